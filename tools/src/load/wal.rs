//! Workloads `wal` (durable append throughput and latency) and `wal-recover` (recovery scan).
//!
//! `wal`: 64-byte records appended from 1 and 2 threads in each durability mode.
//! * Group commit and `None`: each thread appends its share with `append_bytes`, then the
//!   figure's clock stops when the last LSN is durable. `msgs_per_sec` = durable records/s.
//!   Baseline (`--baseline pwrite`): one thread `pwrite`s the same framed bytes sequentially
//!   into a fresh file in batches of the group size, one `fdatasync` per batch.
//! * `EveryRecord`: each thread appends one record and waits until it is durable, in a loop;
//!   latency = append-to-durable. Baseline: a bare `pwrite` of one frame + `fdatasync`, in a
//!   loop, from as many threads, into a file whose blocks were written beforehand (the
//!   cheapest sync: strict); its rate is every thread's records per second of wall time (with
//!   two threads, concurrent syncs may share a device flush, as ours share a group), and
//!   `latency_ratio` = our p50 / baseline p50. The same into an extending file is reported as
//!   `appending_fdatasync_p50_ns`.
//!
//! `wal-recover`: writes `--records` records, closes, then times `Wal::open` (the recovery
//! scan of every frame: bounds, CRC, LSN order) and a full iteration. `bytes_per_sec` = framed
//! bytes scanned per second.
//!
//! Every flag is checked before the first figure is measured: counts and sizes have clap
//! ranges (the error names the flag and the value), and what depends on two flags (each
//! thread's share of `--records`, a record's frame in a `--segment-mib` segment) is checked
//! by `validate` / `validate_recover`.

use std::{
    fs::OpenOptions,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{Arc, Barrier},
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::builder::RangedU64ValueParser;
use coordbus::{
    record::frame,
    wal::{segment, Durability, IoMode, Lsn, Wal, WalConfig, WalOptions},
};
use coordbus_tools::scratch::ScratchDir;
use hdrhistogram::Histogram;

use crate::{
    limits::{
        segment_bytes, MAX_GROUP_BYTES, MAX_GROUP_DELAY_US, MAX_RECORD_BYTES, MAX_THREADS,
        SEGMENT_MIB,
    },
    report::{Figure, Percentiles},
    shares::share,
};

/// Flags of `coordbus-load wal`.
#[derive(clap::Args, Debug, Clone)]
pub struct WalArgs {
    /// Records per throughput figure (group commit and none), split over the threads; at
    /// least the largest of `--threads` (every thread appends at least one).
    #[arg(long, default_value_t = 2_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub records: u64,
    /// Records per thread for the EveryRecord latency figures (at least 1).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub every_records: u64,
    /// Payload bytes per record (1 ..= 1 GiB, the WAL's largest payload; its frame must also
    /// fit in a `--segment-mib` segment).
    #[arg(
        long,
        default_value_t = 64,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_RECORD_BYTES)
    )]
    pub record_bytes: usize,
    /// Thread counts to measure, comma-separated (each 1 ..= 1024).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2",
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_THREADS)
    )]
    pub threads: Vec<usize>,
    /// Durability modes to measure, comma-separated: group, every, none.
    #[arg(long, value_delimiter = ',', default_value = "group,every,none")]
    pub durability: Vec<String>,
    /// Group commit: longest delay of a group, in microseconds (at most 60 s).
    #[arg(
        long,
        default_value_t = 200,
        value_parser = clap::value_parser!(u64).range(0..=MAX_GROUP_DELAY_US)
    )]
    pub max_delay_us: u64,
    /// Group commit: group size that starts a write at once, in bytes (1 ..= 1 GiB; the
    /// pwrite baseline writes batches of this size).
    #[arg(
        long,
        default_value_t = 4 << 20,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_GROUP_BYTES)
    )]
    pub max_bytes: usize,
    /// Segment size in MiB (1 ..= 1048576, i.e. at most 1 TiB, the WAL's largest).
    #[arg(
        long,
        default_value_t = 64,
        value_parser = clap::value_parser!(u64).range(SEGMENT_MIB)
    )]
    pub segment_mib: u64,
    /// I/O path: auto, io_uring or pwrite.
    #[arg(long, default_value = "auto")]
    pub io: String,
    /// How much lower the WAL's sync thread's CPU priority is (added to its nice value, capped
    /// at 19; 0 leaves it; at most 39). Its io_uring workers inherit it.
    #[arg(
        long,
        default_value_t = coordbus::wal::DEFAULT_SYNC_THREAD_NICE,
        value_parser = clap::value_parser!(u8)
            .range(0..=i64::from(coordbus::wal::MAX_SYNC_THREAD_NICE))
    )]
    pub sync_nice: u8,
    /// Baseline measured in the same run: pwrite or none.
    #[arg(long, default_value = "pwrite")]
    pub baseline: String,
    /// Directory for the logs (a temporary directory inside it; default: the system temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Flags of `coordbus-load wal-recover`.
