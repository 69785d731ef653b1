//! The WAL's bounded waits, for callers that must not hang on a disk that stopped answering:
//! - `Wal::close_timeout`: a sync that does not finish fails the close with a typed error
//!   (naming the last appended LSN, the durable one and the bound) instead of hanging the
//!   caller; the log is closing anyway (appends are refused), and once the sync finishes a
//!   later close completes and every appended record is durable;
//! - the drop of a log not closed: it waits at most `WalConfig::drop_close_timeout` for a sync
//!   that does not finish, then returns; the sync thread finishes in the background, and the
//!   record becomes durable and the directory free once the disk answers;
//! - `Wal::append_bytes_timeout`: an append that finds the staging buffer full waits at most
//!   its timeout for room, then fails with a typed error and appends nothing.
//!
//! - `Wal::read_bytes` of a handle this log never returned (stale, or of another log): while
//!   appends wait for the disk, a frame past what was appended to the active segment (or to an
//!   earlier one, once appends moved on), or past the end of a sealed segment, fails at once
//!   with `NotFound`, instead of waiting up to the read's 60 s bound for writes that can never
//!   reach it.
//!
//! Method: a storage whose syncs wait at a gate the test opens (`wal_support`), on the pwrite
//! path with group commit, so the sync thread does every write and sync.

mod wal_support;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use coordbus::wal::{is_locked, Lsn, RecordHandle, Wal, WalConfig, WalError};
use wal_support::{
    gated_config, hold_and_fill_staging, open_gated, open_gated_with, within, AfterGate, Gate,
    OpenOnDrop, RUN_BOUND,
};

/// How long a read of a handle that cannot be answered may take: far below the read's 60 s
/// bound, which is what it took before (the gate keeps what was appended unwritten).
const AT_ONCE: Duration = Duration::from_secs(10);

/// Reads `handle` and returns the reason of its `NotFound`, checking that it came at once.
fn not_found_reason(wal: &Wal, handle: RecordHandle) -> &'static str {
    let started = Instant::now();
    let result = wal.read_bytes(handle);
    let waited = started.elapsed();
    assert!(waited < AT_ONCE, "the read of {handle:?} waited {waited:?}");
    match result {
        Err(WalError::NotFound { reason, .. }) => reason,
        Err(other) => panic!("expected NotFound for {handle:?}, got {other}"),
        Ok(record) => panic!("read {:?} at {handle:?}", &record[..]),
    }
}

fn payloads(wal: &Wal) -> Vec<Vec<u8>> {
    wal.iter_from(Lsn::ZERO).unwrap().map(|record| record.unwrap().bytes.to_vec()).collect()
}

#[test]
fn a_close_whose_sync_does_not_finish_times_out_refuses_appends_and_completes_later() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let wal = open_gated(dir.path(), &gate, AfterGate::Sync);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    let (first, _) = wal.append_bytes(b"first", 1).unwrap();
    let (last, _) = wal.append_bytes(b"last", 2).unwrap();
    assert!(first < last);

    let timeout = Duration::from_millis(100);
    let started = Instant::now();
    let error = wal.close_timeout(timeout).unwrap_err();
    let waited = started.elapsed();
    match error {
        WalError::CloseTimedOut { appended, durable, timeout: reported } => {
            assert_eq!(appended, last.0, "the timeout names the last appended record");
            assert!(durable < first.0, "nothing could be durable yet (durable {durable})");
            assert_eq!(reported, timeout);
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(waited >= timeout, "returned before its bound: {waited:?}");
    assert!(waited < RUN_BOUND, "the close waited {waited:?}");
    assert!(
        matches!(wal.append_bytes(b"after", 3), Err(WalError::Closed)),
        "a log that is closing accepted an append"
    );

    gate.open();
    wal.close_timeout(RUN_BOUND).unwrap();
    assert!(wal.durable_lsn() >= last, "the close returned before the records were durable");
    drop(wal);
    let reopened = Wal::open(dir.path(), gated_config()).unwrap();
    assert_eq!(payloads(&reopened), [b"first".to_vec(), b"last".to_vec()]);
}

#[test]
fn dropping_a_log_whose_sync_does_not_finish_waits_at_most_its_drop_close_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let drop_close_timeout = Duration::from_millis(100);
    let config = WalConfig { drop_close_timeout, ..gated_config() };
    let wal = open_gated_with(dir.path(), &gate, AfterGate::Sync, config);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    wal.append_bytes(b"held", 1).unwrap();
    gate.wait_until_reached(1);

    let started = Instant::now();
    within(move || drop(wal));
    let waited = started.elapsed();
    assert!(waited >= drop_close_timeout, "returned before its bound: {waited:?}");
    assert!(waited < RUN_BOUND, "the drop waited {waited:?}");
    assert!(is_locked(dir.path()).unwrap(), "the sync thread still holds the log");

    gate.open();
    // The sync thread writes and syncs the record, then ends and frees the directory.
    let deadline = Instant::now() + RUN_BOUND;
    while is_locked(dir.path()).unwrap() {
        assert!(Instant::now() < deadline, "the sync thread never finished");
        std::thread::sleep(Duration::from_millis(1));
    }
    let reopened = Wal::open(dir.path(), gated_config()).unwrap();
    assert_eq!(payloads(&reopened), [b"held".to_vec()]);
}

