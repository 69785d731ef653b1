//! The tracker hosted on the bus: receivers ask `AddBlock` or log through a `BlockReceiver`,
//! the batch side asks for allocations, blocks of batches and cleanups (SPEC 0.5).
//!
//! ## Durable acknowledgements without blocking
//! A handler appends the event to the WAL (which returns at once, unless its staging buffer is
//! full: back-pressure), applies it to the tracker and keeps the request's [`Replier`] in a
//! queue ordered by LSN. It does not wait for syncs (two requests excepted, below):
//! when the WAL reports an LSN durable, a callback (on the WAL's sync thread) sends the
//! endpoint a [`BlockTrackerMessage::Durable`] wake-up, and the endpoint answers every queued
//! request whose LSN is now durable. One callback is armed at a time, so a whole group commit
//! costs one callback and one wake-up however many receivers it acknowledges. The endpoint
//! also answers whatever became durable at the start of every message it handles, so a full
//! inbox (where the wake-up may not fit) never delays an answer.
//!
//! ## What a reply means
//! * `AddBlock` answers `true` only once the addition's record is durable; `false` if the WAL
//!   refused or failed it (then the block is not queued), or at once if the block's metadata
//!   is too long to be allocated ([`ReceivedBlockTracker::block_metadata_bytes_max`]). A slow
//!   sync is not a failure here: the answer waits for it (up to the ask's own timeout). SPEC
//!   D.5 counts a wait past the batching timeout as a failed write; an asker that must answer
//!   by then waits with `wait_timeout(write_timeout)` and takes the timeout for `false`, as
//!   [`BlockReceiver`]'s receipts do. The block stays queued either way, and is allocated
//!   once durable (D.5: a write reported failed may still be durable).
//!   `AddBlocks` does the same for several blocks (one record each) and answers once the last
//!   is durable, per block; after a block the WAL refused, the rest of the request is refused
//!   without being tried (a block too large is refused alone). Across requests too: once an
//!   append timed out for room (a disk that stopped taking writes), every append the endpoint
//!   would make is refused untried until the log makes something more durable, so that N
//!   separate requests do not hold the endpoint thread N append timeouts long.
//! * `AllocateBlocksToBatch` and `CleanupOldBatches` answer once their event is durable (a
//!   cleanup also deletes the old WAL files first). A cleanup with `wait` deletes them on the
//!   endpoint thread and syncs the directory before answering, so requests behind it wait
//!   that long.
//! * `StopTracker` waits on the endpoint thread, at most 5 s, for the queued events to become
//!   durable, answers them, then closes the WAL (at most 30 s more:
//!   [`WAL_CLOSE_TIMEOUT`](super::WAL_CLOSE_TIMEOUT)).
//! * Queries (`GetBlocksOfBatch`, ...) are answered with the state at the time they were
//!   handled, but only once every event applied before them is durable: no answer ever
//!   exposes a change that a crash could still undo. While [`MAX_PENDING_QUERIES`] queries
//!   wait for durability (a stalled disk), or their answers hold
//!   [`DEFAULT_ANSWER_BYTE_LIMIT`] bytes (configurable), a further query fails at once with
//!   [`BlockTrackerError::DurabilityBacklog`] or [`BlockTrackerError::AnswerBacklog`] instead
//!   of queueing its answer.
//!
//! ## Two ways to add blocks
//! * `AddBlock`/`AddBlocks` asks: the endpoint thread serializes and appends each addition
//!   itself (one record per block) and answers once it is durable.
//! * A [`BlockReceiver`] (asked for with [`ConnectReceiver`]): the receiver's own thread
//!   appends the record and sends the logged blocks as a one-way
//!   [`BlockTrackerMessage::Logged`]; the endpoint only applies them (no I/O) and remembers the
//!   largest such LSN (`applied_lsn`). The receiver learns durability from the WAL directly
//!   (the `receiver` module doc has the ordering argument). This is what scales: the endpoint
//!   thread no longer serializes or appends additions, and a receiver may log many blocks in
//!   one record.
//!
//! ## Choice: apply at append time, acknowledge at durability
//! The state is changed when the event is appended (or, for a receiver's record, when its
//! hand-over arrives), and the queues are observed in log order, so the in-memory state is
//! always the replay of the journal up to the records applied: after a crash recovery
//! rebuilds exactly what any acknowledged answer described. An allocation may take a block
//! whose addition is not yet durable: its own record has a later LSN, so it is durable only
//! if the addition is, and it is acknowledged only then. Queries wait for every record the
//! state reflects (`applied_lsn` and the waiting requests). Per sender, requests keep their
//! order: a receiver's additions are acknowledged in the order it sent them, and a query
//! sees every earlier request and hand-over of the same sender.
//!
//! If the WAL fails, every waiting request fails (`AddBlock` answers `false`, allocations and
//! cleanups answer normally as SPEC D.5 wants, queries fail) and the state is rebuilt from the
//! journal's durable prefix; receivers' hand-overs are dropped from then on (the rebuilt
//! state holds every durable record, and no later one can become durable). A durability
//! callback watches `applied_lsn` too, so a failure is noticed even when no request waits. A
//! failed write may still be durable (module doc of the tracker). If the durable prefix
//! cannot be read back either, the state is left empty and every query fails with
//! [`BlockTrackerError::StateLost`]: no answer comes from a half-replayed state. A
//! `StopTracker` whose wait ends with requests still waiting fails them without a rebuild
//! (with the wait's [`WalError::Timeout`], or the WAL's failure), and the queries still
//! queued behind it fail with [`BlockTrackerError::StateLost`] (the state holds what never
//! became durable). What is not durable once the stop's wait ended is treated as never
//! becoming so (the close may still sync it, or a close that timed out may sync it in the
//! background: D.5's "failed but maybe durable"): a receiver's hand-over handled after the
//! stop that is not durable (its record appended before a close that timed out) fails what
//! waits and refuses what follows in the same way.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, OnceLock,
    },
    time::Duration,
};

