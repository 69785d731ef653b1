//! A bounded single-producer, single-consumer lane, and the table of lanes of one inbox.
//!
//! A lane belongs to one producer thread at a time (the holder of a producer index, see
//! `queue::producer`), so the producer needs no compare-exchange: it writes values and then
//! publishes them with a plain release store of a stamp. A push publishes a *run* of positions
//! `p..e` (one message, or a whole batch) by storing `e` into the stamp of the slot of `p`, the
//! run's first position, after writing every value of the run. The consumer polls the stamp of
//! the slot at its head `h`: a stamp above `h` is fresh and says that `h..stamp` is published;
//! it then reads those values without looking at another stamp, and polls again at the run's
//! end. So a message costs one cache line that travels with the value (polling a shared tail
//! index instead would drag the producer's index line back and forth once per message whenever
//! the consumer has caught up), and a batch costs one stamp store and one stamp load.
//!
//! Why a stale stamp never looks fresh: the slot of `h` last held position `h - capacity` (or
//! an earlier lap), and any stamp stored there then ended a run within that lap's capacity, so
//! at most at `h`. Slots inside a run keep their stale stamps, which are never read while the
//! run is known (the consumer keeps the end of the run it is reading, `published_end`).
//!
//! Why publish a batch at its first slot: a consumer that has caught up waits at the head, which
//! is that first slot, so it sees the whole batch at once and then reads lines the producer is
//! done with. Stamping each slot in order instead let the consumer follow one slot behind the
//! producer, taking every line back while the producer still had its second slot to write, so a
//! line crossed between the cores two or three times instead of once (`send_batch` 256: 92 ->
//! 105 M msgs/s with the cores on one socket). Storing only the run's stamp also saves the
//! producer a store per message, and the consumer a load and a compare.
//!
//! The consumer never writes slots: it publishes its head with a release store, and the
//! producer rereads that head only when its cached copy says the lane is full. The producer's
//! tail is published too (relaxed, on its own line) but read only for statistics and teardown.
//!
//! Closing. The producer cannot mark its tail closed (no read-modify-write on the hot path), so
//! a lane has a `busy` flag instead: a push raises it, then reads the inbox's `closed` flag, and
//! lowers it after publishing (or after refusing). The closer stores `closed`, then runs the
//! heavy barrier (see `queue::barrier`), and only then lets the consumer decide "drained". That
//! is the store-load pairing of the barrier module on (`busy`, `closed`): either the push sees
//! `closed` and refuses the message, or the consumer sees `busy` and waits until the push is
//! published. So every push that returned `Ok` is consumed, and none after that returned `Ok`.
//!
//! The algorithm is the cached-index SPSC ring of FastForward (Giacomoni et al., PPoPP 2008)
//! and Rigtorp's `SPSCQueue`, with the per-slot full marks of Vyukov's bounded queue.
//!
//! Ownership: exactly one thread at a time, and never re-entrantly, calls the producer methods
//! of a lane. That rests on two things outside this file: `queue::producer` never gives one
//! index to two live threads, and `ShardedQueue` hands lane `i` only to the holder of index `i`
//! (`ShardedQueue::target`, `try_push_with`). The producer methods never run caller code
//! between raising `busy` and publishing, except `push_batch`'s iterator and `push_with`'s
//! constructor. `push_with`'s callers (`ShardedQueue::try_push_with`) require a plain move or
//! enum constructor. `push_batch`'s iterator is a plain mapped vector
//! (`ShardedQueue::push_batch_from`) or caller code (`ShardedQueue::push_iter_from`). A push
//! that caller code makes into the same inbox finds this lane `busy` (`Lane::in_own_push`) and
//! goes to a shared shard instead (`ShardedQueue::own_lane`), and `push_batch` survives the
//! code panicking or yielding fewer values than its `len` said.
//!
//! Indices grow without wrapping (2^64 messages at one per nanosecond last 584 years).
//!
//! This file holds `unsafe` for the slot cells (written by the one producer, read by the one
//! consumer, ordered by the tail and head stores), for the lane table's lazily allocated lanes
//! (freed only when the table is dropped), and for the cache hints: the consumer's read
//! prefetch and a batch push's `PREFETCHW` (inline assembly, on CPUs that have it).
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use crossbeam_utils::CachePadded;

use super::{barrier::BarrierMode, Consume, Run};
use crate::sync::{AtomicBool, AtomicPtr, AtomicUsize, Ordering, UnsafeCell};

/// Why a lane push did not take the message; the message is handed back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum LanePushError<T> {
    /// No free slot right now.
    Full(T),
    /// The inbox was closed.
    Closed(T),
}

/// The producer's cache line.
#[derive(Debug, Default)]
struct ProducerSide {
    /// Next position to write (read by others only for statistics and teardown).
    tail: AtomicUsize,
    /// Raised while a push is between its check of `closed` and its publication.
    busy: AtomicBool,
    /// The consumer's head as last read by the producer (producer-only, relaxed).
    cached_head: AtomicUsize,
}

/// The consumer's cache line.
#[derive(Debug, Default)]
struct ConsumerSide {
    /// Next position to read; published with release after the value was moved out.
    head: AtomicUsize,
    /// End of the published run the consumer last saw a stamp of (`head <= published_end`;
    /// consumer-only, relaxed): positions below it need no stamp check.
    published_end: AtomicUsize,
}

