//! Delta offsets records: most epochs' offsets are logged as the difference from a recent full
//! record of the same run (a "keyframe"), in a fraction of the bytes.
//!
//! # Why
//! With group commit paced (module `wal::writer::pacing`), what a durable epoch run spends
//! beyond the in-memory one grows with the bytes it logs: about a microsecond of kernel CPU
//! per KiB made durable on this machine class, mostly ext4 converting the unwritten extents of
//! preallocated segments (PERF.md, EpochCoordinator, "Fourteenth session"). A full offsets
//! record of 1000 partitions with 8-byte offsets is 8 KiB per epoch. But a partition's offset moves by one epoch's progress
//! from one epoch to the next, so the difference from a recent epoch's offset needs a few low
//! bytes, not eight.
//!
//! # Encoding
//! The concatenated payloads are read as little-endian 8-byte words (the last one padded with
//! zeros). Each word is stored as the zigzag encoding of its wrapping difference from the
//! keyframe's word at the same place, in the fewest bytes that hold the largest such value in
//! the record (`word_bytes`, one width for the whole record: no per-word length to decode, and
//! the encoder is two straight passes). For 8-byte offsets this is exactly "offset minus the
//! keyframe's offset"; for other payloads it is still lossless, only less compact.
//!
//! # Keyframes
//! A run's first offsets record is full, and so is every record that cannot be a delta: the
//! layout is not compact (ids `0..count`, one payload width), the count or width differs from
//! the keyframe's, or the epoch is [`KEYFRAME_INTERVAL`] or more away from the keyframe's (the
//! further, the larger the differences). Each full compact record becomes the keyframe of the
//! deltas after it; a full record that is not compact leaves none. So a delta's base is always
//! the last full record its run appended before it, which recovery tracks in one pass.
//!
//! # Why a keyframe survives cleaning
//! The log keeps every segment holding an epoch at or above `D + 1 - retained_epochs`, with `D`
//! the last durable commit (module `durable`). Recovery needs the offsets of the last commit it
//! finds, `E >= D`, and so the keyframe of `E`'s delta, whose epoch `k` is above
//! `E - interval`. With an interval of at most `retained_epochs`, `k > D - retained_epochs`:
//! its segment is kept. A crash that cuts the log keeps a prefix, and a keyframe precedes its
//! deltas. Only a log opened with corrupted segments skipped can miss a base; opening then
//! fails with [`super::EpochError::BadLogRecord`] if the restart point needs it.

use super::{
    log_record::{ArchivedOffsetsDeltaRecord, ArchivedOffsetsRecord, OffsetsDeltaRecord},
    PartitionId, Payload,
};

/// Most epochs between a delta and its keyframe (exclusive), unless the log retains fewer.
pub(super) const KEYFRAME_INTERVAL: i64 = 16;

/// The run's keyframe and the buffers of the delta being built, kept across epochs.
#[derive(Debug, Default)]
pub(super) struct DeltaEncoder {
    keyframe: Option<Keyframe>,
    /// The current epoch's words, then their encoded differences.
    words: Vec<u64>,
    /// The payloads concatenated (keyframes, and deltas of widths other than 8).
    bytes: Vec<u8>,
    record: OffsetsDeltaRecord,
}

/// The last full record of the run, in the compact layout.
#[derive(Debug)]
struct Keyframe {
    epoch: i64,
    count: usize,
    width: usize,
    words: Vec<u64>,
}

