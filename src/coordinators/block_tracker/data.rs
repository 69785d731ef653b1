//! A receiver's write-ahead log for the blocks' bytes (Spark's receiver WAL).
//!
//! A receiver stores a block's data here before it reports the block to the tracker; the
//! block's [`BlockStoreResult::ReceiverWal`] then carries the record handle, and after a driver
//! restart (when the executor copies are presumed gone) the data is read back through that
//! handle, zero-copy from the log's memory map. The data log is separate from the tracker's
//! journal (as in Spark, one per stream under `<checkpoint>/receivedData/<stream>`) so the
//! journal only ever holds tracker events.

use std::path::{Path, PathBuf};

use super::{BlockStoreResult, BlockTrackerError, ReceivedBlockInfo, StreamBlockId, StreamId};
use crate::wal::{Lsn, RecordBytes, Wal, WalConfig, WalError};

/// A receiver-side log of block data.
#[derive(Debug)]
pub struct ReceiverBlockStore {
    wal: Wal,
}

impl ReceiverBlockStore {
    /// The conventional directory of `stream`'s data log: `<checkpoint>/receivedData/<stream>`.
    pub fn dir_for(checkpoint_dir: &Path, stream: StreamId) -> PathBuf {
        checkpoint_dir.join("receivedData").join(stream.0.to_string())
    }

    /// Opens (and recovers) the data log in `dir`.
    ///
    /// # Errors
    /// The WAL's opening errors.
    pub fn open(dir: impl AsRef<Path>, config: WalConfig) -> Result<Self, WalError> {
        Ok(Self { wal: Wal::open(dir, config)? })
    }

    /// Appends `data` for `block_id` with record time `time_ms` and returns once it is durable,
    /// with the store result to put in the block's info.
    ///
    /// # Errors
    /// The WAL's append or durability error.
    pub fn store(
        &self,
        block_id: StreamBlockId,
        data: &[u8],
        time_ms: i64,
    ) -> Result<BlockStoreResult, WalError> {
        let (lsn, result) = self.store_deferred(block_id, data, time_ms)?;
        self.wal.wait_durable(lsn)?;
        Ok(result)
    }

    /// Appends without waiting; the data is durable once [`Self::wal`]'s durable LSN reaches
    /// the returned LSN.
    ///
    /// # Errors
    /// The WAL's append error.
    pub fn store_deferred(
        &self,
        block_id: StreamBlockId,
        data: &[u8],
        time_ms: i64,
    ) -> Result<(Lsn, BlockStoreResult), WalError> {
        let (lsn, handle) = self.wal.append_bytes(data, time_ms)?;
        Ok((lsn, BlockStoreResult::ReceiverWal { block_id, handle }))
    }

    /// The bytes of `info`'s block, borrowed from the log's memory map.
    ///
    /// # Errors
    /// [`BlockTrackerError::NotInReceiverLog`] if the block was stored in a block manager;
    /// [`BlockTrackerError::Wal`] if its record was cleaned or is damaged.
    pub fn read(&self, info: &ReceivedBlockInfo) -> Result<RecordBytes, BlockTrackerError> {
        let handle = info
            .store_result()
            .wal_handle()
            .ok_or(BlockTrackerError::NotInReceiverLog { block_id: info.block_id() })?;
        Ok(self.wal.read_bytes(handle)?)
    }

    /// The underlying log (cleaning, statistics).
    pub fn wal(&self) -> &Wal {
        &self.wal
    }
}
