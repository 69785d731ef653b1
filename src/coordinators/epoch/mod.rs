//! The continuous-processing epoch coordinator (SPEC B, with the decisions of SPEC 0.3).
//!
//! One coordinator per continuous run of a streaming query. It keeps the driver epoch that
//! executors poll, gathers each epoch's reader offsets and writer commit messages per partition,
//! records an epoch's offsets once every reader partition reported, and commits an epoch (sink
//! first, then the query's commit record) once it has every writer commit and every reader
//! offset and every earlier epoch is committed. Epochs that complete early wait and are committed
//! in order, in the same pass, by the message that completes the epoch before them.
//!
//! # The epoch protocol (SPEC B.8)
//! The driver's epoch thread asks [`IncrementAndGetEpoch`] every trigger interval: a reply of
//! `n + 1` ends epoch `n`. Tasks poll [`GetCurrentEpoch`] and, for each epoch they are behind
//! the driver's, send that epoch's [`ReportPartitionOffset`] (the reading side) and
//! [`CommitPartitionEpoch`] (the writing side), then move on to the next; they start at the
//! start epoch. As in Spark, one-way messages are not checked against the driver epoch: an
//! epoch the driver has not ended yet is stored and commits like any other (the tasks' epochs
//! are trusted). Only epochs at or below the last committed one are refused as stale (SPEC
//! 0.3; Spark stores those and never commits them).
//!
//! # Parts
//! * `payload`: [`Payload`] (opaque engine bytes, inline up to 24 bytes), [`Epoch`],
//!   [`PartitionId`].
//! * `state`: [`EpochCoordinator`], the state machine: no I/O, no threads, one method per
//!   message. Tests and embedders drive it directly.
//! * `endpoint`: [`EpochEndpoint`], the bus endpoint wrapping the state machine, its typed
//!   messages ([`CommitPartitionEpoch`], [`ReportPartitionOffset`]) and requests
//!   ([`GetCurrentEpoch`], [`IncrementAndGetEpoch`], [`SetReaderPartitions`],
//!   [`SetWriterPartitions`], [`StopContinuousExecutionWrites`], plus [`GetEpochStats`]).
//! * [`reference`](mod@reference): a deliberately simple model written straight from the spec
//!   (Spark-like maps, rescans on every message). It is the oracle of the property test and the
//!   baseline of the benchmark and the load tool; it is not meant for production.
//! * `durable`: [`DurableQuery`], the WAL-backed query (see Durability below), with
//!   [`DurableQueryStatus`] and [`NoopQuery`].
//! * Here: the collaborator traits [`Query`] and [`Sink`], an in-memory [`MemoryQuery`] (the
//!   offset and commit logs of SPEC B.9 without persistence), a [`NoopSink`], [`EpochConfig`],
//!   errors and counters.
//!
//! # Why it is fast
//! Spark's coordinator rescans its `(epoch, partition)` maps on every message (to count the
//! entries of an epoch, to collect them, to clean up), so one epoch at P partitions costs
//! O(P^2). This one keeps one bucket per pending epoch, with per-bucket entry counts, and
//! whole-coordinator entry counters for the backlog checks, so a message costs O(1) amortised:
//! * a bucket is found through a one-entry cache (consecutive messages mostly share an epoch)
//!   and otherwise an epoch-keyed hash map; buckets live in a slab and are recycled with their
//!   allocations, so a steady run allocates nothing per epoch (payloads that spilled to the
//!   heap are freed when their epoch commits, not kept until their slot is reused);
//! * near the commit frontier (as many epochs ahead as the side's backlog limit holds full epochs,
//!   and at least 16 for counts up to 16 Ki) a bucket is laid out densely: slot `p` holds partition
//!   `p`'s entry and a bitmap says which slots are filled, so a message costs a bit test and a
//!   store, and a complete epoch already is the slice, sorted by partition id, that the query and
//!   the sink get (SPEC 0.3). Every epoch that a backlog of full epochs within the limits can reach
//!   is near, so producers that run ahead of one another still fill dense buckets;
//! * further ahead, or while a partition count is unset, a bucket is sparse: entries in arrival
//!   order (the vector is its own index while partitions arrive as 0, 1, 2, ...; otherwise a
//!   small per-bucket hash map finds them), sorted on completion, by placing each entry at its
//!   index when the ids are exactly `0..n` (O(n), no comparison sort);
//! * cleanup after a commit frees exactly the buckets of the committed epochs (they are known),
//!   instead of scanning all pending state;
//! * the checks every message passes (SPEC B.4 and B.7) cost three comparisons while none is
//!   near failing: an admission gate derived from the partition counts, the last commit and
//!   the stop, and a lower bound of the room left under the backlog limits, taken down by one
//!   per entry stored and counted again when it runs out or the queues shrink. A message that
//!   fails them goes through the full checks, which name its reason.
//!
//! Each stored offset and commit is logged at debug level (SPEC 0.1), which costs a check of
//! `tracing`'s level per message; an engine that never wants them can compile them out with
//! one of `tracing`'s `release_max_level_*` features.
//!
//! Memory is bounded by the limits: sparse buckets grow with their entries; dense buckets (40 bytes
//! per partition and side, only for partition counts up to the side's backlog limit and 1 Mi, which
//! bounds what one message can allocate at 40 MiB a side) exist only for the epochs of that window,
//! `max(16, limit / count)` after the last committed one (for counts above 16 Ki `limit / count`,
//! no minimum, so their live dense sides stay within the limit), plus recycled ones, at most
//! `max(16, limit / count)` (only the free buckets released last keep their allocations, and every
//! free bucket gives them back when the count changes), so they take at most `2 x max(16 x count,
//! limit)` slots of 40 bytes per side, counts below 16 counting as 16. Recycled sparse sides keep
//! room for up to `count` entries too, at most the limit and one (which no side exceeds), so a
//! count above the limit makes that 16 x the limit. After a count is lowered, buckets laid out for
//! the old count stay until their epochs commit; those it left with no entry are freed. The backlog
//! checks stop the query once the entries exceed the limits (default 10 000 each), with Spark's
//! errors (SPEC B.7). Spark then keeps storing until the query sends
//! `StopContinuousExecutionWrites`, so tasks that keep sending grow its maps without bound. Here a
//! side (offsets or commits) whose entries are over its limit takes no new `(epoch, partition)`
//! entry, except for the next epoch to commit while that side's partition count is set and within
//! the limit: only those messages can commit epochs and so free the queue (an epoch with more
//! partitions than the limit cannot commit without overflowing anyway). A message it refuses is
//! dropped and counted ([`DropReason::BacklogFull`]), and the checks run for it as for a stored one
//! (they fire again, as in Spark); a repeat report or a duplicate commit adds no entry and is
//! handled as usual. Each side therefore holds at most its limit plus one entry, plus the next
//! epoch's (at most its partition count, itself within the limit), whatever arrives after the stop;
//! ready epochs waiting to commit hold commit entries, so they are bounded by the commit limit too.
//! A refused message is lost (tasks do not resend), so its epoch never commits: by then the run is
//! failing anyway (the query has the overflow error). This departs from SPEC B.7 ("it does not drop
//! or truncate anything on overflow") on purpose: issue 4 asks for memory bounded by the backlog
//! limits, and where the spec and an issue disagree, the issue wins. The reference model of the
//! property test ([`reference::ReferenceEpochCoordinator`]) carries the same rule, so the two are
//! compared on it too.
//!
//! # Behaviour decisions (SPEC 0.3 over B, and where the spec is silent)
//! * A message for an epoch at or below the last committed epoch (which covers epochs below
//!   the start epoch) is dropped and counted; it never re-enters the waiting set.
//! * A negative partition id, or one not below the partition count when that count is set, is
//!   dropped and counted. While a count is unset (0), any non-negative partition id of that side
//!   is kept (as in Spark), and no epoch completes until both counts are set (B.5 read literally
//!   would complete an epoch with no offsets when the reader count is 0). Setting a count
//!   drops, counted as out of range, the entries of pending epochs kept with an id not below
//!   it (kept while it was unset, or under a larger count), so that a complete side is exactly
//!   partitions `0..count`: in Spark, which counts entries, such an entry stands in for a
//!   missing partition, whose own commit is then dropped as stale and never reaches the sink.
//!   The commit chain takes a waiting epoch only if it is ready under the counts of now: one
//!   that waited and no longer is (a count was raised, or unset) is not committed with a
//!   partition missing, as Spark's would be; it stays waiting, and commits once it is ready
//!   again: by its next message, or, if the chain passed it and a count change makes it ready
//!   (the count set back), at that count change. Otherwise setting a count resolves nothing by
//!   itself (Spark); the next message of an epoch does.
//! * An epoch that becomes ready although `add_offsets` was never called for it (every offset
//!   arrived while the reader count was unset and a writer commit then completed the epoch, or
//!   the count was lowered to what had arrived) gets its `add_offsets` call just before its
//!   sink commit, counted ([`EpochCounters::offsets_added_at_commit`]) and logged as a
//!   warning. Spark commits such an epoch with no offset log entry, which its next restart
//!   rejects ("Batch E was committed without end epoch offsets!"), after the sink already
//!   committed it; [`DurableQuery`] would likewise refuse the commit. An epoch whose offsets
//!   were added once is not added again at its commit, even if a count change let its
//!   offsets change without a completing report (the offset log keeps a run's first record of
//!   an epoch anyway). So a reader count raised after an epoch's offsets were added leaves the
//!   new partitions out of that epoch's record: their reports complete it again and call
//!   `add_offsets` again, which the offset log ignores, and a restart from that epoch finds no
//!   offset for them (Spark's offset log keeps the first entry too, SPEC B.9). Set the counts
//!   before the tasks start (SPEC B.4).
//! * A duplicate `CommitPartitionEpoch` is dropped and counted (first commit wins, no backlog
//!   check). A repeated `ReportPartitionOffset` overwrites the offset (Spark) and, if the epoch's
//!   offsets are complete, calls `add_offsets` again.
//! * Dropped messages (writes stopped, stale epoch, bad partition, backlog full, duplicate
//!   commit) change no state and, except for backlog full (see the paragraph on memory above),
//!   run no backlog check. Precedence of reasons: writes stopped, negative partition, partition
//!   out of range, stale epoch, backlog full, duplicate commit. Every drop is counted by its
//!   reason ([`EpochCounters`]) and logged, as a warning for the 1st, 2nd, 4th, 8th, ... drop
//!   of each reason (with the count so far) and at debug level for the others, so that a flood
//!   of bad input (a misconfigured task sending every offset to partition -1) cannot flood the
//!   log; drops after the stop of writes are expected (lame-duck tasks, SPEC B.6) and only
//!   logged at debug level.
//! * A negative partition count in `SetReaderPartitions` / `SetWriterPartitions` is rejected
//!   with [`EpochError::InvalidPartitionCount`] (the asker gets the error) and changes nothing.
//!   `IncrementAndGetEpoch` at `i64::MAX` fails with [`EpochError::EpochOverflow`].
//! * Fail-stop: if `add_offsets`, the sink commit or the query commit fails, the query is
//!   stopped with that error (the same path as the backlog errors) and no epoch is committed
//!   from then on, ever. The epochs committed earlier in the same pass stay committed and are
//!   cleaned up as usual; the failing epoch (and every epoch that becomes ready later) is kept
//!   in the waiting set, where it counts towards the epoch backlog.
//! * The backlog counts include the retained entries of the last committed epoch, exactly as
//!   Spark's maps do (they are kept until the next commit), so the checks fire on the same
//!   message as in Spark, apart from the messages dropped above (stale or out of range: Spark
//!   stores and counts them) and the fail-stop cleanup above (SPEC B.5 skips it).
//!
//! # Durability (SPEC 0.3, B.9, B.10)
//! The coordinator persists nothing itself: what must survive a restart goes through the
//! [`Query`] trait, which is exactly Spark's offset log and commit log.
//! * [`MemoryQuery`] keeps those logs in memory ([`MemoryQuery::restart_point`] is the B.10
//!   rule), for tests and engines that persist elsewhere.
//! * [`DurableQuery`] (`durable`) keeps them in coordbus's WAL, in front of an inner engine
//!   query (default [`NoopQuery`]) that still gets every `add_offsets`, `commit` and `stop`
//!   after the append. `add_offsets` appends one rkyv record of the epoch's offsets (once per
//!   epoch and run; the first record of a run wins, a newer run's replaces an older run's; for
//!   an epoch far after the last commit, at its commit instead, which a restart cannot tell);
//!   `commit` appends a committed-epoch record after the sink committed the epoch (and fails
//!   with [`EpochError::CommittedWithoutOffsets`] if the epoch has no offsets), and ignores
//!   (counts) a commit of an already committed epoch. Appends never wait for an fsync (group
//!   commit); [`DurableQueryStatus`] tells from any thread which commits are durable. Once the
//!   WAL has failed, both calls fail with [`EpochError::Wal`], which fail-stops the
//!   coordinator.
//! * Restart: [`DurableQuery::open`] (or [`DurableQuery::from_wal`]) reads the log and yields
//!   the restart point: the last committed epoch `E` and its offsets, or none (start at 0);
//!   offsets of epochs after `E` are ignored, and a commit without offsets fails with Spark's
//!   "Batch E was committed without end epoch offsets!". The new coordinator gets
//!   `EpochConfig::start_epoch = E + 1` ([`DurableQuery::start_epoch`]), so a commit or report
//!   that arrives again for `E` or earlier is dropped as stale (and counted), and the engine
//!   resumes reading from `E`'s offsets. An epoch whose commit record was not durable at a
//!   crash is committed again by the next run (the sink sees it twice: SPEC B.5's
//!   at-least-once).
//! * Bounded log: records carry the epoch as their WAL time, so with `D` the last commit known
//!   durable the WAL's time-based `clean` drops whole segments of epochs below
//!   `D + 1 - retained` (Spark's `minBatchesToRetain`, default 100), never `D`'s own records.

