//! The data plane: a sharded, bounded, lock-free inbox with one consumer.
//!
//! Parts:
//! * `ring`: one bounded MPSC ring (Vyukov stamps, batch claims, a closed mark in the tail).
//!   The only `unsafe` code of the queue.
//! * `wake`: parking and waking of the consumer (doorbell) and of producers blocked on a full
//!   inbox, without lost wake-ups.
//! * [`ShardedQueue`] (here): several rings behind one consumer. A producer thread is given a
//!   fixed shard the first time it sends (a per-thread index, modulo the shard count), so all
//!   of one thread's messages, one-way and request-reply alike, travel through one FIFO ring:
//!   per-sender order (SPEC A.4) holds by construction. Producers on different shards never
//!   touch the same cache lines.
//!
//! Invariants: messages of one producer thread are consumed in the order they were pushed;
//! every message that was accepted is consumed exactly once, also after `close` (the consumer
//! drains until every ring is drained); after `close` no push succeeds. The send path takes no
//! lock: a compare-exchange to claim, a release store to publish, one read of the doorbell.
//!
//! What it does not do: dispatch, threads, timeouts on the consumer side. Those live in
//! `runtime`. This module imports nothing else from the crate except the `sync` shim.

mod ring;
mod wake;

use std::{
    cell::Cell,
    time::{Duration, Instant},
};

use crossbeam_utils::{Backoff, CachePadded};

pub(crate) use self::ring::{ClaimError, PushError};
use self::{
    ring::Ring,
    wake::{Doorbell, ProducerWaiters},
};
use crate::sync::{AtomicBool, AtomicUsize, Ordering};

/// Index of a producer thread, handed out once per thread; `index % shards` picks its shard.
fn producer_index() -> usize {
    static NEXT_PRODUCER_INDEX: std::sync::atomic::AtomicUsize =
        std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static PRODUCER_INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    PRODUCER_INDEX.with(|cell| {
        let mut index = cell.get();
        if index == usize::MAX {
            index = NEXT_PRODUCER_INDEX.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            cell.set(index);
        }
        index
    })
}

/// Why a push failed; the message (or the messages not taken) is handed back.
#[derive(Debug, PartialEq, Eq)]
pub enum QueueError<T> {
    /// The inbox is full (only from non-blocking pushes).
    Full(T),
    /// The inbox is closed for good.
    Closed(T),
    /// The inbox stayed full until the deadline.
    Timeout(T),
}

/// A bounded inbox of several MPSC rings drained by one consumer thread.
///
/// Producers may be any threads; consumer methods (`drain_round`, `park_until_work`,
/// `is_drained`) must only be called from the one consumer thread.
pub struct ShardedQueue<T> {
    shards: Box<[Ring<T>]>,
    doorbell: Doorbell,
    blocked_producers: ProducerWaiters,
    /// High-water mark of a single shard's depth, sampled by the consumer per drained batch.
    depth_high_water: AtomicUsize,
    /// Set once by `close`, after every ring is closed; never written on the send path.
    closed: CachePadded<AtomicBool>,
}

