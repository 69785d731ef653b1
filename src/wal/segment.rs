//! Segment files: naming, the 64-byte segment header, and the in-memory state of a segment.
//!
//! Public so tools and tests can build and read segment files by hand; the byte layout is
//! documented in the `wal` module.
//!
//! A segment is created by the sync thread when the first record placed in it is written:
//! header written, file preallocated to the full segment size (`fallocate`), directory synced;
//! or made from a spare, the file of a cleaned segment (module `wal`, "Recycled segments").
//! Appenders place records in a segment before its file exists; readers wait for the written
//! watermark before touching a record, so they never see a segment without its file.

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
        Arc, OnceLock,
    },
};

use crate::{
    error::WalError,
    wal::{Lsn, SegmentId},
};

/// Bytes of the segment header; records start right after it.
pub const HEADER_LEN: u64 = 64;
/// Segment file magic.
pub const MAGIC: [u8; 8] = *b"CBWALSG\0";
/// The segment format version of a file created for its segment.
pub const VERSION: u8 = 1;
/// The segment format version of a recycled file (module `wal`, "Recycled segments"): the same
/// layout, but frames of the file's earlier use may follow the records. A build from before
/// recycled segments refuses it ([`WalError::UnsupportedVersion`]) instead of reading those
/// frames as damage.
pub const RECYCLED_VERSION: u8 = 2;
const FLAG_HAS_WINDOW: u8 = 1;
/// The largest first LSN a segment header may name: half the LSN space, which no log reaches
/// (2^63 records), so that LSNs counted on from any header cannot wrap.
const MAX_FIRST_LSN: u64 = u64::MAX >> 1;

/// A rolling window `[start_ms, stop_ms]` (both inclusive, SPEC E.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Window start (the time of the record that opened it).
    pub start_ms: i64,
    /// Window end: `start_ms + rolling interval`.
    pub stop_ms: i64,
}

/// The decoded header of a segment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The segment's number (also in its file name).
    pub id: SegmentId,
    /// The LSN of the first record placed in this segment.
    pub first_lsn: u64,
    /// The rolling window, if the log rolls by time.
    pub window: Option<Window>,
    /// The segment size the log was configured with when this segment was created.
    /// Informational (for tools): a log reads a segment within its file's length, so a log
    /// reopened with another size reads the segments made before as they are.
    pub segment_size_bytes: u64,
    /// The file held an earlier segment of the log (a spare, module `wal`, "Recycled
    /// segments"; format version [`RECYCLED_VERSION`]): past this segment's records it may
    /// still hold that segment's frames, all of LSNs below `first_lsn`. The sync thread sets it in
    /// the file when it creates the segment from a spare; the header a running log keeps for a
    /// segment it is writing leaves it false (only recovery reads it, from the file).
    pub recycled: bool,
}

