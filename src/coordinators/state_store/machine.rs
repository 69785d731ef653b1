//! The state machine of the state-store coordinator: who hosts which provider, which snapshot
//! each provider uploaded last, and which providers lag behind (SPEC C.3, C.4).
//!
//! State is kept per query run: `runs` maps a run id to that run's `instances` (store id ->
//! location, an `InstanceTable`), its latest snapshots and the time of its last full lag
//! report. A lookup is two probes of small, cache-resident maps (run, then operator) and one
//! vector index (partition); deactivating a run removes one entry of `runs`, which frees that
//! run's tables and touches nothing of the other runs (SPEC 0.4: time proportional to that
//! run's stores, here only the cost of freeing them). Lag detection walks only the run it is
//! asked about.
//!
//! Choices beyond the spec:
//! * Deactivating a run drops all of that run's snapshot records, also those of providers that
//!   reported an upload but were never reported active (Spark drops only the ids it found
//!   active, leaving the others behind for good).
//! * A report (active instance or snapshot upload) for a run deactivated earlier is dropped,
//!   counted and logged (the 1st, 2nd, 4th, ... time), instead of being stored as SPEC C.4
//!   says, which would bring the run back: tasks
//!   of a stopped run that still load providers, or a maintenance upload that finishes after
//!   the stop, would otherwise leave a run's tables behind for good (as Spark does), one per
//!   query run over a driver's life. The last [`DEACTIVATED_RUNS_REMEMBERED`] deactivated runs
//!   are remembered (run ids are fresh per run, so none is ever legitimately reused). A
//!   dropped `ReportActiveInstance` still answers its check (against the providers active
//!   now), so the executor unloads what it should.

use std::{collections::VecDeque, time::Duration};

use rustc_hash::{FxHashMap, FxHashSet};
use uuid::Uuid;

use super::{
    ids::{ExecutorCacheTaskLocation, SnapshotUploadEvent, StateStoreId, StateStoreProviderId},
    instances::InstanceTable,
};
use crate::{clock::Clock, clock::SystemClock, error::ConfigError};

/// Settings of the coordinator (SPEC 0.4 and C.4), with Spark's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateStoreCoordinatorConfig {
    /// Whether lagging stores are detected and reported
    /// (`spark.sql.streaming.stateStore.coordinatorReportSnapshotUploadLag`, default `true`).
    /// When off, lag reports do nothing and the lagging list is empty.
    pub report_snapshot_upload_lag: bool,
    /// A store lags in versions when it is more than this many times `min_deltas_for_snapshot`
    /// behind (`...multiplierForMinVersionDiffToLog`, default 5, at least 1).
    pub multiplier_for_min_version_diff_to_log: i64,
    /// A store lags in time when its last upload is more than this many maintenance intervals
    /// old (`...multiplierForMinTimeDiffToLog`, default 3, at least 1).
    pub multiplier_for_min_time_diff_to_log: i64,
    /// Least time between two full lag reports of one run (default 5 minutes).
    pub snapshot_lag_report_interval_ms: i64,
    /// Most stores named in one full lag report (default 5).
    pub max_lagging_stores_to_report: usize,
    /// Deltas between snapshots (`spark.sql.streaming.stateStore.minDeltasForSnapshot`,
    /// default 10, at least 1).
    pub min_deltas_for_snapshot: i64,
    /// Interval of the executors' maintenance task
    /// (`spark.sql.streaming.stateStore.maintenanceInterval`, default 60 s, positive).
    pub maintenance_interval_ms: i64,
}

impl Default for StateStoreCoordinatorConfig {
    fn default() -> Self {
        Self {
            report_snapshot_upload_lag: true,
            multiplier_for_min_version_diff_to_log: 5,
            multiplier_for_min_time_diff_to_log: 3,
            snapshot_lag_report_interval_ms: Duration::from_secs(5 * 60).as_millis() as i64,
            max_lagging_stores_to_report: 5,
            min_deltas_for_snapshot: 10,
            maintenance_interval_ms: Duration::from_secs(60).as_millis() as i64,
        }
    }
}

