//! The tracker's data: identifiers, block infos, allocations and the journal events.
//!
//! Every type here is an rkyv record. Events go to the WAL in the compact layout of the
//! `journal` module and come back equal (SPEC 0.5). Equality of [`ReceivedBlockInfo`] ignores
//! its `block_id_valid` flag (SPEC D.1), and so does its hash, so recovery can remove "exactly
//! the listed blocks" by equality.

use std::hash::{Hash, Hasher};

use rkyv::util::AlignedVec;

use super::BlockTrackerError;
use crate::wal::RecordHandle;

/// An input stream's id (Spark's `streamId: Int`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct StreamId(pub i32);

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A batch time in milliseconds, ordered numerically (Spark's `Time`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct BatchTime(pub i64);

impl std::fmt::Display for BatchTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ms", self.0)
    }
}

/// A block's id: the stream it came from plus an id unique within the stream.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct StreamBlockId {
    /// The stream.
    pub stream: StreamId,
    /// Unique within the stream.
    pub unique_id: u64,
}

impl std::fmt::Display for StreamBlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "input-{}-{}", self.stream.0, self.unique_id)
    }
}

/// Where a receiver stored a block's data.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum BlockStoreResult {
    /// In an executor's block manager (lost with the executor; Spark's
    /// `BlockManagerBasedStoreResult`).
    BlockManager {
        /// The block.
        block_id: StreamBlockId,
    },
    /// In a receiver write-ahead log: the data can be read back through `handle`
    /// ([`super::ReceiverBlockStore::read`]), also after a driver restart.
    ReceiverWal {
        /// The block.
        block_id: StreamBlockId,
        /// Where the block's bytes are in the receiver's log.
        handle: RecordHandle,
    },
}

impl BlockStoreResult {
    /// The block's id.
    pub fn block_id(&self) -> StreamBlockId {
        match *self {
            Self::BlockManager { block_id } | Self::ReceiverWal { block_id, .. } => block_id,
        }
    }

    /// The data's record handle, if the block was stored in a receiver log.
    pub fn wal_handle(&self) -> Option<RecordHandle> {
        match *self {
            Self::BlockManager { .. } => None,
            Self::ReceiverWal { handle, .. } => Some(handle),
        }
    }
}

/// What a receiver reports about one stored block (SPEC D.1).
///
/// Equality and hashing ignore `block_id_valid`.
///
/// Laid out in 40 bytes: the tracker holds millions of these, and its queues, allocations and
/// the receivers' batches move them around. The parts a block kept in an executor's block
/// manager lacks (the receiver's metadata, a receiver-log handle) are boxed behind one
/// pointer, and the block id is kept as its parts; [`Self::store_result`] rebuilds the
/// [`BlockStoreResult`]. A block stored in a receiver log therefore costs a small allocation
/// per info (and per clone), next to the log write of its data.
#[derive(Debug, Clone, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ReceivedBlockInfo {
    stream_id: StreamId,
    /// The stream of the block's id (the info's own stream, except in odd reports).
    block_stream: StreamId,
    /// The unique id of the block's id.
    unique_id: u64,
    /// The record count, or [`NO_RECORD_COUNT`] (a count is never negative): 8 bytes instead
    /// of an `Option`'s 16.
    num_records: i64,
    /// `None` for the usual block: no metadata, stored in a block manager.
    rare: Option<Box<RareParts>>,
    block_id_valid: bool,
}

/// The parts of a [`ReceivedBlockInfo`] most blocks lack.
#[derive(Debug, Clone, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct RareParts {
    /// The receiver's opaque metadata.
    metadata: Option<Box<[u8]>>,
    /// Set when the block was stored in a receiver log.
    wal_handle: Option<RecordHandle>,
}

/// `ReceivedBlockInfo::num_records` when the count is unknown.
const NO_RECORD_COUNT: i64 = -1;

