//! The block tracker hosted on the bus: acknowledgements wait for durability, concurrent
//! receivers share group commits, queries never expose undurable changes, and a WAL failure
//! fails the waiting requests and rolls the state back to the durable prefix.
//!
//! Method: a recording log (wrapping the real WAL log) remembers the LSN of every addition, so
//! each receiver can check at the moment it is acknowledged that the WAL's durable LSN already
//! covers its record. A fault-injecting storage fails `fdatasync` on demand.

use std::{
    collections::HashMap,
    io,
    os::fd::RawFd,
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc, Condvar, Mutex,
    },
    time::Duration,
};

use coordbus::{
    clock::{ManualClock, SystemClock},
    coordinators::block_tracker::{
        AddBlock, AddBlocks, AllocateBlocksToBatch, BatchTime, BlockLog, BlockLogError,
        BlockReceiver, BlockStoreResult, BlockTrackerConfig, BlockTrackerEndpoint,
        BlockTrackerError, CleanupOldBatches, ConnectReceiver, GetBlocksOfBatch,
        GetBlocksOfBatchAndStream, GetUnallocatedBlocks, GetUnconfiguredStreams,
        HasUnallocatedBlocks, ReceivedBlockInfo, ReceivedBlockTracker, StopTracker, StreamBlockId,
        StreamId, TrackerEvent, WalBlockLog, DEFAULT_ANSWER_BYTE_LIMIT, MAX_PENDING_QUERIES,
        RECEIVED_BLOCK_METADATA_DIR,
    },
    wal::{
        storage::{FileStorage, Storage, StorageFile},
        DurableCallback, IoMode, Lsn, Wal, WalConfig, WalError, WalOptions,
    },
    AskError, Bus,
};

fn info(stream: i32, unique_id: u64) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
    ReceivedBlockInfo::new(
        StreamId(stream),
        Some(1),
        None,
        BlockStoreResult::BlockManager { block_id },
    )
    .unwrap()
}

/// The real log, remembering the LSN each block's addition got.
struct RecordingLog {
    inner: WalBlockLog,
    lsns: Mutex<HashMap<StreamBlockId, Lsn>>,
}

impl BlockLog for RecordingLog {
    fn append(&self, event: &TrackerEvent, time_ms: i64) -> Result<Lsn, BlockLogError> {
        let lsn = self.inner.append(event, time_ms)?;
        if let TrackerEvent::BlockAddition(addition) = event {
            self.lsns.lock().unwrap().insert(addition.info.block_id(), lsn);
        }
        Ok(lsn)
    }
    fn wait_durable(&self, lsn: Lsn, timeout: Duration) -> Result<(), WalError> {
        self.inner.wait_durable(lsn, timeout)
    }
    fn durable_lsn(&self) -> Lsn {
        self.inner.durable_lsn()
    }
    fn notify_when_durable(&self, lsn: Lsn, callback: DurableCallback) {
        self.inner.notify_when_durable(lsn, callback);
    }
    fn replay(
        &self,
        last: Option<Lsn>,
        apply: &mut dyn FnMut(Lsn, TrackerEvent),
    ) -> Result<u64, BlockTrackerError> {
        self.inner.replay(last, apply)
    }
    fn clean(&self, threshold_ms: i64, keep_from: Option<Lsn>, wait: bool) -> Result<(), WalError> {
        self.inner.clean(threshold_ms, keep_from, wait)
    }
    fn close(&self) -> Result<(), WalError> {
        self.inner.close()
    }
    fn max_event_bytes(&self) -> Option<usize> {
        self.inner.max_event_bytes()
    }
    fn wal(&self) -> Option<&Arc<Wal>> {
        self.inner.wal()
    }
}

/// Far longer than any answer takes; a wait that reaches it is a hang.
const BOUND: Duration = Duration::from_secs(30);

/// The real log, but nothing becomes durable unless the test says so ([`StalledLog::catch_up`]):
/// a disk that stopped answering. It counts the replays of the log (rebuilds of the state),
/// and fails them if `unreadable`.
struct StalledLog {
    inner: WalBlockLog,
    callbacks: Mutex<Vec<DurableCallback>>,
    /// Signalled when a callback is armed.
    armed: Condvar,
    replays: AtomicUsize,
    unreadable: bool,
    /// The LSN the log reports durable: 0 until `catch_up`.
    durable: AtomicU64,
    /// The last LSN appended.
    appended: AtomicU64,
    /// Set by [`StalledLog::hold_close`]: the next `close` says it entered, waits for the
    /// release, then times out, leaving the log open (a close that gave up on the disk).
    held_close: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
    /// While set, appends time out for room, as on a disk that stopped taking writes.
    appends_stall: AtomicBool,
    /// Calls of `append`, stalled ones included.
    append_calls: AtomicUsize,
}

