//! The endpoint thread: start hook, drain loop, idle strategy, stop hook.
//!
//! The loop takes up to `drain_batch` messages from each inbox shard in turn and hands them to
//! the endpoint, one at a time: runs of one-way messages through [`Endpoint::handle_run`] (so
//! that an endpoint can carry work from one message to the next), each request and each timed
//! message on its own; each round runs inside `catch_unwind`: a panicking handler fails
//! its asker and is logged, and the next message is handled as usual. When a round finds nothing,
//! the thread follows the configured [`Idle`] strategy: spin (with the CPU's spin hint) for a while
//! after the last message, then yield a few times, then park until a producer rings the doorbell.
//! Work can be announced that no round can take yet: a producer claimed a ring slot and was
//! preempted before filling it, or the inbox is closing while a push is in flight. The thread that
//! would end that may be waiting for this very core (2 cores, more busy threads), so the endpoint
//! does not spin on it: it retries once, yields, then dozes for growing times up to [`DOZE_MAX`]
//! ([`Stall`]). With [`Idle::Adaptive`] the spin is long only while recent idle gaps were short
//! ([`SpinBudget`]): on a 2-core machine an endpoint that receives a large message every 60 us
//! spent a third of a core spinning through gaps it could not bridge, taken from the threads
//! producing its messages. Once the inbox is closed and drained, `on_stop` runs and the thread
//! ends.

use std::{
    marker::PhantomData,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use super::{
    endpoint::{Context, Endpoint, Envelope, Inbox},
    reply::{fail_replies_orphaned_by_panic, has_orphaned_replies, RequestScope},
    stats::HANDLER_TIME_SAMPLE_EVERY,
};
use crate::{
    config::Idle,
    error::HandlerError,
    queue::{Consume, Consumer, Run},
    AskError,
};

/// Drain rounds between two looks for replies orphaned by a panic a handler caught itself
/// (an idle endpoint polls in rounds too, and looks again before it parks).
const ORPHAN_CHECK_EVERY_ROUNDS: u32 = 64;
/// CPU spin hints between two polls of an idle inbox.
const IDLE_PAUSES_PER_POLL: u32 = 4;
/// Yields after spinning, before parking.
const YIELDS_BEFORE_PARK: u32 = 8;
/// Longest single park; the doorbell makes wake-ups prompt, this only bounds a lost one.
const PARK_MAX: Duration = Duration::from_millis(50);
/// Steps, once work is announced that no round could take, before dozing: one more round at
/// once, then yields.
const STALLED_YIELDS: u32 = 4;
/// The first doze of a stall; each next one doubles, up to [`DOZE_MAX`].
const DOZE_MIN: Duration = Duration::from_micros(20);
/// The longest doze of a stall: the most a message filled meanwhile waits, if its producer
/// does not ring.
const DOZE_MAX: Duration = Duration::from_millis(1);

/// Runs an endpoint until its inbox is closed and drained.
pub(crate) fn run_endpoint<E: Endpoint>(
    mut endpoint: E,
    inbox: Arc<Inbox<E>>,
    idle_strategy: Idle,
    drain_batch: usize,
) {
    let mut consumer = inbox.queue.consumer().expect("an inbox has exactly one endpoint thread");
    inbox.enter_thread();
    let context = Context { inbox: Arc::clone(&inbox) };
    guarded_hook(&inbox, "on_start", || endpoint.on_start(&context));
    tracing::info!(endpoint = %inbox.name, "endpoint started");

    let mut handled_total = 0u64;
    let mut idle_since: Option<Instant> = None;
    let mut spin_budget = SpinBudget::new(idle_strategy);
    let mut idle = IdlePhase::default();
    let mut stall = Stall::default();
    let mut rounds = 0u32;
    loop {
        // One `catch_unwind` per round, not per message: the ring publishes its head before
        // each handler call, so a panic unwinding out of the round leaves the inbox consistent
        // (the panicking message counts as consumed) and the next round carries on.
        let round = catch_unwind(AssertUnwindSafe(|| {
            let mut ending_idle = 0;
            let mut per_shard = drain_batch;
            if idle_since.is_some() {
                ending_idle = drain_round_ending_idle(
                    &mut consumer,
                    &mut endpoint,
                    &context,
                    &mut handled_total,
                    || {
                        if let Some(since) = idle_since.take() {
                            spin_budget.record_gap(since.elapsed());
                        }
                    },
                );
                if ending_idle == 0 {
                    return 0;
                }
                // The two rounds together take at most `drain_batch` from each shard, as any.
                per_shard = per_shard.saturating_sub(1);
            }
            ending_idle
                + consumer.drain_round_into(
                    per_shard,
                    &mut Dispatcher {
                        endpoint: &mut endpoint,
                        context: &context,
                        handled_total: &mut handled_total,
                    },
                )
        }));
        inbox.counters.handled.store(handled_total, Ordering::Relaxed);
        let handled = match round {
            Ok(handled) => {
                // A handler that caught a panic itself while a replier was being dropped left
                // it waiting for a panic message: fail it, looking every so many rounds (a
                // thread-local access) rather than after each.
                rounds = rounds.wrapping_add(1);
                if rounds.is_multiple_of(ORPHAN_CHECK_EVERY_ROUNDS) && has_orphaned_replies() {
                    fail_replies_orphaned_by_panic("a panic caught inside the handler");
                }
                handled
            }
            Err(payload) => {
                inbox.counters.panicked.fetch_add(1, Ordering::Relaxed);
                let message = panic_message(payload.as_ref());
                drop_caught(payload);
                tracing::error!(endpoint = %inbox.name, panic = %message, "handler panicked");
                fail_replies_orphaned_by_panic(&message);
                // SPEC A.6: a panic is a handler error, and `on_error` hears of it too.
                let error = AskError::HandlerPanicked { endpoint: inbox.name.to_owned(), message };
                let error: HandlerError = Box::new(error);
                if let Err(payload) = catch_unwind(AssertUnwindSafe(|| endpoint.on_error(&error))) {
                    drop_caught(payload);
                    tracing::error!(endpoint = %inbox.name, "on_error panicked on a handler panic");
                }
                1
            }
        };
        if handled > 0 {
            idle = IdlePhase::default();
            stall = Stall::default();
            continue;
        }
        // Idle. Touch only read-mostly state here: polling the rings' tails would steal the
        // producers' hottest cache line on every turn of this loop.
        if inbox.queue.is_closed() && consumer.is_drained() {
            break;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        match idle.next_step(since, spin_budget.spin()) {
            IdleStep::Spin => {
                // A PAUSE costs ~30 ns here (tens to ~150 cycles, by CPU): a few per poll keep
                // the reaction time well under a microsecond.
                for _ in 0..IDLE_PAUSES_PER_POLL {
                    std::hint::spin_loop();
                }
            }
            IdleStep::Yield => std::thread::yield_now(),
            IdleStep::Park => {
                if has_orphaned_replies() {
                    fail_replies_orphaned_by_panic("a panic caught inside the handler");
                }
                if consumer.park_until_work(PARK_MAX) {
                    stall = Stall::default();
                } else {
                    match stall.next_step() {
                        StallStep::Retry => {}
                        StallStep::Yield => std::thread::yield_now(),
                        StallStep::Doze(timeout) => consumer.doze(timeout),
                    }
                }
            }
        }
    }
    guarded_hook(&inbox, "on_stop", || endpoint.on_stop());
    tracing::info!(endpoint = %inbox.name, handled = handled_total, "endpoint stopped");
}

/// Idle polls between two clock reads while spinning (about 2 us of spinning here).
const POLLS_PER_CLOCK_READ: u32 = 16;

/// What an idle endpoint does after a poll that found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdleStep {
    Spin,
    Yield,
    Park,
}

/// Where an idle period stands: spinning, then yielding, then parking, each phase once (a
/// yield does not restart the spin).
#[derive(Debug, Default, Clone, Copy)]
struct IdlePhase {
    polls: u32,
    spin_over: bool,
    yields: u32,
}

impl IdlePhase {
    /// The step after an empty poll, in an idle period that began at `since`.
    fn next_step(&mut self, since: Instant, spin: Duration) -> IdleStep {
        if !self.spin_over {
            self.polls += 1;
            // The clock is read every few polls only; a zero spin ends at once.
            let check = spin.is_zero() || self.polls.is_multiple_of(POLLS_PER_CLOCK_READ);
            if !check || since.elapsed() < spin {
                return IdleStep::Spin;
            }
            self.spin_over = true;
        }
        if self.yields < YIELDS_BEFORE_PARK {
            self.yields += 1;
            return IdleStep::Yield;
        }
        IdleStep::Park
    }
}

/// What a parking endpoint does when work was announced but its last round took nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StallStep {
    /// Another round at once: most announcements are a message that arrived just after the
    /// round that found nothing.
    Retry,
    Yield,
    Doze(Duration),
}

