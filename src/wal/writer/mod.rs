//! The sync thread: takes the staged group, writes it, syncs it, publishes durability.
//!
//! One thread per log owns all writing, so the order rules of the format (module `wal`) hold
//! by construction:
//! * a group is written in LSN order; a group spanning a roll first writes and syncs the old
//!   segment, then creates the new file and writes the rest (with the pipeline drained);
//! * the durable LSN moves only after a sync covering it (and every earlier LSN) completed;
//! * the first failed write or sync fails the log for good (nothing is retried);
//! * the directory lock (module `wal::lock`) is held from open (or the directory's creation)
//!   until this thread exits.
//!
//! Two kinds of turns: `serial_turn` (one group at a time: the pwrite path) and
//! `pipelined_turn` (the io_uring path: several groups on the ring, described in the `wal`
//! module doc under "Pipelined group commit"). The two I/O paths implement [`IoEngine`]:
//! [`uring::UringEngine`] (which also runs the pipeline) and [`pwrite::PwriteEngine`].
//!
//! ## Leading (`EveryRecord`)
//! The writer's state lives behind a mutex that the sync thread holds only while it works: it
//! releases it when nothing is staged and nothing is in flight, and waits for an appender
//! without it. A thread that calls [`crate::wal::Wal::wait_durable`] with `EveryRecord` takes
//! the free mutex and writes and syncs the staged group itself ([`Writer::lead`]), on its own
//! thread and with the same code as the serial path (on io_uring: one submission, the write
//! linked to its `fdatasync`). Waiting on the sync thread costs three cross-thread wake-ups
//! per record (appender to sync thread, kernel worker to sync thread, sync thread to
//! appender), and on this 2-core class each is tens of microseconds; leading leaves only the
//! kernel worker's. A bare `fdatasync` pays none of them, and that is the yardstick of the
//! `EveryRecord` latency goal. If the writer is busy, the waiter waits: the sync thread
//! publishes the groups it has in flight, and a leader that is done wakes the waiters so that
//! one of them leads next. While waiters lead, appends do not wake the sync thread; it looks
//! for groups nobody led every millisecond (`Shared::wait_for_work`). A leader never runs
//! durability callbacks, not even failed ones: user code could block on the very thread
//! waiting for durability, so it leaves them to the sync thread
//! (`Shared::callbacks_deferred`), which runs them at its next turn.

pub(crate) mod pacing;
pub(crate) mod pwrite;
pub(crate) mod uring;

use std::{
    io::PipeWriter,
    path::{Path, PathBuf},
    sync::{atomic::Ordering, Arc, Mutex},
    time::Instant,
};

use crate::{
    error::WalError,
    wal::{
        lock,
        lock::DirLock,
        reader::SegmentMap,
        recovery,
        segment::{Segment, SegmentHeader},
        storage::StorageFile,
        Chunk, CleanReport, Durability, IoPath, Shared, SyncThreadIds, WriterWait,
    },
};

/// One write of a group: bytes and where they go.
#[derive(Debug)]
pub(crate) struct WriteOp<'a> {
    pub(crate) file: &'a dyn StorageFile,
    pub(crate) path: &'a Path,
    pub(crate) buf: &'a [u8],
    pub(crate) offset: u64,
}

/// The file to `fdatasync` after a group's writes.
#[derive(Debug)]
pub(crate) struct SyncTarget<'a> {
    pub(crate) file: &'a dyn StorageFile,
    pub(crate) path: &'a Path,
}

/// An I/O path: writes every op completely, then (if asked) syncs, and returns only when all
/// of it completed.
pub(crate) trait IoEngine: Send {
    /// Which path this is.
    fn path(&self) -> IoPath;
    /// Writes `ops` fully, then syncs `sync` after all of them completed.
    fn write_and_sync(
        &mut self,
        ops: &[WriteOp<'_>],
        sync: Option<&SyncTarget<'_>>,
    ) -> Result<(), WalError>;
    /// The io_uring engine, which can also pipeline groups.
    fn as_uring(&mut self) -> Option<&mut uring::UringEngine> {
        None
    }
    /// Whether the engine broke (module `uring`, "A broken ring"): a failed `write_and_sync`
    /// may have left writes in flight, so the caller must never free or reuse the buffers it
    /// passed, nor close their files.
    fn is_broken(&self) -> bool {
        false
    }
    /// A handle appenders write to to wake the sync thread while it waits for I/O (pipelining
    /// engines only).
    fn waker(&self) -> Option<PipeWriter> {
        None
    }
}

/// One contiguous range of a group's buffer and where it goes in the segment file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub(crate) buf_start: usize,
    pub(crate) buf_end: usize,
    pub(crate) file_offset: u64,
}

/// What the sync thread publishes once a pipelined group is written, then durable.
#[derive(Debug, Clone)]
pub(crate) struct GroupSummary {
    pub(crate) segment: Arc<Segment>,
    pub(crate) last_lsn: u64,
    /// Segment offset just past the group's last byte.
    pub(crate) end_offset: u64,
    pub(crate) max_time_ms: i64,
    pub(crate) started: Instant,
}

/// A group handed to the io_uring pipeline: it owns its bytes until they are written.
pub(crate) struct RingGroup {
    pub(crate) buf: Vec<u8>,
    pub(crate) runs: Vec<Run>,
    pub(crate) file: Arc<dyn StorageFile>,
    pub(crate) path: PathBuf,
    /// Sync the group (durable modes).
    pub(crate) sync: bool,
    pub(crate) summary: GroupSummary,
}

