//! Goal: the StateStoreCoordinator scenarios of SCENARIOS.md section 3 (SS-01..SS-03) and the
//! rest of SPEC C.4 hold when the coordinator runs on the bus: exact replies, the textual
//! location, deactivation by run, one coordinator behind every "for driver" reference, stop
//! semantics, snapshot and lag queries, and typed rejection of bad input.
//! Method: a real bus with one coordinator per test; every assertion is made right after the
//! request it depends on, with no polling (one-way reports are ordered before the same
//! thread's later asks). Read-your-writes is checked from several reporter threads at once.

use std::{sync::Arc, time::Duration};

use coordbus::{
    clock::ManualClock,
    coordinators::state_store::{
        ExecutorCacheTaskLocation, ReportActiveInstance, StateStoreCoordinatorConfig,
        StateStoreCoordinatorEndpoint, StateStoreCoordinatorRef, StateStoreError, StateStoreId,
        StateStoreProviderId, VerifyIfInstanceActive, STATE_STORE_COORDINATOR_NAME,
    },
    AskError, Bus, BusError, SendError,
};
use uuid::Uuid;

fn bus() -> Bus {
    Bus::builder().inbox_shards(4).inbox_capacity(1 << 10).build().unwrap()
}

/// `P(loc, op, part, runId)` of SCENARIOS.md.
fn p(location: &str, operator: i64, partition: i32, run: Uuid) -> StateStoreProviderId {
    StateStoreProviderId::new(StateStoreId::new(location, operator, partition), run)
}

fn at(host: &str, executor: &str) -> ExecutorCacheTaskLocation {
    ExecutorCacheTaskLocation::new(host, executor)
}

fn handler_error(error: AskError) -> StateStoreError {
    match error.handler_error::<StateStoreError>() {
        Some(cause) => cause.clone(),
        None => panic!("expected a StateStoreError from the handler, got {error:?}"),
    }
}

#[test]
fn ss_01_report_verify_get_location() {
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let id = p("x", 0, 0, Uuid::from_u128(0x55_0001));

    assert!(!coordinator.verify_if_instance_active(id, "exec1").unwrap());
    assert_eq!(coordinator.get_location(id).unwrap(), None);

    let unload =
        coordinator.report_active_instance_and_check(id, at("hostX", "exec1"), vec![]).unwrap();
    assert!(unload.is_empty());
    assert!(coordinator.verify_if_instance_active(id, "exec1").unwrap());
    assert_eq!(coordinator.get_location(id).unwrap().as_deref(), Some("executor_hostX_exec1"));

    coordinator.report_active_instance_and_check(id, at("hostX", "exec2"), vec![]).unwrap();
    assert!(!coordinator.verify_if_instance_active(id, "exec1").unwrap());
    assert!(coordinator.verify_if_instance_active(id, "exec2").unwrap());
    assert_eq!(coordinator.get_location(id).unwrap().as_deref(), Some("executor_hostX_exec2"));
    bus.shutdown().unwrap();
}

#[test]
fn ss_01_with_the_one_way_report_needs_no_eventually() {
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let id = p("x", 0, 0, Uuid::from_u128(0x55_0002));
    coordinator.report_active_instance(id, at("hostX", "exec1")).unwrap();
    assert!(coordinator.verify_if_instance_active(id, "exec1").unwrap());
    assert_eq!(coordinator.get_location(id).unwrap().as_deref(), Some("executor_hostX_exec1"));
    coordinator.report_active_instance(id, at("hostX", "exec2")).unwrap();
    assert!(!coordinator.verify_if_instance_active(id, "exec1").unwrap());
    assert!(coordinator.verify_if_instance_active(id, "exec2").unwrap());
    assert_eq!(coordinator.get_location(id).unwrap().as_deref(), Some("executor_hostX_exec2"));
    bus.shutdown().unwrap();
}

