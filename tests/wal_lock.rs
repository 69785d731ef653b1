//! The directory lock: never two writers on one log directory.
//!
//! Goal: a second `Wal::open` for writing on a directory that is already open (in this process
//! or another) fails with `WalError::Locked` naming the directory; close, drop and the death of
//! the holding process release the lock; read-only opens still work on a locked directory and
//! `is_locked` reports the holder; a log opened on a missing directory that another writer
//! creates first fails at its first write instead of writing beside it.
//! Method: opens in this process on temporary directories; for the other-process case the test
//! re-executes its own binary (`current_exe`) filtered to `lock_child`, which opens the log,
//! appends one durable record, prints `ready` and waits for stdin; the parent checks the lock,
//! kills the child with SIGKILL, and opens again.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use coordbus::wal::{
    is_locked, Durability, Lsn, Wal, WalConfig, WalError, WalOptions, UNSYNCED_MARKER,
};

const DIR_VAR: &str = "COORDBUS_WAL_LOCK_DIR";
const READY: &str = "lock-child-ready";
/// Bound of a durability wait: far longer than a sync; a wait that has not returned by then is
/// hung, and fails the test instead of hanging it.
const WAIT: Duration = Duration::from_secs(30);

fn config() -> WalConfig {
    WalConfig {
        segment_size_bytes: 64 << 10,
        durability: Durability::EveryRecord,
        ..WalConfig::default()
    }
}

fn assert_locked(result: Result<Wal, WalError>, dir: &std::path::Path) {
    match result {
        Err(WalError::Locked { dir: locked }) => assert_eq!(locked, dir),
        Err(other) => panic!("expected Locked, got {other:?}"),
        Ok(_) => panic!("a second writer opened {}", dir.display()),
    }
}

/// Asserts the directory is not locked: polled for a while, since a child process another
/// test of this binary spawns holds a copy of every descriptor between its fork and its exec
/// (module `wal::lock`), the lock's too, for that moment.
fn assert_unlocked(dir: &std::path::Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while is_locked(dir).unwrap() {
        assert!(std::time::Instant::now() < deadline, "{} is still locked", dir.display());
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_second_open_in_this_process_is_locked_until_the_first_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let first = Wal::open(dir.path(), config()).unwrap();
    let (lsn, _) = first.append_bytes(b"first", 1).unwrap();
    first.wait_durable_timeout(lsn, WAIT).unwrap();
    assert_locked(Wal::open(dir.path(), config()), dir.path());
    let error = Wal::open(dir.path(), config()).unwrap_err();
    assert!(error.to_string().contains(&format!("{:?}", dir.path())), "{error}");
    drop(first);
    let second = Wal::open(dir.path(), config()).unwrap();
    let (lsn, _) = second.append_bytes(b"second", 2).unwrap();
    second.wait_durable_timeout(lsn, WAIT).unwrap();
    let records: Vec<Vec<u8>> =
        second.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap().bytes.to_vec()).collect();
    assert_eq!(records, vec![b"first".to_vec(), b"second".to_vec()]);
}

#[test]
fn close_releases_the_lock_even_while_the_object_lives() {
    let dir = tempfile::tempdir().unwrap();
    let first = Wal::open(dir.path(), config()).unwrap();
    first.append_bytes(b"x", 1).unwrap();
    assert!(is_locked(dir.path()).unwrap());
    first.close().unwrap();
    assert_unlocked(dir.path());
    let second = Wal::open(dir.path(), config()).unwrap();
    assert_eq!(second.recovery_report().last_lsn, Lsn(1));
    // The closed object still reads, and does not take the lock back.
    assert_eq!(first.iter_from(Lsn::ZERO).unwrap().count(), 1);
    assert_locked(Wal::open(dir.path(), config()), dir.path());
}

#[test]
fn read_only_opens_work_on_a_locked_directory_and_see_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let writer = Wal::open(dir.path(), config()).unwrap();
    let (lsn, _) = writer.append_bytes(b"live", 1).unwrap();
    writer.wait_durable_timeout(lsn, WAIT).unwrap();
    assert!(is_locked(dir.path()).unwrap());
    let reader = Wal::open_with_options(
        dir.path(),
        config(),
        WalOptions { read_only: true, ..WalOptions::default() },
    )
    .unwrap();
    assert_eq!(reader.iter_from(Lsn::ZERO).unwrap().count(), 1);
    // Two read-only opens at once are fine too, and neither blocks the writer.
    let reader_two = Wal::open_with_options(
        dir.path(),
        config(),
        WalOptions { read_only: true, ..WalOptions::default() },
    )
    .unwrap();
    drop((reader, reader_two));
    let (lsn, _) = writer.append_bytes(b"more", 2).unwrap();
    writer.wait_durable_timeout(lsn, WAIT).unwrap();
}