impl DeltaEncoder {
    /// The delta record of `offsets` for `epoch`, if they can be one (module doc,
    /// "Keyframes"; `interval` is [`KEYFRAME_INTERVAL`] or the log's retained epochs, if fewer).
    pub(super) fn encode(
        &mut self,
        run: u64,
        epoch: i64,
        offsets: &[(PartitionId, Payload)],
        interval: i64,
    ) -> Option<&OffsetsDeltaRecord> {
        let keyframe = self.keyframe.as_ref()?;
        let width = offsets.first().map_or(0, |(_, payload)| payload.len());
        if offsets.len() != keyframe.count
            || width != keyframe.width
            || epoch.abs_diff(keyframe.epoch) >= interval.unsigned_abs()
        {
            return None;
        }
        let all_bits = if width == 8 {
            differences_of_words(offsets, &keyframe.words, &mut self.words)?
        } else {
            if !fill_words(offsets, width, &mut self.words, &mut self.bytes) {
                return None;
            }
            let mut all_bits = 0u64;
            for (word, base) in self.words.iter_mut().zip(&keyframe.words) {
                *word = zigzag(word.wrapping_sub(*base));
                all_bits |= *word;
            }
            all_bits
        };
        let word_bytes = (u64::BITS - all_bits.leading_zeros()).div_ceil(8) as usize;
        let record = &mut self.record;
        record.run = run;
        record.epoch = epoch;
        record.base_epoch = keyframe.epoch;
        // Fit: the keyframe's full record held as many (its constructor checked them).
        record.count = offsets.len() as u32;
        record.width = width as u32;
        record.word_bytes = word_bytes as u8;
        record.deltas.clear();
        record.deltas.resize(self.words.len() * word_bytes, 0);
        match word_bytes {
            0 => {}
            1 => store_low_bytes::<1>(&self.words, &mut record.deltas),
            2 => store_low_bytes::<2>(&self.words, &mut record.deltas),
            3 => store_low_bytes::<3>(&self.words, &mut record.deltas),
            4 => store_low_bytes::<4>(&self.words, &mut record.deltas),
            5 => store_low_bytes::<5>(&self.words, &mut record.deltas),
            6 => store_low_bytes::<6>(&self.words, &mut record.deltas),
            7 => store_low_bytes::<7>(&self.words, &mut record.deltas),
            _ => store_low_bytes::<8>(&self.words, &mut record.deltas),
        }
        Some(&self.record)
    }

    /// After a full record of `offsets` for `epoch`: it becomes the keyframe if its layout is
    /// compact, else there is none until the next compact full record.
    pub(super) fn full_record_appended(&mut self, epoch: i64, offsets: &[(PartitionId, Payload)]) {
        let width = offsets.first().map_or(0, |(_, payload)| payload.len());
        let mut keyframe = self.keyframe.take().map_or_else(Vec::new, |keyframe| keyframe.words);
        if fill_words(offsets, width, &mut keyframe, &mut self.bytes) {
            self.keyframe = Some(Keyframe { epoch, count: offsets.len(), width, words: keyframe });
        }
    }
}

/// For payloads of 8 bytes, one word each: the zigzag differences from `base` into `out`, in
/// one pass, and all their bits or'ed; `None` if the layout is not compact (ids `0..count`,
/// every payload 8 bytes).
fn differences_of_words(
    offsets: &[(PartitionId, Payload)],
    base: &[u64],
    out: &mut Vec<u64>,
) -> Option<u64> {
    out.clear();
    out.resize(offsets.len(), 0);
    let (mut all_bits, mut compact) = (0u64, true);
    for (index, ((slot, (partition, payload)), base)) in
        out.iter_mut().zip(offsets).zip(base).enumerate()
    {
        let payload = payload.as_bytes();
        // `&`, not `&&`: no branch per payload.
        compact &= (partition.0 as usize == index) & (payload.len() == 8);
        let word = payload.first_chunk::<8>().map_or(0, |word| u64::from_le_bytes(*word));
        *slot = zigzag(word.wrapping_sub(*base));
        all_bits |= *slot;
    }
    compact.then_some(all_bits)
}

/// Stores the `N` low bytes of each word, little-endian, into `out` (`N` bytes per word).
fn store_low_bytes<const N: usize>(words: &[u64], out: &mut [u8]) {
    for (slot, word) in out.chunks_exact_mut(N).zip(words) {
        slot.copy_from_slice(&word.to_le_bytes()[..N]);
    }
}

