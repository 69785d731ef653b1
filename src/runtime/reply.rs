//! Request-reply plumbing: the [`Replier`] a handler answers through, and the [`Reply`] handle
//! the asker waits on (blocking, with a timeout, or as a `Future`).
//!
//! Each ask gets one reply slot (module [`slot`]): a single heap block holding a small state
//! word, the outcome, and the asker's waiter (a thread to unpark or a task's waker). The slot
//! is this crate's own one-shot channel, shaped for the ask path:
//!
//! * The asker's common path has no read-modify-write and no clock read. With many asks in
//!   flight the oldest reply is usually there by the time the asker waits for it: one acquire
//!   load sees it, the asker reads the outcome and frees the block. A general one-shot channel
//!   (such as the `oneshot` crate) spends a swap on the receiver's drop to decide who frees;
//!   here the state machine decides it (the replier never touches the slot again once it has
//!   published), and the clock is read only once the reply was not there at first look.
//! * The replier publishes with one compare-exchange, which also tells it whether the asker is
//!   parked (then it takes the waiter and wakes it) or gone (then it frees the slot).
//! * No allocator call per ask: freed slot blocks go to a small per-thread cache and the
//!   asking thread's next ask takes one back (through mimalloc's aligned allocation path, a
//!   fresh block per ask costs about 200 instructions, more than the rest of the asker's side).
//!
//! A waiting asker spins briefly on the state, because an endpoint that is busy-polling
//! answers in well under a microsecond and parking would cost several; then it registers its
//! thread and parks until the reply or its deadline. An asker that gives up (timeout, or the
//! [`Reply`] dropped) hands the slot to the replier, whose later answer is dropped harmlessly.
//!
//! A handler that panics while it owns a `Replier` drops it during unwinding; the drop parks the
//! replier in a thread-local list, and the endpoint thread, once it has caught the panic, fails
//! each parked replier with the panic's message. Nothing of this runs unless a panic happens.
//!
//! A request handler that returns an error (SPEC A.6's "handler throws") fails its asker with
//! that error: its envelope names the request's reply slot, and the drop of that request's own
//! replier unanswered during its handler parks it until the handler returns
//! ([`RequestScope`]). The common path costs one thread-local store before the handler and
//! one load after it.

use std::{
    cell::{Cell, RefCell},
    future::Future,
    pin::Pin,
    task::{Context as TaskContext, Poll},
    time::{Duration, Instant},
};

use self::slot::{Completer, Receiver, Waiter};
#[cfg(not(loom))]
use super::ask_timer::Armed;
use crate::{
    error::{AskError, HandlerError},
    sync::{current_thread, park_timeout, spin_loop},
};

/// How long a waiting asker spins before it parks (not at all under loom, where the clock is
/// not modelled and the number of spins must not depend on it).
const ASKER_SPIN: Duration = if cfg!(loom) { Duration::ZERO } else { Duration::from_micros(30) };

/// Polls of the state between two clock reads while the asker spins (one under loom, whose
/// every spin is a scheduling point).
const SPINS_PER_CLOCK_READ: u32 = if cfg!(loom) { 1 } else { 64 };

/// Longest single park of a waiting asker; it re-checks and parks again (an unpark wakes it at
/// once, this only bounds the sleep of an asker without a deadline).
const PARK_MAX: Duration = Duration::from_millis(100);

/// Default timeout of a [`Replier::pair`] reply (no bus, so no `ask_timeout` setting).
const PAIR_TIMEOUT: Duration = Duration::from_secs(120);

/// Fails one orphaned reply with a panic message.
type FailWithPanic = Box<dyn FnOnce(&str)>;

/// Fails the reply its request handler dropped without replying.
type FailDropped = Box<dyn FnOnce(Unanswered)>;

thread_local! {
    /// Repliers dropped while their handler was panicking, waiting for the panic message.
    static ORPHANED_BY_PANIC: RefCell<Vec<FailWithPanic>> = const {
        RefCell::new(Vec::new())
    };
    /// The reply slot of the request whose handler runs on this thread ([`RequestScope`]): 0
    /// outside a request handler, [`OWN_REPLIER_DROPPED`] once the handler dropped that
    /// request's replier without replying (one load at the handler's return tells).
    static CURRENT_REQUEST: Cell<usize> = const { Cell::new(0) };
    /// That replier, waiting for what its handler returns: its error, if it returns one
    /// (SPEC A.6: the asker fails with the thrown error), else [`AskError::NoReply`].
    static DROPPED_OWN_REPLIER: RefCell<Option<FailDropped>> = const { RefCell::new(None) };
}

/// [`CURRENT_REQUEST`] once the running handler dropped its request's replier unanswered (no
/// slot has this address: slots are aligned).
const OWN_REPLIER_DROPPED: usize = usize::MAX;

/// The time a request handler runs on an endpoint thread. If the handler drops its request's
/// own replier (the one whose slot the envelope named) without replying, the asker is failed
/// when the handler returns ([`RequestScope::finish`]), with the handler's error if it
/// returns one. Any other replier dropped unanswered fails with [`AskError::NoReply`] at once,
/// as outside a handler. Dropped during a panic, the scope ends (the held replier is then
/// failed with the panic's message, [`fail_replies_orphaned_by_panic`]).
pub(crate) struct RequestScope(());

impl RequestScope {
    /// Enters the handler of the request whose reply slot is at `slot`.
    #[inline(always)]
    pub(crate) fn enter(slot: usize) -> Self {
        CURRENT_REQUEST.with(|current| current.set(slot));
        RequestScope(())
    }

    /// After the handler returned `outcome`: fails the request's replier if the handler
    /// dropped it unanswered, with the handler's error itself (then given back as text, for
    /// `on_error`), else with [`AskError::NoReply`]. Returns the outcome, the error intact
    /// when the asker did not take it.
    #[inline(always)]
    pub(crate) fn finish(self, outcome: Result<(), HandlerError>) -> Result<(), HandlerError> {
        // `Drop` would clear the slot again.
        std::mem::forget(self);
        if CURRENT_REQUEST.with(|current| current.replace(0)) == OWN_REPLIER_DROPPED {
            return fail_dropped_own_replier(outcome);
        }
        outcome
    }
}

impl Drop for RequestScope {
    /// Only when the handler panicked (else [`RequestScope::finish`] ran).
    fn drop(&mut self) {
        let _ = CURRENT_REQUEST.try_with(|current| current.set(0));
    }
}

/// Before a replier's answer: if it is the running handler's own request's, nothing may match
/// that request's slot any more. Once answered, the slot can be freed (its asker gave up)
/// and its block reused, by a replier the same handler then makes (`Replier::pair`, a nested
/// ask): that one must not be taken for the request's own.
#[inline(always)]
fn answered<T>(completer: &Completer<T>) {
    let _ = CURRENT_REQUEST.try_with(|current| {
        if current.get() == completer.address() {
            current.set(0);
        }
    });
}

/// [`RequestScope::finish`]'s rare part.
#[cold]
fn fail_dropped_own_replier(outcome: Result<(), HandlerError>) -> Result<(), HandlerError> {
    // The text first: `Display` is the endpoint's code, and should it panic, the replier is
    // still held and the endpoint loop fails it with the panic's message.
    let failed = outcome.map_err(|error| {
        let text = crate::error::message_with_causes(&*error);
        (error, text)
    });
    let Some(fail) = DROPPED_OWN_REPLIER.with(|held| held.borrow_mut().take()) else {
        return failed.map_err(|(error, _)| error);
    };
    let (error, returned) = match failed {
        Ok(()) => (Unanswered::NoReply, Ok(())),
        Err((error, text)) => {
            (Unanswered::Handler(error), Err(Box::new(HandlerErrorText(text)) as HandlerError))
        }
    };
    fail(error);
    returned
}

/// A handler's error as text: what the endpoint's `on_error` gets when the asker took the
/// error itself.
#[derive(Debug)]
struct HandlerErrorText(String);

