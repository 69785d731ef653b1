//! Workloads `blocks/add`, `blocks/allocate`, `blocks/recover`: the received-block tracker
//! with its WAL.
//!
//! * `blocks/add`: R receiver threads each keep `--in-flight` additions outstanding against
//!   the tracker endpoint (blocks spread over `--streams` streams), through a `BlockReceiver`
//!   (receiver-side logging: the receiver thread appends the record and hands the logged
//!   block to the endpoint) or, with `--asks`, through `AddBlock`/`AddBlocks` asks (the
//!   endpoint thread logs). An addition counts once its record is durable (synced, group
//!   commit). Run with 1 receiver, with `--receivers`, and with `--receivers` and `--batch`
//!   blocks per record (or per ask), that run keeping `--batch-in-flight` blocks outstanding
//!   per receiver. Latency is per addition (add to durable answer; through a
//!   `BlockReceiver`, sampled on one call in 16: the clock costs ~40 ns a read here, as much
//!   as a combined addition). `bytes_per_event` is
//!   framed WAL bytes per addition; `records` counts the WAL records.
//! * `blocks/recover`: `--recover-events` additions are logged, the tracker is stopped, and a
//!   new tracker is built with recovery on: `seconds` is the construction time, `messages` the
//!   events replayed.
//! * `blocks/allocate`: on the recovered tracker, one durable allocation of all those blocks
//!   to a batch (`messages` = blocks allocated).
//!
//! Every figure carries `bytes_per_event` (framed bytes in the WAL per event); `blocks/add` and
//! `blocks/recover` also carry the Spark 4.3 figures of ANCHORS.md as extra keys (`spark_*`),
//! measured on the same machine class but not in this run, and never synced by Spark.
//!
//! The logs go to a fresh temporary directory (inside `--dir` if given), removed at the end:
//! a run never replays what an earlier run logged.

