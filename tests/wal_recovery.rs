//! Round trips, torn tails and bit flips: what reopening a log keeps.
//!
//! Goal: every record appended and made durable comes back intact, in order, after rolls and
//! reopenings, on both I/O paths and in every durability mode; a torn last record is cut and
//! nothing before it is lost; any single flipped bit of a record is detected.
//! Method: seeded pseudo-random payloads of varied sizes; truncation at every byte offset of
//! the last record and flips of every bit of a middle and the last record, each checked by a
//! read-only scan (and a few by a full open); a proptest that replay equals the appends.

mod wal_support;

use std::{path::Path, sync::Arc, time::Duration};

use coordbus::{
    record::frame,
    wal::{
        scan_dir, segment, Durability, IoMode, IoPath, Lsn, RecordHandle, RecoveryMode, Wal,
        WalConfig, WalError, WalOptions,
    },
};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use wal_support::wait_durable_bounded;

/// Bound of a durability wait: far longer than a sync; a wait that has not returned by then is
/// hung, and fails the test instead of hanging it.
const WAIT: Duration = Duration::from_secs(30);

/// A fixed-seed generator, enough for payload sizes and bytes.
fn seeded(seed: u64) -> XorShiftRng {
    XorShiftRng::seed_from_u64(seed)
}

fn payload(rng: &mut XorShiftRng, max_len: usize) -> Vec<u8> {
    let len = rng.random_range(0..=max_len);
    (0..len).map(|_| rng.random::<u8>()).collect()
}

fn open(dir: &Path, durability: Durability, io: IoMode, segment_size_bytes: u64) -> Wal {
    Wal::open_with_options(
        dir,
        WalConfig {
            segment_size_bytes,
            durability,
            recovery: RecoveryMode::Strict,
            ..WalConfig::default()
        },
        WalOptions { io, uring_direct_max_bytes: 0, ..WalOptions::default() },
    )
    .unwrap()
}

fn all_records(wal: &Wal) -> Vec<(Lsn, i64, Vec<u8>)> {
    wal.iter_from(Lsn::ZERO)
        .unwrap()
        .map(|record| {
            let record = record.unwrap();
            (record.lsn, record.time_ms, record.bytes.to_vec())
        })
        .collect()
}

#[test]
fn round_trip_of_varied_records_across_rolls_and_reopenings_on_both_io_paths() {
    let modes = [Durability::default(), Durability::EveryRecord, Durability::None];
    for io in [IoMode::Auto, IoMode::Pwrite] {
        for durability in modes {
            let dir = tempfile::tempdir().unwrap();
            let mut rng = seeded(0x9e37_79b9_7f4a_7c15);
            let mut expected: Vec<(Lsn, i64, Vec<u8>, RecordHandle)> = Vec::new();
            for session in 0..3 {
                let wal = open(dir.path(), durability, io, 16 << 10);
                assert_eq!(wal.io_path(), wal_support::path_of(io));
                assert_eq!(wal.recovery_report().records, expected.len() as u64);
                for index in 0..300 {
                    let bytes = payload(&mut rng, if index % 50 == 0 { 5000 } else { 300 });
                    let time = session * 1_000 + index;
                    let (lsn, handle) = wal.append_bytes(&bytes, time).unwrap();
                    assert_eq!(lsn.0, expected.len() as u64 + 1);
                    expected.push((lsn, time, bytes, handle));
                }
                wal.wait_durable_timeout(expected.last().unwrap().0, WAIT).unwrap();
                for (_, _, bytes, handle) in &expected {
                    assert_eq!(&*wal.read_bytes(*handle).unwrap(), &bytes[..]);
                }
                let stats = wal.stats();
                assert_eq!(stats.appends, 300);
                assert!(stats.segments > 1);
                wal.close().unwrap();
                wal.close().unwrap();
            }
            let wal = open(dir.path(), durability, io, 16 << 10);
            let found = all_records(&wal);
            assert_eq!(found.len(), expected.len(), "{io:?} {durability:?}");
            for ((lsn, time, bytes), (want_lsn, want_time, want_bytes, _)) in
                found.iter().zip(&expected)
            {
                assert_eq!((lsn, time, bytes), (want_lsn, want_time, want_bytes));
            }
            // Iterating from the middle starts exactly there.
            let from = wal.iter_from(Lsn(450)).unwrap().next().unwrap().unwrap();
            assert_eq!(from.lsn, Lsn(450));
            assert_eq!(&*from.bytes, &expected[449].2[..]);
        }
    }
}

#[test]
fn typed_records_are_validated_zero_copy_reads() {
    #[derive(rkyv::Archive, rkyv::Serialize, Debug)]
    struct BlockAdded {
        stream: u32,
        block: u64,
        location: String,
        sizes: Vec<u64>,
    }
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20);
    let mut handles = Vec::new();
    for block in 0..50u64 {
        let value = BlockAdded {
            stream: (block % 3) as u32,
            block,
            location: format!("host-{block}"),
            sizes: (0..block % 5).collect(),
        };
        handles.push(wal.append(&value, block as i64).unwrap());
    }
    wal.wait_durable_timeout(handles.last().unwrap().0, WAIT).unwrap();
    for (block, (_, handle)) in handles.iter().enumerate() {
        let record = wal.read::<BlockAdded>(*handle).unwrap();
        assert_eq!(record.block, block as u64);
        assert_eq!(record.location.as_str(), format!("host-{block}"));
        assert_eq!(record.sizes.len(), block % 5);
        // The payload's address is 16-byte aligned in the mapping.
        assert_eq!(record.bytes().as_ptr() as usize % 16, 0);
    }
    // Reading a String record as a struct fails validation with a typed error.
    let (lsn, handle) = wal.append(&"not a block".to_owned(), 0).unwrap();
    wal.wait_durable_timeout(lsn, WAIT).unwrap();
    assert!(matches!(
        wal.read::<BlockAdded>(handle),
        Err(WalError::Record(coordbus::RecordError::Validate { .. }))
    ));
    // A handle pointing into the middle of a record, or past the end, is an error.
    let mut inside = handles[3].1;
    inside.offset += 16;
    assert!(wal.read_bytes(inside).is_err());
    let past = RecordHandle { offset: 1 << 19, ..handles[3].1 };
    assert!(matches!(wal.read_bytes(past), Err(WalError::NotFound { .. })));
}

/// Writes `count` records (EveryRecord, each waited) into one segment; returns the file, the
/// payloads and the handles.
fn small_log(dir: &Path, count: usize) -> (std::path::PathBuf, Vec<Vec<u8>>, Vec<RecordHandle>) {
    let wal = Arc::new(open(dir, Durability::EveryRecord, IoMode::Auto, 64 << 10));
    // Appended and waited for without a timeout on one bounded thread: each waiter may write
    // and sync its record itself (leading), as a real `EveryRecord` writer does.
    let (payloads, handles) = wal_support::bounded(&wal, move |wal| {
        let mut rng = seeded(7);
        let mut payloads = Vec::new();
        let mut handles = Vec::new();
        for index in 0..count {
            let bytes: Vec<u8> = (0..20 + index * 3).map(|_| rng.random::<u8>()).collect();
            let (lsn, handle) = wal.append_bytes(&bytes, index as i64).unwrap();
            wal.wait_durable(lsn).unwrap();
            payloads.push(bytes);
            handles.push(handle);
        }
        (payloads, handles)
    });
    wal.close().unwrap();
    (dir.join(segment::file_name(handles[0].segment)), payloads, handles)
}

