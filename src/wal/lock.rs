//! The writer's lock on a log directory: at most one `Wal` writes a directory at a time.
//!
//! The lock is an exclusive `flock(2)` (std's [`File::try_lock`]) on the log directory itself,
//! opened read-only. Why the directory and not a lock file inside it: SPEC E.3 says creating
//! the log object must not create the directory or any file (only a write does), and a lock
//! file would have to be created to be locked. Linux accepts `flock` on a directory descriptor
//! on every local file system. Why `flock`: the kernel drops it when the last descriptor of its
//! open file description closes, so a writer killed with `kill -9` never leaves a stale lock
//! (the crash tests reopen right after the kill), and two opens in one process conflict just
//! like two processes (each open has its own description). Descriptors are close-on-exec, so a
//! child process does not keep the lock, but between its `fork` and its `exec` it holds a copy
//! of every descriptor of the parent, and with it the lock's description: a log closed while
//! another thread of the process spawns a child can stay locked for that moment. So a writer
//! that finds the directory locked retries for up to [`LOCK_GRACE`] before it reports
//! [`WalError::Locked`] (a bounded wait; a real second writer still fails, only later).
//!
//! When it is taken:
//! * [`Wal::open`](crate::wal::Wal::open) on an existing directory takes it before recovery
//!   touches anything, and fails with [`WalError::Locked`] if another writer holds it.
//! * On a missing directory there is nothing to lock yet: the sync thread takes the lock right
//!   after creating the directory, before writing any segment. If another writer got there
//!   first, the log fails with [`WalError::Locked`] as its cause and writes nothing; if another
//!   writer got there first and has let go since, leaving its log, the log fails with
//!   [`WalError::ChangedSinceOpen`] and writes nothing either (its recovered state is stale).
//!
//! It is released when the sync thread exits (at close or drop, after the last sync), so after
//! `close` returns another writer can open the directory. Read-only opens (tools) take no lock
//! on the directory; [`is_locked`] tells them whether a live writer holds it (its tail may then
//! be in flight). Their mappings hold shared locks on the segment files they map, so that a
//! live writer never reuses such a file as a spare (module `reader`).

use std::{
    fs::{File, TryLockError},
    io,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

use crate::error::WalError;

/// How long a writer retries a held lock before it reports [`WalError::Locked`] (see the
/// module doc: a child process between `fork` and `exec` holds it briefly).
pub(crate) const LOCK_GRACE: std::time::Duration = std::time::Duration::from_millis(200);

/// An exclusive lock on a log directory, released on drop.
#[derive(Debug)]
pub(crate) struct DirLock {
    /// The locked directory, opened read-only; closing it releases the lock.
    _file: File,
    dir: PathBuf,
}

impl DirLock {
    /// Locks `dir`, or returns `Ok(None)` if it does not exist (yet).
    ///
    /// # Errors
    /// [`WalError::Locked`] if another writer holds the lock, [`WalError::Io`] if the
    /// directory cannot be opened or locked.
    pub(crate) fn try_acquire(dir: &Path) -> Result<Option<DirLock>, WalError> {
        Self::try_acquire_within(dir, LOCK_GRACE, &AtomicU32::new(0))
    }

    /// [`DirLock::try_acquire`], retrying for up to `grace`; counts the tries that found the
    /// lock held in `busy_tries`.
    fn try_acquire_within(
        dir: &Path,
        grace: std::time::Duration,
        busy_tries: &AtomicU32,
    ) -> Result<Option<DirLock>, WalError> {
        let file = match open_directory(dir) {
            Ok(file) => file,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(WalError::from_io("open directory to lock", dir, 0, &error)),
        };
        let deadline = std::time::Instant::now() + grace;
        let mut pause = std::time::Duration::from_micros(100);
        loop {
            match file.try_lock() {
                Ok(()) => {
                    tracing::debug!(dir = ?dir, "locked the WAL directory");
                    return Ok(Some(DirLock { _file: file, dir: dir.to_path_buf() }));
                }
                Err(TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    busy_tries.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(10));
                }
                Err(TryLockError::WouldBlock) => {
                    return Err(WalError::Locked { dir: dir.to_path_buf() })
                }
                Err(TryLockError::Error(error)) => {
                    return Err(WalError::from_io("lock directory", dir, 0, &error))
                }
            }
        }
    }

    /// Locks `dir`, which must exist.
    ///
    /// # Errors
    /// As [`DirLock::try_acquire`], plus [`WalError::Io`] (not found) if `dir` is missing.
    pub(crate) fn acquire_existing(dir: &Path) -> Result<DirLock, WalError> {
        Self::try_acquire(dir)?.ok_or_else(|| WalError::Io {
            op: "lock directory",
            path: dir.to_path_buf(),
            kind: io::ErrorKind::NotFound,
            message: "the directory vanished right after it was created".into(),
        })
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        tracing::debug!(dir = ?self.dir, "released the WAL directory lock");
    }
}

