//! The segmented write-ahead log.
//!
//! Every coordinator's durable state lives here. Appends return at once with the record's
//! [`Lsn`] and [`RecordHandle`]; one sync thread writes what was appended in groups and makes
//! each group durable with one `fdatasync`, and callers learn durability through a watermark
//! ([`Wal::durable_lsn`]), a wait ([`Wal::wait_durable`]) or a callback
//! ([`Wal::notify_when_durable`]). Reading gives validated, zero-copy access to rkyv archives
//! straight from a read-only memory map.
//!
//! ## Parts
//! * `segment`: file naming, the segment header, the shared state of one segment.
//! * `writer`: the sync thread (group commit) and its two I/O paths, `writer::uring`
//!   (io_uring: groups pipelined, parallel writes, one `fdatasync` in flight) and
//!   `writer::pwrite` (fallback: one group at a time).
//! * `reader`: memory maps, record guards and the in-order iterator.
//! * `recovery`: the scan run when a log is opened (and by `coordbus-wal verify`).
//! * `storage`: the file layer the sync thread writes through (fault injection in tests).
//! * `lock`: the directory lock that keeps a second writer out.
//!
//! ## Data path
//! An appender serializes its value (rkyv) with no lock held, then takes the append lock for a
//! few tens of nanoseconds: it assigns the LSN and the place (segment, offset), rolls to a new
//! segment if needed, and copies the frame into the staging buffer, computing its CRC in the
//! same pass (hardware CRC32C: a few nanoseconds for a 96-byte frame). The sync thread swaps
//! the staging buffer for an empty one, writes it with one submission (io_uring) or a few
//! `pwrite`s, and syncs; then it publishes the durable LSN and runs the durability callbacks.
//! Appenders never wait for I/O; they wait only when their frame does not fit in the staging
//! buffer (two groups of `max_bytes`, at most [`STAGING_LIMIT_BYTES`]; a larger frame waits
//! for an empty buffer and goes alone), and then wake the sync thread at once: back-pressure,
//! so memory stays bounded and the buffers stay warm when the disk is slower than the
//! appenders. Waiting is first come, first served, by reservation: a waiter queues the size
//! of its frame, the oldest waiter goes as soon as its frame fits (a frame larger than the
//! limit: as soon as the buffer is empty), each later waiter only once its frame fits beside
//! the frames of the waiters ahead of it, and a newcomer only once it fits beside all of
//! them. So a large frame waits for at most the groups in front of it, never for a stream of
//! small appends, while small newcomers still use whatever room the waiters leave (they do
//! not sleep through a group just because someone waits).
//!
//! With [`Durability::EveryRecord`], a thread that waits for its record ([`Wal::wait_durable`])
//! writes and syncs the staged group itself while the sync thread is idle ("leading", module
//! `writer`): that saves the three cross-thread wake-ups of a hand-over to the sync thread,
//! which cost more than the `fdatasync` they wrap on this 2-core class. The sync thread still
//! writes what nobody leads (records nobody waits for, durability callbacks, pipelined load).
//!
//! ## Pipelined group commit (io_uring path)
//! On the io_uring path the sync thread does not wait for a group's sync before taking the
//! next group: up to `GROUPS_IN_FLIGHT_MAX` (8) groups are on the ring at once, so group k+1's
//! writes run while group k's `fdatasync` is in flight (the classic pipelined group commit of
//! database logs: the disk flushes one batch while the next is copied to the page cache).
//! * Writes of a group are submitted as soon as the group is taken (no drain). A group alone
//!   on the ring whose bytes go in one write gets its `fdatasync` linked behind that write
//!   (`IO_LINK`): the kernel worker that runs the write runs the sync next, without a round
//!   trip through the sync thread (measured: one context switch and 0.7 `io_uring_enter`
//!   fewer per `EveryRecord` append). If that write fails or comes up short, the linked
//!   sync counts for nothing and a new one follows the rewrite.
//! * With group commit, a group that is not full (`max_bytes`) is not taken while earlier
//!   groups are still on their way to durability: it could not become durable before the
//!   next sync anyway, so it keeps growing and goes on the ring when they are done (then the
//!   group delay applies as usual). Under load that makes one write and one sync per sync
//!   time instead of one write per `max_delay`; on this 2-core class every sync costs the
//!   kernel a worker wake-up, an interrupt and a journal commit, so fewer, larger groups
//!   leave more CPU to the appenders. Full groups still overlap the sync in flight.
//! * At most one `fdatasync` is on the ring. It is submitted only after the writes of every
//!   group it covers were seen complete, and it covers all groups written so far; groups
//!   whose writes complete while it runs are covered by the next one (so one sync may make
//!   several groups durable; the `syncs` counter counts syncs, `groups` groups).
//! * Completions are reaped in any order but applied in LSN order: a group is reported
//!   written only after every earlier group, and durable only when a sync covering it
//!   completed; so the durable watermark moves only to the last LSN of a group whose sync
//!   completed and whose predecessors are all durable.
//! * The first failed write or sync fails the log at once (nothing later is ever reported
//!   durable, even if a later sync succeeds; no sync is retried). The ring is emptied before
//!   any buffer is reused.
//! * A roll, a segment's first group, the opt-in direct path and files without a descriptor
//!   (fault injection through `write_at`) drain the pipeline and go one group at a time, so
//!   the segment-order rules below hold unchanged.
//! * While groups are in flight the sync thread waits in the ring, not on the condition
//!   variable; appenders wake it there through a non-blocking pipe the ring polls. A group
//!   that is not full is held until the groups in flight finish; the group-commit delay
//!   applies from then on.
//!
//! The `pwrite` path keeps one group at a time: with blocking calls there is nothing to
//! overlap without a second thread.
//!
//! ## Sync pacing
//! Back-to-back syncs cost this machine class about half a core whatever the I/O method (each
//! is a write and a flush request to the virtual disk, with their exits, interrupts and
//! wake-ups), CPU the appenders lose. So when records keep arriving while syncs run and nobody
//! waits for any record that is not durable yet, the next group (not full) is held until four
//! times the last sync's duration after that sync, at most ten times `max_delay`: syncs then
//! keep the device busy about a fifth of the time, and the durable watermark lags by at most
//! that pause. A thread that waits ([`Wal::wait_durable`], a callback, a reader of a staged
//! record) ends the pause at once; a full group or an appender waiting for room is never
//! held; a light load (each group starting after the previous sync) is never paced.
//! [`WalStats::paced_groups`] counts the groups held. Rule and reasons: module
//! `writer::pacing`.
//!
//! Group commit: with [`Durability::GroupCommit`] the sync thread lets a group grow for up to
//! `max_delay` after its first record or until it holds `max_bytes` (longer under sustained
//! load that nobody waits for: "Sync pacing" below); with
//! [`Durability::EveryRecord`] it starts at once (records appended meanwhile still share the
//! sync, and none is reported durable before its sync completed); with [`Durability::None`] it
//! writes to the page cache and never syncs (except when rolling and closing), and an LSN
//! counts as "durable" once written.
//!
//! ## Recycled segments
//! A cleaned segment's file is not always deleted: up to [`WalOptions::spare_segments`] (default
//! 2) are renamed `spare-<id>.wal` and become the files of later segments (PostgreSQL recycles
//! its WAL segments the same way, RocksDB with `recycle_log_file_num`). Writing into blocks a
//! file already wrote is cheaper for the file system than into the unwritten extents of a new
//! preallocated file: no extent conversion to journal with each sync (this machine class:
//! 256 KiB groups synced in 250 instead of 410 us, `tools/scripts/sync-cost.py`), and no
//! `fallocate` per segment (nor its `ENOSPC`).
//! * A file is kept only if it is whole (the configured segment size) and nothing else holds
//!   its segment or its mapping: a reader's record guard or iterator still mapping a cleaned
//!   segment must never see its bytes change, so that file is deleted as before.
//! * Reuse, on the sync thread when a segment starts: the directory is synced (the rename that
//!   made the spare must be durable, or a crash could bring back the old name over a new
//!   header), the new header is written with version 2 and synced, the file is renamed to
//!   the segment's name, and the directory synced. Records are written only after that.
//! * Past its records a recycled file still holds frames of its earlier use, all of LSNs below
//!   the new segment's first LSN (LSNs only grow within a log). Recovery never takes them for
//!   records: a record must have the next expected LSN, and a later record proves an earlier
//!   one durable only with an LSN at or above it. Where a recycled segment's records stop, the
//!   rest is its earlier use, not damage: a clean end for a sealed segment where the next
//!   segment's header starts at the next LSN (or the next file is a torn creation; otherwise
//!   it is damage in a sealed segment, reported in strict mode as the next file's damaged
//!   header when that header does not decode and no frame of this use lies there), and a torn
//!   tail for the last segment only if frames of this use (LSN at or above the expected one,
//!   complete or with just their header) lie there.
//! * Closing a log deletes its spares, and a writer's open deletes those a crash left (and a
//!   spare whose reuse a crash interrupted): only the process that retired a spare knows that
//!   every frame in it has a lower LSN than the next one. So spares take disk space, up to
//!   `spare_segments` segment sizes, only while the log is open or after a crash.
//!
//! ## On-disk format (versions 1 and 2)
//! A log is a directory of segment files named `seg-<10-digit id>.wal` (so names sort in log
//! order; other files are ignored, and `spare-<10-digit id>.wal` files are deleted by a
//! writer's open). Each is preallocated to `segment_size_bytes` when created, or is a spare of
//! that size ("Recycled segments").
//!
//! Segment header (64 bytes, little-endian):
//!
//! | offset | size | field                | meaning                                         |
//! |-------:|-----:|----------------------|-------------------------------------------------|
//! | 0      | 8    | magic                | `b"CBWALSG\0"`                                  |
//! | 8      | 1    | version              | `1`; `2`: a recycled file ("Recycled segments") |
//! | 9      | 1    | flags                | bit 0: the segment has a rolling window         |
//! | 10     | 2    | reserved             | zero                                            |
//! | 12     | 4    | segment id           | u32, equals the number in the file name         |
//! | 16     | 8    | first LSN            | LSN of the first record placed in the segment   |
//! | 24     | 8    | window start ms      | i64 (zero without a window)                     |
//! | 32     | 8    | window stop ms       | i64, inclusive (zero without a window)          |
//! | 40     | 8    | segment size         | u64, bytes the file was preallocated to         |
//! | 48     | 12   | reserved             | zero                                            |
//! | 60     | 4    | header CRC32C        | over bytes 0..60                                |
//!
//! Records follow from offset 64, each framed as documented in [`crate::record::frame`]
//! (32-byte header with length, CRC32C, LSN, time, sync gap; payload 16-byte aligned; padded to
//! 16). LSNs increase by one from record to record, within and across segments. The first
//! all-zero frame header (preallocated space), or the end of the file, ends a segment; in a
//! recycled segment, also the first frame of a lower LSN or bytes that are no frame, unless a
//! frame of this segment's use follows, and, in a sealed one, only where the next segment
//! starts ("Recycled segments").
//!
//! ## Durability order (what recovery relies on)
//! * A new segment file is created (header written and synced, preallocation, directory sync;
//!   or from a spare: directory sync, header written and synced, rename, directory sync)
//!   only after every byte of the previous segment was synced, so a later segment holding any
//!   record proves the earlier ones complete: damage in a sealed (non-last) segment is
//!   corruption. Opening a log syncs its last segment first, since the previous process may
//!   have died with part of it only in the page cache.
//! * A segment's header is durable before any record is written behind it.
//! * Within the last segment, records written after the last completed sync may reach the disk
//!   in any order. Each frame records `sync_gap` (its LSN minus the durable LSN when it was
//!   appended; `u32::MAX` when the gap did not fit, which proves nothing). At a damaged frame
//!   expecting LSN `e`, a later valid frame whose `lsn - sync_gap >= e` proves `e` was durable:
//!   that is corruption. Otherwise the damage is a torn tail: it is cut off (the file is
//!   truncated there) and reported.
//! * After a failed write or sync the log is failed for good (SPEC 0.6, redb's `PreviousIo`),
//!   and its durable LSN never moves again. It also leaves a marker file,
//!   [`UNSYNCED_MARKER`], naming that durable LSN (if it holds the directory's lock: another
//!   writer's directory is not its to mark): opening the log cuts every record after it
//!   (never acknowledged), then deletes the marker once the cut is durable; a read-only open
//!   or [`scan_dir`] cuts in what it reports only. The marker is written before waiters are
//!   woken, on the failing thread, so on a failing disk they wait for its sync too. It is
//!   written whole (a temporary file renamed into place, then synced). A marker that holds no
//!   LSN was damaged, or its own sync failed on the failing disk before a power loss: opening
//!   or scanning the log then fails with [`WalError::BadUnsyncedMarker`] rather than guess
//!   which records to keep. Without the
//!   marker, a process that opens the log later in the same boot could read those records
//!   back from the page cache and sync them without an error, although the kernel may never
//!   have written them: Linux reports a failed writeback to one `fsync` only and may drop the
//!   dirty pages ("fsyncgate"), so the records would vanish at the next reboot under state
//!   built on them.
//!
//! ## Choices where SPEC is silent
//! * After opening, the first append starts a new segment (like Spark's new writer), so the
//!   recovered tail is sealed as it was found (after cutting a torn tail).
//! * `clean` deletes the oldest segments only, up to the first one it keeps (Spark deletes
//!   every file older than the threshold; here a segment left behind a deleted one would be an
//!   LSN gap, which recovery reads as corruption). It never deletes the newest segment (the
//!   active one, or the recovered last one before the first append: the LSNs and segment ids
//!   of a reopened log continue from it), nor a segment whose bytes are not all written yet.
//!   The unlinks of one clean are made durable together (one directory sync, or none without
//!   `wait`): a file system that reordered them in a crash could leave such a gap; ext4, XFS
//!   and btrfs commit them in order. With `wait = true` it unlinks the files (or keeps them as
//!   spares) itself and syncs the directory, so the deletion is durable on return; without,
//!   the sync thread does (SPEC E.4's asynchronous deletion: dropping a segment's cached pages
//!   costs milliseconds that a coordinator's thread should not pay). A log closed before that
//!   deletes them at close.
//! * Close flushes and syncs everything appended before it (the issue's rule), then rejects
//!   appends with [`WalError::Closed`].
//! * Two `Wal` objects never write the same directory at once: a writer holds an exclusive
//!   `flock` on the directory from `open` (or, for a directory that did not exist yet, from its
//!   creation by the first write) until its sync thread exits at close/drop; a second open
//!   fails with [`WalError::Locked`] naming the directory. Read-only opens take no lock, and
//!   [`is_locked`] tells tools whether a live writer holds it. Details in `lock`.

pub(crate) mod lock;
pub(crate) mod reader;
pub(crate) mod recovery;
pub mod segment;
pub mod storage;
pub(crate) mod writer;

pub use self::writer::uring::DIRECT_GROUP_BYTES as URING_DIRECT_GROUP_BYTES;

use std::{
    collections::{BTreeMap, VecDeque},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crossbeam_utils::CachePadded;

pub use self::lock::is_locked;
use self::segment::{Segment, SegmentHeader, Window, HEADER_LEN as SEGMENT_HEADER_LEN};
pub use self::{
    reader::{ArchivedRecord, RecordBytes, RecordRef, WalIter},
    recovery::{
        scan_dir, CorruptionNote, DirScan, RecoveryReport, SegmentSummary, TornTail, UnsyncedCut,
    },
    storage::{FileStorage, RealFile, RingFault, RingOp, Storage, StorageFile},
};
pub use crate::error::WalError;

/// The file a failed log leaves in its directory, holding its last durable LSN in decimal:
/// opening the log cuts every record after that LSN, then deletes the file (module doc,
/// "Durability order").
pub const UNSYNCED_MARKER: &str = "unsynced-after.lsn";

/// Longest valid [`UNSYNCED_MARKER`]: the 20 digits of `u64::MAX` and a newline, with room for
/// surrounding whitespace. Recovery reads no more than this of it.
pub const UNSYNCED_MARKER_MAX_BYTES: usize = 32;

/// Where a failing log writes its [`UNSYNCED_MARKER`] before renaming it into place, so that
/// the marker is either whole or absent. A writer's open deletes one left behind.
pub const UNSYNCED_MARKER_TEMP: &str = "unsynced-after.lsn.tmp";

use crate::{
    clock::{Clock, SystemClock},
    record::{self, frame, Checked, Record},
};

/// Most bytes the staging buffer may hold before appenders wait for the sync thread (a single
/// frame larger than the limit is staged alone). The limit in force is twice the group size
/// (`max_bytes`) clamped to 1 MiB ..= this, or 8 MiB without group commit.
pub const STAGING_LIMIT_BYTES: usize = 64 << 20;

/// How long the sync thread leaves a new `EveryRecord` group to its appender while waiters
/// lead (`Shared::wait_for_work`). An appender goes from its append to leading in a few
/// microseconds unless it is preempted; a group nobody leads waits this much longer.
const LEADER_GRACE: Duration = Duration::from_micros(50);
/// How often the sync thread looks for groups nobody led while `EveryRecord` waiters lead and
/// appends do not wake it (`Shared::wait_for_work`): the longest a record appended without
/// anyone waiting for it can wait to be written then.
const LEADER_POLL: Duration = Duration::from_millis(1);

/// What an append waits for in [`Wal::wait_for_room`]: room for a frame, until a deadline.
#[derive(Debug, Clone, Copy)]
struct Room {
    frame_len: usize,
    staging_limit: usize,
    /// The longest wait for room (`None`: as long as it takes). The clock is read only once
    /// the append has to wait.
    timeout: Option<Duration>,
}

/// The staging limit for `durability`.
fn staging_limit(durability: Durability) -> usize {
    match durability {
        Durability::GroupCommit { max_bytes, .. } => {
            max_bytes.saturating_mul(2).clamp(1 << 20, STAGING_LIMIT_BYTES)
        }
        _ => 8 << 20,
    }
}

/// The largest payload a record may carry in segments of `segment_size_bytes`: its frame
/// (header, payload, padding) must fit a segment after the segment's header.
fn max_payload_len(segment_size_bytes: u64) -> usize {
    let frame_room = segment_size_bytes.saturating_sub(SEGMENT_HEADER_LEN);
    let payload_room =
        usize::try_from(frame_room).unwrap_or(usize::MAX).saturating_sub(frame::HEADER_LEN);
    // The padding rounds a payload up to the alignment: the largest that fits is aligned.
    (payload_room & !(frame::ALIGN - 1)).min(frame::MAX_PAYLOAD_LEN as usize)
}

/// Log sequence number: 1 for the first record ever appended, then +1 per record.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct Lsn(pub u64);

impl Lsn {
    /// Before the first record: `iter_from(Lsn::ZERO)` reads everything.
    pub const ZERO: Lsn = Lsn(0);
}

impl std::fmt::Display for Lsn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The number of a segment file (its name is `seg-<id>.wal`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct SegmentId(pub u32);

impl std::fmt::Display for SegmentId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where a record lives: segment, byte offset of its frame, payload length. Serializable
/// (rkyv) so other records can point at it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct RecordHandle {
    /// The segment holding the record.
    pub segment: SegmentId,
    /// Byte offset of the record's frame inside the segment file.
    pub offset: u64,
    /// Payload length in bytes (the frame's header and padding are not counted).
    pub len: u32,
}

impl ArchivedRecordHandle {
    /// The handle as a native value.
    pub fn to_native(&self) -> RecordHandle {
        RecordHandle {
            segment: SegmentId(self.segment.0.to_native()),
            offset: self.offset.to_native(),
            len: self.len.to_native(),
        }
    }
}

/// When appended records become durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Page cache only: never synced except when a segment is sealed or the log closes. An
    /// LSN counts as durable once written to the page cache.
    None,
    /// Concurrent appends share one write and one sync; a group is written when it is
    /// `max_delay` old or holds `max_bytes`. Under sustained load that nobody waits for, a
    /// group may be held up to `10 * max_delay` after the previous sync instead (module doc,
    /// "Sync pacing").
    GroupCommit {
        /// Longest a record waits for its group to fill (unless paced: see above).
        max_delay: Duration,
        /// Group size that starts the write at once.
        max_bytes: usize,
    },
    /// Each record is written and synced as soon as possible and is durable before its LSN
    /// is reported durable. A thread waiting in [`Wal::wait_durable`] writes and syncs its
    /// own record (and whatever was appended with it) when the log is idle, which saves the
    /// hand-over to the sync thread; the sync thread writes the rest: records nobody waits
    /// for (within about a millisecond while waiters lead), durability callbacks, and records
    /// appended while a group is being written.
    EveryRecord,
}

