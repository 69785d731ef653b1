//! Goal (WAL-F6, SPEC E.3's recommendation): a frame header whose declared length is huge (a
//! torn or garbage tail) is checked against the bytes there before anything is sized from it;
//! recovery never allocates the declared length.
//!
//! Method: `allocation_counter` (the global allocator of this test binary) counts the
//! allocations of the test's own thread, which runs the recovery scan (`scan_dir`): the most
//! bytes live at once during the scan stay far below the declared length, and the counter is
//! checked to have seen the scan's own allocations.

use std::path::Path;

use coordbus::{
    record::frame,
    wal::{scan_dir, RecoveryMode, Wal, WalConfig},
};

/// A closed log of ten small records in `dir`; returns its segment's path and where its
/// records end.
fn small_log(dir: &Path) -> (std::path::PathBuf, u64) {
    let wal = Wal::open(dir, WalConfig::default()).unwrap();
    for index in 0..10u8 {
        wal.append_bytes(&[index; 100], 1).unwrap();
    }
    wal.close().unwrap();
    drop(wal);
    let scan = scan_dir(dir, RecoveryMode::Strict).unwrap();
    let segment = scan.segments.last().unwrap();
    (segment.path.clone(), segment.valid_end)
}

#[test]
fn a_huge_declared_frame_length_is_never_allocated() {
    for declared in [u32::MAX, 0x8000_0000, 1 << 29] {
        let dir = tempfile::tempdir().unwrap();
        let (path, end) = small_log(dir.path());
        let mut header = [0u8; frame::HEADER_LEN];
        header[0..4].copy_from_slice(&declared.to_le_bytes());
        header[28..30].copy_from_slice(&frame::MAGIC.to_le_bytes());
        header[30] = frame::VERSION;
        std::os::unix::fs::FileExt::write_all_at(
            &std::fs::OpenOptions::new().write(true).open(&path).unwrap(),
            &header,
            end,
        )
        .unwrap();
        let mut scan = None;
        let counted =
            allocation_counter::measure(|| scan = Some(scan_dir(dir.path(), RecoveryMode::Strict)));
        let scan = scan.unwrap().unwrap();
        assert_eq!(scan.report.records, 10, "declared {declared}");
        assert_eq!(scan.report.torn_tail.as_ref().map(|tail| tail.offset), Some(end));
        assert!(counted.count_total > 0, "the counter saw the scan: {counted:?}");
        assert!(counted.bytes_max < 1 << 20, "declared {declared}: {counted:?}");
    }
}