#[derive(clap::Args, Debug, Clone)]
pub struct WalRecoverArgs {
    /// Records written, then recovered (at least 1).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub records: u64,
    /// Payload bytes per record (1 ..= 1 GiB, the WAL's largest payload; its frame must also
    /// fit in a `--segment-mib` segment).
    #[arg(
        long,
        default_value_t = 64,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_RECORD_BYTES)
    )]
    pub record_bytes: usize,
    /// Segment size in MiB (1 ..= 1048576, i.e. at most 1 TiB, the WAL's largest).
    #[arg(
        long,
        default_value_t = 64,
        value_parser = clap::value_parser!(u64).range(SEGMENT_MIB)
    )]
    pub segment_mib: u64,
    /// Times the recovery is repeated (the best and the median are reported; 1 ..= 1000).
    #[arg(
        long,
        default_value_t = 3,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=1000)
    )]
    pub repeats: usize,
    /// Directory for the log (a temporary directory inside it; default: the system temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The ~3-5 s version used by the no-argument run.
pub fn quick() -> WalArgs {
    WalArgs {
        records: 1_000_000,
        every_records: 200,
        record_bytes: 64,
        threads: vec![1, 2],
        durability: vec!["group".into(), "every".into(), "none".into()],
        max_delay_us: 200,
        max_bytes: 4 << 20,
        segment_mib: 64,
        io: "auto".into(),
        sync_nice: coordbus::wal::DEFAULT_SYNC_THREAD_NICE,
        baseline: "pwrite".into(),
        dir: None,
    }
}

/// The quick version of `wal-recover`.
pub fn quick_recover() -> WalRecoverArgs {
    WalRecoverArgs { records: 1_000_000, record_bytes: 64, segment_mib: 64, repeats: 3, dir: None }
}

/// A fresh scratch directory inside `dir` (`--dir`, which must exist; default: the system
/// temp dir), removed on drop or interruption: runs never reuse (or replay) what an earlier run
/// left.
pub fn temp_in(dir: &Option<PathBuf>) -> anyhow::Result<ScratchDir> {
    Ok(match dir {
        Some(dir) => {
            coordbus_tools::scratch::check_parent_dir("--dir", dir)?;
            ScratchDir::new_in(dir, SCRATCH_PREFIX).with_context(|| {
                format!("creating a temporary directory in --dir {}", dir.display())
            })?
        }
        None => ScratchDir::new(SCRATCH_PREFIX).context("creating a temporary directory")?,
    })
}

/// The start of the load generator's scratch directories' names.
pub const SCRATCH_PREFIX: &str = "coordbus-load-";

/// The durability modes `--durability` accepts.
const DURABILITY_NAMES: [&str; 3] = ["group", "every", "none"];

/// Checks that a record of `record_bytes` fits in a `segment_mib` segment (after its
/// header), so no figure fails on its first append.
fn check_record_fits(record_bytes: usize, segment_mib: u64) -> anyhow::Result<()> {
    let frame_bytes = frame::frame_len(record_bytes) as u64;
    let room = segment_bytes(segment_mib).saturating_sub(segment::HEADER_LEN);
    anyhow::ensure!(
        frame_bytes <= room,
        "--record-bytes {record_bytes} makes {frame_bytes}-byte frames, more than the {room} \
         bytes a --segment-mib {segment_mib} segment holds"
    );
    Ok(())
}

