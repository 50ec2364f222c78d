//! What is particular to each backend: Redis's prefix, TTLs, server-side touch and
//! outages; the memory store's background invalidation; the guest artefact itself.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use corral::guest::Freshness;
use corral::{Clock, Corral, EntryOptions, ErrorKind};
use corral_tests::{Backend, Fixture, RedisServer};

const SEC: Duration = Duration::from_secs(1);

#[test]
fn the_guest_is_a_small_component() {
    let wasm = corral::guest::GUEST_WASM;
    assert_eq!(&wasm[..4], b"\0asm", "a wasm binary");
    assert_eq!(
        &wasm[4..8],
        &[0x0d, 0x00, 0x01, 0x00],
        "of the component layer, not a core module"
    );
    // 164 KB before tags and clear (contract §7.5), 211 KB with them, 276 KB with the
    // portable body's batch (§5.16), 297 KB built for size; 353 KB built for speed
    // (`[profile.guest]`, opt-level 3: a batch's reads judged in two thirds the time).
    assert!(
        wasm.len() < 400 * 1024,
        "a few hundred KB, not {} bytes",
        wasm.len()
    );
}

async fn pttl(f: &Fixture, key: &str) -> Result<i64> {
    let server = f.redis.as_ref().expect("redis");
    let mut conn = server.connection().await?;
    Ok(redis::cmd("PTTL")
        .arg(f.cache.entry_name(key)?)
        .query_async(&mut conn)
        .await?)
}

#[tokio::test]
async fn the_server_side_touch_agrees_with_the_guest() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    let cases = [
        ("sliding", EntryOptions::new().sliding(60 * SEC)),
        ("capped", EntryOptions::new().relative(80 * SEC).sliding(60 * SEC)),
        ("relative", EntryOptions::new().relative(60 * SEC)),
        ("default", EntryOptions::new()),
    ];
    for (key, options) in cases {
        f.cache.set(key, "v", options).await?;
    }
    for step in [25, 30, 20] {
        f.clock.advance(step * SEC);
        let now = f.clock.now_ms();
        for (key, _) in cases {
            let before = f.cache.inspect(key).await?.expect("stored").meta;
            let expected = f.cache.policy().check(&before, now)?;
            // A refresh always reads L2 (a get may be served by L1).
            let got = f.cache.refresh(key).await?;
            match expected {
                Freshness::Fresh { meta, .. } => {
                    assert!(got, "{key} at +{step}s");
                    let after = f.cache.inspect(key).await?.expect("stored").meta;
                    assert_eq!(after, meta, "Lua touch and guest check agree for {key}");
                }
                Freshness::Expired => assert!(!got, "{key}"),
                _ => unreachable!(),
            }
        }
    }
    Ok(())
}

#[tokio::test]
async fn keys_live_under_the_prefix_and_tenants_never_meet() -> Result<()> {
    let server = RedisServer::start()?;
    let tenant = |prefix: &str| {
        let mut o = corral::RedisOptions::new(server.url());
        o.prefix = prefix.into();
        Corral::builder().redis_options(o).build()
    };
    let (a, b) = (tenant("a:")?, tenant("b:")?);
    a.set("k", "from a", EntryOptions::new()).await?;
    assert_eq!(b.get("k").await?, None);
    b.set("k", "from b", EntryOptions::new()).await?;
    assert_eq!(a.get("k").await?.as_deref(), Some(&b"from a"[..]));
    let mut conn = server.connection().await?;
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await?;
    keys.sort();
    assert_eq!(keys, ["{2:a:k}:e", "{2:b:k}:e"]);
    Ok(())
}

#[tokio::test]
async fn the_redis_ttl_is_an_upper_bound_that_follows_the_touch() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    f.cache
        .set("k", "v", EntryOptions::new().sliding(60 * SEC))
        .await?;
    let ttl = pttl(&f, "k").await?;
    assert!(
        (60_000..=61_000).contains(&ttl),
        "expiry plus at most the grace: {ttl}"
    );
    // 40 s of manual time later a read slides the entry 60 s from then: Redis's TTL
    // moves with it (real time has hardly passed, so it must grow by about 40 s).
    f.clock.advance(40 * SEC);
    assert!(f.cache.get("k").await?.is_some());
    let ttl = pttl(&f, "k").await?;
    assert!(
        (60_000..=61_000).contains(&ttl),
        "PEXPIRE'd with the touch: {ttl}"
    );
    // A relative entry's TTL never grows.
    f.cache
        .set("r", "v", EntryOptions::new().relative(30 * SEC))
        .await?;
    f.clock.advance(10 * SEC);
    assert!(f.cache.get("r").await?.is_some());
    assert!(pttl(&f, "r").await? <= 31_000);
    Ok(())
}

