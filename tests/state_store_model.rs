//! Goal: the StateStoreCoordinator agrees with a plain reference model (hash maps, a literal
//! transcription of SPEC C.4) on every reply and on its final state, for random sequences of
//! every message, bad input included.
//! Method: (1) proptest (fixed seed) drives the state machine alone, one operation at a time,
//! comparing each reply with the model's; (2) several reporter threads (seeded RNG each) drive
//! one coordinator through the bus concurrently, each on its own query runs, each checking
//! every reply against its own model at once (per-sender FIFO makes that exact, also for
//! one-way reports) and its final view at the end; the coordinator's counters must add up.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use coordbus::{
    clock::{Clock, ManualClock},
    coordinators::state_store::{
        ExecutorCacheTaskLocation, GetLaggingStoresForTesting, LagReport, LaggingStore,
        SnapshotUploadEvent, StateStoreCoordinator, StateStoreCoordinatorConfig,
        StateStoreCoordinatorEndpoint, StateStoreCoordinatorRef, StateStoreId,
        StateStoreProviderId,
    },
    Bus,
};
use proptest::{prelude::*, test_runner::RngSeed};
use uuid::Uuid;

const START_MS: i64 = 10_000_000;

/// The reference model: SPEC C.3 state in plain maps, every rule applied by full scans.
#[derive(Default)]
struct Model {
    config: StateStoreCoordinatorConfig,
    instances: HashMap<StateStoreProviderId, ExecutorCacheTaskLocation>,
    snapshots: HashMap<StateStoreProviderId, SnapshotUploadEvent>,
    last_full_report_ms: HashMap<Uuid, i64>,
    /// Runs deactivated earlier: their later reports are dropped (coordbus's documented
    /// choice; the cases use far fewer runs than it remembers).
    deactivated: HashSet<Uuid>,
}

fn valid_id(id: &StateStoreProviderId) -> bool {
    let store = &id.store_id;
    !store.checkpoint_root_location.as_str().is_empty()
        && !store.store_name.as_str().is_empty()
        && store.operator_id >= 0
        && store.partition_id >= 0
}

fn valid_location(location: &ExecutorCacheTaskLocation) -> bool {
    !location.host.as_str().is_empty() && !location.executor_id.as_str().is_empty()
}

impl Model {
    fn report(
        &mut self,
        id: StateStoreProviderId,
        location: ExecutorCacheTaskLocation,
        check: &[StateStoreProviderId],
    ) -> Option<Vec<StateStoreProviderId>> {
        // A malformed id in `check` is only not returned: no report can have recorded it.
        if !valid_id(&id) || !valid_location(&location) {
            return None;
        }
        if !self.deactivated.contains(&id.query_run_id) {
            self.instances.insert(id, location);
        }
        Some(
            check
                .iter()
                .filter(|other| self.instances.get(other).is_some_and(|active| *active != location))
                .copied()
                .collect(),
        )
    }

    fn verify(&self, id: StateStoreProviderId, executor: &str) -> Option<bool> {
        if !valid_id(&id) || executor.is_empty() {
            return None;
        }
        Some(
            self.instances
                .get(&id)
                .is_some_and(|location| location.executor_id.as_str() == executor),
        )
    }

    fn location(&self, id: StateStoreProviderId) -> Option<Option<String>> {
        valid_id(&id).then(|| self.instances.get(&id).map(ToString::to_string))
    }

    fn deactivate(&mut self, run: Uuid) {
        self.instances.retain(|id, _| id.query_run_id != run);
        // coordbus drops every snapshot record of the run (documented choice).
        self.snapshots.retain(|id, _| id.query_run_id != run);
        self.last_full_report_ms.remove(&run);
        self.deactivated.insert(run);
    }

    fn snapshot(&mut self, id: StateStoreProviderId, version: i64, timestamp_ms: i64) -> bool {
        if !valid_id(&id) || version < 0 {
            return false;
        }
        if self.deactivated.contains(&id.query_run_id) {
            return true;
        }
        let event = SnapshotUploadEvent::new(version, timestamp_ms);
        match self.snapshots.get(&id) {
            Some(latest) if latest.version >= version => {}
            _ => {
                self.snapshots.insert(id, event);
            }
        }
        true
    }

