//! [`DurableQuery`]: the offset log and commit log of SPEC B.9 / 0.3 kept in coordbus's WAL.
//!
//! # Records
//! Every record is one rkyv-archived [`LogRecord`] appended with the **epoch number as its
//! record time**:
//! * `Offsets { run, epoch, count, partitions, width, ends, data }`: the `count` offsets of
//!   one epoch, sorted by partition id, as flat arrays, so serializing 1000 offsets is a few
//!   copies, not 1000 small vectors. The common case is compact: `partitions` is empty when the
//!   ids are exactly `0..count`, and `ends` is empty when every payload is `width` bytes long
//!   (payload `i` is then `data[i * width..][..width]`, else `data[ends[i-1]..ends[i]]`). For
//!   1000 partitions with 8-byte offsets a record is about 8 KiB. It is archived straight from
//!   the coordinator's offsets, in one pass in the compact case (module `log_record`).
//! * `Commit { run, epoch }`: the epoch was committed (appended after the sink commit).
//! * `OffsetsDelta { run, epoch, base_epoch, count, width, word_bytes, deltas }`: the offsets of
//!   one epoch as the difference from the offsets record the run appended just before it (of
//!   epoch `base_epoch`, full or delta), 3/8 of the bytes for offsets that advance by about
//!   2^20 an epoch (module `delta`). A record is a delta when the layout is compact and the
//!   same as its base's, and the epoch is after the last full record's (the chain's keyframe)
//!   by fewer than 64 epochs (and fewer than `retained_epochs`); else it is full, and a compact
//!   full record starts the next chain.
//! * `OffsetsDeltaOfDelta { .. }`, the same fields: a second-order delta, each value the
//!   difference from what the base record moved its word by; no bytes at all for offsets that
//!   advance steadily, as the load generator's do (module `delta`, "Orders"). Each delta record
//!   is of the order that takes fewer bytes.
//!
//! Logs written before delta records existed open unchanged (the archived enum keeps its size,
//! a compile-time check in `log_record`), and so do logs whose deltas all name their keyframe
//! as the base (the first version of delta records) and logs of first-order deltas only (the
//! versions before second-order ones). A build from before delta records cannot open a log
//! holding them, nor one from before second-order deltas a log holding those (an unknown
//! record: [`EpochError::BadLogRecord`]), nor can one with the first version open a log of
//! chained deltas (a delta whose base is not the last full record:
//! [`EpochError::BadLogRecord`], which then wrongly suggests a skipped segment).
//!
//! `run` numbers the openings of the log (the highest run found on recovery, plus one), and
//! each coordinator the query is handed to takes the next number (`Query::begin_run`). It is
//! what makes "the first record of an epoch wins" safe across restarts: a run that stopped may
//! have logged offsets for epochs after its last commit, and the next run (which restarts from
//! the last committed epoch, SPEC B.10) logs that epoch's offsets again, possibly different.
//! On replay, offsets of a newer run replace those of an older run; within one run the first
//! record of an epoch wins (later ones are not even appended). Counting one per opening and
//! per coordinator, no real log gets near 2^63 runs: recovery refuses a record of a higher run
//! ([`MAX_RECOVERED_RUN`]), so that the numbers after any run it accepts stay fresh (a run that
//! reused the number of the run before would have that run's offsets win on replay). Like any
//! bound on a growing count, it has an edge: a run that started from a (forged) record at the
//! bound writes numbers above it, and the opening after it fails with a typed error.
//!
//! # Recovery (SPEC B.10)
//! Opening reads every record in LSN order, keeping only record handles (the last committed
//! epoch `E` and, per epoch after the newest commit, where its winning offsets are, within the
//! chain of its run's records since the last full one). `E`'s offsets are decoded at the end,
//! along its chain from the keyframe; a delta whose base is not in its chain (lost with a
//! segment skipped as corrupt) fails with [`EpochError::BadLogRecord`] naming both epochs.
//! No commit: the run starts at epoch 0. A commit without
//! offsets fails with [`EpochError::CommittedWithoutOffsets`] (Spark's message). Offsets of
//! epochs after `E` are ignored.
//!
//! # Durability without blocking
//! Appends return at once (group commit: the WAL's sync thread makes records durable in
//! groups). The coordinator thread never waits for an fsync: a commit record becomes durable
//! shortly after the sink commit, and a crash in between makes the restarted run commit that
//! epoch again (SPEC B.5's at-least-once). [`DurableQueryStatus::durable_committed`] tells
//! which commits are durable already: the commit records' LSNs wait in a queue that is drained
//! against the WAL's durable LSN by each commit and by status readers (no callback per
//! commit, which would cost the coordinator thread a wake-up). Once the WAL has failed (a
//! failed write or sync, seen by an append or a wait), `add_offsets` and `commit` fail, which
//! fail-stops the coordinator (SPEC 0.3). Dropping the query closes the log, which writes and
//! syncs everything appended: a clean stop leaves every commit durable.
//!
//! # Keeping the log bounded
//! Because the record time is the epoch, the WAL's time-based `clean` drops whole segments of old
//! epochs: on a commit, with `D` the last commit known durable, segments whose largest epoch is
//! below `D + 1 - retained_epochs` are deleted (Spark's `minBatchesToRetain`, default 100), at most
//! once every `max(1, retained_epochs / 4)` epochs. `D`'s own records have time `D`, never below
//! the threshold, so a crash always finds at least `D`. The threshold follows the durable commit,
//! not the last appended one: the segment of an appended commit may not be written yet, and
//! cleaning by it once deleted the only segments a crash could recover from (found by the kill -9
//! test). With `Durability::None`, which counts a written record durable and syncs only sealed
//! segments, `D` is the last commit known synced instead: by a written one, cleaning deleted every
//! synced segment, and a power loss left no commit at all (found by review, now tested in
//! `epoch_power_loss`). (If the WAL is configured with a rolling interval, that interval is counted
//! in epochs.) Cleaning deletes only a prefix of the segments, so a record of an epoch far after
//! the last commit would keep its segment and all later ones until the commits pass it, for good if
//! they never do (one report for a distant epoch): offsets more than `max(retained_epochs, 64)`
//! epochs ahead wait in memory (at most [`DEFERRED_ENTRIES_MAX`] offsets) and are logged just
//! before their epoch's commit (`DurableQuery::log_ahead_epochs`).

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet, VecDeque},
    path::Path,
    rc::Rc,
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak,
    },
    time::{Duration, Instant},
};

use rkyv::{rancor, util::AlignedVec};

use super::{
    clamp_retained_epochs,
    delta::{as_delta, ChainDecoder, DeltaEncoder, KEYFRAME_INTERVAL},
    log_record::{
        decode_offsets, ArchivedLogRecord, LogRecord, LogRecordRef, OffsetsRecordRef, TooLarge,
    },
    worth_a_warning, CollaboratorError, Epoch, EpochError, Offsets, PartitionId, Payload, Query,
};
use crate::wal::{Durability, Lsn, RecordHandle, Wal, WalConfig, WalError};

/// The default number of committed epochs whose records are retained (Spark's
/// `spark.sql.streaming.minBatchesToRetain`).
pub const DEFAULT_RETAINED_EPOCHS: usize = 100;

/// The longest an append waits for room in the WAL's staging buffer by default (the disk
/// stalled): the coordinator's thread then fails the query instead of waiting for good
/// ([`DurableQuery::with_write_timeout`]).
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The most offsets a [`DurableQuery`] keeps in memory for epochs too far ahead to log yet
/// (their commit logs them): beyond it, such offsets are logged at once, which only delays the
/// cleaning of the log until the commits pass them. The coordinator's backlog limits keep it
/// far below this unless partition counts change under epochs far ahead.
pub const DEFERRED_ENTRIES_MAX: usize = 1 << 17;

/// The longest dropping the query waits for the log to write and sync what was appended.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(30);

/// A [`Query`] that does nothing: the default inner query of a [`DurableQuery`] when the
/// engine needs no callbacks of its own.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopQuery;

impl Query for NoopQuery {
    fn add_offsets(&mut self, _: Epoch, _: Offsets<'_>) -> Result<(), CollaboratorError> {
        Ok(())
    }
    fn commit(&mut self, _: Epoch) -> Result<(), CollaboratorError> {
        Ok(())
    }
    fn stop(&mut self, _: EpochError) {}
}

/// State shared between a [`DurableQuery`] and its [`DurableQueryStatus`] handles.
#[derive(Debug)]
struct Status {
    /// Last committed epoch (-1: none).
    last_committed: AtomicI64,
    /// Last committed epoch whose commit record is durable (-1: none).
    durable_committed: AtomicI64,
    /// The WAL's failure, once seen.
    wal_failure: OnceLock<WalError>,
    /// The first stop error.
    stop_error: Mutex<Option<Arc<EpochError>>>,
    /// Commits ignored because the epoch was already committed.
    ignored_commits: AtomicU64,
    /// Offsets ignored because the epoch was already committed.
    ignored_offsets: AtomicU64,
    /// Commit records not yet known durable, and who waits for a commit.
    pending: Mutex<PendingCommits>,
    /// Signalled when a commit is queued while someone waits for one, and when commits end.
    commit_queued: Condvar,
    /// The log (not kept open by status handles).
    wal: Weak<Wal>,
}

/// How many commits [`SyncedCommits`] tracks at most.
const SYNCED_COMMITS_TRACKED: usize = 1024;

/// With [`Durability::None`], the last commit that a power loss keeps: the WAL counts a written
/// record durable there, but syncs only when a segment is sealed. Cleaning follows this commit
/// instead of the durable one, so that it never deletes synced segments on the strength of a
/// commit that only the page cache holds (a power loss would then leave no commit at all, and
/// the query would restart from epoch 0).
#[derive(Debug)]
struct SyncedCommits {
    /// Commit records not yet known synced, `(lsn, epoch)` in order. At most
    /// [`SYNCED_COMMITS_TRACKED`]: when full, the newest entry is replaced, so the answer can
    /// only lag behind, never run ahead.
    unsynced: VecDeque<(u64, i64)>,
    /// The last commit known synced (-1: none).
    last: i64,
}

impl SyncedCommits {
    fn new(recovered: i64) -> Self {
        Self { unsynced: VecDeque::new(), last: recovered }
    }

    fn appended(&mut self, lsn: Lsn, epoch: Epoch) {
        if self.unsynced.len() == SYNCED_COMMITS_TRACKED {
            self.unsynced.pop_back();
        }
        self.unsynced.push_back((lsn.0, epoch.0));
    }

    /// The last commit whose record is at most `synced` (-1: none).
    fn last_synced(&mut self, synced: Lsn) -> i64 {
        while let Some(&(_, epoch)) = self.unsynced.front().filter(|(lsn, _)| *lsn <= synced.0) {
            self.last = epoch;
            self.unsynced.pop_front();
        }
        self.last
    }
}

/// Commit records not yet known durable, and the readers waiting for a commit to be appended
/// ([`DurableQueryStatus::wait_durable_committed`]).
#[derive(Debug, Default)]
struct PendingCommits {
    /// `(lsn, epoch)`, in order.
    records: VecDeque<(u64, i64)>,
    /// Readers waiting on [`Status::commit_queued`]: a commit signals only if there are any (a
    /// signal is a system call, and commits come by the hundred thousand a second).
    waiters: usize,
    /// No more commits will come: the query was dropped, its WAL failed, or the coordinator
    /// fail-stopped (until a new run begins).
    ended: bool,
}

impl Status {
    fn fail(&self, error: &WalError) {
        if self.wal_failure.set(error.clone()).is_ok() {
            tracing::error!(%error, "the epoch log's WAL failed; the query stops committing");
        }
        self.end_commits();
    }

    fn pending(&self) -> MutexGuard<'_, PendingCommits> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues the commit record of `epoch` at `lsn` and wakes the readers waiting for a commit.
    fn queue_commit(&self, lsn: Lsn, epoch: Epoch) {
        let mut pending = self.pending();
        pending.records.push_back((lsn.0, epoch.0));
        if pending.waiters > 0 {
            self.commit_queued.notify_all();
        }
    }

    /// A new coordinator took the query (after an earlier one fail-stopped, maybe): commits
    /// may come again, unless the WAL failed.
    fn begin_commits(&self) {
        let mut pending = self.pending();
        pending.ended = self.wal_failure.get().is_some();
    }

    /// No commit will come any more: wakes every reader waiting for one.
    fn end_commits(&self) {
        let mut pending = self.pending();
        pending.ended = true;
        if pending.waiters > 0 {
            self.commit_queued.notify_all();
        }
    }

