//! Where the active providers of one query run are loaded, laid out for the cache.
//!
//! A run's stores come in operators (checkpoint location, store name, operator id), and the
//! stores of one operator are its partitions, numbered densely from 0. So the table is a small
//! map from operator to a vector indexed by partition id: a lookup hashes three words of a map
//! that has one entry per operator (it stays in the first-level cache), then indexes a vector of
//! 16-byte slots in which neighbouring partitions share cache lines. That is several times less
//! memory touched per report than one hash map keyed by the whole store id.
//!
//! The dense vector grows only as far as its live entries justify: a partition id goes there if
//! it is below twice the operator's dense entries plus [`DENSE_SLACK`] (and below
//! [`DENSE_PARTITION_LIMIT`]); any other id (a stray huge one, a negative one, or one that
//! arrived far ahead of the others) goes to a per-operator hash map, and moves into the
//! vector when the vector grows over it. So one report costs one slot or one map entry, not
//! a vector up to its partition id: the vector of an operator holds at most about twice its
//! entries plus the slack, and never more than `DENSE_PARTITION_LIMIT` slots (1 MiB).

use rustc_hash::FxHashMap;

use super::ids::{ExecutorCacheTaskLocation, Name, StateStoreId};

/// Partition ids below this may be kept in the dense vector of their operator.
pub(super) const DENSE_PARTITION_LIMIT: usize = 1 << 16;

/// Slots the dense vector may hold beyond twice its entries (so the first partitions of an
/// operator, arriving in any order, go straight to the vector).
pub(super) const DENSE_SLACK: usize = 64;

/// One operator's stores within a run: every field of a [`StateStoreId`] but the partition.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct OperatorKey {
    checkpoint_root_location: Name,
    store_name: Name,
    operator_id: i64,
}

impl OperatorKey {
    fn of(store_id: &StateStoreId) -> Self {
        Self {
            checkpoint_root_location: store_id.checkpoint_root_location,
            store_name: store_id.store_name,
            operator_id: store_id.operator_id,
        }
    }

    fn store_id(self, partition_id: i32) -> StateStoreId {
        StateStoreId {
            checkpoint_root_location: self.checkpoint_root_location,
            operator_id: self.operator_id,
            partition_id,
            store_name: self.store_name,
        }
    }
}

/// The partitions of one operator.
#[derive(Debug, Default)]
struct PartitionSlots {
    /// Slot `p` holds partition `p`; `None` where not active. Every partition below
    /// `dense.len()` is here, never in `sparse`.
    dense: Vec<Option<ExecutorCacheTaskLocation>>,
    /// `Some` slots of `dense`.
    dense_len: usize,
    /// Partitions at or above `dense.len()` (huge, negative, or far ahead of the others).
    sparse: FxHashMap<i32, ExecutorCacheTaskLocation>,
    /// Sparse entries and newly covered slots [`Self::grow_to`] looked at (tests).
    #[cfg(test)]
    growth_visits: usize,
}

impl PartitionSlots {
    /// How many slots the dense vector may have now (module doc).
    fn dense_room(&self) -> usize {
        (2 * self.dense_len + DENSE_SLACK).min(DENSE_PARTITION_LIMIT)
    }

    /// Grows the dense vector to hold `index` (at least doubling, within
    /// [`Self::dense_room`]; `index` is below it).
    #[cold]
    fn grow_dense(&mut self, index: usize) {
        let new_len = (2 * self.dense.len()).max(index + 1).min(self.dense_room());
        self.grow_to(new_len);
    }

    /// After a new dense entry: while sparse entries wait and the room has doubled, grows the
    /// vector to the room, taking in the entries it covers (each growth at least doubles the
    /// vector, so a run of arrivals in any order costs O(log n) growths).
    #[inline]
    fn absorb_sparse(&mut self) {
        while !self.sparse.is_empty() && self.dense_room() >= 2 * self.dense.len().max(1) {
            let room = self.dense_room();
            self.grow_to(room);
        }
    }

