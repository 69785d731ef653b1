//! Goal: the tools refuse bad input with a clear error that names the flag (or path) and the
//! value, and a non-zero exit, before any measured run starts: never a panic, a hang, or a
//! wrong directory reported as a healthy log.
//!
//! Method: run the built binaries (`CARGO_BIN_EXE_*`) with each bad value, bounded by a
//! timeout (a hang fails the test instead of CI), and check the exit code and the message. A
//! panic would show as exit code 101 and "panicked" on stderr.

mod support;

use std::{path::Path, process::Command, time::Duration};

/// Longer than any refusal takes (they come before any run); a run that starts instead is
/// killed by the deadline and fails the test.
const BOUND: Duration = Duration::from_secs(60);

/// Exit code and output (stdout, then stderr) of `binary args`, killing it if it outlives
/// [`BOUND`].
fn run(binary: &str, args: &[&str]) -> (Option<i32>, String) {
    let output = support::output_within(Command::new(binary).args(args), BOUND);
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(!text.contains("panicked"), "{binary} {args:?} panicked: {text}");
    (output.status.code(), text)
}

fn load(args: &[&str]) -> (Option<i32>, String) {
    run(env!("CARGO_BIN_EXE_coordbus-load"), args)
}

fn wal_tool(args: &[&str]) -> (Option<i32>, String) {
    run(env!("CARGO_BIN_EXE_coordbus-wal"), args)
}

/// `coordbus-load args` is refused, with a message holding every one of `names`.
fn assert_load_refuses(args: &[&str], names: &[&str]) {
    let (code, stderr) = load(args);
    assert!(matches!(code, Some(code) if code != 0), "{args:?} was accepted: {stderr}");
    for name in names {
        assert!(stderr.contains(name), "{args:?}: the error does not say {name:?}: {stderr}");
    }
}

#[test]
fn out_of_range_load_options_are_refused_naming_the_flag_and_value() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["wal", "--threads", "0"], &["--threads", "0"]),
        (&["wal-recover", "--record-bytes", "0"], &["--record-bytes", "0"]),
        (&["wal-recover", "--records", "0"], &["--records", "0"]),
        (&["wal", "--every-records", "0"], &["--every-records", "0"]),
        (&["blocks", "--streams", "2147483648"], &["--streams", "2147483648"]),
        (&["epoch", "--window", "9223372036854775807"], &["--window", "9223372036854775807"]),
        (&["epoch", "--sync-nice", "40"], &["--sync-nice", "40"]),
        (&["epoch", "--baseline-seconds", "nan"], &["--baseline-seconds", "nan"]),
        (&["epoch", "--baseline-seconds", "inf"], &["--baseline-seconds", "inf"]),
        (&["epoch", "--baseline-seconds=-1"], &["--baseline-seconds", "-1"]),
        (&["epoch", "--epochs", "9223372036854775807"], &["--epochs", "9223372036854775807"]),
        (&["ask", "--in-flight", "18446744073709551615"], &["--in-flight"]),
        (&["bus", "--producers", "18446744073709551615"], &["--producers"]),
        (&["state-store", "--asks", "0"], &["--asks", "0"]),
        (&["state-store", "--stores", "1000000000000000"], &["--stores", "1000000000000000"]),
        (&["state-store", "--executors", "1000000000"], &["--executors", "1000000000"]),
        (&["state-store", "--stores", "10", "--executors", "20"], &["--executors", "20", "10"]),
        (&["state-store", "--deactivate-rounds", "0"], &["--deactivate-rounds", "0"]),
        (&["epoch", "--partitions", "4000000"], &["--partitions", "4000000"]),
        (&["epoch", "--partitions=-5"], &["--partitions", "-5"]),
        (&["epoch", "--backlog-limit", "0"], &["--backlog-limit", "0"]),
        (&["blocks", "--batch-only", "--batch", "1"], &["--batch-only", "--batch 1"]),
        (
            &["wal", "--durability", "group", "--records", "1000000", "--max-bytes", "64"],
            &["--max-bytes 64", "--records 1000000", "--baseline none"],
        ),
        (
            &["epoch", "--partitions", "1000", "--backlog-limit", "1000"],
            &["--backlog-limit", "1000"],
        ),
        // Two producers, one of which may run a window (4 epochs here) ahead of the other.
        (
            &["epoch", "--partitions", "100000", "--producers", "2", "--backlog-limit", "400000"],
            &["--backlog-limit 400000", "--partitions 100000", "--producers 2", "500000"],
        ),
    ];
    for (args, names) in cases {
        assert_load_refuses(args, names);
    }
}