use super::{
    receiver::{LoggedBlocks, LoggedPayload},
    AllocatedBlocks, BatchTime, BlockReceiver, BlockTrackerError, Logged, ReceivedBlockInfo,
    ReceivedBlockTracker, StreamId,
};
use crate::{
    error::HandlerError,
    runtime::{Ask, Context, Endpoint, EndpointRef, Replier},
    wal::{Lsn, WalError},
};

/// Longest `Stop` (or stopping the endpoint) waits for queued events to become durable.
const STOP_DURABILITY_TIMEOUT: Duration = Duration::from_secs(5);

/// Most queries waiting for durability (their askers still waiting) before the endpoint
/// refuses more ([`BlockTrackerError::DurabilityBacklog`]). Each waiting query holds its
/// answer (a copy of a queue or a batch), so a stalled disk must not let askers queue them
/// without bound; additions and allocations are bounded by the WAL's staging back-pressure
/// instead. The answers of allocations and cleanups that logged nothing (a stale batch time,
/// a failed write) wait the same way, count here too, and past the bound are refused as
/// queries are (they report no state, so nothing is lost; repeating them must not pile up).
pub const MAX_PENDING_QUERIES: usize = 4096;

/// A refused query's scan for abandoned ones covers the next `pending / RESCAN_DIVISOR`
/// refusals ([`BlockTrackerEndpoint::admit_within_bounds`]).
const RESCAN_DIVISOR: usize = 16;

/// Most bytes the answers of waiting queries may hold, by default, before the endpoint
/// refuses more queries ([`BlockTrackerError::AnswerBacklog`];
/// [`BlockTrackerEndpoint::with_answer_byte_limit`]). The query count alone does not bound
/// memory: one answer can copy a queue of millions of blocks. A query is let in while the
/// answers held are below the limit, so they hold at most the limit plus one answer.
pub const DEFAULT_ANSWER_BYTE_LIMIT: usize = 64 << 20;

/// One-way messages of [`BlockTrackerEndpoint`].
#[derive(Debug)]
#[non_exhaustive]
pub enum BlockTrackerMessage {
    /// The WAL made more events durable: answer the requests waiting for them. Sent by the
    /// endpoint's own durability callback; sending it from elsewhere is harmless.
    Durable,
    /// Blocks a [`BlockReceiver`] logged: queue them (no I/O on the endpoint's thread).
    Logged(LoggedBlocks),
}

/// Requests of [`BlockTrackerEndpoint`]; build them with the request structs ([`AddBlock`],
/// ...) through `EndpointRef::ask`.
#[derive(Debug)]
#[non_exhaustive]
pub enum BlockTrackerRequest {
    /// See [`AddBlock`].
    AddBlock(ReceivedBlockInfo, Replier<bool>),
    /// See [`AddBlocks`].
    AddBlocks(Vec<ReceivedBlockInfo>, Replier<Vec<bool>>),
    /// See [`AllocateBlocksToBatch`].
    AllocateBlocksToBatch(BatchTime, Replier<()>),
    /// See [`GetBlocksOfBatch`].
    GetBlocksOfBatch(BatchTime, Replier<AllocatedBlocks>),
    /// See [`GetBlocksOfBatchAndStream`].
    GetBlocksOfBatchAndStream(BatchTime, StreamId, Replier<Vec<ReceivedBlockInfo>>),
    /// See [`HasUnallocatedBlocks`].
    HasUnallocatedBlocks(Replier<bool>),
    /// See [`GetUnallocatedBlocks`].
    GetUnallocatedBlocks(StreamId, Replier<Vec<ReceivedBlockInfo>>),
    /// See [`GetUnconfiguredStreams`].
    GetUnconfiguredStreams(Replier<Vec<StreamId>>),
    /// See [`CleanupOldBatches`].
    CleanupOldBatches(BatchTime, bool, Replier<()>),
    /// See [`StopTracker`].
    Stop(Replier<()>),
    /// See [`ConnectReceiver`].
    ConnectReceiver(Replier<BlockReceiver>),
}

/// Adds a block; answers `true` once its record is durable, `false` if it was not written.
#[derive(Debug, Clone)]
pub struct AddBlock(pub ReceivedBlockInfo);

/// Adds several blocks in order (one journal record each, as that many [`AddBlock`]s would);
/// answers, once the last of them is durable, whether each was logged. Saves a receiver that
/// has several blocks ready one ask per block. Once one block's write is refused the blocks
/// after it are refused without being tried (on a stalled disk each try would wait out the
/// journal's append timeout; separate asks are refused untried only after an append timed
/// out for room: module doc).
#[derive(Debug, Clone)]
pub struct AddBlocks(pub Vec<ReceivedBlockInfo>);

