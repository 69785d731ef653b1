//! The largest block the tracker takes: one whose allocation record, listing it alone, fits
//! the log.
//!
//! # Why
//! A block's metadata is the receiver's opaque bytes, of any length. Its addition record may
//! fit the log while an allocation record listing it does not: the allocation lists every
//! configured stream and its batch time besides the block. Such a block could be acknowledged
//! and then never allocated: as the oldest unallocated block it would hold up every later
//! allocation (which takes the streams with the oldest blocks first when a record is too
//! large). So an addition of a block whose metadata is longer than [`BlockSizeLimit`] allows
//! is refused up front, like any addition the log refuses: `false`, nothing changed, and a
//! warning naming the block, its length and the limit (for the first refusal and then at each
//! power of two).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    AllocatedBlocks, BatchAllocationEvent, BatchTime, BlockLog, BlockStoreResult,
    BlockTrackerError, ReceivedBlockInfo, StreamBlockId, StreamId, TrackerEvent,
};
use crate::wal::{RecordHandle, SegmentId};

/// Bytes of slack for the padding after metadata in the encoded record (at most 7: what
/// follows is 8-aligned), with room to spare: the limit errs by at most this much on the safe
/// side for a block whose fields code longest, and more for others (small ids code shorter).
const PADDING_SLACK: usize = 16;

/// Blocks refused for their size, by every tracker of the process: a warning is logged for
/// the first and then at each power of two, not for each (a receiver could send thousands).
static REFUSED_BLOCKS: AtomicU64 = AtomicU64::new(0);

/// The longest metadata a block may carry (`None`: any, the log has no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BlockSizeLimit {
    metadata_bytes_max: Option<usize>,
}

impl BlockSizeLimit {
    /// The limit for a tracker over `log` allocating `stream_ids`: the log's largest record
    /// less an allocation record of every stream in which one holds one block with empty
    /// metadata and every other field as long as it codes (`allocation_of_one_block_bytes`),
    /// less the slack.
    ///
    /// # Errors
    /// [`BlockTrackerError::StreamsExceedLog`] if that allocation alone exceeds the log's
    /// largest record: no block could ever be allocated.
    pub(super) fn of(
        log: Option<&dyn BlockLog>,
        stream_ids: &[StreamId],
    ) -> Result<Self, BlockTrackerError> {
        let Some(max_event_bytes) = log.and_then(BlockLog::max_event_bytes) else {
            return Ok(Self { metadata_bytes_max: None });
        };
        let allocation_bytes = allocation_of_one_block_bytes(stream_ids)? + PADDING_SLACK;
        match max_event_bytes.checked_sub(allocation_bytes) {
            Some(metadata_bytes_max) => Ok(Self { metadata_bytes_max: Some(metadata_bytes_max) }),
            None => Err(BlockTrackerError::StreamsExceedLog {
                streams: stream_ids.len(),
                allocation_bytes,
                max_event_bytes,
            }),
        }
    }

    /// The longest metadata a block may carry, if limited.
    pub(super) fn metadata_bytes_max(self) -> Option<usize> {
        self.metadata_bytes_max
    }

    /// Whether `info` is too large to be allocated (module doc); a refusal is logged.
    #[inline]
    pub(super) fn refuses(self, info: &ReceivedBlockInfo) -> bool {
        let (Some(max), Some(metadata)) = (self.metadata_bytes_max, info.metadata()) else {
            return false;
        };
        let refused = metadata.len() > max;
        if refused {
            let count = REFUSED_BLOCKS.fetch_add(1, Ordering::Relaxed) + 1;
            if count.is_power_of_two() {
                tracing::warn!(
                    block = %info.block_id(),
                    metadata_bytes = metadata.len(),
                    metadata_bytes_max = max,
                    refused_so_far = count,
                    "a block whose metadata is too large to be allocated from the log is refused"
                );
            }
        }
        refused
    }

    /// Whether a receiver's pending batch counted at `pending_bytes` ([`batch_bytes`] of its
    /// blocks) may take a block counted at `more_bytes` and still make a record the log takes:
    /// the count stays within the limit, which is less than the log's largest record.
    #[inline]
    pub(super) fn combines(self, pending_bytes: usize, more_bytes: usize) -> bool {
        self.metadata_bytes_max.is_none_or(|max| pending_bytes + more_bytes <= max)
    }

