//! Workloads `bus` (one-way throughput) and `ask` (request-reply latency and throughput).
//!
//! `bus`: `--producers N` threads send `--messages M` 16-byte messages in total into a no-op
//! endpoint, with `send` (`--batch 1`) or `send_batch` of B. The clock stops when every
//! producer's closing ask (a barrier for its own sends) has returned. Baselines run the same
//! producers and message count right after ours, in the same process:
//! `crossbeam` (`crossbeam_channel::bounded` into one consumer thread) and `ring` (one `rtrb`
//! SPSC ring per producer with chunked, batched publication: the ceiling, with no endpoint and
//! no dispatch).
//!
//! `ask`: one thread keeps `--in-flight K` asks outstanding against an endpoint that answers at
//! once, measuring each ask's round trip; the baseline is request-reply over crossbeam channels
//! with a fresh one-shot channel per ask.

use std::{
    collections::VecDeque,
    sync::{Arc, Barrier},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use clap::builder::RangedU64ValueParser;
use coordbus::{Ask, Bus, Context, Endpoint, EndpointRef, HandlerError, Idle, Pinning, Replier};
use hdrhistogram::Histogram;

use crate::{
    limits::{
        INBOX_CAPACITY, MAX_BATCH, MAX_INBOX_LANES, MAX_INBOX_SHARDS, MAX_IN_FLIGHT, MAX_THREADS,
    },
    report::{latency_histogram, record_latency, Figure, Percentiles},
    shares::share,
};

/// A 16-byte message.
#[derive(Debug, Clone, Copy)]
pub struct Payload([u64; 2]);

/// Sums what it receives (so the work cannot be optimised away) and answers asks at once.
#[derive(Default)]
struct NoOp {
    sum: u64,
}

/// Ask for the running sum.
struct Sum;

impl Ask<NoOp> for Sum {
    type Reply = u64;
    fn into_request(self, replier: Replier<u64>) -> Replier<u64> {
        replier
    }
}

impl Endpoint for NoOp {
    type Message = Payload;
    type Request = Replier<u64>;

    #[inline]
    fn handle(&mut self, Payload(words): Payload, _: &Context<Self>) -> Result<(), HandlerError> {
        self.sum = self.sum.wrapping_add(words[0]);
        Ok(())
    }

    fn handle_request(
        &mut self,
        reply: Replier<u64>,
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        reply.reply(self.sum);
        Ok(())
    }
}

/// Baselines of the `bus` workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BusBaseline {
    /// No baseline.
    None,
    /// `crossbeam_channel::bounded` with the same producers.
    Crossbeam,
    /// One `rtrb` SPSC ring per producer, batched publication (the ceiling).
    Ring,
}

/// Flags of `coordbus-load bus`.
#[derive(clap::Args, Debug, Clone)]
pub struct BusArgs {
    /// Producer threads (1 ..= 1024).
    #[arg(
        long,
        default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_THREADS)
    )]
    pub producers: usize,
    /// Messages per `send_batch` call (1 = plain `send`; at most 1048576, a vector of that
    /// many messages is built per call).
    #[arg(
        long,
        default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH)
    )]
    pub batch: usize,
    /// Messages in total (over all producers; at least one per producer).
    #[arg(long, default_value_t = 100_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub messages: u64,
    /// Baseline to run on the same workload right after ours.
    #[arg(long, value_enum, default_value_t = BusBaseline::Crossbeam)]
    pub baseline: BusBaseline,
    /// Inbox rings per endpoint (1 ..= 1024, the bus's limit).
    #[arg(
        long,
        default_value_t = 4,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_INBOX_SHARDS)
    )]
    pub shards: usize,
    /// Single-producer lanes per inbox (0: every producer on the shared rings; at most 1024,
    /// the bus's limit).
    #[arg(
        long,
        default_value_t = coordbus::queue::DEFAULT_LANES,
        value_parser = RangedU64ValueParser::<usize>::new().range(0..=MAX_INBOX_LANES)
    )]
    pub lanes: usize,
    /// Slots per inbox ring (and the capacity of the baselines' queues; 2 ..= 2^24, the bus's
    /// limit).
    #[arg(
        long,
        default_value_t = 1 << 14,
        value_parser = RangedU64ValueParser::<usize>::new().range(INBOX_CAPACITY)
    )]
    pub capacity: usize,
    /// Pin the endpoint thread (round robin over cores).
    #[arg(long)]
    pub pin: bool,
    /// How long the idle endpoint spins before parking, in microseconds (at most 10 000, the
    /// bus's `Idle::MAX_SPIN`).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub spin_us: u64,
}

