//! Corral on a local Redis Cluster (3 masters, 3 replicas, started by the bench), side by
//! side in one run: L2 hits (L1 off) with 64 concurrent callers and with one, against a
//! raw `GET` through the `redis` crate's own cluster connection; then a cold-key
//! stampede of four caches x 250 callers: loader calls and the commands it cost.
//!
//! `cargo bench -p corral-tests --bench cluster`. Prints Markdown for BENCHMARKS.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use corral::{Corral, EntryOptions};
use corral_tests::RedisCluster;
use redis::cluster_async::ClusterConnection;

const CALLERS: usize = 64;
const OPS_PER_CALLER: usize = 1_000;
const SOLO_OPS: usize = 3_000;
const ROUNDS: usize = 5;

#[derive(Clone, Copy)]
enum Reader {
    Raw,
    Corral(&'static str),
}

async fn read(reader: Reader, cache: &Corral, raw: &ClusterConnection) {
    match reader {
        Reader::Raw => {
            let mut conn = raw.clone();
            let v: Vec<u8> = redis::cmd("GET").arg("raw").query_async(&mut conn).await.unwrap();
            assert_eq!(v.len(), 96);
        }
        Reader::Corral(key) => {
            let v = cache.get(key).await.unwrap().expect("a hit");
            assert_eq!(v.len(), 64);
        }
    }
}

/// Reads per second for `callers` tasks doing `ops` reads each.
async fn measure(reader: Reader, callers: usize, ops: usize, cache: &Corral, raw: &ClusterConnection) -> f64 {
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (cache, raw) = (cache.clone(), raw.clone());
            tokio::spawn(async move {
                for _ in 0..ops {
                    read(reader, &cache, &raw).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (callers * ops) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    eprintln!("starting a 3+3 cluster");
    let cluster = RedisCluster::start(3, 1, Duration::from_secs(5))?;
    let cache = Corral::builder()
        .redis_cluster(cluster.urls())
        .l1_capacity(0)
        .build()?;
    let hour = Duration::from_secs(3600);
    cache
        .set("relative", vec![7u8; 64], EntryOptions::new().relative(hour))
        .await?;
    cache
        .set("sliding", vec![7u8; 64], EntryOptions::new().sliding(hour))
        .await?;
    let raw = redis::cluster::ClusterClient::new(cluster.urls())?
        .get_async_connection()
        .await?;
    redis::cmd("SET")
        .arg("raw")
        .arg(vec![7u8; 96])
        .query_async::<()>(&mut raw.clone())
        .await?;

    let contenders = [
        ("raw redis-rs cluster `GET`", Reader::Raw),
        ("Corral `get`, relative entry (`GET`)", Reader::Corral("relative")),
        ("Corral `get`, sliding entry (`GETEX`)", Reader::Corral("sliding")),
    ];
    for (_, r) in contenders {
        measure(r, 8, 200, &cache, &raw).await;
    }
    let mut tput = vec![Vec::new(); contenders.len()];
    let mut solo = vec![Vec::new(); contenders.len()];
    let mut ratio = vec![(Vec::new(), Vec::new()); contenders.len()];
    for round in 0..ROUNDS {
        eprintln!("round {} of {ROUNDS}", round + 1);
        for (i, (_, r)) in contenders.iter().enumerate() {
            tput[i].push(measure(*r, CALLERS, OPS_PER_CALLER, &cache, &raw).await);
            solo[i].push(measure(*r, 1, SOLO_OPS, &cache, &raw).await);
        }
        for i in 0..contenders.len() {
            ratio[i].0.push(tput[i][round] / tput[0][round]);
            ratio[i].1.push(solo[0][round] / solo[i][round]);
        }
    }
    println!("| what | {CALLERS} callers: reads/s | ratio | 1 caller: µs per read | ratio |");
    println!("| --- | --- | --- | --- | --- |");
    for (i, (name, _)) in contenders.iter().enumerate() {
        let (t, s) = (median(tput[i].clone()), median(solo[i].clone()));
        let (rt, rs) = (median(ratio[i].0.clone()), median(ratio[i].1.clone()));
        println!("| {name} | {t:.0} | {rt:.2}x | {:.1} µs | {rs:.2}x |", 1e6 / s);
    }
    println!("\n(medians of {ROUNDS} rounds; ratios are medians of per-round ratios to the raw `GET`)\n");

    // A stampede: four caches (four processes, as far as the cluster can tell) x 250
    // callers on one cold key whose loader takes 200 ms.
    let caches: Vec<Corral> = (0..4)
        .map(|_| Corral::builder().redis_cluster(cluster.urls()).build())
        .collect::<corral::Result<_>>()?;
    for c in &caches {
        c.get("warm-up").await?; // connect and subscribe first
    }
    let before: u64 = caches
        .iter()
        .map(|c| c.redis_store().unwrap().commands_sent())
        .sum();
    let loads = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in &caches {
        for _ in 0..250 {
            let (c, loads) = (c.clone(), loads.clone());
            tasks.spawn(async move {
                c.get_or_set("stampede", EntryOptions::new(), || async move {
                    loads.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok::<_, std::io::Error>("value")
                })
                .await
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let commands: u64 = caches
        .iter()
        .map(|c| c.redis_store().unwrap().commands_sent())
        .sum::<u64>()
        - before;
    println!(
        "| stampede on the cluster | callers | loader calls | commands sent | took |\n| --- | --- | --- | --- | --- |\n| 4 caches x 250 callers, one cold key | 1000 | {} | {commands} | {:.0} ms |",
        loads.load(Ordering::SeqCst),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
