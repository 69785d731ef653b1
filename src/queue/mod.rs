//! The data plane: a bounded, lock-free inbox with one consumer.
//!
//! Parts:
//! * `lane`: a bounded SPSC lane owned by one producer thread (plain stores, cached indices,
//!   a `busy` flag for closing), and the table of an inbox's lanes, allocated on first use.
//! * `ring`: one bounded MPSC ring (Vyukov stamps, batch claims, a closed mark in the tail),
//!   shared by the producers that have no lane.
//! * `barrier`: the asymmetric barrier (compiler fence for producers, `membarrier` for the
//!   consumer's rare park and close decisions) that lets a lane push use no locked instruction.
//! * `producer`: a small per-thread index, recycled when the thread ends.
//! * `wake`: parking and waking of the consumer (doorbell) and of producers blocked on a full
//!   inbox, without lost wake-ups.
//! * [`ShardedQueue`] (here): the lanes and the shared rings behind one consumer. A producer
//!   thread with index `i` below the lane count always pushes into lane `i`; any other thread
//!   always pushes into shared ring `i % shards`. Either way all of one thread's messages,
//!   one-way and request-reply alike, travel through one FIFO: per-sender order (SPEC A.4)
//!   holds by construction.
//!
//! Why lanes: with several producers on one MPSC ring each push needs a compare-exchange, a
//! locked instruction that drains the store buffer and so waits for the cache-line transfer of
//! the previous slot write. A lane has one producer, so a push is a slot write and a release
//! store; only the consumer pays for the ordering, and only when it parks or closes.
//!
//! Invariants: messages of one producer thread are consumed in the order they were pushed;
//! every message that was accepted is consumed exactly once, also after `close` (the consumer
//! drains until every lane and ring is drained); after `close` no push succeeds. The send path
//! takes no lock.
//!
//! What it does not do: dispatch, threads, timeouts on the consumer side. Those live in
//! `runtime`. This module imports nothing else from the crate except the `sync` shim.

mod barrier;
mod lane;
mod producer;
mod ring;
#[cfg(all(test, not(loom)))]
mod test_bounds;
mod wake;

use std::{
    marker::PhantomData,
    time::{Duration, Instant},
};

use crossbeam_utils::{Backoff, CachePadded};

pub use self::barrier::BarrierMode;
pub(crate) use self::ring::{ClaimError, PushError};
use self::{
    lane::{Lane, LanePushError, LaneTable},
    producer::producer_index,
    ring::Ring,
    wake::{Doorbell, ProducerWaiters},
};
use crate::sync::{AtomicBool, AtomicUsize, Ordering};

/// Why a push failed; the message (or the messages not taken) is handed back.
#[derive(Debug, PartialEq, Eq)]
pub enum QueueError<T> {
    /// The inbox is full: from non-blocking pushes, and from a blocking push by the queue's
    /// own consumer (which alone could make room).
    Full(T),
    /// The inbox is closed for good.
    Closed(T),
    /// The inbox stayed full until the deadline.
    Timeout(T),
}

/// Lane places of an inbox unless told otherwise: producers with a lower index get a lane.
pub const DEFAULT_LANES: usize = 16;

/// Most lane places an inbox can have (the number of recycled producer indices).
pub const MAX_LANES: usize = producer::RECYCLED_INDICES;

/// Most slots of one shared ring or lane (`capacity_per_shard`, before rounding up to a power
/// of two).
pub const MAX_CAPACITY: usize = 1 << 24;

/// Most shared rings of one inbox (`shard_count`, before rounding up to a power of two).
pub const MAX_SHARDS: usize = 1024;

/// Most slots of one queue in all, its rings' and its lanes' (as rounded up, [`total_slots`]).
/// Each setting alone may be in range and their product not: 1024 shards of 2^24 slots would
/// abort the process on allocation.
pub const MAX_TOTAL_SLOTS: u64 = 1 << 27;

/// Most bytes the slots of one queue may take ([`total_slots`] x [`slot_bytes`]): 2^27 slots of
/// a 1 KiB message would be 128 GiB.
pub const MAX_TOTAL_BYTES: u64 = 8 << 30;

/// Slots of a queue of `shard_count` rings and `lane_count` lanes of `capacity_per_shard` slots
/// each, as the queue rounds them (counts and capacity up to powers of two). The rings are
/// allocated up front, the lanes on first use.
pub fn total_slots(lane_count: usize, shard_count: usize, capacity_per_shard: usize) -> u64 {
    let rings = shard_count.max(1).next_power_of_two() as u64;
    (rings + lane_count as u64).saturating_mul(capacity_per_shard.max(2).next_power_of_two() as u64)
}

/// Bytes of one slot holding a `T`: its stamp and the value, with the padding `T`'s alignment
/// adds.
pub fn slot_bytes<T>() -> u64 {
    ring::slot_size::<T>() as u64
}

/// A [`ShardedQueue`] asked for more than it can be: the setting and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueConfigError {
    /// `capacity_per_shard` above [`MAX_CAPACITY`].
    #[error("capacity_per_shard {value} exceeds the largest ring or lane, {MAX_CAPACITY} slots")]
    Capacity {
        /// The capacity asked for.
        value: usize,
    },
    /// `shard_count` above [`MAX_SHARDS`].
    #[error("shard_count {value} exceeds the most shared rings, {MAX_SHARDS}")]
    Shards {
        /// The shard count asked for.
        value: usize,
    },
    /// `lane_count` above [`MAX_LANES`].
    #[error("lane_count {value} exceeds the most lane places, {MAX_LANES}")]
    Lanes {
        /// The lane count asked for.
        value: usize,
    },
    /// The settings together ask for more than [`MAX_TOTAL_SLOTS`] slots or
    /// [`MAX_TOTAL_BYTES`] bytes.
    #[error(
        "{lanes} lanes and {shards} shards of {capacity} slots make {slots} slots of \
         {slot_bytes} bytes, more than a queue's {MAX_TOTAL_SLOTS} slots or {MAX_TOTAL_BYTES} \
         bytes"
    )]
    TooLarge {
        /// The lane count asked for.
        lanes: usize,
        /// The shard count asked for.
        shards: usize,
        /// The capacity per shard or lane asked for.
        capacity: usize,
        /// The slots that makes, as rounded ([`total_slots`]).
        slots: u64,
        /// Bytes of one slot ([`slot_bytes`]).
        slot_bytes: u64,
    },
}

