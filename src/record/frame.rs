//! The frame around one record: a 32-byte header, the payload, zero padding to 16 bytes.
//!
//! | offset | size | field       | meaning                                                      |
//! |-------:|-----:|-------------|--------------------------------------------------------------|
//! | 0      | 4    | `len`       | payload length in bytes, u32 LE (padding not counted)        |
//! | 4      | 4    | `crc`       | CRC32C of bytes 8..end of frame, then of bytes 0..4          |
//! | 8      | 8    | `lsn`       | log sequence number, u64 LE, 1 for the first record ever     |
//! | 16     | 8    | `time_ms`   | the record's time (ms since the Unix epoch), i64 LE          |
//! | 24     | 4    | `sync_gap`  | `lsn - durable_lsn` at append, u32 LE (`u32::MAX`: unknown)  |
//! | 28     | 2    | `magic`     | `0xC0DB` LE                                                  |
//! | 30     | 1    | `version`   | frame version, `1`                                           |
//! | 31     | 1    | `flags`     | reserved, `0`                                                |
//! | 32     | len  | payload     | rkyv archive (or raw bytes), starts 16-byte aligned          |
//! | 32+len | pad  | padding     | zeros up to the next multiple of 16                          |
//!
//! Why these fields:
//! - Every payload starts at a multiple of 16 from the start of the segment file (the header is
//!   32 bytes and frames are padded to 16), and the mapping is page-aligned, so rkyv's zero-copy
//!   access sees the alignment it needs for every archived type (including 16-byte integers).
//! - The CRC covers every byte of the frame except itself, padding included, so any single bit
//!   flip in a frame is detected.
//! - `sync_gap` lets recovery tell a torn tail (records written after the last sync, which may
//!   reach the disk in any order) from real corruption: if a valid record after a damaged one
//!   was appended when the damaged one was already durable, the damage hit acknowledged data.
//! - An all-zero header is never a valid frame (the magic is not zero): zeroed, preallocated
//!   space reads as the end of the log.
//!
//! The parser never allocates and never trusts the length before checking it against the bytes
//! available; it returns typed errors for every malformed input.

use crate::error::RecordError;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 32;
/// Alignment of frames and payloads, in bytes.
pub const ALIGN: usize = 16;
/// The frame magic.
pub const MAGIC: u16 = 0xC0DB;
/// The frame format version written by this build.
pub const VERSION: u8 = 1;
/// The largest payload a frame may carry (1 GiB).
pub const MAX_PAYLOAD_LEN: u32 = 1 << 30;

/// The decoded header of a frame whose checksum passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Payload length in bytes.
    pub len: u32,
    /// Log sequence number.
    pub lsn: u64,
    /// The record's time in ms.
    pub time_ms: i64,
    /// `lsn` minus the durable LSN seen when it was appended (saturating).
    pub sync_gap: u32,
}

impl FrameHeader {
    /// The LSN that was already durable when this record was appended, as far as the frame
    /// tells: a saturated gap (`u32::MAX`: the real gap may be larger) tells nothing, so 0.
    pub fn synced_lsn_at_append(&self) -> u64 {
        if self.sync_gap == u32::MAX {
            return 0;
        }
        self.lsn.saturating_sub(u64::from(self.sync_gap))
    }

    /// The whole frame's size on disk (header, payload, padding).
    pub fn frame_len(&self) -> u64 {
        frame_len(self.len as usize) as u64
    }
}

/// The size of a frame carrying `payload_len` bytes (at most [`MAX_PAYLOAD_LEN`] in a
/// valid frame; far larger lengths would wrap).
pub const fn frame_len(payload_len: usize) -> usize {
    HEADER_LEN + padded(payload_len)
}

/// `len` rounded up to the frame alignment (`len` within 15 of `usize::MAX` would wrap; frame
/// lengths are at most [`MAX_PAYLOAD_LEN`]).
pub const fn padded(len: usize) -> usize {
    (len + ALIGN - 1) & !(ALIGN - 1)
}

const ZEROS: [u8; ALIGN] = [0; ALIGN];

