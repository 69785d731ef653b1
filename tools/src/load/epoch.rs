//! Workload `epoch`: the epoch coordinator endpoint under a continuous-processing load.
//!
//! `--producers N` threads play the executors: each owns a contiguous range of the
//! `--partitions P` reader and writer partitions and, for every epoch, sends one
//! `ReportPartitionOffset` and one `CommitPartitionEpoch` per partition with `send_iter` (each
//! message made as the inbox takes it, straight into its slot). A
//! driver thread plays the epoch update thread: it asks `IncrementAndGetEpoch` whenever the
//! producers need the next epoch. As in Spark, tasks only start an epoch the driver announced,
//! and (flow control of this tool) they stay at most `--window` epochs ahead of the last
//! committed one. A thread held back by the window resumes only when half of it is free, and
//! a commit wakes parked threads only when it reaches an epoch one of them waits for: each
//! wake-up is a futex call on the endpoint thread, which runs the commits. The query
//! collaborator timestamps every commit. The commit latency of an epoch (`p50_ns`..) is from
//! the clock read just before the `send_iter` call whose batch carries the epoch's last message
//! (of the producer that sent its part last) to the query's commit of the epoch: it includes
//! making that batch's messages (made inside the call, as the inbox takes them) and any wait
//! for inbox room, not only the time in the inbox and the coordinator. In a backlogged run it
//! is mostly set by this tool's flow control, not by the coordinator: the producers keep between
//! half the window and the whole window (`--window`; by default about 64 Ki messages, which is
//! 32768 epochs at 1 partition and 32 at 1000) queued ahead of the coordinator, and an epoch's
//! last batch waits behind what is queued before it: about the queued messages over the rate,
//! milliseconds at 1 partition. A smaller `--window` lowers the latency (and, once the
//! coordinator runs out of queued work, the rate).
//!
//! `--offsets steady` (the default) reports `epoch << 20 | partition`: every partition advances
//! by 2^20 an epoch, which a durable run's log stores in no bytes per offset (second-order
//! deltas; only each chain's keyframe and first delta, one epoch in 64 each, hold the
//! offsets); `--offsets varied` gives each partition a seeded rate of its own and a jitter that
//! changes every epoch (`--seed`), about 3 bytes an offset in every delta (module `offsets`).
//! The JSON keys `offsets` (and `seed`, for varied) say which. `--seed` with steady offsets is
//! refused, not ignored.
//!
//! `--placement isolated` (the default) pins the coordinator's endpoint thread to the last
//! core and the producers, the driver and the WAL's sync thread and io_uring workers to the
//! others (module `placement`); `shared` pins nothing. The JSON key `placement` says which was
//! applied (one core: `shared`): `partly isolated` if the system refused the pin of a load
//! thread or of the coordinator's thread (a warning on stderr names it; the WAL's own I/O
//! threads, confined by the WAL, are not counted).
//!
//! `--baseline reference` then applies the same message stream (the producers' batches in
//! round-robin order) to the reference model and, for comparison, to the fast state machine,
//! directly on this thread (no bus, which favours the reference). The reference model rescans
//! its maps on every message, so it gets a time budget (`--baseline-seconds`, refused with the
//! other baselines) and is measured on the prefix of the stream it gets through.
//!
//! `--baseline memory` (with `--durability group|every` only; refused with `none`, where it
//! would compare the run with itself) measures a durable run against the in-memory bus run in
//! the same process: an in-memory run, the durable run, then another in-memory run, each on a
//! fresh bus and coordinator with the same flags and message stream (`--durability none`, no
//! WAL). The in-memory runs bracket the durable one, so that a drift of the machine during
//! the sitting (a slow stretch, the host moving the vCPUs) weighs on both sides of the ratio.
//! The figure is the durable run's; its baseline (`in-memory bus`) is the arithmetic mean of
//! the two in-memory rates (`memory_msgs_per_sec`, also `baseline_msgs_per_sec`), its `ratio`
//! (also `ratio_to_memory`) the durable rate over that mean, and the two runs' own rates and
//! commit p50s (`memory_before_msgs_per_sec`, `memory_after_msgs_per_sec`,
//! `memory_before_p50_ns`, `memory_after_p50_ns`) say how far apart they were and whether the
//! coordinator set their pace (a commit p50 of hundreds of microseconds) or a producer did
//! (microseconds). It takes three runs' time. One baseline a run: the reference model's rate
//! says nothing about durability, so `--baseline reference` stays a run of its own.
//!
//! `--durability group|every` puts a `DurableQuery` (the offset and commit logs in the WAL, in
//! a fresh directory made inside `--dir` or the system's temporary directory, as the `wal` and
//! `blocks` workloads make theirs, and removed afterwards unless `--keep`) in front of the load
//! query: group commit (`Durability::GroupCommit`: the WAL's default 200 us delay, or
//! `--group-delay-us`, and groups of up to 4 MiB, as in the `wal` workload; the WAL's default
//! is 1 MiB) or `Durability::EveryRecord` (no group delay: a sync starts as soon as one is not
//! running, and the records appended during a sync share the next one, so this is not a sync
//! per record here, where nobody waits for each record). The coordinator never waits for a
//! sync, but the run only ends when the last epoch's commit record is durable, and that moment
//! ends the measured time.
//!
//! Such runs also report the durable commit latency (`durable_p50_ns`, `durable_p99_ns`,
//! `durable_p999_ns`): from the same clock read as the commit latency to the moment the
//! epoch's commit record is seen durable; `p50_ns`.. stay the in-memory commit latency (the
//! JSON key `latency` says so, also in the table). It is seen at the coordinator's next commit
//! (the query collaborator asks the durable query's status there, which costs no wake-up and
//! no extra sync) or, for the run's last epochs, when the main thread's wait for the last
//! commit record returns; so it reads late by at most the gap between two commits, tens of
//! microseconds under load.
//!
//! The flags that only a WAL uses (`--group-delay-us`, which only group commit uses,
//! `--sync-nice`, `--dir`, `--keep`) are refused with `--durability none` rather than ignored,
//! and the WAL's keys (`sync_nice`, `group_delay_us`) are reported only by runs that have one:
//! a figure never names a setting that did not apply. Those flags are `Option`s for that reason
//! (clap cannot tell a default from a value given), their defaults applied by
//! [`EpochArgs::sync_nice`] and its siblings.
//!
//! `peak_rss_mib` is the peak resident memory during the run (module `memory`: the process's
//! mark is reset when the run starts, so in the no-argument run it no longer carries the peaks
//! of the workloads run before; `rss_at_start_mib` is what the process held then). It counts
//! the run's per-epoch timestamps, allocated and written before the run starts: 16 bytes an
//! epoch, 24 with a WAL (1.5 MiB at 100 000 epochs, 384 MiB at the most `--epochs`, 2^24),
//! which grow it with `--epochs` at any partition count. With `--baseline memory` it is the
//! durable run's own peak.
//!
//! `core_round_trip_ns` (module `machine`) brackets the runs each figure's rate and ratio come
//! from: the bus figure's bus run (with `--baseline memory` its three bus runs; with
//! `--baseline reference` also the reference model's direct run after it, its ratio's
//! baseline), the `epoch/state-machine` figure's the direct runs only (its own and the
//! reference model's, which follow the bus run and take seconds).

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering},
        Arc, Barrier, OnceLock,
    },
    thread::Thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use clap::builder::RangedU64ValueParser;
use coordbus::{
    coordinators::epoch::{
        coordinator_name, reference::ReferenceEpochCoordinator, CollaboratorError,
        CommitPartitionEpoch, DurableQuery, DurableQueryStatus, Epoch, EpochConfig,
        EpochCoordinator, EpochEndpoint, EpochError, EpochMessage, GetCurrentEpoch, GetEpochStats,
        IncrementAndGetEpoch, Offsets, PartitionId, Payload, Query, ReportPartitionOffset,
        SetReaderPartitions, SetWriterPartitions, Sink,
    },
    wal::{self, Wal, WalConfig, WalOptions},
    Bus, Pinning,
};
use coordbus_tools::scratch::ScratchDir;
use hdrhistogram::Histogram;

use crate::{
    limits::{INBOX_CAPACITY, MAX_BATCH, MAX_GROUP_DELAY_US, MAX_INBOX_LANES, MAX_INBOX_SHARDS},
    machine,
    offsets::{OffsetPattern, OffsetStream},
    placement::{self, Placement},
    report::{Figure, Percentiles},
};

