//! Goal (issue 4): small payloads (a few machine words: up to three, `Payload::INLINE_BYTES`)
//! cost no allocation per message, and memory stays bounded by the backlog limits: the
//! payloads of committed epochs are freed, so recycled buckets do not keep old writer commit
//! messages alive, and pending epochs are laid out by partition only where the partition count
//! is within the limit.
//!
//! Method: `allocation_counter` (the global allocator of this test binary) counts the
//! allocations and live bytes of the test's own thread while it drives the state machine with
//! a query and sink that keep nothing (`NoopQuery`, `NoopSink`). Each count is checked against a
//! run that must allocate (payloads too large to be inline), so a counter that saw nothing would
//! fail the test.

use coordbus::coordinators::epoch::{
    Epoch, EpochConfig, EpochCoordinator, NoopQuery, NoopSink, PartitionId, Payload,
};

const PARTITIONS: i32 = 100;

fn coordinator() -> EpochCoordinator<NoopQuery, NoopSink> {
    let mut coordinator = EpochCoordinator::new(EpochConfig::new(1), NoopQuery, NoopSink).unwrap();
    coordinator.set_reader_partitions(PARTITIONS).unwrap();
    coordinator.set_writer_partitions(PARTITIONS).unwrap();
    coordinator
}

/// Runs epochs `epochs` with the writers `ahead` epochs ahead of the readers (as tasks race
/// ahead of each other), so several buckets are live at once; every epoch commits.
fn run(
    coordinator: &mut EpochCoordinator<NoopQuery, NoopSink>,
    epochs: std::ops::RangeInclusive<i64>,
    ahead: i64,
    message: impl Fn(i64) -> Payload,
) {
    let word_offset =
        |epoch: i64, partition: i32| Payload::from(epoch * 1000 + i64::from(partition));
    run_with_offsets(coordinator, epochs, ahead, message, word_offset);
}

/// As [`run`], with the offsets made by `offset(epoch, partition)`.
fn run_with_offsets(
    coordinator: &mut EpochCoordinator<NoopQuery, NoopSink>,
    epochs: std::ops::RangeInclusive<i64>,
    ahead: i64,
    message: impl Fn(i64) -> Payload,
    offset: impl Fn(i64, i32) -> Payload,
) {
    let (first, last) = (*epochs.start(), *epochs.end());
    for epoch in first..=last + ahead {
        if epoch <= last {
            for partition in 0..PARTITIONS {
                let commit = message(epoch);
                coordinator
                    .commit_partition_epoch(PartitionId(partition), Epoch(epoch), commit)
                    .unwrap();
            }
        }
        let reported = epoch - ahead;
        if reported >= first {
            for partition in 0..PARTITIONS {
                let offset = offset(reported, partition);
                coordinator
                    .report_partition_offset(PartitionId(partition), Epoch(reported), offset)
                    .unwrap();
            }
        }
    }
    assert_eq!(coordinator.last_committed(), Epoch(last), "every epoch committed");
}

#[test]
fn small_payloads_cost_no_allocation_per_message_in_a_steady_run() {
    let small = |epoch: i64| Payload::from(epoch);
    let mut coordinator = coordinator();
    // Warm up: the buckets, their slots and the epoch map reach their working size.
    run(&mut coordinator, 1..=40, 8, small);
    let steady = allocation_counter::measure(|| run(&mut coordinator, 41..=240, 8, small));
    let messages = 200 * 2 * PARTITIONS as u64;
    assert_eq!(steady.count_total, 0, "{messages} messages of 8 bytes: {steady:?}");

    // The counter sees the coordinator's thread: 40-byte commit messages spill to the heap.
    let large = |epoch: i64| Payload::from(vec![epoch as u8; 40]);
    let spilled = allocation_counter::measure(|| run(&mut coordinator, 241..=250, 8, large));
    assert!(spilled.count_total >= 10 * PARTITIONS as u64, "{spilled:?}");
}

/// A payload of `words` machine words, made of `value` (not a single word, so it is stored
/// as bytes, not as a word).
fn words_payload(words: usize, value: i64) -> Payload {
    let mut bytes = [0u8; 5 * 8];
    for (word, chunk) in bytes.chunks_exact_mut(8).take(words).enumerate() {
        chunk.copy_from_slice(&(value + word as i64).to_le_bytes());
    }
    Payload::from(&bytes[..words * 8])
}

