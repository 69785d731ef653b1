//! Producer indices: a small integer per thread, given back when the thread ends.
//!
//! An inbox keys its single-producer lanes by this index, so an index must never be held by two
//! live threads. Indices below [`RECYCLED_INDICES`] come from a bitmap (lowest free first) and
//! return to it from the thread's TLS destructor, so a long-lived process with thread churn
//! keeps its producers on low indices, and therefore on lanes. Beyond that many live threads,
//! indices come from a counter and are never reused; such threads use the inbox's shared
//! multi-producer shards instead of a lane.
//!
//! Handing an index from a finished thread to a new one is safe for the lanes: the old thread's
//! last publication happens before its destructor frees the bit (release), which happens before
//! the new thread claims it (acquire); the lane's cached indices live in the lane itself.
//!
//! A thread that sends from another TLS destructor after its index was given back gets a fresh
//! never-reused index for its remaining life: its few last messages may then overtake messages it
//! queued earlier in its lane (per-sender order cannot be kept for a thread in teardown without
//! keeping its lane forever).
//!
//! Claiming an index is a few atomic operations, once per thread; reading it afterwards is one
//! thread-local load.

use std::{
    cell::Cell,
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
};

/// Indices `0..RECYCLED_INDICES` are recycled; the rest are counted upwards.
pub(crate) const RECYCLED_INDICES: usize = 1024;

const WORDS: usize = RECYCLED_INDICES / 64;

/// Bit `i` set: index `i` is held by a live thread.
static IN_USE: [AtomicU64; WORDS] = [const { AtomicU64::new(0) }; WORDS];
/// Next index handed out once the bitmap is full (or to threads in teardown).
static NEXT_UNRECYCLED: AtomicUsize = AtomicUsize::new(RECYCLED_INDICES);

const UNASSIGNED: usize = usize::MAX;

thread_local! {
    /// This thread's index (`UNASSIGNED` until its first send). No destructor, so it stays
    /// readable while other thread-locals are torn down.
    static INDEX: Cell<usize> = const { Cell::new(UNASSIGNED) };
    /// Gives a recycled index back when the thread ends.
    static RELEASE_ON_EXIT: IndexRelease = const { IndexRelease(Cell::new(UNASSIGNED)) };
}

/// The index of the calling thread, claimed on first use.
#[inline(always)]
pub(crate) fn producer_index() -> usize {
    let index = INDEX.with(Cell::get);
    if index != UNASSIGNED {
        return index;
    }
    assign_index()
}

#[cold]
fn assign_index() -> usize {
    let index = match claim_recycled() {
        Some(index) => {
            // Registering the destructor can fail only during this thread's teardown; then the
            // bit must not be kept forever, and the thread takes a never-reused index instead.
            if RELEASE_ON_EXIT.try_with(|release| release.0.set(index)).is_ok() {
                index
            } else {
                release_recycled(index);
                NEXT_UNRECYCLED.fetch_add(1, Ordering::Relaxed)
            }
        }
        None => NEXT_UNRECYCLED.fetch_add(1, Ordering::Relaxed),
    };
    INDEX.with(|cell| cell.set(index));
    index
}

/// Claims the lowest free recycled index.
fn claim_recycled() -> Option<usize> {
    for (word_index, word) in IN_USE.iter().enumerate() {
        let mut bits = word.load(Ordering::Relaxed);
        while bits != u64::MAX {
            let bit = bits.trailing_ones();
            match word.compare_exchange_weak(
                bits,
                bits | (1 << bit),
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(word_index * 64 + bit as usize),
                Err(current) => bits = current,
            }
        }
    }
    None
}

fn release_recycled(index: usize) {
    IN_USE[index / 64].fetch_and(!(1 << (index % 64)), Ordering::Release);
}

/// Thread-local guard whose destructor gives the thread's recycled index back.
struct IndexRelease(Cell<usize>);

impl Drop for IndexRelease {
    fn drop(&mut self) {
        let index = self.0.get();
        if index == UNASSIGNED {
            return;
        }
        // Later sends of this thread (from other destructors) must not use the index any more.
        let _ = INDEX.try_with(|cell| cell.set(NEXT_UNRECYCLED.fetch_add(1, Ordering::Relaxed)));
        release_recycled(index);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn index_is_stable_per_thread_and_live_threads_never_share_one() {
        let mine = producer_index();
        assert_eq!(mine, producer_index());
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let barrier = std::sync::Arc::clone(&barrier);
                std::thread::spawn(move || {
                    let index = producer_index();
                    barrier.wait();
                    index
                })
            })
            .collect();
        let mut indices: Vec<usize> =
            handles.into_iter().map(|handle| handle.join().unwrap()).collect();
        indices.push(mine);
        indices.sort_unstable();
        indices.dedup();
        assert_eq!(indices.len(), 5, "five live threads, five indices: {indices:?}");
    }

    #[test]
    fn indices_of_finished_threads_are_reused() {
        // Without recycling, 2 x RECYCLED_INDICES threads one after the other would run the
        // counter past the recycled range; with it, each finds a low free index again.
        for _ in 0..2 * RECYCLED_INDICES {
            let index = std::thread::spawn(producer_index).join().unwrap();
            assert!(index < RECYCLED_INDICES, "thread got never-reused index {index}");
        }
    }
}