impl Default for Durability {
    fn default() -> Self {
        Self::GroupCommit { max_delay: Duration::from_micros(200), max_bytes: 1 << 20 }
    }
}

/// What opening does with damage that is not a torn tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// Fail with [`WalError::Corruption`] naming segment and offset (the default).
    #[default]
    Strict,
    /// Skip damaged segments and damaged stretches, keep every valid record, and report what
    /// was skipped in the [`RecoveryReport`].
    TolerateCorruption,
}

/// Which I/O path the sync thread uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoPath {
    /// io_uring: parallel writes and a drained `fdatasync` in one submission.
    IoUring,
    /// `pwrite` + `fdatasync`.
    Pwrite,
}

impl IoPath {
    /// `"io_uring"` or `"pwrite"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IoUring => "io_uring",
            Self::Pwrite => "pwrite",
        }
    }
}

/// Which I/O path to ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoMode {
    /// io_uring if the kernel allows it, else `pwrite` (logged once).
    #[default]
    Auto,
    /// io_uring or fail to open.
    IoUring,
    /// Always `pwrite`.
    Pwrite,
}

/// Settings of a [`Wal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalConfig {
    /// Size of each segment file (default 64 MiB; 4 KiB ..= 1 TiB, a multiple of 16).
    pub segment_size_bytes: u64,
    /// When appends become durable (default group commit, 200 us / 1 MiB).
    pub durability: Durability,
    /// What opening does with corruption (default strict).
    pub recovery: RecoveryMode,
    /// Also roll by time with SPEC E.2's window rule (Spark's `rollingIntervalSecs`; default
    /// none: roll by size only).
    pub rolling_interval: Option<Duration>,
    /// The longest dropping a [`Wal`] that was not closed waits for its last writes and sync
    /// (default [`DEFAULT_DROP_CLOSE_TIMEOUT`]), as [`Wal::close_timeout`] does: on a stalled
    /// disk, the drop then returns and warns, and the sync thread finishes in the background.
    /// Until it does, it keeps the directory locked (opening it again fails with
    /// [`WalError::Locked`]), and records appended but not yet durable are lost if the process
    /// exits meanwhile (none was acknowledged durable: acknowledged records were synced). Zero:
    /// the drop does not wait (and warns that the sync thread is still closing).
    pub drop_close_timeout: Duration,
}

/// Default [`WalConfig::drop_close_timeout`].
pub const DEFAULT_DROP_CLOSE_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for WalConfig {
    fn default() -> Self {
        Self {
            segment_size_bytes: 64 << 20,
            durability: Durability::default(),
            recovery: RecoveryMode::default(),
            rolling_interval: None,
            drop_close_timeout: DEFAULT_DROP_CLOSE_TIMEOUT,
        }
    }
}

/// The spare files of a log (module doc, "Recycled segments").
#[derive(Debug, Default)]
pub(crate) struct Spares {
    /// Files of cleaned segments, to become the files of new segments.
    pub(crate) files: Vec<PathBuf>,
    /// The log was closed: its spares were deleted, and no more are kept.
    pub(crate) closed: bool,
}

/// The longest [`Durability::GroupCommit`] `max_delay` accepted. A group is held at most ten
/// times that under pacing; a longer delay is surely a unit mistake, and one near
/// [`Duration::MAX`] would overflow the clock.
pub const MAX_GROUP_COMMIT_DELAY: Duration = Duration::from_secs(60);
/// The default of [`WalOptions::spare_segments`].
pub const DEFAULT_SPARE_SEGMENTS: usize = 2;
/// The largest [`WalOptions::spare_segments`] accepted.
pub const MAX_SPARE_SEGMENTS: usize = 1024;
/// The default of [`WalOptions::sync_thread_nice`].
pub const DEFAULT_SYNC_THREAD_NICE: u8 = 5;
/// The largest [`WalOptions::sync_thread_nice`] accepted (Linux's nice values span 40 steps,
/// -20 to 19).
pub const MAX_SYNC_THREAD_NICE: u8 = 39;
/// [`WalOptions::io_cores`]' ids must be below this: a Linux CPU set names cores `0..1024`.
pub const CORE_ID_LIMIT: usize = rustix::thread::CpuSet::MAX_CPU;
const _: () = assert!(CORE_ID_LIMIT == 1024, "the io_cores error message says 1024");

impl WalConfig {
    /// Checks every setting.
    ///
    /// # Errors
    /// [`WalError::InvalidConfig`] naming the setting.
    pub fn validate(&self) -> Result<(), WalError> {
        let invalid =
            |setting, value: String, reason| WalError::InvalidConfig { setting, value, reason };
        if self.segment_size_bytes < 4096
            || self.segment_size_bytes > 1 << 40
            || !self.segment_size_bytes.is_multiple_of(16)
        {
            return Err(invalid(
                "segment_size_bytes",
                self.segment_size_bytes.to_string(),
                "must be a multiple of 16 between 4 KiB and 1 TiB",
            ));
        }
        if let Durability::GroupCommit { max_delay, max_bytes } = self.durability {
            if max_bytes == 0 {
                return Err(invalid("durability.max_bytes", "0".into(), "must be at least 1"));
            }
            if max_delay > MAX_GROUP_COMMIT_DELAY {
                return Err(invalid(
                    "durability.max_delay",
                    format!("{max_delay:?}"),
                    "must be at most 60 s",
                ));
            }
        }
        if let Some(interval) = self.rolling_interval {
            if interval.as_millis() == 0 || interval.as_millis() > i64::MAX as u128 / 2 {
                return Err(invalid(
                    "rolling_interval",
                    format!("{interval:?}"),
                    "must be at least 1 ms and below 2^62 ms",
                ));
            }
        }
        Ok(())
    }
}

/// Options beyond the configuration: the I/O path and the file layer.
#[derive(Clone)]
pub struct WalOptions {
    /// Which I/O path to use (default [`IoMode::Auto`]).
    pub io: IoMode,
    /// The file layer the sync thread writes through (default [`FileStorage`]).
    pub storage: Arc<dyn Storage>,
    /// On the io_uring path, a group that is one write of at most this many bytes is written
    /// with `pwrite` and synced with `fdatasync` directly, skipping the ring's hop to a kernel
    /// worker (default 0: every group goes through the ring; [`URING_DIRECT_GROUP_BYTES`] is the
    /// opt-in value measured to lower `EveryRecord` latency here).
    pub uring_direct_max_bytes: usize,
    /// Open without changing anything on disk (default false): a torn tail is hidden, not
    /// cut, no sync thread runs, no io_uring is set up (`io` is ignored), and appends fail
    /// with [`WalError::ReadOnly`]. For tools.
    pub read_only: bool,
    /// The clock of [`Wal::append_now`] and [`Wal::append_bytes_now`] (default
    /// [`SystemClock`]).
    pub clock: Arc<dyn Clock>,
    /// How many files of cleaned segments the log keeps as spares and reuses for new segments
    /// instead of creating files (default 2; 0 deletes them; at most 1024). Writing into a
    /// spare's written blocks costs the file system less than filling a new file's
    /// preallocated ones (module doc, "Recycled segments"). Spares take disk space while the log
    /// is open: up to this many segment sizes. Closing the log deletes them.
    pub spare_segments: usize,
    /// How much lower the sync thread's CPU priority is than that of the thread that opened
    /// the log: the sync thread adds this to its nice value (capped at 19) when it starts
    /// (default [`DEFAULT_SYNC_THREAD_NICE`]; 0 leaves it; at most
    /// [`MAX_SYNC_THREAD_NICE`]). The io_uring kernel workers that run its writes and syncs
    /// are started by it and inherit the value. On a machine whose cores are busy, the
    /// threads that append (a coordinator, say) then preempt the log's background I/O rather
    /// than wait behind it; the sync thread still gets a share of the CPU (nice weighs, it does
    /// not starve). A thread that waits for durability in [`Durability::EveryRecord`] may
    /// write and sync on its own thread instead ("leading"), at its own priority. Like
    /// RocksDB's lowered priority of its background threads; measured in PERF.md
    /// (EpochCoordinator, "Twenty-fifth session"). If the system refuses the change, the
    /// thread runs at its inherited priority (logged).
    pub sync_thread_nice: u8,
    /// The cores the sync thread, and the io_uring kernel workers that run its writes and
    /// syncs (`IORING_REGISTER_IOWQ_AFF`), may run on (ids below [`CORE_ID_LIMIT`]; default
    /// empty: the sync thread keeps the cores of the thread that opened the log, and its
    /// workers whatever the kernel gives them, since Linux 6.2 the sync thread's). An engine
    /// that keeps a core for a hot thread (an endpoint pinned with [`crate::Pinning::Cores`])
    /// lists the other cores here, so that the log's copies into the page cache, its syncs and
    /// their wake-ups never take that core. On a 2-core machine, the epoch load generator's
    /// isolated placement (the coordinator pinned to one core; its producers and, with this,
    /// the log's I/O on the other) took a durable epoch run from 0.68x to 0.76x of the
    /// in-memory rate (PERF.md, "Forty-third session"). Not confined: a thread that leads its
    /// own group ([`Durability::EveryRecord`], module doc) writes and syncs through its own
    /// io_uring workers, which the kernel places as that thread (since Linux 6.2: on its cores,
    /// so a leader pinned to the hot core keeps its I/O there). If the system refuses the sync
    /// thread's confinement (no listed core online or allowed), the thread keeps the opening
    /// thread's cores, and so do its workers since Linux 6.2 (logged), as an endpoint whose
    /// pinning is refused does.
    pub io_cores: Vec<usize>,
}

impl std::fmt::Debug for WalOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalOptions")
            .field("io", &self.io)
            .field("storage", &self.storage)
            .field("uring_direct_max_bytes", &self.uring_direct_max_bytes)
            .field("read_only", &self.read_only)
            .field("spare_segments", &self.spare_segments)
            .field("sync_thread_nice", &self.sync_thread_nice)
            .field("io_cores", &self.io_cores)
            .finish_non_exhaustive()
    }
}

impl Default for WalOptions {
    fn default() -> Self {
        Self {
            io: IoMode::Auto,
            storage: Arc::new(FileStorage),
            uring_direct_max_bytes: 0,
            read_only: false,
            clock: Arc::new(SystemClock),
            spare_segments: DEFAULT_SPARE_SEGMENTS,
            sync_thread_nice: DEFAULT_SYNC_THREAD_NICE,
            io_cores: Vec::new(),
        }
    }
}

/// What [`Wal::clean`] did. Every selected segment is no longer tracked, whatever happens to
/// its file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanReport {
    /// Segments deleted from the log (`wait`, or a closed log): their files removed, or kept
    /// as spares.
    pub deleted: Vec<SegmentId>,
    /// Those of `deleted` whose files were kept as spares, to be reused for new segments
    /// ([`WalOptions::spare_segments`]).
    pub kept_as_spares: Vec<SegmentId>,
    /// Segments whose files the sync thread deletes next (without `wait`; SPEC E.4's
    /// asynchronous deletion). A failure there is logged.
    pub queued: Vec<SegmentId>,
    /// Bytes of the deleted or queued files (their preallocated size; queued files the sync
    /// thread keeps as spares free nothing).
    pub bytes_freed: u64,
    /// Segments selected but whose file could not be deleted (logged; SPEC E.4 ignores them).
    pub failed: Vec<(SegmentId, String)>,
}

/// Cheap counters of a [`Wal`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WalStats {
    /// Records appended since opening.
    pub appends: u64,
    /// Framed bytes appended since opening.
    pub bytes: u64,
    /// Groups written and (in the durable modes) synced.
    pub groups: u64,
    /// Of those, groups written on the thread of an `EveryRecord` appender waiting for them
    /// (module `writer`, "Leading") instead of the sync thread.
    pub led_groups: u64,
    /// `fdatasync` calls completed.
    pub syncs: u64,
    /// Median group write+sync time, in microseconds (log2 bucket upper bound; 0 if none).
    pub sync_p50_us: u64,
    /// 99th percentile group write+sync time, in microseconds (log2 bucket upper bound).
    pub sync_p99_us: u64,
    /// The last LSN appended.
    pub appended_lsn: Lsn,
    /// The last LSN durable.
    pub durable_lsn: Lsn,
    /// Segments tracked (not cleaned), including the active one.
    pub segments: usize,
    /// Segments deleted by `clean` since opening.
    pub cleaned_segments: u64,
    /// Segments created in a spare's file instead of a new file (module doc, "Recycled
    /// segments").
    pub recycled_segments: u64,
    /// Spare files held now.
    pub spare_segments: usize,
    /// Times another thread (an appender, a waiter, `clean`) woke the sync thread. Each one
    /// is a system call on the waking thread and a turn of the sync thread; under group
    /// commit a busy log needs about one per group at most.
    pub writer_wakeups: u64,
    /// Groups that sync pacing held back (module doc, "Sync pacing").
    pub paced_groups: u64,
    /// The live I/O path.
    pub io_path: Option<IoPath>,
}

/// A callback run once an LSN is durable (or the log failed).
pub type DurableCallback = Box<dyn FnOnce(Result<(), WalError>) + Send + 'static>;

/// One run of staged bytes destined for one contiguous range of one segment.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) segment: Arc<Segment>,
    pub(crate) file_offset: u64,
    pub(crate) buf_start: usize,
    pub(crate) buf_end: usize,
    pub(crate) last_lsn: u64,
    pub(crate) max_time_ms: i64,
}

/// State guarded by the append lock.
#[derive(Debug)]
pub(crate) struct AppendState {
    /// LSN the next append gets.
    pub(crate) next_lsn: u64,
    /// The segment appends go to (`None` until the first append after opening).
    pub(crate) active: Option<Arc<Segment>>,
    /// Offset in `active` where the next frame goes.
    pub(crate) offset: u64,
    /// Number the next segment gets.
    pub(crate) next_segment_id: u64,
    /// Frames appended and not yet taken by the sync thread.
    pub(crate) buf: Vec<u8>,
    /// Where each run of `buf` goes.
    pub(crate) chunks: Vec<Chunk>,
    /// When the first record of the staged group was appended.
    pub(crate) group_started: Option<Instant>,
    /// How the sync thread waits, which decides when an appender must wake it.
    pub(crate) writer_wait: WriterWait,
    /// Appenders waiting on `space_cv` for room, oldest first (module doc, "Data path").
    pub(crate) room_waiters: VecDeque<RoomWaiter>,
    /// Ticket the next waiter for room gets.
    pub(crate) next_room_ticket: u64,
    /// `close` was called: appends are rejected, the sync thread drains and exits.
    pub(crate) closing: bool,
    pub(crate) appends: u64,
    pub(crate) bytes: u64,
}

/// An appender waiting for staging room, and the room it reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RoomWaiter {
    ticket: u64,
    frame_len: usize,
}

/// How the sync thread waits, which decides when an appender must wake it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriterWait {
    /// Not waiting: no wake-up needed.
    Running,
    /// On `writer_cv`, for a group's first record or a full group.
    Condvar,
    /// In the io_uring ring (woken through `Shared::ring_waker`), for a group's first record
    /// or a full group.
    Ring,
    /// In the io_uring ring, for a full group only (groups in flight end the wait).
    RingUntilFull,
    /// On `writer_cv`, holding a group for sync pacing (module `writer::pacing`): a full group
    /// or a waiter for durability ends the wait.
    Paced,
}

impl WriterWait {
    /// Whether an append that starts a group (`first_of_group`) or fills it (`full`) must wake
    /// the sync thread.
    fn wants_wake(self, first_of_group: bool, full: bool) -> bool {
        match self {
            Self::Running => false,
            Self::Condvar | Self::Ring => first_of_group || full,
            Self::RingUntilFull | Self::Paced => full,
        }
    }

    fn in_ring(self) -> bool {
        matches!(self, Self::Ring | Self::RingUntilFull)
    }
}

impl AppendState {
    /// Whether the staged group may keep growing under group commit: it is not full, the log
    /// is not closing, and no appender waits for room (then the group is due at once).
    pub(crate) fn group_may_grow(&self, max_bytes: usize) -> bool {
        !self.closing && self.buf.len() < max_bytes && self.room_waiters.is_empty()
    }

