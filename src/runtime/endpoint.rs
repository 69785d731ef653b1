//! The endpoint contract and the handles that reach an endpoint.
//!
//! * [`Endpoint`]: user code. Two typed handler tables (one-way messages, requests), start and
//!   stop hooks, an error hook. The bus calls them from one thread, one message at a time.
//! * [`Ask`]: a request type with its own reply type; it knows how to wrap itself, with its
//!   [`Replier`], into the endpoint's request enum. The asker gets the reply type directly.
//! * [`EndpointRef`]: a cheap, cloneable, thread-safe reference used to send and ask.
//! * [`Context`]: what a handler may do to its own endpoint (stop it, learn its name).

use std::{
    sync::{Arc, Weak},
    time::{Duration, Instant},
};

use super::{
    reply::{request_pair, Reply},
    BusShared, Replier,
};
use crate::{
    error::{AskError, HandlerError, SendError},
    queue::{QueueError, ShardedQueue},
};

/// User code hosted on the bus. The bus guarantees: `on_start` runs before any message;
/// messages are handled one at a time, each handler returning before the next starts; `on_stop`
/// runs after the last message. Handlers therefore need no locks (SPEC A.3).
///
/// A request handler answers through the [`Replier`] inside the request, now or later.
pub trait Endpoint: Send + Sized + 'static {
    /// One-way messages (`send`). Use an enum for several kinds.
    type Message: Send + 'static;
    /// Request-reply messages (`ask`): usually an enum whose variants hold a typed [`Replier`].
    type Request: Send + 'static;

    /// Runs on the endpoint thread before the first message. A panic in it is caught, logged
    /// as an error and counted ([`EndpointStats::hook_panics`]; it reaches neither `on_error`
    /// nor `Bus::shutdown`), and the endpoint goes on to its messages; the same holds for
    /// `on_stop`.
    fn on_start(&mut self, _context: &Context<Self>) {}

    /// Handles one one-way message. An `Err` goes to [`Endpoint::on_error`]; the sender is not
    /// told (one-way).
    ///
    /// # Errors
    /// Whatever the endpoint considers a failed message.
    fn handle(
        &mut self,
        message: Self::Message,
        context: &Context<Self>,
    ) -> Result<(), HandlerError>;

    /// Handles one-way messages taken together from one inbox lane or ring: every message
    /// `messages` yields, in order, each as [`Endpoint::handle`] would. The bus calls it instead
    /// of `handle` for runs of one-way messages, ending a run before a request (and before the
    /// one message in so many it times); the default calls `handle` for each. Override it to
    /// carry work from one message to the next (the epoch coordinator keeps the bucket it
    /// stores into).
    ///
    /// Returning early is allowed: the messages not taken are handed to a later call. An `Err`
    /// counts as one failed message and goes to [`Endpoint::on_error`], as from `handle`. A
    /// call that takes no message and returns leaves the next one to `handle`.
    ///
    /// # Errors
    /// Whatever the endpoint considers a failed message.
    #[inline(always)]
    fn handle_run(
        &mut self,
        messages: &mut impl Iterator<Item = Self::Message>,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        for message in messages {
            self.handle(message, context)?;
        }
        Ok(())
    }

    /// Handles one request; answer through its [`Replier`]. An `Err` (SPEC A.6's "handler
    /// throws") goes to [`Endpoint::on_error`] (as text), and fails the asker with the error
    /// itself as the cause ([`AskError::Handler`]) if the handler dropped this request's
    /// replier without answering (the usual case: it returned early with `?`); that asker
    /// learns of it once the handler returns. Failing the replier explicitly
    /// ([`Replier::fail`]) is an answer: the asker gets that error (and `on_error` hears of a
    /// returned `Err` only). Any other replier dropped without an answer, or this one by a
    /// handler that returns `Ok`, fails its asker with [`AskError::NoReply`].
    ///
    /// # Errors
    /// Whatever the endpoint considers a failed request.
    fn handle_request(
        &mut self,
        request: Self::Request,
        context: &Context<Self>,
    ) -> Result<(), HandlerError>;

    /// Runs on the endpoint thread after the last message, once the endpoint was stopped.
    fn on_stop(&mut self) {}

    /// Called with every error a handler returns, and with [`AskError::HandlerPanicked`] for a
    /// handler that panicked (SPEC A.6). Default: a `tracing` warning, with the error's causes.
    fn on_error(&mut self, error: &HandlerError) {
        let error = crate::error::message_with_causes(&**error);
        tracing::warn!(endpoint = std::any::type_name::<Self>(), %error, "handler failed");
    }
}

