//! The io_uring write path: groups pipelined on one ring, writes in parallel.
//!
//! A group's bytes are cut into writes of at most [`WRITE_CHUNK_BYTES`], pushed to the
//! submission queue with no links between them (ANCHORS: chaining the writes with IO_LINK
//! serializes them and runs at a third of the speed).
//!
//! Pipelined (the normal case, driven by the sync thread's `run_pipelined`): a group's writes
//! are submitted at once, without waiting for earlier groups; their completions are reaped in
//! any order and applied in LSN order (`take_events`). One `fdatasync` at a time is on the
//! ring, submitted only after the writes of every group it covers completed, covering all of
//! them (or, for a group alone on the ring with one write, linked behind that write); while
//! it runs, later groups' writes proceed. See the `wal` module doc, "Pipelined
//! group commit". Every buffer the kernel reads stays owned by the engine until its write's
//! completion was reaped, and `Drop` waits for every entry in flight.
//!
//! A broken ring: `io_uring_enter` itself fails with an error other than a timeout, a signal
//! or "busy, retry" (`EBADR` when the kernel lost a completion, `ENOMEM`, ...). The engine then
//! never enters that ring again, since a lost completion would leave an entry counted in flight
//! for good and any wait for it would hang. It fails the log with that error
//! (`WalError::Io { op: "io_uring_enter" }`, reported like a failed write) and leaks what the
//! kernel may still use: the buffers of the pipelined groups still on the ring, and their files
//! (a request may look its descriptor up only when it runs, so the descriptor must not be
//! closed and its number reused). A serial write (`write_and_sync`) returns the error, and its
//! caller leaks the buffer and the file it passed ([`IoEngine::is_broken`]).
//!
//! One group at a time (`write_and_sync`: the first group of a segment, rolls, seals at
//! close, a leader's groups, and the unit tests): the writes are followed by one `fdatasync`,
//! linked behind the write if the last batch of entries is a single write (`IO_LINK`), else
//! flagged `IO_DRAIN`, so the kernel starts the sync only after every earlier write
//! completed, and one `io_uring_enter` submits the lot and waits for all completions.
//!
//! The kernel may take only a prefix of the queue in one `io_uring_enter` (it stops at a
//! request it cannot allocate), and a link does not span submissions. So a linked sync still
//! in the queue after its enter counts for nothing (`SyncInFlight::cut_from_write`): the
//! pipelined path voids it, and `write_and_sync` syncs again.
//!
//! On both, a short write (or one that was interrupted or would block: `EINTR`, `EAGAIN`) is
//! finished with `pwrite` afterwards and synced again (or before the covering sync is
//! submitted), so the durability claim never rests on a sync that ran before all bytes were
//! written; any other failed write or sync fails the log.
//!
//! Fault injection: before each write or sync entry the file's `StorageFile::ring_fault` is
//! asked; an injected errno replaces the entry with a no-op whose completion carries it, an
//! injected short write submits fewer bytes. The completion handling is the live code. Each
//! reaped completion is reported to `StorageFile::ring_completed` (with the injected result,
//! if any), so a test can model what a power loss keeps. Neither hook may unwind through the
//! engine: entries in flight borrow buffers that an unwind would free while the kernel still
//! reads them, and completions taken off the ring but not yet counted would be lost (a later
//! drain would wait for them forever). So a hook that panics counts as its operation failing
//! with `EIO` (the log fails), and the panic is logged ([`hook_or_eio`]).
//!
//! By default every group goes through the ring. As an opt-in tuning, a group that is a single
//! write of at most `WalOptions::uring_direct_max_bytes` (typical of `EveryRecord` and of light
//! load) can be written with `pwrite` and synced with `fdatasync` directly: with nothing to
//! overlap, the ring only adds a hop to the kernel worker thread that executes the sync.
//! [`DIRECT_GROUP_BYTES`] is the size measured to pay off here.
//!
//! This module also holds the writer's other system-call glue (`posix_fallocate`, the wake
//! pipe's `O_NONBLOCK`); it is one of the three modules allowed to use `unsafe` (STYLE.md).

#![allow(unsafe_code)]

use std::{
    collections::VecDeque,
    io::{PipeReader, PipeWriter, Read},
    os::fd::{AsRawFd, RawFd},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use io_uring::{opcode, squeue, types, IoUring};

use crate::{
    error::WalError,
    wal::{
        storage::{RingFault, RingOp, StorageFile},
        writer::{
            pwrite::{sync_file, write_all_at},
            GroupSummary, IoEngine, RingEvent, RingGroup, SyncTarget, WriteOp,
        },
        IoPath,
    },
};

/// Largest single write submitted: 64 KiB. ANCHORS measured 1 MiB writes fastest on an idle
/// machine, but on a kernel without preemption (`PREEMPT_NONE`, this machine class's) the
/// kernel worker that copies a write into the page cache keeps its core until that write is
/// done: up to 5.5 ms for 1 MiB into new page-cache pages, while the threads that share the
/// core (an epoch run's producers) wait, and the appender they feed runs dry. Shorter writes
/// shorten those waits (the producer's mean wait for its core: 0.14-0.17 ms with 1 MiB
/// writes, 0.069 ms with 64 KiB): the durable epoch run gained 10%, and the `wal` workload's
/// group commit of 256-byte records 1.3-3x. The cost: a group of more than one write no
/// longer gets its sync linked behind its write (`submit_group`); `EveryRecord` with 256 KiB
/// records lost nothing to that (PERF.md, "Forty-third session").
pub const WRITE_CHUNK_BYTES: usize = 64 << 10;
/// A good value for the opt-in `WalOptions::uring_direct_max_bytes`: groups of one write up to
/// this size are then written and synced with plain system calls.
pub const DIRECT_GROUP_BYTES: usize = 64 << 10;
/// Most groups on the ring at once (pipelining depth): their chunk lists stay until durable,
/// their buffers until written. When it is reached, the sync thread waits for I/O and the
/// staging buffer keeps filling (appenders wait only when it is full).
pub(crate) const GROUPS_IN_FLIGHT_MAX: usize = 8;
const RING_ENTRIES: u32 = 128;
/// The sync of the one-group-at-a-time path (`write_and_sync`).
const SYNC_USER_DATA: u64 = u64::MAX;
/// The poll on the wake pipe.
const WAKE_USER_DATA: u64 = u64::MAX - 1;
/// The no-op that gives the sync thread its io-wq (`confine_workers`).
const NO_OP_USER_DATA: u64 = u64::MAX - 2;
/// How many times `submit_no_op` enters the ring before giving up (each enter waits for a
/// completion; only an interrupted or refused enter comes back without one).
const NO_OP_ATTEMPTS: usize = 100;
/// Pipelined entries carry `seq << SEQ_SHIFT | code`: the group's sequence number and what the
/// entry is (a write's piece index, or `CODE_SYNC`).
const SEQ_SHIFT: u32 = 20;
const CODE_MASK: u64 = (1 << SEQ_SHIFT) - 1;
/// The `fdatasync` covering every group up to `seq`.
const CODE_SYNC: u64 = CODE_MASK;

/// Writes and syncs through an io_uring instance owned by the sync thread.
pub struct UringEngine {
    ring: IoUring,
    /// Groups of one write up to this many bytes bypass the ring (0: none do).
    direct_max_bytes: usize,
    /// Read end of the wake pipe (non-blocking). While the sync thread waits in the ring for
    /// completions, a poll on it is armed, so an appender can wake it by writing a byte to
    /// [`UringEngine::waker`].
    wake_reader: PipeReader,
    wake_writer: PipeWriter,
    /// The poll on `wake_reader` is submitted and has not completed.
    wake_armed: bool,
    /// Groups on the ring, in LSN order; the front is popped once durable.
    groups: VecDeque<GroupInFlight>,
    /// Sequence number of the next group submitted.
    next_seq: u64,
    /// Pipelined entries submitted and not yet reaped (the wake poll is not counted). Buffers
    /// are released only when their writes were reaped; `Drop` waits for this to reach zero.
    entries_in_flight: usize,
    /// Completions read from the ring, processed after the borrow of the queue ends.
    reaped: Vec<(u64, i32)>,
    /// The one `fdatasync` on the ring, if any. It was submitted after the writes of every
    /// group up to its `seq` completed, so it covers all of them.
    sync_in_flight: Option<SyncInFlight>,
    /// The first failure of a pipelined write or sync (reported once by `take_events`).
    error: Option<WalError>,
    /// Why the ring broke (module doc, "A broken ring"): once set, the engine never enters the
    /// ring or reads its completions again, every wait returns at once, and every serial write
    /// fails with this error.
    broken: Option<WalError>,
    /// Test hook: a linked pair goes in as two submissions, the sync only once its write
    /// completed, as when the kernel takes only a prefix of the queue.
    #[cfg(test)]
    split_links: bool,
    /// Test hook: the n-th `io_uring_enter` from now (1-based) fails with this errno instead
    /// of entering the kernel (see [`BREAK_RING`]).
    #[cfg(test)]
    break_at_enter: Option<(u32, i32)>,
}

/// The pipelined `fdatasync` on the ring.
struct SyncInFlight {
    /// Last group it covers.
    seq: u64,
    /// Linked behind that group's only write (`IO_LINK`): the kernel starts it when the write
    /// completed in full, and cancels it if the write fails or comes up short.
    linked: bool,
    /// Linked, but maybe not taken by the kernel in the same submission as its write: it was
    /// still queued after that enter (the kernel took a prefix only, or asked to retry before
    /// taking anything). A link does not span submissions, so it may have run unordered, and
    /// it proves nothing (one sync more at worst).
    cut_from_write: bool,
    /// Result injected by the fault plan.
    injected: Option<i32>,
    /// Keeps the descriptor open until the completion is reaped.
    file: Arc<dyn StorageFile>,
    path: PathBuf,
}

/// One byte range of a group's buffer, written with one entry.
#[derive(Debug, Clone, Copy)]
struct RingPiece {
    buf_start: usize,
    len: usize,
    file_offset: u64,
}

/// A group on the ring and what its completions said so far.
struct GroupInFlight {
    seq: u64,
    /// The group's bytes: read by the kernel until every write entry completed (then handed
    /// back to the sync thread, leaving this empty).
    buf: Vec<u8>,
    file: Arc<dyn StorageFile>,
    path: PathBuf,
    pieces: Vec<RingPiece>,
    /// Results injected by the fault plan, per piece.
    injected: Vec<Option<i32>>,
    writes_pending: usize,
    /// Bytes the ring left unwritten (short or interrupted writes), finished with `pwrite`.
    leftovers: Vec<RingPiece>,
    /// Some bytes were finished with `pwrite` (after a sync linked to the write ran, maybe).
    rewritten: bool,
    /// The group must be synced (durable modes).
    sync: bool,
    /// Its writes completed (leftovers included) and were reported (`RingEvent::Written`).
    written: bool,
    /// A sync submitted after `written` covers it.
    sync_submitted: bool,
    /// That sync completed successfully.
    synced: bool,
    /// It is the last group that sync covers (so the sync is counted once).
    sync_last: bool,
    summary: GroupSummary,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine").finish_non_exhaustive()
    }
}

