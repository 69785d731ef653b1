//! The received-block tracker: which blocks the receivers stored, which batch each went to,
//! journaled so that a restarted driver rebuilds exactly the same state (SPEC D, 0.5).
//!
//! ## Parts
//! * `types`: identifiers, [`ReceivedBlockInfo`], [`AllocatedBlocks`] and the journal events
//!   ([`TrackerEvent`]).
//! * `journal`: the events' compact record layout (64 bytes framed for one block, about 4
//!   bytes per block in a multi-block record), validated on decode.
//! * `log`: [`BlockLog`], the journal as a trait, and [`WalBlockLog`] over coordbus's WAL.
//! * `queue`: one stream's unallocated blocks, as chunks of records, observed in log order.
//! * this module: [`ReceivedBlockTracker`], the plain state machine (no threads).
//! * `endpoint`: [`BlockTrackerEndpoint`], the tracker hosted on the bus, acknowledging each
//!   request once its journal record is durable.
//! * `receiver`: [`BlockReceiver`], receiver-side logging: a receiver appends its addition
//!   records itself (outside the tracker, as SPEC D.3 allows) and hands the logged blocks to
//!   the endpoint, pipelined and batched.
//! * `data`: [`ReceiverBlockStore`], a receiver-side log for the blocks' bytes.
//!
//! ## The state machine
//! State (SPEC D.1): per stream a FIFO of unallocated blocks, a map batch time -> allocated
//! blocks, and the last allocated batch time. Every change is first written to the journal
//! (when a checkpoint directory is given; the WAL lives in
//! `<checkpoint>/receivedBlockMetadata`), and applied only once the write succeeded, so a
//! failed write never loses a block (SPEC D.3, D.5). The record time of every event is the
//! clock's current time (not the batch time), which is what WAL cleanup compares against.
//!
//! The synchronous methods ([`ReceivedBlockTracker::add_block`] and friends) wait until the
//! event is durable (at most [`BlockTrackerConfig::write_timeout`], Spark's batching timeout,
//! once it is appended; the append itself waits for room while the WAL's staging buffer is
//! full, at most the log's append timeout, and once an append timed out the tracker's later
//! appends are refused untried until the log makes something more durable: a stuck disk
//! costs one append timeout, then each write fails at once) before changing the state. The
//! `*_deferred` methods are for hosts that acknowledge asynchronously (the bus endpoint): they
//! append the event, apply it at once, and return the LSN the caller must see durable before
//! it tells anyone about the change.
//! [`ReceivedBlockTracker::apply_logged_additions`] queues blocks whose record a receiver
//! appended itself. Queues are observed in log order (by the records' LSNs, not by arrival),
//! and recovery removes exactly the blocks an allocation lists, so the in-memory state always
//! equals the replay of the log up to the records applied, also when a receiver's addition
//! was appended before an allocation but applied after it (it stays unallocated in both); if
//! the log fails before those are durable, the host calls
//! [`ReceivedBlockTracker::rebuild_from_log`] to fall back to the durable prefix.
//!
//! ## A write reported as failed may still be durable
//! SPEC 0.5 and D.5: when a write "fails" because durability was not confirmed in time (the
//! timeout), or because the log failed after the record reached the disk, the record may still
//! be in the log. The caller was told "not written" (an addition answered `false`, an
//! allocation silently not applied), yet a later recovery replays it: a block that reappears as
//! unallocated (and is then allocated, so the receiver's retry makes it appear twice), or an
//! allocation the runtime never applied. The latter on the synchronous path
//! ([`ReceivedBlockTracker::allocate_blocks_to_batch`]): a batch whose allocation timed out
//! gives its blocks back to the queues, a later batch takes them, and after a recovery the
//! blocks belong to both batches (the replayed first allocation, and the later one, which
//! lists them too). The endpoint's deferred path has no such case: it applies an allocation at
//! append and rebuilds from the durable prefix if the log fails. This is the at-least-once
//! behaviour Spark has too; consumers must tolerate a block being offered again after a
//! driver restart.
//!
//! ## Recovery (SPEC D.4)
//! With `recover_from_wal`, construction replays the whole log: additions are queued with
//! `block_id_valid = false` (the executor-side copy is presumed gone), an allocation removes
//! from the queues exactly the blocks it lists (by equality, as a multiset) and records the
//! batch, a cleanup forgets its batches. Without the flag the log is opened (old segments stay
//! cleanable) and the state starts empty.
//!
//! ## Choices where SPEC is silent
//! * Blocks of streams not in `stream_ids` are queued but never allocated (as Spark). The first
//!   block of such a stream logs a warning, and [`ReceivedBlockTracker::unconfigured_streams`]
//!   lists them: nothing frees their queues while the tracker lives.
//! * [`ReceivedBlockTracker::stop`] closes the log; later writes fail (so additions answer
//!   false and allocations do nothing), reads keep working.

mod data;
mod endpoint;
mod journal;
mod limit;
mod log;
mod queue;
mod receiver;
mod recycle;
mod types;

use std::{
    collections::{BTreeMap, VecDeque},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

pub use self::{
    data::{ReceiverBlockStore, DEFAULT_STORE_TIMEOUT},
    endpoint::{
        AddBlock, AddBlocks, AllocateBlocksToBatch, BlockTrackerEndpoint, BlockTrackerMessage,
        BlockTrackerRequest, CleanupOldBatches, ConnectReceiver, GetBlocksOfBatch,
        GetBlocksOfBatchAndStream, GetUnallocatedBlocks, GetUnconfiguredStreams,
        HasUnallocatedBlocks, StopTracker, DEFAULT_ANSWER_BYTE_LIMIT, MAX_PENDING_QUERIES,
    },
    log::{BlockLog, BlockLogError, WalBlockLog, WAL_APPEND_TIMEOUT, WAL_CLOSE_TIMEOUT},
    receiver::{AddReceipt, BlockReceiver, LoggedBlocks, COMBINE_MAX_BLOCKS},
    types::{
        AllocatedBlocks, BatchAllocationEvent, BatchCleanupEvent, BatchTime, BlockAdditionEvent,
        BlockAdditionsEvent, BlockStoreResult, ReceivedBlockInfo, StreamBlockId, StreamBlocks,
        StreamId, TrackerEvent,
    },
};
use self::{
    limit::BlockSizeLimit,
    queue::{Bounds, ChunkBlocks, StreamQueue},
    recycle::BlockVecPool,
};
use crate::{
    clock::Clock,
    wal::{Lsn, Wal, WalConfig, WalError, WalOptions},
};

/// Name of the WAL directory inside the checkpoint directory (Spark's).
pub const RECEIVED_BLOCK_METADATA_DIR: &str = "receivedBlockMetadata";

/// Errors of the tracker.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockTrackerError {
    /// A block info was built with a negative record count.
    #[error("block {block_id} has a negative number of records: {num_records}")]
    NegativeNumRecords {
        /// The block.
        block_id: StreamBlockId,
        /// The count given.
        num_records: i64,
    },
    /// `cleanup_old_batches` was given a threshold that is not in the past (Spark:
    /// "requirement failed").
    #[error(
        "requirement failed: cleanup threshold {threshold_ms} ms must be before the current \
         time {now_ms} ms"
    )]
    ThresholdNotInPast {
        /// The threshold given.
        threshold_ms: i64,
        /// The clock's time.
        now_ms: i64,
    },
    /// The log step raised (an injected log); nothing was changed.
    #[error("{message}")]
    LogRaised {
        /// The event being written.
        event: &'static str,
        /// The raised error's text.
        message: String,
    },
    /// Opening, reading or cleaning the write-ahead log failed.
    #[error(transparent)]
    Wal(#[from] WalError),
    /// The block's data was stored in a block manager, not in a receiver log.
    #[error("block {block_id} was stored in a block manager, not in a receiver log")]
    NotInReceiverLog {
        /// The block.
        block_id: StreamBlockId,
    },
    /// An event could not be serialized.
    #[error("a tracker event could not be serialized: {message}")]
    Encode {
        /// What went wrong.
        message: String,
    },
    /// A journal record is not a valid tracker event.
    #[error("a journal record is not a valid tracker event: {message}")]
    Decode {
        /// What was wrong.
        message: String,
    },
    /// The bus endpoint refused a query: `limit` queries already wait for earlier events to
    /// become durable (the disk is behind). Nothing changed; ask again later.
    #[error(
        "{pending} queries already wait for the write-ahead log to catch up (limit {limit}); \
         the query was refused"
    )]
    DurabilityBacklog {
        /// Queries waiting when this one arrived.
        pending: usize,
        /// The endpoint's limit.
        limit: usize,
    },
    /// The bus endpoint refused a query: the answers of the queries already waiting for
    /// earlier events to become durable hold `held_bytes` (at least `limit`, the endpoint's
    /// byte limit). Nothing changed; ask again later.
    #[error(
        "the answers of queries waiting for the write-ahead log to catch up already hold \
         {held_bytes} bytes (limit {limit}); the query was refused"
    )]
    AnswerBacklog {
        /// Bytes the waiting answers hold.
        held_bytes: usize,
        /// The endpoint's byte limit.
        limit: usize,
    },
    /// The bus endpoint holds no state it can vouch for, so every query fails with this from
    /// then on: its write-ahead log failed and rebuilding the state from the log's durable
    /// prefix failed too, or it stopped before its events were durable. Restarting the
    /// tracker with recovery reads the log again.
    #[error("the block tracker's state is lost: {reason}")]
    StateLost {
        /// What happened.
        reason: String,
    },
    /// The log's records are too small for an allocation of even one block: one listing
    /// all `streams` configured streams takes `allocation_bytes`, more than the log's
    /// largest record, `max_event_bytes`. Configure fewer streams or larger WAL segments.
    #[error(
        "an allocation record of the {streams} configured streams takes {allocation_bytes} \
         bytes, more than the log's largest record of {max_event_bytes} bytes; configure \
         fewer streams or larger write-ahead log segments"
    )]
    StreamsExceedLog {
        /// Configured streams.
        streams: usize,
        /// Encoded bytes of an allocation of one block with empty metadata.
        allocation_bytes: usize,
        /// The log's largest record.
        max_event_bytes: usize,
    },
    /// Recovery found an unallocated block too large to be allocated with this configuration
    /// (logged by an earlier version, or with fewer streams or larger segments): it would
    /// hold up every later allocation. Nothing was changed; reopen with larger write-ahead
    /// log segments or the streams it was logged with.
    #[error(
        "recovered block {block_id} has {metadata_bytes} bytes of metadata, more than an \
         allocation record of the configured streams holds ({metadata_bytes_max}); reopen with \
         larger write-ahead log segments or fewer streams"
    )]
    UnallocatableBlock {
        /// The block.
        block_id: StreamBlockId,
        /// Its metadata's length.
        metadata_bytes: usize,
        /// The longest metadata a block may carry here.
        metadata_bytes_max: usize,
    },
}

