//! The records of the epoch log (the on-disk format of [`super::DurableQuery`]), and how they
//! are written.
//!
//! [`LogRecord`] is the format: what recovery validates and reads. Writing goes through its
//! borrowed twin [`LogRecordRef`], which archives into exactly [`ArchivedLogRecord`] (rkyv's
//! `as`) but takes the offsets straight from the coordinator's `(partition, payload)` slice.
//!
//! Why: recording an epoch's offsets is the coordinator thread's main cost of durability, and
//! that thread is the bottleneck of a durable run. Building an owned [`OffsetsRecord`] first
//! took three passes over the offsets (a layout check, a zeroed resize of the record's vector
//! and a copy into it) and then the serializer's copy of that vector. Now the common case, ids
//! `0..count` and payloads of one width, is one pass: the layout is assumed
//! ([`OffsetsRecordRef::assuming_compact`]) and checked while each payload is copied, with a
//! fixed-size move, into a stack chunk that goes to the serializer 4 KiB at a time. Should the
//! assumption fail, the record is serialized again with the layout computed first
//! ([`OffsetsRecordRef::new`]). Either way the bytes are those of [`LogRecord`]'s own
//! serialization; a test checks it for every layout.

use std::{cell::Cell, marker::PhantomData};

use rkyv::{
    munge::munge,
    rancor::Fallible,
    ser::{Writer, WriterExt as _},
    vec::{ArchivedVec, VecResolver},
    Archive, Archived, Place, Portable, Serialize,
};

use super::{PartitionId, Payload};

/// One record of the epoch log.
#[derive(Debug, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub(super) enum LogRecord {
    /// The offsets of one epoch.
    Offsets(OffsetsRecord),
    /// A committed epoch.
    Commit {
        /// The run that committed it.
        run: u64,
        /// The epoch.
        epoch: i64,
    },
    /// The offsets of one epoch, as the difference from the run's last offsets record
    /// (module `delta`).
    OffsetsDelta(OffsetsDeltaRecord),
    /// The offsets of one epoch, as the difference from the run's last offsets record of the
    /// difference that record made to its own base (zero for a full record): a second-order
    /// delta, zero for offsets that advance steadily (module `delta`). `deltas` holds those
    /// differences of differences.
    OffsetsDeltaOfDelta(OffsetsDeltaRecord),
}

// rkyv finds a record's root at its end, `size_of` the archived enum back: logs written before
// `OffsetsDelta` existed hold 56-byte roots, so no variant may grow the enum (or they no
// longer open). A new kind of record is a new variant, which a build from before it refuses
// as unknown (a typed error), rather than a field an older build would not know to read.
const _: () = assert!(std::mem::size_of::<ArchivedLogRecord>() == 56);

/// The offsets of one epoch as the difference from a base: the last offsets record, full
/// ([`OffsetsRecord`]) or delta, the same run appended before this record, which has the
/// compact layout (ids `0..count`, every payload `width` bytes) with the same `count` and
/// `width` (module `delta`).
#[derive(
    Debug, Clone, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub(super) struct OffsetsDeltaRecord {
    pub(super) run: u64,
    pub(super) epoch: i64,
    /// The epoch of the base record.
    pub(super) base_epoch: i64,
    /// Number of offsets.
    pub(super) count: u32,
    /// Length of every payload.
    pub(super) width: u32,
    /// Bytes per entry of `deltas`, 0 to 8.
    pub(super) word_bytes: u8,
    /// For each 8-byte little-endian word of the concatenated payloads (the last one padded
    /// with zeros), the zigzag-encoded wrapping difference from the base's word (for
    /// `OffsetsDeltaOfDelta`, from the base's word plus the base's own difference), in its
    /// `word_bytes` low bytes, little-endian.
    pub(super) deltas: Vec<u8>,
}

