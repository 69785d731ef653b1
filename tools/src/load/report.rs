//! The figures a workload measures, and how they are printed.
//!
//! JSON contract (one object per measured figure, one per line, with `--json`): the keys
//! `workload`, `messages`, `seconds`, `msgs_per_sec`, `p50_ns`, `p99_ns`, `p999_ns` always (null
//! where not measured); `baseline`, `baseline_msgs_per_sec`, `ratio` (ours / baseline) where a
//! baseline ran; `core_round_trip_ns`, the machine's core-to-core round trip probed just before
//! and just after the runs the figure comes from, its own and its baseline's (`[before, after]`,
//! module `machine`: it tells which of the machine's modes a figure was measured in); plus
//! workload-specific keys (`extra`).
//!
//! The JSON keeps every number at full precision; the human table prints the extra keys in
//! human units (times, rates, 4 significant digits), a key's three percentiles together.
//! Latency histograms lose no sample ([`latency_histogram`]).
//!
//! What the baselines and latencies are, where that is easy to misread:
//! * `epoch`: `p50_ns`.. (the table's p50/p99/p99.9 columns) are from just before the
//!   `send_iter` call whose batch carries an epoch's last message (the batch's messages are
//!   made inside it) to the epoch's commit in memory, not to its commit being durable (the
//!   run's end waits for that); `--durability group|every` runs add `durable_p50_ns`.. (in the
//!   table, `durable_p50/p99/p99.9`) up to the commit record being seen durable, and the key
//!   `latency` says which is which. In a backlogged run that latency is mostly the tool's own
//!   flow-control window (`--window`): the wait behind the messages it lets queue. The
//!   `reference (direct)` baseline runs the reference model in memory on this thread, on a
//!   prefix of the stream, also for `--durability group|every` runs: compare a durable run
//!   with in-memory runs instead, `--baseline memory` (`in-memory bus`: the mean of the
//!   in-memory bus runs just before and just after the durable one, same stream, same
//!   process; also `ratio_to_memory`, `memory_msgs_per_sec`).
//! * `wal`: the every-record baseline runs as many threads as the figure, each writing and
//!   fdatasyncing its own records; the group-commit baseline syncs 4 MiB batches, larger than
//!   the log's own groups.
//! * `blocks`: no baseline runs; the `spark_*` keys are Spark's published rates
//!   (`../shared/ANCHORS.md`).
//! * `state-store/deactivate`: ours is the median of several rounds, the baseline one cold
//!   measurement.

use hdrhistogram::Histogram;
use serde_json::{json, Map, Value};

/// The largest sample a [`latency_histogram`] holds without growing: 60 s, in nanoseconds.
const PRESIZED_MAX_NS: u64 = 60_000_000_000;

/// A histogram of latencies in nanoseconds (3 significant digits) that loses no sample. It is
/// sized up front for 1 ns ..= 60 s, so recording a sample in that range never allocates on a
/// measured path, and grows past it (auto-resize) for a longer one, which is then recorded as
/// it is: a histogram that dropped it, or clamped it to its bound, would understate the max
/// and the high percentiles of exactly the runs that went wrong. Growing costs nothing per
/// sample: the bounds check that decides it is the one every record makes.
pub fn latency_histogram() -> Histogram<u64> {
    let mut histogram =
        Histogram::new_with_bounds(1, PRESIZED_MAX_NS, 3).expect("constant, valid bounds");
    histogram.auto(true);
    histogram
}

/// Records `ns` in a [`latency_histogram`].
///
/// # Panics
/// If the histogram is not auto-resizing: one that is takes any `u64` (it could only fail to
/// grow past what a `usize` indexes, not on a 64-bit machine).
#[inline]
pub fn record_latency(histogram: &mut Histogram<u64>, ns: u64) {
    histogram.record(ns).expect("an auto-resizing histogram records any value");
}

/// Latency percentiles in nanoseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Percentiles {
    pub p50_ns: Option<u64>,
    pub p99_ns: Option<u64>,
    pub p999_ns: Option<u64>,
}

