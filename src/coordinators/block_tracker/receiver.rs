//! Receiver-side logging: a receiver writes its block-addition records to the journal itself
//! and hands the logged blocks to the tracker endpoint, which only applies them.
//!
//! ## Why
//! Through [`super::AddBlock`] asks the endpoint thread serializes and appends every addition
//! itself, and one thread then bounds the whole system's additions. SPEC D.3 writes an
//! addition's record outside the tracker's lock precisely so that concurrent receivers can
//! log in parallel (Spark's `addBlock` does the same); [`BlockReceiver`] does that on the bus:
//! the receiver's thread encodes and appends the record (the WAL's append is a short critical
//! section, the sync is shared by group commit), then sends the endpoint a one-way
//! [`LoggedBlocks`] message with the record's LSN. The endpoint applies it to the state
//! machine ([`super::ReceivedBlockTracker::apply_logged_additions`]), with no I/O.
//!
//! ## Ordering with allocations (why recovery still rebuilds the exact state)
//! * The endpoint learns of a block only after its record was appended, and an allocation is
//!   appended by the endpoint after it applied the blocks it lists: an allocation record only
//!   ever lists blocks whose addition records precede it in the log.
//! * An addition can be appended before an allocation and reach the endpoint after it. At
//!   runtime the block then stays unallocated; recovery replays additions in log order and an
//!   allocation removes exactly the blocks it lists (SPEC D.4), so the block stays unallocated
//!   after recovery too.
//! * Hand-overs of concurrent receivers can arrive out of log order; the tracker queues blocks
//!   by log position (LSN, index in the record), so its queues are always those a replay
//!   builds.
//!
//! ## What an acknowledgement means
//! [`BlockReceiver::add_block`] returns an [`AddReceipt`] at once; the receipt resolves to
//! `true` once the record's LSN is durable (synced) and the blocks were handed to the
//! endpoint; never before the sync. A receiver may keep many receipts in flight (pipelining);
//! [`BlockReceiver::add_blocks`] logs several blocks in one record. The endpoint applies the
//! blocks when it reaches the message: a later ask from the same thread sees them (per-sender
//! FIFO); another thread's allocation may run first, and the blocks then go to a later batch.
//! A crash after the acknowledgement cannot lose them: they are in the durable log and
//! recovery queues them.
//!
//! ## Combining (Nagle's rule)
//! A receiver that adds one block at a time while its previous record is still being synced
//! gains nothing from logging each block at once: none of them can be acknowledged before the
//! next sync. So [`BlockReceiver::add_block`] logs at once only when the receiver has nothing
//! in flight (its last record is durable: a lone addition pays no delay); otherwise the block
//! joins the receiver's pending batch, logged as one record (one frame, one hand-over, one
//! apply on the endpoint) when the batch holds [`COMBINE_MAX_BLOCKS`] blocks, before a block
//! that would take the batch's metadata and the most its blocks' fixed parts take past the
//! longest metadata a block may carry (so that blocks each within that limit never make a
//! record the log refuses, whatever the segment size), when a receipt
//! of the batch is waited on, polled or dropped, on [`BlockReceiver::flush`], on
//! [`BlockReceiver::add_blocks`] (which keeps the receiver's order), or when the receiver is
//! dropped. Spark's driver WAL batches concurrent `addBlock` writes the same way
//! (`BatchedWriteAheadLog`). The pending batch keeps one vector per stream (a thread may add
//! blocks of several streams) and its record holds them one after the other: the tracker
//! then queues each vector as it is, where a record of interleaved streams had to be split
//! on the tracker's thread, which every receiver shares. The order of each stream's blocks is
//! the order they were added, the only order the tracker's queues keep (a replay of the
//! record queues them the same way).
//!
//! Acknowledgements are unchanged: a receipt is `true` only once the record holding its block
//! is durable. What changes is when a pending block reaches the endpoint: a query from the
//! receiver's own thread sees it once it was flushed (a receipt resolved, or `flush`).
//!
//! A flush hands the batch over from the thread that flushes. Resolve a receiver's receipts on
//! the thread that adds its blocks to keep its blocks' order across batches: a receipt resolved
//! (waited on, polled or dropped) on another thread hands its batch over from that thread, whose
//! messages the bus does not order with the adding thread's (per-sender FIFO only), so an
//! allocation from a third thread may take the batch's blocks while an earlier hand-over of the
//! same receiver is still on its way (that block then goes to a later batch). Nothing is lost
//! or repeated, and a replay rebuilds the same state (the allocation lists what it took).
//!
//! `false` means not logged, with SPEC D.5's caveat: a record appended and then not confirmed
//! (a timeout, a WAL failure after the write, an endpoint that stopped before the hand-over)
//! may still be durable, and a later recovery shows the block. Two cases show it without a
//! restart:
//! * a receipt whose wait times out (the sync took longer than the write timeout but did not
//!   fail) answers `false`, yet its blocks were handed over and stay queued; they are allocated
//!   like any other once durable, so a receiver that retries them adds them twice (the
//!   at-least-once behaviour consumers must tolerate anyway);
//! * a hand-over that could not be sent (the endpoint's inbox stayed full for the write
//!   timeout) answers `false` and the blocks are not queued, but their record may become
//!   durable: if the WAL later fails, the endpoint rolls back to the durable prefix, which
//!   holds them, so a retried block is then queued twice.
//!
//! Otherwise a WAL failure rolls the endpoint back to the durable prefix.