/// The quick version for the no-argument run.
pub fn quick_bus(producers: usize, batch: usize, baseline: BusBaseline) -> BusArgs {
    BusArgs {
        producers,
        batch,
        messages: if batch > 1 { 100_000_000 } else { 20_000_000 },
        baseline,
        shards: 4,
        lanes: coordbus::queue::DEFAULT_LANES,
        capacity: 1 << 14,
        pin: false,
        spin_us: 50,
    }
}

fn bus_for(
    lanes: usize,
    shards: usize,
    capacity: usize,
    pin: bool,
    spin: Duration,
) -> anyhow::Result<Bus> {
    Ok(Bus::builder()
        .inbox_lanes(lanes)
        .inbox_shards(shards)
        .inbox_capacity(capacity)
        .pinning(if pin { Pinning::RoundRobin } else { Pinning::Off })
        .idle(Idle::SpinThenPark { spin })
        .build()?)
}

/// Runs the `bus` workload.
pub fn run_bus(args: &BusArgs) -> anyhow::Result<Vec<Figure>> {
    if args.producers == 0 || args.batch == 0 || args.messages == 0 {
        bail!("--producers, --batch and --messages must be at least 1");
    }
    if args.messages < args.producers as u64 {
        bail!(
            "--messages {} is less than --producers {}: every producer sends at least one message",
            args.messages,
            args.producers
        );
    }
    let slot = std::mem::size_of::<Payload>() as u128;
    crate::limits::check_producer_batches(args.producers, args.batch, slot as usize)?;
    if args.baseline == BusBaseline::Ring {
        crate::limits::check_planned_bytes(
            &format!(
                "--baseline ring: --producers {} x --capacity {}",
                args.producers, args.capacity
            ),
            args.producers as u128 * args.capacity as u128 * slot,
        )?;
    }
    // The probes bracket ours and the baseline's run, nothing before them.
    crate::machine::with_round_trips(|| run_bus_and_baseline(args)).map(|figure| vec![figure])
}

/// The measured runs of the `bus` workload: ours, then the baseline's.
fn run_bus_and_baseline(args: &BusArgs) -> anyhow::Result<Figure> {
    let total = args.messages;
    let (ours, stats) = measure_bus(args)?;
    let mut figure = Figure::new("bus", total, ours.as_secs_f64())
        .with_endpoint_stats("endpoint_stats", &stats)
        .with("producers", args.producers)
        .with("batch", args.batch)
        .with("message_bytes", std::mem::size_of::<Payload>());
    let baseline = match args.baseline {
        BusBaseline::None => None,
        BusBaseline::Crossbeam => Some(("crossbeam", measure_crossbeam(args))),
        BusBaseline::Ring => Some(("ring", measure_ring(args))),
    };
    if let Some((name, elapsed)) = baseline {
        figure = figure.with_baseline(name, total as f64 / elapsed.as_secs_f64());
    }
    Ok(figure)
}