impl std::fmt::Display for HandlerErrorText {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl std::error::Error for HandlerErrorText {}

/// Whether a panic left replies waiting for its message on this thread (a handler that
/// caught a panic itself leaves them behind without the endpoint loop seeing a panic).
pub(crate) fn has_orphaned_replies() -> bool {
    ORPHANED_BY_PANIC.with(|list| !list.borrow().is_empty())
        || DROPPED_OWN_REPLIER.with(|held| held.borrow().is_some())
}

/// Fails every reply that a panicking handler dropped, with the panic's message.
///
/// Failing a reply wakes its asker's task, and a waker is the asker's code: one that panics
/// is logged (the slot catches a waker's panic, on its wake-up or its drop) and the others are
/// still failed. The caller (the endpoint loop, outside its per-round `catch_unwind`) must not
/// unwind, or the endpoint thread would end.
pub(crate) fn fail_replies_orphaned_by_panic(panic_message: &str) {
    // The request's replier, if its handler dropped it before it panicked, did not get the
    // handler's outcome either.
    if let Some(fail) = DROPPED_OWN_REPLIER.with(|held| held.borrow_mut().take()) {
        fail(Unanswered::Panicked(panic_message.to_owned()));
    }
    let orphaned = ORPHANED_BY_PANIC.with(|list| std::mem::take(&mut *list.borrow_mut()));
    for fail in orphaned {
        fail(panic_message);
    }
}

/// A connected replier and reply handle whose [`Reply::wait`] and `.await` use
/// `default_timeout`, and whose errors name `endpoint` (empty: none).
pub(crate) fn request_pair<T: Send + 'static>(
    default_timeout: Duration,
    endpoint: &'static str,
) -> (Replier<T>, Reply<T>) {
    let (completer, receiver) = slot::channel();
    (
        Replier { completer: Some(completer) },
        Reply {
            state: ReplyState::Pending(receiver),
            default_timeout,
            endpoint,
            deadline: None,
            timer: None,
        },
    )
}

/// The answering side of one request: answer exactly once with [`reply`](Replier::reply) or
/// [`fail`](Replier::fail). It may be kept and answered later, from any thread (this is how
/// durable work is acknowledged once the WAL has synced it).
///
/// Dropping it unanswered gives the asker [`AskError::NoReply`], except while the handler of
/// its own request runs: then the asker fails once that handler returns, with the handler's
/// error if it returns one ([`crate::Endpoint::handle_request`]), or with the panic's message
/// if it panics. If the asker already gave up (timed out or dropped its [`Reply`]), answering
/// is harmless and does nothing.
#[must_use = "a request must be answered with reply() or fail()"]
pub struct Replier<T: Send + 'static> {
    /// `None` once answered (or handed to the panic list).
    completer: Option<Completer<T>>,
}

impl<T: Send + 'static> std::fmt::Debug for Replier<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Replier").field("answered", &self.completer.is_none()).finish()
    }
}

impl<T: Send + 'static> Replier<T> {
    /// The address of its reply slot (0 once answered): names the request in its envelope.
    pub(crate) fn slot_address(&self) -> usize {
        self.completer.as_ref().map_or(0, Completer::address)
    }

    /// A connected replier and reply handle, not bound to any endpoint (for driving a state
    /// machine directly, in tests or embeddings without the bus). [`Reply::wait`] on it waits
    /// at most 120 s.
    pub fn pair() -> (Replier<T>, Reply<T>) {
        request_pair(PAIR_TIMEOUT, "")
    }

    /// Answers with `value`.
    pub fn reply(mut self, value: T) {
        if let Some(completer) = self.completer.take() {
            answered(&completer);
            completer.complete(Ok(value));
        }
    }

    /// Answers with a failure; the asker sees [`AskError::Handler`] with `error` as its cause.
    pub fn fail(mut self, error: impl Into<HandlerError>) {
        if let Some(completer) = self.completer.take() {
            answered(&completer);
            completer.complete(Err(Unanswered::Handler(error.into())));
        }
    }

    /// Whether the asker has stopped waiting (a reply would be discarded).
    pub fn is_abandoned(&self) -> bool {
        self.completer.as_ref().is_none_or(Completer::is_abandoned)
    }

    /// Whether the asker has registered to be woken (it is parked or about to park).
    #[cfg(all(test, not(loom)))]
    fn asker_registered(&self) -> bool {
        self.completer.as_ref().is_some_and(Completer::asker_registered)
    }
}

impl<T: Send + 'static> Drop for Replier<T> {
    fn drop(&mut self) {
        let Some(completer) = self.completer.take() else {
            return;
        };
        if std::thread::panicking() && !super::endpoint::on_endpoint_thread() {
            // No endpoint loop here to catch the panic and pass its message on (a replier
            // moved to another thread, a panic in the asker's own code): fail it at once
            // rather than let the asker wait out its timeout.
            completer.complete(Err(Unanswered::Panicked(
                "the replier was dropped by a panicking thread that is not an endpoint thread \
                 (the panic's message is not known here)"
                    .to_owned(),
            )));
        } else if std::thread::panicking() {
            let fail = move |panic_message: &str| {
                completer.complete(Err(Unanswered::Panicked(panic_message.to_owned())));
            };
            // try_with: during thread teardown the list may be gone; then the closure (and the
            // completer in it) is dropped here and the asker sees NoReply, which is still an
            // error and never a hang.
            let _ = ORPHANED_BY_PANIC.try_with(|list| list.borrow_mut().push(Box::new(fail)));
        } else if CURRENT_REQUEST.try_with(Cell::get) == Ok(completer.address()) {
            // The running handler's own request: failed when the handler returns, with its
            // error if it returns one. (try_with: during thread teardown the closure is
            // dropped here, and the asker sees NoReply.)
            let fail = move |error: Unanswered| completer.complete(Err(error));
            let _ = DROPPED_OWN_REPLIER.try_with(|held| *held.borrow_mut() = Some(Box::new(fail)));
            let _ = CURRENT_REQUEST.try_with(|current| current.set(OWN_REPLIER_DROPPED));
        } else {
            completer.complete(Err(Unanswered::NoReply));
        }
    }
}

/// How the answering side failed a request: what a reply slot carries in place of an
/// [`AskError`]. The answering side does not know the endpoint's name, which the asker's
/// [`Reply`] adds ([`Unanswered::asked`]); and this type is smaller than an `AskError`, which
/// keeps the slot (a heap block per ask) small.
#[derive(Debug)]
pub(crate) enum Unanswered {
    /// The replier was dropped without an answer.
    NoReply,
    /// The handler failed the request with this error.
    Handler(HandlerError),
    /// The handler panicked with this message.
    Panicked(String),
}

impl Unanswered {
    /// The asker's error, naming `endpoint`.
    #[cold]
    #[inline(never)]
    fn asked(self, endpoint: &str) -> AskError {
        let endpoint = endpoint.to_owned();
        match self {
            Self::NoReply => AskError::NoReply { endpoint },
            Self::Handler(source) => AskError::Handler { endpoint, source },
            Self::Panicked(message) => AskError::HandlerPanicked { endpoint, message },
        }
    }
}

/// A slot's outcome as the asker gets it: its error, if any, naming `endpoint`.
#[inline(always)]
fn answered_to<T>(outcome: Result<T, Unanswered>, endpoint: &str) -> Result<T, AskError> {
    outcome.map_err(|unanswered| unanswered.asked(endpoint))
}

enum ReplyState<T> {
    Pending(Receiver<T>),
    /// Failed before it was queued, or already taken (`None`: later takes see `NoReply`).
    /// Boxed: an error is the rare case, and an [`AskError`] would double the reply's size.
    Failed(Option<Box<AskError>>),
}

/// The asking side of one request: wait for it blocking ([`wait`](Reply::wait),
/// [`wait_timeout`](Reply::wait_timeout)) or `.await` it (no particular async runtime needed).
///
/// Dropping it before the reply came is allowed: the reply is then discarded when it arrives.
#[must_use = "a reply does nothing unless waited on or awaited"]
pub struct Reply<T> {
    state: ReplyState<T>,
    /// Timeout of [`Reply::wait`] and of awaiting: the bus's `ask_timeout`.
    default_timeout: Duration,
    /// The endpoint asked, named by the errors the asker gets (empty for [`Replier::pair`]).
    /// Interned when the endpoint was registered: a copy of two words per ask.
    endpoint: &'static str,
    /// The deadline of [`Reply::wait`] and of awaiting, once fixed (`Some(None)`: no deadline,
    /// the timeout being too large for the clock): `ask_timeout` after the wait for room began,
    /// for an ask that waited for room in a full inbox (fixed when it was queued: that wait
    /// counts against `ask_timeout`), or else `ask_timeout` after the first poll. Not fixed,
    /// [`Reply::wait`] waits `default_timeout` from its own start.
    deadline: Option<Option<Instant>>,
    /// That deadline, armed in the ask timer while the awaited reply is pending (dropping it
    /// disarms it). Boxed: one word in every reply, which only an awaited one fills (a blocking
    /// ask's handle stays as small as it was: it is made and dropped on the ask path).
    #[cfg(not(loom))]
    timer: Option<Box<Armed>>,
    #[cfg(loom)]
    timer: Option<()>,
}

