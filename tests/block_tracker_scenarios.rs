//! ReceivedBlockTracker acceptance scenarios RBT-01..RBT-06 (SCENARIOS.md section 4), plus the
//! edge cases of SPEC D.3 (threshold in the past, negative record counts) and block data kept
//! in a receiver log.
//!
//! Method: drive the plain state machine with a manual clock, read the journal back by opening
//! its WAL directory after the tracker stopped, and compare events by equality.

mod warning_capture;

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use coordbus::{
    clock::ManualClock,
    coordinators::block_tracker::{
        AllocatedBlocks, BatchAllocationEvent, BatchCleanupEvent, BatchTime, BlockAdditionEvent,
        BlockAdditionsEvent, BlockLog, BlockLogError, BlockStoreResult, BlockTrackerConfig,
        BlockTrackerError, Logged, ReceivedBlockInfo, ReceivedBlockTracker, ReceiverBlockStore,
        StreamBlockId, StreamId, TrackerEvent, WalBlockLog, RECEIVED_BLOCK_METADATA_DIR,
    },
    wal::{
        Durability, DurableCallback, IoMode, IoPath, Lsn, RecordHandle, SegmentId, Wal, WalConfig,
        WalError, WalOptions,
    },
};
use warning_capture::WarningLog;

const STREAM: StreamId = StreamId(1);

/// Fresh block ids from a fixed-seed generator (splitmix64), so runs are repeatable.
struct Blocks(u64);

impl Blocks {
    fn new() -> Self {
        Self(0x5eed_b10c)
    }

    fn next_id(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// `n` fresh infos `{stream 1, numRecords 0, no metadata, block-manager result}`.
    fn take(&mut self, n: usize) -> Vec<ReceivedBlockInfo> {
        (0..n)
            .map(|_| {
                let block_id = StreamBlockId { stream: STREAM, unique_id: self.next_id() };
                ReceivedBlockInfo::new(
                    STREAM,
                    Some(0),
                    None,
                    BlockStoreResult::BlockManager { block_id },
                )
                .unwrap()
            })
            .collect()
    }
}

fn config(checkpoint: Option<&Path>, rolling: Duration) -> BlockTrackerConfig {
    let mut config = BlockTrackerConfig::new([STREAM]);
    config.wal.rolling_interval = Some(rolling);
    // Small segments keep the many opens of these tests cheap (opening scans each segment).
    config.wal.segment_size_bytes = 4 << 20;
    if let Some(dir) = checkpoint {
        config = config.checkpoint_dir(dir);
    }
    config
}

/// [`config`] with `streams` and 64 KiB segments: records small enough that a few blocks with
/// metadata reach the log's largest.
fn small_records_config(checkpoint: &Path, streams: &[StreamId]) -> BlockTrackerConfig {
    let mut config = config(Some(checkpoint), Duration::from_secs(60));
    config.stream_ids = streams.to_vec();
    config.wal.segment_size_bytes = 64 << 10;
    config
}

/// A block in a block manager with `metadata_bytes` of metadata (each byte `unique_id`).
fn with_metadata(
    stream: StreamId,
    unique_id: u64,
    num_records: Option<i64>,
    metadata_bytes: usize,
) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream, unique_id };
    let metadata = Some(vec![unique_id as u8; metadata_bytes]);
    ReceivedBlockInfo::new(
        stream,
        num_records,
        metadata,
        BlockStoreResult::BlockManager { block_id },
    )
    .unwrap()
}

fn wal_dir(checkpoint: &Path) -> PathBuf {
    checkpoint.join(RECEIVED_BLOCK_METADATA_DIR)
}

/// Every event in the journal, in order, with the segment holding it.
fn read_log(checkpoint: &Path, wal_config: &WalConfig) -> Vec<(u32, TrackerEvent)> {
    let wal = Wal::open(wal_dir(checkpoint), wal_config.clone()).unwrap();
    let events = wal
        .iter_from(Lsn::ZERO)
        .unwrap()
        .map(|record| {
            let record = record.unwrap();
            (record.handle.segment.0, TrackerEvent::decode(&record.bytes).unwrap())
        })
        .collect();
    wal.close().unwrap();
    events
}

fn events_only(log: Vec<(u32, TrackerEvent)>) -> Vec<TrackerEvent> {
    log.into_iter().map(|(_, event)| event).collect()
}

/// Segment files in the journal directory, sorted by name (= log order).
fn log_files(checkpoint: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(wal_dir(checkpoint))
        .map(|entries| {
            entries
                .map(|entry| entry.unwrap().path())
                .filter(|path| path.extension().is_some_and(|ext| ext == "wal"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

fn additions(blocks: &[ReceivedBlockInfo]) -> Vec<TrackerEvent> {
    blocks
        .iter()
        .map(|info| TrackerEvent::BlockAddition(BlockAdditionEvent { info: info.clone() }))
        .collect()
}

fn allocation(time: i64, blocks: &[ReceivedBlockInfo]) -> TrackerEvent {
    TrackerEvent::BatchAllocation(BatchAllocationEvent {
        time: BatchTime(time),
        blocks: AllocatedBlocks::new([(STREAM, blocks.to_vec())]),
    })
}

#[test]
fn rbt_01_addition_and_allocation_without_wal() {
    let clock = Arc::new(ManualClock::new(0));
    let mut tracker =
        ReceivedBlockTracker::open(config(None, Duration::from_secs(60)), clock).unwrap();
    assert!(!tracker.is_wal_enabled());
    assert!(tracker.unallocated_blocks(STREAM).is_empty());

    let b = Blocks::new().take(5);
    for info in &b {
        assert!(tracker.add_block(info.clone()));
    }
    assert_eq!(tracker.unallocated_blocks(STREAM), b);
    assert!(tracker.has_unallocated_blocks());

    tracker.allocate_blocks_to_batch(BatchTime(1)).unwrap();
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(1), STREAM), b);
    assert_eq!(tracker.blocks_of_batch(BatchTime(1)), AllocatedBlocks::new([(STREAM, b.clone())]));
    assert!(tracker.unallocated_blocks(STREAM).is_empty());
    assert!(!tracker.has_unallocated_blocks());

    tracker.allocate_blocks_to_batch(BatchTime(2)).unwrap();
    assert!(tracker.blocks_of_batch_and_stream(BatchTime(2), STREAM).is_empty());
    assert_eq!(tracker.blocks_of_batch(BatchTime(2)), AllocatedBlocks::new([(STREAM, vec![])]));

    tracker.allocate_blocks_to_batch(BatchTime(1)).unwrap();
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(1), STREAM), b);

    for info in &b {
        assert!(tracker.add_block(info.clone()));
    }
    tracker.allocate_blocks_to_batch(BatchTime(2)).unwrap();
    assert!(tracker.blocks_of_batch_and_stream(BatchTime(2), STREAM).is_empty());
    assert_eq!(tracker.unallocated_blocks(STREAM), b);
    assert_eq!(tracker.last_allocated_batch_time(), Some(BatchTime(2)));
}

#[test]
fn rbt_02_many_blocks_with_wal() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000));
    let mut config = config(Some(dir.path()), Duration::from_secs(60));
    // Room for 100 000 additions and their allocation in one segment (about 25 MB).
    config.wal.segment_size_bytes = 64 << 20;
    // Each `add_block` waits until its record is written, as Spark's `addBlock` waits for its
    // write to the log (flushed, not synced: a sync per addition would make this test take
    // minutes; the allocation below is synced by `stop`).
    config.wal.durability = Durability::None;
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock).unwrap();
    let blocks = Blocks::new().take(100_000);
    for info in &blocks {
        assert!(tracker.add_block(info.clone()), "addition of {info:?} not logged");
    }
    tracker.allocate_blocks_to_batch(BatchTime(1)).unwrap();

    assert!(tracker.unallocated_blocks(STREAM).is_empty());
    assert!(!tracker.has_unallocated_blocks());
    assert_eq!(
        tracker.blocks_of_batch(BatchTime(1)),
        AllocatedBlocks::new([(STREAM, blocks.clone())])
    );
    tracker.stop().unwrap();

    let mut expected = additions(&blocks);
    expected.push(allocation(1, &blocks));
    assert!(events_only(read_log(dir.path(), &config.wal)) == expected);
    assert_eq!(log_files(dir.path()).len(), 1, "exactly one log file");
}

