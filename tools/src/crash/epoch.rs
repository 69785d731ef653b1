//! Target `epoch`: epochs committed through the `EpochEndpoint` with the WAL-backed
//! `DurableQuery`, killed mid-stream.
//!
//! Child: opens the epoch log in `<work>/epoch` (recovering the restart point), prints
//! `start S` (the first epoch it will run), hosts an `EpochEndpoint` on the bus with a sink
//! that prints `sink E` for each epoch it commits, and sends whole epochs (3 reader partitions
//! reporting offsets `E * 1000 + p`, plus a jitter in every other run of 8 epochs, so that the
//! log holds deltas of no bytes and deltas of some; 2 writer partitions committing), with an
//! `IncrementAndGetEpoch` ask after each as the epoch thread would. It first re-delivers the
//! whole last committed epoch, as stale tasks do after a restart (it must be dropped). After each
//! ask it prints `durable D` when the last commit record known durable has advanced to `D`.
//! Iterations alternate group commit and `EveryRecord`; the log keeps the last 20 epochs, so
//! `clean` also runs under the kill.
//!
//! Parent: reopens the log (the recovery time) and checks that the recovered last committed
//! epoch `R` is at least every epoch ever printed durable (else `lost`), at most the last epoch
//! the sink committed (else a commit that never happened was accepted: `corrupt_accepted`),
//! that `R`'s offsets are exactly the ones reported, that the child started at the epoch the
//! previous check recovered, and that its sink committed epochs in order without gaps
//! (`out_of_order`). An epoch acknowledged durable that reaches the sink again is `duplicated`;
//! an epoch committed but not yet durable at the kill may be committed again by the next run
//! (SPEC B.5's at-least-once): counted as `recommitted_not_acked`, not as a failure.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context};
use coordbus::{
    coordinators::epoch::{
        coordinator_name, CollaboratorError, CommitPartitionEpoch, DurableQuery, Epoch,
        EpochConfig, EpochEndpoint, IncrementAndGetEpoch, NoopQuery, PartitionId, Payload,
        ReportPartitionOffset, SetReaderPartitions, SetWriterPartitions, Sink,
    },
    wal::{Durability, Lsn, Wal, WalConfig, WalOptions},
    Bus,
};

use crate::{Checker, Counts};

const READERS: i32 = 3;
const WRITERS: i32 = 2;
/// Epochs whose records the log keeps (small, so that segments are cleaned under the kill).
const RETAINED_EPOCHS: usize = 20;
/// Longest a reply may take (a hang is a failure, not a wait).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

fn config(iteration: u64) -> WalConfig {
    let durability =
        if iteration.is_multiple_of(2) { Durability::default() } else { Durability::EveryRecord };
    WalConfig { segment_size_bytes: 64 << 10, durability, ..WalConfig::default() }
}

fn log_dir(work: &Path) -> PathBuf {
    work.join("epoch")
}

/// The offset `partition` reports for `epoch`: steady for 8 epochs (second-order deltas of no
/// bytes), then 8 with a jitter below 500 (of some bytes), and so on; always growing.
fn offset(partition: i32, epoch: i64) -> Payload {
    let jitter =
        if epoch / 8 % 2 == 1 { (epoch * 7919 + i64::from(partition) * 104_729) % 500 } else { 0 };
    Payload::from(epoch * 1000 + i64::from(partition) + jitter)
}

/// The child's sink: prints each epoch it commits.
struct PrintingSink;

