//! Redis Cluster as a backend (issue: scale out on Redis Cluster): locks on a real
//! 3-master, 3-replica cluster, no command ever refused with `CROSSSLOT`, and what a
//! master's failover does to the cache and to a held lock. The contract suite and the
//! four-process stampede run on the cluster too (`contract::cluster`,
//! `single_flight::four_processes_share_one_load_on_a_cluster`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use corral::locks::{LockOptions, RedisLocks};
use corral::{Corral, EntryOptions, ErrorKind, RedisOptions};
use corral_tests::{RedisCluster, real_time};

const MS: Duration = Duration::from_millis(1);

fn prefix(test: &str) -> String {
    format!("{test}-{}:", std::process::id())
}

/// A resource that checks fencing tokens: it counts overlaps of two holders and tokens
/// not above the last it saw.
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
async fn locks_on_a_cluster_never_overlap_and_tokens_rise() -> Result<()> {
    let _real_time = real_time().await;
    let nodes = RedisCluster::shared()?;
    let prefix = prefix("contenders");
    let resource = Arc::new(Fenced::default());
    let until = Instant::now() + Duration::from_secs(3);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let locks = RedisLocks::connect_cluster(&nodes, &prefix)?;
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
    println!("16 contenders on a cluster for 3 s: {uses} critical sections");
    assert!(uses > 16, "the lock changed hands many times: {uses}");
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
async fn a_caches_own_locks_work_on_a_cluster_with_a_watchdog() -> Result<()> {
    let _real_time = real_time().await;
    let mut options = RedisOptions::cluster(RedisCluster::shared()?);
    options.prefix = prefix("cache-locks");
    let cache = Corral::builder().redis_options(options).build()?;
    let locks = cache.locks().redis().context("a cluster cache has leases")?;
    let lease = locks
        .acquire("job", LockOptions::new().watchdog(300 * MS))
        .await?;
    let busy = locks.try_acquire("job", LockOptions::new()).await?;
    assert!(busy.is_none(), "held");
    tokio::time::sleep(Duration::from_secs(1)).await; // longer than the TTL: renewed
    assert!(!lease.is_lost());
    let token = lease.fencing_token();
    lease.release().await?;
    let next = locks
        .try_acquire("job", LockOptions::new())
        .await?
        .context("free after the release")?;
    assert!(next.fencing_token() > token);
    next.release().await?;
    Ok(())
}

/// Every node's count of replies refused with `CROSSSLOT`.
async fn crossslot_errors(nodes: &[String]) -> Result<u64> {
    let mut total = 0;
    for url in nodes {
        let mut conn = redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection()
            .await?;
        let info: String = redis::cmd("INFO")
            .arg("errorstats")
            .query_async(&mut conn)
            .await?;
        total += info
            .lines()
            .find_map(|l| l.strip_prefix("errorstat_CROSSSLOT:count="))
            .map_or(Ok(0), str::parse::<u64>)?;
    }
    Ok(total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_command_is_ever_refused_with_crossslot() -> Result<()> {
    let nodes = RedisCluster::shared()?;
    let mut options = RedisOptions::cluster(nodes.clone());
    options.prefix = prefix("crossslot");
    let cache = Corral::builder().redis_options(options).build()?;
    let locks = cache.locks().redis().context("leases")?;
    // Keys over every master, through every kind of command the cache and locks send.
    for i in 0..200 {
        let key = format!("user:{i}");
        cache
            .set(&key, "v", EntryOptions::new().sliding(Duration::from_secs(60)))
            .await?;
        cache.refresh(&key).await?;
        cache.get(&key).await?;
        cache.inspect(&key).await?;
        cache.remove(&key).await?;
        let v = cache
            .get_or_set(&key, EntryOptions::new(), || async {
                Ok::<_, std::io::Error>("loaded")
            })
            .await?;
        assert_eq!(v, "loaded");
        let lease = locks
            .acquire(&key, LockOptions::new().ttl(Duration::from_secs(5)))
            .await?;
        lease.extend(Duration::from_secs(5)).await?;
        lease.release().await?;
    }
    assert_eq!(
        crossslot_errors(&nodes).await?,
        0,
        "zero CROSSSLOT errors on any node"
    );
    Ok(())
}

/// Kills a master mid-run (its replica takes over after the 1 s node timeout): the
/// master of a cached key's slot, of a held lock's, and the node both processes'
/// landing subscriptions sit on (the first seed node). Every operation meanwhile
/// succeeds or fails with a typed error by its deadline; the cache recovers after the
/// promotion with no manual step; the other process hears of a write again (its
/// subscription moved and flushed L1); the held lease is either still valid or its
/// holder is told it is lost; fencing tokens do not go backwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_failover_mid_run() -> Result<()> {
    let _real_time = real_time().await;
    let mut cluster = RedisCluster::start(3, 1, Duration::from_secs(1))?;
    let build = || {
        let mut options = RedisOptions::cluster(cluster.urls());
        options.prefix = "failover:".into();
        Corral::builder().redis_options(options).build()
    };
    let (a, b) = (build()?, build()?);
    let locks = a.locks().redis().context("leases")?.clone();

    // A key and a lock served by the first seed node, where the subscriptions are
    // (`redis-cli --cluster create` makes the first nodes it is given the masters).
    let victim = 0;
    let pick = |prefix: &str, name: &dyn Fn(&str) -> corral::Result<String>| -> Result<String> {
        for i in 0..10_000 {
            let key = format!("{prefix}-{i}");
            if cluster.master_of(&name(&key)?)? == victim {
                return Ok(key);
            }
        }
        anyhow::bail!("no key on node {victim}")
    };
    let key = pick("k", &|k| a.entry_name(k))?;
    let job = pick("job", &|k| locks.lock_key(k))?;

    a.set(
        &key,
        "before",
        EntryOptions::new().sliding(Duration::from_secs(600)),
    )
    .await?;
    assert_eq!(
        b.get(&key).await?.as_deref(),
        Some(&b"before"[..]),
        "b holds it in L1"
    );
    let lease = locks
        .acquire(&job, LockOptions::new().watchdog(Duration::from_secs(3)))
        .await?;
    let token_before = lease.fencing_token();

    let killed_at = Instant::now();
    cluster.node(victim).kill();
    let mut failures = std::collections::BTreeMap::<String, usize>::new();
    let mut slowest = Duration::ZERO;
    let recovered = loop {
        let started = Instant::now();
        let set = a.set(&key, "after", EntryOptions::new()).await;
        slowest = slowest.max(started.elapsed());
        let started = Instant::now();
        let got = a.get(&key).await;
        slowest = slowest.max(started.elapsed());
        match (&set, &got) {
            (Ok(()), Ok(Some(v))) if v.as_ref() == b"after" => break killed_at.elapsed(),
            _ => {
                for e in [set.err(), got.err()].into_iter().flatten() {
                    assert!(
                        matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout),
                        "typed: {e:?}"
                    );
                    *failures.entry(format!("{:?}", e.kind())).or_default() += 1;
                }
            }
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "recovered after promotion; failures so far: {failures:?}"
        );
        tokio::time::sleep(100 * MS).await;
    };
    println!(
        "failover: the cache answered again {recovered:?} after the kill; slowest call {slowest:?}; failures meanwhile: {failures:?}"
    );
    assert!(
        slowest <= Duration::from_millis(2_500) + 500 * MS,
        "each call ends by its deadline (connect + 2 x response timeout): {slowest:?}"
    );

    // b's subscription sat on the dead node: it moved, flushed L1, and hears again.
    let heard_at = Instant::now();
    loop {
        if b.get(&key).await.ok().flatten().as_deref() == Some(&b"after"[..]) {
            break;
        }
        assert!(
            heard_at.elapsed() < Duration::from_secs(10),
            "b sees the write after the failover"
        );
        tokio::time::sleep(50 * MS).await;
    }
    a.set(&key, "later", EntryOptions::new()).await?;
    let heard_at = Instant::now();
    while b.get(&key).await?.as_deref() != Some(&b"later"[..]) {
        assert!(
            heard_at.elapsed() < Duration::from_secs(2),
            "b's L1 dropped on the announcement"
        );
        tokio::time::sleep(10 * MS).await;
    }
    println!("failover: b saw a later write {:?} after it", heard_at.elapsed());

    // The lease: still renewed by its watchdog on the promoted replica, or lost and said so.
    let lost = tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .is_ok();
    println!(
        "failover: the lease held across it was {}",
        if lost {
            "lost (its holder was told)"
        } else {
            "kept"
        }
    );
    if !lost {
        lease.release().await?;
    }
    // Fencing after the failover: the new master's counter is floored at its clock.
    let next = locks
        .acquire(
            &job,
            LockOptions::new()
                .ttl(Duration::from_secs(5))
                .wait(Duration::from_secs(10)),
        )
        .await?;
    println!(
        "failover: token {token_before} before, {} after",
        next.fencing_token()
    );
    assert!(
        next.fencing_token() > token_before,
        "fencing tokens never go backwards"
    );
    next.release().await?;
    Ok(())
}