/// Most epochs of a run (`--epochs`, 2^24): the run keeps two 8-byte timestamps per epoch
/// (256 MiB at this bound), three with `--durability group|every` (384 MiB), allocated up
/// front. Also the largest `--window`: a window of every epoch of the run is the largest that
/// changes anything.
const MAX_EPOCHS: i64 = 1 << 24;
/// Most producer threads: the coordinator's inbox has a shard per producer plus one for the
/// driver, and the bus allows at most [`MAX_INBOX_SHARDS`].
const MAX_PRODUCERS: u64 = MAX_INBOX_SHARDS - 1;
/// Most partitions (`--partitions`, 2^20): the steady offsets hold the partition in their low
/// 20 bits, and an epoch is 2 x partitions messages, generated whole.
const MAX_PARTITIONS: i64 = 1 << 20;
/// Largest `--backlog-limit` (2^26 entries per queue): the coordinator may hold that many
/// entries before the limit stops the query.
const MAX_BACKLOG_LIMIT: u64 = 1 << 26;
/// Longest time budget of the reference model run (`--baseline-seconds`), in seconds.
const MAX_BASELINE_SECONDS: f64 = 3600.0;

/// Durability of the commit records.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// In memory only.
    None,
    /// WAL with group commit.
    Group,
    /// WAL with `Durability::EveryRecord` (syncs back to back, no group delay).
    Every,
}

impl Durability {
    fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Group => "group",
            Self::Every => "every",
        }
    }
}

/// What to compare against.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// No baseline.
    None,
    /// The reference model (Spark's algorithm) on the same stream.
    Reference,
    /// With `--durability group|every`: in-memory bus runs before and after the durable one.
    Memory,
}

impl Baseline {
    fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Reference => "reference",
            Self::Memory => "memory",
        }
    }
}

/// Flags of the `epoch` workload.
#[derive(clap::Args, Debug, Clone)]
pub struct EpochArgs {
    /// Reader partitions, and as many writer partitions (1 ..= 1048576: a steady offset holds
    /// the partition in its low 20 bits).
    #[arg(
        long,
        default_value_t = 1000,
        value_parser = clap::value_parser!(i32).range(1..=MAX_PARTITIONS)
    )]
    pub partitions: i32,
    /// Epochs to run (each is 2 x partitions messages; 1 ..= 16777216). The run keeps 16
    /// bytes of timestamps per epoch (24 with --durability group|every), allocated before it
    /// starts and counted in peak_rss_mib: 1.5 MiB at 100000 epochs, 384 MiB at the most.
    #[arg(
        long,
        default_value_t = 5000,
        value_parser = clap::value_parser!(i64).range(1..=MAX_EPOCHS)
    )]
    pub epochs: i64,
    /// Producer threads (each owns a contiguous range of partitions; 1 ..= 1023: each has an
    /// inbox shard, and the driver one more, of the bus's 1024 at most).
    #[arg(
        long,
        default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_PRODUCERS)
    )]
    pub producers: usize,
    /// Messages per `send_iter` batch (1 ..= 1048576).
    #[arg(
        long,
        default_value_t = 512,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH)
    )]
    pub batch: usize,
    /// How many epochs the producers may run ahead of the last committed epoch; 0 = auto
    /// (about 64 Ki messages in flight, at least 4 epochs: 32768 epochs at 1 partition, 32 at
    /// 1000); at most 16777216 (the most `--epochs`: a window of every epoch). A producer held
    /// back resumes when half of the window is free. The inbox's capacity is the other bound: a
    /// full inbox makes `send_iter` wait. The window mostly sets the commit latency of a
    /// backlogged run: an epoch's last batch waits behind the half to whole window queued
    /// ahead of it (about that many messages over the rate), so a smaller window lowers the
    /// p50/p99 (and, once the coordinator runs out of queued work, the rate).
    #[arg(
        long,
        default_value_t = 0,
        value_parser = clap::value_parser!(i64).range(0..=MAX_EPOCHS)
    )]
    pub window: i64,
    /// Commit durability: none (in memory), group (WAL, group commit) or every (WAL, syncs
    /// back to back with no group delay; records appended during a sync share the next). The
    /// p50/p99/p99.9 columns (`p50_ns`..) are always the in-memory commit latency: from just
    /// before the send of the batch that carries an epoch's last message (making the batch
    /// included) to the epoch's commit; in a backlogged run mostly the wait behind the
    /// messages the window lets queue (see --window). A WAL run adds the latency to the commit
    /// record being durable as `durable_p50_ns`.. (in the table's details:
    /// `durable_p50/p99/p99.9`).
    #[arg(long, value_enum, default_value_t = Durability::None)]
    pub durability: Durability,
    /// With `--durability group` only: longest a record waits for its group (the WAL's
    /// `GroupCommit::max_delay`), in microseconds (default 200; at most 60 s, the WAL's limit).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_GROUP_DELAY_US))]
    pub group_delay_us: Option<u64>,
    /// Baseline run in the same process on the same message stream: `reference`, the
    /// reference model (Spark's algorithm) directly on this thread, on the prefix of the stream
    /// it gets through in --baseline-seconds; `memory`, with --durability group|every only,
    /// the in-memory bus run: in memory, then durable, then in memory again, each on a fresh
    /// coordinator, the ratio against the mean of the two in-memory rates
    /// (`ratio_to_memory`, `memory_msgs_per_sec`, and each run's rate and commit p50); `none`.
    #[arg(long, value_enum, default_value_t = Baseline::Reference)]
    pub baseline: Baseline,
    /// With `--baseline reference` only: time budget of the reference model run, in seconds
    /// (default 2; finite, more than 0, at most 3600).
    #[arg(long, value_parser = parse_baseline_seconds)]
    pub baseline_seconds: Option<f64>,
    /// Backlog limit of the coordinator (all three limits). The default is above the
    /// coordinator's own (10 000, Spark's): the window keeps about 64 Ki messages in flight,
    /// so each queue holds up to about 32 Ki entries, which would stop the query as Spark's
    /// limits would; and at 10 000 partitions one committed epoch (whose entries stay counted
    /// until the next epoch commits) and the next already reach 10 000 entries. At least 2 x
    /// `--partitions` (a committed epoch's entries and the next epoch's), at most 2^26.
    #[arg(
        long,
        default_value_t = 1_000_000,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BACKLOG_LIMIT)
    )]
    pub backlog_limit: usize,
    /// Inbox capacity per lane and per shared ring (messages; 2 ..= 2^24, the bus's limit).
    #[arg(
        long,
        default_value_t = 1 << 16,
        value_parser = RangedU64ValueParser::<usize>::new().range(INBOX_CAPACITY)
    )]
    pub inbox_capacity: usize,
    /// Single-producer lanes of the coordinator's inbox (0: producers share rings; at most
    /// 1024, the bus's limit).
    #[arg(
        long,
        default_value_t = coordbus::queue::DEFAULT_LANES,
        value_parser = RangedU64ValueParser::<usize>::new().range(0..=MAX_INBOX_LANES)
    )]
    pub inbox_lanes: usize,
    /// With `--durability group|every` only: how much lower the WAL's sync thread's CPU
    /// priority is (added to its nice value, capped at 19; 0 leaves it; default 5; at most
    /// 39). Its io_uring workers inherit it.
    #[arg(
        long,
        value_parser = clap::value_parser!(u8).range(0..=i64::from(wal::MAX_SYNC_THREAD_NICE))
    )]
    pub sync_nice: Option<u8>,
    /// With `--durability group|every` only: the directory for the log. A fresh
    /// `coordbus-load-*` directory is made inside it (it must exist) and removed at the end
    /// unless `--keep` (default: inside the system temp dir), as the `wal` and `blocks`
    /// workloads do.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// With `--durability group|every` only: keep the log's directory at the end (also on an
    /// error or Ctrl-C), to read it with `coordbus-wal`; its path is printed on stderr and in
    /// the JSON key `wal_dir`.
    #[arg(long)]
    pub keep: bool,
    /// Where the threads run: `isolated` keeps the last core for the coordinator alone and
    /// runs the producers, the driver and the WAL's I/O threads on the other cores; `shared`
    /// pins nothing and lets the scheduler place every thread.
    #[arg(long, value_enum, default_value_t = Placement::Isolated)]
    pub placement: Placement,
    /// How the reported offsets advance: `steady` (every partition by 2^20 an epoch) or
    /// `varied` (each partition by a seeded rate of its own, with a jitter that changes every
    /// epoch). With a WAL, `varied` logs about 3 bytes an offset per epoch, `steady` none.
    #[arg(long, value_enum, default_value_t = OffsetPattern::Steady)]
    pub offsets: OffsetPattern,
    /// With `--offsets varied` only: seed of the offsets' rates and jitters (default 42).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Group commit delay when `--group-delay-us` is not given, in microseconds.