impl StalledLog {
    fn new(dir: &Path, unreadable: bool) -> Arc<Self> {
        Arc::new(Self {
            inner: WalBlockLog::open(dir.join("wal"), WalConfig::default()).unwrap(),
            callbacks: Mutex::new(Vec::new()),
            armed: Condvar::new(),
            replays: AtomicUsize::new(0),
            unreadable,
            durable: AtomicU64::new(0),
            appended: AtomicU64::new(0),
            held_close: Mutex::new(None),
            appends_stall: AtomicBool::new(false),
            append_calls: AtomicUsize::new(0),
        })
    }

    /// Makes the next `close` stop until released, then time out. Returns the receiver of its
    /// "entered" signal and the sender that releases it.
    fn hold_close(&self) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (entered, entered_signal) = mpsc::channel();
        let (release, released) = mpsc::channel();
        *self.held_close.lock().unwrap() = Some((entered, released));
        (entered_signal, release)
    }

    /// The disk answers once: everything appended so far becomes durable, and the armed
    /// callbacks say so. Later appends stall again.
    fn catch_up(&self) {
        self.durable.store(self.appended.load(Ordering::SeqCst), Ordering::SeqCst);
        self.report(&Ok(()));
    }

    /// Waits (bounded) until a durability callback is armed, then runs the ones armed so far
    /// with `outcome`.
    fn report(&self, outcome: &Result<(), WalError>) {
        let (mut callbacks, timeout) = self
            .armed
            .wait_timeout_while(self.callbacks.lock().unwrap(), BOUND, |armed| armed.is_empty())
            .unwrap();
        assert!(!timeout.timed_out(), "no durability callback was armed");
        let callbacks = std::mem::take(&mut *callbacks);
        for callback in callbacks {
            callback(outcome.clone());
        }
    }
}

impl BlockLog for StalledLog {
    fn append(&self, event: &TrackerEvent, time_ms: i64) -> Result<Lsn, BlockLogError> {
        self.append_calls.fetch_add(1, Ordering::SeqCst);
        if self.appends_stall.load(Ordering::SeqCst) {
            return Err(BlockLogError::Wal(WalError::AppendTimedOut {
                timeout: Duration::from_secs(5),
                appended: self.appended.load(Ordering::SeqCst),
                durable: self.durable.load(Ordering::SeqCst),
            }));
        }
        let lsn = self.inner.append(event, time_ms)?;
        self.appended.fetch_max(lsn.0, Ordering::SeqCst);
        Ok(lsn)
    }
    fn wait_durable(&self, lsn: Lsn, timeout: Duration) -> Result<(), WalError> {
        if lsn <= self.durable_lsn() {
            return Ok(());
        }
        let durable = self.durable.load(Ordering::SeqCst);
        Err(WalError::Timeout { lsn: lsn.0, durable, timeout })
    }
    fn durable_lsn(&self) -> Lsn {
        Lsn(self.durable.load(Ordering::SeqCst))
    }
    fn notify_when_durable(&self, _: Lsn, callback: DurableCallback) {
        self.callbacks.lock().unwrap().push(callback);
        self.armed.notify_all();
    }
    fn replay(
        &self,
        last: Option<Lsn>,
        apply: &mut dyn FnMut(Lsn, TrackerEvent),
    ) -> Result<u64, BlockTrackerError> {
        self.replays.fetch_add(1, Ordering::SeqCst);
        if self.unreadable {
            return Err(BlockTrackerError::Decode { message: "unreadable journal".into() });
        }
        self.inner.replay(last, apply)
    }
    fn clean(&self, threshold_ms: i64, keep_from: Option<Lsn>, wait: bool) -> Result<(), WalError> {
        self.inner.clean(threshold_ms, keep_from, wait)
    }
    fn close(&self) -> Result<(), WalError> {
        let Some((entered, released)) = self.held_close.lock().unwrap().take() else {
            return self.inner.close();
        };
        entered.send(()).unwrap();
        released.recv_timeout(BOUND).unwrap();
        Err(WalError::CloseTimedOut {
            appended: self.appended.load(Ordering::SeqCst),
            durable: self.durable.load(Ordering::SeqCst),
            timeout: BOUND,
        })
    }
    fn max_event_bytes(&self) -> Option<usize> {
        self.inner.max_event_bytes()
    }
    fn wal(&self) -> Option<&Arc<Wal>> {
        self.inner.wal()
    }
}

/// The tracker of `log` (one stream, 1) on a new bus, its endpoint refusing queries while
/// waiting answers hold `answer_byte_limit` bytes.
fn host_stalled(
    log: &Arc<StalledLog>,
    answer_byte_limit: usize,
) -> (Bus, coordbus::EndpointRef<BlockTrackerEndpoint>) {
    let tracker = ReceivedBlockTracker::with_log(
        BlockTrackerConfig::new([StreamId(1)]),
        Arc::new(SystemClock),
        Some(log.clone()),
    )
    .unwrap();
    let bus = Bus::builder().build().unwrap();
    let endpoint = BlockTrackerEndpoint::new(tracker).with_answer_byte_limit(answer_byte_limit);
    let endpoint = bus.register("stalled", endpoint).unwrap();
    (bus, endpoint)
}

