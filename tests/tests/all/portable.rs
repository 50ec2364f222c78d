//! The portable body's L1 keeps the native body's promises (contract §5.12): it hears
//! other processes' changes, and a read's fill never lands over a newer write of this
//! process.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use corral::portable::PortableCache;
use corral::store::memory::MemoryStore;
use corral::store::{Entries, FlightLock, Notifications};
use corral::{Corral, EntryOptions};
use corral_tests::RedisServer;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Notify;

const SEC: Duration = Duration::from_secs(1);

/// Polls `check` every 10 ms until it holds, for at most `within`.
async fn until(within: Duration, what: &str, mut check: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    while !check().await? {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{what} (after {within:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// A portable and a native process over one redis-server, each with an hour of L1.
fn over_one_redis(server: &RedisServer) -> Result<(PortableCache, Corral)> {
    let hour = Duration::from_secs(3600);
    let portable = PortableCache::builder()
        .redis_options(corral::RedisOptions::new(server.url()))
        .l1_ttl(hour)
        .build()?;
    let native = Corral::builder().redis(server.url()).l1_ttl(hour).build()?;
    Ok((portable, native))
}

/// Waits until both are subscribed: a probe each way is heard (a changed value read
/// after the old one was in L1).
async fn until_each_hears_the_other(portable: &PortableCache, native: &Corral) -> Result<()> {
    until(
        10 * SEC,
        "the native process never heard the portable one",
        async || {
            portable.set("probe", "p", EntryOptions::new()).await?;
            native.get("probe").await?;
            portable.set("probe", "q", EntryOptions::new()).await?;
            Ok(native.get("probe").await?.as_deref() == Some(&b"q"[..]))
        },
    )
    .await?;
    until_portable_hears(native, portable).await
}

/// Waits until `portable` is subscribed: a probe `native` writes is heard (a changed
/// value read after the old one was in L1).
async fn until_portable_hears(native: &Corral, portable: &PortableCache) -> Result<()> {
    until(
        10 * SEC,
        "the portable process never heard the native one",
        async || {
            native.set("probe2", "p", EntryOptions::new()).await?;
            portable.get("probe2").await?;
            native.set("probe2", "q", EntryOptions::new()).await?;
            Ok(portable.get("probe2").await?.as_deref() == Some(&b"q"[..]))
        },
    )
    .await
}

/// A portable process on `server`, on `clock`, its L1 serving for `l1_ttl`.
fn portable_on(server: &RedisServer, clock: &corral::ManualClock, l1_ttl: Duration) -> Result<PortableCache> {
    Ok(PortableCache::builder()
        .redis_options(corral::RedisOptions::new(server.url()))
        .l1_ttl(l1_ttl)
        .clock(clock.clone())
        .build()?)
}

/// A native process on `server`, on `clock`, its L1 serving for `l1_ttl`.
fn native_on(server: &RedisServer, clock: &corral::ManualClock, l1_ttl: Duration) -> Result<Corral> {
    Ok(Corral::builder()
        .redis(server.url())
        .l1_ttl(l1_ttl)
        .clock(clock.clone())
        .build()?)
}

/// A native process's `set` reaches a portable process's L1, and the other way round:
/// each drops its copy when it hears of the other's write, well before its L1 TTL (an
/// hour here). Before, the portable body's L1 heard nothing and its writes announced
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portable_l1_hears_other_processes_and_is_heard() -> Result<()> {
    let server = RedisServer::start()?;
    let (portable, native) = over_one_redis(&server)?;
    until_each_hears_the_other(&portable, &native).await?;

    native.set("k", "v1", EntryOptions::new()).await?;
    assert_eq!(
        portable.get("k").await?.as_deref(),
        Some(&b"v1"[..]),
        "portable L1 now holds v1"
    );
    native.set("k", "v2", EntryOptions::new()).await?;
    until(
        5 * SEC,
        "the portable process kept serving v1 from L1",
        async || Ok(portable.get("k").await?.as_deref() == Some(&b"v2"[..])),
    )
    .await?;

    assert_eq!(
        native.get("k").await?.as_deref(),
        Some(&b"v2"[..]),
        "native L1 now holds v2"
    );
    portable.set("k", "v3", EntryOptions::new()).await?;
    until(
        5 * SEC,
        "the native process kept serving v2 from L1",
        async || Ok(native.get("k").await?.as_deref() == Some(&b"v3"[..])),
    )
    .await?;
    portable.remove("k").await?;
    until(
        5 * SEC,
        "the native process kept serving v3 after the removal",
        async || Ok(native.get("k").await?.is_none()),
    )
    .await?;
    Ok(())
}

/// A memory store whose next read of `held` (once `armed`) reads the bytes, then waits
/// for `release` before answering with them: the read is taken, and answers after,
/// whatever is written meanwhile; and whose next write of `held` (a `set` or a `swap`,
/// once `armed_set`) waits for `release` before it is applied.
#[derive(Debug)]
struct HeldRead {
    inner: MemoryStore,
    held: String,
    armed: std::sync::atomic::AtomicBool,
    armed_set: std::sync::atomic::AtomicBool,
    reached: Notify,
    release: Notify,
}

impl HeldRead {
    fn over(memory: &MemoryStore, key: &str) -> Arc<HeldRead> {
        Arc::new(HeldRead {
            inner: memory.clone(),
            held: corral_core::names::name("held:", key, corral_core::names::Kind::Entry),
            armed: std::sync::atomic::AtomicBool::new(false),
            armed_set: std::sync::atomic::AtomicBool::new(false),
            reached: Notify::new(),
            release: Notify::new(),
        })
    }

    /// Waits for `release` if `key` is the held one and `armed` was set (it is unset):
    /// says so on `reached` first.
    async fn hold(&self, key: &str, armed: &std::sync::atomic::AtomicBool) {
        if key == self.held && armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.reached.notify_one();
            self.release.notified().await;
        }
    }

    /// A portable cache over it (prefix `held:`), and a native one over the same
    /// memory: another process.
    fn caches(self: &Arc<Self>) -> Result<(PortableCache, Corral)> {
        let memory = &self.inner;
        let portable = PortableCache::builder()
            .stores(
                "held:",
                self.clone() as Arc<dyn Entries>,
                Arc::new(memory.clone()) as Arc<dyn FlightLock>,
                Arc::new(memory.clone()) as Arc<dyn Notifications>,
            )
            .l1_ttl(Duration::from_secs(3600))
            .build()?;
        let other = Corral::builder()
            .stores(
                "held:",
                Arc::new(memory.clone()),
                Arc::new(memory.clone()),
                Arc::new(memory.clone()),
            )
            .build()?;
        Ok((portable, other))
    }
}

impl Entries for HeldRead {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, corral::Result<Option<Bytes>>> {
        async move {
            let read = self.inner.get(key).await;
            self.hold(key, &self.armed).await;
            read
        }
        .boxed()
    }
    fn ttl_ms<'a>(&'a self, key: &'a str) -> BoxFuture<'a, corral::Result<Option<u64>>> {
        self.inner.ttl_ms(key)
    }
    fn set<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, corral::Result<()>> {
        async move {
            self.hold(key, &self.armed_set).await;
            self.inner.set(key, bytes, ttl_ms).await
        }
        .boxed()
    }
    fn swap<'a>(
        &'a self,
        name: &'a str,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, corral::Result<Option<Bytes>>> {
        async move {
            self.hold(name, &self.armed_set).await;
            self.inner.swap(name, bytes, ttl_ms).await
        }
        .boxed()
    }
    fn set_if<'a>(
        &'a self,
        name: &'a str,
        expected: Option<Bytes>,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, corral::Result<bool>> {
        self.inner.set_if(name, expected, bytes, ttl_ms)
    }
    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, corral::Result<bool>> {
        self.inner.delete(key)
    }
    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, corral::Result<bool>> {
        self.inner.delete_if_equal(key, expected)
    }
    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: Bytes,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, corral::Result<bool>> {
        self.inner.replace_if_equal(key, expected, bytes, ttl_ms)
    }
    fn name(&self) -> &'static str {
        "memory"
    }
}

/// A read that found the old value, and answers only after a `set` of the same key in
/// this process wrote a newer one, does not put the old value in L1: the next `get`
/// returns the newer one. Before, the portable body filled L1 with whatever its read
/// found, and served it until the L1 TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_read_never_fills_l1_over_a_newer_write() -> Result<()> {
    let memory = MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let store = HeldRead::over(&memory, "k");
    let (cache, other) = store.caches()?;
    // "old" is in L2 but not in this process's L1: another process wrote it.
    other.set("k", "old", EntryOptions::new()).await?;
    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let reached = store.reached.notified();
    let reader = {
        let cache = cache.clone();
        tokio::spawn(async move { cache.get("k").await })
    };
    reached.await;
    // The read has the old bytes in hand; this process writes a newer value meanwhile.
    cache.set("k", "new", EntryOptions::new()).await?;
    store.release.notify_one();
    let read = reader.await??;
    assert_eq!(
        read.as_deref(),
        Some(&b"old"[..]),
        "the read answers what it found"
    );
    assert_eq!(
        cache.get("k").await?.as_deref(),
        Some(&b"new"[..]),
        "L1 keeps the newer write, not the read's older value"
    );
    Ok(())
}

