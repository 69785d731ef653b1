//! The bus: a registry of named endpoints, each on its own thread, fed by a sharded inbox.
//!
//! Parts:
//! * `endpoint`: the [`Endpoint`] trait, typed requests ([`Ask`]), [`EndpointRef`], [`Context`].
//! * `reply`: [`Replier`] and [`Reply`], the two halves of one request-reply exchange.
//! * `worker`: the endpoint thread (drain loop, idle strategy, panic containment).
//! * `pin`: optional pinning of endpoint threads to cores.
//!
//! The registry (a `DashMap` from name to endpoint) is touched only by `register`, `lookup` and
//! `stop`; sending goes straight from an [`EndpointRef`] to the endpoint's inbox, with no lookup
//! and no lock. Stopping removes the name at once (it can be registered again immediately)
//! and closes the inbox; the endpoint thread drains what was queued, runs `on_stop`, and ends
//! (SPEC A.5). Shutting the bus down stops every endpoint that way and joins every thread, all
//! within `shutdown_timeout`; from a handler it only stops them (see [`Bus::shutdown`]).

#[cfg(not(loom))]
mod ask_timer;
mod endpoint;
mod pin;
mod reply;
mod stats;
mod timer_handshake;
mod worker;

pub(crate) use worker::panic_message;

use std::{
    any::Any,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc, Arc, Mutex, PoisonError,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use dashmap::{mapref::entry::Entry, DashMap};

pub use self::{
    endpoint::{Ask, Context, Endpoint, EndpointRef, EndpointStats},
    reply::{Replier, Reply},
    stats::{DroppedCount, TimeSummary, OTHER_DROP_REASONS},
};
use self::{
    endpoint::{Envelope, Inbox},
    pin::CorePlanner,
};
use crate::{
    config::{BusBuilder, BusConfig},
    error::BusError,
    queue::ShardedQueue,
};

/// Type-erased handle on a registered endpoint.
struct Registration {
    id: u64,
    type_name: &'static str,
    /// An `Arc<Inbox<E>>` for the endpoint's `E`.
    inbox: Arc<dyn Any + Send + Sync>,
    stop: Box<dyn Fn() -> bool + Send + Sync>,
}

/// State shared by the bus and (weakly) by every inbox, for deregistration.
pub(crate) struct BusShared {
    /// Unique in the process (not an address, which a later bus could reuse): what an
    /// endpoint thread's mark of its bus holds.
    pub(crate) id: u64,
    registry: DashMap<String, Registration>,
    next_id: AtomicU64,
    shut_down: AtomicBool,
}

impl BusShared {
    /// Removes `name` if it still belongs to registration `id`.
    pub(crate) fn deregister(&self, name: &str, id: u64) {
        self.registry.remove_if(name, |_, registration| registration.id == id);
    }
}

/// The id the next bus gets (0 marks a thread that runs no endpoint).
static NEXT_BUS_ID: AtomicU64 = AtomicU64::new(1);

/// A message bus hosting named endpoints. See the crate docs for an example.
pub struct Bus {
    config: BusConfig,
    shared: Arc<BusShared>,
    cores: CorePlanner,
    threads: Mutex<Vec<(String, JoinHandle<()>)>>,
    /// Each endpoint thread sends one unit here as it ends (even by panic), so shutdown can
    /// wait for threads with a deadline instead of polling.
    thread_ended: (mpsc::Sender<()>, Mutex<mpsc::Receiver<()>>),
    /// The first endpoint thread found panicked (outside a handler) when a registration
    /// joined it, for `shutdown` to report: its name and the panic's message.
    panicked_earlier: Mutex<Option<(String, String)>>,
}

/// Sends on drop: tells the bus an endpoint thread ended, however it ended.
struct EndedSignal(mpsc::Sender<()>);

impl Drop for EndedSignal {
    fn drop(&mut self) {
        let _bus_gone = self.0.send(());
    }
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Bus")
            .field("endpoints", &self.shared.registry.len())
            .field("shut_down", &self.shared.shut_down.load(Ordering::Relaxed))
            .finish()
    }
}

impl Bus {
    /// A builder with every setting at its default.
    pub fn builder() -> BusBuilder {
        BusBuilder::default()
    }

