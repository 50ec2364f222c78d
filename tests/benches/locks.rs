//! Lock costs side by side, in one run, against redis-servers this bench starts:
//!
//! - an uncontended acquire + release against a raw `SET NX PX` + `EVALSHA` release pair;
//! - Redlock over 3 servers against a lease on 1 (parallel fan-out).
//!
//! `cargo bench -p corral-tests --bench locks`. Figures go to BENCHMARKS.md.

use std::time::Duration;

use corral::locks::{LockOptions, RedisLocks};
use corral_tests::RedisServer;
use criterion::{Criterion, criterion_group, criterion_main};

fn locks(c: &mut Criterion) {
    let servers: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start().expect("redis-server"))
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let one = RedisLocks::connect(&[servers[0].url()]).unwrap();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let three = RedisLocks::connect(&urls).unwrap();
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    );
    let (raw, raw_configured) = rt.block_on(async {
        let info = redis::IntoConnectionInfo::into_connection_info(servers[0].url().as_str())
            .unwrap()
            .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let client = redis::Client::open(info).unwrap();
        // The settings Corral's lock connections use: 500 ms connect and response timeouts.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_response_timeout(Some(Duration::from_millis(500)))
            .set_number_of_retries(1);
        (
            client.get_connection_manager().await.unwrap(),
            client.get_connection_manager_with_config(config).await.unwrap(),
        )
    });
    let options = LockOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Duration::ZERO);

    let mut g = c.benchmark_group("lock acquire + release (uncontended)");
    for (name, raw) in [
        ("raw SET NX PX + EVALSHA", &raw),
        (
            "raw SET NX PX + EVALSHA, Corral's connection settings",
            &raw_configured,
        ),
    ] {
        g.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                let mut conn = raw.clone();
                let release = &release;
                async move {
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
                    let n: u64 = release
                        .key("raw-lock")
                        .arg("token-0123456789abcdef")
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                    assert_eq!(n, 1);
                }
            })
        });
    }
    // The very scripts Corral runs (corral-core's acquire with the fencing floor and
    // INCR, and its release), raw, on Corral's connection settings.
    let acquire = redis::Script::new(corral_core::script::LOCK_ACQUIRE);
    let corral_release = redis::Script::new(corral_core::script::LOCK_RELEASE);
    g.bench_function(
        "raw EVALSHA acquire+INCR + EVALSHA release (Corral's scripts)",
        |b| {
            b.to_async(&rt).iter(|| {
                let mut conn = raw_configured.clone();
                let (acquire, release) = (&acquire, &corral_release);
                async move {
                    let token: u64 = acquire
                        .key("raw-lock2")
                        .key("raw-fence2")
                        .arg("token-0123456789abcdef")
                        .arg(10_000)
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                    assert!(token > 0);
                    let n: u64 = release
                        .key("raw-lock2")
                        .key("raw-fence2")
                        .arg("token-0123456789abcdef")
                        .arg("0")
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                    assert_eq!(n, 1);
                }
            })
        },
    );
    g.bench_function("corral lease, 1 server", |b| {
        b.to_async(&rt).iter(|| async {
            one.try_acquire("k", options)
                .await
                .unwrap()
                .unwrap()
                .release()
                .await
                .unwrap()
        })
    });
    g.bench_function("corral Redlock, 3 servers", |b| {
        b.to_async(&rt).iter(|| async {
            three
                .try_acquire("k", options)
                .await
                .unwrap()
                .unwrap()
                .release()
                .await
                .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, locks);
criterion_main!(benches);
