//! An iterator follows the log's tail: once it has returned everything written, a later
//! `next` returns what was written since, in the segment it stopped in and in segments made
//! after the iterator was, never skipping a record (`Wal::iter_from`).
//!
//! Method: the public API on a temporary directory; each record is made durable (so written)
//! before the iterator is asked again. Small segments make the log roll.

use std::time::Duration;

use coordbus::wal::{Durability, Lsn, Wal, WalConfig, WalIter};

/// Bound of a durability wait: far longer than a sync.
const WAIT: Duration = Duration::from_secs(30);

fn open(dir: &std::path::Path, durability: Durability, segment_size_bytes: u64) -> Wal {
    Wal::open(dir, WalConfig { segment_size_bytes, durability, ..WalConfig::default() }).unwrap()
}

fn append_durable(wal: &Wal, payload: &[u8]) -> Lsn {
    let (lsn, _) = wal.append_bytes(payload, 1).unwrap();
    wal.wait_durable_timeout(lsn, WAIT).unwrap();
    lsn
}

fn lsns(iter: &mut WalIter) -> Vec<u64> {
    iter.map(|record| record.unwrap().lsn.0).collect()
}

/// An iterator from an LSN past every record written stops, then yields the records that
/// reach it once they are written (it used to skip the segment still being written for good).
#[test]
fn an_iterator_from_past_the_written_records_yields_them_once_written() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), 1 << 20);
    append_durable(&wal, b"one");
    let mut iter = wal.iter_from(Lsn(2)).unwrap();
    assert_eq!(lsns(&mut iter), Vec::<u64>::new());
    append_durable(&wal, b"two");
    assert_eq!(lsns(&mut iter), [2]);
    append_durable(&wal, b"three");
    assert_eq!(lsns(&mut iter), [3]);
}

/// An iterator made before the log had any segment, and one that reached the end of the
/// segments there were when it was made, both go on into the segments made since (they used
/// to stop for good at the end of their first snapshot of the segments).
#[test]
fn an_iterator_follows_the_log_into_segments_made_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open(dir.path(), Durability::default(), 4096);
    let mut from_empty = wal.iter_from(Lsn::ZERO).unwrap();
    assert_eq!(lsns(&mut from_empty), Vec::<u64>::new());
    append_durable(&wal, &[0; 100]);
    let mut from_first = wal.iter_from(Lsn::ZERO).unwrap();
    assert_eq!(lsns(&mut from_first), [1]);
    let last = (1..=100u8).map(|index| append_durable(&wal, &[index; 100])).last().unwrap();
    assert!(wal.stats().segments >= 3, "the log rolled: {:?}", wal.stats());
    assert_eq!(lsns(&mut from_first), (2..=last.0).collect::<Vec<_>>());
    assert_eq!(lsns(&mut from_empty), (1..=last.0).collect::<Vec<_>>());
}

/// A segment appended to but not yet written (its group waits out the group-commit delay,
/// its file may not exist yet) is where an iterator stops, not a segment it skips.
#[test]
fn a_segment_not_yet_written_is_waited_for_not_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let durability =
        Durability::GroupCommit { max_delay: Duration::from_millis(300), max_bytes: 1 << 20 };
    let wal = open(dir.path(), durability, 1 << 20);
    let (lsn, _) = wal.append_bytes(b"held for the delay", 1).unwrap();
    let mut iter = wal.iter_from(Lsn::ZERO).unwrap();
    // Empty while the group waits (or the record, if this thread was held past the delay).
    let mut seen = lsns(&mut iter);
    wal.wait_durable_timeout(lsn, WAIT).unwrap();
    seen.extend(lsns(&mut iter));
    assert_eq!(seen, [lsn.0]);
}
