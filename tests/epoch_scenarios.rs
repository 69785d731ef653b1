//! Goal: the EpochCoordinator acceptance scenarios EC-01 ... EC-09 of SCENARIOS.md, through the
//! bus endpoint.
//!
//! Method: each test registers an `EpochEndpoint` whose query and sink are recorders appending to
//! one shared, ordered call log (start epoch 1, backlog limit 10), sends the scenario's one-way
//! messages from the test thread, waits on the barrier (`ask GetCurrentEpoch` from the same
//! thread, SPEC A.4), and asserts the exact call log.

mod epoch_support;

use coordbus::coordinators::epoch::BacklogQueue;
use epoch_support::{add_offsets, sink_commit, BusHarness, Call};

fn commit_calls(epoch: i64, writers: i32) -> [Call; 2] {
    [sink_commit(epoch, writers), Call::QueryCommit(epoch)]
}

#[test]
fn ec01_single_epoch() {
    let harness = BusHarness::scenario(3, 2);
    for partition in 0..3 {
        harness.commit(partition, 1);
    }
    harness.report(0, 1);
    harness.report(1, 1);
    assert_eq!(harness.barrier(), 1);
    assert_eq!(harness.calls(), [add_offsets(1, 2), sink_commit(1, 3), Call::QueryCommit(1)]);
}

#[test]
fn ec02_single_epoch_one_writer_partition_missing() {
    let harness = BusHarness::scenario(3, 2);
    harness.commit(0, 1);
    harness.commit(1, 1);
    harness.report(0, 1);
    harness.report(1, 1);
    harness.barrier();
    assert_eq!(harness.calls(), [add_offsets(1, 2)]);
}

#[test]
fn ec03_single_epoch_one_reader_partition_missing() {
    let harness = BusHarness::scenario(3, 2);
    for partition in 0..3 {
        harness.commit(partition, 1);
    }
    harness.report(0, 1);
    harness.barrier();
    assert_eq!(harness.calls(), []);
}

#[test]
fn ec04_consecutive_epochs_arriving_in_order() {
    let harness = BusHarness::scenario(2, 2);
    for epoch in 1..=2 {
        harness.commit(0, epoch);
        harness.commit(1, epoch);
        harness.report(0, epoch);
        harness.report(1, epoch);
    }
    harness.barrier();
    let mut expected = vec![add_offsets(1, 2)];
    expected.extend(commit_calls(1, 2));
    expected.push(add_offsets(2, 2));
    expected.extend(commit_calls(2, 2));
    assert_eq!(harness.calls(), expected);
}

#[test]
fn ec05_message_for_epoch_k_after_all_of_epoch_k_plus_1() {
    let harness = BusHarness::scenario(2, 2);
    harness.commit(0, 1);
    harness.commit(1, 1);
    harness.report(0, 1);
    harness.commit(0, 2);
    harness.commit(1, 2);
    harness.report(0, 2);
    harness.report(1, 2);
    harness.barrier();
    // Epoch 2 is complete but must wait for epoch 1.
    assert_eq!(harness.calls(), [add_offsets(2, 2)]);
    harness.report(1, 1);
    harness.barrier();
    let mut expected = vec![add_offsets(2, 2), add_offsets(1, 2)];
    expected.extend(commit_calls(1, 2));
    expected.extend(commit_calls(2, 2));
    assert_eq!(harness.calls(), expected);
}

/// Sends commit(0, e), report(0, e) for each e in `order` (writers 1, readers 1) and checks
/// that every epoch commits in increasing order, each sink commit followed by its query
/// commit, the late epochs in the same pass as the epoch that unblocks them.
fn out_of_order_epochs(order: &[i64]) {
    let harness = BusHarness::scenario(1, 1);
    let mut expected = Vec::new();
    let mut committed = 0;
    let mut complete = std::collections::BTreeSet::new();
    for &epoch in order {
        harness.commit(0, epoch);
        harness.report(0, epoch);
        expected.push(add_offsets(epoch, 1));
        complete.insert(epoch);
        while complete.contains(&(committed + 1)) {
            committed += 1;
            expected.extend(commit_calls(committed, 1));
        }
    }
    harness.barrier();
    assert_eq!(harness.calls(), expected);
    let commit_order: Vec<i64> = harness
        .calls()
        .iter()
        .filter_map(|call| match call {
            Call::QueryCommit(epoch) => Some(*epoch),
            _ => None,
        })
        .collect();
    let mut sorted = order.to_vec();
    sorted.sort_unstable();
    assert_eq!(commit_order, sorted);
}