/// Announced work that rounds could not take, in a row (module doc): a retry first (a
/// message that arrived just after the empty round is taken by the next one), then yields,
/// then dozes that double from [`DOZE_MIN`] to [`DOZE_MAX`].
#[derive(Debug, Default, Clone, Copy)]
struct Stall {
    /// Announcements in a row that rounds found nothing to take for (0: none since the last
    /// message handled or park).
    rounds: u32,
}

impl Stall {
    fn next_step(&mut self) -> StallStep {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds == 1 {
            return StallStep::Retry;
        }
        if self.rounds <= STALLED_YIELDS {
            return StallStep::Yield;
        }
        let doublings = (self.rounds - STALLED_YIELDS - 1).min(16);
        StallStep::Doze((DOZE_MIN * (1 << doublings)).min(DOZE_MAX))
    }
}

/// How long an idle endpoint spins before yielding and parking, per its [`Idle`] strategy.
#[derive(Debug, Clone, Copy)]
struct SpinBudget {
    idle: Idle,
    /// Of the recent idle gaps, the share that were short, in 1/256ths (an exponentially
    /// weighted average: each gap weighs 1/8). Used by [`Idle::Adaptive`] only.
    short_share: u32,
}

impl SpinBudget {
    /// The share above which an adaptive endpoint spins its full `max_spin` (one half).
    const SPIN_FULL_ABOVE: u32 = 128;

    fn new(idle: Idle) -> Self {
        // Starts as if gaps were short: the first messages meet a spinning thread.
        Self { idle, short_share: 256 }
    }

    /// Notes an idle gap that ended: from the inbox running empty to the next message.
    fn record_gap(&mut self, gap: Duration) {
        let short = if gap <= Idle::SHORT_GAP { 256 } else { 0 };
        self.short_share = (self.short_share * 7 + short) / 8;
    }

    /// How long to spin now.
    fn spin(&self) -> Duration {
        match self.idle {
            Idle::SpinThenPark { spin } => spin,
            Idle::Adaptive { max_spin } if self.short_share > Self::SPIN_FULL_ABOVE => max_spin,
            Idle::Adaptive { max_spin } => max_spin.min(Idle::SHORT_GAP),
            Idle::Park => Duration::ZERO,
        }
    }
}

/// [`dispatch`], timed into the handler-time histogram. Out of line: it runs for one message in
/// [`HANDLER_TIME_SAMPLE_EVERY`], and the clock reads would only bloat the common path that
/// [`Dispatcher::consume`] inlines into the inbox's pop loops.
#[cold]
#[inline(never)]
fn dispatch_timed<E: Endpoint>(endpoint: &mut E, context: &Context<E>, envelope: Envelope<E>) {
    let began = Instant::now();
    dispatch(endpoint, context, envelope);
    let elapsed_ns = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
    context.inbox.counters.handler_time_ns.record(elapsed_ns);
}

