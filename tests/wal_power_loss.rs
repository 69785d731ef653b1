//! Goal (the brief's "durable means synced"): every record the log acknowledged durable is in
//! what a power loss leaves, the bytes that were synced and nothing else. A kill -9 (the crash
//! tool, `wal_crash`) keeps the page cache, so it cannot tell an acknowledgement after `write`
//! from one after `fdatasync`; this test can.
//!
//! Method: `SyncedImage`, a storage layer over the real file system, keeps for every file the
//! bytes it held at its last `sync_data`, and for the directory the names (and the files they
//! name) as of its last `sync_dir`. At seeded moments while appenders run, the test notes the
//! acknowledged LSNs and then takes the image: only those synced bytes under those synced
//! names. Opening the image (strict recovery) must succeed and yield every acknowledged record,
//! intact. Two appenders run at once; rolls, cleaning and spare reuse (renames) run meanwhile.
//!
//! Both write paths run it:
//! * **pwrite**: the storage layer hides the descriptors, so every write and sync goes through
//!   it; a sync makes durable what the file held as it started.
//! * **io_uring**: the layer hands the engine the real descriptors and learns of each ring
//!   entry twice, at submission (`StorageFile::ring_fault`) and when the engine reaps its
//!   completion (`StorageFile::ring_completed`). A ring `fdatasync` makes durable what the file
//!   holds when its completion is reaped, except the bytes of every write it may not cover,
//!   which keep what the last sync left (zeros if none): writes submitted after it, and, unless
//!   the kernel orders it behind every earlier entry (drained or linked), writes whose
//!   completions were not reaped before it was submitted. This is stricter than the kernel
//!   (which covers any write finished before the sync started), so a group acknowledged on a
//!   sync that did not cover it is caught, pipelining included. Seeded ring writes come up
//!   short or are interrupted, so the engine's finishing of them with pwrite runs too.
//!
//! Limits of the model: it learns of ring entries from the engine's own calls, made where each
//! entry is built and where its completion is read, so it checks how the engine orders writes,
//! syncs and acknowledgements, not whether the kernel ran what was submitted. An unsynced
//! rename or unlink is lost, never persisted early. A write that lands while a sync through
//! the storage layer runs may or may not be in it, and the model may count it in (that sync
//! snapshots the file as it starts; only ring writes in flight are masked). Each record is
//! also checked against the model when it is acknowledged, not only in the images.

mod wal_support;