const DEFAULT_GROUP_DELAY_US: u64 = 200;
/// Seed of the varied offsets when `--seed` is not given.
const DEFAULT_SEED: u64 = 42;
/// Time budget of the reference model run when `--baseline-seconds` is not given, in seconds.
const DEFAULT_BASELINE_SECONDS: f64 = 2.0;

impl EpochArgs {
    /// The group commit delay: `--group-delay-us` or its default.
    fn group_delay_us(&self) -> u64 {
        self.group_delay_us.unwrap_or(DEFAULT_GROUP_DELAY_US)
    }

    /// The sync thread's nice increment: `--sync-nice` or the WAL's default.
    fn sync_nice(&self) -> u8 {
        self.sync_nice.unwrap_or(wal::DEFAULT_SYNC_THREAD_NICE)
    }

    /// The offsets' seed: `--seed` or its default.
    fn seed(&self) -> u64 {
        self.seed.unwrap_or(DEFAULT_SEED)
    }

    /// The reference model's time budget: `--baseline-seconds` or its default.
    fn baseline_seconds(&self) -> f64 {
        self.baseline_seconds.unwrap_or(DEFAULT_BASELINE_SECONDS)
    }

    /// The flags given that only a WAL uses, as the operator wrote them.
    fn wal_flags_given(&self) -> Vec<String> {
        let mut given = Vec::new();
        given.extend(self.sync_nice.map(|nice| format!("--sync-nice {nice}")));
        given.extend(self.dir.as_ref().map(|dir| format!("--dir {}", dir.display())));
        given.extend(self.keep.then(|| "--keep".to_owned()));
        given
    }
}

/// A run of a few seconds for the no-argument invocation.
pub fn quick() -> EpochArgs {
    EpochArgs {
        partitions: 1000,
        epochs: 2000,
        producers: 1,
        batch: 512,
        window: 0,
        durability: Durability::None,
        group_delay_us: None,
        baseline: Baseline::Reference,
        baseline_seconds: Some(1.0),
        backlog_limit: 1_000_000,
        inbox_capacity: 1 << 16,
        inbox_lanes: coordbus::queue::DEFAULT_LANES,
        sync_nice: None,
        dir: None,
        keep: false,
        placement: Placement::Isolated,
        offsets: OffsetPattern::Steady,
        seed: None,
    }
}

/// Longest park of a waiting producer or driver thread: only a bound on a missed wake-up (the
/// commit that reaches `wake_at`, or a new driver epoch, unparks it). Kept long: waits for
/// commits can last milliseconds, and on a busy two-core machine every timer wake-up takes a
/// core from the endpoint.
const MISSED_WAKE_BOUND: Duration = Duration::from_millis(20);

/// How many times a waiting producer looks at its condition before it parks: spinning on its
/// own core, it spares the coordinator the wake-up of a parked thread.
const PRODUCER_SPINS: u32 = 256;

/// State shared by the query collaborator (on the endpoint thread) and the load threads.
struct Shared {
    start: Instant,
    committed: AtomicI64,
    driver_epoch: AtomicI64,
    /// Per epoch (index epoch - 1): nanoseconds since `start` just before the `send_iter` call
    /// whose batch carries its last message (the latest of the producers').
    last_sent_ns: Vec<AtomicU64>,
    /// Per epoch: nanoseconds since `start` when it was committed.
    committed_ns: Vec<AtomicU64>,
    /// Durable runs: the query's status, asked at every commit which commits are durable, and
    /// by the main thread for the final wait and the WAL's counters.
    durable_status: OnceLock<DurableQueryStatus>,
    /// Durable runs, per epoch: nanoseconds since `start` when its commit record was seen
    /// durable (empty for in-memory runs).
    durable_ns: Vec<AtomicU64>,
    /// The last epoch stamped in `durable_ns` (0: none).
    durable_stamped: AtomicI64,
    stopped: AtomicBool,
    failed: AtomicBool,
    /// The producer and driver threads, woken by every new driver epoch and by the commit
    /// that reaches `wake_at`.
    waiters: OnceLock<Vec<Thread>>,
    /// The smallest committed epoch a parked thread waits for (`i64::MAX`: none).
    wake_at: AtomicI64,
    /// The epochs of the run.
    epochs: i64,
    /// The thread waiting for the last epoch's commit, a failure, or a stop.
    main: Thread,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn wake_all(&self) {
        for thread in self.waiters.get().map_or(&[][..], Vec::as_slice) {
            thread.unpark();
        }
    }

    /// Waits until `ready()`: spins up to `spins` looks (none: parks at once), then parks until
    /// the commit of epoch `committed_at_least` or a new driver epoch (woken by
    /// [`Shared::wake_all`]; the timeout only bounds a missed wake-up). Returns false if the run
    /// was stopped, checked before `ready()` on every round: a caller that finds itself ready
    /// again and again without progress still ends when the run is stopped.
    fn wait_until(&self, committed_at_least: i64, spins: u32, ready: impl Fn() -> bool) -> bool {
        let mut spun = 0u32;
        loop {
            if self.stopped.load(Ordering::Relaxed) {
                return false;
            }
            if ready() {
                return true;
            }
            if spun < spins {
                spun += 1;
                std::hint::spin_loop();
            } else {
                // Published before `ready` is checked again (SeqCst both here and in
                // `on_commit`): either that check sees the commit or the commit sees this.
                self.wake_at.fetch_min(committed_at_least, Ordering::SeqCst);
                if ready() {
                    return true;
                }
                std::thread::park_timeout(MISSED_WAKE_BOUND);
            }
        }
    }

    /// Stamps `now_ns` on the epochs up to `durable` (capped at the run's epochs) not stamped
    /// yet; each epoch is stamped by exactly one caller.
    fn stamp_durable(&self, durable: Option<Epoch>, now_ns: u64) {
        let through = durable.map_or(0, |epoch| epoch.0).min(self.epochs);
        let stamped = self.durable_stamped.fetch_max(through, Ordering::AcqRel);
        for epoch in stamped + 1..=through {
            if let Some(slot) = self.durable_ns.get((epoch - 1) as usize) {
                slot.store(now_ns, Ordering::Relaxed);
            }
        }
    }

    /// Ends the run: every waiting thread returns.
    fn stop_run(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.wake_all();
        self.main.unpark();
    }

    /// Records the commit of `epoch` and wakes the parked threads if one waits for it.
    fn on_commit(&self, epoch: i64) {
        self.committed.store(epoch, Ordering::SeqCst);
        if epoch >= self.wake_at.load(Ordering::SeqCst) {
            self.wake_at.store(i64::MAX, Ordering::SeqCst);
            self.wake_all();
        }
        if epoch >= self.epochs {
            self.main.unpark();
        }
    }
}

/// Stops the run when a load thread ends before its work is done (an error or a panic), so
/// that the other threads and the main thread stop waiting for commits that will not come.
struct StopRunUnlessDone<'a> {
    shared: &'a Shared,
    done: bool,
}

impl Drop for StopRunUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.shared.stop_run();
        }
    }
}

struct LoadQuery(Arc<Shared>);

impl Query for LoadQuery {
    fn add_offsets(&mut self, _: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError> {
        std::hint::black_box(offsets);
        Ok(())
    }

    fn commit(&mut self, epoch: Epoch) -> Result<(), CollaboratorError> {
        let shared = &self.0;
        let now_ns = shared.now_ns();
        if let Some(slot) = shared.committed_ns.get((epoch.0 - 1) as usize) {
            slot.store(now_ns, Ordering::Relaxed);
        }
        if let Some(status) = shared.durable_status.get() {
            // Stamped after the read: a sync that ends between the two clock reads is not
            // stamped before it ended.
            let durable = status.durable_committed();
            shared.stamp_durable(durable, shared.now_ns());
        }
        shared.on_commit(epoch.0);
        Ok(())
    }

    fn stop(&mut self, error: EpochError) {
        if !self.0.failed.swap(true, Ordering::Relaxed) {
            eprintln!("epoch workload: the coordinator stopped the query: {error}");
        }
        self.0.main.unpark();
    }
}

struct LoadSink;

impl Sink for LoadSink {
    fn commit(
        &mut self,
        _: Epoch,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError> {
        std::hint::black_box(messages);
        Ok(())
    }
}

/// The messages producer `range` sends for `epoch`, in order: per partition, its offset report
/// and then its writer commit.
fn epoch_messages(
    range: std::ops::Range<i32>,
    epoch: i64,
    offsets: &OffsetStream,
    out: &mut Vec<EpochMessage>,
) {
    for partition in range {
        push_partition_messages(partition, epoch, offsets, out);
    }
}

/// The two messages of `partition` for `epoch`: its offset report, then its writer commit.
fn push_partition_messages(
    partition: i32,
    epoch: i64,
    offsets: &OffsetStream,
    out: &mut Vec<EpochMessage>,
) {
    let at = StreamPosition { epoch, partition, commit_next: false };
    out.push(at.message(offsets));
    out.push(StreamPosition { commit_next: true, ..at }.message(offsets));
}

/// A position in a producer's stream of messages: the next one is the report (or, with
/// `commit_next`, the commit) of `partition` for `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StreamPosition {
    epoch: i64,
    partition: i32,
    commit_next: bool,
}

impl StreamPosition {
    /// The first message of `epoch` for producer `range` (not empty).
    fn start_of(epoch: i64, range: &std::ops::Range<i32>) -> Self {
        debug_assert!(!range.is_empty(), "every producer owns a partition");
        Self { epoch, partition: range.start, commit_next: false }
    }

