//! `coordbus-crash`: kill -9 loops against the WAL, the epoch coordinator and the block tracker.
//!
//! Each iteration re-executes this binary as a child (the hidden `child` subcommand) on the
//! same directory. The child recovers whatever the previous runs left, works, and prints one
//! line per item as soon as it is acknowledged (durable). The parent reads those lines, waits
//! for the first acknowledgement, lets the child run for a random time (seeded, at most
//! `--max-run-ms`), kills it with SIGKILL, then reopens the directory itself, measuring the
//! recovery time, and checks that every acknowledged item is present, intact and not
//! duplicated. A killed process keeps what reached the page cache: the check proves, end to
//! end on real files and processes, that each item was written before it was acknowledged and
//! that recovery finds it, not that it was synced (a power loss). That half is
//! `tests/wal_power_loss.rs`, `epoch_power_loss.rs` and `block_tracker_power_loss.rs`, which
//! open images holding only the synced bytes (on both write paths; see their limits). A kill
//! inside a write (a torn record) is rare; the `wal` target's parent tears the unacknowledged
//! tail itself in every third iteration (`tails_torn`; `torn_tails_cut` counts what recovery
//! cut). What these loops rarely reach: a kill during recovery itself (the window opens at the
//! first acknowledgement), and, with short runs, cleaning and segment reuse (`--max-run-ms
//! 200` reaches them).
//!
//! Parts: `main.rs` (CLI, the kill loop, counting and the summary), one module per target
//! (`wal`, `epoch`, `blocks`) with its child workload and its checker; the tools library's
//! `rng` (a seeded xorshift) makes runs repeatable.
//!
//! Counts: `acked` (items the children acknowledged), `lost` (acknowledged but missing after
//! recovery), `duplicated` (present more than once), `corrupt_accepted` (recovered but not
//! intact, or different from what was acknowledged), `out_of_order` (order rules broken) and
//! `open_failures` (the directory could not be reopened, by the parent's check or by a child:
//! a child whose open fails exits with code 3). Any of the last five non-zero fails
//! the run (exit code 1); a tool error (the child cannot start, a bad flag) exits with 2.
//! `iterations_io_uring` and `iterations_pwrite` count the children whose log wrote through
//! each I/O path (each child prints its path first).
//!
//! On failure the run stops at the failing iteration and keeps the directory as the parent's
//! check left it (the check only cuts torn tails, which hold nothing acknowledged) and prints
//! where it is.

mod blocks;
mod epoch;
mod wal;

use std::{
    fs::File,
    io::{BufRead, BufReader, Read, Seek, SeekFrom},
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand, ValueEnum};
use coordbus_tools::{
    rng::Rng,
    scratch::{ChildGuard, ScratchDir},
};
use serde_json::json;

use coordbus::wal::{IoMode, IoPath};

