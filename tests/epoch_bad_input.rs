//! Goal: every kind of bad input to the epoch coordinator is dropped (or rejected) with a typed,
//! counted outcome and no state change, never a panic; failures of the query or the sink
//! fail-stop the coordinator (SPEC 0.3, B.5, B.6).
//!
//! Method: through the bus endpoint, send the bad messages, barrier, then compare the
//! coordinator's stats snapshot (`GetEpochStats`) with the one before (only the matching drop
//! counter may change) and the recorded call log; the typed rejections are checked on the state
//! machine directly.

mod epoch_support;
mod warning_capture;

use coordbus::coordinators::epoch::{
    coordinator_name, BacklogQueue, DropReason, Epoch, EpochConfig, EpochCoordinator,
    EpochCounters, EpochError, EpochStats, IncrementAndGetEpoch, MessageKind, PartitionId,
    PartitionSide, Payload, Rejected, SetReaderPartitions, SetWriterPartitions,
    StopContinuousExecutionWrites,
};
use epoch_support::{
    add_offsets, recorders, sink_commit, BusHarness, Call, RecordingQuery, RecordingSink,
    REPLY_TIMEOUT,
};
use warning_capture::WarningLog;

/// `after` equals `before` except for the counters, whose difference is `expected_drops`.
fn assert_only_counters_changed(before: EpochStats, after: EpochStats, expected: EpochCounters) {
    let mut normalized = after;
    normalized.counters = before.counters;
    assert_eq!(normalized, before, "state changed");
    assert_eq!(after.counters, expected, "counters");
}

fn counters_plus(base: EpochCounters, change: impl FnOnce(&mut EpochCounters)) -> EpochCounters {
    let mut counters = base;
    change(&mut counters);
    counters
}

#[test]
fn partition_out_of_range_is_dropped_and_counted() {
    let harness = BusHarness::scenario(2, 2);
    let before = harness.stats();
    harness.commit(2, 1);
    harness.report(2, 1);
    harness.commit(i32::MAX, 1);
    harness.report(5, 1);
    harness.barrier();
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.dropped_partition_out_of_range += 4),
    );
    assert_eq!(harness.calls(), []);
}

#[test]
fn negative_partition_is_dropped_and_counted() {
    let harness = BusHarness::scenario(2, 2);
    let before = harness.stats();
    harness.commit(-1, 1);
    harness.report(-1, 1);
    harness.report(i32::MIN, 1);
    harness.barrier();
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.dropped_negative_partition += 3),
    );
    assert_eq!(harness.calls(), []);
}

#[test]
fn epoch_at_or_below_last_committed_is_dropped_and_never_waits() {
    let harness = BusHarness::scenario(1, 1);
    harness.commit(0, 1);
    harness.report(0, 1);
    harness.barrier();
    assert_eq!(harness.calls(), [add_offsets(1, 1), sink_commit(1, 1), Call::QueryCommit(1)]);
    let before = harness.stats();
    assert_eq!(before.last_committed, Epoch(1));
    // Re-sent messages of the committed epoch (Spark's quirk would re-add and park it in the
    // waiting set forever), the epoch below the start epoch, and extreme epochs.
    harness.report(0, 1);
    harness.commit(0, 1);
    harness.report(0, 0);
    harness.commit(0, -7);
    harness.report(0, i64::MIN);
    harness.barrier();
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.dropped_stale_epoch += 5),
    );
    assert_eq!(harness.calls().len(), 3, "no call after the stale messages");
}

#[test]
fn epoch_below_start_epoch_is_dropped_before_any_commit() {
    let harness = BusHarness::scenario(1, 1);
    let before = harness.stats();
    assert_eq!(before.last_committed, Epoch(0));
    harness.report(0, 0);
    harness.commit(0, -1);
    harness.barrier();
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.dropped_stale_epoch += 2),
    );
}

#[test]
fn messages_before_partition_counts_are_kept_but_complete_nothing() {
    let (query, sink, log) = recorders();
    let harness = BusHarness::start(EpochConfig::new(1), query, sink, log);
    harness.commit(0, 1);
    harness.report(0, 1);
    harness.report(1000, 1); // no count yet: kept, as in Spark
    harness.barrier();
    let stats = harness.stats();
    assert_eq!(stats.offset_entries, 2);
    assert_eq!(stats.commit_entries, 1);
    assert_eq!(stats.counters.dropped(), 0);
    assert_eq!(harness.calls(), [], "a count of 0 never completes an epoch");

    // Setting the counts drops the kept entry whose id is out of range (SPEC 0.3: dropped and
    // counted) and resolves nothing by itself; the epoch's next message does.
    harness.set_counts(1, 1);
    harness.barrier();
    assert_eq!(harness.calls(), []);
    let stats = harness.stats();
    assert_eq!(stats.offset_entries, 1);
    assert_eq!(stats.counters.dropped_partition_out_of_range, 1);
    harness.report(0, 1);
    harness.commit(0, 2);
    harness.report(0, 2);
    harness.barrier();
    assert_eq!(
        harness.calls(),
        [
            add_offsets(1, 1),
            sink_commit(1, 1),
            Call::QueryCommit(1),
            add_offsets(2, 1),
            sink_commit(2, 1),
            Call::QueryCommit(2)
        ]
    );
}

