//! Receiver-side logging: receivers append their block-addition records themselves and hand
//! the logged blocks to the tracker, which applies them with no I/O. Goal: acknowledgements
//! never come before the sync, a WAL failure answers false and rolls the state back to the
//! durable prefix, and recovery rebuilds exactly the pre-crash state whatever order appends,
//! hand-overs and allocations interleave in (SPEC D.3, D.4); a receiver combines the blocks
//! it adds while its last record syncs into one record, and never leaves one unlogged.
//!
//! Method: the interleavings that matter (an addition appended before an allocation but
//! applied after it; hand-overs arriving out of log order) are built step by step on the
//! plain state machine through its public API (`BlockLog::append`,
//! `apply_logged_additions`); the bus path runs two pipelined receivers against a batch loop
//! and compares the state before the stop with the recovered one. A gated file layer holds
//! or fails `fdatasync` on demand, so "not yet durable" is a fact, not a timing guess.

use std::{
    collections::BTreeMap,
    io,
    os::fd::RawFd,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex,
    },
    time::Duration,
};

use coordbus::{
    clock::{ManualClock, SystemClock},
    coordinators::block_tracker::{
        AddBlock, AddBlocks, AllocateBlocksToBatch, BatchTime, BlockAdditionEvent,
        BlockAdditionsEvent, BlockLog, BlockReceiver, BlockStoreResult, BlockTrackerConfig,
        BlockTrackerEndpoint, BlockTrackerError, ConnectReceiver, GetBlocksOfBatch,
        GetUnallocatedBlocks, HasUnallocatedBlocks, ReceivedBlockInfo, ReceivedBlockTracker,
        StopTracker, StreamBlockId, StreamId, TrackerEvent, WalBlockLog, COMBINE_MAX_BLOCKS,
        RECEIVED_BLOCK_METADATA_DIR,
    },
    wal::{
        storage::{FileStorage, Storage, StorageFile},
        IoMode, RecordHandle, SegmentId, Wal, WalConfig, WalOptions,
    },
    AskError, Bus,
};

const STREAMS: [StreamId; 2] = [StreamId(1), StreamId(2)];
/// How long the pipelined receivers may take in all before the test fails (a few seconds when
/// things work).
const RUN_BOUND: Duration = Duration::from_secs(120);
/// Longest a sync waits at a held gate: far longer than any test holds it. Bounded so that a
/// test that fails while it holds the gate does not leave the sync thread there for good (the
/// log's drop joins it, which would hang the failing test).
const GATE_BOUND: Duration = Duration::from_secs(30);

/// A block in a block manager with `metadata_bytes` of metadata (each byte `unique_id`).
fn with_metadata(stream: i32, unique_id: u64, metadata_bytes: usize) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
    let metadata = Some(vec![unique_id as u8; metadata_bytes]);
    let result = BlockStoreResult::BlockManager { block_id };
    ReceivedBlockInfo::new(StreamId(stream), None, metadata, result).unwrap()
}

fn info(stream: i32, unique_id: u64) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
    ReceivedBlockInfo::new(
        StreamId(stream),
        Some(unique_id as i64),
        None,
        BlockStoreResult::BlockManager { block_id },
    )
    .unwrap()
}

/// Everything observable of a tracker's state.
#[derive(Debug, PartialEq, Eq)]
struct State {
    unallocated: Vec<Vec<ReceivedBlockInfo>>,
    batches: BTreeMap<BatchTime, Vec<Vec<ReceivedBlockInfo>>>,
    last_allocated: Option<BatchTime>,
}

fn state_of(tracker: &ReceivedBlockTracker) -> State {
    State {
        unallocated: STREAMS.iter().map(|stream| tracker.unallocated_blocks(*stream)).collect(),
        batches: tracker
            .allocated_batch_times()
            .into_iter()
            .map(|time| {
                let blocks = STREAMS
                    .iter()
                    .map(|stream| tracker.blocks_of_batch_and_stream(time, *stream))
                    .collect();
                (time, blocks)
            })
            .collect(),
        last_allocated: tracker.last_allocated_batch_time(),
    }
}

fn open(dir: &Path, recover: bool) -> ReceivedBlockTracker {
    let config = BlockTrackerConfig::new(STREAMS).checkpoint_dir(dir).recover(recover);
    ReceivedBlockTracker::open(config, Arc::new(ManualClock::new(1_000))).unwrap()
}

