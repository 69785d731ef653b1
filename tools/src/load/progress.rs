//! Progress for long runs: a bar on a terminal, periodic plain lines when stderr is piped.
//!
//! Progress goes to stderr so that stdout stays clean for the table or the JSON lines.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// Progress over a known number of steps (workloads).
pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    done: u64,
}

impl Progress {
    /// Progress over `total` steps.
    pub fn new(total: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
                    .expect("static template")
                    .progress_chars("=> "),
            );
            bar
        });
        Self { bar, total, done: 0 }
    }

    /// Announces the next step.
    pub fn start(&mut self, step: &str) {
        match &self.bar {
            Some(bar) => bar.set_message(step.to_owned()),
            None => eprintln!("[{}/{}] {step}", self.done + 1, self.total),
        }
    }

    /// Marks the current step done.
    pub fn finish_step(&mut self) {
        self.done += 1;
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    /// Removes the bar.
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
