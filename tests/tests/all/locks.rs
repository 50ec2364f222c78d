//! Locks (contract §6) against real redis-server processes: fencing, ownership,
//! the watchdog, Redlock's quorum, the in-memory provider, and `corral lock`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use corral::locks::{LockOptions, MemoryLocks, RedisLocks};
use corral::{ErrorKind, ManualClock};
use corral_tests::{RedisServer, corral_bin, real_time};
use tokio::io::AsyncBufReadExt;

const MS: Duration = Duration::from_millis(1);

/// A resource that checks fencing tokens, as the README asks of one: it refuses a token
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
    let key = locks.lock_key("job");
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
        .arg(locks.lock_key("long-job"))
        .query_async(&mut conn)
        .await?;
    assert!(
        pttl > 0 && pttl <= 300,
        "renewed to the 300 ms TTL, 2 s after the start: {pttl}"
    );
    lease.release().await?;
    let exists: u64 = redis::cmd("EXISTS")
        .arg(locks.lock_key("long-job"))
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
            .arg(locks.lock_key("r"))
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
    assert!(
        stderr.contains("could not get lock") && stderr.contains("--wait"),
        "{stderr}"
    );
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
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // `corral lock` says when it holds the lock; then the server goes away.
    let mut stderr = tokio::io::BufReader::new(child.stderr.take().context("piped")?).lines();
    let first = stderr.next_line().await?.unwrap_or_default();
    assert!(first.contains("holding \"cron\" (fencing token 1)"), "{first}");
    server.pause()?;
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await??;
    server.resume()?;
    let mut rest = String::new();
    while let Some(line) = stderr.next_line().await? {
        rest.push_str(&line);
        rest.push('\n');
    }
    assert_eq!(status.code(), Some(76), "{rest}");
    assert!(rest.contains("lost: stopping the command"), "{rest}");
    Ok(())
}
