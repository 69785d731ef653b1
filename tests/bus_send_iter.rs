//! Goal: `EndpointRef::send_iter` delivers messages made as the inbox takes them, through a
//! lane or a shared shard, in order, with iterators that keep their word and iterators that do
//! not (shorter or longer than their `len`, panicking, sending from inside themselves), and
//! hands back what a stopped endpoint refused.
//!
//! Method: a `Recorder` endpoint appends every number it handles to a shared list; each test
//! sends numbered messages, waits (bounded) until the list holds as many as it must, and
//! compares the list with the numbers sent. Where order against another endpoint matters, that
//! endpoint is held at a gate on its first message, so that a reorder would show.

use std::{
    sync::{mpsc, Arc, Mutex},
    time::{Duration, Instant},
};

use coordbus::{Ask, Bus, Context, Endpoint, EndpointRef, HandlerError, Replier, SendError};

const BOUND: Duration = Duration::from_secs(30);

/// Lane places enough for the test thread to have a lane whatever its producer index.
const LANES: usize = 1024;

/// Keeps every message it is sent, in arrival order; with a gate, holds its handler on
/// message 0 until the gate opens (so what is queued meanwhile is drained in queue order).
struct Recorder {
    seen: Arc<Mutex<Vec<u64>>>,
    gate: Option<mpsc::Receiver<()>>,
}

struct Count;
impl Ask<Recorder> for Count {
    type Reply = usize;
    fn into_request(self, replier: Replier<usize>) -> Replier<usize> {
        replier
    }
}

impl Endpoint for Recorder {
    type Message = u64;
    type Request = Replier<usize>;

    fn handle(&mut self, value: u64, _: &Context<Self>) -> Result<(), HandlerError> {
        if let Some(gate) = self.gate.as_ref().filter(|_| value == 0) {
            gate.recv_timeout(BOUND).expect("the gate opens");
        }
        self.seen.lock().unwrap().push(value);
        Ok(())
    }

    fn handle_request(
        &mut self,
        replier: Replier<usize>,
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        replier.reply(self.seen.lock().unwrap().len());
        Ok(())
    }
}

/// A bus whose inboxes give each sending thread a lane (`lanes`: [`LANES`]), or none (0:
/// every thread sends through the shared shards), of 64 slots (fewer than the batches below).
fn recorder(lanes: usize) -> (Bus, EndpointRef<Recorder>, Arc<Mutex<Vec<u64>>>) {
    let bus = Bus::builder().inbox_lanes(lanes).inbox_capacity(64).build().unwrap();
    let (endpoint, seen) = register_recorder(&bus, "recorder");
    (bus, endpoint, seen)
}

fn register_recorder(bus: &Bus, name: &str) -> (EndpointRef<Recorder>, Arc<Mutex<Vec<u64>>>) {
    register_gated(bus, name, None)
}

fn register_gated(
    bus: &Bus,
    name: &str,
    gate: Option<mpsc::Receiver<()>>,
) -> (EndpointRef<Recorder>, Arc<Mutex<Vec<u64>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let endpoint = bus.register(name, Recorder { seen: Arc::clone(&seen), gate }).unwrap();
    (endpoint, seen)
}

/// What the recorder has seen once it has handled `count` messages (asked until then, each
/// ask answered after this thread's earlier messages; bounded).
fn seen_after(endpoint: &EndpointRef<Recorder>, seen: &Mutex<Vec<u64>>, count: usize) -> Vec<u64> {
    let deadline = Instant::now() + BOUND;
    while endpoint.ask(Count).wait_timeout(BOUND).unwrap() < count {
        assert!(Instant::now() < deadline, "fewer than {count} messages arrived");
    }
    seen.lock().unwrap().clone()
}

/// Says it holds `claims` values and yields `0..yields`.
struct Claiming {
    next: u64,
    yields: u64,
    claims: usize,
}

impl Iterator for Claiming {
    type Item = u64;
    fn next(&mut self) -> Option<u64> {
        (self.next < self.yields).then(|| {
            self.next += 1;
            self.next - 1
        })
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.claims, Some(self.claims))
    }
}

impl ExactSizeIterator for Claiming {}

#[test]
fn send_iter_delivers_every_message_in_order_with_a_lane_and_without() {
    for lanes in [LANES, 0] {
        let (bus, endpoint, seen) = recorder(lanes);
        endpoint.send_iter((0..1000u32).map(|value| u64::from(value) * 3)).unwrap();
        let expected: Vec<u64> = (0..1000).map(|value| value * 3).collect();
        assert_eq!(seen_after(&endpoint, &seen, 1000), expected, "{lanes} lanes");
        bus.shutdown().unwrap();
    }
}

