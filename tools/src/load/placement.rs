//! Where the epoch workload's threads run (`--placement`).
//!
//! The coordinator's endpoint thread handles every message of the run, so its core sets the
//! rate. Left to the scheduler, every other thread of the run takes turns on that core too:
//! the producers and the driver, and with a WAL its sync thread and the io_uring kernel
//! workers that copy each group into the page cache and run the syncs. On a 2-core machine
//! the durable run's coordinator waited 1.0 s for its core against 2.7 s running (PERF.md,
//! "Forty-third session"). `isolated` (the default) keeps one core for the
//! coordinator ([`coordbus::Pinning::Cores`]) and pins the load threads to the others, where
//! the WAL's I/O also goes ([`coordbus::wal::WalOptions::io_cores`]): how an engine that
//! embeds the coordinator would keep its hot thread's core. Both the in-memory and the
//! durable run are placed the same way, so their ratio compares like with like. The main
//! thread (which mostly waits for the run's end) stays unpinned. `shared` pins nothing.

/// Where the run's threads go.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The coordinator alone on the last core; the load threads and the WAL's I/O on the
    /// others (on a single core: as `shared`).
    Isolated,
    /// Every thread wherever the scheduler puts it.
    Shared,
}

/// The cores of an isolated run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cores {
    /// The coordinator's endpoint thread's core.
    pub coordinator: usize,
    /// The cores of the load threads and the WAL's I/O (never empty).
    pub load: Vec<usize>,
}

impl Placement {
    /// The cores this placement puts the run on, among `available` (the ids this process may
    /// run on): `None` for `shared`, and for `isolated` with fewer than two cores (nothing to
    /// keep apart).
    pub fn cores(self, available: &[usize]) -> Option<Cores> {
        match (self, available.split_last()) {
            (Self::Isolated, Some((&coordinator, load))) if !load.is_empty() => {
                Some(Cores { coordinator, load: load.to_vec() })
            }
            _ => None,
        }
    }
}

impl Cores {
    /// The core of load thread `index` (the load cores in turn).
    pub fn load_core(&self, index: usize) -> usize {
        self.load[index % self.load.len()]
    }
}

/// The name of the placement a run got: `cores` from [`Placement::cores`], `refused_pins`
/// how many of its threads' pins the system refused (the run then says `partly isolated`: its
/// figure is less isolated than asked, not wrong).
pub fn name(cores: Option<&Cores>, refused_pins: usize) -> &'static str {
    match (cores, refused_pins) {
        (None, _) => "shared",
        (Some(_), 0) => "isolated",
        (Some(_), _) => "partly isolated",
    }
}

/// The ids of the cores this thread may run on (empty if the system does not say).
pub fn available_cores() -> Vec<usize> {
    core_affinity::get_core_ids().unwrap_or_default().into_iter().map(|core| core.id).collect()
}

/// Whether the coordinator's thread is not on the core an isolated run (`cores`) asked for it,
/// from its endpoint stats' `pinned_core`: the system refused the pin.
pub fn coordinator_pin_refused(cores: Option<&Cores>, pinned_core: Option<usize>) -> bool {
    cores.is_some_and(|cores| pinned_core != Some(cores.coordinator))
}

/// Pins the calling load thread to `core` and returns true; if the system refuses, says so,
/// carries on unpinned and returns false ([`name`] then says `partly isolated`).
pub fn pin_load_thread(core: usize, thread: &str) -> bool {
    let pinned = core_affinity::set_for_current(core_affinity::CoreId { id: core });
    if !pinned {
        eprintln!("epoch workload: could not pin {thread} to core {core}; it runs unpinned");
    }
    pinned
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isolated_keeps_the_last_core_for_the_coordinator_and_the_rest_for_the_load() {
        let two = Placement::Isolated.cores(&[0, 1]).unwrap();
        assert_eq!(two, Cores { coordinator: 1, load: vec![0] });
        assert_eq!((two.load_core(0), two.load_core(1), two.load_core(2)), (0, 0, 0));
        // Ids of a restricted cpuset need not start at 0 nor be contiguous.
        let four = Placement::Isolated.cores(&[2, 3, 5, 7]).unwrap();
        assert_eq!(four, Cores { coordinator: 7, load: vec![2, 3, 5] });
        assert_eq!((four.load_core(0), four.load_core(2), four.load_core(3)), (2, 5, 2));
        assert_eq!(name(Some(&four), 0), "isolated");
        assert_eq!(name(Some(&four), 1), "partly isolated", "a refused pin shows");
    }

    /// A core id one past the last this system could ever bring online: no core has it.
    fn nonexistent_core() -> usize {
        let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
        // A list of ranges, such as "0-1" or "0-3,8-11": the last number is the last core.
        let last = possible.trim().rsplit([',', '-']).next().unwrap();
        let core = last.parse::<usize>().unwrap() + 1;
        // A CPU set names cores below 1024; past that the pinning call itself panics.
        assert!(core < 1024, "no core id left to test a refusal with ({possible:?})");
        core
    }

    /// A core the process may run on takes the pin; one that does not exist is refused and
    /// reported.
    #[test]
    fn a_refused_pin_is_reported() {
        let (allowed, nonexistent) = (available_cores()[0], nonexistent_core());
        let pins = std::thread::spawn(move || {
            (pin_load_thread(nonexistent, "test"), pin_load_thread(allowed, "test"))
        })
        .join()
        .unwrap();
        assert_eq!(pins, (false, true), "core {nonexistent} refused, core {allowed} taken");
    }

    /// The coordinator's pin counts as refused when its thread is not on the core asked, and
    /// never in a shared run.
    #[test]
    fn a_coordinator_off_its_core_counts_as_a_refused_pin() {
        let cores = Placement::Isolated.cores(&[0, 1]).unwrap();
        assert!(!coordinator_pin_refused(Some(&cores), Some(1)));
        assert!(coordinator_pin_refused(Some(&cores), None));
        assert!(coordinator_pin_refused(Some(&cores), Some(0)));
        assert!(!coordinator_pin_refused(None, None));
    }

    #[test]
    fn one_core_or_shared_places_nothing() {
        assert_eq!(Placement::Isolated.cores(&[3]), None);
        assert_eq!(Placement::Isolated.cores(&[]), None);
        assert_eq!(Placement::Shared.cores(&[0, 1]), None);
        assert_eq!(name(None, 0), "shared");
        assert_eq!(name(None, 2), "shared");
    }
}
