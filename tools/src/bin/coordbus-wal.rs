//! `coordbus-wal`: look inside a coordbus write-ahead log directory without changing it.
//!
//! * `inspect DIR`: one line per segment (records, LSN range, times, window, state) and the
//!   first corruption, if any.
//! * `dump DIR`: every record (LSN, time, place, length, payload preview), as text or JSON
//!   lines; damage skipped and what opening cuts (a torn tail, a torn segment creation, a
//!   failed log's records past its durable LSN) are named on stderr, and set the exit code:
//!   the same as `verify`'s for the same log.
//! * `verify DIR`: a strict scan; the exit code says whether the log is healthy.
//!
//! Nothing is written: the scans are read-only (a torn tail is reported, not cut), so they
//! work on a log a live writer holds open. Each command says whether a writer holds the
//! directory lock: if one does, a "torn tail" may be records still being written.
//!
//! `DIR` must be a log directory: a path that does not exist, or a directory holding files but
//! no segment file (`seg-NNNNNNNNNN.wal`; spare files `spare-NNNNNNNNNN.wal` are not
//! segments) nor a failed log's marker (`unsynced-after.lsn`, or its `.tmp`), is an error
//! (exit code 3), never an empty, healthy log: the wrong directory (the parent of the log, a
//! typo) must not pass for one. An empty directory is an empty log.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::Context;
use clap::{Parser, Subcommand};
use coordbus::wal::{
    is_locked, scan_dir,
    segment::{self, is_spare_file_name, parse_file_name},
    Lsn, RecoveryMode, RecoveryReport, SegmentSummary, TornTail, UnsyncedCut, Wal, WalConfig,
    WalError, WalOptions, UNSYNCED_MARKER, UNSYNCED_MARKER_TEMP,
};
use serde_json::json;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `println!` that returns the write's error instead of panicking: output piped into a
/// reader that stops early (`| head`) ends the command quietly (see `main`).
macro_rules! outln {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*)
    };
}

/// Inspect, dump and verify a coordbus write-ahead log (read-only).
#[derive(Debug, Parser)]
#[command(name = "coordbus-wal", version)]
struct Cli {
    /// Print JSON lines instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Segments, record counts, LSN ranges, and the first corruption if any.
    Inspect {
        /// The log directory.
        dir: PathBuf,
    },
    /// Every record, in LSN order. Damage is skipped (as a log opened tolerating corruption
    /// would); a torn tail, a torn segment creation, and the records a failed log wrote after
    /// its last durable LSN are not shown. Each is named on stderr. The exit code is about the
    /// whole log, whatever part --from and --limit show, and is verify's: 0: nothing left out;
    /// 1: damage skipped, or a failed-log marker that holds no LSN; 2: a torn tail, a torn
    /// segment creation or a failed log's records past its durable LSN left out; 3: I/O or
    /// usage error.
    Dump {
        /// The log directory.
        dir: PathBuf,
        /// First LSN to print (0: from the start).
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Print at most this many records (default: all).
        #[arg(long)]
        limit: Option<usize>,
        /// Payload bytes shown per record, in hex.
        #[arg(long, default_value_t = 32)]
        preview_bytes: usize,
    },
    /// Strict scan. Exit code 0: healthy; 1: corruption (opening would fail in strict mode),
    /// or a failed-log marker that holds no LSN (opening fails in any mode); 2: a torn tail or
    /// a torn segment creation, or records (or a segment) a failed log wrote after its last
    /// durable LSN (opening cuts or removes them; nothing acknowledged is affected); 3: I/O or
    /// usage error (also: DIR does not exist, or holds files but no WAL segment nor failed-log
    /// marker).
    Verify {
        /// The log directory.
        dir: PathBuf,
    },
}

fn summary_json(segment: &SegmentSummary) -> serde_json::Value {
    json!({
        "segment": segment.id.0,
        "path": segment.path,
        "file_len": segment.file_len,
        "records": segment.records,
        "first_lsn": segment.first_lsn.map(|lsn| lsn.0),
        "last_lsn": segment.last_lsn.map(|lsn| lsn.0),
        "time_range_ms": segment.time_range_ms,
        "window": segment.window,
        "valid_end": segment.valid_end,
        "torn_tail": segment.torn_tail.as_ref().map(|tail| json!({
            "offset": tail.offset,
            "bytes_discarded": tail.bytes_discarded,
            "records_discarded": tail.records_discarded,
        })),
        "corruption": segment.corruption.iter().map(|note| json!({
            "offset": note.offset,
            "reason": note.reason,
            "bytes_skipped": note.bytes_skipped,
        })).collect::<Vec<_>>(),
        "skipped": segment.skipped,
        "dropped": segment.dropped,
        "recycled": segment.recycled,
    })
}