/// Whether the kernel behind `ring` runs what the engine submits: writes, fsyncs, polls (the
/// wake pipe), no-ops (injected faults), waits with a timeout (`EXT_ARG`), and keeps the
/// completions that overflow the completion queue instead of dropping them (`NODROP`: the
/// pipelined path can have more entries in flight than the queue holds, and a dropped
/// completion would leave its entry counted in flight for good).
fn check_support(ring: &IoUring) -> std::io::Result<()> {
    let unsupported = |what: &str| {
        std::io::Error::new(std::io::ErrorKind::Unsupported, format!("io_uring without {what}"))
    };
    if !ring.params().is_feature_ext_arg() || pretend_missing() {
        return Err(unsupported("waits with a timeout (IORING_FEAT_EXT_ARG)"));
    }
    if !ring.params().is_feature_nodrop() {
        return Err(unsupported("kept completion overflow (IORING_FEAT_NODROP)"));
    }
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    let needed = [
        ("writes", opcode::Write::CODE),
        ("fsync", opcode::Fsync::CODE),
        ("poll", opcode::PollAdd::CODE),
        ("no-ops", opcode::Nop::CODE),
    ];
    match needed.iter().find(|(_, code)| !probe.is_supported(*code)) {
        Some((what, _)) => Err(unsupported(what)),
        None => Ok(()),
    }
}

