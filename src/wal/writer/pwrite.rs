//! The portable write path: `pwrite` (through
//! [`StorageFile::write_at`](crate::wal::StorageFile::write_at)) and `fdatasync`.
//!
//! Used when the kernel refuses io_uring (ENOSYS, EPERM: seccomp or `io_uring_disabled`), when
//! chosen explicitly, and for files whose storage hides its descriptor (fault injection).

use crate::{
    error::WalError,
    wal::{
        writer::{IoEngine, SyncTarget, WriteOp},
        IoPath,
    },
};

/// Writes with `pwrite`, syncs with `fdatasync`, one call at a time.
#[derive(Debug, Default)]
pub struct PwriteEngine;

/// Writes all of `buf` at `offset`, continuing after short writes.
pub(crate) fn write_all_at(op: &WriteOp<'_>) -> Result<(), WalError> {
    let mut done = 0usize;
    while done < op.buf.len() {
        let offset = op.offset + done as u64;
        match op.file.write_at(&op.buf[done..], offset) {
            Ok(0) => {
                return Err(WalError::Io {
                    op: "write",
                    path: op.path.to_path_buf(),
                    kind: std::io::ErrorKind::WriteZero,
                    message: format!("wrote 0 bytes at offset {offset}"),
                })
            }
            Ok(written) => done += written,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => {
                return Err(WalError::from_io(
                    "write",
                    op.path,
                    (op.buf.len() - done) as u64,
                    &error,
                ))
            }
        }
    }
    Ok(())
}

/// `fdatasync` through the storage layer.
pub(crate) fn sync_file(target: &SyncTarget<'_>) -> Result<(), WalError> {
    target.file.sync_data().map_err(|error| WalError::from_io("fdatasync", target.path, 0, &error))
}

impl IoEngine for PwriteEngine {
    fn path(&self) -> IoPath {
        IoPath::Pwrite
    }

    fn write_and_sync(
        &mut self,
        ops: &[WriteOp<'_>],
        sync: Option<&SyncTarget<'_>>,
    ) -> Result<(), WalError> {
        for op in ops {
            write_all_at(op)?;
        }
        if let Some(target) = sync {
            sync_file(target)?;
        }
        Ok(())
    }
}