/// A read that runs while a removal's tombstone is on its way (it finds the old value
/// and fills L1 before the tombstone lands) does not outlive the removal: when `remove`
/// returns, this process serves nothing. Before, the portable body dropped its copy only
/// before the store step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_read_during_a_removal_does_not_outlive_it() -> Result<()> {
    let memory = MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let store = HeldRead::over(&memory, "k");
    let (cache, other) = store.caches()?;
    other.set("k", "old", EntryOptions::new()).await?;
    store.armed_set.store(true, std::sync::atomic::Ordering::SeqCst);
    let reached = store.reached.notified();
    let remover = {
        let cache = cache.clone();
        tokio::spawn(async move { cache.remove("k").await })
    };
    reached.await;
    // The tombstone waits; a read now finds the old value and fills L1.
    assert_eq!(cache.get("k").await?.as_deref(), Some(&b"old"[..]));
    store.release.notify_one();
    assert!(remover.await??, "the removal found the value");
    assert_eq!(
        cache.get("k").await?,
        None,
        "nothing is served once remove returned"
    );
    Ok(())
}

/// A `clear` by one instance of a portable cache reaches the others at once: an
/// instance that knew the old generation reads it again, so it neither serves nor
/// fills what was stored before the clear. Before, each instance trusted its own
/// reading of the generation for an L1 TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clear_in_one_portable_instance_reaches_the_others() -> Result<()> {
    let cache = PortableCache::builder()
        .l1_ttl(Duration::from_secs(3600))
        .build()?;
    // Instance X names "k" in the first generation.
    cache.set("k", "v", EntryOptions::new()).await?;
    // X is kept busy by a load while another instance, Y, clears.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let busy = {
        let cache = cache.clone();
        let mut started = Some(started_tx);
        tokio::spawn(async move {
            cache
                .get_or_set("other", EntryOptions::new(), move |_| {
                    if let Some(started) = started.take() {
                        let _ = started.send(());
                    }
                    go_rx.recv().map_err(|e| e.to_string())?;
                    Ok(b"x".to_vec())
                })
                .await
        })
    };
    started_rx.await?;
    cache.clear().await?;
    go_tx.send(())?;
    busy.await??;
    // The next call runs on X again (the last instance to go idle).
    assert_eq!(cache.get("k").await?, None, "nothing from before the clear");
    Ok(())
}

/// A portable `remove` says whether *its* tombstone replaced a fresh value: when another
/// process removed the key first, it says `false`. Before, it read the key, then wrote
/// the tombstone with a plain set, and a removal between the two went unseen (here the
/// read is held while the other process removes). Now the tombstone is one swap: there
/// is no read to hold, and the answer is what the swap replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_remove_says_what_its_own_tombstone_replaced() -> Result<()> {
    let memory = MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let store = HeldRead::over(&memory, "k");
    let (cache, other) = store.caches()?;
    other.set("k", "old", EntryOptions::new()).await?;
    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let reached = store.reached.notified();
    let mut remover = {
        let cache = cache.clone();
        tokio::spawn(async move { cache.remove("k").await })
    };
    let (removed_first, said) = tokio::select! {
        () = reached => {
            assert!(other.remove("k").await?, "the other process removes the value first");
            store.release.notify_one();
            (true, remover.await??)
        }
        said = &mut remover => (false, said??),
    };
    assert_eq!(
        said, !removed_first,
        "remove says whether its own tombstone replaced the value"
    );
    Ok(())
}

/// A get-or-set's store steps share a deadline in the portable body as in the native
/// one (contract §5.13): a read that never answers fails at the deadline of the steps
/// before the load, and the flight goes on to load, instead of holding its caller for
/// as long as the store hangs. Before, the portable call never ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_step_that_never_answers_ends_at_the_flights_deadline_in_both_bodies() -> Result<()> {
    let memory = MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let store = HeldRead::over(&memory, "k");
    let wait = Duration::from_millis(300);
    let portable = PortableCache::builder()
        .stores(
            "held:",
            store.clone() as Arc<dyn Entries>,
            Arc::new(memory.clone()) as Arc<dyn FlightLock>,
            Arc::new(memory.clone()) as Arc<dyn Notifications>,
        )
        .lock_wait(wait)
        .build()?;
    let native = Corral::builder()
        .stores(
            "held:",
            store.clone() as Arc<dyn Entries>,
            Arc::new(memory.clone()) as Arc<dyn FlightLock>,
            Arc::new(memory.clone()) as Arc<dyn Notifications>,
        )
        .lock_wait(wait)
        .build()?;
    let bound = 20 * SEC;

    // The read of "k" is taken and never answered (nothing releases it).
    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let load = |_: &str| Ok::<_, String>(b"portable".to_vec());
    let got = tokio::time::timeout(bound, portable.get_or_set("k", EntryOptions::new(), load)).await;
    // A read still held (the call never gave up on it) lets go, so the test can end.
    store.release.notify_waiters();
    let got = got.map_err(|_| {
        anyhow::anyhow!("the portable get-or-set was still waiting on the store after {bound:?}")
    })??;
    assert_eq!(&got[..], b"portable");

    memory
        .delete(&corral_core::names::name(
            "held:",
            "k",
            corral_core::names::Kind::Entry,
        ))
        .await?;
    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let got = tokio::time::timeout(
        bound,
        native.get_or_set("k", corral::LoadOptions::new(), || async {
            Ok::<_, std::io::Error>(b"native".to_vec())
        }),
    )
    .await;
    store.release.notify_waiters();
    let got = got.map_err(|_| {
        anyhow::anyhow!("the native get-or-set was still waiting on the store after {bound:?}")
    })??;
    assert_eq!(&got[..], b"native");
    Ok(())
}

/// A follower's wait for another process's lock ends at the real-time budget of the
/// steps before the load (contract §5.13) even when the cache's clock stands still (a
/// frozen manual clock, a wall clock stepped back): the flight judges the lock timed out
/// and loads uncached. Before, past the budget each wait ended at once and the flight
/// looked again, for as long as the clock stood still (a spin at full CPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_wait_ends_at_its_budget_on_a_frozen_clock_in_both_bodies() -> Result<()> {
    let clock = corral::ManualClock::starting_now();
    let memory = MemoryStore::new(Arc::new(clock.clone()), 30_000);
    let wait = Duration::from_millis(300);
    let (entries, lock, notifications) = memory_stores(&memory);
    let portable = PortableCache::builder()
        .stores("frozen:", entries, lock, notifications)
        .clock(clock.clone())
        .lock_wait(wait)
        .build()?;
    let (entries, lock, notifications) = memory_stores(&memory);
    let native = Corral::builder()
        .stores("frozen:", entries, lock, notifications)
        .clock(clock.clone())
        .lock_wait(wait)
        .build()?;
    // Another process leads "k" and never lands: its lock lives for an hour of the clock.
    let held = corral_core::names::name("frozen:", "k", corral_core::names::Kind::FlightLock);
    assert!(memory.try_lock(&held, "another process", 3_600_000).await?);
    let bound = 20 * SEC;
    // The steps before the load share max(lock wait, store timeout): the memory store's
    // 1 s. A wait is never cut before it.
    let budget = SEC;

    let load = |_: &str| Ok::<_, String>(b"portable".to_vec());
    let began = tokio::time::Instant::now();
    let got = tokio::time::timeout(bound, portable.get_or_set("k", EntryOptions::new(), load))
        .await
        .map_err(|_| anyhow::anyhow!("the portable follower still waited after {bound:?}"))??;
    assert_eq!(&got[..], b"portable", "loaded uncached");
    assert!(
        began.elapsed() >= budget,
        "waited out the budget: {:?}",
        began.elapsed()
    );

    let began = tokio::time::Instant::now();
    let got = tokio::time::timeout(
        bound,
        native.get_or_set("k", corral::LoadOptions::new(), || async {
            Ok::<_, std::io::Error>(b"native".to_vec())
        }),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the native follower still waited after {bound:?}"))??;
    assert_eq!(&got[..], b"native", "loaded uncached");
    assert!(
        began.elapsed() >= budget,
        "waited out the budget: {:?}",
        began.elapsed()
    );
    let m = native.metrics();
    assert_eq!(
        (m.lock_waits, m.lock_timeouts, m.degraded),
        (1, 1, 1),
        "one wait, judged a lock timeout"
    );
    Ok(())
}

