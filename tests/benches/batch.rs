//! Many keys at once, side by side in one run, on one real redis-server:
//! - 100 keys that are L2 hits (L1 off): one `get_or_set_many`, 100 concurrent
//!   `get_or_set` calls, and a raw redis-rs `MGET` of the same 100 entries, with 64-byte
//!   values; the bulk call and the raw `MGET` again with 1 KiB values;
//! - the bulk call's own work: the same 100 hits in the in-memory L2, no network;
//! - a cold stampede of 4 caches (4 registries and L1s, as 4 processes would have) x 250
//!   callers, each asking for 10 random keys of 100: through the bulk call, and through
//!   10 concurrent single-key calls per caller. Commands sent, loader calls, p99.
//!
//! `cargo bench -p corral-tests --bench batch`. Prints Markdown tables for
//! BENCHMARKS.md. The bulk call and the raw `MGET` take turns batch by batch, so drift in
//! this VM hits them alike.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use corral::{Corral, EntryOptions, LoadOptions};
use corral_tests::RedisServer;
use corral_tests::usage::{client_cpu, context_switches};
use redis::aio::ConnectionManager;

const KEYS: usize = 100;
const BATCHES_PER_ROUND: usize = 300;
const ROUNDS: usize = 7;

#[derive(Clone, Copy, Debug)]
enum Reader {
    RawMget,
    Bulk,
    Singles,
}

fn options() -> LoadOptions {
    EntryOptions::new().relative(Duration::from_secs(3600)).into()
}

async fn read_all(
    reader: Reader,
    cache: &Corral,
    keys: &[String],
    names: &[String],
    raw: &ConnectionManager,
) {
    match reader {
        Reader::RawMget => {
            let mut conn = raw.clone();
            let found: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
                .arg(names)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(found.iter().all(Option::is_some));
        }
        Reader::Bulk => {
            let found = cache
                .get_or_set_many(keys, options(), |_: Vec<String>| async {
                    Err::<Vec<(String, Vec<u8>)>, _>(std::io::Error::other("all are hits"))
                })
                .await
                .unwrap();
            assert!(found.iter().all(|v| matches!(v, Ok(Some(_)))));
        }
        Reader::Singles => {
            let reads = keys.iter().map(|k| {
                cache.get_or_set(k, options(), || async {
                    Err::<Vec<u8>, _>(std::io::Error::other("a hit"))
                })
            });
            let found = futures::future::join_all(reads).await;
            assert!(found.iter().all(Result::is_ok));
        }
    }
}

/// 100 keys written through `writer` with `value_bytes`-byte values, and their entries'
/// names (for the raw `MGET`).
async fn written(writer: &Corral, value_bytes: usize) -> Result<(Vec<String>, Vec<String>)> {
    let keys: Vec<String> = (0..KEYS).map(|i| format!("hit{value_bytes}-{i}")).collect();
    writer
        .get_or_set_many(&keys, options(), |asked: Vec<String>| async move {
            Ok::<_, std::io::Error>(
                asked
                    .into_iter()
                    .map(|k| (k, vec![7u8; value_bytes]))
                    .collect::<Vec<_>>(),
            )
        })
        .await?;
    let names = keys
        .iter()
        .map(|k| writer.entry_name(k))
        .collect::<corral::Result<_>>()?;
    Ok((keys, names))
}

/// The bulk call's own work, with no network to hide it: a cache on the in-memory L2
/// (the embedded default), L1 off, and 100 keys written there with 64-byte values.
async fn in_memory_hits() -> Result<(Corral, Vec<String>)> {
    let memory = Corral::builder().l1_capacity(0).build()?;
    let (keys, _) = written(&memory, 64).await?;
    Ok((memory, keys))
}

fn median(v: Vec<f64>) -> f64 {
    percentile(v, 0.5)
}

fn percentile(mut v: Vec<f64>, at: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * at) as usize).min(v.len() - 1)]
}

/// What one cold stampede cost.
struct Stampede {
    loader_calls: usize,
    keys_loaded: usize,
    commands: u64,
    p99: Duration,
    wall: Duration,
}

