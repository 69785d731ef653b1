//! The state-store coordinator (SPEC C): which executor hosts each state-store provider, where
//! to place tasks, and which stores lag behind in snapshot uploads.
//!
//! Parts:
//! * `ids`: [`StateStoreId`], [`StateStoreProviderId`], [`ExecutorCacheTaskLocation`],
//!   [`SnapshotUploadEvent`], and [`Name`], the interned string they are made of. Ids are small
//!   `Copy` values, so reports cross the bus without allocation or shared reference counts.
//! * `instances`: the per-run table of active providers (operator -> partition-indexed slots).
//! * `machine`: [`StateStoreCoordinator`], the state machine (no I/O, no threads, an
//!   injectable [`Clock`](crate::clock::Clock)), its settings, errors and counters.
//! * `endpoint`: [`StateStoreCoordinatorEndpoint`] hosting it on the bus, one struct per
//!   message, and [`StateStoreCoordinatorRef`] with Spark's "for driver" / "for executor"
//!   helpers.
//!
//! Both forms of the report exist (SPEC 0.4): the one-way [`ReportActiveInstance`] of Spark
//! <= 3.x and the request-reply [`ReportActiveInstanceAndCheck`] of 4.x that answers with the
//! providers to unload.
//!
//! Read-your-writes: all messages, reads included, are handled on the endpoint thread. A
//! thread's one-way report and its later verify or location query share one FIFO lane of the
//! inbox (per-sender order, SPEC A.4), so the query sees the report; no "eventually" is needed.
//! The sender is the thread: an async task that reports, awaits, and queries from another
//! worker thread of its executor is two senders, and its query may overtake its report (the
//! bus's `EndpointRef` doc); such a task asks [`ReportActiveInstanceAndCheck`] instead, whose
//! answer means the report was applied.
//!
//! Bad input (an empty host, executor id, checkpoint location or store name; a negative
//! operator, partition or snapshot version) never panics: a request fails with a
//! [`StateStoreError`] naming the values, a one-way report is dropped, counted in
//! [`StateStoreCounters::rejected`] and logged (a warning at the 1st, 2nd, 4th, ... rejected
//! report).

mod endpoint;
mod ids;
mod instances;
mod machine;

pub use self::{
    endpoint::{
        DeactivateInstances, GetCounters, GetLaggingStoresForTesting,
        GetLatestSnapshotVersionForTesting, GetLocation, LogLaggingStateStores,
        ReportActiveInstance, ReportActiveInstanceAndCheck, ReportSnapshotUploaded,
        StateStoreCoordinatorEndpoint, StateStoreCoordinatorRef, StateStoreRequest,
        StopCoordinator, UpdateConfig, VerifyIfInstanceActive, STATE_STORE_COORDINATOR_NAME,
    },
    ids::{
        ExecutorCacheTaskLocation, Name, SnapshotUploadEvent, StateStoreId, StateStoreProviderId,
        DEFAULT_STORE_NAME,
    },
    machine::{
        LagReport, LaggingStore, StateStoreCoordinator, StateStoreCoordinatorConfig,
        StateStoreCounters, StateStoreError, DEACTIVATED_RUNS_REMEMBERED,
    },
};

#[cfg(test)]
mod tests;
