//! Tiered get-or-set with single flight (contract §5), against the in-memory L2 and
//! real redis-server processes; the multi-process stampede spawns real OS processes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use corral::{Corral, EntryOptions, ErrorKind, LoadOptions};
use corral_tests::{
    Backend, Fixture, RedisServer, command_calls, commands_processed, real_time, stampedes_at_a_barrier,
};
use tokio::sync::Notify;

const MIN: Duration = Duration::from_secs(60);

fn relative() -> LoadOptions {
    EntryOptions::new().relative(MIN).into()
}

/// `n` concurrent callers of one cold key, each with a loader that counts its calls and
/// sleeps `loader` before answering.
async fn stampede(cache: &Corral, key: &str, n: usize, loader: Duration) -> Result<(usize, Vec<Bytes>)> {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (cache, calls, key) = (cache.clone(), calls.clone(), key.to_owned());
        tasks.spawn(async move {
            cache
                .get_or_set(&key, relative(), || async move {
                    let call = calls.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(loader).await;
                    Ok::<_, std::io::Error>(format!("value from call {call}"))
                })
                .await
        });
    }
    let mut values = Vec::with_capacity(n);
    while let Some(r) = tasks.join_next().await {
        values.push(r??);
    }
    Ok((calls.load(Ordering::SeqCst), values))
}