/// A byte limit refuses only answers that would have to wait: with a limit of 0, an idle
/// endpoint still answers, and a query behind an undurable addition is refused.
#[test]
fn a_zero_byte_limit_refuses_only_answers_that_must_wait() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, 0);
    assert!(!endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND).unwrap());
    let addition = endpoint.ask(AddBlock(info(1, 1)));
    match endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND) {
        Err(AskError::Handler { source: cause, .. }) => assert_eq!(
            cause.downcast_ref::<BlockTrackerError>(),
            Some(&BlockTrackerError::AnswerBacklog { held_bytes: 0, limit: 0 })
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    drop(addition);
    let _ = bus.shutdown();
}

/// The answers waiting for durability are bounded in bytes, not only in count: one answer
/// may copy a queue of millions of blocks. Past the limit a query fails at once with a typed
/// error naming the bytes held; once the asker of the large answer gives up, queries are let
/// in again.
#[test]
fn the_answers_waiting_for_a_stalled_log_are_bounded_in_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let limit = 1000;
    let (bus, endpoint) = host_stalled(&log, limit);
    let blocks: Vec<_> = (0..100).map(|id| info(1, id)).collect();
    let held_bytes = std::mem::size_of_val(blocks.as_slice());
    assert!(held_bytes > limit);
    let additions = endpoint.ask(AddBlocks(blocks));
    let large = endpoint.ask(GetUnallocatedBlocks(StreamId(1)));
    match endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND) {
        Err(AskError::Handler { source: cause, .. }) => assert_eq!(
            cause.downcast_ref::<BlockTrackerError>(),
            Some(&BlockTrackerError::AnswerBacklog { held_bytes, limit })
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    drop(large);
    let small = endpoint.ask(HasUnallocatedBlocks);
    // Let in, it waits for durability like the additions, until the stop fails what waits
    // with its wait's timeout (nothing ever becomes durable here).
    bus.shutdown().unwrap();
    assert_failed_with_the_stops_timeout(small.wait_timeout(BOUND), 100);
    assert_eq!(additions.wait_timeout(BOUND).unwrap(), vec![false; 100]);
}

/// On a stuck disk, once an append timed out for room, later requests' appends are refused
/// without being tried (each try would hold the endpoint thread for the append timeout: N
/// separate additions held it N times over) until the log makes something more durable;
/// then appends are tried again.
#[test]
fn appends_after_one_timed_out_for_room_are_refused_untried_until_the_log_progresses() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let first = endpoint.ask(AddBlock(info(1, 0)));
    endpoint.ask(ConnectReceiver).wait_timeout(BOUND).unwrap();
    log.appends_stall.store(true, Ordering::SeqCst);
    let calls_before = log.append_calls.load(Ordering::SeqCst);
    for id in 1..4 {
        let added = endpoint.ask(AddBlock(info(1, id))).wait_timeout(BOUND).unwrap();
        assert!(!added, "block {id} was reported added on a stalled log");
    }
    let allocation = endpoint.ask(AllocateBlocksToBatch(BatchTime(1)));
    endpoint.ask(ConnectReceiver).wait_timeout(BOUND).unwrap();
    assert_eq!(
        log.append_calls.load(Ordering::SeqCst) - calls_before,
        1,
        "only the first append after the stall is tried"
    );
    log.appends_stall.store(false, Ordering::SeqCst);
    log.catch_up();
    assert!(first.wait_timeout(BOUND).unwrap(), "the addition before the stall is durable");
    allocation.wait_timeout(BOUND).unwrap();
    let after = endpoint.ask(AddBlock(info(1, 4)));
    endpoint.ask(ConnectReceiver).wait_timeout(BOUND).unwrap();
    assert_eq!(log.append_calls.load(Ordering::SeqCst) - calls_before, 2, "tried again");
    log.catch_up();
    assert!(after.wait_timeout(BOUND).unwrap(), "logged once the log made progress");
    let _ = bus.shutdown();
}

