//! Delta offsets records: most epochs' offsets are logged as the difference from the
//! offsets record the run appended just before, in a fraction of the bytes.
//!
//! # Why
//! With group commit paced (module `wal::writer::pacing`), what a durable epoch run spends
//! beyond the in-memory one grows with the bytes it logs: about a microsecond of kernel CPU
//! per KiB made durable on this machine class, mostly ext4 converting the unwritten extents of
//! preallocated segments (PERF.md, EpochCoordinator, "Fourteenth session"), and the copies and
//! the checksum on the coordinator's thread. A full offsets record of 1000 partitions with
//! 8-byte offsets is 8 KiB per epoch. But a partition's offset moves by one epoch's progress
//! from one epoch to the next, so the difference from the previous epoch's offset needs a few
//! low bytes, not eight.
//!
//! # Encoding
//! The concatenated payloads are read as little-endian 8-byte words (the last one padded with
//! zeros). Each word is stored as the zigzag encoding of its wrapping difference from the base's
//! word at the same place, in the fewest bytes that hold the largest such value in the record
//! (`word_bytes`, one width for the whole record: no per-word length to decode, and the encoder is
//! straight passes: gather, differences, pack). For 8-byte offsets this is exactly "offset minus
//! the base's offset"; for other payloads it is still lossless, only less compact.
//!
//! # Orders
//! A source that advances steadily moves each partition by about the same amount every epoch
//! (a rate-limited source, or Kafka partitions read at a cap under backlog: the load
//! generator's offsets move by exactly 2^20). Its first differences are as large as the
//! advance, but their own differences from the epoch before are small, or zero: Gorilla's
//! delta-of-delta timestamps (Pelkonen et al., VLDB 2015) rest on the same observation. So a
//! delta record is of one of two orders, whichever takes fewer bytes (the second on a tie):
//! `OffsetsDelta` holds each word's difference from the base's word, `OffsetsDeltaOfDelta`
//! the difference of that from the base's own difference (what the base record moved its word
//! by; zero for a keyframe). Both orders come out of one pass (module `zigzag`), which also
//! keeps the differences for the next record; the first order costs one more pass when it is
//! kept. Offsets that move back and forth, or at random, keep the first order; the load
//! generator's steady ones take no bytes at all in the second (its `--offsets varied` stream
//! has seeded per-partition rates and jitter: 3 bytes an offset either way). A decoder keeps
//! the last differences beside the words, which restart at zero at each keyframe.
//!
//! # Chains and keyframes
//! A delta's base is the offsets record its run appended just before it (`base_epoch` names
//! its epoch), full or delta: the difference from the previous epoch is the smallest (a base
//! further back grows with the distance: with the keyframe 16 epochs back as the base, as the
//! first version of this module did, the load generator's offsets needed 4 bytes instead of 3).
//! A run's first offsets record is full, and so is every record that cannot be a delta: the
//! layout is not compact (ids `0..count`, one payload width), the count or width differs from
//! the base's, or the epoch is not after the chain's full record (its keyframe) by fewer than
//! [`KEYFRAME_INTERVAL`] epochs (an epoch's offsets can complete before an earlier epoch's). Each
//! full compact record starts a new chain; a full record that is not compact starts none. Reading a
//! delta back decodes its chain from the keyframe on, at most [`KEYFRAME_INTERVAL`] records.
//! Recovery follows `base_epoch` from record to record, so logs whose deltas all name their
//! keyframe (the first version) decode the same way.
//!
//! # Why a keyframe survives cleaning
//! The log keeps every segment holding an epoch at or above `D + 1 - retained_epochs`, with `D`
//! the last durable commit (module `durable`). Recovery needs the offsets of the last commit it
//! finds, `E >= D`, and so the chain of `E`'s delta back to its keyframe, whose epoch `k` is
//! above `E - interval`, every record of it at an epoch above `k` (a delta is never of an
//! earlier epoch than its keyframe). With an interval of
//! at most `retained_epochs`, `k > D - retained_epochs`: their segments are kept. That holds
//! for chains the cleaning run wrote. A run restarted with fewer retained epochs than the run
//! before it keeps the recovered restart point's chain (up to [`KEYFRAME_INTERVAL`] epochs
//! back) until a commit of its own is durable; its first offsets record is full, so from then
//! on its own chains are what a restart needs. A crash that
//! cuts the log keeps a prefix, and a chain's records precede the deltas that use them. Only a
//! log opened with corrupted segments skipped can miss a base; opening then fails with
//! [`super::EpochError::BadLogRecord`] if the restart point needs it.

