//! [`Payload`]: the engine's opaque bytes (a reader's partition offset, a writer's commit
//! message), and the identifier newtypes [`Epoch`] and [`PartitionId`].
//!
//! The coordinator never looks inside a payload; it stores it, hands it back to the query or the
//! sink, and drops it. Most engines' offsets and commit messages are a few machine words (a
//! Kafka offset is one `i64`), so a payload of up to [`Payload::INLINE_BYTES`] bytes lives inline
//! in the value (a `smallvec` with the `union` layout, 32 bytes in all) and costs no allocation;
//! longer ones spill to the heap.

use std::fmt;

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
/// let message = Payload::from(&b"writer-commit"[..]);
/// assert_eq!(message.as_bytes(), b"writer-commit");
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

    /// The bytes as a vector.
    pub fn into_vec(self) -> Vec<u8> {
        self.0.into_vec()
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
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(value) = self.as_i64() {
            return write!(formatter, "Payload({value})");
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
        assert!(Payload::new().is_empty());
    }

    #[test]
    fn epoch_next_stops_at_max() {
        assert_eq!(Epoch(1).next(), Some(Epoch(2)));
        assert_eq!(Epoch(i64::MAX).next(), None);
    }
}
