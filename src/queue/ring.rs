//! A bounded multi-producer, single-consumer ring with per-slot sequence stamps.
//!
//! The algorithm is Dmitry Vyukov's bounded MPMC queue as used by crossbeam's `ArrayQueue`
//! (<https://www.1024cores.net/home/lock-free-algorithms/queues/bounded-mpmc-queue>), narrowed to
//! one consumer and extended in two ways:
//!
//! * **Batch claims.** A producer may claim `n` consecutive positions with one compare-exchange of
//!   the tail, then fill them. Because the single consumer frees slots strictly in order, the
//!   whole range is free exactly when its *last* slot is free, so one stamp check suffices.
//! * **Closing.** The top bit of `tail` is a closed mark. Producers claim positions with a
//!   compare-exchange on `tail`, so once the mark is set no position can be claimed any more:
//!   every message that will ever be in the ring has a position below the marked tail, and the
//!   consumer knows it has drained the ring when `head` reaches it. This gives "stop drains what
//!   was queued, then nothing more" (SPEC A.5) without any extra counter on the send path.
//!
//! Stamps: slot `i` starts with stamp `i`. A producer that owns position `p` writes the value and
//! then stores stamp `p + 1` (release): "full, for the consumer at `p`". The consumer at `p`
//! waits for stamp `p + 1` (acquire), moves the value out, and stores stamp `p + capacity`
//! (release): "free, for the producer at `p + capacity`". Positions grow without wrapping (2^63
//! of them at one message per nanosecond last 292 years).
//!
//! This file holds `unsafe` for the slot cells: each is written by the one producer that
//! claimed its position and read by the one consumer, the stamp protocol above ordering the two.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use crossbeam_utils::CachePadded;

use super::{Consume, Run};
use crate::sync::{AtomicUsize, Ordering, UnsafeCell};

/// The closed mark in `tail`.
const CLOSED_BIT: usize = 1 << (usize::BITS - 1);

/// Why a push did not take the message; the message is handed back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PushError<T> {
    /// No free slot right now.
    Full(T),
    /// The ring was closed; it will never take a message again.
    Closed(T),
}

/// Why a batch claim failed.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub(crate) enum ClaimError {
    /// Fewer free slots than requested right now.
    Full,
    /// The ring was closed.
    Closed,
}

struct Slot<T> {
    /// Sequence stamp; see the module doc. Written with release by whoever hands the slot over.
    stamp: AtomicUsize,
    /// Initialised exactly when `stamp == position + 1` for the slot's current position.
    value: UnsafeCell<MaybeUninit<T>>,
}

/// Bytes of one slot of a ring (or a lane, whose slots have the same fields) holding a `T`.
pub(crate) const fn slot_size<T>() -> usize {
    std::mem::size_of::<Slot<T>>()
}

/// A bounded MPSC ring. Any number of threads may push; exactly one thread (the owner of the
/// endpoint's inbox) may call the consumer methods (`pop_batch`, `is_empty_for_consumer`,
/// `is_drained`).
pub(crate) struct Ring<T> {
    /// Next position the consumer reads. Written only by the consumer; read by anyone for `len`.
    head: CachePadded<AtomicUsize>,
    /// Next position a producer claims, with [`CLOSED_BIT`]. Advanced only by compare-exchange.
    tail: CachePadded<AtomicUsize>,
    /// `capacity` slots; `capacity` is a power of two.
    slots: Box<[Slot<T>]>,
    /// `capacity - 1`.
    mask: usize,
}

// SAFETY: values of `T` are moved from the producing thread to the consuming thread through the
// slot cells; the stamp protocol gives each cell exactly one accessor at a time. `T: Send` is
// therefore all that is needed to share the ring between threads.
unsafe impl<T: Send> Send for Ring<T> {}
// SAFETY: as above; all shared mutation goes through atomics or stamp-guarded cells.
unsafe impl<T: Send> Sync for Ring<T> {}

/// Positions claimed by a producer, to be filled in order with [`Ring::fill`].
#[derive(Debug)]
pub(crate) struct Claim {
    /// First claimed position.
    start: usize,
    /// Number of positions claimed.
    len: usize,
}