/// The CRC of a complete frame (`frame.len()` is the frame length): bytes 8.. then 0..4.
///
/// One pass over contiguous memory plus four bytes: the same cost to write and to verify.
///
/// # Panics
/// If `frame` is shorter than a frame header.
pub fn frame_crc(frame: &[u8]) -> u32 {
    assert!(frame.len() >= HEADER_LEN, "a frame of {} bytes has no whole header", frame.len());
    super::crc::crc32c_of_two(&frame[8..], &frame[0..4])
}

/// Appends a complete frame (header, payload, padding) to `out`.
///
/// `durable_lsn` is the LSN known durable when the record is appended (feeds `sync_gap`).
///
/// # Errors
/// [`RecordError::TooLarge`] if the payload exceeds [`MAX_PAYLOAD_LEN`].
pub fn encode_into(
    out: &mut Vec<u8>,
    payload: &[u8],
    lsn: u64,
    time_ms: i64,
    durable_lsn: u64,
) -> Result<(), RecordError> {
    let len = u32::try_from(payload.len()).ok().filter(|len| *len <= MAX_PAYLOAD_LEN).ok_or(
        RecordError::TooLarge { len: payload.len() as u64, max: u64::from(MAX_PAYLOAD_LEN) },
    )?;
    let sync_gap = u32::try_from(lsn.saturating_sub(durable_lsn)).unwrap_or(u32::MAX);
    let mut header = [0u8; HEADER_LEN];
    header[0..4].copy_from_slice(&len.to_le_bytes());
    header[8..16].copy_from_slice(&lsn.to_le_bytes());
    header[16..24].copy_from_slice(&time_ms.to_le_bytes());
    header[24..28].copy_from_slice(&sync_gap.to_le_bytes());
    header[28..30].copy_from_slice(&MAGIC.to_le_bytes());
    header[30] = VERSION;
    header[31] = 0;
    let start = out.len();
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    out.extend_from_slice(&ZEROS[..padded(payload.len()) - payload.len()]);
    let crc = frame_crc(&out[start..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// True if the 32 bytes at the start of `bytes` are all zero (preallocated, never written).
pub fn is_zero_header(bytes: &[u8]) -> bool {
    bytes.len() >= HEADER_LEN && bytes[..HEADER_LEN].iter().all(|byte| *byte == 0)
}

/// Cheap pre-check used when scanning for frames: magic, version and flags are right.
pub fn looks_like_header(bytes: &[u8]) -> bool {
    bytes.len() >= HEADER_LEN
        && bytes[28..30] == MAGIC.to_le_bytes()
        && bytes[30] == VERSION
        && bytes[31] == 0
}

/// The LSN a frame header at the start of `bytes` claims, unverified (no checksum: the frame
/// may be partly written), if the header looks like one ([`looks_like_header`]).
pub fn claimed_lsn(bytes: &[u8]) -> Option<u64> {
    looks_like_header(bytes).then(|| u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")))
}

/// Parses and verifies the frame at the start of `bytes`; returns the header and the payload.
///
/// # Errors
/// [`RecordError::Truncated`] if the header or the declared payload runs past `bytes`,
/// [`RecordError::BadHeader`] for a wrong magic/version/flags, [`RecordError::TooLarge`] for a
/// length over the limit, [`RecordError::Checksum`] if the CRC does not match.
pub fn parse(bytes: &[u8]) -> Result<(FrameHeader, &[u8]), RecordError> {
    if bytes.len() < HEADER_LEN {
        return Err(RecordError::Truncated {
            needed: HEADER_LEN as u64,
            available: bytes.len() as u64,
        });
    }
    let magic = u16::from_le_bytes([bytes[28], bytes[29]]);
    if !looks_like_header(bytes) {
        return Err(RecordError::BadHeader { magic, version: bytes[30], flags: bytes[31] });
    }
    let len = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
    if len > MAX_PAYLOAD_LEN {
        return Err(RecordError::TooLarge { len: u64::from(len), max: u64::from(MAX_PAYLOAD_LEN) });
    }
    let total = frame_len(len as usize);
    if total > bytes.len() {
        return Err(RecordError::Truncated { needed: total as u64, available: bytes.len() as u64 });
    }
    let payload = &bytes[HEADER_LEN..HEADER_LEN + len as usize];
    let stored = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    // The padding is checksummed as stored, so a flipped padding bit fails too.
    let computed = frame_crc(&bytes[..total]);
    if computed != stored {
        return Err(RecordError::Checksum { stored, computed });
    }
    Ok((
        FrameHeader {
            len,
            lsn: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
            time_ms: i64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes")),
            sync_gap: u32::from_le_bytes(bytes[24..28].try_into().expect("4 bytes")),
        },
        payload,
    ))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A gap that saturated says nothing of what was durable (the real gap may be larger):
    /// recovery must not take it as proof that an earlier record was durable.
    #[test]
    fn a_saturated_sync_gap_claims_nothing_durable() {
        let header = |lsn, sync_gap| FrameHeader { len: 0, lsn, time_ms: 0, sync_gap };
        assert_eq!(header(10, 3).synced_lsn_at_append(), 7);
        assert_eq!(header(1 << 40, u32::MAX - 1).synced_lsn_at_append(), (1 << 40) - 0xffff_fffe);
        assert_eq!(header(1 << 40, u32::MAX).synced_lsn_at_append(), 0);
        let mut frame = Vec::new();
        encode_into(&mut frame, b"x", 1 << 40, 0, 1).unwrap();
        assert_eq!(parse(&frame).unwrap().0.synced_lsn_at_append(), 0, "the gap saturated");
    }

    #[test]
    fn encode_then_parse_round_trips_every_length_up_to_64() {
        for len in 0..=64usize {
            let payload: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x5a).collect();
            let mut buf = Vec::new();
            encode_into(&mut buf, &payload, 42 + len as u64, -5, 40).unwrap();
            assert_eq!(buf.len(), frame_len(len));
            assert_eq!(buf.len() % ALIGN, 0);
            let (header, parsed) = parse(&buf).unwrap();
            assert_eq!(parsed, &payload[..]);
            assert_eq!(header.lsn, 42 + len as u64);
            assert_eq!(header.time_ms, -5);
            assert_eq!(header.synced_lsn_at_append(), 40);
            assert_eq!(claimed_lsn(&buf), Some(42 + len as u64));
            // A torn payload still shows the LSN its header claims.
            if buf.len() > HEADER_LEN {
                let last = buf.len() - 1;
                buf[last] ^= 1;
                assert!(parse(&buf).is_err());
                assert_eq!(claimed_lsn(&buf), Some(42 + len as u64));
            }
        }
        assert_eq!(claimed_lsn(&[0u8; HEADER_LEN]), None);
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let mut buf = Vec::new();
        encode_into(&mut buf, b"seventeen bytes!!", 9, 1_000, 0).unwrap();
        for bit in 0..buf.len() * 8 {
            let mut damaged = buf.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            match parse(&damaged) {
                Err(_) => {}
                Ok((header, payload)) => panic!("bit {bit} undetected: {header:?} {payload:?}"),
            }
        }
    }

    #[test]
    fn zero_header_is_not_a_frame() {
        let zeros = [0u8; 64];
        assert!(is_zero_header(&zeros));
        assert!(matches!(parse(&zeros), Err(RecordError::BadHeader { .. })));
    }

    #[test]
    fn a_length_past_the_end_is_truncated_not_allocated() {
        let mut buf = Vec::new();
        encode_into(&mut buf, &[1; 40], 1, 0, 0).unwrap();
        buf[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(parse(&buf), Err(RecordError::TooLarge { .. })));
        buf[0..4].copy_from_slice(&(MAX_PAYLOAD_LEN).to_le_bytes());
        assert!(matches!(parse(&buf), Err(RecordError::Truncated { .. })));
    }

    proptest! {
        // A fixed seed: the same cases on every run, so a failure reproduces.
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xF4A3_E5EE),
            ..ProptestConfig::default()
        })]
        #[test]
        fn parser_never_panics_on_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let _ = parse(&bytes);
        }

        #[test]
        fn parser_never_panics_on_mutated_frames(
            payload in proptest::collection::vec(any::<u8>(), 0..100),
            index in any::<prop::sample::Index>(),
            value in any::<u8>(),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut buf = Vec::new();
            encode_into(&mut buf, &payload, 3, 7, 1).unwrap();
            let at = index.index(buf.len());
            let changed = buf[at] != value;
            buf[at] = value;
            let end = cut.index(buf.len() + 1);
            let result = parse(&buf[..end]);
            if changed || end < buf.len() {
                prop_assert!(result.is_err());
            }
        }
    }
}
