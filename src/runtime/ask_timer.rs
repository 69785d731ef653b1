//! The ask timer: wakes an awaited [`Reply`](super::Reply) at its deadline, so that `.await`
//! honours the bus's `ask_timeout` as [`Reply::wait`](super::Reply::wait) does, with any
//! executor.
//!
//! # Why
//! A blocking wait parks with a timeout; a future can only return `Pending` and wait to be
//! woken. Without a timer, a reply that never comes (a handler that keeps its `Replier` and
//! never answers) left `.await` pending until something else woke the task: an unbounded wait.
//!
//! # How
//! One process-wide thread, started by the first reply that is awaited and still pending,
//! keeps the armed deadlines (deadline and a unique key, to the task's waker) in [`SHARDS`]
//! ordered maps, each behind its own mutex (askers on different threads rarely meet), and
//! sleeps on a condition variable until the earliest. A reply disarms its entry when it
//! completes or is dropped, so the maps hold only the replies still awaited: bounded by the
//! asks in flight. Only awaiting pays for this; a blocking wait never arms.
//!
//! Deadlines lie `ask_timeout` after a reply's first poll (or after the start of its ask's wait
//! for room in a full inbox, which is earlier), so a new one is almost never earlier
//! than the one the thread sleeps until: arming then costs one shard lock and one atomic load,
//! and the thread wakes about once per `ask_timeout` while replies are awaited, never while
//! none are. Arming an earlier deadline wakes the thread. That is a store-load pairing: the
//! armer inserts and then reads the thread's plan, the thread publishes its plan and then
//! looks at the maps again, each with a full fence between; so either the thread finds the
//! new entry before it sleeps, or the armer finds the plan later than its deadline and
//! notifies (under the thread's mutex, with a flag the thread checks before it waits, so a
//! notification is never lost). The pairing is module `timer_handshake`, checked by a loom
//! model there.
//!
//! If the thread cannot be started (the system refuses a thread), awaiting falls back to
//! checking the deadline only when the task is polled, and a warning says so once. Under Miri
//! no reply arms (the timer thread never ends, which Miri reports as an error at exit).

use std::{
    collections::BTreeMap,
    sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError},
    task::Waker,
    time::Instant,
};

use super::timer_handshake::{plan_holds, plan_misses};
use crate::sync::{AtomicU64, Ordering};

/// Maps of armed deadlines, each behind its own lock; a thread arms in one of them.
const SHARDS: usize = 8;

/// An armed deadline: when, and a key unique among the entries alive (the arming thread's
/// token in the high half, its own count in the low half).
type Key = (Instant, u64);

/// A deadline armed for an awaited reply; dropping it disarms it.
#[derive(Debug)]
pub(crate) struct Armed {
    key: Key,
    /// The waker the timer holds, to tell when a later poll brings another one.
    waker: Waker,
}

impl Armed {
    /// Arms `deadline` to wake `waker`, or `None` if the timer thread could not be started.
    pub(crate) fn new(deadline: Instant, waker: &Waker) -> Option<Self> {
        let timer = timer()?;
        let key = (deadline, next_key());
        // Cloned outside the lock (a waker is the asker's code).
        let entry = waker.clone();
        timer.shard(key).insert(key, entry);
        timer.wake_if_earlier(deadline);
        Some(Self { key, waker: waker.clone() })
    }

    /// Makes the timer wake `waker` instead, if it is not the same task's (a task polled from
    /// another thread of its executor may bring another waker). If the timer took the entry
    /// meanwhile (the deadline passed after the poll read the clock), it woke the old waker,
    /// which may no longer poll this reply: the new one is woken here.
    pub(crate) fn update(&mut self, waker: &Waker) {
        if self.waker.will_wake(waker) {
            return;
        }
        let replaced = TIMER.get().copied().flatten().and_then(|timer| {
            // Cloned, and the old one dropped, outside the lock (a waker is the asker's code).
            let replacement = waker.clone();
            let old = timer
                .shard(self.key)
                .get_mut(&self.key)
                .map(|armed| std::mem::replace(armed, replacement));
            old
        });
        if replaced.is_none() {
            waker.wake_by_ref();
        }
        drop(replaced);
        self.waker.clone_from(waker);
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(timer) = TIMER.get().copied().flatten() {
            // Gone already if the deadline passed: the thread took it to wake it.
            let removed = timer.shard(self.key).remove(&self.key);
            // Dropped outside the lock: a waker is the asker's code.
            drop(removed);
        }
    }
}