/// Allocates the unallocated blocks to a batch; answers once the allocation is durable (or
/// was a no-op: a time not newer than the last, or a failed write, SPEC D.3).
/// Fails if the log step raised, or, for a no-op that must wait for earlier events while
/// [`MAX_PENDING_QUERIES`] answers wait already, with [`BlockTrackerError::DurabilityBacklog`]
/// (or [`BlockTrackerError::AnswerBacklog`]).
#[derive(Debug, Clone, Copy)]
pub struct AllocateBlocksToBatch(pub BatchTime);

/// The blocks of a batch (empty if none).
#[derive(Debug, Clone, Copy)]
pub struct GetBlocksOfBatch(pub BatchTime);

/// The blocks of one stream in a batch (empty if none).
#[derive(Debug, Clone, Copy)]
pub struct GetBlocksOfBatchAndStream(pub BatchTime, pub StreamId);

/// Whether any block is unallocated.
#[derive(Debug, Clone, Copy)]
pub struct HasUnallocatedBlocks;

/// The unallocated blocks of a stream.
#[derive(Debug, Clone, Copy)]
pub struct GetUnallocatedBlocks(pub StreamId);

/// The streams with queued blocks that are missing from the configured stream ids (their
/// blocks are never allocated: [`ReceivedBlockTracker::unconfigured_streams`]).
#[derive(Debug, Clone, Copy)]
pub struct GetUnconfiguredStreams;

/// Forgets batches older than `threshold` and deletes old WAL files (waiting for the deletion
/// if `wait`). Fails with [`BlockTrackerError::ThresholdNotInPast`] unless the threshold is in
/// the past; a cleanup whose record failed answers as a no-op allocation does (see
/// [`AllocateBlocksToBatch`]).
#[derive(Debug, Clone, Copy)]
pub struct CleanupOldBatches {
    /// Batches strictly older are forgotten.
    pub threshold: BatchTime,
    /// Wait until the WAL files are deleted.
    pub wait: bool,
}

/// Waits for queued events to become durable, answers them, closes the WAL and stops the
/// endpoint.
#[derive(Debug, Clone, Copy)]
pub struct StopTracker;

/// A [`BlockReceiver`] for this endpoint: a handle that logs additions on the receiver's own
/// thread (see [`BlockReceiver::connect`]).
#[derive(Debug, Clone, Copy)]
pub struct ConnectReceiver;

macro_rules! ask_impl {
    ($request:ty, $reply:ty, |$value:ident, $replier:ident| $build:expr) => {
        impl Ask<BlockTrackerEndpoint> for $request {
            type Reply = $reply;
            fn into_request(self, $replier: Replier<$reply>) -> BlockTrackerRequest {
                let $value = self;
                $build
            }
        }
    };
}

ask_impl!(AddBlock, bool, |r, p| BlockTrackerRequest::AddBlock(r.0, p));
ask_impl!(AddBlocks, Vec<bool>, |r, p| BlockTrackerRequest::AddBlocks(r.0, p));
ask_impl!(AllocateBlocksToBatch, (), |r, p| BlockTrackerRequest::AllocateBlocksToBatch(r.0, p));
ask_impl!(GetBlocksOfBatch, AllocatedBlocks, |r, p| BlockTrackerRequest::GetBlocksOfBatch(r.0, p));
ask_impl!(GetBlocksOfBatchAndStream, Vec<ReceivedBlockInfo>, |r, p| {
    BlockTrackerRequest::GetBlocksOfBatchAndStream(r.0, r.1, p)
});
ask_impl!(HasUnallocatedBlocks, bool, |_r, p| BlockTrackerRequest::HasUnallocatedBlocks(p));
ask_impl!(GetUnallocatedBlocks, Vec<ReceivedBlockInfo>, |r, p| {
    BlockTrackerRequest::GetUnallocatedBlocks(r.0, p)
});
ask_impl!(GetUnconfiguredStreams, Vec<StreamId>, |_r, p| {
    BlockTrackerRequest::GetUnconfiguredStreams(p)
});
ask_impl!(CleanupOldBatches, (), |r, p| BlockTrackerRequest::CleanupOldBatches(
    r.threshold,
    r.wait,
    p
));
ask_impl!(StopTracker, (), |_r, p| BlockTrackerRequest::Stop(p));
ask_impl!(ConnectReceiver, BlockReceiver, |_r, p| BlockTrackerRequest::ConnectReceiver(p));

/// A request waiting for its LSN to become durable.
enum Pending {
    Add {
        lsn: Lsn,
        replier: Replier<bool>,
    },
    /// `lsns[i]`: the LSN of block i, or `None` if it was not logged; `lsn` is the largest.
    AddMany {
        lsn: Lsn,
        lsns: Vec<Option<Lsn>>,
        replier: Replier<Vec<bool>>,
    },
    Allocate {
        lsn: Lsn,
        replier: Replier<()>,
    },
    Cleanup {
        lsn: Lsn,
        threshold: BatchTime,
        wait: bool,
        replier: Replier<()>,
    },
    Query {
        lsn: Lsn,
        /// What the answer holds ([`HeldBytes`]).
        held_bytes: usize,
        answer: Box<dyn WaitingAnswer>,
    },
}