/// The drain round after an idle period: one message from each shard, through the out-of-line
/// path, with `note_gap` run before the first (one clock read per idle period). Taking this
/// out of the common rounds leaves their pop loops without a per-message test for it. Returns
/// how many were handled (0: still idle, and `note_gap` did not run).
#[inline(never)]
fn drain_round_ending_idle<E: Endpoint>(
    consumer: &mut Consumer<'_, Envelope<E>>,
    endpoint: &mut E,
    context: &Context<E>,
    handled_total: &mut u64,
    note_gap: impl FnOnce(),
) -> usize {
    let mut note_gap = Some(note_gap);
    consumer.drain_round(1, |envelope| {
        if let Some(note_gap) = note_gap.take() {
            note_gap();
        }
        let sampled = handled_total.is_multiple_of(HANDLER_TIME_SAMPLE_EVERY);
        *handled_total += 1;
        dispatch_noting(endpoint, context, envelope, sampled, *handled_total);
    })
}

/// The endpoint loop's handler of one drain round's envelopes: the loop's state it updates per
/// message, borrowed for the round.
struct Dispatcher<'a, E: Endpoint> {
    endpoint: &'a mut E,
    context: &'a Context<E>,
    handled_total: &'a mut u64,
}

impl<E: Endpoint> Consume<Envelope<E>> for Dispatcher<'_, E> {
    /// Inlined into the inbox's pop loops (see `Consumer::drain_round_into`).
    #[inline(always)]
    fn consume(&mut self, envelope: Envelope<E>) {
        let sampled = self.handled_total.is_multiple_of(HANDLER_TIME_SAMPLE_EVERY);
        *self.handled_total += 1;
        // One test per message for the two rarer cases, so that the common one (a one-way
        // message, not timed) stays a few instructions around the handler call. The message
        // that ends an idle period never comes here (`drain_round_ending_idle`).
        if sampled || matches!(envelope, Envelope::Request(..)) {
            dispatch_noting(self.endpoint, self.context, envelope, sampled, *self.handled_total);
        } else {
            dispatch(self.endpoint, self.context, envelope);
        }
    }

    /// Hands the run's one-way messages to [`Endpoint::handle_run`], and each request and
    /// timed message to [`Self::consume`]. A run given to the endpoint ends before such a
    /// message, which stays queued until the endpoint returns. Inlined into the inbox's pop
    /// loops, like `consume`.
    #[inline(always)]
    fn consume_run(&mut self, run: &mut impl Run<Envelope<E>>) {
        loop {
            let timed = self.handled_total.is_multiple_of(HANDLER_TIME_SAMPLE_EVERY);
            if timed || !run.next_is(|envelope| matches!(envelope, Envelope::Message(_))) {
                match run.next() {
                    Some(envelope) => {
                        self.consume(envelope);
                        continue;
                    }
                    None => return,
                }
            }
            let before = *self.handled_total;
            let outcome = {
                let mut messages = OneWayMessages::new(&mut *run, &mut *self.handled_total);
                self.endpoint.handle_run(&mut messages, self.context)
            };
            if let Err(error) = outcome {
                note_failure(self.endpoint, self.context, &error);
            }
            if *self.handled_total == before {
                // The handler took nothing: the message goes to `consume`, so that every call
                // makes progress.
                match run.next() {
                    Some(envelope) => self.consume(envelope),
                    None => return,
                }
            }
        }
    }
}

/// The one-way messages of an inbox run, as [`Endpoint::handle_run`] sees them: they end at the
/// run's end, or before a request or the next message to time, which stay queued. Counts each
/// message taken off the inbox, as [`Dispatcher::consume`] does.
struct OneWayMessages<'a, E: Endpoint, R: Run<Envelope<E>>> {
    run: &'a mut R,
    /// The endpoint loop's count, carried in a local for the call (so that it can stay in a
    /// register) and written back to `handled_total` on drop, also when the handler panics.
    handled: u64,
    handled_total: &'a mut u64,
    _messages_of: PhantomData<fn() -> E>,
}

impl<'a, E: Endpoint, R: Run<Envelope<E>>> OneWayMessages<'a, E, R> {
    fn new(run: &'a mut R, handled_total: &'a mut u64) -> Self {
        Self { run, handled: *handled_total, handled_total, _messages_of: PhantomData }
    }

    /// A `handle_run` that panicked before taking a message consumes the one it was called
    /// for, as a panicking `handle` does: left queued, it would be handed to `handle_run`
    /// again and again.
    #[cold]
    fn consume_the_message_panicked_on(&mut self) {
        if self.run.next().is_some() {
            self.handled += 1;
        }
    }
}

impl<E: Endpoint, R: Run<Envelope<E>>> Drop for OneWayMessages<'_, E, R> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.handled == *self.handled_total && std::thread::panicking() {
            self.consume_the_message_panicked_on();
        }
        *self.handled_total = self.handled;
    }
}

impl<E: Endpoint, R: Run<Envelope<E>>> Iterator for OneWayMessages<'_, E, R> {
    type Item = E::Message;

    #[inline(always)]
    fn next(&mut self) -> Option<E::Message> {
        if self.handled.is_multiple_of(HANDLER_TIME_SAMPLE_EVERY) {
            return None;
        }
        let envelope = self.run.next_if(|envelope| matches!(envelope, Envelope::Message(_)))?;
        self.handled += 1;
        match envelope {
            Envelope::Message(message) => Some(message),
            Envelope::Request(..) => unreachable!("`next_if` takes one-way messages only"),
        }
    }
}

/// [`dispatch`] of a message that is a request (the handled count is stored first, so a reply
/// never shows a stale count; otherwise it is stored after each round) or is timed (one in
/// [`HANDLER_TIME_SAMPLE_EVERY`]).
#[inline(never)]
fn dispatch_noting<E: Endpoint>(
    endpoint: &mut E,
    context: &Context<E>,
    envelope: Envelope<E>,
    sampled: bool,
    handled_total: u64,
) {
    if matches!(envelope, Envelope::Request(..)) {
        context.inbox.counters.handled.store(handled_total, Ordering::Relaxed);
    }
    if sampled {
        dispatch_timed(endpoint, context, envelope);
    } else {
        dispatch(endpoint, context, envelope);
    }
}

