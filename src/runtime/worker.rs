//! The endpoint thread: start hook, drain loop, idle strategy, stop hook.
//!
//! The loop takes up to `drain_batch` messages from each inbox shard in turn and hands each to
//! the endpoint, one at a time, inside `catch_unwind`: a panicking handler fails its asker and
//! is logged, and the next message is handled as usual. When a round finds nothing, the thread
//! follows the configured [`Idle`] strategy: spin (with the CPU's spin hint) for a while after
//! the last message, then yield a few times, then park until a producer rings the doorbell.
//! Once the inbox is closed and drained, `on_stop` runs and the thread ends.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use super::{
    endpoint::{Context, Endpoint, Envelope, Inbox},
    reply::fail_replies_orphaned_by_panic,
};
use crate::config::Idle;

/// Yields after spinning, before parking.
const YIELDS_BEFORE_PARK: u32 = 8;
/// Longest single park; the doorbell makes wake-ups prompt, this only bounds a lost one.
const PARK_MAX: Duration = Duration::from_millis(50);

/// Runs an endpoint until its inbox is closed and drained.
pub(crate) fn run_endpoint<E: Endpoint>(
    mut endpoint: E,
    inbox: Arc<Inbox<E>>,
    idle: Idle,
    drain_batch: usize,
) {
    inbox.queue.bind_consumer();
    inbox.enter_thread();
    let context = Context {
        inbox: Arc::clone(&inbox),
    };
    guarded_hook(&inbox.name, "on_start", || endpoint.on_start(&context));
    tracing::info!(endpoint = %inbox.name, "endpoint started");

    let mut handled_total = 0u64;
    let mut idle_since: Option<Instant> = None;
    let mut yields = 0u32;
    loop {
        let handled = inbox.queue.drain_round(drain_batch, |envelope| {
            dispatch(&mut endpoint, &context, envelope);
        });
        if handled > 0 {
            handled_total += handled as u64;
            inbox
                .counters
                .handled
                .store(handled_total, Ordering::Relaxed);
            idle_since = None;
            yields = 0;
            continue;
        }
        if inbox.queue.is_drained() {
            break;
        }
        if inbox.queue.has_pending() {
            // A producer claimed a slot and is writing it: it is nanoseconds away.
            std::hint::spin_loop();
            continue;
        }
        let spin = match idle {
            Idle::SpinThenPark { spin } => spin,
            Idle::Park => Duration::ZERO,
        };
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < spin {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        } else if yields < YIELDS_BEFORE_PARK {
            yields += 1;
            std::thread::yield_now();
        } else {
            inbox.queue.park_until_work(PARK_MAX);
        }
    }
    guarded_hook(&inbox.name, "on_stop", || endpoint.on_stop());
    tracing::info!(endpoint = %inbox.name, handled = handled_total, "endpoint stopped");
}

/// Hands one envelope to the endpoint; contains a panic.
#[inline]
fn dispatch<E: Endpoint>(endpoint: &mut E, context: &Context<E>, envelope: Envelope<E>) {
    let outcome = catch_unwind(AssertUnwindSafe(|| match envelope {
        Envelope::Message(message) => endpoint.handle(message, context),
        Envelope::Request(request) => endpoint.handle_request(request, context),
    }));
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            context
                .inbox
                .counters
                .failed
                .fetch_add(1, Ordering::Relaxed);
            endpoint.on_error(&error);
        }
        Err(payload) => {
            context
                .inbox
                .counters
                .panicked
                .fetch_add(1, Ordering::Relaxed);
            let message = panic_message(payload.as_ref());
            tracing::error!(endpoint = %context.inbox.name, panic = %message, "handler panicked");
            fail_replies_orphaned_by_panic(&message);
        }
    }
}

/// Runs a start or stop hook, logging a panic instead of ending the thread.
fn guarded_hook(endpoint: &str, hook: &str, run: impl FnOnce()) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(run)) {
        let message = panic_message(payload.as_ref());
        tracing::error!(endpoint, hook, panic = %message, "endpoint hook panicked");
        fail_replies_orphaned_by_panic(&message);
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