impl SegmentHeader {
    /// Encodes the header (64 bytes, CRC-protected).
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut out = [0u8; HEADER_LEN as usize];
        out[0..8].copy_from_slice(&MAGIC);
        out[8] = if self.recycled { RECYCLED_VERSION } else { VERSION };
        out[9] = if self.window.is_some() { FLAG_HAS_WINDOW } else { 0 };
        out[12..16].copy_from_slice(&self.id.0.to_le_bytes());
        out[16..24].copy_from_slice(&self.first_lsn.to_le_bytes());
        let window = self.window.unwrap_or(Window { start_ms: 0, stop_ms: 0 });
        out[24..32].copy_from_slice(&window.start_ms.to_le_bytes());
        out[32..40].copy_from_slice(&window.stop_ms.to_le_bytes());
        out[40..48].copy_from_slice(&self.segment_size_bytes.to_le_bytes());
        let crc = crate::record::crc::crc32c(&out[0..60]);
        out[60..64].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and verifies a header read from segment `id`'s file.
    ///
    /// # Errors
    /// [`WalError::Corruption`] (offset 0) for a short, damaged or mismatched header,
    /// [`WalError::UnsupportedVersion`] for another format version.
    pub fn decode(id: SegmentId, bytes: &[u8]) -> Result<Self, WalError> {
        let corrupt = |reason: String| WalError::Corruption { segment: id.0, offset: 0, reason };
        if bytes.len() < HEADER_LEN as usize {
            return Err(corrupt(format!(
                "segment header needs {HEADER_LEN} bytes, file has {}",
                bytes.len()
            )));
        }
        let stored = u32::from_le_bytes(bytes[60..64].try_into().expect("4 bytes"));
        let computed = crate::record::crc::crc32c(&bytes[0..60]);
        if stored != computed {
            return Err(corrupt(format!(
                "segment header checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
            )));
        }
        if bytes[0..8] != MAGIC {
            return Err(corrupt("segment header magic is wrong".into()));
        }
        if bytes[8] != VERSION && bytes[8] != RECYCLED_VERSION {
            return Err(WalError::UnsupportedVersion {
                segment: id.0,
                found: bytes[8],
                supported: RECYCLED_VERSION,
            });
        }
        let stored_id = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
        if stored_id != id.0 {
            return Err(corrupt(format!(
                "segment header names segment {stored_id}, file name says {}",
                id.0
            )));
        }
        let first_lsn = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        if first_lsn > MAX_FIRST_LSN {
            // No log appends 2^63 records: only a forged header gets here, and LSNs counted on
            // from it would wrap.
            return Err(corrupt(format!(
                "segment header's first LSN {first_lsn} is beyond any log's reach"
            )));
        }
        let read_i64 = |at: usize| i64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let window = (bytes[9] & FLAG_HAS_WINDOW != 0)
            .then(|| Window { start_ms: read_i64(24), stop_ms: read_i64(32) });
        Ok(Self {
            id,
            first_lsn,
            window,
            segment_size_bytes: u64::from_le_bytes(bytes[40..48].try_into().expect("8 bytes")),
            recycled: bytes[8] == RECYCLED_VERSION,
        })
    }
}

/// The file name of segment `id`: `seg-<id, 10 digits>.wal`, so names sort in log order.
pub fn file_name(id: SegmentId) -> String {
    format!("seg-{:010}.wal", id.0)
}

/// The segment number in a file name made by [`file_name`], or `None` for other files.
pub fn parse_file_name(name: &str) -> Option<SegmentId> {
    parse_numbered(name, "seg-")
}

/// The number in a file name `<prefix><10 digits>.wal`, or `None` for other names.
fn parse_numbered(name: &str, prefix: &str) -> Option<SegmentId> {
    let digits = name.strip_prefix(prefix)?.strip_suffix(".wal")?;
    if digits.len() != 10 || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(SegmentId)
}

/// The file name of a spare: the file of retired segment `id`, kept for reuse (module `wal`,
/// "Recycled segments"). Not a segment: scans ignore it, and opening a log deletes it.
pub fn spare_file_name(id: SegmentId) -> String {
    format!("spare-{:010}.wal", id.0)
}

/// Whether `name` is a spare's file name (made by [`spare_file_name`]).
pub fn is_spare_file_name(name: &str) -> bool {
    parse_numbered(name, "spare-").is_some()
}

/// The in-memory state of one segment, shared by appenders, the sync thread and readers.
#[derive(Debug)]
pub(crate) struct Segment {
    /// The segment's header (as written or recovered).
    pub header: SegmentHeader,
    /// The file's path.
    pub path: PathBuf,
    /// The read-only mapping of the file; set once the file exists (by recovery, or by the
    /// sync thread when it creates the file).
    pub map: OnceLock<Arc<crate::wal::reader::SegmentMap>>,
    /// Largest record time in the segment (`i64::MIN` while empty). Written by appenders
    /// under the append lock, read by `clean`.
    pub max_time_ms: AtomicI64,
    /// LSN of the last record placed in the segment (0 while empty).
    pub last_lsn: AtomicU64,
    /// Byte offset just past the last record written (by the sync thread, or a leading
    /// appender) or recovered.
    pub end_offset: AtomicU64,
    /// Every record of the segment is written and synced and no more will be added (set by
    /// recovery, and by the sync thread when it moves on to the next segment). Only sealed
    /// segments may be cleaned.
    pub sealed: AtomicBool,
    /// Byte offset where appends to the segment ended, set (under the append lock) when the
    /// next segment became the active one; 0 while it is active, and for recovered segments.
    pub appended_end: AtomicU64,
    /// Byte ranges holding records, for segments where tolerant recovery skipped damage
    /// (`None`: one range from the header to `end_offset`).
    pub valid_ranges: Option<Vec<(u64, u64)>>,
    /// Found by recovery, not created by this log: never kept as a spare (only this process
    /// knows that every frame of a segment it created has an LSN below the next one; a log
    /// opened tolerating corruption need not hold LSNs in order).
    pub recovered: bool,
}