/// Opens `dir` read-only to lock it, failing with `ENOTDIR` if it is not a directory: a plain
/// `File::open` of a named pipe would block until a writer opened it (`O_NONBLOCK` as well,
/// should the kernel ever check the type later).
fn open_directory(dir: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NONBLOCK)
        .open(dir)
}

/// Whether a writer (in this or another process) holds the lock on `dir`. A missing directory
/// is not locked. The answer may be stale by the time it is read; tools use it to explain what
/// they see (a live writer's tail may be in flight), not to synchronize.
///
/// # Errors
/// [`WalError::Io`] if the directory cannot be opened or the lock state cannot be read.
pub fn is_locked(dir: impl AsRef<Path>) -> Result<bool, WalError> {
    let dir = dir.as_ref();
    let file = match open_directory(dir) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(error) => return Err(WalError::from_io("open directory", dir, 0, &error)),
    };
    // A shared lock conflicts only with a writer's exclusive one; it is released when `file`
    // closes at the end of this function.
    match file.try_lock_shared() {
        Ok(()) => Ok(false),
        Err(TryLockError::WouldBlock) => Ok(true),
        Err(TryLockError::Error(error)) => Err(WalError::from_io("probe lock", dir, 0, &error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A named pipe is not a directory: probing or locking it fails at once instead of
    /// blocking in `open` until a writer opens the pipe.
    #[test]
    fn a_named_pipe_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success(), "mkfifo: {made}");
        let (sender, receiver) = std::sync::mpsc::channel();
        let probed = fifo.clone();
        std::thread::spawn(move || {
            let _ =
                sender.send((is_locked(&probed).is_err(), DirLock::try_acquire(&probed).is_err()));
        });
        let refused = receiver
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the probe and the lock returned instead of blocking");
        assert_eq!(refused, (true, true), "both refuse a named pipe");
    }

    #[test]
    fn a_directory_is_locked_once_and_free_after_release() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_locked(dir.path()).unwrap());
        let lock = DirLock::try_acquire(dir.path()).unwrap().expect("the directory exists");
        assert!(is_locked(dir.path()).unwrap());
        match DirLock::try_acquire(dir.path()) {
            Err(WalError::Locked { dir: locked }) => assert_eq!(locked, dir.path()),
            other => panic!("expected Locked, got {other:?}"),
        }
        drop(lock);
        // Polled: a child process another test spawns holds a copy of the lock's descriptor
        // between its fork and its exec (module doc).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while is_locked(dir.path()).unwrap() {
            assert!(std::time::Instant::now() < deadline, "still locked after the release");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(DirLock::try_acquire(dir.path()).unwrap().is_some());
    }

    #[test]
    fn a_missing_directory_is_neither_locked_nor_created() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("wal");
        assert!(DirLock::try_acquire(&missing).unwrap().is_none());
        assert!(!is_locked(&missing).unwrap());
        assert!(!missing.exists());
    }

    /// A lock released within the grace period (as a forked child's copy is, at its exec) is
    /// taken, not reported as held; the holder here releases it once the waiter found it held.
    #[test]
    fn a_lock_released_within_the_grace_period_is_taken() {
        use std::{
            sync::{mpsc, Arc},
            time::{Duration, Instant},
        };
        // Long enough that no scheduling delay runs it out.
        const GRACE: Duration = Duration::from_secs(30);
        let dir = tempfile::tempdir().unwrap();
        let lock = DirLock::try_acquire(dir.path()).unwrap().expect("the directory exists");
        let path = dir.path().to_path_buf();
        let busy_tries = Arc::new(AtomicU32::new(0));
        let (done_tx, done_rx) = mpsc::channel();
        {
            let busy_tries = Arc::clone(&busy_tries);
            std::thread::spawn(move || {
                let _ = done_tx.send(DirLock::try_acquire_within(&path, GRACE, &busy_tries));
            });
        }
        let deadline = Instant::now() + GRACE;
        while busy_tries.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "the waiter never found the lock held");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(lock);
        let acquired = done_rx.recv_timeout(GRACE * 2).expect("the waiter hung");
        assert!(acquired.unwrap().is_some(), "the released lock was not taken");
    }
}
