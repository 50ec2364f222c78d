//! The lease pair, side by side in one run and robust to this VM's drift: an
//! uncontended `try_acquire` + `release` through Corral against raw pairs on the same
//! kind of connection (a plain `SET NX PX` + `EVALSHA` release, and Corral's very
//! scripts sent raw), and a Redlock over three servers against the same scripts sent
//! raw to the three in parallel. Rounds alternate the contenders; the table gives
//! medians of per-round ratios.
//!
//! `cargo bench -p corral-tests --bench lock_pair`. Prints a Markdown table.
//! `CORRAL_BENCH_ONLY=<n>` runs contender `n` alone (for a profiler).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use corral::locks::{LockOptions, RedisLocks};
use corral_tests::RedisServer;
use corral_tests::usage::client_cpu;
use redis::aio::ConnectionManager;

const PAIRS: usize = 2_000;
const ROUNDS: usize = 7;
const TOKEN: &str = "token-0123456789abcdef";

#[derive(Clone, Copy, Debug)]
enum Pair {
    /// `SET NX PX` and a compare-and-delete script, raw, on one server.
    RawSetNx,
    /// Corral's acquire and release scripts, raw, on one server.
    RawScripts,
    /// `try_acquire` + `release` on one server.
    Corral,
    /// Corral's scripts, raw, on three servers in parallel (each step joins the three;
    /// the release raises the counters to the largest token, as Redlock's does).
    RawScripts3,
    /// `try_acquire` + `release` of a Redlock on three servers.
    Redlock3,
}

struct Bench {
    /// One connection per server, with the settings Corral's connections use.
    conns: Vec<ConnectionManager>,
    scripts: [redis::Script; 3],
    one: RedisLocks,
    three: RedisLocks,
}

impl Bench {
    async fn one(&self, pair: Pair) {
        match pair {
            Pair::RawSetNx => {
                let mut conn = self.conns[0].clone();
                let ok: Option<String> = redis::cmd("SET")
                    .arg("raw-lock")
                    .arg(TOKEN)
                    .arg("NX")
                    .arg("PX")
                    .arg(10_000)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert!(ok.is_some());
                let n: u64 = self.scripts[0]
                    .key("raw-lock")
                    .arg(TOKEN)
                    .invoke_async(&mut conn)
                    .await
                    .unwrap();
                assert_eq!(n, 1);
            }
            Pair::RawScripts => self.raw_scripts(&self.conns[..1]).await,
            Pair::RawScripts3 => self.raw_scripts(&self.conns).await,
            Pair::Corral => Self::lease(&self.one).await,
            Pair::Redlock3 => Self::lease(&self.three).await,
        }
    }

    /// Corral's acquire, then its release, each sent to every one of `conns` at once,
    /// with the arguments Corral sends.
    async fn raw_scripts(&self, conns: &[ConnectionManager]) {
        let acquired = Self::on_all(conns, &self.scripts[1], 10_000).await;
        assert!(acquired.iter().all(|&token| token > 0));
        // As Corral's release: one server needs no counter raise; several are raised to
        // the largest token (Redlock's fencing).
        let fence = match conns.len() {
            1 => 0,
            _ => acquired.iter().copied().max().unwrap_or(0),
        };
        let released = Self::on_all(conns, &self.scripts[2], fence).await;
        assert!(released.iter().all(|&n| n == 1));
    }

    /// `script` on the raw lock and counter with the owner token and `last`, on every
    /// one of `conns` in parallel: the replies, in order.
    async fn on_all(conns: &[ConnectionManager], script: &redis::Script, last: u64) -> Vec<u64> {
        futures::future::join_all(conns.iter().map(|conn| {
            let mut conn = conn.clone();
            async move {
                let mut invocation = script.prepare_invoke();
                invocation.key("raw-lock2").key("raw-fence2").arg(TOKEN).arg(last);
                invocation.invoke_async::<u64>(&mut conn).await.unwrap()
            }
        }))
        .await
    }

    async fn lease(locks: &RedisLocks) {
        let options = LockOptions::new()
            .ttl(Duration::from_secs(10))
            .wait(Duration::ZERO);
        let lease = locks.try_acquire("k", options).await.unwrap().expect("free");
        lease.release().await.unwrap();
    }
}

impl Bench {
    /// The servers' CPU seconds so far (user + sys, summed).
    async fn server_cpu(&self) -> Result<f64> {
        let mut total = 0.0;
        for conn in &self.conns {
            let info: String = redis::cmd("INFO")
                .arg("cpu")
                .query_async(&mut conn.clone())
                .await?;
            for name in ["used_cpu_user:", "used_cpu_sys:"] {
                let field = info.lines().find_map(|l| l.strip_prefix(name));
                total += field.context(name)?.trim().parse::<f64>()?;
            }
        }
        Ok(total)
    }
}