/// Appends `blocks` as a receiver would (one record) and waits until it is durable.
fn append_as_receiver(
    tracker: &ReceivedBlockTracker,
    blocks: &[ReceivedBlockInfo],
) -> coordbus::wal::Lsn {
    let log = tracker.log().unwrap();
    let event = if let [only] = blocks {
        TrackerEvent::BlockAddition(BlockAdditionEvent { info: only.clone() })
    } else {
        TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos: blocks.to_vec() })
    };
    let lsn = log.append(&event, 1_000).unwrap();
    log.wait_durable(lsn, Duration::from_secs(10)).unwrap();
    lsn
}

#[test]
fn an_addition_logged_before_an_allocation_but_applied_after_it_stays_unallocated() {
    let dir = tempfile::tempdir().unwrap();
    let mut tracker = open(dir.path(), false);
    assert!(tracker.add_block(info(1, 1)));
    // A receiver appends block 2; before the tracker applies it, a batch is allocated.
    let late = info(1, 2);
    let late_lsn = append_as_receiver(&tracker, std::slice::from_ref(&late));
    tracker.allocate_blocks_to_batch(BatchTime(100)).unwrap();
    tracker.apply_logged_additions(late_lsn, [late.clone()]);
    assert_eq!(tracker.blocks_of_batch_and_stream(BatchTime(100), StreamId(1)), [info(1, 1)]);
    assert_eq!(tracker.unallocated_blocks(StreamId(1)), std::slice::from_ref(&late));
    let before = state_of(&tracker);
    drop(tracker); // a crash: nothing more is written

    let recovered = open(dir.path(), true);
    assert_eq!(state_of(&recovered), before);
    assert!(recovered.unallocated_blocks(StreamId(1)).iter().all(|b| !b.is_block_id_valid()));
}

#[test]
fn hand_overs_arriving_out_of_log_order_queue_in_log_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut tracker = open(dir.path(), false);
    // Receiver A logs one block, receiver B logs a record of three; B's hand-over arrives
    // first, then a later block of A's.
    let a1 = info(1, 10);
    let b = [info(1, 20), info(2, 21), info(1, 22)];
    let a2 = info(2, 11);
    let a1_lsn = append_as_receiver(&tracker, std::slice::from_ref(&a1));
    let b_lsn = append_as_receiver(&tracker, &b);
    let a2_lsn = append_as_receiver(&tracker, std::slice::from_ref(&a2));
    tracker.apply_logged_additions(b_lsn, b.clone());
    tracker.apply_logged_additions(a2_lsn, [a2.clone()]);
    tracker.apply_logged_additions(a1_lsn, [a1.clone()]);
    assert_eq!(tracker.unallocated_blocks(StreamId(1)), [a1.clone(), b[0].clone(), b[2].clone()]);
    assert_eq!(tracker.unallocated_blocks(StreamId(2)), [b[1].clone(), a2.clone()]);
    let unallocated_before = state_of(&tracker);
    let (_copy, recovered) = open_copy(dir.path());
    assert_eq!(state_of(&recovered), unallocated_before);

    tracker.allocate_blocks_to_batch(BatchTime(200)).unwrap();
    assert_eq!(
        tracker.blocks_of_batch_and_stream(BatchTime(200), StreamId(1)),
        [a1, b[0].clone(), b[2].clone()]
    );
    let before = state_of(&tracker);
    drop(tracker);
    assert_eq!(state_of(&open(dir.path(), true)), before);
}

/// Recovers a second tracker from a copy of the log while the first keeps it open.
fn open_copy(dir: &Path) -> (tempfile::TempDir, ReceivedBlockTracker) {
    let copy = tempfile::tempdir().unwrap();
    let source = dir.join(RECEIVED_BLOCK_METADATA_DIR);
    let target = copy.path().join(RECEIVED_BLOCK_METADATA_DIR);
    std::fs::create_dir_all(&target).unwrap();
    for entry in std::fs::read_dir(source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), target.join(entry.file_name())).unwrap();
    }
    let tracker = open(copy.path(), true);
    (copy, tracker)
}