use std::{
    collections::VecDeque,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Barrier,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use clap::builder::RangedU64ValueParser;
use coordbus::{
    clock::{Clock, SystemClock},
    coordinators::block_tracker::{
        AddBlock, AddBlocks, AddReceipt, AllocateBlocksToBatch, BatchTime, BlockReceiver,
        BlockStoreResult, BlockTrackerConfig, BlockTrackerEndpoint, CleanupOldBatches, Logged,
        ReceivedBlockInfo, ReceivedBlockTracker, StopTracker, StreamBlockId, StreamId,
        RECEIVED_BLOCK_METADATA_DIR,
    },
    wal::{Durability, Wal, WalConfig, WalOptions},
    Bus,
};
use hdrhistogram::Histogram;

use crate::{
    limits::{
        segment_bytes, MAX_BATCH, MAX_GROUP_BYTES, MAX_GROUP_DELAY_US, MAX_IN_FLIGHT, MAX_THREADS,
        SEGMENT_MIB,
    },
    report::{Figure, Percentiles},
    shares::{share, start_of_share},
};

/// Most input streams (`--streams`): stream ids are `i32` (the tracker's `StreamId`), and
/// every allocation record lists every configured stream, so the batch loop's records grow
/// with the count; 65536 is far above any Spark job's receivers.
const MAX_STREAMS: u32 = 1 << 16;
/// Longest batch interval (`--batch-interval-ms`): one minute.
const MAX_BATCH_INTERVAL_MS: u64 = 60_000;
/// Most logged additions of `blocks/recover` (`--recover-events`, 2^23): the allocation of
/// every block is one record of about 100 bytes per block, and a record holds at most
/// `MAX_PAYLOAD_LEN` (1 GiB) bytes; the run sizes its recovery segments at 128 bytes per event
/// (1 GiB here), preallocated.
const MAX_RECOVER_EVENTS: u64 = coordbus::record::frame::MAX_PAYLOAD_LEN as u64 / 128;

/// Spark 4.3, `ReceivedBlockTracker.addBlock` with the driver WAL, batching on (ANCHORS.md).
const SPARK_ADD_1_THREAD: f64 = 20_000.0;
/// The same with 2 threads.
const SPARK_ADD_2_THREADS: f64 = 46_000.0;
/// Spark's recovery of 1 M logged additions, seconds (ANCHORS.md).
const SPARK_RECOVER_1M_SECONDS: f64 = 13.0;
/// Spark's WAL bytes per block-addition event (ANCHORS.md: ~930-980).
const SPARK_BYTES_PER_EVENT: f64 = 955.0;

/// Flags of `coordbus-load blocks`.
#[derive(clap::Args, Debug, Clone)]
pub struct BlocksArgs {
    /// Input streams the blocks are spread over (1 ..= 65536).
    #[arg(
        long,
        default_value_t = 2,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_STREAMS))
    )]
    pub streams: u32,
    /// Receiver threads of the second `blocks/add` run (the first uses 1; 1 ..= 1024).
    #[arg(
        long,
        default_value_t = 2,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_THREADS)
    )]
    pub receivers: usize,
    /// Additions per `blocks/add` run (over all receivers; at least `--receivers`, every
    /// receiver adds at least one block).
    #[arg(long, default_value_t = 2_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub blocks: u64,
    /// Blocks per `AddBlocks` ask in the extra `blocks/add` run with `--receivers` (1: no
    /// extra run; at most 1048576).
    #[arg(
        long,
        default_value_t = 64,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH)
    )]
    pub batch: usize,
    /// Add through `AddBlock`/`AddBlocks` asks (the endpoint logs) instead of a
    /// `BlockReceiver` (the receiver logs).
    #[arg(long)]
    pub asks: bool,
    /// Of the `blocks/add` runs, only the one with `--receivers` and `--batch` (profiling).
    #[arg(long)]
    pub batch_only: bool,
    /// Blocks (single-block additions) each receiver keeps outstanding (1 ..= 1048576).
    #[arg(
        long,
        default_value_t = 4096,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_IN_FLIGHT)
    )]
    pub in_flight: usize,
    /// Blocks each receiver keeps outstanding in the `--batch` run (a receiver that batches
    /// its blocks into records keeps more of them in flight). An addition waits for the sync
    /// in progress and then its own (2 to 8 ms here), so the window bounds the rate at about
    /// window / latency per receiver (Little's law). 1 ..= 1048576.
    #[arg(
        long,
        default_value_t = 32_768,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_IN_FLIGHT)
    )]
    pub batch_in_flight: usize,
    /// Batch interval of the driver loop that allocates and cleans up batches while the
    /// receivers add (0: no loop, the blocks pile up unallocated; at most 60000). The loop
    /// ends as soon as the additions are done, whatever the interval.
    #[arg(
        long,
        default_value_t = 20,
        value_parser = clap::value_parser!(u64).range(0..=MAX_BATCH_INTERVAL_MS)
    )]
    pub batch_interval_ms: u64,
    /// Logged additions for `blocks/recover` and `blocks/allocate` (1 ..= 2^23, so that the
    /// allocation of them all fits one WAL record).
    #[arg(
        long,
        default_value_t = 1_000_000,
        value_parser = clap::value_parser!(u64).range(1..=MAX_RECOVER_EVENTS)
    )]
    pub recover_events: u64,
    /// Group commit: longest a record waits for its group, microseconds (at most 60 s).
    #[arg(
        long,
        default_value_t = 200,
        value_parser = clap::value_parser!(u64).range(0..=MAX_GROUP_DELAY_US)
    )]
    pub max_delay_us: u64,
    /// Group commit: group size that starts the write at once, bytes (1 ..= 1 GiB).
    #[arg(
        long,
        default_value_t = 1 << 20,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_GROUP_BYTES)
    )]
    pub max_group_bytes: usize,
    /// Size of each WAL segment file, MiB (the tracker's default is 64; 1 ..= 1048576, i.e.
    /// at most 1 TiB, the WAL's largest).
    #[arg(
        long,
        default_value_t = 64,
        value_parser = clap::value_parser!(u64).range(SEGMENT_MIB)
    )]
    pub segment_mib: u64,
    /// How much lower the WAL's sync thread's CPU priority is (added to its nice value, capped
    /// at 19; 0 leaves it; at most 39). Its io_uring workers inherit it.
    #[arg(
        long,
        default_value_t = coordbus::wal::DEFAULT_SYNC_THREAD_NICE,
        value_parser = clap::value_parser!(u8)
            .range(0..=i64::from(coordbus::wal::MAX_SYNC_THREAD_NICE))
    )]
    pub sync_nice: u8,
    /// Directory for the logs: a fresh temporary directory is made inside it (default: inside
    /// the system temp dir) and removed at the end, so a run never replays an earlier run's
    /// log.
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
}

