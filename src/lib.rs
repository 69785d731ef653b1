//! # coordbus
//!
//! A lock-free message bus runtime hosting the driver-side coordinators of a stream-processing
//! engine: the continuous-processing epoch coordinator, the state-store location coordinator and
//! the received-block tracker, with a segmented write-ahead log for what must survive a crash.
//!
//! ## Data path
//! A sender holds an [`EndpointRef`]. `send` writes the message into the endpoint's inbox: one
//! of several bounded lock-free rings (`queue`), always the same one for the same sender thread,
//! so one sender's messages keep their order. The endpoint's own thread (`runtime`) drains the
//! rings in fair batches and calls the endpoint's handler one message at a time (runs of one-way
//! messages through [`Endpoint::handle_run`], so that a handler can carry work from one message
//! to the next; the epoch coordinator does). `ask` travels
//! the same lane with a one-shot reply channel inside; the handler answers at once, or keeps the
//! [`Replier`] and answers later (for example once the WAL reports the work durable). When idle,
//! the endpoint thread spins briefly, then yields, then parks until a sender rings its doorbell.
//!
//! ## Example
//! ```
//! use coordbus::{Ask, Bus, Context, Endpoint, HandlerError, Replier};
//!
//! /// Counts what it is sent.
//! struct Counter(u64);
//! #[derive(Debug)]
//! struct Add(u64);
//! struct Total;
//! enum CounterRequest { Total(Replier<u64>) }
//!
//! impl Endpoint for Counter {
//!     type Message = Add;
//!     type Request = CounterRequest;
//!     fn handle(&mut self, Add(n): Add, _: &Context<Self>) -> Result<(), HandlerError> {
//!         self.0 += n;
//!         Ok(())
//!     }
//!     fn handle_request(&mut self, request: CounterRequest, _: &Context<Self>)
//!         -> Result<(), HandlerError> {
//!         match request { CounterRequest::Total(reply) => reply.reply(self.0) }
//!         Ok(())
//!     }
//! }
//! impl Ask<Counter> for Total {
//!     type Reply = u64;
//!     fn into_request(self, reply: Replier<u64>) -> CounterRequest {
//!         CounterRequest::Total(reply)
//!     }
//! }
//!
//! let bus = Bus::builder().inbox_shards(2).build()?;
//! let counter = bus.register("counter", Counter(0))?;
//! counter.send(Add(40))?;
//! counter.send_batch(vec![Add(1), Add(1)])?;
//! assert_eq!(counter.ask(Total).wait()?, 42); // the ask sees this thread's earlier sends
//! bus.shutdown()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Modules
//! * [`queue`]: the sharded lock-free inbox (the data plane).
//! * `runtime` (re-exported at the root): [`Bus`], [`Endpoint`], [`EndpointRef`], replies.
//! * [`wal`]: the segmented write-ahead log (memory-mapped segments, io_uring writes with a
//!   pwrite fallback, group commit, crash recovery); [`record`]: its rkyv records and frames.
//! * [`coordinators`]: the epoch coordinator, the state-store coordinator and the received-block
//!   tracker, each a plain state machine plus its bus endpoint.
//! * [`clock`]: injectable time.

// The queue's positions and stamps are `usize` counters that must never wrap (at 100 M
// messages a second a 32-bit one wraps in under a minute), and the WAL maps segments of up to
// gigabytes: 64-bit targets only.
#[cfg(not(target_pointer_width = "64"))]
compile_error!("coordbus needs a 64-bit target (its queue counters must never wrap)");

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod clock;
mod config;
pub mod coordinators;
mod error;
pub mod queue;
pub mod record;
mod runtime;
pub(crate) mod sync;
pub mod wal;

/// The warnings a unit test logs, captured without a subscriber of its own thread (see the
/// module; the integration tests share it).
#[cfg(test)]
#[path = "../tests/warning_capture/mod.rs"]
mod warning_capture;

/// Skipping a test variant the machine cannot run, unless CI forbids it (see the module; the
/// integration tests share it).
#[cfg(test)]
#[path = "../tests/skipped_variants/mod.rs"]
mod skipped_variants;

pub use crate::coordinators::block_tracker::{BlockTrackerEndpoint, ReceivedBlockTracker};
pub use crate::coordinators::epoch::{EpochConfig, EpochCoordinator, EpochEndpoint};
pub use crate::coordinators::state_store::{StateStoreCoordinator, StateStoreCoordinatorRef};
pub use crate::{
    config::{BusBuilder, BusConfig, Idle, Pinning},
    error::{AskError, BusError, ConfigError, Error, HandlerError, SendError},
    runtime::{
        Ask, Bus, Context, DroppedCount, Endpoint, EndpointRef, EndpointStats, Replier, Reply,
        TimeSummary, OTHER_DROP_REASONS,
    },
};
pub use crate::{
    error::{RecordError, WalError},
    wal::{Durability, Lsn, RecordHandle, RecoveryMode, SegmentId, Wal, WalConfig},
};
