//! Sliding entries on a store that keeps their expiry moment in its own TTL (contract
//! §3.1): a read slides them with one `GETEX`, no script, and every reader, on either
//! kind of clock, follows what each entry says.
//!
//! These run on the system clock against a real redis-server; instead of waiting for
//! time to pass they move the store's TTL (`PEXPIRE`) and check that a read puts it
//! back where the contract says.

use std::time::Duration;

use anyhow::Result;
use corral::{Corral, EntryOptions, ManualClock};
use corral_tests::{RedisServer, command_calls};

const MIN: Duration = Duration::from_secs(60);

async fn raw(server: &RedisServer, args: &[&str]) -> Result<redis::Value> {
    let mut conn = server.connection().await?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    Ok(cmd.query_async(&mut conn).await?)
}

async fn pttl(server: &RedisServer, name: &str) -> Result<i64> {
    let mut conn = server.connection().await?;
    Ok(redis::cmd("PTTL").arg(name).query_async(&mut conn).await?)
}

/// A cache on the system clock with no L1, so every read goes to Redis.
fn cache(server: &RedisServer) -> Result<Corral> {
    Ok(Corral::builder().redis(server.url()).l1_capacity(0).build()?)
}

#[tokio::test]
async fn a_sliding_read_on_the_system_clock_is_one_getex_and_no_script() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = cache(&server)?;
    cache.set("k", "v", EntryOptions::new().sliding(MIN)).await?;
    let name = cache.entry_name("k")?;
    let stored: Vec<u8> = redis::cmd("GET")
        .arg(&name)
        .query_async(&mut server.connection().await?)
        .await?;
    assert_eq!(&stored[..4], b"CRL\x02", "the store keeps the moment");
    assert!(
        pttl(&server, &name).await? > 50_000,
        "set with the sliding interval, no grace"
    );

    // As if 59.5 s had passed unread.
    raw(&server, &["PEXPIRE", &name, "500"]).await?;
    assert!(cache.refresh("k").await?);
    assert!(pttl(&server, &name).await? > 50_000, "the first read slid it");

    let (getex, scripts) = (
        command_calls(&server, "getex").await?,
        command_calls(&server, "evalsha").await?,
    );
    for _ in 0..10 {
        raw(&server, &["PEXPIRE", &name, "500"]).await?;
        assert_eq!(cache.get("k").await?.as_deref(), Some(&b"v"[..]));
        assert!(pttl(&server, &name).await? > 50_000, "every read slides it");
    }
    assert_eq!(
        command_calls(&server, "getex").await? - getex,
        10,
        "one GETEX per read"
    );
    assert_eq!(
        command_calls(&server, "evalsha").await? - scripts,
        0,
        "and no script"
    );
    let after: Vec<u8> = redis::cmd("GET")
        .arg(&name)
        .query_async(&mut server.connection().await?)
        .await?;
    assert_eq!(after, stored, "sliding never rewrites the bytes");
    Ok(())
}

#[tokio::test]
async fn a_store_kept_slide_stops_at_the_absolute_point() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = cache(&server)?;
    let options = EntryOptions::new().relative(Duration::from_secs(5)).sliding(MIN);
    cache.set("k", "v", options).await?;
    let name = cache.entry_name("k")?;
    let ttl = pttl(&server, &name).await?;
    assert!((1..=5_000).contains(&ttl), "capped at the absolute point: {ttl}");
    for _ in 0..2 {
        assert!(cache.refresh("k").await?);
        let ttl = pttl(&server, &name).await?;
        assert!((1..=5_000).contains(&ttl), "a read never slides past it: {ttl}");
    }
    Ok(())
}

