//! Goal: with the WAL-backed `DurableQuery`, a query restarted from its epoch log continues
//! where it stopped (SPEC B.10): every epoch reaches the sink exactly once and in order across
//! clean restarts, commits re-delivered for already committed epochs are ignored, the inner
//! engine query still sees every call, and after `kill -9` every commit reported durable is
//! recovered (an epoch whose commit record was not yet durable may reach the sink again: the
//! spec's at-least-once).
//!
//! Method: each run opens the log in a temp dir, starts a coordinator on the bus at the
//! recovered start epoch, sends whole epochs plus a partial one (sizes from a fixed-seed
//! generator), in some runs also the next epoch whole (complete, waiting behind the partial
//! one, its offsets logged but never committed), then stops cleanly (stop writes, shut the bus
//! down: the query and its WAL are dropped and closed). The sink's calls, recorded across runs,
//! must be `0..=last` once each. The crash variant re-executes this test binary as a child (env
//! var) that prints the epochs its sink commits and those whose commit record is durable; the
//! parent kills it at random points, a dozen times, and checks the printed history against the next
//! run's start. The parent reads the child's output on a thread and gives each child 60 s to reach
//! its kill point (then kills it and fails with what it printed); a child runs at most 100 000
//! epochs and fails if it gets there without being killed.

mod epoch_support;

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc::{self, RecvTimeoutError},
    time::{Duration, Instant},
};

use coordbus::{
    coordinators::epoch::{
        coordinator_name, CollaboratorError, CommitPartitionEpoch, DurableQuery, Epoch,
        EpochConfig, EpochEndpoint, GetEpochStats, IncrementAndGetEpoch, PartitionId, Payload,
        ReportPartitionOffset, SetReaderPartitions, SetWriterPartitions, Sink,
        StopContinuousExecutionWrites,
    },
    wal::{Durability, Wal, WalConfig},
    Bus, EndpointRef,
};
use epoch_support::{calls, recorders, Call, RecordingQuery, RecordingSink, REPLY_TIMEOUT};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

const READERS: i32 = 3;
const WRITERS: i32 = 2;

fn wal_config(durability: Durability) -> WalConfig {
    WalConfig { segment_size_bytes: 256 << 10, durability, ..WalConfig::default() }
}

fn offset(partition: i32, epoch: i64) -> Payload {
    Payload::from(epoch * 1000 + i64::from(partition))
}

fn send_epoch<E: coordbus::Endpoint<Message = coordbus::coordinators::epoch::EpochMessage>>(
    endpoint: &EndpointRef<E>,
    epoch: i64,
) {
    for partition in 0..READERS {
        let offset = offset(partition, epoch);
        endpoint.send(ReportPartitionOffset { partition, epoch, offset }).unwrap();
    }
    for partition in 0..WRITERS {
        endpoint.send(CommitPartitionEpoch { partition, epoch, message: epoch.into() }).unwrap();
    }
}

type Durable = EpochEndpoint<DurableQuery<RecordingQuery>, RecordingSink>;