impl Percentiles {
    pub fn from_histogram(histogram: &Histogram<u64>) -> Self {
        if histogram.is_empty() {
            return Self::default();
        }
        Self {
            p50_ns: Some(histogram.value_at_quantile(0.50)),
            p99_ns: Some(histogram.value_at_quantile(0.99)),
            p999_ns: Some(histogram.value_at_quantile(0.999)),
        }
    }
}

/// A baseline measured in the same run on the same workload.
#[derive(Debug, Clone)]
pub struct Baseline {
    pub name: String,
    pub msgs_per_sec: f64,
}

/// One measured figure.
#[derive(Debug, Clone)]
pub struct Figure {
    pub workload: String,
    pub messages: u64,
    pub seconds: f64,
    pub latency: Percentiles,
    pub baseline: Option<Baseline>,
    /// Workload-specific keys, printed after the common ones.
    pub extra: Map<String, Value>,
}

impl Figure {
    pub fn new(workload: impl Into<String>, messages: u64, seconds: f64) -> Self {
        Self {
            workload: workload.into(),
            messages,
            seconds,
            latency: Percentiles::default(),
            baseline: None,
            extra: Map::new(),
        }
    }

    pub fn msgs_per_sec(&self) -> f64 {
        if self.seconds > 0.0 {
            self.messages as f64 / self.seconds
        } else {
            0.0
        }
    }

    pub fn with_latency(mut self, latency: Percentiles) -> Self {
        self.latency = latency;
        self
    }

    pub fn with_baseline(mut self, name: impl Into<String>, msgs_per_sec: f64) -> Self {
        self.baseline = Some(Baseline { name: name.into(), msgs_per_sec });
        self
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.to_owned(), value.into());
        self
    }

    /// Attaches an endpoint's counters under `key` when `--stats` is on.
    pub fn with_endpoint_stats(self, key: &str, stats: &coordbus::EndpointStats) -> Self {
        if !crate::stats_enabled() {
            return self;
        }
        let time = &stats.handler_time;
        self.with(
            key,
            json!({
                "received": stats.received,
                "handled": stats.handled,
                "failed": stats.failed,
                "panicked": stats.panicked,
                "hook_panics": stats.hook_panics,
                "inbox_depth": stats.inbox_depth,
                "inbox_depth_high_water": stats.inbox_depth_high_water,
                "handler_time_samples": time.samples,
                "handler_time_p50_ns_at_most": time.p50_ns_at_most,
                "handler_time_p99_ns_at_most": time.p99_ns_at_most,
                "handler_time_max_ns_at_most": time.max_ns_at_most,
                "pinned_core": stats.pinned_core,
                "dropped": stats.dropped,
                "dropped_by_reason": stats
                    .dropped_by_reason
                    .iter()
                    .map(|dropped| (dropped.reason.to_owned(), json!(dropped.count)))
                    .collect::<serde_json::Map<_, _>>(),
            }),
        )
    }

    /// Attaches a WAL's counters under `key` when `--stats` is on.
    pub fn with_wal_stats(self, key: &str, stats: &coordbus::wal::WalStats) -> Self {
        if !crate::stats_enabled() {
            return self;
        }
        self.with(
            key,
            json!({
                "appends": stats.appends,
                "bytes": stats.bytes,
                "groups": stats.groups,
                "led_groups": stats.led_groups,
                "syncs": stats.syncs,
                "sync_p50_us": stats.sync_p50_us,
                "sync_p99_us": stats.sync_p99_us,
                "appended_lsn": stats.appended_lsn.0,
                "durable_lsn": stats.durable_lsn.0,
                "durable_lag_records": stats.appended_lsn.0.saturating_sub(stats.durable_lsn.0),
                "segments": stats.segments,
                "cleaned_segments": stats.cleaned_segments,
                "recycled_segments": stats.recycled_segments,
                "spare_segments": stats.spare_segments,
                "writer_wakeups": stats.writer_wakeups,
                "paced_groups": stats.paced_groups,
                "io_path": stats.io_path.map(|path| path.as_str()),
            }),
        )
    }

    pub fn ratio(&self) -> Option<f64> {
        self.baseline
            .as_ref()
            .filter(|baseline| baseline.msgs_per_sec > 0.0)
            .map(|baseline| self.msgs_per_sec() / baseline.msgs_per_sec)
    }

    pub fn to_json(&self) -> Value {
        let mut object = Map::new();
        object.insert("workload".into(), json!(self.workload));
        object.insert("messages".into(), json!(self.messages));
        object.insert("seconds".into(), json!(self.seconds));
        object.insert("msgs_per_sec".into(), json!(self.msgs_per_sec()));
        object.insert("p50_ns".into(), json!(self.latency.p50_ns));
        object.insert("p99_ns".into(), json!(self.latency.p99_ns));
        object.insert("p999_ns".into(), json!(self.latency.p999_ns));
        if let Some(baseline) = &self.baseline {
            object.insert("baseline".into(), json!(baseline.name));
            object.insert("baseline_msgs_per_sec".into(), json!(baseline.msgs_per_sec));
            object.insert("ratio".into(), json!(self.ratio()));
        }
        for (key, value) in &self.extra {
            object.insert(key.clone(), value.clone());
        }
        Value::Object(object)
    }
}