#[test]
fn pipelined_receivers_and_a_batch_loop_recover_to_the_exact_state() {
    let dir = tempfile::tempdir().unwrap();
    let config = BlockTrackerConfig::new(STREAMS).checkpoint_dir(dir.path());
    let tracker = ReceivedBlockTracker::open(config.clone(), Arc::new(SystemClock)).unwrap();
    let wal = Arc::clone(tracker.wal().unwrap());
    let bus = Bus::builder().inbox_shards(3).build().unwrap();
    let endpoint =
        bus.register("ReceivedBlockTracker", BlockTrackerEndpoint::new(tracker)).unwrap();
    let per_receiver: u64 = if cfg!(miri) { 20 } else { 3_000 };
    let receivers: Vec<_> = (0..2u64)
        .map(|receiver| {
            let (endpoint, wal) = (endpoint.clone(), wal.clone());
            std::thread::spawn(move || {
                let handle = BlockReceiver::connect(&endpoint).unwrap();
                let make = |seq: u64| info(1 + (seq % 2) as i32, receiver * 1_000_000 + seq);
                let mut in_flight = std::collections::VecDeque::new();
                let mut seq = 0;
                while seq < per_receiver {
                    // Receiver 0 adds one block per record, receiver 1 up to 7.
                    let count = if receiver == 0 { 1 } else { 1 + seq % 7 }.min(per_receiver - seq);
                    let receipt = if count == 1 {
                        handle.add_block(make(seq))
                    } else {
                        handle.add_blocks((seq..seq + count).map(make).collect())
                    };
                    in_flight.push_back(receipt);
                    if in_flight.len() > 64 {
                        let receipt = in_flight.pop_front().unwrap();
                        // Polling flushes a combined block's batch: its LSN is known after.
                        assert_ne!(receipt.try_result(), Some(false), "addition not logged");
                        let lsn = receipt.lsn().expect("logged and handed over");
                        assert!(receipt.wait(), "addition not logged");
                        assert!(wal.durable_lsn() >= lsn, "acknowledged before the sync");
                    }
                    seq += count;
                }
                // A `let`: the receipts borrow the receiver, which must outlive them (a tail
                // expression's temporaries would be dropped after it).
                #[allow(clippy::let_and_return)]
                let all_logged = in_flight.into_iter().all(|receipt| receipt.wait());
                all_logged
            })
        })
        .collect();
    let mut time = 0;
    let deadline = std::time::Instant::now() + RUN_BOUND;
    while receivers.iter().any(|receiver| !receiver.is_finished()) {
        assert!(std::time::Instant::now() < deadline, "receivers running after {RUN_BOUND:?}");
        time += 10;
        endpoint.ask(AllocateBlocksToBatch(BatchTime(time))).wait().unwrap();
    }
    for receiver in receivers {
        assert!(receiver.join().unwrap());
    }
    // The hand-overs the receivers made are handled before this thread's next asks only per
    // sender; wait until every block is in the state (bounded).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let total = |endpoint: &coordbus::EndpointRef<BlockTrackerEndpoint>| -> u64 {
        let allocated: usize = (1..=time / 10)
            .map(|batch| {
                endpoint.ask(GetBlocksOfBatch(BatchTime(batch * 10))).wait().unwrap().block_count()
            })
            .sum();
        let unallocated: usize = STREAMS
            .iter()
            .map(|stream| endpoint.ask(GetUnallocatedBlocks(*stream)).wait().unwrap().len())
            .sum();
        (allocated + unallocated) as u64
    };
    while total(&endpoint) < 2 * per_receiver {
        assert!(std::time::Instant::now() < deadline, "hand-overs did not arrive");
        std::thread::yield_now();
    }
    time += 10;
    endpoint.ask(AllocateBlocksToBatch(BatchTime(time))).wait().unwrap();
    assert!(!endpoint.ask(HasUnallocatedBlocks).wait().unwrap());
    // One more receiver record lands after the last allocation and stays unallocated.
    let handle = BlockReceiver::connect(&endpoint).unwrap();
    assert!(handle.add_blocks(vec![info(1, 7), info(2, 8)]).wait());

    let mut before_batches = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    for batch in 1..=time / 10 {
        let blocks = endpoint.ask(GetBlocksOfBatch(BatchTime(batch * 10))).wait().unwrap();
        for stream in blocks.streams() {
            for block in &stream.blocks {
                assert!(seen.insert(block.block_id()), "block allocated twice: {block:?}");
            }
        }
        before_batches.insert(batch * 10, blocks);
    }
    assert_eq!(seen.len() as u64, 2 * per_receiver);
    let before_unallocated: Vec<_> = STREAMS
        .iter()
        .map(|stream| endpoint.ask(GetUnallocatedBlocks(*stream)).wait().unwrap())
        .collect();
    assert_eq!(before_unallocated, [vec![info(1, 7)], vec![info(2, 8)]]);
    endpoint.ask(StopTracker).wait().unwrap();
    bus.shutdown().unwrap();

    let recovered =
        ReceivedBlockTracker::open(config.recover(true), Arc::new(SystemClock)).unwrap();
    for (time, blocks) in before_batches {
        assert_eq!(recovered.blocks_of_batch(BatchTime(time)), blocks, "batch {time}");
    }
    let after_unallocated: Vec<_> =
        STREAMS.iter().map(|stream| recovered.unallocated_blocks(*stream)).collect();
    assert_eq!(after_unallocated, before_unallocated);
    assert_eq!(recovered.last_allocated_batch_time(), Some(BatchTime(time)));
}

