//! Queue and bus benchmarks, each with its baselines in the same group and the same run.
//!
//! * `queue/spsc`, `queue/mpsc_2p`: our `ShardedQueue` against `crossbeam_queue::ArrayQueue`,
//!   `crossbeam_channel::bounded` and `std::sync::mpsc::sync_channel`, 16-byte messages, one
//!   consumer thread draining, producers pushing `MESSAGES` in total.
//! * `bus/send`: through a registered endpoint (dispatch included), one by one and in batches
//!   (`coordbus_endpoint/{64,256}`).
//! * `bus/ask`: one synchronous request-reply round trip against an endpoint that busy-polls,
//!   and a sliding window of 64 asks in flight (per ask); baseline: crossbeam channels with a
//!   fresh bounded(1) reply channel per request.
//!
//! Multi-threaded cases use `iter_custom` with a barrier and explicit start/stop instants.
//! Run: `cargo bench --bench queue` (add `-- --quick` for a short smoke run).

use std::{
    sync::{Arc, Barrier},
    time::{Duration, Instant},
};

use coordbus::{
    queue::{QueueError, ShardedQueue},
    Ask, Bus, Context, Endpoint, HandlerError, Idle, Replier,
};
use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MESSAGES: u64 = 1 << 20;
const CAPACITY: usize = 1 << 14;

type Message = [u64; 2];

/// A queue contender: a push that spins while full, and a consumer loop.
trait Contender: Send + Sync + 'static {
    fn push(&self, message: Message);
    /// Consumes exactly `count` messages; returns their checksum.
    fn consume(&self, count: u64) -> u64;
}

impl Contender for ShardedQueue<Message> {
    fn push(&self, message: Message) {
        let mut message = message;
        loop {
            match self.try_push(message) {
                Ok(()) => return,
                Err(QueueError::Full(back)) => {
                    message = back;
                    std::hint::spin_loop();
                }
                Err(error) => panic!("queue closed during bench: {error:?}"),
            }
        }
    }

    fn consume(&self, count: u64) -> u64 {
        let mut consumer = self.consumer().expect("one consumer per bench queue");
        let (mut received, mut sum) = (0, 0u64);
        while received < count {
            let taken = consumer.drain_round(256, |message| sum = sum.wrapping_add(message[0]));
            received += taken as u64;
            if taken == 0 {
                std::hint::spin_loop();
            }
        }
        sum
    }
}

impl Contender for ArrayQueue<Message> {
    fn push(&self, message: Message) {
        let mut message = message;
        while let Err(back) = ArrayQueue::push(self, message) {
            message = back;
            std::hint::spin_loop();
        }
    }

    fn consume(&self, count: u64) -> u64 {
        let (mut received, mut sum) = (0, 0u64);
        while received < count {
            match self.pop() {
                Some(message) => {
                    sum = sum.wrapping_add(message[0]);
                    received += 1;
                }
                None => std::hint::spin_loop(),
            }
        }
        sum
    }
}

struct CrossbeamChannel(crossbeam_channel::Sender<Message>, crossbeam_channel::Receiver<Message>);

impl Contender for CrossbeamChannel {
    fn push(&self, message: Message) {
        self.0.send(message).expect("receiver alive");
    }

    fn consume(&self, count: u64) -> u64 {
        (0..count).fold(0u64, |sum, _| sum.wrapping_add(self.1.recv().expect("senders alive")[0]))
    }
}

struct StdChannel(
    std::sync::mpsc::SyncSender<Message>,
    std::sync::Mutex<std::sync::mpsc::Receiver<Message>>,
);

impl Contender for StdChannel {
    fn push(&self, message: Message) {
        self.0.send(message).expect("receiver alive");
    }

    fn consume(&self, count: u64) -> u64 {
        let receiver = self.1.lock().expect("one consumer");
        (0..count).fold(0u64, |sum, _| sum.wrapping_add(receiver.recv().expect("senders alive")[0]))
    }
}