/// A request of endpoint `E` with its own reply type.
///
/// ```
/// # use coordbus::{Ask, Replier};
/// # struct Counter; enum CounterRequest { Get(Replier<u64>) }
/// struct Get;
/// impl Ask<Counter> for Get {
///     type Reply = u64;
///     fn into_request(self, replier: Replier<u64>) -> CounterRequest {
///         CounterRequest::Get(replier)
///     }
/// }
/// # impl coordbus::Endpoint for Counter {
/// #   type Message = (); type Request = CounterRequest;
/// #   fn handle(&mut self, _: (), _: &coordbus::Context<Self>)
/// #       -> Result<(), coordbus::HandlerError> { Ok(()) }
/// #   fn handle_request(&mut self, r: CounterRequest, _: &coordbus::Context<Self>)
/// #       -> Result<(), coordbus::HandlerError> {
/// #       match r { CounterRequest::Get(reply) => reply.reply(0) } Ok(()) }
/// # }
/// ```
pub trait Ask<E: Endpoint>: Send + 'static {
    /// What the endpoint answers.
    type Reply: Send + 'static;
    /// Wraps the request and its replier into the endpoint's request type.
    fn into_request(self, replier: Replier<Self::Reply>) -> E::Request;
}

/// What travels through an inbox. A request carries its reply slot's address
/// ([`Replier::slot_address`]): the endpoint loop tells the request's own replier from any
/// other one its handler drops (`reply::RequestScope`).
pub(crate) enum Envelope<E: Endpoint> {
    Message(E::Message),
    Request(E::Request, usize),
}

/// Per-endpoint counters, written by the endpoint thread only.
#[derive(Debug, Default)]
pub(crate) struct EndpointCounters {
    pub(crate) handled: std::sync::atomic::AtomicU64,
    pub(crate) failed: std::sync::atomic::AtomicU64,
    pub(crate) panicked: std::sync::atomic::AtomicU64,
    pub(crate) hook_panics: std::sync::atomic::AtomicU64,
    pub(crate) handler_time_ns: super::stats::Log2Histogram,
    pub(crate) dropped: super::stats::DropCounters,
    /// The core the endpoint's thread pinned itself to, plus one (0: not pinned). Written once,
    /// by that thread before its first message; a reply it sends later publishes it to the
    /// asker that waited for the reply (release and acquire on the reply slot), so `Relaxed`
    /// suffices.
    pub(crate) pinned_core: std::sync::atomic::AtomicUsize,
}

/// A snapshot of an endpoint's counters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EndpointStats {
    /// Messages accepted into the inbox (handled + queued; not those dropped because the
    /// endpoint's thread never started). Read while a drain round runs it
    /// lags by up to that round (up to the bus's `drain_batch` messages from each lane and
    /// ring): `handled` is published once per round, while the depth drops with each message
    /// taken.
    pub received: u64,
    /// Messages handled (including those whose handler failed or panicked), as of the end of
    /// the last drain round.
    pub handled: u64,
    /// Handler calls that returned an error.
    pub failed: u64,
    /// Handler calls that panicked.
    pub panicked: u64,
    /// `on_start` and `on_stop` calls that panicked. The endpoint carries on (after a panic in
    /// `on_start` it still handles its messages); the panic's message is logged.
    pub hook_panics: u64,
    /// Messages queued now.
    pub inbox_depth: u64,
    /// Largest depth of one inbox shard seen so far.
    pub inbox_depth_high_water: u64,
    /// Handler time of sampled messages (one in 256).
    pub handler_time: super::stats::TimeSummary,
    /// Messages the endpoint handled but dropped (see [`Context::record_dropped`]), and
    /// messages queued for it that were dropped unhandled because its thread never started
    /// (reason "endpoint thread never started"), in total.
    pub dropped: u64,
    /// The same, by reason (reasons with a non-zero count, in order of first use).
    pub dropped_by_reason: Vec<super::stats::DroppedCount>,
    /// The core the endpoint's thread is pinned to (the bus's
    /// [`Pinning`](crate::Pinning)): `None` with pinning off, when the system refused the
    /// pin (a warning says so), and until the thread has pinned itself (it does so first,
    /// before `on_start`: for a thread that got an answer to an ask, this is settled).
    pub pinned_core: Option<usize>,
}

