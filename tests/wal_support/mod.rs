//! Shared helpers of the WAL tests: waits for durability without a timeout (the wait that may
//! lead: with `EveryRecord`, only such a wait writes and syncs the group on the waiting thread),
//! bounded from outside, so that a wait that hangs fails the test instead of stalling it; and a
//! storage layer whose syncs wait at a gate the test opens.

#![allow(dead_code)]

#[path = "../skipped_variants/mod.rs"]
mod skipped_variants;

use std::{
    io,
    os::fd::RawFd,
    path::Path,
    sync::{mpsc, Arc},
    time::Duration,
};

use coordbus::wal::{FileStorage, Lsn, Storage, StorageFile, Wal, WalError};

/// How long `work` may take before the test fails: far longer than any sync.
pub const RUN_BOUND: Duration = Duration::from_secs(60);

/// Runs `work` on a thread of its own with a clone of the log and returns its result, failing
/// the test if it has none within [`RUN_BOUND`] (the thread is then left behind). `work`
/// appends and waits with no timeout, right after its appends as a real waiter does, so the
/// waiter may lead.
pub fn bounded<T: Send + 'static>(
    wal: &Arc<Wal>,
    work: impl FnOnce(&Wal) -> T + Send + 'static,
) -> T {
    let wal = Arc::clone(wal);
    within(move || {
        let result = work(&wal);
        // Before answering: the caller may close, drop and reopen the log next.
        drop(wal);
        result
    })
}

/// Runs `work` on a thread of its own and returns its result, failing the test if it has none
/// within [`RUN_BOUND`] (the thread is then left behind): for a call that would hang the test
/// if the bound it is meant to keep regressed.
pub fn within<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(work());
    });
    match receiver.recv_timeout(RUN_BOUND) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the call hung (nothing in {RUN_BOUND:?})"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the calling thread panicked"),
    }
}

/// Joins `threads`, failing the test if any is still running after [`RUN_BOUND`] (an appender
/// stuck in a wait that should have ended).
pub fn join_all_within<T>(threads: Vec<std::thread::JoinHandle<T>>) -> Vec<T> {
    let deadline = std::time::Instant::now() + RUN_BOUND;
    while !threads.iter().all(std::thread::JoinHandle::is_finished) {
        assert!(std::time::Instant::now() < deadline, "threads still running after {RUN_BOUND:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    threads
        .into_iter()
        .map(|thread| thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
        .collect()
}

/// `wal.wait_durable(lsn)` through [`bounded`]. The wait starts a thread's start-up after the
/// append, so the sync thread may write the group first: use [`bounded`] around the appends
/// too where leading matters.
pub fn wait_durable_bounded(wal: &Arc<Wal>, lsn: Lsn) -> Result<(), WalError> {
    bounded(wal, move |wal| wal.wait_durable(lsn))
}

/// A gate that holds threads until the test opens it (each wait bounded by [`RUN_BOUND`]: a
/// test that never opens it fails anyway), counting the threads that reached it.
#[derive(Debug, Default)]
pub struct Gate {
    state: std::sync::Mutex<GateState>,
    changed: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    open: bool,
    arrived: usize,
}

impl Gate {
    pub fn open(&self) {
        self.state.lock().unwrap().open = true;
        self.changed.notify_all();
    }

    pub fn pass(&self) {
        let mut state = self.state.lock().unwrap();
        state.arrived += 1;
        self.changed.notify_all();
        let _state =
            self.changed.wait_timeout_while(state, RUN_BOUND, |state| !state.open).unwrap();
    }

    /// Waits (bounded) until `count` threads have reached the gate: the sync thread is then
    /// known to be held there.
    pub fn wait_until_reached(&self, count: usize) {
        let state = self.state.lock().unwrap();
        let (state, _) = self
            .changed
            .wait_timeout_while(state, RUN_BOUND, |state| state.arrived < count)
            .unwrap();
        assert!(state.arrived >= count, "only {} of {count} reached the gate", state.arrived);
    }
}

/// What a gated file's `sync_data` does once its gate is open.
#[derive(Debug, Clone, Copy)]
pub enum AfterGate {
    /// Syncs the file.
    Sync,
    /// Panics (a broken storage layer).
    Panic,
}

/// The real file system, with each file it creates (a new segment, a spare) wrapped by the
/// function it holds: what the fault-injecting layers of the tests are built on.
pub struct WrappingStorage<W>(pub W);

impl<W> std::fmt::Debug for WrappingStorage<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WrappingStorage")
    }
}

impl<W> Storage for WrappingStorage<W>
where
    W: Fn(Arc<dyn StorageFile>) -> Arc<dyn StorageFile> + Send + Sync + 'static,
{
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        FileStorage.create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok((self.0)(FileStorage.create(path)?))
    }
    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        FileStorage.open_existing(path)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        FileStorage.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        FileStorage.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        FileStorage.sync_dir(dir)
    }
}

/// Real files whose `sync_data` waits at a [`Gate`] first, then does what [`AfterGate`] says.
/// The files hide their descriptors, so the log writes with pwrite: open it with
/// `IoMode::Pwrite`.
pub fn gated_sync_storage(gate: &Arc<Gate>, after: AfterGate) -> Arc<dyn Storage> {
    let gate = Arc::clone(gate);
    Arc::new(WrappingStorage(move |file| -> Arc<dyn StorageFile> {
        Arc::new(GatedSyncFile(file, Arc::clone(&gate), after))
    }))
}

#[derive(Debug)]
struct GatedSyncFile(Arc<dyn StorageFile>, Arc<Gate>, AfterGate);

