//! Unit tests of the state machine alone (no bus): the effects and replies of SPEC C.4,
//! snapshot tracking, lag detection with a manual clock, and bad input.

use uuid::Uuid;

use super::*;
use crate::{clock::ManualClock, warning_capture};

const NOW_MS: i64 = 1_000_000;

fn provider(location: &str, operator: i64, partition: i32, run: Uuid) -> StateStoreProviderId {
    StateStoreProviderId::new(StateStoreId::new(location, operator, partition), run)
}

fn at(host: &str, executor: &str) -> ExecutorCacheTaskLocation {
    ExecutorCacheTaskLocation::new(host, executor)
}

fn coordinator() -> (StateStoreCoordinator<ManualClock>, ManualClock) {
    let clock = ManualClock::new(NOW_MS);
    let coordinator =
        StateStoreCoordinator::with_clock(StateStoreCoordinatorConfig::default(), clock.clone())
            .unwrap();
    (coordinator, clock)
}

#[test]
fn default_config_has_the_spec_values_and_validates() {
    let config = StateStoreCoordinatorConfig::default();
    assert!(config.report_snapshot_upload_lag);
    assert_eq!(config.multiplier_for_min_version_diff_to_log, 5);
    assert_eq!(config.multiplier_for_min_time_diff_to_log, 3);
    assert_eq!(config.snapshot_lag_report_interval_ms, 300_000);
    assert_eq!(config.max_lagging_stores_to_report, 5);
    assert_eq!(config.min_deltas_for_snapshot, 10);
    assert_eq!(config.maintenance_interval_ms, 60_000);
    assert_eq!(config.validate(), Ok(()));
}

#[test]
fn invalid_config_is_rejected_with_setting_and_value() {
    let config = StateStoreCoordinatorConfig {
        multiplier_for_min_version_diff_to_log: 0,
        ..Default::default()
    };
    let error = StateStoreCoordinator::new(config).unwrap_err();
    assert_eq!(
        error.to_string(),
        "multiplier_for_min_version_diff_to_log = 0 is invalid: must be at least 1"
    );
    let (mut coordinator, _) = coordinator();
    let bad = StateStoreCoordinatorConfig { maintenance_interval_ms: -5, ..Default::default() };
    assert!(matches!(coordinator.set_config(bad), Err(StateStoreError::Config(_))));
    assert_eq!(coordinator.config(), &StateStoreCoordinatorConfig::default());
}

#[test]
fn report_verify_and_location_follow_the_latest_owner() {
    let (mut coordinator, _) = coordinator();
    let id = provider("x", 0, 0, Uuid::from_u128(1));
    assert!(!coordinator.verify_if_instance_active(id, "exec1".into()).unwrap());
    assert_eq!(coordinator.get_location(id).unwrap(), None);
    coordinator.report_active_instance(id, at("hostX", "exec1")).unwrap();
    assert!(coordinator.verify_if_instance_active(id, "exec1".into()).unwrap());
    assert_eq!(coordinator.get_location(id).unwrap().as_deref(), Some("executor_hostX_exec1"));
    coordinator.report_active_instance(id, at("hostY", "exec2")).unwrap();
    assert!(!coordinator.verify_if_instance_active(id, "exec1".into()).unwrap());
    assert!(coordinator.verify_if_instance_active(id, "exec2".into()).unwrap());
    assert_eq!(coordinator.get_location(id).unwrap().as_deref(), Some("executor_hostY_exec2"));
    let counters = coordinator.counters();
    assert_eq!(counters.reports, 2);
    assert_eq!(counters.new_instances, 1);
    assert_eq!(counters.verifies, 4);
    assert_eq!(counters.location_queries, 3);
    assert_eq!(counters.rejected, 0);
}

#[test]
fn verify_compares_the_executor_id_only() {
    let (mut coordinator, _) = coordinator();
    let id = provider("x", 0, 0, Uuid::from_u128(1));
    coordinator.report_active_instance(id, at("hostX", "exec1")).unwrap();
    assert!(coordinator.verify_if_instance_active(id, "exec1".into()).unwrap());
    assert!(!coordinator.verify_if_instance_active(id, "exec2".into()).unwrap());
    // The owner is now on another host with the same executor id: it still verifies, as in
    // Spark (verify names no host), and the location follows the report.
    coordinator.report_active_instance(id, at("hostY", "exec1")).unwrap();
    assert!(coordinator.verify_if_instance_active(id, "exec1".into()).unwrap());
    assert_eq!(coordinator.location(id), Some(at("hostY", "exec1")));
}