fn copy_dir(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn truncating_inside_the_last_record_keeps_exactly_the_earlier_records() {
    let pristine = tempfile::tempdir().unwrap();
    let (file, payloads, handles) = small_log(pristine.path(), 12);
    let last = *handles.last().unwrap();
    let start = last.offset;
    let end = last.offset + frame::frame_len(last.len as usize) as u64;
    for cut in start..end {
        let work = tempfile::tempdir().unwrap();
        copy_dir(pristine.path(), work.path());
        let path = work.path().join(file.file_name().unwrap());
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(cut).unwrap();
        let scan = scan_dir(work.path(), RecoveryMode::Strict).unwrap();
        assert_eq!(scan.report.records, 11, "cut at {cut}");
        assert_eq!(scan.report.torn_tail.is_some(), cut > start, "cut at {cut}");
        // A full open at a few cuts: the records are exactly the earlier ones.
        if cut == start || cut == start + 1 || cut == end - 1 || cut == start + 31 {
            let wal = open(work.path(), Durability::EveryRecord, IoMode::Auto, 64 << 10);
            let found = all_records(&wal);
            assert_eq!(found.len(), 11);
            for (index, (_, _, bytes)) in found.iter().enumerate() {
                assert_eq!(bytes, &payloads[index]);
            }
        }
    }
}

#[test]
fn flipping_any_single_bit_of_a_record_is_detected() {
    let pristine = tempfile::tempdir().unwrap();
    let (file, _, handles) = small_log(pristine.path(), 9);
    let original = std::fs::read(&file).unwrap();
    let name = file.file_name().unwrap().to_owned();
    for (which, handle) in [(4usize, handles[4]), (8, handles[8])] {
        let len = frame::frame_len(handle.len as usize);
        for bit in 0..len * 8 {
            let work = tempfile::tempdir().unwrap();
            let mut bytes = original.clone();
            bytes[handle.offset as usize + bit / 8] ^= 1 << (bit % 8);
            std::fs::write(work.path().join(&name), &bytes).unwrap();
            match scan_dir(work.path(), RecoveryMode::Strict) {
                // A middle record: the records after it were appended once it was durable.
                Err(WalError::Corruption { segment, offset, .. }) => {
                    assert_eq!(which, 4, "bit {bit}");
                    assert_eq!(segment, handle.segment.0);
                    assert_eq!(offset, handle.offset);
                }
                // The last record: indistinguishable from a torn write, so it is cut.
                Ok(scan) => {
                    assert_eq!(which, 8, "bit {bit}");
                    assert_eq!(scan.report.records, 8);
                    assert_eq!(scan.report.torn_tail.unwrap().offset, handle.offset);
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
            if bit % 97 == 0 && which == 4 {
                // Tolerant mode keeps every other record and reports the skip.
                let wal = Wal::open(
                    work.path(),
                    WalConfig {
                        segment_size_bytes: 64 << 10,
                        recovery: RecoveryMode::TolerateCorruption,
                        ..WalConfig::default()
                    },
                )
                .unwrap();
                let lsns: Vec<u64> = all_records(&wal).iter().map(|(lsn, _, _)| lsn.0).collect();
                assert_eq!(lsns, vec![1, 2, 3, 4, 6, 7, 8, 9]);
                assert_eq!(wal.recovery_report().corruption_skipped.len(), 1);
            }
        }
    }
}

#[test]
fn damage_in_a_sealed_segment_is_corruption_naming_segment_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    let mut handles = Vec::new();
    for index in 0..100 {
        handles.push(wal.append_bytes(&[index as u8; 90], index).unwrap());
    }
    wal.wait_durable_timeout(handles.last().unwrap().0, WAIT).unwrap();
    wal.close().unwrap();
    let victim = handles[3].1;
    let path = dir.path().join(segment::file_name(victim.segment));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[victim.offset as usize + 40] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    match Wal::open(dir.path(), WalConfig { segment_size_bytes: 4096, ..WalConfig::default() }) {
        Err(WalError::Corruption { segment, offset, .. }) => {
            assert_eq!(segment, victim.segment.0);
            assert_eq!(offset, victim.offset);
        }
        other => panic!("expected corruption, got {other:?}"),
    }
    let error =
        Wal::open(dir.path(), WalConfig { segment_size_bytes: 4096, ..WalConfig::default() })
            .unwrap_err()
            .to_string();
    assert!(error.contains(&format!("segment {}", victim.segment)), "{error}");
}

/// A tail of forged frame headers, each claiming the next LSN and a long payload but failing
/// its checksum, is corruption at once: a strict scan refuses it, a tolerant one keeps every
/// record before it and skips the rest of the segment as damage. Checking every header in
/// full would take time quadratic in the segment's size (hours for a 64 MiB segment): the
/// search past damage checksums at most a few times the segment's bytes.
#[test]
fn a_tail_of_forged_frame_headers_is_corruption_not_an_endless_search() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _, handles) = small_log(dir.path(), 3);
    let last = *handles.last().unwrap();
    let tail = last.offset as usize + frame::frame_len(last.len as usize);
    let mut forged = Vec::new();
    frame::encode_into(&mut forged, &[0u8; 8 << 10], 4, 4, 3).unwrap();
    forged[4] ^= 0xFF; // the checksum no longer holds
    let header = &forged[..frame::HEADER_LEN];
    let mut bytes = std::fs::read(&file).unwrap();
    for at in (tail..bytes.len() - frame::HEADER_LEN).step_by(frame::HEADER_LEN) {
        bytes[at..at + frame::HEADER_LEN].copy_from_slice(header);
    }
    std::fs::write(&file, &bytes).unwrap();
    let forged = "forged or repeated frame headers";
    match scan_dir(dir.path(), RecoveryMode::Strict) {
        Err(WalError::Corruption { segment, offset, reason }) => {
            assert_eq!((segment, offset), (last.segment.0, tail as u64));
            assert!(reason.contains(forged), "{reason}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }
    let scan = scan_dir(dir.path(), RecoveryMode::TolerateCorruption).unwrap();
    assert_eq!(scan.report.records, 3);
    assert_eq!(scan.report.torn_tail.map(|torn| torn.offset), Some(tail as u64), "cut on open");
    let [skipped] = &scan.report.corruption_skipped[..] else {
        panic!("one stretch skipped: {:?}", scan.report.corruption_skipped);
    };
    assert_eq!((skipped.segment, skipped.offset), (last.segment, tail as u64));
    assert!(skipped.reason.contains(forged), "{}", skipped.reason);
    // A tolerant open cuts the forged tail off the last segment, as a torn tail: nothing of it
    // is left to be read as a record by a later open, when the segment is no longer the last.
    let config = WalConfig {
        segment_size_bytes: 64 << 10,
        recovery: RecoveryMode::TolerateCorruption,
        ..WalConfig::default()
    };
    let wal = Wal::open(dir.path(), config).unwrap();
    assert_eq!(wal.recovery_report().torn_tail.as_ref().map(|torn| torn.offset), Some(tail as u64));
    let (next, _) = wal.append_bytes(b"next", 9).unwrap();
    assert_eq!(next.0, 4);
    wal.wait_durable_timeout(next, WAIT).unwrap();
    drop(wal);
    assert_eq!(std::fs::metadata(&file).unwrap().len(), tail as u64, "the forged tail is cut");
    let reopened = open(dir.path(), Durability::default(), IoMode::Auto, 64 << 10);
    let kept: Vec<u64> = all_records(&reopened).iter().map(|(lsn, _, _)| lsn.0).collect();
    assert_eq!(kept, [1, 2, 3, 4], "a strict reopen finds the log whole");
}

/// A damaged record in the last segment that was durable is corruption, also when the record
/// right after it was appended before it was durable (in the same group, or while its sync
/// ran): a later record, appended once it was durable, proves it. Judged by the next record
/// alone, the damage read as a torn tail, and the damaged record and every acknowledged one
/// after it were cut without an error.
#[test]
fn damage_proved_only_by_a_later_record_is_corruption_not_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(wal_support::Gate::default());
    let (first, second, third) = {
        let wal =
            Arc::new(wal_support::open_gated(dir.path(), &gate, wal_support::AfterGate::Sync));
        let _open_gate_on_exit = wal_support::OpenOnDrop(Arc::clone(&gate));
        let first = wal.append_bytes(&[1u8; 100], 1).unwrap();
        // The sync thread holds the first record's sync: the second is appended before the
        // first is durable, so its frame proves nothing about the first.
        gate.wait_until_reached(1);
        let second = wal.append_bytes(&[2u8; 100], 2).unwrap();
        gate.open();
        wait_durable_bounded(&wal, second.0).unwrap();
        let third = wal.append_bytes(&[3u8; 100], 3).unwrap();
        wait_durable_bounded(&wal, third.0).unwrap();
        wal.close().unwrap();
        (first, second, third)
    };
    assert_eq!((first.0 .0, second.0 .0, third.0 .0), (1, 2, 3));
    let victim = first.1;
    let path = dir.path().join(segment::file_name(victim.segment));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[victim.offset as usize + frame::HEADER_LEN + 10] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();

    match scan_dir(dir.path(), RecoveryMode::Strict) {
        Err(WalError::Corruption { segment, offset, reason }) => {
            assert_eq!((segment, offset), (victim.segment.0, victim.offset));
            assert!(reason.contains("LSN 3"), "the proof is the third record: {reason}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }
    let wal = Wal::open(
        dir.path(),
        WalConfig { recovery: RecoveryMode::TolerateCorruption, ..wal_support::gated_config() },
    )
    .unwrap();
    let kept: Vec<u64> = all_records(&wal).iter().map(|(lsn, _, _)| lsn.0).collect();
    assert_eq!(kept, [2, 3], "only the damaged record is skipped");
    assert_eq!(wal.recovery_report().corruption_skipped.len(), 1);
}

#[test]
fn concurrent_appenders_share_groups_and_keep_their_order() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Arc::new(open(
        dir.path(),
        Durability::GroupCommit { max_delay: Duration::from_micros(500), max_bytes: 64 << 10 },
        IoMode::Auto,
        256 << 10,
    ));
    let per_thread = 5_000u32;
    let threads: Vec<_> = (0..2u32)
        .map(|thread| {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || {
                let mut out = Vec::new();
                for seq in 0..per_thread {
                    let mut bytes = [0u8; 64];
                    bytes[0..4].copy_from_slice(&thread.to_le_bytes());
                    bytes[4..8].copy_from_slice(&seq.to_le_bytes());
                    out.push(wal.append_bytes(&bytes, i64::from(seq)).unwrap());
                }
                out
            })
        })
        .collect();
    let results: Vec<Vec<(Lsn, RecordHandle)>> = wal_support::join_all_within(threads);
    wal.wait_durable_timeout(wal.appended_lsn(), WAIT).unwrap();
    let stats = wal.stats();
    assert!(stats.syncs < u64::from(2 * per_thread), "groups shared syncs: {stats:?}");
    for (thread, handles) in results.iter().enumerate() {
        // Each thread's LSNs increase (arrival order) and each handle reads its own record.
        assert!(handles.windows(2).all(|pair| pair[0].0 < pair[1].0));
        for (seq, (_, handle)) in handles.iter().enumerate().step_by(97) {
            let bytes = wal.read_bytes(*handle).unwrap();
            assert_eq!(u32::from_le_bytes(bytes[0..4].try_into().unwrap()), thread as u32);
            assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), seq as u32);
        }
    }
    let lsns: Vec<u64> = all_records(&wal).iter().map(|(lsn, _, _)| lsn.0).collect();
    assert_eq!(lsns, (1..=u64::from(2 * per_thread)).collect::<Vec<_>>());
}

/// A close from a durability callback (on the sync thread, which cannot wait for itself) does
/// not claim what it cannot know: with a record appended and not yet durable it reports
/// `CloseOnSyncThread`; the drop of the last handle on another thread then waits, and the
/// record is durable (the next open finds it).
#[test]
fn a_close_from_a_durability_callback_does_not_claim_the_unsynced_records_durable() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Arc::new(open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20));
    let (first, _) = wal.append_bytes(b"first", 0).unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    let in_callback = Arc::clone(&wal);
    wal.notify_when_durable(
        first,
        Box::new(move |outcome| {
            outcome.unwrap();
            let (late, _) = in_callback.append_bytes(b"appended in the callback", 0).unwrap();
            let closed = in_callback.close();
            // Before answering: the test's handle is then the last one.
            drop(in_callback);
            sender.send((late, closed)).unwrap();
        }),
    );
    let (late, closed) = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    match closed {
        Err(WalError::CloseOnSyncThread { appended, .. }) => assert_eq!(appended, late.0),
        other => panic!("expected CloseOnSyncThread, got {other:?}"),
    }
    // The drop of the last handle (no close first) waits for the sync thread to finish: the
    // record is durable and the directory free once it returns.
    wal_support::within(move || drop(wal));
    assert!(!coordbus::wal::is_locked(dir.path()).unwrap(), "the sync thread still runs");
    let reopened = open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20);
    assert_eq!(reopened.recovery_report().last_lsn, late);
}