    /// Whether a frame of `frame_len` bytes may be staged now under `limit`, by the waiter
    /// holding `ticket` or by a newcomer (`None`): it must fit beside the staged bytes and the
    /// frames of the waiters ahead of it (all of them, for a newcomer). With nothing staged
    /// and nobody ahead, any frame goes (one larger than the limit goes alone).
    fn has_room(&self, frame_len: usize, limit: usize, ticket: Option<u64>) -> bool {
        let reserved_ahead: usize = self
            .room_waiters
            .iter()
            .take_while(|waiter| Some(waiter.ticket) != ticket)
            .map(|waiter| waiter.frame_len)
            .sum();
        (self.buf.is_empty() && reserved_ahead == 0)
            || self.buf.len() + reserved_ahead + frame_len <= limit
    }

    /// Queues a waiter for room for a frame of `frame_len` bytes; returns its ticket.
    fn queue_room_waiter(&mut self, frame_len: usize) -> u64 {
        let ticket = self.next_room_ticket;
        self.next_room_ticket += 1;
        self.room_waiters.push_back(RoomWaiter { ticket, frame_len });
        ticket
    }

    /// Removes the waiter holding `ticket` (it got its room, or gives up).
    fn remove_room_waiter(&mut self, ticket: Option<u64>) {
        if let Some(ticket) = ticket {
            self.room_waiters.retain(|waiter| waiter.ticket != ticket);
        }
    }

    /// Records how the sync thread waits.
    pub(crate) fn set_writer_wait(&mut self, wait: WriterWait) {
        self.writer_wait = wait;
    }
}

/// State guarded by the sync lock (paired with `durable_cv`).
pub(crate) struct SyncState {
    pub(crate) callbacks: BTreeMap<u64, Vec<DurableCallback>>,
    /// The sync thread takes no more work (set with the callbacks it will not run taken out).
    pub(crate) writer_exited: bool,
    /// The sync thread has also run those callbacks: it is about to end.
    pub(crate) writer_done: bool,
    /// Threads waiting on `durable_cv` for durability (`wait_durable`).
    pub(crate) durable_waiters: usize,
    /// Threads waiting on `durable_cv` for written bytes (readers of a record being written).
    pub(crate) written_waiters: usize,
}

impl SyncState {
    /// Waits on `durable_cv` (at most `timeout`) counted in `waiters(self)`, so that the sync
    /// thread signals only when someone waits for what it published.
    pub(crate) fn wait_counted<'a>(
        mut guard: MutexGuard<'a, SyncState>,
        condvar: &Condvar,
        timeout: Option<Duration>,
        waiters: fn(&mut SyncState) -> &mut usize,
    ) -> MutexGuard<'a, SyncState> {
        *waiters(&mut guard) += 1;
        let mut guard = match timeout {
            None => condvar.wait(guard).unwrap_or_else(std::sync::PoisonError::into_inner),
            Some(timeout) => {
                condvar
                    .wait_timeout(guard, timeout)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0
            }
        };
        *waiters(&mut guard) -= 1;
        guard
    }
}

/// Segment files waiting for the sync thread to delete them.
#[derive(Debug, Default)]
pub(crate) struct Doomed {
    pub(crate) segments: Vec<Arc<Segment>>,
    /// The sync thread will not look again: `clean` deletes by itself.
    pub(crate) writer_exited: bool,
}

/// The ids of a log's sync thread: Rust's, and the kernel's (its `/proc/self/task` entry).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncThreadIds {
    pub(crate) thread: std::thread::ThreadId,
    /// Read by a test only (the sync thread's nice value).
    #[cfg_attr(any(not(test), loom), allow(dead_code))]
    pub(crate) kernel_tid: i32,
}

/// Everything the appenders, readers and the sync thread share.
pub(crate) struct Shared {
    pub(crate) dir: PathBuf,
    pub(crate) config: WalConfig,
    pub(crate) storage: Arc<dyn Storage>,
    pub(crate) append: Mutex<AppendState>,
    /// Wakes the sync thread (with `append`).
    pub(crate) writer_cv: Condvar,
    /// Wakes the sync thread while it waits in the io_uring ring (pipelined path only): one
    /// byte into a non-blocking pipe the ring polls.
    pub(crate) ring_waker: Option<std::io::PipeWriter>,
    /// The sync thread, once it runs (`Wal::close_timeout` called from it must not wait for
    /// itself).
    pub(crate) sync_thread: OnceLock<SyncThreadIds>,
    /// Whether the sync thread confined its io_uring workers to `io_cores` (read by a test).
    #[cfg(test)]
    pub(crate) workers_confined: OnceLock<bool>,
    /// Wakes appenders waiting for staging space (with `append`).
    pub(crate) space_cv: Condvar,
    /// Tracked segments in id order (the active one last).
    pub(crate) segments: RwLock<Vec<Arc<Segment>>>,
    /// Last LSN appended (written under the append lock).
    pub(crate) appended_lsn: CachePadded<AtomicU64>,
    /// Last LSN written to the page cache (sync thread).
    pub(crate) written_lsn: CachePadded<AtomicU64>,
    /// Last LSN whose sync completed (sync thread); feeds the frames' `sync_gap`.
    pub(crate) synced_lsn: CachePadded<AtomicU64>,
    /// Last LSN reported durable (stored under `sync`).
    pub(crate) durable_lsn: CachePadded<AtomicU64>,
    pub(crate) sync: Mutex<SyncState>,
    /// Segments `clean` untracked without waiting, for the sync thread to delete (SPEC E.4:
    /// deletion runs on the log's thread).
    pub(crate) doomed: Mutex<Doomed>,
    /// Held while `clean` selects segments and while anyone deletes cleaned segments: the
    /// deletions then run one at a time, in the order the segments were selected (LSN order).
    /// Without it, an immediate `clean` could delete its (later) segments while older ones
    /// were still queued for the sync thread, and a failed or interrupted deletion of those
    /// would leave a gap in the LSNs on disk.
    pub(crate) deleting: Mutex<()>,
    /// Files of cleaned segments kept for reuse, at most `spare_limit`.
    pub(crate) spares: Mutex<Spares>,
    /// [`WalOptions::spare_segments`].
    pub(crate) spare_limit: usize,
    /// Segments created in a spare's file.
    pub(crate) recycled_segments: AtomicU64,
    /// Signalled after every group (durable LSN and written bytes moved) and on failure.
    pub(crate) durable_cv: Condvar,
    /// A leader made durability callbacks due and left them for the sync thread.
    pub(crate) callbacks_deferred: AtomicBool,
    /// `EveryRecord` waiters lead: appends leave their groups to them instead of waking the
    /// sync thread. Set by each lead, cleared by the sync thread (both under the append lock)
    /// after a [`LEADER_POLL`] without a lead or a group nobody led (`Shared::wait_for_work`).
    pub(crate) leaders_active: AtomicBool,
    /// A lead happened since the sync thread's last poll (set by leaders, cleared by polls).
    pub(crate) led_since_poll: AtomicBool,
    /// The first segment a clean could not delete: no later one is deleted (see
    /// `delete_segments`).
    pub(crate) undeletable: Mutex<Option<SegmentId>>,
    /// This log holds its directory's lock (the writer's `DirLock`): only then may a failure
    /// leave its [`UNSYNCED_MARKER`] there (another writer's directory is not its to mark).
    pub(crate) holds_dir_lock: AtomicBool,
    pub(crate) failed: OnceLock<WalError>,
    pub(crate) failed_flag: AtomicBool,
    pub(crate) groups: AtomicU64,
    /// Groups a leader wrote (counted in `groups` too).
    pub(crate) led_groups: AtomicU64,
    pub(crate) syncs: AtomicU64,
    pub(crate) sync_latency_us_log2: [AtomicU64; 32],
    pub(crate) cleaned_segments: AtomicU64,
    /// `WalStats::writer_wakeups`.
    pub(crate) writer_wakeups: AtomicU64,
    /// `WalStats::paced_groups`.
    pub(crate) paced_groups: AtomicU64,
    /// The sync thread announces a pause for pacing (`writer::pacing::hold_unless_awaited`):
    /// only then must a waiter take the append lock to wake it.
    pub(crate) pacing: crate::sync::AtomicBool,
    /// The highest LSN a thread waited for (a durability waiter, a callback, a reader of a
    /// staged record): while it is above the durable LSN, groups are not paced
    /// (`writer::pacing`).
    pub(crate) awaited_lsn: CachePadded<crate::sync::AtomicU64>,
    /// Opened read-only: no sync thread, appends and clean refused.
    pub(crate) read_only: bool,
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks is a broken invariant elsewhere; the state itself is
    // plain data, so continuing with it is sound.
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    pub(crate) fn failure(&self) -> Option<WalError> {
        if self.failed_flag.load(Ordering::Acquire) {
            self.failed.get().cloned()
        } else {
            None
        }
    }

    /// Fails the log for good and fails every waiter.
    pub(crate) fn fail(&self, error: WalError, run_callbacks: bool) {
        let error = match error {
            WalError::Failed { cause } => *cause,
            other => other,
        };
        // The first failure is the log's; later ones (a close that finds the sync thread
        // panicked, which failed the log already) are only noted.
        let first = match self.failed.set(error) {
            Ok(()) => {
                tracing::error!(error = %self.failed.get().expect("just set"),
                    dir = ?self.dir, "write-ahead log failed; no more writes");
                true
            }
            Err(later) => {
                tracing::debug!(error = %later, dir = ?self.dir, "write-ahead log failed again");
                false
            }
        };
        let (callbacks, durable) = {
            let mut sync = lock(&self.sync);
            // Under the sync lock, where `publish` moves the durable LSN: from here on it
            // stays at `durable`, the LSN the marker names.
            self.failed_flag.store(true, Ordering::Release);
            let durable = self.durable_lsn.load(Ordering::Acquire);
            let callbacks = if run_callbacks {
                std::mem::take(&mut sync.callbacks)
            } else {
                if !sync.callbacks.is_empty() {
                    self.callbacks_deferred.store(true, Ordering::Release);
                }
                BTreeMap::new()
            };
            (callbacks, durable)
        };
        // Not while this thread unwinds (a leader's panic guard): a storage layer panicking
        // again would abort the process. A panic is not a failed write, so the page cache
        // holds nothing the kernel gave up on.
        if first
            && !self.read_only
            && self.holds_dir_lock.load(Ordering::Acquire)
            && !std::thread::panicking()
        {
            self.leave_unsynced_marker(durable);
        }
        self.durable_cv.notify_all();
        // An appender waiting for room checks `failed_flag` and then waits on `space_cv`, both
        // under the append lock. Taking that lock once here means the appender has either seen
        // the flag or is already waiting when the notification comes; without it, the
        // notification could fall between its check and its wait and be lost. No caller holds
        // the append lock here (the lock order is writer, then append).
        drop(lock(&self.append));
        self.space_cv.notify_all();
        let failed = self.failed_error();
        for callback in callbacks.into_values().flatten() {
            callback(Err(failed.clone()));
        }
    }