#[test]
fn report_and_check_returns_ids_active_elsewhere_in_input_order() {
    let (mut coordinator, _) = coordinator();
    let run = Uuid::from_u128(9);
    let [a, b, c, d, e] = [0, 1, 2, 3, 4].map(|partition| provider("x", 0, partition, run));
    coordinator.report_active_instance(b, at("hostX", "exec2")).unwrap();
    coordinator.report_active_instance(c, at("hostX", "exec1")).unwrap();
    coordinator.report_active_instance(d, at("hostY", "exec1")).unwrap();
    // e has no entry: not selected. c is on the reporter: not selected. d differs by host only.
    let unload = coordinator
        .report_active_instance_and_check(a, at("hostX", "exec1"), &[e, d, c, b, a])
        .unwrap();
    assert_eq!(unload, vec![d, b]);
    assert_eq!(coordinator.location(a), Some(at("hostX", "exec1")));
    assert_eq!(
        coordinator.report_active_instance_and_check(a, at("hostX", "exec1"), &[]).unwrap(),
        Vec::<StateStoreProviderId>::new()
    );
    assert_eq!(coordinator.counters().checked_ids, 5);
}

#[test]
fn deactivation_removes_only_that_run() {
    let (mut coordinator, _) = coordinator();
    let (r1, r2) = (Uuid::from_u128(1), Uuid::from_u128(2));
    let id1 = provider("x", 0, 0, r1);
    let id2 = provider("y", 1, 0, r2);
    let id3 = provider("x", 0, 1, r1);
    for id in [id1, id2, id3] {
        coordinator.report_active_instance(id, at("hostX", "exec1")).unwrap();
    }
    coordinator.report_snapshot_uploaded(id1, 4, NOW_MS).unwrap();
    coordinator.report_snapshot_uploaded(id2, 4, NOW_MS).unwrap();
    // A snapshot record of a provider of r1 that was never active goes too.
    let never_active = provider("x", 0, 7, r1);
    coordinator.report_snapshot_uploaded(never_active, 1, NOW_MS).unwrap();
    assert_eq!(coordinator.deactivate_instances(r1), 2);
    assert_eq!(coordinator.location(id1), None);
    assert_eq!(coordinator.location(id3), None);
    assert_eq!(coordinator.location(id2), Some(at("hostX", "exec1")));
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(id1), None);
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(never_active), None);
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(id2), Some(4));
    assert_eq!(coordinator.deactivate_instances(r1), 0);
    assert_eq!(coordinator.deactivate_instances(r2), 1);
    assert_eq!(coordinator.active_instance_count(), 0);
    assert_eq!(coordinator.run_count(), 0);
    assert_eq!(coordinator.counters().deactivated_instances, 3);
}

#[test]
fn a_newer_snapshot_version_overwrites_an_older_or_equal_one_does_not() {
    let (mut coordinator, clock) = coordinator();
    let run = Uuid::from_u128(3);
    let id = provider("x", 0, 0, run);
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(id), None);
    // No check that the provider is active.
    coordinator.report_snapshot_uploaded(id, 5, 100).unwrap();
    coordinator.report_snapshot_uploaded(id, 5, 900).unwrap();
    coordinator.report_snapshot_uploaded(id, 3, 950).unwrap();
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(id), Some(5));
    // The equal version did not move the timestamp: the store is still 100 ms old's upload.
    coordinator.report_active_instance(id, at("h", "e")).unwrap();
    clock.set_ms(100 + 180_001);
    assert_eq!(coordinator.get_lagging_stores_for_testing(run, 56, false), vec![id]);
    coordinator.report_snapshot_uploaded(id, 7, 1_000).unwrap();
    assert_eq!(coordinator.get_latest_snapshot_version_for_testing(id), Some(7));
    assert_eq!(coordinator.counters().snapshot_reports, 4);
}