/// Settings of a [`ReceivedBlockTracker`]: [`BlockTrackerConfig::new`] and the setters below
/// (or assignments to the public fields). Not built field by field outside the crate, so that
/// a new setting is not a breaking change.
///
/// ```
/// use std::time::Duration;
/// use coordbus::coordinators::block_tracker::{BlockTrackerConfig, StreamId};
/// let config = BlockTrackerConfig::new([StreamId(0)])
///     .checkpoint_dir("/tmp/checkpoint")
///     .write_timeout(Duration::from_secs(2));
/// assert_eq!(config.write_timeout, Duration::from_secs(2));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BlockTrackerConfig {
    /// The input streams whose blocks are allocated to batches.
    pub stream_ids: Vec<StreamId>,
    /// Checkpoint directory; the WAL is enabled iff it is given.
    pub checkpoint_dir: Option<PathBuf>,
    /// Replay the log at construction (Spark's `recoverFromWriteAheadLog`).
    pub recover_from_wal: bool,
    /// The WAL's settings (default [`BlockTrackerConfig::driver_wal_config`]).
    pub wal: WalConfig,
    /// The WAL's options: its I/O path, the sync thread's priority, spare segments, ... (default
    /// [`WalOptions::default`]). Their `clock` does not matter: the tracker stamps its records
    /// with its own clock. `read_only` is refused: the tracker writes its log.
    pub wal_options: WalOptions,
    /// Longest a synchronous write waits for durability before it counts as failed (Spark's
    /// `batchingTimeout`, 5 s). A tracker that opens its own log also bounds each append's
    /// wait for room in the WAL's staging buffer by it.
    pub write_timeout: Duration,
}

impl BlockTrackerConfig {
    /// Defaults for `stream_ids`: no checkpoint (WAL disabled), no recovery.
    pub fn new(stream_ids: impl IntoIterator<Item = StreamId>) -> Self {
        Self {
            stream_ids: stream_ids.into_iter().collect(),
            checkpoint_dir: None,
            recover_from_wal: false,
            wal: Self::driver_wal_config(),
            wal_options: WalOptions::default(),
            write_timeout: Duration::from_millis(5000),
        }
    }

    /// Sets the checkpoint directory (enables the WAL).
    pub fn checkpoint_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoint_dir = Some(dir.into());
        self
    }

    /// Sets the recovery flag.
    pub fn recover(mut self, recover: bool) -> Self {
        self.recover_from_wal = recover;
        self
    }

    /// Sets the WAL's settings.
    pub fn wal_config(mut self, wal: WalConfig) -> Self {
        self.wal = wal;
        self
    }

    /// Sets the WAL's options.
    pub fn wal_options(mut self, options: WalOptions) -> Self {
        self.wal_options = options;
        self
    }

    /// Sets how long a synchronous write waits for durability (default 5 s; more than zero
    /// when there is a log: [`ReceivedBlockTracker::open`] refuses zero).
    pub fn write_timeout(mut self, timeout: Duration) -> Self {
        self.write_timeout = timeout;
        self
    }

    /// The driver log's defaults (SPEC E.7): group commit on (Spark's batching), rolling
    /// every 60 s.
    pub fn driver_wal_config() -> WalConfig {
        WalConfig { rolling_interval: Some(Duration::from_secs(60)), ..WalConfig::default() }
    }
}

/// The outcome of a `*_deferred` operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logged {
    /// Applied, with nothing to wait for (WAL disabled).
    Done,
    /// Appended as this LSN and already applied: report it once the LSN is durable; if the
    /// log fails first, call [`ReceivedBlockTracker::rebuild_from_log`].
    Pending(Lsn),
    /// The log refused the write: nothing changed.
    Failed,
    /// Nothing to do (an allocation for a batch time not newer than the last one).
    Skipped,
}

/// Outcome of the write step (`writeToLog` without the wait).
enum Append {
    Disabled,
    Appended(Lsn),
    Failed,
    /// The record is larger than the log takes (`WalError::RecordTooLarge`): nothing failed,
    /// a smaller one may go.
    TooLarge,
}

/// How much of the unallocated blocks one allocation takes: all of them, unless the record
/// was too large for the log (`append_allocation`).
#[derive(Debug, Clone, Copy)]
struct AllocationLimit {
    /// The oldest blocks of each stream taken.
    blocks_per_stream: usize,
    /// How many streams' blocks are taken (those whose oldest block is oldest).
    streams: usize,
}

/// Splits `bounds` (a queue's chunks, as `(lsn, blocks)`) after its first `at` blocks:
/// `bounds` keeps those, the rest is returned.
fn split_bounds(bounds: &mut Bounds, at: usize) -> Bounds {
    let mut kept = 0;
    let mut rest = Bounds::new();
    bounds.retain_mut(|(lsn, count)| {
        if kept >= at {
            rest.push((*lsn, *count));
            return false;
        }
        if kept + *count > at {
            rest.push((*lsn, kept + *count - at));
            *count = at - kept;
        }
        kept += *count;
        true
    });
    rest
}

/// Refuses a zero `write_timeout` for a tracker with a log: every synchronous write (and every
/// receiver's receipt) would answer false before a sync could make it durable, while its record
/// may still become durable and be applied, or come back after a restart.
fn refuse_zero_write_timeout(config: &BlockTrackerConfig) -> Result<(), BlockTrackerError> {
    if config.write_timeout.is_zero() {
        return Err(BlockTrackerError::Wal(WalError::InvalidConfig {
            setting: "write_timeout",
            value: format!("{:?}", config.write_timeout),
            reason: "a synchronous write must be able to wait for its sync",
        }));
    }
    Ok(())
}