    /// Writes [`UNSYNCED_MARKER`] naming `durable`, the failed log's last durable LSN (module
    /// doc, "Durability order"): into [`UNSYNCED_MARKER_TEMP`] first, renamed over the marker,
    /// then synced with the directory. A process killed at any point leaves the marker whole
    /// (in the page cache, which is what a later open in the same boot reads) or absent, never
    /// half written. Best effort: the disk may be failing. A marker whose sync failed is kept,
    /// since it is read back from the same page cache as the records it guards against (after
    /// a power loss it may then be found empty: opening refuses such a log, module doc).
    ///
    /// Runs inside `fail`, before the waiting threads are woken and the callbacks run, so a
    /// storage layer that panics here is caught: the failure must still reach them.
    fn leave_unsynced_marker(&self, durable: u64) {
        let path = self.dir.join(UNSYNCED_MARKER);
        let temp = self.dir.join(UNSYNCED_MARKER_TEMP);
        let failed = |op, at: &Path, error: std::io::Error| WalError::from_io(op, at, 0, &error);
        let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match self.storage.remove(&temp) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    return Err(failed("remove", &temp, error));
                }
                _ => {}
            }
            let file =
                self.storage.create(&temp).map_err(|error| failed("create", &temp, error))?;
            let text = format!("{durable}\n");
            writer::pwrite::write_all_at(&writer::WriteOp {
                file: file.as_ref(),
                path: &temp,
                buf: text.as_bytes(),
                offset: 0,
            })?;
            // Renamed before its sync: a sync on a failing disk may hang until the process is
            // killed, and the marker must already be in place then (whole, in the page cache).
            self.storage.rename(&temp, &path).map_err(|error| failed("rename", &temp, error))?;
            let synced = file.sync_data().map_err(|error| failed("fdatasync", &path, error));
            let dir_synced = self
                .storage
                .sync_dir(&self.dir)
                .map_err(|error| failed("sync directory", &self.dir, error));
            synced.and(dir_synced)
        }))
        .unwrap_or_else(|_| {
            let panicked = std::io::Error::other("the storage layer panicked");
            Err(failed("write the failed-log marker", &path, panicked))
        });
        match written {
            Ok(()) => tracing::warn!(
                ?path,
                durable,
                "left a marker: opening the log will cut the records after the durable LSN"
            ),
            Err(error) => tracing::error!(?path, durable, %error,
                "could not make the failed log's marker durable; records after the durable \
                 LSN may be read back from the page cache by a later open"),
        }
    }

    /// Wakes the sync thread where it waits: in the io_uring ring (`in_ring`, through the wake
    /// pipe) or on `writer_cv`. Counted in [`WalStats::writer_wakeups`].
    pub(crate) fn wake_writer(&self, in_ring: bool) {
        self.writer_wakeups.fetch_add(1, Ordering::Relaxed);
        if in_ring {
            self.wake_ring();
        } else {
            self.writer_cv.notify_one();
        }
    }

    /// Wakes the sync thread out of a wait in the io_uring ring. The pipe is non-blocking: if
    /// it is full, a wake is already pending.
    pub(crate) fn wake_ring(&self) {
        if let Some(waker) = &self.ring_waker {
            use std::io::Write;
            let _ = (&*waker).write(&[1]);
        }
    }

    pub(crate) fn failed_error(&self) -> WalError {
        WalError::Failed { cause: Box::new(self.failed.get().cloned().unwrap_or(WalError::Closed)) }
    }

    /// Whether appends leave their group to a leader instead of waking the sync thread
    /// (`leaders_active`, set only by `EveryRecord` leads; read by appenders under the append
    /// lock that it is set and cleared under).
    pub(crate) fn leaders_write(&self) -> bool {
        self.leaders_active.load(Ordering::Relaxed)
    }

    /// For a thread about to wait until `awaited_lsn` is durable or written and that cannot
    /// lead (a waiter with a timeout, a durability callback, a reader): marks the LSN as
    /// awaited, which stops sync pacing (`writer::pacing`), and wakes the sync thread if it
    /// holds a group for pacing, or (`EveryRecord`) if it waits for a group and leaders may
    /// have left one staged.
    pub(crate) fn wake_writer_for_waiter(&self, awaited_lsn: u64) {
        // Marked, then the pause looked for: the mirror image of the sync thread's
        // `hold_unless_awaited`, so that either it sees the mark or this thread sees the pause.
        let paused = writer::pacing::mark_awaited(&self.awaited_lsn, awaited_lsn, &self.pacing);
        let every_record = match self.config.durability {
            Durability::EveryRecord => true,
            Durability::GroupCommit { .. } if paused => false,
            Durability::GroupCommit { .. } | Durability::None => return,
        };
        let mut state = lock(&self.append);
        let wake = if every_record {
            !state.chunks.is_empty() && state.writer_wait.wants_wake(true, true)
        } else {
            state.writer_wait == WriterWait::Paced
        };
        if !wake {
            return;
        }
        let in_ring = state.writer_wait.in_ring();
        state.set_writer_wait(WriterWait::Running);
        drop(state);
        self.wake_writer(in_ring);
    }

    /// Whether a thread waits for a record that is not durable yet (`writer::pacing`).
    pub(crate) fn awaited(&self) -> bool {
        // Runs after `hold_unless_awaited`'s fence, which pairs with `mark_awaited`'s: a mark
        // this load misses belongs to a waiter that sees the announced pause.
        self.awaited_lsn.load(crate::sync::Ordering::Relaxed)
            > self.durable_lsn.load(Ordering::Acquire)
    }

    /// Moves the written and durable watermarks, wakes the waiters that wait for them and,
    /// with `run_callbacks`, runs the durability callbacks now due. Without (a leader's
    /// thread: module `writer`, "Leading") due callbacks stay queued and
    /// `callbacks_deferred` tells the sync thread to run them.
    pub(crate) fn publish(&self, written: u64, durable: u64, run_callbacks: bool) {
        self.written_lsn.fetch_max(written, Ordering::AcqRel);
        let (ready, wake) = {
            let mut sync = lock(&self.sync);
            let previous = self.durable_lsn.load(Ordering::Acquire);
            // A failed log's durable LSN stays where the failure found it (`fail`), and no
            // callback past it runs as durable.
            let durable = if self.failed_flag.load(Ordering::Acquire) {
                durable.min(previous)
            } else {
                durable
            };
            let durable_moved = durable > previous;
            if durable_moved {
                self.durable_lsn.store(durable, Ordering::Release);
            }
            // Waiters register under this lock before waiting, so none is missed; a wake-up
            // nobody waits for (or one for bytes written when only durability is awaited)
            // would cost a system call and a spurious context switch per group.
            let wake = sync.written_waiters > 0 || (durable_moved && sync.durable_waiters > 0);
            let due = sync.callbacks.first_key_value().is_some_and(|(lsn, _)| *lsn <= durable);
            let ready = if due && run_callbacks {
                Self::split_due_callbacks(&mut sync, durable)
            } else {
                if due {
                    self.callbacks_deferred.store(true, Ordering::Release);
                }
                BTreeMap::new()
            };
            (ready, wake)
        };
        if wake {
            self.durable_cv.notify_all();
        }
        for callback in ready.into_values().flatten() {
            callback(Ok(()));
        }
    }

    /// Takes the callbacks of LSNs up to `durable` out of `sync`.
    fn split_due_callbacks(
        sync: &mut SyncState,
        durable: u64,
    ) -> BTreeMap<u64, Vec<DurableCallback>> {
        let later = sync.callbacks.split_off(&(durable + 1));
        std::mem::replace(&mut sync.callbacks, later)
    }

    /// Sync thread: runs the durability callbacks a leader left (see `publish` and `fail`):
    /// those of durable LSNs with `Ok`, and once the log failed, all others with its error.
    pub(crate) fn run_deferred_callbacks(&self) {
        if !self.callbacks_deferred.swap(false, Ordering::AcqRel) {
            return;
        }
        let (durable, failed) = {
            let mut sync = lock(&self.sync);
            let durable =
                Self::split_due_callbacks(&mut sync, self.durable_lsn.load(Ordering::Acquire));
            let failed = if self.failed_flag.load(Ordering::Acquire) {
                std::mem::take(&mut sync.callbacks)
            } else {
                BTreeMap::new()
            };
            (durable, failed)
        };
        for callback in durable.into_values().flatten() {
            callback(Ok(()));
        }
        if !failed.is_empty() {
            let error = self.failed_error();
            for callback in failed.into_values().flatten() {
                callback(Err(error.clone()));
            }
        }
    }

    /// Wakes the sync thread if callbacks were left for it (`callbacks_deferred`).
    pub(crate) fn wake_writer_for_callbacks(&self) {
        if self.callbacks_deferred.load(Ordering::Acquire) {
            // Under the append lock: the sync thread checks the flag under it before waiting.
            let _state = lock(&self.append);
            self.writer_wakeups.fetch_add(1, Ordering::Relaxed);
            self.writer_cv.notify_all();
        }
    }

    /// Sync thread, holding no writer lock: waits until there is something to do (a staged
    /// group, segments to delete, callbacks a leader left, or closing). Checked under the
    /// append lock, which every one of those takes to wake this thread, so no wake-up is lost.
    ///
    /// While `EveryRecord` waiters lead (`leaders_active`; module `writer`, "Leading"), appends
    /// do not wake this thread. So it looks for groups nobody led every [`LEADER_POLL`], and
    /// leaves a staged group to a possible leader for [`LEADER_GRACE`] after its first record.
    /// A poll period without any lead, or a group nobody led within the grace (which this
    /// thread then writes itself), ends that: appends wake this thread again until the next
    /// lead.
    pub(crate) fn wait_for_work(&self) {
        let mut state = lock(&self.append);
        loop {
            let other_work = state.closing
                || self.has_doomed()
                || self.callbacks_deferred.load(Ordering::Acquire);
            if other_work {
                return;
            }
            let leaders = self.leaders_active.load(Ordering::Relaxed);
            let (timeout, polling) = match state.group_started.filter(|_| !state.chunks.is_empty())
            {
                Some(_) if !leaders => return,
                Some(started) => {
                    let now = Instant::now();
                    let grace_end = started + LEADER_GRACE;
                    if now >= grace_end {
                        self.leaders_active.store(false, Ordering::Relaxed);
                        return;
                    }
                    (Some(grace_end - now), false)
                }
                None if leaders => (Some(LEADER_POLL), true),
                None => (None, false),
            };
            state.set_writer_wait(WriterWait::Condvar);
            state = match timeout {
                None => {
                    self.writer_cv.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner)
                }
                Some(timeout) => {
                    let (state, result) = self
                        .writer_cv
                        .wait_timeout(state, timeout)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let quiet_poll = polling
                        && result.timed_out()
                        && !self.led_since_poll.swap(false, Ordering::Relaxed);
                    if quiet_poll {
                        // No lead for a whole poll period: appends wake this thread again.
                        self.leaders_active.store(false, Ordering::Relaxed);
                    }
                    state
                }
            };
        }
    }

    /// After a lead that took a group, with the writer free again: wakes the sync thread if
    /// the leader left callbacks for it, and the waiters if records they may wait for are not
    /// durable yet, so that one of them leads next (appends do not wake the sync thread while
    /// leaders write: `Shared::leaders_write`).
    fn after_lead(&self) {
        self.wake_writer_for_callbacks();
        if self.appended_lsn.load(Ordering::Acquire) > self.durable_lsn.load(Ordering::Acquire)
            && lock(&self.sync).durable_waiters > 0
        {
            self.durable_cv.notify_all();
        }
    }

    /// The sync thread is ending without [`writer::Writer`]'s orderly exit (it panicked, and
    /// the log is failed): from now on `clean` deletes by itself (what it queued is deleted
    /// here), and threads waiting for the thread to finish (`Wal::close_timeout`) see it gone.
    /// Runs while the thread unwinds, so a storage layer that panics again while deleting is
    /// caught (a panic during an unwind would abort the process); the files then stay.
    pub(crate) fn writer_gone(&self) {
        let _order = lock(&self.deleting);
        let leftover_doomed = self.take_doomed(true);
        let deleted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.delete_segments(leftover_doomed, &mut CleanReport::default());
        }));
        if deleted.is_err() {
            tracing::error!("deleting cleaned segments panicked after the sync thread panicked");
        }
        self.mark_writer_done();
    }

    /// The sync thread has done everything it will ever do (its callbacks included): set
    /// under the sync lock, with the waiters woken (`Wal::close_timeout` waits for it).
    pub(crate) fn mark_writer_done(&self) {
        {
            let mut sync = lock(&self.sync);
            sync.writer_exited = true;
            sync.writer_done = true;
        }
        self.durable_cv.notify_all();
    }

    /// Deletes the files of `segments` (no longer tracked), or keeps them as spares, adding
    /// what happened to `report`. Failures are logged and reported, never retried (SPEC E.4).
    ///
    /// Oldest first, and never again once one cannot be deleted: a segment left on disk
    /// behind deleted ones would be an LSN gap, which the next open reads as corruption. The
    /// later ones stay on disk too (reported failed), now and in later cleans; the next open
    /// finds them all, in order, and a clean then deletes them.
    pub(crate) fn delete_segments(&self, segments: Vec<Arc<Segment>>, report: &mut CleanReport) {
        let mut segments = segments.into_iter();
        if let Some(stuck) = *lock(&self.undeletable) {
            let reason = format!("not deleted: segment {stuck} before it could not be");
            report.failed.extend(segments.map(|kept| (kept.header.id, reason.clone())));
            return;
        }
        while let Some(segment) = segments.next() {
            let (id, path, len) = (segment.header.id, segment.path.clone(), segment.file_len());
            if self.keep_as_spare(segment) {
                report.deleted.push(id);
                report.kept_as_spares.push(id);
            } else {
                match self.storage.remove(&path) {
                    Ok(()) => {
                        report.deleted.push(id);
                        report.bytes_freed += len;
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                        report.deleted.push(id);
                    }
                    Err(error) => {
                        tracing::warn!(?path, %error,
                            "could not delete a WAL segment; no later one is deleted until the \
                             log is reopened");
                        report.failed.push((id, error.to_string()));
                        *lock(&self.undeletable) = Some(id);
                        let reason = format!("not deleted: segment {id} before it could not be");
                        report.failed.extend(segments.map(|kept| (kept.header.id, reason.clone())));
                        return;
                    }
                }
            }
            // After the unlink or rename: a reader that sees the count sees the file gone.
            self.cleaned_segments.fetch_add(1, Ordering::Release);
        }
    }

    /// Renames the file of cleaned `segment` to a spare's name and adds it to the spares, if
    /// there is room, this log created it (so it is whole, of the configured size; not found by
    /// recovery: `Segment::recovered`), and nothing maps it. A
    /// reader's record guard or iterator may still map a cleaned segment, in this process or
    /// another (a read-only tool); its file must then never be written again, so it is deleted
    /// instead (the mapping keeps the bytes). In this process: the segment and its mapping
    /// must have no other reference. Elsewhere: every mapping holds a shared lock on its file
    /// (module `reader`), so the file is renamed under an exclusive lock taken without
    /// waiting. A segment the sync thread still holds is deleted too: `clean` with `wait` right
    /// after the segment's last group became durable may find it finishing that group; the
    /// sync thread itself retires the segments of a `clean` without `wait` between its groups.
    fn keep_as_spare(&self, segment: Arc<Segment>) -> bool {
        let mut spares = lock(&self.spares);
        if spares.closed || spares.files.len() >= self.spare_limit || segment.recovered {
            return false;
        }
        // The log no longer lists the segment (`clean` took it out): if this is the only
        // reference to it and to its mapping, nobody here can make another.
        let Ok(segment) = Arc::try_unwrap(segment) else {
            return false;
        };
        let Some(map) = segment.map.into_inner() else {
            return false;
        };
        let Ok(map) = Arc::try_unwrap(map) else {
            return false;
        };
        // Unmapped and unlocked before taking the exclusive lock.
        drop(map);
        let Ok(file) = std::fs::File::open(&segment.path) else {
            return false;
        };
        if file.try_lock().is_err() {
            // Mapped by another process (or another `Wal` of this one).
            return false;
        }
        let spare = self.dir.join(segment::spare_file_name(segment.header.id));
        match self.storage.rename(&segment.path, &spare) {
            Ok(()) => {
                spares.files.push(spare);
                true
            }
            Err(error) => {
                tracing::warn!(
                    path = ?segment.path,
                    %error,
                    "could not keep a WAL segment as a spare"
                );
                false
            }
        }
    }

    /// Deletes the spares and keeps no more: a closed log has no use for them, and the next
    /// writer's open would delete them anyway (module doc, "Recycled segments"). The sync
    /// thread calls it when it exits, before it releases the directory lock; `close` calls it
    /// again, which finds none unless the sync thread panicked. A spare the sync thread took
    /// before is its own; a failed deletion is logged and left to that open.
    fn delete_spares(&self) {
        let files = {
            let mut spares = lock(&self.spares);
            spares.closed = true;
            std::mem::take(&mut spares.files)
        };
        for file in files {
            match self.storage.remove(&file) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => tracing::warn!(path = ?file, %error, "could not delete a WAL spare"),
            }
        }
    }

    /// Hands `segments` to the sync thread for deletion and wakes it. Returns them if the sync
    /// thread has exited (the caller deletes them itself).
    fn doom(&self, segments: Vec<Arc<Segment>>) -> Option<Vec<Arc<Segment>>> {
        {
            let mut doomed = lock(&self.doomed);
            if doomed.writer_exited {
                return Some(segments);
            }
            doomed.segments.extend(segments);
        }
        // Under the append lock, so a sync thread about to wait sees the work first (it
        // checks `doomed` under the same lock) or is woken by this.
        let state = lock(&self.append);
        self.writer_wakeups.fetch_add(1, Ordering::Relaxed);
        if state.writer_wait.in_ring() {
            self.wake_ring();
        }
        self.writer_cv.notify_all();
        drop(state);
        None
    }

    pub(crate) fn has_doomed(&self) -> bool {
        !lock(&self.doomed).segments.is_empty()
    }

    /// Takes the segments queued for deletion (the caller deletes them, holding `deleting`);
    /// with `writer_exits`, every later `clean` deletes its segments itself.
    pub(crate) fn take_doomed(&self, writer_exits: bool) -> Vec<Arc<Segment>> {
        let mut doomed = lock(&self.doomed);
        doomed.writer_exited |= writer_exits;
        std::mem::take(&mut doomed.segments)
    }

    pub(crate) fn record_sync_latency(&self, elapsed: Duration) {
        let micros = elapsed.as_micros().max(1) as u64;
        let bucket = (63 - micros.leading_zeros() as usize).min(31);
        self.sync_latency_us_log2[bucket].fetch_add(1, Ordering::Relaxed);
    }

    fn sync_percentile_us(&self, quantile: f64) -> u64 {
        let counts: Vec<u64> =
            self.sync_latency_us_log2.iter().map(|count| count.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let target = ((total as f64) * quantile).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (bucket, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= target {
                return 1u64 << (bucket + 1);
            }
        }
        1 << 32
    }

    pub(crate) fn segment(&self, id: SegmentId) -> Option<Arc<Segment>> {
        let segments = self.segments.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        segments
            .binary_search_by_key(&id, |segment| segment.header.id)
            .ok()
            .map(|index| Arc::clone(&segments[index]))
    }

    pub(crate) fn segments_snapshot(&self) -> Vec<Arc<Segment>> {
        self.segments.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// A segmented write-ahead log. `Send + Sync`: share it (`Arc<Wal>`) and append from any
/// number of threads.
///
/// # Examples
/// ```
/// use coordbus::wal::{Lsn, Wal, WalConfig};
///
/// #[derive(rkyv::Archive, rkyv::Serialize)]
/// struct BlockAdded {
///     stream: u32,
///     block: u64,
/// }
///
/// let dir = tempfile::tempdir()?;
/// let wal = Wal::open(dir.path().join("wal"), WalConfig::default())?;
/// let (lsn, handle) = wal.append(&BlockAdded { stream: 1, block: 42 }, 1_000)?;
/// wal.wait_durable(lsn)?;
/// let record = wal.read::<BlockAdded>(handle)?;
/// assert_eq!(record.block, 42);
/// assert_eq!(wal.iter_from(Lsn::ZERO)?.count(), 1);
/// wal.close()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Wal {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// The writer's state, shared with the sync thread so that an `EveryRecord` waiter can
    /// lead (module `writer`, "Leading"); `None` when read-only.
    log_writer: Option<Arc<Mutex<writer::Writer>>>,
    report: RecoveryReport,
    io_path: IoPath,
    clock: Arc<dyn Clock>,
    /// A [`Wal::close_timeout`] gave up waiting for the sync thread: the drop does not wait for
    /// it either.
    close_timed_out: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal")
            .field("dir", &self.shared.dir)
            .field("io_path", &self.io_path)
            .field("durable_lsn", &self.durable_lsn())
            .finish_non_exhaustive()
    }
}

static FALLBACK_LOGGED: std::sync::Once = std::sync::Once::new();

impl Wal {
    /// Opens (and recovers) the log in `dir` with the default I/O path and file layer.
    ///
    /// A missing directory is an empty log; nothing is created until the first append
    /// (SPEC E.3).
    ///
    /// # Errors
    /// [`WalError::Locked`] if another `Wal` (in this or another process) has `dir` open for
    /// writing, [`WalError::InvalidConfig`], [`WalError::Corruption`] (strict mode),
    /// [`WalError::UnsupportedVersion`], [`WalError::Io`].
    pub fn open(dir: impl AsRef<Path>, config: WalConfig) -> Result<Wal, WalError> {
        Self::open_with_options(dir, config, WalOptions::default())
    }