/// The bytes an answer holds while it waits for durability (its own size and its heap
/// parts), for [`DEFAULT_ANSWER_BYTE_LIMIT`].
trait HeldBytes {
    fn held_bytes(&self) -> usize;
}

impl HeldBytes for () {
    fn held_bytes(&self) -> usize {
        0
    }
}

impl HeldBytes for bool {
    fn held_bytes(&self) -> usize {
        0
    }
}

impl HeldBytes for Vec<StreamId> {
    fn held_bytes(&self) -> usize {
        std::mem::size_of_val(self.as_slice())
    }
}

impl HeldBytes for Vec<ReceivedBlockInfo> {
    fn held_bytes(&self) -> usize {
        std::mem::size_of_val(self.as_slice())
            + self.iter().map(ReceivedBlockInfo::rare_heap_bytes).sum::<usize>()
    }
}

impl HeldBytes for AllocatedBlocks {
    fn held_bytes(&self) -> usize {
        self.streams().iter().map(|stream| stream.blocks.held_bytes()).sum()
    }
}

/// A query's answer waiting for durability, with its replier.
trait WaitingAnswer: Send {
    /// Replies with the answer (`Ok`) or fails the query with the WAL's error.
    fn complete(self: Box<Self>, outcome: Result<(), WalError>);
    /// Whether the asker gave up (its reply handle is gone).
    fn is_abandoned(&self) -> bool;
}

struct Answer<T: Send + 'static> {
    value: T,
    replier: Replier<T>,
}

/// The answer of a request that logged nothing ([`BlockTrackerEndpoint::answer_nothing_logged`]):
/// it reports no state, so it is given even if the WAL fails meanwhile, as the answers of
/// logged allocations and cleanups are (SPEC D.5).
struct NothingLoggedAnswer(Replier<()>);

impl<T: Send + 'static> WaitingAnswer for Answer<T> {
    fn complete(self: Box<Self>, outcome: Result<(), WalError>) {
        match outcome {
            Ok(()) => self.replier.reply(self.value),
            Err(error) => self.replier.fail(BlockTrackerError::Wal(error)),
        }
    }

    fn is_abandoned(&self) -> bool {
        self.replier.is_abandoned()
    }
}

impl WaitingAnswer for NothingLoggedAnswer {
    fn complete(self: Box<Self>, _: Result<(), WalError>) {
        self.0.reply(());
    }

    fn is_abandoned(&self) -> bool {
        self.0.is_abandoned()
    }
}

impl Pending {
    fn lsn(&self) -> Lsn {
        match self {
            Self::Add { lsn, .. }
            | Self::AddMany { lsn, .. }
            | Self::Allocate { lsn, .. }
            | Self::Cleanup { lsn, .. }
            | Self::Query { lsn, .. } => *lsn,
        }
    }
}

/// What the durability callback shares with the endpoint.
#[derive(Default)]
struct Waker {
    /// A callback is registered and has not run yet.
    armed: AtomicBool,
    /// Set (after `failure` is filled) once the WAL reported a failure: the hot path checks
    /// this flag instead of taking the lock.
    failed: AtomicBool,
    /// The first failure the WAL reported.
    failure: Mutex<Option<WalError>>,
    /// Where the wake-up goes (set in `on_start`).
    endpoint: OnceLock<EndpointRef<BlockTrackerEndpoint>>,
}

impl Waker {
    fn failure(&self) -> Option<WalError> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// [`ReceivedBlockTracker`] as a bus endpoint (module doc: when replies are sent).
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
/// let block_id = StreamBlockId { stream: StreamId(0), unique_id: 1 };
/// let info = ReceivedBlockInfo::new(
///     StreamId(0), None, None, BlockStoreResult::BlockManager { block_id })?;
/// assert!(endpoint.ask(AddBlock(info.clone())).wait()?);      // true: durable
/// endpoint.ask(AllocateBlocksToBatch(BatchTime(1))).wait()?;
/// assert_eq!(endpoint.ask(GetBlocksOfBatchAndStream(BatchTime(1), StreamId(0))).wait()?, [info]);
/// endpoint.ask(StopTracker).wait()?;
/// bus.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BlockTrackerEndpoint {
    tracker: ReceivedBlockTracker,
    /// Requests waiting for durability, in LSN order.
    pending: VecDeque<Pending>,
    /// How many of `pending` are queries.
    pending_queries: usize,
    /// The bytes their answers hold.
    pending_answer_bytes: usize,
    /// Most bytes they may hold before further queries are refused.
    answer_byte_limit: usize,
    waker: Arc<Waker>,
    /// The tracker was stopped (the WAL closed).
    stopped: bool,
    /// The largest LSN of the blocks receivers handed over and the endpoint applied: queries
    /// wait for it to be durable, and a durability callback watches it so that a WAL failure
    /// is noticed even when no request waits.
    applied_lsn: Lsn,
    /// The waiting requests were failed (a WAL failure, or a stop that gave up waiting): no
    /// later record can become durable, and the state was rebuilt from the durable prefix
    /// (or is lost), so receivers' hand-overs are dropped from then on.
    requests_failed: bool,
    /// Why the state cannot be trusted (a failed rebuild, a stop before durability): queries
    /// fail with [`BlockTrackerError::StateLost`].
    state_lost: Option<String>,
    /// Refusals left before the next scan for abandoned queries ([`Self::admit_within_bounds`]).
    refusals_before_rescan: usize,
}