/// The received-block tracker as a plain state machine (see the module doc).
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use coordbus::clock::ManualClock;
/// use coordbus::coordinators::block_tracker::*;
///
/// let clock = Arc::new(ManualClock::new(1_000));
/// let dir = tempfile::tempdir()?;
/// let config = BlockTrackerConfig::new([StreamId(1)]).checkpoint_dir(dir.path());
/// let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone())?;
/// let block = StreamBlockId { stream: StreamId(1), unique_id: 7 };
/// let info = ReceivedBlockInfo::new(
///     StreamId(1), Some(10), None, BlockStoreResult::BlockManager { block_id: block })?;
/// assert!(tracker.add_block(info.clone()));            // durable when it returns
/// tracker.allocate_blocks_to_batch(BatchTime(1_000))?;
/// let allocated = tracker.blocks_of_batch_and_stream(BatchTime(1_000), StreamId(1));
/// assert_eq!(allocated, vec![info.clone()]);
/// tracker.stop()?;
///
/// let recovered = ReceivedBlockTracker::open(config.recover(true), clock)?;
/// assert_eq!(recovered.blocks_of_batch_and_stream(BatchTime(1_000), StreamId(1)), vec![info]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ReceivedBlockTracker {
    /// Streams whose queues allocations take (sorted, unique).
    stream_ids: Vec<StreamId>,
    clock: Arc<dyn Clock>,
    /// `None`: WAL disabled.
    log: Option<Arc<dyn BlockLog>>,
    write_timeout: Duration,
    /// Per stream, the unallocated blocks, observed in log order (`queue` module).
    unallocated: BTreeMap<StreamId, StreamQueue>,
    allocated: BTreeMap<BatchTime, AllocatedBlocks>,
    last_allocated: Option<BatchTime>,
    recovered_events: u64,
    /// True while the log is replayed: a queue of an unconfigured stream created then may be
    /// emptied by a later event of the log (warned about after the replay instead).
    replaying: bool,
    /// The last LSN replayed at construction: blocks added up to it were marked invalid.
    recovered_through: Lsn,
    /// Without recovery, the log's durable LSN at construction: what earlier runs logged,
    /// which this tracker never had, so a rebuild skips it.
    unrecovered_through: Lsn,
    /// Block vectors of forgotten batches, emptied, for the next allocations: a large
    /// allocation's vector is then memory already mapped, not fresh pages the kernel must
    /// fault in and zero (which, at millions of blocks per second, cost more than the rest of
    /// the allocation). The largest [`SPARE_MAX`] are kept (`keep_spare`), none much larger
    /// than recent allocations need.
    spare: Vec<Vec<ReceivedBlockInfo>>,
    /// The largest stream list of recent allocations, decaying by 1/128 per allocation
    /// (halving in about 90): spares more than twice as large (with the allocation's
    /// headroom) are freed, so the memory of a burst goes back once batches stay small. A
    /// faster decay freed the spares between the bursts of a 20 ms batch loop (measured).
    recent_allocation_max: usize,
    /// Emptied record vectors go back to the receivers through this pool (module `recycle`).
    recycled: Arc<BlockVecPool>,
    /// Events the WAL refused (see `append` for which are logged).
    failed_writes: std::sync::atomic::AtomicU64,
    /// The durable LSN when an append last timed out for room ([`NOT_STALLED`]: none since
    /// the log made progress). Until the log makes more durable, appends are refused at once
    /// instead of each waiting out the append timeout again on the caller's thread (the
    /// endpoint's: N separate additions on a stuck disk held it N times over).
    stalled_at_durable: std::sync::atomic::AtomicU64,
    /// Blocks too large to be allocated are refused (module `limit`).
    block_size_limit: BlockSizeLimit,
    /// Deferred allocations whose record may not be durable yet: `(its LSN, the oldest
    /// addition LSN of the blocks it took)`. Until the record is durable those additions are
    /// the blocks' only durable trace, so cleaning keeps them ([`Self::clean_log`]).
    undurable_allocations: VecDeque<(Lsn, Lsn)>,
}

/// Most spare block vectors kept.
const SPARE_MAX: usize = 8;

/// `stalled_at_durable` when no append timed out since the log last made progress.
const NOT_STALLED: u64 = u64::MAX;
/// Smallest capacity worth keeping as a spare.
const SPARE_CAPACITY_MIN: usize = 1024;

impl std::fmt::Debug for ReceivedBlockTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceivedBlockTracker")
            .field("stream_ids", &self.stream_ids)
            .field("wal_enabled", &self.log.is_some())
            .field("allocated_batches", &self.allocated.len())
            .field("last_allocated", &self.last_allocated)
            .finish_non_exhaustive()
    }
}

impl ReceivedBlockTracker {
    /// Builds a tracker; opens the WAL in `<checkpoint>/receivedBlockMetadata` when a
    /// checkpoint directory is given, and replays it when `recover_from_wal` is set.
    ///
    /// # Errors
    /// The WAL's opening errors (also [`WalError::InvalidConfig`] for read-only WAL options,
    /// and for a zero `write_timeout` with a log), or a damaged journal during recovery.
    pub fn open(
        config: BlockTrackerConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, BlockTrackerError> {
        if config.checkpoint_dir.is_some() && config.wal_options.read_only {
            return Err(BlockTrackerError::Wal(WalError::InvalidConfig {
                setting: "read_only",
                value: "true".into(),
                reason: "the block tracker writes its log",
            }));
        }
        if config.checkpoint_dir.is_some() {
            refuse_zero_write_timeout(&config)?;
        }
        let log: Option<Arc<dyn BlockLog>> = match &config.checkpoint_dir {
            None => None,
            Some(dir) => Some(Arc::new(
                WalBlockLog::open_with_options(
                    dir.join(RECEIVED_BLOCK_METADATA_DIR),
                    config.wal.clone(),
                    config.wal_options.clone(),
                )?
                .with_append_timeout(config.write_timeout),
            )),
        };
        Self::with_log(config, clock, log)
    }

    /// Builds a tracker over an explicit log (`None`: WAL disabled); `config.checkpoint_dir`,
    /// `config.wal` and `config.wal_options` are ignored.
    ///
    /// # Errors
    /// [`WalError::InvalidConfig`] for a zero `write_timeout` with a log; a damaged journal
    /// during recovery;
    /// [`BlockTrackerError::StreamsExceedLog`] if the log's records cannot hold an
    /// allocation of one block; [`BlockTrackerError::UnallocatableBlock`] if recovery found
    /// an unallocated block they cannot hold.
    pub fn with_log(
        config: BlockTrackerConfig,
        clock: Arc<dyn Clock>,
        log: Option<Arc<dyn BlockLog>>,
    ) -> Result<Self, BlockTrackerError> {
        if log.is_some() {
            refuse_zero_write_timeout(&config)?;
        }
        let mut stream_ids = config.stream_ids;
        stream_ids.sort_unstable();
        stream_ids.dedup();
        let block_size_limit = BlockSizeLimit::of(log.as_deref(), &stream_ids)?;
        let mut tracker = Self {
            block_size_limit,
            stream_ids,
            clock,
            log,
            write_timeout: config.write_timeout,
            unallocated: BTreeMap::new(),
            allocated: BTreeMap::new(),
            last_allocated: None,
            recovered_events: 0,
            replaying: false,
            recovered_through: Lsn::ZERO,
            unrecovered_through: Lsn::ZERO,
            spare: Vec::new(),
            recent_allocation_max: 0,
            undurable_allocations: VecDeque::new(),
            recycled: Arc::default(),
            failed_writes: std::sync::atomic::AtomicU64::new(0),
            stalled_at_durable: std::sync::atomic::AtomicU64::new(NOT_STALLED),
        };
        if !config.recover_from_wal {
            tracker.unrecovered_through =
                tracker.log.as_ref().map_or(Lsn::ZERO, |log| log.durable_lsn());
        }
        if config.recover_from_wal && tracker.log.is_some() {
            let started = std::time::Instant::now();
            let replayed = tracker.replay(None, Lsn::ZERO, Lsn(u64::MAX))?;
            tracker.recovered_events = replayed.events;
            tracker.recovered_through = replayed.through;
            tracing::info!(
                events = tracker.recovered_events,
                elapsed = ?started.elapsed(),
                allocated_batches = tracker.allocated.len(),
                "received-block tracker recovered from its write-ahead log"
            );
            tracker.check_recovered_blocks_allocatable(replayed.longest_metadata_bytes)?;
            let unconfigured = tracker.unconfigured_streams();
            if !unconfigured.is_empty() {
                tracing::warn!(
                    streams = ?unconfigured,
                    configured = ?tracker.stream_ids,
                    "recovered blocks of streams missing from the tracker's stream ids are kept \
                     but never allocated"
                );
            }
        }
        Ok(tracker)
    }

    /// Whether events are journaled (a checkpoint directory or log was given).
    pub fn is_wal_enabled(&self) -> bool {
        self.log.is_some()
    }

    /// The journal, if enabled.
    pub fn log(&self) -> Option<&Arc<dyn BlockLog>> {
        self.log.as_ref()
    }

    /// The journal's WAL, if the journal is a WAL.
    pub fn wal(&self) -> Option<&Arc<Wal>> {
        self.log.as_ref().and_then(|log| log.wal())
    }

    /// The configured streams (sorted).
    pub fn stream_ids(&self) -> &[StreamId] {
        &self.stream_ids
    }

    /// Events replayed at construction.
    pub fn recovered_events(&self) -> u64 {
        self.recovered_events
    }

    /// How long a synchronous write waits for durability (Spark's batching timeout).
    pub fn write_timeout(&self) -> Duration {
        self.write_timeout
    }

    /// The clock the tracker stamps its records with.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The longest metadata a block may carry, if the log limits it: a block with more could
    /// not be allocated (an allocation record listing it alone would not fit the log), so its
    /// addition is refused (answered false, nothing changed).
    pub fn block_metadata_bytes_max(&self) -> Option<usize> {
        self.block_size_limit.metadata_bytes_max()
    }

    fn block_size_limit(&self) -> BlockSizeLimit {
        self.block_size_limit
    }

    /// Fails if a recovered unallocated block is longer than [`Self::block_metadata_bytes_max`]
    /// allows: it could never be allocated and, as the oldest, would stall allocation. The
    /// queues are walked only if the longest metadata replayed, `longest_metadata_bytes`, is
    /// over the limit (a walk of a million recovered blocks cost a sixth of the recovery).
    fn check_recovered_blocks_allocatable(
        &self,
        longest_metadata_bytes: usize,
    ) -> Result<(), BlockTrackerError> {
        let Some(metadata_bytes_max) = self.block_size_limit.metadata_bytes_max() else {
            return Ok(());
        };
        if longest_metadata_bytes <= metadata_bytes_max {
            return Ok(());
        }
        // Only configured streams are allocated: blocks of others never hold anything up.
        let configured = self.stream_ids.iter().filter_map(|stream| self.unallocated.get(stream));
        let too_large = configured
            .flat_map(StreamQueue::blocks)
            .find(|info| limit::metadata_bytes(info) > metadata_bytes_max);
        match too_large {
            None => Ok(()),
            Some(info) => Err(BlockTrackerError::UnallocatableBlock {
                block_id: info.block_id(),
                metadata_bytes: limit::metadata_bytes(info),
                metadata_bytes_max,
            }),
        }
    }

    // ----- the log step -------------------------------------------------------------------

    fn append(&self, event: &TrackerEvent) -> Result<Append, BlockTrackerError> {
        let Some(log) = &self.log else {
            return Ok(Append::Disabled);
        };
        if self.still_stalled(log.as_ref()) {
            self.count_failed_write(
                event,
                &"the log has made nothing durable since an append \
                                             timed out for room",
            );
            return Ok(Append::Failed);
        }
        match log.append(event, self.clock.now_ms()) {
            Ok(lsn) => Ok(Append::Appended(lsn)),
            Err(BlockLogError::Wal(error @ WalError::RecordTooLarge { .. })) => {
                // An allocation is retried smaller, and reported once (`append_allocation`).
                if !matches!(event, TrackerEvent::BatchAllocation(_)) {
                    tracing::warn!(event = event.kind(), %error, "a record too large for the log");
                }
                Ok(Append::TooLarge)
            }
            Err(BlockLogError::Wal(error)) => {
                if let WalError::AppendTimedOut { durable, .. } = error {
                    self.stalled_at_durable.store(durable, std::sync::atomic::Ordering::Relaxed);
                    // A stall (at most one per append timeout) is always worth a line.
                    tracing::warn!(event = event.kind(), %error, "the write-ahead log is stalled");
                    self.failed_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                } else {
                    self.count_failed_write(event, &error);
                }
                Ok(Append::Failed)
            }
            Err(BlockLogError::Raised { message }) => {
                Err(BlockTrackerError::LogRaised { event: event.kind(), message })
            }
        }
    }

    /// Whether an append timed out for room and the log has made nothing more durable since
    /// (`stalled_at_durable`); clears the mark once it has.
    fn still_stalled(&self, log: &dyn BlockLog) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let stalled_at = self.stalled_at_durable.load(Relaxed);
        if stalled_at == NOT_STALLED {
            return false;
        }
        if log.durable_lsn().0 <= stalled_at {
            return true;
        }
        self.stalled_at_durable.store(NOT_STALLED, Relaxed);
        false
    }

