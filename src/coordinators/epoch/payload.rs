//! [`Payload`]: the engine's opaque bytes (a reader's partition offset, a writer's commit
//! message), the identifier newtypes [`Epoch`] and [`PartitionId`], and [`Offsets`], one
//! epoch's offsets as the query receives them.
//!
//! The coordinator never looks inside a payload; it stores it, hands it back to the query or the
//! sink, and drops it. Most engines' offsets and commit messages are a few machine words (a
//! Kafka offset is one `i64`), so a payload of up to [`Payload::INLINE_BYTES`] bytes lives inline
//! in the value (a `smallvec` with the `union` layout, 32 bytes in all) and costs no allocation;
//! longer ones spill to the heap.

use std::{fmt, ops::Deref};

use smallvec::SmallVec;

/// An epoch number (Spark's `Long` epoch id). Epochs of one continuous run start at the
/// coordinator's start epoch and are committed in strictly increasing, gap-free order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Epoch(pub i64);

impl Epoch {
    /// The next epoch, or `None` at `i64::MAX`.
    #[inline]
    pub fn next(self) -> Option<Epoch> {
        self.0.checked_add(1).map(Epoch)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(formatter)
    }
}

impl From<i64> for Epoch {
    fn from(value: i64) -> Self {
        Self(value)
    }
}

/// A partition id (Spark's `Int`). Valid ids are `0 .. count` of the partition count the
/// query set; anything else that arrives is bad input and is dropped (and counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PartitionId(pub i32);

impl fmt::Display for PartitionId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(formatter)
    }
}

impl From<i32> for PartitionId {
    fn from(value: i32) -> Self {
        Self(value)
    }
}

/// Opaque bytes of the engine: a partition offset or a writer commit message.
///
/// Up to [`Payload::INLINE_BYTES`] bytes are stored inline (no allocation). Integers convert to
/// their 8-byte little-endian encoding; `i32`/`u32` are widened first, so `Payload::from(42)`
/// equals `Payload::from(42i64)` and [`Payload::as_i64`] reads any of them back.
///
/// ```
/// use coordbus::coordinators::epoch::Payload;
/// let offset: Payload = 42.into();
/// assert_eq!(offset.as_i64(), Some(42));
/// assert!(offset.is_inline());
/// let message = Payload::from(b"writer-commit");
/// assert_eq!(message.as_bytes(), b"writer-commit");
/// let offset_json: Payload = r#"{"topic":{"0":42}}"#.into();
/// assert!(offset_json.is_inline()); // 18 bytes
/// let large: Payload = "x".repeat(100).into();
/// assert!(!large.is_inline() && large.len() == 100);
/// ```
#[derive(PartialEq, Eq, Hash, Default)]
pub struct Payload(SmallVec<[u8; Payload::INLINE_BYTES]>);

impl Payload {
    /// Payloads up to this many bytes are stored without an allocation.
    pub const INLINE_BYTES: usize = 24;

    /// An empty payload.
    #[inline]
    pub fn new() -> Self {
        Self(SmallVec::new())
    }

    /// The bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Number of bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the bytes are stored inline (no heap allocation).
    #[inline]
    pub fn is_inline(&self) -> bool {
        !self.0.spilled()
    }

    /// The bytes as text, if they are valid UTF-8 (a payload made from a `&str` or `String`).
    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(self.as_bytes()).ok()
    }

    /// The bytes as a vector.
    pub fn into_vec(self) -> Vec<u8> {
        self.0.into_vec()
    }

    /// Whether the payload is exactly 8 bytes (what [`Payload::as_i64`] reads). One comparison:
    /// an 8-byte payload is always inline (see `as_i64`).
    #[inline]
    pub fn is_word(&self) -> bool {
        !self.0.spilled() && self.0.len() == 8
    }

    /// The payload read as an integer written by `From<i64>` (or `i32`, `u64`, `u32`): `Some`
    /// exactly when it is 8 bytes long.
    #[inline]
    pub fn as_i64(&self) -> Option<i64> {
        // An 8-byte payload is always inline (every constructor keeps payloads of up to
        // `INLINE_BYTES` inline, `From<Vec<u8>>` included). Saying so first lets the compiler
        // drop the inline-or-heap choice of the length and the data pointer that follow: the
        // read is one comparison and one load, which the durable epoch log does for every
        // offset of every epoch (module `delta`).
        if self.0.spilled() {
            return None;
        }
        let bytes: &[u8; 8] = self.0.as_slice().try_into().ok()?;
        Some(i64::from_le_bytes(*bytes))
    }
}

