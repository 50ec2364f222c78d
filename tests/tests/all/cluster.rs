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
                    assert!(transient(&e), "typed: {e:?}");
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
    // A redirect fails one command (no command is sent twice: contract, cluster), and
    // the slot map may still move once after the promotion: the write is tried again
    // within its bound, as a caller would.
    let writing = Instant::now();
    while let Err(e) = a.set(&key, "later", EntryOptions::new()).await {
        assert!(
            transient(&e) && writing.elapsed() < Duration::from_secs(5),
            "the later write lands after the failover: {e:?}"
        );
        tokio::time::sleep(50 * MS).await;
    }
    let heard_at = Instant::now();
    loop {
        match b.get(&key).await {
            Ok(Some(v)) if v.as_ref() == b"later" => break,
            Ok(_) => {}
            Err(e) => assert!(transient(&e), "b reads after the failover: {e:?}"),
        }
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
        // A release the failover interrupts is an error the caller is told of; the
        // lease then lapses by its ttl, which the acquire below waits out.
        if let Err(e) = lease.release().await {
            assert!(transient(&e), "a release after the failover: {e:?}");
        }
    }
    // Fencing after the failover: the new master's counter is floored at its clock.
    // An acquire a redirect interrupts is tried again within a bound, as a caller would.
    let acquiring = Instant::now();
    let next = loop {
        let options = LockOptions::new()
            .ttl(Duration::from_secs(5))
            .wait(Duration::from_secs(10));
        match locks.acquire(&job, options).await {
            Ok(next) => break next,
            Err(e) => assert!(
                transient(&e) && acquiring.elapsed() < Duration::from_secs(15),
                "the lock is taken again after the failover: {e:?}"
            ),
        }
        tokio::time::sleep(50 * MS).await;
    };
    println!(
        "failover: token {token_before} before, {} after",
        next.fencing_token()
    );
    assert!(
        next.fencing_token() > token_before,
        "fencing tokens never go backwards"
    );
    if let Err(e) = next.release().await {
        assert!(transient(&e), "a release after the failover: {e:?}");
    }
    Ok(())
}

/// What a failover may answer a call while the slot map settles: the call failed, said
/// so in time, and the next one may succeed.
fn transient(e: &corral::Error) -> bool {
    matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout)
}

/// `per` keys on each master of `cluster` (by `name`, the key's Redis name), by master.
fn keys_by_master(
    cluster: &RedisCluster,
    per: usize,
    name: &dyn Fn(&str) -> corral::Result<String>,
) -> Result<std::collections::BTreeMap<usize, Vec<String>>> {
    let mut keys = std::collections::BTreeMap::<usize, Vec<String>>::new();
    for i in 0..10_000 {
        let key = format!("k-{i}");
        let on = keys.entry(cluster.master_of(&name(&key)?)?).or_default();
        if on.len() < per {
            on.push(key);
        }
        if keys.len() == 3 && keys.values().all(|k| k.len() == per) {
            return Ok(keys);
        }
    }
    anyhow::bail!("found no {per} keys on each of 3 masters: {keys:?}")
}