/// The quick version for the no-argument run.
pub fn quick() -> BlocksArgs {
    BlocksArgs {
        streams: 2,
        receivers: 2,
        blocks: 500_000,
        in_flight: 4096,
        batch_in_flight: 32_768,
        batch: 64,
        asks: false,
        batch_only: false,
        batch_interval_ms: 20,
        recover_events: 1_000_000,
        max_delay_us: 200,
        max_group_bytes: 1 << 20,
        segment_mib: 64,
        sync_nice: coordbus::wal::DEFAULT_SYNC_THREAD_NICE,
        dir: None,
    }
}

fn block(stream: StreamId, unique_id: u64) -> ReceivedBlockInfo {
    let block_id = StreamBlockId { stream, unique_id };
    ReceivedBlockInfo::new(stream, Some(100), None, BlockStoreResult::BlockManager { block_id })
        .expect("non-negative record count")
}

fn wal_config(args: &BlocksArgs) -> WalConfig {
    WalConfig {
        durability: Durability::GroupCommit {
            max_delay: Duration::from_micros(args.max_delay_us),
            max_bytes: args.max_group_bytes,
        },
        segment_size_bytes: segment_bytes(args.segment_mib),
        ..BlockTrackerConfig::driver_wal_config()
    }
}

/// The tracker's settings for a log in `dir`.
fn tracker_config(args: &BlocksArgs, dir: &std::path::Path) -> BlockTrackerConfig {
    BlockTrackerConfig::new(streams(args))
        .checkpoint_dir(dir)
        .wal_config(wal_config(args))
        .wal_options(WalOptions { sync_thread_nice: args.sync_nice, ..WalOptions::default() })
}

/// The stream ids `0..--streams` (`validate` keeps `--streams` within [`MAX_STREAMS`], so
/// every id fits the tracker's `i32`).
fn streams(args: &BlocksArgs) -> Vec<StreamId> {
    (0..args.streams).map(|id| StreamId(id as i32)).collect()
}

