//! Per-message cost of the StateStoreCoordinator state machine (no bus), against a plain
//! `HashMap` model doing the same bookkeeping, in the same groups and the same run:
//! * `state_store/report`: a report of an already active provider (the steady state), with
//!   1k and 100k stores.
//! * `state_store/verify`: a verification of an active provider.
//! * `state_store/deactivate_100k`: deactivating a run of 100k stores while 100k stores of
//!   another run stay; the model scans its one map as Spark does.

// criterion's macros generate undocumented functions.
#![allow(missing_docs)]

use std::{collections::HashMap, hint::black_box, time::Duration};

use coordbus::coordinators::state_store::{
    ExecutorCacheTaskLocation, StateStoreCoordinator, StateStoreCoordinatorConfig, StateStoreId,
    StateStoreProviderId,
};
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use uuid::Uuid;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const STORES: usize = 100_000;

type Store = (StateStoreProviderId, ExecutorCacheTaskLocation);

fn stores(count: usize, run: u128, checkpoint: &str) -> Vec<Store> {
    let locations: Vec<_> = (0..1_000)
        .map(|executor| {
            ExecutorCacheTaskLocation::new(&format!("host-{}", executor / 8), &executor.to_string())
        })
        .collect();
    (0..count)
        .map(|index| {
            (
                StateStoreProviderId::new(
                    StateStoreId::new(checkpoint, (index / 200) as i64, (index % 200) as i32),
                    Uuid::from_u128(run),
                ),
                locations[index % locations.len()],
            )
        })
        .collect()
}

fn coordinator_with(stores: &[Store]) -> StateStoreCoordinator {
    let mut coordinator = StateStoreCoordinator::new(StateStoreCoordinatorConfig::default())
        .expect("default config is valid");
    for (id, location) in stores {
        coordinator.report_active_instance(*id, *location).expect("well-formed");
    }
    coordinator
}

fn model_with(stores: &[Store]) -> HashMap<StateStoreProviderId, ExecutorCacheTaskLocation> {
    stores.iter().copied().collect()
}

fn report(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("state_store/report");
    group.throughput(Throughput::Elements(1));
    // 1k stores stay in the first-level caches; 100k (about 6 MB of table) do not.
    for count in [1_000, STORES] {
        let stores = stores(count, 1, "/bench/report");
        let mut coordinator = coordinator_with(&stores);
        let mut cursor = stores.iter().cycle();
        group.bench_function(BenchmarkId::new("coordinator", count), |bencher| {
            bencher.iter(|| {
                let (id, location) = cursor.next().expect("cycle");
                coordinator
                    .report_active_instance(black_box(*id), black_box(*location))
                    .expect("well-formed");
            });
        });
        let mut model = model_with(&stores);
        let mut cursor = stores.iter().cycle();
        group.bench_function(BenchmarkId::new("hashmap_model", count), |bencher| {
            bencher.iter(|| {
                let (id, location) = cursor.next().expect("cycle");
                black_box(model.insert(black_box(*id), black_box(*location)));
            });
        });
    }
    group.finish();
}

fn verify(criterion: &mut Criterion) {
    let stores = stores(STORES, 2, "/bench/verify");
    let mut group = criterion.benchmark_group("state_store/verify");
    group.throughput(Throughput::Elements(1));
    let mut coordinator = coordinator_with(&stores);
    let mut cursor = stores.iter().cycle();
    group.bench_function("coordinator", |bencher| {
        bencher.iter(|| {
            let (id, location) = cursor.next().expect("cycle");
            assert!(coordinator
                .verify_if_instance_active(black_box(*id), location.executor_id)
                .expect("well-formed"));
        });
    });
    let model = model_with(&stores);
    let mut cursor = stores.iter().cycle();
    group.bench_function("hashmap_model", |bencher| {
        bencher.iter(|| {
            let (id, location) = cursor.next().expect("cycle");
            assert!(model
                .get(black_box(id))
                .is_some_and(|found| found.executor_id == location.executor_id));
        });
    });
    group.finish();
}

fn deactivate(criterion: &mut Criterion) {
    let doomed = stores(STORES, 3, "/bench/doomed");
    let staying = stores(STORES, 4, "/bench/staying");
    let run = Uuid::from_u128(3);
    let mut group = criterion.benchmark_group("state_store/deactivate_100k");
    group.throughput(Throughput::Elements(STORES as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    group.bench_function("coordinator", |bencher| {
        bencher.iter_batched(
            || {
                let mut coordinator = coordinator_with(&staying);
                for (id, location) in &doomed {
                    coordinator.report_active_instance(*id, *location).expect("well-formed");
                }
                coordinator
            },
            |mut coordinator| {
                assert_eq!(coordinator.deactivate_instances(run), STORES);
                coordinator
            },
            BatchSize::LargeInput,
        );
    });
    group.bench_function("hashmap_model_scan", |bencher| {
        bencher.iter_batched(
            || {
                let mut model = model_with(&staying);
                model.extend(doomed.iter().copied());
                model
            },
            |mut model| {
                let keys: Vec<_> =
                    model.keys().filter(|id| id.query_run_id == run).copied().collect();
                for key in &keys {
                    model.remove(key);
                }
                assert_eq!(keys.len(), STORES);
                model
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();
}

criterion_group!(benches, report, verify, deactivate);
criterion_main!(benches);
