//! Reads that reach a Redis-backed cache together go out together: named in one guest
//! call, read in one request, judged in one more. Every caller still gets its own key's
//! answer and its own error, and sees every write that ended before it called.

use std::pin::pin;
use std::time::Duration;

use anyhow::{Result, ensure};
use corral::{EntryOptions, ErrorKind};
use corral_tests::{Backend, Fixture, command_calls};

const HOUR: Duration = Duration::from_secs(3600);

/// A Redis-backed cache with L1 off: every `get` reads L2.
fn l2_only() -> Result<Fixture> {
    Fixture::with(Backend::Redis, |b| b.l1_capacity(0))
}

#[tokio::test]
async fn gets_that_arrive_together_go_out_in_one_request_each_with_its_own_answer() -> Result<()> {
    let f = l2_only()?;
    let server = f.redis.as_ref().expect("redis");
    for i in 0..64 {
        let options = match i % 3 {
            0 => EntryOptions::new().sliding(HOUR),
            _ => EntryOptions::new().relative(HOUR),
        };
        f.cache.set(&format!("key-{i}"), format!("v{i}"), options).await?;
    }
    // Asked for twice, and a key with nothing under it.
    let keys: Vec<String> = (0..64)
        .map(|i| format!("key-{i}"))
        .chain(["key-7".to_owned(), "absent".to_owned()])
        .collect();
    let mget = command_calls(server, "mget").await?;
    let found = futures::future::join_all(keys.iter().map(|k| f.cache.get(k))).await;
    for (key, found) in keys.iter().zip(found) {
        let expected = key.strip_prefix("key-").map(|i| format!("v{i}"));
        ensure!(
            found?.as_deref() == expected.as_deref().map(str::as_bytes),
            "{key} got its own answer"
        );
    }
    // The first found nothing else under way and went at once, with a GET.
    ensure!(
        command_calls(server, "mget").await? - mget == 1,
        "the 65 reads arriving behind it went out as one MGET"
    );
    Ok(())
}

#[tokio::test]
async fn a_bad_key_among_gathered_reads_fails_alone_with_the_error_it_gets_alone() -> Result<()> {
    let f = l2_only()?;
    f.cache.set("a", "1", EntryOptions::new()).await?;
    f.cache.set("b", "2", EntryOptions::new()).await?;
    let alone = f.cache.get(" ").await.expect_err("a blank key is refused");
    let (a, bad, b) = tokio::join!(f.cache.get("a"), f.cache.get(" "), f.cache.get("b"));
    let bad = bad.expect_err("refused when gathered too");
    ensure!(bad.kind() == ErrorKind::InvalidArgument && bad.to_string() == alone.to_string());
    ensure!(a?.as_deref() == Some(&b"1"[..]) && b?.as_deref() == Some(&b"2"[..]));
    Ok(())
}

#[tokio::test]
async fn a_leader_dropped_while_gathering_leaves_its_followers_to_read_alone() -> Result<()> {
    let f = l2_only()?;
    f.cache.set("a", "1", EntryOptions::new()).await?;
    f.cache.set("b", "2", EntryOptions::new()).await?;
    let mut leader = Box::pin(f.cache.get("a"));
    ensure!(
        futures::poll!(&mut leader).is_pending(),
        "the first read leads and yields"
    );
    let mut follower = pin!(f.cache.get("b"));
    ensure!(futures::poll!(&mut follower).is_pending(), "the second joins it");
    drop(leader);
    let got = tokio::time::timeout(Duration::from_secs(5), follower).await?;
    ensure!(got?.as_deref() == Some(&b"2"[..]), "the follower read alone");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_gathered_caller_sees_its_own_last_write() -> Result<()> {
    let f = l2_only()?;
    let cache = f.cache.clone();
    let writers = (0..32).map(|w| {
        let cache = cache.clone();
        tokio::spawn(async move {
            let key = format!("writer-{w}");
            for n in 0..40u32 {
                cache.set(&key, n.to_string(), EntryOptions::new()).await?;
                let got = cache.get(&key).await?;
                ensure!(
                    got.as_deref() == Some(n.to_string().as_bytes()),
                    "{key}: wrote {n}, read {got:?}"
                );
            }
            anyhow::Ok(())
        })
    });
    // Readers of one hot key, gathered with the writers' reads.
    cache.set("hot", "h", EntryOptions::new().relative(HOUR)).await?;
    let readers = (0..16).map(|_| {
        let cache = cache.clone();
        tokio::spawn(async move {
            for _ in 0..40 {
                ensure!(cache.get("hot").await?.as_deref() == Some(&b"h"[..]));
            }
            anyhow::Ok(())
        })
    });
    for task in writers.chain(readers).collect::<Vec<_>>() {
        task.await??;
    }
    Ok(())
}

#[tokio::test]
async fn reads_of_one_sliding_key_that_arrive_together_cost_one_getex() -> Result<()> {
    // A real clock: a sliding entry's moment is the store's TTL, read with `GETEX`.
    let server = corral_tests::RedisServer::start()?;
    let cache = corral::Corral::builder()
        .redis(server.url())
        .l1_capacity(0)
        .build()?;
    cache.set("s", "v", EntryOptions::new().sliding(HOUR)).await?;
    cache.set("other", "w", EntryOptions::new().sliding(HOUR)).await?;
    // The first reads learn that the keys slide.
    cache.get("s").await?;
    cache.get("other").await?;
    let getex = command_calls(&server, "getex").await?;
    let keys: Vec<&str> = std::iter::repeat_n("s", 32).chain(["other"]).collect();
    let found = futures::future::join_all(keys.iter().map(|k| cache.get(k))).await;
    for (key, found) in keys.iter().zip(found) {
        let expected: &[u8] = if *key == "s" { b"v" } else { b"w" };
        ensure!(found?.as_deref() == Some(expected), "{key} got its own value");
    }
    // The first found nothing else under way and went at once; the others went out
    // together, one GETEX per key (a leader polled after one of its followers loses
    // its gathering to it, and reads alone: one more).
    let sent = command_calls(&server, "getex").await? - getex;
    ensure!(
        (3..=4).contains(&sent),
        "33 reads of two sliding keys sent {sent} GETEX"
    );
    Ok(())
}

#[tokio::test]
async fn a_read_never_waits_on_a_leader_set_aside() -> Result<()> {
    let f = l2_only()?;
    f.cache.set("a", "1", EntryOptions::new()).await?;
    f.cache.set("b", "2", EntryOptions::new()).await?;
    let mut busy = pin!(f.cache.get("a"));
    ensure!(futures::poll!(&mut busy).is_pending(), "a read on its way");
    // A leader polled once, then set aside (a future waiting in a `select!`).
    let mut set_aside = pin!(f.cache.get("a"));
    ensure!(futures::poll!(&mut set_aside).is_pending(), "leads and yields");
    let started = std::time::Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(5), f.cache.get("b")).await?;
    ensure!(got?.as_deref() == Some(&b"2"[..]));
    ensure!(
        started.elapsed() < Duration::from_millis(500),
        "took the gathering over instead of waiting a store timeout: {:?}",
        started.elapsed()
    );
    ensure!(set_aside.await?.as_deref() == Some(&b"1"[..]));
    ensure!(busy.await?.as_deref() == Some(&b"1"[..]));
    Ok(())
}