/// A master dies and stays dead (the node timeout outlasts the test, so no replica is
/// promoted meanwhile). Reads of keys on the two live shards all succeed: the dead
/// shard's failures open its own breaker, never theirs. Reads of the dead shard's keys
/// fail typed, each naming the dead node's address (not the first seed node's), and its
/// breaker opens (issue 19, item 7: before, one breaker for the whole cluster refused
/// every shard's keys, and no error named the node that failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_opens_only_its_shards_breaker() -> Result<()> {
    let _real_time = real_time().await;
    let mut cluster = RedisCluster::start(3, 1, Duration::from_secs(60))?;
    let mut options = RedisOptions::cluster(cluster.urls());
    options.prefix = prefix("one-shard");
    options.response_timeout = 300 * MS;
    options.breaker_cool_down = Duration::from_secs(30);
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    let keys = keys_by_master(&cluster, 20, &|k| cache.entry_name(k))?;
    for key in keys.values().flatten() {
        cache.set(key, "v", EntryOptions::new()).await?;
    }
    let locks = cache.locks().redis().context("leases")?;
    let jobs = keys_by_master(&cluster, 1, &|k| locks.lock_key(k))?;
    // A master other than the first seed node, so that naming the seed is not naming it.
    let victim = *keys.keys().find(|&&n| n != 0).context("a second master")?;
    let dead = format!("127.0.0.1:{}", cluster.node(victim).port());
    cluster.node(victim).kill();

    // Each round reads the dead shard's keys first, then the live shards'.
    let mut order: Vec<(usize, &Vec<String>)> = keys.iter().map(|(n, on)| (*n, on)).collect();
    order.sort_by_key(|(n, _)| *n != victim);
    let (mut live_failures, mut dead_errors) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        for &(node, on) in &order {
            for key in on {
                let got = cache.get(key).await;
                if node == victim {
                    dead_errors.push(got.err().context("a read on a dead master succeeded")?);
                } else if !matches!(&got, Ok(Some(v)) if v.as_ref() == b"v") {
                    live_failures.push(format!("{key}: {got:?}"));
                }
            }
        }
    }
    let open = dead_errors
        .iter()
        .filter(|e| e.to_string().contains("circuit open"))
        .count();
    println!(
        "one dead master: {} failed reads of live shards' keys, {} of the dead one's ({open} refused by its breaker); e.g. {:?}",
        live_failures.len(),
        dead_errors.len(),
        (
            dead_errors.first().map(ToString::to_string),
            dead_errors.last().map(ToString::to_string)
        )
    );
    assert!(
        live_failures.is_empty(),
        "every read of a live shard's key succeeds: {} failed, first {:?}",
        live_failures.len(),
        live_failures.first()
    );
    for e in &dead_errors {
        assert!(
            matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout),
            "typed: {e:?}"
        );
        assert!(e.to_string().contains(&dead), "names the dead node {dead}: {e}");
    }
    assert!(open > 0, "the dead shard's breaker opened");
    let store = cache.redis_store().context("a Redis store")?;
    assert_eq!(
        store.open_breakers(),
        vec![dead.clone()],
        "only the dead master's breaker is open"
    );
    // A lease on the dead master: its error names that node too.
    let once = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .wait(Duration::ZERO);
    let e = locks
        .acquire(&jobs[&victim][0], once)
        .await
        .err()
        .context("a lease on a dead master")?;
    assert!(e.to_string().contains(&dead), "names the dead node {dead}: {e}");
    println!("one dead master: a lease on it: {e}");
    Ok(())
}

/// A master dies before any node has loaded the scripts (a fresh cluster, a client
/// connected to every node): `SCRIPT LOAD` would go to every node and fail, so a script
/// a node lacks runs as `EVAL` of its body on its key's master instead. Reads that touch sliding entries and leases on the
/// live shards work (issue 19, item 8b: before, each such call failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_run_on_live_shards_while_a_node_is_down() -> Result<()> {
    let _real_time = real_time().await;
    let mut cluster = RedisCluster::start(3, 1, Duration::from_secs(60))?;
    let mut options = RedisOptions::cluster(cluster.urls());
    options.prefix = prefix("cold-scripts");
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    let locks = cache.locks().redis().context("leases")?;
    let entries = keys_by_master(&cluster, 5, &|k| cache.entry_name(k))?;
    let leases = keys_by_master(&cluster, 5, &|k| locks.lock_key(k))?;
    // Plain commands (no script) on every master: the client holds a connection to each.
    for key in entries.values().flatten() {
        cache.set(key, "plain", EntryOptions::new()).await?;
        cache.get(key).await?;
    }
    let victim = *entries.keys().find(|&&n| n != 0).context("a second master")?;
    cluster.node(victim).kill();

    let sliding = EntryOptions::new().sliding(Duration::from_secs(60));
    for (_, on) in entries.iter().filter(|(n, _)| **n != victim) {
        for key in on {
            cache.set(key, "v", sliding).await?;
            for _ in 0..3 {
                // The first read learns the entry slides; the next ones touch it in a script.
                assert_eq!(cache.get(key).await?.as_deref(), Some(&b"v"[..]), "{key}");
            }
        }
    }
    for (_, on) in leases.iter().filter(|(n, _)| **n != victim) {
        for key in on {
            let lease = locks
                .acquire(
                    key,
                    LockOptions::new()
                        .ttl(Duration::from_secs(5))
                        .wait(Duration::ZERO),
                )
                .await?;
            lease.extend(Duration::from_secs(5)).await?;
            lease.release().await?;
        }
    }
    Ok(())
}

