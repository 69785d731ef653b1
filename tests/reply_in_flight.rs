//! Request-reply with many asks in flight, through the public API.
//!
//! Goal: every ask gets its own reply, exactly once, whether the endpoint answers at once or
//! keeps the `Replier` and answers later from another thread in any order, and whether the
//! asker waits blocking, with a timeout or as a future, or gives up; a reply to an asker that
//! gave up is dropped exactly once and nothing else happens. Method: an endpoint that either
//! answers at once or hands each `Replier` to an answering thread, which answers batches in
//! reverse order; reply values carry the request id (checked by the asker) and count their
//! drops (checked against the number of asks). Every wait is bounded; no sleeps.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use coordbus::{Ask, AskError, Bus, Context, Endpoint, HandlerError, Idle, Replier, Reply};

const WAIT: Duration = Duration::from_secs(30);

fn small_bus() -> Bus {
    Bus::builder()
        .inbox_shards(2)
        .inbox_capacity(1024)
        .idle(Idle::SpinThenPark { spin: Duration::from_micros(20) })
        .ask_timeout(WAIT)
        .build()
        .unwrap()
}

/// A reply value: the request id it answers, and a drop counter.
#[derive(Debug)]
struct Answer {
    id: u64,
    drops: Arc<AtomicUsize>,
}

impl Drop for Answer {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// Answers at once, or passes the replier on to `deferred` (another thread answers it).
struct Answering {
    drops: Arc<AtomicUsize>,
    deferred: Option<crossbeam_channel::Sender<(u64, Replier<Answer>)>>,
}

struct Query(u64);

impl Ask<Answering> for Query {
    type Reply = Answer;
    fn into_request(self, replier: Replier<Answer>) -> (u64, Replier<Answer>) {
        (self.0, replier)
    }
}

impl Endpoint for Answering {
    type Message = ();
    type Request = (u64, Replier<Answer>);

    fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
        Ok(())
    }

    fn handle_request(
        &mut self,
        (id, replier): (u64, Replier<Answer>),
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        match &self.deferred {
            Some(deferred) => deferred.send((id, replier)).map_err(|_| "answerer gone")?,
            None => replier.reply(Answer { id, drops: Arc::clone(&self.drops) }),
        }
        Ok(())
    }
}

/// Answers the repliers it receives in batches of `batch`, each batch in reverse order.
fn answer_in_reverse_batches(
    repliers: crossbeam_channel::Receiver<(u64, Replier<Answer>)>,
    batch: usize,
    drops: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut answered = 0;
        let mut held = Vec::with_capacity(batch);
        // Block for the first request of a batch, then take what else is queued (so no asker
        // waits on a batch that cannot fill), and answer them newest first.
        while let Ok(request) = repliers.recv() {
            held.push(request);
            while held.len() < batch {
                match repliers.try_recv() {
                    Ok(request) => held.push(request),
                    Err(_) => break,
                }
            }
            for (id, replier) in held.drain(..).rev() {
                replier.reply(Answer { id, drops: Arc::clone(&drops) });
                answered += 1;
            }
        }
        answered
    })
}

/// Joins the answering thread once it has finished, failing the test if it has not within
/// `WAIT`: it ends when the endpoint holding its channel's sender is dropped (at the bus's
/// shutdown), so a plain join would wait as long as that never happens.
fn join_answerer(answerer: std::thread::JoinHandle<usize>) -> usize {
    let deadline = Instant::now() + WAIT;
    while !answerer.is_finished() {
        assert!(Instant::now() < deadline, "the answering thread still runs after {WAIT:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    answerer.join().expect("answerer")
}

/// A minimal executor: polls the future, parking the thread between wake-ups.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    use std::task::{Context as TaskContext, Poll, Wake, Waker};
    struct ThreadWaker(std::thread::Thread);
    impl Wake for ThreadWaker {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut task = TaskContext::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    let deadline = Instant::now() + WAIT;
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut task) {
            return output;
        }
        assert!(Instant::now() < deadline, "future not ready within {WAIT:?}");
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// Waits for `reply` in one of three ways, chosen by `id`.
fn wait_any_way(id: u64, reply: Reply<Answer>) -> Result<Answer, AskError> {
    match id % 3 {
        0 => reply.wait(),
        1 => reply.wait_timeout(WAIT),
        _ => block_on(reply),
    }
}

fn keep_in_flight(endpoint: &coordbus::EndpointRef<Answering>, asks: u64, in_flight: usize) {
    let mut outstanding = VecDeque::with_capacity(in_flight);
    let check = |(id, reply): (u64, Reply<Answer>)| {
        let answer = wait_any_way(id, reply).expect("every ask is answered");
        assert_eq!(answer.id, id, "a reply reached the wrong asker");
    };
    for id in 0..asks {
        if outstanding.len() == in_flight {
            check(outstanding.pop_front().expect("in flight"));
        }
        outstanding.push_back((id, endpoint.ask(Query(id))));
    }
    outstanding.into_iter().for_each(check);
}

#[test]
fn asks_answered_at_once_with_64_in_flight_each_reach_their_asker_once() {
    let asks = if cfg!(miri) { 200 } else { 30_000 };
    let drops = Arc::new(AtomicUsize::new(0));
    let bus = small_bus();
    let endpoint =
        bus.register("at-once", Answering { drops: Arc::clone(&drops), deferred: None }).unwrap();
    keep_in_flight(&endpoint, asks, 64);
    bus.shutdown().unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), asks as usize);
}