/// Stores of one run at `NOW_MS` with the default thresholds (50 versions, 180 s), reference
/// version 110:
/// * `never`: no upload -> (0, 0): behind in both -> lagging.
/// * `old`: (59, now - 200 s): 51 versions, 200 s -> lagging.
/// * `recent`: (59, now - 10 s): behind in versions only -> lagging when terminating.
/// * `edge_time`: (1, now - 180 s): time not strictly over -> lagging when terminating.
/// * `edge_version`: (60, 0): 50 versions, not strictly over -> never.
/// * `fresh`: (100, 0): 10 versions -> never.
fn lagging_fixture() -> (StateStoreCoordinator<ManualClock>, Uuid, [StateStoreProviderId; 6]) {
    let (mut coordinator, _) = coordinator();
    let run = Uuid::from_u128(0xabc);
    let ids = [0, 1, 2, 3, 4, 5].map(|partition| provider("lag", 0, partition, run));
    let [never, old, recent, edge_time, edge_version, fresh] = ids;
    for id in ids {
        coordinator.report_active_instance(id, at("h", "e")).unwrap();
    }
    let _ = never;
    coordinator.report_snapshot_uploaded(old, 59, NOW_MS - 200_000).unwrap();
    coordinator.report_snapshot_uploaded(recent, 59, NOW_MS - 10_000).unwrap();
    coordinator.report_snapshot_uploaded(edge_time, 1, NOW_MS - 180_000).unwrap();
    coordinator.report_snapshot_uploaded(edge_version, 60, 0).unwrap();
    coordinator.report_snapshot_uploaded(fresh, 100, 0).unwrap();
    // Another run's lagging store and an inactive provider with an old upload never appear.
    coordinator
        .report_active_instance(provider("lag", 0, 0, Uuid::from_u128(1)), at("h", "e"))
        .unwrap();
    coordinator.report_snapshot_uploaded(provider("lag", 0, 9, run), 1, 0).unwrap();
    (coordinator, run, ids)
}

#[test]
fn lagging_sets_for_non_terminating_and_terminating_triggers_are_exact() {
    let (mut coordinator, run, [never, old, recent, edge_time, _, _]) = lagging_fixture();
    assert_eq!(coordinator.get_lagging_stores_for_testing(run, 110, false), vec![never, old]);
    // Sorted ascending by latest upload: (0,0), (1, ..), (59, older), (59, newer).
    assert_eq!(
        coordinator.get_lagging_stores_for_testing(run, 110, true),
        vec![never, edge_time, old, recent]
    );
    assert_eq!(coordinator.get_lagging_stores_for_testing(run, 51, true), vec![never]);
    assert!(coordinator.get_lagging_stores_for_testing(Uuid::from_u128(77), 110, true).is_empty());
    coordinator.deactivate_instances(run);
    assert!(coordinator.get_lagging_stores_for_testing(run, 110, true).is_empty());
}

#[test]
fn extreme_versions_and_times_do_not_overflow() {
    let (mut coordinator, run, [never, ..]) = lagging_fixture();
    let lagging = coordinator.get_lagging_stores_for_testing(run, i64::MAX, true);
    assert_eq!(lagging.len(), 6);
    assert_eq!(lagging[0], never);
    assert!(coordinator.get_lagging_stores_for_testing(run, i64::MIN, true).is_empty());
}

/// The time difference too: a clock at `i64::MAX` and an upload stamped `i64::MIN` lag by
/// more than an `i64` holds, reported saturated.
#[test]
fn extreme_times_saturate_the_reported_lag() {
    let (mut coordinator, clock) = coordinator();
    let run = Uuid::from_u128(0xe7);
    let id = provider("extreme", 0, 0, run);
    coordinator.report_active_instance(id, at("h", "e")).unwrap();
    coordinator.report_snapshot_uploaded(id, 0, i64::MIN).unwrap();
    clock.set_ms(i64::MAX);
    let report = coordinator.log_lagging_state_stores(run, i64::MAX, false);
    assert_eq!(report.lagging_count, 1);
    assert_eq!(report.full_report[0].time_delta_ms, i64::MAX);
    assert_eq!(report.full_report[0].version_delta, i64::MAX);
}

