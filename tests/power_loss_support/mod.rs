//! `SyncedImage`, a storage layer over the real file system that keeps what a power loss would
//! leave: for every file the bytes it held at its last sync, and for the directory the names
//! (and the files they name) as of its last directory sync, or of its last rename or unlink
//! (`Directory::Eager`). `image` writes that state out as a directory of its own, which a test
//! opens as a restarted process would after a power loss. Used by the power-loss tests of the
//! WAL, the epoch log and the block tracker.
//!
//! Both write paths are modelled:
//! * **pwrite**: the storage layer hides the descriptors, so every write and sync goes through
//!   it; a sync makes durable what the file held as it started.
//! * **io_uring**: the layer hands the engine the real descriptors and learns of each ring
//!   entry twice, at submission (`StorageFile::ring_fault`) and when the engine reaps its
//!   completion (`StorageFile::ring_completed`). A ring `fdatasync` makes durable what the file
//!   holds when its completion is reaped, except the bytes of every write it may not cover,
//!   which keep what the last sync left (zeros if none): writes submitted after it, and, unless
//!   the kernel orders it behind every earlier write (drained or linked), writes whose
//!   completions were not reaped before it was submitted. This is stricter than the kernel
//!   (which covers any write finished before the sync started), so a group acknowledged on a
//!   sync that did not cover it is caught, pipelining included. Ring writes come up short or
//!   are interrupted (chosen by a hash of the seed, the file and the write's place), so the
//!   engine's finishing of them with pwrite runs too.
//!
//! The directory: by default a name change (create, rename, unlink) is durable only after a
//! directory sync (`Directory::Lazy`). `Directory::Eager` makes every rename and unlink
//! durable at once with every change before it: the state a journal commit right after it
//! leaves (ext4 commits metadata in order, and any `fsync` may commit the journal). Only the
//! changed file's directory is persisted (the logs here live in one directory); a commit right
//! after a create (a new name before its header is synced) is not modelled. A correct log
//! survives both extremes.
//!
//! Limits of the model: it learns of ring entries from the engine's own calls, made where each
//! entry is built and where its completion is read, so it checks how the engine orders writes,
//! syncs and acknowledgements, not whether the kernel ran what was submitted. A write that
//! lands while a sync through the storage layer runs may or may not be in it, and the model may
//! count it in (that sync snapshots the file as it starts; only ring writes in flight are
//! masked).

#![allow(dead_code)]

