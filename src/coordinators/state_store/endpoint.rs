//! The coordinator hosted on the bus: its messages, its endpoint and a typed reference.
//!
//! Every message, the reads included, is handled on the endpoint thread, one at a time, by the
//! state machine. Read-your-writes for one sender follows from the bus's per-sender FIFO (SPEC
//! A.4, 0.2): a thread's one-way [`ReportActiveInstance`] and its later
//! [`VerifyIfInstanceActive`] or [`GetLocation`] travel the same ordered inbox lane, so the
//! report has been applied when the read is handled. Reads are not served off the endpoint
//! thread (for example from a concurrent map), because that would break exactly this: a read
//! could overtake the sender's own report still queued in the inbox.

use std::sync::Arc;

use uuid::Uuid;

use super::{
    ids::{ExecutorCacheTaskLocation, Name, StateStoreProviderId},
    machine::{
        LagReport, StateStoreCoordinator, StateStoreCoordinatorConfig, StateStoreCounters,
        StateStoreError,
    },
};
use crate::{
    clock::{Clock, SystemClock},
    error::{AskError, BusError, HandlerError, SendError},
    runtime::{Ask, Bus, Context, Endpoint, EndpointRef, Replier},
};

/// The name the coordinator is registered under (one per bus, SPEC A.1).
pub const STATE_STORE_COORDINATOR_NAME: &str = "StateStoreCoordinator";

/// One-way report that `provider_id` is loaded at `location` (Spark <= 3.x). Bad input is
/// counted as rejected and logged by the bus's error hook (a warning at the 1st, 2nd, 4th, ...
/// rejection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportActiveInstance {
    /// The provider.
    pub provider_id: StateStoreProviderId,
    /// Where it is loaded.
    pub location: ExecutorCacheTaskLocation,
}

/// Request-reply report of Spark 4.x; replies with the ids of `provider_ids_to_check` that are
/// active elsewhere (to unload), in input order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportActiveInstanceAndCheck {
    /// The provider.
    pub provider_id: StateStoreProviderId,
    /// Where it is loaded.
    pub location: ExecutorCacheTaskLocation,
    /// Other providers loaded on the reporting executor.
    pub provider_ids_to_check: Vec<StateStoreProviderId>,
}

/// Whether `provider_id` is active on executor `executor_id`; replies `bool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyIfInstanceActive {
    /// The provider.
    pub provider_id: StateStoreProviderId,
    /// The executor to compare with (the host is not compared).
    pub executor_id: Name,
}

/// Where `provider_id` is active; replies `Some("executor_<host>_<executorId>")` or `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetLocation {
    /// The provider.
    pub provider_id: StateStoreProviderId,
}

/// Forgets every provider of a query run; replies `true`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeactivateInstances {
    /// The run.
    pub query_run_id: Uuid,
}

/// Records a snapshot upload (older or equal versions never overwrite); replies `true`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportSnapshotUploaded {
    /// The provider.
    pub provider_id: StateStoreProviderId,
    /// The uploaded version.
    pub version: i64,
    /// When it was uploaded (ms since the Unix epoch).
    pub timestamp_ms: i64,
}

/// Logs the run's lagging stores (rate-limited full report); replies `true`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLaggingStateStores {
    /// The run.
    pub query_run_id: Uuid,
    /// The reference version (the run's latest committed version).
    pub latest_version: i64,
    /// Whether the trigger is the last one (the time condition is then waived).
    pub is_terminating_trigger: bool,
}

/// The latest recorded snapshot version of a provider; replies `Option<i64>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetLatestSnapshotVersionForTesting {
    /// The provider.
    pub provider_id: StateStoreProviderId,
}

/// The lagging providers of a run, most lagging first; replies `Vec<StateStoreProviderId>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetLaggingStoresForTesting {
    /// The run.
    pub query_run_id: Uuid,
    /// The reference version.
    pub latest_version: i64,
    /// Whether the trigger is the last one.
    pub is_terminating_trigger: bool,
}

