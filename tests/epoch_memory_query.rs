//! Goal: the in-memory query keeps Spark's offset and commit logs (first offsets record wins,
//! commit needs offsets, only the newest epochs retained, first stop error kept), and a run
//! restarted from its restart point continues where it stopped: every epoch is committed exactly
//! once, in order, and messages that arrive again for committed epochs are dropped.
//!
//! Method: two coordinator runs on the bus share one `MemoryQuery` (its clones share state) and
//! a recording sink; the second run starts at `last committed + 1` as SPEC B.10 prescribes, gets
//! a replay of the first run's last messages plus new epochs, and the sink's commit log is
//! checked for gap-free, duplicate-free order. The query's own rules are checked directly.

mod epoch_support;

use coordbus::{
    coordinators::epoch::{
        coordinator_name, BacklogQueue, CommitPartitionEpoch, Epoch, EpochConfig, EpochEndpoint,
        EpochError, GetCurrentEpoch, GetEpochStats, MemoryQuery, Offsets, PartitionId, Payload,
        Query, ReportPartitionOffset, SetReaderPartitions, SetWriterPartitions,
    },
    Bus, EndpointRef,
};
use epoch_support::{recorders, Call, RecordingSink, REPLY_TIMEOUT};

type Endpoint = EpochEndpoint<MemoryQuery, RecordingSink>;

fn start_run(bus: &Bus, query: MemoryQuery, sink: RecordingSink) -> EndpointRef<Endpoint> {
    let start = match query.restart_point().unwrap() {
        None => 0,
        Some((last, offsets)) => {
            assert_eq!(offsets.len(), 2, "restart offsets of epoch {last}");
            last.0 + 1
        }
    };
    let endpoint = EpochEndpoint::new(EpochConfig::new(start), query, sink).unwrap();
    let epoch = bus.register(coordinator_name("restart"), endpoint).unwrap();
    epoch.ask(SetReaderPartitions(2)).wait_timeout(REPLY_TIMEOUT).unwrap();
    epoch.ask(SetWriterPartitions(2)).wait_timeout(REPLY_TIMEOUT).unwrap();
    epoch
}

fn send_epoch(epoch_ref: &EndpointRef<Endpoint>, epoch: i64) {
    for partition in 0..2 {
        epoch_ref
            .send(ReportPartitionOffset {
                partition,
                epoch,
                offset: (epoch * 10 + i64::from(partition)).into(),
            })
            .unwrap();
        epoch_ref.send(CommitPartitionEpoch { partition, epoch, message: epoch.into() }).unwrap();
    }
}

#[test]
fn restarted_run_commits_every_epoch_exactly_once_in_order() {
    // Stop points: before any commit, after the first epoch, and in the middle of the run.
    for last_before_stop in [-1, 0, 3, 6] {
        restart_after(last_before_stop);
    }
}

/// Commits epochs `0..=last_before_stop`, half-sends the next one, stops the run, restarts from
/// the query's restart point, replays the last committed epoch (stale tasks) and runs to 9.
fn restart_after(last_before_stop: i64) {
    let bus = Bus::builder().inbox_shards(2).build().unwrap();
    let query = MemoryQuery::new(3);
    let (_, sink, log) = recorders();

    let first = start_run(&bus, query.clone(), sink.clone());
    for epoch in 0..=last_before_stop {
        send_epoch(&first, epoch);
    }
    // The next epoch is half done when the run stops: reported, not committed.
    let half = last_before_stop + 1;
    first.send(ReportPartitionOffset { partition: 0, epoch: half, offset: 70.into() }).unwrap();
    first.ask(GetCurrentEpoch).wait_timeout(REPLY_TIMEOUT).unwrap();
    let expected_last = (last_before_stop >= 0).then_some(Epoch(last_before_stop));
    assert_eq!(query.last_committed(), expected_last);
    assert!(first.stop());

    let second = start_run(&bus, query.clone(), sink);
    assert_eq!(second.ask(GetCurrentEpoch).wait_timeout(REPLY_TIMEOUT).unwrap(), half);
    // Stale tasks re-send the last committed epoch; then the run goes on.
    if last_before_stop >= 0 {
        send_epoch(&second, last_before_stop);
    }
    for epoch in half..=9 {
        send_epoch(&second, epoch);
    }
    let stats = second.ask(GetEpochStats).wait_timeout(REPLY_TIMEOUT).unwrap();
    let stale = if last_before_stop >= 0 { 4 } else { 0 };
    assert_eq!(stats.counters.dropped_stale_epoch, stale, "re-sent committed epoch dropped");
    assert_eq!(query.last_committed(), Some(Epoch(9)));

    let sink_epochs: Vec<i64> = epoch_support::calls(&log)
        .iter()
        .filter_map(|call| match call {
            Call::SinkCommit(epoch, _) => Some(*epoch),
            _ => None,
        })
        .collect();
    assert_eq!(sink_epochs, (0..=9).collect::<Vec<_>>(), "stop after {last_before_stop}");
    // Only the newest three committed epochs keep their offsets.
    assert_eq!(query.offsets(Epoch(6)), None);
    assert_eq!(
        query.offsets(Epoch(9)),
        Some(vec![(PartitionId(0), 90.into()), (PartitionId(1), 91.into())])
    );
    assert!(!query.is_stopped());
    bus.shutdown().unwrap();
}