    /// Whether one of `infos` is one [`Self::refuses`].
    pub(super) fn refuses_any(self, infos: &[ReceivedBlockInfo]) -> bool {
        infos.iter().any(|info| self.refuses(info))
    }

    /// Whether `event` adds a block [`Self::refuses`].
    pub(super) fn refuses_event(self, event: &TrackerEvent) -> bool {
        match event {
            TrackerEvent::BlockAddition(addition) => self.refuses(&addition.info),
            TrackerEvent::BlockAdditions(additions) => self.refuses_any(&additions.infos),
            TrackerEvent::BatchAllocation(_) | TrackerEvent::BatchCleanup(_) => false,
        }
    }
}

/// The most bytes a block's fixed part takes in an additions record: its coded fields (at most
/// 25 bytes of flags and varints) and its extra (index, block stream, the metadata's and the
/// handle's options), rounded up to the extras' alignment (`tests` measures it).
const BLOCK_FIXED_BYTES_MAX: usize = 96;

/// What a block counts for in a receiver's pending batch ([`BlockSizeLimit::combines`]): its
/// metadata and the most its fixed part takes.
#[inline]
pub(super) fn batch_bytes(info: &ReceivedBlockInfo) -> usize {
    metadata_bytes(info) + BLOCK_FIXED_BYTES_MAX
}

/// The length of `info`'s metadata (0 without any).
#[inline]
pub(super) fn metadata_bytes(info: &ReceivedBlockInfo) -> usize {
    info.metadata().map_or(0, <[u8]>::len)
}

/// The encoded size of an allocation of every stream of `stream_ids` (or of one stream, if
/// there is none) in which one stream holds one block with empty metadata whose every other
/// field codes as long as it can: stream and unique ids whose zigzag deltas take the longest
/// varints, the largest record count, a receiver-log handle and another stream in its id.
fn allocation_of_one_block_bytes(stream_ids: &[StreamId]) -> Result<usize, BlockTrackerError> {
    let stream = stream_ids.first().copied().unwrap_or(StreamId(0));
    let longest_stream = StreamId(i32::MIN);
    let block_id = StreamBlockId { stream: longest_stream, unique_id: 1 << 63 };
    let handle = RecordHandle { segment: SegmentId(u32::MAX), offset: u64::MAX, len: u32::MAX };
    let store_result = BlockStoreResult::ReceiverWal { block_id, handle };
    let block =
        ReceivedBlockInfo::new(longest_stream, Some(i64::MAX), Some(Vec::new()), store_result)?;
    let others = stream_ids.iter().skip(1).map(|other| (*other, Vec::new()));
    let blocks = AllocatedBlocks::new(std::iter::once((stream, vec![block])).chain(others));
    let event =
        TrackerEvent::BatchAllocation(BatchAllocationEvent { time: BatchTime(i64::MAX), blocks });
    Ok(event.encode_into(rkyv::util::AlignedVec::new())?.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinators::block_tracker::BlockAdditionsEvent;

    fn longest_block(unique_id: u64) -> ReceivedBlockInfo {
        let block_id = StreamBlockId { stream: StreamId(i32::MAX), unique_id };
        let handle = RecordHandle { segment: SegmentId(u32::MAX), offset: u64::MAX, len: u32::MAX };
        let store_result = BlockStoreResult::ReceiverWal { block_id, handle };
        ReceivedBlockInfo::new(StreamId(i32::MIN), Some(i64::MAX), Some(Vec::new()), store_result)
            .unwrap()
    }

    fn additions_bytes(blocks: usize) -> usize {
        // Unique ids alternating between the extremes: every delta codes in 10 bytes.
        let infos = (0..blocks)
            .map(|index| longest_block(if index % 2 == 0 { 1 << 63 } else { 0 }))
            .collect();
        let event = TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos });
        event.encode_into(rkyv::util::AlignedVec::new()).unwrap().len()
    }

    /// A block whose every field codes longest adds at most `BLOCK_FIXED_BYTES_MAX` bytes to
    /// an additions record besides its metadata.
    #[test]
    fn a_block_s_fixed_part_in_an_additions_record_is_within_its_bound() {
        let one = additions_bytes(1);
        let many = additions_bytes(257);
        let per_block = (many - one).div_ceil(256);
        assert!(per_block <= BLOCK_FIXED_BYTES_MAX, "{per_block} bytes per block");
        assert!(one <= 2 * BLOCK_FIXED_BYTES_MAX, "{one} bytes for one block");
    }
}
