//! Locks (contract §6) against real redis-server processes: fencing, ownership,
//! the watchdog, Redlock's quorum, the in-memory provider, and `corral lock`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use corral::locks::{LockOptions, MemoryLocks, RedisLocks};
use corral::{ErrorKind, ManualClock};
use corral_tests::{FaultProxy, RedisServer, corral_bin, real_time};
use tokio::io::AsyncBufReadExt;

const MS: Duration = Duration::from_millis(1);

/// A resource that checks fencing tokens, as docs/locks.md asks of one: it refuses a token
/// not above the last it saw, and records any overlap of two holders.
#[derive(Default)]
struct Fenced {
    busy: AtomicBool,
    last: AtomicU64,
    overlaps: AtomicUsize,
    stale: AtomicUsize,
    uses: AtomicUsize,
}

impl Fenced {
    async fn use_with(&self, token: u64) {
        if self.busy.swap(true, Ordering::SeqCst) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        if self.last.fetch_max(token, Ordering::SeqCst) >= token {
            self.stale.fetch_add(1, Ordering::SeqCst);
        }
        self.uses.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(2 * MS).await;
        self.busy.store(false, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_contenders_never_overlap_and_tokens_rise() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let resource = Arc::new(Fenced::default());
    let until = Instant::now() + Duration::from_secs(5);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        // A client each, as 64 separate services would have.
        let locks = RedisLocks::connect(&[server.url()])?;
        let resource = resource.clone();
        tasks.spawn(async move {
            while Instant::now() < until {
                let options = LockOptions::new()
                    .ttl(Duration::from_secs(2))
                    .wait(Duration::from_secs(1));
                match locks.acquire("shared", options).await {
                    Ok(lease) => {
                        resource.use_with(lease.fencing_token()).await;
                        lease.release().await?;
                    }
                    Err(e) if e.kind() == ErrorKind::Timeout => {}
                    Err(e) => return Err(anyhow::Error::from(e)),
                }
            }
            Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let uses = resource.uses.load(Ordering::SeqCst);
    println!("64 contenders for 5 s: {uses} critical sections");
    assert!(uses > 64, "the lock changed hands many times: {uses}");
    assert_eq!(
        resource.overlaps.load(Ordering::SeqCst),
        0,
        "no two holders at once"
    );
    assert_eq!(
        resource.stale.load(Ordering::SeqCst),
        0,
        "tokens strictly increase"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_holder_cannot_release_or_extend_the_next_holders_lock() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let a = locks.acquire("job", LockOptions::new().ttl(200 * MS)).await?;
    // Redis expires keys on its own clock: A really has to outlive its TTL.
    tokio::time::sleep(400 * MS).await;
    assert!(a.is_lost(), "A's validity ran out");
    let b = locks
        .acquire("job", LockOptions::new().ttl(Duration::from_secs(10)))
        .await?;
    assert!(b.fencing_token() > a.fencing_token());
    let mut conn = server.connection().await?;
    let key = locks.lock_key("job")?;
    let owner_before: String = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
    let pttl_before: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await?;

    assert_eq!(
        a.extend(Duration::from_secs(60)).await.unwrap_err().kind(),
        ErrorKind::LockLost
    );
    assert_eq!(a.release().await.unwrap_err().kind(), ErrorKind::LockLost);

    let owner_after: String = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
    let pttl_after: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await?;
    assert_eq!(owner_after, owner_before, "B still holds it");
    assert!(
        pttl_after <= pttl_before && pttl_after > 9_000,
        "B's TTL untouched: {pttl_before} -> {pttl_after}"
    );
    b.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watchdog_keeps_a_short_lease_alive_and_release_leaves_nothing() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let lease = locks
        .acquire("long-job", LockOptions::new().watchdog(300 * MS))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await; // the job runs for 2 s
    assert!(!lease.is_lost());
    let mut conn = server.connection().await?;
    let pttl: i64 = redis::cmd("PTTL")
        .arg(locks.lock_key("long-job")?)
        .query_async(&mut conn)
        .await?;
    assert!(
        pttl > 0 && pttl <= 300,
        "renewed to the 300 ms TTL, 2 s after the start: {pttl}"
    );
    lease.release().await?;
    let exists: u64 = redis::cmd("EXISTS")
        .arg(locks.lock_key("long-job")?)
        .query_async(&mut conn)
        .await?;
    assert_eq!(exists, 0, "no key remains after release");
    Ok(())
}

async fn lost_signal_fires(fault: impl FnOnce(&mut RedisServer) -> Result<()>) -> Result<()> {
    let _real_time = real_time().await;
    let mut server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let lease = locks
        .acquire("job", LockOptions::new().watchdog(300 * MS))
        .await?;
    let began = Instant::now();
    fault(&mut server)?;
    tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .context("the lost signal never fired")?;
    assert!(lease.is_lost());
    println!("lost signal after {:?}", began.elapsed());
    let _ = server.resume();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_makes_the_lost_signal_fire() -> Result<()> {
    lost_signal_fires(|s| s.pause()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_makes_the_lost_signal_fire() -> Result<()> {
    lost_signal_fires(|s| {
        s.kill();
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_holds_with_two_of_five_down_and_refuses_with_three() -> Result<()> {
    let _real_time = real_time().await;
    let mut servers = (0..5).map(|_| RedisServer::start()).collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locks = RedisLocks::connect(&urls)?;
    servers[0].kill();
    servers[1].kill();
    let lease = locks
        .acquire("r", LockOptions::new().ttl(Duration::from_secs(5)))
        .await?;
    assert!(lease.fencing_token() >= 1);
    lease.release().await?;

    servers[2].kill();
    let e = locks
        .acquire("r", LockOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Quorum, "{e}");
    for live in &servers[3..] {
        let mut conn = live.connection().await?;
        let exists: u64 = redis::cmd("EXISTS")
            .arg(locks.lock_key("r")?)
            .query_async(&mut conn)
            .await?;
        assert_eq!(exists, 0, "no partial lock left on a live server");
    }
    Ok(())
}

#[test]
fn ten_thousand_racing_try_locks_have_one_winner() -> Result<()> {
    let locks = MemoryLocks::new()?;
    let winners = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..8 {
            let (locks, winners) = (&locks, &winners);
            s.spawn(move || {
                for i in 0..1_250 {
                    if locks
                        .try_lock("hot", &format!("owner-{t}-{i}"), Duration::from_secs(60))
                        .unwrap()
                    {
                        winners.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
    });
    assert_eq!(winners.load(Ordering::SeqCst), 1);
    Ok(())
}

#[test]
fn the_memory_provider_follows_the_seed_api_and_sweeps_zombies() -> Result<()> {
    let clock = ManualClock::new(1_000_000);
    let locks = MemoryLocks::with_clock(clock.clone())?;
    assert!(locks.is_lock_expired("a")?, "never taken");
    assert!(locks.try_lock("a", "alice", Duration::from_secs(1))?);
    assert!(!locks.try_lock("a", "bob", Duration::from_secs(1))?);
    assert!(locks.is_locked_by("a", "alice")? && !locks.is_locked_by("a", "bob")?);
    assert!(!locks.unlock("a", "bob")?, "only the owner unlocks");
    assert!(locks.unlock("a", "alice")?);
    assert!(locks.try_lock("a", "bob", Duration::from_secs(1))?);
    assert!(locks.force_unlock("a"), "administrators unlock anyone's");
    assert_eq!(
        locks.try_lock("a", "bob", Duration::ZERO).unwrap_err().argument(),
        Some("ttl")
    );
    assert_eq!(
        locks
            .try_lock(" ", "bob", Duration::from_secs(1))
            .unwrap_err()
            .argument(),
        Some("key")
    );

    for key in ["x", "y", "z"] {
        locks.try_lock(key, "alice", Duration::from_secs(1))?;
    }
    clock.advance(Duration::from_secs(2));
    assert!(locks.is_lock_expired("x")?);
    assert!(
        locks.try_lock("x", "bob", Duration::from_secs(10))?,
        "an expired lock is taken over"
    );
    assert_eq!(
        locks.sweep()?,
        2,
        "y and z were zombies; x was taken over and stays"
    );
    assert!(locks.is_locked_by("x", "bob")?);
    assert_eq!(locks.len(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_shell_processes_take_turns_under_corral_lock() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let dir = std::env::temp_dir().join(format!("corral-lock-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let log = dir.join("log");
    let _ = std::fs::remove_file(&log);
    let script = format!(
        "echo \"start $CORRAL_FENCING_TOKEN\" >> {0}; sleep 0.05; echo \"end $CORRAL_FENCING_TOKEN\" >> {0}",
        log.display()
    );
    let mut children = Vec::new();
    for _ in 0..20 {
        children.push(
            tokio::process::Command::new(corral_bin())
                .args([
                    "lock",
                    "--key",
                    "cron",
                    "--wait",
                    "60s",
                    "--redis",
                    &server.url(),
                    "--",
                ])
                .args(["sh", "-c", &script])
                .spawn()?,
        );
    }
    for mut child in children {
        assert!(child.wait().await?.success());
    }
    let text = std::fs::read_to_string(&log)?;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 40, "{text}");
    let mut last = 0;
    for pair in lines.chunks(2) {
        let start: u64 = pair[0].strip_prefix("start ").context("a start line")?.parse()?;
        assert_eq!(pair[1], format!("end {start}"), "no interleaving:\n{text}");
        assert!(start > last, "tokens rise in the order the holders ran:\n{text}");
        last = start;
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_lock_says_so_when_the_lock_is_busy() -> Result<()> {
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let held = locks
        .acquire("cron", LockOptions::new().ttl(Duration::from_secs(30)))
        .await?;
    let out = tokio::process::Command::new(corral_bin())
        .args([
            "lock",
            "--key",
            "cron",
            "--wait",
            "200ms",
            "--redis",
            &server.url(),
            "--",
            "true",
        ])
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(75));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("held by another owner"), "{stderr}");
    held.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_lock_stops_the_command_when_the_lock_is_lost() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let mut child = tokio::process::Command::new(corral_bin())
        .args([
            "lock",
            "--key",
            "cron",
            "--watchdog",
            "300ms",
            "--redis",
            &server.url(),
            "--",
            "sleep",
            "30",
        ])
        .env("CORRAL_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // `corral lock` logs when it holds the lock; then the server goes away.
    let mut stderr = tokio::io::BufReader::new(child.stderr.take().context("piped")?).lines();
    let mut first = String::new();
    while !first.contains("holding the lock") {
        first = stderr
            .next_line()
            .await?
            .context("corral lock ended before holding")?;
    }
    // Fencing tokens start at the server's clock in microseconds, not at 1.
    let token = first
        .split_once("fencing_token=")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|t| t.parse::<u64>().ok());
    assert!(token.is_some_and(|t| t > 0), "{first}");
    server.pause()?;
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await??;
    server.resume()?;
    let mut rest = String::new();
    while let Some(line) = stderr.next_line().await? {
        rest.push_str(&line);
        rest.push('\n');
    }
    assert_eq!(status.code(), Some(76), "{rest}");
    assert!(
        rest.contains("lost (expired or taken over): stopping the command"),
        "{rest}"
    );
    Ok(())
}

/// Polls `check` every 20 ms until it holds or `within` passes; says whether it held.
async fn eventually<F, Fut>(within: Duration, mut check: F) -> Result<bool>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let until = Instant::now() + within;
    loop {
        if check().await? {
            return Ok(true);
        }
        if Instant::now() >= until {
            return Ok(false);
        }
        tokio::time::sleep(20 * MS).await;
    }
}

/// The value of the lock key of `key` on `server` (`None`: not held there).
async fn holder(server: &RedisServer, locks: &RedisLocks, key: &str) -> Result<Option<String>> {
    let mut conn = server.connection().await?;
    Ok(redis::cmd("GET")
        .arg(locks.lock_key(key)?)
        .query_async(&mut conn)
        .await?)
}

/// The Redis key of the fencing counter of `key` on `server`: the one key there that is
/// not the lock key (the test stores nothing else), whatever the naming scheme.
pub(super) async fn counter_key(server: &RedisServer, locks: &RedisLocks, key: &str) -> Result<String> {
    let mut conn = server.connection().await?;
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await?;
    let lock = locks.lock_key(key)?;
    let others: Vec<String> = keys.into_iter().filter(|k| *k != lock).collect();
    anyhow::ensure!(others.len() == 1, "one counter key expected: {others:?}");
    Ok(others[0].clone())
}

/// Opens every server's connection and loads the lock scripts there, so that a fault
/// injected afterwards stalls an established connection (its response timeout, 1 s).
async fn warm(locks: &RedisLocks) -> Result<()> {
    let lease = locks
        .acquire("warm-up", LockOptions::new().ttl(Duration::from_secs(1)))
        .await?;
    lease.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_won_with_a_stalled_minority_is_valid_for_ttl_minus_elapsed_minus_drift() -> Result<()> {
    let _real_time = real_time().await;
    let servers = (0..3).map(|_| RedisServer::start()).collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locks = RedisLocks::connect(&urls)?;
    warm(&locks).await?;
    servers[2].pause()?;
    let ttl = Duration::from_secs(3);
    let began = Instant::now();
    let lease = locks
        .acquire("stalled", LockOptions::new().ttl(ttl).wait(Duration::ZERO))
        .await;
    let elapsed = began.elapsed();
    let seen = lease.as_ref().ok().map(|l| (l.valid_for(), l.is_lost()));
    servers[2].resume()?;
    let lease = lease?;
    let (left, lost) = seen.context("held")?;
    let drift = Duration::from_millis(3_000 / 100 + 2);
    println!("TTL {ttl:?}, one of 3 servers stalled: acquire took {elapsed:?}, validity left {left:?}");
    assert!(
        elapsed >= Duration::from_millis(900),
        "the stalled server held the round for its response timeout: {elapsed:?}"
    );
    assert!(!lost, "a lease won in time is not lost at birth");
    let expected = ttl - elapsed - drift;
    assert!(
        left + Duration::from_millis(100) >= expected && left <= ttl - drift,
        "validity is TTL - elapsed - drift once, not twice: {left:?}, expected about {expected:?}"
    );
    lease.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_step_neither_loses_a_held_lease_nor_keeps_a_lapsed_one() -> Result<()> {
    use corral::Clock;
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let wall = ManualClock::starting_now();
    let locks = RedisLocks::connect_with(&[server.url()], "corral:", wall.clone())?;
    let fixed = locks
        .acquire("fixed", LockOptions::new().ttl(Duration::from_secs(5)))
        .await?;
    let watched = locks
        .acquire("watched", LockOptions::new().watchdog(300 * MS))
        .await?;
    wall.advance(Duration::from_secs(3_600));
    assert!(
        !fixed.is_lost(),
        "an hour's step of the wall clock does not end a 5 s lease"
    );
    tokio::time::sleep(Duration::from_secs(1)).await; // the watchdog renews about 3 times
    assert!(!watched.is_lost(), "the watchdog keeps renewing on its own clock");
    assert!(!fixed.is_lost());
    let left = fixed.valid_for();
    assert!(
        left > Duration::from_secs(3) && left < Duration::from_secs(5),
        "{left:?}"
    );
    assert!(holder(&server, &locks, "watched").await?.is_some());
    fixed.release().await?;
    watched.release().await?;

    // Stepping back: a 300 ms lease still lapses after 300 ms.
    let short = locks.acquire("short", LockOptions::new().ttl(300 * MS)).await?;
    wall.set(wall.now_ms() - 3_600_000);
    tokio::time::sleep(400 * MS).await;
    assert!(
        short.is_lost(),
        "a step back of the wall clock does not extend a lease past its validity"
    );
    tokio::time::timeout(Duration::from_secs(1), short.lost())
        .await
        .context("the lost signal fires at the monotonic deadline")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_rise_after_a_restart_without_persistence_or_a_deleted_counter() -> Result<()> {
    let _real_time = real_time().await;
    let mut server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let options = LockOptions::new().ttl(Duration::from_secs(10));
    let first = locks.acquire("fenced", options).await?;
    let t1 = first.fencing_token();
    first.release().await?;
    server.restart()?; // `--save ""`: it comes back empty
    // The first command on the old connection may fail: acquire retries.
    let second = locks.acquire("fenced", options).await?;
    let t2 = second.fencing_token();
    second.release().await?;
    let key = counter_key(&server, &locks, "fenced").await?;
    let mut conn = server.connection().await?;
    let _: () = redis::cmd("DEL").arg(&key).query_async(&mut conn).await?;
    let third = locks.acquire("fenced", options).await?;
    let t3 = third.fencing_token();
    third.release().await?;
    println!("tokens: {t1}, after a restart {t2}, after the counter's deletion {t3}");
    assert!(t2 > t1, "a restart without persistence: {t1} then {t2}");
    assert!(t3 > t2, "a deleted counter: {t2} then {t3}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_tokens_rise_after_a_crashed_holder_and_a_lost_counter() -> Result<()> {
    let _real_time = real_time().await;
    let servers = (0..3).map(|_| RedisServer::start()).collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locks = RedisLocks::connect(&urls)?;
    let first = locks
        .acquire("r", LockOptions::new().ttl(Duration::from_secs(5)))
        .await?;
    let t1 = first.fencing_token();
    first.release().await?;
    // Server 0's counter drifted ahead of the others (it saw acquires they missed).
    let key = counter_key(&servers[0], &locks, "r").await?;
    let mut conn = servers[0].connection().await?;
    let value: u64 = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg(value + 1_000)
        .query_async(&mut conn)
        .await?;
    // A holder takes the lock, its token from server 0, and crashes without releasing.
    let crashed = locks.acquire("r", LockOptions::new().ttl(300 * MS)).await?;
    let t2 = crashed.fencing_token();
    std::mem::forget(crashed);
    tokio::time::sleep(400 * MS).await;
    // Server 0 loses its counter.
    let _: () = redis::cmd("DEL").arg(&key).query_async(&mut conn).await?;
    let next = locks
        .acquire("r", LockOptions::new().ttl(Duration::from_secs(5)))
        .await?;
    let t3 = next.fencing_token();
    next.release().await?;
    println!("Redlock tokens: {t1}, drifted {t2}, after the crash and the lost counter {t3}");
    assert!(t2 > t1 && t3 > t2, "tokens only rise: {t1}, {t2}, {t3}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_reply_times_out_leaves_no_lock_behind() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    warm(&locks).await?;
    server.pause()?;
    let options = LockOptions::new().ttl(Duration::from_secs(30));
    let outcome = locks.try_acquire("orphan", options).await;
    server.resume()?;
    let e = outcome.expect_err("the only server was frozen");
    println!("acquire against a frozen server: {e}");
    // The frozen server ran the SET when it woke; the lease code releases it.
    let gone = eventually(Duration::from_secs(5), || async {
        Ok(holder(&server, &locks, "orphan").await?.is_none())
    })
    .await?;
    assert!(gone, "the lock key is left held by a token nobody has");
    let lease = locks.try_acquire("orphan", options).await?;
    assert!(lease.is_some(), "the lock is free again");
    Ok(())
}

/// A release Redis did not answer (its connection reset, new ones refused) leaves the
/// lock held there: it is retried in the background until the lock would have lapsed,
/// and `close`, what a process calls before it exits, returns once it went through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_redis_did_not_answer_is_retried_and_close_waits_for_it() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let proxy = FaultProxy::start(server.addr())?;
    let locks = RedisLocks::connect(&[proxy.url()])?;
    let lease = locks
        .acquire("owed", LockOptions::new().ttl(Duration::from_secs(30)))
        .await?;
    proxy.refuse(true);
    ensure!(proxy.reset_all() >= 1, "the lock's connection");
    let e = lease.release().await.expect_err("Redis was out of reach");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    ensure!(
        holder(&server, &locks, "owed").await?.is_some(),
        "the lock is still held in Redis"
    );
    let closing = tokio::spawn({
        let locks = locks.clone();
        async move { locks.close(Duration::from_secs(10)).await }
    });
    proxy.heal();
    closing.await??;
    assert_eq!(
        holder(&server, &locks, "owed").await?,
        None,
        "close returned with the lock still held, its release never retried"
    );
    // Nothing owed: at once.
    locks.close(Duration::ZERO).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_acquire_leaves_no_lock_behind() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    warm(&locks).await?;
    server.pause()?;
    let options = LockOptions::new().ttl(Duration::from_secs(30));
    // The caller gives up mid-flight: its future is dropped with the SET sent.
    let cancelled = tokio::time::timeout(200 * MS, locks.acquire("dropped", options)).await;
    assert!(cancelled.is_err(), "still in flight when dropped");
    server.resume()?;
    let gone = eventually(Duration::from_secs(5), || async {
        Ok(holder(&server, &locks, "dropped").await?.is_none())
    })
    .await?;
    assert!(gone, "the lock key is left held by a dropped acquire");
    let lease = locks.try_acquire("dropped", options).await?;
    assert!(lease.is_some(), "the lock is free again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_server_outage_is_unavailable_not_quorum() -> Result<()> {
    let _real_time = real_time().await;
    let mut server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    let lease = locks
        .acquire("solo", LockOptions::new().ttl(Duration::from_secs(10)))
        .await?;
    server.kill();
    let options = LockOptions::new().ttl(Duration::from_secs(10));
    let e = locks.try_acquire("other", options).await.unwrap_err();
    println!("try_acquire: {e}");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains(&server.url()), "names the server: {e}");
    let e = locks.acquire("other", options.wait(300 * MS)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let e = lease.extend(Duration::from_secs(10)).await.unwrap_err();
    println!("extend: {e}");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let e = lease.release().await.unwrap_err();
    println!("release: {e}");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn memory_locks_sweep_expired_entries_by_themselves_until_dropped() -> Result<()> {
    let clock = ManualClock::new(1_000_000);
    let metrics = tokio::runtime::Handle::current().metrics();
    let tasks_before = metrics.num_alive_tasks();
    let locks = MemoryLocks::with_sweep_interval(clock.clone(), 50 * MS)?;
    for key in ["a", "b", "c"] {
        assert!(locks.try_lock(key, "alice", Duration::from_secs(1))?);
    }
    assert!(locks.try_lock("live", "alice", Duration::from_secs(3_600))?);
    clock.advance(Duration::from_secs(2));
    let swept = eventually(Duration::from_secs(2), || async { Ok(locks.len() == 1) }).await?;
    assert!(swept, "expired entries left after 2 s: {}", locks.len());
    assert!(locks.is_locked_by("live", "alice")?, "a live lock stays");

    // The sweeper lives as long as the table: a clone keeps it, the last drop stops it.
    assert_eq!(metrics.num_alive_tasks(), tasks_before + 1, "one sweeper");
    let twin = locks.clone();
    drop(locks);
    tokio::task::yield_now().await;
    assert_eq!(metrics.num_alive_tasks(), tasks_before + 1, "a clone keeps it");
    drop(twin);
    let stopped = eventually(Duration::from_secs(2), || async {
        Ok(metrics.num_alive_tasks() == tasks_before)
    })
    .await?;
    assert!(stopped, "the sweeper outlived its table");
    Ok(())
}

#[test]
fn memory_locks_sweep_without_a_runtime_too() -> Result<()> {
    let clock = ManualClock::new(1_000_000);
    let locks = MemoryLocks::with_sweep_interval(clock.clone(), 50 * MS)?;
    assert!(locks.try_lock("a", "alice", Duration::from_secs(1))?);
    clock.advance(Duration::from_secs(2));
    let until = Instant::now() + Duration::from_secs(2);
    while !locks.is_empty() && Instant::now() < until {
        std::thread::sleep(20 * MS);
    }
    assert_eq!(locks.len(), 0, "swept by the table's own thread");
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn the_default_memory_table_sweeps_within_its_interval() -> Result<()> {
    let clock = ManualClock::new(1_000_000);
    let locks = MemoryLocks::with_clock(clock.clone())?;
    assert!(locks.try_lock("a", "alice", Duration::from_secs(1))?);
    clock.advance(Duration::from_secs(2));
    let swept = eventually(Duration::from_secs(3), || async { Ok(locks.is_empty()) }).await?;
    assert!(swept, "the default table never swept its zombie");
    Ok(())
}

/// User locks are named like every other datum (contract §2.4): tenants whose prefixes
/// nest never share a lock, and a lock and its fencing counter share one hash slot, so
/// the acquire script is single-slot on a Redis Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_locks_of_nested_tenants_never_meet() -> Result<()> {
    let server = RedisServer::start()?;
    let outer = RedisLocks::connect_with(&[server.url()], "corral:", corral::SystemClock)?;
    let inner = RedisLocks::connect_with(&[server.url()], "corral:lock:", corral::SystemClock)?;
    assert_eq!(outer.lock_key("job")?, "{7:corral:job}:k");
    let options = LockOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Duration::ZERO);
    // Under the first round's scheme both were `corral:lock:lock:job`.
    let a = outer.try_acquire("lock:job", options).await?.expect("free");
    let b = inner
        .try_acquire("job", options)
        .await?
        .expect("another tenant's lock");
    a.release().await?;
    b.release().await?;
    assert!(outer.lock_key(" ").is_err(), "a bad key is an argument error");
    Ok(())
}

/// Ten jobs of 300 ms queue on one lock: each waiter wakes on the holder's release (an
/// announcement on the landing channel), not at its next backoff step (50 ms doubling
/// to 1 s), so the queue drains in about ten times 300 ms. Through a cache's locks and
/// through standalone ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_waiters_wake_on_the_release_not_by_polling() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let cache = corral::Corral::builder().redis(server.url()).build()?;
    let from_cache = cache.locks().redis().expect("leases").clone();
    let standalone = RedisLocks::connect(&[server.url()])?;
    for (what, locks) in [("cache.locks()", from_cache), ("RedisLocks::connect", standalone)] {
        let resource = Arc::new(Fenced::default());
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let (locks, resource) = (locks.clone(), resource.clone());
            tasks.spawn(async move {
                let options = LockOptions::new()
                    .ttl(Duration::from_secs(5))
                    .wait(Duration::from_secs(20));
                let lease = locks.acquire("report", options).await?;
                resource.use_with(lease.fencing_token()).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                lease.release().await?;
                anyhow::Ok(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        let took = started.elapsed();
        println!("{what}: ten queued 300 ms jobs took {took:?}");
        assert_eq!(resource.uses.load(Ordering::SeqCst), 10);
        assert_eq!(resource.overlaps.load(Ordering::SeqCst), 0);
        // Polling with the backoff took 7.9 s; woken by releases it is 3 s and the
        // hand-overs. A generous bound: this asserts the wake-up, not a speed.
        assert!(took < Duration::from_millis(5_000), "{what}: {took:?}");
    }
    Ok(())
}

/// A release announces itself only when a waiter marked the lock waited for (a try
/// that found it held and will wait for the announcement): every process on the prefix
/// hears an announcement, so an uncontended lease publishes nothing, a lease with a
/// waiter publishes once and clears the mark, and the next uncontended one is quiet
/// again. Fair and plain, through a cache's locks and standalone ones; once with the
/// holder keeping the waiter waiting past the mark's lifetime (each try renews it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_release_with_a_waiter_is_announced() -> Result<()> {
    use corral_core::names::{DEFAULT_PREFIX, Kind, name};
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let cache = corral::Corral::builder().redis(server.url()).build()?;
    let from_cache = cache.locks().redis().expect("leases").clone();
    let standalone = RedisLocks::connect(&[server.url()])?;
    let mut conn = server.connection().await?;
    let published = || corral_tests::command_calls(&server, "publish");
    for (what, locks) in [("cache.locks()", from_cache), ("RedisLocks::connect", standalone)] {
        for fair in [false, true] {
            let key = format!("announced-{fair}");
            assert_eq!(locks.lock_key(&key)?, name(DEFAULT_PREFIX, &key, Kind::Lock));
            let mark = name(DEFAULT_PREFIX, &key, Kind::Waiting);
            let options = LockOptions::new()
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(10))
                .fair(fair);
            let quiet = |n: usize| {
                let (locks, key) = (locks.clone(), key.clone());
                async move {
                    for i in 0..n {
                        let lease = match i % 2 {
                            0 => locks.try_acquire(&key, options).await?.context("free")?,
                            _ => locks.acquire(&key, options).await?,
                        };
                        lease.release().await?;
                    }
                    anyhow::Ok(())
                }
            };
            let before = published().await?;
            quiet(20).await?;
            assert_eq!(
                published().await? - before,
                0,
                "{what}, fair {fair}: uncontended releases announce nothing"
            );

            let holder = locks.acquire(&key, options).await?;
            let waiter = tokio::spawn({
                let (locks, key) = (locks.clone(), key.clone());
                async move { locks.acquire(&key, options).await?.release().await }
            });
            // The waiter's first try found the lock held and marked it.
            let asked = Instant::now();
            while !redis::cmd("EXISTS")
                .arg(&mark)
                .query_async::<bool>(&mut conn)
                .await?
            {
                ensure!(
                    asked.elapsed() < Duration::from_secs(5),
                    "{what}: no waiting mark"
                );
                tokio::time::sleep(5 * MS).await;
            }
            if !fair && what == "RedisLocks::connect" {
                // Held past the mark's first lapse: the waiter's later tries renewed it.
                let stale = Duration::from_millis(corral_core::script::FAIR_STALE_MS);
                tokio::time::sleep(stale + Duration::from_secs(1)).await;
            }
            let before = published().await?;
            holder.release().await?;
            waiter.await??;
            assert_eq!(
                published().await? - before,
                1,
                "{what}, fair {fair}: the release the waiter waited for is announced, the waiter's own is not"
            );
            let exists: bool = redis::cmd("EXISTS").arg(&mark).query_async(&mut conn).await?;
            assert!(!exists, "{what}, fair {fair}: the announcement cleared the mark");
            let before = published().await?;
            quiet(4).await?;
            assert_eq!(published().await? - before, 0, "{what}, fair {fair}: quiet again");
        }
    }
    Ok(())
}

/// Fair leases: callers in one process get the lock in the order they asked, even
/// when a later caller would try sooner. Redlock over two servers has no landing
/// channel, so waiters poll with a growing backoff: an early waiter has backed off to
/// about a second when a late one arrives trying every 50 ms. Unfair, the late one wins
/// the lock after the release; fair, it queues behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_waiters_in_one_process_are_served_first_come_first_served() -> Result<()> {
    let _real_time = real_time().await;
    let (a, b) = (RedisServer::start()?, RedisServer::start()?);
    let locks = RedisLocks::connect(&[a.url(), b.url()])?;
    for fair in [false, true] {
        let options = LockOptions::new()
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(20))
            .fair(fair);
        let holder = locks.acquire("queue", options).await?;
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let waiter = |name: &'static str| {
            let (locks, order) = (locks.clone(), order.clone());
            tokio::spawn(async move {
                let lease = locks.acquire("queue", options).await?;
                order.lock().push(name);
                tokio::time::sleep(Duration::from_millis(100)).await;
                lease.release().await?;
                anyhow::Ok(())
            })
        };
        let early = waiter("early");
        // The early waiter backs off (50, 100, 200, 400, 800 ms...) meanwhile.
        tokio::time::sleep(Duration::from_millis(1_600)).await;
        let late = waiter("late");
        tokio::time::sleep(Duration::from_millis(20)).await;
        holder.release().await?;
        early.await??;
        late.await??;
        let order = order.lock().clone();
        println!("fair = {fair}: {order:?}");
        if fair {
            assert_eq!(order, ["early", "late"], "first come, first served");
        } else {
            assert_eq!(order, ["late", "early"], "without it, the quicker try wins");
        }
    }
    Ok(())
}

/// The servers of a fair Redlock agree on who is ahead, whatever order the waiters
/// reached them in: each queue is kept in the order of the waiters' ids (when each
/// started waiting, contract §6). Kept in the order of arrival, two waiters reaching two
/// servers in opposite orders would each head one queue, and neither would ever take a
/// majority. Also: a waiter's place is kept across its tries, `leave` gives it up, and a
/// `try` never queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_queues_on_several_servers_agree_whatever_order_the_waiters_reached_them_in() -> Result<()> {
    use corral_core::{lock::fair_waiter, names, script::LOCK_ACQUIRE_FAIR};
    let (a, b) = (RedisServer::start()?, RedisServer::start()?);
    let [lock, fence, queue] = [names::Kind::Lock, names::Kind::Fence, names::Kind::Queue]
        .map(|kind| names::name(corral::DEFAULT_PREFIX, "job", kind));
    let (first, second) = (fair_waiter(1_000, "bb"), fair_waiter(2_000, "aa"));
    let script = redis::Script::new(LOCK_ACQUIRE_FAIR);
    let run = |url: String, owner: &'static str, waiter: String, how: &'static str| {
        let (script, lock, fence, queue) = (script.clone(), lock.clone(), fence.clone(), queue.clone());
        async move {
            let mut conn = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            let reply: redis::Value = script
                .key(lock)
                .key(fence)
                .key(queue)
                .arg(owner)
                .arg(10_000)
                .arg(waiter)
                .arg(how)
                .invoke_async(&mut conn)
                .await?;
            anyhow::Ok(reply)
        }
    };
    let queued = |url: String| {
        let queue = queue.clone();
        async move {
            let mut conn = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            let q: Option<String> = redis::cmd("GET").arg(queue).query_async(&mut conn).await?;
            anyhow::Ok(
                q.unwrap_or_default()
                    .lines()
                    .map(|l| l.split(' ').next().unwrap_or("").to_owned())
                    .collect::<Vec<_>>(),
            )
        }
    };
    for server in [&a, &b] {
        ensure!(run(server.url(), "holder", fair_waiter(1, "h"), "wait").await? != redis::Value::Int(0));
    }
    // Server a hears the first waiter first; server b hears the second first.
    for (server, order) in [(&a, [&first, &second]), (&b, [&second, &first])] {
        for waiter in order {
            ensure!(run(server.url(), "w", waiter.clone(), "wait").await? == redis::Value::Int(0));
        }
    }
    for server in [&a, &b] {
        ensure!(
            queued(server.url()).await? == [first.clone(), second.clone()],
            "{:?}",
            queued(server.url()).await?
        );
    }
    // A second try keeps the place; a lone try never queues; leaving gives it up.
    run(a.url(), "w", second.clone(), "wait").await?;
    run(a.url(), "t", fair_waiter(500, "try"), "try").await?;
    ensure!(queued(a.url()).await? == [first.clone(), second.clone()]);
    run(a.url(), "w", first.clone(), "leave").await?;
    ensure!(queued(a.url()).await? == std::slice::from_ref(&second));
    Ok(())
}

/// The portable body's lock table is swept in the background as `MemoryLocks` is
/// (contract §6.2): an expired lock nobody touches again is removed within the sweep
/// interval. Before, that table was never swept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portable_lock_table_sweeps_expired_locks_by_itself() -> Result<()> {
    let clock = ManualClock::new(1_000_000);
    let cache = corral::portable::PortableCache::builder()
        .clock(clock.clone())
        .build()?;
    assert!(cache.try_lock("job", "a", 100 * MS).await?);
    assert!(cache.try_lock("other", "b", Duration::from_secs(3600)).await?);
    assert_eq!(cache.locks_held(), 2);
    clock.advance(200 * MS);
    let swept = eventually(Duration::from_secs(5), || {
        let held = cache.locks_held();
        async move { Ok(held == 1) }
    })
    .await?;
    assert!(
        swept,
        "the expired lock was never swept: {} held",
        cache.locks_held()
    );
    assert!(
        !cache.try_lock("other", "c", 100 * MS).await?,
        "a live lock stays"
    );
    Ok(())
}

/// Locks built from `RedisOptions` keep each server's timeouts and the options' prefix:
/// over a link whose round trip (700 ms) is longer than the default connect timeout,
/// `connect` cannot take a lock and `from_options` with a longer one can. Options that
/// cannot describe one set of locks are refused before anything connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_from_options_keep_their_timeouts_and_prefix() -> Result<()> {
    let _real_time = real_time().await;
    let server = RedisServer::start()?;
    let proxy = FaultProxy::start(server.addr())?;
    proxy.set_latency(Duration::from_millis(350));
    let once = LockOptions::new().ttl(Duration::from_secs(5));

    let hasty = RedisLocks::connect(&[proxy.url()])?;
    let err = hasty
        .try_acquire("far", once)
        .await
        .err()
        .context("a 500 ms connect timeout")?;
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");

    let mut patient = corral::RedisOptions::new(proxy.url());
    patient.connect_timeout = Duration::from_secs(5);
    patient.response_timeout = Duration::from_secs(5);
    patient.prefix = "tenant-b:".into();
    let locks = RedisLocks::from_options(std::slice::from_ref(&patient))?;
    let lease = locks
        .try_acquire("far", once)
        .await?
        .context("the lock is free")?;
    let name = locks.lock_key("far")?;
    assert!(name.contains("tenant-b:"), "{name}");
    let mut conn = server.connection().await?;
    let held: Option<String> = redis::cmd("GET").arg(&name).query_async(&mut conn).await?;
    ensure!(held.is_some(), "the lock is under the options' prefix");
    lease.release().await?;

    let refused = |servers: &[corral::RedisOptions]| {
        RedisLocks::from_options(servers)
            .err()
            .map(|e| (e.kind(), e.to_string()))
    };
    let mut other = corral::RedisOptions::new(server.url());
    other.prefix = "tenant-c:".into();
    let mut cluster = corral::RedisOptions::cluster([server.url()]);
    cluster.prefix = patient.prefix.clone();
    for (servers, why) in [
        (vec![], "at least one server"),
        (vec![patient.clone(), other], "the same on every server"),
        (vec![patient, cluster], "not on a cluster"),
    ] {
        let (kind, text) = refused(&servers).context(why)?;
        assert_eq!(kind, ErrorKind::InvalidArgument, "{text}");
        assert!(text.contains(why), "{text}");
    }
    Ok(())
}

/// A bad lease TTL is named as the caller set it: `watchdog` for
/// [`LockOptions::watchdog`]'s, `ttl` for [`LockOptions::ttl`]'s; nothing is sent.
#[tokio::test]
async fn a_bad_lease_ttl_is_named_as_the_caller_set_it() -> Result<()> {
    let server = RedisServer::start()?;
    let locks = RedisLocks::connect(&[server.url()])?;
    for (options, named) in [
        (LockOptions::new().watchdog(Duration::ZERO), "watchdog"),
        (LockOptions::new().watchdog(Duration::from_millis(2)), "watchdog"),
        (LockOptions::new().ttl(Duration::ZERO), "ttl"),
    ] {
        for refused in [
            locks.try_acquire("job", options).await.err(),
            locks.acquire("job", options).await.err(),
        ] {
            let e = refused.context("refused")?;
            ensure!(e.kind() == ErrorKind::InvalidArgument, "{e}");
            ensure!(e.argument() == Some(named), "{e:?}");
            ensure!(e.to_string().contains(&format!("`{named}`")), "{e}");
        }
    }
    Ok(())
}