/// The offsets of one epoch, as flat arrays (the layouts are described in the `durable`
/// module doc).
#[derive(Debug, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub(super) struct OffsetsRecord {
    pub(super) run: u64,
    pub(super) epoch: i64,
    /// Partition ids, sorted; empty when they are exactly `0..count`.
    pub(super) partitions: Vec<i32>,
    /// Number of offsets.
    pub(super) count: u32,
    /// Length of every payload when they all have one length (then `ends` is empty).
    pub(super) width: u32,
    /// End of each partition's payload in `data`, when the lengths differ.
    pub(super) ends: Vec<u32>,
    /// All payloads, concatenated.
    pub(super) data: Vec<u8>,
}

/// [`LogRecord`] as it is written: archives as [`ArchivedLogRecord`].
#[derive(rkyv::Archive, rkyv::Serialize)]
#[rkyv(as = ArchivedLogRecord)]
pub(super) enum LogRecordRef<'a> {
    /// The offsets of one epoch.
    Offsets(OffsetsRecordRef<'a>),
    /// A committed epoch.
    Commit {
        /// The run that committed it.
        run: u64,
        /// The epoch.
        epoch: i64,
    },
    /// The offsets of one epoch, as a difference (module `delta`).
    OffsetsDelta(#[rkyv(with = rkyv::with::Inline)] &'a OffsetsDeltaRecord),
    /// The offsets of one epoch, as a difference of differences (module `delta`).
    OffsetsDeltaOfDelta(#[rkyv(with = rkyv::with::Inline)] &'a OffsetsDeltaRecord),
}

/// [`OffsetsRecord`] as it is written, borrowing the offsets: archives as
/// [`ArchivedOffsetsRecord`]. Build it with [`OffsetsRecordRef::new`], which computes the
/// layout, or [`OffsetsRecordRef::assuming_compact`], which assumes the compact one.
/// (`Archive` and `Serialize` are written out: the derive's `as` cannot see through the
/// lifetime of the field types.)
pub(super) struct OffsetsRecordRef<'a> {
    run: u64,
    epoch: i64,
    partitions: Words<'a, Archived<i32>>,
    count: u32,
    width: u32,
    ends: Words<'a, Archived<u32>>,
    data: PayloadBytes<'a>,
}

/// The resolvers of an [`OffsetsRecordRef`]'s arrays.
pub(super) struct OffsetsRecordRefResolver {
    partitions: VecResolver,
    ends: VecResolver,
    data: VecResolver,
}

impl Archive for OffsetsRecordRef<'_> {
    type Archived = ArchivedOffsetsRecord;
    type Resolver = OffsetsRecordRefResolver;

    fn resolve(&self, resolver: Self::Resolver, out: Place<Self::Archived>) {
        munge!(
            let ArchivedOffsetsRecord { run, epoch, partitions, count, width, ends, data } = out
        );
        self.run.resolve((), run);
        self.epoch.resolve((), epoch);
        self.partitions.resolve(resolver.partitions, partitions);
        self.count.resolve((), count);
        self.width.resolve((), width);
        self.ends.resolve(resolver.ends, ends);
        self.data.resolve(resolver.data, data);
    }
}

impl<S: Fallible + Writer + ?Sized> Serialize<S> for OffsetsRecordRef<'_> {
    /// The arrays in field order, as the derive of [`OffsetsRecord`] writes them.
    fn serialize(&self, serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        Ok(OffsetsRecordRefResolver {
            partitions: self.partitions.serialize(serializer)?,
            ends: self.ends.serialize(serializer)?,
            data: self.data.serialize(serializer)?,
        })
    }
}

/// The most offsets one record holds (2^24, far beyond any engine's partition count). A
/// record's empty payloads take no bytes, so nothing else bounds what a reader of a damaged
/// or forged log would allocate; the writer keeps to the same bound.
pub(super) const MAX_OFFSETS_PER_RECORD: usize = 1 << 24;

