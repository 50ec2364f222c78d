//! What fail-safe costs, side by side with an L2 hit, in one run, over a redis-server this
//! bench starts on a free loopback port (64-byte values, a manual clock standing still):
//!
//! - L2 hit: `get_or_set` of a fresh entry, L1 off: one `GET`.
//! - Stale, throttled: `get_or_set` of a stale entry whose reload failed once, loader
//!   failing, L1 on: the stale copy served from L1 for the throttle (contract §7.1).
//! - Stale, each reload failing: the same with L1 off, so every call reads the stale copy,
//!   takes the lock, reads again, runs the failing loader, and releases: the price of one
//!   failed reload, which the throttle pays once per interval per process.
//!
//! `cargo bench -p corral-tests --bench freshness`. Figures go to BENCHMARKS.md.

use std::hint::black_box;
use std::time::Duration;

use corral::{Corral, EntryOptions, LoadOptions, ManualClock};
use corral_tests::RedisServer;
use criterion::{Criterion, criterion_group, criterion_main};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn fail_safe(c: &mut Criterion) {
    let server = RedisServer::start().expect("redis-server (apt-get install redis-server)");
    let rt = runtime();
    let _entered = rt.enter();
    let clock = ManualClock::starting_now();
    let build = |l1: u64| {
        Corral::builder()
            .clock(clock.clone())
            .redis(server.url())
            .l1_capacity(l1)
            .build()
            .unwrap()
    };
    let (no_l1, with_l1) = (build(0), build(100_000));
    let options = LoadOptions::relative(Duration::from_secs(1)).fail_safe(Duration::from_secs(3600));
    rt.block_on(async {
        let long = EntryOptions::new().relative(Duration::from_secs(3600));
        no_l1.set("fresh", vec![7u8; 64], long).await.unwrap();
        for key in ["stale-l1", "stale-l2"] {
            no_l1
                .set(
                    key,
                    vec![7u8; 64],
                    EntryOptions::new()
                        .relative(Duration::from_secs(1))
                        .fail_safe(Duration::from_secs(3600)),
                )
                .await
                .unwrap();
        }
    });
    clock.advance(Duration::from_secs(2));
    let failing = || async { Err::<Vec<u8>, _>(std::io::Error::other("source down")) };
    let mut g = c.benchmark_group("fail-safe over Redis (64 B)");
    g.measurement_time(Duration::from_secs(4));
    g.bench_function("L2 hit: get_or_set, L1 off", |b| {
        b.to_async(&rt).iter(|| async {
            no_l1
                .get_or_set(black_box("fresh"), options.clone(), failing)
                .await
                .unwrap()
        })
    });
    g.bench_function("stale, throttled: get_or_set, loader failing, L1 on", |b| {
        b.to_async(&rt).iter(|| async {
            with_l1
                .get_or_set(black_box("stale-l1"), options.clone(), failing)
                .await
                .unwrap()
        })
    });
    g.bench_function("stale, each reload failing: get_or_set, L1 off", |b| {
        b.to_async(&rt).iter(|| async {
            no_l1
                .get_or_set(black_box("stale-l2"), options.clone(), failing)
                .await
                .unwrap()
        })
    });
    g.finish();
    let (a, b) = (no_l1.metrics(), with_l1.metrics());
    // With L1 on, a failed reload runs once per throttle, or again after an L1 flush.
    assert!(
        b.stale_served <= b.l1_flushes + 1 && b.l1_hits > 1_000 * b.loads,
        "{b:?}"
    );
    assert!(a.stale_served > 1, "{a:?}");
    println!(
        "L1 on: {} calls, {} failed reloads; L1 off: {} failed reloads",
        b.l1_hits + b.misses,
        b.loads,
        a.loads
    );
}

criterion_group!(benches, fail_safe);
criterion_main!(benches);
