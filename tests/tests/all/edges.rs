//! Numbers and values at the edges: fencing counters past 2^53 and at Redis's largest
//! integer, another Redis type under a lock's names, durations at `Duration::MAX` in
//! every setting and option, and processes that exit right after their last call. Each
//! is refused with a typed error naming what is wrong, or works exactly; nothing
//! panics, nothing repeats, and nothing owed is lost.

use std::time::Duration;

use anyhow::{Context, Result};
use corral::locks::{LockOptions, MemoryLocks, RedisLocks};
use corral::{Corral, ErrorKind, LoadOptions};
use corral_tests::{Backend, Fixture, RedisServer, command_calls, corral_bin, real_time};

/// 2^53 + 1: the first integer a Lua number (a double) cannot hold.
const PAST_DOUBLES: u64 = (1 << 53) + 1;

/// The Redis key of `key`'s fencing counter, created by one acquire and release.
async fn counter_key(server: &RedisServer, locks: &RedisLocks, key: &str) -> Result<String> {
    let lease = locks
        .acquire(key, LockOptions::new().ttl(Duration::from_secs(5)))
        .await?;
    lease.release().await?;
    super::locks::counter_key(server, locks, key).await
}

async fn set(server: &RedisServer, key: &str, value: impl redis::ToRedisArgs) -> Result<()> {
    let mut conn = server.connection().await?;
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query_async(&mut conn)
        .await?;
    Ok(())
}

async fn hset(server: &RedisServer, key: &str) -> Result<()> {
    let mut conn = server.connection().await?;
    let _: () = redis::cmd("DEL").arg(key).query_async(&mut conn).await?;
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg("field")
        .arg("1")
        .query_async(&mut conn)
        .await?;
    Ok(())
}

/// Four acquires and releases in a row: their tokens.
async fn four_tokens(locks: &RedisLocks, key: &str) -> Result<Vec<u64>> {
    let mut tokens = Vec::new();
    for _ in 0..4 {
        let lease = locks
            .acquire(key, LockOptions::new().ttl(Duration::from_secs(5)))
            .await?;
        tokens.push(lease.fencing_token());
        lease.release().await?;
    }
    Ok(tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_rise_by_one_past_two_to_the_53() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let counter = counter_key(&server, &locks, "big").await?;
    set(&server, &counter, PAST_DOUBLES).await?;
    let tokens = four_tokens(&locks, "big").await?;
    let expected: Vec<u64> = (1..=4).map(|i| PAST_DOUBLES + i).collect();
    assert_eq!(tokens, expected, "exact integers, never a double's rounding");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_tokens_rise_strictly_past_two_to_the_53() -> Result<()> {
    let _real_time = real_time().await;
    let servers = (0..3).map(|_| RedisServer::start()).collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locks = RedisLocks::connect(&urls)?;
    let lease = locks
        .acquire("r", LockOptions::new().ttl(Duration::from_secs(5)))
        .await?;
    lease.release().await?;
    // Counters one apart, where doubles cannot tell them apart: the release must still
    // raise the lower ones to the token (compared as integers, not as Lua numbers).
    for (i, server) in servers.iter().enumerate() {
        let counter = super::locks::counter_key(server, &locks, "r").await?;
        set(server, &counter, PAST_DOUBLES + 1 + u64::from(i == 0)).await?;
    }
    let tokens = four_tokens(&locks, "r").await?;
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens rise strictly: {tokens:?}"
    );
    assert!(tokens[0] > PAST_DOUBLES + 2, "{tokens:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_counter_at_its_largest_refuses_before_taking_the_lock() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    refused_with_a_full_counter_on_the_first_of(&[server]).await
}

/// Fills the fencing counter of the lock `full` on the first of `servers`, and asserts
/// that an acquire on them all is refused (`Corrupt`, naming the largest token) and
/// leaves the lock taken nowhere.
async fn refused_with_a_full_counter_on_the_first_of(servers: &[RedisServer]) -> Result<()> {
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locks = RedisLocks::connect(&urls)?;
    let counter = counter_key(&servers[0], &locks, "full").await?;
    set(&servers[0], &counter, i64::MAX).await?;
    let err = locks
        .try_acquire("full", LockOptions::new().ttl(Duration::from_secs(5)))
        .await
        .err()
        .context("no token above i64::MAX can be issued, nor a smaller one than it gave")?;
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("largest token"), "{err}");
    for server in servers {
        let mut conn = server.connection().await?;
        let held: Option<String> = redis::cmd("GET")
            .arg(locks.lock_key("full")?)
            .query_async(&mut conn)
            .await?;
        assert_eq!(held, None, "the lock is taken nowhere");
    }
    Ok(())
}

/// Under Redlock, one server whose counter can rise no further refuses the whole acquire,
/// as one server alone does: the others' counters lag behind the largest token that
/// server gave out (its holder may have died before its release raised them), so a
/// majority without it would hand out a smaller token than an earlier holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_server_whose_counter_is_at_its_largest_refuses_the_acquire() -> Result<()> {
    let _real_time = real_time().await;
    let servers = (0..3).map(|_| RedisServer::start()).collect::<Result<Vec<_>>>()?;
    refused_with_a_full_counter_on_the_first_of(&servers).await
}