#[test]
fn repliers_kept_and_answered_later_in_reverse_from_another_thread_reach_their_askers() {
    let asks = if cfg!(miri) { 200 } else { 20_000 };
    let drops = Arc::new(AtomicUsize::new(0));
    let (deferred, repliers) = crossbeam_channel::unbounded();
    let answerer = answer_in_reverse_batches(repliers, 16, Arc::clone(&drops));
    let bus = small_bus();
    let endpoint = bus
        .register("later", Answering { drops: Arc::clone(&drops), deferred: Some(deferred) })
        .unwrap();
    keep_in_flight(&endpoint, asks, 64);
    bus.shutdown().unwrap();
    assert_eq!(join_answerer(answerer), asks as usize);
    assert_eq!(drops.load(Ordering::SeqCst), asks as usize);
}

#[test]
fn abandoned_asks_have_their_late_replies_dropped_once_and_the_endpoint_keeps_serving() {
    let asks: u64 = if cfg!(miri) { 100 } else { 5_000 };
    let drops = Arc::new(AtomicUsize::new(0));
    let (deferred, repliers) = crossbeam_channel::unbounded();
    let answerer = answer_in_reverse_batches(repliers, 8, Arc::clone(&drops));
    let bus = small_bus();
    let endpoint = bus
        .register("abandoned", Answering { drops: Arc::clone(&drops), deferred: Some(deferred) })
        .unwrap();
    let mut timed_out = 0u64;
    for id in 0..asks {
        let reply = endpoint.ask(Query(id));
        match id % 4 {
            // Given up at once: the reply arrives (or not yet) after the handle is gone.
            0 => drop(reply),
            // Timeouts of zero and of a few microseconds race the answering thread.
            1 | 2 => match reply.wait_timeout(Duration::from_micros((id % 3) * 5)) {
                Ok(answer) => assert_eq!(answer.id, id),
                Err(AskError::Timeout { .. }) => timed_out += 1,
                Err(other) => panic!("ask {id}: unexpected {other:?}"),
            },
            _ => assert_eq!(reply.wait().expect("answered").id, id),
        }
    }
    // Still serving, in order, after all the abandoned asks.
    assert_eq!(endpoint.ask(Query(asks)).wait().expect("answered").id, asks);
    bus.shutdown().unwrap();
    assert_eq!(join_answerer(answerer), asks as usize + 1);
    assert_eq!(drops.load(Ordering::SeqCst), asks as usize + 1, "timed out: {timed_out}");
}

#[test]
fn a_replier_kept_after_a_timeout_sees_the_asker_gone() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (deferred, repliers) = crossbeam_channel::unbounded();
    let bus = small_bus();
    let endpoint = bus
        .register("kept", Answering { drops: Arc::clone(&drops), deferred: Some(deferred) })
        .unwrap();
    let timeout = Duration::from_millis(1);
    match endpoint.ask(Query(9)).wait_timeout(timeout) {
        Err(AskError::Timeout { timeout: reported, .. }) => assert_eq!(reported, timeout),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let (id, replier) = repliers.recv_timeout(WAIT).expect("the request reached the handler");
    assert_eq!(id, 9);
    assert!(replier.is_abandoned());
    replier.reply(Answer { id, drops: Arc::clone(&drops) });
    assert_eq!(drops.load(Ordering::SeqCst), 1, "the late reply was dropped at once");
    bus.shutdown().unwrap();
}
