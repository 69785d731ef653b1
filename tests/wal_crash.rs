//! Crash test: kill -9 a process appending to the WAL, reopen, check every durable record.
//!
//! Goal: a record the log reported durable survives a crash intact; after recovery the log
//! holds a contiguous run of LSNs from 1, every record intact, and no garbage after the tail.
//! Method: the test re-executes its own binary (`current_exe`) filtered to the `crash_child`
//! test (ignored in a plain run: `--ignored`) with `COORDBUS_WAL_CRASH_DIR` set. The child
//! appends self-checking records (the first 4 bytes are the CRC32C of the rest), alternately
//! with `EveryRecord` (one thread) and `GroupCommit` (two threads), on both I/O paths (it
//! prints its path, which the parent checks: io_uring wherever the kernel allows it), and
//! prints `durable <lsn> <crc>` for each record once `wait_durable` returned. The child's
//! workload (record sizes, batches, bytes) comes from a seed the parent passes in
//! `COORDBUS_WAL_CRASH_SEED`, derived from the parent's fixed-seed generator and the kill
//! index; a failure names it. The parent waits for the first
//! printed record, lets the child run for a random 0-20 ms (fixed seed), sends SIGKILL, reopens
//! the log in strict mode and checks. 56 kills in all; a few seconds on 2 cores.
//!
//! A second test kills children that also clean behind themselves on 16 KiB segments, so that
//! they keep cleaned segments' files as spares and reuse them (recycled segments): each prints
//! `clean <lsn>` before it cleans below that LSN, and every durable record at or above the
//! highest announced threshold must survive, the rest of the log contiguous and intact. Each
//! child is killed 0-20 ms after it announced its first reuse of a spare. 24 kills.

use std::{
    io::{Read, Write},
    path::Path,
    process::{Command, Stdio},
    sync::{mpsc, Arc},
    time::Duration,
};

use coordbus::wal::{scan_dir, Durability, IoMode, Lsn, RecoveryMode, Wal, WalConfig, WalOptions};

mod wal_support;

const DIR_VAR: &str = "COORDBUS_WAL_CRASH_DIR";
const MODE_VAR: &str = "COORDBUS_WAL_CRASH_MODE";
/// The child's workload seed (decimal `u64`), set by the parent.
const SEED_VAR: &str = "COORDBUS_WAL_CRASH_SEED";
const KILLS: u64 = 56;
const RECYCLING_KILLS: u64 = 24;
const SEGMENT_SIZE: u64 = 256 << 10;

fn config(durability: Durability) -> WalConfig {
    WalConfig {
        segment_size_bytes: SEGMENT_SIZE,
        durability,
        recovery: RecoveryMode::Strict,
        ..WalConfig::default()
    }
}

/// Segments of 16 KiB (about 85 records): the recycling children roll, clean and reuse
/// segments every few milliseconds.
const RECYCLING_SEGMENT_SIZE: u64 = 16 << 10;
/// How many records behind the durable LSN the recycling children clean.
const RECYCLING_RETAIN: u64 = 600;

fn recycling_config() -> WalConfig {
    WalConfig { segment_size_bytes: RECYCLING_SEGMENT_SIZE, ..config(Durability::default()) }
}

/// In a recycling child: prints `clean <lsn>`, then cleans (without waiting) every segment
/// wholly below it, `RECYCLING_RETAIN` records behind the durable LSN. Printed first, so the
/// parent knows every threshold that may have been applied. Prints `recycled` once the log
/// has made a segment from a spare (the parent's kill timer starts there).
fn clean_behind(wal: &Wal) {
    static ANNOUNCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let durable = wal.durable_lsn().0;
    let mut out = std::io::stdout().lock();
    if durable > RECYCLING_RETAIN {
        let threshold = durable - RECYCLING_RETAIN;
        writeln!(out, "clean {threshold}").unwrap();
        out.flush().unwrap();
        wal.clean_below_lsn(Lsn(threshold), false).unwrap();
    }
    if wal.stats().recycled_segments > 0
        && !ANNOUNCED.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        writeln!(out, "recycled").unwrap();
        out.flush().unwrap();
    }
}