/// A request that logged nothing (here a stale allocation: the same batch time again) waits
/// behind the undurable requests before it, and if the WAL fails meanwhile it is answered
/// normally, as the logged allocation before it is (SPEC D.5): it reports no state. (It failed
/// with the WAL's error before.)
#[test]
fn a_stale_allocation_waiting_when_the_wal_fails_is_answered_normally() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let mut addition = endpoint.ask(AddBlock(info(1, 1)));
    let mut allocation = endpoint.ask(AllocateBlocksToBatch(BatchTime(1)));
    let mut stale = endpoint.ask(AllocateBlocksToBatch(BatchTime(1)));
    // A barrier: answered at once, after the requests above (one sender's order).
    endpoint.ask(ConnectReceiver).wait_timeout(BOUND).unwrap();
    assert!(addition.try_take().is_none(), "answered before durable");
    assert!(allocation.try_take().is_none(), "answered before durable");
    assert!(stale.try_take().is_none(), "answered before what precedes it was durable");
    log.report(&Err(WalError::Closed));
    assert!(!addition.wait_timeout(BOUND).unwrap(), "the WAL failed");
    allocation.wait_timeout(BOUND).unwrap();
    stale.wait_timeout(BOUND).unwrap();
    let _ = bus.shutdown();
}

/// `reply` failed with the stop's durability wait timing out on `lsn` (nothing durable).
fn assert_failed_with_the_stops_timeout<T: std::fmt::Debug>(reply: Result<T, AskError>, lsn: u64) {
    match reply {
        Err(AskError::Handler { source: cause, .. }) => assert!(
            matches!(
                cause.downcast_ref::<BlockTrackerError>(),
                Some(BlockTrackerError::Wal(WalError::Timeout { lsn: waited, durable: 0, .. }))
                    if *waited == lsn
            ),
            "{cause}"
        ),
        other => panic!("expected the stop's timeout on LSN {lsn}, got {other:?}"),
    }
}

/// `reply`, of a query behind a stop that timed out before the state was durable, is the
/// refusal that says so.
fn assert_refused_after_an_undurable_stop<T: std::fmt::Debug>(reply: Result<T, AskError>) {
    match reply {
        Err(AskError::Handler { source: cause, .. }) => assert!(
            matches!(
                cause.downcast_ref::<BlockTrackerError>(),
                Some(BlockTrackerError::StateLost { reason })
                    if reason.contains("stopped before its events were durable")
            ),
            "{cause}"
        ),
        other => panic!("a query behind the stop saw undurable state: {other:?}"),
    }
}

/// A `StopTracker` whose bounded wait ends with requests still waiting fails them (the
/// addition answers false, a waiting query fails with the wait's timeout, which names the LSN
/// waited for) without reading the log back: the tracker is stopping, and a rebuild would hold
/// the endpoint thread past the stop's documented bound. A query queued behind the stop is
/// refused: the state still holds the addition that never became durable.
#[test]
fn a_stop_that_times_out_fails_what_waits_without_a_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let addition = endpoint.ask(AddBlock(info(1, 1)));
    let waiting = endpoint.ask(HasUnallocatedBlocks);
    let stop = endpoint.ask(StopTracker);
    let behind = endpoint.ask(GetUnallocatedBlocks(StreamId(1)));
    stop.wait_timeout(BOUND).unwrap();
    assert!(!addition.wait_timeout(BOUND).unwrap(), "never durable");
    assert_failed_with_the_stops_timeout(waiting.wait_timeout(BOUND), 1);
    assert_refused_after_an_undurable_stop(behind.wait_timeout(BOUND));
    assert_eq!(log.replays.load(Ordering::SeqCst), 0, "the stop rebuilt the state");
    bus.shutdown().unwrap();
}

/// A stop whose close times out (the disk stopped answering) leaves a receiver's hand-over
/// queued behind it undurable for good: the query behind that is refused with a typed error,
/// not dropped unanswered (`NoReply`) when the endpoint stops.
#[test]
fn a_query_behind_a_hand_over_after_a_close_that_timed_out_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let receiver = BlockReceiver::connect(&endpoint).unwrap();
    let (close_entered, release_close) = log.hold_close();
    let stop = endpoint.ask(StopTracker);
    close_entered.recv_timeout(BOUND).unwrap();
    // The endpoint thread is in the close: the hand-over and the query queue behind the stop.
    let receipt = receiver.add_block(info(1, 1));
    let behind = endpoint.ask(GetUnallocatedBlocks(StreamId(1)));
    release_close.send(()).unwrap();
    stop.wait_timeout(BOUND).unwrap();
    assert_refused_after_an_undurable_stop(behind.wait_timeout(BOUND));
    drop(receipt);
    bus.shutdown().unwrap();
}

/// The same when nothing waits at the endpoint but a receiver's hand-over is not durable (the
/// receiver waits for its own receipt): a query behind the stop is refused, never answered
/// from that addition, nor from a log read back after the stop.
#[test]
fn a_stop_that_times_out_with_a_handed_over_addition_refuses_the_queries_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let receiver = BlockReceiver::connect(&endpoint).unwrap();
    let receipt = receiver.add_block(info(1, 1));
    // A barrier: this thread's hand-over is applied before the asks below (one sender's order).
    endpoint.ask(ConnectReceiver).wait_timeout(BOUND).unwrap();
    let stop = endpoint.ask(StopTracker);
    let behind = endpoint.ask(GetUnallocatedBlocks(StreamId(1)));
    stop.wait_timeout(BOUND).unwrap();
    assert_refused_after_an_undurable_stop(behind.wait_timeout(BOUND));
    assert_eq!(log.replays.load(Ordering::SeqCst), 0, "the stop rebuilt the state");
    drop(receipt);
    bus.shutdown().unwrap();
}

