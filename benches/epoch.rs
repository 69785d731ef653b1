//! Per-message cost of the epoch coordinator's state machine, against the reference model (a
//! Spark-like implementation that rescans its maps on every message) on the same stream.
//!
//! Group `epoch/per_message/<P>`: a stream of `E` complete epochs at `P` reader and `P` writer
//! partitions (one `ReportPartitionOffset` and one `CommitPartitionEpoch` per partition per
//! epoch), applied to a fresh coordinator whose query and sink only count. Within an epoch the
//! partitions come in a scattered order (a stride coprime with `P`), each partition's report
//! just before its commit. That is not the order producers send in (each its own contiguous
//! range of partitions, the producers' batches interleaving in blocks of a batch's messages,
//! as `coordbus-load epoch --baseline reference` replays them): it is a harder one for the
//! state machine's locality, kept because PERF.md's figures were measured with it. Throughput
//! is in messages. No bus: this is the state machine alone; `coordbus-load epoch` measures the
//! endpoint. Contenders: `coordbus` (one `apply` call a message), `coordbus_run` (the
//! endpoint's path: the whole stream as one run, `apply_run`) and `reference`.
//!
//! Only the messages' handling is timed (`iter_custom`): each iteration makes its coordinator
//! and copies the stream into a buffer before its clock starts, and drops the coordinator
//! after the clock stops. The stream is about 100 000 messages (4.8 MB, which the last-level
//! cache holds, as it holds an inbox's slots), so the first epoch of a fresh coordinator,
//! which grows its tables, is a small part of the timed work (1 epoch of 5 at 10 000
//! partitions, the least). Before anything is timed, each contender applies the whole stream
//! once and must commit every epoch with no message rejected and the query never stopped;
//! every timed iteration checks the same after its clock stops, so no figure can time less
//! work than it claims.
//!
//! The reference model's cost per message grows with the partitions (it rescans one or two
//! epochs' entries per message: each commit drops the entries of the epochs before the one
//! just committed), so it runs on the stream's first epochs only, enough for about 10 to 300
//! ms an iteration (all of them at 1 partition, 50 at 100, 10 at 1000; its throughput counts
//! its own messages) with criterion's flat sampling, and not at all at 10 000 partitions,
//! where one epoch takes it seconds and ten samples would take minutes: `coordbus-load epoch
//! --partitions 10000 --baseline reference` measures it there, within a time budget.
//!
//! Group `epoch/durable_query/<P>`: the coordinator thread's cost of the WAL-backed query per
//! epoch: `add_offsets` of `P` 8-byte offsets then `commit`, on a WAL in a temporary directory,
//! with offsets taken from 64 precomputed epochs so that building them is not measured (the
//! cycle starts over at a keyframe, every 64 epochs), two ways: `add_offsets+commit` with
//! offsets that advance as `coordbus-load epoch`'s steady ones do, `epoch << 20 | partition`
//! (second-order delta records of no bytes an offset), and `add_offsets+commit_varied` with
//! offsets that advance by a rate of each partition's own, plus a jitter of up to an eighth of
//! it (as `--offsets varied`; 3 bytes an offset). Both
//! with page-cache durability (`Durability::None`): the sync thread's writes run beside it. With
//! group commit a tight loop would measure the disk instead: the appends outrun the syncs and
//! wait for staging space. Baseline in the same group (`plain_file_append`): the same bytes
//! (partition id + 8-byte offset per partition, then a commit marker) appended to one plain file
//! with two `write` calls per epoch (the page cache too), the least a log without framing,
//! checksums or recovery could do.
//!
//! Group `epoch/repeat_report/<P>`: a retried stage's reports of an epoch whose offsets are
//! complete already (SPEC B.4: each one replaces its offset and, the epoch's offsets being
//! complete, hands the query all of them again with `add_offsets`), one message at a time, `P` of
//! them (every partition once more). `coordbus_near`: the epoch is the next to commit (a dense
//! side); `coordbus_far`: it is 20 epochs ahead, beyond the dense window (a sparse side, as also
//! for counts over the limit or 1 Mi, or offsets stored while a count was unset); both with the
//! default backlog limits (10 000). `reference`: the reference model on the far stream (its layout
//! does not depend on the epoch), which counts the epoch's entries by a scan of all stored entries
//! per report; at 10 000 partitions on the first 1 000 repeats only. Only the repeats are timed;
//! each iteration checks that every one reached the query.
//!
//! Timing settings: a warm-up of 1 s and 3 s of measurement per function (PERF.md's method),
//! so that the whole file runs in about two minutes; `--warm-up-time` and
//! `--measurement-time` on the command line still override them.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use std::{
    hint::black_box,
    io::{Seek, Write},
    time::{Duration, Instant},
};