    /// Opens (and recovers) the log with `clock` as the time source of [`Wal::append_now`].
    ///
    /// # Errors
    /// As [`Wal::open`].
    pub fn open_with_clock(
        dir: impl AsRef<Path>,
        config: WalConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Wal, WalError> {
        Self::open_with_options(dir, config, WalOptions { clock, ..WalOptions::default() })
    }

    /// Opens (and recovers) the log with an explicit I/O path and file layer.
    ///
    /// # Errors
    /// As [`Wal::open`]; with [`IoMode::IoUring`] also the kernel's refusal of io_uring.
    pub fn open_with_options(
        dir: impl AsRef<Path>,
        config: WalConfig,
        options: WalOptions,
    ) -> Result<Wal, WalError> {
        config.validate()?;
        if options.spare_segments > MAX_SPARE_SEGMENTS {
            return Err(WalError::InvalidConfig {
                setting: "spare_segments",
                value: options.spare_segments.to_string(),
                reason: "must be at most 1024",
            });
        }
        if options.sync_thread_nice > MAX_SYNC_THREAD_NICE {
            return Err(WalError::InvalidConfig {
                setting: "sync_thread_nice",
                value: options.sync_thread_nice.to_string(),
                reason: "must be at most 39 (nice values span -20 to 19)",
            });
        }
        if let Some(core) = options.io_cores.iter().find(|&&core| core >= CORE_ID_LIMIT) {
            return Err(WalError::InvalidConfig {
                setting: "io_cores",
                value: core.to_string(),
                reason: "core ids must be below 1024 (what a CPU set can name)",
            });
        }
        let dir = dir.as_ref().to_path_buf();
        let engine: Box<dyn writer::IoEngine> = match options.io {
            // A read-only log writes nothing: no ring (its memory, its wake pipe), whatever the
            // mode asked.
            _ if options.read_only => Box::new(writer::pwrite::PwriteEngine),
            IoMode::Pwrite => Box::new(writer::pwrite::PwriteEngine),
            IoMode::IoUring => Box::new(
                writer::uring::UringEngine::new(options.uring_direct_max_bytes)
                    .map_err(|error| WalError::from_io("io_uring setup", dir.clone(), 0, &error))?,
            ),
            IoMode::Auto => match writer::uring::UringEngine::new(options.uring_direct_max_bytes) {
                Ok(engine) => Box::new(engine),
                Err(error) => {
                    FALLBACK_LOGGED.call_once(|| {
                        tracing::warn!(
                            %error,
                            "io_uring unavailable (ENOSYS/EPERM or limits); the WAL writes with \
                             pwrite + fdatasync"
                        );
                    });
                    Box::new(writer::pwrite::PwriteEngine)
                }
            },
        };
        let io_path = engine.path();
        let ring_waker = engine.waker();
        // Lock before recovery reads or cuts anything: a second writer must not even recover
        // (it would cut the first one's in-flight tail). Read-only opens change nothing and
        // take no lock.
        let dir_lock = if options.read_only { None } else { lock::DirLock::try_acquire(&dir)? };
        let recovered =
            recovery::recover(&dir, &config, options.storage.as_ref(), options.read_only)?;
        tracing::info!(dir = ?dir, report = %recovered.report, io_path = io_path.as_str(),
            "write-ahead log opened");
        let last_lsn = recovered.report.last_lsn.0;
        let staging = staging_limit(config.durability);
        let shared = Arc::new(Shared {
            dir: dir.clone(),
            config: config.clone(),
            storage: options.storage,
            append: Mutex::new(AppendState {
                next_lsn: last_lsn + 1,
                active: None,
                offset: SEGMENT_HEADER_LEN,
                next_segment_id: recovered.next_segment_id,
                buf: Vec::with_capacity(staging),
                chunks: Vec::new(),
                group_started: None,
                writer_wait: WriterWait::Running,
                room_waiters: VecDeque::new(),
                next_room_ticket: 0,
                closing: options.read_only,
                appends: 0,
                bytes: 0,
            }),
            writer_cv: Condvar::new(),
            ring_waker,
            sync_thread: OnceLock::new(),
            #[cfg(test)]
            workers_confined: OnceLock::new(),
            space_cv: Condvar::new(),
            segments: RwLock::new(recovered.segments),
            appended_lsn: CachePadded::new(AtomicU64::new(last_lsn)),
            written_lsn: CachePadded::new(AtomicU64::new(last_lsn)),
            synced_lsn: CachePadded::new(AtomicU64::new(last_lsn)),
            durable_lsn: CachePadded::new(AtomicU64::new(last_lsn)),
            sync: Mutex::new(SyncState {
                callbacks: BTreeMap::new(),
                writer_exited: options.read_only,
                writer_done: options.read_only,
                durable_waiters: 0,
                written_waiters: 0,
            }),
            doomed: Mutex::new(Doomed { segments: Vec::new(), writer_exited: options.read_only }),
            deleting: Mutex::new(()),
            spares: Mutex::new(Spares::default()),
            spare_limit: options.spare_segments,
            recycled_segments: AtomicU64::new(0),
            read_only: options.read_only,
            durable_cv: Condvar::new(),
            callbacks_deferred: AtomicBool::new(false),
            leaders_active: AtomicBool::new(false),
            led_since_poll: AtomicBool::new(false),
            holds_dir_lock: AtomicBool::new(false),
            undeletable: Mutex::new(None),
            failed: OnceLock::new(),
            failed_flag: AtomicBool::new(false),
            groups: AtomicU64::new(0),
            led_groups: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            sync_latency_us_log2: Default::default(),
            cleaned_segments: AtomicU64::new(0),
            writer_wakeups: AtomicU64::new(0),
            paced_groups: AtomicU64::new(0),
            pacing: crate::sync::AtomicBool::new(false),
            awaited_lsn: CachePadded::new(crate::sync::AtomicU64::new(0)),
        });
        let log_writer = (!options.read_only).then(|| {
            Arc::new(Mutex::new(writer::Writer::new(Arc::clone(&shared), engine, dir_lock)))
        });
        let writer = match &log_writer {
            None => None,
            Some(log_writer) => {
                let thread_writer = Arc::clone(log_writer);
                Some(
                    std::thread::Builder::new()
                        .name("coordbus-wal-sync".into())
                        .spawn(move || {
                            writer::run(thread_writer, options.sync_thread_nice, &options.io_cores)
                        })
                        .map_err(|error| {
                            WalError::from_io("spawn sync thread", dir.clone(), 0, &error)
                        })?,
                )
            }
        };
        Ok(Wal {
            shared,
            writer: Mutex::new(writer),
            log_writer,
            report: recovered.report,
            io_path,
            clock: options.clock,
            close_timed_out: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The log's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The configuration the log was opened with.
    pub fn config(&self) -> &WalConfig {
        &self.shared.config
    }

    /// The largest payload one record may carry: what a segment holds after its header and
    /// the record's frame header (and at most [`frame::MAX_PAYLOAD_LEN`]). A longer one is
    /// refused with [`WalError::RecordTooLarge`].
    pub fn max_payload_len(&self) -> usize {
        max_payload_len(self.shared.config.segment_size_bytes)
    }

    /// Serializes `value` (rkyv) and appends it with time `time_ms`. Never waits for a sync:
    /// the record is durable once [`Wal::durable_lsn`] reaches the returned LSN. It returns at
    /// once unless the staging buffer is full (the disk is behind the appenders); then it
    /// waits, first come first served, until the sync thread has written enough to make room
    /// (back-pressure, as long as the disk takes: [`Wal::append_bytes_timeout`] bounds it).
    ///
    /// # Errors
    /// [`WalError::Record`] if serialization fails, [`WalError::RecordTooLarge`],
    /// [`WalError::Closed`], [`WalError::ReadOnly`] for a log opened read-only,
    /// [`WalError::Failed`] after an earlier write or sync failure, and
    /// [`WalError::InvalidConfig`] once the log's 2^32 segment ids are used up.
    pub fn append<T: Record>(
        &self,
        value: &T,
        time_ms: i64,
    ) -> Result<(Lsn, RecordHandle), WalError> {
        let bytes = record::to_bytes(value)?;
        self.append_bytes(&bytes, time_ms)
    }

    /// [`Wal::append`] with the time of the log's clock.
    ///
    /// # Errors
    /// As [`Wal::append`].
    pub fn append_now<T: Record>(&self, value: &T) -> Result<(Lsn, RecordHandle), WalError> {
        self.append(value, self.clock.now_ms())
    }

    /// [`Wal::append_bytes`] with the time of the log's clock.
    ///
    /// # Errors
    /// As [`Wal::append`].
    pub fn append_bytes_now(&self, payload: &[u8]) -> Result<(Lsn, RecordHandle), WalError> {
        self.append_bytes(payload, self.clock.now_ms())
    }

    /// Appends raw bytes with time `time_ms` (read them back with [`Wal::read_bytes`]).
    ///
    /// # Errors
    /// As [`Wal::append`].
    pub fn append_bytes(
        &self,
        payload: &[u8],
        time_ms: i64,
    ) -> Result<(Lsn, RecordHandle), WalError> {
        self.append_bytes_within(payload, time_ms, None)
    }

    /// [`Wal::append_bytes`] that waits at most `timeout` for room in a full staging buffer.
    ///
    /// # Errors
    /// As [`Wal::append`], plus [`WalError::AppendTimedOut`] if there was no room in time
    /// (nothing was appended).
    pub fn append_bytes_timeout(
        &self,
        payload: &[u8],
        time_ms: i64,
        timeout: Duration,
    ) -> Result<(Lsn, RecordHandle), WalError> {
        self.append_bytes_within(payload, time_ms, Some(timeout))
    }

    /// [`Wal::append_bytes`], waiting at most `timeout` for room (`None`: as long as it
    /// takes).
    fn append_bytes_within(
        &self,
        payload: &[u8],
        time_ms: i64,
        timeout: Option<Duration>,
    ) -> Result<(Lsn, RecordHandle), WalError> {
        let shared = &*self.shared;
        let frame_len = frame::frame_len(payload.len()) as u64;
        if payload.len() > max_payload_len(shared.config.segment_size_bytes) {
            return Err(WalError::RecordTooLarge {
                len: frame_len,
                segment_size_bytes: shared.config.segment_size_bytes,
            });
        }
        let group_commit_bytes = match shared.config.durability {
            Durability::GroupCommit { max_bytes, .. } => Some(max_bytes),
            _ => None,
        };
        let staging_limit = staging_limit(shared.config.durability);
        let room = Room { frame_len: frame_len as usize, staging_limit, timeout };
        let mut state = self.wait_for_room(lock(&shared.append), room)?;
        let needs_new = match &state.active {
            None => true,
            Some(active) => {
                let late_window =
                    matches!(active.header.window, Some(window) if time_ms > window.stop_ms);
                late_window || state.offset + frame_len > shared.config.segment_size_bytes
            }
        };
        if needs_new {
            if let Err(error) = self.roll(&mut state, time_ms) {
                // Its room stays unused: the waiters behind it may go.
                drop(state);
                shared.space_cv.notify_all();
                return Err(error);
            }
        }
        let lsn = state.next_lsn;
        let offset = state.offset;
        let mut guard = state;
        let state = &mut *guard;
        let buf_start = state.buf.len();
        frame::encode_into(
            &mut state.buf,
            payload,
            lsn,
            time_ms,
            shared.synced_lsn.load(Ordering::Relaxed),
        )?;
        debug_assert_eq!(state.buf.len() - buf_start, frame_len as usize);
        let active = state.active.as_ref().expect("rolled above");
        match state.chunks.last_mut() {
            Some(chunk)
                if Arc::ptr_eq(&chunk.segment, active)
                    && chunk.file_offset + (chunk.buf_end - chunk.buf_start) as u64 == offset =>
            {
                chunk.buf_end = state.buf.len();
                chunk.last_lsn = lsn;
                chunk.max_time_ms = chunk.max_time_ms.max(time_ms);
            }
            _ => state.chunks.push(Chunk {
                segment: Arc::clone(active),
                file_offset: offset,
                buf_start,
                buf_end: state.buf.len(),
                last_lsn: lsn,
                max_time_ms: time_ms,
            }),
        }
        state.next_lsn = lsn + 1;
        state.offset = offset + frame_len;
        state.appends += 1;
        state.bytes += frame_len;
        shared.appended_lsn.store(lsn, Ordering::Release);
        let first_of_group = state.group_started.is_none();
        if first_of_group {
            state.group_started = Some(Instant::now());
        }
        let full = group_commit_bytes.is_none_or(|max| state.buf.len() >= max);
        // While `EveryRecord` waiters lead, the appender is expected to write its group itself
        // (module `writer`, "Leading"); waking the sync thread for it would only compete with
        // that leader for the two cores. Whoever waits without leading wakes it instead.
        let leaders_write = shared.leaders_write();
        let wake = state.writer_wait.wants_wake(first_of_group, full) && !leaders_write;
        let wake_ring = wake && state.writer_wait.in_ring();
        let segment = active.header.id;
        if wake {
            state.set_writer_wait(WriterWait::Running);
        }
        drop(guard);
        if wake {
            shared.wake_writer(wake_ring);
        }
        Ok((Lsn(lsn), RecordHandle { segment, offset, len: payload.len() as u32 }))
    }

    /// Waits until a frame of `room.frame_len` bytes may be staged (`AppendState::has_room`,
    /// first come first served), waking the sync thread so that the staged group is written at
    /// once. Returns the append lock, or the error that ends the wait (closed or failed log,
    /// or the deadline passed).
    fn wait_for_room<'a>(
        &'a self,
        mut state: MutexGuard<'a, AppendState>,
        room: Room,
    ) -> Result<MutexGuard<'a, AppendState>, WalError> {
        let shared = &*self.shared;
        let Room { frame_len, staging_limit, timeout } = room;
        let mut ticket = None;
        // Set when the append first has to wait (a timeout too large for the clock: none).
        let mut deadline: Option<Instant> = None;
        loop {
            let refusal = if state.closing {
                Some(if shared.read_only { WalError::ReadOnly } else { WalError::Closed })
            } else if shared.failed_flag.load(Ordering::Acquire) {
                Some(shared.failed_error())
            } else {
                None
            };
            // The frame must fit in the limit (the buffers are allocated at the limit: one
            // that overflowed was reallocated, and the copy faulted in fresh pages each time).
            if refusal.is_none() && state.has_room(frame_len, staging_limit, ticket) {
                state.remove_room_waiter(ticket);
                return Ok(state);
            }
            if ticket.is_none() {
                deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
            }
            let refusal = refusal.or_else(|| {
                deadline.filter(|deadline| Instant::now() >= *deadline).map(|_| {
                    WalError::AppendTimedOut {
                        timeout: timeout.unwrap_or_default(),
                        appended: shared.appended_lsn.load(Ordering::Acquire),
                        durable: shared.durable_lsn.load(Ordering::Acquire),
                    }
                })
            });
            if let Some(error) = refusal {
                state.remove_room_waiter(ticket);
                drop(state);
                // The waiters behind this one may go now.
                shared.space_cv.notify_all();
                return Err(error);
            }
            // Someone waits for room: the group is due now, not after its delay.
            if state.writer_wait.wants_wake(false, true) {
                let in_ring = state.writer_wait.in_ring();
                state.set_writer_wait(WriterWait::Running);
                shared.wake_writer(in_ring);
            }
            if ticket.is_none() {
                ticket = Some(state.queue_room_waiter(frame_len));
            }
            state = match deadline {
                None => {
                    shared.space_cv.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner)
                }
                Some(deadline) => {
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    let waited = shared.space_cv.wait_timeout(state, remaining);
                    waited.unwrap_or_else(std::sync::PoisonError::into_inner).0
                }
            };
        }
    }

    /// Starts a new active segment for a record with time `time_ms` (SPEC E.2 window rule).
    fn roll(&self, state: &mut AppendState, time_ms: i64) -> Result<(), WalError> {
        let shared = &*self.shared;
        let window = match (shared.config.rolling_interval, &state.active) {
            (None, _) => None,
            (Some(_), Some(active))
                if active.header.window.is_some_and(|window| time_ms <= window.stop_ms) =>
            {
                // Rolled by size inside a window: the new segment keeps the window.
                active.header.window
            }
            (Some(interval), _) => Some(Window {
                start_ms: time_ms,
                stop_ms: time_ms.saturating_add(interval.as_millis() as i64),
            }),
        };
        let id = u32::try_from(state.next_segment_id).map_err(|_| WalError::InvalidConfig {
            setting: "segment id",
            value: state.next_segment_id.to_string(),
            reason: "segment numbers are exhausted (u32)",
        })?;
        state.next_segment_id += 1;
        let header = SegmentHeader {
            id: SegmentId(id),
            first_lsn: state.next_lsn,
            window,
            segment_size_bytes: shared.config.segment_size_bytes,
            // The sync thread decides when it creates the file (`Writer::create_segment`).
            recycled: false,
        };
        let segment = Arc::new(Segment::new(&shared.dir, header));
        shared
            .segments
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Arc::clone(&segment));
        if let Some(previous) = state.active.replace(segment) {
            previous.appended_end.store(state.offset, Ordering::Release);
        }
        state.offset = SEGMENT_HEADER_LEN;
        Ok(())
    }

    /// The last LSN known durable (`Lsn::ZERO` before anything; after opening, the last
    /// recovered LSN).
    pub fn durable_lsn(&self) -> Lsn {
        Lsn(self.shared.durable_lsn.load(Ordering::Acquire))
    }

    /// The last LSN whose sync completed, so that a power loss keeps it. The same as
    /// [`Wal::durable_lsn`] with [`Durability::GroupCommit`] and [`Durability::EveryRecord`];
    /// with [`Durability::None`] (which counts a written LSN durable), the last record of the
    /// last segment sealed. After opening for writing (which syncs the recovered last
    /// segment), the last recovered LSN; a read-only log syncs nothing, so there it is only
    /// the last LSN found.
    pub fn synced_lsn(&self) -> Lsn {
        Lsn(self.shared.synced_lsn.load(Ordering::Acquire))
    }

    /// The last LSN appended.
    pub fn appended_lsn(&self) -> Lsn {
        Lsn(self.shared.appended_lsn.load(Ordering::Acquire))
    }

    /// Waits until `lsn` is durable. With [`Durability::EveryRecord`], if the log is idle,
    /// the calling thread writes and syncs the staged records itself (so this call does the
    /// I/O; [`Wal::wait_durable_timeout`] never does).
    ///
    /// # Errors
    /// [`WalError::Failed`] if the log failed first, [`WalError::NotAppended`] for an LSN never
    /// appended, [`WalError::Closed`] if the log closed without making it durable.
    pub fn wait_durable(&self, lsn: Lsn) -> Result<(), WalError> {
        self.wait_durable_inner(lsn, None)
    }

    /// Whether a wait for durability on this log may lead (module `writer`, "Leading"):
    /// `EveryRecord`, a writable log, and no timeout (the write and sync could outlast it).
    fn may_lead(&self, timeout: Option<Duration>) -> bool {
        timeout.is_none()
            && self.log_writer.is_some()
            && matches!(self.shared.config.durability, Durability::EveryRecord)
    }

    /// Writes and syncs the staged records on this thread if the writer is free. Returns
    /// false if it is busy: its holder writes them then (the sync thread at its next turn, or
    /// a leader, which wakes the waiters when it is done so that one of them leads next:
    /// `Shared::after_lead`).
    fn try_lead(&self, lsn: Lsn) -> bool {
        let Some(log_writer) = &self.log_writer else {
            return true;
        };
        // Busy or poisoned: wait as usual.
        let Ok(mut writer) = log_writer.try_lock() else {
            return false;
        };
        let led = writer.lead(lsn.0);
        drop(writer);
        if led {
            self.shared.after_lead();
        }
        true
    }

    /// Whether the writer is free right now (nobody leads, the sync thread is between turns
    /// or idle).
    fn writer_is_free(&self) -> bool {
        self.log_writer.as_ref().is_some_and(|log_writer| log_writer.try_lock().is_ok())
    }

    /// Waits at most `timeout` until `lsn` is durable.
    ///
    /// # Errors
    /// As [`Wal::wait_durable`], plus [`WalError::Timeout`].
    pub fn wait_durable_timeout(&self, lsn: Lsn, timeout: Duration) -> Result<(), WalError> {
        self.wait_durable_inner(lsn, Some(timeout))
    }

