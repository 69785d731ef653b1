//! Goal (the brief's "durable means synced"): every record the log acknowledged durable is in
//! what a power loss leaves, the bytes that were synced and nothing else. A kill -9 (the crash
//! tool, `wal_crash`) keeps the page cache, so it cannot tell an acknowledgement after `write`
//! from one after `fdatasync`; this test can.
//!
//! Method: the log writes through `power_loss_support::SyncedImage`, which keeps what each
//! sync made durable, on both write paths (see its module doc and limits). At seeded moments
//! while appenders run, the test notes the acknowledged LSNs and then takes the image: only
//! the synced bytes under the synced names. Opening the image (strict recovery) must succeed
//! and yield every acknowledged record, intact. Two appenders run at once; rolls, cleaning and
//! spare reuse (renames) run meanwhile. Each record is also checked against the model when it
//! is acknowledged, not only in the images. Directory changes become durable at directory
//! syncs only, or (the `keeps_every_unlink` variants) at once: the two extremes.

mod power_loss_support;
mod wal_support;

use std::{
    collections::HashMap,
    path::Path,
    sync::{
        atomic::{AtomicI64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use coordbus::wal::{Durability, IoMode, IoPath, Lsn, Wal, WalConfig, WalOptions};
use power_loss_support::{Directory, SyncedImage};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

/// Longest an appender waits for the checker's next image (a hang is a failure).
const IMAGE_WAIT: Duration = Duration::from_secs(60);

/// The payload of an appender's record: its key (`thread << 32 | index`), then bytes derived
/// from it, to a length that varies with it.
fn payload(key: u64) -> Vec<u8> {
    let len = 16 + (key % 200) as usize;
    // The key, then bytes of a hash chain seeded by it: no payload is found inside another, or
    // in a zeroed stretch of a file (the acknowledgement check searches the synced bytes).
    let mut state = key ^ 0x5eed_5eed_5eed_5eed;
    let mut bytes = key.to_le_bytes().to_vec();
    while bytes.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut word = state;
        word = (word ^ (word >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        word = (word ^ (word >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        bytes.extend_from_slice(&(word ^ (word >> 31)).to_le_bytes());
    }
    bytes.truncate(len);
    bytes
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
    directory: Directory,
    seed: u64,
) {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(SyncedImage::new(io == IoMode::IoUring, directory, seed));
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
    let deadline = std::time::Instant::now() + wal_support::RUN_BOUND;
    while !appenders.iter().all(|appender| appender.is_finished()) {
        assert!(std::time::Instant::now() < deadline, "appenders still running");
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
    let stats = wal.stats();
    assert!(stats.cleaned_segments > 0 && stats.recycled_segments > 0, "{stats:?}");
    if io == IoMode::IoUring {
        // The live ring engine made records durable, not a fallback.
        assert_eq!(wal.io_path(), IoPath::IoUring);
        assert!(storage.ring_syncs() > 0, "no ring sync was modelled");
        assert!(storage.ring_faults_injected() > 0, "no short or interrupted ring write");
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
        Directory::Lazy,
        0x5eed_2001,
    );
}

#[test]
fn every_record_acknowledged_per_record_survives_a_power_loss() {
    acknowledged_records_survive_the_loss_of_unsynced_bytes(
        IoMode::Pwrite,
        Durability::EveryRecord,
        Directory::Lazy,
        0x5eed_2002,
    );
}

#[test]
fn every_record_acknowledged_by_io_uring_group_commit_survives_a_power_loss() {
    if wal_support::kernel_allows_io_uring() {
        acknowledged_records_survive_the_loss_of_unsynced_bytes(
            IoMode::IoUring,
            Durability::default(),
            Directory::Lazy,
            0x5eed_2003,
        );
    }
}

#[test]
fn every_record_acknowledged_per_record_on_io_uring_survives_a_power_loss() {
    if wal_support::kernel_allows_io_uring() {
        acknowledged_records_survive_the_loss_of_unsynced_bytes(
            IoMode::IoUring,
            Durability::EveryRecord,
            Directory::Lazy,
            0x5eed_2004,
        );
    }
}

#[test]
fn every_record_acknowledged_survives_a_power_loss_that_keeps_every_unlink() {
    acknowledged_records_survive_the_loss_of_unsynced_bytes(
        IoMode::Pwrite,
        Durability::default(),
        Directory::Eager,
        0x5eed_2005,
    );
}

#[test]
fn every_record_acknowledged_on_io_uring_survives_a_power_loss_that_keeps_every_unlink() {
    if wal_support::kernel_allows_io_uring() {
        acknowledged_records_survive_the_loss_of_unsynced_bytes(
            IoMode::IoUring,
            Durability::default(),
            Directory::Eager,
            0x5eed_2006,
        );
    }
}