impl<T> std::fmt::Debug for ShardedQueue<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ShardedQueue")
            .field("shards", &self.shards.len())
            .field("capacity_per_shard", &self.shards[0].capacity())
            .field("len", &self.len())
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl<T> ShardedQueue<T> {
    /// `shard_count` rings of `capacity_per_shard` slots each (both rounded up to a power of
    /// two; at least 1 shard of 2 slots).
    pub fn new(shard_count: usize, capacity_per_shard: usize) -> Self {
        let shard_count = shard_count.max(1).next_power_of_two();
        Self {
            shards: (0..shard_count).map(|_| Ring::with_capacity(capacity_per_shard)).collect(),
            doorbell: Doorbell::default(),
            blocked_producers: ProducerWaiters::default(),
            depth_high_water: AtomicUsize::new(0),
            closed: CachePadded::new(AtomicBool::new(false)),
        }
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Slots per shard.
    pub fn capacity_per_shard(&self) -> usize {
        self.shards[0].capacity()
    }

    /// Messages queued and not yet consumed, over all shards (approximate while running).
    pub fn len(&self) -> usize {
        self.shards.iter().map(Ring::len).sum()
    }

    /// Whether nothing is queued (approximate while running).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The largest depth of one shard seen by the consumer.
    pub fn depth_high_water(&self) -> usize {
        self.depth_high_water.load(Ordering::Relaxed)
    }

    /// Whether the queue was closed (a read-mostly flag, cheap to poll).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The shard of the calling thread (a mask, not a division: the shard count is a power of
    /// two).
    #[inline]
    fn my_shard(&self) -> &Ring<T> {
        &self.shards[producer_index() & (self.shards.len() - 1)]
    }

    /// Pushes without waiting.
    ///
    /// # Errors
    /// `Full` if the caller's shard has no free slot, `Closed` after [`ShardedQueue::close`].
    #[inline]
    pub fn try_push(&self, value: T) -> Result<(), QueueError<T>> {
        match self.my_shard().push(value) {
            Ok(()) => {
                self.doorbell.ring();
                Ok(())
            }
            Err(PushError::Full(value)) => Err(QueueError::Full(value)),
            Err(PushError::Closed(value)) => Err(QueueError::Closed(value)),
        }
    }

    /// Pushes, waiting for room while the shard is full: spinning briefly, then parked, until
    /// `deadline` (none: as long as it takes).
    ///
    /// # Errors
    /// `Closed` if the queue is or becomes closed, `Timeout` if the deadline passes first.
    #[inline]
    pub fn push(&self, value: T, deadline: Option<Instant>) -> Result<(), QueueError<T>> {
        match self.try_push(value) {
            Err(QueueError::Full(value)) => self.push_slow(value, deadline),
            outcome => outcome,
        }
    }

    #[cold]
    fn push_slow(&self, value: T, deadline: Option<Instant>) -> Result<(), QueueError<T>> {
        let mut pending = Some(value);
        let backoff = Backoff::new();
        while !backoff.is_completed() {
            match self.try_push(pending.take().expect("value present while looping")) {
                Err(QueueError::Full(value)) => pending = Some(value),
                outcome => return outcome,
            }
            backoff.snooze();
        }
        self.blocked_producers.wait_until(|| {
            let value = pending.take().expect("value present while waiting");
            match self.try_push(value) {
                Err(QueueError::Full(value)) if deadline_passed(deadline) => {
                    Some(Err(QueueError::Timeout(value)))
                }
                Err(QueueError::Full(value)) => {
                    pending = Some(value);
                    None
                }
                outcome => Some(outcome),
            }
        })
    }

    /// Pushes all of `values` in order, claiming as many slots as possible with each
    /// compare-exchange (one publication per claim), waiting for room like [`push`] when the
    /// shard is full.
    ///
    /// # Errors
    /// `Closed` or `Timeout` with the messages not pushed (those before them were).
    ///
    /// [`push`]: ShardedQueue::push
    pub fn push_batch<I>(
        &self,
        values: I,
        deadline: Option<Instant>,
    ) -> Result<(), QueueError<Vec<T>>>
    where
        I: IntoIterator<Item = T>,
        I::IntoIter: ExactSizeIterator,
    {
        let shard = self.my_shard();
        let mut rest = values.into_iter();
        let mut want = rest.len().min(shard.capacity());
        let backoff = Backoff::new();
        while rest.len() > 0 {
            want = want.clamp(1, rest.len().min(shard.capacity()));
            match shard.claim(want) {
                Ok(claim) => {
                    let len = claim.len();
                    shard.fill(claim, rest.by_ref().take(len));
                    self.doorbell.ring();
                    backoff.reset();
                    want = rest.len();
                }
                Err(ClaimError::Closed) => return Err(QueueError::Closed(rest.collect())),
                Err(ClaimError::Full) if want > 1 => want /= 2,
                Err(ClaimError::Full) => {
                    if backoff.is_completed() {
                        let room = self.blocked_producers.wait_until(|| {
                            if shard.len() < shard.capacity() || shard.is_closed() {
                                Some(true)
                            } else if deadline_passed(deadline) {
                                Some(false)
                            } else {
                                None
                            }
                        });
                        if !room {
                            return Err(QueueError::Timeout(rest.collect()));
                        }
                    } else {
                        backoff.snooze();
                    }
                }
            }
        }
        Ok(())
    }

    /// Closes every shard: no push succeeds from now on; what is queued stays to be drained.
    /// Wakes the consumer and blocked producers. Returns `false` if it was already closed.
    pub fn close(&self) -> bool {
        let mut first = false;
        for shard in self.shards.iter() {
            first |= shard.close();
        }
        self.closed.store(true, Ordering::Release);
        self.doorbell.wake();
        self.blocked_producers.wake_all_if_any();
        first
    }

    /// Consumer: records the calling thread as the consumer (to be unparked by producers).
    pub fn bind_consumer(&self) {
        self.doorbell.bind_consumer();
    }

    /// Consumer: takes up to `max_per_shard` messages from every shard in turn (fair: no shard
    /// can starve another). Returns how many were handled.
    pub fn drain_round(&self, max_per_shard: usize, mut handle: impl FnMut(T)) -> usize {
        let mut total = 0;
        for shard in self.shards.iter() {
            let depth = shard.len();
            let taken = shard.pop_batch(max_per_shard, &mut handle);
            if taken > 0 {
                if depth > self.depth_high_water.load(Ordering::Relaxed) {
                    self.depth_high_water.store(depth, Ordering::Relaxed);
                }
                total += taken;
            }
        }
        if total > 0 {
            self.blocked_producers.wake_all_if_any();
        }
        total
    }

    /// Consumer: parks for at most `timeout`, unless something is (or becomes) queued or the
    /// queue is closed.
    pub fn park_until_work(&self, timeout: Duration) {
        self.doorbell.park_unless(timeout, || {
            self.is_closed() || self.shards.iter().any(|shard| !shard.is_empty_for_consumer())
        });
    }

    /// Consumer: closed and every accepted message consumed.
    pub fn is_drained(&self) -> bool {
        self.shards.iter().all(Ring::is_drained)
    }
}

fn deadline_passed(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|deadline| Instant::now() >= deadline)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_thread_uses_one_shard_so_its_messages_stay_in_order() {
        let queue = ShardedQueue::new(4, 8);
        for value in 0..8 {
            queue.try_push(value).unwrap();
        }
        assert!(matches!(queue.try_push(8), Err(QueueError::Full(8))));
        let mut seen = Vec::new();
        queue.drain_round(100, |value| seen.push(value));
        assert_eq!(seen, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn push_with_deadline_times_out_on_a_full_shard() {
        let queue = ShardedQueue::new(1, 2);
        queue.try_push(1).unwrap();
        queue.try_push(2).unwrap();
        let deadline = Instant::now() + Duration::from_millis(20);
        assert_eq!(queue.push(3, Some(deadline)), Err(QueueError::Timeout(3)));
        assert_eq!(
            queue.push_batch(vec![4, 5], Some(Instant::now())),
            Err(QueueError::Timeout(vec![4, 5]))
        );
    }

    #[test]
    fn batch_larger_than_capacity_flows_through_with_a_consumer() {
        let queue = Arc::new(ShardedQueue::<i32>::new(2, 16));
        let consumer = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || {
                queue.bind_consumer();
                let mut seen = Vec::new();
                while seen.len() < 1000 {
                    if queue.drain_round(7, |value| seen.push(value)) == 0 {
                        queue.park_until_work(Duration::from_millis(5));
                    }
                }
                seen
            })
        };
        queue.push_batch(0..1000, None).unwrap();
        assert_eq!(consumer.join().unwrap(), (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn close_wakes_blocked_producer_with_closed() {
        let queue = Arc::new(ShardedQueue::new(1, 2));
        queue.try_push(1).unwrap();
        queue.try_push(2).unwrap();
        let producer = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || queue.push(3, None))
        };
        // The producer is either about to block or blocked; closing must release it either way.
        while queue.blocked_producers_registered() == 0 && !producer.is_finished() {
            std::thread::yield_now();
        }
        queue.close();
        assert_eq!(producer.join().unwrap(), Err(QueueError::Closed(3)));
        let mut seen = Vec::new();
        queue.drain_round(10, |value| seen.push(value));
        assert_eq!(seen, vec![1, 2]);
        assert!(queue.is_drained());
    }

    impl<T: Send> ShardedQueue<T> {
        fn blocked_producers_registered(&self) -> usize {
            self.blocked_producers.registered()
        }
    }
}
