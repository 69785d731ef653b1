//! Goal (SPEC D.5 after a power loss, not just a kill -9): a tracker recovered from what a power
//! loss leaves of its write-ahead log holds every block addition, batch allocation and batch
//! cleanup that was durable, and nothing else. `block_tracker_crash` kills a process, which
//! keeps the page cache; here only synced bytes survive.
//!
//! Method: the tracker's log writes through `power_loss_support::SyncedImage` (on both write
//! paths, with directory changes durable at syncs or at once; see its module doc and limits),
//! in 64 KiB segments that also roll every second of the manual clock, so that rolls, time
//! cleaning and spare reuse happen. Batches 100 ms apart: blocks of two streams are added
//! without waiting for each, then made durable together (as a receiver's batch is), the batch
//! is allocated (which waits for its record), and every tenth batch the batches older than two
//! seconds are cleaned up, log files included. Every operation is durable when the next one
//! starts, so at the seeded moments (after a batch's additions, or after its allocation) the
//! image must recover to exactly the tracker's state: unallocated blocks, allocated batches
//! and their blocks, last allocation.

mod power_loss_support;
mod wal_support;

use std::{path::Path, sync::Arc, time::Duration};

use coordbus::{
    clock::ManualClock,
    coordinators::block_tracker::{
        BatchCleanupEvent, BatchTime, BlockLog, BlockStoreResult, BlockTrackerConfig, Logged,
        ReceivedBlockInfo, ReceivedBlockTracker, StreamBlockId, StreamId, TrackerEvent,
        WalBlockLog, RECEIVED_BLOCK_METADATA_DIR,
    },
    wal::{IoMode, IoPath, Lsn, Wal, WalOptions},
};
use power_loss_support::{Directory, SyncedImage};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

const STREAMS: [StreamId; 2] = [StreamId(1), StreamId(2)];
const BATCHES: i64 = 300;
const BATCH_INTERVAL_MS: i64 = 100;
const BLOCKS_PER_STREAM: u64 = 24;
/// Batches older than this are cleaned up (every tenth batch).
const REMEMBER_MS: i64 = 2000;
/// Longest a test wait for durability may take (a hang is a failure).
const DURABLE_WAIT: Duration = Duration::from_secs(60);

fn config() -> BlockTrackerConfig {
    let mut config = BlockTrackerConfig::new(STREAMS);
    config.wal.segment_size_bytes = 64 << 10;
    config.wal.rolling_interval = Some(Duration::from_secs(1));
    // An allocation or cleanup waits this long for its record (a slow sync on a loaded
    // machine must not roll it back).
    config.write_timeout = DURABLE_WAIT;
    config
}

fn block(stream: StreamId, unique_id: u64) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream, unique_id };
    ReceivedBlockInfo::new(stream, Some(10), None, BlockStoreResult::BlockManager { block_id })
        .unwrap()
}

/// Recovers a tracker from `image` (a checkpoint directory) and checks it holds exactly what
/// `tracker` holds.
fn check_image(image: &Path, tracker: &ReceivedBlockTracker, clock: &Arc<ManualClock>) {
    let config = config().checkpoint_dir(image).recover(true);
    let recovered = ReceivedBlockTracker::open(config, Arc::clone(clock) as _)
        .unwrap_or_else(|error| panic!("the image does not recover: {error}"));
    for stream in STREAMS {
        assert_eq!(
            recovered.unallocated_blocks(stream),
            tracker.unallocated_blocks(stream),
            "unallocated blocks of stream {stream:?}"
        );
    }
    assert_eq!(recovered.allocated_batch_times(), tracker.allocated_batch_times());
    for time in tracker.allocated_batch_times() {
        assert_eq!(recovered.blocks_of_batch(time), tracker.blocks_of_batch(time), "batch {time}");
    }
    assert_eq!(recovered.last_allocated_batch_time(), tracker.last_allocated_batch_time());
}

/// Writes what a power loss would leave now as a checkpoint directory and checks it.
fn take_and_check_image(
    storage: &SyncedImage,
    tracker: &ReceivedBlockTracker,
    clock: &Arc<ManualClock>,
) {
    let image = tempfile::tempdir().unwrap();
    let image_wal = image.path().join(RECEIVED_BLOCK_METADATA_DIR);
    std::fs::create_dir(&image_wal).unwrap();
    storage.image(&image_wal);
    check_image(image.path(), tracker, clock);
}

