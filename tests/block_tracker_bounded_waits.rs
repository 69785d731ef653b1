//! The block tracker's waits on a disk that stopped answering are bounded.
//!
//! A receiver's `ReceiverBlockStore::store` waits at most its store timeout (Spark's
//! `blockStoreTimeout`), for room to stage the data and then for durability: a sync that does
//! not finish fails the store with a typed timeout naming the LSN and the bound, and a full
//! staging buffer fails it with a typed error, instead of hanging the receiver; once the sync
//! finishes, the data is durable and readable. The tracker's journal (`WalBlockLog`) waits at
//! most its append timeout for room, then refuses the event (nothing logged).
//!
//! Method: a storage whose `sync_data` is held at a gate until the test opens it, on the
//! pwrite path with group commit (so the sync thread, not the storing thread, syncs).

mod wal_support;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use coordbus::{
    clock::SystemClock,
    coordinators::block_tracker::{
        AddBlocks, BatchCleanupEvent, BatchTime, BlockLog, BlockLogError, BlockStoreResult,
        BlockTrackerConfig, BlockTrackerEndpoint, ReceivedBlockInfo, ReceivedBlockTracker,
        ReceiverBlockStore, StreamBlockId, StreamId, TrackerEvent, WalBlockLog,
        DEFAULT_STORE_TIMEOUT, WAL_APPEND_TIMEOUT,
    },
    wal::{WalConfig, WalError},
    Bus,
};
use wal_support::{hold_and_fill_staging, open_gated, AfterGate, Gate, OpenOnDrop};

/// Far longer than a sync; a wait that has not returned by then is hung.
const BOUND: Duration = Duration::from_secs(30);

fn block(id: u64) -> StreamBlockId {
    StreamBlockId { stream: StreamId(0), unique_id: id }
}

#[test]
fn a_store_whose_sync_does_not_finish_times_out_with_its_lsn_and_bound() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let timeout = Duration::from_millis(100);
    let store = ReceiverBlockStore::from_wal(open_gated(dir.path(), &gate, AfterGate::Sync))
        .with_store_timeout(timeout);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    assert_eq!(store.store_timeout(), timeout);

    let started = Instant::now();
    let error = store.store(block(1), b"held at the gate", 10).unwrap_err();
    let waited = started.elapsed();
    match error {
        WalError::Timeout { lsn, timeout: reported, .. } => {
            assert_eq!(reported, timeout);
            assert_eq!(lsn, store.wal().appended_lsn().0, "the timeout names the block's LSN");
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(waited >= timeout, "returned before its bound: {waited:?}");
    assert!(waited < BOUND, "the store waited {waited:?}");

    // Once the sync finishes, the timed-out data is durable after all, and a block stored now
    // reads back (waited for with the test's bound: the store's 100 ms is no bound for a
    // write and an fsync on a loaded machine).
    gate.open();
    let appended = store.wal().appended_lsn();
    store.wal().wait_durable_timeout(appended, BOUND).unwrap();
    let (lsn, result) = store.store_deferred(block(2), b"stored", 11).unwrap();
    store.wal().wait_durable_timeout(lsn, BOUND).unwrap();
    assert!(
        matches!(result, BlockStoreResult::ReceiverWal { block_id, .. } if block_id == block(2))
    );
    let info = ReceivedBlockInfo::new(StreamId(0), Some(1), None, result).unwrap();
    assert_eq!(&*store.read(&info).unwrap(), b"stored");
}

#[test]
fn a_store_that_finds_no_room_to_stage_in_time_fails_and_appends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let timeout = Duration::from_millis(50);
    let store = ReceiverBlockStore::from_wal(open_gated(dir.path(), &gate, AfterGate::Sync))
        .with_store_timeout(timeout);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    // Hold the sync thread at the gate, then fill the staging buffer behind it.
    hold_and_fill_staging(store.wal(), &gate, 64 << 10, timeout);
    let filler = vec![1u8; 64 << 10];
    let before = store.wal().appended_lsn();
    let started = Instant::now();
    match store.store(block(3), &filler, 12) {
        Err(WalError::AppendTimedOut { timeout: reported, .. }) => assert_eq!(reported, timeout),
        other => panic!("expected AppendTimedOut, got {other:?}"),
    }
    assert!(started.elapsed() < BOUND, "the store waited {:?}", started.elapsed());
    assert_eq!(store.wal().appended_lsn(), before, "the refused store appended nothing");
    gate.open();
}

