//! Recovery: the scan run when a log is opened, and by `coordbus-wal verify`.
//!
//! Segments are scanned in id order, frame by frame (bounds, magic, CRC, consecutive LSNs).
//! Where a segment's records stop before its end, the rules of the format decide (module
//! `wal`, "Durability order"; raft-engine's `RecoveryMode` is the model):
//!
//! | where          | found where the records stop                          | outcome          |
//! |----------------|-------------------------------------------------------|------------------|
//! | any segment    | all-zero header or end of file, nothing valid after   | clean end        |
//! | sealed segment | damaged frame (whatever follows it)                   | corruption       |
//! | last segment   | damage or garbage, no later record proves it durable  | torn tail: cut   |
//! | last segment   | a later record appended after the damaged one was durable | corruption   |
//! | last segment   | damaged segment header, nothing but zeros after it    | file removed     |
//! | recycled, sealed | at the next segment's first LSN, no frame at or above it | clean end |
//! | recycled, last | no frame (nor frame header) of LSN at or above the expected one | clean end |
//! | other segment  | damaged segment header                                | corruption       |
//! | next segment   | first LSN does not follow the previous segment's last | corruption       |
//!
//! ("Sealed" is every segment but the last; "file removed" is a torn creation: the process
//! died between creating the file and making its header durable, so nothing was written after
//! the header's place; a damaged header with anything after it is the "other segment" row.
//! "Recycled" segments' files held earlier segments, whose frames of lower LSNs follow their
//! records: module `wal`, "Recycled segments".) Spare files are no segments: a writer's open
//! deletes them.
//!
//! After the scan, a failed log's marker ([`super::UNSYNCED_MARKER`]) cuts every record after
//! the durable LSN it names: the segment holding the next LSN ends before it (cut like a torn
//! tail), and later segments are removed whole; LSNs continue after the durable one.
//!
//! "Corruption" fails the open with [`WalError::Corruption`] naming segment and offset in
//! [`RecoveryMode::Strict`]; in [`RecoveryMode::TolerateCorruption`] the damaged stretch (or
//! segment) is skipped, every valid record kept, and the skip reported. A segment skipped
//! whole after the last one kept takes its LSNs with it: with a failed log's marker, LSNs
//! continue after the marker's LSN; without one, nothing says how far the skipped records
//! went, and LSNs continue after the last record kept (new records may then take LSNs the
//! damaged segment held).
//!
//! Length fields are checked against the bytes of the file before they are used, and nothing
//! is allocated from them: frames are parsed in place in the memory map.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use crate::{
    error::WalError,
    record::frame,
    wal::{
        reader::{data_regions, SegmentMap},
        segment::{self, Segment, SegmentHeader, Window, HEADER_LEN},
        storage::Storage,
        writer::{pwrite::write_all_at, WriteOp},
        Lsn, RecoveryMode, SegmentId, WalConfig,
    },
};

/// A torn tail cut off the last segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The segment cut.
    pub segment: SegmentId,
    /// Where the log now ends (the first byte cut).
    pub offset: u64,
    /// Non-zero bytes discarded from `offset` on (partial records, garbage).
    pub bytes_discarded: u64,
    /// Complete records discarded with it (written after the last sync, never acknowledged).
    pub records_discarded: u64,
}

/// Records a failed log had appended after its last durable LSN, cut on opening (module
/// `wal`, "Durability order": the [`super::UNSYNCED_MARKER`] the failure left).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnsyncedCut {
    /// The failed log's last durable LSN: the log now ends there.
    pub durable_lsn: Lsn,
    /// Complete records cut after it (never acknowledged).
    pub records_discarded: u64,
    /// Segments removed because every record of theirs came after it (also one created with
    /// its header, before any of its records was durable).
    pub segments_removed: u64,
}

/// Damage skipped in tolerant mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptionNote {
    /// The damaged segment.
    pub segment: SegmentId,
    /// Where the damage starts.
    pub offset: u64,
    /// What was found.
    pub reason: String,
    /// Bytes skipped.
    pub bytes_skipped: u64,
    /// Records known lost (from the LSN gap), if known.
    pub records_skipped: u64,
}

/// What the scan found in one segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSummary {
    /// The segment's number.
    pub id: SegmentId,
    /// Its file.
    pub path: PathBuf,
    /// The file's length.
    pub file_len: u64,
    /// The segment header, if readable.
    pub first_lsn_in_header: Option<Lsn>,
    /// Rolling window from the header, as `(start_ms, stop_ms)`.
    pub window: Option<(i64, i64)>,
    /// Valid records.
    pub records: u64,
    /// LSN of the first valid record.
    pub first_lsn: Option<Lsn>,
    /// LSN of the last valid record.
    pub last_lsn: Option<Lsn>,
    /// Smallest and largest record time.
    pub time_range_ms: Option<(i64, i64)>,
    /// Offset just past the last valid record.
    pub valid_end: u64,
    /// Bytes of valid frames.
    pub record_bytes: u64,
    /// Torn tail cut here, if any.
    pub torn_tail: Option<TornTail>,
    /// Damage skipped here (tolerant mode).
    pub corruption: Vec<CorruptionNote>,
    /// The segment was unreadable and skipped as a whole (tolerant mode).
    pub skipped: bool,
    /// The segment is dropped: a torn creation (last, no valid header, nothing but zeros after
    /// it; `first_lsn_in_header` is `None`), or every record of it was cut after a failed
    /// log's last durable LSN.
    pub dropped: bool,
    /// The segment's file held an earlier segment (its header says so): bytes past
    /// `valid_end` may be that segment's frames (module `wal`, "Recycled segments").
    pub recycled: bool,
}