    /// The LSN of the commit record of `epoch` or a later one, once one is queued, waiting for
    /// it until `deadline` (`None`: no deadline). `None` if the deadline passed, commits ended,
    /// or `epoch` is durable already (its record left the queue).
    fn wait_committed(&self, epoch: Epoch, deadline: Option<Instant>) -> Option<Lsn> {
        let mut pending = self.pending();
        loop {
            let queued = pending.records.iter().find(|(_, committed)| *committed >= epoch.0);
            if let Some(&(lsn, _)) = queued {
                return Some(Lsn(lsn));
            }
            if self.durable_committed.load(Ordering::Acquire) >= epoch.0 || pending.ended {
                return None;
            }
            let left = match deadline {
                Some(deadline) => deadline.checked_duration_since(Instant::now())?,
                None => Duration::MAX,
            };
            pending.waiters += 1;
            pending = match self.commit_queued.wait_timeout(pending, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
            pending.waiters -= 1;
        }
    }

    /// Moves the commits whose records are durable (LSN at most `durable`) out of `pending`.
    fn advance(&self, durable: Lsn) {
        let mut pending = self.pending();
        let mut last = None;
        while let Some(&(lsn, epoch)) = pending.records.front() {
            if lsn > durable.0 {
                break;
            }
            last = Some(epoch);
            pending.records.pop_front();
        }
        if let Some(epoch) = last {
            self.durable_committed.fetch_max(epoch, Ordering::AcqRel);
        }
    }
}

fn epoch_or_none(value: i64) -> Option<Epoch> {
    (value >= 0).then_some(Epoch(value))
}

/// A cheap, cloneable view of a [`DurableQuery`]'s progress, usable from any thread while the
/// coordinator owns the query. It does not keep the WAL open.
#[derive(Debug, Clone)]
pub struct DurableQueryStatus(Arc<Status>);

impl DurableQueryStatus {
    /// The last committed epoch (recovered or committed by this run), if any.
    pub fn last_committed(&self) -> Option<Epoch> {
        epoch_or_none(self.0.last_committed.load(Ordering::Acquire))
    }

    /// The last committed epoch whose commit record is durable, if any. A restart recovers at
    /// least this epoch as committed.
    pub fn durable_committed(&self) -> Option<Epoch> {
        if let Some(wal) = self.0.wal.upgrade() {
            self.0.advance(wal.durable_lsn());
        }
        epoch_or_none(self.0.durable_committed.load(Ordering::Acquire))
    }

    /// Waits at most `timeout` until `epoch` (or a later one) is committed and its commit
    /// record durable, and returns whether it is. Returns `false` once no commit can come any
    /// more (the query was dropped, its WAL failed, or the coordinator fail-stopped) without
    /// `epoch` committed and durable, or when the timeout passes: [`Self::wal_failure`], or a
    /// fail-stop error in [`Self::stop_error`] ([`EpochError::is_fail_stop`]), then says which
    /// (neither: the timeout, or the query was dropped). An engine's own calls of
    /// [`Query::stop`] with a fail-stop error end the wait too. Two limits: the query is not
    /// told of `StopContinuousExecutionWrites`, so after it a wait for an epoch that will not
    /// commit runs to its timeout; and `stop_error` keeps the first error of the query's life,
    /// so in a run begun after a fail-stop ([`Query::begin_run`]) it names the old one.
    pub fn wait_durable_committed(&self, epoch: Epoch, timeout: Duration) -> bool {
        let status = &*self.0;
        let durable = |status: &Status| status.durable_committed.load(Ordering::Acquire) >= epoch.0;
        // A timeout too large for the clock (`Duration::MAX`) means no deadline.
        let deadline = Instant::now().checked_add(timeout);
        let Some(wal) = status.wal.upgrade() else {
            // The query is gone and its log closed (which synced or failed everything).
            return durable(status);
        };
        status.advance(wal.durable_lsn());
        if durable(status) {
            return true;
        }
        // None: no commit came in time, or the commit was made durable (and taken off the
        // queue) by another reader's `advance`.
        let Some(lsn) = status.wait_committed(epoch, deadline) else { return durable(status) };
        let left = deadline
            .map_or(Duration::MAX, |deadline| deadline.saturating_duration_since(Instant::now()));
        match wal.wait_durable_timeout(lsn, left) {
            Ok(()) => status.advance(lsn),
            Err(error @ WalError::Failed { .. }) => status.fail(&error),
            Err(_) => {}
        }
        durable(status)
    }

    /// The counters of the query's log, while it is open.
    pub fn wal_stats(&self) -> Option<crate::wal::WalStats> {
        self.0.wal.upgrade().map(|wal| wal.stats())
    }

    /// The WAL failure that stopped recording, if any.
    pub fn wal_failure(&self) -> Option<WalError> {
        self.0.wal_failure.get().cloned()
    }

    /// The first error the query was stopped with, typed (shared: the status keeps it too);
    /// [`EpochError::stop_text`] gives it as text with its causes and an overflow's values.
    pub fn stop_error(&self) -> Option<Arc<EpochError>> {
        self.0.stop_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Whether the query was asked to stop.
    pub fn is_stopped(&self) -> bool {
        self.stop_error().is_some()
    }

    /// Commits of already committed epochs that were ignored.
    pub fn ignored_commits(&self) -> u64 {
        self.0.ignored_commits.load(Ordering::Relaxed)
    }

    /// Offsets of already committed epochs that were ignored.
    pub fn ignored_offsets(&self) -> u64 {
        self.0.ignored_offsets.load(Ordering::Relaxed)
    }
}

/// Where a restarted run starts (SPEC B.10): the last committed epoch and its offsets.
pub type RestartPoint = (Epoch, Vec<(PartitionId, Payload)>);

/// The WAL-backed [`Query`]: Spark's offset log and commit log in coordbus's WAL (SPEC 0.3,
/// B.9, B.10), in front of an inner engine query `Q` that still gets every call (after the
/// append).
///
/// * Records: one rkyv record per epoch's offsets (appended once per epoch and run, compact flat
///   arrays; for an epoch more than `max(retained_epochs, 64)` after the last commit, just before
///   its commit instead of when complete) and one per committed epoch, each with the **epoch as its
///   WAL time** and tagged with the run (the opening of the log) that wrote it. On replay the first
///   offsets record of a run wins and a newer run's replaces an older run's, so offsets that a
///   stopped run logged after its last commit never shadow what the next run logs for that epoch.
/// * Recovery ([`DurableQuery::open`], [`DurableQuery::from_wal`]): the last committed epoch
///   and its offsets ([`DurableQuery::restart_point`]); offsets of later epochs are ignored.
/// * No waiting for syncs: appends return at once (unless the WAL's staging buffer is full,
///   when they wait for the disk to catch up: back-pressure, at most the write timeout,
///   [`DEFAULT_WRITE_TIMEOUT`], after which the record is refused with
///   [`WalError::AppendTimedOut`] and the coordinator stops the query); the WAL's sync thread
///   makes them durable (group commit). [`DurableQueryStatus`] says which commits are durable.
///   A crash before a commit record is durable makes the next run commit that epoch again
///   (at-least-once, SPEC B.5).
/// * Bounded: with `D` the last commit known durable (with [`Durability::None`], which syncs only
///   sealed segments: known synced), WAL segments holding only epochs below `D + 1 -
///   retained_epochs` are deleted (time-based `clean`, every `max(1, retained_epochs / 4)` epochs);
///   `D`'s records are never below that threshold, and every later commit is in a later segment. A
///   WAL rolling interval, if configured, counts epochs.
/// * Dropping the query closes the log (writing and syncing everything appended), waiting at
///   most [`CLOSE_TIMEOUT`].
///
/// Two queries cannot use one directory at once: the WAL locks it, and the second open fails
/// with [`EpochError::Wal`] holding [`WalError::Locked`].
///
/// A run, then its restart: the restarted coordinator starts after the last committed epoch,
/// and the engine resumes reading from that epoch's offsets.
///
/// ```
/// use std::time::Duration;
/// use coordbus::{coordinators::epoch::*, wal::WalConfig, Bus};
/// let dir = tempfile::tempdir()?;
/// {
///     let query = DurableQuery::open(dir.path(), WalConfig::default())?;
///     assert!(query.restart_point().is_none()); // a new query: start at epoch 0
///     let status = query.status(); // readable from any thread
///     let config = EpochConfig::new(query.start_epoch());
///     let bus = Bus::builder().inbox_shards(2).build()?;
///     let endpoint = EpochEndpoint::new(config, query, NoopSink)?;
///     let epoch = bus.register(coordinator_name("run1"), endpoint)?;
///     epoch.ask(SetReaderPartitions(1)).wait()?;
///     epoch.ask(SetWriterPartitions(1)).wait()?;
///     for _ in 0..2 {
///         let e = epoch.ask(IncrementAndGetEpoch).wait()? - 1; // the driver ends epoch e
///         epoch.send(ReportPartitionOffset { partition: 0, epoch: e, offset: (100 + e).into() })?;
///         epoch.send(CommitPartitionEpoch { partition: 0, epoch: e, message: e.into() })?;
///     }
///     assert!(status.wait_durable_committed(Epoch(1), Duration::from_secs(10)));
///     bus.shutdown()?; // drops the query, which closes the log
/// }
/// let query = DurableQuery::open(dir.path(), WalConfig::default())?;
/// let (last, offsets) = query.restart_point().expect("epochs 0 and 1 were committed");
/// assert_eq!((*last, offsets[0].1.as_i64()), (Epoch(1), Some(101)));
/// assert_eq!(query.start_epoch(), Epoch(2)); // EpochConfig::new(query.start_epoch())
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct DurableQuery<Q: Query = NoopQuery> {
    wal: Arc<Wal>,
    inner: Q,
    status: Arc<Status>,
    run: u64,
    restart_point: Option<RestartPoint>,
    /// Epochs after the last commit whose offsets this run logged.
    logged: BTreeSet<i64>,
    /// Offsets of epochs too far after the last commit to log yet ([`Self::log_ahead_epochs`]),
    /// as first added in this run: logged just before their commit, if it comes.
    deferred: BTreeMap<i64, Vec<(PartitionId, Payload)>>,
    /// The offsets in `deferred`, at most [`DEFERRED_ENTRIES_MAX`].
    deferred_entries: usize,
    retained_epochs: usize,
    /// The longest an append waits for room ([`DEFAULT_WRITE_TIMEOUT`]).
    write_timeout: Duration,
    /// The next cleaning threshold that triggers a `clean`.
    next_clean: i64,
    /// With [`Durability::None`] only: the commits a power loss keeps, which cleaning follows.
    synced_commits: Option<SyncedCommits>,
    /// Reused serialization buffer.
    buf: AlignedVec,
    /// Whether the last offsets record had the compact layout (see `append_offsets`).
    assume_compact: bool,
    /// The run's keyframe and the delta being built (module `delta`).
    deltas: DeltaEncoder,
    /// An append that failed without failing the log (it timed out waiting for room): the
    /// coordinator fail-stopped on it, so every later record is refused at once instead of
    /// waiting out the write timeout again on the coordinator's thread.
    append_failure: Option<WalError>,
}

impl DurableQuery<NoopQuery> {
    /// Opens (creating if needed) the epoch log in `dir` and recovers the restart point, with
    /// no inner query and [`DEFAULT_RETAINED_EPOCHS`].
    ///
    /// # Errors
    /// As [`DurableQuery::from_wal`], plus [`EpochError::Wal`] if the WAL cannot be opened
    /// ([`WalError::Locked`] if another log, in this process or another, has `dir` open).
    pub fn open(dir: impl AsRef<Path>, config: WalConfig) -> Result<Self, EpochError> {
        let wal = Wal::open(dir, config)
            .map_err(|source| EpochError::Wal { op: "open the epoch log", source })?;
        Self::from_wal(wal, NoopQuery)
    }
}

impl<Q: Query> DurableQuery<Q> {
    /// Recovers the restart point from an open `wal` (reading every record) and wraps `inner`.
    ///
    /// # Errors
    /// [`EpochError::CommittedWithoutOffsets`] if the last committed epoch has no offsets
    /// (SPEC B.10), [`EpochError::BadLogRecord`] for a record that is not a valid epoch-log
    /// record, [`EpochError::Wal`] if reading fails, [`EpochError::EpochOverflow`] if the last
    /// committed epoch is `i64::MAX` (no epoch is left to start at).
    pub fn from_wal(wal: Wal, inner: Q) -> Result<Self, EpochError> {
        let recovered = recover(&wal)?;
        if let Some((epoch, _)) =
            recovered.restart_point.as_ref().filter(|(e, _)| e.next().is_none())
        {
            // The run would start after the last epoch there is.
            return Err(EpochError::EpochOverflow { epoch: *epoch });
        }
        let last = recovered.restart_point.as_ref().map_or(-1, |(epoch, _)| epoch.0);
        warn_of_skipped_damage(&wal, last);
        tracing::info!(
            dir = ?wal.dir(),
            last_committed = last,
            run = recovered.max_run + 1,
            "epoch log recovered"
        );
        let synced_commits =
            matches!(wal.config().durability, Durability::None).then(|| SyncedCommits::new(last));
        let wal = Arc::new(wal);
        let status = Arc::new(Status {
            last_committed: AtomicI64::new(last),
            durable_committed: AtomicI64::new(last),
            wal_failure: OnceLock::new(),
            stop_error: Mutex::new(None),
            ignored_commits: AtomicU64::new(0),
            ignored_offsets: AtomicU64::new(0),
            pending: Mutex::new(PendingCommits::default()),
            commit_queued: Condvar::new(),
            wal: Arc::downgrade(&wal),
        });
        Ok(Self {
            wal,
            inner,
            status,
            run: recovered.max_run + 1,
            restart_point: recovered.restart_point,
            logged: BTreeSet::new(),
            deferred: BTreeMap::new(),
            deferred_entries: 0,
            append_failure: None,
            retained_epochs: DEFAULT_RETAINED_EPOCHS,
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            next_clean: i64::MIN,
            synced_commits,
            buf: AlignedVec::new(),
            assume_compact: true,
            deltas: DeltaEncoder::default(),
        })
    }