use super::{
    log_record::{
        reserve_offsets, ArchivedLogRecord, ArchivedOffsetsDeltaRecord, ArchivedOffsetsRecord,
        LogRecordRef, OffsetsDeltaRecord,
    },
    low_bytes::store_low_bytes,
    zigzag::{differences as zigzag_differences, unzigzag, zigzag_each, OrderBits},
    Offsets, PartitionId, Payload,
};

/// Most epochs between a delta and its chain's keyframe (exclusive), unless the log retains
/// fewer. The longer, the fewer full records (8 KiB each at 1000 partitions, against about
/// 3 KiB for a delta of offsets that advance by 2^20 with jitter, and none for the load
/// generator's steady ones); recovery decodes at most this many records for the restart point.
pub(super) const KEYFRAME_INTERVAL: i64 = 64;

/// What a delta record's values are differences from (module doc, "Orders").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DeltaOrder {
    /// From the base's words: a `LogRecord::OffsetsDelta`.
    First,
    /// From the base's words plus the base's own differences: a
    /// `LogRecord::OffsetsDeltaOfDelta`.
    Second,
}

/// The delta record in `record` and its order, if it is one.
pub(super) fn as_delta(
    record: &ArchivedLogRecord,
) -> Option<(DeltaOrder, &ArchivedOffsetsDeltaRecord)> {
    match record {
        ArchivedLogRecord::OffsetsDelta(delta) => Some((DeltaOrder::First, delta)),
        ArchivedLogRecord::OffsetsDeltaOfDelta(delta) => Some((DeltaOrder::Second, delta)),
        ArchivedLogRecord::Offsets(_) | ArchivedLogRecord::Commit { .. } => None,
    }
}

/// The base of the run's next delta and the buffers of the delta being built, kept across
/// epochs.
#[derive(Debug, Default)]
pub(super) struct DeltaEncoder {
    base: Option<Base>,
    /// The buffers of the last base dropped, kept for the next full record's base: each
    /// keyframe would otherwise free two (8 KiB each at 1000 partitions) and allocate two
    /// more, and the allocator's returns of such memory to the system cost the other core an
    /// interrupt (TLB shootdown).
    spare: BaseBuffers,
    /// The current epoch's words, then their encoded differences.
    words: Vec<u64>,
    /// The payloads concatenated (payloads of widths other than 8).
    bytes: Vec<u8>,
    record: OffsetsDeltaRecord,
}

/// The last offsets record of the run, in the compact layout, and its chain's keyframe.
#[derive(Debug)]
struct Base {
    /// The epoch of the run's last offsets record.
    epoch: i64,
    /// The epoch of the full record that started the chain.
    keyframe_epoch: i64,
    count: usize,
    width: usize,
    buffers: BaseBuffers,
}

/// The words of a base, and what they moved by.
#[derive(Debug, Default)]
struct BaseBuffers {
    /// The last record's payloads as words.
    words: Vec<u64>,
    /// The wrapping difference of each of `words` from the record before (zeros for a full
    /// record): what a second-order delta's values are differences from.
    differences: Vec<u64>,
}

