//! `state-store`: the StateStoreCoordinator on the bus.
//!
//! Workloads (one figure each):
//! * `state-store/report`: one-way `ReportActiveInstance` from `--producers` threads, each
//!   cycling over its share of `--stores` stores spread over `--executors` executors; timed
//!   until every thread's closing ask (a barrier for its own reports) has returned. Baseline:
//!   the same inserts into one `Mutex<HashMap>` from the same number of threads; the extra key
//!   `state_machine_msgs_per_sec` is the bare state machine's rate on one thread (no bus).
//! * `state-store/verify`: synchronous `VerifyIfInstanceActive` asks, one at a time from one
//!   thread, with latency percentiles. Baseline: the same question to a thread owning a
//!   `HashMap`, over a crossbeam channel with a fresh reply channel per ask.
//! * `state-store/verify-pipelined`: the same asks with `--in-flight` outstanding at once.
//! * `state-store/location`: synchronous `GetLocation` asks (the reply is the location string),
//!   with the same baseline as `state-store/verify`.
//! * `state-store/deactivate`: `DeactivateInstances` of a run with `--deactivate-stores` stores
//!   while `--stores` stores of other runs stay registered; `seconds` is the median time of one
//!   deactivation ask. Baseline: Spark's method, a scan of one `HashMap` of all stores.
//!
//! Spark 4.3 figures from the same machine class (ANCHORS.md) are attached as `spark_*` keys.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Barrier, Mutex},
    thread,
    time::{Duration, Instant},
};

use clap::builder::RangedU64ValueParser;
use coordbus::{
    coordinators::state_store::{
        ExecutorCacheTaskLocation, GetCounters, GetLocation, ReportActiveInstance,
        StateStoreCoordinator, StateStoreCoordinatorConfig, StateStoreCoordinatorRef, StateStoreId,
        StateStoreProviderId, VerifyIfInstanceActive,
    },
    Bus, Idle,
};
use hdrhistogram::Histogram;
use uuid::Uuid;

use crate::{
    limits::{INBOX_CAPACITY, MAX_BATCH, MAX_INBOX_SHARDS, MAX_IN_FLIGHT, MAX_THREADS},
    machine::with_round_trips,
    report::{Figure, Percentiles},
};

/// Spark 4.3, synchronous StateStoreCoordinator ask, 1 thread (ANCHORS.md).
const SPARK_SYNC_ASKS_PER_SEC: f64 = 38_000.0;
const SPARK_SYNC_P50_NS: u64 = 17_000;
const SPARK_SYNC_P99_NS: u64 = 55_000;
/// Spark 4.3, pipelined report asks, 1 / 2 senders.
const SPARK_PIPELINED_1_PER_SEC: f64 = 590_000.0;
const SPARK_PIPELINED_2_PER_SEC: f64 = 740_000.0;
/// Spark 4.3, deactivateInstances of 100 k stores of one run.
const SPARK_DEACTIVATE_100K_SECONDS: f64 = 0.078;

/// Most stores (`--stores`, `--deactivate-stores`): each is about a hundred bytes in the
/// coordinator and in the workload's own tables.
const MAX_STORES: u64 = 10_000_000;
/// Most executors (`--executors`): each is an interned host and executor name, never freed.
const MAX_EXECUTORS: u64 = 1_000_000;
/// Most deactivation rounds (`--deactivate-rounds`).
const MAX_DEACTIVATE_ROUNDS: u64 = 1000;

