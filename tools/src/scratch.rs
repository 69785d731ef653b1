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

use std::{
    io,
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard, PoisonError},
};

/// The exit status after an interruption (128 + SIGINT, as shells report Ctrl-C).
pub const INTERRUPTED_STATUS: i32 = 130;

/// How many times a removal is tried when files appear meanwhile (a WAL's sync thread can
/// still create a segment while the handler removes its directory).
const REMOVAL_ATTEMPTS: usize = 10;

/// The scratch directories alive now.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn live() -> MutexGuard<'static, Vec<PathBuf>> {
    // A panic while listing leaves a consistent list (single pushes and removals).
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Installs the handler that removes the scratch directories on SIGINT, SIGTERM or SIGHUP
/// and exits with [`INTERRUPTED_STATUS`]. Without it (the handler could not be installed,
/// which is logged), an interrupted run leaves its directories behind.
pub fn remove_on_interrupt() {
    if let Err(error) = ctrlc::set_handler(on_interrupt) {
        tracing::warn!(%error, "no interrupt handler: an interrupted run leaves its scratch directories");
    }
}

fn on_interrupt() {
    let dirs = std::mem::take(&mut *live());
    for dir in &dirs {
        if let Err(error) = remove_all(dir) {
            eprintln!("interrupted; could not remove {}: {error}", dir.display());
        }
    }
    eprintln!("interrupted; removed {} scratch directories", dirs.len());
    std::process::exit(INTERRUPTED_STATUS);
}

/// Removes `dir` and everything in it, trying again while files appear meanwhile; a directory
/// already gone is removed.
fn remove_all(dir: &Path) -> io::Result<()> {
    let mut attempt = 1;
    loop {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => return Ok(()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(error) if attempt >= REMOVAL_ATTEMPTS => return Err(error),
            Err(_) => attempt += 1,
        }
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
        let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(parent)?;
        live().push(dir.path().to_path_buf());
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
            forget(dir.path());
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
}
