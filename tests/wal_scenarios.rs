//! Acceptance scenarios WAL-C3, C5, C6, F3, F6, F8, D1, D2 (SCENARIOS.md section 5).
//!
//! Method: each scenario runs through the public API on a temporary directory, with group
//! commit on (`GroupCommit`) and off (`EveryRecord`), and on both I/O paths (io_uring when the
//! kernel allows it, and pwrite). Data is the strings "1".."100", one record each, written by
//! `write_with_log`: the clock starts at 10 000 and advances 500 ms before each write, with a
//! rolling interval of 1 s (so segments roll by time).

mod wal_support;

use std::{path::Path, sync::Arc, time::Duration};

use coordbus::{
    record::frame,
    wal::{
        scan_dir, segment, Durability, IoMode, Lsn, RecordHandle, RecoveryMode, Wal, WalConfig,
        WalError, WalOptions,
    },
};

const SEGMENT_SIZE: u64 = 64 << 10;
/// Bound of a durability wait: far longer than a sync; a wait that has not returned by then is
/// hung, and fails the test instead of hanging it.
const WAIT: Duration = Duration::from_secs(30);

/// The (durability, io) combinations every scenario runs with.
fn variants() -> Vec<(Durability, IoMode)> {
    let group =
        Durability::GroupCommit { max_delay: Duration::from_micros(200), max_bytes: 1 << 20 };
    vec![
        (group, IoMode::Auto),
        (group, IoMode::Pwrite),
        (Durability::EveryRecord, IoMode::Auto),
        (Durability::EveryRecord, IoMode::Pwrite),
    ]
}

fn config(durability: Durability, recovery: RecoveryMode) -> WalConfig {
    WalConfig {
        segment_size_bytes: SEGMENT_SIZE,
        durability,
        recovery,
        rolling_interval: Some(Duration::from_secs(1)),
        ..WalConfig::default()
    }
}

/// Opens the log; the `Auto` variants are io_uring runs wherever the kernel allows it.
fn open(dir: &Path, durability: Durability, io: IoMode, recovery: RecoveryMode) -> Wal {
    let wal = Wal::open_with_options(
        dir,
        config(durability, recovery),
        WalOptions { io, uring_direct_max_bytes: 0, ..WalOptions::default() },
    )
    .unwrap();
    assert_eq!(wal.io_path(), wal_support::path_of(io));
    wal
}

fn data(range: std::ops::RangeInclusive<u32>) -> Vec<String> {
    range.map(|i| i.to_string()).collect()
}

/// Writes every item as a record at clock += `advance`; returns the handles. The clock is set
/// to 10 000 first if below 100 000 (the scenario helper).
fn write_with_log(
    wal: &Wal,
    items: &[String],
    clock_ms: &mut i64,
    advance: i64,
) -> Vec<RecordHandle> {
    if *clock_ms < 100_000 {
        *clock_ms = 10_000;
    }
    let mut handles = Vec::new();
    let mut last = Lsn::ZERO;
    for item in items {
        *clock_ms += advance;
        let (lsn, handle) = wal.append(item, *clock_ms).unwrap();
        last = lsn;
        handles.push(handle);
    }
    wal.wait_durable_timeout(last, WAIT).unwrap();
    handles
}

fn read_all(wal: &Wal) -> Vec<String> {
    wal.iter_from(Lsn::ZERO)
        .unwrap()
        .map(|record| {
            let record = record.unwrap();
            record.access::<String>().unwrap().as_str().to_owned()
        })
        .collect()
}

fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|entry| entry.unwrap().path())
                .filter(|path| {
                    path.file_name()
                        .and_then(|name| name.to_str())
                        .and_then(segment::parse_file_name)
                        .is_some()
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn wal_c3_read_all_logs_after_write() {
    for (durability, io) in variants() {
        let dir = tempfile::tempdir().unwrap();
        let items = data(1..=100);
        let wal = open(dir.path(), durability, io, RecoveryMode::Strict);
        let mut clock = 0;
        write_with_log(&wal, &items, &mut clock, 500);
        wal.close().unwrap();
        assert!(segment_files(dir.path()).len() > 1, "{durability:?} {io:?}");
        let reopened = open(dir.path(), durability, io, RecoveryMode::Strict);
        assert_eq!(read_all(&reopened), items, "{durability:?} {io:?}");
        assert_eq!(reopened.recovery_report().records, 100);
        assert!(reopened.recovery_report().torn_tail.is_none());
    }
}

#[test]
fn wal_c5_clean_old_logs_synchronously() {
    for (durability, io) in variants() {
        let dir = tempfile::tempdir().unwrap();
        let items = data(1..=100);
        let wal = open(dir.path(), durability, io, RecoveryMode::Strict);
        let mut clock = 0;
        write_with_log(&wal, &items, &mut clock, 500);
        let before = segment_files(dir.path()).len();
        let threshold = clock / 2;
        let report = wal.clean(threshold, true).unwrap();
        let after = segment_files(dir.path()).len();
        assert!(after < before, "{before} -> {after} ({durability:?} {io:?})");
        assert_eq!(before - after, report.deleted.len());
        // What remains is a suffix of the data, and every record at or after the threshold
        // (whose segment ends at or after it) survived.
        let remaining = read_all(&wal);
        assert_eq!(&items[items.len() - remaining.len()..], &remaining[..]);
        let survivors_needed = items
            .iter()
            .enumerate()
            .filter(|(index, _)| 10_000 + 500 * (*index as i64 + 1) >= threshold)
            .count();
        assert!(remaining.len() >= survivors_needed);
    }
}

#[test]
fn wal_c6_corrupt_or_truncated_earlier_files_do_not_block_later_ones() {
    for (durability, io) in variants() {
        let dir = tempfile::tempdir().unwrap();
        let data1 = data(1..=100);
        let data2 = data(101..=200);
        let wal = open(dir.path(), durability, io, RecoveryMode::Strict);
        let mut clock = 0;
        write_with_log(&wal, &data1, &mut clock, 500);
        wal.close().unwrap();
        let first_files = segment_files(dir.path());
        assert!(first_files.len() > 1);
        clock += 100_000;
        let wal = open(dir.path(), durability, io, RecoveryMode::Strict);
        write_with_log(&wal, &data2, &mut clock, 500);
        let all: Vec<String> = data1.iter().chain(&data2).cloned().collect();
        assert_eq!(read_all(&wal), all);
        wal.close().unwrap();
        assert!(segment_files(dir.path()).len() > first_files.len());
        for file in &first_files {
            std::fs::OpenOptions::new().write(true).open(file).unwrap().set_len(1).unwrap();
        }
        // Strict: opening reports corruption naming the first damaged segment.
        let first_id =
            segment::parse_file_name(first_files[0].file_name().unwrap().to_str().unwrap())
                .unwrap();
        match Wal::open(dir.path(), config(durability, RecoveryMode::Strict)) {
            Err(WalError::Corruption { segment, offset, .. }) => {
                assert_eq!(segment, first_id.0);
                assert_eq!(offset, 0);
            }
            other => panic!("expected corruption, got {other:?}"),
        }
        // Tolerant: everything of data2, nothing else, no error; and nothing of data2's files
        // is altered by it (the same bytes after the open and close, read again alike).
        let later_files: Vec<_> = segment_files(dir.path())
            .into_iter()
            .filter(|file| !first_files.contains(file))
            .collect();
        let later_bytes: Vec<Vec<u8>> =
            later_files.iter().map(|file| std::fs::read(file).unwrap()).collect();
        let tolerant = open(dir.path(), durability, io, RecoveryMode::TolerateCorruption);
        assert_eq!(read_all(&tolerant), data2);
        assert_eq!(tolerant.recovery_report().segments_skipped.len(), first_files.len());
        tolerant.close().unwrap();
        drop(tolerant);
        let after: Vec<Vec<u8>> =
            later_files.iter().map(|file| std::fs::read(file).unwrap()).collect();
        assert!(after == later_bytes, "a tolerant open altered data2's segment files");
        let again = open(dir.path(), durability, io, RecoveryMode::TolerateCorruption);
        assert_eq!(read_all(&again), data2);
    }
}

#[test]
fn wal_f3_writer_durability_and_visibility_per_write() {
    for (durability, io) in variants() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(open(dir.path(), durability, io, RecoveryMode::Strict));
        let dir_path = dir.path().to_path_buf();
        // Appends and waits without a timeout on one bounded thread, as a writer does: with
        // `EveryRecord` the waiter may then write and sync its record itself (leading).
        wal_support::bounded(&wal, move |wal| {
            let mut clock = 10_000;
            for item in data(1..=100) {
                clock += 500;
                let (lsn, handle) = wal.append_bytes(item.as_bytes(), clock).unwrap();
                wal.wait_durable(lsn).unwrap();
                // By hand, from the file, with the writer still open.
                let path = dir_path.join(segment::file_name(handle.segment));
                let bytes = std::fs::read(&path).unwrap();
                let (header, payload) = frame::parse(&bytes[handle.offset as usize..]).unwrap();
                assert_eq!(payload, item.as_bytes());
                assert_eq!(header.lsn, lsn.0);
                assert_eq!(header.time_ms, clock);
                // And through the log's own reader.
                assert_eq!(&*wal.read_bytes(handle).unwrap(), item.as_bytes());
            }
        });
    }
}

/// One-segment log of `items` (no rolling); returns the path of its file and the offset just
/// past the last record.
fn one_segment_log(
    dir: &Path,
    durability: Durability,
    io: IoMode,
    items: &[String],
) -> (std::path::PathBuf, u64) {
    let wal = Wal::open_with_options(
        dir,
        WalConfig {
            segment_size_bytes: SEGMENT_SIZE,
            durability,
            recovery: RecoveryMode::Strict,
            ..WalConfig::default()
        },
        WalOptions { io, uring_direct_max_bytes: 0, ..WalOptions::default() },
    )
    .unwrap();
    let mut clock = 0;
    let handles = write_with_log(&wal, items, &mut clock, 500);
    wal.close().unwrap();
    let last = handles.last().unwrap();
    let files = segment_files(dir);
    assert_eq!(files.len(), 1);
    (files[0].clone(), last.offset + frame::frame_len(last.len as usize) as u64)
}

fn patch(path: &Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(bytes, offset)
        .unwrap();
}

#[test]
fn wal_f6_torn_tail_and_garbage_tail() {
    let items = data(1..=100);
    for (durability, io) in variants() {
        let reopen = |dir: &Path| {
            Wal::open(
                dir,
                WalConfig { segment_size_bytes: SEGMENT_SIZE, durability, ..WalConfig::default() },
            )
            .unwrap()
        };
        // Garbage appended at the end of the file, and garbage right after the last record.
        let garbage = b"This line appended to file!";
        for at_end_of_records in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (path, end) = one_segment_log(dir.path(), durability, io, &items);
            let at = if at_end_of_records { end } else { std::fs::metadata(&path).unwrap().len() };
            patch(&path, at, garbage);
            let wal = reopen(dir.path());
            assert_eq!(read_all(&wal), items);
            let tail = wal.recovery_report().torn_tail.clone().expect("garbage reported");
            assert_eq!(tail.offset, end);
            assert_eq!(tail.bytes_discarded, at + garbage.len() as u64 - end);
            // The cut is permanent and the log continues after it.
            let (lsn, _) = wal.append(&"after".to_owned(), 1).unwrap();
            assert_eq!(lsn, Lsn(101));
            wal.close().unwrap();
            let wal = reopen(dir.path());
            assert!(wal.recovery_report().torn_tail.is_none());
            assert_eq!(read_all(&wal).len(), 101);
        }
        // Truncated to N - 1 bytes: the last item is gone, the rest is there.
        let dir = tempfile::tempdir().unwrap();
        let (path, end) = one_segment_log(dir.path(), durability, io, &items);
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(end - 1).unwrap();
        let wal = reopen(dir.path());
        assert_eq!(read_all(&wal), &items[..99]);
        assert!(wal.recovery_report().torn_tail.is_some());
        drop(wal);
        // A tail of 1 to 3 bytes, and headers whose length is negative or runs past the end.
        for tail in [&[7u8][..], &[1, 2], &[1, 2, 3]] {
            let dir = tempfile::tempdir().unwrap();
            let (path, end) = one_segment_log(dir.path(), durability, io, &items);
            patch(&path, end, tail);
            let wal = reopen(dir.path());
            assert_eq!(read_all(&wal), items);
        }
        for declared in [u32::MAX /* -1 as i32 */, 0x8000_0000, 1 << 29, 60_000] {
            let dir = tempfile::tempdir().unwrap();
            let (path, end) = one_segment_log(dir.path(), durability, io, &items);
            let mut header = [0u8; frame::HEADER_LEN];
            header[0..4].copy_from_slice(&declared.to_le_bytes());
            header[28..30].copy_from_slice(&frame::MAGIC.to_le_bytes());
            header[30] = frame::VERSION;
            patch(&path, end, &header);
            let wal = reopen(dir.path());
            assert_eq!(read_all(&wal), items, "declared length {declared}");
            assert_eq!(wal.recovery_report().torn_tail.as_ref().unwrap().offset, end);
        }
    }
}