/// `n` pairs of `pair` in a task of the runtime, as a service's handlers run them (not
/// on the thread `main` blocks): µs per pair.
async fn timed(bench: &std::sync::Arc<Bench>, pair: Pair, n: usize) -> f64 {
    let bench = bench.clone();
    let task = tokio::spawn(async move {
        let started = Instant::now();
        for _ in 0..n {
            bench.one(pair).await;
        }
        started.elapsed().as_secs_f64() * 1e6 / n as f64
    });
    task.await.expect("the bench task")
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
    let servers = (0..3).map(|_| RedisServer::start()).collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    // The settings Corral's connections use.
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(1);
    let mut conns = Vec::new();
    for url in &urls {
        let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())?
            .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let client = redis::Client::open(info)?;
        conns.push(client.get_connection_manager_with_config(config.clone()).await?);
    }
    let bench = std::sync::Arc::new(Bench {
        conns,
        scripts: [
            redis::Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            ),
            redis::Script::new(corral_core::script::LOCK_ACQUIRE),
            redis::Script::new(corral_core::script::LOCK_RELEASE),
        ],
        one: RedisLocks::connect(&urls[..1])?,
        three: RedisLocks::connect(&urls)?,
    });
    let pairs = [
        ("raw `SET NX PX` + `EVALSHA` release, 1 server", Pair::RawSetNx),
        (
            "raw `EVALSHA` pair (Corral's scripts), 1 server",
            Pair::RawScripts,
        ),
        ("Corral `try_acquire` + `release`, 1 server", Pair::Corral),
        (
            "raw `EVALSHA` pair (Corral's scripts), 3 servers in parallel",
            Pair::RawScripts3,
        ),
        (
            "Corral Redlock `try_acquire` + `release`, 3 servers",
            Pair::Redlock3,
        ),
    ];
    if let Some(only) = std::env::var("CORRAL_BENCH_ONLY")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
    {
        let (name, pair) = pairs[only];
        let n = PAIRS * 10;
        let (server_before, client_before) = (bench.server_cpu().await?, client_cpu());
        let wall = timed(&bench, pair, n).await;
        let per = |s: f64| s * 1e6 / n as f64;
        let server = per(bench.server_cpu().await? - server_before);
        let client = per(client_cpu() - client_before);
        println!(
            "{name}: {wall:.1} µs per pair; CPU per pair: servers {server:.1} µs, client {client:.1} µs"
        );
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut bench.conns[0].clone())
            .await?;
        let calls: Vec<String> = info
            .lines()
            .filter_map(|l| l.strip_prefix("cmdstat_")?.split_once(":calls="))
            .filter_map(|(cmd, rest)| {
                let calls: f64 = rest.split(',').next()?.parse().ok()?;
                (calls >= n as f64 / 2.0).then(|| format!("{cmd} {:.2}", calls / n as f64))
            })
            .collect();
        println!("commands per pair on the first server: {}", calls.join(", "));
        return Ok(());
    }
    for (_, p) in pairs {
        timed(&bench, p, 200).await;
    }
    let mut micros = vec![Vec::new(); pairs.len()];
    for round in 0..ROUNDS {
        eprintln!("round {} of {ROUNDS}", round + 1);
        for (i, (_, p)) in pairs.iter().enumerate() {
            micros[i].push(timed(&bench, *p, PAIRS).await);
        }
    }
    // The median over rounds of a's time over b's in the same round.
    let ratio = |a: usize, b: usize| median(micros[a].iter().zip(&micros[b]).map(|(x, y)| x / y).collect());
    println!("| what | µs per pair (median) |");
    println!("| --- | --- |");
    for (i, (name, _)) in pairs.iter().enumerate() {
        println!("| {name} | {:.1} |", median(micros[i].clone()));
    }
    println!();
    println!("| ratio | median of per-round ratios | target |");
    println!("| --- | --- | --- |");
    println!(
        "| Corral lease / raw pair running its scripts | {:.2}x | <= 1.1x |",
        ratio(2, 1)
    );
    println!(
        "| Corral lease / raw `SET NX PX` pair | {:.2}x | <= 1.2x |",
        ratio(2, 0)
    );
    println!(
        "| Corral Redlock 3 / Corral lease 1 | {:.2}x | <= 1.15x |",
        ratio(4, 2)
    );
    println!(
        "| raw scripts 3 / raw scripts 1 (the floor of the above) | {:.2}x | |",
        ratio(3, 1)
    );
    println!("| Corral Redlock 3 / raw scripts 3 | {:.2}x | |", ratio(4, 3));
    println!("\n({ROUNDS} rounds of {PAIRS} pairs, the contenders in turn within each round)");
    Ok(())
}
