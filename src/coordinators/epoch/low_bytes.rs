//! The low bytes of each encoded difference, packed: the last pass of the delta encoder
//! (module `delta`), compiled for AVX2 when the CPU has it.
//!
//! # Why
//! A delta record keeps `N` bytes of each zigzag difference (`N` from all of them or'ed: 3 for the
//! load generator's `--offsets varied`, 0 for its steady ones, which skip this pass). Packed with
//! shifts into 8-byte stores, that is about 4 instructions per word: a load, a shift and an `or`
//! for each word, and a word that straddles two stores twice. AVX2's byte shuffle moves the `N` low
//! bytes of two words to the front of each 128-bit half in one instruction, for four words at a
//! time, and the two halves are stored where their bytes go: 5 instructions per four words, about 7
//! with the loop's own. The pass runs over every offset of every epoch on the coordinator's thread
//! (PERF.md, "Forty-first session"). The `unsafe` here: calling the AVX2 copy once the CPU is known
//! to have it, and its unaligned vector loads and stores, within bounds asserted before the loop.
#![allow(unsafe_code)]

/// Sets `out` to the `N` low bytes of each word, little-endian (`N` bytes per word). Every word
/// must fit in `N` bytes (the encoder takes `N` from all of them or'ed): the bytes of one that
/// does not would land in its neighbours'. `out` is not cleared first (a memset of the whole
/// record per epoch): every byte kept is written.
///
/// Compiled for AVX2 when the CPU has it (for `N` below 8), and for the target's baseline
/// otherwise (module doc).
pub(super) fn store_low_bytes<const N: usize>(words: &[u64], out: &mut Vec<u8>) {
    debug_assert!(N == 8 || words.iter().all(|word| word >> (8 * N) == 0));
    #[cfg(target_arch = "x86_64")]
    if N < 8 && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), which is what calling a function
        // compiled with it requires; the function's own unsafe operations state theirs.
        unsafe { store_low_bytes_avx2::<N>(words, out) };
        return;
    }
    store_low_bytes_portable::<N>(words, out);
}

/// [`store_low_bytes`] for the target's baseline: eight words fill exactly `N` 8-byte stores,
/// each word shifted into place in them (the shifts are constants once the loops are
/// unrolled), instead of an `N`-byte copy per word.
fn store_low_bytes_portable<const N: usize>(words: &[u64], out: &mut Vec<u8>) {
    out.resize(words.len() * N, 0);
    let (groups, rest) = words.as_chunks::<8>();
    let (packed_out, rest_out) = out.split_at_mut(groups.len() * 8 * N);
    for (group, slot) in groups.iter().zip(packed_out.chunks_exact_mut(8 * N)) {
        let mut packed = [0u64; N];
        for (index, &word) in group.iter().enumerate() {
            let (at, shift) = (index * N / 8, index * N % 8 * 8);
            packed[at] |= word << shift;
            if shift + 8 * N > 64 {
                // The word's high bytes go to the next store.
                packed[at + 1] |= word >> (64 - shift);
            }
        }
        for (bytes, packed) in slot.chunks_exact_mut(8).zip(packed) {
            bytes.copy_from_slice(&packed.to_le_bytes());
        }
    }
    store_low_bytes_one_by_one::<N>(rest, rest_out);
}

/// The `N` low bytes of each word into `out`, one word at a time (the words past the last
/// whole group).
fn store_low_bytes_one_by_one<const N: usize>(words: &[u64], out: &mut [u8]) {
    for (slot, word) in out.chunks_exact_mut(N).zip(words) {
        slot.copy_from_slice(&word.to_le_bytes()[..N]);
    }
}

