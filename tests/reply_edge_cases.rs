//! Request-reply at its edges: timeouts too large for the clock, and repliers dropped during
//! panics that no endpoint loop sees.
//!
//! Goal: `Duration::MAX` as a timeout means "no deadline" everywhere (never an overflow panic);
//! a replier dropped by a panicking thread that is not an endpoint thread, or during a panic a
//! handler catches itself, fails its asker with `HandlerPanicked` at once instead of leaving it
//! to wait out its timeout; an asker's waker that panics while the endpoint loop fails such a
//! reply does not end the endpoint thread, nor, when a reply is answered, unwind into the
//! answering thread (a handler midway through its work). Method: public API only; every wait
//! is bounded by a timeout that a regression would run into (the assertion then sees
//! `Timeout`, not `HandlerPanicked`, or the bounded wait for the endpoint's next request
//! fails).

use std::{
    future::Future,
    panic::{catch_unwind, AssertUnwindSafe},
    pin::pin,
    sync::{Arc, Mutex},
    task::{Context as TaskContext, Poll, Wake, Waker},
    time::Duration,
};

use coordbus::{Ask, AskError, Bus, Context, Endpoint, HandlerError, Replier};

/// Far longer than any answer here takes; a wait that reaches it is a hang.
const WAIT: Duration = Duration::from_secs(30);

/// Keeps each replier until told to answer, or drops it inside a panic it catches itself.
#[derive(Default)]
struct Keeper {
    kept: Arc<Mutex<Vec<Replier<u32>>>>,
    /// What `ReplyAfterGiveUp` found: 1 if its own pair's reply said `NoReply` at once.
    late_pair: Arc<std::sync::atomic::AtomicU32>,
    /// The text of every error `on_error` got.
    errors: Arc<Mutex<Vec<String>>>,
}

enum Request {
    Keep(Replier<u32>),
    Echo(u32, Replier<u32>),
    /// Answers every kept replier with the value, then its own.
    AnswerKept(u32, Replier<u32>),
    PanicCaughtInside(Replier<u32>),
    PanicHolding(Replier<u32>),
    /// Drops the kept repliers and its own, then returns an error.
    RaiseDroppingAll(Replier<u32>),
    /// Drops the kept repliers and its own, then panics.
    DropAllThenPanic(Replier<u32>),
    /// Makes a replier of its own (`Replier::pair`), drops it, and answers 1 if its reply
    /// says `NoReply` within the wait (0 otherwise).
    PairInside(Replier<u32>),
    /// Waits (bounded) until its asker gave up, answers anyway (which frees the reply slot on
    /// this thread), then does what `PairInside` does, noting the result in `late_pair`.
    ReplyAfterGiveUp(Replier<u32>),
}

/// The error `RaiseDroppingAll`'s handler returns.
#[derive(Debug, PartialEq, Eq)]
struct Raised(u32);

impl std::fmt::Display for Raised {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "raised {}", self.0)
    }
}

/// What `Raised` says caused it.
#[derive(Debug)]
struct RaisedCause;

impl std::fmt::Display for RaisedCause {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("its cause")
    }
}

impl std::error::Error for RaisedCause {}

impl std::error::Error for Raised {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&RaisedCause)
    }
}

struct RaiseDroppingAll;
impl Ask<Keeper> for RaiseDroppingAll {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::RaiseDroppingAll(replier)
    }
}

struct PairInside;
impl Ask<Keeper> for PairInside {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::PairInside(replier)
    }
}

struct ReplyAfterGiveUp;
impl Ask<Keeper> for ReplyAfterGiveUp {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::ReplyAfterGiveUp(replier)
    }
}

struct DropAllThenPanic;
impl Ask<Keeper> for DropAllThenPanic {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::DropAllThenPanic(replier)
    }
}

struct KeepIt;
impl Ask<Keeper> for KeepIt {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::Keep(replier)
    }
}