    /// Resizes the dense vector to `new_len` slots and moves the sparse entries it now covers
    /// into it. Those are the sparse entries in `old len..new_len` (none is below the old
    /// length), found by looking up each new slot or by one pass over the sparse entries,
    /// whichever is fewer: a growth costs at most its new slots, so however the vector grows
    /// (by doubling, or by a few slots where its room is short), the growths of an operator
    /// cost O(1) per entry. (Scanning every sparse entry at each growth cost a whole pass per
    /// report when many partitions above the dense limit wait there for good.)
    #[cold]
    fn grow_to(&mut self, new_len: usize) {
        let old_len = self.dense.len();
        self.dense.resize(new_len, None);
        let by_slot = new_len - old_len <= self.sparse.len();
        #[cfg(test)]
        {
            self.growth_visits += if by_slot { new_len - old_len } else { self.sparse.len() };
        }
        let (dense, dense_len) = (&mut self.dense, &mut self.dense_len);
        let mut place = |slot: usize, location| {
            dense[slot] = Some(location);
            *dense_len += 1;
        };
        if by_slot {
            for slot in old_len..new_len {
                // New slots are below DENSE_PARTITION_LIMIT, so their indexes fit an i32.
                if let Some(location) = self.sparse.remove(&(slot as i32)) {
                    place(slot, location);
                }
            }
        } else {
            self.sparse.retain(|&partition, location| match usize::try_from(partition) {
                Ok(slot) if slot < new_len => {
                    place(slot, *location);
                    false
                }
                _ => true,
            });
        }
    }
}

/// Active providers of one run: store id -> location.
#[derive(Debug, Default)]
pub(super) struct InstanceTable {
    operators: FxHashMap<OperatorKey, PartitionSlots>,
    /// Number of `Some` slots plus sparse entries over all operators.
    len: usize,
}

impl InstanceTable {
    /// Sets the location of `store_id`; returns the previous one.
    #[inline]
    pub(super) fn insert(
        &mut self,
        store_id: StateStoreId,
        location: ExecutorCacheTaskLocation,
    ) -> Option<ExecutorCacheTaskLocation> {
        let slots = self.operators.entry(OperatorKey::of(&store_id)).or_default();
        let index = usize::try_from(store_id.partition_id).ok();
        let previous = match index {
            Some(index) if index < slots.dense.len() || index < slots.dense_room() => {
                if index >= slots.dense.len() {
                    // The growth may move this very partition over from `sparse`.
                    slots.grow_dense(index);
                }
                let previous = slots.dense[index].replace(location);
                if previous.is_none() {
                    slots.dense_len += 1;
                    slots.absorb_sparse();
                }
                previous
            }
            _ => slots.sparse.insert(store_id.partition_id, location),
        };
        if previous.is_none() {
            self.len += 1;
        }
        previous
    }

    /// The location of `store_id`, if active.
    #[inline]
    pub(super) fn get(&self, store_id: &StateStoreId) -> Option<ExecutorCacheTaskLocation> {
        let slots = self.operators.get(&OperatorKey::of(store_id))?;
        match usize::try_from(store_id.partition_id) {
            Ok(index) if index < slots.dense.len() => slots.dense[index],
            _ => slots.sparse.get(&store_id.partition_id).copied(),
        }
    }