/// How many positions ahead of its head the consumer asks the CPU to fetch: the lines were
/// last written by the producer's core, and fetching them early overlaps the transfers.
const PREFETCH_AHEAD: usize = 16;

/// How many positions ahead of its write a batch push asks the CPU for ownership of a slot's
/// (first) line. Only slots the batch already owns are asked for: a slot the consumer has yet
/// to read must keep its line. A line the asked-for slot shares with the consumer's next unread
/// slot (slots are not line-aligned) can still move early; that costs the consumer a transfer
/// the batch's own store would cause a moment later anyway.
const PREFETCH_WRITE_AHEAD: usize = 8;

/// Whether this CPU has `PREFETCHW` (CPUID leaf 8000_0001h, ECX bit 8, `PRFCHW`), read once.
/// Every AMD64 CPU since the first, and Intel's since Broadwell, have it.
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn has_prefetch_for_write() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        use std::arch::x86_64::__cpuid;
        __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
    })
}

#[cfg(not(all(target_arch = "x86_64", not(miri))))]
fn has_prefetch_for_write() -> bool {
    false
}

/// Asks the CPU for `slot`'s line in the exclusive state (`PREFETCHW`), so that the stores into
/// it do not each wait, in the store buffer, for the line to leave the consumer's core. Only
/// called when [`has_prefetch_for_write`].
#[inline(always)]
fn prefetch_for_write<T>(slot: &Slot<T>) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: the caller checked that the CPU has `PREFETCHW`. It is a hint: it never faults,
    // whatever the address, and changes no register, flag or memory contents (declared
    // `readonly`, the closest option for an access that is not architectural); the address is
    // a live slot's anyway.
    unsafe {
        std::arch::asm!(
            "prefetchw [{address}]",
            address = in(reg) std::ptr::from_ref(slot),
            options(nostack, preserves_flags, readonly)
        );
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = slot;
}

/// Hints the CPU to bring `slot`'s line into this core's cache.
#[inline(always)]
fn prefetch<T>(slot: &Slot<T>) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, part of every x86_64 CPU; a prefetch never faults,
    // whatever the address (it is only a hint), and the address is of a live slot anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            std::ptr::from_ref(slot).cast::<i8>(),
        );
    }
}

/// One cell of the lane and its stamp.
struct Slot<T> {
    /// When the slot's position `p` starts a published run `p..e`: `e` (stored with release
    /// after the run's values). Any value `<= p`: nothing published from `p` (module doc).
    stamp: AtomicUsize,
    /// Initialised exactly while `p` lies in a published run and `p >= head`, for the slot's
    /// current position `p` (the run's stamp is published before the producer's `tail` is).
    value: UnsafeCell<MaybeUninit<T>>,
}

/// A bounded SPSC lane. Producer methods (`push_with`, `push_batch`) must only be called by the
/// lane's current owner; consumer methods (`pop_batch`, `is_empty_for_consumer`, `is_drained`)
/// only by the inbox's consumer thread.
pub(crate) struct Lane<T> {
    producer: CachePadded<ProducerSide>,
    consumer: CachePadded<ConsumerSide>,
    /// `capacity` slots; `capacity` is a power of two. Slot `p & mask` holds position `p`.
    slots: Box<[Slot<T>]>,
    mask: usize,
}

// SAFETY: values of `T` move from the producing thread to the consuming thread through the
// cells. The owner thread (see "Ownership" in the module doc) writes a cell only while it is
// free (`position - head < capacity`) and publishes it with the stamp of its run; the one
// consumer reads it only after acquiring that stamp and frees it with its head store. So each
// cell has one accessor at a time and `T: Send` suffices for sharing the lane.
unsafe impl<T: Send> Send for Lane<T> {}
// SAFETY: as above; every shared mutation is an atomic or a cell guarded by its run's stamp and
// the head.
unsafe impl<T: Send> Sync for Lane<T> {}

impl<T> Lane<T> {
    /// A lane of `capacity` slots, rounded up to a power of two (at least 2).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        debug_assert!(capacity <= super::MAX_CAPACITY, "checked by `ShardedQueue`");
        let capacity = capacity.max(2).next_power_of_two();
        Self {
            producer: CachePadded::default(),
            consumer: CachePadded::default(),
            slots: (0..capacity)
                .map(|_| Slot {
                    stamp: AtomicUsize::new(0),
                    value: UnsafeCell::new(MaybeUninit::uninit()),
                })
                .collect(),
            mask: capacity - 1,
        }
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Messages published and not yet consumed (approximate while running).
    pub(crate) fn len(&self) -> usize {
        let head = self.consumer.head.load(Ordering::Acquire);
        self.producer.tail.load(Ordering::Acquire).saturating_sub(head)
    }

    #[inline(always)]
    fn slot(&self, position: usize) -> &Slot<T> {
        let index = position & self.mask;
        debug_assert!(index < self.slots.len());
        // SAFETY: `slots.len() == mask + 1` (set in `with_capacity`, never changed), so
        // `position & mask` is a valid index; this skips a bounds check per message.
        unsafe { self.slots.get_unchecked(index) }
    }

    /// Producer (owner only): whether the calling thread is inside a push of its own to this
    /// lane (`busy` raised: only the owner raises it, and lowers it before each push returns
    /// or unwinds).
    #[inline(always)]
    pub(crate) fn in_own_push(&self) -> bool {
        self.producer.busy.load(Ordering::Relaxed)
    }

