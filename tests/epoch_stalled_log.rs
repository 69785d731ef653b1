//! Goal: once an append of the epoch log timed out (a stalled disk: the staging buffer stayed
//! full for the write timeout), the durable query refuses every later record at once, since
//! the coordinator fail-stopped on the first: it does not make the coordinator's thread wait
//! out the write timeout again for every later epoch.
//!
//! Method: a log whose sync waits at a gate, its staging buffer filled behind the held sync
//! (`wal_support`); the first offsets record times out, the next is refused without trying.

mod wal_support;

use std::{sync::Arc, time::Duration};

use coordbus::coordinators::epoch::{
    DurableQuery, Epoch, NoopQuery, Offsets, PartitionId, Payload, Query,
};
use wal_support::{hold_and_fill_staging, open_gated, AfterGate, Gate, OpenOnDrop};

/// 1000 offsets: a record of about 8 KiB, far more than the filled buffer has room for.
fn offsets(epoch: i64) -> Vec<(PartitionId, Payload)> {
    (0..1000).map(|p| (PartitionId(p), Payload::from(epoch << 20 | i64::from(p)))).collect()
}

#[test]
fn after_an_append_timed_out_later_records_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let wal = open_gated(dir.path(), &gate, AfterGate::Sync);
    let mut query = DurableQuery::from_wal(wal, NoopQuery)
        .unwrap()
        .with_write_timeout(Duration::from_millis(100));
    // Dropped first: opens the gate before the query's drop closes the log.
    let _open = OpenOnDrop(Arc::clone(&gate));
    hold_and_fill_staging(query.wal(), &gate, 4096, Duration::from_millis(50));

    let timed_out = query.add_offsets(Epoch(0), Offsets::new(&offsets(0))).unwrap_err().to_string();
    assert!(timed_out.contains("append"), "{timed_out}");
    let refused = query.add_offsets(Epoch(1), Offsets::new(&offsets(1))).unwrap_err().to_string();
    assert!(refused.contains("an earlier append failed"), "{refused}");
    let refused = query.commit(Epoch(0)).unwrap_err().to_string();
    assert!(refused.contains("an earlier append failed"), "{refused}");
}