async fn a_thousand_callers_get_one_load(backend: Backend) -> Result<()> {
    let _real_time = real_time().await;
    let f = Fixture::new(backend)?;
    let (calls, values) = stampede(&f.cache, "cold", 1_000, Duration::from_millis(500)).await?;
    assert_eq!(calls, 1, "one loader call for 1,000 callers");
    assert!(
        values.iter().all(|v| v == "value from call 0"),
        "everyone gets the same value"
    );
    assert_eq!(
        f.cache.flights_in_progress(),
        0,
        "the flight registry is empty afterwards"
    );
    let m = f.cache.metrics();
    assert_eq!((m.loads, m.coalesced, m.degraded), (1, 999, 0));
    // Served from L1 now, without a load.
    let (calls, _) = stampede(&f.cache, "cold", 10, Duration::ZERO).await?;
    assert_eq!(calls, 0);
    assert_eq!(f.cache.metrics().l1_hits, 10);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_callers_get_one_load_memory() -> Result<()> {
    a_thousand_callers_get_one_load(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_callers_get_one_load_redis() -> Result<()> {
    a_thousand_callers_get_one_load(Backend::Redis).await
}

/// Processes sharing one store (a redis-server, or one memory store) on the system
/// clock: a lock lapses by the store's clock, in real time.
struct Processes {
    server: Option<RedisServer>,
    store: corral::store::memory::MemoryStore,
    lock_ttl: Duration,
}

impl Processes {
    fn new(backend: Backend, lock_ttl: Duration) -> Result<Self> {
        Ok(Processes {
            server: match backend {
                Backend::Redis => Some(RedisServer::start()?),
                _ => None,
            },
            store: corral::store::memory::MemoryStore::new(Arc::new(corral::SystemClock), 1_000),
            lock_ttl,
        })
    }

    fn build(&self) -> Result<Corral> {
        let builder = Corral::builder()
            .lock_ttl(self.lock_ttl)
            .lock_wait(Duration::from_secs(10));
        Ok(match &self.server {
            Some(server) => {
                let mut options = corral::RedisOptions::new(server.url());
                options.prefix = corral_tests::PREFIX.into();
                builder.redis_options(options).build()?
            }
            None => builder.memory(self.store.clone()).build()?,
        })
    }
}

/// A loader slower than the get-or-set lock's TTL still fills, and loads once across
/// processes (contract §5.12): its leader renews the lock while the loader runs (a third
/// of the TTL on, as a lease's watchdog does), so another process asking meanwhile
/// waits for the value instead of taking a lapsed lock over and loading again. Real
/// time: the store lapses a lock by its own clock.
async fn a_loader_slower_than_the_lock_ttl_fills_once(backend: Backend) -> Result<()> {
    let _real_time = real_time().await;
    let processes = Processes::new(backend, Duration::from_secs(1))?;
    let (a, b) = (processes.build()?, processes.build()?);
    let loads = AtomicUsize::new(0);
    let started = Notify::new();
    let leader = a.get_or_set("k", relative(), || async {
        loads.fetch_add(1, Ordering::SeqCst);
        started.notify_one();
        // Three TTLs: the lock is renewed about nine times.
        tokio::time::sleep(Duration::from_secs(3)).await;
        Ok::<_, anyhow::Error>("slow")
    });
    let follower = async {
        started.notified().await;
        b.get_or_set("k", relative(), || async {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, anyhow::Error>("taken over")
        })
        .await
    };
    let (led, followed) = tokio::join!(leader, follower);
    assert_eq!(led?, "slow");
    assert_eq!(followed?, "slow", "the other process waited for the value");
    assert_eq!(loads.load(Ordering::SeqCst), 1, "one load across the processes");
    assert_eq!(a.metrics().fills_refused, 0);
    let c = processes.build()?;
    assert_eq!(c.get("k").await?.as_deref(), Some(&b"slow"[..]), "filled into L2");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_slower_than_the_lock_ttl_fills_once_memory() -> Result<()> {
    a_loader_slower_than_the_lock_ttl_fills_once(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_slower_than_the_lock_ttl_fills_once_redis() -> Result<()> {
    a_loader_slower_than_the_lock_ttl_fills_once(Backend::Redis).await
}

/// A removal made while a renewed load runs is never filled over, however long the load
/// outlives the removal's tombstone (a lock TTL and a second): the renewal checks the
/// entry with the lock, finds the tombstone, and ends the lock, so the load fills nothing
/// (contract §5.12). The caller still gets its value.
async fn a_removal_during_a_renewed_load_is_never_filled_over(backend: Backend) -> Result<()> {
    let _real_time = real_time().await;
    let processes = Processes::new(backend, Duration::from_millis(300))?;
    let (a, b) = (processes.build()?, processes.build()?);
    let removed = Notify::new();
    let leader = a.get_or_set("k", relative(), || async {
        b.remove("k").await?;
        removed.notify_one();
        // Past the tombstone's life (1.3 s) by a second.
        tokio::time::sleep(Duration::from_millis(2_300)).await;
        Ok::<_, anyhow::Error>("loaded before the removal")
    });
    let (value, ()) = tokio::join!(leader, removed.notified());
    assert_eq!(value?, "loaded before the removal", "the caller gets its value");
    let c = processes.build()?;
    assert_eq!(c.get("k").await?, None, "nothing filled over the removal");
    assert_eq!(a.metrics().fills_refused, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_during_a_renewed_load_is_never_filled_over_memory() -> Result<()> {
    a_removal_during_a_renewed_load_is_never_filled_over(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_during_a_renewed_load_is_never_filled_over_redis() -> Result<()> {
    a_removal_during_a_renewed_load_is_never_filled_over(Backend::Redis).await
}

/// A cold key's stampede in one process costs Redis three commands besides the
/// process's subscription: the read, the lock with the double-check's look at the
/// entry (one script), and the fill with the lock's release and the landing's
/// announcement (one script). A fresh process reads the prefix's generation in the same
/// `MGET` as the entry, and sends each script by its body the first time, so no call
/// pays a `NOSCRIPT` round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_stampede_costs_three_commands() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = corral::Corral::builder().redis(server.url()).build()?;
    let count = |command: &'static str| command_calls(&server, command);
    // The process subscribes as it starts, and a generation read that overlaps its first
    // subscription is not kept (announcements may have been missed before it): wait for
    // the subscription (its first L1 flush), so the stampede's read is the one kept.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cache.metrics().l1_flushes < 1 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (calls, _) = stampede(&cache, "cold", 1_000, Duration::from_millis(100)).await?;
    assert_eq!(calls, 1);
    let sent = cache.redis_commands_sent().context("a Redis cache")?;
    let (publish, noscript_retries) = (count("publish").await?, count("evalsha").await?);
    println!("1,000 callers on a cold key: {sent} commands, {publish} PUBLISH (in the release's script)");
    assert_eq!(
        sent, 4,
        "the subscription, then the generation and the read, lock-and-look, fill-release-and-announce"
    );
    assert_eq!(count("mget").await?, 1, "the generation read with the entry");
    assert_eq!(publish, 1, "the landing announced once");
    assert_eq!(noscript_retries, 0, "each script sent by its body the first time");
    let (calls, _) = stampede(&cache, "cold-2", 1_000, Duration::from_millis(100)).await?;
    assert_eq!(calls, 1);
    let second = cache.redis_commands_sent().unwrap() - sent;
    assert_eq!(second, 3, "once the generation is known: three");
    assert_eq!(count("mget").await?, 1, "the entry read alone");
    assert_eq!(count("evalsha").await?, 2, "the scripts by their hashes now");
    Ok(())
}

/// A fresh process reads the prefix's generation in one `MGET` with the entry under the
/// generation it expects (0): after another process's `clear` the two differ, and the
/// entry read with it (the cleared generation's, still in the store) is never served;
/// the flight reads the entry under the store's generation instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_process_never_serves_what_a_clear_left_in_the_generation_it_expected() -> Result<()> {
    let server = RedisServer::start()?;
    let before = Corral::builder().redis(server.url()).build()?;
    before
        .set(
            "k",
            "before the clear",
            EntryOptions::new().relative(Duration::from_secs(60)),
        )
        .await?;
    before.clear().await?;
    let fresh = Corral::builder().redis(server.url()).build()?;
    let v = fresh
        .get_or_set("k", relative(), || async {
            Ok::<_, std::io::Error>("loaded after it")
        })
        .await?;
    assert_eq!(v, "loaded after it");
    assert_eq!(fresh.metrics().loads, 1);
    // Named in the store's generation from then on.
    assert_eq!(fresh.get("k").await?.as_deref(), Some(&b"loaded after it"[..]));
    assert_eq!(before.get("k").await?.as_deref(), Some(&b"loaded after it"[..]));
    Ok(())
}

/// As above, with a slow Redis: the fresh process's first read (the generation, with the
/// entry under the generation it expects or alone) answers after the store timeout, and
/// Redis is quick again by the next command. The process never read the generation, so
/// none may stand in: the get-or-set loads (degraded) and touches nothing in the store,
/// rather than read (or write) under generation 0, which a clear left. The single key,
/// the batch, and a bypass (whose first step is the load, then a write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_process_behind_a_slow_first_reply_never_serves_what_a_clear_left() -> Result<()> {
    let server = RedisServer::start()?;
    let before = Corral::builder().redis(server.url()).build()?;
    for key in ["single", "batch", "bypass"] {
        let options = EntryOptions::new().relative(Duration::from_secs(60));
        before.set(key, "before the clear", options).await?;
    }
    before.clear().await?;
    for key in ["single", "batch", "bypass"] {
        let proxy = corral_tests::FaultProxy::start(server.addr())?;
        let mut options = corral::RedisOptions::new(proxy.url());
        options.response_timeout = Duration::from_millis(200);
        let fresh = Corral::builder().redis_options(options).build()?;
        // Connected (without reading the generation) before Redis turns slow.
        fresh.entries().ttl_ms("connect").await?;
        let left_by_the_clear = fresh.entry_name(key)?;
        proxy.set_latency(Duration::from_millis(300));
        let call = {
            let fresh = fresh.clone();
            tokio::spawn(async move {
                let loaded = format!("{key} loaded after it");
                let answer = match key {
                    "batch" => {
                        let answers = fresh
                            .get_or_set_many([key], relative(), move |keys: Vec<String>| {
                                let loaded: Vec<_> = keys.into_iter().map(|k| (k, loaded.clone())).collect();
                                std::future::ready(Ok::<_, std::io::Error>(loaded))
                            })
                            .await?;
                        answers.into_iter().next().context("one answer")??
                    }
                    _ => {
                        let options = relative().bypass(key == "bypass");
                        let v = fresh
                            .get_or_set(
                                key,
                                options,
                                move || async move { Ok::<_, std::io::Error>(loaded) },
                            )
                            .await?;
                        Some(v)
                    }
                };
                Ok::<_, anyhow::Error>(answer.map(|b| String::from_utf8_lossy(&b).into_owned()))
            })
        };
        // Quick again once the first read is on its slow way (its delay is fixed).
        let deadline = Instant::now() + Duration::from_secs(10);
        let reading = |c: &String| c == "GET" || c == "MGET";
        while !proxy.connections().iter().any(|c| c.commands.iter().any(reading)) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the first read never reached the proxy ({key}): {:?}",
                proxy.connections()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        proxy.set_latency(Duration::ZERO);
        let answer = call.await??;
        assert_eq!(answer, Some(format!("{key} loaded after it")), "{key}");
        let metrics = fresh.metrics();
        assert_eq!(metrics.loads, 1, "{key}");
        // The slow path was taken: the read's failure or the flight's degradation is
        // counted, whichever timeout fired first (the connection's or the flight's); a
        // bypass, which reads nothing, would have written under the current generation.
        assert!(
            key == "bypass" || metrics.l2_errors + metrics.degraded >= 1,
            "{key}: the first read was not slow: {metrics:?}"
        );
        let current = before.entry_name(key)?;
        assert_eq!(
            before.entries().get(&current).await?,
            None,
            "{key}: nothing is written while the generation is unknown"
        );
        let left = fresh
            .entries()
            .get(&left_by_the_clear)
            .await?
            .context("what the clear left")?;
        assert!(
            left.ends_with(b"before the clear"),
            "{key}: the old generation was written: {left:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_share_one_load_without_a_polling_storm() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let before = commands_processed(&server).await?;
    let (loads, client_commands) = four_processes(&["--redis", &server.url()]).await?;
    let server_commands = commands_processed(&server).await? - before - 1;
    println!(
        "4 x 250 callers: {loads} loader call(s), {client_commands} cache commands, {server_commands} server-side"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_share_one_load_on_a_cluster() -> Result<()> {
    let _real_time = real_time().await;
    let nodes = corral_tests::RedisCluster::shared()?;
    let prefix = format!("four-processes-{}:", std::process::id());
    let mut args: Vec<&str> = nodes
        .iter()
        .flat_map(|n| ["--redis-cluster", n.as_str()])
        .collect();
    args.extend(["--prefix", &prefix]);
    let (loads, client_commands) = four_processes(&args).await?;
    println!("4 x 250 callers on a cluster: {loads} loader call(s), {client_commands} cache commands");
    Ok(())
}

/// Four `corral stampede` processes of 250 callers each on one cold key, started at
/// once over the Redis that `redis_args` name: one load in all, a few commands each.
async fn four_processes(redis_args: &[&str]) -> Result<(u64, u64)> {
    let mut args = vec!["--callers", "250", "--loader-ms", "500", "--key", "shared"];
    args.extend(redis_args);
    let mut loads = 0;
    let mut client_commands = 0;
    for report in stampedes_at_a_barrier(4, &args)? {
        loads += report["loader_calls"].as_u64().context("loader_calls")?;
        client_commands += report["redis_commands"].as_u64().context("redis_commands")?;
        assert_eq!(report["callers"], 250);
        assert_eq!(report["errors"], 0);
    }
    assert_eq!(loads, 1, "one loader call across four processes");
    assert!(
        client_commands <= 30,
        "a few commands per process, not a polling storm: {client_commands}"
    );
    Ok((loads, client_commands))
}

/// A loader's own error type, as a service would map to a 404.
#[derive(Debug)]
struct NotFound(u64);

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "user {} not found", self.0)
    }
}

impl std::error::Error for NotFound {}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_error_reaches_every_coalesced_caller_and_nothing_is_cached() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let cache = f.cache.clone();
        tasks.spawn(async move {
            cache
                .get_or_set("k", relative(), || async {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Err::<Vec<u8>, _>(NotFound(42))
                })
                .await
        });
    }
    while let Some(r) = tasks.join_next().await {
        let e = r?.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Loader);
        // Leader and followers alike: the loader's own error, to map to a 404.
        assert_eq!(e.loader_error::<NotFound>().map(|n| n.0), Some(42), "{e:?}");
        let source = std::error::Error::source(&e).expect("the loader's error is the source");
        assert!(source.downcast_ref::<NotFound>().is_some());
        assert_eq!(e.to_string(), "loader failed: user 42 not found", "said once");
    }
    assert_eq!(f.cache.metrics().loads, 1);
    assert_eq!(f.cache.metrics().coalesced, 49);
    assert_eq!(f.cache.get("k").await?, None, "nothing cached");
    let v = f
        .cache
        .get_or_set("k", relative(), || async {
            Ok::<_, std::io::Error>("second try")
        })
        .await?;
    assert_eq!(v, "second try", "the next call loads again");
    assert_eq!(f.cache.metrics().loads, 2);
    assert_eq!(f.cache.flights_in_progress(), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_leader_hands_the_flight_over_and_leaks_nothing() -> Result<()> {
    let _real_time = real_time().await;
    let f = Fixture::new(Backend::Redis)?;
    let started = Arc::new(Notify::new());
    let leader = {
        let (cache, started) = (f.cache.clone(), started.clone());
        tokio::spawn(async move {
            cache
                .get_or_set("k", relative(), || async move {
                    started.notify_one();
                    std::future::pending::<()>().await;
                    Ok::<_, std::io::Error>("never")
                })
                .await
        })
    };
    started.notified().await; // the leader holds the lock and is loading
    let mut followers = tokio::task::JoinSet::new();
    for i in 0..10 {
        let cache = f.cache.clone();
        followers.spawn(async move {
            cache
                .get_or_set("k", relative(), move || async move {
                    Ok::<_, std::io::Error>(format!("from {i}"))
                })
                .await
        });
    }
    while f.cache.followers_of("k") < 10 {
        tokio::task::yield_now().await;
    }
    let began = Instant::now();
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    let mut values = Vec::new();
    while let Some(r) = followers.join_next().await {
        values.push(r??);
    }
    values.dedup();
    assert_eq!(values.len(), 1, "one new leader served everyone: {values:?}");
    let m = f.cache.metrics();
    // The abandoned lock was released (and the release announced), not left to block
    // the new leader until its 30 s TTL or the 5 s lock wait.
    assert_eq!((m.loads, m.degraded, m.lock_timeouts), (2, 0, 0));
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "soon after: {:?}",
        began.elapsed()
    );
    assert_eq!(f.cache.flights_in_progress(), 0);
    let server = f.redis.as_ref().expect("redis");
    let mut conn = server.connection().await?;
    let pttl: i64 = redis::cmd("PTTL")
        .arg("{5:test:k}:l")
        .query_async(&mut conn)
        .await?;
    assert_eq!(pttl, -2, "the lock key is gone");
    Ok(())
}

/// A leader whose loader panics: its own caller gets the panic as an error, and the
/// flight goes to a follower at once (no lock wait, no lock TTL), for both backends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_loader_panics_hands_the_flight_over_at_once() -> Result<()> {
    let _real_time = real_time().await;
    for backend in [Backend::Redis, Backend::Memory, Backend::Redis, Backend::Memory] {
        let f = Fixture::new(backend)?;
        let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let panicked_at = Arc::new(parking_lot::Mutex::new(None::<Instant>));
        let leader = {
            let (cache, started, go, at) =
                (f.cache.clone(), started.clone(), go.clone(), panicked_at.clone());
            tokio::spawn(async move {
                cache
                    .get_or_set("k", relative(), || async move {
                        started.notify_one();
                        go.notified().await;
                        *at.lock() = Some(Instant::now());
                        if at.lock().is_some() {
                            panic!("the database driver blew up");
                        }
                        Ok::<_, std::io::Error>("never")
                    })
                    .await
            })
        };
        started.notified().await;
        let mut followers = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let cache = f.cache.clone();
            followers.spawn(async move {
                let v = cache
                    .get_or_set("k", relative(), || async {
                        Ok::<_, std::io::Error>("taken over")
                    })
                    .await;
                (v, Instant::now())
            });
        }
        while f.cache.followers_of("k") < 10 {
            tokio::task::yield_now().await;
        }
        go.notify_one();
        let err = leader.await?.expect_err("the panic reaches its caller");
        assert_eq!(err.kind(), ErrorKind::Loader, "{err}");
        assert!(
            err.to_string().contains("panicked: the database driver blew up"),
            "{err}"
        );
        let mut slowest = Duration::ZERO;
        while let Some(r) = followers.join_next().await {
            let (v, at) = r?;
            assert_eq!(v?, "taken over", "{backend:?}");
            let at_panic = panicked_at.lock().expect("it panicked");
            slowest = slowest.max(at.duration_since(at_panic));
        }
        println!("{backend:?}: followers served {slowest:?} after the leader's panic");
        let m = f.cache.metrics();
        assert_eq!((m.loads, m.degraded, m.lock_timeouts), (2, 0, 0), "{backend:?}");
        // Typically 2-5 ms; the bound only separates "handed over" from a lock wait
        // (5 s) or the lock's TTL (30 s), with room for a machine under load, where the
        // new leader may meet the old one's lock before its background release lands.
        assert!(
            slowest < Duration::from_millis(2_500),
            "handed over at once, not after a lock wait: {slowest:?}"
        );
        assert_eq!(f.cache.flights_in_progress(), 0);
    }
    Ok(())
}

/// A load never overwrites a set or a removal made while it ran (fenced fills, contract
/// §5.12): its caller gets what it loaded, the store keeps the newer write. Before, the
/// load's plain `SET` won and brought the stale value back for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_never_overwrites_a_newer_set_or_remove() -> Result<()> {
    for backend in [Backend::Memory, Backend::Redis] {
        for newer in [Some("newer"), None] {
            let f = Fixture::with(backend, |b| b.l1_capacity(0))?;
            let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
            let leader = {
                let (cache, started, go) = (f.cache.clone(), started.clone(), go.clone());
                tokio::spawn(async move {
                    cache
                        .get_or_set("k", relative(), || async move {
                            started.notify_one();
                            go.notified().await;
                            Ok::<_, std::io::Error>("stale")
                        })
                        .await
                })
            };
            started.notified().await; // the load read its source before the write below
            match newer {
                Some(v) => f.cache.set("k", v, EntryOptions::new().relative(MIN)).await?,
                None => {
                    f.cache.remove("k").await?;
                }
            }
            go.notify_one();
            assert_eq!(leader.await??, "stale", "the loader's caller gets what it loaded");
            assert_eq!(
                f.cache.get("k").await?.as_deref(),
                newer.map(str::as_bytes),
                "{backend:?}: the newer write stays"
            );
            assert_eq!(f.cache.metrics().fills_refused, 1, "{backend:?}");
        }
    }
    Ok(())
}

/// The portable body's fills are fenced too (contract §5.12): a load's write lands only
/// where the key still holds what its read found. Here the key is written while the
/// loader runs (raw bytes, straight into Redis, from inside the loader); the fill must
/// leave them. Before, the portable body wrote its fill with a plain `SET` over them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portable_bodys_load_never_overwrites_a_newer_write() -> Result<()> {
    let server = RedisServer::start()?;
    let mut options = corral::RedisOptions::new(server.url());
    options.prefix = "portable-fence:".to_owned();
    let cache = corral::portable::PortableCache::builder()
        .redis_options(options)
        .build()?;
    let name = corral_core::names::name("portable-fence:", "k", corral_core::names::Kind::Entry);
    let url = server.url();
    let (writer_name, newer) = (name.clone(), b"written while the load ran".to_vec());
    let loaded = cache
        .get_or_set("k", EntryOptions::new().relative(MIN), move |_| {
            let mut conn = redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection())
                .map_err(|e| e.to_string())?;
            redis::cmd("SET")
                .arg(&writer_name)
                .arg(&newer)
                .query::<()>(&mut conn)
                .map_err(|e| e.to_string())?;
            Ok(b"loaded".to_vec())
        })
        .await?;
    assert_eq!(&loaded[..], b"loaded", "the loader's caller gets what it loaded");
    let mut conn = server.connection().await?;
    let stored: Option<Vec<u8>> = redis::cmd("GET").arg(&name).query_async(&mut conn).await?;
    assert_eq!(
        stored.as_deref(),
        Some(&b"written while the load ran"[..]),
        "the newer write stays"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_the_caller_gets_the_loaders_value() -> Result<()> {
    let _real_time = real_time().await;
    let lock_wait = Duration::from_secs(1);
    let mut f = Fixture::with(Backend::Redis, |b| b.lock_wait(lock_wait))?;
    f.redis.as_mut().expect("redis").kill();
    let began = Instant::now();
    let v = f
        .cache
        .get_or_set("k", relative(), || async {
            Ok::<_, std::io::Error>("fresh from the source")
        })
        .await?;
    let took = began.elapsed();
    assert_eq!(v, "fresh from the source");
    assert!(
        took < lock_wait + Duration::from_secs(1),
        "within lock wait plus loader time: {took:?}"
    );
    let m = f.cache.metrics();
    assert_eq!((m.loads, m.degraded), (1, 1));
    assert_eq!(f.cache.flights_in_progress(), 0);

    // The degraded value is kept in this process's L1 for the degraded second: the next
    // callers do not go to the source again; after it, they do.
    let loads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let again = || {
        let loads = loads.clone();
        f.cache.get_or_set("k", relative(), move || async move {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>("again from the source")
        })
    };
    for _ in 0..10 {
        assert_eq!(again().await?, "fresh from the source");
    }
    assert_eq!(
        loads.load(Ordering::SeqCst),
        0,
        "served from L1 while Redis is down"
    );
    f.clock.advance(Duration::from_millis(1_001));
    assert_eq!(again().await?, "again from the source");
    assert_eq!(loads.load(Ordering::SeqCst), 1, "the degraded second is over");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_l2_write_fails_the_caller_gets_the_value_and_l1_is_not_written() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    let server = Arc::new(parking_lot::Mutex::new(f.redis));
    let killer = server.clone();
    let v = f
        .cache
        .get_or_set("k", relative(), move || async move {
            // Redis dies while the value is being loaded.
            if let Some(s) = killer.lock().as_mut() {
                s.kill();
            }
            Ok::<_, std::io::Error>("loaded")
        })
        .await?;
    assert_eq!(v, "loaded");
    assert_eq!(f.cache.metrics().loads, 1);
    // Had L1 been written, this read would be an L1 hit; it goes to the dead L2 instead.
    let e = f.cache.get("k").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert_eq!(f.cache.metrics().l1_hits, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_should_cache_rejects_is_returned_but_not_cached() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    let options = || relative().should_cache(|v| v != b"error page");
    let v = f
        .cache
        .get_or_set("k", options(), || async { Ok::<_, std::io::Error>("error page") })
        .await?;
    assert_eq!(v, "error page");
    assert_eq!(f.cache.get("k").await?, None, "written to no tier");
    let v = f
        .cache
        .get_or_set("k", options(), || async { Ok::<_, std::io::Error>("good") })
        .await?;
    assert_eq!(v, "good");
    assert_eq!(f.cache.get("k").await?.as_deref(), Some(&b"good"[..]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypass_always_loads_and_writes_both_tiers() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    f.cache.set("k", "old", EntryOptions::new()).await?;
    let v = f
        .cache
        .get_or_set("k", relative().bypass(true), || async {
            Ok::<_, std::io::Error>("new")
        })
        .await?;
    assert_eq!(v, "new");
    assert_eq!(f.cache.metrics().loads, 1);
    assert_eq!(f.cache.get("k").await?.as_deref(), Some(&b"new"[..]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_fails_before_the_loader_runs() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let e = f
        .cache
        .get_or_set(" ", relative(), || async { Ok::<_, std::io::Error>("x") })
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind(), e.argument()),
        (ErrorKind::InvalidArgument, Some("key"))
    );
    let bad = EntryOptions::new().sliding(Duration::ZERO);
    let e = f
        .cache
        .get_or_set("k", bad, || async { Ok::<_, std::io::Error>("x") })
        .await
        .unwrap_err();
    assert_eq!(e.argument(), Some("sliding"));
    assert_eq!(f.cache.metrics().loads, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_process_is_woken_by_the_landing_not_by_polling() -> Result<()> {
    let _real_time = real_time().await;
    // Two caches on one Redis: two processes as far as Redis can tell.
    let server = RedisServer::start()?;
    let cache = || Corral::builder().redis(server.url()).build();
    let (a, b) = (cache()?, cache()?);
    let loading = Arc::new(Notify::new());
    let leader = {
        let (a, loading) = (a.clone(), loading.clone());
        tokio::spawn(async move {
            a.get_or_set("k", relative(), || async move {
                loading.notify_one();
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok::<_, std::io::Error>("from a")
            })
            .await
        })
    };
    loading.notified().await;
    let began = Instant::now();
    let v = b
        .get_or_set("k", relative(), || async { Ok::<_, std::io::Error>("from b") })
        .await?;
    assert_eq!(v, "from a");
    assert_eq!(leader.await??, "from a");
    let (mb, redis_b) = (b.metrics(), b.redis_store().expect("redis").commands_sent());
    assert_eq!((mb.loads, mb.lock_waits, mb.l2_hits), (0, 1, 1));
    // With backoff polling alone (50, 100, 200 ms...) b would have read and tried the
    // lock three more times in 0.5 s; woken by the landing it reads once more.
    // (The prefix's generation, read once per process and L1 TTL (§7.5), comes with
    // the first read.)
    assert_eq!(
        redis_b, 4,
        "generation and read, subscribe, lock (busy), read after the landing"
    );
    assert!(began.elapsed() < Duration::from_secs(5));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_values_travel_as_json() -> Result<()> {
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct User {
        name: String,
        visits: u32,
    }
    let f = Fixture::new(Backend::Redis)?;
    let ada = || User {
        name: "Ada".into(),
        visits: 3,
    };
    let loaded: User = f
        .cache
        .get_or_set_json("user:1", relative(), || async { Ok::<_, std::io::Error>(ada()) })
        .await?;
    assert_eq!(loaded, ada());
    assert_eq!(f.cache.get_json::<User>("user:1").await?, Some(ada()));
    f.cache.set_json("n", &7u32, EntryOptions::new()).await?;
    let e = f.cache.get_json::<User>("n").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    Ok(())
}

/// A typed `None` is returned but not cached, unless negative caching is asked for, and
/// then for its own TTL; a typed `should_cache` sees the value, not its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_none_is_cached_only_when_asked_and_for_its_own_ttl() -> Result<()> {
    for backend in [Backend::Memory, Backend::Redis] {
        let f = Fixture::new(backend)?;
        let calls = Arc::new(AtomicUsize::new(0));
        let find = |options: corral::LoadOptions| {
            let calls = calls.clone();
            f.cache.get_or_set_json("user:7", options, move || async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok::<Option<String>, std::io::Error>(None)
            })
        };
        let hour = corral::LoadOptions::relative(Duration::from_secs(3600));
        assert_eq!(find(hour.clone()).await?, None);
        assert_eq!(find(hour.clone()).await?, None);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "{backend:?}: None is not cached by default"
        );
        assert!(!f.stored("user:7").await?);

        let negative = hour.cache_none_for(Duration::from_secs(10));
        assert_eq!(find(negative.clone()).await?, None);
        assert_eq!(find(negative.clone()).await?, None);
        assert_eq!(calls.load(Ordering::SeqCst), 3, "{backend:?}: cached when asked");
        let meta = f.cache.inspect("user:7").await?.expect("stored").meta;
        assert!(
            meta.expires_at_ms <= f.cache.clock().now_ms() + 10_000,
            "{backend:?}: for its own 10 s, not the hour"
        );
        f.clock.advance(Duration::from_secs(11));
        assert_eq!(find(negative).await?, None);
        assert_eq!(calls.load(Ordering::SeqCst), 4, "{backend:?}: and no longer");

        // A typed predicate sees the value.
        let v: Vec<u32> = f
            .cache
            .get_or_set_json_if(
                "list",
                corral::LoadOptions::new(),
                |v: &Vec<u32>| !v.is_empty(),
                || async { Ok::<_, std::io::Error>(Vec::new()) },
            )
            .await?;
        assert!(v.is_empty());
        assert!(
            !f.stored("list").await?,
            "{backend:?}: an empty list was not cached"
        );
        let v: Vec<u32> = f
            .cache
            .get_or_set_json_if(
                "list",
                corral::LoadOptions::new(),
                |v: &Vec<u32>| !v.is_empty(),
                || async { Ok::<_, std::io::Error>(vec![1, 2]) },
            )
            .await?;
        assert_eq!(v, [1, 2]);
        assert!(f.stored("list").await?, "{backend:?}: a full one was");
    }
    Ok(())
}

/// Counts how often it is parsed from JSON.
static PARSED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[derive(serde::Serialize, Debug, PartialEq)]
struct Profile {
    name: String,
}

impl<'de> serde::Deserialize<'de> for Profile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Raw {
            name: String,
        }
        PARSED.fetch_add(1, Ordering::SeqCst);
        Raw::deserialize(d).map(|r| Profile { name: r.name })
    }
}

/// Typed L1 hits reuse the decoded value instead of parsing JSON again, while L1 holds
/// the same bytes; a new value is parsed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_l1_hits_reuse_the_decoded_value() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let load = |name: &'static str| {
        f.cache
            .get_or_set_json_shared("profile", relative(), move || async move {
                Ok::<_, std::io::Error>(Profile { name: name.into() })
            })
    };
    let first = load("Ada").await?;
    for _ in 0..100 {
        let again = load("never loaded").await?;
        assert!(Arc::ptr_eq(&first, &again), "the same decoded value");
    }
    assert_eq!(PARSED.load(Ordering::SeqCst), 1, "parsed once for 101 reads");
    f.cache
        .set_json("profile", &Profile { name: "Grace".into() }, EntryOptions::new())
        .await?;
    let changed = load("never loaded").await?;
    assert_eq!(changed.name, "Grace", "a new value, not the old decoded one");
    assert_eq!(load("never loaded").await?.name, "Grace");
    assert_eq!(PARSED.load(Ordering::SeqCst), 2, "and parsed once");
    Ok(())
}

/// Whether `cache` hears another process's change (its L1 invalidations pass `heard`)
/// within `within`.
async fn hears_after(cache: &Corral, heard: u64, within: Duration) -> bool {
    let by = Instant::now() + within;
    while cache.metrics().l1_invalidations <= heard {
        if Instant::now() >= by {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    true
}

/// A caller does not join a flight that began before a change of its key this process
/// has since heard of (contract §5.12): its outcome may be older than a write
/// acknowledged before the caller came. Here process a's flight of k loads slowly;
/// process b sets k meanwhile, and a hears it; a caller in a then leads a flight of its
/// own and reads b's value, while the first flight's caller still gets its load. Before,
/// the late caller joined the old flight and got the loaded value (found by the
/// simulator's tag workload: `corral-sim --portable --scenario network --seed 743`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_after_a_heard_change_does_not_join_an_older_flight() -> Result<()> {
    let server = RedisServer::start()?;
    let a = Corral::builder().redis(server.url()).build()?;
    let b = Corral::builder().redis(server.url()).build()?;
    // Both subscribed: a hears b.
    corral_tests::until_a_hears_b(&a, &b, "subscribed").await?;

    let (gate, entered) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let first = tokio::spawn({
        let (a, gate, entered) = (a.clone(), gate.clone(), entered.clone());
        async move {
            a.get_or_set("k", relative(), || async move {
                entered.notify_one();
                gate.notified().await;
                Ok::<_, std::io::Error>(Bytes::from_static(b"loaded"))
            })
            .await
        }
    });
    // The first flight is loading (its loader waits on the gate).
    tokio::time::timeout(Duration::from_secs(10), entered.notified())
        .await
        .context("the first flight never loaded")?;
    let heard = a.metrics().l1_invalidations;
    b.set("k", "written", EntryOptions::new().relative(MIN)).await?;
    anyhow::ensure!(
        hears_after(&a, heard, Duration::from_secs(10)).await,
        "a never heard b's set"
    );
    let late = tokio::time::timeout(
        Duration::from_secs(5),
        a.get_or_set("k", relative(), || async {
            Ok::<_, std::io::Error>(Bytes::from_static(b"late load"))
        }),
    )
    .await;
    gate.notify_one();
    let late = late.context("the late caller waited on the first flight")??;
    assert_eq!(&late[..], b"written", "the late caller reads what b wrote");
    assert_eq!(
        &first.await??[..],
        b"loaded",
        "the first caller gets its own load"
    );
    Ok(())
}

/// A call's options are judged once, as it begins: a follower whose leader went away
/// after the follower's absolute expiry passed leads in its place from the verdict its
/// options got when it was called. It loads and is served (not cached: the point passed),
/// as a caller whose point passes while its own loader runs is. Before, it judged its
/// options again as it led, and failed with an invalid argument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_leads_after_its_absolute_point_passed_is_served() -> Result<()> {
    let cache = Corral::builder().build()?;
    let started = Arc::new(Notify::new());
    let leader = tokio::spawn({
        let (cache, started) = (cache.clone(), started.clone());
        async move {
            cache
                .get_or_set("k", relative(), || async move {
                    started.notify_one();
                    std::future::pending::<std::result::Result<Vec<u8>, std::io::Error>>().await
                })
                .await
        }
    });
    started.notified().await;
    let soon = std::time::SystemTime::now() + Duration::from_millis(100);
    let follower = tokio::spawn({
        let cache = cache.clone();
        async move {
            cache
                .get_or_set("k", EntryOptions::new().absolute(soon), || async {
                    Ok::<_, std::io::Error>(b"mine".to_vec())
                })
                .await
        }
    });
    while cache.followers_of("k") == 0 {
        tokio::task::yield_now().await;
    }
    // The follower's absolute point passes while it waits; then its leader goes away.
    tokio::time::sleep(Duration::from_millis(150)).await;
    leader.abort();
    let got = follower.await?.context("the follower that led")?;
    assert_eq!(&got[..], b"mine");
    assert_eq!(
        cache.get("k").await?,
        None,
        "not cached: its absolute point passed"
    );
    Ok(())
}