    /// Producer: raises `busy` and checks `closed` (the pairing of the module doc).
    #[inline(always)]
    fn enter(&self, closed: &AtomicBool, barrier: BarrierMode) -> bool {
        debug_assert!(
            !self.producer.busy.load(Ordering::Relaxed),
            "lane entered re-entrantly or after an unwound push"
        );
        self.producer.busy.store(true, Ordering::Relaxed);
        barrier.light();
        if closed.load(Ordering::Relaxed) {
            self.producer.busy.store(false, Ordering::Release);
            return false;
        }
        true
    }

    /// Producer: free slots, rereading the consumer's head only when the cached copy does not
    /// show at least `wanted`.
    #[inline(always)]
    fn free_slots(&self, tail: usize, wanted: usize) -> usize {
        let capacity = self.capacity();
        let free = capacity - (tail - self.producer.cached_head.load(Ordering::Relaxed));
        if free >= wanted {
            return free;
        }
        let head = self.consumer.head.load(Ordering::Acquire);
        self.producer.cached_head.store(head, Ordering::Relaxed);
        capacity - (tail - head)
    }

    /// Producer (owner only): pushes one message, or hands it back. (The queue pushes with
    /// [`push_with`](Self::push_with).)
    #[cfg(test)]
    pub(crate) fn push(
        &self,
        value: T,
        closed: &AtomicBool,
        barrier: BarrierMode,
    ) -> Result<(), LanePushError<T>> {
        self.push_with(|| value, closed, barrier)
    }

    /// Pushes the message `make` builds, or hands it back. `make` runs exactly once on every
    /// path; on success it runs while `busy` is raised, so it must be a plain constructor that
    /// cannot panic (no caller code: see "Ownership" in the module doc).
    ///
    /// Why a constructor and not a value: built once the slot is known, the message is stored
    /// straight into the slot. A value built before the checks lives in memory, and copying it
    /// to the slot reloads its fields wider than they were stored; such a reload cannot be
    /// forwarded from the store buffer and waits until the previous message's slot stores (a
    /// cache-line transfer from the consumer's core) drain. Measured: a one-way send went from
    /// about 18 ns to about 12 ns per message here.
    #[inline(always)]
    pub(crate) fn push_with(
        &self,
        make: impl FnOnce() -> T,
        closed: &AtomicBool,
        barrier: BarrierMode,
    ) -> Result<(), LanePushError<T>> {
        if !self.enter(closed, barrier) {
            return Err(LanePushError::Closed(make()));
        }
        let tail = self.producer.tail.load(Ordering::Relaxed);
        if self.free_slots(tail, 1) == 0 {
            self.producer.busy.store(false, Ordering::Release);
            return Err(LanePushError::Full(make()));
        }
        self.write(tail, make());
        self.producer.tail.store(tail + 1, Ordering::Relaxed);
        self.producer.busy.store(false, Ordering::Release);
        Ok(())
    }

    /// Producer: writes the value of `position` and publishes it as a run of one.
    #[inline(always)]
    fn write(&self, position: usize, value: T) {
        self.write_unpublished(position, value);
        self.publish_run(position, position + 1);
    }

    /// Producer: writes the value of `position` without publishing it (see
    /// [`Self::publish_run`]).
    #[inline(always)]
    fn write_unpublished(&self, position: usize, value: T) {
        self.slot(position).value.with_mut(|cell| {
            // SAFETY: the caller checked `position - head < capacity`, so the consumer has moved
            // the previous value of this slot out (it published a head beyond it); only the
            // owner writes slots, and the consumer reads this one only after the stamp store of
            // a run that holds it.
            unsafe { (*cell).write(value) };
        });
    }

    /// Producer: publishes the values written at `start..end` (the consumer reads them once it
    /// sees this stamp).
    #[inline(always)]
    fn publish_run(&self, start: usize, end: usize) {
        debug_assert!(start < end && end - start <= self.capacity());
        self.slot(start).stamp.store(end, Ordering::Release);
    }

    /// Producer (owner only): pushes as many of `values` as fit, publishing them as one run
    /// (module doc) and with one tail store. Returns how many were taken (0 when the lane is
    /// full).
    ///
    /// # Errors
    /// `Err(())` if the inbox was closed (nothing taken).
    pub(crate) fn push_batch(
        &self,
        values: &mut impl ExactSizeIterator<Item = T>,
        closed: &AtomicBool,
        barrier: BarrierMode,
    ) -> Result<usize, ()> {
        if !self.enter(closed, barrier) {
            return Err(());
        }
        let tail = self.producer.tail.load(Ordering::Relaxed);
        let count = self.free_slots(tail, values.len()).min(values.len());
        // Stores the tail and lowers `busy` however this ends: should the iterator break its
        // contract and panic (or yield fewer values than its `len`), the lane stays consistent
        // with what was written.
        let mut published = PublishOnDrop { lane: self, tail, written: 0 };
        let end = tail + count;
        let prefetch = has_prefetch_for_write();
        if prefetch {
            for position in tail..end.min(tail + PREFETCH_WRITE_AHEAD) {
                prefetch_for_write(self.slot(position));
            }
        }
        // `for_each`, not `next()` in a loop: the vector's iterator then hands each value over
        // without an `Option`, and the compiler copies it straight into the slot instead of
        // through the stack (PERF.md, "Thirty-fifth session"). `Take` asks for no value beyond
        // `count`: the rest stays in the caller's iterator.
        values.by_ref().take(count).for_each(|value| {
            let position = tail + published.written;
            if prefetch && position + PREFETCH_WRITE_AHEAD < end {
                prefetch_for_write(self.slot(position + PREFETCH_WRITE_AHEAD));
            }
            // `free_slots` showed `position - head < capacity` for all of them. `published`
            // publishes them as one run once the batch is written.
            self.write_unpublished(position, value);
            published.written += 1;
        });
        Ok(published.written)
    }

