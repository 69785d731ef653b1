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
    clock::{Clock, ManualClock},
    coordinators::block_tracker::{
        BatchTime, BlockStoreResult, BlockTrackerConfig, ReceivedBlockInfo, ReceivedBlockTracker,
        StreamBlockId, StreamId, RECEIVED_BLOCK_METADATA_DIR,
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
    /// Clean up below the n-th allocated batch (`BatchTimes` says from which end; if none,
    /// below the first time possible).
    Cleanup(usize),
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    ops_on(0..3)
}

/// Operations adding blocks to the streams in `streams` only.
fn ops_on(streams: std::ops::Range<i32>) -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => streams.prop_map(Op::Add),
        3 => (-1..3i64).prop_map(Op::Allocate),
        1 => (0..4usize).prop_map(Op::Cleanup),
        1 => Just(Op::Restart),
    ]
}

/// Where batch times are: far below the clock (cleanups delete no file), or on its scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchTimes {
    Small,
    /// Batch times follow the clock (as a driver's do: a batch is allocated at or after its
    /// time), so cleanups delete the log files of old batches, and what recovery rebuilds
    /// after that is checked too.
    OnTheClock,
}

/// The clock at the start of a case.
const CLOCK_START_MS: i64 = 1_000_000;
/// How far the clock moves per operation.
const OP_MS: i64 = 700;

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

/// Runs `ops` against the tracker and the model; returns how many log files the cleanups
/// deleted.
fn run(ops: &[Op], times: BatchTimes) -> Result<usize, TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(CLOCK_START_MS));
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
    let mut files_deleted = 0;
    for op in ops {
        clock.advance_ms(OP_MS);
        match op {
            Op::Add(stream) => {
                next_id += 1;
                prop_assert!(tracker.add_block(info(*stream, next_id)));
                model.unallocated.entry(*stream).or_default().push(next_id);
            }
            Op::Allocate(delta) => {
                let time = match times {
                    BatchTimes::Small => model.last.unwrap_or(0) + delta,
                    // Up to three operations back from now (a delta of 2 is now).
                    BatchTimes::OnTheClock => clock.now_ms() - (2 - delta) * OP_MS,
                };
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
                // The n-th oldest batch, or (on the clock, to clean more) the n-th newest.
                let threshold = match times {
                    BatchTimes::Small => model.allocated.keys().nth(*index).copied().unwrap_or(1),
                    BatchTimes::OnTheClock => {
                        model.allocated.keys().rev().nth(*index).copied().unwrap_or(CLOCK_START_MS)
                    }
                };
                let before = log_files(dir.path());
                tracker.cleanup_old_batches(BatchTime(threshold), true).unwrap();
                files_deleted += before.saturating_sub(log_files(dir.path()));
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
    Ok(files_deleted)
}

/// Segment files in the tracker's journal directory (a cleaned segment may stay as a spare
/// file for reuse: not counted).
fn log_files(checkpoint: &std::path::Path) -> usize {
    std::fs::read_dir(checkpoint.join(RECEIVED_BLOCK_METADATA_DIR)).map_or(0, |entries| {
        entries
            .filter(|entry| {
                entry
                    .as_ref()
                    .is_ok_and(|entry| entry.file_name().to_string_lossy().starts_with("seg-"))
            })
            .count()
    })
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
        run(&ops, BatchTimes::Small)?;
    }

    /// Configured streams only: their blocks are never lost to a cleanup (blocks of a stream
    /// not configured lose their additions with the files, as in Spark, which this model does
    /// not follow).
    #[test]
    fn tracker_matches_the_model_across_cleanups_that_delete_files(
        ops in prop::collection::vec(ops_on(0..2), 1..60)
    ) {
        run(&ops, BatchTimes::OnTheClock)?;
    }
}

/// The clock-scale cases do delete files (else the comparison above would not cover recovery
/// after a cleanup deleted some).
#[test]
fn cleanups_on_the_clock_delete_files() {
    use proptest::{
        strategy::ValueTree,
        test_runner::{Config, RngSeed, TestRunner},
    };
    let mut runner = TestRunner::new(Config { rng_seed: RngSeed::Fixed(11), ..Config::default() });
    let strategy = prop::collection::vec(ops_on(0..2), 1..60);
    let deleted: usize = (0..24)
        .map(|_| run(&strategy.new_tree(&mut runner).unwrap().current(), BatchTimes::OnTheClock))
        .map(|deleted| deleted.unwrap())
        .sum();
    eprintln!("segment files deleted by cleanups in 24 cases: {deleted}");
    assert!(deleted > 10, "files deleted by cleanups in 24 cases: {deleted}");
}
