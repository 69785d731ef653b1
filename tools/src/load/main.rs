//! `coordbus-load`: the load generator.
//!
//! Each workload lives in its own module with an argument struct (clap) and a `run` function
//! returning the measured [`report::Figure`]s. With no subcommand, every workload runs briefly on
//! an embedded default and one table (or JSON lines with `--json`) is printed.

mod blocks;
mod bus;
mod report;
mod wal;

use clap::{Parser, Subcommand};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Load generator for coordbus: measures each workload against a baseline in the same run.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Print one JSON object per measured figure, one per line, instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    workload: Option<Workload>,
}

#[derive(Debug, Subcommand)]
enum Workload {
    /// One-way messages from N producers into a no-op endpoint (send or send_batch).
    Bus(bus::BusArgs),
    /// Request-reply round trips, K in flight.
    Ask(bus::AskArgs),
    /// Received-block tracker: durable additions, allocation and recovery of 1 M events.
    Blocks(blocks::BlocksArgs),
    /// WAL append: durable 64-byte records/s per durability mode and thread count.
    Wal(wal::WalArgs),
    /// WAL recovery scan speed.
    WalRecover(wal::WalRecoverArgs),
}

/// Every workload, briefly: the README's main command.
fn run_all() -> anyhow::Result<Vec<report::Figure>> {
    use bus::{quick_ask, quick_bus, BusBaseline};
    let mut figures = Vec::new();
    figures.extend(bus::run_bus(&quick_bus(1, 1, BusBaseline::Crossbeam))?);
    figures.extend(bus::run_bus(&quick_bus(2, 1, BusBaseline::Crossbeam))?);
    figures.extend(bus::run_bus(&quick_bus(1, 256, BusBaseline::Ring))?);
    figures.extend(bus::run_ask(&quick_ask(1))?);
    figures.extend(bus::run_ask(&quick_ask(64))?);
    figures.extend(wal::run(&wal::quick())?);
    figures.extend(wal::run_recover(&wal::quick_recover())?);
    figures.extend(blocks::run(&blocks::quick())?);
    Ok(figures)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let figures = match cli.workload {
        None => run_all()?,
        Some(Workload::Bus(args)) => bus::run_bus(&args)?,
        Some(Workload::Ask(args)) => bus::run_ask(&args)?,
        Some(Workload::Blocks(args)) => blocks::run(&args)?,
        Some(Workload::Wal(args)) => wal::run(&args)?,
        Some(Workload::WalRecover(args)) => wal::run_recover(&args)?,
    };
    report::print(&figures, cli.json);
    Ok(())
}