#[tokio::test]
async fn a_dead_redis_is_a_typed_retryable_error_and_recovery_follows() -> Result<()> {
    let mut f = Fixture::new(Backend::Redis)?;
    f.cache.set("k", "v", EntryOptions::new()).await?;
    f.redis.as_mut().expect("redis").kill();
    // "k" may still be served from L1; a key L1 does not hold must go to the dead L2.
    let e = f.cache.get("not-in-l1").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.is_retryable());
    assert!(std::error::Error::source(&e).is_some(), "the cause is chained");
    let e = f.cache.set("k", "v2", EntryOptions::new()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    // Bad input is still judged first, without touching the store.
    assert_eq!(
        f.cache.get(" ").await.unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert!(f.cache.metrics().l2_errors >= 2);

    f.redis.as_mut().expect("redis").restart()?;
    // The connection manager reconnects in the background; the first command after a
    // restart may still see the old connection fail.
    let mut recovered = false;
    for _ in 0..50 {
        if f.cache.set("k", "v3", EntryOptions::new()).await.is_ok() {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(recovered, "the cache works again once Redis is back");
    assert_eq!(f.cache.get("k").await?.as_deref(), Some(&b"v3"[..]));
    Ok(())
}

/// Redis frozen (SIGSTOP) under a steady stream of misses, for ten cool-downs: once the
/// breaker is open no call waits on Redis again, not even once per cool-down (the probe
/// runs in the background; it used to ride a caller's request, which then waited out the
/// response timeout). Once Redis is back, the probe closes the breaker with no call made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_the_breaker_is_open_no_call_waits_on_a_probe() -> Result<()> {
    let server = RedisServer::start()?;
    let mut options = corral::RedisOptions::new(server.url());
    options.response_timeout = Duration::from_millis(200);
    options.breaker_cool_down = Duration::from_millis(100);
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    cache.set("k", "v", EntryOptions::new()).await?;
    let store = cache.redis_store().expect("redis");
    server.pause()?;
    for _ in 0..3 {
        cache.get("k").await.unwrap_err();
    }
    ensure!(store.breaker().0, "open after three failures");
    let degraded = cache.metrics().degraded;
    let mut slowest = Duration::ZERO;
    for i in 0..40 {
        let started = Instant::now();
        let v = cache
            .get_or_set(&format!("miss-{i}"), EntryOptions::new(), || async {
                Ok::<_, std::io::Error>("from the database")
            })
            .await?;
        slowest = slowest.max(started.elapsed());
        ensure!(v == "from the database");
        // Paced over ten cool-downs (pacing the workload, not waiting for anything).
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    println!("breaker open, Redis frozen: the slowest of 40 misses took {slowest:?}");
    ensure!(
        slowest < Duration::from_millis(100),
        "a call waited on Redis (a call sent takes the 200 ms response timeout): {slowest:?}"
    );
    ensure!(
        cache.metrics().degraded - degraded == 40,
        "each miss loaded, uncached"
    );
    ensure!(store.breaker().0, "still open: Redis is frozen");
    server.resume()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.breaker().0 {
        ensure!(
            Instant::now() < deadline,
            "no probe closed it: {:?}",
            store.breaker()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(cache.get("k").await?.as_deref() == Some(&b"v"[..]));
    Ok(())
}

/// A frozen Redis opens the breaker after three failed calls: later calls are refused at
/// once without a command sent (a get-or-set loads, uncached), until a probe after the
/// cool-down finds Redis back and closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_redis_opens_the_breaker_and_a_probe_closes_it() -> Result<()> {
    let server = RedisServer::start()?;
    let mut options = corral::RedisOptions::new(server.url());
    options.response_timeout = Duration::from_millis(200);
    options.breaker_cool_down = Duration::from_secs(2);
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    cache.set("k", "v", EntryOptions::new()).await?;
    let store = cache.redis_store().expect("redis");
    server.pause()?;
    let started = Instant::now();
    for i in 0..3 {
        let e = cache.get("k").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "call {i}: {e}");
    }
    let tripped = started.elapsed();
    assert!(store.breaker().0, "open after three failures");
    let sent = store.commands_sent();
    let started = Instant::now();
    for i in 0..50 {
        let v = cache
            .get_or_set(&format!("miss-{i}"), EntryOptions::new(), || async {
                Ok::<_, std::io::Error>("from the database")
            })
            .await?;
        assert_eq!(v, "from the database");
    }
    let e = cache.set("k", "v2", EntryOptions::new()).await.unwrap_err();
    assert!(e.to_string().contains("circuit open"), "{e}");
    let fast = started.elapsed();
    // (The landing channel's own resubscription runs on its own connection, counted
    // in `commands_sent`; the cache's calls were all refused before sending.)
    let _ = sent;
    assert_eq!(cache.metrics().degraded, 50, "each miss loaded, uncached");
    let (_, opened, refused) = store.breaker();
    assert_eq!(opened, 1);
    assert!(refused >= 51, "each miss's L2 read, and the set: {refused}");
    println!("breaker: 3 calls took {tripped:?} to open it; 50 misses + 1 set then took {fast:?}");

    server.resume()?;
    let mut closed = false;
    for _ in 0..60 {
        if cache.set("k", "v3", EntryOptions::new()).await.is_ok() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(closed, "a probe after the cool-down closes it");
    assert!(!store.breaker().0);
    assert_eq!(cache.get("k").await?.as_deref(), Some(&b"v3"[..]));
    Ok(())
}

#[test]
fn building_with_redis_outside_a_runtime_is_an_error_not_a_panic() {
    let e = Corral::builder()
        .redis("redis://127.0.0.1:1")
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("Tokio runtime"), "{e}");
}

#[tokio::test]
async fn a_bad_redis_url_is_an_argument_error() {
    let e = Corral::builder().redis("http://not-redis").build().unwrap_err();
    assert_eq!(
        (e.kind(), e.argument()),
        (ErrorKind::InvalidArgument, Some("redis url"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_invalidation_runs_in_the_background_at_most_once_per_interval() -> Result<()> {
    let f = Fixture::with(Backend::Memory, |b| b.invalidation_interval(10 * SEC))?;
    let store = f.cache.memory_store().expect("memory backend").clone();
    for key in ["a", "b", "c"] {
        f.cache
            .set(key, "v", EntryOptions::new().relative(5 * SEC))
            .await?;
    }
    f.cache
        .set("long", "v", EntryOptions::new().relative(3600 * SEC))
        .await?;

    // Refresh always goes to L2 (a get may be served from L1).
    f.clock.advance(6 * SEC);
    f.cache.refresh("long").await?;
    assert_eq!(
        store.invalidation_stats().started,
        0,
        "not yet due: the interval has not passed"
    );
    assert_eq!(
        store.len(),
        4,
        "expired entries wait for a read or an invalidation"
    );

    f.clock.advance(5 * SEC);
    f.cache.refresh("long").await?;
    assert_eq!(
        store.invalidation_stats().started,
        1,
        "due: started by an ordinary call"
    );
    store.invalidated(1).await;
    assert_eq!(store.invalidation_stats().removed, 3);
    assert_eq!(store.len(), 1);

    f.clock.advance(9 * SEC);
    f.cache.set("x", "v", EntryOptions::new()).await?;
    f.cache.remove("x").await?;
    assert_eq!(store.invalidation_stats().started, 1, "at most once per interval");
    f.clock.advance(SEC);
    f.cache.remove("x").await?;
    assert_eq!(store.invalidation_stats().started, 2);
    store.invalidated(2).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_share_the_guest_safely() -> Result<()> {
    for backend in [Backend::Memory, Backend::Redis] {
        let f = Fixture::new(backend)?;
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..200 {
            let cache = f.cache.clone();
            tasks.spawn(async move {
                let key = format!("k{}", i % 20);
                cache.set(&key, format!("v{i}"), EntryOptions::new()).await?;
                anyhow::ensure!(cache.get(&key).await?.is_some(), "{key} missing");
                Ok(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        assert_eq!(f.cache.metrics().sets, 200, "{backend:?}");
        let created = f.cache.policy().instances_created();
        assert!(
            created <= 8,
            "instances are reused, not made per call: {created} for 400 calls"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_one_process_drops_the_l1_copy_in_another() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = || Corral::builder().redis(server.url()).build();
    let (a, b) = (cache()?, cache()?);
    // Make sure b listens before a speaks: its first subscription flushes its (empty) L1.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while b.metrics().l1_flushes < 1 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "b never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Wait for b to act on a's announcement (over pub/sub), not for a guessed delay.
    let heard = |after: u64| {
        let b = b.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(5), async {
                while b.metrics().l1_invalidations <= after {
                    tokio::task::yield_now().await;
                }
            })
            .await
        }
    };
    // b hears of a's set first: a fill that raced with that news would be refused (a
    // fill never lands over a newer invalidation), which is right, but not this test.
    let before = b.metrics().l1_invalidations;
    a.set("k", "one", EntryOptions::new()).await?;
    heard(before).await?;
    assert_eq!(
        b.get("k").await?.as_deref(),
        Some(&b"one"[..]),
        "b reads L2 and fills its L1"
    );
    assert_eq!(b.get("k").await?.as_deref(), Some(&b"one"[..]));
    assert_eq!(b.metrics().l1_hits, 1);

    let before = b.metrics().l1_invalidations;
    a.set("k", "two", EntryOptions::new()).await?;
    heard(before).await?;
    assert_eq!(
        b.get("k").await?.as_deref(),
        Some(&b"two"[..]),
        "no stale L1 copy"
    );

    let before = b.metrics().l1_invalidations;
    a.remove("k").await?;
    heard(before).await?;
    assert_eq!(b.get("k").await?, None, "a removal reaches b's L1 too");
    assert_eq!(a.metrics().l1_invalidations, 0, "a ignores its own announcements");
    Ok(())
}

/// Two tenants whose prefixes nest (`corral:` and `corral:e:`) never meet: under the
/// first round's scheme both wrote `corral:e:e:k`, so one read, removed and replaced
/// the other's entry (contract §2.4).
#[tokio::test]
async fn tenants_whose_prefixes_nest_never_meet() -> Result<()> {
    let server = RedisServer::start()?;
    let tenant = |prefix: &str| {
        let mut o = corral::RedisOptions::new(server.url());
        o.prefix = prefix.into();
        Corral::builder().redis_options(o).l1_capacity(0).build()
    };
    let (outer, inner) = (tenant("corral:")?, tenant("corral:e:")?);
    outer.set("e:k", "outer's", EntryOptions::new()).await?;
    assert_eq!(inner.get("k").await?, None, "inner sees nothing of outer's");
    assert!(!inner.remove("k").await?, "and removes nothing of it");
    inner.set("k", "inner's", EntryOptions::new()).await?;
    assert_eq!(outer.get("e:k").await?.as_deref(), Some(&b"outer's"[..]));
    assert_eq!(inner.get("k").await?.as_deref(), Some(&b"inner's"[..]));
    Ok(())
}

/// The landing channel is kept by a task of its own: when its connection dies, a new
/// subscription replaces it, and the whole L1 is dropped, since announcements made in
/// between are lost (contract §5.13). Before, nothing resubscribed until the next
/// get-or-set waited, and the L1 kept serving what another process had replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_landing_channel_is_replaced_and_l1_is_flushed() -> Result<()> {
    let server = RedisServer::start()?;
    let proxy = corral_tests::FaultProxy::start(server.addr())?;
    let a = Corral::builder().redis(server.url()).build()?;
    let b = Corral::builder().redis(proxy.url()).build()?;
    // b listens once it hears a's announcements. (Its first subscription's flush is
    // counted only if the channel came up after the cache registered its hook, which a
    // loaded machine may reorder: it is not the signal.)
    corral_tests::until_a_hears_b(&b, &a, "listening").await?;
    let flushes = b.metrics().l1_flushes;
    let subscribed = |n: u64| {
        let b = b.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while b.metrics().l1_flushes < n {
                anyhow::ensure!(Instant::now() < deadline, "b never subscribed again");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(())
        }
    };
    a.set("k", "one", EntryOptions::new()).await?;
    assert_eq!(
        b.get("k").await?.as_deref(),
        Some(&b"one"[..]),
        "b's L1 holds it now"
    );

    let dropped = Instant::now();
    assert_eq!(proxy.drop_subscribers(), 1, "b's channel dies");
    a.set("k", "two", EntryOptions::new()).await?; // an announcement b may never hear
    subscribed(flushes + 1).await?;
    println!("resubscribed {:?} after the channel died", dropped.elapsed());
    assert_eq!(
        b.get("k").await?.as_deref(),
        Some(&b"two"[..]),
        "no stale L1 copy"
    );
    Ok(())
}

/// No secret is ever printed: a Redis URL's password appears in no error, no error
/// source and no `Debug` output of the cache, its options or its locks (issue: before,
/// `RedisOptions`' and `RedisLocks`' `Debug` showed it, and the lock log lines too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_password_is_never_printed() -> Result<()> {
    let url = "redis://user:hunter2@127.0.0.1:1/0";
    let mut shown = Vec::new();
    let cache = Corral::builder().redis(url).build()?;
    let err = cache.get("k").await.unwrap_err();
    shown.push(format!(
        "{err} {err:?} {cache:?} {:?}",
        corral::RedisOptions::new(url)
    ));
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        shown.push(format!("{s} {s:?}"));
        source = s.source();
    }
    let locks = corral::locks::RedisLocks::connect(&[url])?;
    let err = locks
        .try_acquire("k", corral::locks::LockOptions::new())
        .await
        .unwrap_err();
    shown.push(format!("{err} {err:?} {locks:?}"));
    let bad = Corral::builder()
        .redis("redis://user:hunter2@[not a url")
        .build()
        .unwrap_err();
    shown.push(format!("{bad} {bad:?}"));
    for text in &shown {
        assert!(!text.contains("hunter2"), "a password was printed: {text}");
    }
    assert!(
        shown[0].contains("user:***@127.0.0.1:1"),
        "the rest is kept: {}",
        shown[0]
    );
    Ok(())
}

/// After a half-open connection (the peer silently gone: replies just stop), later
/// operations reconnect by themselves: two timeouts in a row replace the connection.
/// Before, every command on the dead connection timed out until TCP gave up (minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_connection_heals_within_a_few_timeouts() -> Result<()> {
    let server = RedisServer::start()?;
    let proxy = corral_tests::FaultProxy::start(server.addr())?;
    let mut options = corral::RedisOptions::new(proxy.url());
    options.response_timeout = Duration::from_millis(200);
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    cache.set("k", "v", EntryOptions::new()).await?;
    let cut = proxy.half_open();
    assert!(cut >= 1, "the command connection is cut off");
    let began = Instant::now();
    let mut failures = 0;
    let healed = loop {
        match cache.get("k").await {
            Ok(v) => break v,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                failures += 1;
                anyhow::ensure!(began.elapsed() < Duration::from_secs(10), "never healed: {e}");
            }
        }
    };
    println!(
        "healed {:?} after the connection went half-open ({failures} failed calls)",
        began.elapsed()
    );
    assert_eq!(healed.as_deref(), Some(&b"v"[..]));
    assert!(
        failures <= 3,
        "{failures} calls failed before the connection was replaced"
    );
    Ok(())
}

/// Tries the lease `heal` on `locks` until a try takes it (then releases it), after a
/// half-open cut: each failed try must be `Unavailable`, and the lease must come back
/// within `within`. How many tries failed.
async fn lease_after_half_open(locks: &corral::locks::RedisLocks, within: Duration) -> Result<usize> {
    let options = corral::locks::LockOptions::new().ttl(Duration::from_secs(5));
    let began = Instant::now();
    let mut failures = 0;
    let lease = loop {
        match locks.try_acquire("heal", options).await {
            Ok(Some(lease)) => break lease,
            Ok(None) => anyhow::bail!("the lock was held by nobody, yet refused"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                failures += 1;
                ensure!(
                    began.elapsed() < within,
                    "never healed ({failures} failed tries): {e}"
                );
            }
        }
    };
    println!(
        "the lease came back {:?} after the connection went half-open ({failures} failed tries)",
        began.elapsed()
    );
    lease.release().await?;
    Ok(failures)
}

/// Leases through the cache (`cache.locks()`) share the cache's command connection and
/// heal with it: two timeouts in a row replace it. Before, the lock API kept its first
/// connection for good and timed out on every try until the process restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_connection_heals_leases_too() -> Result<()> {
    let server = RedisServer::start()?;
    let proxy = corral_tests::FaultProxy::start(server.addr())?;
    let mut options = corral::RedisOptions::new(proxy.url());
    options.response_timeout = Duration::from_millis(200);
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    let locks = cache.locks().redis().expect("a Redis cache has Redis locks");
    let options = corral::locks::LockOptions::new().ttl(Duration::from_secs(5));
    let lease = locks
        .try_acquire("heal", options)
        .await?
        .expect("nobody holds it");
    lease.release().await?;
    let cut = proxy.half_open();
    assert!(cut >= 1, "the command connection is cut off");
    let failures = lease_after_half_open(locks, Duration::from_secs(10)).await?;
    assert!(
        failures <= 3,
        "{failures} tries failed before the connection was replaced"
    );
    Ok(())
}

/// Standalone `RedisLocks` (no cache) replace a half-open connection the same way (with
/// the default 1 s response timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_connection_heals_standalone_leases() -> Result<()> {
    let server = RedisServer::start()?;
    let proxy = corral_tests::FaultProxy::start(server.addr())?;
    let locks = corral::locks::RedisLocks::connect(&[proxy.url()])?;
    let options = corral::locks::LockOptions::new().ttl(Duration::from_secs(5));
    let lease = locks
        .try_acquire("heal", options)
        .await?
        .expect("nobody holds it");
    lease.release().await?;
    let cut = proxy.half_open();
    assert!(cut >= 1, "the command connection is cut off");
    let failures = lease_after_half_open(&locks, Duration::from_secs(10)).await?;
    assert!(
        failures <= 3,
        "{failures} tries failed before the connection was replaced"
    );
    Ok(())
}

/// After a Redis restart (empty, on the same port), operations succeed again without
/// any manual step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_is_reached_again() -> Result<()> {
    let mut server = RedisServer::start()?;
    let cache = Corral::builder().redis(server.url()).l1_capacity(0).build()?;
    cache.set("k", "v", EntryOptions::new()).await?;
    server.restart()?;
    let began = Instant::now();
    loop {
        match cache.set("k", "again", EntryOptions::new()).await {
            Ok(()) => break,
            Err(e) => anyhow::ensure!(
                began.elapsed() < Duration::from_secs(10),
                "never reconnected: {e}"
            ),
        }
    }
    println!("reached again {:?} after the restart", began.elapsed());
    assert_eq!(cache.get("k").await?.as_deref(), Some(&b"again"[..]));
    Ok(())
}

/// Every call ends by its documented deadline, also against a frozen Redis (SIGSTOP):
/// get, set and remove within one store operation's bound (connect timeout + 2 x
/// response timeout: the connection manager retries once), and a get-or-set within
/// max(lock wait, store timeout) + loader + one store timeout, with the loader's value
/// (degraded). Before, the first get-or-set of a process waited on
/// the subscription's connect while holding a lock that every other flight queued on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_ends_by_its_deadline_against_a_frozen_redis() -> Result<()> {
    let server = RedisServer::start()?;
    let timeout = Duration::from_millis(300);
    let mut options = corral::RedisOptions::new(server.url());
    options.response_timeout = timeout;
    options.connect_timeout = timeout;
    let cache = Corral::builder()
        .redis_options(options)
        .lock_wait(Duration::from_millis(500))
        .build()?;
    server.pause()?;
    let bound = |what: &str, took: Duration, limit: Duration| {
        println!("{what}: {took:?} (deadline {limit:?})");
        assert!(took <= limit, "{what} took {took:?}, past its deadline {limit:?}");
    };
    // One store operation each, and the margin of a busy 2-core machine.
    let slack = Duration::from_millis(700);
    let op = 3 * timeout;
    let t = Instant::now();
    assert_eq!(cache.get("k").await.unwrap_err().kind(), ErrorKind::Unavailable);
    bound("get", t.elapsed(), op + slack);
    let t = Instant::now();
    assert!(cache.set("k", "v", EntryOptions::new()).await.is_err());
    bound("set", t.elapsed(), op + slack);
    let t = Instant::now();
    assert!(cache.remove("k").await.is_err());
    bound("remove", t.elapsed(), op + slack);
    let t = Instant::now();
    let mut callers = tokio::task::JoinSet::new();
    for i in 0..8 {
        let cache = cache.clone();
        callers.spawn(async move {
            cache
                .get_or_set(&format!("k{i}"), EntryOptions::new(), || async {
                    Ok::<_, std::io::Error>("loaded")
                })
                .await
        });
    }
    while let Some(r) = callers.join_next().await {
        assert_eq!(r??, "loaded");
    }
    bound(
        "8 get-or-sets",
        t.elapsed(),
        Duration::from_millis(500) + 2 * timeout + slack,
    );
    server.resume()?;
    Ok(())
}

/// Landings that fail their first `fails` announcements, then pass them on.
#[derive(Debug)]
struct Flaky {
    inner: corral::store::memory::MemoryStore,
    fails: std::sync::atomic::AtomicUsize,
    announced: tokio::sync::Notify,
}

impl corral::store::Notifications for Flaky {
    fn watch<'a>(&'a self, key: &'a str) -> futures::future::BoxFuture<'a, corral::store::LandingWatch> {
        self.inner.watch(key)
    }

    fn announce<'a>(&'a self, key: &'a str) -> futures::future::BoxFuture<'a, corral::Result<()>> {
        use futures::FutureExt;
        use std::sync::atomic::Ordering;
        async move {
            if self
                .fails
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(corral::Error::from(ErrorKind::Unavailable).with_context("store unreachable"));
            }
            self.inner.announce(key).await?;
            self.announced.notify_one();
            Ok(())
        }
        .boxed()
    }

    fn on_foreign(&self, hook: corral::store::ForeignHook) {
        self.inner.on_foreign(hook);
    }
}

/// A change announcement that could not be published is made again once the store
/// answers (so other processes do not serve the old value until their L1 deadline).
#[tokio::test]
async fn an_announcement_that_failed_is_retried_until_it_is_published() -> Result<()> {
    use std::sync::Arc;
    let store = corral::store::memory::MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let flaky = Arc::new(Flaky {
        inner: store.clone(),
        fails: std::sync::atomic::AtomicUsize::new(3),
        announced: tokio::sync::Notify::new(),
    });
    let cache = Corral::builder()
        .stores("t:", Arc::new(store.clone()), Arc::new(store), flaky.clone())
        .build()?;
    let published = flaky.announced.notified();
    cache.set("k", "v", EntryOptions::new()).await?;
    tokio::time::timeout(Duration::from_secs(5), published)
        .await
        .expect("published after three failures (50, 100, 200 ms of backoff)");
    assert_eq!(flaky.fails.load(std::sync::atomic::Ordering::SeqCst), 0);
    Ok(())
}

/// Redis options for a cache that reaches Redis through `proxy`, with short timeouts so
/// a frozen network fails its calls quickly.
fn through(proxy: &corral_tests::FaultProxy) -> corral::RedisOptions {
    let mut options = corral::RedisOptions::new(proxy.url());
    options.response_timeout = Duration::from_millis(200);
    options.connect_timeout = Duration::from_millis(200);
    options
}

/// Polls `check` every 20 ms until it holds, for at most `within`; `what` names it in
/// the failure.
async fn until(within: Duration, what: &str, mut check: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if check().await? {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `remove` whose tombstone never reached Redis (the network froze and swallowed the
/// command) returns its error, its L1 copy dropped at once, and the removal is made
/// again in the background once Redis answers, on the announcements' schedule (50 ms
/// doubling to 2 s, for up to the L1 TTL). Before, the old value stayed in Redis until
/// it expired (issue 19, item 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_remove_is_retried_until_it_lands() -> Result<()> {
    let server = RedisServer::start()?;
    let proxy = corral_tests::FaultProxy::start(server.addr())?;
    let a = Corral::builder().redis_options(through(&proxy)).build()?;
    let b = Corral::builder().redis(server.url()).l1_capacity(0).build()?;
    a.set("k", "old", EntryOptions::new()).await?;
    proxy.blackhole(true);
    let e = a.remove("k").await.unwrap_err();
    assert!(e.is_retryable(), "the caller learns it may not have landed: {e}");
    assert!(
        e.to_string().starts_with("store unavailable: remove: "),
        "names the call: {e}"
    );
    assert!(
        a.get("k").await.is_err(),
        "a's L1 copy is gone at once: its get goes to Redis"
    );
    proxy.heal();
    let healed = Instant::now();
    until(
        10 * SEC,
        "the removal never landed: another instance still reads the old value",
        async || Ok(b.get("k").await?.is_none()),
    )
    .await?;
    println!(
        "the removal landed {:?} after the network healed",
        healed.elapsed()
    );
    until(5 * SEC, "a's store calls never came back", async || {
        Ok(a.get("k").await.is_ok())
    })
    .await?;
    assert_eq!(a.get("k").await?, None, "nor does a serve it");
    Ok(())
}

/// A removal that cannot even name its entry (the prefix's generation is due to be read
/// again, and the store is out of reach) still drops this process's copy at once, and
/// lands once the store is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remove_that_cannot_name_its_entry_still_drops_the_copy_and_lands() -> Result<()> {
    let (server, proxy, a) = a_copy_outliving_the_known_generation().await?;
    let b = Corral::builder().redis(server.url()).l1_capacity(0).build()?;
    proxy.blackhole(true);
    let e = a.remove("k").await.unwrap_err();
    assert!(e.is_retryable(), "the caller learns it may not have landed: {e}");
    let got = a.get("k").await;
    assert!(
        got.is_err(),
        "a's L1 copy is gone at once: its get goes to Redis, not {got:?}"
    );
    proxy.heal();
    until(
        10 * SEC,
        "the removal never landed: another instance still reads the old value",
        async || Ok(b.get("k").await?.is_none()),
    )
    .await?;
    Ok(())
}

/// So does an `expire` that cannot name its entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expire_that_cannot_name_its_entry_still_drops_the_copy() -> Result<()> {
    let (_server, proxy, a) = a_copy_outliving_the_known_generation().await?;
    proxy.blackhole(true);
    let e = a.expire("k").await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    let got = a.get("k").await;
    assert!(
        got.is_err(),
        "a's L1 copy is gone at once: its get goes to Redis, not {got:?}"
    );
    Ok(())
}

/// A cache on a manual clock, through a fault proxy, whose L1 holds `k` = "old" while
/// the prefix's generation is no longer known (it was read one L1 TTL ago; the copy was
/// made later): naming an entry now needs the store.
async fn a_copy_outliving_the_known_generation() -> Result<(RedisServer, corral_tests::FaultProxy, Corral)> {
    let server = RedisServer::start()?;
    let proxy = corral_tests::FaultProxy::start(server.addr())?;
    let clock = corral::ManualClock::starting_now();
    let l1_ttl = Duration::from_secs(10);
    let a = Corral::builder()
        .clock(clock.clone())
        .l1_ttl(l1_ttl)
        .redis_options(through(&proxy))
        .build()?;
    assert_eq!(a.get("warm").await?, None);
    clock.advance(l1_ttl - Duration::from_secs(1));
    a.set("k", "old", EntryOptions::new()).await?;
    clock.advance(Duration::from_secs(2));
    assert_eq!(a.get("k").await?.as_deref(), Some(&b"old"[..]), "an L1 hit");
    Ok((server, proxy, a))
}

/// A removal being retried never lands over a write made after the failed `remove`:
/// here another instance's `set`, made while the first one's commands still fail (its
/// subscription lives, so it hears of that set). The later value survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_remove_never_lands_over_a_later_set() -> Result<()> {
    let server = RedisServer::start()?;
    let proxy = corral_tests::FaultProxy::start(server.addr())?;
    let a = Corral::builder().redis_options(through(&proxy)).build()?;
    let b = Corral::builder().redis(server.url()).l1_capacity(0).build()?;
    corral_tests::until_a_hears_b(&a, &b, "subscribed").await?;
    a.set("k", "old", EntryOptions::new()).await?;
    // a's commands fail from now on (its command connection reset, new ones refused);
    // its subscription is left alone.
    proxy.refuse(true);
    ensure!(
        proxy.drop_connections_matching(|c| !c.subscriber) >= 1,
        "a's command connection"
    );
    let e = a.remove("k").await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert_eq!(a.background_in_progress(), 1, "the removal is being retried");
    let heard = a.metrics().l1_invalidations;
    b.set("k", "new", EntryOptions::new()).await?;
    until(5 * SEC, "a never heard of b's set", async || {
        Ok(a.metrics().l1_invalidations > heard)
    })
    .await?;
    proxy.refuse(false);
    until(10 * SEC, "the retry never ended", async || {
        Ok(a.background_in_progress() == 0)
    })
    .await?;
    assert_eq!(
        b.get("k").await?.as_deref(),
        Some(&b"new"[..]),
        "the later set survives"
    );
    until(5 * SEC, "a's store calls never came back", async || {
        Ok(a.get("k").await.is_ok())
    })
    .await?;
    assert_eq!(a.get("k").await?.as_deref(), Some(&b"new"[..]));
    Ok(())
}

/// Entries whose every step but a plain `set` fails while `down`: a removal's tombstone
/// cannot be written, a `set` can.
#[derive(Debug)]
struct SetsOnly {
    inner: corral::store::memory::MemoryStore,
    down: std::sync::atomic::AtomicBool,
}

impl SetsOnly {
    fn check(&self) -> corral::Result<()> {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(corral::Error::from(ErrorKind::Unavailable).with_context("store unreachable"));
        }
        Ok(())
    }
}