/// A commit kept before the counts, of a partition the count then leaves out, must not stand
/// in for a partition that is missing: before, epoch 1 committed to the sink with partitions
/// 0 and 5 (two entries for two writers) and partition 1's own commit was then dropped as
/// stale, its output never committed.
#[test]
fn a_kept_entry_of_a_partition_the_count_leaves_out_completes_nothing() {
    let (query, sink, log) = recorders();
    let harness = BusHarness::start(EpochConfig::new(1), query, sink, log);
    harness.commit(5, 1);
    harness.set_counts(2, 1);
    harness.commit(0, 1);
    harness.report(0, 1);
    harness.barrier();
    assert_eq!(harness.calls(), [add_offsets(1, 1)], "epoch 1 lacks partition 1's commit");
    assert_eq!(harness.stats().counters.dropped_partition_out_of_range, 1);
    harness.commit(1, 1);
    harness.barrier();
    assert_eq!(harness.calls()[1..], [sink_commit(1, 2), Call::QueryCommit(1)]);
}

/// A coordinator with one reader and one writer where epoch 2 is complete and waits for
/// epoch 1 (its offsets added).
fn epoch_two_waiting() -> BusHarness {
    let (query, sink, log) = recorders();
    let harness = BusHarness::start(EpochConfig::new(1), query, sink, log);
    harness.set_counts(1, 1);
    harness.commit(0, 2);
    harness.report(0, 2);
    harness
}

/// [`epoch_two_waiting`], then the writer count raised to 2 and epoch 1 committed with both
/// writers: its chain passes epoch 2, which lacks partition 1's commit.
fn epoch_two_passed_by_the_chain() -> BusHarness {
    let harness = epoch_two_waiting();
    harness.set_counts(2, 1);
    harness.commit(0, 1);
    harness.commit(1, 1);
    harness.report(0, 1);
    harness
}

/// Raising the writer count while an epoch waits: it is no longer complete, so the commit of
/// the epoch before it does not chain into it (Spark's would, committing it to the sink
/// without the new partition, whose own commit would then be dropped as stale). It stays
/// waiting and commits with its missing partition's message.
#[test]
fn a_raised_count_keeps_a_waiting_epoch_from_committing_incomplete() {
    let harness = epoch_two_waiting();
    harness.barrier();
    assert_eq!(harness.stats().waiting_epochs, 1, "epoch 2 is complete and waits for epoch 1");
    harness.set_counts(2, 1);
    harness.commit(0, 1);
    harness.commit(1, 1);
    harness.report(0, 1);
    harness.barrier();
    assert_eq!(
        harness.calls(),
        [add_offsets(2, 1), add_offsets(1, 1), sink_commit(1, 2), Call::QueryCommit(1)],
        "epoch 1 commits alone"
    );
    assert_eq!(harness.stats().waiting_epochs, 1);
    harness.commit(1, 2);
    harness.barrier();
    assert_eq!(harness.calls()[4..], [sink_commit(2, 2), Call::QueryCommit(2)]);
    assert_eq!(harness.stats().waiting_epochs, 0);
}

/// A count raised and set back while an epoch waits: the epoch is complete again and commits
/// in the chain of the epoch before it, with no message of its own to come.
#[test]
fn a_waiting_epoch_commits_in_the_chain_once_a_count_is_set_back() {
    let harness = epoch_two_waiting();
    harness.set_counts(2, 1);
    harness.set_counts(1, 1);
    harness.commit(0, 1);
    harness.report(0, 1);
    harness.barrier();
    assert_eq!(
        harness.calls(),
        [
            add_offsets(2, 1),
            add_offsets(1, 1),
            sink_commit(1, 1),
            Call::QueryCommit(1),
            sink_commit(2, 1),
            Call::QueryCommit(2)
        ]
    );
    assert_eq!(harness.stats().waiting_epochs, 0);
}

/// As above, but the count is set back only after the epoch before committed, its chain having
/// passed the waiting epoch: the count change commits it (no message of it is left to come).
#[test]
fn a_waiting_epoch_the_chain_passed_commits_when_a_count_is_set_back() {
    let harness = epoch_two_passed_by_the_chain();
    harness.barrier();
    assert_eq!(harness.stats().waiting_epochs, 1, "the chain passed epoch 2");
    harness.set_counts(1, 1);
    harness.barrier();
    assert_eq!(
        harness.calls()[2..],
        [sink_commit(1, 2), Call::QueryCommit(1), sink_commit(2, 1), Call::QueryCommit(2)]
    );
    assert_eq!(harness.stats().waiting_epochs, 0);
}