/// What opening a log found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments kept.
    pub segments: usize,
    /// Valid records kept.
    pub records: u64,
    /// Bytes of valid frames kept.
    pub bytes: u64,
    /// The first LSN kept (`Lsn::ZERO` if none).
    pub first_lsn: Lsn,
    /// The last LSN kept; without records, the LSN before the first one a kept segment's
    /// header names, or else a failed log's durable LSN ([`Self::unsynced_cut`]); `Lsn::ZERO`
    /// if none of these. LSNs continue after it.
    pub last_lsn: Lsn,
    /// The torn tail cut off, if any.
    pub torn_tail: Option<TornTail>,
    /// Damage skipped (tolerant mode only).
    pub corruption_skipped: Vec<CorruptionNote>,
    /// Segment files skipped as a whole (tolerant mode), dropped as a torn creation, or
    /// dropped because every record of theirs was cut with [`Self::unsynced_cut`].
    pub segments_skipped: Vec<SegmentId>,
    /// What a failed log's marker cut, if the log had failed (and left one).
    pub unsynced_cut: Option<UnsyncedCut>,
    /// How long the scan took.
    pub elapsed: Duration,
}

impl std::fmt::Display for RecoveryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.records == 0 {
            write!(f, "no records in {} segment(s)", self.segments)?;
        } else {
            write!(
                f,
                "{} records (LSN {}..={}) in {} segment(s), {} bytes",
                self.records, self.first_lsn, self.last_lsn, self.segments, self.bytes
            )?;
        }
        write!(f, ", scanned in {:.1} ms", self.elapsed.as_secs_f64() * 1e3)?;
        match &self.torn_tail {
            Some(tail) => write!(
                f,
                "; torn tail cut in segment {} at offset {}: {} bytes and {} complete records \
                 discarded",
                tail.segment, tail.offset, tail.bytes_discarded, tail.records_discarded
            )?,
            None => write!(f, "; no torn tail")?,
        }
        for note in &self.corruption_skipped {
            write!(
                f,
                "; skipped damage in segment {} at offset {} ({} bytes, {} records): {}",
                note.segment, note.offset, note.bytes_skipped, note.records_skipped, note.reason
            )?;
        }
        if let Some(cut) = &self.unsynced_cut {
            write!(
                f,
                "; the log had failed: {} records after its last durable LSN {} cut",
                cut.records_discarded, cut.durable_lsn
            )?;
        }
        if !self.segments_skipped.is_empty() {
            let ids: Vec<String> = self.segments_skipped.iter().map(ToString::to_string).collect();
            write!(f, "; segments skipped: {}", ids.join(", "))?;
        }
        Ok(())
    }
}

/// The result of scanning a directory without changing it.
#[derive(Debug, Clone)]
pub struct DirScan {
    /// Every segment file found, in order.
    pub segments: Vec<SegmentSummary>,
    /// The totals, as opening would report them.
    pub report: RecoveryReport,
}

/// A segment after scanning, with its mapping.
struct Scanned {
    summary: SegmentSummary,
    header: Option<SegmentHeader>,
    map: Option<Arc<SegmentMap>>,
    ranges: Vec<(u64, u64)>,
    max_time_ms: i64,
}

/// What `Wal::open` needs from recovery.
pub(crate) struct Recovered {
    pub(crate) segments: Vec<Arc<Segment>>,
    pub(crate) report: RecoveryReport,
    pub(crate) next_segment_id: u64,
}

/// The files of `dir` whose names `select` maps to a key (a missing directory has none).
fn files_named<K>(
    dir: &Path,
    select: impl Fn(&str) -> Option<K>,
) -> Result<Vec<(K, PathBuf)>, WalError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(WalError::from_io("list directory", dir, 0, &error)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|error| WalError::from_io("list directory", dir, 0, &error))?;
        if let Some(key) = entry.file_name().to_str().and_then(&select) {
            found.push((key, entry.path()));
        }
    }
    Ok(found)
}

/// The first file of a log found in `dir` (a segment, a spare, a failed log's marker or its
/// temporary), if any. A writer that found `dir` missing when it opened checks, once it holds
/// the lock, that no other writer made a log there since.
pub(crate) fn first_log_file(dir: &Path) -> Result<Option<PathBuf>, WalError> {
    let is_log_file = |name: &str| {
        (segment::parse_file_name(name).is_some()
            || segment::is_spare_file_name(name)
            || name == super::UNSYNCED_MARKER
            || name == super::UNSYNCED_MARKER_TEMP)
            .then_some(())
    };
    Ok(files_named(dir, is_log_file)?.into_iter().next().map(|((), path)| path))
}

/// Lists segment files of `dir` in id order. A segment's name on something that is not a
/// regular file (a directory, say) is an error naming it, not a file to map.
fn list(dir: &Path) -> Result<Vec<(SegmentId, PathBuf)>, WalError> {
    let mut found = files_named(dir, segment::parse_file_name)?;
    for (_, path) in &found {
        let metadata = std::fs::metadata(path)
            .map_err(|error| WalError::from_io("stat segment", path, 0, &error))?;
        if !metadata.is_file() {
            let not_a_file = std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a segment's name on something that is not a regular file",
            );
            return Err(WalError::from_io("list segments", path, 0, &not_a_file));
        }
    }
    found.sort();
    Ok(found)
}

/// Lists the spare files of `dir` (module `wal`, "Recycled segments").
fn list_spares(dir: &Path) -> Result<Vec<PathBuf>, WalError> {
    let found = files_named(dir, |name| segment::is_spare_file_name(name).then_some(()))?;
    Ok(found.into_iter().map(|((), path)| path).collect())
}

/// Bytes a scan of one segment may checksum while it searches for frames past damage or a
/// torn tail ([`find_frame`]), per byte of the segment. A segment this crate wrote needs about
/// one pass per search: a candidate is checksummed only if it claims an LSN this log can have
/// written there, and each frame of a run is found once ([`BestProofs`]). A segment of forged
/// headers that all claim such an LSN and a long payload would otherwise cost time quadratic
/// in its size (hours for one of 64 MiB).
const SEARCH_CHECKSUM_BYTES_PER_BYTE: u64 = 4;

/// What a segment's searches may still checksum ([`SEARCH_CHECKSUM_BYTES_PER_BYTE`]).
struct SearchBudget {
    left: u64,
    limit: u64,
}

impl SearchBudget {
    fn for_segment(segment_len: u64) -> Self {
        let limit = segment_len.saturating_mul(SEARCH_CHECKSUM_BYTES_PER_BYTE);
        Self { left: limit, limit }
    }

