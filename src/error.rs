//! Error enums, one per subsystem, and the umbrella [`Error`].
//!
//! Every variant carries the values that explain it (a name, a timeout, a limit), so a caller
//! can act on it and a log line says what was wrong. None of these is produced by a panic path:
//! bad input and bad bytes give `Err`.

use std::time::Duration;

/// A failure reported by an endpoint's handler, boxed so that any error type can travel.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `error`'s message followed by each of its causes', joined by ": ". The enums here leave a
/// cause out of their own message (it is their `source`), so a message kept as text, which
/// has no `source` to follow, needs the whole chain.
pub(crate) fn message_with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        text.push_str(": ");
        text.push_str(&error.to_string());
        cause = error.source();
    }
    text
}

/// Why a one-way send did not deliver; the message(s) not delivered are handed back.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendError<T> {
    /// The inbox shard of this sender is full: from `try_send`, and from a `send` or
    /// `send_batch` by the endpoint's own handler into its own full inbox (only that handler's
    /// thread could make room, so waiting would never end). A handler's send into another
    /// endpoint's full inbox waits at most the bus's `ask_timeout`, then fails with
    /// [`SendError::Timeout`] (endpoints that send to each other in a cycle would otherwise
    /// wait for each other forever).
    #[error("inbox of endpoint {endpoint:?} is full")]
    Full {
        /// The endpoint's name.
        endpoint: String,
        /// The message that was not sent.
        message: T,
    },
    /// The endpoint was stopped (or the bus shut down); it takes no more messages.
    #[error("endpoint {endpoint:?} is stopped")]
    Stopped {
        /// The endpoint's name.
        endpoint: String,
        /// The message that was not sent.
        message: T,
    },
    /// The inbox stayed full until the deadline: `send_timeout`'s, or, for a `send` or
    /// `send_batch` from an endpoint's handler, the bus's `ask_timeout`.
    #[error("inbox of endpoint {endpoint:?} stayed full for {timeout:?}")]
    Timeout {
        /// The endpoint's name.
        endpoint: String,
        /// How long the sender waited.
        timeout: Duration,
        /// The message that was not sent.
        message: T,
    },
}

impl<T> SendError<T> {
    /// The message that was not delivered.
    pub fn into_message(self) -> T {
        match self {
            Self::Full { message, .. }
            | Self::Stopped { message, .. }
            | Self::Timeout { message, .. } => message,
        }
    }
}

/// Why a request-reply call did not produce a reply value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AskError {
    /// The endpoint was stopped (or the bus shut down) before the request was queued.
    #[error("endpoint {endpoint:?} is stopped")]
    Stopped {
        /// The endpoint's name.
        endpoint: String,
    },
    /// No reply within the timeout (the `ask_timeout` setting, or the one given to
    /// `wait_timeout`), counted from when the ask began to wait for room if it had to wait (a
    /// full inbox), else from the wait for the reply. A late reply is discarded.
    #[error(
        "{}no reply within {timeout:?} (setting: ask_timeout or wait_timeout)",
        asked(.endpoint)
    )]
    Timeout {
        /// The endpoint's name (empty for a [`Replier::pair`](crate::Replier::pair)).
        endpoint: String,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The handler failed the request; the cause is the handler's error.
    #[error("{}the handler failed the request", asked(.endpoint))]
    Handler {
        /// The endpoint's name (empty for a [`Replier::pair`](crate::Replier::pair)).
        endpoint: String,
        /// The handler's error.
        #[source]
        source: HandlerError,
    },
    /// The handler panicked while holding the request.
    #[error("{}the handler panicked: {message}", asked(.endpoint))]
    HandlerPanicked {
        /// The endpoint's name (empty for a [`Replier::pair`](crate::Replier::pair)).
        endpoint: String,
        /// The panic payload, if it was a string.
        message: String,
    },
    /// The handler dropped the reply without answering (a bug in the endpoint).
    #[error("{}the handler dropped the request without replying", asked(.endpoint))]
    NoReply {
        /// The endpoint's name (empty for a [`Replier::pair`](crate::Replier::pair)).
        endpoint: String,
    },
    /// The inbox was full: it stayed full for the bus's `ask_timeout` (`ask`), or was full
    /// at once (`try_ask`, which does not wait: `timeout` is zero). The request was never
    /// queued: the handler never sees it, and asking again is safe. (A [`AskError::Timeout`],
    /// by contrast, means the request was queued and its handler may still run.)
    #[error("inbox of endpoint {endpoint:?} was full (waited {timeout:?} for room)")]
    Full {
        /// The endpoint's name.
        endpoint: String,
        /// How long the ask waited for room: the bus's `ask_timeout`, or zero for `try_ask`.
        timeout: Duration,
    },
    /// A handler asked its own endpoint: it would wait for itself forever.
    #[error("endpoint {endpoint:?} asked itself from inside its handler (would deadlock)")]
    SelfAsk {
        /// The endpoint's name.
        endpoint: String,
    },
}

