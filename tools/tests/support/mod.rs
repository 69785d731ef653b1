//! Running a built tool from a test, bounded: a tool that hangs fails the test instead of
//! hanging CI.

use std::{
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::Duration,
};

/// Runs `command` (stdin closed, stdout and stderr captured) and returns its output, killing it
/// and failing the test if it outlives `bound`.
pub fn output_within(command: &mut Command, bound: Duration) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the tool starts");
    wait_within(child, bound)
}

/// Waits for `child` and returns its output (what its captured pipes still hold), killing it
/// and failing the test if it outlives `bound`.
pub fn wait_within(child: Child, bound: Duration) -> Output {
    let pid = child.id();
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    match receiver.recv_timeout(bound) {
        Ok(output) => output.expect("the tool's output"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("process {pid} ran past {bound:?}");
        }
    }
}