    /// Counts a write the log refused; a failed or stalled log refuses every later write, so
    /// those are logged at the 1st, 2nd, 4th, ... one.
    fn count_failed_write(&self, event: &TrackerEvent, error: &dyn std::fmt::Display) {
        let failed = 1 + self.failed_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if failed.is_power_of_two() {
            tracing::warn!(
                event = event.kind(),
                %error,
                failed,
                "failed to write to the write-ahead log"
            );
        }
    }

    fn wait(&self, kind: &'static str, lsn: Lsn) -> bool {
        let Some(log) = &self.log else {
            return true;
        };
        match log.wait_durable(lsn, self.write_timeout) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(
                    event = kind, %lsn, %error,
                    "a write-ahead log write was not confirmed durable; it may still be (SPEC D.5)"
                );
                false
            }
        }
    }

    /// Spark's `writeToLog`: writes `event` and waits until it is durable. True if the WAL is
    /// disabled or the write is durable; false if the write failed or was not confirmed in
    /// time (it may still become durable: module doc), and, without writing, if it adds a
    /// block whose metadata is too long to be allocated ([`Self::block_metadata_bytes_max`]),
    /// or if an earlier append timed out for room and the log has made nothing more durable
    /// since (module doc).
    ///
    /// # Errors
    /// [`BlockTrackerError::LogRaised`] if the log step raised.
    pub fn write_to_log(&self, event: &TrackerEvent) -> Result<bool, BlockTrackerError> {
        if self.block_size_limit.refuses_event(event) {
            return Ok(false);
        }
        Ok(match self.append(event)? {
            Append::Disabled => true,
            Append::Appended(lsn) => self.wait(event.kind(), lsn),
            Append::Failed | Append::TooLarge => false,
        })
    }

    // ----- operations ---------------------------------------------------------------------

    /// Journals the addition of `info` (durably) and then queues it as unallocated. Returns
    /// whether it was journaled; on false nothing changed (SPEC D.3). Never fails otherwise:
    /// an error of the log step is logged and answered false, and so is a block whose
    /// metadata is too long to be allocated ([`Self::block_metadata_bytes_max`]).
    pub fn add_block(&mut self, info: ReceivedBlockInfo) -> bool {
        if self.block_size_limit.refuses(&info) {
            return false;
        }
        let event = TrackerEvent::BlockAddition(BlockAdditionEvent { info });
        let (logged, lsn) = match self.append(&event) {
            Ok(Append::Disabled) => (true, Lsn::ZERO),
            Ok(Append::Appended(lsn)) => (self.wait(event.kind(), lsn), lsn),
            Ok(Append::Failed | Append::TooLarge) => (false, Lsn::ZERO),
            Err(error) => {
                tracing::warn!(%error, "adding a block failed");
                (false, Lsn::ZERO)
            }
        };
        if logged {
            let TrackerEvent::BlockAddition(BlockAdditionEvent { info }) = event else {
                unreachable!("built above")
            };
            self.enqueue(lsn, info);
        }
        logged
    }

    /// [`Self::add_block`] without waiting: appends the event and queues the block at once.
    /// See [`Logged`] for what the caller must do.
    pub fn add_block_deferred(&mut self, info: ReceivedBlockInfo) -> Logged {
        if self.block_size_limit.refuses(&info) {
            return Logged::Failed;
        }
        let event = TrackerEvent::BlockAddition(BlockAdditionEvent { info });
        let outcome = match self.append(&event) {
            Ok(Append::Disabled) => Logged::Done,
            Ok(Append::Appended(lsn)) => Logged::Pending(lsn),
            Ok(Append::Failed | Append::TooLarge) => Logged::Failed,
            Err(error) => {
                tracing::warn!(%error, "adding a block failed");
                Logged::Failed
            }
        };
        if outcome != Logged::Failed {
            let TrackerEvent::BlockAddition(BlockAdditionEvent { info }) = event else {
                unreachable!("built above")
            };
            let lsn = if let Logged::Pending(lsn) = outcome { lsn } else { Lsn::ZERO };
            self.enqueue(lsn, info);
        }
        outcome
    }

    /// Queues blocks whose addition record somebody else already appended to this tracker's
    /// log as `lsn` (a receiver logging outside the tracker, SPEC D.3/D.4; the bus endpoint's
    /// [`BlockReceiver`]): `blocks` in the record's order, `Lsn::ZERO` when the WAL is
    /// disabled. No I/O. The blocks take their place in the queues by log position, not by
    /// arrival, so the queues always equal what a replay of the log would build, whatever
    /// order concurrent receivers' hand-overs arrive in.
    ///
    /// The caller must not report the additions before `lsn` is durable, and must pass the
    /// LSN the record really got: an allocation logged after this call may list these blocks,
    /// which is only sound if their record precedes it in the log. It must also have refused
    /// blocks whose metadata is longer than [`Self::block_metadata_bytes_max`] before logging
    /// them ([`BlockReceiver`] does): such a block could never be allocated, and recovering
    /// it fails with [`BlockTrackerError::UnallocatableBlock`].
    pub fn apply_logged_additions(
        &mut self,
        lsn: Lsn,
        blocks: impl IntoIterator<Item = ReceivedBlockInfo>,
    ) {
        // A vector passes through `collect` without a copy.
        let mut blocks: Vec<ReceivedBlockInfo> = blocks.into_iter().collect();
        let Some(first) = blocks.first().map(ReceivedBlockInfo::stream_id) else {
            return;
        };
        if blocks.len() == 1 {
            // Kept inline in its chunk; a batch-sized vector goes back to the receivers.
            let chunk = blocks.drain(..).collect();
            self.queue_of(first).push(lsn, chunk);
            self.recycled.give_back(blocks);
            return;
        }
        if blocks.iter().all(|info| info.stream_id() == first) {
            // One stream (a receiver belongs to one): the vector becomes the chunk as it is.
            self.queue_of(first).push(lsn, ChunkBlocks::from_vec(blocks));
            return;
        }
        // Several streams (a receiver rotating over streams; Spark's serve one each): the
        // first stream's blocks stay in the record's vector, the others move out, in one pass.
        let moved = blocks.iter().filter(|info| info.stream_id() != first).count();
        let mut others = self.vector_with_capacity(moved);
        others.extend(blocks.extract_if(.., |info| info.stream_id() != first));
        self.queue_of(first).push(lsn, ChunkBlocks::from_vec(blocks));
        let Some(second) = others.first().map(ReceivedBlockInfo::stream_id) else {
            debug_assert!(false, "the record had a block of another stream");
            return;
        };
        if others.iter().all(|info| info.stream_id() == second) {
            self.queue_of(second).push(lsn, ChunkBlocks::from_vec(others));
            return;
        }
        // Three streams or more: counted first, so that each stream's chunk is allocated
        // once at its final size.
        let mut counts: BTreeMap<StreamId, usize> = BTreeMap::new();
        for info in &others {
            *counts.entry(info.stream_id()).or_default() += 1;
        }
        let mut by_stream: BTreeMap<StreamId, ChunkBlocks> = counts
            .into_iter()
            .map(|(stream, count)| {
                (stream, ChunkBlocks::from_vec(self.vector_with_capacity(count)))
            })
            .collect();
        for info in others.drain(..) {
            by_stream.entry(info.stream_id()).or_default().push(info);
        }
        self.recycled.give_back(others);
        for (stream, blocks) in by_stream {
            self.queue_of(stream).push(lsn, blocks);
        }
    }

    /// An empty vector with room for `count` blocks: a recycled batch-sized one when `count`
    /// fills at least half of it (so that a queued chunk never holds more than twice the
    /// memory its blocks need), else one of exactly that capacity.
    fn vector_with_capacity(&self, count: usize) -> Vec<ReceivedBlockInfo> {
        if (receiver::COMBINE_MAX_BLOCKS / 2..=receiver::COMBINE_MAX_BLOCKS).contains(&count) {
            self.recycled.take()
        } else {
            Vec::with_capacity(count)
        }
    }

    /// The pool receivers take their batch vectors from (module `recycle`).
    pub(crate) fn recycled_vectors(&self) -> Arc<BlockVecPool> {
        Arc::clone(&self.recycled)
    }

    /// Queues blocks of one stream from record `lsn`, in their record order (a receiver's
    /// batch vector for that stream: queued as it is, unless it fills less than half of a
    /// batch vector, which then goes back to the receivers).
    pub(crate) fn queue_stream_group(
        &mut self,
        lsn: Lsn,
        stream: StreamId,
        mut blocks: Vec<ReceivedBlockInfo>,
    ) {
        if blocks.is_empty() {
            return;
        }
        debug_assert!(blocks.iter().all(|info| info.stream_id() == stream), "one stream");
        let chunk = if blocks.len() < receiver::COMBINE_MAX_BLOCKS / 2
            && blocks.capacity() >= receiver::COMBINE_MAX_BLOCKS
        {
            let chunk = blocks.drain(..).collect();
            self.recycled.give_back(blocks);
            chunk
        } else {
            ChunkBlocks::from_vec(blocks)
        };
        self.queue_of(stream).push(lsn, chunk);
    }

    /// The unallocated queue of `stream`, created on its first block. A stream missing from
    /// `stream_ids` gets one too (SPEC D: accepted and queued) but is never allocated, so
    /// nothing ever frees it: a block into its empty queue (its first, unless a replayed
    /// allocation emptied the queue) is worth a warning.
    fn queue_of(&mut self, stream: StreamId) -> &mut StreamQueue {
        let queue = self.unallocated.entry(stream).or_default();
        if queue.is_empty() && !self.replaying && self.stream_ids.binary_search(&stream).is_err() {
            tracing::warn!(
                %stream,
                configured = ?self.stream_ids,
                "blocks of a stream missing from the tracker's stream ids are kept but never \
                 allocated"
            );
        }
        queue
    }

    /// Queues one block added as record `lsn`.
    fn enqueue(&mut self, lsn: Lsn, info: ReceivedBlockInfo) {
        let stream = info.stream_id();
        self.queue_of(stream).push(lsn, smallvec::smallvec![info]);
    }

    /// Takes the unallocated blocks of the configured streams into an allocation event for
    /// batch `time`, within `limit` (the oldest blocks of each stream, of the streams whose
    /// oldest block is oldest): the rest stay queued. The chunk bounds are kept aside in case
    /// the allocation is not written.
    fn take_allocation(
        &mut self,
        time: BatchTime,
        limit: AllocationLimit,
    ) -> (TrackerEvent, Vec<Bounds>) {
        let taken_streams = self.oldest_streams(limit.streams);
        let mut bounds = Vec::with_capacity(self.stream_ids.len());
        let mut largest = 0;
        let blocks = AllocatedBlocks::new(self.stream_ids.iter().map(|stream| {
            let taken = taken_streams.as_ref().is_none_or(|taken| taken.contains(stream));
            let (mut infos, mut stream_bounds) = match self.unallocated.get_mut(stream) {
                Some(queue) if taken && !queue.is_empty() => {
                    queue.take(&mut self.spare, &self.recycled)
                }
                _ => Default::default(),
            };
            if infos.len() > limit.blocks_per_stream {
                let rest = infos.split_off(limit.blocks_per_stream);
                let rest_bounds = split_bounds(&mut stream_bounds, limit.blocks_per_stream);
                self.unallocated.get_mut(stream).expect("taken from").restore(rest, rest_bounds);
            }
            largest = largest.max(infos.len());
            bounds.push(stream_bounds);
            (*stream, infos)
        }));
        self.recent_allocation_max =
            largest.max(self.recent_allocation_max - self.recent_allocation_max / 128);
        (TrackerEvent::BatchAllocation(BatchAllocationEvent { time, blocks }), bounds)
    }

    /// The `count` configured streams with unallocated blocks whose oldest block is oldest
    /// (in log order), or `None` (every stream) if no more than `count` have any.
    fn oldest_streams(&mut self, count: usize) -> Option<Vec<StreamId>> {
        if count >= self.stream_ids.len() {
            return None;
        }
        let mut oldest: Vec<(Lsn, StreamId)> = Vec::new();
        for stream in &self.stream_ids {
            if let Some(lsn) = self.unallocated.get_mut(stream).and_then(StreamQueue::oldest) {
                oldest.push((lsn, *stream));
            }
        }
        if oldest.len() <= count {
            return None;
        }
        oldest.sort_unstable();
        Some(oldest.into_iter().take(count).map(|(_, stream)| stream).collect())
    }

    /// The largest spare worth keeping: twice what the largest recent allocation took, with
    /// the quarter of headroom a new allocation vector gets.
    fn spare_capacity_max(&self) -> usize {
        let recent = self.recent_allocation_max;
        (2 * (recent + recent / 4)).max(SPARE_CAPACITY_MIN)
    }

    /// Puts the blocks of an allocation that was not written back into their queues (they
    /// were the whole queues when taken).
    fn restore_allocation(&mut self, event: TrackerEvent, bounds: Vec<Bounds>) {
        let TrackerEvent::BatchAllocation(BatchAllocationEvent { blocks, .. }) = event else {
            unreachable!("only allocations are restored")
        };
        // `AllocatedBlocks` lists every configured stream once, sorted, as `stream_ids` is.
        for (StreamBlocks { stream_id, blocks }, bounds) in
            blocks.into_streams().into_iter().zip(bounds)
        {
            self.queue_of(stream_id).restore(blocks, bounds);
        }
    }

    fn apply_allocation(&mut self, event: TrackerEvent) {
        let TrackerEvent::BatchAllocation(BatchAllocationEvent { time, blocks }) = event else {
            unreachable!("only allocations are applied")
        };
        self.allocated.insert(time, blocks);
        self.last_allocated = Some(time);
    }

    fn is_stale_batch(&self, time: BatchTime) -> bool {
        if let Some(last) = self.last_allocated {
            if time <= last {
                tracing::info!(
                    batch = time.0,
                    last_allocated = last.0,
                    "possibly processed batch {time} needs to be processed again in WAL recovery"
                );
                return true;
            }
        }
        false
    }

    /// Allocates every unallocated block of the configured streams to batch `time`, after
    /// journaling the allocation durably (SPEC D.3). A time not newer than the last allocated
    /// one does nothing. If the write fails, nothing changes and the caller is not told (the
    /// same time can be retried). An allocation too large for one log record takes the oldest
    /// blocks of each stream that fit (halving the count until the record fits, then, at one
    /// block per stream, halving the streams taken, those with the oldest blocks first, and
    /// halving their counts again); the rest stay queued for the next batch. (Taking
    /// everything, as SPEC D.3 says, would fail the same way for every later batch, each
    /// larger still: allocation would stop for good.)
    ///
    /// # Errors
    /// Only [`BlockTrackerError::LogRaised`] (an injected log step raised); nothing changed.
    pub fn allocate_blocks_to_batch(&mut self, time: BatchTime) -> Result<(), BlockTrackerError> {
        if self.is_stale_batch(time) {
            return Ok(());
        }
        let (event, bounds, appended) = self.append_allocation(time)?;
        let logged = match appended {
            Append::Disabled => true,
            Append::Appended(lsn) => self.wait(event.kind(), lsn),
            Append::Failed | Append::TooLarge => false,
        };
        if logged {
            self.apply_allocation(event);
        } else {
            tracing::info!(batch = time.0, "possibly processed batch {time} was not allocated");
            self.restore_allocation(event, bounds);
        }
        Ok(())
    }

    /// [`Self::allocate_blocks_to_batch`] without waiting (see [`Logged`]).
    ///
    /// # Errors
    /// As [`Self::allocate_blocks_to_batch`].
    pub fn allocate_blocks_to_batch_deferred(
        &mut self,
        time: BatchTime,
    ) -> Result<Logged, BlockTrackerError> {
        if self.is_stale_batch(time) {
            return Ok(Logged::Skipped);
        }
        let (event, bounds, appended) = self.append_allocation(time)?;
        let outcome = match appended {
            Append::Disabled => Logged::Done,
            Append::Appended(lsn) => Logged::Pending(lsn),
            Append::Failed | Append::TooLarge => Logged::Failed,
        };
        if let Logged::Pending(lsn) = outcome {
            self.note_undurable_allocation(lsn, &bounds);
        }
        if outcome == Logged::Failed {
            self.restore_allocation(event, bounds);
        } else {
            self.apply_allocation(event);
        }
        Ok(outcome)
    }

    /// Remembers the oldest addition a deferred allocation at `lsn` took, until that
    /// allocation is durable (entries already durable are dropped here and when cleaning, so
    /// this holds at most the allocations in flight).
    fn note_undurable_allocation(&mut self, lsn: Lsn, bounds: &[Bounds]) {
        self.forget_durable_allocations();
        let oldest = bounds.iter().flatten().map(|(addition, _)| *addition).min();
        if let Some(oldest) = oldest {
            self.undurable_allocations.push_back((lsn, oldest));
        }
    }

    fn forget_durable_allocations(&mut self) {
        let Some(log) = &self.log else { return };
        let durable = log.durable_lsn();
        while self.undurable_allocations.front().is_some_and(|(lsn, _)| *lsn <= durable) {
            self.undurable_allocations.pop_front();
        }
    }

    /// Takes batch `time`'s allocation and appends it; one too large for a log record is put
    /// back and taken again with at most half as many blocks per stream, then, at one block
    /// per stream, from half as many streams (all their blocks, then halving again), until it
    /// fits (or a single block does not: then `TooLarge`). Returns the event taken, its bounds
    /// and the append's outcome.
    ///
    /// # Errors
    /// An error of the log step ([`BlockTrackerError::LogRaised`]); the blocks are put back.
    fn append_allocation(
        &mut self,
        time: BatchTime,
    ) -> Result<(TrackerEvent, Vec<Bounds>, Append), BlockTrackerError> {
        let mut limit = AllocationLimit { blocks_per_stream: usize::MAX, streams: usize::MAX };
        let mut tries = 0_u32;
        loop {
            tries += 1;
            let (event, bounds) = self.take_allocation(time, limit);
            let appended = match self.append(&event) {
                Ok(appended) => appended,
                Err(error) => {
                    self.restore_allocation(event, bounds);
                    return Err(error);
                }
            };
            let taken = bounds.iter().map(|stream| stream.iter().map(|(_, n)| n).sum::<usize>());
            let largest = taken.clone().max().unwrap_or(0);
            let streams = taken.filter(|blocks| *blocks > 0).count();
            let too_large = matches!(appended, Append::TooLarge);
            if !too_large || (largest <= 1 && streams <= 1) {
                if tries > 1 || too_large {
                    tracing::warn!(
                        batch = time.0,
                        tries,
                        blocks_per_stream = largest,
                        streams,
                        fits = !too_large,
                        "allocation too large for one log record: retried with fewer blocks"
                    );
                }
                return Ok((event, bounds, appended));
            }
            self.restore_allocation(event, bounds);
            if largest > 1 {
                limit.blocks_per_stream = largest / 2;
            } else {
                // Half the streams, and all their blocks again: kept at one block per stream,
                // every batch would take one block per stream while a large block waits.
                limit.streams = streams / 2;
                limit.blocks_per_stream = usize::MAX;
            }
        }
    }

    fn cleanup_times(&self, threshold: BatchTime) -> Result<Vec<BatchTime>, BlockTrackerError> {
        let now_ms = self.clock.now_ms();
        if threshold.0 >= now_ms {
            return Err(BlockTrackerError::ThresholdNotInPast {
                threshold_ms: threshold.0,
                now_ms,
            });
        }
        Ok(self.allocated.range(..threshold).map(|(time, _)| *time).collect())
    }

    fn forget_batches(&mut self, times: &[BatchTime]) {
        for time in times {
            if let Some(blocks) = self.allocated.remove(time) {
                for StreamBlocks { blocks, .. } in blocks.into_streams() {
                    self.keep_spare(blocks);
                }
            }
        }
    }

    /// Keeps a forgotten batch's vector as a spare, emptied: the largest [`SPARE_MAX`] are
    /// kept, so that a batch larger than the usual (a slow batch loop, a burst) finds the
    /// memory of the last large one instead of faulting in fresh pages, a cost that grows
    /// with the batch and so makes the next batch larger still. Spares much larger than
    /// recent allocations (`spare_capacity_max`) are freed. A vector too small to keep goes
    /// to the receivers' pool (a receiver's record vector that became a batch as it was) or
    /// is freed.
    fn keep_spare(&mut self, mut blocks: Vec<ReceivedBlockInfo>) {
        let useful_max = self.spare_capacity_max();
        self.spare.retain(|spare| spare.capacity() <= useful_max);
        if blocks.capacity() < SPARE_CAPACITY_MIN || blocks.capacity() > useful_max {
            self.recycled.give_back(blocks);
            return;
        }
        blocks.clear();
        if self.spare.len() < SPARE_MAX {
            self.spare.push(blocks);
            return;
        }
        let smallest = (0..self.spare.len())
            .min_by_key(|index| self.spare[*index].capacity())
            .expect("the spares are full");
        if blocks.capacity() > self.spare[smallest].capacity() {
            blocks = std::mem::replace(&mut self.spare[smallest], blocks);
        }
        self.recycled.give_back(blocks);
    }

    /// Forgets the batches older than `threshold` (strictly) after journaling a cleanup event
    /// (written even when there is none), then deletes WAL files whose end time is below
    /// `threshold` (with `wait`, durably before returning). If the write fails nothing is
    /// removed and no file is deleted.
    ///
    /// A file holding the addition of a block still queued for a configured stream stays until
    /// that block is allocated ([`Self::clean_log`]): allocations too large for one record take
    /// part of the queue, so such blocks can wait past a cleanup. As in Spark, the files go
    /// whatever else they hold: blocks of a stream missing from the configured ids (never
    /// allocated) stay queued in this tracker, but their additions leave the journal, so a
    /// tracker recovered after this does not have them.
    ///
    /// # Errors
    /// [`BlockTrackerError::ThresholdNotInPast`] unless `threshold` is before the clock's
    /// time (checked before anything else); [`BlockTrackerError::LogRaised`];
    /// [`BlockTrackerError::Wal`] if the log refused the cleaning (read-only) or, with
    /// `wait`, syncing the directory after the deletions failed. A file that cannot be deleted
    /// is logged and skipped, as SPEC E.4 wants.
    pub fn cleanup_old_batches(
        &mut self,
        threshold: BatchTime,
        wait: bool,
    ) -> Result<(), BlockTrackerError> {
        let times = self.cleanup_times(threshold)?;
        tracing::debug!(threshold = threshold.0, batches = times.len(), "cleaning up old batches");
        let event = TrackerEvent::BatchCleanup(BatchCleanupEvent { times });
        if self.write_to_log(&event)? {
            let TrackerEvent::BatchCleanup(BatchCleanupEvent { times }) = &event else {
                unreachable!("built above")
            };
            self.forget_batches(times);
            self.clean_log(threshold, wait)?;
        } else {
            tracing::warn!(
                threshold = threshold.0,
                "failed to acknowledge batch cleanup in the log"
            );
        }
        Ok(())
    }

    /// [`Self::cleanup_old_batches`] without waiting and without deleting files: once the
    /// returned LSN is durable the caller runs [`Self::clean_log`].
    ///
    /// # Errors
    /// As [`Self::cleanup_old_batches`], except file deletion.
    pub fn cleanup_old_batches_deferred(
        &mut self,
        threshold: BatchTime,
    ) -> Result<Logged, BlockTrackerError> {
        let times = self.cleanup_times(threshold)?;
        let event = TrackerEvent::BatchCleanup(BatchCleanupEvent { times });
        let outcome = match self.append(&event)? {
            Append::Disabled => Logged::Done,
            Append::Appended(lsn) => Logged::Pending(lsn),
            Append::Failed | Append::TooLarge => Logged::Failed,
        };
        if outcome != Logged::Failed {
            let TrackerEvent::BatchCleanup(BatchCleanupEvent { times }) = &event else {
                unreachable!("built above")
            };
            self.forget_batches(times);
        }
        Ok(outcome)
    }

    /// Deletes WAL files whose end time is strictly below `threshold` (nothing without a WAL),
    /// except those from the oldest addition of a block still needed on: queued for a
    /// configured stream, or taken by a deferred allocation whose record is not durable yet.
    /// That addition record is the block's only durable trace until its allocation record is
    /// (acknowledged blocks must survive a crash).
    ///
    /// # Errors
    /// [`BlockTrackerError::Wal`] from the log.
    pub fn clean_log(&mut self, threshold: BatchTime, wait: bool) -> Result<(), BlockTrackerError> {
        self.forget_durable_allocations();
        if let Some(log) = &self.log {
            log.clean(threshold.0, self.oldest_needed_addition(), wait)?;
        }
        Ok(())
    }

    /// The LSN of the oldest addition record of a block queued for a configured stream or
    /// taken by an allocation not known durable.
    fn oldest_needed_addition(&self) -> Option<Lsn> {
        let queued = self
            .stream_ids
            .iter()
            .filter_map(|stream| self.unallocated.get(stream))
            .filter_map(StreamQueue::oldest_lsn);
        let allocating = self.undurable_allocations.iter().map(|(_, oldest)| *oldest);
        queued.chain(allocating).min()
    }

    /// The blocks allocated to batch `time` (empty if none).
    pub fn blocks_of_batch(&self, time: BatchTime) -> AllocatedBlocks {
        self.allocated.get(&time).cloned().unwrap_or_default()
    }

    /// The blocks of `stream` allocated to batch `time` (empty if none).
    pub fn blocks_of_batch_and_stream(
        &self,
        time: BatchTime,
        stream: StreamId,
    ) -> Vec<ReceivedBlockInfo> {
        self.allocated
            .get(&time)
            .map(|blocks| blocks.blocks_of_stream(stream).to_vec())
            .unwrap_or_default()
    }

    /// Whether any stream has unallocated blocks.
    pub fn has_unallocated_blocks(&self) -> bool {
        self.unallocated.values().any(|queue| !queue.is_empty())
    }

    /// The streams that have blocks queued but are missing from the configured stream ids:
    /// their blocks are never allocated (SPEC D), and stay queued while the tracker lives (a
    /// cleanup past their time removes their additions from the journal, though:
    /// [`Self::cleanup_old_batches`]).
    pub fn unconfigured_streams(&self) -> Vec<StreamId> {
        self.unallocated
            .iter()
            .filter(|(stream, queue)| {
                !queue.is_empty() && self.stream_ids.binary_search(stream).is_err()
            })
            .map(|(stream, _)| *stream)
            .collect()
    }

    /// The unallocated blocks of `stream`, oldest first.
    pub fn unallocated_blocks(&self, stream: StreamId) -> Vec<ReceivedBlockInfo> {
        self.unallocated.get(&stream).map(StreamQueue::to_vec).unwrap_or_default()
    }

    /// The allocated batch times, oldest first.
    pub fn allocated_batch_times(&self) -> Vec<BatchTime> {
        self.allocated.keys().copied().collect()
    }

    /// The last allocated batch time.
    pub fn last_allocated_batch_time(&self) -> Option<BatchTime> {
        self.last_allocated
    }

    /// Closes the log (idempotent; the WAL's log waits at most [`WAL_CLOSE_TIMEOUT`]). Later
    /// writes fail; reads keep working.
    ///
    /// # Errors
    /// [`BlockTrackerError::Wal`] if the log had failed, or did not close in time.
    pub fn stop(&mut self) -> Result<(), BlockTrackerError> {
        if let Some(log) = &self.log {
            log.close()?;
        }
        Ok(())
    }

    // ----- recovery -----------------------------------------------------------------------

    /// Replaces the state with the replay of the log's durable prefix (blocks added since
    /// construction keep `block_id_valid = true`: the executors still hold them; blocks
    /// recovered at construction stay invalid; a tracker opened without recovery skips what
    /// the log held then, as it never had it). A host of the `*_deferred`
    /// methods calls this when the log fails before its pending events became durable.
    /// Returns the number of events replayed.
    ///
    /// # Errors
    /// A damaged or unreadable journal. The state is then empty (not the part replayed
    /// before the error).
    pub fn rebuild_from_log(&mut self) -> Result<u64, BlockTrackerError> {
        let last = self.log.as_ref().map(|log| log.durable_lsn());
        self.forget_state();
        if last.is_none() {
            return Ok(0);
        }
        match self.replay(last, self.unrecovered_through, self.recovered_through) {
            Ok(replayed) => Ok(replayed.events),
            Err(error) => {
                self.forget_state();
                Err(error)
            }
        }
    }

    /// Empties the queues and the allocations (the configuration stays).
    fn forget_state(&mut self) {
        self.unallocated.clear();
        self.allocated.clear();
        self.last_allocated = None;
    }

    /// Replays the log up to `last` (all if `None`), skipping events up to `skip_through`;
    /// additions up to `invalid_through` are marked invalid.
    fn replay(
        &mut self,
        last: Option<Lsn>,
        skip_through: Lsn,
        invalid_through: Lsn,
    ) -> Result<Replayed, BlockTrackerError> {
        let mut replayed = Replayed { events: 0, through: Lsn::ZERO, longest_metadata_bytes: 0 };
        let Some(log) = self.log.clone() else {
            return Ok(replayed);
        };
        let Replayed { events, through, longest_metadata_bytes } = &mut replayed;
        self.replaying = true;
        let mut apply = |lsn: Lsn, event: TrackerEvent| match event {
            _ if lsn <= skip_through => {}
            TrackerEvent::BlockAddition(BlockAdditionEvent { mut info }) => {
                *through = lsn;
                *events += 1;
                *longest_metadata_bytes =
                    (*longest_metadata_bytes).max(limit::metadata_bytes(&info));
                if lsn <= invalid_through {
                    info.set_block_id_valid(false);
                }
                self.enqueue(lsn, info);
            }
            TrackerEvent::BlockAdditions(BlockAdditionsEvent { mut infos }) => {
                *through = lsn;
                *events += infos.len() as u64;
                let longest = infos.iter().map(limit::metadata_bytes).max().unwrap_or(0);
                *longest_metadata_bytes = (*longest_metadata_bytes).max(longest);
                if lsn <= invalid_through {
                    for info in &mut infos {
                        info.set_block_id_valid(false);
                    }
                }
                self.apply_logged_additions(lsn, infos);
            }
            TrackerEvent::BatchAllocation(BatchAllocationEvent { time, blocks }) => {
                *through = lsn;
                *events += 1;
                for entry in blocks.streams() {
                    if let Some(queue) = self.unallocated.get_mut(&entry.stream_id) {
                        queue.remove_listed(&entry.blocks);
                    }
                }
                self.allocated.insert(time, blocks);
                self.last_allocated = Some(time);
            }
            TrackerEvent::BatchCleanup(BatchCleanupEvent { times }) => {
                *through = lsn;
                *events += 1;
                self.forget_batches(&times);
            }
        };
        let outcome = log.replay(last, &mut apply);
        self.replaying = false;
        outcome?;
        Ok(replayed)
    }
}