/// Progress of pipelined groups, reported in LSN order.
pub(crate) enum RingEvent {
    /// Every byte of the group is written (page cache); its buffer comes back for reuse.
    Written { summary: GroupSummary, buf: Vec<u8> },
    /// The group's sync completed (`synced`) or it needed none; every earlier group is done.
    /// `sync_last`: the group is the last one its sync covered (one sync may cover several).
    Done { summary: GroupSummary, synced: bool, sync_last: bool },
    /// A write or sync failed: the log fails, nothing later is reported.
    Failed(WalError),
}

/// What a look at the staging buffer found.
enum Take {
    /// A group was swapped out (`closing`: the log is closing; the group may then be empty).
    Group { closing: bool },
    /// Nothing to take yet: wait, in the ring for I/O if groups are in flight (an appender's
    /// wake-up ends that wait too), else for work without the writer lock.
    Wait,
    /// Other work first (segments to delete): look again without waiting.
    Again,
}

/// What one turn of the sync thread found.
enum Turn {
    /// Take another turn at once.
    Again,
    /// Nothing staged, nothing in flight: wait for work without the writer lock (a leader
    /// may take it meanwhile).
    Idle,
    /// The log is closed and everything written and synced (or the log failed): exit.
    Finished,
}

/// The sync thread's buffers, kept across its turns.
struct TurnBuffers {
    /// The group being taken (swapped with the appenders' staging buffer).
    buf: Vec<u8>,
    chunks: Vec<Chunk>,
    /// Buffers of written pipelined groups, for reuse.
    pool: Vec<Vec<u8>>,
    events: Vec<RingEvent>,
}

/// The segment file the sync thread is writing.
struct OpenSegment {
    segment: Arc<Segment>,
    file: Arc<dyn StorageFile>,
    /// Written since its last sync.
    dirty: bool,
    /// Last LSN written into it.
    last_lsn: u64,
}

/// Fails the log if dropped while a leader's thread unwinds (see [`Writer::lead`]): a broken
/// invariant then ends in a failed log, not in records never written and waiters that wait
/// forever. Callbacks are left to the sync thread: this runs on a user's thread, and during
/// an unwind, where a panicking callback would abort the process.
struct FailOnPanic(Arc<Shared>);

impl Drop for FailOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.fail(
                WalError::Io {
                    op: "lead",
                    path: self.0.dir.clone(),
                    kind: std::io::ErrorKind::Other,
                    message: "a thread writing the log for its own records panicked".into(),
                },
                false,
            );
            self.0.wake_writer_for_callbacks();
        }
    }
}

/// The writer's state: the I/O engine, the segment being written, the directory lock. The
/// sync thread holds it while it works; a leader (module doc, "Leading") while it writes.
pub(crate) struct Writer {
    shared: Arc<Shared>,
    engine: Box<dyn IoEngine>,
    current: Option<OpenSegment>,
    dir_ready: bool,
    /// The directory lock (module `wal::lock`): taken at open if the directory existed, else
    /// when this thread creates it. Dropped when the sync thread exits, after the last sync.
    dir_lock: Option<DirLock>,
    /// A leader's group buffers, kept warm between leads.
    lead_buf: Vec<u8>,
    lead_chunks: Vec<Chunk>,
    /// An appender's thread is writing: durability callbacks are left for the sync thread.
    leading: bool,
    /// The sync thread has exited: nobody writes any more.
    exited: bool,
    /// The last completed sync, for sync pacing (module `pacing`).
    last_sync: Option<pacing::LastSync>,
}

impl Writer {
    /// The writer of `shared`'s log, for the sync thread to run.
    pub(crate) fn new(
        shared: Arc<Shared>,
        engine: Box<dyn IoEngine>,
        dir_lock: Option<DirLock>,
    ) -> Self {
        shared.holds_dir_lock.store(dir_lock.is_some(), Ordering::Release);
        Writer {
            shared,
            engine,
            current: None,
            dir_ready: false,
            dir_lock,
            lead_buf: Vec::new(),
            lead_chunks: Vec::new(),
            leading: false,
            exited: false,
            last_sync: None,
        }
    }
}

/// Moves the appenders' pending group into `buf`/`chunks` (they get the empty buffers back),
/// releases the append lock and wakes appenders waiting for staging space. Returns whether the
/// log is closing.
fn swap_out_group(
    shared: &Shared,
    mut state: std::sync::MutexGuard<'_, crate::wal::AppendState>,
    buf: &mut Vec<u8>,
    chunks: &mut Vec<Chunk>,
) -> bool {
    std::mem::swap(&mut state.buf, buf);
    std::mem::swap(&mut state.chunks, chunks);
    state.group_started = None;
    let closing = state.closing;
    let wake_appenders = !state.room_waiters.is_empty();
    drop(state);
    if wake_appenders {
        shared.space_cv.notify_all();
    }
    closing
}

/// The directories from `dir` up that do not exist yet, deepest first (an error reading one
/// counts as existing: `create_dir_all` reports it).
fn missing_ancestors(dir: &Path) -> Vec<PathBuf> {
    dir.ancestors()
        .filter(|ancestor| !ancestor.as_os_str().is_empty())
        .take_while(|ancestor| matches!(ancestor.try_exists(), Ok(false)))
        .map(Path::to_path_buf)
        .collect()
}

