//! Shared helpers of the WAL tests: waits for durability without a timeout (the wait that may
//! lead: with `EveryRecord`, only such a wait writes and syncs the group on the waiting thread),
//! bounded from outside, so that a wait that hangs fails the test instead of stalling it.

#![allow(dead_code)]

use std::{
    sync::{mpsc, Arc},
    time::Duration,
};

use coordbus::wal::{Lsn, Wal, WalError};

/// How long `work` may take before the test fails: far longer than any sync.
pub const RUN_BOUND: Duration = Duration::from_secs(60);

/// Runs `work` on a thread of its own with a clone of the log and returns its result, failing
/// the test if it has none within [`RUN_BOUND`] (the thread is then left behind). `work`
/// appends and waits with no timeout, right after its appends as a real waiter does, so the
/// waiter may lead.
pub fn bounded<T: Send + 'static>(
    wal: &Arc<Wal>,
    work: impl FnOnce(&Wal) -> T + Send + 'static,
) -> T {
    let (sender, receiver) = mpsc::channel();
    let wal = Arc::clone(wal);
    std::thread::spawn(move || {
        let result = work(&wal);
        // Before answering: the caller may close, drop and reopen the log next.
        drop(wal);
        let _ = sender.send(result);
    });
    match receiver.recv_timeout(RUN_BOUND) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the waits hung (nothing in {RUN_BOUND:?})"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the waiting thread panicked"),
    }
}

/// `wal.wait_durable(lsn)` through [`bounded`]. The wait starts a thread's start-up after the
/// append, so the sync thread may write the group first: use [`bounded`] around the appends
/// too where leading matters.
pub fn wait_durable_bounded(wal: &Arc<Wal>, lsn: Lsn) -> Result<(), WalError> {
    bounded(wal, move |wal| wal.wait_durable(lsn))
}
