//! Request-reply plumbing: the [`Replier`] a handler answers through, and the [`Reply`] handle
//! the asker waits on (blocking, with a timeout, or as a `Future`).
//!
//! Each ask gets a fresh one-shot channel from the `oneshot` crate (lock-free, one allocation,
//! works both blocking and async without a runtime). The asker first spins briefly on the
//! channel, because an endpoint that is busy-polling answers in well under a microsecond and
//! parking would cost several; then it blocks with the timeout.
//!
//! A handler that panics while it owns a `Replier` drops it during unwinding; the drop parks the
//! sender in a thread-local list, and the endpoint thread, once it has caught the panic, fails
//! each parked sender with the panic's message. Nothing of this runs unless a panic happens.

use std::{
    cell::RefCell,
    future::Future,
    pin::Pin,
    task::{Context as TaskContext, Poll},
    time::{Duration, Instant},
};

use crate::error::{AskError, HandlerError};

type ReplySender<T> = oneshot::Sender<Result<T, AskError>>;
type ReplyReceiver<T> = oneshot::Receiver<Result<T, AskError>>;

/// How long a waiting asker spins before it blocks.
const ASKER_SPIN: Duration = Duration::from_micros(30);

/// Fails one orphaned reply with a panic message.
type FailWithPanic = Box<dyn FnOnce(&str)>;

thread_local! {
    /// Senders dropped while their handler was panicking, waiting for the panic message.
    static ORPHANED_BY_PANIC: RefCell<Vec<FailWithPanic>> = const {
        RefCell::new(Vec::new())
    };
}

/// Fails every reply that a panicking handler dropped, with the panic's message.
pub(crate) fn fail_replies_orphaned_by_panic(panic_message: &str) {
    let orphaned = ORPHANED_BY_PANIC.with(|list| std::mem::take(&mut *list.borrow_mut()));
    for fail in orphaned {
        fail(panic_message);
    }
}

/// The answering side of one request: answer exactly once with [`reply`](Replier::reply) or
/// [`fail`](Replier::fail). It may be kept and answered later, from any thread (this is how
/// durable work is acknowledged once the WAL has synced it).
///
/// Dropping it unanswered gives the asker [`AskError::NoReply`]. If the asker already gave up
/// (timed out or dropped its [`Reply`]), answering is harmless and does nothing.
#[must_use = "a request must be answered with reply() or fail()"]
pub struct Replier<T: Send + 'static> {
    sender: Option<ReplySender<T>>,
}

impl<T: Send + 'static> std::fmt::Debug for Replier<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Replier").field("answered", &self.sender.is_none()).finish()
    }
}

impl<T: Send + 'static> Replier<T> {
    /// A connected replier and reply handle, not bound to any endpoint (for driving a state
    /// machine directly, in tests or embeddings without the bus).
    pub fn pair() -> (Replier<T>, Reply<T>) {
        let (sender, receiver) = oneshot::channel();
        (Replier { sender: Some(sender) }, Reply::pending(receiver, Duration::from_secs(120)))
    }

    pub(crate) fn from_sender(sender: ReplySender<T>) -> Self {
        Self { sender: Some(sender) }
    }

    /// Answers with `value`.
    pub fn reply(mut self, value: T) {
        if let Some(sender) = self.sender.take() {
            let _asker_gone = sender.send(Ok(value));
        }
    }

    /// Answers with a failure; the asker sees [`AskError::Handler`] with `error` as its cause.
    pub fn fail(mut self, error: impl Into<HandlerError>) {
        if let Some(sender) = self.sender.take() {
            let _asker_gone = sender.send(Err(AskError::Handler(error.into())));
        }
    }

    /// Whether the asker has stopped waiting (a reply would be discarded).
    pub fn is_abandoned(&self) -> bool {
        self.sender.as_ref().is_none_or(oneshot::Sender::is_closed)
    }
}

impl<T: Send + 'static> Drop for Replier<T> {
    fn drop(&mut self) {
        let Some(sender) = self.sender.take() else {
            return;
        };
        if std::thread::panicking() {
            let fail = move |panic_message: &str| {
                let _asker_gone = sender
                    .send(Err(AskError::HandlerPanicked { message: panic_message.to_owned() }));
            };
            // try_with: during thread teardown the list may be gone; then the asker sees
            // NoReply, which is still an error and never a hang.
            let _ = ORPHANED_BY_PANIC.try_with(|list| list.borrow_mut().push(Box::new(fail)));
        }
    }
}

