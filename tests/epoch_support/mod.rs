//! Shared harness of the epoch coordinator tests: recorder fakes of the query and the sink that
//! append every call to one shared, ordered call log (SCENARIOS harness conventions), with
//! optional injected failures.

#![allow(dead_code)]

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use coordbus::{
    coordinators::epoch::{
        coordinator_name, BacklogQueue, CollaboratorError, CommitPartitionEpoch, Epoch,
        EpochConfig, EpochEndpoint, EpochError, EpochStats, GetCurrentEpoch, GetEpochStats,
        Offsets, PartitionId, Payload, Query, ReportPartitionOffset, SetReaderPartitions,
        SetWriterPartitions, Sink,
    },
    Bus, EndpointRef,
};

/// One collaborator call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `query.add_offsets(epoch, offsets)`.
    AddOffsets(i64, Vec<(i32, Payload)>),
    /// `sink.commit(epoch, messages)`.
    SinkCommit(i64, Vec<(i32, Payload)>),
    /// `query.commit(epoch)`.
    QueryCommit(i64),
    /// `query.stop(error)`: the error's message, and its backlog fields if it is an overflow.
    Stop { message: String, backlog: Option<(BacklogQueue, usize, usize)> },
}

/// The shared call log.
pub type CallLog = Arc<Mutex<Vec<Call>>>;

pub fn calls(log: &CallLog) -> Vec<Call> {
    log.lock().unwrap().clone()
}

fn pairs(entries: &[(PartitionId, Payload)]) -> Vec<(i32, Payload)> {
    entries.iter().map(|(partition, payload)| (partition.0, payload.clone())).collect()
}

fn injected(what: &str, epoch: Epoch) -> CollaboratorError {
    format!("injected {what} failure at epoch {epoch}").into()
}

/// Query recorder; fails `add_offsets` / `commit` at the given epochs.
#[derive(Debug, Default, Clone)]
pub struct RecordingQuery {
    pub log: CallLog,
    pub fail_add_offsets_at: HashSet<i64>,
    pub fail_commit_at: HashSet<i64>,
}

impl Query for RecordingQuery {
    fn add_offsets(&mut self, epoch: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError> {
        // The coordinator's word flag is what a read of the entries finds (it is trusted by the
        // durable log's encoder, and release builds do not check it).
        let read = Offsets::new(offsets.as_slice()).are_words();
        assert_eq!(offsets.are_words(), read, "the word flag of epoch {epoch}'s offsets");
        self.log.lock().unwrap().push(Call::AddOffsets(epoch.0, pairs(&offsets)));
        if self.fail_add_offsets_at.contains(&epoch.0) {
            return Err(injected("add_offsets", epoch));
        }
        Ok(())
    }

    fn commit(&mut self, epoch: Epoch) -> Result<(), CollaboratorError> {
        self.log.lock().unwrap().push(Call::QueryCommit(epoch.0));
        if self.fail_commit_at.contains(&epoch.0) {
            return Err(injected("query commit", epoch));
        }
        Ok(())
    }

    fn stop(&mut self, error: EpochError) {
        let backlog = match &error {
            EpochError::BacklogExceeded { queue, size, limit } => Some((*queue, *size, *limit)),
            _ => None,
        };
        self.log.lock().unwrap().push(Call::Stop { message: error.to_string(), backlog });
    }
}

/// Sink recorder; fails `commit` at the given epochs (`fail_at`), or panics there
/// (`panic_at`).
#[derive(Debug, Default, Clone)]
pub struct RecordingSink {
    pub log: CallLog,
    pub fail_at: HashSet<i64>,
    pub panic_at: HashSet<i64>,
}

impl Sink for RecordingSink {
    fn commit(
        &mut self,
        epoch: Epoch,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError> {
        self.log.lock().unwrap().push(Call::SinkCommit(epoch.0, pairs(messages)));
        if self.fail_at.contains(&epoch.0) {
            return Err(injected("sink commit", epoch));
        }
        assert!(!self.panic_at.contains(&epoch.0), "injected: the sink panicked at {epoch}");
        Ok(())
    }
}

/// A query and a sink sharing one fresh log.
pub fn recorders() -> (RecordingQuery, RecordingSink, CallLog) {
    let log = CallLog::default();
    let query = RecordingQuery { log: Arc::clone(&log), ..RecordingQuery::default() };
    let sink = RecordingSink { log: Arc::clone(&log), ..RecordingSink::default() };
    (query, sink, log)
}

/// The "fresh opaque" commit message of `(partition, epoch)` in the scenarios.
pub fn message(partition: i32, epoch: i64) -> Payload {
    Payload::from(format!("commit p{partition} e{epoch}").as_bytes())
}

/// The "fresh opaque" offset of `(partition, epoch)` in the scenarios.
pub fn offset(partition: i32, epoch: i64) -> Payload {
    Payload::from(format!("offset p{partition} e{epoch}").as_bytes())
}

/// Expected `AddOffsets(epoch, ...)` for partitions `0..readers` with [`offset`] payloads.
pub fn add_offsets(epoch: i64, readers: i32) -> Call {
    Call::AddOffsets(epoch, (0..readers).map(|p| (p, offset(p, epoch))).collect())
}

/// Expected `SinkCommit(epoch, ...)` for partitions `0..writers` with [`message`] payloads.
pub fn sink_commit(epoch: i64, writers: i32) -> Call {
    Call::SinkCommit(epoch, (0..writers).map(|p| (p, message(p, epoch))).collect())
}

/// The endpoint type under test.
pub type Coordinator = EpochEndpoint<RecordingQuery, RecordingSink>;

/// How long a test waits for any reply before failing (never reached when things work).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// A bus hosting one epoch coordinator with recorders.
pub struct BusHarness {
    pub bus: Bus,
    pub epoch: EndpointRef<Coordinator>,
    pub log: CallLog,
}

impl BusHarness {
    /// Registers a coordinator with `config` and the given recorders.
    pub fn start(
        config: EpochConfig,
        query: RecordingQuery,
        sink: RecordingSink,
        log: CallLog,
    ) -> Self {
        let bus = Bus::builder().inbox_shards(2).build().unwrap();
        let endpoint = EpochEndpoint::new(config, query, sink).unwrap();
        let epoch = bus.register(coordinator_name("test-run"), endpoint).unwrap();
        Self { bus, epoch, log }
    }

