//! Bounds of the workloads' flags.
//!
//! Each flag that sizes an allocation, a thread count or a wait has a clap range built from
//! these bounds, so a bad value is rejected by clap (naming the flag and the value) before
//! any run starts, instead of panicking, wrapping or hanging in the middle of one. The bounds
//! are far above any useful value and the defaults; where the library has its own limit
//! (inbox shards, lanes and capacity, segment size, payload size, group commit delay), the
//! flag takes exactly that. Flags that only bound together are checked before a run:
//! memory planned up front ([`check_planned_bytes`]) and logs against the free space of their
//! file system ([`check_free_disk`], sized by [`log_disk_bytes`]).

use std::{ops::RangeInclusive, path::Path};

use anyhow::Context;
use coordbus::{record::frame, wal::segment};

/// Most threads a count flag starts (`bus --producers`, `wal --threads`, `state-store
/// --producers`, `blocks --receivers`): each is an OS thread of its own.
pub const MAX_THREADS: u64 = 1024;

/// Most requests kept outstanding (`ask`, `blocks`, `state-store` `--in-flight`, `blocks
/// --batch-in-flight`): a queue of this many replies is allocated up front.
pub const MAX_IN_FLIGHT: u64 = 1 << 20;

/// Most messages per `send_batch` or blocks per `AddBlocks` (`bus`, `epoch`, `state-store`,
/// `blocks` `--batch`): a vector of this many is allocated per call.
pub const MAX_BATCH: u64 = 1 << 20;

/// Inbox rings per endpoint: the bus accepts 1 ..= 1024 (`BusConfig::inbox_shards`).
pub const MAX_INBOX_SHARDS: u64 = 1024;

/// Single-producer lanes per inbox: the bus accepts 0 ..= `queue::MAX_LANES`.
pub const MAX_INBOX_LANES: u64 = coordbus::queue::MAX_LANES as u64;

/// Slots per inbox lane or ring: the bus accepts 2 ..= 2^24 (`BusConfig::inbox_capacity`).
pub const INBOX_CAPACITY: RangeInclusive<u64> = 2..=1 << 24;

/// Largest record payload (1 GiB): the largest payload a WAL frame carries.
pub const MAX_RECORD_BYTES: u64 = frame::MAX_PAYLOAD_LEN as u64;

/// Largest group commit size (1 GiB, `--max-bytes`, `--max-group-bytes`): the `wal`
/// workload's pwrite baseline allocates one batch of this size.
pub const MAX_GROUP_BYTES: u64 = 1 << 30;

/// Longest group commit delay in microseconds: the WAL's `MAX_GROUP_COMMIT_DELAY` (60 s).
pub const MAX_GROUP_DELAY_US: u64 = 60_000_000;

/// WAL segment sizes in MiB (`--segment-mib`): 1 MiB ..= 1 TiB, the WAL's largest segment
/// (`WalConfig::validate`), so `MiB << 20` cannot overflow.
pub const SEGMENT_MIB: RangeInclusive<u64> = 1..=1 << 20;

/// The segment size of `--segment-mib` in bytes (the flag's range keeps it within the WAL's).
pub fn segment_bytes(segment_mib: u64) -> u64 {
    segment_mib.saturating_mul(1 << 20)
}

/// Most bytes the flags of one run may make it allocate up front together (8 GiB). Each flag's
/// range is checked alone; several of them multiply (threads x batch x message size, producers
/// x ring slots), and a product past this is refused before anything runs, naming the flags,
/// instead of aborting on a failed allocation or swapping in the middle of a run.
pub const MAX_PLANNED_BYTES: u128 = 8 << 30;

/// Refuses a run whose `producers` threads each build batches of `batch` messages of
/// `message_bytes` (`--producers` x `--batch`) past [`MAX_PLANNED_BYTES`].
pub fn check_producer_batches(
    producers: usize,
    batch: usize,
    message_bytes: usize,
) -> anyhow::Result<()> {
    check_planned_bytes(
        &format!("--producers {producers} x --batch {batch}"),
        producers as u128 * batch as u128 * message_bytes as u128,
    )
}

/// Refuses a run whose flags named in `what` plan `bytes` bytes of memory up front, more than
/// [`MAX_PLANNED_BYTES`].
pub fn check_planned_bytes(what: &str, bytes: u128) -> anyhow::Result<()> {
    anyhow::ensure!(
        bytes <= MAX_PLANNED_BYTES,
        "{what} make the run allocate {bytes} bytes up front, more than {MAX_PLANNED_BYTES} (8 \
         GiB): lower one of them"
    );
    Ok(())
}

/// Bytes a log of `frames` frames of at most `frame_bytes` bytes each takes on disk in
/// `segment_bytes` segments. A frame that does not fit in what is left of a segment starts the
/// next one, and every segment is preallocated whole, so this counts whole segments of as many
/// whole frames as fit, plus one for the segment a roll starts (or the spare a clean keeps).
pub fn log_disk_bytes(frames: u128, frame_bytes: u128, segment_bytes: u64) -> u128 {
    let room = u128::from(segment_bytes.saturating_sub(segment::HEADER_LEN));
    let frames_per_segment = (room / frame_bytes.max(1)).max(1);
    (frames.div_ceil(frames_per_segment) + 1) * u128::from(segment_bytes)
}

/// Refuses a run whose flags (named in `what`) would have it write about `bytes` bytes to
/// the file system holding `dir`, more than is free there for this user: the run would
/// otherwise stop in the middle with `ENOSPC` (a preallocated 1 TiB segment, say) after
/// minutes of work.
///
/// `elsewhere` names how to choose another directory (`" (--dir)"`, `" (TMPDIR)"`).
pub fn check_free_disk(dir: &Path, what: &str, bytes: u128, elsewhere: &str) -> anyhow::Result<()> {
    let stats = rustix::fs::statvfs(dir)
        .with_context(|| format!("reading the free space of {}", dir.display()))?;
    let free = u128::from(stats.f_bavail) * u128::from(stats.f_frsize);
    anyhow::ensure!(
        bytes <= free,
        "{what} make the run write about {bytes} bytes to {}, which has {free} bytes free: \
         lower them, or give the run a larger file system{}",
        dir.display(),
        elsewhere
    );
    Ok(())
}