/// A self-checking payload: CRC32C of the body, then the body.
fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed | 1;
    let body: Vec<u8> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let mut out = crc32c::crc32c(&body).to_le_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

fn self_check(bytes: &[u8]) -> bool {
    bytes.len() >= 4
        && crc32c::crc32c(&bytes[4..]) == u32::from_le_bytes(bytes[..4].try_into().unwrap())
}

/// The child: appends until killed. Ignored in a plain run (it is not a test of its own); the
/// parent starts it with `--ignored`.
#[test]
#[ignore = "a child process: the crash test starts it"]
fn crash_child() {
    let Ok(dir) = std::env::var(DIR_VAR) else {
        return;
    };
    let mode = std::env::var(MODE_VAR).unwrap_or_default();
    let seed: u64 = match std::env::var(SEED_VAR) {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|error| panic!("{SEED_VAR}={text:?} is not a decimal u64: {error}")),
        Err(error) => panic!("{SEED_VAR} must be set by the parent: {error}"),
    };
    let (durability, io, threads) = match mode.as_str() {
        "every-uring" => (Durability::EveryRecord, IoMode::Auto, 1),
        "every-pwrite" => (Durability::EveryRecord, IoMode::Pwrite, 1),
        "group-uring" | "recycle-uring" => (Durability::default(), IoMode::Auto, 2),
        _ => (Durability::default(), IoMode::Pwrite, 2),
    };
    let recycling = mode.starts_with("recycle");
    let config = if recycling { recycling_config() } else { config(durability) };
    let wal = Arc::new(
        Wal::open_with_options(
            &dir,
            config,
            WalOptions { io, uring_direct_max_bytes: 0, ..WalOptions::default() },
        )
        .unwrap(),
    );
    // The parent checks the path: an `Auto` mode must run on io_uring where the kernel allows.
    println!("path {:?}", wal.io_path());
    let workers: Vec<_> = (0..threads)
        .map(|thread| {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || {
                let mut seed = seed ^ (thread << 40);
                for round in 0u64.. {
                    if recycling && thread == 0 && round % 16 == 15 {
                        clean_behind(&wal);
                    }
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    let batch = if threads == 1 { 1 } else { 1 + (seed >> 58) as usize };
                    let mut appended = Vec::with_capacity(batch);
                    for index in 0..batch {
                        let bytes = payload(seed ^ index as u64, 8 + (seed >> 20) as usize % 300);
                        let (lsn, _) = wal.append_bytes(&bytes, 0).unwrap();
                        appended.push((lsn, crc32c::crc32c(&bytes)));
                    }
                    wal.wait_durable(appended.last().unwrap().0).unwrap();
                    let mut out = std::io::stdout().lock();
                    for (lsn, crc) in appended {
                        writeln!(out, "durable {} {crc}", lsn.0).unwrap();
                    }
                    out.flush().unwrap();
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
}

/// Checks the log after a crash; returns the number of records and whether a tail was cut.
/// `what` names the kill (index, mode, child seed) in every failure message.
fn verify(dir: &Path, printed: &[(u64, u32)], what: &str) -> (u64, bool) {
    let wal = Wal::open(dir, config(Durability::default()))
        .unwrap_or_else(|error| panic!("{what}: reopening the log: {error:?}"));
    let torn = wal.recovery_report().torn_tail.is_some();
    let mut crcs = Vec::new();
    let records = wal
        .iter_from(Lsn::ZERO)
        .unwrap_or_else(|error| panic!("{what}: reading the log: {error:?}"));
    for (index, record) in records.enumerate() {
        let record = record.unwrap_or_else(|error| panic!("{what}: record {index}: {error:?}"));
        assert_eq!(record.lsn.0, index as u64 + 1, "{what}: LSNs are contiguous from 1");
        assert!(self_check(&record.bytes), "{what}: record {} is intact", record.lsn);
        crcs.push(crc32c::crc32c(&record.bytes));
    }
    for (lsn, crc) in printed {
        let stored = crcs.get(*lsn as usize - 1);
        assert_eq!(stored, Some(crc), "{what}: durable LSN {lsn} is present and intact");
    }
    wal.close().unwrap_or_else(|error| panic!("{what}: closing the log: {error:?}"));
    drop(wal);
    // The cut tail stays cut: a second scan finds a clean log.
    let scan = scan_dir(dir, RecoveryMode::Strict)
        .unwrap_or_else(|error| panic!("{what}: scanning the log: {error:?}"));
    assert!(scan.report.torn_tail.is_none(), "{what}: a torn tail after the cut");
    assert_eq!(scan.report.records, crcs.len() as u64, "{what}: records of the second scan");
    (crcs.len() as u64, torn)
}

/// The workload seed of the child of kill `kill`, from the parent's generator state `rng`
/// (which it does not advance, so the kill timings stay as they were): a splitmix64 step.
fn child_seed(rng: u64, kill: u64) -> u64 {
    let mut z = rng ^ kill.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Starts the child in `mode` on `dir` with workload `seed`, waits until its output holds
/// `ready` (at most 30 s), lets it run for a random 0-20 ms (from `rng`), kills it, and returns
/// its complete output lines.
fn run_and_kill(
    dir: &Path,
    mode: &str,
    seed: u64,
    ready: &'static [u8],
    rng: &mut u64,
) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(&exe)
        .args(["--exact", "crash_child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(DIR_VAR, dir)
        .env(MODE_VAR, mode)
        .env(SEED_VAR, seed.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (first_sender, first_receiver) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        let mut signalled = false;
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(read) => {
                    all.extend_from_slice(&buf[..read]);
                    if !signalled && all.windows(ready.len()).any(|window| window == ready) {
                        signalled = true;
                        let _ = first_sender.send(());
                    }
                }
            }
        }
        all
    });
    if let Err(error) = first_receiver.recv_timeout(Duration::from_secs(30)) {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the child ({mode}, seed {seed}) did not get ready within 30 s: {error}");
    }
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    std::thread::sleep(Duration::from_micros(*rng % 20_000));
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child ({mode}, seed {seed}) was killed");
    let output = reader.join().unwrap();
    // Only complete lines count: the kill may cut the last one.
    let complete = match output.iter().rposition(|byte| *byte == b'\n') {
        Some(end) => &output[..end],
        None => &output[..0],
    };
    let lines: Vec<String> = String::from_utf8_lossy(complete).lines().map(str::to_owned).collect();
    // It shares its line with the harness's "test crash_child ... ".
    let path = lines.iter().find_map(|line| line.split("path ").nth(1));
    let io = if mode.ends_with("uring") { IoMode::Auto } else { IoMode::Pwrite };
    let expected = format!("{:?}", wal_support::path_of(io));
    assert_eq!(path, Some(expected.as_str()), "the child's ({mode}, seed {seed}) I/O path");
    lines
}

/// The `durable <lsn> <crc>` lines of a child's output.
fn durable_records(lines: &[String]) -> Vec<(u64, u32)> {
    lines
        .iter()
        .filter_map(|line| {
            // The first record shares its line with the harness's "test crash_child ... ".
            let mut parts = line.split("durable ").nth(1)?.split(' ');
            Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
        })
        .collect()
}

#[test]
fn wal_crash_kill9_keeps_every_durable_record() {
    let dir = tempfile::tempdir().unwrap();
    let modes = ["every-uring", "group-uring", "every-pwrite", "group-pwrite"];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut total_printed = 0usize;
    let mut records = 0;
    let mut torn_tails = 0;
    for kill in 0..KILLS {
        let mode = modes[kill as usize % modes.len()];
        let seed = child_seed(rng, kill);
        let what = format!("kill {kill} ({mode}, child seed {seed})");
        let lines = run_and_kill(dir.path(), mode, seed, b"durable ", &mut rng);
        let printed = durable_records(&lines);
        assert!(!printed.is_empty(), "{what}: nothing printed: {lines:?}");
        total_printed += printed.len();
        let (now, torn) = verify(dir.path(), &printed, &what);
        torn_tails += usize::from(torn);
        assert!(now >= records, "{what}: records never disappear");
        records = now;
    }
    assert!(total_printed as u64 >= KILLS);
    eprintln!(
        "{KILLS} kills, {total_printed} durable records checked, {records} records at the end, \
         {torn_tails} torn tails cut"
    );
}

/// Checks a recycling child's log after a crash: a contiguous run of intact records, every
/// durable record at or above the highest clean threshold the child announced present and
/// intact, and a clean scan after reopening. Returns how many segments are recycled files.
/// `what` names the kill (index, mode, child seed) in every failure message.
fn verify_recycling(dir: &Path, printed: &[(u64, u32)], cleaned_below: u64, what: &str) -> usize {
    let wal = Wal::open(dir, recycling_config())
        .unwrap_or_else(|error| panic!("{what}: reopening the log: {error:?}"));
    let mut stored = std::collections::HashMap::new();
    let mut previous = None;
    let records = wal
        .iter_from(Lsn::ZERO)
        .unwrap_or_else(|error| panic!("{what}: reading the log: {error:?}"));
    for record in records {
        let record = record.unwrap_or_else(|error| panic!("{what}: reading a record: {error:?}"));
        if let Some(previous) = previous {
            assert_eq!(record.lsn.0, previous + 1, "{what}: LSNs are contiguous");
        }
        previous = Some(record.lsn.0);
        assert!(self_check(&record.bytes), "{what}: record {} is intact", record.lsn);
        stored.insert(record.lsn.0, crc32c::crc32c(&record.bytes));
    }
    for (lsn, crc) in printed.iter().filter(|(lsn, _)| *lsn >= cleaned_below) {
        assert_eq!(stored.get(lsn), Some(crc), "{what}: durable LSN {lsn} is present and intact");
    }
    wal.close().unwrap_or_else(|error| panic!("{what}: closing the log: {error:?}"));
    drop(wal);
    let scan = scan_dir(dir, RecoveryMode::Strict)
        .unwrap_or_else(|error| panic!("{what}: scanning the log: {error:?}"));
    assert!(scan.report.torn_tail.is_none(), "{what}: a torn tail after the cut");
    assert_eq!(scan.report.records, stored.len() as u64, "{what}: records of the second scan");
    scan.segments.iter().filter(|segment| segment.recycled).count()
}

/// The same kills, with children that clean behind themselves on 16 KiB segments, so that
/// they keep cleaned segments' files as spares and reuse them (module `wal`, "Recycled
/// segments"); kills land anywhere, during a spare's rename and header write too.
#[test]
fn wal_crash_kill9_with_recycled_segments_keeps_every_durable_record() {
    let dir = tempfile::tempdir().unwrap();
    let modes = ["recycle-uring", "recycle-pwrite"];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let (mut total_printed, mut recycled_seen) = (0usize, 0usize);
    for kill in 0..RECYCLING_KILLS {
        let mode = modes[kill as usize % modes.len()];
        let seed = child_seed(rng, kill);
        let what = format!("kill {kill} ({mode}, child seed {seed})");
        // Killed only after it reused a spare: every child's kill lands among recycled segments.
        let lines = run_and_kill(dir.path(), mode, seed, b"recycled", &mut rng);
        let printed = durable_records(&lines);
        assert!(!printed.is_empty(), "{what}: nothing printed: {lines:?}");
        let cleaned_below = lines
            .iter()
            .filter_map(|line| line.strip_prefix("clean ")?.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        total_printed += printed.len();
        recycled_seen += verify_recycling(dir.path(), &printed, cleaned_below, &what);
    }
    eprintln!(
        "{RECYCLING_KILLS} kills, {total_printed} durable records checked, {recycled_seen} \
         recycled segments seen after the kills"
    );
    // Each child was killed after it reused a spare: recovery must have read recycled files.
    assert!(recycled_seen > 0, "no recycled segment was left for recovery to read");
}