/// The sync thread's body: turns until the log closes. The writer lock is held for each turn
/// and released while the thread waits for work, so that a leader can write meanwhile.
///
/// A panic (a broken invariant, or a storage layer that panics) fails the log before the
/// thread ends, so that waiters, durability callbacks and appenders get the error instead of
/// waiting forever, and marks the thread gone (for `clean` and `Wal::close_timeout`); the
/// panic then goes on, for [`crate::wal::Wal::close`] to report. The
/// callbacks run after the unwind was caught, not during it: one that panicked there would
/// abort the process.
pub(crate) fn run(writer: Arc<Mutex<Writer>>, nice: u8, io_cores: &[usize]) {
    lower_priority(nice);
    let shared = Arc::clone(&lock(&writer).shared);
    let _ = shared.sync_thread.set(SyncThreadIds {
        thread: std::thread::current().id(),
        kernel_tid: rustix::thread::gettid().as_raw_nonzero().get(),
    });
    let turns = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _workers_confined = confine_to_cores(io_cores, lock(&writer).engine.as_mut());
        #[cfg(test)]
        let _ = shared.workers_confined.set(_workers_confined);
        run_turns(&writer)
    }));
    if let Err(panic) = turns {
        // Marked gone after the failure is published, also if a callback run by `fail`
        // panics in turn.
        let _gone = MarkGoneOnDrop(&shared);
        shared.fail(
            WalError::Io {
                op: "sync thread",
                path: shared.dir.clone(),
                kind: std::io::ErrorKind::Other,
                message: "the sync thread panicked".into(),
            },
            true,
        );
        std::panic::resume_unwind(panic);
    }
}

/// Adds `nice` to the calling thread's nice value, capped at 19 (`WalOptions::sync_thread_nice`;
/// on Linux a nice value is per thread). A refusal is logged, not an error: the thread then
/// runs at the priority it inherited.
fn lower_priority(nice: u8) {
    if nice == 0 {
        return;
    }
    let lowered = rustix::process::getpriority_process(None).and_then(|current| {
        rustix::process::setpriority_process(None, (current + i32::from(nice)).min(19))
    });
    if let Err(error) = lowered {
        tracing::warn!(%error, nice, "the WAL's sync thread could not lower its CPU priority");
    }
}

/// Keeps the calling thread (the sync thread) and the io_uring workers that run its ring
/// entries on `cores` (`WalOptions::io_cores`; empty: no change), and returns whether the
/// workers' confinement was registered. A refusal is logged, not an error: if the system
/// refuses the thread's confinement, the thread keeps the opening thread's cores (and its
/// workers too, since Linux 6.2), as an endpoint whose pinning is refused does; if it refuses
/// only the workers', they take the confined thread's cores since Linux 6.2, any core before.
fn confine_to_cores(cores: &[usize], engine: &mut dyn IoEngine) -> bool {
    if cores.is_empty() {
        return false;
    }
    let mut asked = rustix::thread::CpuSet::new();
    // Checked when the log was opened: every id is below `CORE_ID_LIMIT` (`CpuSet::MAX_CPU`).
    cores.iter().for_each(|&core| asked.set(core));
    let confined = rustix::thread::sched_setaffinity(None, &asked)
        .and_then(|()| rustix::thread::sched_getaffinity(None));
    let granted = match confined {
        Ok(granted) => granted,
        Err(error) => {
            tracing::warn!(%error, ?cores, "the WAL's sync thread could not be confined");
            return false;
        }
    };
    // What the thread got (the listed cores that are online and in its cpuset): since Linux
    // 6.7 the workers' mask must lie within the cpuset.
    let granted: Vec<usize> =
        (0..rustix::thread::CpuSet::MAX_CPU).filter(|&core| granted.is_set(core)).collect();
    match engine.as_uring().map(|uring| uring.confine_workers(&granted)) {
        Some(Err(error)) => {
            tracing::warn!(%error, ?granted, "the WAL's io_uring workers could not be confined");
            false
        }
        Some(Ok(())) => true,
        None => false,
    }
}

/// Calls `Shared::writer_gone` when dropped (see [`run`]).
struct MarkGoneOnDrop<'a>(&'a Shared);

impl Drop for MarkGoneOnDrop<'_> {
    fn drop(&mut self) {
        self.0.writer_gone();
    }
}

/// [`run`]'s loop.
fn run_turns(writer: &Mutex<Writer>) {
    let (shared, pipelined) = {
        let mut writer = lock(writer);
        let pipelined = writer.shared.ring_waker.is_some() && writer.engine.as_uring().is_some();
        (Arc::clone(&writer.shared), pipelined)
    };
    let capacity = lock(&shared.append).buf.capacity();
    // The second staging buffer, sized like the first so neither regrows (and re-faults fresh
    // pages) in steady state.
    let mut buffers = TurnBuffers {
        buf: Vec::with_capacity(capacity),
        chunks: Vec::new(),
        pool: Vec::new(),
        events: Vec::new(),
    };
    loop {
        let mut guard = lock(writer);
        // Set only by a leader that panicked (the log is failed then); this thread runs the
        // callbacks itself.
        guard.leading = false;
        shared.run_deferred_callbacks();
        let turn = if pipelined {
            guard.pipelined_turn(&mut buffers)
        } else {
            guard.serial_turn(&mut buffers)
        };
        match turn {
            Turn::Again => {}
            Turn::Idle => {
                drop(guard);
                shared.wait_for_work();
            }
            Turn::Finished => {
                guard.exit();
                return;
            }
        }
    }
}