/// As above, but writes were stopped before the count is set back: nothing commits after
/// `StopContinuousExecutionWrites` (SPEC B.6), so the epoch stays uncommitted.
#[test]
fn a_count_set_back_after_writes_stopped_commits_nothing() {
    let harness = epoch_two_passed_by_the_chain();
    harness.epoch.ask(StopContinuousExecutionWrites).wait_timeout(REPLY_TIMEOUT).unwrap();
    harness.set_counts(1, 1);
    harness.barrier();
    assert_eq!(harness.stats().last_committed, Epoch(1));
    assert_eq!(harness.stats().waiting_epochs, 1);
}

#[test]
fn messages_kept_before_counts_count_once_counts_are_set() {
    let (query, sink, log) = recorders();
    let harness = BusHarness::start(EpochConfig::new(1), query, sink, log);
    harness.commit(0, 1);
    harness.report(0, 1);
    harness.set_counts(1, 1);
    harness.report(0, 1); // a repeat report overwrites and completes the epoch
    harness.barrier();
    assert_eq!(harness.calls(), [add_offsets(1, 1), sink_commit(1, 1), Call::QueryCommit(1)]);
}

/// Spark would commit this epoch to the sink with no offset log entry (its restart then fails
/// with "Batch 1 was committed without end epoch offsets!"); here its offsets are added first.
#[test]
fn offsets_reported_before_the_counts_are_added_before_the_sink_commit() {
    let (query, sink, log) = recorders();
    let harness = BusHarness::start(EpochConfig::new(1), query, sink, log);
    harness.report(0, 1);
    harness.report(1, 1);
    harness.set_counts(1, 2);
    harness.commit(0, 1); // completes epoch 1: no report completed its offsets
    harness.barrier();
    assert_eq!(harness.calls(), [add_offsets(1, 2), sink_commit(1, 1), Call::QueryCommit(1)]);
    let counters = harness.stats().counters;
    assert_eq!((counters.offsets_added, counters.offsets_added_at_commit), (1, 1));

    // The next epoch, in the usual order, is added once, by its completing report.
    harness.report(0, 2);
    harness.report(1, 2);
    harness.commit(0, 2);
    harness.barrier();
    assert_eq!(harness.calls()[3..], [add_offsets(2, 2), sink_commit(2, 1), Call::QueryCommit(2)]);
    let counters = harness.stats().counters;
    assert_eq!((counters.offsets_added, counters.offsets_added_at_commit), (2, 1));
}

/// A lowered reader count lets a writer commit complete epochs whose offsets were never
/// added: each gets them just before its sink commit, also an epoch that waited and commits in
/// the chain of the one before it.
#[test]
fn a_lowered_reader_count_adds_offsets_before_each_commit_also_in_a_chain() {
    let harness = BusHarness::scenario(1, 3);
    for epoch in [2, 3] {
        harness.report(0, epoch);
        harness.report(1, epoch); // 2 of 3: not added
    }
    harness.set_counts(1, 2);
    harness.commit(0, 3); // epoch 3 is ready and waits for epoch 2
    harness.barrier();
    assert_eq!(harness.calls(), []);
    assert_eq!(harness.stats().waiting_epochs, 1);
    for partition in 0..2 {
        harness.report(partition, 1); // completes epoch 1's offsets: added
    }
    harness.commit(0, 1);
    harness.commit(0, 2); // commits epoch 2, then epoch 3 in its chain
    harness.barrier();
    assert_eq!(
        harness.calls(),
        [
            add_offsets(1, 2),
            sink_commit(1, 1),
            Call::QueryCommit(1),
            add_offsets(2, 2),
            sink_commit(2, 1),
            Call::QueryCommit(2),
            add_offsets(3, 2),
            sink_commit(3, 1),
            Call::QueryCommit(3),
        ]
    );
    let counters = harness.stats().counters;
    assert_eq!((counters.offsets_added, counters.offsets_added_at_commit), (3, 2));
}

#[test]
fn duplicate_commit_is_dropped_first_commit_wins() {
    let harness = BusHarness::scenario(2, 1);
    harness.commit(0, 1);
    harness.barrier();
    let before = harness.stats();
    harness
        .epoch
        .send(coordbus::coordinators::epoch::CommitPartitionEpoch {
            partition: 0,
            epoch: 1,
            message: Payload::from(&b"second attempt"[..]),
        })
        .unwrap();
    harness.barrier();
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.dropped_duplicate_commit += 1),
    );
    harness.commit(1, 1);
    harness.report(0, 1);
    harness.barrier();
    assert_eq!(
        harness.calls(),
        [add_offsets(1, 1), sink_commit(1, 2), Call::QueryCommit(1)],
        "the sink sees the first commit message"
    );
}