/// Reads the payloads as padded little-endian words into `words`, and returns whether the
/// layout is compact (ids `0..count`, every payload `width` bytes; else `words` is garbage).
fn fill_words(
    offsets: &[(PartitionId, Payload)],
    width: usize,
    words: &mut Vec<u64>,
    bytes: &mut Vec<u8>,
) -> bool {
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

fn zigzag(difference: u64) -> u64 {
    (difference << 1) ^ ((difference as i64 >> 63) as u64)
}

fn unzigzag(encoded: u64) -> u64 {
    (encoded >> 1) ^ 0u64.wrapping_sub(encoded & 1)
}

/// The offsets a delta record stands for, from its base (the run's last full record before
/// it, which the caller found), checking that the two agree.
pub(super) fn decode_delta(
    base: &ArchivedOffsetsRecord,
    delta: &ArchivedOffsetsDeltaRecord,
) -> Result<Vec<(PartitionId, Payload)>, String> {
    let (run, epoch, base_epoch) =
        (delta.run.to_native(), delta.epoch.to_native(), delta.base_epoch.to_native());
    if base.run.to_native() != run || base.epoch.to_native() != base_epoch {
        return Err(format!(
            "the delta of epoch {epoch} (run {run}) names the base of epoch {base_epoch}, but \
             the run's last full record is of epoch {} (run {})",
            base.epoch.to_native(),
            base.run.to_native()
        ));
    }
    let count = delta.count.to_native() as usize;
    let width = delta.width.to_native() as usize;
    let data = base.data.as_slice();
    if !base.partitions.is_empty()
        || !base.ends.is_empty()
        || base.count.to_native() as usize != count
        || base.width.to_native() as usize != width
        || count.checked_mul(width) != Some(data.len())
    {
        return Err(format!(
            "the delta of epoch {epoch} has {count} offsets of {width} bytes, its base of \
             epoch {base_epoch} {} offsets of {} bytes in {} bytes{}",
            base.count.to_native(),
            base.width.to_native(),
            data.len(),
            if base.partitions.is_empty() && base.ends.is_empty() { "" } else { ", not compact" }
        ));
    }
    let word_bytes = usize::from(delta.word_bytes);
    let deltas = delta.deltas.as_slice();
    let words = data.len().div_ceil(8);
    if word_bytes > 8 || deltas.len() != words * word_bytes {
        return Err(format!(
            "the delta of epoch {epoch} has {} bytes for {words} words of {word_bytes} bytes",
            deltas.len()
        ));
    }
    let mut decoded = Vec::with_capacity(words * 8);
    for (index, base_word) in data.chunks(8).enumerate() {
        let difference = unzigzag(padded_word(&deltas[index * word_bytes..][..word_bytes]));
        let word = padded_word(base_word).wrapping_add(difference);
        decoded.extend_from_slice(&word.to_le_bytes());
    }
    if decoded[data.len()..].iter().any(|&byte| byte != 0) {
        return Err(format!("the delta of epoch {epoch} sets bytes past its payloads"));
    }
    decoded.truncate(data.len());
    Ok((0..count)
        .map(|index| (PartitionId(index as i32), Payload::from(&decoded[index * width..][..width])))
        .collect())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rkyv::{rancor, util::AlignedVec};

    use super::*;
    use crate::coordinators::epoch::log_record::{
        ArchivedLogRecord, LogRecordRef, OffsetsRecordRef,
    };

    type Offsets = Vec<(PartitionId, Payload)>;

    fn dense(payloads: &[Vec<u8>]) -> Offsets {
        payloads
            .iter()
            .enumerate()
            .map(|(index, payload)| (PartitionId(index as i32), Payload::from(payload.clone())))
            .collect()
    }

    /// The archived full record and delta, from their bytes.
    fn archived<'a>(
        full: &'a [u8],
        delta: &'a [u8],
    ) -> (&'a ArchivedOffsetsRecord, &'a ArchivedOffsetsDeltaRecord) {
        let full = rkyv::access::<ArchivedLogRecord, rancor::Error>(full).unwrap();
        let delta = rkyv::access::<ArchivedLogRecord, rancor::Error>(delta).unwrap();
        match (full, delta) {
            (ArchivedLogRecord::Offsets(full), ArchivedLogRecord::OffsetsDelta(delta)) => {
                (full, delta)
            }
            _ => panic!("unexpected record kinds"),
        }
    }

    /// Archives the full record of `offsets` (epoch `base_epoch`) and the delta of `next`
    /// against the keyframe of epoch 10 (if one is made): their bytes.
    fn full_and_delta(
        base_epoch: i64,
        offsets: &[(PartitionId, Payload)],
        next: &[(PartitionId, Payload)],
    ) -> Option<(AlignedVec, AlignedVec)> {
        let run = 3;
        let full = LogRecordRef::Offsets(OffsetsRecordRef::new(run, base_epoch, offsets).unwrap());
        let full = rkyv::to_bytes::<rancor::Error>(&full).unwrap();
        let mut encoder = DeltaEncoder::default();
        encoder.full_record_appended(10, offsets);
        let delta = encoder.encode(run, 12, next, KEYFRAME_INTERVAL)?;
        let delta = rkyv::to_bytes::<rancor::Error>(&LogRecordRef::OffsetsDelta(delta)).unwrap();
        Some((full, delta))
    }

    /// The size of the delta of `next` against `offsets`, and what it decodes to.
    fn round_trip(
        offsets: &[(PartitionId, Payload)],
        next: &[(PartitionId, Payload)],
    ) -> Option<(usize, Offsets)> {
        let (full, delta) = full_and_delta(10, offsets, next)?;
        let (full, delta) = archived(&full, &delta);
        Some((delta.deltas.len(), decode_delta(full, delta).unwrap()))
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xDE17A),
            ..ProptestConfig::default()
        })]
        #[test]
        fn a_delta_decodes_to_the_offsets_it_encoded(
            width in prop_oneof![Just(8usize), 0usize..20],
            pairs in prop::collection::vec((any::<[u8; 20]>(), any::<[u8; 20]>()), 0..40),
        ) {
            let base: Vec<Vec<u8>> = pairs.iter().map(|(a, _)| a[..width].to_vec()).collect();
            let next: Vec<Vec<u8>> = pairs.iter().map(|(_, b)| b[..width].to_vec()).collect();
            let (_, decoded) = round_trip(&dense(&base), &dense(&next)).expect("a delta");
            prop_assert_eq!(decoded, dense(&next));
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
    fn no_delta_without_a_compact_keyframe_of_the_same_shape_nearby() {
        let eight = |count: u8| dense(&(0..count).map(|p| vec![p; 8]).collect::<Vec<_>>());
        let mut encoder = DeltaEncoder::default();
        assert!(encoder.encode(1, 5, &eight(4), KEYFRAME_INTERVAL).is_none(), "no keyframe");
        encoder.full_record_appended(5, &eight(4));
        assert!(encoder
            .encode(1, 5 + KEYFRAME_INTERVAL - 1, &eight(4), KEYFRAME_INTERVAL)
            .is_some());
        assert!(encoder
            .encode(1, 5 - KEYFRAME_INTERVAL + 1, &eight(4), KEYFRAME_INTERVAL)
            .is_some());
        assert!(encoder.encode(1, 5 + KEYFRAME_INTERVAL, &eight(4), KEYFRAME_INTERVAL).is_none());
        assert!(encoder.encode(1, 6, &eight(4), 1).is_none(), "an interval of 1: no deltas");
        assert!(encoder.encode(1, 6, &eight(5), KEYFRAME_INTERVAL).is_none(), "another count");
        let sixteen = dense(&(0..4u8).map(|p| vec![p; 16]).collect::<Vec<_>>());
        assert!(encoder.encode(1, 6, &sixteen, KEYFRAME_INTERVAL).is_none(), "another width");
        let mut sparse = eight(4);
        sparse[3].0 = PartitionId(7);
        assert!(encoder.encode(1, 6, &sparse, KEYFRAME_INTERVAL).is_none(), "sparse ids");
        let mut ragged = eight(4);
        ragged[2].1 = Payload::from(&b"short"[..]);
        assert!(encoder.encode(1, 6, &ragged, KEYFRAME_INTERVAL).is_none(), "ragged payloads");
        // A full record that is not compact leaves no keyframe.
        encoder.full_record_appended(6, &sparse);
        assert!(encoder.encode(1, 7, &eight(4), KEYFRAME_INTERVAL).is_none());
    }

    #[test]
    fn a_delta_whose_base_does_not_match_is_refused_with_both_epochs() {
        let base = dense(&[vec![1; 8], vec![2; 8]]);
        // The delta was made against a keyframe of epoch 10; the full record given is of 9.
        let (full, delta) = full_and_delta(9, &base, &base).unwrap();
        let (full, delta) = archived(&full, &delta);
        let error = decode_delta(full, delta).unwrap_err();
        assert!(error.contains("epoch 10") && error.contains("epoch 9"), "{error}");
    }
}