impl std::fmt::Debug for BlockTrackerEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockTrackerEndpoint")
            .field("tracker", &self.tracker)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl BlockTrackerEndpoint {
    /// Hosts `tracker` (already recovered, if it was asked to).
    pub fn new(tracker: ReceivedBlockTracker) -> Self {
        Self {
            tracker,
            pending: VecDeque::new(),
            pending_queries: 0,
            pending_answer_bytes: 0,
            answer_byte_limit: DEFAULT_ANSWER_BYTE_LIMIT,
            waker: Arc::default(),
            stopped: false,
            applied_lsn: Lsn::ZERO,
            requests_failed: false,
            state_lost: None,
            refusals_before_rescan: 0,
        }
    }

    /// Refuses queries while the answers waiting for durability hold `limit` bytes or more
    /// (default [`DEFAULT_ANSWER_BYTE_LIMIT`]).
    pub fn with_answer_byte_limit(mut self, limit: usize) -> Self {
        self.answer_byte_limit = limit;
        self
    }

    /// The hosted tracker.
    pub fn tracker(&self) -> &ReceivedBlockTracker {
        &self.tracker
    }

    /// The LSN everything applied so far waits for: the last waiting request's, or the last
    /// handed-over block's if that is later.
    fn awaited_lsn(&self) -> Lsn {
        self.pending.back().map_or(self.applied_lsn, |pending| pending.lsn().max(self.applied_lsn))
    }

    /// Answers every waiting request whose LSN is durable; on a WAL failure fails the rest
    /// and rebuilds the state; otherwise makes sure a callback is armed for the rest.
    fn complete_durable(&mut self) {
        loop {
            let Some(durable) = self.tracker.log().map(|log| log.durable_lsn()) else {
                return;
            };
            let awaited = self.awaited_lsn();
            // Most calls find nothing new durable and no failure: a few loads, no lock.
            if self.pending.front().is_none_or(|front| front.lsn() > durable)
                && (awaited <= durable || self.waker.armed.load(Ordering::Acquire))
                && !self.waker.failed.load(Ordering::Acquire)
            {
                return;
            }
            while self.pending.front().is_some_and(|pending| pending.lsn() <= durable) {
                let pending = self.pending.pop_front().expect("checked");
                self.finish(pending, Ok(()));
            }
            if let Some(error) = self.waker.failure() {
                // The durable LSN stops where the failure found it, but it may have moved
                // since it was read above: answer what became durable meanwhile, as the
                // rebuild keeps it, before failing the rest.
                let durable = self.tracker.log().map_or(durable, |log| log.durable_lsn());
                while self.pending.front().is_some_and(|pending| pending.lsn() <= durable) {
                    let pending = self.pending.pop_front().expect("checked");
                    self.finish(pending, Ok(()));
                }
                if awaited > durable || !self.pending.is_empty() {
                    self.fail_pending(error);
                }
                return;
            }
            if awaited <= durable || self.waker.armed.swap(true, Ordering::AcqRel) {
                return;
            }
            let Some(log) = self.tracker.log() else {
                return;
            };
            let waker = Arc::clone(&self.waker);
            log.notify_when_durable(
                awaited,
                Box::new(move |result| {
                    if let Err(error) = result {
                        let mut failure =
                            waker.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        failure.get_or_insert(error);
                        waker.failed.store(true, Ordering::Release);
                    }
                    waker.armed.store(false, Ordering::Release);
                    if let Some(endpoint) = waker.endpoint.get() {
                        // Full: the endpoint has messages to handle and checks durability
                        // before each. Stopped: `on_stop` answers what is left.
                        let _ = endpoint.try_send(BlockTrackerMessage::Durable);
                    }
                }),
            );
            // If the callback already ran (the LSN became durable meanwhile), loop to answer
            // at once instead of waiting for the wake-up.
            if self.waker.armed.load(Ordering::Acquire) {
                return;
            }
        }
    }

    /// The WAL failed: fail every waiting request and fall back to the durable prefix. If
    /// that cannot be read back, no state is left to answer from: queries fail from then on
    /// ([`BlockTrackerError::StateLost`]).
    fn fail_pending(&mut self, error: WalError) {
        self.fail_requests(error);
        match self.tracker.rebuild_from_log() {
            Ok(events) => {
                tracing::info!(events, "block tracker state rebuilt from the durable log")
            }
            Err(error) => {
                tracing::error!(%error,
                    "rebuilding the block tracker state failed; every query fails from now on");
                self.state_lost = Some(format!(
                    "its write-ahead log failed, and rebuilding the state from the log's \
                     durable prefix failed: {error}"
                ));
            }
        }
    }

    /// Fails every waiting request with `error`; receivers' hand-overs are dropped from then
    /// on (no later record can become durable).
    fn fail_requests(&mut self, error: WalError) {
        let pending = std::mem::take(&mut self.pending);
        // Zeroed first: a `finish` below that panics must not leave the counts too high.
        self.pending_queries = 0;
        self.pending_answer_bytes = 0;
        self.requests_failed = true;
        self.applied_lsn = Lsn::ZERO;
        tracing::warn!(%error, requests = pending.len(),
            "failing the block tracker's requests waiting for durability");
        for request in pending {
            self.finish(request, Err(error.clone()));
        }
    }

    fn finish(&mut self, pending: Pending, outcome: Result<(), WalError>) {
        match pending {
            Pending::Add { replier, .. } => replier.reply(outcome.is_ok()),
            Pending::AddMany { lsns, replier, .. } => {
                // On a failure, the blocks already durable were logged all the same.
                let durable = self.tracker.log().map_or(Lsn::ZERO, |log| log.durable_lsn());
                let ok = outcome.is_ok();
                replier.reply(
                    lsns.iter().map(|lsn| lsn.is_some_and(|lsn| ok || lsn <= durable)).collect(),
                );
            }
            Pending::Allocate { replier, .. } => replier.reply(()),
            Pending::Cleanup { threshold, wait, replier, .. } => {
                if outcome.is_err() {
                    tracing::warn!(threshold = threshold.0, "failed to acknowledge batch cleanup");
                    replier.reply(());
                } else {
                    match self.tracker.clean_log(threshold, wait) {
                        Ok(()) => replier.reply(()),
                        Err(error) => replier.fail(error),
                    }
                }
            }
            Pending::Query { held_bytes, answer, .. } => {
                // Saturating: `fail_requests` zeroes the counts before it finishes the queries.
                self.pending_queries = self.pending_queries.saturating_sub(1);
                self.pending_answer_bytes = self.pending_answer_bytes.saturating_sub(held_bytes);
                answer.complete(outcome);
            }
        }
    }

    /// Answers a query with what `compute` reads from the tracker, unless [`Self::admit_query`]
    /// refuses it (then nothing is computed).
    fn answer_query<T: HeldBytes + Send + 'static>(
        &mut self,
        replier: Replier<T>,
        compute: impl FnOnce(&ReceivedBlockTracker) -> T,
    ) {
        if let Some(replier) = self.admit_query(replier) {
            let value = compute(&self.tracker);
            self.answer(value, replier);
        }
    }

    /// Lets a query in (its answer is then computed and given with [`Self::answer`]), unless
    /// its answer would have to wait for durability while [`MAX_PENDING_QUERIES`] queries
    /// wait already, or their answers hold the byte limit (and their askers wait: abandoned
    /// ones are dropped first). A refused query fails at once with
    /// [`BlockTrackerError::DurabilityBacklog`] or [`BlockTrackerError::AnswerBacklog`]; an
    /// answer that need not wait is never refused. Once the state is lost (a failed rebuild,
    /// a stop before durability), every query fails with [`BlockTrackerError::StateLost`].
    fn admit_query<T: Send + 'static>(&mut self, replier: Replier<T>) -> Option<Replier<T>> {
        if let Some(reason) = &self.state_lost {
            replier.fail(BlockTrackerError::StateLost { reason: reason.clone() });
            return None;
        }
        self.admit_within_bounds(replier)
    }

    /// [`Self::admit_query`]'s bounds: lets in an answer that need not wait, or one within
    /// them (after dropping abandoned queries); else fails it at once.
    ///
    /// Looking for abandoned queries scans every waiting request, so a refusal that found
    /// none lets the next `pending / RESCAN_DIVISOR` refusals go without a scan: a flood of
    /// refused queries costs the endpoint O(1) amortized each, not O(pending). An asker that
    /// gives up meanwhile frees its place at the next scan.
    fn admit_within_bounds<T: Send + 'static>(
        &mut self,
        replier: Replier<T>,
    ) -> Option<Replier<T>> {
        if self.below_query_limits() || !self.must_wait() {
            // A backlog, if any, is over: the next one starts with a scan.
            self.refusals_before_rescan = 0;
            return Some(replier);
        }
        if self.refusals_before_rescan > 0 {
            self.refusals_before_rescan -= 1;
        } else {
            self.drop_abandoned_queries();
            if self.below_query_limits() {
                return Some(replier);
            }
            self.refusals_before_rescan = self.pending.len() / RESCAN_DIVISOR;
        }
        if self.pending_queries >= MAX_PENDING_QUERIES {
            replier.fail(BlockTrackerError::DurabilityBacklog {
                pending: self.pending_queries,
                limit: MAX_PENDING_QUERIES,
            });
        } else {
            replier.fail(BlockTrackerError::AnswerBacklog {
                held_bytes: self.pending_answer_bytes,
                limit: self.answer_byte_limit,
            });
        }
        None
    }

    fn below_query_limits(&self) -> bool {
        self.pending_queries < MAX_PENDING_QUERIES
            && self.pending_answer_bytes < self.answer_byte_limit
    }

    /// Answers a request that logged nothing (a stale allocation, a cleanup whose record
    /// failed) as a query: once everything before it is durable, refused past the bound. Not
    /// with [`BlockTrackerError::StateLost`], nor with the WAL's failure if one comes while it
    /// waits: it reports no state (SPEC D.3 does not report a failed write; D.5 answers
    /// allocations and cleanups normally).
    fn answer_nothing_logged(&mut self, replier: Replier<()>) {
        if let Some(replier) = self.admit_within_bounds(replier) {
            if self.must_wait() {
                self.wait_to_answer(0, Box::new(NothingLoggedAnswer(replier)));
            } else {
                replier.reply(());
            }
        }
    }

    /// Answers `replier` with `value` once everything applied so far is durable (now if it
    /// is). Never refused: callers that must be bounded are let in by [`Self::admit_query`].
    fn answer<T: HeldBytes + Send + 'static>(&mut self, value: T, replier: Replier<T>) {
        if !self.must_wait() {
            replier.reply(value);
            return;
        }
        let held_bytes = value.held_bytes();
        self.wait_to_answer(held_bytes, Box::new(Answer { value, replier }));
    }

    /// Queues `answer` (holding `held_bytes`) until everything applied so far is durable.
    fn wait_to_answer(&mut self, held_bytes: usize, answer: Box<dyn WaitingAnswer>) {
        let lsn = self.awaited_lsn();
        self.pending_queries += 1;
        self.pending_answer_bytes += held_bytes;
        self.pending.push_back(Pending::Query { lsn, held_bytes, answer });
    }

    /// Whether an answer given now must wait for durability (requests wait, or applied events
    /// are not durable yet).
    fn must_wait(&self) -> bool {
        let durable = self.tracker.log().map_or(Lsn::ZERO, |log| log.durable_lsn());
        !self.pending.is_empty() || self.awaited_lsn() > durable
    }

    /// Drops the waiting queries whose askers gave up (nobody reads their answers).
    #[cold]
    fn drop_abandoned_queries(&mut self) {
        self.pending.retain(|pending| match pending {
            Pending::Query { answer, .. } => !answer.is_abandoned(),
            _ => true,
        });
        (self.pending_queries, self.pending_answer_bytes) = (0, 0);
        for pending in &self.pending {
            if let Pending::Query { held_bytes, .. } = pending {
                self.pending_queries += 1;
                self.pending_answer_bytes += held_bytes;
            }
        }
    }

    /// Waits (bounded) for everything queued to become durable, answers it, closes the WAL.
    fn stop_tracker(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let awaited = self.awaited_lsn();
        let mut wait_error = None;
        if let Some(log) = self.tracker.log().cloned() {
            if let Err(error) = log.wait_durable(awaited, STOP_DURABILITY_TIMEOUT) {
                tracing::warn!(%error, "stopping the block tracker before its events were durable");
                wait_error = Some(error);
            }
        }
        // No rebuild for what the wait left undurable: the tracker stops, and reading the log
        // back would take this thread past the stop's bound.
        self.settle_after_stop(wait_error);
        if let Err(error) = self.tracker.stop() {
            tracing::warn!(%error, "closing the block tracker's WAL");
        }
    }

    /// Once stopped, what the tracker appended is treated as never becoming durable if it is
    /// not now (the stop's wait is over; a close may still sync it, which D.5 allows of a
    /// failed write): answers what is durable and fails what waits, with the WAL's failure,
    /// else `wait_error` (the stop's wait), else `Closed`. The state then holds
    /// events that were not made durable (also a receiver's hand-over applied after a close
    /// that timed out), so every later query is refused. Without this, what waited was
    /// dropped unanswered when the endpoint stopped.
    fn settle_after_stop(&mut self, wait_error: Option<WalError>) {
        let Some(durable) = self.tracker.log().map(|log| log.durable_lsn()) else {
            return;
        };
        while self.pending.front().is_some_and(|pending| pending.lsn() <= durable) {
            let pending = self.pending.pop_front().expect("checked");
            self.finish(pending, Ok(()));
        }
        if self.pending.is_empty() && self.awaited_lsn() <= durable {
            return;
        }
        let error = self.waker.failure().or(wait_error).unwrap_or(WalError::Closed);
        if self.state_lost.is_none() {
            self.state_lost = Some(format!("it stopped before its events were durable: {error}"));
        }
        self.fail_requests(error);
    }

    /// Answers what became durable, and fails or arranges to answer the rest
    /// ([`Self::complete_durable`], or [`Self::settle_after_stop`] once stopped).
    fn settle(&mut self) {
        if self.stopped {
            self.settle_after_stop(None);
        } else {
            self.complete_durable();
        }
    }
}

