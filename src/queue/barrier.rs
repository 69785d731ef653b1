//! Asymmetric memory barriers: a compiler-only fence for producers, a process-wide barrier for
//! the rare consumer-side decisions.
//!
//! Two places in the inbox need a store-load ("Dekker") ordering between a producer and the
//! consumer: a producer publishes a message and then reads whether the consumer is about to park;
//! the consumer announces that it parks and then reads whether anything was published (and the
//! same for a producer entering a push while the inbox closes). Each side needs a full barrier
//! between its store and its load, or both may miss the other. A full barrier per message is
//! what made the old send path cost a locked instruction (and a drained store buffer) per send.
//!
//! Linux's `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` moves that cost to the rare side: it
//! makes every running thread of the process execute a full barrier before it returns, so the
//! frequent side needs only a compiler fence (the pattern of liburcu, folly's
//! `asymmetricHeavyBarrier` and the Linux kernel's own `sys_membarrier` users). Producers run
//! [`BarrierMode::light`] per message; the consumer runs [`BarrierMode::heavy`] only before it
//! parks (after spinning idle) and when the inbox closes.
//!
//! Correctness of the pairing: take producer `store A; light; load B` and consumer
//! `store B; heavy; load A`. The heavy barrier interrupts the producer's CPU at some point of its
//! program. If that point is after `store A`, the barrier drains the producer's store buffer
//! and the consumer's `load A` (after `heavy` returns) sees it. If it is before `store A`, then
//! the producer's `load B` comes after a barrier that itself comes after the consumer's
//! `store B`, so the producer sees `B`. Either way at least one side sees the other.
//!
//! When the kernel refuses `membarrier` (older than 4.14, or forbidden by a seccomp filter),
//! both sides use a real `SeqCst` fence instead ([`BarrierMode::Fenced`]); that path is also what
//! the loom models check (loom cannot model `membarrier`), and the queue's tests run in both
//! modes.

use std::sync::OnceLock;

use crate::sync::{fence, Ordering};

/// How the producer and consumer sides of the inbox order their store-load pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarrierMode {
    /// Producers: compiler fence only. Consumer: `membarrier(PRIVATE_EXPEDITED)`.
    Asymmetric,
    /// Both sides: a `SeqCst` fence (the kernel refused `membarrier`).
    Fenced,
}

impl BarrierMode {
    /// The best mode this process can use: [`BarrierMode::Asymmetric`] once the process is
    /// registered for expedited private membarriers, else [`BarrierMode::Fenced`] (reported
    /// once through `tracing`). Decided once per process.
    pub fn detect() -> Self {
        static MODE: OnceLock<BarrierMode> = OnceLock::new();
        *MODE.get_or_init(register_membarrier)
    }

    /// Producer side: orders an earlier store before a later load, in the pairing described in
    /// the module doc. A compiler fence in asymmetric mode.
    #[inline(always)]
    pub(crate) fn light(self) {
        match self {
            Self::Asymmetric => std::sync::atomic::compiler_fence(Ordering::SeqCst),
            Self::Fenced => fence(Ordering::SeqCst),
        }
    }

    /// Consumer side: a full barrier on every running thread of the process (asymmetric mode),
    /// or on this one (fenced mode).
    pub(crate) fn heavy(self) {
        match self {
            Self::Asymmetric => expedited_membarrier(),
            Self::Fenced => fence(Ordering::SeqCst),
        }
    }
}

#[cfg(not(any(loom, miri)))]
fn register_membarrier() -> BarrierMode {
    use rustix::thread::{membarrier, MembarrierCommand};
    match membarrier(MembarrierCommand::RegisterPrivateExpedited) {
        Ok(()) => BarrierMode::Asymmetric,
        Err(error) => {
            tracing::info!(
                %error,
                "membarrier refused: inbox producers fall back to a full fence per message"
            );
            BarrierMode::Fenced
        }
    }
}

/// Loom cannot model `membarrier` (nor can Miri run it): the models check the fenced protocol.
#[cfg(any(loom, miri))]
fn register_membarrier() -> BarrierMode {
    BarrierMode::Fenced
}

#[cfg(not(any(loom, miri)))]
fn expedited_membarrier() {
    use rustix::thread::{membarrier, MembarrierCommand};
    // Registration succeeded (that is the only way to reach asymmetric mode), after which the
    // kernel documents no failure of this command; should one appear anyway, a full fence on
    // this thread is not enough for the pairing, so fail loudly rather than lose a wake-up.
    if let Err(error) = membarrier(MembarrierCommand::PrivateExpedited) {
        panic!("membarrier(PRIVATE_EXPEDITED) failed after registration: {error}");
    }
}

#[cfg(any(loom, miri))]
fn expedited_membarrier() {
    unreachable!("asymmetric mode is never selected under loom or Miri")
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn detection_is_stable_and_both_sides_run() {
        let mode = BarrierMode::detect();
        assert_eq!(mode, BarrierMode::detect());
        mode.light();
        mode.heavy();
        BarrierMode::Fenced.light();
        BarrierMode::Fenced.heavy();
    }
}