impl ReceivedBlockInfo {
    /// A block info; `block_id_valid` starts true.
    ///
    /// # Errors
    /// [`BlockTrackerError::NegativeNumRecords`] if `num_records` is negative.
    #[inline]
    pub fn new(
        stream_id: StreamId,
        num_records: Option<i64>,
        metadata: Option<Vec<u8>>,
        store_result: BlockStoreResult,
    ) -> Result<Self, BlockTrackerError> {
        let block_id = store_result.block_id();
        if let Some(count) = num_records {
            if count < 0 {
                return Err(BlockTrackerError::NegativeNumRecords { block_id, num_records: count });
            }
        }
        let wal_handle = store_result.wal_handle();
        let rare = (metadata.is_some() || wal_handle.is_some()).then(|| {
            Box::new(RareParts { metadata: metadata.map(Vec::into_boxed_slice), wal_handle })
        });
        Ok(Self {
            stream_id,
            block_stream: block_id.stream,
            unique_id: block_id.unique_id,
            num_records: num_records.unwrap_or(NO_RECORD_COUNT),
            rare,
            block_id_valid: true,
        })
    }

    /// Heap bytes of the parts most blocks lack (metadata, receiver-log handle); 0 for the
    /// usual block.
    pub(crate) fn rare_heap_bytes(&self) -> usize {
        self.rare.as_ref().map_or(0, |rare| {
            std::mem::size_of::<RareParts>() + rare.metadata.as_ref().map_or(0, |data| data.len())
        })
    }

    /// The stream the block belongs to.
    #[inline]
    pub fn stream_id(&self) -> StreamId {
        self.stream_id
    }

    /// Records in the block, if known (never negative).
    #[inline]
    pub fn num_records(&self) -> Option<i64> {
        (self.num_records != NO_RECORD_COUNT).then_some(self.num_records)
    }

    /// Opaque metadata of the receiver.
    #[inline]
    pub fn metadata(&self) -> Option<&[u8]> {
        self.rare.as_ref().and_then(|rare| rare.metadata.as_deref())
    }

    /// Where the data is.
    #[inline]
    pub fn store_result(&self) -> BlockStoreResult {
        let block_id = self.block_id();
        match self.rare.as_ref().and_then(|rare| rare.wal_handle) {
            Some(handle) => BlockStoreResult::ReceiverWal { block_id, handle },
            None => BlockStoreResult::BlockManager { block_id },
        }
    }

    /// The block's id.
    #[inline]
    pub fn block_id(&self) -> StreamBlockId {
        StreamBlockId { stream: self.block_stream, unique_id: self.unique_id }
    }

    /// Whether the executor-side block is presumed to exist (false after a driver recovery:
    /// the data must then come from the receiver log).
    #[inline]
    pub fn is_block_id_valid(&self) -> bool {
        self.block_id_valid
    }

    /// Sets the flag read by [`Self::is_block_id_valid`].
    pub fn set_block_id_valid(&mut self, valid: bool) {
        self.block_id_valid = valid;
    }
}

impl PartialEq for ReceivedBlockInfo {
    fn eq(&self, other: &Self) -> bool {
        self.stream_id == other.stream_id
            && self.block_stream == other.block_stream
            && self.unique_id == other.unique_id
            && self.num_records == other.num_records
            && self.rare == other.rare
    }
}

impl Eq for ReceivedBlockInfo {}

impl Hash for ReceivedBlockInfo {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.stream_id.hash(state);
        self.block_stream.hash(state);
        self.unique_id.hash(state);
        self.num_records.hash(state);
        self.rare.hash(state);
    }
}

/// The blocks of one stream inside an [`AllocatedBlocks`].
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct StreamBlocks {
    /// The stream.
    pub stream_id: StreamId,
    /// Its blocks, in the order they were added.
    pub blocks: Vec<ReceivedBlockInfo>,
}

/// The blocks allocated to one batch, per stream (SPEC D.1). A missing stream has no blocks.
///
/// Kept as a list sorted by stream id (an archived list is cheaper to validate than a map).
#[derive(
    Debug, Clone, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct AllocatedBlocks {
    /// Sorted by `stream_id`, each stream at most once.
    streams: Vec<StreamBlocks>,
}

impl AllocatedBlocks {
    /// Builds an allocation from `(stream, blocks)` pairs; a stream given twice keeps the
    /// blocks of both, in order.
    pub fn new(streams: impl IntoIterator<Item = (StreamId, Vec<ReceivedBlockInfo>)>) -> Self {
        use std::collections::btree_map::Entry;
        let mut map = std::collections::BTreeMap::<StreamId, Vec<ReceivedBlockInfo>>::new();
        for (stream_id, blocks) in streams {
            // A stream's first list is moved in, not copied (it can hold millions of blocks).
            match map.entry(stream_id) {
                Entry::Vacant(slot) => {
                    slot.insert(blocks);
                }
                Entry::Occupied(mut slot) => slot.get_mut().extend(blocks),
            }
        }
        Self {
            streams: map
                .into_iter()
                .map(|(stream_id, blocks)| StreamBlocks { stream_id, blocks })
                .collect(),
        }
    }

