//! The lease pair, side by side in one run and robust to this VM's drift: an
//! uncontended `try_acquire` + `release` through Corral against raw pairs on the same
//! kind of connection (a plain `SET NX PX` + `EVALSHA` release, and Corral's very
//! scripts sent raw). Rounds alternate the contenders; the table gives medians of the
//! per-round ratios to the raw pair running Corral's scripts.
//!
//! `cargo bench -p corral-tests --bench lock_pair`. Prints a Markdown table.

use std::time::{Duration, Instant};

use anyhow::Result;
use corral::locks::{LockOptions, RedisLocks};
use corral_tests::RedisServer;
use redis::aio::ConnectionManager;

const PAIRS: usize = 2_000;
const ROUNDS: usize = 7;

#[derive(Clone, Copy, Debug)]
enum Pair {
    RawSetNx,
    RawScripts,
    Corral,
}

async fn one(pair: Pair, conn: &ConnectionManager, scripts: &[redis::Script; 3], locks: &RedisLocks) {
    let mut conn = conn.clone();
    match pair {
        Pair::RawSetNx => {
            let ok: Option<String> = redis::cmd("SET")
                .arg("raw-lock")
                .arg("token-0123456789abcdef")
                .arg("NX")
                .arg("PX")
                .arg(10_000)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(ok.is_some());
            let n: u64 = scripts[0]
                .key("raw-lock")
                .arg("token-0123456789abcdef")
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(n, 1);
        }
        Pair::RawScripts => {
            let token: u64 = scripts[1]
                .key("raw-lock2")
                .key("raw-fence2")
                .arg("token-0123456789abcdef")
                .arg(10_000)
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert!(token > 0);
            let n: u64 = scripts[2]
                .key("raw-lock2")
                .key("raw-fence2")
                .arg("token-0123456789abcdef")
                .arg("0")
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(n, 1);
        }
        Pair::Corral => {
            let options = LockOptions::new()
                .ttl(Duration::from_secs(10))
                .wait(Duration::ZERO);
            let lease = locks.try_acquire("k", options).await.unwrap().expect("free");
            lease.release().await.unwrap();
        }
    }
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
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let info = redis::IntoConnectionInfo::into_connection_info(server.url().as_str())?
        .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    // The settings Corral's connections use.
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(1);
    let conn = redis::Client::open(info)?
        .get_connection_manager_with_config(config)
        .await?;
    let scripts = [
        redis::Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
        ),
        redis::Script::new(corral_core::script::LOCK_ACQUIRE),
        redis::Script::new(corral_core::script::LOCK_RELEASE),
    ];
    let pairs = [
        ("raw `SET NX PX` + `EVALSHA` release", Pair::RawSetNx),
        (
            "raw `EVALSHA` acquire (Corral's script) + `EVALSHA` release (Corral's)",
            Pair::RawScripts,
        ),
        ("Corral `try_acquire` + `release`, 1 server", Pair::Corral),
    ];
    for (_, p) in pairs {
        for _ in 0..200 {
            one(p, &conn, &scripts, &locks).await;
        }
    }
    let mut micros = vec![Vec::new(); pairs.len()];
    let mut ratios = vec![Vec::new(); pairs.len()];
    for round in 0..ROUNDS {
        eprintln!("round {} of {ROUNDS}", round + 1);
        let mut this = Vec::new();
        for (_, p) in pairs {
            let t = Instant::now();
            for _ in 0..PAIRS {
                one(p, &conn, &scripts, &locks).await;
            }
            this.push(t.elapsed().as_secs_f64() * 1e6 / PAIRS as f64);
        }
        for i in 0..pairs.len() {
            micros[i].push(this[i]);
            ratios[i].push(this[i] / this[1]);
        }
    }
    println!("| what | µs per pair | ratio to Corral's scripts raw | ratio to raw SET NX pair |");
    println!("| --- | --- | --- | --- |");
    let base_setnx: Vec<f64> = micros[0].clone();
    for (i, (name, _)) in pairs.iter().enumerate() {
        let to_setnx = median(micros[i].iter().zip(&base_setnx).map(|(a, b)| a / b).collect());
        println!(
            "| {name} | {:.1} | {:.2}x | {to_setnx:.2}x |",
            median(micros[i].clone()),
            median(ratios[i].clone())
        );
    }
    println!("\n(medians of {ROUNDS} rounds of {PAIRS} pairs; ratios are medians of per-round ratios)");
    Ok(())
}