    /// The SCENARIOS common setup: start epoch 1, backlog limit 10, recorders; then
    /// `SetWriterPartitions(writers)` and `SetReaderPartitions(readers)` asked and answered.
    pub fn scenario(writers: i32, readers: i32) -> Self {
        let (query, sink, log) = recorders();
        let harness = Self::start(EpochConfig::new(1).with_backlog_limit(10), query, sink, log);
        harness.set_counts(writers, readers);
        harness
    }

    pub fn set_counts(&self, writers: i32, readers: i32) {
        self.epoch.ask(SetWriterPartitions(writers)).wait_timeout(REPLY_TIMEOUT).unwrap();
        self.epoch.ask(SetReaderPartitions(readers)).wait_timeout(REPLY_TIMEOUT).unwrap();
    }

    /// `commit(p, e)`: one-way `CommitPartitionEpoch` with the fresh message of `(p, e)`.
    pub fn commit(&self, partition: i32, epoch: i64) {
        self.epoch
            .send(CommitPartitionEpoch { partition, epoch, message: message(partition, epoch) })
            .unwrap();
    }

    /// `report(p, e)`: one-way `ReportPartitionOffset` with the fresh offset of `(p, e)`.
    pub fn report(&self, partition: i32, epoch: i64) {
        self.epoch
            .send(ReportPartitionOffset { partition, epoch, offset: offset(partition, epoch) })
            .unwrap();
    }

    /// Barrier: asks `GetCurrentEpoch` from this thread; every earlier send was handled when
    /// it returns (SPEC A.4). Returns the reply.
    pub fn barrier(&self) -> i64 {
        self.epoch.ask(GetCurrentEpoch).wait_timeout(REPLY_TIMEOUT).unwrap()
    }

    pub fn stats(&self) -> EpochStats {
        self.epoch.ask(GetEpochStats).wait_timeout(REPLY_TIMEOUT).unwrap()
    }

    pub fn calls(&self) -> Vec<Call> {
        calls(&self.log)
    }
}

impl Drop for BusHarness {
    fn drop(&mut self) {
        let _ = self.bus.shutdown();
    }
}

/// Checks the warnings of the four bad messages the bad-input tests send, in order (counts of
/// 2 partitions, last committed epoch 0): a report for partition 2 of epoch 1 (out of range),
/// a commit of partition -4 (negative), a commit of epoch 0 (stale), a second commit of
/// partition 1 of epoch 1 (duplicate); each warning names the message and why it was dropped.
pub fn assert_warnings_name_the_four_bad_messages(lines: &[String]) {
    assert_eq!(lines.len(), 4, "one warning per dropped message: {lines:?}");
    for (line, expected) in lines.iter().zip([
        ["partition 2 ", "epoch 1 ", "partition count 2"],
        ["partition -4 ", "epoch 1 ", "negative"],
        ["partition 0 ", "epoch 0 ", "last committed epoch 0"],
        ["partition 1 ", "epoch 1 ", "already committed this epoch"],
    ]) {
        for part in expected {
            assert!(line.contains(part), "{part:?} missing from the warning {line:?}");
        }
    }
}