/// Flags that are each in range but multiply past the memory a run may plan up front are
/// refused before anything runs, naming every flag of the product.
#[test]
fn flags_whose_product_is_too_much_memory_are_refused_naming_them() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["bus", "--producers", "1024", "--batch", "1048576", "--messages", "100000000"],
            &["--producers 1024", "--batch 1048576", "8 GiB"],
        ),
        (
            &["blocks", "--receivers", "1024", "--batch", "1048576", "--batch-in-flight", "16"],
            &["--receivers 1024", "--batch-in-flight 16", "--batch 1048576"],
        ),
        // Single additions keep `--in-flight` blocks per receiver (the check once left it out).
        (
            &["blocks", "--receivers", "1024", "--in-flight", "1048576"],
            &["--receivers 1024", "--in-flight 1048576"],
        ),
        (
            &["wal", "--threads", "1024", "--record-bytes", "16777216", "--records", "2048"],
            &["--threads 1024", "--record-bytes 16777216"],
        ),
        (
            &["epoch", "--producers", "1000", "--batch", "1048576"],
            &["--producers 1000", "--batch 1048576"],
        ),
    ];
    for (args, names) in cases {
        assert_load_refuses(args, names);
    }
}

/// Logs larger than the free space of their file system are refused before anything runs,
/// naming the flags and the free bytes. The flags ask for petabytes, more than any disk here
/// has. (A durable `epoch` run is checked the same way, but its largest log, about 2 GiB, fits
/// on any machine that runs these tests.)
#[test]
fn logs_larger_than_the_free_disk_are_refused_naming_the_flags() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            // 10^7 frames of 1 GiB, 1023 to a 1 TiB segment: about 10 PB.
            &["wal", "--records", "10000000", "--record-bytes", "1073741824"],
            &["--records 10000000", "--record-bytes 1073741824", "bytes free"],
        ),
        (
            &["wal-recover", "--records", "10000000", "--record-bytes", "1073741824"],
            &["--records 10000000", "--record-bytes 1073741824", "bytes free"],
        ),
        (
            // 10^14 additions of up to 64 bytes: about 6 PB.
            &["blocks", "--blocks", "100000000000000"],
            &["--blocks 100000000000000", "bytes free"],
        ),
    ];
    for (args, names) in cases {
        let args: Vec<&str> = args.iter().chain(&["--segment-mib", "1048576"]).copied().collect();
        assert_load_refuses(&args, names);
    }
}

#[test]
fn work_that_splits_to_nothing_per_thread_is_refused_naming_both_flags() {
    assert_load_refuses(
        &["bus", "--producers", "4", "--messages", "3"],
        &["--messages", "3", "--producers", "4"],
    );
    assert_load_refuses(
        &["wal", "--threads", "4", "--records", "3"],
        &["--records", "3", "--threads", "4"],
    );
}

/// `coordbus-wal verify DIR` exits 3 (an error, not "healthy") with a message holding `says`.
fn assert_verify_refuses(dir: &Path, says: &str) {
    let path = dir.to_str().unwrap();
    let (code, output) = wal_tool(&["verify", path]);
    assert_eq!(code, Some(3), "verify {path}: {output}");
    assert!(output.contains(says), "verify {path} does not say {says:?}: {output}");
    for command in ["inspect", "dump"] {
        let (code, stderr) = wal_tool(&[command, path]);
        assert!(matches!(code, Some(code) if code != 0), "{command} {path} succeeded: {stderr}");
        assert!(stderr.contains(says), "{command} {path} does not say {says:?}: {stderr}");
    }
}