#[test]
fn repeated_report_overwrites_and_re_adds_offsets() {
    let harness = BusHarness::scenario(2, 1);
    harness.report(0, 1);
    harness
        .epoch
        .send(coordbus::coordinators::epoch::ReportPartitionOffset {
            partition: 0,
            epoch: 1,
            offset: 99.into(),
        })
        .unwrap();
    harness.barrier();
    assert_eq!(
        harness.calls(),
        [add_offsets(1, 1), Call::AddOffsets(1, vec![(0, Payload::from(99))])]
    );
    let stats = harness.stats();
    assert_eq!(stats.offset_entries, 1);
    assert_eq!(stats.counters.offsets_overwritten, 1);
}

#[test]
fn after_stop_writes_one_way_messages_are_dropped_requests_still_work() {
    let harness = BusHarness::scenario(1, 1);
    harness.report(0, 1);
    harness.epoch.ask(StopContinuousExecutionWrites).wait_timeout(REPLY_TIMEOUT).unwrap();
    let before = harness.stats();
    assert!(before.writes_stopped);
    harness.commit(0, 1);
    harness.report(0, 2);
    harness.commit(-1, 1); // writes-stopped wins over every other reason
    harness.barrier();
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.dropped_writes_stopped += 3),
    );
    let endpoint_stats = harness.epoch.stats();
    assert_eq!(endpoint_stats.dropped, 3, "the bus endpoint's stats count the drops too");
    assert_eq!(
        endpoint_stats.dropped_by_reason,
        [coordbus::DroppedCount { reason: DropReason::WritesStopped.label(), count: 3 }]
    );
    assert_eq!(harness.calls(), [add_offsets(1, 1)], "epoch 1 never commits");
    assert_eq!(harness.epoch.ask(IncrementAndGetEpoch).wait_timeout(REPLY_TIMEOUT).unwrap(), 2);
    assert_eq!(harness.barrier(), 2);
    // A second stop changes nothing: one-way messages are still dropped.
    harness.epoch.ask(StopContinuousExecutionWrites).wait_timeout(REPLY_TIMEOUT).unwrap();
    harness.report(0, 2);
    harness.barrier();
    assert_eq!(harness.stats().counters.dropped_writes_stopped, 4);
}

#[test]
fn negative_partition_count_is_rejected_with_its_value() {
    let harness = BusHarness::scenario(2, 2);
    let before = harness.stats();
    for (outcome, expected_side, expected_count) in [
        (
            harness.epoch.ask(SetReaderPartitions(-1)).wait_timeout(REPLY_TIMEOUT),
            PartitionSide::Reader,
            -1,
        ),
        (
            harness.epoch.ask(SetWriterPartitions(i32::MIN)).wait_timeout(REPLY_TIMEOUT),
            PartitionSide::Writer,
            i32::MIN,
        ),
    ] {
        let error = outcome.expect_err("a negative count is refused");
        // The asker gets the typed error, naming the side and the value.
        match error.handler_error::<EpochError>() {
            Some(&EpochError::InvalidPartitionCount { side, count }) => {
                assert_eq!((side, count), (expected_side, expected_count));
            }
            other => panic!("expected InvalidPartitionCount, got {other:?} from {error:?}"),
        }
        assert!(error.handler_error::<std::io::Error>().is_none(), "another type is None");
    }
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.rejected_partition_counts += 2),
    );
    // The state machine names the side and the value.
    let (query, sink, _) = recorders();
    let mut coordinator = EpochCoordinator::new(EpochConfig::new(0), query, sink).unwrap();
    assert!(matches!(
        coordinator.set_reader_partitions(-3),
        Err(EpochError::InvalidPartitionCount { side: PartitionSide::Reader, count: -3 })
    ));
}

