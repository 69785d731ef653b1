//! Identifiers of the state-store coordinator (SPEC C.2), built for cheap copies and lookups.
//!
//! Every string part of an id (checkpoint location, store name, host, executor id) is an
//! interned [`Name`]: a pointer to one process-wide copy of the text. Interning is paid once,
//! when an id is made (an executor makes the id of a provider once, then reports it many
//! times); after that an id is a small `Copy` value (48 bytes for a provider id, 16 for a
//! location), compared and hashed by pointer and integers, and sent through the bus without
//! allocating or touching a shared reference count. That is what lets one endpoint thread take
//! tens of millions of reports a second.
//!
//! Interned text is never freed. This is bounded by what a driver sees: one checkpoint location
//! per query, a handful of store names, one host and one executor id per executor. A driver that
//! starts many short queries on fresh checkpoint directories keeps about one path per query;
//! [`Name::interned_count`] exposes the count for monitoring.

use std::{
    cmp::Ordering,
    fmt,
    hash::{Hash, Hasher},
    sync::{OnceLock, RwLock},
};

use rustc_hash::FxHashMap;
use uuid::Uuid;

/// Interner shards: concurrent interning of different strings rarely meets on one lock.
const NAME_SHARDS: usize = 16;

/// The text behind a [`Name`]; leaked, so it lives as long as the process.
struct NameData {
    text: Box<str>,
}

/// An interned string: equal texts give the same pointer, so equality and hashing look at the
/// pointer only. `Copy`, 8 bytes. Ordering and display use the text.
///
/// ```
/// use coordbus::coordinators::state_store::Name;
/// let a = Name::new("/checkpoints/q1");
/// let b = Name::new(&String::from("/checkpoints/q1"));
/// assert_eq!(a, b);
/// assert_eq!(a.as_str(), "/checkpoints/q1");
/// ```
#[derive(Clone, Copy)]
pub struct Name(&'static NameData);

type NameShard = RwLock<FxHashMap<&'static str, Name>>;

fn name_shards() -> &'static [NameShard; NAME_SHARDS] {
    static SHARDS: OnceLock<[NameShard; NAME_SHARDS]> = OnceLock::new();
    SHARDS.get_or_init(|| std::array::from_fn(|_| RwLock::new(FxHashMap::default())))
}

impl Name {
    /// Interns `text` (a lookup, and one leaked allocation the first time a text is seen).
    pub fn new(text: &str) -> Self {
        let mut hasher = rustc_hash::FxHasher::default();
        text.hash(&mut hasher);
        let shard = &name_shards()[(hasher.finish() as usize) % NAME_SHARDS];
        // A poisoned lock only means another thread panicked while holding it; the map is
        // still consistent (inserts are single calls), so keep using it.
        if let Some(name) =
            shard.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(text)
        {
            return *name;
        }
        let mut names = shard.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(name) = names.get(text) {
            return *name;
        }
        let data: &'static NameData = Box::leak(Box::new(NameData { text: text.into() }));
        let name = Name(data);
        names.insert(&data.text, name);
        name
    }

    /// The text.
    pub fn as_str(self) -> &'static str {
        &self.0.text
    }

    /// Whether the text is empty.
    pub fn is_empty(self) -> bool {
        self.0.text.is_empty()
    }

    /// How many distinct texts this process has interned so far.
    pub fn interned_count() -> usize {
        name_shards()
            .iter()
            .map(|shard| shard.read().unwrap_or_else(std::sync::PoisonError::into_inner).len())
            .sum()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for Name {}

impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_usize(std::ptr::from_ref(self.0) as usize);
    }
}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Self) -> Ordering {
        if self == other {
            Ordering::Equal
        } else {
            self.as_str().cmp(other.as_str())
        }
    }
}

impl fmt::Display for Name {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), formatter)
    }
}