    /// Producer: whether at least `slots` slots are free (for a blocked producer's re-check).
    pub(crate) fn has_room(&self, slots: usize) -> bool {
        let tail = self.producer.tail.load(Ordering::Relaxed);
        tail - self.consumer.head.load(Ordering::Acquire) + slots <= self.capacity()
    }

    /// Consumer: moves up to `max` published messages to `handle`, in order. Returns how many.
    ///
    /// The head is published before each handler call, so a panicking handler leaves the lane
    /// consistent (its message counts as consumed), and a handler that sends one message per
    /// message it handles into a full lane finds the slot it just freed at its first try.
    /// Publishing once per batch measured 8% faster for `send_batch`, but then such a handler
    /// waits for room that only its own thread can make. (A send that has to wait waits for
    /// a batch of free slots: around a cycle of endpoints whose inboxes are both full, the
    /// runtime bounds a handler's wait instead: `EndpointRef::send`.)
    pub(crate) fn pop_batch(&self, max: usize, handle: &mut impl Consume<T>) -> usize {
        let start = self.consumer.head.load(Ordering::Relaxed);
        let mut published_end = self.consumer.published_end.load(Ordering::Relaxed);
        // `max` may be `usize::MAX` ("everything").
        let limit = start.saturating_add(max);
        let mut head = start;
        while head < limit {
            if head == published_end {
                let Some(end) = self.fresh_run_end(head) else { break };
                published_end = end;
                self.consumer.published_end.store(end, Ordering::Relaxed);
            }
            // The bounds are set once per run, so that a message costs one test of each.
            let stop = published_end.min(limit);
            // Only lines the producer is done with: beyond the run it may still be writing.
            let prefetch_stop = published_end.saturating_sub(PREFETCH_AHEAD).min(stop);
            let mut run = PublishedRun { lane: self, head, stop, prefetch_stop };
            handle.consume_run(&mut run);
            debug_assert_eq!(run.head, stop, "`consume_run` takes the whole run");
            if run.head == head {
                break;
            }
            head = run.head;
        }
        head - start
    }

    /// Consumer: the end of the run published from `head` (the consumer's head, at the end of
    /// every run it knows of), if there is one.
    #[inline(always)]
    fn fresh_run_end(&self, head: usize) -> Option<usize> {
        let end = self.slot(head).stamp.load(Ordering::Acquire);
        debug_assert!(end <= head || end - head <= self.capacity(), "stamp {end} at {head}");
        (end > head).then_some(end)
    }

    /// Consumer: whether the position at the head is not published yet.
    pub(crate) fn is_empty_for_consumer(&self) -> bool {
        let head = self.consumer.head.load(Ordering::Relaxed);
        head == self.consumer.published_end.load(Ordering::Relaxed)
            && self.fresh_run_end(head).is_none()
    }

    /// Consumer, once the inbox is closed and the close barrier has run: no push is in flight
    /// and everything published was consumed.
    pub(crate) fn is_drained(&self) -> bool {
        !self.producer.busy.load(Ordering::Acquire) && self.is_empty_for_consumer()
    }
}

/// The consumer's view of part of one published run: the positions `head..stop`, each read once
/// and handed back (the head published) as the iterator yields it.
struct PublishedRun<'a, T> {
    lane: &'a Lane<T>,
    head: usize,
    stop: usize,
    /// Below this, the slot [`PREFETCH_AHEAD`] positions further is fetched early.
    prefetch_stop: usize,
}

impl<T> PublishedRun<'_, T> {
    /// Takes the value at `head`, which the caller checked is below `stop`.
    #[inline(always)]
    fn take(&mut self) -> T {
        debug_assert!(self.head < self.stop);
        let lane = self.lane;
        if self.head < self.prefetch_stop {
            prefetch(lane.slot(self.head + PREFETCH_AHEAD));
        }
        let value = lane.slot(self.head).value.with(|cell| {
            // SAFETY: `head` lies below `stop`, in a run whose stamp was acquired (by
            // `pop_batch`, now or in an earlier call), so the owner wrote this value and
            // released it; only this consumer reads it, once, before handing the slot back with
            // the head store below (the producer rewrites it only after seeing that).
            unsafe { cell.cast::<T>().read() }
        });
        self.head += 1;
        lane.consumer.head.store(self.head, Ordering::Release);
        value
    }

    /// Whether `wanted` holds for the value at `head`, which the caller checked is below
    /// `stop`, looked at in place.
    #[inline(always)]
    fn look(&self, wanted: impl FnOnce(&T) -> bool) -> bool {
        self.lane.slot(self.head).value.with(|cell| {
            // SAFETY: as in `take`, the value at `head` is written and released, and only this
            // consumer accesses it until its head store; looking at it through a shared
            // reference moves nothing.
            wanted(unsafe { &*cell.cast::<T>() })
        })
    }
}

