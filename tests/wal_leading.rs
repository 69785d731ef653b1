//! `EveryRecord` leading: a thread waiting for its record's durability writes and syncs the
//! staged group itself when the writer is free (module `wal::writer`, "Leading").
//!
//! Goal: leading keeps every promise of the sync thread: each waited record is durable and
//! intact, a record nobody waits for is still written, durability callbacks run on the sync
//! thread (never on a leader's), concurrent waiters all finish, and group commit never leads.
//! Method: the public API on a temporary directory, on both I/O paths (io_uring when the
//! kernel allows it, and pwrite); `WalStats::led_groups` tells groups a leader wrote from
//! groups the sync thread wrote.

mod wal_support;

use std::{
    sync::{mpsc, Arc},
    time::{Duration, Instant},
};

use coordbus::wal::{Durability, IoMode, Lsn, Wal, WalConfig, WalOptions};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use wal_support::{bounded, RUN_BOUND};

/// How long a test waits for something that takes microseconds, before failing.
const BOUND: Duration = Duration::from_secs(10);

fn io_modes() -> [IoMode; 2] {
    [IoMode::Auto, IoMode::Pwrite]
}

/// Opens the log; the `Auto` variants are io_uring runs wherever the kernel allows it.
fn open(dir: &std::path::Path, durability: Durability, io: IoMode) -> Wal {
    let wal = Wal::open_with_options(
        dir,
        WalConfig { segment_size_bytes: 1 << 20, durability, ..WalConfig::default() },
        WalOptions { io, ..WalOptions::default() },
    )
    .unwrap();
    assert_eq!(wal.io_path(), wal_support::path_of(io));
    wal
}

fn payload(index: u32) -> Vec<u8> {
    (0..64).map(|byte| (byte as u32 ^ index) as u8).collect()
}

/// Appends and waits for each of `count` records; checks each is durable on return. The waits
/// have no timeout, so that they may lead: run it on a thread of its own (`bounded`).
fn append_and_wait(wal: &Wal, first: u32, count: u32) -> Vec<(Lsn, coordbus::wal::RecordHandle)> {
    (first..first + count)
        .map(|index| {
            let (lsn, handle) = wal.append_bytes(&payload(index), i64::from(index)).unwrap();
            wal.wait_durable(lsn).unwrap();
            assert!(wal.durable_lsn() >= lsn, "wait_durable returned before {lsn} was durable");
            (lsn, handle)
        })
        .collect()
}

/// Rounds of ten appended and waited records (each round bounded), at most ten, until a waiter
/// has led. Whether a waiter or the sync thread takes the writer first is a race (the first
/// append to an idle log wakes the sync thread), which a loaded machine can lose several times
/// in a row; a hundred losses in a row mean leading is broken.
fn append_and_wait_until_led(wal: &Arc<Wal>) -> Vec<(Lsn, coordbus::wal::RecordHandle)> {
    let mut written = Vec::new();
    for round in 0..10u32 {
        written.extend(bounded(wal, move |wal| append_and_wait(wal, round * 10, 10)));
        if wal.stats().led_groups > 0 {
            break;
        }
    }
    written
}

#[test]
fn every_record_waiters_write_their_own_groups() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(open(dir.path(), Durability::EveryRecord, io));
        let written = append_and_wait_until_led(&wal);
        let stats = wal.stats();
        assert!(stats.led_groups > 0, "no waiter led ({io:?}): {stats:?}");
        assert!(stats.led_groups <= stats.groups, "{stats:?}");
        assert!(stats.syncs >= stats.groups, "a group became durable without a sync: {stats:?}");
        for (index, (_, handle)) in written.iter().enumerate() {
            assert_eq!(wal.read_bytes(*handle).unwrap().as_ref(), &payload(index as u32)[..]);
        }
        wal.close().unwrap();
        drop(wal);
        let reopened = open(dir.path(), Durability::EveryRecord, io);
        assert_eq!(reopened.durable_lsn(), written.last().unwrap().0);
    }
}