impl<T> std::fmt::Debug for Reply<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            ReplyState::Pending(receiver) if receiver.is_ready() => "ready",
            ReplyState::Pending(_) => "pending",
            ReplyState::Failed(Some(_)) => "failed",
            ReplyState::Failed(None) => "taken",
        };
        formatter.debug_struct("Reply").field("state", &state).finish()
    }
}

impl<T> Reply<T> {
    pub(crate) fn failed(error: AskError, endpoint: &'static str) -> Self {
        Self {
            state: ReplyState::Failed(Some(Box::new(error))),
            default_timeout: Duration::ZERO,
            endpoint,
            deadline: None,
            timer: None,
        }
    }

    /// [`AskError::NoReply`] naming the endpoint asked.
    #[cold]
    fn no_reply(&self) -> Result<T, AskError> {
        Err(Unanswered::NoReply.asked(self.endpoint))
    }

    /// Fixes the deadline of waiting and awaiting (`None`: no deadline): for an ask that
    /// waited for room, `ask_timeout` after that wait began.
    pub(crate) fn with_deadline(mut self, deadline: Option<Instant>) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Waits for the reply for at most the bus's `ask_timeout`. For an ask that first waited
    /// for room in a full inbox, that wait counts: the reply is waited for until `ask_timeout`
    /// after the ask began to wait for room, so the ask as a whole takes at most about
    /// `ask_timeout`. A reply already polled as a `Future` keeps the deadline its first poll
    /// fixed.
    ///
    /// # Errors
    /// Every [`AskError`]: the endpoint was stopped, the inbox stayed full (`Full`), the
    /// handler failed, panicked or dropped the request, the ask came from the endpoint's own
    /// handler (`SelfAsk`), or the timeout passed (`Timeout` naming `ask_timeout`).
    pub fn wait(self) -> Result<T, AskError> {
        let (timeout, deadline) = (self.default_timeout, self.deadline);
        self.wait_until(timeout, deadline)
    }

    /// Waits for the reply for at most `timeout` from now; a reply arriving later is
    /// discarded.
    ///
    /// # Errors
    /// As [`Reply::wait`], with [`AskError::Timeout`] naming `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T, AskError> {
        self.wait_until(timeout, None)
    }

    /// The body of [`Reply::wait`] and [`Reply::wait_timeout`]: waits until `fixed_deadline`
    /// if there is one (`Some(None)`: no deadline), else for `timeout` from the first look
    /// that finds no reply (so that look reads no clock); a timeout reports `timeout`.
    fn wait_until(
        self,
        timeout: Duration,
        fixed_deadline: Option<Option<Instant>>,
    ) -> Result<T, AskError> {
        let endpoint = self.endpoint;
        let receiver = match self.state {
            ReplyState::Pending(receiver) => receiver,
            ReplyState::Failed(Some(error)) => return Err(*error),
            ReplyState::Failed(None) => return Err(Unanswered::NoReply.asked(endpoint)),
        };
        // First look without reading the clock: with many asks in flight the reply is usually
        // there already.
        let mut receiver = match receiver.try_take() {
            Ok(outcome) => return answered_to(outcome, endpoint),
            Err(receiver) => receiver,
        };
        let start = Instant::now();
        // No deadline if `timeout` is too large to represent: wait until the reply comes.
        let deadline = fixed_deadline.unwrap_or_else(|| start.checked_add(timeout));
        let spin_for = deadline.map_or(ASKER_SPIN, |deadline| {
            ASKER_SPIN.min(deadline.saturating_duration_since(start))
        });
        let mut spins = 0u32;
        loop {
            if receiver.is_ready() {
                return answered_to(receiver.take_ready(), endpoint);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(SPINS_PER_CLOCK_READ) && start.elapsed() >= spin_for {
                break;
            }
            spin_loop();
        }
        if !receiver.register(Waiter::Thread(current_thread())) {
            return answered_to(receiver.take_ready(), endpoint);
        }
        loop {
            let remaining = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::MAX,
            };
            if remaining.is_zero() {
                // A reply that won the race with the deadline is still delivered.
                if receiver.unregister() {
                    return answered_to(receiver.take_ready(), endpoint);
                }
                // Dropping the receiver hands the slot to the replier.
                return Err(AskError::Timeout { endpoint: endpoint.to_owned(), timeout });
            }
            park_timeout(remaining.min(PARK_MAX));
            if receiver.is_ready() {
                return answered_to(receiver.take_ready(), endpoint);
            }
        }
    }

    /// The reply if it has arrived, without waiting; `None` while it is still pending.
    pub fn try_take(&mut self) -> Option<Result<T, AskError>> {
        match &mut self.state {
            ReplyState::Failed(error) => {
                self.timer = None;
                Some(match error.take() {
                    Some(error) => Err(*error),
                    None => self.no_reply(),
                })
            }
            ReplyState::Pending(receiver) if receiver.is_ready() => {
                self.timer = None;
                let ReplyState::Pending(receiver) =
                    std::mem::replace(&mut self.state, ReplyState::Failed(None))
                else {
                    unreachable!("matched Pending just above");
                };
                Some(answered_to(receiver.take_ready(), self.endpoint))
            }
            ReplyState::Pending(_) => None,
        }
    }
}

/// Awaiting a reply honours the bus's `ask_timeout`, with any executor: the deadline is fixed
/// at the first poll (or earlier, for an ask that waited for room: [`Reply::wait`]), and a
/// reply still pending arms it in the crate's ask timer (one thread for the process, module
/// `ask_timer`), which wakes the task then; the poll that follows fails with
/// [`AskError::Timeout`]. So a reply that never comes (a handler that keeps its `Replier` and
/// never answers) still ends. Should the system refuse the timer's thread, the deadline is only
/// checked when something else polls the task (a warning says so); the same holds under Miri,
/// where no reply arms the timer (its thread never ends, which Miri reports), also in the tests
/// of a crate that embeds this one. The `ask` call itself may block while the inbox is full;
/// async callers ask with [`EndpointRef::try_ask`](crate::EndpointRef::try_ask).
impl<T> Future for Reply<T> {
    type Output = Result<T, AskError>;

    fn poll(self: Pin<&mut Self>, task: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some(outcome) = this.try_take() {
            return Poll::Ready(outcome);
        }
        // `None` inside: a timeout too large for the clock, no deadline.
        let deadline =
            *this.deadline.get_or_insert_with(|| Instant::now().checked_add(this.default_timeout));
        let ReplyState::Pending(receiver) = &mut this.state else {
            unreachable!("try_take leaves only a pending reply behind");
        };
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            this.timer = None;
            if receiver.unregister() {
                return Poll::Ready(this.try_take().unwrap_or_else(|| this.no_reply()));
            }
            // Dropping the receiver hands the slot to the replier.
            this.state = ReplyState::Failed(None);
            let timeout = this.default_timeout;
            return Poll::Ready(Err(AskError::Timeout {
                endpoint: this.endpoint.to_owned(),
                timeout,
            }));
        }
        if receiver.register(Waiter::Task(task.waker().clone())) {
            #[cfg(not(loom))]
            if let Some(deadline) = deadline.filter(|_| !cfg!(miri)) {
                match &mut this.timer {
                    Some(armed) => armed.update(task.waker()),
                    None => this.timer = Armed::new(deadline, task.waker()).map(Box::new),
                }
            }
            Poll::Pending
        } else {
            this.timer = None;
            Poll::Ready(this.try_take().unwrap_or_else(|| this.no_reply()))
        }
    }
}

