//! The fault proxy itself, against a real redis-server through the plain `redis` crate:
//! each fault does what it says, and only that.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use corral_tests::{FaultProxy, RedisServer, real_time};
use futures::StreamExt;
use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;

/// The response timeout of connections that are meant to time out.
const SHORT: Duration = Duration::from_millis(200);
/// The bound on anything that is meant to succeed or fail promptly.
const LONG: Duration = Duration::from_secs(10);

async fn connect(url: &str, response_timeout: Duration) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(LONG))
        .set_response_timeout(Some(response_timeout));
    redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

async fn ping(conn: &mut MultiplexedConnection) -> redis::RedisResult<String> {
    redis::cmd("PING").query_async(conn).await
}

fn start() -> Result<(RedisServer, FaultProxy)> {
    let server = RedisServer::start()?;
    let proxy = FaultProxy::start(server.addr())?;
    Ok((server, proxy))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_is_a_plain_pipe() -> Result<()> {
    let (_server, proxy) = start()?;
    assert_eq!(proxy.url(), format!("redis://127.0.0.1:{}", proxy.port()));
    assert_eq!(proxy.addr().port(), proxy.port());

    let mut conn = connect(&proxy.url(), LONG).await?;
    assert_eq!(ping(&mut conn).await?, "PONG");
    // Several chunks each way, byte for byte.
    let value: Vec<u8> = (0..3 * 1024 * 1024 + 7).map(|i| (i * 31 % 251) as u8).collect();
    redis::cmd("SET")
        .arg("big")
        .arg(&value)
        .query_async::<()>(&mut conn)
        .await?;
    let back: Vec<u8> = redis::cmd("GET").arg("big").query_async(&mut conn).await?;
    assert!(back == value, "the value came back intact");

    assert_eq!(proxy.connections_accepted(), 1);
    assert_eq!(proxy.live_connections(), 1);
    drop(conn);
    proxy.wait_live_connections(0, LONG).await?;
    assert_eq!(proxy.connections_accepted(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_delays_both_directions() -> Result<()> {
    let _time = real_time().await;
    let (_server, proxy) = start()?;
    let mut conn = connect(&proxy.url(), LONG).await?;
    assert_eq!(ping(&mut conn).await?, "PONG");

    let latency = Duration::from_millis(150);
    proxy.set_latency(latency);
    assert_eq!(proxy.latency(), latency);
    let started = Instant::now();
    assert_eq!(ping(&mut conn).await?, "PONG");
    let took = started.elapsed();
    assert!(
        took >= 2 * latency,
        "a round trip took {took:?}, under twice {latency:?}"
    );

    proxy.heal();
    assert_eq!(proxy.latency(), Duration::ZERO);
    assert_eq!(ping(&mut conn).await?, "PONG");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackhole_swallows_everything_until_lifted() -> Result<()> {
    let _time = real_time().await;
    let (_server, proxy) = start()?;
    let mut conn = connect(&proxy.url(), SHORT).await?;
    assert_eq!(ping(&mut conn).await?, "PONG");

    proxy.blackhole(true);
    let started = Instant::now();
    let err = ping(&mut conn).await.expect_err("nothing answers in a blackhole");
    assert!(err.is_timeout(), "a timeout, not {err:?}");
    assert!(started.elapsed() >= SHORT);
    // New connections are accepted, then hear nothing either.
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(SHORT))
        .set_response_timeout(Some(SHORT));
    let fresh = async {
        let mut conn = redis::Client::open(proxy.url())?
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        ping(&mut conn).await
    };
    assert!(tokio::time::timeout(LONG, fresh).await?.is_err());
    assert_eq!(proxy.connections_accepted(), 2);
    assert!(proxy.live_connections() >= 1, "the old connection is held open");

    proxy.heal();
    let mut conn = connect(&proxy.url(), LONG).await?;
    assert_eq!(ping(&mut conn).await?, "PONG");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_strands_old_connections_only() -> Result<()> {
    let _time = real_time().await;
    let (_server, proxy) = start()?;
    let mut old = connect(&proxy.url(), SHORT).await?;
    assert_eq!(ping(&mut old).await?, "PONG");

    assert_eq!(proxy.half_open(), 1);
    let err = ping(&mut old).await.expect_err("the peer is gone");
    assert!(err.is_timeout(), "a timeout, not {err:?}");

    let mut new = connect(&proxy.url(), LONG).await?;
    assert_eq!(ping(&mut new).await?, "PONG");
    // The old connection was never closed.
    assert_eq!(proxy.live_connections(), 2);
    let infos = proxy.connections();
    assert!(infos[0].half_open && !infos[1].half_open, "{infos:?}");
    let err = ping(&mut old).await.expect_err("still gone");
    assert!(err.is_timeout(), "still a timeout, not {err:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_all_breaks_old_connections_at_once() -> Result<()> {
    let (_server, proxy) = start()?;
    // A long response timeout: the error must come from the reset, not from waiting.
    let mut old = connect(&proxy.url(), LONG).await?;
    assert_eq!(ping(&mut old).await?, "PONG");

    assert_eq!(proxy.reset_all(), 1);
    assert_eq!(proxy.live_connections(), 0);
    let err = tokio::time::timeout(LONG, ping(&mut old))
        .await?
        .expect_err("the connection was reset");
    assert!(!err.is_timeout(), "an error, not a timeout: {err:?}");

    let mut new = connect(&proxy.url(), LONG).await?;
    assert_eq!(ping(&mut new).await?, "PONG");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuse_turns_new_connections_away() -> Result<()> {
    let (_server, proxy) = start()?;
    let mut old = connect(&proxy.url(), LONG).await?;

    proxy.refuse(true);
    let fresh = async {
        let mut conn = connect(&proxy.url(), LONG).await?;
        ping(&mut conn).await
    };
    let refused = tokio::time::timeout(LONG, fresh).await?;
    ensure!(refused.is_err(), "a new connection was served: {refused:?}");
    assert!(proxy.connections_refused() >= 1);
    assert_eq!(proxy.connections_accepted(), 1);
    assert_eq!(
        ping(&mut old).await?,
        "PONG",
        "existing connections are untouched"
    );

    proxy.heal();
    let mut new = connect(&proxy.url(), LONG).await?;
    assert_eq!(ping(&mut new).await?, "PONG");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_subscribers_kills_only_the_subscription() -> Result<()> {
    let (_server, proxy) = start()?;
    let client = redis::Client::open(proxy.url())?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe("news").await?;
    let mut messages = pubsub.into_on_message();
    let mut conn = connect(&proxy.url(), LONG).await?;
    // The word in a key or a value does not make a subscriber.
    redis::cmd("SET")
        .arg("SUBSCRIBE")
        .arg("subscribe")
        .query_async::<()>(&mut conn)
        .await?;
    let receivers: u64 = redis::cmd("PUBLISH")
        .arg("news")
        .arg("first")
        .query_async(&mut conn)
        .await?;
    assert_eq!(receivers, 1);
    let msg = tokio::time::timeout(LONG, messages.next())
        .await?
        .expect("a message");
    assert_eq!(msg.get_payload::<String>()?, "first");

    let subscribers: Vec<_> = proxy.connections().into_iter().filter(|c| c.subscriber).collect();
    assert_eq!(subscribers.len(), 1, "{:?}", proxy.connections());
    assert_eq!(proxy.drop_subscribers(), 1);
    assert_eq!(proxy.live_connections(), 1);
    let end = tokio::time::timeout(LONG, messages.next()).await?;
    assert!(end.is_none(), "the stream ended, not {end:?}");
    assert_eq!(ping(&mut conn).await?, "PONG", "the command connection lives");
    let value: String = redis::cmd("GET").arg("SUBSCRIBE").query_async(&mut conn).await?;
    assert_eq!(value, "subscribe");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_proxy_closes_everything() -> Result<()> {
    let (_server, proxy) = start()?;
    let url = proxy.url();
    let mut old = connect(&url, LONG).await?;
    assert_eq!(ping(&mut old).await?, "PONG");

    drop(proxy);
    let err = tokio::time::timeout(LONG, ping(&mut old))
        .await?
        .expect_err("the proxy is gone");
    assert!(!err.is_timeout(), "an error, not a timeout: {err:?}");
    let fresh = tokio::time::timeout(LONG, connect(&url, LONG)).await?;
    assert!(fresh.is_err(), "nothing listens any more");
    Ok(())
}