/// The timer's state, shared by the armers and its thread.
struct Timer {
    shards: [Mutex<BTreeMap<Key, Waker>>; SHARDS],
    /// When the thread plans to wake, in nanoseconds after `base` (`u64::MAX`: only when
    /// notified).
    planned: AtomicU64,
    base: Instant,
    /// Set by an armer that notified; the thread looks at the maps again before it waits.
    notified: Mutex<bool>,
    wake: Condvar,
}

/// The timer, started on first use (one for the process, never freed); `None` inside if its
/// thread could not be started.
static TIMER: OnceLock<Option<&'static Timer>> = OnceLock::new();

fn timer() -> Option<&'static Timer> {
    *TIMER.get_or_init(|| {
        let timer: &'static Timer = Box::leak(Box::new(Timer::new()));
        let spawned = std::thread::Builder::new()
            .name("coordbus-ask-timer".to_owned())
            .spawn(move || run(timer));
        match spawned {
            Ok(_) => Some(timer),
            Err(error) => {
                tracing::warn!(
                    %error,
                    "the ask timer thread could not be started: an awaited reply checks its \
                     ask timeout only when its task is polled"
                );
                None
            }
        }
    })
}

/// A key unique among the entries alive: this thread's token and its next count.
fn next_key() -> u64 {
    static THREADS: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static TOKEN: u64 = THREADS.fetch_add(1, Ordering::Relaxed) << 32;
        static COUNT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    let count = COUNT.with(|count| {
        let next = count.get().wrapping_add(1);
        count.set(next);
        next
    });
    TOKEN.with(|token| token | u64::from(count))
}

impl Timer {
    fn new() -> Self {
        Self {
            shards: std::array::from_fn(|_| Mutex::new(BTreeMap::new())),
            planned: AtomicU64::new(u64::MAX),
            base: Instant::now(),
            notified: Mutex::new(false),
            wake: Condvar::new(),
        }
    }

    /// The map holding `key`. A panic while a map is locked cannot leave it inconsistent
    /// (each use is one map call), so a poisoned lock is used as it is.
    fn shard(&self, key: Key) -> MutexGuard<'_, BTreeMap<Key, Waker>> {
        let index = (key.1 >> 32) as usize % SHARDS;
        self.shards[index].lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX - 1)
    }

    /// After arming `deadline`: wakes the thread if it plans to sleep past it (module doc).
    fn wake_if_earlier(&self, deadline: Instant) {
        if plan_misses(&self.planned, self.nanos(deadline)) {
            *self.notified.lock().unwrap_or_else(PoisonError::into_inner) = true;
            self.wake.notify_one();
        }
    }

    /// Takes the entries due at `now` out of the maps; returns their wakers and the earliest
    /// deadline left.
    fn take_due(&self, now: Instant) -> (Vec<Waker>, Option<Instant>) {
        let mut due = Vec::new();
        let mut earliest: Option<Instant> = None;
        for shard in &self.shards {
            let mut map = shard.lock().unwrap_or_else(PoisonError::into_inner);
            while let Some(entry) = map.first_entry() {
                if entry.key().0 > now {
                    let deadline = entry.key().0;
                    earliest = Some(earliest.map_or(deadline, |earliest| earliest.min(deadline)));
                    break;
                }
                due.push(entry.remove());
            }
        }
        (due, earliest)
    }

    /// The earliest deadline armed now.
    fn earliest(&self) -> Option<Instant> {
        self.shards
            .iter()
            .filter_map(|shard| {
                shard
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .first_key_value()
                    .map(|(key, _)| key.0)
            })
            .min()
    }
}

