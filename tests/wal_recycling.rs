//! Recycled segments: cleaned segments' files kept as spares and reused for new segments.
//!
//! Goal: reuse never costs a record. A reopened log holds exactly what was appended after the
//! clean point, though its recycled files still hold the frames of their earlier use past its
//! records; a torn record in a recycled last segment is cut like any torn tail, and records
//! missing at the end of a recycled sealed segment are still corruption. A segment whose
//! mapping a reader still holds (of this log, or a read-only log of the same directory, as a
//! tool in another process) is deleted, never reused, so the reader's bytes never change; so is
//! a segment found at open. Spares are bounded by the configuration, deleted when a log is
//! closed, and those a crash left deleted when a writer opens the log.
//! Method: 64 KiB segments of ~1 KiB records with the record index as its time, cleaned by
//! time with `wait`, on both I/O paths (`Auto` is io_uring unless the kernel refuses it);
//! damage written into the files by hand, then reopened or scanned read-only.

mod wal_support;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use coordbus::wal::{
    scan_dir, segment, Durability, IoMode, Lsn, RecoveryMode, Wal, WalConfig, WalError, WalOptions,
};

const SEGMENT_SIZE: u64 = 64 << 10;
/// Bound of a durability wait: far longer than a sync; a wait that has not returned by then is
/// hung, and fails the test instead of hanging it.
const WAIT: Duration = Duration::from_secs(30);

fn config() -> WalConfig {
    WalConfig {
        segment_size_bytes: SEGMENT_SIZE,
        durability: Durability::GroupCommit {
            max_delay: Duration::from_micros(100),
            max_bytes: 1 << 20,
        },
        ..WalConfig::default()
    }
}

/// Opens on `io`'s path, checked: `Auto` must be io_uring unless the kernel refuses it, so a
/// silent fallback cannot pass as an io_uring run.
fn open_with(dir: &Path, config: WalConfig, io: IoMode) -> Wal {
    let wal =
        Wal::open_with_options(dir, config, WalOptions { io, ..WalOptions::default() }).unwrap();
    assert_eq!(wal.io_path(), wal_support::path_of(io));
    wal
}

fn open_with_spares(dir: &Path, spare_segments: usize) -> Wal {
    let options = WalOptions { spare_segments, ..WalOptions::default() };
    Wal::open_with_options(dir, config(), options).unwrap()
}

/// A record of ~1 KiB that names its index (so a stale frame is never mistaken for it).
fn payload(index: u64) -> Vec<u8> {
    let mut bytes = index.to_le_bytes().to_vec();
    bytes.extend((0..1000 + index % 40).map(|at| (index as u8).wrapping_mul(31) ^ at as u8));
    bytes
}

/// Appends records `range` with their index as time, and waits until they are durable.
fn append(wal: &Wal, range: std::ops::Range<u64>) {
    let mut last = Lsn::ZERO;
    for index in range {
        last = wal.append_bytes(&payload(index), index as i64).unwrap().0;
    }
    wal.wait_durable_timeout(last, WAIT).unwrap();
}

/// Every record's payload, in order.
fn read_all(wal: &Wal) -> Vec<Vec<u8>> {
    wal.iter_from(Lsn::ZERO).unwrap().map(|record| record.unwrap().bytes.to_vec()).collect()
}

fn files_named(dir: &Path, select: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.file_name().and_then(|name| name.to_str()).is_some_and(&select))
        .collect();
    files.sort();
    files
}

fn spares(dir: &Path) -> Vec<PathBuf> {
    files_named(dir, segment::is_spare_file_name)
}

/// Cleans below `threshold` without `wait` (the sync thread retires the segments between
/// its groups, as under a coordinator) and waits until it has. Returns how many it took.
fn clean_below(wal: &Wal, threshold: i64) -> u64 {
    let before = wal.stats().cleaned_segments;
    let queued = wal.clean(threshold, false).unwrap().queued.len() as u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while wal.stats().cleaned_segments < before + queued {
        assert!(std::time::Instant::now() < deadline, "segments not retired in 10 s");
        std::thread::yield_now();
    }
    queued
}