impl Endpoint for BlockTrackerEndpoint {
    type Message = BlockTrackerMessage;
    type Request = BlockTrackerRequest;

    fn on_start(&mut self, context: &Context<Self>) {
        let _ = self.waker.endpoint.set(context.endpoint_ref());
        tracing::info!(
            endpoint = context.name(),
            wal = self.tracker.is_wal_enabled(),
            "received-block tracker endpoint started"
        );
    }

    fn handle(
        &mut self,
        message: BlockTrackerMessage,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        match message {
            BlockTrackerMessage::Durable => self.settle(),
            BlockTrackerMessage::Logged(LoggedBlocks { lsn, blocks }) => {
                if self.requests_failed {
                    // A durable record of them is in the rebuilt state already; a later one
                    // can never become durable.
                    tracing::debug!(%lsn, "dropping blocks handed over after the WAL failed");
                    context.record_dropped("blocks handed over after the WAL failed");
                    return Ok(());
                }
                match blocks {
                    LoggedPayload::One(info) => self.tracker.enqueue(lsn, info),
                    LoggedPayload::Many(infos) => self.tracker.apply_logged_additions(lsn, infos),
                    LoggedPayload::ByStream(groups) => {
                        for (stream, blocks) in groups {
                            self.tracker.queue_stream_group(lsn, stream, blocks);
                        }
                    }
                }
                if lsn > self.applied_lsn {
                    self.applied_lsn = lsn;
                }
                self.settle();
            }
        }
        Ok(())
    }

