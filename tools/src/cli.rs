//! Command lines: a flag clap refuses is reported in one line on stderr, as every other error of
//! these tools is (`error: ...`), instead of clap's three or more (the error, a blank line, a
//! usage line, "For more information, try '--help'."). Help and version print as clap prints
//! them.
//!
//! The line keeps everything clap said, in order: its lines joined with `; ` (the error, any
//! `tip:` and `[possible values: ...]`, the usage where clap gives one; a line ending in `:`
//! with a space, to the list it introduces) and the pointer to `--help` at the end.

use std::process::ExitCode;

use clap::error::ErrorKind;

/// What a command line that does not run asks for instead: help, the version, or a usage error.
#[derive(Debug)]
pub struct EarlyExit(clap::Error);

impl EarlyExit {
    /// Prints it and returns the exit code: help and version as clap prints them, with 0 (help
    /// shown for a missing subcommand counts as a usage error); a usage error as one line on
    /// stderr ([`one_line`]), with `usage_exit_code`.
    pub fn print(&self, usage_exit_code: u8) -> ExitCode {
        let error = &self.0;
        match error.kind() {
            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                // A reader that went away (`--help | head`) has what it wanted.
                let _ = error.print();
                ExitCode::SUCCESS
            }
            ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                let _ = error.print();
                ExitCode::from(usage_exit_code)
            }
            _ => {
                eprintln!("{}", one_line(error));
                ExitCode::from(usage_exit_code)
            }
        }
    }
}

/// Parses the process's command line as `P`; what to print and exit with if it does not run.
pub fn parse<P: clap::Parser>() -> Result<P, EarlyExit> {
    P::try_parse().map_err(EarlyExit)
}

/// A usage error as one line (module doc), starting with clap's `error: `.
pub fn one_line(error: &clap::Error) -> String {
    // Rendered without styles: `StyledStr`'s `Display` leaves the terminal codes out.
    let rendered = error.render().to_string();
    let mut line = String::new();
    let parts = rendered
        .lines()
        .map(str::trim)
        .filter(|part| !part.is_empty() && !part.starts_with("For more information"));
    for part in parts {
        // A part that introduces a list ("...not provided:") goes on with its items.
        match line.chars().last() {
            None => {}
            Some(':') => line.push(' '),
            Some(_) => line.push_str("; "),
        }
        line.push_str(part);
    }
    line + " (for more information, try '--help')"
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    #[command(name = "tool")]
    struct Cli {
        /// A count.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        count: Option<u32>,
        /// A mode.
        #[arg(long, value_enum)]
        mode: Option<Mode>,
    }

    #[derive(clap::ValueEnum, Debug, Clone)]
    enum Mode {
        Fast,
        Slow,
    }

    fn refusal(args: &[&str]) -> String {
        let error = Cli::try_parse_from(std::iter::once("tool").chain(args.iter().copied()))
            .expect_err("refused");
        one_line(&error)
    }

    /// Each refusal is one line that names the flag and the value, and keeps clap's hints.
    #[test]
    fn a_refused_flag_is_one_line_with_everything_clap_said() {
        let line = refusal(&["--count", "0"]);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("error: invalid value '0' for '--count <COUNT>'"), "{line}");
        assert!(line.ends_with("(for more information, try '--help')"), "{line}");
        let line = refusal(&["--mode", "medium"]);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.contains("'medium'") && line.contains("fast, slow"), "{line}");
        let line = refusal(&["--cuont", "3"]);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.contains("'--cuont'") && line.contains("Usage: tool"), "{line}");
    }

    /// A line that introduces a list goes on with it, not with a `; `.
    #[test]
    fn a_list_follows_the_line_that_introduces_it() {
        #[derive(Debug, Parser)]
        #[command(name = "tool")]
        struct Required {
            /// A directory.
            dir: String,
        }
        let error = Required::try_parse_from(["tool"]).expect_err("refused");
        let line = one_line(&error);
        assert!(line.contains("were not provided: <DIR>; Usage: tool <DIR>"), "{line}");
    }
}