/// What a scan found, in the terms of `verify`'s exit code. `dump` reads its own open's
/// report with it too, so the two commands give one log the same code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finding {
    Healthy,
    /// Damage (a tolerant scan skipped it; a strict open fails on it).
    Corrupt,
    /// Records, or a segment, that a failed log wrote after its last durable LSN: opening
    /// cuts or removes them (never acknowledged). A marker with nothing after its LSN only
    /// goes.
    FailedLog,
    /// Records written after the last sync, cut on open (what a crash leaves).
    TornTail,
    /// A last segment whose header never reached the disk, removed on open.
    TornCreation,
}

impl Finding {
    fn of(report: &RecoveryReport) -> Self {
        if !report.corruption_skipped.is_empty() {
            Self::Corrupt
        } else if report
            .unsynced_cut
            .is_some_and(|cut| cut.records_discarded > 0 || cut.segments_removed > 0)
        {
            Self::FailedLog
        } else if report.torn_tail.is_some() {
            Self::TornTail
        } else if !report.segments_skipped.is_empty() {
            Self::TornCreation
        } else {
            Self::Healthy
        }
    }

    fn exit_code(self) -> u8 {
        match self {
            Self::Healthy => 0,
            Self::Corrupt => 1,
            Self::FailedLog | Self::TornTail | Self::TornCreation => 2,
        }
    }

    fn verdict(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Corrupt => "corrupt",
            Self::FailedLog => "failed-log",
            Self::TornTail | Self::TornCreation => "torn-tail",
        }
    }
}

/// The segment files a report's open removes or skips, by name.
fn skipped_segment_names(report: &RecoveryReport) -> String {
    let names: Vec<String> =
        report.segments_skipped.iter().map(|&id| segment::file_name(id)).collect();
    names.join(", ")
}

/// What a failed log's marker cuts, as JSON (`null` without a marker).
fn unsynced_cut_json(report: &RecoveryReport) -> serde_json::Value {
    report.unsynced_cut.map_or(serde_json::Value::Null, |cut| {
        json!({
            "durable_lsn": cut.durable_lsn.0,
            "records_discarded": cut.records_discarded,
            "segments_removed": cut.segments_removed,
        })
    })
}

/// One line on the writer lock, for text output. A probe that failed says so: claiming the
/// lock free would tell the operator that a torn tail is what a crash left, when a live writer
/// may still be writing it.
fn lock_note(locked: &Result<bool, WalError>) -> String {
    match locked {
        Ok(true) => "writer lock: held by a live writer (the tail may be in flight; this scan \
                     cuts nothing)"
            .to_owned(),
        Ok(false) => "writer lock: free (no writer has the log open)".to_owned(),
        Err(error) => format!("writer lock: unknown ({error})"),
    }
}

/// The lock probe's answer for JSON (`null`: unknown) and its error (`null`: none).
fn lock_json(locked: &Result<bool, WalError>) -> (Option<bool>, Option<String>) {
    (locked.as_ref().ok().copied(), locked.as_ref().err().map(ToString::to_string))
}

/// The one-line summary of a scan or an open. The library's report counts the segments it
/// keeps ("no records in 0 segment(s)"), while the tool lists every segment file, skipped
/// ones too: with any skipped, the summary counts those as well, so it agrees with the table
/// above it.
fn report_summary(report: &RecoveryReport) -> String {
    let text = report.to_string();
    let skipped = report.segments_skipped.len();
    if skipped == 0 {
        return text;
    }
    let kept = report.segments;
    let counted = format!(" in {kept} segment(s)");
    let all = format!(" in {} segment(s) ({kept} kept, {skipped} skipped)", kept + skipped);
    if text.contains(&counted) {
        text.replacen(&counted, &all, 1)
    } else {
        format!("{text}; {} segment file(s), {kept} kept, {skipped} skipped", kept + skipped)
    }
}