mod delta;
mod durable;
mod endpoint;
mod log_record;
mod low_bytes;
mod payload;
pub mod reference;
mod state;
mod zigzag;

pub use self::{
    durable::{
        DurableQuery, DurableQueryStatus, NoopQuery, RestartPoint, CLOSE_TIMEOUT,
        DEFAULT_RETAINED_EPOCHS, DEFAULT_WRITE_TIMEOUT, DEFERRED_ENTRIES_MAX,
    },
    endpoint::{
        coordinator_name, CommitPartitionEpoch, EpochEndpoint, EpochMessage, EpochRequest,
        GetCurrentEpoch, GetEpochStats, IncrementAndGetEpoch, ReportPartitionOffset,
        SetReaderPartitions, SetWriterPartitions, StopContinuousExecutionWrites,
    },
    payload::{Epoch, Offsets, PartitionId, Payload},
    state::EpochCoordinator,
};
use crate::error::{ConfigError, HandlerError};

/// The error a collaborator (query, sink) returns from a failed call.
pub type CollaboratorError = HandlerError;

/// The query side of the run (Spark's `ContinuousExecution`), implemented by the engine.
///
/// Calls arrive on the coordinator's thread, one at a time, in the order the coordinator makes
/// them. See the module docs for the durable implementation's contract.
pub trait Query {
    /// Records the end offsets of `epoch` (Spark's `addOffset`: the offset log). `offsets` holds
    /// one entry per reader partition, sorted by partition id, and says whether they are words
    /// ([`Offsets::are_words`]).
    ///
    /// Called each time a report leaves the epoch's offsets complete, so possibly more than once
    /// for the same epoch (a repeated report; the first record of an epoch in a run should win,
    /// [`Query::begin_run`]), and in the order the epochs complete, which may run ahead of the
    /// commits (epoch 3's offsets before epoch 2 commits). An epoch that became ready without
    /// such a report gets its call just before its sink commit (module docs). Either way an
    /// epoch's offsets are recorded before its [`Sink::commit`]. The calls go on after
    /// [`Query::stop`] and after a fail-stop: the coordinator keeps handling messages (SPEC
    /// B.7) until the engine stops the writes.
    ///
    /// # Errors
    /// A failure to record; the coordinator then stops the query with
    /// [`EpochError::AddOffsets`] and commits no epoch from then on, ever (it is not retried).
    fn add_offsets(&mut self, epoch: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError>;

    /// Records `epoch` as committed (the commit log). Called at most once per epoch in a run,
    /// right after the sink committed it, in strictly increasing, gap-free epoch order from the
    /// start epoch.
    ///
    /// # Errors
    /// A failure to record; the coordinator then stops the query with
    /// [`EpochError::QueryCommit`] and commits no epoch from then on, ever (it is not retried).
    /// The sink has committed `epoch` already; a restarted run commits it again ([`Sink`]).
    fn commit(&mut self, epoch: Epoch) -> Result<(), CollaboratorError>;

    /// Asks the query to stop with `error` as its cause (Spark's `stopInNewThread`). May be
    /// called many times (every failing backlog check calls it); keeping only the **first**
    /// error is the query's job. Must not block on the coordinator.
    ///
    /// A request, not an end: the coordinator keeps handling messages after it (SPEC B.7), so
    /// after a backlog overflow epochs that complete still commit, and [`Query::add_offsets`]
    /// and [`Query::commit`] are still called, until the engine sends
    /// `StopContinuousExecutionWrites` and stops the endpoint (SPEC B.6). The errors it gets:
    /// [`EpochError::BacklogExceeded`], after which epochs still commit; and the fail-stops
    /// [`EpochError::AddOffsets`], [`EpochError::SinkCommit`], [`EpochError::QueryCommit`] and
    /// [`EpochError::HandlerPanicked`], after which no epoch commits any more. A request's
    /// errors ([`EpochError::InvalidPartitionCount`], [`EpochError::EpochOverflow`]) go to its
    /// asker, never here.
    fn stop(&mut self, error: EpochError);

    /// The last epoch this query has recorded committed, if any (a restarted query: the `E`
    /// of SPEC B.10). A coordinator must start exactly at `E + 1` ([`EpochCoordinator::new`],
    /// `startEpoch = E + 1`): below it the sink would commit those epochs again; above it the
    /// epochs in between would never commit, and a later restart would resume past their
    /// offsets; after `i64::MAX` no epoch is left to start at. `None` (the default): no epoch
    /// committed, or no history to check against; any start epoch is taken.
    fn last_committed_epoch(&self) -> Option<Epoch> {
        None
    }

    /// A coordinator starts with this query ([`EpochCoordinator::new`] calls it once, after
    /// the start epoch check). A query that keeps an offset log starts a new run here: the
    /// offsets the new coordinator records replace those an earlier coordinator recorded for
    /// epochs it did not commit (SPEC B.10), also when one query is handed on from coordinator
    /// to coordinator. The default does nothing.
    fn begin_run(&mut self) {}
}

/// The data sink's global commit, implemented by the engine.
///
/// **At least once:** the same epoch can reach a sink again in a later run. If the process
/// dies (or [`Query::commit`] fails) after the sink committed an epoch and before the query's
/// commit record is durable, the restarted run starts at that epoch and commits it again (SPEC
/// B.5), so a sink must take a repeated commit of an epoch as done (idempotent per epoch).
pub trait Sink {
    /// Commits `epoch` with one writer commit message per writer partition, sorted by
    /// partition id.
    ///
    /// Called at most once per epoch in a run (none after a fail-stop), in strictly increasing,
    /// gap-free epoch order from the start epoch, after the epoch's offsets were recorded
    /// ([`Query::add_offsets`]) and before [`Query::commit`] of the same epoch. An embedder
    /// driving the state machine that catches a panic of its sink must call
    /// [`EpochCoordinator::fail_after_panic`] before applying anything more, as the endpoint
    /// does.
    ///
    /// # Errors
    /// A failed commit; the coordinator then stops the query with [`EpochError::SinkCommit`]
    /// and commits no epoch from then on, ever (it is not retried). On the bus a panic here is
    /// caught by the endpoint and fail-stops the coordinator the same way
    /// ([`EpochError::HandlerPanicked`]).
    fn commit(
        &mut self,
        epoch: Epoch,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError>;
}

/// A [`Sink`] that accepts every commit and keeps nothing: the default sink for tests,
/// benchmarks, and engines whose writers make their output visible on their own.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopSink;

impl Sink for NoopSink {
    fn commit(&mut self, _: Epoch, _: &[(PartitionId, Payload)]) -> Result<(), CollaboratorError> {
        Ok(())
    }
}

impl<T: Query + ?Sized> Query for Box<T> {
    fn add_offsets(&mut self, epoch: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError> {
        (**self).add_offsets(epoch, offsets)
    }
    fn commit(&mut self, epoch: Epoch) -> Result<(), CollaboratorError> {
        (**self).commit(epoch)
    }
    fn stop(&mut self, error: EpochError) {
        (**self).stop(error);
    }
    fn last_committed_epoch(&self) -> Option<Epoch> {
        (**self).last_committed_epoch()
    }
    fn begin_run(&mut self) {
        (**self).begin_run();
    }
}

impl<T: Sink + ?Sized> Sink for Box<T> {
    fn commit(
        &mut self,
        epoch: Epoch,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError> {
        (**self).commit(epoch, messages)
    }
}

/// An in-memory [`Query`]: what Spark's `ContinuousExecution` keeps (SPEC B.9), without
/// persistence. The offset log keeps the first record of each epoch (of a run: below), the
/// commit log the
/// committed epochs (a commit of an epoch without offsets fails, as Spark's assertion does), the
/// newest `retained_epochs` committed epochs' offsets are kept (Spark's `minBatchesToRetain`,
/// default 100), and the first stop error is kept. Clones share one state, so an engine or a test
/// can read it while the endpoint owns the query. [`DurableQuery`] keeps the same records on
/// disk.
///
/// **Each clone, and each coordinator it is handed to ([`Query::begin_run`]), is a run of its
/// own**, as each opening of a [`DurableQuery`] is (a restarted coordinator starts after
/// [`MemoryQuery::restart_point`]).
/// Within a run the first offsets record of an epoch wins; a later run's record replaces one an
/// earlier run made (SPEC B.10: offsets logged for epochs after the last commit are ignored on
/// restart, and the restarted run's own offsets are what its commit of that epoch stands for).
#[derive(Debug)]
pub struct MemoryQuery {
    state: std::sync::Arc<std::sync::Mutex<MemoryQueryState>>,
    /// This clone's run: later clones have larger numbers.
    run: u64,
}

#[derive(Debug)]
struct MemoryQueryState {
    /// Each epoch's offsets, with the run that recorded them.
    offsets: std::collections::BTreeMap<Epoch, (u64, Vec<(PartitionId, Payload)>)>,
    last_committed: Option<Epoch>,
    stop_error: Option<std::sync::Arc<EpochError>>,
    retained_epochs: usize,
    /// The run number of the next clone.
    next_run: u64,
}

impl Clone for MemoryQuery {
    /// Another handle on the same state, as a new run (type doc).
    fn clone(&self) -> Self {
        let mut state = self.state();
        let run = state.next_run;
        state.next_run += 1;
        Self { state: std::sync::Arc::clone(&self.state), run }
    }
}

impl Default for MemoryQuery {
    fn default() -> Self {
        Self::new(100)
    }
}

/// `retained_epochs` as the queries count with it: at least 1, and at most `i64::MAX` (epochs
/// are `i64`, and every epoch is kept from there on), so that it converts to an epoch count
/// without wrapping negative.
pub(crate) fn clamp_retained_epochs(retained_epochs: usize) -> usize {
    retained_epochs.clamp(1, i64::MAX as usize)
}

impl MemoryQuery {
    /// An empty query keeping the offsets of the newest `retained_epochs` committed epochs (at
    /// least 1; anything from `i64::MAX` up keeps every epoch).
    pub fn new(retained_epochs: usize) -> Self {
        Self {
            state: std::sync::Arc::new(std::sync::Mutex::new(MemoryQueryState {
                offsets: std::collections::BTreeMap::new(),
                last_committed: None,
                stop_error: None,
                retained_epochs: clamp_retained_epochs(retained_epochs),
                next_run: 1,
            })),
            run: 0,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MemoryQueryState> {
        // A panic while holding the lock leaves plain data behind; keep using it.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The last committed epoch, if any.
    pub fn last_committed(&self) -> Option<Epoch> {
        self.state().last_committed
    }

    /// The offsets recorded for `epoch` (the winning record: type doc), if still retained.
    pub fn offsets(&self, epoch: Epoch) -> Option<Vec<(PartitionId, Payload)>> {
        self.state().offsets.get(&epoch).map(|(_, offsets)| offsets.clone())
    }

    /// The first error the query was stopped with, typed (shared: the query keeps it too);
    /// [`EpochError::stop_text`] gives it as text with its causes and an overflow's values.
    pub fn stop_error(&self) -> Option<std::sync::Arc<EpochError>> {
        self.state().stop_error.clone()
    }

    /// Whether the query was asked to stop.
    pub fn is_stopped(&self) -> bool {
        self.state().stop_error.is_some()
    }

    /// Where a restarted run starts (SPEC B.10): `None` for a new query (start epoch 0), else
    /// the last committed epoch `E` with its offsets; the new coordinator starts at `E + 1`.
    ///
    /// # Errors
    /// [`EpochError::CommittedWithoutOffsets`] if `E` has no offsets.
    pub fn restart_point(&self) -> Result<Option<RestartPoint>, EpochError> {
        let state = self.state();
        let Some(epoch) = state.last_committed else {
            return Ok(None);
        };
        state
            .offsets
            .get(&epoch)
            .map(|(_, offsets)| Some((epoch, offsets.clone())))
            .ok_or(EpochError::CommittedWithoutOffsets { epoch })
    }
}

impl Query for MemoryQuery {
    fn add_offsets(&mut self, epoch: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError> {
        let mut state = self.state();
        if state.last_committed.is_some_and(|last| epoch <= last) {
            // Committed already (a late call of an old run): its record stays as it is.
            return Ok(());
        }
        match state.offsets.entry(epoch) {
            std::collections::btree_map::Entry::Vacant(vacant) => {
                vacant.insert((self.run, offsets.to_vec()));
            }
            // An earlier run's record of an epoch it did not commit: this run's replaces it.
            std::collections::btree_map::Entry::Occupied(mut occupied)
                if occupied.get().0 < self.run =>
            {
                occupied.insert((self.run, offsets.to_vec()));
            }
            std::collections::btree_map::Entry::Occupied(_) => {}
        }
        Ok(())
    }

    fn commit(&mut self, epoch: Epoch) -> Result<(), CollaboratorError> {
        let mut state = self.state();
        if !state.offsets.contains_key(&epoch) {
            return Err(Box::new(EpochError::CommittedWithoutOffsets { epoch }));
        }
        state.last_committed = Some(epoch);
        // Keep the newest `retained_epochs` committed epochs (and everything after them).
        let keep_from = Epoch(epoch.0.saturating_sub(state.retained_epochs as i64 - 1));
        state.offsets = state.offsets.split_off(&keep_from);
        Ok(())
    }

    /// The last epoch committed (`None` while none was).
    fn last_committed_epoch(&self) -> Option<Epoch> {
        self.state().last_committed
    }

    /// Takes a new run number, as a clone does (type doc).
    fn begin_run(&mut self) {
        let mut state = self.state();
        let run = state.next_run;
        state.next_run += 1;
        drop(state);
        self.run = run;
    }

    fn stop(&mut self, error: EpochError) {
        let mut state = self.state();
        if state.stop_error.is_none() {
            tracing::warn!(error = %error.stop_text(), "query stopped by the epoch coordinator");
            state.stop_error = Some(std::sync::Arc::new(error));
        }
    }
}

/// Which backlog limit overflowed (SPEC B.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BacklogQueue {
    /// Stored `(epoch, partition)` offset entries.
    PartitionOffsets,
    /// Stored `(epoch, partition)` writer commit entries.
    PartitionCommits,
    /// Epochs found ready while an earlier epoch was uncommitted, not committed yet (Spark's
    /// `epochsWaitingToBeCommitted`; one a count change has made not ready since stays).
    WaitingEpochs,
}

impl BacklogQueue {
    /// The exact message Spark raises for this overflow (engines match on it).
    pub fn overflow_message(self) -> &'static str {
        match self {
            Self::PartitionOffsets => "Size of the partition offset queue has exceeded its maximum",
            Self::PartitionCommits => "Size of the partition commit queue has exceeded its maximum",
            Self::WaitingEpochs => "Size of the epoch queue has exceeded its maximum",
        }
    }

    /// What the queue holds, for messages.
    fn noun(self) -> &'static str {
        match self {
            Self::PartitionOffsets => "partition offset queue",
            Self::PartitionCommits => "partition commit queue",
            Self::WaitingEpochs => "epoch queue",
        }
    }
}

impl EpochError {
    /// This error as the queries log it when they are stopped with it: its message with its
    /// causes, and for an overflow the queue's size and limit too (its `Display` is Spark's
    /// message, verbatim, which names neither).
    ///
    /// ```
    /// use coordbus::coordinators::epoch::{BacklogQueue, EpochError};
    /// let error = EpochError::BacklogExceeded {
    ///     queue: BacklogQueue::WaitingEpochs,
    ///     size: 11,
    ///     limit: 10,
    /// };
    /// assert_eq!(error.to_string(), "Size of the epoch queue has exceeded its maximum");
    /// assert_eq!(
    ///     error.stop_text(),
    ///     "Size of the epoch queue has exceeded its maximum (size 11, limit 10)"
    /// );
    /// ```
    pub fn stop_text(&self) -> String {
        let text = crate::error::message_with_causes(self);
        match self {
            Self::BacklogExceeded { size, limit, .. } => {
                format!("{text} (size {size}, limit {limit})")
            }
            _ => text,
        }
    }