    /// The message at this position, reporting `offsets`' offset.
    fn message(self, offsets: &OffsetStream) -> EpochMessage {
        let (partition, epoch) = (self.partition, self.epoch);
        if self.commit_next {
            CommitPartitionEpoch { partition, epoch, message: i64::from(partition).into() }.into()
        } else {
            let offset = offsets.offset(partition, epoch).into();
            ReportPartitionOffset { partition, epoch, offset }.into()
        }
    }

    /// How many messages producer `range`'s stream has from here through epoch `last`.
    fn messages_through(self, last: i64, range: &std::ops::Range<i32>) -> usize {
        let epochs = usize::try_from(last - self.epoch + 1).unwrap_or(0);
        let done_in_epoch =
            2 * (self.partition - range.start) as usize + usize::from(self.commit_next);
        (epochs * 2 * range.len()).saturating_sub(done_in_epoch)
    }

    /// Moves to the next message of producer `range`'s stream.
    fn advance(&mut self, range: &std::ops::Range<i32>) {
        if !self.commit_next {
            self.commit_next = true;
            return;
        }
        self.commit_next = false;
        self.next_partition(range);
    }

    /// Moves to the report of the next partition (of the next epoch after the range's last).
    fn next_partition(&mut self, range: &std::ops::Range<i32>) {
        debug_assert!(!self.commit_next);
        self.partition += 1;
        if self.partition == range.end {
            *self = Self::start_of(self.epoch + 1, range);
        }
    }
}

/// The next batch of a producer's stream: up to `batch` messages from a position, those of
/// epochs up to `last`, each made when the inbox asks for it (`send_iter`).
struct StreamBatch<'a> {
    /// Where the stream continues after the messages yielded so far.
    at: StreamPosition,
    /// Messages left in the batch.
    left: usize,
    range: &'a std::ops::Range<i32>,
    offsets: &'a OffsetStream,
}

impl<'a> StreamBatch<'a> {
    /// The batch of producer `range`'s stream from `at`: `batch` messages, or fewer where
    /// the stream passes epoch `last`.
    fn new(
        at: StreamPosition,
        batch: usize,
        last: i64,
        range: &'a std::ops::Range<i32>,
        offsets: &'a OffsetStream,
    ) -> Self {
        Self { at, left: at.messages_through(last, range).min(batch), range, offsets }
    }
}

impl Iterator for StreamBatch<'_> {
    type Item = EpochMessage;

    #[inline]
    fn next(&mut self) -> Option<EpochMessage> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let message = self.at.message(self.offsets);
        self.at.advance(self.range);
        Some(message)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for StreamBatch<'_> {}

fn ranges(partitions: i32, producers: usize) -> Vec<std::ops::Range<i32>> {
    let producers = producers as i64;
    (0..producers)
        .map(|index| {
            let start = (i64::from(partitions) * index / producers) as i32;
            let end = (i64::from(partitions) * (index + 1) / producers) as i32;
            start..end
        })
        .collect()
}

/// Parses `--baseline-seconds` (see [`check_baseline_seconds`]).
fn parse_baseline_seconds(text: &str) -> Result<f64, String> {
    let seconds = text.trim().parse::<f64>().map_err(|error| format!("not a number: {error}"))?;
    check_baseline_seconds(seconds)?;
    Ok(seconds)
}

/// A time budget of the reference run must be a duration: finite, more than 0, at most
/// [`MAX_BASELINE_SECONDS`].
fn check_baseline_seconds(seconds: f64) -> Result<(), String> {
    if seconds.is_finite() && seconds > 0.0 && seconds <= MAX_BASELINE_SECONDS {
        Ok(())
    } else {
        Err(format!("must be a finite number of seconds in (0, {MAX_BASELINE_SECONDS}]"))
    }
}

/// Checks the flags before anything runs (the clap ranges check each flag alone; this checks
/// them together, and the values of a run built in code).
fn validate(args: &EpochArgs) -> anyhow::Result<()> {
    if !(1..=MAX_PARTITIONS).contains(&i64::from(args.partitions)) {
        bail!("--partitions {} is out of range (1 ..= {MAX_PARTITIONS})", args.partitions);
    }
    if args.epochs < 1 || args.producers < 1 || args.batch < 1 {
        bail!(
            "--epochs {}, --producers {} and --batch {} must each be at least 1",
            args.epochs,
            args.producers,
            args.batch
        );
    }
    check_collected_batches(args)?;
    let least_backlog = 2 * args.partitions as usize;
    if args.backlog_limit < least_backlog || args.backlog_limit as u64 > MAX_BACKLOG_LIMIT {
        bail!(
            "--backlog-limit {} is out of range for --partitions {} ({least_backlog} ..= \
             {MAX_BACKLOG_LIMIT}: a committed epoch's entries stay counted while the next \
             epoch's arrive, so a smaller limit stops the query by design)",
            args.backlog_limit,
            args.partitions
        );
    }
    if args.producers > args.partitions as usize {
        bail!(
            "--producers {} exceeds --partitions {}: every producer owns at least one partition",
            args.producers,
            args.partitions
        );
    }
    if args.epochs > MAX_EPOCHS {
        bail!("--epochs {} is more than {MAX_EPOCHS}", args.epochs);
    }
    if args.producers as u64 > MAX_PRODUCERS {
        bail!("--producers {} is more than {MAX_PRODUCERS}", args.producers);
    }
    if !(0..=MAX_EPOCHS).contains(&args.window) {
        bail!("--window {} is out of range (0 = auto ..= {MAX_EPOCHS})", args.window);
    }
    // With several producers one can run ahead of the others by the whole window, its
    // partitions' entries of every epoch in it waiting for the rest: past the limit the query
    // stops by design, so refuse the flags up front instead of stopping mid-run.
    let window = window_epochs(args).min(args.epochs);
    let window_backlog = (window as u64 + 1).saturating_mul(args.partitions as u64);
    if args.producers > 1 && (args.backlog_limit as u64) < window_backlog {
        bail!(
            "--backlog-limit {} is too small for --partitions {} with --producers {} and a window \
             of {} epochs (at most the run's): a producer running ahead can leave up to \
             {window_backlog} entries waiting (the window plus one epoch of every partition); \
             raise the limit, or lower --window or --producers",
            args.backlog_limit,
            args.partitions,
            args.producers,
            window
        );
    }
    if let Some(seconds) = args.baseline_seconds {
        check_baseline_seconds(seconds)
            .map_err(|reason| anyhow::anyhow!("--baseline-seconds {seconds}: {reason}"))?;
    }
    check_flags_apply(args)
}

/// Threads that send into the coordinator's inbox besides the producers, each of which may hold
/// one of its lanes: the driver and the main thread (its set-up asks). A thread's lane is the
/// one of its process-wide producer index, claimed at its first send or ask, so which threads
/// get the lanes is a race; counted as if both others won theirs.
const LANE_HOLDERS_BESIDE_PRODUCERS: usize = 2;

/// Refuses `--producers` x `--batch` past the memory a run may plan up front, counting only
/// the batches that are allocated: a producer with an inbox lane of its own makes each message
/// straight into its slot (`send_iter` allocates nothing), and only a producer without one
/// (more producers than `--inbox-lanes`, less the lanes other threads may hold) collects each
/// batch into a vector first.
fn check_collected_batches(args: &EpochArgs) -> anyhow::Result<()> {
    let lanes_for_producers = args.inbox_lanes.saturating_sub(LANE_HOLDERS_BESIDE_PRODUCERS);
    let collecting = args.producers.saturating_sub(lanes_for_producers);
    crate::limits::check_planned_bytes(
        &format!(
            "--producers {} x --batch {} ({collecting} of the producers without a lane of \
             --inbox-lanes {} collect each batch into a vector)",
            args.producers, args.batch, args.inbox_lanes
        ),
        collecting as u128 * args.batch as u128 * std::mem::size_of::<EpochMessage>() as u128,
    )
}