impl From<&str> for Name {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<String> for Name {
    fn from(text: String) -> Self {
        Self::new(&text)
    }
}

impl From<&String> for Name {
    fn from(text: &String) -> Self {
        Self::new(text)
    }
}

impl Default for Name {
    /// The empty name.
    fn default() -> Self {
        Self::new("")
    }
}

/// The store name used when none is given (Spark's `StateStoreId.DEFAULT_STORE_NAME`).
pub const DEFAULT_STORE_NAME: &str = "default";

/// One state store: value equality on all four fields (SPEC C.2).
///
/// Well-formed ids have a non-empty checkpoint location and store name and a non-negative
/// operator and partition; the coordinator rejects others
/// ([`StateStoreError::MalformedStoreId`](super::StateStoreError::MalformedStoreId)).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct StateStoreId {
    /// Root of the query's checkpoint.
    pub checkpoint_root_location: Name,
    /// The stateful operator.
    pub operator_id: i64,
    /// The partition of that operator.
    pub partition_id: i32,
    /// Which store of the operator ("default" unless the operator keeps several).
    pub store_name: Name,
}

impl StateStoreId {
    /// The id of the default store of (`checkpoint_root_location`, `operator_id`,
    /// `partition_id`).
    pub fn new(checkpoint_root_location: &str, operator_id: i64, partition_id: i32) -> Self {
        Self::with_store_name(
            checkpoint_root_location,
            operator_id,
            partition_id,
            DEFAULT_STORE_NAME,
        )
    }

    /// The id of the store `store_name`.
    pub fn with_store_name(
        checkpoint_root_location: &str,
        operator_id: i64,
        partition_id: i32,
        store_name: &str,
    ) -> Self {
        Self {
            checkpoint_root_location: Name::new(checkpoint_root_location),
            operator_id,
            partition_id,
            store_name: Name::new(store_name),
        }
    }

    /// Why this id is malformed, or `None` if it is well formed.
    pub fn malformation(&self) -> Option<&'static str> {
        if self.checkpoint_root_location.is_empty() {
            Some("empty checkpoint root location")
        } else if self.operator_id < 0 {
            Some("negative operator id")
        } else if self.partition_id < 0 {
            Some("negative partition id")
        } else if self.store_name.is_empty() {
            Some("empty store name")
        } else {
            None
        }
    }
}

impl fmt::Display for StateStoreId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "StateStoreId[checkpointRootLocation={}, operatorId={}, partitionId={}, storeName={}]",
            self.checkpoint_root_location, self.operator_id, self.partition_id, self.store_name
        )
    }
}

/// A state store as loaded by one run of a query: the run id makes providers of different runs
/// of the same query distinct (SPEC C.2).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub struct StateStoreProviderId {
    /// The store.
    pub store_id: StateStoreId,
    /// The query run that loaded it.
    pub query_run_id: Uuid,
}

impl StateStoreProviderId {
    /// The provider of `store_id` in run `query_run_id`.
    pub fn new(store_id: StateStoreId, query_run_id: Uuid) -> Self {
        Self { store_id, query_run_id }
    }
}

impl Hash for StateStoreProviderId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.store_id.hash(state);
        state.write_u128(self.query_run_id.as_u128());
    }
}

impl fmt::Display for StateStoreProviderId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "StateStoreProviderId[storeId={}, queryRunId={}]",
            self.store_id, self.query_run_id
        )
    }
}

/// Where a provider is loaded: an executor's block-manager cache. Its string form,
/// `executor_<host>_<executorId>`, is what task placement uses as a preferred location.
///
/// ```
/// use coordbus::coordinators::state_store::ExecutorCacheTaskLocation;
/// let location = ExecutorCacheTaskLocation::new("hostX", "exec1");
/// assert_eq!(location.to_string(), "executor_hostX_exec1");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ExecutorCacheTaskLocation {
    /// The executor's host.
    pub host: Name,
    /// The executor's id.
    pub executor_id: Name,
}

impl ExecutorCacheTaskLocation {
    /// The location of executor `executor_id` on `host`.
    pub fn new(host: &str, executor_id: &str) -> Self {
        Self { host: Name::new(host), executor_id: Name::new(executor_id) }
    }

    /// Why this location is malformed (an empty host or executor id), or `None`.
    pub fn malformation(&self) -> Option<&'static str> {
        if self.host.is_empty() {
            Some("empty host")
        } else if self.executor_id.is_empty() {
            Some("empty executor id")
        } else {
            None
        }
    }
}