/// Writes 0..330 with a clean below 150 after 200: two segments of the first records become
/// spares and carry the last ones, the last segment among them. Returns the log, still open.
fn log_with_recycled_segments(dir: &Path, io: IoMode) -> Wal {
    let wal = open_with(dir, config(), io);
    append(&wal, 0..200);
    assert!(clean_below(&wal, 150) >= 2);
    assert_eq!(spares(dir).len(), 2);
    assert_eq!(wal.stats().spare_segments, 2);
    append(&wal, 200..330);
    let stats = wal.stats();
    assert_eq!((stats.recycled_segments, stats.spare_segments), (2, 0), "{stats:?}");
    assert!(spares(dir).is_empty());
    wal
}

/// A closed log whose last segment was made from a spare: its records, and that segment.
fn closed_log_ending_recycled(dir: &Path) -> (Vec<Vec<u8>>, coordbus::wal::SegmentSummary) {
    let wal = log_with_recycled_segments(dir, IoMode::Auto);
    let expected = read_all(&wal);
    wal.close().unwrap();
    let scan = scan_dir(dir, RecoveryMode::Strict).unwrap();
    let last = scan.segments.last().unwrap().clone();
    assert!(last.recycled, "the last segment was made from a spare");
    (expected, last)
}

#[test]
fn recycled_segments_reopen_with_exactly_their_records_on_both_paths() {
    for io in [IoMode::Auto, IoMode::Pwrite] {
        let dir = tempfile::tempdir().unwrap();
        let wal = log_with_recycled_segments(dir.path(), io);
        let expected = read_all(&wal);
        assert_eq!(expected.last(), Some(&payload(329)), "{io:?}");
        wal.close().unwrap();
        // Two segments are recycled, the last one among them: its file holds stale frames
        // past its records.
        let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
        let recycled: Vec<_> = scan.segments.iter().filter(|segment| segment.recycled).collect();
        assert_eq!(recycled.len(), 2, "{io:?}");
        for segment in &recycled {
            assert!(segment.torn_tail.is_none() && segment.corruption.is_empty(), "{segment:?}");
        }
        let last = scan.segments.last().unwrap();
        assert!(last.recycled, "{io:?}");
        let bytes = std::fs::read(&last.path).unwrap();
        let stale = &bytes[last.valid_end as usize..];
        assert!(
            (0..stale.len())
                .step_by(16)
                .any(|at| coordbus::record::frame::claimed_lsn(&stale[at..]).is_some()),
            "{io:?}: stale frames past the records of {last:?}"
        );
        assert!(scan.report.torn_tail.is_none(), "{io:?}: {}", scan.report);
        let reopened = open_with(dir.path(), config(), io);
        let report = reopened.recovery_report();
        assert!(report.torn_tail.is_none() && report.corruption_skipped.is_empty(), "{report}");
        assert_eq!(read_all(&reopened), expected, "{io:?}");
    }
}

#[test]
fn a_torn_record_in_a_recycled_last_segment_is_cut_and_the_stale_tail_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let (expected, last) = closed_log_ending_recycled(dir.path());
    // Tear the last record: flip a byte of its payload (its header still claims its LSN).
    let mut bytes = std::fs::read(&last.path).unwrap();
    let last_record_len = 32 + coordbus::record::frame::padded(payload(329).len()) as u64;
    let last_start = last.valid_end - last_record_len;
    bytes[(last.valid_end - 1) as usize] ^= 0x40;
    std::fs::write(&last.path, &bytes).unwrap();
    let reopened = open_with(dir.path(), config(), IoMode::Auto);
    let tail = reopened.recovery_report().torn_tail.clone().expect("a torn tail");
    assert_eq!((tail.offset, tail.records_discarded), (last_start, 0), "{tail:?}");
    assert_eq!(read_all(&reopened), expected[..expected.len() - 1]);
    reopened.close().unwrap();
    // The cut is durable: the next open finds no torn tail.
    let again = open_with(dir.path(), config(), IoMode::Auto);
    assert!(again.recovery_report().torn_tail.is_none(), "{}", again.recovery_report());
}

#[test]
fn a_torn_creation_after_a_recycled_segment_leaves_a_log_that_opens() {
    let dir = tempfile::tempdir().unwrap();
    let (expected, last) = closed_log_ending_recycled(dir.path());
    // The next segment's file created (and preallocated), then a crash before its header: as
    // `Writer::new_file` leaves it when no spare is left.
    let torn = dir.path().join(segment::file_name(coordbus::wal::SegmentId(last.id.0 + 1)));
    std::fs::File::create(&torn).unwrap().set_len(SEGMENT_SIZE).unwrap();
    let reopened = open_with(dir.path(), config(), IoMode::Auto);
    let report = reopened.recovery_report();
    assert!(report.corruption_skipped.is_empty(), "{report}");
    assert_eq!(report.segments_skipped, [coordbus::wal::SegmentId(last.id.0 + 1)], "{report}");
    assert_eq!(read_all(&reopened), expected);
}