#[test]
fn rbt_03_recovery_removes_only_the_allocated_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let config = config(Some(dir.path()), Duration::from_secs(60));
    let mut blocks = Blocks::new();
    let (a, u) = (blocks.take(5), blocks.take(5));

    let mut tracker1 = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    for event in additions(&a).into_iter().chain(additions(&u)).chain([allocation(0, &a)]) {
        assert!(tracker1.write_to_log(&event).unwrap());
    }
    tracker1.stop().unwrap();

    let tracker2 = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    assert_eq!(tracker2.blocks_of_batch(BatchTime(0)), AllocatedBlocks::new([(STREAM, a)]));
    assert_eq!(tracker2.unallocated_blocks(STREAM), u);
    assert_eq!(tracker2.recovered_events(), 11);
}

/// The real log, with allocation writes failing on demand: raising (as Spark's test
/// overrides `writeToLog`) or reporting a WAL error; and with its durable LSN read as none
/// on demand (a sync that has not come back yet).
#[derive(Default)]
struct FailingLog {
    inner: Option<WalBlockLog>,
    raise_on_allocation: AtomicBool,
    refuse_allocation: AtomicBool,
    durability_unseen: AtomicBool,
}

impl FailingLog {
    fn open(dir: &Path, wal: &WalConfig) -> Self {
        Self {
            inner: Some(WalBlockLog::open(wal_dir(dir), wal.clone()).unwrap()),
            ..Self::default()
        }
    }

    fn inner(&self) -> &WalBlockLog {
        self.inner.as_ref().expect("opened")
    }
}

impl BlockLog for FailingLog {
    fn append(&self, event: &TrackerEvent, time_ms: i64) -> Result<Lsn, BlockLogError> {
        if matches!(event, TrackerEvent::BatchAllocation(_)) {
            if self.raise_on_allocation.load(Ordering::SeqCst) {
                return Err(BlockLogError::Raised {
                    message: "Not able to write BatchAllocationEvent".into(),
                });
            }
            if self.refuse_allocation.load(Ordering::SeqCst) {
                return Err(BlockLogError::Wal(WalError::Closed));
            }
        }
        self.inner().append(event, time_ms)
    }
    fn wait_durable(&self, lsn: Lsn, timeout: Duration) -> Result<(), WalError> {
        self.inner().wait_durable(lsn, timeout)
    }
    fn durable_lsn(&self) -> Lsn {
        if self.durability_unseen.load(Ordering::SeqCst) {
            return Lsn::ZERO;
        }
        self.inner().durable_lsn()
    }
    fn notify_when_durable(&self, lsn: Lsn, callback: DurableCallback) {
        self.inner().notify_when_durable(lsn, callback);
    }
    fn replay(
        &self,
        last: Option<Lsn>,
        apply: &mut dyn FnMut(Lsn, TrackerEvent),
    ) -> Result<u64, BlockTrackerError> {
        self.inner().replay(last, apply)
    }
    fn clean(&self, threshold_ms: i64, keep_from: Option<Lsn>, wait: bool) -> Result<(), WalError> {
        self.inner().clean(threshold_ms, keep_from, wait)
    }
    fn close(&self) -> Result<(), WalError> {
        self.inner().close()
    }
    fn max_event_bytes(&self) -> Option<usize> {
        self.inner().max_event_bytes()
    }
}

fn assert_nothing_allocated(tracker: &ReceivedBlockTracker, b: &[ReceivedBlockInfo]) {
    assert_eq!(tracker.unallocated_blocks(STREAM), b);
    assert!(tracker.blocks_of_batch(BatchTime(1)).is_empty());
    assert!(tracker.blocks_of_batch_and_stream(BatchTime(1), STREAM).is_empty());
    assert_eq!(tracker.last_allocated_batch_time(), None);
}