/// The coordinator's counters; replies [`StateStoreCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetCounters;

/// Replaces the settings (validated); replies `true`, or fails with
/// [`StateStoreError::Config`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateConfig(pub StateStoreCoordinatorConfig);

/// Stops the coordinator: the name is deregistered first, then the reply (`true`) is sent, so
/// the name is free when the ask returns. Later messages get the bus's `Stopped` error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopCoordinator;

/// The requests of the coordinator, each with its typed replier. Built by the [`Ask`] impls of
/// the request structs; users rarely name it. The rare large requests are boxed so that every
/// inbox slot stays small (at most 88 bytes: 80 for the request, and its reply slot's
/// address, which the bus carries with it).
#[derive(Debug)]
#[non_exhaustive]
pub enum StateStoreRequest {
    /// See [`ReportActiveInstanceAndCheck`].
    ReportActiveInstanceAndCheck(
        Box<ReportActiveInstanceAndCheck>,
        Replier<Vec<StateStoreProviderId>>,
    ),
    /// See [`VerifyIfInstanceActive`].
    VerifyIfInstanceActive(VerifyIfInstanceActive, Replier<bool>),
    /// See [`GetLocation`].
    GetLocation(GetLocation, Replier<Option<String>>),
    /// See [`DeactivateInstances`].
    DeactivateInstances(DeactivateInstances, Replier<bool>),
    /// See [`ReportSnapshotUploaded`].
    ReportSnapshotUploaded(ReportSnapshotUploaded, Replier<bool>),
    /// See [`LogLaggingStateStores`].
    LogLaggingStateStores(LogLaggingStateStores, Replier<bool>),
    /// See [`GetLatestSnapshotVersionForTesting`].
    GetLatestSnapshotVersionForTesting(GetLatestSnapshotVersionForTesting, Replier<Option<i64>>),
    /// See [`GetLaggingStoresForTesting`].
    GetLaggingStoresForTesting(GetLaggingStoresForTesting, Replier<Vec<StateStoreProviderId>>),
    /// See [`GetCounters`].
    GetCounters(Replier<StateStoreCounters>),
    /// See [`UpdateConfig`].
    UpdateConfig(Box<UpdateConfig>, Replier<bool>),
    /// See [`StopCoordinator`].
    StopCoordinator(Replier<bool>),
}

macro_rules! ask_impl {
    ($request:ident, $reply:ty, |$value:ident, $replier:ident| $build:expr) => {
        impl Ask<StateStoreCoordinatorEndpoint> for $request {
            type Reply = $reply;
            fn into_request(self, replier: Replier<$reply>) -> StateStoreRequest {
                let ($value, $replier) = (self, replier);
                $build
            }
        }
    };
}

ask_impl!(ReportActiveInstanceAndCheck, Vec<StateStoreProviderId>, |request, replier| {
    StateStoreRequest::ReportActiveInstanceAndCheck(Box::new(request), replier)
});
ask_impl!(VerifyIfInstanceActive, bool, |request, replier| {
    StateStoreRequest::VerifyIfInstanceActive(request, replier)
});
ask_impl!(GetLocation, Option<String>, |request, replier| {
    StateStoreRequest::GetLocation(request, replier)
});
ask_impl!(DeactivateInstances, bool, |request, replier| {
    StateStoreRequest::DeactivateInstances(request, replier)
});
ask_impl!(ReportSnapshotUploaded, bool, |request, replier| {
    StateStoreRequest::ReportSnapshotUploaded(request, replier)
});
ask_impl!(LogLaggingStateStores, bool, |request, replier| {
    StateStoreRequest::LogLaggingStateStores(request, replier)
});
ask_impl!(GetLatestSnapshotVersionForTesting, Option<i64>, |request, replier| {
    StateStoreRequest::GetLatestSnapshotVersionForTesting(request, replier)
});
ask_impl!(GetLaggingStoresForTesting, Vec<StateStoreProviderId>, |request, replier| {
    StateStoreRequest::GetLaggingStoresForTesting(request, replier)
});
ask_impl!(GetCounters, StateStoreCounters, |_request, replier| {
    StateStoreRequest::GetCounters(replier)
});
ask_impl!(UpdateConfig, bool, |request, replier| {
    StateStoreRequest::UpdateConfig(Box::new(request), replier)
});
ask_impl!(StopCoordinator, bool, |_request, replier| {
    StateStoreRequest::StopCoordinator(replier)
});