/// `println!` for the run's summary that ignores a closed stdout (`| head`) instead of
/// panicking: the exit code is the run's answer, and output nobody reads does not change it.
macro_rules! summary {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Longest the parent waits for a child's first acknowledgement (a hang is a failure).
const FIRST_ACK_TIMEOUT: Duration = Duration::from_secs(30);
/// SIGKILL's number (9 on Linux and every other Unix; POSIX fixes it for `kill -9`).
const SIGKILL: i32 = 9;
/// The prefix of a child's line naming its log's I/O path ([`print_io_path`]).
const IO_PATH_LINE: &str = "io_path ";
/// How often a long run prints a progress line on stderr.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);
/// A child's exit code when it could not open or recover the directory ([`OpenFailed`]): the
/// parent counts it in `open_failures`. Any other error of a child is the tool's (exit 2).
const CHILD_OPEN_FAILED: u8 = 3;
/// Failure notes printed at most (the counts hold the rest).
const NOTES_MAX: usize = 20;
/// Largest `--max-run-ms`: one minute. The parent keeps every line a child prints until its
/// check (hundreds of thousands a minute), and the checkers keep what was acknowledged over
/// the whole run: longer windows would grow memory without finding more.
const MAX_RUN_MS: u64 = 60_000;

/// Kill -9 loops: every restart recovers from the same directory, and nothing acknowledged may
/// be lost, duplicated or corrupted.
///
/// Exit code 0: no loss; 1: loss, duplication, corruption or disorder detected (the directory
/// is kept and its path printed); 2: the tool itself failed (bad flag, child cannot start);
/// 130: interrupted (SIGINT, SIGTERM or SIGHUP; the work directory is removed unless --keep).
#[derive(Debug, Parser)]
#[command(name = "coordbus-crash", version, subcommand_negates_reqs = true)]
struct Cli {
    /// What to crash: `wal` (self-checking records with EveryRecord and GroupCommit, on the
    /// io_uring and pwrite paths), `epoch` (epochs committed through the EpochEndpoint with
    /// the WAL-backed DurableQuery), `blocks` (receivers adding blocks to the block tracker
    /// endpoint and a batch loop allocating and processing batches). `epoch` and `blocks`
    /// children alternate their log's I/O path every two iterations (the default, io_uring
    /// where the kernel allows it, then pwrite).
    #[arg(long, value_enum, required = true)]
    target: Option<Target>,
    /// Number of kill -9 iterations (child runs), at least 1.
    #[arg(long, default_value_t = 50, value_parser = parse_iterations)]
    iterations: u64,
    /// Parent directory for the work directory (default: the system temp directory); it must
    /// exist. A fresh `coordbus-crash-*` directory is created inside it and removed at the end
    /// unless `--keep` is given or a failure was found.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the work directory at the end (its path is printed). Default: remove it when the
    /// run passes.
    #[arg(long)]
    keep: bool,
    /// Seed of the random kill times and of the children's workloads; the same seed gives the
    /// same schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object (target, iterations, acked, lost, duplicated, corrupt_accepted,
    /// recovery_p50_ms, recovery_max_ms, ...) instead of the human summary.
    #[arg(long)]
    json: bool,
    /// Longest a child runs after its first acknowledgement before the kill, in milliseconds
    /// (0 ..= 60000, a minute); each kill comes at a uniformly random moment in 0..=M ms.
    #[arg(
        long,
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(0..=MAX_RUN_MS)
    )]
    max_run_ms: u64,
    /// Testing aid: before each check, cut the log so that the last acknowledged item is lost
    /// (every target), to prove the checker notices. Makes the run fail.
    #[arg(long, hide = true)]
    inject_loss: bool,
    #[command(subcommand)]
    child: Option<ChildCommand>,
}

#[derive(Debug, Subcommand)]
enum ChildCommand {
    /// Internal: one child run (recover, work, print acknowledgements until killed).
    #[command(hide = true)]
    Child(ChildArgs),
}

/// Arguments of a child run.
#[derive(Debug, clap::Args)]
struct ChildArgs {
    /// The target to work on.
    #[arg(long, value_enum)]
    target: Target,
    /// The work directory.
    #[arg(long)]
    dir: PathBuf,
    /// The run's seed.
    #[arg(long)]
    seed: u64,
    /// The iteration number (chooses modes that alternate).
    #[arg(long)]
    iteration: u64,
}

/// What to crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Target {
    /// The write-ahead log alone.
    Wal,
    /// The epoch coordinator with its durable query.
    Epoch,
    /// The received-block tracker.
    Blocks,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Self::Wal => "wal",
            Self::Epoch => "epoch",
            Self::Blocks => "blocks",
        }
    }
}

/// What the checks found, summed over iterations.
#[derive(Debug, Default)]
pub struct Counts {
    /// Items acknowledged by the children.
    pub acked: u64,
    /// Acknowledged items missing after recovery.
    pub lost: u64,
    /// Items present more than once.
    pub duplicated: u64,
    /// Items recovered but not intact, or not what was acknowledged.
    pub corrupt_accepted: u64,
    /// Order rules broken (LSN gaps, epochs or batches out of order, garbage after the tail).
    pub out_of_order: u64,
    /// Reopenings that failed.
    pub open_failures: u64,
    /// Target-specific figures (records, torn tails cut, batches...), for the summary.
    pub extra: Vec<(&'static str, u64)>,
    /// The first failure notes, for the human reader.
    pub notes: Vec<String>,
}

impl Counts {
    /// Whether anything wrong was found.
    pub fn failed(&self) -> bool {
        self.lost + self.duplicated + self.corrupt_accepted + self.out_of_order + self.open_failures
            > 0
    }

    /// Records a failure note (the first few are kept).
    pub fn note(&mut self, iteration: u64, text: impl Into<String>) {
        if self.notes.len() < NOTES_MAX {
            self.notes.push(format!("iteration {iteration}: {}", text.into()));
        }
    }

