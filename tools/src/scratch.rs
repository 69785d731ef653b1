//! Scratch directories (temporary WALs, the crash tester's work directory), removed when the
//! tool ends, also when it is interrupted.
//!
//! A load run can write gigabytes of WAL segments. `tempfile::TempDir` removes its directory
//! when dropped, but a signal ends the process without running destructors, and Ctrl-C is how
//! an operator stops a run that takes too long. So every [`ScratchDir`] is also listed here,
//! and [`remove_on_interrupt`] installs a handler (SIGINT, SIGTERM, SIGHUP) that removes the
//! listed directories and exits with status 130. The names start with the tool's name
//! (`coordbus-load-...`), not tempfile's hidden `.tmp...`, so one left by `kill -9` is easy to
//! find.
//!
//! A directory given for scratch directories to be made in (`--dir`) must exist already
//! ([`check_parent_dir`]): creating a missing one would leave it behind after the run, and a
//! typo would write the run's gigabytes somewhere nobody looks.
//!
//! The handler runs on its own thread while the tool goes on, so it holds the list's lock to
//! the end (a directory made meanwhile waits for it, and the process exits first), first kills
//! the child processes listed with [`ChildGuard`] (a crash tester's child would otherwise go
//! on writing into the directory), and removes until nothing is left: a WAL's sync thread can
//! still create a file, or the directory itself again, while it is being removed.

use std::{
    io,
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard, PoisonError},
};

/// The exit status after an interruption: 128 + SIGINT, as shells report Ctrl-C, whichever
/// of the three signals came (the handler is not told which).
pub const INTERRUPTED_STATUS: i32 = 130;

/// How many times a removal is tried when files appear meanwhile (a WAL's sync thread can
/// still create a segment while the handler removes its directory).
const REMOVAL_ATTEMPTS: usize = 10;

/// The scratch directories alive now.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The child processes to kill before the directories are removed.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while listing leaves a consistent list (single pushes and removals).
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn live() -> MutexGuard<'static, Vec<PathBuf>> {
    lock(&LIVE)
}

/// Installs the handler that removes the scratch directories on SIGINT, SIGTERM or SIGHUP
/// and exits with [`INTERRUPTED_STATUS`]. Without it (the handler could not be installed,
/// which is logged), an interrupted run leaves its directories behind.
pub fn remove_on_interrupt() {
    if let Err(error) = ctrlc::set_handler(on_interrupt) {
        tracing::warn!(
            %error,
            "no interrupt handler: an interrupted run leaves its scratch directories"
        );
    }
}

fn on_interrupt() {
    // Held until the exit: no directory is listed, nor unlisted, behind the handler's back.
    let dirs = live();
    kill_children();
    let mut removed = 0;
    for dir in dirs.iter() {
        match remove_all(dir) {
            Ok(()) => removed += 1,
            Err(error) => eprintln!("interrupted; could not remove {}: {error}", dir.display()),
        }
    }
    eprintln!("interrupted; removed {removed} of {} scratch directories", dirs.len());
    std::process::exit(INTERRUPTED_STATUS);
}

/// Kills the listed child processes and waits for each to end, so that none writes into a
/// directory being removed.
fn kill_children() {
    for &pid in lock(&CHILDREN).iter() {
        let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) else {
            continue;
        };
        if rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok() {
            let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
        }
    }
}

/// Removes `dir` and everything in it, again while it (or a file in it) reappears: a writer
/// still running can create a file, or the directory itself, meanwhile. A directory already
/// gone counts as removed.
fn remove_all(dir: &Path) -> io::Result<()> {
    let mut attempt = 1;
    loop {
        let removed = match std::fs::remove_dir_all(dir) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(error),
        };
        match removed {
            Ok(()) if !dir.exists() => return Ok(()),
            Err(error) if attempt >= REMOVAL_ATTEMPTS => return Err(error),
            Ok(()) if attempt >= REMOVAL_ATTEMPTS => {
                return Err(io::Error::other("it was created again while being removed"))
            }
            _ => {
                attempt += 1;
                std::thread::sleep(REMOVAL_PAUSE);
            }
        }
    }
}

/// Between two removals of a directory that reappeared: long enough for a writer's file
/// creation in flight to land.
const REMOVAL_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);

/// A child process listed for [`remove_on_interrupt`]'s handler to kill (and wait for) before
/// it removes the directories; unlisted when dropped.
#[derive(Debug)]
pub struct ChildGuard(u32);

impl ChildGuard {
    /// Lists the child process `pid`.
    pub fn new(pid: u32) -> Self {
        lock(&CHILDREN).push(pid);
        Self(pid)
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        lock(&CHILDREN).retain(|&listed| listed != self.0);
    }
}

