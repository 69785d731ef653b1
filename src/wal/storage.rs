//! The file layer the WAL writes through, as a trait so tests can inject failures.
//!
//! The sync thread creates, writes, preallocates, syncs, renames and deletes segment files only
//! through [`Storage`] and [`StorageFile`]. [`FileStorage`] is the real implementation (std
//! files plus `fallocate`). A test wraps it to fail an `fdatasync` with EIO, shorten writes, or
//! report ENOSPC, and checks the log's reaction (SPEC 0.6: a failed sync fails the log for good).
//!
//! Reading does not go through this layer: readers map the files read-only (`reader`).
//! The io_uring engine writes through the file descriptor from [`StorageFile::raw_fd`]; a
//! storage that returns `None` there is written through [`StorageFile::write_at`] and synced
//! through [`StorageFile::sync_data`] even when io_uring is the live path. To inject faults on
//! the io_uring path itself, a wrapper returns the real descriptor and answers
//! [`StorageFile::ring_fault`]: the engine asks it before each write and `fdatasync` it submits
//! to the ring, and a [`RingFault`] turns that submission into a failed one (the entry is
//! replaced by a no-op whose completion carries the injected errno) or a short write (the
//! entry writes fewer bytes than asked). Everything after the submission (completion
//! handling, the failure rule, publishing) is the live code. After each completion the engine
//! reports its result to [`StorageFile::ring_completed`], so a test can model what a power
//! loss keeps on the io_uring path too (`tests/wal_power_loss.rs`).

use std::{
    fmt::Debug,
    fs::{File, OpenOptions},
    io,
    os::{
        fd::{AsRawFd, RawFd},
        unix::fs::FileExt,
    },
    path::Path,
    sync::Arc,
};

/// A directory of files, as the WAL's sync thread uses it.
pub trait Storage: Send + Sync + Debug + 'static {
    /// Creates `dir` and its missing parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Creates a new file (failing if it exists), open for writing.
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Opens an existing file for writing (used to cut a torn tail during recovery).
    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Deletes a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Renames a file within the directory, replacing `to` if it exists.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes the directory's entries (created or deleted files) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// One open file.
pub trait StorageFile: Send + Sync + Debug {
    /// Writes some of `buf` at `offset`; returns how many bytes were written (may be fewer).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// `fdatasync`: makes written data durable.
    fn sync_data(&self) -> io::Result<()>;
    /// Reserves `len` bytes of disk for the file (`fallocate`), extending its size.
    fn allocate(&self, len: u64) -> io::Result<()>;
    /// Sets the file's length (truncating or extending with zeros).
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// The descriptor io_uring may write and sync through, or `None` to force the methods
    /// above.
    fn raw_fd(&self) -> Option<RawFd>;
    /// Fault injection on the io_uring path: called by the io_uring engine for each `op` it is
    /// about to submit for this file. `None` (the default, and what real files answer)
    /// submits it unchanged. A panic here is caught: the operation fails with `EIO` (the log
    /// fails), since unwinding with writes in flight would free buffers the kernel reads.
    fn ring_fault(&self, op: RingOp) -> Option<RingFault> {
        let _ = op;
        None
    }
    /// Observation on the io_uring path: called by the io_uring engine with the result of
    /// each `op` it submitted for this file, once it reaped the completion (in the order it
    /// reaps them): bytes written (a write) or 0 (a sync), or a negative errno, the injected
    /// one included. `op` is the one [`StorageFile::ring_fault`] was given (a write's full
    /// length, even where an injected short write submitted fewer bytes). The default ignores
    /// it; a storage layer that models what a power loss keeps uses it to learn when the
    /// kernel finished a write or a sync. A panic here is caught, as in
    /// [`StorageFile::ring_fault`]: the operation then counts as failed with `EIO`.
    fn ring_completed(&self, op: RingOp, result: i32) {
        let _ = (op, result);
    }
}

/// An operation the io_uring engine is about to submit (see [`StorageFile::ring_fault`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RingOp {
    /// A write of `len` bytes at `offset`.
    Write {
        /// File offset of the first byte.
        offset: u64,
        /// Bytes to write.
        len: usize,
    },
    /// An `fdatasync`.
    SyncData {
        /// The kernel starts it only after every write submitted before it completed (it is
        /// drained, or linked behind the only write in flight). Otherwise it covers only the
        /// writes whose completions the engine reaped before submitting it.
        ordered: bool,
    },
}

/// How [`StorageFile::ring_fault`] changes a submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RingFault {
    /// Submit a no-op in its place and report this errno (e.g. `libc::EIO`, `libc::ENOSPC`)
    /// as the operation's result: nothing is written or synced.
    Errno(i32),
    /// For a write: submit only the first this many bytes (a short write; at least 1).
    ShortWrite(usize),
}

/// The real file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct FileStorage;

/// A real file.
#[derive(Debug)]
pub struct RealFile(File);

impl RealFile {
    /// Wraps an open file.
    pub fn new(file: File) -> Self {
        Self(file)
    }

    /// The wrapped file.
    pub fn file(&self) -> &File {
        &self.0
    }
}

impl Storage for FileStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        Ok(Arc::new(RealFile(file)))
    }

    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Arc::new(RealFile(file)))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

impl StorageFile for RealFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.0.write_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn allocate(&self, len: u64) -> io::Result<()> {
        let len_off = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length over off_t"))?;
        // posix_fallocate reserves blocks (so ENOSPC shows up here, not on a later write) and
        // falls back to writing zeros on file systems without fallocate.
        match crate::wal::writer::uring::posix_fallocate(self.0.as_raw_fd(), len_off) {
            0 => Ok(()),
            code => Err(io::Error::from_raw_os_error(code)),
        }
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn raw_fd(&self) -> Option<RawFd> {
        Some(self.0.as_raw_fd())
    }
}
