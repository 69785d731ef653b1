//! Parking and waking without lost wake-ups, in both directions.
//!
//! * [`Doorbell`]: the consumer (an endpoint thread) parks when idle; producers ring it after
//!   publishing. The consumer raises `sleeping`, runs the inbox's heavy barrier and then
//!   re-checks the lanes and rings; a producer publishes, runs the light barrier and then reads
//!   `sleeping` (the store-load pairing of `queue::barrier`), so at least one of them sees the
//!   other: either the consumer finds the message and does not park, or the producer sees
//!   `sleeping` and unparks it. In asymmetric mode the producer's side is a compiler fence and a
//!   plain load of a read-mostly flag that stays shared in every cache.
//! * [`ProducerWaiters`]: producers that find the inbox full register themselves and park; the
//!   consumer, after freeing slots, wakes them. Same pattern with fences on both sides (a slow
//!   path on both). Parking always has a short timeout as well, so even a protocol bug could
//!   only cost latency, never a hang.

use std::time::Duration;

#[cfg(not(loom))]
use crossbeam_queue::SegQueue;
use crossbeam_utils::CachePadded;

use super::barrier::BarrierMode;
use crate::sync::{
    current_thread, fence, park_timeout, Arc, AtomicBool, AtomicUsize, Ordering, Thread,
};

/// The longest a parked producer sleeps before re-checking on its own.
const PRODUCER_PARK_MAX: Duration = Duration::from_millis(1);

/// Registrations in [`ProducerWaiters`] above which a producer whose wait ended while it was
/// still registered empties the queue itself (see [`ProducerWaiters::wait_until`]).
#[cfg(not(loom))]
pub(crate) const STALE_WAITERS_MAX: usize = 64;

/// [`STALE_WAITERS_MAX`] for the loom models: the protocol is the same at any limit, and a
/// small one keeps the models small.
#[cfg(loom)]
pub(crate) const STALE_WAITERS_MAX: usize = 2;

/// Wakes a parked consumer.
#[derive(Debug)]
pub(crate) struct Doorbell {
    /// True while the consumer is parked or about to park. Written by the consumer (set) and by
    /// the consumer or a producer (clear).
    sleeping: CachePadded<AtomicBool>,
    /// The consumer thread; bound once by the consumer before it first raises `sleeping`.
    consumer: std::sync::OnceLock<Thread>,
    /// How producers and the consumer pair their store-load orderings.
    barrier: BarrierMode,
}

impl Doorbell {
    /// A doorbell whose two sides pair through `barrier`.
    pub(crate) fn new(barrier: BarrierMode) -> Self {
        Self { sleeping: CachePadded::default(), consumer: std::sync::OnceLock::new(), barrier }
    }

    /// Consumer: records the calling thread as the one to unpark. Idempotent.
    pub(crate) fn bind_consumer(&self) {
        let _ = self.consumer.set(current_thread());
    }