/// A WAL failure whose durable prefix cannot be read back leaves no state to answer from:
/// every query fails with a typed error naming the cause, instead of answering from the
/// part replayed before the error.
#[test]
fn a_rebuild_that_fails_makes_every_query_fail_with_state_lost() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), true);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let addition = endpoint.ask(AddBlock(info(1, 1)));
    log.report(&Err(WalError::Closed));
    assert!(!addition.wait_timeout(BOUND).unwrap(), "the WAL failed");
    let lost = BlockTrackerError::StateLost {
        reason: "its write-ahead log failed, and rebuilding the state from the log's durable \
                 prefix failed: a journal record is not a valid tracker event: unreadable \
                 journal"
            .into(),
    };
    let expect_lost = |reply: Result<(), AskError>| match reply {
        Err(AskError::Handler { source: cause, .. }) => {
            assert_eq!(cause.downcast_ref::<BlockTrackerError>(), Some(&lost));
        }
        other => panic!("expected the state to be lost, got {other:?}"),
    };
    expect_lost(endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND).map(drop));
    expect_lost(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait_timeout(BOUND).map(drop));
    expect_lost(endpoint.ask(GetBlocksOfBatch(BatchTime(1))).wait_timeout(BOUND).map(drop));
    expect_lost(
        endpoint
            .ask(GetBlocksOfBatchAndStream(BatchTime(1), StreamId(1)))
            .wait_timeout(BOUND)
            .map(drop),
    );
    expect_lost(endpoint.ask(GetUnconfiguredStreams).wait_timeout(BOUND).map(drop));
    // (Read after a reply the endpoint sent once its whole failure handling was done.)
    assert_eq!(log.replays.load(Ordering::SeqCst), 1);
    assert!(lost.to_string().contains("unreadable journal"), "{lost}");
    endpoint.ask(StopTracker).wait_timeout(BOUND).unwrap();
    bus.shutdown().unwrap();
}

/// `reply` is the refusal of a query past the bound, with `pending` queries waiting.
fn assert_refused(reply: Result<bool, AskError>, pending: usize) {
    match reply {
        Err(AskError::Handler { source: cause, .. }) => {
            assert_eq!(
                cause.downcast_ref::<BlockTrackerError>(),
                Some(&BlockTrackerError::DurabilityBacklog { pending, limit: MAX_PENDING_QUERIES })
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// While nothing becomes durable, queries wait (holding their answers) up to a bound; past it
/// they fail at once with a typed error instead of piling up. Queries whose askers gave up do
/// not count. An allocation that logs its record is never refused; a stale one (a no-op)
/// waits as a query and is refused as one past the bound, so repeating it cannot pile up.
#[test]
fn queries_behind_a_stalled_log_are_refused_past_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let mut addition = endpoint.ask(AddBlock(info(1, 1)));
    // Given up at once: these do not hold the bound.
    for _ in 0..MAX_PENDING_QUERIES {
        drop(endpoint.ask(HasUnallocatedBlocks));
    }
    let mut waiting: Vec<_> =
        (0..MAX_PENDING_QUERIES).map(|_| endpoint.ask(HasUnallocatedBlocks)).collect();
    assert_refused(endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND), MAX_PENDING_QUERIES);
    // A logged allocation is not a query: it waits for its record, past the bound too. A
    // stale one (the same time again: a no-op) is answered as a query: refused here.
    let mut allocation = endpoint.ask(AllocateBlocksToBatch(BatchTime(1)));
    let stale_allocation = endpoint.ask(AllocateBlocksToBatch(BatchTime(1))).wait_timeout(BOUND);
    match stale_allocation {
        Err(AskError::Handler { source: cause, .. }) => assert_eq!(
            cause.downcast_ref::<BlockTrackerError>(),
            Some(&BlockTrackerError::DurabilityBacklog {
                pending: MAX_PENDING_QUERIES,
                limit: MAX_PENDING_QUERIES
            })
        ),
        other => panic!("expected the stale allocation refused, got {other:?}"),
    }
    assert_refused(endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND), MAX_PENDING_QUERIES);
    // Everything within the bound still waits (one sender's requests keep their order, so
    // they were all handled before the refusals came back).
    assert!(addition.try_take().is_none(), "the addition was answered before durable");
    assert!(waiting.last_mut().unwrap().try_take().is_none());
    assert!(allocation.try_take().is_none(), "the allocation was answered before durable");
    drop(waiting);
    let _ = bus.shutdown();
}

/// Refused queries do not each rescan every waiting request for askers that gave up: after a
/// scan that freed nothing, the next scan comes after a sixteenth of the waiting requests'
/// count in refusals. So once the waiting askers give up, a query is let in again within that
/// many refusals, not at once, and not never.
#[test]
fn places_freed_by_askers_that_gave_up_are_found_within_a_bounded_number_of_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    let _addition = endpoint.ask(AddBlock(info(1, 1)));
    let waiting: Vec<_> =
        (0..MAX_PENDING_QUERIES).map(|_| endpoint.ask(HasUnallocatedBlocks)).collect();
    assert_refused(endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND), MAX_PENDING_QUERIES);
    drop(waiting);
    let skipped_scans = (MAX_PENDING_QUERIES + 1) / 16;
    let mut refusals = 0;
    let mut admitted = endpoint.ask(HasUnallocatedBlocks);
    // A barrier after each ask: a refusal has come back by then, an admitted query has not.
    while {
        endpoint.ask(ConnectReceiver).wait_timeout(BOUND).unwrap();
        admitted.try_take().is_some()
    } {
        refusals += 1;
        assert!(refusals <= skipped_scans, "still refused after {refusals} refusals");
        admitted = endpoint.ask(HasUnallocatedBlocks);
    }
    assert_eq!(refusals, skipped_scans, "each refusal rescanned the waiting requests");
    drop(admitted);
    let _ = bus.shutdown();
}

