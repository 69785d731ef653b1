//! The journal's record layout: compact rkyv records for the tracker's events.
//!
//! [`TrackerEvent`] is the vocabulary (SPEC D.2); this module is how an event is laid out in
//! one WAL record. Archiving the events as they are costs 112 payload bytes (144 framed) per
//! block addition: every `Option` and the store-result enum carry tags and padding, and the
//! stream id is written twice. At millions of synced additions per second the disk's write
//! bandwidth is the bound (a group's write and sync time grows with its bytes), so blocks are
//! packed instead:
//!
//! * a record of one block holds a [`PackedBlock`] of 24 bytes: unique id, record count (`-1`
//!   for none: a count is never negative), stream id and flags;
//! * a record of several blocks (a receiver's batch, an allocation) codes each block as a
//!   flags byte and varints: the stream id and the unique id as zigzag deltas from the
//!   previous block, then the record count. Blocks of one receiver have nearly consecutive
//!   ids and few streams, so a block takes about 4 bytes;
//! * what most blocks lack (metadata, a receiver-log handle, a block id whose stream differs
//!   from the info's stream) goes to a sparse side list of [`BlockExtra`]s, named by index and
//!   flagged on the block;
//! * every variant of the root enum is boxed, so the root is 8 bytes.
//!
//! Sizes (payload, then framed with the WAL's 32-byte header and 16-byte padding), for blocks
//! without extras:
//!
//! | record                               | payload bytes     | framed bytes            |
//! |--------------------------------------|-------------------|-------------------------|
//! | one block (`Block`)                  | 32                | 64                      |
//! | n blocks (`Blocks`)                  | about 4 n + 32    | about 4 n + 64          |
//! | allocation of n blocks in s streams  | about 4 n + 24 s  | about 4 n + 24 s + 48   |
//!
//! A record is one event, except `Blocks`, which is one [`BlockAdditionsEvent`] (several
//! additions logged together by a receiver: each block is still one addition event of SPEC
//! D.2, they only share a record and its LSN). Decoding validates everything an encoder
//! guarantees (flags, extra indices, varint lengths, ranges, no trailing bytes), so every
//! record round-trips exactly and a damaged one is an error, never a panic.
//!
//! The layout carries no version tag. It changed twice before any release (archived events
//! became packed ones, then packed block lists became coded ones); a journal written by such
//! an earlier build fails recovery with a decoding error (`BlockTrackerError::Decode`), it is
//! never misread. A future change of the layout needs a tag, or a new root variant, to keep
//! reading the journals written by this one.

use rkyv::{rancor, util::AlignedVec, with::AsBox};

use super::{
    AllocatedBlocks, BatchAllocationEvent, BatchCleanupEvent, BatchTime, BlockAdditionEvent,
    BlockAdditionsEvent, BlockStoreResult, BlockTrackerError, ReceivedBlockInfo, StreamBlockId,
    StreamId, TrackerEvent,
};
use crate::wal::RecordHandle;

/// The block's `block_id_valid` flag is false.
const FLAG_INVALID: u32 = 1;
/// The block has an entry in the record's extras.
const FLAG_EXTRA: u32 = 2;
/// The block has a record count (coded blocks only; a [`PackedBlock`] uses [`NO_COUNT`]).
const FLAG_COUNT: u32 = 4;
/// Every flag an encoder sets.
const FLAGS_KNOWN: u32 = FLAG_INVALID | FLAG_EXTRA | FLAG_COUNT;
/// `num_records` of a block whose count is unknown.
const NO_COUNT: i64 = -1;

/// A block in 24 bytes.
#[derive(rkyv::Archive, rkyv::Serialize)]
struct PackedBlock {
    unique_id: u64,
    /// The record count, or [`NO_COUNT`].
    num_records: i64,
    stream_id: i32,
    /// [`FLAG_INVALID`], [`FLAG_EXTRA`].
    flags: u32,
}