#[test]
fn memory_query_keeps_the_first_offsets_and_the_first_stop_error() {
    let mut query = MemoryQuery::default();
    let first = [(PartitionId(0), Payload::from(1))];
    query.add_offsets(Epoch(1), Offsets::new(&first)).unwrap();
    query.add_offsets(Epoch(1), Offsets::new(&[(PartitionId(0), Payload::from(2))])).unwrap();
    assert_eq!(query.offsets(Epoch(1)), Some(first.to_vec()));

    let error = query.commit(Epoch(2)).unwrap_err();
    assert_eq!(error.to_string(), "Batch 2 was committed without end epoch offsets!");
    assert_eq!(query.last_committed(), None);
    query.commit(Epoch(1)).unwrap();
    assert_eq!(query.restart_point().unwrap().map(|(epoch, _)| epoch), Some(Epoch(1)));

    query.stop(EpochError::QueryCommit { epoch: Epoch(5), source: "the disk is gone".into() });
    query.stop(EpochError::EpochOverflow { epoch: Epoch(6) });
    let first = query.stop_error().expect("the query was stopped");
    assert!(matches!(*first, EpochError::QueryCommit { epoch: Epoch(5), .. }), "{first:?}");
    assert_eq!(
        first.stop_text(),
        "recording the commit of epoch 5 failed: the disk is gone",
        "the first stop error, with its cause"
    );
}

/// An overflow's message is Spark's, verbatim, and names neither the size nor the limit: the
/// stop error the query keeps adds both.
#[test]
fn an_overflow_stop_error_names_the_queue_size_and_limit() {
    let query = MemoryQuery::default();
    query.clone().stop(EpochError::BacklogExceeded {
        queue: BacklogQueue::PartitionOffsets,
        size: 11,
        limit: 10,
    });
    let first = query.stop_error().expect("the query was stopped");
    assert!(matches!(
        *first,
        EpochError::BacklogExceeded { queue: BacklogQueue::PartitionOffsets, size: 11, limit: 10 }
    ));
    assert_eq!(
        first.stop_text(),
        "Size of the partition offset queue has exceeded its maximum (size 11, limit 10)"
    );
}

#[test]
fn the_last_committed_epochs_offsets_are_always_retained() {
    // Even when retaining a single epoch, the restart point has its offsets.
    let mut query = MemoryQuery::new(1);
    query.add_offsets(Epoch(3), Offsets::new(&[(PartitionId(0), Payload::from(3))])).unwrap();
    query.commit(Epoch(3)).unwrap();
    assert!(query.offsets(Epoch(3)).is_some(), "the last committed epoch is retained");
    assert!(matches!(query.restart_point(), Ok(Some((Epoch(3), _)))));
}

#[test]
fn a_retention_too_large_for_an_epoch_count_keeps_every_epoch() {
    // `usize::MAX` used to wrap to -1 as an epoch count, so a commit dropped its own offsets
    // and the restart point failed with "committed without end epoch offsets".
    for retained in [usize::MAX, 1 << 63, i64::MAX as usize] {
        let mut query = MemoryQuery::new(retained);
        for epoch in 0..3 {
            query
                .add_offsets(Epoch(epoch), Offsets::new(&[(PartitionId(0), Payload::from(epoch))]))
                .unwrap();
            query.commit(Epoch(epoch)).unwrap();
        }
        for epoch in 0..3 {
            assert!(query.offsets(Epoch(epoch)).is_some(), "epoch {epoch} dropped ({retained})");
        }
        assert!(matches!(query.restart_point(), Ok(Some((Epoch(2), _)))), "{retained}");
    }
}