    /// The blocks of `stream` (empty if the stream is not in the allocation).
    pub fn blocks_of_stream(&self, stream: StreamId) -> &[ReceivedBlockInfo] {
        match self.streams.binary_search_by_key(&stream, |entry| entry.stream_id) {
            Ok(index) => &self.streams[index].blocks,
            Err(_) => &[],
        }
    }

    /// Every stream in the allocation (streams with no blocks included), by stream id.
    pub fn streams(&self) -> &[StreamBlocks] {
        &self.streams
    }

    /// Whether the allocation names no stream at all (Spark's empty map).
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Blocks over all streams.
    pub fn block_count(&self) -> usize {
        self.streams.iter().map(|entry| entry.blocks.len()).sum()
    }

    /// Consumes the allocation into its per-stream lists.
    pub fn into_streams(self) -> Vec<StreamBlocks> {
        self.streams
    }
}

/// A block was added (SPEC D.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockAdditionEvent {
    /// The block.
    pub info: ReceivedBlockInfo,
}

/// Several blocks were added together (one journal record for what SPEC D.2 calls one
/// `BlockAdditionEvent` per block): a receiver logs the blocks it has ready in one record, so
/// they share one LSN and one frame. Replay treats it exactly as that many additions in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockAdditionsEvent {
    /// The blocks, in the order they were added.
    pub infos: Vec<ReceivedBlockInfo>,
}

/// The unallocated blocks were allocated to a batch (SPEC D.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchAllocationEvent {
    /// The batch.
    pub time: BatchTime,
    /// What it got.
    pub blocks: AllocatedBlocks,
}

/// Batches were cleaned up (SPEC D.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchCleanupEvent {
    /// The batch times removed (possibly none).
    pub times: Vec<BatchTime>,
}

/// One journal record of the tracker. Its layout on disk is the compact one of the `journal`
/// module ([`TrackerEvent::encode`], [`TrackerEvent::decode`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrackerEvent {
    /// [`BlockAdditionEvent`].
    BlockAddition(BlockAdditionEvent),
    /// [`BlockAdditionsEvent`].
    BlockAdditions(BlockAdditionsEvent),
    /// [`BatchAllocationEvent`].
    BatchAllocation(BatchAllocationEvent),
    /// [`BatchCleanupEvent`].
    BatchCleanup(BatchCleanupEvent),
}

impl TrackerEvent {
    /// The event's kind, as Spark names it (for messages).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BlockAddition(_) => "BlockAdditionEvent",
            Self::BlockAdditions(_) => "BlockAdditionEvents",
            Self::BatchAllocation(_) => "BatchAllocationEvent",
            Self::BatchCleanup(_) => "BatchCleanupEvent",
        }
    }

    /// The number of SPEC D.2 events this record stands for (blocks for additions, else 1).
    pub fn event_count(&self) -> u64 {
        match self {
            Self::BlockAdditions(BlockAdditionsEvent { infos }) => infos.len() as u64,
            _ => 1,
        }
    }

    /// Serializes the event into its journal record (a fresh buffer).
    ///
    /// # Errors
    /// [`BlockTrackerError::Encode`] if serialization fails.
    pub fn encode(&self) -> Result<AlignedVec, BlockTrackerError> {
        super::journal::encode_into(self, AlignedVec::new())
    }

    /// Serializes the event into `buf` (cleared first; reuse it to save an allocation).
    ///
    /// # Errors
    /// [`BlockTrackerError::Encode`] if serialization fails.
    pub fn encode_into(&self, buf: AlignedVec) -> Result<AlignedVec, BlockTrackerError> {
        super::journal::encode_into(self, buf)
    }

    /// Validates `bytes` (a journal record read from the log) and decodes the event.
    ///
    /// # Errors
    /// [`BlockTrackerError::Decode`] if the bytes are not a valid event.
    pub fn decode(bytes: &[u8]) -> Result<Self, BlockTrackerError> {
        super::journal::decode(bytes)
    }
}
