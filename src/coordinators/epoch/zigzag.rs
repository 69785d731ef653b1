//! Zigzag differences of one epoch's offsets from the previous epoch's (first order), and of
//! those from the previous epoch's own differences (second order), for the delta records of
//! module `delta`: the loop of the durable encoder that vectorizes, compiled for AVX2 when the
//! CPU has it.
//!
//! # Why
//! The loop is simple arithmetic, but the x86-64 baseline (SSE2) has no 64-bit compare or
//! arithmetic shift, so the sign of each difference takes a 32-bit shift and a shuffle: 5.75
//! instructions per word for the first order alone. AVX2 has the 64-bit compare (the sign in
//! one instruction), on four words at a time: 2.2 instructions per word for the first order
//! alone (PERF.md, "Fortieth session"), 3.9 for both orders (31 per eight words, PERF.md,
//! "Forty-fifth session"). The loop runs over every offset of every epoch on the coordinator's
//! thread. A function compiled with a
//! `target_feature` may only be called once the CPU is known to have it: those calls are the
//! `unsafe` blocks here.
//!
//! Not AVX-512, although this machine class has it: it would save about one more instruction
//! per word, but a burst of 512-bit instructions once per epoch can make some Intel CPUs
//! change their frequency licence each time, and valgrind, the one instruction profiler here,
//! cannot run it.
#![allow(unsafe_code)]

/// The bits of each order of differences, or'ed over the words ([`differences`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OrderBits {
    /// Of the zigzag differences from the base's words.
    pub(super) first: u64,
    /// Of the zigzag differences of those from the base's own differences.
    pub(super) second: u64,
}

/// Computes each word's difference from `base`'s word at the same place, and the difference of
/// that from `last_differences`' (the base's own differences, from its base). Replaces each
/// word by the zigzag encoding of the second, leaves `base` holding the words and
/// `last_differences` the (plain) first differences, and returns each order's zigzag values
/// or'ed: the encoder keeps the narrower order (module `delta`).
///
/// The loop is written once and compiled twice: for AVX2 when the CPU has it, and for the
/// target's baseline otherwise (module doc).
pub(super) fn differences(
    words: &mut [u64],
    base: &mut [u64],
    last_differences: &mut [u64],
) -> OrderBits {
    debug_assert_eq!(words.len(), base.len(), "a base of the same shape");
    debug_assert_eq!(words.len(), last_differences.len(), "differences of the same shape");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), which is all that calling a function
        // compiled with it requires; the function itself is safe code.
        return unsafe { differences_avx2(words, base, last_differences) };
    }
    differences_portable(words, base, last_differences)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn differences_avx2(
    words: &mut [u64],
    base: &mut [u64],
    last_differences: &mut [u64],
) -> OrderBits {
    differences_portable(words, base, last_differences)
}

/// [`differences`] for the target's baseline, and the body of its AVX2 version (inlined there,
/// and compiled with AVX2).
#[inline(always)]
fn differences_portable(
    words: &mut [u64],
    base: &mut [u64],
    last_differences: &mut [u64],
) -> OrderBits {
    let (mut first, mut second) = (0u64, 0u64);
    // Exact lengths, so that the compiler sees one trip count and no bounds checks.
    let count = words.len();
    let (base, last_differences) = (&mut base[..count], &mut last_differences[..count]);
    for index in 0..count {
        let difference = words[index].wrapping_sub(base[index]);
        let second_difference = zigzag(difference.wrapping_sub(last_differences[index]));
        base[index] = words[index];
        last_differences[index] = difference;
        words[index] = second_difference;
        first |= zigzag(difference);
        second |= second_difference;
    }
    OrderBits { first, second }
}

/// Sets each word to the zigzag encoding of the difference at the same place: the first-order
/// values, when the encoder keeps those ([`differences`] leaves the second-order ones).
/// Compiled for AVX2 when the CPU has it, as [`differences`] is.
pub(super) fn zigzag_each(words: &mut [u64], differences: &[u64]) {
    debug_assert_eq!(words.len(), differences.len(), "differences of the same shape");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), which is all that calling a function
        // compiled with it requires; the function itself is safe code.
        return unsafe { zigzag_each_avx2(words, differences) };
    }
    zigzag_each_portable(words, differences);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn zigzag_each_avx2(words: &mut [u64], differences: &[u64]) {
    zigzag_each_portable(words, differences);
}

/// [`zigzag_each`] for the target's baseline, and the body of its AVX2 version.
#[inline(always)]
fn zigzag_each_portable(words: &mut [u64], differences: &[u64]) {
    for (word, difference) in words.iter_mut().zip(differences) {
        *word = zigzag(*difference);
    }
}

/// A wrapping difference as an unsigned number that is small when the difference is small
/// either way: 0, -1, 1, -2, ... become 0, 1, 2, 3, ...
fn zigzag(difference: u64) -> u64 {
    (difference << 1) ^ ((difference as i64 >> 63) as u64)
}