/// Refuses a flag given for a setting the run does not have: ignored, it would let a figure
/// seem to have run with it.
fn check_flags_apply(args: &EpochArgs) -> anyhow::Result<()> {
    let durability = args.durability.name();
    if let (Some(delay), false) = (args.group_delay_us, args.durability == Durability::Group) {
        bail!(
            "--group-delay-us {delay} applies only to --durability group, not --durability \
             {durability}: it would be ignored"
        );
    }
    let wal_flags = args.wal_flags_given();
    if args.durability == Durability::None && !wal_flags.is_empty() {
        let verb = if wal_flags.len() == 1 { "applies" } else { "apply" };
        bail!(
            "{} {verb} only to a run with a WAL (--durability group or every), not \
             --durability none: it would be ignored",
            wal_flags.join(", ")
        );
    }
    if let (Some(seed), OffsetPattern::Steady) = (args.seed, args.offsets) {
        bail!(
            "--seed {seed} applies only to --offsets varied (steady offsets use no seed): it \
             would be ignored"
        );
    }
    if let (Some(seconds), false) = (args.baseline_seconds, args.baseline == Baseline::Reference) {
        bail!(
            "--baseline-seconds {seconds} applies only to --baseline reference, not --baseline \
             {}: it would be ignored",
            args.baseline.name()
        );
    }
    if args.baseline == Baseline::Memory && args.durability == Durability::None {
        bail!(
            "--baseline memory applies only to --durability group or every, not --durability \
             none: it compares a durable run with in-memory runs of the same stream"
        );
    }
    Ok(())
}

/// Refuses a durable run whose log does not fit in the free space under `dir`. The durable
/// query keeps the records of its last `DEFAULT_RETAINED_EPOCHS` committed epochs (cleaning
/// every quarter of that); counted here as twice that many full offsets records (8 bytes per
/// partition) in default segments, and the spare segments cleaning keeps.
fn check_free_disk(args: &EpochArgs, dir: &std::path::Path) -> anyhow::Result<()> {
    let record_bytes = u128::from(args.partitions.unsigned_abs()) * 8 + 256;
    let records = 2 * coordbus::coordinators::epoch::DEFAULT_RETAINED_EPOCHS as u128;
    let segment = WalConfig::default().segment_size_bytes;
    let spares = wal::DEFAULT_SPARE_SEGMENTS as u128 * u128::from(segment);
    crate::limits::check_free_disk(
        dir,
        &format!(
            "--partitions {} with --durability {}",
            args.partitions,
            format!("{:?}", args.durability).to_lowercase()
        ),
        crate::limits::log_disk_bytes(records, record_bytes, segment) + spares,
        " (--dir)",
    )
}

/// The directory of a durable run's log (`--dir`, `--keep`): a fresh `coordbus-load-*`
/// directory, as the `wal` and `blocks` workloads make.
enum WalDir {
    /// Removed when dropped (also on an error) or on interruption.
    Scratch(ScratchDir),
    /// Kept whatever happens (`--keep`), its path already printed.
    Kept(PathBuf),
}

impl WalDir {
    /// A fresh directory inside `--dir` (default: the system temp dir), kept with `--keep`.
    fn new(args: &EpochArgs) -> anyhow::Result<Self> {
        let scratch = crate::wal::temp_in(&args.dir)?;
        if !args.keep {
            return Ok(Self::Scratch(scratch));
        }
        // Kept from now on, so that a run that fails leaves its log to read too.
        let kept = scratch.keep();
        eprintln!("epoch workload: the WAL is kept in {} (--keep)", kept.display());
        Ok(Self::Kept(kept))
    }

    fn path(&self) -> &Path {
        match self {
            Self::Scratch(scratch) => scratch.path(),
            Self::Kept(path) => path,
        }
    }

    /// Ends the run's use of the directory: removes it, or returns its path if it is kept.
    fn finish(self) -> Option<PathBuf> {
        match self {
            Self::Scratch(_) => None,
            Self::Kept(path) => Some(path),
        }
    }
}

/// What the `p50_ns`.. of an epoch figure time (the JSON key `latency`, also in the table).
fn latency_description(durability: Durability) -> &'static str {
    match durability {
        Durability::None => "last batch sent -> commit",
        Durability::Group | Durability::Every => {
            "last batch sent -> commit, in memory (durable_p*: -> commit record durable)"
        }
    }
}

/// Adds the settings this run used that depend on others (the WAL's with a WAL, the seed
/// with varied offsets), and where a kept log is: a figure names no setting that did not
/// apply.
fn with_settings_that_applied(
    mut figure: Figure,
    args: &EpochArgs,
    kept_wal_dir: Option<PathBuf>,
) -> Figure {
    if args.durability != Durability::None {
        figure = figure.with("sync_nice", args.sync_nice());
    }
    if args.durability == Durability::Group {
        figure = figure.with("group_delay_us", args.group_delay_us());
    }
    if args.offsets == OffsetPattern::Varied {
        figure = figure.with("seed", args.seed());
    }
    match kept_wal_dir {
        Some(dir) => figure.with("wal_dir", dir.display().to_string()),
        None => figure,
    }
}

/// The longest a run may go without a commit before it ends as stalled.
const STALL_LIMIT: Duration = Duration::from_secs(60);

/// Runs the workload.
pub fn run(args: &EpochArgs) -> anyhow::Result<Vec<Figure>> {
    validate(args)?;
    // Each figure's probes bracket the runs its rate and ratio come from (module doc).
    let before_bus = machine::core_round_trip_ns();
    let bus = match args.baseline {
        Baseline::Memory => run_bus_against_memory(args)?,
        Baseline::None | Baseline::Reference => run_bus(args)?,
    };
    let after_bus = machine::core_round_trip_ns();
    if args.baseline != Baseline::Reference {
        return Ok(vec![
            bus.with(machine::ROUND_TRIPS_KEY, machine::round_trips_json(before_bus, after_bus))
        ]);
    }
    let (ours, reference) = run_direct(args)?;
    let after_direct = machine::core_round_trip_ns();
    let with_reference = |figure: Figure, before| {
        figure
            .with_baseline("reference (direct)", reference.figure.msgs_per_sec())
            .with("baseline_messages", reference.figure.messages)
            .with("baseline_epochs", reference.epochs)
            .with(machine::ROUND_TRIPS_KEY, machine::round_trips_json(before, after_direct))
    };
    Ok(vec![with_reference(bus, before_bus), with_reference(ours, after_bus)])
}

/// The name of the `--baseline memory` baseline.
const MEMORY_BASELINE: &str = "in-memory bus";

/// `--baseline memory`: the durable bus run between two in-memory bus runs of the same flags
/// and stream, each on a fresh bus and coordinator; the durable run's figure with the mean of
/// the in-memory rates as its baseline (module doc: the keys).
fn run_bus_against_memory(args: &EpochArgs) -> anyhow::Result<Figure> {
    debug_assert_ne!(args.durability, Durability::None, "refused by `check_flags_apply`");
    let in_memory = EpochArgs {
        durability: Durability::None,
        group_delay_us: None,
        sync_nice: None,
        dir: None,
        keep: false,
        baseline: Baseline::None,
        ..args.clone()
    };
    let before = run_bus(&in_memory)?;
    let durable = run_bus(args)?;
    let after = run_bus(&in_memory)?;
    let memory_msgs_per_sec = (before.msgs_per_sec() + after.msgs_per_sec()) / 2.0;
    let figure = durable
        .with_baseline(MEMORY_BASELINE, memory_msgs_per_sec)
        .with("memory_msgs_per_sec", memory_msgs_per_sec)
        .with("memory_before_msgs_per_sec", before.msgs_per_sec())
        .with("memory_after_msgs_per_sec", after.msgs_per_sec())
        .with("memory_before_p50_ns", before.latency.p50_ns)
        .with("memory_after_p50_ns", after.latency.p50_ns);
    let ratio = figure.ratio();
    Ok(figure.with("ratio_to_memory", ratio))
}