    fn handle_request(
        &mut self,
        request: BlockTrackerRequest,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        self.settle();
        match request {
            BlockTrackerRequest::AddBlock(info, replier) => {
                match self.tracker.add_block_deferred(info) {
                    Logged::Done | Logged::Skipped => replier.reply(true),
                    Logged::Failed => replier.reply(false),
                    Logged::Pending(lsn) => self.pending.push_back(Pending::Add { lsn, replier }),
                }
            }
            BlockTrackerRequest::AddBlocks(infos, replier) => {
                let mut all_done = true;
                // After the first refused write, the rest of the request is refused without
                // trying: on a stuck disk each try would wait out the journal's append
                // timeout, and the request would hold the endpoint that many times over. A
                // block too large to be allocated is refused alone: the log did not refuse.
                let mut refused = false;
                let block_size_limit = self.tracker.block_size_limit();
                let lsns: Vec<Option<Lsn>> = infos
                    .into_iter()
                    .map(|info| {
                        if refused || block_size_limit.refuses(&info) {
                            return None;
                        }
                        match self.tracker.add_block_deferred(info) {
                            Logged::Done | Logged::Skipped => Some(Lsn::ZERO),
                            Logged::Failed => {
                                refused = true;
                                None
                            }
                            Logged::Pending(lsn) => {
                                all_done = false;
                                Some(lsn)
                            }
                        }
                    })
                    .collect();
                if all_done {
                    replier.reply(lsns.iter().map(Option::is_some).collect());
                } else {
                    let lsn = lsns.iter().flatten().max().copied().unwrap_or(Lsn::ZERO);
                    self.pending.push_back(Pending::AddMany { lsn, lsns, replier });
                }
            }
            BlockTrackerRequest::AllocateBlocksToBatch(time, replier) => {
                match self.tracker.allocate_blocks_to_batch_deferred(time) {
                    Ok(Logged::Pending(lsn)) => {
                        self.pending.push_back(Pending::Allocate { lsn, replier });
                    }
                    // A stale time or a failed write is not reported (SPEC D.3); but the
                    // answer still waits for earlier events, so that it never runs ahead of
                    // the state the caller may query next. It logged nothing, so it waits as a
                    // query does, and past the bound it is refused as one: a client repeating
                    // it while the disk is behind cannot pile answers up.
                    Ok(_) => self.answer_nothing_logged(replier),
                    Err(error) => replier.fail(error),
                }
            }
            BlockTrackerRequest::GetBlocksOfBatch(time, replier) => {
                self.answer_query(replier, |tracker| tracker.blocks_of_batch(time));
            }
            BlockTrackerRequest::GetBlocksOfBatchAndStream(time, stream, replier) => {
                self.answer_query(replier, |tracker| {
                    tracker.blocks_of_batch_and_stream(time, stream)
                });
            }
            BlockTrackerRequest::HasUnallocatedBlocks(replier) => {
                self.answer_query(replier, ReceivedBlockTracker::has_unallocated_blocks);
            }
            BlockTrackerRequest::GetUnallocatedBlocks(stream, replier) => {
                self.answer_query(replier, |tracker| tracker.unallocated_blocks(stream));
            }
            BlockTrackerRequest::GetUnconfiguredStreams(replier) => {
                self.answer_query(replier, ReceivedBlockTracker::unconfigured_streams);
            }
            BlockTrackerRequest::CleanupOldBatches(threshold, wait, replier) => {
                match self.tracker.cleanup_old_batches_deferred(threshold) {
                    Ok(Logged::Pending(lsn)) => {
                        self.pending.push_back(Pending::Cleanup { lsn, threshold, wait, replier });
                    }
                    Ok(Logged::Done) => match self.tracker.clean_log(threshold, wait) {
                        Ok(()) => replier.reply(()),
                        Err(error) => replier.fail(error),
                    },
                    Ok(Logged::Failed | Logged::Skipped) => {
                        tracing::warn!(threshold = threshold.0, "failed to log batch cleanup");
                        self.answer_nothing_logged(replier);
                    }
                    Err(error) => replier.fail(error),
                }
            }
            BlockTrackerRequest::ConnectReceiver(replier) => match self.waker.endpoint.get() {
                Some(endpoint) => replier.reply(BlockReceiver::new(
                    endpoint.clone(),
                    self.tracker.log().cloned(),
                    Arc::clone(self.tracker.clock()),
                    self.tracker.write_timeout(),
                    self.tracker.recycled_vectors(),
                    self.tracker.block_size_limit(),
                )),
                None => replier.fail("the block tracker endpoint has not started"),
            },
            BlockTrackerRequest::Stop(replier) => {
                self.stop_tracker();
                // Stopped before the answer, so the asker sees the endpoint stopped.
                context.stop();
                replier.reply(());
            }
        }
        // Answer what is durable already, and arm the durability callback for the rest.
        self.settle();
        Ok(())
    }

    fn on_stop(&mut self) {
        self.stop_tracker();
    }
}
