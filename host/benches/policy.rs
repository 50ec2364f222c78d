//! What one decision costs across the wasm boundary, and what reads of the embedded
//! default cost: an L1 hit, and the in-memory L2 with L1 off.
//!
//! `cargo bench -p corral-cache --features test-util --bench policy`. Figures go to BENCHMARKS.md with the machine.

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

fn embedded_default(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let clock = ManualClock::starting_now();
    let with_l1 = Corral::builder().clock(clock.clone()).build().expect("cache");
    // L1 capacity 0 turns L1 off: every get reads the in-memory L2.
    let l2_only = Corral::builder()
        .clock(clock)
        .l1_capacity(0)
        .build()
        .expect("cache");
    rt.block_on(async {
        for cache in [&with_l1, &l2_only] {
            let sliding = EntryOptions::new().sliding(Duration::from_secs(600));
            cache.set("sliding", vec![7u8; 64], sliding).await.unwrap();
            cache
                .set(
                    "relative",
                    vec![7u8; 64],
                    EntryOptions::new().relative(Duration::from_secs(600)),
                )
                .await
                .unwrap();
        }
    });
    let mut group = c.benchmark_group("embedded default (64 B)");
    group.bench_function("get, L1 hit", |b| {
        b.to_async(&rt)
            .iter(|| async { with_l1.get(black_box("relative")).await.unwrap().unwrap() })
    });
    for key in ["relative", "sliding"] {
        group.bench_function(format!("get, in-memory L2 ({key}), L1 off"), |b| {
            b.to_async(&rt)
                .iter(|| async { l2_only.get(black_box(key)).await.unwrap().unwrap() })
        });
    }
    group.bench_function("set", |b| {
        b.to_async(&rt).iter(|| async {
            with_l1
                .set("w", vec![7u8; 64], EntryOptions::new())
                .await
                .unwrap()
        })
    });
    group.finish();
    assert_eq!(l2_only.metrics().l1_hits, 0, "the L1-off cache never hit L1");
}

criterion_group!(benches, policy_calls, embedded_default);
criterion_main!(benches);