/// What a replay went through.
struct Replayed {
    /// Events replayed (an event of several additions counts each).
    events: u64,
    /// The last LSN applied.
    through: Lsn,
    /// The longest metadata of a block added (allocated or not).
    longest_metadata_bytes: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;

    /// A plain block (in a block manager, one record) for the tests of this module and its
    /// submodules.
    pub(super) fn info(stream: i32, unique_id: u64) -> ReceivedBlockInfo {
        let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
        ReceivedBlockInfo::new(
            StreamId(stream),
            Some(1),
            None,
            BlockStoreResult::BlockManager { block_id },
        )
        .unwrap()
    }

    fn ids(blocks: &[ReceivedBlockInfo]) -> Vec<u64> {
        blocks.iter().map(|block| block.block_id().unique_id).collect()
    }

    /// A record's blocks in a vector of a receiver's batch size, as receivers hand them over.
    fn record(blocks: &[ReceivedBlockInfo]) -> Vec<ReceivedBlockInfo> {
        let mut record = Vec::with_capacity(receiver::COMBINE_MAX_BLOCKS);
        record.extend_from_slice(blocks);
        record
    }

    #[test]
    fn logged_records_of_one_two_and_three_streams_queue_each_block_in_its_stream_in_order() {
        let config = BlockTrackerConfig::new([StreamId(1), StreamId(2), StreamId(3)]);
        let mut tracker = ReceivedBlockTracker::with_log(config, Arc::new(SystemClock), None)
            .expect("no log to replay");
        let recycled = tracker.recycled_vectors();
        // One block: queued inline, its vector recycled at once.
        tracker.apply_logged_additions(Lsn(1), record(&[info(1, 10)]));
        assert_eq!(recycled.len(), 1);
        tracker.apply_logged_additions(Lsn(2), record(&[info(2, 20), info(2, 21)]));
        tracker.apply_logged_additions(
            Lsn(3),
            record(&[info(1, 11), info(2, 22), info(1, 12), info(2, 23), info(1, 13)]),
        );
        tracker.apply_logged_additions(
            Lsn(4),
            record(&[info(3, 30), info(1, 14), info(2, 24), info(3, 31), info(2, 25)]),
        );
        assert_eq!(ids(&tracker.unallocated_blocks(StreamId(1))), [10, 11, 12, 13, 14]);
        assert_eq!(ids(&tracker.unallocated_blocks(StreamId(2))), [20, 21, 22, 23, 24, 25]);
        assert_eq!(ids(&tracker.unallocated_blocks(StreamId(3))), [30, 31]);
        assert_eq!(recycled.len(), 1, "the other vectors are queued chunks");
        // Allocating empties the chunks: the batch-sized vectors of records 2 and 3 (stream
        // 1 and 2 have several chunks) go back; stream 3's one chunk is the allocation's
        // vector; the small vectors the other streams' blocks moved to are freed.
        tracker.allocate_blocks_to_batch(BatchTime(100)).expect("no log to fail");
        assert_eq!(recycled.len(), 3);
        let batch = tracker.blocks_of_batch(BatchTime(100));
        assert_eq!(ids(batch.blocks_of_stream(StreamId(1))), [10, 11, 12, 13, 14]);
        assert_eq!(ids(batch.blocks_of_stream(StreamId(2))), [20, 21, 22, 23, 24, 25]);
        assert_eq!(ids(batch.blocks_of_stream(StreamId(3))), [30, 31]);
        // Cleaning the batch up recycles stream 3's record vector too.
        tracker.cleanup_old_batches(BatchTime(101), false).expect("no log to fail");
        assert_eq!(recycled.len(), 4);
    }

