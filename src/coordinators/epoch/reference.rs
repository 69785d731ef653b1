//! The reference model: a deliberately simple epoch coordinator written straight from SPEC B
//! with the decisions of SPEC 0.3 (and the module-level decisions of [`super`]).
//!
//! It keeps Spark's data structures, two maps keyed by `(epoch, partition)` and a set of waiting
//! epochs, and rescans the maps on every message, exactly like Spark's `EpochCoordinator`: to
//! count an epoch's entries, to collect them, and to clean up. That makes it easy to check
//! against the spec line by line, and slow (O(pending entries) per message, O(P^2) per epoch at
//! P partitions).
//!
//! Uses: the oracle of the property test (`tests/epoch_model.rs` drives it and
//! [`EpochCoordinator`](super::EpochCoordinator) with the same messages and compares every
//! collaborator call), and the baseline of the `epoch` benchmark and of
//! `coordbus-load epoch --baseline reference`. Not for production use.

use std::collections::{HashMap, HashSet};

use super::{
    worth_a_warning, BacklogQueue, DropReason, Epoch, EpochConfig, EpochCounters, EpochError,
    EpochMessage, EpochStats, MessageKind, Offsets, PartitionId, PartitionSide, Payload, Query,
    Rejected, Sink,
};
use crate::error::ConfigError;

/// The reference epoch coordinator. Same methods and observable behaviour as
/// [`EpochCoordinator`](super::EpochCoordinator); Spark's structures and costs.
#[derive(Debug)]
pub struct ReferenceEpochCoordinator<Q, S> {
    config: EpochConfig,
    query: Q,
    sink: S,
    current_driver_epoch: i64,
    last_committed_epoch: i64,
    num_reader_partitions: i32,
    num_writer_partitions: i32,
    partition_commits: HashMap<(i64, i32), Payload>,
    partition_offsets: HashMap<(i64, i32), Payload>,
    epochs_waiting_to_be_committed: HashSet<i64>,
    /// Epochs whose offsets were passed to `add_offsets` (the parent module's decision: an
    /// epoch that commits without one gets it just before its sink commit).
    epochs_with_offsets_added: HashSet<i64>,
    query_writes_stopped: bool,
    failed_epoch: Option<i64>,
    counters: EpochCounters,
}

impl<Q: Query, S: Sink> ReferenceEpochCoordinator<Q, S> {
    /// A reference coordinator at `config.start_epoch`.
    ///
    /// # Errors
    /// [`ConfigError`] if `config` is invalid.
    pub fn new(config: EpochConfig, mut query: Q, sink: S) -> Result<Self, ConfigError> {
        config.validate()?;
        query.begin_run();
        Ok(Self {
            current_driver_epoch: config.start_epoch.0,
            last_committed_epoch: config.start_epoch.0 - 1,
            config,
            query,
            sink,
            num_reader_partitions: 0,
            num_writer_partitions: 0,
            partition_commits: HashMap::new(),
            partition_offsets: HashMap::new(),
            epochs_waiting_to_be_committed: HashSet::new(),
            epochs_with_offsets_added: HashSet::new(),
            query_writes_stopped: false,
            failed_epoch: None,
            counters: EpochCounters::default(),
        })
    }

    /// Handles one one-way message.
    ///
    /// # Errors
    /// [`Rejected`] when the message was dropped.
    pub fn apply(&mut self, message: EpochMessage) -> Result<(), Rejected> {
        match message {
            EpochMessage::CommitPartitionEpoch { partition, epoch, message } => {
                self.commit_partition_epoch(PartitionId(partition), Epoch(epoch), message)
            }
            EpochMessage::ReportPartitionOffset { partition, epoch, offset } => {
                self.report_partition_offset(PartitionId(partition), Epoch(epoch), offset)
            }
        }
    }

    /// `CommitPartitionEpoch` (SPEC B.4).
    ///
    /// # Errors
    /// [`Rejected`] when dropped.
    pub fn commit_partition_epoch(
        &mut self,
        partition: PartitionId,
        epoch: Epoch,
        message: Payload,
    ) -> Result<(), Rejected> {
        let kind = MessageKind::CommitPartitionEpoch;
        self.admit(kind, partition, epoch, self.num_writer_partitions)?;
        let key = (epoch.0, partition.0);
        if self.partition_commits.contains_key(&key) {
            return Err(self.reject(kind, partition, epoch, DropReason::DuplicateCommit));
        }
        self.partition_commits.insert(key, message);
        self.counters.commits_accepted += 1;
        self.resolve_commits_at_epoch(epoch.0);
        self.check_processing_queue_boundaries();
        Ok(())
    }