#[tokio::test]
async fn a_gathered_get_after_a_clear_never_reads_the_generation_before_it() -> Result<()> {
    let server = corral_tests::RedisServer::start()?;
    let cache = || {
        corral::Corral::builder()
            .redis(server.url())
            .l1_capacity(0)
            .build()
    };
    let before = cache()?;
    for key in ["k", "x"] {
        before.set(key, "old", EntryOptions::new().relative(HOUR)).await?;
    }
    before.clear().await?;
    // The generation can no longer be read (a value of another type in its place); the
    // entries named before the clear are still there.
    let generation = corral_core::names::generation(before.prefix());
    let mut conn = server.connection().await?;
    redis::cmd("DEL")
        .arg(&generation)
        .query_async::<()>(&mut conn)
        .await?;
    redis::cmd("LPUSH")
        .arg(&generation)
        .arg("x")
        .query_async::<()>(&mut conn)
        .await?;
    let after = cache()?;
    let alone = after.get("k").await;
    let (busy, k, x) = tokio::join!(after.get("k"), after.get("k"), after.get("x"));
    for found in [alone, busy, k, x] {
        ensure!(
            !matches!(&found, Ok(Some(v)) if &v[..] == b"old"),
            "a read after the clear served the entry before it: {found:?}"
        );
    }
    Ok(())
}

/// On a cluster too: reads of a slot that arrive together go out together, in one
/// pipeline (a cluster's pipeline stays on one node), each with its own answer, and one
/// key read by many is sent once; reads of other slots go alone.
#[tokio::test]
async fn on_a_cluster_reads_that_arrive_together_go_out_per_slot_each_with_its_own_answer() -> Result<()> {
    let keys: Vec<String> = (0..12).map(|i| format!("k{i}")).collect();
    let cluster = corral_tests::RedisCluster::start(3, 0, Duration::from_secs(5))?;
    let cache = corral::Corral::builder()
        .redis_cluster(cluster.urls())
        .l1_capacity(0)
        .build()?;
    for key in &keys {
        cache
            .set(key, key.clone(), EntryOptions::new().sliding(HOUR))
            .await?;
        // The first read learns that the key slides.
        cache.get(key).await?;
    }
    let store = cache.redis_store().expect("a Redis store");
    let sent = store.commands_sent();
    let asked: Vec<&str> = std::iter::repeat_n("k0", 32)
        .chain(keys.iter().map(String::as_str))
        .collect();
    let found = futures::future::join_all(asked.iter().map(|k| cache.get(k))).await;
    for (key, found) in asked.iter().zip(found) {
        ensure!(
            found?.as_deref() == Some(key.as_bytes()),
            "{key} got its own value"
        );
    }
    // 44 reads of 12 keys: the first read goes alone (nothing else under way), the
    // second leads k0's 32 other reads in one pipeline, and the other 11 keys, each in
    // a slot of its own, go alone; one more if a leader polled after one of its
    // followers loses its gathering to it, and reads alone.
    let sent = store.commands_sent() - sent;
    ensure!(
        (13..=14).contains(&sent),
        "44 reads of 12 sliding keys on a cluster sent {sent} commands"
    );
    Ok(())
}