#[cfg(all(test, not(loom)))]
thread_local! {
    /// Unit tests: the next ring set up on this thread reports a missing feature.
    pub(crate) static PRETEND_MISSING: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

#[cfg(all(test, not(loom)))]
thread_local! {
    /// Unit tests: the next ring set up on this thread fails its n-th `io_uring_enter`
    /// (1-based) with the errno given, as a broken ring would.
    pub(crate) static BREAK_RING: std::cell::Cell<Option<(u32, i32)>> =
        const { std::cell::Cell::new(None) };
}

fn pretend_missing() -> bool {
    #[cfg(all(test, not(loom)))]
    return PRETEND_MISSING.with(std::cell::Cell::take);
    #[cfg(not(all(test, not(loom))))]
    false
}

impl UringEngine {
    /// Sets up a ring, and checks that the kernel runs every operation and feature the engine
    /// uses (a ring can be set up where some are missing: kernels before 5.11, sandboxes with
    /// a partial io_uring), so that `IoMode::Auto` falls back to pwrite then instead of
    /// failing the log at its first write.
    ///
    /// # Errors
    /// The kernel's error (ENOSYS without io_uring, EPERM under seccomp or when disabled), or
    /// `Unsupported` naming what is missing.
    pub fn new(direct_max_bytes: usize) -> std::io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        check_support(&ring)?;
        let (wake_reader, wake_writer) = std::io::pipe()?;
        set_nonblocking(wake_reader.as_raw_fd())?;
        set_nonblocking(wake_writer.as_raw_fd())?;
        Ok(Self {
            ring,
            direct_max_bytes,
            wake_reader,
            wake_writer,
            wake_armed: false,
            groups: VecDeque::new(),
            next_seq: 1,
            entries_in_flight: 0,
            reaped: Vec::new(),
            sync_in_flight: None,
            error: None,
            broken: None,
            #[cfg(test)]
            split_links: false,
            #[cfg(all(test, not(loom)))]
            break_at_enter: BREAK_RING.with(std::cell::Cell::take),
            #[cfg(all(test, loom))]
            break_at_enter: None,
        })
    }

    /// Keeps the kernel workers that run the calling thread's entries on this ring (io-wq:
    /// buffered writes and syncs go there) on `cores` (`IORING_REGISTER_IOWQ_AFF`, Linux
    /// 5.14). The kernel confines the calling thread's workers, which exist only once that
    /// thread has submitted to a ring (or created one): the sync thread, which did not create
    /// the ring, first submits a no-op. Call it with nothing on the ring.
    pub(crate) fn confine_workers(&mut self, cores: &[usize]) -> std::io::Result<()> {
        const { assert!(crate::wal::CORE_ID_LIMIT <= 8 * size_of::<libc::cpu_set_t>()) };
        self.submit_no_op()?;
        // SAFETY: `cpu_set_t` is plain bits, for which all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &core in cores {
            debug_assert!(core < crate::wal::CORE_ID_LIMIT, "core {core}");
            // SAFETY: `CPU_SET` only sets bit `core` of the set, after checking that the set
            // has that bit (it panics beyond, never writes out of bounds); the ids were
            // checked below `CORE_ID_LIMIT`, the set's bits, when the log was opened.
            unsafe { libc::CPU_SET(core, &mut set) };
        }
        self.ring.submitter().register_iowq_aff(&set)
    }

    /// Submits a no-op and waits for it (the calling thread's first submission gives it its
    /// io-wq). Completions of other entries read meanwhile are kept for `reap`. A no-op whose
    /// completion comes later (after a refused enter) is ignored wherever it is read.
    fn submit_no_op(&mut self) -> std::io::Result<()> {
        debug_assert!(self.entries_in_flight == 0 && !self.wake_armed, "nothing on the ring");
        let broken = || std::io::Error::other("the ring is broken");
        if self.broken.is_some() {
            return Err(broken());
        }
        let no_op = opcode::Nop::new().build().user_data(NO_OP_USER_DATA);
        // SAFETY: a no-op refers to no buffer and no descriptor.
        unsafe { self.ring.submission().push(&no_op) }
            .map_err(|_| std::io::Error::other("the submission queue is full"))?;
        for _ in 0..NO_OP_ATTEMPTS {
            // A hard error breaks the ring (as every enter's); a refusal is retried.
            self.enter(1, None);
            if self.broken.is_some() {
                return Err(broken());
            }
            let mut done = false;
            for entry in self.ring.completion() {
                if entry.user_data() == NO_OP_USER_DATA {
                    done = true;
                } else {
                    self.reaped.push((entry.user_data(), entry.result()));
                }
            }
            if done {
                return Ok(());
            }
        }
        Err(std::io::Error::other("the no-op submitted to start the workers did not complete"))
    }

    /// A handle that wakes the sync thread while it waits in the ring (write one byte; the
    /// pipe is non-blocking, so a full pipe, which already means a pending wake, is ignored).
    pub(crate) fn waker(&self) -> std::io::Result<PipeWriter> {
        self.wake_writer.try_clone()
    }

    /// The opt-in direct-path threshold (`WalOptions::uring_direct_max_bytes`).
    pub(crate) fn direct_max_bytes(&self) -> usize {
        self.direct_max_bytes
    }

    /// Groups submitted and not yet durable (or failed).
    pub(crate) fn groups_in_flight(&self) -> usize {
        self.groups.len()
    }

    /// Pushes `entry`, first submitting (and if need be waiting for completions) until the
    /// submission queue has `room` free slots, so the engine never splits a linked pair across
    /// two submissions (the kernel still may: `SyncInFlight::cut_from_write`). On a broken
    /// ring, pushes nothing (the entry's group is failed with the ring).
    ///
    /// # Safety
    /// The buffer and descriptor `entry` refers to must stay valid until its completion is
    /// reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry, room: usize) {
        loop {
            if self.broken.is_some() {
                return;
            }
            let free = {
                let submission = self.ring.submission();
                submission.capacity() - submission.len()
            };
            if free >= room {
                break;
            }
            if !self.enter(0, None) {
                // The kernel is busy (completion queue overflow): make room by reaping.
                self.enter(1, None);
                self.reap();
            }
        }
        // SAFETY: the caller keeps what `entry` points at valid until its completion (this
        // function's contract); the loop above made room.
        unsafe { self.ring.submission().push(entry) }.expect("room was made above");
    }

    /// Enters the kernel: submits what is queued and waits for `want` completions, at most
    /// `timeout`. Returns false if the kernel asked to retry (EAGAIN/EBUSY) before taking the
    /// queued entries; a timeout or a signal counts as done (the caller looks again). Any other
    /// error breaks the ring (module doc); a broken ring is not entered (true: done).
    fn enter(&mut self, want: usize, timeout: Option<Duration>) -> bool {
        if self.broken.is_some() {
            return true;
        }
        #[cfg(test)]
        if let Some((countdown, errno)) = self.break_at_enter.as_mut() {
            *countdown -= 1;
            if *countdown == 0 {
                let errno = *errno;
                self.break_at_enter = None;
                self.break_ring(&std::io::Error::from_raw_os_error(errno));
                return true;
            }
        }
        let result = match timeout {
            None if want == 0 => self.ring.submit(),
            None => self.ring.submit_and_wait(want),
            Some(timeout) if timeout.is_zero() => self.ring.submit(),
            Some(timeout) => {
                let timespec = types::Timespec::from(timeout);
                let args = types::SubmitArgs::new().timespec(&timespec);
                self.ring.submitter().submit_with_args(want, &args)
            }
        };
        match result {
            Ok(_) => true,
            Err(error) if matches!(error.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => true,
            Err(error) if matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => false,
            Err(error) => {
                self.break_ring(&error);
                true
            }
        }
    }

    /// Marks the ring broken by `error` (module doc, "A broken ring") and fails the pipelined
    /// groups with it (reported by `take_events`). The error names the file of the oldest
    /// group on the ring, if any (a serial write names its own: [`Self::broken_error`]).
    fn break_ring(&mut self, error: &std::io::Error) {
        tracing::error!(
            %error,
            "io_uring_enter failed: the ring is not used again and the log fails"
        );
        let path = self.groups.front().map(|group| group.path.clone()).unwrap_or_default();
        let failure = WalError::from_io("io_uring_enter", path, 0, error);
        self.error.get_or_insert_with(|| failure.clone());
        self.broken = Some(failure);
    }

    /// The error that broke the ring, naming `path` if it names no file yet (a serial write's
    /// break, with no group on the ring).
    fn broken_error(&mut self, path: &std::path::Path) -> Option<WalError> {
        let broken = self.broken.as_mut()?;
        if let WalError::Io { path: named, .. } = broken {
            if named.as_os_str().is_empty() {
                *named = path.to_path_buf();
            }
        }
        Some(broken.clone())
    }

    /// Submits a group's writes without waiting. Its sync is submitted by
    /// [`UringEngine::take_events`] once its writes (and those of every earlier group)
    /// completed and no other sync is on the ring.
    pub(crate) fn submit_group(&mut self, group: RingGroup) {
        let RingGroup { buf, runs, file, path, sync, summary } = group;
        let fd = file.raw_fd().expect("the writer pipelines only files with a descriptor");
        let mut pieces = Vec::new();
        for run in &runs {
            let mut start = run.buf_start;
            while start < run.buf_end {
                let len = (run.buf_end - start).min(WRITE_CHUNK_BYTES);
                let file_offset = run.file_offset + (start - run.buf_start) as u64;
                pieces.push(RingPiece { buf_start: start, len, file_offset });
                start += len;
            }
        }
        assert!(!pieces.is_empty() && pieces.len() < CODE_SYNC as usize, "1..2^20 writes");
        // Alone on the ring and written with one entry: its fdatasync is linked behind the
        // write, so the kernel worker that runs the write runs the sync next, without a round
        // trip through this thread (buffered writes run on io_uring's workers here). Several
        // writes would need a chain, which serializes them.
        let link_sync =
            sync && pieces.len() == 1 && self.groups.is_empty() && self.sync_in_flight.is_none();
        let write_flags = if link_sync { squeue::Flags::IO_LINK } else { squeue::Flags::empty() };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.groups.push_back(GroupInFlight {
            seq,
            buf,
            file,
            path,
            injected: vec![None; pieces.len()],
            writes_pending: pieces.len(),
            leftovers: Vec::new(),
            rewritten: false,
            sync,
            written: false,
            sync_submitted: false,
            synced: false,
            sync_last: false,
            summary,
            pieces,
        });
        let index = self.groups.len() - 1;
        for slot in 0..self.groups[index].pieces.len() {
            let group = &self.groups[index];
            let piece = group.pieces[slot];
            let as_piece = Piece { op: 0, start: piece.buf_start, len: piece.len };
            let (entry, fault) =
                write_entry(group.file.as_ref(), fd, &group.buf, as_piece, piece.file_offset);
            let entry = entry.user_data(seq << SEQ_SHIFT | slot as u64).flags(write_flags);
            self.groups[index].injected[slot] = fault;
            self.entries_in_flight += 1;
            // SAFETY: the entry reads `buf[piece.buf_start..][..len]` of the group's buffer,
            // which `self.groups` owns and releases only after this write's completion was
            // reaped (`take_events` hands it back when `writes_pending` is zero; `abandon` and
            // `Drop` first wait for every entry in flight, or on a broken ring leak the
            // buffer). Moving the group inside the deque does not move the heap buffer. The
            // descriptor belongs to `group.file`, kept alive by the same group (and leaked
            // with it on a broken ring). With `link_sync` there is room for the linked sync too,
            // so the pair goes in one submission.
            unsafe { self.push(&entry, if link_sync { 2 } else { 1 }) };
        }
        let split_for_test = link_sync && self.split_link_for_test();
        if link_sync {
            self.push_sync(index, true);
        }
        self.enter(0, None);
        if link_sync && (split_for_test || self.sync_left_behind()) {
            let sync = self.sync_in_flight.as_mut().expect("pushed above");
            sync.cut_from_write = true;
        }
    }

    /// Whether the last enter left entries in the submission queue: the kernel took a prefix
    /// only, or nothing, so the last entry pushed (a linked pair's sync) may go in apart from
    /// its write.
    fn sync_left_behind(&mut self) -> bool {
        !self.ring.submission().is_empty()
    }

    /// The test hook `split_links`: submits the write alone and waits for its completion, so
    /// the sync pushed next runs after it, but in a submission of its own. Returns whether it
    /// did (never outside the unit tests).
    fn split_link_for_test(&mut self) -> bool {
        #[cfg(test)]
        if self.split_links {
            let entries = self.entries_in_flight;
            while self.entries_in_flight == entries && self.broken.is_none() {
                self.enter(1, Some(Duration::from_secs(10)));
                self.reap();
            }
            return true;
        }
        false
    }

    /// Submits one `fdatasync` covering every group up to the one at `last` (all written).
    fn submit_sync(&mut self, last: usize) {
        self.push_sync(last, false);
        self.enter(0, None);
    }

    /// Queues the `fdatasync` covering every group up to the one at `last`: after their
    /// writes completed, or `linked` behind the last write just queued (the only one in flight).
    fn push_sync(&mut self, last: usize, linked: bool) {
        let group = &self.groups[last];
        let fd = group.file.raw_fd().expect("checked at submission");
        let (entry, injected) = sync_entry(group.file.as_ref(), fd, linked);
        let entry = entry.user_data(group.seq << SEQ_SHIFT | CODE_SYNC);
        self.sync_in_flight = Some(SyncInFlight {
            seq: group.seq,
            linked,
            cut_from_write: false,
            injected,
            file: Arc::clone(&group.file),
            path: group.path.clone(),
        });
        for group in self.groups.iter_mut().take(last + 1) {
            group.sync_submitted = true;
        }
        self.groups[last].sync_last = true;
        self.entries_in_flight += 1;
        // SAFETY: no buffer; `sync_in_flight` keeps the descriptor open until the completion.
        unsafe { self.push(&entry, 1) };
    }

    /// Reaps completions without waiting.
    pub(crate) fn poll(&mut self) {
        self.reap();
    }

    /// Waits until at least one completion arrives (or `deadline` passes), then reaps. With
    /// `wake`, a byte written to the wake pipe also ends the wait.
    pub(crate) fn wait(&mut self, deadline: Option<Instant>, wake: bool) {
        if self.broken.is_some() {
            return;
        }
        if wake && !self.wake_armed {
            let entry =
                opcode::PollAdd::new(types::Fd(self.wake_reader.as_raw_fd()), libc::POLLIN as u32)
                    .build()
                    .user_data(WAKE_USER_DATA);
            // SAFETY: a poll entry carries no buffer; the pipe is owned by `self`, which
            // outlives the ring's use of it (the ring is dropped with `self`).
            unsafe { self.push(&entry, 1) };
            self.wake_armed = true;
        }
        let timeout = deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
        if !self.enter(1, timeout) {
            self.enter(0, None);
        }
        self.reap();
    }

    /// Reads every available completion into the state of its group (or of the sync); on a
    /// broken ring, none (its entries are no longer counted).
    fn reap(&mut self) {
        if self.broken.is_some() {
            return;
        }
        let mut reaped = std::mem::take(&mut self.reaped);
        reaped.extend(self.ring.completion().map(|entry| (entry.user_data(), entry.result())));
        for &(user_data, result) in &reaped {
            if user_data == WAKE_USER_DATA {
                self.on_wake(result);
                continue;
            }
            if user_data == NO_OP_USER_DATA {
                // `submit_no_op`'s, completed after it gave up: not counted in flight.
                continue;
            }
            self.entries_in_flight -= 1;
            let seq = user_data >> SEQ_SHIFT;
            let code = user_data & CODE_MASK;
            if code == CODE_SYNC {
                let sync = self.sync_in_flight.take().expect("a sync completion has its sync");
                debug_assert_eq!(sync.seq, seq);
                let result = sync.injected.unwrap_or(result);
                let ordered = sync.linked && !sync.cut_from_write;
                let result =
                    report_completion(sync.file.as_ref(), RingOp::SyncData { ordered }, result);
                // A sync that failed (not one the kernel cancelled) fails the log, voided or
                // not: Linux reports a writeback error once, so the sync issued in its place
                // could succeed over lost bytes.
                let failed = result < 0 && result != -libc::ECANCELED;
                if sync.linked && !failed && self.linked_sync_void(seq, result, sync.cut_from_write)
                {
                    continue;
                }
                if result < 0 {
                    let error = std::io::Error::from_raw_os_error(-result);
                    self.error.get_or_insert(WalError::from_io("fdatasync", &sync.path, 0, &error));
                } else {
                    // It was submitted after the writes of every group up to `seq` completed.
                    for group in self.groups.iter_mut().take_while(|group| group.seq <= seq) {
                        debug_assert!((group.written || sync.linked) && group.sync_submitted);
                        group.synced = true;
                    }
                }
                continue;
            }
            let front = self.groups.front().expect("a completion belongs to a group").seq;
            let group = &mut self.groups[(seq - front) as usize];
            debug_assert_eq!(group.seq, seq);
            let slot = code as usize;
            group.writes_pending -= 1;
            let piece = group.pieces[slot];
            let result = group.injected[slot].unwrap_or(result);
            let op = RingOp::Write { offset: piece.file_offset, len: piece.len };
            let result = report_completion(group.file.as_ref(), op, result);
            if result < 0 {
                if matches!(-result, libc::EINTR | libc::EAGAIN) {
                    group.rewritten = true;
                    group.leftovers.push(piece);
                } else {
                    let error = std::io::Error::from_raw_os_error(-result);
                    let error = WalError::from_io("write", &group.path, piece.len as u64, &error);
                    self.error.get_or_insert(error);
                }
            } else if (result as usize) < piece.len {
                let done = result as usize;
                group.rewritten = true;
                group.leftovers.push(RingPiece {
                    buf_start: piece.buf_start + done,
                    len: piece.len - done,
                    file_offset: piece.file_offset + done as u64,
                });
            }
        }
        reaped.clear();
        self.reaped = reaped;
    }

    /// Whether the completion (`result`) of the sync linked behind group `seq`'s write proves
    /// nothing: the kernel cancelled it (the write failed or came up short: `ECANCELED`), it
    /// ran before bytes the ring left unwritten were finished with `pwrite`, the write's own
    /// completion was not reaped yet, or it was `cut_from_write` (submitted apart from the
    /// write, so not ordered after it). The group then waits for a sync submitted the usual
    /// way, after its writes (`take_events`); a failed write has already failed the log.
    fn linked_sync_void(&mut self, seq: u64, result: i32, cut_from_write: bool) -> bool {
        let group = self.groups.iter_mut().find(|group| group.seq == seq);
        let group = group.expect("a linked sync's group stays until it is durable");
        // Its write's completion not reaped yet (completions may be reaped in any order):
        // nothing is known about it, so the sync counts for nothing (one sync more at worst).
        if !cut_from_write
            && result != -libc::ECANCELED
            && !group.rewritten
            && group.writes_pending == 0
        {
            return false;
        }
        group.sync_submitted = false;
        group.sync_last = false;
        true
    }

    /// Completes the armed wake poll (by waking it) and reaps it, so no entry of the
    /// pipelined path is left on the ring.
    fn disarm_wake(&mut self) {
        if self.wake_armed {
            use std::io::Write;
            let _ = (&self.wake_writer).write(&[1]);
            while self.wake_armed && self.broken.is_none() {
                self.enter(1, None);
                self.reap();
            }
        }
    }

    fn on_wake(&mut self, result: i32) {
        self.wake_armed = false;
        if result >= 0 {
            let mut scratch = [0u8; 64];
            // Non-blocking: stops at WouldBlock once the pipe is empty.
            while matches!((&self.wake_reader).read(&mut scratch), Ok(read) if read > 0) {}
        }
    }

    /// Moves the groups forward in LSN order and reports what changed: writes complete
    /// (`Written`, in order, with the buffer handed back), durable (`Done`, in order: a group
    /// is reported only once a sync that started after its writes, and those of every earlier
    /// group, completed), or the first failure (`Failed`, once; the caller then calls
    /// [`UringEngine::abandon`]). Short writes are finished here with `pwrite` before the
    /// group counts as written. When no sync is on the ring, one is submitted here covering
    /// every group written so far: while it runs, later groups' writes proceed, and the next
    /// sync covers all of those that completed meanwhile.
    pub(crate) fn take_events(&mut self, events: &mut Vec<RingEvent>) {
        if let Some(error) = self.error.take() {
            events.push(RingEvent::Failed(error));
            return;
        }
        let mut last_written = None;
        for index in 0..self.groups.len() {
            let group = &mut self.groups[index];
            if group.writes_pending > 0 {
                // Later groups are reported written only after this one.
                break;
            }
            if !group.written {
                for piece in std::mem::take(&mut group.leftovers) {
                    let op = WriteOp {
                        file: group.file.as_ref(),
                        path: &group.path,
                        buf: &group.buf[piece.buf_start..piece.buf_start + piece.len],
                        offset: piece.file_offset,
                    };
                    if let Err(error) = write_all_at(&op) {
                        events.push(RingEvent::Failed(error));
                        return;
                    }
                }
                group.written = true;
                events.push(RingEvent::Written {
                    summary: group.summary.clone(),
                    buf: std::mem::take(&mut group.buf),
                });
            }
            last_written = Some(index);
        }
        if let Some(last) = last_written {
            let group = &self.groups[last];
            if self.sync_in_flight.is_none() && group.sync && !group.sync_submitted {
                self.submit_sync(last);
            }
        }
        while let Some(group) = self.groups.front() {
            if !group.written || (group.sync && !group.synced) {
                break;
            }
            let group = self.groups.pop_front().expect("front exists");
            events.push(RingEvent::Done {
                summary: group.summary,
                synced: group.sync,
                sync_last: group.sync_last,
            });
        }
    }

    /// After a failure: waits until the kernel is done with every entry in flight, then drops
    /// the groups (nothing more is reported) and hands their buffers back. On a broken ring it
    /// waits for nothing and leaks the buffers the kernel may still read.
    pub(crate) fn abandon(&mut self) -> Vec<Vec<u8>> {
        while self.entries_in_flight > 0 && self.broken.is_none() {
            self.enter(1, None);
            self.reap();
        }
        // The log is failed already; what the drained entries reported changes nothing.
        self.error = None;
        if self.broken.is_some() {
            self.leak_in_flight();
            return Vec::new();
        }
        self.sync_in_flight = None;
        self.groups.drain(..).map(|group| group.buf).filter(|buf| buf.capacity() > 0).collect()
    }

    /// On a broken ring: leaks the buffers and files of the groups and of the sync still on
    /// it. The kernel may still read those buffers, and look those descriptors up (a request
    /// may do so only when it runs): they are never freed, nor closed for their numbers to be
    /// reused.
    fn leak_in_flight(&mut self) {
        for group in self.groups.drain(..) {
            std::mem::forget(group.buf);
            std::mem::forget(group.file);
        }
        if let Some(sync) = self.sync_in_flight.take() {
            std::mem::forget(sync.file);
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The kernel may still read buffers of groups in flight (a panic unwinding the sync
        // thread): wait for it before they are freed (or leak them, on a broken ring).
        let _ = self.abandon();
    }
}

/// Sets `O_NONBLOCK` on a descriptor this module owns.
fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl with F_GETFL/F_SETFL takes no pointers; `fd` is a live pipe end owned by
    // the caller for the duration of the call.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One submitted write: which op, which byte range of it.
#[derive(Debug, Clone, Copy)]
struct Piece {
    op: usize,
    start: usize,
    len: usize,
}

impl IoEngine for UringEngine {
    fn path(&self) -> IoPath {
        IoPath::IoUring
    }

    fn as_uring(&mut self) -> Option<&mut UringEngine> {
        Some(self)
    }

    fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    fn waker(&self) -> Option<PipeWriter> {
        match UringEngine::waker(self) {
            Ok(waker) => Some(waker),
            Err(error) => {
                tracing::warn!(
                    %error,
                    "no wake pipe for the io_uring writer; groups go one at a time"
                );
                None
            }
        }
    }

    fn write_and_sync(
        &mut self,
        ops: &[WriteOp<'_>],
        sync: Option<&SyncTarget<'_>>,
    ) -> Result<(), WalError> {
        // Files without a descriptor go through their storage methods. A group that is one
        // small write has nothing to overlap: io_uring would only add the hop to the kernel
        // worker that runs the fdatasync, so it is written and synced directly.
        let path = ops.first().map_or_else(|| sync.map(|target| target.path), |op| Some(op.path));
        let path = path.unwrap_or(std::path::Path::new(""));
        if let Some(broken) = self.broken_error(path) {
            return Err(broken);
        }
        assert_eq!(self.entries_in_flight, 0, "the pipeline is drained before a serial write");
        let total: usize = ops.iter().map(|op| op.buf.len()).sum();
        if ops.iter().any(|op| op.file.raw_fd().is_none())
            || sync.is_some_and(|target| target.file.raw_fd().is_none())
            || (ops.len() <= 1 && total <= self.direct_max_bytes)
        {
            return super::pwrite::PwriteEngine.write_and_sync(ops, sync);
        }
        // A drained sync below would wait for every earlier entry, the armed wake poll
        // included; the poll is reaped first.
        self.disarm_wake();
        if let Some(broken) = self.broken_error(path) {
            return Err(broken);
        }
        let mut pieces = Vec::new();
        for (index, op) in ops.iter().enumerate() {
            let mut start = 0;
            while start < op.buf.len() {
                let len = (op.buf.len() - start).min(WRITE_CHUNK_BYTES);
                pieces.push(Piece { op: index, start, len });
                start += len;
            }
        }
        // Bytes of each piece still unwritten after the ring finished (short or failed).
        let mut leftovers: Vec<Piece> = Vec::new();
        let mut first_error: Option<WalError> = None;
        let mut synced = false;
        // The sync completed but proves nothing (cut from its write): sync again at the end.
        let mut resync = false;
        let room = RING_ENTRIES as usize - 1;
        let batches: Vec<&[Piece]> =
            if pieces.is_empty() { vec![&[]] } else { pieces.chunks(room).collect() };
        let batch_count = batches.len();
        for (batch_index, batch) in batches.into_iter().enumerate() {
            let with_sync = sync.filter(|_| batch_index + 1 == batch_count);
            // One write and its sync are linked: the kernel worker that runs the write runs
            // the sync next (a drained sync costs a second trip through io_uring, measured at
            // 1.8x a bare `fdatasync` here against 1.1-1.3x linked). If the write fails or
            // comes up short, the sync is cancelled and the code below writes the rest and
            // syncs again.
            let linked = with_sync.is_some() && batch.len() == 1;
            let write_flags = if linked {
                squeue::Flags::IO_LINK | squeue::Flags::ASYNC
            } else {
                squeue::Flags::empty()
            };
            let mut expected = 0usize;
            // Results injected by the storage's fault plan, per slot (and for the sync).
            let mut injected: Vec<Option<i32>> = vec![None; batch.len()];
            let mut sync_injected: Option<i32> = None;
            {
                let mut submission = self.ring.submission();
                for (slot, piece) in batch.iter().enumerate() {
                    let op = &ops[piece.op];
                    let fd = op.file.raw_fd().expect("checked above");
                    let file_offset = op.offset + piece.start as u64;
                    let (entry, fault) = write_entry(op.file, fd, op.buf, *piece, file_offset);
                    injected[slot] = fault;
                    let entry = entry.user_data(slot as u64);
                    // Linked, it goes straight to the kernel worker (`ASYNC`): a buffered
                    // write to ext4 cannot complete without blocking, so trying it inline
                    // first only delays it.
                    let entry = entry.flags(write_flags);
                    // SAFETY: the buffer `op.buf[piece.start..piece.start + len]` is borrowed
                    // from `ops` for this whole call, and this function does not return before
                    // every submitted entry completed (the loop below waits for all), so the
                    // kernel never reads freed memory; only a broken ring returns with entries
                    // in flight, and the caller then leaks the buffer and the file (module
                    // doc, "A broken ring"). The descriptor belongs to a file the caller keeps
                    // open for the call. The queue has room: at most RING_ENTRIES - 1 writes
                    // plus one sync are pushed per round, onto a queue the wake poll left
                    // empty (`disarm_wake`).
                    unsafe { submission.push(&entry) }.expect("ring has room for the batch");
                    expected += 1;
                }
                if let Some(target) = with_sync {
                    let fd = target.file.raw_fd().expect("checked above");
                    let order =
                        if linked { squeue::Flags::empty() } else { squeue::Flags::IO_DRAIN };
                    // Linked behind the only write, or drained: ordered either way.
                    let (entry, fault) = sync_entry(target.file, fd, true);
                    sync_injected = fault;
                    let entry = entry.flags(order).user_data(SYNC_USER_DATA);
                    // SAFETY: an fsync entry carries no buffer; the descriptor stays open for
                    // the call, which waits for the completion below.
                    unsafe { submission.push(&entry) }.expect("ring has room for the sync");
                    expected += 1;
                }
            }
            let mut completed = 0usize;
            // A linked sync left in the queue by the first enter (the kernel took a prefix
            // only) goes in later, apart from its write and unordered: it proves nothing.
            let mut sync_cut_from_write = None;
            while completed < expected {
                // Retried after a signal or a busy kernel.
                self.enter(expected - completed, None);
                if let Some(broken) = self.broken_error(path) {
                    return Err(broken);
                }
                let cut =
                    *sync_cut_from_write.get_or_insert_with(|| linked && self.sync_left_behind());
                let mut woke = None;
                for entry in self.ring.completion() {
                    if entry.user_data() == WAKE_USER_DATA {
                        // The pipelined path's wake poll (armed earlier): not ours to count.
                        woke = Some(entry.result());
                        continue;
                    }
                    if entry.user_data() == NO_OP_USER_DATA {
                        // `submit_no_op`'s, completed after it gave up: not ours either.
                        continue;
                    }
                    completed += 1;
                    if entry.user_data() == SYNC_USER_DATA {
                        let result = sync_injected.unwrap_or(entry.result());
                        let target = with_sync.expect("a sync was submitted");
                        let op = RingOp::SyncData { ordered: !cut };
                        let result = report_completion(target.file, op, result);
                        if linked && result == -libc::ECANCELED {
                            // The linked write failed or came up short: handled with it.
                            continue;
                        }
                        if result < 0 {
                            let error = std::io::Error::from_raw_os_error(-result);
                            first_error.get_or_insert(WalError::from_io(
                                "fdatasync",
                                target.path,
                                0,
                                &error,
                            ));
                        } else if cut {
                            resync = true;
                        } else {
                            synced = true;
                        }
                        continue;
                    }
                    let slot = entry.user_data() as usize;
                    let piece = batch[slot];
                    let result = injected[slot].unwrap_or(entry.result());
                    let op = &ops[piece.op];
                    let file_offset = op.offset + piece.start as u64;
                    let result = report_completion(
                        op.file,
                        RingOp::Write { offset: file_offset, len: piece.len },
                        result,
                    );
                    if result < 0 {
                        let error = std::io::Error::from_raw_os_error(-result);
                        // Interrupted or would block: nothing failed, the piece is finished with
                        // pwrite (as on the pipelined path).
                        if matches!(-result, libc::EINTR | libc::EAGAIN) {
                            leftovers.push(piece);
                        } else {
                            first_error.get_or_insert(WalError::from_io(
                                "write",
                                op.path,
                                piece.len as u64,
                                &error,
                            ));
                        }
                    } else if (result as usize) < piece.len {
                        leftovers.push(Piece {
                            op: piece.op,
                            start: piece.start + result as usize,
                            len: piece.len - result as usize,
                        });
                    }
                }
                if let Some(result) = woke {
                    self.on_wake(result);
                }
            }
        }
        if let Some(error) = first_error {
            return Err(error);
        }
        if leftovers.is_empty() && !resync {
            if sync.is_some() && !synced {
                unreachable!("the sync completed, or its linked write failed or came up short");
            }
            return Ok(());
        }
        // Finish short writes, then sync again: the drained sync may have run before them (a
        // linked one was cancelled, or cut from its write).
        for piece in leftovers {
            let op = &ops[piece.op];
            write_all_at(&WriteOp {
                file: op.file,
                path: op.path,
                buf: &op.buf[piece.start..piece.start + piece.len],
                offset: op.offset + piece.start as u64,
            })?;
        }
        if let Some(target) = sync {
            sync_file(target)?;
        }
        Ok(())
    }
}

/// The ring entry for writing `piece` of `buf` at `file_offset`, as the file's fault plan
/// (`StorageFile::ring_fault`) has it: the real write, a shorter one, or a no-op standing in
/// for a failed write (its injected result, a negative errno, is returned beside it).
fn write_entry(
    file: &dyn StorageFile,
    fd: RawFd,
    buf: &[u8],
    piece: Piece,
    file_offset: u64,
) -> (squeue::Entry, Option<i32>) {
    let mut len = piece.len;
    match fault_plan(file, RingOp::Write { offset: file_offset, len }) {
        None => {}
        Some(RingFault::Errno(errno)) => return (opcode::Nop::new().build(), Some(-errno.abs())),
        Some(RingFault::ShortWrite(max)) => len = len.min(max.max(1)),
    }
    let len = u32::try_from(len).expect("pieces are at most WRITE_CHUNK_BYTES");
    let entry = opcode::Write::new(types::Fd(fd), buf[piece.start..].as_ptr(), len)
        .offset(file_offset)
        .build();
    (entry, None)
}

/// The ring entry for `fdatasync` of `fd`, or a no-op with an injected errno (see
/// [`write_entry`]). `ordered`: the kernel starts it only after every entry submitted before
/// it completed (`RingOp::SyncData`).
fn sync_entry(file: &dyn StorageFile, fd: RawFd, ordered: bool) -> (squeue::Entry, Option<i32>) {
    match fault_plan(file, RingOp::SyncData { ordered }) {
        Some(RingFault::Errno(errno)) => (opcode::Nop::new().build(), Some(-errno.abs())),
        _ => (opcode::Fsync::new(types::Fd(fd)).flags(types::FsyncFlags::DATASYNC).build(), None),
    }
}

/// `file.ring_fault(op)`; a panic in it injects `EIO` ([`hook_or_eio`]).
fn fault_plan(file: &dyn StorageFile, op: RingOp) -> Option<RingFault> {
    hook_or_eio("ring_fault", op, || file.ring_fault(op), Some(RingFault::Errno(libc::EIO)))
}

/// Reports `op`'s completion with `result` to `file.ring_completed`, and returns the result
/// to act on: `result`, or `-EIO` if the hook panicked ([`hook_or_eio`]).
fn report_completion(file: &dyn StorageFile, op: RingOp, result: i32) -> i32 {
    hook_or_eio(
        "ring_completed",
        op,
        || {
            file.ring_completed(op, result);
            result
        },
        -libc::EIO,
    )
}

/// Runs a storage layer's hook about `op` without letting a panic in it unwind through the
/// engine (module doc, "Fault injection"): a panic is logged and `on_panic` returned instead.
fn hook_or_eio<T>(hook: &'static str, op: RingOp, call: impl FnOnce() -> T, on_panic: T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(value) => value,
        Err(payload) => {
            let message = crate::runtime::panic_message(payload.as_ref());
            tracing::error!(hook, ?op, %message,
                "the storage layer's hook panicked; the operation counts as failed with EIO");
            on_panic
        }
    }
}

/// `posix_fallocate(fd, 0, len)`: reserves the blocks of a new segment. Returns 0 or an errno.
pub(crate) fn posix_fallocate(fd: RawFd, len: libc::off_t) -> i32 {
    // SAFETY: posix_fallocate takes no pointers, so it cannot touch this process's memory; `fd`
    // is borrowed from a live `File` for the duration of the call.
    unsafe { libc::posix_fallocate(fd, 0, len) }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::{
        path::Path,
        sync::atomic::{AtomicU64, Ordering},
    };

    use super::*;
    use crate::wal::{
        segment::{Segment, SegmentHeader},
        storage::{FileStorage, Storage},
        writer::Run,
        SegmentId,
    };

    /// A real file whose ring submissions follow a small fault plan.
    #[derive(Debug)]
    struct PlannedFile {
        inner: Arc<dyn StorageFile>,
        /// Fail the n-th `fdatasync` submitted to the ring (1-based; 0: none) with EIO.
        fail_sync_number: u64,
        /// Shorten ring writes to this many bytes (0: no).
        short_write_bytes: usize,
        syncs: AtomicU64,
        /// What was submitted or written, in order: "ring write", "sync", "pwrite".
        log: std::sync::Mutex<Vec<&'static str>>,
    }

    impl PlannedFile {
        fn note(&self, what: &'static str) {
            self.log.lock().unwrap().push(what);
        }
    }

    impl StorageFile for PlannedFile {
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<usize> {
            self.note("pwrite");
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
        fn raw_fd(&self) -> Option<RawFd> {
            self.inner.raw_fd()
        }
        fn ring_fault(&self, op: RingOp) -> Option<RingFault> {
            self.note(match op {
                RingOp::SyncData { .. } => "sync",
                RingOp::Write { .. } => "ring write",
            });
            match op {
                RingOp::SyncData { .. } => {
                    let number = self.syncs.fetch_add(1, Ordering::SeqCst) + 1;
                    (number == self.fail_sync_number).then_some(RingFault::Errno(libc::EIO))
                }
                RingOp::Write { len, .. } => (self.short_write_bytes > 0
                    && len > self.short_write_bytes)
                    .then_some(RingFault::ShortWrite(self.short_write_bytes)),
            }
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        path: PathBuf,
        file: Arc<dyn StorageFile>,
        planned: Arc<PlannedFile>,
        segment: Arc<Segment>,
    }

    fn fixture(fail_sync_number: u64, short_write_bytes: usize) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let header = SegmentHeader {
            id: SegmentId(1),
            first_lsn: 1,
            window: None,
            segment_size_bytes: 16 << 20,
            recycled: false,
        };
        let segment = Arc::new(Segment::new(dir.path(), header));
        let path = segment.path.clone();
        let planned = Arc::new(PlannedFile {
            inner: FileStorage.create(&path).unwrap(),
            fail_sync_number,
            short_write_bytes,
            syncs: AtomicU64::new(0),
            log: std::sync::Mutex::new(Vec::new()),
        });
        let file: Arc<dyn StorageFile> = planned.clone();
        Fixture { _dir: dir, path, file, planned, segment }
    }

    /// A group of `len` bytes of value `lsn as u8`, written at `offset`, ending with `lsn`.
    fn group(fixture: &Fixture, lsn: u64, offset: u64, len: usize) -> RingGroup {
        RingGroup {
            buf: vec![lsn as u8; len],
            runs: vec![Run { buf_start: 0, buf_end: len, file_offset: offset }],
            file: Arc::clone(&fixture.file),
            path: fixture.path.clone(),
            sync: true,
            summary: GroupSummary {
                segment: Arc::clone(&fixture.segment),
                last_lsn: lsn,
                end_offset: offset + len as u64,
                max_time_ms: 0,
                started: Instant::now(),
            },
        }
    }

    /// What happened, in order: ("written" | "done" | "failed", lsn).
    ///
    /// Bounded: each round waits for at least one completion, at most `ROUND_TIMEOUT`; a group
    /// counted in flight whose entries never reach the ring fails the test instead of hanging.
    fn drive(engine: &mut UringEngine, stop_at_failure: bool) -> Vec<(&'static str, u64)> {
        const ROUND_TIMEOUT: Duration = Duration::from_secs(10);
        let mut seen = Vec::new();
        let mut events = Vec::new();
        for _ in 0..10_000 {
            engine.poll();
            engine.take_events(&mut events);
            for event in events.drain(..) {
                match event {
                    RingEvent::Written { summary, .. } => seen.push(("written", summary.last_lsn)),
                    RingEvent::Done { summary, synced, .. } => {
                        assert!(synced);
                        seen.push(("done", summary.last_lsn));
                    }
                    RingEvent::Failed(error) => {
                        assert!(matches!(error, WalError::Io { op: "fdatasync", .. }), "{error}");
                        seen.push(("failed", 0));
                        if stop_at_failure {
                            let _ = engine.abandon();
                            return seen;
                        }
                    }
                }
            }
            if engine.groups_in_flight() == 0 {
                return seen;
            }
            // `wait` returns nothing: reaped completions show as fewer entries in flight (`reap`
            // only ever lowers the count, and the wake poll is neither armed here nor counted).
            // A timeout, a signal or a busy kernel returns with the count unchanged: wait again
            // until the same deadline.
            let deadline = Instant::now() + ROUND_TIMEOUT;
            let entries_before = engine.entries_in_flight;
            loop {
                engine.wait(Some(deadline), false);
                if engine.entries_in_flight != entries_before {
                    break;
                }
                if Instant::now() >= deadline {
                    let message = format!(
                        "no completion within {ROUND_TIMEOUT:?}: {} groups and {entries_before} \
                         entries in flight; events so far: {seen:?}",
                        engine.groups_in_flight()
                    );
                    // Dropping the engine while unwinding waits for every entry in flight,
                    // which would hang the failing test: leak it (with the buffers the kernel
                    // may still read) in place of a fresh one.
                    if let Ok(fresh) = UringEngine::new(0) {
                        std::mem::forget(std::mem::replace(engine, fresh));
                    }
                    panic!("{message}");
                }
            }
        }
        panic!("the ring did not finish: {seen:?}");
    }

    /// An engine, or `None` (said on stderr) where the kernel refuses io_uring: the pwrite
    /// path covers such a machine. Any other setup error fails the test (no silent skip).
    pub(crate) fn engine_if_available() -> Option<UringEngine> {
        match UringEngine::new(0) {
            Ok(engine) => Some(engine),
            Err(error) if kernel_refuses(&error) => {
                let reason = format!("the kernel refuses io_uring ({error})");
                crate::skipped_variants::skip_io_uring_variant(&reason);
                None
            }
            Err(error) => {
                panic!("io_uring setup failed, not because the kernel refuses it: {error}")
            }
        }
    }

    /// No io_uring (`ENOSYS`, or a ring without what the engine needs), not allowed
    /// (`EPERM`/`EACCES`), or no locked memory left (`ENOMEM`).
    fn kernel_refuses(error: &std::io::Error) -> bool {
        use std::io::ErrorKind;
        matches!(
            error.kind(),
            ErrorKind::Unsupported | ErrorKind::PermissionDenied | ErrorKind::OutOfMemory
        )
    }

    #[test]
    fn groups_in_flight_are_written_then_made_durable_in_lsn_order() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        let fixture = fixture(0, 0);
        // Three groups on the ring at once: one of 48 64 KiB writes, then two small ones.
        engine.submit_group(group(&fixture, 1, 0, 3 << 20));
        engine.submit_group(group(&fixture, 2, 3 << 20, 100));
        engine.submit_group(group(&fixture, 3, (3 << 20) + 100, 100));
        assert_eq!(engine.groups_in_flight(), 3);
        let seen = drive(&mut engine, false);
        let written: Vec<u64> =
            seen.iter().filter(|(kind, _)| *kind == "written").map(|(_, lsn)| *lsn).collect();
        let done: Vec<u64> =
            seen.iter().filter(|(kind, _)| *kind == "done").map(|(_, lsn)| *lsn).collect();
        assert_eq!(written, vec![1, 2, 3]);
        assert_eq!(done, vec![1, 2, 3]);
        for lsn in 1..=3 {
            let at = |kind| seen.iter().position(|event| *event == (kind, lsn)).unwrap();
            assert!(at("written") < at("done"), "{seen:?}");
        }
        let bytes = std::fs::read(&fixture.path).unwrap();
        assert_eq!(bytes.len(), (3 << 20) + 200);
        assert!(bytes[..3 << 20].iter().all(|byte| *byte == 1));
        assert!(bytes[3 << 20..(3 << 20) + 100].iter().all(|byte| *byte == 2));
        assert!(bytes[(3 << 20) + 100..].iter().all(|byte| *byte == 3));
    }

    #[test]
    fn a_failed_sync_leaves_no_group_behind_it_durable() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        // The second sync fails. The first group is made durable alone (its sync is submitted
        // before the others exist); the second and third are behind the failed sync, and the
        // third's writes (and any sync after) must never make them durable.
        let fixture = fixture(2, 0);
        engine.submit_group(group(&fixture, 1, 0, 4096));
        let first = drive(&mut engine, true);
        assert_eq!(first, vec![("written", 1), ("done", 1)]);
        engine.submit_group(group(&fixture, 2, 4096, 4096));
        engine.submit_group(group(&fixture, 3, 8192, 4096));
        let seen = drive(&mut engine, true);
        assert!(seen.contains(&("failed", 0)), "{seen:?}");
        assert!(!seen.iter().any(|(kind, _)| *kind == "done"), "{seen:?}");
        assert_eq!(engine.groups_in_flight(), 0);
        assert_eq!(engine.entries_in_flight, 0);
    }

    #[test]
    fn a_lone_group_has_its_sync_linked_and_a_short_write_voids_that_sync() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        // Alone on the ring, one write: write and sync go in together, one sync in all.
        let whole = fixture(0, 0);
        engine.submit_group(group(&whole, 1, 0, 1000));
        assert_eq!(*whole.planned.log.lock().unwrap(), ["ring write", "sync"]);
        assert_eq!(drive(&mut engine, false), [("written", 1), ("done", 1)]);
        assert_eq!(whole.planned.log.lock().unwrap().len(), 2, "no second sync");
        // The ring writes 10 bytes of 1000: the linked sync ran (or was cancelled) before the
        // rest was written with pwrite, so only a sync after that makes the group durable.
        let short = fixture(0, 10);
        engine.submit_group(group(&short, 2, 0, 1000));
        assert_eq!(drive(&mut engine, false), [("written", 2), ("done", 2)]);
        let log = short.planned.log.lock().unwrap().clone();
        let rewrite = log.iter().rposition(|what| *what == "pwrite").expect("a rewrite");
        assert!(log[rewrite..].contains(&"sync"), "no sync after the rewrite: {log:?}");
        let bytes = std::fs::read(&short.path).unwrap();
        assert!(bytes.len() == 1000 && bytes.iter().all(|byte| *byte == 2));
    }

    #[test]
    fn a_linked_sync_that_went_in_apart_from_its_write_counts_for_nothing() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        // The kernel took the write alone: the sync went in later, in a submission of its own
        // (here only once the write completed, so it even ran after it). Unlinked, it is not
        // ordered after the write, so only a sync submitted the usual way makes it durable.
        engine.split_links = true;
        let fixture = fixture(0, 0);
        engine.submit_group(group(&fixture, 1, 0, 1000));
        assert_eq!(drive(&mut engine, false), [("written", 1), ("done", 1)]);
        assert_eq!(*fixture.planned.log.lock().unwrap(), ["ring write", "sync", "sync"]);
        let bytes = std::fs::read(&fixture.path).unwrap();
        assert!(bytes.len() == 1000 && bytes.iter().all(|byte| *byte == 1));
    }

    /// Runs `body` on a thread of its own and fails the test if it takes longer than 10 s,
    /// instead of hanging it (the thread is left behind then).
    fn within_bound(body: impl FnOnce() + Send + 'static) {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            body();
            let _ = done.send(());
        });
        match finished.recv_timeout(Duration::from_secs(10)) {
            Ok(()) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("hung on a broken ring"),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the body panicked"),
        }
    }

    fn is_broken_ring_error(error: &WalError) -> bool {
        matches!(error, WalError::Io { op: "io_uring_enter", message, .. }
            if message.contains(&std::io::Error::from_raw_os_error(libc::EBADR).to_string()))
    }

    #[test]
    fn a_ring_that_breaks_with_a_group_in_flight_fails_it_and_never_waits_on_the_ring_again() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        within_bound(move || {
            let fixture = fixture(0, 0);
            // The first enter submits the group's linked write and sync; the second (a wait)
            // fails as when the kernel lost a completion.
            engine.break_at_enter = Some((2, libc::EBADR));
            engine.submit_group(group(&fixture, 1, 0, 4096));
            engine.wait(None, false);
            let mut events = Vec::new();
            engine.take_events(&mut events);
            match events.as_slice() {
                [RingEvent::Failed(error)] => {
                    assert!(is_broken_ring_error(error), "{error}");
                    assert!(matches!(error, WalError::Io { path, .. } if *path == fixture.path));
                }
                _ => panic!("expected the ring's failure alone"),
            }
            // The group is dropped without waiting for its entries, and nothing waits on the
            // ring any more: a wait returns at once, with or without the wake poll.
            assert!(engine.abandon().is_empty(), "the kernel may still read those buffers");
            assert_eq!(engine.groups_in_flight(), 0);
            engine.wait(None, true);
            engine.wait(None, false);
            engine.poll();
            events.clear();
            engine.take_events(&mut events);
            assert!(events.is_empty());
            // A serial write after the break fails with the same error.
            let op = WriteOp {
                file: fixture.file.as_ref(),
                path: &fixture.path,
                buf: &[1; 8],
                offset: 0,
            };
            let target = SyncTarget { file: fixture.file.as_ref(), path: &fixture.path };
            let error = engine.write_and_sync(&[op], Some(&target)).unwrap_err();
            assert!(is_broken_ring_error(&error), "{error}");
            drop(engine);
        });
    }

    #[test]
    fn a_ring_that_breaks_in_a_serial_write_fails_that_write_with_its_error() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        within_bound(move || {
            let fixture = fixture(0, 0);
            engine.break_at_enter = Some((1, libc::EBADR));
            let bufs = [vec![7u8; 5000], vec![8u8; 5000]];
            let ops: Vec<WriteOp<'_>> = bufs
                .iter()
                .enumerate()
                .map(|(index, buf)| WriteOp {
                    file: fixture.file.as_ref(),
                    path: &fixture.path,
                    buf,
                    offset: index as u64 * 5000,
                })
                .collect();
            let target = SyncTarget { file: fixture.file.as_ref(), path: &fixture.path };
            for _ in 0..2 {
                let error = engine.write_and_sync(&ops, Some(&target)).unwrap_err();
                assert!(is_broken_ring_error(&error), "{error}");
                // With no group on the ring, the error names the file written.
                assert!(matches!(&error, WalError::Io { path, .. } if *path == fixture.path));
            }
            drop(engine);
        });
    }

    #[test]
    fn short_ring_writes_are_finished_before_the_covering_sync() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        let fixture = fixture(0, 10);
        engine.submit_group(group(&fixture, 1, 0, 1000));
        engine.submit_group(group(&fixture, 2, 1000, 3000));
        let seen = drive(&mut engine, false);
        assert_eq!(seen.iter().filter(|(kind, _)| *kind == "done").count(), 2, "{seen:?}");
        let bytes = std::fs::read(&fixture.path).unwrap();
        assert_eq!(bytes.len(), 4000);
        assert!(bytes[..1000].iter().all(|byte| *byte == 1));
        assert!(bytes[1000..].iter().all(|byte| *byte == 2));
    }

    /// The workers that run a thread's ring entries stay on the cores `confine_workers` gave,
    /// although that thread itself may run on any core (so they did not inherit them), and
    /// also when the thread did not create the ring (as the sync thread did not).
    #[cfg(not(loom))]
    #[test]
    fn confined_ring_workers_run_only_on_the_cores_given() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        let cores = core_affinity::get_core_ids().unwrap();
        if cores.len() < 2 {
            eprintln!("one core: confined and unconfined workers look the same; not checked");
            return;
        }
        let core = cores.last().unwrap().id;
        let dir = tempfile::tempdir().unwrap();
        let file = FileStorage.create(&dir.path().join("f")).unwrap();
        // On a thread of its own (the ring was created on this one), which looks at its
        // workers before it ends (its workers end with it).
        let confined = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    engine.confine_workers(&[core])?;
                    let (buf, path) = ([7; 3000], Path::new("f"));
                    let op = WriteOp { file: file.as_ref(), path, buf: &buf, offset: 0 };
                    let target = SyncTarget { file: file.as_ref(), path };
                    engine.write_and_sync(&[op], Some(&target)).unwrap();
                    let tid = rustix::thread::gettid().as_raw_nonzero().to_string();
                    let workers = crate::wal::tests::ring_workers_of_thread(&tid);
                    Ok::<_, std::io::Error>(workers.map(|workers| {
                        workers.iter().map(|w| crate::wal::tests::cores_of_thread(w)).collect()
                    }))
                })
                .join()
                .unwrap()
        });
        let workers_cores: Vec<String> = match confined {
            Err(error) => {
                let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
                // The leading digits of the first two parts ("6.18.44-fc", "5.4+").
                let version: Vec<u32> = release
                    .trim()
                    .split('.')
                    .take(2)
                    .map(|part| {
                        let digits = part.find(|c: char| !c.is_ascii_digit()).unwrap_or(part.len());
                        part[..digits].parse().unwrap_or(u32::MAX)
                    })
                    .collect();
                assert!(version < vec![5, 14], "confining the workers failed: {error}");
                eprintln!("Linux {release}: no IORING_REGISTER_IOWQ_AFF (5.14); not checked");
                return;
            }
            Ok(None) => {
                eprintln!("io_uring workers carry another PID namespace's ids; not checked");
                return;
            }
            Ok(Some(workers_cores)) => workers_cores,
        };
        // A sync always runs on a worker.
        assert!(!workers_cores.is_empty(), "the sync ran on no worker of the thread");
        for cores in workers_cores {
            assert_eq!(cores, core.to_string());
        }
    }

    #[test]
    fn many_writes_and_large_writes_land_where_asked_through_the_ring() {
        let Some(mut engine) = engine_if_available() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = FileStorage.create(&path).unwrap();
        // 100 small writes (more than one ring's worth) and one of 3 MiB (48 pieces).
        let small: Vec<Vec<u8>> = (0..100u8).map(|i| vec![i; 3000]).collect();
        let large: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
        let mut ops: Vec<WriteOp<'_>> = small
            .iter()
            .enumerate()
            .map(|(index, buf)| WriteOp {
                file: file.as_ref(),
                path: Path::new("f"),
                buf,
                offset: index as u64 * 3000,
            })
            .collect();
        ops.push(WriteOp {
            file: file.as_ref(),
            path: Path::new("f"),
            buf: &large,
            offset: 300_000,
        });
        let target = SyncTarget { file: file.as_ref(), path: Path::new("f") };
        engine.write_and_sync(&ops, Some(&target)).unwrap();
        let written = std::fs::read(&path).unwrap();
        for (index, buf) in small.iter().enumerate() {
            assert_eq!(&written[index * 3000..(index + 1) * 3000], &buf[..]);
        }
        assert_eq!(&written[300_000..300_000 + large.len()], &large[..]);
        // A sync alone (sealing a segment) works too.
        engine.write_and_sync(&[], Some(&target)).unwrap();
    }
}