/// The first `count` permutations of `0..len` in lexicographic order.
fn first_permutations(len: usize, count: usize) -> Vec<Vec<usize>> {
    let mut current: Vec<usize> = (0..len).collect();
    let mut out = vec![current.clone()];
    while out.len() < count {
        let Some(pivot) = (0..len - 1).rev().find(|&i| current[i] < current[i + 1]) else {
            break;
        };
        let swap = (pivot + 1..len).rev().find(|&j| current[j] > current[pivot]).unwrap();
        current.swap(pivot, swap);
        current[pivot + 1..].reverse();
        out.push(current.clone());
    }
    out
}

#[test]
fn wal_f8_random_reader_hand_written_and_writer_written() {
    let items = data(1..=100);
    for (durability, io) in variants() {
        // Writer-written.
        let dir = tempfile::tempdir().unwrap();
        let wal = open(dir.path(), durability, io, RecoveryMode::Strict);
        let mut clock = 0;
        let handles = write_with_log(&wal, &items, &mut clock, 500);
        let reads: Vec<usize> = first_permutations(items.len(), 10).into_iter().flatten().collect();
        assert_eq!(reads.len(), 1000);
        for &index in &reads {
            let record = wal.read::<String>(handles[index]).unwrap();
            assert_eq!(record.as_str(), items[index]);
        }
        // A handle whose length disagrees fails with both lengths.
        let mut wrong = handles[5];
        wrong.len += 3;
        match wal.read_bytes(wrong) {
            Err(WalError::LengthMismatch { expected, actual, .. }) => {
                assert_eq!(expected, handles[5].len + 3);
                assert_eq!(actual, handles[5].len);
            }
            other => panic!("expected a length mismatch, got {other:?}"),
        }
        wal.close().unwrap();
    }
    // Hand-written: a segment file built with the public format helpers, read by the log.
    let dir = tempfile::tempdir().unwrap();
    let id = coordbus::SegmentId(1);
    let header = segment::SegmentHeader {
        id,
        first_lsn: 1,
        window: None,
        segment_size_bytes: SEGMENT_SIZE,
        recycled: false,
    };
    let mut file = header.encode().to_vec();
    let mut handles = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let payload = coordbus::record::to_bytes(item).unwrap();
        handles.push(RecordHandle {
            segment: id,
            offset: file.len() as u64,
            len: payload.len() as u32,
        });
        frame::encode_into(&mut file, &payload, index as u64 + 1, index as i64, index as u64)
            .unwrap();
    }
    std::fs::write(dir.path().join(segment::file_name(id)), &file).unwrap();
    let wal = Wal::open(dir.path(), WalConfig::default()).unwrap();
    for permutation in first_permutations(items.len(), 10) {
        for index in permutation {
            assert_eq!(wal.read::<String>(handles[index]).unwrap().as_str(), items[index]);
        }
    }
}