/// Why the offsets of an epoch cannot be recorded: a count that does not fit the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TooLarge {
    /// What overflowed.
    pub(super) what: &'static str,
    /// Its value.
    pub(super) value: usize,
    /// The most the format holds.
    pub(super) limit: usize,
}

impl LogRecordRef<'_> {
    /// Whether the archive just serialized from this record is valid: always, except for
    /// offsets built by [`OffsetsRecordRef::assuming_compact`] whose assumption failed.
    pub(super) fn layout_held(&self) -> bool {
        match self {
            Self::Offsets(record) => !record.data.assumed || record.data.held.get(),
            Self::Commit { .. } | Self::OffsetsDelta(_) | Self::OffsetsDeltaOfDelta(_) => true,
        }
    }
}

impl<'a> OffsetsRecordRef<'a> {
    /// The record of `offsets` (sorted by partition), in the compact layout that fits: no ids
    /// when they are `0..count`, no ends when every payload has one length.
    ///
    /// # Errors
    /// [`TooLarge`] if the count exceeds [`MAX_OFFSETS_PER_RECORD`] or the total payload
    /// bytes `u32`.
    pub(super) fn new(
        run: u64,
        epoch: i64,
        offsets: &'a [(PartitionId, Payload)],
    ) -> Result<Self, TooLarge> {
        let width = offsets.first().map_or(0, |(_, payload)| payload.len());
        let (mut total, mut dense, mut fixed) = (0usize, true, true);
        for (index, (partition, payload)) in offsets.iter().enumerate() {
            let len = payload.len();
            total += len;
            dense &= partition.0 as usize == index;
            fixed &= len == width;
        }
        Self::with_layout(run, epoch, offsets, total, dense, fixed.then_some(width), false)
    }

    /// The record of `offsets` in the most compact layout (ids `0..count`, every payload as
    /// long as the first), **assumed** rather than checked, when the first payload has one of
    /// the copied widths (8, 16 or 24 bytes; else this is [`OffsetsRecordRef::new`]). Serializing
    /// checks the assumption while it copies the payloads: one pass over the offsets instead of
    /// two. If [`LogRecordRef::layout_held`] then says it failed, the archive is wrong and the
    /// record must be serialized again from [`OffsetsRecordRef::new`].
    ///
    /// # Errors
    /// As [`OffsetsRecordRef::new`] (which it defers to when the assumed size would not fit).
    pub(super) fn assuming_compact(
        run: u64,
        epoch: i64,
        offsets: &'a [(PartitionId, Payload)],
    ) -> Result<Self, TooLarge> {
        let width = offsets.first().map_or(0, |(_, payload)| payload.len());
        let total = offsets.len().saturating_mul(width);
        // An assumed total too large for the format may still be wrong (shorter payloads
        // later): only the computed layout can refuse the record.
        if !matches!(width, 8 | 16 | 24) || u32::try_from(total).is_err() {
            return Self::new(run, epoch, offsets);
        }
        Self::with_layout(run, epoch, offsets, total, true, Some(width), true)
    }

    /// Whether the record has the layout [`OffsetsRecordRef::assuming_compact`] assumes.
    pub(super) fn is_compact(&self) -> bool {
        !self.partitions.present
            && !self.ends.present
            && matches!(self.data.width, Some(8 | 16 | 24))
    }

    fn with_layout(
        run: u64,
        epoch: i64,
        offsets: &'a [(PartitionId, Payload)],
        total: usize,
        dense: bool,
        width: Option<usize>,
        assumed: bool,
    ) -> Result<Self, TooLarge> {
        if offsets.len() > MAX_OFFSETS_PER_RECORD {
            return Err(TooLarge {
                what: "count",
                value: offsets.len(),
                limit: MAX_OFFSETS_PER_RECORD,
            });
        }
        let count = offsets.len() as u32;
        if u32::try_from(total).is_err() {
            return Err(TooLarge { what: "payload bytes", value: total, limit: u32::MAX as usize });
        }
        Ok(Self {
            run,
            epoch,
            partitions: Words::new(offsets, !dense, partition_id_word),
            count,
            // Fits: at most `total`, or the first payload's length when all are that long.
            width: width.unwrap_or(0) as u32,
            ends: Words::new(offsets, width.is_none(), payload_end_word),
            data: PayloadBytes { offsets, total, width, assumed, held: Cell::new(true) },
        })
    }
}