#[test]
fn epoch_overflow_is_an_error_and_the_last_epoch_commits_once() {
    let (query, sink, log) = recorders();
    let harness = BusHarness::start(EpochConfig::new(i64::MAX), query, sink, log);
    harness.set_counts(1, 1);
    let outcome = harness.epoch.ask(IncrementAndGetEpoch).wait_timeout(REPLY_TIMEOUT);
    let error = outcome.expect_err("incrementing past i64::MAX is refused");
    assert!(matches!(
        error.handler_error::<EpochError>(),
        Some(EpochError::EpochOverflow { epoch: Epoch(i64::MAX) })
    ));
    assert_eq!(harness.barrier(), i64::MAX);
    // The last possible epoch still commits; the chain stops at i64::MAX without overflow.
    harness.commit(0, i64::MAX);
    harness.report(0, i64::MAX);
    harness.barrier();
    assert_eq!(harness.stats().last_committed, Epoch(i64::MAX));
    assert_eq!(harness.stats().counters.epochs_committed, 1);
    let committed = harness.calls();
    assert_eq!(
        committed,
        [add_offsets(i64::MAX, 1), sink_commit(i64::MAX, 1), Call::QueryCommit(i64::MAX)]
    );
    // The last epoch's messages again (SPEC B.5's quirk, at the top of the range): the epoch
    // is neither committed to the sink a second time nor left waiting.
    let before = harness.stats();
    harness.commit(0, i64::MAX);
    harness.report(0, i64::MAX);
    harness.barrier();
    assert_only_counters_changed(
        before,
        harness.stats(),
        counters_plus(before.counters, |c| c.dropped_stale_epoch += 2),
    );
    assert_eq!(harness.stats().waiting_epochs, 0);
    assert_eq!(harness.calls(), committed);
}

#[test]
fn negative_start_epoch_is_a_config_error() {
    let (query, sink, _) = recorders();
    let error = EpochCoordinator::new(EpochConfig::new(-1), query, sink).unwrap_err();
    assert!(error.to_string().contains("start_epoch"), "{error}");
}

#[test]
fn state_machine_rejections_carry_the_offending_values() {
    let (query, sink, _) = recorders();
    let mut coordinator = EpochCoordinator::new(EpochConfig::new(1), query, sink).unwrap();
    coordinator.set_reader_partitions(2).unwrap();
    coordinator.set_writer_partitions(2).unwrap();
    assert_eq!(
        coordinator.report_partition_offset(PartitionId(2), Epoch(1), 1.into()),
        Err(Rejected {
            kind: MessageKind::ReportPartitionOffset,
            partition: PartitionId(2),
            epoch: Epoch(1),
            reason: DropReason::PartitionOutOfRange { count: 2 },
        })
    );
    assert_eq!(
        coordinator
            .commit_partition_epoch(PartitionId(0), Epoch(0), 1.into())
            .map_err(|rejected| rejected.reason),
        Err(DropReason::StaleEpoch { last_committed: Epoch(0) })
    );
    coordinator.commit_partition_epoch(PartitionId(0), Epoch(1), 1.into()).unwrap();
    let duplicate =
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(1), 2.into()).unwrap_err();
    assert_eq!(duplicate.reason, DropReason::DuplicateCommit);
    assert!(duplicate.to_string().contains("partition 0"), "{duplicate}");
}

/// Memory bounded by the backlog limits (issue 4): once a queue overflowed (and the query was
/// stopped with Spark's error), a flood of messages that would add entries to it is dropped
/// and counted instead of stored, while the checks still fire on each (SPEC B.7). Messages of
/// the next epoch to commit are still taken, so the coordinator can commit and free the queue.
#[test]
fn a_queue_over_its_limit_takes_only_the_next_epoch_until_commits_free_it() {
    // Writers 1, readers 1, limit 10: reports for epochs 2..=12 overflow at 12, while epoch 1
    // (the next to commit) has nothing yet.
    let harness = BusHarness::scenario(1, 1);
    for epoch in 2..=12 {
        harness.report(0, epoch);
    }
    harness.barrier();
    let overflowed = harness.stats();
    assert_eq!(overflowed.offset_entries, 11);
    assert_eq!(overflowed.counters.backlog_overflows, 1);
    let calls_before_flood = harness.calls().len();

    // The tasks keep reporting later epochs: nothing is stored or added, and every dropped
    // report runs the checks again, which stop the query again.
    for epoch in 13..=2012 {
        harness.report(0, epoch);
    }
    harness.barrier();
    assert_only_counters_changed(
        overflowed,
        harness.stats(),
        counters_plus(overflowed.counters, |c| {
            c.dropped_backlog_full += 2000;
            c.backlog_overflows += 2000;
        }),
    );
    let flood_calls = harness.calls().split_off(calls_before_flood);
    assert_eq!(flood_calls.len(), 2000, "one stop per dropped report, nothing else");
    let overflow = "Size of the partition offset queue has exceeded its maximum";
    assert!(
        stop_messages(&flood_calls).iter().all(|message| message == overflow),
        "{flood_calls:?}"
    );

    // Epoch 1's report is taken although the queue is full, and with the commits (their queue
    // is not full) epochs 1, 2 and 3 commit; committing 3 cleans up epoch 2's offset, which
    // brings the queue back to its limit, so a report of epoch 13 is stored again. Before that,
    // epoch 13 is refused (the queue is still over its limit after epoch 2's commit).
    harness.report(0, 1);
    harness.commit(0, 1);
    harness.commit(0, 2);
    harness.report(0, 13);
    harness.commit(0, 3);
    harness.report(0, 13);
    harness.barrier();
    let after = harness.stats();
    assert_eq!(after.last_committed, Epoch(3));
    assert_eq!(after.offset_entries, 11, "epochs 3..=13");
    assert_eq!(after.counters.offsets_accepted, overflowed.counters.offsets_accepted + 2);
    assert_eq!(after.counters.dropped_backlog_full, 2001);
    let calls = harness.calls();
    for epoch in [1, 13] {
        assert!(calls.contains(&add_offsets(epoch, 1)), "epoch {epoch} not added: {calls:?}");
    }
    assert!(calls.contains(&sink_commit(3, 1)), "{calls:?}");
}

