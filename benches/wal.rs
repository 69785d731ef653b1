//! WAL benchmarks: durable append throughput and recovery scan speed.
//!
//! `wal/append_fdatasync`: 100 000 records of 64 bytes appended by one thread, timed until the
//! last is durable, for the io_uring and pwrite paths of the WAL, against the baseline of a
//! plain sequential `pwrite` of the same framed bytes with one `fdatasync` per 1 MiB batch (the
//! group size), all in the same group and run (`Throughput::Bytes`).
//! `wal/recovery`: opening (scanning and CRC-checking) a log of 100 000 records, against the
//! baseline of reading the same number of bytes from the segment files and checksumming them.
//! `wal/frame_crc/<bytes>`: the CRC32C of one frame as appends and recovery compute it
//! ([`frame::frame_crc`]: a short loop over the CRC32 instruction below 512 bytes, `crc-fast`
//! from there on), against the baseline of the `crc32c` crate on the same two ranges, for frames
//! of 96 bytes (a 64-byte record), 608 and 3104 bytes (about the epoch log's delta record at
//! 1000 partitions of offsets that take 3 bytes each), in the same group (`Throughput::Bytes`).
//!
//! Smoke run: `cargo bench -p coordbus --bench wal -- --quick` (or `--test`).

// criterion's macros generate undocumented functions.
#![allow(missing_docs)]

use std::{
    fs::OpenOptions,
    os::unix::fs::FileExt,
    time::{Duration, Instant},
};

use coordbus::{
    record::frame,
    wal::{Durability, IoMode, Wal, WalConfig, WalOptions},
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RECORDS: u64 = 100_000;
const RECORD_BYTES: usize = 64;
const GROUP_BYTES: usize = 1 << 20;

fn config() -> WalConfig {
    WalConfig {
        segment_size_bytes: 64 << 20,
        durability: Durability::GroupCommit {
            max_delay: Duration::from_micros(200),
            max_bytes: GROUP_BYTES,
        },
        ..WalConfig::default()
    }
}

/// Appends `RECORDS` records into a fresh log and waits for the last to be durable.
fn wal_append(io: IoMode) -> Duration {
    let dir = tempfile::tempdir().unwrap();
    let wal =
        Wal::open_with_options(dir.path(), config(), WalOptions { io, ..WalOptions::default() })
            .unwrap();
    let payload = [7u8; RECORD_BYTES];
    let started = Instant::now();
    let mut last = coordbus::Lsn::ZERO;
    for index in 0..RECORDS {
        last = wal.append_bytes(std::hint::black_box(&payload), index as i64).unwrap().0;
    }
    wal.wait_durable(last).unwrap();
    let elapsed = started.elapsed();
    wal.close().unwrap();
    elapsed
}

/// The same framed bytes with plain pwrite, one fdatasync per group-sized batch.
fn pwrite_baseline() -> Duration {
    let dir = tempfile::tempdir().unwrap();
    let file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(dir.path().join("baseline"))
        .unwrap();
    let total = RECORDS * frame::frame_len(RECORD_BYTES) as u64;
    let batch = vec![7u8; GROUP_BYTES];
    let started = Instant::now();
    let mut offset = 0;
    while offset < total {
        let len = (total - offset).min(GROUP_BYTES as u64) as usize;
        file.write_all_at(&batch[..len], offset).unwrap();
        file.sync_data().unwrap();
        offset += len as u64;
    }
    started.elapsed()
}

fn append(c: &mut Criterion) {
    // Sanity-check the contenders before measuring.
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), config()).unwrap();
    let (lsn, handle) = wal.append_bytes(&[1; RECORD_BYTES], 0).unwrap();
    wal.wait_durable(lsn).unwrap();
    assert_eq!(&*wal.read_bytes(handle).unwrap(), &[1; RECORD_BYTES]);
    drop(wal);

    let mut group = c.benchmark_group("wal/append_fdatasync");
    group.throughput(Throughput::Bytes(RECORDS * frame::frame_len(RECORD_BYTES) as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    group.bench_function("wal_io_uring", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| wal_append(IoMode::Auto)).sum())
    });
    group.bench_function("wal_pwrite", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| wal_append(IoMode::Pwrite)).sum())
    });
    group.bench_function("baseline_pwrite_fdatasync_1MiB", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| pwrite_baseline()).sum())
    });
    group.finish();
}

fn recovery(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let bytes = {
        let wal = Wal::open(dir.path(), config()).unwrap();
        for index in 0..RECORDS {
            wal.append_bytes(&[3u8; RECORD_BYTES], index as i64).unwrap();
        }
        wal.close().unwrap();
        drop(wal);
        let wal = Wal::open(dir.path(), config()).unwrap();
        assert_eq!(wal.recovery_report().records, RECORDS);
        wal.recovery_report().bytes
    };
    let mut group = c.benchmark_group("wal/recovery");
    group.throughput(Throughput::Bytes(bytes));
    group.sample_size(10);
    group.bench_function("open_scan_100k", |b| {
        b.iter(|| {
            let wal = Wal::open(dir.path(), config()).unwrap();
            std::hint::black_box(wal.recovery_report().records)
        })
    });
    // Baseline: read every segment file and checksum all of it (no framing, no records): the
    // floor of a scan that verifies every byte.
    group.bench_function("baseline_read_crc32c", |b| {
        b.iter(|| {
            use std::io::Read;
            let mut checksum = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
            let mut left = bytes;
            let mut data = Vec::with_capacity(bytes as usize);
            for entry in std::fs::read_dir(dir.path()).unwrap() {
                let path = entry.unwrap().path();
                if path.is_file() && left > 0 {
                    data.clear();
                    let file = std::fs::File::open(&path).unwrap();
                    left -= file.take(left).read_to_end(&mut data).unwrap() as u64;
                    checksum.update(&data);
                }
            }
            std::hint::black_box(checksum.finalize())
        })
    });
    group.finish();
}

fn frame_crc(c: &mut Criterion) {
    for frame_bytes in [96usize, 608, 3104] {
        let mut group = c.benchmark_group(format!("wal/frame_crc/{frame_bytes}"));
        group.throughput(Throughput::Bytes(frame_bytes as u64));
        let frame: Vec<u8> = (0..frame_bytes as u32)
            .map(|index| (index.wrapping_mul(0x9E37_79B9) >> 24) as u8)
            .collect();
        group.bench_function("coordbus", |b| {
            b.iter(|| frame::frame_crc(std::hint::black_box(&frame)))
        });
        group.bench_function("baseline_crc32c_crate", |b| {
            b.iter(|| {
                let frame = std::hint::black_box(&frame);
                crc32c::crc32c_append(crc32c::crc32c(&frame[8..]), &frame[..4])
            })
        });
        assert_eq!(
            frame::frame_crc(&frame),
            crc32c::crc32c_append(crc32c::crc32c(&frame[8..]), &frame[..4])
        );
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = append, recovery, frame_crc
}
criterion_main!(benches);