/// Checks the flags before anything runs (the clap ranges check each flag alone; this checks
/// them together, and the values of a run built in code).
fn validate(args: &BlocksArgs) -> anyhow::Result<()> {
    if !(1..=MAX_STREAMS).contains(&args.streams) {
        bail!("--streams {} is out of range (1 ..= {MAX_STREAMS})", args.streams);
    }
    if args.receivers == 0 || args.in_flight == 0 || args.batch_in_flight == 0 || args.batch == 0 {
        bail!("--receivers, --in-flight, --batch-in-flight and --batch must be at least 1");
    }
    // Each receiver keeps a window of blocks in flight: `--in-flight` single additions, or
    // `--batch-in-flight` blocks in records of `--batch` (at least one whole record).
    let block = std::mem::size_of::<ReceivedBlockInfo>() as u128;
    let window = args.in_flight.max(args.batch_in_flight).max(args.batch);
    crate::limits::check_planned_bytes(
        &format!(
            "--receivers {} x the largest of --in-flight {}, --batch-in-flight {} and --batch {}",
            args.receivers, args.in_flight, args.batch_in_flight, args.batch
        ),
        args.receivers as u128 * window as u128 * block,
    )?;
    if args.batch_only && args.batch == 1 {
        bail!(
            "--batch-only with --batch 1: there is no batched run \
             (--batch 1 is the single-block run)"
        );
    }
    if args.blocks < args.receivers as u64 {
        bail!(
            "--blocks {} is less than --receivers {}: every receiver adds at least one block",
            args.blocks,
            args.receivers
        );
    }
    if !(1..=MAX_RECOVER_EVENTS).contains(&args.recover_events) {
        bail!(
            "--recover-events {} is out of range (1 ..= {MAX_RECOVER_EVENTS})",
            args.recover_events
        );
    }
    if args.batch_interval_ms > MAX_BATCH_INTERVAL_MS {
        bail!(
            "--batch-interval-ms {} is more than {MAX_BATCH_INTERVAL_MS}",
            args.batch_interval_ms
        );
    }
    Ok(())
}

/// Runs every `blocks/*` workload.
pub fn run(args: &BlocksArgs) -> anyhow::Result<Vec<Figure>> {
    validate(args)?;
    let temp = crate::wal::temp_in(&args.dir)?;
    let root = temp.path();
    let mut figures = Vec::new();
    let mut receiver_counts = vec![1, args.receivers];
    receiver_counts.dedup();
    let mut runs: Vec<(usize, usize)> = if args.batch_only {
        Vec::new()
    } else {
        receiver_counts.into_iter().map(|r| (r, 1)).collect()
    };
    if args.batch > 1 {
        runs.push((args.receivers, args.batch));
    }
    check_free_disk(args, runs.len(), root)?;
    for (index, (receivers, batch)) in runs.into_iter().enumerate() {
        let dir = root.join(format!("add-{index}"));
        // The probes bracket each figure's own run.
        figures.push(crate::machine::with_round_trips(|| run_add(args, receivers, batch, &dir))?);
    }
    figures.extend(run_recover_and_allocate(args, &root.join("recover"))?);
    Ok(figures)
}

/// Most WAL bytes a logged block event takes (a single block's addition record, the largest
/// per event; batched additions take 4-6).
const MAX_BYTES_PER_EVENT: u128 = 64;

/// Recovery segments hold the allocation of every block in one record: 128 bytes per event,
/// in MiB steps (`run_recover_and_allocate`).
fn recover_segment_bytes(args: &BlocksArgs) -> u64 {
    let allocation_bytes_max = (args.recover_events * 128 + (1 << 20)).next_multiple_of(1 << 20);
    segment_bytes(args.segment_mib).max(allocation_bytes_max)
}

/// Refuses a run whose logs do not fit in the free space under `root`: `add_runs` logs of
/// `--blocks` additions and the recovery log (its additions, then their allocation: one record
/// in one larger segment), all kept until the run ends.
fn check_free_disk(args: &BlocksArgs, add_runs: usize, root: &Path) -> anyhow::Result<()> {
    let segment = segment_bytes(args.segment_mib);
    let events_log = |events: u64| {
        crate::limits::log_disk_bytes(u128::from(events), MAX_BYTES_PER_EVENT, segment)
    };
    let allocation_segment = u128::from(recover_segment_bytes(args));
    crate::limits::check_free_disk(
        root,
        &format!(
            "--blocks {} ({add_runs} runs) and --recover-events {} in --segment-mib {} segments",
            args.blocks, args.recover_events, args.segment_mib
        ),
        events_log(args.blocks) * add_runs as u128
            + events_log(args.recover_events)
            + allocation_segment,
        " (--dir)",
    )
}

