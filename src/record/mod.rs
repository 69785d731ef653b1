//! Records: rkyv-archived values and the frame that carries them on disk.
//!
//! A record is any value rkyv can archive. It is serialized once, by the appending thread, into
//! an aligned buffer; the WAL frames it ([`frame`]) and later hands readers a validated,
//! zero-copy reference to the archived value straight from the memory map.
//!
//! Why rkyv: reading a record is a bounds check, a CRC and bytecheck validation, with no
//! decoding and no allocation, so recovery and random reads run at memory speed.
//!
//! Bytes from disk are untrusted: callers run [`access`] (bytecheck) only after the frame's CRC
//! passed, and never `access_unchecked` on them.
//!
//! This module does no I/O.

pub(crate) mod crc;
pub mod frame;

use rkyv::{
    api::high::{HighSerializer, HighValidator},
    bytecheck::CheckBytes,
    rancor,
    ser::allocator::ArenaHandle,
    util::AlignedVec,
    Archive, Portable, Serialize,
};

use crate::error::RecordError;

/// Values the WAL can append: anything rkyv's high-level serializer accepts.
///
/// Implemented automatically for every `#[derive(rkyv::Archive, rkyv::Serialize)]` type.
pub trait Record:
    for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
{
}

impl<T> Record for T where
    T: for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
{
}

/// Archived forms that can be validated (bytecheck) before they are handed out.
///
/// Implemented automatically for the archived form of every type derived with rkyv's
/// `Archive` (with the `bytecheck` feature, which coordbus enables).
pub trait Checked: Portable + for<'a> CheckBytes<HighValidator<'a, rancor::Error>> {}

impl<T> Checked for T where T: Portable + for<'a> CheckBytes<HighValidator<'a, rancor::Error>> {}

/// Serializes `value` into a fresh aligned buffer.
///
/// # Errors
/// [`RecordError::Serialize`] if rkyv fails (for example a value it cannot represent).
pub fn to_bytes<T: Record>(value: &T) -> Result<AlignedVec, RecordError> {
    rkyv::to_bytes::<rancor::Error>(value)
        .map_err(|error| RecordError::Serialize { message: error.to_string() })
}

/// Validates `bytes` as an archived `T` and returns a reference into them.
///
/// `bytes` must start on an address aligned for `T::Archived` (the WAL guarantees 16 bytes).
///
/// # Errors
/// [`RecordError::Validate`] if bytecheck rejects the bytes (including misalignment).
pub fn access<T>(bytes: &[u8]) -> Result<&T::Archived, RecordError>
where
    T: Archive,
    T::Archived: Checked,
{
    rkyv::access::<T::Archived, rancor::Error>(bytes).map_err(|error| RecordError::Validate {
        type_name: std::any::type_name::<T>(),
        message: error.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(rkyv::Archive, rkyv::Serialize, Debug, PartialEq)]
    struct Sample {
        id: u64,
        name: String,
        values: Vec<u32>,
    }

    #[test]
    fn round_trip_through_access() {
        let value = Sample { id: 7, name: "block-7".into(), values: vec![1, 2, 3] };
        let bytes = to_bytes(&value).unwrap();
        let archived = access::<Sample>(&bytes).unwrap();
        assert_eq!(archived.id, 7);
        assert_eq!(archived.name.as_str(), "block-7");
        assert_eq!(archived.values.len(), 3);
    }

    #[test]
    fn garbage_is_a_validation_error_not_a_panic() {
        let mut bytes = AlignedVec::<16>::new();
        bytes.extend_from_slice(&[0xffu8; 64]);
        let result = access::<Sample>(&bytes);
        assert!(matches!(result, Err(RecordError::Validate { .. })));
    }
}