use std::{
    collections::HashMap,
    io,
    os::fd::RawFd,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

use coordbus::wal::{FileStorage, RingFault, RingOp, Storage, StorageFile};

/// What a power loss would leave, as of now.
#[derive(Debug, Default)]
pub struct Durable {
    /// File identity by current name (created, renamed, removed as the log does).
    current: HashMap<PathBuf, u64>,
    /// File identity by name as of the directory's last sync.
    synced_names: HashMap<PathBuf, u64>,
    /// Each file's bytes as of its last `sync_data` (none: never synced, empty after a loss).
    synced_bytes: HashMap<u64, Vec<u8>>,
    next_id: u64,
    /// Name changes so far, and per directory how many of them `synced_names` holds: a
    /// directory sync that started before a change made durable since (eagerly, or by an
    /// overlapping sync) must not undo it.
    name_changes: u64,
    names_durable_through: HashMap<PathBuf, u64>,
}

/// The real file system, recording what each sync made durable (module doc).
#[derive(Debug, Default)]
pub struct SyncedImage {
    durable: Arc<Mutex<Durable>>,
    /// Hand the engine the real descriptors, so io_uring writes and syncs through them.
    ring: bool,
    /// Ring syncs whose success the model applied.
    ring_syncs: Arc<AtomicUsize>,
    /// Ring writes to come up short or be interrupted now and then (seeded), so the engine's
    /// finishing of such writes with pwrite runs under the model too.
    ring_faults: Option<Arc<RingFaults>>,
    /// A removal or rename is durable at once, with every directory change before it (as a
    /// journal commit right after it would make it), instead of only at the next directory
    /// sync: the other extreme of what a power loss may leave of the directory.
    eager_directory: bool,
}

/// Seeded faults for ring writes, shared by every file of a log.
#[derive(Debug)]
pub struct RingFaults {
    seed: u64,
    injected: AtomicUsize,
}

impl RingFaults {
    fn new(seed: u64) -> Self {
        Self { seed, injected: AtomicUsize::new(0) }
    }

    /// For a ring write of `len` bytes at `offset` of file `file`: one in 16 comes up short
    /// (half of it is submitted), one in 32 is interrupted (`EINTR`, nothing written); the
    /// engine finishes both with pwrite. Chosen by a hash of the seed and the write, so the
    /// same writes get the same faults whatever the timing.
    fn for_write(&self, file: u64, offset: u64, len: usize) -> Option<RingFault> {
        let mut hash = self.seed ^ file.rotate_left(48) ^ offset.rotate_left(16) ^ len as u64;
        // splitmix64's finalizer.
        hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let fault = match (hash ^ (hash >> 31)) % 32 {
            0 | 1 if len > 1 => RingFault::ShortWrite(len / 2),
            2 => RingFault::Errno(libc::EINTR),
            _ => return None,
        };
        self.injected.fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }
}

#[derive(Debug)]
pub struct TrackedFile {
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
pub struct RingState {
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
    pub fn image(&self, into: &Path) {
        let durable = self.durable.lock().unwrap();
        for (path, id) in &durable.synced_names {
            let bytes = durable.synced_bytes.get(id).map_or(&[][..], Vec::as_slice);
            std::fs::write(into.join(path.file_name().unwrap()), bytes).unwrap();
        }
    }
}

impl SyncedImage {
    /// Whether `bytes` are in what a power loss would leave now (a file under a synced name).
    pub fn holds_durably(&self, bytes: &[u8]) -> bool {
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
        durable.name_changes += 1;
        Ok(Arc::new(TrackedFile::new(inner, id, self)))
    }

    fn open_existing(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let inner = FileStorage.open_existing(path)?;
        let id = self.durable.lock().unwrap().current[path];
        Ok(Arc::new(TrackedFile::new(inner, id, self)))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        FileStorage.remove(path)?;
        let mut durable = self.durable.lock().unwrap();
        durable.current.remove(path);
        durable.name_changes += 1;
        if self.eager_directory {
            durable.persist_names(path.parent().expect("a file in a directory"));
        }
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        FileStorage.rename(from, to)?;
        let mut durable = self.durable.lock().unwrap();
        let id = durable.current.remove(from).expect("renaming a known file");
        durable.current.insert(to.to_path_buf(), id);
        durable.name_changes += 1;
        if self.eager_directory {
            durable.persist_names(to.parent().expect("a file in a directory"));
        }
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        // The names as the sync starts are what it makes durable (a change while it runs may
        // miss it).
        let (in_dir, changes) = {
            let durable = self.durable.lock().unwrap();
            (durable.names_in(dir), durable.name_changes)
        };
        FileStorage.sync_dir(dir)?;
        let mut durable = self.durable.lock().unwrap();
        if changes > durable.names_durable_through.get(dir).copied().unwrap_or(0) {
            durable.synced_names.retain(|path, _| path.parent() != Some(dir));
            durable.synced_names.extend(in_dir);
            durable.names_durable_through.insert(dir.to_path_buf(), changes);
        }
        Ok(())
    }
}

impl Durable {
    /// The current names in `dir`.
    fn names_in(&self, dir: &Path) -> HashMap<PathBuf, u64> {
        self.current
            .iter()
            .filter(|(path, _)| path.parent() == Some(dir))
            .map(|(path, id)| (path.clone(), *id))
            .collect()
    }

    /// Makes the current names in `dir` durable, as a directory sync would.
    fn persist_names(&mut self, dir: &Path) {
        let in_dir = self.names_in(dir);
        self.synced_names.retain(|path, _| path.parent() != Some(dir));
        self.synced_names.extend(in_dir);
        self.names_durable_through.insert(dir.to_path_buf(), self.name_changes);
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
                self.ring_faults.as_ref().and_then(|faults| faults.for_write(self.id, offset, len))
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

/// When the model makes directory changes durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Directory {
    /// At directory syncs only.
    Lazy,
    /// Renames and removals at once, with every change before them.
    Eager,
}

impl SyncedImage {
    /// A model of the real file system; `ring`: hand the engine the real descriptors (the
    /// io_uring path), with ring-write faults seeded from `seed`; `directory`: when renames
    /// and removals become durable.
    pub fn new(ring: bool, directory: Directory, seed: u64) -> Self {
        Self {
            ring,
            ring_faults: ring.then(|| Arc::new(RingFaults::new(seed))),
            eager_directory: directory == Directory::Eager,
            ..Self::default()
        }
    }

    /// Ring syncs whose success the model applied.
    pub fn ring_syncs(&self) -> usize {
        self.ring_syncs.load(Ordering::SeqCst)
    }

    /// Ring writes made short or interrupted so far.
    pub fn ring_faults_injected(&self) -> usize {
        self.ring_faults.as_ref().map_or(0, |faults| faults.injected.load(Ordering::SeqCst))
    }
}