impl AskError {
    /// The handler's own error, if the handler failed the request ([`AskError::Handler`]) with
    /// an error of type `E`: how an asker gets a coordinator's typed error back, e.g.
    /// `error.handler_error::<EpochError>()` for a negative partition count. `None` for every
    /// other variant, and for a handler error of another type.
    pub fn handler_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Self::Handler { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }
}

/// The start of an ask error's message: which endpoint was asked (nothing for a reply pair
/// not bound to one).
fn asked(endpoint: &str) -> String {
    if endpoint.is_empty() {
        String::new()
    } else {
        format!("endpoint {endpoint:?}: ")
    }
}

/// Registry errors: registering and looking up endpoints by name.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BusError {
    /// A live endpoint already has this name.
    #[error("there is already an endpoint called {name:?}")]
    DuplicateName {
        /// The name asked for.
        name: String,
    },
    /// No endpoint has this name.
    #[error("cannot find endpoint: {name:?}")]
    NotFound {
        /// The name looked up.
        name: String,
    },
    /// An endpoint has this name but is of another type than asked for.
    #[error("endpoint {name:?} is a {actual}, not a {expected}")]
    WrongType {
        /// The name looked up.
        name: String,
        /// The endpoint type asked for.
        expected: &'static str,
        /// The endpoint type registered.
        actual: &'static str,
    },
    /// The bus was shut down; nothing can be registered any more.
    #[error("the bus is shut down: endpoint {name:?} cannot be registered")]
    ShutDown {
        /// The name the registration asked for.
        name: String,
    },
    /// The operating system refused to start an endpoint thread.
    #[error("could not start the thread of endpoint {name:?}: {reason}")]
    Spawn {
        /// The endpoint's name.
        name: String,
        /// The system's error text.
        reason: String,
    },
    /// An endpoint thread panicked outside its handlers and hooks (in the endpoint's own
    /// `Drop`, say). A panic in a handler fails its asker and goes to `on_error`; one in
    /// `on_start` or `on_stop` is caught and logged as an error, and the thread goes on.
    /// The first such panic is reported; `unfinished` names the endpoints whose threads the
    /// same shutdown also left running at its deadline (as [`BusError::ShutdownTimedOut`]
    /// would have).
    #[error(
        "endpoint thread {name:?} panicked outside a handler: {message}{}",
        still_running(unfinished)
    )]
    ThreadPanicked {
        /// The endpoint's name.
        name: String,
        /// The panic's message.
        message: String,
        /// Endpoints whose threads were still running at the shutdown's deadline (left
        /// detached: stopped, they finish on their own); empty if none.
        unfinished: Vec<String>,
    },
    /// An endpoint name the bus cannot take: an empty one (an ask's errors name the endpoint),
    /// or one holding a NUL character (it names the endpoint's thread).
    #[error("invalid endpoint name {name:?}: {reason}")]
    InvalidName {
        /// The name asked for.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The endpoint's inbox would take more memory than the bus allows for one inbox: its
    /// slots (the bus's shards, lanes and capacity) times the size of a slot for this
    /// endpoint's messages.
    #[error(
        "the inbox of endpoint {name:?} would take {bytes} bytes ({slots} slots of {slot_bytes} \
         bytes), more than {limit}: lower inbox_capacity, inbox_shards or inbox_lanes, or box \
         large messages"
    )]
    InboxTooLarge {
        /// The endpoint's name.
        name: String,
        /// Slots of the inbox (rings and lanes, as the queue rounds them).
        slots: u64,
        /// Bytes of one slot for this endpoint's messages.
        slot_bytes: u64,
        /// `slots` x `slot_bytes`.
        bytes: u64,
        /// The most bytes one inbox may take.
        limit: u64,
    },
    /// Endpoint threads still running when `shutdown` gave up waiting: their endpoints are
    /// stopped and finish on their own (left detached), but what was queued may not be
    /// handled yet.
    #[error(
        "endpoint threads {endpoints:?} did not finish within the shutdown timeout of {timeout:?}"
    )]
    ShutdownTimedOut {
        /// The endpoints whose threads were still running.
        endpoints: Vec<String>,
        /// The bus's `shutdown_timeout`.
        timeout: std::time::Duration,
    },
}

