//! Goal: `coordbus-load` does exactly the work its flags ask for and reports it, and ends
//! quietly when its reader goes away.
//!
//! Method: small runs of the built binary (`CARGO_BIN_EXE_coordbus-load`), bounded by a
//! timeout, checking the JSON figures' counts and the exit code.

mod support;

use std::{
    process::{Command, Stdio},
    time::Duration,
};

/// Far longer than these tiny runs take; a hang fails the test instead of CI.
const BOUND: Duration = Duration::from_secs(120);

/// The JSON figures of `coordbus-load --json args`, which must succeed.
fn figures(args: &[&str]) -> Vec<serde_json::Value> {
    let output = support::output_within(
        Command::new(env!("CARGO_BIN_EXE_coordbus-load")).arg("--json").args(args),
        BOUND,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{args:?} failed: {stderr}");
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|error| panic!("{line}: {error}")))
        .collect()
}

/// A total that does not divide among the threads is done in full: the first threads take
/// one more (it used to be rounded down to a multiple of the thread count, without a word).
/// The counts come from the work (`--stats`: what the endpoint handled, what the log took),
/// and the figure reports the same.
#[test]
fn totals_that_do_not_divide_among_the_threads_are_done_in_full() {
    let bus =
        figures(&["--stats", "bus", "--messages", "5", "--producers", "2", "--baseline", "none"]);
    assert_eq!(bus.len(), 1, "{bus:?}");
    assert_eq!(bus[0]["messages"], 5, "{bus:?}");
    // Each producer also asks once, after its messages, to learn they were handled.
    assert_eq!(bus[0]["endpoint_stats"]["handled"], 5 + 2, "{bus:?}");
    let wal = figures(&[
        "--stats",
        "wal",
        "--records",
        "3",
        "--threads",
        "2",
        "--durability",
        "none",
        "--baseline",
        "none",
        "--segment-mib",
        "1",
    ]);
    assert_eq!(wal.len(), 1, "{wal:?}");
    assert_eq!(wal[0]["messages"], 3, "{wal:?}");
    assert_eq!(wal[0]["wal_stats"]["appends"], 3, "{wal:?}");
}

/// The epoch workload with the reference baseline: the direct runs check their work (every
/// epoch committed, nothing rejected), and both figures that carry the reference's rate say
/// how far the reference got in its time budget.
#[test]
fn the_epoch_reference_baseline_says_how_far_it_got() {
    let epoch = figures(&[
        "epoch",
        "--partitions",
        "8",
        "--epochs",
        "50",
        "--producers",
        "2",
        "--baseline",
        "reference",
    ]);
    assert_eq!(epoch.len(), 2, "{epoch:?}");
    for figure in &epoch {
        assert_eq!(figure["baseline"], "reference (direct)", "{figure}");
        let messages = figure["baseline_messages"].as_u64().unwrap();
        let epochs = figure["baseline_epochs"].as_i64().unwrap();
        assert!(messages > 0 && messages <= 2 * 8 * 50, "{figure}");
        assert!((1..=50).contains(&epochs), "{figure}");
    }
    assert_eq!(epoch[1]["workload"], "epoch/state-machine", "{epoch:?}");
    assert_eq!(epoch[1]["epochs"], 50, "{epoch:?}");
}

/// `--baseline memory` brackets the durable run with two in-memory runs of the same stream in
/// the same process: the figure is the durable run's, its baseline the mean of the two
/// in-memory rates, and its ratio the durable rate over that mean, under both the common keys
/// and the memory ones; the figure carries its core probes.
#[test]
fn the_epoch_memory_baseline_is_the_mean_of_two_in_memory_runs_around_the_durable_one() {
    let epoch = figures(&[
        "epoch",
        "--partitions",
        "8",
        "--epochs",
        "50",
        "--durability",
        "every",
        "--baseline",
        "memory",
    ]);
    assert_eq!(epoch.len(), 1, "{epoch:?}");
    let figure = &epoch[0];
    assert_eq!((&figure["workload"], &figure["durability"]), (&"epoch".into(), &"every".into()));
    assert_eq!(figure["baseline"], "in-memory bus", "{figure}");
    assert_eq!(figure["epochs"], 50, "{figure}");
    let rate = |key: &str| figure[key].as_f64().unwrap_or_else(|| panic!("{key}: {figure}"));
    let mean = (rate("memory_before_msgs_per_sec") + rate("memory_after_msgs_per_sec")) / 2.0;
    assert!(mean > 0.0, "{figure}");
    for key in ["memory_msgs_per_sec", "baseline_msgs_per_sec"] {
        assert!((rate(key) - mean).abs() <= mean * 1e-9, "{key}: {figure}");
    }
    let ratio = rate("msgs_per_sec") / mean;
    for key in ["ratio_to_memory", "ratio"] {
        assert!((rate(key) - ratio).abs() <= ratio * 1e-9, "{key}: {figure}");
    }
    for key in ["memory_before_p50_ns", "memory_after_p50_ns", "durable_p50_ns"] {
        assert!(figure[key].is_u64(), "{key}: {figure}");
    }
    assert!(figure["core_round_trip_ns"].is_array(), "{figure}");
    assert!(figure.get("baseline_messages").is_none(), "no reference ran: {figure}");
}

