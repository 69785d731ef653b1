//! The sync thread: takes the staged group, writes it, syncs it, publishes durability.
//!
//! One thread per log owns all writing, so writes and syncs never race each other and the
//! order rules of the format (module `wal`) hold by construction:
//! * a group is written in LSN order; a group spanning a roll first writes and syncs the old
//!   segment, then creates the new file and writes the rest;
//! * the durable LSN moves only after the sync covering it completed;
//! * the first failed write or sync fails the log for good (nothing is retried).
//!
//! The two I/O paths implement [`IoEngine`]: [`uring::UringEngine`] and
//! [`pwrite::PwriteEngine`].

pub(crate) mod pwrite;
pub(crate) mod uring;

use std::{
    path::Path,
    sync::{atomic::Ordering, Arc},
    time::Instant,
};

use crate::{
    error::WalError,
    wal::{
        lock, lock::DirLock, reader::SegmentMap, segment::Segment, storage::StorageFile, Chunk,
        Durability, IoPath, Shared,
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

struct Writer {
    shared: Arc<Shared>,
    engine: Box<dyn IoEngine>,
    current: Option<OpenSegment>,
    dir_ready: bool,
    /// The directory lock (module `wal::lock`): taken at open if the directory existed, else
    /// when this thread creates it. Dropped when this thread exits, after the last sync.
    dir_lock: Option<DirLock>,
}

/// The sync thread's body; returns when the log closes.
pub(crate) fn run(shared: Arc<Shared>, engine: Box<dyn IoEngine>, dir_lock: Option<DirLock>) {
    let mut writer = Writer { shared, engine, current: None, dir_ready: false, dir_lock };
    // The second staging buffer, sized like the first so neither regrows (and re-faults fresh
    // pages) in steady state.
    let mut spare_buf: Vec<u8> = Vec::with_capacity(lock(&writer.shared.append).buf.capacity());
    let mut spare_chunks: Vec<Chunk> = Vec::new();
    loop {
        let Some(closing) = writer.take_group(&mut spare_buf, &mut spare_chunks) else {
            continue;
        };
        if spare_chunks.is_empty() {
            if closing {
                writer.finish();
                break;
            }
            continue;
        }
        if writer.shared.failure().is_none() {
            let started = Instant::now();
            match writer.write_group(&spare_buf, &spare_chunks) {
                Ok(()) => {
                    writer.shared.groups.fetch_add(1, Ordering::Relaxed);
                    writer.shared.record_sync_latency(started.elapsed());
                }
                Err(error) => writer.shared.fail(error),
            }
        }
        spare_buf.clear();
        spare_chunks.clear();
    }
    // Everything is written and synced (or the log failed): another writer may take over.
    writer.dir_lock = None;
    let leftover = {
        let mut sync = lock(&writer.shared.sync);
        sync.writer_exited = true;
        std::mem::take(&mut sync.callbacks)
    };
    writer.shared.durable_cv.notify_all();
    for callback in leftover.into_values().flatten() {
        callback(Err(WalError::Closed));
    }
}

impl Writer {
    /// Waits for a group and swaps it into `buf`/`chunks`. Returns `Some(closing)` once it
    /// swapped (the group may be empty only when closing), `None` to look again.
    fn take_group(&mut self, buf: &mut Vec<u8>, chunks: &mut Vec<Chunk>) -> Option<bool> {
        let shared = &*self.shared;
        let mut state = lock(&shared.append);
        loop {
            if !state.chunks.is_empty() {
                if let Durability::GroupCommit { max_delay, max_bytes } = shared.config.durability {
                    if !state.closing && state.buf.len() < max_bytes {
                        let deadline =
                            state.group_started.expect("set with the first chunk") + max_delay;
                        let now = Instant::now();
                        if now < deadline {
                            state.writer_idle = true;
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
                state.writer_idle = false;
                return Some(true);
            }
            state.writer_idle = true;
            state = shared.writer_cv.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        state.writer_idle = false;
        std::mem::swap(&mut state.buf, buf);
        std::mem::swap(&mut state.chunks, chunks);
        state.group_started = None;
        let closing = state.closing;
        let wake_appenders = state.space_waiters > 0;
        drop(state);
        if wake_appenders {
            shared.space_cv.notify_all();
        }
        Some(closing)
    }

    fn durable_mode(&self) -> bool {
        !matches!(self.shared.config.durability, Durability::None)
    }

    /// Writes one group and publishes its progress.
    fn write_group(&mut self, buf: &[u8], chunks: &[Chunk]) -> Result<(), WalError> {
        let durable_mode = self.durable_mode();
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
            if sync.is_some() {
                current.dirty = false;
                self.shared.syncs.fetch_add(1, Ordering::Relaxed);
                self.shared.synced_lsn.store(last.last_lsn, Ordering::Release);
                self.shared.publish(last.last_lsn, last.last_lsn);
            } else {
                current.dirty = true;
                let durable = if durable_mode {
                    self.shared.synced_lsn.load(Ordering::Acquire)
                } else {
                    last.last_lsn
                };
                self.shared.publish(last.last_lsn, durable);
            }
            index = end;
        }
        Ok(())
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
            self.shared.syncs.fetch_add(1, Ordering::Relaxed);
            self.shared.synced_lsn.store(current.last_lsn, Ordering::Release);
            self.shared.publish(current.last_lsn, current.last_lsn);
        }
        Ok(())
    }

    /// Creates, preallocates and maps the file of `segment`, and makes its name durable.
    fn create_segment(&mut self, segment: &Arc<Segment>) -> Result<OpenSegment, WalError> {
        let shared = &*self.shared;
        let storage = shared.storage.as_ref();
        if !self.dir_ready {
            storage
                .create_dir_all(&shared.dir)
                .map_err(|error| WalError::from_io("create directory", &shared.dir, 0, &error))?;
            if let Some(parent) =
                shared.dir.parent().filter(|parent| !parent.as_os_str().is_empty())
            {
                storage
                    .sync_dir(parent)
                    .map_err(|error| WalError::from_io("sync directory", parent, 0, &error))?;
            }
            if self.dir_lock.is_none() {
                // The directory did not exist at open; another writer may have created and
                // locked it since. Nothing is written before the lock is held.
                self.dir_lock = Some(DirLock::acquire_existing(&shared.dir)?);
            }
            self.dir_ready = true;
        }
        let size = shared.config.segment_size_bytes;
        let file = storage
            .create(&segment.path)
            .map_err(|error| WalError::from_io("create segment", &segment.path, size, &error))?;
        file.allocate(size).map_err(|error| {
            WalError::from_io("preallocate segment", &segment.path, size, &error)
        })?;
        let header = segment.header.encode();
        pwrite::write_all_at(&WriteOp {
            file: file.as_ref(),
            path: &segment.path,
            buf: &header,
            offset: 0,
        })?;
        // The header (and the preallocation) must be durable before any record is written
        // behind it: recovery treats a last segment with a bad header but valid records as
        // corruption, which must never be what a crash leaves.
        file.sync_data()
            .map_err(|error| WalError::from_io("fdatasync", &segment.path, 0, &error))?;
        self.shared.syncs.fetch_add(1, Ordering::Relaxed);
        storage
            .sync_dir(&shared.dir)
            .map_err(|error| WalError::from_io("sync directory", &shared.dir, 0, &error))?;
        let map = SegmentMap::open(&segment.path)?;
        let _ = segment.map.set(Arc::new(map));
        tracing::debug!(segment = segment.header.id.0, path = ?segment.path, "created WAL segment");
        Ok(OpenSegment {
            segment: Arc::clone(segment),
            file,
            dirty: true,
            last_lsn: segment.header.first_lsn.saturating_sub(1),
        })
    }

    /// At close: syncs what is unsynced (also in `Durability::None`: close makes it durable).
    fn finish(&mut self) {
        if self.shared.failure().is_some() {
            return;
        }
        if let Err(error) = self.seal_current() {
            self.shared.fail(error);
        }
    }
}