#[test]
fn group_commit_waiters_never_lead() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let durability =
            Durability::GroupCommit { max_delay: Duration::from_micros(200), max_bytes: 1 << 20 };
        let wal = Arc::new(open(dir.path(), durability, io));
        bounded(&wal, |wal| append_and_wait(wal, 0, 20));
        let stats = wal.stats();
        assert_eq!(stats.led_groups, 0, "{stats:?}");
        assert!(stats.groups > 0, "{stats:?}");
    }
}

#[test]
fn a_record_nobody_waits_for_is_written_while_waiters_lead() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(open(dir.path(), Durability::EveryRecord, io));
        // Leaders have led: appends no longer wake the sync thread.
        append_and_wait_until_led(&wal);
        assert!(wal.stats().led_groups > 0, "no waiter led ({io:?}): {:?}", wal.stats());
        let (lsn, handle) = wal.append_bytes(&payload(99), 99).unwrap();
        // Nobody waits, registers a callback or reads: the sync thread must find it alone.
        let started = Instant::now();
        while wal.durable_lsn() < lsn {
            assert!(started.elapsed() < BOUND, "a record nobody waited for was never written");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(wal.read_bytes(handle).unwrap().as_ref(), &payload(99)[..]);
    }
}

#[test]
fn durability_callbacks_of_led_groups_run_on_the_sync_thread() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(open(dir.path(), Durability::EveryRecord, io));
        bounded(&wal, |wal| append_and_wait(wal, 0, 5));
        let led_before = wal.stats().led_groups;
        // At least 20 records, and on until one of their groups was led (a loaded machine
        // may leave a record's group to the sync thread: module doc of `wal`, leaders).
        let led = |wal: &Wal| wal.stats().led_groups > led_before;
        let mut index = 0u32;
        while index < 20 || (!led(&wal) && index < 200) {
            let (sender, receiver) = mpsc::channel();
            // Appended, called back and waited for on one thread, as a real waiter does (a
            // wait that starts later leaves the group to the sync thread).
            bounded(&wal, move |wal| {
                let (lsn, _) = wal.append_bytes(&payload(index), 0).unwrap();
                wal.notify_when_durable(
                    lsn,
                    Box::new(move |result| {
                        let thread = std::thread::current().name().map(str::to_owned);
                        sender.send((result.is_ok(), thread)).unwrap();
                    }),
                );
                wal.wait_durable(lsn)
            })
            .unwrap();
            let (ok, thread) = receiver.recv_timeout(BOUND).expect("the callback never ran");
            assert!(ok);
            assert_eq!(thread.as_deref(), Some("coordbus-wal-sync"), "record {index} ({io:?})");
            index += 1;
        }
        // At least some of those groups were led (else this test proved nothing about leaders).
        assert!(led(&wal), "{:?}", wal.stats());
    }
}

#[test]
fn concurrent_every_record_waiters_all_finish_durable() {
    const THREADS: u32 = 4;
    const PER_THREAD: u32 = 200;
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(open(dir.path(), Durability::EveryRecord, io));
        let workers: Vec<_> = (0..THREADS)
            .map(|thread| {
                let wal = Arc::clone(&wal);
                std::thread::spawn(move || append_and_wait(&wal, thread * PER_THREAD, PER_THREAD))
            })
            .collect();
        // Joined once all are done (bounded): their waits have no timeout.
        let deadline = Instant::now() + RUN_BOUND;
        while !workers.iter().all(|worker| worker.is_finished()) {
            assert!(Instant::now() < deadline, "a worker never finished ({io:?})");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut lsns: Vec<Lsn> = Vec::new();
        for (thread, worker) in workers.into_iter().enumerate() {
            let written = worker.join().unwrap();
            for (offset, (lsn, handle)) in written.iter().enumerate() {
                let index = thread as u32 * PER_THREAD + offset as u32;
                assert_eq!(wal.read_bytes(*handle).unwrap().as_ref(), &payload(index)[..]);
                lsns.push(*lsn);
            }
        }
        lsns.sort();
        lsns.dedup();
        assert_eq!(lsns.len(), (THREADS * PER_THREAD) as usize, "an LSN was given twice");
        let stats = wal.stats();
        assert_eq!(stats.appends, u64::from(THREADS * PER_THREAD));
        assert_eq!(stats.durable_lsn, *lsns.last().unwrap());
    }
}