/// An invalid configuration value.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting is outside its allowed range.
    #[error("{setting} = {value} is invalid: {reason}")]
    Invalid {
        /// The setting's name.
        setting: &'static str,
        /// The value given, as text.
        value: String,
        /// What the setting requires.
        reason: &'static str,
    },
}

/// The errors of the bus and the WAL in one type (for `?` in code that uses both). The
/// coordinators' own errors ([`crate::coordinators::epoch::EpochError`], ...) and
/// [`SendError`] (which carries the unsent message) stay separate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Registering or looking up an endpoint.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// A request-reply call.
    #[error(transparent)]
    Ask(#[from] AskError),
    /// A configuration value.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The write-ahead log.
    #[error(transparent)]
    Wal(#[from] WalError),
    /// Encoding, framing or validating a record.
    #[error(transparent)]
    Record(#[from] RecordError),
}

/// Why a record could not be encoded, framed or validated.
///
/// Produced for bytes this process is about to write (serialization) and for bytes read back
/// from disk (framing and rkyv validation). Clonable so one failure can be handed to many
/// waiters.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordError {
    /// rkyv could not serialize the value.
    #[error("could not serialize the record: {message}")]
    Serialize {
        /// rkyv's error text.
        message: String,
    },
    /// The bytes are not a valid archive of the requested type (bytecheck failed).
    #[error("the record bytes are not a valid {type_name}: {message}")]
    Validate {
        /// The Rust type the caller asked for.
        type_name: &'static str,
        /// rkyv's error text.
        message: String,
    },
    /// Fewer bytes than a frame header, or a frame running past the bytes available.
    #[error("frame needs {needed} bytes but only {available} are available")]
    Truncated {
        /// Bytes the frame needs (header, or header plus declared payload and padding).
        needed: u64,
        /// Bytes available from the frame's start.
        available: u64,
    },
    /// The frame header does not carry the frame magic or version.
    #[error("bad frame header: magic {magic:#06x}, version {version}, flags {flags:#04x}")]
    BadHeader {
        /// The magic read.
        magic: u16,
        /// The version byte read.
        version: u8,
        /// The flags byte read.
        flags: u8,
    },
    /// The checksum stored in the frame differs from the one computed over its bytes.
    #[error("frame checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// The CRC32C stored in the header.
        stored: u32,
        /// The CRC32C computed over the header fields and payload.
        computed: u32,
    },
    /// The payload is larger than a frame can hold.
    #[error("payload of {len} bytes exceeds the frame limit of {max} bytes")]
    TooLarge {
        /// The payload's length.
        len: u64,
        /// The largest payload allowed.
        max: u64,
    },
}

