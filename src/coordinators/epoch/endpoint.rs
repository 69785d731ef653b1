//! [`EpochEndpoint`]: the epoch coordinator hosted on the bus, with its typed messages.
//!
//! The two one-way messages travel as one enum, [`EpochMessage`] (with `From` impls, so
//! `epoch.send(ReportPartitionOffset { .. })` works); each request is its own struct
//! implementing [`Ask`] with its own reply type. Field types are the wire types of SPEC B.4
//! (`i32` partition ids, `i64` epochs), so an engine passes its values through unchanged; the
//! state machine turns them into [`PartitionId`] and [`Epoch`].
//!
//! Dropped one-way messages are not handler errors (the sender of a one-way message learns
//! nothing, SPEC A.2): the state machine counts and logs them. Requests that fail (a negative
//! partition count, an epoch overflow) fail the asker with the [`EpochError`], as the source of
//! [`AskError::Handler`]: `error.handler_error::<EpochError>()` gives it back typed
//! ([`AskError::handler_error`]).

use super::{
    Epoch, EpochConfig, EpochCoordinator, EpochError, EpochStats, PartitionId, Payload, Query,
    Rejected, Sink,
};
use crate::{
    error::{ConfigError, HandlerError},
    Ask, AskError, Context, Endpoint, Replier,
};

/// The bus name of a coordinator for one run: `EpochCoordinator-<queryRunId>--<uuid>`, with a
/// fresh random UUID on every call, so tasks of an earlier run cannot reach a new coordinator
/// (SPEC A.1).
pub fn coordinator_name(query_run_id: &str) -> String {
    format!("EpochCoordinator-{query_run_id}--{}", uuid::Uuid::new_v4())
}

/// One-way: a writer partition finished `epoch` (SPEC B.4 `CommitPartitionEpoch`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPartitionEpoch {
    /// The writer partition id.
    pub partition: i32,
    /// The epoch it finished.
    pub epoch: i64,
    /// The writer's commit message, handed to the sink.
    pub message: Payload,
}

/// One-way: a reader partition reached the end of `epoch` at `offset` (SPEC B.4
/// `ReportPartitionOffset`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportPartitionOffset {
    /// The reader partition id.
    pub partition: i32,
    /// The epoch that ended.
    pub epoch: i64,
    /// The partition's end offset, handed to [`Query::add_offsets`].
    pub offset: Payload,
}

/// The one-way messages of the epoch coordinator, as they travel through the inbox.
///
/// Build one from [`CommitPartitionEpoch`] or [`ReportPartitionOffset`] with `into()` (or pass
/// those to `send`, which converts). The variants carry the fields themselves rather than
/// wrapping the two structs: wrapped, the enum's tag would need a word of its own (the structs'
/// padding is not usable), making the message 56 bytes with every field 8 bytes off the
/// 16-byte pieces the inbox copies a message in. Flat, the tag shares the first word with the
/// partition id, the message is 48 bytes (the bus envelope too), and the payload sits exactly in
/// the second and third 16-byte pieces: the endpoint reads each field back with one load the
/// CPU can forward from the copy's stores (a load straddling two stores waits until both reach
/// the cache). PERF.md, section "EpochCoordinator (issue 4)", has the measurement; the sizes
/// are checked at compile time below (the offsets within are the compiler's choice, measured).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EpochMessage {
    /// See [`CommitPartitionEpoch`].
    CommitPartitionEpoch {
        /// The writer partition id.
        partition: i32,
        /// The epoch it finished.
        epoch: i64,
        /// The writer's commit message.
        message: Payload,
    },
    /// See [`ReportPartitionOffset`].
    ReportPartitionOffset {
        /// The reader partition id.
        partition: i32,
        /// The epoch that ended.
        epoch: i64,
        /// The partition's end offset.
        offset: Payload,
    },
}

const _: () = assert!(std::mem::size_of::<EpochMessage>() == 48);

impl From<CommitPartitionEpoch> for EpochMessage {
    #[inline]
    fn from(CommitPartitionEpoch { partition, epoch, message }: CommitPartitionEpoch) -> Self {
        Self::CommitPartitionEpoch { partition, epoch, message }
    }
}

impl From<ReportPartitionOffset> for EpochMessage {
    #[inline]
    fn from(ReportPartitionOffset { partition, epoch, offset }: ReportPartitionOffset) -> Self {
        Self::ReportPartitionOffset { partition, epoch, offset }
    }
}

/// Request: the driver epoch (reply `i64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetCurrentEpoch;

/// Request: increment the driver epoch and return the new value (reply `i64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IncrementAndGetEpoch;

/// Request: set the reader partition count (reply `()`; fails for a negative count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetReaderPartitions(pub i32);

