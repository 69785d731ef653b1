//! Goal: a tool stopped by a signal in the middle of a run (Ctrl-C, or SIGTERM from a job
//! runner) removes the scratch directories it made, and says it was interrupted: exit status
//! 130 and a line on stderr. Before, `TempDir`'s destructors never ran on a signal, and an
//! interrupted `wal` run left gigabytes of segments in a hidden `.tmp...` directory.
//!
//! Method: run the built binaries on a run far longer than the test, in a directory of the
//! test's own (`TMPDIR` for the load generator, `--dir` for the crash tester); wait (bounded)
//! until the run has written a WAL segment in its scratch directory (the crash tester's child
//! is then running, writing into it); send the signal with `kill`; wait (bounded) for the
//! exit; check the status, the message, and that the directory is empty.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Longer than any step below takes; reaching it is a failure, not a wait.
const BOUND: Duration = Duration::from_secs(60);

/// Whether a WAL segment file (`*.wal`) lies under `dir`.
fn holds_a_segment(dir: &Path) -> bool {
    std::fs::read_dir(dir).into_iter().flatten().flatten().any(|entry| {
        let path = entry.path();
        if path.is_dir() {
            holds_a_segment(&path)
        } else {
            path.extension().is_some_and(|extension| extension == "wal")
        }
    })
}

/// Waits until the run wrote a segment under `dir`, signals it, and returns its exit code and
/// stderr.
fn interrupt(mut child: Child, dir: &Path, signal: &str) -> (Option<i32>, String) {
    let deadline = Instant::now() + BOUND;
    while !holds_a_segment(dir) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before writing anything");
        }
        assert!(Instant::now() < deadline, "the run wrote nothing in {BOUND:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed = Command::new("kill")
        .args(["-s", signal, &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success(), "kill -s {signal} failed");
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            return (status.code(), stderr);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("the run did not end within {BOUND:?} of {signal}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn an_interrupted_durable_load_run_removes_its_temporary_wal() {
    let tmp = tempfile::tempdir().unwrap();
    // Group commit cleans old epochs, so the log stays small however long the run goes.
    let child = Command::new(env!("CARGO_BIN_EXE_coordbus-load"))
        .args(["--json", "epoch", "--partitions", "10", "--epochs", "16000000"])
        .args(["--durability", "group", "--baseline", "none"])
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (code, stderr) = interrupt(child, tmp.path(), "INT");
    assert_eq!(code, Some(130), "{stderr}");
    assert!(stderr.contains("interrupted; removed 1 of 1 scratch directories"), "{stderr}");
    assert_eq!(entries(tmp.path()), Vec::<String>::new(), "left behind");
}

#[test]
fn a_terminated_crash_run_removes_its_work_directory() {
    let parent = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_coordbus-crash"))
        .args(["--target", "wal", "--iterations", "1000000", "--seed", "7", "--dir"])
        .arg(parent.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (code, stderr) = interrupt(child, parent.path(), "TERM");
    assert_eq!(code, Some(130), "{stderr}");
    assert!(stderr.contains("interrupted; removed 1 of 1 scratch directories"), "{stderr}");
    assert_eq!(entries(parent.path()), Vec::<String>::new(), "left behind");
}
