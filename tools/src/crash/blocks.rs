//! Target `blocks`: a small streaming driver around the received-block tracker, killed
//! mid-stream.
//!
//! Child: recovers the tracker from `<work>/blocks` (its WAL lives in
//! `receivedBlockMetadata` there), hosts it on the bus, and runs receiver threads (3, on 2
//! streams), each printing `A <receiver> <seq>` once a block's addition is acknowledged
//! (`true` means durable): receiver 0 asks `AddBlock` (the endpoint logs), receivers 1 and 2
//! log their records themselves through a `BlockReceiver`, pipelined (up to 16 additions in
//! flight), receiver 1 one block per record and receiver 2 up to 4 (`add_blocks`), so
//! receiver-side records race the endpoint's allocations under the kill. A batch loop allocates
//! the unallocated blocks to a new batch time every 2 ms and prints the batch it then reads
//! back as processed (`P <time> <id>...`; the reply to the allocation means durable). Each
//! receiver resumes after the last of its blocks the journal holds, and at least at a range of
//! sequence numbers of the run's own (a cleanup can remove all of a receiver's blocks from the
//! journal, and resuming after what is left would add acknowledged ids again). Every 2
//! allocations the loop cleans up batches older than 10 ms (alternately waiting for the WAL
//! files to go or not), printing `c <threshold>` before it asks and `C <threshold>` once that
//! is acknowledged, so cleanup events and segment deletion are crashed too. Block ids encode
//! the receiver and its sequence number; the metadata repeats them, so a block recovered with
//! someone else's metadata is caught.
//!
//! Parent: recovers the tracker itself (the recovery time), reads the journal's durable
//! cleanup events, and checks that every acknowledged block, and every block an earlier check
//! recovered, is present exactly once, either in one allocated batch or still unallocated, or
//! else was in a batch that a durable cleanup removed (`lost`, `duplicated`: a block of a
//! cleaned batch must not come back); a cleanup event excuses only batch times below a
//! threshold a child announced (`c`), else `corrupt_accepted`; that each block is intact (its
//! stream and metadata match its id: `corrupt_accepted`); that every batch processed or
//! recovered so far, in any run, is still allocated with exactly the same blocks, unless
//! durably cleaned (`lost` or `corrupt_accepted`); that no batch below an acknowledged cleanup
//! threshold is back (`lost`); and that processed batch times increase across all runs
//! (`out_of_order`).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context};
use coordbus::{
    clock::{Clock, SystemClock},
    coordinators::block_tracker::{
        AddBlock, AllocateBlocksToBatch, BatchTime, BlockReceiver, BlockStoreResult,
        BlockTrackerConfig, BlockTrackerEndpoint, CleanupOldBatches, GetBlocksOfBatch,
        ReceivedBlockInfo, ReceivedBlockTracker, StreamBlockId, StreamId, TrackerEvent,
        WalBlockLog, RECEIVED_BLOCK_METADATA_DIR,
    },
    wal::{Durability, Lsn, Wal, WalConfig, WalOptions},
    Bus,
};

use crate::{Checker, Counts};

const RECEIVERS: u64 = 3;
const STREAMS: u64 = 2;
/// Block ids: `receiver * ID_STRIDE + seq`.
const ID_STRIDE: u64 = 1 << 40;
/// Sequence numbers a receiver has for one run (far more than a run adds, about 1 500 here):
/// run `i` starts its receivers at `(i mod 2^20) * SEQS_PER_RUN`, below `ID_STRIDE`.
const SEQS_PER_RUN: u64 = 1 << 20;
/// The child's batch interval.
const BATCH_INTERVAL: Duration = Duration::from_millis(2);
/// The child cleans up old batches after every this many allocations.
const CLEANUP_EVERY: u64 = 2;
/// Age (ms of batch time) of the batches a cleanup forgets.
const CLEANUP_AGE_MS: i64 = 10;
/// Longest a reply may take (a hang is a failure, not a wait).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

fn stream_of(receiver: u64) -> StreamId {
    StreamId((receiver % STREAMS) as i32)
}

fn streams() -> Vec<StreamId> {
    (0..STREAMS).map(|stream| StreamId(stream as i32)).collect()
}

fn metadata(receiver: u64, seq: u64) -> Vec<u8> {
    format!("receiver {receiver} block {seq}").into_bytes()
}

fn checkpoint_dir(work: &Path) -> PathBuf {
    work.join("blocks")
}