    /// Whether the consumer has raised `sleeping` (it parks or is about to).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn consumer_sleeping(&self) -> bool {
        self.sleeping.load(Ordering::SeqCst)
    }

    /// Whether the calling thread is the bound consumer (cold paths only: it reads the
    /// thread handle).
    pub(crate) fn on_consumer_thread(&self) -> bool {
        self.consumer.get().is_some_and(|consumer| consumer.id() == current_thread().id())
    }

    /// Consumer: parks for at most `timeout` unless `has_work` (re-checked after announcing the
    /// intent to park) says there is something to do. Returns whether it parked.
    pub(crate) fn park_unless(&self, timeout: Duration, has_work: impl FnOnce() -> bool) -> bool {
        debug_assert!(self.consumer.get().is_some(), "bind_consumer before parking");
        self.sleeping.store(true, Ordering::SeqCst);
        self.barrier.heavy();
        let parks = !has_work();
        if parks {
            park_timeout(timeout);
        }
        self.sleeping.store(false, Ordering::Relaxed);
        parks
    }

    /// Consumer: parks for at most `timeout` whatever is queued, for work that is announced
    /// but cannot be taken yet (a claimed slot not yet filled). It does not look for work
    /// after raising `sleeping` (work is announced already: that is the spin it avoids), so
    /// a producer that reads `sleeping` raised unparks it early, and one that rang just
    /// before (or, in asymmetric mode, whose read is not ordered by a heavy barrier here) is
    /// slept through until the timeout, which is what bounds this wait.
    pub(crate) fn doze(&self, timeout: Duration) {
        debug_assert!(self.consumer.get().is_some(), "bind_consumer before parking");
        self.sleeping.store(true, Ordering::SeqCst);
        park_timeout(timeout);
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// Producer: called after publishing; unparks the consumer if it is (about to be) parked.
    #[inline]
    pub(crate) fn ring(&self) {
        self.barrier.light();
        self.ring_after_sequentially_consistent_claim();
    }

    /// [`Doorbell::ring`] for a producer whose publication was itself a `SeqCst`
    /// read-modify-write (a shared ring's claim): that already orders it before the load below,
    /// so no barrier is needed.
    #[inline]
    pub(crate) fn ring_after_sequentially_consistent_claim(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Unparks the consumer unconditionally (used on close).
    #[cold]
    pub(crate) fn wake(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
        if let Some(consumer) = self.consumer.get() {
            consumer.unpark();
        }
    }
}

/// Producers parked on a full inbox.
#[derive(Debug, Default)]
pub(crate) struct ProducerWaiters {
    /// Number of producers between registering and leaving. Read by the consumer after it frees
    /// slots; a stale registration only causes a spurious wake-up.
    count: CachePadded<AtomicUsize>,
    /// Waiters to unpark, each at most once at a time (see [`Waiter::queued`]). May hold
    /// waiters that already left (a wait that ended by its deadline, say, while the consumer
    /// was stuck); unparking those is harmless, and their number is bounded (see
    /// [`ProducerWaiters::wait_until`]).
    waiters: WaiterQueue,
}

/// The queue of registrations: lock-free outside loom. Under loom a mutex-guarded deque
/// stands in for it, because loom sees no ordering through crossbeam's atomics (it would
/// take the hand-over of a registration for a race).
#[cfg(not(loom))]
type WaiterQueue = SegQueue<Arc<Waiter>>;

/// The queue of registrations, as loom sees it (see the other definition).
#[cfg(loom)]
#[derive(Debug)]
struct WaiterQueue(loom::sync::Mutex<std::collections::VecDeque<Arc<Waiter>>>);

#[cfg(loom)]
impl Default for WaiterQueue {
    fn default() -> Self {
        Self(loom::sync::Mutex::new(std::collections::VecDeque::new()))
    }
}

#[cfg(loom)]
impl WaiterQueue {
    fn push(&self, waiter: Arc<Waiter>) {
        self.0.lock().unwrap().push_back(waiter);
    }

    fn pop(&self) -> Option<Arc<Waiter>> {
        self.0.lock().unwrap().pop_front()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// One producer's registration for one wait.
#[derive(Debug)]
struct Waiter {
    thread: Thread,
    /// True while this waiter is in the queue: a producer that wakes up by its park timeout
    /// does not queue itself again, so a stuck consumer cannot make the queue grow.
    queued: AtomicBool,
}

impl ProducerWaiters {
    /// Producer: waits (parked, bounded) until `try_again` succeeds or says to stop.
    ///
    /// `try_again` returns `Some(result)` to finish, `None` to keep waiting; it is always called
    /// after registering, so a consumer that frees a slot in between is sure to wake us.
    ///
    /// A wait that ends while its registration is still queued leaves it behind, and only the
    /// consumer empties the queue. So that waits ending by their deadline against a stuck
    /// consumer (a `send_timeout` retried in a loop) cannot grow it without bound, a producer
    /// that leaves such a registration while more than [`STALE_WAITERS_MAX`] are queued empties
    /// the queue itself: the live waiters among them get a spurious wake-up and register again.
    pub(crate) fn wait_until<R>(&self, mut try_again: impl FnMut() -> Option<R>) -> R {
        let waiter = Arc::new(Waiter { thread: current_thread(), queued: AtomicBool::new(false) });
        loop {
            self.count.fetch_add(1, Ordering::SeqCst);
            if !waiter.queued.swap(true, Ordering::AcqRel) {
                self.waiters.push(Arc::clone(&waiter));
            }
            fence(Ordering::SeqCst);
            let outcome = try_again();
            if outcome.is_none() {
                park_timeout(PRODUCER_PARK_MAX);
            }
            self.count.fetch_sub(1, Ordering::Relaxed);
            if let Some(result) = outcome {
                if waiter.queued.load(Ordering::Acquire) && self.waiters.len() > STALE_WAITERS_MAX {
                    self.wake_all();
                }
                return result;
            }
        }
    }

    /// Consumer: called after freeing slots (or closing); wakes every registered producer.
    #[inline]
    pub(crate) fn wake_all_if_any(&self) {
        fence(Ordering::SeqCst);
        if self.count.load(Ordering::Relaxed) > 0 {
            self.wake_all();
        }
    }

    /// Number of producers currently registered as waiting (tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn registered(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Number of registrations queued, live or left behind (tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn queued(&self) -> usize {
        self.waiters.len()
    }

    #[cold]
    fn wake_all(&self) {
        while let Some(waiter) = self.waiters.pop() {
            waiter.queued.store(false, Ordering::Release);
            waiter.thread.unpark();
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::thread;

    /// A producer publishing while the consumer decides to park: the consumer either sees the
    /// message before parking or is unparked (loom reports a deadlock if it sleeps forever).
    #[test]
    fn loom_doorbell_has_no_lost_wakeup() {
        loom::model(|| {
            let doorbell = Arc::new(Doorbell::new(BarrierMode::Fenced));
            let published = Arc::new(AtomicBool::new(false));
            doorbell.bind_consumer();
            let producer = {
                let doorbell = Arc::clone(&doorbell);
                let published = Arc::clone(&published);
                thread::spawn(move || {
                    published.store(true, Ordering::SeqCst);
                    doorbell.ring();
                })
            };
            while !published.load(Ordering::SeqCst) {
                doorbell.park_unless(Duration::from_millis(1), || published.load(Ordering::SeqCst));
            }
            producer.join().unwrap();
        });
    }

    /// A producer waiting for room while the consumer frees a slot: the producer either sees
    /// the room or is unparked (loom has no park timeout, so a lost wake-up is a deadlock).
    /// (The waiting side runs on a spawned thread: loom takes an unpark that reaches a thread
    /// blocked in `join` for a broken join.)
    #[test]
    fn loom_producer_waiter_has_no_lost_wakeup() {
        loom::model(|| {
            let waiters = Arc::new(ProducerWaiters::default());
            let room = Arc::new(AtomicBool::new(false));
            let producer = {
                let (waiters, room) = (Arc::clone(&waiters), Arc::clone(&room));
                thread::spawn(move || {
                    waiters.wait_until(|| room.load(Ordering::SeqCst).then_some(()));
                })
            };
            room.store(true, Ordering::SeqCst);
            waiters.wake_all_if_any();
            producer.join().unwrap();
        });
    }

    /// The same while another producer, whose waits ended before anyone woke them, leaves
    /// more than `STALE_WAITERS_MAX` registrations behind and empties the queue: the live
    /// waiter's registration may be taken by that drain instead of the consumer, and it must
    /// still be woken.
    #[test]
    fn loom_producer_waiter_survives_a_stale_drain() {
        loom::model(|| {
            let waiters = Arc::new(ProducerWaiters::default());
            let room = Arc::new(AtomicBool::new(false));
            let waiter = {
                let (waiters, room) = (Arc::clone(&waiters), Arc::clone(&room));
                thread::spawn(move || {
                    waiters.wait_until(|| room.load(Ordering::SeqCst).then_some(()));
                })
            };
            let leaver = {
                let waiters = Arc::clone(&waiters);
                thread::spawn(move || {
                    // Waits that end at once; the last one is over the limit and drains.
                    for _ in 0..=STALE_WAITERS_MAX {
                        waiters.wait_until(|| Some(()));
                    }
                })
            };
            room.store(true, Ordering::SeqCst);
            waiters.wake_all_if_any();
            waiter.join().unwrap();
            leaver.join().unwrap();
        });
    }
}