/// Real files whose `fdatasync` waits while `held` and fails once `fail` is set.
#[derive(Debug, Default)]
struct Gate {
    held: Mutex<bool>,
    opened: Condvar,
    fail: AtomicBool,
}

impl Gate {
    fn set_held(&self, held: bool) {
        *self.held.lock().unwrap() = held;
        self.opened.notify_all();
    }
}

#[derive(Debug)]
struct GatedStorage(Arc<Gate>);

#[derive(Debug)]
struct GatedFile {
    inner: Arc<dyn StorageFile>,
    gate: Arc<Gate>,
}

impl Storage for GatedStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        FileStorage.create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(Arc::new(GatedFile { inner: FileStorage.create(path)?, gate: self.0.clone() }))
    }
    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(Arc::new(GatedFile { inner: FileStorage.open_existing(path)?, gate: self.0.clone() }))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        FileStorage.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        FileStorage.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        FileStorage.sync_dir(dir)
    }
}

impl StorageFile for GatedFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.inner.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        let held = self.gate.held.lock().unwrap();
        drop(self.gate.opened.wait_timeout_while(held, GATE_BOUND, |held| *held).unwrap());
        if self.gate.fail.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5)); // EIO
        }
        self.inner.sync_data()
    }
    fn allocate(&self, len: u64) -> io::Result<()> {
        self.inner.allocate(len)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn raw_fd(&self) -> Option<RawFd> {
        None
    }
}

fn gated_endpoint(
    dir: &Path,
    gate: &Arc<Gate>,
) -> (Bus, coordbus::EndpointRef<BlockTrackerEndpoint>) {
    gated_endpoint_with(dir, gate, WalConfig::default())
}

fn gated_endpoint_with(
    dir: &Path,
    gate: &Arc<Gate>,
    config: WalConfig,
) -> (Bus, coordbus::EndpointRef<BlockTrackerEndpoint>) {
    let wal = Wal::open_with_options(
        dir.join(RECEIVED_BLOCK_METADATA_DIR),
        config,
        WalOptions {
            io: IoMode::Pwrite,
            storage: Arc::new(GatedStorage(gate.clone())),
            ..WalOptions::default()
        },
    )
    .unwrap();
    let log: Arc<dyn BlockLog> = Arc::new(WalBlockLog::from_wal(Arc::new(wal)));
    let tracker = ReceivedBlockTracker::with_log(
        BlockTrackerConfig::new(STREAMS),
        Arc::new(SystemClock),
        Some(log),
    )
    .unwrap();
    let bus = Bus::builder().build().unwrap();
    let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();
    (bus, endpoint)
}

/// A tracker behind a gated log, a receiver of it, and the log's syncs held.
fn receiver_with_syncs_held(
) -> (tempfile::TempDir, Arc<Gate>, Bus, coordbus::EndpointRef<BlockTrackerEndpoint>, BlockReceiver)
{
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let (bus, endpoint) = gated_endpoint(dir.path(), &gate);
    let receiver = BlockReceiver::connect(&endpoint).unwrap();
    gate.set_held(true);
    (dir, gate, bus, endpoint, receiver)
}

fn stop(endpoint: &coordbus::EndpointRef<BlockTrackerEndpoint>, bus: Bus) {
    endpoint.ask(StopTracker).wait().unwrap();
    bus.shutdown().unwrap();
}

