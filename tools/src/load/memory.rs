//! Peak resident memory of one workload's run (`peak_rss_mib`).
//!
//! Linux keeps one high-water mark of resident memory per process (`VmHWM` in
//! `/proc/self/status`). In the no-argument run every workload shares the process, so the mark
//! read at the end of a run is the largest of every workload run so far (177 MiB for the epoch
//! workload, which alone peaks near 34 MiB). Writing `5` to `/proc/self/clear_refs` (Linux 4.0
//! on) resets the mark to the memory resident now, so [`PeakRss::reset`] just before a run
//! makes the mark read after it the peak during that run: earlier workloads' peaks no longer
//! count. What the process still holds when the run begins does, which `rss_at_start_mib`
//! says. Memory that earlier workloads freed is given back to the system first (mimalloc's
//! `mi_collect`): without that, mimalloc kept about 90 MiB of it resident for reuse in the
//! no-argument run, and the epoch workload's peak read 100 MiB there against 34 MiB alone.
//! Now both read about the same (`rss_at_start_mib` 11-13 MiB). The peak is everything the
//! run holds, the tool's own bookkeeping included: the epoch workload's per-epoch timestamps
//! (16 or 24 bytes an epoch) grow it with `--epochs` (its module doc).
//!
//! Where the reset is refused (not Linux, a `/proc` without `clear_refs`), the mark stays the
//! process's: the figure then carries it as `process_peak_rss_mib`, never as `peak_rss_mib`, and
//! a line on stderr says why. Where the mark cannot be read at all, neither key is reported.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::report::Figure;

/// The high-water mark, reset at the start of a run. One measurement at a time in a process
/// (a second reset would cut the first's peak short): it holds [`MEASURING`] until it is
/// added to its figure, and a second waits for that.
#[derive(Debug)]
pub struct PeakRss {
    /// Why the mark could not be reset (`None`: it was).
    reset_refused: Option<String>,
    /// Resident memory right after the reset, in MiB.
    rss_at_start_mib: Option<f64>,
    _measuring: MutexGuard<'static, ()>,
}

/// Held by the [`PeakRss`] measuring now (workloads run one at a time; tests may not).
static MEASURING: Mutex<()> = Mutex::new(());

impl PeakRss {
    /// Resets the process's high-water mark, so that [`PeakRss::add_to`] reports the peak from
    /// now on; says on stderr (naming `workload`) if the system refuses. Waits while another
    /// measurement runs.
    pub fn reset(workload: &str) -> Self {
        let measuring = MEASURING.lock().unwrap_or_else(PoisonError::into_inner);
        return_freed_memory();
        let reset_refused = std::fs::write("/proc/self/clear_refs", "5").err().map(|error| {
            let why = format!("writing /proc/self/clear_refs: {error}");
            eprintln!(
                "{workload} workload: could not reset the peak resident memory mark ({why}); \
                 reporting the whole process's peak as process_peak_rss_mib"
            );
            why
        });
        Self { reset_refused, rss_at_start_mib: status_mib("VmRSS:"), _measuring: measuring }
    }

    /// Adds the peak since [`PeakRss::reset`] to `figure` (see the module doc for the keys).
    pub fn add_to(self, figure: Figure) -> Figure {
        let Some(peak) = status_mib("VmHWM:") else {
            return figure;
        };
        match self.reset_refused {
            None => {
                let figure = figure.with("peak_rss_mib", peak);
                match self.rss_at_start_mib {
                    Some(start) => figure.with("rss_at_start_mib", start),
                    None => figure,
                }
            }
            Some(why) => {
                figure.with("process_peak_rss_mib", peak).with("peak_rss_reset_refused", why)
            }
        }
    }
}

/// Gives the memory that earlier workloads freed, and the allocator kept for reuse, back to
/// the system, so that it is not resident (and counted in the peak) when a run begins.
#[allow(unsafe_code)]
fn return_freed_memory() {
    // SAFETY: `mi_collect` has no preconditions: mimalloc documents it as callable from any
    // thread at any time (it only frees what no live allocation uses); `force` asks it to
    // give back all it can, not only what is cheap to.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

/// A `kB` field of `/proc/self/status` (`VmHWM:`, `VmRSS:`), in MiB; `None` if unknown.
fn status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status.lines().find_map(|line| line.strip_prefix(field))?;
    let kib = kib.split_whitespace().next()?.parse::<f64>().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Touches `BYTES` on a thread's stack of its own, and ends the thread: a stack this large
    /// is its own mapping, unmapped as the thread ends (a freed heap block could stay
    /// resident in the global allocator, and hide what the reset does).
    fn touch_and_give_back<const BYTES: usize>() {
        std::thread::Builder::new()
            .stack_size(2 * BYTES + (16 << 20))
            .spawn(|| {
                // Filled in place: every page is written.
                let mut block = [1u8; BYTES];
                std::hint::black_box(&mut block);
            })
            .unwrap()
            .join()
            .unwrap();
    }

    /// A peak before the reset (memory touched, then given back) does not count after it,
    /// and memory touched after it does. Measured while no other measurement runs (a first
    /// one holds the others off while the earlier peak is made and read); the margins allow
    /// for the other tests running beside it. Skipped, saying so, where the system refuses
    /// the reset (the figure then names the process's peak: `add_to`).
    #[test]
    fn the_reset_drops_an_earlier_peak_and_tracks_the_next() {
        let holding_off_others = PeakRss::reset("test");
        if let Some(why) = &holding_off_others.reset_refused {
            eprintln!("skipping: the system refuses the reset ({why})");
            return;
        }
        touch_and_give_back::<{ 192 << 20 }>();
        let before = status_mib("VmHWM:").expect("Linux reports VmHWM");
        drop(holding_off_others);
        let peak = PeakRss::reset("test");
        touch_and_give_back::<{ 64 << 20 }>();
        let figure = peak.add_to(Figure::new("test", 1, 1.0)).to_json();
        let (after, start) = (&figure["peak_rss_mib"], &figure["rss_at_start_mib"]);
        let (after, start) = (after.as_f64().unwrap(), start.as_f64().unwrap());
        assert!(after + 96.0 < before, "peak {after} MiB after the reset, {before} MiB before");
        assert!(after >= start + 60.0, "{figure}: the block touched after the reset counts");
    }
}