    /// `ReportPartitionOffset` (SPEC B.4).
    ///
    /// # Errors
    /// [`Rejected`] when dropped.
    pub fn report_partition_offset(
        &mut self,
        partition: PartitionId,
        epoch: Epoch,
        offset: Payload,
    ) -> Result<(), Rejected> {
        let kind = MessageKind::ReportPartitionOffset;
        self.admit(kind, partition, epoch, self.num_reader_partitions)?;
        if self.partition_offsets.insert((epoch.0, partition.0), offset).is_some() {
            self.counters.offsets_overwritten += 1;
        } else {
            self.counters.offsets_accepted += 1;
        }
        let this_epoch_offsets = Self::entries_of(&self.partition_offsets, epoch.0);
        if this_epoch_offsets.len() as i64 == i64::from(self.num_reader_partitions) {
            self.counters.offsets_added += 1;
            self.epochs_with_offsets_added.insert(epoch.0);
            if let Err(source) = self.query.add_offsets(epoch, Offsets::new(&this_epoch_offsets)) {
                self.fail(EpochError::AddOffsets { epoch, source }, epoch.0);
            }
            self.resolve_commits_at_epoch(epoch.0);
        }
        self.check_processing_queue_boundaries();
        Ok(())
    }

    /// `GetCurrentEpoch`.
    pub fn get_current_epoch(&self) -> Epoch {
        Epoch(self.current_driver_epoch)
    }

    /// `IncrementAndGetEpoch`.
    ///
    /// # Errors
    /// [`EpochError::EpochOverflow`] at `i64::MAX`.
    pub fn increment_and_get_epoch(&mut self) -> Result<Epoch, EpochError> {
        self.current_driver_epoch = self
            .current_driver_epoch
            .checked_add(1)
            .ok_or(EpochError::EpochOverflow { epoch: Epoch(self.current_driver_epoch) })?;
        Ok(Epoch(self.current_driver_epoch))
    }

    /// `SetReaderPartitions`.
    ///
    /// # Errors
    /// [`EpochError::InvalidPartitionCount`] for a negative count.
    pub fn set_reader_partitions(&mut self, count: i32) -> Result<(), EpochError> {
        if count < 0 {
            self.counters.rejected_partition_counts += 1;
            return Err(EpochError::InvalidPartitionCount { side: PartitionSide::Reader, count });
        }
        self.num_reader_partitions = count;
        self.drop_out_of_range(PartitionSide::Reader, count);
        self.resume_passed_epoch();
        Ok(())
    }

    /// `SetWriterPartitions`.
    ///
    /// # Errors
    /// [`EpochError::InvalidPartitionCount`] for a negative count.
    pub fn set_writer_partitions(&mut self, count: i32) -> Result<(), EpochError> {
        if count < 0 {
            self.counters.rejected_partition_counts += 1;
            return Err(EpochError::InvalidPartitionCount { side: PartitionSide::Writer, count });
        }
        self.num_writer_partitions = count;
        self.drop_out_of_range(PartitionSide::Writer, count);
        self.resume_passed_epoch();
        Ok(())
    }

    /// SPEC 0.3 once a count is set: entries of epochs after the last committed one whose
    /// partition id is not below it are dropped and counted as out of range.
    fn drop_out_of_range(&mut self, side: PartitionSide, count: i32) {
        if count == 0 {
            return;
        }
        let last = self.last_committed_epoch;
        let map = match side {
            PartitionSide::Reader => &mut self.partition_offsets,
            PartitionSide::Writer => &mut self.partition_commits,
        };
        let before = map.len();
        map.retain(|(epoch, partition), _| *epoch <= last || *partition < count);
        self.counters.dropped_partition_out_of_range += (before - map.len()) as u64;
    }

    /// After a count change: the next epoch to commit, if it waits (the chain passed it while
    /// it was not ready) and is ready now, is resolved, unless writes were stopped.
    fn resume_passed_epoch(&mut self) {
        let Some(next) = self.last_committed_epoch.checked_add(1) else { return };
        if self.failed_epoch.is_none()
            && !self.query_writes_stopped
            && self.epochs_waiting_to_be_committed.contains(&next)
            && self.is_ready(next)
        {
            self.resolve_commits_at_epoch(next);
        }
    }