/// Checks that `dir` is a log directory: it exists, is a directory, and holds at least one
/// segment file or nothing at all (an empty log). A directory holding other things but no
/// segment is named with the count of what it holds instead, so a wrong directory (e.g. the
/// parent of the log) is obvious.
fn check_log_dir(dir: &Path) -> anyhow::Result<()> {
    let metadata = match std::fs::metadata(dir) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            anyhow::bail!("{}: no such file or directory", dir.display())
        }
        Err(error) => {
            return Err(error).with_context(|| format!("reading the metadata of {}", dir.display()))
        }
    };
    anyhow::ensure!(metadata.is_dir(), "{} is not a directory", dir.display());
    let entries = std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    let (mut segments, mut spares, mut others) = (0u64, 0u64, 0u64);
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        let name = entry.file_name();
        match name.to_str() {
            // A log that failed before its first segment leaves only its marker (or, killed
            // while writing it, the marker's temporary file).
            Some(name)
                if parse_file_name(name).is_some()
                    || name == UNSYNCED_MARKER
                    || name == UNSYNCED_MARKER_TEMP =>
            {
                segments += 1
            }
            Some(name) if is_spare_file_name(name) => spares += 1,
            _ => others += 1,
        }
    }
    // An empty directory is an empty log (one opened, and nothing written yet).
    anyhow::ensure!(
        segments > 0 || spares + others == 0,
        "{} holds no WAL segment (no seg-NNNNNNNNNN.wal file); it has {} other entries \
         ({spares} spare segment files, {others} other files or directories): is it the log \
         directory?",
        dir.display(),
        spares + others
    );
    Ok(())
}