use coordbus::{
    coordinators::epoch::{
        reference::ReferenceEpochCoordinator, CollaboratorError, CommitPartitionEpoch,
        DurableQuery, Epoch, EpochConfig, EpochCoordinator, EpochError, EpochMessage, Offsets,
        PartitionId, Payload, Query, ReportPartitionOffset, Sink,
    },
    wal::{Durability, WalConfig},
};
use criterion::{
    criterion_group, criterion_main, measurement::WallTime, BenchmarkGroup, BenchmarkId, Criterion,
    SamplingMode, Throughput,
};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Counts calls; keeps nothing.
#[derive(Default)]
struct Counting {
    commits: u64,
    offsets: u64,
    stops: u64,
}

impl Query for Counting {
    fn add_offsets(&mut self, _: Epoch, offsets: Offsets<'_>) -> Result<(), CollaboratorError> {
        self.offsets += offsets.len() as u64;
        Ok(())
    }
    fn commit(&mut self, _: Epoch) -> Result<(), CollaboratorError> {
        self.commits += 1;
        Ok(())
    }
    fn stop(&mut self, _: EpochError) {
        self.stops += 1;
    }
}

impl Sink for Counting {
    fn commit(
        &mut self,
        _: Epoch,
        messages: &[(PartitionId, Payload)],
    ) -> Result<(), CollaboratorError> {
        black_box(messages);
        Ok(())
    }
}