fn config(work: &Path) -> BlockTrackerConfig {
    let wal = WalConfig {
        // Small segments, preallocated: every restart starts a new one.
        segment_size_bytes: 1 << 20,
        durability: Durability::default(),
        ..BlockTrackerConfig::driver_wal_config()
    };
    BlockTrackerConfig::new(streams())
        .checkpoint_dir(checkpoint_dir(work))
        .recover(true)
        .wal_config(wal)
}

/// Everything a recovered tracker holds: each block id with where it is.
struct Snapshot {
    /// `(block info, batch time or None if unallocated)` for every block found.
    blocks: Vec<(ReceivedBlockInfo, Option<i64>)>,
    /// Allocated batches in time order, with their block ids in order.
    batches: BTreeMap<i64, Vec<u64>>,
}

fn snapshot(tracker: &ReceivedBlockTracker) -> Snapshot {
    let mut blocks = Vec::new();
    for stream in streams() {
        blocks.extend(tracker.unallocated_blocks(stream).into_iter().map(|info| (info, None)));
    }
    let mut batches = BTreeMap::new();
    for time in tracker.allocated_batch_times() {
        let batch = tracker.blocks_of_batch(time);
        let infos: Vec<_> =
            batch.streams().iter().flat_map(|stream| stream.blocks.iter().cloned()).collect();
        batches.insert(time.0, infos.iter().map(|info| info.block_id().unique_id).collect());
        blocks.extend(infos.into_iter().map(|info| (info, Some(time.0))));
    }
    Snapshot { blocks, batches }
}

/// Prints one whole line and flushes it (the parent reads lines as they come).
fn print_line(stdout: &Mutex<std::io::Stdout>, line: &str) -> std::io::Result<()> {
    let mut out = stdout.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    writeln!(out, "{line}")?;
    out.flush()
}