impl Segment {
    /// A segment state for `header` stored at `dir`.
    pub fn new(dir: &Path, header: SegmentHeader) -> Self {
        Self {
            path: dir.join(file_name(header.id)),
            header,
            map: OnceLock::new(),
            max_time_ms: AtomicI64::new(i64::MIN),
            last_lsn: AtomicU64::new(0),
            end_offset: AtomicU64::new(HEADER_LEN),
            sealed: AtomicBool::new(false),
            appended_end: AtomicU64::new(0),
            valid_ranges: None,
            recovered: false,
        }
    }

    /// Bytes of the segment's file as mapped (0 if it has no file yet).
    pub fn file_len(&self) -> u64 {
        self.map.get().map_or(0, |map| map.len() as u64)
    }

    /// The segment's end time for cleaning (SPEC 0.6): the window end if the log rolls by
    /// time, else the largest record time (`i64::MIN` for an empty segment).
    pub fn end_time_ms(&self) -> i64 {
        match self.header.window {
            Some(window) => window.stop_ms,
            None => self.max_time_ms.load(Ordering::Acquire),
        }
    }

    /// Whether every record the segment holds has an LSN below `lsn`.
    pub fn holds_only_below(&self, lsn: Lsn) -> bool {
        let last = self.last_lsn.load(Ordering::Acquire);
        // An empty segment holds nothing at or above any LSN past its start.
        let last = if last == 0 { self.header.first_lsn.saturating_sub(1) } else { last };
        last < lsn.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_detects_damage() {
        let header = SegmentHeader {
            id: SegmentId(7),
            first_lsn: 1234,
            window: Some(Window { start_ms: 10_000, stop_ms: 11_000 }),
            segment_size_bytes: 1 << 20,
            recycled: false,
        };
        let bytes = header.encode();
        assert_eq!(SegmentHeader::decode(SegmentId(7), &bytes).unwrap(), header);
        let recycled = SegmentHeader { recycled: true, window: None, ..header };
        assert_eq!(SegmentHeader::decode(SegmentId(7), &recycled.encode()).unwrap(), recycled);
        assert!(SegmentHeader::decode(SegmentId(8), &bytes).is_err());
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes;
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(SegmentHeader::decode(SegmentId(7), &damaged).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn a_header_whose_first_lsn_would_wrap_the_log_is_corrupt() {
        let header = |first_lsn| SegmentHeader {
            id: SegmentId(3),
            first_lsn,
            window: None,
            segment_size_bytes: 1 << 20,
            recycled: false,
        };
        // A checksum-valid header: only the value is wrong.
        match SegmentHeader::decode(SegmentId(3), &header(u64::MAX).encode()) {
            Err(WalError::Corruption { segment: 3, offset: 0, reason }) => {
                assert!(reason.contains(&u64::MAX.to_string()), "{reason}")
            }
            other => panic!("expected Corruption, got {other:?}"),
        }
        let last_accepted = header(MAX_FIRST_LSN);
        assert_eq!(
            SegmentHeader::decode(SegmentId(3), &last_accepted.encode()).unwrap(),
            last_accepted
        );
    }

    #[test]
    fn names_sort_in_order_and_parse_back() {
        let names: Vec<String> =
            [1u32, 9, 10, 4_000_000_000].iter().map(|id| file_name(SegmentId(*id))).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert_eq!(parse_file_name(&names[2]), Some(SegmentId(10)));
        assert_eq!(parse_file_name("seg-12.wal"), None);
        assert_eq!(parse_file_name("log-1-2"), None);
        let spare = spare_file_name(SegmentId(12));
        assert_eq!(spare, "spare-0000000012.wal");
        assert!(is_spare_file_name(&spare));
        assert_eq!(parse_file_name(&spare), None, "a spare is not a segment");
        assert!(!is_spare_file_name("spare-12.wal") && !is_spare_file_name(&names[0]));
    }
}
