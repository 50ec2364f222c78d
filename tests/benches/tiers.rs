//! The cost of a hit, side by side with what it is built on, in one run:
//!
//! - L1 hit: `get_or_set` / `get` on a hot key against moka's own `future::Cache::get`.
//! - L2 hit (L1 empty): `get` against a raw redis-rs `GET`, both over a
//!   `ConnectionManager` to a redis-server this bench starts on a free loopback port.
//!
//! - L1 hit of an entry with two tags against one without (contract §7.5), same run.
//!
//! `cargo bench -p corral-tests --bench tiers`. Figures go to BENCHMARKS.md.

use std::hint::black_box;
use std::time::Duration;

use corral::{Corral, EntryOptions};
use corral_tests::RedisServer;
use criterion::{Criterion, criterion_group, criterion_main};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn l1_hit(c: &mut Criterion) {
    let rt = runtime();
    let moka: moka::future::Cache<String, bytes::Bytes> =
        moka::future::Cache::builder().max_capacity(100_000).build();
    let cache = Corral::builder().build().unwrap();
    let value = bytes::Bytes::from(vec![7u8; 64]);
    rt.block_on(async {
        moka.insert("hot".to_string(), value.clone()).await;
        cache
            .set(
                "hot",
                value.clone(),
                EntryOptions::new().relative(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
    });
    let mut g = c.benchmark_group("L1 hit (hot key, 64 B)");
    g.bench_function("moka future::Cache::get", |b| {
        b.to_async(&rt)
            .iter(|| async { moka.get(black_box("hot")).await.unwrap() })
    });
    g.bench_function("corral get_or_set", |b| {
        b.to_async(&rt).iter(|| async {
            cache
                .get_or_set(black_box("hot"), EntryOptions::new(), || async {
                    Ok::<_, std::io::Error>("never")
                })
                .await
                .unwrap()
        })
    });
    g.bench_function("corral get", |b| {
        b.to_async(&rt)
            .iter(|| async { cache.get(black_box("hot")).await.unwrap() })
    });
    g.finish();
    assert_eq!(cache.metrics().loads, 0, "every call was a hit");
}

fn l2_hit(c: &mut Criterion) {
    let server = RedisServer::start().expect("redis-server (apt-get install redis-server)");
    let rt = runtime();
    let _entered = rt.enter();
    // L1 of capacity 0: every read goes to L2.
    let cache = Corral::builder()
        .redis(server.url())
        .l1_capacity(0)
        .build()
        .unwrap();
    let raw = rt.block_on(async {
        cache
            .set(
                "warm",
                vec![7u8; 64],
                EntryOptions::new().sliding(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
        cache
            .set(
                "fixed",
                vec![7u8; 64],
                EntryOptions::new().relative(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
        let info = redis::IntoConnectionInfo::into_connection_info(server.url().as_str())
            .unwrap()
            .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let client = redis::Client::open(info).unwrap();
        let mut raw = client.get_connection_manager().await.unwrap();
        redis::cmd("SET")
            .arg("raw")
            .arg(vec![7u8; 96])
            .query_async::<()>(&mut raw)
            .await
            .unwrap();
        raw
    });
    let mut g = c.benchmark_group("L2 hit (empty L1, 64 B, loopback redis)");
    g.bench_function("raw redis-rs GET", |b| {
        b.to_async(&rt).iter(|| {
            let mut raw = raw.clone();
            async move {
                redis::cmd("GET")
                    .arg("raw")
                    .query_async::<Vec<u8>>(&mut raw)
                    .await
                    .unwrap()
            }
        })
    });
    g.bench_function("corral get (relative)", |b| {
        b.to_async(&rt)
            .iter(|| async { cache.get(black_box("fixed")).await.unwrap().unwrap() })
    });
    g.bench_function("corral get (sliding, touch in the same trip)", |b| {
        b.to_async(&rt)
            .iter(|| async { cache.get(black_box("warm")).await.unwrap().unwrap() })
    });
    g.finish();
    let m = cache.metrics();
    assert_eq!(m.l1_hits, 0, "every read went to L2");
    drop(server);
}

/// An L1 hit of an entry carrying two tags against one carrying none, side by side:
/// the tagged hit checks the tag epoch (one atomic load), nothing else. Another tag's
/// invalidation between the samples would send tagged reads to L2: none happens here.
fn l1_hit_tagged(c: &mut Criterion) {
    let rt = runtime();
    let cache = Corral::builder().build().unwrap();
    let value = bytes::Bytes::from(vec![7u8; 64]);
    let long = EntryOptions::new().relative(Duration::from_secs(3600));
    rt.block_on(async {
        cache.set("plain", value.clone(), long).await.unwrap();
        cache
            .set_tagged("tagged", value.clone(), long, &["team:7", "users"])
            .await
            .unwrap();
        // Both are L1 hits from here on.
        assert!(cache.get("plain").await.unwrap().is_some());
        assert!(cache.get("tagged").await.unwrap().is_some());
    });
    let before = cache.metrics();
    let mut g = c.benchmark_group("L1 hit, two tags vs none (64 B)");
    for key in ["plain", "tagged"] {
        g.bench_function(format!("corral get, {key}"), |b| {
            b.to_async(&rt)
                .iter(|| async { cache.get(black_box(key)).await.unwrap() })
        });
        g.bench_function(format!("corral get_or_set, {key}"), |b| {
            b.to_async(&rt).iter(|| async {
                cache
                    .get_or_set(black_box(key), EntryOptions::new(), || async {
                        Ok::<_, std::io::Error>("never")
                    })
                    .await
                    .unwrap()
            })
        });
    }
    g.finish();
    let m = cache.metrics();
    assert_eq!(
        (m.l2_hits, m.misses),
        (before.l2_hits, before.misses),
        "every read was an L1 hit"
    );
}

criterion_group!(benches, l1_hit, l1_hit_tagged, l2_hit);
criterion_main!(benches);