#[test]
fn full_lag_report_is_rate_limited_per_run_and_capped() {
    let (mut coordinator, clock) = coordinator();
    let run = Uuid::from_u128(0xfeed);
    let other_run = Uuid::from_u128(0xbeef);
    let ids: Vec<_> = (0..7).map(|partition| provider("cap", 1, partition, run)).collect();
    for (version, id) in ids.iter().enumerate() {
        coordinator.report_active_instance(*id, at("h", "e")).unwrap();
        coordinator.report_snapshot_uploaded(*id, version as i64, 0).unwrap();
    }
    coordinator.report_active_instance(provider("cap", 1, 0, other_run), at("h", "e")).unwrap();

    let first = coordinator.log_lagging_state_stores(run, 1_000, false);
    assert_eq!(first.lagging_count, 7);
    let named: Vec<_> = first.full_report.iter().map(|store| store.provider_id).collect();
    assert_eq!(named, ids[..5].to_vec(), "the five most lagging, most lagging first");
    assert_eq!(first.full_report[2].version_delta, 998);
    assert_eq!(first.full_report[2].time_delta_ms, NOW_MS);
    assert_eq!(first.full_report[2].latest_snapshot, SnapshotUploadEvent::new(2, 0));

    // Exactly the interval later: not strictly more, so only the count is logged.
    clock.advance_ms(300_000);
    let second = coordinator.log_lagging_state_stores(run, 1_000, false);
    assert_eq!(second.lagging_count, 7);
    assert!(second.full_report.is_empty());
    // The other run has its own timer.
    assert_eq!(coordinator.log_lagging_state_stores(other_run, 1_000, false).full_report.len(), 1);
    clock.advance_ms(1);
    assert_eq!(coordinator.log_lagging_state_stores(run, 1_000, false).full_report.len(), 5);
    assert_eq!(coordinator.counters().full_lag_reports, 3);
    assert_eq!(coordinator.counters().lag_checks, 4);

    // Nothing lagging: no report, and the timer is untouched: 200 s after the last full
    // report the stores lag again and only their count is logged; past 300 s, in full.
    clock.advance_ms(200_000);
    assert_eq!(coordinator.log_lagging_state_stores(run, 0, false), LagReport::default());
    let soon_after = coordinator.log_lagging_state_stores(run, 1_000, false);
    assert_eq!(soon_after.lagging_count, 7);
    assert!(soon_after.full_report.is_empty(), "the empty check started the timer over");
    clock.advance_ms(100_001);
    assert_eq!(coordinator.log_lagging_state_stores(run, 1_000, false).full_report.len(), 5);
    // Deactivation forgets the run, its timer with it; a late report of it is dropped, so
    // nothing of the run lags any more.
    coordinator.deactivate_instances(run);
    coordinator.report_active_instance(ids[0], at("h", "e")).unwrap();
    assert_eq!(coordinator.counters().reports_of_deactivated_runs, 1);
    assert_eq!(coordinator.log_lagging_state_stores(run, 1_000, false), LagReport::default());
}

/// Late reports of deactivated runs (tasks still loading providers, a maintenance upload that
/// finishes after the stop) are dropped and counted instead of bringing their runs back, so a
/// driver that sees many runs keeps no state for finished ones.
#[test]
fn late_reports_of_deactivated_runs_leave_no_state_behind() {
    let (mut coordinator, _) = coordinator();
    for run in 0..10_000u128 {
        let id = provider("late", 0, 0, Uuid::from_u128(run));
        coordinator.report_active_instance(id, at("h", "e")).unwrap();
        coordinator.deactivate_instances(id.query_run_id);
        coordinator.report_active_instance(id, at("h", "e")).unwrap();
        let checked = coordinator.report_active_instance_and_check(id, at("h", "e"), &[id]);
        assert_eq!(checked.unwrap(), [], "nothing of the run is active, nothing to unload");
        coordinator.report_snapshot_uploaded(id, 3, 1_000).unwrap();
        assert!(!coordinator.verify_if_instance_active(id, "e".into()).unwrap());
        assert_eq!(coordinator.get_latest_snapshot_version_for_testing(id), None);
    }
    assert_eq!(coordinator.run_count(), 0);
    assert_eq!(coordinator.counters().reports_of_deactivated_runs, 30_000);
}

/// The deactivated runs remembered are bounded: past the limit the oldest is forgotten (and
/// a report of it would be taken again).
#[test]
fn the_deactivated_runs_remembered_are_bounded() {
    let (mut coordinator, _) = coordinator();
    let runs = DEACTIVATED_RUNS_REMEMBERED as u128 + 1;
    for run in 0..runs {
        coordinator.deactivate_instances(Uuid::from_u128(run));
    }
    let oldest = provider("late", 0, 0, Uuid::from_u128(0));
    let newest = provider("late", 0, 0, Uuid::from_u128(runs - 1));
    coordinator.report_active_instance(newest, at("h", "e")).unwrap();
    assert_eq!(coordinator.run_count(), 0, "the newest deactivated run is remembered");
    coordinator.report_active_instance(oldest, at("h", "e")).unwrap();
    assert_eq!(coordinator.run_count(), 1, "the oldest was forgotten");
}

#[test]
fn disabled_reporting_finds_and_logs_nothing() {
    let (mut coordinator, run, _) = lagging_fixture();
    coordinator
        .set_config(StateStoreCoordinatorConfig {
            report_snapshot_upload_lag: false,
            ..Default::default()
        })
        .unwrap();
    assert!(coordinator.get_lagging_stores_for_testing(run, 1_000, true).is_empty());
    assert_eq!(coordinator.log_lagging_state_stores(run, 1_000, true), LagReport::default());
    assert_eq!(coordinator.counters().full_lag_reports, 0);
}

