//! One stream's queue of unallocated blocks, kept as chunks: the blocks of one journal record
//! (for this stream), with the record's LSN.
//!
//! Why chunks: a receiver hands over a record's blocks as one vector; queuing that vector as
//! it is costs no copy and no per-block allocation, and the queue grows by one entry per
//! record instead of one 100-byte entry per block (which, at millions of blocks per second,
//! made the tracker's thread spend most of its time growing and faulting in queue memory).
//!
//! Order: chunks are appended in arrival order. Hand-overs of concurrent receivers arrive as
//! interleaved runs, so the queue is sorted by LSN (a stable sort, linear on those runs)
//! whenever its order is observed: every observer sees log order, which is the order a replay
//! of the log queues the blocks in. Within a chunk the blocks keep their record order.

use std::collections::{HashMap, VecDeque};

use smallvec::SmallVec;

use super::{recycle::BlockVecPool, ReceivedBlockInfo};
use crate::wal::Lsn;

/// The blocks of one stream from one record (one block inline, the common single addition).
pub(super) type ChunkBlocks = SmallVec<[ReceivedBlockInfo; 1]>;

/// Blocks of one record, in record order; never empty while queued.
#[derive(Debug, Clone)]
struct Chunk {
    /// The record's LSN (`Lsn::ZERO` when the WAL is disabled: arrival order then).
    lsn: Lsn,
    blocks: ChunkBlocks,
}

/// Where a taken queue's chunks started, to put them back (`restore`).
pub(super) type Bounds = Vec<(Lsn, usize)>;

/// One stream's unallocated blocks (module doc).
#[derive(Debug, Default, Clone)]
pub(super) struct StreamQueue {
    chunks: VecDeque<Chunk>,
    /// Blocks over all chunks.
    len: usize,
    /// The chunks are known to be in LSN order.
    sorted: bool,
}