fn human_rate(rate: f64) -> String {
    if rate >= 1e6 {
        format!("{:.2} M/s", rate / 1e6)
    } else if rate >= 1e3 {
        format!("{:.1} k/s", rate / 1e3)
    } else {
        format!("{rate:.1} /s")
    }
}

fn human_ns(ns: Option<u64>) -> String {
    match ns {
        None => "-".into(),
        Some(ns) if ns >= 1_000_000 => format!("{:.2} ms", ns as f64 / 1e6),
        Some(ns) if ns >= 1_000 => format!("{:.2} us", ns as f64 / 1e3),
        Some(ns) => format!("{ns} ns"),
    }
}

/// The details column of the table: each key with its value in human units (times as `7.37ms`,
/// rates as `3.89M/s`, other fractions to 4 significant digits, strings unquoted unless they
/// hold a space), and a key's p50, p99 and p99.9 (`X_p50_ns`, `X_p99_ns`, `X_p999_ns`) as one
/// `X_p50/p99/p99.9=a/b/c`, in that order. The JSON keeps every key and full precision.
fn human_details(extra: &Map<String, Value>) -> String {
    const PERCENTILES: [&str; 3] = ["p50_ns", "p99_ns", "p999_ns"];
    // The `X_` of a key `X_p50_ns`, `X_p99_ns` or `X_p999_ns` whose two others are there too.
    let triple_of = |key: &str| {
        let prefix = PERCENTILES.iter().find_map(|suffix| key.strip_suffix(suffix))?;
        let whole =
            PERCENTILES.iter().all(|suffix| extra.contains_key(&(prefix.to_owned() + suffix)));
        whole.then(|| prefix.to_owned())
    };
    let mut details = Vec::new();
    for (key, value) in extra {
        match triple_of(key) {
            Some(prefix) if key.ends_with(PERCENTILES[0]) => {
                let times = PERCENTILES
                    .map(|suffix| human_ns_compact(extra[&(prefix.clone() + suffix)].as_u64()));
                details.push(format!("{prefix}p50/p99/p99.9={}", times.join("/")));
            }
            // Shown with its p50.
            Some(_) => {}
            None => details.push(human_detail(key, value)),
        }
    }
    details.join(" ")
}

/// One `key=value` of the details column (see [`human_details`]).
fn human_detail(key: &str, value: &Value) -> String {
    match value {
        Value::Number(number) => match (number.as_u64(), number.as_f64()) {
            (Some(ns), _) if key.ends_with("_ns") => {
                format!("{}={}", key.trim_end_matches("_ns"), human_ns_compact(Some(ns)))
            }
            (_, Some(rate)) if key.ends_with("_per_sec") => {
                format!("{key}={}", human_rate(rate).replace(' ', ""))
            }
            (None, Some(fraction)) if number.is_f64() => format!("{key}={}", human_f64(fraction)),
            _ => format!("{key}={number}"),
        },
        Value::String(text) if !text.contains(char::is_whitespace) => format!("{key}={text}"),
        other => format!("{key}={other}"),
    }
}

/// A time in the details column: as in the latency columns, without the space.
fn human_ns_compact(ns: Option<u64>) -> String {
    human_ns(ns).replace(' ', "")
}