/// "A few machine words": payloads of two and three words (the inline limit,
/// `Payload::INLINE_BYTES`), offsets and commit messages alike, take the bytes path of a
/// side, not the word path of the 8-byte run; they cost no allocation per message either.
#[test]
fn two_and_three_word_payloads_cost_no_allocation_per_message() {
    assert_eq!(Payload::INLINE_BYTES, 24, "three words are the inline limit");
    for words in [2, 3] {
        let message = |epoch: i64| words_payload(words, epoch);
        let offset =
            |epoch: i64, partition: i32| words_payload(words, epoch * 1000 + i64::from(partition));
        let mut coordinator = coordinator();
        run_with_offsets(&mut coordinator, 1..=40, 8, message, offset);
        let steady = allocation_counter::measure(|| {
            run_with_offsets(&mut coordinator, 41..=240, 8, message, offset);
        });
        let messages = 200 * 2 * PARTITIONS as u64;
        assert_eq!(steady.count_total, 0, "{messages} messages of {words} words: {steady:?}");
        // Two words more are past `Payload::INLINE_BYTES`: they spill to the heap, and the
        // counter sees it.
        let spilled = allocation_counter::measure(|| {
            let message = |epoch: i64| words_payload(words + 2, epoch);
            run_with_offsets(&mut coordinator, 241..=250, 8, message, offset);
        });
        assert!(spilled.count_total >= 10 * PARTITIONS as u64, "{spilled:?}");
    }
}

#[test]
fn committed_epochs_keep_no_large_commit_messages_alive() {
    const MESSAGE_BYTES: usize = 4096;
    let large = |epoch: i64| Payload::from(vec![epoch as u8; MESSAGE_BYTES]);
    let small = |epoch: i64| Payload::from(epoch);
    // The same run twice, with 8-byte and with 4 KiB commit messages: what the second keeps
    // allocated beyond the first is payloads of committed epochs.
    let mut kept = [0i64; 2];
    for (round, large_messages) in [false, true].into_iter().enumerate() {
        // The coordinator outlives the measurement, so what it still holds counts as kept.
        let mut outlives = None;
        let info = allocation_counter::measure(|| {
            let mut coordinator = coordinator();
            if large_messages {
                run(&mut coordinator, 1..=60, 12, large);
            } else {
                run(&mut coordinator, 1..=60, 12, small);
            }
            outlives = Some(coordinator);
        });
        assert!(info.bytes_total > 0, "{info:?}");
        kept[round] = info.bytes_current;
        drop(outlives);
    }
    let [with_small, with_large] = kept;
    let one_epoch_of_messages = (PARTITIONS as usize * MESSAGE_BYTES) as i64;
    assert!(
        with_large - with_small < one_epoch_of_messages / 4,
        "a coordinator with every epoch committed still holds {} bytes more with 4 KiB commit \
         messages ({with_large} against {with_small})",
        with_large - with_small
    );
}

/// Peak bytes the coordinator's thread holds while epochs `1..=16` each get one offset report
/// and one writer commit (16 entries per side, far below the limit of 64), with 16 Ki reader
/// and writer partitions.
fn peak_bytes_of_sixteen_thin_epochs(backlog_limit: usize) -> u64 {
    let info = allocation_counter::measure(|| {
        let config = EpochConfig::new(1).with_backlog_limit(backlog_limit);
        let mut coordinator = EpochCoordinator::new(config, NoopQuery, NoopSink).unwrap();
        coordinator.set_reader_partitions(1 << 14).unwrap();
        coordinator.set_writer_partitions(1 << 14).unwrap();
        for epoch in 1..=16 {
            let partition = PartitionId(epoch as i32);
            coordinator.report_partition_offset(partition, Epoch(epoch), epoch.into()).unwrap();
            coordinator.commit_partition_epoch(partition, Epoch(epoch), epoch.into()).unwrap();
        }
        assert!(coordinator.counters().dropped() == 0, "no limit was reached");
    });
    info.bytes_max
}

#[test]
fn pending_epochs_take_memory_bounded_by_the_backlog_limits() {
    // A dense side is sized by the partition count (40 bytes per partition), not by what it
    // holds: with 16 Ki partitions and a limit of 64 entries, sixteen epochs laid out densely
    // would take 16 x 2 x 16 Ki x 40 bytes = 20 MiB for 32 entries.
    let small_limit = peak_bytes_of_sixteen_thin_epochs(64);
    assert!(
        small_limit < 256 * 1024,
        "32 entries at a backlog limit of 64 took {small_limit} bytes at the peak"
    );
    // The same messages under a limit that allows the dense layout: the counter sees it.
    let large_limit = peak_bytes_of_sixteen_thin_epochs(1 << 20);
    assert!(
        large_limit > 16 * 2 * (1 << 14) * 40,
        "dense layouts within a limit of 2^20 took only {large_limit} bytes"
    );
}