#[test]
fn rbt_04_failed_allocation_write_does_not_lose_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000));
    let config = config(Some(dir.path()), Duration::from_secs(60));
    let log = Arc::new(FailingLog::open(dir.path(), &config.wal));
    let mut tracker =
        ReceivedBlockTracker::with_log(config.clone(), clock.clone(), Some(log.clone())).unwrap();
    let b = Blocks::new().take(5);
    for info in &b {
        assert!(tracker.add_block(info.clone()));
    }
    assert_eq!(tracker.unallocated_blocks(STREAM), b);

    // The log step raises: the error reaches the caller, nothing changes.
    log.raise_on_allocation.store(true, Ordering::SeqCst);
    let error = tracker.allocate_blocks_to_batch(BatchTime(1)).unwrap_err();
    assert!(matches!(error, BlockTrackerError::LogRaised { .. }), "{error:?}");
    assert_eq!(error.to_string(), "Not able to write BatchAllocationEvent");
    assert_nothing_allocated(&tracker, &b);
    log.raise_on_allocation.store(false, Ordering::SeqCst);

    // [derived] The WAL write itself fails: writeToLog is false, allocate returns normally.
    log.refuse_allocation.store(true, Ordering::SeqCst);
    let event = TrackerEvent::BatchAllocation(BatchAllocationEvent {
        time: BatchTime(1),
        blocks: AllocatedBlocks::new([(STREAM, b.clone())]),
    });
    assert_eq!(tracker.write_to_log(&event), Ok(false));
    tracker.allocate_blocks_to_batch(BatchTime(1)).unwrap();
    assert_nothing_allocated(&tracker, &b);
    log.refuse_allocation.store(false, Ordering::SeqCst);

    tracker.allocate_blocks_to_batch(BatchTime(2)).unwrap();
    assert!(tracker.unallocated_blocks(STREAM).is_empty());
    assert!(!tracker.has_unallocated_blocks());
    assert_eq!(tracker.blocks_of_batch(BatchTime(2)), AllocatedBlocks::new([(STREAM, b.clone())]));
    tracker.stop().unwrap();
    drop(tracker);
    drop(log);

    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    assert!(recovered.unallocated_blocks(STREAM).is_empty());
    assert_eq!(recovered.blocks_of_batch(BatchTime(2)), AllocatedBlocks::new([(STREAM, b)]));
}

#[test]
fn rbt_04_variant_a_closed_wal_makes_writes_fail_without_changes() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000));
    let mut tracker =
        ReceivedBlockTracker::open(config(Some(dir.path()), Duration::from_secs(60)), clock)
            .unwrap();
    let b = Blocks::new().take(3);
    for info in &b {
        assert!(tracker.add_block(info.clone()));
    }
    tracker.wal().unwrap().close().unwrap();
    let late = Blocks(7).take(1).remove(0);
    assert!(!tracker.add_block(late), "a failed write answers false");
    tracker.allocate_blocks_to_batch(BatchTime(1)).unwrap();
    assert_nothing_allocated(&tracker, &b);
    assert!(tracker.allocated_batch_times().is_empty());
}

#[test]
fn rbt_05_recovery_and_cleanup_over_rotating_logs() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let config = config(Some(dir.path()), Duration::from_secs(1));
    let mut blocks = Blocks::new();

    // 1. T1 adds B1 at t = 0.
    let mut t1 = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    let b1 = blocks.take(5);
    for info in &b1 {
        assert!(t1.add_block(info.clone()));
    }
    assert_eq!(t1.unallocated_blocks(STREAM), b1);
    t1.stop().unwrap();
    drop(t1);
    assert_eq!(events_only(read_log(dir.path(), &config.wal)), additions(&b1));
    assert_eq!(log_files(dir.path()).len(), 1);
    clock.advance_ms(2_000);

    // 2. Without recovery the state starts empty.
    let mut t1b = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    assert!(t1b.unallocated_blocks(STREAM).is_empty());
    assert!(!t1b.has_unallocated_blocks());
    t1b.stop().unwrap();
    drop(t1b);

    // 3. With recovery B1 is back, every block marked invalid.
    let mut t2 = ReceivedBlockTracker::open(config.clone().recover(true), clock.clone()).unwrap();
    let recovered = t2.unallocated_blocks(STREAM);
    assert_eq!(recovered, b1);
    assert!(recovered.iter().all(|info| !info.is_block_id_valid()));

    // 4. Two batches.
    t2.allocate_blocks_to_batch(BatchTime(2_000)).unwrap();
    assert_eq!(t2.blocks_of_batch_and_stream(BatchTime(2_000), STREAM), b1);
    clock.advance_ms(2_000);
    let b2 = blocks.take(5);
    for info in &b2 {
        assert!(t2.add_block(info.clone()));
    }
    t2.allocate_blocks_to_batch(BatchTime(4_000)).unwrap();
    assert_eq!(t2.blocks_of_batch_and_stream(BatchTime(4_000), STREAM), b2);
    t2.stop().unwrap();
    drop(t2);

    // 5. The whole log.
    let mut expected = additions(&b1);
    expected.push(allocation(2_000, &b1));
    expected.extend(additions(&b2));
    expected.push(allocation(4_000, &b2));
    assert_eq!(events_only(read_log(dir.path(), &config.wal)), expected);

    // 6. Recovery rebuilds both batches.
    clock.advance_ms(2_000);
    let mut t3 = ReceivedBlockTracker::open(config.clone().recover(true), clock.clone()).unwrap();
    assert_eq!(t3.blocks_of_batch_and_stream(BatchTime(2_000), STREAM), b1);
    assert_eq!(t3.blocks_of_batch_and_stream(BatchTime(4_000), STREAM), b2);
    assert!(t3.unallocated_blocks(STREAM).is_empty());

    // 7. Cleanup below 4 000 at t = 8 000.
    let files_before = log_files(dir.path());
    let oldest = files_before[0].clone();
    clock.advance_ms(2_000);
    t3.cleanup_old_batches(BatchTime(4_000), true).unwrap();
    assert!(t3.blocks_of_batch_and_stream(BatchTime(2_000), STREAM).is_empty());
    assert!(!oldest.exists(), "the oldest log file is deleted on return (wait = true)");
    t3.stop().unwrap();
    drop(t3);
    let log = read_log(dir.path(), &config.wal);
    let newest_segment = log.iter().map(|(segment, _)| *segment).max().unwrap();
    let cleanup = TrackerEvent::BatchCleanup(BatchCleanupEvent { times: vec![BatchTime(2_000)] });
    assert!(log.iter().any(|(segment, event)| *segment == newest_segment && *event == cleanup));

    // 8. Recovery after the cleanup.
    clock.advance_ms(2_000);
    let t4 = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    assert!(t4.unallocated_blocks(STREAM).is_empty());
    assert!(t4.blocks_of_batch_and_stream(BatchTime(2_000), STREAM).is_empty());
    assert_eq!(t4.blocks_of_batch_and_stream(BatchTime(4_000), STREAM), b2);
}

