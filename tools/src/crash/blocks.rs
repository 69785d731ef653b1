//! Target `blocks` (pending its coordinator on main).

use std::{path::Path, time::Duration};

use crate::{Checker, Counts};

/// The child.
pub fn child(_work: &Path, _seed: u64, _iteration: u64) -> anyhow::Result<()> {
    anyhow::bail!("target blocks is not built yet")
}

/// The checker.
pub struct BlocksChecker;

impl BlocksChecker {
    /// A checker.
    pub fn new(_work: &Path) -> Self {
        Self
    }
}

impl Checker for BlocksChecker {
    fn is_ack(&self, _line: &str) -> bool {
        false
    }
    fn inject_loss(&mut self, _lines: &[String]) -> anyhow::Result<()> {
        Ok(())
    }
    fn check(&mut self, _: u64, _: &[String], _: &mut Counts) -> anyhow::Result<Option<Duration>> {
        Ok(None)
    }
}