/// Where the calling thread's messages go.
enum Target<'a, T> {
    Lane(&'a Lane<T>),
    Shard(&'a Ring<T>),
}

/// Read-mostly state every push reads: one cache line, written only by `close`.
#[derive(Debug, Default)]
struct CloseState {
    /// Set first by `close`: pushes that see it refuse.
    closed: AtomicBool,
    /// Set by `close` after the heavy barrier: from then on a lane that is not busy and empty
    /// will stay empty.
    fenced: AtomicBool,
}

/// A bounded inbox drained by one consumer thread: single-producer lanes for the first
/// producer threads, shared MPSC rings for the others.
///
/// Producers may be any threads. The consuming side is a [`Consumer`], handed out once, that
/// stays on the thread that took it.
pub struct ShardedQueue<T> {
    lanes: LaneTable<T>,
    shards: Box<[Ring<T>]>,
    close_state: CachePadded<CloseState>,
    barrier: BarrierMode,
    doorbell: Doorbell,
    blocked_producers: ProducerWaiters,
    /// High-water mark of one lane's or shard's depth, sampled by the consumer per batch.
    depth_high_water: AtomicUsize,
    /// Set once the [`Consumer`] was handed out.
    consumer_taken: AtomicBool,
}

impl<T> std::fmt::Debug for ShardedQueue<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ShardedQueue")
            .field("lanes", &self.lanes.count())
            .field("shards", &self.shards.len())
            .field("capacity_per_shard", &self.shards[0].capacity())
            .field("len", &self.len())
            .field("closed", &self.is_closed())
            .field("barrier", &self.barrier)
            .finish()
    }
}

impl<T> ShardedQueue<T> {
    /// [`DEFAULT_LANES`] lanes and `shard_count` shared rings, each of `capacity_per_shard`
    /// slots (counts and capacity rounded up to powers of two; at least 1 ring of 2 slots).
    /// Lanes are allocated on their owner's first push.
    ///
    /// # Errors
    /// [`QueueConfigError`] for a shard count above [`MAX_SHARDS`], a capacity above
    /// [`MAX_CAPACITY`], or settings that together take more than [`MAX_TOTAL_SLOTS`] slots or
    /// [`MAX_TOTAL_BYTES`] bytes.
    pub fn new(shard_count: usize, capacity_per_shard: usize) -> Result<Self, QueueConfigError> {
        Self::with_lanes(DEFAULT_LANES, shard_count, capacity_per_shard)
    }

    /// Like [`ShardedQueue::new`] with `lane_count` lane places (0: every producer uses the
    /// shared rings).
    ///
    /// # Errors
    /// As [`ShardedQueue::new`], and [`QueueConfigError::Lanes`] above [`MAX_LANES`].
    pub fn with_lanes(
        lane_count: usize,
        shard_count: usize,
        capacity_per_shard: usize,
    ) -> Result<Self, QueueConfigError> {
        Self::with_barrier(BarrierMode::detect(), lane_count, shard_count, capacity_per_shard)
    }

    /// Like [`ShardedQueue::with_lanes`] with the barrier mode chosen by the caller (tests run
    /// the fenced fallback this way).
    pub(crate) fn with_barrier(
        barrier: BarrierMode,
        lane_count: usize,
        shard_count: usize,
        capacity_per_shard: usize,
    ) -> Result<Self, QueueConfigError> {
        // The limits keep the rounding up to a power of two (and each ring's index mask) from
        // overflowing.
        if capacity_per_shard > MAX_CAPACITY {
            return Err(QueueConfigError::Capacity { value: capacity_per_shard });
        }
        if shard_count > MAX_SHARDS {
            return Err(QueueConfigError::Shards { value: shard_count });
        }
        if lane_count > MAX_LANES {
            return Err(QueueConfigError::Lanes { value: lane_count });
        }
        let slots = total_slots(lane_count, shard_count, capacity_per_shard);
        let slot_bytes = slot_bytes::<T>();
        if slots > MAX_TOTAL_SLOTS || slots.saturating_mul(slot_bytes) > MAX_TOTAL_BYTES {
            return Err(QueueConfigError::TooLarge {
                lanes: lane_count,
                shards: shard_count,
                capacity: capacity_per_shard,
                slots,
                slot_bytes,
            });
        }
        let shard_count = shard_count.max(1).next_power_of_two();
        Ok(Self {
            lanes: LaneTable::new(lane_count, capacity_per_shard),
            shards: (0..shard_count).map(|_| Ring::with_capacity(capacity_per_shard)).collect(),
            close_state: CachePadded::default(),
            barrier,
            doorbell: Doorbell::new(barrier),
            blocked_producers: ProducerWaiters::default(),
            depth_high_water: AtomicUsize::new(0),
            consumer_taken: AtomicBool::new(false),
        })
    }

    /// Number of shared rings.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Number of lane places.
    pub fn lane_count(&self) -> usize {
        self.lanes.count()
    }

    /// Slots per shard and per lane.
    pub fn capacity_per_shard(&self) -> usize {
        self.shards[0].capacity()
    }

    /// How producers and the consumer order their wake-up and close decisions.
    pub fn barrier_mode(&self) -> BarrierMode {
        self.barrier
    }

    /// Messages queued and not yet consumed, over all lanes and rings (approximate while
    /// running).
    pub fn len(&self) -> usize {
        self.lanes.allocated().map(Lane::len).sum::<usize>()
            + self.shards.iter().map(Ring::len).sum::<usize>()
    }

    /// Whether nothing is queued (approximate while running).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The largest depth of one lane or ring seen by the consumer.
    pub fn depth_high_water(&self) -> usize {
        self.depth_high_water.load(Ordering::Relaxed)
    }

    /// Whether the queue was closed (a read-mostly flag, cheap to poll).
    pub fn is_closed(&self) -> bool {
        self.close_state.closed.load(Ordering::Acquire)
    }