/// The shared state of one registered endpoint.
pub(crate) struct Inbox<E: Endpoint> {
    /// Interned (`runtime::interned_name`): replies copy it into their errors' endpoint.
    pub(crate) name: &'static str,
    /// Registration id; distinguishes this endpoint from a later one under the same name.
    pub(crate) id: u64,
    pub(crate) queue: ShardedQueue<Envelope<E>>,
    pub(crate) counters: EndpointCounters,
    pub(crate) bus: Weak<BusShared>,
    pub(crate) ask_timeout: Duration,
}

thread_local! {
    /// Address of the inbox whose handler runs on this thread (0: none).
    static CURRENT_INBOX: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Id of the bus whose endpoint runs on this thread (0: none). Kept until the thread
    /// ends: `on_stop` and the endpoint's drop run on it too.
    static CURRENT_BUS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Whether this thread runs an endpoint of `bus`.
pub(crate) fn on_endpoint_thread_of(bus: &BusShared) -> bool {
    CURRENT_BUS.with(std::cell::Cell::get) == bus.id
}

/// Whether this thread runs an endpoint (its drain loop catches panics and fails the replies
/// they orphaned).
pub(crate) fn on_endpoint_thread() -> bool {
    CURRENT_INBOX.with(std::cell::Cell::get) != 0
}

/// Marks the calling thread as an endpoint thread (unit tests of the panic path).
#[cfg(all(test, not(loom)))]
pub(crate) fn mark_as_endpoint_thread() {
    CURRENT_INBOX.with(|current| current.set(usize::MAX));
}

impl<E: Endpoint> Inbox<E> {
    fn address(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    /// Marks this thread as the endpoint's thread (for self-ask detection).
    pub(crate) fn enter_thread(&self) {
        CURRENT_INBOX.with(|current| current.set(self.address()));
        let bus = self.bus.upgrade().map_or(0, |bus| bus.id);
        CURRENT_BUS.with(|current| current.set(bus));
    }

    /// Deregisters the name at once and closes the inbox; queued messages are still handled.
    pub(crate) fn stop(&self) -> bool {
        if let Some(bus) = self.bus.upgrade() {
            bus.deregister(self.name, self.id);
        }
        let first = self.queue.close();
        if first {
            tracing::debug!(endpoint = %self.name, "endpoint stopping");
        }
        first
    }

    fn stats(&self) -> EndpointStats {
        use std::sync::atomic::Ordering::Relaxed;
        let handled = self.counters.handled.load(Relaxed);
        let depth = self.queue.len() as u64;
        let dropped_by_reason = self.counters.dropped.snapshot();
        EndpointStats {
            dropped: dropped_by_reason.iter().map(|dropped| dropped.count).sum(),
            dropped_by_reason,
            received: handled + depth,
            handled,
            failed: self.counters.failed.load(Relaxed),
            panicked: self.counters.panicked.load(Relaxed),
            hook_panics: self.counters.hook_panics.load(Relaxed),
            inbox_depth: depth,
            inbox_depth_high_water: self.queue.depth_high_water() as u64,
            handler_time: self.counters.handler_time_ns.summary(),
            pinned_core: self.counters.pinned_core.load(Relaxed).checked_sub(1),
        }
    }
}

/// What a handler can do to its own endpoint.
pub struct Context<E: Endpoint> {
    pub(crate) inbox: Arc<Inbox<E>>,
}

impl<E: Endpoint> std::fmt::Debug for Context<E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Context").field("endpoint", &self.inbox.name).finish()
    }
}

impl<E: Endpoint> Context<E> {
    /// The endpoint's registered name.
    pub fn name(&self) -> &str {
        self.inbox.name
    }

    /// Stops this endpoint: the name is free at once, messages already queued are still
    /// handled, then `on_stop` runs. Idempotent.
    pub fn stop(&self) {
        self.inbox.stop();
    }

