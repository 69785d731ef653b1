//! CRC32C of frames: the `crc32c` crate, with a short path for small frames.
//!
//! Why: the frame of a 64-byte record is 96 bytes, and for inputs that small the crate's
//! per-call setup (alignment split, the dispatch to its three-way interleaved loop, which has
//! nothing to interleave) costs more than the checksum itself: 36 ns per frame (the frame's two
//! covered ranges, two calls) against 13 ns for a plain loop over the CPU's CRC32 instruction
//! (measured on this machine class, 10 M frames). Appenders compute one CRC per record and
//! recovery checks every frame, so the crate's path was most of a recovery scan's time.
//! Inputs of [`SMALL_MAX`] bytes or more still go to the crate, whose interleaved loop is the
//! faster one there; so do CPUs without SSE 4.2 and other architectures.
//!
//! The result is the same CRC32C (Castagnoli, reflected, initial and final XOR `!0`) as the
//! crate's, checked against it by a property test. The loop is the crate's own tail loop
//! (`crc32c` 0.6, `hw_x86_64.rs`: `crc_u64` then `crc_u8` over the SSE 4.2 `CRC32`
//! instruction), without the setup around it.
#![allow(unsafe_code)]

/// Inputs shorter than this take the short path on x86_64 CPUs with SSE 4.2; everything else
/// uses the crate.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const SMALL_MAX: usize = 512;

/// The CRC32C of `first` followed by `second`: `crc32c_append(crc32c(first), second)`.
pub(crate) fn crc32c_of_two(first: &[u8], second: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if first.len() + second.len() < SMALL_MAX && std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: `short_path` only needs SSE 4.2, detected on this CPU just above.
        return unsafe { x86::short_path(first, second) };
    }
    crc32c::crc32c_append(crc32c::crc32c(first), second)
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

    fn crate_crc(first: &[u8], second: &[u8]) -> u32 {
        crc32c::crc32c_append(crc32c::crc32c(first), second)
    }

    #[test]
    fn known_values_match_the_standard_check() {
        // The CRC-32C check value: "123456789" -> 0xE3069283.
        assert_eq!(crc32c_of_two(b"12345", b"6789"), 0xE306_9283);
        assert_eq!(crc32c_of_two(b"", b""), 0);
        let frame = [0xA5u8; 96];
        assert_eq!(crc32c_of_two(&frame[8..], &frame[..4]), crate_crc(&frame[8..], &frame[..4]));
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 2000,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xC5C3_2C00),
            ..ProptestConfig::default()
        })]
        #[test]
        fn equals_the_crate_on_both_paths(
            bytes in proptest::collection::vec(any::<u8>(), 0..2 * SMALL_MAX),
            split in any::<prop::sample::Index>(),
        ) {
            let (first, second) = bytes.split_at(split.index(bytes.len() + 1));
            prop_assert_eq!(crc32c_of_two(first, second), crate_crc(first, second));
        }
    }
}