    fn spend(&mut self, bytes: u64) -> Result<(), SearchBudgetSpent> {
        self.left = self.left.checked_sub(bytes).ok_or(SearchBudgetSpent { limit: self.limit })?;
        Ok(())
    }
}

/// A search for frames checksummed more than its segment's budget allows.
#[derive(Debug, Clone, Copy)]
struct SearchBudgetSpent {
    limit: u64,
}

impl SearchBudgetSpent {
    /// Why the search stopped: the segment holds forged (or repeated) frame headers.
    fn reason(self) -> String {
        format!(
            "searching past the damage at this offset checksummed more than {} bytes of frames \
             that claim an LSN this log can have written there: forged or repeated frame headers",
            self.limit
        )
    }
}

/// A frame found by a search: its offset and its header.
type FoundFrame = (u64, frame::FrameHeader);

/// The first valid frame at or after `from` (16-byte steps) that this log can have written
/// there, if the record of LSN `min_lsn` would start at `origin` (at most `from`): its LSN is
/// at least `min_lsn`, and at most one more per smallest frame (a bare header) between
/// `origin` and it. A frame claiming a larger LSN was not written there by this log (crafted
/// or foreign bytes with a valid CRC): taking it as proof, or resuming at its LSN, would let
/// LSNs jump towards their end (and wrap). The claimed LSN is checked before the checksum,
/// which `budget` bounds.
fn find_frame(
    bytes: &[u8],
    origin: u64,
    from: u64,
    min_lsn: u64,
    budget: &mut SearchBudget,
) -> Result<Option<FoundFrame>, SearchBudgetSpent> {
    let mut at = (from as usize).next_multiple_of(frame::ALIGN);
    while at + frame::HEADER_LEN <= bytes.len() {
        let candidate = &bytes[at..];
        if let Some(lsn) = frame::claimed_lsn(candidate) {
            let most_records = (at as u64).saturating_sub(origin) / frame::HEADER_LEN as u64;
            if lsn >= min_lsn && lsn - min_lsn <= most_records {
                budget.spend(claimed_checksum_bytes(candidate))?;
                if let Ok((header, _)) = frame::parse(candidate) {
                    return Ok(Some((at as u64, header)));
                }
            }
        }
        at += frame::ALIGN;
    }
    Ok(None)
}

/// At most how many bytes [`frame::parse`] checksums for the frame header at the start of
/// `candidate` (its claimed length, within what `candidate` holds).
fn claimed_checksum_bytes(candidate: &[u8]) -> u64 {
    let claimed = u32::from_le_bytes(candidate[0..4].try_into().expect("a header's 4 bytes"));
    let payload = claimed.min(frame::MAX_PAYLOAD_LEN) as usize;
    frame::frame_len(payload).min(candidate.len()) as u64
}

/// The best proofs of runs found so far in one segment, by the offset of a frame on the run
/// ([`best_proof`]): the run that follows a frame (each next one found by [`find_frame`] past
/// the one before, with a higher LSN) depends only on that frame, so a later search that
/// reaches a frame seen before stops there. Without it a damaged stretch at every other frame
/// (tolerant recovery goes on after each) would walk the rest of the segment once per stretch.
type BestProofs = HashMap<u64, FoundFrame>;

/// The frame of the run that starts with `first` with the largest synced LSN at append: the
/// best proof that records before the run were durable. The synced LSN a frame carries grows
/// with its LSN, except where its gap saturated (then it claims nothing), so this is the run's
/// last frame but for those.
fn best_proof(
    bytes: &[u8],
    first: FoundFrame,
    known: &mut BestProofs,
    budget: &mut SearchBudget,
) -> Result<FoundFrame, SearchBudgetSpent> {
    let mut walked = Vec::new();
    let mut current = first;
    let mut best = loop {
        if let Some(&best) = known.get(&current.0) {
            break best;
        }
        walked.push(current);
        let after = current.0 + current.1.frame_len();
        match find_frame(bytes, after, after, current.1.lsn.saturating_add(1), budget)? {
            Some(next) => current = next,
            None => break current,
        }
    };
    // From the end back: each walked frame's best proof is the better of its own and the
    // later frames'.
    for frame in walked.into_iter().rev() {
        if frame.1.synced_lsn_at_append() > best.1.synced_lsn_at_append() {
            best = frame;
        }
        known.insert(frame.0, best);
    }
    Ok(best)
}

/// True if every byte of `bytes` is zero (word-wise, so the compiler vectorizes it).
fn all_zero(bytes: &[u8]) -> bool {
    let words = bytes.chunks_exact(8);
    let tail_zero = words.remainder().iter().all(|byte| *byte == 0);
    tail_zero
        && words
            .map(|word| u64::from_ne_bytes(word.try_into().expect("8 bytes")))
            .fold(0, |acc, word| acc | word)
            == 0
}

/// [`nonzero_end`] of `path`'s mapping `bytes`, reading only the regions that may hold data
/// (holes read as zeros: a preallocated or sparse file is not faulted in page by page).
fn nonzero_end_of_file(path: &Path, bytes: &[u8], from: u64) -> u64 {
    data_regions(path, from, bytes.len() as u64)
        .into_iter()
        .map(|(start, end)| nonzero_end(&bytes[..(end as usize).min(bytes.len())], start))
        .max()
        .unwrap_or(from)
        .max(from)
}

/// Offset just past the last non-zero byte at or after `from` (`from` if all zero).
fn nonzero_end(bytes: &[u8], from: u64) -> u64 {
    let from = (from as usize).min(bytes.len());
    let mut end = bytes.len();
    while end > from {
        let start = end.saturating_sub(4096).max(from);
        let chunk = &bytes[start..end];
        if !all_zero(chunk) {
            let last = chunk.iter().rposition(|byte| *byte != 0).expect("not all zero");
            return (start + last + 1) as u64;
        }
        end = start;
    }
    from as u64
}