impl StateStoreCoordinatorConfig {
    /// Checks every setting.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first setting out of range and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let checks: [(&'static str, i64, i64, &'static str); 5] = [
            (
                "multiplier_for_min_version_diff_to_log",
                self.multiplier_for_min_version_diff_to_log,
                1,
                "must be at least 1",
            ),
            (
                "multiplier_for_min_time_diff_to_log",
                self.multiplier_for_min_time_diff_to_log,
                1,
                "must be at least 1",
            ),
            (
                "snapshot_lag_report_interval_ms",
                self.snapshot_lag_report_interval_ms,
                0,
                "must not be negative",
            ),
            ("min_deltas_for_snapshot", self.min_deltas_for_snapshot, 1, "must be at least 1"),
            ("maintenance_interval_ms", self.maintenance_interval_ms, 1, "must be positive"),
        ];
        for (setting, value, least, reason) in checks {
            if value < least {
                return Err(ConfigError::Invalid { setting, value: value.to_string(), reason });
            }
        }
        Ok(())
    }

    /// Versions a store may be behind before it counts as lagging.
    fn version_lag_threshold(&self) -> i128 {
        i128::from(self.multiplier_for_min_version_diff_to_log)
            * i128::from(self.min_deltas_for_snapshot)
    }

    /// Milliseconds a store's last upload may be old before it counts as lagging.
    fn time_lag_threshold_ms(&self) -> i128 {
        i128::from(self.multiplier_for_min_time_diff_to_log)
            * i128::from(self.maintenance_interval_ms)
    }
}

/// Bad input to the coordinator. Each variant carries the offending values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateStoreError {
    /// A store id with an empty checkpoint location or store name, or a negative operator or
    /// partition.
    #[error("malformed state store id {store_id}: {reason}")]
    MalformedStoreId {
        /// The id as given.
        store_id: StateStoreId,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A location with an empty host or executor id.
    #[error(
        "malformed location (host {host:?}, executor id {executor_id:?}) reported for \
         {provider_id}: {reason}",
        host = location.host.as_str(),
        executor_id = location.executor_id.as_str()
    )]
    MalformedLocation {
        /// The provider it was reported for.
        provider_id: StateStoreProviderId,
        /// The location as given.
        location: ExecutorCacheTaskLocation,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A verification for an empty executor id.
    #[error("empty executor id in verification of {provider_id}")]
    EmptyExecutorId {
        /// The provider being verified.
        provider_id: StateStoreProviderId,
    },
    /// A snapshot upload with a negative version.
    #[error("negative snapshot version {version} reported for {provider_id}")]
    NegativeSnapshotVersion {
        /// The provider it was reported for.
        provider_id: StateStoreProviderId,
        /// The version given.
        version: i64,
    },
    /// A configuration value out of range.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Counts of what the coordinator handled, for observability. Each report, verification,
/// location query, deactivation, snapshot report and lag evaluation (including the testing
/// query's) increments its counter, and `rejected` as well when its input was bad; the
/// snapshot-version testing query, counter reads, configuration updates and the stop count
/// nowhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StateStoreCounters {
    /// Reports of an active instance (both forms).
    pub reports: u64,
    /// Reports that made a provider active for the first time in its run.
    pub new_instances: u64,
    /// Ids checked for unloading by the request-reply report form.
    pub checked_ids: u64,
    /// Malformed ids in such check lists, skipped (they can have no entry).
    pub malformed_checked_ids: u64,
    /// Verifications.
    pub verifies: u64,
    /// Location queries.
    pub location_queries: u64,
    /// Deactivations of a run.
    pub deactivations: u64,
    /// Providers removed by deactivations.
    pub deactivated_instances: u64,
    /// Snapshot upload reports.
    pub snapshot_reports: u64,
    /// Lag evaluations (reports and testing queries).
    pub lag_checks: u64,
    /// Full lag reports logged (rate limited).
    pub full_lag_reports: u64,
    /// Messages rejected for bad input.
    pub rejected: u64,
    /// Reports dropped because their run was deactivated earlier (module doc).
    pub reports_of_deactivated_runs: u64,
}

/// One lagging store, as named in a full lag report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaggingStore {
    /// The provider.
    pub provider_id: StateStoreProviderId,
    /// Its latest upload (`(0, 0)` if none).
    pub latest_snapshot: SnapshotUploadEvent,
    /// Versions behind the reference version.
    pub version_delta: i64,
    /// Milliseconds since its latest upload.
    pub time_delta_ms: i64,
}

/// What one [`StateStoreCoordinator::log_lagging_state_stores`] call found and logged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LagReport {
    /// How many stores of the run lag.
    pub lagging_count: usize,
    /// The most-lagging stores named in a full report (empty when none was due).
    pub full_report: Vec<LaggingStore>,
}