/// Answers `replier` with `outcome`: the value, or the typed error as the handler failure (the
/// asker sees [`AskError::Handler`] whose source downcasts to [`StateStoreError`]).
fn answer<T: Send + 'static>(replier: Replier<T>, outcome: Result<T, StateStoreError>) {
    match outcome {
        Ok(value) => replier.reply(value),
        Err(error) => {
            tracing::debug!(%error, "state store coordinator rejected a request");
            replier.fail(error);
        }
    }
}

/// The coordinator as a bus endpoint. The clock is shared (`Arc<dyn Clock>`) so that every
/// coordinator has the same endpoint type and can be looked up by name whatever its clock.
pub struct StateStoreCoordinatorEndpoint {
    coordinator: StateStoreCoordinator<Arc<dyn Clock>>,
    /// One-way reports rejected (the coordinator's `rejected` counts asks too): the warning
    /// cadence of `on_error`.
    rejected_reports: u64,
}

impl std::fmt::Debug for StateStoreCoordinatorEndpoint {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("StateStoreCoordinatorEndpoint")
            .field("runs", &self.coordinator.run_count())
            .field("counters", &self.coordinator.counters())
            .finish()
    }
}

impl Default for StateStoreCoordinatorEndpoint {
    /// An endpoint with the default settings, on the system clock.
    fn default() -> Self {
        Self {
            coordinator: StateStoreCoordinator::with_default_config(Arc::new(SystemClock)),
            rejected_reports: 0,
        }
    }
}

impl StateStoreCoordinatorEndpoint {
    /// An endpoint with `config`, on the system clock.
    ///
    /// # Errors
    /// [`StateStoreError::Config`] if `config` is invalid.
    pub fn new(config: StateStoreCoordinatorConfig) -> Result<Self, StateStoreError> {
        Self::with_clock(config, Arc::new(SystemClock))
    }

    /// An endpoint with `config`, reading time from `clock`.
    ///
    /// # Errors
    /// [`StateStoreError::Config`] if `config` is invalid.
    pub fn with_clock(
        config: StateStoreCoordinatorConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StateStoreError> {
        Ok(Self {
            coordinator: StateStoreCoordinator::with_clock(config, clock)?,
            rejected_reports: 0,
        })
    }

    /// The state machine inside.
    pub fn coordinator(&self) -> &StateStoreCoordinator<Arc<dyn Clock>> {
        &self.coordinator
    }
}

impl Endpoint for StateStoreCoordinatorEndpoint {
    type Message = ReportActiveInstance;
    type Request = StateStoreRequest;

    fn on_start(&mut self, context: &Context<Self>) {
        tracing::info!(endpoint = context.name(), "state store coordinator started");
    }

    #[inline]
    fn handle(
        &mut self,
        message: ReportActiveInstance,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        match self.coordinator.report_active_instance(message.provider_id, message.location) {
            Ok(true) => Ok(()),
            Ok(false) => {
                context.record_dropped("report of a deactivated run");
                Ok(())
            }
            Err(error) => {
                context.record_dropped("invalid report");
                Err(error.into())
            }
        }
    }

