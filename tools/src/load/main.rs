//! `coordbus-load`: the load generator.
//!
//! Each workload lives in its own module with an argument struct (clap) and a `run` function
//! returning the measured [`report::Figure`]s. With no subcommand, every workload runs briefly on
//! an embedded default and one table (or JSON lines with `--json`) is printed. Each workload
//! probes the cores' round trip around the runs of each of its figures itself
//! ([`machine::with_round_trips`]), so that the probes bracket what the figure measured and
//! nothing else.

mod blocks;
mod bus;
mod epoch;
mod limits;
mod machine;
mod memory;
mod offsets;
mod placement;
mod progress;
mod report;
mod shares;
mod state_store;
mod wal;

use clap::{Parser, Subcommand};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Load generator for coordbus: measures each workload, against a baseline in the same run
/// where one exists (the `blocks` workload reports Spark's published rates instead).
#[derive(Debug, Parser)]
#[command(name = "coordbus-load", version)]
struct Cli {
    /// Print one JSON object per measured figure, one per line, instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Add the endpoints' and WALs' counters (received, handled, inbox depth, handler time,
    /// syncs...) to each figure.
    #[arg(long, global = true)]
    stats: bool,
    #[command(subcommand)]
    workload: Option<Workload>,
}

#[derive(Debug, Subcommand)]
enum Workload {
    /// One-way messages from N producers into a no-op endpoint (send or send_batch).
    Bus(bus::BusArgs),
    /// Request-reply round trips, K in flight.
    Ask(bus::AskArgs),
    /// WAL append: records/s (of --record-bytes) per durability mode and thread count.
    Wal(wal::WalArgs),
    /// WAL recovery scan speed.
    WalRecover(wal::WalRecoverArgs),
    /// Epoch coordinator: partitions reporting offsets and committing epochs.
    Epoch(epoch::EpochArgs),
    /// StateStoreCoordinator: reports, verify/location asks, deactivation.
    StateStore(state_store::StateStoreArgs),
    /// Received-block tracker: durable additions, allocation and recovery of 1 M events.
    Blocks(blocks::BlocksArgs),
}

/// One step of the no-argument run.
type Step = (&'static str, Box<dyn Fn() -> anyhow::Result<Vec<report::Figure>>>);

/// Every workload, briefly: the README's main command.
fn run_all() -> anyhow::Result<Vec<report::Figure>> {
    use bus::{quick_ask, quick_bus, BusBaseline};
    let steps: Vec<Step> = vec![
        (
            "bus: send, 1 producer",
            Box::new(|| bus::run_bus(&quick_bus(1, 1, BusBaseline::Crossbeam))),
        ),
        (
            "bus: send, 2 producers",
            Box::new(|| bus::run_bus(&quick_bus(2, 1, BusBaseline::Crossbeam))),
        ),
        ("bus: send_batch 256", Box::new(|| bus::run_bus(&quick_bus(1, 256, BusBaseline::Ring)))),
        ("ask: 1 in flight", Box::new(|| bus::run_ask(&quick_ask(1)))),
        ("ask: 64 in flight", Box::new(|| bus::run_ask(&quick_ask(64)))),
        ("wal: append", Box::new(|| wal::run(&wal::quick()))),
        ("wal: recovery scan", Box::new(|| wal::run_recover(&wal::quick_recover()))),
        ("epoch coordinator", Box::new(|| epoch::run(&epoch::quick()))),
        ("state-store coordinator", Box::new(|| state_store::run(&state_store::quick()))),
        ("block tracker", Box::new(|| blocks::run(&blocks::quick()))),
    ];
    let mut progress = progress::Progress::new(steps.len() as u64);
    let mut figures = Vec::new();
    for (name, step) in steps {
        progress.start(name);
        figures.extend(step()?);
        progress.finish_step();
    }
    progress.finish();
    Ok(figures)
}

static STATS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether `--stats` was given: workloads then attach their counters to their figures.
pub fn stats_enabled() -> bool {
    STATS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Exit code of a usage error (a flag clap refuses), as clap's own.
const USAGE_EXIT_CODE: u8 = 2;

/// Runs the command line's workloads; an error is printed as one line with its causes
/// (`{:#}`), never with anyhow's backtrace, which `RUST_BACKTRACE=1` would add to a returned
/// error: a refused flag is the operator's mistake, not the tool's. A flag clap refuses is one
/// line too ([`coordbus_tools::cli`]).
fn main() -> std::process::ExitCode {
    let cli = match coordbus_tools::cli::parse::<Cli>() {
        Ok(cli) => cli,
        Err(exit) => return exit.print(USAGE_EXIT_CODE),
    };
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    coordbus_tools::logging::init();
    coordbus_tools::scratch::remove_on_interrupt();
    STATS.store(cli.stats, std::sync::atomic::Ordering::Relaxed);
    let figures = match cli.workload {
        None => run_all()?,
        Some(workload) => match &workload {
            Workload::Bus(args) => bus::run_bus(args)?,
            Workload::Ask(args) => bus::run_ask(args)?,
            Workload::Wal(args) => wal::run(args)?,
            Workload::WalRecover(args) => wal::run_recover(args)?,
            Workload::Epoch(args) => epoch::run(args)?,
            Workload::StateStore(args) => state_store::run(args)?,
            Workload::Blocks(args) => blocks::run(args)?,
        },
    };
    match report::print(&figures, cli.json) {
        // The reader went away (`| head`): it has what it wanted.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        printed => Ok(printed?),
    }
}
