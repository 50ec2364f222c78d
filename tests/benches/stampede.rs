//! 1,000 concurrent callers of one cold key with a 50 ms loader, side by side: moka's own
//! `get_with` (in-process single flight, nothing else) against Corral's `get_or_set` on the
//! embedded default and on a real redis-server. Prints loader calls and latency
//! percentiles; repeats each round several times on fresh keys.
//!
//! `cargo bench -p corral-tests --bench stampede`. Figures go to BENCHMARKS.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use corral::{Corral, EntryOptions};
use corral_tests::RedisServer;

const CALLERS: usize = 1_000;
const LOADER: Duration = Duration::from_millis(50);
const ROUNDS: usize = 5;

#[derive(Default)]
struct Stats {
    latencies: Vec<Duration>,
    loads: usize,
}

impl Stats {
    fn percentile(&mut self, p: f64) -> Duration {
        self.latencies.sort();
        let rank = ((p / 100.0) * self.latencies.len() as f64).ceil() as usize;
        self.latencies[rank.clamp(1, self.latencies.len()) - 1]
    }
}

async fn moka_round(key: String, stats: &mut Stats) {
    let cache: moka::future::Cache<String, Arc<Vec<u8>>> = moka::future::Cache::new(10_000);
    let loads = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..CALLERS {
        let (cache, loads, key) = (cache.clone(), loads.clone(), key.clone());
        tasks.spawn(async move {
            let start = Instant::now();
            cache
                .get_with(key, async move {
                    loads.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(LOADER).await;
                    Arc::new(b"report".to_vec())
                })
                .await;
            start.elapsed()
        });
    }
    while let Some(t) = tasks.join_next().await {
        stats.latencies.push(t.unwrap());
    }
    stats.loads += loads.load(Ordering::SeqCst);
}

async fn corral_round(cache: &Corral, key: String, stats: &mut Stats) {
    let loads = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..CALLERS {
        let (cache, loads, key) = (cache.clone(), loads.clone(), key.clone());
        tasks.spawn(async move {
            let start = Instant::now();
            cache
                .get_or_set(
                    &key,
                    EntryOptions::new().relative(Duration::from_secs(60)),
                    || async move {
                        loads.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(LOADER).await;
                        Ok::<_, std::io::Error>(b"report".to_vec())
                    },
                )
                .await
                .unwrap();
            start.elapsed()
        });
    }
    while let Some(t) = tasks.join_next().await {
        stats.latencies.push(t.unwrap());
    }
    stats.loads += loads.load(Ordering::SeqCst);
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing: run only for benches.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let server = RedisServer::start().expect("redis-server");
    let memory = Corral::builder().build().unwrap();
    let redis = Corral::builder().redis(server.url()).build().unwrap();
    let mut rows = Vec::new();
    for (name, cache) in [
        ("moka get_with", None),
        ("corral, embedded default", Some(&memory)),
        ("corral, redis-server", Some(&redis)),
    ] {
        let mut stats = Stats::default();
        for round in 0..ROUNDS {
            let key = format!("stampede:{round}");
            rt.block_on(async {
                match cache {
                    None => moka_round(key, &mut stats).await,
                    Some(c) => corral_round(c, key, &mut stats).await,
                }
            });
        }
        let (p50, p99) = (stats.percentile(50.0), stats.percentile(99.0));
        let max = *stats.latencies.last().unwrap();
        rows.push((name, stats.loads, p50, p99, max));
    }
    println!("{CALLERS} callers x {ROUNDS} rounds, {LOADER:?} loader");
    println!("| what | loader calls | p50 | p99 | max |");
    println!("| --- | --- | --- | --- | --- |");
    for (name, loads, p50, p99, max) in rows {
        println!("| {name} | {loads} | {p50:.1?} | {p99:.1?} | {max:.1?} |");
    }
}