/// Checks that `records` frames of `record_bytes` count less than 2^64 bytes (the figures'
/// byte counts); `what` names the flags.
fn check_total_bytes(records: u64, record_bytes: usize, what: &str) -> anyhow::Result<()> {
    let frame_bytes = frame::frame_len(record_bytes) as u64;
    anyhow::ensure!(
        records.checked_mul(frame_bytes).is_some(),
        "{what} of --record-bytes {record_bytes} ({frame_bytes}-byte frames) add up to more \
         than 2^64 bytes"
    );
    Ok(())
}

/// Checks what the flags' ranges cannot, before anything is measured: each thread count
/// gets at least one record, every durability mode and `--io` / `--baseline` are known (so a
/// typo in the last mode does not fail the run after the first ones), and a record fits in a
/// segment.
fn validate(args: &WalArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.threads.is_empty(), "--threads lists no thread count");
    // `--records` is the throughput modes' total; `every` counts `--every-records` per thread.
    let splits_records = args.durability.iter().any(|name| name != "every");
    for &threads in &args.threads {
        anyhow::ensure!(threads > 0, "--threads lists 0: every thread count is at least 1");
        anyhow::ensure!(
            !splits_records || args.records >= threads as u64,
            "--records {} is less than --threads {threads}: every thread appends at least one \
             record",
            args.records
        );
        check_total_bytes(
            args.every_records.saturating_mul(threads as u64),
            args.record_bytes,
            &format!("--every-records {} x --threads {threads}", args.every_records),
        )?;
        // Each thread appends from a payload of its own.
        crate::limits::check_planned_bytes(
            &format!("--threads {threads} x --record-bytes {}", args.record_bytes),
            threads as u128 * args.record_bytes as u128,
        )?;
    }
    anyhow::ensure!(args.every_records > 0, "--every-records must be at least 1");
    anyhow::ensure!(!args.durability.is_empty(), "--durability lists no mode");
    for name in &args.durability {
        anyhow::ensure!(
            DURABILITY_NAMES.contains(&name.as_str()),
            "unknown --durability {name:?} (group, every, none)"
        );
    }
    io_mode(&args.io)?;
    baseline_enabled(&args.baseline)?;
    check_record_fits(args.record_bytes, args.segment_mib)?;
    check_total_bytes(args.records, args.record_bytes, &format!("--records {}", args.records))
}

/// Most `fdatasync`s the group-commit figure's pwrite baseline may make (one per
/// `--max-bytes` written): at a millisecond or more each here, more would make the baseline
/// take longer than most runs, without a word.
const MAX_BASELINE_SYNCS: u64 = 100_000;

/// Refuses a `--max-bytes` so small against `--records` that the group-commit figure's pwrite
/// baseline would sync more than [`MAX_BASELINE_SYNCS`] times (checked after the free disk:
/// a run that cannot fit says so first).
fn check_baseline_syncs(args: &WalArgs) -> anyhow::Result<()> {
    if !baseline_enabled(&args.baseline)? || !args.durability.iter().any(|name| name == "group") {
        return Ok(());
    }
    let bytes = args.records.saturating_mul(frame::frame_len(args.record_bytes) as u64);
    let syncs = bytes.div_ceil(args.max_bytes as u64);
    anyhow::ensure!(
        syncs <= MAX_BASELINE_SYNCS,
        "--max-bytes {} makes the pwrite baseline sync {syncs} times (once per --max-bytes of \
         the {bytes} bytes that --records {} of --record-bytes {} write; at most \
         {MAX_BASELINE_SYNCS}): raise --max-bytes, lower --records, or pass --baseline none",
        args.max_bytes,
        args.records,
        args.record_bytes
    );
    Ok(())
}

/// A byte count as KiB when it is whole KiB, else as bytes (a baseline's label).
fn byte_size_label(bytes: usize) -> String {
    if bytes >= 1024 && bytes.is_multiple_of(1024) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// Checks what the flags' ranges cannot for `coordbus-load wal-recover`, before anything is
/// written.
fn validate_recover(args: &WalRecoverArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.records > 0, "--records must be at least 1");
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    check_record_fits(args.record_bytes, args.segment_mib)?;
    check_total_bytes(args.records, args.record_bytes, &format!("--records {}", args.records))
}