impl StorageFile for GatedSyncFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.0.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.1.pass();
        match self.2 {
            AfterGate::Sync => self.0.sync_data(),
            AfterGate::Panic => panic!("injected: the storage layer panicked in sync_data"),
        }
    }
    fn allocate(&self, len: u64) -> io::Result<()> {
        self.0.allocate(len)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn raw_fd(&self) -> Option<RawFd> {
        None
    }
}

/// Opens its gate when dropped: declared after the log, it opens the gate before the log's
/// drop waits for its sync thread, also when the test panics (else each held sync would sit
/// out the gate's bound before the failure is reported).
pub struct OpenOnDrop(pub Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// The configuration of the gated logs: group commit (so the sync thread, not an appender,
/// writes and syncs), 1 MiB segments and groups.
pub fn gated_config() -> coordbus::wal::WalConfig {
    coordbus::wal::WalConfig {
        segment_size_bytes: 1 << 20,
        durability: coordbus::wal::Durability::GroupCommit {
            max_delay: Duration::from_micros(200),
            max_bytes: 1 << 20,
        },
        ..coordbus::wal::WalConfig::default()
    }
}

/// A log in `dir` ([`gated_config`]) whose syncs wait at `gate`, then do what `after` says.
/// The pwrite path: the gated files hide their descriptors.
pub fn open_gated(dir: &Path, gate: &Arc<Gate>, after: AfterGate) -> Wal {
    open_gated_with(dir, gate, after, gated_config())
}

/// As [`open_gated`], with `config`.
pub fn open_gated_with(
    dir: &Path,
    gate: &Arc<Gate>,
    after: AfterGate,
    config: coordbus::wal::WalConfig,
) -> Wal {
    let options = coordbus::wal::WalOptions {
        io: coordbus::wal::IoMode::Pwrite,
        storage: gated_sync_storage(gate, after),
        ..coordbus::wal::WalOptions::default()
    };
    Wal::open_with_options(dir, config, options).unwrap()
}

/// Holds `wal`'s sync thread at `gate` (with one record of `payload_bytes`), then fills the
/// staging buffer behind it: records of `payload_bytes`, then of 64 bytes, until an append
/// finds no room for `timeout`. After this, an append of more than about 32 bytes of payload
/// finds no room. Returns the LSNs appended.
pub fn hold_and_fill_staging(
    wal: &Wal,
    gate: &Gate,
    payload_bytes: usize,
    timeout: Duration,
) -> Vec<Lsn> {
    let payload = vec![7u8; payload_bytes];
    let mut appended = vec![wal.append_bytes(&payload, 1).unwrap().0];
    gate.wait_until_reached(1);
    for filler in [&payload[..], &payload[..64]] {
        while let Ok((lsn, _)) = wal.append_bytes_timeout(filler, 1, timeout) {
            appended.push(lsn);
            assert!(appended.len() < 100_000, "the staging buffer never filled");
        }
    }
    appended
}

/// Why the kernel refuses io_uring, if it does: `None` if a log opens on the io_uring path.
/// Only a refusal (no io_uring: `ENOSYS`, or a ring without what the engine needs; not
/// allowed: `EPERM`/`EACCES`; no locked memory left: `ENOMEM`) lets a test skip its io_uring
/// variant; any other setup error is a failure, not a silent skip.
pub fn io_uring_refusal() -> Option<String> {
    use coordbus::wal::{IoMode, WalOptions};
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions { io: IoMode::IoUring, ..WalOptions::default() };
    match Wal::open_with_options(dir.path(), coordbus::wal::WalConfig::default(), options) {
        Ok(_) => None,
        Err(error) if is_kernel_refusal(&error) => Some(error.to_string()),
        Err(other) => {
            panic!("io_uring setup failed, and not because the kernel refuses it: {other:?}")
        }
    }
}

/// Whether `error` is the kernel refusing io_uring: no io_uring, not allowed, or no locked
/// memory left.
pub fn is_kernel_refusal(error: &WalError) -> bool {
    use std::io::ErrorKind;
    matches!(
        error,
        WalError::Io {
            op: "io_uring setup",
            kind: ErrorKind::Unsupported | ErrorKind::PermissionDenied | ErrorKind::OutOfMemory,
            ..
        }
    )
}

/// The I/O path a log opened with `io` must get on this machine: [`IoMode::Auto`] is io_uring
/// unless the kernel refuses it (checked once per test binary). A test of the `Auto` variant
/// asserts it, so that a silent fallback cannot pass as an io_uring run.
pub fn path_of(io: coordbus::wal::IoMode) -> coordbus::wal::IoPath {
    use coordbus::wal::{IoMode, IoPath};
    static KERNEL_ALLOWS_IO_URING: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match io {
        IoMode::Pwrite => IoPath::Pwrite,
        IoMode::IoUring => IoPath::IoUring,
        IoMode::Auto if *KERNEL_ALLOWS_IO_URING.get_or_init(|| io_uring_refusal().is_none()) => {
            IoPath::IoUring
        }
        IoMode::Auto => IoPath::Pwrite,
    }
}

/// Whether a test's io_uring variant runs: only a kernel refusal skips it (printed; a failure
/// with `COORDBUS_REQUIRE_IO_URING=1`, module `skipped_variants`).
pub fn kernel_allows_io_uring() -> bool {
    match io_uring_refusal() {
        None => true,
        Some(reason) => {
            skipped_variants::skip_io_uring_variant(&format!("the kernel refuses it: {reason}"));
            false
        }
    }
}