    /// Whether the coordinator commits nothing more after stopping the query with this error:
    /// a collaborator failed ([`EpochError::AddOffsets`], [`EpochError::SinkCommit`],
    /// [`EpochError::QueryCommit`]) or a handler panicked ([`EpochError::HandlerPanicked`]).
    /// After [`EpochError::BacklogExceeded`], the other error it stops a query with, epochs
    /// still commit ([`Query::stop`]).
    pub fn is_fail_stop(&self) -> bool {
        matches!(
            self,
            Self::AddOffsets { .. }
                | Self::SinkCommit { .. }
                | Self::QueryCommit { .. }
                | Self::HandlerPanicked { .. }
        )
    }

    /// A copy of this error for a second owner (a query that keeps the first stop error and
    /// also hands it on to an inner query): the same variant and values, with a collaborator's
    /// error (which cannot be cloned) kept as its text with its causes.
    pub(crate) fn copy_with_text_sources(&self) -> Self {
        let text = |source: &CollaboratorError| -> CollaboratorError {
            crate::error::message_with_causes(source.as_ref()).into()
        };
        match self {
            Self::BacklogExceeded { queue, size, limit } => {
                Self::BacklogExceeded { queue: *queue, size: *size, limit: *limit }
            }
            Self::AddOffsets { epoch, source } => {
                Self::AddOffsets { epoch: *epoch, source: text(source) }
            }
            Self::SinkCommit { epoch, source } => {
                Self::SinkCommit { epoch: *epoch, source: text(source) }
            }
            Self::QueryCommit { epoch, source } => {
                Self::QueryCommit { epoch: *epoch, source: text(source) }
            }
            Self::HandlerPanicked { epoch, message } => {
                Self::HandlerPanicked { epoch: *epoch, message: message.clone() }
            }
            Self::InvalidPartitionCount { side, count } => {
                Self::InvalidPartitionCount { side: *side, count: *count }
            }
            Self::CommittedWithoutOffsets { epoch } => {
                Self::CommittedWithoutOffsets { epoch: *epoch }
            }
            Self::Wal { op, source } => Self::Wal { op, source: source.clone() },
            Self::BadLogRecord { lsn, reason } => {
                Self::BadLogRecord { lsn: *lsn, reason: reason.clone() }
            }
            Self::EpochOverflow { epoch } => Self::EpochOverflow { epoch: *epoch },
        }
    }
}

/// Which side a partition count belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PartitionSide {
    /// Reader partitions (offsets).
    Reader,
    /// Writer partitions (commit messages).
    Writer,
}

impl std::fmt::Display for PartitionSide {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Self::Reader => "reader",
            Self::Writer => "writer",
        })
    }
}

/// Errors of the epoch coordinator: what it stops the query with, and failed requests.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EpochError {
    /// A backlog limit was exceeded (SPEC B.7). The message is Spark's, verbatim; the fields
    /// say which queue, its size and its limit.
    #[error("{}", .queue.overflow_message())]
    BacklogExceeded {
        /// The queue that overflowed.
        queue: BacklogQueue,
        /// Its size when checked.
        size: usize,
        /// The configured limit (the check is `size > limit`).
        limit: usize,
    },
    /// [`Query::add_offsets`] failed.
    #[error("recording the offsets of epoch {epoch} failed")]
    AddOffsets {
        /// The epoch whose offsets were being recorded.
        epoch: Epoch,
        /// The query's error.
        #[source]
        source: CollaboratorError,
    },
    /// [`Sink::commit`] failed.
    #[error("the sink commit of epoch {epoch} failed")]
    SinkCommit {
        /// The epoch being committed.
        epoch: Epoch,
        /// The sink's error.
        #[source]
        source: CollaboratorError,
    },
    /// [`Query::commit`] failed (after the sink committed the epoch).
    #[error("recording the commit of epoch {epoch} failed")]
    QueryCommit {
        /// The epoch being committed.
        epoch: Epoch,
        /// The query's error.
        #[source]
        source: CollaboratorError,
    },
    /// A handler of the coordinator panicked (a collaborator's, or its own): its state may be
    /// half updated, so it fail-stops as for a failed collaborator (SPEC 0.3), at the epoch it
    /// was to commit next.
    #[error("the epoch coordinator's handler panicked (next epoch to commit: {epoch}): {message}")]
    HandlerPanicked {
        /// The epoch the coordinator was to commit next.
        epoch: Epoch,
        /// The panic's message.
        message: String,
    },
    /// A partition count below zero was asked for.
    #[error("{side} partition count {count} is negative")]
    InvalidPartitionCount {
        /// Reader or writer.
        side: PartitionSide,
        /// The count asked for.
        count: i32,
    },
    /// An epoch is recorded as committed but has no offsets (SPEC B.9 assertion, B.10).
    #[error("Batch {epoch} was committed without end epoch offsets!")]
    CommittedWithoutOffsets {
        /// The committed epoch.
        epoch: Epoch,
    },
    /// The epoch log's WAL failed (or refused) an operation; see [`DurableQuery`].
    #[error("the epoch log could not {op}")]
    Wal {
        /// What was being done.
        op: &'static str,
        /// The WAL's error.
        #[source]
        source: crate::wal::WalError,
    },
    /// A record of the epoch log is not a valid epoch-log record (or could not be built).
    #[error("bad epoch log record at LSN {lsn}: {reason}")]
    BadLogRecord {
        /// Its LSN (0 while building a record).
        lsn: u64,
        /// What is wrong.
        reason: String,
    },
    /// The driver epoch cannot be incremented any more.
    #[error("the driver epoch {epoch} cannot be incremented past i64::MAX")]
    EpochOverflow {
        /// The current driver epoch.
        epoch: Epoch,
    },
}