/// The reply slot: one heap block shared by a [`Completer`] (inside the `Replier`) and a
/// [`Receiver`] (inside the `Reply`), with ownership handed over through one state byte.
///
/// States and who owns what (the transitions are the only writes of `state`):
///
/// | state       | outcome cell            | waiter cell | set by                          |
/// | ----------- | ----------------------- | ----------- | ------------------------------- |
/// | `EMPTY`     | completer (may write)   | receiver    | start; receiver (unregister)    |
/// | `WAITING`   | completer (may write)   | untouched   | receiver (register)             |
/// | `WAKING`    | completer               | completer   | completer (takes the waiter)    |
/// | `READY`     | receiver (initialized)  | receiver    | completer (publication)         |
/// | `ABANDONED` | completer               | completer   | receiver (gave up)              |
///
/// In `WAITING` the waiter cell holds the receiver's waiter and nobody touches it: the
/// completer takes it only after moving to `WAKING`, the receiver only after moving back to
/// `EMPTY` (or, abandoning, leaves it for the completer to drop with the block).
///
/// `READY` and `ABANDONED` are final, and each hands the whole block to one side, which frees
/// it: the receiver after taking the outcome, the completer once it arrives (dropping its
/// outcome unread). Whoever frees has acquired the other side's release of its last write, so
/// no access can race with the free. The completer never touches the block after it published
/// `READY`: in the `WAITING` case it first moves the waiter out under `WAKING`, then publishes,
/// then wakes the waiter it owns.
///
/// The asker's waits therefore cost acquire loads only (no read-modify-write), and the
/// completer one compare-exchange when nobody waits (the usual case with asks in flight).
/// The protocol is the classic one-shot channel with a waker slot (as in the `oneshot` and
/// `futures::channel::oneshot` crates), with the state deciding deallocation instead of a
/// reference count. The loom models at the end of this file check it.
mod slot {
    #![allow(unsafe_code)]

    #[cfg(not(loom))]
    use std::alloc::Layout;
    use std::{mem::MaybeUninit, ptr::NonNull, task::Waker};

    use crate::{
        runtime::reply::Unanswered,
        sync::{spin_loop, yield_now, AtomicU8, Ordering, Thread, UnsafeCell},
    };

    /// No outcome yet; the asker is not registered for a wake-up.
    const EMPTY: u8 = 0;
    /// No outcome yet; the asker stored a waiter and may be parked.
    const WAITING: u8 = 1;
    /// The completer is moving the waiter out before publishing (lasts a few instructions).
    const WAKING: u8 = 2;
    /// The outcome is written; the block belongs to the receiver.
    const READY: u8 = 3;
    /// The asker gave up; the block belongs to the completer.
    const ABANDONED: u8 = 4;

    /// Spins on a transient state before yielding the processor (the other side may have been
    /// preempted inside its few-instruction critical section).
    const SPINS_BEFORE_YIELD: u32 = 64;

    /// How a parked asker is woken.
    pub(crate) enum Waiter {
        /// A thread blocked in `wait_timeout`.
        Thread(Thread),
        /// A task awaiting the reply.
        Task(Waker),
    }

    impl Waiter {
        /// Wakes the asker. A task's waker is the asker's code; one that panics is logged and
        /// does not unwind into whoever answered (a handler midway through its work, or a
        /// thread already unwinding, where a second panic would abort the process).
        fn wake(self) {
            match self {
                Self::Thread(thread) => thread.unpark(),
                Self::Task(waker) => run_asker_code("woken", || waker.wake()),
            }
        }
    }

    struct Slot<T> {
        /// One of the constants above; the ownership table of the module doc says who may
        /// move it where. Transitions into `WAITING` and `ABANDONED` (receiver) and into
        /// `READY` (completer) are release operations; every read that leads to touching a
        /// cell is an acquire.
        state: AtomicU8,
        /// `Some` only while the receiver is registered (`WAITING`), or transiently while it
        /// re-registers or after a registration that lost to `READY`.
        waiter: UnsafeCell<Option<Waiter>>,
        /// Initialized once the completer wrote it (always before `READY`; possibly before it
        /// found `ABANDONED`, then it drops it itself).
        outcome: UnsafeCell<MaybeUninit<Result<T, Unanswered>>>,
    }

    /// A new slot: its completer and its receiver.
    pub(crate) fn channel<T>() -> (Completer<T>, Receiver<T>) {
        let slot = allocate(Slot {
            state: AtomicU8::new(EMPTY),
            waiter: UnsafeCell::new(None),
            outcome: UnsafeCell::new(MaybeUninit::uninit()),
        });
        (Completer { slot }, Receiver { slot })
    }

    /// Moves `slot` to a block from this thread's cache, or to a new one.
    #[cfg(not(loom))]
    fn allocate<T>(slot: Slot<T>) -> NonNull<Slot<T>> {
        let layout = Layout::new::<Slot<T>>();
        let block = cache::take(layout).unwrap_or_else(|| {
            // SAFETY: the layout is not zero-sized (a slot holds at least its state byte).
            let raw = unsafe { std::alloc::alloc(layout) };
            NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        });
        let block = block.cast::<Slot<T>>();
        // SAFETY: the block is valid for writes of `layout`, the layout of `Slot<T>`, and
        // holds no live value (fresh, or cached only after its slot was dropped in place).
        unsafe { block.as_ptr().write(slot) };
        block
    }

    /// Loom tracks its cells and atomics per object: plain boxes, no block reuse.
    #[cfg(loom)]
    fn allocate<T>(slot: Slot<T>) -> NonNull<Slot<T>> {
        NonNull::from(Box::leak(Box::new(slot)))
    }

    /// Drops a slot whose outcome has been moved out or dropped, or was never written, and
    /// gives its block back to this thread's cache (or to the allocator).
    ///
    /// # Safety
    /// `slot` came from `channel`, the caller owns it exclusively (the state is `READY` and
    /// the caller is the receiver, or `ABANDONED` and the caller is the completer, with that
    /// state read by an acquire), and nothing uses it afterwards.
    unsafe fn free<T>(slot: NonNull<Slot<T>>) {
        // SAFETY: per the caller's duty the slot is exclusively ours; nobody else touches the
        // waiter cell again.
        let waiter = unsafe { slot.as_ref() }.waiter.with_mut(|cell| unsafe { (*cell).take() });
        drop_waiter_caught(waiter);
        #[cfg(not(loom))]
        {
            let layout = Layout::new::<Slot<T>>();
            // SAFETY: per the caller's duty the slot is initialized, exclusively ours and
            // never used again. The outcome is `MaybeUninit`, so it is not dropped here, and
            // the waiter was taken out above: dropping the rest runs no foreign code.
            unsafe { std::ptr::drop_in_place(slot.as_ptr()) };
            if let Err(block) = cache::give(layout, slot.cast()) {
                // SAFETY: the block was allocated with `layout` (by `allocate` for this type,
                // or for another type of the same layout) and holds no live value.
                unsafe { std::alloc::dealloc(block.as_ptr(), layout) };
            }
        }
        #[cfg(loom)]
        {
            // SAFETY: the block came from `Box::leak` in `allocate` and, per the caller's
            // duty, no other reference to it exists or will be used.
            drop(unsafe { Box::from_raw(slot.as_ptr()) });
        }
    }

    /// Drops an asker's waiter left in a slot being freed. A task's `Waker` is the asker's code,
    /// and one whose drop panics is logged: it must not unwind into whoever frees the slot (a
    /// handler answering an abandoned ask, or the endpoint loop failing orphaned replies
    /// outside its per-round `catch_unwind`), nor leak the block.
    fn drop_waiter_caught(waiter: Option<Waiter>) {
        if let Some(Waiter::Task(waker)) = waiter {
            run_asker_code("dropped", || drop(waker));
        }
    }