/// Bytes gathered on the stack before each write to the serializer.
const CHUNK_BYTES: usize = 4096;

/// A stack buffer in front of a serializer: many small copies into it, one write out of it
/// per [`CHUNK_BYTES`].
struct Chunked<'s, S: ?Sized> {
    serializer: &'s mut S,
    chunk: [u8; CHUNK_BYTES],
    len: usize,
}

impl<'s, S: ?Sized> Chunked<'s, S> {
    fn new(serializer: &'s mut S) -> Self {
        Self { serializer, chunk: [0; CHUNK_BYTES], len: 0 }
    }

    /// Room for `N` more bytes, flushing first if needed.
    #[inline(always)]
    fn reserve<const N: usize, E>(&mut self) -> Result<&mut [u8; N], E>
    where
        S: Writer<E>,
    {
        const { assert!(N <= CHUNK_BYTES) };
        if self.len + N > CHUNK_BYTES {
            self.flush()?;
        }
        let start = self.len;
        self.len += N;
        Ok((&mut self.chunk[start..start + N]).try_into().expect("N bytes"))
    }

    /// An empty chunk (flushing first) as `count` slots of `N` bytes, counted as written;
    /// `count` is at most `CHUNK_BYTES / N`.
    fn fresh_slots<const N: usize, E>(&mut self, count: usize) -> Result<&mut [[u8; N]], E>
    where
        S: Writer<E>,
    {
        if self.len > 0 {
            self.flush()?;
        }
        let (slots, _) = self.chunk.as_chunks_mut::<N>();
        let slots = &mut slots[..count];
        self.len = count * N;
        Ok(slots)
    }

    /// Copies `bytes` of any length.
    fn push<E>(&mut self, mut bytes: &[u8]) -> Result<(), E>
    where
        S: Writer<E>,
    {
        while !bytes.is_empty() {
            if self.len == CHUNK_BYTES {
                self.flush()?;
            }
            let take = bytes.len().min(CHUNK_BYTES - self.len);
            self.chunk[self.len..self.len + take].copy_from_slice(&bytes[..take]);
            self.len += take;
            bytes = &bytes[take..];
        }
        Ok(())
    }

    fn flush<E>(&mut self) -> Result<(), E>
    where
        S: Writer<E>,
    {
        self.serializer.write(&self.chunk[..self.len])?;
        self.len = 0;
        Ok(())
    }
}

/// Copies every payload as `WIDTH` bytes with fixed-size moves, and returns whether the
/// compact layout held: every payload exactly `WIDTH` bytes long and the ids `0..count`. (A
/// payload of another length leaves its slot unspecified: the archive is redone then.) Fills
/// a whole chunk per block of payloads, so that the loop keeps its position in registers.
fn push_fixed_width<const WIDTH: usize, S: Writer<E> + ?Sized, E>(
    out: &mut Chunked<'_, S>,
    offsets: &[(PartitionId, Payload)],
) -> Result<bool, E> {
    let mut held = true;
    let mut index = 0usize;
    for block in offsets.chunks(CHUNK_BYTES / WIDTH) {
        for (slot, (partition, payload)) in
            out.fresh_slots::<WIDTH, E>(block.len())?.iter_mut().zip(block)
        {
            let bytes = payload.as_bytes();
            // `&`, not `&&`: no branch per payload.
            held &= (partition.0 as usize == index) & (bytes.len() == WIDTH);
            if let Some(bytes) = bytes.first_chunk::<WIDTH>() {
                *slot = *bytes;
            }
            index += 1;
        }
    }
    Ok(held)
}

