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
//! intact. Rolls, cleaning and spare reuse (renames) run meanwhile; the log writes with pwrite
//! (the storage layer hides the descriptors, so every write and sync goes through it).

mod wal_support;

use std::{
    collections::HashMap,
    io,
    os::fd::RawFd,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use coordbus::wal::{
    Durability, FileStorage, IoMode, Lsn, Storage, StorageFile, Wal, WalConfig, WalOptions,
};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

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
}

#[derive(Debug)]
struct TrackedFile {
    inner: Arc<dyn StorageFile>,
    id: u64,
    durable: Arc<Mutex<Durable>>,
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
        Ok(Arc::new(TrackedFile { inner, id, durable: Arc::clone(&self.durable) }))
    }

    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let inner = FileStorage.open_existing(path)?;
        let id = self.durable.lock().unwrap().current[path];
        Ok(Arc::new(TrackedFile { inner, id, durable: Arc::clone(&self.durable) }))
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
        FileStorage.sync_dir(dir)?;
        let mut durable = self.durable.lock().unwrap();
        let in_dir: HashMap<PathBuf, u64> = durable
            .current
            .iter()
            .filter(|(path, _)| path.parent() == Some(dir))
            .map(|(path, id)| (path.clone(), *id))
            .collect();
        durable.synced_names.retain(|path, _| path.parent() != Some(dir));
        durable.synced_names.extend(in_dir);
        Ok(())
    }
}

impl StorageFile for TrackedFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.inner.write_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()?;
        // What the file holds now is durable: read it through the descriptor (whatever its
        // name is by now).
        let fd = self.inner.raw_fd().expect("a real file");
        let bytes = std::fs::read(format!("/proc/self/fd/{fd}"))?;
        self.durable.lock().unwrap().synced_bytes.insert(self.id, bytes);
        Ok(())
    }

    fn allocate(&self, len: u64) -> io::Result<()> {
        self.inner.allocate(len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn raw_fd(&self) -> Option<RawFd> {
        // Hidden: the log then writes and syncs through `write_at` and `sync_data`.
        None
    }
}

/// The payload of LSN `lsn`: its bytes repeated, of a length that varies with it.
fn payload(lsn: u64) -> Vec<u8> {
    let len = 16 + (lsn % 200) as usize;
    lsn.to_le_bytes().iter().copied().cycle().take(len).collect()
}

/// Two appenders (each waiting for its own records), cleaning every so often, in 16 KiB
/// segments with spares; `images` crash images at seeded moments, each opened and checked.
fn acknowledged_records_survive_the_loss_of_unsynced_bytes(durability: Durability, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(SyncedImage::default());
    let options = WalOptions {
        io: IoMode::Pwrite,
        storage: Arc::clone(&storage) as _,
        spare_segments: 2,
        ..WalOptions::default()
    };
    let config = WalConfig { segment_size_bytes: 16 << 10, durability, ..WalConfig::default() };
    let wal = Arc::new(Wal::open_with_options(dir.path(), config, options).unwrap());
    let acknowledged = Arc::new(Mutex::new(Vec::<u64>::new()));
    let appenders: Vec<_> = (0..2)
        .map(|_| {
            let (wal, acknowledged) = (Arc::clone(&wal), Arc::clone(&acknowledged));
            std::thread::spawn(move || {
                for index in 0..600u64 {
                    // Appended under the lock that records acknowledgements, so the payload's
                    // LSN is known before the append (LSNs follow the append order).
                    let lsn = {
                        let _order = acknowledged.lock().unwrap();
                        let next = wal.appended_lsn().0 + 1;
                        let (lsn, _) = wal.append_bytes(&payload(next), index as i64).unwrap();
                        assert_eq!(lsn.0, next);
                        lsn
                    };
                    wal_support::wait_durable_bounded(&wal, lsn).unwrap();
                    acknowledged.lock().unwrap().push(lsn.0);
                    if index % 150 == 149 {
                        wal.clean(index as i64 - 100, false).unwrap();
                    }
                }
            })
        })
        .collect();
    let mut rng = XorShiftRng::seed_from_u64(seed);
    let mut images = 0;
    while !appenders.iter().all(|appender| appender.is_finished()) {
        std::thread::sleep(Duration::from_micros(rng.random_range(200..3000)));
        // Acknowledged before the image is taken: each one's sync came before.
        let acknowledged_now: Vec<u64> = acknowledged.lock().unwrap().clone();
        let image = tempfile::tempdir().unwrap();
        storage.image(image.path());
        check_image(image.path(), &acknowledged_now);
        images += 1;
    }
    for appender in appenders {
        appender.join().unwrap();
    }
    assert!(images >= 3, "only {images} images taken while the appenders ran");
    let image = tempfile::tempdir().unwrap();
    storage.image(image.path());
    check_image(image.path(), &acknowledged.lock().unwrap());
    assert!(wal.stats().recycled_segments > 0 || wal.stats().cleaned_segments > 0);
}

/// Opens `image` (strict) and checks that it holds every LSN of `acknowledged`, intact, and
/// only records that are intact.
fn check_image(image: &Path, acknowledged: &[u64]) {
    let wal = Wal::open(image, WalConfig { segment_size_bytes: 16 << 10, ..WalConfig::default() })
        .unwrap_or_else(|error| panic!("the image does not open: {error}"));
    let mut present = HashMap::new();
    for record in wal.iter_from(Lsn::ZERO).unwrap() {
        let record = record.unwrap();
        assert_eq!(&record.bytes[..], &payload(record.lsn.0)[..], "LSN {} damaged", record.lsn);
        present.insert(record.lsn.0, ());
    }
    // Cleaning may have removed old records; everything from the oldest kept one on is there.
    let oldest = present.keys().min().copied().unwrap_or(u64::MAX);
    let missing: Vec<u64> = acknowledged
        .iter()
        .copied()
        .filter(|lsn| *lsn >= oldest && !present.contains_key(lsn))
        .collect();
    assert!(missing.is_empty(), "acknowledged but lost at a power loss: {missing:?}");
    let newest_acknowledged = acknowledged.iter().max().copied().unwrap_or(0);
    assert!(
        present.contains_key(&newest_acknowledged) || newest_acknowledged == 0,
        "the newest acknowledged record {newest_acknowledged} is gone"
    );
}

#[test]
fn every_record_acknowledged_by_group_commit_survives_a_power_loss() {
    acknowledged_records_survive_the_loss_of_unsynced_bytes(Durability::default(), 0x5eed_2001);
}

#[test]
fn every_record_acknowledged_per_record_survives_a_power_loss() {
    acknowledged_records_survive_the_loss_of_unsynced_bytes(Durability::EveryRecord, 0x5eed_2002);
}
