//! The coordinators: plain state machines, and the endpoints that host them on the bus.
//!
//! Each coordinator is written twice over, on purpose:
//! * a **state machine** that does no I/O and starts no thread: it takes one message, changes
//!   its state, and calls its collaborators (traits: the query and sink of the epoch
//!   coordinator, the clock, the log). Tests and embedders drive it directly.
//! * an **endpoint** that wraps the state machine for the bus: the runtime delivers one message
//!   at a time, so the state machine needs no locks.
//!
//! Parts: [`epoch`] (continuous-processing epoch commits: state machine, endpoint, reference
//! model), [`state_store`] (state-store locations of a driver's executors), [`block_tracker`]
//! (received blocks and their batch allocations, journaled to the WAL).

pub mod block_tracker;
pub mod epoch;
pub mod state_store;