    pub(crate) fn with_config(config: BusConfig) -> Self {
        Self {
            cores: CorePlanner::new(config.pinning.clone()),
            config,
            shared: Arc::new(BusShared {
                id: NEXT_BUS_ID.fetch_add(1, Ordering::Relaxed),
                registry: DashMap::new(),
                next_id: AtomicU64::new(1),
                shut_down: AtomicBool::new(false),
            }),
            threads: Mutex::new(Vec::new()),
            panicked_earlier: Mutex::new(None),
            thread_ended: {
                let (sender, receiver) = mpsc::channel();
                (sender, Mutex::new(receiver))
            },
        }
    }

    /// The bus's settings.
    pub fn config(&self) -> &BusConfig {
        &self.config
    }

    /// Registers `endpoint` under `name` and starts its thread. Messages sent right away are
    /// queued and handled after `on_start`. The name is kept once for the process's life (its
    /// asks' errors name it: [`AskError`](crate::AskError)), so a process that registers a new
    /// name per query run keeps the name's length and a few dozen bytes more per run.
    ///
    /// # Errors
    /// [`BusError::DuplicateName`] if a live endpoint has the name; [`BusError::InvalidName`]
    /// for an empty name or one holding a NUL character; [`BusError::ShutDown`] after
    /// [`Bus::shutdown`] (a registration overlapping a shutdown either fails so, or returns an
    /// endpoint that the shutdown stops and joins); [`BusError::Spawn`] if the thread cannot be
    /// started (the endpoint is stopped, and an ask that reached its name meanwhile fails at
    /// once with [`AskError::NoReply`](crate::AskError::NoReply)); [`BusError::InboxTooLarge`]
    /// if the inbox's slots for `E`'s messages would take more than 8 GiB.
    pub fn register<E: Endpoint>(
        &self,
        name: impl Into<String>,
        endpoint: E,
    ) -> Result<EndpointRef<E>, BusError> {
        let name = name.into();
        if name.is_empty() {
            // An ask's errors name the endpoint asked; an empty name there means none.
            return Err(BusError::InvalidName { name, reason: "it is empty" });
        }
        if name.contains('\0') {
            // The thread's name is made from it, and a thread name cannot hold a NUL.
            return Err(BusError::InvalidName { name, reason: "it contains a NUL character" });
        }
        if self.shared.shut_down.load(Ordering::SeqCst) {
            return Err(BusError::ShutDown { name });
        }
        self.check_inbox_bytes::<E>(&name)?;
        // Before the registry's entry: interning takes a process-wide lock.
        let interned = interned_name(&name);
        let inbox = match self.shared.registry.entry(name.clone()) {
            Entry::Occupied(_) => return Err(BusError::DuplicateName { name }),
            Entry::Vacant(vacant) => {
                let inbox = Arc::new(Inbox::<E> {
                    name: interned,
                    id: self.shared.next_id.fetch_add(1, Ordering::Relaxed),
                    // Within the queue's limits: `BusBuilder::build` validated the settings
                    // against them, and a bus is only made that way.
                    queue: ShardedQueue::with_lanes(
                        self.config.inbox_lanes,
                        self.config.inbox_shards,
                        self.config.inbox_capacity,
                    )
                    .expect("BusConfig::validate keeps inboxes within the queue's limits"),
                    counters: Default::default(),
                    bus: Arc::downgrade(&self.shared),
                    ask_timeout: self.config.ask_timeout,
                });
                let stopper = Arc::clone(&inbox);
                vacant.insert(Registration {
                    id: inbox.id,
                    type_name: std::any::type_name::<E>(),
                    inbox: Arc::clone(&inbox) as Arc<dyn Any + Send + Sync>,
                    stop: Box::new(move || stopper.stop()),
                });
                inbox
            }
        };
        if let Err(error) = self.spawn_worker(endpoint, Arc::clone(&inbox)) {
            inbox.stop();
            drop_queued(&inbox, self.config.shutdown_timeout);
            return Err(error);
        }
        // A shutdown that began meanwhile may have listed the names, or taken the threads to
        // join, before this one's were in: look again, after a full fence (shutdown fences
        // between setting its flag and doing both). Either it stops and joins this endpoint,
        // or this sees its flag, stops the endpoint, and refuses (the thread, already
        // started, ends on its own; the bus's drop joins it).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.shared.shut_down.load(Ordering::SeqCst) {
            inbox.stop();
            return Err(BusError::ShutDown { name });
        }
        tracing::info!(endpoint = %name, "endpoint registered");
        Ok(EndpointRef { inbox })
    }

    /// Registers `make()` under `name`, or, if an endpoint of type `E` already has the name,
    /// returns a reference to it (Spark's "for driver" helper, SPEC C.5).
    ///
    /// # Errors
    /// As [`Bus::register`] and [`Bus::lookup`]; [`BusError::NotFound`] if the endpoint that
    /// won the name was stopped between this call's registration attempt and its lookup.
    pub fn register_or_lookup<E: Endpoint>(
        &self,
        name: &str,
        make: impl FnOnce() -> E,
    ) -> Result<EndpointRef<E>, BusError> {
        match self.lookup::<E>(name) {
            Ok(existing) => Ok(existing),
            Err(BusError::NotFound { .. }) => match self.register(name, make()) {
                Err(BusError::DuplicateName { .. }) => self.lookup(name),
                outcome => outcome,
            },
            Err(error) => Err(error),
        }
    }

    /// Refuses an inbox whose slots for `E`'s messages would exceed
    /// [`MAX_TOTAL_BYTES`](crate::queue::MAX_TOTAL_BYTES): the slot count alone is validated
    /// with the bus, but the memory depends on the message type. (The queue checks the same
    /// when it is made; this says which endpoint, before its name is taken.)
    fn check_inbox_bytes<E: Endpoint>(&self, name: &str) -> Result<(), BusError> {
        let config = &self.config;
        let slots = crate::queue::total_slots(
            config.inbox_lanes,
            config.inbox_shards,
            config.inbox_capacity,
        );
        let slot_bytes = crate::queue::slot_bytes::<Envelope<E>>();
        let bytes = slots.saturating_mul(slot_bytes);
        let limit = crate::queue::MAX_TOTAL_BYTES;
        if bytes > limit {
            return Err(BusError::InboxTooLarge {
                name: name.to_owned(),
                slots,
                slot_bytes,
                bytes,
                limit,
            });
        }
        Ok(())
    }

    fn spawn_worker<E: Endpoint>(&self, endpoint: E, inbox: Arc<Inbox<E>>) -> Result<(), BusError> {
        let name = inbox.name.to_owned();
        let core = self.cores.next_core();
        let idle = self.config.idle;
        let drain_batch = self.config.drain_batch;
        let thread_name: String = format!("cb-{name}").chars().take(15).collect();
        let ended = EndedSignal(self.thread_ended.0.clone());
        let body = move || {
            let _ended = ended;
            if let Some(core) = core {
                if pin::pin_current_thread(core, inbox.name) {
                    inbox.counters.pinned_core.store(core + 1, Ordering::Relaxed);
                }
            }
            worker::run_endpoint(endpoint, inbox, idle, drain_batch);
        };
        let builder = std::thread::Builder::new().name(thread_name);
        #[cfg(all(test, not(loom)))]
        let spawned = tests::spawn_or_fail(builder, body);
        #[cfg(not(all(test, not(loom))))]
        let spawned = builder.spawn(body);
        let handle = spawned.map_err(|error| {
            // The closure, and with it its end signal, was dropped: take that signal back so
            // the count of signals keeps matching the count of threads.
            let ended = self.thread_ended.1.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = ended.try_recv();
            BusError::Spawn { name: name.clone(), reason: error.to_string() }
        })?;
        let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
        self.join_finished(&mut threads);
        threads.push((name, handle));
        Ok(())
    }

    /// A typed reference to the endpoint registered under `name`.
    ///
    /// # Errors
    /// [`BusError::NotFound`] if no live endpoint has the name; [`BusError::WrongType`] if it
    /// is not an `E`.
    pub fn lookup<E: Endpoint>(&self, name: &str) -> Result<EndpointRef<E>, BusError> {
        let registration = self
            .shared
            .registry
            .get(name)
            .ok_or_else(|| BusError::NotFound { name: name.to_owned() })?;
        let inbox = Arc::clone(&registration.inbox).downcast::<Inbox<E>>().map_err(|_| {
            BusError::WrongType {
                name: name.to_owned(),
                expected: std::any::type_name::<E>(),
                actual: registration.type_name,
            }
        })?;
        Ok(EndpointRef { inbox })
    }

    /// Whether a live endpoint has `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.shared.registry.contains_key(name)
    }

    /// Names of the live endpoints.
    pub fn names(&self) -> Vec<String> {
        self.shared.registry.iter().map(|entry| entry.key().clone()).collect()
    }

    /// Stops the endpoint registered under `name` (see [`EndpointRef::stop`]).
    ///
    /// # Errors
    /// [`BusError::NotFound`] if no live endpoint has the name.
    pub fn stop(&self, name: &str) -> Result<(), BusError> {
        let (_, registration) = self
            .shared
            .registry
            .remove(name)
            .ok_or_else(|| BusError::NotFound { name: name.to_owned() })?;
        (registration.stop)();
        Ok(())
    }

    /// Joins the threads of endpoints stopped earlier that have finished, so that a bus whose
    /// endpoints come and go (one per query run) keeps no finished threads unjoined. Their
    /// end signals are taken back too. The first that panicked outside a handler is kept for
    /// `shutdown` to report.
    fn join_finished(&self, threads: &mut Vec<(String, std::thread::JoinHandle<()>)>) {
        let mut index = 0;
        while index < threads.len() {
            if !threads[index].1.is_finished() {
                index += 1;
                continue;
            }
            let (name, handle) = threads.swap_remove(index);
            if let Err(payload) = handle.join() {
                let message = worker::panic_message(&*payload);
                tracing::error!(endpoint = %name, %message,
                    "endpoint thread panicked outside a handler");
                self.panicked_earlier
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert((name, message));
            }
            // Its one signal was sent before it finished.
            let ended = self.thread_ended.1.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = ended.try_recv();
        }
    }

    /// Stops every endpoint (each drains what was queued, then runs `on_stop`) and joins every
    /// endpoint thread this bus started, waiting at most `shutdown_timeout` in all. Later
    /// registrations fail. Idempotent. Called from a handler of one of this bus's endpoints
    /// (or a bus dropped there), it stops every endpoint but waits for no thread: its own
    /// finishes only once the handler returns, and another may be waiting for this handler
    /// (in its own shutdown, or an ask), so waiting could only run out the timeout. A later
    /// shutdown, or dropping the bus elsewhere, joins them; dropping its last handle on one of
    /// its endpoint threads (a handler, `on_stop`, the endpoint's drop) leaves them detached:
    /// stopped, they finish on their own.
    ///
    /// # Errors
    /// [`BusError::ThreadPanicked`] if an endpoint thread died outside a handler (the first
    /// one, also if a registration had joined it already; with the endpoints still running at
    /// the deadline, if any); else
    /// [`BusError::ShutdownTimedOut`] naming the endpoints whose threads were still running at
    /// the deadline (they are left detached: stopped, they finish on their own).
    pub fn shutdown(&self) -> Result<(), BusError> {
        self.shared.shut_down.store(true, Ordering::SeqCst);
        // Pairs with `register`'s fence: a registration this listing misses sees the flag.
        std::sync::atomic::fence(Ordering::SeqCst);
        let names: Vec<String> = self.names();
        for name in names {
            let _already_gone = self.stop(&name);
        }
        let threads = if endpoint::on_endpoint_thread_of(&self.shared) {
            Vec::new()
        } else {
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner))
        };
        let panicked_earlier =
            self.panicked_earlier.lock().unwrap_or_else(PoisonError::into_inner).take();
        if threads.is_empty() {
            // Nothing to wait for (another shutdown took them, or this runs in a handler):
            // return before taking the signals, which that other shutdown may be waiting on.
            return panicked_earlier.map_or(Ok(()), |(name, message)| {
                Err(BusError::ThreadPanicked { name, message, unfinished: Vec::new() })
            });
        }
        // `None`: a timeout too large for the clock, no deadline.
        let deadline = Instant::now().checked_add(self.config.shutdown_timeout);
        let all_signalled = self.wait_for_end_signals(threads.len(), deadline);
        let mut panicked = panicked_earlier;
        let mut unfinished = Vec::new();
        for (name, handle) in threads {
            // With every signal in, each thread is at most finishing its exit; still, a join
            // waits no longer than the deadline, whatever the signals said.
            let finished =
                handle.is_finished() || (all_signalled && Self::wait_finished(&handle, deadline));
            if !finished {
                tracing::error!(endpoint = %name, "endpoint thread did not finish; detached");
                unfinished.push(name);
            } else if let Err(payload) = handle.join() {
                if panicked.is_none() {
                    panicked = Some((name, worker::panic_message(&*payload)));
                }
            }
        }
        match (panicked, unfinished.is_empty()) {
            (Some((name, message)), _) => {
                Err(BusError::ThreadPanicked { name, message, unfinished })
            }
            (None, false) => Err(BusError::ShutdownTimedOut {
                endpoints: unfinished,
                timeout: self.config.shutdown_timeout,
            }),
            (None, true) => Ok(()),
        }
    }

    /// Waits for `count` end signals, until `deadline`; whether all came.
    fn wait_for_end_signals(&self, count: usize, deadline: Option<Instant>) -> bool {
        let ended = self.thread_ended.1.lock().unwrap_or_else(PoisonError::into_inner);
        for _ in 0..count {
            let remaining = deadline.map_or(Duration::MAX, |deadline| {
                deadline.saturating_duration_since(Instant::now())
            });
            if ended.recv_timeout(remaining).is_err() {
                return false;
            }
        }
        true
    }

    /// Polls until `handle`'s thread finished or `deadline` passed; whether it finished.
    fn wait_finished(handle: &JoinHandle<()>, deadline: Option<Instant>) -> bool {
        while !handle.is_finished() {
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        true
    }
}