/// Whether `--baseline` asks for the pwrite baseline.
fn baseline_enabled(name: &str) -> anyhow::Result<bool> {
    Ok(match name {
        "pwrite" => true,
        "none" => false,
        other => anyhow::bail!("unknown --baseline {other:?} (pwrite, none)"),
    })
}

fn io_mode(name: &str) -> anyhow::Result<IoMode> {
    Ok(match name {
        "auto" => IoMode::Auto,
        "io_uring" | "uring" => IoMode::IoUring,
        "pwrite" => IoMode::Pwrite,
        other => anyhow::bail!("unknown --io {other:?} (auto, io_uring, pwrite)"),
    })
}

fn open(dir: &Path, args: &WalArgs, durability: Durability) -> anyhow::Result<Wal> {
    Ok(Wal::open_with_options(
        dir,
        WalConfig {
            segment_size_bytes: segment_bytes(args.segment_mib),
            durability,
            ..WalConfig::default()
        },
        WalOptions {
            io: io_mode(&args.io)?,
            sync_thread_nice: args.sync_nice,
            ..WalOptions::default()
        },
    )?)
}

/// Sequential pwrite of `total_bytes` in `batch_bytes` batches, one fdatasync per batch.
/// Returns the seconds taken.
fn pwrite_baseline(dir: &Path, total_bytes: u64, batch_bytes: usize) -> anyhow::Result<f64> {
    let path = dir.join("baseline.pwrite");
    let file = OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
    let batch = vec![0x5au8; batch_bytes];
    let started = Instant::now();
    let mut offset = 0u64;
    while offset < total_bytes {
        let len = (total_bytes - offset).min(batch_bytes as u64) as usize;
        file.write_all_at(&batch[..len], offset)?;
        file.sync_data()?;
        offset += len as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(seconds)
}

/// What a loop of pwrite + fdatasync per record does: each of `threads` threads (as many as
/// the figure it is compared with) writes one frame and syncs, `count` times, at its own
/// offsets of one fresh file (thread `t`'s `i`-th frame at place `i * threads + t`), so
/// concurrent syncs of one file can share the device flush as they would for a user.
struct FdatasyncBaseline {
    /// Each pwrite + fdatasync's latency, over every thread.
    latency: Histogram<u64>,
    /// Records made durable per second of wall time, every thread together.
    records_per_sec: f64,
}

/// Runs the [`FdatasyncBaseline`]. With `prewritten`, the file's blocks are written and synced
/// first, so each sync finds its block already allocated (the cheapest fdatasync there is: the
/// strict baseline); without, the writes extend the file.
fn fdatasync_baseline(
    dir: &Path,
    frame_bytes: usize,
    count: u64,
    threads: usize,
    prewritten: bool,
) -> anyhow::Result<FdatasyncBaseline> {
    let path = dir.join("baseline.fdatasync");
    let file = OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
    let records = count * threads as u64;
    if prewritten {
        let total = (records * frame_bytes as u64).next_multiple_of(4096);
        let zeros = vec![0u8; 1 << 20];
        let mut offset = 0;
        while offset < total {
            let len = (total - offset).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..len], offset)?;
            offset += len as u64;
        }
        file.sync_all()?;
    }
    let file = Arc::new(file);
    let places = threads as u64;
    let (latency, seconds) = time_on_threads(threads, count, |thread| {
        let (file, frame) = (Arc::clone(&file), vec![0x5au8; frame_bytes]);
        move |index| {
            file.write_all_at(&frame, (index * places + thread) * frame_bytes as u64)?;
            Ok(file.sync_data()?)
        }
    })?;
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(FdatasyncBaseline { latency, records_per_sec: records as f64 / seconds })
}