/// The child: a driver that works until killed.
pub fn child(work: &Path, _seed: u64, iteration: u64) -> anyhow::Result<()> {
    let clock = Arc::new(SystemClock);
    let config = config(work);
    let dir = checkpoint_dir(work).join(RECEIVED_BLOCK_METADATA_DIR);
    let options = WalOptions { io: crate::io_mode(iteration), ..WalOptions::default() };
    let wal = Wal::open_with_options(&dir, config.wal.clone(), options).with_context(|| {
        crate::OpenFailed(format!("opening the tracker's log in {}", dir.display()))
    })?;
    let log = WalBlockLog::from_wal(Arc::new(wal)).with_append_timeout(config.write_timeout);
    let tracker = ReceivedBlockTracker::with_log(config, clock.clone(), Some(Arc::new(log)))
        .with_context(|| {
            crate::OpenFailed(format!("recovering the tracker in {}", work.display()))
        })?;
    if let Some(wal) = tracker.log().and_then(|log| log.wal()) {
        crate::print_io_path(wal.io_path())?;
    }
    let recovered = snapshot(&tracker);
    // Each receiver resumes after the last of its blocks the journal holds, and at least at a
    // range of its own for this run: a cleanup can remove all of a receiver's blocks from the
    // journal, and resuming after what is left would add acknowledged ids again.
    let mut resume = vec![(iteration % (1 << 20)) * SEQS_PER_RUN; RECEIVERS as usize];
    for (info, _) in &recovered.blocks {
        let id = info.block_id().unique_id;
        let (receiver, seq) = ((id / ID_STRIDE) as usize, id % ID_STRIDE);
        if let Some(next) = resume.get_mut(receiver) {
            *next = (*next).max(seq + 1);
        }
    }
    let mut next_time = tracker.last_allocated_batch_time().map_or(1, |time| time.0 + 1);
    let bus = Bus::builder().inbox_shards(4).build()?;
    let endpoint = bus.register("ReceivedBlockTracker", BlockTrackerEndpoint::new(tracker))?;
    let stdout = Arc::new(Mutex::new(std::io::stdout()));
    let mut allocations = 0u64;
    let receivers: Vec<_> = (0..RECEIVERS)
        .map(|receiver| {
            let (endpoint, stdout) = (endpoint.clone(), Arc::clone(&stdout));
            let start = resume[receiver as usize];
            std::thread::spawn(move || -> anyhow::Result<()> {
                let stream = stream_of(receiver);
                let make = |seq: u64| {
                    let block_id = StreamBlockId { stream, unique_id: receiver * ID_STRIDE + seq };
                    ReceivedBlockInfo::new(
                        stream,
                        Some((seq % 100) as i64),
                        Some(metadata(receiver, seq)),
                        BlockStoreResult::BlockManager { block_id },
                    )
                };
                if receiver == 0 {
                    for seq in start.. {
                        if !endpoint.ask(AddBlock(make(seq)?)).wait_timeout(REPLY_TIMEOUT)? {
                            bail!(
                                "the tracker refused block {seq} of receiver 0 (its log failed, or \
                                 stayed full for the append timeout)"
                            );
                        }
                        print_line(&stdout, &format!("A {receiver} {seq}"))?;
                    }
                    return Ok(());
                }
                let handle = BlockReceiver::connect(&endpoint)?;
                let mut in_flight = std::collections::VecDeque::new();
                let mut seq = start;
                loop {
                    let count = if receiver == 1 { 1 } else { 1 + seq % 4 };
                    let blocks = (seq..seq + count).map(make).collect::<Result<Vec<_>, _>>()?;
                    let receipt = if count == 1 {
                        handle.add_block(blocks.into_iter().next().context("one block")?)
                    } else {
                        handle.add_blocks(blocks)
                    };
                    in_flight.push_back((seq, count, receipt));
                    seq += count;
                    if in_flight.len() >= 16 {
                        let (first, count, receipt) = in_flight.pop_front().context("in flight")?;
                        if !receipt.wait_timeout(REPLY_TIMEOUT) {
                            bail!(
                                "the tracker refused blocks {first}.. of receiver {receiver} \
                                 (its log failed, or stayed full for the append timeout)"
                            );
                        }
                        for seq in first..first + count {
                            print_line(&stdout, &format!("A {receiver} {seq}"))?;
                        }
                    }
                }
            })
        })
        .collect();
    loop {
        if let Some(finished) = receivers.iter().position(|receiver| receiver.is_finished()) {
            let receiver = receivers.into_iter().nth(finished).context("a receiver")?;
            receiver.join().map_err(|_| anyhow::anyhow!("a receiver panicked"))??;
            bail!("receiver {finished} stopped");
        }
        let time = next_time.max(clock.now_ms());
        endpoint.ask(AllocateBlocksToBatch(BatchTime(time))).wait_timeout(REPLY_TIMEOUT)?;
        let batch = endpoint.ask(GetBlocksOfBatch(BatchTime(time))).wait_timeout(REPLY_TIMEOUT)?;
        if batch.block_count() > 0 {
            let mut line = format!("P {time}");
            for block in batch.streams().iter().flat_map(|stream| &stream.blocks) {
                line.push_str(&format!(" {}", block.block_id().unique_id));
            }
            print_line(&stdout, &line)?;
        }
        next_time = time + 1;
        allocations += 1;
        if allocations.is_multiple_of(CLEANUP_EVERY) {
            // Forget the batches older than CLEANUP_AGE_MS (and delete old WAL segments),
            // as a driver does once batches are done. `c` says a cleanup may happen (its
            // batches may vanish), `C` that it is acknowledged (they must stay gone).
            let threshold = clock.now_ms().min(time) - CLEANUP_AGE_MS;
            print_line(&stdout, &format!("c {threshold}"))?;
            let wait = iteration.is_multiple_of(2);
            let cleanup = CleanupOldBatches { threshold: BatchTime(threshold), wait };
            endpoint.ask(cleanup).wait_timeout(REPLY_TIMEOUT)?;
            print_line(&stdout, &format!("C {threshold}"))?;
        }
        // The batch interval of this little driver (receivers keep adding meanwhile).
        std::thread::sleep(BATCH_INTERVAL);
    }
}

/// The parent's side.
pub struct BlocksChecker {
    work: PathBuf,
    /// Every acknowledged block id.
    acked: HashSet<u64>,
    /// Every block id an earlier check recovered (durable since: the check closed the log).
    recovered: HashSet<u64>,
    /// Every batch seen (processed by a child or recovered by a check): time -> block ids.
    known: BTreeMap<i64, Vec<u64>>,
    /// The last processed batch time.
    last_processed: Option<i64>,
    /// Batch times removed by cleanup events found in the journal (a cleanup event lives at
    /// least until the check after the run that wrote it: the active segment is never
    /// deleted, and every run starts a new one).
    cleaned: HashSet<i64>,
    /// The highest acknowledged cleanup threshold.
    cleanup_acked: Option<i64>,
    /// The highest cleanup threshold a child announced (`c`, before asking): a cleanup event
    /// may name only batch times below it.
    cleanup_announced: Option<i64>,
}

impl BlocksChecker {
    /// A checker for the tracker in `<work>/blocks`.
    pub fn new(work: &Path) -> Self {
        Self {
            work: work.to_path_buf(),
            acked: HashSet::new(),
            recovered: HashSet::new(),
            known: BTreeMap::new(),
            last_processed: None,
            cleaned: HashSet::new(),
            cleanup_acked: None,
            cleanup_announced: None,
        }
    }