/// Whether a segment file whose header does not decode is a torn creation: the process died
/// between creating the file and making its header durable. A new file's header is written
/// and synced before any record is written (module `writer`, `new_file`; a spare's before it
/// takes a segment's name), so such a file holds nothing past the header's place: every byte
/// after it is zero (preallocated) or absent. Anything else there (records, garbage) was
/// written after a durable header, so the header was damaged later: corruption, never a file
/// to remove on open. (Holes are skipped: a preallocated file is not read through.)
fn is_torn_creation(path: &Path, bytes: &[u8]) -> bool {
    data_regions(path, HEADER_LEN, bytes.len() as u64).into_iter().all(|(from, to)| {
        let region = &bytes[(from as usize).min(bytes.len())..(to as usize).min(bytes.len())];
        all_zero(region)
    })
}

/// What the file after a segment says about where that segment ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// No file follows: the segment is the last.
    Nothing,
    /// The next segment's header names its first LSN.
    Starts(u64),
    /// The next file is the last and a torn creation (no readable header, nothing but zeros
    /// after it): the segment before it was complete and synced when its creation began.
    TornCreation,
    /// The next file's header is unreadable, and it is no torn creation.
    Unreadable(SegmentId),
}

impl Next {
    /// What follows `files[index]` (`maps`: the files' mappings).
    fn of(files: &[(SegmentId, PathBuf)], maps: &[Arc<SegmentMap>], index: usize) -> Self {
        let (Some((id, _)), Some(map)) = (files.get(index + 1), maps.get(index + 1)) else {
            return Next::Nothing;
        };
        let bytes = map.bytes();
        if let Ok(header) = SegmentHeader::decode(*id, bytes) {
            return Next::Starts(header.first_lsn);
        }
        let is_last = index + 2 == files.len();
        if is_last && is_torn_creation(&files[index + 1].1, bytes) {
            Next::TornCreation
        } else {
            Next::Unreadable(*id)
        }
    }

    /// Whether records that stop at `expected` end the segment before: the next segment
    /// starts there, or its creation was torn (module `wal`, "Recycled segments").
    fn confirms_end_at(self, expected: u64) -> bool {
        match self {
            Next::Starts(first) => first == expected,
            Next::TornCreation => true,
            Next::Nothing | Next::Unreadable(_) => false,
        }
    }
}

/// Searches past the damage (or the end of the records) at `at`: the first frame this log can
/// have written after it, and the proof that the records before it were lost to damage, not
/// cut by a crash. In a sealed segment any later record proves damage. In the last one, a
/// later record appended after LSN `expected` was durable does: the first one found may have
/// been appended in the same group, before that sync, so the proof is the run's frame with the
/// largest synced LSN ([`best_proof`]).
fn search_past(
    region: &[u8],
    at: u64,
    expected: u64,
    is_last: bool,
    budget: &mut SearchBudget,
    best_proofs: &mut BestProofs,
) -> Result<(Option<FoundFrame>, Option<FoundFrame>), SearchBudgetSpent> {
    let later = find_frame(region, at, at + frame::ALIGN as u64, expected, budget)?;
    let proof = match later {
        Some(first) if is_last => Some(best_proof(region, first, best_proofs, budget)?)
            .filter(|(_, proof)| proof.synced_lsn_at_append() >= expected),
        _ => later,
    };
    Ok((later, proof))
}

/// The frames after a torn tail at `at`, from `first` (the first one [`search_past`] found)
/// on: how many, and where the last ends (`at` if none).
fn frames_after_torn(
    region: &[u8],
    at: u64,
    first: Option<FoundFrame>,
    expected: u64,
    budget: &mut SearchBudget,
) -> Result<(u64, u64), SearchBudgetSpent> {
    let (mut count, mut end, mut next) = (0, at, first);
    while let Some((found_at, found)) = next {
        count += 1;
        end = found_at + found.frame_len();
        next = find_frame(region, at, end, expected, budget)?;
    }
    Ok((count, end))
}

/// After a search past `at` spent its budget ([`SearchBudgetSpent`]): corruption in strict
/// mode; in tolerant mode the rest of the segment, from `at` to `garbage_end`, is skipped as
/// damage and the segment's records end at `at`. In the last segment those bytes are also cut
/// on open, as a torn tail is: the next open would find the segment sealed, search past `at`
/// for less, and could take a frame there (never acknowledged) for a record, under an LSN the
/// log has given to a new one since.
fn give_up_search(
    spent: SearchBudgetSpent,
    at: u64,
    garbage_end: u64,
    tolerant: bool,
    is_last: bool,
    summary: &mut SegmentSummary,
) -> Result<(), WalError> {
    let reason = spent.reason();
    if !tolerant {
        return Err(WalError::Corruption { segment: summary.id.0, offset: at, reason });
    }
    summary.corruption.push(CorruptionNote {
        segment: summary.id,
        offset: at,
        reason,
        bytes_skipped: garbage_end - at,
        records_skipped: 0,
    });
    if is_last {
        summary.torn_tail = Some(TornTail {
            segment: summary.id,
            offset: at,
            bytes_discarded: garbage_end - at,
            records_discarded: 0,
        });
    }
    Ok(())
}

