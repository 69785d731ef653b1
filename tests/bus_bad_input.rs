//! The bus facing calls that used to hang or panic: a handler sending into its own full inbox,
//! a name the bus cannot give a thread, a shutdown whose endpoints outlive its timeout, a
//! shutdown called from a handler (also by two handlers at once), and an ask that waits for
//! room in a full inbox (bounded by one `ask_timeout` in all).
//!
//! Goal: each gets a typed error or finishes promptly; nothing waits forever. Method: public
//! API only, with a small inbox so it fills at once; every wait of the test is bounded, so a
//! regression fails it instead of hanging CI.

use std::{
    sync::{mpsc, Arc, Condvar, Mutex, OnceLock},
    time::{Duration, Instant},
};

use coordbus::{
    Ask, AskError, Bus, BusError, Context, Endpoint, EndpointRef, HandlerError, Replier, SendError,
};

/// Longer than anything below takes; a wait that reaches it is a hang.
const BOUND: Duration = Duration::from_secs(30);

/// How a handler's sends into its own inbox ended.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct SelfSends {
    accepted: u32,
    refused_full: bool,
    batch_refused_full: Option<usize>,
    iter_refused_full: Option<usize>,
}

/// On `Flood(n)`, sends itself `n` fillers one by one, then `n` more in one batch, then `n`
/// more with `send_iter`.
#[derive(Default)]
struct SelfSender {
    outcome: Arc<Mutex<SelfSends>>,
    fillers: u64,
}

#[derive(Debug)]
enum Note {
    Flood(u32),
    Filler,
}

struct Fillers;
impl Ask<SelfSender> for Fillers {
    type Reply = u64;
    fn into_request(self, replier: Replier<u64>) -> Replier<u64> {
        replier
    }
}

impl Endpoint for SelfSender {
    type Message = Note;
    type Request = Replier<u64>;

    fn handle(&mut self, note: Note, context: &Context<Self>) -> Result<(), HandlerError> {
        match note {
            Note::Filler => self.fillers += 1,
            Note::Flood(count) => {
                let me = context.endpoint_ref();
                let mut outcome = self.outcome.lock().unwrap();
                for _ in 0..count {
                    match me.send(Note::Filler) {
                        Ok(()) => outcome.accepted += 1,
                        Err(SendError::Full { .. }) => {
                            outcome.refused_full = true;
                            break;
                        }
                        Err(other) => panic!("unexpected {other}"),
                    }
                }
                let batch = (0..count).map(|_| Note::Filler).collect();
                if let Err(SendError::Full { message, .. }) = me.send_batch(batch) {
                    outcome.batch_refused_full = Some(message.len());
                }
                let made = (0..count).map(|_| Note::Filler);
                if let Err(SendError::Full { message, .. }) = me.send_iter(made) {
                    outcome.iter_refused_full = Some(message.len());
                }
            }
        }
        Ok(())
    }

    fn handle_request(
        &mut self,
        replier: Replier<u64>,
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        replier.reply(self.fillers);
        Ok(())
    }
}

#[test]
fn a_handler_sending_into_its_own_full_inbox_gets_full_instead_of_waiting_forever() {
    let bus = Bus::builder().inbox_capacity(4).build().unwrap();
    let endpoint = SelfSender::default();
    let outcome = Arc::clone(&endpoint.outcome);
    let sender = bus.register("self-sender", endpoint).unwrap();
    sender.send(Note::Flood(100)).unwrap();
    // Answered only if the handler returned: before, it waited for room that only it could
    // make, and this ask timed out.
    let fillers = sender.ask(Fillers).wait_timeout(BOUND).expect("the endpoint hung");
    let outcome = outcome.lock().unwrap().clone();
    assert!(outcome.refused_full, "{outcome:?}");
    assert!(outcome.accepted >= 1 && outcome.accepted < 100, "{outcome:?}");
    let refused = outcome.batch_refused_full.expect("the batch into a full inbox was accepted");
    assert!(refused > 0 && refused <= 100, "{outcome:?}");
    let iter_refused = outcome.iter_refused_full.expect("send_iter into a full inbox went in");
    assert!(iter_refused > 0 && iter_refused <= 100, "{outcome:?}");
    // Every filler accepted is handled (from the handler's own lane, which the endpoint
    // drains apart from the test's: wait for them, bounded).
    let accepted =
        u64::from(outcome.accepted) + (100 - refused as u64) + (100 - iter_refused as u64);
    let deadline = Instant::now() + BOUND;
    let mut handled = fillers;
    while handled < accepted {
        assert!(Instant::now() < deadline, "{handled} of {accepted} fillers handled");
        std::thread::sleep(Duration::from_millis(1));
        handled = sender.ask(Fillers).wait_timeout(BOUND).expect("the endpoint hung");
    }
    assert_eq!(handled, accepted, "{outcome:?}");
    bus.shutdown().unwrap();
}