/// Checks that `parent`, given with the flag `flag` (`--dir`), is an existing directory, to
/// make scratch directories in.
///
/// # Errors
/// `NotFound` ("FLAG PATH does not exist"), `NotADirectory` ("FLAG PATH is not a directory"),
/// or what reading its metadata failed with.
pub fn check_parent_dir(flag: &str, parent: &Path) -> io::Result<()> {
    let named = |kind: io::ErrorKind, what: &str| {
        io::Error::new(kind, format!("{flag} {} {what}", parent.display()))
    };
    match std::fs::metadata(parent) {
        Ok(metadata) if metadata.is_dir() => Ok(()),
        Ok(_) => Err(named(io::ErrorKind::NotADirectory, "is not a directory")),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            Err(named(io::ErrorKind::NotFound, "does not exist"))
        }
        Err(error) => Err(named(error.kind(), &format!("cannot be read: {error}"))),
    }
}

/// A fresh directory, removed when dropped or when the tool is interrupted.
#[derive(Debug)]
pub struct ScratchDir {
    /// `None` once kept or closed.
    dir: Option<tempfile::TempDir>,
}

impl ScratchDir {
    /// A new directory `PREFIX...` inside `parent`.
    ///
    /// # Errors
    /// What creating it failed with.
    pub fn new_in(parent: &Path, prefix: &str) -> io::Result<Self> {
        // Listed under the same guard it is made under: an interrupt in between would find it
        // on disk and not listed, and leave it behind.
        let mut live = live();
        let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(parent)?;
        live.push(dir.path().to_path_buf());
        Ok(Self { dir: Some(dir) })
    }

    /// A new directory `PREFIX...` inside the system's temporary directory.
    ///
    /// # Errors
    /// What creating it failed with.
    pub fn new(prefix: &str) -> io::Result<Self> {
        Self::new_in(&std::env::temp_dir(), prefix)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("only keep and close take the directory, by value").path()
    }

    /// Keeps the directory (also on interruption) and returns its path.
    pub fn keep(mut self) -> PathBuf {
        let dir = self.take();
        dir.keep()
    }

    /// Keeps the directory if the tool is interrupted (the operator asked to keep it), and
    /// still removes it when dropped.
    pub fn keep_on_interrupt(&self) {
        forget(self.path());
    }

    /// Removes the directory now.
    ///
    /// # Errors
    /// What removing it failed with.
    pub fn close(mut self) -> io::Result<()> {
        self.take().close()
    }

    fn take(&mut self) -> tempfile::TempDir {
        let dir = self.dir.take().expect("only keep and close take the directory, by value");
        forget(dir.path());
        dir
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take() {
            // Removed, then unlisted: an interruption in between still finds it listed, and
            // finishes the removal.
            let path = dir.path().to_path_buf();
            drop(dir);
            forget(&path);
        }
    }
}

/// Takes `path` off the list of directories to remove on interruption.
fn forget(path: &Path) {
    live().retain(|listed| listed != path);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(path: &Path) -> bool {
        live().iter().any(|listed| listed == path)
    }

    #[test]
    fn a_scratch_dir_is_listed_while_alive_and_removed_when_dropped() {
        let parent = tempfile::tempdir().unwrap();
        let scratch = ScratchDir::new_in(parent.path(), "coordbus-test-").unwrap();
        let path = scratch.path().to_path_buf();
        assert!(path.file_name().unwrap().to_str().unwrap().starts_with("coordbus-test-"));
        assert!(path.is_dir() && listed(&path));
        drop(scratch);
        assert!(!path.exists() && !listed(&path));
    }

    #[test]
    fn a_kept_scratch_dir_stays_and_is_no_longer_listed() {
        let parent = tempfile::tempdir().unwrap();
        let scratch = ScratchDir::new_in(parent.path(), "coordbus-test-").unwrap();
        let path = scratch.keep();
        assert!(path.is_dir() && !listed(&path));

        let scratch = ScratchDir::new_in(parent.path(), "coordbus-test-").unwrap();
        scratch.keep_on_interrupt();
        let path = scratch.path().to_path_buf();
        assert!(!listed(&path));
        drop(scratch);
        assert!(!path.exists(), "dropped, it is still removed");
    }

    #[test]
    fn removing_takes_the_files_inside_and_a_missing_directory_is_no_error() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("segments");
        std::fs::create_dir_all(dir.join("nested")).unwrap();
        std::fs::write(dir.join("nested").join("seg-1.wal"), b"bytes").unwrap();
        remove_all(&dir).unwrap();
        assert!(!dir.exists());
        remove_all(&dir).unwrap();
    }

    #[test]
    fn a_parent_dir_must_exist_and_be_a_directory() {
        let parent = tempfile::tempdir().unwrap();
        check_parent_dir("--dir", parent.path()).unwrap();
        let missing = parent.path().join("missing");
        let error = check_parent_dir("--dir", &missing).unwrap_err();
        assert_eq!(error.to_string(), format!("--dir {} does not exist", missing.display()));
        assert!(!missing.exists(), "checked, not created");
        let file = parent.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let error = check_parent_dir("--dir", &file).unwrap_err();
        assert_eq!(error.to_string(), format!("--dir {} is not a directory", file.display()));
    }
}