use std::{
    sync::{Arc, Mutex, MutexGuard, OnceLock},
    time::Duration,
};

use smallvec::SmallVec;

use super::{
    limit::{batch_bytes, BlockSizeLimit},
    recycle::BlockVecPool,
    BlockAdditionEvent, BlockAdditionsEvent, BlockLog, BlockLogError, BlockTrackerEndpoint,
    BlockTrackerMessage, ReceivedBlockInfo, StreamId, TrackerEvent,
};
use crate::{
    clock::Clock,
    error::{AskError, SendError},
    runtime::EndpointRef,
    wal::{Lsn, WalError},
};

/// Blocks a [`BlockReceiver`] logged, on their way to the endpoint. Only a receiver builds
/// one: the LSN must be the one the record really got.
#[derive(Debug)]
pub struct LoggedBlocks {
    pub(super) lsn: Lsn,
    pub(super) blocks: LoggedPayload,
}

/// One block or several. The single block is held inline: the endpoint's inbox slots hold an
/// `AddBlock` request's block inline anyway, so this costs no slot space and saves an
/// allocation per addition.
#[derive(Debug)]
pub(super) enum LoggedPayload {
    One(ReceivedBlockInfo),
    /// An [`BlockReceiver::add_blocks`] list, streams mixed.
    Many(Vec<ReceivedBlockInfo>),
    /// A combined batch, kept by stream: each vector holds blocks of its stream, in the order
    /// they were added (the record holds the vectors one after the other).
    ByStream(StreamGroups),
}