#[test]
fn bad_input_is_rejected_with_the_values_and_changes_nothing() {
    let (mut coordinator, _) = coordinator();
    let run = Uuid::from_u128(5);
    let good = provider("x", 0, 0, run);
    let empty_location = provider("", 0, 0, run);
    let negative_partition = provider("x", 0, -1, run);
    let negative_operator = provider("x", -2, 0, run);
    let empty_store = StateStoreProviderId::new(StateStoreId::with_store_name("x", 0, 0, ""), run);

    for bad in [empty_location, negative_partition, negative_operator, empty_store] {
        let error = coordinator.report_active_instance(bad, at("h", "e")).unwrap_err();
        assert!(matches!(
            error,
            StateStoreError::MalformedStoreId { store_id, .. } if store_id == bad.store_id
        ));
        assert!(matches!(
            coordinator.verify_if_instance_active(bad, "e".into()),
            Err(StateStoreError::MalformedStoreId { .. })
        ));
        assert!(coordinator.get_location(bad).is_err());
        assert!(coordinator.report_snapshot_uploaded(bad, 1, 1).is_err());
    }
    let error = coordinator.report_active_instance(negative_partition, at("h", "e")).unwrap_err();
    assert_eq!(
        error.to_string(),
        "malformed state store id StateStoreId[checkpointRootLocation=x, operatorId=0, \
         partitionId=-1, storeName=default]: negative partition id"
    );

    let error = coordinator.report_active_instance(good, at("", "e")).unwrap_err();
    assert_eq!(
        error,
        StateStoreError::MalformedLocation {
            provider_id: good,
            location: at("", "e"),
            reason: "empty host",
        }
    );
    assert!(error.to_string().contains("host \"\", executor id \"e\""));
    assert!(coordinator.report_active_instance(good, at("h", "")).is_err());
    assert_eq!(
        coordinator.verify_if_instance_active(good, "".into()),
        Err(StateStoreError::EmptyExecutorId { provider_id: good })
    );
    assert_eq!(
        coordinator.report_snapshot_uploaded(good, -1, 0),
        Err(StateStoreError::NegativeSnapshotVersion { provider_id: good, version: -1 })
    );
    assert_eq!(coordinator.location(good), None);
    assert_eq!(coordinator.active_instance_count(), 0);
    assert_eq!(coordinator.counters().rejected, 4 * 4 + 5);

    // A malformed id in a check list can have no entry, so it is not returned (counted); the
    // report itself is recorded (SPEC C.4: its effect does not depend on the list), and a
    // valid id beside it is still checked.
    let elsewhere = provider("y", 0, 0, run);
    coordinator.report_active_instance(elsewhere, at("other", "e9")).unwrap();
    let to_unload = coordinator
        .report_active_instance_and_check(good, at("h", "e"), &[negative_partition, elsewhere])
        .unwrap();
    assert_eq!(to_unload, [elsewhere]);
    assert_eq!(coordinator.location(good), Some(at("h", "e")));
    assert_eq!(coordinator.counters().malformed_checked_ids, 1);
    assert_eq!(coordinator.counters().rejected, 4 * 4 + 5, "the report was not rejected");
}

#[test]
fn ids_and_messages_stay_small() {
    use std::mem::size_of;
    assert_eq!(size_of::<Name>(), 8);
    assert_eq!(size_of::<StateStoreId>(), 32);
    assert_eq!(size_of::<StateStoreProviderId>(), 48);
    assert_eq!(size_of::<ExecutorCacheTaskLocation>(), 16);
    assert_eq!(size_of::<ReportActiveInstance>(), 64);
    assert!(
        size_of::<StateStoreRequest>() <= 80,
        "request enum is {} bytes",
        size_of::<StateStoreRequest>()
    );
}

#[test]
fn lag_report_logs_a_count_warning_and_a_rate_limited_warning_per_store() {
    let warnings = warning_capture::WarningLog::default();
    let count = || warnings.count();
    warnings.around(|| {
        let (mut coordinator, clock) = coordinator();
        let run = Uuid::from_u128(0x10c);
        for partition in 0..7 {
            coordinator
                .report_active_instance(provider("log", 0, partition, run), at("h", "e"))
                .unwrap();
        }
        coordinator.log_lagging_state_stores(run, 1_000, false);
        assert_eq!(count(), 1 + 5, "one count warning and the five most lagging stores");
        coordinator.log_lagging_state_stores(run, 1_000, false);
        assert_eq!(count(), 6 + 1, "within the interval: the count warning only");
        clock.advance_ms(300_001);
        coordinator.log_lagging_state_stores(run, 1_000, false);
        assert_eq!(count(), 7 + 6);
        coordinator.log_lagging_state_stores(run, 10, false);
        assert_eq!(count(), 13, "nothing lagging: nothing logged");
    });
}