#[test]
fn rbt_06_wal_disabled_without_checkpoint_dir() {
    let tracker = ReceivedBlockTracker::open(
        BlockTrackerConfig::new([STREAM]),
        Arc::new(ManualClock::new(0)),
    )
    .unwrap();
    assert!(!tracker.is_wal_enabled());
    assert!(tracker.wal().is_none());
}

fn block_of(stream: StreamId, unique_id: u64) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream, unique_id };
    ReceivedBlockInfo::new(stream, Some(0), None, BlockStoreResult::BlockManager { block_id })
        .unwrap()
}

/// SPEC D: blocks of a stream missing from `stream_ids` are accepted and queued but never
/// allocated. The tracker warns once per such stream and lists them, so an operator can see
/// what will never drain.
#[test]
fn blocks_of_an_unconfigured_stream_are_queued_never_allocated_warned_and_listed() {
    let warnings = WarningLog::default();
    let clock = Arc::new(ManualClock::new(0));
    let mut tracker =
        ReceivedBlockTracker::open(config(None, Duration::from_secs(60)), clock).unwrap();
    let (other, another) = (StreamId(7), StreamId(8));
    let stray = block_of(other, 1);
    let configured = Blocks::new().take(2);
    assert!(tracker.unconfigured_streams().is_empty());
    warnings.around(|| {
        assert!(tracker.add_block(stray.clone()));
        assert_eq!(warnings.count(), 1, "the first block of an unconfigured stream warns");
        assert!(tracker.add_block(block_of(other, 2)));
        for info in &configured {
            assert!(tracker.add_block(info.clone()));
        }
        assert_eq!(warnings.count(), 1, "once per stream, and never for a configured one");
        assert!(tracker.add_block(block_of(another, 3)));
        assert_eq!(warnings.count(), 2);
    });
    assert_eq!(tracker.unconfigured_streams(), [other, another]);

    tracker.allocate_blocks_to_batch(BatchTime(1)).unwrap();
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(1), STREAM), configured);
    assert!(tracker.blocks_of_batch_and_stream(BatchTime(1), other).is_empty());
    assert_eq!(tracker.unallocated_blocks(other), [stray, block_of(other, 2)]);
    assert!(tracker.has_unallocated_blocks(), "the stray blocks are still queued");
    assert_eq!(tracker.unconfigured_streams(), [other, another]);
}

/// A log written while a stream was configured, recovered by a tracker without it: blocks the
/// log allocated are gone after the replay and warn about nothing; blocks left unallocated are
/// listed and warned about once, after the replay.
#[test]
fn recovery_warns_only_about_unconfigured_streams_that_keep_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000));
    let (allocated_stream, pending_stream) = (StreamId(7), StreamId(8));
    let mut both = BlockTrackerConfig::new([STREAM, allocated_stream, pending_stream])
        .checkpoint_dir(dir.path());
    both.wal.segment_size_bytes = 4 << 20;
    let mut first = ReceivedBlockTracker::open(both, clock.clone()).unwrap();
    assert!(first.add_block(block_of(allocated_stream, 1)));
    assert!(first.add_block(block_of(pending_stream, 2)));
    first.allocate_blocks_to_batch(BatchTime(1_000)).unwrap();
    assert!(first.add_block(block_of(pending_stream, 3)));
    first.stop().unwrap();
    drop(first);

    let warnings = WarningLog::default();
    let mut recovered = warnings.around(|| {
        let only_stream = config(Some(dir.path()), Duration::from_secs(60)).recover(true);
        ReceivedBlockTracker::open(only_stream, clock).unwrap()
    });
    assert_eq!(recovered.unconfigured_streams(), [pending_stream]);
    assert_eq!(recovered.unallocated_blocks(allocated_stream), []);
    assert_eq!(warnings.count(), 1, "one warning, after the replay, for stream 8 only");
    // The replay left stream 7 an empty queue: its first live block still warns, once.
    warnings.around(|| {
        assert!(recovered.add_block(block_of(allocated_stream, 9)));
        assert!(recovered.add_block(block_of(allocated_stream, 10)));
    });
    assert_eq!(warnings.count(), 2);
    assert_eq!(recovered.unconfigured_streams(), [allocated_stream, pending_stream]);
}

#[test]
fn cleanup_threshold_must_be_in_the_past_and_nothing_is_written_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(5_000));
    let config = config(Some(dir.path()), Duration::from_secs(60));
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    let b = Blocks::new().take(2);
    for info in &b {
        assert!(tracker.add_block(info.clone()));
    }
    tracker.allocate_blocks_to_batch(BatchTime(1_000)).unwrap();
    let error = tracker.cleanup_old_batches(BatchTime(5_000), false).unwrap_err();
    assert_eq!(error, BlockTrackerError::ThresholdNotInPast { threshold_ms: 5_000, now_ms: 5_000 });
    assert!(error.to_string().starts_with("requirement failed"));
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(1_000), STREAM), b);
    // An empty cleanup is still journaled.
    tracker.cleanup_old_batches(BatchTime(500), false).unwrap();
    tracker.stop().unwrap();
    drop(tracker);
    let log = events_only(read_log(dir.path(), &config.wal));
    assert_eq!(log.len(), 4);
    assert_eq!(log[3], TrackerEvent::BatchCleanup(BatchCleanupEvent { times: vec![] }));
}

#[test]
fn negative_record_counts_are_rejected_at_construction() {
    let block_id = StreamBlockId { stream: STREAM, unique_id: 3 };
    let error =
        ReceivedBlockInfo::new(STREAM, Some(-1), None, BlockStoreResult::BlockManager { block_id })
            .unwrap_err();
    assert_eq!(error, BlockTrackerError::NegativeNumRecords { block_id, num_records: -1 });
}

#[test]
fn block_data_in_a_receiver_log_is_read_back_by_handle_after_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000));
    let config = config(Some(dir.path()), Duration::from_secs(60));
    let data_dir = ReceiverBlockStore::dir_for(dir.path(), STREAM);
    let data_config = WalConfig { segment_size_bytes: 4 << 20, ..WalConfig::default() };
    // `store` waits for durability at most its store timeout (30 s): no outside bound needed.
    let store = ReceiverBlockStore::open(&data_dir, data_config.clone()).unwrap();
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    let mut infos = Vec::new();
    for unique_id in 0..20u64 {
        let data = vec![unique_id as u8; 100 + unique_id as usize * 37];
        let block_id = StreamBlockId { stream: STREAM, unique_id };
        let result = store.store(block_id, &data, 1_000).unwrap();
        let info = ReceivedBlockInfo::new(STREAM, Some(1), Some(b"meta".to_vec()), result).unwrap();
        assert!(tracker.add_block(info.clone()));
        infos.push((info, data));
    }
    tracker.stop().unwrap();
    drop(tracker);
    drop(store);

    let store = ReceiverBlockStore::open(&data_dir, data_config).unwrap();
    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    let queued = recovered.unallocated_blocks(STREAM);
    assert_eq!(queued.len(), infos.len());
    for (info, (expected, data)) in queued.iter().zip(&infos) {
        assert_eq!(info, expected);
        assert!(!info.is_block_id_valid());
        assert_eq!(&*store.read(info).unwrap(), data.as_slice());
    }
    let manager_block = Blocks::new().take(1).remove(0);
    assert!(matches!(store.read(&manager_block), Err(BlockTrackerError::NotInReceiverLog { .. })));
}