#[test]
fn the_wal_tool_does_not_take_a_wrong_directory_for_a_healthy_log() {
    let parent = tempfile::tempdir().unwrap();
    let missing = parent.path().join("no-such-log");
    assert_verify_refuses(&missing, "no such file or directory");
    // An empty directory is an empty log (opened, nothing written yet): healthy.
    let (code, output) = wal_tool(&["verify", parent.path().to_str().unwrap()]);
    assert_eq!(code, Some(0), "verify of an empty directory: {output}");
    // A directory with something in it, but no segment: the parent of a log, say.
    std::fs::write(parent.path().join("notes.txt"), b"not a segment").unwrap();
    assert_verify_refuses(parent.path(), "holds no WAL segment");
    // A real log in a subdirectory is still read, and reported healthy.
    let log = parent.path().join("log");
    {
        let wal = coordbus::wal::Wal::open(&log, coordbus::wal::WalConfig::default()).unwrap();
        let (lsn, _) = wal.append_bytes(b"record", 1).unwrap();
        wal.wait_durable_timeout(lsn, BOUND).unwrap();
        wal.close().unwrap();
    }
    let (code, stderr) = wal_tool(&["verify", log.to_str().unwrap()]);
    assert_eq!(code, Some(0), "verify of a real log: {stderr}");
    // A segment's name on a directory: named as what it is, not mapped ("no such device").
    let odd = parent.path().join("odd");
    std::fs::create_dir_all(odd.join("seg-0000000001.wal")).unwrap();
    assert_verify_refuses(&odd, "not a regular file");
    assert!(!wal_tool(&["verify", odd.to_str().unwrap()]).1.contains("writer lock"));
    // A named pipe: refused as no directory, at once (opening it to probe a writer's lock
    // blocked until someone wrote to the pipe).
    let fifo = parent.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success(), "mkfifo");
    assert_verify_refuses(&fifo, "is not a directory");
}

/// A usage error of `coordbus-wal` exits 3, as its help says, not clap's 2 (which `verify`
/// uses for a torn tail); `--help` still exits 0.
#[test]
fn a_wal_tool_usage_error_exits_3_not_the_torn_tail_code() {
    for args in [&["verify"][..], &["verify", "--no-such-flag", "."], &["no-such-command"]] {
        let (code, stderr) = wal_tool(args);
        assert_eq!(code, Some(3), "{args:?}: {stderr}");
        assert!(stderr.contains("Usage"), "{args:?} does not explain the usage: {stderr}");
    }
    let (code, output) = wal_tool(&["--help"]);
    assert_eq!(code, Some(0), "--help: {output}");
}

/// A log that failed leaves a marker naming its last durable LSN: `verify` reports the records
/// after it (which opening cuts) with exit code 2, as it does a torn tail, never "healthy";
/// `inspect --json` names the cut. A directory holding only the marker (a log that failed
/// before its first segment) is a log directory, not a wrong one.
#[test]
fn the_wal_tool_reports_a_failed_logs_records_after_its_durable_lsn() {
    let parent = tempfile::tempdir().unwrap();
    let log = parent.path().join("log");
    {
        let wal = coordbus::wal::Wal::open(&log, coordbus::wal::WalConfig::default()).unwrap();
        for index in 0..10u8 {
            let (lsn, _) = wal.append_bytes(&[index; 40], 1).unwrap();
            wal.wait_durable_timeout(lsn, BOUND).unwrap();
        }
        wal.close().unwrap();
    }
    std::fs::write(log.join(coordbus::wal::UNSYNCED_MARKER), b"6\n").unwrap();
    let path = log.to_str().unwrap();
    let (code, output) = wal_tool(&["verify", path]);
    assert_eq!(code, Some(2), "{output}");
    assert!(output.starts_with("failed-log:"), "{output}");
    assert!(output.contains("4 records after its last durable LSN 6 cut"), "{output}");
    let (code, output) = wal_tool(&["--json", "inspect", path]);
    assert_eq!(code, Some(0), "{output}");
    assert!(
        output.contains(
            r#""unsynced_cut":{"durable_lsn":6,"records_discarded":4,"segments_removed":0}"#
        ),
        "{output}"
    );
    // `dump` shows the 6 records opening keeps, names the 4 it leaves out, and exits as
    // `verify` does.
    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(2), "{output}");
    assert_eq!(output.lines().filter(|line| line.starts_with("lsn")).count(), 6, "{output}");
    assert!(
        output.contains(
            "not shown: 4 records a failed log wrote after its last durable LSN 6 (never \
             acknowledged; opening cuts them)"
        ),
        "{output}"
    );

    let only_marker = parent.path().join("failed-early");
    std::fs::create_dir(&only_marker).unwrap();
    std::fs::write(only_marker.join(coordbus::wal::UNSYNCED_MARKER), b"0\n").unwrap();
    let (code, output) = wal_tool(&["verify", only_marker.to_str().unwrap()]);
    assert_ne!(code, Some(3), "a failed log's directory taken for a wrong one: {output}");
    let only_temporary_marker = parent.path().join("killed-while-marking");
    std::fs::create_dir(&only_temporary_marker).unwrap();
    std::fs::write(only_temporary_marker.join(coordbus::wal::UNSYNCED_MARKER_TEMP), b"0").unwrap();
    let (code, output) = wal_tool(&["verify", only_temporary_marker.to_str().unwrap()]);
    assert_ne!(code, Some(3), "a failed log's directory taken for a wrong one: {output}");

    // A marker that holds no LSN: the log cannot be opened, so it is not healthy; the
    // message names the marker and what it holds.
    std::fs::write(log.join(coordbus::wal::UNSYNCED_MARKER), b"\xff\xfe5\n").unwrap();
    let (code, output) = wal_tool(&["verify", path]);
    assert_eq!(code, Some(1), "{output}");
    assert!(output.starts_with("corrupt:"), "{output}");
    assert!(
        output.contains("unsynced-after.lsn") && output.contains("does not hold an LSN (4 bytes"),
        "{output}"
    );
    let (code, output) = wal_tool(&["inspect", path]);
    assert_eq!(code, Some(3), "{output}");
    assert!(output.contains("does not hold an LSN"), "{output}");
    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(1), "dump must exit as verify does: {output}");
    assert!(output.contains("corrupt:") && output.contains("does not hold an LSN"), "{output}");
}

