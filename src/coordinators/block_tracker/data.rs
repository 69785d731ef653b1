//! A receiver's write-ahead log for the blocks' bytes (Spark's receiver WAL).
//!
//! A receiver stores a block's data here before it reports the block to the tracker; the
//! block's [`BlockStoreResult::ReceiverWal`] then carries the record handle, and after a driver
//! restart (when the executor copies are presumed gone) the data is read back through that
//! handle, zero-copy from the log's memory map. The data log is separate from the tracker's
//! journal (as in Spark, one per stream under `<checkpoint>/receivedData/<stream>`) so the
//! journal only ever holds tracker events.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::{BlockStoreResult, BlockTrackerError, ReceivedBlockInfo, StreamBlockId, StreamId};
use crate::wal::{Lsn, RecordBytes, Wal, WalConfig, WalError};

/// How long [`ReceiverBlockStore::store`] waits for a block's data to become durable by
/// default: Spark's `spark.streaming.receiver.blockStoreTimeout`, 30 s.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(30);

/// A receiver-side log of block data.
#[derive(Debug)]
pub struct ReceiverBlockStore {
    wal: Wal,
    store_timeout: Duration,
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
        Ok(Self::from_wal(Wal::open(dir, config)?))
    }

    /// A store over a log the caller opened (with its own [`crate::wal::WalOptions`], say).
    pub fn from_wal(wal: Wal) -> Self {
        Self { wal, store_timeout: DEFAULT_STORE_TIMEOUT }
    }

    /// Sets how long [`Self::store`] waits for durability (default
    /// [`DEFAULT_STORE_TIMEOUT`]).
    #[must_use]
    pub fn with_store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// How long [`Self::store`] waits for durability.
    pub fn store_timeout(&self) -> Duration {
        self.store_timeout
    }

    /// Appends `data` for `block_id` with record time `time_ms` and returns once it is durable,
    /// with the store result to put in the block's info. Waits at most
    /// [`Self::store_timeout`] in all (for room to stage the data, then for the sync), as
    /// Spark's receiver does, so a stuck disk fails the store instead of hanging the receiver.
    /// The waiting thread never writes and syncs itself (a sync could outlast the bound); with
    /// `Durability::EveryRecord`, [`Self::store_deferred`] and `wal().wait_durable(lsn)` let it
    /// do so, without a bound.
    ///
    /// # Errors
    /// The WAL's append or durability error; [`WalError::AppendTimedOut`] if there was no room
    /// to stage the data in time (nothing was appended); [`WalError::Timeout`] (with the LSN
    /// and the store timeout) if the data was not durable in time. It may still become durable
    /// later: a receiver that retries appends the data again, and the first record is then
    /// never read (the log's time-based cleaning removes it).
    pub fn store(
        &self,
        block_id: StreamBlockId,
        data: &[u8],
        time_ms: i64,
    ) -> Result<BlockStoreResult, WalError> {
        let started = Instant::now();
        let (lsn, handle) = self.wal.append_bytes_timeout(data, time_ms, self.store_timeout)?;
        let remaining = self.store_timeout.saturating_sub(started.elapsed());
        match self.wal.wait_durable_timeout(lsn, remaining) {
            Ok(()) => Ok(BlockStoreResult::ReceiverWal { block_id, handle }),
            Err(WalError::Timeout { lsn, durable, .. }) => {
                Err(WalError::Timeout { lsn, durable, timeout: self.store_timeout })
            }
            Err(error) => Err(error),
        }
    }

    /// Appends without waiting for the sync; the data is durable once [`Self::wal`]'s durable
    /// LSN reaches the returned LSN. Like [`Wal::append_bytes`], it waits for room (as long as
    /// the disk takes) if the log's staging buffer is full.
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