#[test]
fn durability_callbacks_waits_and_close() {
    for durability in [Durability::default(), Durability::EveryRecord, Durability::None] {
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(open(dir.path(), durability, IoMode::Auto, 1 << 20));
        let (sender, receiver) = std::sync::mpsc::channel();
        let mut last = Lsn::ZERO;
        for index in 0..100u64 {
            let (lsn, _) = wal.append_bytes(&index.to_le_bytes(), 0).unwrap();
            let sender = sender.clone();
            wal.notify_when_durable(
                lsn,
                Box::new(move |result| sender.send((lsn, result)).unwrap()),
            );
            last = lsn;
        }
        for _ in 0..100 {
            let (lsn, result) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
            result.unwrap();
            assert!(wal.durable_lsn() >= lsn);
        }
        wal.wait_durable_timeout(last, Duration::from_secs(10)).unwrap();
        assert!(matches!(
            wait_durable_bounded(&wal, Lsn(last.0 + 5)),
            Err(WalError::NotAppended { .. })
        ));
        // Appended but unsynced records are flushed by close.
        let (lsn, handle) = wal.append_bytes(b"last words", 0).unwrap();
        wal.close().unwrap();
        assert!(wal.durable_lsn() >= lsn);
        assert!(matches!(wal.append_bytes(b"late", 0), Err(WalError::Closed)));
        assert_eq!(&*wal.read_bytes(handle).unwrap(), b"last words");
        let reopened = open(dir.path(), durability, IoMode::Auto, 1 << 20);
        assert_eq!(reopened.recovery_report().last_lsn, lsn);
    }
}