/// SPEC B.10: the offsets a stopped run recorded for an epoch it did not commit are ignored on
/// restart. Before, the first record won across runs too, so the restart point after the
/// restarted run committed that epoch named the stopped run's offsets, not the ones the commit
/// stood for (data skipped or repeated on the next restart).
#[test]
fn a_restarted_run_replaces_the_offsets_a_stopped_run_recorded_for_an_epoch_it_did_not_commit() {
    let query = MemoryQuery::default();
    let offsets = |value: i64| vec![(PartitionId(0), Payload::from(value))];
    let mut stopped_run = query.clone();
    stopped_run.add_offsets(Epoch(0), Offsets::new(&offsets(10))).unwrap();
    stopped_run.commit(Epoch(0)).unwrap();
    // Epoch 1 reached its offsets but not its commit when the run stopped.
    stopped_run.add_offsets(Epoch(1), Offsets::new(&offsets(70))).unwrap();
    drop(stopped_run);

    let mut restarted_run = query.clone();
    restarted_run.add_offsets(Epoch(1), Offsets::new(&offsets(11))).unwrap();
    // Within one run the first record still wins.
    restarted_run.add_offsets(Epoch(1), Offsets::new(&offsets(12))).unwrap();
    restarted_run.commit(Epoch(1)).unwrap();
    assert_eq!(query.restart_point().unwrap(), Some((Epoch(1), offsets(11))));
    // A committed epoch's record stays, whichever run records it again later (an old endpoint
    // still draining its inbox, say).
    query.clone().add_offsets(Epoch(1), Offsets::new(&offsets(99))).unwrap();
    assert_eq!(query.restart_point().unwrap(), Some((Epoch(1), offsets(11))));
}

#[test]
fn a_coordinator_starts_exactly_at_the_first_epoch_the_memory_query_did_not_commit() {
    let mut query = MemoryQuery::default();
    assert_eq!(query.last_committed_epoch(), None);
    // Nothing committed: any start epoch is taken.
    let (_, sink, _) = recorders();
    EpochEndpoint::new(EpochConfig::new(3), query.clone(), sink.clone()).unwrap();
    query.add_offsets(Epoch(4), Offsets::new(&[(PartitionId(0), Payload::from(4))])).unwrap();
    query.commit(Epoch(4)).unwrap();
    assert_eq!(query.last_committed_epoch(), Some(Epoch(4)));
    // Below it, the sink would commit epochs again.
    let error = EpochEndpoint::new(EpochConfig::new(3), query.clone(), sink.clone()).unwrap_err();
    assert!(error.to_string().contains("start_epoch"), "{error}");
    assert!(error.to_string().contains("committed up to 4"), "{error}");
    assert!(error.to_string().contains("commit the epochs in between again"), "{error}");
    // Above it, epochs 5 and 6 would never commit (SPEC B.10: start = E + 1).
    let error = EpochEndpoint::new(EpochConfig::new(7), query.clone(), sink.clone()).unwrap_err();
    assert!(error.to_string().contains("7 (the query has committed up to 4)"), "{error}");
    assert!(error.to_string().contains("would never commit"), "{error}");
    EpochEndpoint::new(EpochConfig::new(5), query.clone(), sink).unwrap();
}

/// A query that committed `i64::MAX` has no epoch left: a coordinator it is handed on to would
/// start at `i64::MAX` again (the epoch after it does not exist) and commit it a second time.
#[test]
fn a_query_that_committed_the_last_epoch_takes_no_new_coordinator() {
    let mut query = MemoryQuery::default();
    let last = Epoch(i64::MAX);
    query.add_offsets(last, Offsets::new(&[(PartitionId(0), Payload::from(1))])).unwrap();
    query.commit(last).unwrap();
    let (_, sink, _) = recorders();
    for start in [i64::MAX - 1, i64::MAX] {
        let error =
            EpochEndpoint::new(EpochConfig::new(start), query.clone(), sink.clone()).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains(&format!("{start} (the query has committed up to {last})")),
            "{text}"
        );
        assert!(text.contains("no epoch is left to start at"), "{text}");
    }
}