fn run_add(
    args: &BlocksArgs,
    receivers: usize,
    batch: usize,
    dir: &std::path::Path,
) -> anyhow::Result<Figure> {
    let streams = streams(args);
    let config = tracker_config(args, dir);
    let tracker = ReceivedBlockTracker::open(config, Arc::new(SystemClock))?;
    let wal = Arc::clone(tracker.wal().context("the WAL is enabled")?);
    let bus = Bus::builder().inbox_shards(receivers.max(2)).inbox_capacity(1 << 16).build()?;
    let endpoint = bus.register("ReceivedBlockTracker", BlockTrackerEndpoint::new(tracker))?;
    let barrier = Arc::new(Barrier::new(receivers + 1));
    let mut threads = Vec::new();
    for receiver in 0..receivers {
        let (endpoint, barrier, streams) = (endpoint.clone(), barrier.clone(), streams.clone());
        // A window of blocks in flight, whatever the batch size.
        let window = if batch == 1 { args.in_flight } else { args.batch_in_flight };
        let in_flight = (window / batch).max(1);
        let asks = args.asks;
        let per_receiver = share(args.blocks, receivers, receiver);
        let base = start_of_share(args.blocks, receivers, receiver);
        threads.push(std::thread::spawn(move || -> anyhow::Result<Histogram<u64>> {
            let mut histogram = Histogram::<u64>::new(3)?;
            // Single additions rotate over the streams block by block; a batch holds blocks of
            // one stream (a receiver serves one stream, as in Spark) and batches rotate.
            let make = |seq: u64| {
                let turn = if batch == 1 { seq } else { seq / batch as u64 };
                block(streams[(turn % streams.len() as u64) as usize], base + seq)
            };
            if !asks {
                // Past the barrier before a failure returns, so the others do not wait for it.
                let handle = BlockReceiver::connect(&endpoint);
                barrier.wait();
                let handle = handle?;
                add_through_receiver(
                    &handle,
                    per_receiver,
                    batch,
                    in_flight,
                    make,
                    &mut histogram,
                )?;
                return Ok(histogram);
            }
            let mut outstanding = VecDeque::with_capacity(in_flight);
            barrier.wait();
            let mut seq = 0;
            while seq < per_receiver {
                if outstanding.len() == in_flight {
                    wait_one(&mut outstanding, &mut histogram)?;
                }
                let end = (seq + batch as u64).min(per_receiver);
                let reply = if batch == 1 {
                    Outstanding::One(endpoint.ask(AddBlock(make(seq))))
                } else {
                    Outstanding::Many(endpoint.ask(AddBlocks((seq..end).map(make).collect())))
                };
                outstanding.push_back((Instant::now(), reply));
                seq = end;
            }
            while !outstanding.is_empty() {
                wait_one(&mut outstanding, &mut histogram)?;
            }
            Ok(histogram)
        }));
    }
    let done = Arc::new(AtomicBool::new(false));
    let driver = (args.batch_interval_ms > 0).then(|| {
        let (endpoint, done) = (endpoint.clone(), Arc::clone(&done));
        let interval = Duration::from_millis(args.batch_interval_ms);
        std::thread::spawn(move || batch_loop(&endpoint, &done, interval))
    });
    barrier.wait();
    let started = Instant::now();
    let added = join_receivers(threads);
    let seconds = started.elapsed().as_secs_f64();
    // Stopped whether the receivers succeeded or not, so it never outlives the run.
    let batches = stop_batch_loop(driver, &done);
    let histogram = added?;
    let batches = batches?;
    let stats = wal.stats();
    let endpoint_stats = endpoint.stats();
    endpoint.ask(StopTracker).wait()?;
    bus.shutdown()?;
    let additions = args.blocks;
    let spark = if receivers == 1 { SPARK_ADD_1_THREAD } else { SPARK_ADD_2_THREADS };
    let rate = additions as f64 / seconds;
    Ok(Figure::new("blocks/add", additions, seconds)
        .with_latency(Percentiles::from_histogram(&histogram))
        .with("receivers", receivers)
        .with("streams", streams.len())
        .with("sync_nice", args.sync_nice)
        .with("in_flight", if batch == 1 { args.in_flight } else { args.batch_in_flight })
        .with("blocks_per_ask", batch)
        .with(
            "latency",
            if args.asks { "add to durable answer" } else { "add to durable answer, 1 call in 16" },
        )
        .with("batch_interval_ms", args.batch_interval_ms)
        .with("batches_allocated", batches)
        .with("add_path", if args.asks { "AddBlock asks" } else { "BlockReceiver" })
        .with("durable", "synced (group commit)")
        .with("syncs", stats.syncs)
        .with("additions_per_sync", additions as f64 / stats.syncs.max(1) as f64)
        .with("bytes_per_event", stats.bytes as f64 / additions.max(1) as f64)
        .with("records", stats.appends)
        .with("io_path", stats.io_path.map_or("?", |path| path.as_str()))
        .with("spark_msgs_per_sec", spark)
        .with("spark_durable", "never synced")
        .with("ratio_vs_spark", rate / spark)
        .with_endpoint_stats("endpoint_stats", &endpoint_stats)
        .with_wal_stats("wal_stats", &stats))
}