impl Clone for Payload {
    /// Copies the bytes with one `memcpy` (smallvec's own `clone` copies byte by byte).
    #[inline]
    fn clone(&self) -> Self {
        Self(SmallVec::from_slice(self.as_bytes()))
    }
}

impl fmt::Debug for Payload {
    /// Text (printable UTF-8, as JSON offsets are) as a string; an 8-byte payload as the
    /// integer it encodes; 8 bytes of printable text both ways (`Payload("w1-e0001" |
    /// 3544...)`); anything else in hex. A non-negative integer below 2^56 has a zero byte,
    /// so it never reads as text.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.as_str().filter(|text| !text.chars().any(char::is_control));
        match (text, self.as_i64()) {
            (Some(text), Some(value)) => return write!(formatter, "Payload({text:?} | {value})"),
            (Some(text), None) => return write!(formatter, "Payload({text:?})"),
            (None, Some(value)) => return write!(formatter, "Payload({value})"),
            (None, None) => {}
        }
        write!(formatter, "Payload(0x")?;
        for byte in self.as_bytes() {
            write!(formatter, "{byte:02x}")?;
        }
        write!(formatter, ")")
    }
}

impl From<i64> for Payload {
    #[inline]
    fn from(value: i64) -> Self {
        Self(SmallVec::from_slice(&value.to_le_bytes()))
    }
}

impl From<u64> for Payload {
    #[inline]
    fn from(value: u64) -> Self {
        Self(SmallVec::from_slice(&value.to_le_bytes()))
    }
}

impl From<i32> for Payload {
    #[inline]
    fn from(value: i32) -> Self {
        Self::from(i64::from(value))
    }
}

impl From<u32> for Payload {
    #[inline]
    fn from(value: u32) -> Self {
        Self::from(u64::from(value))
    }
}

impl From<&[u8]> for Payload {
    #[inline]
    fn from(bytes: &[u8]) -> Self {
        Self(SmallVec::from_slice(bytes))
    }
}

impl<const N: usize> From<&[u8; N]> for Payload {
    #[inline]
    fn from(bytes: &[u8; N]) -> Self {
        Self::from(&bytes[..])
    }
}

impl From<&str> for Payload {
    /// The string's UTF-8 bytes (an engine's offsets are often JSON, as Spark's are).
    #[inline]
    fn from(text: &str) -> Self {
        Self::from(text.as_bytes())
    }
}

impl From<String> for Payload {
    /// The string's UTF-8 bytes, keeping its allocation as `From<Vec<u8>>` does.
    #[inline]
    fn from(text: String) -> Self {
        Self::from(text.into_bytes())
    }
}

impl From<Vec<u8>> for Payload {
    /// Keeps the vector's allocation when it is longer than the inline size; copies it inline
    /// otherwise.
    #[inline]
    fn from(bytes: Vec<u8>) -> Self {
        if bytes.len() <= Self::INLINE_BYTES {
            Self(SmallVec::from_slice(&bytes))
        } else {
            Self(SmallVec::from_vec(bytes))
        }
    }
}