/// The reference model's run of [`run_direct`]: its figure, and how many epochs it committed
/// within its time budget (the model's cost per message grows with what its maps hold, so a
/// budget that ends inside the first epochs times its cheapest stretch: the JSON says how far
/// it got, `baseline_messages` and `baseline_epochs`).
struct ReferenceRun {
    figure: Figure,
    epochs: i64,
}

/// The window in epochs (`--window 0`: about 64 Ki messages in flight, at least 4 epochs).
fn window_epochs(args: &EpochArgs) -> i64 {
    if args.window > 0 {
        args.window
    } else {
        (65_536 / (2 * i64::from(args.partitions))).max(4)
    }
}

fn run_bus(args: &EpochArgs) -> anyhow::Result<Figure> {
    // Before the run's own allocations: they are part of its peak.
    let peak_rss = crate::memory::PeakRss::reset("epoch");
    let epochs = args.epochs;
    let window = window_epochs(args);
    let durable_epochs = if args.durability == Durability::None { 0 } else { epochs };
    let shared = Arc::new(Shared {
        start: Instant::now(),
        committed: AtomicI64::new(0),
        driver_epoch: AtomicI64::new(1),
        last_sent_ns: (0..epochs).map(|_| AtomicU64::new(0)).collect(),
        committed_ns: (0..epochs).map(|_| AtomicU64::new(0)).collect(),
        durable_status: OnceLock::new(),
        durable_ns: (0..durable_epochs).map(|_| AtomicU64::new(0)).collect(),
        durable_stamped: AtomicI64::new(0),
        stopped: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        waiters: OnceLock::new(),
        wake_at: AtomicI64::new(i64::MAX),
        epochs,
        main: std::thread::current(),
    });
    // The WAL directory lives until the end of this function (removed on drop). Declared
    // before the bus, so that on an early return the bus (and the log it holds open) goes
    // first.
    let mut wal_dir = None;
    let cores = args.placement.cores(&placement::available_cores());
    if args.placement == Placement::Isolated && cores.is_none() {
        eprintln!("epoch workload: one core, nothing to isolate: the threads share it");
    }
    let bus = Bus::builder()
        .pinning(
            cores.as_ref().map_or(Pinning::Off, |cores| Pinning::Cores(vec![cores.coordinator])),
        )
        .inbox_lanes(args.inbox_lanes)
        .inbox_shards(args.producers + 1)
        .inbox_capacity(args.inbox_capacity)
        .build()?;
    let config = EpochConfig::new(1).with_backlog_limit(args.backlog_limit);
    let load_query = LoadQuery(Arc::clone(&shared));
    let query: Box<dyn Query + Send> = match args.durability {
        Durability::None => Box::new(load_query),
        Durability::Group | Durability::Every => {
            let dir = WalDir::new(args)?;
            check_free_disk(args, dir.path())?;
            let durability = match args.durability {
                Durability::Every => wal::Durability::EveryRecord,
                _ => wal::Durability::GroupCommit {
                    max_delay: Duration::from_micros(args.group_delay_us()),
                    max_bytes: 4 << 20,
                },
            };
            let options = WalOptions {
                sync_thread_nice: args.sync_nice(),
                io_cores: cores.as_ref().map(|cores| cores.load.clone()).unwrap_or_default(),
                ..WalOptions::default()
            };
            let wal = Wal::open_with_options(
                dir.path(),
                WalConfig { durability, ..WalConfig::default() },
                options,
            )?;
            let query = DurableQuery::from_wal(wal, load_query)?;
            let _ = shared.durable_status.set(query.status());
            wal_dir = Some(dir);
            Box::new(query)
        }
    };
    let endpoint = EpochEndpoint::new(config, query, LoadSink)?;
    let coordinator = bus.register(coordinator_name("load"), endpoint)?;
    coordinator.ask(SetReaderPartitions(args.partitions)).wait()?;
    coordinator.ask(SetWriterPartitions(args.partitions)).wait()?;

    let barrier = Arc::new(Barrier::new(args.producers + 2));
    let refused_pins = Arc::new(AtomicUsize::new(0));
    let mut threads = Vec::new();
    let offsets = OffsetStream::new(args.offsets, args.partitions, args.seed());
    for (index, range) in ranges(args.partitions, args.producers).into_iter().enumerate() {
        let (shared, coordinator, barrier, offsets) =
            (Arc::clone(&shared), coordinator.clone(), Arc::clone(&barrier), offsets.clone());
        let batch = args.batch;
        let name = format!("epoch-producer-{index}");
        let core = cores.as_ref().map(|cores| cores.load_core(index));
        threads.push(spawn_named(name, core, &refused_pins, move || -> anyhow::Result<()> {
            let mut unless_done = StopRunUnlessDone { shared: &shared, done: false };
            // As Spark's tasks do on start; it also gives this thread its inbox lane (a few MiB
            // of slots, faulted in on allocation) before the measured time.
            let started = coordinator.ask(GetCurrentEpoch).wait();
            start_line(&barrier);
            started?;
            let mut next = 1;
            // Held back by the window: resume once half of it is free (module doc).
            let resume = (window / 2).max(1);
            while next <= epochs {
                let ready = || {
                    shared.driver_epoch.load(Ordering::Acquire) >= next
                        && next - shared.committed.load(Ordering::SeqCst) <= resume
                };
                if !shared.wait_until(next - resume, PRODUCER_SPINS, ready) {
                    return Ok(());
                }
                // Every epoch the driver announced and the window allows, in one stream.
                let start = next;
                let last = shared
                    .driver_epoch
                    .load(Ordering::Acquire)
                    .min(shared.committed.load(Ordering::Acquire).saturating_add(window))
                    .min(epochs);
                // Each message made as its inbox slot takes it: no vector in between.
                let mut at = StreamPosition::start_of(start, &range);
                loop {
                    let mut messages = StreamBatch::new(at, batch, last, &range, &offsets);
                    if messages.len() == 0 {
                        break;
                    }
                    // Before the call, which makes the batch's messages: the latency counts it.
                    let sent_ns = shared.now_ns();
                    coordinator
                        .send_iter(&mut messages)
                        .map_err(|_| anyhow::anyhow!("the coordinator stopped"))?;
                    at = messages.at;
                    // Epochs whose last message went in this batch.
                    while next < at.epoch {
                        shared.last_sent_ns[(next - 1) as usize]
                            .fetch_max(sent_ns, Ordering::Relaxed);
                        next += 1;
                    }
                }
                debug_assert_eq!(next, last + 1);
            }
            unless_done.done = true;
            Ok(())
        })?);
    }
    let driver = {
        let (shared, coordinator, barrier) =
            (Arc::clone(&shared), coordinator.clone(), Arc::clone(&barrier));
        let core = cores.as_ref().map(|cores| cores.load_core(args.producers));
        spawn_named("epoch-driver".into(), core, &refused_pins, move || -> anyhow::Result<()> {
            let mut unless_done = StopRunUnlessDone { shared: &shared, done: false };
            // Its inbox lane before the measured time, like the producers'.
            let started = coordinator.ask(GetCurrentEpoch).wait();
            start_line(&barrier);
            started?;
            let mut driver_epoch = 1;
            let resume = window / 2;
            while driver_epoch < epochs {
                let ready = || driver_epoch - shared.committed.load(Ordering::SeqCst) <= resume;
                // Parked at once: it waits for half a window of commits (at the default window,
                // a hundred microseconds and more), on a core it shares with the producers,
                // whose time each look at the commit count would spend.
                if !shared.wait_until(driver_epoch - resume, 0, ready) {
                    return Ok(());
                }
                // Announce every epoch the window allows with pipelined asks (one per epoch, as
                // Spark's epoch thread does), waiting only for the last reply.
                let room = window - (driver_epoch - shared.committed.load(Ordering::Acquire));
                let asks = room.clamp(1, epochs - driver_epoch);
                let mut last = None;
                for _ in 0..asks {
                    last = Some(coordinator.ask(IncrementAndGetEpoch));
                }
                if let Some(reply) = last {
                    driver_epoch = reply.wait()?;
                }
                shared.driver_epoch.store(driver_epoch, Ordering::Release);
                shared.wake_all();
            }
            unless_done.done = true;
            Ok(())
        })?
    };

    let mut waiters: Vec<Thread> = threads.iter().map(|t| t.thread().clone()).collect();
    waiters.push(driver.thread().clone());
    let _ = shared.waiters.set(waiters);
    // Stamped once every thread is set up and before any is let go: the run's time covers
    // every message and none of the set-up (a stamp after the release could come after the
    // first commits).
    barrier.wait();
    let started_ns = shared.now_ns();
    barrier.wait();
    // Parked until the last commit or a failure unparks it (a timed poll would take the
    // endpoint's core a thousand times a second), looking once a second for progress: a stall
    // (no commit for `STALL_LIMIT`: a lost commit, a stopped query) ends the run with an
    // error, however long a run that makes progress takes.
    let mut progress = (shared.committed.load(Ordering::Acquire), Instant::now());
    let mut stalled = false;
    while shared.committed.load(Ordering::Acquire) < epochs {
        let committed = shared.committed.load(Ordering::Acquire);
        if committed > progress.0 {
            progress = (committed, Instant::now());
        }
        stalled = progress.1.elapsed() > STALL_LIMIT;
        if stalled
            || shared.failed.load(Ordering::Relaxed)
            || shared.stopped.load(Ordering::Relaxed)
        {
            shared.stop_run();
            break;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
    let committed = shared.committed.load(Ordering::Acquire);
    let mut finished_ns = shared
        .committed_ns
        .get((committed.max(1) - 1) as usize)
        .map_or(0, |ns| ns.load(Ordering::Relaxed));
    let mut not_durable = None;
    // With nothing committed (a run that stalled or failed at once) there is nothing to wait for.
    if let Some(status) = shared.durable_status.get().filter(|_| committed > 0) {
        // The run ends when the last commit record is durable.
        if status.wait_durable_committed(Epoch(committed), Duration::from_secs(60)) {
            finished_ns = shared.now_ns();
            shared.stamp_durable(Some(Epoch(committed)), finished_ns);
        } else {
            not_durable = Some(status.wal_failure());
        }
    }
    for thread in threads {
        thread.join().map_err(|_| anyhow::anyhow!("producer panicked"))??;
    }
    driver.join().map_err(|_| anyhow::anyhow!("driver panicked"))??;
    let stats = coordinator.ask(GetEpochStats).wait()?;
    let endpoint_stats = coordinator.stats();
    // Settled: this thread got answers from the coordinator, so its thread has pinned itself
    // (the bus logs a refusal).
    if placement::coordinator_pin_refused(cores.as_ref(), endpoint_stats.pinned_core) {
        refused_pins.fetch_add(1, Ordering::Relaxed);
    }
    let wal_stats = shared.durable_status.get().and_then(DurableQueryStatus::wal_stats);
    bus.shutdown()?;
    // Closed by the shutdown: kept for `coordbus-wal` (`--keep`), or removed.
    let kept_wal_dir = wal_dir.and_then(WalDir::finish);
    if committed < epochs {
        let why = if stalled {
            format!("no epoch committed for {STALL_LIMIT:?}")
        } else {
            "the query was stopped".to_owned()
        };
        bail!("only {committed} of {epochs} epochs committed: {why} (stats: {stats:?})");
    }
    if let Some(failure) = not_durable {
        bail!("the commit record of epoch {committed} did not become durable (WAL: {failure:?})");
    }
    if stats.counters.dropped() != 0 {
        bail!("the coordinator dropped messages: {:?}", stats.counters);
    }

    let seconds = finished_ns.saturating_sub(started_ns) as f64 / 1e9;
    let messages = 2 * args.partitions as u64 * epochs as u64;
    let mut latency = Histogram::<u64>::new(3).context("histogram")?;
    for (sent, done) in shared.last_sent_ns.iter().zip(&shared.committed_ns) {
        let (sent, done) = (sent.load(Ordering::Relaxed), done.load(Ordering::Relaxed));
        latency.record(done.saturating_sub(sent).max(1))?;
    }
    let figure = Figure::new("epoch", messages, seconds)
        .with_latency(Percentiles::from_histogram(&latency))
        .with("latency", latency_description(args.durability))
        .with("partitions", args.partitions)
        .with("durability", args.durability.name())
        .with("offsets", args.offsets.name())
        .with("placement", placement::name(cores.as_ref(), refused_pins.load(Ordering::Relaxed)))
        .with("producers", args.producers as u64)
        .with("epochs", epochs)
        .with("window", window)
        .with("epochs_per_sec", epochs as f64 / seconds.max(1e-9))
        .with_endpoint_stats("endpoint_stats", &endpoint_stats);
    let mut figure = with_settings_that_applied(peak_rss.add_to(figure), args, kept_wal_dir);
    if durable_epochs > 0 {
        let mut durable = Histogram::<u64>::new(3).context("histogram")?;
        for (sent, done) in shared.last_sent_ns.iter().zip(&shared.durable_ns) {
            let (sent, done) = (sent.load(Ordering::Relaxed), done.load(Ordering::Relaxed));
            durable.record(done.saturating_sub(sent).max(1))?;
        }
        let durable = Percentiles::from_histogram(&durable);
        figure = figure
            .with("durable_p50_ns", durable.p50_ns)
            .with("durable_p99_ns", durable.p99_ns)
            .with("durable_p999_ns", durable.p999_ns);
    }
    Ok(match &wal_stats {
        Some(stats) => figure.with_wal_stats("wal_stats", stats),
        None => figure,
    })
}

/// A load thread's start: ready (its set-up done), then let go once the main thread has
/// stamped the start (the barrier's two rounds; the main thread stamps between them).
fn start_line(barrier: &Barrier) {
    barrier.wait();
    barrier.wait();
}

/// Spawns a load thread named `name` (so per-thread profiles tell the threads apart), pinned
/// to `core` if given (`--placement`); a pin the system refuses counts in `refused_pins`.
fn spawn_named<T: Send + 'static>(
    name: String,
    core: Option<usize>,
    refused_pins: &Arc<AtomicUsize>,
    body: impl FnOnce() -> T + Send + 'static,
) -> anyhow::Result<std::thread::JoinHandle<T>> {
    let (thread, refused_pins) = (name.clone(), Arc::clone(refused_pins));
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            if let Some(core) = core {
                if !placement::pin_load_thread(core, &thread) {
                    refused_pins.fetch_add(1, Ordering::Relaxed);
                }
            }
            body()
        })
        .with_context(|| format!("spawn the load thread {name}"))
}