/// A tag moment a portable process keeps but the store lost hides nothing from it and
/// deletes nothing: the entry is judged again by the store's moments, as every other
/// process judges it, and a get-or-set serves it rather than loading over it (contract
/// §7.5; native: `tags::a_moment_the_store_lost_hides_nothing_another_process_wrote`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_process_hides_nothing_by_a_moment_the_store_lost() -> Result<()> {
    let server = RedisServer::start()?;
    let (keeper, writer) = over_one_redis(&server)?;
    until_each_hears_the_other(&keeper, &writer).await?;
    keeper.set_tagged("k0", "v0", EntryOptions::new(), &["t"]).await?;
    // A removal stamped by a clock 5 s ahead, heard by the keeper (its L1 flushed).
    let clock = corral::ManualClock::starting_now();
    clock.advance(5 * SEC);
    let ahead = Corral::builder().redis(server.url()).clock(clock).build()?;
    ahead.remove_by_tag("t").await?;
    until(5 * SEC, "the keeper never heard the removal", async || {
        Ok(keeper.get("k0").await?.is_none())
    })
    .await?;
    // The keeper reads the tag's moments and keeps them; then the store loses them.
    keeper.set_tagged("k1", "v1", EntryOptions::new(), &["t"]).await?;
    let mut conn = server.connection().await?;
    let lost: u32 = redis::cmd("DEL")
        .arg("{7:corral:t}:t")
        .query_async(&mut conn)
        .await?;
    assert_eq!(lost, 1, "the tag's moments were under {{7:corral:t}}:t");

    writer
        .set_tagged("k", "v", EntryOptions::new().relative(600 * SEC), &["t"])
        .await?;
    let load = |_: &str| Ok::<_, String>(b"loaded".to_vec());
    let got = keeper.get_or_set("k", EntryOptions::new(), load).await?;
    assert_eq!(
        &got[..],
        b"v",
        "the portable process loaded over a write the store's moments do not remove"
    );
    assert_eq!(keeper.get("k").await?.as_deref(), Some(&b"v"[..]));
    let reader = Corral::builder().redis(server.url()).build()?;
    assert_eq!(
        reader.get("k").await?.as_deref(),
        Some(&b"v"[..]),
        "the portable process deleted a write the store's moments do not remove"
    );
    // A later removal, stamped before the moment the keeper still keeps.
    reader.remove_by_tag("t").await?;
    assert_eq!(
        keeper.get("k").await?,
        None,
        "the portable process served an entry a completed remove_by_tag removed"
    );
    Ok(())
}

/// A portable load that lost its flight lock while it ran (another leader took the key
/// over) fills nothing, even where the entry is as the flight read it: its fill and its
/// lock's release are one owner-checked step (`l2.fill-releasing`), as the native
/// body's (contract §5.12), and the other leader's lock is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_load_that_lost_its_lock_fills_nothing() -> Result<()> {
    let server = RedisServer::start()?;
    let portable = PortableCache::builder()
        .redis_options(corral::RedisOptions::new(server.url()))
        .build()?;
    let url = server.url();
    let load = move |_: &str| {
        // Another leader takes the lock over while this load runs.
        let mut conn = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .map_err(|e| e.to_string())?;
        redis::cmd("SET")
            .arg("{7:corral:k}:l")
            .arg("another")
            .query::<()>(&mut conn)
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(b"loaded".to_vec())
    };
    let got = portable.get_or_set("k", EntryOptions::new(), load).await?;
    assert_eq!(&got[..], b"loaded", "the caller gets its value");
    let mut conn = server.connection().await?;
    let entry: Option<Vec<u8>> = redis::cmd("GET")
        .arg("{7:corral:k}:e")
        .query_async(&mut conn)
        .await?;
    assert_eq!(entry, None, "a load whose lock another leader held filled L2");
    let lock: Option<String> = redis::cmd("GET")
        .arg("{7:corral:k}:l")
        .query_async(&mut conn)
        .await?;
    assert_eq!(
        lock.as_deref(),
        Some("another"),
        "the other leader's lock was released"
    );
    Ok(())
}

/// A get-or-set lock whose first release fails (the store out of reach for that one
/// step).
#[derive(Debug)]
struct FirstReleaseFails {
    inner: MemoryStore,
    failed: std::sync::atomic::AtomicBool,
}

impl FlightLock for FirstReleaseFails {
    fn try_lock<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
    ) -> BoxFuture<'a, corral::Result<bool>> {
        self.inner.try_lock(key, owner, ttl_ms)
    }

    fn release<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, corral::Result<bool>> {
        if !self.failed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return async {
                Err(corral::Error::from(corral::ErrorKind::Unavailable)
                    .with_context("the release did not go through"))
            }
            .boxed();
        }
        self.inner.release(key, owner)
    }
}

/// A portable flight's lock whose release failed stays the call's: the call's end
/// releases it again, owner-checked, so the next caller need not wait out its TTL
/// (contract §5.13). Before, the lock was dropped from the call's before the release
/// ran, and lived on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_lock_whose_release_failed_is_released_when_the_call_ends() -> Result<()> {
    let memory = MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let lock = Arc::new(FirstReleaseFails {
        inner: memory.clone(),
        failed: std::sync::atomic::AtomicBool::new(false),
    });
    let portable = PortableCache::builder()
        .stores(
            "apart:",
            Arc::new(memory.clone()) as Arc<dyn Entries>,
            lock.clone() as Arc<dyn FlightLock>,
            Arc::new(memory.clone()) as Arc<dyn Notifications>,
        )
        .build()?;
    let load = |_: &str| Ok::<_, String>(b"loaded".to_vec());
    let got = portable.get_or_set("k", EntryOptions::new(), load).await?;
    assert_eq!(&got[..], b"loaded");
    assert!(
        lock.failed.load(std::sync::atomic::Ordering::SeqCst),
        "the release was tried"
    );
    assert!(
        memory.try_lock("{6:apart:k}:l", "probe", 60_000).await?,
        "the flight's lock was left held after its call ended"
    );
    Ok(())
}

/// A portable process watches its wall clock as the native one does (contract §7.5): a
/// clear whose announcement never came is learnt within the L1 TTL of the clock's own
/// time even across a step back, since the step is a gap in what the instance heard (L1
/// emptied, the generation read again); a reading less than a second behind is not a
/// step (native: `tags::a_clock_stepped_back_does_not_extend_what_a_process_trusts`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_clock_stepped_back_does_not_extend_what_it_trusts() -> Result<()> {
    use corral::Clock as _;
    let server = RedisServer::start()?;
    let l1_ttl = 30 * SEC;
    let clock = corral::ManualClock::starting_now();
    let portable = portable_on(&server, &clock, l1_ttl)?;
    // Subscribed first: a (re)subscription empties L1 too.
    let native = Corral::builder().redis(server.url()).build()?;
    until_each_hears_the_other(&portable, &native).await?;
    let start = clock.now_ms();
    portable
        .set("k", "v", EntryOptions::new().relative(600 * SEC))
        .await?;
    assert_eq!(portable.get("k").await?.as_deref(), Some(&b"v"[..]));

    server.clear_unannounced("corral:", start).await?;
    clock.advance(10 * SEC);
    assert_eq!(
        portable.get("k").await?.as_deref(),
        Some(&b"v"[..]),
        "within the L1 TTL, unheard: still served (the documented bound)"
    );
    clock.set(clock.now_ms() - 500);
    assert_eq!(
        portable.get("k").await?.as_deref(),
        Some(&b"v"[..]),
        "half a second back is not a step"
    );

    // An hour back, then more than the L1 TTL forward.
    clock.set(start - 3_600_000);
    clock.advance(l1_ttl + SEC);
    assert_eq!(
        portable.get("k").await?,
        None,
        "the clear was not learnt within the L1 TTL of the clock's own time"
    );
    Ok(())
}

