//! The subscription that carries landings and invalidations, against a real
//! `redis-server` reached through a wire whose health `PING`s can be made to hang.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use corral::{Corral, EntryOptions, RedisOptions};
use corral_tests::RedisServer;
use corral_tests::wire::RealWire;

/// Waits (up to 10 s) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        ensure!(Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// A message that arrives while the subscription's health `PING` waits for its answer
/// is heard at once, not once the ping is answered or given up (up to the response
/// timeout, 30 s here): another process's write drops this process's L1 copy while the
/// ping still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_is_heard_while_a_health_ping_waits() -> Result<()> {
    let server = RedisServer::start()?;
    let wire = RealWire::connect(&server.url()).await?;
    let (hang, pending) = (wire.hang.clone(), wire.pending.clone());
    let mut options = RedisOptions::new(server.url());
    options.response_timeout = Duration::from_secs(30);
    let b = Corral::builder()
        .redis_options(options)
        .redis_wire(Arc::new(wire))
        .build()?;
    let a = Corral::builder().redis(server.url()).build()?;
    // b listens once it hears a's announcements.
    corral_tests::until_a_hears_b(&b, &a, "listening").await?;
    a.set("k", "old", EntryOptions::new()).await?;
    assert_eq!(b.get("k").await?.as_deref(), Some(&b"old"[..]));
    hang.store(true, Ordering::SeqCst);
    until("a health ping hangs", || pending.load(Ordering::SeqCst) > 0).await?;
    let heard = b.metrics().l1_invalidations;
    a.set("k", "new", EntryOptions::new()).await?;
    until("b hears the write", || b.metrics().l1_invalidations > heard).await?;
    assert!(
        pending.load(Ordering::SeqCst) > 0,
        "heard only once the ping was given up"
    );
    assert_eq!(b.get("k").await?.as_deref(), Some(&b"new"[..]));
    Ok(())
}
