//! Driver failure: the block tracker endpoint survives kill -9 with nothing lost or repeated.
//!
//! Goal: every block whose addition was acknowledged is processed exactly once, in a batch,
//! and batches are processed in time order, although the driver is killed at random moments.
//!
//! Method: the test re-executes its own binary (this test only, selected by name, in child mode
//! chosen by an environment variable). The child is a small driver: it recovers the tracker
//! from the WAL, hosts it on the bus, runs receiver threads adding blocks on several streams
//! (printing `A <receiver> <seq>` on stdout once an addition is acknowledged durable) and a
//! batch loop that allocates batches and "processes" them by appending one line per batch to
//! an output file (the sink; a torn last line is cut on restart). On restart the child
//! processes the recovered allocated batches newer than the last processed one first, then
//! continues; each receiver resumes after the last of its blocks the journal holds (its
//! additions are sequential, so the journal holds a prefix of them), after checking that the
//! journal reaches past every block acknowledged in earlier runs (the parent passes those
//! down; a 5 ms group-commit window keeps unwritten records in memory long enough that an
//! acknowledgement sent before its record was written is caught). The parent kills the child
//! with SIGKILL after a random number of acknowledgements (fixed seed), restarts it on the same
//! directory, and after the last run checks the sink against the acknowledgements.

use std::{
    collections::{BTreeSet, HashSet},
    fs::{File, OpenOptions},
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use coordbus::{
    clock::{Clock, SystemClock},
    coordinators::block_tracker::{
        AddBlock, AllocateBlocksToBatch, BatchTime, BlockStoreResult, BlockTrackerConfig,
        BlockTrackerEndpoint, GetBlocksOfBatch, HasUnallocatedBlocks, ReceivedBlockInfo,
        ReceivedBlockTracker, StopTracker, StreamBlockId, StreamId,
    },
    wal::{Durability, WalConfig},
    Bus,
};

const CHILD_ENV: &str = "COORDBUS_BLOCK_TRACKER_CRASH_CHILD";
/// Per receiver, one past its highest acknowledged block so far (comma-separated).
const ACKED_ENV: &str = "COORDBUS_BLOCK_TRACKER_CRASH_ACKED";
const TEST_NAME: &str = "acknowledged_blocks_are_processed_exactly_once_across_kill_9";
const RECEIVERS: u64 = 4;
const STREAMS: u64 = 2;
const BLOCKS_PER_RECEIVER: u64 = 1500;
const KILLS: usize = 24;
const SEED: u64 = 0x6b69_6c6c_2d39;
/// Bound on one child run without progress (a hang is a failure, not a wait).
const RUN_TIMEOUT: Duration = Duration::from_secs(30);

fn stream_of(receiver: u64) -> StreamId {
    StreamId((receiver % STREAMS) as i32)
}

fn unique_id(receiver: u64, seq: u64) -> u64 {
    receiver * 1_000_000 + seq
}

fn wal_config() -> WalConfig {
    WalConfig {
        // Small segments: every restart starts a new one, and they are preallocated.
        segment_size_bytes: 1 << 20,
        // A long group-commit window keeps appended records in memory (not yet written) for a
        // while, so an acknowledgement sent before its record was written would be caught by
        // a kill (a killed process keeps what reached the page cache).
        durability: Durability::GroupCommit {
            max_delay: Duration::from_millis(5),
            max_bytes: 1 << 20,
        },
        ..BlockTrackerConfig::driver_wal_config()
    }
}

struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// One processed batch read from the sink.
#[derive(Debug)]
struct Processed {
    time: i64,
    blocks: Vec<u64>,
}

/// Reads the sink's complete lines (`B <time> <id>... E`) and the byte length they cover.
fn read_sink(path: &Path) -> (Vec<Processed>, u64) {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        file.read_to_string(&mut text).unwrap();
    }
    let mut batches = Vec::new();
    let mut covered = 0u64;
    for line in text.split_inclusive('\n') {
        let Some(body) = line.strip_suffix(" E\n") else { break };
        let mut words = body.split(' ');
        assert_eq!(words.next(), Some("B"), "sink line {line:?}");
        let time = words.next().unwrap().parse().unwrap();
        let blocks = words.map(|word| word.parse().unwrap()).collect();
        batches.push(Processed { time, blocks });
        covered += line.len() as u64;
    }
    (batches, covered)
}

// ----- child: a driver ---------------------------------------------------------------------