#[test]
fn a_record_larger_than_a_segment_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    assert!(matches!(wal.append_bytes(&[0; 5000], 0), Err(WalError::RecordTooLarge { .. })));
    assert!(!dir.path().join(segment::file_name(coordbus::SegmentId(1))).exists());
}

/// `max_payload_len` is exactly the boundary: a segment's room after its 64-byte header and
/// the frame's 32-byte header, rounded down to the 16-byte alignment.
#[test]
fn the_largest_payload_a_log_takes_is_what_one_segment_holds() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    let largest = wal.max_payload_len();
    assert_eq!(largest, 4096 - 64 - 32);
    let (_, handle) = wal.append_bytes(&vec![7; largest], 0).unwrap();
    match wal.append_bytes(&vec![7; largest + 1], 0) {
        Err(WalError::RecordTooLarge { len, segment_size_bytes: 4096 }) => {
            assert_eq!(len, 4096 - 64 + 16, "the frame's length");
        }
        other => panic!("one byte more must be too large: {other:?}"),
    }
    wal.close().unwrap();
    assert_eq!(wal.read_bytes(handle).unwrap().len(), largest);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 12,
        // Fixed: every run replays the same cases, so a failure reproduces.
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x3a1_4ec0_5eed),
        ..ProptestConfig::default()
    })]

    #[test]
    fn replay_equals_the_appends(
        sessions in proptest::collection::vec(
            proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 0..600), any::<i64>()),
                0..40,
            ),
            1..4,
        ),
        pwrite in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let io = if pwrite { IoMode::Pwrite } else { IoMode::Auto };
        let mut expected = Vec::new();
        for session in &sessions {
            let wal = open(dir.path(), Durability::default(), io, 8192);
            for (bytes, time) in session {
                let (lsn, _) = wal.append_bytes(bytes, *time).unwrap();
                expected.push((lsn, *time, bytes.clone()));
            }
            wal.close().unwrap();
        }
        let wal = open(dir.path(), Durability::default(), io, 8192);
        prop_assert_eq!(all_records(&wal), expected);
    }
}

#[test]
fn clean_below_an_lsn_deletes_whole_sealed_segments_only() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    let mut appended = Vec::new();
    for index in 0..200u8 {
        appended.push(wal.append_bytes(&[index; 100], 0).unwrap());
    }
    wal.wait_durable_timeout(appended.last().unwrap().0, WAIT).unwrap();
    let first = appended[0].1.segment;
    let first_last_lsn =
        appended.iter().filter(|(_, handle)| handle.segment == first).map(|(lsn, _)| *lsn).max();
    let first_last_lsn = first_last_lsn.unwrap();
    // An LSN inside the first segment keeps it; the one after its last record deletes it.
    assert!(wal.clean_below_lsn(first_last_lsn, true).unwrap().deleted.is_empty());
    assert_eq!(wal.clean_below_lsn(Lsn(first_last_lsn.0 + 1), true).unwrap().deleted, vec![first]);
    // Everything below the end: all but the active segment.
    wal.clean_below_lsn(Lsn(u64::MAX), true).unwrap();
    let active = appended.last().unwrap().1.segment;
    let remaining: Vec<_> = wal.iter_from(Lsn::ZERO).unwrap().map(|r| r.unwrap()).collect();
    assert!(!remaining.is_empty());
    assert!(remaining.iter().all(|record| record.handle.segment == active));
    assert_eq!(remaining.last().unwrap().lsn, appended.last().unwrap().0);
    assert_eq!(wal.stats().segments, 1);
}

/// Record times out of LSN order (a restarted epoch log logs lower epochs again): `clean`
/// deletes old segments only up to the first one it keeps. Deleting a later old segment too
/// left an LSN gap, and the next open failed with corruption.
#[test]
fn clean_deletes_only_the_oldest_segments_so_the_log_keeps_no_gap() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    // Times by segment: 300, then 50, then 40. The record that starts a segment carries the
    // time of the one before, so the end times are 300, 300 and 50, and the fourth segment is
    // the active one.
    let times = [300, 50, 40, 40];
    let mut segments = Vec::new();
    let mut last = Lsn::ZERO;
    while segments.len() < 4 {
        let time = times[segments.len().saturating_sub(1)];
        let (lsn, handle) = wal.append_bytes(&[7u8; 100], time).unwrap();
        if segments.last() != Some(&handle.segment) {
            segments.push(handle.segment);
        }
        last = lsn;
    }
    wal.wait_durable_timeout(last, WAIT).unwrap();
    // The third segment ends below 100, but the first (300) is kept, so nothing is deleted.
    assert_eq!(wal.clean(100, true).unwrap().deleted, Vec::new());
    // Below 301 the first three go, in order.
    assert_eq!(wal.clean(301, true).unwrap().deleted, segments[..3].to_vec());
    drop(wal);
    let reopened = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    let lsns: Vec<u64> = all_records(&reopened).iter().map(|(lsn, _, _)| lsn.0).collect();
    assert_eq!(lsns.last(), Some(&last.0), "the active segment's records survive");
    assert!(lsns.windows(2).all(|pair| pair[1] == pair[0] + 1), "no gap: {lsns:?}");
}

/// A reopened log has no active segment until its first append, and a clean then keeps the
/// recovered last segment: the next open continues the LSNs and segment ids from it. (With
/// every segment deleted, they started again at 1, and a handle kept from before the clean
/// read a new record of the same length as if it were the old one.)
#[test]
fn a_clean_before_the_first_append_keeps_the_newest_segment_so_lsns_continue() {
    let dir = tempfile::tempdir().unwrap();
    let (old_handle, last) = {
        let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
        let mut appended = Vec::new();
        for index in 0..100u8 {
            appended.push(wal.append_bytes(&[index; 100], 1).unwrap());
        }
        wal.wait_durable_timeout(appended.last().unwrap().0, WAIT).unwrap();
        (appended[0].1, appended.last().unwrap().0)
    };
    let newest = {
        let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
        let segments = wal.stats().segments;
        let report = wal.clean(i64::MAX, true).unwrap();
        assert_eq!(report.deleted.len(), segments - 1, "all but the newest");
        report.deleted.iter().max().copied()
    };
    assert!(newest.is_some());
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    let (lsn, handle) = wal.append_bytes(&[0xee; 100], 2).unwrap();
    assert_eq!(lsn.0, last.0 + 1, "LSNs continue");
    assert!(handle.segment > newest.unwrap(), "segment ids continue");
    assert!(
        matches!(wal.read_bytes(old_handle), Err(WalError::NotFound { .. })),
        "a cleaned record stays gone"
    );
}