impl Claim {
    /// Number of positions claimed.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl<T> Ring<T> {
    /// A ring of `capacity` slots, rounded up to a power of two (at least 2).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        debug_assert!(capacity <= super::MAX_CAPACITY, "checked by `ShardedQueue`");
        let capacity = capacity.max(2).next_power_of_two();
        let slots = (0..capacity)
            .map(|index| Slot {
                stamp: AtomicUsize::new(index),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        Self {
            head: CachePadded::new(AtomicUsize::new(0)),
            tail: CachePadded::new(AtomicUsize::new(0)),
            slots,
            mask: capacity - 1,
        }
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Messages claimed but not yet consumed (approximate while producers run).
    pub(crate) fn len(&self) -> usize {
        let tail = self.tail.load(Ordering::Acquire) & !CLOSED_BIT;
        let head = self.head.load(Ordering::Acquire);
        tail.saturating_sub(head)
    }

    /// Marks the ring closed; later pushes fail with `Closed`. Returns `false` if it already was.
    pub(crate) fn close(&self) -> bool {
        self.tail.fetch_or(CLOSED_BIT, Ordering::SeqCst) & CLOSED_BIT == 0
    }

    /// Pushes one message, or hands it back. (The one-position case of [`Ring::claim`] and
    /// [`Ring::fill`], written out because it is the hottest path of the crate.)
    #[inline]
    pub(crate) fn push(&self, value: T) -> Result<(), PushError<T>> {
        let mut tail = self.tail.load(Ordering::Relaxed);
        loop {
            if tail & CLOSED_BIT != 0 {
                return Err(PushError::Closed(value));
            }
            let slot = self.slot(tail);
            let stamp = slot.stamp.load(Ordering::Acquire);
            if stamp == tail {
                // SeqCst: pairs with the consumer's "about to park" flag (see `claim`).
                match self.tail.compare_exchange_weak(
                    tail,
                    tail + 1,
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        slot.value.with_mut(|cell| {
                            // SAFETY: as in `fill`: this producer won position `tail`, whose
                            // slot the consumer has released (stamp == tail); nobody else
                            // touches the cell until the stamp below publishes it.
                            unsafe { (*cell).write(value) };
                        });
                        slot.stamp.store(tail + 1, Ordering::Release);
                        return Ok(());
                    }
                    Err(current) => tail = current,
                }
            } else if stamp < tail {
                let current = self.tail.load(Ordering::Relaxed);
                if current == tail {
                    return Err(PushError::Full(value));
                }
                tail = current;
            } else {
                crate::sync::spin_loop();
                tail = self.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// The slot of `position`.
    #[inline(always)]
    fn slot(&self, position: usize) -> &Slot<T> {
        let index = position & self.mask;
        debug_assert!(index < self.slots.len());
        // SAFETY: `slots.len() == mask + 1` (set in `with_capacity`, never changed), so
        // `position & mask` is always a valid index; this skips a bounds check per message.
        unsafe { self.slots.get_unchecked(index) }
    }

    /// Claims `len` consecutive positions (1 ..= capacity) with one compare-exchange.
    ///
    /// The claim must be passed to [`Ring::fill`] with exactly `len` values; until it is, the
    /// consumer waits at the first claimed position.
    pub(crate) fn claim(&self, len: usize) -> Result<Claim, ClaimError> {
        debug_assert!(len >= 1 && len <= self.capacity(), "claim of {len} positions");
        let mut tail = self.tail.load(Ordering::Relaxed);
        loop {
            if tail & CLOSED_BIT != 0 {
                return Err(ClaimError::Closed);
            }
            let last = tail + len - 1;
            let stamp = self.slot(last).stamp.load(Ordering::Acquire);
            if stamp == last {
                // SeqCst: this claim and the consumer's "about to park" flag form a Dekker pair
                // (see `queue::Doorbell`); on x86 the CAS is a full barrier anyway.
                match self.tail.compare_exchange_weak(
                    tail,
                    tail + len,
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return Ok(Claim { start: tail, len }),
                    Err(current) => tail = current,
                }
            } else if stamp < last {
                // The slot still holds the message of the previous lap: full, unless the tail
                // moved meanwhile (then retry from the new tail).
                let current = self.tail.load(Ordering::Relaxed);
                if current == tail {
                    return Err(ClaimError::Full);
                }
                tail = current;
            } else {
                // Another producer claimed this position already; catch up.
                crate::sync::spin_loop();
                tail = self.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// Writes `values` into the claimed positions in order and publishes each one.
    ///
    /// # Panics
    /// If `values` yields fewer items than the claim holds (a broken internal invariant: the
    /// consumer would wait forever on the unfilled position). The crate's callers pass vectors'
    /// iterators and single envelopes, which neither fall short nor panic; `Drop` skips
    /// positions left unwritten all the same.
    pub(crate) fn fill(&self, claim: Claim, values: impl IntoIterator<Item = T>) {
        let mut values = values.into_iter();
        for position in claim.start..claim.start + claim.len {
            let value = values.next().expect("claim filled with fewer values than claimed");
            let slot = self.slot(position);
            debug_assert_eq!(slot.stamp.load(Ordering::Relaxed), position);
            slot.value.with_mut(|cell| {
                // SAFETY: this producer won the compare-exchange for `position`, and the slot's
                // stamp equals `position` (checked in `claim` through the claim's last slot,
                // which implies every earlier one), so the consumer has moved the previous
                // value out and nobody else touches the cell until we publish `position + 1`.
                unsafe { (*cell).write(value) };
            });
            slot.stamp.store(position + 1, Ordering::Release);
        }
    }

    /// Consumer only: moves up to `max` ready messages to `handle`, in order. Returns how many.
    ///
    /// Stops early at a position that is claimed but not yet filled.
    pub(crate) fn pop_batch(&self, max: usize, handle: &mut impl Consume<T>) -> usize {
        let start = self.head.load(Ordering::Relaxed);
        let mut run = FilledRun { ring: self, head: start, left: max };
        handle.consume_run(&mut run);
        run.head - start
    }

    /// Consumer only: whether no position has been claimed beyond what was consumed.
    ///
    /// SeqCst load: pairs with the SeqCst claim in the park protocol.
    pub(crate) fn is_empty_for_consumer(&self) -> bool {
        let tail = self.tail.load(Ordering::SeqCst) & !CLOSED_BIT;
        tail == self.head.load(Ordering::Relaxed)
    }

    /// Consumer only: closed, and every message ever claimed has been consumed.
    pub(crate) fn is_drained(&self) -> bool {
        let tail = self.tail.load(Ordering::SeqCst);
        tail & CLOSED_BIT != 0 && tail & !CLOSED_BIT == self.head.load(Ordering::Relaxed)
    }
}

/// The consumer's view of the filled positions from its head: at most `left` more, each read
/// once and handed back as the iterator yields it. It ends at the first position claimed but not
/// yet filled, and stays ended.
struct FilledRun<'a, T> {
    ring: &'a Ring<T>,
    head: usize,
    left: usize,
}

impl<T> FilledRun<'_, T> {
    /// Whether the slot at `head` is filled (and the run not ended): its stamp, acquired. A run
    /// that meets an unfilled slot ends for good.
    #[inline(always)]
    fn head_is_filled(&mut self) -> bool {
        if self.left > 0 && self.ring.slot(self.head).stamp.load(Ordering::Acquire) == self.head + 1
        {
            return true;
        }
        self.left = 0;
        false
    }

    /// Takes the value at `head`, which the caller found filled.
    #[inline(always)]
    fn take(&mut self) -> T {
        let ring = self.ring;
        let slot = ring.slot(self.head);
        let value = slot.value.with(|cell| {
            // SAFETY: stamp `head + 1` (acquired by `head_is_filled`) means the producer of
            // `head` has written the value and released it; only this consumer reads position
            // `head`, and it reads it once before handing the slot back below.
            unsafe { cell.cast::<T>().read() }
        });
        slot.stamp.store(self.head + ring.capacity(), Ordering::Release);
        self.head += 1;
        self.left -= 1;
        // Published per message (a plain store to a consumer-owned line) so that `len` stays
        // exact while a long handler runs.
        ring.head.store(self.head, Ordering::Release);
        value
    }

    /// Whether `wanted` holds for the value at `head`, which the caller found filled, looked at
    /// in place.
    #[inline(always)]
    fn look(&self, wanted: impl FnOnce(&T) -> bool) -> bool {
        self.ring.slot(self.head).value.with(|cell| {
            // SAFETY: as in `take`, the value is written and released, and only this consumer
            // accesses it until it hands the slot back; looking at it through a shared
            // reference moves nothing.
            wanted(unsafe { &*cell.cast::<T>() })
        })
    }
}

impl<T> Iterator for FilledRun<'_, T> {
    type Item = T;

    #[inline(always)]
    fn next(&mut self) -> Option<T> {
        self.head_is_filled().then(|| self.take())
    }
}

impl<T> Run<T> for FilledRun<'_, T> {
    #[inline(always)]
    fn next_is(&mut self, wanted: impl FnOnce(&T) -> bool) -> bool {
        self.head_is_filled() && self.look(wanted)
    }

    #[inline(always)]
    fn next_if(&mut self, wanted: impl FnOnce(&T) -> bool) -> Option<T> {
        (self.head_is_filled() && self.look(wanted)).then(|| self.take())
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // `&mut self`: no producer or consumer is running. Positions head..tail were claimed;
        // each holds a value if its stamp says it was written (a claim is filled before `fill`
        // returns, unless its iterator panicked: the crate's callers pass iterators that
        // cannot, but an unwritten slot must not be dropped even then).
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Relaxed) & !CLOSED_BIT;
        for position in head..tail {
            let slot = &self.slots[position & self.mask];
            if slot.stamp.load(Ordering::Relaxed) != position.wrapping_add(1) {
                continue;
            }
            slot.value.with_mut(|cell| {
                // SAFETY: the stamp says the value at `position` was written and not consumed,
                // and exclusive access (`&mut self`) rules out any concurrent reader.
                unsafe { std::ptr::drop_in_place(cell.cast::<T>()) };
            });
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::test_bounds::{bound, join_within};
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn push_pop_in_order_and_full_hands_message_back() {
        let ring = Ring::with_capacity(4);
        for value in 0..4 {
            ring.push(value).unwrap();
        }
        assert_eq!(ring.push(99), Err(PushError::Full(99)));
        let mut seen = Vec::new();
        assert_eq!(ring.pop_batch(10, &mut |value| seen.push(value)), 4);
        assert_eq!(seen, vec![0, 1, 2, 3]);
        assert!(ring.is_empty_for_consumer());
    }

    #[test]
    fn batch_claim_needs_room_for_all_and_wraps() {
        let ring = Ring::with_capacity(8);
        let claim = ring.claim(5).unwrap();
        ring.fill(claim, 0..5);
        assert_eq!(ring.claim(4).unwrap_err(), ClaimError::Full);
        let mut seen = Vec::new();
        ring.pop_batch(3, &mut |value| seen.push(value));
        let claim = ring.claim(6).unwrap();
        assert_eq!(claim.len(), 6);
        ring.fill(claim, 5..11);
        ring.pop_batch(usize::MAX, &mut |value| seen.push(value));
        assert_eq!(seen, (0..11).collect::<Vec<_>>());
    }

    #[test]
    fn close_refuses_new_claims_but_keeps_queued_messages() {
        let ring = Ring::with_capacity(4);
        ring.push(1).unwrap();
        assert!(ring.close());
        assert!(!ring.close(), "closing twice reports already closed");
        assert_eq!(ring.push(2), Err(PushError::Closed(2)));
        assert!(!ring.is_drained());
        let mut seen = Vec::new();
        ring.pop_batch(10, &mut |value| seen.push(value));
        assert_eq!(seen, vec![1]);
        assert!(ring.is_drained());
    }

    #[test]
    fn drop_releases_unconsumed_messages() {
        let marker = Arc::new(());
        let ring = Ring::with_capacity(4);
        ring.push(Arc::clone(&marker)).unwrap();
        ring.push(Arc::clone(&marker)).unwrap();
        ring.pop_batch(1, &mut drop);
        assert_eq!(Arc::strong_count(&marker), 2);
        drop(ring);
        assert_eq!(Arc::strong_count(&marker), 1);
    }

    #[test]
    fn concurrent_producers_lose_and_duplicate_nothing() {
        const PRODUCERS: usize = 3;
        let per_producer: usize = if cfg!(miri) { 200 } else { 100_000 };
        let ring = Arc::new(Ring::with_capacity(64));
        // Every wait below is bounded: a lost slot or a stuck stamp fails the test, not CI.
        let deadline = Instant::now() + bound(30);
        let handles: Vec<_> = (0..PRODUCERS)
            .map(|producer| {
                let ring = Arc::clone(&ring);
                std::thread::spawn(move || {
                    for sequence in 0..per_producer {
                        let mut value = (producer, sequence);
                        loop {
                            match ring.push(value) {
                                Ok(()) => break,
                                Err(PushError::Full(back)) => {
                                    assert!(
                                        Instant::now() < deadline,
                                        "producer {producer}: ring still full at message \
                                         {sequence} of {per_producer} after the deadline"
                                    );
                                    value = back;
                                    std::thread::yield_now();
                                }
                                Err(PushError::Closed(_)) => unreachable!("never closed"),
                            }
                        }
                    }
                })
            })
            .collect();
        let mut next_expected = [0usize; PRODUCERS];
        let mut received = 0;
        while received < PRODUCERS * per_producer {
            assert!(
                Instant::now() < deadline,
                "consumer: received {received} of {} messages by the deadline \
                 (per producer: {next_expected:?})",
                PRODUCERS * per_producer
            );
            let popped = ring.pop_batch(64, &mut |(producer, sequence)| {
                assert_eq!(sequence, next_expected[producer], "per-producer FIFO");
                next_expected[producer] += 1;
            });
            received += popped;
            if popped == 0 {
                std::thread::yield_now();
            }
        }
        for (producer, handle) in handles.into_iter().enumerate() {
            join_within(handle, bound(10), &format!("producer {producer}"));
        }
        assert_eq!(next_expected, [per_producer; PRODUCERS]);
        assert!(ring.is_empty_for_consumer());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::{sync::Arc, thread};

    /// Two producers (one pushing a batch) and the consumer: every message arrives once, each
    /// producer's messages in order, and a full ring hands the message back.
    #[test]
    fn loom_publish_consume() {
        loom::model(|| {
            let ring = Arc::new(Ring::with_capacity(2));
            let single = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || ring.push(10u32).is_ok())
            };
            let batch = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || match ring.claim(2) {
                    Ok(claim) => {
                        ring.fill(claim, [20u32, 21]);
                        2
                    }
                    Err(_) => 0,
                })
            };
            let mut seen = Vec::new();
            for _ in 0..3 {
                ring.pop_batch(2, &mut |value| seen.push(value));
                thread::yield_now();
            }
            let single_ok = single.join().unwrap();
            let batch_len = batch.join().unwrap();
            ring.pop_batch(4, &mut |value| seen.push(value));
            let expected_len = usize::from(single_ok) + batch_len;
            assert_eq!(seen.len(), expected_len);
            if batch_len == 2 {
                let position = seen.iter().position(|&value| value == 20).unwrap();
                assert_eq!(seen[position + 1], 21);
            }
        });
    }

    /// Close racing a push: either the push fails with Closed, or its message is consumed
    /// before the consumer sees the ring drained.
    #[test]
    fn loom_close_drains_exactly_what_was_claimed() {
        loom::model(|| {
            let ring = Arc::new(Ring::with_capacity(2));
            let producer = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || ring.push(1u32).is_ok())
            };
            ring.close();
            let mut seen = 0;
            while !ring.is_drained() {
                seen += ring.pop_batch(2, &mut |_| ());
                thread::yield_now();
            }
            let pushed = producer.join().unwrap();
            assert_eq!(seen, usize::from(pushed));
        });
    }
}