impl Sink for PrintingSink {
    fn commit(
        &mut self,
        epoch: Epoch,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError> {
        // The writer messages carry their epoch: a commit with another epoch's messages would
        // be a coordinator bug the parent should see.
        let intact = messages.len() == WRITERS as usize
            && messages.iter().all(|(_, message)| message.as_i64() == Some(epoch.0));
        println!("sink {} {}", epoch.0, if intact { "ok" } else { "bad" });
        Ok(())
    }
}

/// The child: runs epochs until killed.
pub fn child(work: &Path, _seed: u64, iteration: u64) -> anyhow::Result<()> {
    let dir = log_dir(work);
    let options = WalOptions { io: crate::io_mode(iteration), ..WalOptions::default() };
    let wal = Wal::open_with_options(&dir, config(iteration), options).with_context(|| {
        crate::OpenFailed(format!("opening the epoch log in {}", dir.display()))
    })?;
    let durable = DurableQuery::from_wal(wal, NoopQuery)
        .with_context(|| {
            crate::OpenFailed(format!("recovering the epoch log in {}", dir.display()))
        })?
        .with_retained_epochs(RETAINED_EPOCHS);
    crate::print_io_path(durable.wal().io_path())?;
    let status = durable.status();
    let start = durable.start_epoch().0;
    println!("start {start}");
    let bus = Bus::builder().inbox_shards(2).build()?;
    let endpoint = EpochEndpoint::new(EpochConfig::new(start), durable, PrintingSink)?;
    let epoch = bus.register(coordinator_name("crash"), endpoint)?;
    epoch.ask(SetReaderPartitions(READERS)).wait_timeout(REPLY_TIMEOUT)?;
    epoch.ask(SetWriterPartitions(WRITERS)).wait_timeout(REPLY_TIMEOUT)?;
    let mut printed = start - 1;
    // Stale tasks re-deliver the last committed epoch after the restart: the coordinator must
    // drop it (the sink must not see it again).
    let first = if start > 0 { start - 1 } else { start };
    for e in first.. {
        for partition in 0..READERS {
            let offset = offset(partition, e);
            epoch.send(ReportPartitionOffset { partition, epoch: e, offset })?;
        }
        for partition in 0..WRITERS {
            epoch.send(CommitPartitionEpoch { partition, epoch: e, message: e.into() })?;
        }
        // The epoch thread's ask: a barrier for the sends above (per-sender FIFO).
        epoch.ask(IncrementAndGetEpoch).wait_timeout(REPLY_TIMEOUT)?;
        if let Some(error) = status.stop_error() {
            bail!("the coordinator stopped the query: {}", error.stop_text());
        }
        let durable = status.durable_committed().map_or(-1, |epoch| epoch.0);
        if durable > printed {
            println!("durable {durable}");
            printed = durable;
        }
    }
    bail!("epochs are unbounded")
}

/// The parent's side.
pub struct EpochChecker {
    dir: PathBuf,
    /// The start epoch the previous check recovered (the next child must start there).
    expected_start: i64,
    /// The highest epoch any child printed durable.
    acked_max: i64,
    /// The last epoch any child's sink committed.
    sink_last: i64,
    /// The iteration whose durability mode the next check reopens with.
    iteration: u64,
}

impl EpochChecker {
    /// A checker for the log in `<work>/epoch`.
    pub fn new(work: &Path) -> Self {
        Self { dir: log_dir(work), expected_start: 0, acked_max: -1, sink_last: -1, iteration: 0 }
    }
}

/// What a child printed.
#[derive(Debug, Default)]
struct Printed {
    start: Option<i64>,
    sink: Vec<(i64, bool)>,
    durable_max: Option<i64>,
}

fn parse(lines: &[String]) -> Printed {
    let mut printed = Printed::default();
    for line in lines {
        let mut words = line.split(' ');
        let (Some(kind), Some(Ok(value))) = (words.next(), words.next().map(str::parse::<i64>))
        else {
            continue;
        };
        match kind {
            "start" => printed.start = Some(value),
            "sink" => printed.sink.push((value, words.next() == Some("ok"))),
            "durable" => printed.durable_max = printed.durable_max.max(Some(value)),
            _ => {}
        }
    }
    printed
}

impl Checker for EpochChecker {
    fn is_ack(&self, line: &str) -> bool {
        line.starts_with("durable ")
    }

