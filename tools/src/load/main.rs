//! `coordbus-load`: the load generator.
//!
//! Each workload lives in its own module with an argument struct (clap) and a `run` function
//! returning the measured [`report::Figure`]s. With no subcommand, every workload runs briefly on
//! an embedded default and one table (or JSON lines with `--json`) is printed.

mod epoch;
mod report;

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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let figures: Vec<report::Figure> = match cli.workload {
        None => epoch::run(&epoch::quick())?,
        Some(workload) => match workload {
            Workload::Epoch(args) => epoch::run(&args)?,
        },
    };
    report::print(&figures, cli.json);
    Ok(())
}