    /// Counts a message this endpoint dropped (handled without effect), under `reason`; it
    /// shows in [`EndpointStats::dropped_by_reason`]. No allocation, no lock: meant to be
    /// called per message. Up to 8 distinct reasons are counted by name, further ones together.
    pub fn record_dropped(&self, reason: &'static str) {
        self.inbox.counters.dropped.record(reason);
    }

    /// A reference to this endpoint (asking it from its own handler fails with
    /// [`AskError::SelfAsk`]).
    pub fn endpoint_ref(&self) -> EndpointRef<E> {
        EndpointRef { inbox: Arc::clone(&self.inbox) }
    }
}

/// A reference to a registered endpoint: cheap to clone, shareable between threads.
///
/// Per-sender order: all messages a thread sends or asks through any reference to the same
/// endpoint are handled in the order the thread issued them; an `ask` therefore returns only
/// after the same thread's earlier sends were handled (SPEC A.4). The sender is the thread:
/// an async task that moves to another thread between two sends (across an `.await` on a
/// work-stealing executor) is two senders, and its two messages may be handled in either
/// order; send such sequences from one thread, or wait for a reply in between. One exception:
/// what a [`send_iter`](Self::send_iter)'s iterator sends or asks to the endpoint of that
/// `send_iter` is not ordered with the thread's other messages to it.
pub struct EndpointRef<E: Endpoint> {
    pub(crate) inbox: Arc<Inbox<E>>,
}

impl<E: Endpoint> Clone for EndpointRef<E> {
    fn clone(&self) -> Self {
        Self { inbox: Arc::clone(&self.inbox) }
    }
}

impl<E: Endpoint> std::fmt::Debug for EndpointRef<E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("EndpointRef")
            .field("name", &self.inbox.name)
            .field("stopped", &self.inbox.queue.is_closed())
            .finish()
    }
}

impl<E: Endpoint> EndpointRef<E> {
    /// The endpoint's registered name.
    pub fn name(&self) -> &str {
        self.inbox.name
    }