/// Opens the log, checks the restart point against what the sink saw, starts a coordinator.
fn start_run(
    bus: &Bus,
    dir: &Path,
    query: RecordingQuery,
    sink: RecordingSink,
) -> (EndpointRef<Durable>, i64) {
    let wal = Wal::open(dir, wal_config(Durability::default())).unwrap();
    let durable = DurableQuery::from_wal(wal, query).unwrap().with_retained_epochs(5);
    let start = durable.start_epoch().0;
    match durable.restart_point() {
        None => assert_eq!(start, 0, "no restart point, yet a start after epoch 0"),
        Some((last, offsets)) => {
            assert_eq!(last.0, start - 1);
            let expected: Vec<_> =
                (0..READERS).map(|p| (PartitionId(p), offset(p, last.0))).collect();
            assert_eq!(offsets, &expected, "the restart offsets are the last committed epoch's");
        }
    }
    let endpoint = EpochEndpoint::new(EpochConfig::new(start), durable, sink).unwrap();
    let epoch = bus.register(coordinator_name("restart"), endpoint).unwrap();
    epoch.ask(SetReaderPartitions(READERS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    epoch.ask(SetWriterPartitions(WRITERS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    (epoch, start)
}

/// Stops a run the way the query does (stop writes, deregister), then shuts the bus down, which
/// joins the endpoint thread: the query and its WAL are dropped, so the log is closed.
fn stop_run(bus: Bus, epoch: EndpointRef<Durable>) {
    epoch.ask(StopContinuousExecutionWrites).wait_timeout(REPLY_TIMEOUT).unwrap();
    epoch.stop();
    bus.shutdown().unwrap();
}

fn sink_epochs(log: &epoch_support::CallLog) -> Vec<i64> {
    calls(log)
        .iter()
        .filter_map(|call| match call {
            Call::SinkCommit(epoch, _) => Some(*epoch),
            _ => None,
        })
        .collect()
}

#[test]
fn clean_restarts_at_random_points_commit_every_epoch_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (query, sink, log) = recorders();
    // Seeded: the stop points are fixed.
    let mut rng = XorShiftRng::seed_from_u64(0x5eed_0001);
    let mut next = 0i64;
    let mut runs_with_a_waiting_epoch = 0;
    for run in 0..8 {
        let bus = Bus::builder().inbox_shards(2).build().unwrap();
        let (epoch, start) = start_run(&bus, dir.path(), query.clone(), sink.clone());
        assert_eq!(start, next, "run {run} starts after the last committed epoch");
        let whole: i64 = rng.random_range(0..12);
        for e in start..start + whole {
            send_epoch(&epoch, e);
        }
        // A partial epoch: some reports and commits, never all of both.
        let partial = start + whole;
        for partition in 0..rng.random_range(0..READERS) {
            let offset = offset(partition, partial);
            epoch.send(ReportPartitionOffset { partition, epoch: partial, offset }).unwrap();
        }
        epoch
            .send(CommitPartitionEpoch { partition: 0, epoch: partial, message: 0.into() })
            .unwrap();
        // In some runs, the epoch after the partial one complete: its offsets are logged, but
        // it waits behind the gap and is never committed; the restart ignores them (B.10).
        let waiting = rng.random_range(0..2) == 1;
        if waiting {
            send_epoch(&epoch, partial + 1);
            runs_with_a_waiting_epoch += 1;
        }
        let stats = epoch.ask(GetEpochStats).wait_timeout(REPLY_TIMEOUT).unwrap();
        assert_eq!(stats.last_committed, Epoch(partial - 1));
        assert_eq!(stats.failed_epoch, None);
        assert_eq!(stats.waiting_epochs, usize::from(waiting), "run {run}");
        stop_run(bus, epoch);
        next = partial;
    }
    assert!(runs_with_a_waiting_epoch > 0, "the seed left no run with a waiting epoch");
    let expected: Vec<i64> = (0..next).collect();
    assert_eq!(sink_epochs(&log), expected, "each epoch reaches the sink once, in order");
    // The inner engine query got the same commits, after the sink each time.
    let commits: Vec<i64> = calls(&log)
        .iter()
        .filter_map(|call| match call {
            Call::QueryCommit(epoch) => Some(*epoch),
            _ => None,
        })
        .collect();
    assert_eq!(commits, expected);
}

#[test]
fn commits_re_delivered_for_committed_epochs_after_a_restart_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let (query, sink, log) = recorders();
    let bus = Bus::builder().inbox_shards(2).build().unwrap();
    let (epoch, _) = start_run(&bus, dir.path(), query.clone(), sink.clone());
    for e in 0..5 {
        send_epoch(&epoch, e);
    }
    stop_run(bus, epoch);

    let bus = Bus::builder().inbox_shards(2).build().unwrap();
    let (epoch, start) = start_run(&bus, dir.path(), query, sink);
    assert_eq!(start, 5);
    // Stale tasks re-deliver whole committed epochs (reports and commits) after the restart.
    send_epoch(&epoch, 4);
    send_epoch(&epoch, 3);
    send_epoch(&epoch, 5);
    let stats = epoch.ask(GetEpochStats).wait_timeout(REPLY_TIMEOUT).unwrap();
    assert_eq!(stats.counters.dropped_stale_epoch, 2 * (READERS + WRITERS) as u64);
    assert_eq!(stats.last_committed, Epoch(5));
    stop_run(bus, epoch);
    assert_eq!(sink_epochs(&log), vec![0, 1, 2, 3, 4, 5]);

    // The query itself also ignores a commit of an already committed epoch.
    let (query, _, _) = recorders();
    let wal = Wal::open(dir.path(), wal_config(Durability::EveryRecord)).unwrap();
    let mut durable = DurableQuery::from_wal(wal, query).unwrap();
    use coordbus::coordinators::epoch::Query as _;
    durable.commit(Epoch(5)).unwrap();
    durable.commit(Epoch(2)).unwrap();
    assert_eq!(durable.status().ignored_commits(), 2);
    assert!(calls(&durable.inner().log).is_empty(), "nothing reaches the inner query");
    assert_eq!(durable.restart_point().map(|(epoch, _)| *epoch), Some(Epoch(5)));
}

// ---- kill -9 -----------------------------------------------------------------------------

const CHILD_DIR: &str = "COORDBUS_EPOCH_RESTART_CHILD_DIR";
/// Prefix of the child's report lines.
const MARK: &str = "@epoch-child";
/// How long one child may take, from its start, to reach its kill point and end once killed.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);
/// Epochs one child runs at most: far more than the at most 20 durable advances the parent
/// waits for take (group commit makes an epoch durable within a few epochs). A child that gets
/// there prints `limit` and exits with an error.
const CHILD_MAX_EPOCHS: i64 = 100_000;

/// The child process, killed and reaped when dropped: a failing assertion in the parent does
/// not leave it running.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The last lines a child printed, for a failure message.
fn last_lines(lines: &[String]) -> String {
    let from = lines.len().saturating_sub(50);
    let last = lines[from..].join("\n");
    format!("{} lines, the last {}:\n{last}", lines.len(), lines.len() - from)
}

/// The child's sink: prints each epoch it commits.
struct PrintingSink;

impl Sink for PrintingSink {
    fn commit(
        &mut self,
        epoch: Epoch,
        _: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError> {
        println!("{MARK} sink {epoch}");
        Ok(())
    }
}

/// Child mode: runs epochs until killed (every seventh step with the next epoch complete
/// first, waiting behind the current one), printing `start E`, `sink E` and `durable E` lines;
/// prints `limit N` and exits with an error after `CHILD_MAX_EPOCHS` epochs.
fn child(dir: &Path) -> ! {
    let durable =
        DurableQuery::open(dir, wal_config(Durability::default())).unwrap().with_retained_epochs(3);
    let status = durable.status();
    let start = durable.start_epoch().0;
    println!("{MARK} start {start}");
    let bus = Bus::builder().inbox_shards(2).build().unwrap();
    let endpoint = EpochEndpoint::new(EpochConfig::new(start), durable, PrintingSink).unwrap();
    let epoch = bus.register(coordinator_name("crash"), endpoint).unwrap();
    epoch.ask(SetReaderPartitions(READERS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    epoch.ask(SetWriterPartitions(WRITERS)).wait_timeout(REPLY_TIMEOUT).unwrap();
    let mut printed = start - 1;
    let mut next = start;
    while next < start + CHILD_MAX_EPOCHS {
        // Every seventh step sends the next epoch first: it completes, waits behind this one
        // (its offsets logged, not committed), and a kill may land right then.
        let epochs = if (next - start) % 7 == 3 { vec![next + 1, next] } else { vec![next] };
        for &e in &epochs {
            send_epoch(&epoch, e);
            // The epoch thread's ask: a barrier for the sends above.
            epoch.ask(IncrementAndGetEpoch).wait_timeout(REPLY_TIMEOUT).unwrap();
        }
        next += epochs.len() as i64;
        let durable = status.durable_committed().map_or(-1, |epoch| epoch.0);
        if durable > printed {
            println!("{MARK} durable {durable}");
            printed = durable;
        }
    }
    // Never reached while the parent works: it kills the child long before.
    println!("{MARK} limit {CHILD_MAX_EPOCHS}");
    let _ = std::io::Write::flush(&mut std::io::stdout());
    std::process::exit(3)
}

#[test]
fn after_kill_9_every_durable_commit_is_recovered_and_epochs_stay_in_order() {
    if let Some(dir) = std::env::var_os(CHILD_DIR) {
        child(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut rng = XorShiftRng::seed_from_u64(0x5eed_0009);
    let mut previous_durable = -1i64; // the highest epoch any child reported durable
    let mut previous_sink = -1i64; // the last epoch the previous child's sink committed
    let mut sink_total = 0usize;
    for round in 0..12 {
        let wanted: i64 = rng.random_range(1..=20);
        let spawned = Command::new(std::env::current_exe().unwrap())
            .args([
                "after_kill_9_every_durable_commit_is_recovered_and_epochs_stay_in_order",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut child = KillOnDrop(spawned);
        // The child's output is read on a thread, so that the parent's wait for it is bounded.
        let stdout = BufReader::new(child.0.stdout.take().unwrap());
        let (line_sender, lines) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in stdout.lines() {
                let failed = line.is_err();
                if line_sender.send(line).is_err() || failed {
                    break;
                }
            }
        });
        let deadline = Instant::now() + CHILD_DEADLINE;
        let mut output: Vec<String> = Vec::new();
        let mut start = None;
        let mut last_sink = None;
        let mut durable_seen = 0;
        let mut killed = false;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let line = match lines.recv_timeout(remaining) {
                Ok(line) => line.unwrap_or_else(|error| {
                    panic!("round {round}: reading the child's output: {error}")
                }),
                // The child's output ended: it was killed (or ended by itself).
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    let _ = child.0.kill();
                    panic!(
                        "round {round}: the child did not reach its kill point ({wanted} durable \
                         reports, {durable_seen} seen, killed: {killed}) and end within \
                         {CHILD_DEADLINE:?}; it printed {}",
                        last_lines(&output)
                    );
                }
            };
            output.push(line.clone());
            // libtest may print its own text before the child's first line.
            let Some(at) = line.find(MARK) else { continue };
            let mut words = line[at + MARK.len()..].split_whitespace();
            let (Some(kind), Some(value)) = (words.next(), words.next()) else { continue };
            let Ok(value) = value.parse::<i64>() else { continue };
            match kind {
                "start" => {
                    // Every commit reported durable was recovered; nothing past the sink.
                    assert!(value > previous_durable, "round {round}: start {value}");
                    assert!(value <= previous_sink + 1, "round {round}: start {value} skips");
                    start = Some(value);
                }
                "sink" => {
                    let expected = last_sink.map_or(start.expect("start first"), |last| last + 1);
                    assert_eq!(value, expected, "round {round}: sink commits in order");
                    last_sink = Some(value);
                    sink_total += 1;
                }
                "durable" => {
                    assert!(value <= last_sink.unwrap_or(-1), "durable only after the sink");
                    previous_durable = previous_durable.max(value);
                    durable_seen += 1;
                    if durable_seen == wanted && !killed {
                        child.0.kill().unwrap(); // SIGKILL
                        killed = true;
                    }
                }
                "limit" => panic!(
                    "round {round}: the child ran {value} epochs without being killed; it printed \
                     {}",
                    last_lines(&output)
                ),
                _ => {}
            }
        }
        assert!(
            killed,
            "round {round}: the child ended by itself; it printed {}",
            last_lines(&output)
        );
        child.0.wait().unwrap();
        reader.join().unwrap();
        previous_sink = last_sink.unwrap_or(previous_sink);
        eprintln!(
            "round {round}: start {start:?}, last sink {last_sink:?}, durable {previous_durable}"
        );
    }
    // The log still opens and holds at least every durable commit.
    let query = DurableQuery::open(dir.path(), wal_config(Durability::default())).unwrap();
    assert!(query.start_epoch().0 > previous_durable);
    assert!(sink_total > 12, "the children made progress");
}