/// A window wider than the run is no more than the run: with several producers it is not
/// held against the backlog limit past the run's epochs (2001 x 1000 entries would exceed the
/// default limit of 1 000 000; 21 x 1000 do not).
#[test]
fn a_window_wider_than_the_run_counts_as_the_run() {
    let epoch = figures(&[
        "epoch",
        "--partitions",
        "1000",
        "--producers",
        "2",
        "--epochs",
        "20",
        "--window",
        "2000",
        "--baseline",
        "none",
    ]);
    assert_eq!(epoch.len(), 1, "{epoch:?}");
    assert_eq!(epoch[0]["epochs"], 20, "{epoch:?}");
}

/// `--records` is the throughput modes' total: with only `--durability every` (which counts
/// `--every-records` per thread) it is not checked against the thread count.
#[test]
fn the_every_record_mode_does_not_check_the_throughput_total() {
    let every = figures(&[
        "wal",
        "--durability",
        "every",
        "--threads",
        "4",
        "--records",
        "2",
        "--every-records",
        "1",
        "--baseline",
        "none",
        "--segment-mib",
        "1",
    ]);
    assert_eq!(every.len(), 1, "{every:?}");
    assert_eq!(every[0]["threads"], 4, "{every:?}");
}

/// Output into a reader that went away (`| head`) ends the run quietly: exit code 0, no panic
/// on the closed pipe.
#[test]
fn the_load_tool_ends_quietly_when_its_reader_goes_away() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_coordbus-load"))
        .args(["bus", "--messages", "2", "--producers", "1", "--baseline", "none"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Closed before the run prints anything.
    drop(child.stdout.take());
    let output = support::wait_within(child, BOUND);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(0), "{stderr}");
}

/// `coordbus-load args` (no `--json`): its table, which must succeed.
fn table(args: &[&str]) -> String {
    let output =
        support::output_within(Command::new(env!("CARGO_BIN_EXE_coordbus-load")).args(args), BOUND);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{args:?} failed: {stderr}");
    String::from_utf8(output.stdout).unwrap()
}

/// A durable epoch run with `--dir` and `--keep` leaves its log in a fresh directory inside
/// `--dir`, named in the figure, which `coordbus-wal` reads as healthy; it names the WAL's
/// settings and what its latencies time. Without `--keep` nothing is left. An in-memory run
/// names no WAL setting, and reports its own peak memory.
#[test]
fn a_durable_epoch_run_keeps_its_log_where_asked_and_names_what_applied() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().to_str().unwrap();
    let small = ["epoch", "--partitions", "8", "--epochs", "50", "--baseline", "none"];
    let durable: Vec<&str> =
        small.iter().chain(&["--durability", "group", "--dir", dir]).copied().collect();
    let kept = figures(&[&durable[..], &["--keep", "--sync-nice", "3"]].concat());
    let wal_dir = kept[0]["wal_dir"].as_str().unwrap_or_else(|| panic!("{kept:?}"));
    assert!(std::path::Path::new(wal_dir).starts_with(parent.path()), "{wal_dir}");
    let verify = support::output_within(
        Command::new(env!("CARGO_BIN_EXE_coordbus-wal")).args(["verify", wal_dir]),
        BOUND,
    );
    assert_eq!(verify.status.code(), Some(0), "{verify:?}");
    assert_eq!((&kept[0]["sync_nice"], &kept[0]["group_delay_us"]), (&3.into(), &200.into()));
    assert!(kept[0]["latency"].as_str().unwrap().contains("in memory"), "{kept:?}");
    std::fs::remove_dir_all(wal_dir).unwrap();

    let removed = figures(&durable);
    assert!(removed[0].get("wal_dir").is_none(), "{removed:?}");
    assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 0, "left behind");

    let in_memory = figures(&small);
    for key in ["sync_nice", "group_delay_us", "wal_dir", "seed"] {
        assert!(in_memory[0].get(key).is_none(), "{key}: {in_memory:?}");
    }
    match in_memory[0].get("peak_rss_mib") {
        Some(peak) => {
            let start = in_memory[0]["rss_at_start_mib"].as_f64().unwrap();
            assert!(peak.as_f64().unwrap() >= start, "{in_memory:?}");
        }
        // A system that refuses the reset: the process's peak, named as such.
        None => assert!(in_memory[0]["process_peak_rss_mib"].as_f64().is_some(), "{in_memory:?}"),
    }
}

/// The table's details are in human units: no float printed to full precision, the durable
/// commit latency as one `durable_p50/p99/p99.9` detail, and what the latency columns time.
#[test]
fn the_table_prints_details_in_human_units() {
    let table = table(&[
        "epoch",
        "--partitions",
        "8",
        "--epochs",
        "50",
        "--baseline",
        "none",
        "--durability",
        "every",
    ]);
    let row = table.lines().find(|line| line.starts_with("epoch ")).unwrap();
    for detail in row.split_whitespace() {
        let decimals = detail
            .rsplit_once('.')
            .map_or(0, |(_, fraction)| fraction.chars().take_while(char::is_ascii_digit).count());
        assert!(decimals <= 6, "{detail} in {row}");
    }
    assert!(row.contains("durable_p50/p99/p99.9="), "{row}");
    assert!(row.contains("epochs_per_sec=") && row.contains("/s "), "{row}");
    assert!(row.contains("latency=\"last batch sent -> commit, in memory"), "{row}");
}