/// The fast state machine and the reference model on the same stream, on this thread.
///
/// Not inlined: inlined into `run`, the state machine's hot loop was compiled together with
/// the rest of `run`, and a change elsewhere in the crate (`9ed4858`, which touches no code of
/// this run) halved this figure (151 -> 49-77 M msgs/s; `perf annotate` put 40% of the run on
/// two stalled loads in `Slots::insert`). On its own it reads 152 M msgs/s again.
#[inline(never)]
fn run_direct(args: &EpochArgs) -> anyhow::Result<(Figure, ReferenceRun)> {
    let ranges = ranges(args.partitions, args.producers);
    let offsets = OffsetStream::new(args.offsets, args.partitions, args.seed());
    let stream_epoch = |epoch: i64, out: &mut Vec<EpochMessage>| {
        // The producers' batches in round-robin order, as the endpoint would drain them.
        let mut per_producer: Vec<Vec<EpochMessage>> = ranges
            .iter()
            .map(|range| {
                let mut messages = Vec::new();
                epoch_messages(range.clone(), epoch, &offsets, &mut messages);
                messages
            })
            .collect();
        let mut cursors = vec![0usize; per_producer.len()];
        loop {
            let mut progressed = false;
            for (producer, messages) in per_producer.iter_mut().enumerate() {
                let start = cursors[producer];
                let end = (start + args.batch).min(messages.len());
                if start < end {
                    out.extend(messages[start..end].iter().cloned());
                    cursors[producer] = end;
                    progressed = true;
                }
            }
            if !progressed {
                break;
            }
        }
    };
    let config = EpochConfig::new(1).with_backlog_limit(args.backlog_limit);

    let mut reference = ReferenceEpochCoordinator::new(config.clone(), LoadSinkQuery, LoadSink)
        .expect("valid configuration");
    let _ = reference.set_reader_partitions(args.partitions);
    let _ = reference.set_writer_partitions(args.partitions);
    let budget = Duration::from_secs_f64(args.baseline_seconds());
    let mut buffer = Vec::new();
    let mut rejected = Rejected::default();
    let (mut reference_messages, mut reference_time) = (0u64, Duration::ZERO);
    'epochs: for epoch in 1..=args.epochs {
        buffer.clear();
        stream_epoch(epoch, &mut buffer);
        // The budget is checked every chunk of messages, not only between epochs: the model
        // rescans its maps per message, so one epoch of many partitions can take far longer
        // than the whole budget.
        let mut messages = buffer.drain(..);
        loop {
            let started = Instant::now();
            let mut applied = 0u64;
            for message in messages.by_ref().take(REFERENCE_CHUNK) {
                rejected.reference += u64::from(reference.apply(message).is_err());
                applied += 1;
            }
            reference_time += started.elapsed();
            reference_messages += applied;
            if reference_time > budget {
                break 'epochs;
            }
            if applied < REFERENCE_CHUNK as u64 {
                break;
            }
        }
    }
    let reference_epochs = reference.last_committed().0;

    let mut ours =
        EpochCoordinator::new(config, LoadSinkQuery, LoadSink).expect("valid configuration");
    let _ = ours.set_reader_partitions(args.partitions);
    let _ = ours.set_writer_partitions(args.partitions);
    let (mut our_messages, mut our_time) = (0u64, Duration::ZERO);
    for epoch in 1..=args.epochs {
        buffer.clear();
        stream_epoch(epoch, &mut buffer);
        our_messages += buffer.len() as u64;
        let started = Instant::now();
        // As the endpoint applies what it drains: one run.
        ours.apply_run(&mut buffer.drain(..), |_| rejected.ours += 1);
        our_time += started.elapsed();
    }
    // Both apply the same valid stream: a rejected message, or an epoch left uncommitted,
    // means a figure timed less work than it claims.
    if rejected.ours + rejected.reference > 0 || ours.last_committed().0 != args.epochs {
        bail!(
            "the direct runs rejected messages (ours {}, the reference {}) or left epochs \
             uncommitted (ours committed {} of {}): their figures would time less work than \
             they claim",
            rejected.ours,
            rejected.reference,
            ours.last_committed().0,
            args.epochs
        );
    }
    let ours = Figure::new("epoch/state-machine", our_messages, our_time.as_secs_f64())
        .with("partitions", args.partitions)
        .with("durability", "none")
        .with("epochs", ours.last_committed().0)
        .with("epochs_per_sec", ours.last_committed().0 as f64 / our_time.as_secs_f64().max(1e-9));
    let reference =
        Figure::new("epoch/reference", reference_messages, reference_time.as_secs_f64());
    Ok((ours, ReferenceRun { figure: reference, epochs: reference_epochs }))
}

