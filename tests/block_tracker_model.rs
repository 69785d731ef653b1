//! The tracker against a simple model, across restarts (property test).
//!
//! Goal: for any sequence of additions (on configured and unconfigured streams), allocations
//! (new, stale or repeated batch times), cleanups and restarts with recovery, the tracker's
//! observable state equals a plain model's, and recovery rebuilds exactly the state before the
//! restart (SPEC D.3, D.4).
//!
//! Method: proptest generates the operations (fixed seed, few cases, short sequences); each case
//! runs against a real WAL in a temporary directory with a manual clock.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use coordbus::{
    clock::ManualClock,
    coordinators::block_tracker::{
        BatchTime, BlockStoreResult, BlockTrackerConfig, ReceivedBlockInfo, ReceivedBlockTracker,
        StreamBlockId, StreamId,
    },
    wal::{Durability, WalConfig},
};
use proptest::prelude::*;

/// Streams 0 and 1 are configured; stream 2 is not (its blocks are queued, never allocated).
const CONFIGURED: [StreamId; 2] = [StreamId(0), StreamId(1)];
const ALL_STREAMS: [StreamId; 3] = [StreamId(0), StreamId(1), StreamId(2)];

#[derive(Debug, Clone)]
enum Op {
    Add(i32),
    /// Allocate at `last + delta` (a delta <= 0 is a stale time).
    Allocate(i64),
    /// Clean up below the n-th allocated batch (or below 1 if none).
    Cleanup(usize),
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..3i32).prop_map(Op::Add),
        3 => (-1..3i64).prop_map(Op::Allocate),
        1 => (0..4usize).prop_map(Op::Cleanup),
        1 => Just(Op::Restart),
    ]
}

#[derive(Debug, Default, PartialEq)]
struct Model {
    unallocated: BTreeMap<i32, Vec<u64>>,
    allocated: BTreeMap<i64, BTreeMap<i32, Vec<u64>>>,
    last: Option<i64>,
}

fn observe(tracker: &ReceivedBlockTracker) -> Model {
    let ids = |blocks: &[ReceivedBlockInfo]| -> Vec<u64> {
        blocks.iter().map(|info| info.block_id().unique_id).collect()
    };
    let mut model =
        Model { last: tracker.last_allocated_batch_time().map(|t| t.0), ..Model::default() };
    for stream in ALL_STREAMS {
        let blocks = tracker.unallocated_blocks(stream);
        if !blocks.is_empty() {
            model.unallocated.insert(stream.0, ids(&blocks));
        }
    }
    for time in tracker.allocated_batch_times() {
        let batch = tracker.blocks_of_batch(time);
        let streams =
            batch.streams().iter().map(|entry| (entry.stream_id.0, ids(&entry.blocks))).collect();
        model.allocated.insert(time.0, streams);
    }
    model
}

fn info(stream: i32, unique_id: u64) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
    ReceivedBlockInfo::new(StreamId(stream), Some(1), Some(vec![stream as u8]), {
        BlockStoreResult::BlockManager { block_id }
    })
    .unwrap()
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let config =
        BlockTrackerConfig::new(CONFIGURED).checkpoint_dir(dir.path()).wal_config(WalConfig {
            segment_size_bytes: 1 << 20,
            durability: Durability::None,
            rolling_interval: Some(Duration::from_secs(1)),
            ..WalConfig::default()
        });
    let mut tracker = ReceivedBlockTracker::open(config.clone(), clock.clone()).unwrap();
    let mut model = Model::default();
    let mut next_id = 0u64;
    for op in ops {
        clock.advance_ms(700);
        match op {
            Op::Add(stream) => {
                next_id += 1;
                prop_assert!(tracker.add_block(info(*stream, next_id)));
                model.unallocated.entry(*stream).or_default().push(next_id);
            }
            Op::Allocate(delta) => {
                let time = model.last.unwrap_or(0) + delta;
                tracker.allocate_blocks_to_batch(BatchTime(time)).unwrap();
                if model.last.is_none_or(|last| time > last) {
                    let batch = CONFIGURED
                        .iter()
                        .map(|stream| {
                            (stream.0, model.unallocated.remove(&stream.0).unwrap_or_default())
                        })
                        .collect();
                    model.allocated.insert(time, batch);
                    model.last = Some(time);
                }
            }
            Op::Cleanup(index) => {
                let threshold = model.allocated.keys().nth(*index).copied().unwrap_or(1);
                tracker.cleanup_old_batches(BatchTime(threshold), true).unwrap();
                model.allocated.retain(|time, _| *time >= threshold);
            }
            Op::Restart => {
                tracker.stop().unwrap();
                drop(tracker);
                tracker = ReceivedBlockTracker::open(config.clone().recover(true), clock.clone())
                    .unwrap();
                let all_invalid = ALL_STREAMS.iter().all(|stream| {
                    tracker.unallocated_blocks(*stream).iter().all(|b| !b.is_block_id_valid())
                });
                prop_assert!(all_invalid, "recovered blocks are marked invalid");
            }
        }
        prop_assert_eq!(observe(&tracker), observe_model(&model));
    }
    Ok(())
}

/// The model as the tracker reports it (empty queues are not listed).
fn observe_model(model: &Model) -> Model {
    Model {
        unallocated: model
            .unallocated
            .iter()
            .filter(|(_, ids)| !ids.is_empty())
            .map(|(stream, ids)| (*stream, ids.clone()))
            .collect(),
        allocated: model.allocated.clone(),
        last: model.last,
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0xb10c_5eed),
        ..ProptestConfig::default()
    })]

    #[test]
    fn tracker_matches_the_model_across_restarts(ops in prop::collection::vec(op(), 1..40)) {
        run(&ops)?;
    }
}