/// Drops what was queued for an endpoint whose thread never started (the inbox closed): a
/// lookup may have reached the name between its registration and the failed spawn. Its asks
/// then fail at once ([`AskError::NoReply`](crate::AskError::NoReply)) instead of waiting out
/// their timeout, and nothing stays queued for nobody. What it drops is counted in the
/// endpoint's statistics and logged (a one-way message's sender learns nothing else).
/// Once the inbox is closed, only pushes already under way can still land; it waits for them
/// (dozing on the inbox's doorbell, which a finished push rings) at most `timeout`, the bus's
/// `shutdown_timeout`: a `send_iter` whose iterator blocks keeps its push under way as long as
/// it blocks. What lands after that stays queued until the last reference to the inbox goes
/// (an asker that still holds one waits out its ask's timeout).
fn drop_queued<E: Endpoint>(inbox: &Inbox<E>, timeout: Duration) {
    let Some(mut consumer) = inbox.queue.consumer() else {
        return;
    };
    let deadline = Instant::now().checked_add(timeout);
    let mut dropped = 0u64;
    while !consumer.is_drained() {
        let taken = consumer.drain_round(DROP_QUEUED_BATCH, |envelope| {
            inbox.counters.dropped.record(THREAD_NEVER_STARTED);
            dropped += 1;
            drop(envelope);
        });
        if taken > 0 {
            continue;
        }
        let remaining = deadline.map_or(DROP_QUEUED_DOZE, |deadline| {
            deadline.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            tracing::warn!(
                endpoint = %inbox.name,
                ?timeout,
                "pushes into an endpoint whose thread never started were still under way after \
                 the shutdown timeout; what they queue stays until the endpoint is dropped"
            );
            break;
        }
        consumer.doze(remaining.min(DROP_QUEUED_DOZE));
    }
    if dropped > 0 {
        tracing::warn!(
            endpoint = %inbox.name,
            dropped,
            "messages sent to an endpoint whose thread never started were dropped (asks among \
             them failed with NoReply)"
        );
    }
}

/// `name`, kept once for the life of the process. An inbox's name is such a copy, so that each
/// ask hands its reply the name to put in its errors as a plain reference, with no reference
/// count to touch on the ask path. Bounded by the distinct names registered in the process's
/// life (a new name per query run is a few dozen bytes a run).
fn interned_name(name: &str) -> &'static str {
    static NAMES: std::sync::OnceLock<Mutex<std::collections::HashSet<&'static str>>> =
        std::sync::OnceLock::new();
    let mut names =
        NAMES.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(interned) = names.get(name) {
        return interned;
    }
    let interned: &'static str = Box::leak(name.into());
    names.insert(interned);
    interned
}

