//! The library logs through `tracing` (a WAL that failed, a torn tail cut, a thread that could
//! not be pinned, a message refused with a warning). A tool without a subscriber drops all of
//! it, and an error that says "the WAL's reason is in the log output" then points at nothing.
//! So each tool writes the log to stderr (stdout stays the tool's report), warnings and
//! errors by default, and what `RUST_LOG` asks for when it is set.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// The filter when `RUST_LOG` is not set.
const DEFAULT_FILTER: &str = "warn";

/// Sends the library's log to stderr. An unusable `RUST_LOG` falls back to the default, with
/// a note saying why.
pub fn init() {
    let (filter, bad_filter) = match std::env::var("RUST_LOG") {
        Ok(directives) => match EnvFilter::try_new(&directives) {
            Ok(filter) => (filter, None),
            Err(error) => (EnvFilter::new(DEFAULT_FILTER), Some((directives, error))),
        },
        Err(_) => (EnvFilter::new(DEFAULT_FILTER), None),
    };
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .is_ok();
    if let (true, Some((directives, error))) = (installed, bad_filter) {
        tracing::warn!(%directives, %error, "RUST_LOG is not a valid filter; logging warnings");
    }
}