impl Writer {
    /// Once the loop is over: deletes the spares and what `clean` left, releases the directory
    /// lock and fails the callbacks still waiting.
    fn exit(&mut self) {
        self.exited = true;
        self.current = None;
        // A closed log keeps no spares. Deleted while this process still holds the directory
        // lock, so a writer that takes over never races this process's unlinks; and before the
        // leftover segments below, which are then deleted, not kept.
        self.shared.delete_spares();
        // From now on `clean` deletes by itself; what it queued before is deleted here.
        let order = lock(&self.shared.deleting);
        let leftover_doomed = self.shared.take_doomed(true);
        self.shared.delete_segments(leftover_doomed, &mut CleanReport::default());
        drop(order);
        // Everything is written and synced (or the log failed): another writer may take over.
        self.shared.holds_dir_lock.store(false, Ordering::Release);
        self.dir_lock = None;
        // Callbacks a leader made ready run with `Ok`; the rest can never be durable now.
        self.shared.run_deferred_callbacks();
        let leftover = {
            let mut sync = lock(&self.shared.sync);
            sync.writer_exited = true;
            std::mem::take(&mut sync.callbacks)
        };
        self.shared.durable_cv.notify_all();
        for callback in leftover.into_values().flatten() {
            callback(Err(WalError::Closed));
        }
        self.shared.mark_writer_done();
    }

    /// One group at a time: take, write, sync, publish (the pwrite path).
    fn serial_turn(&mut self, buffers: &mut TurnBuffers) -> Turn {
        self.delete_doomed();
        let closing = match self.take_group(&mut buffers.buf, &mut buffers.chunks) {
            Take::Group { closing } => closing,
            Take::Wait => return Turn::Idle,
            Take::Again => return Turn::Again,
        };
        if buffers.chunks.is_empty() {
            if closing {
                self.finish();
                return Turn::Finished;
            }
            return Turn::Again;
        }
        self.write_group_serial(&mut buffers.buf, &buffers.chunks);
        buffers.buf.clear();
        buffers.chunks.clear();
        Turn::Again
    }

    /// Writes and syncs staged groups on the calling thread until `lsn` is durable (module
    /// doc, "Leading"). Does nothing if groups are in flight (the sync thread publishes
    /// them), if nothing is staged, or if the log is closing, failed or closed. Returns
    /// whether it took a group.
    pub(crate) fn lead(&mut self, lsn: u64) -> bool {
        let idle = self.engine.as_uring().is_none_or(|uring| uring.groups_in_flight() == 0);
        if self.exited || !idle {
            return false;
        }
        // A panic below (a broken invariant) would leave a group taken and never written:
        // the log fails then, rather than go on with a hole in it.
        let _fail_on_panic = FailOnPanic(Arc::clone(&self.shared));
        self.leading = true;
        let mut led = false;
        let mut buf = std::mem::take(&mut self.lead_buf);
        let mut chunks = std::mem::take(&mut self.lead_chunks);
        while self.shared.durable_lsn.load(Ordering::Acquire) < lsn
            && self.shared.failure().is_none()
        {
            let state = lock(&self.shared.append);
            // Closing is the sync thread's to finish; an empty buffer means the group is not
            // staged here (nothing to lead).
            if state.chunks.is_empty() || state.closing {
                break;
            }
            if buf.capacity() == 0 {
                buf.reserve(state.buf.capacity());
            }
            // Under the append lock, where appenders read it (`Shared::leaders_write`).
            self.shared.leaders_active.store(true, Ordering::Relaxed);
            self.shared.led_since_poll.store(true, Ordering::Relaxed);
            swap_out_group(&self.shared, state, &mut buf, &mut chunks);
            led = true;
            if self.write_group_serial(&mut buf, &chunks) {
                self.shared.led_groups.fetch_add(1, Ordering::Relaxed);
            }
            buf.clear();
            chunks.clear();
        }
        self.lead_buf = buf;
        self.lead_chunks = chunks;
        self.leading = false;
        led
    }

    /// Writes one group synchronously (unless the log failed) and counts it. Returns whether
    /// it was written (and synced, in the durable modes). If the engine broke during this
    /// write, `buf` and the segment file being written are leaked ([`IoEngine::is_broken`];
    /// `buf` is left empty). An engine that was broken before got none of them.
    fn write_group_serial(&mut self, buf: &mut Vec<u8>, chunks: &[Chunk]) -> bool {
        if self.shared.failure().is_some() {
            return false;
        }
        let broken_before = self.engine.is_broken();
        let started = Instant::now();
        match self.write_group(buf, chunks) {
            Ok(synced_at) => {
                match synced_at {
                    Some(done) => self.note_sync(started, done),
                    None => self.shared.record_sync_latency(started.elapsed()),
                }
                true
            }
            Err(error) => {
                self.fail(error);
                if !broken_before && self.engine.is_broken() {
                    std::mem::forget(std::mem::take(buf));
                    self.leak_current_file();
                }
                false
            }
        }
    }

    /// Fails the log; a leader leaves the failed callbacks to the sync thread.
    fn fail(&self, error: WalError) {
        self.shared.fail(error, !self.leading);
    }

