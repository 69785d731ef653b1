//! The tracker's journal as a trait, and its implementation over coordbus's WAL.
//!
//! The tracker never talks to the WAL directly: it goes through [`BlockLog`], so a test can
//! wrap the real log and make a write fail (SPEC D.3's "failed log write", RBT-04) or observe
//! the LSN each event got. [`WalBlockLog`] is the real thing: one rkyv record per event.

use std::{path::Path, sync::Arc, time::Duration};

use rkyv::util::AlignedVec;

use super::{
    types::{BlockAdditionsEvent, TrackerEvent},
    BlockTrackerError, ReceivedBlockInfo,
};
use crate::wal::{DurableCallback, Lsn, Wal, WalConfig, WalError, WalOptions};

/// Why the log step did not write an event.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockLogError {
    /// The write-ahead log refused or failed the write: the tracker reports the write as
    /// failed (`writeToLog` returns false, SPEC D.2) and leaves its state unchanged.
    #[error(transparent)]
    Wal(#[from] WalError),
    /// The log step raised instead of reporting a failure (only an injected log does this);
    /// the tracker propagates it to its caller with its state unchanged (SPEC D.3).
    #[error("{message}")]
    Raised {
        /// The error's text (for example "Not able to write BatchAllocationEvent").
        message: String,
    },
}

/// The journal the tracker writes its events to.
///
/// Appends return with the event's LSN without waiting for a sync (only, bounded, for room
/// while the log's buffer is full); durability is learnt separately, so many writers can
/// share one sync (group commit). Implementations must keep appends in order:
/// an event whose LSN is durable implies every earlier event is durable too.
pub trait BlockLog: Send + Sync + 'static {
    /// Appends `event` with record time `time_ms`; returns its LSN without waiting for
    /// durability.
    ///
    /// An append refused for want of room ([`WalError::AppendTimedOut`]) must leave records
    /// appended and not yet durable (those holding the room): the tracker refuses its later
    /// appends untried until [`BlockLog::durable_lsn`] moves past the `durable` the error
    /// reports.
    ///
    /// # Errors
    /// [`BlockLogError::Wal`] for a write the log refused, [`BlockLogError::Raised`] for an
    /// injected failure that must reach the caller.
    fn append(&self, event: &TrackerEvent, time_ms: i64) -> Result<Lsn, BlockLogError>;

    /// Appends the [`BlockAdditionsEvent`] of the blocks of `groups`, one group after the
    /// other (a receiver's pending blocks kept by stream), like [`BlockLog::append`]. The
    /// default gathers them into the event; [`WalBlockLog`] encodes them where they are.
    ///
    /// # Errors
    /// As [`BlockLog::append`].
    fn append_additions(
        &self,
        groups: &[&[ReceivedBlockInfo]],
        time_ms: i64,
    ) -> Result<Lsn, BlockLogError> {
        let infos = groups.iter().flat_map(|blocks| blocks.iter()).cloned().collect();
        self.append(&TrackerEvent::BlockAdditions(BlockAdditionsEvent { infos }), time_ms)
    }

    /// Waits at most `timeout` until `lsn` is durable.
    ///
    /// # Errors
    /// [`WalError::Timeout`], or the log's failure.
    fn wait_durable(&self, lsn: Lsn, timeout: Duration) -> Result<(), WalError>;

    /// The last LSN known durable.
    fn durable_lsn(&self) -> Lsn;

    /// Runs `callback` once `lsn` is durable or the log failed (see
    /// [`Wal::notify_when_durable`]: it may run at once on the calling thread).
    fn notify_when_durable(&self, lsn: Lsn, callback: DurableCallback);

    /// Calls `apply` with every event in the log, in order, up to and including `last` (all
    /// if `None`), reading nothing after `last`. Returns the number of events read.
    ///
    /// # Errors
    /// [`BlockTrackerError::Wal`] for a damaged log, [`BlockTrackerError::Decode`] for a
    /// record that is not a tracker event.
    fn replay(
        &self,
        last: Option<Lsn>,
        apply: &mut dyn FnMut(Lsn, TrackerEvent),
    ) -> Result<u64, BlockTrackerError>;

    /// Deletes log files whose end time is strictly below `threshold_ms` (SPEC E.4), keeping
    /// every file that holds a record at or above `keep_from` (the addition of a block not
    /// allocated yet), if given.
    ///
    /// # Errors
    /// The log's error.
    fn clean(&self, threshold_ms: i64, keep_from: Option<Lsn>, wait: bool) -> Result<(), WalError>;

    /// Writes and syncs what was appended and stops accepting writes. Idempotent.
    ///
    /// # Errors
    /// The log's failure, or (a bounded close) that it did not finish in time.
    fn close(&self) -> Result<(), WalError>;

    /// The largest encoded event the log takes in one record (`None`: no limit). The tracker
    /// refuses a block too large to be allocated alone from it (`BlockSizeLimit`).
    fn max_event_bytes(&self) -> Option<usize> {
        None
    }

    /// The underlying WAL, if there is one (for statistics and tests).
    fn wal(&self) -> Option<&Arc<Wal>> {
        None
    }
}

/// Largest serialization buffer a thread keeps between appends.
const KEPT_BUF_BYTES_MAX: usize = 1 << 20;

thread_local! {
    /// The serialization buffer of this thread's appends: reused, so an append allocates
    /// nothing once it has grown to the largest record.
    static ENCODE_BUF: std::cell::Cell<AlignedVec> = std::cell::Cell::new(AlignedVec::new());
}

/// How long [`WalBlockLog`]'s `close` waits for the WAL to close.
pub const WAL_CLOSE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`WalBlockLog`]'s appends wait for room while the WAL's staging buffer is full, by
/// default (Spark's batching timeout; a tracker that opens its own log passes its
/// `write_timeout`, whose default this is).
pub const WAL_APPEND_TIMEOUT: Duration = Duration::from_secs(5);