/// Tag and clear invalidations reach the other body's L1 at once, both ways (contract
/// §7.5): a portable process hears a native process's `remove_by_tag` and `clear`, and
/// a native process hears a portable one's, well before their L1 TTL (an hour here).
/// Before, the portable body announced none and heard none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_and_clear_invalidations_reach_the_other_bodys_l1_both_ways() -> Result<()> {
    let server = RedisServer::start()?;
    let (portable, native) = over_one_redis(&server)?;
    let v = |b: Option<Bytes>| b.map(|b| String::from_utf8_lossy(&b).into_owned());
    until_each_hears_the_other(&portable, &native).await?;

    // A native remove_by_tag reaches the portable L1.
    portable.set_tagged("k", "v", EntryOptions::new(), &["t"]).await?;
    assert_eq!(
        v(portable.get("k").await?).as_deref(),
        Some("v"),
        "portable L1 holds k"
    );
    native.remove_by_tag("t").await?;
    until(
        5 * SEC,
        "the portable process kept serving k after remove_by_tag",
        async || Ok(portable.get("k").await?.is_none()),
    )
    .await?;

    // A portable remove_by_tag reaches the native L1.
    native.set_tagged("k2", "v", EntryOptions::new(), &["u"]).await?;
    assert_eq!(
        v(native.get("k2").await?).as_deref(),
        Some("v"),
        "native L1 holds k2"
    );
    portable.remove_by_tag("u").await?;
    until(
        5 * SEC,
        "the native process kept serving k2 after remove_by_tag",
        async || Ok(native.get("k2").await?.is_none()),
    )
    .await?;

    // A native clear reaches the portable L1, and a portable clear the native one.
    native.set("c", "v", EntryOptions::new()).await?;
    assert_eq!(
        v(portable.get("c").await?).as_deref(),
        Some("v"),
        "portable L1 holds c"
    );
    native.clear().await?;
    until(
        5 * SEC,
        "the portable process kept serving c after clear",
        async || Ok(portable.get("c").await?.is_none()),
    )
    .await?;
    portable.set("d", "v", EntryOptions::new()).await?;
    assert_eq!(
        v(native.get("d").await?).as_deref(),
        Some("v"),
        "native L1 holds d"
    );
    portable.clear().await?;
    until(
        5 * SEC,
        "the native process kept serving d after clear",
        async || Ok(native.get("d").await?.is_none()),
    )
    .await?;
    Ok(())
}

/// A portable batch whose key another process is loading does not wait for that load
/// while it holds its other keys' locks: its loader is called at once with the keys it
/// leads, and the other key is answered with the other process's value once it lands.
/// A batch that waited there could wait on a batch that waits on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_loads_its_own_keys_before_waiting_for_another_processs_load() -> Result<()> {
    let memory = MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    let (e, l, n) = memory_stores(&memory);
    // A lock wait far beyond the bound below: a batch waiting for the other load first
    // would be seen.
    let portable = PortableCache::builder()
        .stores("batch:", e, l, n)
        .lock_wait(Duration::from_secs(60))
        .build()?;
    let (e, l, n) = memory_stores(&memory);
    let other = Corral::builder().stores("batch:", e, l, n).build()?;
    // The other process leads "k2" and holds its lock until released.
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let loading = started.notified();
    let other_load = {
        let (started, release) = (started.clone(), release.clone());
        tokio::spawn(async move {
            other
                .get_or_set(
                    "k2",
                    EntryOptions::new().relative(Duration::from_secs(60)),
                    || async move {
                        started.notify_one();
                        release.notified().await;
                        Ok::<_, std::io::Error>("theirs")
                    },
                )
                .await
        })
    };
    loading.await;
    let (asked_tx, mut asked_rx) = tokio::sync::mpsc::unbounded_channel();
    let batch = tokio::spawn(async move {
        portable
            .get_or_set_many(
                &["k1", "k2"],
                EntryOptions::new().relative(Duration::from_secs(60)),
                move |keys: &[String]| {
                    let _ = asked_tx.send(keys.to_vec());
                    Ok(keys
                        .iter()
                        .map(|k| (k.clone(), format!("mine:{k}").into_bytes()))
                        .collect())
                },
            )
            .await
    });
    let first = tokio::time::timeout(Duration::from_secs(20), asked_rx.recv())
        .await
        .map_err(|_| {
            anyhow::anyhow!("the batch waited for the other process's load before loading its own key")
        })?;
    assert_eq!(
        first,
        Some(vec!["k1".to_owned()]),
        "the batch loads the key it leads"
    );
    release.notify_one();
    assert_eq!(&other_load.await??[..], b"theirs");
    let answers = batch.await??;
    let answers: Vec<Option<Bytes>> = answers.into_iter().collect::<corral::Result<_>>()?;
    assert_eq!(
        answers,
        [
            Some(Bytes::from_static(b"mine:k1")),
            Some(Bytes::from_static(b"theirs"))
        ],
        "the other key is the other process's value"
    );
    assert!(
        asked_rx.try_recv().is_err(),
        "one loader call: the other key was never loaded here"
    );
    Ok(())
}

/// A portable cache over its own memory store.
/// `memory` as the three stores a builder's `stores` takes: one process's view of it.
fn memory_stores(memory: &MemoryStore) -> (Arc<dyn Entries>, Arc<dyn FlightLock>, Arc<dyn Notifications>) {
    (
        Arc::new(memory.clone()),
        Arc::new(memory.clone()),
        Arc::new(memory.clone()),
    )
}

fn portable_over_memory() -> Result<PortableCache> {
    let memory = MemoryStore::new(Arc::new(corral::SystemClock), 30_000);
    Ok(PortableCache::builder().memory(memory).build()?)
}

/// The keys of each loader call, in order.
type Calls = Arc<parking_lot::Mutex<Vec<Vec<String>>>>;
/// What a portable batch loader gives: the values found, or a failure.
type Found = Result<Vec<(String, Vec<u8>)>, String>;

/// A batch loader that records the keys of each call and finds every key but `absent`.
fn recording(calls: &Calls) -> impl FnMut(&[String]) -> Found + Send + 'static {
    let calls = calls.clone();
    move |keys: &[String]| {
        calls.lock().push(keys.to_vec());
        Ok(keys
            .iter()
            .filter(|k| k.as_str() != "absent")
            .map(|k| (k.clone(), format!("v:{k}").into_bytes()))
            .collect())
    }
}

/// A portable batch's key counts its hard timeout from its own loader call (contract
/// §5.16, §7.2): with `max_batch` 1 each call takes three fifths of the hard timeout
/// by the cache's clock, and the second call's key is served. Before, its timeout ran
/// from the batch's start, and it timed out on the first call's time. A call that runs
/// past the timeout itself still times out.
#[tokio::test]
async fn a_portable_batch_keys_hard_timeout_counts_from_its_own_call() -> Result<()> {
    let clock = corral::ManualClock::starting_now();
    let memory = MemoryStore::new(Arc::new(clock.clone()), 30_000);
    let hard = Duration::from_millis(1_000);
    let portable = PortableCache::builder()
        .clock(clock.clone())
        .memory(memory)
        .hard_timeout(hard)
        .build()?;
    let relative = || corral::LoadOptions::relative(Duration::from_secs(60));
    let taking = |took: Duration| {
        let clock = clock.clone();
        move |keys: &[String]| -> Found {
            clock.advance(took);
            Ok(keys.iter().map(|k| (k.clone(), k.clone().into_bytes())).collect())
        }
    };
    let got = portable
        .get_or_set_many(&["a", "b"], relative().max_batch(1), taking(hard * 3 / 5))
        .await?;
    for (key, value) in ["a", "b"].iter().zip(got) {
        assert_eq!(
            value?,
            Some(Bytes::from(*key)),
            "{key}, its call within the timeout"
        );
    }
    let got = portable.get_or_set_many(&["c"], relative(), taking(hard)).await?;
    let e = got
        .into_iter()
        .next()
        .expect("one answer")
        .expect_err("past the timeout");
    assert_eq!(e.kind(), corral::ErrorKind::Timeout, "{e}");
    Ok(())
}

