//! Pinning endpoint threads to cores.
//!
//! Pinning is advisory: if the OS refuses (a core id that does not exist, a restricted cpuset),
//! the thread runs unpinned and a warning says so. On a 2-core machine with more busy threads
//! than cores, leave pinning off: pinned spinners then compete for the same core.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::Pinning;

/// Hands out cores to new endpoint threads according to a [`Pinning`] policy.
#[derive(Debug)]
pub(crate) struct CorePlanner {
    pinning: Pinning,
    next_index: AtomicUsize,
}

impl CorePlanner {
    pub(crate) fn new(pinning: Pinning) -> Self {
        Self {
            pinning,
            next_index: AtomicUsize::new(0),
        }
    }

    /// The core id for the next endpoint thread, if pinning is on.
    pub(crate) fn next_core(&self) -> Option<usize> {
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        match &self.pinning {
            Pinning::Off => None,
            Pinning::RoundRobin => {
                let cores = core_affinity::get_core_ids().map_or(0, |ids| ids.len());
                (cores > 0).then(|| index % cores)
            }
            Pinning::Cores(cores) => Some(cores[index % cores.len()]),
        }
    }
}

/// Pins the calling thread to `core`; logs and carries on unpinned if that fails.
pub(crate) fn pin_current_thread(core: usize, endpoint: &str) {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
        tracing::warn!(
            endpoint,
            core,
            "could not pin endpoint thread; running unpinned"
        );
    }
}