/// A failed log's marker (module `wal`, "Durability order") names its last durable LSN:
/// opening cuts every record after it, in the segment holding it and in whole later segments,
/// continues LSNs right after it, and deletes the marker; a read-only scan shows the same cut
/// and changes nothing.
#[test]
fn a_failed_logs_marker_cuts_every_record_after_its_durable_lsn() {
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<(Lsn, RecordHandle)> = {
        let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
        let handles: Vec<_> =
            (0..100u8).map(|index| wal.append_bytes(&[index; 100], 1).unwrap()).collect();
        wal.wait_durable_timeout(handles.last().unwrap().0, WAIT).unwrap();
        handles
    };
    // Durable up to a record in the middle of the second segment.
    let second =
        handles.iter().map(|(_, handle)| handle.segment).find(|s| *s > handles[0].1.segment);
    let in_second: Vec<&(Lsn, RecordHandle)> =
        handles.iter().filter(|(_, handle)| Some(handle.segment) == second).collect();
    let durable = in_second[in_second.len() / 2].0;
    let later_segments = {
        let mut ids: Vec<_> = handles
            .iter()
            .map(|(_, handle)| handle.segment)
            .filter(|id| Some(*id) > second)
            .collect();
        ids.dedup();
        ids
    };
    assert!(later_segments.len() >= 2, "whole segments after the cut: {later_segments:?}");
    let marker = dir.path().join(coordbus::wal::UNSYNCED_MARKER);
    std::fs::write(&marker, format!("{}\n", durable.0)).unwrap();

    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let expected_cut = coordbus::wal::UnsyncedCut {
        durable_lsn: durable,
        records_discarded: 100 - durable.0,
        segments_removed: later_segments.len() as u64,
    };
    assert_eq!(scan.report.unsynced_cut, Some(expected_cut));
    assert_eq!((scan.report.records, scan.report.last_lsn), (durable.0, durable));
    assert_eq!(scan.report.segments_skipped, later_segments);
    assert!(marker.exists(), "a read-only scan changes nothing");

    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    assert_eq!(wal.recovery_report().unsynced_cut, Some(expected_cut));
    assert!(!marker.exists());
    let kept: Vec<u64> = all_records(&wal).iter().map(|(lsn, _, _)| lsn.0).collect();
    assert_eq!(kept, (1..=durable.0).collect::<Vec<_>>());
    assert_eq!(wal.durable_lsn(), durable);
    let (next, handle) = wal.append_bytes(b"next", 2).unwrap();
    assert_eq!(next.0, durable.0 + 1, "LSNs continue after the durable one");
    assert!(Some(handle.segment) > later_segments.last().copied(), "segment ids are not reused");
    wal.wait_durable_timeout(next, WAIT).unwrap();
    drop(wal);
    let reopened = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    assert_eq!(all_records(&reopened).len() as u64, durable.0 + 1, "a strict reopen finds no gap");
    assert_eq!(reopened.recovery_report().unsynced_cut, None);
}

/// A log cleaned up to its last segment that then failed before any record of that segment
/// was durable: opening drops that segment and finds no other, but LSNs still continue after
/// the durable one the marker names, never again from 1.
#[test]
fn lsns_continue_after_a_failed_logs_durable_lsn_when_no_segment_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let last = durable_log_of_50_records(dir.path());
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let newest = scan.segments.last().unwrap();
    let first_of_newest = newest.first_lsn_in_header.unwrap();
    assert!(first_of_newest.0 > 1 && first_of_newest.0 <= last.0 + 1, "{first_of_newest}");
    // The older segments cleaned; the marker names the LSN before the newest segment.
    for segment in &scan.segments[..scan.segments.len() - 1] {
        std::fs::remove_file(&segment.path).unwrap();
    }
    let durable = Lsn(first_of_newest.0 - 1);
    std::fs::write(dir.path().join(coordbus::wal::UNSYNCED_MARKER), format!("{}\n", durable.0))
        .unwrap();

    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    assert_eq!(wal.recovery_report().records, 0);
    assert_eq!(wal.recovery_report().segments_skipped, [newest.id]);
    assert_eq!(wal.durable_lsn(), durable);
    let (next, _) = wal.append_bytes(b"next", 2).unwrap();
    assert_eq!(next.0, durable.0 + 1, "LSNs continue after the durable one");
    wal.wait_durable_timeout(next, WAIT).unwrap();
    drop(wal);
    let reopened = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    let kept: Vec<u64> = all_records(&reopened).iter().map(|(lsn, _, _)| lsn.0).collect();
    assert_eq!(kept, [durable.0 + 1]);
}

/// A failed log whose records end below its marker's LSN (with `Durability::None` a record
/// counts as durable once written, and a power loss may take the page cache with it): LSNs
/// continue after the last record kept, so the log has no gap and a second open finds it
/// whole.
#[test]
fn lsns_continue_after_the_last_record_kept_when_it_is_below_the_markers_lsn() {
    let dir = tempfile::tempdir().unwrap();
    let last = durable_log_of_50_records(dir.path());
    std::fs::write(dir.path().join(coordbus::wal::UNSYNCED_MARKER), format!("{}\n", last.0 + 10))
        .unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    assert_eq!(wal.recovery_report().records, last.0);
    let (next, _) = wal.append_bytes(b"next", 2).unwrap();
    assert_eq!(next.0, last.0 + 1, "no gap after the records kept");
    wal.wait_durable_timeout(next, WAIT).unwrap();
    drop(wal);
    let reopened = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    assert_eq!(all_records(&reopened).len() as u64, last.0 + 1, "a strict reopen finds no gap");
}

/// A failed log whose last segment's header is damaged: a tolerant open skips that segment
/// whole, so its records are gone, but LSNs still continue after the marker's LSN, never
/// with the LSNs the skipped segment held (the last record kept would put them there).
#[test]
fn tolerant_lsns_continue_after_the_markers_lsn_past_a_skipped_last_segment() {
    let dir = tempfile::tempdir().unwrap();
    let last = durable_log_of_50_records(dir.path());
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let newest = scan.segments.last().unwrap();
    let first_of_newest = newest.first_lsn_in_header.unwrap();
    assert!(first_of_newest.0 > 1 && first_of_newest.0 <= last.0, "{first_of_newest}");
    // Records follow the damaged header, so this is no torn creation: the segment is skipped.
    let mut bytes = std::fs::read(&newest.path).unwrap();
    bytes[..16].fill(0xab);
    std::fs::write(&newest.path, &bytes).unwrap();
    std::fs::write(dir.path().join(coordbus::wal::UNSYNCED_MARKER), format!("{}\n", last.0))
        .unwrap();

    let config = WalConfig {
        segment_size_bytes: 4096,
        recovery: RecoveryMode::TolerateCorruption,
        ..WalConfig::default()
    };
    let wal = Wal::open(dir.path(), config).unwrap();
    let report = wal.recovery_report();
    assert_eq!(report.segments_skipped, [newest.id]);
    assert_eq!(report.records, first_of_newest.0 - 1, "the skipped segment's records are gone");
    let (next, _) = wal.append_bytes(b"next", 2).unwrap();
    assert_eq!(next.0, last.0 + 1, "LSNs continue after the marker's, not at {first_of_newest}");
}

/// Writes 50 records of 100 bytes in `dir` (4 KiB segments), waits until they are durable and
/// closes the log; returns the last LSN.
fn durable_log_of_50_records(dir: &Path) -> Lsn {
    let wal = open(dir, Durability::default(), IoMode::Auto, 4096);
    let last = (0..50u8).map(|index| wal.append_bytes(&[index; 100], 1).unwrap().0).last();
    wal.wait_durable_timeout(last.unwrap(), WAIT).unwrap();
    last.unwrap()
}