#[tokio::test]
async fn a_portable_batch_takes_the_native_batchs_options() -> Result<()> {
    let portable = portable_over_memory()?;
    let calls = Calls::default();
    let relative = || corral::LoadOptions::relative(Duration::from_secs(60));
    // `max_batch` splits the loader calls, as the guest's `batch-calls` says.
    let keys = ["a", "b", "c", "d", "e"];
    let got = portable
        .get_or_set_many(&keys, relative().max_batch(2), recording(&calls))
        .await?;
    let sizes: Vec<usize> = calls.lock().iter().map(Vec::len).collect();
    assert_eq!(sizes, [2, 2, 1], "{:?}", calls.lock());
    for (key, value) in keys.iter().zip(got) {
        assert_eq!(value?, Some(Bytes::from(format!("v:{key}"))));
    }
    // `should_cache`: a refused value is returned, not cached; a left-out key is absent.
    calls.lock().clear();
    let picky = relative().should_cache(|v| v != b"v:skip");
    for _ in 0..2 {
        let got = portable
            .get_or_set_many(&["skip", "keep", "absent"], picky.clone(), recording(&calls))
            .await?;
        assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&b"v:skip"[..]));
        assert!(matches!(got[2], Ok(None)), "{:?}", got[2]);
    }
    assert_eq!(
        *calls.lock(),
        [vec!["skip", "keep", "absent"], vec!["skip", "absent"]],
        "the refused and the absent keys are loaded again, the kept one is not"
    );
    // Tags: a loaded entry carries them, and `remove_by_tag` removes it.
    calls.lock().clear();
    let tagged = relative().tags(["t"]);
    portable
        .get_or_set_many(&["t1"], tagged.clone(), recording(&calls))
        .await?;
    portable.remove_by_tag("t").await?;
    portable
        .get_or_set_many(&["t1"], tagged, recording(&calls))
        .await?;
    assert_eq!(calls.lock().len(), 2, "the tagged entry was removed by its tag");
    // `bypass`: loaded whatever is cached.
    calls.lock().clear();
    portable
        .get_or_set_many(&["keep"], relative().bypass(true), recording(&calls))
        .await?;
    assert_eq!(*calls.lock(), [vec!["keep"]]);
    Ok(())
}

#[tokio::test]
async fn a_portable_batch_refuses_what_it_cannot_keep_before_anything_runs() -> Result<()> {
    let portable = portable_over_memory()?;
    let calls = Calls::default();
    let relative = || corral::LoadOptions::relative(Duration::from_secs(60));
    let refused = [
        (relative().hard_timeout(SEC), "hard_timeout"),
        (relative().soft_timeout(SEC), "soft_timeout"),
        (relative().eager_refresh(0.5), "eager_refresh"),
        (relative().background_completion(true), "background_completion"),
        (relative().max_batch(0), "max_batch"),
    ];
    for (options, name) in refused {
        let e = portable
            .get_or_set_many(&["k"], options, recording(&calls))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), corral::ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains(name), "{name}: {e}");
    }
    // A bad key before a bad tag is named first, as the native body names it.
    let e = portable
        .get_or_set_many(&["a", ""], relative().tags([""]), recording(&calls))
        .await
        .unwrap_err();
    assert_eq!(e.argument(), Some("key"), "{e}");
    assert!(calls.lock().is_empty(), "no loader call: {:?}", calls.lock());
    Ok(())
}

#[tokio::test]
async fn a_portable_get_or_set_takes_the_native_options_and_refuses_what_it_cannot_keep() -> Result<()> {
    let portable = portable_over_memory()?;
    let loads = Arc::new(AtomicUsize::new(0));
    let counting = |value: &'static [u8]| {
        let loads = loads.clone();
        move |_: &str| {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok(value.to_vec())
        }
    };
    let relative = || corral::LoadOptions::relative(Duration::from_secs(60));
    for (options, name) in [
        (relative().hard_timeout(SEC), "hard_timeout"),
        (relative().soft_timeout(SEC), "soft_timeout"),
        (relative().eager_refresh(0.5), "eager_refresh"),
        (relative().background_completion(true), "background_completion"),
        (relative().tags([""]), "tags"),
    ] {
        let e = portable
            .get_or_set("k", options, counting(b"x"))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), corral::ErrorKind::InvalidArgument, "{e}");
        assert_eq!(e.argument(), Some(name), "{e}");
    }
    assert_eq!(loads.load(Ordering::SeqCst), 0, "nothing refused ran the loader");

    // `should_cache` judges: a refused value is returned, not cached.
    let refusing = relative().should_cache(|v| v != b"bad");
    assert_eq!(
        &portable
            .get_or_set("k", refusing.clone(), counting(b"bad"))
            .await?[..],
        b"bad"
    );
    assert_eq!(portable.get("k").await?, None, "a refused value is not cached");
    assert_eq!(
        &portable.get_or_set("k", refusing, counting(b"good")).await?[..],
        b"good"
    );
    // `tags`: the loaded entry carries them.
    assert_eq!(
        &portable
            .get_or_set("t", relative().tags(["team"]), counting(b"tagged"))
            .await?[..],
        b"tagged"
    );
    portable.remove_by_tag("team").await?;
    assert_eq!(portable.get("t").await?, None, "the tag dropped the loaded entry");
    // `bypass`: loads again over a fresh entry, and caches what it loaded.
    let before = loads.load(Ordering::SeqCst);
    assert_eq!(
        &portable
            .get_or_set("k", relative().bypass(true), counting(b"new"))
            .await?[..],
        b"new"
    );
    assert_eq!(loads.load(Ordering::SeqCst), before + 1);
    assert_eq!(portable.get("k").await?.as_deref(), Some(&b"new"[..]));
    Ok(())
}

/// A free lock is taken however the table changes around it: a sweep that forgets
/// another key's released record between the `lock` export's read and its swap raises
/// the table's floor (the swap's expected record is then stale), and the export reads
/// again rather than answer "not taken". Every acquire here is of a key nobody holds,
/// while another thread sweeps the table without pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_portable_lock_is_taken_while_the_table_forgets_other_keys() -> Result<()> {
    let cache = PortableCache::builder().build()?;
    let table = cache.lock_table().clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sweeper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = table.sweep();
            }
        })
    };
    let mut refused = Vec::new();
    let mut last = std::collections::HashMap::new();
    for i in 0..3_000 {
        // A few keys, each released at once: their free records are what the sweeper
        // forgets, raising the floor of their shards.
        let key = format!("k{}", i % 48);
        match cache.acquire(&key, "me", Duration::from_secs(60)).await? {
            Some(token) => {
                if let Some(before) = last.insert(key.clone(), token) {
                    anyhow::ensure!(token > before, "{key}: token {token} after {before}");
                }
                anyhow::ensure!(cache.unlock(&key, "me").await?, "{key} released");
            }
            None => refused.push(key),
        }
    }
    stop.store(true, Ordering::Relaxed);
    sweeper.join().expect("the sweeper ends");
    anyhow::ensure!(refused.is_empty(), "free locks refused: {refused:?}");
    Ok(())
}

/// A portable process's L1 copy lives no longer than the generation it was named in is
/// known, as the native one's (`tags::a_copy_filled_late_in_the_generations_window_does_not_outlive_it`):
/// a read late in that window, after a clear whose announcement never came, is served,
/// but its copy is not served past the L1 TTL of the last read of the generation before
/// the clear. Before, the portable body capped the copy by its tags' moments only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_copy_filled_late_in_the_generations_window_does_not_outlive_it() -> Result<()> {
    use corral::Clock as _;
    let server = RedisServer::start()?;
    let l1_ttl = 30 * SEC;
    let clock = corral::ManualClock::starting_now();
    let portable = portable_on(&server, &clock, l1_ttl)?;
    // The get-or-set's process: once the generation lapsed, a process's first read
    // learns the new one and empties its L1, so each check must be its process's first.
    let portable2 = portable_on(&server, &clock, l1_ttl)?;
    let native = Corral::builder().redis(server.url()).build()?;
    until_each_hears_the_other(&portable, &native).await?;
    until_each_hears_the_other(&portable2, &native).await?;
    // Written by another process, so not in the portable L1s (a probe written after
    // them is heard, so their announcements were too): one read by `get`, one by a
    // get-or-set.
    for key in ["k", "k2"] {
        native
            .set(key, "v", EntryOptions::new().relative(600 * SEC))
            .await?;
    }
    until_each_hears_the_other(&portable, &native).await?;
    until_each_hears_the_other(&portable2, &native).await?;
    let options = EntryOptions::new().relative(600 * SEC);
    let load = |_: &str| Ok(b"loaded".to_vec());

    server.clear_unannounced("corral:", clock.now_ms()).await?;
    clock.advance(l1_ttl - SEC);
    assert_eq!(
        portable.get("k").await?.as_deref(),
        Some(&b"v"[..]),
        "within the L1 TTL, unheard: still served (the documented bound)"
    );
    assert_eq!(portable2.get_or_set("k2", options, load).await?, "v");
    clock.advance(2 * SEC);
    assert_eq!(
        portable.get("k").await?,
        None,
        "the copy filled late in the generation's window outlived it"
    );
    assert_eq!(
        portable2.get_or_set("k2", options, load).await?,
        "loaded",
        "the get-or-set's copy filled late in the generation's window outlived it"
    );
    Ok(())
}

