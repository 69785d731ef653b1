//! The ask timer's store-load pairing between a thread that arms a deadline and the timer
//! thread about to sleep (module `ask_timer`, "How"), apart so that a loom model checks it.
//!
//! # Why
//! The timer thread sleeps until the earliest deadline it found in the maps. A deadline armed
//! after it looked, and earlier than what it plans, must wake it, or the awaited reply's
//! timeout fires late (or, with nothing else armed, never). The armer cannot take the thread's
//! lock on every arm (most deadlines are later than the plan: that is the cheap path), so the
//! two sides pair a store and a load each, with a full fence between: the armer inserts its
//! entry, then reads the plan ([`plan_misses`]); the thread publishes its plan, then looks at
//! the maps again ([`plan_holds`]). Whatever the interleaving, at least one of them sees the
//! other: the thread finds the entry and does not sleep on the old plan, or the armer finds a
//! plan later than its deadline and notifies the thread (under the thread's mutex, with a flag
//! the thread checks before it waits, so that the notification is not lost). Both sides also
//! take the map's lock (the armer to insert, the thread to look), which orders them as well;
//! the fences keep the pairing from depending on that. The model breaks (a thread left
//! waiting) if the thread skips its second look.

// Under loom only the model uses them (the ask timer itself is not built there).
#![cfg_attr(loom, allow(dead_code))]

use crate::sync::{fence, AtomicU64, Ordering};

/// The armer's side, after its entry is in the maps: whether `planned` (the thread's plan, in
/// the timer's nanoseconds; `u64::MAX` for "only when notified") is later than `deadline`, so
/// that the armer must wake the thread.
pub(crate) fn plan_misses(planned: &AtomicU64, deadline: u64) -> bool {
    fence(Ordering::SeqCst);
    deadline < planned.load(Ordering::SeqCst)
}

/// The thread's side: publishes `plan` in `planned`, then says whether it still holds, given
/// the earliest deadline armed now (`earliest_armed`, read after the publication): `false` if
/// an entry armed meanwhile comes earlier, and the thread must look at the maps again.
pub(crate) fn plan_holds(
    planned: &AtomicU64,
    plan: u64,
    earliest_armed: impl FnOnce() -> Option<u64>,
) -> bool {
    planned.store(plan, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    earliest_armed().is_none_or(|armed| armed >= plan)
}

#[cfg(all(test, loom))]
mod loom_tests {
    use loom::sync::{Arc, Condvar, Mutex};

    use super::*;

    /// The timer thread took the entry due at 3 (its plan was 3) and finds nothing left, so it
    /// plans to sleep until notified; meanwhile an asker arms 5. Modelled as the real code does
    /// it: the map behind a mutex, the plan, the notified flag under the thread's mutex and
    /// the condition variable. Whatever the interleaving and the memory model allow, the thread
    /// does not sleep past the new deadline unwoken: it looks again, finds the flag set, or is
    /// notified while it waits (loom reports a thread left waiting for good as a deadlock).
    #[test]
    fn loom_an_armed_deadline_is_never_slept_past() {
        loom::model(|| {
            let map = Arc::new(Mutex::new(None::<u64>));
            let planned = Arc::new(AtomicU64::new(3));
            let notified = Arc::new((Mutex::new(false), Condvar::new()));
            let armer = {
                let (map, planned, notified) =
                    (Arc::clone(&map), Arc::clone(&planned), Arc::clone(&notified));
                loom::thread::spawn(move || {
                    *map.lock().unwrap() = Some(5);
                    if plan_misses(&planned, 5) {
                        *notified.0.lock().unwrap() = true;
                        notified.1.notify_one();
                    }
                })
            };
            // One turn of the thread's loop after `take_due` found nothing.
            let mut flag = notified.0.lock().unwrap();
            let woken_or_looks_again = std::mem::take(&mut *flag)
                || !plan_holds(&planned, u64::MAX, || *map.lock().unwrap());
            if !woken_or_looks_again {
                while !std::mem::take(&mut *flag) {
                    flag = notified.1.wait(flag).unwrap();
                }
            }
            drop(flag);
            armer.join().unwrap();
        });
    }
}