impl corral::store::Entries for SetsOnly {
    fn get<'a>(
        &'a self,
        key: &'a str,
    ) -> futures::future::BoxFuture<'a, corral::Result<Option<bytes::Bytes>>> {
        use futures::FutureExt;
        async move {
            self.check()?;
            self.inner.get(key).await
        }
        .boxed()
    }

    fn ttl_ms<'a>(&'a self, key: &'a str) -> futures::future::BoxFuture<'a, corral::Result<Option<u64>>> {
        use futures::FutureExt;
        async move {
            self.check()?;
            self.inner.ttl_ms(key).await
        }
        .boxed()
    }

    fn set<'a>(
        &'a self,
        key: &'a str,
        bytes: bytes::Bytes,
        ttl_ms: u64,
    ) -> futures::future::BoxFuture<'a, corral::Result<()>> {
        self.inner.set(key, bytes, ttl_ms)
    }

    fn swap<'a>(
        &'a self,
        name: &'a str,
        bytes: bytes::Bytes,
        ttl_ms: u64,
    ) -> futures::future::BoxFuture<'a, corral::Result<Option<bytes::Bytes>>> {
        use futures::FutureExt;
        async move {
            self.check()?;
            self.inner.swap(name, bytes, ttl_ms).await
        }
        .boxed()
    }

    fn set_if<'a>(
        &'a self,
        name: &'a str,
        expected: Option<bytes::Bytes>,
        bytes: bytes::Bytes,
        ttl_ms: u64,
    ) -> futures::future::BoxFuture<'a, corral::Result<bool>> {
        use futures::FutureExt;
        async move {
            self.check()?;
            self.inner.set_if(name, expected, bytes, ttl_ms).await
        }
        .boxed()
    }

    fn delete<'a>(&'a self, key: &'a str) -> futures::future::BoxFuture<'a, corral::Result<bool>> {
        use futures::FutureExt;
        async move {
            self.check()?;
            self.inner.delete(key).await
        }
        .boxed()
    }

    fn delete_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: bytes::Bytes,
    ) -> futures::future::BoxFuture<'a, corral::Result<bool>> {
        use futures::FutureExt;
        async move {
            self.check()?;
            self.inner.delete_if_equal(key, expected).await
        }
        .boxed()
    }

    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: bytes::Bytes,
        bytes: bytes::Bytes,
        ttl_ms: u64,
    ) -> futures::future::BoxFuture<'a, corral::Result<bool>> {
        use futures::FutureExt;
        async move {
            self.check()?;
            self.inner.replace_if_equal(key, expected, bytes, ttl_ms).await
        }
        .boxed()
    }

    fn name(&self) -> &'static str {
        "sets-only"
    }
}