/// A value a flight loaded is newer than any clear its process missed: its L1 copy is
/// not bound by the generation (`flight::l1_copy_until`), so in an outage that let the
/// generation lapse, the degraded copy (a second in L1) still spares the next caller
/// the loader, in both bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_copy_outlives_an_outage_that_let_the_generation_lapse_in_both_bodies() -> Result<()> {
    let server = RedisServer::start()?;
    let l1_ttl = 30 * SEC;
    let clock = corral::ManualClock::starting_now();
    let mut options = corral::RedisOptions::new(server.url());
    options.response_timeout = Duration::from_millis(200);
    let portable = PortableCache::builder()
        .redis_options(options.clone())
        .l1_ttl(l1_ttl)
        .clock(clock.clone())
        .build()?;
    let native = Corral::builder()
        .redis_options(options)
        .l1_ttl(l1_ttl)
        .clock(clock.clone())
        .build()?;
    // Each learns the generation now.
    portable.get("warm").await?;
    native.get("warm").await?;
    server.pause()?;
    clock.advance(l1_ttl + SEC);
    let loads = Arc::new(AtomicUsize::new(0));
    for round in 0..2 {
        let counted = loads.clone();
        let v = portable
            .get_or_set("d", EntryOptions::new(), move |_: &str| {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok(b"loaded".to_vec())
            })
            .await?;
        assert_eq!(v, "loaded", "portable, call {round}");
        let counted = loads.clone();
        let v = native
            .get_or_set("d", EntryOptions::new(), || async move {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>("loaded")
            })
            .await?;
        assert_eq!(v, "loaded", "native, call {round}");
    }
    server.resume()?;
    assert_eq!(
        loads.load(Ordering::SeqCst),
        2,
        "one load a body: the second call of each was served its degraded copy"
    );
    Ok(())
}

/// A hit a get-or-set's flight finds (its first read missed, so its copy is filled as
/// the flight ends, not by that read) is bound by the generation as a read's is
/// (`flight::l1_copy_until`), in both bodies: late in the window a process trusts its
/// generation, after a clear whose announcement never came, each body waits for
/// another process's load of the key and is served what that load wrote, but its copy
/// is not served once the generation lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hit_found_in_a_flight_late_in_the_generations_window_does_not_outlive_it() -> Result<()> {
    use corral::Clock as _;
    let server = RedisServer::start()?;
    let l1_ttl = 30 * SEC;
    let clock = corral::ManualClock::starting_now();
    let portable = portable_on(&server, &clock, l1_ttl)?;
    let native = native_on(&server, &clock, l1_ttl)?;
    // The other process, on the same clock (its lock's moments are read by the bodies):
    // it too trusts the generation it learns now, so its load lands where they look.
    let other = native_on(&server, &clock, l1_ttl)?;
    // Each subscribed and then read the generation (a subscription that goes live
    // after a read forgets what that read learnt).
    until_each_hears_the_other(&portable, &other).await?;
    until_each_hears_the_other(&portable, &native).await?;
    let options = EntryOptions::new().relative(600 * SEC);

    server.clear_unannounced("corral:", clock.now_ms()).await?;
    clock.advance(l1_ttl - SEC);
    for body in ["portable", "native"] {
        let key = format!("found-by-{body}");
        // The other process leads the key's flight; its load waits for the word.
        let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let leading = {
            let (other, key, options) = (other.clone(), key.clone(), options);
            let (started, release) = (started.clone(), release.clone());
            tokio::spawn(async move {
                other
                    .get_or_set(&key, options, || async {
                        started.notify_one();
                        release.notified().await;
                        Ok::<_, std::io::Error>("theirs")
                    })
                    .await
            })
        };
        started.notified().await;
        // The body's read misses and its lock attempt (the native body's script, the
        // portable body's `SET NX`) is refused: it waits for the other's landing, and
        // finds the hit in its flight.
        let lock_attempts = async || -> Result<u64> {
            let mut sent = 0;
            for command in ["evalsha", "eval", "set"] {
                sent += corral_tests::command_calls(&server, command).await?;
            }
            Ok(sent)
        };
        let before = lock_attempts().await?;
        let following = {
            let (portable, native, key, options) = (portable.clone(), native.clone(), key.clone(), options);
            tokio::spawn(async move {
                let ours = |_: &str| Ok(b"ours".to_vec());
                Ok::<Bytes, anyhow::Error>(match body {
                    "portable" => portable.get_or_set(&key, options, ours).await?,
                    _ => {
                        native
                            .get_or_set(&key, options, || async { Ok::<_, std::io::Error>("ours") })
                            .await?
                    }
                })
            })
        };
        until(10 * SEC, "the body never tried the flight lock", async || {
            Ok(lock_attempts().await? > before)
        })
        .await?;
        release.notify_one();
        assert_eq!(following.await??, "theirs", "{body}: served the other's load");
        assert_eq!(leading.await??, "theirs");
    }
    // The copies are in L1 (no read reaches Redis), so what follows tests their bound.
    let reads = async || -> Result<u64> {
        let mut sent = 0;
        for command in ["get", "mget", "getex", "evalsha", "eval"] {
            sent += corral_tests::command_calls(&server, command).await?;
        }
        Ok(sent)
    };
    let before = reads().await?;
    assert_eq!(
        portable.get("found-by-portable").await?.as_deref(),
        Some(&b"theirs"[..])
    );
    assert_eq!(
        native.get("found-by-native").await?.as_deref(),
        Some(&b"theirs"[..])
    );
    assert_eq!(
        reads().await?,
        before,
        "a copy the flights found was not kept in L1"
    );
    clock.advance(2 * SEC);
    let load = |_: &str| Ok(b"loaded".to_vec());
    assert_eq!(
        portable.get_or_set("found-by-portable", options, load).await?,
        "loaded",
        "portable: the hit its flight found late in the generation's window outlived it"
    );
    assert_eq!(
        native
            .get_or_set("found-by-native", options, || async {
                Ok::<_, std::io::Error>("loaded")
            })
            .await?,
        "loaded",
        "native: the hit its flight found late in the generation's window outlived it"
    );
    Ok(())
}

/// A portable get-or-set whose `should_cache` panics fails as its loader's panic would
/// (a `Loader` error, nothing escapes the call), and the cache serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_should_cache_that_panics_fails_the_call_not_the_caller() -> Result<()> {
    let cache = PortableCache::builder().build()?;
    let picky = corral::LoadOptions::new().should_cache(|_| panic!("a predicate that cannot judge"));
    let got = std::panic::AssertUnwindSafe(cache.get_or_set("k", picky, |_| Ok(b"v".to_vec())))
        .catch_unwind()
        .await
        .map_err(|_| anyhow::anyhow!("the predicate's panic escaped the call"))?;
    assert_eq!(
        got.expect_err("its predicate panicked").kind(),
        corral::ErrorKind::Loader
    );
    let again = cache
        .get_or_set("k", EntryOptions::new(), |_| Ok(b"w".to_vec()))
        .await?;
    assert_eq!(again, Bytes::from("w"));
    Ok(())
}

/// How many data commands (reads, writes, scripts) `server` ran so far: what a cache's
/// call sends, without the connections' own (`INFO`, `PING`, subscriptions).
async fn data_commands(server: &RedisServer) -> Result<u64> {
    let mut total = 0;
    for command in ["get", "mget", "set", "eval", "evalsha", "del", "pexpire", "pttl"] {
        total += corral_tests::command_calls(server, command).await?;
    }
    Ok(total)
}

