//! L2 reads at Redis's own cost, side by side in one run: 64 concurrent callers on one
//! connection, and one caller alone, reading a 64 B value through Corral (L1 off) and
//! through a raw redis-rs `GET` on the same kind of connection. Besides throughput, it
//! reads the server's own CPU time per operation from `INFO cpu`, so a read that costs
//! Redis more than a `GET` (a Lua script) shows up even when the network hides it.
//!
//! `cargo bench -p corral-tests --bench l2_concurrent`. Prints a Markdown table for
//! BENCHMARKS.md. Rounds alternate the contenders so drift in this VM hits them alike.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use corral::{Corral, EntryOptions};
use corral_tests::RedisServer;
use corral_tests::usage::{client_cpu, context_switches};
use redis::aio::ConnectionManager;

const CALLERS: usize = 64;
const OPS_PER_CALLER: usize = 1_500;
const SOLO_OPS: usize = 4_000;
const ROUNDS: usize = 7;

#[derive(Clone, Copy)]
enum Reader {
    Raw,
    /// A raw `GET` on a connection set up as Corral sets up its own (timeouts on).
    RawConfigured,
    /// A raw `GETEX PX`: what a sliding read costs Redis at the least.
    RawGetex,
    /// Every caller reads the same key.
    Corral(&'static str),
    /// Each caller reads a key of its own (`{prefix}{caller}`): nothing to share.
    CorralOwn(&'static str),
}

/// Server CPU seconds so far (user + sys, main thread included).
async fn server_cpu(conn: &mut ConnectionManager) -> Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    let field = |name: &str| -> Result<f64> {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .with_context(|| format!("no {name} in INFO cpu"))?
            .trim()
            .parse::<f64>()
            .context("a number")
    };
    Ok(field("used_cpu_user:")? + field("used_cpu_sys:")?)
}

/// The key `caller` reads with `reader` (named once per caller, as a service holds its
/// key: the bench measures the read, not the naming).
fn key_of(reader: Reader, caller: usize) -> String {
    match reader {
        Reader::Corral(key) => key.to_owned(),
        Reader::CorralOwn(prefix) => format!("{prefix}{caller}"),
        _ => "raw".to_owned(),
    }
}

async fn read(reader: Reader, key: &str, cache: &Corral, raw: &[ConnectionManager; 2]) {
    match reader {
        Reader::Raw | Reader::RawConfigured => {
            let mut conn = raw[matches!(reader, Reader::RawConfigured) as usize].clone();
            let v: Vec<u8> = redis::cmd("GET").arg("raw").query_async(&mut conn).await.unwrap();
            assert_eq!(v.len(), 96);
        }
        Reader::RawGetex => {
            let mut conn = raw[0].clone();
            let v: Vec<u8> = redis::cmd("GETEX")
                .arg("raw")
                .arg("PX")
                .arg(3_600_000)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(v.len(), 96);
        }
        Reader::Corral(_) | Reader::CorralOwn(_) => {
            let v = cache.get(key).await.unwrap().expect("a hit");
            assert_eq!(v.len(), 64);
        }
    }
}

/// (ops per second, server CPU µs per op) for `callers` tasks doing `ops` reads each.
async fn measure(
    reader: Reader,
    callers: usize,
    ops: usize,
    cache: &Corral,
    raw: &[ConnectionManager; 2],
    probe: &mut ConnectionManager,
) -> Result<(f64, f64)> {
    let cpu0 = server_cpu(probe).await?;
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let (cache, raw) = (cache.clone(), raw.clone());
            tokio::spawn(async move {
                let key = key_of(reader, caller);
                for _ in 0..ops {
                    read(reader, &key, &cache, &raw).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed();
    let cpu = server_cpu(probe).await? - cpu0;
    let total = (callers * ops) as f64;
    Ok((total / elapsed.as_secs_f64(), cpu * 1e6 / total))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// On a machine with two or more cores, puts the server on the last core and this
/// process (every thread) on the others, so that client and server stop trading one
/// core back and forth. With `CORRAL_BENCH_PIN=1` only: on this 2-core VM it steadies
/// the figures but leaves the client one core, which makes every contender client-bound.
fn pin_apart(server: &RedisServer) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 || !std::env::var("CORRAL_BENCH_PIN").is_ok_and(|v| v == "1") {
        return;
    }
    let Some(pid) = server.pid() else { return };
    let last = (cores - 1).to_string();
    let rest = if cores == 2 {
        "0".to_owned()
    } else {
        format!("0-{}", cores - 2)
    };
    let me = std::process::id().to_string();
    for (cpus, pid) in [(last.as_str(), pid.to_string()), (rest.as_str(), me)] {
        let pinned = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", cpus, &pid])
            .stdout(std::process::Stdio::null())
            .status();
        if !pinned.is_ok_and(|s| s.success()) {
            eprintln!("(taskset is missing or failed: the client and the server share the cores)");
            return;
        }
    }
    eprintln!("redis-server on core {last}, this bench on core(s) {rest}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(()); // `cargo test --benches` lists benches; nothing to list here.
    }
    let server = RedisServer::start()?;
    pin_apart(&server);
    let cache = Corral::builder().redis(server.url()).l1_capacity(0).build()?;
    let hour = Duration::from_secs(3600);
    cache
        .set("relative", vec![7u8; 64], EntryOptions::new().relative(hour))
        .await?;
    cache
        .set("sliding", vec![7u8; 64], EntryOptions::new().sliding(hour))
        .await?;
    for caller in 0..CALLERS {
        let relative = EntryOptions::new().relative(hour);
        cache
            .set(&format!("relative-{caller}"), vec![7u8; 64], relative)
            .await?;
        let sliding = EntryOptions::new().sliding(hour);
        cache
            .set(&format!("sliding-{caller}"), vec![7u8; 64], sliding)
            .await?;
    }
    let info = redis::IntoConnectionInfo::into_connection_info(server.url().as_str())?
        .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    let client = redis::Client::open(info)?;
    let configured = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(1);
    let raw = [
        client.get_connection_manager().await?,
        client.get_connection_manager_with_config(configured).await?,
    ];
    let mut probe = client.get_connection_manager().await?;
    redis::cmd("SET")
        .arg("raw")
        .arg(vec![7u8; 96])
        .query_async::<()>(&mut probe.clone())
        .await?;

    let contenders = [
        ("raw redis-rs `GET`", Reader::Raw),
        (
            "raw redis-rs `GET`, Corral's connection settings",
            Reader::RawConfigured,
        ),
        ("raw redis-rs `GETEX PX`", Reader::RawGetex),
        ("Corral `get`, relative entry (`GET`)", Reader::Corral("relative")),
        ("Corral `get`, sliding entry (`GETEX`)", Reader::Corral("sliding")),
        (
            "Corral `get`, relative, a key per caller",
            Reader::CorralOwn("relative-"),
        ),
        (
            "Corral `get`, sliding, a key per caller",
            Reader::CorralOwn("sliding-"),
        ),
    ];
    // CORRAL_BENCH_ONLY=<n> runs contender n alone, long, for a profiler.
    if let Some(n) = std::env::var("CORRAL_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        // One caller with CORRAL_BENCH_SOLO=1.
        let solo = std::env::var_os("CORRAL_BENCH_SOLO").is_some();
        let (callers, ops) = if solo {
            (1, SOLO_OPS * 10)
        } else {
            (CALLERS, OPS_PER_CALLER * 4)
        };
        let sent = cache.redis_commands_sent().unwrap_or(0);
        let (client, switches) = (client_cpu(), context_switches());
        let (tput, cpu) = measure(contenders[n].1, callers, ops, &cache, &raw, &mut probe).await?;
        let sent = cache.redis_commands_sent().unwrap_or(0) - sent;
        let reads = (callers * ops) as f64;
        println!(
            "{}, {callers} caller(s): {tput:.0} reads/s, {cpu:.2} µs Redis CPU per read, {:.3} Corral commands per read, client CPU {:.1} µs and {:.2} context switches per read",
            contenders[n].0,
            sent as f64 / reads,
            (client_cpu() - client) * 1e6 / reads,
            (context_switches() - switches) as f64 / reads,
        );
        return Ok(());
    }
    // Warm up every path (connections, the script cache, the sliding-key memory).
    for (_, r) in contenders {
        measure(r, 8, 200, &cache, &raw, &mut probe).await?;
    }
    // Per round, each contender's figures as ratios to the raw `GET` of the same round:
    // drift in this VM moves a whole round, and the median of the ratios ignores it.
    let mut results = vec![(Vec::new(), Vec::new(), Vec::new()); contenders.len()];
    let mut ratios = vec![(Vec::new(), Vec::new(), Vec::new()); contenders.len()];
    for round in 0..ROUNDS {
        eprintln!("round {} of {ROUNDS}", round + 1);
        for (i, (_, r)) in contenders.iter().enumerate() {
            let (tput, cpu) = measure(*r, CALLERS, OPS_PER_CALLER, &cache, &raw, &mut probe).await?;
            let (solo, _) = measure(*r, 1, SOLO_OPS, &cache, &raw, &mut probe).await?;
            results[i].0.push(tput);
            results[i].1.push(cpu);
            results[i].2.push(1e6 / solo);
        }
        for i in 0..contenders.len() {
            let base = (results[0].0[round], results[0].1[round], results[0].2[round]);
            ratios[i].0.push(results[i].0[round] / base.0);
            ratios[i].1.push(results[i].1[round] / base.1);
            ratios[i].2.push(results[i].2[round] / base.2);
        }
    }
    let ratios: Vec<(f64, f64, f64)> = ratios
        .into_iter()
        .map(|(t, c, s)| (median(t), median(c), median(s)))
        .collect();
    let summary: Vec<(f64, f64, f64)> = results
        .into_iter()
        .map(|(t, c, s)| (median(t), median(c), median(s)))
        .collect();
    println!(
        "| what | {CALLERS} callers: reads/s | ratio | Redis CPU per read | ratio | 1 caller: µs per read | ratio |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (((name, _), (tput, cpu, solo)), (rt, rc, rs)) in contenders.iter().zip(&summary).zip(&ratios) {
        println!("| {name} | {tput:.0} | {rt:.2}x | {cpu:.2} µs | {rc:.2}x | {solo:.1} µs | {rs:.2}x |");
    }
    println!("\n(medians of {ROUNDS} rounds; ratios are medians of per-round ratios to the raw `GET`)");
    assert_eq!(cache.metrics().l1_hits, 0, "every read went to L2");
    Ok(())
}
