//! A write the kernel itself refuses, on the live io_uring path, with the `fdatasync` linked
//! behind it.
//!
//! Why a file of its own: `tests/wal_faults.rs` injects results after the ring ran the real
//! operation, so there the linked `fdatasync` always runs. Only a write that fails in the
//! kernel breaks the link, and then the kernel cancels the sync (`ECANCELED`). The kernel
//! refuses the write here because of the process's file-size limit (`RLIMIT_FSIZE`: a write at
//! or past it fails with `EFBIG`). The limit covers the whole process, so this test must run
//! alone in its own test binary: this file holds only it.
//!
//! What it shows: the log fails with the write's own error (not the cancelled sync's), the
//! durable LSN does not move, later appends are refused, and a reopened log holds exactly the
//! acknowledged records. Both places that handle a cancelled linked sync run: the sync
//! thread's pipelined path (a later group of a segment) and the serial path of a waiting
//! thread that writes the group itself (`EveryRecord`, once the records before it were led).
//! What it cannot show: that a cancelled sync is not counted when the rest of a short write is
//! then written successfully; the limit refuses that rewrite too, so the failed write decides
//! the outcome whatever the sync's handling. A third case checks a new segment whose
//! preallocation the kernel refuses.
//!
//! `unsafe` here: three libc calls, `getrlimit`, `setrlimit` and `signal` (to ignore
//! `SIGXFSZ`).
#![allow(unsafe_code)]

mod wal_support;

use std::{io::ErrorKind, sync::Arc, time::Duration};

use coordbus::{
    record::frame,
    wal::{Durability, IoMode, IoPath, Lsn, Wal, WalConfig, WalError, WalOptions},
};
use wal_support::bounded;

fn config(durability: Durability, segment_size_bytes: u64) -> WalConfig {
    WalConfig { segment_size_bytes, durability, ..WalConfig::default() }
}

fn uring_options() -> WalOptions {
    WalOptions { io: IoMode::IoUring, ..WalOptions::default() }
}

/// A lowered file-size limit of the process (`RLIMIT_FSIZE`, soft limit only), restored when
/// dropped (also when an assertion fails, so the reopening below and the harness are not
/// limited).
struct FileSizeLimit {
    original: libc::rlimit,
}

impl FileSizeLimit {
    fn set(bytes: u64) -> Self {
        let mut original = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `getrlimit` writes the struct passed by reference, which outlives the call.
        let result = unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut original) };
        assert_eq!(result, 0, "getrlimit: {}", std::io::Error::last_os_error());
        assert!(bytes <= original.rlim_cur, "the limit is lowered, never raised");
        set_file_size_limit(libc::rlimit { rlim_cur: bytes, rlim_max: original.rlim_max });
        Self { original }
    }
}

impl Drop for FileSizeLimit {
    fn drop(&mut self) {
        set_file_size_limit(self.original);
    }
}

fn set_file_size_limit(limit: libc::rlimit) {
    // SAFETY: `setrlimit` only reads the struct passed by reference.
    let result = unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &limit) };
    assert_eq!(result, 0, "setrlimit: {}", std::io::Error::last_os_error());
}

fn payloads(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let wal = Wal::open_with_options(dir, config(Durability::default(), 1 << 20), uring_options())
        .unwrap();
    wal.iter_from(Lsn::ZERO).unwrap().map(|record| record.unwrap().bytes.to_vec()).collect()
}

/// The segment header's length (the WAL's on-disk format, module `wal`): a segment's first
/// frame starts there.
const SEGMENT_HEADER_LEN: u64 = 64;

const REFUSED: &[u8] = b"refused by the kernel";

/// How the refused record's group reaches the kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Case {
    /// A later group of a segment, written by the sync thread on its pipelined path.
    Pipelined,
    /// `EveryRecord`, with a waiting thread that writes the group itself ("leading", the
    /// serial path) once the records before it were led (one of the first 100 must be, or the
    /// test fails).
    Led,
    /// The first record of a new segment: the kernel refuses the segment's preallocation.
    NewSegment,
}