impl DeltaEncoder {
    /// The delta record of `offsets` for `epoch`, of the order that takes fewer bytes (the
    /// second when they tie), if they can be one (module doc, "Chains and keyframes";
    /// `interval` is [`KEYFRAME_INTERVAL`] or the log's retained epochs, if fewer). The caller
    /// appends it: it is the base of the next delta. `None` leaves no base until the caller
    /// appends a full record ([`Self::full_record_appended`]).
    pub(super) fn encode(
        &mut self,
        run: u64,
        epoch: i64,
        offsets: Offsets<'_>,
        interval: i64,
    ) -> Option<LogRecordRef<'_>> {
        let base = self.base.as_mut()?;
        let width = offsets.first().map_or(0, |(_, payload)| payload.len());
        let after_keyframe = epoch > base.keyframe_epoch
            && epoch.abs_diff(base.keyframe_epoch) < interval.unsigned_abs();
        if offsets.len() != base.count || width != base.width || !after_keyframe {
            self.drop_base();
            return None;
        }
        // Reading the payloads, then arithmetic the compiler vectorizes.
        let compact = fill_words(offsets, width, &mut self.words, &mut self.bytes);
        // Same count and width give as many words as the base has; checked anyway (once per
        // epoch), as a word left out of the differences would not fit `word_bytes`.
        let compact = compact && self.words.len() == base.buffers.words.len();
        if !compact {
            self.drop_base();
            return None;
        }
        let BaseBuffers { words: base_words, differences } = &mut base.buffers;
        let OrderBits { first, second } =
            zigzag_differences(&mut self.words, base_words, differences);
        let (order, word_bytes) = if bytes_to_hold(second) <= bytes_to_hold(first) {
            (DeltaOrder::Second, bytes_to_hold(second))
        } else {
            // The words hold the second-order values.
            zigzag_each(&mut self.words, differences);
            (DeltaOrder::First, bytes_to_hold(first))
        };
        let base_epoch = std::mem::replace(&mut base.epoch, epoch);
        let record = &mut self.record;
        record.run = run;
        record.epoch = epoch;
        record.base_epoch = base_epoch;
        // Fit: the keyframe's full record held as many (its constructor checked them).
        record.count = offsets.len() as u32;
        record.width = width as u32;
        record.word_bytes = word_bytes as u8;
        match word_bytes {
            0 => record.deltas.clear(),
            1 => store_low_bytes::<1>(&self.words, &mut record.deltas),
            2 => store_low_bytes::<2>(&self.words, &mut record.deltas),
            3 => store_low_bytes::<3>(&self.words, &mut record.deltas),
            4 => store_low_bytes::<4>(&self.words, &mut record.deltas),
            5 => store_low_bytes::<5>(&self.words, &mut record.deltas),
            6 => store_low_bytes::<6>(&self.words, &mut record.deltas),
            7 => store_low_bytes::<7>(&self.words, &mut record.deltas),
            _ => store_low_bytes::<8>(&self.words, &mut record.deltas),
        }
        Some(match order {
            DeltaOrder::First => LogRecordRef::OffsetsDelta(&self.record),
            DeltaOrder::Second => LogRecordRef::OffsetsDeltaOfDelta(&self.record),
        })
    }

    /// After a delta [`Self::encode`] made was not appended (the log refused it): the next
    /// record must be full.
    pub(super) fn forget_base(&mut self) {
        self.drop_base();
    }

    /// Leaves no base, keeping its buffers for the next one.
    fn drop_base(&mut self) {
        if let Some(base) = self.base.take() {
            self.spare = base.buffers;
        }
    }

    /// After a full record of `offsets` for `epoch`: it starts a chain if its layout is
    /// compact, else there is none until the next compact full record.
    pub(super) fn full_record_appended(&mut self, epoch: i64, offsets: Offsets<'_>) {
        let width = offsets.first().map_or(0, |(_, payload)| payload.len());
        let mut buffers = match self.base.take() {
            Some(base) => base.buffers,
            None => std::mem::take(&mut self.spare),
        };
        if !fill_words(offsets, width, &mut buffers.words, &mut self.bytes) {
            self.spare = buffers;
            return;
        }
        // A full record moved by nothing, as far as the next delta's second order goes.
        buffers.differences.clear();
        buffers.differences.resize(buffers.words.len(), 0);
        let count = offsets.len();
        self.base = Some(Base { epoch, keyframe_epoch: epoch, count, width, buffers });
    }
}

/// The fewest bytes that hold `bits` (0 for none).
fn bytes_to_hold(bits: u64) -> usize {
    (u64::BITS - bits.leading_zeros()).div_ceil(8) as usize
}

/// Sets `out` to the payloads read as 8-byte words, and returns whether the offsets are words
/// ([`Offsets::are_words`]: the compact layout for a width of 8).
///
/// The ids are not checked here: the offsets say they are `0..len` (the coordinator's side derives
/// it from its first and last ids, `Slots::offsets`). Each payload's length is, as it is read (one
/// comparison the read makes anyway), so that a flag wrong about a payload's width costs a full
/// record rather than a wrong offset in the log: the first payload that is no word ends the gather
/// (`out` then holds anything). This is the first read of an epoch's entries since they were
/// stored, usually from beyond the cache (PERF.md, "Fortieth session").
///
/// Written as a loop that leaves at the first payload that is no word, into slots sized
/// before it: a comparison and a branch per payload, where collecting every word with the
/// flag or'ed took a select per payload (9.5 instructions each against 4.5, PERF.md,
/// "Forty-first session").
fn gather_words(offsets: Offsets<'_>, out: &mut Vec<u64>) -> bool {
    if !offsets.are_words() {
        out.clear();
        return false;
    }
    words_of(offsets.as_slice(), out)
}

/// Sets `out` to the payloads of `entries` as words, and returns true; or returns false at
/// the first payload that is no word (`out` then holds anything).
fn words_of(entries: &[(PartitionId, Payload)], out: &mut Vec<u64>) -> bool {
    // Every slot is written below: only a count other than the last epoch's fills any.
    out.resize(entries.len(), 0);
    // Eight at a time: the loop's own count, step and test once per eight payloads.
    let (slot_groups, slots_left) = out.as_chunks_mut::<8>();
    let (entry_groups, entries_left) = entries.as_chunks::<8>();
    for (slots, entries) in slot_groups.iter_mut().zip(entry_groups) {
        if !read_words(slots, entries) {
            return false;
        }
    }
    read_words(slots_left, entries_left)
}

