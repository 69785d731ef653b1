//! [`EpochCoordinator`]: the state machine (no I/O, no threads). See the parent module for the
//! design and the behaviour decisions.
//!
//! Invariants (checked by `debug_assert!` where cheap):
//! * every stored bucket's epoch is above `last_committed`;
//! * `offset_entries` = offsets in stored buckets + `retained_offsets` (same for commits);
//! * `waiting_epochs` = buckets with `waiting` set; a waiting bucket was ready when it was set
//!   (a count change since may have made it not ready: the commit chain takes a waiting epoch
//!   only if it is ready now);
//! * `backlog_slack` <= the least room left under the three backlog limits (limit - size,
//!   0 for a queue at or over its limit);
//! * `admission` is what [`AdmissionGate::of`] derives from the partition counts, the last
//!   committed epoch and `writes_stopped`;
//! * `by_epoch` maps exactly the live buckets; `free` lists exactly the other slab slots;
//! * `cached_epoch` is [`NO_CACHED_EPOCH`] or a live bucket's epoch, with `cached_slot` its
//!   slot.

use std::{
    collections::{hash_map::Entry, HashMap},
    hash::{BuildHasherDefault, Hasher},
};

use super::{
    worth_a_warning, BacklogQueue, DropReason, Epoch, EpochConfig, EpochCounters, EpochError,
    EpochMessage, EpochStats, MessageKind, Offsets, PartitionId, PartitionSide, Payload, Query,
    Rejected, Sink,
};
use crate::error::ConfigError;

/// The least dense window ([`dense_window`]), in epochs ahead of the last committed epoch.
const DENSE_WINDOW_EPOCHS_MIN: i64 = 16;
/// [`EpochCoordinator`]'s bucket cache holds no bucket. No bucket has this epoch: every one is
/// above the last committed epoch, which is at least -1 (the start epoch is not negative), and
/// every epoch looked up is above it too.
const NO_CACHED_EPOCH: Epoch = Epoch(i64::MIN);

/// A multiplicative hash for integer keys (partition ids, epochs): one multiply and a fold, so
/// both the low bits (bucket position) and the high bits (SwissTable tag) depend on every key
/// bit. Keys come from the engine, not from the network, so no keyed hash is needed.
#[derive(Default, Clone, Copy)]
pub(crate) struct IntHasher(u64);

impl IntHasher {
    const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

    #[inline]
    fn mix(&mut self, value: u64) {
        let product = (self.0 ^ value).wrapping_mul(Self::MULTIPLIER);
        self.0 = product ^ (product >> 32);
    }
}

impl Hasher for IntHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }
    #[inline]
    fn write_i32(&mut self, value: i32) {
        self.mix(u64::from(value as u32));
    }
    #[inline]
    fn write_i64(&mut self, value: i64) {
        self.mix(value as u64);
    }
}

pub(crate) type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// Whether a dense side for `count` partitions stays within `limit` entries: a dense side is
/// sized by the partition count, not by what it holds, so only a count within its backlog limit
/// is laid out densely (a larger one is sparse and grows with its entries), and memory stays
/// bounded by the limits.
fn fits_limit(count: i32, limit: usize) -> bool {
    usize::try_from(count).is_ok_and(|count| count <= limit)
}

/// The capacity a free bucket's side for `count` partitions under `limit` may keep: its
/// count, at most one more than the limit (no side holds more: a queue over its limit takes
/// no new entry, see [`EpochCoordinator::full_queue_refuses`]), or [`SMALL_SIDE_CAPACITY`] if
/// that is more.
fn reusable_capacity(count: i32, limit: usize) -> usize {
    usize::try_from(count).unwrap_or(0).min(limit.saturating_add(1)).max(SMALL_SIDE_CAPACITY)
}

/// How many free buckets (the last released, popped first) keep their allocations for a side
/// of `count` partitions under `limit`: as many as `limit` fills at [`reusable_capacity`]
/// each, and at least [`DENSE_WINDOW_EPOCHS_MIN`]. The recycled sides then take at most
/// `max(16 x reusable_capacity, limit)` slots (the live dense sides at most `max(16 x count,
/// limit)` up to 16 Ki partitions, `limit` above).
fn recycle_window(count: i32, limit: usize) -> usize {
    (limit / reusable_capacity(count, limit)).max(DENSE_WINDOW_EPOCHS_MIN as usize)
}

/// How many epochs ahead of the last committed one a side for `count` partitions is laid out
/// densely (and may reuse a recycled allocation); further ahead it is sparse and starts small.
///
/// As many epochs as `limit` holds full epochs of `count` entries, and at least
/// [`DENSE_WINDOW_EPOCHS_MIN`] for counts up to [`LEAST_WINDOW_PARTITIONS_MAX`] (above it,
/// no minimum: the limit's full epochs, at least the next one for a count within the limit):
/// the live dense sides then take at most `max(16 x min(count, 16 Ki), limit)` slots of 40
/// bytes, within what the limit's entries take anyway.
/// A window sized by the limit covers every epoch a backlog of full epochs within it reaches, so
/// producers that run ahead of one another (each epoch's partitions arriving from several
/// threads, some epochs ahead) fill dense sides: a sparse side of such an epoch hashes its
/// out-of-order ids, grows by reallocation and sorts on completion, and the allocation it gives
/// back is one a near epoch then lays out again.
fn dense_window(count: i32, limit: usize) -> i64 {
    let full_epochs =
        usize::try_from(count).ok().filter(|&count| count > 0).map_or(0, |count| limit / count);
    let full_epochs = i64::try_from(full_epochs).unwrap_or(i64::MAX);
    if count > LEAST_WINDOW_PARTITIONS_MAX {
        full_epochs
    } else {
        full_epochs.max(DENSE_WINDOW_EPOCHS_MIN)
    }
}

/// What an insert into [`Slots`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inserted {
    New,
    Replaced,
    Duplicate,
}

/// The entries of one epoch for one side (offsets or commits), in one of two layouts:
///
/// * **dense** (the usual case: the partition count is set, within the backlog limit and at
///   most [`DENSE_PARTITIONS_MAX`], and the epoch is near the commit frontier): `entries[p] ==
///   (p, payload)` for every `p` below the partition count the bucket was prepared for, a bitmap
///   says which slots hold a value. An insert is a bit test and a store; a complete side is
///   already the sorted slice the query and sink want.
/// * **sparse** (count unset, over the limit or [`DENSE_PARTITIONS_MAX`], or epoch far ahead):
///   entries in arrival order, found through a small hash map, sorted on completion. While
///   partitions arrive as 0, 1, 2, ... the vector is its own index ("positional", no hashing).
struct Slots {
    entries: Vec<(PartitionId, Payload)>,
    /// Dense layout: `entries.len()` is the prepared partition count and `present` its bitmap.
    dense: bool,
    present: Vec<u64>,
    /// Number of stored entries (dense: set bits; sparse: `entries.len()`).
    len: usize,
    /// What the side noted of the payloads it holds (heap payloads to free, the dense layout's
    /// since its last clear; how many are no 8-byte word).
    stored: StoredPayloads,
    /// Sparse layout: partition id -> position in `entries`, maintained only when `positional`
    /// is false.
    index: IntMap<i32, u32>,
    /// Sparse layout: `entries[i].0 == i` for every `i`; `index` is empty.
    positional: bool,
    /// Sparse layout: largest partition id stored (-1 when empty).
    max_partition: i32,
}

/// Entries a side keeps room for whatever the partition count: what [`Slots::shrink`] leaves.
const SMALL_SIDE_CAPACITY: usize = 16;

/// Largest partition count whose dense window is at least [`DENSE_WINDOW_EPOCHS_MIN`] epochs
/// whatever the limit (a dense side costs 40 bytes per partition: 16 epochs of 16 Ki
/// partitions are 10 MiB a side). Larger counts are laid out densely only as far ahead as the
/// limit holds full epochs ([`dense_window`]), so their dense sides stay within the limit.
const LEAST_WINDOW_PARTITIONS_MAX: i32 = 1 << 14;

/// Largest partition count laid out densely at all: a dense side is allocated whole for its
/// count by the epoch's first message, 40 bytes a partition, so this bounds what one message
/// can allocate at 40 MiB a side, whatever the limit.
const DENSE_PARTITIONS_MAX: i32 = 1 << 20;

impl Slots {
    fn new() -> Self {
        Self {
            entries: Vec::new(),
            dense: false,
            present: Vec::new(),
            len: 0,
            stored: StoredPayloads::default(),
            index: IntMap::default(),
            positional: true,
            max_partition: -1,
        }
    }

    /// Chooses the layout of an empty side for `count` partitions, of an epoch `ahead` epochs
    /// after the last committed one, under a backlog limit of `limit` entries: dense within
    /// the limit and the [`dense_window`]; beyond the window the side starts small.
    fn prepare_ahead(&mut self, count: i32, limit: usize, ahead: i64) {
        let far = ahead > dense_window(count, limit);
        if far {
            self.shrink();
        }
        self.prepare(count, !far && fits_limit(count, limit));
    }

    /// Chooses the layout of an empty side for `count` partitions.
    fn prepare(&mut self, count: i32, allow_dense: bool) {
        debug_assert_eq!(self.len, 0);
        if allow_dense && count > 0 && count <= DENSE_PARTITIONS_MAX {
            let count = count as usize;
            if !(self.dense && self.entries.len() == count) {
                self.entries.clear();
                self.entries.extend((0..count).map(|p| (PartitionId(p as i32), Payload::new())));
                self.present.clear();
                self.present.resize(count.div_ceil(64), 0);
                self.dense = true;
            }
        } else if self.dense {
            self.entries.clear();
            self.present.clear();
            self.dense = false;
            self.index.clear();
            self.positional = true;
            self.max_partition = -1;
        }
    }

    #[inline]
    fn len(&self) -> usize {
        self.len
    }

    /// Whether `partition` has an entry.
    fn contains(&self, partition: PartitionId) -> bool {
        let position = partition.0 as usize;
        if self.dense && position < self.entries.len() {
            return self.present[position / 64] & (1 << (position % 64)) != 0;
        }
        if self.dense {
            false
        } else if self.positional {
            position < self.entries.len()
        } else {
            self.index.contains_key(&partition.0)
        }
    }

    /// Stores `payload` for `partition`; an existing entry is replaced when `overwrite`, else
    /// kept (and `Duplicate` returned).
    ///
    /// The dense layout's new entry (nearly every message of a steady run) is inlined into the
    /// caller; everything else is [`Slots::insert_other`].
    #[inline(always)]
    fn insert(&mut self, partition: PartitionId, payload: Payload, overwrite: bool) -> Inserted {
        debug_assert!(partition.0 >= 0, "partition ids are validated before insert");
        let position = partition.0 as usize;
        if self.dense && position < self.entries.len() {
            let (word, bit) = (position / 64, 1u64 << (position % 64));
            if let Some(present) = self.present.get_mut(word) {
                if *present & bit == 0 {
                    *present |= bit;
                    self.stored.note(&payload);
                    self.entries[position].1 = payload;
                    self.len += 1;
                    return Inserted::New;
                }
            }
        }
        self.insert_other(partition, payload, overwrite)
    }