    /// Whether two references reach the same endpoint.
    pub fn same_endpoint(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inbox, &other.inbox)
    }

    fn send_error<T>(&self, error: QueueError<T>, timeout: Option<Duration>) -> SendError<T> {
        let endpoint = self.inbox.name.to_owned();
        match error {
            QueueError::Full(message) => SendError::Full { endpoint, message },
            QueueError::Closed(message) => SendError::Stopped { endpoint, message },
            QueueError::Timeout(message) => {
                SendError::Timeout { endpoint, timeout: timeout.unwrap_or_default(), message }
            }
        }
    }

    /// Sends a one-way message, waiting for room while this sender's inbox shard is full:
    /// from a plain thread as long as it takes (back-pressure); from an endpoint's thread (a
    /// handler, or `on_start`/`on_stop`) at most the bus's `ask_timeout`, since endpoints that
    /// send to each other in a cycle would otherwise wait for each other forever once both
    /// inboxes are full.
    ///
    /// # Errors
    /// [`SendError::Stopped`] (with the message) once the endpoint is stopped;
    /// [`SendError::Full`] when the endpoint's own handler sends into its own full inbox
    /// (waiting there would never end); [`SendError::Timeout`] when a handler's send found no
    /// room within `ask_timeout`.
    #[inline]
    pub fn send(&self, message: impl Into<E::Message>) -> Result<(), SendError<E::Message>> {
        // Converted first: no caller code may run inside the push (see `Lane::push_with`).
        // Only the outcome's tag is inspected on the way out (see `ShardedQueue::push_with`).
        let message = message.into();
        match self.inbox.queue.try_push_with(|| Envelope::Message(message)) {
            Ok(()) => Ok(()),
            Err(refused) => self.send_when_refused(refused),
        }
    }

    /// The rest of [`send`](Self::send) once the first try found no room (or a stopped
    /// endpoint): waits, with a deadline on an endpoint thread.
    #[cold]
    #[inline(never)]
    fn send_when_refused(
        &self,
        refused: QueueError<Envelope<E>>,
    ) -> Result<(), SendError<E::Message>> {
        let QueueError::Full(envelope) = refused else {
            return Err(self.send_refused(refused, None));
        };
        let (timeout, deadline) = self.handler_send_deadline();
        match self.inbox.queue.push_with(|| envelope, deadline) {
            Ok(()) => Ok(()),
            Err(refused) => Err(self.send_refused(refused, timeout)),
        }
    }

    /// How long a send from this thread may wait for room, and until when: `ask_timeout` on an
    /// endpoint's thread (see [`send`](Self::send)), else without a bound (no clock read).
    fn handler_send_deadline(&self) -> (Option<Duration>, Option<Instant>) {
        let timeout = on_endpoint_thread().then_some(self.inbox.ask_timeout);
        (timeout, timeout.and_then(|timeout| Instant::now().checked_add(timeout)))
    }

    /// The error of a send whose push was refused (out of line: see `send`).
    #[cold]
    #[inline(never)]
    fn send_refused(
        &self,
        refused: QueueError<Envelope<E>>,
        timeout: Option<Duration>,
    ) -> SendError<E::Message> {
        self.send_error(unwrap_message(refused), timeout)
    }

    /// Sends without waiting.
    ///
    /// # Errors
    /// [`SendError::Full`] with the message if this sender's shard is full;
    /// [`SendError::Stopped`] once the endpoint is stopped.
    #[inline]
    pub fn try_send(&self, message: impl Into<E::Message>) -> Result<(), SendError<E::Message>> {
        // Converted first: no caller code may run inside the push (see `Lane::push_with`).
        let message = message.into();
        match self.inbox.queue.try_push_with(|| Envelope::Message(message)) {
            Ok(()) => Ok(()),
            Err(refused) => Err(self.send_refused(refused, None)),
        }
    }

    /// Sends, waiting at most `timeout` for room.
    ///
    /// # Errors
    /// [`SendError::Timeout`] or [`SendError::Stopped`], with the message; from the endpoint's
    /// own handler, [`SendError::Full`] at once when its own inbox is full.
    pub fn send_timeout(
        &self,
        message: impl Into<E::Message>,
        timeout: Duration,
    ) -> Result<(), SendError<E::Message>> {
        let message = message.into();
        // A timeout too large for the clock (`Duration::MAX`) means no deadline.
        let deadline = Instant::now().checked_add(timeout);
        match self.inbox.queue.push_with(|| Envelope::Message(message), deadline) {
            Ok(()) => Ok(()),
            Err(refused) => Err(self.send_refused(refused, Some(timeout))),
        }
    }

    /// Sends many one-way messages in order, claiming inbox slots for as many as fit with one
    /// atomic operation (one publication per claim). Waits for room like [`send`](Self::send)
    /// (from a handler, at most `ask_timeout` in all).
    ///
    /// # Errors
    /// [`SendError::Stopped`] with the messages not sent (the earlier ones were);
    /// [`SendError::Full`] likewise when the endpoint's own handler fills its own inbox;
    /// [`SendError::Timeout`] likewise when a handler's batch found no room in time.
    pub fn send_batch(&self, messages: Vec<E::Message>) -> Result<(), SendError<Vec<E::Message>>> {
        // Mapped lazily: the messages go straight from the caller's vector into the slots.
        let envelopes = messages.into_iter().map(Envelope::Message);
        let (timeout, deadline) = self.handler_send_deadline();
        self.inbox
            .queue
            .push_batch_from(envelopes, deadline)
            .map_err(|error| self.batch_send_error(error, timeout))
    }

    /// Sends the messages `messages` yields, in order, as [`send_batch`](Self::send_batch)
    /// does, but with no vector between the caller and the inbox: each message goes from the
    /// iterator straight into its inbox slot as it is yielded, for a producer that makes its
    /// messages as it sends them. The iterator's `len` is the batch: at most that many
    /// messages are sent (an iterator that yields fewer ends the batch early; values beyond
    /// the count stay in it, so pass `&mut iterator` to keep them).
    ///
    /// The iterator runs while this thread's lane of the inbox is claimed, from the first
    /// message to the last. It may send and ask. To this endpoint (or to one whose
    /// `send_iter` is running this one) those go through a shared shard of the inbox, and are
    /// not ordered with this thread's other messages to it, the batch included; to other
    /// endpoints they keep their order. A `send_iter` to this endpoint from inside collects its
    /// messages first. It should not block for long: once the endpoint is stopped, its thread's
    /// last drain (and [`Bus::shutdown`](crate::Bus::shutdown), up to its timeout) waits for
    /// the batch to be published. If it panics, the messages it yielded before are sent. A
    /// thread without a lane in this inbox (more sending threads than the bus's
    /// `inbox_lanes`) collects the messages into a vector first (and sends none if the
    /// iterator panics).
    ///
    /// # Errors
    /// As [`send_batch`](Self::send_batch): the messages not sent (those the iterator had not
    /// yet yielded included, up to its `len`).
    pub fn send_iter<I>(&self, messages: I) -> Result<(), SendError<Vec<E::Message>>>
    where
        I: IntoIterator<Item = E::Message>,
        I::IntoIter: ExactSizeIterator,
    {
        let envelopes = messages.into_iter().map(Envelope::Message);
        let (timeout, deadline) = self.handler_send_deadline();
        self.inbox
            .queue
            .push_iter_from(envelopes, deadline)
            .map_err(|error| self.batch_send_error(error, timeout))
    }

    /// The error of a batch send that was refused (out of line: see `send`).
    #[cold]
    #[inline(never)]
    fn batch_send_error(
        &self,
        error: QueueError<Vec<Envelope<E>>>,
        timeout: Option<Duration>,
    ) -> SendError<Vec<E::Message>> {
        let unwrap_all = |envelopes: Vec<Envelope<E>>| {
            envelopes.into_iter().filter_map(Envelope::into_message).collect()
        };
        self.send_error(
            match error {
                QueueError::Full(rest) => QueueError::Full(unwrap_all(rest)),
                QueueError::Closed(rest) => QueueError::Closed(unwrap_all(rest)),
                QueueError::Timeout(rest) => QueueError::Timeout(unwrap_all(rest)),
            },
            timeout,
        )
    }

    /// Asks: queues the request behind this sender's earlier messages and returns a handle to
    /// wait on or await. Waits for room (up to the bus's `ask_timeout`) if the shard is full,
    /// blocking the calling thread: an async caller, whose executor thread must not block, uses
    /// [`try_ask`](Self::try_ask). That wait counts against the reply's `ask_timeout`: the
    /// handle's [`wait`](crate::Reply::wait) and `.await` end `ask_timeout` after the wait for
    /// room began.
    ///
    /// Errors arrive through the handle: [`AskError::Stopped`] at once for a stopped endpoint,
    /// [`AskError::SelfAsk`] when called from this endpoint's own handler,
    /// [`AskError::Full`] if the inbox stayed full for `ask_timeout` (the request was never
    /// queued), and then those of [`Reply::wait`](crate::Reply::wait).
    pub fn ask<A: Ask<E>>(&self, request: A) -> Reply<A::Reply> {
        if CURRENT_INBOX.with(std::cell::Cell::get) == self.inbox.address() {
            return self.self_ask();
        }
        let (replier, reply) = request_pair(self.inbox.ask_timeout, self.inbox.name);
        let slot = replier.slot_address();
        let request = request.into_request(replier);
        // Only the tag of the push's outcome is inspected on this path: matching on the whole
        // result lets the compiler spill it and reload it wider than it was stored, a failed
        // store-to-load forwarding that waits for the inbox slot's write (a cache miss, the
        // line was last read by the endpoint) to drain.
        match self.inbox.queue.try_push_with(|| Envelope::Request(request, slot)) {
            Ok(()) => reply,
            Err(refused) => self.ask_refused(refused, reply),
        }
    }

    /// As [`ask`](Self::ask), but never waits for room: if this sender's shard is full, the
    /// handle fails at once with [`AskError::Full`] (its `timeout` zero; the request was never
    /// queued). For async callers, which retry on their own terms.
    pub fn try_ask<A: Ask<E>>(&self, request: A) -> Reply<A::Reply> {
        // Its own body, not one shared with `ask`: that is a measured path, whose code stays
        // as it was (sharing it changed how the compiler inlined it).
        if CURRENT_INBOX.with(std::cell::Cell::get) == self.inbox.address() {
            return self.self_ask();
        }
        let (replier, reply) = request_pair(self.inbox.ask_timeout, self.inbox.name);
        let slot = replier.slot_address();
        let request = request.into_request(replier);
        match self.inbox.queue.try_push_with(|| Envelope::Request(request, slot)) {
            Ok(()) => reply,
            // Dropping the reply abandons the slot; the replier inside the refused envelope
            // is dropped with it and frees the slot.
            Err(refused) => self.ask_failed(refused, Duration::ZERO),
        }
    }

    /// The rest of an ask whose first push was refused: waits for room if the shard was full
    /// (the clock is read only here; the deadline bounds the wait), else fails the reply. The
    /// same deadline then bounds the wait for the reply, so the ask as a whole lasts at most
    /// about `ask_timeout`.
    #[cold]
    #[inline(never)]
    fn ask_refused<T>(&self, refused: QueueError<Envelope<E>>, reply: Reply<T>) -> Reply<T> {
        let pushed = match refused {
            QueueError::Full(envelope) => {
                let deadline = Instant::now().checked_add(self.inbox.ask_timeout);
                self.inbox.queue.push(envelope, deadline).map(|()| deadline)
            }
            refused => Err(refused),
        };
        match pushed {
            Ok(deadline) => reply.with_deadline(deadline),
            // Dropping `reply` abandons the slot; the replier inside the refused envelope
            // is dropped with it and frees the slot.
            Err(refused) => self.ask_failed(refused, self.inbox.ask_timeout),
        }
    }

    /// The failed reply of an ask the queue refused, after waiting `waited` for room.
    #[cold]
    fn ask_failed<T>(&self, refused: QueueError<Envelope<E>>, waited: Duration) -> Reply<T> {
        let endpoint = self.inbox.name.to_owned();
        let error = match refused {
            QueueError::Closed(_) => AskError::Stopped { endpoint },
            QueueError::Full(_) | QueueError::Timeout(_) => {
                AskError::Full { endpoint, timeout: waited }
            }
        };
        Reply::failed(error, self.inbox.name)
    }

    /// The failed reply of an ask from the endpoint's own handler.
    #[cold]
    fn self_ask<T>(&self) -> Reply<T> {
        Reply::failed(AskError::SelfAsk { endpoint: self.inbox.name.to_owned() }, self.inbox.name)
    }

    /// Stops the endpoint: its name is free at once; messages already queued are still
    /// handled, then `on_stop` runs; later sends and asks fail with `Stopped`. Idempotent;
    /// returns `false` if it was already stopped.
    pub fn stop(&self) -> bool {
        self.inbox.stop()
    }

    /// Whether the endpoint was stopped.
    pub fn is_stopped(&self) -> bool {
        self.inbox.queue.is_closed()
    }

    /// The endpoint's counters, readable at any time.
    pub fn stats(&self) -> EndpointStats {
        self.inbox.stats()
    }
}