/// The state of one query run.
#[derive(Debug, Default)]
struct RunState {
    /// Where each active provider of the run is loaded.
    instances: InstanceTable,
    /// The latest upload of each provider of the run that reported one.
    snapshots: FxHashMap<StateStoreId, SnapshotUploadEvent>,
    /// When the last full lag report of this run was logged (0: never).
    last_full_lag_report_ms: i64,
}

/// The coordinator as a plain state machine: no I/O, no threads, no locks. Drive it directly,
/// or host it on the bus with
/// [`StateStoreCoordinatorEndpoint`](super::StateStoreCoordinatorEndpoint).
///
/// ```
/// use coordbus::coordinators::state_store::*;
/// use uuid::Uuid;
///
/// let mut coordinator = StateStoreCoordinator::new(StateStoreCoordinatorConfig::default())?;
/// let id = StateStoreProviderId::new(StateStoreId::new("/chk", 0, 0), Uuid::new_v4());
/// coordinator.report_active_instance(id, ExecutorCacheTaskLocation::new("hostX", "exec1"))?;
/// assert!(coordinator.verify_if_instance_active(id, "exec1".into())?);
/// assert_eq!(coordinator.get_location(id)?.as_deref(), Some("executor_hostX_exec1"));
/// coordinator.deactivate_instances(id.query_run_id);
/// assert_eq!(coordinator.get_location(id)?, None);
/// # Ok::<(), StateStoreError>(())
/// ```
#[derive(Debug)]
pub struct StateStoreCoordinator<C: Clock = SystemClock> {
    config: StateStoreCoordinatorConfig,
    clock: C,
    runs: FxHashMap<u128, RunState>,
    deactivated: DeactivatedRuns,
    counters: StateStoreCounters,
}

/// How many deactivated run ids a coordinator remembers, to drop late reports of those runs
/// (module doc).
pub const DEACTIVATED_RUNS_REMEMBERED: usize = 4096;

/// The last [`DEACTIVATED_RUNS_REMEMBERED`] deactivated run ids, oldest first.
#[derive(Debug, Default)]
struct DeactivatedRuns {
    order: VecDeque<u128>,
    set: FxHashSet<u128>,
}

impl DeactivatedRuns {
    fn remember(&mut self, run: u128) {
        if !self.set.insert(run) {
            return;
        }
        if self.order.len() == DEACTIVATED_RUNS_REMEMBERED {
            if let Some(oldest) = self.order.pop_front() {
                self.set.remove(&oldest);
            }
        }
        self.order.push_back(run);
    }

    fn contains(&self, run: u128) -> bool {
        self.set.contains(&run)
    }
}

impl StateStoreCoordinator<SystemClock> {
    /// A coordinator on the system clock.
    ///
    /// # Errors
    /// [`StateStoreError::Config`] if `config` is invalid.
    pub fn new(config: StateStoreCoordinatorConfig) -> Result<Self, StateStoreError> {
        Self::with_clock(config, SystemClock)
    }
}

impl<C: Clock> StateStoreCoordinator<C> {
    /// A coordinator reading time from `clock`.
    ///
    /// # Errors
    /// [`StateStoreError::Config`] if `config` is invalid.
    pub fn with_clock(
        config: StateStoreCoordinatorConfig,
        clock: C,
    ) -> Result<Self, StateStoreError> {
        config.validate()?;
        Ok(Self {
            config,
            clock,
            runs: FxHashMap::default(),
            deactivated: DeactivatedRuns::default(),
            counters: StateStoreCounters::default(),
        })
    }