impl<T> Iterator for PublishedRun<'_, T> {
    type Item = T;

    #[inline(always)]
    fn next(&mut self) -> Option<T> {
        (self.head < self.stop).then(|| self.take())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.stop.saturating_sub(self.head);
        (left, Some(left))
    }
}

impl<T> Run<T> for PublishedRun<'_, T> {
    #[inline(always)]
    fn next_is(&mut self, wanted: impl FnOnce(&T) -> bool) -> bool {
        self.head < self.stop && self.look(wanted)
    }

    #[inline(always)]
    fn next_if(&mut self, wanted: impl FnOnce(&T) -> bool) -> Option<T> {
        (self.head < self.stop && self.look(wanted)).then(|| self.take())
    }
}

impl<T> Drop for Lane<T> {
    fn drop(&mut self) {
        // `&mut self`: no producer or consumer runs. Positions head..tail hold published values.
        let head = self.consumer.head.load(Ordering::Relaxed);
        let tail = self.producer.tail.load(Ordering::Relaxed);
        for position in head..tail {
            self.slot(position).value.with_mut(|cell| {
                // SAFETY: published and not consumed, so initialised; exclusive access.
                unsafe { std::ptr::drop_in_place(cell.cast::<T>()) };
            });
        }
    }
}

/// Publishes a batch's values as one run and its tail, and lowers `busy`, when dropped (see
/// [`Lane::push_batch`]).
struct PublishOnDrop<'a, T> {
    lane: &'a Lane<T>,
    tail: usize,
    written: usize,
}

impl<T> Drop for PublishOnDrop<'_, T> {
    fn drop(&mut self) {
        if self.written > 0 {
            self.lane.publish_run(self.tail, self.tail + self.written);
        }
        self.lane.producer.tail.store(self.tail + self.written, Ordering::Relaxed);
        self.lane.producer.busy.store(false, Ordering::Release);
    }
}

/// The lanes of one inbox, indexed by producer index, each allocated on its owner's first push.
pub(crate) struct LaneTable<T> {
    /// Null until the owner of that index first pushes; then a `Box<Lane<T>>` leaked into the
    /// table and freed only by `Drop`.
    lanes: Box<[AtomicPtr<Lane<T>>]>,
    /// One more than the highest allocated index: the consumer scans `0..in_use`.
    in_use: CachePadded<AtomicUsize>,
    lane_capacity: usize,
}

// SAFETY: the table hands out `&Lane<T>` to its owner thread and to the consumer; `Lane<T>` is
// `Sync` for `T: Send`, and the pointers themselves are atomics.
unsafe impl<T: Send> Send for LaneTable<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for LaneTable<T> {}

impl<T> LaneTable<T> {
    /// `count` lane places (none allocated) of `lane_capacity` slots each.
    pub(crate) fn new(count: usize, lane_capacity: usize) -> Self {
        Self {
            lanes: (0..count).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect(),
            in_use: CachePadded::new(AtomicUsize::new(0)),
            lane_capacity,
        }
    }

    /// Number of lane places.
    pub(crate) fn count(&self) -> usize {
        self.lanes.len()
    }

    /// The lane at `index`, if its owner has pushed at least once.
    #[inline(always)]
    pub(crate) fn get(&self, index: usize) -> Option<&Lane<T>> {
        let pointer = self.lanes[index].load(Ordering::Acquire);
        // SAFETY: a non-null pointer came from `Box::into_raw` in `allocate` (published with
        // release, read with acquire above) and is freed only in `Drop`, which needs `&mut self`;
        // so it points to a live, initialised lane for as long as `&self` lives.
        unsafe { pointer.as_ref() }
    }

    /// Producer (the holder of `index` only): allocates its lane, on its first push.
    #[cold]
    pub(crate) fn allocate(&self, index: usize) -> &Lane<T> {
        let pointer = Box::into_raw(Box::new(Lane::with_capacity(self.lane_capacity)));
        // Only the owner of `index` allocates it, so nobody else can have stored meanwhile.
        self.lanes[index].store(pointer, Ordering::Release);
        // SeqCst: the consumer must not miss a lane whose owner goes on to see the inbox open
        // (this store pairs with the close barrier like `busy` does).
        self.in_use.fetch_max(index + 1, Ordering::SeqCst);
        self.get(index).expect("lane just stored")
    }

    /// Consumer: every allocated lane, in index order.
    #[inline]
    pub(crate) fn allocated(&self) -> impl Iterator<Item = &Lane<T>> {
        let in_use = self.in_use.load(Ordering::Acquire);
        (0..in_use).filter_map(|index| self.get(index))
    }
}

