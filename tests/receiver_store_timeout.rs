//! A receiver's `ReceiverBlockStore::store` waits for durability at most its store timeout
//! (Spark's `blockStoreTimeout`): a sync that does not finish fails the store with a typed
//! timeout naming the LSN and the bound, instead of hanging the receiver; once the sync
//! finishes, the data is durable and readable.
//!
//! Method: a storage whose `sync_data` is held at a gate until the test opens it, on the
//! pwrite path with group commit (so the sync thread, not the storing thread, syncs).

use std::{
    io,
    os::fd::RawFd,
    path::Path,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use coordbus::{
    coordinators::block_tracker::{
        BlockStoreResult, ReceivedBlockInfo, ReceiverBlockStore, StreamBlockId, StreamId,
        DEFAULT_STORE_TIMEOUT,
    },
    wal::{
        Durability, FileStorage, IoMode, Storage, StorageFile, Wal, WalConfig, WalError, WalOptions,
    },
};

/// Far longer than a sync; a wait that has not returned by then is hung.
const BOUND: Duration = Duration::from_secs(30);

/// Holds every sync until the test opens it.
#[derive(Debug, Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    /// Waits (bounded: a test that never opens it fails anyway) until the gate is open.
    fn pass(&self) {
        let open = self.open.lock().unwrap();
        let _open = self.opened.wait_timeout_while(open, BOUND, |open| !*open).unwrap();
    }
}

#[derive(Debug)]
struct GatedSyncStorage(Arc<Gate>);

#[derive(Debug)]
struct GatedSyncFile(Arc<dyn StorageFile>, Arc<Gate>);

impl Storage for GatedSyncStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        FileStorage.create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(Arc::new(GatedSyncFile(FileStorage.create(path)?, Arc::clone(&self.0))))
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

impl StorageFile for GatedSyncFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.0.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.1.pass();
        self.0.sync_data()
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

fn open_gated(dir: &Path, gate: &Arc<Gate>) -> Wal {
    let config = WalConfig {
        segment_size_bytes: 1 << 20,
        durability: Durability::GroupCommit {
            max_delay: Duration::from_micros(200),
            max_bytes: 1 << 20,
        },
        ..WalConfig::default()
    };
    let options = WalOptions {
        io: IoMode::Pwrite,
        storage: Arc::new(GatedSyncStorage(Arc::clone(gate))),
        ..WalOptions::default()
    };
    Wal::open_with_options(dir, config, options).unwrap()
}

fn block(id: u64) -> StreamBlockId {
    StreamBlockId { stream: StreamId(0), unique_id: id }
}

#[test]
fn a_store_whose_sync_does_not_finish_times_out_with_its_lsn_and_bound() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let timeout = Duration::from_millis(100);
    let store =
        ReceiverBlockStore::from_wal(open_gated(dir.path(), &gate)).with_store_timeout(timeout);
    assert_eq!(store.store_timeout(), timeout);

    let started = Instant::now();
    let error = store.store(block(1), b"held at the gate", 10).unwrap_err();
    let waited = started.elapsed();
    match error {
        WalError::Timeout { lsn, timeout: reported, .. } => {
            assert_eq!(reported, timeout);
            assert_eq!(lsn, store.wal().appended_lsn().0, "the timeout names the block's LSN");
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(waited >= timeout, "returned before its bound: {waited:?}");
    assert!(waited < BOUND, "the store waited {waited:?}");

    // Once the sync finishes, the timed-out data is durable after all, and a new store returns
    // a block that reads back.
    gate.open();
    let appended = store.wal().appended_lsn();
    store.wal().wait_durable_timeout(appended, BOUND).unwrap();
    let result = store.store(block(2), b"stored", 11).unwrap();
    assert!(
        matches!(result, BlockStoreResult::ReceiverWal { block_id, .. } if block_id == block(2))
    );
    let info = ReceivedBlockInfo::new(StreamId(0), Some(1), None, result).unwrap();
    assert_eq!(&*store.read(&info).unwrap(), b"stored");
}

#[test]
fn the_default_store_timeout_is_sparks_thirty_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let store = ReceiverBlockStore::open(dir.path(), WalConfig::default()).unwrap();
    assert_eq!(DEFAULT_STORE_TIMEOUT, Duration::from_secs(30));
    assert_eq!(store.store_timeout(), DEFAULT_STORE_TIMEOUT);
    store.store(block(1), b"data", 1).unwrap();
}