/// Scans one segment. `expected_first` is the LSN the previous segment says comes next;
/// `next` what the file after it says.
fn scan_segment(
    id: SegmentId,
    path: &Path,
    map: Arc<SegmentMap>,
    next: Next,
    mode: RecoveryMode,
    expected_first: Option<u64>,
) -> Result<Scanned, WalError> {
    let is_last = next == Next::Nothing;
    let bytes = map.bytes();
    let len = bytes.len() as u64;
    let tolerant = mode == RecoveryMode::TolerateCorruption;
    let mut summary = SegmentSummary {
        id,
        path: path.to_path_buf(),
        file_len: len,
        first_lsn_in_header: None,
        window: None,
        records: 0,
        first_lsn: None,
        last_lsn: None,
        time_range_ms: None,
        valid_end: HEADER_LEN.min(len),
        record_bytes: 0,
        torn_tail: None,
        corruption: Vec::new(),
        skipped: false,
        dropped: false,
        recycled: false,
    };
    let header = match SegmentHeader::decode(id, bytes) {
        Ok(header) => header,
        Err(error @ WalError::UnsupportedVersion { .. }) => return Err(error),
        Err(error) => {
            if is_last && is_torn_creation(path, bytes) {
                // Created, then the process died before its header reached the disk: nothing
                // in it was ever acknowledged.
                summary.dropped = true;
                summary.torn_tail = Some(TornTail {
                    segment: id,
                    offset: 0,
                    bytes_discarded: nonzero_end_of_file(path, bytes, 0),
                    records_discarded: 0,
                });
                return Ok(Scanned {
                    summary,
                    header: None,
                    map: Some(map),
                    ranges: Vec::new(),
                    max_time_ms: i64::MIN,
                });
            }
            if !tolerant {
                return Err(error);
            }
            summary.skipped = true;
            summary.corruption.push(CorruptionNote {
                segment: id,
                offset: 0,
                reason: error.to_string(),
                bytes_skipped: len,
                records_skipped: 0,
            });
            return Ok(Scanned {
                summary,
                header: None,
                map: Some(map),
                ranges: Vec::new(),
                max_time_ms: i64::MIN,
            });
        }
    };
    summary.first_lsn_in_header = Some(Lsn(header.first_lsn));
    summary.recycled = header.recycled;
    summary.window = header.window.map(|Window { start_ms, stop_ms }| (start_ms, stop_ms));
    if let Some(expected) = expected_first {
        if expected != header.first_lsn {
            let reason = format!(
                "segment starts at LSN {} but the previous segment ends before LSN {expected}",
                header.first_lsn
            );
            if !tolerant {
                return Err(WalError::Corruption { segment: id.0, offset: 0, reason });
            }
            summary.corruption.push(CorruptionNote {
                segment: id,
                offset: 0,
                reason,
                bytes_skipped: 0,
                records_skipped: header.first_lsn.abs_diff(expected),
            });
        }
    }
    let mut expected = header.first_lsn;
    let mut at = HEADER_LEN;
    let mut range_start = HEADER_LEN;
    let mut ranges = Vec::new();
    let mut max_time = i64::MIN;
    let mut min_time = i64::MAX;
    let mut best_proofs = BestProofs::new();
    let mut budget = SearchBudget::for_segment(len);
    loop {
        let rest = &bytes[at as usize..];
        let parsed = frame::parse(rest);
        if let Ok((frame_header, _)) = &parsed {
            if frame_header.lsn == expected {
                summary.records += 1;
                summary.first_lsn.get_or_insert(Lsn(frame_header.lsn));
                summary.last_lsn = Some(Lsn(frame_header.lsn));
                summary.record_bytes += frame_header.frame_len();
                max_time = max_time.max(frame_header.time_ms);
                min_time = min_time.min(frame_header.time_ms);
                at += frame_header.frame_len();
                expected += 1;
                continue;
            }
        }
        let zero = if rest.len() < frame::HEADER_LEN {
            rest.iter().all(|byte| *byte == 0)
        } else {
            frame::is_zero_header(rest)
        };
        let problem: Option<String> = match parsed {
            _ if zero => None,
            Ok((frame_header, _)) => {
                Some(format!("record has LSN {} where LSN {expected} belongs", frame_header.lsn))
            }
            Err(error) => Some(format!("damaged record where LSN {expected} belongs: {error}")),
        };
        // The records stop at `at`: a zero header / end of file (`problem` is None) or damage.
        if zero && !is_last {
            break;
        }
        // Nothing past the last non-zero byte can be a frame: bound the search there (the
        // zeroed, preallocated rest of an active segment is not scanned twice).
        let garbage_end = nonzero_end_of_file(path, bytes, at);
        // Frames end on an alignment boundary, and their padding is zeros: a frame whose last
        // bytes are padding ends past `garbage_end`.
        let search_end = (garbage_end as usize).next_multiple_of(frame::ALIGN).min(bytes.len());
        let region = &bytes[..search_end];
        let searched = if garbage_end > at {
            search_past(region, at, expected, is_last, &mut budget, &mut best_proofs)
        } else {
            Ok((None, None))
        };
        let (later, proof) = match searched {
            Ok(found) => found,
            Err(spent) => {
                give_up_search(spent, at, garbage_end, tolerant, is_last, &mut summary)?;
                break;
            }
        };
        if let (Some((later_at, later_header)), Some((proof_at, proof_header))) = (later, proof) {
            let what = problem.clone().unwrap_or_else(|| "records missing (zeroed)".into());
            let reason = if is_last {
                format!(
                    "{what}; LSN {} at offset {proof_at} was appended after LSN {expected} was \
                     durable",
                    proof_header.lsn
                )
            } else {
                format!("{what}; in a sealed segment")
            };
            if !tolerant {
                return Err(WalError::Corruption { segment: id.0, offset: at, reason });
            }
            summary.corruption.push(CorruptionNote {
                segment: id,
                offset: at,
                reason,
                bytes_skipped: later_at - at,
                records_skipped: later_header.lsn - expected,
            });
            ranges.push((range_start, at));
            range_start = later_at;
            at = later_at;
            expected = later_header.lsn;
            continue;
        }
        match problem {
            // A recycled sealed segment whose records stop where the next segment starts (or
            // before a torn creation): what follows is its file's earlier use (frames of lower
            // LSNs; garbage where they do not start at a frame boundary of this use), not
            // damage. Without the next file to confirm the end, it is judged like any sealed
            // segment, except in strict mode when that file's header is damaged and nothing
            // here is a frame of this use: the header is then the corruption named.
            Some(_) if !is_last && header.recycled && next.confirms_end_at(expected) => {}
            Some(reason) if !is_last => {
                if !tolerant {
                    let frame_of_this_use =
                        frame::claimed_lsn(rest).is_some_and(|lsn| lsn >= expected);
                    if let (true, false, Next::Unreadable(next_id)) =
                        (header.recycled, frame_of_this_use, next)
                    {
                        return Err(WalError::Corruption {
                            segment: next_id.0,
                            offset: 0,
                            reason: format!(
                                "damaged segment header: it alone could confirm where the \
                                 records of recycled segment {} before it end (at offset {at}: \
                                 {reason})",
                                id.0
                            ),
                        });
                    }
                    return Err(WalError::Corruption {
                        segment: id.0,
                        offset: at,
                        reason: format!("{reason}; in a sealed segment"),
                    });
                }
                summary.corruption.push(CorruptionNote {
                    segment: id,
                    offset: at,
                    reason,
                    bytes_skipped: garbage_end - at,
                    records_skipped: 0,
                });
            }
            _ if garbage_end > at => {
                match frames_after_torn(region, at, later, expected, &mut budget) {
                    Err(spent) => {
                        give_up_search(spent, at, garbage_end, tolerant, is_last, &mut summary)?
                    }
                    Ok((records_discarded, frames_end)) => {
                        // In a recycled segment only frames of this use (LSN `expected` or
                        // more, complete or not) are a torn tail; the rest is the earlier
                        // use's.
                        let partial = frame::claimed_lsn(rest).is_some_and(|lsn| lsn >= expected);
                        let new_end = if !header.recycled {
                            garbage_end
                        } else if partial {
                            frames_end.max(at + frame::HEADER_LEN as u64)
                        } else {
                            frames_end
                        };
                        if new_end > at {
                            summary.torn_tail = Some(TornTail {
                                segment: id,
                                offset: at,
                                bytes_discarded: new_end - at,
                                records_discarded,
                            });
                        }
                    }
                }
            }
            _ => {}
        }
        break;
    }
    ranges.push((range_start, at));
    summary.valid_end = at;
    if summary.records > 0 {
        summary.time_range_ms = Some((min_time, max_time));
    }
    Ok(Scanned { summary, header: Some(header), map: Some(map), ranges, max_time_ms: max_time })
}