/// Waits for every receiver thread and merges their latencies.
fn join_receivers(
    threads: Vec<JoinHandle<anyhow::Result<Histogram<u64>>>>,
) -> anyhow::Result<Histogram<u64>> {
    let mut histogram = Histogram::<u64>::new(3)?;
    for thread in threads {
        let partial = thread.join().map_err(|_| anyhow::anyhow!("receiver panicked"))??;
        histogram.add(partial)?;
    }
    Ok(histogram)
}

/// Tells the batch loop (if any) that the additions are done, wakes it from its interval
/// wait, and returns the batches it allocated.
fn stop_batch_loop(
    driver: Option<JoinHandle<anyhow::Result<u64>>>,
    done: &AtomicBool,
) -> anyhow::Result<u64> {
    done.store(true, Ordering::Release);
    match driver {
        Some(driver) => {
            driver.thread().unpark();
            driver.join().map_err(|_| anyhow::anyhow!("batch loop panicked"))?
        }
        None => Ok(0),
    }
}

/// Waits `interval`, or less if `done` is set meanwhile (its setter unparks this thread;
/// early or spurious wake-ups only re-check). Returns false once `done` is set.
fn wait_interval_unless_done(done: &AtomicBool, interval: Duration) -> bool {
    let deadline = Instant::now() + interval;
    loop {
        if done.load(Ordering::Acquire) {
            return false;
        }
        let now = Instant::now();
        if now >= deadline {
            return true;
        }
        std::thread::park_timeout(deadline - now);
    }
}

/// The driver's batch loop while receivers add: every `interval` allocates the unallocated
/// blocks to a batch, then forgets the batches before it (processed at once), as Spark's job
/// generator does; so the tracker's memory stays bounded and is reused. Ends as soon as `done`
/// is set, even in the middle of an interval. Returns the batches.
fn batch_loop(
    endpoint: &coordbus::EndpointRef<BlockTrackerEndpoint>,
    done: &AtomicBool,
    interval: Duration,
) -> anyhow::Result<u64> {
    let clock = SystemClock;
    let mut last = 0;
    let mut batches = 0;
    while wait_interval_unless_done(done, interval) {
        let time = clock.now_ms().max(last + 1);
        endpoint.ask(AllocateBlocksToBatch(BatchTime(time))).wait()?;
        batches += 1;
        last = time;
        let threshold = time.min(clock.now_ms() - 1);
        endpoint.ask(CleanupOldBatches { threshold: BatchTime(threshold), wait: false }).wait()?;
    }
    Ok(batches)
}