    /// Waits at most `timeout` for room in the WAL's staging buffer per append (default
    /// [`DEFAULT_WRITE_TIMEOUT`]); an append that found none fails with
    /// [`WalError::AppendTimedOut`], and the coordinator stops the query.
    pub fn with_write_timeout(mut self, timeout: Duration) -> Self {
        self.write_timeout = timeout;
        self
    }

    /// Keeps the records of the newest `retained_epochs` committed epochs (at least 1;
    /// default [`DEFAULT_RETAINED_EPOCHS`]; anything from `i64::MAX` up keeps every epoch).
    pub fn with_retained_epochs(mut self, retained_epochs: usize) -> Self {
        self.retained_epochs = clamp_retained_epochs(retained_epochs);
        self
    }

    /// Where the run starts (SPEC B.10), as recovered when opening: `None` for a new query
    /// (start epoch 0), else the last committed epoch `E` with its offsets (start at `E + 1`),
    /// from which the engine resumes reading. Read it before the query moves into its
    /// endpoint (the endpoint's thread owns it from then on).
    pub fn restart_point(&self) -> Option<&RestartPoint> {
        self.restart_point.as_ref()
    }

    /// The epoch a new coordinator starts at: the one after the last committed (the recovered `E +
    /// 1` when just opened; a query handed on after committing more moves on with it), or 0. After
    /// a commit of `i64::MAX` (which [`DurableQuery::from_wal`] refuses to reopen) it stays
    /// `i64::MAX`, which [`EpochCoordinator::new`](super::EpochCoordinator::new) refuses.
    pub fn start_epoch(&self) -> Epoch {
        self.last_committed_epoch().map_or(Epoch(0), |last| Epoch(last.0.saturating_add(1)))
    }

    /// A handle on this query's progress for other threads.
    pub fn status(&self) -> DurableQueryStatus {
        DurableQueryStatus(Arc::clone(&self.status))
    }

    /// The run number of this opening (one more than the highest recovered).
    pub fn run(&self) -> u64 {
        self.run
    }

    /// The underlying WAL (for its statistics).
    pub fn wal(&self) -> &Wal {
        &self.wal
    }

    /// The inner query.
    pub fn inner(&self) -> &Q {
        &self.inner
    }

    /// The inner query, mutably.
    pub fn inner_mut(&mut self) -> &mut Q {
        &mut self.inner
    }

    fn check_failed(&self, epoch: Epoch) -> Result<(), EpochError> {
        let (op, error) = match (self.status.wal_failure.get(), &self.append_failure) {
            (Some(error), _) => ("record an epoch (the WAL failed)", error),
            (None, Some(error)) => ("record an epoch (an earlier append failed)", error),
            (None, None) => return Ok(()),
        };
        tracing::debug!(%epoch, %error, "the epoch log refuses records");
        Err(EpochError::Wal { op, source: error.clone() })
    }

    /// Serializes `record` into `self.buf`; returns whether the archive is valid (see
    /// [`LogRecordRef::layout_held`]).
    fn serialize(
        buf: &mut AlignedVec,
        record: &LogRecordRef<'_>,
        epoch: Epoch,
    ) -> Result<bool, EpochError> {
        let mut taken = std::mem::take(buf);
        taken.clear();
        *buf =
            rkyv::api::high::to_bytes_in::<_, rancor::Error>(record, taken).map_err(|error| {
                EpochError::BadLogRecord {
                    lsn: 0,
                    reason: format!("serializing a record of epoch {epoch}: {error}"),
                }
            })?;
        Ok(record.layout_held())
    }

    /// Appends what [`Self::serialize`] left in `self.buf`.
    fn append_serialized(&mut self, epoch: Epoch, op: &'static str) -> Result<Lsn, EpochError> {
        match self.wal.append_bytes_timeout(&self.buf, epoch.0, self.write_timeout) {
            Ok((lsn, _)) => Ok(lsn),
            Err(source) => {
                if matches!(source, WalError::Failed { .. }) {
                    self.status.fail(&source);
                } else {
                    self.append_failure.get_or_insert_with(|| source.clone());
                }
                Err(EpochError::Wal { op, source })
            }
        }
    }

    /// Appends the epoch's offsets record: a delta from the run's last one when it can be one
    /// (module `delta`), else a full record, serialized in one pass assuming the compact layout
    /// while the last record had it (the usual case), else with the layout computed first. An
    /// assumption that fails costs one wasted pass, and then no more until a record is compact
    /// again.
    fn append_offsets(&mut self, epoch: Epoch, offsets: Offsets<'_>) -> Result<(), EpochError> {
        // Chains of at most the retained epochs, so that cleaning keeps their keyframes (module
        // `delta`).
        let interval = KEYFRAME_INTERVAL.min(self.retained_epochs as i64);
        if let Some(delta) = self.deltas.encode(self.run, epoch.0, offsets, interval) {
            let appended = Self::serialize(&mut self.buf, &delta, epoch)
                .and_then(|_| self.append_serialized(epoch, "append the offsets of an epoch"));
            if appended.is_err() {
                // The encoder took this delta as the next one's base: it is not in the log.
                self.deltas.forget_base();
            }
            return appended.map(|_| ());
        }
        let too_large = |error: TooLarge| EpochError::BadLogRecord {
            lsn: 0,
            reason: format!(
                "the offsets of epoch {epoch}: {} {} exceeds {}",
                error.what, error.value, error.limit
            ),
        };
        let held = self.assume_compact && {
            let record = OffsetsRecordRef::assuming_compact(self.run, epoch.0, &offsets);
            Self::serialize(
                &mut self.buf,
                &LogRecordRef::Offsets(record.map_err(too_large)?),
                epoch,
            )?
        };
        if !held {
            let record = OffsetsRecordRef::new(self.run, epoch.0, &offsets).map_err(too_large)?;
            self.assume_compact = record.is_compact();
            Self::serialize(&mut self.buf, &LogRecordRef::Offsets(record), epoch)?;
        }
        self.append_serialized(epoch, "append the offsets of an epoch")?;
        self.deltas.full_record_appended(epoch.0, offsets);
        Ok(())
    }

    /// Cleans below the newest `retained_epochs` **durable** commits (with
    /// [`Durability::None`], **synced** commits: [`SyncedCommits`]). Counting from the last
    /// appended commit instead would be wrong: its segment may not be written yet, and a crash
    /// would then find neither it nor the (deleted) segments of the durable commits before it.
    fn maybe_clean(&mut self) {
        let durable = match self.synced_commits.as_mut() {
            Some(synced_commits) => synced_commits.last_synced(self.wal.synced_lsn()),
            None => self.status.durable_committed.load(Ordering::Acquire),
        };
        if durable < 0 {
            return;
        }
        let mut threshold = durable.saturating_add(1).saturating_sub(self.retained_epochs as i64);
        if let Some((recovered, _)) = self.restart_point.as_ref().filter(|(e, _)| durable <= e.0) {
            // The restart point is still the recovered one, whose offsets may be a delta in
            // the previous run's chain: written under that run's retention, it may reach up to
            // `KEYFRAME_INTERVAL` epochs back, further than this run keeps (module `delta`).
            // Once a commit of this run is durable, its own chain (started by a full record)
            // is what a restart needs.
            let chain_start = recovered.0.saturating_add(1).saturating_sub(KEYFRAME_INTERVAL);
            threshold = threshold.min(chain_start);
        }
        if threshold < self.next_clean || threshold <= 0 {
            return;
        }
        self.next_clean = threshold.saturating_add((self.retained_epochs / 4).max(1) as i64);
        match self.wal.clean(threshold, false) {
            Ok(report) if !report.deleted.is_empty() => {
                tracing::debug!(threshold, deleted = report.deleted.len(), "epoch log cleaned");
            }
            Ok(_) => {}
            // Not a loss: the old segments stay and are cleaned by a later call.
            Err(error) => tracing::warn!(threshold, %error, "cleaning the epoch log failed"),
        }
    }
}

impl<Q: Query> DurableQuery<Q> {
    /// How far after the last commit an epoch's offsets are logged as soon as they are
    /// complete: `max(retained_epochs, KEYFRAME_INTERVAL)` epochs. A record's time is its
    /// epoch, and cleaning deletes only a prefix of the segments, so a record of an epoch far
    /// ahead would keep its segment and every later one until the commits pass it: a single
    /// report for a distant epoch (a task gone astray) would stop the cleaning for good.
    /// Offsets further ahead wait in memory ([`Self::deferred`], bounded as the coordinator's
    /// own backlog: an epoch's offsets are complete only while it holds them) and are logged
    /// just before their epoch's commit, which needs them first; a restart ignores the offsets
    /// of uncommitted epochs anyway (SPEC B.10), so nothing it reads is missing.
    fn log_ahead_epochs(&self) -> i64 {
        i64::try_from(self.retained_epochs).unwrap_or(i64::MAX).max(KEYFRAME_INTERVAL)
    }