impl LoggedPayload {
    fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Many(blocks) => blocks.len(),
            Self::ByStream(groups) => groups.iter().map(|(_, blocks)| blocks.len()).sum(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A receiver's pending blocks, one vector per stream (module doc, "Combining").
pub(super) type StreamGroups = SmallVec<[(StreamId, Vec<ReceivedBlockInfo>); 2]>;

impl LoggedBlocks {
    /// The LSN of the blocks' record (`Lsn::ZERO` when the WAL is disabled).
    pub fn lsn(&self) -> Lsn {
        self.lsn
    }

    /// The number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether there are no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A receiver's handle on a [`BlockTrackerEndpoint`]: logs additions on the calling thread
/// (module doc). Cheap to clone; each receiver thread may hold its own.
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use coordbus::Bus;
/// use coordbus::clock::SystemClock;
/// use coordbus::coordinators::block_tracker::*;
///
/// let dir = tempfile::tempdir()?;
/// let config = BlockTrackerConfig::new([StreamId(0)]).checkpoint_dir(dir.path());
/// let tracker = ReceivedBlockTracker::open(config, Arc::new(SystemClock))?;
/// let bus = Bus::builder().build()?;
/// let endpoint = bus.register("ReceivedBlockTracker", BlockTrackerEndpoint::new(tracker))?;
/// let receiver = BlockReceiver::connect(&endpoint)?;
/// let blocks: Vec<_> = (0..3)
///     .map(|unique_id| {
///         let block_id = StreamBlockId { stream: StreamId(0), unique_id };
///         ReceivedBlockInfo::new(
///             StreamId(0), None, None, BlockStoreResult::BlockManager { block_id })
///     })
///     .collect::<Result<_, _>>()?;
/// let first = receiver.add_block(blocks[0].clone());      // returns at once
/// let rest = receiver.add_blocks(blocks[1..].to_vec());   // one record for both
/// assert!(first.wait() && rest.wait());                   // true: durable
/// assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(0))).wait()?, blocks);
/// endpoint.ask(StopTracker).wait()?;
/// bus.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BlockReceiver {
    endpoint: EndpointRef<BlockTrackerEndpoint>,
    /// The tracker's journal (`None`: WAL disabled).
    log: Option<Arc<dyn BlockLog>>,
    clock: Arc<dyn Clock>,
    /// How long a hand-over waits for room in the inbox and a receipt for durability.
    write_timeout: Duration,
    /// Blocks waiting to be logged together (module doc, "Combining"). Each clone has its
    /// own; the lock is only contended by receipts resolved on other threads.
    pending: Mutex<PendingBatch>,
    /// Where batch vectors come from (module `recycle`).
    recycled: Arc<BlockVecPool>,
    /// Blocks too large to be allocated are refused (module `limit`).
    block_size_limit: BlockSizeLimit,
}

/// Most blocks a pending batch holds before it is logged.
pub const COMBINE_MAX_BLOCKS: usize = 256;

/// A receiver's pending batch.
#[derive(Debug, Default)]
struct PendingBatch {
    /// The blocks by stream, so that the tracker queues each vector as it is (a record of
    /// mixed streams would be split there, on the one thread all receivers share).
    groups: StreamGroups,
    /// Blocks over all groups.
    blocks: usize,
    /// What the blocks count for in the record (`limit::batch_bytes`).
    record_bytes: usize,
    /// Shared with the receipts of the blocks in `groups`.
    outcome: Arc<BatchOutcome>,
    /// The LSN of the receiver's last record (`Lsn::ZERO`: none yet).
    last_lsn: Lsn,
}

impl PendingBatch {
    /// Adds `info` to its stream's vector (one from `pool` for a stream new to the batch:
    /// sized once per batch, and recycled by the tracker).
    #[inline]
    fn push(&mut self, info: ReceivedBlockInfo, pool: &BlockVecPool) {
        let stream = info.stream_id();
        self.record_bytes += batch_bytes(&info);
        match self.groups.iter_mut().find(|(known, _)| *known == stream) {
            Some((_, blocks)) => blocks.push(info),
            None => {
                let mut blocks = pool.take();
                blocks.push(info);
                self.groups.push((stream, blocks));
            }
        }
        self.blocks += 1;
    }
}

/// What happened to a batch once it was flushed: `Some(lsn)` logged in record `lsn` and
/// handed over, `None` not logged.
#[derive(Debug, Default)]
struct BatchOutcome(OnceLock<Option<Lsn>>);

impl Clone for BlockReceiver {
    /// A handle on the same tracker with a pending batch of its own.
    fn clone(&self) -> Self {
        Self::new(
            self.endpoint.clone(),
            self.log.clone(),
            Arc::clone(&self.clock),
            self.write_timeout,
            Arc::clone(&self.recycled),
            self.block_size_limit,
        )
    }
}

impl Drop for BlockReceiver {
    /// Logs what is still pending (receipts dropped unresolved already did).
    fn drop(&mut self) {
        self.flush();
    }
}

impl std::fmt::Debug for BlockReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockReceiver")
            .field("endpoint", &self.endpoint)
            .field("wal_enabled", &self.log.is_some())
            .field("write_timeout", &self.write_timeout)
            .field("pending_blocks", &self.lock_pending().blocks)
            .finish_non_exhaustive()
    }
}

impl BlockReceiver {
    pub(super) fn new(
        endpoint: EndpointRef<BlockTrackerEndpoint>,
        log: Option<Arc<dyn BlockLog>>,
        clock: Arc<dyn Clock>,
        write_timeout: Duration,
        recycled: Arc<BlockVecPool>,
        block_size_limit: BlockSizeLimit,
    ) -> Self {
        let pending = Mutex::new(PendingBatch::default());
        Self { endpoint, log, clock, write_timeout, pending, recycled, block_size_limit }
    }

