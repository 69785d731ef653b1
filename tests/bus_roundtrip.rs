//! Bus contract tests (SCENARIOS.md section 6, BUS-01..BUS-07, and issue 2's list).
//!
//! Goal: prove through the public API that the bus loses and duplicates nothing, keeps
//! per-sender order across one-way and request-reply messages, handles one message at a time,
//! and stops, times out and survives panics as specified. Method: small test endpoints that
//! record what they see; every wait is on a real condition (an ask reply, a channel message)
//! with a bound, never a sleep.

use std::{
    cell::Cell,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Barrier,
    },
    time::Duration,
};

use coordbus::{
    Ask, AskError, Bus, BusError, Context, Endpoint, HandlerError, Idle, Replier, SendError,
};

const WAIT: Duration = Duration::from_secs(30);
/// How long a test's sending threads may take in all before it fails (seconds when things
/// work; generous for the millions of messages of the largest test).
const RUN_BOUND: Duration = Duration::from_secs(300);

fn small_bus() -> Bus {
    Bus::builder()
        .inbox_shards(4)
        .inbox_capacity(1024)
        .idle(Idle::SpinThenPark { spin: Duration::from_micros(20) })
        .ask_timeout(WAIT)
        .build()
        .unwrap()
}

/// Joins `threads` once all have finished, failing the test if they have not within
/// `RUN_BOUND` (a plain join waits as long as a thread stays blocked, e.g. in `send` on an
/// inbox nobody drains); a panic of a thread is passed on with its own message.
fn join_all<T>(threads: Vec<std::thread::JoinHandle<T>>) -> Vec<T> {
    let deadline = std::time::Instant::now() + RUN_BOUND;
    while !threads.iter().all(|thread| thread.is_finished()) {
        let running = threads.iter().filter(|thread| !thread.is_finished()).count();
        assert!(
            std::time::Instant::now() < deadline,
            "{running} of {} threads still running after {RUN_BOUND:?}",
            threads.len()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    threads
        .into_iter()
        .map(|thread| thread.join().unwrap_or_else(|payload| std::panic::resume_unwind(payload)))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// A recording endpoint.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Started,
    Message(u64, u64),
    Request(u64),
    /// `on_error` with the error's text.
    Error(String),
    Stopped,
}

#[derive(Default)]
struct Recorder {
    seen: Vec<Seen>,
    log: Option<crossbeam_channel::Sender<Seen>>,
    /// Non-atomic counter and an "in handler" flag: a concurrent entry would be caught.
    count: Cell<u64>,
    in_handler: Cell<bool>,
    overlap_detected: Arc<AtomicBool>,
    /// Yield between reading and writing `count` on every message (BUS-02's deliberate yield);
    /// otherwise on one message in 1000.
    yield_on_every_message: bool,
    /// If set, `on_start` waits for it: messages sent meanwhile are really queued.
    start_gate: Option<crossbeam_channel::Receiver<()>>,
    /// Where `SilentRequest`'s replier goes (without it, the request is failed).
    handed_out: Option<crossbeam_channel::Sender<Replier<Late>>>,
}

#[derive(Debug)]
struct Note {
    sender: u64,
    sequence: u64,
}

enum RecorderRequest {
    Count(Replier<u64>),
    Seen(Replier<Vec<Seen>>),
    Fail(Replier<u64>),
    Raise(Replier<u64>),
    Panic(Replier<u64>),
    HandOut(Replier<Late>),
    Mark(u64, Replier<()>),
    AskSelf(Replier<String>),
}

struct CountQuery;
impl Ask<Recorder> for CountQuery {
    type Reply = u64;
    fn into_request(self, replier: Replier<u64>) -> RecorderRequest {
        RecorderRequest::Count(replier)
    }
}
struct SeenQuery;
impl Ask<Recorder> for SeenQuery {
    type Reply = Vec<Seen>;
    fn into_request(self, replier: Replier<Vec<Seen>>) -> RecorderRequest {
        RecorderRequest::Seen(replier)
    }
}
struct FailingRequest;
impl Ask<Recorder> for FailingRequest {
    type Reply = u64;
    fn into_request(self, replier: Replier<u64>) -> RecorderRequest {
        RecorderRequest::Fail(replier)
    }
}
/// Its handler returns an error (SPEC A.6's "handler throws"), dropping the replier.
struct RaisingRequest;
impl Ask<Recorder> for RaisingRequest {
    type Reply = u64;
    fn into_request(self, replier: Replier<u64>) -> RecorderRequest {
        RecorderRequest::Raise(replier)
    }
}
struct PanickingRequest;
impl Ask<Recorder> for PanickingRequest {
    type Reply = u64;
    fn into_request(self, replier: Replier<u64>) -> RecorderRequest {
        RecorderRequest::Panic(replier)
    }
}
/// Not answered by the handler: it hands the replier out on `Recorder::handed_out`.
struct SilentRequest;
impl Ask<Recorder> for SilentRequest {
    type Reply = Late;
    fn into_request(self, replier: Replier<Late>) -> RecorderRequest {
        RecorderRequest::HandOut(replier)
    }
}

/// A reply value that counts its drops: a late reply must be dropped at once, never delivered
/// or leaked.
#[derive(Debug)]
struct Late(Arc<AtomicUsize>);

impl Drop for Late {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}
struct Mark(u64);
impl Ask<Recorder> for Mark {
    type Reply = ();
    fn into_request(self, replier: Replier<()>) -> RecorderRequest {
        RecorderRequest::Mark(self.0, replier)
    }
}
struct AskSelf;
impl Ask<Recorder> for AskSelf {
    type Reply = String;
    fn into_request(self, replier: Replier<String>) -> RecorderRequest {
        RecorderRequest::AskSelf(replier)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("handler refused: {0}")]
struct Refused(u64);

impl Recorder {
    fn record(&mut self, seen: Seen) {
        if let Some(log) = &self.log {
            let _ = log.send(seen.clone());
        }
        self.seen.push(seen);
    }
}

impl Endpoint for Recorder {
    type Message = Note;
    type Request = RecorderRequest;

    fn on_start(&mut self, _: &Context<Self>) {
        if let Some(gate) = &self.start_gate {
            let _ = gate.recv_timeout(WAIT);
        }
        self.record(Seen::Started);
    }

    fn handle(&mut self, note: Note, _: &Context<Self>) -> Result<(), HandlerError> {
        if self.in_handler.replace(true) {
            self.overlap_detected.store(true, Ordering::SeqCst);
        }
        let before = self.count.get();
        if self.yield_on_every_message || note.sequence % 1000 == 999 {
            std::thread::yield_now(); // widen the window for a concurrent entry
        }
        self.count.set(before + 1);
        if self.log.is_some() || self.seen.len() < 10_000 {
            self.record(Seen::Message(note.sender, note.sequence));
        }
        self.in_handler.set(false);
        if note.sequence == u64::MAX {
            return Err(Box::new(Refused(note.sender)));
        }
        Ok(())
    }

    fn handle_request(
        &mut self,
        request: RecorderRequest,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        match request {
            RecorderRequest::Count(reply) => reply.reply(self.count.get()),
            RecorderRequest::Seen(reply) => reply.reply(self.seen.clone()),
            RecorderRequest::Fail(reply) => reply.fail(Refused(7)),
            RecorderRequest::Raise(reply) => {
                drop(reply);
                return Err(Box::new(Refused(9)));
            }
            RecorderRequest::Panic(_reply) => panic!("deliberate panic in handler"),
            RecorderRequest::HandOut(reply) => match &self.handed_out {
                Some(handed_out) => handed_out.send(reply).map_err(|_| "nobody takes repliers")?,
                None => reply.fail("no `handed_out` channel to hand the replier to"),
            },
            RecorderRequest::Mark(id, reply) => {
                self.record(Seen::Request(id));
                reply.reply(());
            }
            RecorderRequest::AskSelf(reply) => {
                let outcome = context.endpoint_ref().ask(CountQuery).wait_timeout(WAIT);
                reply.reply(format!("{outcome:?}"));
            }
        }
        Ok(())
    }

    fn on_error(&mut self, error: &HandlerError) {
        self.record(Seen::Error(error.to_string()));
    }

    fn on_stop(&mut self) {
        self.record(Seen::Stopped);
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn bus_01_names_are_unique_until_stopped() {
    let bus = small_bus();
    let first = bus.register("x", Recorder::default()).unwrap();
    assert_eq!(
        bus.register("x", Recorder::default()).unwrap_err(),
        BusError::DuplicateName { name: "x".into() }
    );
    first.stop();
    let second = bus.register("x", Recorder::default()).unwrap();
    assert!(!first.same_endpoint(&second));
    let looked_up = bus.lookup::<Recorder>("x").unwrap();
    assert!(looked_up.same_endpoint(&second), "several references reach the same endpoint");
    bus.shutdown().unwrap();
}

#[test]
fn bus_02_one_message_at_a_time_and_no_lost_updates() {
    let bus = small_bus();
    let overlap = Arc::new(AtomicBool::new(false));
    let recorder = Recorder {
        overlap_detected: Arc::clone(&overlap),
        yield_on_every_message: true,
        ..Default::default()
    };
    let endpoint = bus.register("counter", recorder).unwrap();
    let senders: Vec<_> = (0..8)
        .map(|sender| {
            let endpoint = endpoint.clone();
            std::thread::spawn(move || {
                for sequence in 0..10_000 {
                    endpoint.send(Note { sender, sequence }).unwrap();
                }
                // Barrier for this sender's own messages.
                endpoint.ask(CountQuery).wait().unwrap()
            })
        })
        .collect();
    for count in join_all(senders) {
        assert!(count >= 10_000);
    }
    // Every sender's messages were handled before its ask; all senders are done.
    assert_eq!(endpoint.ask(CountQuery).wait().unwrap(), 80_000);
    assert!(!overlap.load(Ordering::SeqCst), "two handler invocations overlapped");
    let stats = endpoint.stats();
    assert!(stats.handled >= 80_000);
    assert!(stats.handler_time.samples >= 80_000 / 256, "one handler call in 256 is timed");
    assert!(stats.handler_time.p50_ns_at_most.is_some());
    bus.shutdown().unwrap();
}

#[test]
fn bus_03_per_sender_fifo_across_kinds_and_ask_is_a_barrier() {
    let bus = small_bus();
    let endpoint = bus.register("fifo", Recorder::default()).unwrap();
    for sequence in 1..=1000 {
        endpoint.send(Note { sender: 0, sequence }).unwrap();
    }
    endpoint.ask(Mark(1)).wait().unwrap();
    let seen = endpoint.ask(SeenQuery).wait().unwrap();
    let mut expected = vec![Seen::Started];
    expected.extend((1..=1000).map(|sequence| Seen::Message(0, sequence)));
    expected.push(Seen::Request(1));
    assert_eq!(seen, expected);
    bus.shutdown().unwrap();
}

#[test]
fn per_sender_order_holds_under_concurrent_producers_with_batches() {
    let bus = small_bus();
    let (log, records) = crossbeam_channel::unbounded();
    let recorder = Recorder { log: Some(log), ..Default::default() };
    let endpoint = bus.register("order", recorder).unwrap();
    const SENDERS: u64 = 4;
    const PER_SENDER: u64 = 20_000;
    let threads: Vec<_> = (0..SENDERS)
        .map(|sender| {
            let endpoint = endpoint.clone();
            std::thread::spawn(move || {
                let mut sequence = 0;
                while sequence < PER_SENDER {
                    if sequence % 3 == 0 {
                        let batch = (sequence..(sequence + 50).min(PER_SENDER))
                            .map(|sequence| Note { sender, sequence })
                            .collect::<Vec<_>>();
                        sequence += batch.len() as u64;
                        endpoint.send_batch(batch).unwrap();
                    } else {
                        endpoint.send(Note { sender, sequence }).unwrap();
                        sequence += 1;
                    }
                }
                endpoint.ask(Mark(sender)).wait().unwrap();
            })
        })
        .collect();
    join_all(threads);
    bus.shutdown().unwrap();
    let mut next = [0u64; SENDERS as usize];
    let mut marks = 0;
    for seen in records.try_iter() {
        match seen {
            Seen::Message(sender, sequence) => {
                assert_eq!(sequence, next[sender as usize], "sender {sender} out of order");
                next[sender as usize] += 1;
            }
            Seen::Request(sender) => {
                assert_eq!(next[sender as usize], PER_SENDER, "mark before the sends");
                marks += 1;
            }
            Seen::Started | Seen::Stopped => {}
            Seen::Error(error) => panic!("no handler fails here: {error}"),
        }
    }
    assert_eq!(next, [PER_SENDER; SENDERS as usize], "nothing lost, nothing duplicated");
    assert_eq!(marks, SENDERS);
}

#[test]
fn four_producers_times_a_million_lose_and_duplicate_nothing() {
    struct Tally {
        sums: [u64; 4],
        counts: [u64; 4],
    }
    #[derive(Debug)]
    struct Producer(usize, u64);
    struct Totals;
    impl Ask<Tally> for Totals {
        type Reply = ([u64; 4], [u64; 4]);
        fn into_request(self, replier: Replier<Self::Reply>) -> Replier<Self::Reply> {
            replier
        }
    }
    impl Endpoint for Tally {
        type Message = Producer;
        type Request = Replier<([u64; 4], [u64; 4])>;
        fn handle(
            &mut self,
            Producer(index, value): Producer,
            _: &Context<Self>,
        ) -> Result<(), HandlerError> {
            // Sequence numbers must arrive in order per producer: count equals the value.
            assert_eq!(self.counts[index], value, "producer {index} reordered or lost");
            self.sums[index] += value;
            self.counts[index] += 1;
            Ok(())
        }
        fn handle_request(
            &mut self,
            reply: Self::Request,
            _: &Context<Self>,
        ) -> Result<(), HandlerError> {
            reply.reply((self.sums, self.counts));
            Ok(())
        }
    }
    let per_producer: u64 = if cfg!(miri) { 1_000 } else { 1_000_000 };
    let bus = small_bus();
    let endpoint = bus.register("tally", Tally { sums: [0; 4], counts: [0; 4] }).unwrap();
    let start = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|index| {
            let endpoint = endpoint.clone();
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                let mut value = 0;
                while value < per_producer {
                    if index % 2 == 0 {
                        endpoint.send(Producer(index, value)).unwrap();
                        value += 1;
                    } else {
                        let end = (value + 64).min(per_producer);
                        let batch = (value..end).map(|value| Producer(index, value)).collect();
                        endpoint.send_batch(batch).unwrap();
                        value = end;
                    }
                }
                // Barrier: this producer's messages are all handled when the ask returns.
                endpoint.ask(Totals).wait().unwrap();
            })
        })
        .collect();
    join_all(threads);
    let (sums, counts) = endpoint.ask(Totals).wait().unwrap();
    let expected_sum = per_producer * (per_producer - 1) / 2;
    assert_eq!(counts, [per_producer; 4]);
    assert_eq!(sums, [expected_sum; 4]);
    assert_eq!(endpoint.stats().panicked, 0, "the handler's order assertion never fired");
    bus.shutdown().unwrap();
}

#[test]
fn bus_04_stop_drains_the_queue_then_runs_on_stop() {
    let bus = small_bus();
    let (log, records) = crossbeam_channel::unbounded();
    let (open_gate, gate) = crossbeam_channel::bounded(1);
    let recorder = Recorder { log: Some(log), start_gate: Some(gate), ..Default::default() };
    let endpoint = bus.register("drain", recorder).unwrap();
    // on_start is held, so all 100 messages are queued when the endpoint is stopped.
    for sequence in 0..100 {
        endpoint.send(Note { sender: 1, sequence }).unwrap();
    }
    assert_eq!(endpoint.stats().inbox_depth, 100);
    assert!(endpoint.stop());
    assert!(!bus.contains("drain"), "the name is free immediately");
    let replacement = bus.register("drain", Recorder::default());
    assert!(replacement.is_ok(), "the name can be registered again right away");
    // This sender's lane exists (it sent the 100): each way of sending is refused and hands
    // the message back.
    match endpoint.send(Note { sender: 2, sequence: 0 }) {
        Err(SendError::Stopped { endpoint: name, message }) => {
            assert_eq!((name.as_str(), message.sequence), ("drain", 0))
        }
        other => panic!("send after stop gave {other:?}"),
    }
    match endpoint.try_send(Note { sender: 2, sequence: 1 }) {
        Err(SendError::Stopped { message, .. }) => assert_eq!(message.sequence, 1),
        other => panic!("try_send after stop gave {other:?}"),
    }
    match endpoint.send_timeout(Note { sender: 2, sequence: 2 }, Duration::from_millis(10)) {
        Err(SendError::Stopped { message, .. }) => assert_eq!(message.sequence, 2),
        other => panic!("send_timeout after stop gave {other:?}"),
    }
    assert!(matches!(endpoint.ask(CountQuery).wait(), Err(AskError::Stopped { .. })));
    assert!(matches!(bus.lookup::<Recorder>("missing").unwrap_err(), BusError::NotFound { .. }));
    open_gate.send(()).unwrap();
    bus.shutdown().unwrap(); // joins the endpoint thread: on_stop has run when this returns
    let seen: Vec<Seen> = records.try_iter().collect();
    let mut expected = vec![Seen::Started];
    expected.extend((0..100).map(|sequence| Seen::Message(1, sequence)));
    expected.push(Seen::Stopped);
    assert_eq!(seen, expected);
}

#[test]
fn bus_05_handler_errors_and_panics_fail_the_asker_and_the_endpoint_keeps_serving() {
    let bus = small_bus();
    let endpoint = bus.register("errors", Recorder::default()).unwrap();
    match endpoint.ask(FailingRequest).wait() {
        Err(error @ AskError::Handler { .. }) => {
            assert_eq!(error.to_string(), "endpoint \"errors\": the handler failed the request");
            let AskError::Handler { endpoint, source: cause } = error else { unreachable!() };
            assert_eq!(endpoint, "errors");
            assert_eq!(cause.to_string(), "handler refused: 7");
        }
        other => panic!("expected a handler error, got {other:?}"),
    }
    // A handler that raises (returns an error): the asker fails with that error as its cause,
    // and `on_error` sees it too (SPEC A.6, BUS-05).
    match endpoint.ask(RaisingRequest).wait() {
        Err(AskError::Handler { source: cause, .. }) => {
            assert!(matches!(cause.downcast_ref::<Refused>(), Some(Refused(9))), "{cause:?}")
        }
        other => panic!("expected the raised error, got {other:?}"),
    }
    match endpoint.ask(PanickingRequest).wait() {
        Err(AskError::HandlerPanicked { endpoint, message }) => {
            assert_eq!(
                (endpoint.as_str(), message.as_str()),
                ("errors", "deliberate panic in handler")
            )
        }
        other => panic!("expected a panic error, got {other:?}"),
    }
    // A failing one-way message: the sender is not told; the next message is handled.
    endpoint.send(Note { sender: 3, sequence: u64::MAX }).unwrap();
    endpoint.send(Note { sender: 3, sequence: 1 }).unwrap();
    assert_eq!(endpoint.ask(CountQuery).wait().unwrap(), 2);
    let stats = endpoint.stats();
    assert_eq!(stats.failed, 2);
    assert_eq!(stats.panicked, 1);
    // `on_error` hears of the raised error, of the panic (SPEC A.6: a panic is a handler
    // error) and of the failing one-way message; a request failed through its replier (an
    // answer, not a raise) is the asker's only.
    let errors: Vec<Seen> = endpoint
        .ask(SeenQuery)
        .wait()
        .unwrap()
        .into_iter()
        .filter(|seen| matches!(seen, Seen::Error(_)))
        .collect();
    assert_eq!(
        errors,
        [
            Seen::Error("handler refused: 9".into()),
            Seen::Error(
                "endpoint \"errors\": the handler panicked: deliberate panic in handler".into()
            ),
            Seen::Error("handler refused: 3".into()),
        ]
    );
    bus.shutdown().unwrap();
}

#[test]
fn bus_06_ask_timeout_names_the_timeout_and_a_late_reply_is_harmless() {
    let bus = small_bus();
    let (handed_out, repliers) = crossbeam_channel::unbounded();
    let recorder = Recorder { handed_out: Some(handed_out), ..Default::default() };
    let endpoint = bus.register("silent", recorder).unwrap();
    let timeout = Duration::from_millis(200);
    match endpoint.ask(SilentRequest).wait_timeout(timeout) {
        Err(error @ AskError::Timeout { .. }) => {
            let named =
                matches!(error, AskError::Timeout { timeout: reported, .. } if reported == timeout);
            assert!(named, "{error:?}");
            assert!(error.to_string().contains("200ms"), "{error}");
            // ...and names the setting that controls it (SPEC A.6, BUS-06), and the endpoint.
            assert!(error.to_string().contains("ask_timeout"), "{error}");
            assert!(error.to_string().starts_with("endpoint \"silent\": "), "{error}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // The handler kept the request's replier: the asker that timed out is gone for it...
    let replier = repliers.recv_timeout(WAIT).expect("the request reached the handler");
    assert!(replier.is_abandoned(), "the replier sees that its asker gave up");
    // ...and answering it late is harmless: the value is dropped at once, nothing panics.
    let drops = Arc::new(AtomicUsize::new(0));
    replier.reply(Late(Arc::clone(&drops)));
    assert_eq!(drops.load(Ordering::SeqCst), 1, "the late reply was dropped at once");
    // The endpoint still serves, and counts nothing against the late reply.
    assert_eq!(endpoint.ask(CountQuery).wait().unwrap(), 0);
    let stats = endpoint.stats();
    assert_eq!((stats.failed, stats.panicked), (0, 0));
    bus.shutdown().unwrap();
}

/// A one-way handler that panics in the middle of a batch, on the common dispatch path (not
/// the first message after an idle period, not a timed one, not a request), costs that message
/// only: the rest of the batch is handled once each, in order, and the endpoint keeps serving.
#[test]
fn a_one_way_panic_mid_batch_costs_only_its_message() {
    const PANICS_ON: u64 = 100;
    struct Picky {
        gate: crossbeam_channel::Receiver<()>,
        seen: Vec<u64>,
    }
    impl Endpoint for Picky {
        type Message = u64;
        type Request = Replier<Vec<u64>>;
        fn handle(&mut self, value: u64, _: &Context<Self>) -> Result<(), HandlerError> {
            if value == 0 {
                // Held until the whole batch is queued: no idle gap before the panicking one.
                let _ = self.gate.recv_timeout(WAIT);
            }
            assert_ne!(value, PANICS_ON, "deliberate panic on {value}");
            self.seen.push(value);
            Ok(())
        }
        fn handle_request(
            &mut self,
            replier: Replier<Vec<u64>>,
            _: &Context<Self>,
        ) -> Result<(), HandlerError> {
            replier.reply(std::mem::take(&mut self.seen));
            Ok(())
        }
    }
    struct TakeSeen;
    impl Ask<Picky> for TakeSeen {
        type Reply = Vec<u64>;
        fn into_request(self, replier: Replier<Vec<u64>>) -> Replier<Vec<u64>> {
            replier
        }
    }
    let bus = small_bus();
    let (open_gate, gate) = crossbeam_channel::bounded(1);
    let endpoint = bus.register("picky", Picky { gate, seen: Vec::new() }).unwrap();
    endpoint.send(0u64).unwrap();
    endpoint.send_batch((1..600u64).collect()).unwrap();
    open_gate.send(()).unwrap();
    let seen = endpoint.ask(TakeSeen).wait_timeout(WAIT).unwrap();
    let expected: Vec<u64> = (0..600).filter(|value| *value != PANICS_ON).collect();
    assert_eq!(seen, expected);
    let stats = endpoint.stats();
    assert_eq!(stats.panicked, 1);
    assert_eq!(stats.handled, 601, "600 messages and the ask");
    bus.shutdown().unwrap();
}

#[test]
fn dropped_replier_gives_no_reply_error_and_self_ask_is_an_error() {
    let (replier, reply) = Replier::<u64>::pair();
    drop(replier);
    // A pair bound to no endpoint names none.
    let error = reply.wait_timeout(WAIT).unwrap_err();
    assert!(matches!(&error, AskError::NoReply { endpoint } if endpoint.is_empty()), "{error:?}");
    assert_eq!(error.to_string(), "the handler dropped the request without replying");
    let bus = small_bus();
    let endpoint = bus.register("self", Recorder::default()).unwrap();
    let outcome = endpoint.ask(AskSelf).wait().unwrap();
    assert!(outcome.contains("SelfAsk"), "{outcome}");
    bus.shutdown().unwrap();
}

#[test]
fn bus_07_on_start_runs_before_the_first_message() {
    let bus = small_bus();
    let endpoint = bus.register("start", Recorder::default()).unwrap();
    endpoint.send(Note { sender: 0, sequence: 0 }).unwrap();
    let seen = endpoint.ask(SeenQuery).wait().unwrap();
    assert_eq!(seen, vec![Seen::Started, Seen::Message(0, 0)]);
    bus.shutdown().unwrap();
}

#[test]
fn reply_is_a_future() {
    let bus = small_bus();
    let endpoint = bus.register("future", Recorder::default()).unwrap();
    endpoint.send(Note { sender: 0, sequence: 0 }).unwrap();
    let count = block_on(endpoint.ask(CountQuery)).unwrap();
    assert_eq!(count, 1);
    bus.shutdown().unwrap();
}

/// An awaited ask whose handler keeps its replier and never answers ends at the bus's
/// `ask_timeout`, woken by the ask timer: the executor here parks with no timeout, so nothing
/// else polls the task again (before the timer, such an `.await` never ended).
#[test]
fn an_awaited_ask_never_answered_fails_at_the_ask_timeout() {
    struct Hoarder(Vec<Replier<u64>>);
    struct Hoard;
    impl Endpoint for Hoarder {
        type Message = ();
        type Request = Replier<u64>;
        fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
        fn handle_request(
            &mut self,
            replier: Replier<u64>,
            _: &Context<Self>,
        ) -> Result<(), HandlerError> {
            self.0.push(replier);
            Ok(())
        }
    }
    impl Ask<Hoarder> for Hoard {
        type Reply = u64;
        fn into_request(self, replier: Replier<u64>) -> Replier<u64> {
            replier
        }
    }
    let timeout = Duration::from_millis(100);
    let bus = Bus::builder().inbox_shards(1).ask_timeout(timeout).build().unwrap();
    let endpoint = bus.register("hoarder", Hoarder(Vec::new())).unwrap();
    let (outcome_sender, outcome) = std::sync::mpsc::channel();
    let asker = endpoint.clone();
    std::thread::spawn(move || {
        let _ = outcome_sender.send(poll_until_ready(asker.ask(Hoard), std::thread::park));
    });
    let outcome = outcome.recv_timeout(Duration::from_secs(10)).expect("the await ended");
    assert!(
        matches!(outcome, Err(AskError::Timeout { timeout: t, .. }) if t == timeout),
        "{outcome:?}"
    );
    bus.shutdown().unwrap();
}

/// A minimal executor: polls the future, parking the thread between wake-ups.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    // Bounded: a reply that never becomes ready (not even with its ask timeout, `WAIT`) fails
    // the test instead of hanging it.
    let deadline = std::time::Instant::now() + 2 * WAIT;
    poll_until_ready(future, || {
        assert!(std::time::Instant::now() < deadline, "future not ready within {:?}", 2 * WAIT);
        std::thread::park_timeout(Duration::from_millis(10));
    })
}

/// Polls `future` on this thread until it is ready, calling `park` after each pending poll;
/// the future's waker unparks this thread.
fn poll_until_ready<F: std::future::Future>(future: F, park: impl Fn()) -> F::Output {
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
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut task) {
            return output;
        }
        park();
    }
}

/// Two producers on one 4-slot ring shared by both (no lanes: the full inbox holds 4), or each
/// on its own 4-slot lane (1024 lane places, so that both surely get one: it holds 8).
#[test]
fn stop_releases_producers_blocked_on_a_full_inbox() {
    stop_releases_blocked_producers(0, 4);
    stop_releases_blocked_producers(1024, 8);
}

fn stop_releases_blocked_producers(lanes: usize, full_depth: u64) {
    struct Gate(crossbeam_channel::Receiver<()>);
    impl Endpoint for Gate {
        type Message = u64;
        type Request = ();
        fn handle(&mut self, value: u64, _: &Context<Self>) -> Result<(), HandlerError> {
            if value == 0 {
                // Block until the test has filled the inbox and stopped the endpoint.
                let _ = self.0.recv_timeout(WAIT);
            }
            Ok(())
        }
        fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
    }
    let bus = Bus::builder().inbox_lanes(lanes).inbox_shards(1).inbox_capacity(4).build().unwrap();
    let (open_gate, gate) = crossbeam_channel::bounded(1);
    let endpoint = bus.register("gate", Gate(gate)).unwrap();
    let blocked = Arc::new(AtomicUsize::new(0));
    // Each producer reports its last send's outcome here, so that the test bounds the wait for
    // it (a join would wait as long as a producer stays blocked).
    let (outcomes, released) = std::sync::mpsc::channel();
    let producers: Vec<_> = (0..2)
        .map(|producer| {
            let endpoint = endpoint.clone();
            let blocked = Arc::clone(&blocked);
            let outcomes = outcomes.clone();
            std::thread::spawn(move || {
                let mut outcome = Ok(());
                for value in 0..100u64 {
                    if value == 0 {
                        blocked.fetch_add(1, Ordering::SeqCst);
                    }
                    outcome = endpoint.send(value);
                    if outcome.is_err() {
                        break;
                    }
                }
                let _ = outcomes.send((producer, outcome));
            })
        })
        .collect();
    drop(outcomes);
    // Both producers have started and the inbox is full (the handler is stuck on a first
    // message): every producer is blocked in `send` or about to be.
    let deadline = std::time::Instant::now() + WAIT;
    while (blocked.load(Ordering::SeqCst) < 2 || endpoint.stats().inbox_depth < full_depth)
        && std::time::Instant::now() < deadline
    {
        std::thread::yield_now();
    }
    assert_eq!(endpoint.stats().inbox_depth, full_depth, "inbox is full ({lanes} lanes)");
    endpoint.stop();
    // Released by the stop itself: well within 5 s, and long before the handler's gate gives up
    // by itself (after `WAIT`), which would otherwise let the producers through and hide a
    // regression.
    for _ in 0..2 {
        let (producer, outcome) =
            released.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|error| {
                panic!("a producer was not released within 5 s of stop ({lanes} lanes): {error}")
            });
        assert!(
            matches!(outcome, Err(SendError::Stopped { .. })),
            "producer {producer} ({lanes} lanes): {outcome:?}"
        );
    }
    for producer in producers {
        producer.join().unwrap();
    }
    drop(open_gate); // every blocked handler call returns at once
    bus.shutdown().unwrap();
}

#[test]
fn try_send_hands_the_message_back_when_full_and_registering_after_shutdown_fails() {
    let bus = Bus::builder().inbox_shards(1).inbox_capacity(2).idle(Idle::Park).build().unwrap();
    struct Sink(crossbeam_channel::Receiver<()>);
    impl Endpoint for Sink {
        type Message = u64;
        type Request = ();
        fn on_start(&mut self, _: &Context<Self>) {
            let _ = self.0.recv_timeout(WAIT);
        }
        fn handle(&mut self, _: u64, _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
        fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
    }
    let (start, started) = crossbeam_channel::bounded(1);
    let endpoint = bus.register("sink", Sink(started)).unwrap();
    endpoint.try_send(1u64).unwrap();
    endpoint.try_send(2u64).unwrap();
    match endpoint.try_send(3u64) {
        Err(SendError::Full { message, .. }) => assert_eq!(message, 3),
        other => panic!("expected Full, got {other:?}"),
    }
    match endpoint.send_timeout(4u64, Duration::from_millis(10)) {
        Err(SendError::Timeout { message, timeout, .. }) => {
            assert_eq!((message, timeout), (4, Duration::from_millis(10)))
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    start.send(()).unwrap();
    bus.shutdown().unwrap();
    assert_eq!(
        bus.register("late", Recorder::default()).unwrap_err(),
        BusError::ShutDown { name: "late".to_owned() }
    );
    assert!(matches!(bus.lookup::<Recorder>("sink"), Err(BusError::NotFound { .. })));
}

#[test]
fn lookup_with_the_wrong_type_is_a_typed_error() {
    let bus = small_bus();
    bus.register("typed", Recorder::default()).unwrap();
    struct Other;
    impl Endpoint for Other {
        type Message = ();
        type Request = ();
        fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
        fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
    }
    assert!(matches!(bus.lookup::<Other>("typed"), Err(BusError::WrongType { .. })));
    bus.shutdown().unwrap();
}

#[test]
fn more_busy_threads_than_cores_still_make_progress() {
    // Four endpoints and eight producers on a 2-core machine, endpoints spinning when idle.
    let bus = Bus::builder()
        .inbox_shards(2)
        .inbox_capacity(256)
        .idle(Idle::SpinThenPark { spin: Duration::from_millis(1) })
        .build()
        .unwrap();
    let endpoints: Vec<_> = (0..4)
        .map(|index| bus.register(format!("busy-{index}"), Recorder::default()).unwrap())
        .collect();
    let threads: Vec<_> = (0..8)
        .map(|sender| {
            let endpoints = endpoints.clone();
            std::thread::spawn(move || {
                for sequence in 0..5_000 {
                    endpoints[(sequence % 4) as usize].send(Note { sender, sequence }).unwrap();
                }
                for endpoint in &endpoints {
                    endpoint.ask(CountQuery).wait().unwrap(); // barrier for this sender
                }
            })
        })
        .collect();
    join_all(threads);
    let total: u64 =
        endpoints.iter().map(|endpoint| endpoint.ask(CountQuery).wait().unwrap()).sum();
    assert_eq!(total, 40_000);
    bus.shutdown().unwrap();
}

/// SPEC A.1: registering on a shut-down bus fails. A registration racing a shutdown either
/// fails with `ShutDown` or is stopped by that shutdown: no endpoint it returned is still
/// running afterwards. (Before, one that checked the flag just before the shutdown listed the
/// names was inserted after the listing and kept running.)
#[test]
fn a_registration_racing_a_shutdown_is_refused_or_stopped() {
    for round in 0..40 {
        let bus = Arc::new(small_bus());
        let registrar = {
            let bus = Arc::clone(&bus);
            std::thread::spawn(move || {
                let mut registered = Vec::new();
                // Bounded: a starved test thread must not let it spawn thousands of endpoint
                // threads before the shutdown comes (the race is in the first few anyway).
                for index in 0..256 {
                    match bus.register(format!("r{index}"), Recorder::default()) {
                        Ok(endpoint) => registered.push(endpoint),
                        Err(BusError::ShutDown { .. }) => break,
                        Err(other) => panic!("round {round}: {other:?}"),
                    }
                }
                registered
            })
        };
        // Let the registrar get going (bounded: it registers within microseconds).
        let started = std::time::Instant::now();
        while bus.names().len() < 2 && started.elapsed() < RUN_BOUND {
            std::thread::yield_now();
        }
        let _ = bus.shutdown();
        let registered = registrar.join().unwrap();
        assert!(!registered.is_empty());
        for endpoint in &registered {
            assert!(
                matches!(
                    endpoint.try_send(Note { sender: 0, sequence: 0 }),
                    Err(SendError::Stopped { .. })
                ),
                "round {round}: an endpoint registered during the shutdown still takes messages"
            );
        }
        assert!(bus.names().is_empty(), "round {round}: {:?}", bus.names());
    }
}

/// Two endpoints whose handlers forward each message to the other (a cycle), with more
/// messages in flight than the cycle's inbox lanes hold: once both lanes are full, each
/// handler waits for room only the other can make. A handler's send waits at most the bus's
/// `ask_timeout` and then fails (the forwarder drops that message), so the cycle drains
/// instead of waiting forever.
#[test]
fn endpoints_sending_to_each_other_cannot_deadlock_on_full_inboxes() {
    const HOPS: u64 = 20;
    struct Forwarder {
        peer: Arc<std::sync::OnceLock<coordbus::EndpointRef<Forwarder>>>,
        gate: std::sync::mpsc::Receiver<()>,
        retired: Arc<AtomicUsize>,
        timed_out: Arc<AtomicUsize>,
    }
    impl Endpoint for Forwarder {
        type Message = u64;
        type Request = ();
        fn on_start(&mut self, _: &Context<Self>) {
            let _ = self.gate.recv_timeout(WAIT);
        }
        fn handle(&mut self, hops: u64, _: &Context<Self>) -> Result<(), HandlerError> {
            if hops == 0 {
                self.retired.fetch_add(1, Ordering::SeqCst);
                return Ok(());
            }
            let peer = self.peer.get().expect("peer set before the gates open");
            match peer.send(hops - 1) {
                Ok(()) => {}
                Err(SendError::Timeout { .. }) => {
                    self.timed_out.fetch_add(1, Ordering::SeqCst);
                    self.retired.fetch_add(1, Ordering::SeqCst);
                }
                Err(other) => return Err(other.to_string().into()),
            }
            Ok(())
        }
        fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
    }
    let bus = Bus::builder()
        .inbox_shards(1)
        .inbox_capacity(64)
        .idle(Idle::SpinThenPark { spin: Duration::from_micros(20) })
        .ask_timeout(Duration::from_millis(10))
        .build()
        .unwrap();
    let (retired, timed_out) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let peers = [Arc::new(std::sync::OnceLock::new()), Arc::new(std::sync::OnceLock::new())];
    let mut gates = Vec::new();
    let mut endpoints = Vec::new();
    for (index, peer) in peers.iter().enumerate() {
        let (open, gate) = std::sync::mpsc::channel();
        gates.push(open);
        let forwarder = Forwarder {
            peer: Arc::clone(peer),
            gate,
            retired: Arc::clone(&retired),
            timed_out: Arc::clone(&timed_out),
        };
        endpoints.push(bus.register(format!("forwarder-{index}"), forwarder).unwrap());
    }
    peers[0].set(endpoints[1].clone()).unwrap();
    peers[1].set(endpoints[0].clone()).unwrap();
    // Seeding threads fill what they can of both inboxes while the handlers are held (their
    // lanes, or the shared ring if they get none): at least as many messages as the slots the
    // two handlers forward into, so both of those fill up.
    let seeders: Vec<_> = (0..4)
        .map(|_| {
            let endpoints = endpoints.clone();
            std::thread::spawn(move || {
                let mut seeded = 0;
                for endpoint in &endpoints {
                    while seeded < 10_000 && endpoint.try_send(HOPS).is_ok() {
                        seeded += 1;
                    }
                }
                seeded
            })
        })
        .collect();
    let seeded: usize = seeders.into_iter().map(|seeder| seeder.join().unwrap()).sum();
    assert!(seeded >= 2 * 64, "{seeded} seeded");
    for open in gates {
        open.send(()).unwrap();
    }
    let started = std::time::Instant::now();
    while retired.load(Ordering::SeqCst) < seeded {
        assert!(
            started.elapsed() < RUN_BOUND,
            "the cycle is stuck: {} of {seeded} messages retired",
            retired.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(timed_out.load(Ordering::SeqCst) > 0, "both lanes filled, so some sends timed out");
    bus.shutdown().unwrap();
}