/// The difference [`zigzag`] encoded.
pub(super) fn unzigzag(encoded: u64) -> u64 {
    (encoded >> 1) ^ 0u64.wrapping_sub(encoded & 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words, bases and the bases' own differences for `count` words: differences of at most
    /// 1000 either way from the base and from its difference, and one of 2^40 at `large_at` (if
    /// below `count`) in each order, so that a word missing from either or'ed value shows.
    fn sample(count: usize, large_at: usize) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            // xorshift64: fixed seed, no dependency on the test's order.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut small = move |index: usize| match index % 2 {
            0 => next() % 1000,
            _ => (next() % 1000).wrapping_neg(),
        };
        let (mut words, mut bases, mut last_differences) = (vec![], vec![], vec![]);
        for index in 0..count {
            let base = small(index).wrapping_mul(1 << 20);
            let last_difference = small(index + 1).wrapping_mul(1 << 10);
            let step = match index {
                _ if index == large_at => 1 << 40,
                _ => last_difference.wrapping_add(small(index)),
            };
            words.push(base.wrapping_add(step));
            bases.push(base);
            last_differences.push(last_difference);
        }
        (words, bases, last_differences)
    }

    /// What every version must compute: the loop, one word at a time.
    fn expected(words: &[u64], base: &[u64], last: &[u64]) -> (Vec<u64>, Vec<u64>, OrderBits) {
        let first: Vec<u64> = words.iter().zip(base).map(|(w, b)| w.wrapping_sub(*b)).collect();
        let second: Vec<u64> =
            first.iter().zip(last).map(|(d, last)| zigzag(d.wrapping_sub(*last))).collect();
        let or = |values: &mut dyn Iterator<Item = u64>| values.fold(0, |all, value| all | value);
        let bits = OrderBits {
            first: or(&mut first.iter().map(|d| zigzag(*d))),
            second: or(&mut second.iter().copied()),
        };
        (second, first, bits)
    }

    type Version = fn(&mut [u64], &mut [u64], &mut [u64]) -> OrderBits;

    /// Each version this CPU can run of [`differences`].
    fn versions() -> Vec<(&'static str, Version)> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut versions: Vec<(&str, Version)> =
            vec![("portable", differences_portable), ("dispatched", differences)];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            versions.push(("avx2", |w, b, l| unsafe { differences_avx2(w, b, l) }));
        } else {
            crate::skipped_variants::skip_avx2_variant();
        }
        versions
    }

    type ZigzagVersion = fn(&mut [u64], &[u64]);

    /// Each version this CPU can run of [`zigzag_each`].
    fn zigzag_versions() -> Vec<(&'static str, ZigzagVersion)> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut versions: Vec<(&str, ZigzagVersion)> =
            vec![("portable", zigzag_each_portable), ("dispatched", zigzag_each)];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            versions.push(("avx2", |words, differences| unsafe {
                zigzag_each_avx2(words, differences)
            }));
        } else {
            crate::skipped_variants::skip_avx2_variant();
        }
        versions
    }

    /// Each version this CPU can run gives the loop's second-order values and both orders'
    /// bits, and leaves the words in the base and the first differences beside it, for counts
    /// around the vector widths.
    #[test]
    fn every_version_the_cpu_has_computes_the_same_differences() {
        for count in [0, 1, 3, 4, 7, 8, 15, 16, 17, 1000] {
            // The large difference at each place (the vector body and the tail), or nowhere.
            for large_at in (0..count.min(17)).chain([count - count.min(1), usize::MAX]) {
                let (words, base, last) = sample(count, large_at);
                let (want, want_first, want_bits) = expected(&words, &base, &last);
                let case = format!("{count} words, large at {large_at}");
                if large_at < count {
                    assert!(want_bits.first >> 40 != 0 && want_bits.second >> 40 != 0, "{case}");
                }
                for (name, version) in versions() {
                    let (mut got, mut got_base, mut got_last) =
                        (words.clone(), base.clone(), last.clone());
                    let bits = version(&mut got, &mut got_base, &mut got_last);
                    assert_eq!((&got, bits), (&want, want_bits), "{name}, {case}");
                    assert_eq!(got_base, words, "{name}, {case}: the base holds the words");
                    assert_eq!(got_last, want_first, "{name}, {case}: the first differences");
                    let want_zigzag: Vec<u64> = want_first.iter().map(|d| zigzag(*d)).collect();
                    for (name, zigzag_version) in zigzag_versions() {
                        let mut first = vec![u64::MAX; count];
                        zigzag_version(&mut first, &got_last);
                        assert_eq!(first, want_zigzag, "{case}: zigzag_each, {name}");
                    }
                }
            }
        }
    }

    /// A run of steady steps: the first differences are the steps, the second ones are zero.
    #[test]
    fn steady_steps_have_no_second_order_bits() {
        let (mut base, mut last) = (vec![5u64, 7, 9], vec![0u64; 3]);
        let steps = [1u64 << 20, 3, 0u64.wrapping_sub(2)];
        let mut bits = vec![];
        for epoch in 1..4u64 {
            let mut words: Vec<u64> = (0..3)
                .map(|at| [5u64, 7, 9][at].wrapping_add(steps[at].wrapping_mul(epoch)))
                .collect();
            bits.push(differences(&mut words, &mut base, &mut last));
            assert_eq!(last, steps, "epoch {epoch}");
        }
        let first = (1 << 21) | 6 | 3;
        assert_eq!(bits[0], OrderBits { first, second: first }, "no differences before");
        assert_eq!(bits[1..], [OrderBits { first, second: 0 }; 2]);
    }

    #[test]
    fn unzigzag_inverts_zigzag() {
        for difference in [0u64, 1, 2, 1000, u64::MAX, u64::MAX - 999, 1 << 63, (1 << 63) - 1] {
            assert_eq!(unzigzag(zigzag(difference)), difference, "{difference}");
        }
        assert_eq!([0u64, u64::MAX, 1, u64::MAX - 1].map(zigzag), [0, 1, 2, 3]);
    }
}