fn measure_bus(args: &BusArgs) -> anyhow::Result<(Duration, coordbus::EndpointStats)> {
    let bus = bus_for(
        args.lanes,
        args.shards,
        args.capacity,
        args.pin,
        Duration::from_micros(args.spin_us),
    )?;
    let endpoint = bus.register("load-bus", NoOp::default())?;
    let start = Arc::new(Barrier::new(args.producers + 1));
    let producers: Vec<_> = (0..args.producers)
        .map(|producer| {
            let endpoint = endpoint.clone();
            let start = Arc::clone(&start);
            let batch = args.batch;
            let per_producer = share(args.messages, args.producers, producer);
            std::thread::spawn(move || -> anyhow::Result<()> {
                start.wait();
                produce(&endpoint, per_producer, batch)?;
                endpoint.ask(Sum).wait()?; // barrier: all of this producer's messages handled
                Ok(())
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    for producer in producers {
        producer.join().map_err(|_| anyhow::anyhow!("producer panicked"))??;
    }
    let elapsed = began.elapsed();
    let stats = endpoint.stats();
    bus.shutdown()?;
    Ok((elapsed, stats))
}

fn produce(endpoint: &EndpointRef<NoOp>, messages: u64, batch: usize) -> anyhow::Result<()> {
    if batch == 1 {
        for index in 0..messages {
            endpoint.send(Payload([index, 0])).context("send")?;
        }
        return Ok(());
    }
    let mut sent = 0;
    while sent < messages {
        let len = (messages - sent).min(batch as u64);
        let chunk: Vec<Payload> = (sent..sent + len).map(|index| Payload([index, 0])).collect();
        endpoint.send_batch(chunk).map_err(|error| anyhow::anyhow!("send_batch: {error}"))?;
        sent += len;
    }
    Ok(())
}

fn measure_crossbeam(args: &BusArgs) -> Duration {
    let (sender, receiver) = crossbeam_channel::bounded::<Payload>(args.capacity);
    let total = args.messages;
    let start = Arc::new(Barrier::new(args.producers + 2));
    let consumer = {
        let start = Arc::clone(&start);
        std::thread::spawn(move || {
            start.wait();
            let mut sum = 0u64;
            for _ in 0..total {
                let Payload(words) = receiver.recv().expect("producers outlive the consumer");
                sum = sum.wrapping_add(words[0]);
            }
            sum
        })
    };
    let producers: Vec<_> = (0..args.producers)
        .map(|producer| {
            let sender = sender.clone();
            let start = Arc::clone(&start);
            let per_producer = share(total, args.producers, producer);
            std::thread::spawn(move || {
                start.wait();
                for index in 0..per_producer {
                    sender.send(Payload([index, 0])).expect("consumer alive");
                }
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    for producer in producers {
        producer.join().expect("baseline producer");
    }
    std::hint::black_box(consumer.join().expect("baseline consumer"));
    began.elapsed()
}

fn measure_ring(args: &BusArgs) -> Duration {
    let batch = args.batch.min(args.capacity);
    let (producers, mut consumers): (Vec<_>, Vec<_>) =
        (0..args.producers).map(|_| rtrb::RingBuffer::<Payload>::new(args.capacity)).unzip();
    let total = args.messages;
    let start = Arc::new(Barrier::new(args.producers + 2));
    let consumer = {
        let start = Arc::clone(&start);
        std::thread::spawn(move || {
            start.wait();
            let mut sum = 0u64;
            let mut received = 0u64;
            while received < total {
                for consumer in &mut consumers {
                    let ready = consumer.slots();
                    if ready == 0 {
                        continue;
                    }
                    let chunk = consumer.read_chunk(ready).expect("slots are ready");
                    for Payload(words) in chunk {
                        sum = sum.wrapping_add(words[0]);
                    }
                    received += ready as u64;
                }
                std::hint::spin_loop();
            }
            sum
        })
    };
    let threads: Vec<_> = producers
        .into_iter()
        .enumerate()
        .map(|(index, mut producer)| {
            let start = Arc::clone(&start);
            let per_producer = share(total, args.producers, index);
            std::thread::spawn(move || {
                start.wait();
                let mut sent = 0u64;
                while sent < per_producer {
                    let want = (per_producer - sent).min(batch as u64) as usize;
                    match producer.write_chunk_uninit(want) {
                        Ok(chunk) => {
                            let written =
                                chunk.fill_from_iter((sent..).map(|index| Payload([index, 0])));
                            sent += written as u64;
                        }
                        Err(_) => std::hint::spin_loop(),
                    }
                }
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    for thread in threads {
        thread.join().expect("ring producer");
    }
    std::hint::black_box(consumer.join().expect("ring consumer"));
    began.elapsed()
}

/// Flags of `coordbus-load ask`.
#[derive(clap::Args, Debug, Clone)]
pub struct AskArgs {
    /// Asks kept outstanding at once (1 = synchronous round trips; at most 1048576, a queue of
    /// that many replies is allocated).
    #[arg(
        long,
        default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_IN_FLIGHT)
    )]
    pub in_flight: usize,
    /// Asks in total (at least 1).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub messages: u64,
    /// Run the crossbeam request-reply baseline (fresh one-shot channel per ask) too.
    #[arg(long, value_enum, default_value_t = AskBaseline::Crossbeam)]
    pub baseline: AskBaseline,
    /// Pin the endpoint thread (round robin over cores).
    #[arg(long)]
    pub pin: bool,
    /// How long the idle endpoint spins before parking, in microseconds (at most 10 000, the
    /// bus's `Idle::MAX_SPIN`; the default, that most, keeps it busy-polling through the run,
    /// whose gaps between asks are far shorter).
    #[arg(
        long,
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(0..=10_000)
    )]
    pub spin_us: u64,
}

/// Baselines of the `ask` workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AskBaseline {
    /// No baseline.
    None,
    /// Request-reply over crossbeam channels, a fresh bounded(1) reply channel per ask.
    Crossbeam,
}

/// The quick version for the no-argument run.
pub fn quick_ask(in_flight: usize) -> AskArgs {
    AskArgs {
        in_flight,
        messages: 500_000,
        baseline: AskBaseline::Crossbeam,
        pin: false,
        spin_us: 10_000,
    }
}

/// Runs the `ask` workload.
pub fn run_ask(args: &AskArgs) -> anyhow::Result<Vec<Figure>> {
    if args.in_flight == 0 || args.messages == 0 {
        bail!("--in-flight and --messages must be at least 1");
    }
    // The probes bracket ours and the baseline's run, nothing before them.
    crate::machine::with_round_trips(|| run_ask_and_baseline(args)).map(|figure| vec![figure])
}

/// The measured runs of the `ask` workload: ours, then the baseline's.
fn run_ask_and_baseline(args: &AskArgs) -> anyhow::Result<Figure> {
    let bus = bus_for(
        coordbus::queue::DEFAULT_LANES,
        1,
        1 << 12,
        args.pin,
        Duration::from_micros(args.spin_us),
    )?;
    let endpoint = bus.register("load-ask", NoOp::default())?;
    let mut histogram = latency_histogram();
    let sample_every = latency_sample_every(args.in_flight);
    let mut record = |asked_at: Option<Instant>| {
        if let Some(asked_at) = asked_at {
            record_latency(&mut histogram, asked_at.elapsed().as_nanos() as u64);
        }
    };
    let began = Instant::now();
    let mut outstanding = VecDeque::with_capacity(args.in_flight);
    for asked in 0..args.messages {
        if outstanding.len() == args.in_flight {
            let (asked_at, reply): (Option<Instant>, coordbus::Reply<u64>) =
                outstanding.pop_front().expect("in flight");
            reply.wait()?;
            record(asked_at);
        }
        let asked_at = asked.is_multiple_of(sample_every).then(Instant::now);
        outstanding.push_back((asked_at, endpoint.ask(Sum)));
    }
    for (asked_at, reply) in outstanding {
        reply.wait()?;
        record(asked_at);
    }
    let elapsed = began.elapsed();
    let stats = endpoint.stats();
    bus.shutdown()?;
    let mut figure = Figure::new("ask", args.messages, elapsed.as_secs_f64())
        .with_latency(Percentiles::from_histogram(&histogram))
        .with_endpoint_stats("endpoint_stats", &stats)
        .with("in_flight", args.in_flight)
        .with("latency", latency_description(sample_every));
    if args.baseline == AskBaseline::Crossbeam {
        let (baseline_elapsed, baseline_histogram) = measure_crossbeam_ask(args);
        figure = figure
            .with_baseline("crossbeam", args.messages as f64 / baseline_elapsed.as_secs_f64())
            .with("baseline_p50_ns", baseline_histogram.value_at_quantile(0.5))
            .with("baseline_p99_ns", baseline_histogram.value_at_quantile(0.99));
    }
    Ok(figure)
}

/// Asks timed per asks sent: every ask with one in flight (the round trip is the figure),
/// one in [`LATENCY_SAMPLE_EVERY`] with several (two clock reads cost ~80 ns here, a quarter
/// of the asking thread's time per ask at 64 in flight). Ours and the baseline alike.
fn latency_sample_every(in_flight: usize) -> u64 {
    if in_flight > 1 {
        LATENCY_SAMPLE_EVERY
    } else {
        1
    }
}

/// Asks timed, one in this many, when several are in flight.
const LATENCY_SAMPLE_EVERY: u64 = 16;

fn latency_description(sample_every: u64) -> String {
    if sample_every == 1 {
        "ask to reply, every ask".to_owned()
    } else {
        format!("ask to reply, 1 ask in {sample_every}")
    }
}

fn measure_crossbeam_ask(args: &AskArgs) -> (Duration, Histogram<u64>) {
    type Request = crossbeam_channel::Sender<u64>;
    let (requests, inbox) = crossbeam_channel::bounded::<Request>(1 << 12);
    let server = std::thread::spawn(move || {
        for (answered, reply) in (0u64..).zip(inbox) {
            let _ = reply.send(answered);
        }
    });
    let mut histogram = latency_histogram();
    let sample_every = latency_sample_every(args.in_flight);
    let began = Instant::now();
    let mut outstanding = VecDeque::with_capacity(args.in_flight);
    let mut wait = |(asked_at, receiver): (Option<Instant>, crossbeam_channel::Receiver<u64>)| {
        receiver.recv().expect("server answers");
        if let Some(asked_at) = asked_at {
            record_latency(&mut histogram, asked_at.elapsed().as_nanos() as u64);
        }
    };
    for asked in 0..args.messages {
        if outstanding.len() == args.in_flight {
            wait(outstanding.pop_front().expect("in flight"));
        }
        let (reply, receiver) = crossbeam_channel::bounded(1);
        let asked_at = asked.is_multiple_of(sample_every).then(Instant::now);
        requests.send(reply).expect("server alive");
        outstanding.push_back((asked_at, receiver));
    }
    outstanding.into_iter().for_each(&mut wait);
    let elapsed = began.elapsed();
    drop(requests);
    server.join().expect("baseline server");
    (elapsed, histogram)
}