    /// Adds to a target-specific figure.
    pub fn add_extra(&mut self, key: &'static str, value: u64) {
        match self.extra.iter_mut().find(|(name, _)| *name == key) {
            Some((_, total)) => *total += value,
            None => self.extra.push((key, value)),
        }
    }

    /// Sets a target-specific figure.
    pub fn set_extra(&mut self, key: &'static str, value: u64) {
        match self.extra.iter_mut().find(|(name, _)| *name == key) {
            Some((_, total)) => *total = value,
            None => self.extra.push((key, value)),
        }
    }
}

/// The parent side of a target: recognises acknowledgements and checks a crashed directory.
pub trait Checker {
    /// Whether a child's line acknowledges an item (the kill timer starts at the first).
    fn is_ack(&self, line: &str) -> bool;

    /// Cuts the log so that the last acknowledged item is lost (`--inject-loss`).
    fn inject_loss(&mut self, lines: &[String]) -> anyhow::Result<()>;

    /// Reopens the directory after the kill, checks it against the child's complete output
    /// lines and adds to `counts`. Returns the recovery time (the reopening), or `None` if the
    /// reopening failed (counted in `counts`).
    ///
    /// # Errors
    /// Only for failures of the tool itself (a file it cannot read); damage is counted.
    fn check(
        &mut self,
        iteration: u64,
        lines: &[String],
        counts: &mut Counts,
    ) -> anyhow::Result<Option<Duration>>;
}

fn main() -> ExitCode {
    let cli = match coordbus_tools::cli::parse::<Cli>() {
        Ok(cli) => cli,
        // A usage error is a tool error: exit code 2, in one line.
        Err(exit) => return exit.print(2),
    };
    coordbus_tools::logging::init();
    if let Some(ChildCommand::Child(args)) = &cli.child {
        let result = match args.target {
            Target::Wal => wal::child(&args.dir, args.seed, args.iteration),
            Target::Epoch => epoch::child(&args.dir, args.seed, args.iteration),
            Target::Blocks => blocks::child(&args.dir, args.seed, args.iteration),
        };
        // A child only returns on error: it works until killed.
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("coordbus-crash child: {error:#}");
                ExitCode::from(child_exit_code(&error))
            }
        };
    }
    coordbus_tools::scratch::remove_on_interrupt();
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(error) => {
            eprintln!("coordbus-crash: error: {error:#}");
            ExitCode::from(2)
        }
    }
}

/// Parses `--iterations`: a whole number, at least 1 (clap's range would name its bound as
/// `1..18446744073709551615`).
fn parse_iterations(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(iterations) => Ok(iterations),
        Err(error) => Err(format!("not a whole number of iterations: {error}")),
    }
}