/// Settings of one coordinator. `Default`: start epoch 0, every backlog limit 10 000 (Spark's
/// `spark.sql.streaming.continuous.epochBacklogQueueSize`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EpochConfig {
    /// The epoch the run starts at (0 for a new query, last committed + 1 on restart, SPEC
    /// B.10). The driver epoch starts here and the last committed epoch one below. At least 0.
    pub start_epoch: Epoch,
    /// Most `(epoch, partition)` offset entries before the query is stopped (strict `>`).
    pub partition_offset_limit: usize,
    /// Most `(epoch, partition)` commit entries before the query is stopped (strict `>`).
    pub partition_commit_limit: usize,
    /// Most waiting epochs ([`BacklogQueue::WaitingEpochs`]) before the query is stopped
    /// (strict `>`).
    pub waiting_epoch_limit: usize,
}

impl Default for EpochConfig {
    fn default() -> Self {
        Self {
            start_epoch: Epoch(0),
            partition_offset_limit: Self::DEFAULT_BACKLOG_LIMIT,
            partition_commit_limit: Self::DEFAULT_BACKLOG_LIMIT,
            waiting_epoch_limit: Self::DEFAULT_BACKLOG_LIMIT,
        }
    }
}

impl EpochConfig {
    /// Spark's default `epochBacklogQueueSize`.
    pub const DEFAULT_BACKLOG_LIMIT: usize = 10_000;

