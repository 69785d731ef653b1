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

/// The peak resident memory of this process so far, in KiB (`VmHWM`).
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|line| line.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A segment file that is a 1 GiB hole (a torn creation on a file system that preallocates
/// sparsely) is scanned without reading the hole: recovery looks only where the file system
/// says data may be, so the scan does not fault a gigabyte of zero pages in (the peak resident
/// memory of the process stays far below it).
#[test]
fn a_sparse_segment_is_scanned_without_reading_its_holes() {
    let dir = tempfile::tempdir().unwrap();
    let file = std::fs::File::create(dir.path().join("seg-0000000001.wal")).unwrap();
    file.set_len(1 << 30).unwrap();
    drop(file);
    let before = peak_rss_kib();
    let scan = scan_dir(dir.path(), RecoveryMode::Strict).unwrap();
    let grown_mib = (peak_rss_kib() - before) / 1024;
    assert!(scan.segments[0].dropped, "an all-zero file is a torn creation: {scan:?}");
    assert!(grown_mib < 256, "the scan made the process {grown_mib} MiB larger at its peak");
}