    /// Whether `epoch` has as many commits and offsets as the (set) partition counts.
    fn is_ready(&self, epoch: i64) -> bool {
        self.num_writer_partitions > 0
            && self.num_reader_partitions > 0
            && Self::entries_of(&self.partition_commits, epoch).len() as i64
                == i64::from(self.num_writer_partitions)
            && Self::entries_of(&self.partition_offsets, epoch).len() as i64
                == i64::from(self.num_reader_partitions)
    }

    /// `StopContinuousExecutionWrites`.
    pub fn stop_writes(&mut self) {
        self.query_writes_stopped = true;
    }

    /// The last committed epoch.
    pub fn last_committed(&self) -> Epoch {
        Epoch(self.last_committed_epoch)
    }

    /// The counters.
    pub fn counters(&self) -> EpochCounters {
        self.counters
    }

    /// A snapshot of state and counters (same meaning as the fast coordinator's).
    pub fn stats(&self) -> EpochStats {
        EpochStats {
            current_epoch: Epoch(self.current_driver_epoch),
            last_committed: Epoch(self.last_committed_epoch),
            reader_partitions: self.num_reader_partitions,
            writer_partitions: self.num_writer_partitions,
            writes_stopped: self.query_writes_stopped,
            failed_epoch: self.failed_epoch.map(Epoch),
            offset_entries: self.partition_offsets.len(),
            commit_entries: self.partition_commits.len(),
            waiting_epochs: self.epochs_waiting_to_be_committed.len(),
            counters: self.counters,
        }
    }

    /// The query collaborator.
    pub fn query(&self) -> &Q {
        &self.query
    }

    /// The sink collaborator.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Ends the coordinator, returning its collaborators.
    pub fn into_parts(self) -> (Q, S) {
        (self.query, self.sink)
    }

    fn admit(
        &mut self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        partition_count: i32,
    ) -> Result<(), Rejected> {
        let reason = if self.query_writes_stopped {
            DropReason::WritesStopped
        } else if partition.0 < 0 {
            DropReason::NegativePartition
        } else if partition_count > 0 && partition.0 >= partition_count {
            DropReason::PartitionOutOfRange { count: partition_count }
        } else if epoch.0 <= self.last_committed_epoch {
            DropReason::StaleEpoch { last_committed: Epoch(self.last_committed_epoch) }
        } else if let Some((queue, limit)) =
            self.backlog_full(kind, partition, epoch, partition_count)
        {
            DropReason::BacklogFull { queue, limit }
        } else {
            return Ok(());
        };
        let rejected = self.reject(kind, partition, epoch, reason);
        if let DropReason::BacklogFull { .. } = reason {
            self.check_processing_queue_boundaries();
        }
        Err(rejected)
    }

    /// A map over its limit takes no new `(epoch, partition)` entry, except for the next epoch
    /// to commit while the side's partition count is set and at most the limit (the memory
    /// bound of the module doc of [`super`]).
    fn backlog_full(
        &self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        partition_count: i32,
    ) -> Option<(BacklogQueue, usize)> {
        let (queue, map, limit) = match kind {
            MessageKind::CommitPartitionEpoch => (
                BacklogQueue::PartitionCommits,
                &self.partition_commits,
                self.config.partition_commit_limit,
            ),
            MessageKind::ReportPartitionOffset => (
                BacklogQueue::PartitionOffsets,
                &self.partition_offsets,
                self.config.partition_offset_limit,
            ),
        };
        let next_to_commit = self.last_committed_epoch.checked_add(1) == Some(epoch.0)
            && partition_count > 0
            && partition_count as usize <= limit;
        let new_entry = !map.contains_key(&(epoch.0, partition.0));
        (map.len() > limit && new_entry && !next_to_commit).then_some((queue, limit))
    }

    fn reject(
        &mut self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        reason: DropReason,
    ) -> Rejected {
        let count = self.counters.count_drop(reason);
        let rejected = Rejected { kind, partition, epoch, reason };
        if reason != DropReason::WritesStopped && worth_a_warning(count) {
            tracing::warn!(%rejected, "reference model: message dropped");
        }
        rejected
    }

    /// All entries of `epoch`, sorted by partition: a full scan, as Spark does.
    fn entries_of(map: &HashMap<(i64, i32), Payload>, epoch: i64) -> Vec<(PartitionId, Payload)> {
        let mut entries: Vec<(PartitionId, Payload)> = map
            .iter()
            .filter(|((entry_epoch, _), _)| *entry_epoch == epoch)
            .map(|((_, partition), payload)| (PartitionId(*partition), payload.clone()))
            .collect();
        entries.sort_by_key(|(partition, _)| *partition);
        entries
    }

