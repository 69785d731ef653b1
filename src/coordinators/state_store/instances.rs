//! Where the active providers of one query run are loaded, laid out for the cache.
//!
//! A run's stores come in operators (checkpoint location, store name, operator id), and the
//! stores of one operator are its partitions, numbered densely from 0. So the table is a small
//! map from operator to a vector indexed by partition id: a lookup hashes three words of a map
//! that has one entry per operator (it stays in the first-level cache), then indexes a vector of
//! 16-byte slots in which neighbouring partitions share cache lines. That is several times less
//! memory touched per report than one hash map keyed by the whole store id.
//!
//! Partition ids at or above [`DENSE_PARTITION_LIMIT`] go to a per-operator hash map instead,
//! so a stray huge partition id costs one map entry, not a huge vector. The dense vector of an
//! operator is therefore at most `DENSE_PARTITION_LIMIT` slots (1 MiB).

use rustc_hash::FxHashMap;

use super::ids::{ExecutorCacheTaskLocation, Name, StateStoreId};

/// Partition ids below this are kept in the dense vector of their operator.
pub(super) const DENSE_PARTITION_LIMIT: usize = 1 << 16;

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
    /// Slot `p` holds partition `p` (`p < DENSE_PARTITION_LIMIT`); `None` where not active.
    dense: Vec<Option<ExecutorCacheTaskLocation>>,
    /// Partitions outside the dense range (huge or negative ids).
    sparse: FxHashMap<i32, ExecutorCacheTaskLocation>,
}

/// Dense-vector index of `partition_id`, if it belongs in the dense range.
#[inline]
fn dense_index(partition_id: i32) -> Option<usize> {
    usize::try_from(partition_id).ok().filter(|index| *index < DENSE_PARTITION_LIMIT)
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
        let previous = match dense_index(store_id.partition_id) {
            Some(index) => {
                if index >= slots.dense.len() {
                    slots.dense.resize(index + 1, None);
                }
                slots.dense[index].replace(location)
            }
            None => slots.sparse.insert(store_id.partition_id, location),
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
        match dense_index(store_id.partition_id) {
            Some(index) => slots.dense.get(index).copied().flatten(),
            None => slots.sparse.get(&store_id.partition_id).copied(),
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