    fn lagging(
        &self,
        run: Uuid,
        reference: i64,
        now_ms: i64,
        terminating: bool,
    ) -> Vec<LaggingStore> {
        if !self.config.report_snapshot_upload_lag {
            return Vec::new();
        }
        let version_threshold = i128::from(self.config.multiplier_for_min_version_diff_to_log)
            * i128::from(self.config.min_deltas_for_snapshot);
        let time_threshold = i128::from(self.config.multiplier_for_min_time_diff_to_log)
            * i128::from(self.config.maintenance_interval_ms);
        let mut lagging: Vec<LaggingStore> = self
            .instances
            .keys()
            .filter(|id| id.query_run_id == run)
            .filter_map(|id| {
                let latest = self.snapshots.get(id).copied().unwrap_or_default();
                let version_delta = i128::from(reference) - i128::from(latest.version);
                let time_delta = i128::from(now_ms) - i128::from(latest.timestamp_ms);
                (version_delta > version_threshold && (terminating || time_delta > time_threshold))
                    .then_some(LaggingStore {
                        provider_id: *id,
                        latest_snapshot: latest,
                        version_delta: version_delta as i64,
                        time_delta_ms: time_delta as i64,
                    })
            })
            .collect();
        lagging.sort_by_key(|store| (store.latest_snapshot, store.provider_id));
        lagging
    }

    fn log_lagging(
        &mut self,
        run: Uuid,
        reference: i64,
        now_ms: i64,
        terminating: bool,
    ) -> LagReport {
        let lagging = self.lagging(run, reference, now_ms, terminating);
        if lagging.is_empty() {
            return LagReport::default();
        }
        let last = self.last_full_report_ms.get(&run).copied().unwrap_or(0);
        let full_report = if now_ms - last > self.config.snapshot_lag_report_interval_ms {
            self.last_full_report_ms.insert(run, now_ms);
            lagging.iter().take(self.config.max_lagging_stores_to_report).copied().collect()
        } else {
            Vec::new()
        };
        LagReport { lagging_count: lagging.len(), full_report }
    }
}

const LOCATIONS: [&str; 3] = ["/chk/a", "/chk/b", ""];
const HOSTS: [&str; 3] = ["h1", "h2", ""];
const EXECUTORS: [&str; 4] = ["e1", "e2", "e3", ""];
/// Small partition ids, and ids around and far beyond the end of the dense slot range.
const PARTITIONS: [i32; 8] = [-1, 0, 1, 2, 3, 65_535, 65_536, i32::MAX];

fn run_of(index: u8) -> Uuid {
    Uuid::from_u128(0x5000 + u128::from(index))
}

fn id_strategy() -> impl Strategy<Value = StateStoreProviderId> {
    let partition = prop_oneof![4 => -1..4i32, 1 => prop::sample::select(&PARTITIONS[5..])];
    (0..3usize, 0..2i64, partition, 0..3u8, prop::bool::weighted(0.05)).prop_map(
        |(location, operator, partition, run, other_store)| {
            let store = if other_store { "other" } else { "default" };
            StateStoreProviderId::new(
                StateStoreId::with_store_name(LOCATIONS[location], operator, partition, store),
                run_of(run),
            )
        },
    )
}

fn location_strategy() -> impl Strategy<Value = ExecutorCacheTaskLocation> {
    (prop::sample::select(&HOSTS[..]), prop::sample::select(&EXECUTORS[..]))
        .prop_map(|(host, executor)| ExecutorCacheTaskLocation::new(host, executor))
}

/// Versions and times are drawn around the thresholds (50 versions, 180 s, 300 s between full
/// reports), so the strict comparisons of SPEC C.4 are exercised at their boundaries.
fn version_strategy() -> impl Strategy<Value = i64> {
    prop_oneof![prop::sample::select(&[-1i64, 0, 1, 10, 49, 50, 51, 60][..]), 0..120i64]
}

fn reference_strategy() -> impl Strategy<Value = i64> {
    prop_oneof![prop::sample::select(&[0i64, 50, 51, 60, 100, 101, 110, 111][..]), 0..200i64]
}

