//! What one decision costs across the wasm boundary, and what an in-memory read costs.
//!
//! `cargo bench -p corral --bench policy`. Figures go to BENCHMARKS.md with the machine.

use std::hint::black_box;
use std::time::Duration;

use corral::{Corral, EntryOptions, ManualClock};
use criterion::{Criterion, criterion_group, criterion_main};

fn policy_calls(c: &mut Criterion) {
    let cache = Corral::builder().build().expect("cache");
    let policy = cache.policy().clone();
    let mut group = c.benchmark_group("guest call");
    group.bench_function("validate_key", |b| {
        b.iter(|| policy.validate_key(black_box("user:42")).unwrap())
    });
    let meta = {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            cache
                .set("k", "v", EntryOptions::new().sliding(Duration::from_secs(60)))
                .await
                .unwrap();
            cache.inspect("k").await.unwrap().unwrap().meta
        })
    };
    let now = meta.expires_at_ms - 30_000;
    group.bench_function("check (sliding touch)", |b| {
        b.iter(|| policy.check(black_box(&meta), black_box(now)).unwrap())
    });
    group.finish();
}

fn memory_get(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let clock = ManualClock::starting_now();
    let cache = Corral::builder().clock(clock).build().expect("cache");
    rt.block_on(async {
        cache
            .set(
                "sliding",
                vec![7u8; 64],
                EntryOptions::new().sliding(Duration::from_secs(600)),
            )
            .await
            .unwrap();
        cache
            .set(
                "relative",
                vec![7u8; 64],
                EntryOptions::new().relative(Duration::from_secs(600)),
            )
            .await
            .unwrap();
    });
    let mut group = c.benchmark_group("in-memory L2 get (L1 off)");
    for key in ["relative", "sliding"] {
        group.bench_function(key, |b| {
            b.to_async(&rt)
                .iter(|| async { cache.get(black_box(key)).await.unwrap().unwrap() })
        });
    }
    group.bench_function("set 64 B", |b| {
        b.to_async(&rt)
            .iter(|| async { cache.set("w", vec![7u8; 64], EntryOptions::new()).await.unwrap() })
    });
    group.finish();
}

criterion_group!(benches, policy_calls, memory_get);
criterion_main!(benches);