/// Answered at once with its value: shows that the endpoint still handles requests.
struct Echo(u32);
impl Ask<Keeper> for Echo {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::Echo(self.0, replier)
    }
}

/// Makes the handler answer every kept replier with the value, then this ask.
struct AnswerKept(u32);
impl Ask<Keeper> for AnswerKept {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::AnswerKept(self.0, replier)
    }
}

struct PanicWhileHoldingIt;
impl Ask<Keeper> for PanicWhileHoldingIt {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::PanicHolding(replier)
    }
}

struct DropItInACaughtPanic;
impl Ask<Keeper> for DropItInACaughtPanic {
    type Reply = u32;
    fn into_request(self, replier: Replier<u32>) -> Request {
        Request::PanicCaughtInside(replier)
    }
}

impl Endpoint for Keeper {
    type Message = u32;
    type Request = Request;

    fn handle(&mut self, _: u32, _: &Context<Self>) -> Result<(), HandlerError> {
        Ok(())
    }

    fn on_error(&mut self, error: &HandlerError) {
        self.errors.lock().unwrap().push(error.to_string());
    }

    fn handle_request(&mut self, request: Request, _: &Context<Self>) -> Result<(), HandlerError> {
        match request {
            Request::Keep(replier) => self.kept.lock().unwrap().push(replier),
            Request::Echo(value, replier) => replier.reply(value),
            Request::AnswerKept(value, replier) => {
                for kept in self.kept.lock().unwrap().drain(..) {
                    kept.reply(value);
                }
                replier.reply(value);
            }
            Request::PanicCaughtInside(replier) => {
                let caught = catch_unwind(AssertUnwindSafe(move || {
                    let _held = replier;
                    panic!("inside the handler");
                }));
                assert!(caught.is_err());
            }
            Request::PanicHolding(replier) => {
                let _held = replier;
                panic!("the handler panics holding the replier");
            }
            Request::RaiseDroppingAll(replier) => {
                self.kept.lock().unwrap().clear();
                drop(replier);
                return Err(Box::new(Raised(5)));
            }
            Request::PairInside(replier) => {
                let (inner, reply) = Replier::<u32>::pair();
                drop(inner);
                let answered = matches!(reply.wait_timeout(WAIT), Err(AskError::NoReply { .. }));
                replier.reply(u32::from(answered));
            }
            Request::ReplyAfterGiveUp(replier) => {
                let deadline = std::time::Instant::now() + WAIT;
                while !replier.is_abandoned() && std::time::Instant::now() < deadline {
                    std::thread::yield_now();
                }
                replier.reply(0);
                // The freed slot's block is this thread's next one.
                let (inner, reply) = Replier::<u32>::pair();
                drop(inner);
                let at_once = matches!(
                    reply.wait_timeout(Duration::from_secs(5)),
                    Err(AskError::NoReply { .. })
                );
                self.late_pair.store(u32::from(at_once), std::sync::atomic::Ordering::SeqCst);
            }
            Request::DropAllThenPanic(replier) => {
                self.kept.lock().unwrap().clear();
                drop(replier);
                panic!("the handler panics after dropping repliers");
            }
        }
        Ok(())
    }
}

struct NoopWake;
impl Wake for NoopWake {
    fn wake(self: Arc<Self>) {}
}

/// An asker's waker that panics when woken.
struct PanickingWake;
impl Wake for PanickingWake {
    fn wake(self: Arc<Self>) {
        panic!("the asker's waker panics");
    }
}