    fn handle_request(
        &mut self,
        request: StateStoreRequest,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        let coordinator = &mut self.coordinator;
        match request {
            StateStoreRequest::ReportActiveInstanceAndCheck(request, replier) => answer(
                replier,
                coordinator.report_active_instance_and_check(
                    request.provider_id,
                    request.location,
                    &request.provider_ids_to_check,
                ),
            ),
            StateStoreRequest::VerifyIfInstanceActive(request, replier) => answer(
                replier,
                coordinator.verify_if_instance_active(request.provider_id, request.executor_id),
            ),
            StateStoreRequest::GetLocation(request, replier) => {
                answer(replier, coordinator.get_location(request.provider_id));
            }
            StateStoreRequest::DeactivateInstances(request, replier) => {
                coordinator.deactivate_instances(request.query_run_id);
                replier.reply(true);
            }
            StateStoreRequest::ReportSnapshotUploaded(request, replier) => answer(
                replier,
                coordinator
                    .report_snapshot_uploaded(
                        request.provider_id,
                        request.version,
                        request.timestamp_ms,
                    )
                    .map(|()| true),
            ),
            StateStoreRequest::LogLaggingStateStores(request, replier) => {
                let _: LagReport = coordinator.log_lagging_state_stores(
                    request.query_run_id,
                    request.latest_version,
                    request.is_terminating_trigger,
                );
                replier.reply(true);
            }
            StateStoreRequest::GetLatestSnapshotVersionForTesting(request, replier) => {
                replier.reply(
                    coordinator.get_latest_snapshot_version_for_testing(request.provider_id),
                );
            }
            StateStoreRequest::GetLaggingStoresForTesting(request, replier) => {
                replier.reply(coordinator.get_lagging_stores_for_testing(
                    request.query_run_id,
                    request.latest_version,
                    request.is_terminating_trigger,
                ));
            }
            StateStoreRequest::GetCounters(replier) => replier.reply(coordinator.counters()),
            StateStoreRequest::UpdateConfig(request, replier) => {
                let UpdateConfig(config) = *request;
                answer(replier, coordinator.set_config(config).map(|()| true));
            }
            StateStoreRequest::StopCoordinator(replier) => {
                // Deregister before replying: when the asker's wait returns, the name is free.
                context.stop();
                tracing::info!(endpoint = context.name(), "state store coordinator stopped");
                replier.reply(true);
            }
        }
        Ok(())
    }

    fn on_error(&mut self, error: &HandlerError) {
        if let Some(panic @ AskError::HandlerPanicked { .. }) = error.downcast_ref::<AskError>() {
            // The runtime already logged the panic as an error; it is no rejected report.
            tracing::debug!(%panic, "state store coordinator's handler panicked");
            return;
        }
        // Logged at the 1st, 2nd, 4th, ... rejected report, so a flood of bad reports logs
        // O(log n) (a rejected ask is the asker's error, not counted here).
        self.rejected_reports += 1;
        let rejected = self.rejected_reports;
        if rejected.is_power_of_two() {
            tracing::warn!(%error, rejected, "state store coordinator rejected a one-way report");
        } else {
            tracing::debug!(%error, rejected, "state store coordinator rejected a one-way report");
        }
    }
}

/// A typed reference to the coordinator with one method per message (Spark's
/// `StateStoreCoordinatorRef`). Cheap to clone; share it between threads.
///
/// ```
/// use coordbus::{Bus, coordinators::state_store::*};
/// use uuid::Uuid;
///
/// let bus = Bus::builder().inbox_shards(2).build()?;
/// let driver = StateStoreCoordinatorRef::for_driver(&bus)?;
/// let executor = StateStoreCoordinatorRef::for_executor(&bus)?;
/// let id = StateStoreProviderId::new(StateStoreId::new("/chk", 0, 0), Uuid::new_v4());
/// executor.report_active_instance(id, ExecutorCacheTaskLocation::new("hostX", "exec1"))?;
/// // The same thread's ask is handled after its one-way report.
/// assert!(executor.verify_if_instance_active(id, "exec1")?);
/// assert_eq!(driver.get_location(id)?.as_deref(), Some("executor_hostX_exec1"));
/// assert!(driver.stop_coordinator()?);
/// bus.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct StateStoreCoordinatorRef {
    endpoint: EndpointRef<StateStoreCoordinatorEndpoint>,
}

