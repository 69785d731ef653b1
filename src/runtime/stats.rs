//! Cheap always-on measurements of an endpoint: a power-of-two histogram of handler times.
//!
//! Timing every message would cost two clock reads (~40 ns) per message, more than the rest of
//! the handling path; so one message in [`HANDLER_TIME_SAMPLE_EVERY`] is timed. The histogram
//! has one bucket per power of two of nanoseconds, written by the endpoint thread only (plain
//! load + store, no locked instruction) and readable from any thread at any time.

use std::sync::atomic::{AtomicU64, Ordering};

/// One message in this many has its handler timed.
pub(crate) const HANDLER_TIME_SAMPLE_EVERY: u64 = 64;

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
    /// Messages timed (one in 64 handled).
    pub samples: u64,
    /// The median is below this many nanoseconds.
    pub p50_ns_at_most: Option<u64>,
    /// The 99th percentile is below this many nanoseconds.
    pub p99_ns_at_most: Option<u64>,
    /// The slowest sample is below this many nanoseconds.
    pub max_ns_at_most: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

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
