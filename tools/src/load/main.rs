//! `coordbus-load`: the load generator.
//!
//! Each workload lives in its own module with an argument struct (clap) and a `run` function
//! returning the measured [`report::Figure`]s. With no subcommand, every workload runs briefly on
//! an embedded default and one table (or JSON lines with `--json`) is printed.

mod epoch;
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
    /// Epoch coordinator: partitions reporting offsets and committing epochs.
    Epoch(epoch::EpochArgs),
    /// WAL append: durable 64-byte records/s per durability mode and thread count.
    Wal(wal::WalArgs),
    /// WAL recovery scan speed.
    WalRecover(wal::WalRecoverArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let figures: Vec<report::Figure> = match cli.workload {
        None => {
            let mut figures = epoch::run(&epoch::quick())?;
            figures.extend(wal::run(&wal::quick())?);
            figures.extend(wal::run_recover(&wal::quick_recover())?);
            figures
        }
        Some(workload) => match workload {
            Workload::Epoch(args) => epoch::run(&args)?,
            Workload::Wal(args) => wal::run(&args)?,
            Workload::WalRecover(args) => wal::run_recover(&args)?,
        },
    };
    report::print(&figures, cli.json);
    Ok(())
}