/// A per-offset array of 4-byte little-endian words, archived as `ArchivedVec<T>`, or an empty
/// one when it is not `present`: the `partitions` field ([`partition_id_word`]) and the `ends`
/// field ([`payload_end_word`]). `word` gets a running value, zero at the first offset.
struct Words<'a, T> {
    offsets: &'a [(PartitionId, Payload)],
    present: bool,
    word: fn(&mut u32, &(PartitionId, Payload)) -> [u8; 4],
    archived: PhantomData<T>,
}

impl<'a, T> Words<'a, T> {
    fn new(
        offsets: &'a [(PartitionId, Payload)],
        present: bool,
        word: fn(&mut u32, &(PartitionId, Payload)) -> [u8; 4],
    ) -> Self {
        Self { offsets, present, word, archived: PhantomData }
    }
}

/// The id of an offset's partition.
fn partition_id_word(_: &mut u32, (partition, _): &(PartitionId, Payload)) -> [u8; 4] {
    partition.0.to_le_bytes()
}

/// The end of an offset's payload in `data` (`end` is the end of the previous one).
fn payload_end_word(end: &mut u32, (_, payload): &(PartitionId, Payload)) -> [u8; 4] {
    // Fits: the record's constructors checked the total.
    *end += payload.len() as u32;
    end.to_le_bytes()
}

impl<T: Portable> Archive for Words<'_, T> {
    type Archived = ArchivedVec<T>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<Self::Archived>) {
        let len = if self.present { self.offsets.len() } else { 0 };
        ArchivedVec::resolve_from_len(len, resolver, out);
    }
}

impl<S: Fallible + Writer + ?Sized, T: Portable> Serialize<S> for Words<'_, T> {
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        let pos = serializer.align_for::<T>()?;
        if self.present {
            let mut out = Chunked::new(serializer);
            let mut running = 0u32;
            for offset in self.offsets {
                *out.reserve::<4, S::Error>()? = (self.word)(&mut running, offset);
            }
            out.flush()?;
        }
        Ok(VecResolver::from_pos(pos))
    }
}

/// The `data` field: every payload, concatenated.
struct PayloadBytes<'a> {
    offsets: &'a [(PartitionId, Payload)],
    total: usize,
    /// The one length of every payload, if they have one.
    width: Option<usize>,
    /// The layout was assumed ([`OffsetsRecordRef::assuming_compact`]), not checked.
    assumed: bool,
    /// Set by serializing: whether an assumed layout held.
    held: Cell<bool>,
}

impl Archive for PayloadBytes<'_> {
    type Archived = ArchivedVec<u8>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<Self::Archived>) {
        ArchivedVec::resolve_from_len(self.total, resolver, out);
    }
}

impl<S: Fallible + Writer + ?Sized> Serialize<S> for PayloadBytes<'_> {
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        let pos = serializer.pos();
        let mut out = Chunked::new(serializer);
        let held = match self.width {
            // The common widths (an offset or two, in 8-byte words) copy with fixed-size moves;
            // a length-generic copy per payload is a call into `memcpy` each.
            Some(8) => push_fixed_width::<8, _, _>(&mut out, self.offsets)?,
            Some(16) => push_fixed_width::<16, _, _>(&mut out, self.offsets)?,
            Some(24) => push_fixed_width::<24, _, _>(&mut out, self.offsets)?,
            _ => {
                for (_, payload) in self.offsets {
                    out.push(payload.as_bytes())?;
                }
                true
            }
        };
        out.flush()?;
        self.held.set(held);
        Ok(VecResolver::from_pos(pos))
    }
}