#[test]
fn ss_02_make_inactive() {
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let (r1, r2) = (Uuid::from_u128(0x55_0003), Uuid::from_u128(0x55_0004));
    let id1 = p("x", 0, 0, r1);
    let id2 = p("y", 1, 0, r2);
    let id3 = p("x", 0, 1, r1);
    for id in [id1, id2, id3] {
        coordinator.report_active_instance_and_check(id, at("hostX", "exec1"), vec![]).unwrap();
    }
    for id in [id1, id2, id3] {
        assert!(coordinator.verify_if_instance_active(id, "exec1").unwrap());
    }

    assert!(coordinator.deactivate_instances(r1).unwrap());
    assert!(!coordinator.verify_if_instance_active(id1, "exec1").unwrap());
    assert!(coordinator.verify_if_instance_active(id2, "exec1").unwrap());
    assert!(!coordinator.verify_if_instance_active(id3, "exec1").unwrap());
    assert_eq!(coordinator.get_location(id1).unwrap(), None);
    assert_eq!(coordinator.get_location(id2).unwrap().as_deref(), Some("executor_hostX_exec1"));
    assert_eq!(coordinator.get_location(id3).unwrap(), None);

    assert!(coordinator.deactivate_instances(r2).unwrap());
    assert!(!coordinator.verify_if_instance_active(id2, "exec1").unwrap());
    assert_eq!(coordinator.get_location(id2).unwrap(), None);
    bus.shutdown().unwrap();
}

#[test]
fn ss_03_multiple_references_share_one_coordinator() {
    let bus = bus();
    let ref1 = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let ref2 = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let executor_side = StateStoreCoordinatorRef::for_executor(&bus).unwrap();
    assert!(ref1.same_coordinator(&ref2));
    assert!(ref1.same_coordinator(&executor_side));
    assert_eq!(bus.names(), vec![STATE_STORE_COORDINATOR_NAME.to_owned()]);

    let id = p("x", 0, 0, Uuid::from_u128(0x55_0005));
    ref1.report_active_instance(id, at("hostX", "exec1")).unwrap();
    // The report went one-way through ref1; an ask from this thread through ref2 travels the
    // same ordered lane, so it is handled after the report.
    assert!(ref2.verify_if_instance_active(id, "exec1").unwrap());
    assert_eq!(ref2.get_location(id).unwrap().as_deref(), Some("executor_hostX_exec1"));
    bus.shutdown().unwrap();
}

/// SS-03's collision: the helper found no coordinator, but another registration won the name
/// before its own (here from inside the helper's constructor, between the two steps). The
/// helper returns a reference to the coordinator that won; the endpoint it built is dropped.
#[test]
fn ss_03_a_registration_that_collides_returns_the_existing_coordinator() {
    let bus = bus();
    let mut winner = None;
    let late = StateStoreCoordinatorRef::for_driver_with(&bus, || {
        winner = Some(StateStoreCoordinatorRef::for_driver(&bus).unwrap());
        StateStoreCoordinatorEndpoint::default()
    })
    .unwrap();
    let winner = winner.expect("the constructor ran: the lookup found no coordinator");
    assert!(late.same_coordinator(&winner));
    assert_eq!(bus.names(), vec![STATE_STORE_COORDINATOR_NAME.to_owned()]);
    let id = p("x", 0, 0, Uuid::from_u128(0x55_0006));
    winner.report_active_instance(id, at("hostX", "exec1")).unwrap();
    assert!(late.verify_if_instance_active(id, "exec1").unwrap());
    bus.shutdown().unwrap();
}

#[test]
fn concurrent_for_driver_calls_register_one_coordinator() {
    let bus = bus();
    let references: Vec<StateStoreCoordinatorRef> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| StateStoreCoordinatorRef::for_driver(&bus).unwrap()))
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    });
    assert!(references.windows(2).all(|pair| pair[0].same_coordinator(&pair[1])));
    assert_eq!(bus.names().len(), 1);
    bus.shutdown().unwrap();
}

#[test]
fn for_executor_without_a_coordinator_is_not_found() {
    let bus = bus();
    assert!(matches!(
        StateStoreCoordinatorRef::for_executor(&bus),
        Err(BusError::NotFound { name }) if name == STATE_STORE_COORDINATOR_NAME
    ));
    bus.shutdown().unwrap();
}

#[test]
fn stop_coordinator_frees_the_name_before_replying_and_later_messages_are_stopped() {
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let id = p("x", 0, 0, Uuid::from_u128(0x55_0006));
    coordinator.report_active_instance(id, at("hostX", "exec1")).unwrap();
    assert!(coordinator.stop_coordinator().unwrap());
    assert!(!bus.contains(STATE_STORE_COORDINATOR_NAME));

    assert!(matches!(
        coordinator.verify_if_instance_active(id, "exec1"),
        Err(AskError::Stopped { endpoint }) if endpoint == STATE_STORE_COORDINATOR_NAME
    ));
    assert!(matches!(
        coordinator.report_active_instance(id, at("hostX", "exec1")),
        Err(SendError::Stopped { message, .. }) if message.provider_id == id
    ));
    assert!(matches!(coordinator.stop_coordinator(), Err(AskError::Stopped { .. })));

    // A new coordinator takes the name at once and starts empty.
    let fresh = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    assert!(!fresh.same_coordinator(&coordinator));
    assert_eq!(fresh.get_location(id).unwrap(), None);
    bus.shutdown().unwrap();
}

