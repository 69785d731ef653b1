//! Goal (SPEC B.10 after a power loss, not just a kill -9): a coordinator restarted from what a
//! power loss leaves of its epoch log starts after every commit the durable query had reported
//! durable, with exactly the offsets logged for the epoch it resumes from. `epoch_restart`
//! kills a process, which keeps the page cache; here only synced bytes survive.
//!
//! Method: the durable query's WAL writes through `power_loss_support::SyncedImage` (on both
//! write paths; see its module doc and limits), in 64 KiB segments with a short retention, so
//! that delta chains, keyframes, rolls, cleaning and spare reuse all happen. The coordinator's
//! state machine runs epochs of 16 reader and 16 writer partitions with 8-byte offsets (a
//! fixed function of epoch and partition, so any epoch's offsets are known). At seeded moments
//! the test reads the last commit the query reports durable, then takes the image and opens a
//! new durable query on it: its restart point must be at or after that commit, at or before
//! the last commit made, and hold that epoch's offsets. After a clean close the image must
//! restart after the last epoch. The same with `Durability::None` (only sealed segments are
//! synced): each image must restart no earlier than the one before it, and from some commit
//! once a segment was cleaned.

mod power_loss_support;
mod wal_support;

use coordbus::{
    coordinators::epoch::{
        DurableQuery, DurableQueryStatus, Epoch, EpochConfig, EpochCoordinator, NoopQuery,
        NoopSink, PartitionId, Payload,
    },
    wal::{Durability, IoMode, IoPath, Wal, WalConfig, WalOptions},
};
use power_loss_support::{Directory, SyncedImage};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use std::{path::Path, sync::Arc};

const PARTITIONS: i32 = 16;
const EPOCHS: i64 = 3000;
/// Committed epochs whose records the query keeps (cleaning runs every two epochs).
const RETAINED_EPOCHS: usize = 8;

fn config() -> WalConfig {
    WalConfig {
        segment_size_bytes: 64 << 10,
        durability: Durability::default(),
        ..WalConfig::default()
    }
}

/// Page-cache durability: the WAL syncs a segment only when it seals it.
fn unsynced_config() -> WalConfig {
    WalConfig { durability: Durability::None, ..config() }
}

/// Partition `partition`'s offset in `epoch`: grows by a few thousand per epoch, so offsets
/// records are mostly deltas.
fn offset(epoch: i64, partition: i32) -> i64 {
    epoch * 4096 + i64::from(partition) * 7 + (epoch * i64::from(partition)) % 13
}

fn offsets(epoch: i64) -> Vec<(PartitionId, Payload)> {
    (0..PARTITIONS).map(|p| (PartitionId(p), Payload::from(offset(epoch, p)))).collect()
}

/// Opens a durable query on `image` (a restart after the power loss) and checks its restart
/// point against `durable` (the last commit reported durable before the image was taken) and
/// `committed` (the last commit made). Returns the restart point's epoch.
fn check_image(image: &Path, durable: Option<Epoch>, committed: Epoch) -> Option<Epoch> {
    let query = DurableQuery::open(image, config())
        .unwrap_or_else(|error| panic!("the image does not open: {error}"));
    match (query.restart_point(), durable) {
        (None, None) => None,
        (None, Some(durable)) => panic!("commit of epoch {durable} reported durable, then lost"),
        (Some((epoch, logged)), durable) => {
            assert!(
                durable.is_none_or(|durable| *epoch >= durable),
                "restarts from epoch {epoch}, before {durable:?}, reported durable"
            );
            assert!(*epoch <= committed, "restarts from epoch {epoch}, never committed");
            assert_eq!(logged, &offsets(epoch.0), "the offsets of epoch {epoch}");
            Some(*epoch)
        }
    }
}

/// Runs `EPOCHS` epochs through a coordinator whose durable query writes through `storage`
/// with `wal_config`, calling `at_random_moment(epoch)` after about one epoch in a hundred.
fn run_epochs(
    dir: &Path,
    io: IoMode,
    storage: &Arc<SyncedImage>,
    wal_config: WalConfig,
    seed: u64,
    mut at_random_moment: impl FnMut(&DurableQueryStatus, Epoch),
) -> DurableQueryStatus {
    let options = WalOptions { io, storage: Arc::clone(storage) as _, ..WalOptions::default() };
    let wal = Wal::open_with_options(dir, wal_config.clone(), options).unwrap();
    let query =
        DurableQuery::from_wal(wal, NoopQuery).unwrap().with_retained_epochs(RETAINED_EPOCHS);
    let status = query.status();
    let start = query.start_epoch();
    assert_eq!(start, Epoch(0), "a new log");
    let mut coordinator = EpochCoordinator::new(EpochConfig::new(start), query, NoopSink).unwrap();
    coordinator.set_reader_partitions(PARTITIONS).unwrap();
    coordinator.set_writer_partitions(PARTITIONS).unwrap();
    let mut rng = XorShiftRng::seed_from_u64(seed);
    for epoch in 0..EPOCHS {
        for (partition, offset) in offsets(epoch) {
            coordinator.report_partition_offset(partition, Epoch(epoch), offset).unwrap();
            let message = Payload::from(epoch);
            coordinator.commit_partition_epoch(partition, Epoch(epoch), message).unwrap();
        }
        assert_eq!(coordinator.last_committed(), Epoch(epoch));
        if rng.random_ratio(1, 100) {
            at_random_moment(&status, Epoch(epoch));
        }
    }
    let stats = status.wal_stats().unwrap();
    assert!(stats.cleaned_segments > 0, "no segment was cleaned: {stats:?}");
    assert!(stats.recycled_segments > 0, "no spare was reused: {stats:?}");
    if io == IoMode::IoUring {
        assert_eq!(stats.io_path, Some(IoPath::IoUring), "the ring engine wrote, not a fallback");
        // Without syncs of its own (Durability::None), the ring syncs nothing: the segments
        // are sealed with a sync outside it.
        let syncs_groups = !matches!(wal_config.durability, Durability::None);
        assert!(!syncs_groups || storage.ring_syncs() > 0, "no ring sync was modelled");
    }
    // A clean stop closes the log: everything is durable.
    drop(coordinator);
    status
}