/// Scans every segment of `dir`; returns the scans and the report.
fn scan_all(
    dir: &Path,
    mode: RecoveryMode,
) -> Result<(Vec<Scanned>, RecoveryReport, u64), WalError> {
    let started = Instant::now();
    let files = list(dir)?;
    let next_id = files.last().map_or(1, |(id, _)| u64::from(id.0) + 1);
    let mut scanned = Vec::with_capacity(files.len());
    let mut expected: Option<u64> = None;
    let maps = files
        .iter()
        .map(|(_, path)| SegmentMap::open(path).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    for (index, ((id, path), map)) in files.iter().zip(&maps).enumerate() {
        map.advise_sequential();
        let next = Next::of(&files, &maps, index);
        let scan = scan_segment(*id, path, Arc::clone(map), next, mode, expected)?;
        expected = match (&scan.header, scan.summary.last_lsn) {
            (None, _) => None,
            (Some(_), Some(last)) => Some(last.0 + 1),
            (Some(header), None) => expected.or(Some(header.first_lsn)).map(|_| header.first_lsn),
        };
        scanned.push(scan);
    }
    let unsynced_cut = unsynced_after(dir)?.map(|durable| cut_unsynced(&mut scanned, durable));
    let mut report = RecoveryReport { unsynced_cut, ..RecoveryReport::default() };
    for scan in &scanned {
        let summary = &scan.summary;
        if summary.dropped {
            // Opening removes it: its records (cut after a failed log's durable LSN) count
            // nowhere, nor fix where LSNs continue.
            report.segments_skipped.push(summary.id);
            continue;
        }
        if summary.skipped {
            report.segments_skipped.push(summary.id);
        } else {
            report.segments += 1;
        }
        report.records += summary.records;
        report.bytes += summary.record_bytes;
        if let Some(first) = summary.first_lsn {
            if report.first_lsn == Lsn::ZERO {
                report.first_lsn = first;
            }
        }
        if let Some(last) = summary.last_lsn {
            report.last_lsn = last;
        }
        if let Some(tail) = &summary.torn_tail {
            report.torn_tail = Some(tail.clone());
        }
        report.corruption_skipped.extend(summary.corruption.iter().cloned());
    }
    // An empty last segment still fixes where LSNs continue.
    if report.last_lsn == Lsn::ZERO {
        if let Some(first) = scanned
            .iter()
            .rev()
            .filter(|scan| !scan.summary.dropped)
            .find_map(|scan| scan.header.map(|header| header.first_lsn))
        {
            report.last_lsn = Lsn(first.saturating_sub(1));
        }
    }
    // With no segment left (the ones holding the records up to a failed log's durable LSN
    // cleaned before the failure, every later one dropped now), that LSN fixes where LSNs
    // continue: else they would start again at 1, and LSNs a caller kept from before (to clean
    // below, say) would name the new records. The same when a segment after the last one kept
    // was skipped as damaged (tolerant mode): its records may reach the marker's LSN, and the
    // new records must not take their LSNs. Otherwise the last kept segment fixes it itself,
    // also where its records end below the marker's LSN (lost pages of `Durability::None`):
    // continuing past them would leave a gap that the next open refuses.
    if let Some(cut) = &report.unsynced_cut {
        if !lsns_fixed_by_a_kept_segment(&scanned) {
            report.last_lsn = report.last_lsn.max(cut.durable_lsn);
        }
    }
    report.elapsed = started.elapsed();
    Ok((scanned, report, next_id))
}

/// Whether the last segment kept (with a header, not dropped) fixes where LSNs continue: there
/// is one, and no segment after it was skipped as damaged (whose LSNs are unknown).
fn lsns_fixed_by_a_kept_segment(scanned: &[Scanned]) -> bool {
    let is_kept = |scan: &Scanned| !scan.summary.dropped && scan.header.is_some();
    scanned
        .iter()
        .rposition(is_kept)
        .is_some_and(|last_kept| !scanned[last_kept + 1..].iter().any(|scan| scan.summary.skipped))
}

/// The last durable LSN a failed log's marker names, if it left one. The log writes its marker
/// whole (module `wal`, "Durability order"), so one that does not hold an LSN was damaged, or
/// lost by the failing disk: [`WalError::BadUnsyncedMarker`]. Read no further than
/// [`super::UNSYNCED_MARKER_MAX_BYTES`].
fn unsynced_after(dir: &Path) -> Result<Option<u64>, WalError> {
    use std::io::Read;
    let path = dir.join(super::UNSYNCED_MARKER);
    let read_failed =
        |error: std::io::Error| WalError::from_io("read the failed-log marker", &path, 0, &error);
    let file = match std::fs::File::open(&path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(read_failed(error)),
    };
    let len = file.metadata().map_err(read_failed)?.len();
    let mut bytes = Vec::with_capacity(super::UNSYNCED_MARKER_MAX_BYTES);
    file.take(super::UNSYNCED_MARKER_MAX_BYTES as u64)
        .read_to_end(&mut bytes)
        .map_err(read_failed)?;
    let durable = (len <= super::UNSYNCED_MARKER_MAX_BYTES as u64)
        .then(|| std::str::from_utf8(&bytes).ok()?.trim().parse::<u64>().ok())
        .flatten();
    match durable {
        Some(durable) => Ok(Some(durable)),
        None => Err(WalError::BadUnsyncedMarker {
            path,
            len,
            preview: String::from_utf8_lossy(&bytes).into_owned(),
        }),
    }
}

/// Deletes a failed log's marker once its cut is durable (the cut segment synced, the
/// dropped ones' removal with the directory), and makes the deletion durable. Also deletes a
/// temporary marker a failing process left unrenamed (it never was the marker).
fn remove_unsynced_marker(dir: &Path, storage: &dyn Storage) -> Result<(), WalError> {
    let temp = dir.join(super::UNSYNCED_MARKER_TEMP);
    match storage.remove(&temp) {
        Ok(()) => tracing::warn!(?temp, "removed a failed-log marker that was never completed"),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            return Err(WalError::from_io(
                "remove the temporary failed-log marker",
                &temp,
                0,
                &error,
            ))
        }
    }
    let path = dir.join(super::UNSYNCED_MARKER);
    match storage.remove(&path) {
        Ok(()) => {
            tracing::info!(?path, "removed the failed log's marker after cutting its records");
            storage
                .sync_dir(dir)
                .map_err(|error| WalError::from_io("sync directory", dir, 0, &error))
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(WalError::from_io("remove the failed-log marker", &path, 0, &error)),
    }
}

/// Cuts every record after `durable` (a failed log's last durable LSN): segments that start
/// after it are dropped, and the one holding `durable + 1` ends before it (a torn tail there,
/// cut like one on opening). Returns what was cut (possibly nothing: the failure may have
/// come before any record after `durable` was written).
fn cut_unsynced(scanned: &mut [Scanned], durable: u64) -> UnsyncedCut {
    let (mut records_discarded, mut segments_removed) = (0, 0);
    for scan in scanned.iter_mut() {
        let Some(header) = &scan.header else {
            continue;
        };
        if scan.summary.dropped || scan.summary.skipped {
            continue;
        }
        if header.first_lsn > durable {
            // All its records are after `durable`; kept empty, it would leave an LSN gap.
            records_discarded += scan.summary.records;
            segments_removed += 1;
            scan.summary.dropped = true;
            continue;
        }
        if scan.summary.last_lsn.is_some_and(|last| last.0 > durable) {
            records_discarded += cut_segment_after(scan, durable);
        }
    }
    UnsyncedCut { durable_lsn: Lsn(durable), records_discarded, segments_removed }
}

/// Ends `scan`'s segment before its first record after `durable` (walking its valid ranges);
/// returns how many records that cut.
fn cut_segment_after(scan: &mut Scanned, durable: u64) -> u64 {
    let map = scan.map.as_ref().expect("scanned segments keep their map");
    let bytes = map.bytes();
    let (mut records, mut record_bytes) = (0u64, 0u64);
    let (mut min_time, mut max_time) = (i64::MAX, i64::MIN);
    let (mut first, mut last) = (None, None);
    let mut cut = None;
    'ranges: for &(start, end) in &scan.ranges {
        let mut at = start;
        while at < end {
            let Ok((header, _)) = frame::parse(&bytes[at as usize..end as usize]) else {
                break;
            };
            if header.lsn > durable {
                cut = Some(at);
                break 'ranges;
            }
            records += 1;
            record_bytes += header.frame_len();
            min_time = min_time.min(header.time_ms);
            max_time = max_time.max(header.time_ms);
            first.get_or_insert(Lsn(header.lsn));
            last = Some(Lsn(header.lsn));
            at += header.frame_len();
        }
    }
    let Some(cut) = cut else {
        return 0;
    };
    let summary = &mut scan.summary;
    let discarded = summary.records - records;
    let old_end = summary
        .torn_tail
        .as_ref()
        .map_or(summary.valid_end, |tail| tail.offset + tail.bytes_discarded);
    summary.torn_tail = Some(TornTail {
        segment: summary.id,
        offset: cut,
        bytes_discarded: old_end.saturating_sub(cut),
        records_discarded: discarded,
    });
    summary.valid_end = cut;
    summary.records = records;
    summary.record_bytes = record_bytes;
    summary.first_lsn = first;
    summary.last_lsn = last;
    summary.time_range_ms = (records > 0).then_some((min_time, max_time));
    scan.max_time_ms = max_time;
    scan.ranges.retain(|&(start, _)| start < cut);
    if let Some(range) = scan.ranges.last_mut() {
        range.1 = range.1.min(cut);
    }
    discarded
}