    /// Several groups on the ring at once (the io_uring path): group k+1's writes are
    /// submitted while group k's `fdatasync` runs. See the module doc of `wal` ("Pipelined
    /// group commit") for the rules. Idle only with nothing in flight.
    fn pipelined_turn(&mut self, buffers: &mut TurnBuffers) -> Turn {
        self.pump(&mut buffers.events, &mut buffers.pool);
        self.delete_doomed();
        let in_flight = self.uring().groups_in_flight();
        let closing = if in_flight == 0 {
            // Nothing on the ring: wait on the staging buffer alone.
            match self.take_group(&mut buffers.buf, &mut buffers.chunks) {
                Take::Group { closing } => closing,
                Take::Wait => return Turn::Idle,
                Take::Again => return Turn::Again,
            }
        } else if in_flight < uring::GROUPS_IN_FLIGHT_MAX {
            match self.try_take_group(&mut buffers.buf, &mut buffers.chunks) {
                Take::Group { closing } => closing,
                Take::Wait => {
                    self.uring().wait(None, true);
                    // Running again: appenders need not wake it (a pipe write each).
                    lock(&self.shared.append).set_writer_wait(WriterWait::Running);
                    return Turn::Again;
                }
                Take::Again => return Turn::Again,
            }
        } else {
            // The pipeline is full: wait for I/O only.
            self.uring().wait(None, false);
            return Turn::Again;
        };
        if buffers.chunks.is_empty() {
            if closing {
                self.drain(&mut buffers.events, &mut buffers.pool);
                self.finish();
                return Turn::Finished;
            }
            return Turn::Again;
        }
        if self.shared.failure().is_none() {
            if self.can_pipeline(&buffers.chunks) {
                let capacity = buffers.buf.capacity();
                let next = buffers.pool.pop().unwrap_or_else(|| Vec::with_capacity(capacity));
                let group_buf = std::mem::replace(&mut buffers.buf, next);
                let group = self.ring_group(group_buf, &buffers.chunks);
                self.uring().submit_group(group);
            } else {
                // A roll, the first group of a segment, the opt-in direct path, or a file
                // without a descriptor: one group at a time, after the ring is empty.
                self.drain(&mut buffers.events, &mut buffers.pool);
                self.write_group_serial(&mut buffers.buf, &buffers.chunks);
            }
        }
        buffers.buf.clear();
        buffers.chunks.clear();
        Turn::Again
    }

    fn uring(&mut self) -> &mut uring::UringEngine {
        self.engine.as_uring().expect("the pipelined loop runs on the io_uring engine")
    }

    /// Reaps completions (without waiting) and publishes what they completed.
    fn pump(&mut self, events: &mut Vec<RingEvent>, pool: &mut Vec<Vec<u8>>) {
        let uring = self.uring();
        uring.poll();
        uring.take_events(events);
        for event in events.drain(..) {
            self.on_event(event, pool);
        }
    }

    /// Waits until every pipelined group is durable (or the log failed).
    fn drain(&mut self, events: &mut Vec<RingEvent>, pool: &mut Vec<Vec<u8>>) {
        loop {
            self.pump(events, pool);
            if self.uring().groups_in_flight() == 0 {
                return;
            }
            self.uring().wait(None, false);
        }
    }

    fn on_event(&mut self, event: RingEvent, pool: &mut Vec<Vec<u8>>) {
        let durable_mode = self.durable_mode();
        match event {
            RingEvent::Written { summary, mut buf } => {
                let segment = &summary.segment;
                segment.max_time_ms.fetch_max(summary.max_time_ms, Ordering::AcqRel);
                segment.last_lsn.store(summary.last_lsn, Ordering::Release);
                segment.end_offset.store(summary.end_offset, Ordering::Release);
                if let Some(current) = self.current.as_mut() {
                    debug_assert!(Arc::ptr_eq(&current.segment, segment));
                    current.last_lsn = summary.last_lsn;
                    current.dirty = true;
                }
                let durable = if durable_mode {
                    self.shared.synced_lsn.load(Ordering::Acquire)
                } else {
                    summary.last_lsn
                };
                self.publish(summary.last_lsn, durable);
                buf.clear();
                pool.push(buf);
            }
            RingEvent::Done { summary, synced, sync_last } => {
                // Before publishing: see `write_group`.
                let done = Instant::now();
                // Counted before it is published (as in `write_group`).
                self.shared.groups.fetch_add(1, Ordering::Relaxed);
                if synced {
                    // Every earlier group is durable too (events come in order), so the
                    // watermark may move to this group's last LSN.
                    if sync_last {
                        self.shared.syncs.fetch_add(1, Ordering::Relaxed);
                    }
                    self.shared.synced_lsn.store(summary.last_lsn, Ordering::Release);
                    self.publish(summary.last_lsn, summary.last_lsn);
                    if let Some(current) = self.current.as_mut() {
                        if current.last_lsn == summary.last_lsn {
                            current.dirty = false;
                        }
                    }
                }
                if synced && sync_last {
                    self.note_sync(summary.started, done);
                } else {
                    self.shared.record_sync_latency(summary.started.elapsed());
                }
            }
            RingEvent::Failed(error) => {
                // Never reported durable, never retried: the log is failed for good. The ring
                // is emptied before the buffers are reused.
                self.fail(error);
                pool.extend(self.uring().abandon());
            }
        }
    }