#[test]
fn timeouts_too_large_for_the_clock_mean_no_deadline() {
    let bus = Bus::builder().ask_timeout(Duration::MAX).build().unwrap();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let endpoint =
        bus.register("keeper", Keeper { kept: Arc::clone(&kept), ..Keeper::default() }).unwrap();
    endpoint.send_timeout(1u32, Duration::MAX).unwrap();
    // Polled before the reply exists: the future fixes its deadline (none) without panicking.
    let mut reply = pin!(endpoint.ask(KeepIt));
    let waker = Waker::from(Arc::new(NoopWake));
    assert!(reply.as_mut().poll(&mut TaskContext::from_waker(&waker)).is_pending());
    // Answer it once the endpoint has it (bounded wait on the real condition).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while kept.lock().unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the ask never reached the endpoint");
        std::thread::yield_now();
    }
    kept.lock().unwrap().pop().unwrap().reply(7);
    assert!(matches!(
        reply.as_mut().poll(&mut TaskContext::from_waker(&waker)),
        Poll::Ready(Ok(7))
    ));
    // A blocking wait with the bus's (unbounded) timeout, on a helper thread so that the test
    // itself stays bounded: a regression fails the `recv_timeout` below instead of hanging.
    let second = endpoint.ask(KeepIt);
    let (done, outcome) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = done.send(second.wait());
    });
    // Answers the ask once the endpoint has it; gives up after 10 s (returns false).
    let answerer = {
        let kept = Arc::clone(&kept);
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if let Some(replier) = kept.lock().unwrap().pop() {
                    replier.reply(8);
                    return true;
                }
                std::thread::yield_now();
            }
            false
        })
    };
    assert!(answerer.join().unwrap(), "the second ask never reached the endpoint within 10 s");
    let second = outcome.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|error| {
        panic!("the unbounded wait gave no outcome in 30 s ({error}: disconnected = panicked)")
    });
    assert_eq!(second.unwrap(), 8);
    waiter.join().unwrap();
    bus.shutdown().unwrap();
}

#[test]
fn a_replier_dropped_by_a_panicking_thread_fails_its_asker_at_once() {
    let (replier, reply) = Replier::<u32>::pair();
    let outcome = std::thread::spawn(move || {
        let _held = replier;
        panic!("a worker thread of the engine");
    })
    .join();
    assert!(outcome.is_err());
    assert!(matches!(
        reply.wait_timeout(Duration::from_secs(30)),
        Err(AskError::HandlerPanicked { .. })
    ));
}

#[test]
fn a_replier_dropped_in_a_panic_the_handler_caught_fails_its_asker() {
    let bus = Bus::builder().build().unwrap();
    let endpoint = bus.register("keeper", Keeper::default()).unwrap();
    match endpoint.ask(DropItInACaughtPanic).wait_timeout(Duration::from_secs(30)) {
        Err(AskError::HandlerPanicked { message, .. }) => {
            assert!(message.contains("caught inside the handler"), "{message}");
        }
        other => panic!("expected HandlerPanicked, got {other:?}"),
    }
    // The endpoint keeps serving: a later message is taken and a later ask is answered (an
    // ended endpoint thread would leave it to time out, or fail it).
    endpoint.send(1u32).unwrap();
    assert_eq!(endpoint.ask(Echo(5)).wait_timeout(Duration::from_secs(30)).unwrap(), 5);
    bus.shutdown().unwrap();
}

/// A waker that panics when it is dropped (once its last clone goes).
struct PanicsWhenDropped;
impl Wake for PanicsWhenDropped {
    fn wake(self: Arc<Self>) {}
}
impl Drop for PanicsWhenDropped {
    fn drop(&mut self) {
        panic!("the asker's waker panics when dropped");
    }
}

/// An asker that polled, then gave up, leaves its waker in the reply slot, and whoever answers
/// frees the slot and drops it: a waker whose drop panics does not unwind into the answerer.
#[test]
fn answering_an_abandoned_reply_whose_waker_panics_on_drop_does_not_unwind_into_the_answerer() {
    let (replier, reply) = Replier::<u32>::pair();
    let mut reply = Box::pin(reply);
    let waker = Waker::from(Arc::new(PanicsWhenDropped));
    assert!(reply.as_mut().poll(&mut TaskContext::from_waker(&waker)).is_pending());
    drop(reply);
    // The slot's clone of the waker is now its last.
    drop(waker);
    assert!(replier.is_abandoned());
    let answered = catch_unwind(AssertUnwindSafe(move || replier.reply(4)));
    assert!(answered.is_ok(), "the waker's drop unwound into the answering thread");
}