/// An allocation too large for one log record (64 KiB segments here, blocks with 200 bytes of
/// metadata) takes the oldest blocks that fit; the rest stay queued, the next batches take
/// them in order, and a recovery replays the same allocations. (Taking everything, as SPEC D.3
/// says, failed the same way for every later batch, each larger: allocation stopped for good.)
#[test]
fn an_allocation_too_large_for_one_record_takes_what_fits_and_the_rest_follows() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let mut config = config(Some(dir.path()), Duration::from_secs(60));
    config.wal.segment_size_bytes = 64 << 10;
    let infos: Vec<ReceivedBlockInfo> = (0..1000u64)
        .map(|unique_id| {
            let block_id = StreamBlockId { stream: STREAM, unique_id };
            let metadata = Some(vec![unique_id as u8; 200]);
            ReceivedBlockInfo::new(
                STREAM,
                Some(1),
                metadata,
                BlockStoreResult::BlockManager { block_id },
            )
            .unwrap()
        })
        .collect();
    {
        let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
        for chunk in infos.chunks(100) {
            let event = TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos: chunk.to_vec() });
            assert!(tracker.write_to_log(&event).unwrap());
        }
        tracker.stop().unwrap();
    }
    let mut tracker =
        ReceivedBlockTracker::open(config.clone().recover(true), clock.clone()).unwrap();
    assert_eq!(tracker.unallocated_blocks(STREAM).len(), 1000);
    let mut allocated = Vec::new();
    let mut batches = Vec::new();
    for time in 1..=64 {
        if !tracker.has_unallocated_blocks() {
            break;
        }
        tracker.allocate_blocks_to_batch(BatchTime(time)).unwrap();
        let batch = tracker.blocks_of_batch_and_stream(BatchTime(time), STREAM);
        assert!(!batch.is_empty() && batch.len() < 1000, "batch {time}: {} blocks", batch.len());
        allocated.extend(batch.iter().cloned());
        batches.push((time, batch));
    }
    assert!(batches.len() > 1, "the allocation was split");
    assert_eq!(allocated, infos, "every block once, oldest first");
    tracker.stop().unwrap();

    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    for (time, batch) in batches {
        assert_eq!(recovered.blocks_of_batch_and_stream(BatchTime(time), STREAM), batch);
    }
    assert!(!recovered.has_unallocated_blocks());
}

/// A cleanup keeps the journal files holding additions of blocks still queued: a split
/// allocation leaves blocks queued for later batches, and their addition records are their only
/// trace in the journal until an allocation lists them. Before, the cleanup deleted those files
/// by time alone, and a tracker recovered after it had lost acknowledged blocks.
#[test]
fn a_cleanup_keeps_the_additions_of_blocks_still_queued_after_a_split_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    // 64 KiB segments rolling every second: the additions at time 0 fill segments whose
    // window ends at 1000, all below the cleanup's threshold.
    let mut config = config(Some(dir.path()), Duration::from_secs(1));
    config.wal.segment_size_bytes = 64 << 10;
    let infos: Vec<ReceivedBlockInfo> =
        (0..1000u64).map(|unique_id| with_metadata(STREAM, unique_id, Some(1), 200)).collect();
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    for info in &infos {
        assert!(tracker.add_block(info.clone()));
    }
    let addition_segments = log_files(dir.path()).len();
    assert!(addition_segments > 2, "the additions span {addition_segments} segments");
    clock.set_ms(10_000);
    tracker.allocate_blocks_to_batch(BatchTime(5_000)).unwrap();
    let allocated = tracker.blocks_of_batch_and_stream(BatchTime(5_000), STREAM).len();
    assert!(allocated > 0 && allocated < 1000, "a split allocation took {allocated}");
    // Forgets batch 5000 (its blocks are done) and deletes old files, but not the additions
    // of the blocks still queued.
    tracker.cleanup_old_batches(BatchTime(9_000), true).unwrap();
    let queued = tracker.unallocated_blocks(STREAM);
    assert_eq!(queued, infos[allocated..]);
    tracker.stop().unwrap();
    drop(tracker);

    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    assert_eq!(recovered.unallocated_blocks(STREAM), queued, "acknowledged blocks lost");
    assert!(recovered.allocated_batch_times().is_empty(), "batch 5000 was cleaned");
}

/// The deferred path (the endpoint's): an allocation took blocks from the queue, but its record
/// is not durable yet when a cleanup deletes old files. Their addition records are then still
/// their only durable trace, so the cleanup keeps them. Before, only the queues were looked at,
/// and the files went.
#[test]
fn a_cleanup_keeps_the_additions_of_blocks_whose_allocation_is_not_durable_yet() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let mut config = config(Some(dir.path()), Duration::from_secs(1));
    config.wal.segment_size_bytes = 64 << 10;
    let log = Arc::new(FailingLog::open(dir.path(), &config.wal));
    let mut tracker =
        ReceivedBlockTracker::with_log(config.clone(), clock.clone(), Some(log.clone())).unwrap();
    for unique_id in 0..1000u64 {
        assert!(tracker.add_block(with_metadata(STREAM, unique_id, Some(1), 200)));
    }
    let files = log_files(dir.path());
    assert!(files.len() > 2, "the additions span {} segments", files.len());
    clock.set_ms(10_000);
    log.durability_unseen.store(true, Ordering::SeqCst);
    let mut taken = 0;
    let mut last_allocation = Lsn::ZERO;
    for time in 5_000.. {
        if !tracker.has_unallocated_blocks() {
            break;
        }
        let logged = tracker.allocate_blocks_to_batch_deferred(BatchTime(time)).unwrap();
        let Logged::Pending(lsn) = logged else { panic!("{logged:?}") };
        last_allocation = lsn;
        taken += tracker.blocks_of_batch_and_stream(BatchTime(time), STREAM).len();
    }
    assert_eq!(taken, 1000, "every block taken, no allocation durable as far as cleaning knows");
    tracker.clean_log(BatchTime(9_000), true).unwrap();
    assert!(files.iter().all(|file| file.exists()), "an addition file went before its allocation");

    // Once the allocations are known durable, their records stand for the blocks: the old
    // files may go.
    log.durability_unseen.store(false, Ordering::SeqCst);
    log.wait_durable(last_allocation, Duration::from_secs(20)).unwrap();
    tracker.clean_log(BatchTime(9_000), true).unwrap();
    assert!(!files[0].exists(), "the first addition file is no longer needed");
}