/// What a block with [`FLAG_EXTRA`] has beyond its [`PackedBlock`].
#[derive(rkyv::Archive, rkyv::Serialize)]
struct BlockExtra {
    /// Index of the block in its list.
    index: u32,
    /// The stream of the block's id.
    block_stream: i32,
    metadata: Option<Vec<u8>>,
    /// Set iff the block was stored in a receiver log.
    handle: Option<RecordHandle>,
}

/// Blocks in order, delta- and varint-coded (`put_block`), plus the extras of those that have
/// one (by increasing index).
#[derive(rkyv::Archive, rkyv::Serialize, Default)]
struct PackedBlocks {
    /// The number of blocks in `coded`.
    count: u32,
    /// Per block: flags byte, stream id delta (zigzag varint), unique id delta (wrapping,
    /// zigzag varint), record count (varint, present iff [`FLAG_COUNT`]).
    coded: Vec<u8>,
    extras: Vec<BlockExtra>,
}

/// The blocks of one stream in an allocation.
#[derive(rkyv::Archive, rkyv::Serialize)]
struct PackedStream {
    stream_id: i32,
    blocks: PackedBlocks,
}

/// A batch allocation.
#[derive(rkyv::Archive, rkyv::Serialize)]
struct PackedAllocation {
    time: i64,
    /// By increasing stream id, each stream once.
    streams: Vec<PackedStream>,
}