/// Adds `count` blocks through a receiver handle, `batch` per record, `in_flight` records
/// outstanding; records each addition's latency (add to durable).
fn add_through_receiver(
    receiver: &BlockReceiver,
    count: u64,
    batch: usize,
    in_flight: usize,
    make: impl Fn(u64) -> ReceivedBlockInfo,
    histogram: &mut Histogram<u64>,
) -> anyhow::Result<()> {
    let mut outstanding = VecDeque::with_capacity(in_flight);
    let mut seq = 0;
    let mut calls = 0u64;
    while seq < count {
        if outstanding.len() == in_flight {
            finish_oldest(&mut outstanding, histogram)?;
        }
        let end = (seq + batch as u64).min(count);
        // Two clock reads per call cost about as much as a combined addition itself here.
        let sent = calls.is_multiple_of(LATENCY_SAMPLE_EVERY).then(Instant::now);
        calls += 1;
        let receipt = if batch == 1 {
            receiver.add_block(make(seq))
        } else {
            receiver.add_blocks((seq..end).map(&make).collect())
        };
        outstanding.push_back((sent, receipt));
        seq = end;
    }
    while !outstanding.is_empty() {
        finish_oldest(&mut outstanding, histogram)?;
    }
    Ok(())
}

/// Why a run stops when an addition is refused.
const ADDITION_REFUSED: &str = "an addition was refused: the log failed, stayed full for the \
    append timeout, or one --batch of blocks makes a record larger than a --segment-mib \
    segment holds (the WAL's reason is in the log output)";

/// `BlockReceiver` calls whose latency is measured: one in this many.
const LATENCY_SAMPLE_EVERY: u64 = 16;

