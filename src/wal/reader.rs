//! Reading: read-only memory maps of segment files, record guards, the in-order iterator.
//!
//! Every read checks the frame (bounds, magic, CRC, length) before handing out bytes, and
//! typed access runs rkyv's validation (bytecheck) before the first reference to an archived
//! value exists. A guard keeps its segment's mapping alive, so a record stays readable even if
//! `clean` deletes its file meanwhile (the mapping outlives the directory entry).
//!
//! Hazard (inherent to mmap): another process truncating a segment file under a live mapping
//! makes reads of the vanished pages fault (SIGBUS). coordbus itself only cuts the torn tail
//! of a segment during a writer's recovery, in place only under the file's exclusive lock
//! (which no mapping's shared lock lets it take); while another process maps the file (a
//! read-only tool), recovery replaces it with a cut copy and the mapping keeps the old file.
//!
//! Recycled segments (module `wal`) write a cleaned segment's file again, so no mapping of it
//! may remain, in this process or another (a read-only tool on a live log). Every mapping
//! holds a shared `flock` on its file, taken before the file is mapped and checked to still be
//! the segment's (the name may have moved on to a spare in between); a writer reuses a file
//! only while it holds the exclusive lock, taken without waiting (else it deletes the file as
//! before), and renames it away from the segment's name before letting go.
//!
//! This module is one of the six allowed to use `unsafe` (STYLE.md names three): mapping a
//! file, and re-deriving a reference to an archive that was validated when its guard was built.

#![allow(unsafe_code)]

use std::{
    fs::File,
    marker::PhantomData,
    ops::Deref,
    path::Path,
    sync::{atomic::Ordering, Arc, Weak},
    time::{Duration, Instant},
};

use memmap2::Mmap;

use crate::{
    error::{RecordError, WalError},
    record::{self, frame, Checked},
    wal::{
        lock, segment::Segment, segment::HEADER_LEN, Durability, Lsn, RecordHandle, Shared,
        SyncState,
    },
};

/// How long a read waits for a record appended but not yet written before giving up, past the
/// group-commit delay (`Durability::GroupCommit::max_delay`).
const READ_WAIT_LIMIT: Duration = Duration::from_secs(60);

/// How many times [`SegmentMap::open`] follows a segment's name to a file that replaced the
/// one it opened.
const MAX_REPLACED: u32 = 3;

/// A read-only mapping of a whole segment file.
#[derive(Debug)]
pub struct SegmentMap {
    map: Option<Mmap>,
    /// The mapped file, open for as long as the mapping, holding a shared lock on it: a writer
    /// never reuses a file someone maps (module doc).
    _locked: File,
}

impl SegmentMap {
    /// Maps the file at `path` (its current length), under a shared lock (module doc).
    ///
    /// # Errors
    /// [`WalError::Io`] if the file cannot be opened, locked or mapped, or if `path` no longer
    /// names a file once locked (the segment was cleaned meanwhile: `NotFound`).
    pub fn open(path: &Path) -> Result<Self, WalError> {
        let mut replaced = 0;
        let file = loop {
            let file = File::open(path)
                .map_err(|error| WalError::from_io("open segment", path, 0, &error))?;
            lock_shared(&file, path)?;
            if still_named(&file, path) {
                break file;
            }
            // The name moved on: cleaned (or kept as a spare), or replaced by a writer's
            // recovery with a cut copy (module `recovery`), which is then the segment.
            replaced += 1;
            if replaced > MAX_REPLACED || std::fs::metadata(path).is_err() {
                let gone = std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the segment was cleaned while it was being opened",
                );
                return Err(WalError::from_io("open segment", path, 0, &gone));
            }
        };
        let len = file
            .metadata()
            .map_err(|error| WalError::from_io("stat segment", path, 0, &error))?
            .len();
        if len == 0 {
            return Ok(Self { map: None, _locked: file });
        }
        // SAFETY: the mapping is read-only and private to this process's view of the file.
        // coordbus writes segment files only through `pwrite`/io_uring into ranges no reader
        // has been handed yet (readers wait for the written watermark), truncates a file only
        // during recovery and under its exclusive lock (never while this shared lock is held),
        // and writes a cleaned segment's file again (a
        // spare) only if it renamed the file away from the segment's name while holding the
        // file's exclusive lock. This mapping holds the shared lock from before it checked
        // the name until it is dropped: so either the writer saw the lock and deleted the file
        // instead, or the rename came first and the name check above failed (module doc).
        // External modification of the files is outside the contract.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|error| WalError::from_io("map segment", path, len, &error))?;
        Ok(Self { map: Some(map), _locked: file })
    }

    /// Tells the kernel the mapping will be read front to back (read-ahead; a hint only).
    pub fn advise_sequential(&self) {
        if let Some(map) = &self.map {
            // Advice is a hint; failing to give it changes nothing but speed.
            let _ = map.advise(memmap2::Advice::Sequential);
        }
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.bytes().len()
    }
}