#[test]
fn a_healthy_close_timeout_syncs_everything_and_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), gated_config()).unwrap();
    let (last, _) = (0..100u8).map(|i| wal.append_bytes(&[i; 64], 1).unwrap()).last().unwrap();
    wal.close_timeout(RUN_BOUND).unwrap();
    assert!(wal.durable_lsn() >= last);
    wal.close_timeout(RUN_BOUND).unwrap();
    wal.close().unwrap();
    drop(wal);
    let reopened = Wal::open(dir.path(), gated_config()).unwrap();
    assert_eq!(payloads(&reopened).len(), 100);
}

#[test]
fn an_append_that_finds_no_room_in_time_fails_and_appends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let wal = open_gated(dir.path(), &gate, AfterGate::Sync);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    let timeout = Duration::from_millis(50);
    // The sync thread is held at its first sync; the staging buffer fills behind it.
    let appended = hold_and_fill_staging(&wal, &gate, 64 << 10, timeout);
    let started = Instant::now();
    let error = wal.append_bytes_timeout(&[7u8; 64 << 10], 1, timeout).unwrap_err();
    let waited = started.elapsed();
    assert!(waited >= timeout, "gave up after {waited:?}");
    assert!(waited < RUN_BOUND, "waited {waited:?}");
    let last = *appended.last().expect("some appends found room");
    match error {
        WalError::AppendTimedOut { timeout: reported, appended: reported_last, durable } => {
            assert_eq!(reported, timeout);
            assert_eq!(reported_last, last.0, "the error names the last appended LSN");
            assert!(durable < last.0, "durable {durable}");
        }
        other => panic!("expected AppendTimedOut, got {other}"),
    }
    assert_eq!(wal.appended_lsn(), last, "the refused append appended nothing");

    gate.open();
    let (after, _) = wal.append_bytes_timeout(b"after", 2, RUN_BOUND).unwrap();
    assert_eq!(after.0, last.0 + 1, "no LSN was used by the refused append");
    wal.close_timeout(RUN_BOUND).unwrap();
    drop(wal);
    let reopened = Wal::open(dir.path(), gated_config()).unwrap();
    assert_eq!(payloads(&reopened).len(), appended.len() + 1);
}

/// After a close that timed out, dropping the log does not wait for the stuck sync thread
/// either (it finishes in the background once the disk answers).
#[test]
fn dropping_a_log_whose_close_timed_out_does_not_wait_for_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let wal = open_gated(dir.path(), &gate, AfterGate::Sync);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    wal.append_bytes(b"held", 1).unwrap();
    gate.wait_until_reached(1);
    assert!(matches!(
        wal.close_timeout(Duration::from_millis(20)),
        Err(WalError::CloseTimedOut { .. })
    ));
    let started = Instant::now();
    drop(wal);
    let waited = started.elapsed();
    gate.open();
    assert!(waited < Duration::from_secs(5), "the drop waited {waited:?} for the stuck disk");
    // The sync thread finishes in the background: the log then reopens with the record.
    let deadline = Instant::now() + RUN_BOUND;
    let reopened = loop {
        match Wal::open(dir.path(), gated_config()) {
            Ok(wal) => break wal,
            Err(WalError::Locked { .. }) if Instant::now() < deadline => std::thread::yield_now(),
            Err(error) => panic!("reopening: {error}"),
        }
    };
    assert_eq!(payloads(&reopened), [b"held".to_vec()]);
}

