//! CRC32C (Castagnoli) of frames and segment headers: a short path of our own for small inputs,
//! the `crc-fast` crate for the rest.
//!
//! # Why two paths
//! Appenders compute one CRC per record on their own thread (the coordinator's, for the epoch
//! log), and recovery checks every frame. For small inputs a plain loop over the CPU's CRC32
//! instruction beats any library's per-call setup: a 96-byte frame (a 64-byte record; its two
//! covered ranges) takes 3.8 ns against 13.4 ns with the `crc32c` crate, whose setup (alignment
//! split, dispatch to a three-way interleaved loop with nothing to interleave) once made up most of
//! a recovery scan's time, and about 11 ns with `crc-fast`. From [`SMALL_MAX`] bytes on, `crc-fast`
//! is faster: it folds the input with the CPU's carry-less multiply fused with the CRC32
//! instruction (VPCLMULQDQ with AVX-512 where the CPU has it, else PCLMULQDQ; PMULL on aarch64; a
//! table only without any of them; chosen at run time, so under valgrind, which hides AVX-512, it
//! takes the PCLMULQDQ variant), where the `crc32c` crate interleaves three streams of the CRC32
//! instruction, eight bytes per instruction. A 3104-byte frame (about the epoch log's delta record
//! at 1000 partitions of offsets that take 3 bytes each, one per epoch on the coordinator's thread)
//! takes 54.6 ns against 107.9 ns with the `crc32c` crate. Figures on this machine class: `cargo
//! bench --bench wal -- wal/frame_crc`, and PERF.md, "Forty-fourth session". CPUs without SSE 4.2
//! and other architectures take `crc-fast` at every size.
//!
//! The result is the standard CRC32C (reflected, initial and final XOR `!0`) on both paths,
//! checked against the `crc32c` crate (an independent implementation) by a property test: logs
//! written before `crc-fast` replaced that crate here read back unchanged. The short path's loop
//! is the `crc32c` crate's own tail loop (`crc32c` 0.6, `hw_x86_64.rs`: `crc_u64` then `crc_u8`
//! over the SSE 4.2 `CRC32` instruction), without the setup around it.
#![allow(unsafe_code)]

use crc_fast::{CrcAlgorithm, Digest};

/// Inputs shorter than this take the short path on x86_64 CPUs with SSE 4.2; everything else
/// uses `crc-fast` (below it, `crc-fast`'s setup costs more than the loop saves: PERF.md,
/// "Forty-fourth session").
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const SMALL_MAX: usize = 512;

/// The CRC32C of `bytes`.
pub(crate) fn crc32c(bytes: &[u8]) -> u32 {
    crc32c_of_two(bytes, &[])
}

/// The CRC32C of `first` followed by `second` (a frame's two covered ranges).
pub(crate) fn crc32c_of_two(first: &[u8], second: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if first.len() + second.len() < SMALL_MAX && std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: `short_path` only needs SSE 4.2, detected on this CPU just above.
        return unsafe { x86::short_path(first, second) };
    }
    let mut digest = Digest::new(CrcAlgorithm::Crc32Iscsi);
    digest.update(first);
    digest.update(second);
    // A 32-bit CRC: the digest's value is in the low 32 bits.
    digest.finalize() as u32
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};

    /// [`super::crc32c_of_two`] with the CRC32 instruction, eight bytes at a time.
    #[target_feature(enable = "sse4.2")]
    pub(super) fn short_path(first: &[u8], second: &[u8]) -> u32 {
        !update(update(!0, first), second)
    }

    /// Feeds `bytes` into the running (not yet inverted) CRC `crc`.
    #[target_feature(enable = "sse4.2")]
    fn update(crc: u32, bytes: &[u8]) -> u32 {
        let mut words = bytes.chunks_exact(8);
        let mut wide = u64::from(crc);
        for word in &mut words {
            let mut le = [0u8; 8];
            le.copy_from_slice(word);
            wide = _mm_crc32_u64(wide, u64::from_le_bytes(le));
        }
        // The instruction leaves the CRC in the low 32 bits.
        let mut crc = wide as u32;
        for &byte in words.remainder() {
            crc = _mm_crc32_u8(crc, byte);
        }
        crc
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The `crc32c` crate's value: an implementation independent of this module's.
    fn crate_crc(first: &[u8], second: &[u8]) -> u32 {
        crc32c::crc32c_append(crc32c::crc32c(first), second)
    }

    #[test]
    fn known_values_match_the_standard_check() {
        // The CRC-32C check value: "123456789" -> 0xE3069283.
        assert_eq!(crc32c_of_two(b"12345", b"6789"), 0xE306_9283);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c_of_two(b"", b""), 0);
        let frame = [0xA5u8; 96];
        assert_eq!(crc32c_of_two(&frame[8..], &frame[..4]), crate_crc(&frame[8..], &frame[..4]));
    }

    /// A frame of each path, its ranges split as `frame::frame_crc` splits them (the first
    /// one starting 8 bytes into the frame), against values computed outside Rust (a bitwise
    /// CRC32C in Python, checked on "123456789").
    #[test]
    fn a_frame_of_each_path_has_its_known_value() {
        let frame = |len: u32| -> Vec<u8> {
            (0..len).map(|index| (index.wrapping_mul(0x9E37_79B9) >> 24) as u8).collect()
        };
        let (small, large) = (frame(96), frame(3104));
        assert_eq!(crc32c_of_two(&small[8..], &small[..4]), 0x17CB_A171);
        assert_eq!(crc32c_of_two(&large[8..], &large[..4]), 0x8D0D_3373);
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: if cfg!(miri) { 64 } else { 2000 },
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xC5C3_2C00),
            ..ProptestConfig::default()
        })]
        /// Lengths up to 8 KiB, half of them around the paths' boundary, at every alignment
        /// within 64 bytes (`crc-fast` aligns its loads first): both paths, with the variant of
        /// `crc-fast`'s folding this CPU selects (its other variants are the crate's own tests'
        /// to check).
        #[test]
        fn equals_another_implementation_on_both_paths(
            bytes in prop_oneof![0..2 * SMALL_MAX, 0..16 * SMALL_MAX]
                .prop_flat_map(|len| proptest::collection::vec(any::<u8>(), len)),
            skip in 0..64usize,
            split in any::<prop::sample::Index>(),
        ) {
            let bytes = &bytes[skip.min(bytes.len())..];
            let (first, second) = bytes.split_at(split.index(bytes.len() + 1));
            prop_assert_eq!(crc32c_of_two(first, second), crate_crc(first, second));
            prop_assert_eq!(crc32c(bytes), crate_crc(bytes, &[]));
        }
    }
}