    fn journal_dir(&self) -> PathBuf {
        checkpoint_dir(&self.work).join(RECEIVED_BLOCK_METADATA_DIR)
    }

    /// Adds the batch times of the journal's cleanup events to `cleaned`.
    fn read_cleanups(&mut self) -> anyhow::Result<()> {
        let wal = Wal::open_with_options(
            self.journal_dir(),
            config(&self.work).wal,
            WalOptions { read_only: true, ..WalOptions::default() },
        )?;
        for record in wal.iter_from(Lsn::ZERO)? {
            if let TrackerEvent::BatchCleanup(event) = TrackerEvent::decode(&record?.bytes)? {
                self.cleaned.extend(event.times.iter().map(|time| time.0));
            }
        }
        Ok(())
    }
}

impl Checker for BlocksChecker {
    fn is_ack(&self, line: &str) -> bool {
        line.starts_with("A ")
    }

    fn inject_loss(&mut self, lines: &[String]) -> anyhow::Result<()> {
        let last = lines.iter().rev().find_map(|line| {
            let mut words = line.strip_prefix("A ")?.split(' ');
            let receiver: u64 = words.next()?.parse().ok()?;
            let seq: u64 = words.next()?.parse().ok()?;
            Some(receiver * ID_STRIDE + seq)
        });
        let Some(last) = last else { return Ok(()) };
        // Cut the journal at the last acknowledged block's addition record, as if it (and
        // everything after it) never reached the disk.
        let dir = checkpoint_dir(&self.work).join(RECEIVED_BLOCK_METADATA_DIR);
        let cut = crate::cut_log_at_first(&dir, config(&self.work).wal, Lsn::ZERO, |record| {
            Ok(match TrackerEvent::decode(&record.bytes)? {
                TrackerEvent::BlockAddition(event) => event.info.block_id().unique_id == last,
                TrackerEvent::BlockAdditions(event) => {
                    event.infos.iter().any(|info| info.block_id().unique_id == last)
                }
                _ => false,
            })
        })?;
        if !cut {
            bail!("no addition record of block {last} to cut");
        }
        Ok(())
    }