    fn inject_loss(&mut self, lines: &[String]) -> anyhow::Result<()> {
        let Some(last) = parse(lines).durable_max else { return Ok(()) };
        // Records carry their epoch as WAL time: cut the log before the first record of the
        // last acknowledged epoch (its offsets, then its commit), as if they never reached
        // the disk.
        let cut =
            crate::cut_log_at_first(&self.dir, config(self.iteration), Lsn::ZERO, |record| {
                Ok(record.time_ms >= last)
            })?;
        if !cut {
            bail!("no record of epoch {last} to cut");
        }
        Ok(())
    }

    fn check(
        &mut self,
        iteration: u64,
        lines: &[String],
        counts: &mut Counts,
    ) -> anyhow::Result<Option<Duration>> {
        self.iteration = iteration;
        let printed = parse(lines);
        let Some(start) = printed.start else {
            bail!("iteration {iteration}: the child printed no start line")
        };
        if start != self.expected_start {
            counts.out_of_order += 1;
            counts.note(
                iteration,
                format!("the child started at epoch {start}, the log said {}", self.expected_start),
            );
        }
        let durable_max = printed.durable_max.unwrap_or(start - 1);
        counts.acked += (durable_max - (start - 1)).max(0) as u64;
        // The sink: epochs in order from the start, each with its own messages.
        let mut next = start;
        for (epoch, intact) in &printed.sink {
            if *epoch != next {
                counts.out_of_order += 1;
                counts.note(iteration, format!("sink committed epoch {epoch}, expected {next}"));
            }
            if !intact {
                counts.corrupt_accepted += 1;
                counts.note(iteration, format!("sink got wrong writer messages for {epoch}"));
            }
            if *epoch <= self.acked_max {
                counts.duplicated += 1;
                counts.note(iteration, format!("epoch {epoch} was acknowledged, committed again"));
            } else if *epoch <= self.sink_last {
                counts.add_extra("recommitted_not_acked", 1);
            }
            next = epoch + 1;
        }
        counts.add_extra("sink_commits", printed.sink.len() as u64);
        if let Some((last, _)) = printed.sink.last() {
            self.sink_last = *last;
        }
        self.acked_max = self.acked_max.max(durable_max);

        let started = Instant::now();
        let query = match DurableQuery::open(&self.dir, config(iteration)) {
            Ok(query) => query,
            Err(error) => {
                counts.open_failures += 1;
                counts.lost += (self.acked_max + 1) as u64;
                counts.note(iteration, format!("reopening the epoch log failed: {error}"));
                return Ok(None);
            }
        };
        let recovery = started.elapsed();
        let recovered = query.start_epoch().0 - 1;
        if recovered < self.acked_max {
            counts.lost += (self.acked_max - recovered) as u64;
            counts.note(
                iteration,
                format!(
                    "recovered last commit {recovered}, but {} was acknowledged",
                    self.acked_max
                ),
            );
        }
        if recovered > self.sink_last {
            counts.corrupt_accepted += 1;
            counts.note(
                iteration,
                format!("recovered commit {recovered}, the sink only reached {}", self.sink_last),
            );
        }
        if let Some((epoch, offsets)) = query.restart_point() {
            let expected: Vec<_> =
                (0..READERS).map(|p| (PartitionId(p), offset(p, epoch.0))).collect();
            if *offsets != expected {
                counts.corrupt_accepted += 1;
                counts.note(iteration, format!("epoch {epoch} recovered with offsets {offsets:?}"));
            }
        }
        drop(query);
        counts.set_extra("last_committed", recovered.max(0) as u64);
        self.expected_start = recovered + 1;
        Ok(Some(recovery))
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn child_lines_are_parsed_and_noise_ignored() {
        let lines: Vec<String> =
            ["start 4", "sink 4 ok", "durable 4", "sink 5 bad", "durable 3", "junk 1", "sink"]
                .iter()
                .map(ToString::to_string)
                .collect();
        let printed = parse(&lines);
        assert_eq!(printed.start, Some(4));
        assert_eq!(printed.sink, vec![(4, true), (5, false)]);
        assert_eq!(printed.durable_max, Some(4));
    }
}