use std::{
    collections::HashMap,
    io,
    os::fd::RawFd,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicI64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use coordbus::wal::{
    Durability, FileStorage, IoMode, IoPath, Lsn, RingFault, RingOp, Storage, StorageFile, Wal,
    WalConfig, WalOptions,
};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

/// Longest an appender waits for the checker's next image (a hang is a failure).
const IMAGE_WAIT: Duration = Duration::from_secs(60);

/// What a power loss would leave, as of now.
#[derive(Debug, Default)]
struct Durable {
    /// File identity by current name (created, renamed, removed as the log does).
    current: HashMap<PathBuf, u64>,
    /// File identity by name as of the directory's last sync.
    synced_names: HashMap<PathBuf, u64>,
    /// Each file's bytes as of its last `sync_data` (none: never synced, empty after a loss).
    synced_bytes: HashMap<u64, Vec<u8>>,
    next_id: u64,
}

/// The real file system, recording what each sync made durable (module doc).
#[derive(Debug, Default)]
struct SyncedImage {
    durable: Arc<Mutex<Durable>>,
    /// Hand the engine the real descriptors, so io_uring writes and syncs through them.
    ring: bool,
    /// Ring syncs whose success the model applied.
    ring_syncs: Arc<AtomicUsize>,
    /// Ring writes to come up short or be interrupted now and then (seeded), so the engine's
    /// finishing of such writes with pwrite runs under the model too.
    ring_faults: Option<Arc<RingFaults>>,
}

/// Seeded faults for ring writes, shared by every file of a log.
#[derive(Debug)]
struct RingFaults {
    rng: Mutex<XorShiftRng>,
    injected: AtomicUsize,
}

impl RingFaults {
    fn new(seed: u64) -> Self {
        Self { rng: Mutex::new(XorShiftRng::seed_from_u64(seed)), injected: AtomicUsize::new(0) }
    }

    /// For a ring write of `len` bytes: one in 16 comes up short (half of it is submitted),
    /// one in 32 is interrupted (`EINTR`, nothing written); the engine finishes both with
    /// pwrite.
    fn for_write(&self, len: usize) -> Option<RingFault> {
        let fault = match self.rng.lock().unwrap().random_range(0..32) {
            0 | 1 if len > 1 => RingFault::ShortWrite(len / 2),
            2 => RingFault::Errno(libc::EINTR),
            _ => return None,
        };
        self.injected.fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }
}

#[derive(Debug)]
struct TrackedFile {
    inner: Arc<dyn StorageFile>,
    id: u64,
    durable: Arc<Mutex<Durable>>,
    ring: bool,
    ring_syncs: Arc<AtomicUsize>,
    ring_faults: Option<Arc<RingFaults>>,
    ring_state: Mutex<RingState>,
}

/// A file's ring entries the model still follows.
#[derive(Debug, Default)]
struct RingState {
    /// Ring writes submitted and not yet reaped: `(offset, len)`.
    in_flight: Vec<(u64, usize)>,
    /// The ring sync submitted and not yet reaped: the byte ranges it may not cover.
    sync_uncovered: Option<Vec<(u64, usize)>>,
}

impl TrackedFile {
    fn new(inner: Arc<dyn StorageFile>, id: u64, storage: &SyncedImage) -> Self {
        Self {
            inner,
            id,
            durable: Arc::clone(&storage.durable),
            ring: storage.ring,
            ring_syncs: Arc::clone(&storage.ring_syncs),
            ring_faults: storage.ring_faults.clone(),
            ring_state: Mutex::new(RingState::default()),
        }
    }

    /// The file's bytes now (through the descriptor, whatever its name is by now).
    fn bytes_now(&self) -> io::Result<Vec<u8>> {
        let fd = self.inner.raw_fd().expect("a real file");
        std::fs::read(format!("/proc/self/fd/{fd}"))
    }

    /// Makes `bytes` the file's durable content, except the `uncovered` ranges, which keep
    /// what the last sync left (zeros where it left nothing).
    fn make_durable(&self, mut bytes: Vec<u8>, uncovered: &[(u64, usize)]) {
        let mut durable = self.durable.lock().unwrap();
        let before = durable.synced_bytes.get(&self.id).map_or(&[][..], Vec::as_slice);
        for &(offset, len) in uncovered {
            let start = (offset as usize).min(bytes.len());
            let end = (offset as usize + len).min(bytes.len());
            for (at, byte) in bytes[start..end].iter_mut().enumerate() {
                *byte = before.get(start + at).copied().unwrap_or(0);
            }
        }
        durable.synced_bytes.insert(self.id, bytes);
    }
}

impl SyncedImage {
    /// The durable state written out as a directory of its own: what a power loss leaves.
    fn image(&self, into: &Path) {
        let durable = self.durable.lock().unwrap();
        for (path, id) in &durable.synced_names {
            let bytes = durable.synced_bytes.get(id).map_or(&[][..], Vec::as_slice);
            std::fs::write(into.join(path.file_name().unwrap()), bytes).unwrap();
        }
    }
}

impl SyncedImage {
    /// Whether `bytes` are in what a power loss would leave now (a file under a synced name).
    fn holds_durably(&self, bytes: &[u8]) -> bool {
        let durable = self.durable.lock().unwrap();
        durable.synced_names.values().any(|id| {
            durable
                .synced_bytes
                .get(id)
                .is_some_and(|synced| synced.windows(bytes.len()).any(|window| window == bytes))
        })
    }
}

impl Storage for SyncedImage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        FileStorage.create_dir_all(dir)
    }

    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let inner = FileStorage.create(path)?;
        let mut durable = self.durable.lock().unwrap();
        durable.next_id += 1;
        let id = durable.next_id;
        durable.current.insert(path.to_path_buf(), id);
        Ok(Arc::new(TrackedFile::new(inner, id, self)))
    }

    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let inner = FileStorage.open_existing(path)?;
        let id = self.durable.lock().unwrap().current[path];
        Ok(Arc::new(TrackedFile::new(inner, id, self)))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        FileStorage.remove(path)?;
        self.durable.lock().unwrap().current.remove(path);
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        FileStorage.rename(from, to)?;
        let mut durable = self.durable.lock().unwrap();
        let id = durable.current.remove(from).expect("renaming a known file");
        durable.current.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        // The names as the sync starts are what it makes durable (a change while it runs may
        // miss it).
        let in_dir: HashMap<PathBuf, u64> = {
            let durable = self.durable.lock().unwrap();
            durable
                .current
                .iter()
                .filter(|(path, _)| path.parent() == Some(dir))
                .map(|(path, id)| (path.clone(), *id))
                .collect()
        };
        FileStorage.sync_dir(dir)?;
        let mut durable = self.durable.lock().unwrap();
        durable.synced_names.retain(|path, _| path.parent() != Some(dir));
        durable.synced_names.extend(in_dir);
        Ok(())
    }
}

