//! Goal (issue 4): small payloads (a few machine words) cost no allocation per message on the
//! whole path an engine uses, `send` through the bus into the coordinator endpoint, not only in
//! the state machine (`tests/epoch_allocations.rs`).
//!
//! Method: this test binary's global allocator counts every allocation of every thread (the
//! sender, the endpoint's thread, the bus's), while it is switched on. The binary holds this
//! one test, so no other test allocates meanwhile. A steady run of 8-byte offsets and commit
//! messages is counted against a run whose commit messages are too large to be inline, so a
//! counter that saw nothing would fail the test.
//!
//! `unsafe` here: the counting allocator's `GlobalAlloc` impl, which forwards every call to
//! `System` (`allocation-counter`, used by the state-machine test, counts one thread only).
#![allow(unsafe_code)]

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::Duration,
};

use coordbus::{
    coordinators::epoch::{
        coordinator_name, CommitPartitionEpoch, EpochConfig, EpochEndpoint, GetCurrentEpoch,
        GetEpochStats, NoopQuery, NoopSink, Payload, ReportPartitionOffset, SetReaderPartitions,
        SetWriterPartitions,
    },
    Bus, EndpointRef,
};

/// The system allocator, counting allocations while `COUNTING` is on.
struct CountingAllocator;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to `System`, which upholds `GlobalAlloc`'s
// contract; the counters are atomics and never allocate.
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
        // SAFETY: `ptr` was allocated by this allocator, hence by `System`, with `layout`.
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
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

type Coordinator = EpochEndpoint<NoopQuery, NoopSink>;

/// Sends epochs `epochs` (an offset report and a writer commit per partition, with `message`
/// as the commit message) one message at a time, then waits for them to be handled (the ask
/// is a barrier for this sender, SPEC A.4) and checks that the last one committed.
fn run(
    coordinator: &EndpointRef<Coordinator>,
    epochs: std::ops::RangeInclusive<i64>,
    message: impl Fn(i64) -> Payload,
) {
    let last = *epochs.end();
    for epoch in epochs {
        for partition in 0..PARTITIONS {
            let offset = Payload::from(epoch * 1000 + i64::from(partition));
            coordinator.send(ReportPartitionOffset { partition, epoch, offset }).unwrap();
            let message = message(epoch);
            coordinator.send(CommitPartitionEpoch { partition, epoch, message }).unwrap();
        }
    }
    coordinator.ask(GetCurrentEpoch).wait_timeout(REPLY_TIMEOUT).unwrap();
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
    let endpoint = EpochEndpoint::new(EpochConfig::new(1), NoopQuery, NoopSink).unwrap();
    let coordinator = bus.register(coordinator_name("allocations"), endpoint).unwrap();
    coordinator.ask(SetReaderPartitions(PARTITIONS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    coordinator.ask(SetWriterPartitions(PARTITIONS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    let small = |epoch: i64| Payload::from(epoch);
    // Warm up: the inbox lanes, the buckets and the epoch map reach their working size.
    run(&coordinator, 1..=40, small);

    let steady = allocations_during(|| run(&coordinator, 41..=240, small));
    let messages = 200 * 2 * u64::from(PARTITIONS.unsigned_abs());
    // The two barrier asks at the end may allocate a little; the messages must not.
    assert!(steady <= 16, "{messages} messages of 8 bytes made {steady} allocations");

    // The counter sees the endpoint's thread: 40-byte commit messages spill to the heap.
    let large = |epoch: i64| Payload::from(vec![epoch as u8; 40]);
    let spilled = allocations_during(|| run(&coordinator, 241..=250, large));
    assert!(spilled >= 10 * u64::from(PARTITIONS.unsigned_abs()), "only {spilled} allocations");
    bus.shutdown().unwrap();
}