    /// Whether the staged group can go on the ring behind the groups in flight: it lies
    /// wholly in the segment being written (no roll, no first group of a segment), that file
    /// has a descriptor, and it is not a group the opt-in direct path takes.
    fn can_pipeline(&mut self, chunks: &[Chunk]) -> bool {
        let in_flight = self.uring().groups_in_flight();
        let direct_max_bytes = self.uring().direct_max_bytes();
        let Some(current) = &self.current else {
            return false;
        };
        if current.file.raw_fd().is_none()
            || !chunks.iter().all(|chunk| Arc::ptr_eq(&chunk.segment, &current.segment))
        {
            return false;
        }
        let total: usize = chunks.iter().map(|chunk| chunk.buf_end - chunk.buf_start).sum();
        !(in_flight == 0 && chunks.len() <= 1 && total <= direct_max_bytes)
    }

    fn ring_group(&self, buf: Vec<u8>, chunks: &[Chunk]) -> RingGroup {
        let current = self.current.as_ref().expect("checked by can_pipeline");
        let last = chunks.last().expect("a group is not empty");
        RingGroup {
            buf,
            runs: chunks
                .iter()
                .map(|chunk| Run {
                    buf_start: chunk.buf_start,
                    buf_end: chunk.buf_end,
                    file_offset: chunk.file_offset,
                })
                .collect(),
            file: Arc::clone(&current.file),
            path: current.segment.path.clone(),
            sync: self.durable_mode(),
            summary: GroupSummary {
                segment: Arc::clone(&current.segment),
                last_lsn: last.last_lsn,
                end_offset: last.file_offset + (last.buf_end - last.buf_start) as u64,
                max_time_ms: chunks.iter().map(|chunk| chunk.max_time_ms).max().unwrap_or(i64::MIN),
                started: Instant::now(),
            },
        }
    }

    /// The non-blocking [`Writer::take_group`], called while groups are in flight: swaps a
    /// ready group out, or says to wait (and asks appenders to wake the ring wait).
    fn try_take_group(&mut self, buf: &mut Vec<u8>, chunks: &mut Vec<Chunk>) -> Take {
        let shared = &*self.shared;
        let mut state = lock(&shared.append);
        if shared.has_doomed() {
            state.set_writer_wait(WriterWait::Running);
            return Take::Again;
        }
        if state.chunks.is_empty() {
            if state.closing {
                state.set_writer_wait(WriterWait::Running);
                return Take::Group { closing: true };
            }
            // With group commit a new group's first record needs no wake-up: the groups in
            // flight end this wait, and the group is held until then anyway (below).
            let group_commit = matches!(shared.config.durability, Durability::GroupCommit { .. });
            state.set_writer_wait(if group_commit {
                WriterWait::RingUntilFull
            } else {
                WriterWait::Ring
            });
            return Take::Wait;
        }
        if let Durability::GroupCommit { max_bytes, .. } = shared.config.durability {
            if state.group_may_grow(max_bytes) {
                // Earlier groups are on their way to durability: this one could not become
                // durable before the next sync anyway, so it keeps growing until they are
                // done (then `take_group` applies the delay) or it is full: one write and one
                // wake-up of this thread per sync instead of one per `max_delay`.
                state.set_writer_wait(WriterWait::RingUntilFull);
                return Take::Wait;
            }
        }
        state.set_writer_wait(WriterWait::Running);
        Take::Group { closing: swap_out_group(shared, state, buf, chunks) }
    }

    /// Swaps a staged group into `buf`/`chunks`, first waiting out its group-commit delay and
    /// its pacing (module `pacing`). `Group { closing }` once it swapped (the group may be
    /// empty only when closing); `Wait` when nothing is staged (the caller waits without the
    /// writer lock: `Shared::wait_for_work`).
    fn take_group(&mut self, buf: &mut Vec<u8>, chunks: &mut Vec<Chunk>) -> Take {
        let shared = &*self.shared;
        let mut state = lock(&shared.append);
        let mut paced = false;
        loop {
            // Set again below if this turn paces (a stale `true` only sends a waiter through
            // the append lock).
            shared.pacing.store(false, crate::sync::Ordering::Relaxed);
            if shared.has_doomed() {
                // Segments to delete first (checked under the append lock, which `clean`
                // takes to wake this thread: no wake-up is lost).
                state.set_writer_wait(WriterWait::Running);
                return Take::Again;
            }
            if !state.chunks.is_empty() {
                if let Durability::GroupCommit { max_delay, max_bytes } = shared.config.durability {
                    if state.group_may_grow(max_bytes) {
                        let started = state.group_started.expect("set with the first chunk");
                        let delay_end = started + max_delay;
                        let pace_end = pacing::paced_until(started, self.last_sync, max_delay)
                            .filter(|&pace_end| pace_end > delay_end)
                            .filter(|_| {
                                pacing::hold_unless_awaited(&shared.pacing, || shared.awaited())
                            });
                        let deadline = pace_end.unwrap_or(delay_end);
                        let now = Instant::now();
                        if now < deadline {
                            paced |= pace_end.is_some();
                            state.set_writer_wait(if pace_end.is_some() {
                                WriterWait::Paced
                            } else {
                                WriterWait::Condvar
                            });
                            state = shared
                                .writer_cv
                                .wait_timeout(state, deadline - now)
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .0;
                            continue;
                        }
                    }
                }
                break;
            }
            if state.closing {
                state.set_writer_wait(WriterWait::Running);
                return Take::Group { closing: true };
            }
            return Take::Wait;
        }
        if paced {
            shared.paced_groups.fetch_add(1, Ordering::Relaxed);
        }
        state.set_writer_wait(WriterWait::Running);
        Take::Group { closing: swap_out_group(shared, state, buf, chunks) }
    }

