//! Target `wal`: self-checking records appended until the kill.
//!
//! Child: opens (recovers) the log in `<work>/wal` and appends records whose first 4 bytes are
//! the CRC32C of the rest, in the mode the iteration picks (`EveryRecord` with one thread, or
//! `GroupCommit` with two threads appending small batches; each on the io_uring path when the
//! kernel allows it and on the pwrite path, alternating). It prints `durable <lsn> <crc>` for
//! each record once `wait_durable` returned for it. In every other group of four iterations
//! the first appender also cleans the log behind itself: it prints `clean <lsn>`, then cleans
//! below that LSN without waiting, so cleaned segments' files become spares and are reused for
//! new segments (module doc of `coordbus::wal`, "Recycled segments") while the kill can come;
//! after each clean it prints `recycled <n>`, the segments its run has made from spares.
//!
//! Parent: in every third iteration, first tears the tail after the last acknowledged record
//! (`tear_after`), in the last segment only: from a random point after it to up to 4 KiB past
//! the last frame written, the bytes become zeros or garbage, as a power loss may leave bytes
//! no sync covered (a kill -9 alone keeps them whole); recovery must cut garbage as a torn
//! tail (except in a recycled segment, where it may be taken for the earlier segment's bytes).
//! Then it reopens the log in strict mode (the recovery time), and checks that LSNs run
//! contiguously from the first record kept, which must be at or below the highest `clean`
//! threshold announced so far (1 if none), that every record passes its self-check, that every
//! printed LSN is present with the printed checksum, that every record verified after earlier
//! kills is still there unchanged unless it lies below the first record kept, and, after
//! closing, that a second read-only scan finds no torn tail (no garbage after the tail).