/// Flags of `coordbus-load state-store`.
#[derive(clap::Args, Debug, Clone)]
pub struct StateStoreArgs {
    /// Stores registered (spread over the executors and the producers); 10k is 50 operators of
    /// 200 partitions (1 ..= 10000000).
    #[arg(
        long,
        default_value_t = 10_000,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_STORES)
    )]
    pub stores: usize,
    /// Executors the stores are spread over (1 ..= 1000000, and at most `--stores`).
    #[arg(
        long,
        default_value_t = 1_000,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_EXECUTORS)
    )]
    pub executors: usize,
    /// Reporter threads of state-store/report (1 by default: with the endpoint thread that
    /// fills a 2-core machine; 1 ..= 1024, and at most `--stores`: each reports its own share
    /// of the stores).
    #[arg(
        long,
        default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_THREADS)
    )]
    pub producers: usize,
    /// One-way reports per producer in state-store/report (at least 1).
    #[arg(long, default_value_t = 4_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub reports: u64,
    /// Reports per bus publication (1: one `send` per report; more: `send_batch`; at most
    /// 1048576).
    #[arg(
        long,
        default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH)
    )]
    pub batch: usize,
    /// Asks of state-store/verify, state-store/location and state-store/verify-pipelined (at
    /// least 1).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub asks: u64,
    /// Asks outstanding at once in state-store/verify-pipelined (1 ..= 1048576).
    #[arg(
        long,
        default_value_t = 64,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_IN_FLIGHT)
    )]
    pub in_flight: usize,
    /// Stores of the run removed by state-store/deactivate (1 ..= 10000000).
    #[arg(
        long,
        default_value_t = 100_000,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_STORES)
    )]
    pub deactivate_stores: usize,
    /// Deactivation rounds (the median is reported; 1 ..= 1000).
    #[arg(
        long,
        default_value_t = 5,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_DEACTIVATE_ROUNDS)
    )]
    pub deactivate_rounds: usize,
    /// Inbox rings of the coordinator (1 ..= 1024, the bus's limit).
    #[arg(
        long,
        default_value_t = 4,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_INBOX_SHARDS)
    )]
    pub inbox_shards: usize,
    /// Messages per inbox ring (2 ..= 2^24, the bus's limit).
    #[arg(
        long,
        default_value_t = 1 << 14,
        value_parser = RangedU64ValueParser::<usize>::new().range(INBOX_CAPACITY)
    )]
    pub inbox_capacity: usize,
    /// How long the coordinator's thread spins for work before it parks, in microseconds
    /// (the bus default is 50; at most 10 000, the bus's `Idle::MAX_SPIN`).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub spin_us: u64,
}

/// A ~3-5 s version for the no-argument run.
pub fn quick() -> StateStoreArgs {
    StateStoreArgs {
        stores: 10_000,
        executors: 1_000,
        producers: 1,
        reports: 2_000_000,
        batch: 1,
        asks: 50_000,
        in_flight: 64,
        deactivate_stores: 100_000,
        deactivate_rounds: 3,
        inbox_shards: 4,
        inbox_capacity: 1 << 14,
        spin_us: 50,
    }
}

/// Runs every state-store workload.
pub fn run(args: &StateStoreArgs) -> anyhow::Result<Vec<Figure>> {
    anyhow::ensure!(
        (1..=MAX_STORES as usize).contains(&args.stores),
        "--stores {} is out of range (1 ..= {MAX_STORES})",
        args.stores
    );
    anyhow::ensure!(
        (1..=MAX_STORES as usize).contains(&args.deactivate_stores),
        "--deactivate-stores {} is out of range (1 ..= {MAX_STORES})",
        args.deactivate_stores
    );
    anyhow::ensure!(
        (1..=MAX_EXECUTORS as usize).contains(&args.executors) && args.executors <= args.stores,
        "--executors {} is out of range (1 ..= {MAX_EXECUTORS}, and at most --stores {})",
        args.executors,
        args.stores
    );
    anyhow::ensure!(
        (1..=MAX_DEACTIVATE_ROUNDS as usize).contains(&args.deactivate_rounds),
        "--deactivate-rounds {} is out of range (1 ..= {MAX_DEACTIVATE_ROUNDS})",
        args.deactivate_rounds
    );
    anyhow::ensure!(args.producers > 0, "--producers must be positive");
    anyhow::ensure!(
        args.producers <= args.stores,
        "--producers {} exceeds --stores {}: every producer reports its own share of the stores",
        args.producers,
        args.stores
    );
    anyhow::ensure!(args.reports > 0, "--reports must be positive");
    anyhow::ensure!(args.batch > 0, "--batch must be positive");
    crate::limits::check_producer_batches(
        args.producers,
        args.batch,
        std::mem::size_of::<ReportActiveInstance>(),
    )?;
    anyhow::ensure!(args.asks > 0, "--asks must be positive");
    anyhow::ensure!(args.in_flight > 0, "--in-flight must be positive");
    let bus = Bus::builder()
        .inbox_shards(args.inbox_shards)
        .inbox_capacity(args.inbox_capacity)
        .idle(Idle::SpinThenPark { spin: Duration::from_micros(args.spin_us) })
        .build()?;
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus)?;
    let run_id = Uuid::from_u128(0x5747_e000);
    let stores = store_set(args.stores, args.executors, run_id, "/checkpoint/load");

    // Each figure's probes bracket its own runs (ours and its baseline's).
    let mut figures = vec![with_round_trips(|| report(args, &coordinator, &stores))?];
    figures.push(with_round_trips(|| verify(args, &coordinator, &stores))?);
    figures.push(with_round_trips(|| verify_pipelined(args, &coordinator, &stores))?);
    figures.push(with_round_trips(|| location(args, &coordinator, &stores))?);
    figures.push(with_round_trips(|| deactivate(args, &coordinator, &stores))?);
    let endpoint_stats = coordinator.endpoint().stats();
    if let Some(first) = figures.first_mut() {
        *first = first.clone().with_endpoint_stats("endpoint_stats", &endpoint_stats);
    }
    coordinator.stop_coordinator()?;
    bus.shutdown()?;
    Ok(figures)
}