/// An iterator shorter than its `len` sends what it yields; a longer one sends its `len` and
/// keeps the rest; the inbox takes messages as before after either.
#[test]
fn send_iter_sends_what_an_iterator_yields_up_to_its_len() {
    for lanes in [LANES, 0] {
        let (bus, endpoint, seen) = recorder(lanes);
        endpoint.send_iter(Claiming { next: 0, yields: 4, claims: 100 }).unwrap();
        let mut longer = Claiming { next: 10, yields: 20, claims: 3 };
        endpoint.send_iter(&mut longer).unwrap();
        assert_eq!(longer.next(), Some(13), "{lanes} lanes: the rest stays in the iterator");
        endpoint.send(99u64).unwrap();
        assert_eq!(seen_after(&endpoint, &seen, 8), [0, 1, 2, 3, 10, 11, 12, 99], "{lanes} lanes");
        bus.shutdown().unwrap();
    }
}

/// The iterator may send to the same endpoint: that message arrives once, beside the batch,
/// which keeps its order.
#[test]
fn a_send_from_inside_the_iterator_arrives_beside_the_batch() {
    for lanes in [LANES, 0] {
        let (bus, endpoint, seen) = recorder(lanes);
        let inner = endpoint.clone();
        let values = (0..200u32).map(u64::from).inspect(move |&value| {
            if value == 100 {
                inner.send(1000u64).unwrap();
            }
        });
        endpoint.send_iter(values).unwrap();
        let seen = seen_after(&endpoint, &seen, 201);
        let batch: Vec<u64> = seen.iter().copied().filter(|&value| value < 1000).collect();
        assert_eq!(batch, (0..200).collect::<Vec<_>>(), "{lanes} lanes");
        assert_eq!(seen.iter().filter(|&&value| value == 1000).count(), 1, "{lanes} lanes");
        bus.shutdown().unwrap();
    }
}

/// What the iterator sends to another endpoint keeps its order with this thread's other
/// messages to it (the other endpoint holds on the first until all three are queued, so it
/// takes them in queue order); a `send_iter` from inside the iterator (to the same endpoint)
/// arrives whole.
#[test]
fn sends_from_inside_the_iterator_keep_their_order_elsewhere_and_arrive_here() {
    for lanes in [LANES, 0] {
        let (bus, endpoint, seen) = recorder(lanes);
        let (open, gate) = mpsc::channel();
        let (other, other_seen) = register_gated(&bus, "other", Some(gate));
        other.send(0u64).unwrap();
        let (inner, inner_other) = (endpoint.clone(), other.clone());
        let values = (0..100u32).map(u64::from).inspect(move |&value| {
            if value == 50 {
                inner_other.send(1u64).unwrap();
                inner.send_iter((0..10u32).map(|value| 1000 + u64::from(value))).unwrap();
            }
        });
        endpoint.send_iter(values).unwrap();
        other.send(2u64).unwrap();
        open.send(()).unwrap();
        assert_eq!(seen_after(&other, &other_seen, 3), [0, 1, 2], "{lanes} lanes");
        let seen = seen_after(&endpoint, &seen, 110);
        let batch: Vec<u64> = seen.iter().copied().filter(|&value| value < 1000).collect();
        let nested: Vec<u64> = seen.iter().copied().filter(|&value| value >= 1000).collect();
        assert_eq!(batch, (0..100).collect::<Vec<_>>(), "{lanes} lanes");
        assert_eq!(nested, (1000..1010).collect::<Vec<_>>(), "{lanes} lanes");
        bus.shutdown().unwrap();
    }
}

/// A panicking iterator: with a lane, what it yielded before the panic is delivered; without
/// one, nothing (the messages are collected first). The endpoint works on either way.
#[test]
fn a_panicking_iterator_leaves_the_endpoint_working() {
    for (lanes, delivered) in [(LANES, 3u64), (0, 0)] {
        let (bus, endpoint, seen) = recorder(lanes);
        let panicking =
            (0..5u32).map(|value| if value < 3 { u64::from(value) } else { panic!("injected") });
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            endpoint.send_iter(panicking)
        }));
        assert!(outcome.is_err(), "{lanes} lanes: the panic reaches the caller");
        endpoint.send(99u64).unwrap();
        let mut expected: Vec<u64> = (0..delivered).collect();
        expected.push(99);
        let count = expected.len();
        assert_eq!(seen_after(&endpoint, &seen, count), expected, "{lanes} lanes");
        bus.shutdown().unwrap();
    }
}

/// A stopped endpoint refuses the batch and hands back every message, those the iterator had
/// not yielded yet included (through the thread's lane, made by a first send, or without).
#[test]
fn a_stopped_endpoint_hands_back_the_messages() {
    for lanes in [LANES, 0] {
        let (bus, endpoint, seen) = recorder(lanes);
        endpoint.send(7u64).unwrap();
        assert_eq!(seen_after(&endpoint, &seen, 1), [7], "{lanes} lanes");
        endpoint.stop();
        match endpoint.send_iter((0..10u32).map(u64::from)) {
            Err(SendError::Stopped { endpoint: name, message }) => {
                assert_eq!(name, "recorder");
                assert_eq!(message, (0..10).collect::<Vec<_>>(), "{lanes} lanes");
            }
            other => panic!("{lanes} lanes: expected Stopped, got {other:?}"),
        }
        bus.shutdown().unwrap();
    }
}
