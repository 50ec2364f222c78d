//! Readiness and shutdown: `Corral::health`, the fail-fast `build_ready` and `close`,
//! against real redis-server processes (live, frozen, with a password, absent, out of
//! reach behind a fault proxy).

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use corral::{Corral, EntryOptions, ErrorKind, LoadOptions, RedisOptions};
use corral_tests::{FaultProxy, RedisServer};

fn short(url: String) -> RedisOptions {
    let mut options = RedisOptions::new(url);
    options.response_timeout = Duration::from_millis(300);
    options.connect_timeout = Duration::from_millis(300);
    options
}

/// A live Redis is ready; a frozen one (SIGSTOP) is not, and the answer says why and
/// comes within its deadline; it is ready again once the server resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_ready_with_a_live_redis_and_names_a_frozen_one() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = Corral::builder()
        .redis_options(short(server.url()))
        .build_ready()
        .await?;
    let health = cache.health().await;
    assert!(health.is_ready(), "{health}");
    assert_eq!(health.to_string(), "ready");

    server.pause()?;
    let began = Instant::now();
    let health = cache.health().await;
    let took = began.elapsed();
    server.resume()?;
    assert!(!health.is_ready() && !health.l2_reachable, "{health:?}");
    assert!(health.to_string().contains("L2 unreachable"), "{health}");
    assert!(
        took < Duration::from_secs(5),
        "the check ends by its deadline: {took:?}"
    );

    let deadline = Instant::now() + Duration::from_secs(10);
    while !cache.health().await.is_ready() {
        anyhow::ensure!(Instant::now() < deadline, "never ready again after the resume");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// A wrong password: `build` succeeds (every miss then goes to the loader), while
/// `build_ready` fails fast with `Unavailable`, naming the problem and never the
/// password; `health` says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_fails_build_ready_without_printing_it() -> Result<()> {
    let port = corral_tests::free_port()?;
    let server = RedisServer::start_with(port, &["--requirepass".to_owned(), "right-secret".to_owned()])?;
    let url = format!("redis://:not-the-secret@127.0.0.1:{}", server.port());
    let e = Corral::builder()
        .redis_options(short(url.clone()))
        .build_ready()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    println!("build_ready with a wrong password: {e}");
    let shown = format!("{e} {e:?}");
    assert!(
        !shown.contains("not-the-secret") && !shown.contains("right-secret"),
        "{shown}"
    );
    assert!(
        shown.to_lowercase().contains("pass") || shown.to_lowercase().contains("auth"),
        "names the cause: {shown}"
    );

    let cache = Corral::builder().redis_options(short(url)).build()?;
    let health = cache.health().await;
    assert!(!health.is_ready() && !health.l2_reachable, "{health:?}");
    assert!(!format!("{health:?}").contains("not-the-secret"));
    Ok(())
}

/// Nothing listening: `build_ready` fails fast with `Unavailable`; `health` is not
/// ready and not subscribed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_fails_build_ready() -> Result<()> {
    let port = corral_tests::free_port()?;
    let url = format!("redis://127.0.0.1:{port}");
    let began = Instant::now();
    let e = Corral::builder()
        .redis_options(short(url.clone()))
        .build_ready()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "fails fast: {:?}",
        began.elapsed()
    );
    let cache = Corral::builder().redis_options(short(url)).build()?;
    let health = cache.health().await;
    assert!(!health.l2_reachable && !health.subscribed, "{health:?}");
    Ok(())
}

/// A frozen server (SIGSTOP: it accepts connections and never answers): `build_ready`
/// fails with `Unavailable` within its deadlines rather than hanging, naming L2; once
/// the server resumes, a new `build_ready` succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_fails_build_ready_by_its_deadline() -> Result<()> {
    let server = RedisServer::start()?;
    server.pause()?;
    let began = Instant::now();
    let built = Corral::builder()
        .redis_options(short(server.url()))
        .build_ready()
        .await;
    let took = began.elapsed();
    server.resume()?;
    let e = built
        .err()
        .ok_or_else(|| anyhow::anyhow!("build_ready succeeded on a frozen Redis"))?;
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("L2"), "names what is wrong: {e}");
    assert!(took < Duration::from_secs(10), "ends by its deadlines: {took:?}");
    let cache = Corral::builder()
        .redis_options(short(server.url()))
        .build_ready()
        .await?;
    assert!(cache.health().await.is_ready());
    Ok(())
}