/// Room for the `count` offsets of a record read from disk: at most
/// [`MAX_OFFSETS_PER_RECORD`] (empty payloads take no bytes in a record, so a well-formed
/// record may claim any count), and the allocation may fail with an error instead of
/// aborting.
pub(super) fn reserve_offsets(count: usize) -> Result<Vec<(PartitionId, Payload)>, String> {
    if count > MAX_OFFSETS_PER_RECORD {
        return Err(format!(
            "{count} offsets, more than a record holds ({MAX_OFFSETS_PER_RECORD})"
        ));
    }
    let mut offsets = Vec::new();
    offsets
        .try_reserve_exact(count)
        .map_err(|error| format!("no memory for {count} offsets: {error}"))?;
    Ok(offsets)
}

/// The offsets of a validated record, checking that its arrays agree.
pub(super) fn decode_offsets(
    entry: &ArchivedOffsetsRecord,
) -> Result<Vec<(PartitionId, Payload)>, String> {
    let count = entry.count.to_native() as usize;
    let width = entry.width.to_native() as usize;
    let (partitions, ends, data) =
        (entry.partitions.as_slice(), entry.ends.as_slice(), entry.data.as_slice());
    if !partitions.is_empty() && partitions.len() != count {
        return Err(format!("{} partition ids for {count} offsets", partitions.len()));
    }
    if !ends.is_empty() && ends.len() != count {
        return Err(format!("{} payload ends for {count} offsets", ends.len()));
    }
    if ends.is_empty() && count.checked_mul(width) != Some(data.len()) {
        return Err(format!("{count} offsets of {width} bytes in {} bytes", data.len()));
    }
    let mut offsets = reserve_offsets(count)?;
    let mut start = 0usize;
    for index in 0..count {
        let end = match ends.get(index) {
            Some(end) => end.to_native() as usize,
            None => start + width,
        };
        if end < start || end > data.len() {
            return Err(format!("payload end {end} outside {start}..={}", data.len()));
        }
        let partition = partitions.get(index).map_or(index as i32, |p| p.to_native());
        offsets.push((PartitionId(partition), Payload::from(&data[start..end])));
        start = end;
    }
    Ok(offsets)
}

#[cfg(test)]
pub(super) mod tests {
    use rkyv::rancor;

    use super::*;

    /// The bytes of a well-formed record claiming `count` empty payloads: nothing in the
    /// record bounds that count (found by review: it used to allocate 40 bytes per claimed
    /// offset, and `u32::MAX` of them aborted the process on open).
    pub(in crate::coordinators::epoch) fn empty_payloads_record(
        count: u32,
    ) -> rkyv::util::AlignedVec {
        let record = LogRecord::Offsets(OffsetsRecord {
            run: 1,
            epoch: 1,
            partitions: Vec::new(),
            count,
            width: 0,
            ends: Vec::new(),
            data: Vec::new(),
        });
        rkyv::to_bytes::<rancor::Error>(&record).unwrap()
    }

    #[test]
    fn a_record_claiming_more_offsets_than_a_record_holds_is_an_error_not_an_abort() {
        for (count, error) in [
            (u32::MAX, "4294967295 offsets, more than a record holds (16777216)"),
            (1 << 24 | 1, "16777217 offsets, more than a record holds (16777216)"),
        ] {
            let bytes = empty_payloads_record(count);
            let archived = rkyv::access::<ArchivedLogRecord, rancor::Error>(&bytes).unwrap();
            let ArchivedLogRecord::Offsets(entry) = archived else { panic!("not offsets") };
            assert_eq!(decode_offsets(entry).unwrap_err(), error);
        }
        // A modest count of empty payloads is a valid record.
        let bytes = empty_payloads_record(3);
        let archived = rkyv::access::<ArchivedLogRecord, rancor::Error>(&bytes).unwrap();
        let ArchivedLogRecord::Offsets(entry) = archived else { panic!("not offsets") };
        assert_eq!(
            decode_offsets(entry).unwrap(),
            vec![
                (PartitionId(0), Payload::new()),
                (PartitionId(1), Payload::new()),
                (PartitionId(2), Payload::new()),
            ]
        );
    }