    #[test]
    fn stream_groups_are_queued_as_they_are_and_small_ones_give_their_vector_back() {
        let config = BlockTrackerConfig::new([StreamId(1), StreamId(2)]);
        let mut tracker = ReceivedBlockTracker::with_log(config, Arc::new(SystemClock), None)
            .expect("no log to replay");
        let recycled = tracker.recycled_vectors();
        let half = receiver::COMBINE_MAX_BLOCKS / 2;
        let large: Vec<_> = (0..half as u64).map(|id| info(1, id)).collect();
        let small = [info(2, 7), info(2, 8)];
        tracker.queue_stream_group(Lsn(2), StreamId(1), record(&large));
        tracker.queue_stream_group(Lsn(2), StreamId(2), record(&small));
        tracker.queue_stream_group(Lsn(3), StreamId(1), Vec::new());
        assert_eq!(recycled.len(), 1, "only the small group's vector came back");
        assert_eq!(tracker.unallocated_blocks(StreamId(1)), large);
        assert_eq!(tracker.unallocated_blocks(StreamId(2)), small);
    }

    #[test]
    fn the_largest_spare_vectors_are_kept_while_recent_allocations_need_them() {
        let config = BlockTrackerConfig::new([StreamId(1)]);
        let mut tracker = ReceivedBlockTracker::with_log(config, Arc::new(SystemClock), None)
            .expect("no log to replay");
        // As if a recent allocation took 50 000 blocks of a stream.
        tracker.recent_allocation_max = 50_000;
        let capacities = |tracker: &ReceivedBlockTracker| -> Vec<usize> {
            let mut capacities: Vec<usize> = tracker.spare.iter().map(Vec::capacity).collect();
            capacities.sort_unstable();
            capacities
        };
        for step in 0..SPARE_MAX {
            tracker.keep_spare(Vec::with_capacity(SPARE_CAPACITY_MIN + step));
        }
        tracker.keep_spare(Vec::with_capacity(SPARE_CAPACITY_MIN - 1));
        tracker.keep_spare(Vec::with_capacity(SPARE_CAPACITY_MIN));
        assert_eq!(
            capacities(&tracker),
            (0..SPARE_MAX).map(|step| SPARE_CAPACITY_MIN + step).collect::<Vec<_>>()
        );
        let mut large = Vec::with_capacity(100_000);
        large.push(info(1, 1));
        tracker.keep_spare(large);
        let kept = capacities(&tracker);
        assert_eq!(kept.len(), SPARE_MAX);
        assert_eq!(kept[0], SPARE_CAPACITY_MIN + 1, "the smallest made room");
        assert!(kept[SPARE_MAX - 1] >= 100_000);
        assert!(tracker.spare.iter().all(Vec::is_empty));
        // Far larger than recent allocations need: not kept.
        tracker.keep_spare(Vec::with_capacity(200_000));
        assert!(capacities(&tracker).iter().all(|capacity| *capacity < 200_000));
        // Each allocation decays the recent largest by 1/128; once batches are small, the
        // large spare is freed.
        tracker.recent_allocation_max = 1_280;
        tracker.allocate_blocks_to_batch(BatchTime(1)).expect("no log to fail");
        assert_eq!(tracker.recent_allocation_max, 1_270);
        tracker.keep_spare(Vec::with_capacity(SPARE_CAPACITY_MIN));
        assert!(capacities(&tracker).iter().all(|capacity| *capacity <= 2 * (1_270 + 317)));
    }