impl fmt::Display for ExecutorCacheTaskLocation {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "executor_{}_{}", self.host, self.executor_id)
    }
}

/// The latest snapshot a provider uploaded: ordered by version, then timestamp. The default,
/// `(0, 0)`, stands for "never uploaded".
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct SnapshotUploadEvent {
    /// The uploaded snapshot's version.
    pub version: i64,
    /// When it was uploaded (ms since the Unix epoch).
    pub timestamp_ms: i64,
}

impl SnapshotUploadEvent {
    /// An upload of `version` at `timestamp_ms`.
    pub fn new(version: i64, timestamp_ms: i64) -> Self {
        Self { version, timestamp_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_interned_once_and_compare_by_text_order() {
        let a = Name::new("interned-test-a");
        let a_again = Name::new(&format!("interned-test-{}", "a"));
        let b = Name::new("interned-test-b");
        assert_eq!(a, a_again);
        assert!(std::ptr::eq(a.as_str(), a_again.as_str()));
        assert_ne!(a, b);
        assert!(a < b);
        assert!(Name::default().is_empty());
        assert!(Name::interned_count() >= 3);
    }

    #[test]
    fn names_interned_concurrently_are_one_name() {
        // Four threads released together intern the same fresh texts in the same order, so
        // many are first seen by two threads at once.
        const TEXTS: usize = 2000;
        let start = std::sync::Barrier::new(4);
        let per_thread: Vec<Vec<Name>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        start.wait();
                        (0..TEXTS).map(|i| Name::new(&format!("interned-race-{i}"))).collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for i in 0..TEXTS {
            let first = per_thread[0][i];
            assert!(per_thread.iter().all(|names| names[i] == first), "text {i} interned twice");
        }
    }

    #[test]
    fn ids_have_value_equality_and_the_spark_string_form() {
        let run = Uuid::from_u128(7);
        let one = StateStoreProviderId::new(StateStoreId::new("x", 0, 0), run);
        let same = StateStoreProviderId::new(
            StateStoreId::with_store_name(&String::from("x"), 0, 0, "default"),
            run,
        );
        assert_eq!(one, same);
        assert_ne!(
            one,
            StateStoreProviderId::new(StateStoreId::new("x", 0, 0), Uuid::from_u128(8))
        );
        assert_ne!(one.store_id, StateStoreId::with_store_name("x", 0, 0, "other"));
        assert_eq!(
            ExecutorCacheTaskLocation::new("hostX", "exec1").to_string(),
            "executor_hostX_exec1"
        );
        assert_ne!(
            ExecutorCacheTaskLocation::new("hostX", "exec1"),
            ExecutorCacheTaskLocation::new("hostY", "exec1")
        );
    }

    #[test]
    fn malformed_ids_are_named() {
        assert_eq!(StateStoreId::new("x", 0, 0).malformation(), None);
        assert_eq!(
            StateStoreId::new("", 0, 0).malformation(),
            Some("empty checkpoint root location")
        );
        assert_eq!(StateStoreId::new("x", -1, 0).malformation(), Some("negative operator id"));
        assert_eq!(StateStoreId::new("x", 0, -3).malformation(), Some("negative partition id"));
        assert_eq!(
            StateStoreId::with_store_name("x", 0, 0, "").malformation(),
            Some("empty store name")
        );
        assert_eq!(ExecutorCacheTaskLocation::new("", "e").malformation(), Some("empty host"));
        assert_eq!(
            ExecutorCacheTaskLocation::new("h", "").malformation(),
            Some("empty executor id")
        );
    }

    #[test]
    fn snapshot_events_order_by_version_then_time() {
        let mut events = vec![
            SnapshotUploadEvent::new(2, 1),
            SnapshotUploadEvent::new(1, 9),
            SnapshotUploadEvent::default(),
            SnapshotUploadEvent::new(1, 3),
        ];
        events.sort();
        assert_eq!(
            events,
            vec![
                SnapshotUploadEvent::new(0, 0),
                SnapshotUploadEvent::new(1, 3),
                SnapshotUploadEvent::new(1, 9),
                SnapshotUploadEvent::new(2, 1),
            ]
        );
    }
}