/// 4 caches x 250 callers, each asking for 10 random keys of 100 cold ones.
async fn stampede(url: &str, prefix: &str, bulk: bool) -> Result<Stampede> {
    let mut caches = Vec::new();
    for _ in 0..4 {
        let mut options = corral::RedisOptions::new(url);
        options.prefix = prefix.into();
        let cache = Corral::builder().redis_options(options).build()?;
        cache.get("warm-up").await?;
        caches.push(cache);
    }
    let before: u64 = caches.iter().filter_map(Corral::redis_commands_sent).sum();
    let calls = Arc::new(AtomicUsize::new(0));
    let keys_loaded = Arc::new(AtomicUsize::new(0));
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for caller in 0..1_000 {
        let cache = caches[caller % 4].clone();
        let mut picked: Vec<String> = Vec::new();
        while picked.len() < 10 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let key = format!("k{}", seed % KEYS as u64);
            if !picked.contains(&key) {
                picked.push(key);
            }
        }
        let (calls, keys_loaded) = (calls.clone(), keys_loaded.clone());
        tasks.spawn(async move {
            let start = Instant::now();
            if bulk {
                let loader = |keys: Vec<String>| {
                    let (calls, keys_loaded) = (calls.clone(), keys_loaded.clone());
                    async move {
                        calls.fetch_add(1, Ordering::Relaxed);
                        keys_loaded.fetch_add(keys.len(), Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok::<_, std::io::Error>(
                            keys.into_iter()
                                .map(|k| (k, vec![7u8; 64]))
                                .collect::<HashMap<_, _>>(),
                        )
                    }
                };
                let found = cache.get_or_set_many(&picked, options(), loader).await.unwrap();
                assert!(found.iter().all(|v| matches!(v, Ok(Some(_)))));
            } else {
                let reads = picked.iter().map(|k| {
                    let (calls, keys_loaded) = (calls.clone(), keys_loaded.clone());
                    cache.get_or_set(k, options(), move || async move {
                        calls.fetch_add(1, Ordering::Relaxed);
                        keys_loaded.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok::<_, std::io::Error>(vec![7u8; 64])
                    })
                });
                for found in futures::future::join_all(reads).await {
                    found.unwrap();
                }
            }
            start.elapsed()
        });
    }
    let mut latencies = Vec::new();
    while let Some(took) = tasks.join_next().await {
        latencies.push(took?);
    }
    let wall = began.elapsed();
    latencies.sort();
    let after: u64 = caches.iter().filter_map(Corral::redis_commands_sent).sum();
    Ok(Stampede {
        loader_calls: calls.load(Ordering::Relaxed),
        keys_loaded: keys_loaded.load(Ordering::Relaxed),
        commands: after - before,
        p99: latencies[latencies.len() * 99 / 100 - 1],
        wall,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(()); // `cargo test --benches` lists benches; nothing to list here.
    }
    let server = RedisServer::start()?;
    // L1 off: every call reads L2.
    let cache = Corral::builder().redis(server.url()).l1_capacity(0).build()?;
    // Writes the entries the contenders read.
    let writer = Corral::builder().redis(server.url()).build()?;
    let raw = redis::Client::open(server.url())?
        .get_connection_manager()
        .await?;
    let contenders = [
        ("raw redis-rs `MGET` of the 100 entries", Reader::RawMget),
        ("Corral `get_or_set_many` of 100 keys", Reader::Bulk),
        ("100 concurrent Corral `get_or_set`", Reader::Singles),
    ];
    // CORRAL_BENCH_ONLY=<n> runs contender n alone, long, for a profiler; n = 3, the
    // bulk call on the in-memory L2 (its own work, no network).
    if let Some(n) = std::env::var("CORRAL_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        // CORRAL_BENCH_BATCHES=<count> sets how many batches (10,000 unless told).
        let batches = std::env::var("CORRAL_BENCH_BATCHES")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(10_000);
        if n == contenders.len() {
            let (memory, keys) = in_memory_hits().await?;
            let (started, cpu) = (Instant::now(), client_cpu());
            for _ in 0..batches {
                read_all(Reader::Bulk, &memory, &keys, &[], &raw).await;
            }
            println!(
                "Corral `get_or_set_many` of 100 keys in the in-memory L2: {:.1} µs per 100 keys, client CPU {:.1} µs",
                started.elapsed().as_secs_f64() * 1e6 / f64::from(batches),
                (client_cpu() - cpu) * 1e6 / f64::from(batches),
            );
            return Ok(());
        }
        let (keys, names) = written(&writer, 64).await?;
        let (started, cpu, switches) = (Instant::now(), client_cpu(), context_switches());
        for _ in 0..batches {
            read_all(contenders[n].1, &cache, &keys, &names, &raw).await;
        }
        println!(
            "{}: {:.0} µs per 100 keys, client CPU {:.0} µs and {:.2} context switches per 100 keys",
            contenders[n].0,
            started.elapsed().as_secs_f64() * 1e6 / f64::from(batches),
            (client_cpu() - cpu) * 1e6 / f64::from(batches),
            (context_switches() - switches) as f64 / f64::from(batches),
        );
        return Ok(());
    }
    // 64-byte values, every contender; 1 KiB values, the bulk call against the raw one.
    // The raw `MGET` and the bulk call take turns batch by batch (each goes first every
    // other time), so that the VM's drift hits both alike; the single-key calls, two
    // orders of magnitude slower, take rounds of their own between.
    for (value_bytes, contenders) in [(64, &contenders[..]), (1024, &contenders[..2])] {
        let (keys, names) = written(&writer, value_bytes).await?;
        for (_, reader) in contenders {
            for _ in 0..20 {
                read_all(*reader, &cache, &keys, &names, &raw).await;
            }
        }
        let mut per_batch: Vec<Vec<f64>> = vec![Vec::new(); contenders.len()];
        let mut pair_ratios = Vec::new();
        for round in 0..ROUNDS {
            for b in 0..BATCHES_PER_ROUND {
                let mut pair = [0.0; 2];
                for turn in 0..2 {
                    let i = (turn + b) % 2;
                    let started = Instant::now();
                    read_all(contenders[i].1, &cache, &keys, &names, &raw).await;
                    pair[i] = started.elapsed().as_secs_f64() * 1e6;
                }
                per_batch[0].push(pair[0]);
                per_batch[1].push(pair[1]);
                pair_ratios.push(pair[1] / pair[0]);
            }
            for (i, (_, reader)) in contenders.iter().enumerate().skip(2) {
                let started = Instant::now();
                for _ in 0..BATCHES_PER_ROUND / 10 {
                    read_all(*reader, &cache, &keys, &names, &raw).await;
                }
                per_batch[i].push(started.elapsed().as_secs_f64() * 1e6 / (BATCHES_PER_ROUND / 10) as f64);
            }
            eprintln!("{value_bytes}-byte values: round {}/{ROUNDS} done", round + 1);
        }
        let raw_us = median(per_batch[0].clone());
        println!(
            "| 100 L2 hits of {value_bytes}-byte values ({BATCHES_PER_ROUND} batches x {ROUNDS} rounds, median batch) | µs per 100 keys | vs raw `MGET` |"
        );
        println!("| --- | ---: | ---: |");
        for (i, (name, _)) in contenders.iter().enumerate() {
            let us = median(per_batch[i].clone());
            println!("| {name} | {us:.0} | {:.2}x |", us / raw_us);
        }
        println!(
            "| (the bulk call over the raw `MGET` beside it, batch by batch: median, p90) | | {:.2}x, {:.2}x |",
            median(pair_ratios.clone()),
            percentile(pair_ratios, 0.9)
        );
        println!();
    }

    // The bulk call's own work, with no network to hide it: the same 100 hits in the
    // in-memory L2 (the embedded default), L1 off.
    let (memory, keys) = in_memory_hits().await?;
    let mut per_batch = Vec::new();
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..BATCHES_PER_ROUND * 10 {
            read_all(Reader::Bulk, &memory, &keys, &[], &raw).await;
        }
        per_batch.push(started.elapsed().as_secs_f64() * 1e6 / (BATCHES_PER_ROUND * 10) as f64);
    }
    println!(
        "| 100 hits of 64-byte values in the in-memory L2, L1 off ({} batches x {ROUNDS} rounds, median) | µs per 100 keys |",
        BATCHES_PER_ROUND * 10
    );
    println!("| --- | ---: |");
    println!(
        "| Corral `get_or_set_many` of 100 keys | {:.1} |",
        median(per_batch)
    );
    println!();

    println!(
        "| cold stampede: 4 caches x 250 callers x 10 of 100 keys, loader 50 ms | loader calls | keys loaded | Redis commands | p99 | wall |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    // Each twice, in the order bulk, single, single, bulk: whichever runs first pays for
    // the process's first stampede (its caches, its connections), and a tail measured
    // once moves by tens of ms from run to run.
    let (bulk, singles) = ("`get_or_set_many`", "10 concurrent `get_or_set` per caller");
    for (round, (name, bulk)) in [(bulk, true), (singles, false), (singles, false), (bulk, true)]
        .into_iter()
        .enumerate()
    {
        let prefix = format!("stampede-{round}:");
        let s = stampede(&server.url(), &prefix, bulk).await?;
        println!(
            "| {name} (run {}) | {} | {} | {} | {:.0?} | {:.0?} |",
            round + 1,
            s.loader_calls,
            s.keys_loaded,
            s.commands,
            s.p99,
            s.wall
        );
    }
    Ok(())
}