impl<E: Endpoint> Envelope<E> {
    fn into_message(self) -> Option<E::Message> {
        match self {
            Self::Message(message) => Some(message),
            Self::Request(..) => None,
        }
    }
}

/// Unwraps the one-way message from a failed push of a `Message` envelope.
fn unwrap_message<E: Endpoint>(error: QueueError<Envelope<E>>) -> QueueError<E::Message> {
    let unwrap = |envelope: Envelope<E>| match envelope {
        Envelope::Message(message) => message,
        Envelope::Request(..) => unreachable!("send only pushes Message envelopes"),
    };
    match error {
        QueueError::Full(envelope) => QueueError::Full(unwrap(envelope)),
        QueueError::Closed(envelope) => QueueError::Closed(unwrap(envelope)),
        QueueError::Timeout(envelope) => QueueError::Timeout(unwrap(envelope)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinators::epoch::{EpochEndpoint, EpochMessage, NoopQuery, NoopSink};

    /// The epoch coordinator's envelope costs no word beyond its message: the request variant
    /// takes its tag from a value the message's own tag never has (see `EpochMessage`).
    #[test]
    fn an_epoch_envelope_is_as_large_as_its_message() {
        assert_eq!(std::mem::size_of::<EpochMessage>(), 48);
        assert_eq!(std::mem::size_of::<Envelope<EpochEndpoint<NoopQuery, NoopSink>>>(), 48);
    }
}
