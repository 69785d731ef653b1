//! Sync pacing: under sustained group-commit load nobody waits for, groups are spaced out.
//!
//! # Why
//! Under load the pipelined group commit takes the next group as soon as the previous sync
//! completes, so syncs run back to back. On the 2-core class we run on, every sync costs the
//! machine far more than its bytes: a write request and a flush request to the virtual disk
//! (each a VM exit), an interrupt, worker and journal wake-ups. Measured (PERF.md,
//! EpochCoordinator), back-to-back syncs take 0.35-0.56 of a core whatever the I/O method:
//! cheaper syncs only make proportionally more of them. The appenders lose that CPU. When
//! somebody waits for a record to become durable, that is the price of a short wait; when
//! nobody waits (the epoch log: its coordinator never waits for a sync), it buys nothing.
//!
//! # The rule
//! A group that is not full is held past its `max_delay` when all of these hold:
//! * its first record was appended before the previous sync completed (records keep arriving
//!   while syncs run: sustained load, not a lone appender that waited for its last record);
//! * nobody waits for a record that is not durable yet: no [`crate::wal::Wal::wait_durable`]
//!   caller, no durability callback, no reader of a record still staged (they mark the LSN they
//!   need, `Shared::awaited_lsn`, and a waiter that arrives during a paced wait ends it).
//!
//! It is then held until [`PACING_FACTOR`] times the previous sync's duration after that sync
//! completed, at most [`PACING_CAP_DELAYS`] times `max_delay` (2 ms at the 200 us default), so
//! that syncs keep the device busy at most about a fifth of the time. A full group
//! (`max_bytes`), an appender waiting for staging room, or closing the log still take the
//! group at once, so memory stays bounded and nothing waits on pacing but the durable
//! watermark. A light load is not paced at all: its groups start after the previous sync
//! completed.

use std::time::{Duration, Instant};

use crate::sync::{fence, AtomicBool, AtomicU64, Ordering};

/// A paced group waits this many times the previous sync's duration after that sync.
pub(crate) const PACING_FACTOR: u32 = 4;
/// ... but at most this many times the group commit's `max_delay` after that sync.
pub(crate) const PACING_CAP_DELAYS: u32 = 10;

/// The last completed sync: when it completed and how long its group took to become durable
/// (write and sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LastSync {
    pub(crate) done: Instant,
    pub(crate) took: Duration,
}

/// Until when pacing holds a group that is not full and that nobody waits for (checked
/// apart: [`hold_unless_awaited`]), or `None` if it does not (module doc): `group_started` is
/// its first record's append time.
pub(crate) fn paced_until(
    group_started: Instant,
    last_sync: Option<LastSync>,
    max_delay: Duration,
) -> Option<Instant> {
    let last = last_sync?;
    if group_started >= last.done {
        return None;
    }
    let pause =
        last.took.saturating_mul(PACING_FACTOR).min(max_delay.saturating_mul(PACING_CAP_DELAYS));
    Some(last.done + pause)
}

/// Whether the sync thread may hold its group: announces the pause in `pacing`, then looks
/// for waiters (`awaited`), and takes the announcement back if there is one. A waiter does the
/// mirror image ([`mark_awaited`]). Each side has a full fence between its store and its load
/// (a store-load, "Dekker", pairing), so at least one of the two sees the other: either the
/// sync thread finds the waiter, or the waiter finds the pause and wakes the sync thread
/// (under the append lock, which the sync thread holds from here until it waits). Waiters
/// need the lock only while a pause is announced. Checked by a loom model.
pub(crate) fn hold_unless_awaited(pacing: &AtomicBool, awaited: impl FnOnce() -> bool) -> bool {
    pacing.store(true, Ordering::Relaxed);
    fence(Ordering::SeqCst);
    if awaited() {
        pacing.store(false, Ordering::Relaxed);
        return false;
    }
    true
}

/// A waiter's side of [`hold_unless_awaited`]: marks `lsn` as awaited in `awaited_lsn`, then
/// says whether a pause is announced (the waiter must then wake the sync thread).
pub(crate) fn mark_awaited(awaited_lsn: &AtomicU64, lsn: u64, pacing: &AtomicBool) -> bool {
    awaited_lsn.fetch_max(lsn, Ordering::Relaxed);
    fence(Ordering::SeqCst);
    pacing.load(Ordering::Relaxed)
}

#[cfg(all(test, loom))]
mod loom_tests {
    use loom::sync::Arc;

    use super::*;

    /// The handshake of a waiter and a pause: whatever the interleaving and the memory model
    /// allow, the sync thread never holds its group while the waiter misses the pause (which
    /// would leave the waiter's record held for the whole pause).
    #[test]
    fn loom_a_waiter_and_a_pause_always_see_each_other() {
        loom::model(|| {
            let pacing = Arc::new(AtomicBool::new(false));
            let awaited_lsn = Arc::new(AtomicU64::new(0));
            let durable = 5;
            let waiter = {
                let (pacing, awaited_lsn) = (Arc::clone(&pacing), Arc::clone(&awaited_lsn));
                loom::thread::spawn(move || mark_awaited(&awaited_lsn, durable + 1, &pacing))
            };
            let held =
                hold_unless_awaited(&pacing, || awaited_lsn.load(Ordering::Relaxed) > durable);
            let waiter_saw_pause = waiter.join().unwrap();
            assert!(!held || waiter_saw_pause, "a paused group with a waiter that missed it");
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const MAX_DELAY: Duration = Duration::from_micros(200);

    fn last_sync(at: Instant, took_us: u64) -> Option<LastSync> {
        Some(LastSync { done: at, took: Duration::from_micros(took_us) })
    }

    #[test]
    fn a_group_that_started_while_the_last_sync_ran_waits_a_multiple_of_that_sync() {
        let done = Instant::now();
        let started = done - Duration::from_micros(100);
        assert_eq!(
            paced_until(started, last_sync(done, 300), MAX_DELAY),
            Some(done + Duration::from_micros(300 * u64::from(PACING_FACTOR)))
        );
    }

    #[test]
    fn the_pause_is_capped_at_a_multiple_of_max_delay() {
        let done = Instant::now();
        let started = done - Duration::from_micros(100);
        assert_eq!(
            paced_until(started, last_sync(done, 50_000), MAX_DELAY),
            Some(done + MAX_DELAY * PACING_CAP_DELAYS)
        );
    }

    #[test]
    fn a_group_that_started_after_the_last_sync_is_not_paced() {
        let done = Instant::now();
        assert_eq!(paced_until(done, last_sync(done, 300), MAX_DELAY), None);
        let later = done + Duration::from_micros(1);
        assert_eq!(paced_until(later, last_sync(done, 300), MAX_DELAY), None);
    }

    #[test]
    fn a_pause_is_announced_before_looking_for_waiters_and_withdrawn_if_there_is_one() {
        let pacing = AtomicBool::new(false);
        let announced_first = |seen: &mut bool| {
            *seen = pacing.load(Ordering::SeqCst);
            true
        };
        let mut seen = false;
        assert!(!hold_unless_awaited(&pacing, || announced_first(&mut seen)), "a waiter");
        assert!(seen, "announced before looking");
        assert!(!pacing.load(Ordering::SeqCst), "withdrawn");
        assert!(hold_unless_awaited(&pacing, || false), "nobody waits");
        assert!(pacing.load(Ordering::SeqCst), "announced while the group is held");
    }

    #[test]
    fn nothing_is_paced_before_the_first_sync() {
        assert_eq!(paced_until(Instant::now(), None, MAX_DELAY), None);
    }
}