/// Takes a shared lock on a segment file. A writer holds the exclusive one only across one
/// rename (recycling) or one cut of a torn tail (recovery), so this waits briefly; a lock
/// held longer is another program's, and an error.
fn lock_shared(file: &File, path: &Path) -> Result<(), WalError> {
    let deadline = Instant::now() + lock::LOCK_GRACE;
    let mut pause = Duration::from_micros(50);
    loop {
        match file.try_lock_shared() {
            Ok(()) => return Ok(()),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(10));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let held = std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    "another program holds an exclusive lock on the segment file",
                );
                return Err(WalError::from_io("lock segment", path, 0, &held));
            }
            Err(std::fs::TryLockError::Error(error)) => {
                return Err(WalError::from_io("lock segment", path, 0, &error))
            }
        }
    }
}

/// Whether `path` still names `file` (same device and inode).
fn still_named(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(open), Ok(named)) => open.dev() == named.dev() && open.ino() == named.ino(),
        _ => false,
    }
}

/// The regions of `path` between `from` and `len` that may hold data: everything except the
/// holes `lseek(SEEK_DATA/SEEK_HOLE)` reports (holes, including preallocated space never
/// written, read as zeros). Lets recovery skip the zeroed rest of a preallocated segment
/// without faulting it in. Falls back to the whole range if the file system cannot say.
pub(crate) fn data_regions(path: &Path, from: u64, len: u64) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let whole = vec![(from, len)];
    if from >= len {
        return Vec::new();
    }
    let Ok(file) = File::open(path) else {
        return whole;
    };
    let fd = file.as_raw_fd();
    let seek = |offset: u64, whence: i32| -> Option<u64> {
        let offset = libc::off_t::try_from(offset).ok()?;
        // SAFETY: lseek takes no pointers; `fd` belongs to `file`, open for this whole call.
        let result = unsafe { libc::lseek(fd, offset, whence) };
        u64::try_from(result).ok()
    };
    let mut regions = Vec::new();
    let mut at = from;
    while at < len {
        let Some(data) = seek(at, libc::SEEK_DATA) else {
            // ENXIO: no data after `at`; any other error: the file system cannot tell.
            let no_more = std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
            return if no_more { regions } else { whole };
        };
        if data >= len {
            break;
        }
        let hole = seek(data, libc::SEEK_HOLE).unwrap_or(len).min(len);
        if hole <= data {
            return whole;
        }
        regions.push((data, hole));
        at = hole;
    }
    regions
}

/// The payload bytes of one record, borrowed from its segment's mapping.
#[derive(Debug, Clone)]
pub struct RecordBytes {
    map: Arc<SegmentMap>,
    start: usize,
    len: usize,
}

