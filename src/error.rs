//! Error enums, one per subsystem, and the umbrella [`Error`].
//!
//! Every variant carries the values that explain it (a name, a timeout, a limit), so a caller
//! can act on it and a log line says what was wrong. None of these is produced by a panic path:
//! bad input and bad bytes give `Err`.

use std::time::Duration;

/// A failure reported by an endpoint's handler, boxed so that any error type can travel.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a one-way send did not deliver; the message(s) not delivered are handed back.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendError<T> {
    /// The inbox shard of this sender is full (only from `try_send`).
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
    /// The inbox stayed full until the deadline of `send_timeout`.
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
    /// `wait_timeout`). A late reply is discarded.
    #[error("no reply within {timeout:?} (setting: ask_timeout or wait_timeout)")]
    Timeout {
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The handler failed the request; the cause is the handler's error.
    #[error("the handler failed the request")]
    Handler(#[source] HandlerError),
    /// The handler panicked while holding the request.
    #[error("the handler panicked: {message}")]
    HandlerPanicked {
        /// The panic payload, if it was a string.
        message: String,
    },
    /// The handler dropped the reply without answering (a bug in the endpoint).
    #[error("the handler dropped the request without replying")]
    NoReply,
    /// The inbox stayed full until the ask's deadline (only from `try_ask`-style calls).
    #[error("inbox of endpoint {endpoint:?} is full")]
    Full {
        /// The endpoint's name.
        endpoint: String,
    },
    /// A handler asked its own endpoint: it would wait for itself forever.
    #[error("endpoint {endpoint:?} asked itself from inside its handler (would deadlock)")]
    SelfAsk {
        /// The endpoint's name.
        endpoint: String,
    },
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
    #[error("the bus is shut down")]
    ShutDown,
    /// The operating system refused to start an endpoint thread.
    #[error("could not start the thread of endpoint {name:?}: {reason}")]
    Spawn {
        /// The endpoint's name.
        name: String,
        /// The system's error text.
        reason: String,
    },
    /// An endpoint thread panicked outside a handler (in a start or stop hook).
    #[error("endpoint thread {name:?} panicked outside a handler")]
    ThreadPanicked {
        /// The endpoint's name.
        name: String,
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

/// Any coordbus error.
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
}
