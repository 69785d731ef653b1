//! Received-block tracker benchmarks.
//!
//! * `blocks/add_durable`: `AddBlock` asks through the bus endpoint, 1 receiver thread with
//!   256 asks in flight; an addition counts when its reply says it is durable (group commit).
//! * `blocks/add_receiver`: the same through a `BlockReceiver` (the receiver thread logs, the
//!   endpoint only applies), 256 additions in flight.
//! * `blocks/add_state_machine`: the same additions appended straight through the plain
//!   tracker (`add_block_deferred`), made durable once at the end: the cost without the bus.
//! * baseline `blocks/add_mutex_file_sync`: the plain way with the same durability, in the
//!   same group: one thread pushes each block into a `Mutex<VecDeque>` and appends its encoded
//!   event to a plain file, with one `fdatasync` per 256 additions (the same window).
//! * `blocks/recover_100k`: constructing a tracker with recovery over 100 000 logged
//!   additions (the WAL scan plus the replay). Baseline `blocks/recover_100k_plain_file`:
//!   reading a plain file of the same 100 000 length-prefixed encoded events and decoding each
//!   into a queue (no framing, checksums or segments).
//! * `blocks/event_codec`: serializing and decoding (validated) one addition event in the
//!   journal's compact layout. Baseline `blocks/event_codec_rkyv`: the same block as an rkyv
//!   archive (serialize, then validated access), the general-purpose zero-copy format.
//!
//! Smoke-run with `cargo bench --bench block_tracker -- --quick` (or `--test`).

// criterion_group! and criterion_main! generate undocumented functions.
#![allow(missing_docs)]

use std::{
    collections::VecDeque,
    io::Write,
    sync::Arc,
    time::{Duration, Instant},
};

use coordbus::{
    clock::SystemClock,
    coordinators::block_tracker::{
        AddBlock, AddReceipt, BlockAdditionEvent, BlockReceiver, BlockStoreResult,
        BlockTrackerConfig, BlockTrackerEndpoint, Logged, ReceivedBlockInfo, ReceivedBlockTracker,
        StopTracker, StreamBlockId, StreamId, TrackerEvent,
    },
    Bus,
};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn block(unique_id: u64) -> ReceivedBlockInfo {
    let stream = StreamId((unique_id % 2) as i32);
    let block_id = StreamBlockId { stream, unique_id };
    ReceivedBlockInfo::new(stream, Some(100), None, BlockStoreResult::BlockManager { block_id })
        .unwrap()
}

fn config(dir: &std::path::Path) -> BlockTrackerConfig {
    BlockTrackerConfig::new([StreamId(0), StreamId(1)]).checkpoint_dir(dir)
}

fn add(c: &mut Criterion) {
    let mut group = c.benchmark_group("blocks");
    group.throughput(Throughput::Elements(1));
    group.bench_function("add_durable", |b| {
        b.iter_custom(|iters| {
            let dir = tempfile::tempdir().unwrap();
            let tracker =
                ReceivedBlockTracker::open(config(dir.path()), Arc::new(SystemClock)).unwrap();
            let bus = Bus::builder().build().unwrap();
            let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();
            let mut outstanding = VecDeque::with_capacity(256);
            let started = Instant::now();
            for unique_id in 0..iters {
                if outstanding.len() == 256 {
                    let reply: coordbus::Reply<bool> = outstanding.pop_front().unwrap();
                    assert!(reply.wait().unwrap());
                }
                outstanding.push_back(endpoint.ask(AddBlock(block(unique_id))));
            }
            for reply in outstanding {
                assert!(reply.wait().unwrap());
            }
            let elapsed = started.elapsed();
            endpoint.ask(StopTracker).wait().unwrap();
            bus.shutdown().unwrap();
            elapsed
        });
    });
    group.bench_function("add_receiver", |b| {
        b.iter_custom(|iters| {
            let dir = tempfile::tempdir().unwrap();
            let tracker =
                ReceivedBlockTracker::open(config(dir.path()), Arc::new(SystemClock)).unwrap();
            let bus = Bus::builder().build().unwrap();
            let endpoint = bus.register("tracker", BlockTrackerEndpoint::new(tracker)).unwrap();
            let receiver = BlockReceiver::connect(&endpoint).unwrap();
            let mut outstanding = VecDeque::with_capacity(256);
            let started = Instant::now();
            for unique_id in 0..iters {
                if outstanding.len() == 256 {
                    let receipt: AddReceipt<'_> = outstanding.pop_front().unwrap();
                    assert!(receipt.wait());
                }
                outstanding.push_back(receiver.add_block(block(unique_id)));
            }
            for receipt in outstanding {
                assert!(receipt.wait());
            }
            let elapsed = started.elapsed();
            endpoint.ask(StopTracker).wait().unwrap();
            bus.shutdown().unwrap();
            elapsed
        });
    });
    group.bench_function("add_mutex_file_sync", |b| {
        b.iter_custom(|iters| {
            let dir = tempfile::tempdir().unwrap();
            let mut file = std::fs::File::create(dir.path().join("plain.log")).unwrap();
            let queue = std::sync::Mutex::new(VecDeque::new());
            let started = Instant::now();
            for unique_id in 0..iters {
                let info = block(unique_id);
                let event = TrackerEvent::BlockAddition(BlockAdditionEvent { info: info.clone() });
                file.write_all(&event.encode().unwrap()).unwrap();
                queue.lock().unwrap().push_back(info);
                if unique_id % 256 == 255 {
                    file.sync_data().unwrap();
                }
            }
            file.sync_data().unwrap();
            started.elapsed()
        });
    });
    group.bench_function("add_state_machine", |b| {
        b.iter_custom(|iters| {
            let dir = tempfile::tempdir().unwrap();
            let mut tracker =
                ReceivedBlockTracker::open(config(dir.path()), Arc::new(SystemClock)).unwrap();
            let started = Instant::now();
            let mut last = None;
            for unique_id in 0..iters {
                if let Logged::Pending(lsn) = tracker.add_block_deferred(block(unique_id)) {
                    last = Some(lsn);
                }
            }
            if let (Some(lsn), Some(log)) = (last, tracker.log()) {
                log.wait_durable(lsn, Duration::from_secs(30)).unwrap();
            }
            let elapsed = started.elapsed();
            tracker.stop().unwrap();
            elapsed
        });
    });
    group.finish();
}