impl Deref for RecordBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map.bytes()[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for RecordBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// A validated, zero-copy archived `T` inside a segment mapping; derefs to `T::Archived`.
pub struct ArchivedRecord<T: rkyv::Archive> {
    bytes: RecordBytes,
    _type: PhantomData<fn() -> T>,
}

impl<T> ArchivedRecord<T>
where
    T: rkyv::Archive,
    T::Archived: Checked,
{
    /// Validates `bytes` as an archived `T`.
    ///
    /// # Errors
    /// [`RecordError::Validate`] if bytecheck rejects the bytes.
    pub fn new(bytes: RecordBytes) -> Result<Self, RecordError> {
        record::access::<T>(&bytes)?;
        Ok(Self { bytes, _type: PhantomData })
    }

    /// The raw payload bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl<T> Deref for ArchivedRecord<T>
where
    T: rkyv::Archive,
    T::Archived: Checked,
{
    type Target = T::Archived;

    fn deref(&self) -> &T::Archived {
        debug_assert!(record::access::<T>(&self.bytes).is_ok());
        // SAFETY: `new` validated exactly these bytes with `rkyv::access` (bytecheck), and the
        // bytes cannot change afterwards: the guard holds the read-only mapping alive, and
        // coordbus never writes a range it has handed to a reader (module doc).
        unsafe { rkyv::access_unchecked::<T::Archived>(&self.bytes) }
    }
}

impl<T> std::fmt::Debug for ArchivedRecord<T>
where
    T: rkyv::Archive,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArchivedRecord")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.bytes.len)
            .finish()
    }
}

/// One record met by [`WalIter`].
#[derive(Debug, Clone)]
pub struct RecordRef {
    /// The record's LSN.
    pub lsn: Lsn,
    /// The record's time in ms.
    pub time_ms: i64,
    /// Where it is (usable with `Wal::read`).
    pub handle: RecordHandle,
    /// The payload.
    pub bytes: RecordBytes,
}

impl RecordRef {
    /// The payload as a validated archived `T`.
    ///
    /// # Errors
    /// [`RecordError::Validate`] if the payload is not a valid `T`.
    pub fn access<T>(&self) -> Result<&T::Archived, RecordError>
    where
        T: rkyv::Archive,
        T::Archived: Checked,
    {
        record::access::<T>(&self.bytes)
    }

    /// Turns this into an owned guard of the archived `T`.
    ///
    /// # Errors
    /// [`RecordError::Validate`] if the payload is not a valid `T`.
    pub fn into_archived<T>(self) -> Result<ArchivedRecord<T>, RecordError>
    where
        T: rkyv::Archive,
        T::Archived: Checked,
    {
        ArchivedRecord::new(self.bytes)
    }
}

/// Checks the frame at `offset` of `segment`, bounded by `limit`; returns header and payload
/// position.
fn frame_at(
    segment: &Segment,
    map: &Arc<SegmentMap>,
    offset: u64,
    limit: u64,
) -> Result<(frame::FrameHeader, usize), WalError> {
    let bytes = map.bytes();
    let limit = (limit as usize).min(bytes.len());
    let start = offset as usize;
    if start > limit {
        return Err(WalError::NotFound {
            segment: segment.header.id.0,
            offset,
            reason: "offset past the end of the segment",
        });
    }
    let (header, _) = frame::parse(&bytes[start..limit]).map_err(|error| WalError::Corruption {
        segment: segment.header.id.0,
        offset,
        reason: format!("no valid record frame here: {error}"),
    })?;
    Ok((header, start + frame::HEADER_LEN))
}

/// `Wal::read_bytes`.
pub(crate) fn read_bytes(shared: &Shared, handle: RecordHandle) -> Result<RecordBytes, WalError> {
    let not_found =
        |reason| WalError::NotFound { segment: handle.segment.0, offset: handle.offset, reason };
    let segment = shared
        .segment(handle.segment)
        .ok_or(not_found("no such segment (cleaned, or never created)"))?;
    if handle.offset < HEADER_LEN || !handle.offset.is_multiple_of(frame::ALIGN as u64) {
        return Err(not_found("offset is not a record boundary"));
    }
    // A handle's fields are public: an offset near `u64::MAX` is not a record boundary.
    let header_end = handle
        .offset
        .checked_add(frame::HEADER_LEN as u64)
        .ok_or(not_found("offset is not a record boundary"))?;
    if segment.end_offset.load(Ordering::Acquire) < header_end {
        wait_written(shared, &segment, header_end, not_found)?;
    }
    let map = segment.map.get().cloned().ok_or(not_found("the segment has no file"))?;
    let limit = segment.end_offset.load(Ordering::Acquire);
    let (header, start) = frame_at(&segment, &map, handle.offset, limit)?;
    if header.len != handle.len {
        return Err(WalError::LengthMismatch {
            segment: handle.segment.0,
            offset: handle.offset,
            expected: handle.len,
            actual: header.len,
        });
    }
    Ok(RecordBytes { map, start, len: header.len as usize })
}