    /// Default settings starting at `start_epoch`.
    pub fn new(start_epoch: impl Into<Epoch>) -> Self {
        Self { start_epoch: start_epoch.into(), ..Self::default() }
    }

    /// Sets all three backlog limits to `limit` (Spark has one setting for all three).
    pub fn with_backlog_limit(mut self, limit: usize) -> Self {
        self.partition_offset_limit = limit;
        self.partition_commit_limit = limit;
        self.waiting_epoch_limit = limit;
        self
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] for a negative start epoch.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.start_epoch.0 < 0 {
            return Err(ConfigError::Invalid {
                setting: "start_epoch",
                value: self.start_epoch.to_string(),
                reason: "must be at least 0",
            });
        }
        Ok(())
    }
}

/// The one-way message kinds, for drop reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// `CommitPartitionEpoch`.
    CommitPartitionEpoch,
    /// `ReportPartitionOffset`.
    ReportPartitionOffset,
}

impl std::fmt::Display for MessageKind {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Self::CommitPartitionEpoch => "CommitPartitionEpoch",
            Self::ReportPartitionOffset => "ReportPartitionOffset",
        })
    }
}

/// Why a one-way message was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum DropReason {
    /// `StopContinuousExecutionWrites` was processed earlier (SPEC B.6).
    #[error("writes are stopped")]
    WritesStopped,
    /// The partition id is negative.
    #[error("the partition id is negative")]
    NegativePartition,
    /// The partition id is not below the configured partition count.
    #[error("the partition id is not below the partition count {count}")]
    PartitionOutOfRange {
        /// The partition count of the message's side.
        count: i32,
    },
    /// The epoch is at or below the last committed epoch (or below the start epoch).
    #[error("the epoch is at or below the last committed epoch {last_committed}")]
    StaleEpoch {
        /// The last committed epoch when the message arrived.
        last_committed: Epoch,
    },
    /// A commit for this epoch and partition was already stored (the first wins).
    #[error("the partition already committed this epoch")]
    DuplicateCommit,
    /// The message would add an entry to a queue that already holds more entries than its
    /// backlog limit, for an epoch other than the next to commit (or for that one while its
    /// side's partition count is unset): the backlog check stopped the query when the queue
    /// overflowed, and the coordinator takes no more such entries until commits bring it back
    /// to the limit (so memory stays bounded by the limits: see the module doc).
    #[error("the {} already holds more than its limit of {limit} entries", .queue.noun())]
    BacklogFull {
        /// The queue the message would have grown.
        queue: BacklogQueue,
        /// Its backlog limit.
        limit: usize,
    },
}

