//! The machine's state around a run: how long a cache line takes to travel from one core to
//! another and back.
//!
//! Why: every workload of this tool moves messages between threads, so its rate is bound by
//! cache-line transfers between cores. On the shared 2-vCPU virtual machines coordbus is
//! measured on, that transfer time is not a constant: the host places the two vCPUs on two
//! hardware threads of one core (a round trip of about 30 ns), close together (about 60 ns) or
//! far apart (about 370 ns), and moves them from one run to the next. The same binary then
//! reads 100 or 30 M msgs/s. Reporting the round trip measured just before and just after each
//! run tells which placement a figure was taken in, so that figures (and the ratios between
//! them) are compared within one placement instead of across them. See PERF.md, "Machine and
//! method"; `tools/scripts/perf-summary.py` classifies the probes.
//!
//! The probe: two threads pinned to the first two cores pass one counter back and forth
//! ([`ROUND_TRIPS`] times after a warm-up, at most [`PROBE_TIME_LIMIT`] in all).
//!
//! Where: each workload brackets exactly the runs a figure's rate and ratio come from
//! ([`with_round_trips`]): its own run and its baseline's, which most workloads time back to
//! back. Not the set-up before them (a log written only to be scanned), nor the runs of the
//! workload's other figures where they can be told apart. The `epoch` workload's bus figure
//! carries the probes around its bus run (with `--baseline memory`, its three bus runs; with
//! `--baseline reference`, up to the end of the reference model's direct run, its ratio's
//! baseline), and its `epoch/state-machine` figure its own probes around the direct runs,
//! which come after and take seconds. Two pairs of figures share one bracket, their runs
//! being one: `wal-recover`'s open and iterate phases (which alternate per repeat), and the
//! block tracker's `blocks/recover` and `blocks/allocate` (allocation follows the recovery it
//! measures on the same tracker).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use crossbeam_utils::CachePadded;

use crate::report::Figure;

/// Round trips timed per probe (after [`WARM_UP_ROUND_TRIPS`]).
pub const ROUND_TRIPS: u64 = 20_000;
/// Round trips run before the timed ones (the threads start, the line settles).
const WARM_UP_ROUND_TRIPS: u64 = 1_000;
/// Longest a probe runs: on a machine too busy to give both threads a core at once, the probe
/// stops there and reports the round trips it timed.
pub const PROBE_TIME_LIMIT: Duration = Duration::from_millis(200);
/// The counter's value that tells the answering thread to stop.
const STOP: u64 = u64::MAX;

/// The mean time, in nanoseconds, for a cache line to go from the first core to the second and
/// back; `None` on a machine with fewer than two cores, when the threads cannot be pinned, or
/// when not a single round trip was timed within [`PROBE_TIME_LIMIT`].
pub fn core_round_trip_ns() -> Option<f64> {
    let cores = core_affinity::get_core_ids()?;
    let (&first, &second) = (cores.first()?, cores.get(1)?);
    let counter = CachePadded::new(AtomicU64::new(0));
    std::thread::scope(|scope| {
        let answering = scope.spawn(|| {
            let pinned = core_affinity::set_for_current(second);
            answer(&counter);
            pinned
        });
        // Both ends on threads of their own: pinning the caller would pin every thread it
        // spawns afterwards (they inherit its affinity).
        let asking = scope.spawn(|| {
            let pinned = core_affinity::set_for_current(first);
            (pinned, ask(&counter))
        });
        let (ask_pinned, measured) = asking.join().unwrap_or((false, None));
        let answer_pinned = answering.join().unwrap_or(false);
        measured.filter(|_| ask_pinned && answer_pinned)
    })
}

/// Sends odd values and waits for each to come back one higher; always ends by storing
/// [`STOP`]. Returns the mean round trip of the timed part.
fn ask(counter: &AtomicU64) -> Option<f64> {
    let deadline = Instant::now() + PROBE_TIME_LIMIT;
    let mut timed_since = None;
    let mut timed = 0u64;
    for trip in 0..WARM_UP_ROUND_TRIPS + ROUND_TRIPS {
        if trip == WARM_UP_ROUND_TRIPS {
            timed_since = Some(Instant::now());
        }
        let sent = 2 * trip + 1;
        counter.store(sent, Ordering::Release);
        if !wait_for(counter, sent + 1, deadline) {
            break;
        }
        if timed_since.is_some() {
            timed += 1;
        }
    }
    counter.store(STOP, Ordering::Release);
    let elapsed = timed_since?.elapsed();
    (timed > 0).then(|| elapsed.as_nanos() as f64 / timed as f64)
}

/// Spins until `counter` holds `expected`; `false` once `deadline` passed (checked every 1024
/// spins, so a probe on an overloaded machine still ends).
fn wait_for(counter: &AtomicU64, expected: u64, deadline: Instant) -> bool {
    let mut spins = 0u32;
    while counter.load(Ordering::Acquire) != expected {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) && Instant::now() >= deadline {
            return false;
        }
    }
    true
}

