//! The io_uring write path: one submission per group, writes in parallel, the sync drained.
//!
//! A group's bytes are cut into writes of at most [`WRITE_CHUNK_BYTES`], pushed to the
//! submission queue with no links between them (ANCHORS: chaining the writes with IO_LINK
//! serializes them and runs at a third of the speed), followed by one `fdatasync` flagged
//! `IO_DRAIN`, so the kernel starts the sync only after every earlier write completed. One
//! `io_uring_enter` submits the lot and waits for all completions. A short or failed write is
//! finished with `pwrite` afterwards and synced again, so the durability claim never rests on a
//! sync that ran before all bytes were written.
//!
//! By default every group goes through the ring. As an opt-in tuning, a group that is a single
//! write of at most `WalOptions::uring_direct_max_bytes` (typical of `EveryRecord` and of light
//! load) can be written with `pwrite` and synced with `fdatasync` directly: with nothing to
//! overlap, the ring only adds a hop to the kernel worker thread that executes the sync.
//! [`DIRECT_GROUP_BYTES`] is the size measured to pay off here.
//!
//! This module also holds the writer's other system-call glue (`posix_fallocate`); it is one of
//! the three modules allowed to use `unsafe` (STYLE.md).

#![allow(unsafe_code)]

use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types, IoUring};

use crate::{
    error::WalError,
    wal::{
        storage::{RingFault, RingOp, StorageFile},
        writer::{
            pwrite::{sync_file, write_all_at},
            IoEngine, SyncTarget, WriteOp,
        },
        IoPath,
    },
};

/// Largest single write submitted (1 MiB: the size ANCHORS measured best).
pub const WRITE_CHUNK_BYTES: usize = 1 << 20;
/// A good value for the opt-in `WalOptions::uring_direct_max_bytes`: groups of one write up to
/// this size are then written and synced with plain system calls.
pub const DIRECT_GROUP_BYTES: usize = 64 << 10;
const RING_ENTRIES: u32 = 64;
const SYNC_USER_DATA: u64 = u64::MAX;

/// Writes and syncs through an io_uring instance owned by the sync thread.
pub struct UringEngine {
    ring: IoUring,
    /// Groups of one write up to this many bytes bypass the ring (0: none do).
    direct_max_bytes: usize,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine").finish_non_exhaustive()
    }
}

impl UringEngine {
    /// Sets up a ring.
    ///
    /// # Errors
    /// The kernel's error (ENOSYS without io_uring, EPERM under seccomp or when disabled).
    pub fn new(direct_max_bytes: usize) -> std::io::Result<Self> {
        Ok(Self { ring: IoUring::new(RING_ENTRIES)?, direct_max_bytes })
    }
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