/// Three streams, each with one block whose metadata fills more than half a log record
/// (64 KiB segments, 40 KiB of metadata): no two fit one allocation record, and taking fewer
/// blocks per stream cannot help. Each allocation takes the stream whose oldest block is
/// oldest; the others follow in the next batches, and a recovery replays the same batches.
/// (Before, such an allocation failed as too large every time: allocation stopped for good.)
#[test]
fn single_blocks_too_large_to_share_a_record_are_allocated_one_stream_per_batch() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let streams = [StreamId(3), StreamId(1), StreamId(2)];
    let config = small_records_config(dir.path(), &streams);
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    // Added in the order 3, 1, 2: the batches follow it, not the stream ids.
    let infos: Vec<ReceivedBlockInfo> = streams
        .iter()
        .map(|stream| with_metadata(*stream, stream.0 as u64, Some(1), 40 << 10))
        .collect();
    for info in &infos {
        assert!(tracker.add_block(info.clone()), "one block fits a record");
    }
    for (time, info) in (1..=3).zip(&infos) {
        tracker.allocate_blocks_to_batch(BatchTime(time)).unwrap();
        for stream in streams {
            let batch = tracker.blocks_of_batch_and_stream(BatchTime(time), stream);
            let expected = if stream == info.stream_id() { vec![info.clone()] } else { vec![] };
            assert_eq!(batch, expected, "batch {time}, stream {stream:?}");
        }
    }
    assert!(!tracker.has_unallocated_blocks());
    tracker.stop().unwrap();

    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    for (time, info) in (1..=3).zip(&infos) {
        let batch = recovered.blocks_of_batch_and_stream(BatchTime(time), info.stream_id());
        assert_eq!(batch, vec![info.clone()], "batch {time} after recovery");
    }
    assert!(!recovered.has_unallocated_blocks());
}

/// A block whose addition record fits the log but whose allocation record would not (the
/// allocation lists every configured stream and its time besides the block) is refused when
/// added: `false`, nothing queued. Before, it was acknowledged and then never allocated, and
/// as the oldest block it held up every later allocation. A block at the limit is taken and
/// allocated, with a block of another stream, and both survive a recovery.
#[test]
fn a_block_too_large_to_be_allocated_is_refused_when_added_and_allocation_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let streams = [StreamId(1), StreamId(2), StreamId(3)];
    let config = small_records_config(dir.path(), &streams);
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    let limit = tracker.block_metadata_bytes_max().expect("a WAL limits its records");
    let max_event = tracker.log().unwrap().wal().unwrap().max_payload_len();
    assert!(limit < max_event && limit > max_event - 1024, "limit {limit}, record {max_event}");
    let block = |stream, unique_id, metadata_bytes| {
        with_metadata(stream, unique_id, Some(1), metadata_bytes)
    };
    let encoded_bytes = |event: TrackerEvent| event.encode_into(Default::default()).unwrap().len();
    let allocated_alone_bytes = |info: &ReceivedBlockInfo| {
        let blocks = AllocatedBlocks::new(streams.map(|stream| {
            (stream, if stream == info.stream_id() { vec![info.clone()] } else { vec![] })
        }));
        encoded_bytes(TrackerEvent::BatchAllocation(BatchAllocationEvent {
            time: BatchTime(1),
            blocks,
        }))
    };
    // The smallest metadata that no allocation record can hold: the limit errs on the safe
    // side by at most the padding.
    let unallocatable = (limit + 1..limit + 64)
        .find(|bytes| allocated_alone_bytes(&block(StreamId(3), 3, *bytes)) > max_event)
        .expect("within the padding of the limit");
    let over = block(StreamId(3), 3, unallocatable);
    let addition_bytes =
        encoded_bytes(TrackerEvent::BlockAddition(BlockAdditionEvent { info: over.clone() }));
    assert!(addition_bytes <= max_event, "the log would take its addition: the case that stalled");
    let small = block(StreamId(2), 1, 16);
    let at_limit = block(StreamId(1), 2, limit);
    assert!(allocated_alone_bytes(&at_limit) <= max_event);

    assert!(tracker.add_block(small.clone()));
    assert!(!tracker.add_block(over), "too large to be allocated");
    assert!(!tracker.add_block(block(StreamId(3), 4, limit + 1)), "one byte over the limit");
    assert!(tracker.unallocated_blocks(StreamId(3)).is_empty(), "nothing queued");
    assert!(tracker.add_block(at_limit.clone()), "at the limit");
    let mut time = 0;
    while tracker.has_unallocated_blocks() {
        time += 1;
        assert!(time <= 2, "two blocks take at most two batches");
        tracker.allocate_blocks_to_batch(BatchTime(time)).unwrap();
    }
    let allocated = |tracker: &ReceivedBlockTracker| {
        (1..=time)
            .flat_map(|time| {
                streams.map(|stream| tracker.blocks_of_batch_and_stream(BatchTime(time), stream))
            })
            .flatten()
            .collect::<Vec<_>>()
    };
    let mut expected = vec![small.clone(), at_limit.clone()];
    expected.sort_by_key(|info| info.block_id().unique_id);
    let mut got = allocated(&tracker);
    got.sort_by_key(|info| info.block_id().unique_id);
    assert_eq!(got, expected);
    tracker.stop().unwrap();

    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    let mut got = allocated(&recovered);
    got.sort_by_key(|info| info.block_id().unique_id);
    assert_eq!(got, expected, "after recovery");
    assert!(!recovered.has_unallocated_blocks());
}

