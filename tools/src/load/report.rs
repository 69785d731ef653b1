//! The figures a workload measures, and how they are printed.
//!
//! JSON contract (one object per measured figure, one per line, with `--json`): the keys
//! `workload`, `messages`, `seconds`, `msgs_per_sec`, `p50_ns`, `p99_ns`, `p999_ns` always (null
//! where not measured); `baseline`, `baseline_msgs_per_sec`, `ratio` (ours / baseline) where a
//! baseline ran; `core_round_trip_ns`, the machine's core-to-core round trip probed just before
//! and just after the workload (`[before, after]`, module `machine`: it tells which of the
//! machine's modes a figure was measured in); plus workload-specific keys (`extra`).
//!
//! What the baselines and latencies are, where that is easy to misread:
//! * `epoch`: `p50_ns`.. are from an epoch's last message handed to the bus to its commit, not
//!   to its commit being durable (the run's end waits for that); `--durability group|every`
//!   runs add `durable_p50_ns`.. up to the commit record being seen durable. The
//!   `reference (direct)` baseline runs the reference model in memory on this thread, on a
//!   prefix of the stream, also for `--durability group|every` runs: compare a durable run
//!   with the in-memory run of the same sitting, not with that baseline.
//! * `wal`: the every-record baseline runs as many threads as the figure, each writing and
//!   fdatasyncing its own records; the group-commit baseline syncs 4 MiB batches, larger than
//!   the log's own groups.
//! * `blocks`: no baseline runs; the `spark_*` keys are Spark's published rates
//!   (`../shared/ANCHORS.md`).
//! * `state-store/deactivate`: ours is the median of several rounds, the baseline one cold
//!   measurement.

use hdrhistogram::Histogram;
use serde_json::{json, Map, Value};

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
        let details: Vec<String> =
            figure.extra.iter().map(|(key, value)| format!("{key}={value}")).collect();
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
            details.join(" ")
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
