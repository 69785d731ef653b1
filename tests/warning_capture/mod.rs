//! Captures the warnings logged on the current thread, for tests that check them.
//!
//! Why not `tracing::subscriber::with_default`: with a subscriber of its own thread, a callsite
//! that another test's thread reaches first (with no subscriber) can be registered as never
//! interesting, for the whole process (tracing-core's interest cache), and the test's own
//! warning from that callsite is then dropped: a rare, timing-dependent miss. Here one global
//! subscriber, installed before the first capture, has every callsite registered against it
//! (installing it rebuilds the interest of those registered before), and hands each warning to
//! the capture of the thread that logged it, if that thread has one.
//!
//! Used by the integration tests (`mod warning_capture;`) and by the library's own tests
//! (`#[path]`), so it depends on nothing of the crate.

// Each test binary uses part of it.
#![allow(dead_code)]

use std::{
    cell::RefCell,
    sync::{Arc, Mutex, Once},
};

use tracing_subscriber::{filter::LevelFilter, layer::SubscriberExt, Layer};

thread_local! {
    /// Where this thread's warnings go while a capture runs.
    static CAPTURE: RefCell<Option<Arc<Mutex<Vec<String>>>>> = const { RefCell::new(None) };
}

/// Where the warnings of every thread without a capture of its own go while
/// [`WarningLog::around_every_thread`] runs.
static EVERY_THREAD: Mutex<Option<Arc<Mutex<Vec<String>>>>> = Mutex::new(None);

/// The warnings captured on a thread, each as its fields' text (`name=value ` for each field,
/// the message first).
#[derive(Clone, Default)]
pub struct WarningLog(Arc<Mutex<Vec<String>>>);

impl WarningLog {
    /// The warnings captured so far.
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// How many warnings were captured so far.
    pub fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// Runs `body`, capturing the warnings this thread logs meanwhile.
    pub fn around<T>(&self, body: impl FnOnce() -> T) -> T {
        install_once();
        let previous = CAPTURE.with(|capture| capture.replace(Some(Arc::clone(&self.0))));
        // Put back also when `body` panics (a failing assertion inside it).
        struct Restore(Option<Arc<Mutex<Vec<String>>>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                CAPTURE.with(|capture| *capture.borrow_mut() = previous);
            }
        }
        let _restore = Restore(previous);
        body()
    }
}

impl WarningLog {
    /// Runs `body`, capturing the warnings that every thread logs meanwhile (a bus endpoint's
    /// thread too), except threads with a capture of their own. Only for a test binary of one
    /// test: another test's warnings would be captured as well.
    pub fn around_every_thread<T>(&self, body: impl FnOnce() -> T) -> T {
        install_once();
        *EVERY_THREAD.lock().unwrap() = Some(Arc::clone(&self.0));
        // Ended also when `body` panics.
        struct End;
        impl Drop for End {
            fn drop(&mut self) {
                *EVERY_THREAD.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
            }
        }
        let _end = End;
        body()
    }
}

/// Installs the global subscriber (warnings and errors only, so the per-message debug events
/// of the code under test stay as cheap as without a subscriber).
fn install_once() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let subscriber =
            tracing_subscriber::registry().with(ToThreadCapture.with_filter(LevelFilter::WARN));
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other global subscriber in a test binary");
        // A callsite another thread registered while the default was being set may have been
        // asked before the default was visible: ask them all again.
        tracing::callsite::rebuild_interest_cache();
    });
}

/// Hands each warning to the capture of the thread that logged it.
struct ToThreadCapture;

impl<S: tracing::Subscriber> Layer<S> for ToThreadCapture {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() != tracing::Level::WARN {
            return;
        }
        let record = |lines: &Mutex<Vec<String>>| {
            let mut fields = Fields(String::new());
            event.record(&mut fields);
            lines.lock().unwrap().push(fields.0);
        };
        // `try_with`: a warning from a thread's last destructors, after its capture is gone.
        let own = CAPTURE.try_with(|capture| capture.borrow().clone()).ok().flatten();
        if let Some(lines) = own {
            record(&lines);
        } else if let Some(lines) = EVERY_THREAD.lock().unwrap().clone() {
            record(&lines);
        }
    }
}

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}