/// The root of every journal record.
#[derive(rkyv::Archive, rkyv::Serialize)]
enum JournalRecord {
    /// A [`BlockAdditionEvent`] whose block has no extra.
    Block(#[rkyv(with = AsBox)] PackedBlock),
    /// A [`BlockAdditionEvent`] whose block has an extra (exactly one block).
    BlockWithExtra(#[rkyv(with = AsBox)] PackedBlocks),
    /// A [`BlockAdditionsEvent`].
    Blocks(#[rkyv(with = AsBox)] PackedBlocks),
    /// A [`BatchAllocationEvent`].
    Allocation(#[rkyv(with = AsBox)] PackedAllocation),
    /// A [`BatchCleanupEvent`]: the batch times.
    Cleanup(#[rkyv(with = AsBox)] Vec<i64>),
}

fn needs_extra(info: &ReceivedBlockInfo) -> bool {
    info.metadata().is_some()
        || info.store_result().wal_handle().is_some()
        || info.block_id().stream != info.stream_id()
}

fn pack_block(info: &ReceivedBlockInfo, extra: bool) -> PackedBlock {
    let mut flags = 0;
    if !info.is_block_id_valid() {
        flags |= FLAG_INVALID;
    }
    if extra {
        flags |= FLAG_EXTRA;
    }
    PackedBlock {
        unique_id: info.block_id().unique_id,
        num_records: info.num_records().unwrap_or(NO_COUNT),
        stream_id: info.stream_id().0,
        flags,
    }
}

fn zigzag(value: i64) -> u64 {
    ((value << 1) ^ (value >> 63)) as u64
}

fn unzigzag(value: u64) -> i64 {
    ((value >> 1) as i64) ^ -((value & 1) as i64)
}

fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push(value as u8 | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

/// The previous block's stream and unique id: the base of the next block's deltas.
#[derive(Default, Clone, Copy)]
struct Previous {
    stream: i32,
    unique_id: u64,
}

/// Appends one block's coded form. Blocks of a batch usually come from a few streams with
/// nearly consecutive ids and small counts: about 4 bytes each.
#[inline]
fn put_block(buf: &mut Vec<u8>, previous: &mut Previous, info: &ReceivedBlockInfo, extra: bool) {
    let mut flags = pack_block(info, extra).flags;
    let count = info.num_records();
    if count.is_some() {
        flags |= FLAG_COUNT;
    }
    let stream = info.stream_id().0;
    let unique_id = info.block_id().unique_id;
    let stream_delta = zigzag(i64::from(stream) - i64::from(previous.stream));
    let id_delta = zigzag(unique_id.wrapping_sub(previous.unique_id) as i64);
    *previous = Previous { stream, unique_id };
    // Flags fit a byte (FLAGS_KNOWN < 256); a count is never negative (checked by
    // `ReceivedBlockInfo::new`).
    let flags = flags as u8;
    let count = count.map(|count| count as u64);
    // The common block (next of its receiver, small count) has one-byte varints: written in
    // one fixed-size append, the same bytes as the general path below.
    if (stream_delta | id_delta | count.unwrap_or(0)) < 0x80 {
        match count {
            Some(count) => {
                buf.extend_from_slice(&[flags, stream_delta as u8, id_delta as u8, count as u8]);
            }
            None => buf.extend_from_slice(&[flags, stream_delta as u8, id_delta as u8]),
        }
        return;
    }
    put_coded_fields(buf, flags, stream_delta, id_delta, count);
}

/// [`put_block`]'s general case: the fields as varints of any length.
#[inline(never)]
fn put_coded_fields(
    buf: &mut Vec<u8>,
    flags: u8,
    stream_delta: u64,
    id_delta: u64,
    count: Option<u64>,
) {
    buf.push(flags);
    put_varint(buf, stream_delta);
    put_varint(buf, id_delta);
    if let Some(count) = count {
        put_varint(buf, count);
    }
}

/// Packs the blocks of `lists`, one list after the other.
fn pack_blocks(lists: &[&[ReceivedBlockInfo]]) -> PackedBlocks {
    let count = lists.iter().map(|list| list.len()).sum::<usize>();
    let mut packed = PackedBlocks {
        // Lists longer than u32::MAX blocks cannot fit a record (4 GiB payload limit).
        count: count as u32,
        coded: Vec::with_capacity(count * 5),
        extras: Vec::new(),
    };
    let mut previous = Previous::default();
    let mut index = 0;
    for list in lists {
        for info in *list {
            let extra = needs_extra(info);
            put_block(&mut packed.coded, &mut previous, info, extra);
            if extra {
                packed.extras.push(BlockExtra {
                    index: index as u32,
                    block_stream: info.block_id().stream.0,
                    metadata: info.metadata().map(<[u8]>::to_vec),
                    handle: info.store_result().wal_handle(),
                });
            }
            index += 1;
        }
    }
    packed
}

/// Reads coded blocks; every read is bounds-checked (the bytes come from disk).
struct Cursor<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl Cursor<'_> {
    fn byte(&mut self) -> Result<u8, BlockTrackerError> {
        let byte = *self.bytes.get(self.position).ok_or_else(|| {
            bad(format!("coded blocks end early at byte {} of {}", self.position, self.bytes.len()))
        })?;
        self.position += 1;
        Ok(byte)
    }

    fn varint(&mut self) -> Result<u64, BlockTrackerError> {
        let start = self.position;
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.byte()?;
            let bits = u64::from(byte & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(bad(format!("varint at byte {start} overflows 64 bits")));
            }
            value |= bits << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(bad(format!("varint at byte {start} is longer than 10 bytes")))
    }
}

fn pack(event: &TrackerEvent) -> JournalRecord {
    match event {
        TrackerEvent::BlockAddition(BlockAdditionEvent { info }) => {
            if needs_extra(info) {
                JournalRecord::BlockWithExtra(pack_blocks(&[std::slice::from_ref(info)]))
            } else {
                JournalRecord::Block(pack_block(info, false))
            }
        }
        TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos }) => {
            JournalRecord::Blocks(pack_blocks(&[infos]))
        }
        TrackerEvent::BatchAllocation(BatchAllocationEvent { time, blocks }) => {
            JournalRecord::Allocation(PackedAllocation {
                time: time.0,
                streams: blocks
                    .streams()
                    .iter()
                    .map(|entry| PackedStream {
                        stream_id: entry.stream_id.0,
                        blocks: pack_blocks(&[&entry.blocks]),
                    })
                    .collect(),
            })
        }
        TrackerEvent::BatchCleanup(BatchCleanupEvent { times }) => {
            JournalRecord::Cleanup(times.iter().map(|time| time.0).collect())
        }
    }
}

/// Serializes `event` into `buf` (cleared first) and returns it.
///
/// # Errors
/// [`BlockTrackerError::Decode`] never; [`BlockTrackerError::Encode`] if rkyv fails.
pub(super) fn encode_into(
    event: &TrackerEvent,
    buf: AlignedVec,
) -> Result<AlignedVec, BlockTrackerError> {
    serialize(&pack(event), buf)
}

/// Serializes the [`BlockAdditionsEvent`] of the blocks of `groups` taken one after the
/// other into `buf` (cleared first), without gathering them into one vector first: the record
/// a receiver logs when it keeps its pending blocks by stream. The same bytes as the event.
///
/// # Errors
/// As [`encode_into`].
pub(super) fn encode_additions_into(
    groups: &[&[ReceivedBlockInfo]],
    buf: AlignedVec,
) -> Result<AlignedVec, BlockTrackerError> {
    serialize(&JournalRecord::Blocks(pack_blocks(groups)), buf)
}

fn serialize(record: &JournalRecord, mut buf: AlignedVec) -> Result<AlignedVec, BlockTrackerError> {
    buf.clear();
    rkyv::api::high::to_bytes_in::<_, rancor::Error>(record, buf)
        .map_err(|error| BlockTrackerError::Encode { message: error.to_string() })
}

fn bad(message: impl Into<String>) -> BlockTrackerError {
    BlockTrackerError::Decode { message: message.into() }
}

fn unpack_block(
    block: &ArchivedPackedBlock,
    extra: Option<&ArchivedBlockExtra>,
) -> Result<ReceivedBlockInfo, BlockTrackerError> {
    let block = PackedBlock {
        unique_id: block.unique_id.to_native(),
        num_records: block.num_records.to_native(),
        stream_id: block.stream_id.to_native(),
        flags: block.flags.to_native(),
    };
    if block.flags & FLAG_COUNT != 0 {
        return Err(bad(format!(
            "block {} has a coded-only flag (flags {:#x})",
            block.unique_id, block.flags
        )));
    }
    unpack_native_block(&block, extra)
}

fn unpack_native_block(
    block: &PackedBlock,
    extra: Option<&ArchivedBlockExtra>,
) -> Result<ReceivedBlockInfo, BlockTrackerError> {
    let flags = block.flags;
    let unique_id = block.unique_id;
    if flags & !FLAGS_KNOWN != 0 {
        return Err(bad(format!("block {unique_id} has unknown flags {flags:#x}")));
    }
    if (flags & FLAG_EXTRA != 0) != extra.is_some() {
        let (flag, extras) =
            if extra.is_some() { ("not set", "present") } else { ("set", "absent") };
        return Err(bad(format!(
            "block {unique_id}: the extra flag is {flag} (flags {flags:#x}) but extras are {extras}"
        )));
    }
    let stream = StreamId(block.stream_id);
    let num_records = match block.num_records {
        NO_COUNT => None,
        count if count >= 0 => Some(count),
        count => return Err(bad(format!("block {unique_id} has record count {count}"))),
    };
    let (block_stream, metadata, handle) = match extra {
        None => (stream, None, None),
        Some(extra) => (
            StreamId(extra.block_stream.to_native()),
            extra.metadata.as_ref().map(|bytes| bytes.as_slice().to_vec()),
            extra.handle.as_ref().map(|handle| handle.to_native()),
        ),
    };
    let block_id = StreamBlockId { stream: block_stream, unique_id };
    let store_result = match handle {
        None => BlockStoreResult::BlockManager { block_id },
        Some(handle) => BlockStoreResult::ReceiverWal { block_id, handle },
    };
    let mut info = ReceivedBlockInfo::new(stream, num_records, metadata, store_result)?;
    info.set_block_id_valid(flags & FLAG_INVALID == 0);
    Ok(info)
}

/// Decodes the next coded block; `extra` is its entry in the extras, if it has one.
fn take_block(
    cursor: &mut Cursor<'_>,
    previous: &mut Previous,
    extra: Option<&ArchivedBlockExtra>,
) -> Result<ReceivedBlockInfo, BlockTrackerError> {
    let flags = u32::from(cursor.byte()?);
    let delta = unzigzag(cursor.varint()?);
    let stream = i64::from(previous.stream)
        .checked_add(delta)
        .and_then(|stream| i32::try_from(stream).ok())
        .ok_or_else(|| {
            bad(format!("coded stream id {} + {delta} is out of range", previous.stream))
        })?;
    let unique_id = previous.unique_id.wrapping_add(unzigzag(cursor.varint()?) as u64);
    let num_records = if flags & FLAG_COUNT != 0 {
        let count = cursor.varint()?;
        i64::try_from(count)
            .map_err(|_| bad(format!("block {unique_id} has record count {count}")))?
    } else {
        NO_COUNT
    };
    *previous = Previous { stream, unique_id };
    let block =
        PackedBlock { unique_id, num_records, stream_id: stream, flags: flags & !FLAG_COUNT };
    unpack_native_block(&block, extra)
}

fn unpack_blocks(
    packed: &ArchivedPackedBlocks,
) -> Result<Vec<ReceivedBlockInfo>, BlockTrackerError> {
    let count = packed.count.to_native() as usize;
    let coded = packed.coded.as_slice();
    // Every coded block takes at least 3 bytes: no allocation beyond what the bytes justify.
    if count > coded.len() / 3 {
        return Err(bad(format!("{count} blocks cannot fit {} coded bytes", coded.len())));
    }
    let mut cursor = Cursor { bytes: coded, position: 0 };
    let mut previous = Previous::default();
    let mut extras = packed.extras.iter().peekable();
    let mut infos = Vec::with_capacity(count);
    for index in 0..count {
        let extra = match extras.peek() {
            Some(extra) if extra.index.to_native() as usize == index => extras.next(),
            _ => None,
        };
        infos.push(take_block(&mut cursor, &mut previous, extra)?);
    }
    if let Some(extra) = extras.next() {
        return Err(bad(format!(
            "an extra names block {} of {count} blocks, out of order or out of range",
            extra.index.to_native(),
        )));
    }
    if cursor.position != coded.len() {
        return Err(bad(format!(
            "{} bytes follow the {count} coded blocks",
            coded.len() - cursor.position
        )));
    }
    Ok(infos)
}

/// Validates `bytes` (one record's payload) and decodes its event.
///
/// # Errors
/// [`BlockTrackerError::Decode`] if the bytes are not a valid journal record.
pub(super) fn decode(bytes: &[u8]) -> Result<TrackerEvent, BlockTrackerError> {
    let record =
        crate::record::access::<JournalRecord>(bytes).map_err(|error| bad(error.to_string()))?;
    Ok(match record {
        ArchivedJournalRecord::Block(block) => {
            TrackerEvent::BlockAddition(BlockAdditionEvent { info: unpack_block(block, None)? })
        }
        ArchivedJournalRecord::BlockWithExtra(packed) => {
            let mut infos = unpack_blocks(packed)?;
            if infos.len() != 1 || packed.extras.len() != 1 {
                return Err(bad(format!(
                    "a single-block record holds {} blocks and {} extras",
                    infos.len(),
                    packed.extras.len()
                )));
            }
            TrackerEvent::BlockAddition(BlockAdditionEvent { info: infos.pop().expect("one") })
        }
        ArchivedJournalRecord::Blocks(packed) => {
            TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos: unpack_blocks(packed)? })
        }
        ArchivedJournalRecord::Allocation(allocation) => {
            let mut streams = Vec::with_capacity(allocation.streams.len());
            let mut previous: Option<i32> = None;
            for entry in allocation.streams.iter() {
                let stream = entry.stream_id.to_native();
                if previous.is_some_and(|previous| previous >= stream) {
                    return Err(bad(format!(
                        "allocation streams out of order: {stream} after {previous:?}"
                    )));
                }
                previous = Some(stream);
                let blocks = unpack_blocks(&entry.blocks)?;
                // Replay takes a stream's listed blocks off that stream's queue: a block of
                // another stream would stay queued there, and be allocated twice.
                if let Some(stray) = blocks.iter().find(|block| block.stream_id().0 != stream) {
                    return Err(bad(format!(
                        "an allocation lists a block of stream {} under stream {stream}",
                        stray.stream_id().0
                    )));
                }
                streams.push((StreamId(stream), blocks));
            }
            TrackerEvent::BatchAllocation(BatchAllocationEvent {
                time: BatchTime(allocation.time.to_native()),
                blocks: AllocatedBlocks::new(streams),
            })
        }
        ArchivedJournalRecord::Cleanup(times) => TrackerEvent::BatchCleanup(BatchCleanupEvent {
            times: times.iter().map(|time| BatchTime(time.to_native())).collect(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::SegmentId;

    fn plain(stream: i32, unique_id: u64) -> ReceivedBlockInfo {
        let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
        ReceivedBlockInfo::new(
            StreamId(stream),
            Some(7),
            None,
            BlockStoreResult::BlockManager { block_id },
        )
        .unwrap()
    }

    fn rich(stream: i32, unique_id: u64) -> ReceivedBlockInfo {
        let block_id = StreamBlockId { stream: StreamId(stream + 1), unique_id };
        let handle = RecordHandle { segment: SegmentId(3), offset: 4_096, len: 99 };
        let mut info = ReceivedBlockInfo::new(
            StreamId(stream),
            None,
            Some(b"meta".to_vec()),
            BlockStoreResult::ReceiverWal { block_id, handle },
        )
        .unwrap();
        info.set_block_id_valid(false);
        info
    }

    fn round_trip(event: &TrackerEvent) -> usize {
        let bytes = encode_into(event, AlignedVec::new()).unwrap();
        let decoded = decode(&bytes).unwrap();
        assert_eq!(&decoded, event);
        // Equality ignores the valid flag: compare it too.
        let flags = |event: &TrackerEvent| -> Vec<bool> {
            match event {
                TrackerEvent::BlockAddition(e) => vec![e.info.is_block_id_valid()],
                TrackerEvent::BlockAdditions(e) => {
                    e.infos.iter().map(ReceivedBlockInfo::is_block_id_valid).collect()
                }
                _ => vec![],
            }
        };
        assert_eq!(flags(&decoded), flags(event));
        bytes.len()
    }

    #[test]
    fn every_event_round_trips_exactly() {
        round_trip(&TrackerEvent::BlockAddition(BlockAdditionEvent { info: rich(1, 2) }));
        round_trip(&TrackerEvent::BlockAdditions(BlockAdditionsEvent {
            infos: vec![plain(1, 1), rich(2, 2), plain(1, 3), rich(0, 4)],
        }));
        round_trip(&TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos: vec![] }));
        round_trip(&TrackerEvent::BatchAllocation(BatchAllocationEvent {
            time: BatchTime(5),
            blocks: AllocatedBlocks::new([
                (StreamId(1), vec![plain(1, 1), rich(1, 2)]),
                (StreamId(2), vec![]),
            ]),
        }));
        round_trip(&TrackerEvent::BatchCleanup(BatchCleanupEvent {
            times: vec![BatchTime(1), BatchTime(-3)],
        }));
    }

    #[test]
    fn additions_kept_by_stream_encode_as_the_event_of_their_blocks_in_that_order() {
        let groups = [vec![plain(1, 1), rich(1, 3)], vec![plain(2, 2)], vec![plain(1, 9)]];
        let event = TrackerEvent::BlockAdditions(BlockAdditionsEvent {
            infos: groups.iter().flatten().cloned().collect(),
        });
        let lists: Vec<&[ReceivedBlockInfo]> = groups.iter().map(Vec::as_slice).collect();
        let grouped = encode_additions_into(&lists, AlignedVec::new()).unwrap();
        assert_eq!(&grouped[..], &encode_into(&event, AlignedVec::new()).unwrap()[..]);
        assert_eq!(decode(&grouped).unwrap(), event);
    }

    #[test]
    fn plain_blocks_are_compact() {
        let one = TrackerEvent::BlockAddition(BlockAdditionEvent { info: plain(1, 1) });
        assert_eq!(round_trip(&one), 32);
        let many = TrackerEvent::BlockAdditions(BlockAdditionsEvent {
            infos: (0..64).map(|id| plain(1 + (id % 2) as i32, 1_000 + id)).collect(),
        });
        assert!(round_trip(&many) <= 4 * 64 + 48, "{}", round_trip(&many));
    }

    #[test]
    fn blocks_with_one_byte_fields_are_coded_as_the_general_varints_are() {
        let base = Previous { stream: 5, unique_id: 1_000 };
        for stream_step in [0i32, 1, -1, 63, -64, 64, -65] {
            for id_step in [0i64, 1, -1, 63, -64, 64, -65, 1 << 40] {
                for count in [None, Some(0), Some(127), Some(128)] {
                    let stream = base.stream + stream_step;
                    let unique_id = base.unique_id.wrapping_add(id_step as u64);
                    let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
                    let store = BlockStoreResult::BlockManager { block_id };
                    let info =
                        ReceivedBlockInfo::new(StreamId(stream), count, None, store).unwrap();
                    let mut coded = Vec::new();
                    let mut previous = base;
                    put_block(&mut coded, &mut previous, &info, false);
                    let mut expected = vec![if count.is_some() { FLAG_COUNT as u8 } else { 0 }];
                    put_varint(&mut expected, zigzag(i64::from(stream_step)));
                    put_varint(&mut expected, zigzag(id_step));
                    if let Some(count) = count {
                        put_varint(&mut expected, count as u64);
                    }
                    assert_eq!(coded, expected, "steps {stream_step}, {id_step}, count {count:?}");
                    assert_eq!((previous.stream, previous.unique_id), (stream, unique_id));
                }
            }
        }
    }

    #[test]
    fn damaged_records_are_errors() {
        let event = TrackerEvent::BlockAddition(BlockAdditionEvent { info: plain(1, 1) });
        let bytes = encode_into(&event, AlignedVec::new()).unwrap();
        // The record count is bytes 8..16 of the packed block: -2 is no valid count.
        let mut damaged = AlignedVec::<16>::new();
        damaged.extend_from_slice(&bytes);
        damaged[8..16].copy_from_slice(&(-2i64).to_le_bytes());
        assert!(matches!(decode(&damaged), Err(BlockTrackerError::Decode { .. })));
        let mut damaged = AlignedVec::<16>::new();
        damaged.extend_from_slice(&bytes);
        damaged[20] = 0xff; // unknown flags
        assert!(matches!(decode(&damaged), Err(BlockTrackerError::Decode { .. })));
        assert!(decode(&bytes[..8]).is_err());
    }

    #[test]
    fn an_allocation_listing_a_block_under_another_stream_is_an_error() {
        let misfiled = TrackerEvent::BatchAllocation(BatchAllocationEvent {
            time: BatchTime(5),
            blocks: AllocatedBlocks::new([(StreamId(1), vec![plain(1, 1), plain(2, 2)])]),
        });
        let bytes = encode_into(&misfiled, AlignedVec::new()).unwrap();
        match decode(&bytes) {
            Err(BlockTrackerError::Decode { message }) => {
                assert!(message.contains("a block of stream 2 under stream 1"), "{message}");
            }
            other => panic!("expected a decode error, got {other:?}"),
        }
    }

    #[test]
    fn damaged_coded_blocks_are_errors() {
        let good = [plain(1, 1), plain(2, 2)];
        let coded = |count: u32, coded: Vec<u8>| {
            let record = JournalRecord::Blocks(PackedBlocks { count, coded, extras: Vec::new() });
            let bytes = rkyv::to_bytes::<rancor::Error>(&record).unwrap();
            decode(&bytes)
        };
        let valid = pack_blocks(&[&good]).coded;
        assert!(coded(2, valid.clone()).is_ok());
        let is_decode_error = |outcome: Result<TrackerEvent, BlockTrackerError>| {
            matches!(outcome, Err(BlockTrackerError::Decode { .. }))
        };
        assert!(is_decode_error(coded(3, valid.clone())), "count beyond the bytes");
        assert!(is_decode_error(coded(2, valid[..valid.len() - 1].to_vec())), "truncated");
        let mut trailing = valid.clone();
        trailing.push(0);
        assert!(is_decode_error(coded(2, trailing)), "trailing bytes");
        let overflow = [vec![FLAG_COUNT as u8, 0, 0], vec![0xff; 9], vec![0x7f]].concat();
        assert!(is_decode_error(coded(1, overflow)), "a count varint past 64 bits");
        let huge_stream = [vec![0u8], vec![0xff, 0xff, 0xff, 0xff, 0x7f], vec![0]].concat();
        assert!(is_decode_error(coded(1, huge_stream)), "a stream id out of i32 range");
        // After a block of stream 1 (flags 0, stream delta +1, id delta 0), a stream delta of
        // i64::MAX (zigzag u64::MAX - 1) or, after stream -1, i64::MIN (zigzag u64::MAX): the
        // sum overflows i64 (a panic where overflow is checked).
        for (first_stream, delta) in [(0x02u8, 0xfeu8), (0x01, 0xff)] {
            let overflowing =
                [vec![0, first_stream, 0, 0, delta], vec![0xff; 8], vec![0x01, 0]].concat();
            assert!(is_decode_error(coded(2, overflowing)), "a stream delta overflowing i64");
        }
        assert!(is_decode_error(coded(u32::MAX, vec![0; 30])), "no allocation from a count");
    }

    proptest::proptest! {
        // A fixed seed: the same cases on every run, so a failure reproduces.
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x0B10_C4ED),
            ..proptest::prelude::ProptestConfig::default()
        })]
        #[test]
        fn coded_blocks_round_trip(
            blocks in proptest::collection::vec(
                (proptest::prelude::any::<i32>(), proptest::prelude::any::<u64>(),
                 proptest::option::of(0..i64::MAX), proptest::prelude::any::<bool>(),
                 proptest::prelude::any::<bool>()),
                0..40,
            )
        ) {
            let infos: Vec<ReceivedBlockInfo> = blocks
                .into_iter()
                .map(|(stream, unique_id, count, valid, rich_one)| {
                    let mut info = if rich_one {
                        rich(stream.saturating_sub(1), unique_id)
                    } else {
                        let block_id = StreamBlockId { stream: StreamId(stream), unique_id };
                        ReceivedBlockInfo::new(
                            StreamId(stream),
                            count,
                            None,
                            BlockStoreResult::BlockManager { block_id },
                        )
                        .unwrap()
                    };
                    info.set_block_id_valid(valid);
                    info
                })
                .collect();
            round_trip(&TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos }));
        }
    }
}