    fn wait_durable_inner(&self, lsn: Lsn, timeout: Option<Duration>) -> Result<(), WalError> {
        let shared = &*self.shared;
        if shared.durable_lsn.load(Ordering::Acquire) >= lsn.0 {
            return Ok(());
        }
        let appended = shared.appended_lsn.load(Ordering::Acquire);
        if lsn.0 > appended {
            return Err(WalError::NotAppended { lsn: lsn.0, appended });
        }
        let may_lead = self.may_lead(timeout);
        if !may_lead {
            shared.wake_writer_for_waiter(lsn.0);
        }
        // A timeout too large for the clock (`Duration::MAX`) waits without a deadline.
        let deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
        let mut sync = lock(&shared.sync);
        // Lead first, and again after every wake-up (a leader that is done wakes the waiters).
        let mut lead_now = may_lead;
        let mut recheck_writer = false;
        let mut recheck_allowed = true;
        loop {
            let durable = shared.durable_lsn.load(Ordering::Acquire);
            if durable >= lsn.0 {
                return Ok(());
            }
            if shared.failed_flag.load(Ordering::Acquire) {
                return Err(shared.failed_error());
            }
            if sync.writer_exited {
                return Err(WalError::Closed);
            }
            if lead_now {
                lead_now = false;
                drop(sync);
                let busy = !self.try_lead(lsn);
                recheck_writer = busy && std::mem::take(&mut recheck_allowed);
                // Not registered as a waiter meanwhile: look again before waiting.
                sync = lock(&shared.sync);
                continue;
            }
            // At most once per wake-up: a sync thread turning fast could otherwise keep
            // this thread alternating between a busy and a free writer.
            if std::mem::take(&mut recheck_writer) && self.writer_is_free() {
                // The writer was busy when this thread tried, and its holder let go before
                // this thread registered as a waiter: a leader's hand-over (`after_lead`) may
                // have found nobody to wake. Under the sync lock, so a holder that lets go
                // from now on sees this thread waiting.
                lead_now = true;
                continue;
            }
            let remaining = match deadline {
                None => None,
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(WalError::Timeout {
                            lsn: lsn.0,
                            durable,
                            timeout: timeout.unwrap_or_default(),
                        });
                    }
                    Some(deadline - now)
                }
            };
            sync = SyncState::wait_counted(sync, &shared.durable_cv, remaining, |sync| {
                &mut sync.durable_waiters
            });
            lead_now = may_lead;
            recheck_allowed = true;
        }
    }

    /// Runs `callback` once `lsn` is durable (with `Ok`), or with the error that decides it
    /// cannot become durable: [`WalError::Failed`] (the log failed), [`WalError::Closed`]
    /// (closed first), [`WalError::NotAppended`] (an LSN never appended). It runs on the sync
    /// thread, so it must be short and must not block on the log; if `lsn` is already durable
    /// (or the outcome already known) it runs at once on the calling thread.
    pub fn notify_when_durable(&self, lsn: Lsn, callback: DurableCallback) {
        let shared = &*self.shared;
        let outcome = {
            let mut sync = lock(&shared.sync);
            let appended = shared.appended_lsn.load(Ordering::Acquire);
            if shared.durable_lsn.load(Ordering::Acquire) >= lsn.0 {
                Ok(())
            } else if shared.failed_flag.load(Ordering::Acquire) {
                Err(shared.failed_error())
            } else if lsn.0 > appended {
                Err(WalError::NotAppended { lsn: lsn.0, appended })
            } else if sync.writer_exited {
                Err(WalError::Closed)
            } else {
                sync.callbacks.entry(lsn.0).or_default().push(callback);
                drop(sync);
                // Leaders write only for themselves, and pacing holds groups nobody waits
                // for: the sync thread must see this record.
                shared.wake_writer_for_waiter(lsn.0);
                return;
            }
        };
        callback(outcome);
    }

    /// The record at `handle` as raw payload bytes, checked (frame CRC, length) and borrowed
    /// from the memory map. If the record is appended but not yet written, waits until the sync
    /// thread has written it (at most 60 s past the group-commit delay). A handle this log
    /// never returned (stale, or of another log) does not wait for appends: past what was
    /// appended to the active segment, past where appends to an earlier segment ended, or past
    /// the end of a sealed one, it fails at once.
    ///
    /// # Errors
    /// [`WalError::NotFound`] (cleaned, never appended, past the end, or not written within
    /// 60 s past the group-commit delay), [`WalError::LengthMismatch`] naming both lengths,
    /// [`WalError::Corruption`] if the bytes on disk are damaged, [`WalError::Failed`] if the
    /// log fails while it waits.
    pub fn read_bytes(&self, handle: RecordHandle) -> Result<RecordBytes, WalError> {
        reader::read_bytes(&self.shared, handle)
    }

    /// The record at `handle` as a validated, zero-copy view of the archived `T`: a guard
    /// that dereferences to `T::Archived` (`&*wal.read::<T>(handle)?` for a reference).
    ///
    /// # Errors
    /// As [`Wal::read_bytes`], plus [`WalError::Record`] if the bytes are not a valid `T`.
    pub fn read<T>(&self, handle: RecordHandle) -> Result<ArchivedRecord<T>, WalError>
    where
        T: rkyv::Archive,
        T::Archived: Checked,
    {
        let bytes = self.read_bytes(handle)?;
        ArchivedRecord::new(bytes).map_err(WalError::from)
    }

    /// Every record with an LSN of at least `from`, in LSN order across segments, up to what
    /// was written when each segment is reached. The iteration stops (`None`) at the end of
    /// what is written (in the first segment still being written); a later `next` on the same
    /// iterator goes on from there with what was written since, in that segment and in the
    /// segments made after it, never skipping a record, except in segments cleaned before the
    /// iterator reached them (it holds the segments there were when it was made or last
    /// reached the end; a segment made since and cleaned meanwhile is gone).
    ///
    /// # Errors
    /// Opening the iterator does not fail today; items fail with [`WalError::Corruption`] if
    /// bytes changed on disk after recovery.
    pub fn iter_from(&self, from: Lsn) -> Result<WalIter, WalError> {
        Ok(WalIter::new(&self.shared, from))
    }

    /// Deletes the segments whose end time is strictly below `threshold_ms` (SPEC 0.6, E.4),
    /// oldest first, up to the first segment that is kept: never the newest segment (the
    /// active one, or after a reopen the recovered last one: the log's LSNs and segment ids
    /// continue from it), nor one not yet completely written, nor one behind a kept segment
    /// (when record times are not in LSN order, as after a restart that logs lower times
    /// again), since a gap in the LSNs would read as corruption on the next open. The
    /// segments leave the log at once. With `wait`, their files are deleted here and the directory
    /// is synced, so the deletions are durable on return; without, the sync thread deletes the
    /// files ([`CleanReport::queued`]), and the caller pays nothing for dropping their cached
    /// pages.
    ///
    /// # Errors
    /// [`WalError::Io`] only if syncing the directory fails (failed deletions are reported in
    /// [`CleanReport::failed`]); [`WalError::ReadOnly`].
    pub fn clean(&self, threshold_ms: i64, wait: bool) -> Result<CleanReport, WalError> {
        let report = self.clean_where(wait, |segment| segment.end_time_ms() < threshold_ms)?;
        tracing::debug!(threshold_ms, deleted = report.deleted.len(), "cleaned WAL segments");
        Ok(report)
    }

    /// Deletes the segments all of whose records have an LSN below `lsn` (for callers that
    /// checkpoint by position rather than time); same rules as [`Wal::clean`] otherwise.
    ///
    /// # Errors
    /// As [`Wal::clean`].
    pub fn clean_below_lsn(&self, lsn: Lsn, wait: bool) -> Result<CleanReport, WalError> {
        let report = self.clean_where(wait, |segment| segment.holds_only_below(lsn))?;
        tracing::debug!(lsn = lsn.0, deleted = report.deleted.len(), "cleaned WAL segments");
        Ok(report)
    }

    /// [`Wal::clean`] that also keeps every segment holding a record at or above `keep_from`:
    /// for callers whose records from `keep_from` on are still needed whatever their time
    /// (a tracker's additions of blocks it has not allocated yet). Same rules otherwise.
    ///
    /// # Errors
    /// As [`Wal::clean`].
    pub fn clean_keeping_from(
        &self,
        threshold_ms: i64,
        keep_from: Lsn,
        wait: bool,
    ) -> Result<CleanReport, WalError> {
        let report = self.clean_where(wait, |segment| {
            segment.end_time_ms() < threshold_ms && segment.holds_only_below(keep_from)
        })?;
        tracing::debug!(
            threshold_ms,
            keep_from = keep_from.0,
            deleted = report.deleted.len(),
            "cleaned WAL segments"
        );
        Ok(report)
    }

    fn clean_where(
        &self,
        wait: bool,
        select: impl Fn(&Segment) -> bool,
    ) -> Result<CleanReport, WalError> {
        let shared = &*self.shared;
        if shared.read_only {
            return Err(WalError::ReadOnly);
        }
        // Selections and deletions in one order (`Shared::deleting`).
        let _order = lock(&shared.deleting);
        let active = lock(&shared.append).active.as_ref().map(|segment| segment.header.id);
        let selected: Vec<Arc<Segment>> = {
            let mut segments =
                shared.segments.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            // The oldest segments only, up to the first one kept: deleting one further on
            // would leave a gap in the LSNs, which recovery reads as corruption. Never the
            // newest: a reopened log continues its LSNs and segment ids from it (with none
            // left they would start again at 1, and a stale handle could read a new record).
            // Nor one whose next segment has no file yet (mapped once its header and name are
            // durable): until then it is the newest file on disk, from which a reopened log
            // continues (the sync thread seals it before creating the next file, and a log
            // that failed to create that file never will).
            let prefix = segments
                .iter()
                .zip(segments.iter().skip(1))
                .take_while(|(segment, next)| {
                    Some(segment.header.id) != active
                        && segment.sealed.load(Ordering::Acquire)
                        && next.map.get().is_some()
                        && select(segment)
                })
                .count();
            segments.drain(..prefix).collect()
        };
        let mut report = CleanReport::default();
        if selected.is_empty() {
            // Nothing to delete: no wake-up of the sync thread (a coordinator cleans every few
            // commits, and most calls find nothing; each wake-up cost a pipe write here and a
            // turn of the sync thread, competing for the cores with this caller).
            return Ok(report);
        }
        if wait {
            // Segments an earlier `clean` queued for the sync thread are older: they go first
            // (and are reported here).
            let mut queued = shared.take_doomed(false);
            queued.extend(selected);
            shared.delete_segments(queued, &mut report);
            if !report.deleted.is_empty() {
                shared.storage.sync_dir(&shared.dir).map_err(|error| {
                    WalError::from_io("sync directory", shared.dir.clone(), 0, &error)
                })?;
            }
        } else {
            report.queued = selected.iter().map(|segment| segment.header.id).collect();
            report.bytes_freed = selected.iter().map(|segment| segment.file_len()).sum();
            if let Some(selected) = shared.doom(selected) {
                // No sync thread to hand them to (closed): delete them here.
                report.queued.clear();
                report.bytes_freed = 0;
                shared.delete_segments(selected, &mut report);
            }
        }
        Ok(report)
    }

    /// What opening found and cut.
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.report
    }

    /// The live I/O path ([`IoPath::Pwrite`] for a read-only log, which sets up no ring).
    pub fn io_path(&self) -> IoPath {
        self.io_path
    }

    /// Counters (cheap: a few atomic loads and one short lock).
    pub fn stats(&self) -> WalStats {
        let shared = &*self.shared;
        let (appends, bytes) = {
            let state = lock(&shared.append);
            (state.appends, state.bytes)
        };
        WalStats {
            appends,
            bytes,
            groups: shared.groups.load(Ordering::Relaxed),
            led_groups: shared.led_groups.load(Ordering::Relaxed),
            syncs: shared.syncs.load(Ordering::Relaxed),
            sync_p50_us: shared.sync_percentile_us(0.5),
            sync_p99_us: shared.sync_percentile_us(0.99),
            appended_lsn: self.appended_lsn(),
            durable_lsn: self.durable_lsn(),
            segments: shared
                .segments
                .read()
                .map_or_else(|poison| poison.into_inner().len(), |s| s.len()),
            cleaned_segments: shared.cleaned_segments.load(Ordering::Relaxed),
            recycled_segments: shared.recycled_segments.load(Ordering::Relaxed),
            spare_segments: lock(&shared.spares).files.len(),
            writer_wakeups: shared.writer_wakeups.load(Ordering::Relaxed),
            paced_groups: shared.paced_groups.load(Ordering::Relaxed),
            io_path: Some(self.io_path),
        }
    }

    /// Writes and syncs everything appended, stops the sync thread, and rejects later appends
    /// with [`WalError::Closed`]. Idempotent; reads keep working. Waits as long as the disk
    /// takes; [`Wal::close_timeout`] bounds the wait, and the drop of a log not closed calls
    /// it with [`WalConfig::drop_close_timeout`]. Called from a durability callback (on
    /// the sync thread, which cannot wait for itself), it only starts closing: the thread
    /// writes and syncs the rest once the callback returns.
    ///
    /// # Errors
    /// [`WalError::Failed`] if a write or sync failed (now or earlier);
    /// [`WalError::CloseOnSyncThread`] if called from a durability callback while appended
    /// records are not durable yet (not a failure: a later `close` from another thread, or the
    /// drop, waits for them).
    pub fn close(&self) -> Result<(), WalError> {
        self.begin_close();
        let handle = lock(&self.writer).take();
        // A durability callback may drop the last reference to the log on the sync thread
        // itself; that thread then finishes on its own once `closing` is seen.
        let on_sync_thread = self.on_sync_thread();
        if handle.is_none() && !on_sync_thread {
            // Another close took the handle and joins the thread: wait for the same end.
            let _ = self.wait_for_writer_done(None, Duration::ZERO);
        }
        if let Some(handle) = handle.filter(|_| !on_sync_thread) {
            if handle.join().is_err() {
                self.shared.fail(
                    WalError::Io {
                        op: "sync thread",
                        path: self.shared.dir.clone(),
                        kind: std::io::ErrorKind::Other,
                        message: "the sync thread panicked".into(),
                    },
                    true,
                );
            }
        }
        self.shared.delete_spares();
        if let Some(_failure) = self.shared.failure() {
            return Err(self.shared.failed_error());
        }
        if on_sync_thread {
            // The sync thread cannot wait for itself: it writes and syncs what is left once the
            // callback that called this returns. Ok only if nothing is left.
            let appended = self.shared.appended_lsn.load(Ordering::Acquire);
            let durable = self.shared.durable_lsn.load(Ordering::Acquire);
            if durable < appended {
                return Err(WalError::CloseOnSyncThread { appended, durable });
            }
        }
        Ok(())
    }
}

impl Wal {
    /// [`Wal::close`] with a bound on the wait: refuses appends at once, then waits at most
    /// `timeout` for the sync thread to write and sync everything appended and exit. A disk
    /// that stopped answering then fails the call instead of hanging it.
    ///
    /// # Errors
    /// [`WalError::CloseTimedOut`] (with the last appended LSN and the durable one) if the
    /// sync thread was still busy after `timeout`: the log stays closing (appends are refused,
    /// reads work) and the thread goes on in the background. A later `close` joins it; the
    /// drop does not wait for it (it leaves the thread to finish alone). Otherwise as
    /// [`Wal::close`].
    pub fn close_timeout(&self, timeout: Duration) -> Result<(), WalError> {
        self.begin_close();
        // Called from the sync thread (a durability callback): it exits after this returns.
        if !self.on_sync_thread() {
            let deadline = Instant::now().checked_add(timeout);
            if let Err(error) = self.wait_for_writer_done(deadline, timeout) {
                self.close_timed_out.store(true, std::sync::atomic::Ordering::Relaxed);
                return Err(error);
            }
        }
        self.close()
    }

    /// Whether the calling thread is this log's sync thread.
    fn on_sync_thread(&self) -> bool {
        self.shared.sync_thread.get().is_some_and(|ids| ids.thread == std::thread::current().id())
    }

    /// Marks the log closing (appends are refused from now on) and wakes the sync thread and
    /// appenders waiting for space.
    fn begin_close(&self) {
        {
            let mut state = lock(&self.shared.append);
            state.closing = true;
        }
        self.shared.writer_cv.notify_all();
        self.shared.space_cv.notify_all();
        if lock(&self.writer).is_some() {
            self.shared.wake_ring();
        }
    }