#[test]
fn report_with_check_returns_the_providers_to_unload() {
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let run = Uuid::from_u128(0x55_0007);
    let [a, b, c, missing] = [0, 1, 2, 3].map(|partition| p("chk", 0, partition, run));
    coordinator.report_active_instance(b, at("hostY", "exec9")).unwrap();
    coordinator.report_active_instance(c, at("hostX", "exec1")).unwrap();
    let unload = coordinator
        .report_active_instance_and_check(a, at("hostX", "exec1"), vec![missing, c, b])
        .unwrap();
    assert_eq!(unload, vec![b]);
    assert_eq!(coordinator.get_location(a).unwrap().as_deref(), Some("executor_hostX_exec1"));
    bus.shutdown().unwrap();
}

#[test]
fn snapshot_tracking_and_lag_queries_through_the_bus() {
    let bus = bus();
    let clock = ManualClock::new(1_000_000);
    let coordinator = StateStoreCoordinatorRef::for_driver_with(&bus, || {
        StateStoreCoordinatorEndpoint::with_clock(
            StateStoreCoordinatorConfig::default(),
            Arc::new(clock.clone()),
        )
        .unwrap()
    })
    .unwrap();
    let run = Uuid::from_u128(0x55_0008);
    let [never, old, recent, fresh] = [0, 1, 2, 3].map(|partition| p("lag", 2, partition, run));
    for id in [never, old, recent, fresh] {
        coordinator.report_active_instance(id, at("h", "e")).unwrap();
    }
    assert!(coordinator.report_snapshot_uploaded(old, 10, 1_000_000 - 200_000).unwrap());
    assert!(coordinator.report_snapshot_uploaded(recent, 10, 1_000_000 - 1_000).unwrap());
    assert!(coordinator.report_snapshot_uploaded(fresh, 70, 1_000_000).unwrap());
    assert!(coordinator.report_snapshot_uploaded(fresh, 69, 0).unwrap());
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(fresh).unwrap(), Some(70));
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(never).unwrap(), None);

    // Threshold 5 x 10 = 50 versions, 3 x 60 s of age.
    assert_eq!(
        coordinator.get_lagging_stores_for_testing(run, 80, false).unwrap(),
        vec![never, old]
    );
    assert_eq!(
        coordinator.get_lagging_stores_for_testing(run, 80, true).unwrap(),
        vec![never, old, recent]
    );
    assert!(coordinator.log_lagging_state_stores(run, 80, false).unwrap());
    assert!(coordinator.log_lagging_state_stores(run, 80, false).unwrap());
    clock.advance_ms(300_001);
    assert!(coordinator.log_lagging_state_stores(run, 80, true).unwrap());
    let counters = coordinator.counters().unwrap();
    assert_eq!(counters.full_lag_reports, 2, "the second report was rate limited");
    assert_eq!(counters.snapshot_reports, 4);

    assert!(coordinator
        .update_config(StateStoreCoordinatorConfig {
            report_snapshot_upload_lag: false,
            ..Default::default()
        })
        .unwrap());
    assert!(coordinator.get_lagging_stores_for_testing(run, 80, true).unwrap().is_empty());
    let bad = StateStoreCoordinatorConfig { min_deltas_for_snapshot: 0, ..Default::default() };
    assert!(matches!(
        handler_error(coordinator.update_config(bad).unwrap_err()),
        StateStoreError::Config(_)
    ));
    bus.shutdown().unwrap();
}