#[tokio::test]
async fn a_read_that_guessed_wrong_puts_the_ttl_right() -> Result<()> {
    let server = RedisServer::start()?;
    let reader = cache(&server)?;
    let writer = cache(&server)?;
    writer
        .set("k", "sliding", EntryOptions::new().sliding(MIN))
        .await?;
    assert!(reader.refresh("k").await?, "the reader learns k slides by 60 s");
    let name = reader.entry_name("k")?;

    // Another process puts an entry of another kind there: the reader's next read
    // still slides by the old guess, and must undo it.
    writer
        .set("k", "fixed", EntryOptions::new().relative(MIN * 60))
        .await?;
    let getex = command_calls(&server, "getex").await?;
    assert_eq!(reader.get("k").await?.as_deref(), Some(&b"fixed"[..]));
    assert_eq!(
        command_calls(&server, "getex").await? - getex,
        1,
        "read by the stale guess"
    );
    let ttl = pttl(&server, &name).await?;
    assert!(
        ttl > 3_500_000,
        "the hour-long entry keeps its hour, not 60 s: {ttl}"
    );

    // A removal's tombstone read by the guess gets a removal's TTL back (the flight
    // lock's 30 s and a second of grace), so it refuses exactly the fills it was written
    // to refuse (contract §5.12), no longer.
    writer
        .set("k", "sliding", EntryOptions::new().sliding(MIN * 10))
        .await?;
    assert!(reader.refresh("k").await?);
    assert!(writer.remove("k").await?);
    assert_eq!(reader.get("k").await?, None);
    let ttl = pttl(&server, &name).await?;
    assert!(
        (20_000..=31_000).contains(&ttl),
        "a removal's TTL again, not 10 min: {ttl} ms"
    );
    Ok(())
}

#[tokio::test]
async fn a_guess_never_cuts_a_tombstone_short() -> Result<()> {
    // A key that slides by less than a removal's TTL is never read with GETEX: a stale
    // guess could otherwise leave a tombstone with a second to live if its fix-up never
    // ran (the process died, the store failed), and a load that began before the
    // removal could then fill over it.
    let server = RedisServer::start()?;
    let reader = cache(&server)?;
    let writer = cache(&server)?;
    writer
        .set("k", "v", EntryOptions::new().sliding(Duration::from_secs(1)))
        .await?;
    let getex = command_calls(&server, "getex").await?;
    for _ in 0..3 {
        assert!(reader.refresh("k").await?);
    }
    assert_eq!(
        command_calls(&server, "getex").await? - getex,
        0,
        "GET and a compare-and-expire"
    );
    assert!(writer.remove("k").await?);
    assert_eq!(reader.get("k").await?, None);
    let ttl = pttl(&server, &reader.entry_name("k")?).await?;
    assert!(ttl > 20_000, "the tombstone keeps a removal's TTL: {ttl} ms");
    Ok(())
}

#[tokio::test]
async fn processes_on_either_clock_share_a_store() -> Result<()> {
    let server = RedisServer::start()?;
    let real = cache(&server)?;
    let manual = Corral::builder()
        .redis(server.url())
        .clock(ManualClock::starting_now())
        .l1_capacity(0)
        .build()?;

    // Written on the system clock: the store keeps the moment, and a reader on a manual
    // clock slides the store's TTL too.
    real.set("a", "1", EntryOptions::new().sliding(MIN)).await?;
    let a = real.entry_name("a")?;
    raw(&server, &["PEXPIRE", &a, "500"]).await?;
    assert_eq!(manual.get("a").await?.as_deref(), Some(&b"1"[..]));
    assert!(pttl(&server, &a).await? > 50_000);

    // Written on a manual clock: the envelope keeps the moment; a reader on the system
    // clock slides it there (the script), never by GETEX.
    manual.set("b", "2", EntryOptions::new().sliding(MIN)).await?;
    let b = manual.entry_name("b")?;
    let stored: Vec<u8> = redis::cmd("GET")
        .arg(&b)
        .query_async(&mut server.connection().await?)
        .await?;
    assert_eq!(&stored[..4], b"CRL\x01");
    let (getex, scripts) = (
        command_calls(&server, "getex").await?,
        command_calls(&server, "evalsha").await?,
    );
    for _ in 0..3 {
        assert_eq!(real.get("b").await?.as_deref(), Some(&b"2"[..]));
    }
    assert_eq!(command_calls(&server, "getex").await?, getex, "never by GETEX");
    assert!(
        command_calls(&server, "evalsha").await? > scripts,
        "but by the script"
    );
    Ok(())
}

#[tokio::test]
async fn a_cache_told_not_to_keeps_the_moment_in_the_envelope() -> Result<()> {
    // For a rolling upgrade: processes that predate version-2 envelopes take them for
    // corrupt entries, so the new ones write version 1 until the old ones are gone.
    let server = RedisServer::start()?;
    let cache = Corral::builder()
        .redis(server.url())
        .sliding_in_store(false)
        .l1_capacity(0)
        .build()?;
    cache.set("k", "v", EntryOptions::new().sliding(MIN)).await?;
    let stored: Vec<u8> = redis::cmd("GET")
        .arg(cache.entry_name("k")?)
        .query_async(&mut server.connection().await?)
        .await?;
    assert_eq!(&stored[..4], b"CRL\x01");
    Ok(())
}