    /// The owned record of `offsets`, built the plain way.
    fn owned(run: u64, epoch: i64, offsets: &[(PartitionId, Payload)]) -> OffsetsRecord {
        let width = offsets.first().map_or(0, |(_, payload)| payload.len());
        let dense = offsets.iter().enumerate().all(|(i, (p, _))| p.0 as usize == i);
        let fixed = offsets.iter().all(|(_, payload)| payload.len() == width);
        let mut data = Vec::new();
        let mut ends = Vec::new();
        for (_, payload) in offsets {
            data.extend_from_slice(payload.as_bytes());
            ends.push(data.len() as u32);
        }
        OffsetsRecord {
            run,
            epoch,
            partitions: if dense { Vec::new() } else { offsets.iter().map(|(p, _)| p.0).collect() },
            count: offsets.len() as u32,
            width: if fixed { width as u32 } else { 0 },
            ends: if fixed { Vec::new() } else { ends },
            data,
        }
    }

    fn layouts() -> Vec<Vec<(PartitionId, Payload)>> {
        let fixed_dense = |count: usize, width: usize| -> Vec<(PartitionId, Payload)> {
            (0..count)
                .map(|p| (PartitionId(p as i32), Payload::from(vec![p as u8 ^ 0x5a; width])))
                .collect()
        };
        let mut layouts = vec![
            Vec::new(),
            vec![(PartitionId(3), Payload::from(&b"x"[..]))],
            vec![
                (PartitionId(2), Payload::from(&b"a"[..])),
                (PartitionId(5), Payload::new()),
                (PartitionId(9), Payload::from(vec![7u8; 300])),
            ],
            vec![(PartitionId(1), Payload::from(1)), (PartitionId(3), 3.into())],
            // Compact but for one entry: a sparse id, a longer or a shorter payload.
            (0..10)
                .map(|p| (PartitionId(if p == 9 { 11 } else { p }), Payload::from(i64::from(p))))
                .collect(),
            (0..10)
                .map(|p| (PartitionId(p), Payload::from(vec![1u8; if p == 4 { 9 } else { 8 }])))
                .collect(),
            (0..10)
                .map(|p| (PartitionId(p), Payload::from(vec![1u8; if p == 4 { 3 } else { 16 }])))
                .collect(),
            // Larger than a chunk, in each layout.
            (0..1500).map(|p| (PartitionId(p * 2), Payload::from(i64::from(p)))).collect(),
            (0..700).map(|p| (PartitionId(p), Payload::from(vec![1u8; p as usize % 40]))).collect(),
            vec![(PartitionId(0), Payload::from(vec![9u8; 10_000]))],
        ];
        for width in [0, 4, 8, 12, 16, 24, 32] {
            layouts.push(fixed_dense(3, width));
            layouts.push(fixed_dense(1000, width));
        }
        layouts
    }