    /// The calling thread's lane or ring.
    #[inline(always)]
    fn target(&self) -> Target<'_, T> {
        let index = producer_index();
        match self.own_lane(index) {
            Some(lane) => Target::Lane(lane),
            // No lane place, or closed before this thread's lane existed: the (closed) ring
            // answers.
            None => Target::Shard(self.shared_ring(index)),
        }
    }

    /// The lane of the producer with `index`, allocated on first use; `None` if `index` has no
    /// lane place, if the queue is closed and the lane was never allocated (no memory for a
    /// lane that could never take a message), or while the calling thread is inside a push
    /// of its own to it: then only caller code that a batch runs
    /// ([`ShardedQueue::push_iter_from`]) can push, and it must not write the batch's slots.
    #[inline(always)]
    fn own_lane(&self, index: usize) -> Option<&Lane<T>> {
        if index >= self.lanes.count() {
            return None;
        }
        self.lanes
            .get(index)
            .or_else(|| (!self.is_closed()).then(|| self.lanes.allocate(index)))
            .filter(|lane| {
                let busy = lane.in_own_push();
                // Only a caller's iterator runs inside a push: a lane left busy otherwise (a
                // push that unwound without lowering it) would reroute this thread for good.
                debug_assert!(!busy || in_caller_iterator(), "a lane left busy by its owner");
                !busy
            })
    }

    #[inline(always)]
    fn shared_ring(&self, producer_index: usize) -> &Ring<T> {
        &self.shards[producer_index & (self.shards.len() - 1)]
    }

    /// Pushes without waiting.
    ///
    /// # Errors
    /// `Full` if the caller's lane or ring has no free slot, `Closed` after
    /// [`ShardedQueue::close`].
    #[inline(always)]
    pub fn try_push(&self, value: T) -> Result<(), QueueError<T>> {
        self.try_push_with(|| value)
    }

    /// [`try_push`](Self::try_push) of the value `make` builds, built where it is stored (see
    /// `Lane::push_with`). `make` must be a plain constructor (no caller code, no panic): it
    /// runs inside the lane's push.
    #[inline(always)]
    pub(crate) fn try_push_with(&self, make: impl FnOnce() -> T) -> Result<(), QueueError<T>> {
        let index = producer_index();
        let Some(lane) = self.own_lane(index) else {
            return self.try_push_shared(index, make());
        };
        match lane.push_with(make, &self.close_state.closed, self.barrier) {
            Ok(()) => {
                self.doorbell.ring();
                Ok(())
            }
            Err(LanePushError::Full(value)) => Err(QueueError::Full(value)),
            Err(LanePushError::Closed(value)) => Err(QueueError::Closed(value)),
        }
    }

    /// `try_push` for a thread without a lane.
    fn try_push_shared(&self, index: usize, value: T) -> Result<(), QueueError<T>> {
        match self.shared_ring(index).push(value) {
            Ok(()) => {
                self.doorbell.ring_after_sequentially_consistent_claim();
                Ok(())
            }
            Err(PushError::Full(value)) => Err(QueueError::Full(value)),
            Err(PushError::Closed(value)) => Err(QueueError::Closed(value)),
        }
    }

    /// Pushes, waiting for room while the caller's lane or ring is full: spinning briefly, then
    /// parked, until `deadline` (none: as long as it takes).
    ///
    /// # Errors
    /// `Closed` if the queue is or becomes closed, `Timeout` if the deadline passes first,
    /// `Full` at once when the consumer's own thread finds the queue full (only it could make
    /// room).
    #[inline(always)]
    pub fn push(&self, value: T, deadline: Option<Instant>) -> Result<(), QueueError<T>> {
        self.push_with(|| value, deadline)
    }

    /// [`push`](Self::push) of the value `make` builds, built where it is stored; `make` as
    /// for [`try_push_with`](Self::try_push_with).
    #[inline(always)]
    pub(crate) fn push_with(
        &self,
        make: impl FnOnce() -> T,
        deadline: Option<Instant>,
    ) -> Result<(), QueueError<T>> {
        // `Ok` is matched on its own: merging it with the `Closed` arm lets the compiler copy
        // the whole outcome through the stack, and that wide reload of the narrow tag store
        // cannot be forwarded; it waits until the slot's stores (a cache-line miss) drain.
        match self.try_push_with(make) {
            Ok(()) => Ok(()),
            Err(QueueError::Full(value)) => self.push_slow(value, deadline),
            Err(refused) => Err(refused),
        }
    }

    #[cold]
    fn push_slow(&self, value: T, deadline: Option<Instant>) -> Result<(), QueueError<T>> {
        if self.doorbell.on_consumer_thread() {
            // The consumer pushing into its own full queue (a handler sending to its own
            // endpoint): only it could make room, so waiting would never end.
            return Err(QueueError::Full(value));
        }
        let target = self.target();
        let mut pending = Some(value);
        // Retries only once a batch of slots is free (or the queue closed): writing into the
        // slot the consumer has just freed would bounce that cache line between the two cores
        // for every message while the queue stays full.
        let attempt = |pending: &mut Option<T>| {
            if !self.has_room_to_resume(&target) && !self.is_closed() {
                return None;
            }
            match self.try_push(pending.take().expect("value present while waiting")) {
                Err(QueueError::Full(value)) => {
                    *pending = Some(value);
                    None
                }
                outcome => Some(outcome),
            }
        };
        let backoff = Backoff::new();
        while !backoff.is_completed() {
            if let Some(outcome) = attempt(&mut pending) {
                return outcome;
            }
            backoff.snooze();
        }
        self.blocked_producers.wait_until(|| {
            if let Some(outcome) = attempt(&mut pending) {
                Some(outcome)
            } else if deadline_passed(deadline) {
                Some(Err(QueueError::Timeout(pending.take().expect("value present"))))
            } else {
                None
            }
        })
    }

    /// Whether a producer that found its lane or ring full should try again. A lane: once an
    /// eighth of it (at most 64 slots) is free; its one consumer drains it to empty and wakes
    /// its producer after every productive round, so the wait is short. A shared ring: once any
    /// slot is free, as other producers may keep it nearly full and would starve a waiter that
    /// asked for more.
    fn has_room_to_resume(&self, target: &Target<'_, T>) -> bool {
        match target {
            Target::Lane(lane) => lane.has_room((self.capacity_per_shard() / 8).clamp(1, 64)),
            Target::Shard(shard) => shard.len() < shard.capacity(),
        }
    }

    /// Pushes all of `values` in order, publishing as many as fit with each store (lane) or
    /// compare-exchange (ring), waiting for room like [`push`] when full.
    ///
    /// # Errors
    /// `Closed`, `Timeout` or (on the consumer's own thread) `Full`, with the messages not
    /// pushed (those before them were).
    ///
    /// [`push`]: ShardedQueue::push
    pub fn push_batch(
        &self,
        values: Vec<T>,
        deadline: Option<Instant>,
    ) -> Result<(), QueueError<Vec<T>>> {
        self.push_batch_from(values.into_iter(), deadline)
    }

    /// [`push_batch`](ShardedQueue::push_batch) from an iterator that the queue drives inside
    /// a lane's critical section: it must neither panic nor push into this queue (a mapped
    /// `vec::IntoIter` with a constructor as the map, as the bus passes, does neither).
    pub(crate) fn push_batch_from(
        &self,
        rest: impl ExactSizeIterator<Item = T>,
        deadline: Option<Instant>,
    ) -> Result<(), QueueError<Vec<T>>> {
        self.push_batch_to(&self.target(), rest, deadline)
    }

    /// [`push_batch`](ShardedQueue::push_batch) of the values an iterator of caller code
    /// yields, each written straight into its slot as it is yielded (no vector in between).
    /// At most as many as its `len` said at the start: safe code may break `ExactSizeIterator`'s
    /// contract, so a shorter iterator ends the batch early, and values beyond that count stay
    /// in it.
    ///
    /// The iterator runs inside the lane's push (between raising `busy` and publishing,
    /// module `lane`). A push of its own into this queue finds the lane busy and goes to the
    /// thread's shared shard ([`ShardedQueue::own_lane`]): not ordered with the thread's other
    /// messages here, but not into the slots the batch is writing. Should it panic, what it
    /// yielded before is published and the consumer woken. A thread without a lane here
    /// collects the values first: a shared ring's claim must be filled whole (its consumer
    /// waits at an unfilled position).
    ///
    /// # Errors
    /// As [`push_batch`](ShardedQueue::push_batch).
    pub(crate) fn push_iter_from(
        &self,
        values: impl ExactSizeIterator<Item = T>,
        deadline: Option<Instant>,
    ) -> Result<(), QueueError<Vec<T>>> {
        let target = self.target();
        if let Target::Shard(_) = target {
            let values: Vec<T> = DeclaredLen::new(values).collect();
            return self.push_batch_to(&target, values.into_iter(), deadline);
        }
        let _wake = WakeOnUnwind(&self.doorbell);
        let _iterating = CallerIterator::enter();
        self.push_batch_to(&target, DeclaredLen::new(values), deadline)
    }

    /// [`push_batch_from`](ShardedQueue::push_batch_from) into `target`, the caller's lane or
    /// ring. `rest` may yield fewer values than its `len` ([`ShardedQueue::push_iter_from`]):
    /// the batch then ends with the last one.
    fn push_batch_to(
        &self,
        target: &Target<'_, T>,
        mut rest: impl ExactSizeIterator<Item = T>,
        deadline: Option<Instant>,
    ) -> Result<(), QueueError<Vec<T>>> {
        let backoff = Backoff::new();
        while rest.len() > 0 {
            let pushed = match target {
                Target::Lane(lane) => {
                    lane.push_batch(&mut rest, &self.close_state.closed, self.barrier)
                }
                Target::Shard(shard) => Self::push_batch_into_ring(shard, &mut rest),
            };
            match pushed {
                // Nothing taken and nothing left: an iterator shorter than it said.
                Ok(0) if rest.len() == 0 => {}
                Ok(0) => {
                    if self.doorbell.on_consumer_thread() {
                        // Full, and this thread is the one that would have to make room
                        // (see `push_slow`).
                        return Err(QueueError::Full(rest.collect()));
                    }
                    // Full: wait until a batch of slots is free (see `push_slow`).
                    while !self.has_room_to_resume(target) && !self.is_closed() {
                        if !backoff.is_completed() {
                            backoff.snooze();
                        } else if !self.wait_for_room(target, deadline) {
                            return Err(QueueError::Timeout(rest.collect()));
                        }
                    }
                }
                Ok(_) => {
                    self.doorbell.ring();
                    backoff.reset();
                }
                Err(()) => return Err(QueueError::Closed(rest.collect())),
            }
        }
        Ok(())
    }

    /// Claims as many ring slots as are free for the next values (halving the claim while the
    /// ring is too full) and fills them. `Ok(0)`: full; `Err(())`: closed.
    fn push_batch_into_ring(
        shard: &Ring<T>,
        rest: &mut impl ExactSizeIterator<Item = T>,
    ) -> Result<usize, ()> {
        let mut want = rest.len().min(shard.capacity());
        loop {
            match shard.claim(want) {
                Ok(claim) => {
                    let len = claim.len();
                    shard.fill(claim, rest.by_ref().take(len));
                    return Ok(len);
                }
                Err(ClaimError::Closed) => return Err(()),
                Err(ClaimError::Full) if want > 1 => want /= 2,
                Err(ClaimError::Full) => return Ok(0),
            }
        }
    }

    /// Parks (bounded) until the target has room to resume or is closed; `false` if the
    /// deadline passed.
    fn wait_for_room(&self, target: &Target<'_, T>, deadline: Option<Instant>) -> bool {
        self.blocked_producers.wait_until(|| {
            if self.has_room_to_resume(target) || self.is_closed() {
                Some(true)
            } else if deadline_passed(deadline) {
                Some(false)
            } else {
                None
            }
        })
    }

    /// Closes the queue: no push succeeds from now on; what is queued stays to be drained.
    /// Wakes the consumer and blocked producers. Returns `false` if it was already closed.
    pub fn close(&self) -> bool {
        for shard in self.shards.iter() {
            shard.close();
        }
        let first = !self.close_state.closed.swap(true, Ordering::SeqCst);
        // Pairs with every lane push's `busy` store and lane allocation (see `lane`): after
        // this, a lane seen idle and empty stays empty.
        self.barrier.heavy();
        self.close_state.fenced.store(true, Ordering::Release);
        self.doorbell.wake();
        self.blocked_producers.wake_all_if_any();
        first
    }

    /// The consuming side, bound to the calling thread (producers unpark it). Handed out once:
    /// `None` if it was taken before.
    pub fn consumer(&self) -> Option<Consumer<'_, T>> {
        if self.consumer_taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        self.doorbell.bind_consumer();
        Some(Consumer { queue: self, _bound_to_this_thread: PhantomData })
    }

    /// Consumer: raises the depth high-water mark (single writer, plain stores).
    #[inline]
    fn note_depth(&self, depth: usize) {
        if depth > self.depth_high_water.load(Ordering::Relaxed) {
            self.depth_high_water.store(depth, Ordering::Relaxed);
        }
    }
}

