//! Zigzag differences of one epoch's offsets from the previous epoch's, for the delta
//! records of module `delta`: the one loop of the durable encoder that vectorizes, compiled
//! for AVX2 when the CPU has it.
//!
//! # Why
//! The loop is simple arithmetic, but the x86-64 baseline (SSE2) has no 64-bit compare or
//! arithmetic shift, so the sign of each difference takes a 32-bit shift and a shuffle: 5.75
//! instructions per word. AVX2 has the 64-bit compare (the sign in one instruction), on four
//! words at a time: 2.2 instructions per word. The loop runs over every offset of every epoch
//! on the coordinator's thread (PERF.md, "Fortieth session"). A function compiled with a
//! `target_feature` may only be called once the CPU is known to have it: that call is the one
//! `unsafe` block here, outside the tests.
//!
//! Not AVX-512, although this machine class has it: it would save about one more instruction
//! per word, but a burst of 512-bit instructions once per epoch can make some Intel CPUs
//! change their frequency licence each time, and valgrind, the one instruction profiler here,
//! cannot run it.
#![allow(unsafe_code)]

/// Replaces each word by the zigzag encoding of its difference from `base`'s word at the same
/// place, leaves `base` holding the words, and returns all the differences or'ed.
///
/// The loop is written once and compiled twice: for AVX2 when the CPU has it, and for the
/// target's baseline otherwise (module doc).
pub(super) fn differences(words: &mut [u64], base: &mut [u64]) -> u64 {
    debug_assert_eq!(words.len(), base.len(), "a base of the same shape");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), which is all that calling a function
        // compiled with it requires; the function itself is safe code.
        return unsafe { differences_avx2(words, base) };
    }
    differences_portable(words, base)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn differences_avx2(words: &mut [u64], base: &mut [u64]) -> u64 {
    differences_portable(words, base)
}

/// [`differences`] for the target's baseline, and the body of its AVX2 version (inlined there,
/// and compiled with AVX2).
#[inline(always)]
fn differences_portable(words: &mut [u64], base: &mut [u64]) -> u64 {
    let mut all_bits = 0u64;
    for (word, base) in words.iter_mut().zip(base) {
        let difference = zigzag(word.wrapping_sub(*base));
        *base = *word;
        *word = difference;
        all_bits |= difference;
    }
    all_bits
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

    /// Words and bases for `count` words: differences of at most 1000 either way, and one of
    /// 2^40 at `large_at` (if below `count`), so that a word missing from the or'ed bits shows.
    fn sample(count: usize, large_at: usize) -> (Vec<u64>, Vec<u64>) {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            // xorshift64: fixed seed, no dependency on the test's order.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..count)
            .map(|index| {
                let base = next();
                let step = match index {
                    _ if index == large_at => 1 << 40,
                    _ if index % 2 == 0 => next() % 1000,
                    _ => (next() % 1000).wrapping_neg(),
                };
                (base.wrapping_add(step), base)
            })
            .unzip()
    }

    /// What every version must compute: the loop, one word at a time.
    fn expected(words: &[u64], base: &[u64]) -> (Vec<u64>, u64) {
        let differences: Vec<u64> =
            words.iter().zip(base).map(|(word, base)| zigzag(word.wrapping_sub(*base))).collect();
        let all_bits = differences.iter().fold(0, |all, difference| all | difference);
        (differences, all_bits)
    }

    /// Each version this CPU can run gives the loop's differences and bits, and leaves the
    /// words in the base, for counts around the vector widths.
    #[test]
    fn every_version_the_cpu_has_computes_the_same_differences() {
        type Version = fn(&mut [u64], &mut [u64]) -> u64;
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut versions: Vec<(&str, Version)> =
            vec![("portable", differences_portable), ("dispatched", differences)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                versions.push(("avx2", |words, base| unsafe { differences_avx2(words, base) }));
            }
        }
        for count in [0, 1, 3, 4, 7, 8, 15, 16, 17, 1000] {
            // The large difference at each place (the vector body and the tail), or nowhere.
            for large_at in (0..count.min(17)).chain([count - count.min(1), usize::MAX]) {
                let (words, base) = sample(count, large_at);
                let (want, want_bits) = expected(&words, &base);
                let case = format!("{count} words, large at {large_at}");
                for (name, version) in &versions {
                    let (mut got, mut got_base) = (words.clone(), base.clone());
                    let bits = version(&mut got, &mut got_base);
                    assert_eq!((got, bits), (want.clone(), want_bits), "{name}, {case}");
                    assert_eq!(got_base, words, "{name}, {case}: the base holds the words");
                }
            }
        }
    }

    #[test]
    fn unzigzag_inverts_zigzag() {
        for difference in [0u64, 1, 2, 1000, u64::MAX, u64::MAX - 999, 1 << 63, (1 << 63) - 1] {
            assert_eq!(unzigzag(zigzag(difference)), difference, "{difference}");
        }
        assert_eq!([0u64, u64::MAX, 1, u64::MAX - 1].map(zigzag), [0, 1, 2, 3]);
    }
}