    fn write_and_sync(
        &mut self,
        ops: &[WriteOp<'_>],
        sync: Option<&SyncTarget<'_>>,
    ) -> Result<(), WalError> {
        // Files without a descriptor go through their storage methods. A group that is one
        // small write has nothing to overlap: io_uring would only add the hop to the kernel
        // worker that runs the fdatasync, so it is written and synced directly.
        let total: usize = ops.iter().map(|op| op.buf.len()).sum();
        if ops.iter().any(|op| op.file.raw_fd().is_none())
            || sync.is_some_and(|target| target.file.raw_fd().is_none())
            || (ops.len() <= 1 && total <= self.direct_max_bytes)
        {
            return super::pwrite::PwriteEngine.write_and_sync(ops, sync);
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
        let room = RING_ENTRIES as usize - 1;
        let batches: Vec<&[Piece]> =
            if pieces.is_empty() { vec![&[]] } else { pieces.chunks(room).collect() };
        let batch_count = batches.len();
        for (batch_index, batch) in batches.into_iter().enumerate() {
            let with_sync = sync.filter(|_| batch_index + 1 == batch_count);
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
                    // SAFETY: the buffer `op.buf[piece.start..piece.start + len]` is borrowed
                    // from `ops` for this whole call, and this function does not return before
                    // every submitted entry completed (submit_and_wait below waits for all), so
                    // the kernel never reads freed memory. The descriptor belongs to a file the
                    // caller keeps open for the call. The queue has room: at most
                    // RING_ENTRIES - 1 writes plus one sync are pushed per round.
                    unsafe { submission.push(&entry) }.expect("ring has room for the batch");
                    expected += 1;
                }
                if let Some(target) = with_sync {
                    let fd = target.file.raw_fd().expect("checked above");
                    let (entry, fault) = sync_entry(target.file, fd);
                    sync_injected = fault;
                    let entry = entry.flags(squeue::Flags::IO_DRAIN).user_data(SYNC_USER_DATA);
                    // SAFETY: an fsync entry carries no buffer; the descriptor stays open for
                    // the call, which waits for the completion below.
                    unsafe { submission.push(&entry) }.expect("ring has room for the sync");
                    expected += 1;
                }
            }
            let mut completed = 0usize;
            while completed < expected {
                match self.ring.submit_and_wait(expected - completed) {
                    Ok(_) => {}
                    Err(error)
                        if error.kind() == std::io::ErrorKind::Interrupted
                            || matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                    }
                    Err(error) => {
                        // The ring itself failed; entries may still be in flight, so the
                        // buffers must not be released: this is a broken invariant.
                        panic!("io_uring_enter failed with entries in flight: {error}");
                    }
                }
                for entry in self.ring.completion() {
                    completed += 1;
                    if entry.user_data() == SYNC_USER_DATA {
                        let result = sync_injected.unwrap_or(entry.result());
                        let target = with_sync.expect("a sync was submitted");
                        if result < 0 {
                            let error = std::io::Error::from_raw_os_error(-result);
                            first_error.get_or_insert(WalError::from_io(
                                "fdatasync",
                                target.path,
                                0,
                                &error,
                            ));
                        } else {
                            synced = true;
                        }
                        continue;
                    }
                    let slot = entry.user_data() as usize;
                    let piece = batch[slot];
                    let result = injected[slot].unwrap_or(entry.result());
                    if result < 0 {
                        let error = std::io::Error::from_raw_os_error(-result);
                        if error.kind() == std::io::ErrorKind::Interrupted {
                            leftovers.push(piece);
                        } else {
                            let op = &ops[piece.op];
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
            }
        }
        if let Some(error) = first_error {
            return Err(error);
        }
        if leftovers.is_empty() {
            if sync.is_some() && !synced {
                unreachable!("the sync completion was counted");
            }
            return Ok(());
        }
        // Finish short writes, then sync again: the drained sync may have run before them.
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
    match file.ring_fault(RingOp::Write { offset: file_offset, len }) {
        None => {}
        Some(RingFault::Errno(errno)) => return (opcode::Nop::new().build(), Some(-errno.abs())),
        Some(RingFault::ShortWrite(max)) => len = len.min(max.max(1)),
    }
    let len = u32::try_from(len).expect("pieces are at most 1 MiB");
    let entry = opcode::Write::new(types::Fd(fd), buf[piece.start..].as_ptr(), len)
        .offset(file_offset)
        .build();
    (entry, None)
}

/// The ring entry for `fdatasync` of `fd`, or a no-op with an injected errno (see
/// [`write_entry`]).
fn sync_entry(file: &dyn StorageFile, fd: RawFd) -> (squeue::Entry, Option<i32>) {
    match file.ring_fault(RingOp::SyncData) {
        Some(RingFault::Errno(errno)) => (opcode::Nop::new().build(), Some(-errno.abs())),
        _ => (opcode::Fsync::new(types::Fd(fd)).flags(types::FsyncFlags::DATASYNC).build(), None),
    }
}

/// `posix_fallocate(fd, 0, len)`: reserves the blocks of a new segment. Returns 0 or an errno.
pub(crate) fn posix_fallocate(fd: RawFd, len: libc::off_t) -> i32 {
    // SAFETY: posix_fallocate takes no pointers, so it cannot touch this process's memory; `fd`
    // is borrowed from a live `File` for the duration of the call.
    unsafe { libc::posix_fallocate(fd, 0, len) }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::wal::storage::{FileStorage, Storage};

    #[test]
    fn many_writes_and_large_writes_land_where_asked_through_the_ring() {
        let Ok(mut engine) = UringEngine::new(0) else {
            eprintln!("io_uring unavailable here; the pwrite path covers this machine");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = FileStorage.create(&path).unwrap();
        // 100 small writes (more than one ring's worth) and one of 3 MiB (three pieces).
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
