//! Goal: the fast `EpochCoordinator` behaves exactly like the reference model written straight
//! from the spec (`coordinators::epoch::reference`), on any interleaving of messages.
//!
//! Method: proptest (fixed seed, a few hundred cases) generates a configuration (start epoch,
//! backlog limits, injected sink/query failures) and a sequence of operations: the partition
//! counts (set first, as the protocol requires, or after some messages, or never), rare later
//! count requests (including negative counts), commits and reports over a small range of epochs and
//! partitions (including stale epochs, negative and out-of-range partitions, duplicates, long
//! payloads that spill to the heap), epoch increments and a possible stop of writes. Both
//! machines get the same operations, each with its own recorders; after every operation the
//! outcomes, the full call logs (offsets added, sink commits with their messages, query commits,
//! stop calls with their errors) and the state snapshots must be equal.

mod epoch_support;

use coordbus::coordinators::epoch::{
    reference::ReferenceEpochCoordinator, BacklogQueue, Epoch, EpochConfig, EpochCoordinator,
    EpochMessage, EpochStats, PartitionId, Payload,
};
use epoch_support::{recorders, CallLog, RecordingQuery, RecordingSink};
use proptest::{prelude::*, test_runner::RngSeed};

#[derive(Debug, Clone)]
enum Op {
    SetReaders(i32),
    SetWriters(i32),
    Commit(i32, i64),
    Report(i32, i64),
    Increment,
    StopWrites,
}

