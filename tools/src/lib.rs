//! What the three tools (`coordbus-load`, `coordbus-wal`, `coordbus-crash`) share: how they
//! report a command line they refuse, how they show the library's log, the scratch directories
//! they remove however they end, and the seeded generator behind their repeatable randomness.

pub mod cli;
pub mod logging;
pub mod rng;
pub mod scratch;