/// The in-memory default is always ready.
#[tokio::test]
async fn the_memory_default_is_ready() -> Result<()> {
    let cache = Corral::builder().build_ready().await?;
    assert!(cache.health().await.is_ready());
    Ok(())
}

/// A cache behind a fault proxy that has set `k` to "old", then cut off from Redis: its
/// connections reset, new ones refused until the proxy heals.
async fn cut_off_after_a_set() -> Result<(RedisServer, FaultProxy, Corral)> {
    let server = RedisServer::start()?;
    let proxy = FaultProxy::start(server.addr())?;
    let cache = Corral::builder()
        .redis_options(short(proxy.url()))
        .build_ready()
        .await?;
    cache.set("k", "old", EntryOptions::new()).await?;
    proxy.refuse(true);
    ensure!(proxy.reset_all() >= 1, "the cache's connections");
    Ok((server, proxy, cache))
}

/// A load its caller gave up on (a hard timeout, completed in the background) is waited
/// for by `close`, and fills before it returns; a close whose bound passes first says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_waits_for_a_load_its_caller_left_and_a_short_bound_says_what_was_left() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = Corral::builder()
        .redis_options(short(server.url()))
        .build_ready()
        .await?;
    let (go, gate) = tokio::sync::oneshot::channel::<()>();
    let options = LoadOptions::relative(Duration::from_secs(60))
        .hard_timeout(Duration::from_millis(100))
        .background_completion(true);
    let e = cache
        .fetch("k", options, || async move {
            let _ = gate.await;
            Ok::<_, std::convert::Infallible>("loaded")
        })
        .await
        .expect_err("the loader waits past the hard timeout");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let e = cache
        .close(Duration::from_millis(50))
        .await
        .expect_err("the load is still under way");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("still under way after 50ms"), "{e}");
    let closing = tokio::spawn({
        let cache = cache.clone();
        async move { cache.close(Duration::from_secs(10)).await }
    });
    go.send(()).expect("the loader waits");
    closing.await??;
    let other = Corral::builder().redis_options(short(server.url())).build()?;
    assert_eq!(
        other.get("k").await?.as_deref(),
        Some(&b"loaded"[..]),
        "the load filled L2 before close returned"
    );
    Ok(())
}

/// A removal whose write Redis did not answer is retried in the background; `close`
/// returns once it went through, so a process that exits right after a failed `remove`
/// leaves no old value behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_waits_for_a_removal_retried_in_the_background() -> Result<()> {
    let (server, proxy, cache) = cut_off_after_a_set().await?;
    let e = cache.remove("k").await.expect_err("Redis was out of reach");
    assert!(e.is_retryable(), "{e}");
    let closing = tokio::spawn({
        let cache = cache.clone();
        async move { cache.close(Duration::from_secs(10)).await }
    });
    proxy.heal();
    closing.await??;
    let other = Corral::builder().redis_options(short(server.url())).build()?;
    assert_eq!(other.get("k").await?, None, "the old value outlived close");
    Ok(())
}

/// A write Redis never received (its connection refused) changed nothing: no
/// announcement of it is owed, and `close` returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_redis_never_received_owes_nothing() -> Result<()> {
    let (_server, _proxy, cache) = cut_off_after_a_set().await?;
    // Reads meet the reset connection, then refused ones (a read owes nothing); the
    // write after them is refused a connection, or not tried.
    for other in ["a", "b", "c"] {
        let _ = cache.get(other).await;
    }
    let e = cache
        .set("k", "new", EntryOptions::new())
        .await
        .expect_err("Redis was out of reach");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    cache.close(Duration::ZERO).await?;
    Ok(())
}