    /// Appends the run's first offsets of `epoch` now, or keeps them for its commit if it is
    /// too far ahead ([`Self::log_ahead_epochs`]) and [`DEFERRED_ENTRIES_MAX`] leaves room.
    /// Offsets kept earlier win over `offsets`, also once the epoch is near enough to log.
    fn log_or_defer(&mut self, epoch: Epoch, offsets: Offsets<'_>) -> Result<(), EpochError> {
        let last = self.status.last_committed.load(Ordering::Relaxed);
        let far_ahead = epoch.0 > last.saturating_add(self.log_ahead_epochs());
        if far_ahead && self.deferred.contains_key(&epoch.0) {
            return Ok(());
        }
        if let Some(first) = self.deferred.remove(&epoch.0) {
            self.deferred_entries -= first.len();
            self.append_offsets(epoch, Offsets::new(&first))?;
        } else if far_ahead && self.deferred_entries + offsets.len() <= DEFERRED_ENTRIES_MAX {
            self.deferred_entries += offsets.len();
            self.deferred.insert(epoch.0, offsets.to_vec());
            return Ok(());
        } else {
            self.append_offsets(epoch, offsets)?;
        }
        self.logged.insert(epoch.0);
        Ok(())
    }
}

impl<Q: Query> Query for DurableQuery<Q> {
    /// Appends the epoch's offsets (once per epoch and run: the run's first offsets of the
    /// epoch; of an epoch more than `max(retained_epochs, 64)` after the last commit, keeps
    /// them to append at its commit), then calls the inner query. Offsets of an epoch at or below
    /// the last committed one are ignored (counted).
    fn add_offsets(&mut self, epoch: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError> {
        self.check_failed(epoch)?;
        if epoch.0 <= self.status.last_committed.load(Ordering::Relaxed) {
            let count = self.status.ignored_offsets.fetch_add(1, Ordering::Relaxed) + 1;
            if worth_a_warning(count) {
                tracing::warn!(%epoch, count, "offsets of an already committed epoch ignored");
            }
            return Ok(());
        }
        if !self.logged.contains(&epoch.0) {
            self.log_or_defer(epoch, offsets)?;
        }
        self.inner.add_offsets(epoch, offsets)
    }

    /// Appends the commit record (not waiting for it to be durable), calls the inner query,
    /// and cleans old segments. A commit of an already committed epoch is ignored (counted).
    fn commit(&mut self, epoch: Epoch) -> Result<(), CollaboratorError> {
        self.check_failed(epoch)?;
        if epoch.0 <= self.status.last_committed.load(Ordering::Relaxed) {
            let count = self.status.ignored_commits.fetch_add(1, Ordering::Relaxed) + 1;
            if worth_a_warning(count) {
                tracing::warn!(%epoch, count, "commit of an already committed epoch ignored");
            }
            return Ok(());
        }
        if !self.logged.contains(&epoch.0) {
            let Some(offsets) = self.deferred.remove(&epoch.0) else {
                return Err(Box::new(EpochError::CommittedWithoutOffsets { epoch }));
            };
            self.deferred_entries -= offsets.len();
            self.append_offsets(epoch, Offsets::new(&offsets))?;
            self.logged.insert(epoch.0);
        }
        Self::serialize(
            &mut self.buf,
            &LogRecordRef::Commit { run: self.run, epoch: epoch.0 },
            epoch,
        )?;
        let lsn = self.append_serialized(epoch, "append the commit of an epoch")?;
        // Track durability without a callback per commit (a callback costs the sync thread a
        // lock and this thread a wake-up): the queue is drained here and by status readers.
        // Queued before the epoch shows as committed, so that a reader who sees it committed
        // finds its record to wait for (`wait_durable_committed`).
        self.status.queue_commit(lsn, epoch);
        if let Some(synced_commits) = self.synced_commits.as_mut() {
            synced_commits.appended(lsn, epoch);
        }
        self.status.last_committed.store(epoch.0, Ordering::Release);
        // Drop the epochs up to this one in place (`split_off` would build a new set: an
        // allocation per commit).
        while self.logged.first().is_some_and(|&logged| logged <= epoch.0) {
            self.logged.pop_first();
        }
        while self.deferred.first_key_value().is_some_and(|(&deferred, _)| deferred <= epoch.0) {
            if let Some((_, offsets)) = self.deferred.pop_first() {
                self.deferred_entries -= offsets.len();
            }
        }
        self.status.advance(self.wal.durable_lsn());
        self.maybe_clean();
        self.inner.commit(epoch)
    }

    /// A new coordinator takes this query: a new run number, so that the offsets it logs
    /// replace, on recovery, those an earlier coordinator logged for epochs it did not commit
    /// (before, the epochs it had logged were not logged again, and a restart resumed from the
    /// earlier coordinator's offsets). The next offsets record is full: a run's chain of deltas
    /// starts with a full record of that run (module `delta`). The inner query is told too.
    fn begin_run(&mut self) {
        // Recovered runs are at most MAX_RECOVERED_RUN, so no real sequence of coordinators
        // reaches the cap; it only keeps the number below u64::MAX.
        self.run = self.run.saturating_add(1).min(u64::MAX - 1);
        self.logged.clear();
        self.deferred.clear();
        self.deferred_entries = 0;
        self.deltas.forget_base();
        self.status.begin_commits();
        self.inner.begin_run();
    }

    /// The last epoch committed: recovered, or committed through this query since (a query
    /// handed on to a new coordinator keeps what its run committed). `None` while none is.
    fn last_committed_epoch(&self) -> Option<Epoch> {
        epoch_or_none(self.status.last_committed.load(Ordering::Acquire))
    }

    /// Passes the error to the inner query, and keeps the first (for
    /// [`DurableQueryStatus::stop_error`]): a copy of it, as the inner query owns the error, in
    /// which a collaborator's error is its text with its causes.
    fn stop(&mut self, error: EpochError) {
        {
            let mut first =
                self.status.stop_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if first.is_none() {
                let text = error.stop_text();
                tracing::warn!(error = %text, "query stopped by the epoch coordinator");
                *first = Some(Arc::new(error.copy_with_text_sources()));
            }
        }
        if error.is_fail_stop() {
            self.status.end_commits();
        }
        self.inner.stop(error);
    }
}

impl<Q: Query> Drop for DurableQuery<Q> {
    /// Closes the log: everything appended is written and synced (or the failure recorded),
    /// so a clean stop leaves every commit durable.
    fn drop(&mut self) {
        // First: readers waiting for an epoch never committed return at once, and those whose
        // commit is queued wait for the close to make it durable.
        self.status.end_commits();
        match self.wal.close_timeout(CLOSE_TIMEOUT) {
            Ok(()) => self.status.advance(Lsn(u64::MAX)),
            // Dropped in one of the log's durability callbacks: the sync thread writes the
            // rest once it returns; the status learns of it as readers advance.
            Err(WalError::CloseOnSyncThread { .. }) => {}
            Err(error) => {
                tracing::warn!(%error, "closing the epoch log");
                self.status.fail(&error);
            }
        }
    }
}

/// A log opened in tolerant mode may have skipped records of later commits than the restart
/// point it gave: the run then restarts before them, and the sink commits those epochs again
/// (at-least-once). Recovery itself fails only if the restart point's own offsets are gone.
fn warn_of_skipped_damage(wal: &Wal, last_committed: i64) {
    let skipped = &wal.recovery_report().corruption_skipped;
    if !skipped.is_empty() {
        // Not the records: a segment skipped as a whole counts none (their number is unknown).
        let bytes: u64 = skipped.iter().map(|note| note.bytes_skipped).sum();
        tracing::warn!(
            stretches = skipped.len(),
            bytes,
            last_committed,
            "the epoch log was opened with damage skipped (tolerant recovery): if it held \
             later commits, the run restarts before them and the sink commits those epochs again"
        );
    }
}

/// The highest run number recovery accepts (module doc): after any run at or below it, 2^63 - 1
/// more openings and coordinators fit below [`Query::begin_run`]'s cap, so no two runs share a
/// number. A record of a higher run (forged, or written by a run that started from a forged
/// one at the bound) makes opening fail.
const MAX_RECOVERED_RUN: u64 = i64::MAX as u64;

/// What [`recover`] found.
struct Recovered {
    restart_point: Option<RestartPoint>,
    max_run: u64,
}

fn bad_record(lsn: Lsn, reason: impl std::fmt::Display) -> EpochError {
    EpochError::BadLogRecord { lsn: lsn.0, reason: reason.to_string() }
}

/// Reads the whole log (SPEC B.10).
fn recover(wal: &Wal) -> Result<Recovered, EpochError> {
    let read_error = |source| EpochError::Wal { op: "read the epoch log", source };
    let mut max_run = 0u64;
    // The last commit record's epoch and run.
    let mut last_committed: Option<(i64, u64)> = None;
    // Epoch -> its winning offsets record; only epochs >= the last commit kept.
    let mut offsets: BTreeMap<i64, Winner> = BTreeMap::new();
    // The records since the last full offsets record read: the bases of the deltas after it.
    let mut chain: Option<SharedChain> = None;
    for record in wal.iter_from(Lsn(0)).map_err(read_error)? {
        let record = record.map_err(read_error)?;
        let lsn = record.lsn;
        let archived = record.access::<LogRecord>().map_err(|error| bad_record(lsn, error))?;
        let link = |epoch, base_epoch| Link { epoch, base_epoch, handle: record.handle, lsn };
        let (run, epoch) = match archived {
            ArchivedLogRecord::Offsets(entry) => (entry.run.to_native(), entry.epoch.to_native()),
            ArchivedLogRecord::OffsetsDelta(entry)
            | ArchivedLogRecord::OffsetsDeltaOfDelta(entry) => {
                (entry.run.to_native(), entry.epoch.to_native())
            }
            ArchivedLogRecord::Commit { run, epoch } => (run.to_native(), epoch.to_native()),
        };
        if run > MAX_RECOVERED_RUN {
            return Err(bad_record(
                lsn,
                format!(
                    "run number {run} is above {MAX_RECOVERED_RUN}, which no log reaches by its \
                     openings and coordinators (a forged record, or one of a run that started \
                     from a forged record)"
                ),
            ));
        }
        if epoch < 0 {
            // A run starts at epoch 0 or later (`EpochConfig::start_epoch`): a forged record.
            return Err(bad_record(lsn, format!("epoch {epoch} is negative")));
        }
        let place = match archived {
            ArchivedLogRecord::Offsets(_) => {
                let started = Rc::new(RefCell::new(Chain { run, links: vec![link(epoch, None)] }));
                chain = Some(Rc::clone(&started));
                Ok((started, 0))
            }
            ArchivedLogRecord::OffsetsDelta(entry)
            | ArchivedLogRecord::OffsetsDeltaOfDelta(entry) => {
                let base_epoch = entry.base_epoch.to_native();
                match chain.as_ref().filter(|chain| chain.borrow().run == run) {
                    Some(chain) => {
                        let mut links = RefCell::borrow_mut(chain);
                        links.links.push(link(epoch, Some(base_epoch)));
                        Ok((Rc::clone(chain), links.links.len() - 1))
                    }
                    None => Err(base_epoch),
                }
            }
            ArchivedLogRecord::Commit { .. } => {
                max_run = max_run.max(run);
                match last_committed {
                    Some((last, _)) if epoch <= last => {
                        tracing::warn!(
                            epoch,
                            last,
                            lsn = lsn.0,
                            "out-of-order commit record ignored"
                        );
                    }
                    _ => {
                        last_committed = Some((epoch, run));
                        offsets = offsets.split_off(&epoch);
                    }
                }
                continue;
            }
        };
        max_run = max_run.max(run);
        if last_committed.is_some_and(|(last, _)| epoch < last) {
            continue;
        }
        match offsets.get(&epoch) {
            // The first record of a run wins; a newer run replaces an older one.
            Some(winner) if winner.run >= run => {}
            _ => {
                offsets.insert(epoch, Winner { run, lsn, place });
            }
        }
    }
    let Some((last, committing_run)) = last_committed else {
        return Ok(Recovered { restart_point: None, max_run });
    };
    // Only the committing run's own offsets are where its sink's data ends: a run commits
    // only an epoch it logged offsets for, and no later run logs a committed epoch. Another
    // run's offsets here mean the committing run's record is gone (a damaged record skipped
    // by a tolerant open), and resuming from them could skip or repeat data.
    let found = offsets.get(&last);
    let Some(winner) = found.filter(|winner| winner.run == committing_run) else {
        if let Some(other) = found {
            tracing::warn!(
                epoch = last,
                committing_run,
                offsets_run = other.run,
                "the last committed epoch's offsets were logged by another run"
            );
        }
        return Err(EpochError::CommittedWithoutOffsets { epoch: Epoch(last) });
    };
    let restart_offsets = winner.decode(wal, last)?;
    Ok(Recovered { restart_point: Some((Epoch(last), restart_offsets)), max_run })
}

/// Where recovery found an epoch's winning offsets.
struct Winner {
    run: u64,
    lsn: Lsn,
    /// Its chain and its place in it, or, for a delta read with no chain of its run before
    /// it (a keyframe lost with a skipped segment), the base epoch it names.
    place: Result<(SharedChain, usize), i64>,
}

/// A chain that winners of several epochs share while recovery still appends to it.
type SharedChain = Rc<RefCell<Chain>>;

/// The offsets records of one run from a full record on (module `delta`, "Chains and
/// keyframes").
struct Chain {
    run: u64,
    /// The full record, then the deltas after it.
    links: Vec<Link>,
}

/// An offsets record in its chain.
#[derive(Clone, Copy)]
struct Link {
    epoch: i64,
    /// For a delta: the epoch of its base.
    base_epoch: Option<i64>,
    handle: RecordHandle,
    lsn: Lsn,
}

impl Chain {
    /// The places of the records that decoding the one at `index` needs, from the full record
    /// on, found by following each delta's base epoch back.
    fn path_to(&self, index: usize) -> Result<Vec<usize>, EpochError> {
        let mut path = vec![index];
        let mut at = index;
        while let Some(base_epoch) = self.links[at].base_epoch {
            let link = self.links[at];
            at = self.links[..at].iter().rposition(|base| base.epoch == base_epoch).ok_or_else(
                || {
                    bad_record(
                        link.lsn,
                        format!(
                            "the offsets of epoch {} are a delta from the record of epoch \
                             {base_epoch}, which run {} did not log since its last full record",
                            link.epoch, self.run
                        ),
                    )
                },
            )?;
            path.push(at);
        }
        path.reverse();
        Ok(path)
    }
}

impl Winner {
    /// The offsets of `epoch`, read from the log (and from the chain of a delta).
    fn decode(&self, wal: &Wal, epoch: i64) -> Result<Vec<(PartitionId, Payload)>, EpochError> {
        let read_error = |source| EpochError::Wal { op: "read the epoch log", source };
        let (chain, index) = match &self.place {
            Ok((chain, index)) => (chain.borrow(), *index),
            Err(base_epoch) => {
                return Err(bad_record(
                    self.lsn,
                    format!(
                        "the offsets of epoch {epoch} are a delta from the record of epoch \
                         {base_epoch} of run {}, but no full record of that run comes before \
                         it (lost with a skipped segment?)",
                        self.run
                    ),
                ))
            }
        };
        let path = chain.path_to(index)?;
        let (keyframe, deltas) = path.split_first().expect("a path holds the record itself");
        let keyframe = chain.links[*keyframe];
        let record = wal.read::<LogRecord>(keyframe.handle).map_err(read_error)?;
        let ArchivedLogRecord::Offsets(full) = &*record else {
            return Err(bad_record(keyframe.lsn, "expected a full offsets record"));
        };
        if deltas.is_empty() {
            return decode_offsets(full).map_err(|reason| bad_record(keyframe.lsn, reason));
        }
        let mut decoder =
            ChainDecoder::new(full).map_err(|reason| bad_record(keyframe.lsn, reason))?;
        for link in deltas.iter().map(|&at| chain.links[at]) {
            let record = wal.read::<LogRecord>(link.handle).map_err(read_error)?;
            let Some((order, delta)) = as_delta(&record) else {
                return Err(bad_record(link.lsn, "expected a delta offsets record"));
            };
            decoder.apply(order, delta).map_err(|reason| bad_record(link.lsn, reason))?;
        }
        let last = chain.links[*path.last().expect("a path holds the record itself")].lsn;
        decoder.offsets().map_err(|reason| bad_record(last, reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rand::{RngExt, SeedableRng};
    use rand_xorshift::XorShiftRng;

    use crate::{coordinators::epoch::delta::DeltaOrder, wal::Durability};

    fn config() -> WalConfig {
        WalConfig {
            segment_size_bytes: 64 << 10,
            durability: Durability::EveryRecord,
            ..WalConfig::default()
        }
    }

    /// `count` dense 8-byte offsets that advance by about `step` an epoch: `epoch * step + p`
    /// plus a jitter of less than `step / 8`, fixed by `(p, epoch)`, so that the deltas of the
    /// log take bytes in either order (steady advances take none in the second).
    fn advancing(count: i32, step: i64, epoch: i64) -> Vec<(PartitionId, Payload)> {
        let jitter = |p: i32| (scrambled(p, epoch) % (step as u64 / 8).max(1)) as i64;
        (0..count)
            .map(|p| (PartitionId(p), Payload::from(epoch * step + i64::from(p) + jitter(p))))
            .collect()
    }

    /// A number fixed by `(p, epoch)` that looks random: the first of a generator seeded by
    /// both.
    fn scrambled(p: i32, epoch: i64) -> u64 {
        XorShiftRng::seed_from_u64(u64::from(p as u32) << 40 ^ epoch as u64).random()
    }

    /// 200 offsets advancing by about 5000 an epoch: most records are deltas, a 4 KiB segment
    /// holds one chain of a few epochs.
    fn chained_offsets(epoch: i64) -> Vec<(PartitionId, Payload)> {
        advancing(200, 5000, epoch)
    }

    /// Page-cache durability (segments written, so cleanable, without fsyncs) in 4 KiB
    /// segments, so that a few epochs roll a segment.
    fn unsynced_small_segments() -> WalConfig {
        WalConfig { durability: Durability::None, segment_size_bytes: 4096, ..config() }
    }

    fn offsets(epoch: i64, value: i64) -> Vec<(PartitionId, Payload)> {
        (0..3)
            .map(|p| (PartitionId(p), Payload::from(epoch * 100 + value + i64::from(p))))
            .collect()
    }

    #[test]
    fn a_new_log_starts_at_epoch_zero() {
        let dir = tempfile::tempdir().unwrap();
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        assert!(query.restart_point().is_none());
        assert_eq!(query.start_epoch(), Epoch(0));
        assert_eq!(query.run(), 1);
    }

    #[test]
    fn restart_point_is_the_last_commit_with_its_first_offsets() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut query = DurableQuery::open(dir.path(), config()).unwrap();
            for epoch in 0..5 {
                query.add_offsets(Epoch(epoch), Offsets::new(&offsets(epoch, 0))).unwrap();
                // A repeated report: the first record wins.
                query.add_offsets(Epoch(epoch), Offsets::new(&offsets(epoch, 50))).unwrap();
                query.commit(Epoch(epoch)).unwrap();
            }
            // Offsets after the last commit are ignored on restart.
            query.add_offsets(Epoch(5), Offsets::new(&offsets(5, 0))).unwrap();
            assert_eq!(query.wal().stats().appends, 11, "duplicates are not appended");
        }
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(4), offsets(4, 0))));
        assert_eq!(query.start_epoch(), Epoch(5));
        assert_eq!(query.status().last_committed(), Some(Epoch(4)));
        assert_eq!(query.run(), 2);
    }