/// The refusals a scan lets go without scanning belong to one backlog: once a query is let in
/// below the bounds, the count is reset, so the first refusal of the next backlog scans for
/// askers that gave up (and lets the query in at once if they freed its place).
#[test]
fn the_first_refusal_of_a_new_backlog_scans_for_askers_that_gave_up() {
    let dir = tempfile::tempdir().unwrap();
    let log = StalledLog::new(dir.path(), false);
    let (bus, endpoint) = host_stalled(&log, DEFAULT_ANSWER_BYTE_LIMIT);
    // The first backlog: a refusal whose scan freed nothing lets the next 256 refusals skip it.
    let addition = endpoint.ask(AddBlock(info(1, 1)));
    let waiting: Vec<_> =
        (0..MAX_PENDING_QUERIES).map(|_| endpoint.ask(HasUnallocatedBlocks)).collect();
    assert_refused(endpoint.ask(HasUnallocatedBlocks).wait_timeout(BOUND), MAX_PENDING_QUERIES);
    // The disk catches up: everything waiting is answered, the backlog is over.
    log.catch_up();
    assert!(addition.wait_timeout(BOUND).unwrap(), "the addition is durable");
    for query in waiting {
        assert!(query.wait_timeout(BOUND).unwrap(), "the block is unallocated");
    }
    // The second backlog: the queries let in below the bounds, then all of them given up.
    let _stalled = endpoint.ask(AddBlock(info(1, 2)));
    let given_up: Vec<_> =
        (0..MAX_PENDING_QUERIES).map(|_| endpoint.ask(HasUnallocatedBlocks)).collect();
    drop(given_up);
    let mut admitted = endpoint.ask(HasUnallocatedBlocks);
    // A barrier: a refusal has come back by then, an admitted query (waiting for the stalled
    // addition) has not.
    endpoint.ask(ConnectReceiver).wait_timeout(BOUND).unwrap();
    assert!(admitted.try_take().is_none(), "refused: the new backlog did not scan at once");
    let _ = bus.shutdown();
}