/// The epoch log's appends are bounded too: a `DurableQuery` whose WAL stays full (the disk
/// stalled) fails the append after its write timeout with a typed error, which stops the query
/// (the coordinator's thread is not held for good), and nothing is appended.
#[test]
fn the_epoch_logs_append_on_a_stalled_disk_fails_after_its_write_timeout() {
    use coordbus::coordinators::epoch::{
        DurableQuery, Epoch, EpochError, NoopQuery, Offsets, PartitionId, Payload, Query,
    };
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let timeout = Duration::from_millis(200);
    let mut query =
        DurableQuery::from_wal(open_gated(dir.path(), &gate, AfterGate::Sync), NoopQuery)
            .unwrap()
            .with_write_timeout(timeout);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    hold_and_fill_staging(query.wal(), &gate, 4096, Duration::from_millis(50));
    let appended = query.wal().appended_lsn();
    let offsets: Vec<(PartitionId, Payload)> =
        (0..64).map(|p| (PartitionId(p), Payload::from(vec![7u8; 64]))).collect();
    let started = Instant::now();
    let error = query.add_offsets(Epoch(0), Offsets::new(&offsets)).unwrap_err();
    let waited = started.elapsed();
    assert!(waited >= timeout && waited < RUN_BOUND / 2, "waited {waited:?}");
    match error.downcast_ref::<EpochError>() {
        Some(EpochError::Wal { source: WalError::AppendTimedOut { .. }, .. }) => {}
        other => panic!("expected the append's timeout, got {other:?} ({error})"),
    }
    assert_eq!(query.wal().appended_lsn(), appended, "nothing was appended");
}

#[test]
fn a_read_past_what_was_appended_fails_at_once_while_the_disk_holds_the_appends() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let wal = open_gated(dir.path(), &gate, AfterGate::Sync);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    let (_, appended) = wal.append_bytes(b"appended", 1).unwrap();
    // The sync thread is held in the record's sync: it is appended, not yet written.
    gate.wait_until_reached(1);
    let never_appended = RecordHandle { offset: appended.offset + 4096, ..appended };
    assert_eq!(not_found_reason(&wal, never_appended), "offset past the end of what was appended");

    gate.open();
    assert_eq!(&wal.read_bytes(appended).unwrap()[..], b"appended");
}

#[test]
fn a_read_past_the_end_of_a_sealed_segment_fails_at_once_while_the_disk_holds_the_appends() {
    let dir = tempfile::tempdir().unwrap();
    let earlier = {
        let wal = Wal::open(dir.path(), gated_config()).unwrap();
        let (_, handle) = wal.append_bytes(b"earlier", 1).unwrap();
        wal.close().unwrap();
        handle
    };
    let gate = Arc::new(Gate::default());
    let wal = open_gated(dir.path(), &gate, AfterGate::Sync);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    // The first append of a reopened log starts a new segment; the recovered one is sealed.
    let (_, appended) = wal.append_bytes(b"appended", 2).unwrap();
    assert_ne!(appended.segment, earlier.segment);
    gate.wait_until_reached(1);
    let past_the_end = RecordHandle { offset: earlier.offset + 4096, ..earlier };
    assert_eq!(not_found_reason(&wal, past_the_end), "offset past the end of its sealed segment");
    assert_eq!(&wal.read_bytes(earlier).unwrap()[..], b"earlier");

    gate.open();
    assert_eq!(&wal.read_bytes(appended).unwrap()[..], b"appended");
}

#[test]
fn a_read_past_where_appends_to_a_rolled_segment_ended_fails_at_once_while_the_disk_holds_them() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let wal = open_gated(dir.path(), &gate, AfterGate::Sync);
    let _open_gate_on_exit = OpenOnDrop(Arc::clone(&gate));
    // Three records of 300 KiB fill most of a 1 MiB segment; the fourth rolls to the next.
    let payload = vec![0x5a; 300 << 10];
    let (_, first) = wal.append_bytes(&payload, 1).unwrap();
    // The sync thread is held in the first record's sync: the rest stay staged, unwritten,
    // and the first segment is not sealed.
    gate.wait_until_reached(1);
    let (_, third) = (0..2).map(|_| wal.append_bytes(&payload, 1).unwrap()).last().unwrap();
    let (_, rolled) = wal.append_bytes(&payload, 1).unwrap();
    assert_eq!(third.segment, first.segment);
    assert_ne!(rolled.segment, first.segment, "the fourth record rolled");
    let appended_end = third.offset + (300 << 10) + 32;
    let never_appended =
        RecordHandle { offset: appended_end.next_multiple_of(4096) + 4096, ..third };
    assert_eq!(not_found_reason(&wal, never_appended), "offset past the end of what was appended");

    gate.open();
    assert_eq!(wal.read_bytes(third).unwrap().len(), 300 << 10);
    assert_eq!(wal.read_bytes(rolled).unwrap().len(), 300 << 10);
}