/// Waits until `segment` has bytes written up to `needed`, or proves they never will be.
fn wait_written(
    shared: &Shared,
    segment: &Segment,
    needed: u64,
    not_found: impl Fn(&'static str) -> WalError,
) -> Result<(), WalError> {
    if !within_appended(shared, segment, needed) {
        return Err(not_found("offset past the end of what was appended"));
    }
    // A group waits out its delay before it is written (a reader does not cut it short).
    let group_delay = match shared.config.durability {
        Durability::GroupCommit { max_delay, .. } => max_delay,
        Durability::EveryRecord | Durability::None => Duration::ZERO,
    };
    let deadline = Instant::now() + READ_WAIT_LIMIT + group_delay;
    // Leaders write only for themselves, and pacing holds groups nobody waits for: the sync
    // thread must see a record still staged (which one is not known here: all of them).
    shared.wake_writer_for_waiter(shared.appended_lsn.load(Ordering::Acquire));
    let mut sync = lock(&shared.sync);
    loop {
        // Sealed first, end second: a sealed segment's end is final (the sync thread stores
        // it with its last write, before it seals; recovery before it seals).
        let sealed = segment.sealed.load(Ordering::Acquire);
        if segment.end_offset.load(Ordering::Acquire) >= needed {
            return Ok(());
        }
        if sealed {
            return Err(not_found("offset past the end of its sealed segment"));
        }
        if shared.failed_flag.load(Ordering::Acquire) {
            return Err(shared.failed_error());
        }
        let appended = shared.appended_lsn.load(Ordering::Acquire);
        if shared.written_lsn.load(Ordering::Acquire) >= appended || sync.writer_exited {
            // Everything appended is written and the offset is still beyond the end.
            if segment.end_offset.load(Ordering::Acquire) >= needed {
                return Ok(());
            }
            return Err(not_found("offset past the end of what was written"));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(not_found("the record was not written within 60 s past its group's delay"));
        }
        let timeout = (deadline - now).min(Duration::from_millis(50));
        sync = SyncState::wait_counted(sync, &shared.durable_cv, Some(timeout), |sync| {
            &mut sync.written_waiters
        });
    }
}

/// Whether a frame ending at `needed` in `segment` can have been appended: within the active
/// segment's appended end, or the end appends to an earlier segment of this log stopped at. A
/// handle beyond it was not returned by this log (stale, or of another log), and waiting for
/// it would last as long as appends keep coming. A recovered segment never had appends here:
/// `wait_written` settles it by its final end (it is sealed).
fn within_appended(shared: &Shared, segment: &Segment, needed: u64) -> bool {
    let state = lock(&shared.append);
    match &state.active {
        Some(active) if active.header.id == segment.header.id => needed <= state.offset,
        _ => match segment.appended_end.load(Ordering::Acquire) {
            0 => true,
            appended_end => needed <= appended_end,
        },
    }
}

/// The in-order iterator of [`crate::wal::Wal::iter_from`].
///
/// It walks a snapshot of the log's segments and, at its end, takes the segments the log added
/// since (ids only grow). A segment still being written stops the iteration for now, wherever
/// the iterator is in it (even before its first record, or before any record reaching `from`):
/// the sync thread writes in LSN order and seals a segment once its last record is written,
/// before it writes the next segment's first, so nothing after it is written yet.
#[derive(Debug)]
pub struct WalIter {
    /// Where newer segments come from (nothing, once the log is gone).
    shared: Weak<Shared>,
    segments: Vec<Arc<Segment>>,
    segment_index: usize,
    /// Index into the current segment's ranges.
    range_index: usize,
    /// Next frame offset in the current segment (0: segment not started).
    offset: u64,
    from: u64,
    done: bool,
}

impl WalIter {
    pub(crate) fn new(shared: &Arc<Shared>, from: Lsn) -> Self {
        Self {
            shared: Arc::downgrade(shared),
            segments: shared.segments_snapshot(),
            segment_index: 0,
            range_index: 0,
            offset: 0,
            from: from.0,
            done: false,
        }
    }

    fn next_segment(&mut self) {
        self.segment_index += 1;
        self.range_index = 0;
        self.offset = 0;
    }

    /// At the end of the snapshot: takes the segments the log added after its last one, and
    /// starts at the first of them. Whether there were any.
    fn take_newer_segments(&mut self) -> bool {
        let Some(shared) = self.shared.upgrade() else {
            return false;
        };
        let last_seen = self.segments.last().map(|segment| segment.header.id);
        let newer: Vec<Arc<Segment>> = shared
            .segments_snapshot()
            .into_iter()
            .filter(|segment| last_seen.is_none_or(|last| segment.header.id > last))
            .collect();
        if newer.is_empty() {
            return false;
        }
        self.segments = newer;
        self.segment_index = 0;
        self.range_index = 0;
        self.offset = 0;
        true
    }
}

impl Iterator for WalIter {
    type Item = Result<RecordRef, WalError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let Some(segment) = self.segments.get(self.segment_index).cloned() else {
                if self.take_newer_segments() {
                    continue;
                }
                return None;
            };
            // Sealed first: a sealed segment's last LSN is final (stored before it seals).
            let sealed = segment.sealed.load(Ordering::Acquire);
            let last_lsn = segment.last_lsn.load(Ordering::Acquire);
            let holds_none_wanted = last_lsn == 0 || last_lsn < self.from;
            let map = segment.map.get().cloned();
            if !sealed && (holds_none_wanted || map.is_none()) {
                // Still being written (or its file not made yet): its next records may be
                // wanted, and nothing after it is written yet.
                return None;
            }
            let Some(map) = map.filter(|_| !holds_none_wanted) else {
                self.next_segment();
                continue;
            };
            let (range_start, range_end) = match &segment.valid_ranges {
                Some(ranges) => match ranges.get(self.range_index) {
                    Some(range) => *range,
                    None => {
                        self.next_segment();
                        continue;
                    }
                },
                None => (HEADER_LEN, segment.end_offset.load(Ordering::Acquire)),
            };
            if self.offset < range_start {
                self.offset = range_start;
            }
            if self.offset + frame::HEADER_LEN as u64 > range_end {
                if segment.valid_ranges.is_some() {
                    self.range_index += 1;
                    self.offset = 0;
                } else if !segment.sealed.load(Ordering::Acquire) {
                    // Still being written, so nothing after it is written yet either (the sync
                    // thread writes in LSN order and seals a segment once its last record is
                    // written, before the next segment's first): stop here for now. Moving on
                    // could skip this segment's tail, written between reading its end and
                    // reading the next segment's records.
                    return None;
                } else if segment.end_offset.load(Ordering::Acquire) > range_end {
                    // Sealed since `range_end` was read: its final end is further on.
                    continue;
                } else {
                    self.next_segment();
                }
                continue;
            }
            let offset = self.offset;
            match frame_at(&segment, &map, offset, range_end) {
                Err(error) => {
                    self.done = true;
                    return Some(Err(error));
                }
                Ok((header, start)) => {
                    self.offset = offset + header.frame_len();
                    if header.lsn < self.from {
                        continue;
                    }
                    return Some(Ok(RecordRef {
                        lsn: Lsn(header.lsn),
                        time_ms: header.time_ms,
                        handle: RecordHandle {
                            segment: segment.header.id,
                            offset,
                            len: header.len,
                        },
                        bytes: RecordBytes { map, start, len: header.len as usize },
                    }));
                }
            }
        }
        None
    }
}
