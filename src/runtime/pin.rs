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
    /// [`Pinning::RoundRobin`]'s cores: the ids the process may run on when the bus was
    /// built (not list positions: under a restricted cpuset they need not start at 0), read
    /// once, so an endpoint registered from a pinned thread does not see only that thread's
    /// core.
    round_robin: Vec<usize>,
    next_index: AtomicUsize,
}

impl CorePlanner {
    pub(crate) fn new(pinning: Pinning) -> Self {
        let round_robin = match pinning {
            Pinning::RoundRobin => core_affinity::get_core_ids()
                .map(|ids| ids.into_iter().map(|id| id.id).collect())
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        Self { pinning, round_robin, next_index: AtomicUsize::new(0) }
    }

    /// The core id for the next endpoint thread, if pinning is on.
    pub(crate) fn next_core(&self) -> Option<usize> {
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        match &self.pinning {
            Pinning::Off => None,
            Pinning::RoundRobin => (!self.round_robin.is_empty())
                .then(|| self.round_robin[index % self.round_robin.len()]),
            Pinning::Cores(cores) => Some(cores[index % cores.len()]),
        }
    }
}

/// Pins the calling thread to `core` and returns true; logs, carries on unpinned and returns
/// false if that fails. A core id beyond what the OS's CPU sets can name is refused up front:
/// the pinning call itself would index past its CPU set (libc's `CPU_SET` panics there, and
/// the process aborts). The OS refuses a core that does not exist or is offline, and one
/// outside the process's cgroup cpuset (a mask narrowed with `taskset` can be widened again).
pub(crate) fn pin_current_thread(core: usize, endpoint: &str) -> bool {
    if core >= CPU_SET_CORES {
        tracing::warn!(
            endpoint,
            core,
            limit = CPU_SET_CORES,
            "core id beyond the CPU set; running unpinned"
        );
        return false;
    }
    let pinned = core_affinity::set_for_current(core_affinity::CoreId { id: core });
    if !pinned {
        tracing::warn!(endpoint, core, "could not pin endpoint thread; running unpinned");
    }
    pinned
}

/// How many cores a `cpu_set_t` can name (glibc's `CPU_SETSIZE`, 1024).
const CPU_SET_CORES: usize = 8 * std::mem::size_of::<libc::cpu_set_t>();

#[cfg(test)]
mod tests {
    use super::*;

    /// Affinity of the calling thread, as core ids.
    fn current_affinity() -> Vec<usize> {
        core_affinity::get_core_ids().unwrap().into_iter().map(|id| id.id).collect()
    }

    #[test]
    fn a_core_id_beyond_the_cpu_set_runs_unpinned_instead_of_panicking() {
        // 4096 is past glibc's CPU_SETSIZE (1024): `CPU_SET` on it indexes out of bounds.
        const { assert!(CPU_SET_CORES <= 4096) };
        let affinity = std::thread::spawn(|| {
            let before = current_affinity();
            let pinned = pin_current_thread(4096, "test");
            (before, current_affinity(), pinned)
        })
        .join()
        .expect("pinning to an impossible core panicked");
        assert_eq!(affinity.0, affinity.1, "the thread's affinity changed");
        assert!(!affinity.2, "a refused pin is reported as refused");
    }

    /// Round robin hands out the core ids the process may run on, read when the planner is
    /// made: from a thread pinned to the last of them, a new planner still cycles through all
    /// (and a planner made on it then, only through that one: its id, not position 0).
    #[test]
    fn round_robin_hands_out_core_ids_read_when_the_bus_is_built() {
        let allowed = current_affinity();
        let planner = CorePlanner::new(Pinning::RoundRobin);
        let handed: Vec<usize> =
            (0..allowed.len() * 2).map(|_| planner.next_core().unwrap()).collect();
        let expected: Vec<usize> = allowed.iter().chain(&allowed).copied().collect();
        assert_eq!(handed, expected);
        let last = *allowed.last().unwrap();
        let on_last = std::thread::spawn(move || {
            assert!(pin_current_thread(last, "test"));
            let planner = CorePlanner::new(Pinning::RoundRobin);
            (planner.next_core(), planner.next_core(), planner.next_core())
        })
        .join()
        .unwrap();
        assert_eq!(on_last, (Some(last), Some(last), Some(last)));
        // The planner made before keeps cycling through every allowed core.
        assert_eq!(planner.next_core(), Some(allowed[0]));
    }

    #[test]
    fn an_allowed_core_pins_the_thread_to_it() {
        let core = *current_affinity().last().unwrap();
        let (pinned, affinity) = std::thread::spawn(move || {
            let pinned = pin_current_thread(core, "test");
            (pinned, current_affinity())
        })
        .join()
        .unwrap();
        assert!(pinned, "the pin is reported as taken");
        assert_eq!(affinity, vec![core]);
    }
}