    /// SPEC B.5 resolve(e), with the decisions of the parent module (no resolve below the last
    /// committed epoch is possible, since such messages are dropped; fail-stop).
    fn resolve_commits_at_epoch(&mut self, epoch: i64) {
        // SPEC 0.3: while either partition count is unset (0), no epoch can complete (B.5 read
        // literally would let an epoch with no offsets complete when the reader count is 0).
        if self.num_writer_partitions == 0 || self.num_reader_partitions == 0 {
            return;
        }
        let this_epoch_commits = Self::entries_of(&self.partition_commits, epoch);
        let next_epoch_offsets = Self::entries_of(&self.partition_offsets, epoch);
        if this_epoch_commits.len() as i64 != i64::from(self.num_writer_partitions)
            || next_epoch_offsets.len() as i64 != i64::from(self.num_reader_partitions)
        {
            return;
        }
        if self.failed_epoch.is_some() || self.last_committed_epoch != epoch - 1 {
            self.epochs_waiting_to_be_committed.insert(epoch);
            return;
        }
        if let Err(error) = self.commit_epoch(epoch, &this_epoch_commits) {
            self.epochs_waiting_to_be_committed.insert(epoch);
            self.fail(error, epoch);
            return;
        }
        // It may have waited, skipped by the chain while a count change left it not ready.
        self.epochs_waiting_to_be_committed.remove(&epoch);
        self.last_committed_epoch = epoch;
        while let Some(next_epoch) = self.last_committed_epoch.checked_add(1) {
            // Issue 4: an epoch commits when every partition is in; one that waited and is no
            // longer ready (a count changed since) waits for its next message instead of
            // committing with a partition missing, as Spark's would.
            if !self.epochs_waiting_to_be_committed.contains(&next_epoch)
                || !self.is_ready(next_epoch)
            {
                break;
            }
            let next_epoch_commits = Self::entries_of(&self.partition_commits, next_epoch);
            if let Err(error) = self.commit_epoch(next_epoch, &next_epoch_commits) {
                self.fail(error, next_epoch);
                break;
            }
            self.epochs_waiting_to_be_committed.remove(&next_epoch);
            self.last_committed_epoch = next_epoch;
        }
        let last = self.last_committed_epoch;
        self.partition_commits.retain(|(entry_epoch, _), _| *entry_epoch >= last);
        self.partition_offsets.retain(|(entry_epoch, _), _| *entry_epoch >= last);
        self.epochs_with_offsets_added.retain(|entry_epoch| *entry_epoch > last);
    }

    fn commit_epoch(
        &mut self,
        epoch: i64,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), EpochError> {
        if self.epochs_with_offsets_added.insert(epoch) {
            let offsets = Self::entries_of(&self.partition_offsets, epoch);
            self.counters.offsets_added += 1;
            self.counters.offsets_added_at_commit += 1;
            self.query
                .add_offsets(Epoch(epoch), Offsets::new(&offsets))
                .map_err(|source| EpochError::AddOffsets { epoch: Epoch(epoch), source })?;
        }
        let epoch = Epoch(epoch);
        self.sink
            .commit(epoch, messages)
            .map_err(|source| EpochError::SinkCommit { epoch, source })?;
        self.query.commit(epoch).map_err(|source| EpochError::QueryCommit { epoch, source })?;
        self.counters.epochs_committed += 1;
        Ok(())
    }

    fn fail(&mut self, error: EpochError, epoch: i64) {
        if self.failed_epoch.is_none() {
            self.failed_epoch = Some(epoch);
        }
        self.query.stop(error);
    }

    /// SPEC B.7, verbatim.
    fn check_processing_queue_boundaries(&mut self) {
        let checks = [
            (
                BacklogQueue::PartitionOffsets,
                self.partition_offsets.len(),
                self.config.partition_offset_limit,
            ),
            (
                BacklogQueue::PartitionCommits,
                self.partition_commits.len(),
                self.config.partition_commit_limit,
            ),
            (
                BacklogQueue::WaitingEpochs,
                self.epochs_waiting_to_be_committed.len(),
                self.config.waiting_epoch_limit,
            ),
        ];
        for (queue, size, limit) in checks {
            if size > limit {
                self.counters.backlog_overflows += 1;
                self.query.stop(EpochError::BacklogExceeded { queue, size, limit });
            }
        }
    }
}