/// The one consumer of a [`ShardedQueue`]: neither `Send` nor `Sync` nor `Clone`, so its lanes
/// and rings are read by exactly one thread, and `&mut self` on the draining methods rules out
/// a handler draining the queue it is called from.
pub struct Consumer<'a, T> {
    queue: &'a ShardedQueue<T>,
    /// `*const ()` makes the type neither `Send` nor `Sync`.
    _bound_to_this_thread: PhantomData<*const ()>,
}

impl<T> std::fmt::Debug for Consumer<'_, T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Consumer").field("queue", self.queue).finish()
    }
}

impl<T> Consumer<'_, T> {
    /// Takes up to `max_per_shard` messages from every lane and ring in turn (fair: none can
    /// starve another). Returns how many were handled.
    ///
    /// If `handle` panics, the messages before it stay consumed, the panicking one counts as
    /// consumed, and the rest stay queued for the next round.
    pub fn drain_round(&mut self, max_per_shard: usize, mut handle: impl FnMut(T)) -> usize {
        self.drain_round_into(max_per_shard, &mut handle)
    }

    /// [`Consumer::drain_round`] with a [`Consume`] handler, for the endpoint loop: its
    /// `#[inline(always)]` `consume` is compiled into the pop loops, so the handler reads each
    /// message's fields straight from the copy the pop made (a closure's body is left out of
    /// line there, and re-copies the message through its own stack frame first).
    pub(crate) fn drain_round_into(
        &mut self,
        max_per_shard: usize,
        handle: &mut impl Consume<T>,
    ) -> usize {
        let queue = self.queue;
        // Wakes blocked producers also when a handler panics out of the round.
        let mut round = WakeProducersOnDrop { queue, taken: 0 };
        for lane in queue.lanes.allocated() {
            let taken = lane.pop_batch(max_per_shard, handle);
            if taken > 0 {
                queue.note_depth(taken + lane.len());
                round.taken += taken;
            }
        }
        for shard in queue.shards.iter() {
            // Depth is read only after a non-empty batch: reading a ring's tail on every idle
            // poll would pull the producers' hottest cache line to this core.
            let taken = shard.pop_batch(max_per_shard, handle);
            if taken > 0 {
                queue.note_depth(taken + shard.len());
                round.taken += taken;
            }
        }
        round.taken
    }

    /// Parks for at most `timeout`, unless something is (or becomes) queued or the queue is
    /// closed. Returns whether it parked: `false` when work was announced, which a drain
    /// round may still not be able to take (a ring slot claimed and not yet filled, or a
    /// close whose pushes are still in flight).
    pub fn park_until_work(&mut self, timeout: Duration) -> bool {
        let queue = self.queue;
        queue.doorbell.park_unless(timeout, || {
            queue.is_closed()
                || queue.lanes.allocated().any(|lane| !lane.is_empty_for_consumer())
                || queue.shards.iter().any(|shard| !shard.is_empty_for_consumer())
        })
    }

    /// Parks for at most `timeout` whatever is announced: for work [`Self::park_until_work`]
    /// announced that drain rounds could not take, whose producer may be waiting for this
    /// core. A producer that rings meanwhile ends it early.
    pub fn doze(&mut self, timeout: Duration) {
        self.queue.doorbell.doze(timeout);
    }

    /// Closed and every accepted message consumed.
    pub fn is_drained(&self) -> bool {
        let queue = self.queue;
        queue.close_state.fenced.load(Ordering::Acquire)
            && queue.lanes.allocated().all(Lane::is_drained)
            && queue.shards.iter().all(Ring::is_drained)
    }
}