impl StateStoreCoordinatorRef {
    /// Registers a coordinator with the default settings under
    /// [`STATE_STORE_COORDINATOR_NAME`], or, if one is registered already, returns a reference
    /// to it (SPEC C.5): all driver-side references reach one coordinator.
    ///
    /// # Errors
    /// [`BusError`] from registration or lookup (for example a shut-down bus, or another
    /// endpoint type under the name).
    pub fn for_driver(bus: &Bus) -> Result<Self, BusError> {
        Self::for_driver_with(bus, StateStoreCoordinatorEndpoint::default)
    }

    /// As [`for_driver`](Self::for_driver), registering `make()` if no coordinator is
    /// registered yet.
    ///
    /// # Errors
    /// As [`for_driver`](Self::for_driver).
    pub fn for_driver_with(
        bus: &Bus,
        make: impl FnOnce() -> StateStoreCoordinatorEndpoint,
    ) -> Result<Self, BusError> {
        Ok(Self { endpoint: bus.register_or_lookup(STATE_STORE_COORDINATOR_NAME, make)? })
    }

    /// A reference to the registered coordinator (the executor side).
    ///
    /// # Errors
    /// [`BusError::NotFound`] if no coordinator is registered.
    pub fn for_executor(bus: &Bus) -> Result<Self, BusError> {
        Ok(Self { endpoint: bus.lookup(STATE_STORE_COORDINATOR_NAME)? })
    }

    /// The bus reference, for `ask`, `send_batch`, `try_send` and the endpoint's statistics.
    pub fn endpoint(&self) -> &EndpointRef<StateStoreCoordinatorEndpoint> {
        &self.endpoint
    }

    /// Whether two references reach the same coordinator.
    pub fn same_coordinator(&self, other: &Self) -> bool {
        self.endpoint.same_endpoint(&other.endpoint)
    }

    /// One-way report that `provider_id` is loaded at `location`.
    ///
    /// # Errors
    /// [`SendError::Stopped`] once the coordinator is stopped. While its inbox is full the
    /// call waits for room, as [`EndpointRef::send`](crate::EndpointRef::send) does: called
    /// from an endpoint's thread it waits at most the bus's `ask_timeout`
    /// ([`SendError::Timeout`]), and from the coordinator's own handler it does not wait
    /// ([`SendError::Full`]).
    #[inline]
    pub fn report_active_instance(
        &self,
        provider_id: StateStoreProviderId,
        location: ExecutorCacheTaskLocation,
    ) -> Result<(), SendError<ReportActiveInstance>> {
        self.endpoint.send(ReportActiveInstance { provider_id, location })
    }

    /// Request-reply report; returns the ids of `provider_ids_to_check` to unload.
    ///
    /// # Errors
    /// Any [`AskError`] (the call waits for its reply up to the bus's `ask_timeout`); bad
    /// input gives [`AskError::Handler`] with a [`StateStoreError`] source.
    pub fn report_active_instance_and_check(
        &self,
        provider_id: StateStoreProviderId,
        location: ExecutorCacheTaskLocation,
        provider_ids_to_check: Vec<StateStoreProviderId>,
    ) -> Result<Vec<StateStoreProviderId>, AskError> {
        self.endpoint
            .ask(ReportActiveInstanceAndCheck { provider_id, location, provider_ids_to_check })
            .wait()
    }

    /// Whether `provider_id` is active on executor `executor_id`.
    ///
    /// # Errors
    /// As [`report_active_instance_and_check`](Self::report_active_instance_and_check).
    pub fn verify_if_instance_active(
        &self,
        provider_id: StateStoreProviderId,
        executor_id: impl Into<Name>,
    ) -> Result<bool, AskError> {
        self.endpoint
            .ask(VerifyIfInstanceActive { provider_id, executor_id: executor_id.into() })
            .wait()
    }

    /// The string form of where `provider_id` is active, if anywhere.
    ///
    /// # Errors
    /// As [`report_active_instance_and_check`](Self::report_active_instance_and_check).
    pub fn get_location(
        &self,
        provider_id: StateStoreProviderId,
    ) -> Result<Option<String>, AskError> {
        self.endpoint.ask(GetLocation { provider_id }).wait()
    }