#[test]
fn a_receipt_resolves_only_after_the_sync_and_queries_wait_for_it() {
    let (_dir, gate, bus, endpoint, receiver) = receiver_with_syncs_held();
    let receipt = receiver.add_block(info(1, 1));
    assert!(receipt.lsn().is_some());
    assert_eq!(receipt.try_result(), None, "the sync is held: not durable yet");
    // The query sees the handed-over block, but is answered only once it is durable.
    let mut query = endpoint.ask(GetUnallocatedBlocks(StreamId(1)));
    // Answered at once whatever is durable, and after the query (one sender's requests keep
    // their order): once it is back, the query was handled, and waits.
    endpoint.ask(ConnectReceiver).wait().unwrap();
    assert!(query.try_take().is_none(), "answered before the sync");
    gate.set_held(false);
    assert!(receipt.wait());
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(), [info(1, 1)]);
    stop(&endpoint, bus);
}

#[test]
fn a_failed_sync_answers_false_and_rolls_handed_over_blocks_back() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let (bus, endpoint) = gated_endpoint(dir.path(), &gate);
    let receiver = BlockReceiver::connect(&endpoint).unwrap();
    assert!(receiver.add_block(info(1, 1)).wait());
    gate.set_held(true);
    let lost = receiver.add_blocks(vec![info(1, 2), info(2, 3)]);
    // The hand-over is applied before the next ask of this thread is handled.
    let query = endpoint.ask(HasUnallocatedBlocks);
    // An ask answered at once: once it returns, the query above has been handled (per-sender
    // order) and is waiting for the sync. Without it the failure below may reach the endpoint
    // (from the WAL's thread) first, and the query would then rightly see only durable state.
    let _ = BlockReceiver::connect(&endpoint).unwrap();
    gate.fail.store(true, Ordering::SeqCst);
    gate.set_held(false);
    assert!(!lost.wait(), "the sync failed");
    // The state it saw was not durable: it fails with the WAL's error, at once.
    match query.wait_timeout(GATE_BOUND) {
        Err(AskError::Handler { source: cause, .. }) => assert!(
            matches!(cause.downcast_ref::<BlockTrackerError>(), Some(BlockTrackerError::Wal(_))),
            "{cause}"
        ),
        other => panic!("expected the WAL's failure, got {other:?}"),
    }
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(), [info(1, 1)]);
    assert!(endpoint.ask(GetUnallocatedBlocks(StreamId(2))).wait().unwrap().is_empty());
    // The failed log takes nothing more.
    assert!(!receiver.add_block(info(1, 4)).wait());
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(), [info(1, 1)]);
    stop(&endpoint, bus);
}

#[test]
fn a_lone_addition_is_logged_at_once_and_later_ones_combine_while_it_syncs() {
    let (_dir, gate, bus, endpoint, receiver) = receiver_with_syncs_held();
    let first = receiver.add_block(info(1, 1));
    let first_lsn = first.lsn().expect("nothing was in flight: logged at once");
    // The first record is not durable: the next blocks wait in the receiver's batch.
    let second = receiver.add_block(info(1, 2));
    let third = receiver.add_block(info(2, 3));
    assert_eq!((second.lsn(), third.lsn()), (None, None), "pending, not logged yet");
    // Polling a receipt flushes its batch: both blocks go in the next record.
    assert_eq!(second.try_result(), None, "logged, the sync is held");
    assert_eq!(second.lsn(), Some(coordbus::wal::Lsn(first_lsn.0 + 1)));
    assert_eq!(third.lsn(), second.lsn(), "one record for the batch");
    gate.set_held(false);
    assert!(first.wait() && second.wait() && third.wait());
    assert_eq!(
        endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(),
        [info(1, 1), info(1, 2)]
    );
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(2))).wait().unwrap(), [info(2, 3)]);
    // Everything is durable again: the next lone block is logged at once.
    let fourth = receiver.add_block(info(1, 4));
    assert_eq!(fourth.lsn(), Some(coordbus::wal::Lsn(first_lsn.0 + 2)));
    assert!(fourth.wait());
    stop(&endpoint, bus);
}