fn durable_state_survives_a_power_loss(io: IoMode, directory: Directory, seed: u64) {
    let checkpoint = tempfile::tempdir().unwrap();
    let storage = Arc::new(SyncedImage::new(io == IoMode::IoUring, directory, seed));
    let options = WalOptions { io, storage: Arc::clone(&storage) as _, ..WalOptions::default() };
    let wal_dir = checkpoint.path().join(RECEIVED_BLOCK_METADATA_DIR);
    let wal = Arc::new(Wal::open_with_options(&wal_dir, config().wal, options).unwrap());
    let log: Arc<dyn BlockLog> = Arc::new(WalBlockLog::from_wal(Arc::clone(&wal)));
    let clock = Arc::new(ManualClock::new(0));
    let mut tracker =
        ReceivedBlockTracker::with_log(config(), Arc::clone(&clock) as _, Some(log)).unwrap();
    let mut rng = XorShiftRng::seed_from_u64(seed);
    let mut next_id = 0u64;
    let mut images = 0;
    for batch in 1..=BATCHES {
        let time = batch * BATCH_INTERVAL_MS;
        clock.set_ms(time);
        let mut last = Lsn::ZERO;
        for stream in STREAMS {
            for _ in 0..BLOCKS_PER_STREAM {
                next_id += 1;
                match tracker.add_block_deferred(block(stream, next_id)) {
                    Logged::Pending(lsn) => last = last.max(lsn),
                    other => panic!("addition not appended: {other:?}"),
                }
            }
        }
        tracker.log().unwrap().wait_durable(last, DURABLE_WAIT).unwrap();
        // The additions are durable, not yet allocated: they must come back unallocated.
        if rng.random_ratio(1, 12) {
            take_and_check_image(&storage, &tracker, &clock);
            images += 1;
        }
        tracker.allocate_blocks_to_batch(BatchTime(time)).unwrap();
        assert_eq!(tracker.last_allocated_batch_time(), Some(BatchTime(time)), "batch allocated");
        if batch % 10 == 0 && time > REMEMBER_MS {
            tracker.cleanup_old_batches(BatchTime(time - REMEMBER_MS), true).unwrap();
        }
        if rng.random_ratio(1, 12) {
            take_and_check_image(&storage, &tracker, &clock);
            images += 1;
        }
    }
    assert!(images >= 20, "only {images} images");
    let stats = wal.stats();
    assert!(stats.cleaned_segments > 0, "no segment was cleaned: {stats:?}");
    assert!(stats.recycled_segments > 0, "no spare was reused: {stats:?}");
    if io == IoMode::IoUring {
        assert_eq!(stats.io_path, Some(IoPath::IoUring), "the ring engine wrote, not a fallback");
        assert!(storage.ring_syncs() > 0, "no ring sync was modelled");
    }
}

#[test]
fn durable_additions_allocations_and_cleanups_survive_a_power_loss() {
    durable_state_survives_a_power_loss(IoMode::Pwrite, Directory::Lazy, 0x5eed_6001);
}

#[test]
fn durable_state_survives_a_power_loss_that_keeps_every_unlink() {
    durable_state_survives_a_power_loss(IoMode::Pwrite, Directory::Eager, 0x5eed_6002);
}

#[test]
fn durable_state_on_io_uring_survives_a_power_loss() {
    if wal_support::kernel_allows_io_uring() {
        durable_state_survives_a_power_loss(IoMode::IoUring, Directory::Lazy, 0x5eed_6003);
    }
}

#[test]
fn durable_state_on_io_uring_survives_a_power_loss_that_keeps_every_unlink() {
    if wal_support::kernel_allows_io_uring() {
        durable_state_survives_a_power_loss(IoMode::IoUring, Directory::Eager, 0x5eed_6004);
    }
}

/// After a failed sync, records past the durable LSN may read back damaged (pages the kernel
/// dropped). Replaying up to the durable LSN, which a tracker does to rebuild after its log
/// failed, reads none of them: the durable prefix is replayed whatever follows it.
#[test]
fn a_replay_up_to_an_lsn_reads_nothing_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Arc::new(Wal::open(dir.path(), coordbus::wal::WalConfig::default()).unwrap());
    let log = WalBlockLog::from_wal(Arc::clone(&wal));
    for time in 1..=4 {
        let cleanup = BatchCleanupEvent { times: vec![BatchTime(time)] };
        let lsn = log.append(&TrackerEvent::BatchCleanup(cleanup), time).unwrap();
        log.wait_durable(lsn, DURABLE_WAIT).unwrap();
    }
    let fourth = wal.iter_from(Lsn(4)).unwrap().next().unwrap().unwrap().handle;
    let segment = dir.path().join(coordbus::wal::segment::file_name(fourth.segment));
    let file = std::fs::OpenOptions::new().write(true).open(segment).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0xa5; 16], fourth.offset).unwrap();

    let mut replayed = Vec::new();
    let mut record = |lsn: Lsn, _: TrackerEvent| replayed.push(lsn);
    assert!(log.replay(None, &mut record).is_err(), "a whole replay reads the damage");
    replayed.clear();
    let mut record = |lsn: Lsn, _: TrackerEvent| replayed.push(lsn);
    assert_eq!(log.replay(Some(Lsn(3)), &mut record).unwrap(), 3);
    assert_eq!(replayed, [Lsn(1), Lsn(2), Lsn(3)]);
    let mut record = |_: Lsn, _: TrackerEvent| panic!("nothing is durable");
    assert_eq!(log.replay(Some(Lsn::ZERO), &mut record).unwrap(), 0);
}