/// One epoch's offsets as the coordinator hands them to
/// [`Query::add_offsets`](super::Query::add_offsets): one entry per reader partition, sorted by
/// partition id. It derefs to the slice of entries, and also says whether they are **words**:
/// ids exactly `0..len` and every payload 8 bytes (an `i64` offset per partition, the common
/// case). A query that stores offsets by partition, as the durable log does, can then take each
/// entry's position as its id instead of checking ids one by one (the durable log still checks
/// each payload's length as it reads the word).
///
/// Why the coordinator says it rather than the query checking: the coordinator's dense layout
/// has the ids by construction and notes a payload that is not 8 bytes as it stores it, by a
/// comparison it made anyway, while a check by the query reads every entry's id again, on
/// entries that have usually left the cache by the time the epoch completes (PERF.md,
/// "Fortieth session").
///
/// ```
/// use coordbus::coordinators::epoch::{Offsets, PartitionId, Payload};
/// let entries = [(PartitionId(0), Payload::from(10)), (PartitionId(1), Payload::from(12))];
/// let offsets = Offsets::new(&entries);
/// assert!(offsets.are_words());
/// assert_eq!(offsets.len(), 2);
/// assert_eq!(offsets[1].1.as_i64(), Some(12));
/// let gap = [(PartitionId(0), Payload::from(10)), (PartitionId(2), Payload::from(12))];
/// assert!(!Offsets::new(&gap).are_words());
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Offsets<'a> {
    entries: &'a [(PartitionId, Payload)],
    words: bool,
}

impl<'a> Offsets<'a> {
    /// The offsets of `entries` (sorted by partition id), read once to find whether they are
    /// words.
    pub fn new(entries: &'a [(PartitionId, Payload)]) -> Self {
        Self { entries, words: are_words(entries) }
    }

    /// The offsets of `entries`, sorted by partition id with no id twice, of which
    /// `only_words_stored` says whether every payload is an 8-byte word (checked in debug
    /// builds). Without a read: sorted distinct ids are exactly `0..len` when the first is 0
    /// and the last `len - 1`.
    pub(super) fn of_sorted_distinct(
        entries: &'a [(PartitionId, Payload)],
        only_words_stored: bool,
    ) -> Self {
        let ids_are_positions = match (entries.first(), entries.last()) {
            (Some((first, _)), Some((last, _))) => {
                first.0 == 0 && i64::from(last.0) + 1 == entries.len() as i64
            }
            _ => true,
        };
        let words = only_words_stored && ids_are_positions;
        debug_assert_eq!(words, are_words(entries), "the side's note of its words is wrong");
        Self { entries, words }
    }

    /// The entries, sorted by partition id.
    #[inline]
    pub fn as_slice(&self) -> &'a [(PartitionId, Payload)] {
        self.entries
    }

    /// Whether the ids are exactly `0..len` and every payload is 8 bytes
    /// ([`Payload::is_word`]).
    #[inline]
    pub fn are_words(&self) -> bool {
        self.words
    }
}

impl Deref for Offsets<'_> {
    type Target = [(PartitionId, Payload)];

    #[inline]
    fn deref(&self) -> &Self::Target {
        self.entries
    }
}

impl<'a> From<&'a [(PartitionId, Payload)]> for Offsets<'a> {
    fn from(entries: &'a [(PartitionId, Payload)]) -> Self {
        Self::new(entries)
    }
}

impl<'a> From<&'a Vec<(PartitionId, Payload)>> for Offsets<'a> {
    fn from(entries: &'a Vec<(PartitionId, Payload)>) -> Self {
        Self::new(entries)
    }
}

impl<'a> IntoIterator for Offsets<'a> {
    type Item = &'a (PartitionId, Payload);
    type IntoIter = std::slice::Iter<'a, (PartitionId, Payload)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter()
    }
}

