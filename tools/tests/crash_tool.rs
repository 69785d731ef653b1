//! Goal: the built `coordbus-crash` binary runs its kill -9 loops, reports nothing lost in its
//! JSON summary, cleans up its work directory, and exits non-zero (keeping and naming the
//! failing image) when a loss is provoked.
//!
//! Method: run the binary (`CARGO_BIN_EXE_coordbus-crash`) with small iteration counts and a
//! fixed seed, with `--dir` inside a test temp directory so that nothing is left behind, parse
//! the one JSON object it prints, and check the counts (the `wal` target's torn tails too).
//! The loss case uses the hidden `--inject-loss` flag, which cuts the log just before the last
//! acknowledged record before the parent checks it.

mod support;

use std::{path::Path, process::Command, time::Duration};

use serde_json::Value;

/// Far longer than the small runs below take (a few seconds); a run past it has hung, and
/// fails the test instead of hanging CI.
const BOUND: Duration = Duration::from_secs(300);

fn crash(args: &[&str], parent: &Path) -> (Option<i32>, Value, String) {
    let output = support::output_within(
        Command::new(env!("CARGO_BIN_EXE_coordbus-crash"))
            .args(args)
            .args(["--json", "--seed", "7", "--dir"])
            .arg(parent),
        BOUND,
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let summary: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|error| panic!("one JSON object ({error}): {stdout:?} / {stderr:?}"));
    (output.status.code(), summary, stderr)
}

fn entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

fn assert_nothing_lost(target: &str, iterations: u64) -> Value {
    let parent = tempfile::tempdir().unwrap();
    let (code, summary, stderr) =
        crash(&["--target", target, "--iterations", &iterations.to_string()], parent.path());
    assert_eq!(code, Some(0), "{summary} / {stderr}");
    assert_eq!(summary["target"], target);
    assert_eq!(summary["iterations"], iterations);
    assert!(summary["acked"].as_u64().unwrap() >= iterations, "each child acknowledged work");
    for key in ["lost", "duplicated", "corrupt_accepted", "out_of_order", "open_failures"] {
        assert_eq!(summary[key], 0, "{key}: {summary}");
    }
    // Every child named its I/O path, and kills hit the pwrite path (io_uring too, where the
    // kernel allows it).
    let on = |key: &str| summary[key].as_u64().unwrap_or(0);
    assert_eq!(on("iterations_io_uring") + on("iterations_pwrite"), iterations, "{summary}");
    assert!(on("iterations_pwrite") >= 1, "{summary}");
    let p50 = summary["recovery_p50_ms"].as_f64().unwrap();
    let max = summary["recovery_max_ms"].as_f64().unwrap();
    assert!(p50 > 0.0 && p50 <= max, "{summary}");
    assert_eq!(summary["kept_dir"], Value::Null);
    assert_eq!(entries(parent.path()), 0, "the work directory was removed");
    summary
}

#[test]
fn wal_kill_loop_loses_nothing_and_cleans_up() {
    assert_nothing_lost("wal", 12);
}

/// In every third iteration the parent tears the tail after the last acknowledged record
/// (zeros or garbage); recovery loses nothing acknowledged, and the tool counts garbage left
/// uncut (outside a recycled segment) as `corrupt_accepted`, which must stay 0. Eight tears
/// are tried; one finds nothing to tear only when the kill came just after a roll (a later
/// segment exists) or the acknowledged record ends its file (when nothing was written after
/// it, garbage follows it directly).
#[test]
fn wal_tails_torn_after_kills_are_cut_without_loss() {
    let summary = assert_nothing_lost("wal", 24);
    assert!(summary["tails_torn"].as_u64().unwrap_or(0) >= 1, "no tail was torn: {summary}");
}

#[test]
fn epoch_kill_loop_loses_nothing_and_cleans_up() {
    assert_nothing_lost("epoch", 8);
}

#[test]
fn blocks_kill_loop_loses_nothing_and_cleans_up() {
    assert_nothing_lost("blocks", 8);
}

fn assert_injected_loss_detected(target: &str, subdir: &str) {
    let parent = tempfile::tempdir().unwrap();
    let (code, summary, stderr) =
        crash(&["--target", target, "--iterations", "5", "--inject-loss"], parent.path());
    assert_eq!(code, Some(1), "{summary} / {stderr}");
    assert!(summary["lost"].as_u64().unwrap() >= 1, "{summary}");
    assert_eq!(summary["passed"], false);
    // The run stops at the failing iteration and keeps its directory, named on stderr.
    assert_eq!(summary["iterations"], 1);
    let kept = summary["kept_dir"].as_str().expect("a kept directory");
    assert!(Path::new(kept).join(subdir).is_dir(), "{kept}");
    assert!(stderr.contains(kept), "{stderr}");
}

#[test]
fn injected_wal_loss_fails_the_run_and_keeps_the_image() {
    assert_injected_loss_detected("wal", "wal");
}

#[test]
fn injected_epoch_loss_fails_the_run_and_keeps_the_image() {
    assert_injected_loss_detected("epoch", "epoch");
}

#[test]
fn injected_block_loss_fails_the_run_and_keeps_the_image() {
    assert_injected_loss_detected("blocks", "blocks");
}

/// A child that cannot open its directory says so with its own exit code (3), which the
/// parent counts in `open_failures`, instead of the tool error's 2.
#[test]
fn a_child_that_cannot_open_its_directory_exits_with_the_open_failure_code() {
    let work = tempfile::tempdir().unwrap();
    // The log's directory is a regular file.
    std::fs::write(work.path().join("wal"), b"not a directory").unwrap();
    let output = support::output_within(
        Command::new(env!("CARGO_BIN_EXE_coordbus-crash"))
            .args(["child", "--target", "wal", "--seed", "7", "--iteration", "0", "--dir"])
            .arg(work.path()),
        BOUND,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("opening the log in"), "{stderr}");
}

#[test]
fn keep_leaves_the_work_directory() {
    let parent = tempfile::tempdir().unwrap();
    let (code, summary, _) =
        crash(&["--target", "wal", "--iterations", "2", "--keep"], parent.path());
    assert_eq!(code, Some(0), "{summary}");
    let kept = summary["kept_dir"].as_str().expect("a kept directory");
    assert!(Path::new(kept).join("wal").is_dir());
}

#[test]
fn help_explains_every_flag_with_its_default() {
    let output = support::output_within(
        Command::new(env!("CARGO_BIN_EXE_coordbus-crash")).arg("--help"),
        BOUND,
    );
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    for flag in ["--target", "--iterations", "--dir", "--keep", "--seed", "--json", "--max-run-ms"]
    {
        assert!(help.contains(flag), "{flag} in {help}");
    }
    assert!(!help.contains("--inject-loss"), "the testing aid stays hidden");
    for default in ["[default: 50]", "[default: 1]", "[default: 30]"] {
        assert!(help.contains(default), "{default} in {help}");
    }
    // A bad target is a clear clap error, not a crash.
    let bad = support::output_within(
        Command::new(env!("CARGO_BIN_EXE_coordbus-crash")).args([
            "--target",
            "disk",
            "--iterations",
            "1",
        ]),
        BOUND,
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("disk"));
}
