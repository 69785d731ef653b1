//! Goal (issue 4): small payloads (a few machine words) cost no allocation per message on the
//! whole path an engine uses, `send` through the bus into the coordinator endpoint, not only in
//! the state machine (`tests/epoch_allocations.rs`).
//!
//! Method: this test binary's global allocator counts every allocation of every thread (the
//! sender, the endpoint's thread, the bus's), while it is switched on. The binary holds this
//! one test, so no other test allocates meanwhile. The messages go in chunks that fit the
//! sender's inbox lane, each ended by a barrier ask (reply slots are cached per thread), so
//! the sender never waits for room (a wait is not per message, but it allocates its waiter).
//! A steady run of 8-byte offsets and commit messages is counted against a run whose sink
//! copies each epoch's messages on the endpoint's thread, so a counter that did not see that
//! thread would fail the test.
//!
//! `unsafe` here: the counting allocator's `GlobalAlloc` impl, which forwards every call to
//! `System` (`allocation-counter`, used by the state-machine test, counts one thread only).

use std::{
    alloc::{GlobalAlloc, Layout, System},
    hint::black_box,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::Duration,
};

use coordbus::{
    coordinators::epoch::{
        coordinator_name, CollaboratorError, CommitPartitionEpoch, Epoch, EpochConfig,
        EpochEndpoint, GetCurrentEpoch, GetEpochStats, NoopQuery, PartitionId, Payload,
        ReportPartitionOffset, SetReaderPartitions, SetWriterPartitions, Sink,
    },
    Bus, EndpointRef,
};

/// The system allocator, counting allocations while `COUNTING` is on.
struct CountingAllocator;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to `System`, which upholds `GlobalAlloc`'s
// contract; the counters are atomics and never allocate.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's `layout` obligations are passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: `ptr` was allocated by this allocator, hence by `System`, with `layout`;
        // the caller's duties for `new_size` (non-zero, no overflow when rounded up to
        // `layout.align()`) are passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator, hence by `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn count() {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const PARTITIONS: i32 = 100;
/// Epochs sent between two barriers: 4000 messages, a quarter of an inbox lane (16 Ki).
const CHUNK_EPOCHS: i64 = 20;
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// While set, [`CopyingSink`] copies each epoch's messages (an allocation on the endpoint's
/// thread per committed epoch).
static SINK_COPIES: AtomicBool = AtomicBool::new(false);

/// A sink that keeps nothing, and copies what it commits while [`SINK_COPIES`] is set.
struct CopyingSink;

impl Sink for CopyingSink {
    fn commit(
        &mut self,
        _: Epoch,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError> {
        if SINK_COPIES.load(Ordering::SeqCst) {
            black_box(messages.to_vec());
        }
        Ok(())
    }
}

type Coordinator = EpochEndpoint<NoopQuery, CopyingSink>;

/// Sends epochs `epochs` (an offset report and a writer commit per partition, 8-byte payloads)
/// one message at a time, in chunks each followed by a barrier ask (SPEC A.4), and checks that
/// the last epoch committed.
fn run(coordinator: &EndpointRef<Coordinator>, epochs: std::ops::RangeInclusive<i64>) {
    let last = *epochs.end();
    for epoch in epochs {
        for partition in 0..PARTITIONS {
            let offset = Payload::from(epoch * 1000 + i64::from(partition));
            coordinator.send(ReportPartitionOffset { partition, epoch, offset }).unwrap();
            let message = Payload::from(epoch);
            coordinator.send(CommitPartitionEpoch { partition, epoch, message }).unwrap();
        }
        if epoch % CHUNK_EPOCHS == 0 || epoch == last {
            coordinator.ask(GetCurrentEpoch).wait_timeout(REPLY_TIMEOUT).unwrap();
        }
    }
    let stats = coordinator.ask(GetEpochStats).wait_timeout(REPLY_TIMEOUT).unwrap();
    assert_eq!(stats.last_committed.0, last, "every epoch committed: {stats:?}");
}

/// Allocations made by every thread while `body` runs.
fn allocations_during(body: impl FnOnce()) -> u64 {
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    body();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::SeqCst)
}

#[test]
fn small_payloads_sent_through_the_bus_cost_no_allocation_per_message() {
    let bus = Bus::builder().inbox_shards(2).build().unwrap();
    let endpoint = EpochEndpoint::new(EpochConfig::new(1), NoopQuery, CopyingSink).unwrap();
    let coordinator = bus.register(coordinator_name("allocations"), endpoint).unwrap();
    coordinator.ask(SetReaderPartitions(PARTITIONS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    coordinator.ask(SetWriterPartitions(PARTITIONS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    // Warm up: the inbox lanes, the buckets and the epoch map reach their working size.
    run(&coordinator, 1..=40);

    let steady = allocations_during(|| run(&coordinator, 41..=240));
    let messages = 200 * 2 * u64::from(PARTITIONS.unsigned_abs());
    // The asks may allocate a little; the messages must not.
    assert!(steady <= 16, "{messages} messages of 8 bytes made {steady} allocations");

    // The counter sees the endpoint's thread: the sink copies each committed epoch there.
    SINK_COPIES.store(true, Ordering::SeqCst);
    let copied = allocations_during(|| run(&coordinator, 241..=290));
    SINK_COPIES.store(false, Ordering::SeqCst);
    assert!(copied >= 50, "50 epochs copied by the sink, only {copied} allocations counted");
    bus.shutdown().unwrap();
}