fn age_strategy() -> impl Strategy<Value = i64> {
    prop_oneof![
        prop::sample::select(&[0i64, 1, 179_999, 180_000, 180_001, 500_000][..]),
        0..START_MS
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Report(StateStoreProviderId, ExecutorCacheTaskLocation),
    ReportAndCheck(StateStoreProviderId, ExecutorCacheTaskLocation, Vec<StateStoreProviderId>),
    Verify(StateStoreProviderId, &'static str),
    Location(StateStoreProviderId),
    Deactivate(u8),
    Snapshot(StateStoreProviderId, i64, i64),
    SnapshotTwice(StateStoreProviderId, i64, i64, i64),
    Lagging(u8, i64, bool),
    LogLagging(u8, i64, bool),
    Advance(i64),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (id_strategy(), location_strategy()).prop_map(|(id, at)| Op::Report(id, at)),
        3 => (id_strategy(), location_strategy(), prop::collection::vec(id_strategy(), 0..4))
            .prop_map(|(id, at, check)| Op::ReportAndCheck(id, at, check)),
        4 => (id_strategy(), prop::sample::select(&EXECUTORS[..]))
            .prop_map(|(id, executor)| Op::Verify(id, executor)),
        3 => id_strategy().prop_map(Op::Location),
        1 => (0..3u8).prop_map(Op::Deactivate),
        4 => (id_strategy(), version_strategy(), age_strategy()).prop_map(|(id, version, age)| {
            Op::Snapshot(id, version, START_MS - age)
        }),
        2 => (0..3u8, reference_strategy(), any::<bool>())
            .prop_map(|(run, v, t)| Op::Lagging(run, v, t)),
        // The same version uploaded again later (a retried upload): must not move the time.
        2 => (id_strategy(), version_strategy(), age_strategy(), age_strategy())
            .prop_map(|(id, version, first, second)| {
                Op::SnapshotTwice(id, version, START_MS - first, START_MS - second)
            }),
        3 => (0..3u8, reference_strategy(), any::<bool>())
            .prop_map(|(run, v, t)| Op::LogLagging(run, v, t)),
        3 => prop::sample::select(&[0i64, 1, 299_999, 300_000, 300_001][..]).prop_map(Op::Advance),
    ]
}

fn ids(stores: &[LaggingStore]) -> Vec<StateStoreProviderId> {
    stores.iter().map(|store| store.provider_id).collect()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 300,
        rng_seed: RngSeed::Fixed(0x5747_e570),
        ..ProptestConfig::default()
    })]

    #[test]
    fn state_machine_matches_the_reference_model(
        ops in prop::collection::vec(op_strategy(), 1..80),
        small_report in any::<bool>(),
    ) {
        let config = StateStoreCoordinatorConfig {
            max_lagging_stores_to_report: if small_report { 2 } else { 5 },
            ..Default::default()
        };
        let clock = ManualClock::new(START_MS);
        let mut coordinator = StateStoreCoordinator::with_clock(config.clone(), clock.clone())
            .unwrap();
        let mut model = Model { config, ..Model::default() };
        for op in ops {
            match op {
                Op::Report(id, at) => {
                    let ours = coordinator.report_active_instance(id, at);
                    prop_assert_eq!(ours.is_ok(), model.report(id, at, &[]).is_some());
                }
                Op::ReportAndCheck(id, at, check) => {
                    let ours = coordinator.report_active_instance_and_check(id, at, &check).ok();
                    prop_assert_eq!(ours, model.report(id, at, &check));
                }
                Op::Verify(id, executor) => {
                    let ours = coordinator.verify_if_instance_active(id, executor.into()).ok();
                    prop_assert_eq!(ours, model.verify(id, executor));
                }
                Op::Location(id) => {
                    prop_assert_eq!(coordinator.get_location(id).ok(), model.location(id));
                }
                Op::Deactivate(run) => {
                    coordinator.deactivate_instances(run_of(run));
                    model.deactivate(run_of(run));
                }
                Op::Snapshot(id, version, time) => {
                    let ours = coordinator.report_snapshot_uploaded(id, version, time).is_ok();
                    prop_assert_eq!(ours, model.snapshot(id, version, time));
                }
                Op::SnapshotTwice(id, version, first, second) => {
                    for time in [first, second] {
                        let ours = coordinator.report_snapshot_uploaded(id, version, time).is_ok();
                        prop_assert_eq!(ours, model.snapshot(id, version, time));
                    }
                    let ours =
                        coordinator.get_lagging_stores_for_testing(id.query_run_id, 111, false);
                    let theirs = model.lagging(id.query_run_id, 111, clock.now_ms(), false);
                    prop_assert_eq!(ours, ids(&theirs));
                }
                Op::Lagging(run, version, terminating) => {
                    let ours = coordinator
                        .get_lagging_stores_for_testing(run_of(run), version, terminating);
                    let theirs = model.lagging(run_of(run), version, clock.now_ms(), terminating);
                    prop_assert_eq!(ours, ids(&theirs));
                }
                Op::LogLagging(run, version, terminating) => {
                    let ours =
                        coordinator.log_lagging_state_stores(run_of(run), version, terminating);
                    let theirs =
                        model.log_lagging(run_of(run), version, clock.now_ms(), terminating);
                    prop_assert_eq!(ours, theirs);
                }
                Op::Advance(ms) => {
                    clock.advance_ms(ms);
                }
            }
        }
        // Final state: every id of the domain, valid or not, under both store names.
        let stores = LOCATIONS.into_iter().flat_map(|at| [(at, "default"), (at, "other")]);
        for (location, store) in stores {
            for operator in 0..2 {
                for partition in PARTITIONS {
                    for run in 0..3 {
                        let id = StateStoreProviderId::new(
                            StateStoreId::with_store_name(location, operator, partition, store),
                            run_of(run),
                        );
                        prop_assert_eq!(coordinator.get_location(id).ok(), model.location(id));
                        prop_assert_eq!(
                            coordinator.get_latest_snapshot_version_for_testing(id),
                            model.snapshots.get(&id).map(|event| event.version)
                        );
                    }
                }
            }
        }
        prop_assert_eq!(coordinator.active_instance_count(), model.instances.len());
    }
}