/// Errors of the write-ahead log.
///
/// Clonable (I/O errors are kept as kind plus text) because one failure of the sync thread is
/// reported to every waiter and callback of the group it hit.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WalError {
    /// An operating-system call failed.
    #[error("{op} on {path:?} failed: {message} ({kind:?})")]
    Io {
        /// What was being done (`"create segment"`, `"fdatasync"`, ...).
        op: &'static str,
        /// The file or directory concerned.
        path: std::path::PathBuf,
        /// The error's kind.
        kind: std::io::ErrorKind,
        /// The system's error text.
        message: String,
    },
    /// The device is full (ENOSPC / EDQUOT): the write or preallocation did not fit.
    #[error("disk full while trying to {op} {path:?} ({bytes} bytes)")]
    DiskFull {
        /// What was being done.
        op: &'static str,
        /// The file concerned.
        path: std::path::PathBuf,
        /// How many bytes the operation wanted.
        bytes: u64,
    },
    /// An earlier write or sync failed; the log accepts no more writes (a sync is never retried
    /// over pages the kernel may have dropped). Records acknowledged durable before the failure
    /// are unaffected.
    #[error("the log failed earlier and accepts no more writes: {cause}")]
    Failed {
        /// The first failure.
        cause: Box<WalError>,
    },
    /// Another writer (in this or another process) has the log's directory open: two writers
    /// would interleave their records, so the second is refused.
    #[error(
        "the write-ahead log in {dir:?} is already open for writing (the directory is locked)"
    )]
    Locked {
        /// The log's directory.
        dir: std::path::PathBuf,
    },
    /// The log's directory was missing when this log was opened, and another writer has made
    /// a log there since: this log's recovered state (empty) no longer describes the directory,
    /// so it writes nothing there (its LSNs and segment ids would collide with that log's).
    #[error(
        "another writer made a log in {dir:?} after this one was opened (found {found:?}); \
         reopen the log to write there"
    )]
    ChangedSinceOpen {
        /// The log's directory.
        dir: std::path::PathBuf,
        /// A file of the other writer's log.
        found: std::path::PathBuf,
    },
    /// The log was closed.
    #[error("the write-ahead log is closed")]
    Closed,
    /// The log was opened read-only (`WalOptions::read_only`).
    #[error("the write-ahead log was opened read-only")]
    ReadOnly,
    /// Damaged bytes where a valid record or segment header must be.
    #[error("corruption in segment {segment} at offset {offset}: {reason}")]
    Corruption {
        /// The segment's number.
        segment: u32,
        /// Byte offset of the damage inside the segment file.
        offset: u64,
        /// What was found.
        reason: String,
    },
    /// A segment header carries a format version this build does not read.
    #[error(
        "segment {segment} has format version {found}; this build reads versions up to {supported}"
    )]
    UnsupportedVersion {
        /// The segment's number.
        segment: u32,
        /// The version byte found.
        found: u8,
        /// The highest version this build reads.
        supported: u8,
    },
    /// A record handle whose length disagrees with the record stored at its offset.
    #[error(
        "expected record length {expected} (from the handle) but the record at segment {segment} \
         offset {offset} is {actual} bytes"
    )]
    LengthMismatch {
        /// The segment of the handle.
        segment: u32,
        /// The offset of the handle.
        offset: u64,
        /// The length the handle claims.
        expected: u32,
        /// The length stored in the frame.
        actual: u32,
    },
    /// No record at this place: the segment was cleaned, never existed, or the offset is past
    /// the end of what was written.
    #[error("no record at segment {segment} offset {offset}: {reason}")]
    NotFound {
        /// The segment asked for.
        segment: u32,
        /// The offset asked for.
        offset: u64,
        /// Why.
        reason: &'static str,
    },
    /// A record is larger than a segment can hold.
    #[error("record of {len} bytes does not fit a segment of {segment_size_bytes} bytes")]
    RecordTooLarge {
        /// The framed record size.
        len: u64,
        /// The configured segment size.
        segment_size_bytes: u64,
    },
    /// A record could not be encoded or its stored bytes failed validation.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// Waiting for durability timed out.
    #[error("LSN {lsn} was not durable within {timeout:?} (durable so far: {durable})")]
    Timeout {
        /// The LSN waited for.
        lsn: u64,
        /// The LSN durable when the wait gave up.
        durable: u64,
        /// How long the caller waited.
        timeout: Duration,
    },
    /// [`Wal::append_bytes_timeout`](crate::wal::Wal::append_bytes_timeout): the staging
    /// buffer stayed full (the disk is behind) for the whole timeout; nothing was appended.
    #[error(
        "no room to stage the record within {timeout:?}: the disk is behind \
         (appended: {appended}, durable: {durable})"
    )]
    AppendTimedOut {
        /// How long the caller waited.
        timeout: Duration,
        /// The last LSN appended when the wait gave up.
        appended: u64,
        /// The LSN durable when the wait gave up.
        durable: u64,
    },
    /// [`Wal::close_timeout`](crate::wal::Wal::close_timeout): the sync thread had not
    /// finished writing, syncing and exiting in time.
    #[error(
        "the log's sync thread had not finished closing within {timeout:?} \
         (appended: {appended}, durable: {durable})"
    )]
    CloseTimedOut {
        /// The last LSN appended.
        appended: u64,
        /// The LSN durable when the wait gave up.
        durable: u64,
        /// How long the caller waited.
        timeout: Duration,
    },
    /// [`Wal::close`](crate::wal::Wal::close) called from a durability callback, on the sync
    /// thread, which cannot wait for itself: the log is closing, and the thread writes and
    /// syncs the records up to `appended` once the callback returns (or fails the log). Not a
    /// failure; a `close` from another thread waits for the end.
    #[error(
        "closing the log from its sync thread, which writes the rest once the callback returns \
         (appended: {appended}, durable: {durable})"
    )]
    CloseOnSyncThread {
        /// The last LSN appended.
        appended: u64,
        /// The LSN durable when close was called.
        durable: u64,
    },
    /// Waiting for an LSN that was never appended (it would wait forever).
    #[error("LSN {lsn} was never appended (last appended: {appended})")]
    NotAppended {
        /// The LSN asked for.
        lsn: u64,
        /// The last LSN appended.
        appended: u64,
    },
    /// An invalid configuration value.
    #[error("{setting} = {value} is invalid: {reason}")]
    InvalidConfig {
        /// The setting's name.
        setting: &'static str,
        /// The value given, as text.
        value: String,
        /// What the setting requires.
        reason: &'static str,
    },
    /// A failed log's marker ([`UNSYNCED_MARKER`](crate::wal::UNSYNCED_MARKER)) does not hold
    /// an LSN. The log writes it whole (a temporary file renamed over it), so it was damaged,
    /// or the failing disk did not keep it (its sync failed, then the power was lost). Which
    /// records after the failure reached the disk is then unknown, so the log is not opened,
    /// nor scanned, until the marker is looked at. Removing it opens the log with every record
    /// the scan finds.
    #[error(
        "the failed-log marker {path:?} does not hold an LSN ({len} bytes, starting \
         {preview:?}): records after the failure may never have reached the disk; remove the \
         marker to open the log with every record found"
    )]
    BadUnsyncedMarker {
        /// The marker file.
        path: std::path::PathBuf,
        /// Its length in bytes.
        len: u64,
        /// Its first bytes, invalid UTF-8 replaced (at most
        /// [`UNSYNCED_MARKER_MAX_BYTES`](crate::wal::UNSYNCED_MARKER_MAX_BYTES)).
        preview: String,
    },
}