/// Another type under a minority's names is that server's failure, not the lock's: the
/// majority takes it (a Redlock survives the loss of a minority), and only when no
/// majority did is the refusal named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_value_on_a_minority_of_redlock_servers_leaves_the_majority_to_decide() -> Result<()> {
    let _real_time = real_time().await;
    let servers = (0..3).map(|_| RedisServer::start()).collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locks = RedisLocks::connect(&urls)?;
    let lock = locks.lock_key("job")?;
    let options = LockOptions::new().ttl(Duration::from_secs(5));
    hset(&servers[0], &lock).await?;
    let lease = locks
        .try_acquire("job", options)
        .await?
        .context("two of three servers took it")?;
    lease.release().await?;
    hset(&servers[1], &lock).await?;
    let err = locks
        .try_acquire("job", options)
        .await
        .err()
        .context("one of three cannot hold it")?;
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("a hash"), "{err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_redis_type_under_a_locks_names_is_named_not_called_busy() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let counter = counter_key(&server, &locks, "job").await?;
    let lock = locks.lock_key("job")?;
    let options = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(5));
    for (name, foreign) in [(&counter, "a hash"), (&lock, "a hash")] {
        hset(&server, name).await?;
        let started = std::time::Instant::now();
        let err = locks.acquire("job", options).await.err().context("refused")?;
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{name}: {err}");
        let text = err.to_string();
        assert!(text.contains(name.as_str()) && text.contains(foreign), "{text}");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "refused at once, not after the wait"
        );
        let mut conn = server.connection().await?;
        let _: () = redis::cmd("DEL").arg(name).query_async(&mut conn).await?;
    }
    set(&server, &counter, "not a number").await?;
    let err = locks.acquire("job", options).await.err().context("refused")?;
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("not a fencing counter"), "{err}");
    Ok(())
}

/// A string that never lapses under a lock's name is no Corral lock (every one has a
/// TTL): the acquire is refused at once as corrupt data naming it, not called busy for
/// good; a string with a TTL there is another owner's lock, and busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_without_a_ttl_under_a_locks_name_is_named_not_called_busy_for_good() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let lock = locks.lock_key("job")?;
    let options = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(5));
    set(&server, &lock, "someone").await?;
    let started = std::time::Instant::now();
    let err = locks.acquire("job", options).await.err().context("refused")?;
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(lock.as_str()) && text.contains("without a TTL"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "refused at once, not after the wait"
    );
    let mut conn = server.connection().await?;
    let _: () = redis::cmd("PEXPIRE")
        .arg(&lock)
        .arg(60_000)
        .query_async(&mut conn)
        .await?;
    let busy = locks.try_acquire("job", options).await?;
    assert!(busy.is_none(), "with a TTL it is another owner's lock: busy");
    set(&server, &locks.lock_key("job2")?, "someone").await?;
    let out = tokio::process::Command::new(corral_bin())
        .args(["lock", "--key", "job2", "--redis", &server.url()])
        .args(["--", "true"])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(65), "EX_DATAERR: {stderr}");
    assert!(stderr.contains("without a TTL"), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_lock_names_a_foreign_value_with_exit_65() -> Result<()> {
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    hset(&server, &locks.lock_key("cron")?).await?;
    let out = tokio::process::Command::new(corral_bin())
        .args(["lock", "--key", "cron", "--wait", "2s", "--redis", &server.url()])
        .args(["--", "true"])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(65), "EX_DATAERR: {stderr}");
    assert!(stderr.contains("holds a hash"), "{stderr}");
    Ok(())
}