/// `verify` tells a torn segment creation (exit 2: opening removes a file that never held a
/// record) from a last segment of garbage (exit 1: its records are damaged, and opening in
/// strict mode fails).
#[test]
fn the_wal_tool_tells_a_torn_segment_creation_from_a_damaged_last_segment() {
    let parent = tempfile::tempdir().unwrap();
    let log = parent.path().join("log");
    {
        let wal = coordbus::wal::Wal::open(&log, coordbus::wal::WalConfig::default()).unwrap();
        let (lsn, _) = wal.append_bytes(b"record", 1).unwrap();
        wal.wait_durable_timeout(lsn, BOUND).unwrap();
        wal.close().unwrap();
    }
    let next = log.join(coordbus::wal::segment::file_name(coordbus::wal::SegmentId(2)));
    let mut torn = vec![0u8; 1 << 16];
    torn[..24].fill(0x5A);
    std::fs::write(&next, &torn).unwrap();
    let path = log.to_str().unwrap();
    let (code, output) = wal_tool(&["verify", path]);
    assert_eq!(code, Some(2), "{output}");
    assert!(output.starts_with("torn-tail:"), "{output}");
    assert!(output.contains("a torn segment creation, removed on open"), "{output}");
    assert!(output.contains("seg-0000000002.wal"), "{output}");
    // Bytes past the header: written after a durable header, so the header was damaged.
    torn[5000..5100].fill(0xA7);
    std::fs::write(&next, &torn).unwrap();
    let (code, output) = wal_tool(&["verify", path]);
    assert_eq!(code, Some(1), "{output}");
    assert!(output.starts_with("corrupt:"), "{output}");
}

/// `dump` into a reader that stops early (`| head -1`) ends quietly: no panic on the closed
/// pipe, exit code 0.
#[test]
fn the_wal_tool_stops_quietly_when_its_reader_goes_away() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    {
        let wal =
            coordbus::wal::Wal::open(dir.path(), coordbus::wal::WalConfig::default()).unwrap();
        let mut last = None;
        for index in 0..20_000u32 {
            last = Some(wal.append_bytes(&index.to_le_bytes(), 1).unwrap().0);
        }
        wal.wait_durable_timeout(last.unwrap(), BOUND).unwrap();
        wal.close().unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_coordbus-wal"))
        .args(["dump", dir.path().to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("lsn"), "{first}");
    // The reader is dropped here: the rest of the dump meets a closed pipe.
    let output = support::wait_within(child, BOUND);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(0), "{stderr}");
}