impl Op {
    /// The epoch of a report or a commit.
    fn epoch(&self) -> Option<i64> {
        match self {
            Op::Report(_, epoch) | Op::Commit(_, epoch) => Some(*epoch),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
struct Case {
    start_epoch: i64,
    offset_limit: usize,
    commit_limit: usize,
    waiting_limit: usize,
    fail_sink_at: Option<i64>,
    fail_commit_at: Option<i64>,
    fail_add_offsets_at: Option<i64>,
    ops: Vec<Op>,
}

impl Case {
    /// `ops` from epoch 1 without injected failures, with `entries_limit` for both partition
    /// queues.
    fn from_epoch_1(ops: Vec<Op>, entries_limit: usize, waiting_limit: usize) -> Self {
        Self {
            start_epoch: 1,
            offset_limit: entries_limit,
            commit_limit: entries_limit,
            waiting_limit,
            fail_sink_at: None,
            fail_commit_at: None,
            fail_add_offsets_at: None,
            ops,
        }
    }
}

/// Message-heavy operations, with rare partition-count changes (including unset and negative).
fn op() -> impl Strategy<Value = Op> {
    let partition = prop_oneof![24 => 0..3i32, 1 => Just(-1), 1 => 3..6i32];
    // Epochs 20.. are far ahead of the commit frontier: their buckets use the sparse layout.
    let epoch = prop_oneof![24 => 0..7i64, 1 => Just(-1i64), 1 => 20..22i64];
    prop_oneof![
        // Rare, so that most runs keep their counts long enough to commit epochs.
        1 => prop_oneof![
            (0..4i32).prop_map(Op::SetReaders),
            (0..4i32).prop_map(Op::SetWriters),
            Just(Op::SetWriters(-2)),
        ],
        150 => (partition.clone(), epoch.clone()).prop_map(|(p, e)| Op::Commit(p, e)),
        150 => (partition, epoch).prop_map(|(p, e)| Op::Report(p, e)),
        6 => Just(Op::Increment),
    ]
}

/// The last operations of a run: as [`op`], plus a possible stop of writes.
fn tail_op() -> impl Strategy<Value = Op> {
    prop_oneof![10 => op(), 1 => Just(Op::StopWrites)]
}

fn case() -> impl Strategy<Value = Case> {
    let failure = prop_oneof![6 => Just(None), 1 => (0..8i64).prop_map(Some)];
    (
        0..3i64,
        // Entry limits up to 40: small ones overflow early (and then refuse new entries of all
        // but the next epoch to commit), larger ones let runs commit many epochs first.
        (1..40usize, 1..40usize, 0..5usize),
        (failure.clone(), failure.clone(), failure),
        (1..4i32, 1..4i32),
        proptest::collection::vec(op(), 0..200),
        proptest::collection::vec(tail_op(), 0..30),
        // Where the counts are set: first (as the protocol requires), after that many operations
        // (messages arrive before them: SPEC B.4 note), or not at all.
        prop_oneof![6 => Just(Some(0usize)), 3 => (1..80usize).prop_map(Some), 1 => Just(None)],
    )
        .prop_map(
            |(start_epoch, limits, failures, (readers, writers), body, tail, counts_after)| {
                let mut ops = body;
                if let Some(position) = counts_after {
                    let position = position.min(ops.len());
                    ops.splice(
                        position..position,
                        [Op::SetReaders(readers), Op::SetWriters(writers)],
                    );
                }
                ops.extend(tail);
                Case {
                    start_epoch,
                    offset_limit: limits.0,
                    commit_limit: limits.1,
                    waiting_limit: limits.2,
                    fail_sink_at: failures.0,
                    fail_commit_at: failures.1,
                    fail_add_offsets_at: failures.2,
                    ops,
                }
            },
        )
}

fn collaborators(case: &Case) -> (RecordingQuery, RecordingSink, CallLog) {
    let (mut query, mut sink, log) = recorders();
    sink.fail_at.extend(case.fail_sink_at);
    query.fail_commit_at.extend(case.fail_commit_at);
    query.fail_add_offsets_at.extend(case.fail_add_offsets_at);
    (query, sink, log)
}

/// A payload unique to operation `index`: every fifth one too long to be inline, every seventh
/// other one inline but 12 bytes (no word), the rest 8-byte words.
fn payload(index: usize) -> Payload {
    if index.is_multiple_of(5) {
        Payload::from(format!("a long payload that spills to the heap #{index}").into_bytes())
    } else if index.is_multiple_of(7) {
        Payload::from(format!("inline{index:06}").into_bytes())
    } else {
        Payload::from(index as i64)
    }
}

type Fast = EpochCoordinator<RecordingQuery, RecordingSink>;
type Model = ReferenceEpochCoordinator<RecordingQuery, RecordingSink>;

/// Both machines for `case`, each with the log of its collaborators' calls.
fn machines(case: &Case) -> (Fast, CallLog, Model, CallLog) {
    let mut config = EpochConfig::new(case.start_epoch);
    config.partition_offset_limit = case.offset_limit;
    config.partition_commit_limit = case.commit_limit;
    config.waiting_epoch_limit = case.waiting_limit;
    let (query, sink, fast_log) = collaborators(case);
    let fast = EpochCoordinator::new(config.clone(), query, sink).unwrap();
    let (query, sink, model_log) = collaborators(case);
    let model = ReferenceEpochCoordinator::new(config, query, sink).unwrap();
    (fast, fast_log, model, model_log)
}

/// Applies operation `index` to the model, as text.
fn apply_to_model(index: usize, op: &Op, model: &mut Model) -> Result<(), String> {
    let text = |error: &dyn std::fmt::Display| error.to_string();
    match *op {
        Op::SetReaders(count) => model.set_reader_partitions(count).map_err(|e| text(&e)),
        Op::SetWriters(count) => model.set_writer_partitions(count).map_err(|e| text(&e)),
        Op::Commit(partition, epoch) => model
            .commit_partition_epoch(PartitionId(partition), Epoch(epoch), payload(index))
            .map_err(|e| text(&e)),
        Op::Report(partition, epoch) => model
            .report_partition_offset(PartitionId(partition), Epoch(epoch), payload(index))
            .map_err(|e| text(&e)),
        Op::Increment => model.increment_and_get_epoch().map(drop).map_err(|e| text(&e)),
        Op::StopWrites => {
            model.stop_writes();
            Ok(())
        }
    }
}

/// Applies operation `index` to the fast machine, as text.
fn apply_to_fast(index: usize, op: &Op, fast: &mut Fast) -> Result<(), String> {
    let text = |error: &dyn std::fmt::Display| error.to_string();
    match *op {
        Op::SetReaders(count) => fast.set_reader_partitions(count).map_err(|e| text(&e)),
        Op::SetWriters(count) => fast.set_writer_partitions(count).map_err(|e| text(&e)),
        Op::Commit(partition, epoch) => fast
            .commit_partition_epoch(PartitionId(partition), Epoch(epoch), payload(index))
            .map_err(|e| text(&e)),
        Op::Report(partition, epoch) => fast
            .report_partition_offset(PartitionId(partition), Epoch(epoch), payload(index))
            .map_err(|e| text(&e)),
        Op::Increment => fast.increment_and_get_epoch().map(drop).map_err(|e| text(&e)),
        Op::StopWrites => {
            fast.stop_writes();
            Ok(())
        }
    }
}

/// Runs `case` on both machines, comparing them after every operation; returns the fast one's
/// final statistics.
fn check(case: &Case) -> Result<EpochStats, TestCaseError> {
    let (mut fast, fast_log, mut model, model_log) = machines(case);
    for (index, op) in case.ops.iter().enumerate() {
        let fast_outcome = apply_to_fast(index, op, &mut fast);
        let model_outcome = apply_to_model(index, op, &mut model);
        prop_assert_eq!(&fast_outcome, &model_outcome, "outcome of op {} {:?}", index, op);
        prop_assert_eq!(
            epoch_support::calls(&fast_log),
            epoch_support::calls(&model_log),
            "call logs after op {} {:?}",
            index,
            op
        );
        prop_assert_eq!(fast.stats(), model.stats(), "stats after op {} {:?}", index, op);
        prop_assert_eq!(fast.get_current_epoch(), model.get_current_epoch());
    }
    Ok(fast.stats())
}

/// Whether the run being built ends after operation `index` (a fixed pseudo-random cut, about
/// one in six, so that runs of many lengths occur).
fn cut_after(index: usize) -> bool {
    (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61 == 0
}

/// The message of operation `index`, if it is one.
fn message_of(index: usize, op: &Op) -> Option<EpochMessage> {
    match *op {
        Op::Commit(partition, epoch) => {
            Some(EpochMessage::CommitPartitionEpoch { partition, epoch, message: payload(index) })
        }
        Op::Report(partition, epoch) => {
            Some(EpochMessage::ReportPartitionOffset { partition, epoch, offset: payload(index) })
        }
        _ => None,
    }
}

/// [`check`] with the fast machine driven as an endpoint drives it: each run of consecutive
/// messages (cut at every other operation and at [`cut_after`]) through
/// `EpochCoordinator::apply_run`, the model one message at a time. After each run the messages
/// dropped (in order), the call logs and the state snapshots must be equal.
fn check_in_runs(case: &Case) -> Result<(), TestCaseError> {
    let (mut fast, fast_log, mut model, model_log) = machines(case);
    let mut index = 0;
    while index < case.ops.len() {
        let op = &case.ops[index];
        if message_of(index, op).is_none() {
            let fast_outcome = apply_to_fast(index, op, &mut fast);
            let model_outcome = apply_to_model(index, op, &mut model);
            prop_assert_eq!(&fast_outcome, &model_outcome, "outcome of op {} {:?}", index, op);
            index += 1;
            continue;
        }
        let start = index;
        let mut run = Vec::new();
        while let Some(message) = case.ops.get(index).and_then(|op| message_of(index, op)) {
            run.push(message);
            index += 1;
            if cut_after(index - 1) {
                break;
            }
        }
        let mut fast_dropped = Vec::new();
        fast.apply_run(&mut run.into_iter(), |rejected| fast_dropped.push(rejected.to_string()));
        let model_dropped: Vec<String> = (start..index)
            .filter_map(|at| apply_to_model(at, &case.ops[at], &mut model).err())
            .collect();
        prop_assert_eq!(&fast_dropped, &model_dropped, "dropped in ops {}..{}", start, index);
        prop_assert_eq!(
            epoch_support::calls(&fast_log),
            epoch_support::calls(&model_log),
            "call logs after ops {}..{}",
            start,
            index
        );
        prop_assert_eq!(fast.stats(), model.stats(), "stats after ops {}..{}", start, index);
    }
    prop_assert_eq!(fast.get_current_epoch(), model.get_current_epoch());
    Ok(())
}

/// Runs the way an inbox delivers them: every message of epochs `1..=epochs` for 1-130
/// partitions, each epoch's in its own shuffled order, with about one operation in twelve added
/// at random: a repeat, a stale or far epoch, a partition out of range or negative, a count
/// change, an increment. Backlog limits from below one epoch to a few, so that stretches meet
/// the slack's bound and overflows.
fn runs_case() -> impl Strategy<Value = Case> {
    (1..=130i32, 1..=130i32, 2..=6i64, 0.3f64..4.0)
        .prop_flat_map(|(readers, writers, epochs, limit_epochs)| {
            let per_epoch: Vec<_> = (1..=epochs)
                .map(|epoch| {
                    let mut messages: Vec<Op> =
                        (0..readers).map(|partition| Op::Report(partition, epoch)).collect();
                    messages.extend((0..writers).map(|partition| Op::Commit(partition, epoch)));
                    Just(messages).prop_shuffle()
                })
                .collect();
            let limit = ((f64::from(readers.max(writers)) * limit_epochs) as usize).max(1);
            let noise = prop::collection::vec(
                (
                    any::<prop::sample::Index>(),
                    prop_oneof![
                        (-2..140i32, 0..=8i64).prop_map(|(p, e)| Op::Report(p, e)),
                        (-2..140i32, 0..=8i64).prop_map(|(p, e)| Op::Commit(p, e)),
                        (1..=130i32).prop_map(Op::SetReaders),
                        (1..=130i32).prop_map(Op::SetWriters),
                        Just(Op::Increment),
                    ],
                ),
                0..=((readers + writers) as usize * epochs as usize / 12),
            );
            (Just((readers, writers, limit)), per_epoch, noise)
        })
        .prop_map(|((readers, writers, limit), per_epoch, noise)| {
            let mut ops = vec![Op::SetReaders(readers), Op::SetWriters(writers)];
            let messages: Vec<Op> = per_epoch.into_iter().flatten().collect();
            let mut messages = messages;
            for (at, op) in noise {
                let at = at.index(messages.len() + 1);
                messages.insert(at, op);
            }
            ops.extend(messages);
            Case::from_epoch_1(ops, limit, 4)
        })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        rng_seed: RngSeed::Fixed(0x00C0_0DB0_5EEF),
        max_shrink_iters: 1024,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fast_coordinator_in_runs_matches_the_reference_model(case in runs_case()) {
        check(&case)?;
        check_in_runs(&case)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 384,
        rng_seed: RngSeed::Fixed(0x00C0_0DB0_5EED),
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fast_coordinator_matches_the_reference_model(case in case()) {
        check(&case)?;
        check_in_runs(&case)?;
    }
}

/// Wide runs: 65-100 partitions (more than one word of a dense side's bitmap), every message of
/// more than 32 epochs in one shuffled order (under limits this high every bucket is dense:
/// the dense window is 1000 epochs; [`windowed_wide_case`] has buckets beyond it); in two cases
/// of three a reader or a writer count lowered or raised midway, which turns prepared dense
/// sides sparse; and in one case of three the counts set only after some messages, whose
/// buckets are sparse (out-of-order ids over more than one bitmap word, sorted when their
/// epochs commit). The small cases above reach none of these.
fn wide_case() -> impl Strategy<Value = Case> {
    (
        65..=100i32,
        65..=100i32,
        33..=36i64,
        prop_oneof![
            Just(None),
            (0..4000usize, 60..=110i32).prop_map(|(at, count)| Some((at, count, true))),
            (0..4000usize, 60..=110i32).prop_map(|(at, count)| Some((at, count, false))),
        ],
        prop_oneof![2 => Just(0usize), 1 => 0..4000usize],
    )
        .prop_flat_map(|(readers, writers, epochs, count_change, counts_at)| {
            let mut messages = Vec::new();
            for epoch in 1..=epochs {
                messages.extend((0..readers).map(|partition| Op::Report(partition, epoch)));
                messages.extend((0..writers).map(|partition| Op::Commit(partition, epoch)));
            }
            (Just((readers, writers, count_change, counts_at)), Just(messages).prop_shuffle())
        })
        .prop_map(|((readers, writers, count_change, counts_at), messages)| {
            let mut ops = messages;
            let counts_at = counts_at.min(ops.len());
            ops.splice(counts_at..counts_at, [Op::SetReaders(readers), Op::SetWriters(writers)]);
            if let Some((at, count, readers_side)) = count_change {
                let change =
                    if readers_side { Op::SetReaders(count) } else { Op::SetWriters(count) };
                let at = counts_at + 2 + at.min(ops.len() - counts_at - 2);
                ops.insert(at, change);
            }
            Case::from_epoch_1(ops, 100_000, 100_000)
        })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 8,
        rng_seed: RngSeed::Fixed(0x00C0_0DB0_5EEE),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fast_coordinator_matches_the_reference_model_on_wide_runs(case in wide_case()) {
        let stats = check(&case)?;
        check_in_runs(&case)?;
        // Without a count change every epoch completes: the comparison covered their commits.
        // (An epoch needs a message after the counts are set: setting a count resolves
        // nothing by itself.)
        let is_count = |op: &Op| matches!(op, Op::SetReaders(_) | Op::SetWriters(_));
        let changed = case.ops.iter().filter(|op| is_count(op)).count() > 2;
        let counts_set = case.ops.iter().position(|op| matches!(op, Op::SetWriters(_)));
        let last = case.ops.iter().filter_map(Op::epoch).max().unwrap_or(0);
        let resolved_after_counts = counts_set.is_some_and(|at| {
            let after: std::collections::HashSet<i64> =
                case.ops[at..].iter().filter_map(Op::epoch).collect();
            (1..=last).all(|epoch| after.contains(&epoch))
        });
        if !changed && resolved_after_counts {
            prop_assert_eq!(stats.last_committed, Epoch(last), "{:?}", stats);
        }
    }
}

proptest! {
    // Each case is about 7000 messages against a model that rescans its maps per message.
    #![proptest_config(ProptestConfig {
        cases: 4,
        rng_seed: RngSeed::Fixed(0x00C0_0DB0_5EEE),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fast_coordinator_matches_the_reference_model_on_windowed_wide_runs(
        case in windowed_wide_case()
    ) {
        let stats = check(&case)?;
        check_in_runs(&case)?;
        // Within the limits, every epoch commits: the comparison covered their commits.
        let last = case.ops.iter().filter_map(|op| match op {
            Op::Report(_, epoch) => Some(*epoch),
            _ => None,
        });
        prop_assert_eq!(stats.last_committed, Epoch(last.max().unwrap_or(0)), "{:?}", stats);
    }
}

/// Wide runs under limits of 20 epochs of the larger side's entries (a dense window of 20 to
/// 30 epochs), with every epoch's messages arriving within four epochs of each other, except
/// two in 1000 that arrive 25 epochs early (about a quarter of the epochs then get their
/// bucket beyond the dense window, laid out sparse, and complete later, with their ids out of
/// order) and five in 1000 that arrive 12 epochs late (a burst of up to about 16 commits when
/// they come). The other epochs reuse dense buckets; at the end, the drain frees more buckets
/// than the top of the free list keeps.
fn windowed_wide_case() -> impl Strategy<Value = Case> {
    (65..=100i32, 65..=100i32, 40..=44i64)
        .prop_flat_map(|(readers, writers, epochs)| {
            let messages = (readers + writers) as usize * epochs as usize;
            let keys = prop::collection::vec((0..1000u32, 0..64i64), messages);
            (Just((readers, writers, epochs)), keys)
        })
        .prop_map(|((readers, writers, epochs), keys)| {
            let mut messages = Vec::new();
            for epoch in 1..=epochs {
                messages.extend((0..readers).map(|partition| Op::Report(partition, epoch)));
                messages.extend((0..writers).map(|partition| Op::Commit(partition, epoch)));
            }
            // Arrival time in sixteenths of an epoch: the epoch, shifted for the early and
            // late ones, plus up to four epochs of jitter.
            let mut keyed: Vec<(i64, Op)> = (messages.into_iter().zip(keys))
                .map(|(op, (kind, jitter))| {
                    let epoch = op.epoch().expect("only messages here");
                    let shift = match kind {
                        0..=1 => -25,
                        2..=6 => 12,
                        _ => 0,
                    };
                    ((epoch + shift) * 16 + jitter, op)
                })
                .collect();
            keyed.sort_by_key(|(at, _)| *at);
            let mut ops = vec![Op::SetReaders(readers), Op::SetWriters(writers)];
            ops.extend(keyed.into_iter().map(|(_, op)| op));
            let limit = 20 * readers.max(writers) as usize;
            Case::from_epoch_1(ops, limit, 100_000)
        })
}

/// The least dense window of the coordinator, in epochs after the last commit (its module
/// docs: "as many epochs ahead as the side's backlog limit holds full epochs, and at least 16").
const DENSE_WINDOW_EPOCHS_MIN: i64 = 16;

/// The generated cases do reach the interesting states (guards against a strategy that never
/// commits, overflows, drops for a full queue or fails, which would make the equivalence check
/// vacuous).
#[test]
fn generated_cases_cover_commits_waits_overflows_and_failures() {
    use proptest::{
        strategy::ValueTree,
        test_runner::{Config, TestRunner},
    };
    let mut runner = TestRunner::new(Config { rng_seed: RngSeed::Fixed(7), ..Config::default() });
    let (mut commits, mut chained, mut stops, mut failures) = (0u64, 0u64, 0u64, 0u64);
    let mut backlog_full_runs = 0u64;
    let mut added_at_commit_runs = 0u64;
    let mut purge_runs = 0u64;
    // Runs with stale drops, duplicate commits and repeated reports, and messages stored for an
    // epoch beyond the dense window (a sparse side).
    let (mut stale_runs, mut duplicate_runs, mut repeat_runs) = (0u64, 0u64, 0u64);
    let mut far_ahead_stored = 0u64;
    // Runs stopped by an overflow of each queue (offsets, commits, waiting epochs): the model
    // comparison covers "stop on the same overflow" only if each kind happens.
    let mut overflow_runs = [0u64; 3];
    for _ in 0..200 {
        let case = case().new_tree(&mut runner).unwrap().current();
        check(&case).unwrap();
        let mut config = EpochConfig::new(case.start_epoch);
        config.partition_offset_limit = case.offset_limit;
        config.partition_commit_limit = case.commit_limit;
        config.waiting_epoch_limit = case.waiting_limit;
        let (query, sink, log) = collaborators(&case);
        let mut fast = EpochCoordinator::new(config, query, sink).unwrap();
        let mut max_waiting = 0;
        let mut purged = false;
        for (index, op) in case.ops.iter().enumerate() {
            let before = fast.stats();
            let _ = match *op {
                Op::Commit(p, e) => fast
                    .commit_partition_epoch(PartitionId(p), Epoch(e), payload(index))
                    .map_err(drop),
                Op::Report(p, e) => fast
                    .report_partition_offset(PartitionId(p), Epoch(e), payload(index))
                    .map_err(drop),
                Op::SetReaders(n) => fast.set_reader_partitions(n).map_err(drop),
                Op::SetWriters(n) => fast.set_writer_partitions(n).map_err(drop),
                Op::Increment => fast.increment_and_get_epoch().map(drop).map_err(drop),
                Op::StopWrites => {
                    fast.stop_writes();
                    Ok(())
                }
            };
            max_waiting = max_waiting.max(fast.stats().waiting_epochs);
            let stored = |stats: &EpochStats| {
                stats.counters.offsets_accepted + stats.counters.commits_accepted
            };
            // The coordinator's dense window for a side whose count is set: max(16, limit /
            // count) epochs after the last commit (module docs of the coordinator). Sides of an
            // unset count are sparse too, but not what this counts.
            let beyond_window = |e: i64, count: i32, limit: usize| {
                count > 0
                    && e - before.last_committed.0
                        > DENSE_WINDOW_EPOCHS_MIN.max(limit as i64 / i64::from(count))
            };
            let beyond_window = match *op {
                Op::Report(_, e) => beyond_window(e, before.reader_partitions, case.offset_limit),
                Op::Commit(_, e) => beyond_window(e, before.writer_partitions, case.commit_limit),
                _ => false,
            };
            far_ahead_stored += u64::from(beyond_window && stored(&fast.stats()) > stored(&before));
            // A count set dropped entries kept with ids it leaves out.
            purged |= matches!(op, Op::SetReaders(_) | Op::SetWriters(_))
                && fast.stats().counters.dropped_partition_out_of_range
                    > before.counters.dropped_partition_out_of_range;
        }
        purge_runs += u64::from(purged);
        let stats = fast.stats();
        commits += stats.counters.epochs_committed;
        chained += u64::from(max_waiting > 0 && stats.counters.epochs_committed > 1);
        let calls = epoch_support::calls(&log);
        stops +=
            calls.iter().filter(|call| matches!(call, epoch_support::Call::Stop { .. })).count()
                as u64;
        for (kind, queue) in [
            BacklogQueue::PartitionOffsets,
            BacklogQueue::PartitionCommits,
            BacklogQueue::WaitingEpochs,
        ]
        .into_iter()
        .enumerate()
        {
            overflow_runs[kind] += u64::from(calls.iter().any(|call| {
                matches!(
                    call,
                    epoch_support::Call::Stop { backlog: Some((q, _, _)), .. } if *q == queue
                )
            }));
        }
        failures += u64::from(stats.failed_epoch.is_some());
        stale_runs += u64::from(stats.counters.dropped_stale_epoch > 0);
        duplicate_runs += u64::from(stats.counters.dropped_duplicate_commit > 0);
        repeat_runs += u64::from(stats.counters.offsets_overwritten > 0);
        backlog_full_runs += u64::from(stats.counters.dropped_backlog_full > 0);
        added_at_commit_runs += u64::from(stats.counters.offsets_added_at_commit > 0);
    }
    eprintln!(
        "coverage: commits {commits} chained {chained} stops {stops} failures {failures} \
         backlog_full_runs {backlog_full_runs} overflow runs (offsets, commits, waiting) \
         {overflow_runs:?} runs adding offsets at a commit {added_at_commit_runs} runs where a \
         count dropped kept entries {purge_runs} runs with stale drops {stale_runs}, duplicate \
         commits {duplicate_runs}, repeated reports {repeat_runs}; far-ahead entries stored \
         {far_ahead_stored}"
    );
    assert!(stale_runs > 10, "runs that dropped stale messages: {stale_runs}");
    assert!(duplicate_runs > 10, "runs that dropped duplicate commits: {duplicate_runs}");
    assert!(repeat_runs > 10, "runs with repeated reports: {repeat_runs}");
    assert!(far_ahead_stored > 10, "entries stored beyond the dense window: {far_ahead_stored}");
    assert!(purge_runs > 0, "runs where setting a count dropped kept entries: {purge_runs}");
    assert!(
        overflow_runs.iter().all(|&runs| runs > 0),
        "runs stopped by an overflow of each queue (offsets, commits, waiting epochs): \
         {overflow_runs:?}"
    );
    assert!(commits > 150, "commits {commits}");
    assert!(chained > 10, "runs with waiting epochs that later committed: {chained}");
    assert!(stops > 20, "stop calls {stops}");
    assert!(failures > 5, "fail-stopped runs {failures}");
    assert!(
        backlog_full_runs > 10,
        "runs that dropped messages for a full queue {backlog_full_runs}"
    );
    assert!(
        added_at_commit_runs > 0,
        "runs that added an epoch's offsets just before its commit {added_at_commit_runs}"
    );
}