#[test]
fn wal_d1_rolling_rule() {
    for (durability, io) in variants() {
        let dir = tempfile::tempdir().unwrap();
        let wal = open(dir.path(), durability, io, RecoveryMode::Strict);
        let mut last = Lsn::ZERO;
        let mut segments = Vec::new();
        for time in [10_000, 11_000, 11_001, 9_000] {
            let (lsn, handle) = wal.append(&time.to_string(), time).unwrap();
            last = lsn;
            segments.push(handle.segment);
        }
        wal.wait_durable_timeout(last, WAIT).unwrap();
        assert_eq!(segments[0], segments[1]);
        assert_ne!(segments[1], segments[2]);
        assert_eq!(segments[2], segments[3]);
        wal.close().unwrap();
        let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
        assert_eq!(scan.segments.len(), 2);
        assert_eq!(scan.segments[0].window, Some((10_000, 11_000)));
        assert_eq!(scan.segments[0].records, 2);
        assert_eq!(scan.segments[0].time_range_ms, Some((10_000, 11_000)));
        assert_eq!(scan.segments[1].window, Some((11_001, 12_001)));
        assert_eq!(scan.segments[1].records, 2);
        assert_eq!(scan.segments[1].time_range_ms, Some((9_000, 11_001)));
    }
}