/// [`BlockLog`] over a [`Wal`]: each event is one compact rkyv record (`journal` module).
/// An append that finds the WAL's staging buffer full (the disk is behind) waits at most its
/// append timeout, then fails as a refused write ([`WalError::AppendTimedOut`]: nothing was
/// logged, so the addition answers false), instead of holding the tracker's thread or a
/// receiver for as long as the disk takes. The tracker then refuses its own later appends
/// untried until the log makes something more durable (one timeout, not one per event).
#[derive(Debug, Clone)]
pub struct WalBlockLog {
    wal: Arc<Wal>,
    append_timeout: Duration,
}

impl WalBlockLog {
    /// Opens (and recovers) the WAL in `dir`.
    ///
    /// # Errors
    /// The WAL's opening errors (configuration, corruption in strict mode, I/O).
    pub fn open(dir: impl AsRef<Path>, config: WalConfig) -> Result<Self, WalError> {
        Self::open_with_options(dir, config, WalOptions::default())
    }

    /// [`Self::open`] with the WAL's `options`.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn open_with_options(
        dir: impl AsRef<Path>,
        config: WalConfig,
        options: WalOptions,
    ) -> Result<Self, WalError> {
        Ok(Self::from_wal(Arc::new(Wal::open_with_options(dir, config, options)?)))
    }

    /// Wraps an open WAL.
    pub fn from_wal(wal: Arc<Wal>) -> Self {
        Self { wal, append_timeout: WAL_APPEND_TIMEOUT }
    }

    /// Sets how long appends wait for room (default [`WAL_APPEND_TIMEOUT`]).
    #[must_use]
    pub fn with_append_timeout(mut self, timeout: Duration) -> Self {
        self.append_timeout = timeout;
        self
    }
}

impl WalBlockLog {
    /// Serializes a record with `encode` into this thread's buffer and appends it.
    fn append_encoded(
        &self,
        kind: &str,
        time_ms: i64,
        encode: impl FnOnce(AlignedVec) -> Result<AlignedVec, BlockTrackerError>,
    ) -> Result<Lsn, BlockLogError> {
        ENCODE_BUF.with(|cell| {
            let buf = encode(cell.take()).map_err(|error| BlockLogError::Raised {
                message: format!("serializing a {kind}: {error}"),
            })?;
            let outcome = self.wal.append_bytes_timeout(&buf, time_ms, self.append_timeout);
            // A huge record (a large allocation) does not pin its buffer for good.
            if buf.capacity() <= KEPT_BUF_BYTES_MAX {
                cell.set(buf);
            }
            Ok(outcome?.0)
        })
    }
}

impl BlockLog for WalBlockLog {
    fn append(&self, event: &TrackerEvent, time_ms: i64) -> Result<Lsn, BlockLogError> {
        self.append_encoded(event.kind(), time_ms, |buf| event.encode_into(buf))
    }

    fn append_additions(
        &self,
        groups: &[&[ReceivedBlockInfo]],
        time_ms: i64,
    ) -> Result<Lsn, BlockLogError> {
        self.append_encoded("BlockAdditionEvents", time_ms, |buf| {
            super::journal::encode_additions_into(groups, buf)
        })
    }

    fn wait_durable(&self, lsn: Lsn, timeout: Duration) -> Result<(), WalError> {
        self.wal.wait_durable_timeout(lsn, timeout)
    }

    fn durable_lsn(&self) -> Lsn {
        self.wal.durable_lsn()
    }

    fn notify_when_durable(&self, lsn: Lsn, callback: DurableCallback) {
        self.wal.notify_when_durable(lsn, callback);
    }

    fn replay(
        &self,
        last: Option<Lsn>,
        apply: &mut dyn FnMut(Lsn, TrackerEvent),
    ) -> Result<u64, BlockTrackerError> {
        let mut count = 0;
        if last == Some(Lsn::ZERO) {
            return Ok(0);
        }
        for record in self.wal.iter_from(Lsn::ZERO)? {
            let record = record?;
            if last.is_some_and(|last| record.lsn > last) {
                break;
            }
            let event = TrackerEvent::decode(&record.bytes).map_err(|error| match error {
                BlockTrackerError::Decode { message } => BlockTrackerError::Decode {
                    message: format!(
                        "record {} (segment {}, offset {}): {message}",
                        record.lsn, record.handle.segment, record.handle.offset
                    ),
                },
                other => other,
            })?;
            apply(record.lsn, event);
            count += 1;
            if last == Some(record.lsn) {
                // Not even read past `last`: after a failed sync, the records there may be
                // damaged (pages the kernel dropped), and the durable prefix is what counts.
                break;
            }
        }
        Ok(count)
    }

    fn clean(&self, threshold_ms: i64, keep_from: Option<Lsn>, wait: bool) -> Result<(), WalError> {
        match keep_from {
            Some(keep_from) => self.wal.clean_keeping_from(threshold_ms, keep_from, wait),
            None => self.wal.clean(threshold_ms, wait),
        }
        .map(|_| ())
    }

    /// Waits at most [`WAL_CLOSE_TIMEOUT`] for the WAL to write, sync and close (a stuck
    /// disk fails the close instead of hanging the tracker's stop; the WAL's sync thread then
    /// finishes in the background).
    fn close(&self) -> Result<(), WalError> {
        self.wal.close_timeout(WAL_CLOSE_TIMEOUT)
    }

    fn max_event_bytes(&self) -> Option<usize> {
        Some(self.wal.max_payload_len())
    }

    fn wal(&self) -> Option<&Arc<Wal>> {
        Some(&self.wal)
    }
}