/// `epochs` complete epochs at `partitions` partitions, partitions scattered.
fn stream(partitions: i32, epochs: i64) -> Vec<EpochMessage> {
    let mut messages = Vec::with_capacity(2 * partitions as usize * epochs as usize);
    // A stride coprime with the partition count visits every partition once, out of order.
    let stride =
        (1..).map(|k| 7919 * k).find(|s: &i64| gcd(*s, i64::from(partitions)) == 1).unwrap_or(1);
    for epoch in 1..=epochs {
        for index in 0..i64::from(partitions) {
            let partition = ((index * stride) % i64::from(partitions)) as i32;
            messages.push(
                ReportPartitionOffset {
                    partition,
                    epoch,
                    offset: (epoch * 1_000 + i64::from(partition)).into(),
                }
                .into(),
            );
            messages.push(
                CommitPartitionEpoch { partition, epoch, message: i64::from(partition).into() }
                    .into(),
            );
        }
    }
    messages
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn config() -> EpochConfig {
    EpochConfig::new(1).with_backlog_limit(1 << 24)
}

/// A coordinator with `config` and both partition counts set to `partitions`.
fn coordinator_of(config: EpochConfig, partitions: i32) -> EpochCoordinator<Counting, Counting> {
    let mut coordinator = EpochCoordinator::new(config, Counting::default(), Counting::default())
        .expect("valid config");
    coordinator.set_reader_partitions(partitions).expect("count");
    coordinator.set_writer_partitions(partitions).expect("count");
    coordinator
}

/// The `per_message` cases: partitions, epochs of the stream (about 100 000 messages each), and
/// how many of them the reference model runs (module doc; 0: it does not run).
const PER_MESSAGE_CASES: [(i32, i64, i64); 4] =
    [(1, 50_000, 50_000), (100, 500, 50), (1_000, 50, 10), (10_000, 5, 0)];

/// A contender of `per_message` and `repeat_report`: a fresh coordinator with `config` at
/// `partitions`, the messages it takes, and what its query counted once they are applied.
trait Contender: Sized {
    fn with_config(config: EpochConfig, partitions: i32) -> Self;
    /// A fresh coordinator with the bench's config ([`config`]).
    fn fresh(partitions: i32) -> Self {
        Self::with_config(config(), partitions)
    }
    /// Applies `messages` (timed by the caller); counts rejected messages.
    fn apply_all(&mut self, messages: &mut Vec<EpochMessage>, rejected: &mut u64);
    fn query(&self) -> &Counting;
    fn commits_and_stops(&self) -> (u64, u64) {
        (self.query().commits, self.query().stops)
    }
}

/// `coordbus`: one `apply` call a message.
struct OneByOne(EpochCoordinator<Counting, Counting>);
/// `coordbus_run`: the stream as one run, as the endpoint applies what it drains.
struct AsRun(EpochCoordinator<Counting, Counting>);
/// `reference`: the reference model, one `apply` call a message.
struct Reference(ReferenceEpochCoordinator<Counting, Counting>);

impl Contender for OneByOne {
    fn with_config(config: EpochConfig, partitions: i32) -> Self {
        Self(coordinator_of(config, partitions))
    }
    #[inline(always)]
    fn apply_all(&mut self, messages: &mut Vec<EpochMessage>, rejected: &mut u64) {
        for message in messages.drain(..) {
            *rejected += u64::from(self.0.apply(message).is_err());
        }
    }
    fn query(&self) -> &Counting {
        self.0.query()
    }
}

impl Contender for AsRun {
    fn with_config(config: EpochConfig, partitions: i32) -> Self {
        Self(coordinator_of(config, partitions))
    }
    #[inline(always)]
    fn apply_all(&mut self, messages: &mut Vec<EpochMessage>, rejected: &mut u64) {
        self.0.apply_run(&mut messages.drain(..), |_| *rejected += 1);
    }
    fn query(&self) -> &Counting {
        self.0.query()
    }
}

impl Contender for Reference {
    fn with_config(config: EpochConfig, partitions: i32) -> Self {
        let mut coordinator =
            ReferenceEpochCoordinator::new(config, Counting::default(), Counting::default())
                .expect("valid config");
        coordinator.set_reader_partitions(partitions).expect("count");
        coordinator.set_writer_partitions(partitions).expect("count");
        Self(coordinator)
    }
    #[inline(always)]
    fn apply_all(&mut self, messages: &mut Vec<EpochMessage>, rejected: &mut u64) {
        for message in messages.drain(..) {
            *rejected += u64::from(self.0.apply(message).is_err());
        }
    }
    fn query(&self) -> &Counting {
        self.0.query()
    }
}

/// Applies `messages` (`epochs` complete epochs) to a fresh `C` and returns the time the
/// application took, reusing `buffer` for the copy of the stream; panics, naming `name`, unless
/// every epoch committed with no message rejected and no stop of the query.
fn apply_checked<C: Contender>(
    name: &str,
    partitions: i32,
    epochs: i64,
    messages: &[EpochMessage],
    buffer: &mut Vec<EpochMessage>,
) -> Duration {
    let mut coordinator = C::fresh(partitions);
    buffer.clear();
    buffer.extend_from_slice(messages);
    let mut rejected = 0;
    let started = Instant::now();
    coordinator.apply_all(black_box(buffer), &mut rejected);
    let elapsed = started.elapsed();
    let (commits, stops) = coordinator.commits_and_stops();
    assert!(
        commits == epochs as u64 && rejected == 0 && stops == 0,
        "{name} at {partitions} partitions: {commits} of {epochs} epochs committed, {rejected} \
         messages rejected, {stops} stops: the figure would time other work than it claims"
    );
    // Dropped here, after the clock stopped.
    drop(coordinator);
    elapsed
}

/// Times contender `C` on `messages` as `name` in `group` (after one checked application).
fn bench_contender<C: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    partitions: i32,
    epochs: i64,
    messages: &[EpochMessage],
) {
    let mut buffer = Vec::with_capacity(messages.len());
    // Sanity, before anything is timed.
    apply_checked::<C>(name, partitions, epochs, messages, &mut buffer);
    group.throughput(Throughput::Elements(messages.len() as u64));
    group.bench_function(BenchmarkId::new(name, partitions), |bencher| {
        bencher.iter_custom(|iterations| {
            (0..iterations)
                .map(|_| apply_checked::<C>(name, partitions, epochs, messages, &mut buffer))
                .sum()
        });
    });
}