/// A marker that holds no LSN was not written by the log (it writes its marker whole): the
/// scan and the open refuse the log with an error naming the file, its length and its first
/// bytes, read no further than the marker's longest valid length, and change nothing; once the
/// marker is removed, the log opens with every record.
#[test]
fn a_marker_that_holds_no_lsn_fails_the_scan_and_the_open_and_changes_nothing() {
    let huge = vec![b'7'; 1 << 20];
    let damaged: [(&str, &[u8]); 6] = [
        ("empty", b""),
        ("text", b"garbage\n"),
        ("negative", b"-5\n"),
        ("not UTF-8", b"\xff\xfe5\n"),
        ("past u64", b"18446744073709551616\n"),
        ("1 MiB of digits", &huge),
    ];
    for (what, bytes) in damaged {
        let dir = tempfile::tempdir().unwrap();
        let last = durable_log_of_50_records(dir.path());
        let marker = dir.path().join(coordbus::wal::UNSYNCED_MARKER);
        std::fs::write(&marker, bytes).unwrap();
        let shown = &bytes[..bytes.len().min(coordbus::wal::UNSYNCED_MARKER_MAX_BYTES)];
        let expected = WalError::BadUnsyncedMarker {
            path: marker.clone(),
            len: bytes.len() as u64,
            preview: String::from_utf8_lossy(shown).into_owned(),
        };
        assert_eq!(
            scan_dir(dir.path(), RecoveryMode::Strict).err(),
            Some(expected.clone()),
            "{what}"
        );
        let opened =
            Wal::open(dir.path(), WalConfig { segment_size_bytes: 4096, ..WalConfig::default() });
        assert_eq!(opened.err(), Some(expected.clone()), "{what}");
        assert_eq!(
            expected.to_string(),
            format!(
                "the failed-log marker {marker:?} does not hold an LSN ({} bytes, starting {:?}): \
                 records after the failure may never have reached the disk; remove the marker \
                 to open the log with every record found",
                bytes.len(),
                String::from_utf8_lossy(shown)
            )
        );
        assert_eq!(std::fs::read(&marker).unwrap(), bytes, "{what}: the marker is left as found");

        std::fs::remove_file(&marker).unwrap();
        let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
        assert_eq!(wal.recovery_report().unsynced_cut, None, "{what}");
        assert_eq!(all_records(&wal).len() as u64, last.0, "{what}: every record kept");
    }
}

/// A temporary marker left by a process that died before renaming it never became the marker:
/// a scan ignores it, and a writer's open keeps every record and deletes it.
#[test]
fn a_temporary_marker_left_behind_cuts_nothing_and_a_writers_open_deletes_it() {
    let dir = tempfile::tempdir().unwrap();
    let last = durable_log_of_50_records(dir.path());
    let temp = dir.path().join(coordbus::wal::UNSYNCED_MARKER_TEMP);
    std::fs::write(&temp, b"3\n").unwrap();
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    assert_eq!((scan.report.unsynced_cut, scan.report.last_lsn), (None, last));
    assert!(temp.exists(), "a read-only scan changes nothing");
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4096);
    assert_eq!(wal.recovery_report().unsynced_cut, None);
    assert_eq!(all_records(&wal).len() as u64, last.0, "every record kept");
    assert!(!temp.exists(), "the writer's open deletes it");
}

#[test]
fn a_callback_may_drop_the_last_reference_to_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Arc::new(open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20));
    let (lsn, _) = wal.append_bytes(b"x", 0).unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    let keep = Arc::clone(&wal);
    wal.notify_when_durable(
        lsn,
        Box::new(move |result| {
            drop(keep);
            sender.send(result).unwrap();
        }),
    );
    drop(wal);
    receiver.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
}

/// A crash image of the last segment: each 512-byte sector written after the last sync either
/// reached the disk or still holds what was there before (zeros: the segment is preallocated).
#[test]
fn torn_sectors_of_an_unsynced_tail_are_cut_never_reported_as_corruption() {
    let pristine = tempfile::tempdir().unwrap();
    // 50 synced records, then (new segment) 200 records appended with nothing synced in
    // between: `Durability::None` leaves the durable LSN at 50 while they are appended.
    let wal = open(pristine.path(), Durability::default(), IoMode::Auto, 1 << 20);
    let mut payloads = Vec::new();
    let mut rng = seeded(99);
    for _ in 0..50 {
        let bytes = payload(&mut rng, 200);
        wal.append_bytes(&bytes, 0).unwrap();
        payloads.push(bytes);
    }
    wal.close().unwrap();
    drop(wal);
    let wal = open(pristine.path(), Durability::None, IoMode::Auto, 1 << 20);
    let (first_unsynced, handle) = {
        let bytes = payload(&mut rng, 200);
        let appended = wal.append_bytes(&bytes, 0).unwrap();
        payloads.push(bytes);
        appended
    };
    assert_eq!(first_unsynced, Lsn(51));
    for _ in 0..199 {
        let bytes = payload(&mut rng, 200);
        wal.append_bytes(&bytes, 0).unwrap();
        payloads.push(bytes);
    }
    wal.close().unwrap();
    drop(wal);
    let name = segment::file_name(handle.segment);
    let image = std::fs::read(pristine.path().join(&name)).unwrap();
    for seed in 1..=30u64 {
        let mut rng = seeded(seed * 7919);
        let mut torn = image.clone();
        let start = segment::HEADER_LEN as usize;
        let end = image.iter().rposition(|byte| *byte != 0).unwrap() + 1;
        let mut sector = 0;
        while sector * 512 < end {
            let (from, to) = ((sector * 512).max(start), ((sector + 1) * 512).min(end));
            if from < to && rng.random_range(0..4) == 0 {
                torn[from..to].fill(0);
            }
            sector += 1;
        }
        let work = tempfile::tempdir().unwrap();
        copy_dir(pristine.path(), work.path());
        std::fs::write(work.path().join(&name), &torn).unwrap();
        let wal = open(work.path(), Durability::default(), IoMode::Auto, 1 << 20);
        let found = all_records(&wal);
        assert!(found.len() >= 50, "seed {seed}: synced records kept");
        for (index, (lsn, _, bytes)) in found.iter().enumerate() {
            assert_eq!(lsn.0, index as u64 + 1, "seed {seed}");
            assert_eq!(bytes, &payloads[index], "seed {seed}");
        }
    }
}

#[test]
fn asking_for_io_uring_gives_it_or_a_typed_setup_error() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions { io: IoMode::IoUring, ..WalOptions::default() };
    match Wal::open_with_options(dir.path(), WalConfig::default(), options) {
        Ok(wal) => {
            assert_eq!(wal.io_path(), IoPath::IoUring);
            assert_eq!(wal.stats().io_path, Some(IoPath::IoUring));
            let (lsn, handle) = wal.append_bytes(b"ring", 0).unwrap();
            wal.wait_durable_timeout(lsn, WAIT).unwrap();
            assert_eq!(&*wal.read_bytes(handle).unwrap(), b"ring");
        }
        Err(error) => {
            assert!(wal_support::is_kernel_refusal(&error), "only a kernel refusal: {error:?}")
        }
    }
    let pwrite = WalOptions { io: IoMode::Pwrite, ..WalOptions::default() };
    let wal = Wal::open_with_options(dir.path(), WalConfig::default(), pwrite).unwrap();
    assert_eq!(wal.io_path(), IoPath::Pwrite);
}