/// Request: set the writer partition count (reply `()`; fails for a negative count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetWriterPartitions(pub i32);

/// Request: drop every later one-way message (reply `()`; SPEC B.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopContinuousExecutionWrites;

/// Request (coordbus addition): a snapshot of the coordinator's state and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetEpochStats;

/// The requests of the epoch coordinator, each with its typed replier. Built by the [`Ask`]
/// impls of the request structs; engines do not build it by hand.
#[derive(Debug)]
#[non_exhaustive]
pub enum EpochRequest {
    /// [`GetCurrentEpoch`].
    GetCurrentEpoch(Replier<i64>),
    /// [`IncrementAndGetEpoch`].
    IncrementAndGetEpoch(Replier<i64>),
    /// [`SetReaderPartitions`].
    SetReaderPartitions(i32, Replier<()>),
    /// [`SetWriterPartitions`].
    SetWriterPartitions(i32, Replier<()>),
    /// [`StopContinuousExecutionWrites`].
    StopContinuousExecutionWrites(Replier<()>),
    /// [`GetEpochStats`].
    GetEpochStats(Replier<EpochStats>),
}

/// The epoch coordinator as a bus endpoint.
///
/// ```
/// use coordbus::{Bus, coordinators::epoch::*};
/// # #[derive(Default)] struct Q(Vec<i64>);
/// # impl Query for Q {
/// #   fn add_offsets(&mut self, _: Epoch, _: Offsets<'_>)
/// #       -> Result<(), CollaboratorError> { Ok(()) }
/// #   fn commit(&mut self, e: Epoch) -> Result<(), CollaboratorError> { self.0.push(e.0); Ok(()) }
/// #   fn stop(&mut self, _: EpochError) {}
/// # }
/// let bus = Bus::builder().inbox_shards(2).build()?;
/// let endpoint = EpochEndpoint::new(EpochConfig::new(1), Q::default(), NoopSink)?;
/// let epoch = bus.register(coordinator_name("run42"), endpoint)?;
/// epoch.ask(SetReaderPartitions(1)).wait()?;
/// epoch.ask(SetWriterPartitions(1)).wait()?;
/// // The driver ends epoch 1 (the start epoch); the tasks send what they have of it.
/// let ended: i64 = epoch.ask(IncrementAndGetEpoch).wait()? - 1;
/// epoch.send(ReportPartitionOffset { partition: 0, epoch: ended, offset: 42.into() })?;
/// // Batches are of `EpochMessage`, which both one-way messages convert into.
/// let batch: Vec<EpochMessage> =
///     vec![CommitPartitionEpoch { partition: 0, epoch: ended, message: 7.into() }.into()];
/// epoch.send_batch(batch)?;
/// assert_eq!(epoch.ask(GetEpochStats).wait()?.last_committed, Epoch(1));
/// bus.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct EpochEndpoint<Q, S> {
    coordinator: EpochCoordinator<Q, S>,
}

impl<Q: Query, S: Sink> EpochEndpoint<Q, S> {
    /// An endpoint around a new [`EpochCoordinator`].
    ///
    /// # Errors
    /// [`ConfigError`] as [`EpochCoordinator::new`]: `config` is invalid, or the query has
    /// committed epochs and the start epoch is not the one after the last of them.
    pub fn new(config: EpochConfig, query: Q, sink: S) -> Result<Self, ConfigError> {
        Ok(Self { coordinator: EpochCoordinator::new(config, query, sink)? })
    }

    /// An endpoint around an existing state machine.
    pub fn from_coordinator(coordinator: EpochCoordinator<Q, S>) -> Self {
        Self { coordinator }
    }

    /// The state machine.
    pub fn coordinator(&self) -> &EpochCoordinator<Q, S> {
        &self.coordinator
    }

    /// The state machine, mutably.
    pub fn coordinator_mut(&mut self) -> &mut EpochCoordinator<Q, S> {
        &mut self.coordinator
    }

    /// Unwraps the state machine.
    pub fn into_coordinator(self) -> EpochCoordinator<Q, S> {
        self.coordinator
    }
}