    /// Waits until the sync thread is done (it signals `durable_cv`), so that joining it does
    /// not wait: until `deadline` if any (`timeout` is the caller's, for the error).
    fn wait_for_writer_done(
        &self,
        deadline: Option<Instant>,
        timeout: Duration,
    ) -> Result<(), WalError> {
        let shared = &*self.shared;
        let mut sync = lock(&shared.sync);
        while !sync.writer_done {
            let remaining = match deadline {
                None => None,
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(remaining) if !remaining.is_zero() => Some(remaining),
                    _ => {
                        return Err(WalError::CloseTimedOut {
                            appended: shared.appended_lsn.load(Ordering::Acquire),
                            durable: shared.durable_lsn.load(Ordering::Acquire),
                            timeout,
                        })
                    }
                },
            };
            sync = SyncState::wait_counted(sync, &shared.durable_cv, remaining, |sync| {
                &mut sync.durable_waiters
            });
        }
        Ok(())
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        let stuck = self.close_timed_out.load(std::sync::atomic::Ordering::Relaxed)
            && !lock(&self.shared.sync).writer_done;
        if stuck {
            // A bounded close gave up on this log's sync thread: do not wait for it here
            // either. It owns what it needs and finishes in the background (or never, if the
            // disk never answers); what it acknowledged was durable already.
            drop(lock(&self.writer).take());
            tracing::warn!(
                dir = %self.shared.dir.display(),
                "dropping a write-ahead log whose sync thread is still closing; not waiting"
            );
            return;
        }
        match self.close_timeout(self.shared.config.drop_close_timeout) {
            Ok(()) => {}
            // Dropped in a durability callback: the sync thread finishes once it returns.
            Err(error @ WalError::CloseOnSyncThread { .. }) => {
                tracing::debug!(%error, "write-ahead log dropped on its sync thread");
            }
            Err(error) => tracing::warn!(%error, "closing the write-ahead log on drop"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bound of a durability wait in these tests: far longer than a sync; a wait that has not
    /// returned by then is hung, and fails the test instead of hanging it.
    const WAIT: Duration = Duration::from_secs(30);

    #[test]
    fn the_log_is_send_and_sync_and_handles_are_archivable() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Wal>();
        let handle = RecordHandle { segment: SegmentId(3), offset: 4096, len: 17 };
        let bytes = crate::record::to_bytes(&handle).unwrap();
        let archived = crate::record::access::<RecordHandle>(&bytes).unwrap();
        assert_eq!(archived.to_native(), handle);
    }

    /// An iterator that reaches the end of what a segment had written while the segment is not
    /// sealed stops there instead of moving on to the next one: the sync thread may write the
    /// segment's tail and the next segment's first records between the iterator's two reads,
    /// and moving on would skip that tail. Simulated on a closed log of three segments by
    /// putting the first one back in its state before its tail was written.
    #[test]
    fn an_iterator_never_skips_the_tail_of_a_segment_still_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let config = WalConfig { segment_size_bytes: 4096, ..WalConfig::default() };
        let wal = Wal::open(dir.path(), config).unwrap();
        let mut last = Lsn::ZERO;
        while wal.shared.segments_snapshot().len() < 3 {
            last = wal.append_bytes(&[9u8; 300], 0).unwrap().0;
        }
        wal.wait_durable_timeout(last, WAIT).unwrap();
        let all: Vec<Lsn> = wal.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap().lsn).collect();
        assert_eq!(all, (1..=last.0).map(Lsn).collect::<Vec<_>>());
        let first = Arc::clone(&wal.shared.segments_snapshot()[0]);
        let written_end = first.end_offset.load(Ordering::Acquire);
        let tail_start = {
            let mut records = wal.iter_from(Lsn::ZERO).unwrap();
            let in_first = records
                .by_ref()
                .take_while(|r| r.as_ref().unwrap().handle.segment == first.header.id);
            let handles: Vec<RecordHandle> = in_first.map(|r| r.unwrap().handle).collect();
            handles.last().unwrap().offset
        };
        // The first segment as the sync thread left it before writing its last record.
        first.sealed.store(false, Ordering::Release);
        first.end_offset.store(tail_start, Ordering::Release);
        let mut iter = wal.iter_from(Lsn::ZERO).unwrap();
        let before: Vec<Lsn> = iter.by_ref().map(|r| r.unwrap().lsn).collect();
        let tail_lsn = before.len() as u64 + 1;
        assert_eq!(before, (1..tail_lsn).map(Lsn).collect::<Vec<_>>(), "stops at the tail");
        // The tail is written and the segment sealed: the same iterator goes on, in order.
        first.end_offset.store(written_end, Ordering::Release);
        first.sealed.store(true, Ordering::Release);
        let after: Vec<Lsn> = iter.map(|r| r.unwrap().lsn).collect();
        assert_eq!(after, (tail_lsn..=last.0).map(Lsn).collect::<Vec<_>>());
    }

    #[test]
    fn append_now_takes_the_time_of_the_injected_clock() {
        let dir = tempfile::tempdir().unwrap();
        let clock = crate::clock::ManualClock::new(12_345);
        let wal = Wal::open_with_clock(dir.path(), WalConfig::default(), Arc::new(clock.clone()))
            .unwrap();
        wal.append_bytes_now(b"a").unwrap();
        clock.advance_ms(5);
        let (lsn, _) = wal.append_now(&7u64).unwrap();
        wal.wait_durable_timeout(lsn, WAIT).unwrap();
        let times: Vec<i64> =
            wal.iter_from(Lsn::ZERO).unwrap().map(|record| record.unwrap().time_ms).collect();
        assert_eq!(times, vec![12_345, 12_350]);
    }

    #[test]
    fn records_larger_than_the_staging_limit_go_alone_and_the_limit_is_never_overrun() {
        let dir = tempfile::tempdir().unwrap();
        let durability =
            Durability::GroupCommit { max_delay: Duration::from_micros(200), max_bytes: 4096 };
        let limit = staging_limit(durability);
        let config = WalConfig { durability, ..WalConfig::default() };
        let wal = Wal::open(dir.path(), config).unwrap();
        let big = vec![7u8; limit + limit / 2];
        let mut payloads: Vec<Vec<u8>> = Vec::new();
        let mut last = Lsn::ZERO;
        for round in 0..3u8 {
            for small in 0..100u8 {
                payloads.push(vec![round ^ small; 64]);
            }
            payloads.push(big.clone());
        }
        for payload in &payloads {
            last = wal.append_bytes_now(payload).unwrap().0;
            let staged = lock(&wal.shared.append).buf.len();
            let big_frame = frame::frame_len(big.len()) as usize;
            assert!(staged <= big_frame.max(limit), "staged {staged} bytes, limit {limit}");
        }
        wal.wait_durable_timeout(last, WAIT).unwrap();
        let read: Vec<Vec<u8>> = wal
            .iter_from(Lsn::ZERO)
            .unwrap()
            .map(|record| record.unwrap().bytes.to_vec())
            .collect();
        assert_eq!(read, payloads);
    }

    #[test]
    fn an_appender_waiting_for_room_has_the_group_written_without_waiting_out_its_delay() {
        let dir = tempfile::tempdir().unwrap();
        // The limit equals the group size here (64 MiB), so a group can leave no room for a
        // frame before it is full; its delay is far longer than this test may take.
        let max_delay = Duration::from_secs(60);
        let durability = Durability::GroupCommit { max_delay, max_bytes: STAGING_LIMIT_BYTES };
        assert_eq!(staging_limit(durability), STAGING_LIMIT_BYTES);
        let config =
            WalConfig { durability, segment_size_bytes: 256 << 20, ..WalConfig::default() };
        let wal = Wal::open(dir.path(), config).unwrap();
        let mib = vec![3u8; 1 << 20];
        for _ in 0..63 {
            wal.append_bytes_now(&mib).unwrap();
        }
        let started = Instant::now();
        let (last, _) = wal.append_bytes_now(&vec![4u8; 2 << 20]).unwrap();
        let waited = started.elapsed();
        // Waiting out the delay would take all of it; writing 64 MiB takes well under half of
        // it even on a slow, shared disk.
        assert!(waited < max_delay / 2, "the appender waited {waited:?} for room");
        wal.close().unwrap();
        assert_eq!(wal.durable_lsn(), last);
    }

    /// Staging state with `staged` bytes in the buffer and nobody waiting.
    fn staging_with(staged: usize) -> AppendState {
        AppendState {
            next_lsn: 1,
            active: None,
            offset: SEGMENT_HEADER_LEN,
            next_segment_id: 0,
            buf: vec![0; staged],
            chunks: Vec::new(),
            group_started: None,
            writer_wait: WriterWait::Running,
            room_waiters: VecDeque::new(),
            next_room_ticket: 0,
            closing: false,
            appends: 0,
            bytes: 0,
        }
    }

    #[test]
    fn room_goes_to_waiters_first_come_first_served_and_newcomers_wait_behind_them() {
        let limit = 1000;
        let mut state = staging_with(900);
        assert!(!state.has_room(300, limit, None));
        let first = state.queue_room_waiter(300);
        let huge = state.queue_room_waiter(1500);
        // The group is swapped out.
        state.buf.clear();
        assert!(state.has_room(300, limit, Some(first)));
        assert!(!state.has_room(1500, limit, Some(huge)), "it is behind the first waiter");
        assert!(!state.has_room(10, limit, None), "a newcomer is behind both");
        state.remove_room_waiter(Some(first));
        state.buf.resize(300, 0);
        // A frame larger than the limit waits for an empty buffer, and newcomers wait for it.
        assert!(!state.has_room(1500, limit, Some(huge)));
        assert!(!state.has_room(10, limit, None));
        state.buf.clear();
        assert!(state.has_room(1500, limit, Some(huge)));
        state.remove_room_waiter(Some(huge));
        assert!(state.room_waiters.is_empty());
        assert!(state.has_room(10, limit, None));
    }

    #[test]
    fn a_waiter_for_a_small_frame_leaves_newcomers_the_rest_of_the_room() {
        let limit = 1000;
        let mut state = staging_with(950);
        let waiter = state.queue_room_waiter(100);
        assert!(!state.group_may_grow(usize::MAX), "a waiter makes the group due");
        state.buf.clear();
        assert!(state.has_room(900, limit, None));
        assert!(!state.has_room(901, limit, None));
        state.buf.resize(900, 0);
        assert!(state.has_room(100, limit, Some(waiter)));
    }

    /// A file layer whose writes wait until the test opens its gate (no descriptor, so the
    /// io_uring engine writes through `write_at` too).
    #[derive(Debug, Default)]
    struct GatedStorage {
        gate: Arc<Gate>,
    }

    /// Longest a write waits at a closed gate: far longer than any test holds it (2.5 s).
    const GATE_BOUND: Duration = Duration::from_secs(60);

    #[derive(Debug, Default)]
    struct Gate {
        open: Mutex<bool>,
        opened: Condvar,
        writers_held: AtomicU64,
    }

    #[derive(Debug)]
    struct GatedFile {
        inner: Arc<dyn StorageFile>,
        gate: Arc<Gate>,
    }

    impl Storage for GatedStorage {
        fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
            FileStorage.create_dir_all(dir)
        }
        fn create(&self, path: &Path) -> std::io::Result<Arc<dyn StorageFile>> {
            let inner = FileStorage.create(path)?;
            Ok(Arc::new(GatedFile { inner, gate: Arc::clone(&self.gate) }))
        }
        fn open_existing(&self, path: &Path) -> std::io::Result<Arc<dyn StorageFile>> {
            FileStorage.open_existing(path)
        }
        fn remove(&self, path: &Path) -> std::io::Result<()> {
            FileStorage.remove(path)
        }
        fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
            FileStorage.rename(from, to)
        }
        fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
            FileStorage.sync_dir(dir)
        }
    }

    impl StorageFile for GatedFile {
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<usize> {
            let mut open = lock(&self.gate.open);
            if !*open {
                self.gate.writers_held.fetch_add(1, Ordering::SeqCst);
                // Bounded: a test that fails before it opens the gate would otherwise leave the
                // sync thread here for good, and the log's drop (which joins it) would hang it.
                open =
                    self.gate.opened.wait_timeout_while(open, GATE_BOUND, |open| !*open).unwrap().0;
            }
            drop(open);
            self.inner.write_at(buf, offset)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.inner.sync_data()
        }
        fn allocate(&self, len: u64) -> std::io::Result<()> {
            self.inner.allocate(len)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.inner.set_len(len)
        }
        fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
            None
        }
    }

    /// Polls `condition` every millisecond for at most 10 s.
    fn eventually(what: &str, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting for: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_newcomer_does_not_take_the_room_a_waiting_large_frame_needs() {
        let dir = tempfile::tempdir().unwrap();
        let durability =
            Durability::GroupCommit { max_delay: Duration::from_millis(1), max_bytes: 4096 };
        let limit = staging_limit(durability);
        let storage = Arc::new(GatedStorage::default());
        let gate = Arc::clone(&storage.gate);
        let options = WalOptions { storage, ..WalOptions::default() };
        let config = WalConfig { durability, ..WalConfig::default() };
        let wal = Arc::new(Wal::open_with_options(dir.path(), config, options).unwrap());
        // A full group: the sync thread takes it and is held at the gate.
        wal.append_bytes_now(&[1u8; 4096]).unwrap();
        eventually("the sync thread is held", || gate.writers_held.load(Ordering::SeqCst) > 0);
        // Staged while the sync thread is held: a small frame, then a frame that only fits in
        // an empty buffer, whose appender waits.
        wal.append_bytes_now(&[2u8; 64]).unwrap();
        let big = vec![3u8; limit - 64];
        // Plain threads, not scoped ones: a scope joins its threads even when the test fails,
        // so an appender whose wait for room never ends would hang the test instead of
        // failing it.
        let big_appender = {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || wal.append_bytes_now(&big).unwrap().0)
        };
        eventually("the large frame waits", || lock(&wal.shared.append).room_waiters.len() == 1);
        // A newcomer whose frame would still fit beside the staged one waits behind it.
        let small_appender = {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || wal.append_bytes_now(&[4u8; 64]).unwrap().0)
        };
        eventually("the newcomer waits or is done", || {
            small_appender.is_finished() || lock(&wal.shared.append).room_waiters.len() == 2
        });
        *lock(&gate.open) = true;
        gate.opened.notify_all();
        // Joined once done (bounded): their waits for room end once the held group is written.
        eventually("both appenders are done", || {
            big_appender.is_finished() && small_appender.is_finished()
        });
        let (big_lsn, small_lsn) = (big_appender.join().unwrap(), small_appender.join().unwrap());
        assert!(
            big_lsn < small_lsn,
            "the newcomer ({small_lsn:?}) went before the waiter ({big_lsn:?})"
        );
        wal.wait_durable_timeout(small_lsn, WAIT).unwrap();
        let sizes: Vec<usize> =
            wal.iter_from(Lsn::ZERO).unwrap().map(|record| record.unwrap().bytes.len()).collect();
        assert_eq!(sizes, vec![4096, 64, limit - 64, 64]);
    }

    #[test]
    fn a_lone_appender_that_waits_for_each_record_is_never_paced() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), WalConfig::default()).unwrap();
        for value in 0..30u64 {
            let (lsn, _) = wal.append_now(&value).unwrap();
            wal.wait_durable_timeout(lsn, WAIT).unwrap();
        }
        let stats = wal.stats();
        assert_eq!(stats.groups, 30);
        assert_eq!(stats.paced_groups, 0, "each record was appended after the previous sync");
    }

    #[test]
    fn a_stream_nobody_waits_for_is_paced_and_still_all_made_durable() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), WalConfig::default()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = Lsn::ZERO;
        let mut appended = 0u64;
        // Appends keep arriving while the syncs run: sustained load, and nobody waits. At
        // least five groups, and on until one was paced (a group whose first record a
        // preempted appender made only after the previous sync completed is not).
        while wal.stats().groups < 5 || wal.stats().paced_groups == 0 {
            assert!(
                Instant::now() < deadline,
                "no paced group among the groups written in 20 s: {:?}",
                wal.stats()
            );
            for _ in 0..100 {
                last = wal.append_now(&appended).unwrap().0;
                appended += 1;
            }
        }
        wal.wait_durable_timeout(last, WAIT).unwrap();
        let stats = wal.stats();
        assert!(stats.paced_groups > 0, "no group was paced: {stats:?}");
        let read: Vec<u64> = wal
            .iter_from(Lsn::ZERO)
            .unwrap()
            .map(|record| {
                let record = record.unwrap();
                u64::from_le_bytes(record.bytes[..8].try_into().unwrap())
            })
            .collect();
        assert_eq!(read, (0..appended).collect::<Vec<_>>());
    }

    /// How long the first group's sync is held: the pause is four times that.
    const PACED_SYNC: Duration = Duration::from_millis(2500);
    /// What ends a 10 s pause early must do it within this.
    const PAUSE_ENDED_WITHIN: Duration = Duration::from_secs(5);

    /// A log (on a gated file layer) whose second group, a small record appended while the
    /// first group's slow sync ran, is held for pacing: 10 s after that sync (4x its 2.5 s, at
    /// most 10 x `max_delay` = 10 s). The tests below give what ends the pause early 5 s:
    /// wide margins both ways, so neither a slow machine nor a descheduled test thread can
    /// make a held group pass or a released one fail. Returns the log, its directory, and the
    /// LSNs of the durable first record and the held one.
    fn log_with_a_paced_group() -> (Wal, tempfile::TempDir, Lsn, Lsn) {
        let dir = tempfile::tempdir().unwrap();
        let durability =
            Durability::GroupCommit { max_delay: Duration::from_secs(1), max_bytes: 4096 };
        let storage = Arc::new(GatedStorage::default());
        let gate = Arc::clone(&storage.gate);
        let options = WalOptions { storage, ..WalOptions::default() };
        let config = WalConfig { durability, ..WalConfig::default() };
        let wal = Wal::open_with_options(dir.path(), config, options).unwrap();
        // A full group, taken at once and held at the gate: a slow sync.
        let (full, _) = wal.append_bytes_now(&[1u8; 4096]).unwrap();
        eventually("the sync thread is held", || gate.writers_held.load(Ordering::SeqCst) > 0);
        // Appended while that sync runs, and nobody waits for it.
        let (small, _) = wal.append_bytes_now(&[2u8; 64]).unwrap();
        // Makes the held group's write take 2.5 s, so the pause after it is 10 s (this sleep
        // makes the slow sync; it waits for no result).
        std::thread::sleep(PACED_SYNC);
        *lock(&gate.open) = true;
        gate.opened.notify_all();
        eventually("the small group is held for pacing", || {
            lock(&wal.shared.append).writer_wait == WriterWait::Paced
        });
        assert_eq!(wal.durable_lsn(), full);
        (wal, dir, full, small)
    }

    /// Polls (without waiting on the log, which would end the pause) until `lsn` is durable,
    /// at most `bound`.
    fn durable_within(wal: &Wal, lsn: Lsn, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        while wal.durable_lsn() < lsn {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn a_waiter_ends_the_pause_of_a_paced_group() {
        let (wal, _dir, _, small) = log_with_a_paced_group();
        // Well inside the 10 s pause: only the waiter's wake-up can make it durable in time.
        wal.wait_durable_timeout(small, PAUSE_ENDED_WITHIN).unwrap();
        assert_eq!(wal.stats().paced_groups, 1);
    }

    #[test]
    fn a_group_that_fills_up_is_not_held_by_pacing() {
        let (wal, _dir, _, _) = log_with_a_paced_group();
        // Fills the held group past `max_bytes` (4096).
        let (last, _) = wal.append_bytes_now(&[3u8; 4096]).unwrap();
        assert!(durable_within(&wal, last, PAUSE_ENDED_WITHIN), "the full group waited");
    }

    #[test]
    fn closing_does_not_wait_out_a_pause() {
        let (wal, _dir, _, small) = log_with_a_paced_group();
        let wal = Arc::new(wal);
        let (closed_tx, closed_rx) = std::sync::mpsc::channel();
        {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || {
                let started = Instant::now();
                let closed = wal.close();
                let _ = closed_tx.send((closed, started.elapsed()));
            });
        }
        // Bounded: a close that hung would otherwise hang the test.
        let (closed, took) = closed_rx.recv_timeout(Duration::from_secs(60)).expect("close hung");
        closed.unwrap();
        assert!(took < PAUSE_ENDED_WITHIN, "close took {took:?}");
        assert_eq!(wal.durable_lsn(), small);
    }

    #[test]
    fn config_validation_names_the_setting() {
        let config = WalConfig { segment_size_bytes: 100, ..WalConfig::default() };
        assert!(matches!(
            config.validate(),
            Err(WalError::InvalidConfig { setting: "segment_size_bytes", .. })
        ));
        assert!(WalConfig::default().validate().is_ok());
    }

    #[test]
    fn a_handle_offset_near_the_end_of_the_address_space_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), WalConfig::default()).unwrap();
        let (lsn, handle) = wal.append_bytes(b"record", 1).unwrap();
        wal.wait_durable_timeout(lsn, Duration::from_secs(30)).unwrap();
        // 16-aligned and past the segment header: only the addition of the frame header
        // overflows (it panicked in debug builds, and wrapped in release ones).
        let forged = RecordHandle { offset: !15u64, ..handle };
        match wal.read_bytes(forged) {
            Err(WalError::NotFound { offset, reason, .. }) => {
                assert_eq!(offset, forged.offset);
                assert_eq!(reason, "offset is not a record boundary");
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
        assert_eq!(&*wal.read_bytes(handle).unwrap(), b"record");
    }

    #[test]
    fn a_group_commit_delay_too_long_for_the_clock_is_refused_at_open() {
        let with_delay = |max_delay| WalConfig {
            durability: Durability::GroupCommit { max_delay, max_bytes: 1 << 20 },
            ..WalConfig::default()
        };
        let dir = tempfile::tempdir().unwrap();
        // Before the bound, the sync thread panicked adding this delay to the group's start.
        match Wal::open(dir.path(), with_delay(Duration::MAX)) {
            Err(WalError::InvalidConfig { setting: "durability.max_delay", value, .. }) => {
                assert_eq!(value, format!("{:?}", Duration::MAX));
            }
            other => panic!("expected InvalidConfig for max_delay, got {other:?}"),
        }
        assert!(with_delay(MAX_GROUP_COMMIT_DELAY).validate().is_ok());
        assert!(with_delay(MAX_GROUP_COMMIT_DELAY + Duration::from_nanos(1)).validate().is_err());
    }

    #[test]
    fn open_on_a_missing_directory_creates_nothing_until_a_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wal");
        let wal = Wal::open(&path, WalConfig::default()).unwrap();
        assert!(!path.exists());
        wal.close().unwrap();
        assert!(!path.exists());
        let wal = Wal::open(&path, WalConfig::default()).unwrap();
        let (lsn, _) = wal.append_bytes(b"x", 1).unwrap();
        wal.wait_durable_timeout(lsn, WAIT).unwrap();
        assert!(path.exists());
    }

    /// The real file system, recording the directories it syncs and refusing to remove the
    /// file named in `refuse_remove`.
    #[derive(Debug, Default)]
    struct ObservedStorage {
        synced_dirs: Mutex<Vec<PathBuf>>,
        refuse_remove: Mutex<Option<PathBuf>>,
    }

    impl Storage for ObservedStorage {
        fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
            FileStorage.create_dir_all(dir)
        }
        fn create(&self, path: &Path) -> std::io::Result<Arc<dyn StorageFile>> {
            FileStorage.create(path)
        }
        fn open_existing(&self, path: &Path) -> std::io::Result<Arc<dyn StorageFile>> {
            FileStorage.open_existing(path)
        }
        fn remove(&self, path: &Path) -> std::io::Result<()> {
            if lock(&self.refuse_remove).as_deref() == Some(path) {
                return Err(std::io::ErrorKind::PermissionDenied.into());
            }
            FileStorage.remove(path)
        }
        fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
            FileStorage.rename(from, to)
        }
        fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
            lock(&self.synced_dirs).push(dir.to_path_buf());
            FileStorage.sync_dir(dir)
        }
    }

    /// A log whose directory is created with missing parents (a receiver's data log under
    /// `<checkpoint>/receivedData/<stream>`) makes every new directory entry durable, not only
    /// its own, before its first record is durable.
    #[test]
    fn every_directory_a_log_creates_has_its_entry_synced() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("checkpoint").join("receivedData").join("7");
        let storage = Arc::new(ObservedStorage::default());
        let options = WalOptions { storage: Arc::clone(&storage) as _, ..WalOptions::default() };
        let wal = Wal::open_with_options(&dir, WalConfig::default(), options).unwrap();
        let (lsn, _) = wal.append_bytes(b"x", 1).unwrap();
        wal.wait_durable_timeout(lsn, WAIT).unwrap();
        let synced = lock(&storage.synced_dirs).clone();
        let checkpoint = root.path().join("checkpoint");
        for entry_holder in
            [root.path().to_path_buf(), checkpoint.clone(), checkpoint.join("receivedData"), dir]
        {
            assert!(synced.contains(&entry_holder), "{entry_holder:?} not synced: {synced:?}");
        }
    }

    /// A segment that cannot be deleted stops cleaning there, in this clean and later ones:
    /// deleting the segments after it would leave an LSN gap on disk, and the next open would
    /// fail as corrupt. That open finds the kept segments in order.
    #[test]
    fn a_segment_that_cannot_be_deleted_stops_cleaning_so_no_gap_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let storage = Arc::new(ObservedStorage::default());
        let options = WalOptions {
            storage: Arc::clone(&storage) as _,
            spare_segments: 0,
            ..WalOptions::default()
        };
        let config = WalConfig { segment_size_bytes: 4096, ..WalConfig::default() };
        let wal = Wal::open_with_options(dir.path(), config.clone(), options).unwrap();
        let appended: Vec<_> = (0..150u8)
            .map(|index| wal.append_bytes(&[index; 100], i64::from(index)).unwrap())
            .collect();
        wal.wait_durable_timeout(appended.last().unwrap().0, WAIT).unwrap();
        let segments: Vec<SegmentId> =
            wal.shared.segments_snapshot().iter().map(|segment| segment.header.id).collect();
        assert!(segments.len() >= 5, "{segments:?}");
        *lock(&storage.refuse_remove) = Some(dir.path().join(segment::file_name(segments[1])));

        // Times are the record indices, 28 records a segment: below 100, the first three.
        let first = wal.clean(100, true).unwrap();
        assert_eq!(first.deleted, [segments[0]], "the segments before the stuck one go");
        let failed: Vec<SegmentId> = first.failed.iter().map(|(id, _)| *id).collect();
        assert_eq!(failed, segments[1..3], "the stuck one, and the one after it is kept");
        let second = wal.clean(i64::MAX, true).unwrap();
        assert!(second.deleted.is_empty(), "no later segment is deleted: {second:?}");
        assert!(!second.failed.is_empty());
        drop(wal);

        let reopened = Wal::open(dir.path(), config).unwrap();
        let lsns: Vec<u64> =
            reopened.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap().lsn.0).collect();
        assert_eq!(lsns.last(), Some(&appended.last().unwrap().0 .0));
        assert!(lsns.windows(2).all(|pair| pair[1] == pair[0] + 1), "no gap: {lsns:?}");
    }

    /// A ring that breaks under load (`io_uring_enter` fails with `EBADR`, as when the kernel
    /// lost a completion) fails the log with that error, on the sync thread's pipelined path
    /// (group commit) and on a waiting appender's serial one (every record, where an
    /// appender's `wait_durable` leads): no panic and no hang, and every record acknowledged
    /// durable before it is there on reopening.
    #[cfg(not(loom))]
    #[test]
    fn a_broken_ring_fails_the_log_with_its_error_and_keeps_what_was_acknowledged() {
        if writer::uring::tests::engine_if_available().is_none() {
            return;
        }
        let group_commit =
            Durability::GroupCommit { max_delay: Duration::from_micros(200), max_bytes: 4096 };
        for durability in [group_commit, Durability::EveryRecord] {
            let dir = tempfile::tempdir().unwrap();
            let config = WalConfig { durability, ..WalConfig::default() };
            // The 100th entry into the kernel breaks the ring. Until an appender's wait has
            // led once, appends wake the sync thread, which may take the first groups itself
            // on a loaded machine (a break at the 10th entry once came before any lead).
            writer::uring::BREAK_RING.with(|at| at.set(Some((100, libc::EBADR))));
            let wal = Wal::open(dir.path(), config.clone()).unwrap();
            assert_eq!(wal.io_path(), IoPath::IoUring);
            // `wait_durable` has no bound of its own (a bound would keep it from leading): the
            // appender runs on a thread of its own, and the test waits for it at most `WAIT`.
            let (done, finished) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut acknowledged = Vec::new();
                let failure = (0..1000i64).find_map(|time| {
                    let appended = wal.append_bytes(&time.to_le_bytes(), time);
                    let result = appended.and_then(|(lsn, _)| {
                        wal.wait_durable(lsn).map(|()| acknowledged.push(lsn))
                    });
                    result.err()
                });
                let _ = done.send((wal, acknowledged, failure));
            });
            let (wal, acknowledged, failure) =
                finished.recv_timeout(WAIT).expect("the appender finished (no hang, no panic)");
            if durability == Durability::EveryRecord {
                assert!(wal.stats().led_groups > 0, "the appender's waits led");
            }
            let failure = failure.expect("the ring broke within 1000 appends");
            match failure.root_cause() {
                WalError::Io { op: "io_uring_enter", message, .. } => {
                    let ebadr = std::io::Error::from_raw_os_error(libc::EBADR).to_string();
                    assert!(message.contains(&ebadr), "{message}");
                }
                other => panic!("{durability:?}: expected the ring's error, got {other}"),
            }
            assert!(wal.append_bytes(b"after", 0).is_err(), "the log is failed for good");
            assert!(wal.close_timeout(WAIT).is_err(), "close reports the failure");
            drop(wal);

            let reopened = Wal::open(dir.path(), config).unwrap();
            let lsns: std::collections::BTreeSet<Lsn> =
                reopened.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap().lsn).collect();
            let lost: Vec<&Lsn> = acknowledged.iter().filter(|lsn| !lsns.contains(lsn)).collect();
            assert!(lost.is_empty(), "{durability:?}: acknowledged and lost: {lost:?}");
        }
    }

    /// The nice value of this process's thread `tid` (`/proc`, field 19 of `stat`).
    #[cfg(not(loom))]
    fn nice_of_thread(tid: i32) -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        // Fields from the third (state) on: the nice value is the 19th field.
        after_name.split(' ').nth(19 - 3).unwrap().parse().unwrap()
    }

    /// The sync thread lowers its own CPU priority by `sync_thread_nice` (from the opener's,
    /// capped at 19) before its first turn: once a record is durable it has. 0 leaves it; a
    /// value past the range is a typed error.
    #[cfg(not(loom))]
    #[test]
    fn the_sync_thread_runs_at_a_lower_priority_by_the_nice_asked() {
        let opener = rustix::process::getpriority_process(None).unwrap();
        for (nice, expected) in [(0u8, opener), (3, (opener + 3).min(19)), (39, 19)] {
            let dir = tempfile::tempdir().unwrap();
            let options = WalOptions { sync_thread_nice: nice, ..WalOptions::default() };
            let wal = Wal::open_with_options(dir.path(), WalConfig::default(), options).unwrap();
            let (lsn, _) = wal.append_bytes(b"one", 1).unwrap();
            wal.wait_durable_timeout(lsn, WAIT).unwrap();
            let sync_thread = wal.shared.sync_thread.get().copied().expect("the sync thread ran");
            assert_eq!(nice_of_thread(sync_thread.kernel_tid), expected, "nice {nice}");
        }
        let options = WalOptions { sync_thread_nice: 40, ..WalOptions::default() };
        let dir = tempfile::tempdir().unwrap();
        match Wal::open_with_options(dir.path(), WalConfig::default(), options) {
            Err(WalError::InvalidConfig { setting: "sync_thread_nice", value, .. }) => {
                assert_eq!(value, "40");
            }
            other => panic!("expected a typed error, got {:?}", other.map(|_| ())),
        }
        assert_eq!(WalOptions::default().sync_thread_nice, DEFAULT_SYNC_THREAD_NICE);
    }

    /// The cores thread `tid` of this process may run on (`/proc`, `Cpus_allowed_list`).
    #[cfg(not(loom))]
    pub(crate) fn cores_of_thread(tid: &str) -> String {
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        let line = status.lines().find(|line| line.starts_with("Cpus_allowed_list:")).unwrap();
        line["Cpus_allowed_list:".len()..].trim().to_string()
    }

    /// The io_uring kernel workers of thread `tid` of this process (io-wq names a thread's
    /// workers after it: `iou-wrk-<tid>`), as task ids. `None` when none is named after `tid`
    /// but some worker is named after an id that is no task here: inside a PID namespace the
    /// names carry the initial namespace's ids, and the workers cannot be told apart.
    #[cfg(not(loom))]
    pub(crate) fn ring_workers_of_thread(tid: &str) -> Option<Vec<String>> {
        let tasks: Vec<(String, String)> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .map(|task| task.unwrap().file_name().into_string().unwrap())
            .filter_map(|task| {
                let comm = std::fs::read_to_string(format!("/proc/self/task/{task}/comm")).ok()?;
                Some((task, comm.trim().to_string()))
            })
            .collect();
        let owners = tasks.iter().filter_map(|(_, comm)| comm.strip_prefix("iou-wrk-"));
        let named_elsewhere =
            owners.clone().any(|owner| !tasks.iter().any(|(task, _)| task == owner));
        let workers: Vec<String> = tasks
            .iter()
            .filter(|(_, comm)| comm.strip_prefix("iou-wrk-") == Some(tid))
            .map(|(task, _)| task.clone())
            .collect();
        (!workers.is_empty() || !named_elsewhere).then_some(workers)
    }

    /// The sync thread, and the io_uring workers that run its writes and syncs, run only on
    /// the `io_cores` asked, on either I/O path; a core id no CPU set can name is a typed
    /// error.
    #[cfg(not(loom))]
    #[test]
    fn the_sync_thread_and_its_ring_workers_run_on_the_io_cores_asked() {
        // The last core this thread may use: on a machine of more than one, narrower than
        // what the sync thread would inherit.
        let core = core_affinity::get_core_ids().unwrap().last().unwrap().id;
        for io in [IoMode::Auto, IoMode::Pwrite] {
            let dir = tempfile::tempdir().unwrap();
            let options = WalOptions { io, io_cores: vec![core], ..WalOptions::default() };
            let wal = Wal::open_with_options(dir.path(), WalConfig::default(), options).unwrap();
            for record in 0..4u8 {
                let (lsn, _) = wal.append_bytes(&[record; 100], 1).unwrap();
                wal.wait_durable_timeout(lsn, WAIT).unwrap();
            }
            let sync_thread = wal.shared.sync_thread.get().copied().expect("the sync thread ran");
            let tid = sync_thread.kernel_tid.to_string();
            assert_eq!(cores_of_thread(&tid), core.to_string(), "{io:?}: the sync thread");
            // The ring's syncs run on kernel workers.
            let Some(workers) = ring_workers_of_thread(&tid) else {
                eprintln!("io_uring workers carry another PID namespace's ids; not checked");
                continue;
            };
            if wal.io_path() == IoPath::IoUring {
                assert!(
                    !workers.is_empty(),
                    "the ring's syncs ran on no worker of the sync thread"
                );
                // Since Linux 6.2 they would take the sync thread's cores anyway: the
                // registration itself must have worked.
                assert_eq!(wal.shared.workers_confined.get(), Some(&true));
            }
            for worker in &workers {
                assert_eq!(cores_of_thread(worker), core.to_string(), "{io:?}: a ring worker");
            }
        }
        // A core that can be named but is not there: refused by the system, so the thread
        // runs where the opener may (logged), and the log works.
        let dir = tempfile::tempdir().unwrap();
        let options = WalOptions { io_cores: vec![CORE_ID_LIMIT - 1], ..WalOptions::default() };
        let wal = Wal::open_with_options(dir.path(), WalConfig::default(), options).unwrap();
        let (lsn, _) = wal.append_bytes(b"one", 1).unwrap();
        wal.wait_durable_timeout(lsn, WAIT).unwrap();
        let sync_thread = wal.shared.sync_thread.get().copied().expect("the sync thread ran");
        let opener = rustix::thread::gettid().as_raw_nonzero().to_string();
        assert_eq!(cores_of_thread(&sync_thread.kernel_tid.to_string()), cores_of_thread(&opener));
        let dir = tempfile::tempdir().unwrap();
        let options = WalOptions { io_cores: vec![0, CORE_ID_LIMIT], ..WalOptions::default() };
        match Wal::open_with_options(dir.path(), WalConfig::default(), options) {
            Err(WalError::InvalidConfig { setting: "io_cores", value, .. }) => {
                assert_eq!(value, CORE_ID_LIMIT.to_string());
            }
            other => panic!("expected a typed error, got {:?}", other.map(|_| ())),
        }
        assert!(WalOptions::default().io_cores.is_empty());
    }

    /// A read-only log writes nothing, so it sets up no ring, whatever `io` asks: it opens
    /// with `IoMode::IoUring` even where the kernel lacks what the engine needs (pretended),
    /// and the pretence is left for the next ring set up on this thread.
    #[cfg(not(loom))]
    #[test]
    fn a_read_only_log_sets_up_no_ring() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), WalConfig::default()).unwrap();
        let (lsn, _) = wal.append_bytes(b"one", 1).unwrap();
        wal.wait_durable_timeout(lsn, WAIT).unwrap();
        drop(wal);
        writer::uring::PRETEND_MISSING.with(|pretend| pretend.set(true));
        let options = WalOptions { io: IoMode::IoUring, read_only: true, ..WalOptions::default() };
        let read_only = Wal::open_with_options(dir.path(), WalConfig::default(), options).unwrap();
        assert_eq!(read_only.io_path(), IoPath::Pwrite);
        assert_eq!(read_only.iter_from(Lsn::ZERO).unwrap().count(), 1);
        let untouched = writer::uring::PRETEND_MISSING.with(std::cell::Cell::take);
        assert!(untouched, "a ring was set up");
    }

    /// A kernel that sets up a ring but lacks something the engine uses: `IoMode::Auto`
    /// writes with pwrite (and works), `IoMode::IoUring` is a typed setup error naming what is
    /// missing. (Skipped where the kernel refuses io_uring outright.)
    #[cfg(not(loom))]
    #[test]
    fn a_ring_missing_a_feature_falls_back_to_pwrite_under_auto() {
        if writer::uring::tests::engine_if_available().is_none() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        writer::uring::PRETEND_MISSING.with(|pretend| pretend.set(true));
        let wal = Wal::open(dir.path(), WalConfig::default()).unwrap();
        assert_eq!(wal.io_path(), IoPath::Pwrite);
        let (lsn, _) = wal.append_bytes(b"written with pwrite", 1).unwrap();
        wal.wait_durable_timeout(lsn, WAIT).unwrap();
        drop(wal);

        writer::uring::PRETEND_MISSING.with(|pretend| pretend.set(true));
        let options = WalOptions { io: IoMode::IoUring, ..WalOptions::default() };
        match Wal::open_with_options(dir.path(), WalConfig::default(), options) {
            Err(WalError::Io { op: "io_uring setup", kind, message, .. }) => {
                assert_eq!(kind, std::io::ErrorKind::Unsupported);
                assert!(message.contains("io_uring without"), "{message}");
            }
            other => panic!("expected the setup error, got {other:?}"),
        }
        // Without the pretence, the same kernel's ring is taken.
        let wal = Wal::open(dir.path(), WalConfig::default()).unwrap();
        assert_eq!(wal.io_path(), IoPath::IoUring);
        let records: Vec<Vec<u8>> = wal
            .iter_from(Lsn::ZERO)
            .unwrap()
            .map(|record| record.unwrap().bytes.to_vec())
            .collect();
        assert_eq!(records, [b"written with pwrite".to_vec()]);
    }
}
