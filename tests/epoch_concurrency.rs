//! Goal: with several producer threads sending reports and commits for interleaved epochs (and a
//! driver thread incrementing the epoch meanwhile), every epoch is committed exactly once, in
//! order, with every partition's message, sorted, and the sink commit precedes the query commit.
//!
//! Method: three producer threads own disjoint partition ranges and send their epochs with
//! `send` and `send_batch` (one of them in reverse partition order); a driver thread asks
//! `IncrementAndGetEpoch`. Each producer ends with the barrier ask, so once they are joined
//! every message was handled; then the recorded call log is checked. Sizes are small for a
//! 2-core machine.

mod epoch_support;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use coordbus::coordinators::epoch::{
    CommitPartitionEpoch, EpochConfig, EpochMessage, GetCurrentEpoch, GetEpochStats,
    IncrementAndGetEpoch, ReportPartitionOffset,
};
use epoch_support::{message, offset, recorders, BusHarness, Call, REPLY_TIMEOUT};

const PARTITIONS: i32 = 12;
const EPOCHS: i64 = 150;
/// How long the producers and the driver may take in all before the test fails (well under a
/// second when things work).
const RUN_BOUND: Duration = Duration::from_secs(120);

#[test]
fn concurrent_producers_commit_every_epoch_once_in_order() {
    let (query, sink, log) = recorders();
    let harness = Arc::new(BusHarness::start(
        EpochConfig::new(1).with_backlog_limit(100_000),
        query,
        sink,
        log,
    ));
    harness.set_counts(PARTITIONS, PARTITIONS);

    let mut threads = Vec::new();
    for producer in 0..3 {
        let epoch_ref = harness.epoch.clone();
        threads.push(std::thread::spawn(move || {
            let mut partitions: Vec<i32> = (producer * 4..producer * 4 + 4).collect();
            if producer == 1 {
                partitions.reverse();
            }
            for epoch in 1..=EPOCHS {
                let batch: Vec<EpochMessage> = partitions
                    .iter()
                    .flat_map(|&partition| {
                        [
                            ReportPartitionOffset {
                                partition,
                                epoch,
                                offset: offset(partition, epoch),
                            }
                            .into(),
                            CommitPartitionEpoch {
                                partition,
                                epoch,
                                message: message(partition, epoch),
                            }
                            .into(),
                        ]
                    })
                    .collect();
                if producer == 2 {
                    for one in batch {
                        epoch_ref.send(one).unwrap();
                    }
                } else {
                    epoch_ref.send_batch(batch).unwrap();
                }
            }
            epoch_ref.ask(GetCurrentEpoch).wait_timeout(REPLY_TIMEOUT).unwrap();
        }));
    }
    let driver = {
        let epoch_ref = harness.epoch.clone();
        std::thread::spawn(move || {
            for _ in 1..EPOCHS {
                epoch_ref.ask(IncrementAndGetEpoch).wait_timeout(REPLY_TIMEOUT).unwrap();
            }
        })
    };
    // Joined once all are done (bounded: a producer blocked for good in `send` fails the test
    // instead of hanging it).
    let deadline = Instant::now() + RUN_BOUND;
    while !(threads.iter().all(|thread| thread.is_finished()) && driver.is_finished()) {
        assert!(Instant::now() < deadline, "producers or driver running after {RUN_BOUND:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    for thread in threads {
        thread.join().unwrap();
    }
    driver.join().unwrap();

    let stats = harness.epoch.ask(GetEpochStats).wait_timeout(REPLY_TIMEOUT).unwrap();
    assert_eq!(stats.current_epoch.0, EPOCHS);
    assert_eq!(stats.last_committed.0, EPOCHS);
    assert_eq!(stats.counters.dropped(), 0);
    assert_eq!(stats.waiting_epochs, 0);

    let commits: Vec<Call> =
        harness.calls().into_iter().filter(|call| !matches!(call, Call::AddOffsets(..))).collect();
    let mut expected = Vec::new();
    for epoch in 1..=EPOCHS {
        expected.push(epoch_support::sink_commit(epoch, PARTITIONS));
        expected.push(Call::QueryCommit(epoch));
    }
    assert_eq!(commits, expected);
    let added: Vec<i64> = harness
        .calls()
        .iter()
        .filter_map(|call| match call {
            Call::AddOffsets(epoch, offsets) => {
                assert_eq!(offsets.len(), PARTITIONS as usize);
                Some(*epoch)
            }
            _ => None,
        })
        .collect();
    let mut sorted = added.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (1..=EPOCHS).collect::<Vec<_>>(), "offsets added once per epoch");
}