/// Hands one envelope to the endpoint (panics are contained by the caller, per round).
#[inline(always)]
fn dispatch<E: Endpoint>(endpoint: &mut E, context: &Context<E>, envelope: Envelope<E>) {
    let outcome = match envelope {
        Envelope::Message(message) => endpoint.handle(message, context),
        Envelope::Request(request, slot) => {
            // The request's replier, if the handler drops it without replying, fails with the
            // handler's error, if it returns one (SPEC A.6), once it has returned.
            let scope = RequestScope::enter(slot);
            let outcome = endpoint.handle_request(request, context);
            scope.finish(outcome)
        }
    };
    if let Err(error) = outcome {
        note_failure(endpoint, context, &error);
    }
}

/// Counts a handler's error and hands it to [`Endpoint::on_error`].
#[cold]
fn note_failure<E: Endpoint>(endpoint: &mut E, context: &Context<E>, error: &HandlerError) {
    context.inbox.counters.failed.fetch_add(1, Ordering::Relaxed);
    endpoint.on_error(error);
}

/// Runs a start or stop hook; a panic is counted (`EndpointStats::hook_panics`) and logged
/// instead of ending the thread.
fn guarded_hook<E: Endpoint>(inbox: &Inbox<E>, hook: &str, run: impl FnOnce()) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(run)) {
        let message = panic_message(payload.as_ref());
        drop_caught(payload);
        inbox.counters.hook_panics.fetch_add(1, Ordering::Relaxed);
        tracing::error!(endpoint = %inbox.name, hook, panic = %message, "endpoint hook panicked");
        fail_replies_orphaned_by_panic(&message);
    }
}

/// Drops a caught panic's payload where a panic of its own `Drop` is caught too (it would end
/// the endpoint thread, leaving its inbox open and its senders waiting).
fn drop_caught(payload: Box<dyn std::any::Any + Send>) {
    if catch_unwind(AssertUnwindSafe(move || drop(payload))).is_err() {
        tracing::error!("dropping a panic's payload panicked");
    }
}