    /// Runs the asker's waker code `run` (its waker being woken or dropped); a panic in it is
    /// logged, not unwound into the caller. Under loom it runs uncaught: a panic there is the
    /// model's verdict.
    fn run_asker_code(when: &str, run: impl FnOnce()) {
        #[cfg(loom)]
        let _ = when;
        #[cfg(loom)]
        run();
        #[cfg(not(loom))]
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).is_err() {
            tracing::warn!("an asker's waker panicked when it was {when}");
        }
    }

    /// A per-thread cache of free slot blocks, by layout, so that an ask costs no trip to the
    /// allocator: a thread that keeps asks in flight frees each reply's block and takes it
    /// again for its next ask. Blocks freed by the replier's thread (an abandoned ask) go to
    /// that thread's cache; a block may serve any type of the same layout. Bounded: at most
    /// [`cache::BLOCKS_PER_LAYOUT`] blocks for each of [`cache::LAYOUTS_MAX`] layouts per
    /// thread, blocks of at most [`cache::BLOCK_BYTES_MAX`] bytes; the rest go back to the
    /// allocator, and so does the cache when its thread ends.
    #[cfg(not(loom))]
    mod cache {
        use std::{alloc::Layout, cell::RefCell, ptr::NonNull};

        /// Cached blocks per layout (a thread with more asks in flight allocates the excess).
        pub(super) const BLOCKS_PER_LAYOUT: usize = 256;
        /// Layouts cached per thread (one per reply type size and alignment in practice).
        pub(super) const LAYOUTS_MAX: usize = 8;
        /// Largest block cached: a slot holds its reply inline, and a cache of big replies'
        /// blocks would hold megabytes per thread (at most 8 x 256 x 512 B = 1 MiB here).
        pub(super) const BLOCK_BYTES_MAX: usize = 512;

        struct Cache {
            /// Free blocks, each allocated with the global allocator and the layout it is
            /// filed under, holding no live value.
            free_by_layout: Vec<(Layout, Vec<NonNull<u8>>)>,
        }

        impl Drop for Cache {
            fn drop(&mut self) {
                for (layout, blocks) in self.free_by_layout.drain(..) {
                    for block in blocks {
                        // SAFETY: filed under `layout`, allocated with it, no live value,
                        // and the cache is the block's only owner.
                        unsafe { std::alloc::dealloc(block.as_ptr(), layout) };
                    }
                }
            }
        }

        thread_local! {
            static CACHE: RefCell<Cache> = const {
                RefCell::new(Cache { free_by_layout: Vec::new() })
            };
        }

        /// A free block of `layout`, if this thread has one.
        #[inline]
        pub(super) fn take(layout: Layout) -> Option<NonNull<u8>> {
            if layout.size() > BLOCK_BYTES_MAX {
                return None;
            }
            // try_with: during thread teardown the cache may be gone; allocate instead.
            CACHE
                .try_with(|cache| {
                    let mut cache = cache.borrow_mut();
                    let (_, blocks) =
                        cache.free_by_layout.iter_mut().find(|(filed, _)| *filed == layout)?;
                    blocks.pop()
                })
                .ok()
                .flatten()
        }

        /// Files a free block of `layout` (allocated with it, holding no live value), or
        /// hands it back if the cache is full or gone.
        #[inline]
        pub(super) fn give(layout: Layout, block: NonNull<u8>) -> Result<(), NonNull<u8>> {
            if layout.size() > BLOCK_BYTES_MAX {
                return Err(block);
            }
            CACHE
                .try_with(|cache| {
                    let mut cache = cache.borrow_mut();
                    let index =
                        match cache.free_by_layout.iter().position(|(filed, _)| *filed == layout) {
                            Some(index) => index,
                            None if cache.free_by_layout.len() < LAYOUTS_MAX => {
                                cache.free_by_layout.push((layout, Vec::new()));
                                cache.free_by_layout.len() - 1
                            }
                            None => return Err(block),
                        };
                    let blocks = &mut cache.free_by_layout[index].1;
                    if blocks.len() < BLOCKS_PER_LAYOUT {
                        blocks.push(block);
                        Ok(())
                    } else {
                        Err(block)
                    }
                })
                .unwrap_or(Err(block))
        }

        /// Blocks of `layout` cached by this thread.
        #[cfg(test)]
        pub(super) fn cached(layout: Layout) -> usize {
            CACHE.with(|cache| {
                let cache = cache.borrow();
                cache
                    .free_by_layout
                    .iter()
                    .find(|(filed, _)| *filed == layout)
                    .map_or(0, |(_, blocks)| blocks.len())
            })
        }
    }

    #[cfg(all(test, not(loom)))]
    mod tests {
        use super::*;

        #[test]
        fn an_abandoned_reply_whose_drop_panics_still_frees_its_block() {
            struct PanicsOnDrop;
            impl Drop for PanicsOnDrop {
                fn drop(&mut self) {
                    panic!("the reply's drop panics");
                }
            }
            let layout = Layout::new::<Slot<PanicsOnDrop>>();
            let (completer, receiver) = channel::<PanicsOnDrop>();
            drop(receiver);
            let cached_before = cache::cached(layout);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                completer.complete(Ok(PanicsOnDrop));
            }));
            assert!(outcome.is_err(), "the reply's drop panicked through `complete`");
            assert_eq!(cache::cached(layout), cached_before + 1, "the block went back");
        }

        #[test]
        fn a_taken_reply_block_serves_the_next_ask_and_the_cache_is_bounded() {
            let (completer, receiver) = channel::<u64>();
            let first = receiver.slot;
            completer.complete(Ok(1));
            assert_eq!(receiver.take_ready().expect("ok"), 1);
            let (completer, receiver) = channel::<u64>();
            assert_eq!(receiver.slot, first, "the freed block was taken again");
            drop(completer);
            assert!(matches!(receiver.take_ready(), Err(Unanswered::NoReply)));

            // A type of another layout gets its own blocks; many in flight at once fill the
            // cache up to its bound and no further.
            let layout = Layout::new::<Slot<[u64; 9]>>();
            let in_flight = cache::BLOCKS_PER_LAYOUT + 10;
            let pairs: Vec<_> = (0..in_flight).map(|_| channel::<[u64; 9]>()).collect();
            assert_eq!(cache::cached(layout), 0);
            for (completer, receiver) in pairs {
                completer.complete(Ok([7; 9]));
                assert_eq!(receiver.take_ready().expect("ok"), [7; 9]);
            }
            assert_eq!(cache::cached(layout), cache::BLOCKS_PER_LAYOUT);
        }
    }

    /// Backs off while the other side is inside a transient state.
    fn back_off(spins: &mut u32) {
        *spins += 1;
        if *spins < SPINS_BEFORE_YIELD {
            spin_loop();
        } else {
            yield_now();
        }
    }

    /// The replier's half. Dropping it unanswered completes with `Unanswered::NoReply`.
    pub(crate) struct Completer<T> {
        slot: NonNull<Slot<T>>,
    }

    // SAFETY: the completer moves a `T` or an `Unanswered` into the slot (hence `T: Send`;
    // `Unanswered` is `Send`: a `String` or a `HandlerError`, which is `Send + Sync`) and may
    // run on any thread; every access to the shared block is ordered by the state protocol of
    // the module doc, never by the thread it runs on.
    unsafe impl<T: Send> Send for Completer<T> {}
    // SAFETY: through `&Completer` only `is_abandoned` runs, an atomic load.
    unsafe impl<T: Send> Sync for Completer<T> {}

    impl<T> Completer<T> {
        fn slot(&self) -> &Slot<T> {
            // SAFETY: the block stays allocated while the completer exists: only `READY`
            // (which this completer alone sets, in `complete`, after which it is gone) lets
            // the receiver free it.
            unsafe { self.slot.as_ref() }
        }

        /// The slot's address: which request this completer answers (never 0, and never
        /// `usize::MAX`: the block is aligned).
        pub(crate) fn address(&self) -> usize {
            self.slot.as_ptr() as usize
        }

        /// Whether the asker gave up (an answer would be dropped).
        pub(crate) fn is_abandoned(&self) -> bool {
            self.slot().state.load(Ordering::Relaxed) == ABANDONED
        }

        /// Whether the receiver is registered for a wake-up (tests drive the park path).
        #[cfg(all(test, not(loom)))]
        pub(crate) fn asker_registered(&self) -> bool {
            self.slot().state.load(Ordering::Relaxed) == WAITING
        }

        /// Delivers `outcome` (or drops it if the asker gave up) and wakes a parked asker.
        pub(crate) fn complete(self, outcome: Result<T, Unanswered>) {
            let slot_ptr = self.slot;
            std::mem::forget(self);
            // SAFETY: as in `Completer::slot`: alive until this function publishes `READY`,
            // after which `slot` is not used again (every path below returns right after).
            let slot = unsafe { slot_ptr.as_ref() };
            slot.outcome.with_mut(|cell| {
                // SAFETY: the state is `EMPTY`, `WAITING` or `ABANDONED` (only this completer
                // moves it further), in all of which the completer owns the outcome cell; it
                // is written once, as `complete` consumes the completer.
                unsafe { (*cell).write(outcome) };
            });
            let mut current = EMPTY;
            let mut spins = 0u32;
            loop {
                match current {
                    EMPTY => match slot.state.compare_exchange(
                        EMPTY,
                        READY,
                        Ordering::Release,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return,
                        Err(actual) => current = actual,
                    },
                    WAITING => match slot.state.compare_exchange(
                        WAITING,
                        WAKING,
                        Ordering::Acquire,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => {
                            let waiter = slot.waiter.with_mut(|cell| {
                                // SAFETY: `WAKING` gives the completer the waiter cell; the
                                // acquire above made the receiver's write of it visible.
                                unsafe { (*cell).take() }
                            });
                            slot.state.store(READY, Ordering::Release);
                            // The block may be freed from here on; the waiter is our own.
                            if let Some(waiter) = waiter {
                                waiter.wake();
                            }
                            return;
                        }
                        Err(actual) => current = actual,
                    },
                    ABANDONED => {
                        // Frees the block when this arm ends, also if the outcome's drop
                        // panics (else a panicking `T::drop` would leak the block).
                        let _free = FreeOnDrop(slot_ptr);
                        slot.outcome.with_mut(|cell| {
                            // SAFETY: written just above; `ABANDONED` is final and gives this
                            // completer the whole block, so nobody else reads the cell.
                            unsafe {
                                std::ptr::drop_in_place(cell.cast::<Result<T, Unanswered>>())
                            };
                        });
                        return;
                    }
                    _ => {
                        // `WAKING` and `READY` are set by this completer only, which has not
                        // done so yet; `current` came from the state word.
                        debug_assert!(false, "completer found state {current}");
                        back_off(&mut spins);
                        current = slot.state.load(Ordering::Acquire);
                    }
                }
            }
        }
    }

    /// Frees a block the completer found `ABANDONED` (see [`free`]), when dropped.
    struct FreeOnDrop<T>(NonNull<Slot<T>>);

    impl<T> Drop for FreeOnDrop<T> {
        fn drop(&mut self) {
            // SAFETY: made only by `Completer::complete` after it read `ABANDONED` by an
            // acquire (the compare-exchange failure ordering): the receiver is gone, the block
            // is the completer's alone, and nothing uses it after this guard is dropped (the
            // arm that holds the guard returns, or unwinds, right after the outcome's drop).
            unsafe { free(self.0) };
        }
    }

    impl<T> Drop for Completer<T> {
        fn drop(&mut self) {
            let completer = Completer { slot: self.slot };
            completer.complete(Err(Unanswered::NoReply));
        }
    }

    /// The asker's half. Dropping it before the outcome is taken hands the block to the
    /// completer (the outcome is then discarded when it arrives).
    pub(crate) struct Receiver<T> {
        slot: NonNull<Slot<T>>,
    }

    // SAFETY: the receiver moves a `T` or an `Unanswered` (which is `Send`, see `Completer`)
    // out of the slot (hence `T: Send`), on whichever thread holds it; every access to the
    // shared block is ordered by the state protocol.
    unsafe impl<T: Send> Send for Receiver<T> {}
    // SAFETY: through `&Receiver` only `is_ready` runs, an atomic load.
    unsafe impl<T: Send> Sync for Receiver<T> {}

    impl<T> Receiver<T> {
        fn slot(&self) -> &Slot<T> {
            // SAFETY: the block stays allocated while the receiver exists: only `ABANDONED`
            // (which this receiver alone sets, in `drop`) lets the completer free it.
            unsafe { self.slot.as_ref() }
        }

        /// Whether the outcome is there ([`Receiver::take_ready`] will not wait).
        #[inline]
        pub(crate) fn is_ready(&self) -> bool {
            self.slot().state.load(Ordering::Acquire) == READY
        }

        /// The outcome if it is there, else the receiver back.
        #[inline]
        pub(crate) fn try_take(self) -> Result<Result<T, Unanswered>, Self> {
            if self.is_ready() {
                Ok(self.take_ready())
            } else {
                Err(self)
            }
        }

        /// Takes the outcome and frees the block. Call only once [`Receiver::is_ready`] (or
        /// [`Receiver::unregister`]) said so; should that not hold, it waits for the outcome.
        pub(crate) fn take_ready(self) -> Result<T, Unanswered> {
            debug_assert!(self.is_ready(), "take_ready before the outcome was published");
            self.wait_until_ready();
            let slot_ptr = self.slot;
            std::mem::forget(self);
            // SAFETY: the state is `READY` (read by an acquire in `wait_until_ready`), so the
            // block is the receiver's and stays allocated until the `free` below.
            let slot = unsafe { slot_ptr.as_ref() };
            let outcome = slot.outcome.with(|cell| {
                // SAFETY: `READY` means the completer initialized the outcome and released
                // it; the receiver reads it exactly once (this consumes the receiver).
                unsafe { cell.cast::<Result<T, Unanswered>>().read() }
            });
            // SAFETY: `READY` gives the receiver the block, the outcome was moved out above,
            // and `slot` is not used after this call.
            unsafe { free(slot_ptr) };
            outcome
        }

        /// Stores `waiter` to be woken when the outcome is published. Returns `false` (and
        /// stores nothing lasting) if the outcome is already there. Replaces an earlier
        /// registration.
        pub(crate) fn register(&mut self, waiter: Waiter) -> bool {
            if self.unregister() {
                return false;
            }
            let slot = self.slot();
            // After `unregister` returned `false` the state is `EMPTY` or later `READY`:
            // the receiver owns the waiter cell in both.
            slot.waiter.with_mut(|cell| {
                // SAFETY: in `EMPTY` (and `READY`) the receiver owns the waiter cell, and only
                // the receiver leaves those states except by the completer's publication,
                // which does not touch the cell.
                unsafe { *cell = Some(waiter) };
            });
            match slot.state.compare_exchange(EMPTY, WAITING, Ordering::Release, Ordering::Acquire)
            {
                Ok(_) => true,
                // Published meanwhile: the waiter stays in the cell, which is still ours, and
                // is dropped with the block.
                Err(actual) => {
                    debug_assert_eq!(actual, READY);
                    false
                }
            }
        }

        /// Withdraws a registration. Returns whether the outcome is there (then it waits out
        /// a completer that is just waking us, so the outcome can be taken at once).
        pub(crate) fn unregister(&mut self) -> bool {
            let slot = self.slot();
            match slot.state.compare_exchange(WAITING, EMPTY, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => {
                    let waiter = slot.waiter.with_mut(|cell| {
                        // SAFETY: back in `EMPTY`, the receiver owns the waiter cell; the
                        // completer never read it (it would have had to move to `WAKING`).
                        unsafe { (*cell).take() }
                    });
                    drop(waiter);
                    false
                }
                Err(EMPTY) => false,
                Err(_) => {
                    self.wait_until_ready();
                    true
                }
            }
        }

        /// Waits out `WAKING` (a few instructions of the completer); returns once `READY` was
        /// read by an acquire.
        fn wait_until_ready(&self) {
            let mut spins = 0u32;
            while self.slot().state.load(Ordering::Acquire) != READY {
                back_off(&mut spins);
            }
        }
    }

    impl<T> Drop for Receiver<T> {
        fn drop(&mut self) {
            let slot = self.slot();
            let mut current = slot.state.load(Ordering::Acquire);
            let mut spins = 0u32;
            loop {
                match current {
                    READY => {
                        let receiver = Receiver { slot: self.slot };
                        drop(receiver.take_ready());
                        return;
                    }
                    EMPTY | WAITING => {
                        // A registered waiter stays in the cell and is dropped with the block
                        // by the completer.
                        match slot.state.compare_exchange(
                            current,
                            ABANDONED,
                            Ordering::Release,
                            Ordering::Acquire,
                        ) {
                            Ok(_) => return,
                            Err(actual) => current = actual,
                        }
                    }
                    _ => {
                        // `WAKING`: the completer publishes in a few instructions.
                        debug_assert_eq!(current, WAKING);
                        back_off(&mut spins);
                        current = slot.state.load(Ordering::Acquire);
                    }
                }
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::{
        sync::{
            atomic::{AtomicUsize, Ordering},
            Arc,
        },
        task::Wake,
    };

    use super::*;

    /// Counts its drops, so a test can check that every outcome is dropped exactly once.
    #[derive(Debug)]
    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Polls `future` on this thread, parking (with no timeout) between wake-ups: only its
    /// waker ends a park, so a future nothing wakes is never ready.
    fn block_on_parking<F: Future>(future: F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut task = TaskContext::from_waker(&waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let Poll::Ready(output) = future.as_mut().poll(&mut task) {
                return output;
            }
            std::thread::park();
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "no reply arms the ask timer under Miri")]
    fn an_awaited_reply_that_never_comes_times_out_at_its_deadline() {
        let timeout = Duration::from_millis(50);
        let (replier, reply) = request_pair::<u32>(timeout, "asked");
        let (outcome_sender, outcome) = std::sync::mpsc::channel();
        let started = Instant::now();
        // Before the ask timer, nothing woke this task again: its thread stayed parked.
        std::thread::spawn(move || outcome_sender.send(block_on_parking(reply)));
        let outcome = outcome
            .recv_timeout(Duration::from_secs(10))
            .expect("the awaited reply ended within 10 s of its 50 ms timeout");
        assert!(matches!(outcome, Err(AskError::Timeout { timeout: t, .. }) if t == timeout));
        assert!(started.elapsed() >= timeout);
        drop(replier);
    }

    /// A reply whose deadline was fixed when it was queued (an ask that waited for room) is
    /// waited for until that deadline, not for its whole timeout from the wait's start, and
    /// its timeout error names the configured timeout.
    #[test]
    fn a_fixed_deadline_ends_the_wait_and_the_error_names_the_configured_timeout() {
        let timeout = Duration::from_secs(60);
        let (_replier, reply) = request_pair::<u32>(timeout, "asked");
        let started = Instant::now();
        let reply = reply.with_deadline(started.checked_add(Duration::from_millis(50)));
        let outcome = reply.wait();
        assert!(matches!(outcome, Err(AskError::Timeout { timeout: t, .. }) if t == timeout));
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(50), "gave up early: {waited:?}");
        assert!(waited < Duration::from_secs(10), "waited {waited:?} of the 60 s timeout");
    }

    /// Awaiting honours a deadline fixed before the first poll in the same way.
    #[test]
    #[cfg_attr(miri, ignore = "no reply arms the ask timer under Miri")]
    fn an_awaited_reply_with_a_fixed_deadline_times_out_at_it() {
        let timeout = Duration::from_secs(60);
        let (replier, reply) = request_pair::<u32>(timeout, "asked");
        let started = Instant::now();
        let reply = reply.with_deadline(started.checked_add(Duration::from_millis(50)));
        let (outcome_sender, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || outcome_sender.send(block_on_parking(reply)));
        let outcome = outcome
            .recv_timeout(Duration::from_secs(10))
            .expect("the awaited reply ended within 10 s of its 50 ms deadline");
        assert!(matches!(outcome, Err(AskError::Timeout { timeout: t, .. }) if t == timeout));
        assert!(started.elapsed() >= Duration::from_millis(50));
        drop(replier);
    }

    /// A reply that comes to a parked asker before its fixed deadline is delivered; so is one
    /// to a reply whose fixed deadline is none (no deadline), though its timeout is zero.
    #[test]
    fn a_reply_before_a_fixed_deadline_or_with_none_is_delivered() {
        let fixed = [
            (Duration::from_secs(60), Instant::now().checked_add(Duration::from_secs(10))),
            (Duration::ZERO, None),
        ];
        for (timeout, deadline) in fixed {
            let (replier, reply) = request_pair::<u32>(timeout, "asked");
            let reply = reply.with_deadline(deadline);
            let answering = std::thread::spawn(move || {
                // Only once the asker parked: the wait itself meets the reply.
                wait_for(|| replier.asker_registered());
                replier.reply(7);
            });
            assert_eq!(reply.wait().expect("replied before the deadline"), 7, "{deadline:?}");
            answering.join().expect("answering thread");
        }
    }

    /// `wait_timeout` waits its own timeout from now, not the fixed deadline: a reply that
    /// comes after that deadline but within the timeout is delivered.
    #[test]
    fn wait_timeout_ignores_a_fixed_deadline() {
        let (replier, reply) = request_pair::<u32>(Duration::from_secs(60), "asked");
        let fixed = Instant::now() + Duration::from_millis(20);
        let reply = reply.with_deadline(Some(fixed));
        let answering = std::thread::spawn(move || {
            wait_for(|| replier.asker_registered());
            while Instant::now() <= fixed {
                std::thread::sleep(Duration::from_millis(5));
            }
            replier.reply(7);
        });
        assert_eq!(reply.wait_timeout(Duration::from_secs(10)).expect("within 10 s"), 7);
        answering.join().expect("answering thread");
    }

    #[test]
    #[cfg_attr(miri, ignore = "no reply arms the ask timer under Miri")]
    fn an_awaited_reply_disarms_its_deadline_when_answered_or_dropped() {
        let mut task = TaskContext::from_waker(std::task::Waker::noop());
        let (replier, mut reply) = Replier::<u32>::pair();
        assert!(Pin::new(&mut reply).poll(&mut task).is_pending());
        let key = reply.timer.as_ref().expect("a pending awaited reply is armed").key();
        assert!(super::super::ask_timer::is_armed(key));
        replier.reply(7);
        assert!(matches!(Pin::new(&mut reply).poll(&mut task), Poll::Ready(Ok(7))));
        assert!(reply.timer.is_none());
        assert!(!super::super::ask_timer::is_armed(key));

        let (_replier, mut reply) = Replier::<u32>::pair();
        assert!(Pin::new(&mut reply).poll(&mut task).is_pending());
        let key = reply.timer.as_ref().expect("armed").key();
        drop(reply);
        assert!(!super::super::ask_timer::is_armed(key));
    }

    /// Spins (yielding) until `condition` holds; fails the test after 10 s.
    fn wait_for(condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "condition not reached within 10 s");
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_reply_sent_before_the_wait_is_taken_at_once() {
        let (replier, reply) = Replier::pair();
        replier.reply(7u64);
        assert_eq!(reply.wait_timeout(Duration::ZERO).expect("replied"), 7);
    }

    #[test]
    fn a_parked_asker_is_woken_by_a_reply_from_another_thread() {
        let (replier, reply) = Replier::pair();
        let answering = std::thread::spawn(move || {
            // Answer only once the asker has registered, so the park and wake path runs.
            wait_for(|| replier.asker_registered());
            replier.reply(String::from("late but awaited"));
        });
        assert_eq!(reply.wait_timeout(Duration::from_secs(10)).expect("woken"), "late but awaited");
        answering.join().expect("answering thread");
    }

    #[test]
    fn a_parked_asker_is_woken_by_a_dropped_replier_with_no_reply() {
        let (replier, reply) = Replier::<u64>::pair();
        let dropping = std::thread::spawn(move || {
            wait_for(|| replier.asker_registered());
            drop(replier);
        });
        assert!(matches!(
            reply.wait_timeout(Duration::from_secs(10)),
            Err(AskError::NoReply { .. })
        ));
        dropping.join().expect("dropping thread");
    }

    #[test]
    fn timeout_then_late_reply_is_dropped_once_and_the_replier_sees_it_abandoned() {
        let drops = Arc::new(AtomicUsize::new(0));
        let (replier, reply) = Replier::<Counted>::pair();
        assert!(!replier.is_abandoned());
        let timeout = Duration::from_millis(2);
        match reply.wait_timeout(timeout) {
            Err(AskError::Timeout { timeout: reported, .. }) => assert_eq!(reported, timeout),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(replier.is_abandoned());
        replier.reply(Counted(Arc::clone(&drops)));
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the late reply was dropped exactly once");
    }

    #[test]
    fn an_untaken_reply_is_dropped_with_its_handle() {
        let drops = Arc::new(AtomicUsize::new(0));
        let (replier, reply) = Replier::<Counted>::pair();
        replier.reply(Counted(Arc::clone(&drops)));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(reply);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn dropped_replier_gives_no_reply_and_fail_gives_the_handler_error() {
        let (replier, reply) = Replier::<u64>::pair();
        drop(replier);
        assert!(matches!(reply.wait(), Err(AskError::NoReply { .. })));

        let (replier, reply) = Replier::<u64>::pair();
        replier.fail(HandlerError::from("no such epoch"));
        match reply.wait() {
            Err(AskError::Handler { source: cause, .. }) => {
                assert_eq!(cause.to_string(), "no such epoch")
            }
            other => panic!("expected a handler error, got {other:?}"),
        }
    }

    #[test]
    fn try_take_is_none_until_the_reply_then_gives_it_once() {
        let (replier, mut reply) = Replier::pair();
        assert!(reply.try_take().is_none());
        assert!(format!("{reply:?}").contains("pending"));
        replier.reply(3u8);
        assert!(format!("{reply:?}").contains("ready"));
        assert_eq!(reply.try_take().expect("arrived").expect("ok"), 3);
        assert!(matches!(reply.try_take(), Some(Err(AskError::NoReply { .. }))));
    }

    /// Every error the asker takes names the endpoint asked, however it takes it: a dropped
    /// replier's and a failed one's, by `try_take` and by a wait, and a failed reply's on a
    /// second take. A reply and its slot stay small (a reply is made per ask, and a slot is a
    /// heap block per ask): an `AskError` is kept out of both on the answering path.
    #[test]
    fn the_asker_s_errors_name_the_endpoint_asked() {
        let named = |error: &AskError| match error {
            AskError::NoReply { endpoint }
            | AskError::Handler { endpoint, .. }
            | AskError::HandlerPanicked { endpoint, .. }
            | AskError::Timeout { endpoint, .. }
            | AskError::Stopped { endpoint } => endpoint == "asked",
            _ => false,
        };
        let (replier, mut reply) = request_pair::<u64>(Duration::from_secs(10), "asked");
        drop(replier);
        let error = reply.try_take().expect("failed at once").unwrap_err();
        assert!(matches!(error, AskError::NoReply { .. }) && named(&error), "{error:?}");
        assert!(error.to_string().starts_with("endpoint \"asked\": "), "{error}");
        let second = reply.try_take().expect("taken").unwrap_err();
        assert!(matches!(second, AskError::NoReply { .. }) && named(&second), "{second:?}");

        let (replier, reply) = request_pair::<u64>(Duration::from_secs(10), "asked");
        replier.fail("refused");
        let error = reply.wait().unwrap_err();
        assert!(matches!(error, AskError::Handler { .. }) && named(&error), "{error:?}");

        let stopped = AskError::Stopped { endpoint: "asked".to_owned() };
        let mut reply = Reply::<u64>::failed(stopped, "asked");
        let error = reply.try_take().expect("failed").unwrap_err();
        assert!(matches!(error, AskError::Stopped { .. }) && named(&error), "{error:?}");
        let second = reply.try_take().expect("taken").unwrap_err();
        assert!(matches!(second, AskError::NoReply { .. }) && named(&second), "{second:?}");

        // 80 and 40 bytes before the endpoint's name (with a `Result<u64, AskError>` outcome).
        assert!(std::mem::size_of::<Reply<u64>>() <= 72, "{}", std::mem::size_of::<Reply<u64>>());
        let slot_outcome = std::mem::size_of::<Result<u64, Unanswered>>();
        assert!(slot_outcome <= 24, "a slot's outcome takes {slot_outcome} bytes");
    }

    #[test]
    fn a_replier_dropped_by_a_panicking_handler_fails_with_the_panic_message() {
        // As on an endpoint thread, whose loop passes the caught panic's message on.
        crate::runtime::endpoint::mark_as_endpoint_thread();
        let (replier, reply) = Replier::<u64>::pair();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = replier;
            panic!("handler gave up");
        }));
        assert!(unwound.is_err());
        fail_replies_orphaned_by_panic("handler gave up");
        match reply.wait_timeout(Duration::from_secs(10)) {
            Err(AskError::HandlerPanicked { message, .. }) => {
                assert_eq!(message, "handler gave up")
            }
            other => panic!("expected HandlerPanicked, got {other:?}"),
        }
    }

    /// Counts wake-ups.
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn polling_registers_the_waker_and_the_reply_wakes_it() {
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = std::task::Waker::from(Arc::clone(&counter));
        let mut task = TaskContext::from_waker(&waker);
        let (replier, mut reply) = Replier::pair();
        assert!(Pin::new(&mut reply).poll(&mut task).is_pending());
        // A second poll replaces the registration rather than adding one.
        assert!(Pin::new(&mut reply).poll(&mut task).is_pending());
        let answering = std::thread::spawn(move || replier.reply(11u32));
        wait_for(|| counter.0.load(Ordering::SeqCst) > 0);
        answering.join().expect("answering thread");
        assert_eq!(counter.0.load(Ordering::SeqCst), 1, "woken exactly once");
        match Pin::new(&mut reply).poll(&mut task) {
            Poll::Ready(Ok(value)) => assert_eq!(value, 11),
            other => panic!("expected the reply, got {other:?}"),
        }
    }

    #[test]
    fn polling_after_the_deadline_times_out_and_abandons() {
        let waker = std::task::Waker::from(Arc::new(CountingWaker(AtomicUsize::new(0))));
        let mut task = TaskContext::from_waker(&waker);
        let (replier, mut reply) = request_pair::<u64>(Duration::ZERO, "asked");
        match Pin::new(&mut reply).poll(&mut task) {
            Poll::Ready(Err(AskError::Timeout { endpoint, timeout })) => {
                assert_eq!(endpoint, "asked", "the error names the endpoint asked");
                assert_eq!(timeout, Duration::ZERO)
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(replier.is_abandoned());
        replier.reply(1);
    }

    /// Replies racing timeouts of every length around the reply's arrival: each outcome is
    /// either delivered or dropped, exactly once, and never both.
    #[test]
    fn racing_replies_and_timeouts_deliver_or_drop_every_outcome_exactly_once() {
        let rounds: usize = if cfg!(miri) { 50 } else { 20_000 };
        let drops = Arc::new(AtomicUsize::new(0));
        let (repliers, asked) = crossbeam_queue_pair(rounds);
        let answering = {
            let drops = Arc::clone(&drops);
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    let replier: Replier<Counted> = loop {
                        if let Some(replier) = repliers.pop() {
                            break replier;
                        }
                        std::hint::spin_loop();
                    };
                    replier.reply(Counted(Arc::clone(&drops)));
                }
            })
        };
        let mut delivered = 0usize;
        for round in 0..rounds {
            let (replier, reply) = Replier::pair();
            asked.push(replier).expect("queue sized for every round");
            // Fixed pattern of timeouts from zero to a few microseconds.
            let timeout = Duration::from_nanos((round % 7) as u64 * 700);
            if let Ok(value) = reply.wait_timeout(timeout) {
                delivered += 1;
                drop(value);
            }
        }
        answering.join().expect("answering thread");
        assert_eq!(drops.load(Ordering::SeqCst), rounds, "delivered {delivered}");
    }

    fn crossbeam_queue_pair<T>(
        capacity: usize,
    ) -> (Arc<crossbeam_queue::ArrayQueue<T>>, Arc<crossbeam_queue::ArrayQueue<T>>) {
        let queue = Arc::new(crossbeam_queue::ArrayQueue::new(capacity));
        (Arc::clone(&queue), queue)
    }
}