#[test]
fn bad_input_fails_asks_with_typed_errors_and_counts_one_way_reports() {
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let run = Uuid::from_u128(0x55_0009);
    let good = p("x", 0, 0, run);
    let negative = p("x", 0, -4, run);

    let error = handler_error(
        coordinator.report_active_instance_and_check(good, at("", "exec1"), vec![]).unwrap_err(),
    );
    assert_eq!(
        error,
        StateStoreError::MalformedLocation {
            provider_id: good,
            location: at("", "exec1"),
            reason: "empty host"
        }
    );
    assert!(matches!(
        handler_error(coordinator.verify_if_instance_active(negative, "e").unwrap_err()),
        StateStoreError::MalformedStoreId { store_id, reason: "negative partition id" }
            if store_id.partition_id == -4
    ));
    assert!(matches!(
        handler_error(coordinator.verify_if_instance_active(good, "").unwrap_err()),
        StateStoreError::EmptyExecutorId { provider_id } if provider_id == good
    ));
    assert!(matches!(
        handler_error(coordinator.get_location(p("", 0, 0, run)).unwrap_err()),
        StateStoreError::MalformedStoreId { .. }
    ));
    assert!(matches!(
        handler_error(coordinator.report_snapshot_uploaded(good, -1, 0).unwrap_err()),
        StateStoreError::NegativeSnapshotVersion { version: -1, .. }
    ));

    // One-way: dropped, counted, and the endpoint keeps serving.
    coordinator.report_active_instance(good, at("hostX", "")).unwrap();
    coordinator.report_active_instance(negative, at("hostX", "exec1")).unwrap();
    coordinator.report_active_instance(good, at("hostX", "exec1")).unwrap();
    let counters = coordinator.counters().unwrap();
    assert_eq!(counters.rejected, 7);
    assert_eq!(counters.reports, 4);
    assert_eq!(counters.new_instances, 1);
    let endpoint_stats = coordinator.endpoint().stats();
    assert_eq!(endpoint_stats.failed, 2);
    assert_eq!(
        endpoint_stats.dropped_by_reason,
        [coordbus::DroppedCount { reason: "invalid report", count: 2 }]
    );
    assert_eq!(coordinator.get_location(good).unwrap().as_deref(), Some("executor_hostX_exec1"));

    // A report of a deactivated run is dropped, and the endpoint's statistics say so.
    coordinator.deactivate_instances(run).unwrap();
    coordinator.report_active_instance(good, at("hostX", "exec1")).unwrap();
    assert_eq!(coordinator.counters().unwrap().reports_of_deactivated_runs, 1);
    assert_eq!(coordinator.get_location(good).unwrap(), None);
    assert_eq!(
        coordinator.endpoint().stats().dropped_by_reason,
        [
            coordbus::DroppedCount { reason: "invalid report", count: 2 },
            coordbus::DroppedCount { reason: "report of a deactivated run", count: 1 }
        ]
    );
    bus.shutdown().unwrap();
}

/// Each thread reports its own providers one-way and verifies each right after sending it,
/// with no waiting: per-sender FIFO must make every report visible to the same thread's next
/// ask, while the other threads interleave their traffic.
#[test]
fn each_reporter_reads_its_own_one_way_report_immediately() {
    const THREADS: usize = 4;
    const ROUNDS: i32 = 300;
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let run = Uuid::from_u128(0x55_000a);
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let coordinator = coordinator.clone();
            scope.spawn(move || {
                let operator = thread as i64;
                for round in 0..ROUNDS {
                    let id = p("ryw", operator, round % 16, run);
                    let executor = format!("exec{thread}-{round}");
                    coordinator.report_active_instance(id, at("host", &executor)).unwrap();
                    let verify = coordinator
                        .endpoint()
                        .ask(VerifyIfInstanceActive {
                            provider_id: id,
                            executor_id: executor.as_str().into(),
                        })
                        .wait_timeout(Duration::from_secs(10))
                        .unwrap();
                    assert!(verify, "thread {thread} round {round} did not see its report");
                    assert_eq!(
                        coordinator.get_location(id).unwrap(),
                        Some(format!("executor_host_{executor}"))
                    );
                }
            });
        }
    });
    let counters = coordinator.counters().unwrap();
    assert_eq!(counters.reports, (THREADS as u64) * (ROUNDS as u64));
    assert_eq!(counters.new_instances, (THREADS as u64) * 16);
    bus.shutdown().unwrap();
}

#[test]
fn batched_one_way_reports_are_all_applied_and_the_last_one_wins() {
    let bus = bus();
    let coordinator = StateStoreCoordinatorRef::for_driver(&bus).unwrap();
    let id = p("batch", 0, 0, Uuid::from_u128(0x55_000b));
    let reports: Vec<_> = (0..100)
        .map(|index| ReportActiveInstance {
            provider_id: id,
            location: at("host", &format!("exec{index}")),
        })
        .collect();
    coordinator.endpoint().send_batch(reports).unwrap();
    assert_eq!(coordinator.get_location(id).unwrap().as_deref(), Some("executor_host_exec99"));
    let counters = coordinator.counters().unwrap();
    assert_eq!((counters.reports, counters.new_instances), (100, 1), "{counters:?}");
    bus.shutdown().unwrap();
}