impl StorageFile for TrackedFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        // Written while a ring sync runs: that sync may not cover it.
        if let Some(uncovered) = &mut self.ring_state.lock().unwrap().sync_uncovered {
            uncovered.push((offset, buf.len()));
        }
        self.inner.write_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        // What the file holds as the sync starts is what it makes durable (a write while it
        // runs may miss it), except ring writes still in flight.
        let in_flight = self.ring_state.lock().unwrap().in_flight.clone();
        let bytes = self.bytes_now()?;
        self.inner.sync_data()?;
        self.make_durable(bytes, &in_flight);
        Ok(())
    }

    fn allocate(&self, len: u64) -> io::Result<()> {
        self.inner.allocate(len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn raw_fd(&self) -> Option<RawFd> {
        // Hidden on the pwrite path: the log then writes and syncs through `write_at` and
        // `sync_data`.
        if self.ring {
            self.inner.raw_fd()
        } else {
            None
        }
    }

    fn ring_fault(&self, op: RingOp) -> Option<RingFault> {
        let mut state = self.ring_state.lock().unwrap();
        match op {
            RingOp::Write { offset, len } => {
                state.in_flight.push((offset, len));
                if let Some(uncovered) = &mut state.sync_uncovered {
                    uncovered.push((offset, len));
                }
                self.ring_faults.as_ref().and_then(|faults| faults.for_write(len))
            }
            RingOp::SyncData { ordered } => {
                assert!(state.sync_uncovered.is_none(), "two ring syncs of one file at once");
                let uncovered = if ordered { Vec::new() } else { state.in_flight.clone() };
                state.sync_uncovered = Some(uncovered);
                None
            }
            _ => panic!("an operation the model does not know: {op:?}"),
        }
    }

    fn ring_completed(&self, op: RingOp, result: i32) {
        let mut state = self.ring_state.lock().unwrap();
        match op {
            RingOp::Write { offset, len } => {
                let at = state.in_flight.iter().position(|&write| write == (offset, len));
                state.in_flight.swap_remove(at.expect("a reaped write was submitted"));
            }
            RingOp::SyncData { .. } => {
                let uncovered = state.sync_uncovered.take().expect("a reaped sync was submitted");
                drop(state);
                if result >= 0 {
                    self.make_durable(self.bytes_now().unwrap(), &uncovered);
                    self.ring_syncs.fetch_add(1, Ordering::SeqCst);
                }
            }
            _ => panic!("an operation the model does not know: {op:?}"),
        }
    }
}

/// The payload of an appender's record: its key (`thread << 32 | index`) repeated, to a
/// length that varies with it.
fn payload(key: u64) -> Vec<u8> {
    let len = 16 + (key % 200) as usize;
    key.to_le_bytes().iter().copied().cycle().take(len).collect()
}

/// The key a well-formed payload was made from.
fn key_of(bytes: &[u8]) -> Option<u64> {
    let key = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    (payload(key) == bytes).then_some(key)
}

/// An acknowledged record: its LSN, its payload's key and its time.
#[derive(Debug, Clone, Copy)]
struct Acknowledged {
    lsn: u64,
    key: u64,
    time_ms: i64,
}

/// Records each appender writes.
const RECORDS_PER_APPENDER: u64 = 600;

/// Waits (bounded) until `record` is durable, checks that the model holds its bytes durably
/// already (or that it is older than a cleaning threshold passed), and notes it as
/// acknowledged.
fn acknowledge(
    wal: &Arc<Wal>,
    storage: &SyncedImage,
    acknowledged: &Mutex<Vec<Acknowledged>>,
    cleaned_below: &AtomicI64,
    record: Acknowledged,
) {
    wal_support::wait_durable_bounded(wal, Lsn(record.lsn)).unwrap();
    // Durable by the time it is acknowledged, not just by the next image (unless the other
    // appender has cleaned it away meanwhile).
    assert!(
        storage.holds_durably(&payload(record.key))
            || record.time_ms < cleaned_below.load(Ordering::SeqCst),
        "LSN {} acknowledged before a sync made its bytes durable",
        record.lsn
    );
    acknowledged.lock().unwrap().push(record);
}

/// Two appenders (each waiting for its own records, and checking that each is durable in the
/// model once acknowledged), cleaning every so often, in 16 KiB segments with spares; crash
/// images at seeded moments, each opened and checked.
fn acknowledged_records_survive_the_loss_of_unsynced_bytes(
    io: IoMode,
    durability: Durability,
    seed: u64,
) {
    let dir = tempfile::tempdir().unwrap();
    let ring = io == IoMode::IoUring;
    let storage = Arc::new(SyncedImage {
        ring,
        ring_faults: ring.then(|| Arc::new(RingFaults::new(seed))),
        ..SyncedImage::default()
    });
    let options = WalOptions {
        io,
        storage: Arc::clone(&storage) as _,
        spare_segments: 2,
        ..WalOptions::default()
    };
    let config = WalConfig { segment_size_bytes: 16 << 10, durability, ..WalConfig::default() };
    let wal = Arc::new(Wal::open_with_options(dir.path(), config, options).unwrap());
    let acknowledged = Arc::new(Mutex::new(Vec::<Acknowledged>::new()));
    // The highest threshold passed to `clean` so far: only records older than it may be gone.
    let cleaned_below = Arc::new(AtomicI64::new(i64::MIN));
    // Images checked so far: the appenders wait (bounded) for the first two at a third and
    // at two thirds of their records, so that images are taken mid-run however fast the
    // appenders or slow the checks are.
    let images = Arc::new(AtomicUsize::new(0));
    let appenders: Vec<_> = (0..2u64)
        .map(|thread| {
            let (wal, acknowledged) = (Arc::clone(&wal), Arc::clone(&acknowledged));
            let (cleaned_below, images) = (Arc::clone(&cleaned_below), Arc::clone(&images));
            let storage = Arc::clone(&storage);
            std::thread::spawn(move || {
                for index in 0..RECORDS_PER_APPENDER {
                    if index == RECORDS_PER_APPENDER / 3 || index == 2 * RECORDS_PER_APPENDER / 3 {
                        let wanted = (3 * index / RECORDS_PER_APPENDER) as usize;
                        let started = Instant::now();
                        while images.load(Ordering::SeqCst) < wanted {
                            assert!(started.elapsed() < IMAGE_WAIT, "no image in {IMAGE_WAIT:?}");
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    let key = thread << 32 | index;
                    let time_ms = index as i64;
                    let (lsn, _) = wal.append_bytes(&payload(key), time_ms).unwrap();
                    let record = Acknowledged { lsn: lsn.0, key, time_ms };
                    acknowledge(&wal, &storage, &acknowledged, &cleaned_below, record);
                    if index % 150 == 149 {
                        let threshold = time_ms - 100;
                        cleaned_below.fetch_max(threshold, Ordering::SeqCst);
                        wal.clean(threshold, false).unwrap();
                    }
                }
            })
        })
        .collect();
    let mut rng = XorShiftRng::seed_from_u64(seed);
    while !appenders.iter().all(|appender| appender.is_finished()) {
        std::thread::sleep(Duration::from_micros(rng.random_range(200..3000)));
        // Acknowledged before the image is taken: each one's sync came before.
        let acknowledged_now = acknowledged.lock().unwrap().clone();
        let image = tempfile::tempdir().unwrap();
        storage.image(image.path());
        check_image(image.path(), &acknowledged_now, cleaned_below.load(Ordering::SeqCst));
        images.fetch_add(1, Ordering::SeqCst);
    }
    for appender in appenders {
        appender.join().unwrap();
    }
    let images = images.load(Ordering::SeqCst);
    assert!(images >= 2, "only {images} images taken while the appenders ran");
    let image = tempfile::tempdir().unwrap();
    storage.image(image.path());
    check_image(image.path(), &acknowledged.lock().unwrap(), cleaned_below.load(Ordering::SeqCst));
    assert!(wal.stats().recycled_segments > 0 || wal.stats().cleaned_segments > 0);
    if io == IoMode::IoUring {
        // The live ring engine made records durable, not a fallback.
        assert_eq!(wal.io_path(), IoPath::IoUring);
        assert!(storage.ring_syncs.load(Ordering::SeqCst) > 0, "no ring sync was modelled");
        let faults = storage.ring_faults.as_ref().unwrap().injected.load(Ordering::SeqCst);
        assert!(faults > 0, "no short or interrupted ring write was injected");
    }
}

/// Opens `image` (strict) and checks that every record in it is intact, and that it holds
/// every acknowledged record, each with its payload, except records older than the highest
/// cleaning threshold (`cleaned_below`), which a clean may have deleted.
fn check_image(image: &Path, acknowledged: &[Acknowledged], cleaned_below: i64) {
    let wal = Wal::open(image, WalConfig { segment_size_bytes: 16 << 10, ..WalConfig::default() })
        .unwrap_or_else(|error| panic!("the image does not open: {error}"));
    let mut present = HashMap::new();
    for record in wal.iter_from(Lsn::ZERO).unwrap() {
        let record = record.unwrap();
        let key = key_of(&record.bytes).unwrap_or_else(|| panic!("LSN {} damaged", record.lsn));
        present.insert(record.lsn.0, key);
    }
    let missing: Vec<Acknowledged> = acknowledged
        .iter()
        .copied()
        .filter(|ack| ack.time_ms >= cleaned_below && present.get(&ack.lsn) != Some(&ack.key))
        .collect();
    assert!(missing.is_empty(), "acknowledged but lost (or changed) at a power loss: {missing:?}");
}

#[test]
fn every_record_acknowledged_by_group_commit_survives_a_power_loss() {
    acknowledged_records_survive_the_loss_of_unsynced_bytes(
        IoMode::Pwrite,
        Durability::default(),
        0x5eed_2001,
    );
}

#[test]
fn every_record_acknowledged_per_record_survives_a_power_loss() {
    acknowledged_records_survive_the_loss_of_unsynced_bytes(
        IoMode::Pwrite,
        Durability::EveryRecord,
        0x5eed_2002,
    );
}

/// Skips an io_uring variant only where the kernel refuses io_uring.
fn kernel_allows_io_uring() -> bool {
    match wal_support::io_uring_refusal() {
        None => true,
        Some(reason) => {
            eprintln!("skipping: the kernel refuses io_uring: {reason}");
            false
        }
    }
}

#[test]
fn every_record_acknowledged_by_io_uring_group_commit_survives_a_power_loss() {
    if kernel_allows_io_uring() {
        acknowledged_records_survive_the_loss_of_unsynced_bytes(
            IoMode::IoUring,
            Durability::default(),
            0x5eed_2003,
        );
    }
}

#[test]
fn every_record_acknowledged_per_record_on_io_uring_survives_a_power_loss() {
    if kernel_allows_io_uring() {
        acknowledged_records_survive_the_loss_of_unsynced_bytes(
            IoMode::IoUring,
            Durability::EveryRecord,
            0x5eed_2004,
        );
    }
}