fn recover(c: &mut Criterion) {
    const EVENTS: u64 = 100_000;
    let dir = tempfile::tempdir().unwrap();
    {
        let mut tracker =
            ReceivedBlockTracker::open(config(dir.path()), Arc::new(SystemClock)).unwrap();
        let mut last = None;
        for unique_id in 0..EVENTS {
            if let Logged::Pending(lsn) = tracker.add_block_deferred(block(unique_id)) {
                last = Some(lsn);
            }
        }
        tracker.log().unwrap().wait_durable(last.unwrap(), Duration::from_secs(30)).unwrap();
        tracker.stop().unwrap();
    }
    let mut group = c.benchmark_group("blocks");
    group.throughput(Throughput::Elements(EVENTS));
    group.sample_size(10);
    group.bench_function("recover_100k", |b| {
        b.iter_batched(
            || config(dir.path()).recover(true),
            |config| {
                let tracker = ReceivedBlockTracker::open(config, Arc::new(SystemClock)).unwrap();
                assert_eq!(tracker.recovered_events(), EVENTS);
                tracker
            },
            BatchSize::PerIteration,
        );
    });
    let plain = dir.path().join("plain-events.bin");
    {
        // Each event behind its length, both 16-byte aligned in the file (the rkyv records need
        // that alignment to decode, as the WAL's memory map gives them).
        let mut bytes = Vec::new();
        for unique_id in 0..EVENTS {
            let event = TrackerEvent::BlockAddition(BlockAdditionEvent { info: block(unique_id) });
            let encoded = event.encode().unwrap();
            bytes.extend_from_slice(&u32::try_from(encoded.len()).unwrap().to_le_bytes());
            bytes.resize(bytes.len().next_multiple_of(16), 0);
            bytes.extend_from_slice(&encoded);
            bytes.resize(bytes.len().next_multiple_of(16), 0);
        }
        std::fs::write(&plain, bytes).unwrap();
    }
    // As ours: the state returned, so its drop is not timed.
    group.bench_function("recover_100k_plain_file", |b| {
        b.iter_batched(
            || (),
            |()| {
                // Read into 16-byte aligned memory, then decoded in place.
                let mut bytes = rkyv::util::AlignedVec::<16>::new();
                let mut file = std::fs::File::open(&plain).unwrap();
                bytes.extend_from_reader(&mut file).unwrap();
                let mut queue = VecDeque::new();
                let mut at = 0;
                while at < bytes.len() {
                    let length = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
                    let start = at + 16;
                    let end = start + length as usize;
                    queue.push_back(TrackerEvent::decode(&bytes[start..end]).unwrap());
                    at = end.next_multiple_of(16);
                }
                assert_eq!(queue.len() as u64, EVENTS);
                queue
            },
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

fn codec(c: &mut Criterion) {
    let event = TrackerEvent::BlockAddition(BlockAdditionEvent { info: block(42) });
    let mut group = c.benchmark_group("blocks");
    group.throughput(Throughput::Elements(1));
    group.bench_function("event_codec", |b| {
        b.iter(|| {
            let bytes = std::hint::black_box(&event).encode().unwrap();
            TrackerEvent::decode(&bytes).unwrap()
        });
    });
    let info = block(42);
    group.bench_function("event_codec_rkyv", |b| {
        b.iter(|| {
            let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(std::hint::black_box(&info)).unwrap();
            let archived =
                rkyv::access::<rkyv::Archived<ReceivedBlockInfo>, rkyv::rancor::Error>(&bytes)
                    .unwrap();
            rkyv::deserialize::<ReceivedBlockInfo, rkyv::rancor::Error>(archived).unwrap()
        });
    });
    group.finish();
}

criterion_group!(benches, add, recover, codec);
criterion_main!(benches);