#[test]
fn records_missing_at_the_end_of_a_recycled_sealed_segment_are_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let wal = log_with_recycled_segments(dir.path(), IoMode::Auto);
    append(&wal, 330..430);
    wal.close().unwrap();
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let sealed = scan.segments[..scan.segments.len() - 1]
        .iter()
        .find(|segment| segment.recycled)
        .expect("a recycled segment that is not the last");
    // Damage its last record: its records now stop one early, before the stale tail.
    let mut bytes = std::fs::read(&sealed.path).unwrap();
    bytes[(sealed.valid_end - 1) as usize] ^= 0x40;
    std::fs::write(&sealed.path, &bytes).unwrap();
    let error = Wal::open(dir.path(), config()).unwrap_err();
    let WalError::Corruption { segment, offset, reason } = &error else { panic!("{error}") };
    // Reported where the damaged record starts (record `i` has LSN `i + 1`).
    let damaged = payload(sealed.last_lsn.unwrap().0 - 1);
    let damaged_len = 32 + coordbus::record::frame::padded(damaged.len()) as u64;
    assert_eq!((*segment, *offset), (sealed.id.0, sealed.valid_end - damaged_len), "{error}");
    assert!(reason.contains("in a sealed segment"), "{reason}");
    // Tolerant recovery keeps every other record.
    let records = scan_dir(dir.path(), RecoveryMode::TolerateCorruption).unwrap().report.records;
    let tolerant =
        Wal::open(dir.path(), WalConfig { recovery: RecoveryMode::TolerateCorruption, ..config() })
            .unwrap();
    assert!(!tolerant.recovery_report().corruption_skipped.is_empty());
    assert_eq!(tolerant.recovery_report().records, records);
    assert_eq!(read_all(&tolerant).len() as u64, records);
}

#[test]
fn a_segment_a_reader_still_maps_is_deleted_not_reused() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open_with(dir.path(), config(), IoMode::Auto);
    let (first_lsn, first) = wal.append_bytes(&payload(0), 0).unwrap();
    wal.wait_durable_timeout(first_lsn, WAIT).unwrap();
    append(&wal, 1..200);
    let guard = wal.read_bytes(first).unwrap();
    assert!(clean_below(&wal, 150) >= 2);
    // The first segment was deleted; the second kept.
    assert_eq!(
        spares(dir.path()),
        [dir.path().join(segment::spare_file_name(coordbus::wal::SegmentId(first.segment.0 + 1)))]
    );
    append(&wal, 200..400);
    // Whatever was reused, the guard's bytes are the record's.
    assert_eq!(&*guard, &payload(0)[..]);
    let names: Vec<String> = files_named(dir.path(), |_| true)
        .iter()
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(!names.contains(&segment::file_name(first.segment)), "{names:?}");
    assert!(!names.contains(&segment::spare_file_name(first.segment)), "{names:?}");
}

#[test]
fn spares_are_bounded_by_the_configuration_and_deleted_at_close_and_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let leftover = {
        let wal = open_with_spares(dir.path(), 1);
        append(&wal, 0..200);
        assert!(clean_below(&wal, 150) >= 2);
        let kept = spares(dir.path());
        assert_eq!(kept.len(), 1);
        // What a crash would leave: the spare, copied aside before the close.
        let bytes = std::fs::read(&kept[0]).unwrap();
        wal.close().unwrap();
        assert!(spares(dir.path()).is_empty(), "closing deletes the spares");
        // A clean after the close deletes its files: a closed log keeps no spare.
        let report = wal.clean(190, true).unwrap();
        assert!(!report.deleted.is_empty() && report.kept_as_spares.is_empty(), "{report:?}");
        assert!(spares(dir.path()).is_empty());
        assert_eq!(wal.stats().spare_segments, 0);
        (kept[0].clone(), bytes)
    };
    std::fs::write(&leftover.0, &leftover.1).unwrap();
    let kept = scan_dir(dir.path(), RecoveryMode::Strict).unwrap().report.records;
    assert!((10..50).contains(&kept), "{kept}");
    // Read-only opens change nothing; a writer's open deletes a spare a crash left.
    drop(
        Wal::open_with_options(
            dir.path(),
            config(),
            WalOptions { read_only: true, ..WalOptions::default() },
        )
        .unwrap(),
    );
    assert_eq!(spares(dir.path()), std::slice::from_ref(&leftover.0));
    let wal = open_with(dir.path(), config(), IoMode::Auto);
    assert!(spares(dir.path()).is_empty());
    assert_eq!(read_all(&wal), (200 - kept..200).map(payload).collect::<Vec<_>>());
    // Zero spares: every cleaned file is deleted.
    let dir = tempfile::tempdir().unwrap();
    let wal = open_with_spares(dir.path(), 0);
    append(&wal, 0..200);
    assert!(clean_below(&wal, 150) >= 2);
    assert!(spares(dir.path()).is_empty());
}