/// A fraction to 4 significant digits (at most 6 decimals; whole above 1000).
fn human_f64(value: f64) -> String {
    if !value.is_finite() || value == 0.0 {
        return value.to_string();
    }
    let decimals = (3 - value.abs().log10().floor() as i32).clamp(0, 6) as usize;
    format!("{value:.decimals$}")
}

/// Prints figures: JSON lines, or one human table. Returns the write's error instead of
/// panicking (a reader that went away: `main` ends quietly then).
pub fn print(figures: &[Figure], as_json: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if as_json {
        for figure in figures {
            writeln!(out, "{}", figure.to_json())?;
        }
        return Ok(());
    }
    writeln!(
        out,
        "{:<28} {:>12} {:>10} {:>10} {:>10} {:>18} {:>8}  details",
        "workload", "ours", "p50", "p99", "p99.9", "baseline", "ratio"
    )?;
    for figure in figures {
        let baseline = figure.baseline.as_ref().map_or("-".to_owned(), |baseline| {
            format!("{} {}", baseline.name, human_rate(baseline.msgs_per_sec))
        });
        let ratio = figure.ratio().map_or("-".to_owned(), |ratio| format!("{ratio:.2}x"));
        let details = human_details(&figure.extra);
        writeln!(
            out,
            "{:<28} {:>12} {:>10} {:>10} {:>10} {:>18} {:>8}  {}",
            figure.workload,
            human_rate(figure.msgs_per_sec()),
            human_ns(figure.latency.p50_ns),
            human_ns(figure.latency.p99_ns),
            human_ns(figure.latency.p999_ns),
            baseline,
            ratio,
            details
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table's details: human units, percentile triples merged, short strings bare.
    #[test]
    fn details_are_in_human_units_with_percentiles_together() {
        let figure = Figure::new("epoch", 1, 1.0)
            .with("epochs_per_sec", 3_890_513.178_140_763)
            .with("peak_rss_mib", 38.265_625)
            .with("durable_p50_ns", 7_372_799)
            .with("durable_p99_ns", 7_442_431)
            .with("durable_p999_ns", 7_852_031)
            .with("baseline_p50_ns", 950)
            .with("durability", "group")
            .with("placement", "partly isolated")
            .with("epochs", 200)
            .with("tiny", 0.000_412_5)
            .with("core_round_trip_ns", json!([50.4, 260.7]));
        assert_eq!(
            human_details(&figure.extra),
            "baseline_p50=950ns core_round_trip_ns=[50.4,260.7] durability=group \
             durable_p50/p99/p99.9=7.37ms/7.44ms/7.85ms epochs=200 \
             epochs_per_sec=3.89M/s peak_rss_mib=38.27 placement=\"partly isolated\" \
             tiny=0.000412"
        );
        assert_eq!(figure.to_json()["epochs_per_sec"], json!(3_890_513.178_140_763));
    }

    /// A sample past the histogram's pre-sized 60 s is neither dropped nor clamped.
    #[test]
    fn a_latency_past_the_presized_range_is_recorded_as_it_is() {
        let mut histogram = latency_histogram();
        record_latency(&mut histogram, 1_000);
        let two_hours_ns = 7_200_000_000_000;
        record_latency(&mut histogram, two_hours_ns);
        assert_eq!(histogram.len(), 2);
        assert!(histogram.equivalent(histogram.max(), two_hours_ns), "{}", histogram.max());
    }

    #[test]
    fn json_has_the_contract_keys_and_the_ratio() {
        let figure =
            Figure::new("bus", 1000, 0.5).with_baseline("crossbeam", 500.0).with("producers", 2);
        let value = figure.to_json();
        for key in
            ["workload", "messages", "seconds", "msgs_per_sec", "p50_ns", "p99_ns", "p999_ns"]
        {
            assert!(value.get(key).is_some(), "missing {key}");
        }
        assert_eq!(value["msgs_per_sec"], json!(2000.0));
        assert_eq!(value["ratio"], json!(4.0));
        assert_eq!(value["p50_ns"], Value::Null);
        assert_eq!(value["producers"], json!(2));
    }
}