/// What a drain round hands each message to. Every `FnMut(T)` is one; the endpoint loop
/// implements it on a struct, with `consume` inlined into the pop loops.
pub(crate) trait Consume<T> {
    /// Takes one message.
    fn consume(&mut self, value: T);

    /// Takes the messages `run` yields, in order, until it ends. Each is taken off the queue as
    /// it is yielded (a panic leaves the rest queued). The default hands each to
    /// [`Consume::consume`]; the endpoint loop hands runs of one-way messages to its endpoint.
    #[inline(always)]
    fn consume_run(&mut self, run: &mut impl Run<T>) {
        for value in run {
            self.consume(value);
        }
    }
}

/// The messages a drain round takes from one lane or ring, as its consumer sees them: `next`
/// takes the next one off the queue; the next one can also be looked at in place first.
pub(crate) trait Run<T>: Iterator<Item = T> {
    /// Whether there is a next message and `wanted` holds for it. Nothing is taken.
    fn next_is(&mut self, wanted: impl FnOnce(&T) -> bool) -> bool;

    /// The next message, taken off the queue only if `wanted` holds for it; otherwise `None`
    /// and it stays queued.
    #[inline(always)]
    fn next_if(&mut self, wanted: impl FnOnce(&T) -> bool) -> Option<T> {
        if self.next_is(wanted) {
            self.next()
        } else {
            None
        }
    }
}

impl<T, F: FnMut(T)> Consume<T> for F {
    #[inline]
    fn consume(&mut self, value: T) {
        self(value);
    }
}

/// Wakes producers blocked on a full inbox when a drain round that took messages ends, also by
/// unwinding.
struct WakeProducersOnDrop<'a, T> {
    queue: &'a ShardedQueue<T>,
    taken: usize,
}

impl<T> Drop for WakeProducersOnDrop<'_, T> {
    fn drop(&mut self) {
        if self.taken > 0 || std::thread::panicking() {
            self.queue.blocked_producers.wake_all_if_any();
        }
    }
}

thread_local! {
    /// How many batches of `push_iter_from` the thread is inside (checked in debug builds).
    static CALLER_ITERATORS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether the thread is inside a batch of [`ShardedQueue::push_iter_from`] (its iterator runs).
fn in_caller_iterator() -> bool {
    CALLER_ITERATORS.with(std::cell::Cell::get) > 0
}

/// Counts the thread inside a batch of [`ShardedQueue::push_iter_from`] while it lives.
struct CallerIterator(());

impl CallerIterator {
    fn enter() -> Self {
        CALLER_ITERATORS.with(|count| count.set(count.get() + 1));
        Self(())
    }
}

impl Drop for CallerIterator {
    fn drop(&mut self) {
        CALLER_ITERATORS.with(|count| count.set(count.get() - 1));
    }
}

/// Wakes the consumer when dropped by unwinding: a batch whose iterator panicked published
/// what it had written ([`ShardedQueue::push_iter_from`]) without ringing.
struct WakeOnUnwind<'a>(&'a Doorbell);

impl Drop for WakeOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.ring();
        }
    }
}

/// An iterator of caller code, cut to the length it declared when it was wrapped, and whose
/// `len` is always the most it may still yield. A lane claims slots by `len`; an
/// `ExactSizeIterator` of safe code may yield fewer values than its `len` says (or more), and
/// then this one ends early (or at the declared count).
struct DeclaredLen<I> {
    inner: I,
    left: usize,
}

impl<I: ExactSizeIterator> DeclaredLen<I> {
    fn new(inner: I) -> Self {
        let left = inner.len();
        Self { inner, left }
    }
}

/// Most values a [`DeclaredLen`] says it holds at least, for a collection to reserve room for:
/// the `len` it declares is caller code's word, and may be far beyond memory.
const DECLARED_LEN_RESERVE: usize = 4096;

impl<I: Iterator> Iterator for DeclaredLen<I> {
    type Item = I::Item;

    #[inline(always)]
    fn next(&mut self) -> Option<I::Item> {
        if self.left == 0 {
            return None;
        }
        let value = self.inner.next();
        // An early end ends this one too: no value is asked of it again.
        self.left = if value.is_some() { self.left - 1 } else { 0 };
        value
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left.min(DECLARED_LEN_RESERVE), Some(self.left))
    }
}

/// `len` is what a lane claims slots by; `size_hint` only caps what a `collect` reserves.
impl<I: Iterator> ExactSizeIterator for DeclaredLen<I> {
    fn len(&self) -> usize {
        self.left
    }
}