    /// Number of active providers.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Every active provider and its location, in no particular order.
    pub(super) fn iter(
        &self,
    ) -> impl Iterator<Item = (StateStoreId, ExecutorCacheTaskLocation)> + '_ {
        self.operators.iter().flat_map(|(key, slots)| {
            let dense = slots.dense.iter().enumerate().filter_map(move |(index, slot)| {
                // Dense indexes are below DENSE_PARTITION_LIMIT, so they fit an i32.
                let partition_id = i32::try_from(index).ok()?;
                slot.map(|location| (key.store_id(partition_id), location))
            });
            let sparse = slots
                .sparse
                .iter()
                .map(move |(partition_id, location)| (key.store_id(*partition_id), *location));
            dense.chain(sparse)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl InstanceTable {
        /// Dense slots allocated for `store_id`'s operator (tests).
        fn dense_slots(&self, store_id: &StateStoreId) -> usize {
            self.operators.get(&OperatorKey::of(store_id)).map_or(0, |slots| slots.dense.len())
        }

        /// Sparse entries and new slots the growths of `store_id`'s operator looked at.
        fn growth_visits(&self, store_id: &StateStoreId) -> usize {
            self.operators.get(&OperatorKey::of(store_id)).map_or(0, |slots| slots.growth_visits)
        }
    }

    /// Many partitions above the dense limit wait in the map for good; reports of partitions
    /// below it that grow the vector a few slots at a time (its room is short of doubling) cost
    /// their new slots, not a pass over all those waiting entries each.
    #[test]
    fn growing_the_vector_costs_its_new_slots_not_a_pass_over_every_sparse_entry() {
        let mut table = InstanceTable::default();
        let at = ExecutorCacheTaskLocation::new("h", "e");
        let store = |partition| StateStoreId::new("/many", 1, partition);
        const ABOVE: i32 = 20_000;
        for index in 0..ABOVE {
            table.insert(store(1_000_000 + index), at);
        }
        // Odd partitions: each is just past the vector's room, which grows by two slots.
        let reports = 2_000;
        for partition in (63..).step_by(2).take(reports) {
            table.insert(store(partition), at);
        }
        assert_eq!(table.len(), ABOVE as usize + reports);
        let visits = table.growth_visits(&store(0));
        assert!(visits <= 20 * reports, "{visits} visits for {reports} reports");
        for partition in (63..).step_by(2).take(reports) {
            assert_eq!(table.get(&store(partition)), Some(at), "partition {partition}");
        }
    }

    /// One report with a partition id far ahead costs one entry, not a vector up to it; ids
    /// that arrive out of order move into the vector as it grows over them, and every
    /// lookup finds them wherever they are.
    #[test]
    fn the_dense_vector_grows_with_its_entries_not_with_one_large_id() {
        let mut table = InstanceTable::default();
        let at = |executor| ExecutorCacheTaskLocation::new("h", executor);
        let store = |partition| StateStoreId::new("/grow", 1, partition);
        let far = DENSE_PARTITION_LIMIT as i32 - 1;
        assert_eq!(table.insert(store(far), at("far")), None);
        assert!(table.dense_slots(&store(0)) <= DENSE_SLACK, "{}", table.dense_slots(&store(0)));
        // Partitions arriving in reverse: the first land in the map, then move over.
        for partition in (0..1_000).rev() {
            assert_eq!(table.insert(store(partition), at("x")), None, "partition {partition}");
        }
        assert_eq!(table.len(), 1_001);
        for partition in 0..1_000 {
            assert_eq!(table.get(&store(partition)), Some(at("x")), "partition {partition}");
        }
        assert_eq!(table.get(&store(far)), Some(at("far")));
        // Everything below 1 000 moved into the vector, which stays within its bound.
        let slots = table.dense_slots(&store(0));
        assert!((1_000..=2 * 1_001 + DENSE_SLACK).contains(&slots), "{slots} dense slots");
        // A repeat of a moved partition replaces it, counted once.
        assert_eq!(table.insert(store(999), at("y")), Some(at("x")));
        assert_eq!(table.len(), 1_001);
        assert_eq!(table.iter().count(), 1_001);
    }

    #[test]
    fn dense_sparse_and_negative_partitions_are_kept_apart_and_counted_once() {
        let mut table = InstanceTable::default();
        let at = |executor| ExecutorCacheTaskLocation::new("h", executor);
        let store = |partition| StateStoreId::new("/t", 3, partition);
        assert_eq!(table.insert(store(5), at("a")), None);
        assert_eq!(table.insert(store(5), at("b")), Some(at("a")));
        assert_eq!(table.insert(store(i32::MAX), at("c")), None);
        assert_eq!(table.insert(store(-1), at("d")), None);
        assert_eq!(table.insert(store(DENSE_PARTITION_LIMIT as i32 - 1), at("e")), None);
        assert_eq!(table.len(), 4);
        assert_eq!(table.get(&store(5)), Some(at("b")));
        assert_eq!(table.get(&store(4)), None);
        assert_eq!(table.get(&store(6)), None);
        assert_eq!(table.get(&store(70_000)), None);
        assert_eq!(table.get(&store(i32::MAX)), Some(at("c")));
        assert_eq!(table.get(&store(-1)), Some(at("d")));
        assert_eq!(table.get(&StateStoreId::new("/t", 4, 5)), None);
        let mut all: Vec<_> = table.iter().collect();
        all.sort();
        assert_eq!(
            all,
            vec![
                (store(-1), at("d")),
                (store(5), at("b")),
                (store(DENSE_PARTITION_LIMIT as i32 - 1), at("e")),
                (store(i32::MAX), at("c")),
            ]
        );
    }
}