impl<T> Drop for LaneTable<T> {
    fn drop(&mut self) {
        for place in self.lanes.iter() {
            let pointer = place.load(Ordering::Relaxed);
            if !pointer.is_null() {
                // SAFETY: produced by `Box::into_raw` in `allocate`, stored once, and dropped
                // only here, with exclusive access to the table.
                drop(unsafe { Box::from_raw(pointer) });
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
pub(super) mod tests {
    use super::super::test_bounds::{bound, join_within};
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    fn open() -> AtomicBool {
        AtomicBool::new(false)
    }

    /// A lane of 4 slots holding 0..4, its (open) inbox flag and the barrier mode.
    fn full_lane_of_four() -> (Lane<i32>, AtomicBool, BarrierMode) {
        let closed = open();
        let lane = Lane::with_capacity(4);
        let mode = BarrierMode::detect();
        for value in 0..4 {
            lane.push(value, &closed, mode).unwrap();
        }
        (lane, closed, mode)
    }

    #[test]
    fn a_panicking_handler_consumes_its_message_and_frees_the_slots_before_it() {
        let (lane, _, _) = full_lane_of_four();
        let mut seen = Vec::new();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lane.pop_batch(10, &mut |value| {
                if value == 1 {
                    panic!("handler fails on {value}");
                }
                seen.push(value);
            })
        }));
        assert!(outcome.is_err());
        // Positions 0 and 1 (the panicking one) are consumed and their slots free again.
        assert!(lane.has_room(2), "the head was not published by the unwinding batch");
        lane.pop_batch(10, &mut |value| seen.push(value));
        assert_eq!(seen, vec![0, 2, 3], "the panicking message is not handled twice");
    }

    #[test]
    fn a_handler_finds_the_slot_of_its_message_free_in_a_full_lane() {
        let (lane, closed, mode) = full_lane_of_four();
        let mut seen = Vec::new();
        lane.pop_batch(4, &mut |value| {
            seen.push(value);
            // One message out, one in: what a handler forwarding to its own endpoint (or
            // around a cycle of endpoints) needs to never wait on itself.
            lane.push(value + 10, &closed, mode).expect("the handled message's slot is free");
        });
        lane.pop_batch(4, &mut |value| seen.push(value));
        assert_eq!(seen, vec![0, 1, 2, 3, 10, 11, 12, 13]);
    }

    #[test]
    fn push_pop_in_order_full_and_wrap() {
        let closed = open();
        let lane = Lane::with_capacity(4);
        for mode in [BarrierMode::Fenced, BarrierMode::detect()] {
            for value in 0..4 {
                lane.push(value, &closed, mode).unwrap();
            }
            assert_eq!(lane.push(99, &closed, mode), Err(LanePushError::Full(99)));
            let mut seen = Vec::new();
            assert_eq!(lane.pop_batch(3, &mut |value| seen.push(value)), 3);
            let mut rest = 4..6;
            assert_eq!(lane.push_batch(&mut rest, &closed, mode), Ok(2), "wraps around");
            lane.pop_batch(10, &mut |value| seen.push(value));
            lane.pop_batch(10, &mut |value| seen.push(value));
            assert_eq!(seen, vec![0, 1, 2, 3, 4, 5]);
            assert!(lane.is_empty_for_consumer());
        }
    }

    /// Batches longer than the write-prefetch distance, wrapping around a lane whose consumer
    /// lags: every accepted value arrives once, in order, and a batch takes only the free slots.
    #[test]
    fn batches_longer_than_the_prefetch_distance_wrap_in_order() {
        let closed = open();
        let capacity = 4 * PREFETCH_WRITE_AHEAD;
        let lane = Lane::with_capacity(capacity);
        let mode = BarrierMode::detect();
        let mut seen = Vec::new();
        let mut next = 0..;
        for round in 0..6 {
            let mut batch = (&mut next).take(capacity + 3).collect::<Vec<usize>>().into_iter();
            let (first, offered) = (next.start - batch.len(), batch.len());
            let taken = lane.push_batch(&mut batch, &closed, mode).unwrap();
            assert!(taken <= offered && taken > PREFETCH_WRITE_AHEAD, "round {round}: {taken}");
            assert_eq!(
                batch.collect::<Vec<_>>(),
                (first + taken..first + offered).collect::<Vec<_>>(),
                "round {round}: the values that did not fit stay in the caller's iterator"
            );
            // What did not fit is offered again first.
            next = (next.start - offered + taken)..;
            // The consumer takes a part only, so the next batch wraps.
            lane.pop_batch(capacity - 5 + round, &mut |value| seen.push(value));
        }
        lane.pop_batch(usize::MAX, &mut |value| seen.push(value));
        assert_eq!(seen, (0..seen.len()).collect::<Vec<_>>(), "every value once, in order");
        assert!(seen.len() > 4 * capacity);
        assert!(lane.is_empty_for_consumer());
    }

    /// An iterator that claims `claimed` values, yields `0..yielded`, and then panics or ends:
    /// a broken `ExactSizeIterator` that `push_batch` (and `ShardedQueue::push_iter_from`) must
    /// survive.
    pub(in crate::queue) struct BrokenBatch {
        pub(in crate::queue) next: u32,
        pub(in crate::queue) yielded: u32,
        pub(in crate::queue) claimed: usize,
        pub(in crate::queue) panics: bool,
    }

    impl Iterator for BrokenBatch {
        type Item = u32;

        fn next(&mut self) -> Option<u32> {
            if self.next == self.yielded {
                assert!(!self.panics, "the batch's iterator fails after {} values", self.next);
                return None;
            }
            self.next += 1;
            Some(self.next - 1)
        }

        fn size_hint(&self) -> (usize, Option<usize>) {
            let left = self.claimed.saturating_sub(self.next as usize);
            (left, Some(left))
        }
    }

    impl ExactSizeIterator for BrokenBatch {}

    /// Pushes 100 after a broken batch, then pops everything: what the consumer sees.
    fn values_after(lane: &Lane<u32>, closed: &AtomicBool, mode: BarrierMode) -> Vec<u32> {
        assert!(!lane.producer.busy.load(Ordering::SeqCst), "busy is lowered");
        lane.push(100, closed, mode).expect("the lane takes pushes again");
        let mut seen = Vec::new();
        lane.pop_batch(usize::MAX, &mut |value| seen.push(value));
        assert!(lane.is_empty_for_consumer());
        seen
    }

    #[test]
    fn a_batch_whose_iterator_panics_publishes_what_it_wrote_and_lowers_busy() {
        let closed = open();
        let mode = BarrierMode::detect();
        let lane = Lane::with_capacity(16);
        let mut batch = BrokenBatch { next: 0, yielded: 3, claimed: 8, panics: true };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lane.push_batch(&mut batch, &closed, mode)
        }));
        assert!(outcome.is_err(), "the iterator's panic reaches the caller");
        assert_eq!(lane.len(), 3, "the three values written are published");
        assert_eq!(values_after(&lane, &closed, mode), vec![0, 1, 2, 100]);
    }

    #[test]
    fn a_batch_whose_iterator_yields_fewer_than_its_len_publishes_only_those() {
        let closed = open();
        let mode = BarrierMode::detect();
        let lane = Lane::with_capacity(16);
        let mut batch = BrokenBatch { next: 0, yielded: 2, claimed: 8, panics: false };
        assert_eq!(lane.push_batch(&mut batch, &closed, mode), Ok(2), "two values taken");
        assert_eq!(values_after(&lane, &closed, mode), vec![0, 1, 100]);
        let mut empty = BrokenBatch { next: 0, yielded: 0, claimed: 4, panics: false };
        assert_eq!(lane.push_batch(&mut empty, &closed, mode), Ok(0), "nothing to take");
        assert_eq!(values_after(&lane, &closed, mode), vec![100], "no stale run published");
    }

    /// Runs of every length up to the whole lane, single pushes among them, over many laps of a
    /// small lane, with the consumer stopping anywhere inside a run: no stale stamp looks fresh
    /// (not even the one a full-lane run leaves, which equals the position one lap later), so
    /// every value arrives once, in order, and nothing more.
    #[test]
    fn runs_of_every_length_over_many_laps_arrive_once_in_order() {
        let closed = open();
        let capacity = 8;
        let lane = Lane::with_capacity(capacity);
        let mode = BarrierMode::detect();
        // A fixed-seed linear congruential generator: the same interleaving on every run.
        let mut seed = 0x2545_f491_u64;
        let mut next_random = |below: usize| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            usize::try_from(seed >> 33).unwrap() % below
        };
        let (mut sent, mut seen) = (0usize, Vec::new());
        while sent < 2_000 {
            if next_random(4) == 0 {
                if lane.push(sent, &closed, mode).is_ok() {
                    sent += 1;
                }
            } else {
                let mut batch =
                    (sent..sent + 1 + next_random(capacity + 2)).collect::<Vec<_>>().into_iter();
                sent += lane.push_batch(&mut batch, &closed, mode).unwrap();
            }
            // Sometimes everything, so that a batch can then fill the whole lane in one run.
            let take = if next_random(4) == 0 { usize::MAX } else { next_random(capacity) };
            lane.pop_batch(take, &mut |value| seen.push(value));
            assert_eq!(lane.is_empty_for_consumer(), lane.len() == 0, "after {sent} sent");
        }
        lane.pop_batch(usize::MAX, &mut |value| seen.push(value));
        assert_eq!(seen, (0..sent).collect::<Vec<_>>(), "every value once, in order");
        assert!(lane.is_empty_for_consumer());
        assert_eq!(lane.pop_batch(usize::MAX, &mut |value| seen.push(value)), 0, "nothing more");
    }

    #[test]
    fn push_with_builds_each_message_once_and_lowers_busy_on_every_path() {
        let closed = open();
        let lane = Lane::with_capacity(2);
        let built = std::cell::Cell::new(0);
        let push = |value: u32| {
            lane.push_with(
                || {
                    built.set(built.get() + 1);
                    value
                },
                &closed,
                BarrierMode::Fenced,
            )
        };
        assert_eq!(push(1), Ok(()));
        assert_eq!(push(2), Ok(()));
        assert_eq!(push(3), Err(LanePushError::Full(3)), "two slots");
        closed.store(true, Ordering::SeqCst);
        assert_eq!(push(4), Err(LanePushError::Closed(4)));
        assert_eq!(built.get(), 4, "one constructor call per push: accepted, full and closed");
        assert!(!lane.producer.busy.load(Ordering::SeqCst), "busy is lowered on every path");
        let mut seen = Vec::new();
        lane.pop_batch(10, &mut |value| seen.push(value));
        assert_eq!(seen, vec![1, 2]);
    }

    #[test]
    fn closed_inbox_refuses_and_keeps_published_messages() {
        let closed = open();
        let lane = Lane::with_capacity(4);
        lane.push(1, &closed, BarrierMode::Fenced).unwrap();
        closed.store(true, Ordering::SeqCst);
        assert_eq!(lane.push(2, &closed, BarrierMode::Fenced), Err(LanePushError::Closed(2)));
        assert_eq!(lane.push_batch(&mut (3..4), &closed, BarrierMode::Fenced), Err(()));
        assert!(!lane.is_drained());
        let mut seen = Vec::new();
        lane.pop_batch(10, &mut |value| seen.push(value));
        assert_eq!(seen, vec![1]);
        assert!(lane.is_drained());
    }

    #[test]
    fn drop_releases_unconsumed_messages_and_lanes() {
        let marker = Arc::new(());
        let closed = open();
        let table = LaneTable::new(4, 4);
        assert!(table.get(2).is_none());
        let lane = table.allocate(2);
        lane.push(Arc::clone(&marker), &closed, BarrierMode::Fenced).unwrap();
        lane.push(Arc::clone(&marker), &closed, BarrierMode::Fenced).unwrap();
        lane.pop_batch(1, &mut drop);
        assert_eq!(table.allocated().count(), 1);
        assert_eq!(Arc::strong_count(&marker), 2);
        drop(table);
        assert_eq!(Arc::strong_count(&marker), 1);
    }

    #[test]
    fn concurrent_producer_and_consumer_keep_order() {
        let count: usize = if cfg!(miri) { 500 } else { 1_000_000 };
        let closed = Arc::new(open());
        let lane = Arc::new(Lane::with_capacity(64));
        // Every wait below is bounded: a lost slot or a stuck stamp fails the test, not CI.
        let deadline = Instant::now() + bound(30);
        let producer = {
            let (lane, closed) = (Arc::clone(&lane), Arc::clone(&closed));
            std::thread::spawn(move || {
                let mut next = 0;
                while next < count {
                    assert!(
                        Instant::now() < deadline,
                        "producer: pushed {next} of {count} messages by the deadline"
                    );
                    let batch = (next..(next + 7).min(count)).collect::<Vec<_>>();
                    let mut values = batch.into_iter();
                    next += lane.push_batch(&mut values, &closed, BarrierMode::detect()).unwrap();
                    if values.len() > 0 {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut expected = 0;
        while expected < count {
            assert!(
                Instant::now() < deadline,
                "consumer: received {expected} of {count} messages by the deadline"
            );
            if lane.pop_batch(16, &mut |value| {
                assert_eq!(value, expected);
                expected += 1;
            }) == 0
            {
                std::thread::yield_now();
            }
        }
        join_within(producer, bound(10), "producer");
        assert!(lane.is_empty_for_consumer());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::{sync::Arc, thread};

    /// A producer pushing three messages into a 2-slot lane (so a slot is reused after the
    /// consumer frees it), a separate thread closing the inbox (the `ShardedQueue::close`
    /// sequence: closed, heavy barrier, fenced), and the consumer draining until it may call
    /// the lane drained: every push that returned `Ok` is consumed, in order, exactly once, and
    /// nothing else is.
    #[test]
    fn loom_lane_close_drains_exactly_what_was_accepted() {
        loom::model(|| {
            let lane = Arc::new(Lane::with_capacity(2));
            let closed = Arc::new(AtomicBool::new(false));
            let fenced = Arc::new(AtomicBool::new(false));
            let producer = {
                let (lane, closed) = (Arc::clone(&lane), Arc::clone(&closed));
                thread::spawn(move || {
                    let mut accepted = 0u32;
                    while accepted < 3 {
                        match lane.push(accepted + 1, &closed, BarrierMode::Fenced) {
                            Ok(()) => accepted += 1,
                            Err(LanePushError::Full(_)) => thread::yield_now(),
                            Err(LanePushError::Closed(_)) => break,
                        }
                    }
                    accepted
                })
            };
            let closer = {
                let (closed, fenced) = (Arc::clone(&closed), Arc::clone(&fenced));
                thread::spawn(move || {
                    closed.store(true, Ordering::SeqCst);
                    BarrierMode::Fenced.heavy();
                    fenced.store(true, Ordering::Release);
                })
            };
            let mut seen = Vec::new();
            loop {
                let done = fenced.load(Ordering::Acquire) && lane.is_drained();
                lane.pop_batch(2, &mut |value| seen.push(value));
                if done {
                    break;
                }
                thread::yield_now();
            }
            let accepted = producer.join().unwrap();
            closer.join().unwrap();
            assert!(seen.iter().copied().eq(1..=accepted), "seen {seen:?}, accepted {accepted}");
        });
    }

    /// A batch push publishes its values as one run: a consumer polling concurrently never
    /// reads a slot before its value is written (loom checks every cell access against the
    /// stamp's ordering), sees a batch's values in order, and gets each exactly once, across a
    /// wrap-around of a 2-slot lane.
    #[test]
    fn loom_batch_push_publishes_whole_batches_in_order() {
        loom::model(|| {
            let lane = Arc::new(Lane::with_capacity(2));
            let closed = Arc::new(AtomicBool::new(false));
            let producer = {
                let (lane, closed) = (Arc::clone(&lane), Arc::clone(&closed));
                thread::spawn(move || {
                    let mut values = 1..4u32;
                    while !values.is_empty() {
                        if lane.push_batch(&mut values, &closed, BarrierMode::Fenced) == Ok(0) {
                            thread::yield_now();
                        }
                    }
                })
            };
            let mut seen = Vec::new();
            while seen.len() < 3 {
                if lane.pop_batch(2, &mut |value| seen.push(value)) == 0 {
                    thread::yield_now();
                }
            }
            producer.join().unwrap();
            assert_eq!(seen, vec![1, 2, 3]);
            assert!(lane.is_empty_for_consumer());
        });
    }
}