/// Answers every odd value with the next even one until [`STOP`].
fn answer(counter: &AtomicU64) {
    let mut last_answered = 0;
    loop {
        let value = counter.load(Ordering::Acquire);
        if value == STOP {
            return;
        }
        if value % 2 == 1 && value > last_answered && reply(counter, value) {
            last_answered = value + 1;
        }
        std::hint::spin_loop();
    }
}

/// Answers `value` with `value + 1` unless the counter changed since it was read: the asker
/// may have given up at its deadline and stored [`STOP`] meanwhile, and a plain store would
/// overwrite it and leave this thread spinning forever (the asker is gone) and the caller
/// waiting for it. Returns whether it answered.
fn reply(counter: &AtomicU64, value: u64) -> bool {
    counter.compare_exchange(value, value + 1, Ordering::AcqRel, Ordering::Acquire).is_ok()
}

/// The probe before and after a run, as the JSON value the figures carry
/// (`[before, after]`, nanoseconds, `null` where not measured).
pub fn round_trips_json(before: Option<f64>, after: Option<f64>) -> serde_json::Value {
    let rounded = |ns: Option<f64>| ns.map(|ns| (ns * 10.0).round() / 10.0);
    serde_json::json!([rounded(before), rounded(after)])
}

/// The key under which a figure carries the probes.
pub const ROUND_TRIPS_KEY: &str = "core_round_trip_ns";

/// Runs `measured` between two probes; returns what it returned and the probes as the JSON
/// value a figure carries ([`round_trips_json`]).
pub fn bracket<T>(
    measured: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(T, serde_json::Value)> {
    let before = core_round_trip_ns();
    let value = measured()?;
    let after = core_round_trip_ns();
    Ok((value, round_trips_json(before, after)))
}

/// Runs `measured`, the runs of one figure (its own and its baseline's), between two probes
/// and adds them to the figure as [`ROUND_TRIPS_KEY`] (module doc: what to bracket).
pub fn with_round_trips(
    measured: impl FnOnce() -> anyhow::Result<Figure>,
) -> anyhow::Result<Figure> {
    let (figure, round_trips) = bracket(measured)?;
    Ok(figure.with(ROUND_TRIPS_KEY, round_trips))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probes of these tests spin on both cores: run one at a time, or two pinned pairs
    /// share the cores and neither gets its round trips done in time.
    static ONE_PROBE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        ONE_PROBE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Probes a busy machine may leave unmeasured (`None`) before the test calls it broken.
    const PROBE_TRIES: usize = 10;

    #[test]
    fn the_probe_measures_a_plausible_round_trip_or_explains_why_not() {
        let _alone = one_at_a_time();
        let cores = core_affinity::get_core_ids().map_or(0, |cores| cores.len());
        if cores < 2 {
            assert_eq!(core_round_trip_ns(), None, "one core: nothing to measure");
            return;
        }
        // On shared vCPUs (another process spinning, steal time) one probe may not get its
        // round trips done within its limit, which is what `None` says; not ten in a row.
        let ns = (0..PROBE_TRIES)
            .find_map(|_| core_round_trip_ns())
            .expect("two cores to pin: the probe times at least one round trip");
        // A round trip is at least a few nanoseconds and, even with both threads sharing a
        // core, at most the probe's time limit.
        assert!(ns > 1.0 && ns < PROBE_TIME_LIMIT.as_nanos() as f64, "round trip {ns} ns");
    }

    #[test]
    fn the_probe_leaves_the_callers_cores_as_they_were() {
        let _alone = one_at_a_time();
        let before = core_affinity::get_core_ids();
        let _ = core_round_trip_ns();
        assert_eq!(
            core_affinity::get_core_ids(),
            before,
            "threads spawned after a probe must run where they ran before it"
        );
    }

    #[test]
    fn a_probe_that_nobody_answers_ends_at_its_deadline() {
        let _alone = one_at_a_time();
        let counter = AtomicU64::new(0);
        let started = Instant::now();
        assert_eq!(ask(&counter), None, "no answer: no round trip timed");
        assert_eq!(counter.load(Ordering::Relaxed), STOP, "the asker always leaves STOP");
        // Ends: at its deadline, not before; the upper bound is only "it ended" (a loaded
        // machine may deschedule the spinning asker past its deadline for a while).
        let took = started.elapsed();
        assert!(took >= PROBE_TIME_LIMIT && took < Duration::from_secs(30), "took {took:?}");
    }

    /// The race that hung a probe: the answerer read an odd value, the asker gave up at its
    /// deadline and stored STOP, then the answer came. It must not overwrite STOP.
    #[test]
    fn an_answer_that_comes_after_the_asker_gave_up_leaves_stop() {
        let counter = AtomicU64::new(STOP);
        assert!(!reply(&counter, 7), "the value read (7) is gone: no answer");
        assert_eq!(counter.load(Ordering::Relaxed), STOP);
        // And the answering thread then ends, seeing STOP.
        answer(&counter);
        let counter = AtomicU64::new(7);
        assert!(reply(&counter, 7));
        assert_eq!(counter.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn the_json_value_rounds_and_keeps_missing_probes_null() {
        assert_eq!(round_trips_json(Some(61.234), None), serde_json::json!([61.2, null]));
    }
}