fn durable_commits_survive_a_power_loss(io: IoMode, directory: Directory, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(SyncedImage::new(io == IoMode::IoUring, directory, seed));
    let (mut images, mut images_after_a_durable_commit) = (0, 0);
    run_epochs(dir.path(), io, &storage, config(), seed, |status, epoch| {
        // Reported durable before the image is taken: its sync came before.
        let durable = status.durable_committed();
        let image = tempfile::tempdir().unwrap();
        storage.image(image.path());
        check_image(image.path(), durable, epoch);
        images += 1;
        images_after_a_durable_commit += usize::from(durable.is_some());
    });
    assert!(images >= 10, "only {images} images");
    // Else no image checked that a commit reported durable survived.
    assert!(images_after_a_durable_commit > 0, "no commit was reported durable before an image");
    let image = tempfile::tempdir().unwrap();
    storage.image(image.path());
    check_image(image.path(), Some(Epoch(EPOCHS - 1)), Epoch(EPOCHS - 1));
}

/// With `Durability::None` a commit counts as durable once written (a kill -9 keeps it), and
/// only sealed segments are synced. A power loss may then lose the newest commits, never what
/// a sealed segment holds: cleaning follows the commits known synced, not those written (it
/// once deleted every synced segment on the strength of commits only the page cache held, and
/// a power loss left no commit at all). So each image restarts no earlier than the image
/// before it, and once a segment was cleaned, from some commit.
fn synced_commits_survive_a_power_loss_without_syncs(io: IoMode, directory: Directory, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(SyncedImage::new(io == IoMode::IoUring, directory, seed));
    let (mut images, mut images_after_cleaning) = (0, 0);
    let mut previous: Option<Epoch> = None;
    run_epochs(dir.path(), io, &storage, unsynced_config(), seed, |status, epoch| {
        let cleaned = status.wal_stats().unwrap().cleaned_segments > 0;
        let image = tempfile::tempdir().unwrap();
        storage.image(image.path());
        let restart = check_image(image.path(), None, epoch);
        assert!(restart >= previous, "restarts from {restart:?}, before an image's {previous:?}");
        assert!(!cleaned || restart.is_some(), "a segment was cleaned, and no commit survives");
        previous = restart;
        images += 1;
        images_after_cleaning += usize::from(cleaned);
    });
    assert!(images >= 10, "only {images} images");
    assert!(images_after_cleaning > 0, "no image was taken after a segment was cleaned");
    let image = tempfile::tempdir().unwrap();
    storage.image(image.path());
    check_image(image.path(), Some(Epoch(EPOCHS - 1)), Epoch(EPOCHS - 1));
}

#[test]
fn without_syncs_a_power_loss_keeps_the_sealed_segments_commits() {
    synced_commits_survive_a_power_loss_without_syncs(
        IoMode::Pwrite,
        Directory::Eager,
        0x5eed_4005,
    );
}

#[test]
fn without_syncs_on_io_uring_a_power_loss_keeps_the_sealed_segments_commits() {
    if wal_support::kernel_allows_io_uring() {
        synced_commits_survive_a_power_loss_without_syncs(
            IoMode::IoUring,
            Directory::Eager,
            0x5eed_4006,
        );
    }
}

#[test]
fn every_commit_reported_durable_survives_a_power_loss() {
    durable_commits_survive_a_power_loss(IoMode::Pwrite, Directory::Lazy, 0x5eed_4001);
}

#[test]
fn every_commit_reported_durable_survives_a_power_loss_that_keeps_every_unlink() {
    durable_commits_survive_a_power_loss(IoMode::Pwrite, Directory::Eager, 0x5eed_4003);
}

#[test]
fn every_commit_reported_durable_on_io_uring_survives_a_power_loss() {
    if wal_support::kernel_allows_io_uring() {
        durable_commits_survive_a_power_loss(IoMode::IoUring, Directory::Lazy, 0x5eed_4002);
    }
}

#[test]
fn every_commit_reported_durable_on_io_uring_survives_a_power_loss_that_keeps_every_unlink() {
    if wal_support::kernel_allows_io_uring() {
        durable_commits_survive_a_power_loss(IoMode::IoUring, Directory::Eager, 0x5eed_4004);
    }
}