/// A writer's open cuts a torn tail without shrinking a file someone maps. A read-only tool's
/// mapping of the segment (which holds the file's shared lock) keeps the bytes it mapped, where
/// a file cut in place under it would make its reads past the cut fault (SIGBUS); the writer
/// replaces the file under its name with a cut copy instead, and recovers every record.
#[test]
fn a_torn_tail_is_cut_without_shrinking_a_file_a_reader_maps() {
    use std::os::unix::fs::FileExt;

    let dir = tempfile::tempdir().unwrap();
    let mut rng = seeded(41);
    let payloads: Vec<Vec<u8>> = (0..100).map(|_| payload(&mut rng, 200)).collect();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20);
    for bytes in &payloads {
        wal.append_bytes(bytes, 0).unwrap();
    }
    wal.close().unwrap();
    drop(wal);
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let (path, valid_end) = {
        let last = scan.segments.last().unwrap();
        (last.path.clone(), last.valid_end)
    };
    // A torn write after the last record.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(&[0xA5; 3000], valid_end)
        .unwrap();
    let torn = std::fs::read(&path).unwrap();
    let expected: Vec<Vec<u8>> = payloads.clone();
    let records = |wal: &Wal| all_records(wal).into_iter().map(|(_, _, bytes)| bytes).collect();

    let reader = Wal::open_with_options(
        dir.path(),
        WalConfig::default(),
        WalOptions { read_only: true, ..WalOptions::default() },
    )
    .unwrap();
    let reader_records: Vec<Vec<u8>> = records(&reader);
    assert_eq!(reader_records, expected);
    // The file the reader maps, as the reader's mapping sees it.
    let mapped = std::fs::File::open(&path).unwrap();

    let writer = open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20);
    let tail = writer.recovery_report().torn_tail.clone().expect("the torn tail was found");
    assert_eq!(tail.offset, valid_end);
    let writer_records: Vec<Vec<u8>> = records(&writer);
    assert_eq!(writer_records, expected);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), valid_end, "the name holds the cut file");
    let mut seen = vec![0u8; torn.len()];
    mapped.read_exact_at(&mut seen, 0).unwrap();
    assert_eq!(seen, torn, "the file the reader maps changed under it");
    let reader_records: Vec<Vec<u8>> = records(&reader);
    assert_eq!(reader_records, expected);
    drop((reader, writer));

    // Nobody maps it any more: the next torn tail is cut in place.
    let reopened = open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20);
    reopened.append_bytes(b"after", 0).unwrap();
    reopened.close().unwrap();
    drop(reopened);
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let last = scan.segments.last().unwrap();
    let (path, valid_end) = (last.path.clone(), last.valid_end);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&[0xA5; 3000], valid_end).unwrap();
    let before = std::fs::File::open(&path).unwrap();
    let writer = open(dir.path(), Durability::default(), IoMode::Auto, 1 << 20);
    assert_eq!(
        writer.recovery_report().torn_tail.as_ref().map(|tail| tail.offset),
        Some(valid_end)
    );
    assert_eq!(before.metadata().unwrap().len(), valid_end, "cut in place, the same file");
    assert_eq!(all_records(&writer).len(), 101);
}

/// A log of `records` random payloads in segments of 64 KiB, closed; returns the payloads and
/// the last segment's path.
fn closed_log(dir: &Path, records: usize, seed: u64) -> (Vec<Vec<u8>>, std::path::PathBuf) {
    let mut rng = seeded(seed);
    let payloads: Vec<Vec<u8>> = (0..records).map(|_| payload(&mut rng, 400)).collect();
    let wal = open(dir, Durability::default(), IoMode::Auto, 64 << 10);
    for bytes in &payloads {
        wal.append_bytes(bytes, 0).unwrap();
    }
    wal.close().unwrap();
    drop(wal);
    let scan = scan_dir(dir, RecoveryMode::Strict).unwrap();
    (payloads, scan.segments.last().unwrap().path.clone())
}

/// A last segment whose header does not decode is a torn creation only if nothing follows
/// the header: a new file's header is synced before any record is written. A segment whose
/// header and records are all garbage held acknowledged records, so opening it is
/// corruption (strict mode fails, naming the segment), not a file quietly removed with its
/// records. (Before, any last segment without a valid header or frame was removed.)
#[test]
fn a_last_segment_of_garbage_is_corruption_not_a_torn_creation() {
    let dir = tempfile::tempdir().unwrap();
    let (_, last) = closed_log(dir.path(), 600, 51);
    let id = scan_dir(dir.path(), RecoveryMode::Strict).unwrap().segments.last().unwrap().id;
    assert!(id.0 >= 2, "the log rolled");
    let mut garbage = vec![0u8; std::fs::metadata(&last).unwrap().len() as usize];
    let mut rng = seeded(52);
    garbage.iter_mut().for_each(|byte| *byte = rng.random());
    std::fs::write(&last, &garbage).unwrap();
    match scan_dir(dir.path(), RecoveryMode::Strict) {
        Err(WalError::Corruption { segment, .. }) => assert_eq!(segment, id.0),
        other => panic!("expected corruption of segment {}, got {other:?}", id.0),
    }
    match Wal::open(dir.path(), WalConfig::default()) {
        Err(WalError::Corruption { segment, .. }) => assert_eq!(segment, id.0),
        other => panic!("expected corruption of segment {}, got {other:?}", id.0),
    }
    assert!(last.exists(), "the damaged segment was removed");
    let tolerant = scan_dir(dir.path(), RecoveryMode::TolerateCorruption).unwrap();
    let summary = tolerant.segments.last().unwrap();
    assert!(summary.skipped && !summary.dropped, "{summary:?}");
}

/// The same after a recycled segment: its file held an earlier segment, so its records are
/// followed by that segment's frames, and only the next segment's header can confirm where its
/// own records end. When that header is garbage, strict opening names the damaged segment, not
/// the intact recycled one before it.
#[test]
fn a_garbage_segment_after_a_recycled_one_is_the_corruption_named() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Arc::new(open(dir.path(), Durability::default(), IoMode::Auto, 64 << 10));
    let mut rng = seeded(54);
    let mut append = |wal: &Arc<Wal>| {
        let (lsn, handle) = wal.append_bytes(&payload(&mut rng, 400), 0).unwrap();
        wait_durable_bounded(wal, lsn).unwrap();
        (lsn, handle.segment)
    };
    let mut last = Lsn::ZERO;
    for _ in 0..600 {
        last = append(&wal).0;
    }
    // Every segment but the last becomes a spare (two are kept), to be the next segments.
    wal.clean_below_lsn(last, true).unwrap();
    // Append until the second spare is a segment, then a record too large for what is left
    // of it: the log rolls with the earlier use's frames left after the records.
    let recycled = (0..5000)
        .map(|_| append(&wal).1)
        .find(|_| wal.stats().recycled_segments == 2)
        .expect("the second spare became a segment");
    let room = (64 << 10) - segment::HEADER_LEN as usize;
    let largest = (0..room).rev().find(|&len| frame::frame_len(len) <= room).unwrap();
    let (lsn, handle) = wal.append_bytes(&vec![7u8; largest], 0).unwrap();
    wait_durable_bounded(&wal, lsn).unwrap();
    assert_eq!(handle.segment.0, recycled.0 + 1, "the large record rolled the log");
    Arc::into_inner(wal).unwrap().close().unwrap();
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let (before, garbled) = match scan.segments.as_slice() {
        [.., before, garbled] => (before, garbled),
        other => panic!("two segments at least: {other:?}"),
    };
    assert!(before.recycled && before.id == recycled, "{before:?}");
    assert!(!garbled.recycled && garbled.id.0 == recycled.0 + 1, "{garbled:?}");
    let mut garbage = vec![0u8; std::fs::metadata(&garbled.path).unwrap().len() as usize];
    garbage.iter_mut().for_each(|byte| *byte = rng.random());
    std::fs::write(&garbled.path, &garbage).unwrap();
    match scan_dir(dir.path(), RecoveryMode::Strict) {
        Err(WalError::Corruption { segment, .. }) => assert_eq!(segment, garbled.id.0),
        other => panic!("expected corruption of segment {}, got {other:?}", garbled.id.0),
    }
    match Wal::open(dir.path(), WalConfig::default()) {
        Err(WalError::Corruption { segment, .. }) => assert_eq!(segment, garbled.id.0),
        other => panic!("expected corruption of segment {}, got {other:?}", garbled.id.0),
    }
}