    #[test]
    fn the_borrowed_record_archives_to_the_same_bytes_as_the_owned_one() {
        for offsets in layouts() {
            let (run, epoch) = (7, 1 << 40);
            let expected =
                rkyv::to_bytes::<rancor::Error>(&LogRecord::Offsets(owned(run, epoch, &offsets)))
                    .unwrap();
            let record =
                LogRecordRef::Offsets(OffsetsRecordRef::new(run, epoch, &offsets).unwrap());
            let actual = rkyv::to_bytes::<rancor::Error>(&record).unwrap();
            assert!(record.layout_held());
            assert_eq!(actual.as_slice(), expected.as_slice(), "{} offsets", offsets.len());
            // The assumed layout: the same bytes when it holds, and a failure reported when not.
            let assumed = OffsetsRecordRef::assuming_compact(run, epoch, &offsets).unwrap();
            let assumed = LogRecordRef::Offsets(assumed);
            let speculative = rkyv::to_bytes::<rancor::Error>(&assumed).unwrap();
            if assumed.layout_held() {
                assert_eq!(
                    speculative.as_slice(),
                    expected.as_slice(),
                    "{} offsets",
                    offsets.len()
                );
            } else {
                assert_ne!(
                    speculative.as_slice(),
                    expected.as_slice(),
                    "{} offsets",
                    offsets.len()
                );
            }
            let archived = rkyv::access::<ArchivedLogRecord, rancor::Error>(&actual).unwrap();
            let ArchivedLogRecord::Offsets(entry) = archived else { panic!("not offsets") };
            assert_eq!(decode_offsets(entry).unwrap(), offsets);
        }
        let owned = |value: &LogRecord| rkyv::to_bytes::<rancor::Error>(value).unwrap();
        let written = |value: &LogRecordRef| rkyv::to_bytes::<rancor::Error>(value).unwrap();
        assert_eq!(
            written(&LogRecordRef::Commit { run: 3, epoch: 9 }).as_slice(),
            owned(&LogRecord::Commit { run: 3, epoch: 9 }).as_slice()
        );
        let delta = OffsetsDeltaRecord {
            run: 3,
            epoch: 9,
            base_epoch: 8,
            count: 3,
            width: 8,
            word_bytes: 1,
            deltas: vec![1, 2, 3],
        };
        assert_eq!(
            written(&LogRecordRef::OffsetsDelta(&delta)).as_slice(),
            owned(&LogRecord::OffsetsDelta(delta.clone())).as_slice()
        );
        let of_delta = written(&LogRecordRef::OffsetsDeltaOfDelta(&delta));
        assert_eq!(of_delta.as_slice(), owned(&LogRecord::OffsetsDeltaOfDelta(delta)).as_slice());
        let archived = rkyv::access::<ArchivedLogRecord, rancor::Error>(&of_delta).unwrap();
        assert!(matches!(archived, ArchivedLogRecord::OffsetsDeltaOfDelta(_)));
    }

    #[test]
    fn an_assumed_layout_that_fails_is_reported() {
        let sparse = [(PartitionId(0), Payload::from(1)), (PartitionId(2), Payload::from(2))];
        let longer = [(PartitionId(0), Payload::from(1)), (PartitionId(1), vec![0u8; 9].into())];
        for offsets in [&sparse[..], &longer[..]] {
            let record =
                LogRecordRef::Offsets(OffsetsRecordRef::assuming_compact(1, 0, offsets).unwrap());
            rkyv::to_bytes::<rancor::Error>(&record).unwrap();
            assert!(!record.layout_held());
        }
        let compact = [(PartitionId(0), Payload::from(1)), (PartitionId(1), Payload::from(2))];
        let record =
            LogRecordRef::Offsets(OffsetsRecordRef::assuming_compact(1, 0, &compact).unwrap());
        rkyv::to_bytes::<rancor::Error>(&record).unwrap();
        assert!(record.layout_held());
    }

    #[test]
    fn the_layout_follows_the_ids_and_lengths() {
        let dense = [(PartitionId(0), Payload::from(1)), (PartitionId(1), Payload::from(2))];
        let record = OffsetsRecordRef::new(1, 0, &dense).unwrap();
        assert_eq!((record.count, record.width), (2, 8));
        assert!(!record.partitions.present && !record.ends.present);
        assert!(record.is_compact());
        let sparse_mixed = [(PartitionId(4), Payload::from(1)), (PartitionId(6), Payload::new())];
        let record = OffsetsRecordRef::new(1, 0, &sparse_mixed).unwrap();
        assert_eq!((record.count, record.width), (2, 0));
        assert!(record.partitions.present && record.ends.present);
        assert!(!record.is_compact());
        let dense_width_12 = [(PartitionId(0), Payload::from(vec![1u8; 12]))];
        assert!(!OffsetsRecordRef::new(1, 0, &dense_width_12).unwrap().is_compact());
    }
}