#[test]
fn concurrent_receivers_are_acknowledged_only_once_durable_and_share_syncs() {
    const RECEIVERS: u64 = 6;
    const BLOCKS: u64 = 100;
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(RecordingLog {
        inner: WalBlockLog::open(dir.path().join("wal"), WalConfig::default()).unwrap(),
        lsns: Mutex::new(HashMap::new()),
    });
    let streams: Vec<StreamId> = (0..RECEIVERS as i32).map(StreamId).collect();
    let tracker = ReceivedBlockTracker::with_log(
        BlockTrackerConfig::new(streams.clone()),
        Arc::new(SystemClock),
        Some(log.clone()),
    )
    .unwrap();
    let bus = Bus::builder().inbox_shards(4).build().unwrap();
    let endpoint =
        bus.register("ReceivedBlockTracker", BlockTrackerEndpoint::new(tracker)).unwrap();

    std::thread::scope(|scope| {
        for receiver in 0..RECEIVERS {
            let (endpoint, log) = (endpoint.clone(), log.clone());
            scope.spawn(move || {
                for unique_id in 0..BLOCKS {
                    let block = info(receiver as i32, unique_id);
                    let id = block.block_id();
                    assert!(endpoint.ask(AddBlock(block)).wait().unwrap());
                    let lsn = log.lsns.lock().unwrap()[&id];
                    assert!(log.durable_lsn() >= lsn, "acknowledged before durable: {id}");
                }
            });
        }
        // One receiver pipelining its additions: acknowledged, in order, all durable.
        let (endpoint, log) = (endpoint.clone(), log.clone());
        scope.spawn(move || {
            let replies: Vec<_> = (0..64)
                .map(|unique_id| endpoint.ask(AddBlock(info(0, 1_000 + unique_id))))
                .collect();
            for (unique_id, reply) in (0..64).zip(replies) {
                assert!(reply.wait().unwrap());
                let lsn = log.lsns.lock().unwrap()[&info(0, 1_000 + unique_id).block_id()];
                assert!(log.durable_lsn() >= lsn);
            }
        });
    });

    let additions = RECEIVERS * BLOCKS + 64;
    let stats = log.wal().unwrap().stats();
    assert!(stats.syncs < additions, "{} syncs for {additions} additions", stats.syncs);

    endpoint.ask(AllocateBlocksToBatch(BatchTime(1))).wait().unwrap();
    let batch = endpoint.ask(GetBlocksOfBatch(BatchTime(1))).wait().unwrap();
    assert_eq!(batch.block_count() as u64, additions);
    for stream in &streams {
        let blocks = batch.blocks_of_stream(*stream);
        let expected = if stream.0 == 0 { BLOCKS + 64 } else { BLOCKS };
        assert_eq!(blocks.len() as u64, expected);
    }
    assert!(!endpoint.ask(HasUnallocatedBlocks).wait().unwrap());
    endpoint.ask(StopTracker).wait().unwrap();
    bus.shutdown().unwrap();
}

#[test]
fn the_endpoint_lists_streams_whose_blocks_are_never_allocated() {
    let clock = Arc::new(ManualClock::new(10_000));
    let bus = Bus::builder().build().unwrap();
    let tracker =
        ReceivedBlockTracker::open(BlockTrackerConfig::new([StreamId(1)]), clock).unwrap();
    let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();
    assert!(endpoint.ask(AddBlock(info(1, 1))).wait().unwrap());
    assert_eq!(endpoint.ask(GetUnconfiguredStreams).wait().unwrap(), []);
    assert!(endpoint.ask(AddBlock(info(9, 2))).wait().unwrap());
    endpoint.ask(AllocateBlocksToBatch(BatchTime(1_000))).wait().unwrap();
    assert_eq!(endpoint.ask(GetUnconfiguredStreams).wait().unwrap(), [StreamId(9)]);
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(9))).wait().unwrap(), [info(9, 2)]);
    bus.shutdown().unwrap();
}

#[test]
fn endpoint_operations_are_durable_and_survive_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(10_000));
    let mut config = BlockTrackerConfig::new([StreamId(1), StreamId(2)]).checkpoint_dir(dir.path());
    config.wal.segment_size_bytes = 4 << 20;
    let bus = Bus::builder().build().unwrap();
    let tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();

    let first: Vec<_> = (0..4).map(|id| info(1 + (id % 2) as i32, id)).collect();
    for block in &first {
        assert!(endpoint.ask(AddBlock(block.clone())).wait().unwrap());
    }
    assert!(endpoint.ask(HasUnallocatedBlocks).wait().unwrap());
    assert_eq!(
        endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(),
        [first[0].clone(), first[2].clone()]
    );
    endpoint.ask(AllocateBlocksToBatch(BatchTime(1_000))).wait().unwrap();
    // A stale time is a no-op.
    endpoint.ask(AllocateBlocksToBatch(BatchTime(1_000))).wait().unwrap();
    assert_eq!(
        endpoint.ask(GetBlocksOfBatchAndStream(BatchTime(1_000), StreamId(2))).wait().unwrap(),
        [first[1].clone(), first[3].clone()]
    );
    let late = info(2, 99);
    assert!(endpoint.ask(AddBlock(late.clone())).wait().unwrap());
    clock.advance_ms(1_000);
    endpoint.ask(AllocateBlocksToBatch(BatchTime(2_000))).wait().unwrap();

    let error = endpoint
        .ask(CleanupOldBatches { threshold: BatchTime(11_000), wait: true })
        .wait()
        .unwrap_err();
    match error {
        AskError::Handler { source: cause, .. } => assert_eq!(
            cause.downcast_ref::<BlockTrackerError>(),
            Some(&BlockTrackerError::ThresholdNotInPast { threshold_ms: 11_000, now_ms: 11_000 })
        ),
        other => panic!("expected a handler error, got {other:?}"),
    }
    endpoint.ask(CleanupOldBatches { threshold: BatchTime(1_500), wait: true }).wait().unwrap();
    assert!(endpoint.ask(GetBlocksOfBatch(BatchTime(1_000))).wait().unwrap().is_empty());
    endpoint.ask(StopTracker).wait().unwrap();
    assert!(endpoint.is_stopped());
    bus.shutdown().unwrap();

    let recovered = ReceivedBlockTracker::open(config.recover(true), clock).unwrap();
    assert!(recovered.blocks_of_batch(BatchTime(1_000)).is_empty());
    assert_eq!(recovered.blocks_of_batch_and_stream(BatchTime(2_000), StreamId(2)), [late]);
    assert!(!recovered.has_unallocated_blocks());
    assert_eq!(recovered.last_allocated_batch_time(), Some(BatchTime(2_000)));
}

