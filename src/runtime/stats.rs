//! Cheap always-on measurements of an endpoint: a power-of-two histogram of handler times, and
//! counts of the messages the endpoint dropped, by reason.
//!
//! Timing every message would cost two clock reads (~40 ns) per message, more than the rest of
//! the handling path; so one message in [`HANDLER_TIME_SAMPLE_EVERY`] is timed (one in 64
//! still cost a no-op endpoint 14% of its time at 100 M messages/s; one in 256 leaves
//! thousands of samples a second at a million messages a second). The histogram
//! has one bucket per power of two of nanoseconds, written by the endpoint thread only (plain
//! load + store, no locked instruction) and readable from any thread at any time.

use std::sync::atomic::{AtomicU64, Ordering};

/// One message in this many has its handler timed.
pub(crate) const HANDLER_TIME_SAMPLE_EVERY: u64 = 256;

const BUCKETS: usize = 48;

/// A histogram with a bucket per power of two, single writer, many readers.
#[derive(Debug)]
pub(crate) struct Log2Histogram {
    /// `buckets[i]` counts values `v` with `64 - v.leading_zeros() == i`, i.e. `v < 2^i`.
    buckets: [AtomicU64; BUCKETS],
}

impl Default for Log2Histogram {
    fn default() -> Self {
        Self { buckets: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

impl Log2Histogram {
    /// Writer only: counts one value.
    pub(crate) fn record(&self, value: u64) {
        let index = ((u64::BITS - value.leading_zeros()) as usize).min(BUCKETS - 1);
        let bucket = &self.buckets[index];
        bucket.store(bucket.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// A summary: sample count and upper bounds of the p50, p99 and largest buckets.
    pub(crate) fn summary(&self) -> TimeSummary {
        let counts: Vec<u64> =
            self.buckets.iter().map(|bucket| bucket.load(Ordering::Relaxed)).collect();
        let samples: u64 = counts.iter().sum();
        let upper_bound = |index: usize| if index == 0 { 0 } else { 1u64 << index };
        let quantile = |fraction: f64| -> Option<u64> {
            let rank = ((samples as f64) * fraction).ceil().max(1.0) as u64;
            let mut seen = 0;
            counts.iter().enumerate().find_map(|(index, &count)| {
                seen += count;
                (seen >= rank).then(|| upper_bound(index))
            })
        };
        if samples == 0 {
            return TimeSummary::default();
        }
        TimeSummary {
            samples,
            p50_ns_at_most: quantile(0.50),
            p99_ns_at_most: quantile(0.99),
            max_ns_at_most: counts.iter().rposition(|&count| count > 0).map(upper_bound),
        }
    }
}

/// Handler times of sampled messages, as power-of-two upper bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TimeSummary {
    /// Messages timed (one in 256 handled).
    pub samples: u64,
    /// The median is below this many nanoseconds.
    pub p50_ns_at_most: Option<u64>,
    /// The 99th percentile is below this many nanoseconds.
    pub p99_ns_at_most: Option<u64>,
    /// The slowest sample is below this many nanoseconds.
    pub max_ns_at_most: Option<u64>,
}

/// Distinct drop reasons an endpoint can count by name; further reasons are counted together
/// under [`OTHER_DROP_REASONS`].
pub(crate) const NAMED_DROP_REASONS: usize = 8;

/// The reason under which drops beyond the first `NAMED_DROP_REASONS` reasons are counted.
pub const OTHER_DROP_REASONS: &str = "other reasons";

/// Messages an endpoint dropped, by reason: a fixed table (no allocation, no lock), written by
/// the endpoint thread only, readable from any thread.
#[derive(Debug, Default)]
pub(crate) struct DropCounters {
    /// Reasons in order of first use; a set entry never changes.
    reasons: [std::sync::OnceLock<&'static str>; NAMED_DROP_REASONS],
    /// `counts[i]` for `reasons[i]`; the last one for [`OTHER_DROP_REASONS`].
    counts: [AtomicU64; NAMED_DROP_REASONS + 1],
}

impl DropCounters {
    /// Writer only: counts one dropped message.
    pub(crate) fn record(&self, reason: &'static str) {
        let index = self
            .reasons
            .iter()
            .position(|entry| *entry.get_or_init(|| reason) == reason)
            .unwrap_or(NAMED_DROP_REASONS);
        let count = &self.counts[index];
        count.store(count.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Every reason with a non-zero count, in order of first use. Each count is read by its
    /// own index: a reason the writer is setting right now (count already up, name not yet
    /// visible) is left out until its name is, never shown under another reason's name.
    pub(crate) fn snapshot(&self) -> Vec<DroppedCount> {
        let named = self
            .reasons
            .iter()
            .zip(&self.counts)
            .filter_map(|(entry, count)| entry.get().map(|reason| (*reason, count)));
        named
            .chain(std::iter::once((OTHER_DROP_REASONS, &self.counts[NAMED_DROP_REASONS])))
            .map(|(reason, count)| DroppedCount { reason, count: count.load(Ordering::Relaxed) })
            .filter(|dropped| dropped.count > 0)
            .collect()
    }
}

/// How many messages an endpoint dropped for one reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DroppedCount {
    /// The reason, as the endpoint named it in [`Context::record_dropped`](crate::Context).
    pub reason: &'static str,
    /// Messages dropped for it.
    pub count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_are_counted_by_reason_and_overflow_into_other() {
        let drops = DropCounters::default();
        assert!(drops.snapshot().is_empty());
        drops.record("writes stopped");
        drops.record("stale epoch");
        drops.record("writes stopped");
        assert_eq!(
            drops.snapshot(),
            vec![
                DroppedCount { reason: "writes stopped", count: 2 },
                DroppedCount { reason: "stale epoch", count: 1 },
            ]
        );
        const MANY: [&str; 10] = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
        for reason in MANY {
            drops.record(reason);
        }
        let snapshot = drops.snapshot();
        assert_eq!(snapshot.len(), NAMED_DROP_REASONS + 1);
        assert_eq!(snapshot.last(), Some(&DroppedCount { reason: OTHER_DROP_REASONS, count: 4 }));
        assert_eq!(snapshot.iter().map(|dropped| dropped.count).sum::<u64>(), 13);
    }

    /// A reader between the writer's count and its first use of a name (the count visible, the
    /// name not yet) leaves that count out; it never shows it under another name.
    #[test]
    fn a_count_whose_name_is_not_visible_yet_is_not_misattributed() {
        let drops = DropCounters::default();
        drops.record("writes stopped");
        drops.record("stale epoch");
        drops.counts[2].store(1, Ordering::Relaxed);
        assert_eq!(
            drops.snapshot(),
            vec![
                DroppedCount { reason: "writes stopped", count: 1 },
                DroppedCount { reason: "stale epoch", count: 1 },
            ]
        );
    }

    #[test]
    fn quantiles_are_power_of_two_upper_bounds() {
        let histogram = Log2Histogram::default();
        assert_eq!(histogram.summary(), TimeSummary::default());
        for value in [100u64; 98] {
            histogram.record(value);
        }
        histogram.record(5_000);
        histogram.record(1 << 40);
        let summary = histogram.summary();
        assert_eq!(summary.samples, 100);
        assert_eq!(summary.p50_ns_at_most, Some(128));
        assert_eq!(summary.p99_ns_at_most, Some(8192));
        assert_eq!(summary.max_ns_at_most, Some(1 << 41));
    }
}