    /// The rest of [`Slots::insert`]: a repeated partition of the dense layout (a new one took
    /// the fast path), or any partition once the side is sparse.
    #[inline(never)]
    fn insert_other(
        &mut self,
        partition: PartitionId,
        payload: Payload,
        overwrite: bool,
    ) -> Inserted {
        let position = partition.0 as usize;
        if self.dense {
            if position < self.entries.len() {
                debug_assert!(
                    self.present[position / 64] & (1 << (position % 64)) != 0,
                    "a new dense entry takes `insert`'s fast path"
                );
                if !overwrite {
                    return Inserted::Duplicate;
                }
                self.stored.note_replacing(&self.entries[position].1, &payload);
                self.entries[position].1 = payload;
                return Inserted::Replaced;
            }
            self.make_sparse();
        }
        if self.positional {
            let len = self.entries.len();
            if position < len {
                debug_assert_eq!(self.entries[position].0, partition);
                if !overwrite {
                    return Inserted::Duplicate;
                }
                self.stored.note_replacing(&self.entries[position].1, &payload);
                self.entries[position].1 = payload;
                return Inserted::Replaced;
            }
            if position == len {
                self.stored.note(&payload);
                self.entries.push((partition, payload));
                self.max_partition = partition.0;
                self.len += 1;
                return Inserted::New;
            }
            self.positional = false;
            self.rebuild_index();
        }
        match self.index.entry(partition.0) {
            Entry::Occupied(occupied) => {
                if !overwrite {
                    return Inserted::Duplicate;
                }
                let replaced = &mut self.entries[*occupied.get() as usize].1;
                self.stored.note_replacing(replaced, &payload);
                *replaced = payload;
                Inserted::Replaced
            }
            Entry::Vacant(vacant) => {
                // Entries per bucket are bounded by the partition ids, which are i32.
                vacant.insert(self.entries.len() as u32);
                self.stored.note(&payload);
                self.entries.push((partition, payload));
                self.max_partition = self.max_partition.max(partition.0);
                self.len += 1;
                Inserted::New
            }
        }
    }

    /// Turns the dense layout into the sparse one (rare: the partition count changed after the
    /// bucket was prepared).
    #[cold]
    fn make_sparse(&mut self) {
        debug_assert!(self.dense);
        let present = std::mem::take(&mut self.present);
        let mut position = 0;
        self.entries.retain(|_| {
            let keep = present[position / 64] & (1 << (position % 64)) != 0;
            position += 1;
            keep
        });
        self.dense = false;
        // The entries kept are those counted (the slots not present, which may still hold an
        // earlier epoch's payloads, never were); a sparse side drops its payloads when
        // cleared, so it has no heap payloads to free.
        self.stored.heap = false;
        self.max_partition = self.entries.last().map_or(-1, |(partition, _)| partition.0);
        // Kept in partition order: positional exactly when the ids are 0..len.
        self.positional = self.max_partition + 1 == self.entries.len() as i32;
        if self.positional {
            self.index.clear();
        } else {
            self.rebuild_index();
        }
    }

    fn rebuild_index(&mut self) {
        self.index.clear();
        self.index.reserve(self.entries.len());
        for (position, (partition, _)) in self.entries.iter().enumerate() {
            self.index.insert(partition.0, position as u32);
        }
    }

    /// The stored entries sorted by partition id. O(1) for a complete dense side; O(n) for a
    /// sparse side whose ids are exactly `0..n`.
    fn sorted(&mut self) -> &[(PartitionId, Payload)] {
        if self.dense {
            if self.len == self.entries.len() {
                return &self.entries;
            }
            self.make_sparse();
        }
        if !self.positional {
            let len = self.entries.len();
            if (self.max_partition as usize) < len {
                // Distinct ids in 0..len: a permutation; put each entry at its index.
                for position in 0..len {
                    loop {
                        let target = self.entries[position].0 .0 as usize;
                        if target == position {
                            break;
                        }
                        self.entries.swap(position, target);
                    }
                }
                self.positional = true;
                self.index.clear();
            } else {
                self.entries.sort_unstable_by_key(|(partition, _)| *partition);
                self.rebuild_index();
            }
        }
        &self.entries
    }

    /// The stored entries as the query's [`Offsets`], sorted as by [`Slots::sorted`]. Whether
    /// they are words comes from the side's count of payloads that are no word and its first
    /// and last ids, without a read of the entries: a repeated report of a complete epoch, which
    /// hands the query all its offsets again, costs O(1) here too.
    fn offsets(&mut self) -> Offsets<'_> {
        let only_words_stored = self.stored.non_words == 0;
        Offsets::of_sorted_distinct(self.sorted(), only_words_stored)
    }

    /// Removes the entries of partitions `first_out` and above and returns how many went (rare:
    /// a partition count set below ids stored before, SPEC 0.3).
    #[cold]
    fn remove_from(&mut self, first_out: i32) -> usize {
        let first_out_position = first_out as usize;
        if self.dense {
            let stored_beyond = (first_out_position..self.entries.len())
                .any(|position| self.present[position / 64] & (1 << (position % 64)) != 0);
            if !stored_beyond {
                return 0;
            }
            self.make_sparse();
        }
        if self.max_partition < first_out {
            return 0;
        }
        let before = self.entries.len();
        let non_words = &mut self.stored.non_words;
        self.entries.retain(|(partition, payload)| {
            let keep = partition.0 < first_out;
            if !keep && !payload.is_word() {
                *non_words -= 1;
            }
            keep
        });
        self.len = self.entries.len();
        self.max_partition =
            self.entries.iter().map(|(partition, _)| partition.0).max().unwrap_or(-1);
        self.positional = self
            .entries
            .iter()
            .enumerate()
            .all(|(position, (partition, _))| partition.0 as usize == position);
        if self.positional {
            self.index.clear();
        } else {
            self.rebuild_index();
        }
        before - self.len
    }

    /// Empties the side, keeping its allocations (a dense side keeps its layout) but not the
    /// payloads' own.
    fn clear(&mut self) {
        if self.dense {
            if self.stored.heap {
                self.free_heap_payloads();
            }
            self.present.fill(0);
        } else {
            self.entries.clear();
            self.index.clear();
            self.positional = true;
            self.max_partition = -1;
        }
        self.stored = StoredPayloads::default();
        self.len = 0;
    }

    /// Dense layout: replaces the stored payloads that live on the heap with empty ones. Visits
    /// only the filled slots (each was a message), so it stays O(1) amortised per message.
    #[cold]
    fn free_heap_payloads(&mut self) {
        for (word_index, &word) in self.present.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let position = word_index * 64 + bits.trailing_zeros() as usize;
                let payload = &mut self.entries[position].1;
                if !payload.is_inline() {
                    *payload = Payload::new();
                }
                bits &= bits - 1;
            }
        }
        self.stored.heap = false;
    }

    /// Empties the side of a released bucket, keeping its allocation for a later epoch if it
    /// is sized for the current `count` under `limit` ([`reusable_capacity`]), else giving it
    /// back.
    fn clear_for_reuse(&mut self, count: i32, limit: usize) {
        let bound = reusable_capacity(count, limit);
        if self.entries.capacity() <= bound && self.index.capacity() <= bound {
            self.clear();
        } else {
            self.shrink();
        }
    }

    /// Empties the side and gives back allocations larger than a small epoch needs.
    fn shrink(&mut self) {
        self.clear();
        if self.dense {
            self.entries = Vec::new();
            self.dense = false;
            self.positional = true;
            self.max_partition = -1;
        }
        // Also the bitmap a side turned sparse by `prepare` kept (empty, not given back).
        self.present = Vec::new();
        if self.entries.capacity() > SMALL_SIDE_CAPACITY {
            self.entries = Vec::new();
        }
        if self.index.capacity() > SMALL_SIDE_CAPACITY {
            self.index = IntMap::default();
        }
    }
}

/// What a side knows of the payloads it holds (whether one is on the heap: the dense layout's,
/// since its last clear). One struct, so that a [`SideStretch`] borrows it with one pointer
/// (the stretch loop holds two sides in registers).
#[derive(Debug, Default, Clone, Copy)]
struct StoredPayloads {
    /// One may hold its payload on the heap, so [`Slots::clear`] frees those payloads instead
    /// of keeping them until the slot is overwritten (recycled buckets would otherwise hold a
    /// whole epoch of large commit messages each, beyond what the backlog limits bound).
    heap: bool,
    /// How many of the side's payloads are no 8-byte word ([`Payload::is_word`]). A complete
    /// side with none is handed to the query as words ([`Offsets::are_words`]) without a read
    /// ([`Slots::offsets`]), and the durable log then reads the words without checking each
    /// entry's id. At most the partition ids' range, so a `u32`.
    non_words: u32,
}

impl StoredPayloads {
    /// Notes a payload being stored in a slot that held none: one comparison for a word, the
    /// common payload (a heap payload is no word).
    #[inline(always)]
    fn note(&mut self, payload: &Payload) {
        if !payload.is_word() {
            self.non_words += 1;
            self.heap |= !payload.is_inline();
        }
    }

    /// Notes `payload` replacing `replaced` in its slot.
    #[inline]
    fn note_replacing(&mut self, replaced: &Payload, payload: &Payload) {
        if !replaced.is_word() {
            debug_assert!(self.non_words > 0, "a payload that is no word was stored uncounted");
            self.non_words -= 1;
        }
        self.note(payload);
    }
}

/// A dense side borrowed for a stretch of new entries ([`EpochCoordinator::apply_run`]): it
/// takes partitions below its bound whose bit is clear, and no more of them than leave the
/// side one short of complete (completing a side is the one-by-one path's work).
struct SideStretch<'a> {
    /// The side's entries below the partition count (none unless the side is dense).
    entries: &'a mut [(PartitionId, Payload)],
    present: &'a mut [u64],
    /// New entries the stretch may store: `room` in all, `left` of them still.
    room: usize,
    left: usize,
    /// The side's own entry count (updated when the stretch ends) and payload notes.
    side_len: &'a mut usize,
    side_stored: &'a mut StoredPayloads,
}

impl Slots {
    /// This side, borrowed for a stretch of at most `most` new entries, for a partition count
    /// of `count`.
    #[inline(always)]
    fn stretch(&mut self, count: i32, most: usize) -> SideStretch<'_> {
        let count = usize::try_from(count).unwrap_or(0);
        // A dense side prepared for a larger count than the current one takes only partitions
        // below the current one; one prepared for a smaller count takes none beyond its own.
        let bound = if self.dense { count.min(self.entries.len()) } else { 0 };
        let room = count.saturating_sub(self.len + 1).min(most);
        SideStretch {
            entries: &mut self.entries[..bound],
            present: &mut self.present,
            room,
            left: room,
            side_len: &mut self.len,
            side_stored: &mut self.stored,
        }
    }
}

impl SideStretch<'_> {
    /// Marks `partition` present and returns its position, if the stretch can store a new entry
    /// for it.
    #[inline(always)]
    fn claim(&mut self, partition: i32) -> Option<usize> {
        // A negative id is above every bound as `u32`.
        let position = partition as u32 as usize;
        if position >= self.entries.len() || self.left == 0 {
            return None;
        }
        let (word, bit) = (position / 64, 1u64 << (position % 64));
        let present = self.present.get_mut(word)?;
        if *present & bit != 0 {
            return None;
        }
        *present |= bit;
        self.left -= 1;
        Some(position)
    }

    /// Stores the payload of a claimed position.
    #[inline(always)]
    fn store(&mut self, position: usize, payload: Payload) {
        self.side_stored.note(&payload);
        self.entries[position].1 = payload;
    }

    /// Ends the stretch: the side's count takes what it stored. Returns how many.
    #[inline(always)]
    fn finish(&mut self) -> usize {
        let stored = self.room - self.left;
        *self.side_len += stored;
        self.room = self.left;
        stored
    }
}

/// A stretch of [`EpochCoordinator::apply_run`] over one bucket: its two sides and the
/// coordinator's counts, brought up to date when it ends, also by a panic of the caller's
/// iterator (the entries it stored are then counted as the one-by-one path would have).
struct Stretch<'a> {
    offsets: SideStretch<'a>,
    commits: SideStretch<'a>,
    offset_entries: &'a mut usize,
    commit_entries: &'a mut usize,
    backlog_slack: &'a mut usize,
    counters: &'a mut EpochCounters,
}