fn per_message(criterion: &mut Criterion) {
    for (partitions, epochs, reference_epochs) in PER_MESSAGE_CASES {
        let messages = stream(partitions, epochs);
        let mut group = criterion.benchmark_group(format!("epoch/per_message/{partitions}"));
        group.sample_size(10);
        bench_contender::<OneByOne>(&mut group, "coordbus", partitions, epochs, &messages);
        bench_contender::<AsRun>(&mut group, "coordbus_run", partitions, epochs, &messages);
        if reference_epochs > 0 {
            // Its stream's first epochs (module doc), in as few iterations as a sample allows.
            let prefix = &messages[..2 * partitions as usize * reference_epochs as usize];
            group.sampling_mode(SamplingMode::Flat);
            bench_contender::<Reference>(
                &mut group,
                "reference",
                partitions,
                reference_epochs,
                prefix,
            );
        }
        group.finish();
    }
}

fn durable_query(criterion: &mut Criterion) {
    for partitions in [1, 100, 1_000] {
        let mut group = criterion.benchmark_group(format!("epoch/durable_query/{partitions}"));
        group.throughput(Throughput::Elements(1));
        group.sample_size(10);
        let dir = tempfile::tempdir().expect("temporary directory");
        let durability = Durability::None;
        let mut query =
            DurableQuery::open(dir.path(), WalConfig { durability, ..WalConfig::default() })
                .expect("open the epoch log");
        let steady = cycle_of(partitions, |p, epoch| epoch << 20 | i64::from(p));
        let varied = varied_cycle(partitions);
        let offsets = &steady[0];
        let mut epoch = 0;
        for (name, cycle) in
            [("add_offsets+commit", &steady), ("add_offsets+commit_varied", &varied)]
        {
            // Read for the word layout once, outside the timing, as the coordinator's dense
            // sides hand it on without a read.
            let views: Vec<Offsets> = cycle.iter().map(|offsets| Offsets::new(offsets)).collect();
            // Each function starts at a keyframe: the first epoch of a cycle.
            epoch = (epoch as u64).next_multiple_of(64) as i64;
            group.bench_function(BenchmarkId::new(name, partitions), |bencher| {
                bencher.iter(|| {
                    let offsets = views[(epoch % 64) as usize];
                    query.add_offsets(Epoch(epoch), offsets).expect("append offsets");
                    query.commit(Epoch(epoch)).expect("append commit");
                    epoch += 1;
                });
            });
        }
        let mut plain = std::fs::File::create(dir.path().join("plain.log")).expect("plain file");
        let mut plain_epoch = 0i64;
        let mut record = Vec::with_capacity(offsets.len() * 12 + 8);
        group.bench_function(BenchmarkId::new("plain_file_append", partitions), |bencher| {
            bencher.iter(|| {
                // Bounded as our log is (it keeps the last 100 epochs): started over every 100
                // epochs, so the file neither grows through the run nor fills the page cache.
                if plain_epoch % PLAIN_FILE_EPOCHS == 0 {
                    plain.set_len(0).expect("truncate the plain file");
                    plain.rewind().expect("rewind the plain file");
                }
                record.clear();
                for (partition, _) in offsets {
                    record.extend_from_slice(&partition.0.to_le_bytes());
                    record.extend_from_slice(&plain_epoch.to_le_bytes());
                }
                plain.write_all(&record).expect("append offsets");
                plain.write_all(&plain_epoch.to_le_bytes()).expect("append commit");
                plain_epoch += 1;
            });
        });
        group.finish();
    }
}

/// 64 epochs of `partitions` offsets, `offset(partition, epoch)` each.
fn cycle_of(partitions: i32, offset: impl Fn(i32, i64) -> i64) -> Vec<Vec<(PartitionId, Payload)>> {
    (0..64i64)
        .map(|epoch| (0..partitions).map(|p| (PartitionId(p), offset(p, epoch).into())).collect())
        .collect()
}