    #[test]
    fn sparse_ids_mixed_payload_lengths_and_fixed_widths_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mixed = vec![
            (PartitionId(2), Payload::from(&b"a"[..])),
            (PartitionId(5), Payload::new()),
            (PartitionId(9), Payload::from(vec![7u8; 300])),
        ];
        let fixed_sparse = vec![(PartitionId(1), Payload::from(1)), (PartitionId(3), 3.into())];
        // Every fixed width with a copy of its own (8, 16, 24 bytes) and one without (12).
        let fixed_dense = |width: usize| -> Vec<(PartitionId, Payload)> {
            (0..4u8)
                .map(|p| (PartitionId(i32::from(p)), Payload::from(vec![p + 1; width])))
                .collect()
        };
        let cases =
            [mixed, fixed_sparse, Vec::new()].into_iter().chain([8, 12, 16, 24].map(fixed_dense));
        for offsets in cases {
            {
                let mut query = DurableQuery::open(dir.path(), config()).unwrap();
                let epoch = query.start_epoch();
                query.add_offsets(epoch, Offsets::new(&offsets)).unwrap();
                query.commit(epoch).unwrap();
            }
            let query = DurableQuery::open(dir.path(), config()).unwrap();
            assert_eq!(query.restart_point().map(|(_, offsets)| offsets), Some(&offsets));
        }
    }

    #[test]
    fn each_offsets_record_has_its_own_layout_whatever_the_last_one_had() {
        let dir = tempfile::tempdir().unwrap();
        let compact = |epoch: i64| offsets(epoch, 0);
        let mixed = |epoch: i64| -> Vec<(PartitionId, Payload)> {
            // First payload 8 bytes (so the compact layout is tried), then other lengths.
            vec![
                (PartitionId(0), Payload::from(epoch)),
                (PartitionId(1), Payload::from(&b"no"[..])),
                (PartitionId(2), Payload::from(vec![epoch as u8; 30])),
            ]
        };
        let sparse = |epoch: i64| vec![(PartitionId(0), epoch.into()), (PartitionId(5), 5.into())];
        let layouts: [&dyn Fn(i64) -> Vec<(PartitionId, Payload)>; 8] =
            [&compact, &mixed, &mixed, &compact, &sparse, &compact, &compact, &sparse];
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        for (epoch, layout) in (0..).zip(layouts) {
            query.add_offsets(Epoch(epoch), Offsets::new(&layout(epoch))).unwrap();
            query.commit(Epoch(epoch)).unwrap();
        }
        let last = Epoch(layouts.len() as i64 - 1);
        assert!(query.status().wait_durable_committed(last, Duration::from_secs(10)));
        // Only a compact record after a compact full one is a delta.
        let deltas = [false, false, false, false, false, false, true, false];
        let expected: Vec<_> = (0..)
            .zip(layouts)
            .zip(deltas)
            .map(|((epoch, layout), delta)| (epoch, layout(epoch), delta))
            .collect();
        assert_eq!(logged_offsets(query.wal()), expected);
    }

    /// An offsets record read back: `(epoch, offsets, is a delta)`.
    type Logged = (i64, Vec<(PartitionId, Payload)>, bool);

    /// Every offsets record in the log, in order (each delta decoded from the record before).
    fn logged_offsets(wal: &Wal) -> Vec<Logged> {
        let mut logged = Vec::new();
        let mut chain = None;
        for record in wal.iter_from(Lsn(0)).unwrap() {
            let record = record.unwrap();
            let archived = record.access::<LogRecord>().unwrap();
            if let ArchivedLogRecord::Offsets(entry) = archived {
                logged.push((entry.epoch.to_native(), decode_offsets(entry).unwrap(), false));
                chain = ChainDecoder::new(entry).ok();
            } else if let Some((order, delta)) = as_delta(archived) {
                let chain = chain.as_mut().expect("a delta after a compact full record");
                chain.apply(order, delta).unwrap();
                logged.push((delta.epoch.to_native(), chain.offsets().unwrap(), true));
            }
        }
        logged
    }

    /// A delta record read back, without decoding it.
    struct LoggedDelta {
        epoch: i64,
        order: DeltaOrder,
        word_bytes: u8,
        /// Length of its packed values.
        bytes: usize,
    }

    /// Every delta record in the log, in order.
    fn logged_deltas(wal: &Wal) -> Vec<LoggedDelta> {
        let mut deltas = Vec::new();
        for record in wal.iter_from(Lsn(0)).unwrap() {
            let record = record.unwrap();
            if let Some((order, delta)) = as_delta(record.access::<LogRecord>().unwrap()) {
                let (epoch, word_bytes) = (delta.epoch.to_native(), delta.word_bytes);
                deltas.push(LoggedDelta { epoch, order, word_bytes, bytes: delta.deltas.len() });
            }
        }
        deltas
    }