    /// Records how long a group that `started` took to be written and synced (`done`): the
    /// sync-time statistics, and the last sync for pacing (module `pacing`).
    fn note_sync(&mut self, started: Instant, done: Instant) {
        let took = done.saturating_duration_since(started);
        self.shared.record_sync_latency(took);
        self.last_sync = Some(pacing::LastSync { done, took });
    }

    /// Deletes the files of the segments `clean` queued (SPEC E.4: on the log's thread;
    /// failures are logged and not retried).
    fn delete_doomed(&self) {
        // A `clean` that holds the order is selecting (microseconds) or deleting; one that
        // deletes takes the queued segments too. Either way this turn does not wait for it.
        let _order = match self.shared.deleting.try_lock() {
            Ok(order) => order,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        let doomed = self.shared.take_doomed(false);
        if !doomed.is_empty() {
            self.shared.delete_segments(doomed, &mut CleanReport::default());
        }
    }

    /// Publishes progress; a leader leaves the durability callbacks to the sync thread.
    fn publish(&self, written: u64, durable: u64) {
        self.shared.publish(written, durable, !self.leading);
    }

    fn durable_mode(&self) -> bool {
        !matches!(self.shared.config.durability, Durability::None)
    }

    /// Writes one group and publishes its progress. Returns when its sync completed (`None`
    /// without one), taken before its durability is published, so that no record appended
    /// after a waiter saw the group durable counts as appended before that sync (pacing).
    fn write_group(&mut self, buf: &[u8], chunks: &[Chunk]) -> Result<Option<Instant>, WalError> {
        let durable_mode = self.durable_mode();
        let mut synced_at = None;
        let mut index = 0;
        while index < chunks.len() {
            let segment = Arc::clone(&chunks[index].segment);
            if self.current.as_ref().is_none_or(|current| !Arc::ptr_eq(&current.segment, &segment))
            {
                self.seal_current()?;
                if let Some(previous) = &self.current {
                    previous.segment.sealed.store(true, Ordering::Release);
                }
                self.current = Some(self.create_segment(&segment)?);
            }
            let end = index
                + chunks[index..]
                    .iter()
                    .take_while(|chunk| Arc::ptr_eq(&chunk.segment, &segment))
                    .count();
            let run = &chunks[index..end];
            let current = self.current.as_mut().expect("set above");
            let ops: Vec<WriteOp<'_>> = run
                .iter()
                .map(|chunk| WriteOp {
                    file: current.file.as_ref(),
                    path: &segment.path,
                    buf: &buf[chunk.buf_start..chunk.buf_end],
                    offset: chunk.file_offset,
                })
                .collect();
            let sync = (durable_mode && end == chunks.len())
                .then(|| SyncTarget { file: current.file.as_ref(), path: &segment.path });
            self.engine.write_and_sync(&ops, sync.as_ref())?;
            let last = run.last().expect("non-empty run");
            let max_time = run.iter().map(|chunk| chunk.max_time_ms).max().unwrap_or(i64::MIN);
            segment.max_time_ms.fetch_max(max_time, Ordering::AcqRel);
            segment.last_lsn.store(last.last_lsn, Ordering::Release);
            let written_end = last.file_offset + (last.buf_end - last.buf_start) as u64;
            segment.end_offset.store(written_end, Ordering::Release);
            current.last_lsn = last.last_lsn;
            if end == chunks.len() {
                // Counted before it is published: a thread that saw the group durable sees it
                // counted in the stats.
                self.shared.groups.fetch_add(1, Ordering::Relaxed);
            }
            if sync.is_some() {
                current.dirty = false;
                self.shared.syncs.fetch_add(1, Ordering::Relaxed);
                self.shared.synced_lsn.store(last.last_lsn, Ordering::Release);
                synced_at = Some(Instant::now());
                self.publish(last.last_lsn, last.last_lsn);
            } else {
                current.dirty = true;
                let durable = if durable_mode {
                    self.shared.synced_lsn.load(Ordering::Acquire)
                } else {
                    last.last_lsn
                };
                self.publish(last.last_lsn, durable);
            }
            index = end;
        }
        Ok(synced_at)
    }

    /// Syncs the segment being written if it has unsynced bytes (before a roll or at close).
    fn seal_current(&mut self) -> Result<(), WalError> {
        let Some(current) = self.current.as_mut() else {
            return Ok(());
        };
        if current.dirty {
            self.engine.write_and_sync(
                &[],
                Some(&SyncTarget { file: current.file.as_ref(), path: &current.segment.path }),
            )?;
            current.dirty = false;
            let last_lsn = current.last_lsn;
            self.shared.syncs.fetch_add(1, Ordering::Relaxed);
            self.shared.synced_lsn.store(last_lsn, Ordering::Release);
            self.publish(last_lsn, last_lsn);
        }
        Ok(())
    }

    /// Creates (or makes from a spare) and maps the file of `segment`, and makes its name
    /// durable.
    fn create_segment(&mut self, segment: &Arc<Segment>) -> Result<OpenSegment, WalError> {
        let shared = &*self.shared;
        let storage = shared.storage.as_ref();
        if !self.dir_ready {
            // Every directory this creates needs its entry in its parent made durable, not
            // only the log's own (a data log under `<checkpoint>/receivedData/<stream>` may
            // create three levels).
            let created = missing_ancestors(&shared.dir);
            storage
                .create_dir_all(&shared.dir)
                .map_err(|error| WalError::from_io("create directory", &shared.dir, 0, &error))?;
            // A relative path's top directory is an entry of the working directory (its
            // parent reads as the empty path).
            let parents = std::iter::once(shared.dir.as_path())
                .chain(created.iter().map(PathBuf::as_path).filter(|dir| *dir != shared.dir))
                .filter_map(Path::parent)
                .map(|parent| if parent.as_os_str().is_empty() { Path::new(".") } else { parent });
            for parent in parents {
                storage
                    .sync_dir(parent)
                    .map_err(|error| WalError::from_io("sync directory", parent, 0, &error))?;
            }
            if self.dir_lock.is_none() {
                // The directory did not exist at open. Another writer may have created and
                // locked it since (`Locked`), or created it, written its log and let go: this
                // log's recovered state (empty) is then stale (`ChangedSinceOpen`). Nothing is
                // written, not even a failed log's marker, before the lock is held and the
                // directory found free of logs.
                let dir_lock = DirLock::acquire_existing(&shared.dir)?;
                if let Some(found) = recovery::first_log_file(&shared.dir)? {
                    return Err(WalError::ChangedSinceOpen { dir: shared.dir.clone(), found });
                }
                self.dir_lock = Some(dir_lock);
                shared.holds_dir_lock.store(true, Ordering::Release);
            }
            self.dir_ready = true;
        }
        let spare = lock(&shared.spares).files.pop();
        let file = match &spare {
            Some(spare) => self.file_from_spare(spare, segment)?,
            None => self.new_file(segment)?,
        };
        storage
            .sync_dir(&shared.dir)
            .map_err(|error| WalError::from_io("sync directory", &shared.dir, 0, &error))?;
        let map = SegmentMap::open(&segment.path)?;
        let _ = segment.map.set(Arc::new(map));
        if spare.is_some() {
            shared.recycled_segments.fetch_add(1, Ordering::Relaxed);
        }
        tracing::debug!(
            segment = segment.header.id.0,
            path = ?segment.path,
            recycled = spare.is_some(),
            "created WAL segment"
        );
        Ok(OpenSegment {
            segment: Arc::clone(segment),
            file,
            dirty: true,
            last_lsn: segment.header.first_lsn.saturating_sub(1),
        })
    }

    /// A new file for `segment`: created, preallocated, its header written and synced.
    fn new_file(&self, segment: &Segment) -> Result<Arc<dyn StorageFile>, WalError> {
        let size = self.shared.config.segment_size_bytes;
        let file =
            self.shared.storage.create(&segment.path).map_err(|error| {
                WalError::from_io("create segment", &segment.path, size, &error)
            })?;
        file.allocate(size).map_err(|error| {
            WalError::from_io("preallocate segment", &segment.path, size, &error)
        })?;
        self.write_header(file.as_ref(), &segment.path, &segment.header)?;
        Ok(file)
    }

    /// The file of `spare` made into `segment`'s (module `wal`, "Recycled segments"): the
    /// spare's name made durable, the new header (format version 2) written and synced, then
    /// the file renamed. A crash before the rename is durable leaves a spare, which opening
    /// deletes; never a segment file whose header names another segment.
    fn file_from_spare(
        &self,
        spare: &Path,
        segment: &Segment,
    ) -> Result<Arc<dyn StorageFile>, WalError> {
        let shared = &*self.shared;
        let storage = shared.storage.as_ref();
        // The rename that made the file a spare must be durable before the header changes:
        // else a crash could bring back the old segment's name over the new header.
        storage
            .sync_dir(&shared.dir)
            .map_err(|error| WalError::from_io("sync directory", &shared.dir, 0, &error))?;
        let file = storage
            .open_existing(spare)
            .map_err(|error| WalError::from_io("open spare segment", spare, 0, &error))?;
        let header = SegmentHeader { recycled: true, ..segment.header };
        self.write_header(file.as_ref(), spare, &header)?;
        storage
            .rename(spare, &segment.path)
            .map_err(|error| WalError::from_io("rename spare segment", &segment.path, 0, &error))?;
        Ok(file)
    }

    /// Writes and syncs a segment header. It must be durable before any record is written
    /// behind it: recovery treats a last segment with a bad header but valid records as
    /// corruption, which must never be what a crash leaves.
    fn write_header(
        &self,
        file: &dyn StorageFile,
        path: &Path,
        header: &SegmentHeader,
    ) -> Result<(), WalError> {
        let header = header.encode();
        pwrite::write_all_at(&WriteOp { file, path, buf: &header, offset: 0 })?;
        file.sync_data().map_err(|error| WalError::from_io("fdatasync", path, 0, &error))?;
        self.shared.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// At close: syncs what is unsynced (also in `Durability::None`: close makes it durable).
    /// If the engine broke during that sync, the segment file is leaked (its descriptor may
    /// still be looked up by the sync in flight: [`IoEngine::is_broken`]).
    fn finish(&mut self) {
        if self.shared.failure().is_some() {
            return;
        }
        let broken_before = self.engine.is_broken();
        if let Err(error) = self.seal_current() {
            self.fail(error);
            if !broken_before && self.engine.is_broken() {
                self.leak_current_file();
            }
        }
    }

    /// Keeps the current segment's file open for good: after the engine broke, a request in
    /// flight may still look its descriptor up, so the number must never be reused.
    fn leak_current_file(&self) {
        if let Some(current) = &self.current {
            std::mem::forget(Arc::clone(&current.file));
        }
    }
}