#[test]
fn a_missing_directory_created_by_another_writer_fails_the_late_writer_at_its_first_write() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("wal");
    // Nothing exists to lock yet, so both opens succeed (opening creates nothing: SPEC E.3).
    let early = Wal::open(&dir, config()).unwrap();
    let late = Wal::open(&dir, config()).unwrap();
    assert!(!dir.exists());
    let (lsn, _) = early.append_bytes(b"early", 1).unwrap();
    early.wait_durable_timeout(lsn, WAIT).unwrap();
    let (lsn, _) = late.append_bytes(b"late", 2).unwrap();
    let error = late.wait_durable_timeout(lsn, Duration::from_secs(10)).unwrap_err();
    match error.root_cause() {
        WalError::Locked { dir: locked } => assert_eq!(locked, &dir),
        other => panic!("expected Locked as the cause, got {other:?}"),
    }
    assert!(matches!(late.append_bytes(b"later", 3), Err(WalError::Failed { .. })));
    drop(late);
    // The late writer failed, but the directory is not its own: it leaves no failed-log
    // marker there (one naming its durable LSN, 0, would cut the early writer's records).
    assert!(!dir.join(UNSYNCED_MARKER).exists());
    let (lsn, _) = early.append_bytes(b"early two", 4).unwrap();
    early.wait_durable_timeout(lsn, WAIT).unwrap();
    let records = |wal: &Wal| -> Vec<Vec<u8>> {
        wal.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap().bytes.to_vec()).collect()
    };
    assert_eq!(records(&early), vec![b"early".to_vec(), b"early two".to_vec()]);
    drop(early);
    let reopened = Wal::open(&dir, config()).unwrap();
    assert_eq!(records(&reopened), vec![b"early".to_vec(), b"early two".to_vec()]);
}

/// The same, but the early writer closes (letting go of the lock) before the late one first
/// writes: the late writer's empty recovered state is stale, so it fails and writes nothing
/// (before, it took the free lock, failed creating a segment file of the same name, and left a
/// marker naming LSN 0, which cut every record of the early writer at the next open).
#[test]
fn a_late_writer_finding_a_log_made_since_its_open_writes_nothing_there() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("wal");
    let early = Wal::open(&dir, config()).unwrap();
    let late = Wal::open(&dir, config()).unwrap();
    let (lsn, _) = early.append_bytes(b"early", 1).unwrap();
    early.wait_durable_timeout(lsn, WAIT).unwrap();
    early.close().unwrap();
    drop(early);
    let (lsn, _) = late.append_bytes(b"late", 2).unwrap();
    let error = late.wait_durable_timeout(lsn, Duration::from_secs(10)).unwrap_err();
    match error.root_cause() {
        WalError::ChangedSinceOpen { dir: changed, found } => {
            assert_eq!(changed, &dir);
            assert!(found.starts_with(&dir), "{found:?}");
        }
        other => panic!("expected ChangedSinceOpen as the cause, got {other:?}"),
    }
    drop(late);
    assert!(!dir.join(UNSYNCED_MARKER).exists());
    let reopened = Wal::open(&dir, config()).unwrap();
    let records: Vec<Vec<u8>> =
        reopened.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap().bytes.to_vec()).collect();
    assert_eq!(records, vec![b"early".to_vec()]);
}

/// The other process: holds the log open until killed. Ignored in a plain run (it is not a
/// test of its own); the parent starts it with `--ignored`.
#[test]
#[ignore = "a child process: the lock test starts it"]
fn lock_child() {
    let Ok(dir) = std::env::var(DIR_VAR) else {
        return;
    };
    let wal = Wal::open(&dir, config()).unwrap();
    let (lsn, _) = wal.append_bytes(b"child", 1).unwrap();
    wal.wait_durable(lsn).unwrap();
    println!("\n{READY}");
    let mut line = String::new();
    // Blocks until the parent kills this process (or closes stdin).
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn another_process_holding_the_log_locks_it_and_its_death_releases_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "lock_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(DIR_VAR, dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Lines are read on a thread so a child that never gets ready fails the test in bounded
    // time instead of hanging it.
    let stdout = child.stdout.take().unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.trim() == READY {
                let _ = sender.send(());
            }
        }
    });
    if receiver.recv_timeout(Duration::from_secs(60)).is_err() {
        child.kill().unwrap();
        child.wait().unwrap();
        panic!("the child never reported the log open");
    }
    assert!(is_locked(dir.path()).unwrap());
    assert_locked(Wal::open(dir.path(), config()), dir.path());
    // kill -9: the kernel releases the flock with the dead process's descriptors.
    child.kill().unwrap();
    child.wait().unwrap();
    reader.join().unwrap();
    assert_unlocked(dir.path());
    let wal = Wal::open(dir.path(), config()).unwrap();
    let records: Vec<Vec<u8>> =
        wal.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap().bytes.to_vec()).collect();
    assert_eq!(records, vec![b"child".to_vec()]);
}
