//! Freshness (contract §7) through the public API: fail-safe, the soft and hard loader
//! timeouts, eager refresh and soft invalidation, in one process and across caches that
//! share a real redis-server (each `Corral` there has its own L1, connections and
//! subscription, as a process does; `eager_refresh_runs_once_across_four_processes`
//! runs real `corral` processes).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use corral::{Clock, Corral, EntryOptions, ErrorKind, LoadOptions, ManualClock};
use corral_tests::RedisServer;
use tokio::sync::{Notify, oneshot};

const SEC: Duration = Duration::from_secs(1);

/// Polls `check` until it holds or `within` passes: for effects that land in a
/// background task (a refresh, a soft-timed-out load) where nothing notifies the test.
async fn eventually(within: Duration, mut check: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if check().await? {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "did not happen within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Says when it is dropped: moved into a loader, it tells whether the loader's future was
/// dropped (stopped) rather than run to its end.
struct OnDrop(Option<oneshot::Sender<()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

fn drop_signal() -> (OnDrop, oneshot::Receiver<()>) {
    let (tx, rx) = oneshot::channel();
    (OnDrop(Some(tx)), rx)
}

fn memory_cache(clock: &ManualClock) -> Result<Corral> {
    Ok(Corral::builder().clock(clock.clone()).build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_coalesced_caller_gets_the_stale_copy_marked_stale() -> Result<()> {
    let clock = ManualClock::starting_now();
    let cache = memory_cache(&clock)?;
    let options = LoadOptions::relative(SEC).fail_safe(Duration::from_secs(60));
    cache
        .get_or_set("k", options.clone(), || async { Ok::<_, std::io::Error>("v1") })
        .await?;
    clock.advance(2 * SEC);
    // The leader's loader waits until every follower has joined, then fails.
    let gate = Arc::new(Notify::new());
    let mut callers = Vec::new();
    for i in 0..4 {
        let (cache, options, gate) = (cache.clone(), options.clone(), gate.clone());
        callers.push(tokio::spawn(async move {
            cache
                .get_or_set_served("k", options, || async move {
                    gate.notified().await;
                    Err::<&str, _>(std::io::Error::other(format!("database down ({i})")))
                })
                .await
        }));
    }
    eventually(5 * SEC, async || Ok(cache.followers_of("k") == 3)).await?;
    gate.notify_one();
    for caller in callers {
        let served = caller.await??;
        assert_eq!((&served.value[..], served.stale), (&b"v1"[..], true));
    }
    let m = cache.metrics();
    assert_eq!((m.stale_served, m.loads), (1, 2), "{m:?}");
    // A plain get never returns it; get_stale does, and says so.
    assert_eq!(cache.get("k").await?, None);
    let stale = cache.get_stale("k").await?.context("a stale copy")?;
    assert!(stale.stale);
    let inspected = cache.inspect("k").await?.context("inspected")?;
    assert_eq!(
        (inspected.fresh, inspected.stale, inspected.meta.stale_ms),
        (false, true, Some(60_000))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_timeout_drops_the_loader_and_is_a_timeout_error() -> Result<()> {
    let cache = Corral::builder().build()?;
    let (guard, dropped_rx) = drop_signal();
    let err = cache
        .get_or_set(
            "k",
            LoadOptions::relative(SEC).hard_timeout(Duration::from_millis(50)),
            || async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                Ok::<_, std::io::Error>("never")
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    dropped_rx
        .await
        .context("the loader's future was dropped at the timeout")?;
    assert_eq!(cache.get("k").await?, None, "nothing cached");
    assert_eq!(cache.metrics().hard_timeouts, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_timeout_eager_refresh_and_background_completion_need_fetch() -> Result<()> {
    let cache = Corral::builder().build()?;
    for (options, name) in [
        (LoadOptions::relative(SEC).soft_timeout(SEC), "soft_timeout"),
        (LoadOptions::relative(SEC).eager_refresh(0.5), "eager_refresh"),
        (
            LoadOptions::relative(SEC)
                .hard_timeout(SEC)
                .background_completion(true),
            "background_completion",
        ),
    ] {
        let err = cache
            .get_or_set("k", options, || async { Ok::<_, std::io::Error>("v") })
            .await
            .unwrap_err();
        assert_eq!(
            (err.kind(), err.argument()),
            (ErrorKind::InvalidArgument, Some(name)),
            "{err}"
        );
    }
    for bad in [0.0, 1.0, -3.0, f64::NAN] {
        let err = cache
            .fetch("k", LoadOptions::relative(SEC).eager_refresh(bad), || async {
                Ok::<_, std::io::Error>("v")
            })
            .await
            .unwrap_err();
        assert_eq!(err.argument(), Some("eager_refresh"), "{bad}: {err}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soft_timeout_serves_the_stale_copy_and_the_load_still_fills_the_tiers() -> Result<()> {
    let clock = ManualClock::starting_now();
    let cache = memory_cache(&clock)?;
    let options = LoadOptions::relative(SEC)
        .fail_safe(Duration::from_secs(60))
        .soft_timeout(Duration::from_millis(50));
    cache
        .fetch("k", options.clone(), || async { Ok::<_, std::io::Error>("v1") })
        .await?;
    clock.advance(2 * SEC);
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let served = cache
        .fetch_served("k", options.clone(), || async move {
            let _ = go_rx.await;
            Ok::<_, std::io::Error>("v2")
        })
        .await?;
    assert_eq!((&served.value[..], served.stale), (&b"v1"[..], true));
    assert_eq!(cache.metrics().soft_timeouts, 1);
    // The load is still running; once it returns, both tiers hold its value.
    go_tx.send(()).ok();
    eventually(5 * SEC, async || {
        Ok(cache.get("k").await?.as_deref() == Some(&b"v2"[..]))
    })
    .await?;
    let served = cache
        .fetch_served("k", options, || async { Ok::<_, std::io::Error>("v3") })
        .await?;
    assert_eq!((&served.value[..], served.stale), (&b"v2"[..], false));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_completion_answers_every_caller_at_the_hard_timeout_and_the_load_fills_both_tiers()
-> Result<()> {
    let server = RedisServer::start()?;
    let cache = Corral::builder().redis(server.url()).build()?;
    let other = Corral::builder().redis(server.url()).build()?;
    let options = LoadOptions::relative(Duration::from_secs(60))
        .hard_timeout(SEC)
        .background_completion(true);
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let leader = {
        let (cache, options) = (cache.clone(), options.clone());
        tokio::spawn(async move {
            cache
                .fetch("k", options, || async move {
                    let _ = go_rx.await;
                    Ok::<_, std::io::Error>("late")
                })
                .await
        })
    };
    eventually(5 * SEC, async || Ok(cache.flights_in_progress() == 1)).await?;
    let follower = {
        let (cache, options) = (cache.clone(), options.clone());
        tokio::spawn(async move {
            cache
                .fetch("k", options, || async { Ok::<_, std::io::Error>("never") })
                .await
        })
    };
    eventually(5 * SEC, async || Ok(cache.followers_of("k") == 1)).await?;
    let (led, followed) = (leader.await?, follower.await?);
    for (who, result) in [("leader", led), ("follower", followed)] {
        let err = result.err().with_context(|| format!("the {who} got a value"))?;
        assert_eq!(err.kind(), ErrorKind::Timeout, "{who}: {err}");
        assert!(err.to_string().contains("background"), "{who}: {err}");
    }
    let m = cache.metrics();
    assert_eq!((m.hard_timeouts, m.loads, m.coalesced), (1, 1, 1), "{m:?}");
    assert_eq!(cache.get("k").await?, None, "nothing until the load returns");
    // The load was not stopped: once it returns, its value is in L2 for every process,
    // and in this one's L1.
    go_tx.send(()).ok();
    eventually(5 * SEC, async || {
        Ok(other.get("k").await?.as_deref() == Some(&b"late"[..]))
    })
    .await?;
    let served = cache
        .fetch_served("k", options, || async { Ok::<_, std::io::Error>("never") })
        .await?;
    assert_eq!((&served.value[..], served.stale), (&b"late"[..], false));
    assert_eq!(cache.metrics().loads, 1, "served from the tiers");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_completion_serves_the_stale_copy_at_the_hard_timeout_and_a_late_failure_keeps_it()
-> Result<()> {
    let clock = ManualClock::starting_now();
    let cache = memory_cache(&clock)?;
    let options = LoadOptions::relative(SEC)
        .fail_safe(Duration::from_secs(60))
        .hard_timeout(Duration::from_millis(50))
        .background_completion(true);
    cache
        .fetch("k", options.clone(), || async { Ok::<_, std::io::Error>("v1") })
        .await?;
    clock.advance(2 * SEC);
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let (failed_tx, failed_rx) = oneshot::channel::<()>();
    let served = cache
        .fetch_served("k", options.clone(), || async move {
            let _ = go_rx.await;
            let _ = failed_tx.send(());
            Err::<&str, _>(std::io::Error::other("database down"))
        })
        .await?;
    assert_eq!((&served.value[..], served.stale), (&b"v1"[..], true));
    let m = cache.metrics();
    assert_eq!((m.hard_timeouts, m.stale_served), (1, 1), "{m:?}");
    // The late failure leaves the stale copy, served from L1 for the throttle.
    go_tx
        .send(())
        .ok()
        .context("the load was stopped at the hard timeout")?;
    failed_rx.await.context("the load ran to its end")?;
    eventually(5 * SEC, async || Ok(cache.background_in_progress() == 0)).await?;
    let m = cache.metrics();
    assert_eq!(
        (m.stale_served, m.hard_timeouts),
        (1, 1),
        "served once, counted once: {m:?}"
    );
    let served = cache
        .fetch_served("k", options, || async { Ok::<_, std::io::Error>("never") })
        .await?;
    assert_eq!((&served.value[..], served.stale), (&b"v1"[..], true));
    assert_eq!(cache.metrics().loads, 2, "the throttle holds the loader off");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_background_completion_a_hard_timeout_still_drops_the_load_under_fetch() -> Result<()> {
    let cache = Corral::builder().build()?;
    let (guard, dropped_rx) = drop_signal();
    let err = cache
        .fetch(
            "k",
            LoadOptions::relative(SEC).hard_timeout(Duration::from_millis(50)),
            || async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                Ok::<_, std::io::Error>("never")
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    dropped_rx.await.context("the loader's future was dropped")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_refresh_returns_the_current_value_and_refreshes_once_in_the_background() -> Result<()> {
    let clock = ManualClock::starting_now();
    let cache = memory_cache(&clock)?;
    let loads = Arc::new(AtomicUsize::new(0));
    let options = LoadOptions::relative(Duration::from_secs(10)).eager_refresh(0.5);
    let loader = |value: &'static str| {
        let loads = loads.clone();
        move || async move {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(value)
        }
    };
    assert_eq!(&cache.fetch("k", options.clone(), loader("v1")).await?[..], b"v1");
    // Before half the freshness: no refresh.
    clock.advance(Duration::from_millis(4_999));
    assert_eq!(&cache.fetch("k", options.clone(), loader("v2")).await?[..], b"v1");
    assert_eq!(loads.load(Ordering::SeqCst), 1);
    // After it: the hit returns the current value at once and one refresh starts; the
    // hits while it runs (its loader waits at the gate) start no other.
    clock.advance(Duration::from_millis(1));
    let gate = Arc::new(Notify::new());
    for _ in 0..20 {
        let (loads, gate) = (loads.clone(), gate.clone());
        let gated = move || async move {
            loads.fetch_add(1, Ordering::SeqCst);
            gate.notified().await;
            Ok::<_, std::io::Error>("v2")
        };
        assert_eq!(&cache.fetch("k", options.clone(), gated).await?[..], b"v1");
    }
    gate.notify_one();
    eventually(5 * SEC, async || {
        Ok(cache.get("k").await?.as_deref() == Some(&b"v2"[..]))
    })
    .await?;
    assert_eq!(loads.load(Ordering::SeqCst), 2, "one refresh");
    assert_eq!(cache.metrics().refreshes, 1);
    // A refresh that fails leaves the current value in place.
    clock.advance(Duration::from_secs(6));
    let failing = || async { Err::<&str, _>(std::io::Error::other("database down")) };
    assert_eq!(&cache.fetch("k", options.clone(), failing).await?[..], b"v2");
    eventually(5 * SEC, async || Ok(cache.flights_in_progress() == 0)).await?;
    assert_eq!(cache.get("k").await?.as_deref(), Some(&b"v2"[..]));
    Ok(())
}

/// A caller that misses L1 while a refresh's load runs (no L1 here; with one: an evicted
/// or lapsed copy) reads L2 and gets the current value at once: it never waits for the
/// refresh (before the fix it followed the refresh's flight until its load returned), and
/// starts no second refresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_missing_l1_during_a_refresh_get_the_current_value_without_waiting() -> Result<()> {
    let clock = ManualClock::starting_now();
    let cache = Corral::builder().clock(clock.clone()).l1_capacity(0).build()?;
    let options = LoadOptions::relative(Duration::from_secs(10)).eager_refresh(0.5);
    cache
        .fetch("k", options.clone(), || async { Ok::<_, std::io::Error>("v1") })
        .await?;
    // The first load's flight ends (its lock release included) before the refresh can
    // meet it: a refresh that meets its own process's release still in flight is skipped
    // (contract, open points), which is not what this test is about.
    eventually(5 * SEC, async || Ok(cache.background_in_progress() == 0)).await?;
    clock.advance(Duration::from_secs(6));
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let loads = Arc::new(AtomicUsize::new(0));
    let counted = loads.clone();
    let value = cache
        .fetch("k", options.clone(), move || async move {
            counted.fetch_add(1, Ordering::SeqCst);
            let _ = go_rx.await;
            Ok::<_, std::io::Error>("v2")
        })
        .await?;
    assert_eq!(&value[..], b"v1", "the due hit returns the current value");
    eventually(5 * SEC, async || Ok(loads.load(Ordering::SeqCst) == 1)).await?;
    // The refresh's load is held at its gate: these must not wait for it.
    for i in 0..5 {
        let counted = loads.clone();
        let value = tokio::time::timeout(
            2 * SEC,
            cache.fetch("k", options.clone(), move || async move {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>("v3")
            }),
        )
        .await
        .with_context(|| format!("caller {i} waited for the refresh"))??;
        assert_eq!(&value[..], b"v1", "caller {i}");
    }
    assert_eq!(loads.load(Ordering::SeqCst), 1, "no second refresh");
    go_tx.send(()).ok();
    eventually(5 * SEC, async || {
        Ok(cache.get("k").await?.as_deref() == Some(&b"v2"[..]))
    })
    .await?;
    // The refresh is counted as its flight ends, which its value in L2 can precede.
    eventually(5 * SEC, async || Ok(cache.metrics().refreshes == 1)).await?;
    assert_eq!(cache.metrics().refreshes, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_refresh_runs_once_across_four_caches_on_one_redis() -> Result<()> {
    let server = RedisServer::start()?;
    let clock = ManualClock::starting_now();
    let caches: Vec<Corral> = (0..4)
        .map(|_| Corral::builder().clock(clock.clone()).redis(server.url()).build())
        .collect::<corral::Result<_>>()?;
    let loads = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Notify::new());
    let options = LoadOptions::relative(Duration::from_secs(10)).eager_refresh(0.5);
    let first = caches[0]
        .fetch("k", options.clone(), || async { Ok::<_, std::io::Error>("v1") })
        .await?;
    assert_eq!(&first[..], b"v1");
    for cache in &caches[1..] {
        assert_eq!(
            &cache
                .fetch("k", options.clone(), || async {
                    Ok::<_, std::io::Error>("never")
                })
                .await?[..],
            b"v1"
        );
    }
    clock.advance(Duration::from_secs(6));
    // Every cache hits the due entry; each starts a refresh, whose loader waits at the
    // gate, so all four are in flight together: only one may get the lock and load.
    for cache in &caches {
        let (loads, gate) = (loads.clone(), gate.clone());
        let value = cache
            .fetch("k", options.clone(), move || async move {
                loads.fetch_add(1, Ordering::SeqCst);
                gate.notified().await;
                Ok::<_, std::io::Error>("v2")
            })
            .await?;
        assert_eq!(&value[..], b"v1", "the current value, at once");
    }
    eventually(5 * SEC, async || {
        Ok(caches.iter().map(Corral::flights_in_progress).sum::<usize>() <= 1)
    })
    .await?;
    gate.notify_waiters();
    gate.notify_one();
    for cache in &caches {
        eventually(5 * SEC, async || {
            Ok(cache.get("k").await?.as_deref() == Some(&b"v2"[..]))
        })
        .await?;
    }
    assert_eq!(loads.load(Ordering::SeqCst), 1, "one refresh across four caches");
    let refreshes: u64 = caches.iter().map(|c| c.metrics().refreshes).sum();
    assert_eq!(refreshes, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expire_reaches_the_other_processes_and_keeps_the_stale_copy() -> Result<()> {
    let server = RedisServer::start()?;
    let a = Corral::builder().redis(server.url()).build()?;
    let b = Corral::builder().redis(server.url()).build()?;
    let options = EntryOptions::new()
        .relative(Duration::from_secs(600))
        .fail_safe(Duration::from_secs(600));
    a.set("k", "v1", options).await?;
    assert_eq!(b.get("k").await?.as_deref(), Some(&b"v1"[..]), "in b's L1 now");
    assert!(a.expire("k").await?);
    // b drops its L1 copy on a's announcement.
    eventually(5 * SEC, async || Ok(b.get("k").await?.is_none())).await?;
    let served = b
        .get_or_set_served("k", LoadOptions::new().entry(options), || async {
            Err::<&str, _>(std::io::Error::other("database down"))
        })
        .await?;
    assert_eq!((&served.value[..], served.stale), (&b"v1"[..], true));
    assert_eq!(a.metrics().expires, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_refresh_runs_once_across_four_processes() -> Result<()> {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    let server = RedisServer::start()?;
    let prefix = format!("refresh-{}:", std::process::id());
    let seeded_at = corral::SystemClock.now_ms();
    let at = |clock_ms: u64| -> Result<Corral> {
        let mut options = corral::RedisOptions::new(server.url());
        options.prefix = prefix.clone();
        Ok(Corral::builder()
            .clock(ManualClock::new(clock_ms))
            .redis_options(options)
            .build()?)
    };
    let options = LoadOptions::relative(Duration::from_secs(60)).eager_refresh(0.5);
    let seeded = at(seeded_at)?
        .fetch("k", options, || async { Ok::<_, std::io::Error>("v1") })
        .await?;
    assert_eq!(&seeded[..], b"v1");
    // Forty seconds on, past half of the minute: due for a refresh.
    let now = seeded_at + 40_000;
    let mut children = Vec::new();
    for _ in 0..4 {
        children.push(
            Command::new(env!("CARGO_BIN_EXE_refresh_probe"))
                .args([server.url().as_str(), prefix.as_str(), now.to_string().as_str()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("spawning refresh_probe")?,
        );
    }
    // A barrier, not a sleep: each says "ready" once connected, then all go at once.
    for child in &mut children {
        let mut line = String::new();
        BufReader::new(child.stderr.as_mut().context("piped")?).read_line(&mut line)?;
        ensure!(line.trim() == "ready", "{line}");
    }
    for child in &mut children {
        writeln!(child.stdin.as_mut().context("piped")?, "go")?;
    }
    let (mut loads, mut refreshes, mut old) = (0, 0, 0);
    for child in children {
        let out = child.wait_with_output()?;
        ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        loads += report["loads"].as_u64().context("loads")?;
        refreshes += report["refreshes"].as_u64().context("refreshes")?;
        // Each got the current value at once: v1, or v2 if the refresh had landed.
        match report["returned"].as_str() {
            Some("v1") => old += 1,
            Some("v2") => {}
            other => anyhow::bail!("returned {other:?}"),
        }
    }
    println!(
        "4 processes, due entry: {loads} load(s), {refreshes} refresh(es), {old} served the current value while it ran"
    );
    assert_eq!((loads, refreshes), (1, 1), "one refresh across four processes");
    assert_eq!(at(now)?.get("k").await?.as_deref(), Some(&b"v2"[..]));
    Ok(())
}

/// Caches sharing one in-memory store under one prefix: processes, as far as the
/// contract goes (each has its own L1 and registry).
fn sharing(clock: &ManualClock, store: &corral::store::memory::MemoryStore) -> Result<Corral> {
    Ok(Corral::builder()
        .clock(clock.clone())
        .stores(
            "p:",
            Arc::new(store.clone()),
            Arc::new(store.clone()),
            Arc::new(store.clone()),
        )
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_while_a_flight_waits_is_never_undone_by_its_stale_copy() -> Result<()> {
    let clock = ManualClock::starting_now();
    let store = corral::store::memory::MemoryStore::new(Arc::new(clock.clone()), 60_000);
    let (a, b, c) = (
        sharing(&clock, &store)?,
        sharing(&clock, &store)?,
        sharing(&clock, &store)?,
    );
    let options = LoadOptions::relative(SEC).fail_safe(Duration::from_secs(600));
    a.get_or_set("k", options.clone(), || async {
        Ok::<_, std::io::Error>("secret-v1")
    })
    .await?;
    clock.advance(2 * SEC);
    // B takes the lock and loads forever.
    let (entered_tx, entered_rx) = oneshot::channel();
    let holder = {
        let (b, options) = (b.clone(), options.clone());
        tokio::spawn(async move {
            b.get_or_set("k", options, || async move {
                let _ = entered_tx.send(());
                std::future::pending::<()>().await;
                Ok::<_, std::io::Error>("never")
            })
            .await
        })
    };
    entered_rx.await?;
    // A reads the stale copy and waits for B's lock.
    let waiter = {
        let (a, options) = (a.clone(), options.clone());
        tokio::spawn(async move {
            a.get_or_set_served("k", options, || async { Ok::<_, std::io::Error>("reloaded") })
                .await
        })
    };
    eventually(5 * SEC, async || Ok(a.metrics().lock_waits == 1)).await?;
    // The key is removed; then A's lock wait ends.
    c.remove("k").await?;
    clock.advance(10 * SEC);
    let served = waiter.await??;
    assert_ne!(&served.value[..], b"secret-v1", "a removed value was served");
    let after = a
        .get_or_set_served("k", options, || async { Ok::<_, std::io::Error>("reloaded") })
        .await?;
    assert_ne!(&after.value[..], b"secret-v1", "a removed value came back");
    assert!(
        a.get_stale("k")
            .await?
            .is_none_or(|s| &s.value[..] != b"secret-v1")
    );
    holder.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expire_while_a_load_runs_refuses_its_fill_as_a_removal_does() -> Result<()> {
    let clock = ManualClock::starting_now();
    let store = corral::store::memory::MemoryStore::new(Arc::new(clock.clone()), 60_000);
    let (a, c) = (sharing(&clock, &store)?, sharing(&clock, &store)?);
    let options = LoadOptions::relative(10 * SEC).fail_safe(Duration::from_secs(600));
    for already in ["missing", "stale"] {
        let key = format!("k-{already}");
        if already == "stale" {
            a.get_or_set(&key, options.clone(), || async { Ok::<_, std::io::Error>("v0") })
                .await?;
            clock.advance(11 * SEC);
        }
        let (entered_tx, entered_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel::<()>();
        let load = {
            let (a, options, key) = (a.clone(), options.clone(), key.clone());
            tokio::spawn(async move {
                a.get_or_set(&key, options, || async move {
                    let _ = entered_tx.send(());
                    let _ = go_rx.await;
                    Ok::<_, std::io::Error>("read before the invalidation")
                })
                .await
            })
        };
        entered_rx.await?;
        c.expire(&key).await?;
        go_tx.send(()).ok();
        load.await??;
        assert_eq!(
            c.get(&key).await?,
            None,
            "{already}: the load's fill beat the expire"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_arriving_during_a_soft_timed_out_load_get_the_stale_copy_from_l1() -> Result<()> {
    let clock = ManualClock::starting_now();
    let cache = memory_cache(&clock)?;
    let options = LoadOptions::relative(SEC)
        .fail_safe(Duration::from_secs(60))
        .soft_timeout(Duration::from_millis(20));
    cache
        .fetch("k", options.clone(), || async { Ok::<_, std::io::Error>("v1") })
        .await?;
    // The first load's flight ends (its lock release included) first: a flight that
    // meets its own process's release still in flight waits for it (contract, open
    // points), which is not what this test is about.
    eventually(5 * SEC, async || Ok(cache.background_in_progress() == 0)).await?;
    clock.advance(2 * SEC);
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let first = cache
        .fetch_served("k", options.clone(), || async move {
            let _ = go_rx.await;
            Ok::<_, std::io::Error>("v2")
        })
        .await?;
    assert!(first.stale);
    let before = cache.metrics();
    let second = cache
        .fetch_served("k", options.clone(), || async { Ok::<_, std::io::Error>("v3") })
        .await?;
    let after = cache.metrics();
    assert_eq!((&second.value[..], second.stale), (&b"v1"[..], true));
    assert_eq!(
        after.l1_hits - before.l1_hits,
        1,
        "served from L1, no lock wait: {after:?}"
    );
    assert_eq!(
        (after.lock_waits, after.stale_served - before.stale_served),
        (0, 1)
    );
    go_tx.send(()).ok();
    eventually(5 * SEC, async || {
        Ok(cache.get("k").await?.as_deref() == Some(&b"v2"[..]))
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_eager_refresh_is_refused_when_the_cache_is_built() -> Result<()> {
    for bad in [0.0, 1.0, 2.0, f64::NAN, f64::INFINITY] {
        let err = Corral::builder().eager_refresh(bad).build().unwrap_err();
        assert_eq!(err.argument(), Some("eager_refresh"), "{bad}: {err}");
    }
    Ok(())
}

/// The stale copy a flight answers with at its soft timeout is re-armed in L1 for the
/// fail-safe throttle, but as a copy of what the store held no longer than the
/// generation it was named in is known (`flight::l1_copy_until`): late in that window,
/// after a clear whose announcement never came, the copy is not served from L1 once the
/// generation lapsed, though the throttle would have kept it for seconds more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_answered_late_in_the_generations_window_does_not_outlive_it() -> Result<()> {
    let server = RedisServer::start()?;
    let clock = ManualClock::starting_now();
    let l1_ttl = 30 * SEC;
    let a = Corral::builder()
        .redis(server.url())
        .l1_ttl(l1_ttl)
        .clock(clock.clone())
        .build()?;
    let b = Corral::builder().redis(server.url()).build()?;
    // `a` subscribed, then learnt the generation; the entry is another process's, so not
    // in `a`'s L1. It is past its expiry from the start of the window on (`a`'s clock
    // moves only when told), and kept for fail-safe.
    corral_tests::until_a_hears_b(&a, &b, "subscribed").await?;
    let kept = EntryOptions::new()
        .relative(SEC)
        .fail_safe(Duration::from_secs(600));
    b.set("k", "v1", kept).await?;
    let options = LoadOptions::relative(SEC)
        .fail_safe(Duration::from_secs(600))
        .soft_timeout(Duration::from_millis(50));

    server.clear_unannounced("corral:", clock.now_ms()).await?;
    clock.advance(l1_ttl - SEC);
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let first = a
        .fetch_served("k", options.clone(), || async move {
            let _ = go_rx.await;
            Ok::<_, std::io::Error>("v2")
        })
        .await?;
    assert_eq!((&first.value[..], first.stale), (&b"v1"[..], true));
    let before = a.metrics();
    let second = a
        .fetch_served("k", options.clone(), || async { Ok::<_, std::io::Error>("v3") })
        .await?;
    assert_eq!((&second.value[..], second.stale), (&b"v1"[..], true));
    assert_eq!(a.metrics().l1_hits - before.l1_hits, 1, "re-armed in L1");

    // Past the generation's window, within the throttle: the load still runs.
    clock.advance(2 * SEC);
    let before = a.metrics();
    let third = {
        let a = a.clone();
        tokio::spawn(async move {
            a.fetch_served("k", options, || async { Ok::<_, std::io::Error>("v4") })
                .await
        })
    };
    eventually(10 * SEC, async || {
        Ok(third.is_finished() || a.metrics().coalesced > before.coalesced)
    })
    .await?;
    assert_eq!(
        a.metrics().l1_hits,
        before.l1_hits,
        "the stale copy answered late in the generation's window outlived it"
    );
    go_tx.send(()).ok();
    third.await??;
    Ok(())
}

/// An eager refresh whose lock try gets no reply (held on the wire) ends within one store
/// timeout: a refresh never waits for the lock, so its steps before the load get one
/// store timeout (`refresh_before_load_ms`, contract §5.13), not the lock wait. The hit
/// returns at once either way; the refresh leaves the flights under way when it ends
/// (the release of what its lost reply may have taken goes on in the background). Before, it ran for the lock wait (5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_refresh_whose_lock_try_hangs_ends_within_one_store_timeout() -> Result<()> {
    let server = RedisServer::start()?;
    let clock = ManualClock::starting_now();
    let wire = Arc::new(corral_tests::wire::RealWire::connect(&server.url()).await?);
    let mut redis = corral::RedisOptions::new(server.url());
    redis.response_timeout = Duration::from_millis(300);
    redis.breaker_threshold = 0;
    let cache = Corral::builder()
        .redis_options(redis)
        .redis_wire(wire.clone())
        .clock(clock.clone())
        .build()?;
    let options = LoadOptions::relative(Duration::from_secs(10)).eager_refresh(0.5);
    let loader = || async { Ok::<_, std::io::Error>("v") };
    cache.fetch("k", options.clone(), loader).await?;
    clock.advance(Duration::from_secs(6));
    // Every reply to a command naming a flight lock (`…}:l`) held from now.
    *wire.naming.lock().unwrap_or_else(|e| e.into_inner()) = Some("}:l".to_string());
    wire.named.close();
    let began = Instant::now();
    assert_eq!(&cache.fetch("k", options, loader).await?[..], b"v");
    eventually(30 * SEC, async || Ok(cache.flights_in_progress() == 0)).await?;
    let took = began.elapsed();
    assert!(
        wire.named_sends.load(Ordering::SeqCst) >= 1,
        "the refresh tried no lock"
    );
    println!("the refresh ran for {took:?}");
    // One store timeout and the slack of a busy 2-core machine.
    assert!(
        took < Duration::from_millis(2_500),
        "the refresh ran for {took:?}"
    );
    Ok(())
}
