//! Corral on a local Redis Cluster (3 masters, 3 replicas, started by the bench), side by
//! side in one run: L2 hits (L1 off) with 64 concurrent callers and with one, against a
//! raw `GET` through the `redis` crate's own cluster connection; then a cold-key
//! stampede of four caches x 250 callers: loader calls and the commands it cost.
//!
//! `cargo bench -p corral-tests --bench cluster`. Prints Markdown for BENCHMARKS.md.
//! `CORRAL_BENCH_ONLY=<n>` (with `CORRAL_BENCH_SOLO=1` for one caller) runs contender n
//! alone, long, for a profiler.
//!
//! Each Corral read is set beside the raw command it sends, on a connection with Corral's
//! settings (its floor): a sliding entry's `GETEX` costs a cluster more than a `GET`, since
//! the master hands each one on to its replica.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use corral::{Corral, EntryOptions};
use corral_tests::RedisCluster;
use corral_tests::usage::{client_cpu, context_switches};
use redis::cluster_async::ClusterConnection;

const CALLERS: usize = 64;
const OPS_PER_CALLER: usize = 1_000;
const SOLO_OPS: usize = 3_000;
const ROUNDS: usize = 9;

#[derive(Clone, Copy)]
enum Reader {
    /// A raw `GET` on the cluster client's default connection.
    Raw,
    /// A raw `GET`, or a `GETEX` if `true`, on a connection with Corral's settings.
    RawAsCorral(bool),
    Corral(&'static str),
}

/// Raw cluster connections: the client's defaults, and Corral's own settings (timeouts,
/// no retries, `TCP_NODELAY`).
#[derive(Clone)]
struct Raws {
    default: ClusterConnection,
    settings: ClusterConnection,
    /// The raw keys read, in the slots of Corral's relative and sliding entries: each
    /// raw read goes to the master its Corral read goes to.
    keys: [Arc<str>; 2],
}

async fn read(reader: Reader, cache: &Corral, raw: &Raws) {
    match reader {
        Reader::Raw => {
            let mut conn = raw.default.clone();
            let v: Vec<u8> = redis::cmd("GET")
                .arg(&*raw.keys[0])
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(v.len(), 96);
        }
        Reader::RawAsCorral(sliding) => {
            let mut conn = raw.settings.clone();
            let mut cmd = redis::cmd(if sliding { "GETEX" } else { "GET" });
            cmd.arg(&*raw.keys[usize::from(sliding)]);
            if sliding {
                cmd.arg("PX").arg(3_600_000);
            }
            let v: Vec<u8> = cmd.query_async(&mut conn).await.unwrap();
            assert_eq!(v.len(), 96);
        }
        Reader::Corral(key) => {
            let v = cache.get(key).await.unwrap().expect("a hit");
            assert_eq!(v.len(), 64);
        }
    }
}

/// Reads per second for `callers` tasks doing `ops` reads each.
async fn measure(reader: Reader, callers: usize, ops: usize, cache: &Corral, raw: &Raws) -> f64 {
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
    let raw = Raws {
        default: redis::cluster::ClusterClient::new(cluster.urls())?
            .get_async_connection()
            .await?,
        // As `corral::store::link` builds its cluster client.
        settings: redis::cluster::ClusterClient::builder(cluster.urls())
            .connection_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_secs(1))
            .retries(0)
            .tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true))
            .build()?
            .get_async_connection()
            .await?,
        keys: ["relative", "sliding"].map(|key| {
            let entry = cache.entry_name(key).expect("a good key");
            Arc::from(format!("{}:raw", entry.trim_end_matches(":e")))
        }),
    };
    for key in &raw.keys {
        redis::cmd("SET")
            .arg(&**key)
            .arg(vec![7u8; 96])
            .query_async::<()>(&mut raw.default.clone())
            .await?;
    }

    // Each contender, and the index of the contender that is its floor.
    let contenders = [
        ("raw redis-rs cluster `GET`", Reader::Raw, 0),
        (
            "raw cluster `GET`, Corral's connection settings",
            Reader::RawAsCorral(false),
            1,
        ),
        (
            "raw cluster `GETEX PX`, Corral's connection settings",
            Reader::RawAsCorral(true),
            2,
        ),
        (
            "Corral `get`, relative entry (`GET`)",
            Reader::Corral("relative"),
            1,
        ),
        (
            "Corral `get`, sliding entry (`GETEX`)",
            Reader::Corral("sliding"),
            2,
        ),
    ];
    for (_, r, _) in contenders {
        measure(r, 8, 200, &cache, &raw).await;
    }
    // CORRAL_BENCH_ONLY=<n> runs contender n alone, long, for a profiler: 64 callers, or
    // one with CORRAL_BENCH_SOLO=1.
    if let Some(n) = std::env::var("CORRAL_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let solo = std::env::var_os("CORRAL_BENCH_SOLO").is_some();
        let (callers, ops) = if solo {
            (1, SOLO_OPS * 20)
        } else {
            (CALLERS, OPS_PER_CALLER * 4)
        };
        let sent = cache.redis_store().map_or(0, |s| s.commands_sent());
        let (cpu, switches) = (client_cpu(), context_switches());
        let tput = measure(contenders[n].1, callers, ops, &cache, &raw).await;
        let sent = cache.redis_store().map_or(0, |s| s.commands_sent()) - sent;
        let reads = (callers * ops) as f64;
        println!(
            "{}, {callers} caller(s): {tput:.0} reads/s ({:.1} µs per read per caller), {:.3} Corral commands per read, client CPU {:.1} µs and {:.2} context switches per read",
            contenders[n].0,
            1e6 * callers as f64 / tput,
            sent as f64 / reads,
            (client_cpu() - cpu) * 1e6 / reads,
            (context_switches() - switches) as f64 / reads,
        );
        return Ok(());
    }
    let mut tput = vec![Vec::new(); contenders.len()];
    let mut solo = vec![Vec::new(); contenders.len()];
    // One caller's client CPU (µs) and context switches per read.
    let mut costs = vec![(Vec::new(), Vec::new()); contenders.len()];
    // Per contender: ratios to the raw `GET` and to its floor, 64 callers and one.
    let mut ratio = vec![[Vec::new(), Vec::new(), Vec::new(), Vec::new()]; contenders.len()];
    for round in 0..ROUNDS {
        eprintln!("round {} of {ROUNDS}", round + 1);
        for (i, (_, r, _)) in contenders.iter().enumerate() {
            tput[i].push(measure(*r, CALLERS, OPS_PER_CALLER, &cache, &raw).await);
            let (cpu, switches) = (client_cpu(), context_switches());
            solo[i].push(measure(*r, 1, SOLO_OPS, &cache, &raw).await);
            costs[i].0.push((client_cpu() - cpu) * 1e6 / SOLO_OPS as f64);
            costs[i]
                .1
                .push((context_switches() - switches) as f64 / SOLO_OPS as f64);
        }
        for (i, &(_, _, floor)) in contenders.iter().enumerate() {
            ratio[i][0].push(tput[i][round] / tput[0][round]);
            ratio[i][1].push(tput[i][round] / tput[floor][round]);
            ratio[i][2].push(solo[0][round] / solo[i][round]);
            ratio[i][3].push(solo[floor][round] / solo[i][round]);
        }
    }
    println!(
        "| what | {CALLERS} callers: reads/s | vs raw `GET` | vs its floor | 1 caller: µs per read | vs raw `GET` | vs its floor | client CPU per read | context switches per read |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (i, (name, _, _)) in contenders.iter().enumerate() {
        let (t, s) = (median(tput[i].clone()), median(solo[i].clone()));
        let [a, b, c, d] = ratio[i].clone().map(median);
        println!(
            "| {name} | {t:.0} | {a:.2}x | {b:.2}x | {:.1} µs | {c:.2}x | {d:.2}x | {:.1} µs | {:.2} |",
            1e6 / s,
            median(costs[i].0.clone()),
            median(costs[i].1.clone())
        );
    }
    println!(
        "\n(medians of {ROUNDS} rounds; ratios are medians of per-round ratios: of throughput for {CALLERS} callers, higher is faster; of time per read for one, higher is slower. A Corral read's floor is the raw command it sends, with Corral's connection settings. The client's CPU is the whole process's, in ticks of 10 ms)\n"
    );

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
