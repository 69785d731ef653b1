//! What the three tools (`coordbus-load`, `coordbus-wal`, `coordbus-crash`) share: how they
//! show the library's log, and the scratch directories they remove however they end.

pub mod logging;
pub mod scratch;