    #[test]
    fn a_newer_run_replaces_the_offsets_an_older_run_logged_after_its_last_commit() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut query = DurableQuery::open(dir.path(), config()).unwrap();
            query.add_offsets(Epoch(0), Offsets::new(&offsets(0, 0))).unwrap();
            query.commit(Epoch(0)).unwrap();
            query.add_offsets(Epoch(1), Offsets::new(&offsets(1, 7))).unwrap(); // never committed
        }
        {
            let mut query = DurableQuery::open(dir.path(), config()).unwrap();
            assert_eq!(query.start_epoch(), Epoch(1));
            query.add_offsets(Epoch(1), Offsets::new(&offsets(1, 0))).unwrap();
            query.commit(Epoch(1)).unwrap();
        }
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(1), offsets(1, 0))));
        assert_eq!(query.run(), 3);
    }

    #[test]
    fn commits_need_offsets_and_repeated_commits_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        let error = query.commit(Epoch(0)).unwrap_err();
        assert_eq!(error.to_string(), "Batch 0 was committed without end epoch offsets!");
        query.add_offsets(Epoch(0), Offsets::new(&offsets(0, 0))).unwrap();
        query.commit(Epoch(0)).unwrap();
        let appends = query.wal().stats().appends;
        let warnings = crate::warning_capture::WarningLog::default();
        warnings.around(|| {
            query.commit(Epoch(0)).unwrap();
            query.add_offsets(Epoch(0), Offsets::new(&offsets(0, 1))).unwrap();
        });
        assert_eq!(query.wal().stats().appends, appends, "nothing appended for a committed epoch");
        assert_eq!(query.status().ignored_commits(), 1);
        assert_eq!(query.status().ignored_offsets(), 1);
        // Counted and logged (issue 4: "a counted, logged warning"), naming the epoch.
        let lines = warnings.lines();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].contains("commit of an already committed epoch ignored"), "{lines:?}");
        assert!(lines[1].contains("offsets of an already committed epoch ignored"), "{lines:?}");
        assert!(lines.iter().all(|line| line.contains("epoch=0")), "{lines:?}");
    }

    /// Offsets reported before the partition counts were set, then a writer commit completing
    /// the epoch: the coordinator adds them before the sink commit, so the durable query logs
    /// them and the commit, and a restart resumes from them (it used to fail-stop with
    /// `CommittedWithoutOffsets` after the sink had committed).
    #[test]
    fn an_epoch_whose_offsets_came_before_the_counts_commits_and_restarts_from_them() {
        use crate::coordinators::epoch::{EpochConfig, EpochCoordinator, NoopSink};
        let dir = tempfile::tempdir().unwrap();
        {
            let query = DurableQuery::open(dir.path(), config()).unwrap();
            let status = query.status();
            let mut coordinator =
                EpochCoordinator::new(EpochConfig::new(query.start_epoch().0), query, NoopSink)
                    .unwrap();
            for (partition, offset) in offsets(0, 0) {
                coordinator.report_partition_offset(partition, Epoch(0), offset).unwrap();
            }
            coordinator.set_reader_partitions(3).unwrap();
            coordinator.set_writer_partitions(1).unwrap();
            coordinator.commit_partition_epoch(PartitionId(0), Epoch(0), Payload::new()).unwrap();
            assert_eq!(coordinator.last_committed(), Epoch(0));
            assert!(status.stop_error().is_none());
            assert_eq!(status.last_committed(), Some(Epoch(0)));
        }
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(0), offsets(0, 0))));
    }

    #[test]
    fn a_commit_record_without_offsets_fails_recovery_with_sparks_message() {
        let dir = tempfile::tempdir().unwrap();
        {
            let wal = Wal::open(dir.path(), config()).unwrap();
            wal.append(&LogRecord::Commit { run: 1, epoch: 7 }, 7).unwrap();
            wal.close().unwrap();
        }
        let error = DurableQuery::open(dir.path(), config()).unwrap_err();
        assert!(matches!(error, EpochError::CommittedWithoutOffsets { epoch: Epoch(7) }));
        assert_eq!(error.to_string(), "Batch 7 was committed without end epoch offsets!");
    }

    /// The last committed epoch's offsets logged by another run than the one that committed
    /// it (the committing run's own record lost, say skipped as damaged by a tolerant open):
    /// they are not where that run's sink data ends, so recovery fails as with no offsets,
    /// instead of resuming from them.
    #[test]
    fn offsets_of_another_run_than_the_committing_one_fail_recovery() {
        let dir = tempfile::tempdir().unwrap();
        {
            let wal = Wal::open(dir.path(), config()).unwrap();
            // Run 1 logged epoch 5 and stopped; run 2 committed epoch 5, its offsets lost.
            wal.append_bytes(&full_bytes(5, &offsets(5, 0)), 5).unwrap();
            wal.append(&LogRecord::Commit { run: 2, epoch: 5 }, 5).unwrap();
            wal.close().unwrap();
        }
        let error = DurableQuery::open(dir.path(), config()).unwrap_err();
        assert!(
            matches!(error, EpochError::CommittedWithoutOffsets { epoch: Epoch(5) }),
            "{error}"
        );
    }

    /// A coordinator started below the recovered query's first uncommitted epoch would have
    /// its sink commit those epochs again; one started above it would never commit the epochs
    /// in between (and a later restart would resume past their offsets): both are refused,
    /// naming both epochs. A fresh log takes any start epoch.
    #[test]
    fn a_coordinator_starting_off_the_recovered_epoch_is_refused() {
        use crate::coordinators::epoch::{EpochConfig, EpochCoordinator, NoopSink};
        let dir = tempfile::tempdir().unwrap();
        write_log(dir.path(), &[(full_bytes(3, &offsets(3, 0)), 3)], &[3]);
        let query = || DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query().start_epoch(), Epoch(4));
        let refused = EpochCoordinator::new(EpochConfig::new(3), query(), NoopSink).unwrap_err();
        let text = refused.to_string();
        assert!(text.starts_with("start_epoch = 3 (the query has committed up to 3)"), "{text}");
        let refused = EpochCoordinator::new(EpochConfig::new(6), query(), NoopSink).unwrap_err();
        let text = refused.to_string();
        assert!(text.starts_with("start_epoch = 6 (the query has committed up to 3)"), "{text}");
        assert!(text.contains("would never commit"), "{text}");
        // A query handed on after committing more in this run: its own commits count too.
        let mut live = query();
        live.add_offsets(Epoch(4), Offsets::new(&offsets(4, 0))).unwrap();
        live.commit(Epoch(4)).unwrap();
        let refused = EpochCoordinator::new(EpochConfig::new(4), live, NoopSink).unwrap_err();
        assert!(refused
            .to_string()
            .starts_with("start_epoch = 4 (the query has committed up to 4)"));
        // The log now has epoch 4 committed too.
        assert!(EpochCoordinator::new(EpochConfig::new(5), query(), NoopSink).is_ok());
        let fresh = tempfile::tempdir().unwrap();
        let fresh_query = DurableQuery::open(fresh.path(), config()).unwrap();
        assert!(EpochCoordinator::new(EpochConfig::new(7), fresh_query, NoopSink).is_ok());
    }

    /// A query handed on from one coordinator to the next (`EpochCoordinator::into_parts`): a
    /// restart resumes from the offsets the second coordinator logged for an epoch the first
    /// logged and did not commit. Before, that epoch counted as logged, the second's offsets
    /// were not appended, and recovery named the first coordinator's.
    #[test]
    fn a_query_handed_on_logs_the_new_coordinators_offsets() {
        use crate::coordinators::epoch::{EpochConfig, EpochCoordinator, NoopSink};
        let dir = tempfile::tempdir().unwrap();
        {
            let query = DurableQuery::open(dir.path(), config()).unwrap();
            let mut first = EpochCoordinator::new(EpochConfig::new(0), query, NoopSink).unwrap();
            first.set_reader_partitions(1).unwrap();
            first.set_writer_partitions(1).unwrap();
            first.report_partition_offset(PartitionId(0), Epoch(0), Payload::from(10)).unwrap();
            first.commit_partition_epoch(PartitionId(0), Epoch(0), Payload::from(0)).unwrap();
            // Epoch 1's offsets are logged, and the coordinator hands its query on.
            first.report_partition_offset(PartitionId(0), Epoch(1), Payload::from(70)).unwrap();
            let (query, sink) = first.into_parts();
            let mut second = EpochCoordinator::new(EpochConfig::new(1), query, sink).unwrap();
            second.set_reader_partitions(1).unwrap();
            second.set_writer_partitions(1).unwrap();
            second.report_partition_offset(PartitionId(0), Epoch(1), Payload::from(11)).unwrap();
            second.commit_partition_epoch(PartitionId(0), Epoch(1), Payload::from(1)).unwrap();
            assert_eq!(second.stats().last_committed, Epoch(1));
        }
        let reopened = DurableQuery::open(dir.path(), config()).unwrap();
        let expected = (Epoch(1), vec![(PartitionId(0), Payload::from(11))]);
        assert_eq!(reopened.restart_point(), Some(&expected));
    }

    #[test]
    fn a_foreign_record_is_a_typed_error_with_its_lsn() {
        let dir = tempfile::tempdir().unwrap();
        {
            let wal = Wal::open(dir.path(), config()).unwrap();
            wal.append_bytes(&[0xff; 40], 0).unwrap();
            wal.close().unwrap();
        }
        let error = DurableQuery::open(dir.path(), config()).unwrap_err();
        assert!(matches!(error, EpochError::BadLogRecord { lsn: 1, .. }), "{error}");
    }

    /// Adds the offsets of each epoch of `epochs` and commits it, waiting (bounded) until the
    /// commit is durable: only written (sealed) segments can be cleaned, so the disk keeps up,
    /// as it does in a steady run.
    /// Waits (at most 10 s) until the query's log has deleted `at_least` cleaned segments: a
    /// commit queues the clean, and the sync thread deletes the files at its next turn.
    fn wait_for_cleaned_segments(query: &DurableQuery, at_least: u64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let stats = query.wal().stats();
            if stats.cleaned_segments >= at_least {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "fewer than {at_least} cleaned: {stats:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn commit_each_durably(
        query: &mut DurableQuery,
        epochs: std::ops::Range<i64>,
        offsets: impl Fn(i64) -> Vec<(PartitionId, Payload)>,
    ) {
        for epoch in epochs {
            query.add_offsets(Epoch(epoch), Offsets::new(&offsets(epoch))).unwrap();
            query.commit(Epoch(epoch)).unwrap();
            assert!(
                query.status().wait_durable_committed(Epoch(epoch), Duration::from_secs(10)),
                "epoch {epoch} not durable within 10 s"
            );
        }
    }

    #[test]
    fn cleaning_drops_old_epochs_but_keeps_the_restart_point() {
        let dir = tempfile::tempdir().unwrap();
        // Payloads of bytes that look random: their deltas take about as many bytes.
        let many = |epoch: i64| -> Vec<(PartitionId, Payload)> {
            let payload = |p: i32| -> Vec<u8> {
                (0..100).map(|at| scrambled(p, epoch * 100 + at) as u8).collect()
            };
            (0..64).map(|p| (PartitionId(p), Payload::from(payload(p)))).collect()
        };
        {
            // Page-cache durability: the segments are written (so cleanable) without fsyncs.
            let config = WalConfig { durability: Durability::None, ..config() };
            let mut query = DurableQuery::open(dir.path(), config).unwrap().with_retained_epochs(4);
            commit_each_durably(&mut query, 0..200, many);
            // About 6.5 KiB per epoch in 64 KiB segments: ~20 segments written, all but the
            // newest (holding the last few epochs) deleted.
            wait_for_cleaned_segments(&query, 18);
            let stats = query.wal().stats();
            assert!(stats.segments <= 3, "{stats:?}");
        }
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(199), many(199))));
    }

    /// A record's time is its epoch and cleaning deletes only a prefix of the segments: the
    /// offsets of one epoch far ahead, logged when they completed, kept their segment and every
    /// later one for good. They wait in memory instead, and the log is cleaned as usual.
    #[test]
    fn offsets_far_ahead_do_not_stop_the_cleaning() {
        let dir = tempfile::tempdir().unwrap();
        let offsets = chained_offsets;
        let config = unsynced_small_segments();
        {
            let mut query =
                DurableQuery::open(dir.path(), config.clone()).unwrap().with_retained_epochs(4);
            // Nothing committed yet (-1): the distance to the last epoch there is overflows.
            let astray = Epoch(i64::MAX);
            query.add_offsets(astray, Offsets::new(&offsets(7))).unwrap();
            assert_eq!(query.wal().stats().appends, 0, "not logged");
            commit_each_durably(&mut query, 0..300, offsets);
            // A 4 KiB segment holds one chain of 4 epochs: 75 were written.
            wait_for_cleaned_segments(&query, 60);
        }
        let query = DurableQuery::open(dir.path(), config).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(299), offsets(299))));
    }

    /// Offsets too far ahead to log when they complete are logged just before their epoch's
    /// commit, as first added (the first record of a run wins, deferred or not).
    #[test]
    fn offsets_deferred_far_ahead_are_logged_before_their_commit() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut query =
                DurableQuery::open(dir.path(), config()).unwrap().with_retained_epochs(4);
            // 100 epochs ahead of the last commit (none: -1), beyond the 64 logged at once.
            query.add_offsets(Epoch(99), Offsets::new(&offsets(99, 1))).unwrap();
            query.add_offsets(Epoch(99), Offsets::new(&offsets(99, 2))).unwrap();
            assert_eq!(query.wal().stats().appends, 0, "nothing logged yet");
            commit_each_durably(&mut query, 0..40, |epoch| offsets(epoch, 0));
            // Near enough now (a repeated report completes it again): the first is logged.
            let appends = query.wal().stats().appends;
            query.add_offsets(Epoch(99), Offsets::new(&offsets(99, 3))).unwrap();
            assert_eq!(query.wal().stats().appends, appends + 1);
            commit_each_durably(&mut query, 40..99, |epoch| offsets(epoch, 0));
            query.commit(Epoch(99)).unwrap();
            assert!(query.status().wait_durable_committed(Epoch(99), Duration::from_secs(10)));
        }
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(99), offsets(99, 1))));
    }

    /// The offsets kept for epochs far ahead are bounded: past [`DEFERRED_ENTRIES_MAX`], such
    /// offsets are logged at once.
    #[test]
    fn offsets_far_ahead_beyond_the_memory_bound_are_logged_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        let half: Vec<(PartitionId, Payload)> = (0..DEFERRED_ENTRIES_MAX / 2)
            .map(|p| (PartitionId(p as i32), Payload::from(p as i64)))
            .collect();
        for epoch in [1000, 1001] {
            query.add_offsets(Epoch(epoch), Offsets::new(&half)).unwrap();
        }
        assert_eq!(query.wal().stats().appends, 0, "both kept");
        query.add_offsets(Epoch(1002), Offsets::new(&half[..1])).unwrap();
        assert_eq!(query.wal().stats().appends, 1, "no room left: logged");
    }

    /// A query handed on to a new coordinator forgets the offsets it deferred: the new
    /// coordinator's own offsets are the run's first (a commit without them fails).
    #[test]
    fn a_new_run_forgets_the_deferred_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        query.add_offsets(Epoch(500), Offsets::new(&offsets(500, 1))).unwrap();
        query.begin_run();
        let error = query.commit(Epoch(500)).unwrap_err();
        assert!(error.to_string().contains("committed without end epoch offsets"), "{error}");
    }

    #[test]
    fn a_retention_too_large_for_an_epoch_count_cleans_nothing() {
        // `usize::MAX` used to wrap to -1 as an epoch count: the cleaning threshold was then
        // above the durable commit, and a commit after a restart deleted the recovered
        // segments holding the restart point.
        let offsets = chained_offsets;
        for retained in [usize::MAX, 1 << 63] {
            let dir = tempfile::tempdir().unwrap();
            let config = unsynced_small_segments();
            for run in 0..2 {
                let mut query = DurableQuery::open(dir.path(), config.clone())
                    .unwrap()
                    .with_retained_epochs(retained);
                commit_each_durably(&mut query, run * 20..run * 20 + 20, offsets);
                let stats = query.wal().stats();
                assert_eq!(stats.cleaned_segments, 0, "retained {retained}, run {run}: {stats:?}");
            }
            let query = DurableQuery::open(dir.path(), config).unwrap();
            assert_eq!(query.restart_point(), Some(&(Epoch(39), offsets(39))), "{retained}");
            let logged: Vec<i64> =
                logged_offsets(query.wal()).iter().map(|(epoch, _, _)| *epoch).collect();
            assert_eq!(logged, (0..40).collect::<Vec<_>>(), "retained {retained}");
        }
    }

    /// A run that keeps fewer epochs than the one before it must not clean, before a commit of
    /// its own is durable, what the recovered restart point decodes from: that run's chain may
    /// reach further back (up to [`KEYFRAME_INTERVAL`] epochs) than the new retention. Checked
    /// by opening a copy of the log cut back to the first run's records (as a crash before the
    /// second run's commit became durable would leave it), through a failed-log marker.
    #[test]
    fn a_smaller_retention_after_a_restart_keeps_the_recovered_restart_points_chain() {
        let dir = tempfile::tempdir().unwrap();
        let offsets = chained_offsets;
        let config = unsynced_small_segments();
        let first_run_end = {
            let mut query = DurableQuery::open(dir.path(), config.clone()).unwrap();
            commit_each_durably(&mut query, 0..150, offsets);
            query.wal().appended_lsn()
        };
        {
            let mut query =
                DurableQuery::open(dir.path(), config.clone()).unwrap().with_retained_epochs(2);
            commit_each_durably(&mut query, 150..151, offsets);
            wait_for_cleaned_segments(&query, 1);
        }
        let crashed = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let entry = entry.unwrap();
            if entry.file_name().to_string_lossy().starts_with("seg-") {
                std::fs::copy(entry.path(), crashed.path().join(entry.file_name())).unwrap();
            }
        }
        std::fs::write(
            crashed.path().join(crate::wal::UNSYNCED_MARKER),
            format!("{}\n", first_run_end.0),
        )
        .unwrap();
        let query = DurableQuery::open(crashed.path(), config).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(149), offsets(149))));
    }

    #[test]
    fn deltas_shrink_the_log_and_their_keyframes_outlive_cleaning() {
        let dir = tempfile::tempdir().unwrap();
        // 200 offsets of 8 bytes that advance by 5000 an epoch: 1.6 KiB as a full record, 400
        // bytes as a delta from the epoch before (differences below 2^15).
        let offsets = chained_offsets;
        let epochs = 600;
        {
            // Segments of 4 KiB, a few epochs each, so that cleaning runs close behind the
            // restart point: keyframes more epochs back than retained would be deleted.
            let config = unsynced_small_segments();
            let mut query = DurableQuery::open(dir.path(), config).unwrap().with_retained_epochs(3);
            commit_each_durably(&mut query, 0..epochs, offsets);
            wait_for_cleaned_segments(&query, 100);
            let stats = query.wal().stats();
            // One full record and two deltas per three epochs, plus the commits: about 900
            // bytes an epoch, against 1.7 KiB with full records only.
            assert!(stats.bytes < epochs as u64 * 1100, "{stats:?}");
        }
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        let logged = logged_offsets(query.wal());
        let (last, last_offsets, last_is_delta) = logged.last().unwrap();
        assert_eq!((*last, *last_is_delta), (epochs - 1, true), "the restart point is a delta");
        assert_eq!(last_offsets, &offsets(epochs - 1));
        assert_eq!(query.restart_point(), Some(&(Epoch(epochs - 1), offsets(epochs - 1))));
    }

    #[test]
    fn a_delta_whose_keyframe_is_gone_fails_recovery_naming_both_epochs() {
        let dir = tempfile::tempdir().unwrap();
        let offsets = |epoch: i64| -> Vec<(PartitionId, Payload)> { advancing(4, 10, epoch) };
        let (lsn, delta) = {
            let mut query = DurableQuery::open(dir.path(), config()).unwrap();
            query.add_offsets(Epoch(0), Offsets::new(&offsets(0))).unwrap();
            query.add_offsets(Epoch(1), Offsets::new(&offsets(1))).unwrap();
            query
                .wal()
                .wait_durable_timeout(query.wal().appended_lsn(), Duration::from_secs(10))
                .unwrap();
            let logged = logged_offsets(query.wal());
            assert_eq!(
                logged.iter().map(|(_, _, delta)| *delta).collect::<Vec<_>>(),
                [false, true]
            );
            // The delta's bytes, as they were logged.
            let record = query.wal().iter_from(Lsn(2)).unwrap().next().unwrap().unwrap();
            (record.lsn, record.bytes.to_vec())
        };
        assert_eq!(lsn, Lsn(2));
        // A log holding the delta, then a commit of its epoch, but not its keyframe (as if
        // its segment had been skipped as corrupt).
        let other = tempfile::tempdir().unwrap();
        {
            let wal = Wal::open(other.path(), config()).unwrap();
            wal.append_bytes(&delta, 1).unwrap();
            let commit =
                rkyv::to_bytes::<rancor::Error>(&LogRecord::Commit { run: 1, epoch: 1 }).unwrap();
            let (lsn, _) = wal.append_bytes(&commit, 1).unwrap();
            wal.wait_durable_timeout(lsn, Duration::from_secs(10)).unwrap();
        }
        let error = DurableQuery::open(other.path(), config()).unwrap_err();
        let EpochError::BadLogRecord { lsn, reason } = &error else { panic!("{error}") };
        assert_eq!(*lsn, 1);
        assert!(reason.contains("epoch 1") && reason.contains("epoch 0"), "{reason}");
    }

    /// The bytes of a delta record of `epoch` from a base of `base_epoch` (run 1), of the first
    /// order, as the first versions wrote them: the encoder's record from a keyframe, whose
    /// values are the same in either order (the keyframe moved by nothing).
    fn delta_bytes(
        base_epoch: i64,
        base: &[(PartitionId, Payload)],
        epoch: i64,
        offsets: &[(PartitionId, Payload)],
    ) -> AlignedVec {
        let mut encoder = DeltaEncoder::default();
        encoder.full_record_appended(base_epoch, Offsets::new(base));
        let delta = match encoder.encode(1, epoch, Offsets::new(offsets), KEYFRAME_INTERVAL) {
            Some(LogRecordRef::OffsetsDelta(delta) | LogRecordRef::OffsetsDeltaOfDelta(delta)) => {
                LogRecordRef::OffsetsDelta(delta)
            }
            _ => panic!("not a delta"),
        };
        rkyv::to_bytes::<rancor::Error>(&delta).unwrap()
    }

    #[test]
    fn a_log_whose_last_commit_is_the_last_epoch_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        write_log(dir.path(), &[(full_bytes(i64::MAX, &offsets(0, 5)), i64::MAX)], &[i64::MAX]);
        match DurableQuery::open(dir.path(), config()) {
            Err(EpochError::EpochOverflow { epoch }) => assert_eq!(epoch, Epoch(i64::MAX)),
            Err(other) => panic!("expected EpochOverflow, got {other}"),
            Ok(_) => panic!("opened a run that would start past i64::MAX"),
        }
    }

    #[test]
    fn a_record_of_a_run_no_log_reaches_is_a_typed_error() {
        // u64::MAX - 1: before, it was accepted, the next opening took u64::MAX (which the
        // opening after refused) and a coordinator's run stayed at u64::MAX - 1, the number
        // of the run before.
        for run in [MAX_RECOVERED_RUN + 1, u64::MAX - 1, u64::MAX] {
            let dir = tempfile::tempdir().unwrap();
            {
                let wal = Wal::open(dir.path(), config()).unwrap();
                wal.append_bytes(&full_bytes(0, &offsets(0, 5)), 0).unwrap();
                wal.append(&LogRecord::Commit { run, epoch: 0 }, 0).unwrap();
                wal.close().unwrap();
            }
            match DurableQuery::open(dir.path(), config()) {
                Err(EpochError::BadLogRecord { lsn: 2, reason }) => {
                    assert!(reason.contains(&format!("run number {run} is above")), "{reason}")
                }
                Err(other) => panic!("run {run}: expected BadLogRecord at LSN 2, got {other}"),
                Ok(_) => panic!("opened a log with a record of run {run}"),
            }
        }
    }

    #[test]
    fn a_new_run_is_passed_on_to_the_inner_query() {
        /// Counts the runs it is told of.
        #[derive(Default)]
        struct RunCounting(usize);
        impl Query for RunCounting {
            fn add_offsets(&mut self, _: Epoch, _: Offsets<'_>) -> Result<(), CollaboratorError> {
                Ok(())
            }
            fn commit(&mut self, _: Epoch) -> Result<(), CollaboratorError> {
                Ok(())
            }
            fn stop(&mut self, _: EpochError) {}
            fn begin_run(&mut self) {
                self.0 += 1;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), config()).unwrap();
        let mut query = DurableQuery::from_wal(wal, RunCounting::default()).unwrap();
        query.begin_run();
        query.begin_run();
        assert_eq!((query.run(), query.inner().0), (3, 2));
    }

    #[test]
    fn opening_with_damage_skipped_warns_that_later_commits_may_be_lost() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut query = DurableQuery::open(dir.path(), config()).unwrap();
            // Chains from epochs 0 and 64 (KEYFRAME_INTERVAL): the last commit's is not in
            // the oldest segment.
            for epoch in 0..100 {
                query
                    .add_offsets(Epoch(epoch), Offsets::new(&advancing(1000, 1 << 20, epoch)))
                    .unwrap();
                query.commit(Epoch(epoch)).unwrap();
            }
        }
        let mut segments: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .and_then(crate::wal::segment::parse_file_name)
                    .is_some()
            })
            .collect();
        segments.sort();
        assert!(segments.len() >= 3, "{segments:?}");
        // The oldest segment's header: tolerant recovery skips the segment as a whole.
        let mut bytes = std::fs::read(&segments[0]).unwrap();
        bytes[..16].fill(0xA5);
        std::fs::write(&segments[0], bytes).unwrap();
        let tolerant =
            WalConfig { recovery: crate::wal::RecoveryMode::TolerateCorruption, ..config() };
        let warnings = crate::warning_capture::WarningLog::default();
        let query = warnings.around(|| DurableQuery::open(dir.path(), tolerant)).unwrap();
        assert_eq!(query.restart_point().map(|(epoch, _)| epoch), Some(&Epoch(99)));
        let lines = warnings.lines();
        assert!(
            lines.iter().any(|line| line.contains("opened with damage skipped")
                && line.contains("stretches=1")
                && line.contains("last_committed=99")),
            "{lines:?}"
        );
    }

    #[test]
    fn a_record_of_the_highest_accepted_run_opens_and_its_next_run_is_the_edge() {
        let dir = tempfile::tempdir().unwrap();
        {
            let wal = Wal::open(dir.path(), config()).unwrap();
            let offsets = offsets(0, 5);
            let record = OffsetsRecordRef::new(MAX_RECOVERED_RUN, 0, &offsets).unwrap();
            wal.append_bytes(
                &rkyv::to_bytes::<rancor::Error>(&LogRecordRef::Offsets(record)).unwrap(),
                0,
            )
            .unwrap();
            wal.append(&LogRecord::Commit { run: MAX_RECOVERED_RUN, epoch: 0 }, 0).unwrap();
            wal.close().unwrap();
        }
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query.run(), MAX_RECOVERED_RUN + 1);
        // The edge of the bound (module doc): that run's records are above it.
        query.add_offsets(Epoch(1), Offsets::new(&offsets(1, 5))).unwrap();
        query.commit(Epoch(1)).unwrap();
        drop(query);
        match DurableQuery::open(dir.path(), config()) {
            Err(EpochError::BadLogRecord { lsn: 3, reason }) => {
                let run = MAX_RECOVERED_RUN + 1;
                assert!(reason.contains(&format!("run number {run} is above")), "{reason}")
            }
            Err(other) => panic!("expected BadLogRecord at LSN 3, got {other}"),
            Ok(_) => panic!("opened a log with records above the bound"),
        }
    }

    /// Appends `records` (bytes, epoch) and a commit of each epoch in `commits` (run 1).
    fn write_log(dir: &Path, records: &[(AlignedVec, i64)], commits: &[i64]) {
        let wal = Wal::open(dir, config()).unwrap();
        for (bytes, epoch) in records {
            wal.append_bytes(bytes, *epoch).unwrap();
        }
        for &epoch in commits {
            wal.append(&LogRecord::Commit { run: 1, epoch }, epoch).unwrap();
        }
        wal.close().unwrap();
    }

    fn full_bytes(epoch: i64, offsets: &[(PartitionId, Payload)]) -> AlignedVec {
        let record = LogRecordRef::Offsets(OffsetsRecordRef::new(1, epoch, offsets).unwrap());
        rkyv::to_bytes::<rancor::Error>(&record).unwrap()
    }

    #[test]
    fn a_restart_point_deep_in_a_chain_decodes_through_every_delta_of_it() {
        let dir = tempfile::tempdir().unwrap();
        // The load generator's offsets: epoch << 20 | partition.
        let offsets = |epoch: i64| -> Vec<(PartitionId, Payload)> {
            (0..100).map(|p| (PartitionId(p), Payload::from(epoch << 20 | i64::from(p)))).collect()
        };
        let epochs = KEYFRAME_INTERVAL + 10;
        {
            let mut query = DurableQuery::open(dir.path(), config()).unwrap();
            commit_each_durably(&mut query, 0..epochs, offsets);
            let logged = logged_offsets(query.wal());
            let full: Vec<i64> =
                logged.iter().filter(|(_, _, delta)| !delta).map(|(epoch, _, _)| *epoch).collect();
            assert_eq!(full, [0, KEYFRAME_INTERVAL], "a keyframe every {KEYFRAME_INTERVAL}");
            // Every delta is of the second order: the offsets advance by 2^20 an epoch, so the
            // first delta after a keyframe takes 3 bytes an offset (zigzag 2^21), and every
            // other none (the same advance as the epoch before).
            let deltas = logged_deltas(query.wal());
            for &LoggedDelta { epoch, order, word_bytes, bytes } in &deltas {
                let want: u8 = if epoch % KEYFRAME_INTERVAL == 1 { 3 } else { 0 };
                assert_eq!(order, DeltaOrder::Second, "epoch {epoch}");
                assert_eq!((word_bytes, bytes), (want, usize::from(want) * 100));
            }
            assert_eq!(deltas.len() as i64, epochs - 2);
        }
        // Stopped at the keyframe's predecessor (63 deltas deep), at the keyframe, after it.
        for stop in [KEYFRAME_INTERVAL - 1, KEYFRAME_INTERVAL, epochs - 1] {
            let (_copy, query) = reopened_with_commits_up_to(dir.path(), stop);
            assert_eq!(query.restart_point(), Some(&(Epoch(stop), offsets(stop))), "stop {stop}");
        }
    }

    /// The log in `dir` copied without its commit records after epoch `stop`, and opened: a
    /// restart whose last commit is `stop`, with the records of later epochs still there. The
    /// directory goes with the query.
    fn reopened_with_commits_up_to(dir: &Path, stop: i64) -> (tempfile::TempDir, DurableQuery) {
        let copy = tempfile::tempdir().unwrap();
        {
            let source = DurableQuery::open(dir, config()).unwrap();
            let wal = Wal::open(copy.path(), config()).unwrap();
            for record in source.wal().iter_from(Lsn(0)).unwrap() {
                let record = record.unwrap();
                let keep = match record.access::<LogRecord>().unwrap() {
                    ArchivedLogRecord::Commit { epoch, .. } => epoch.to_native() <= stop,
                    _ => true,
                };
                if keep {
                    wal.append_bytes(&record.bytes, record.time_ms).unwrap();
                }
            }
            wal.close().unwrap();
        }
        let query = DurableQuery::open(copy.path(), config()).unwrap();
        (copy, query)
    }

    /// Offsets whose delta records switch order: advancing by 5000 an epoch for 10 epochs
    /// (second order, no bytes), then 100 up and down by turns for 10 (first order: +-100 is
    /// one byte, +-200 two in the second), and so on; every restart point decodes through the
    /// switches.
    #[test]
    fn a_chain_that_switches_order_decodes_at_every_restart_point() {
        let dir = tempfile::tempdir().unwrap();
        let swinging = |epoch: i64| epoch / 10 % 2 == 1;
        let offsets = |epoch: i64| -> Vec<(PartitionId, Payload)> {
            let advanced = (1..=epoch).filter(|at| !swinging(*at)).count() as i64 * 5000;
            let swing = if swinging(epoch) { epoch % 2 * 100 } else { 0 };
            (0..50i64)
                .map(|p| (PartitionId(p as i32), Payload::from(p * 1_000_000 + advanced + swing)))
                .collect()
        };
        let epochs = 50;
        {
            let mut query = DurableQuery::open(dir.path(), config()).unwrap();
            commit_each_durably(&mut query, 0..epochs, offsets);
            let orders: Vec<(i64, DeltaOrder)> =
                logged_deltas(query.wal()).iter().map(|delta| (delta.epoch, delta.order)).collect();
            let switches = orders.windows(2).filter(|pair| pair[0].1 != pair[1].1).count();
            assert!(switches >= 4, "{orders:?}");
        }
        for stop in 0..epochs {
            let (_copy, query) = reopened_with_commits_up_to(dir.path(), stop);
            assert_eq!(query.restart_point(), Some(&(Epoch(stop), offsets(stop))), "stop {stop}");
        }
    }

    #[test]
    fn deltas_that_all_name_their_keyframe_still_decode() {
        // The first version of delta records: every delta from the run's last full record.
        let dir = tempfile::tempdir().unwrap();
        let offsets = |epoch: i64| -> Vec<(PartitionId, Payload)> { advancing(8, 1000, epoch) };
        let mut records = vec![(full_bytes(0, &offsets(0)), 0)];
        records.extend(
            (1..5).map(|epoch| (delta_bytes(0, &offsets(0), epoch, &offsets(epoch)), epoch)),
        );
        write_log(dir.path(), &records, &[0, 1, 2, 3, 4]);
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        assert_eq!(query.restart_point(), Some(&(Epoch(4), offsets(4))));
    }

    #[test]
    fn a_delta_whose_base_is_not_in_its_chain_fails_recovery_naming_both_epochs() {
        let dir = tempfile::tempdir().unwrap();
        let offsets = |epoch: i64| -> Vec<(PartitionId, Payload)> { advancing(4, 10, epoch) };
        // Epochs 0 (full) and 1, then a delta of epoch 3 from epoch 2, which is not logged.
        let records = [
            (full_bytes(0, &offsets(0)), 0),
            (delta_bytes(0, &offsets(0), 1, &offsets(1)), 1),
            (delta_bytes(2, &offsets(2), 3, &offsets(3)), 3),
        ];
        write_log(dir.path(), &records, &[0, 1, 3]);
        let error = DurableQuery::open(dir.path(), config()).unwrap_err();
        let EpochError::BadLogRecord { lsn, reason } = &error else { panic!("{error}") };
        assert_eq!(*lsn, 3);
        assert!(reason.contains("epoch 3") && reason.contains("epoch 2"), "{reason}");
    }

    #[test]
    fn a_record_of_a_negative_epoch_fails_the_open_naming_it() {
        for (records, commits) in
            [(vec![], vec![-5]), (vec![(full_bytes(-5, &offsets(-5, 0)), 0)], vec![])]
        {
            let dir = tempfile::tempdir().unwrap();
            write_log(dir.path(), &records, &commits);
            let error = DurableQuery::open(dir.path(), config()).unwrap_err();
            let EpochError::BadLogRecord { lsn, reason } = &error else { panic!("{error}") };
            assert_eq!((*lsn, reason.as_str()), (1, "epoch -5 is negative"));
        }
    }

    /// Waits in another thread until it waits on the status for a commit (bounded), then
    /// returns the thread, whose result is `wait_durable_committed(epoch, timeout)`.
    fn waiting_for_commit(
        status: &DurableQueryStatus,
        epoch: Epoch,
        timeout: Duration,
    ) -> std::thread::JoinHandle<(bool, Duration)> {
        let waiter = status.clone();
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            (waiter.wait_durable_committed(epoch, timeout), started.elapsed())
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while status.0.pending().waiters == 0 {
            assert!(Instant::now() < deadline, "the waiter never waited for a commit");
            std::thread::yield_now();
        }
        thread
    }

    /// A reader waiting for an epoch not committed yet gets it once it is committed and
    /// durable; an overflow's stop, before or during the wait, does not end it (the coordinator
    /// still commits after one).
    #[test]
    fn a_wait_for_a_durable_commit_waits_for_the_commit_too() {
        let overflow = || EpochError::BacklogExceeded {
            queue: super::super::BacklogQueue::PartitionOffsets,
            size: 11,
            limit: 10,
        };
        let dir = tempfile::tempdir().unwrap();
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        let status = query.status();
        query.stop(overflow());
        let waiter = waiting_for_commit(&status, Epoch(1), Duration::from_secs(30));
        query.stop(overflow());
        query.add_offsets(Epoch(0), Offsets::new(&offsets(0, 0))).unwrap();
        query.commit(Epoch(0)).unwrap();
        query.add_offsets(Epoch(1), Offsets::new(&offsets(1, 0))).unwrap();
        query.commit(Epoch(1)).unwrap();
        let (durable, _) = waiter.join().unwrap();
        assert!(durable, "epoch 1 committed and durable");
        assert_eq!(status.durable_committed(), Some(Epoch(1)));
    }

    /// After a fail-stop a wait ends at once; a new coordinator taking the query
    /// ([`Query::begin_run`]) begins commits again, and a wait gets its commit.
    #[test]
    fn a_new_run_begins_commits_again() {
        let long = Duration::from_secs(60);
        let dir = tempfile::tempdir().unwrap();
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        let status = query.status();
        query.stop(EpochError::SinkCommit { epoch: Epoch(0), source: "refused".into() });
        let started = Instant::now();
        assert!(!status.wait_durable_committed(Epoch(0), long));
        assert!(started.elapsed() < long / 2, "the fail-stop ended the wait");
        query.begin_run();
        let waiter = waiting_for_commit(&status, Epoch(0), long);
        query.add_offsets(Epoch(0), Offsets::new(&offsets(0, 0))).unwrap();
        query.commit(Epoch(0)).unwrap();
        assert!(waiter.join().unwrap().0, "the new run's commit of epoch 0");
    }

    /// A wait for an epoch that is never committed ends with its timeout.
    #[test]
    fn a_wait_for_a_commit_that_never_comes_ends_with_its_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        let timeout = Duration::from_millis(50);
        let started = Instant::now();
        assert!(!query.status().wait_durable_committed(Epoch(0), timeout));
        assert!(started.elapsed() >= timeout, "returned after {:?}", started.elapsed());
    }

    /// A reader waiting for a commit that can no longer come returns `false` at once when
    /// commits end: the coordinator fail-stopped, or the query was dropped.
    #[test]
    fn a_wait_for_a_commit_ends_when_commits_end() {
        let long = Duration::from_secs(60);
        let dir = tempfile::tempdir().unwrap();
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        let waiter = waiting_for_commit(&query.status(), Epoch(3), long);
        query.stop(EpochError::SinkCommit { epoch: Epoch(0), source: "refused".into() });
        let (durable, waited) = waiter.join().unwrap();
        assert!(!durable && waited < long / 2, "the fail-stop ended the wait after {waited:?}");

        let dir = tempfile::tempdir().unwrap();
        let query = DurableQuery::open(dir.path(), config()).unwrap();
        let waiter = waiting_for_commit(&query.status(), Epoch(3), long);
        drop(query);
        let (durable, waited) = waiter.join().unwrap();
        assert!(!durable && waited < long / 2, "the drop ended the wait after {waited:?}");
    }

    /// The inner query gets the stop error itself, its collaborator's error typed; the status
    /// keeps the first as a copy, the same variant with that error as text.
    #[test]
    fn the_inner_query_gets_the_stop_error_itself() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), config()).unwrap();
        let inner = super::super::MemoryQuery::default();
        let mut query = DurableQuery::from_wal(wal, inner.clone()).unwrap();
        let status = query.status();
        let refused = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "sink refused");
        query.stop(EpochError::SinkCommit { epoch: Epoch(4), source: Box::new(refused) });
        let EpochError::SinkCommit { epoch, source } = &*inner.stop_error().unwrap() else {
            panic!("the inner query's error is a SinkCommit");
        };
        assert_eq!(*epoch, Epoch(4));
        let io = source.downcast_ref::<std::io::Error>().expect("the sink's own error type");
        assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
        let kept = status.stop_error().unwrap();
        let EpochError::SinkCommit { epoch: Epoch(4), source } = &*kept else {
            panic!("the status keeps a SinkCommit: {kept:?}");
        };
        assert!(!source.is::<std::io::Error>());
        assert_eq!(kept.stop_text(), "the sink commit of epoch 4 failed: sink refused");
    }

    #[test]
    fn durable_commits_are_reported_and_a_closed_log_fails_the_query() {
        let dir = tempfile::tempdir().unwrap();
        let mut query = DurableQuery::open(dir.path(), config()).unwrap();
        let status = query.status();
        query.add_offsets(Epoch(0), Offsets::new(&offsets(0, 0))).unwrap();
        query.commit(Epoch(0)).unwrap();
        assert!(status.wait_durable_committed(Epoch(0), Duration::from_secs(10)));
        assert_eq!(status.durable_committed(), Some(Epoch(0)));
        query.wal().close().unwrap();
        let error = query.add_offsets(Epoch(1), Offsets::new(&offsets(1, 0))).unwrap_err();
        assert!(error.to_string().contains("epoch log"), "{error}");
        query.stop(EpochError::QueryCommit { epoch: Epoch(1), source: error });
        query.stop(EpochError::EpochOverflow { epoch: Epoch(2) });
        let first = status.stop_error().unwrap();
        // Typed: the variant and epoch, with the WAL's error as its source text.
        assert!(matches!(*first, EpochError::QueryCommit { epoch: Epoch(1), .. }), "{first:?}");
        let stop_error = first.stop_text();
        assert!(
            stop_error.starts_with("recording the commit of epoch 1 failed: ")
                && stop_error.contains("epoch log")
                && stop_error.contains("closed"),
            "the first stop error, with its causes: {stop_error}"
        );
    }
}