/// Writes each payload of `entries` as a word to the slot at the same place, until one is no
/// word (then returns false).
#[inline(always)]
fn read_words(slots: &mut [u64], entries: &[(PartitionId, Payload)]) -> bool {
    for (slot, (_, payload)) in slots.iter_mut().zip(entries) {
        let Some(word) = payload.as_i64() else {
            return false;
        };
        *slot = word as u64;
    }
    true
}

/// Reads the payloads as padded little-endian words into `words`, and returns whether the
/// layout is compact (ids `0..count`, every payload `width` bytes; else `words` is garbage).
/// Payloads of 8 bytes are one word each ([`gather_words`]).
fn fill_words(
    offsets: Offsets<'_>,
    width: usize,
    words: &mut Vec<u64>,
    bytes: &mut Vec<u8>,
) -> bool {
    if width == 8 {
        return gather_words(offsets, words);
    }
    words.clear();
    let mut compact = true;
    bytes.clear();
    for (index, (partition, payload)) in offsets.iter().enumerate() {
        let payload = payload.as_bytes();
        compact &= (partition.0 as usize == index) & (payload.len() == width);
        bytes.extend_from_slice(payload);
    }
    words.extend(bytes.chunks(8).map(padded_word));
    compact
}

/// A little-endian word of up to 8 bytes, padded with zeros.
fn padded_word(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(word)
}

/// A chain being decoded: the offsets of its last record as words, from its keyframe on.
#[derive(Debug)]
pub(super) struct ChainDecoder {
    run: u64,
    epoch: i64,
    count: usize,
    width: usize,
    /// Bytes of the concatenated payloads (the last word is padded past them).
    data_len: usize,
    words: Vec<u64>,
    /// What each word moved by in the last record applied (zeros for the keyframe).
    differences: Vec<u64>,
}

impl ChainDecoder {
    /// Starts from a full record, which must have the compact layout (a delta's base always
    /// has it).
    pub(super) fn new(keyframe: &ArchivedOffsetsRecord) -> Result<Self, String> {
        let (count, width) =
            (keyframe.count.to_native() as usize, keyframe.width.to_native() as usize);
        let data = keyframe.data.as_slice();
        if !keyframe.partitions.is_empty()
            || !keyframe.ends.is_empty()
            || count.checked_mul(width) != Some(data.len())
        {
            return Err(format!(
                "the full record of epoch {} is the base of a delta, but it is not compact \
                 ({count} offsets of {width} bytes in {} bytes{})",
                keyframe.epoch.to_native(),
                data.len(),
                if keyframe.partitions.is_empty() { "" } else { ", with partition ids" }
            ));
        }
        Ok(Self {
            run: keyframe.run.to_native(),
            epoch: keyframe.epoch.to_native(),
            count,
            width,
            data_len: data.len(),
            words: data.chunks(8).map(padded_word).collect(),
            differences: vec![0; data.len().div_ceil(8)],
        })
    }

    /// Applies the next delta of the chain, of `order`, checking that it names this base.
    pub(super) fn apply(
        &mut self,
        order: DeltaOrder,
        delta: &ArchivedOffsetsDeltaRecord,
    ) -> Result<(), String> {
        let (run, epoch, base_epoch) =
            (delta.run.to_native(), delta.epoch.to_native(), delta.base_epoch.to_native());
        if self.run != run || self.epoch != base_epoch {
            return Err(format!(
                "the delta of epoch {epoch} (run {run}) names the base of epoch {base_epoch}, \
                 but is applied to the record of epoch {} (run {})",
                self.epoch, self.run
            ));
        }
        let (count, width) = (delta.count.to_native() as usize, delta.width.to_native() as usize);
        if (count, width) != (self.count, self.width) {
            return Err(format!(
                "the delta of epoch {epoch} has {count} offsets of {width} bytes, its base of \
                 epoch {base_epoch} {} offsets of {} bytes",
                self.count, self.width
            ));
        }
        let word_bytes = usize::from(delta.word_bytes);
        let deltas = delta.deltas.as_slice();
        if word_bytes > 8 || deltas.len() != self.words.len() * word_bytes {
            return Err(format!(
                "the delta of epoch {epoch} has {} bytes for {} words of {word_bytes} bytes",
                deltas.len(),
                self.words.len()
            ));
        }
        let encoded = |index: usize| match word_bytes {
            0 => 0,
            _ => padded_word(&deltas[index * word_bytes..][..word_bytes]),
        };
        let moves = self.words.iter_mut().zip(&mut self.differences);
        for (index, (word, difference)) in moves.enumerate() {
            let step = unzigzag(encoded(index));
            *difference = match order {
                DeltaOrder::First => step,
                DeltaOrder::Second => difference.wrapping_add(step),
            };
            *word = word.wrapping_add(*difference);
        }
        let padding = (!self.data_len.is_multiple_of(8)).then(|| self.words.last()).flatten();
        if padding.is_some_and(|last| last >> (self.data_len % 8 * 8) != 0) {
            return Err(format!("the delta of epoch {epoch} sets bytes past its payloads"));
        }
        self.epoch = epoch;
        Ok(())
    }