#[test]
fn mixed_waiters_callbacks_readers_and_unwaited_appends_all_finish() {
    const THREADS: u64 = 4;
    const PER_THREAD: u64 = 300;
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(open(dir.path(), Durability::EveryRecord, io));
        let (callbacks_sender, callbacks) = mpsc::channel::<(Lsn, bool)>();
        let (done_sender, done) =
            mpsc::channel::<(Vec<(Lsn, coordbus::wal::RecordHandle, u32)>, usize)>();
        for thread in 0..THREADS {
            let wal = Arc::clone(&wal);
            let callbacks_sender = callbacks_sender.clone();
            let done_sender = done_sender.clone();
            std::thread::spawn(move || {
                // Seeded, so that every run draws the same mix.
                let mut draw = XorShiftRng::seed_from_u64(0x9e37_79b9_7f4a_7c15 ^ (thread + 1));
                let mut written = Vec::new();
                let mut registered = 0;
                for step in 0..PER_THREAD {
                    let index = (thread * PER_THREAD + step) as u32;
                    let (lsn, handle) = wal.append_bytes(&payload(index), 0).unwrap();
                    match draw.random_range(0..5) {
                        0 => wal.wait_durable(lsn).unwrap(),
                        1 => wal.wait_durable_timeout(lsn, BOUND).unwrap(),
                        2 => {
                            registered += 1;
                            let sender = callbacks_sender.clone();
                            wal.notify_when_durable(
                                lsn,
                                Box::new(move |result| sender.send((lsn, result.is_ok())).unwrap()),
                            );
                        }
                        3 => assert_eq!(
                            wal.read_bytes(handle).unwrap().as_ref(),
                            &payload(index)[..]
                        ),
                        _ => {} // nobody waits for this one
                    }
                    written.push((lsn, handle, index));
                }
                done_sender.send((written, registered)).unwrap();
            });
        }
        drop(callbacks_sender);
        drop(done_sender);
        // Bounded: a lost wake-up fails the test instead of hanging it.
        let mut all = Vec::new();
        let mut registered = 0;
        for _ in 0..THREADS {
            let (written, callbacks) =
                done.recv_timeout(Duration::from_secs(60)).expect("a thread never finished");
            all.extend(written);
            registered += callbacks;
        }
        let last = all.iter().map(|(lsn, _, _)| *lsn).max().unwrap();
        wal.wait_durable_timeout(last, BOUND).unwrap();
        for (lsn, handle, index) in &all {
            assert!(wal.durable_lsn() >= *lsn);
            assert_eq!(wal.read_bytes(*handle).unwrap().as_ref(), &payload(*index)[..]);
        }
        wal.close().unwrap();
        drop(wal);
        // Every callback ran once, with Ok (the log closed only after all were durable). All
        // are collected once the last sender is gone (bounded: a callback the log kept and
        // never ran nor dropped fails the test instead of hanging it).
        let mut fired: Vec<(Lsn, bool)> = Vec::new();
        loop {
            match callbacks.recv_timeout(BOUND) {
                Ok(outcome) => fired.push(outcome),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("a durability callback was kept, never run nor dropped ({io:?})")
                }
            }
        }
        assert!(!fired.is_empty());
        assert!(fired.iter().all(|(_, ok)| *ok), "a callback got an error");
        let mut lsns: Vec<Lsn> = fired.iter().map(|(lsn, _)| *lsn).collect();
        lsns.sort();
        lsns.dedup();
        assert_eq!(lsns.len(), fired.len(), "a callback ran twice");
        assert_eq!(fired.len(), registered, "a callback never ran");
        assert_eq!(all.len(), (THREADS * PER_THREAD) as usize);
    }
}