/// An answer whose asker's waker panics does not unwind into whoever answered: the reply is
/// delivered, and the answering thread goes on.
#[test]
fn answering_a_reply_whose_waker_panics_does_not_unwind_into_the_answerer() {
    let (replier, reply) = Replier::<u32>::pair();
    let mut reply = pin!(reply);
    let waker = Waker::from(Arc::new(PanickingWake));
    assert!(reply.as_mut().poll(&mut TaskContext::from_waker(&waker)).is_pending());
    let answered = catch_unwind(AssertUnwindSafe(move || replier.reply(4)));
    assert!(answered.is_ok(), "the waker's panic unwound into the answering thread");
    let polled =
        reply.as_mut().poll(&mut TaskContext::from_waker(&Waker::from(Arc::new(NoopWake))));
    assert!(matches!(polled, Poll::Ready(Ok(4))), "{polled:?}");
}

/// The same inside a handler: it answers a kept request whose asker's waker panics, and still
/// finishes its work (the next kept request and its own are answered), with no handler panic
/// counted against the endpoint.
#[test]
fn a_handler_answering_a_reply_whose_waker_panics_finishes_its_work() {
    let bus = Bus::builder().ask_timeout(WAIT).build().unwrap();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let endpoint =
        bus.register("keeper", Keeper { kept: Arc::clone(&kept), ..Keeper::default() }).unwrap();
    let mut first = pin!(endpoint.ask(KeepIt));
    let waker = Waker::from(Arc::new(PanickingWake));
    assert!(first.as_mut().poll(&mut TaskContext::from_waker(&waker)).is_pending());
    let second = endpoint.ask(KeepIt);
    wait_kept(&kept, 2);
    assert_eq!(endpoint.ask(AnswerKept(6)).wait_timeout(WAIT).unwrap(), 6);
    assert_eq!(second.wait_timeout(WAIT).unwrap(), 6);
    let polled =
        first.as_mut().poll(&mut TaskContext::from_waker(&Waker::from(Arc::new(NoopWake))));
    assert!(matches!(polled, Poll::Ready(Ok(6))), "{polled:?}");
    assert_eq!(endpoint.stats().panicked, 0);
    bus.shutdown().unwrap();
}

#[test]
fn a_waker_that_panics_when_a_panicking_handler_fails_its_reply_does_not_end_the_endpoint() {
    let bus = Bus::builder().ask_timeout(Duration::from_secs(30)).build().unwrap();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let endpoint =
        bus.register("keeper", Keeper { kept: Arc::clone(&kept), ..Keeper::default() }).unwrap();
    // Polled first, so failing the reply wakes this waker on the endpoint thread.
    let mut reply = pin!(endpoint.ask(PanicWhileHoldingIt));
    let waker = Waker::from(Arc::new(PanickingWake));
    assert!(reply.as_mut().poll(&mut TaskContext::from_waker(&waker)).is_pending());
    // The endpoint still serves: a later ask is handled and answered (an ended endpoint thread
    // would leave it to time out, or fail it with `NoReply`).
    let later = endpoint.ask(KeepIt);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while kept.lock().unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the endpoint stopped handling requests");
        std::thread::yield_now();
    }
    kept.lock().unwrap().pop().unwrap().reply(9);
    assert_eq!(later.wait().unwrap(), 9);
    // The failed reply carries the handler's panic.
    match reply.as_mut().poll(&mut TaskContext::from_waker(&Waker::from(Arc::new(NoopWake)))) {
        Poll::Ready(Err(AskError::HandlerPanicked { endpoint, message })) => {
            assert_eq!(endpoint, "keeper", "a polled reply's error names the endpoint asked");
            assert_eq!(message, "the handler panics holding the replier")
        }
        other => panic!("expected the handler's panic, got {other:?}"),
    }
    assert_eq!(endpoint.stats().panicked, 1);
    bus.shutdown().unwrap();
}

