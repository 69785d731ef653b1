//! Recycled block vectors: receivers fill them, the tracker empties them and hands them back.
//!
//! Why: a [`super::BlockReceiver`] logs its blocks in records of up to
//! [`super::COMBINE_MAX_BLOCKS`] and hands each record's vector to the tracker's thread, which
//! keeps it until the blocks are allocated to a batch and then empties it. Allocated on one
//! thread and freed on another, a few thousand times a second, those vectors kept the
//! allocator returning memory to the system and faulting fresh pages back in (mimalloc, 2
//! receivers, 4 M additions: 46 k page faults, and clearing fresh pages took a sixth of the
//! receivers' time). The tracker gives emptied vectors back to this pool instead, and a
//! receiver takes one when it starts a batch.
//!
//! Bounded: at most [`POOL_VECTORS`] vectors of one to two batch sizes are kept (at most
//! ~21 MB of 40-byte blocks); the rest are freed as before. Lock-free: crossbeam's bounded
//! `ArrayQueue`, used directly (not through `crate::sync`): the loom models cover the
//! crate's own protocols, and this is a plain queue of owned values.

use crossbeam_queue::ArrayQueue;

use super::{receiver::COMBINE_MAX_BLOCKS, ReceivedBlockInfo};

/// Most vectors the pool keeps.
pub(super) const POOL_VECTORS: usize = 1024;

/// Empty block vectors with room for a receiver's batch (module doc).
#[derive(Debug)]
pub(crate) struct BlockVecPool {
    vectors: ArrayQueue<Vec<ReceivedBlockInfo>>,
}

impl Default for BlockVecPool {
    fn default() -> Self {
        Self { vectors: ArrayQueue::new(POOL_VECTORS) }
    }
}

impl BlockVecPool {
    /// An empty vector with room for at least [`COMBINE_MAX_BLOCKS`] blocks.
    pub(super) fn take(&self) -> Vec<ReceivedBlockInfo> {
        self.vectors.pop().unwrap_or_else(|| Vec::with_capacity(COMBINE_MAX_BLOCKS))
    }

    /// Takes back `vector`, emptied; freed instead if the pool is full or the vector's size is
    /// not a batch's (a caller's vector of a few blocks, or of a whole allocation).
    pub(super) fn give_back(&self, mut vector: Vec<ReceivedBlockInfo>) {
        if (COMBINE_MAX_BLOCKS..=2 * COMBINE_MAX_BLOCKS).contains(&vector.capacity()) {
            vector.clear();
            // A full pool hands the vector back, and it is freed here.
            let _ = self.vectors.push(vector);
        }
    }

    /// Vectors kept now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.vectors.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_batch_sized_vectors_and_at_most_pool_vectors() {
        let pool = BlockVecPool::default();
        pool.give_back(Vec::with_capacity(4));
        pool.give_back(Vec::with_capacity(100 * COMBINE_MAX_BLOCKS));
        assert_eq!(pool.len(), 0, "vectors of other sizes are freed");
        for _ in 0..POOL_VECTORS + 10 {
            pool.give_back(Vec::with_capacity(COMBINE_MAX_BLOCKS));
        }
        assert_eq!(pool.len(), POOL_VECTORS);
        let vector = pool.take();
        assert!(vector.is_empty() && vector.capacity() >= COMBINE_MAX_BLOCKS);
        assert_eq!(pool.len(), POOL_VECTORS - 1);
    }

    #[test]
    fn an_empty_pool_allocates_a_batch_sized_vector() {
        let vector = BlockVecPool::default().take();
        assert!(vector.is_empty() && vector.capacity() >= COMBINE_MAX_BLOCKS);
    }
}