/// A portable batch of L1 hits sends nothing once the prefix's generation lapsed (one
/// L1 TTL after it was read), as one portable get-or-set's L1 hit sends nothing: the
/// copies its own loads filled are not bound by that generation, and L1 answers before
/// the generation is asked for. A key L1 does not hold reads the generation again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_of_l1_hits_sends_nothing_once_the_generation_lapsed() -> Result<()> {
    let server = RedisServer::start()?;
    let clock = corral::ManualClock::starting_now();
    let portable = portable_on(&server, &clock, 60 * SEC)?;
    portable.get("warm-up").await?;
    // Loaded 30 s after the generation was read; asked again 35 s later, past its lapse.
    clock.advance(30 * SEC);
    let keys = ["k0", "k1", "k2"];
    let options = EntryOptions::new().relative(3_600 * SEC);
    let calls = Calls::default();
    portable
        .get_or_set_many(&keys, options, recording(&calls))
        .await?;
    clock.advance(35 * SEC);
    let before = data_commands(&server).await?;
    let one = portable
        .get_or_set("k0", options, |_| Err("an L1 hit".to_string()))
        .await?;
    assert_eq!(one, Bytes::from("v:k0"));
    assert_eq!(
        data_commands(&server).await? - before,
        0,
        "one key's L1 hit sends nothing"
    );
    let answers = portable
        .get_or_set_many(&keys, options, recording(&calls))
        .await?;
    let values: Vec<Option<Bytes>> = answers.into_iter().collect::<corral::Result<_>>()?;
    assert_eq!(values, keys.map(|k| Some(Bytes::from(format!("v:{k}")))));
    assert_eq!(
        data_commands(&server).await? - before,
        0,
        "a batch of L1 hits sends nothing either"
    );
    assert_eq!(calls.lock().len(), 1, "loaded once");
    // The control: a key L1 does not hold is read, and loaded.
    portable
        .get_or_set_many(&["k0", "k9"], options, recording(&calls))
        .await?;
    assert!(data_commands(&server).await? > before, "k9 was read");
    assert_eq!(
        calls.lock().last().map(Vec::as_slice),
        Some(&["k9".to_string()][..])
    );
    Ok(())
}

/// A portable batch whose read of the prefix's generation timed out (its reply held on
/// the wire, no generation known to stand in) reads it once, as the native batch does:
/// its led keys degrade (loaded, served, nothing cached) without each reading the
/// generation again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_whose_generation_read_timed_out_reads_it_once() -> Result<()> {
    let server = RedisServer::start()?;
    let portable = generation_held(&server, Duration::from_millis(200)).await?;
    let reads_before = corral_tests::command_calls(&server, "get").await?;
    let calls = Calls::default();
    let keys = ["k0", "k1", "k2", "k3", "k4"];
    let answers = portable
        .get_or_set_many(&keys, EntryOptions::new(), recording(&calls))
        .await?;
    let generation_reads = corral_tests::command_calls(&server, "get").await? - reads_before;
    let values: Vec<Option<Bytes>> = answers.into_iter().collect::<corral::Result<_>>()?;
    assert_eq!(values, keys.map(|k| Some(Bytes::from(format!("v:{k}")))));
    assert_eq!(calls.lock().len(), 1, "one loader call");
    assert_eq!(generation_reads, 1, "the generation read again per led key");
    Ok(())
}

/// A portable batch's options are judged once, when it is called: an absolute expiry
/// ahead then that passes while the batch reads its generation (held on the wire until
/// the response timeout) fails no key; each is loaded and served, not cached (contract
/// §5.16). Before, each led key judged the options again as its flight started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_whose_absolute_expiry_passes_while_it_reads_fails_no_key() -> Result<()> {
    let server = RedisServer::start()?;
    let portable = generation_held(&server, Duration::from_millis(800)).await?;
    let calls = Calls::default();
    let keys = ["k0", "k1", "k2"];
    let soon = std::time::SystemTime::now() + Duration::from_millis(250);
    let answers = portable
        .get_or_set_many(&keys, EntryOptions::new().absolute(soon), recording(&calls))
        .await?;
    let values: Vec<Option<Bytes>> = answers.into_iter().collect::<corral::Result<_>>()?;
    assert_eq!(values, keys.map(|k| Some(Bytes::from(format!("v:{k}")))));
    assert_eq!(calls.lock().len(), 1, "one loader call");
    // Past its point, nothing is cached in L2.
    assert_eq!(
        server.entries_held().await?,
        0,
        "an entry was written past its point"
    );
    Ok(())
}

/// A portable bypass batch whose read of the prefix's generation timed out reads it once:
/// its keys are named in one generation found once for them all (contract §5.16), and
/// each is loaded and served, as one key's bypass is. Before, each key read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_bypass_batch_whose_generation_read_timed_out_reads_it_once() -> Result<()> {
    let server = RedisServer::start()?;
    let portable = generation_held(&server, Duration::from_millis(200)).await?;
    let reads = async || -> Result<u64> {
        Ok(corral_tests::command_calls(&server, "get").await?
            + corral_tests::command_calls(&server, "mget").await?)
    };
    let reads_before = reads().await?;
    let calls = Calls::default();
    let keys = ["k0", "k1", "k2", "k3", "k4"];
    let answers = portable
        .get_or_set_many(
            &keys,
            corral::LoadOptions::relative(Duration::from_secs(60)).bypass(true),
            recording(&calls),
        )
        .await?;
    let generation_reads = reads().await? - reads_before;
    let values: Vec<Option<Bytes>> = answers.into_iter().collect::<corral::Result<_>>()?;
    assert_eq!(values, keys.map(|k| Some(Bytes::from(format!("v:{k}")))));
    assert_eq!(calls.lock().len(), 1, "one loader call");
    assert_eq!(generation_reads, 1, "the generation read again per bypassing key");
    Ok(())
}

/// A portable cache on `server` whose reads of the prefix's generation get no reply (held
/// on the wire) until its response timeout, `timeout`.
async fn generation_held(server: &RedisServer, timeout: Duration) -> Result<PortableCache> {
    let wire = corral_tests::wire::RealWire::holding_the_generation(&server.url()).await?;
    let mut options = corral::RedisOptions::new(server.url());
    options.response_timeout = timeout;
    Ok(PortableCache::builder()
        .redis_options(options)
        .redis_wire(Arc::new(wire))
        .build()?)
}

/// A portable batch's L1 hits due for their eager refresh are refreshed together: each
/// key is served its copy at once, the prefix's generation (lapsed) is read once for
/// them all, and their loads go to the loader in one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_refreshes_its_hits_due_in_one_loader_call() -> Result<()> {
    let due = hits_due_for_refresh(false).await?;
    assert_eq!(
        due.generation_sends, 1,
        "the generation read once for the batch's refreshes"
    );
    assert_eq!(
        due.refreshed,
        Some(due.keys),
        "every key refreshed, in one loader call"
    );
    Ok(())
}

/// A portable batch's L1 hits due for their eager refresh, when the read of the prefix's
/// (lapsed) generation gets no reply: it is sent once for them all, no refresh begins (a
/// refresh names its key only in a generation it read), and each key is served its copy.
/// Before, each refresh sent its own read of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_of_hits_due_for_refresh_whose_generation_read_hangs_sends_it_once() -> Result<()> {
    let due = hits_due_for_refresh(true).await?;
    assert_eq!(
        due.generation_sends, 1,
        "the generation read sent again per refresh"
    );
    assert_eq!(due.refreshed, None, "nothing refreshed in an unread generation");
    Ok(())
}

/// What a portable batch of 20 L1 hits due for their eager refresh did.
struct HitsDue {
    keys: Vec<String>,
    /// How many sends named the prefix's generation during the batch.
    generation_sends: usize,
    /// The keys of the loader call the refreshes made, if they made one.
    refreshed: Option<Vec<String>>,
}

/// 20 keys loaded 30 s after the prefix's generation was read (their L1 copies are not
/// bound by it), then asked again in a batch 35 s later: past the generation's lapse
/// (one L1 TTL, 60 s) and the keys' refresh point, short of their L1 deadline. With
/// `hold`, the replies to what names the generation never come (its read times out).
/// Each key must be served its copy.
async fn hits_due_for_refresh(hold: bool) -> Result<HitsDue> {
    let server = RedisServer::start()?;
    let clock = corral::ManualClock::starting_now();
    // The wire counts what names the prefix's generation (`{…}:g`).
    let wire = Arc::new(corral_tests::wire::RealWire::connect(&server.url()).await?);
    *wire.naming.lock().unwrap_or_else(|e| e.into_inner()) = Some("}:g".to_string());
    let mut options = corral::RedisOptions::new(server.url());
    options.response_timeout = Duration::from_millis(300);
    let portable = PortableCache::builder()
        .redis_options(options)
        .redis_wire(wire.clone())
        .clock(clock.clone())
        .l1_ttl(60 * SEC)
        .eager_refresh(0.5)
        .build()?;
    // Subscribed first (the gap a subscription opens with flushes what it knew): the
    // generation is read now, by the probe, and not again before it lapses.
    let native = Corral::builder().redis(server.url()).build()?;
    until_portable_hears(&native, &portable).await?;
    clock.advance(30 * SEC);
    let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    let calls = Calls::default();
    let options = EntryOptions::new().relative(60 * SEC);
    portable
        .get_or_set_many(&keys, options, recording(&calls))
        .await?;
    clock.advance(35 * SEC);
    if hold {
        wire.named.close();
    }
    let sends = wire.named_sends.load(Ordering::SeqCst);
    let answers = portable
        .get_or_set_many(&keys, options, recording(&calls))
        .await?;
    let generation_sends = wire.named_sends.load(Ordering::SeqCst) - sends;
    let values: Vec<Option<Bytes>> = answers.into_iter().collect::<corral::Result<_>>()?;
    let expected: Vec<Option<Bytes>> = keys.iter().map(|k| Some(Bytes::from(format!("v:{k}")))).collect();
    assert_eq!(values, expected, "each key served its copy");
    let refreshed = calls.lock().get(1).cloned();
    assert!(calls.lock().len() <= 2, "the refreshes loaded in one call");
    Ok(HitsDue {
        keys,
        generation_sends,
        refreshed,
    })
}