/// Waits (bounded) until the endpoint keeps `count` repliers.
fn wait_kept(kept: &Mutex<Vec<Replier<u32>>>, count: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while kept.lock().unwrap().len() < count {
        assert!(std::time::Instant::now() < deadline, "the asks never reached the endpoint");
        std::thread::yield_now();
    }
}

/// SPEC A.6: a request handler that raises fails its asker with the raised error itself (its
/// type intact); `on_error` gets it too. Other repliers the handler drops unanswered (kept
/// from earlier requests) fail with `NoReply`, at once, as anywhere else: the handler's error
/// is its own request's. A request's replier its handler dropped before panicking fails
/// with the panic's message.
#[test]
fn a_raising_handler_fails_its_own_asker_with_its_error_and_others_with_no_reply() {
    let bus = Bus::builder().build().unwrap();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let late_pair = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let keeper = Keeper {
        kept: Arc::clone(&kept),
        late_pair: Arc::clone(&late_pair),
        errors: Arc::clone(&errors),
    };
    let endpoint = bus.register("keeper", keeper).unwrap();
    let first = endpoint.ask(KeepIt);
    let second = endpoint.ask(KeepIt);
    wait_kept(&kept, 2);
    let raising = endpoint.ask(RaiseDroppingAll);
    for other in [first, second] {
        assert!(matches!(other.wait_timeout(WAIT), Err(AskError::NoReply { .. })));
    }
    match raising.wait_timeout(WAIT) {
        Err(AskError::Handler { source: cause, .. }) => {
            assert_eq!(cause.downcast_ref::<Raised>(), Some(&Raised(5)), "{cause:?}")
        }
        other => panic!("expected the raised error, got {other:?}"),
    }
    // `on_error` gets it as text (the asker took the error itself), with its cause; it runs
    // after the asker was answered.
    let deadline = std::time::Instant::now() + WAIT;
    while errors.lock().unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "on_error never ran");
        std::thread::yield_now();
    }
    assert_eq!(errors.lock().unwrap()[0], "raised 5: its cause");

    let third = endpoint.ask(KeepIt);
    wait_kept(&kept, 1);
    let panicking = endpoint.ask(DropAllThenPanic);
    assert!(matches!(third.wait_timeout(WAIT), Err(AskError::NoReply { .. })));
    match panicking.wait_timeout(WAIT) {
        Err(AskError::HandlerPanicked { message, .. }) => {
            assert_eq!(message, "the handler panics after dropping repliers")
        }
        other => panic!("expected the panic's message, got {other:?}"),
    }
    // A replier a handler makes and drops itself fails at once: its handler can wait for it.
    assert_eq!(endpoint.ask(PairInside).wait_timeout(WAIT).unwrap(), 1);
    // Also when it reuses the block of the request's own reply slot, freed by an answer to
    // an asker that gave up: it is not taken for the request's own replier.
    assert!(matches!(
        endpoint.ask(ReplyAfterGiveUp).wait_timeout(Duration::from_millis(1)),
        Err(AskError::Timeout { .. })
    ));
    assert_eq!(endpoint.ask(Echo(4)).wait_timeout(WAIT).unwrap(), 4);
    assert_eq!(late_pair.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The endpoint keeps serving (and this answer comes after the counts above were taken).
    assert_eq!(endpoint.ask(Echo(3)).wait_timeout(WAIT).unwrap(), 3);
    let stats = endpoint.stats();
    assert_eq!((stats.failed, stats.panicked), (1, 1));
    bus.shutdown().unwrap();
}