#[test]
fn a_name_holding_a_nul_is_refused_and_leaves_nothing_registered() {
    let bus = Bus::builder().build().unwrap();
    match bus.register("a\0b", SelfSender::default()) {
        Err(BusError::InvalidName { name, .. }) => assert_eq!(name, "a\0b"),
        other => panic!("expected InvalidName, got {:?}", other.map(|_| ())),
    }
    assert!(matches!(bus.lookup::<SelfSender>("a\0b"), Err(BusError::NotFound { .. })));
    // An empty name too: an ask's error would name no endpoint.
    match bus.register("", SelfSender::default()) {
        Err(error @ BusError::InvalidName { .. }) => {
            assert!(error.to_string().contains("it is empty"), "{error}")
        }
        other => panic!("expected InvalidName, got {:?}", other.map(|_| ())),
    }
    bus.register("ab", SelfSender::default()).unwrap();
    bus.shutdown().unwrap();
}

/// An endpoint of large messages, kept inline in the inbox's slots.
struct LargeMessages;

impl Endpoint for LargeMessages {
    type Message = [u8; 4096];
    type Request = ();
    fn handle(&mut self, _: [u8; 4096], _: &Context<Self>) -> Result<(), HandlerError> {
        Ok(())
    }
    fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// The slot count of an inbox is validated with the bus, its memory with the message type:
/// the most slots a bus allows, of 4 KiB messages, would be 512 GiB allocated up front (an
/// abort or the OOM killer), so registering such an endpoint is a typed error that names the
/// sizes, and nothing is registered or allocated.
#[test]
fn an_inbox_too_large_for_its_message_type_is_refused_before_allocating() {
    let bus = Bus::builder().inbox_shards(1024).inbox_lanes(0).inbox_capacity(1 << 17).build();
    let bus = bus.expect("2^27 slots in all is within the bus's slot limit");
    match bus.register("large", LargeMessages) {
        Err(BusError::InboxTooLarge { name, slots, slot_bytes, bytes, limit }) => {
            assert_eq!(name, "large");
            assert_eq!(slots, 1 << 27);
            assert!(slot_bytes >= 4096, "{slot_bytes}");
            assert_eq!(bytes, slots * slot_bytes);
            assert!(bytes > limit, "{bytes} against {limit}");
        }
        other => panic!("expected InboxTooLarge, got {:?}", other.map(|_| ())),
    }
    assert!(matches!(bus.lookup::<LargeMessages>("large"), Err(BusError::NotFound { .. })));
    bus.shutdown().unwrap();
}

/// A gate a handler waits at (bounded) until the test opens it.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn pass(&self) {
        let open = self.open.lock().unwrap();
        drop(self.opened.wait_timeout_while(open, BOUND, |open| !*open).unwrap());
    }
}

/// Tells the test it is handling a message, then waits at the gate.
struct Blocker {
    gate: Arc<Gate>,
    entered: mpsc::Sender<()>,
}

/// A request the blocker answers at once.
struct Ping;
impl Ask<Blocker> for Ping {
    type Reply = ();
    fn into_request(self, replier: Replier<()>) -> Replier<()> {
        replier
    }
}

impl Endpoint for Blocker {
    type Message = ();
    type Request = Replier<()>;

    fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
        let _ = self.entered.send(());
        self.gate.pass();
        Ok(())
    }

    fn handle_request(
        &mut self,
        replier: Replier<()>,
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        replier.reply(());
        Ok(())
    }
}

#[test]
fn a_shutdown_whose_endpoint_outlives_the_timeout_names_it_instead_of_reporting_success() {
    let timeout = Duration::from_millis(100);
    let bus = Bus::builder().shutdown_timeout(timeout).build().unwrap();
    let gate = Arc::new(Gate::default());
    let (entered, handling) = mpsc::channel();
    let blocker = bus.register("blocker", Blocker { gate: Arc::clone(&gate), entered }).unwrap();
    blocker.send(()).unwrap();
    handling.recv_timeout(BOUND).expect("the handler never ran");
    match bus.shutdown() {
        Err(BusError::ShutdownTimedOut { endpoints, timeout: reported }) => {
            assert_eq!(endpoints, vec!["blocker".to_owned()]);
            assert_eq!(reported, timeout);
        }
        other => panic!("expected ShutdownTimedOut, got {other:?}"),
    }
    gate.open();
}

