//! Goal: bad input that reaches the epoch coordinator through the bus is dropped with a
//! counted, logged warning naming the message, as it is on the state machine
//! (`epoch_bad_input.rs`). The endpoint's thread logs it, hence a capture of every thread.
//!
//! Method: one test in its own binary, so that the capture of every thread's warnings
//! (`WarningLog::around_every_thread`) sees no other test's. The messages are sent from the
//! test thread and the barrier (`GetCurrentEpoch` from the same thread) waits until they were
//! handled.

mod epoch_support;
mod warning_capture;

use epoch_support::BusHarness;
use warning_capture::WarningLog;

#[test]
fn bad_input_through_the_bus_logs_a_warning_naming_each_message() {
    let harness = BusHarness::scenario(2, 2);
    let warnings = WarningLog::default();
    warnings.around_every_thread(|| {
        harness.report(2, 1); // out of range: the count is 2
        harness.commit(-4, 1); // negative partition
        harness.commit(0, 0); // stale: epoch 0 is the last committed
        harness.commit(1, 1);
        harness.commit(1, 1); // duplicate commit
        harness.barrier();
    });
    let dropped: Vec<String> =
        warnings.lines().into_iter().filter(|line| line.contains("message dropped")).collect();
    epoch_support::assert_warnings_name_the_four_bad_messages(&dropped);
    let counters = harness.stats().counters;
    assert_eq!(
        (
            counters.dropped_partition_out_of_range,
            counters.dropped_negative_partition,
            counters.dropped_stale_epoch,
            counters.dropped_duplicate_commit,
        ),
        (1, 1, 1, 1)
    );
}