/// A portable batch of L1 hits due for their eager refresh ends within one store timeout
/// when the replies to its refreshes' lock tries never come: the refreshes begin
/// together under one bound (a refresh's budget: it takes the lock without waiting), and
/// each key is served its L1 copy. Before, each began under a bound of its own, the lock
/// wait: 20 keys took over 100 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_of_hits_due_for_refresh_ends_within_one_store_timeout_when_its_locks_hang()
-> Result<()> {
    let took = refresh_with_locks_held(20, false).await?;
    // One store timeout for the refreshes, one for releasing what their lost replies may
    // have taken, and the slack of a busy 2-core machine; one per key would be 6 s.
    assert!(took < Duration::from_millis(2_000), "took {took:?}");
    Ok(())
}

/// One portable hit due for its eager refresh ends within one store timeout when the
/// reply to its refresh's lock try never comes: a refresh never waits for the lock, so
/// its steps before the load get one store timeout (`refresh_before_load_ms`), not the
/// lock wait. Before, the hit took the lock wait (5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_hit_due_for_refresh_ends_within_one_store_timeout_when_its_lock_hangs() -> Result<()> {
    let took = refresh_with_locks_held(1, false).await?;
    assert!(took < Duration::from_millis(2_000), "took {took:?}");
    Ok(())
}

/// A portable batch of L2 hits due for their eager refresh (a process whose L1 holds none
/// of them) ends within one store timeout when the replies to its refreshes' lock tries
/// never come: the led keys' refreshes begin together with the L1 hits', under one
/// bound. Before, each led key's refresh began alone, under a bound of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_batch_of_l2_hits_due_for_refresh_ends_within_one_store_timeout_when_its_locks_hang()
-> Result<()> {
    let took = refresh_with_locks_held(20, true).await?;
    assert!(took < Duration::from_millis(2_000), "took {took:?}");
    Ok(())
}

/// How long a portable call took to serve `n` keys whose eager refreshes fell due, while
/// every reply to a command naming a flight lock (`…}:l`) is held (the store timeout is
/// 300 ms, the lock wait the default 5 s): one key through `get_or_set`, more through
/// `get_or_set_many`; from the L1 of the process that loaded them, or (`from_l2`) from
/// L2 through another process. Each key must be served its copy, and each refresh must
/// have tried its lock.
async fn refresh_with_locks_held(n: usize, from_l2: bool) -> Result<Duration> {
    let server = RedisServer::start()?;
    let clock = corral::ManualClock::starting_now();
    let wire = Arc::new(corral_tests::wire::RealWire::connect(&server.url()).await?);
    let mut redis = corral::RedisOptions::new(server.url());
    redis.response_timeout = Duration::from_millis(300);
    redis.breaker_threshold = 0;
    let process = || {
        PortableCache::builder()
            .redis_options(redis.clone())
            .redis_wire(wire.clone())
            .clock(clock.clone())
            .l1_ttl(600 * SEC)
            .eager_refresh(0.5)
            .build()
    };
    let loading = process()?;
    let keys: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
    let calls = Calls::default();
    let options = EntryOptions::new().relative(60 * SEC);
    loading.get_or_set_many(&keys, options, recording(&calls)).await?;
    let portable = if from_l2 { process()? } else { loading };
    // Past the refresh point (30 s), short of the expiry; the reading process knows the
    // prefix's generation.
    clock.advance(40 * SEC);
    portable.get("warm-up").await?;
    *wire.naming.lock().unwrap_or_else(|e| e.into_inner()) = Some("}:l".to_string());
    wire.named.close();
    let sends = wire.named_sends.load(Ordering::SeqCst);
    let began = std::time::Instant::now();
    let values: Vec<Option<Bytes>> = if let [key] = keys.as_slice() {
        let one = portable
            .get_or_set(key, options, |_| Err("an L1 hit".to_string()))
            .await?;
        vec![Some(one)]
    } else {
        let answers = portable
            .get_or_set_many(&keys, options, recording(&calls))
            .await?;
        answers.into_iter().collect::<corral::Result<_>>()?
    };
    let took = began.elapsed();
    let expected: Vec<Option<Bytes>> = keys.iter().map(|k| Some(Bytes::from(format!("v:{k}")))).collect();
    assert_eq!(values, expected, "each key served its copy");
    let lock_tries = wire.named_sends.load(Ordering::SeqCst) - sends;
    assert!(lock_tries >= n, "{lock_tries} lock tries for {n} refreshes");
    println!("{n} hits due for refresh (from L2: {from_l2}), their lock tries held: {took:?}");
    Ok(took)
}

/// A cold batch against a frozen Redis (SIGSTOP) ends by its deadlines in both bodies
/// (contract §9: the generation's read and the first reads, then each key's lock try,
/// within one deadline before the load; the loader; one store timeout after it): every
/// key is loaded once, in one loader call, and answered with what the loader gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_batch_against_a_frozen_redis_ends_by_its_deadlines_in_both_bodies() -> Result<()> {
    let server = RedisServer::start()?;
    let timeout = Duration::from_millis(200);
    let lock_wait = SEC;
    let mut options = corral::RedisOptions::new(server.url());
    options.response_timeout = timeout;
    let portable = PortableCache::builder()
        .redis_options(options.clone())
        .lock_wait(lock_wait)
        .build()?;
    let native = Corral::builder()
        .redis_options(options)
        .lock_wait(lock_wait)
        .build()?;
    // The deadlines of §9, and a second for the test's own scheduling: the steps
    // before the load (the generation's read among them, in the portable body) within
    // max(lock wait, store timeout), the steps after it within one store timeout.
    let bound = lock_wait.max(timeout) + 2 * timeout + SEC;
    let keys: Vec<String> = (0..50).map(|i| format!("frozen-{i}")).collect();
    server.pause()?;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let started = std::time::Instant::now();
    let answers = portable
        .get_or_set_many(&keys, EntryOptions::new(), move |asked: &[String]| {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok(asked.iter().map(|k| (k.clone(), k.as_bytes().to_vec())).collect())
        })
        .await?;
    let portable_took = started.elapsed();
    let portable_calls = calls.swap(0, Ordering::SeqCst);
    let counted = calls.clone();
    let started = std::time::Instant::now();
    let native_answers = native
        .get_or_set_many(&keys, EntryOptions::new(), move |asked: Vec<String>| {
            counted.fetch_add(1, Ordering::SeqCst);
            let found: Vec<(String, String)> = asked.into_iter().map(|k| (k.clone(), k)).collect();
            async move { Ok::<_, std::io::Error>(found) }
        })
        .await?;
    let native_took = started.elapsed();
    let native_calls = calls.load(Ordering::SeqCst);
    server.resume()?;
    println!(
        "frozen Redis, 50 cold keys: portable {portable_took:?}, native {native_took:?} (bound {bound:?})"
    );
    for (body, answers, calls, took) in [
        ("portable", answers, portable_calls, portable_took),
        ("native", native_answers, native_calls, native_took),
    ] {
        assert!(took < bound, "{body}: {took:?}, past {bound:?}");
        assert_eq!(calls, 1, "{body}: one loader call for the batch");
        for (key, answer) in keys.iter().zip(answers) {
            let value = answer.map_err(|e| anyhow::anyhow!("{body}: {key}: {e}"))?;
            assert_eq!(value.as_deref(), Some(key.as_bytes()), "{body}: {key}");
        }
    }
    Ok(())
}