#[test]
fn the_default_store_timeout_is_sparks_thirty_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let store = ReceiverBlockStore::open(dir.path(), WalConfig::default()).unwrap();
    assert_eq!(DEFAULT_STORE_TIMEOUT, Duration::from_secs(30));
    assert_eq!(store.store_timeout(), DEFAULT_STORE_TIMEOUT);
    store.store(block(1), b"data", 1).unwrap();
}

#[test]
fn a_journal_append_that_finds_no_room_in_time_is_refused_and_logs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let timeout = Duration::from_millis(50);
    let log = WalBlockLog::from_wal(Arc::new(open_gated(dir.path(), &gate, AfterGate::Sync)))
        .with_append_timeout(timeout);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    let wal = Arc::clone(log.wal().unwrap());
    // Filled down to the last bytes of room: the event is small.
    hold_and_fill_staging(&wal, &gate, 64 << 10, timeout);
    let before = wal.appended_lsn();
    let event = TrackerEvent::BatchCleanup(BatchCleanupEvent { times: vec![BatchTime(1)] });
    let started = Instant::now();
    match log.append(&event, 2) {
        Err(BlockLogError::Wal(WalError::AppendTimedOut { timeout: reported, .. })) => {
            assert_eq!(reported, timeout)
        }
        other => panic!("expected AppendTimedOut, got {other:?}"),
    }
    assert!(started.elapsed() < BOUND, "the append waited {:?}", started.elapsed());
    assert_eq!(wal.appended_lsn(), before, "the refused event was logged");
    assert_eq!(WAL_APPEND_TIMEOUT, Duration::from_secs(5));
    gate.open();
}

/// On a stuck disk an `AddBlocks` request costs the endpoint one append timeout, not one per
/// block: after the first refused write the rest of the request is refused at once.
#[test]
fn an_add_blocks_request_on_a_stuck_disk_waits_out_one_append_timeout_not_one_per_block() {
    const BLOCKS: usize = 100;
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    // Long enough that a hundred of them (50 s) stand far apart from one on a loaded machine.
    let timeout = Duration::from_millis(500);
    let log = Arc::new(
        WalBlockLog::from_wal(Arc::new(open_gated(dir.path(), &gate, AfterGate::Sync)))
            .with_append_timeout(timeout),
    );
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    hold_and_fill_staging(log.wal().unwrap(), &gate, 64 << 10, timeout);
    let tracker = ReceivedBlockTracker::with_log(
        BlockTrackerConfig::new([StreamId(0)]),
        Arc::new(SystemClock),
        Some(log),
    )
    .unwrap();
    let bus = Bus::builder().build().unwrap();
    let endpoint = bus.register("stuck", BlockTrackerEndpoint::new(tracker)).unwrap();
    let infos: Vec<ReceivedBlockInfo> = (0..BLOCKS as u64)
        .map(|id| {
            let result = BlockStoreResult::BlockManager { block_id: block(id) };
            ReceivedBlockInfo::new(StreamId(0), Some(1), None, result).unwrap()
        })
        .collect();
    let started = Instant::now();
    let logged = endpoint.ask(AddBlocks(infos)).wait_timeout(BOUND).unwrap();
    let waited = started.elapsed();
    assert_eq!(logged, vec![false; BLOCKS], "a block was logged on a full, stuck log");
    // One timeout (0.5 s) and the request's own work; a hundred would be 50 s.
    assert!(waited < Duration::from_secs(10), "the request took {waited:?}");
    gate.open();
    let _ = bus.shutdown();
}