impl Drop for Stretch<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        let (new_offsets, new_commits) = (self.offsets.finish(), self.commits.finish());
        *self.offset_entries += new_offsets;
        *self.commit_entries += new_commits;
        *self.backlog_slack -= new_offsets + new_commits;
        self.counters.offsets_accepted += new_offsets as u64;
        self.counters.commits_accepted += new_commits as u64;
    }
}

/// Everything stored for one pending epoch.
struct Bucket {
    epoch: Epoch,
    offsets: Slots,
    commits: Slots,
    /// Found ready while an earlier epoch was uncommitted, and not committed yet (Spark's
    /// `epochsWaitingToBeCommitted`); a count change since may have made it not ready.
    waiting: bool,
    /// [`Query::add_offsets`] was called for this epoch (by a report that completed its
    /// offsets). If not when it commits, [`EpochCoordinator::commit_epoch`] calls it first.
    offsets_added: bool,
}

impl Bucket {
    fn new(epoch: Epoch) -> Self {
        Self {
            epoch,
            offsets: Slots::new(),
            commits: Slots::new(),
            waiting: false,
            offsets_added: false,
        }
    }
}

/// Whether `len` entries complete a side whose partition count is `count` (0 = unset never
/// completes, SPEC B.4 note).
#[inline]
fn complete(len: usize, count: i32) -> bool {
    count > 0 && len == count as usize
}

/// The epoch coordinator's state machine.
///
/// One method per message of SPEC B.4; call them from one thread in the order the messages
/// arrive (the [`EpochEndpoint`](super::EpochEndpoint) does). Every message is O(1)
/// amortised: laying out an epoch's dense sides costs its partition counts, as many messages
/// as it needs to commit (epochs that never commit add at most the dense window's worth,
/// once). A partition count change is O(pending and free buckets).
///
/// ```
/// use coordbus::coordinators::epoch::{
///     CollaboratorError, Epoch, EpochConfig, EpochCoordinator, EpochError, NoopSink,
///     Offsets, PartitionId, Payload, Query,
/// };
///
/// #[derive(Default)]
/// struct Log(Vec<String>);
/// impl Query for Log {
///     fn add_offsets(&mut self, e: Epoch, o: Offsets<'_>)
///         -> Result<(), CollaboratorError> {
///         self.0.push(format!("offsets {e} x{}", o.len()));
///         Ok(())
///     }
///     fn commit(&mut self, e: Epoch) -> Result<(), CollaboratorError> {
///         self.0.push(format!("commit {e}"));
///         Ok(())
///     }
///     fn stop(&mut self, error: EpochError) { self.0.push(format!("stop {error}")); }
/// }
///
/// let mut coordinator = EpochCoordinator::new(EpochConfig::new(1), Log::default(), NoopSink)?;
/// coordinator.set_reader_partitions(1)?;
/// coordinator.set_writer_partitions(1)?;
/// coordinator.report_partition_offset(PartitionId(0), Epoch(1), 7.into())?;
/// coordinator.commit_partition_epoch(PartitionId(0), Epoch(1), 9.into())?;
/// assert_eq!(coordinator.query().0, ["offsets 1 x1", "commit 1"]);
/// assert_eq!(coordinator.last_committed(), Epoch(1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct EpochCoordinator<Q, S> {
    config: EpochConfig,
    query: Q,
    sink: S,
    current_epoch: Epoch,
    last_committed: Epoch,
    reader_partitions: i32,
    writer_partitions: i32,
    writes_stopped: bool,
    /// Set by the first failed `add_offsets` / sink commit / query commit: nothing commits
    /// after it.
    failed_epoch: Option<Epoch>,
    /// Slab of buckets; live ones are in `by_epoch`, the others in `free`.
    buckets: Vec<Bucket>,
    free: Vec<u32>,
    by_epoch: IntMap<i64, u32>,
    /// The last bucket looked up: its epoch and slab slot, valid while that bucket is live;
    /// [`NO_CACHED_EPOCH`] when there is none. (A sentinel, not an `Option`: one comparison per
    /// message instead of two.)
    cached_epoch: Epoch,
    cached_slot: u32,
    offset_entries: usize,
    commit_entries: usize,
    waiting_epochs: usize,
    /// Entries of the last committed epoch, still counted by the backlog checks (Spark keeps
    /// them until the next commit); their payloads are already freed.
    retained_offsets: usize,
    retained_commits: usize,
    /// How many more entries (offsets, commits or waiting epochs) the backlog queues surely
    /// take before one of them is over its limit: a lower bound of the least room left under
    /// the three limits. Each entry stored takes one off, whatever its queue, and the exact
    /// figure is counted again when it reaches 0 (by the backlog checks) or when the queues
    /// shrink (a commit, a count change). While it is above 0 no queue is over its limit, so a
    /// message skips the per-queue comparisons of its admission and of SPEC B.7's checks,
    /// which would all pass: one test per message instead of four comparisons.
    backlog_slack: usize,
    /// The common message's admission in three comparisons (see [`AdmissionGate`]).
    admission: AdmissionGate,
    counters: EpochCounters,
}

/// What lets a message pass every check of [`EpochCoordinator::admit`] in three comparisons
/// (with [`EpochCoordinator::backlog_slack`] above 0): its partition id below its side's
/// bound and its epoch above `epochs_above`. Derived from the coordinator's state, and set
/// again wherever that changes; a message that fails the gate goes through the full checks,
/// which name its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AdmissionGate {
    /// Reader and writer partition ids, as `u32`, must be below these: the partition count,
    /// or 2^31 while it is unset (any id that is not negative; a negative id, as `u32`, is
    /// never below either).
    reader_bound: u32,
    writer_bound: u32,
    /// The last committed epoch, or `i64::MAX` once writes are stopped (no epoch is above).
    epochs_above: i64,
}

impl AdmissionGate {
    fn of(reader_partitions: i32, writer_partitions: i32, last: Epoch, stopped: bool) -> Self {
        let bound = |count: i32| if count > 0 { count as u32 } else { 1 << 31 };
        Self {
            reader_bound: bound(reader_partitions),
            writer_bound: bound(writer_partitions),
            epochs_above: if stopped { i64::MAX } else { last.0 },
        }
    }

    /// Whether a message of `kind` for `partition` and `epoch` passes.
    #[inline(always)]
    fn passes(&self, kind: MessageKind, partition: PartitionId, epoch: Epoch) -> bool {
        let bound = match kind {
            MessageKind::CommitPartitionEpoch => self.writer_bound,
            MessageKind::ReportPartitionOffset => self.reader_bound,
        };
        (partition.0 as u32) < bound && epoch.0 > self.epochs_above
    }
}

impl<Q, S> std::fmt::Debug for EpochCoordinator<Q, S> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("EpochCoordinator")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<Q, S> EpochCoordinator<Q, S> {
    /// A snapshot of state and counters.
    pub fn stats(&self) -> EpochStats {
        EpochStats {
            current_epoch: self.current_epoch,
            last_committed: self.last_committed,
            reader_partitions: self.reader_partitions,
            writer_partitions: self.writer_partitions,
            writes_stopped: self.writes_stopped,
            failed_epoch: self.failed_epoch,
            offset_entries: self.offset_entries,
            commit_entries: self.commit_entries,
            waiting_epochs: self.waiting_epochs,
            counters: self.counters,
        }
    }
}

/// Checks that a run of a query whose last committed epoch is `last` starts at `start`: the
/// epoch after it (SPEC B.10), which exists.
fn check_start_after(start: Epoch, last: Epoch) -> Result<(), ConfigError> {
    let refused = |reason| {
        Err(ConfigError::Invalid {
            setting: "start_epoch",
            value: format!("{start} (the query has committed up to {last})"),
            reason,
        })
    };
    match last.0.checked_add(1) {
        None => refused(
            "no epoch is left to start at: the query has committed the last one, and a \
             coordinator starting at it would commit it again",
        ),
        Some(first) if start.0 < first => refused(
            "must be the first epoch the query has not committed: below it, the sink would \
             commit the epochs in between again",
        ),
        Some(first) if start.0 > first => refused(
            "must be the first epoch the query has not committed: above it, the epochs in \
             between would never commit, and a restart would resume past them",
        ),
        Some(_) => Ok(()),
    }
}

impl<Q: Query, S: Sink> EpochCoordinator<Q, S> {
    /// A coordinator at `config.start_epoch` (driver epoch = start, last committed = start - 1,
    /// partition counts unset).
    ///
    /// # Errors
    /// [`ConfigError`] if `config` is invalid (see [`EpochConfig::validate`]), or if the query
    /// has committed epochs and the start epoch is not the one after the last of them
    /// ([`Query::last_committed_epoch`]), or there is none (it committed `i64::MAX`).
    pub fn new(config: EpochConfig, query: Q, sink: S) -> Result<Self, ConfigError> {
        config.validate()?;
        let start = config.start_epoch;
        if let Some(last) = query.last_committed_epoch() {
            check_start_after(start, last)?;
        }
        let mut query = query;
        query.begin_run();
        let mut coordinator = Self {
            query,
            sink,
            current_epoch: start,
            last_committed: Epoch(start.0 - 1),
            reader_partitions: 0,
            writer_partitions: 0,
            writes_stopped: false,
            failed_epoch: None,
            buckets: Vec::new(),
            free: Vec::new(),
            by_epoch: IntMap::default(),
            cached_epoch: NO_CACHED_EPOCH,
            cached_slot: 0,
            offset_entries: 0,
            commit_entries: 0,
            waiting_epochs: 0,
            retained_offsets: 0,
            retained_commits: 0,
            backlog_slack: 0,
            admission: AdmissionGate::of(0, 0, Epoch(start.0 - 1), false),
            counters: EpochCounters::default(),
            config,
        };
        coordinator.recount_backlog_slack();
        Ok(coordinator)
    }

    /// Handles one one-way message (dispatches to the two methods below).
    ///
    /// # Errors
    /// [`Rejected`] when the message was dropped (nothing changed but a counter).
    #[inline]
    pub fn apply(&mut self, message: EpochMessage) -> Result<(), Rejected> {
        match message {
            EpochMessage::CommitPartitionEpoch { partition, epoch, message } => {
                self.commit_partition_epoch(PartitionId(partition), Epoch(epoch), message)
            }
            EpochMessage::ReportPartitionOffset { partition, epoch, offset } => {
                self.report_partition_offset(PartitionId(partition), Epoch(epoch), offset)
            }
        }
    }

    /// Handles the one-way messages `messages` yields, in order, exactly as [`Self::apply`]
    /// would one by one; `on_rejected` hears of each message dropped.
    ///
    /// Faster than `apply` per message for what a bus inbox delivers: a run of messages mostly
    /// adds new entries to one epoch's two sides. After each message applied one by one, the
    /// ones that follow it and add a new entry to its epoch take a shorter path, a stretch
    /// (`store_stretch`), which skips only checks that cannot fail for them.
    #[inline(always)]
    pub fn apply_run(
        &mut self,
        messages: &mut impl Iterator<Item = EpochMessage>,
        mut on_rejected: impl FnMut(Rejected),
    ) {
        let mut next = messages.next();
        while let Some(message) = next {
            if let Err(rejected) = self.apply(message) {
                on_rejected(rejected);
            }
            next = match messages.next() {
                Some(message) => self.store_stretch(message, messages),
                None => None,
            };
        }
    }