#[test]
fn every_builder_duration_at_its_limit_is_an_argument_error_naming_it() {
    type Setter = fn(corral::CorralBuilder, Duration) -> corral::CorralBuilder;
    let setters: [(&str, Setter); 9] = [
        ("l1_ttl", |b, d| b.l1_ttl(d)),
        ("lock_ttl", |b, d| b.lock_ttl(d)),
        ("lock_wait", |b, d| b.lock_wait(d)),
        ("default_sliding", |b, d| b.default_sliding(d)),
        ("degraded_l1_ttl", |b, d| b.degraded_l1_ttl(d)),
        ("fail_safe_throttle", |b, d| b.fail_safe_throttle(d)),
        ("hard_timeout", |b, d| b.hard_timeout(d)),
        ("soft_timeout", |b, d| b.soft_timeout(d)),
        ("invalidation_interval", |b, d| b.invalidation_interval(d)),
    ];
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    for (name, setter) in setters {
        for too_long in [Duration::MAX, century + Duration::from_millis(1)] {
            let err = setter(Corral::builder(), too_long)
                .build()
                .err()
                .unwrap_or_else(|| panic!("{name}({too_long:?}) built"));
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{name}: {err}");
            assert_eq!(err.argument(), Some(name), "{err}");
        }
        setter(Corral::builder(), century)
            .build()
            .unwrap_or_else(|e| panic!("{name}(100 years): {e}"));
    }
}