fn are_words(entries: &[(PartitionId, Payload)]) -> bool {
    entries
        .iter()
        .enumerate()
        .all(|(index, (partition, payload))| partition.0 as usize == index && payload.is_word())
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_payloads_are_inline_and_32_bytes() {
        assert_eq!(std::mem::size_of::<Payload>(), 32);
        assert!(Payload::from(7i64).is_inline());
        assert!(Payload::from(&[1u8; 24][..]).is_inline());
        assert!(Payload::from(vec![9u8; 3]).is_inline());
        assert!(!Payload::from(&[1u8; 25][..]).is_inline());
    }

    #[test]
    fn integers_round_trip_and_widen() {
        assert_eq!(Payload::from(42), Payload::from(42i64));
        assert_eq!(Payload::from(-5i32).as_i64(), Some(-5));
        assert_eq!(Payload::from(7u32).as_i64(), Some(7));
        assert_eq!(Payload::from(u64::MAX).as_i64(), Some(-1));
        assert_eq!(Payload::from(&b"abc"[..]).as_i64(), None);
        assert_eq!(Payload::from(vec![1u8; 40]).into_vec(), vec![1u8; 40]);
        assert_eq!(Payload::from(b"abc"), Payload::from(&b"abc"[..]));
        assert_eq!(Payload::from("abc"), Payload::from(&b"abc"[..]));
        assert_eq!(Payload::from(String::from("abc")), Payload::from(&b"abc"[..]));
        assert!(Payload::from("a".repeat(24)).is_inline());
        assert_eq!(Payload::from("w1-e201").as_str(), Some("w1-e201"));
        assert_eq!(Payload::from(&[0xffu8, 0][..]).as_str(), None);
        assert!(!Payload::from("a".repeat(25)).is_inline());
        assert!(Payload::new().is_empty());
    }

    #[test]
    fn offsets_are_words_only_with_ids_0_to_len_and_8_byte_payloads() {
        let word = |partition: i32, value: i64| (PartitionId(partition), Payload::from(value));
        assert!(Offsets::new(&[]).are_words());
        assert!(Offsets::new(&[word(0, 5), word(1, -3), word(2, 0)]).are_words());
        // An id that is not its index: a gap, a start above 0, a negative id.
        assert!(!Offsets::new(&[word(0, 5), word(2, 6)]).are_words());
        assert!(!Offsets::new(&[word(1, 5), word(2, 6)]).are_words());
        assert!(!Offsets::new(&[word(-1, 5)]).are_words());
        // A payload of another width, short, long inline, or on the heap.
        for width in [0, 7, 9, 24, 40] {
            let other = (PartitionId(1), Payload::from(vec![1u8; width]));
            assert!(!Offsets::new(&[word(0, 5), other]).are_words(), "width {width}");
        }
        let entries = vec![word(0, 5), word(1, 6)];
        let offsets = Offsets::from(&entries);
        assert!(offsets.are_words() && Offsets::from(&entries[..1]).are_words());
        assert_eq!(offsets.as_slice().len(), 2);
        let ids: Vec<i32> = offsets.into_iter().map(|(partition, _)| partition.0).collect();
        assert_eq!(ids, [0, 1]);
        assert_eq!(
            offsets.iter().map(|(_, payload)| payload.as_i64()).collect::<Vec<_>>(),
            [Some(5), Some(6)]
        );
        assert!(Payload::from(1u32).is_word());
        assert!(!Payload::from(vec![1u8; 8 + 24]).is_word());
    }

    /// Text shows as text (8 bytes of it too), integers as integers, other bytes as hex.
    #[test]
    fn debug_shows_text_integers_and_bytes() {
        let debug = |payload: Payload| format!("{payload:?}");
        assert_eq!(debug(Payload::from("w10-e2011")), r#"Payload("w10-e2011")"#);
        // Eight printable bytes: text or an integer, both shown.
        assert_eq!(
            debug(Payload::from(0x3030_3030_3030_3030i64)),
            r#"Payload("00000000" | 3472328296227680304)"#
        );
        assert_eq!(debug(Payload::from(r#"{"t":{"0":5}}"#)), r#"Payload("{\"t\":{\"0\":5}}")"#);
        assert_eq!(debug(Payload::from(1234)), "Payload(1234)");
        assert_eq!(debug(Payload::from(-1)), "Payload(-1)");
        assert_eq!(debug(Payload::from(&[1u8, 0xff][..])), "Payload(0x01ff)");
        assert_eq!(debug(Payload::from("a\nb")), "Payload(0x610a62)");
        assert_eq!(debug(Payload::new()), r#"Payload("")"#);
    }

    #[test]
    fn epoch_next_stops_at_max() {
        assert_eq!(Epoch(1).next(), Some(Epoch(2)));
        assert_eq!(Epoch(i64::MAX).next(), None);
    }
}