fn child_main(dir: PathBuf) {
    let sink_path = dir.join("processed.log");
    let (processed, covered) = read_sink(&sink_path);
    // Cut a torn last line: that batch was not processed.
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&sink_path)
        .unwrap()
        .set_len(covered)
        .unwrap();
    let last_processed = processed.last().map(|batch| batch.time);

    let streams: Vec<StreamId> = (0..STREAMS).map(|stream| StreamId(stream as i32)).collect();
    let config = BlockTrackerConfig::new(streams.clone())
        .checkpoint_dir(&dir)
        .recover(true)
        .wal_config(wal_config());
    let clock = Arc::new(SystemClock);
    let tracker = ReceivedBlockTracker::open(config, clock.clone()).unwrap();

    // Each receiver resumes after the last of its blocks the journal holds.
    let mut resume = vec![0u64; RECEIVERS as usize];
    let mut note = |info: &ReceivedBlockInfo| {
        let id = info.block_id().unique_id;
        let (receiver, seq) = (id / 1_000_000, id % 1_000_000);
        resume[receiver as usize] = resume[receiver as usize].max(seq + 1);
    };
    for stream in &streams {
        tracker.unallocated_blocks(*stream).iter().for_each(&mut note);
    }
    let recovered_batches = tracker.allocated_batch_times();
    for time in &recovered_batches {
        tracker.blocks_of_batch(*time).streams().iter().flat_map(|s| &s.blocks).for_each(&mut note);
    }
    // Every block acknowledged in an earlier run must be in the journal: a receiver's blocks
    // are added one after the other, so the journal holds a prefix of them, and it must reach
    // past the highest acknowledged one.
    let acknowledged: Vec<u64> =
        std::env::var(ACKED_ENV).unwrap().split(',').map(|count| count.parse().unwrap()).collect();
    for (receiver, (&acked, &journaled)) in acknowledged.iter().zip(&resume).enumerate() {
        if journaled < acked {
            eprintln!(
                "LOST: receiver {receiver} had blocks up to {acked} acknowledged, the journal \
                 holds {journaled}"
            );
            std::process::exit(3);
        }
    }
    let mut next_time = tracker.last_allocated_batch_time().map_or(1, |time| time.0 + 1);

    let bus = Bus::builder().inbox_shards(4).build().unwrap();
    let endpoint =
        bus.register("ReceivedBlockTracker", BlockTrackerEndpoint::new(tracker)).unwrap();
    let stdout = Arc::new(Mutex::new(std::io::stdout()));
    let receivers_done = Arc::new(AtomicUsize::new(0));

    let mut threads = Vec::new();
    for receiver in 0..RECEIVERS {
        let (endpoint, stdout, done) = (endpoint.clone(), stdout.clone(), receivers_done.clone());
        let start = resume[receiver as usize];
        threads.push(std::thread::spawn(move || {
            for seq in start..BLOCKS_PER_RECEIVER {
                let block_id = StreamBlockId {
                    stream: stream_of(receiver),
                    unique_id: unique_id(receiver, seq),
                };
                let info = ReceivedBlockInfo::new(
                    stream_of(receiver),
                    Some(1),
                    None,
                    BlockStoreResult::BlockManager { block_id },
                )
                .unwrap();
                assert!(endpoint.ask(AddBlock(info)).wait().unwrap(), "addition not logged");
                let mut out = stdout.lock().unwrap();
                writeln!(out, "A {receiver} {seq}").unwrap();
                out.flush().unwrap();
            }
            done.fetch_add(1, Ordering::SeqCst);
        }));
    }

    let mut sink = OpenOptions::new().append(true).open(&sink_path).unwrap();
    let process = |time: i64, sink: &mut File| {
        let batch = endpoint.ask(GetBlocksOfBatch(BatchTime(time))).wait().unwrap();
        if batch.block_count() == 0 {
            return;
        }
        let mut line = format!("B {time}");
        for block in batch.streams().iter().flat_map(|stream| &stream.blocks) {
            line.push_str(&format!(" {}", block.block_id().unique_id));
        }
        line.push_str(" E\n");
        sink.write_all(line.as_bytes()).unwrap();
    };
    // Batches the journal shows allocated but the sink does not show processed.
    for time in recovered_batches {
        if last_processed.is_none_or(|last| time.0 > last) {
            process(time.0, &mut sink);
        }
    }
    loop {
        let receivers_finished = receivers_done.load(Ordering::SeqCst) == RECEIVERS as usize;
        if receivers_finished && !endpoint.ask(HasUnallocatedBlocks).wait().unwrap() {
            break;
        }
        let time = next_time.max(clock.now_ms());
        endpoint.ask(AllocateBlocksToBatch(BatchTime(time))).wait().unwrap();
        process(time, &mut sink);
        next_time = time + 1;
        // The batch interval of this little driver.
        std::thread::sleep(Duration::from_millis(2));
    }
    for thread in threads {
        thread.join().unwrap();
    }
    endpoint.ask(StopTracker).wait().unwrap();
    bus.shutdown().unwrap();
    let mut out = stdout.lock().unwrap();
    writeln!(out, "DONE").unwrap();
    out.flush().unwrap();
}