/// A bus with `ask_timeout` and endpoint "full" (one shard of 4), its handler held at the
/// returned gate on a first message and its inbox filled behind it with `queued` notes.
fn a_full_inbox(ask_timeout: Duration) -> (Bus, EndpointRef<Blocker>, Arc<Gate>, u64) {
    let bus =
        Bus::builder().inbox_shards(1).inbox_capacity(4).ask_timeout(ask_timeout).build().unwrap();
    let gate = Arc::new(Gate::default());
    let (entered, handling) = mpsc::channel();
    let blocker = bus.register("full", Blocker { gate: Arc::clone(&gate), entered }).unwrap();
    blocker.send(()).unwrap();
    handling.recv_timeout(BOUND).expect("the handler never ran");
    let mut queued = 0;
    while blocker.try_send(()).is_ok() {
        queued += 1;
        assert!(queued < 1 << 20, "the inbox never filled");
    }
    (bus, blocker, gate, queued)
}

/// An ask into an inbox that stays full for `ask_timeout` is never queued: it fails with
/// `Full`, naming the endpoint, and the handler never sees it.
#[test]
fn an_ask_into_an_inbox_full_for_its_timeout_is_full_not_timeout() {
    let ask_timeout = Duration::from_millis(50);
    let (bus, blocker, gate, queued) = a_full_inbox(ask_timeout);
    let started = Instant::now();
    match blocker.ask(Ping).wait_timeout(BOUND) {
        Err(AskError::Full { endpoint, timeout }) => {
            assert_eq!(endpoint, "full");
            assert_eq!(timeout, ask_timeout);
        }
        other => panic!("expected Full, got {other:?}"),
    }
    assert!(started.elapsed() >= ask_timeout, "gave up before ask_timeout");
    gate.open();
    // Every queued note is handled (each passes the open gate), and nothing else: the refused
    // ask left no request behind. A later ask is answered.
    blocker.ask(Ping).wait_timeout(BOUND).expect("the endpoint serves again");
    let stats = blocker.stats();
    assert_eq!(stats.handled, 1 + queued + 1, "{stats:?}");
    bus.shutdown().unwrap();
}

/// Handles each note only once the test hands it a ticket (or the ticket sender is dropped);
/// answers requests at once.
struct Turnstile {
    tickets: mpsc::Receiver<()>,
    entered: mpsc::Sender<()>,
}

/// A request the turnstile answers at once.
struct Knock;
impl Ask<Turnstile> for Knock {
    type Reply = ();
    fn into_request(self, replier: Replier<()>) -> Replier<()> {
        replier
    }
}

impl Endpoint for Turnstile {
    type Message = ();
    type Request = Replier<()>;

    fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
        let _ = self.entered.send(());
        let _ = self.tickets.recv_timeout(BOUND);
        Ok(())
    }

    fn handle_request(
        &mut self,
        replier: Replier<()>,
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        replier.reply(());
        Ok(())
    }
}

