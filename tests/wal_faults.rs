//! Fault injection through the WAL's storage trait: fsync failure (EIO), disk full (ENOSPC on
//! preallocation and on write), short writes, on both I/O paths.
//!
//! Goal (SPEC 0.6): after a failed sync the log accepts no more writes and never reports the
//! failed records durable; disk full is a clear error; records acknowledged before the failure
//! are intact after reopening; short writes are completed, not lost.
//! Method: a `FaultStorage` wraps the real file layer and fails on command. Every test runs
//! twice: on the pwrite path (the fault file hides its descriptor, so writes and syncs go
//! through `write_at`/`sync_data`, which fail) and with the io_uring writer live (the fault
//! file exposes the real descriptor and answers `ring_fault`, so the writes and `fdatasync`s
//! submitted to the ring complete with the injected EIO/ENOSPC or are shortened). The uring
//! variant checks that the ring really consulted the fault plan; it is skipped, with a printed
//! reason, only if the kernel refuses io_uring.

mod wal_support;

use std::{
    io,
    os::fd::RawFd,
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use coordbus::wal::{
    Durability, FileStorage, IoMode, IoPath, Lsn, RingFault, RingOp, SegmentId, Storage,
    StorageFile, UnsyncedCut, Wal, WalConfig, WalError, WalOptions, UNSYNCED_MARKER,
    UNSYNCED_MARKER_TEMP,
};
use wal_support::{bounded, kernel_allows_io_uring, wait_durable_bounded};

/// Bound of a durability wait with a timeout: far longer than a sync; a wait that has not
/// returned by then is hung, and fails the test instead of hanging it.
const WAIT_BOUND: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct Faults {
    /// Fail every fdatasync with EIO.
    sync_eio: AtomicBool,
    /// Fail preallocation with ENOSPC.
    allocate_enospc: AtomicBool,
    /// Fail writes with ENOSPC.
    write_enospc: AtomicBool,
    /// Write at most this many bytes per call (0: no limit).
    short_write_bytes: AtomicU64,
    /// Successful syncs (either path).
    syncs: AtomicU64,
    /// Fail every sync from this one on (1-based count of syncs asked for; 0: never).
    fail_sync_from: AtomicU64,
    /// Fail this one sync only (1-based count of syncs asked for; 0: none).
    fail_one_sync: AtomicU64,
    /// Complete the next ring write with this errno instead (0: none), once.
    ring_write_errno_once: std::sync::atomic::AtomicI32,
    /// Syncs asked for (either path).
    sync_requests: AtomicU64,
    /// Operations the io_uring engine submitted after asking the fault plan.
    ring_ops: AtomicU64,
    /// Expose the descriptor so the io_uring engine writes the file itself.
    ring: bool,
}

impl Faults {
    /// Counts a sync request; true if the plan fails it.
    fn planned_sync_failure(&self) -> bool {
        let number = self.sync_requests.fetch_add(1, Ordering::SeqCst) + 1;
        let from = self.fail_sync_from.load(Ordering::SeqCst);
        (from > 0 && number >= from) || number == self.fail_one_sync.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
struct FaultStorage {
    faults: Arc<Faults>,
}

#[derive(Debug)]
struct FaultFile {
    inner: Arc<dyn StorageFile>,
    faults: Arc<Faults>,
}

impl Storage for FaultStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        FileStorage.create_dir_all(dir)
    }

    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(Arc::new(FaultFile {
            inner: FileStorage.create(path)?,
            faults: Arc::clone(&self.faults),
        }))
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

impl StorageFile for FaultFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        if self.faults.write_enospc.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let limit = self.faults.short_write_bytes.load(Ordering::SeqCst) as usize;
        let buf = if limit > 0 && buf.len() > limit { &buf[..limit] } else { buf };
        self.inner.write_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        if self.faults.sync_eio.load(Ordering::SeqCst) || self.faults.planned_sync_failure() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.faults.syncs.fetch_add(1, Ordering::SeqCst);
        self.inner.sync_data()
    }

    fn allocate(&self, len: u64) -> io::Result<()> {
        if self.faults.allocate_enospc.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.inner.allocate(len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn raw_fd(&self) -> Option<RawFd> {
        if self.faults.ring {
            self.inner.raw_fd()
        } else {
            None
        }
    }

    fn ring_fault(&self, op: RingOp) -> Option<RingFault> {
        self.faults.ring_ops.fetch_add(1, Ordering::SeqCst);
        match op {
            RingOp::SyncData { .. }
                if self.faults.sync_eio.load(Ordering::SeqCst)
                    || self.faults.planned_sync_failure() =>
            {
                Some(RingFault::Errno(libc::EIO))
            }
            RingOp::SyncData { .. } => {
                self.faults.syncs.fetch_add(1, Ordering::SeqCst);
                None
            }
            RingOp::Write { .. } if self.faults.write_enospc.load(Ordering::SeqCst) => {
                Some(RingFault::Errno(libc::ENOSPC))
            }
            RingOp::Write { .. }
                if self.faults.ring_write_errno_once.load(Ordering::SeqCst) != 0 =>
            {
                Some(RingFault::Errno(self.faults.ring_write_errno_once.swap(0, Ordering::SeqCst)))
            }
            RingOp::Write { len, .. } => {
                let limit = self.faults.short_write_bytes.load(Ordering::SeqCst) as usize;
                (limit > 0 && len > limit).then_some(RingFault::ShortWrite(limit))
            }
            _ => None,
        }
    }
}

/// The two write paths every test runs on.
#[derive(Debug, Clone, Copy)]
enum IoVariant {
    Pwrite,
    Uring,
}

/// Runs `test` on both paths (the uring one only if the kernel allows io_uring).
fn on_both_paths(test: impl Fn(IoVariant)) {
    test(IoVariant::Pwrite);
    if kernel_allows_io_uring() {
        test(IoVariant::Uring);
    }
}

/// After a test: on the uring path, the ring must have asked the fault plan (so the faults hit
/// the live io_uring writer, not a fallback).
fn assert_path_used(wal: &Wal, faults: &Faults) {
    if faults.ring {
        assert_eq!(wal.io_path(), IoPath::IoUring);
        assert!(faults.ring_ops.load(Ordering::SeqCst) > 0, "the ring never saw the fault plan");
    } else {
        assert_eq!(wal.io_path(), IoPath::Pwrite);
        assert_eq!(faults.ring_ops.load(Ordering::SeqCst), 0);
    }
}

fn open_faulty(
    path: IoVariant,
    dir: &Path,
    durability: Durability,
    segment_size_bytes: u64,
) -> (Wal, Arc<Faults>) {
    let ring = matches!(path, IoVariant::Uring);
    let faults = Arc::new(Faults { ring, ..Faults::default() });
    let wal = Wal::open_with_options(
        dir,
        WalConfig { segment_size_bytes, durability, ..WalConfig::default() },
        WalOptions {
            io: if ring { IoMode::IoUring } else { IoMode::Pwrite },
            storage: Arc::new(FaultStorage { faults: Arc::clone(&faults) }),
            ..WalOptions::default()
        },
    )
    .unwrap();
    (wal, faults)
}

fn records(dir: &Path) -> Vec<Vec<u8>> {
    let wal =
        Wal::open(dir, WalConfig { segment_size_bytes: 4096, ..WalConfig::default() }).unwrap();
    wal.iter_from(Lsn::ZERO).unwrap().map(|record| record.unwrap().bytes.to_vec()).collect()
}

#[test]
fn a_failed_fsync_fails_the_log_for_good_and_keeps_acknowledged_records() {
    on_both_paths(a_failed_fsync_fails_the_log_for_good_on);
}

fn a_failed_fsync_fails_the_log_for_good_on(path: IoVariant) {
    for durability in [Durability::default(), Durability::EveryRecord] {
        let dir = tempfile::tempdir().unwrap();
        let (wal, faults) = open_faulty(path, dir.path(), durability, 1 << 20);
        let wal = Arc::new(wal);
        let (acked, _) = wal.append_bytes(b"acknowledged", 1).unwrap();
        wait_durable_bounded(&wal, acked).unwrap();
        faults.sync_eio.store(true, Ordering::SeqCst);
        let (doomed, _) = wal.append_bytes(b"doomed", 2).unwrap();
        let error = wal.wait_durable_timeout(doomed, Duration::from_secs(10)).unwrap_err();
        match error.root_cause() {
            WalError::Io { op, message, .. } => {
                assert_eq!(*op, "fdatasync");
                assert!(message.contains("Input/output error"), "{message}");
            }
            other => panic!("expected the fdatasync error, got {other:?}"),
        }
        assert!(wal.durable_lsn() < doomed, "a failed sync never reports success");
        // Even once the device recovers, nothing is retried and nothing more is accepted.
        faults.sync_eio.store(false, Ordering::SeqCst);
        assert!(matches!(wal.append_bytes(b"later", 3), Err(WalError::Failed { .. })));
        let (sender, receiver) = std::sync::mpsc::channel();
        wal.notify_when_durable(doomed, Box::new(move |result| sender.send(result).unwrap()));
        assert!(receiver.recv_timeout(Duration::from_secs(10)).unwrap().is_err());
        assert!(matches!(wal.close(), Err(WalError::Failed { .. })));
        assert!(wal.durable_lsn() < doomed);
        assert_path_used(&wal, &faults);
        drop(wal);
        // The failure left its durable LSN: the doomed record, which the page cache still
        // holds (the injected EIO dropped nothing), is cut on opening, since on a real disk
        // it may never have been written (module `wal`, "Durability order").
        let marker = dir.path().join(UNSYNCED_MARKER);
        assert_eq!(std::fs::read_to_string(&marker).unwrap(), format!("{}\n", acked.0));
        assert!(
            !dir.path().join(UNSYNCED_MARKER_TEMP).exists(),
            "the marker is written to a temporary file, then renamed into place"
        );
        let wal =
            Wal::open(dir.path(), WalConfig { segment_size_bytes: 4096, ..WalConfig::default() })
                .unwrap();
        assert_eq!(
            wal.recovery_report().unsynced_cut,
            Some(UnsyncedCut { durable_lsn: acked, records_discarded: 1, segments_removed: 0 })
        );
        assert!(!marker.exists(), "the marker goes once the cut is durable");
        let (next, _) = wal.append_bytes(b"next", 4).unwrap();
        assert_eq!(next, Lsn(acked.0 + 1), "LSNs continue after the last durable one");
        wait_durable_bounded(&Arc::new(wal), next).unwrap();
        assert_eq!(records(dir.path()), [&b"acknowledged"[..], b"next"]);
    }
}

#[test]
fn disk_full_on_preallocation_is_a_clear_error() {
    on_both_paths(disk_full_on_preallocation_on);
}

fn disk_full_on_preallocation_on(path: IoVariant) {
    let dir = tempfile::tempdir().unwrap();
    let (wal, faults) = open_faulty(path, dir.path(), Durability::EveryRecord, 4096);
    let wal = Arc::new(wal);
    let mut acknowledged = Vec::new();
    for index in 0..20u8 {
        let (lsn, _) = wal.append_bytes(&[index; 100], 0).unwrap();
        wait_durable_bounded(&wal, lsn).unwrap();
        acknowledged.push(vec![index; 100]);
    }
    faults.allocate_enospc.store(true, Ordering::SeqCst);
    // Fill the current segment and roll: the new segment cannot be preallocated.
    let mut failure = None;
    for _ in 0..100 {
        match wal.append_bytes(&[0xee; 100], 0) {
            Ok((lsn, _)) => {
                if let Err(error) = wait_durable_bounded(&wal, lsn) {
                    failure = Some(error);
                    break;
                }
            }
            Err(error) => {
                failure = Some(error);
                break;
            }
        }
    }
    let failure = failure.expect("the roll hits the full disk");
    assert!(
        matches!(failure.root_cause(), WalError::DiskFull { op: "preallocate segment", .. }),
        "{failure:?}"
    );
    assert!(failure.to_string().contains("disk full"), "{failure}");
    let later = wal.append_bytes(b"x", 0).unwrap_err();
    assert!(matches!(later.root_cause(), WalError::DiskFull { .. }));
    // The roll never created the next segment's file, so the first segment is still the newest
    // file on disk: a clean, however far, keeps it (a reopened log continues its LSNs from it;
    // with no segment left they started again at 1).
    let cleaned = wal.clean_below_lsn(Lsn(u64::MAX), true).unwrap();
    assert!(cleaned.deleted.is_empty(), "{cleaned:?}");
    let _ = wal.close();
    assert_path_used(&wal, &faults);
    drop(wal);
    let found = records(dir.path());
    assert!(found.len() >= 20, "{} records found", found.len());
    assert_eq!(&found[..20], &acknowledged[..]);
}

#[test]
fn disk_full_on_write_is_a_clear_error() {
    on_both_paths(disk_full_on_write_on);
}

fn disk_full_on_write_on(path: IoVariant) {
    let dir = tempfile::tempdir().unwrap();
    let (wal, faults) = open_faulty(path, dir.path(), Durability::default(), 1 << 20);
    let (acked, _) = wal.append_bytes(b"before", 0).unwrap();
    wal.wait_durable_timeout(acked, WAIT_BOUND).unwrap();
    faults.write_enospc.store(true, Ordering::SeqCst);
    let (lsn, _) = wal.append_bytes(b"after", 0).unwrap();
    let error = wal.wait_durable_timeout(lsn, WAIT_BOUND).unwrap_err();
    assert!(matches!(error.root_cause(), WalError::DiskFull { op: "write", .. }), "{error:?}");
    assert!(error.to_string().contains("disk full"), "{error}");
    assert!(wal.durable_lsn() < lsn);
    assert!(matches!(wal.append_bytes(b"later", 0), Err(WalError::Failed { .. })));
    assert_path_used(&wal, &faults);
    drop(wal);
    assert_eq!(records(dir.path()), vec![b"before".to_vec()]);
}

#[test]
fn short_writes_are_completed() {
    on_both_paths(short_writes_are_completed_on);
}

/// Group commit (the sync thread's pipelined groups), and `EveryRecord` with a wait per record
/// (groups written by the waiting thread: the write linked to its sync on io_uring).
fn short_writes_are_completed_on(path: IoVariant) {
    for durability in [Durability::default(), Durability::EveryRecord] {
        let wait_each = durability == Durability::EveryRecord;
        let dir = tempfile::tempdir().unwrap();
        let (wal, faults) = open_faulty(path, dir.path(), durability, 64 << 10);
        let wal = Arc::new(wal);
        faults.short_write_bytes.store(7, Ordering::SeqCst);
        let count = if wait_each { 100 } else { 500 };
        let mut expected = Vec::new();
        let mut last = Lsn::ZERO;
        // With `EveryRecord`, rounds of waited-for records until a waiter has led (at most
        // ten): whether a waiter finds the writer free right after its append is a race with
        // the sync thread its append woke, and with 7-byte writes the sync thread holds the
        // writer long; under a loaded machine a whole round can go to it.
        for round in 0..10 {
            let (written, round_last) = bounded(&wal, move |wal| {
                let mut written = Vec::new();
                let mut last = Lsn::ZERO;
                for index in round * count..(round + 1) * count {
                    let bytes: Vec<u8> =
                        (0..index % 200).map(|byte| (byte ^ index) as u8).collect();
                    last = wal.append_bytes(&bytes, 0).unwrap().0;
                    if wait_each {
                        wal.wait_durable(last).unwrap();
                    }
                    written.push(bytes);
                }
                (written, last)
            });
            expected.extend(written);
            last = round_last;
            if !wait_each || wal.stats().led_groups > 0 {
                break;
            }
        }
        wait_durable_bounded(&wal, last).unwrap();
        assert!(faults.syncs.load(Ordering::SeqCst) > 0);
        if wait_each {
            assert!(wal.stats().led_groups > 0, "no waiter led in ten rounds: {:?}", wal.stats());
        }
        wal.close().unwrap();
        assert_path_used(&wal, &faults);
        drop(wal);
        assert_eq!(records(dir.path()), expected, "{durability:?}");
    }
}

#[test]
fn a_failed_fsync_fails_the_waiter_where_waiters_lead() {
    on_both_paths(a_failed_fsync_fails_the_waiter_where_waiters_lead_on);
}

/// `EveryRecord` waiters write their own groups when the writer is free (checked: groups were
/// led before the fault). The failing sync is run by whichever takes the doomed group first:
/// the waiter, leading, or the sync thread, which the pending callback wakes. Either way the
/// waiter gets the sync's error from `wait_durable`, the callback gets it on the sync thread,
/// and the log is failed for everyone.
fn a_failed_fsync_fails_the_waiter_where_waiters_lead_on(path: IoVariant) {
    let dir = tempfile::tempdir().unwrap();
    let (wal, faults) = open_faulty(path, dir.path(), Durability::EveryRecord, 1 << 20);
    let wal = Arc::new(wal);
    // At least ten records, and on until a waiter led a group (a loaded machine may leave the
    // first ones to the sync thread), at most 200.
    let acknowledged = bounded(&wal, |wal| {
        let mut index = 0u8;
        while index < 10 || (wal.stats().led_groups == 0 && index < 200) {
            let (lsn, _) = wal.append_bytes(&[index; 32], 0).unwrap();
            wal.wait_durable(lsn).unwrap();
            index += 1;
        }
        usize::from(index)
    });
    assert!(wal.stats().led_groups > 0, "{:?}", wal.stats());
    faults.sync_eio.store(true, Ordering::SeqCst);
    let (doomed, _) = wal.append_bytes(b"doomed", 0).unwrap();
    // A callback waiting for the doomed record learns the failure on the sync thread, never
    // on the waiting thread (which may lead).
    let (sender, receiver) = std::sync::mpsc::channel();
    wal.notify_when_durable(
        doomed,
        Box::new(move |result| {
            let thread = std::thread::current().name().map(str::to_owned);
            sender.send((result.is_err(), thread)).unwrap();
        }),
    );
    let error = wait_durable_bounded(&wal, doomed).unwrap_err();
    match error.root_cause() {
        WalError::Io { op, .. } => assert_eq!(*op, "fdatasync"),
        other => panic!("expected the fdatasync error, got {other:?}"),
    }
    let (failed, thread) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(failed, "the callback of a record whose sync failed got Ok");
    assert_eq!(thread.as_deref(), Some("coordbus-wal-sync"));
    assert!(wal.durable_lsn() < doomed, "a failed sync never reports success");
    faults.sync_eio.store(false, Ordering::SeqCst);
    assert!(matches!(wal.append_bytes(b"later", 0), Err(WalError::Failed { .. })));
    assert!(matches!(wal.close(), Err(WalError::Failed { .. })));
    assert_path_used(&wal, &faults);
    drop(wal);
    // The acknowledged records are intact (the doomed one may follow: its write reached the
    // page cache, only its sync failed).
    let found = records(dir.path());
    assert!(found.len() >= acknowledged, "{} records of {acknowledged}", found.len());
    for (index, record) in found.iter().take(acknowledged).enumerate() {
        assert_eq!(record, &vec![index as u8; 32]);
    }
}

#[test]
fn a_failed_fsync_amid_concurrent_groups_never_reports_a_later_group_durable() {
    on_both_paths(a_failed_fsync_amid_concurrent_groups_on);
}

/// Two appenders and small groups, so several groups are on the ring when the eighth sync
/// fails (io_uring path). Every record is watched with a durability callback: exactly the LSNs up
/// to the final durable watermark are acknowledged, they are contiguous from 1, and all of them are
/// intact after reopening; everything later is reported failed.
fn a_failed_fsync_amid_concurrent_groups_on(path: IoVariant) {
    let dir = tempfile::tempdir().unwrap();
    let durability =
        Durability::GroupCommit { max_delay: Duration::from_micros(20), max_bytes: 2048 };
    let (wal, faults) = open_faulty(path, dir.path(), durability, 1 << 20);
    faults.fail_sync_from.store(8, Ordering::SeqCst);
    let wal = Arc::new(wal);
    let outcomes = Arc::new(std::sync::Mutex::new(Vec::<(u64, bool)>::new()));
    let appenders: Vec<_> = (0..2u8)
        .map(|thread| {
            let wal = Arc::clone(&wal);
            let outcomes = Arc::clone(&outcomes);
            std::thread::spawn(move || {
                let mut appended = Vec::new();
                for index in 0..3000u32 {
                    let mut payload = vec![thread; 40];
                    payload[1..5].copy_from_slice(&index.to_le_bytes());
                    let Ok((lsn, _)) = wal.append_bytes(&payload, 0) else {
                        break;
                    };
                    let outcomes = Arc::clone(&outcomes);
                    wal.notify_when_durable(
                        lsn,
                        Box::new(move |result| {
                            outcomes.lock().unwrap().push((lsn.0, result.is_ok()))
                        }),
                    );
                    appended.push((lsn.0, payload));
                    // Pause now and then for durability, so there are many groups and syncs
                    // (bounded: a wait that hangs fails the test instead of ending the thread).
                    if index % 100 == 99 {
                        match wal.wait_durable_timeout(lsn, WAIT_BOUND) {
                            Ok(()) => {}
                            Err(error @ WalError::Timeout { .. }) => panic!("{error}"),
                            Err(_) => break,
                        }
                    }
                }
                appended
            })
        })
        .collect();
    let mut appended: Vec<(u64, Vec<u8>)> =
        wal_support::join_all_within(appenders).into_iter().flatten().collect();
    appended.sort();
    // Close runs every pending callback (durable, failed or closed) before it returns.
    let error = wal.close().unwrap_err();
    match error.root_cause() {
        WalError::Io { op, message, .. } => {
            assert_eq!(*op, "fdatasync");
            assert!(message.contains("Input/output error"), "{message}");
        }
        other => panic!("expected the fdatasync error, got {other:?}"),
    }
    assert_path_used(&wal, &faults);
    let durable = wal.durable_lsn().0;
    let outcomes = outcomes.lock().unwrap().clone();
    assert_eq!(outcomes.len(), appended.len(), "every callback ran once");
    let mut acknowledged: Vec<u64> =
        outcomes.iter().filter(|(_, ok)| *ok).map(|(lsn, _)| *lsn).collect();
    acknowledged.sort();
    assert_eq!(acknowledged, (1..=durable).collect::<Vec<_>>(), "acknowledged = 1..=durable");
    assert!(durable < appended.last().unwrap().0, "the failure left records unacknowledged");
    drop(wal);
    let found = records(dir.path());
    // Exactly the acknowledged records: what the failed log wrote after them is cut.
    assert_eq!(found.len() as u64, durable);
    for (lsn, payload) in appended.iter().take(durable as usize) {
        assert_eq!(&found[*lsn as usize - 1], payload, "LSN {lsn}");
    }
}

#[test]
fn a_failure_amid_a_group_that_spans_segments_cuts_its_records_in_each() {
    on_both_paths(a_failure_amid_a_group_that_spans_segments_on);
}

/// A group of records that fills several 4 KiB segments, whose second sync fails (the first
/// syncs the rest of the segment it starts in): the log's durable LSN stays at the record
/// acknowledged before. Opening cuts every record after it, in the segment it shares with
/// that record and in the segments created for the group (dropped as a whole), and the next
/// append continues right after it.
fn a_failure_amid_a_group_that_spans_segments_on(path: IoVariant) {
    let dir = tempfile::tempdir().unwrap();
    let durability =
        Durability::GroupCommit { max_delay: Duration::from_millis(50), max_bytes: 1 << 20 };
    let (wal, faults) = open_faulty(path, dir.path(), durability, 4096);
    let wal = Arc::new(wal);
    let (acked, _) = wal.append_bytes(&[1u8; 100], 1).unwrap();
    wait_durable_bounded(&wal, acked).unwrap();
    let requests = faults.sync_requests.load(Ordering::SeqCst);
    faults.fail_sync_from.store(requests + 2, Ordering::SeqCst);
    let mut last = acked;
    for _ in 0..80 {
        match wal.append_bytes(&[2u8; 100], 2) {
            Ok((lsn, _)) => last = lsn,
            Err(_) => break,
        }
    }
    let error = wal.wait_durable_timeout(last, WAIT_BOUND).unwrap_err();
    assert!(
        matches!(error.root_cause(), WalError::Io { op: "fdatasync", .. }),
        "the injected sync failure, not a timeout: {error:?}"
    );
    let durable = wal.durable_lsn();
    assert!(durable >= acked && durable < last, "durable {durable:?}, last {last:?}");
    drop(wal);
    let segment_files = || {
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|entry| {
                entry.as_ref().unwrap().file_name().to_string_lossy().starts_with("seg-")
            })
            .count()
    };
    let before = segment_files();
    let reopened =
        Wal::open(dir.path(), WalConfig { segment_size_bytes: 4096, ..WalConfig::default() })
            .unwrap();
    let cut = reopened.recovery_report().unsynced_cut.expect("the failed log's marker");
    // Which sync failed depends on how the records were grouped: the records after the
    // durable LSN were cut where they were written, or the segment created for them dropped.
    let after = segment_files();
    assert!(cut.records_discarded > 0 || after < before, "{}", reopened.recovery_report());
    assert!(after <= before);
    assert_eq!(cut.durable_lsn, durable);
    let (next, _) = reopened.append_bytes(b"next", 3).unwrap();
    assert_eq!(next, Lsn(durable.0 + 1));
    wait_durable_bounded(&Arc::new(reopened), next).unwrap();
    let found = records(dir.path());
    assert_eq!(found.len() as u64, durable.0 + 1);
    assert_eq!(found.last().unwrap(), b"next");
}

/// io_uring: a group alone on the ring, its write linked to its sync. The write comes up short
/// (finished with pwrite) and the linked sync fails with EIO. The failed sync fails the log:
/// it is not voided like a cancelled one, since the sync issued in its place could succeed
/// over the bytes the failed writeback lost (Linux reports such an error once).
#[test]
fn a_failed_linked_sync_fails_the_log_even_when_its_write_came_up_short() {
    if !kernel_allows_io_uring() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (wal, faults) = open_faulty(IoVariant::Uring, dir.path(), Durability::default(), 1 << 20);
    let wal = Arc::new(wal);
    // The segment's first group goes one group at a time; the next one is pipelined.
    let (first, _) = wal.append_bytes(b"first", 1).unwrap();
    wait_durable_bounded(&wal, first).unwrap();
    faults.short_write_bytes.store(7, Ordering::SeqCst);
    let next_sync = faults.sync_requests.load(Ordering::SeqCst) + 1;
    faults.fail_one_sync.store(next_sync, Ordering::SeqCst);
    let (lsn, _) = wal.append_bytes(&[9u8; 100], 2).unwrap();
    let outcome = wal.wait_durable_timeout(lsn, WAIT_BOUND);
    assert!(
        faults.sync_requests.load(Ordering::SeqCst) >= next_sync,
        "the planned sync was never asked for"
    );
    match outcome {
        Err(error) => match error.root_cause() {
            WalError::Io { op, .. } => assert_eq!(*op, "fdatasync"),
            other => panic!("expected the fdatasync error, got {other:?}"),
        },
        Ok(()) => panic!("a record whose sync failed was reported durable"),
    }
    assert!(wal.durable_lsn() < lsn);
    assert_path_used(&wal, &faults);
}

/// io_uring: a ring write that completes with EAGAIN (would block) or EINTR wrote nothing and
/// failed nothing: it is finished with pwrite, on the one-group path (a segment's first group)
/// and on the pipelined one alike, and the record is durable and intact.
#[test]
fn a_ring_write_that_would_block_is_finished_with_pwrite_on_both_ring_paths() {
    if !kernel_allows_io_uring() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (wal, faults) = open_faulty(IoVariant::Uring, dir.path(), Durability::default(), 1 << 20);
    let wal = Arc::new(wal);
    let mut expected = Vec::new();
    // The first record's group is the segment's first (one group at a time); the later ones
    // go through the pipeline.
    for (index, errno) in [libc::EAGAIN, libc::EAGAIN, libc::EINTR].into_iter().enumerate() {
        faults.ring_write_errno_once.store(errno, Ordering::SeqCst);
        let bytes = vec![index as u8; 50 + index];
        let (lsn, _) = wal.append_bytes(&bytes, index as i64).unwrap();
        wait_durable_bounded(&wal, lsn).unwrap();
        assert_eq!(faults.ring_write_errno_once.load(Ordering::SeqCst), 0, "the fault was used");
        expected.push(bytes);
    }
    assert_path_used(&wal, &faults);
    drop(wal);
    assert_eq!(records(dir.path()), expected);
}

/// The file layer of [`cleans_delete_in_lsn_order_so_a_failed_deletion_leaves_no_gap`]: the
/// removal of segment 1 announces itself, waits for the test's gate, then fails.
#[derive(Debug)]
struct StuckRemoval {
    entered: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
    gate: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Storage for StuckRemoval {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        FileStorage.create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        FileStorage.create(path)
    }
    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        FileStorage.open_existing(path)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        if path.file_name() == Some(coordbus::wal::segment::file_name(SegmentId(1)).as_ref()) {
            if let Some(entered) = self.entered.lock().unwrap().take() {
                let _ = entered.send(());
            }
            let _ = self.gate.lock().unwrap().recv_timeout(WAIT_BOUND);
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        FileStorage.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        FileStorage.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        FileStorage.sync_dir(dir)
    }
}

/// A `clean` that deletes at once (`wait`) while an earlier one's segments are still being
/// deleted by the sync thread waits for them: deletions run in LSN order, so when the earlier
/// segment cannot be deleted, the later one is kept too and the log still opens. (Before, the
/// later segment was deleted first, and the failed deletion left a gap in the LSNs on disk,
/// which a strict open reports as corruption.)
#[test]
fn cleans_delete_in_lsn_order_so_a_failed_deletion_leaves_no_gap() {
    let dir = tempfile::tempdir().unwrap();
    let (entered, entered_rx) = std::sync::mpsc::channel();
    let (open_gate, gate) = std::sync::mpsc::channel();
    let storage = StuckRemoval { entered: Some(entered).into(), gate: std::sync::Mutex::new(gate) };
    let wal = Arc::new(
        Wal::open_with_options(
            dir.path(),
            WalConfig { segment_size_bytes: 4096, ..WalConfig::default() },
            WalOptions { storage: Arc::new(storage), spare_segments: 0, ..WalOptions::default() },
        )
        .unwrap(),
    );
    // The first LSN of each segment, for four segments and the start of a fifth.
    let mut first_lsn = std::collections::BTreeMap::new();
    while first_lsn.len() < 5 {
        let (lsn, handle) = wal.append_bytes(&[7u8; 200], 0).unwrap();
        wait_durable_bounded(&wal, lsn).unwrap();
        first_lsn.entry(handle.segment.0).or_insert(lsn);
    }
    // Segment 1 for the sync thread, which gets stuck deleting it.
    let queued = wal.clean_below_lsn(first_lsn[&2], false).unwrap();
    assert_eq!(queued.queued, vec![SegmentId(1)]);
    entered_rx.recv_timeout(WAIT_BOUND).expect("the sync thread deletes segment 1");
    // Segment 2, to be deleted at once, from another thread.
    let (done, done_rx) = std::sync::mpsc::channel();
    let cleaner = Arc::clone(&wal);
    let below = first_lsn[&3];
    std::thread::spawn(move || {
        let cleaned = cleaner.clean_below_lsn(below, true);
        // Before answering: the test takes the log back as its only owner next.
        drop(cleaner);
        let _ = done.send(cleaned);
    });
    // It must wait for segment 1's deletion: it may not finish while that is stuck.
    let early = done_rx.recv_timeout(Duration::from_millis(500));
    assert!(early.is_err(), "segment 2 was cleaned while segment 1 was not: {early:?}");
    open_gate.send(()).unwrap();
    let later = done_rx.recv_timeout(WAIT_BOUND).expect("the clean finished").unwrap();
    assert!(later.deleted.is_empty(), "{later:?}");
    assert!(later.failed.iter().any(|(id, _)| *id == SegmentId(2)), "{later:?}");
    let wal = Arc::into_inner(wal).expect("the only reference");
    wal.close().unwrap();
    drop(wal);
    // Both segments are still there, so the LSNs on disk have no gap.
    Wal::open(dir.path(), WalConfig { segment_size_bytes: 4096, ..WalConfig::default() })
        .expect("a strict open finds no gap");
}