#[test]
fn segments_found_at_open_are_never_kept() {
    let dir = tempfile::tempdir().unwrap();
    {
        let wal = open_with(dir.path(), config(), IoMode::Auto);
        append(&wal, 0..200);
        wal.close().unwrap();
    }
    let found = files_named(dir.path(), |name| segment::parse_file_name(name).is_some());
    let wal = open_with(dir.path(), config(), IoMode::Auto);
    append(&wal, 200..400);
    // Everything before record 350: the segments found at open and some of this log's.
    assert!(clean_below(&wal, 350) > found.len() as u64);
    let kept: Vec<String> = spares(dir.path())
        .iter()
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept.len(), 2, "{kept:?}");
    for path in &found {
        let id = segment::parse_file_name(&path.file_name().unwrap().to_string_lossy()).unwrap();
        assert!(!kept.contains(&segment::spare_file_name(id)), "{kept:?}");
    }
}

#[test]
fn a_segment_another_reader_maps_is_deleted_not_reused() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open_with(dir.path(), config(), IoMode::Auto);
    append(&wal, 0..200);
    // A read-only log of the same directory (as a tool in another process would open it)
    // maps every segment it found.
    let reader = Wal::open_with_options(
        dir.path(),
        config(),
        WalOptions { read_only: true, ..WalOptions::default() },
    )
    .unwrap();
    let before = read_all(&reader);
    assert!(clean_below(&wal, 150) >= 2);
    assert!(spares(dir.path()).is_empty(), "nothing kept while mapped elsewhere");
    append(&wal, 200..330);
    assert_eq!(wal.stats().recycled_segments, 0);
    assert_eq!(read_all(&reader), before, "the reader's bytes never change");
    // Once the reader is gone, cleaned segments are kept again.
    drop(reader);
    assert!(clean_below(&wal, 300) >= 1);
    assert!(!spares(dir.path()).is_empty());
}

#[test]
fn a_segment_another_program_locks_exclusively_fails_the_open_after_a_bounded_wait() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open_with(dir.path(), config(), IoMode::Auto);
    append(&wal, 0..10);
    wal.close().unwrap();
    drop(wal);
    let first = files_named(dir.path(), |name| segment::parse_file_name(name).is_some())[0].clone();
    let held = std::fs::File::open(&first).unwrap();
    held.try_lock().unwrap();
    let started = std::time::Instant::now();
    let options = WalOptions { read_only: true, ..WalOptions::default() };
    // On a thread of its own: were the wait unbounded, the test fails instead of hanging.
    let path = dir.path().to_path_buf();
    let error = wal_support::within(move || {
        Wal::open_with_options(&path, config(), options).map(drop).unwrap_err()
    });
    let waited = started.elapsed();
    assert!(matches!(&error, WalError::Io { op: "lock segment", .. }), "{error}");
    assert!(error.to_string().contains("exclusive lock"), "{error}");
    assert!(waited < Duration::from_secs(5), "a bounded wait: {waited:?}");
    // Released, the same open succeeds.
    drop(held);
    let options = WalOptions { read_only: true, ..WalOptions::default() };
    let reader = Wal::open_with_options(dir.path(), config(), options).unwrap();
    assert_eq!(read_all(&reader), (0..10).map(payload).collect::<Vec<_>>());
}

#[test]
fn too_many_spares_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions { spare_segments: 1025, ..WalOptions::default() };
    let error = Wal::open_with_options(dir.path(), config(), options).unwrap_err();
    assert!(
        matches!(
            &error,
            WalError::InvalidConfig { setting: "spare_segments", value, .. } if value == "1025"
        ),
        "{error}"
    );
}