    fn lock_pending(&self) -> MutexGuard<'_, PendingBatch> {
        // The batch is plain data; a panic elsewhere leaves it consistent.
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Asks the endpoint for a receiver handle (the same as asking
    /// [`super::ConnectReceiver`]).
    ///
    /// # Errors
    /// The ask's error (the endpoint stopped, a timeout).
    pub fn connect(endpoint: &EndpointRef<BlockTrackerEndpoint>) -> Result<Self, AskError> {
        endpoint.ask(super::ConnectReceiver).wait()
    }

    /// Adds `info`: logs it in a record of its own and hands it to the endpoint if this
    /// receiver has nothing in flight, else adds it to the pending batch (module doc,
    /// "Combining"). The receipt says once the record holding it is durable. Never waits for
    /// a sync; it waits only while the WAL's staging buffer or the endpoint's inbox is full
    /// (back-pressure: at most the journal's append timeout for each record this call logs,
    /// the pending batch's and its own, and the tracker's `write_timeout` for the inbox).
    /// A block whose metadata is too long to be allocated is answered `false` at once
    /// ([`super::ReceivedBlockTracker::block_metadata_bytes_max`]).
    #[inline]
    pub fn add_block(&self, info: ReceivedBlockInfo) -> AddReceipt<'_> {
        if self.block_size_limit.refuses(&info) {
            return AddReceipt { receiver: self, outcome: Outcome::Done(false), blocks: 1 };
        }
        let mut pending = self.lock_pending();
        let nothing_in_flight = pending.blocks == 0
            && self.log.as_ref().is_none_or(|log| log.durable_lsn() >= pending.last_lsn);
        if nothing_in_flight {
            let outcome = self.log_and_hand_over(LoggedPayload::One(info), &mut pending);
            return AddReceipt { receiver: self, outcome, blocks: 1 };
        }
        if !self.block_size_limit.combines(pending.record_bytes, batch_bytes(&info)) {
            self.flush_locked(&mut pending);
        }
        pending.push(info, &self.recycled);
        let batch = Arc::clone(&pending.outcome);
        if pending.blocks >= COMBINE_MAX_BLOCKS {
            self.flush_locked(&mut pending);
        }
        AddReceipt { receiver: self, outcome: Outcome::Batched(batch), blocks: 1 }
    }