/// The reason [`drop_queued`] records.
const THREAD_NEVER_STARTED: &str = "endpoint thread never started";

/// Messages taken per lane and ring in one round of [`drop_queued`].
const DROP_QUEUED_BATCH: usize = 1024;

/// Longest doze of [`drop_queued`] between looks (a push that ends without ringing, one whose
/// messages were all refused, is seen at the next look).
const DROP_QUEUED_DOZE: Duration = Duration::from_millis(1);

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{runtime::Context, HandlerError, Pinning};

    /// Handles nothing; with `panics_on_drop`, panics when dropped: after `on_stop`, outside
    /// any handler the worker guards.
    struct Idle {
        panics_on_drop: bool,
    }

    const IDLE: Idle = Idle { panics_on_drop: false };

    impl Drop for Idle {
        fn drop(&mut self) {
            if self.panics_on_drop {
                panic!("injected: an endpoint that panics when dropped");
            }
        }
    }

    impl Endpoint for Idle {
        type Message = ();
        type Request = ();

        fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }

        fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    std::thread_local! {
        /// Set by a test: the next endpoint thread this thread starts fails to start, after
        /// running the hook (in the window where the name is registered and no thread runs).
        static SPAWN_FAILS_AFTER: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
            const { std::cell::RefCell::new(None) };
    }

    /// `builder.spawn(body)`, unless a test asked this thread's next spawn to fail.
    pub(super) fn spawn_or_fail<F: FnOnce() + Send + 'static>(
        builder: std::thread::Builder,
        body: F,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        match SPAWN_FAILS_AFTER.with(|hook| hook.borrow_mut().take()) {
            Some(hook) => {
                hook();
                drop(body);
                Err(std::io::Error::other("injected: no thread to start"))
            }
            None => builder.spawn(body),
        }
    }

    /// Answers every ask with `()`.
    struct Pinger;

    struct Ping;

    impl Endpoint for Pinger {
        type Message = ();
        type Request = crate::Replier<()>;

        fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }

        fn handle_request(
            &mut self,
            replier: crate::Replier<()>,
            _: &Context<Self>,
        ) -> Result<(), HandlerError> {
            replier.reply(());
            Ok(())
        }
    }

    impl crate::runtime::Ask<Pinger> for Ping {
        type Reply = ();
        fn into_request(self, replier: crate::Replier<()>) -> crate::Replier<()> {
            replier
        }
    }

    /// An endpoint's stats name the core its thread is pinned to: the core asked when the
    /// system allows it, none with pinning off or when the core is refused (4096: past any CPU
    /// set, refused before the system is asked).
    #[test]
    fn stats_name_the_core_the_endpoint_thread_is_pinned_to() {
        let allowed: Vec<usize> =
            core_affinity::get_core_ids().unwrap().into_iter().map(|core| core.id).collect();
        let last = *allowed.last().unwrap();
        let cases = [
            (Pinning::Cores(vec![last]), Some(last)),
            (Pinning::Off, None),
            (Pinning::Cores(vec![4096]), None),
        ];
        for (pinning, expected) in cases {
            let bus = Bus::builder().pinning(pinning.clone()).build().unwrap();
            let endpoint = bus.register("pinned", Pinger).unwrap();
            // Answered: the thread pinned itself (or was refused) before it handled anything.
            endpoint.ask(Ping).wait().unwrap();
            assert_eq!(endpoint.stats().pinned_core, expected, "{pinning:?}");
            bus.shutdown().unwrap();
        }
    }

    /// An endpoint whose thread fails to start: a message and an ask that reached its name
    /// in the meantime are dropped at once (the ask fails with `NoReply` instead of waiting
    /// out its timeout), the name is free again, and later calls see it stopped.
    #[test]
    fn a_failed_start_drops_what_was_queued_and_frees_the_name() {
        use std::sync::{mpsc, Barrier};

        let bus = Bus::builder().ask_timeout(std::time::Duration::from_secs(60)).build().unwrap();
        let asked = Arc::new(Barrier::new(2));
        let hook_asked = Arc::clone(&asked);
        SPAWN_FAILS_AFTER.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                hook_asked.wait();
            }));
        });
        let (reply_sender, reply_receiver) = mpsc::channel();
        std::thread::scope(|scope| {
            let racer = scope.spawn(|| {
                let endpoint = lookup_once_registered(&bus, "never");
                endpoint.send(()).unwrap();
                let reply = endpoint.ask(Ping);
                asked.wait();
                let started = Instant::now();
                reply_sender.send(reply.wait_timeout(std::time::Duration::from_secs(30))).unwrap();
                assert!(started.elapsed() < std::time::Duration::from_secs(10));
                endpoint
            });
            match bus.register("never", Pinger) {
                Err(BusError::Spawn { name, reason }) => {
                    assert_eq!(name, "never");
                    assert_eq!(reason, "injected: no thread to start");
                }
                other => panic!("expected a spawn failure, got {other:?}"),
            }
            let endpoint = racer.join().unwrap();
            let failed = reply_receiver.recv().unwrap();
            let named = |endpoint: &String| endpoint == "never";
            assert!(
                matches!(&failed, Err(crate::AskError::NoReply { endpoint }) if named(endpoint)),
                "{failed:?}"
            );
            // The racer's message and its ask, dropped with their reason.
            let dropped = endpoint.stats().dropped_by_reason;
            assert_eq!(dropped.len(), 1, "{dropped:?}");
            assert_eq!((dropped[0].reason, dropped[0].count), (THREAD_NEVER_STARTED, 2));
            assert!(endpoint.is_stopped());
            assert!(endpoint.send(()).is_err(), "a stopped endpoint refuses sends");
        });
        assert!(!bus.contains("never"));
        let again = bus.register("never", Pinger).expect("the name is free again");
        again.ask(Ping).wait_timeout(std::time::Duration::from_secs(30)).unwrap();
        bus.shutdown().unwrap();
    }

    /// The endpoint `name` of `bus`, as soon as it is registered (from a thread racing the
    /// registration); fails the test after 30 s.
    fn lookup_once_registered(bus: &Bus, name: &str) -> crate::EndpointRef<Pinger> {
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if let Ok(endpoint) = bus.lookup::<Pinger>(name) {
                return endpoint;
            }
            assert!(Instant::now() < deadline, "the name was never registered");
            std::thread::yield_now();
        }
    }

    /// An iterator of `len` unit messages whose first `next` tells `entered` and then blocks
    /// until `release` says go (or 30 s pass).
    struct BlockingBatch {
        len: usize,
        entered: std::sync::mpsc::Sender<()>,
        release: std::sync::mpsc::Receiver<()>,
    }

    impl Iterator for BlockingBatch {
        type Item = ();
        fn next(&mut self) -> Option<()> {
            if self.len == 0 {
                return None;
            }
            if self.entered.send(()).is_ok() {
                let _ = self.release.recv_timeout(std::time::Duration::from_secs(30));
            }
            self.len -= 1;
            Some(())
        }
        fn size_hint(&self) -> (usize, Option<usize>) {
            (self.len, Some(self.len))
        }
    }

    impl ExactSizeIterator for BlockingBatch {}

    /// An endpoint whose thread fails to start while a `send_iter` into it is under way, its
    /// iterator blocked: dropping what was queued waits for that push at most the bus's
    /// `shutdown_timeout`, so the registration fails in about that time instead of waiting
    /// as long as the iterator blocks.
    #[test]
    fn a_failed_start_waits_for_a_push_under_way_at_most_the_shutdown_timeout() {
        use std::sync::mpsc;

        let shutdown_timeout = std::time::Duration::from_millis(200);
        let bus = Bus::builder().shutdown_timeout(shutdown_timeout).build().unwrap();
        let (entered_sender, entered) = mpsc::channel();
        let (release, release_receiver) = mpsc::channel();
        SPAWN_FAILS_AFTER.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                // The racer's push is under way, its iterator blocked in its first `next`.
                entered.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
            }));
        });
        std::thread::scope(|scope| {
            let racer = scope.spawn(|| {
                let endpoint = lookup_once_registered(&bus, "blocked");
                let batch =
                    BlockingBatch { len: 4, entered: entered_sender, release: release_receiver };
                // Its outcome depends on when the push sees the inbox closed; only its end
                // matters here.
                let _ = endpoint.send_iter(batch);
            });
            let started = Instant::now();
            let registered = bus.register("blocked", Pinger);
            let took = started.elapsed();
            release.send(()).unwrap();
            racer.join().unwrap();
            assert!(matches!(registered, Err(BusError::Spawn { .. })), "{registered:?}");
            assert!(took >= shutdown_timeout, "it waited for the push: {took:?}");
            assert!(took < std::time::Duration::from_secs(10), "bounded: {took:?}");
        });
        bus.shutdown().unwrap();
    }

    fn held_threads(bus: &Bus) -> usize {
        bus.threads.lock().unwrap().len()
    }

    #[test]
    fn endpoints_that_come_and_go_leave_no_finished_threads_unjoined() {
        let bus = Bus::builder().build().unwrap();
        for run in 0..20 {
            let name = format!("run-{run}");
            bus.register(&name, IDLE).unwrap();
            bus.stop(&name).unwrap();
        }
        // Each stopped thread finishes on its own; the next registration joins the finished.
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        loop {
            bus.register("probe", IDLE).unwrap();
            bus.stop("probe").unwrap();
            // At most the probe just started and the ones not yet finished.
            if held_threads(&bus) <= 2 {
                break;
            }
            assert!(Instant::now() < deadline, "{} threads held", held_threads(&bus));
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Once the held threads finished, one end signal waits per held thread: the joined
        // ones took theirs back, no more and no less.
        while !bus.threads.lock().unwrap().iter().all(|(_, handle)| handle.is_finished()) {
            assert!(Instant::now() < deadline, "the stopped threads did not finish");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let signals = bus.thread_ended.1.lock().unwrap().try_iter().count();
        assert_eq!(signals, held_threads(&bus));
        // Put back what was counted: shutdown waits for one per thread.
        for _ in 0..signals {
            bus.thread_ended.0.send(()).unwrap();
        }
        let started = Instant::now();
        bus.shutdown().unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "shutdown waited it out");
    }

    #[test]
    fn a_thread_that_panicked_and_was_joined_by_a_registration_is_still_reported_at_shutdown() {
        let bus = Bus::builder().build().unwrap();
        bus.register("dies", Idle { panics_on_drop: true }).unwrap();
        bus.stop("dies").unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        while !bus.threads.lock().unwrap().iter().all(|(_, handle)| handle.is_finished()) {
            assert!(Instant::now() < deadline, "the stopped thread did not finish");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // This registration joins the finished thread (and its panic).
        bus.register("lives", IDLE).unwrap();
        assert_eq!(held_threads(&bus), 1);
        match bus.shutdown() {
            Err(BusError::ThreadPanicked { name, message, unfinished }) => {
                assert_eq!(name, "dies");
                assert_eq!(message, "injected: an endpoint that panics when dropped");
                assert!(unfinished.is_empty(), "{unfinished:?}");
            }
            other => panic!("expected ThreadPanicked, got {other:?}"),
        }
    }

    /// Held in its handler until its gate is dropped (or 30 s pass).
    struct Stuck(crossbeam_channel::Receiver<()>);

    impl Endpoint for Stuck {
        type Message = ();
        type Request = ();

        fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            let _ = self.0.recv_timeout(std::time::Duration::from_secs(30));
            Ok(())
        }

        fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    /// A shutdown that finds a panicked thread and also times out on another reports both:
    /// before, the endpoints left running were only logged.
    #[test]
    fn a_shutdown_with_a_panic_and_a_timeout_reports_both() {
        let bus =
            Bus::builder().shutdown_timeout(std::time::Duration::from_millis(100)).build().unwrap();
        bus.register("dies", Idle { panics_on_drop: true }).unwrap();
        bus.stop("dies").unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let dies_finished = || {
            let threads = bus.threads.lock().unwrap();
            threads
                .iter()
                .filter(|(name, _)| name == "dies")
                .all(|(_, handle)| handle.is_finished())
        };
        while !dies_finished() {
            assert!(Instant::now() < deadline, "the stopped thread did not finish");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (gate, held) = crossbeam_channel::bounded::<()>(0);
        let stuck = bus.register("stuck", Stuck(held)).unwrap();
        stuck.send(()).unwrap();
        // Taken off the inbox: its handler holds it now.
        while stuck.stats().inbox_depth > 0 {
            assert!(Instant::now() < deadline, "the stuck endpoint never took its message");
            std::thread::yield_now();
        }
        match bus.shutdown() {
            Err(BusError::ThreadPanicked { name, unfinished, .. }) => {
                assert_eq!(name, "dies");
                assert_eq!(unfinished, vec!["stuck".to_owned()]);
            }
            other => panic!("expected ThreadPanicked naming the unfinished, got {other:?}"),
        }
        drop(gate);
    }
}