/// A partition count above the limit: its epochs cannot commit without overflowing, so the
/// next epoch to commit gets no exception from the refusal over the limit, and the side holds
/// at most the limit and one entry, not the count.
#[test]
fn a_count_above_the_limit_gets_no_exception_for_the_next_epoch() {
    let (query, sink, calls) = recorders();
    let config = EpochConfig::new(1).with_backlog_limit(2);
    let mut coordinator = EpochCoordinator::new(config, query, sink).unwrap();
    coordinator.set_reader_partitions(1000).unwrap();
    coordinator.set_writer_partitions(1).unwrap();
    for partition in 0..3 {
        coordinator.report_partition_offset(PartitionId(partition), Epoch(1), 1.into()).unwrap();
    }
    for partition in 3..1000 {
        let rejected = coordinator
            .report_partition_offset(PartitionId(partition), Epoch(1), 1.into())
            .unwrap_err();
        assert_eq!(
            rejected.reason,
            DropReason::BacklogFull { queue: BacklogQueue::PartitionOffsets, limit: 2 }
        );
    }
    let stats = coordinator.stats();
    assert_eq!(stats.offset_entries, 3, "the limit and one");
    assert_eq!(stats.counters.dropped_backlog_full, 997);
    assert_eq!(stats.counters.backlog_overflows, 998, "the third report and each refused one");
    let calls = calls.lock().unwrap();
    assert!(!calls.iter().any(|call| matches!(call, Call::AddOffsets(..))), "{calls:?}");
}

/// A coordinator of one reader and one writer with backlog limits of 2, whose commit queue is
/// over its limit: epochs 1 to 3 committed by the writer, no offset reported.
fn over_the_commit_limit(
    query: RecordingQuery,
    sink: RecordingSink,
) -> EpochCoordinator<RecordingQuery, RecordingSink> {
    let config = EpochConfig::new(1).with_backlog_limit(2);
    let mut coordinator = EpochCoordinator::new(config, query, sink).unwrap();
    coordinator.set_reader_partitions(1).unwrap();
    coordinator.set_writer_partitions(1).unwrap();
    for epoch in 1..=3 {
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(epoch), 1.into()).unwrap();
    }
    coordinator
}

/// SPEC B.4 step 2: an ignored duplicate commit runs no backlog check, also with the commit
/// queue over its limit (where every other message's check fires again).
#[test]
fn a_duplicate_commit_over_the_limit_runs_no_backlog_check() {
    let (query, sink, calls) = recorders();
    let mut coordinator = over_the_commit_limit(query, sink);
    let before = coordinator.stats();
    let stops_before = stop_messages(&calls.lock().unwrap()).len();
    assert!(stops_before > 0, "the queue overflowed");
    let rejected =
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(2), 9.into()).unwrap_err();
    assert_eq!(rejected.reason, DropReason::DuplicateCommit);
    let after = coordinator.stats();
    assert_eq!(after.counters.backlog_overflows, before.counters.backlog_overflows);
    assert_eq!(after.counters.dropped_duplicate_commit, 1);
    assert_eq!(stop_messages(&calls.lock().unwrap()).len(), stops_before, "no check, no stop");
    // A new commit over the limit does run the check (and is refused).
    coordinator.commit_partition_epoch(PartitionId(0), Epoch(4), 1.into()).unwrap_err();
    assert_eq!(
        coordinator.stats().counters.backlog_overflows,
        after.counters.backlog_overflows + 1
    );
}

/// Setting a count drops, counted, the entries kept with ids not below it: with a warning
/// that says how many, on which side.
#[test]
fn a_count_that_drops_kept_entries_logs_a_warning() {
    let (query, sink, _) = recorders();
    let mut coordinator = EpochCoordinator::new(EpochConfig::new(1), query, sink).unwrap();
    for partition in [0, 5, 6] {
        coordinator.report_partition_offset(PartitionId(partition), Epoch(1), 1.into()).unwrap();
    }
    let warnings = WarningLog::default();
    warnings.around(|| coordinator.set_reader_partitions(2).unwrap());
    let lines = warnings.lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    for part in ["partition ids not below the new partition count", "count=2", "dropped=2"] {
        assert!(lines[0].contains(part), "{part:?} missing from {lines:?}");
    }
    assert_eq!(coordinator.counters().dropped_partition_out_of_range, 2);
}