#[test]
fn a_full_batch_is_logged_without_being_asked_and_add_blocks_keeps_the_order() {
    let (_dir, gate, bus, endpoint, receiver) = receiver_with_syncs_held();
    let first = receiver.add_block(info(1, 0));
    let first_lsn = first.lsn().unwrap().0;
    let batch: Vec<_> =
        (1..=COMBINE_MAX_BLOCKS as u64).map(|id| receiver.add_block(info(1, id))).collect();
    // The batch filled up and was logged as one record, nobody asking.
    assert!(batch.iter().all(|receipt| receipt.lsn() == Some(coordbus::wal::Lsn(first_lsn + 1))));
    // A pending block, then an explicit multi-block record: the pending one is logged first.
    let pending = receiver.add_block(info(2, 1_000));
    assert_eq!(pending.lsn(), None);
    let many = receiver.add_blocks(vec![info(2, 1_001), info(2, 1_002)]);
    assert_eq!(pending.lsn(), Some(coordbus::wal::Lsn(first_lsn + 2)));
    assert_eq!(many.lsn(), Some(coordbus::wal::Lsn(first_lsn + 3)));
    gate.set_held(false);
    assert!(first.wait() && pending.wait() && many.wait());
    assert!(batch.into_iter().all(|receipt| receipt.wait()));
    let stream1 = endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap();
    assert_eq!(stream1, (0..=COMBINE_MAX_BLOCKS as u64).map(|id| info(1, id)).collect::<Vec<_>>());
    assert_eq!(
        endpoint.ask(GetUnallocatedBlocks(StreamId(2))).wait().unwrap(),
        [info(2, 1_000), info(2, 1_001), info(2, 1_002)]
    );
    stop(&endpoint, bus);
}

#[test]
fn pending_blocks_are_logged_when_their_receipt_or_their_receiver_is_dropped() {
    let (_dir, gate, bus, endpoint, receiver) = receiver_with_syncs_held();
    let first = receiver.add_block(info(1, 1));
    drop(receiver.add_block(info(1, 2)));
    // The dropped receipt flushed its batch: the next block finds it empty.
    let third = receiver.add_block(info(1, 3));
    assert_eq!(third.try_result(), None, "flushed by polling; the sync is held");
    assert_eq!(third.lsn(), Some(coordbus::wal::Lsn(first.lsn().unwrap().0 + 2)));
    // A receipt forgotten (never dropped): the receiver's drop logs its block.
    std::mem::forget(receiver.add_block(info(1, 4)));
    gate.set_held(false);
    assert!(first.wait() && third.wait());
    drop(receiver);
    let blocks = endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap();
    assert_eq!(blocks, [info(1, 1), info(1, 2), info(1, 3), info(1, 4)]);
    stop(&endpoint, bus);
}

/// A receiver refuses a block too large to be allocated (its metadata longer than
/// `block_metadata_bytes_max`) before logging anything: its receipt is false at once, and an
/// `add_blocks` holding it is refused whole, and so is an `AddBlock` ask; an `AddBlocks` ask
/// refuses that block alone. A block at the limit is logged and queued.
#[test]
fn a_receiver_refuses_a_block_too_large_to_be_allocated_without_logging_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = BlockTrackerConfig::new(STREAMS).checkpoint_dir(dir.path());
    config.wal.segment_size_bytes = 64 << 10;
    let tracker = ReceivedBlockTracker::open(config, Arc::new(SystemClock)).unwrap();
    let limit = tracker.block_metadata_bytes_max().expect("a WAL limits its records");
    let wal = Arc::clone(tracker.log().unwrap().wal().unwrap());
    let bus = Bus::builder().build().unwrap();
    let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();
    let receiver = BlockReceiver::connect(&endpoint).unwrap();
    let appended_before = wal.appended_lsn();

    let refused = receiver.add_block(with_metadata(1, 1, limit + 1));
    assert_eq!(refused.lsn(), None, "nothing logged");
    assert_eq!(refused.try_result(), Some(false), "answered at once");
    let mixed = receiver.add_blocks(vec![info(2, 2), with_metadata(1, 3, limit + 1)]);
    assert!(!mixed.wait(), "all or nothing");
    let asked = endpoint.ask(AddBlock(with_metadata(2, 5, limit + 1))).wait().unwrap();
    assert!(!asked, "the endpoint's own additions refuse it too");
    assert_eq!(wal.appended_lsn(), appended_before, "no record appended");
    for stream in STREAMS {
        assert!(endpoint.ask(GetUnallocatedBlocks(stream)).wait().unwrap().is_empty());
    }
    // An `AddBlocks` ask answers per block: only the oversized one is refused, the blocks
    // after it are still logged (a refused write, by contrast, refuses the rest).
    let answers = endpoint
        .ask(AddBlocks(vec![info(2, 6), with_metadata(2, 7, limit + 1), info(2, 8)]))
        .wait()
        .unwrap();
    assert_eq!(answers, [true, false, true]);
    assert_eq!(
        endpoint.ask(GetUnallocatedBlocks(StreamId(2))).wait().unwrap(),
        [info(2, 6), info(2, 8)]
    );

    let at_limit = with_metadata(1, 4, limit);
    assert!(receiver.add_block(at_limit.clone()).wait());
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(), [at_limit]);
    stop(&endpoint, bus);
}