/// A panic payload's message (the text of `panic!`), or a placeholder for other payloads.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX_SPIN: Duration = Duration::from_micros(50);
    const LONG_GAP: Duration = Duration::from_micros(60);

    fn adaptive() -> SpinBudget {
        SpinBudget::new(Idle::Adaptive { max_spin: MAX_SPIN })
    }

    #[test]
    fn adaptive_spin_shrinks_after_long_gaps_and_grows_back_after_short_ones() {
        let mut budget = adaptive();
        assert_eq!(budget.spin(), MAX_SPIN, "a fresh endpoint spins fully");
        for _ in 0..8 {
            budget.record_gap(LONG_GAP);
        }
        assert_eq!(budget.spin(), Idle::SHORT_GAP, "gaps longer than a wake-up: spin briefly");
        for _ in 0..8 {
            budget.record_gap(Duration::from_nanos(300));
        }
        assert_eq!(budget.spin(), MAX_SPIN, "short gaps again: spin fully");
    }

    #[test]
    fn adaptive_spin_follows_the_majority_of_recent_gaps() {
        let mut budget = adaptive();
        // One short gap in three: a minority, whichever gap came last.
        for _ in 0..32 {
            budget.record_gap(Idle::SHORT_GAP);
            budget.record_gap(LONG_GAP);
            budget.record_gap(LONG_GAP);
        }
        assert_eq!(budget.spin(), Idle::SHORT_GAP);
        budget.record_gap(Idle::SHORT_GAP);
        assert_eq!(budget.spin(), Idle::SHORT_GAP, "one short gap does not flip it");
        // Three short gaps in four: most are short.
        for _ in 0..32 {
            budget.record_gap(Idle::SHORT_GAP);
            budget.record_gap(Idle::SHORT_GAP);
            budget.record_gap(Idle::SHORT_GAP);
            budget.record_gap(LONG_GAP);
        }
        assert_eq!(budget.spin(), MAX_SPIN);
    }

    #[test]
    fn an_idle_period_spins_then_yields_then_parks_and_never_spins_again() {
        let since = Instant::now();
        let mut phase = IdlePhase::default();
        let steps: Vec<IdleStep> =
            (0..YIELDS_BEFORE_PARK + 3).map(|_| phase.next_step(since, Duration::ZERO)).collect();
        assert!(steps[..YIELDS_BEFORE_PARK as usize].iter().all(|step| *step == IdleStep::Yield));
        assert!(steps[YIELDS_BEFORE_PARK as usize..].iter().all(|step| *step == IdleStep::Park));

        let mut phase = IdlePhase::default();
        let long = Duration::from_secs(3600);
        for _ in 0..10 * POLLS_PER_CLOCK_READ {
            assert_eq!(phase.next_step(since, long), IdleStep::Spin, "within the spin");
        }
        let mut phase = IdlePhase::default();
        let spin = Duration::from_millis(1);
        let spin_ended = since + spin;
        let mut first_after_spin = None;
        while first_after_spin.is_none() {
            let step = phase.next_step(since, spin);
            if step != IdleStep::Spin {
                first_after_spin = Some(step);
            }
        }
        assert!(Instant::now() >= spin_ended, "spun at least the spin");
        assert_eq!(first_after_spin, Some(IdleStep::Yield));
        // The following yields do not restart the spin.
        for _ in 1..YIELDS_BEFORE_PARK {
            assert_eq!(phase.next_step(since, spin), IdleStep::Yield);
        }
        for _ in 0..3 * POLLS_PER_CLOCK_READ {
            assert_eq!(phase.next_step(since, spin), IdleStep::Park, "parks from now on");
        }
    }

    /// Counts its messages and records, for each, the handled count the loop last stored (once
    /// per round); tells the test its thread's id when it starts.
    struct Counting {
        thread_id: std::sync::mpsc::Sender<String>,
        handled: Arc<std::sync::atomic::AtomicUsize>,
        stored_counts: Arc<std::sync::Mutex<Vec<u64>>>,
    }

    impl Endpoint for Counting {
        type Message = u64;
        type Request = ();

        fn on_start(&mut self, _: &crate::runtime::Context<Self>) {
            let link = std::fs::read_link("/proc/thread-self").unwrap();
            let _ = self.thread_id.send(link.file_name().unwrap().to_string_lossy().into_owned());
        }

        fn handle(
            &mut self,
            _: u64,
            context: &crate::runtime::Context<Self>,
        ) -> Result<(), HandlerError> {
            let stored = context.inbox.counters.handled.load(Ordering::Relaxed);
            self.stored_counts.lock().unwrap().push(stored);
            self.handled.fetch_add(1, Ordering::Release);
            Ok(())
        }

        fn handle_request(
            &mut self,
            (): (),
            _: &crate::runtime::Context<Self>,
        ) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    /// A [`Counting`] endpoint registered on a bus, and what the tests read of it.
    struct Registered {
        endpoint: crate::EndpointRef<Counting>,
        /// Its thread's id (`/proc/self/task/<tid>`).
        tid: String,
        handled: Arc<std::sync::atomic::AtomicUsize>,
        stored_counts: Arc<std::sync::Mutex<Vec<u64>>>,
    }

    /// Registers a [`Counting`] endpoint as `name` and waits (bounded) for its thread to start.
    fn register_counting(bus: &crate::Bus, name: &str) -> Registered {
        let (thread_id, started) = std::sync::mpsc::channel();
        let handled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stored_counts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let counting = Counting {
            thread_id,
            handled: Arc::clone(&handled),
            stored_counts: Arc::clone(&stored_counts),
        };
        let endpoint = bus.register(name, counting).unwrap();
        let tid = started.recv_timeout(Duration::from_secs(60)).unwrap();
        Registered { endpoint, tid, handled, stored_counts }
    }

    /// Nanoseconds thread `tid` of this process has run (`schedstat`'s first field).
    fn thread_cpu_ns(tid: &str) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).unwrap();
        stat.split_whitespace().next().unwrap().parse().unwrap()
    }

    /// Yields `first`, then waits (bounded) for the test's word before yielding `second`: a
    /// ring slot claimed for `second` stays unfilled meanwhile.
    struct HeldBatch {
        values: std::vec::IntoIter<u64>,
        reached: std::sync::mpsc::Sender<()>,
        release: std::sync::mpsc::Receiver<()>,
    }

    impl Iterator for HeldBatch {
        type Item = Envelope<Counting>;

        fn next(&mut self) -> Option<Self::Item> {
            if self.values.len() == 1 {
                let _ = self.reached.send(());
                self.release.recv_timeout(Duration::from_secs(60)).unwrap();
            }
            self.values.next().map(Envelope::Message)
        }

        fn size_hint(&self) -> (usize, Option<usize>) {
            self.values.size_hint()
        }
    }

    impl ExactSizeIterator for HeldBatch {}

    /// The adaptive strategy hears of every idle gap (the message that ends one is handled by
    /// `drain_round_ending_idle`): after long gaps it spins briefly, so an endpoint whose
    /// messages come a few milliseconds apart parks through the gaps instead of spinning
    /// through them (it would, with `max_spin` above the gap, if the gaps went unnoted).
    #[test]
    fn an_adaptive_endpoint_fed_at_long_gaps_parks_through_them() {
        let bus = crate::Bus::builder()
            .idle(Idle::Adaptive { max_spin: Idle::MAX_SPIN })
            .build()
            .unwrap();
        let Registered { endpoint, tid, handled, .. } = register_counting(&bus, "gaps");
        let gap = Duration::from_millis(2);
        assert!(gap > Idle::SHORT_GAP && gap < Idle::MAX_SPIN);
        // One message, handled, then a gap of idle time (the stimulus, not a wait for a result).
        let message_then_gap = |sent: usize| {
            endpoint.send(sent as u64).unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            while handled.load(Ordering::Acquire) < sent {
                assert!(Instant::now() < deadline, "message {sent} was not handled");
                std::thread::yield_now();
            }
            std::thread::sleep(gap);
        };
        // 16 long gaps take the share of short ones from all to about a tenth.
        for sent in 1..=16 {
            message_then_gap(sent);
        }
        let cpu_before = thread_cpu_ns(&tid);
        let measured_from = Instant::now();
        for sent in 17..=36 {
            message_then_gap(sent);
        }
        let cpu = Duration::from_nanos(thread_cpu_ns(&tid) - cpu_before);
        let elapsed = measured_from.elapsed();
        // Spinning through every gap would take about all of `elapsed`.
        assert!(cpu < elapsed / 4, "the endpoint ran {cpu:?} of {elapsed:?} between messages");
        bus.shutdown().unwrap();
    }

    /// The round that ends an idle period and the round after it take at most `drain_batch`
    /// messages from a shard between them, as any round does: no more than `drain_batch`
    /// messages see the same stored handled count.
    #[test]
    fn the_rounds_after_an_idle_period_take_at_most_drain_batch_from_a_shard() {
        let drain_batch = 2;
        let bus = crate::Bus::builder().drain_batch(drain_batch).build().unwrap();
        let Registered { endpoint, tid, handled, stored_counts } =
            register_counting(&bus, "rounds");
        // Parked: its idle period has begun, so the batch below ends one.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
            if stat[stat.rfind(')').unwrap() + 2..].starts_with('S') {
                break;
            }
            assert!(Instant::now() < deadline, "the idle endpoint never parked");
            std::thread::yield_now();
        }
        endpoint.send_batch((0..6).collect()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while handled.load(Ordering::Acquire) < 6 {
            assert!(Instant::now() < deadline, "the batch was not handled");
            std::thread::yield_now();
        }
        let stored_counts = stored_counts.lock().unwrap().clone();
        let mut per_round = std::collections::BTreeMap::<u64, usize>::new();
        for stored in &stored_counts {
            *per_round.entry(*stored).or_default() += 1;
        }
        assert!(
            per_round.values().all(|&taken| taken <= drain_batch),
            "a round took more than {drain_batch}: stored counts seen {stored_counts:?}"
        );
        bus.shutdown().unwrap();
    }

    #[test]
    fn an_endpoint_whose_producer_stalls_mid_claim_dozes_instead_of_spinning() {
        // No lanes: the batch goes to a shared ring, whose claim is visible before its fill.
        let bus = crate::Bus::builder().inbox_lanes(0).build().unwrap();
        let Registered { endpoint, tid, handled, .. } = register_counting(&bus, "stalled");

        let (reached, at_second) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel();
        let inbox = Arc::clone(&endpoint.inbox);
        let producer = std::thread::spawn(move || {
            let batch = HeldBatch { values: vec![1, 2].into_iter(), reached, release: released };
            inbox.queue.push_batch_from(batch, None).map_err(|_| "the push failed")
        });
        at_second.recv_timeout(Duration::from_secs(60)).unwrap();
        // Both slots are claimed and only the first is filled: the endpoint takes it, then
        // sees work announced that it cannot take, for as long as the window lasts. Spinning
        // on it takes nearly all of a core (about 99% before the endpoint dozed); the window
        // opens once the first message is handled, and its bound leaves room for the spin
        // that follows a message (up to the adaptive maximum) and a slow, shared machine.
        let deadline = Instant::now() + Duration::from_secs(60);
        while handled.load(Ordering::Acquire) == 0 {
            assert!(Instant::now() < deadline, "the filled slot was not taken");
            std::thread::yield_now();
        }
        let window = Duration::from_millis(300);
        let cpu_before = thread_cpu_ns(&tid);
        let window_started = Instant::now();
        std::thread::sleep(window);
        let cpu = Duration::from_nanos(thread_cpu_ns(&tid) - cpu_before);
        let elapsed = window_started.elapsed();
        assert_eq!(handled.load(Ordering::Acquire), 1, "the claimed slot was taken unfilled");
        assert!(cpu < elapsed / 4, "the endpoint ran {cpu:?} of {elapsed:?} waiting on a claim");

        release.send(()).unwrap();
        producer.join().unwrap().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while handled.load(Ordering::Acquire) < 2 {
            assert!(Instant::now() < deadline, "the filled batch was not handled");
            std::thread::yield_now();
        }
        bus.shutdown().unwrap();
    }

    #[test]
    fn a_stall_retries_then_yields_then_dozes_for_doubling_times_up_to_the_cap() {
        let mut stall = Stall::default();
        let steps: Vec<StallStep> = (0..STALLED_YIELDS + 12).map(|_| stall.next_step()).collect();
        assert_eq!(steps[0], StallStep::Retry);
        assert!(steps[1..STALLED_YIELDS as usize].iter().all(|step| *step == StallStep::Yield));
        let dozes: Vec<Duration> = steps[STALLED_YIELDS as usize..]
            .iter()
            .map(|step| match step {
                StallStep::Doze(timeout) => *timeout,
                other => panic!("{other:?} after dozing began: {steps:?}"),
            })
            .collect();
        assert_eq!(dozes[0], DOZE_MIN);
        assert_eq!(dozes[1], DOZE_MIN * 2);
        assert!(dozes.windows(2).all(|pair| pair[1] >= pair[0]), "{dozes:?}");
        assert_eq!(*dozes.last().unwrap(), DOZE_MAX);
        for _ in 0..100 {
            assert_eq!(stall.next_step(), StallStep::Doze(DOZE_MAX));
        }
    }

    #[test]
    fn fixed_strategies_ignore_the_gaps() {
        let spin = Duration::from_micros(20);
        let mut fixed = SpinBudget::new(Idle::SpinThenPark { spin });
        let mut park = SpinBudget::new(Idle::Park);
        for _ in 0..16 {
            fixed.record_gap(LONG_GAP);
            park.record_gap(Duration::ZERO);
        }
        assert_eq!(fixed.spin(), spin);
        assert_eq!(park.spin(), Duration::ZERO);
        let tiny = Duration::from_micros(1);
        let mut short_max = SpinBudget::new(Idle::Adaptive { max_spin: tiny });
        for _ in 0..16 {
            short_max.record_gap(LONG_GAP);
        }
        assert_eq!(short_max.spin(), tiny, "never more than max_spin");
    }

    /// What a [`RunRecording`] endpoint saw, in order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Seen {
        /// The messages one `handle_run` call took.
        Run(Vec<u64>),
        /// A message through `handle`.
        One(u64),
        Request,
    }

    /// Records how its messages arrive. `handle_run` fails once it has taken `fail_at`, panics
    /// once it has taken `panic_at`, panics after the end of the run that took `panic_after`,
    /// and takes nothing at all while `refuse_runs` is set.
    struct RunRecording {
        seen: Arc<std::sync::Mutex<Vec<Seen>>>,
        fail_at: Option<u64>,
        panic_at: Option<u64>,
        panic_after: Option<u64>,
        /// The next `handle_run` call panics before taking a message (once).
        panic_before_taking: bool,
        refuse_runs: bool,
        errors: Arc<std::sync::atomic::AtomicUsize>,
        /// `handle` of message 0 waits (bounded) for the test's word: what the test sends
        /// meanwhile queues up behind it.
        gate: Option<std::sync::mpsc::Receiver<()>>,
    }

    impl Endpoint for RunRecording {
        type Message = u64;
        type Request = crate::Replier<()>;

        fn handle(&mut self, message: u64, _: &Context<Self>) -> Result<(), HandlerError> {
            if let (0, Some(gate)) = (message, &self.gate) {
                gate.recv_timeout(Duration::from_secs(60)).unwrap();
            }
            self.seen.lock().unwrap().push(Seen::One(message));
            Ok(())
        }

        fn handle_run(
            &mut self,
            messages: &mut impl Iterator<Item = u64>,
            _: &Context<Self>,
        ) -> Result<(), HandlerError> {
            if self.refuse_runs {
                return Ok(());
            }
            if std::mem::take(&mut self.panic_before_taking) {
                panic!("the test's panic before taking a message");
            }
            let mut run = Vec::new();
            let mut outcome = Ok(());
            for message in messages.by_ref() {
                run.push(message);
                assert_ne!(Some(message), self.panic_at, "the test's panic");
                if Some(message) == self.fail_at {
                    outcome = Err("the test's failure".into());
                    break;
                }
            }
            let panics = self.panic_after.is_some_and(|message| run.contains(&message));
            self.seen.lock().unwrap().push(Seen::Run(run));
            assert!(!panics, "the test's panic after a run");
            outcome
        }

        fn handle_request(
            &mut self,
            replier: crate::Replier<()>,
            _: &Context<Self>,
        ) -> Result<(), HandlerError> {
            self.seen.lock().unwrap().push(Seen::Request);
            replier.reply(());
            Ok(())
        }

        fn on_error(&mut self, _: &HandlerError) {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    struct Ping;

    impl crate::Ask<RunRecording> for Ping {
        type Reply = ();
        fn into_request(self, replier: crate::Replier<()>) -> crate::Replier<()> {
            replier
        }
    }

    /// Sends `0..count` in batches of `batch` from this thread, with a request after the batch
    /// that ends at `ask_after`, and waits (bounded) until the endpoint handled them all; returns
    /// what it saw and its statistics. The inbox is one shared ring (a lane publishes each push
    /// as a run of its own), and the endpoint holds message 0 until everything is queued, so
    /// that messages and the request share the runs the endpoint drains.
    fn run_recording(
        mut endpoint: RunRecording,
        count: u64,
        batch: u64,
        ask_after: u64,
    ) -> (Vec<Seen>, crate::EndpointStats) {
        let seen = Arc::clone(&endpoint.seen);
        let (release, gate) = std::sync::mpsc::channel();
        endpoint.gate = Some(gate);
        let bus = crate::Bus::builder().inbox_lanes(0).inbox_shards(1).build().unwrap();
        let endpoint = bus.register("runs", endpoint).unwrap();
        let mut reply = None;
        for start in (0..count).step_by(batch as usize) {
            let end = (start + batch).min(count);
            endpoint.send_batch((start..end).collect()).unwrap();
            if end == ask_after {
                reply = Some(endpoint.ask(Ping));
            }
        }
        release.send(()).unwrap();
        if let Some(reply) = reply {
            reply.wait_timeout(Duration::from_secs(60)).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while endpoint.stats().handled < count + u64::from(ask_after > 0) {
            assert!(Instant::now() < deadline, "handled by the deadline: {:?}", endpoint.stats());
            std::thread::yield_now();
        }
        let stats = endpoint.stats();
        bus.shutdown().unwrap();
        let seen = seen.lock().unwrap().clone();
        (seen, stats)
    }

    fn recording() -> RunRecording {
        RunRecording {
            seen: Arc::default(),
            fail_at: None,
            panic_at: None,
            panic_after: None,
            panic_before_taking: false,
            refuse_runs: false,
            errors: Arc::default(),
            gate: None,
        }
    }

    /// The messages of `seen` in the order handled, and the request's place among them.
    fn handled_order(seen: &[Seen]) -> (Vec<u64>, Option<usize>) {
        let mut messages = Vec::new();
        let mut request_at = None;
        for event in seen {
            match event {
                Seen::Run(run) => messages.extend(run),
                Seen::One(message) => messages.push(*message),
                Seen::Request => request_at = Some(messages.len()),
            }
        }
        (messages, request_at)
    }

    /// One-way messages reach `handle_run` in runs, each message exactly once and in order; a
    /// run ends before a request, and before each message the loop times (every
    /// `HANDLER_TIME_SAMPLE_EVERY`-th taken off the inbox), which goes to `handle` instead.
    #[test]
    fn one_way_messages_arrive_in_runs_that_end_before_requests_and_timed_messages() {
        let (seen, stats) = run_recording(recording(), 2000, 500, 1000);
        let (messages, request_at) = handled_order(&seen);
        assert_eq!(messages, (0..2000).collect::<Vec<_>>());
        assert_eq!(request_at, Some(1000), "the request between the batches it was sent between");
        assert!(seen.iter().any(|event| matches!(event, Seen::Run(run) if run.len() > 100)));
        assert!(!seen.contains(&Seen::Run(Vec::new())), "no call without a message: {seen:?}");
        // The request takes place 1000 in the inbox's order, so message m is taken off the
        // inbox as number m, or m + 1 after the request.
        for event in &seen {
            if let Seen::Run(run) = event {
                for message in run {
                    let taken_before = message + u64::from(*message >= 1000);
                    assert!(
                        !taken_before.is_multiple_of(HANDLER_TIME_SAMPLE_EVERY),
                        "message {message} is timed, so handled alone: {seen:?}"
                    );
                }
            }
        }
        assert_eq!((stats.handled, stats.failed), (2001, 0));
    }

    /// An `Err` from `handle_run` counts as one failed message and reaches `on_error`; the rest
    /// of the run is handed to the next call.
    #[test]
    fn a_failed_run_counts_one_failure_and_the_rest_is_still_handled() {
        let endpoint = RunRecording { fail_at: Some(300), ..recording() };
        let errors = Arc::clone(&endpoint.errors);
        let (seen, stats) = run_recording(endpoint, 600, 600, 0);
        assert_eq!(handled_order(&seen).0, (0..600).collect::<Vec<_>>());
        assert!(!seen.contains(&Seen::Run(Vec::new())), "no call without a message: {seen:?}");
        assert_eq!((stats.handled, stats.failed), (600, 1));
        assert_eq!(errors.load(Ordering::Relaxed), 1);
    }

    /// A `handle_run` that takes nothing makes no endless loop: each message then goes to
    /// `handle`.
    #[test]
    fn a_run_handler_that_takes_nothing_leaves_each_message_to_handle() {
        let endpoint = RunRecording { refuse_runs: true, ..recording() };
        let (seen, stats) = run_recording(endpoint, 300, 300, 0);
        assert_eq!(seen, (0..300).map(Seen::One).collect::<Vec<_>>());
        assert_eq!((stats.handled, stats.failed), (300, 0));
    }

    /// A panic in `handle_run` consumes the message it panicked on; the rest are handled, and
    /// the handled count includes every message taken off the inbox.
    #[test]
    fn a_panic_in_a_run_consumes_its_message_and_the_rest_are_handled() {
        let endpoint = RunRecording { panic_at: Some(100), ..recording() };
        let (seen, stats) = run_recording(endpoint, 400, 400, 0);
        let messages = handled_order(&seen).0;
        let expected: Vec<u64> = (0..400).filter(|message| *message != 100).collect();
        // The run that panicked recorded nothing: the messages it took before 100 are lost to
        // the recording, not to the endpoint (it took them).
        let missing: Vec<u64> =
            expected.iter().copied().filter(|m| !messages.contains(m)).collect();
        assert!(missing.iter().all(|message| *message < 100), "{missing:?}");
        assert_eq!(
            messages,
            expected.iter().copied().filter(|m| !missing.contains(m)).collect::<Vec<_>>()
        );
        assert_eq!((stats.handled, stats.panicked), (400, 1));
    }

    /// A run ends before a request, which stays queued while the endpoint handles the run: a
    /// handler that panics after its run ended (at a flush, say) does not take the request down
    /// with it.
    #[test]
    fn a_panic_after_a_run_leaves_the_request_after_it_to_be_handled() {
        let seen = Arc::default();
        let (release, gate) = std::sync::mpsc::channel();
        let endpoint = RunRecording {
            panic_after: Some(5),
            seen: Arc::clone(&seen),
            gate: Some(gate),
            ..recording()
        };
        let bus = crate::Bus::builder().inbox_lanes(0).inbox_shards(1).build().unwrap();
        let endpoint = bus.register("runs", endpoint).unwrap();
        // Message 0 holds the endpoint until 1..10 and the request are queued in one ring.
        endpoint.send_batch((0..10).collect()).unwrap();
        let reply = endpoint.ask(Ping);
        release.send(()).unwrap();
        let reply = reply.wait_timeout(Duration::from_secs(60));
        assert!(reply.is_ok(), "the request was handled: {reply:?}");
        let stats = endpoint.stats();
        assert_eq!((stats.handled, stats.panicked), (11, 1));
        bus.shutdown().unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.first(), Some(&Seen::One(0)), "{seen:?}");
        assert_eq!(seen.last(), Some(&Seen::Request), "{seen:?}");
    }

    /// A `handle_run` that panics before taking a message consumes the message it was called
    /// for, as a panicking `handle` does, instead of being handed it again without end.
    #[test]
    fn a_run_handler_panicking_before_taking_consumes_its_first_message() {
        let endpoint = RunRecording { panic_before_taking: true, ..recording() };
        let (seen, stats) = run_recording(endpoint, 300, 300, 0);
        // Message 0 is timed (handled alone); the first run was called for message 1.
        let expected: Vec<u64> = (0..300).filter(|message| *message != 1).collect();
        assert_eq!(handled_order(&seen).0, expected);
        assert_eq!((stats.handled, stats.panicked), (300, 1));
    }

    /// Panics in `on_start` and in `on_stop`.
    struct PanickingHooks;

    /// A request [`PanickingHooks`] answers at once.
    struct Hello;

    impl crate::Ask<PanickingHooks> for Hello {
        type Reply = ();
        fn into_request(self, replier: crate::Replier<()>) -> crate::Replier<()> {
            replier
        }
    }

    impl Endpoint for PanickingHooks {
        type Message = ();
        type Request = crate::Replier<()>;

        fn on_start(&mut self, _: &crate::runtime::Context<Self>) {
            panic!("on_start panics");
        }

        fn handle(
            &mut self,
            (): (),
            _: &crate::runtime::Context<Self>,
        ) -> Result<(), HandlerError> {
            Ok(())
        }

        fn handle_request(
            &mut self,
            replier: crate::Replier<()>,
            _: &crate::runtime::Context<Self>,
        ) -> Result<(), HandlerError> {
            replier.reply(());
            Ok(())
        }

        fn on_stop(&mut self) {
            panic!("on_stop panics");
        }
    }

    /// A hook's panic is counted in the endpoint's stats (not only logged), and the endpoint
    /// carries on: it serves after a panicking `on_start`, and its thread ends normally after
    /// a panicking `on_stop`.
    #[test]
    fn hook_panics_are_counted_and_the_endpoint_carries_on() {
        let bus = crate::Bus::builder().build().unwrap();
        let endpoint = bus.register("panicking-hooks", PanickingHooks).unwrap();
        endpoint.ask(Hello).wait_timeout(Duration::from_secs(60)).expect("served after on_start");
        // `on_start` ran before the request was handled, on the thread that answered it.
        assert_eq!((endpoint.stats().hook_panics, endpoint.stats().panicked), (1, 0));
        bus.shutdown().expect("the thread ended normally");
        assert_eq!((endpoint.stats().hook_panics, endpoint.stats().panicked), (2, 0));
    }
}