/// Runs `count` calls of the operation `worker(thread)` makes on each of `threads` threads,
/// released together; returns every call's latency and the seconds from the release until the
/// last thread ended. The operations are built before the release (their set-up is not timed).
fn time_on_threads<W, Op>(
    threads: usize,
    count: u64,
    worker: W,
) -> anyhow::Result<(Histogram<u64>, f64)>
where
    W: Fn(u64) -> Op,
    Op: FnMut(u64) -> anyhow::Result<()> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads as u64)
        .map(|thread| {
            let (barrier, mut op) = (Arc::clone(&barrier), worker(thread));
            std::thread::spawn(move || -> anyhow::Result<Histogram<u64>> {
                let mut histogram = Histogram::<u64>::new(3)?;
                barrier.wait();
                for index in 0..count {
                    let started = Instant::now();
                    op(index)?;
                    histogram.record(started.elapsed().as_nanos() as u64)?;
                }
                Ok(histogram)
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    let mut latency = Histogram::<u64>::new(3)?;
    for handle in handles {
        latency.add(&handle.join().map_err(|_| anyhow::anyhow!("a timed thread panicked"))??)?;
    }
    Ok((latency, started.elapsed().as_secs_f64()))
}

fn throughput_figure(
    args: &WalArgs,
    root: &Path,
    name: &str,
    durability: Durability,
    threads: usize,
) -> anyhow::Result<(Figure, u64)> {
    let dir = root.join(format!("{name}-{threads}"));
    let wal = Arc::new(open(&dir, args, durability)?);
    let barrier = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|thread| {
            let wal = Arc::clone(&wal);
            let barrier = Arc::clone(&barrier);
            let per_thread = share(args.records, threads, thread);
            let payload = vec![thread as u8; args.record_bytes];
            std::thread::spawn(move || -> anyhow::Result<(Lsn, Histogram<u64>)> {
                let mut histogram = Histogram::<u64>::new(3)?;
                let mut last = Lsn::ZERO;
                barrier.wait();
                for index in 0..per_thread {
                    if index % 1024 == 0 {
                        let started = Instant::now();
                        last = wal.append_bytes(&payload, index as i64)?.0;
                        histogram.record(started.elapsed().as_nanos() as u64)?;
                    } else {
                        last = wal.append_bytes(&payload, index as i64)?.0;
                    }
                }
                Ok((last, histogram))
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    let mut histogram = Histogram::<u64>::new(3)?;
    let mut last = Lsn::ZERO;
    for worker in workers {
        let (thread_last, thread_histogram) =
            worker.join().map_err(|_| anyhow::anyhow!("appender panicked"))??;
        last = last.max(thread_last);
        histogram.add(&thread_histogram)?;
    }
    wal.wait_durable(last)?;
    let seconds = started.elapsed().as_secs_f64();
    let stats = wal.stats();
    let messages = args.records;
    let frame_bytes = frame::frame_len(args.record_bytes) as u64;
    let figure = Figure::new("wal", messages, seconds)
        .with_latency(Percentiles::from_histogram(&histogram))
        .with("durability", name)
        .with("threads", threads)
        .with("record_bytes", args.record_bytes)
        .with("frame_bytes", frame_bytes)
        .with("bytes_per_sec", (messages * frame_bytes) as f64 / seconds)
        .with("io_path", wal.io_path().as_str())
        .with("sync_nice", args.sync_nice)
        .with("latency", "append call (sampled 1/1024)")
        .with("groups", stats.groups)
        .with("syncs", stats.syncs)
        .with("sync_p50_us", stats.sync_p50_us)
        .with_wal_stats("wal_stats", &stats);
    wal.close()?;
    drop(wal);
    std::fs::remove_dir_all(&dir).ok();
    Ok((figure, messages * frame_bytes))
}

fn every_record_figure(
    args: &WalArgs,
    root: &Path,
    threads: usize,
    baselines: Option<&(FdatasyncBaseline, FdatasyncBaseline)>,
) -> anyhow::Result<Figure> {
    let dir = root.join(format!("every-{threads}"));
    let wal = Arc::new(open(&dir, args, Durability::EveryRecord)?);
    let (histogram, seconds) = time_on_threads(threads, args.every_records, |thread| {
        let (wal, payload) = (Arc::clone(&wal), vec![thread as u8; args.record_bytes]);
        move |index| {
            let (lsn, _) = wal.append_bytes(&payload, index as i64)?;
            Ok(wal.wait_durable(lsn)?)
        }
    })?;
    let messages = args.every_records * threads as u64;
    let frame_bytes = frame::frame_len(args.record_bytes) as u64;
    let mut figure = Figure::new("wal", messages, seconds)
        .with_latency(Percentiles::from_histogram(&histogram))
        .with("durability", "every")
        .with("threads", threads)
        .with("record_bytes", args.record_bytes)
        .with("bytes_per_sec", (messages * frame_bytes) as f64 / seconds)
        .with("io_path", wal.io_path().as_str())
        .with("sync_nice", args.sync_nice)
        .with("latency", "append to durable")
        .with_wal_stats("wal_stats", &wal.stats());
    if let Some((baseline, appending)) = baselines {
        let baseline_p50 = baseline.latency.value_at_quantile(0.5);
        figure = figure
            .with_baseline(
                "pwrite+fdatasync per record, prewritten file, as many threads",
                baseline.records_per_sec,
            )
            .with("baseline_p50_ns", baseline_p50)
            .with("baseline_p99_ns", baseline.latency.value_at_quantile(0.99))
            .with("appending_fdatasync_p50_ns", appending.latency.value_at_quantile(0.5))
            .with(
                "latency_ratio",
                histogram.value_at_quantile(0.5) as f64 / baseline_p50.max(1) as f64,
            );
    }
    wal.close()?;
    drop(wal);
    std::fs::remove_dir_all(&dir).ok();
    Ok(figure)
}

/// Runs `coordbus-load wal`.
pub fn run(args: &WalArgs) -> anyhow::Result<Vec<Figure>> {
    validate(args)?;
    let root = temp_in(&args.dir)?;
    check_free_disk(args, root.path())?;
    check_baseline_syncs(args)?;
    let with_baseline = baseline_enabled(&args.baseline)?;
    let mut figures = Vec::new();
    for name in &args.durability {
        for &threads in &args.threads {
            // The probes bracket this figure's runs (ours and its baseline's).
            let figure = crate::machine::with_round_trips(|| {
                measure_figure(args, root.path(), name, threads, with_baseline)
            })?;
            figures.push(figure);
        }
    }
    Ok(figures)
}

/// One figure of `coordbus-load wal`: durability `name` at `threads` threads, with its
/// baseline when `with_baseline`.
fn measure_figure(
    args: &WalArgs,
    root: &Path,
    name: &str,
    threads: usize,
    with_baseline: bool,
) -> anyhow::Result<Figure> {
    let frame_bytes = frame::frame_len(args.record_bytes);
    Ok(match name {
        "group" | "none" => {
            let durability = if name == "group" {
                Durability::GroupCommit {
                    max_delay: Duration::from_micros(args.max_delay_us),
                    max_bytes: args.max_bytes,
                }
            } else {
                Durability::None
            };
            let (figure, bytes) = throughput_figure(args, root, name, durability, threads)?;
            if with_baseline && name == "group" {
                let seconds =
                    pwrite_baseline(root, bytes, args.max_bytes).context("pwrite baseline")?;
                let records = bytes / frame_bytes as u64;
                figure
                    .with_baseline(
                        format!("pwrite+fdatasync/{}", byte_size_label(args.max_bytes)),
                        records as f64 / seconds,
                    )
                    .with("baseline_bytes_per_sec", bytes as f64 / seconds)
            } else {
                figure
            }
        }
        "every" => {
            let baselines = if with_baseline {
                let count = args.every_records;
                Some((
                    fdatasync_baseline(root, frame_bytes, count, threads, true)?,
                    fdatasync_baseline(root, frame_bytes, count, threads, false)?,
                ))
            } else {
                None
            };
            every_record_figure(args, root, threads, baselines.as_ref())?
        }
        other => anyhow::bail!("unknown durability {other:?} (group, every, none)"),
    })
}

/// Refuses a `wal` run whose largest log does not fit in the free space under `root`. The
/// figures run one after the other, each log removed before the next (and before its pwrite
/// baseline writes as many bytes again).
fn check_free_disk(args: &WalArgs, root: &Path) -> anyhow::Result<()> {
    let max_threads = args.threads.iter().copied().max().unwrap_or(1) as u128;
    let every_records = if args.durability.iter().any(|name| name == "every") {
        u128::from(args.every_records) * max_threads
    } else {
        0
    };
    crate::limits::check_free_disk(
        root,
        &format!(
            "--records {} (or --every-records {} x --threads {max_threads}) of --record-bytes {} \
             in --segment-mib {} segments",
            args.records, args.every_records, args.record_bytes, args.segment_mib
        ),
        crate::limits::log_disk_bytes(
            u128::from(args.records).max(every_records),
            frame::frame_len(args.record_bytes) as u128,
            segment_bytes(args.segment_mib),
        ),
        " (--dir)",
    )
}

/// Runs `coordbus-load wal-recover`.
pub fn run_recover(args: &WalRecoverArgs) -> anyhow::Result<Vec<Figure>> {
    validate_recover(args)?;
    let root = temp_in(&args.dir)?;
    crate::limits::check_free_disk(
        root.path(),
        &format!(
            "--records {} of --record-bytes {} in --segment-mib {} segments",
            args.records, args.record_bytes, args.segment_mib
        ),
        crate::limits::log_disk_bytes(
            u128::from(args.records),
            frame::frame_len(args.record_bytes) as u128,
            segment_bytes(args.segment_mib),
        ),
        " (--dir)",
    )?;
    let dir = root.path().join("log");
    let config = WalConfig {
        segment_size_bytes: segment_bytes(args.segment_mib),
        durability: Durability::GroupCommit {
            max_delay: Duration::from_millis(1),
            max_bytes: 4 << 20,
        },
        ..WalConfig::default()
    };
    {
        let wal = Wal::open(&dir, config.clone())?;
        let payload = vec![0xa5u8; args.record_bytes];
        for index in 0..args.records {
            wal.append_bytes(&payload, index as i64)?;
        }
        wal.close()?;
    }
    // The probes bracket the timed opens and scans, not the writing of the log before them.
    let ((mut open_seconds, mut iter_seconds, bytes), round_trips) =
        crate::machine::bracket(|| time_recoveries(args, &dir, &config))?;
    open_seconds.sort_by(f64::total_cmp);
    iter_seconds.sort_by(f64::total_cmp);
    let median = |values: &[f64]| values[values.len() / 2];
    let open_median = median(&open_seconds);
    let iter_median = median(&iter_seconds);
    // One bracket for both phases, which alternate per repeat (module `machine`).
    let phase = |name: &str, median: f64, best: f64| {
        Figure::new("wal-recover", args.records, median)
            .with("phase", name)
            .with("bytes_per_sec", bytes as f64 / median)
            .with("best_seconds", best)
            .with("record_bytes", args.record_bytes)
            .with("bytes", bytes)
            .with(crate::machine::ROUND_TRIPS_KEY, round_trips.clone())
    };
    Ok(vec![
        phase("open (scan + CRC)", open_median, open_seconds[0]),
        phase("iterate all (CRC again)", iter_median, iter_seconds[0]),
    ])
}

/// The timed part of `wal-recover`: `--repeats` opens of the log in `dir`, each followed by a
/// full iteration; their times in seconds (opens, iterations) and the bytes scanned.
fn time_recoveries(
    args: &WalRecoverArgs,
    dir: &Path,
    config: &WalConfig,
) -> anyhow::Result<(Vec<f64>, Vec<f64>, u64)> {
    let mut open_seconds = Vec::new();
    let mut iter_seconds = Vec::new();
    let mut bytes = 0;
    for _ in 0..args.repeats.max(1) {
        let started = Instant::now();
        let wal = Wal::open(dir, config.clone())?;
        open_seconds.push(started.elapsed().as_secs_f64());
        anyhow::ensure!(wal.recovery_report().records == args.records, "lost records");
        bytes = wal.recovery_report().bytes;
        let started = Instant::now();
        let mut count = 0u64;
        let mut checksum = 0u64;
        for record in wal.iter_from(Lsn::ZERO)? {
            let record = record?;
            checksum = checksum.wrapping_add(record.bytes.first().map_or(0, |&b| u64::from(b)));
            count += 1;
        }
        iter_seconds.push(started.elapsed().as_secs_f64());
        anyhow::ensure!(
            count == args.records && checksum > 0,
            "iteration lost records: {count} of {} read back",
            args.records
        );
        // Keep the segments: a reopen must not find anything new to write.
        drop(wal);
    }
    Ok((open_seconds, iter_seconds, bytes))
}