    /// Stores `first` and the messages after it while each adds a new entry to the cached
    /// bucket (`cached_epoch`: the last one a message was stored into or looked up for), on
    /// either side; returns the first message it did not store, for [`Self::apply`].
    ///
    /// What it skips of `apply` cannot apply to such a message, so the outcome is the same:
    /// * admission: the epoch is the cached bucket's (above the last committed one) and writes
    ///   are not stopped, checked once; the partition is below the side's count, checked per
    ///   message by [`SideStretch::claim`];
    /// * completion, and so resolve and add-offsets: a side takes at most the entries that
    ///   leave it one short of complete;
    /// * the backlog checks: the stretch stores at most `backlog_slack - 1` entries, so the
    ///   slack stays above 0;
    /// * the per-message debug events: while they are enabled, there is no stretch.
    ///
    /// The counts and the slack are updated once, when the stretch ends ([`Stretch`]).
    #[inline(always)]
    fn store_stretch(
        &mut self,
        first: EpochMessage,
        messages: &mut impl Iterator<Item = EpochMessage>,
    ) -> Option<EpochMessage> {
        let epoch = self.cached_epoch.0;
        let stretch_epoch = match &first {
            EpochMessage::CommitPartitionEpoch { epoch, .. }
            | EpochMessage::ReportPartitionOffset { epoch, .. } => *epoch,
        };
        if stretch_epoch != epoch
            || epoch <= self.admission.epochs_above
            || self.backlog_slack < 2
            || tracing::enabled!(tracing::Level::DEBUG)
        {
            return Some(first);
        }
        // Half the entries the slack allows for each side, so that the loop tests each side's
        // room only.
        let most = self.backlog_slack - 1;
        let Self {
            buckets,
            cached_slot,
            reader_partitions,
            writer_partitions,
            offset_entries,
            commit_entries,
            backlog_slack,
            counters,
            ..
        } = self;
        let bucket = &mut buckets[*cached_slot as usize];
        let mut stretch = Stretch {
            offsets: bucket.offsets.stretch(*reader_partitions, most / 2),
            commits: bucket.commits.stretch(*writer_partitions, most - most / 2),
            offset_entries,
            commit_entries,
            backlog_slack,
            counters,
        };
        let mut message = first;
        loop {
            match message {
                EpochMessage::ReportPartitionOffset { partition, epoch: of, offset }
                    if of == epoch =>
                {
                    match stretch.offsets.claim(partition) {
                        Some(position) => stretch.offsets.store(position, offset),
                        None => {
                            return Some(EpochMessage::ReportPartitionOffset {
                                partition,
                                epoch,
                                offset,
                            })
                        }
                    }
                }
                EpochMessage::CommitPartitionEpoch { partition, epoch: of, message }
                    if of == epoch =>
                {
                    match stretch.commits.claim(partition) {
                        Some(position) => stretch.commits.store(position, message),
                        None => {
                            return Some(EpochMessage::CommitPartitionEpoch {
                                partition,
                                epoch,
                                message,
                            })
                        }
                    }
                }
                other => return Some(other),
            }
            message = messages.next()?;
        }
    }

    /// `CommitPartitionEpoch`: stores the writer commit message of `partition` for `epoch`
    /// (the first one wins), commits what became committable, then runs the backlog checks.
    ///
    /// # Errors
    /// [`Rejected`] when dropped: writes stopped, bad partition, stale epoch, commit queue
    /// full, duplicate.
    #[inline]
    pub fn commit_partition_epoch(
        &mut self,
        partition: PartitionId,
        epoch: Epoch,
        message: Payload,
    ) -> Result<(), Rejected> {
        let kind = MessageKind::CommitPartitionEpoch;
        self.admit(kind, partition, epoch, self.writer_partitions)?;
        let slot = self.bucket_for(epoch);
        let bucket = &mut self.buckets[slot as usize];
        if bucket.commits.insert(partition, message, false) == Inserted::Duplicate {
            return Err(self.drop_message(kind, partition, epoch, DropReason::DuplicateCommit));
        }
        self.commit_entries += 1;
        self.take_backlog_slack();
        self.counters.commits_accepted += 1;
        tracing::debug!(%partition, %epoch, "writer commit stored");
        if self.is_ready(slot) {
            self.resolve(slot);
        }
        self.check_backlog();
        Ok(())
    }

    /// `ReportPartitionOffset`: stores (or replaces) the end offset of `partition` for
    /// `epoch`; when the epoch's offsets are complete, records them with
    /// [`Query::add_offsets`] and commits what became committable; then runs the backlog
    /// checks.
    ///
    /// # Errors
    /// [`Rejected`] when dropped: writes stopped, bad partition, stale epoch, offset queue
    /// full.
    #[inline]
    pub fn report_partition_offset(
        &mut self,
        partition: PartitionId,
        epoch: Epoch,
        offset: Payload,
    ) -> Result<(), Rejected> {
        self.admit(MessageKind::ReportPartitionOffset, partition, epoch, self.reader_partitions)?;
        let slot = self.bucket_for(epoch);
        let offsets = &mut self.buckets[slot as usize].offsets;
        let inserted = offsets.insert(partition, offset, true);
        let stored = offsets.len();
        if inserted == Inserted::New {
            self.offset_entries += 1;
            self.take_backlog_slack();
            self.counters.offsets_accepted += 1;
        } else {
            self.counters.offsets_overwritten += 1;
        }
        tracing::debug!(%partition, %epoch, "partition offset stored");
        if complete(stored, self.reader_partitions) {
            self.offsets_complete(slot, epoch);
        }
        self.check_backlog();
        Ok(())
    }

    /// The offsets of `epoch` (in `slot`) are complete after a report: records them with
    /// [`Query::add_offsets`] and commits what became committable. Once per epoch in a steady
    /// run, so out of line.
    #[inline(never)]
    fn offsets_complete(&mut self, slot: u32, epoch: Epoch) {
        self.counters.offsets_added += 1;
        let bucket = &mut self.buckets[slot as usize];
        bucket.offsets_added = true;
        let offsets = bucket.offsets.offsets();
        if let Err(source) = self.query.add_offsets(epoch, offsets) {
            self.fail(EpochError::AddOffsets { epoch, source }, epoch);
        }
        self.resolve(slot);
    }

    /// `GetCurrentEpoch`: the driver epoch.
    pub fn get_current_epoch(&self) -> Epoch {
        self.current_epoch
    }

    /// `IncrementAndGetEpoch`: advances the driver epoch and returns the new value.
    ///
    /// # Errors
    /// [`EpochError::EpochOverflow`] at `i64::MAX` (the epoch is unchanged).
    pub fn increment_and_get_epoch(&mut self) -> Result<Epoch, EpochError> {
        let next = self
            .current_epoch
            .next()
            .ok_or(EpochError::EpochOverflow { epoch: self.current_epoch })?;
        self.current_epoch = next;
        tracing::debug!(epoch = %next, "driver epoch incremented");
        Ok(next)
    }

    /// `SetReaderPartitions(count)`: overwrites the reader partition count.
    ///
    /// # Errors
    /// [`EpochError::InvalidPartitionCount`] for a negative count (nothing changes).
    pub fn set_reader_partitions(&mut self, count: i32) -> Result<(), EpochError> {
        self.set_partition_count(PartitionSide::Reader, count)
    }

    /// `SetWriterPartitions(count)`: overwrites the writer partition count.
    ///
    /// # Errors
    /// [`EpochError::InvalidPartitionCount`] for a negative count (nothing changes).
    pub fn set_writer_partitions(&mut self, count: i32) -> Result<(), EpochError> {
        self.set_partition_count(PartitionSide::Writer, count)
    }

    /// Both `Set*Partitions` messages: refuses a negative count, then overwrites `side`'s count,
    /// drops the pending entries it leaves out of range and resumes a waiting epoch the chain
    /// passed. The same count again changes nothing, and costs nothing: every id stored since
    /// it was set is below it, and no epoch's readiness changed.
    fn set_partition_count(&mut self, side: PartitionSide, count: i32) -> Result<(), EpochError> {
        self.check_count(side, count)?;
        let current = match side {
            PartitionSide::Reader => &mut self.reader_partitions,
            PartitionSide::Writer => &mut self.writer_partitions,
        };
        if *current == count {
            tracing::debug!(%side, count, "partition count set again, unchanged");
            return Ok(());
        }
        *current = count;
        self.shrink_free_sides(side);
        self.set_admission_gate();
        tracing::debug!(%side, count, "partition count set");
        self.drop_out_of_range(side, count);
        self.resume_passed_epoch();
        Ok(())
    }

    /// When `side`'s partition count changes: the free buckets give back that side's
    /// allocations, which were sized for the old count ([`Slots::clear_for_reuse`]).
    /// O(free buckets) per count change.
    fn shrink_free_sides(&mut self, side: PartitionSide) {
        for &slot in &self.free {
            let bucket = &mut self.buckets[slot as usize];
            match side {
                PartitionSide::Reader => bucket.offsets.shrink(),
                PartitionSide::Writer => bucket.commits.shrink(),
            }
        }
    }

    /// SPEC 0.3 once a count is set: entries of pending epochs stored with a partition id not
    /// below it (kept while the count was unset, or under a larger count) are dropped and
    /// counted as out of range, so that a complete side is exactly partitions `0..count` (an
    /// entry of a partition that does not exist must not stand in for one that is missing).
    /// Waiting flags stay (a waiting epoch no longer ready is skipped by the commit chain until
    /// it is ready again: [`Self::resolve`]). Nothing is resolved here: the epoch's next
    /// message does that, as after any count change. O(pending buckets) per count set.
    fn drop_out_of_range(&mut self, side: PartitionSide, count: i32) {
        if count == 0 {
            return;
        }
        let mut dropped = 0;
        for &slot in self.by_epoch.values() {
            let bucket = &mut self.buckets[slot as usize];
            dropped += match side {
                PartitionSide::Reader => bucket.offsets.remove_from(count),
                PartitionSide::Writer => bucket.commits.remove_from(count),
            };
        }
        if dropped == 0 {
            return;
        }
        match side {
            PartitionSide::Reader => self.offset_entries -= dropped,
            PartitionSide::Writer => self.commit_entries -= dropped,
        }
        self.release_emptied_buckets();
        self.recount_backlog_slack();
        self.counters.dropped_partition_out_of_range += dropped as u64;
        tracing::warn!(
            %side,
            count,
            dropped,
            "entries stored with partition ids not below the new partition count dropped"
        );
    }

    /// After a count change dropped entries: frees the pending buckets it left with no entry
    /// on either side (not waiting, their offsets not added), whose epochs may never get
    /// another message. Otherwise count changes back and forth could keep any number of empty
    /// buckets alive while the entry counts, and so the backlog checks, stay under the limits.
    /// A later message for such an epoch lays its bucket out afresh.
    #[cold]
    fn release_emptied_buckets(&mut self) {
        let emptied: Vec<u32> = self
            .by_epoch
            .values()
            .copied()
            .filter(|&slot| {
                let bucket = &self.buckets[slot as usize];
                bucket.offsets.len() == 0
                    && bucket.commits.len() == 0
                    && !bucket.waiting
                    && !bucket.offsets_added
            })
            .collect();
        for slot in emptied {
            self.release(slot);
        }
    }

    /// After a count change: the next epoch to commit, if it waits (the commit chain passed it
    /// while a count change left it not ready) and is ready now, commits, with the ready
    /// epochs waiting after it, unless writes were stopped (then nothing commits, SPEC B.6). It
    /// may have no message left to come (module doc of [`super`]).
    fn resume_passed_epoch(&mut self) {
        let Some(slot) = self.last_committed.next().and_then(|next| self.live_slot(next)) else {
            return;
        };
        let bucket = &self.buckets[slot as usize];
        if self.failed_epoch.is_none()
            && !self.writes_stopped
            && bucket.waiting
            && self.is_ready(slot)
        {
            self.resolve(slot);
        }
    }

    /// `StopContinuousExecutionWrites`: from now on every one-way message is dropped (SPEC B.6).
    /// Irreversible.
    pub fn stop_writes(&mut self) {
        if !self.writes_stopped {
            tracing::info!(last_committed = %self.last_committed, "query writes stopped");
        }
        self.writes_stopped = true;
        self.set_admission_gate();
    }