fn deadline_passed(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|deadline| Instant::now() >= deadline)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::lane::tests::BrokenBatch;
    use super::test_bounds::{bound, join_within};
    use super::*;
    use std::sync::Arc;

    /// Every test runs on each kind of inbox: lanes with the live barrier mode, lanes with the
    /// fenced fallback, and shared rings only. `MAX_LANES` places guarantee the test thread a
    /// lane whatever its index.
    fn each_kind<T>(shards: usize, capacity: usize) -> Vec<(&'static str, ShardedQueue<T>)> {
        vec![
            ("lanes", ShardedQueue::with_lanes(MAX_LANES, shards, capacity).unwrap()),
            (
                "fenced lanes",
                ShardedQueue::with_barrier(BarrierMode::Fenced, MAX_LANES, shards, capacity)
                    .unwrap(),
            ),
            ("rings", ShardedQueue::with_lanes(0, shards, capacity).unwrap()),
        ]
    }

    #[test]
    fn one_thread_uses_one_fifo_so_its_messages_stay_in_order() {
        for (kind, queue) in each_kind(4, 8) {
            for value in 0..8 {
                queue.try_push(value).unwrap();
            }
            assert!(matches!(queue.try_push(8), Err(QueueError::Full(8))), "{kind}");
            let mut seen = Vec::new();
            queue.consumer().unwrap().drain_round(100, |value| seen.push(value));
            assert_eq!(seen, (0..8).collect::<Vec<_>>(), "{kind}");
            assert!(queue.consumer().is_none(), "{kind}: one consumer only");
            assert_eq!(queue.depth_high_water(), 8, "{kind}");
        }
    }

    #[test]
    fn push_with_deadline_times_out_when_full() {
        for (kind, queue) in each_kind(1, 2) {
            queue.try_push(1).unwrap();
            queue.try_push(2).unwrap();
            let deadline = Instant::now() + Duration::from_millis(20);
            assert_eq!(queue.push(3, Some(deadline)), Err(QueueError::Timeout(3)), "{kind}");
            assert_eq!(
                queue.push_batch(vec![4, 5], Some(Instant::now())),
                Err(QueueError::Timeout(vec![4, 5])),
                "{kind}"
            );
        }
    }

    /// A thread that consumes `count` values from `queue` in small rounds and returns them;
    /// it fails if they have not all come by `deadline`.
    fn consume_in_thread<T: Send + Sync + 'static>(
        queue: &Arc<ShardedQueue<T>>,
        count: usize,
        deadline: Instant,
        kind: &'static str,
    ) -> std::thread::JoinHandle<Vec<T>> {
        let queue = Arc::clone(queue);
        std::thread::spawn(move || {
            let mut consumer = queue.consumer().unwrap();
            let mut seen = Vec::new();
            while seen.len() < count {
                assert!(
                    Instant::now() < deadline,
                    "{kind}: consumer received {} of {count} messages by the deadline",
                    seen.len()
                );
                if consumer.drain_round(7, |value| seen.push(value)) == 0 {
                    consumer.park_until_work(Duration::from_millis(5));
                }
            }
            seen
        })
    }

    #[test]
    fn batch_larger_than_capacity_flows_through_with_a_consumer() {
        for (kind, queue) in each_kind::<i32>(2, 16) {
            let queue = Arc::new(queue);
            // Every wait below is bounded: a stuck batch fails the test, not CI.
            let deadline = Instant::now() + bound(30);
            let consumer = consume_in_thread(&queue, 1000, deadline, kind);
            let pushed = queue.push_batch((0..1000).collect(), Some(deadline));
            // Joined first: if the consumer failed, its own message says how far it got.
            let seen = join_within(consumer, bound(40), kind);
            if let Err(error) = pushed {
                let left = match error {
                    QueueError::Full(rest)
                    | QueueError::Closed(rest)
                    | QueueError::Timeout(rest) => rest.len(),
                };
                panic!("{kind}: push_batch of 1000 failed with {left} messages not pushed");
            }
            assert_eq!(seen, (0..1000).collect::<Vec<_>>(), "{kind}");
        }
    }

    /// A broken `ExactSizeIterator` (module `lane`'s): says it holds `claimed` values and
    /// yields `0..yielded`.
    fn claiming(yielded: u32, claimed: usize) -> BrokenBatch {
        BrokenBatch { next: 0, yielded, claimed, panics: false }
    }

    /// Everything queued, drained by `consumer`.
    fn drain_all<T>(consumer: &mut Consumer<'_, T>) -> Vec<T> {
        let mut seen = Vec::new();
        while consumer.drain_round(usize::MAX, |value| seen.push(value)) > 0 {}
        seen
    }

    /// `push_iter_from` takes what the iterator yields, in order, up to the length it declared:
    /// all of an exact one (through a lane or ring smaller than the batch, with a consumer),
    /// what a shorter one yields, and as many as a longer one said (the rest stays in it).
    #[test]
    fn push_iter_takes_what_the_iterator_yields_up_to_its_len() {
        for (kind, queue) in each_kind::<u32>(2, 16) {
            let mut consumer = queue.consumer().unwrap();
            queue.push_iter_from(claiming(4, 10), None).unwrap();
            assert_eq!(drain_all(&mut consumer), [0, 1, 2, 3], "{kind}: shorter than it said");
            queue.push_iter_from(claiming(0, 5), None).unwrap();
            assert_eq!(drain_all(&mut consumer), [0u32; 0], "{kind}: yields nothing");
            let mut longer = claiming(10, 3);
            queue.push_iter_from(&mut longer, None).unwrap();
            assert_eq!(drain_all(&mut consumer), [0, 1, 2], "{kind}: longer than it said");
            assert_eq!(longer.next(), Some(3), "{kind}: the rest stays in the iterator");
            // A length beyond memory reserves no room for it.
            queue.push_iter_from(claiming(3, usize::MAX), None).unwrap();
            assert_eq!(drain_all(&mut consumer), [0, 1, 2], "{kind}: a len beyond memory");
            assert!(queue.close());
            match queue.push_iter_from(claiming(3, usize::MAX), None) {
                Err(QueueError::Closed(rest)) => assert_eq!(rest, [0, 1, 2], "{kind}: closed"),
                other => panic!("{kind}: expected Closed, got {other:?}"),
            }
        }
        for (kind, queue) in each_kind::<u32>(2, 16) {
            let queue = Arc::new(queue);
            let deadline = Instant::now() + bound(30);
            let consumer = consume_in_thread(&queue, 1000, deadline, kind);
            let pushed = queue.push_iter_from(claiming(1000, 1000), Some(deadline));
            let seen = join_within(consumer, bound(40), kind);
            assert!(pushed.is_ok(), "{kind}: the batch was refused");
            assert_eq!(seen, (0..1000).collect::<Vec<_>>(), "{kind}");
        }
    }

    /// A push into the same queue from inside the iterator goes around the batch (a lane's
    /// slots are being written by it): every value arrives once, the batch in its order.
    #[test]
    fn a_push_from_inside_the_iterator_arrives_beside_the_batch() {
        for (kind, queue) in each_kind::<i32>(2, 16) {
            let mut consumer = queue.consumer().unwrap();
            let values = (0..6).inspect(|&value| {
                if value == 2 {
                    queue.try_push(100).unwrap();
                }
            });
            queue.push_iter_from(values, None).unwrap();
            let seen = drain_all(&mut consumer);
            let batch: Vec<i32> = seen.iter().copied().filter(|&value| value < 100).collect();
            assert_eq!(batch, [0, 1, 2, 3, 4, 5], "{kind}: {seen:?}");
            assert_eq!(seen.iter().filter(|&&value| value == 100).count(), 1, "{kind}: {seen:?}");
            assert_eq!(seen.len(), 7, "{kind}: {seen:?}");
            // The thread has its lane back afterwards.
            let has_lane = queue.own_lane(producer_index()).is_some();
            assert_eq!(has_lane, kind != "rings", "{kind}");
            queue.try_push(7).unwrap();
            assert_eq!(drain_all(&mut consumer), [7], "{kind}");
        }
    }

    /// An iterator that panics: what it yielded before is published through a lane (none of
    /// it through a ring: the values are collected first), and the queue takes pushes again.
    /// (The wake-up of a parked consumer: the next test.)
    #[test]
    fn a_panicking_iterator_leaves_what_it_yielded_published() {
        for (kind, queue) in each_kind::<i32>(2, 16) {
            let mut consumer = queue.consumer().unwrap();
            let panicking = (0..5).map(|value| if value < 3 { value } else { panic!("injected") });
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                queue.push_iter_from(panicking, None)
            }));
            assert!(outcome.is_err(), "{kind}: the iterator's panic goes to the caller");
            let expected: &[i32] = if kind == "rings" { &[] } else { &[0, 1, 2] };
            assert_eq!(drain_all(&mut consumer), expected, "{kind}");
            queue.try_push(3).unwrap();
            assert_eq!(drain_all(&mut consumer), [3], "{kind}");
        }
    }

    /// An iterator that panics in a lane's batch: what it yielded before is published and the
    /// parked consumer woken (no later push rings for it); the lane takes pushes again.
    /// Not under Miri: it reads the consumer thread's state from `/proc`, which under Miri
    /// shows the interpreter's one thread.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_panicking_iterator_publishes_what_it_yielded_and_wakes_the_consumer() {
        for (kind, queue) in
            each_kind::<i32>(2, 16).into_iter().filter(|(kind, _)| *kind != "rings")
        {
            let queue = Arc::new(queue);
            let (tid_sender, tid) = std::sync::mpsc::channel();
            let consumer = {
                let queue = Arc::clone(&queue);
                std::thread::spawn(move || {
                    let mut consumer = queue.consumer().unwrap();
                    let thread = std::fs::read_link("/proc/thread-self").unwrap();
                    tid_sender.send(thread).unwrap();
                    let started = Instant::now();
                    let mut seen = Vec::new();
                    // Long parks: only the batch's wake-up ends the first one in time.
                    let parked = consumer.park_until_work(Duration::from_secs(120));
                    while seen.len() < 3 && started.elapsed() < Duration::from_secs(120) {
                        consumer.drain_round(usize::MAX, |value| seen.push(value));
                        if seen.len() < 3 {
                            consumer.park_until_work(Duration::from_secs(120));
                        }
                    }
                    (parked, started.elapsed(), seen)
                })
            };
            // Parked: asleep in the kernel, after its last look for work.
            // `/proc/thread-self` links to `<pid>/task/<tid>`, relative to `/proc`.
            let stat = std::path::Path::new("/proc").join(tid.recv().unwrap()).join("stat");
            let deadline = Instant::now() + bound(30);
            loop {
                let stat = std::fs::read_to_string(&stat).unwrap();
                let asleep = stat[stat.rfind(')').unwrap() + 2..].starts_with('S');
                if asleep && queue.doorbell.consumer_sleeping() {
                    break;
                }
                assert!(Instant::now() < deadline, "{kind}: the consumer never parked");
                std::thread::yield_now();
            }
            let panicking = (0..5).map(|value| if value < 3 { value } else { panic!("injected") });
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                queue.push_iter_from(panicking, None)
            }));
            assert!(outcome.is_err(), "{kind}: the iterator's panic goes to the caller");
            let (parked, woken_after, seen) = join_within(consumer, bound(60), kind);
            // Parked before the batch (it waited for `sleeping`), so the batch's ring woke it.
            assert!(parked, "{kind}: the consumer found work before it parked");
            assert!(woken_after < Duration::from_secs(60), "{kind}: not woken ({woken_after:?})");
            assert_eq!(seen, [0, 1, 2], "{kind}");
            assert!(queue.own_lane(producer_index()).is_some(), "{kind}: the lane is usable again");
            queue.try_push(3).unwrap();
        }
    }

    #[test]
    fn close_wakes_blocked_producer_with_closed() {
        for (kind, queue) in each_kind(1, 2) {
            let queue = Arc::new(queue);
            let producer = {
                let queue = Arc::clone(&queue);
                std::thread::spawn(move || {
                    queue.try_push(1).unwrap();
                    queue.try_push(2).unwrap();
                    queue.push(3, None)
                })
            };
            // The producer is about to block or blocked; closing must release it either way.
            let deadline = Instant::now() + bound(30);
            while queue.blocked_producers_registered() == 0 && !producer.is_finished() {
                assert!(
                    Instant::now() < deadline,
                    "{kind}: the producer neither blocked nor finished by the deadline"
                );
                std::thread::yield_now();
            }
            assert!(queue.close());
            assert!(!queue.close(), "second close reports already closed");
            let pushed = join_within(
                producer,
                bound(10),
                &format!("{kind}: producer blocked in push after close"),
            );
            assert_eq!(pushed, Err(QueueError::Closed(3)), "{kind}");
            assert_eq!(queue.try_push(4), Err(QueueError::Closed(4)), "{kind}");
            let mut consumer = queue.consumer().unwrap();
            let mut seen = Vec::new();
            consumer.drain_round(10, |value| seen.push(value));
            assert_eq!(seen, vec![1, 2], "{kind}");
            assert!(consumer.is_drained(), "{kind}");
        }
    }

    /// Sizes whose rounding to a power of two would overflow (and leave a ring with no slots
    /// behind an all-ones index mask) are typed errors naming the setting and its value.
    #[test]
    fn oversized_settings_are_typed_errors_naming_the_value() {
        let cases = [
            ((0, 1, usize::MAX), QueueConfigError::Capacity { value: usize::MAX }),
            ((0, 1, MAX_CAPACITY + 1), QueueConfigError::Capacity { value: MAX_CAPACITY + 1 }),
            ((0, usize::MAX, 2), QueueConfigError::Shards { value: usize::MAX }),
            ((MAX_LANES + 1, 1, 2), QueueConfigError::Lanes { value: MAX_LANES + 1 }),
        ];
        for ((lanes, shards, capacity), expected) in cases {
            let error = ShardedQueue::<u32>::with_lanes(lanes, shards, capacity).unwrap_err();
            assert_eq!(error, expected);
            let text = error.to_string();
            let value = match expected {
                QueueConfigError::Capacity { value }
                | QueueConfigError::Shards { value }
                | QueueConfigError::Lanes { value } => value,
                QueueConfigError::TooLarge { .. } => unreachable!("not among the cases"),
            };
            assert!(text.contains(&value.to_string()), "{text}");
        }
        let queue = ShardedQueue::<u32>::with_lanes(MAX_LANES, MAX_SHARDS, 2).unwrap();
        assert_eq!(queue.shard_count(), MAX_SHARDS);
    }

    /// Settings each in range whose product is not (the most shards of the largest rings: 2^34
    /// slots, which would abort the process on allocation), or whose slots for a large `T` take
    /// too many bytes, are a typed error naming the settings and the slots, and allocate
    /// nothing.
    #[test]
    fn settings_too_large_together_are_a_typed_error() {
        let error = ShardedQueue::<u64>::new(MAX_SHARDS, MAX_CAPACITY).unwrap_err();
        assert_eq!(
            error,
            QueueConfigError::TooLarge {
                lanes: DEFAULT_LANES,
                shards: MAX_SHARDS,
                capacity: MAX_CAPACITY,
                slots: (MAX_SHARDS + DEFAULT_LANES) as u64 * MAX_CAPACITY as u64,
                slot_bytes: 16,
            }
        );
        assert!(error.to_string().contains(&format!("{MAX_SHARDS} shards")), "{error}");
        // 2^24 slots fit the count, not the bytes: 2^24 x 1032 bytes is over 8 GiB.
        let error = ShardedQueue::<[u8; 1024]>::with_lanes(0, 1, MAX_CAPACITY).unwrap_err();
        assert!(matches!(error, QueueConfigError::TooLarge { slot_bytes: 1032, .. }), "{error}");
    }

    #[test]
    fn push_after_close_allocates_no_lane() {
        let queue = ShardedQueue::<u32>::with_lanes(MAX_LANES, 1, 1 << 10).unwrap();
        queue.close();
        assert_eq!(queue.try_push(1), Err(QueueError::Closed(1)));
        assert_eq!(queue.push_batch(vec![2, 3], None), Err(QueueError::Closed(vec![2, 3])));
        assert_eq!(queue.lanes.allocated().count(), 0);
    }

    /// Producers keep pushing while the queue closes under them: every push that returned
    /// `Ok` is consumed exactly once, in per-producer order, and the consumer sees the queue
    /// drained only after that.
    #[test]
    fn close_during_pushes_loses_and_duplicates_nothing() {
        const PRODUCERS: usize = 3;
        for (kind, queue) in each_kind::<(usize, usize)>(2, 64) {
            let queue = Arc::new(queue);
            // Every wait below is bounded: a producer or consumer that never sees the close
            // fails the test, not CI.
            let deadline = Instant::now() + bound(30);
            let producers: Vec<_> = (0..PRODUCERS)
                .map(|producer| {
                    let queue = Arc::clone(&queue);
                    std::thread::spawn(move || {
                        let mut accepted = 0;
                        loop {
                            assert!(
                                Instant::now() < deadline,
                                "{kind}: producer {producer} still pushing at the deadline \
                                 ({accepted} accepted, never refused as closed)"
                            );
                            // The deadline only bounds the wait for room; before it the push
                            // waits exactly as with none.
                            match queue.push((producer, accepted), Some(deadline)) {
                                Ok(()) => accepted += 1,
                                Err(QueueError::Closed(_)) => return accepted,
                                Err(QueueError::Timeout(_)) => panic!(
                                    "{kind}: producer {producer} waited for room until the \
                                     deadline ({accepted} accepted)"
                                ),
                                Err(other) => panic!("unexpected {other:?}"),
                            }
                        }
                    })
                })
                .collect();
            let mut consumer = queue.consumer().unwrap();
            let mut next_expected = [0usize; PRODUCERS];
            let mut consume = |(producer, sequence): (usize, usize)| {
                assert_eq!(sequence, next_expected[producer], "{kind}: per-producer FIFO");
                next_expected[producer] += 1;
            };
            let mut consumed = 0;
            while consumed < 20_000 {
                assert!(
                    Instant::now() < deadline,
                    "{kind}: consumed {consumed} of 20000 messages before closing by the deadline"
                );
                let taken = consumer.drain_round(32, &mut consume);
                if taken == 0 {
                    consumer.park_until_work(Duration::from_millis(1));
                }
                consumed += taken;
            }
            queue.close();
            while !consumer.is_drained() {
                assert!(
                    Instant::now() < deadline,
                    "{kind}: not drained by the deadline after close ({consumed} consumed)"
                );
                consumed += consumer.drain_round(32, &mut consume);
            }
            let accepted: Vec<usize> = producers
                .into_iter()
                .enumerate()
                .map(|(producer, handle)| {
                    join_within(handle, bound(10), &format!("{kind}: producer {producer}"))
                })
                .collect();
            assert_eq!(next_expected.to_vec(), accepted, "{kind}: consumed == accepted");
        }
    }

    impl<T: Send> ShardedQueue<T> {
        fn blocked_producers_registered(&self) -> usize {
            self.blocked_producers.registered()
        }
    }

    /// Waits that end by their deadline while the consumer is stuck leave their registrations
    /// behind; a retry loop must not grow that list without bound.
    #[test]
    fn timed_out_pushes_against_a_stuck_consumer_leave_a_bounded_waiter_list() {
        for (kind, queue) in each_kind(1, 2) {
            queue.try_push(1).unwrap();
            queue.try_push(2).unwrap();
            // Fewer under Miri (slow), still far past the bound.
            let attempts = if cfg!(miri) { 200 } else { 10_000 };
            for value in 0..attempts {
                assert_eq!(
                    queue.push(value, Some(Instant::now())),
                    Err(QueueError::Timeout(value)),
                    "{kind}"
                );
            }
            let queued = queue.blocked_producers.queued();
            let bound = wake::STALE_WAITERS_MAX + 1;
            assert!(queued <= bound, "{kind}: {queued} registrations left behind");
            assert_eq!(queue.blocked_producers_registered(), 0, "{kind}");
        }
    }
}