impl WalError {
    /// Wraps an I/O error, mapping ENOSPC and EDQUOT to [`WalError::DiskFull`].
    pub fn from_io(
        op: &'static str,
        path: impl Into<std::path::PathBuf>,
        bytes: u64,
        error: &std::io::Error,
    ) -> Self {
        let path = path.into();
        match error.raw_os_error() {
            Some(code) if code == libc::ENOSPC || code == libc::EDQUOT => {
                Self::DiskFull { op, path, bytes }
            }
            _ if error.kind() == std::io::ErrorKind::StorageFull => {
                Self::DiskFull { op, path, bytes }
            }
            _ => Self::Io { op, path, kind: error.kind(), message: error.to_string() },
        }
    }

    /// The underlying failure: the cause of [`WalError::Failed`], else `self`.
    pub fn root_cause(&self) -> &WalError {
        match self {
            Self::Failed { cause } => cause.root_cause(),
            other => other,
        }
    }
}

/// `ThreadPanicked`'s note on the endpoints a shutdown left running, if any.
fn still_running(unfinished: &[String]) -> String {
    if unfinished.is_empty() {
        String::new()
    } else {
        format!("; endpoints still running at the shutdown's deadline: {unfinished:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_error_is_the_handlers_own_error_of_that_type_only() {
        let failed = AskError::Handler {
            endpoint: "e".into(),
            source: Box::new(std::io::Error::other("refused")),
        };
        assert_eq!(
            failed.handler_error::<std::io::Error>().map(ToString::to_string).as_deref(),
            Some("refused")
        );
        assert!(failed.handler_error::<std::fmt::Error>().is_none(), "another type");
        let others = [
            AskError::HandlerPanicked { endpoint: "e".into(), message: "boom".into() },
            AskError::Stopped { endpoint: "e".into() },
            AskError::NoReply { endpoint: "e".into() },
        ];
        for other in others {
            assert!(other.handler_error::<std::io::Error>().is_none(), "{other:?}");
        }
    }
}