/// A torn creation (a header never made durable, zeros after it) is removed on open, and the
/// records before it are all kept.
#[test]
fn a_torn_segment_creation_is_removed_and_the_records_before_it_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (payloads, last) = closed_log(dir.path(), 50, 53);
    let id = scan_dir(dir.path(), RecoveryMode::Strict).unwrap().segments.last().unwrap().id;
    let torn = dir.path().join(segment::file_name(coordbus::wal::SegmentId(id.0 + 1)));
    let mut bytes = vec![0u8; 64 << 10];
    bytes[..20].fill(0x5A);
    std::fs::write(&torn, &bytes).unwrap();
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    assert!(scan.segments.last().unwrap().dropped, "{:?}", scan.segments.last());
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 64 << 10);
    let found: Vec<Vec<u8>> = all_records(&wal).into_iter().map(|(_, _, bytes)| bytes).collect();
    assert_eq!(found, payloads);
    assert!(!torn.exists(), "the torn creation was kept");
    assert!(last.exists());
}

/// Writes `frames` after the last valid record of the log's last segment (so at its
/// `valid_end`), after `garbage` bytes that are no frame; returns the segment's path.
fn append_after_garbage(dir: &Path, garbage: usize, frames: &[u8]) -> std::path::PathBuf {
    let scan = scan_dir(dir, RecoveryMode::Strict).unwrap();
    let last = scan.segments.last().unwrap();
    let mut bytes = std::fs::read(&last.path).unwrap();
    let at = last.valid_end as usize;
    let frames_at = (at + garbage).next_multiple_of(frame::ALIGN);
    assert!(frames_at + frames.len() <= bytes.len(), "room in the segment");
    bytes[at..frames_at].fill(0xA5);
    bytes[frames_at..frames_at + frames.len()].copy_from_slice(frames);
    std::fs::write(&last.path, &bytes).unwrap();
    last.path.clone()
}

/// Damage in the last segment proven by a frame that is not the run's last: the last frame's
/// sync gap saturated (it claims nothing durable), an earlier one was appended after the
/// damaged record was durable. That is corruption, as it was when a saturated gap still
/// claimed something (before, taking only the last frame as proof would have cut it as a torn
/// tail).
#[test]
fn damage_proven_by_an_earlier_frame_than_a_saturated_last_one_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    closed_log(dir.path(), 3, 56);
    let mut frames = Vec::new();
    // LSN 4 is the damaged stretch. LSN 5 was appended once 4 was durable.
    frame::encode_into(&mut frames, b"five", 5, 0, 4).unwrap();
    // LSN 6, its gap saturated (u32::MAX: unknown), its checksum made to match.
    let six_at = frames.len();
    frame::encode_into(&mut frames, b"six", 6, 0, 5).unwrap();
    frames[six_at + 24..six_at + 28].copy_from_slice(&u32::MAX.to_le_bytes());
    let crc = frame::frame_crc(&frames[six_at..]);
    frames[six_at + 4..six_at + 8].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(frame::parse(&frames[six_at..]).unwrap().0.synced_lsn_at_append(), 0);
    append_after_garbage(dir.path(), 32, &frames);
    match scan_dir(dir.path(), RecoveryMode::Strict) {
        Err(WalError::Corruption { reason, .. }) => {
            assert!(reason.contains("LSN 5 at offset"), "the proof is LSN 5: {reason}");
        }
        other => panic!("expected corruption, got {:?}", other.map(|scan| scan.report)),
    }
}

/// A frame with a valid CRC but an LSN this log cannot have written there (crafted, or
/// foreign bytes) after a damaged stretch: recovery does not take it as the log's next record.
/// Before, tolerant recovery resumed at its LSN (`u64::MAX`: an overflow panic where overflow
/// is checked, else LSNs wrapped to 0 and every later append read as durable at once), and
/// strict recovery took it as proof of damage.
#[test]
fn a_frame_claiming_an_impossible_lsn_is_not_taken_for_a_record_of_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let (payloads, _) = closed_log(dir.path(), 3, 55);
    let mut crafted = Vec::new();
    frame::encode_into(&mut crafted, b"not of this log", u64::MAX, 0, u64::MAX).unwrap();
    append_after_garbage(dir.path(), 32, &crafted);
    for mode in [RecoveryMode::Strict, RecoveryMode::TolerateCorruption] {
        let scan = scan_dir(dir.path(), mode).unwrap();
        assert_eq!(scan.report.last_lsn, Lsn(3), "{mode:?}: {:?}", scan.report);
        assert!(scan.segments.last().unwrap().torn_tail.is_some(), "{mode:?}: cut as a torn tail");
    }
    let wal = Arc::new(
        Wal::open(
            dir.path(),
            WalConfig { recovery: RecoveryMode::TolerateCorruption, ..WalConfig::default() },
        )
        .unwrap(),
    );
    assert_eq!(all_records(&wal).len(), payloads.len());
    let syncs = wal.stats().syncs;
    let (lsn, _) = wal.append_bytes(b"next", 0).unwrap();
    assert_eq!(lsn, Lsn(4), "LSNs continue after the log's own records");
    wait_durable_bounded(&wal, lsn).unwrap();
    assert!(wal.stats().syncs > syncs, "the append was made durable by a sync");
}

/// Tolerant recovery of a last segment whose every other stretch is damaged (32 garbage bytes
/// before each record) takes time in proportion to the segment, not to its square: each damaged
/// stretch looks for proof among the records after it, and the records' runs are walked once.
/// Before, a 4 MiB segment of this took minutes.
#[test]
fn tolerant_recovery_of_a_segment_damaged_between_every_record_is_linear() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), IoMode::Auto, 4 << 20);
    wal.append_bytes(b"first", 0).unwrap();
    wal.close().unwrap();
    drop(wal);
    let room = (4 << 20) - segment::HEADER_LEN as usize - 128;
    let records = room / 64;
    let mut pattern = Vec::with_capacity(records * 64);
    for index in 0..records as u64 {
        pattern.extend_from_slice(&[0xA5; 32]);
        // Empty payloads (32-byte frames), each appended when the one before was durable.
        let lsn = 2 + index;
        frame::encode_into(&mut pattern, &[], lsn, 0, lsn - 1).unwrap();
    }
    append_after_garbage(dir.path(), 0, &pattern);
    let path = dir.path().to_path_buf();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(scan_dir(&path, RecoveryMode::TolerateCorruption));
    });
    let scan = receiver
        .recv_timeout(Duration::from_secs(60))
        .expect("tolerant recovery finished within 60 s")
        .unwrap();
    let summary = scan.segments.last().unwrap();
    // The last record proves no damage before it (nothing was appended after it was durable):
    // that stretch and the record are a torn tail.
    assert_eq!(summary.records, records as u64, "every record but the last kept");
    assert_eq!(summary.corruption.len(), records - 1, "each damaged stretch noted");
    assert!(summary.torn_tail.is_some(), "{summary:?}");
}