    /// A coordinator with the default settings, reading time from `clock`.
    pub fn with_default_config(clock: C) -> Self {
        Self {
            config: StateStoreCoordinatorConfig::default(),
            clock,
            runs: FxHashMap::default(),
            deactivated: DeactivatedRuns::default(),
            counters: StateStoreCounters::default(),
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &StateStoreCoordinatorConfig {
        &self.config
    }

    /// Replaces the settings; they apply from the next evaluation on (as Spark reads its
    /// session settings at each evaluation).
    ///
    /// # Errors
    /// [`StateStoreError::Config`] if `config` is invalid; the old settings stay.
    pub fn set_config(
        &mut self,
        config: StateStoreCoordinatorConfig,
    ) -> Result<(), StateStoreError> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// What was handled so far.
    pub fn counters(&self) -> StateStoreCounters {
        self.counters
    }

    /// Number of active providers over all runs.
    pub fn active_instance_count(&self) -> usize {
        self.runs.values().map(|run| run.instances.len()).sum()
    }

    /// Number of runs with any state.
    pub fn run_count(&self) -> usize {
        self.runs.len()
    }

    fn reject<T>(&mut self, error: StateStoreError) -> Result<T, StateStoreError> {
        self.counters.rejected += 1;
        Err(error)
    }

    fn check_store_id(&mut self, store_id: StateStoreId) -> Result<(), StateStoreError> {
        match store_id.malformation() {
            None => Ok(()),
            Some(reason) => self.reject(StateStoreError::MalformedStoreId { store_id, reason }),
        }
    }

    /// Records that `provider_id` is loaded at `location`, replacing any earlier owner (the
    /// one-way report of Spark <= 3.x). `Ok(false)`: dropped (counted and logged), because the
    /// provider's query run was deactivated earlier.
    ///
    /// # Errors
    /// [`StateStoreError::MalformedStoreId`] or [`StateStoreError::MalformedLocation`]; nothing
    /// changes then.
    #[inline]
    pub fn report_active_instance(
        &mut self,
        provider_id: StateStoreProviderId,
        location: ExecutorCacheTaskLocation,
    ) -> Result<bool, StateStoreError> {
        self.counters.reports += 1;
        self.check_report(provider_id, location)?;
        Ok(self.insert_instance(provider_id, location))
    }

    /// The report of Spark 4.x: records `provider_id` at `location` like
    /// [`report_active_instance`](Self::report_active_instance), then returns, in input order,
    /// the ids of `provider_ids_to_check` (other providers loaded on the reporting executor)
    /// that are active at another location: the executor should unload them. Ids with no
    /// active entry are not returned; a malformed id in the list can have none, so it is not
    /// returned either (counted in [`StateStoreCounters::malformed_checked_ids`] and logged):
    /// the report itself still counts (SPEC C.4: its effect does not depend on the list).
    ///
    /// # Errors
    /// As [`report_active_instance`](Self::report_active_instance).
    pub fn report_active_instance_and_check(
        &mut self,
        provider_id: StateStoreProviderId,
        location: ExecutorCacheTaskLocation,
        provider_ids_to_check: &[StateStoreProviderId],
    ) -> Result<Vec<StateStoreProviderId>, StateStoreError> {
        self.counters.reports += 1;
        self.check_report(provider_id, location)?;
        self.insert_instance(provider_id, location);
        self.counters.checked_ids += provider_ids_to_check.len() as u64;
        let mut to_unload = Vec::new();
        for id in provider_ids_to_check {
            if let Some(reason) = id.store_id.malformation() {
                self.skip_malformed_checked_id(*id, reason);
            } else if self.location(*id).is_some_and(|active| active != location) {
                to_unload.push(*id);
            }
        }
        Ok(to_unload)
    }

    #[cold]
    fn skip_malformed_checked_id(&mut self, id: StateStoreProviderId, reason: &'static str) {
        self.counters.malformed_checked_ids += 1;
        let count = self.counters.malformed_checked_ids;
        if count.is_power_of_two() {
            tracing::warn!(%id, reason, count, "malformed state store id in a check list skipped");
        } else {
            tracing::debug!(%id, reason, count, "malformed state store id in a check list skipped");
        }
    }

    #[inline]
    fn check_report(
        &mut self,
        provider_id: StateStoreProviderId,
        location: ExecutorCacheTaskLocation,
    ) -> Result<(), StateStoreError> {
        self.check_store_id(provider_id.store_id)?;
        match location.malformation() {
            None => Ok(()),
            Some(reason) => {
                self.reject(StateStoreError::MalformedLocation { provider_id, location, reason })
            }
        }
    }

    /// Whether the report was applied (not dropped as one of a deactivated run).
    #[inline]
    fn insert_instance(
        &mut self,
        provider_id: StateStoreProviderId,
        location: ExecutorCacheTaskLocation,
    ) -> bool {
        let Some(run) = self.run_for_report(provider_id) else {
            return false;
        };
        if run.instances.insert(provider_id.store_id, location).is_none() {
            self.counters.new_instances += 1;
            tracing::debug!(%provider_id, %location, "state store provider active");
        }
        true
    }

    /// The state of `provider_id`'s run, created on its first report; `None` (counted and
    /// logged) if that run was deactivated earlier.
    #[inline]
    fn run_for_report(&mut self, provider_id: StateStoreProviderId) -> Option<&mut RunState> {
        let run = provider_id.query_run_id.as_u128();
        match self.runs.entry(run) {
            std::collections::hash_map::Entry::Occupied(state) => Some(state.into_mut()),
            std::collections::hash_map::Entry::Vacant(slot) => {
                if self.deactivated.contains(run) {
                    self.counters.reports_of_deactivated_runs += 1;
                    let dropped = self.counters.reports_of_deactivated_runs;
                    if dropped.is_power_of_two() {
                        tracing::warn!(
                            %provider_id,
                            dropped,
                            "report of a deactivated query run dropped"
                        );
                    }
                    return None;
                }
                Some(slot.insert(RunState::default()))
            }
        }
    }

    /// Where `provider_id` is active, if anywhere (no counting, no validation).
    #[inline]
    pub fn location(&self, provider_id: StateStoreProviderId) -> Option<ExecutorCacheTaskLocation> {
        self.runs.get(&provider_id.query_run_id.as_u128())?.instances.get(&provider_id.store_id)
    }

    /// Whether `provider_id` is active on the executor `executor_id` (the host is not compared,
    /// as in Spark).
    ///
    /// # Errors
    /// [`StateStoreError::MalformedStoreId`], [`StateStoreError::EmptyExecutorId`].
    #[inline]
    pub fn verify_if_instance_active(
        &mut self,
        provider_id: StateStoreProviderId,
        executor_id: super::Name,
    ) -> Result<bool, StateStoreError> {
        self.counters.verifies += 1;
        self.check_store_id(provider_id.store_id)?;
        if executor_id.is_empty() {
            return self.reject(StateStoreError::EmptyExecutorId { provider_id });
        }
        let active =
            self.location(provider_id).is_some_and(|location| location.executor_id == executor_id);
        tracing::debug!(%provider_id, %executor_id, active, "verified state store instance");
        Ok(active)
    }

    /// The string form of where `provider_id` is active (`executor_<host>_<executorId>`), or
    /// `None`.
    ///
    /// # Errors
    /// [`StateStoreError::MalformedStoreId`].
    pub fn get_location(
        &mut self,
        provider_id: StateStoreProviderId,
    ) -> Result<Option<String>, StateStoreError> {
        self.counters.location_queries += 1;
        self.check_store_id(provider_id.store_id)?;
        Ok(self.location(provider_id).map(|location| location.to_string()))
    }

    /// Forgets every provider of run `query_run_id`: active instances, snapshot records and
    /// the time of its last full lag report. Costs only the freeing of that run's maps.
    /// Returns how many active instances were removed.
    pub fn deactivate_instances(&mut self, query_run_id: Uuid) -> usize {
        self.counters.deactivations += 1;
        self.deactivated.remember(query_run_id.as_u128());
        let removed =
            self.runs.remove(&query_run_id.as_u128()).map_or(0, |run| run.instances.len());
        self.counters.deactivated_instances += removed as u64;
        tracing::debug!(%query_run_id, removed, "state store run deactivated");
        removed
    }

    /// Records that `provider_id` uploaded snapshot `version` at `timestamp_ms`, unless a
    /// version at least as new is recorded already (an older or equal version never
    /// overwrites). The provider need not be active.
    ///
    /// # Errors
    /// [`StateStoreError::MalformedStoreId`], [`StateStoreError::NegativeSnapshotVersion`].
    pub fn report_snapshot_uploaded(
        &mut self,
        provider_id: StateStoreProviderId,
        version: i64,
        timestamp_ms: i64,
    ) -> Result<(), StateStoreError> {
        self.counters.snapshot_reports += 1;
        self.check_store_id(provider_id.store_id)?;
        if version < 0 {
            return self.reject(StateStoreError::NegativeSnapshotVersion { provider_id, version });
        }
        let Some(run) = self.run_for_report(provider_id) else {
            return Ok(());
        };
        let event = SnapshotUploadEvent::new(version, timestamp_ms);
        run.snapshots
            .entry(provider_id.store_id)
            .and_modify(|latest| {
                if latest.version < version {
                    *latest = event;
                }
            })
            .or_insert(event);
        Ok(())
    }

    /// The latest recorded snapshot version of `provider_id`.
    pub fn get_latest_snapshot_version_for_testing(
        &self,
        provider_id: StateStoreProviderId,
    ) -> Option<i64> {
        self.runs
            .get(&provider_id.query_run_id.as_u128())?
            .snapshots
            .get(&provider_id.store_id)
            .map(|event| event.version)
    }

    /// The active providers of run `query_run_id` that lag behind `latest_version` (SPEC C.4,
    /// `findLagging`), most lagging first (ascending by latest upload, then by id). Empty when
    /// reporting is off.
    pub fn get_lagging_stores_for_testing(
        &mut self,
        query_run_id: Uuid,
        latest_version: i64,
        is_terminating_trigger: bool,
    ) -> Vec<StateStoreProviderId> {
        self.counters.lag_checks += 1;
        if !self.config.report_snapshot_upload_lag {
            return Vec::new();
        }
        let now_ms = self.clock.now_ms();
        self.find_lagging(query_run_id, latest_version, now_ms, is_terminating_trigger)
            .into_iter()
            .map(|store| store.provider_id)
            .collect()
    }

    /// Logs the lagging stores of run `query_run_id` relative to `latest_version`: a warning
    /// with their count whenever there are any, and, at most once per
    /// `snapshot_lag_report_interval_ms` per run, one warning per store for the
    /// `max_lagging_stores_to_report` most-lagging ones. Does nothing when reporting is off.
    pub fn log_lagging_state_stores(
        &mut self,
        query_run_id: Uuid,
        latest_version: i64,
        is_terminating_trigger: bool,
    ) -> LagReport {
        self.counters.lag_checks += 1;
        if !self.config.report_snapshot_upload_lag {
            return LagReport::default();
        }
        let now_ms = self.clock.now_ms();
        let lagging =
            self.find_lagging(query_run_id, latest_version, now_ms, is_terminating_trigger);
        if lagging.is_empty() {
            return LagReport::default();
        }
        tracing::warn!(
            %query_run_id,
            latest_version,
            lagging = lagging.len(),
            "state stores are lagging behind in snapshot uploads"
        );
        let mut report = LagReport { lagging_count: lagging.len(), full_report: Vec::new() };
        let Some(run) = self.runs.get_mut(&query_run_id.as_u128()) else {
            return report;
        };
        if i128::from(now_ms) - i128::from(run.last_full_lag_report_ms)
            > i128::from(self.config.snapshot_lag_report_interval_ms)
        {
            run.last_full_lag_report_ms = now_ms;
            self.counters.full_lag_reports += 1;
            report.full_report =
                lagging.into_iter().take(self.config.max_lagging_stores_to_report).collect();
            for store in &report.full_report {
                tracing::warn!(
                    provider_id = %store.provider_id,
                    latest_snapshot_version = store.latest_snapshot.version,
                    latest_snapshot_timestamp_ms = store.latest_snapshot.timestamp_ms,
                    version_delta = store.version_delta,
                    time_delta_ms = store.time_delta_ms,
                    "state store lagging in snapshot uploads"
                );
            }
        }
        report
    }

    /// `findLagging` of SPEC C.4, sorted most lagging first. Differences are computed in i128,
    /// so extreme versions or times cannot overflow.
    fn find_lagging(
        &self,
        query_run_id: Uuid,
        reference_version: i64,
        now_ms: i64,
        is_terminating_trigger: bool,
    ) -> Vec<LaggingStore> {
        let Some(run) = self.runs.get(&query_run_id.as_u128()) else {
            return Vec::new();
        };
        let version_threshold = self.config.version_lag_threshold();
        let time_threshold_ms = self.config.time_lag_threshold_ms();
        let mut lagging: Vec<LaggingStore> = run
            .instances
            .iter()
            .filter_map(|(store_id, _)| {
                let latest = run.snapshots.get(&store_id).copied().unwrap_or_default();
                let version_delta = i128::from(reference_version) - i128::from(latest.version);
                let time_delta_ms = i128::from(now_ms) - i128::from(latest.timestamp_ms);
                let behind_versions = version_delta > version_threshold;
                let behind_time = time_delta_ms > time_threshold_ms;
                (behind_versions && (is_terminating_trigger || behind_time)).then(|| LaggingStore {
                    provider_id: StateStoreProviderId::new(store_id, query_run_id),
                    latest_snapshot: latest,
                    version_delta: saturate(version_delta),
                    time_delta_ms: saturate(time_delta_ms),
                })
            })
            .collect();
        lagging.sort_unstable_by_key(|store| (store.latest_snapshot, store.provider_id));
        lagging
    }
}

fn saturate(value: i128) -> i64 {
    i64::try_from(value).unwrap_or(if value < 0 { i64::MIN } else { i64::MAX })
}