/// 64 epochs of offsets that advance by a rate of each partition's own (2^10 to 2^20 + 2^10
/// an epoch) plus a jitter below an eighth of it, both from a fixed seed.
fn varied_cycle(partitions: i32) -> Vec<Vec<(PartitionId, Payload)>> {
    let mut rng = XorShiftRng::seed_from_u64(0x2545_F491_4F6C_DD1D);
    let rates: Vec<i64> =
        (0..partitions).map(|_| rng.random_range(1 << 10..(1 << 20) + (1 << 10))).collect();
    let jitters: Vec<i64> = (0..64 * partitions)
        .map(|index| rng.random_range(0..rates[(index % partitions) as usize] / 8))
        .collect();
    cycle_of(partitions, |p, epoch| {
        epoch * rates[p as usize] + jitters[(epoch * i64::from(partitions) + i64::from(p)) as usize]
    })
}

/// Epochs the plain-file baseline appends before it starts its file over (our log keeps about
/// as many: `DEFAULT_RETAINED_EPOCHS`).
const PLAIN_FILE_EPOCHS: i64 = 100;

/// The far epoch of `repeat_report`: 20 epochs after the last committed one (0), beyond the
/// dense window of 16 epochs that the default limits give from 625 partitions up.
const FAR_EPOCH: i64 = 20;

/// A report of every partition of `epoch`, each with offset `round << 32 | partition`.
fn reports(partitions: i32, epoch: i64, round: i64) -> Vec<EpochMessage> {
    (0..partitions)
        .map(|partition| {
            let offset = (round << 32 | i64::from(partition)).into();
            ReportPartitionOffset { partition, epoch, offset }.into()
        })
        .collect()
}

/// A fresh `C` with the default limits given `first` (an epoch's complete offsets), then
/// `repeats`, of which only the repeats are timed; panics, naming `name`, unless every message
/// was taken and each repeat handed the query the epoch's `partitions` offsets again.
fn time_repeats<C: Contender>(
    name: &str,
    partitions: i32,
    first: &[EpochMessage],
    repeats: &[EpochMessage],
) -> Duration {
    let mut coordinator = C::with_config(EpochConfig::new(1), partitions);
    let mut rejected = 0;
    coordinator.apply_all(&mut first.to_vec(), &mut rejected);
    let mut buffer = repeats.to_vec();
    let started = Instant::now();
    coordinator.apply_all(black_box(&mut buffer), &mut rejected);
    let elapsed = started.elapsed();
    let (offsets, stops) = (coordinator.query().offsets, coordinator.query().stops);
    let expected = (1 + repeats.len() as u64) * partitions as u64;
    assert!(
        rejected == 0 && offsets == expected && stops == 0,
        "{name} at {partitions} partitions: {rejected} messages rejected, {offsets} of \
         {expected} offsets handed on, {stops} stops: the figure would time other work than it \
         claims"
    );
    elapsed
}

/// Times contender `C` as `name` in `group` on `repeat_count` repeated reports of every
/// partition of `epoch` (after one checked application).
fn bench_repeats<C: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    partitions: i32,
    epoch: i64,
    repeat_count: usize,
) {
    let first = reports(partitions, epoch, 0);
    let repeats = &reports(partitions, epoch, 1)[..repeat_count];
    // Sanity, before anything is timed.
    time_repeats::<C>(name, partitions, &first, repeats);
    group.throughput(Throughput::Elements(repeats.len() as u64));
    group.bench_function(BenchmarkId::new(name, partitions), |bencher| {
        bencher.iter_custom(|iterations| {
            (0..iterations).map(|_| time_repeats::<C>(name, partitions, &first, repeats)).sum()
        });
    });
}

fn repeat_report(criterion: &mut Criterion) {
    for (partitions, reference_repeats) in [(1_000, 1_000), (10_000, 1_000)] {
        let mut group = criterion.benchmark_group(format!("epoch/repeat_report/{partitions}"));
        group.sample_size(10);
        let all = partitions as usize;
        bench_repeats::<OneByOne>(&mut group, "coordbus_near", partitions, 1, all);
        bench_repeats::<OneByOne>(&mut group, "coordbus_far", partitions, FAR_EPOCH, all);
        group.sampling_mode(SamplingMode::Flat);
        bench_repeats::<Reference>(
            &mut group,
            "reference",
            partitions,
            FAR_EPOCH,
            reference_repeats,
        );
        group.finish();
    }
}

criterion_group! {
    name = benches;
    // Module doc, "Timing settings".
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = per_message, durable_query, repeat_report
}
criterion_main!(benches);