/// Reads that arrive together never wait on another master: with one master frozen,
/// reads of the live masters' keys that arrive among reads of the frozen one's keys,
/// whichever leads the gathering, are answered well inside the response timeout (a
/// gathering that sent every slot's pipeline at once answered none before the frozen
/// one's timed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_never_delays_reads_of_the_others_that_arrive_with_its_own() -> Result<()> {
    frozen_master_among_gathered_reads(EntryOptions::new()).await
}

/// The same with sliding entries, each read a `GETEX` the store gathers by slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_never_delays_sliding_reads_of_the_others_that_arrive_with_its_own() -> Result<()> {
    frozen_master_among_gathered_reads(EntryOptions::new().sliding(Duration::from_secs(3600))).await
}

async fn frozen_master_among_gathered_reads(entries: EntryOptions) -> Result<()> {
    let _real_time = real_time().await;
    let mut cluster = RedisCluster::start(3, 0, Duration::from_secs(60))?;
    let timeout = Duration::from_secs(3);
    let mut options = RedisOptions::cluster(cluster.urls());
    options.prefix = prefix("frozen-gathering");
    options.response_timeout = timeout;
    // No breaker: the frozen master's reads must reach it in the second round too.
    options.breaker_threshold = 0;
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    let keys = keys_by_master(&cluster, 4, &|k| cache.entry_name(k))?;
    for key in keys.values().flatten() {
        cache.set(key, key.clone(), entries).await?;
        // The first read learns how the key is read.
        cache.get(key).await?;
    }
    let frozen = *keys.keys().next().context("a master")?;
    let (frozen_keys, live_keys): (Vec<&String>, Vec<&String>) = {
        let (f, l): (Vec<_>, Vec<_>) = keys.iter().partition(|(m, _)| **m == frozen);
        (
            f.into_iter().flat_map(|(_, k)| k).collect(),
            l.into_iter().flat_map(|(_, k)| k).collect(),
        )
    };
    cluster.node(frozen).pause()?;
    // The first read goes alone; the second leads the gathering: a frozen key, then a
    // live one.
    let rounds = [[live_keys[0], frozen_keys[0]], [frozen_keys[1], live_keys[1]]];
    let mut slow = Vec::new();
    for lead in rounds {
        let asked: Vec<&String> = lead
            .into_iter()
            .chain(live_keys.iter().copied().cycle().take(24))
            .chain(frozen_keys.iter().copied())
            .collect();
        let started = Instant::now();
        let found = futures::future::join_all(asked.iter().map(|key| async {
            let found = cache.get(key).await;
            (*key, found, started.elapsed())
        }))
        .await;
        for (key, found, took) in found {
            if frozen_keys.contains(&key) {
                continue;
            }
            anyhow::ensure!(
                matches!(&found, Ok(Some(v)) if v[..] == *key.as_bytes()),
                "{key} on a live master read {found:?}"
            );
            if took >= timeout / 2 {
                slow.push((key.clone(), took));
            }
        }
    }
    cluster.node(frozen).resume()?;
    anyhow::ensure!(
        slow.is_empty(),
        "reads on live masters waited on the frozen one: {slow:?}"
    );
    Ok(())
}

/// A batch key's hard timeout counts from its loader call, not from when its flight
/// reached its load (contract §5.16, §7.2). The batch's loader is called once the batch
/// is quiet. Here one key's master holds its writes (`CLIENT PAUSE WRITE`): the key's
/// first read goes through, its lock step waits out the store timeout, and the batch
/// is not quiet meanwhile. A key on a live master has been ready since its own lock
/// step. Its loader then runs for a fifth of the hard timeout: it is served. Before,
/// its timeout ran from when it was ready, and it failed with `Timeout` after its
/// loader had run for less than the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_keys_hard_timeout_counts_from_its_loader_call() -> Result<()> {
    batch_held_behind_a_paused_master(true).await
}

/// The same with a loader that answers at once (its call begins and ends in one poll):
/// its answer is judged by its call's moments too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_keys_instant_loader_is_judged_from_its_call() -> Result<()> {
    batch_held_behind_a_paused_master(false).await
}