impl StreamQueue {
    /// Appends a record's blocks (nothing if empty).
    pub(super) fn push(&mut self, lsn: Lsn, blocks: ChunkBlocks) {
        if blocks.is_empty() {
            return;
        }
        let in_order = self.chunks.back().is_none_or(|last| last.lsn <= lsn);
        self.sorted = (self.sorted || self.chunks.is_empty()) && in_order;
        self.len += blocks.len();
        self.chunks.push_back(Chunk { lsn, blocks });
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The smallest LSN of a record with blocks queued here (without sorting the queue).
    pub(super) fn oldest_lsn(&self) -> Option<Lsn> {
        if self.sorted {
            return self.chunks.front().map(|chunk| chunk.lsn);
        }
        self.chunks.iter().map(|chunk| chunk.lsn).min()
    }

    /// The LSN of the oldest block queued (in log order).
    pub(super) fn oldest(&mut self) -> Option<Lsn> {
        self.sort();
        self.chunks.front().map(|chunk| chunk.lsn)
    }

    fn sort(&mut self) {
        if !self.sorted {
            self.chunks.make_contiguous().sort_by_key(|chunk| chunk.lsn);
            self.sorted = true;
        }
    }

    /// The blocks, in no particular order.
    pub(super) fn blocks(&self) -> impl Iterator<Item = &ReceivedBlockInfo> {
        self.chunks.iter().flat_map(|chunk| chunk.blocks.iter())
    }

    /// The blocks in log order (copies).
    pub(super) fn to_vec(&self) -> Vec<ReceivedBlockInfo> {
        let mut chunks: Vec<&Chunk> = self.chunks.iter().collect();
        if !self.sorted {
            chunks.sort_by_key(|chunk| chunk.lsn);
        }
        let mut blocks = Vec::with_capacity(self.len);
        for chunk in chunks {
            blocks.extend(chunk.blocks.iter().cloned());
        }
        blocks
    }

    /// Empties the queue into one vector in log order (the smallest of `spares` large enough,
    /// if any), plus the chunk bounds for `restore`. The emptied chunks' vectors go back to
    /// `recycled`.
    pub(super) fn take(
        &mut self,
        spares: &mut Vec<Vec<ReceivedBlockInfo>>,
        recycled: &BlockVecPool,
    ) -> (Vec<ReceivedBlockInfo>, Bounds) {
        self.sort();
        let len = std::mem::replace(&mut self.len, 0);
        self.sorted = true;
        let bounds = self.chunks.iter().map(|chunk| (chunk.lsn, chunk.blocks.len())).collect();
        // One spilled chunk (one receiver's record): its vector is the allocation's, no copy.
        if self.chunks.len() == 1 && self.chunks[0].blocks.spilled() {
            let chunk = self.chunks.pop_front().expect("one chunk");
            return (chunk.blocks.into_vec(), bounds);
        }
        // A quarter more than needed when new: the vector returns as a spare when its batch
        // is cleaned up, and then fits the next batches unless they are much larger.
        let mut blocks =
            take_fitting_spare(spares, len).unwrap_or_else(|| Vec::with_capacity(len + len / 4));
        // Drained, not taken: the chunk list keeps its memory for the next batch.
        for chunk in self.chunks.drain(..) {
            if chunk.blocks.spilled() {
                let mut vector = chunk.blocks.into_vec();
                blocks.append(&mut vector);
                recycled.give_back(vector);
            } else {
                blocks.extend(chunk.blocks);
            }
        }
        (blocks, bounds)
    }

    /// Puts blocks taken by `take` back in front of whatever was queued since.
    pub(super) fn restore(&mut self, blocks: Vec<ReceivedBlockInfo>, bounds: Bounds) {
        let newer = std::mem::take(self);
        let mut blocks = blocks.into_iter();
        for (lsn, count) in bounds {
            self.push(lsn, blocks.by_ref().take(count).collect());
        }
        for chunk in newer.chunks {
            self.push(chunk.lsn, chunk.blocks);
        }
    }

    /// Removes exactly the blocks in `listed` (by equality, each listed block once; SPEC
    /// D.4). An allocation normally lists a prefix of the queue, removed chunk by chunk.
    pub(super) fn remove_listed(&mut self, listed: &[ReceivedBlockInfo]) {
        if listed.is_empty() || self.is_empty() {
            return;
        }
        self.sort();
        let is_prefix = listed.len() <= self.len
            && self
                .chunks
                .iter()
                .flat_map(|chunk| chunk.blocks.iter())
                .zip(listed)
                .all(|(queued, block)| queued == block);
        if is_prefix {
            let mut left = listed.len();
            while left > 0 {
                let front = self.chunks.front_mut().expect("the prefix is queued");
                if front.blocks.len() <= left {
                    left -= front.blocks.len();
                    self.chunks.pop_front();
                } else {
                    front.blocks.drain(..left);
                    left = 0;
                }
            }
            self.len -= listed.len();
            return;
        }
        let mut counts: HashMap<&ReceivedBlockInfo, usize> = HashMap::with_capacity(listed.len());
        for block in listed {
            *counts.entry(block).or_default() += 1;
        }
        let mut removed = 0;
        for chunk in &mut self.chunks {
            chunk.blocks.retain(|queued| match counts.get_mut(&*queued) {
                Some(count) if *count > 0 => {
                    *count -= 1;
                    removed += 1;
                    false
                }
                _ => true,
            });
        }
        self.chunks.retain(|chunk| !chunk.blocks.is_empty());
        self.len -= removed;
    }
}

/// The smallest of `spares` with room for `len` blocks, emptied (a smaller one would be
/// reallocated, copying its unused capacity; a much larger one would sit in a small batch).
fn take_fitting_spare(
    spares: &mut Vec<Vec<ReceivedBlockInfo>>,
    len: usize,
) -> Option<Vec<ReceivedBlockInfo>> {
    let index = (0..spares.len())
        .filter(|index| spares[*index].capacity() >= len)
        .min_by_key(|index| spares[*index].capacity())?;
    let mut spare = spares.swap_remove(index);
    spare.clear();
    Some(spare)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinators::block_tracker::{BlockStoreResult, StreamBlockId, StreamId};

    fn info(unique_id: u64) -> ReceivedBlockInfo {
        let block_id = StreamBlockId { stream: StreamId(1), unique_id };
        ReceivedBlockInfo::new(StreamId(1), None, None, BlockStoreResult::BlockManager { block_id })
            .unwrap()
    }

    fn ids(blocks: &[ReceivedBlockInfo]) -> Vec<u64> {
        blocks.iter().map(|block| block.block_id().unique_id).collect()
    }

    fn queue(chunks: &[(u64, &[u64])]) -> StreamQueue {
        let mut queue = StreamQueue::default();
        for (lsn, blocks) in chunks {
            queue.push(Lsn(*lsn), blocks.iter().map(|id| info(*id)).collect());
        }
        queue
    }

    #[test]
    fn observers_see_log_order_whatever_the_arrival_order() {
        let mut queue = queue(&[(5, &[50, 51]), (3, &[30]), (7, &[70]), (4, &[40, 41])]);
        assert_eq!(ids(&queue.to_vec()), [30, 40, 41, 50, 51, 70]);
        let mut spares =
            vec![Vec::with_capacity(100), Vec::with_capacity(2), Vec::with_capacity(6)];
        let (taken, bounds) = queue.take(&mut spares, &BlockVecPool::default());
        assert_eq!(taken.capacity(), 6, "the smallest spare that fits");
        assert_eq!(spares.len(), 2, "the others stay spares");
        assert_eq!(ids(&taken), [30, 40, 41, 50, 51, 70]);
        assert!(queue.is_empty());
        queue.push(Lsn(9), [info(90)].into_iter().collect());
        queue.restore(taken, bounds);
        assert_eq!(ids(&queue.to_vec()), [30, 40, 41, 50, 51, 70, 90]);
    }

    #[test]
    fn remove_listed_handles_prefix_and_scattered_and_duplicates() {
        let mut queued = queue(&[(1, &[0, 1, 2]), (2, &[3, 4]), (3, &[5])]);
        queued.remove_listed(&[info(0), info(1)]);
        assert_eq!(ids(&queued.to_vec()), [2, 3, 4, 5]);
        queued.remove_listed(&[info(2), info(3), info(4)]);
        assert_eq!(ids(&queued.to_vec()), [5]);
        let mut queued = queue(&[(1, &[0, 1, 2, 3]), (2, &[4, 5])]);
        queued.remove_listed(&[info(5), info(3), info(9)]);
        assert_eq!(ids(&queued.to_vec()), [0, 1, 2, 4]);
        let mut queued = queue(&[(1, &[1]), (2, &[1, 2])]);
        queued.remove_listed(&[info(2), info(1)]);
        assert_eq!(ids(&queued.to_vec()), [1]);
        assert!(!queued.is_empty());
    }
}