#[test]
fn a_full_queue_rejection_names_the_queue_and_its_limit() {
    let (query, sink, _) = recorders();
    let mut coordinator = over_the_commit_limit(query, sink);
    let rejected =
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(4), 1.into()).unwrap_err();
    assert_eq!(
        rejected.reason,
        DropReason::BacklogFull { queue: BacklogQueue::PartitionCommits, limit: 2 }
    );
    assert!(rejected.to_string().contains("partition commit queue"), "{rejected}");
    assert!(rejected.to_string().contains("limit of 2"), "{rejected}");
    // The offset queue is separate: a report is still stored, and completes epoch 1.
    coordinator.report_partition_offset(PartitionId(0), Epoch(1), 1.into()).unwrap();
    assert_eq!(coordinator.last_committed(), Epoch(1));
}

/// SPEC B.6: after the stop, one-way messages run no backlog check. With a queue over its
/// limit, every accepted message before the stop fires the check again; after it, none does.
#[test]
fn no_backlog_check_runs_after_writes_stop_even_over_the_limit() {
    let (query, sink, log) = recorders();
    let mut coordinator = over_the_commit_limit(query, sink);
    let stops = |log: &epoch_support::CallLog| stop_messages(&log.lock().unwrap()).len();
    assert_eq!(stops(&log), 1, "the commit queue is over its limit");
    // Before the stop, a further (refused) commit checks again.
    assert!(coordinator.commit_partition_epoch(PartitionId(0), Epoch(4), 1.into()).is_err());
    assert_eq!(stops(&log), 2);
    let overflows = coordinator.counters().backlog_overflows;
    coordinator.stop_writes();
    let before = coordinator.stats();
    for epoch in 4..=6 {
        let dropped = coordinator.commit_partition_epoch(PartitionId(0), Epoch(epoch), 1.into());
        assert_eq!(dropped.unwrap_err().reason, DropReason::WritesStopped);
        let dropped = coordinator.report_partition_offset(PartitionId(0), Epoch(epoch), 1.into());
        assert_eq!(dropped.unwrap_err().reason, DropReason::WritesStopped);
    }
    assert_eq!(stops(&log), 2, "no check ran after the stop: {:?}", log.lock().unwrap());
    assert_eq!(coordinator.counters().backlog_overflows, overflows);
    assert_only_counters_changed(
        before,
        coordinator.stats(),
        counters_plus(before.counters, |c| c.dropped_writes_stopped += 6),
    );
}

/// Writers 1, readers 1; completes epochs `epochs` in order and returns the harness.
fn run_epochs(
    query: RecordingQuery,
    sink: RecordingSink,
    log: epoch_support::CallLog,
) -> BusHarness {
    let harness = BusHarness::start(EpochConfig::new(1).with_backlog_limit(10), query, sink, log);
    harness.set_counts(1, 1);
    for epoch in 1..=4 {
        harness.commit(0, epoch);
        harness.report(0, epoch);
    }
    harness.barrier();
    harness
}