/// A receiver's pending batch is logged before a block that would take it past the limit
/// (metadata and the most the blocks' fixed parts take): blocks each within the limit never
/// combine into a record the log refuses (before, a large block and the blocks after it made
/// one record too large for the log, and every one of them was answered false), and blocks
/// that fit together still combine.
#[test]
fn large_blocks_pending_while_a_record_syncs_are_not_combined_past_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let config = WalConfig { segment_size_bytes: 64 << 10, ..WalConfig::default() };
    let config_copy = config.clone();
    let (bus, endpoint) = gated_endpoint_with(dir.path(), &gate, config);
    let receiver = BlockReceiver::connect(&endpoint).unwrap();
    // The limit depends only on the streams and the segment size.
    let twin = tempfile::tempdir().unwrap();
    let mut twin_config = BlockTrackerConfig::new(STREAMS).checkpoint_dir(twin.path());
    twin_config.wal = config_copy;
    let limit = ReceivedBlockTracker::open(twin_config, Arc::new(SystemClock))
        .unwrap()
        .block_metadata_bytes_max()
        .expect("a WAL limits it");
    gate.set_held(true);
    let first = receiver.add_block(info(1, 1));
    let first_lsn = first.lsn().expect("nothing in flight: logged at once");
    let blocks = [
        with_metadata(1, 2, limit * 3 / 5),
        with_metadata(2, 3, 16),
        with_metadata(1, 4, limit * 3 / 5),
        with_metadata(2, 5, 16),
    ];
    let receipts: Vec<_> = blocks.iter().map(|block| receiver.add_block(block.clone())).collect();
    receiver.flush();
    let lsns: Vec<_> = receipts.iter().map(|receipt| receipt.lsn().expect("flushed")).collect();
    // A small block joins the large one before it; the second large one would take the
    // batch past the limit, so the batch is logged first.
    assert_eq!(lsns, [1, 1, 2, 2].map(|step| coordbus::wal::Lsn(first_lsn.0 + step)));
    gate.set_held(false);
    assert!(first.wait());
    assert!(receipts.into_iter().all(|receipt| receipt.wait()), "every block logged");
    let stream = |id: i32| endpoint.ask(GetUnallocatedBlocks(StreamId(id))).wait().unwrap();
    assert_eq!(stream(1), [info(1, 1), blocks[0].clone(), blocks[2].clone()]);
    assert_eq!(stream(2), [blocks[1].clone(), blocks[3].clone()]);
    stop(&endpoint, bus);
}

/// With small segments, the fixed parts of a full batch alone would make a record the log
/// refuses (a block stored in a receiver log carries a handle: about 80 bytes in a record);
/// the batch is logged in as many records as it takes, and every block is acknowledged.
#[test]
fn a_batch_of_blocks_with_handles_fits_small_segments_in_several_records() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let config = WalConfig { segment_size_bytes: 4096, ..WalConfig::default() };
    let (bus, endpoint) = gated_endpoint_with(dir.path(), &gate, config);
    let receiver = BlockReceiver::connect(&endpoint).unwrap();
    gate.set_held(true);
    let with_handle = |unique_id: u64| {
        let block_id = StreamBlockId { stream: StreamId(1), unique_id };
        let handle = RecordHandle { segment: SegmentId(7), offset: unique_id * 4096, len: 4000 };
        let result = BlockStoreResult::ReceiverWal { block_id, handle };
        ReceivedBlockInfo::new(StreamId(1), Some(100), None, result).unwrap()
    };
    let blocks: Vec<_> = (1..=100).map(with_handle).collect();
    let receipts: Vec<_> = blocks.iter().map(|block| receiver.add_block(block.clone())).collect();
    receiver.flush();
    let records: std::collections::BTreeSet<_> =
        receipts.iter().map(|receipt| receipt.lsn().expect("flushed")).collect();
    assert!(records.len() > 2, "100 blocks with handles take several 4 KiB records");
    gate.set_held(false);
    assert!(receipts.into_iter().all(|receipt| receipt.wait()), "every block logged");
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(), blocks);
    stop(&endpoint, bus);
}