async fn batch_held_behind_a_paused_master(loader_waits: bool) -> Result<()> {
    let _real_time = real_time().await;
    let mut cluster = RedisCluster::start(3, 0, Duration::from_secs(60))?;
    let store_timeout = Duration::from_millis(800);
    let hard_timeout = Duration::from_millis(500);
    let mut options = RedisOptions::cluster(cluster.urls());
    options.prefix = prefix("batch-hard-timeout");
    options.response_timeout = store_timeout;
    options.breaker_threshold = 0;
    let cache = Corral::builder().redis_options(options).l1_capacity(0).build()?;
    let keys = keys_by_master(&cluster, 1, &|k| cache.entry_name(k))?;
    let mut masters = keys.iter();
    let (held, held_key) = masters.next().context("a master")?;
    let (_, live_key) = masters.next().context("another master")?;
    let (held_key, live_key) = (held_key[0].clone(), live_key[0].clone());
    // Reads are served; writes and scripts wait for the pause to end.
    let mut held_master = redis::Client::open(cluster.node(*held).url())?
        .get_multiplexed_async_connection()
        .await?;
    let pause_ms = 3 * store_timeout.as_millis() as u64;
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(pause_ms)
        .arg("WRITE")
        .query_async::<()>(&mut held_master)
        .await?;
    let started = Instant::now();
    let found = cache
        .get_or_set_many(
            [&live_key, &held_key],
            corral::LoadOptions::relative(Duration::from_secs(60)).hard_timeout(hard_timeout),
            |keys: Vec<String>| async move {
                if loader_waits {
                    tokio::time::sleep(hard_timeout / 5).await;
                }
                Ok::<_, std::io::Error>(keys.into_iter().map(|k| (k.clone(), k.into_bytes())))
            },
        )
        .await;
    let took = started.elapsed();
    redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async::<()>(&mut held_master)
        .await?;
    let found = found?;
    anyhow::ensure!(
        took >= hard_timeout + hard_timeout / 5,
        "the batch was not held up past the hard timeout ({took:?}): the test proves nothing"
    );
    anyhow::ensure!(
        matches!(&found[0], Ok(Some(v)) if v[..] == *live_key.as_bytes()),
        "the live master's key, its loader {} under a {hard_timeout:?} hard timeout, got {:?} after {took:?}",
        if loader_waits {
            "run for a fifth of it"
        } else {
            "answering at once"
        },
        found[0]
    );
    Ok(())
}

/// A cluster cache's first batch reads every master's keys, whether or not it has learnt
/// which master serves which slot by then (it learns them in the background when first
/// asked): keys whose master it does not know share one `MGET`, which the cluster client
/// splits by slot, so every key is served from its own master, none refused or loaded.
/// And so is a batch after a first read (the slots learnt or being learnt: one `MGET`
/// per master once they are).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_batch_on_a_cluster_reads_every_masters_keys() -> Result<()> {
    let cluster = RedisCluster::start(3, 0, Duration::from_secs(60))?;
    let options = || {
        let mut options = RedisOptions::cluster(cluster.urls());
        options.prefix = prefix("batch-unknown-slots");
        options
    };
    let writer = Corral::builder().redis_options(options()).build()?;
    let by_master = keys_by_master(&cluster, 5, &|k| writer.entry_name(k))?;
    let keys: Vec<String> = by_master.values().flatten().cloned().collect();
    let entry = || corral::LoadOptions::relative(Duration::from_secs(600));
    writer
        .get_or_set_many(&keys, entry(), |asked: Vec<String>| async move {
            Ok::<_, std::io::Error>(asked.into_iter().map(|k| (k.clone(), format!("v:{k}"))))
        })
        .await?;
    for round in ["a first batch", "after a first read"] {
        // A reader of its own, L1 off: each round reads L2.
        let reader = Corral::builder()
            .redis_options(options())
            .l1_capacity(0)
            .build()?;
        if round == "after a first read" {
            reader.get("warm-up").await?;
        }
        let found = reader
            .get_or_set_many(&keys, entry(), |_: Vec<String>| async {
                Err::<Vec<(String, String)>, _>(std::io::Error::other("every key is a hit"))
            })
            .await?;
        for (key, value) in keys.iter().zip(found) {
            let value = value.with_context(|| format!("{key}, {round}"))?;
            anyhow::ensure!(
                value.as_deref() == Some(format!("v:{key}").as_bytes()),
                "{key}, {round}: {value:?}"
            );
        }
        anyhow::ensure!(reader.metrics().l2_hits == keys.len() as u64, "{round}");
    }
    Ok(())
}