/// A log whose records cannot hold an allocation of one block (too many streams for its
/// segments) is refused when the tracker opens, with a typed error naming the stream count and
/// both sizes, rather than taking blocks it could never allocate. With a few streams the same
/// log opens.
#[test]
fn a_log_too_small_for_an_allocation_of_the_configured_streams_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let mut config = config(Some(dir.path()), Duration::from_secs(60));
    config.wal.segment_size_bytes = 4096;
    config.stream_ids = (0..1000).map(StreamId).collect();
    match ReceivedBlockTracker::open(config.clone(), clock.clone()) {
        Err(BlockTrackerError::StreamsExceedLog { streams, allocation_bytes, max_event_bytes }) => {
            assert_eq!(streams, 1000);
            assert!(allocation_bytes > max_event_bytes, "{allocation_bytes} > {max_event_bytes}");
            assert!(max_event_bytes < 4096, "the segment bounds a record: {max_event_bytes}");
        }
        other => panic!("expected StreamsExceedLog, got {other:?}"),
    }
    config.stream_ids = (0..3).map(StreamId).collect();
    let tracker = ReceivedBlockTracker::open(config, clock).unwrap();
    assert!(tracker.block_metadata_bytes_max().is_some_and(|max| max > 0 && max < 4096));
}

/// A block logged under one configuration and reopened under one whose allocation records
/// cannot hold it (here: many more streams) fails the recovery with a typed error naming the
/// block and both lengths, instead of stalling every later allocation behind it, whether it
/// was logged alone or in a record of several additions (a receiver's). Its stream left
/// unconfigured, the same log opens (such blocks are never allocated). Nothing is changed:
/// reopened as it was logged, the block is recovered and allocated.
#[test]
fn recovering_a_block_too_large_for_the_reopened_configuration_is_a_typed_error() {
    for in_a_record_of_several in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(0));
        let streams = [StreamId(1), StreamId(2), StreamId(3)];
        let config = small_records_config(dir.path(), &streams);
        let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
        let limit = tracker.block_metadata_bytes_max().unwrap();
        let block = |unique_id, metadata_bytes| {
            with_metadata(StreamId(2), unique_id, Some(1), metadata_bytes)
        };
        let large = block(7, limit);
        let mut logged = vec![large.clone()];
        if in_a_record_of_several {
            logged.insert(0, block(6, 8));
            let event = TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos: logged.clone() });
            assert!(tracker.write_to_log(&event).unwrap());
        } else {
            assert!(tracker.add_block(large.clone()));
        }
        tracker.stop().unwrap();

        let mut more_streams = config.clone().recover(true);
        more_streams.stream_ids = (0..400).map(StreamId).collect();
        match ReceivedBlockTracker::open(more_streams.clone(), clock.clone()) {
            Err(BlockTrackerError::UnallocatableBlock {
                block_id,
                metadata_bytes,
                metadata_bytes_max,
            }) => {
                assert_eq!(block_id, large.block_id());
                assert_eq!(metadata_bytes, limit);
                assert!(metadata_bytes_max < limit, "{metadata_bytes_max} < {limit}");
            }
            other => panic!("expected UnallocatableBlock, got {other:?}"),
        }
        more_streams.stream_ids.retain(|stream| *stream != StreamId(2));
        let mut unconfigured = ReceivedBlockTracker::open(more_streams, clock.clone()).unwrap();
        assert_eq!(unconfigured.unconfigured_streams(), [StreamId(2)]);
        unconfigured.stop().unwrap();

        let mut tracker = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
        assert_eq!(tracker.unallocated_blocks(StreamId(2)), logged);
        // The large block fills an allocation record alone: one batch per block.
        for (time, block) in (1..).zip(&logged) {
            tracker.allocate_blocks_to_batch(BatchTime(time)).unwrap();
            let batch = tracker.blocks_of_batch_and_stream(BatchTime(time), StreamId(2));
            assert_eq!(batch, std::slice::from_ref(block));
        }
        assert!(!tracker.has_unallocated_blocks());
    }
}

/// The limit holds, with at least 8 bytes to spare, for blocks whose every field codes as long
/// as it can (the journal codes ids and counts as varints: a block with a large unique id,
/// count and stream id is the largest of its metadata length), at every metadata length up to
/// the limit (the padding after the metadata depends on its length modulo 8), and for extreme
/// configured streams.
#[test]
fn a_block_at_the_limit_fits_an_allocation_alone_whatever_its_other_fields() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let streams = [StreamId(i32::MIN), StreamId(0), StreamId(i32::MAX)];
    let config = small_records_config(dir.path(), &streams);
    let tracker = ReceivedBlockTracker::open(config, clock).unwrap();
    let limit = tracker.block_metadata_bytes_max().unwrap();
    let max_event = tracker.log().unwrap().wal().unwrap().max_payload_len();
    let handle = RecordHandle { segment: SegmentId(u32::MAX), offset: u64::MAX, len: u32::MAX };
    for stream in streams {
        for unique_id in [0, 1 << 63, u64::MAX] {
            for metadata_bytes in limit - 16..=limit {
                let block_id = StreamBlockId { stream: StreamId(stream.0 ^ 1), unique_id };
                let store_result = BlockStoreResult::ReceiverWal { block_id, handle };
                let metadata = Some(vec![0xff; metadata_bytes]);
                let info =
                    ReceivedBlockInfo::new(stream, Some(i64::MAX), metadata, store_result).unwrap();
                let blocks = AllocatedBlocks::new(streams.map(|other| {
                    (other, if other == stream { vec![info.clone()] } else { vec![] })
                }));
                let event = TrackerEvent::BatchAllocation(BatchAllocationEvent {
                    time: BatchTime(i64::MIN),
                    blocks,
                });
                let bytes = event.encode_into(Default::default()).unwrap().len();
                // With room to spare: a limit exact for the worst block (no margin) fails.
                assert!(
                    bytes + 8 <= max_event,
                    "stream {stream:?}, id {unique_id}, metadata {metadata_bytes}: {bytes} bytes \
                     + 8 > {max_event}"
                );
            }
        }
    }
}

