//! A panic on the WAL's sync thread (a broken invariant, or a storage layer that panics) fails
//! the log at once: a thread waiting for durability gets the error instead of waiting forever,
//! durability callbacks run with it (one that panics does not abort the process), and later
//! appends are refused.
//!
//! Method: a storage whose `sync_data` panics once the test opens a gate (until then it
//! holds every sync), on the pwrite path (the file hides its descriptor), with group commit
//! (so the sync thread, not a waiter, writes and syncs). Each
//! wait runs on a helper thread and is collected with a bound: the bug this guards against is
//! a hang.

mod wal_support;

use std::{
    sync::{mpsc, Arc},
    time::Duration,
};

use coordbus::wal::WalError;
use wal_support::{open_gated, AfterGate, Gate};

/// Far longer than a sync; a wait that has not returned by then is hung.
const BOUND: Duration = Duration::from_secs(30);

#[test]
fn a_panic_on_the_sync_thread_fails_waiters_callbacks_and_appends_instead_of_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let wal = Arc::new(open_gated(dir.path(), &gate, AfterGate::Panic));
    // Appended, called back and waited for while every sync is held at the gate: nothing can
    // fail before the gate opens.
    let (lsn, _) = wal.append_bytes(b"never durable", 1).unwrap();
    let (later, _) = wal.append_bytes(b"also never durable", 1).unwrap();
    // A callback that panics on the error it is given, registered before anything failed, so
    // the sync thread runs it: after its own unwind was caught, so it is a panic of its own,
    // not a panic while panicking (which aborts the process, and this test with it).
    wal.notify_when_durable(later, Box::new(|outcome| outcome.expect("injected: callback panics")));
    let (callback_tx, callback_rx) = mpsc::channel();
    wal.notify_when_durable(
        lsn,
        Box::new(move |outcome| {
            let _ = callback_tx.send(outcome);
        }),
    );
    let (wait_tx, wait_rx) = mpsc::channel();
    let waiter = {
        let wal = Arc::clone(&wal);
        std::thread::spawn(move || {
            let _ = wait_tx.send(wal.wait_durable(lsn));
        })
    };

    gate.open();
    let waited = wait_rx.recv_timeout(BOUND).expect("the durability wait hung after the panic");
    waiter.join().unwrap();
    let error = waited.expect_err("a record whose sync panicked was reported durable");
    assert!(error.to_string().contains("sync thread panicked"), "unexpected error: {error}");

    let called = callback_rx.recv_timeout(BOUND).expect("the durability callback never ran");
    assert!(called.is_err(), "the callback was told the record is durable");

    assert!(
        matches!(wal.append_bytes(b"after", 2), Err(WalError::Failed { .. })),
        "an append after the panic was accepted"
    );
    assert!(wal.durable_lsn() < lsn, "the durable watermark moved past the failed record");

    // A bounded close sees the thread gone and reports the failure at once, not a timeout.
    let started = std::time::Instant::now();
    let closed = wal.close_timeout(BOUND);
    assert!(matches!(closed, Err(WalError::Failed { .. })), "close_timeout gave {closed:?}");
    assert!(started.elapsed() < BOUND / 2, "close_timeout waited {:?}", started.elapsed());
}