enum ReplyState<T> {
    Pending(ReplyReceiver<T>),
    Failed(Option<AskError>),
}

/// The asking side of one request: wait for it blocking ([`wait`](Reply::wait),
/// [`wait_timeout`](Reply::wait_timeout)) or `.await` it (no particular async runtime needed).
#[must_use = "a reply does nothing unless waited on or awaited"]
pub struct Reply<T> {
    state: ReplyState<T>,
    /// Timeout of [`Reply::wait`] and of awaiting: the bus's `ask_timeout`.
    default_timeout: Duration,
    /// Deadline for the `Future` implementation, fixed at the first poll.
    poll_deadline: Option<Instant>,
}

impl<T> std::fmt::Debug for Reply<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            ReplyState::Pending(_) => "pending",
            ReplyState::Failed(_) => "failed",
        };
        formatter.debug_struct("Reply").field("state", &state).finish()
    }
}

impl<T> Reply<T> {
    pub(crate) fn pending(receiver: ReplyReceiver<T>, default_timeout: Duration) -> Self {
        Self { state: ReplyState::Pending(receiver), default_timeout, poll_deadline: None }
    }

    pub(crate) fn failed(error: AskError) -> Self {
        Self {
            state: ReplyState::Failed(Some(error)),
            default_timeout: Duration::ZERO,
            poll_deadline: None,
        }
    }

    /// Waits for the reply for at most the bus's `ask_timeout`.
    ///
    /// # Errors
    /// Every [`AskError`]: the endpoint was stopped, the handler failed, panicked or dropped
    /// the request, or the timeout passed.
    pub fn wait(self) -> Result<T, AskError> {
        let timeout = self.default_timeout;
        self.wait_timeout(timeout)
    }

    /// Waits for the reply for at most `timeout`; a reply arriving later is discarded.
    ///
    /// # Errors
    /// As [`Reply::wait`], with [`AskError::Timeout`] naming `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T, AskError> {
        let receiver = match self.state {
            ReplyState::Pending(receiver) => receiver,
            ReplyState::Failed(error) => return Err(error.unwrap_or(AskError::NoReply)),
        };
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            match receiver.try_recv() {
                Ok(outcome) => return outcome,
                Err(oneshot::TryRecvError::Disconnected) => return Err(AskError::NoReply),
                Err(oneshot::TryRecvError::Empty) => {}
            }
            spins += 1;
            if spins % 64 == 0 && start.elapsed() >= ASKER_SPIN.min(timeout) {
                break;
            }
            std::hint::spin_loop();
        }
        match receiver.recv_deadline(start + timeout) {
            Ok(outcome) => outcome,
            Err(oneshot::RecvTimeoutError::Timeout) => Err(AskError::Timeout { timeout }),
            Err(oneshot::RecvTimeoutError::Disconnected) => Err(AskError::NoReply),
        }
    }

    /// The reply if it has arrived, without waiting; `None` while it is still pending.
    pub fn try_take(&mut self) -> Option<Result<T, AskError>> {
        match &mut self.state {
            ReplyState::Failed(error) => Some(Err(error.take().unwrap_or(AskError::NoReply))),
            ReplyState::Pending(receiver) => match receiver.try_recv() {
                Ok(outcome) => Some(outcome),
                Err(oneshot::TryRecvError::Empty) => None,
                Err(oneshot::TryRecvError::Disconnected) => Some(Err(AskError::NoReply)),
            },
        }
    }
}

/// Awaiting a reply honours the bus's `ask_timeout` lazily: the deadline is checked each time
/// the future is polled (an executor without timers may only notice it at the next wake-up).
impl<T> Future for Reply<T> {
    type Output = Result<T, AskError>;

    fn poll(self: Pin<&mut Self>, task: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let deadline =
            *this.poll_deadline.get_or_insert_with(|| Instant::now() + this.default_timeout);
        match &mut this.state {
            ReplyState::Failed(error) => {
                Poll::Ready(Err(error.take().unwrap_or(AskError::NoReply)))
            }
            ReplyState::Pending(receiver) => match Pin::new(receiver).poll(task) {
                Poll::Ready(Ok(outcome)) => Poll::Ready(outcome),
                Poll::Ready(Err(oneshot::RecvError)) => Poll::Ready(Err(AskError::NoReply)),
                Poll::Pending if Instant::now() >= deadline => {
                    Poll::Ready(Err(AskError::Timeout { timeout: this.default_timeout }))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}
