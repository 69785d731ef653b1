//! Bounds for the queue's unit tests: a broken queue must fail its test, not hang CI.

use std::time::{Duration, Instant};

/// How long a wait may take before the test fails: generous here, a hundred times that under
/// Miri (orders of magnitude slower, on the real clock with isolation disabled).
pub(super) fn bound(seconds: u64) -> Duration {
    Duration::from_secs(if cfg!(miri) { seconds * 100 } else { seconds })
}

/// Joins `handle`, failing the test instead of hanging if the thread has not finished within
/// `timeout`; a panic of the thread is passed on with its own message.
pub(super) fn join_within<T>(
    handle: std::thread::JoinHandle<T>,
    timeout: Duration,
    what: &str,
) -> T {
    let deadline = Instant::now() + timeout;
    while !handle.is_finished() {
        assert!(Instant::now() < deadline, "{what}: thread still running after {timeout:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    handle.join().unwrap_or_else(|payload| std::panic::resume_unwind(payload))
}