    /// Logs the additions of `infos` in one record (one LSN, one frame: what makes many
    /// additions per second cheap) and hands them to the endpoint in order, after the pending
    /// batch. All or nothing: the receipt resolves to one answer for every block (`true` at
    /// once for no block; `false` at once, nothing logged, if one block's metadata is too long
    /// to be allocated: [`super::ReceivedBlockTracker::block_metadata_bytes_max`]; `false`
    /// also if the log refuses the record, e.g. blocks each within that limit but together
    /// too large for one record).
    pub fn add_blocks(&self, infos: Vec<ReceivedBlockInfo>) -> AddReceipt<'_> {
        let blocks = infos.len();
        if self.block_size_limit.refuses_any(&infos) {
            return AddReceipt { receiver: self, outcome: Outcome::Done(false), blocks };
        }
        let mut pending = self.lock_pending();
        self.flush_locked(&mut pending);
        let outcome = self.log_and_hand_over(LoggedPayload::Many(infos), &mut pending);
        AddReceipt { receiver: self, outcome, blocks }
    }

    /// Logs the pending batch now (module doc, "Combining"): its blocks reach the endpoint
    /// before anything this thread sends it afterwards. Their receipts say how it went.
    pub fn flush(&self) {
        self.flush_locked(&mut self.lock_pending());
    }

    /// Logs the pending batch if `batch` is still it.
    fn flush_batch(&self, batch: &Arc<BatchOutcome>) {
        let mut pending = self.lock_pending();
        if Arc::ptr_eq(&pending.outcome, batch) {
            self.flush_locked(&mut pending);
        }
    }

    fn flush_locked(&self, pending: &mut PendingBatch) {
        if pending.blocks == 0 {
            return;
        }
        let mut groups = std::mem::take(&mut pending.groups);
        let blocks = std::mem::replace(&mut pending.blocks, 0);
        pending.record_bytes = 0;
        let batch = std::mem::take(&mut pending.outcome);
        let payload = if blocks == 1 {
            let (_, mut vector) = groups.pop().expect("one block");
            let info = vector.pop().expect("one block");
            self.recycled.give_back(vector);
            LoggedPayload::One(info)
        } else {
            LoggedPayload::ByStream(groups)
        };
        let logged = match self.log_and_hand_over(payload, pending) {
            Outcome::Pending(lsn) => Some(lsn),
            Outcome::Done(true) => Some(Lsn::ZERO),
            Outcome::Done(false) => None,
            Outcome::Batched(_) => unreachable!("log_and_hand_over answers for its record"),
        };
        let _ = batch.0.set(logged);
    }

    /// [`Self::add_block`] and wait for its receipt.
    pub fn add_block_and_wait(&self, info: ReceivedBlockInfo) -> bool {
        self.add_block(info).wait()
    }

    /// Logs `payload` as one record and hands its blocks to the endpoint (the caller holds
    /// the pending batch's lock, so this receiver's records keep their order).
    fn log_and_hand_over(&self, payload: LoggedPayload, pending: &mut PendingBatch) -> Outcome {
        if payload.is_empty() {
            // Nothing to log or hand over.
            return Outcome::Done(true);
        }
        let failed = Outcome::Done(false);
        let (lsn, payload) = match &self.log {
            None => (Lsn::ZERO, payload),
            Some(log) => match append_payload(log.as_ref(), payload, self.clock.now_ms()) {
                (Ok(lsn), payload) => (lsn, payload),
                (Err(error), payload) => {
                    let blocks = payload.len();
                    match error {
                        BlockLogError::Wal(error) => tracing::warn!(%error, blocks,
                            "failed to write block additions to the write-ahead log"),
                        error => tracing::warn!(%error, blocks, "adding blocks failed"),
                    }
                    return failed;
                }
            },
        };
        let message = BlockTrackerMessage::Logged(LoggedBlocks { lsn, blocks: payload });
        // Try first: the bounded send reads the clock for its deadline.
        let sent = match self.endpoint.try_send(message) {
            Err(SendError::Full { message, .. }) => {
                self.endpoint.send_timeout(message, self.write_timeout)
            }
            outcome => outcome,
        };
        if let Err(error) = sent {
            tracing::warn!(%lsn, %error,
                "logged blocks could not be handed to the tracker; a recovery may show them");
            return failed;
        }
        if self.log.is_some() {
            pending.last_lsn = lsn;
            Outcome::Pending(lsn)
        } else {
            Outcome::Done(true)
        }
    }
}

/// Appends the record of `payload` to `log`; gives the payload back for the hand-over.
fn append_payload(
    log: &dyn BlockLog,
    payload: LoggedPayload,
    time_ms: i64,
) -> (Result<Lsn, BlockLogError>, LoggedPayload) {
    let event = match payload {
        LoggedPayload::ByStream(groups) => {
            let appended = {
                let lists: SmallVec<[&[ReceivedBlockInfo]; 2]> =
                    groups.iter().map(|(_, blocks)| blocks.as_slice()).collect();
                log.append_additions(&lists, time_ms)
            };
            return (appended, LoggedPayload::ByStream(groups));
        }
        LoggedPayload::One(info) => TrackerEvent::BlockAddition(BlockAdditionEvent { info }),
        LoggedPayload::Many(infos) => TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos }),
    };
    let appended = log.append(&event, time_ms);
    let payload = match event {
        TrackerEvent::BlockAddition(BlockAdditionEvent { info }) => LoggedPayload::One(info),
        TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos }) => LoggedPayload::Many(infos),
        _ => unreachable!("built above"),
    };
    (appended, payload)
}

/// Where an addition stands.
#[derive(Debug, Clone)]
enum Outcome {
    /// Known: logged (and handed over) or not.
    Done(bool),
    /// Handed over; logged once this LSN is durable.
    Pending(Lsn),
    /// In a batch that is pending or was flushed (its outcome then says how).
    Batched(Arc<BatchOutcome>),
}

/// The answer to a [`BlockReceiver`] addition, to wait on like a `Reply` (module doc: what
/// `true` means). Borrows its receiver so that keeping thousands in flight costs no reference
/// counting.
#[derive(Debug)]
#[must_use = "an addition is acknowledged only through its receipt"]
pub struct AddReceipt<'r> {
    receiver: &'r BlockReceiver,
    outcome: Outcome,
    blocks: usize,
}