impl DropReason {
    /// A short fixed name of the reason (for counters such as
    /// [`EndpointStats::dropped_by_reason`](crate::EndpointStats)).
    pub fn label(&self) -> &'static str {
        match self {
            Self::WritesStopped => "writes stopped",
            Self::NegativePartition => "negative partition id",
            Self::PartitionOutOfRange { .. } => "partition id out of range",
            Self::StaleEpoch { .. } => "stale epoch",
            Self::DuplicateCommit => "duplicate commit",
            Self::BacklogFull { .. } => "backlog full",
        }
    }
}

/// A one-way message the coordinator dropped, with the values that explain why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{kind} of partition {partition} for epoch {epoch} dropped: {reason}")]
pub struct Rejected {
    /// The message's kind.
    pub kind: MessageKind,
    /// Its partition id.
    pub partition: PartitionId,
    /// Its epoch.
    pub epoch: Epoch,
    /// Why it was dropped.
    pub reason: DropReason,
}

/// Counters of one coordinator (monotonic since construction).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EpochCounters {
    /// Offset reports stored for a new `(epoch, partition)`.
    pub offsets_accepted: u64,
    /// Offset reports that replaced an earlier offset of the same `(epoch, partition)`.
    pub offsets_overwritten: u64,
    /// Writer commits stored.
    pub commits_accepted: u64,
    /// Calls of [`Query::add_offsets`].
    pub offsets_added: u64,
    /// Of those, calls made just before an epoch's sink commit because no report had
    /// completed the epoch's offsets (they all arrived before the reader partition count was
    /// set, or the count changed after they arrived).
    pub offsets_added_at_commit: u64,
    /// Epochs committed (sink and query both succeeded).
    pub epochs_committed: u64,
    /// Messages dropped because writes were stopped.
    pub dropped_writes_stopped: u64,
    /// Messages dropped for a negative partition id.
    pub dropped_negative_partition: u64,
    /// Messages dropped for a partition id not below the partition count, and stored
    /// entries dropped for it when a count was set (they were counted as accepted first).
    pub dropped_partition_out_of_range: u64,
    /// Messages dropped for an epoch at or below the last committed one.
    pub dropped_stale_epoch: u64,
    /// Duplicate writer commits dropped.
    pub dropped_duplicate_commit: u64,
    /// Messages dropped because their queue was over its backlog limit.
    pub dropped_backlog_full: u64,
    /// Partition-count requests rejected (negative count).
    pub rejected_partition_counts: u64,
    /// Backlog checks that failed (each one called [`Query::stop`]).
    pub backlog_overflows: u64,
}