    /// The last committed epoch (start epoch - 1 before the first commit).
    pub fn last_committed(&self) -> Epoch {
        self.last_committed
    }

    /// The counters.
    pub fn counters(&self) -> EpochCounters {
        self.counters
    }

    /// The settings.
    pub fn config(&self) -> &EpochConfig {
        &self.config
    }

    /// The query collaborator.
    pub fn query(&self) -> &Q {
        &self.query
    }

    /// The query collaborator, mutably.
    pub fn query_mut(&mut self) -> &mut Q {
        &mut self.query
    }

    /// The sink collaborator.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// The sink collaborator, mutably.
    pub fn sink_mut(&mut self) -> &mut S {
        &mut self.sink
    }

    /// Ends the coordinator, returning its collaborators.
    pub fn into_parts(self) -> (Q, S) {
        (self.query, self.sink)
    }

    fn check_count(&mut self, side: PartitionSide, count: i32) -> Result<(), EpochError> {
        if count < 0 {
            self.counters.rejected_partition_counts += 1;
            tracing::warn!(%side, count, "negative partition count rejected");
            return Err(EpochError::InvalidPartitionCount { side, count });
        }
        Ok(())
    }

    /// The checks every one-way message passes before it may change state: the admission
    /// gate's two comparisons and the backlog slack's test for the common message, else
    /// [`Self::admit_checked`].
    #[inline(always)]
    fn admit(
        &mut self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        partition_count: i32,
    ) -> Result<(), Rejected> {
        debug_assert_eq!(
            self.admission,
            AdmissionGate::of(
                self.reader_partitions,
                self.writer_partitions,
                self.last_committed,
                self.writes_stopped
            )
        );
        if self.admission.passes(kind, partition, epoch) && self.backlog_slack > 0 {
            return Ok(());
        }
        self.admit_checked(kind, partition, epoch, partition_count)
    }

    /// [`Self::admit`]'s checks one by one, naming the reason of a message dropped.
    #[inline(never)]
    fn admit_checked(
        &mut self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        partition_count: i32,
    ) -> Result<(), Rejected> {
        let reason = if self.writes_stopped {
            DropReason::WritesStopped
        } else if partition.0 < 0 {
            DropReason::NegativePartition
        } else if partition_count > 0 && partition.0 >= partition_count {
            DropReason::PartitionOutOfRange { count: partition_count }
        } else if epoch <= self.last_committed {
            DropReason::StaleEpoch { last_committed: self.last_committed }
        } else if let Some((queue, limit)) =
            self.backlog_full(kind, partition, epoch, partition_count)
        {
            DropReason::BacklogFull { queue, limit }
        } else {
            return Ok(());
        };
        let rejected = self.drop_message(kind, partition, epoch, reason);
        if let DropReason::BacklogFull { .. } = reason {
            // A message Spark would have stored: its checks run (SPEC B.7, "fire again on
            // every later message while the condition holds").
            self.check_backlog();
        }
        Err(rejected)
    }

    /// The queue `kind` stores into and its limit, if that queue is over its limit and the
    /// message would add an entry to it that it may not take (see [`Self::full_queue_refuses`]).
    /// Reached only through [`Self::admit_checked`] for a message the admission gate let
    /// through, so only with no backlog slack left.
    #[inline]
    fn backlog_full(
        &self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        partition_count: i32,
    ) -> Option<(BacklogQueue, usize)> {
        let (queue, entries, limit) = match kind {
            MessageKind::CommitPartitionEpoch => (
                BacklogQueue::PartitionCommits,
                self.commit_entries,
                self.config.partition_commit_limit,
            ),
            MessageKind::ReportPartitionOffset => (
                BacklogQueue::PartitionOffsets,
                self.offset_entries,
                self.config.partition_offset_limit,
            ),
        };
        (entries > limit && self.full_queue_refuses(kind, partition, epoch, partition_count, limit))
            .then_some((queue, limit))
    }

    /// Whether a queue that is over its `limit` refuses this message: one that would add an
    /// entry, unless it is for the next epoch to commit while the side's partition count is
    /// set and within the limit. (The backlog check stopped the query when the queue got
    /// there; storing every new entry would let a flood of messages grow memory without bound
    /// until writes stop.) The next epoch's messages are still taken, at most
    /// `partition_count` (at most `limit`) of them, because only they can commit epochs and so
    /// free the queue; an epoch with more partitions than the limit cannot commit without
    /// overflowing anyway, so it gets no exception. A repeat report or a duplicate commit adds
    /// nothing and is handled as usual.
    #[cold]
    fn full_queue_refuses(
        &self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        partition_count: i32,
        limit: usize,
    ) -> bool {
        let next_to_commit = self.last_committed.0.checked_add(1) == Some(epoch.0);
        if next_to_commit && partition_count > 0 && fits_limit(partition_count, limit) {
            return false;
        }
        let stored = self.live_slot(epoch).is_some_and(|slot| {
            let bucket = &self.buckets[slot as usize];
            match kind {
                MessageKind::CommitPartitionEpoch => bucket.commits.contains(partition),
                MessageKind::ReportPartitionOffset => bucket.offsets.contains(partition),
            }
        });
        !stored
    }

    #[cold]
    fn drop_message(
        &mut self,
        kind: MessageKind,
        partition: PartitionId,
        epoch: Epoch,
        reason: DropReason,
    ) -> Rejected {
        let count = self.counters.count_drop(reason);
        let rejected = Rejected { kind, partition, epoch, reason };
        if reason == DropReason::WritesStopped {
            // Expected after a stop (lame-duck tasks): no warning (SPEC B.6).
            tracing::debug!(%rejected, "message dropped");
        } else if worth_a_warning(count) {
            tracing::warn!(%rejected, dropped_for_this_reason = count, "message dropped");
        } else {
            tracing::debug!(%rejected, "message dropped");
        }
        rejected
    }

    /// The slab slot of `epoch`'s bucket, created if needed. `epoch` is above the last
    /// committed epoch. Consecutive messages mostly share an epoch: the cache answers them.
    #[inline(always)]
    fn bucket_for(&mut self, epoch: Epoch) -> u32 {
        debug_assert!(epoch > self.last_committed);
        if epoch == self.cached_epoch {
            self.cached_slot
        } else {
            self.bucket_for_uncached(epoch)
        }
    }