/// [`store_low_bytes`] with AVX2, for `N` below 8. Four words at a time: a shuffle puts the `N`
/// low bytes of the two words of each 128-bit half at the front of that half (zeros after),
/// and each half is stored, 16 bytes, where its `2 * N` bytes go. A store's zeros past its
/// bytes are overwritten by the next store, and the last one's by the words left over or cut
/// off at the end, so `out` takes 16 bytes of room beyond the record while it is written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn store_low_bytes_avx2<const N: usize>(words: &[u64], out: &mut Vec<u8>) {
    use std::arch::x86_64::{
        _mm256_castsi256_si128, _mm256_extracti128_si256, _mm256_loadu_si256, _mm256_shuffle_epi8,
        _mm_storeu_si128,
    };
    const ROOM: usize = 16;
    let length = words.len() * N;
    out.resize(length + ROOM, 0);
    let shuffle = low_bytes_shuffle::<N>();
    let (groups, rest) = words.as_chunks::<4>();
    let packed_length = groups.len() * 4 * N;
    // Every store below lies in `out`: the last group's second one ends at
    // `packed_length - 2 * N + ROOM`. (One comparison per record; `resize` made it true.)
    assert!(packed_length + ROOM <= out.len());
    let base = out.as_mut_ptr();
    for (index, group) in groups.iter().enumerate() {
        // SAFETY: `group` is four words, the 32 bytes an unaligned load reads.
        let four = unsafe { _mm256_loadu_si256(group.as_ptr().cast()) };
        let packed = _mm256_shuffle_epi8(four, shuffle);
        let (low, high) = (_mm256_castsi256_si128(packed), _mm256_extracti128_si256::<1>(packed));
        let at = index * 4 * N;
        // SAFETY: 16 bytes from `at`, at most `packed_length - 4 * N`: they end at or before
        // `packed_length - 4 * N + ROOM`, within `out` (asserted above).
        unsafe { _mm_storeu_si128(base.wrapping_add(at).cast(), low) };
        // SAFETY: 16 bytes from `at + 2 * N`: they end at or before
        // `packed_length - 2 * N + ROOM`, within `out` (asserted above).
        unsafe { _mm_storeu_si128(base.wrapping_add(at + 2 * N).cast(), high) };
    }
    store_low_bytes_one_by_one::<N>(rest, &mut out[packed_length..length]);
    out.truncate(length);
}

/// The byte shuffle of [`store_low_bytes_avx2`]: in each 128-bit half, byte `i` of the result
/// is byte `i` of the first word for `i < N`, byte `i - N` of the second for `N <= i < 2 * N`,
/// and zero after (an index with its high bit set).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn low_bytes_shuffle<const N: usize>() -> std::arch::x86_64::__m256i {
    let mut indices = [0i8; 32];
    for (place, index) in indices.iter_mut().enumerate() {
        let within_half = place % 16;
        *index = if within_half < N {
            within_half as i8
        } else if within_half < 2 * N {
            (8 + within_half - N) as i8
        } else {
            -1
        };
    }
    // SAFETY: an unaligned load of the 32 bytes of `indices`.
    unsafe { std::arch::x86_64::_mm256_loadu_si256(indices.as_ptr().cast()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words that fill all `N` bytes, each byte differing from the same byte of the words
    /// next to it (so that a byte taken from the wrong word shows) and from the word's other
    /// bytes (a byte from the wrong place).
    fn words<const N: usize>(count: usize) -> Vec<u64> {
        let mask = if N == 8 { u64::MAX } else { (1u64 << (8 * N)) - 1 };
        (0..count as u64)
            .map(|index| (0x8899_AABB_CCDD_EEFF ^ index.wrapping_mul(0x0101_0101_0101_0101)) & mask)
            .collect()
    }

    /// Each version this CPU can run stores every word's `N` low bytes, for every width and for
    /// counts around both versions' groups, into a dirty buffer longer or shorter than the
    /// record.
    #[test]
    fn low_bytes_are_stored_for_every_width_and_count() {
        fn check<const N: usize>() {
            type Version = fn(&[u64], &mut Vec<u8>);
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut versions: Vec<(&str, Version)> = vec![
                ("portable", store_low_bytes_portable::<N>),
                ("dispatched", store_low_bytes::<N>),
            ];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                versions.push(("avx2", |words, out| {
                    // SAFETY: the CPU has AVX2 (checked just above).
                    unsafe { store_low_bytes_avx2::<N>(words, out) }
                }));
            } else {
                crate::skipped_variants::skip_avx2_variant();
            }
            for count in [0usize, 1, 3, 4, 5, 7, 8, 9, 16, 23, 64, 1000] {
                let words = words::<N>(count);
                let expected: Vec<u8> =
                    words.iter().flat_map(|word| word.to_le_bytes()[..N].to_vec()).collect();
                for (name, version) in &versions {
                    for dirty_length in [0, 8 * 1000 + 1] {
                        // A dirty buffer: every byte must be written.
                        let mut out = vec![0x5A; dirty_length];
                        version(&words, &mut out);
                        assert_eq!(out, expected, "{name}: {N} bytes, {count} words");
                    }
                }
            }
        }
        check::<1>();
        check::<2>();
        check::<3>();
        check::<4>();
        check::<5>();
        check::<6>();
        check::<7>();
        check::<8>();
    }
}