impl EpochCounters {
    /// All one-way messages dropped, whatever the reason (with the stored entries a count
    /// change dropped: [`Self::dropped_partition_out_of_range`]).
    pub fn dropped(&self) -> u64 {
        self.dropped_writes_stopped
            + self.dropped_negative_partition
            + self.dropped_partition_out_of_range
            + self.dropped_stale_epoch
            + self.dropped_duplicate_commit
            + self.dropped_backlog_full
    }

    pub(crate) fn count_drop(&mut self, reason: DropReason) -> u64 {
        let counter = match reason {
            DropReason::WritesStopped => &mut self.dropped_writes_stopped,
            DropReason::NegativePartition => &mut self.dropped_negative_partition,
            DropReason::PartitionOutOfRange { .. } => &mut self.dropped_partition_out_of_range,
            DropReason::StaleEpoch { .. } => &mut self.dropped_stale_epoch,
            DropReason::DuplicateCommit => &mut self.dropped_duplicate_commit,
            DropReason::BacklogFull { .. } => &mut self.dropped_backlog_full,
        };
        *counter += 1;
        *counter
    }
}

/// A snapshot of a coordinator's state and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EpochStats {
    /// The driver epoch.
    pub current_epoch: Epoch,
    /// The last committed epoch (start epoch - 1 before the first commit).
    pub last_committed: Epoch,
    /// Reader partition count (0: unset).
    pub reader_partitions: i32,
    /// Writer partition count (0: unset).
    pub writer_partitions: i32,
    /// Whether `StopContinuousExecutionWrites` was processed.
    pub writes_stopped: bool,
    /// The epoch whose commit (or offsets record) failed, or the epoch that was to commit next
    /// when a handler panicked, if any: no epoch commits any more.
    pub failed_epoch: Option<Epoch>,
    /// Offset entries counted by the backlog check.
    pub offset_entries: usize,
    /// Commit entries counted by the backlog check.
    pub commit_entries: usize,
    /// Waiting epochs ([`BacklogQueue::WaitingEpochs`]).
    pub waiting_epochs: usize,
    /// The counters.
    pub counters: EpochCounters,
}