/// Waits for the oldest receipt; if its latency was sampled, records it once per block it
/// carried.
fn finish_oldest(
    outstanding: &mut VecDeque<(Option<Instant>, AddReceipt<'_>)>,
    histogram: &mut Histogram<u64>,
) -> anyhow::Result<()> {
    let (sent, receipt) = outstanding.pop_front().expect("not empty");
    let blocks = receipt.block_count() as u64;
    if !receipt.wait() {
        bail!(ADDITION_REFUSED);
    }
    if let Some(sent) = sent {
        histogram.record_n(sent.elapsed().as_nanos() as u64, blocks)?;
    }
    Ok(())
}

/// An ask in flight.
enum Outstanding {
    One(coordbus::Reply<bool>),
    Many(coordbus::Reply<Vec<bool>>),
}

/// Waits for the oldest ask; records its latency once per block it carried.
fn wait_one(
    outstanding: &mut VecDeque<(Instant, Outstanding)>,
    histogram: &mut Histogram<u64>,
) -> anyhow::Result<()> {
    let (sent, reply) = outstanding.pop_front().expect("not empty");
    let (logged, blocks) = match reply {
        Outstanding::One(reply) => (reply.wait()?, 1),
        Outstanding::Many(reply) => {
            let results = reply.wait()?;
            (results.iter().all(|logged| *logged), results.len() as u64)
        }
    };
    if !logged {
        bail!(ADDITION_REFUSED);
    }
    histogram.record_n(sent.elapsed().as_nanos() as u64, blocks)?;
    Ok(())
}

fn run_recover_and_allocate(
    args: &BlocksArgs,
    dir: &std::path::Path,
) -> anyhow::Result<Vec<Figure>> {
    let streams = streams(args);
    let config = tracker_config(args, dir);
    let clock = Arc::new(SystemClock);

    // Log the additions (appended without waiting, then made durable once).
    let mut writer = ReceivedBlockTracker::open(config.clone(), clock.clone())?;
    let mut last = None;
    for seq in 0..args.recover_events {
        let stream = streams[(seq % streams.len() as u64) as usize];
        match writer.add_block_deferred(block(stream, seq)) {
            Logged::Pending(lsn) => last = Some(lsn),
            other => bail!(
                "addition {seq} refused (the log failed, or stayed full for the append timeout): \
                 {other:?}"
            ),
        }
    }
    if let (Some(lsn), Some(log)) = (last, writer.log()) {
        log.wait_durable(lsn, Duration::from_secs(60))?;
    }
    let stats = writer.wal().context("the WAL is enabled")?.stats();
    let bytes_per_event = stats.bytes as f64 / stats.appends.max(1) as f64;
    writer.stop()?;
    drop(writer);

    // The tracker's recovery as a restarted driver meets it (the files just written, in the
    // page cache), then the WAL's own opening scan alone, a second time. The allocation of
    // every block is one record, so new segments must hold it (about 100 bytes per block).
    let mut recover_config = config.recover(true);
    recover_config.wal.segment_size_bytes =
        recover_config.wal.segment_size_bytes.max(recover_segment_bytes(args));
    // The probes bracket the timed recovery and allocation, not the logging before them.
    let round_trips_before = crate::machine::core_round_trip_ns();
    let started = Instant::now();
    let mut tracker = ReceivedBlockTracker::open(recover_config, clock)?;
    let recover_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let wal_dir = dir.join(RECEIVED_BLOCK_METADATA_DIR);
    let options = WalOptions { read_only: true, ..WalOptions::default() };
    Wal::open_with_options(&wal_dir, wal_config(args), options)?.close()?;
    let wal_open_seconds = started.elapsed().as_secs_f64();
    let recovered = tracker.recovered_events();
    if recovered != args.recover_events {
        bail!("recovered {recovered} events, logged {}", args.recover_events);
    }

    let started = Instant::now();
    tracker.allocate_blocks_to_batch(BatchTime(1))?;
    let allocate_seconds = started.elapsed().as_secs_f64();
    let allocated = tracker.blocks_of_batch(BatchTime(1)).block_count() as u64;
    if allocated != args.recover_events {
        bail!("allocated {allocated} blocks, expected {}", args.recover_events);
    }
    let allocation_bytes = tracker.wal().map_or(0, |wal| wal.stats().bytes);
    tracker.stop()?;
    let round_trips =
        crate::machine::round_trips_json(round_trips_before, crate::machine::core_round_trip_ns());

    Ok(vec![
        Figure::new("blocks/recover", recovered, recover_seconds)
            .with("streams", streams.len())
            .with("segment_mib", args.segment_mib)
            .with("sync_nice", args.sync_nice)
            .with("bytes_per_event", bytes_per_event)
            .with("wal_scan_again_seconds", wal_open_seconds)
            .with("spark_seconds", SPARK_RECOVER_1M_SECONDS * recovered as f64 / 1e6)
            .with("spark_bytes_per_event", SPARK_BYTES_PER_EVENT)
            .with(
                "speedup_vs_spark",
                SPARK_RECOVER_1M_SECONDS * recovered as f64 / 1e6 / recover_seconds,
            )
            .with(crate::machine::ROUND_TRIPS_KEY, round_trips.clone()),
        Figure::new("blocks/allocate", allocated, allocate_seconds)
            .with("streams", streams.len())
            .with("sync_nice", args.sync_nice)
            .with("durable", "synced")
            .with("allocation_event_bytes", allocation_bytes)
            .with("bytes_per_event", allocation_bytes as f64 / allocated.max(1) as f64)
            .with(crate::machine::ROUND_TRIPS_KEY, round_trips),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory check counts the blocks a run keeps in flight: a window per receiver, not a
    /// window of whole batches. (It once multiplied `--batch-in-flight` by `--batch`, refusing
    /// runs of a few MB, and left out `--in-flight`.)
    #[test]
    fn the_memory_check_counts_the_blocks_in_flight() {
        let batches = BlocksArgs { receivers: 2, batch: 1024, batch_in_flight: 131_072, ..quick() };
        validate(&batches).unwrap();
        let singles = BlocksArgs { receivers: 1024, in_flight: 1 << 20, ..quick() };
        let refused = validate(&singles).unwrap_err().to_string();
        assert!(refused.contains("--in-flight 1048576"), "{refused}");
    }
}
