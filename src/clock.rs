//! Injectable time source.
//!
//! Everything in coordbus that depends on wall-clock time (WAL record times, segment rolling,
//! cleanup thresholds, lag reports) asks a [`Clock`] instead of the system, so tests can drive
//! time by hand (SPEC 0.1). Times are milliseconds since the Unix epoch, as in Spark.

use std::sync::{
    atomic::{AtomicI64, Ordering},
    Arc,
};

/// A source of the current time in milliseconds.
pub trait Clock: Send + Sync + 'static {
    /// The current time in milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
}

/// The operating system's real-time clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        let since_epoch =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
    }
}

/// A clock that only moves when told to; clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now_ms: Arc<AtomicI64>,
}

impl ManualClock {
    /// A manual clock starting at `start_ms`.
    pub fn new(start_ms: i64) -> Self {
        Self { now_ms: Arc::new(AtomicI64::new(start_ms)) }
    }

    /// Sets the time to `now_ms`.
    pub fn set_ms(&self, now_ms: i64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }

    /// Moves the time by `delta_ms` (saturating at the ends of `i64`, never wrapping to the
    /// other end) and returns the new time.
    pub fn advance_ms(&self, delta_ms: i64) -> i64 {
        let advance = |now: i64| Some(now.saturating_add(delta_ms));
        // `advance` never declines, so the update never fails.
        let (Ok(before) | Err(before)) =
            self.now_ms.fetch_update(Ordering::SeqCst, Ordering::SeqCst, advance);
        before.saturating_add(delta_ms)
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_ms(&self) -> i64 {
        (**self).now_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told_and_clones_share_time() {
        let clock = ManualClock::new(10_000);
        let other = clock.clone();
        assert_eq!(clock.now_ms(), 10_000);
        assert_eq!(clock.advance_ms(500), 10_500);
        assert_eq!(other.now_ms(), 10_500);
        other.set_ms(3);
        assert_eq!(clock.now_ms(), 3);
        assert_eq!(clock.advance_ms(-20_000), -19_997, "backwards too");
    }

    #[test]
    fn manual_clock_stops_at_the_ends_of_time_instead_of_wrapping() {
        let clock = ManualClock::new(i64::MAX - 1);
        assert_eq!(clock.advance_ms(10), i64::MAX);
        assert_eq!(clock.now_ms(), i64::MAX);
        clock.set_ms(i64::MIN + 1);
        assert_eq!(clock.advance_ms(-10), i64::MIN);
        assert_eq!(clock.now_ms(), i64::MIN);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }
}