/// Scans the log in `dir` without changing anything (for tools and `verify`).
///
/// # Errors
/// In strict mode, the first [`WalError::Corruption`]; always [`WalError::Io`] and
/// [`WalError::UnsupportedVersion`].
pub fn scan_dir(dir: impl AsRef<Path>, mode: RecoveryMode) -> Result<DirScan, WalError> {
    let (scanned, report, _) = scan_all(dir.as_ref(), mode)?;
    Ok(DirScan { segments: scanned.into_iter().map(|scan| scan.summary).collect(), report })
}

/// Cuts the segment file at `path` (segment `id`) at `offset`, durably. Returns whether it
/// replaced the file (the directory then needs a sync).
///
/// A read-only tool may map the file (module `reader`), and shrinking a file under a mapping
/// makes the mapper's reads of the vanished pages fault (SIGBUS). Every mapping holds the
/// file's shared lock, so the file is cut in place only under its exclusive lock, taken
/// without waiting: a tool opening it meanwhile waits for the lock, then maps the cut file.
/// While someone maps it, its first `offset` bytes are copied to a new file (named as a
/// spare: a crash before the rename leaves a file the next writer's open deletes) that
/// replaces it under its name, and the mapper keeps reading the old file, unchanged. That
/// copy needs room for `offset` bytes: on a full disk the open fails ([`WalError::DiskFull`]
/// naming the copy's path), where a cut in place would not have.
fn cut_torn_tail(
    dir: &Path,
    storage: &dyn Storage,
    path: &Path,
    id: SegmentId,
    offset: u64,
) -> Result<bool, WalError> {
    let locked = std::fs::File::open(path)
        .map_err(|error| WalError::from_io("open torn segment", path, 0, &error))?;
    if locked.try_lock().is_ok() {
        let file = storage
            .open_existing(path)
            .map_err(|error| WalError::from_io("open torn segment", path, 0, &error))?;
        file.set_len(offset)
            .map_err(|error| WalError::from_io("cut torn tail", path, 0, &error))?;
        // Cut: a mapping made from now on is safe, and a reader waits for the lock only
        // briefly (module `reader`), so let go before the sync.
        drop(locked);
        file.sync_data().map_err(|error| WalError::from_io("fdatasync", path, 0, &error))?;
        return Ok(false);
    }
    let copy = dir.join(segment::spare_file_name(id));
    let file = storage
        .create(&copy)
        .map_err(|error| WalError::from_io("create cut segment", &copy, 0, &error))?;
    let mut chunk = vec![0u8; CUT_COPY_CHUNK.min(offset as usize)];
    let mut at = 0u64;
    while at < offset {
        let len = chunk.len().min((offset - at) as usize);
        std::os::unix::fs::FileExt::read_exact_at(&locked, &mut chunk[..len], at)
            .map_err(|error| WalError::from_io("read torn segment", path, at, &error))?;
        write_all_at(&WriteOp {
            file: file.as_ref(),
            path: &copy,
            buf: &chunk[..len],
            offset: at,
        })?;
        at += len as u64;
    }
    file.sync_data().map_err(|error| WalError::from_io("fdatasync", &copy, 0, &error))?;
    storage
        .rename(&copy, path)
        .map_err(|error| WalError::from_io("replace torn segment", path, 0, &error))?;
    tracing::info!(
        ?path,
        "the torn segment is mapped by another process: replaced it with a cut copy"
    );
    Ok(true)
}

