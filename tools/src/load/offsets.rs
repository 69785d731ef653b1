//! The offsets the `epoch` workload reports (`--offsets`), computed from the partition and the
//! epoch alone, so that a producer can cut its stream anywhere and a run repeats exactly.
//!
//! # Why two patterns
//! What a durable run logs per epoch depends on how the offsets move: the epoch log stores
//! each epoch's offsets as differences from the epoch before, or as differences of those
//! differences, whichever is smaller (`coordbus::coordinators::epoch`, module `delta`). A
//! steady source (every partition advancing by the same amount every epoch: a rate-limited
//! source, or Kafka partitions read at a cap under backlog) costs the log no bytes per offset
//! in the second order. A source whose partitions advance at rates of their own, by amounts that
//! change from epoch to epoch, costs it several. `steady` is the first (and what every figure
//! before `--offsets` measured); `varied` the second, the harder case for the log.
//!
//! # Cost
//! The producers compute an offset per report on the measured path, and with one producer the
//! in-memory run is only just coordinator-bound: a few instructions more per report make it
//! the producer's rate instead (and the durable run's ratio to it read better than it is). So
//! `varied` is two table look-ups, a multiply, an `and` and two adds, not a random generator
//! per message: the tables (a rate and a jitter mask per partition, 1024 jitters) are filled
//! from the seed before the run.

use std::sync::Arc;

use coordbus_tools::rng::Rng;

/// How the reported offsets advance.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetPattern {
    /// Every partition by 2^20 an epoch: `epoch << 20 | partition`.
    Steady,
    /// Each partition by a rate of its own (seeded, 2^10 to 2^20 + 2^10 an epoch) plus a jitter
    /// of up to an eighth of it (at least a sixteenth) that changes every epoch.
    Varied,
}

impl OffsetPattern {
    /// The name in the JSON figure.
    pub fn name(self) -> &'static str {
        match self {
            Self::Steady => "steady",
            Self::Varied => "varied",
        }
    }
}

/// Jitter values per table: a partition's jitter repeats after this many epochs.
const JITTERS: usize = 1024;

/// The offset of each partition for each epoch; cheap to clone (shares its tables).
#[derive(Debug, Clone)]
pub struct OffsetStream {
    varied: Option<Arc<VariedTables>>,
}

/// The tables of the `varied` pattern.
#[derive(Debug)]
struct VariedTables {
    partitions: Vec<VariedPartition>,
    /// Random bits, masked by each partition's jitter mask.
    jitters: [i64; JITTERS],
}

/// How one partition's offsets advance.
#[derive(Debug, Clone, Copy)]
struct VariedPartition {
    /// Its advance per epoch, before jitter.
    rate: i64,
    /// The jitter's bits: `2^k - 1` for the largest `2^k` at most `rate / 8`.
    jitter_mask: i64,
}

impl OffsetStream {
    /// The offsets of `pattern` for `partitions` partitions, seeded by `seed` (`varied` only).
    pub fn new(pattern: OffsetPattern, partitions: i32, seed: u64) -> Self {
        let varied = (pattern == OffsetPattern::Varied).then(|| {
            let mut rng = Rng::new(seed);
            let partitions = (0..partitions)
                .map(|_| {
                    let rate = (1 << 10) + rng.below(1 << 20) as i64;
                    let eighth = rate / 8;
                    // The largest power of two at most an eighth of the rate, less one.
                    let jitter_mask = (1i64 << (63 - eighth.leading_zeros())) - 1;
                    VariedPartition { rate, jitter_mask }
                })
                .collect();
            let jitters = std::array::from_fn(|_| (rng.next_u64() >> 1) as i64);
            Arc::new(VariedTables { partitions, jitters })
        });
        Self { varied }
    }

    /// The offset `partition` reports for `epoch` (`partition` below the count the stream was
    /// made for, `epoch` at most 2^24: at most 2^45, and each above the epoch before's).
    #[inline]
    pub fn offset(&self, partition: i32, epoch: i64) -> i64 {
        let Some(tables) = &self.varied else {
            return epoch << 20 | i64::from(partition);
        };
        let VariedPartition { rate, jitter_mask } = tables.partitions[partition as usize];
        // Each partition walks the table from its own place, one entry per epoch.
        let jitter = tables.jitters[(epoch as usize).wrapping_add(partition as usize) % JITTERS];
        // Below rate / 8: offsets only grow, by more than rate * 7/8 and less than rate * 9/8
        // an epoch.
        epoch * rate + (jitter & jitter_mask)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_offsets_hold_the_epoch_and_the_partition() {
        let stream = OffsetStream::new(OffsetPattern::Steady, 8, 1);
        assert_eq!(stream.offset(3, 7), 7 << 20 | 3);
    }

    /// Varied offsets grow every epoch by 7/8 to 9/8 of the partition's rate, the rates and
    /// the advances differ, and the same seed gives the same stream.
    #[test]
    fn varied_offsets_grow_by_their_own_rates_with_jitter() {
        let stream = OffsetStream::new(OffsetPattern::Varied, 64, 42);
        let again = OffsetStream::new(OffsetPattern::Varied, 64, 42);
        let other = OffsetStream::new(OffsetPattern::Varied, 64, 43);
        let mut advances = std::collections::BTreeSet::new();
        for partition in 0..64 {
            let rate = stream.varied.as_ref().unwrap().partitions[partition as usize].rate;
            assert!(((1 << 10)..(1 << 20) + (1 << 10)).contains(&rate), "{rate}");
            for epoch in 1..3000 {
                let advance = stream.offset(partition, epoch) - stream.offset(partition, epoch - 1);
                assert!(advance >= rate - rate / 8 && advance <= rate + rate / 8, "{advance}");
                advances.insert(advance);
                assert_eq!(stream.offset(partition, epoch), again.offset(partition, epoch));
            }
        }
        assert!(advances.len() > 64 * 900, "{} distinct advances", advances.len());
        assert_ne!(stream.offset(5, 100), other.offset(5, 100), "another seed");
        // The largest offset of the longest run, for any rate: below 2^45, as documented.
        for partition in 0..64 {
            assert!(stream.offset(partition, 1 << 24) < 1 << 45);
        }
    }
}