    fn check(
        &mut self,
        iteration: u64,
        lines: &[String],
        counts: &mut Counts,
    ) -> anyhow::Result<Option<Duration>> {
        let mut batches_this_run = 0u64;
        let mut processed_this_run = BTreeMap::new();
        for line in lines {
            let mut words = line.split(' ');
            match words.next() {
                Some("A") => {
                    let parsed: Option<(u64, u64)> =
                        (|| Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?)))();
                    let Some((receiver, seq)) = parsed else { continue };
                    counts.acked += 1;
                    if !self.acked.insert(receiver * ID_STRIDE + seq) {
                        counts.duplicated += 1;
                        counts.note(iteration, format!("block {receiver}/{seq} acked twice"));
                    }
                }
                Some("P") => {
                    let Some(Ok(time)) = words.next().map(str::parse::<i64>) else { continue };
                    let ids: Vec<u64> = words.filter_map(|word| word.parse().ok()).collect();
                    if self.last_processed.is_some_and(|last| last >= time) {
                        counts.out_of_order += 1;
                        counts.note(iteration, format!("batch {time} processed after a later one"));
                    }
                    self.last_processed = Some(time);
                    self.known.insert(time, ids.clone());
                    processed_this_run.insert(time, ids);
                    batches_this_run += 1;
                }
                Some("c") => {
                    let Some(Ok(threshold)) = words.next().map(str::parse::<i64>) else {
                        continue;
                    };
                    self.cleanup_announced = self.cleanup_announced.max(Some(threshold));
                }
                Some("C") => {
                    let Some(Ok(threshold)) = words.next().map(str::parse::<i64>) else {
                        continue;
                    };
                    self.cleanup_acked = self.cleanup_acked.max(Some(threshold));
                    counts.add_extra("cleanups_acked", 1);
                }
                _ => {}
            }
        }
        counts.add_extra("batches_processed", batches_this_run);

        let started = Instant::now();
        let mut tracker =
            match ReceivedBlockTracker::open(config(&self.work), Arc::new(SystemClock)) {
                Ok(tracker) => tracker,
                Err(error) => {
                    counts.open_failures += 1;
                    counts.lost += self.acked.len() as u64;
                    counts.note(iteration, format!("recovering the tracker failed: {error}"));
                    return Ok(None);
                }
            };
        let recovery = started.elapsed();
        let snapshot = snapshot(&tracker);
        tracker.stop().context("closing the recovered tracker")?;
        drop(tracker);
        self.read_cleanups().context("reading the journal's cleanup events")?;
        // The journal's own word excuses only what a cleanup was asked to remove: a tracker that
        // removed (and logged) later batches too must not have their blocks excused.
        let asked_below = self.cleanup_announced.unwrap_or(i64::MIN);
        let overreach: Vec<i64> =
            self.cleaned.iter().copied().filter(|time| *time >= asked_below).collect();
        for time in overreach {
            self.cleaned.remove(&time);
            counts.corrupt_accepted += 1;
            counts.note(
                iteration,
                format!("the journal cleaned batch {time}, not below any cleanup asked for"),
            );
        }
        // Blocks of batches a durable cleanup removed: processed, then rightly forgotten.
        let mut cleaned_blocks: HashMap<u64, i64> = HashMap::new();
        for (time, ids) in &self.known {
            if self.cleaned.contains(time) && !snapshot.batches.contains_key(time) {
                cleaned_blocks.extend(ids.iter().map(|id| (*id, *time)));
            }
        }

        // Each block exactly once, intact.
        let mut places: HashMap<u64, Vec<Option<i64>>> = HashMap::new();
        for (info, place) in &snapshot.blocks {
            let id = info.block_id().unique_id;
            let (receiver, seq) = (id / ID_STRIDE, id % ID_STRIDE);
            let intact = receiver < RECEIVERS
                && info.stream_id() == stream_of(receiver)
                && info.block_id().stream == stream_of(receiver)
                && info.metadata() == Some(metadata(receiver, seq).as_slice())
                && info.num_records() == Some((seq % 100) as i64);
            if !intact {
                counts.corrupt_accepted += 1;
                counts.note(iteration, format!("block {id} recovered damaged: {info:?}"));
            }
            places.entry(id).or_default().push(*place);
        }
        for (id, found) in &places {
            if found.len() > 1 {
                counts.duplicated += found.len() as u64 - 1;
                counts.note(
                    iteration,
                    format!("block {id} recovered {} times: {found:?}", found.len()),
                );
            }
        }
        for (id, time) in &cleaned_blocks {
            if let Some(found) = places.get(id) {
                counts.duplicated += 1;
                counts.note(
                    iteration,
                    format!("block {id} of cleaned batch {time} again: {found:?}"),
                );
            }
        }
        let expected: HashSet<&u64> = self.acked.iter().chain(self.recovered.iter()).collect();
        for id in expected {
            if !places.contains_key(id) && !cleaned_blocks.contains_key(id) {
                counts.lost += 1;
                counts.note(iteration, format!("block {}/{} lost", id / ID_STRIDE, id % ID_STRIDE));
            }
        }
        // Every batch processed or recovered so far, in any run, stays allocated with the same
        // blocks unless durably cleaned (a later recovery that lost an earlier run's batch would
        // let its blocks be allocated and processed again).
        for (time, ids) in &self.known {
            match snapshot.batches.get(time) {
                Some(recovered) if recovered == ids => {}
                Some(recovered) => {
                    counts.corrupt_accepted += 1;
                    counts.note(
                        iteration,
                        format!(
                            "batch {time} processed with {ids:?}, recovered with {recovered:?}"
                        ),
                    );
                }
                None if self.cleaned.contains(time) => {}
                None => {
                    counts.lost += 1;
                    let when = if processed_this_run.contains_key(time) {
                        "processed in this run"
                    } else {
                        "seen in an earlier run"
                    };
                    counts.note(iteration, format!("batch {time} ({when}) lost"));
                }
            }
        }
        // An acknowledged cleanup stays done.
        if let Some(threshold) = self.cleanup_acked {
            if let Some(time) = snapshot.batches.keys().find(|time| **time < threshold) {
                counts.lost += 1;
                counts.note(
                    iteration,
                    format!("batch {time} is back although cleanup below {threshold} was acked"),
                );
            }
        }
        self.known.extend(snapshot.batches.iter().map(|(time, ids)| (*time, ids.clone())));
        counts.set_extra("batches_cleaned", self.cleaned.len() as u64);
        let unallocated = snapshot.blocks.iter().filter(|(_, place)| place.is_none()).count();
        counts.set_extra("blocks", places.len() as u64);
        counts.set_extra("batches", snapshot.batches.len() as u64);
        counts.set_extra("unallocated", unallocated as u64);
        self.recovered = places.into_keys().collect();
        Ok(Some(recovery))
    }
}