    /// The offsets of the last record applied (or of the keyframe); an error if a record
    /// cannot hold their count (see [`reserve_offsets`]).
    pub(super) fn offsets(&self) -> Result<Vec<(PartitionId, Payload)>, String> {
        let bytes: Vec<u8> =
            self.words.iter().flat_map(|word| word.to_le_bytes()).take(self.data_len).collect();
        let mut offsets = reserve_offsets(self.count)?;
        offsets.extend((0..self.count).map(|index| {
            let payload = &bytes[index * self.width..][..self.width];
            (PartitionId(index as i32), Payload::from(payload))
        }));
        Ok(offsets)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rkyv::{rancor, util::AlignedVec};

    use super::*;
    use crate::coordinators::epoch::log_record::{
        ArchivedLogRecord, LogRecordRef, OffsetsRecordRef,
    };
    use crate::coordinators::epoch::Offsets;

    type Entries = Vec<(PartitionId, Payload)>;

    #[test]
    fn a_keyframe_claiming_more_offsets_than_a_record_holds_is_an_error_not_an_abort() {
        let bytes = crate::coordinators::epoch::log_record::tests::empty_payloads_record(u32::MAX);
        let ArchivedLogRecord::Offsets(keyframe) =
            rkyv::access::<ArchivedLogRecord, rancor::Error>(&bytes).unwrap()
        else {
            panic!("not offsets")
        };
        let decoder = ChainDecoder::new(keyframe).unwrap();
        let error = decoder.offsets().unwrap_err();
        assert!(error.contains("more than a record holds"), "{error}");
    }

    fn dense(payloads: &[Vec<u8>]) -> Entries {
        payloads
            .iter()
            .enumerate()
            .map(|(index, payload)| (PartitionId(index as i32), Payload::from(payload.clone())))
            .collect()
    }

    fn archived_full(bytes: &[u8]) -> &ArchivedOffsetsRecord {
        match rkyv::access::<ArchivedLogRecord, rancor::Error>(bytes).unwrap() {
            ArchivedLogRecord::Offsets(full) => full,
            _ => panic!("not a full record"),
        }
    }

    fn archived_delta(bytes: &[u8]) -> (DeltaOrder, &ArchivedOffsetsDeltaRecord) {
        as_delta(rkyv::access::<ArchivedLogRecord, rancor::Error>(bytes).unwrap()).expect("a delta")
    }

    const RUN: u64 = 3;

    /// The archived full record of `offsets` for `epoch`.
    fn full(epoch: i64, offsets: &[(PartitionId, Payload)]) -> AlignedVec {
        let full = LogRecordRef::Offsets(OffsetsRecordRef::new(RUN, epoch, offsets).unwrap());
        rkyv::to_bytes::<rancor::Error>(&full).unwrap()
    }

    /// Encodes `epochs` (epoch, offsets) as a run would: the first full, the rest deltas if
    /// they can be. Returns each record's bytes and whether it is a delta.
    fn encode_run(epochs: &[(i64, Entries)]) -> Vec<(AlignedVec, bool)> {
        let mut encoder = DeltaEncoder::default();
        epochs
            .iter()
            .map(|(epoch, offsets)| {
                match encoder.encode(RUN, *epoch, Offsets::new(offsets), KEYFRAME_INTERVAL) {
                    Some(delta) => (rkyv::to_bytes::<rancor::Error>(&delta).unwrap(), true),
                    None => {
                        encoder.full_record_appended(*epoch, Offsets::new(offsets));
                        (full(*epoch, offsets), false)
                    }
                }
            })
            .collect()
    }

    /// Decodes a chain (a full record, then deltas): the offsets after each record.
    fn decode_run(records: &[(AlignedVec, bool)]) -> Result<Vec<Entries>, String> {
        let (keyframe, deltas) = records.split_first().unwrap();
        assert!(!keyframe.1 && deltas.iter().all(|(_, delta)| *delta));
        let mut decoder = ChainDecoder::new(archived_full(&keyframe.0))?;
        let mut decoded = vec![decoder.offsets()?];
        for (delta, _) in deltas {
            let (order, delta) = archived_delta(delta);
            decoder.apply(order, delta)?;
            decoded.push(decoder.offsets()?);
        }
        Ok(decoded)
    }

    /// The size of the delta of `next` after `offsets`, and what it decodes to.
    fn round_trip(
        offsets: &[(PartitionId, Payload)],
        next: &[(PartitionId, Payload)],
    ) -> Option<(usize, Entries)> {
        let records = encode_run(&[(10, offsets.to_vec()), (12, next.to_vec())]);
        if !records[1].1 {
            return None;
        }
        let decoded = decode_run(&records).unwrap();
        Some((archived_delta(&records[1].0).1.deltas.len(), decoded[1].clone()))
    }

    /// Encodes `run` as a run would and checks that every record after the first is a delta
    /// and that the chain decodes to the offsets encoded.
    fn chain_round_trips(run: Vec<(i64, Entries)>) -> Result<(), TestCaseError> {
        let records = encode_run(&run);
        prop_assert!(records.iter().skip(1).all(|(_, delta)| *delta));
        let decoded = decode_run(&records).unwrap();
        let encoded: Vec<Entries> = run.into_iter().map(|(_, offsets)| offsets).collect();
        prop_assert_eq!(decoded, encoded);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xDE17A),
            ..ProptestConfig::default()
        })]
        #[test]
        fn a_chain_of_deltas_decodes_to_the_offsets_it_encoded(
            width in prop_oneof![Just(8usize), 0usize..20],
            rows in prop::collection::vec(prop::collection::vec(any::<[u8; 20]>(), 1..6), 0..30),
        ) {
            // rows[p][e]: partition p's payload in epoch e (as many epochs as the shortest row).
            let epochs = rows.iter().map(Vec::len).min().unwrap_or(1);
            let run: Vec<(i64, Entries)> = (0..epochs)
                .map(|epoch| {
                    let payloads: Vec<Vec<u8>> =
                        rows.iter().map(|row| row[epoch][..width].to_vec()).collect();
                    (epoch as i64, dense(&payloads))
                })
                .collect();
            chain_round_trips(run)?;
        }

        /// Offsets that advance by a step of their own with a jitter, some going back and forth:
        /// runs whose deltas take either order, from one record to the next.
        #[test]
        fn a_chain_of_deltas_of_either_order_decodes_to_the_offsets_it_encoded(
            partitions in prop::collection::vec(
                (any::<i64>(), -(1i64 << 40)..(1 << 40), any::<bool>()), 1..40),
            jitters in prop::collection::vec(
                prop::collection::vec(prop_oneof![Just(0i64), -300i64..300], 40), 2..20),
        ) {
            let run: Vec<(i64, Entries)> = jitters
                .iter()
                .enumerate()
                .map(|(epoch, jitter)| {
                    let at = |(p, &(start, step, back_and_forth)): (usize, &(i64, i64, bool))| {
                        // Back and forth: a step up in odd epochs, back down in even ones.
                        let steps = if back_and_forth { epoch as i64 % 2 } else { epoch as i64 };
                        let offset = start.wrapping_add(step.wrapping_mul(steps));
                        (PartitionId(p as i32), Payload::from(offset.wrapping_add(jitter[p])))
                    };
                    (epoch as i64, partitions.iter().enumerate().map(at).collect())
                })
                .collect();
            chain_round_trips(run)?;
        }
    }

    #[test]
    fn offsets_that_moved_a_little_take_a_few_bytes_each() {
        let base: Vec<Vec<u8>> =
            (0..1000u64).map(|p| (p * 1_000_000_007).to_le_bytes().to_vec()).collect();
        let next: Vec<Vec<u8>> =
            (0..1000u64).map(|p| (p * 1_000_000_007 + 30_000 - p).to_le_bytes().to_vec()).collect();
        let (delta_bytes, decoded) = round_trip(&dense(&base), &dense(&next)).unwrap();
        assert_eq!(decoded, dense(&next));
        // Differences below 2^15 (zigzag: 2^16): two bytes per offset instead of eight.
        assert_eq!(delta_bytes, 2000);
        // Offsets that went back are differences too.
        let (delta_bytes, decoded) = round_trip(&dense(&next), &dense(&base)).unwrap();
        assert_eq!(decoded, dense(&base));
        assert_eq!(delta_bytes, 2000);
        // Unchanged offsets take nothing.
        let (delta_bytes, decoded) = round_trip(&dense(&base), &dense(&base)).unwrap();
        assert_eq!((delta_bytes, decoded), (0, dense(&base)));
    }

    #[test]
    fn each_delta_is_from_the_previous_epoch_and_steady_advances_take_no_bytes() {
        // The load generator's offsets: epoch << 20 | partition. One epoch apart the
        // differences are 2^20 (zigzag 2^21: three bytes; the keyframe 40 epochs back would
        // need four), and each is the difference of the epoch before: no bytes in the second
        // order, after the first delta (whose base, the keyframe, moved by nothing).
        let offsets = |epoch: i64| -> Entries {
            (0..100).map(|p| (PartitionId(p), Payload::from(epoch << 20 | i64::from(p)))).collect()
        };
        let run: Vec<(i64, Entries)> = (0..41).map(|epoch| (epoch, offsets(epoch))).collect();
        let records = encode_run(&run);
        for (epoch, (bytes, is_delta)) in records.iter().enumerate().skip(1) {
            assert!(is_delta, "epoch {epoch}");
            let (order, delta) = archived_delta(bytes);
            assert_eq!(delta.base_epoch.to_native(), epoch as i64 - 1);
            let word_bytes = if epoch == 1 { 3 } else { 0 };
            assert_eq!(order, DeltaOrder::Second, "epoch {epoch}");
            assert_eq!(
                (delta.word_bytes, delta.deltas.len()),
                (word_bytes, word_bytes as usize * 100)
            );
        }
        let decoded = decode_run(&records).unwrap();
        assert_eq!(decoded, run.into_iter().map(|(_, offsets)| offsets).collect::<Vec<_>>());
    }

    #[test]
    fn each_delta_takes_the_order_of_fewer_bytes() {
        // Partition p at p * 1000, then each epoch 5000 * p further, plus 100 in odd epochs:
        // the first differences are 5000p + 100 and 5000p - 100 by turns (zigzag up to about
        // 990 000: three bytes), the second ones 200 and -200 (zigzag 400: two bytes).
        let steady = |epoch: i64| -> Entries {
            (0..100i64)
                .map(|p| (p * 1000 + epoch * 5000 * p + epoch % 2 * 100, p))
                .map(|(offset, p)| (PartitionId(p as i32), Payload::from(offset)))
                .collect()
        };
        // The other way round: each epoch 100 back and forth, so the first differences are
        // +-100 (zigzag 200: one byte), the second ones +-200 (zigzag 400: two).
        let back_and_forth = |epoch: i64| -> Entries {
            (0..100i64)
                .map(|p| (PartitionId(p as i32), Payload::from(p * 1000 + epoch % 2 * 100)))
                .collect()
        };
        for (name, offsets, order, word_bytes) in [
            ("steady", &steady as &dyn Fn(i64) -> Entries, DeltaOrder::Second, 2),
            ("back and forth", &back_and_forth, DeltaOrder::First, 1),
        ] {
            let run: Vec<(i64, Entries)> = (0..6).map(|epoch| (epoch, offsets(epoch))).collect();
            let records = encode_run(&run);
            // The first delta after the keyframe: either order, the same values (a tie).
            assert_eq!(archived_delta(&records[1].0).0, DeltaOrder::Second, "{name}");
            for (epoch, (bytes, _)) in records.iter().enumerate().skip(2) {
                let (got, delta) = archived_delta(bytes);
                assert_eq!((got, delta.word_bytes), (order, word_bytes), "{name}, epoch {epoch}");
            }
            let decoded = decode_run(&records).unwrap();
            assert_eq!(decoded, run.into_iter().map(|(_, offsets)| offsets).collect::<Vec<_>>());
        }
    }

    #[test]
    fn no_delta_without_a_compact_base_of_the_same_shape_and_a_keyframe_nearby() {
        let eight = |count: u8| dense(&(0..count).map(|p| vec![p; 8]).collect::<Vec<_>>());
        let mut encoder = DeltaEncoder::default();
        assert!(
            encoder.encode(1, 5, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_none(),
            "no keyframe"
        );
        let keyframe =
            |encoder: &mut DeltaEncoder| encoder.full_record_appended(5, Offsets::new(&eight(4)));
        keyframe(&mut encoder);
        assert!(encoder.encode(1, 6, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_some());
        assert!(encoder
            .encode(1, 5 + KEYFRAME_INTERVAL - 1, Offsets::new(&eight(4)), KEYFRAME_INTERVAL)
            .is_some());
        assert!(encoder
            .encode(1, 5 + KEYFRAME_INTERVAL, Offsets::new(&eight(4)), KEYFRAME_INTERVAL)
            .is_none());
        assert!(
            encoder.encode(1, 7, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_none(),
            "no base left"
        );
        keyframe(&mut encoder);
        assert!(
            encoder.encode(1, 4, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_none(),
            "before it"
        );
        keyframe(&mut encoder);
        assert!(
            encoder.encode(1, 5, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_none(),
            "its own epoch"
        );
        keyframe(&mut encoder);
        assert!(
            encoder.encode(1, 6, Offsets::new(&eight(4)), 1).is_none(),
            "an interval of 1: no deltas"
        );
        keyframe(&mut encoder);
        assert!(
            encoder.encode(1, 6, Offsets::new(&eight(5)), KEYFRAME_INTERVAL).is_none(),
            "another count"
        );
        keyframe(&mut encoder);
        let sixteen = dense(&(0..4u8).map(|p| vec![p; 16]).collect::<Vec<_>>());
        assert!(
            encoder.encode(1, 6, Offsets::new(&sixteen), KEYFRAME_INTERVAL).is_none(),
            "another width"
        );
        keyframe(&mut encoder);
        let mut sparse = eight(4);
        sparse[3].0 = PartitionId(7);
        assert!(
            encoder.encode(1, 6, Offsets::new(&sparse), KEYFRAME_INTERVAL).is_none(),
            "sparse ids"
        );
        keyframe(&mut encoder);
        let mut ragged = eight(4);
        ragged[2].1 = Payload::from(&b"short"[..]);
        assert!(
            encoder.encode(1, 6, Offsets::new(&ragged), KEYFRAME_INTERVAL).is_none(),
            "ragged payloads"
        );
        // A full record that is not compact starts no chain.
        encoder.full_record_appended(6, Offsets::new(&sparse));
        assert!(encoder.encode(1, 7, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_none());
        encoder.full_record_appended(6, Offsets::new(&ragged));
        assert!(
            encoder.encode(1, 7, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_none(),
            "ragged keyframe"
        );
        let mut negative = eight(4);
        negative[0].0 = PartitionId(-1);
        encoder.full_record_appended(6, Offsets::new(&negative));
        assert!(
            encoder.encode(1, 7, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_none(),
            "negative id"
        );
        encoder.full_record_appended(6, Offsets::new(&eight(4)));
        assert!(
            encoder.encode(1, 7, Offsets::new(&eight(4)), KEYFRAME_INTERVAL).is_some(),
            "compact again"
        );
    }

    /// The gather reads every payload of every count around its group of eight, and stops at
    /// a payload that is no word wherever it is (a flag wrong about the widths then costs a
    /// full record, not a wrong offset).
    #[test]
    fn words_are_gathered_until_a_payload_that_is_no_word() {
        for count in [0usize, 1, 7, 8, 9, 16, 17, 1000] {
            let entries: Entries = (0..count)
                .map(|p| (PartitionId(p as i32), Payload::from(p as i64 * 3 - 7)))
                .collect();
            let want: Vec<u64> = (0..count).map(|p| (p as i64 * 3 - 7) as u64).collect();
            // A dirty buffer of another length, then one of the same length.
            for mut out in [vec![u64::MAX; 3], vec![u64::MAX; count]] {
                assert!(words_of(&entries, &mut out), "{count} words");
                assert_eq!(out, want, "{count} words");
            }
            for at in (0..count).filter(|at| *at < 18 || *at == count - 1) {
                for other in [Payload::from(&[1u8; 7][..]), Payload::from(vec![1u8; 40])] {
                    let mut bad = entries.clone();
                    bad[at].1 = other;
                    assert!(!words_of(&bad, &mut Vec::new()), "{count} words, no word at {at}");
                }
            }
        }
    }

    #[test]
    fn a_delta_applied_to_another_base_is_refused_with_both_epochs() {
        let base = dense(&[vec![1; 8], vec![2; 8]]);
        let records = encode_run(&[(10, base.clone()), (11, base.clone()), (12, base.clone())]);
        // The delta of epoch 12 names epoch 11 as its base; applied to the keyframe of 10.
        let mut decoder = ChainDecoder::new(archived_full(&records[0].0)).unwrap();
        let (order, delta) = archived_delta(&records[2].0);
        let error = decoder.apply(order, delta).unwrap_err();
        assert!(error.contains("epoch 11") && error.contains("epoch 10"), "{error}");
        // Of the right epoch but another run.
        let other_run = full(11, &base);
        let mut decoder = ChainDecoder::new(archived_full(&other_run)).unwrap();
        let mut delta: OffsetsDeltaRecord =
            rkyv::deserialize::<_, rancor::Error>(archived_delta(&records[2].0).1).unwrap();
        delta.run = RUN + 1;
        let delta = rkyv::to_bytes::<rancor::Error>(&LogRecordRef::OffsetsDelta(&delta)).unwrap();
        let (order, delta) = archived_delta(&delta);
        let error = decoder.apply(order, delta).unwrap_err();
        assert!(error.contains("run 4") && error.contains("run 3"), "{error}");
    }

    #[test]
    fn a_full_record_that_is_not_compact_is_no_base() {
        let sparse = vec![(PartitionId(0), Payload::from(1)), (PartitionId(5), Payload::from(2))];
        let error = ChainDecoder::new(archived_full(&full(4, &sparse))).unwrap_err();
        assert_eq!(
            error,
            "the full record of epoch 4 is the base of a delta, but it is not compact \
             (2 offsets of 8 bytes in 16 bytes, with partition ids)"
        );
    }
}