impl<Q, S> Endpoint for EpochEndpoint<Q, S>
where
    Q: Query + Send + 'static,
    S: Sink + Send + 'static,
{
    type Message = EpochMessage;
    type Request = EpochRequest;

    /// Only a panic reaches this hook (the handlers answer every error themselves): the
    /// coordinator fail-stops (`EpochCoordinator::fail_after_panic`). A `HandlerPanicked` here
    /// is this endpoint's own (the worker names it): its handlers ask no other endpoint, so
    /// none returns another endpoint's.
    fn on_error(&mut self, error: &HandlerError) {
        match error.downcast_ref::<AskError>() {
            Some(AskError::HandlerPanicked { message, .. }) => {
                self.coordinator.fail_after_panic(message.clone());
            }
            _ => tracing::warn!(%error, "epoch coordinator handler error"),
        }
    }

    fn on_start(&mut self, context: &Context<Self>) {
        let stats = self.coordinator.stats();
        tracing::info!(
            endpoint = context.name(),
            start_epoch = %self.coordinator.config().start_epoch,
            last_committed = %stats.last_committed,
            "epoch coordinator started"
        );
    }

    #[inline]
    fn handle(
        &mut self,
        message: EpochMessage,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        // A dropped message was counted and logged by the state machine, and is counted by
        // reason in the endpoint's stats; the sender of a one-way message is not told (SPEC
        // A.2, B.6). Tested in each arm rather than once after `apply`: for the merged result
        // the compiler kept the tag in memory, a store and a reload per message.
        let coordinator = &mut self.coordinator;
        match message {
            EpochMessage::CommitPartitionEpoch { partition, epoch, message } => {
                let outcome = coordinator.commit_partition_epoch(
                    PartitionId(partition),
                    Epoch(epoch),
                    message,
                );
                if let Err(rejected) = outcome {
                    record_dropped(context, &rejected);
                }
            }
            EpochMessage::ReportPartitionOffset { partition, epoch, offset } => {
                let outcome = coordinator.report_partition_offset(
                    PartitionId(partition),
                    Epoch(epoch),
                    offset,
                );
                if let Err(rejected) = outcome {
                    record_dropped(context, &rejected);
                }
            }
        }
        Ok(())
    }

    /// The whole run through [`EpochCoordinator::apply_run`], which carries the bucket it
    /// stores into from one message to the next.
    #[inline]
    fn handle_run(
        &mut self,
        messages: &mut impl Iterator<Item = EpochMessage>,
        context: &Context<Self>,
    ) -> Result<(), HandlerError> {
        self.coordinator.apply_run(messages, |rejected| record_dropped(context, &rejected));
        Ok(())
    }

    fn handle_request(
        &mut self,
        request: EpochRequest,
        _: &Context<Self>,
    ) -> Result<(), HandlerError> {
        let coordinator = &mut self.coordinator;
        match request {
            EpochRequest::GetCurrentEpoch(replier) => {
                replier.reply(coordinator.get_current_epoch().0)
            }
            EpochRequest::IncrementAndGetEpoch(replier) => {
                reply_or_fail(replier, coordinator.increment_and_get_epoch().map(|e| e.0));
            }
            EpochRequest::SetReaderPartitions(count, replier) => {
                reply_or_fail(replier, coordinator.set_reader_partitions(count));
            }
            EpochRequest::SetWriterPartitions(count, replier) => {
                reply_or_fail(replier, coordinator.set_writer_partitions(count));
            }
            EpochRequest::StopContinuousExecutionWrites(replier) => {
                coordinator.stop_writes();
                replier.reply(());
            }
            EpochRequest::GetEpochStats(replier) => replier.reply(coordinator.stats()),
        }
        Ok(())
    }

    fn on_stop(&mut self) {
        let stats = self.coordinator.stats();
        tracing::info!(
            last_committed = %stats.last_committed,
            dropped = stats.counters.dropped(),
            "epoch coordinator stopped"
        );
    }
}

/// Counts a dropped one-way message by reason in the endpoint's stats (out of line: the
/// message path only tests for it).
#[cold]
fn record_dropped<Q, S>(context: &Context<EpochEndpoint<Q, S>>, rejected: &Rejected)
where
    Q: Query + Send + 'static,
    S: Sink + Send + 'static,
{
    context.record_dropped(rejected.reason.label());
}

fn reply_or_fail<T: Send + 'static>(replier: Replier<T>, outcome: Result<T, EpochError>) {
    match outcome {
        Ok(value) => replier.reply(value),
        Err(error) => replier.fail(error),
    }
}

macro_rules! ask_impl {
    ($request:ident, $reply:ty $(, $count:tt)?) => {
        impl<Q, S> Ask<EpochEndpoint<Q, S>> for $request
        where
            Q: Query + Send + 'static,
            S: Sink + Send + 'static,
        {
            type Reply = $reply;
            fn into_request(self, replier: Replier<$reply>) -> EpochRequest {
                EpochRequest::$request($(self.$count,)? replier)
            }
        }
    };
}

ask_impl!(GetCurrentEpoch, i64);
ask_impl!(IncrementAndGetEpoch, i64);
ask_impl!(SetReaderPartitions, (), 0);
ask_impl!(SetWriterPartitions, (), 0);
ask_impl!(StopContinuousExecutionWrites, ());
ask_impl!(GetEpochStats, EpochStats);