/// `write_to_log` (Spark's `writeToLog`, for a caller that logs additions itself and then
/// applies them) refuses an addition of a block too large to be allocated, alone or among
/// others, without writing it; a block at the limit is written.
#[test]
fn write_to_log_refuses_additions_of_blocks_too_large_to_be_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let config = small_records_config(dir.path(), &[STREAM]);
    let tracker = ReceivedBlockTracker::open(config, clock).unwrap();
    let limit = tracker.block_metadata_bytes_max().unwrap();
    let wal = Arc::clone(tracker.log().unwrap().wal().unwrap());
    let with_metadata =
        |unique_id, metadata_bytes| with_metadata(STREAM, unique_id, None, metadata_bytes);
    let appended_before = wal.appended_lsn();
    let alone =
        TrackerEvent::BlockAddition(BlockAdditionEvent { info: with_metadata(1, limit + 1) });
    assert!(!tracker.write_to_log(&alone).unwrap());
    let among_others = TrackerEvent::BlockAdditions(BlockAdditionsEvent {
        infos: vec![with_metadata(2, 8), with_metadata(3, limit + 1)],
    });
    assert!(!tracker.write_to_log(&among_others).unwrap());
    assert_eq!(wal.appended_lsn(), appended_before, "nothing written");
    let at_limit =
        TrackerEvent::BlockAddition(BlockAdditionEvent { info: with_metadata(4, limit) });
    assert!(tracker.write_to_log(&at_limit).unwrap());
    assert!(wal.appended_lsn() > appended_before);
}

/// When a large block keeps an allocation from taking a block of every stream, the streams
/// with the oldest blocks are taken with all their blocks, not one block each: older small
/// blocks behind a large one of another stream are allocated a stream per batch, not a block
/// per batch (which, with thousands of them, stalled allocation).
#[test]
fn small_blocks_beside_a_large_one_are_allocated_a_whole_stream_per_batch() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let streams = [StreamId(1), StreamId(2), StreamId(3)];
    let config = small_records_config(dir.path(), &streams);
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    let limit = tracker.block_metadata_bytes_max().unwrap();
    let block = |stream, unique_id, metadata_bytes| {
        with_metadata(stream, unique_id, Some(1), metadata_bytes)
    };
    let mut unique_id = 0;
    let mut small = |stream: StreamId| {
        unique_id += 1;
        block(stream, unique_id, 64)
    };
    let stream2: Vec<_> = (0..40).map(|_| small(StreamId(2))).collect();
    let stream3: Vec<_> = (0..40).map(|_| small(StreamId(3))).collect();
    for info in stream2.iter().chain(&stream3) {
        assert!(tracker.add_block(info.clone()));
    }
    let large = block(StreamId(1), 1000, limit);
    assert!(tracker.add_block(large.clone()));

    for time in 1..=3 {
        tracker.allocate_blocks_to_batch(BatchTime(time)).unwrap();
    }
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(1), StreamId(2)), stream2);
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(2), StreamId(3)), stream3);
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(3), StreamId(1)), [large]);
    assert!(!tracker.has_unallocated_blocks());
}

/// A tracker opened without recovery starts empty, and its rebuild after a WAL failure (the
/// durable prefix of the log) does too: what earlier runs logged, which it never had, stays
/// out. (Before, the rebuild replayed the whole log: an earlier run's blocks reappeared.)
#[test]
fn a_rebuild_of_a_tracker_opened_without_recovery_skips_earlier_runs() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let config = config(Some(dir.path()), Duration::from_secs(60));
    let mut blocks = Blocks::new();
    let (earlier, later) = (blocks.take(3), blocks.take(2));
    {
        let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
        for info in &earlier {
            assert!(tracker.add_block(info.clone()));
        }
        tracker.stop().unwrap();
    }
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    assert!(!tracker.has_unallocated_blocks(), "opened without recovery");
    for info in &later {
        assert!(tracker.add_block(info.clone()));
    }
    tracker.rebuild_from_log().unwrap();
    assert_eq!(tracker.unallocated_blocks(STREAM), later, "only this run's blocks");
    tracker.stop().unwrap();
    // A recovering tracker still has both runs' blocks.
    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    assert_eq!(recovered.unallocated_blocks(STREAM).len(), earlier.len() + later.len());
}

/// The tracker's own log is opened with the configured WAL options (here the `pwrite` path,
/// no spare segments); options the WAL refuses, and a read-only log (the tracker writes),
/// fail the open with the WAL's typed error.
#[test]
fn the_tracker_opens_its_log_with_the_configured_wal_options() {
    let dir = tempfile::tempdir().unwrap();
    let open = |options: WalOptions| {
        ReceivedBlockTracker::open(
            config(Some(dir.path()), Duration::from_secs(60)).wal_options(options),
            Arc::new(ManualClock::new(1_000)),
        )
    };
    let options = WalOptions { io: IoMode::Pwrite, spare_segments: 0, ..WalOptions::default() };
    let tracker = open(options).unwrap();
    let wal = tracker.log().and_then(|log| log.wal()).expect("the tracker's own WAL");
    assert_eq!(wal.io_path(), IoPath::Pwrite);
    drop(tracker);

    let refused = [
        (WalOptions { sync_thread_nice: 40, ..WalOptions::default() }, ("sync_thread_nice", "40")),
        (WalOptions { read_only: true, ..WalOptions::default() }, ("read_only", "true")),
    ];
    for (options, expected) in refused {
        match open(options) {
            Err(BlockTrackerError::Wal(WalError::InvalidConfig { setting, value, .. })) => {
                assert_eq!((setting, value.as_str()), expected);
            }
            other => panic!("expected {expected:?} refused, got {:?}", other.map(drop)),
        }
    }
    // A zero write timeout: every synchronous write would answer false before its sync.
    let zero = config(Some(dir.path()), Duration::from_secs(60)).write_timeout(Duration::ZERO);
    match ReceivedBlockTracker::open(zero, Arc::new(ManualClock::new(1_000))) {
        Err(BlockTrackerError::Wal(WalError::InvalidConfig { setting, value, .. })) => {
            assert_eq!((setting, value.as_str()), ("write_timeout", "0ns"));
        }
        other => panic!("expected a zero write_timeout refused, got {:?}", other.map(drop)),
    }
    // The same over an explicit log.
    let zero = config(None, Duration::from_secs(60)).write_timeout(Duration::ZERO);
    let log = WalBlockLog::open(dir.path().join("explicit"), WalConfig::default()).unwrap();
    match ReceivedBlockTracker::with_log(
        zero,
        Arc::new(ManualClock::new(1_000)),
        Some(Arc::new(log)),
    ) {
        Err(BlockTrackerError::Wal(WalError::InvalidConfig { setting, value, .. })) => {
            assert_eq!((setting, value.as_str()), ("write_timeout", "0ns"));
        }
        other => panic!("expected a zero write_timeout refused, got {:?}", other.map(drop)),
    }
}