/// Messages the direct runs rejected.
#[derive(Default)]
struct Rejected {
    ours: u64,
    reference: u64,
}

/// Messages the reference model applies between checks of its time budget.
const REFERENCE_CHUNK: usize = 1024;

/// A query for the direct runs: does nothing.
struct LoadSinkQuery;

impl Query for LoadSinkQuery {
    fn add_offsets(&mut self, _: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError> {
        std::hint::black_box(offsets);
        Ok(())
    }
    fn commit(&mut self, epoch: Epoch) -> Result<(), CollaboratorError> {
        std::hint::black_box(epoch);
        Ok(())
    }
    fn stop(&mut self, error: EpochError) {
        eprintln!("epoch workload (direct run): query stopped: {error}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches cut a producer's stream exactly at `batch` messages, whatever its parity, and
    /// the returned position says which epochs are complete; for either offset pattern.
    #[test]
    fn batches_are_the_stream_cut_every_batch_messages() {
        let range = 3..6;
        let (first, last) = (7, 9);
        for pattern in [OffsetPattern::Steady, OffsetPattern::Varied] {
            let offsets = OffsetStream::new(pattern, 6, 42);
            let mut stream = Vec::new();
            for epoch in first..=last {
                epoch_messages(range.clone(), epoch, &offsets, &mut stream);
            }
            assert_eq!(stream.len(), 2 * 3 * 3);
            for batch in [1, 4, 5, 6, 7, 100] {
                let case = format!("{pattern:?}, batch {batch}");
                let mut at = StreamPosition::start_of(first, &range);
                let mut joined = Vec::new();
                loop {
                    let mut messages = StreamBatch::new(at, batch, last, &range, &offsets);
                    let declared = messages.len();
                    let chunk: Vec<EpochMessage> = messages.by_ref().collect();
                    at = messages.at;
                    if chunk.is_empty() {
                        break;
                    }
                    assert!(chunk.len() <= batch, "{case}");
                    assert_eq!(chunk.len(), declared, "{case}: its len is exact");
                    joined.extend(chunk);
                    // Every epoch below the position is complete in what was sent.
                    let complete = (at.epoch - first) as usize * 6;
                    assert!(joined.len() >= complete, "{case}");
                    assert!(joined.len() < complete + 6, "{case}");
                    if joined.len() < stream.len() {
                        assert_eq!(joined.len() % batch, 0, "{case}: only the last is short");
                    }
                }
                assert_eq!(joined, stream, "{case}");
                assert_eq!(at, StreamPosition::start_of(last + 1, &range));
            }
            assert_eq!(
                stream[..2],
                [
                    ReportPartitionOffset {
                        partition: 3,
                        epoch: 7,
                        offset: offsets.offset(3, 7).into()
                    }
                    .into(),
                    CommitPartitionEpoch { partition: 3, epoch: 7, message: 3.into() }.into()
                ]
            );
        }
        let steady = OffsetStream::new(OffsetPattern::Steady, 6, 42);
        assert_eq!(steady.offset(3, 7), 7 << 20 | 3);
    }

    fn small_run(durability: Durability) -> serde_json::Value {
        small_run_of(durability, OffsetPattern::Steady)
    }

    fn small_run_of(durability: Durability, offsets: OffsetPattern) -> serde_json::Value {
        let args = EpochArgs {
            partitions: 8,
            epochs: 200,
            durability,
            baseline: Baseline::None,
            offsets,
            ..quick()
        };
        run_bus(&args).unwrap().to_json()
    }

    /// The producers' batches count in the memory check only where they are allocated: a
    /// producer with an inbox lane sends straight into it, one without collects a vector.
    #[test]
    fn the_batch_memory_check_counts_only_producers_without_a_lane() {
        // 1000 vectors of 2^20 messages are past the 8 GiB bound for any message of more
        // than 8 bytes.
        let args = |inbox_lanes| EpochArgs {
            producers: 1000,
            batch: 1 << 20,
            inbox_lanes,
            baseline: Baseline::None,
            baseline_seconds: None,
            ..quick()
        };
        validate(&args(1024)).unwrap();
        let refused = validate(&args(0)).unwrap_err().to_string();
        assert!(refused.contains("--producers 1000 x --batch 1048576"), "{refused}");
        assert!(refused.contains("1000 of the producers without a lane"), "{refused}");
        // Two of 16 lanes may go to the driver and the main thread: 986 collect.
        let refused = validate(&args(16)).unwrap_err().to_string();
        assert!(refused.contains("986 of the producers"), "{refused}");
    }

    /// A run in the default placement names it: `isolated` when every pin took (the
    /// coordinator's too), `shared` on one core.
    #[test]
    fn a_run_names_the_placement_it_got() {
        let figure = small_run(Durability::None);
        let expected = match placement::available_cores().len() {
            0 | 1 => "shared",
            _ => "isolated",
        };
        assert_eq!(figure["placement"], expected);
    }

    /// A durable run of varied offsets commits every epoch and says which offsets and seed it
    /// ran; a steady run names no seed.
    #[test]
    fn a_varied_run_commits_every_epoch_and_names_its_offsets() {
        let varied = small_run_of(Durability::Group, OffsetPattern::Varied);
        assert_eq!(varied["epochs"], 200, "{varied}");
        assert_eq!((&varied["offsets"], &varied["seed"]), (&"varied".into(), &42.into()));
        let steady = small_run(Durability::Group);
        assert_eq!(steady["offsets"], "steady", "{steady}");
        assert!(steady.get("seed").is_none(), "{steady}");
    }

    /// A durable run reports its durable commit latency, which is never below the commit
    /// latency (each epoch is seen durable at or after its commit); an in-memory run has none.
    #[test]
    fn durable_runs_report_the_latency_to_a_durable_commit() {
        for durability in [Durability::Group, Durability::Every] {
            let figure = small_run(durability);
            for (commit, durable) in [
                ("p50_ns", "durable_p50_ns"),
                ("p99_ns", "durable_p99_ns"),
                ("p999_ns", "durable_p999_ns"),
            ] {
                let (commit, durable) = (figure[commit].as_u64(), figure[durable].as_u64());
                assert!(
                    commit.is_some_and(|commit| durable.is_some_and(|durable| durable >= commit)),
                    "{durability:?}: commit {commit:?} ns, durable {durable:?} ns: {figure}"
                );
            }
        }
        let in_memory = small_run(Durability::None);
        assert!(in_memory["p50_ns"].is_u64(), "{in_memory}");
        assert!(in_memory.get("durable_p50_ns").is_none(), "{in_memory}");
    }
}