use std::{
    io::Write,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use coordbus::{
    record::frame,
    wal::{
        scan_dir, segment, Durability, IoMode, Lsn, RecordHandle, RecoveryMode, Wal, WalConfig,
        WalOptions,
    },
};
use coordbus_tools::rng::Rng;

use crate::{Checker, Counts};

/// Segment size: small, so that rolls (and, in cleaning iterations, reuses of spares) happen
/// within a run.
const SEGMENT_SIZE_BYTES: u64 = 64 << 10;
/// A cleaning appender cleans after this many records of its own...
const CLEAN_EVERY_RECORDS: u64 = 200;
/// ... below the LSN this many records before its last durable one.
const CLEAN_KEEP_RECORDS: u64 = 300;

fn config(durability: Durability) -> WalConfig {
    WalConfig {
        segment_size_bytes: SEGMENT_SIZE_BYTES,
        durability,
        recovery: RecoveryMode::Strict,
        ..WalConfig::default()
    }
}

fn wal_dir(work: &Path) -> PathBuf {
    work.join("wal")
}

/// The mode of an iteration: (name, durability, I/O path, appending threads).
fn mode(iteration: u64) -> (&'static str, Durability, IoMode, u64) {
    match iteration % 4 {
        0 => ("every-record/auto", Durability::EveryRecord, IoMode::Auto, 1),
        1 => ("group-commit/auto", Durability::default(), IoMode::Auto, 2),
        2 => ("every-record/pwrite", Durability::EveryRecord, IoMode::Pwrite, 1),
        _ => ("group-commit/pwrite", Durability::default(), IoMode::Pwrite, 2),
    }
}

/// Whether the iteration's first appender cleans behind itself.
fn cleans(iteration: u64) -> bool {
    iteration % 8 >= 4
}

/// Whether the parent tears the log's tail after the iteration's kill (module doc).
fn tears(iteration: u64) -> bool {
    iteration % 3 == 2
}

/// Seeds the parent's tear of an iteration (apart from the children's seeds).
const TEAR_SEED: u64 = 0x7ea2_7a11;

/// The handles of the record of `acknowledged` and of the last record, read (read-only) from a
/// log that ends cleanly; `None` otherwise (see [`tear_after`]).
fn acknowledged_and_last(dir: &Path, acknowledged: Lsn) -> Option<(RecordHandle, RecordHandle)> {
    let options = WalOptions { read_only: true, ..WalOptions::default() };
    let wal = Wal::open_with_options(dir, config(Durability::default()), options).ok()?;
    let report = wal.recovery_report();
    if report.torn_tail.is_some() || report.unsynced_cut.is_some() {
        return None;
    }
    let mut records = wal.iter_from(acknowledged).ok()?;
    let first = records.next()?.ok()?;
    if first.lsn != acknowledged {
        return None;
    }
    let mut last = first.handle;
    for record in records {
        last = record.ok()?.handle;
    }
    Some((first.handle, last))
}

/// What a tear did to the last segment.
struct Tear {
    bytes: u64,
    garbage: bool,
    /// The segment's file held an earlier segment: recovery takes what does not look like a
    /// frame of this use past the records for that segment's bytes, not for a torn tail.
    recycled: bool,
}

/// Tears the log in `dir` after the record of `acknowledged` (the last one a child
/// acknowledged), as a power loss may tear bytes no sync covered: from a random point after
/// that record's frame to up to 4 KiB past the last frame written, the bytes become zeros or
/// garbage. Records synced but not acknowledged yet may be torn too, which is stricter than a
/// power loss but loses nothing acknowledged: every frame after the tear's start is destroyed,
/// so none is left to prove them durable. When nothing was written after the record, garbage
/// follows it directly (a next group torn mid-write). Only a tail inside the last segment file
/// is torn (an earlier segment was synced before a later one got records, so a power loss
/// leaves it whole). `None` (nothing torn) when the record ends its segment's file, a later
/// segment exists, the record is not found (the check counts the loss), or the log does not
/// end cleanly before the tear (a torn tail, a failed log's cut, a read error: frames past the
/// last one read could survive the tear; the check's own open judges such a log).
fn tear_after(dir: &Path, acknowledged: Lsn, rng: &mut Rng) -> anyhow::Result<Option<Tear>> {
    let Some((acked, last)) = acknowledged_and_last(dir, acknowledged) else {
        return Ok(None);
    };
    let later_segment = std::fs::read_dir(dir)?.filter_map(Result::ok).any(|entry| {
        entry
            .file_name()
            .to_str()
            .and_then(segment::parse_file_name)
            .is_some_and(|id| id.0 > acked.segment.0)
    });
    if later_segment || last.segment != acked.segment {
        return Ok(None);
    }
    let acked_end = acked.offset + frame::frame_len(acked.len as usize) as u64;
    let written_end = last.offset + frame::frame_len(last.len as usize) as u64;
    let path = dir.join(segment::file_name(acked.segment));
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;
    let mut header = [0u8; segment::HEADER_LEN as usize];
    file.read_exact_at(&mut header, 0)?;
    let recycled = segment::SegmentHeader::decode(acked.segment, &header)?.recycled;
    let (start, garbage) = if written_end > acked_end {
        (acked_end + rng.below(written_end - acked_end), rng.below(2) == 0)
    } else {
        // Nothing written after the acknowledged record: a power loss in the middle of the
        // next group's write leaves garbage right after it (zeros there would change nothing).
        (acked_end, true)
    };
    let end = (written_end.max(start + 1) + rng.below(4096)).min(file.metadata()?.len());
    if end <= start {
        // The record ends the file: no room for a tail.
        return Ok(None);
    }
    let mut bytes: Vec<u8> =
        (start..end).map(|_| if garbage { rng.next_u64() as u8 } else { 0 }).collect();
    if garbage && bytes.iter().all(|&byte| byte == 0) {
        // Garbage that happens to be zeros would tear nothing.
        bytes[0] = 0xa5;
    }
    file.write_all_at(&bytes, start).with_context(|| format!("tearing {}", path.display()))?;
    Ok(Some(Tear { bytes: end - start, garbage, recycled }))
}

/// A self-checking payload of `len + 4` bytes: CRC32C of the body, then the body.
fn payload(rng: &mut Rng, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    out.extend((0..len).map(|_| rng.next_u64() as u8));
    let crc = crc_fast::crc32_iscsi(&out[4..]);
    out[..4].copy_from_slice(&crc.to_le_bytes());
    out
}

fn self_check(bytes: &[u8]) -> bool {
    bytes.len() >= 4
        && bytes[..4].try_into().map(u32::from_le_bytes).ok()
            == Some(crc_fast::crc32_iscsi(&bytes[4..]))
}

/// The child: appends until killed.
pub fn child(work: &Path, seed: u64, iteration: u64) -> anyhow::Result<()> {
    let (_, durability, io, threads) = mode(iteration);
    let dir = wal_dir(work);
    let wal = Arc::new(
        Wal::open_with_options(
            &dir,
            config(durability),
            // Every group through the ring (when it is live), so both write paths of the
            // io_uring engine are crashed.
            WalOptions { io, uring_direct_max_bytes: 0, ..WalOptions::default() },
        )
        .with_context(|| crate::OpenFailed(format!("opening the log in {}", dir.display())))?,
    );
    crate::print_io_path(wal.io_path())?;
    let workers: Vec<_> = (0..threads)
        .map(|thread| {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || -> anyhow::Result<()> {
                let mut rng = Rng::new(seed ^ (iteration << 20) ^ (thread << 56));
                let cleaner = thread == 0 && cleans(iteration);
                let mut since_clean = 0u64;
                loop {
                    let batch = if threads == 1 { 1 } else { 1 + rng.below(8) };
                    let mut appended = Vec::with_capacity(batch as usize);
                    for _ in 0..batch {
                        let len = 8 + rng.below(300) as usize;
                        let bytes = payload(&mut rng, len);
                        let (lsn, _) = wal.append_bytes(&bytes, 0)?;
                        appended.push((lsn, crc_fast::crc32_iscsi(&bytes)));
                    }
                    let last = appended.last().map_or(Lsn::ZERO, |(lsn, _)| *lsn);
                    wal.wait_durable(last)?;
                    let mut out = std::io::stdout().lock();
                    since_clean += appended.len() as u64;
                    for (lsn, crc) in appended {
                        writeln!(out, "durable {} {crc}", lsn.0)?;
                    }
                    out.flush()?;
                    if cleaner && since_clean >= CLEAN_EVERY_RECORDS {
                        since_clean = 0;
                        let threshold = last.0.saturating_sub(CLEAN_KEEP_RECORDS);
                        // Announced before the clean: records below may be gone after a kill.
                        writeln!(out, "clean {threshold}")?;
                        out.flush()?;
                        drop(out);
                        wal.clean_below_lsn(Lsn(threshold), false)?;
                        // How many segments this run made from spares so far (a count only).
                        let recycled = wal.stats().recycled_segments;
                        writeln!(std::io::stdout().lock(), "recycled {recycled}")?;
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().map_err(|_| anyhow::anyhow!("an appender panicked"))??;
    }
    Ok(())
}

/// The parent's side: what every earlier check verified.
pub struct WalChecker {
    dir: PathBuf,
    /// The run's seed (the tears derive theirs from it).
    seed: u64,
    /// CRC32C of each record verified so far, index `lsn - 1` (`None` below the first record
    /// kept).
    verified: Vec<Option<u32>>,
    /// The highest `clean` threshold any child announced: records below it may be gone.
    clean_floor: u64,
}

impl WalChecker {
    /// A checker for the log in `<work>/wal`, tearing tails with seeds derived from `seed`.
    pub fn new(work: &Path, seed: u64) -> Self {
        Self { dir: wal_dir(work), seed, verified: Vec::new(), clean_floor: 0 }
    }
}

/// The highest threshold of the child's `clean` lines.
fn announced_clean(lines: &[String]) -> Option<u64> {
    lines.iter().filter_map(|line| line.strip_prefix("clean ")?.parse().ok()).max()
}

/// The `(lsn, crc)` pairs of the child's `durable` lines.
fn printed(lines: &[String]) -> Vec<(u64, u32)> {
    lines
        .iter()
        .filter_map(|line| {
            let mut words = line.strip_prefix("durable ")?.split(' ');
            Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
        })
        .collect()
}

impl Checker for WalChecker {
    fn is_ack(&self, line: &str) -> bool {
        line.starts_with("durable ")
    }

    fn inject_loss(&mut self, lines: &[String]) -> anyhow::Result<()> {
        let Some(last) = printed(lines).iter().map(|(lsn, _)| *lsn).max() else {
            return Ok(());
        };
        // Cut the log just before the last acknowledged record: as if its bytes never
        // reached the disk although it was acknowledged.
        let cut = crate::cut_log_at_first(
            &self.dir,
            config(Durability::default()),
            Lsn(last),
            |record| Ok(record.lsn.0 == last),
        )?;
        if !cut {
            anyhow::bail!("LSN {last} not found to inject its loss");
        }
        Ok(())
    }

    fn check(
        &mut self,
        iteration: u64,
        lines: &[String],
        counts: &mut Counts,
    ) -> anyhow::Result<Option<Duration>> {
        let printed = printed(lines);
        counts.acked += printed.len() as u64;
        let last_acked = printed.iter().map(|(lsn, _)| *lsn).max();
        let mut tear = None;
        if let Some(last) = last_acked.filter(|_| tears(iteration)) {
            let mut rng = Rng::new(self.seed ^ TEAR_SEED ^ iteration.rotate_left(32));
            tear = tear_after(&self.dir, Lsn(last), &mut rng)?;
            if let Some(tear) = &tear {
                counts.add_extra("tails_torn", 1);
                counts.add_extra("tails_torn_with_garbage", u64::from(tear.garbage));
                counts.add_extra("tail_bytes_torn", tear.bytes);
            }
        }
        if let Some(threshold) = announced_clean(lines) {
            counts.add_extra("runs_cleaning", 1);
            self.clean_floor = self.clean_floor.max(threshold);
        }
        let recycled = lines.iter().filter_map(|line| line.strip_prefix("recycled ")?.parse().ok());
        counts.add_extra("segments_recycled", recycled.max().unwrap_or(0));
        let started = Instant::now();
        let wal = match Wal::open(&self.dir, config(Durability::default())) {
            Ok(wal) => wal,
            Err(error) => {
                counts.open_failures += 1;
                counts.lost += printed.len() as u64 + self.verified.iter().flatten().count() as u64;
                counts.note(iteration, format!("reopening the log failed: {error}"));
                return Ok(None);
            }
        };
        let recovery = started.elapsed();
        if let Some(tail) = &wal.recovery_report().torn_tail {
            counts.add_extra("torn_tails_cut", 1);
            counts.add_extra("torn_records_discarded", tail.records_discarded);
        } else if tear.is_some_and(|tear| tear.garbage && !tear.recycled) {
            // Garbage after the last whole frame is a torn tail, never a clean end (except in
            // a recycled segment, where it may be taken for the earlier segment's bytes).
            counts.corrupt_accepted += 1;
            counts.note(iteration, "the garbage of a torn tail was not cut".to_string());
        }
        // Read every record: LSNs contiguous from the first one kept, each intact.
        let mut crcs: Vec<Option<u32>> = Vec::new();
        let mut iter_error = None;
        for record in wal.iter_from(Lsn::ZERO)? {
            let record = match record {
                Ok(record) => record,
                Err(error) => {
                    iter_error = Some(error);
                    break;
                }
            };
            if crcs.is_empty() && record.lsn.0 > 1 {
                if record.lsn.0 > self.clean_floor.max(1) {
                    counts.lost += 1;
                    counts.note(
                        iteration,
                        format!(
                            "the log starts at LSN {}, above the highest clean threshold {}",
                            record.lsn, self.clean_floor
                        ),
                    );
                }
                // Cleaned below the first record kept.
                crcs.resize((record.lsn.0 - 1) as usize, None);
            }
            let expected = crcs.len() as u64 + 1;
            if record.lsn.0 < expected {
                counts.duplicated += 1;
                counts.note(iteration, format!("LSN {} again after {}", record.lsn, expected - 1));
                continue;
            }
            if record.lsn.0 > expected {
                counts.out_of_order += 1;
                counts.note(iteration, format!("LSN gap: {} follows {}", record.lsn, expected - 1));
                // Keep positions aligned with LSNs; the gap's LSNs hold no checksum.
                crcs.resize((record.lsn.0 - 1) as usize, None);
            }
            if !self_check(&record.bytes) {
                counts.corrupt_accepted += 1;
                counts.note(iteration, format!("record {} fails its self-check", record.lsn));
            }
            crcs.push(Some(crc_fast::crc32_iscsi(&record.bytes)));
        }
        let first_kept = crcs.iter().position(Option::is_some).map_or(1, |index| index as u64 + 1);
        let kept = crcs.iter().flatten().count() as u64;
        if let Some(error) = iter_error {
            counts.corrupt_accepted += 1;
            counts.note(iteration, format!("reading the recovered log failed: {error}"));
        }
        // Every record verified before this run, and every record printed durable in it, from
        // the first record kept on (the check above bounds where that may be).
        let expected = self
            .verified
            .iter()
            .enumerate()
            .filter_map(|(index, crc)| Some((index as u64 + 1, (*crc)?, "verified earlier")))
            .chain(printed.iter().map(|(lsn, crc)| (*lsn, *crc, "acknowledged")))
            // A record above the clean floor is never cleaned, whatever the log starts at.
            .filter(|(lsn, _, _)| *lsn >= first_kept || *lsn > self.clean_floor);
        for (lsn, crc, what) in expected {
            match crcs.get((lsn as usize).wrapping_sub(1)).copied().flatten() {
                Some(stored) if stored == crc => {}
                Some(stored) => {
                    counts.corrupt_accepted += 1;
                    counts.note(
                        iteration,
                        format!("{what} LSN {lsn}: checksum {stored:#x}, expected {crc:#x}"),
                    );
                }
                None => {
                    counts.lost += 1;
                    counts.note(
                        iteration,
                        format!("{what} LSN {lsn} lost (the log ends at {})", crcs.len()),
                    );
                }
            }
        }
        wal.close()?;
        drop(wal);
        // The cut tail stays cut: a second, read-only scan finds a clean end.
        let scan = scan_dir(&self.dir, RecoveryMode::Strict);
        match scan {
            Ok(scan) if scan.report.torn_tail.is_none() && scan.report.records == kept => {}
            Ok(scan) => {
                counts.out_of_order += 1;
                counts.note(
                    iteration,
                    format!(
                        "garbage after the tail on a second scan: {} (expected {} records)",
                        scan.report, kept
                    ),
                );
            }
            Err(error) => {
                counts.open_failures += 1;
                counts.note(iteration, format!("second scan failed: {error}"));
            }
        }
        counts.set_extra("records", kept);
        self.verified = crcs;
        let kind = if matches!(mode(iteration).1, Durability::EveryRecord) {
            "kills_every_record"
        } else {
            "kills_group_commit"
        };
        counts.add_extra(kind, 1);
        Ok(Some(recovery))
    }
}

#[cfg(test)]
mod tests {
    use super::{announced_clean, payload, printed, self_check};
    use coordbus_tools::rng::Rng;

    #[test]
    fn payloads_check_themselves_and_a_flipped_bit_is_caught() {
        let mut rng = Rng::new(3);
        let mut bytes = payload(&mut rng, 40);
        assert!(self_check(&bytes));
        bytes[10] ^= 0x10;
        assert!(!self_check(&bytes));
        assert!(!self_check(&[1, 2, 3]));
    }

    #[test]
    fn only_whole_durable_lines_count() {
        let lines: Vec<String> =
            ["durable 1 7", "durable 2", "noise", "durable x 1", "durable 3 9"]
                .iter()
                .map(ToString::to_string)
                .collect();
        assert_eq!(printed(&lines), vec![(1, 7), (3, 9)]);
    }

    #[test]
    fn the_highest_whole_clean_line_counts() {
        let lines: Vec<String> = ["clean 40", "durable 1 7", "clean 90", "clean x", "clean 12"]
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(announced_clean(&lines), Some(90));
        assert_eq!(announced_clean(&lines[1..2]), None);
    }
}