/// A small seeded generator (splitmix64), so each thread's sequence is fixed.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

/// What one reporter thread did, to check the coordinator's counters.
#[derive(Default, Debug)]
struct Tally {
    reports: u64,
    verifies: u64,
    location_queries: u64,
    deactivations: u64,
    snapshot_reports: u64,
    rejected: u64,
}

#[test]
fn concurrent_reporters_through_the_bus_match_their_own_models() {
    const THREADS: u64 = 4;
    const OPS: u64 = 600;
    let bus = Bus::builder().inbox_shards(4).inbox_capacity(256).build().unwrap();
    let clock = ManualClock::new(START_MS);
    let coordinator = StateStoreCoordinatorRef::for_driver_with(&bus, || {
        StateStoreCoordinatorEndpoint::with_clock(
            StateStoreCoordinatorConfig::default(),
            Arc::new(clock.clone()),
        )
        .unwrap()
    })
    .unwrap();

    let tallies: Vec<Tally> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|thread| {
                let coordinator = coordinator.clone();
                scope.spawn(move || {
                    let mut rng = SplitMix(0xc0ff_ee00 + thread);
                    // Two live runs and the one deactivated last (a third live run until the
                    // first deactivation). A deactivated run is over
                    // for good (its later reports are dropped), so its slot gets a fresh run,
                    // as a restarted query gets a new run id; the dead one stays in play to
                    // exercise the dropping.
                    let run_id =
                        |generation: u128| Uuid::from_u128((u128::from(thread) << 32) | generation);
                    let mut runs = [run_id(0), run_id(1), run_id(2)];
                    let mut generation = 3;
                    let mut model = Model::default();
                    let mut tally = Tally::default();
                    let pick_run = |rng: &mut SplitMix, runs: &[Uuid; 3]| {
                        runs[[0, 0, 0, 1, 1, 1, 2][rng.below(7) as usize]]
                    };
                    let random_id = |rng: &mut SplitMix, runs: &[Uuid; 3]| {
                        StateStoreProviderId::new(
                            StateStoreId::new(
                                LOCATIONS[rng.below(3) as usize],
                                rng.below(2) as i64,
                                rng.below(5) as i32 - 1,
                            ),
                            pick_run(rng, runs),
                        )
                    };
                    let random_location = |rng: &mut SplitMix| {
                        ExecutorCacheTaskLocation::new(
                            HOSTS[rng.below(3) as usize],
                            EXECUTORS[rng.below(4) as usize],
                        )
                    };
                    for _ in 0..OPS {
                        match rng.below(20) {
                            0..=7 => {
                                let (id, at) =
                                    (random_id(&mut rng, &runs), random_location(&mut rng));
                                tally.reports += 1;
                                if model.report(id, at, &[]).is_none() {
                                    tally.rejected += 1;
                                }
                                coordinator.report_active_instance(id, at).unwrap();
                            }
                            8..=9 => {
                                let (id, at) =
                                    (random_id(&mut rng, &runs), random_location(&mut rng));
                                let check: Vec<_> =
                                    (0..rng.below(4)).map(|_| random_id(&mut rng, &runs)).collect();
                                tally.reports += 1;
                                let expected = model.report(id, at, &check);
                                if expected.is_none() {
                                    tally.rejected += 1;
                                }
                                let ours =
                                    coordinator.report_active_instance_and_check(id, at, check);
                                assert_eq!(ours.ok(), expected);
                            }
                            10..=13 => {
                                let id = random_id(&mut rng, &runs);
                                let executor = EXECUTORS[rng.below(4) as usize];
                                tally.verifies += 1;
                                let expected = model.verify(id, executor);
                                if expected.is_none() {
                                    tally.rejected += 1;
                                }
                                let ours = coordinator.verify_if_instance_active(id, executor);
                                assert_eq!(ours.ok(), expected, "thread {thread} verify {id}");
                            }
                            14..=15 => {
                                let id = random_id(&mut rng, &runs);
                                tally.location_queries += 1;
                                let expected = model.location(id);
                                if expected.is_none() {
                                    tally.rejected += 1;
                                }
                                assert_eq!(coordinator.get_location(id).ok(), expected);
                            }
                            16 => {
                                let slot = rng.below(2) as usize;
                                let run = runs[slot];
                                tally.deactivations += 1;
                                model.deactivate(run);
                                assert!(coordinator.deactivate_instances(run).unwrap());
                                runs[2] = run;
                                runs[slot] = run_id(generation);
                                generation += 1;
                            }
                            17..=18 => {
                                let id = random_id(&mut rng, &runs);
                                let version = rng.below(130) as i64 - 1;
                                let time = rng.below(START_MS as u64) as i64;
                                tally.snapshot_reports += 1;
                                let accepted = model.snapshot(id, version, time);
                                if !accepted {
                                    tally.rejected += 1;
                                }
                                let ours = coordinator.report_snapshot_uploaded(id, version, time);
                                assert_eq!(ours.is_ok(), accepted);
                            }
                            _ => {
                                let run = pick_run(&mut rng, &runs);
                                let version = rng.below(200) as i64;
                                let terminating = rng.below(2) == 0;
                                let expected = model.lagging(run, version, START_MS, terminating);
                                let ours = coordinator
                                    .endpoint()
                                    .ask(GetLaggingStoresForTesting {
                                        query_run_id: run,
                                        latest_version: version,
                                        is_terminating_trigger: terminating,
                                    })
                                    .wait()
                                    .unwrap();
                                assert_eq!(ours, ids(&expected));
                            }
                        }
                    }
                    // Final view of every id this thread could touch.
                    for location in LOCATIONS {
                        for operator in 0..2 {
                            for partition in -1..4 {
                                for run in runs {
                                    let id = StateStoreProviderId::new(
                                        StateStoreId::new(location, operator, partition),
                                        run,
                                    );
                                    if !valid_id(&id) {
                                        continue;
                                    }
                                    assert_eq!(
                                        coordinator.get_location(id).unwrap(),
                                        model.instances.get(&id).map(ToString::to_string)
                                    );
                                    assert_eq!(
                                        coordinator
                                            .get_latest_snapshot_version_for_testing(id)
                                            .unwrap(),
                                        model.snapshots.get(&id).map(|event| event.version)
                                    );
                                    tally.location_queries += 1;
                                }
                            }
                        }
                    }
                    tally
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    });

    let counters = coordinator.counters().unwrap();
    let sum = |field: fn(&Tally) -> u64| tallies.iter().map(field).sum::<u64>();
    assert_eq!(counters.reports, sum(|tally| tally.reports));
    assert_eq!(counters.verifies, sum(|tally| tally.verifies));
    assert_eq!(counters.location_queries, sum(|tally| tally.location_queries));
    assert_eq!(counters.deactivations, sum(|tally| tally.deactivations));
    assert_eq!(counters.snapshot_reports, sum(|tally| tally.snapshot_reports));
    assert_eq!(counters.rejected, sum(|tally| tally.rejected));
    bus.shutdown().unwrap();
}