#[test]
fn ec06_epochs_complete_in_order_1_3_4_2() {
    out_of_order_epochs(&[1, 3, 4, 2]);
    // Spelled out: 3 and 4 wait, completing 2 commits 2, 3, 4 in one go.
    let harness = BusHarness::scenario(1, 1);
    for epoch in [1, 3, 4] {
        harness.commit(0, epoch);
        harness.report(0, epoch);
    }
    harness.barrier();
    let before = harness.calls();
    assert_eq!(before.last(), Some(&add_offsets(4, 1)));
    assert_eq!(harness.stats().waiting_epochs, 2);
    harness.commit(0, 2);
    harness.report(0, 2);
    harness.barrier();
    let after = harness.calls();
    let mut expected = vec![add_offsets(2, 1)];
    for epoch in 2..=4 {
        expected.extend(commit_calls(epoch, 1));
    }
    assert_eq!(after[before.len()..], expected[..]);
    assert_eq!(harness.stats().waiting_epochs, 0);
}

#[test]
fn ec07_epochs_complete_in_order_1_3_5_4_2() {
    out_of_order_epochs(&[1, 3, 5, 4, 2]);
}

#[test]
fn ec08_backlog_overflow_through_partition_offsets() {
    let harness = BusHarness::scenario(1, 1);
    for epoch in 1..=10 {
        harness.report(0, epoch);
    }
    harness.barrier();
    let before = harness.calls();
    assert!(
        !before.iter().any(|call| matches!(call, Call::Stop { .. })),
        "a size equal to the limit is fine"
    );
    harness.report(0, 11);
    harness.barrier();
    let mut expected: Vec<Call> = (1..=11).map(|epoch| add_offsets(epoch, 1)).collect();
    expected.push(Call::Stop {
        message: "Size of the partition offset queue has exceeded its maximum".into(),
        backlog: Some((BacklogQueue::PartitionOffsets, 11, 10)),
    });
    assert_eq!(harness.calls(), expected);
}

#[test]
fn ec09_backlog_overflow_through_partition_commits() {
    let harness = BusHarness::scenario(1, 1);
    for epoch in 1..=10 {
        harness.commit(0, epoch);
    }
    harness.barrier();
    assert_eq!(harness.calls(), []);
    harness.commit(0, 11);
    harness.barrier();
    assert_eq!(
        harness.calls(),
        [Call::Stop {
            message: "Size of the partition commit queue has exceeded its maximum".into(),
            backlog: Some((BacklogQueue::PartitionCommits, 11, 10)),
        }]
    );
}

#[test]
fn waiting_epoch_backlog_overflows_with_its_verbatim_message() {
    // Not an EC scenario, but B.7 check 3: eleven complete epochs waiting behind epoch 1 (limit
    // 10). With one partition each of epochs 2..=12 stores an offset and a commit, so the entry
    // limits are raised to 100 to let the epoch queue overflow alone.
    let (query, sink, log) = epoch_support::recorders();
    let mut config = coordbus::EpochConfig::new(1).with_backlog_limit(10);
    config.partition_offset_limit = 100;
    config.partition_commit_limit = 100;
    let harness = BusHarness::start(config, query, sink, log);
    harness.set_counts(1, 1);
    for epoch in 2..=12 {
        harness.commit(0, epoch);
        harness.report(0, epoch);
    }
    harness.barrier();
    let overflow = Call::Stop {
        message: "Size of the epoch queue has exceeded its maximum".into(),
        backlog: Some((BacklogQueue::WaitingEpochs, 11, 10)),
    };
    let mut expected: Vec<Call> = (2..=12).map(|epoch| add_offsets(epoch, 1)).collect();
    expected.push(overflow.clone());
    assert_eq!(harness.calls(), expected);
    // The commit of epoch 1 does not complete it: the check after it still finds 11 waiting
    // (B.7: it fires on every message while the condition holds). The report completes epoch
    // 1, and the chain commits all twelve in order in the same pass, each sink commit before
    // its query commit; the check after it finds none waiting.
    harness.commit(0, 1);
    harness.report(0, 1);
    harness.barrier();
    expected.push(overflow);
    expected.push(add_offsets(1, 1));
    for epoch in 1..=12 {
        expected.extend(commit_calls(epoch, 1));
    }
    assert_eq!(harness.calls(), expected);
    assert_eq!(harness.stats().last_committed.0, 12);
    assert_eq!(harness.stats().waiting_epochs, 0);
}