fn inspect(dir: &PathBuf, as_json: bool) -> anyhow::Result<ExitCode> {
    check_log_dir(dir)?;
    let locked = is_locked(dir);
    let (locked_by_writer, lock_probe_error) = lock_json(&locked);
    let scan = scan_dir(dir, RecoveryMode::TolerateCorruption)
        .with_context(|| format!("scanning {}", dir.display()))?;
    let first_corruption = scan.segments.iter().flat_map(|segment| &segment.corruption).next();
    if as_json {
        for segment in &scan.segments {
            outln!("{}", summary_json(segment))?;
        }
        outln!(
            "{}",
            json!({
                "summary": report_summary(&scan.report),
                "segments": scan.report.segments,
                "segment_files": scan.segments.len(),
                "segments_skipped": scan.report.segments_skipped.iter().map(|id| id.0)
                    .collect::<Vec<_>>(),
                "records": scan.report.records,
                "first_lsn": (scan.report.records > 0).then_some(scan.report.first_lsn.0),
                "last_lsn": (scan.report.records > 0).then_some(scan.report.last_lsn.0),
                "locked_by_writer": locked_by_writer,
                "lock_probe_error": lock_probe_error,
                "unsynced_cut": unsynced_cut_json(&scan.report),
                "first_corruption": first_corruption.map(|note| json!({
                    "segment": note.segment.0, "offset": note.offset, "reason": note.reason,
                })),
            })
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<18} {:>10} {:>9} {:>21} {:>27} {:>27}  state",
        "segment",
        "bytes",
        "records",
        "LSNs",
        "times (ms)",
        "window (ms)"
    )?;
    for segment in &scan.segments {
        let lsns = match (segment.first_lsn, segment.last_lsn) {
            (Some(first), Some(last)) => format!("{first}..={last}"),
            _ => "-".into(),
        };
        let times = segment.time_range_ms.map_or("-".into(), |(min, max)| format!("{min}..={max}"));
        let window = segment.window.map_or("-".into(), |(start, stop)| format!("{start}..={stop}"));
        let state = if segment.skipped {
            "unreadable (skipped)".to_owned()
        } else if segment.dropped {
            "removed on open (a torn creation, or records of a failed log past its durable LSN)"
                .to_owned()
        } else if !segment.corruption.is_empty() || segment.torn_tail.is_some() {
            // Both, when a segment has damage and a torn tail after it.
            let damage = (!segment.corruption.is_empty())
                .then(|| format!("{} damaged stretch(es)", segment.corruption.len()));
            let torn = segment.torn_tail.as_ref().map(|tail| {
                format!(
                    "torn tail at {} ({} bytes, {} records)",
                    tail.offset, tail.bytes_discarded, tail.records_discarded
                )
            });
            damage.into_iter().chain(torn).collect::<Vec<_>>().join("; ")
        } else if segment.recycled {
            "ok (recycled file)".to_owned()
        } else {
            "ok".to_owned()
        };
        outln!(
            "{:<18} {:>10} {:>9} {:>21} {:>27} {:>27}  {state}",
            segment
                .path
                .file_name()
                .map_or_else(String::new, |name| name.to_string_lossy().into_owned()),
            segment.file_len,
            segment.records,
            lsns,
            times,
            window
        )?;
    }
    outln!("{}", report_summary(&scan.report))?;
    outln!("{}", lock_note(&locked))?;
    match first_corruption {
        Some(note) => outln!(
            "first corruption: segment {} offset {}: {}",
            note.segment,
            note.offset,
            note.reason
        )?,
        None => outln!("no corruption")?,
    }
    Ok(ExitCode::SUCCESS)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn dump(
    dir: &PathBuf,
    from: u64,
    limit: Option<usize>,
    preview_bytes: usize,
    as_json: bool,
) -> anyhow::Result<ExitCode> {
    check_log_dir(dir)?;
    let opened = Wal::open_with_options(
        dir,
        WalConfig { recovery: RecoveryMode::TolerateCorruption, ..WalConfig::default() },
        WalOptions { read_only: true, ..WalOptions::default() },
    );
    let wal = match opened {
        // What a tolerant open still refuses: corrupt, as `verify` says (a marker that names no
        // LSN, a segment of an unknown format version).
        Err(
            error @ (coordbus::WalError::BadUnsyncedMarker { .. }
            | coordbus::WalError::UnsupportedVersion { .. }
            | coordbus::WalError::Corruption { .. }),
        ) => {
            eprintln!("coordbus-wal dump: corrupt: {error}");
            return Ok(ExitCode::from(Finding::Corrupt.exit_code()));
        }
        opened => opened.with_context(|| format!("opening {} read-only", dir.display()))?,
    };
    // On stderr also with --json: stdout holds only the records. A free lock goes unsaid.
    let locked = is_locked(dir);
    if !matches!(locked, Ok(false)) {
        eprintln!("{}", lock_note(&locked));
    }
    for record in wal.iter_from(Lsn(from))?.take(limit.unwrap_or(usize::MAX)) {
        let record = record?;
        let preview = &record.bytes[..record.bytes.len().min(preview_bytes)];
        if as_json {
            outln!(
                "{}",
                json!({
                    "lsn": record.lsn.0,
                    "time_ms": record.time_ms,
                    "segment": record.handle.segment.0,
                    "offset": record.handle.offset,
                    "len": record.handle.len,
                    "payload_crc32c": crc_fast::crc32_iscsi(&record.bytes),
                    "payload_hex": hex(preview),
                })
            )?;
        } else {
            outln!(
                "lsn {:>10}  time {:>14}  segment {:>6} offset {:>10}  len {:>7}  {}{}",
                record.lsn,
                record.time_ms,
                record.handle.segment,
                record.handle.offset,
                record.handle.len,
                hex(preview),
                if preview.len() < record.bytes.len() { ".." } else { "" }
            )?;
        }
    }
    let report = wal.recovery_report();
    let finding = Finding::of(report);
    for note in left_out_notes(report, finding) {
        eprintln!("coordbus-wal dump: {note}");
    }
    Ok(ExitCode::from(finding.exit_code()))
}

/// What `dump` did not show, one line each: the damage skipped, and what opening cuts or
/// removes (a damaged log's notes name both).
fn left_out_notes(report: &RecoveryReport, finding: Finding) -> Vec<String> {
    match (finding, report.unsynced_cut, &report.torn_tail) {
        (Finding::Healthy, ..) => Vec::new(),
        // The damage, and also what opening cuts.
        (Finding::Corrupt, cut, tail) => {
            let mut notes = damage_skipped(report);
            notes.extend(cut.map(|cut| unsynced_cut_note(report, cut)));
            notes.extend(tail.as_ref().map(torn_tail_note));
            notes
        }
        (Finding::FailedLog, Some(cut), _) => vec![unsynced_cut_note(report, cut)],
        (Finding::TornTail, _, Some(tail)) => vec![torn_tail_note(tail)],
        _ => vec![torn_creation_detail(report)],
    }
}

/// The note naming the records a failed log wrote after its last durable LSN.
fn unsynced_cut_note(report: &RecoveryReport, cut: UnsyncedCut) -> String {
    let mut note = format!(
        "not shown: {} records a failed log wrote after its last durable LSN {} (never \
         acknowledged; opening cuts them)",
        cut.records_discarded, cut.durable_lsn
    );
    if !report.segments_skipped.is_empty() {
        note += &format!("; segments removed on open: {}", skipped_segment_names(report));
    }
    note
}

/// The note naming a torn tail `dump` did not show.
fn torn_tail_note(tail: &TornTail) -> String {
    format!(
        "torn tail not shown: {} bytes ({} records) of segment {} from offset {} (records \
         written after the last sync: what a crash leaves, or a live writer's records in \
         flight)",
        tail.bytes_discarded, tail.records_discarded, tail.segment.0, tail.offset
    )
}

/// The damage a tolerant open skipped, one line each (a segment skipped as a whole is one
/// of them; a torn creation is not damage).
fn damage_skipped(report: &RecoveryReport) -> Vec<String> {
    report
        .corruption_skipped
        .iter()
        .map(|note| {
            format!(
                "skipped {} bytes ({} records known lost) of segment {} at offset {}: {}",
                note.bytes_skipped, note.records_skipped, note.segment.0, note.offset, note.reason
            )
        })
        .collect()
}

/// The report of a scan whose last segment is a torn creation (its header never reached the
/// disk, nothing follows it), which opening removes.
fn torn_creation_detail(report: &RecoveryReport) -> String {
    format!(
        "{}; a torn segment creation, removed on open (its header never reached the disk, \
         nothing follows it): {}",
        report_summary(report),
        skipped_segment_names(report)
    )
}

fn verify(dir: &PathBuf, as_json: bool) -> ExitCode {
    let checked = check_log_dir(dir);
    // Probed only for a log directory (the note is left out for anything else).
    let locked = if checked.is_ok() { is_locked(dir) } else { Ok(false) };
    let (locked_by_writer, lock_probe_error) = lock_json(&locked);
    let (code, verdict, detail) = match checked {
        Err(error) => (3, "error", format!("{error:#}")),
        Ok(()) => match scan_dir(dir, RecoveryMode::Strict) {
            Ok(scan) => {
                let finding = Finding::of(&scan.report);
                let detail = match finding {
                    Finding::TornCreation => torn_creation_detail(&scan.report),
                    _ => report_summary(&scan.report),
                };
                (finding.exit_code(), finding.verdict(), detail)
            }
            Err(error @ coordbus::WalError::Corruption { .. })
            | Err(error @ coordbus::WalError::UnsupportedVersion { .. })
            | Err(error @ coordbus::WalError::BadUnsyncedMarker { .. }) => {
                (1, "corrupt", error.to_string())
            }
            Err(error) => (3, "error", error.to_string()),
        },
    };
    // The exit code is the answer: output nobody reads (a closed pipe) does not change it.
    let _ = if as_json {
        outln!(
            "{}",
            json!({
                "verdict": verdict, "exit_code": code, "detail": detail,
                "locked_by_writer": locked_by_writer, "lock_probe_error": lock_probe_error,
            })
        )
    } else {
        // The lock note only means something for a log directory.
        outln!("{verdict}: {detail}").and_then(|()| {
            if code == 3 {
                Ok(())
            } else {
                outln!("{}", lock_note(&locked))
            }
        })
    };
    ExitCode::from(code)
}

fn main() -> ExitCode {
    let cli = match coordbus_tools::cli::parse::<Cli>() {
        Ok(cli) => cli,
        // `--help` and `--version` are not errors; a usage error is 3, as documented (clap
        // would exit with 2, which `verify` uses for a torn tail), in one line.
        Err(exit) => return exit.print(3),
    };
    coordbus_tools::logging::init();
    let result = match &cli.command {
        Command::Inspect { dir } => inspect(dir, cli.json),
        Command::Dump { dir, from, limit, preview_bytes } => {
            dump(dir, *from, *limit, *preview_bytes, cli.json)
        }
        Command::Verify { dir } => return verify(dir, cli.json),
    };
    match result {
        Ok(code) => code,
        Err(error) if is_broken_pipe(&error) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(3)
        }
    }
}

/// Whether `error` is stdout's reader going away (`| head`): the reader has what it wanted.
fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock probe that failed reads as unknown, naming the error, never as a free lock.
    #[test]
    fn a_failed_lock_probe_is_unknown_not_free() {
        let error = is_locked("/dev/null").expect_err("a file is no directory to probe");
        let note = lock_note(&Err(error));
        assert!(note.starts_with("writer lock: unknown ("), "{note}");
        assert!(!note.contains("free"), "{note}");
        assert_eq!(lock_note(&Ok(false)), "writer lock: free (no writer has the log open)");
    }
}