#[test]
fn wal_d2_clean_boundary_is_strict_and_current_file_never_cleaned() {
    for (durability, io) in variants() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open_with_options(
            dir.path(),
            WalConfig {
                rolling_interval: Some(Duration::from_millis(500)),
                ..config(durability, RecoveryMode::Strict)
            },
            WalOptions { io, uring_direct_max_bytes: 0, ..WalOptions::default() },
        )
        .unwrap();
        // Windows [500, 1000], [1500, 2000], then the current one [2500, 3000].
        let mut handles = Vec::new();
        let mut last = Lsn::ZERO;
        for time in [500, 1_500, 2_500] {
            let (lsn, handle) = wal.append_bytes(b"x", time).unwrap();
            handles.push(handle);
            last = lsn;
        }
        wal.wait_durable_timeout(last, WAIT).unwrap();
        let report = wal.clean(2_000, true).unwrap();
        assert_eq!(report.deleted, vec![handles[0].segment]);
        assert_eq!(segment_files(dir.path()).len(), 2);
        // Even a threshold past everything leaves the current segment.
        let report = wal.clean(i64::MAX, true).unwrap();
        assert_eq!(report.deleted, vec![handles[1].segment]);
        assert_eq!(segment_files(dir.path()).len(), 1);
        assert_eq!(&*wal.read_bytes(handles[2]).unwrap(), b"x");
        assert!(matches!(wal.read_bytes(handles[0]), Err(WalError::NotFound { .. })));
    }
    // Without a rolling interval a segment ends at its largest record time.
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), WalConfig { segment_size_bytes: 4096, ..WalConfig::default() })
        .unwrap();
    let segments = append_small_records_at_times_0_to_199(&wal);
    let first = segments[0];
    let first_max_time = segments.iter().rposition(|segment| *segment == first).unwrap() as i64;
    assert!(wal.clean(first_max_time, true).unwrap().deleted.is_empty());
    assert_eq!(wal.clean(first_max_time + 1, true).unwrap().deleted, vec![first]);
}

/// Appends 200 records of 100 bytes with times 0..200, waits until they are durable, and
/// returns the segment of each.
fn append_small_records_at_times_0_to_199(wal: &Wal) -> Vec<coordbus::wal::SegmentId> {
    let mut segments = Vec::new();
    let mut last = Lsn::ZERO;
    for time in 0..200 {
        let (lsn, handle) = wal.append_bytes(&[1; 100], time).unwrap();
        segments.push(handle.segment);
        last = lsn;
    }
    wal.wait_durable_timeout(last, WAIT).unwrap();
    segments
}