    fn bucket_for_uncached(&mut self, epoch: Epoch) -> u32 {
        let slot = match self.by_epoch.entry(epoch.0) {
            Entry::Occupied(occupied) => *occupied.get(),
            Entry::Vacant(vacant) => {
                let ahead = epoch.0.saturating_sub(self.last_committed.0);
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.buckets.push(Bucket::new(epoch));
                    (self.buckets.len() - 1) as u32
                });
                let bucket = &mut self.buckets[slot as usize];
                bucket.epoch = epoch;
                let (offset_limit, commit_limit) =
                    (self.config.partition_offset_limit, self.config.partition_commit_limit);
                bucket.offsets.prepare_ahead(self.reader_partitions, offset_limit, ahead);
                bucket.commits.prepare_ahead(self.writer_partitions, commit_limit, ahead);
                *vacant.insert(slot)
            }
        };
        (self.cached_epoch, self.cached_slot) = (epoch, slot);
        slot
    }

    /// Frees the bucket in `slot` (its epoch committed, or a count change left it empty).
    ///
    /// Only the top [`recycle_window`] of the free list (popped first) keep their allocations,
    /// per side: the bucket that the push moves out of it gives its allocation back.
    fn release(&mut self, slot: u32) {
        let (offset_limit, commit_limit) =
            (self.config.partition_offset_limit, self.config.partition_commit_limit);
        let offsets_window = recycle_window(self.reader_partitions, offset_limit);
        if let Some(leaving) = self.leaving_on_push(offsets_window) {
            self.buckets[leaving as usize].offsets.shrink();
        }
        let commits_window = recycle_window(self.writer_partitions, commit_limit);
        if let Some(leaving) = self.leaving_on_push(commits_window) {
            self.buckets[leaving as usize].commits.shrink();
        }
        let bucket = &mut self.buckets[slot as usize];
        let epoch = bucket.epoch;
        bucket.offsets.clear_for_reuse(self.reader_partitions, offset_limit);
        bucket.commits.clear_for_reuse(self.writer_partitions, commit_limit);
        bucket.waiting = false;
        bucket.offsets_added = false;
        self.by_epoch.remove(&epoch.0);
        if self.cached_epoch == epoch {
            self.cached_epoch = NO_CACHED_EPOCH;
        }
        self.free.push(slot);
    }

    /// The free bucket that the next push moves out of the top `window` of the free list.
    fn leaving_on_push(&self, window: usize) -> Option<u32> {
        self.free.len().checked_sub(window).map(|at| self.free[at])
    }

    fn live_slot(&self, epoch: Epoch) -> Option<u32> {
        if epoch == self.cached_epoch {
            Some(self.cached_slot)
        } else {
            self.by_epoch.get(&epoch.0).copied()
        }
    }

    /// Whether the epoch of `slot` has every writer commit and every reader offset.
    #[inline(always)]
    fn is_ready(&self, slot: u32) -> bool {
        let bucket = &self.buckets[slot as usize];
        complete(bucket.commits.len(), self.writer_partitions)
            && complete(bucket.offsets.len(), self.reader_partitions)
    }

    /// SPEC B.5 resolve(e) for the epoch of `slot`, with the 0.3 decisions: commits the epoch
    /// if it is ready and next in line, then every waiting epoch after it that is ready now, in
    /// one pass.
    #[inline(never)]
    fn resolve(&mut self, slot: u32) {
        if !self.is_ready(slot) {
            return;
        }
        let bucket = &mut self.buckets[slot as usize];
        let epoch = bucket.epoch;
        if self.failed_epoch.is_some() || Some(epoch) != self.last_committed.next() {
            if !bucket.waiting {
                bucket.waiting = true;
                self.waiting_epochs += 1;
                self.take_backlog_slack();
                tracing::debug!(%epoch, last_committed = %self.last_committed, "epoch waiting");
            }
            return;
        }
        let mut next = Some(slot);
        while let Some(slot) = next {
            let epoch = self.buckets[slot as usize].epoch;
            if let Err(error) = self.commit_epoch(slot) {
                let bucket = &mut self.buckets[slot as usize];
                if !bucket.waiting {
                    bucket.waiting = true;
                    self.waiting_epochs += 1;
                    self.take_backlog_slack();
                }
                self.fail(error, epoch);
                return;
            }
            let bucket = &self.buckets[slot as usize];
            debug_assert!(self.offset_entries >= self.retained_offsets + bucket.offsets.len());
            debug_assert!(self.commit_entries >= self.retained_commits + bucket.commits.len());
            debug_assert!(!bucket.waiting || self.waiting_epochs > 0);
            if bucket.waiting {
                self.waiting_epochs -= 1;
            }
            // Cleanup (B.5 d): entries of epochs below the new last committed epoch go; this
            // epoch's entries stay counted until the next commit.
            self.offset_entries -= self.retained_offsets;
            self.commit_entries -= self.retained_commits;
            self.retained_offsets = bucket.offsets.len();
            self.retained_commits = bucket.commits.len();
            self.last_committed = epoch;
            self.set_admission_gate();
            self.counters.epochs_committed += 1;
            self.release(slot);
            next = epoch
                .next()
                .and_then(|after| self.live_slot(after))
                .filter(|&slot| self.buckets[slot as usize].waiting && self.is_ready(slot));
        }
        self.recount_backlog_slack();
    }

    /// Sink commit, then query commit (SPEC B.5 a; the order is mandatory), after the epoch's
    /// offsets if no report added them (module doc of [`super`], "Behaviour decisions").
    fn commit_epoch(&mut self, slot: u32) -> Result<(), EpochError> {
        let bucket = &mut self.buckets[slot as usize];
        let epoch = bucket.epoch;
        if !bucket.offsets_added {
            self.counters.offsets_added += 1;
            self.counters.offsets_added_at_commit += 1;
            if worth_a_warning(self.counters.offsets_added_at_commit) {
                tracing::warn!(
                    %epoch,
                    added_at_commit = self.counters.offsets_added_at_commit,
                    "no report completed this epoch's offsets (they arrived before the reader \
                     partition count was set, or the count changed): adding them before the \
                     sink commit"
                );
            }
            bucket.offsets_added = true;
            self.query
                .add_offsets(epoch, bucket.offsets.offsets())
                .map_err(|source| EpochError::AddOffsets { epoch, source })?;
        }
        self.sink
            .commit(epoch, bucket.commits.sorted())
            .map_err(|source| EpochError::SinkCommit { epoch, source })?;
        self.query.commit(epoch).map_err(|source| EpochError::QueryCommit { epoch, source })?;
        tracing::debug!(%epoch, "epoch committed");
        Ok(())
    }

    /// After a panic in one of its handlers (reported by the bus): the state may be half
    /// updated (an epoch sink-committed but not recorded, say), so the coordinator fail-stops
    /// with [`EpochError::HandlerPanicked`] at the next epoch to commit, as for a failed
    /// collaborator (SPEC 0.3). Without it, that epoch would neither commit nor fail, and the
    /// later ones would wait until a backlog limit stopped the query for the wrong reason.
    pub fn fail_after_panic(&mut self, message: String) {
        let epoch = self.last_committed.next().unwrap_or(self.last_committed);
        self.fail(EpochError::HandlerPanicked { epoch, message }, epoch);
    }

    /// Enters the fail-stop state and stops the query with `error`.
    #[cold]
    fn fail(&mut self, error: EpochError, epoch: Epoch) {
        if self.failed_epoch.is_none() {
            tracing::error!(%epoch, error = %error.stop_text(),
                "epoch coordinator failed; nothing commits from now on");
            self.failed_epoch = Some(epoch);
        } else {
            // Each later epoch whose offsets complete fails again: logged once above.
            tracing::debug!(%epoch, error = %error.stop_text(), "epoch coordinator failed again");
        }
        self.query.stop(error);
    }

    /// SPEC B.7: three independent checks, in order; each failing one stops the query.
    ///
    /// Only once [`Self::backlog_slack`] is used up: until then no queue can be over its limit.
    #[inline(always)]
    fn check_backlog(&mut self) {
        debug_assert!(self.backlog_slack <= self.exact_backlog_slack());
        if self.backlog_slack == 0 {
            self.check_backlog_limits();
        }
    }

    /// [`Self::check_backlog`]'s comparisons, then the slack counted again.
    #[inline(never)]
    fn check_backlog_limits(&mut self) {
        if self.offset_entries > self.config.partition_offset_limit {
            self.overflow(
                BacklogQueue::PartitionOffsets,
                self.offset_entries,
                self.config.partition_offset_limit,
            );
        }
        if self.commit_entries > self.config.partition_commit_limit {
            self.overflow(
                BacklogQueue::PartitionCommits,
                self.commit_entries,
                self.config.partition_commit_limit,
            );
        }
        if self.waiting_epochs > self.config.waiting_epoch_limit {
            self.overflow(
                BacklogQueue::WaitingEpochs,
                self.waiting_epochs,
                self.config.waiting_epoch_limit,
            );
        }
        self.recount_backlog_slack();
    }

    /// One entry more in a backlog queue: one less of [`Self::backlog_slack`].
    #[inline(always)]
    fn take_backlog_slack(&mut self) {
        self.backlog_slack = self.backlog_slack.saturating_sub(1);
    }

    /// Sets [`Self::admission`] again from what it is derived from.
    fn set_admission_gate(&mut self) {
        self.admission = AdmissionGate::of(
            self.reader_partitions,
            self.writer_partitions,
            self.last_committed,
            self.writes_stopped,
        );
    }

    /// Sets [`Self::backlog_slack`] to the exact room left.
    fn recount_backlog_slack(&mut self) {
        self.backlog_slack = self.exact_backlog_slack();
    }

    /// The least room left under the three backlog limits (0 for a queue at or over its limit).
    fn exact_backlog_slack(&self) -> usize {
        let room = |limit: usize, size: usize| limit.saturating_sub(size);
        room(self.config.partition_offset_limit, self.offset_entries)
            .min(room(self.config.partition_commit_limit, self.commit_entries))
            .min(room(self.config.waiting_epoch_limit, self.waiting_epochs))
    }

    #[cold]
    fn overflow(&mut self, queue: BacklogQueue, size: usize, limit: usize) {
        self.counters.backlog_overflows += 1;
        if worth_a_warning(self.counters.backlog_overflows) {
            tracing::warn!(
                ?queue,
                size,
                limit,
                overflows = self.counters.backlog_overflows,
                "{}",
                queue.overflow_message()
            );
        }
        self.query.stop(EpochError::BacklogExceeded { queue, size, limit });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(slots: &mut Slots) -> Vec<i32> {
        slots.sorted().iter().map(|(partition, _)| partition.0).collect()
    }

    #[test]
    fn sparse_slots_stay_positional_for_in_order_partitions() {
        let mut slots = Slots::new();
        for partition in 0..5 {
            assert_eq!(slots.insert(PartitionId(partition), 1.into(), false), Inserted::New);
        }
        assert!(slots.positional && !slots.dense);
        assert_eq!(slots.insert(PartitionId(3), 2.into(), false), Inserted::Duplicate);
        assert_eq!(slots.insert(PartitionId(3), 2.into(), true), Inserted::Replaced);
        assert_eq!(slots.entries[3].1.as_i64(), Some(2));
        assert_eq!(slots.len(), 5);
    }

    #[test]
    fn sparse_slots_sort_a_permutation_by_placement_and_others_by_comparison() {
        let mut slots = Slots::new();
        for partition in [3, 0, 4, 1, 2] {
            let inserted = slots.insert(PartitionId(partition), partition.into(), false);
            assert_eq!(inserted, Inserted::New);
        }
        assert!(!slots.positional);
        assert_eq!(ids(&mut slots), [0, 1, 2, 3, 4]);
        assert!(slots.positional);
        // Still finds entries (by position) after sorting, and leaves positional mode cleanly.
        assert_eq!(slots.insert(PartitionId(2), 9.into(), true), Inserted::Replaced);
        assert_eq!(slots.insert(PartitionId(9), 9.into(), true), Inserted::New);
        assert_eq!(slots.insert(PartitionId(2), 8.into(), false), Inserted::Duplicate);
        assert_eq!(ids(&mut slots), [0, 1, 2, 3, 4, 9]);
        assert_eq!(slots.insert(PartitionId(9), 1.into(), false), Inserted::Duplicate);
        assert_eq!(slots.insert(PartitionId(7), 1.into(), false), Inserted::New);
        assert_eq!(slots.entries[2].1.as_i64(), Some(9));
        assert_eq!(slots.len(), 7);
    }

    #[test]
    fn dense_slots_are_the_sorted_slice_and_fall_back_to_sparse() {
        let mut slots = Slots::new();
        slots.prepare(4, true);
        assert!(slots.dense);
        for partition in [2, 0, 3] {
            assert_eq!(
                slots.insert(PartitionId(partition), partition.into(), false),
                Inserted::New
            );
        }
        assert_eq!(slots.insert(PartitionId(0), 5.into(), false), Inserted::Duplicate);
        assert_eq!(slots.len(), 3);
        assert_eq!(slots.insert(PartitionId(1), 1.into(), false), Inserted::New);
        assert_eq!(ids(&mut slots), [0, 1, 2, 3]);
        assert!(slots.dense, "a complete dense side needs no conversion");
        // Reuse: clear keeps the layout; a partition beyond it turns the side sparse.
        slots.clear();
        slots.prepare(4, true);
        assert_eq!(slots.len(), 0);
        assert_eq!(slots.insert(PartitionId(3), 3.into(), false), Inserted::New);
        assert_eq!(slots.insert(PartitionId(6), 6.into(), false), Inserted::New);
        assert!(!slots.dense);
        assert_eq!(slots.insert(PartitionId(3), 9.into(), false), Inserted::Duplicate);
        assert_eq!(ids(&mut slots), [3, 6]);
        assert_eq!(slots.sorted()[0].1.as_i64(), Some(3));
        // An incomplete dense side sorts into its present entries only.
        let mut partial = Slots::new();
        partial.prepare(8, true);
        partial.insert(PartitionId(5), 5.into(), true);
        partial.insert(PartitionId(1), 1.into(), true);
        assert_eq!(ids(&mut partial), [1, 5]);
        partial.shrink();
        assert!(!partial.dense && partial.len() == 0 && partial.entries.capacity() <= 16);
    }

    #[test]
    fn a_dense_repeat_replaces_or_keeps_and_counts_once() {
        let mut slots = Slots::new();
        slots.prepare(3, true);
        assert_eq!(slots.insert(PartitionId(1), 10.into(), true), Inserted::New);
        assert_eq!(slots.insert(PartitionId(1), 11.into(), true), Inserted::Replaced);
        assert_eq!(slots.insert(PartitionId(1), 12.into(), false), Inserted::Duplicate);
        assert_eq!(slots.len(), 1, "a repeat is not a new entry");
        assert!(slots.dense, "a repeat keeps the dense layout");
        assert_eq!(slots.insert(PartitionId(0), 0.into(), true), Inserted::New);
        assert_eq!(slots.insert(PartitionId(2), 2.into(), true), Inserted::New);
        let values: Vec<_> = slots.sorted().iter().map(|(_, payload)| payload.as_i64()).collect();
        assert_eq!(values, [Some(0), Some(11), Some(2)], "the replacement, not the duplicate");
    }

    struct Nothing;
    impl Query for Nothing {
        fn add_offsets(
            &mut self,
            _: Epoch,
            _: Offsets<'_>,
        ) -> Result<(), crate::error::HandlerError> {
            Ok(())
        }
        fn commit(&mut self, _: Epoch) -> Result<(), crate::error::HandlerError> {
            Ok(())
        }
        fn stop(&mut self, _: EpochError) {}
    }
    impl Sink for Nothing {
        fn commit(
            &mut self,
            _: Epoch,
            _: &[(PartitionId, Payload)],
        ) -> Result<(), crate::error::HandlerError> {
            Ok(())
        }
    }

    #[test]
    fn the_dense_window_is_the_full_epochs_the_limit_holds_at_least_16_up_to_16_ki() {
        assert_eq!(dense_window(1000, 10_000), 16, "10 full epochs: the least window");
        assert_eq!(dense_window(1000, 1 << 20), 1048);
        assert_eq!(dense_window(1000, 1999), 16);
        assert_eq!(dense_window(1, usize::MAX), i64::MAX, "saturates");
        assert_eq!(dense_window(0, 1 << 20), 16, "count unset");
        assert_eq!(dense_window(-3, 1 << 20), 16, "a negative count (refused before)");
        // Above 16 Ki partitions no least window: only the full epochs the limit holds.
        assert_eq!(dense_window(1 << 14, 1 << 17), 16, "16 Ki: the least window still");
        assert_eq!(dense_window((1 << 14) + 1, 1 << 17), 7);
        assert_eq!(dense_window(20_000, 1_000_000), 50);
        assert_eq!(dense_window(100_000, 150_000), 1, "the next epoch");
        assert_eq!(dense_window(100_000, 10_000), 0, "over the limit: never dense");
    }

    #[test]
    fn a_released_side_keeps_only_an_allocation_sized_for_the_count() {
        const LIMIT: usize = 10_000;
        let dense_side = || {
            let mut slots = Slots::new();
            slots.prepare(100, true);
            assert_eq!(slots.entries.capacity(), 100);
            slots
        };
        let mut slots = dense_side();
        slots.clear_for_reuse(100, LIMIT);
        assert!(slots.dense && slots.entries.capacity() == 100, "the same count keeps it");
        let mut slots = dense_side();
        slots.clear_for_reuse(200, LIMIT);
        assert_eq!(slots.entries.capacity(), 100, "room for a larger count is kept");
        let mut slots = dense_side();
        slots.clear_for_reuse(50, LIMIT);
        assert!(!slots.dense && slots.entries.capacity() == 0, "room beyond a smaller count goes");
        let mut sparse = Slots::new();
        for partition in [5, 3, 1] {
            sparse.insert(PartitionId(partition), 1.into(), false);
        }
        assert!(sparse.index.capacity() > 0);
        sparse.clear_for_reuse(0, LIMIT);
        assert!(sparse.index.capacity() > 0, "an index within the small capacity is kept");
        for partition in 0..30 {
            sparse.insert(PartitionId(2 * partition + 1), 1.into(), false);
        }
        assert!(sparse.entries.capacity() <= 40 && sparse.index.capacity() > 40);
        sparse.clear_for_reuse(40, LIMIT);
        assert_eq!(sparse.index.capacity(), 0, "an index beyond the count goes");
        assert_eq!(sparse.entries.capacity(), 0, "and the side with it");
        // A count above the limit: no side holds more than the limit and one, so no more room
        // than that is kept.
        let mut sparse = Slots::new();
        for partition in 0..60 {
            sparse.insert(PartitionId(partition), 1.into(), false);
        }
        assert!(sparse.entries.capacity() >= 60);
        sparse.clear_for_reuse(1_000_000, 40);
        assert_eq!(sparse.entries.capacity(), 0, "room beyond the limit goes");
    }

    #[test]
    fn only_the_top_of_the_free_list_keeps_allocations() {
        // 100 partitions under a limit of 2000: the 20 free buckets released last keep theirs.
        let config = EpochConfig::new(1).with_backlog_limit(2000);
        let mut coordinator = EpochCoordinator::new(config, Nothing, Nothing).unwrap();
        coordinator.set_reader_partitions(100).unwrap();
        coordinator.set_writer_partitions(100).unwrap();
        // 30 live buckets at once (one entry each), then committed in order: 30 free buckets.
        for epoch in 1..=30 {
            coordinator.apply(report(0, epoch, 1.into())).unwrap();
        }
        for epoch in 1..=30 {
            for partition in 0..100 {
                let _ = coordinator.apply(report(partition, epoch, 1.into()));
                coordinator.apply(commit(partition, epoch, 1.into())).unwrap();
            }
        }
        assert_eq!(coordinator.last_committed(), Epoch(30));
        let held: Vec<(bool, bool)> = (coordinator.free.iter())
            .map(|&slot| &coordinator.buckets[slot as usize])
            .map(|bucket| {
                let held = |side: &Slots| side.entries.capacity() > SMALL_SIDE_CAPACITY;
                (held(&bucket.offsets), held(&bucket.commits))
            })
            .collect();
        assert_eq!(held.len(), 30);
        assert_eq!(held[..10], [(false, false); 10], "below the top 20: given back");
        assert_eq!(held[10..20], [(true, true); 10], "epochs 11-20, laid out dense");
        // Epochs 21-30 were beyond the dense window (20 epochs) when laid out: sparse sides
        // grown past the count (to 128), given back.
        assert_eq!(held[20..], [(false, false); 10]);
        // The next 20 epochs, live at once, pop the top 20: near ones, laid out dense whether
        // their bucket kept its allocation or not; they commit.
        for epoch in 31..=50 {
            coordinator.apply(report(0, epoch, 1.into())).unwrap();
            let bucket = &coordinator.buckets[coordinator.by_epoch[&epoch] as usize];
            assert!(bucket.offsets.dense && bucket.commits.dense, "epoch {epoch}");
        }
        for epoch in 31..=50 {
            for partition in 0..100 {
                let _ = coordinator.apply(report(partition, epoch, 1.into()));
                coordinator.apply(commit(partition, epoch, 1.into())).unwrap();
            }
        }
        assert_eq!(coordinator.last_committed(), Epoch(50));
    }

    #[test]
    fn a_partition_count_change_gives_back_the_free_buckets_allocations() {
        let mut coordinator = coordinator_of(100);
        // Three epochs live at once, then committed in one pass: three free buckets.
        for epoch in [3, 2, 1] {
            for partition in 0..100 {
                coordinator.apply(report(partition, epoch, 1.into())).unwrap();
                coordinator.apply(commit(partition, epoch, 1.into())).unwrap();
            }
        }
        assert_eq!(coordinator.last_committed(), Epoch(3));
        let capacities = |coordinator: &EpochCoordinator<Nothing, Nothing>| {
            let free = coordinator.free.iter().map(|&slot| &coordinator.buckets[slot as usize]);
            free.map(|bucket| {
                (bucket.offsets.entries.capacity(), bucket.commits.entries.capacity())
            })
            .collect::<Vec<_>>()
        };
        assert_eq!(capacities(&coordinator), [(100, 100); 3]);
        coordinator.set_reader_partitions(100).unwrap();
        assert_eq!(capacities(&coordinator), [(100, 100); 3], "the same count changes nothing");
        coordinator.set_reader_partitions(10).unwrap();
        assert_eq!(capacities(&coordinator), [(0, 100); 3]);
        coordinator.set_writer_partitions(1000).unwrap();
        assert_eq!(capacities(&coordinator), [(0, 0); 3]);
    }

    /// Above 16 Ki partitions a side is dense only as far ahead as the limit holds full epochs
    /// (no least window of 16), and a complete dense side commits as any other; over the limit,
    /// or over [`DENSE_PARTITIONS_MAX`], none is.
    #[test]
    fn counts_above_16_ki_are_dense_within_the_epochs_the_limit_holds() {
        const COUNT: i32 = 20_000;
        let config = EpochConfig::new(1).with_backlog_limit(100_000);
        let mut coordinator = EpochCoordinator::new(config, Nothing, Nothing).unwrap();
        coordinator.set_reader_partitions(COUNT).unwrap();
        coordinator.set_writer_partitions(1).unwrap();
        let dense_at = |coordinator: &EpochCoordinator<Nothing, Nothing>, epoch: i64| {
            coordinator.buckets[coordinator.by_epoch[&epoch] as usize].offsets.dense
        };
        // 100_000 / 20_000 = 5 full epochs (fewer than 16).
        for epoch in [1, 5, 6] {
            coordinator.report_partition_offset(PartitionId(7), Epoch(epoch), 1.into()).unwrap();
        }
        assert!(dense_at(&coordinator, 1) && dense_at(&coordinator, 5));
        assert!(!dense_at(&coordinator, 6), "beyond the limit's full epochs: sparse");
        for partition in 0..COUNT {
            coordinator
                .report_partition_offset(PartitionId(partition), Epoch(1), 2.into())
                .unwrap();
        }
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(1), 1.into()).unwrap();
        assert_eq!(coordinator.last_committed(), Epoch(1));

        let config = EpochConfig::new(1).with_backlog_limit(COUNT as usize - 1);
        let mut over = EpochCoordinator::new(config, Nothing, Nothing).unwrap();
        over.set_reader_partitions(COUNT).unwrap();
        over.report_partition_offset(PartitionId(7), Epoch(1), 1.into()).unwrap();
        assert!(!dense_at(&over, 1), "a count over the limit is never dense");

        let huge = DENSE_PARTITIONS_MAX + 1;
        let config = EpochConfig::new(1).with_backlog_limit(usize::MAX);
        let mut huge_count = EpochCoordinator::new(config, Nothing, Nothing).unwrap();
        huge_count.set_reader_partitions(huge).unwrap();
        huge_count.report_partition_offset(PartitionId(7), Epoch(1), 1.into()).unwrap();
        assert!(!dense_at(&huge_count, 1), "over 1 Mi partitions: never dense");
        let side = &huge_count.buckets[huge_count.by_epoch[&1] as usize].offsets;
        assert!(side.entries.capacity() <= 16, "one message allocates a small sparse side");
    }

    #[test]
    fn far_epochs_are_sparse_and_committed_buckets_are_recycled() {
        let config = EpochConfig::new(1).with_backlog_limit(1 << 20);
        let mut coordinator = EpochCoordinator::new(config, Nothing, Nothing).unwrap();
        coordinator.set_reader_partitions(1000).unwrap();
        coordinator.set_writer_partitions(1000).unwrap();
        // Near the frontier: dense, sized for the partition count.
        coordinator.report_partition_offset(PartitionId(999), Epoch(2), 1.into()).unwrap();
        let near = coordinator.by_epoch[&2] as usize;
        assert!(coordinator.buckets[near].offsets.dense);
        // Ahead, but within the epochs the limit holds in full (2^20 / 1000 = 1048): dense.
        coordinator.report_partition_offset(PartitionId(999), Epoch(1048), 1.into()).unwrap();
        assert!(coordinator.buckets[coordinator.by_epoch[&1048] as usize].offsets.dense);
        // Far ahead: one entry costs a small sparse allocation, not a full epoch's.
        for epoch in 1100..1200 {
            coordinator.report_partition_offset(PartitionId(999), Epoch(epoch), 1.into()).unwrap();
        }
        for epoch in 1100..1200 {
            let bucket = &coordinator.buckets[coordinator.by_epoch[&epoch] as usize];
            assert!(!bucket.offsets.dense && !bucket.commits.dense);
            assert!(bucket.offsets.entries.capacity() <= 16);
            assert!(bucket.commits.entries.capacity() <= 16);
        }
        // Steady state: committing epoch after epoch reuses the same few buckets.
        for epoch in 1..=40 {
            for partition in 0..1000 {
                let _ = coordinator.report_partition_offset(
                    PartitionId(partition),
                    Epoch(epoch),
                    1.into(),
                );
                let _ = coordinator.commit_partition_epoch(
                    PartitionId(partition),
                    Epoch(epoch),
                    1.into(),
                );
            }
        }
        assert_eq!(coordinator.last_committed(), Epoch(40));
        assert_eq!(coordinator.buckets.len(), 103, "1 + 101 ahead + 1 recycled");
        let stats = coordinator.stats();
        assert_eq!(stats.offset_entries, 1000 + 101, "retained epoch 40 + the entries ahead");
        assert_eq!(stats.commit_entries, 1000);
    }

    fn report(partition: i32, epoch: i64, offset: Payload) -> EpochMessage {
        EpochMessage::ReportPartitionOffset { partition, epoch, offset }
    }

    fn commit(partition: i32, epoch: i64, message: Payload) -> EpochMessage {
        EpochMessage::CommitPartitionEpoch { partition, epoch, message }
    }

    fn coordinator_of(partitions: i32) -> EpochCoordinator<Nothing, Nothing> {
        let mut coordinator = EpochCoordinator::new(EpochConfig::new(1), Nothing, Nothing).unwrap();
        coordinator.set_reader_partitions(partitions).unwrap();
        coordinator.set_writer_partitions(partitions).unwrap();
        coordinator
    }

    /// The same partition count set again (a retried stage) changes nothing: the pending
    /// entries, the counters and the epochs' progress stay as they were, and the epoch still
    /// commits.
    #[test]
    fn the_same_partition_count_again_changes_nothing() {
        let mut coordinator = coordinator_of(4);
        for partition in 0..3 {
            coordinator.apply(report(partition, 1, 1.into())).unwrap();
            coordinator.apply(commit(partition, 1, 1.into())).unwrap();
        }
        let before = coordinator.stats();
        coordinator.set_reader_partitions(4).unwrap();
        coordinator.set_writer_partitions(4).unwrap();
        assert_eq!(coordinator.stats(), before);
        coordinator.apply(report(3, 1, 1.into())).unwrap();
        coordinator.apply(commit(3, 1, 1.into())).unwrap();
        assert_eq!(coordinator.last_committed(), Epoch(1));
    }

    /// A payload on the heap stored by a stretch marks its side, so that the side's clear frees
    /// it (a recycled bucket would otherwise keep it).
    #[test]
    fn a_stretch_marks_a_side_holding_heap_payloads() {
        let mut coordinator = coordinator_of(4);
        let long = || Payload::from(vec![7u8; 2 * Payload::INLINE_BYTES]);
        // The first message goes one by one; the two after it through a stretch.
        let messages = [report(0, 1, 0.into()), report(1, 1, long()), commit(0, 1, long())];
        coordinator.apply_run(&mut messages.into_iter(), |rejected| panic!("{rejected}"));
        let bucket = &coordinator.buckets[coordinator.by_epoch[&1] as usize];
        assert_eq!((bucket.offsets.len, bucket.commits.len), (2, 1));
        assert!(bucket.offsets.stored.heap && bucket.commits.stored.heap);
    }

    /// What a [`WordsSeen`] query was handed: per call, the epoch and whether the offsets
    /// were words.
    type WordsLog = std::rc::Rc<std::cell::RefCell<Vec<(i64, bool)>>>;

    /// Records whether each epoch's offsets came as words ([`Offsets::are_words`]).
    struct WordsSeen(WordsLog);
    impl Query for WordsSeen {
        fn add_offsets(
            &mut self,
            epoch: Epoch,
            offsets: Offsets<'_>,
        ) -> Result<(), crate::error::HandlerError> {
            self.0.borrow_mut().push((epoch.0, offsets.are_words()));
            Ok(())
        }
        fn commit(&mut self, _: Epoch) -> Result<(), crate::error::HandlerError> {
            Ok(())
        }
        fn stop(&mut self, _: EpochError) {}
    }

    /// A complete dense side is handed on as words exactly when every payload it holds is 8
    /// bytes, whichever path stored them: one by one, a stretch, or a repeated report that
    /// replaced a word or was replaced by one. A recycled bucket starts from a clear note.
    #[test]
    fn the_query_is_told_whether_an_epochs_offsets_are_words() {
        let seen = WordsLog::default();
        let mut coordinator =
            EpochCoordinator::new(EpochConfig::new(1), WordsSeen(seen.clone()), Nothing).unwrap();
        coordinator.set_reader_partitions(4).unwrap();
        coordinator.set_writer_partitions(1).unwrap();
        let twelve = || Payload::from(&[3u8; 12][..]);
        let long = || Payload::from(vec![7u8; 2 * Payload::INLINE_BYTES]);
        let run = |coordinator: &mut EpochCoordinator<_, _>, messages: Vec<EpochMessage>| {
            coordinator.apply_run(&mut messages.into_iter(), |rejected| panic!("{rejected}"));
        };
        let words = |epoch: i64| (0..4).map(move |p| report(p, epoch, i64::from(p).into()));
        // Epoch 1: words (the first and the completing report one by one, the two between
        // them in a stretch).
        run(&mut coordinator, words(1).chain([commit(0, 1, 1.into())]).collect());
        // Epoch 2: a 12-byte offset in the stretch.
        let twelve_in_stretch = [report(0, 2, 0.into()), report(1, 2, twelve())];
        let rest = [report(2, 2, 2.into()), report(3, 2, 3.into()), commit(0, 2, 1.into())];
        run(&mut coordinator, twelve_in_stretch.into_iter().chain(rest).collect());
        // Epoch 3: words again, in the recycled bucket of epoch 2 (each epoch commits before
        // the next begins, so all of them reuse one bucket): its clear forgot epoch 2's note.
        run(&mut coordinator, words(3).chain([commit(0, 3, 1.into())]).collect());
        // Epoch 4: a heap offset, applied one message at a time.
        for message in [report(3, 4, long())].into_iter().chain(words(4).take(3)) {
            coordinator.apply(message).unwrap();
        }
        run(&mut coordinator, vec![commit(0, 4, 1.into())]);
        // Epoch 5: a word replaced by a repeated report of 12 bytes before the side completes.
        for message in words(5).take(3).chain([report(1, 5, twelve()), report(3, 5, 3.into())]) {
            coordinator.apply(message).unwrap();
        }
        run(&mut coordinator, vec![commit(0, 5, 1.into())]);
        // Epoch 6: words once more, one by one.
        for message in words(6).chain([commit(0, 6, 1.into())]) {
            coordinator.apply(message).unwrap();
        }
        // Epoch 7: a 12-byte offset replaced by a word: words after all (the side's count of
        // payloads that are no word went back to zero).
        for message in [report(1, 7, twelve())].into_iter().chain(words(7)) {
            coordinator.apply(message).unwrap();
        }
        run(&mut coordinator, vec![commit(0, 7, 1.into())]);
        assert_eq!(coordinator.last_committed(), Epoch(7));
        assert_eq!(
            *seen.borrow(),
            [(1, true), (2, false), (3, true), (4, false), (5, false), (6, true), (7, true)]
        );
    }

    /// A side that is not dense says whether it is words too: ids `0..len` arriving in order,
    /// and out of order (sorted on completion), are words; a gap is not.
    #[test]
    fn a_sparse_side_says_whether_it_is_words() {
        let mut in_order = Slots::new();
        in_order.prepare(3, false);
        for partition in 0..3 {
            in_order.insert(PartitionId(partition), 1.into(), true);
        }
        assert!(!in_order.dense && in_order.offsets().are_words());
        let mut shuffled = Slots::new();
        for partition in [2, 0, 1] {
            shuffled.insert(PartitionId(partition), 1.into(), true);
        }
        assert!(shuffled.offsets().are_words());
        let mut gap = Slots::new();
        for partition in [0, 2] {
            gap.insert(PartitionId(partition), 1.into(), true);
        }
        assert!(!gap.offsets().are_words());
        // A dense side made sparse by a partial hand-over keeps its count: words, then not
        // once a 12-byte offset joins it.
        let mut partial = Slots::new();
        partial.prepare(3, true);
        partial.insert(PartitionId(0), 1.into(), true);
        partial.insert(PartitionId(1), 1.into(), true);
        assert!(partial.offsets().are_words() && !partial.dense);
        partial.insert(PartitionId(2), Payload::from(&[3u8; 12][..]), true);
        assert!(!partial.offsets().are_words());
    }

    /// A sparse side counts the payloads it holds that are no word, so that a complete side
    /// says whether its offsets are words without reading them (a repeated report of a
    /// complete epoch costs O(1)), and exactly: a replacement through the index and in the
    /// positional layout moves the count both ways, a duplicate kept out moves nothing, and
    /// entries a lowered count removes take their payloads out of it.
    #[test]
    fn a_sparse_side_counts_the_payloads_that_are_no_word() {
        let twelve = || Payload::from(&[3u8; 12][..]);
        let mut side = Slots::new();
        for partition in [2, 0, 1] {
            side.insert(PartitionId(partition), 1.into(), true);
        }
        assert!(!side.positional, "partition 2 first: the side is indexed");
        assert_eq!(side.insert(PartitionId(1), twelve(), true), Inserted::Replaced);
        assert!(!side.offsets().are_words());
        assert!(side.positional, "sorted on the hand-over");
        assert_eq!(side.insert(PartitionId(1), 5.into(), true), Inserted::Replaced);
        assert!(side.offsets().are_words());
        assert_eq!(side.insert(PartitionId(0), twelve(), false), Inserted::Duplicate);
        assert!(side.offsets().are_words());
        assert_eq!(side.insert(PartitionId(0), twelve(), true), Inserted::Replaced);
        assert_eq!(side.stored.non_words, 1);
        assert!(!side.offsets().are_words());
        side.clear();
        assert_eq!(side.stored.non_words, 0);

        let mut lowered = Slots::new();
        for (partition, payload) in [(0, 1.into()), (1, 1.into()), (5, twelve())] {
            lowered.insert(PartitionId(partition), payload, true);
        }
        assert_eq!(lowered.remove_from(2), 1);
        assert!(lowered.offsets().are_words());
    }

    /// A caller's iterator that panics in the middle of a stretch leaves the coordinator as
    /// many messages applied one by one would: the entries stored are counted, and the epoch
    /// still commits once the rest arrive.
    #[test]
    fn a_stretch_ended_by_a_panicking_iterator_is_counted() {
        let messages = || (0..3).map(|partition| report(partition, 1, 1.into()));
        let mut coordinator = coordinator_of(4);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut doomed = messages().chain(std::iter::once_with(|| panic!("the test's panic")));
            coordinator.apply_run(&mut doomed, |rejected| panic!("{rejected}"));
        }));
        assert!(panicked.is_err());
        let mut one_by_one = coordinator_of(4);
        for message in messages() {
            one_by_one.apply(message).unwrap();
        }
        assert_eq!(coordinator.stats(), one_by_one.stats());
        let rest =
            [report(3, 1, 1.into())].into_iter().chain((0..4).map(|p| commit(p, 1, 1.into())));
        coordinator.apply_run(&mut rest.into_iter(), |rejected| panic!("{rejected}"));
        assert_eq!(coordinator.last_committed(), Epoch(1));
    }

    /// Count changes back and forth drop the entries stored beyond the new count; the
    /// buckets those drops leave empty are freed, so such cycles keep no more buckets alive
    /// than the entries allow (the entry counts, and so the backlog checks, stay low).
    #[test]
    fn buckets_emptied_by_a_count_change_are_freed() {
        let mut coordinator = coordinator_of(1);
        for cycle in 0..50 {
            coordinator.set_reader_partitions(0).unwrap();
            // While the count is unset, any partition id is kept, in epochs that never commit.
            for epoch in (2 + cycle * 20)..(2 + (cycle + 1) * 20) {
                coordinator
                    .report_partition_offset(PartitionId(3), Epoch(epoch), 1.into())
                    .unwrap();
            }
            assert_eq!(coordinator.by_epoch.len(), 20);
            coordinator.set_reader_partitions(1).unwrap();
            assert_eq!(coordinator.by_epoch.len(), 0, "cycle {cycle}");
        }
        assert_eq!(coordinator.buckets.len(), 20, "freed buckets are reused");
        let stats = coordinator.stats();
        assert_eq!(stats.offset_entries, 0);
        assert_eq!(stats.counters.dropped_partition_out_of_range, 50 * 20);
        // A bucket that keeps an entry on either side stays, and a freed epoch's next message
        // lays it out afresh and commits it.
        coordinator.set_reader_partitions(0).unwrap();
        coordinator.report_partition_offset(PartitionId(3), Epoch(1), 1.into()).unwrap();
        coordinator.commit_partition_epoch(PartitionId(0), Epoch(1), 1.into()).unwrap();
        coordinator.set_reader_partitions(1).unwrap();
        assert_eq!(coordinator.by_epoch.len(), 1, "epoch 1 keeps its commit");
        coordinator.report_partition_offset(PartitionId(0), Epoch(1), 1.into()).unwrap();
        assert_eq!(coordinator.last_committed(), Epoch(1));
    }

    #[test]
    fn int_hasher_spreads_strided_keys() {
        use std::hash::BuildHasher;
        let build = BuildHasherDefault::<IntHasher>::default();
        let low_bits: std::collections::HashSet<u64> =
            (0..64i32).map(|key| build.hash_one(key * 1024) & 127).collect();
        assert!(low_bits.len() > 32, "strided keys collide: {}", low_bits.len());
    }
}