/// Time for `producers` threads to push `MESSAGES` in total through a queue (`make()`, called
/// once per iteration, before the timed part) to one consumer.
fn run_contender<Q: Contender>(
    make: impl Fn() -> Arc<Q>,
    producers: u64,
    iterations: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iterations {
        let queue = &make();
        let start = Arc::new(Barrier::new(producers as usize + 2));
        let consumer = {
            let (queue, start) = (Arc::clone(queue), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                queue.consume(MESSAGES / producers * producers)
            })
        };
        let threads: Vec<_> = (0..producers)
            .map(|_| {
                let (queue, start) = (Arc::clone(queue), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    for index in 0..MESSAGES / producers {
                        queue.push([index, 0]);
                    }
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        threads.into_iter().for_each(|thread| thread.join().expect("producer"));
        std::hint::black_box(consumer.join().expect("consumer"));
        total += began.elapsed();
    }
    total
}

fn queue_groups(criterion: &mut Criterion) {
    for producers in [1u64, 2] {
        let name =
            if producers == 1 { "queue/spsc".to_owned() } else { "queue/mpsc_2p".to_owned() };
        let mut group = criterion.benchmark_group(name);
        group.throughput(Throughput::Elements(MESSAGES)).sample_size(10);
        // A fresh queue per iteration, made before the timed part (a queue hands out its one
        // consumer once); each producer thread gets its own lane.
        group.bench_function("coordbus_sharded", |bench| {
            bench.iter_custom(|iterations| {
                let make = || {
                    Arc::new(ShardedQueue::<Message>::new(producers as usize, CAPACITY).unwrap())
                };
                run_contender(make, producers, iterations)
            })
        });
        let array = Arc::new(ArrayQueue::<Message>::new(CAPACITY));
        group.bench_function("crossbeam_array_queue", |bench| {
            bench.iter_custom(|iterations| {
                run_contender(|| Arc::clone(&array), producers, iterations)
            })
        });
        let (sender, receiver) = crossbeam_channel::bounded(CAPACITY);
        let channel = Arc::new(CrossbeamChannel(sender, receiver));
        group.bench_function("crossbeam_channel", |bench| {
            bench.iter_custom(|iterations| {
                run_contender(|| Arc::clone(&channel), producers, iterations)
            })
        });
        let (sender, receiver) = std::sync::mpsc::sync_channel(CAPACITY);
        let std_channel = Arc::new(StdChannel(sender, std::sync::Mutex::new(receiver)));
        group.bench_function("std_mpsc_sync_channel", |bench| {
            bench.iter_custom(|iterations| {
                run_contender(|| Arc::clone(&std_channel), producers, iterations)
            })
        });
        group.finish();
    }
}

/// A no-op endpoint that sums what it gets and answers asks with the sum.
#[derive(Default)]
struct Summer(u64);

struct Sum;
impl Ask<Summer> for Sum {
    type Reply = u64;
    fn into_request(self, replier: Replier<u64>) -> Replier<u64> {
        replier
    }
}

impl Endpoint for Summer {
    type Message = Message;
    type Request = Replier<u64>;
    fn handle(&mut self, message: Message, _: &Context<Self>) -> Result<(), HandlerError> {
        self.0 = self.0.wrapping_add(message[0]);
        Ok(())
    }
    fn handle_request(
        &mut self,
        reply: Replier<u64>,
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        reply.reply(self.0);
        Ok(())
    }
}

/// Asks kept outstanding by the `bus/ask` in-flight cases.
const ASKS_IN_FLIGHT: usize = 64;

fn bus_groups(criterion: &mut Criterion) {
    let bus = Bus::builder()
        .inbox_shards(2)
        .inbox_capacity(CAPACITY)
        .idle(Idle::SpinThenPark { spin: Duration::from_millis(5) })
        .build()
        .expect("valid config");
    let endpoint = bus.register("bench", Summer::default()).expect("fresh bus");

    let mut group = criterion.benchmark_group("bus/send");
    group.throughput(Throughput::Elements(MESSAGES)).sample_size(10);
    for batch in [1usize, 64, 256] {
        group.bench_with_input(
            BenchmarkId::new("coordbus_endpoint", batch),
            &batch,
            |bench, &batch| {
                bench.iter_custom(|iterations| {
                    let began = Instant::now();
                    for _ in 0..iterations {
                        if batch == 1 {
                            for index in 0..MESSAGES {
                                endpoint.send([index, 0]).expect("running");
                            }
                        } else {
                            for chunk in 0..MESSAGES / batch as u64 {
                                let start = chunk * batch as u64;
                                let messages =
                                    (start..start + batch as u64).map(|index| [index, 0]);
                                endpoint.send_batch(messages.collect()).expect("running");
                            }
                        }
                        endpoint.ask(Sum).wait().expect("barrier");
                    }
                    began.elapsed()
                })
            },
        );
    }
    // The same batches made as the inbox takes them (`send_iter`): no vector in between.
    for batch in [64u32, 256] {
        group.bench_with_input(
            BenchmarkId::new("coordbus_endpoint_send_iter", batch),
            &batch,
            |bench, &batch| {
                bench.iter_custom(|iterations| {
                    let began = Instant::now();
                    for _ in 0..iterations {
                        for chunk in 0..MESSAGES / u64::from(batch) {
                            let start = chunk * u64::from(batch);
                            let messages = (0..batch).map(|offset| [start + u64::from(offset), 0]);
                            endpoint.send_iter(messages).expect("running");
                        }
                        endpoint.ask(Sum).wait().expect("barrier");
                    }
                    began.elapsed()
                })
            },
        );
    }
    let (sender, receiver) = crossbeam_channel::bounded(CAPACITY);
    let channel = Arc::new(CrossbeamChannel(sender, receiver));
    group.bench_function("crossbeam_channel", |bench| {
        bench.iter_custom(|iterations| run_contender(|| Arc::clone(&channel), 1, iterations))
    });
    group.finish();

    let mut group = criterion.benchmark_group("bus/ask");
    group.throughput(Throughput::Elements(1));
    group.bench_function("coordbus_round_trip", |bench| {
        bench.iter(|| endpoint.ask(Sum).wait().expect("reply"))
    });
    let (requests, inbox) = crossbeam_channel::bounded::<crossbeam_channel::Sender<u64>>(64);
    let server = std::thread::spawn(move || {
        for reply in inbox {
            let _ = reply.send(0);
        }
    });
    group.bench_function("crossbeam_oneshot_round_trip", |bench| {
        bench.iter(|| {
            let (reply, answer) = crossbeam_channel::bounded(1);
            requests.send(reply).expect("server alive");
            answer.recv().expect("server answers")
        })
    });
    // Many asks in flight: a sliding window of ASKS_IN_FLIGHT outstanding asks, one element
    // per ask (the "asks/s with many asks in flight").
    group.bench_function("coordbus_64_in_flight", |bench| {
        bench.iter_custom(|iterations| {
            let mut outstanding = std::collections::VecDeque::with_capacity(ASKS_IN_FLIGHT);
            let began = Instant::now();
            for _ in 0..iterations {
                if outstanding.len() == ASKS_IN_FLIGHT {
                    let reply: coordbus::Reply<u64> = outstanding.pop_front().expect("in flight");
                    std::hint::black_box(reply.wait().expect("reply"));
                }
                outstanding.push_back(endpoint.ask(Sum));
            }
            for reply in outstanding {
                std::hint::black_box(reply.wait().expect("reply"));
            }
            began.elapsed()
        })
    });
    group.bench_function("crossbeam_oneshot_64_in_flight", |bench| {
        bench.iter_custom(|iterations| {
            let mut outstanding = std::collections::VecDeque::with_capacity(ASKS_IN_FLIGHT);
            let began = Instant::now();
            for _ in 0..iterations {
                if outstanding.len() == ASKS_IN_FLIGHT {
                    let answer: crossbeam_channel::Receiver<u64> =
                        outstanding.pop_front().expect("in flight");
                    std::hint::black_box(answer.recv().expect("server answers"));
                }
                let (reply, answer) = crossbeam_channel::bounded(1);
                requests.send(reply).expect("server alive");
                outstanding.push_back(answer);
            }
            for answer in outstanding {
                std::hint::black_box(answer.recv().expect("server answers"));
            }
            began.elapsed()
        })
    });
    group.finish();
    drop(requests);
    server.join().expect("server");
    bus.shutdown().expect("clean shutdown");
}

/// Criterion's generated entry points (its macros emit undocumented public functions).
#[allow(missing_docs)]
mod entry {
    criterion::criterion_group!(benches, super::queue_groups, super::bus_groups);
}
criterion_main!(entry::benches);