    #[test]
    fn a_block_info_stays_small() {
        // The tracker holds millions; the size is what its queues and batches move around.
        assert!(std::mem::size_of::<ReceivedBlockInfo>() <= 40);
        assert_eq!(info(1, 1).num_records(), Some(1));
    }

    #[test]
    fn equality_and_hash_ignore_the_valid_flag() {
        use std::hash::BuildHasher;
        let a = info(1, 1);
        let mut b = a.clone();
        b.set_block_id_valid(false);
        assert_eq!(a, b);
        let hasher = std::collections::hash_map::RandomState::new();
        assert_eq!(hasher.hash_one(&a), hasher.hash_one(&b));
        // Empty metadata is metadata; a receiver-log block is not a block-manager one.
        let block_id = a.block_id();
        let store = BlockStoreResult::BlockManager { block_id };
        let with_empty_metadata =
            ReceivedBlockInfo::new(StreamId(1), Some(1), Some(Vec::new()), store).unwrap();
        assert_ne!(a, with_empty_metadata);
        assert_eq!(with_empty_metadata.metadata(), Some(&[][..]));
        let handle =
            crate::wal::RecordHandle { segment: crate::wal::SegmentId(1), offset: 64, len: 9 };
        let in_log = BlockStoreResult::ReceiverWal { block_id, handle };
        let logged = ReceivedBlockInfo::new(StreamId(1), Some(1), None, in_log).unwrap();
        assert_ne!(a, logged);
        assert_eq!(logged.store_result(), in_log);
        assert_eq!(a.store_result(), store);
    }

    #[test]
    fn events_round_trip_through_rkyv() {
        let events = vec![
            TrackerEvent::BlockAddition(BlockAdditionEvent { info: info(1, 1) }),
            TrackerEvent::BatchAllocation(BatchAllocationEvent {
                time: BatchTime(5),
                blocks: AllocatedBlocks::new([
                    (StreamId(1), vec![info(1, 1)]),
                    (StreamId(2), vec![]),
                ]),
            }),
            TrackerEvent::BatchCleanup(BatchCleanupEvent { times: vec![BatchTime(1)] }),
        ];
        for event in events {
            let bytes = event.encode().unwrap();
            assert_eq!(TrackerEvent::decode(&bytes).unwrap(), event);
        }
    }
}