type Store = (StateStoreProviderId, ExecutorCacheTaskLocation);

fn store_set(count: usize, executors: usize, run_id: Uuid, checkpoint: &str) -> Vec<Store> {
    let locations: Vec<_> = (0..executors)
        .map(|executor| {
            ExecutorCacheTaskLocation::new(&format!("host-{}", executor / 8), &executor.to_string())
        })
        .collect();
    (0..count)
        .map(|index| {
            let id = StateStoreProviderId::new(
                StateStoreId::new(checkpoint, (index / 200) as i64, (index % 200) as i32),
                run_id,
            );
            (id, locations[index % executors])
        })
        .collect()
}

fn report(
    args: &StateStoreArgs,
    coordinator: &StateStoreCoordinatorRef,
    stores: &[Store],
) -> anyhow::Result<Figure> {
    let producers = args.producers;
    let shares: Vec<Vec<Store>> = (0..producers)
        .map(|producer| stores.iter().skip(producer).step_by(producers).copied().collect())
        .collect();
    let before = coordinator.counters()?.reports;
    let barrier = Arc::new(Barrier::new(producers + 1));
    let handles: Vec<_> = shares
        .into_iter()
        .map(|share| {
            let coordinator = coordinator.clone();
            let barrier = Arc::clone(&barrier);
            let (reports, batch) = (args.reports, args.batch);
            thread::spawn(move || -> anyhow::Result<()> {
                barrier.wait();
                let endpoint = coordinator.endpoint();
                let mut sent = 0u64;
                let mut cursor = share.iter().cycle();
                if batch == 1 {
                    for (provider_id, location) in cursor.by_ref().take(reports as usize) {
                        endpoint
                            .send(ReportActiveInstance {
                                provider_id: *provider_id,
                                location: *location,
                            })
                            .map_err(|error| anyhow::anyhow!("{error}"))?;
                    }
                } else {
                    while sent < reports {
                        let count = (reports - sent).min(batch as u64) as usize;
                        let messages: Vec<_> = cursor
                            .by_ref()
                            .take(count)
                            .map(|(provider_id, location)| ReportActiveInstance {
                                provider_id: *provider_id,
                                location: *location,
                            })
                            .collect();
                        endpoint
                            .send_batch(messages)
                            .map_err(|error| anyhow::anyhow!("{error}"))?;
                        sent += count as u64;
                    }
                }
                // An ask is a barrier for this thread's earlier one-way reports.
                endpoint.ask(GetCounters).wait()?;
                Ok(())
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for handle in handles {
        handle.join().map_err(|_| anyhow::anyhow!("reporter panicked"))??;
    }
    let seconds = start.elapsed().as_secs_f64();
    let messages = args.reports * producers as u64;
    let handled = coordinator.counters()?.reports - before;
    anyhow::ensure!(handled == messages, "{handled} of {messages} reports handled");

    let baseline = mutex_map_report(args, stores);
    Ok(Figure::new("state-store/report", messages, seconds)
        .with_baseline("Mutex<HashMap> insert", baseline)
        .with("state_machine_msgs_per_sec", state_machine_report(args, stores)?)
        .with("producers", producers as u64)
        .with("stores", stores.len() as u64)
        .with("executors", args.executors as u64)
        .with("batch", args.batch as u64)
        .with(
            "spark_msgs_per_sec",
            if producers >= 2 { SPARK_PIPELINED_2_PER_SEC } else { SPARK_PIPELINED_1_PER_SEC },
        )
        .with("spark_note", "Spark 4.3 report asks, pipelined (it has no one-way report)"))
}

/// The same reports applied to a bare state machine on this thread: the coordinator's own
/// share of the per-message cost, without the bus.
fn state_machine_report(args: &StateStoreArgs, stores: &[Store]) -> anyhow::Result<f64> {
    let mut coordinator = StateStoreCoordinator::new(StateStoreCoordinatorConfig::default())?;
    for (id, location) in stores {
        coordinator.report_active_instance(*id, *location)?;
    }
    let count = args.reports.max(1);
    let start = Instant::now();
    for (id, location) in stores.iter().cycle().take(count as usize) {
        coordinator.report_active_instance(std::hint::black_box(*id), *location)?;
    }
    Ok(count as f64 / start.elapsed().as_secs_f64())
}

/// The same reports as inserts into one shared `Mutex<HashMap>`, from as many threads.
fn mutex_map_report(args: &StateStoreArgs, stores: &[Store]) -> f64 {
    let map: Arc<Mutex<HashMap<StateStoreProviderId, ExecutorCacheTaskLocation>>> =
        Arc::new(Mutex::new(HashMap::with_capacity(stores.len())));
    let producers = args.producers;
    // Fewer operations than ours: the baseline is slower and only its rate matters.
    let per_producer = (args.reports / 4).max(1);
    let barrier = Arc::new(Barrier::new(producers + 1));
    let handles: Vec<_> = (0..producers)
        .map(|producer| {
            let share: Vec<Store> =
                stores.iter().skip(producer).step_by(producers).copied().collect();
            let map = Arc::clone(&map);
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                barrier.wait();
                for (id, location) in share.iter().cycle().take(per_producer as usize) {
                    map.lock().expect("not poisoned").insert(*id, *location);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for handle in handles {
        handle.join().expect("baseline thread");
    }
    (per_producer * producers as u64) as f64 / start.elapsed().as_secs_f64()
}

/// The baseline server for asks: one thread owning a `HashMap`, asked over a crossbeam channel
/// with a fresh one-slot reply channel per ask.
enum BaselineAsk {
    Verify(StateStoreProviderId, ExecutorCacheTaskLocation, crossbeam_channel::Sender<bool>),
    Location(StateStoreProviderId, crossbeam_channel::Sender<Option<String>>),
}

struct BaselineServer {
    requests: crossbeam_channel::Sender<BaselineAsk>,
    thread: Option<thread::JoinHandle<()>>,
}

impl BaselineServer {
    fn start(stores: &[Store]) -> Self {
        let map: HashMap<_, _> = stores.iter().copied().collect();
        let (requests, inbox) = crossbeam_channel::bounded::<BaselineAsk>(4096);
        let thread = thread::spawn(move || {
            for ask in inbox {
                match ask {
                    BaselineAsk::Verify(id, location, reply) => {
                        let active = map
                            .get(&id)
                            .is_some_and(|found| found.executor_id == location.executor_id);
                        let _ = reply.send(active);
                    }
                    BaselineAsk::Location(id, reply) => {
                        let _ = reply.send(map.get(&id).map(ToString::to_string));
                    }
                }
            }
        });
        Self { requests, thread: Some(thread) }
    }

    fn location(&self, store: &Store) -> crossbeam_channel::Receiver<Option<String>> {
        let (reply, receiver) = crossbeam_channel::bounded(1);
        self.requests.send(BaselineAsk::Location(store.0, reply)).expect("baseline server alive");
        receiver
    }

    fn verify(&self, store: &Store) -> crossbeam_channel::Receiver<bool> {
        let (reply, receiver) = crossbeam_channel::bounded(1);
        self.requests
            .send(BaselineAsk::Verify(store.0, store.1, reply))
            .expect("baseline server alive");
        receiver
    }
}

impl Drop for BaselineServer {
    fn drop(&mut self) {
        let (closed, _) = crossbeam_channel::bounded(1);
        self.requests = closed;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn histogram() -> Histogram<u64> {
    crate::report::latency_histogram()
}

fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    crate::report::record_latency(histogram, (elapsed.as_nanos() as u64).max(1));
}

/// Registers every store and waits until the coordinator has them.
fn register(coordinator: &StateStoreCoordinatorRef, stores: &[Store]) -> anyhow::Result<()> {
    for chunk in stores.chunks(4096) {
        let messages = chunk
            .iter()
            .map(|(provider_id, location)| ReportActiveInstance {
                provider_id: *provider_id,
                location: *location,
            })
            .collect();
        coordinator.endpoint().send_batch(messages).map_err(|error| anyhow::anyhow!("{error}"))?;
    }
    coordinator.counters()?;
    Ok(())
}

fn sync_asks<T>(
    count: u64,
    stores: &[Store],
    mut ask: impl FnMut(&Store) -> anyhow::Result<T>,
    mut check: impl FnMut(&Store, T) -> bool,
) -> anyhow::Result<(f64, Histogram<u64>)> {
    let mut latencies = histogram();
    // Warm up the caches and the endpoint's spin.
    for store in stores.iter().cycle().take(1_000) {
        ask(store)?;
    }
    let start = Instant::now();
    for store in stores.iter().cycle().take(count as usize) {
        let asked = Instant::now();
        let answer = ask(store)?;
        record(&mut latencies, asked.elapsed());
        anyhow::ensure!(check(store, answer), "wrong answer for {}", store.0);
    }
    Ok((start.elapsed().as_secs_f64(), latencies))
}

fn verify(
    args: &StateStoreArgs,
    coordinator: &StateStoreCoordinatorRef,
    stores: &[Store],
) -> anyhow::Result<Figure> {
    register(coordinator, stores)?;
    let endpoint = coordinator.endpoint();
    let (seconds, latencies) = sync_asks(
        args.asks,
        stores,
        |(provider_id, location)| {
            Ok(endpoint
                .ask(VerifyIfInstanceActive {
                    provider_id: *provider_id,
                    executor_id: location.executor_id,
                })
                .wait()?)
        },
        |_, active| active,
    )?;
    let server = BaselineServer::start(stores);
    let baseline_count = (args.asks / 2).max(1);
    let (baseline_seconds, _) = sync_asks(
        baseline_count,
        stores,
        |store| Ok(server.verify(store).recv()?),
        |_, active| active,
    )?;
    drop(server);
    Ok(Figure::new("state-store/verify", args.asks, seconds)
        .with_latency(Percentiles::from_histogram(&latencies))
        .with_baseline(
            "crossbeam channel + HashMap thread",
            baseline_count as f64 / baseline_seconds,
        )
        .with("stores", stores.len() as u64)
        .with("spark_msgs_per_sec", SPARK_SYNC_ASKS_PER_SEC)
        .with("spark_p50_ns", SPARK_SYNC_P50_NS)
        .with("spark_p99_ns", SPARK_SYNC_P99_NS))
}

fn verify_pipelined(
    args: &StateStoreArgs,
    coordinator: &StateStoreCoordinatorRef,
    stores: &[Store],
) -> anyhow::Result<Figure> {
    let endpoint = coordinator.endpoint();
    let mut latencies = histogram();
    let mut pending = VecDeque::with_capacity(args.in_flight);
    let start = Instant::now();
    for (provider_id, location) in stores.iter().cycle().take(args.asks as usize) {
        if pending.len() == args.in_flight {
            let (asked, reply): (Instant, coordbus::Reply<bool>) =
                pending.pop_front().expect("in flight");
            anyhow::ensure!(reply.wait()?, "store not active");
            record(&mut latencies, asked.elapsed());
        }
        // Timed from before the ask, as the one-at-a-time asks are: the enqueue counts.
        let asked = Instant::now();
        let reply = endpoint.ask(VerifyIfInstanceActive {
            provider_id: *provider_id,
            executor_id: location.executor_id,
        });
        pending.push_back((asked, reply));
    }
    for (asked, reply) in pending {
        anyhow::ensure!(reply.wait()?, "store not active");
        record(&mut latencies, asked.elapsed());
    }
    let seconds = start.elapsed().as_secs_f64();

    let server = BaselineServer::start(stores);
    let baseline_start = Instant::now();
    let baseline_count = (args.asks / 2).max(1);
    let mut baseline_pending = VecDeque::with_capacity(args.in_flight);
    for store in stores.iter().cycle().take(baseline_count as usize) {
        if baseline_pending.len() == args.in_flight {
            let receiver: crossbeam_channel::Receiver<bool> =
                baseline_pending.pop_front().expect("in flight");
            anyhow::ensure!(receiver.recv()?, "baseline store not active");
        }
        baseline_pending.push_back(server.verify(store));
    }
    for receiver in baseline_pending {
        anyhow::ensure!(receiver.recv()?, "baseline store not active");
    }
    let baseline_rate = baseline_count as f64 / baseline_start.elapsed().as_secs_f64();
    drop(server);
    Ok(Figure::new("state-store/verify-pipelined", args.asks, seconds)
        .with_latency(Percentiles::from_histogram(&latencies))
        .with_baseline("crossbeam channel + HashMap thread", baseline_rate)
        .with("in_flight", args.in_flight as u64)
        .with("spark_msgs_per_sec", SPARK_PIPELINED_1_PER_SEC)
        .with("spark_note", "Spark 4.3 pipelined report asks, 1 sender"))
}

fn location(
    args: &StateStoreArgs,
    coordinator: &StateStoreCoordinatorRef,
    stores: &[Store],
) -> anyhow::Result<Figure> {
    let endpoint = coordinator.endpoint();
    let (seconds, latencies) = sync_asks(
        args.asks,
        stores,
        |(provider_id, _)| Ok(endpoint.ask(GetLocation { provider_id: *provider_id }).wait()?),
        |(_, location), answer| answer.is_some_and(|text| text == location.to_string()),
    )?;
    let server = BaselineServer::start(stores);
    let baseline_count = (args.asks / 2).max(1);
    let (baseline_seconds, _) = sync_asks(
        baseline_count,
        stores,
        |store| Ok(server.location(store).recv()?),
        |_, answer| answer.is_some(),
    )?;
    drop(server);
    Ok(Figure::new("state-store/location", args.asks, seconds)
        .with_latency(Percentiles::from_histogram(&latencies))
        .with_baseline(
            "crossbeam channel + HashMap thread",
            baseline_count as f64 / baseline_seconds,
        )
        .with("stores", stores.len() as u64)
        .with("spark_msgs_per_sec", SPARK_SYNC_ASKS_PER_SEC)
        .with("spark_p50_ns", SPARK_SYNC_P50_NS))
}

fn deactivate(
    args: &StateStoreArgs,
    coordinator: &StateStoreCoordinatorRef,
    other_stores: &[Store],
) -> anyhow::Result<Figure> {
    let rounds = args.deactivate_rounds;
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let run_id = Uuid::from_u128(0xdead_0000 + round as u128);
        let stores = store_set(args.deactivate_stores, args.executors, run_id, "/checkpoint/gone");
        register(coordinator, &stores)?;
        let before = coordinator.counters()?.deactivated_instances;
        let start = Instant::now();
        anyhow::ensure!(coordinator.deactivate_instances(run_id)?, "deactivation refused");
        times.push(start.elapsed().as_secs_f64());
        let removed = coordinator.counters()?.deactivated_instances - before;
        anyhow::ensure!(
            removed == stores.len() as u64,
            "round {round} removed {removed} of its {} stores",
            stores.len()
        );
    }
    times.sort_by(f64::total_cmp);
    let seconds = times[times.len() / 2];

    // Spark's way: one map of every store, scanned for the run's keys, then removed.
    let run_id = Uuid::from_u128(0xdead_ffff);
    let mut all: HashMap<_, _> = other_stores.iter().copied().collect();
    all.extend(store_set(args.deactivate_stores, args.executors, run_id, "/checkpoint/gone"));
    let start = Instant::now();
    let doomed: Vec<_> = all.keys().filter(|id| id.query_run_id == run_id).copied().collect();
    for id in &doomed {
        all.remove(id);
    }
    let baseline_seconds = start.elapsed().as_secs_f64();
    Ok(Figure::new("state-store/deactivate", args.deactivate_stores as u64, seconds)
        .with_baseline(
            "scan of one HashMap (Spark's method)",
            args.deactivate_stores as f64 / baseline_seconds,
        )
        .with("baseline_seconds", baseline_seconds)
        .with("other_stores", other_stores.len() as u64)
        .with("rounds", rounds as u64)
        .with("min_seconds", times[0])
        .with("max_seconds", times[times.len() - 1])
        .with("spark_seconds", SPARK_DEACTIVATE_100K_SECONDS))
}