/// Whether a drop or overflow count deserves a warning: the 1st, 2nd, 4th, 8th, ... occurrence,
/// so a flood of bad messages logs O(log n) warnings.
#[inline]
pub(crate) fn worth_a_warning(count: u64) -> bool {
    count.is_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A collaborator's error with a cause, as an engine's might be.
    #[derive(Debug, thiserror::Error)]
    #[error("the metadata store refused the write")]
    struct StoreError(#[source] std::io::Error);

    fn store_error() -> CollaboratorError {
        Box::new(StoreError(std::io::Error::other("connection reset")))
    }

    #[test]
    fn a_copy_keeps_every_variant_and_value_and_the_sources_text() {
        let wal_error = crate::wal::WalError::Closed;
        let errors = [
            EpochError::BacklogExceeded { queue: BacklogQueue::WaitingEpochs, size: 11, limit: 10 },
            EpochError::AddOffsets { epoch: Epoch(3), source: store_error() },
            EpochError::SinkCommit { epoch: Epoch(4), source: store_error() },
            EpochError::QueryCommit { epoch: Epoch(5), source: store_error() },
            EpochError::HandlerPanicked { epoch: Epoch(6), message: "boom".into() },
            EpochError::InvalidPartitionCount { side: PartitionSide::Writer, count: -2 },
            EpochError::CommittedWithoutOffsets { epoch: Epoch(7) },
            EpochError::Wal { op: "append", source: wal_error.clone() },
            EpochError::BadLogRecord { lsn: 9, reason: "short".into() },
            EpochError::EpochOverflow { epoch: Epoch(i64::MAX) },
        ];
        let fail_stops: Vec<bool> = errors.iter().map(EpochError::is_fail_stop).collect();
        assert_eq!(
            fail_stops,
            [false, true, true, true, true, false, false, false, false, false],
            "the collaborators' failures and a panic are fail-stops; nothing else is"
        );
        for error in &errors {
            let copy = error.copy_with_text_sources();
            assert_eq!(copy.stop_text(), error.stop_text(), "{error:?}");
            assert_eq!(std::mem::discriminant(&copy), std::mem::discriminant(error));
        }
        // The collaborator's error survives as text with its cause; the original keeps its type.
        let original = &errors[1];
        let copy = original.copy_with_text_sources();
        assert_eq!(
            copy.stop_text(),
            "recording the offsets of epoch 3 failed: the metadata store refused the write: \
             connection reset"
        );
        let source = |error: &EpochError| match error {
            EpochError::AddOffsets { source, .. } => source.is::<StoreError>(),
            _ => unreachable!("an AddOffsets error"),
        };
        assert!(source(original) && !source(&copy));
        assert!(matches!(
            errors[0].copy_with_text_sources(),
            EpochError::BacklogExceeded { queue: BacklogQueue::WaitingEpochs, size: 11, limit: 10 }
        ));
        assert!(matches!(
            errors[7].copy_with_text_sources(),
            EpochError::Wal { op: "append", source } if source == wal_error
        ));
    }
}