/// The kill loop. Returns whether the run passed.
fn run(cli: &Cli) -> anyhow::Result<bool> {
    let target = cli.target.context("--target is required")?;
    let parent = match &cli.dir {
        Some(dir) => {
            coordbus_tools::scratch::check_parent_dir("--dir", dir)?;
            dir.clone()
        }
        None => std::env::temp_dir(),
    };
    let work = ScratchDir::new_in(&parent, &format!("coordbus-crash-{}-", target.name()))
        .with_context(|| format!("creating a work directory in {}", parent.display()))?;
    if cli.keep {
        work.keep_on_interrupt();
    }
    let work_dir = work.path().to_path_buf();
    let mut checker: Box<dyn Checker> = match target {
        Target::Wal => Box::new(wal::WalChecker::new(&work_dir, cli.seed)),
        Target::Epoch => Box::new(epoch::EpochChecker::new(&work_dir)),
        Target::Blocks => Box::new(blocks::BlocksChecker::new(&work_dir)),
    };
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut rng = Rng::new(cli.seed);
    let mut counts = Counts::default();
    let mut recoveries: Vec<Duration> = Vec::new();
    let started = Instant::now();
    let mut done = 0;
    let mut outcome = Ok(());
    let mut last_progress = Instant::now();
    for iteration in 0..cli.iterations {
        // Long runs say how far they are, on stderr so that stdout stays one summary.
        if last_progress.elapsed() >= PROGRESS_INTERVAL {
            last_progress = Instant::now();
            eprintln!(
                "coordbus-crash: {iteration}/{} iterations, {} acked, {} lost",
                cli.iterations, counts.acked, counts.lost
            );
        }
        // The flag's range keeps this far from overflowing; saturating all the same.
        let bound_us = cli.max_run_ms.saturating_mul(1000).saturating_add(1);
        let delay = Duration::from_micros(rng.below(bound_us));
        let result = one_iteration(
            &exe,
            target,
            &work_dir,
            cli.seed,
            iteration,
            delay,
            checker.as_mut(),
            cli.inject_loss,
            &mut counts,
        );
        done = iteration + 1;
        match result {
            Ok(Some(recovery)) => recoveries.push(recovery),
            Ok(None) => {}
            Err(error) => {
                outcome = Err(error);
                break;
            }
        }
        if counts.failed() {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let failed = counts.failed() || outcome.is_err();
    let kept = if cli.keep || failed {
        Some(work.keep())
    } else {
        work.close().with_context(|| format!("removing {}", work_dir.display()))?;
        None
    };
    recoveries.sort();
    let ms = |duration: Duration| duration.as_secs_f64() * 1e3;
    let p50 = recoveries.get(recoveries.len().saturating_sub(1) / 2).copied().map_or(0.0, ms);
    let max = recoveries.last().copied().map_or(0.0, ms);
    let mean = if recoveries.is_empty() {
        0.0
    } else {
        recoveries.iter().copied().map(ms).sum::<f64>() / recoveries.len() as f64
    };
    let passed = !failed;
    if cli.json {
        let mut object = json!({
            "target": target.name(),
            "iterations": done,
            "acked": counts.acked,
            "lost": counts.lost,
            "duplicated": counts.duplicated,
            "corrupt_accepted": counts.corrupt_accepted,
            "out_of_order": counts.out_of_order,
            "open_failures": counts.open_failures,
            "recovery_p50_ms": round3(p50),
            "recovery_mean_ms": round3(mean),
            "recovery_max_ms": round3(max),
            "seconds": round3(seconds),
            "seed": cli.seed,
            "max_run_ms": cli.max_run_ms,
            "passed": passed,
            "kept_dir": kept.as_ref().map(|dir| dir.display().to_string()),
            "notes": counts.notes,
        });
        for (key, value) in &counts.extra {
            object[*key] = json!(value);
        }
        if let Err(error) = &outcome {
            object["error"] = json!(format!("{error:#}"));
        }
        summary!("{object}");
    } else {
        summary!(
            "coordbus-crash --target {}: {done} of {} iterations in {seconds:.1} s (seed {}, \
             kills within {} ms of the first acknowledgement)",
            target.name(),
            cli.iterations,
            cli.seed,
            cli.max_run_ms
        );
        summary!(
            "  acked {}  lost {}  duplicated {}  corrupt_accepted {}  out_of_order {}  \
             open_failures {}",
            counts.acked,
            counts.lost,
            counts.duplicated,
            counts.corrupt_accepted,
            counts.out_of_order,
            counts.open_failures
        );
        summary!("  recovery: p50 {p50:.2} ms, mean {mean:.2} ms, max {max:.2} ms");
        if !counts.extra.is_empty() {
            let extra: Vec<String> =
                counts.extra.iter().map(|(key, value)| format!("{key} {value}")).collect();
            summary!("  {}", extra.join("  "));
        }
        for note in &counts.notes {
            summary!("  ! {note}");
        }
        summary!("  {}", if passed { "PASS: nothing acknowledged was lost" } else { "FAIL" });
    }
    if let Some(dir) = &kept {
        if failed {
            eprintln!("coordbus-crash: the failing image was kept in {}", dir.display());
        } else {
            eprintln!("coordbus-crash: work directory kept in {}", dir.display());
        }
    }
    outcome?;
    Ok(passed)
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

/// The context of a child's error when opening or recovering its directory failed: what
/// `open_failures` counts, whichever process's open it was.
#[derive(Debug)]
struct OpenFailed(String);

impl std::fmt::Display for OpenFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The exit code of a child that ended with `error`.
fn child_exit_code(error: &anyhow::Error) -> u8 {
    if error.downcast_ref::<OpenFailed>().is_some() {
        CHILD_OPEN_FAILED
    } else {
        2
    }
}

/// A child that ended before acknowledging anything: if its open failed, that is counted (in
/// `open_failures`, with a note) and the iteration ends without a check; otherwise the tool
/// failed.
fn ended_before_acknowledging(
    iteration: u64,
    status: std::process::ExitStatus,
    stderr: &str,
    counts: &mut Counts,
) -> anyhow::Result<Option<Duration>> {
    if status.code() == Some(i32::from(CHILD_OPEN_FAILED)) {
        counts.open_failures += 1;
        counts.note(iteration, format!("the child could not open the directory: {stderr}"));
        return Ok(None);
    }
    bail!(
        "iteration {iteration}: the child ended ({status}) before acknowledging anything; its \
         stderr: {stderr}"
    )
}

/// One child run and its check. Returns the recovery time of the check.
#[allow(clippy::too_many_arguments)]
fn one_iteration(
    exe: &Path,
    target: Target,
    work_dir: &Path,
    seed: u64,
    iteration: u64,
    delay: Duration,
    checker: &mut dyn Checker,
    inject_loss: bool,
    counts: &mut Counts,
) -> anyhow::Result<Option<Duration>> {
    let stderr_path = work_dir.join("child-stderr.log");
    let stderr = File::create(&stderr_path)
        .with_context(|| format!("creating {}", stderr_path.display()))?;
    let mut child = Command::new(exe)
        .arg("child")
        .args(["--target", target.name(), "--seed", &seed.to_string()])
        .args(["--iteration", &iteration.to_string()])
        .arg("--dir")
        .arg(work_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("starting the child {}", exe.display()))?;
    // Listed for the interrupt handler until just before it is reaped (`reap`: after that
    // its pid may belong to another process).
    let mut listed = Some(ChildGuard::new(child.id()));
    let stdout = child.stdout.take().context("the child's stdout")?;
    let (sender, receiver) = mpsc::channel::<String>();
    // Only complete lines are passed on: the kill may cut the last one.
    let reader = std::thread::spawn(move || {
        let mut stdout = BufReader::new(stdout);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match stdout.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) if buf.last() == Some(&b'\n') => {
                    buf.pop();
                    if sender.send(String::from_utf8_lossy(&buf).into_owned()).is_err() {
                        break;
                    }
                }
                Ok(_) => break,
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + FIRST_ACK_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match receiver.recv_timeout(left) {
            Ok(line) => {
                let ack = checker.is_ack(&line);
                lines.push(line);
                if ack {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = reap(&mut child, &mut listed);
                let _ = reader.join();
                bail!(
                    "iteration {iteration}: the child acknowledged nothing within {:?}; its \
                     stderr: {}",
                    FIRST_ACK_TIMEOUT,
                    tail_of(&stderr_path)
                );
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = reap(&mut child, &mut listed).context("waiting for the child")?;
                let _ = reader.join();
                return ended_before_acknowledging(
                    iteration,
                    status,
                    &tail_of(&stderr_path),
                    counts,
                );
            }
        }
    }
    // The child works while the parent waits: this is the random kill moment, not a wait for
    // a result.
    std::thread::sleep(delay);
    // `Child::kill` sends SIGKILL on Unix.
    child.kill().context("killing the child")?;
    let status = reap(&mut child, &mut listed).context("waiting for the killed child")?;
    reader.join().map_err(|_| anyhow::anyhow!("the stdout reader panicked"))?;
    lines.extend(receiver.try_iter());
    count_io_path(&lines, counts);
    if inject_loss {
        checker.inject_loss(&lines)?;
    }
    let recovery = checker.check(iteration, &lines, counts)?;
    if status.signal() != Some(SIGKILL) {
        bail!(
            "iteration {iteration}: the child ended by itself ({status}) instead of being \
             killed; its stderr: {}",
            tail_of(&stderr_path)
        );
    }
    if recovery.is_none() {
        counts.note(iteration, format!("child stderr: {}", tail_of(&stderr_path)));
    }
    Ok(recovery)
}

/// Waits for `child` to end, after taking it off the interrupt handler's list (`listed`):
/// once reaped, its pid may be another process's.
fn reap(
    child: &mut std::process::Child,
    listed: &mut Option<ChildGuard>,
) -> std::io::Result<std::process::ExitStatus> {
    drop(listed.take());
    child.wait()
}

/// A child's first line: the I/O path its log writes through (`Auto` picks io_uring where
/// the kernel allows it), so that a run's summary says which paths its kills hit.
pub fn print_io_path(path: IoPath) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{IO_PATH_LINE}{}", path.as_str())?;
    out.flush()
}

/// The I/O path of an epoch or blocks child's log: two iterations on the default (`Auto`:
/// io_uring where the kernel allows it), then two on `pwrite`, so that kills hit both (the
/// `wal` target picks its own modes).
pub fn io_mode(iteration: u64) -> IoMode {
    if (iteration / 2).is_multiple_of(2) {
        IoMode::Auto
    } else {
        IoMode::Pwrite
    }
}

/// Counts the iterations of each I/O path, from the child's `io_path` line.
fn count_io_path(lines: &[String], counts: &mut Counts) {
    let path = lines.iter().find_map(|line| line.strip_prefix(IO_PATH_LINE));
    let key = match path {
        Some(name) if name == IoPath::IoUring.as_str() => "iterations_io_uring",
        Some(name) if name == IoPath::Pwrite.as_str() => "iterations_pwrite",
        _ => "iterations_io_path_unknown",
    };
    counts.add_extra(key, 1);
}

/// The last kilobyte of a child's stderr, for error messages.
fn tail_of(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        let len = file.metadata().map(|meta| meta.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(1024)));
        let _ = file.read_to_string(&mut text);
    }
    if text.trim().is_empty() {
        "(empty)".into()
    } else {
        text.trim().to_string()
    }
}

/// Cuts a log (`--inject-loss`) just before the first record from `from` on for which
/// `matches` holds, as if it and everything after it never reached the disk (see [`cut_log`]).
/// Returns `false`, leaving the log as it is, if no record matches.
pub fn cut_log_at_first(
    dir: &Path,
    config: coordbus::wal::WalConfig,
    from: coordbus::wal::Lsn,
    mut matches: impl FnMut(&coordbus::wal::RecordRef) -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    let handle = {
        let options = coordbus::wal::WalOptions { read_only: true, ..Default::default() };
        let wal = coordbus::wal::Wal::open_with_options(dir, config, options)?;
        let mut found = None;
        for record in wal.iter_from(from)? {
            let record = record?;
            if matches(&record)? {
                found = Some(record.handle);
                break;
            }
        }
        found
    };
    match handle {
        Some(handle) => cut_log(dir, handle.segment, handle.offset).map(|()| true),
        None => Ok(false),
    }
}

/// Cuts a log (`--inject-loss`): truncates segment `id` at `offset` and deletes every later
/// segment, as if those bytes never reached the disk.
pub fn cut_log(dir: &Path, id: coordbus::wal::SegmentId, offset: u64) -> anyhow::Result<()> {
    let path = dir.join(coordbus::wal::segment::file_name(id));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|file| file.set_len(offset))
        .with_context(|| format!("truncating {}", path.display()))?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let later = entry
            .file_name()
            .to_str()
            .and_then(coordbus::wal::segment::parse_file_name)
            .is_some_and(|other| other.0 > id.0);
        if later {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Counts;

    #[test]
    fn any_bad_count_fails_and_extras_add_up() {
        let mut counts = Counts { acked: 10, ..Counts::default() };
        assert!(!counts.failed());
        counts.add_extra("records", 2);
        counts.add_extra("records", 3);
        counts.set_extra("segments", 4);
        assert_eq!(counts.extra, vec![("records", 5), ("segments", 4)]);
        for index in 0..30 {
            counts.note(index, "x");
        }
        assert_eq!(counts.notes.len(), super::NOTES_MAX);
        counts.duplicated = 1;
        assert!(counts.failed());
    }

    /// A child whose open failed exits with its own code, and the parent counts that as an
    /// open failure (failing the run), not as a tool error.
    #[test]
    fn a_childs_failed_open_is_counted_not_a_tool_error() {
        use std::os::unix::process::ExitStatusExt as _;

        use anyhow::Context as _;

        let failed_open: anyhow::Result<()> = Err(std::io::Error::other("locked"))
            .with_context(|| super::OpenFailed("opening the log in /x".into()));
        let code = super::child_exit_code(&failed_open.unwrap_err());
        assert_eq!(code, super::CHILD_OPEN_FAILED);
        assert_eq!(super::child_exit_code(&anyhow::anyhow!("a bad flag")), 2);

        let mut counts = Counts::default();
        let status = std::process::ExitStatus::from_raw(i32::from(code) << 8);
        let outcome = super::ended_before_acknowledging(4, status, "locked", &mut counts);
        assert!(matches!(outcome, Ok(None)), "{outcome:?}");
        assert_eq!(counts.open_failures, 1);
        assert!(counts.failed());
        assert!(counts.notes[0].contains("locked"), "{:?}", counts.notes);

        let mut counts = Counts::default();
        let status = std::process::ExitStatus::from_raw(2 << 8);
        let outcome = super::ended_before_acknowledging(4, status, "a bad flag", &mut counts);
        assert!(outcome.is_err());
        assert_eq!(counts.open_failures, 0);
    }
}