/// Appends records and waits until they are synced, then limits the file size to where the
/// next frame goes and appends one more record: its group is alone on the ring and is one
/// write, so its `fdatasync` goes linked behind that write, and the kernel refuses the write
/// (or, for a new segment, its preallocation).
fn refused_write(case: Case) {
    let dir = tempfile::tempdir().unwrap();
    let group_commit =
        Durability::GroupCommit { max_delay: Duration::from_micros(200), max_bytes: 1 << 20 };
    let (durability, segment_size_bytes, first) = match case {
        Case::Pipelined => (group_commit, 1 << 20, b"acknowledged".to_vec()),
        Case::Led => (Durability::EveryRecord, 1 << 20, b"acknowledged".to_vec()),
        // Fills its segment exactly, so the next record starts a new one.
        Case::NewSegment => (
            group_commit,
            4096,
            vec![7u8; (4096 - SEGMENT_HEADER_LEN) as usize - frame::HEADER_LEN],
        ),
    };
    let config = config(durability, segment_size_bytes);
    if !wal_support::kernel_allows_io_uring() {
        return;
    }
    let wal = Arc::new(Wal::open_with_options(dir.path(), config, uring_options()).unwrap());
    assert_eq!(wal.io_path(), IoPath::IoUring, "the test needs the live io_uring path");
    // Under no limit: the first record creates and preallocates the segment. In the led case,
    // records go until one was led: appends then leave their group to the next leader. Each
    // is appended and waited for on one thread, as a real waiter does, so that the wait may
    // lead (`bounded`).
    let record = first.clone();
    let (acknowledged, last_lsn, last_handle) = bounded(&wal, move |wal| {
        let mut acknowledged = Vec::new();
        loop {
            let (lsn, handle) = wal.append_bytes(&record, 1).unwrap();
            wal.wait_durable(lsn).unwrap();
            acknowledged.push(record.clone());
            if case != Case::Led || wal.stats().led_groups > 0 || acknowledged.len() == 100 {
                break (acknowledged, lsn, handle);
            }
        }
    });
    if case == Case::Led {
        assert!(wal.stats().led_groups > 0, "a waiter led a group before the refused one");
    }
    let last_end = last_handle.offset + frame::frame_len(first.len()) as u64;
    let next_offset = if case == Case::NewSegment { SEGMENT_HEADER_LEN } else { last_end };
    let limit = FileSizeLimit::set(next_offset);
    // Appended and waited for on one thread too: in the led case, its waiter leads it.
    let (handle, waited) = bounded(&wal, |wal| {
        let (lsn, handle) = wal.append_bytes(REFUSED, 2).unwrap();
        (handle, wal.wait_durable(lsn))
    });
    assert_eq!(handle.offset, next_offset, "the new frame starts at the limit");
    assert_eq!(handle.segment != last_handle.segment, case == Case::NewSegment);
    let error = waited.expect_err("a record whose write failed must not be reported durable");
    // The failure is the refused operation, with the kernel's EFBIG; never the cancelled sync.
    let expected_op = if case == Case::NewSegment { "preallocate segment" } else { "write" };
    match error.root_cause() {
        WalError::Io { op, kind, .. } => {
            assert_eq!((*op, *kind), (expected_op, ErrorKind::FileTooLarge), "{error}");
        }
        other => panic!("expected the refused {expected_op}, got {other}"),
    }
    assert_eq!(wal.durable_lsn(), last_lsn, "the durable LSN did not move");
    assert!(matches!(wal.append_bytes(b"after the failure", 3), Err(WalError::Failed { .. })));
    drop(limit);
    drop(wal);
    // Reopened: the acknowledged records, and nothing of the refused one.
    assert_eq!(payloads(dir.path()), acknowledged);
}

#[test]
fn a_write_the_kernel_refuses_on_the_linked_path_fails_the_log_and_nothing_is_reported_durable() {
    // The signal the kernel sends with EFBIG would end the process: ignored here, so that the
    // test sees the error.
    // SAFETY: installs the "ignore" disposition; no handler code runs.
    let previous = unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    assert_ne!(previous, libc::SIG_ERR);
    refused_write(Case::Pipelined);
    refused_write(Case::Led);
    refused_write(Case::NewSegment);
}