/// A `set` of the key by this process after a failed `remove` ends the removal's
/// retry: the tombstone never replaces the newer value.
#[tokio::test]
async fn a_set_after_a_failed_remove_ends_its_retry() -> Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    let store = corral::store::memory::MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let entries = Arc::new(SetsOnly {
        inner: store.clone(),
        down: false.into(),
    });
    let cache = Corral::builder()
        .stores("t:", entries.clone(), Arc::new(store.clone()), Arc::new(store))
        .build()?;
    cache.set("k", "old", EntryOptions::new()).await?;
    entries.down.store(true, Ordering::SeqCst);
    assert!(cache.remove("k").await.is_err());
    assert_eq!(cache.background_in_progress(), 1, "the removal is being retried");
    cache.set("k", "mine", EntryOptions::new()).await?;
    entries.down.store(false, Ordering::SeqCst);
    until(5 * SEC, "the retry never ended", async || {
        Ok(cache.background_in_progress() == 0)
    })
    .await?;
    let stored = cache.inspect("k").await?;
    assert!(
        stored.as_ref().is_some_and(|s| s.fresh),
        "the later set survives in L2: {stored:?}"
    );
    assert_eq!(cache.get("k").await?.as_deref(), Some(&b"mine"[..]));
    Ok(())
}

/// Entries and a flight lock in two stores: a leader's fill goes to the entries (and
/// through any layer over them), never to the lock's store, though that store could
/// write and release in one step had it held the entries too.
#[tokio::test]
async fn a_fill_lands_in_the_entries_when_the_lock_is_kept_elsewhere() -> Result<()> {
    use std::sync::Arc;
    let clock: Arc<dyn Clock> = Arc::new(corral::SystemClock);
    let entries = corral::store::memory::MemoryStore::new(clock.clone(), 30_000);
    let locks = corral::store::memory::MemoryStore::new(clock, 30_000);
    let cache = Corral::builder()
        .stores(
            "t:",
            Arc::new(entries.clone()),
            Arc::new(locks.clone()),
            Arc::new(locks.clone()),
        )
        .build()?;
    let v = cache
        .get_or_set("k", EntryOptions::new(), || async {
            Ok::<_, std::io::Error>("loaded")
        })
        .await?;
    assert_eq!(v, "loaded");
    assert_eq!(entries.len(), 1, "the fill is in the entries");
    assert_eq!(locks.len(), 0, "and not in the lock's store");
    Ok(())
}