impl AddReceipt<'_> {
    /// The LSN of the record, if it was logged and handed over (for a combined block: once
    /// its batch was flushed).
    pub fn lsn(&self) -> Option<Lsn> {
        match &self.outcome {
            Outcome::Pending(lsn) => Some(*lsn),
            Outcome::Done(_) => None,
            Outcome::Batched(batch) => batch.0.get().copied().flatten(),
        }
    }

    /// The number of blocks the addition carried.
    pub fn block_count(&self) -> usize {
        self.blocks
    }

    /// Where the addition stands, flushing its batch first if it is still pending.
    #[inline]
    fn settled(&self) -> Outcome {
        match &self.outcome {
            Outcome::Batched(batch) => {
                if batch.0.get().is_none() {
                    self.receiver.flush_batch(batch);
                }
                match batch.0.get() {
                    Some(Some(lsn)) if self.receiver.log.is_some() => Outcome::Pending(*lsn),
                    Some(Some(_)) => Outcome::Done(true),
                    Some(None) | None => Outcome::Done(false),
                }
            }
            outcome => outcome.clone(),
        }
    }

    /// The answer if it is known without waiting for a sync: `Some(true)` once durable,
    /// `Some(false)` if not logged or the log failed, `None` while the sync is pending.
    /// Flushes a pending batch holding the block (which waits for room in the WAL's staging
    /// buffer if it is full: at most the journal's append timeout).
    pub fn try_result(&self) -> Option<bool> {
        match self.settled() {
            Outcome::Done(logged) => Some(logged),
            Outcome::Pending(lsn) => {
                let log = self.receiver.log.as_ref().expect("pending only with a log");
                if log.durable_lsn() >= lsn {
                    return Some(true);
                }
                match log.wait_durable(lsn, Duration::ZERO) {
                    Ok(()) => Some(true),
                    Err(WalError::Timeout { .. }) => None,
                    Err(_) => Some(false),
                }
            }
            Outcome::Batched(_) => unreachable!("settled"),
        }
    }

    /// Waits until the answer is known, at most the tracker's write timeout (Spark's batching
    /// timeout): `false` if it was not logged, the log failed, or durability was not confirmed
    /// in time (then it may still become durable: SPEC D.5).
    #[inline]
    pub fn wait(self) -> bool {
        let timeout = self.receiver.write_timeout;
        self.wait_timeout(timeout)
    }

    /// [`Self::wait`] with an explicit bound on the wait for durability (flushing a pending
    /// batch holding the block may first wait for room: at most the journal's append
    /// timeout).
    #[inline]
    pub fn wait_timeout(self, timeout: Duration) -> bool {
        match self.settled() {
            Outcome::Done(logged) => logged,
            Outcome::Pending(lsn) => {
                let log = self.receiver.log.as_ref().expect("pending only with a log");
                match log.wait_durable(lsn, timeout) {
                    Ok(()) => true,
                    Err(error) => {
                        tracing::warn!(
                            %lsn,
                            %error,
                            "a block addition was not confirmed durable; it may still be \
                             (SPEC D.5)"
                        );
                        false
                    }
                }
            }
            Outcome::Batched(_) => unreachable!("settled"),
        }
    }
}

impl Drop for AddReceipt<'_> {
    /// A receipt dropped unresolved still gets its block logged: its batch is flushed.
    #[inline]
    fn drop(&mut self) {
        if let Outcome::Batched(batch) = &self.outcome {
            if batch.0.get().is_none() {
                self.receiver.flush_batch(batch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinators::block_tracker::tests::info;

    #[test]
    fn a_pending_batch_keeps_its_blocks_by_stream_in_the_order_added() {
        let pool = BlockVecPool::default();
        let mut pending = PendingBatch::default();
        for (stream, id) in [(2, 1), (1, 2), (2, 3), (3, 4), (1, 5), (2, 6)] {
            pending.push(info(stream, id), &pool);
        }
        assert_eq!(pending.blocks, 6);
        let groups: Vec<Vec<u64>> = pending
            .groups
            .iter()
            .map(|(_, blocks)| blocks.iter().map(|block| block.block_id().unique_id).collect())
            .collect();
        assert_eq!(groups, [vec![1, 3, 6], vec![2, 5], vec![4]]);
        let payload = LoggedPayload::ByStream(pending.groups);
        assert_eq!(payload.len(), 6);
    }
}