/// Bytes [`cut_torn_tail`] copies at a time.
const CUT_COPY_CHUNK: usize = 1 << 20;

/// Recovers the log in `dir`: scans, cuts a torn tail ([`cut_torn_tail`]), drops a torn
/// creation, and builds the segment states. `read_only` changes nothing on disk: the torn
/// tail stays (readers stop before it) and a torn creation is ignored.
pub(crate) fn recover(
    dir: &Path,
    config: &WalConfig,
    storage: &dyn Storage,
    read_only: bool,
) -> Result<Recovered, WalError> {
    let (scanned, mut report, next_segment_id) = scan_all(dir, config.recovery)?;
    let mut segments = Vec::with_capacity(scanned.len());
    let mut changed_dir = false;
    if !read_only {
        // Spares of an earlier process (or a reuse a crash interrupted) are not reused: only
        // this process knows that every stale frame in its spares has an LSN below the next.
        for spare in list_spares(dir)? {
            match storage.remove(&spare) {
                // Gone meanwhile: what this loop wanted.
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(WalError::from_io("remove spare segment", &spare, 0, &error))
                }
                Ok(()) => changed_dir = true,
            }
        }
    }
    for mut scan in scanned {
        let summary = &scan.summary;
        if summary.dropped && read_only {
            continue;
        }
        if summary.dropped {
            // Release the mapping before deleting.
            scan.map = None;
            storage.remove(&summary.path).map_err(|error| {
                WalError::from_io("remove dropped segment", &summary.path, 0, &error)
            })?;
            changed_dir = true;
            tracing::info!(
                segment = summary.id.0,
                records_cut = summary.records,
                "removed a segment: its creation was torn, or it held only records of a failed \
                 log past its last durable LSN"
            );
            continue;
        }
        let Some(header) = scan.header else {
            continue;
        };
        let mut map = scan.map.take().expect("scanned segments keep their map");
        if let Some(tail) = summary.torn_tail.as_ref().filter(|_| !read_only) {
            // Our own mapping (and its shared lock) must be gone before the file is cut.
            drop(map);
            if cut_torn_tail(dir, storage, &summary.path, summary.id, tail.offset)? {
                changed_dir = true;
            }
            tracing::info!(
                segment = tail.segment.0,
                offset = tail.offset,
                bytes = tail.bytes_discarded,
                records = tail.records_discarded,
                "cut the torn tail of the write-ahead log"
            );
            map = Arc::new(SegmentMap::open(&summary.path)?);
        }
        let segment = Segment {
            valid_ranges: (!summary.corruption.is_empty()).then(|| scan.ranges.clone()),
            recovered: true,
            ..Segment::new(dir, header)
        };
        segment.max_time_ms.store(scan.max_time_ms, Ordering::Release);
        segment.last_lsn.store(summary.last_lsn.map_or(0, |lsn| lsn.0), Ordering::Release);
        segment.end_offset.store(summary.valid_end, Ordering::Release);
        segment.sealed.store(true, Ordering::Release);
        let _ = segment.map.set(map);
        segments.push(Arc::new(segment));
    }
    if !read_only {
        // The previous process may have died (kill -9) with records of the last segment still
        // only in the page cache. The next append starts a new segment, and a later segment
        // must prove the earlier ones durable (module `wal`), so sync the last one now.
        if let Some(last) = segments.last() {
            let file = storage
                .open_existing(&last.path)
                .map_err(|error| WalError::from_io("open segment", &last.path, 0, &error))?;
            file.sync_data()
                .map_err(|error| WalError::from_io("fdatasync", &last.path, 0, &error))?;
        }
        if changed_dir || !segments.is_empty() {
            storage
                .sync_dir(dir)
                .map_err(|error| WalError::from_io("sync directory", dir, 0, &error))?;
        }
        remove_unsynced_marker(dir, storage)?;
    }
    report.segments = segments.len();
    Ok(Recovered { segments, report, next_segment_id })
}