/// A Redis response timeout is the store timeout a get-or-set's deadlines are built
/// from: zero or past a century is refused at build, naming it, in both bodies (before,
/// the native builder took it and the portable one named a `store_timeout` no builder
/// has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_timeout_of_zero_or_past_a_century_is_an_argument_error_naming_it() {
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    for bad in [Duration::ZERO, Duration::MAX, century + Duration::from_millis(1)] {
        let mut options = corral::RedisOptions::new("redis://127.0.0.1:1");
        options.response_timeout = bad;
        let native = Corral::builder().redis_options(options.clone()).build().err();
        let portable = corral::portable::PortableCache::builder()
            .redis_options(options)
            .build()
            .err();
        for (body, err) in [("native", native), ("portable", portable)] {
            let err = err.unwrap_or_else(|| panic!("{body}: response_timeout {bad:?} built"));
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{body}: {err}");
            assert_eq!(err.argument(), Some("response_timeout"), "{body}: {err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_built_with_a_century_of_each_setting_works() -> Result<()> {
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    let cache = Corral::builder()
        .l1_ttl(century)
        .lock_ttl(century)
        .default_sliding(century)
        .build()?;
    cache.set("k", b"v".to_vec(), corral::EntryOptions::new()).await?;
    let loaded = cache
        .get_or_set("other", LoadOptions::new(), || async {
            Ok::<_, std::io::Error>(b"loaded".to_vec())
        })
        .await?;
    assert_eq!(&loaded[..], b"loaded");
    assert_eq!(cache.get("k").await?.as_deref(), Some(&b"v"[..]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ttls_past_a_century_or_within_the_drift_are_argument_errors_at_once() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let redis = RedisLocks::connect(&[server.url()])?;
    let memory = MemoryLocks::new()?;
    let wait = Duration::from_secs(5);
    for (options, named) in [
        (LockOptions::new().ttl(Duration::MAX), "ttl"),
        (LockOptions::new().watchdog(Duration::MAX), "watchdog"),
        (LockOptions::new().ttl(Duration::from_millis(2)), "ttl"),
    ] {
        let started = std::time::Instant::now();
        let err = redis
            .acquire("k", options.wait(wait))
            .await
            .err()
            .context("refused")?;
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{options:?}: {err}");
        assert_eq!(err.argument(), Some(named), "{err}");
        assert!(started.elapsed() < Duration::from_secs(1), "refused up front");
        let err = redis.try_acquire("k", options).await.err().context("refused")?;
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    }
    let err = memory
        .try_lock("k", "owner", Duration::MAX)
        .err()
        .context("refused")?;
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_get_the_same_answer_warm_or_cold() -> Result<()> {
    let cache = Corral::builder().build()?;
    let load = || async { Ok::<_, std::io::Error>(b"v".to_vec()) };
    cache.get_or_set("warm", LoadOptions::new(), load).await?;
    let many_tags: Vec<String> = (0..17).map(|i| format!("t{i}")).collect();
    let past = corral::EntryOptions::new().absolute_at_ms(1);
    let cases: Vec<(&str, LoadOptions)> = vec![
        ("relative", LoadOptions::relative(Duration::ZERO)),
        (
            "sliding",
            corral::EntryOptions::new().sliding(Duration::ZERO).into(),
        ),
        ("absolute", past.into()),
        ("tags", LoadOptions::new().tags(many_tags)),
        ("timeout", LoadOptions::new().hard_timeout(Duration::MAX)),
        // Past a century: refused at every moment, whatever the clock says.
        (
            "relative",
            LoadOptions::relative(Duration::from_secs(200 * 365 * 24 * 3600)),
        ),
        ("max_stale", LoadOptions::new().fail_safe(Duration::MAX)),
    ];
    for (arg, options) in cases {
        // Twice warm: a remembered verdict must not hide a bad option either.
        for key in ["warm", "cold", "warm"] {
            let err = cache
                .get_or_set(key, options.clone(), load)
                .await
                .err()
                .with_context(|| format!("{arg} on {key} accepted"))?;
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{arg} on {key}: {err}");
            assert_eq!(err.argument(), Some(arg), "{key}: {err}");
        }
    }
    for key in ["warm", "cold"] {
        let err = cache
            .fetch(key, LoadOptions::new().eager_refresh(7.0), load)
            .await
            .err()
            .with_context(|| format!("eager_refresh(7.0) on {key} accepted"))?;
        assert_eq!(err.argument(), Some("eager_refresh"), "{key}: {err}");
    }
    // Good options are still served from L1 after a bad call.
    let value = cache.get_or_set("warm", LoadOptions::new(), load).await?;
    assert_eq!(&value[..], b"v");
    assert_eq!(cache.metrics().l1_hits, 1, "{:?}", cache.metrics());
    Ok(())
}

/// A `corral lock` process that exits right after its release still announces it to
/// the waiter behind it: the announcement is made by the release's own script, so the
/// process owes nothing once `release` returned (one announcement per waited-for
/// release; the waiter's own release, with no one behind it, makes none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_exits_right_after_its_release_still_announces_it() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let lock = locks.lock_key("cron")?;
    let mut conn = server.connection().await?;
    let before = command_calls(&server, "publish").await?;
    let runs = 5;
    for _ in 0..runs {
        let holder = tokio::process::Command::new(corral_bin())
            .args([
                "lock",
                "--key",
                "cron",
                "--redis",
                &server.url(),
                "--",
                "sleep",
                "0.2",
            ])
            .spawn()?;
        let started = std::time::Instant::now();
        while !redis::cmd("EXISTS")
            .arg(&lock)
            .query_async::<bool>(&mut conn)
            .await?
        {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(10),
                "the holder never took the lock"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let options = LockOptions::new()
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(10));
        locks.acquire("cron", options).await?.release().await?;
        let status = holder.wait_with_output().await?.status;
        assert_eq!(status.code(), Some(0));
    }
    let published = command_calls(&server, "publish").await? - before;
    assert_eq!(published, runs, "one announcement per waited-for release");
    Ok(())
}

/// The host's default prefix (a `const`, for the CLI's `--prefix` default) is the one
/// the guest names data under.
#[test]
fn the_default_prefix_is_the_guests() {
    assert_eq!(corral::DEFAULT_PREFIX, corral_core::names::DEFAULT_PREFIX);
}

/// A leader whose get-or-set lock lapsed while its loader ran (a loader slower than the
/// lock's TTL, a process paused past it) fills nothing, even when a removal made
/// meanwhile has outlived its tombstone (contract §5.12): the fill is made only while
/// the leader still holds its lock. The caller still gets its value. Here the lock's
/// lapse and the tombstone's are made by hand, at known points of the load, with the
/// cache's clock standing still (so only the store can tell).
async fn a_load_that_outlived_its_lock_never_fills_over_a_removal(backend: Backend) -> Result<()> {
    let a = Fixture::new(backend)?;
    let b = match (&a.redis, a.cache.memory_store()) {
        (Some(server), _) => {
            let mut options = corral::RedisOptions::new(server.url());
            options.prefix = corral_tests::PREFIX.into();
            Corral::builder()
                .clock(a.clock.clone())
                .redis_options(options)
                .build()?
        }
        (None, Some(store)) => Corral::builder()
            .clock(a.clock.clone())
            .memory(store.clone())
            .build()?,
        (None, None) => anyhow::bail!("a fixture without a store"),
    };
    let lock = corral_core::names::name(a.cache.prefix(), "k", corral_core::names::Kind::FlightLock);
    let value = a
        .cache
        .get_or_set("k", LoadOptions::relative(Duration::from_secs(60)), || async {
            // The lock lapses under the paused leader; another process removes the key,
            // and the removal's tombstone lapses in turn.
            match (a.raw(), a.cache.memory_store()) {
                (Some(mut conn), _) => {
                    let dropped: u64 = redis::cmd("DEL").arg(&lock).query_async(&mut conn).await?;
                    anyhow::ensure!(dropped == 1, "the leader held its lock");
                }
                (None, Some(store)) => anyhow::ensure!(store.lapse_lock(&lock), "the leader held its lock"),
                (None, None) => unreachable!(),
            }
            b.remove("k").await?;
            a.cache.entries().delete(&a.name("k")).await?;
            Ok::<_, anyhow::Error>("loaded before the removal")
        })
        .await?;
    assert_eq!(value, "loaded before the removal", "the caller gets its value");
    assert!(!a.stored("k").await?, "nothing filled once the lock lapsed");
    assert_eq!(b.get("k").await?, None);
    assert_eq!(a.cache.get("k").await?, None, "nor L1");
    assert_eq!(a.cache.metrics().fills_refused, 1);
    Ok(())
}

/// A process paused past its lock's TTL while its loader ran (here the cache's clock
/// jumps a TTL and more inside the loader, before any renewal was due) fills nothing,
/// whatever the store says of the lock: the flight judges the lapse by the moment its
/// lock try was sent. The caller gets its value, and the refused fill is counted.
async fn a_load_past_its_lock_ttl_by_the_clock_is_a_counted_refused_fill(backend: Backend) -> Result<()> {
    let f = Fixture::new(backend)?;
    let value = f
        .cache
        .get_or_set("k", LoadOptions::relative(Duration::from_secs(600)), || async {
            f.clock.advance(Duration::from_secs(31));
            Ok::<_, anyhow::Error>("paused")
        })
        .await?;
    assert_eq!(value, "paused", "the caller gets its value");
    assert!(!f.stored("k").await?, "nothing filled past the lock's TTL");
    let m = f.cache.metrics();
    assert_eq!((m.fills_refused, m.loads), (1, 1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_past_its_lock_ttl_by_the_clock_is_a_counted_refused_fill_memory() -> Result<()> {
    a_load_past_its_lock_ttl_by_the_clock_is_a_counted_refused_fill(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_past_its_lock_ttl_by_the_clock_is_a_counted_refused_fill_redis() -> Result<()> {
    a_load_past_its_lock_ttl_by_the_clock_is_a_counted_refused_fill(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_outlived_its_lock_never_fills_over_a_removal_memory() -> Result<()> {
    a_load_that_outlived_its_lock_never_fills_over_a_removal(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_outlived_its_lock_never_fills_over_a_removal_redis() -> Result<()> {
    a_load_that_outlived_its_lock_never_fills_over_a_removal(Backend::Redis).await
}