/// An ask that waited for room in a full inbox has only the rest of `ask_timeout` for its
/// reply: it times out about `ask_timeout` after it began, not after the time it waited for
/// room plus a whole `ask_timeout` more.
#[test]
fn an_ask_that_waited_for_room_times_out_within_one_ask_timeout_in_all() {
    let ask_timeout = Duration::from_secs(2);
    let bus =
        Bus::builder().inbox_shards(1).inbox_capacity(4).ask_timeout(ask_timeout).build().unwrap();
    let (ticket, tickets) = mpsc::channel();
    let (entered, handling) = mpsc::channel();
    let turnstile = bus.register("turnstile", Turnstile { tickets, entered }).unwrap();
    turnstile.send(()).unwrap();
    handling.recv_timeout(BOUND).expect("the handler never ran");
    let (filled, inbox_filled) = mpsc::channel();
    let asker = {
        let turnstile = turnstile.clone();
        std::thread::spawn(move || {
            // Room is per lane (or the shared ring): the asking thread fills the part of the
            // inbox it pushes into, and only it pushes from now on.
            let mut queued = 0;
            while turnstile.try_send(()).is_ok() {
                queued += 1;
                assert!(queued < 1 << 20, "the inbox never filled");
            }
            let started = Instant::now();
            filled.send(queued).unwrap();
            let outcome = turnstile.ask(Knock).wait();
            (outcome, started.elapsed())
        })
    };
    let queued = inbox_filled.recv_timeout(BOUND).expect("the asker never filled the inbox");
    // Room comes halfway through the ask's wait for it: one note is let through, and the
    // knock is queued behind the others, which wait for tickets that do not come in time.
    std::thread::sleep(ask_timeout / 2);
    // The knock is not in the inbox yet (the notes fill it): its ask is waiting for room.
    let before_room = turnstile.stats();
    assert_eq!(before_room.inbox_depth, queued, "{before_room:?}");
    ticket.send(()).unwrap();
    let (outcome, elapsed) = asker.join().unwrap();
    match outcome {
        Err(AskError::Timeout { timeout, .. }) => assert_eq!(timeout, ask_timeout),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(elapsed >= ask_timeout, "gave up early: {elapsed:?}");
    // A wait for the reply that started afresh once the knock was queued would take 3 s or
    // more in all (1 s for room, then 2 s).
    assert!(
        elapsed < ask_timeout * 3 / 2 - Duration::from_millis(100),
        "waited {elapsed:?} in all"
    );
    // The knock was queued (not refused): it is handled once the notes pass.
    drop(ticket);
    let deadline = Instant::now() + BOUND;
    while turnstile.stats().handled < 1 + queued + 1 {
        assert!(Instant::now() < deadline, "{:?}", turnstile.stats());
        std::thread::yield_now();
    }
    bus.shutdown().unwrap();
}

/// `try_ask` into a full inbox fails at once with `Full` (waited zero), where `ask` would wait
/// up to `ask_timeout` (here far longer than the test's bound), and leaves nothing queued.
#[test]
fn a_try_ask_into_a_full_inbox_is_full_at_once() {
    let (bus, blocker, gate, queued) = a_full_inbox(Duration::from_secs(600));
    let started = Instant::now();
    match blocker.try_ask(Ping).wait_timeout(BOUND) {
        Err(AskError::Full { endpoint, timeout }) => {
            assert_eq!(endpoint, "full");
            assert_eq!(timeout, Duration::ZERO);
        }
        other => panic!("expected Full, got {other:?}"),
    }
    assert!(started.elapsed() < BOUND, "try_ask waited for room");
    gate.open();
    let deadline = Instant::now() + BOUND;
    while blocker.stats().inbox_depth > 0 {
        assert!(Instant::now() < deadline, "the queued notes were not handled");
        std::thread::yield_now();
    }
    blocker.try_ask(Ping).wait_timeout(BOUND).expect("answered once there is room");
    let stats = blocker.stats();
    assert_eq!(stats.handled, 1 + queued + 1, "{stats:?}");
    bus.shutdown().unwrap();
}

#[test]
fn a_shutdown_from_a_handler_does_not_wait_for_its_own_thread() {
    // A long timeout: waiting for its own thread used to run it out every time.
    let bus = Arc::new(Bus::builder().shutdown_timeout(BOUND).build().unwrap());
    let cell = Arc::new(OnceLock::new());
    let (result, results) = mpsc::channel();
    let (entered, _handling) = mpsc::channel();
    // Its gate is open from the start: it shuts the bus down as soon as it has the message.
    let gate = Arc::new(Gate::default());
    gate.open();
    let stopper = bus
        .register("self-stopper", GatedStopper { bus: Arc::clone(&cell), gate, entered, result })
        .unwrap();
    bus.register("bystander", SelfSender::default()).unwrap();
    assert!(cell.set(Arc::clone(&bus)).is_ok());
    stopper.send(()).unwrap();
    let (shut, took) = results.recv_timeout(BOUND * 2).expect("the handler's shutdown hung");
    shut.unwrap();
    assert!(took < Duration::from_secs(5), "shutdown from a handler took {took:?}");
    assert!(matches!(
        bus.register("late", SelfSender::default()),
        Err(BusError::ShutDown { name }) if name == "late"
    ));
}

/// Waits at the gate, then shuts its own bus down and reports how that went.
struct GatedStopper {
    bus: Arc<OnceLock<Arc<Bus>>>,
    gate: Arc<Gate>,
    entered: mpsc::Sender<()>,
    result: mpsc::Sender<(Result<(), BusError>, Duration)>,
}

impl Endpoint for GatedStopper {
    type Message = ();
    type Request = ();

    fn handle(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
        let _ = self.entered.send(());
        self.gate.pass();
        let bus = self.bus.get().expect("set before the message was sent");
        let started = Instant::now();
        let shut = bus.shutdown();
        let _ = self.result.send((shut, started.elapsed()));
        Ok(())
    }

    fn handle_request(&mut self, (): (), _: &Context<Self>) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[test]
fn a_handler_shutting_down_while_the_bus_is_being_shut_down_lets_both_finish_promptly() {
    // A long timeout: a shutdown stuck behind the other would run it out.
    let bus = Arc::new(Bus::builder().shutdown_timeout(BOUND).build().unwrap());
    let cell = Arc::new(OnceLock::new());
    let gate = Arc::new(Gate::default());
    let (entered, handling) = mpsc::channel();
    let (result, results) = mpsc::channel();
    let stopper = bus
        .register(
            "gated-stopper",
            GatedStopper { bus: Arc::clone(&cell), gate: Arc::clone(&gate), entered, result },
        )
        .unwrap();
    assert!(cell.set(Arc::clone(&bus)).is_ok());
    stopper.send(()).unwrap();
    handling.recv_timeout(BOUND).expect("the handler never ran");
    // The test's shutdown stops the endpoint and waits for its thread, which is in its handler.
    let (main_done, main_result) = mpsc::channel();
    {
        let bus = Arc::clone(&bus);
        std::thread::spawn(move || {
            let started = Instant::now();
            let shut = bus.shutdown();
            let _ = main_done.send((shut, started.elapsed()));
        });
    }
    let deadline = Instant::now() + BOUND;
    while bus.lookup::<GatedStopper>("gated-stopper").is_ok() {
        assert!(Instant::now() < deadline, "the test's shutdown never stopped the endpoint");
        std::thread::sleep(Duration::from_millis(1));
    }
    gate.open();
    let (handler_shut, handler_took) = results.recv_timeout(BOUND * 2).expect("handler hung");
    let (main_shut, main_took) = main_result.recv_timeout(BOUND * 2).expect("shutdown hung");
    handler_shut.unwrap();
    main_shut.unwrap();
    assert!(handler_took < Duration::from_secs(5), "the handler's shutdown took {handler_took:?}");
    assert!(main_took < Duration::from_secs(5), "the test's shutdown took {main_took:?}");
}

#[test]
fn two_handlers_shutting_the_bus_down_at_once_both_finish_promptly() {
    // A long timeout: each used to wait for the other's thread, which was waiting for its own,
    // until one ran it out.
    let bus = Arc::new(Bus::builder().shutdown_timeout(BOUND).build().unwrap());
    let cell = Arc::new(OnceLock::new());
    let (result, results) = mpsc::channel();
    let (entered, handling) = mpsc::channel();
    let gates = [Arc::new(Gate::default()), Arc::new(Gate::default())];
    for (name, gate) in ["stopper-a", "stopper-b"].into_iter().zip(&gates) {
        let stopper = GatedStopper {
            bus: Arc::clone(&cell),
            gate: Arc::clone(gate),
            entered: entered.clone(),
            result: result.clone(),
        };
        bus.register(name, stopper).unwrap();
    }
    assert!(cell.set(Arc::clone(&bus)).is_ok());
    for name in ["stopper-a", "stopper-b"] {
        bus.lookup::<GatedStopper>(name).unwrap().send(()).unwrap();
    }
    for _ in 0..2 {
        handling.recv_timeout(BOUND).expect("a handler never ran");
    }
    // The first handler's shutdown stops both endpoints, then (before) took the other's thread
    // to wait for it.
    gates[0].open();
    let deadline = Instant::now() + BOUND;
    while bus.lookup::<GatedStopper>("stopper-b").is_ok() {
        assert!(Instant::now() < deadline, "the first handler's shutdown stopped nothing");
        std::thread::yield_now();
    }
    gates[1].open();
    for _ in 0..2 {
        let (shut, took) = results.recv_timeout(BOUND * 2).expect("a handler's shutdown hung");
        shut.unwrap();
        assert!(took < Duration::from_secs(5), "a handler's shutdown took {took:?}");
    }
    // A shutdown from outside joins both threads.
    let started = Instant::now();
    bus.shutdown().unwrap();
    assert!(started.elapsed() < Duration::from_secs(5), "joining took {:?}", started.elapsed());
}