/// The timer thread: wakes what is due, then sleeps until the earliest deadline left.
fn run(timer: &'static Timer) {
    loop {
        let (due, earliest) = timer.take_due(Instant::now());
        for waker in due {
            // A waker is the asker's code: one that panics must not end the timer.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake())).is_err() {
                tracing::warn!("an asker's waker panicked when woken at its ask timeout");
            }
        }
        let mut notified = timer.notified.lock().unwrap_or_else(PoisonError::into_inner);
        if std::mem::take(&mut *notified) {
            continue;
        }
        let plan = earliest.map_or(u64::MAX, |at| timer.nanos(at));
        // An entry armed after `take_due` whose armer read the plan before this one.
        if !plan_holds(&timer.planned, plan, || timer.earliest().map(|at| timer.nanos(at))) {
            continue;
        }
        let notified = match earliest {
            None => timer.wake.wait(notified).unwrap_or_else(PoisonError::into_inner),
            Some(at) => {
                let timeout = at.saturating_duration_since(Instant::now());
                timer.wake.wait_timeout(notified, timeout).unwrap_or_else(PoisonError::into_inner).0
            }
        };
        drop(notified);
    }
}

/// An armed deadline's identity (tests).
#[cfg(test)]
pub(crate) type ArmedKey = Key;

#[cfg(test)]
impl Armed {
    pub(crate) fn key(&self) -> ArmedKey {
        self.key
    }
}

/// Whether `key` is armed now (tests).
#[cfg(test)]
pub(crate) fn is_armed(key: ArmedKey) -> bool {
    TIMER.get().copied().flatten().is_some_and(|timer| timer.shard(key).contains_key(&key))
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{atomic::AtomicUsize, Arc},
        task::Wake,
        time::Duration,
    };

    use super::*;

    /// Counts its wake-ups.
    #[derive(Default)]
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Yields until `condition` holds; fails the test after 10 s.
    fn wait_for(what: &str, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "{what}: not within 10 s");
            std::thread::yield_now();
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "the timer thread never ends")]
    fn a_due_deadline_wakes_its_waker_and_leaves_the_timer() {
        let first = Arc::new(Counting::default());
        let armed = Armed::new(Instant::now(), &Waker::from(Arc::clone(&first))).unwrap();
        wait_for("woken", || first.0.load(Ordering::SeqCst) == 1);
        assert!(!is_armed(armed.key()));
    }

    /// The deadline passed and the timer woke the waker it held, after the poll that brings
    /// another waker read the clock: that poll's waker is woken too, or its task would wait
    /// for a wake-up that went to the other one.
    #[test]
    #[cfg_attr(miri, ignore = "the timer thread never ends")]
    fn a_waker_brought_after_the_timer_fired_is_woken() {
        let (first, second) = (Arc::new(Counting::default()), Arc::new(Counting::default()));
        let mut armed = Armed::new(Instant::now(), &Waker::from(Arc::clone(&first))).unwrap();
        wait_for("timer fired", || !is_armed(armed.key()));
        armed.update(&Waker::from(Arc::clone(&second)));
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    #[cfg_attr(miri, ignore = "the timer thread never ends")]
    fn an_armed_waker_replaced_before_its_deadline_is_the_one_woken() {
        let (first, second) = (Arc::new(Counting::default()), Arc::new(Counting::default()));
        // Far enough that the update comes first even on a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut armed = Armed::new(deadline, &Waker::from(Arc::clone(&first))).unwrap();
        armed.update(&Waker::from(Arc::clone(&second)));
        wait_for("woken", || second.0.load(Ordering::SeqCst) == 1);
        assert!(Instant::now() >= deadline);
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
    }
}