/// Real files whose `fdatasync` fails once `fail_sync` is set.
#[derive(Debug)]
struct FlakyStorage {
    inner: FileStorage,
    fail_sync: Arc<AtomicBool>,
}

#[derive(Debug)]
struct FlakyFile {
    inner: Arc<dyn StorageFile>,
    fail_sync: Arc<AtomicBool>,
}

impl Storage for FlakyStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.inner.create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let inner = self.inner.create(path)?;
        Ok(Arc::new(FlakyFile { inner, fail_sync: self.fail_sync.clone() }))
    }
    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let inner = self.inner.open_existing(path)?;
        Ok(Arc::new(FlakyFile { inner, fail_sync: self.fail_sync.clone() }))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.inner.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.inner.sync_dir(dir)
    }
}

impl StorageFile for FlakyFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.inner.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        if self.fail_sync.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc_eio()));
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

/// EIO on Linux.
fn libc_eio() -> i32 {
    5
}

#[test]
fn a_failed_sync_fails_waiting_additions_and_rolls_back_to_the_durable_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let fail_sync = Arc::new(AtomicBool::new(false));
    let storage = Arc::new(FlakyStorage { inner: FileStorage, fail_sync: fail_sync.clone() });
    let wal = Wal::open_with_options(
        dir.path().join(RECEIVED_BLOCK_METADATA_DIR),
        WalConfig::default(),
        WalOptions { io: IoMode::Pwrite, storage, ..WalOptions::default() },
    )
    .unwrap();
    let log: Arc<dyn BlockLog> = Arc::new(WalBlockLog::from_wal(Arc::new(wal)));
    let tracker = ReceivedBlockTracker::with_log(
        BlockTrackerConfig::new([StreamId(1)]),
        Arc::new(SystemClock),
        Some(log),
    )
    .unwrap();
    let bus = Bus::builder().build().unwrap();
    let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();

    let durable = info(1, 1);
    assert!(endpoint.ask(AddBlock(durable.clone())).wait().unwrap());
    fail_sync.store(true, Ordering::SeqCst);
    assert!(!endpoint.ask(AddBlock(info(1, 2))).wait().unwrap(), "the sync failed");
    // The state fell back to what is durable; the failed log accepts no more writes.
    assert_eq!(
        endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(),
        std::slice::from_ref(&durable)
    );
    let queued = endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap();
    assert!(queued[0].is_block_id_valid(), "added in this run: the executor still holds it");
    assert!(!endpoint.ask(AddBlock(info(1, 3))).wait().unwrap());
    endpoint.ask(AllocateBlocksToBatch(BatchTime(1))).wait().unwrap();
    assert!(endpoint.ask(GetBlocksOfBatch(BatchTime(1))).wait().unwrap().is_empty());
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(), [durable]);
    endpoint.ask(StopTracker).wait().unwrap();
    bus.shutdown().unwrap();
}

#[test]
fn add_blocks_logs_each_block_and_answers_once_the_last_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(RecordingLog {
        inner: WalBlockLog::open(dir.path().join("wal"), WalConfig::default()).unwrap(),
        lsns: Mutex::new(HashMap::new()),
    });
    let tracker = ReceivedBlockTracker::with_log(
        BlockTrackerConfig::new([StreamId(1)]),
        Arc::new(SystemClock),
        Some(log.clone()),
    )
    .unwrap();
    let bus = Bus::builder().build().unwrap();
    let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();
    let blocks: Vec<_> = (0..50).map(|id| info(1, id)).collect();
    let logged = endpoint.ask(AddBlocks(blocks.clone())).wait().unwrap();
    assert_eq!(logged, vec![true; 50]);
    let lsns = log.lsns.lock().unwrap().clone();
    assert_eq!(lsns.len(), 50, "one record per block");
    let durable = log.durable_lsn();
    assert!(lsns.values().all(|lsn| *lsn <= durable));
    assert_eq!(endpoint.ask(GetUnallocatedBlocks(StreamId(1))).wait().unwrap(), blocks);
    endpoint.ask(StopTracker).wait().unwrap();
    // After the stop the log is closed: nothing more is logged.
    bus.shutdown().unwrap();
}