/// A new log at `log` holding `payloads`, each durable before the next is appended (so a
/// later frame proves an earlier one was synced: damage to it is corruption, not a torn
/// tail); their handles.
fn log_each_durable(log: &Path, payloads: &[&[u8]]) -> Vec<coordbus::wal::RecordHandle> {
    let wal = coordbus::wal::Wal::open(log, coordbus::wal::WalConfig::default()).unwrap();
    let handles = payloads
        .iter()
        .map(|payload| {
            let (lsn, handle) = wal.append_bytes(payload, 1).unwrap();
            wal.wait_durable_timeout(lsn, BOUND).unwrap();
            handle
        })
        .collect();
    wal.close().unwrap();
    handles
}

/// `dump` of a damaged log prints the records it can read, names each damaged range it
/// skipped on stderr, and exits 1; a torn segment creation (not damage, but removed on open)
/// is named and exits 2, as `verify` does.
#[test]
fn the_wal_tool_dump_names_the_damage_it_skipped_and_fails() {
    let parent = tempfile::tempdir().unwrap();
    let log = parent.path().join("log");
    let damaged = log_each_durable(&log, &[b"first", b"hurt!", b"third"]);
    let path = log.to_str().unwrap();
    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(0), "{output}");
    assert_eq!(output.lines().filter(|line| line.starts_with("lsn")).count(), 3, "{output}");

    // A torn creation of the next segment is what a crash leaves, not damage.
    let next = log.join(coordbus::wal::segment::file_name(coordbus::wal::SegmentId(2)));
    std::fs::write(&next, vec![0u8; 1 << 16]).unwrap();
    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(2), "{output}");
    assert_eq!(output.lines().filter(|line| line.starts_with("lsn")).count(), 3, "{output}");
    assert!(output.contains("a torn segment creation, removed on open"), "{output}");
    assert!(output.contains("seg-0000000002.wal"), "{output}");
    assert_eq!(wal_tool(&["verify", path]).0, Some(2), "dump and verify differ");
    // `inspect --json` counts the segments the log keeps, and every file apart.
    let (code, output) = wal_tool(&["--json", "inspect", path]);
    assert_eq!(code, Some(0), "{output}");
    let summary = output.lines().last().unwrap();
    assert!(summary.contains(r#""segments":1,"#), "{summary}");
    assert!(summary.contains(r#""segment_files":2,"#), "{summary}");
    assert!(summary.contains(r#""segments_skipped":[2]"#), "{summary}");
    std::fs::remove_file(&next).unwrap();

    // The last record's payload damaged: nothing after it proves it was synced, so it reads
    // as a torn tail (what a crash leaves): not shown, named, exit code 2 (as verify's).
    let segment = log.join(coordbus::wal::segment::file_name(damaged[2].segment));
    let clean = std::fs::read(&segment).unwrap();
    let damage = |handle: &coordbus::wal::RecordHandle| {
        let mut bytes = clean.clone();
        let payload = handle.offset as usize + coordbus::record::frame::HEADER_LEN;
        bytes[payload..payload + 4].copy_from_slice(b"XXXX");
        std::fs::write(&segment, &bytes).unwrap();
    };
    damage(&damaged[2]);
    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(2), "{output}");
    assert_eq!(output.lines().filter(|line| line.starts_with("lsn")).count(), 2, "{output}");
    assert!(output.contains("coordbus-wal dump: torn tail"), "{output}");

    // The middle record's payload damaged: its checksum no longer holds, and the record after
    // it proves it was synced.
    let damaged = damaged[1];
    damage(&damaged);
    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(1), "{output}");
    let records: Vec<&str> = output.lines().filter(|line| line.starts_with("lsn")).collect();
    assert_eq!(records.len(), 2, "{output}");
    assert!(records[0].trim_end().ends_with(&hex(b"first")), "{output}");
    assert!(records[1].trim_end().ends_with(&hex(b"third")), "{output}");
    assert!(output.contains("coordbus-wal dump: skipped"), "{output}");
    assert!(output.contains(&format!("of segment {} at offset", damaged.segment.0)), "{output}");
    let (code, output) = wal_tool(&["--json", "dump", path]);
    assert_eq!(code, Some(1), "{output}");
}

/// A segment with both damage and a torn tail after it: `inspect` names both in the segment's
/// state, and `dump` (exit 1, corrupt) names the damage it skipped and the torn tail it did
/// not show; with a failed log's records past its durable LSN instead of the torn tail, it
/// names those.
#[test]
fn the_wal_tool_names_both_damage_and_a_torn_tail_in_one_segment() {
    let parent = tempfile::tempdir().unwrap();
    let log = parent.path().join("log");
    let handles = log_each_durable(&log, &[b"first", b"hurt!", b"third", b"torn!"]);
    let segment = log.join(coordbus::wal::segment::file_name(handles[1].segment));
    let mut bytes = std::fs::read(&segment).unwrap();
    for damaged in [&handles[1], &handles[3]] {
        let payload = damaged.offset as usize + coordbus::record::frame::HEADER_LEN;
        bytes[payload..payload + 4].copy_from_slice(b"XXXX");
    }
    std::fs::write(&segment, &bytes).unwrap();
    let path = log.to_str().unwrap();

    let (code, output) = wal_tool(&["inspect", path]);
    assert_eq!(code, Some(0), "{output}");
    let row = output.lines().find(|line| line.starts_with("seg-")).unwrap();
    assert!(row.contains("1 damaged stretch(es); torn tail at"), "{output}");

    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(1), "{output}");
    let records: Vec<&str> = output.lines().filter(|line| line.starts_with("lsn")).collect();
    assert_eq!(records.len(), 2, "{output}");
    assert!(output.contains("coordbus-wal dump: skipped"), "{output}");
    assert!(output.contains("coordbus-wal dump: torn tail not shown"), "{output}");

    // Damage, and a failed log's records past its durable LSN (the last record intact again):
    // dump names both.
    let last = handles[3].offset as usize + coordbus::record::frame::HEADER_LEN;
    bytes[last..last + 4].copy_from_slice(b"torn");
    std::fs::write(&segment, &bytes).unwrap();
    std::fs::write(log.join(coordbus::wal::UNSYNCED_MARKER), b"3\n").unwrap();
    let (code, output) = wal_tool(&["dump", path]);
    assert_eq!(code, Some(1), "{output}");
    assert!(output.contains("coordbus-wal dump: skipped"), "{output}");
    assert!(
        output.contains("not shown: 1 records a failed log wrote after its last durable LSN 3"),
        "{output}"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// `dump --json` says on stderr that a writer holds the log (its torn tail may be records in
/// flight), as the text output does; stdout keeps only the records.
#[test]
fn the_wal_tool_dump_names_a_live_writer_also_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let wal = coordbus::wal::Wal::open(dir.path(), coordbus::wal::WalConfig::default()).unwrap();
    let (lsn, _) = wal.append_bytes(b"record", 1).unwrap();
    wal.wait_durable_timeout(lsn, BOUND).unwrap();
    let output = support::output_within(
        Command::new(env!("CARGO_BIN_EXE_coordbus-wal")).args([
            "--json",
            "dump",
            dir.path().to_str().unwrap(),
        ]),
        BOUND,
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("writer lock: held by a live writer"), "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.starts_with(r#"{"#), "{stdout}");
    wal.close().unwrap();
}

/// A segment of a format version this build does not know (its header otherwise whole): no
/// open reads it, so `verify` and `dump` both call the log corrupt (exit 1), naming the version.
#[test]
fn the_wal_tool_calls_an_unknown_segment_version_corrupt_in_dump_as_in_verify() {
    let dir = tempfile::tempdir().unwrap();
    {
        let wal =
            coordbus::wal::Wal::open(dir.path(), coordbus::wal::WalConfig::default()).unwrap();
        let (lsn, _) = wal.append_bytes(b"record", 1).unwrap();
        wal.wait_durable_timeout(lsn, BOUND).unwrap();
        wal.close().unwrap();
    }
    let segment = dir.path().join(coordbus::wal::segment::file_name(coordbus::wal::SegmentId(1)));
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[8] = 9;
    let crc = crc_fast::crc32_iscsi(&bytes[0..60]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&segment, &bytes).unwrap();
    let path = dir.path().to_str().unwrap();
    for command in ["verify", "dump"] {
        let (code, output) = wal_tool(&[command, path]);
        assert_eq!(code, Some(1), "{command}: {output}");
        assert!(output.contains("corrupt"), "{command}: {output}");
        assert!(output.contains("segment 1 has format version 9"), "{command}: {output}");
    }
}

/// An `epoch` flag for a setting the run does not have (a WAL's, with `--durability none`;
/// group commit's, without it; the varied offsets' seed, with steady offsets) is refused,
/// naming it and its value, with the exit code of the other refusals: ignored, it would let
/// the figure seem to have run with it.
#[test]
fn epoch_flags_that_would_be_ignored_are_refused_naming_them() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["epoch", "--group-delay-us", "5000", "--sync-nice", "10", "--durability", "none"],
            &["--group-delay-us 5000", "--durability group"],
        ),
        (&["epoch", "--sync-nice", "10"], &["--sync-nice 10", "--durability none"]),
        (&["epoch", "--keep", "--dir", "."], &["--keep", "--dir .", "--durability none"]),
        (
            &["epoch", "--durability", "every", "--group-delay-us", "50"],
            &["--group-delay-us 50", "--durability every"],
        ),
        (&["epoch", "--seed", "7"], &["--seed 7", "--offsets varied"]),
        (&["epoch", "--seed", "7", "--offsets", "steady"], &["--seed 7", "--offsets varied"]),
        (
            &["epoch", "--baseline", "none", "--baseline-seconds", "3"],
            &["--baseline-seconds 3", "--baseline reference", "--baseline none"],
        ),
        (
            &["epoch", "--durability", "group", "--baseline", "memory", "--baseline-seconds", "1"],
            &["--baseline-seconds 1", "--baseline memory"],
        ),
        (&["epoch", "--baseline", "memory"], &["--baseline memory", "--durability none"]),
    ];
    for (args, names) in cases {
        let (code, stderr) = load(args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        for name in *names {
            assert!(stderr.contains(name), "{args:?}: the error does not say {name:?}: {stderr}");
        }
    }
}

/// A `--dir` that does not exist, or is a file, is refused by name, and nothing is created:
/// by the load generator (the `wal`, `blocks` and durable `epoch` workloads) and by the crash
/// tester alike.
#[test]
fn a_dir_that_is_missing_or_a_file_is_refused_and_not_created() {
    let parent = tempfile::tempdir().unwrap();
    let missing = parent.path().join("missing").join("deeper");
    let file = parent.path().join("file");
    std::fs::write(&file, b"not a directory").unwrap();
    let crash = |dir: &Path| {
        let dir = dir.to_str().unwrap();
        run(
            env!("CARGO_BIN_EXE_coordbus-crash"),
            &["--target", "wal", "--iterations", "1", "--dir", dir],
        )
    };
    for (dir, says) in [(&missing, "does not exist"), (&file, "is not a directory")] {
        let text = dir.to_str().unwrap();
        let expected = format!("--dir {text} {says}");
        for args in [
            &["wal", "--dir", text][..],
            &["blocks", "--dir", text],
            &["epoch", "--durability", "group", "--dir", text],
        ] {
            let (code, stderr) = load(args);
            assert_eq!(code, Some(1), "{args:?}: {stderr}");
            assert!(stderr.contains(&expected), "{args:?}: {stderr}");
        }
        let (code, output) = crash(dir);
        assert_eq!(code, Some(2), "{output}");
        assert!(output.contains(&expected), "{output}");
    }
    assert!(!parent.path().join("missing").exists(), "a missing --dir was created");
}

/// An error is one line with its causes, also with `RUST_BACKTRACE=1` (anyhow would add a
/// backtrace to an error returned from `main`), with each tool's exit code for it.
#[test]
fn errors_are_one_line_without_a_backtrace() {
    let parent = tempfile::tempdir().unwrap();
    let missing = parent.path().join("missing");
    let missing = missing.to_str().unwrap();
    let cases: [(&str, &[&str], i32); 3] = [
        (
            env!("CARGO_BIN_EXE_coordbus-load"),
            &["epoch", "--backlog-limit", "5", "--partitions", "10"],
            1,
        ),
        (env!("CARGO_BIN_EXE_coordbus-crash"), &["--target", "wal", "--dir", missing], 2),
        (env!("CARGO_BIN_EXE_coordbus-wal"), &["inspect", missing], 3),
    ];
    for (binary, args, expected) in cases {
        let output = support::output_within(
            Command::new(binary).args(args).env("RUST_BACKTRACE", "1"),
            BOUND,
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(expected), "{binary} {args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{binary} {args:?}: {stderr}");
        assert!(stderr.contains("error: "), "{binary} {args:?}: {stderr}");
        assert!(!stderr.contains("backtrace"), "{binary} {args:?}: {stderr}");
    }
}

/// A value or flag clap refuses (out of range, not one of the choices, unknown, missing) is
/// one line on stderr, naming the flag and the value, as every other error is; with each
/// tool's usage exit code (2, and 3 for `coordbus-wal`, whose 2 is a torn tail). `--help` and
/// `--version` still print in full, with exit code 0.
#[test]
fn flags_clap_refuses_are_one_line_naming_the_flag_and_value() {
    let load = env!("CARGO_BIN_EXE_coordbus-load");
    let crash = env!("CARGO_BIN_EXE_coordbus-crash");
    let wal = env!("CARGO_BIN_EXE_coordbus-wal");
    let cases: &[(&str, &[&str], i32, &[&str])] = &[
        (load, &["epoch", "--partitions", "0"], 2, &["--partitions", "'0'"]),
        (load, &["epoch", "--durability", "sometimes"], 2, &["--durability", "'sometimes'"]),
        (load, &["epoch", "--no-such-flag"], 2, &["'--no-such-flag'"]),
        (load, &["--json", "bus", "--producers", "x"], 2, &["--producers", "'x'"]),
        (crash, &["--iterations", "0"], 2, &["--iterations", "'0'"]),
        (wal, &["verify"], 3, &["<DIR>", "Usage"]),
    ];
    for (binary, args, expected, names) in cases {
        let output = support::output_within(Command::new(binary).args(*args), BOUND);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(*expected), "{binary} {args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{binary} {args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{binary} {args:?}: {stderr}");
        for name in *names {
            assert!(stderr.contains(name), "{binary} {args:?}: no {name:?} in {stderr}");
        }
    }
    for (binary, args) in
        [(load, &["epoch", "--help"][..]), (wal, &["--version"]), (crash, &["-h"])]
    {
        let output = support::output_within(Command::new(binary).args(args), BOUND);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(output.status.code(), Some(0), "{binary} {args:?}: {stdout}");
        assert!(!stdout.trim().is_empty() && output.stderr.is_empty(), "{binary} {args:?}");
    }
    let (_, help) = run(load, &["epoch", "--help"]);
    assert!(help.lines().count() > 20 && help.contains("Usage: coordbus-load epoch"), "{help}");
}

/// Help and flag errors in the operator's terms: no bound printed as 2^64 - 1, no default
/// stated twice, no citation of a spec section or a source module.
#[test]
fn help_and_flag_errors_speak_the_operators_terms() {
    let (code, stderr) = run(env!("CARGO_BIN_EXE_coordbus-crash"), &["--iterations", "0"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--iterations") && stderr.contains("must be at least 1"), "{stderr}");
    assert!(!stderr.contains("18446744073709551615"), "{stderr}");

    let (code, help) = wal_tool(&["dump", "--help"]);
    assert_eq!(code, Some(0), "{help}");
    let from = help.lines().find(|line| line.trim_start().starts_with("--from")).unwrap();
    assert!(from.contains("[default: 0]") && !from.contains("(default"), "{from}");

    let (code, help) = load(&["epoch", "--help"]);
    assert_eq!(code, Some(0), "{help}");
    for jargon in ["SPEC", "module `"] {
        assert!(!help.contains(jargon), "epoch --help cites {jargon:?}: {help}");
    }
    for flag in ["--dir", "--keep", "durable_p50_ns", "ratio_to_memory"] {
        assert!(help.contains(flag), "epoch --help does not explain {flag}: {help}");
    }
}

/// `inspect`'s summary counts the segment files it skipped, as its table lists them, instead
/// of "no records in 0 segment(s)" under a table of one segment.
#[test]
fn the_wal_tool_summary_counts_skipped_segments() {
    let parent = tempfile::tempdir().unwrap();
    let log = parent.path().join("log");
    log_each_durable(&log, &[b"record"]);
    let segment = log.join(coordbus::wal::segment::file_name(coordbus::wal::SegmentId(1)));
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[..24].fill(0x5A);
    std::fs::write(&segment, &bytes).unwrap();
    let (code, output) = wal_tool(&["inspect", log.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{output}");
    assert!(output.contains("unreadable (skipped)"), "{output}");
    assert!(output.contains("no records in 1 segment(s) (0 kept, 1 skipped)"), "{output}");
    assert!(!output.contains("in 0 segment(s)"), "{output}");
}