fn stop_messages(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter_map(|call| match call {
            Call::Stop { message, .. } => Some(message.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn sink_commit_failure_stops_the_query_and_commits_nothing_after() {
    let (query, mut sink, log) = recorders();
    sink.fail_at.insert(2);
    let harness = run_epochs(query, sink, log);
    let calls = harness.calls();
    assert_eq!(
        calls[..5],
        [
            add_offsets(1, 1),
            sink_commit(1, 1),
            Call::QueryCommit(1),
            add_offsets(2, 1),
            sink_commit(2, 1),
        ]
    );
    assert_eq!(stop_messages(&calls), ["the sink commit of epoch 2 failed"]);
    assert!(!calls.contains(&Call::QueryCommit(2)), "query commit after a failed sink commit");
    assert!(!calls.iter().any(|c| matches!(c, Call::SinkCommit(3.., _))));
    let stats = harness.stats();
    assert_eq!(stats.last_committed, Epoch(1));
    assert_eq!(stats.failed_epoch, Some(Epoch(2)));
    assert_eq!(stats.waiting_epochs, 3, "epochs 2, 3 and 4 wait forever");
}

/// A collaborator that panics (SPEC 0.2: a panic is a handler error) fail-stops the
/// coordinator like a failed one (SPEC 0.3): the query is stopped naming the panic and the
/// epoch, and nothing commits after it. (Before, the epoch neither committed nor failed, and
/// the later ones waited until a backlog limit stopped the query for the wrong reason.)
#[test]
fn a_panicking_sink_stops_the_query_and_commits_nothing_after() {
    let (query, mut sink, log) = recorders();
    sink.panic_at.insert(2);
    let harness = run_epochs(query, sink, log);
    let calls = harness.calls();
    let stops = stop_messages(&calls);
    assert_eq!(stops.len(), 1, "{calls:?}");
    assert!(stops[0].contains("handler panicked (next epoch to commit: 2)"), "{stops:?}");
    assert!(stops[0].contains("injected: the sink panicked at 2"), "{stops:?}");
    assert!(!calls.contains(&Call::QueryCommit(2)), "query commit after a panicked sink commit");
    assert!(!calls.iter().any(|c| matches!(c, Call::SinkCommit(3.., _))));
    let stats = harness.stats();
    assert_eq!(stats.last_committed, Epoch(1));
    assert_eq!(stats.failed_epoch, Some(Epoch(2)));
}

#[test]
fn query_commit_failure_stops_the_query_and_commits_nothing_after() {
    let (mut query, sink, log) = recorders();
    query.fail_commit_at.insert(3);
    let harness = run_epochs(query, sink, log);
    let calls = harness.calls();
    assert_eq!(stop_messages(&calls), ["recording the commit of epoch 3 failed"]);
    let sink_epochs: Vec<i64> = calls
        .iter()
        .filter_map(|c| match c {
            Call::SinkCommit(epoch, _) => Some(*epoch),
            _ => None,
        })
        .collect();
    assert_eq!(sink_epochs, [1, 2, 3], "the sink committed 3 before the record failed");
    assert_eq!(harness.stats().last_committed, Epoch(2));
}

#[test]
fn add_offsets_failure_stops_the_query_and_blocks_the_commit() {
    let (mut query, sink, log) = recorders();
    query.fail_add_offsets_at.insert(1);
    let harness = run_epochs(query, sink, log);
    let calls = harness.calls();
    assert_eq!(stop_messages(&calls), ["recording the offsets of epoch 1 failed"]);
    assert!(!calls.iter().any(|c| matches!(c, Call::SinkCommit(..))));
    assert_eq!(harness.stats().failed_epoch, Some(Epoch(1)));
}

#[test]
fn coordinator_names_are_fresh_per_run() {
    let first = coordinator_name("run42");
    let second = coordinator_name("run42");
    assert_ne!(first, second);
    let uuid = first.strip_prefix("EpochCoordinator-run42--").expect("prefix");
    assert_eq!(uuid.len(), 36, "{uuid}");
}

/// Issue 4: bad input is "rejected with a counted, logged warning". Each kind warns with the
/// message it dropped (kind, partition, epoch, reason and its value); repeats of one kind warn
/// at counts 1, 2, 4, 8, ... so a flood cannot flood the log; drops after writes stopped are
/// expected (lame-duck tasks, SPEC B.6) and do not warn.
#[test]
fn each_kind_of_bad_input_logs_a_warning_naming_the_message() {
    let (query, sink, _) = recorders();
    let mut coordinator = EpochCoordinator::new(EpochConfig::new(1), query, sink).unwrap();
    coordinator.set_reader_partitions(2).unwrap();
    coordinator.set_writer_partitions(2).unwrap();
    let warnings = WarningLog::default();
    warnings.around(|| {
        coordinator.report_partition_offset(PartitionId(2), Epoch(1), 1.into()).unwrap_err();
        coordinator.commit_partition_epoch(PartitionId(-4), Epoch(1), 1.into()).unwrap_err();
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(0), 1.into()).unwrap_err();
        coordinator.commit_partition_epoch(PartitionId(1), Epoch(1), 1.into()).unwrap();
        coordinator.commit_partition_epoch(PartitionId(1), Epoch(1), 2.into()).unwrap_err();
    });
    let lines = warnings.lines();
    epoch_support::assert_warnings_name_the_four_bad_messages(&lines);

    // Nine more out-of-range reports: the kind's drops 2..=10 warn at 2, 4 and 8.
    let warnings = WarningLog::default();
    warnings.around(|| {
        for _ in 0..9 {
            coordinator.report_partition_offset(PartitionId(7), Epoch(1), 1.into()).unwrap_err();
        }
    });
    let lines = warnings.lines();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[2].contains("dropped_for_this_reason=8"), "{lines:?}");
    assert_eq!(coordinator.counters().dropped_partition_out_of_range, 10);

    // After writes stop, drops are counted but not warned about.
    coordinator.stop_writes();
    let warnings = WarningLog::default();
    warnings.around(|| {
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(1), 1.into()).unwrap_err();
    });
    assert_eq!(warnings.lines(), Vec::<String>::new());
    assert_eq!(coordinator.counters().dropped_writes_stopped, 1);
}
