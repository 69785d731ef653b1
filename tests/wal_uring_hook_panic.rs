//! A storage layer whose io_uring hook (`StorageFile::ring_fault` or `ring_completed`) panics
//! while the engine has writes in flight: the log fails with `EIO` instead of unwinding
//! through the engine (which would free buffers the kernel still reads, and lose completions
//! taken off the ring, so that closing the log waited for them forever).
//!
//! Method: the real files, with the descriptor exposed so the io_uring engine writes them, and
//! hooks that count their calls and panic from a chosen call on. Appends come from several
//! threads with group commit, so groups are in flight together on the ring when the panic
//! comes. Every wait, and dropping the log, is bounded: the bug this guards against is a hang.
//! Skipped, with a printed reason, only if the kernel refuses io_uring.

mod wal_support;

use std::{
    io,
    os::fd::RawFd,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use coordbus::wal::{
    Durability, IoMode, IoPath, Lsn, RingFault, RingOp, StorageFile, Wal, WalConfig, WalError,
    WalOptions,
};
use wal_support::{join_all_within, kernel_allows_io_uring, within, WrappingStorage};

/// Which hook panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hook {
    Fault,
    Completed,
}

#[derive(Debug)]
struct Plan {
    hook: Hook,
    /// The hook's calls so far.
    calls: AtomicU64,
    /// It panics from this call on (1-based).
    panic_from: u64,
}

impl Plan {
    fn call(&self, hook: Hook) {
        if hook == self.hook && self.calls.fetch_add(1, Ordering::SeqCst) + 1 >= self.panic_from {
            panic!("injected: the storage layer's {hook:?} hook panics");
        }
    }
}

#[derive(Debug)]
struct PanickingFile {
    inner: Arc<dyn StorageFile>,
    plan: Arc<Plan>,
}

impl StorageFile for PanickingFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.inner.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()
    }
    fn allocate(&self, len: u64) -> io::Result<()> {
        self.inner.allocate(len)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn raw_fd(&self) -> Option<RawFd> {
        self.inner.raw_fd()
    }
    fn ring_fault(&self, _: RingOp) -> Option<RingFault> {
        self.plan.call(Hook::Fault);
        None
    }
    fn ring_completed(&self, _: RingOp, _: i32) {
        self.plan.call(Hook::Completed);
    }
}

/// How the system names `EIO` in an error's text.
const EIO: &str = "os error 5";

const THREADS: u64 = 4;
const RECORDS_PER_THREAD: u64 = 400;

/// Appends from [`THREADS`] threads, each waiting for its records in batches of 8, until the
/// log fails; returns the records acknowledged durable (LSN, payload) and the first error.
fn append_until_failed(wal: &Arc<Wal>) -> (Vec<(Lsn, Vec<u8>)>, Vec<WalError>) {
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let wal = Arc::clone(wal);
            std::thread::spawn(move || {
                let mut acknowledged = Vec::new();
                let mut batch = Vec::new();
                for index in 0..RECORDS_PER_THREAD {
                    let payload = format!("thread {thread} record {index}").into_bytes();
                    match wal.append_bytes(&payload, 1) {
                        Ok((lsn, _)) => batch.push((lsn, payload)),
                        Err(error) => return (acknowledged, Some(error)),
                    }
                    if batch.len() == 8 {
                        let last = batch.last().unwrap().0;
                        if let Err(error) = wal.wait_durable_timeout(last, Duration::from_secs(30))
                        {
                            return (acknowledged, Some(error));
                        }
                        acknowledged.append(&mut batch);
                    }
                }
                (acknowledged, None)
            })
        })
        .collect();
    let mut acknowledged = Vec::new();
    let mut errors = Vec::new();
    for (records, error) in join_all_within(threads) {
        acknowledged.extend(records);
        errors.extend(error);
    }
    (acknowledged, errors)
}

fn panicking_hook_fails_the_log_with_eio(hook: Hook) {
    let dir = tempfile::tempdir().unwrap();
    let plan = Arc::new(Plan { hook, calls: AtomicU64::new(0), panic_from: 40 });
    let config = WalConfig {
        segment_size_bytes: 1 << 20,
        durability: Durability::GroupCommit {
            max_delay: Duration::from_micros(200),
            max_bytes: 1 << 20,
        },
        ..WalConfig::default()
    };
    let options = WalOptions {
        io: IoMode::IoUring,
        uring_direct_max_bytes: 0,
        storage: {
            let plan = Arc::clone(&plan);
            Arc::new(WrappingStorage(move |inner| -> Arc<dyn StorageFile> {
                Arc::new(PanickingFile { inner, plan: Arc::clone(&plan) })
            }))
        },
        ..WalOptions::default()
    };
    let wal = Arc::new(Wal::open_with_options(dir.path(), config, options).unwrap());
    assert_eq!(wal.io_path(), IoPath::IoUring);
    let (acknowledged, errors) = append_until_failed(&wal);
    assert!(
        plan.calls.load(Ordering::SeqCst) >= plan.panic_from,
        "{hook:?}: the hook never panicked"
    );
    assert!(!errors.is_empty(), "{hook:?}: the log did not fail");
    for error in &errors {
        assert!(
            matches!(error.root_cause(), WalError::Io { message, .. } if message.contains(EIO)),
            "{hook:?}: expected the failure as EIO, got {error:?}"
        );
    }
    // Dropping the last handle closes the log and drains the ring: bounded.
    within(move || drop(wal));
    let reopened = Wal::open(dir.path(), WalConfig::default()).unwrap();
    let kept: std::collections::HashMap<Lsn, Vec<u8>> = reopened
        .iter_from(Lsn::ZERO)
        .unwrap()
        .map(|record| {
            let record = record.unwrap();
            (record.lsn, record.bytes.to_vec())
        })
        .collect();
    for (lsn, payload) in &acknowledged {
        assert_eq!(kept.get(lsn), Some(payload), "{hook:?}: acknowledged record {lsn} lost");
    }
}

#[test]
fn a_panicking_fault_hook_fails_the_log_with_eio_and_keeps_what_was_acknowledged() {
    if kernel_allows_io_uring() {
        panicking_hook_fails_the_log_with_eio(Hook::Fault);
    }
}

#[test]
fn a_panicking_completion_hook_fails_the_log_with_eio_and_keeps_what_was_acknowledged() {
    if kernel_allows_io_uring() {
        panicking_hook_fails_the_log_with_eio(Hook::Completed);
    }
}