/// Waits (bounded) until the log counts `count` deleted segments.
fn wait_for_cleaned_segments(wal: &Wal, count: u64) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while wal.stats().cleaned_segments != count {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

#[test]
fn clean_without_wait_leaves_the_deletion_to_the_sync_thread() {
    for (durability, io) in variants() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open_with_options(
            dir.path(),
            WalConfig { segment_size_bytes: 4096, durability, ..WalConfig::default() },
            WalOptions { io, ..WalOptions::default() },
        )
        .unwrap();
        let mut segments = append_small_records_at_times_0_to_199(&wal);
        segments.dedup();
        let files_before = segment_files(dir.path()).len();
        assert_eq!(files_before, segments.len(), "{durability:?} {io:?}");
        // A clean that selects nothing (every record has time 0 or later) does not wake the
        // sync thread: coordinators call it every few commits, and most calls find nothing.
        let wakeups = wal.stats().writer_wakeups;
        for _ in 0..10 {
            let report = wal.clean(0, false).unwrap();
            assert!(report.queued.is_empty() && report.deleted.is_empty(), "{report:?}");
        }
        assert_eq!(wal.stats().writer_wakeups, wakeups, "{durability:?} {io:?}");
        // Every sealed segment but the last two ends before time 150.
        let report = wal.clean(150, false).unwrap();
        assert_eq!(wal.stats().writer_wakeups, wakeups + 1, "one wake-up to delete them");
        assert!(report.deleted.is_empty(), "nothing deleted by the caller: {report:?}");
        assert!(report.failed.is_empty());
        let expected: Vec<_> =
            segments.iter().copied().filter(|segment| report.queued.contains(segment)).collect();
        assert_eq!(report.queued, expected);
        assert!(report.queued.len() >= 2 && report.queued.len() < segments.len() - 1);
        assert_eq!(report.bytes_freed, 4096 * report.queued.len() as u64);
        // They left the log at once...
        let first_record =
            RecordHandle { segment: report.queued[0], offset: segment::HEADER_LEN, len: 100 };
        assert!(matches!(wal.read_bytes(first_record), Err(WalError::NotFound { .. })));
        // ...and their files go soon after.
        assert!(
            wait_for_cleaned_segments(&wal, report.queued.len() as u64),
            "{durability:?} {io:?}: {} deleted",
            wal.stats().cleaned_segments
        );
        assert_eq!(segment_files(dir.path()).len(), files_before - report.queued.len());
        // Once the log is closed, no sync thread is left: clean deletes by itself.
        wal.close().unwrap();
        let report = wal.clean(i64::MAX, false).unwrap();
        assert!(report.queued.is_empty(), "{report:?}");
        assert_eq!(
            segment_files(dir.path()).len(),
            files_before - wal.stats().cleaned_segments as usize
        );
        assert!(!report.deleted.is_empty());
    }
}

#[test]
fn a_durability_wait_with_a_timeout_too_large_for_the_clock_has_no_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let wal = std::sync::Arc::new(Wal::open(dir.path(), WalConfig::default()).unwrap());
    let (lsn, _) = wal.append_bytes(b"x", 1).unwrap();
    // The unbounded wait runs on a helper thread; the test bounds it from outside, so that a
    // regression fails here instead of hanging.
    let (done, outcome) = std::sync::mpsc::channel();
    let waiter = {
        let wal = std::sync::Arc::clone(&wal);
        std::thread::spawn(move || {
            let outcome = wal.wait_durable_timeout(lsn, Duration::MAX);
            // Before answering: the caller's handle is then the log's last one.
            drop(wal);
            let _ = done.send(outcome);
        })
    };
    outcome
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|error| {
            panic!("the unbounded wait gave no outcome in 30 s ({error}: disconnected = panicked)")
        })
        .unwrap();
    waiter.join().unwrap();
    assert!(wal.durable_lsn() >= lsn);
    wal.close().unwrap();
}