// ----- parent: kills and checks ------------------------------------------------------------

/// Per receiver, one past its highest acknowledged block (0 if none). A block logged but killed
/// before its acknowledgement leaves a gap: the next run resumes after it.
fn acked_counts(acknowledged: &HashSet<(u64, u64)>) -> String {
    (0..RECEIVERS)
        .map(|receiver| {
            let frontier = acknowledged
                .iter()
                .filter(|(r, _)| *r == receiver)
                .map(|(_, seq)| seq + 1)
                .max()
                .unwrap_or(0);
            frontier.to_string()
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn acknowledged_blocks_are_processed_exactly_once_across_kill_9() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        child_main(PathBuf::from(dir));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SplitMix(SEED);
    let mut acknowledged: HashSet<(u64, u64)> = HashSet::new();
    let mut kills = 0;
    let mut runs = 0;
    loop {
        runs += 1;
        assert!(runs <= KILLS + 5, "the driver did not finish after {runs} runs");
        let stderr_path = dir.path().join(format!("child-{runs}.stderr"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .env(ACKED_ENV, acked_counts(&acknowledged))
            .stdout(Stdio::piped())
            .stderr(File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap();
        let kill_after = (kills < KILLS).then(|| match rng.next() % 8 {
            0 => 0,
            _ => 1 + rng.next() % 120,
        });
        if kill_after == Some(0) {
            child.kill().unwrap();
            kills += 1;
        }
        let (lines, receiver) = crossbeam_channel::unbounded::<String>();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let mut acks_this_run = 0;
        let mut done = false;
        let mut killed = kill_after == Some(0);
        loop {
            match receiver.recv_timeout(RUN_TIMEOUT) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("A ") {
                        let mut words = rest.split(' ');
                        let receiver_id: u64 = words.next().unwrap().parse().unwrap();
                        let seq: u64 = words.next().unwrap().parse().unwrap();
                        acknowledged.insert((receiver_id, seq));
                        acks_this_run += 1;
                        if !killed && kill_after.is_some_and(|after| acks_this_run >= after) {
                            child.kill().unwrap();
                            kills += 1;
                            killed = true;
                        }
                    } else if line == "DONE" {
                        done = true;
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    panic!(
                        "driver run {runs} made no progress for {RUN_TIMEOUT:?}; stderr: {}",
                        std::fs::read_to_string(&stderr_path).unwrap_or_default()
                    );
                }
            }
        }
        reader.join().unwrap();
        let status = child.wait().unwrap();
        assert_ne!(
            status.code(),
            Some(3),
            "run {runs}: {}",
            std::fs::read_to_string(&stderr_path).unwrap_or_default()
        );
        if !killed {
            assert!(
                status.success() && done,
                "driver run {runs} failed ({status}); stderr: {}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
            break;
        }
    }
    assert!(kills >= 20, "only {kills} kills");

    let (batches, _) = read_sink(&dir.path().join("processed.log"));
    let mut seen = BTreeSet::new();
    let mut previous = i64::MIN;
    for batch in &batches {
        assert!(batch.time > previous, "batch {} processed after batch {previous}", batch.time);
        previous = batch.time;
        for id in &batch.blocks {
            assert!(seen.insert(*id), "block {id} processed twice (again in batch {})", batch.time);
        }
    }
    for (receiver, seq) in &acknowledged {
        assert!(
            seen.contains(&unique_id(*receiver, *seq)),
            "acknowledged block {receiver}/{seq} never processed"
        );
    }
    // Nothing is lost either: the last run added every remaining block.
    let all: BTreeSet<u64> = (0..RECEIVERS)
        .flat_map(|receiver| (0..BLOCKS_PER_RECEIVER).map(move |seq| unique_id(receiver, seq)))
        .collect();
    assert_eq!(seen, all);
    eprintln!(
        "{runs} runs, {kills} kills, {} acknowledged, {} batches",
        acknowledged.len(),
        batches.len()
    );
}