    /// Forgets every provider of run `query_run_id`.
    ///
    /// # Errors
    /// Any [`AskError`] (the call waits for its reply up to the bus's `ask_timeout`), such as
    /// [`AskError::Stopped`] once the coordinator is stopped.
    pub fn deactivate_instances(&self, query_run_id: Uuid) -> Result<bool, AskError> {
        self.endpoint.ask(DeactivateInstances { query_run_id }).wait()
    }

    /// Records a snapshot upload.
    ///
    /// # Errors
    /// As [`report_active_instance_and_check`](Self::report_active_instance_and_check).
    pub fn report_snapshot_uploaded(
        &self,
        provider_id: StateStoreProviderId,
        version: i64,
        timestamp_ms: i64,
    ) -> Result<bool, AskError> {
        self.endpoint.ask(ReportSnapshotUploaded { provider_id, version, timestamp_ms }).wait()
    }

    /// Logs the lagging stores of run `query_run_id`.
    ///
    /// # Errors
    /// Any [`AskError`] (the call waits for its reply up to the bus's `ask_timeout`), such as
    /// [`AskError::Stopped`] once the coordinator is stopped.
    pub fn log_lagging_state_stores(
        &self,
        query_run_id: Uuid,
        latest_version: i64,
        is_terminating_trigger: bool,
    ) -> Result<bool, AskError> {
        self.endpoint
            .ask(LogLaggingStateStores { query_run_id, latest_version, is_terminating_trigger })
            .wait()
    }

    /// The latest recorded snapshot version of `provider_id`.
    ///
    /// # Errors
    /// Any [`AskError`] (the call waits for its reply up to the bus's `ask_timeout`), such as
    /// [`AskError::Stopped`] once the coordinator is stopped.
    pub fn get_latest_snapshot_version_for_testing(
        &self,
        provider_id: StateStoreProviderId,
    ) -> Result<Option<i64>, AskError> {
        self.endpoint.ask(GetLatestSnapshotVersionForTesting { provider_id }).wait()
    }

    /// The lagging providers of run `query_run_id`, most lagging first.
    ///
    /// # Errors
    /// Any [`AskError`] (the call waits for its reply up to the bus's `ask_timeout`), such as
    /// [`AskError::Stopped`] once the coordinator is stopped.
    pub fn get_lagging_stores_for_testing(
        &self,
        query_run_id: Uuid,
        latest_version: i64,
        is_terminating_trigger: bool,
    ) -> Result<Vec<StateStoreProviderId>, AskError> {
        self.endpoint
            .ask(GetLaggingStoresForTesting {
                query_run_id,
                latest_version,
                is_terminating_trigger,
            })
            .wait()
    }

    /// The coordinator's counters (reflecting every message this thread sent before).
    ///
    /// # Errors
    /// Any [`AskError`] (the call waits for its reply up to the bus's `ask_timeout`), such as
    /// [`AskError::Stopped`] once the coordinator is stopped.
    pub fn counters(&self) -> Result<StateStoreCounters, AskError> {
        self.endpoint.ask(GetCounters).wait()
    }

    /// Replaces the coordinator's settings.
    ///
    /// # Errors
    /// [`AskError::Handler`] with [`StateStoreError::Config`] for an invalid setting.
    pub fn update_config(&self, config: StateStoreCoordinatorConfig) -> Result<bool, AskError> {
        self.endpoint.ask(UpdateConfig(config)).wait()
    }

    /// Stops the coordinator; when this returns, the name is free.
    ///
    /// # Errors
    /// [`AskError::Stopped`] if it was stopped before this ask was queued (a stop queued
    /// behind another one is still handled, and also answers `true`).
    pub fn stop_coordinator(&self) -> Result<bool, AskError> {
        self.endpoint.ask(StopCoordinator).wait()
    }
}