/// Loom models of the reply slot: a reply racing a parking asker, a timeout, a dropped handle
/// and a polling task. Loom reports a lost wake-up as a deadlock, a leaked or doubly dropped
/// outcome through its `Arc` tracking, and unsynchronised cell accesses as errors.
#[cfg(all(test, loom))]
mod loom_tests {
    use loom::{sync::Arc, thread};

    use super::*;

    /// Polls `future`, parking (loom's park) between wake-ups: a lost wake-up is a deadlock.
    fn block_on<F: Future>(future: F) -> F::Output {
        struct Unpark(thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(thread::current())));
        let mut task = TaskContext::from_waker(&waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let Poll::Ready(output) = future.as_mut().poll(&mut task) {
                return output;
            }
            thread::park();
        }
    }

    #[test]
    fn loom_reply_wakes_a_parking_asker() {
        loom::model(|| {
            let (replier, reply) = Replier::pair();
            let value = Arc::new(5u8);
            let answering = thread::spawn(move || replier.reply(value));
            let got = reply.wait_timeout(Duration::from_secs(3600)).expect("replied");
            assert_eq!(*got, 5);
            answering.join().unwrap();
        });
    }

    #[test]
    fn loom_dropped_replier_wakes_a_parking_asker() {
        loom::model(|| {
            let (replier, reply) = Replier::<Arc<u8>>::pair();
            let dropping = thread::spawn(move || drop(replier));
            assert!(matches!(
                reply.wait_timeout(Duration::from_secs(3600)),
                Err(AskError::NoReply { .. })
            ));
            dropping.join().unwrap();
        });
    }

    #[test]
    fn loom_reply_racing_a_timeout_is_delivered_or_dropped_once() {
        loom::model(|| {
            let (replier, reply) = Replier::pair();
            let value = Arc::new(5u8);
            let answering = thread::spawn(move || replier.reply(value));
            // A zero timeout still registers and withdraws, racing the reply at every step.
            match reply.wait_timeout(Duration::ZERO) {
                Ok(got) => assert_eq!(*got, 5),
                Err(error) => assert!(matches!(error, AskError::Timeout { .. })),
            }
            answering.join().unwrap();
        });
    }

    #[test]
    fn loom_reply_racing_a_dropped_handle_is_dropped_once() {
        loom::model(|| {
            let (replier, reply) = Replier::pair();
            let value = Arc::new(5u8);
            let answering = thread::spawn(move || replier.reply(value));
            drop(reply);
            answering.join().unwrap();
        });
    }

    #[test]
    fn loom_reply_wakes_a_polling_task() {
        loom::model(|| {
            let (replier, reply) = Replier::pair();
            let value = Arc::new(5u8);
            let answering = thread::spawn(move || replier.reply(value));
            let got = block_on(reply).expect("replied");
            assert_eq!(*got, 5);
            answering.join().unwrap();
        });
    }
}
