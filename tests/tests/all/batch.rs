//! Bulk get-or-set (`get_or_set_many`): many keys, one load each, however the callers'
//! keys overlap, in one process and across processes; one round trip for L2 hits.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use corral::{Clock, Corral, EntryOptions, ErrorKind, LoadOptions, RedisOptions};
use corral_tests::wire::{Gate, RealWire};
use corral_tests::{Backend, Fixture, PREFIX, RedisServer, command_calls, real_time, stampedes_at_a_barrier};
use tokio::sync::Notify;

fn relative() -> LoadOptions {
    EntryOptions::new().relative(Duration::from_secs(60)).into()
}

fn named(range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("k{i}")).collect()
}

/// What a loader was asked for, call by call.
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<Vec<Vec<String>>>>);

impl Calls {
    fn note(&self, keys: &[String]) {
        self.0.lock().unwrap().push(keys.to_vec());
    }

    fn all(&self) -> Vec<Vec<String>> {
        self.0.lock().unwrap().clone()
    }

    /// How many times each key was loaded.
    fn per_key(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for key in self.all().into_iter().flatten() {
            *counts.entry(key).or_default() += 1;
        }
        counts
    }
}

/// What a test's batch loader answers: a value per key it found.
type Loaded<E, T = String> = Result<Vec<(String, T)>, E>;

/// A loader that answers `value:<key>` for every key, noting its calls.
fn answering(calls: &Calls) -> impl Fn(Vec<String>) -> std::future::Ready<Loaded<std::io::Error>> {
    answering_by(calls, |k| Some(format!("value:{k}")))
}

/// A loader that answers `value(key)` for every key it finds a value for (`None`: left
/// out), noting its calls.
fn answering_by<T>(
    calls: &Calls,
    value: fn(&str) -> Option<T>,
) -> impl Fn(Vec<String>) -> std::future::Ready<Loaded<std::io::Error, T>> + use<T> {
    let calls = calls.clone();
    move |keys| {
        calls.note(&keys);
        std::future::ready(Ok(keys
            .into_iter()
            .filter_map(|k| value(&k).map(|v| (k, v)))
            .collect()))
    }
}

fn values(answers: Vec<corral::Result<Option<Bytes>>>) -> Result<Vec<Option<String>>> {
    answers
        .into_iter()
        .map(|a| Ok(a?.map(|b| String::from_utf8_lossy(&b).into_owned())))
        .collect()
}

/// What a batch answers.
type Answers = corral::Result<Vec<corral::Result<Option<Bytes>>>>;

/// A batch of `keys` in a task of its own, held at its loader: returns once the loader
/// was called, with the batch's task and the gate that lets the loader answer
/// `answer(keys)`.
async fn held_batch<E>(
    cache: &Corral,
    keys: &'static [&'static str],
    answer: fn(Vec<String>) -> Loaded<E>,
) -> (tokio::task::JoinHandle<Answers>, Arc<Notify>)
where
    E: std::error::Error + Send + Sync + 'static,
{
    let (loading, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let batch = {
        let (cache, loading, release) = (cache.clone(), loading.clone(), release.clone());
        tokio::spawn(async move {
            cache
                .get_or_set_many(keys, relative(), |keys: Vec<String>| {
                    let (loading, release) = (loading.clone(), release.clone());
                    async move {
                        loading.notify_one();
                        release.notified().await;
                        answer(keys)
                    }
                })
                .await
        })
    };
    loading.notified().await;
    (batch, release)
}

async fn overlapping_callers_load_each_key_once(backend: Backend) -> Result<()> {
    let f = Fixture::new(backend)?;
    let calls = Calls::default();
    let mut tasks = tokio::task::JoinSet::new();
    for caller in 0..60 {
        // Windows of 10 of 40 keys, each overlapping its neighbours'.
        let keys: Vec<String> = (0..10).map(|i| format!("k{}", (caller * 3 + i) % 40)).collect();
        let (cache, calls) = (f.cache.clone(), calls.clone());
        tasks.spawn(async move {
            let answers = cache
                .get_or_set_many(&keys, relative(), |asked: Vec<String>| {
                    calls.note(&asked);
                    async move {
                        tokio::task::yield_now().await;
                        let found: HashMap<String, String> = asked
                            .into_iter()
                            .map(|k| (k.clone(), format!("value:{k}")))
                            .collect();
                        Ok::<_, std::io::Error>(found)
                    }
                })
                .await?;
            anyhow::Ok((keys, values(answers)?))
        });
    }
    while let Some(done) = tasks.join_next().await {
        let (keys, values) = done??;
        for (key, value) in keys.iter().zip(values) {
            assert_eq!(value.as_deref(), Some(format!("value:{key}").as_str()));
        }
    }
    let per_key = calls.per_key();
    assert_eq!(per_key.len(), 40, "every key loaded: {per_key:?}");
    assert!(
        per_key.values().all(|&n| n == 1),
        "each key loaded once: {per_key:?}"
    );
    assert_eq!(f.cache.flights_in_progress(), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_callers_load_each_key_once_memory() -> Result<()> {
    overlapping_callers_load_each_key_once(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_callers_load_each_key_once_redis() -> Result<()> {
    overlapping_callers_load_each_key_once(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_callers_load_each_key_once_cluster() -> Result<()> {
    overlapping_callers_load_each_key_once(Backend::Cluster).await
}

/// A caller asking for {a, b} while another leads {b, c} waits for b and leads a.
async fn a_caller_waits_for_the_keys_another_leads(backend: Backend) -> Result<()> {
    let f = Fixture::new(backend)?;
    let (first, release) = held_batch(&f.cache, &["b", "c"], |keys| {
        Ok::<_, std::io::Error>(
            keys.into_iter()
                .map(|k| (k.clone(), format!("first:{k}")))
                .collect(),
        )
    })
    .await;
    let calls = Calls::default();
    let second = {
        let (cache, calls) = (f.cache.clone(), calls.clone());
        tokio::spawn(async move {
            cache
                .get_or_set_many(["a", "b"], relative(), answering(&calls))
                .await
        })
    };
    // b is joined before a's load is made: once the loader ran, b waits on the first.
    while calls.all().is_empty() {
        tokio::task::yield_now().await;
    }
    assert_eq!(f.cache.followers_of("b"), 1, "the second caller waits for b");
    release.notify_one();
    let second = values(second.await??)?;
    assert_eq!(second, [Some("value:a".into()), Some("first:b".into())]);
    assert_eq!(
        calls.all(),
        [["a".to_string()]],
        "the second caller loaded a only"
    );
    assert_eq!(
        values(first.await??)?,
        [Some("first:b".into()), Some("first:c".into())]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_waits_for_the_keys_another_leads_memory() -> Result<()> {
    a_caller_waits_for_the_keys_another_leads(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_waits_for_the_keys_another_leads_redis() -> Result<()> {
    a_caller_waits_for_the_keys_another_leads(Backend::Redis).await
}

async fn keys_the_loader_leaves_out_are_absent_and_not_cached(backend: Backend) -> Result<()> {
    let f = Fixture::new(backend)?;
    let keys = named(0..6);
    let calls = Calls::default();
    let evens = |calls: &Calls| {
        let calls = calls.clone();
        move |asked: Vec<String>| {
            calls.note(&asked);
            let found: Vec<(String, &'static str)> = asked
                .into_iter()
                .filter(|k| k.trim_start_matches('k').parse::<u32>().unwrap() % 2 == 0)
                .map(|k| (k, "found"))
                .collect();
            std::future::ready(Ok::<_, std::io::Error>(found))
        }
    };
    let answers = values(f.cache.get_or_set_many(&keys, relative(), evens(&calls)).await?)?;
    let found = Some("found".to_string());
    assert_eq!(
        answers,
        [found.clone(), None, found.clone(), None, found.clone(), None]
    );
    assert_eq!(
        calls.all(),
        std::slice::from_ref(&keys),
        "one loader call for the six"
    );
    // The absent keys were not cached: asked again, they are loaded again, alone.
    let answers = values(f.cache.get_or_set_many(&keys, relative(), evens(&calls)).await?)?;
    assert_eq!(answers[1], None);
    assert_eq!(calls.all()[1], ["k1", "k3", "k5"]);
    for key in ["k1", "k3", "k5"] {
        assert!(!f.stored(key).await?, "{key} is not stored");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_the_loader_leaves_out_are_absent_and_not_cached_memory() -> Result<()> {
    keys_the_loader_leaves_out_are_absent_and_not_cached(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_the_loader_leaves_out_are_absent_and_not_cached_redis() -> Result<()> {
    keys_the_loader_leaves_out_are_absent_and_not_cached(Backend::Redis).await
}

#[derive(Debug)]
struct Down(u32);

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "database {} is down", self.0)
    }
}

impl std::error::Error for Down {}

async fn a_loader_error_is_every_led_keys_error(backend: Backend) -> Result<()> {
    let f = Fixture::new(backend)?;
    let (batch, release) = held_batch(&f.cache, &["a", "b"], |_| Err(Down(7))).await;
    // A single-key caller of b joins the batch's flight and gets its error too.
    let single = {
        let cache = f.cache.clone();
        tokio::spawn(async move {
            cache
                .get_or_set("b", relative(), || async { Ok::<_, std::io::Error>("never") })
                .await
        })
    };
    while f.cache.followers_of("b") == 0 {
        tokio::task::yield_now().await;
    }
    release.notify_one();
    for answer in batch.await??.into_iter().chain([single.await?.map(Some)]) {
        let e = answer.expect_err("the loader failed");
        assert_eq!(e.kind(), ErrorKind::Loader, "{e}");
        assert_eq!(e.loader_error::<Down>().map(|d| d.0), Some(7), "{e:?}");
        assert_eq!(e.to_string(), "loader failed: database 7 is down");
    }
    assert_eq!(f.cache.get("a").await?, None, "nothing cached");
    assert_eq!(f.cache.flights_in_progress(), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_error_is_every_led_keys_error_memory() -> Result<()> {
    a_loader_error_is_every_led_keys_error(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_error_is_every_led_keys_error_redis() -> Result<()> {
    a_loader_error_is_every_led_keys_error(Backend::Redis).await
}

/// A key removed while its batch loads keeps the removal: the load is returned to its
/// caller, but lands in neither tier (contract §5.12).
async fn a_key_removed_mid_batch_stays_removed(backend: Backend) -> Result<()> {
    let f = Fixture::new(backend)?;
    let (batch, release) = held_batch(&f.cache, &["a", "b"], |keys| {
        Ok::<_, std::io::Error>(keys.into_iter().map(|k| (k, "loaded".to_owned())).collect())
    })
    .await;
    f.cache.remove("b").await?;
    release.notify_one();
    let answers = values(batch.await??)?;
    assert_eq!(answers, [Some("loaded".into()), Some("loaded".into())]);
    assert!(f.stored("a").await?, "a landed");
    assert!(!f.stored("b").await?, "the removal of b wins over its load");
    assert_eq!(f.cache.get("b").await?, None, "nor is b in L1");
    assert_eq!(f.cache.metrics().fills_refused, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_removed_mid_batch_stays_removed_memory() -> Result<()> {
    a_key_removed_mid_batch_stays_removed(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_removed_mid_batch_stays_removed_redis() -> Result<()> {
    a_key_removed_mid_batch_stays_removed(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_batch_splits_the_loader_calls() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let calls = Calls::default();
    let keys = named(0..25);
    let answers = f
        .cache
        .get_or_set_many(&keys, relative().max_batch(10), answering(&calls))
        .await?;
    assert!(answers.iter().all(|a| matches!(a, Ok(Some(_)))));
    let mut sizes: Vec<usize> = calls.all().iter().map(Vec::len).collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [5, 10, 10]);
    assert_eq!(calls.per_key().len(), 25);
    // `loads` counts keys loaded, as 25 single-key loads would: not the 3 calls.
    assert_eq!(f.cache.metrics().loads, 25);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_are_named_before_anything_runs() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let calls = Calls::default();
    f.cache.set("ok", "cached", EntryOptions::new()).await?;
    let e = f
        .cache
        .get_or_set_many(["ok", "", "other"], relative(), answering(&calls))
        .await
        .expect_err("an empty key");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(e.argument(), Some("key"), "{e}");
    let e = f
        .cache
        .get_or_set_many(["ok"], relative().max_batch(0), answering(&calls))
        .await
        .expect_err("max_batch 0");
    assert_eq!(e.argument(), Some("max_batch"), "{e}");
    let e = f
        .cache
        .get_or_set_many(
            ["ok"],
            relative().soft_timeout(Duration::from_millis(10)),
            answering(&calls),
        )
        .await
        .expect_err("a soft timeout needs fetch");
    assert_eq!(e.argument(), Some("soft_timeout"), "{e}");
    assert!(calls.all().is_empty(), "no loader ran");
    // An empty batch is answered with nothing; a key asked twice is answered twice.
    let none: [&str; 0] = [];
    assert!(
        f.cache
            .get_or_set_many(none, relative(), answering(&calls))
            .await?
            .is_empty()
    );
    let twice = values(
        f.cache
            .get_or_set_many(["x", "x"], relative(), answering(&calls))
            .await?,
    )?;
    assert_eq!(twice, [Some("value:x".into()), Some("value:x".into())]);
    assert_eq!(calls.all(), [["x".to_string()]]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_l2_hits_cost_one_mget() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    let server = f.redis.as_ref().context("a redis fixture")?;
    let calls = Calls::default();
    let keys = named(0..100);
    f.cache
        .get_or_set_many(&keys, relative(), answering(&calls))
        .await?;
    // Another process: the same Redis and prefix, its L1 cold.
    let mut options = corral::RedisOptions::new(server.url());
    options.prefix = PREFIX.into();
    let reader = Corral::builder()
        .clock(f.clock.clone())
        .redis_options(options)
        .build()?;
    // Once it listens (its first subscription flushes L1 and forgets the generation),
    // it learns the generation: the batch below sends nothing else.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while reader.metrics().l1_flushes < 1 {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the reader never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reader.get("warm-up").await?;
    let count = |command: &'static str| command_calls(server, command);
    let before = [count("mget").await?, count("get").await?, count("evalsha").await?];
    let sent_before = reader.redis_commands_sent().context("a redis cache")?;
    let answers = values(
        reader
            .get_or_set_many(&keys, relative(), answering(&calls))
            .await?,
    )?;
    let after = [count("mget").await?, count("get").await?, count("evalsha").await?];
    assert!(
        answers
            .iter()
            .zip(&keys)
            .all(|(v, k)| v.as_deref() == Some(format!("value:{k}").as_str()))
    );
    assert_eq!(calls.all().len(), 1, "no load: all 100 were L2 hits");
    assert_eq!(
        [after[0] - before[0], after[1] - before[1], after[2] - before[2]],
        [1, 0, 0],
        "one MGET, no GET, no script"
    );
    assert_eq!(
        reader.redis_commands_sent().unwrap() - sent_before,
        1,
        "one command in all"
    );
    assert_eq!(reader.metrics().l2_hits, 100);
    Ok(())
}

/// A `should_cache` that panics fails its key as the key's loader panicking would (a
/// `Loader` error naming the panic), in a batch and for one key: the call returns, and
/// the batch's other keys are served and cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_should_cache_that_panics_fails_its_key_alone() -> Result<()> {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;
    let f = Fixture::new(Backend::Memory)?;
    let calls = Calls::default();
    let picky = || {
        relative().should_cache(|v| {
            assert!(v != b"value:b", "a predicate that cannot take b");
            true
        })
    };
    let answers = AssertUnwindSafe(f.cache.get_or_set_many(["a", "b"], picky(), answering(&calls)))
        .catch_unwind()
        .await
        .map_err(|_| anyhow::anyhow!("the predicate's panic escaped the batch"))??;
    assert_eq!(answers[0].as_ref().ok(), Some(&Some(Bytes::from("value:a"))));
    let e = answers[1].as_ref().expect_err("b's predicate panicked");
    assert_eq!(e.kind(), ErrorKind::Loader);
    assert!(
        e.to_string()
            .contains("should_cache panicked: a predicate that cannot take b"),
        "{e}"
    );
    // a was cached: asked again, it is not loaded again.
    f.cache.get_or_set_many(["a"], picky(), answering(&calls)).await?;
    assert_eq!(calls.all(), [vec!["a".to_string(), "b".to_string()]]);
    let one = AssertUnwindSafe(
        f.cache
            .get_or_set("b", picky(), || async { Ok::<_, std::io::Error>("value:b") }),
    )
    .catch_unwind()
    .await
    .map_err(|_| anyhow::anyhow!("the predicate's panic escaped the call"))?;
    assert_eq!(one.expect_err("b's predicate panicked").kind(), ErrorKind::Loader);
    Ok(())
}

/// A batch dropped while its loader runs (its caller cancelled): an in-process follower
/// of one of its keys leads in its place at once, the locks of its keys are released
/// (not left to their 30 s TTL), and nothing of it stays in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_batch_hands_its_keys_on_at_once() -> Result<()> {
    let _real_time = real_time().await;
    let f = Fixture::new(Backend::Redis)?;
    let (batch, _release) = held_batch(&f.cache, &["a", "b"], |keys| {
        Ok::<_, std::io::Error>(keys.into_iter().map(|k| (k, "from the batch".into())).collect())
    })
    .await;
    let follower = {
        let cache = f.cache.clone();
        tokio::spawn(async move {
            cache
                .get_or_set("a", relative(), || async {
                    Ok::<_, std::io::Error>("from the follower")
                })
                .await
        })
    };
    while f.cache.followers_of("a") < 1 {
        tokio::task::yield_now().await;
    }
    batch.abort();
    assert!(batch.await.unwrap_err().is_cancelled());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let led = tokio::time::timeout_at(deadline.into(), follower)
        .await
        .context("the follower still waits on the dropped batch")???;
    assert_eq!(led, Bytes::from("from the follower"));
    let server = f.redis.as_ref().context("a redis fixture")?;
    let mut conn = server.connection().await?;
    let lock = corral_core::names::name(f.cache.prefix(), "b", corral_core::names::Kind::FlightLock);
    // Released in the background, as the batch's flights were dropped.
    loop {
        let pttl: i64 = redis::cmd("PTTL").arg(&lock).query_async(&mut conn).await?;
        if pttl == -2 && f.cache.flights_in_progress() == 0 {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "b's lock still held ({pttl} ms left) or a flight still running"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let m = f.cache.metrics();
    assert_eq!((m.degraded, m.lock_timeouts), (0, 0));
    Ok(())
}

/// A batch of L1 hits waits on no store, as one get-or-set's L1 hit does not: once the
/// prefix's generation is no longer known (an L1 TTL after it was read), the batch reads
/// it again only for a key L1 does not hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_l1_hits_sends_nothing_once_the_generation_lapsed() -> Result<()> {
    let f = Fixture::with(Backend::Redis, |b| b.l1_ttl(Duration::from_secs(60)))?;
    // Its first subscription flushes L1 and forgets the generation: settled first.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while f.cache.metrics().l1_flushes < 1 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    f.cache.get("warm-up").await?;
    // Loaded 30 s after the generation was read: L1 may serve them until they expire
    // (a value this process loaded is not bound by the generation it knew).
    f.clock.advance(Duration::from_secs(30));
    let calls = Calls::default();
    let keys = named(0..3);
    f.cache
        .get_or_set_many(&keys, relative(), answering(&calls))
        .await?;
    f.clock.advance(Duration::from_secs(35));
    let sent = || f.cache.redis_commands_sent().context("a redis cache");
    let (before, l1_hits) = (sent()?, f.cache.metrics().l1_hits);
    let one = f
        .cache
        .get_or_set(&keys[0], relative(), || async {
            Err::<Vec<u8>, _>(std::io::Error::other("an L1 hit"))
        })
        .await?;
    assert_eq!(one, Bytes::from("value:k0"));
    assert_eq!(sent()? - before, 0, "one key's L1 hit sends nothing");
    let answers = values(
        f.cache
            .get_or_set_many(&keys, relative(), answering(&calls))
            .await?,
    )?;
    assert_eq!(
        answers,
        ["value:k0", "value:k1", "value:k2"].map(|v| Some(v.to_string()))
    );
    assert_eq!(sent()? - before, 0, "a batch of L1 hits sends nothing either");
    assert_eq!(f.cache.metrics().l1_hits - l1_hits, 4);
    // A key L1 does not hold: the generation is read, then the key, and it is loaded.
    let answers = values(
        f.cache
            .get_or_set_many(["k0", "k9"], relative(), answering(&calls))
            .await?,
    )?;
    assert_eq!(
        answers,
        [Some("value:k0".to_string()), Some("value:k9".to_string())]
    );
    assert_eq!(calls.all(), [named(0..3), vec!["k9".to_string()]]);
    Ok(())
}

/// Entries whose headers are longer than what a batch judges together (many long tags)
/// and whose values are large: each is judged alone, served as written, and still
/// judged by its tags.
async fn long_headers_are_judged_alone_and_by_their_tags(backend: Backend) -> Result<()> {
    let f = Fixture::with(backend, |b| b.l1_capacity(0))?;
    // 8 tags of 41 bytes: a header of 385 bytes, past what a batch judges together (256).
    let tags: Vec<String> = (0..8).map(|n| format!("a-tag-of-some-length-{n:>20}")).collect();
    let options = relative().tags(tags.clone());
    let keys = named(0..10);
    let big = |key: &str| format!("{key}:{}", "v".repeat(4_000));
    let calls = Calls::default();
    let loader = |keys: Vec<String>| {
        calls.note(&keys);
        std::future::ready(Ok::<_, std::io::Error>(
            keys.into_iter().map(|k| (k.clone(), big(&k))).collect::<Vec<_>>(),
        ))
    };
    f.cache.get_or_set_many(&keys, options.clone(), loader).await?;
    let read = values(f.cache.get_or_set_many(&keys, options.clone(), loader).await?)?;
    let expected: Vec<Option<String>> = keys.iter().map(|k| Some(big(k))).collect();
    assert_eq!(read, expected);
    assert_eq!(calls.all().len(), 1, "the second batch read every key from L2");
    assert_eq!(f.cache.metrics().l2_hits, 10);
    f.cache.remove_by_tag(&tags[7]).await?;
    let read = values(f.cache.get_or_set_many(&keys, options, loader).await?)?;
    assert_eq!(read, expected);
    assert_eq!(
        calls.per_key().values().copied().collect::<Vec<_>>(),
        vec![2; 10],
        "loaded again after the tag's removal"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_headers_are_judged_alone_and_by_their_tags_memory() -> Result<()> {
    long_headers_are_judged_alone_and_by_their_tags(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_headers_are_judged_alone_and_by_their_tags_redis() -> Result<()> {
    long_headers_are_judged_alone_and_by_their_tags(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typed_twin_caches_absence_when_asked() -> Result<()> {
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Product {
        name: String,
    }
    let f = Fixture::new(Backend::Redis)?;
    let calls = Calls::default();
    let load = |calls: &Calls| answering_by(calls, |k| (k != "gone").then(|| Product { name: k.into() }));
    let options = || relative().cache_none_for(Duration::from_secs(5));
    for _ in 0..2 {
        let answers = f
            .cache
            .get_or_set_many_json::<Product, _, _, _, _, _>(["p1", "gone"], options(), load(&calls))
            .await?;
        let answers: Vec<Option<Product>> = answers.into_iter().collect::<corral::Result<_>>()?;
        assert_eq!(answers, [Some(Product { name: "p1".into() }), None]);
    }
    assert_eq!(calls.all().len(), 1, "the absence was cached too");
    Ok(())
}

/// A typed value that cannot be encoded as JSON (a map with non-string keys) fails its
/// own key with a `Loader` error, as one key's typed load does: the batch's other keys
/// are served and cached, and the failed key caches nothing, not even the null that
/// negative caching would write for a key left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_value_that_cannot_be_encoded_fails_its_key_alone() -> Result<()> {
    type Scores = BTreeMap<Vec<u8>, u8>;
    let f = Fixture::new(Backend::Memory)?;
    let calls = Calls::default();
    let load = |calls: &Calls| {
        answering_by(calls, |k| {
            Some(if k == "bad" {
                [(vec![1], 1)].into()
            } else {
                Scores::new()
            })
        })
    };
    let options = || relative().cache_none_for(Duration::from_secs(5));
    let answers = f
        .cache
        .get_or_set_many_json::<Scores, _, _, _, _, _>(["good", "bad"], options(), load(&calls))
        .await?;
    assert_eq!(answers[0].as_ref().ok(), Some(&Some(Scores::new())));
    let e = answers[1].as_ref().expect_err("its value has no JSON");
    assert_eq!(e.kind(), ErrorKind::Loader);
    let one = f
        .cache
        .get_or_set_json::<Scores, _, _, _>("bad", relative(), || async {
            Ok::<_, std::io::Error>([(vec![1], 1)].into())
        })
        .await
        .expect_err("its value has no JSON");
    assert_eq!(one.kind(), e.kind());
    // Asked again: the good key is served from the cache, the bad one loaded again.
    let again = f
        .cache
        .get_or_set_many_json::<Scores, _, _, _, _, _>(["good", "bad"], options(), load(&calls))
        .await?;
    assert!(again[1].is_err());
    assert_eq!(
        calls.all(),
        [
            vec!["good".to_string(), "bad".to_string()],
            vec!["bad".to_string()]
        ]
    );
    Ok(())
}

/// A loader whose answer panics as it is read (a lazy iterator) fails its call's keys
/// with its own panic, every one of them (before, all but one got the futures crate's
/// "inner future panicked during poll"), and leaves no flight behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_answer_that_panics_as_it_is_read_is_each_keys_panic() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let keys: Vec<String> = (0..3).map(|i| format!("z{i}")).collect();
    let answers = f
        .cache
        .get_or_set_many(&keys, relative(), |asked: Vec<String>| async move {
            Ok::<_, std::io::Error>(asked.into_iter().map(|k| {
                assert_ne!(k, "z1", "lazy");
                (k.clone(), k)
            }))
        })
        .await?;
    for answer in &answers {
        let err = answer.as_ref().err().context("every key fails")?;
        assert!(err.to_string().contains("lazy"), "{err}");
    }
    assert_eq!(f.cache.flights_in_progress(), 0);
    Ok(())
}

#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Item {
    name: String,
}

#[derive(Debug)]
struct NotFound;

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no such row")
    }
}

impl std::error::Error for NotFound {}

/// A typed batch's negative caching (a JSON `null` for a key it left out) is read as a
/// `None` by the single-key typed get-or-set of the same key as an `Option` (the list and
/// item endpoints of examples/axum-service), without its loader; a type that cannot hold
/// `null` reads it as `Corrupt` (documented).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_batchs_cached_none_is_a_none_for_a_single_key_read_as_an_option() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    let options = || relative().cache_none_for(Duration::from_secs(30));
    let answers = f
        .cache
        .get_or_set_many_json::<Item, _, _, _, _, _>(["user:999"], options(), |_| async {
            Ok::<_, std::io::Error>(Vec::new())
        })
        .await?;
    assert!(matches!(answers[..], [Ok(None)]), "{answers:?}");
    let found = f
        .cache
        .get_or_set_json::<Option<Item>, _, _, _>("user:999", options(), || async {
            Err::<Option<Item>, _>(NotFound)
        })
        .await?;
    assert_eq!(found, None, "the cached absence, without a load");
    let err = f
        .cache
        .get_or_set_json::<Item, _, _, _>("user:999", relative(), || async { Err::<Item, _>(NotFound) })
        .await
        .err()
        .context("a type without None")?;
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    Ok(())
}

/// A key a typed batch leaves out, without negative caching, is absent for the single-key
/// follower that waited on it: the follower loads it with its own loader (before, it got
/// the bytes `null` as the key's value).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_a_typed_batch_leaves_out_is_loaded_by_its_single_key_follower() -> Result<()> {
    let f = Fixture::new(Backend::Redis)?;
    let (loading, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let batch = {
        let (cache, loading, release) = (f.cache.clone(), loading.clone(), release.clone());
        tokio::spawn(async move {
            cache
                .get_or_set_many_json::<Item, _, _, _, _, _>(["gone"], relative(), |_| {
                    let (loading, release) = (loading.clone(), release.clone());
                    async move {
                        loading.notify_one();
                        release.notified().await;
                        Ok::<_, std::io::Error>(Vec::new())
                    }
                })
                .await
        })
    };
    loading.notified().await;
    let follower = {
        let cache = f.cache.clone();
        tokio::spawn(async move {
            cache
                .get_or_set("gone", relative(), || async { Ok::<_, std::io::Error>("own") })
                .await
        })
    };
    while f.cache.followers_of("gone") == 0 {
        tokio::task::yield_now().await;
    }
    release.notify_one();
    let answers = batch.await??;
    assert!(matches!(answers[..], [Ok(None)]), "{answers:?}");
    assert_eq!(follower.await??, Bytes::from_static(b"own"));
    Ok(())
}

/// Four `corral stampede --keys 100 --batch 10` processes of 250 callers each, started
/// at once over the Redis that `redis_args` name: every key is loaded exactly once in
/// all. Returns the keys each process loaded.
async fn four_bulk_processes(redis_args: &[&str]) -> Result<Vec<u64>> {
    let key = format!("bulk-{}-{}", std::process::id(), corral::SystemClock.now_ms());
    let mut args = vec!["--keys", "100", "--batch", "10", "--callers", "250"];
    args.extend(["--loader-ms", "200", "--key", &key]);
    args.extend(redis_args);
    let mut loaded = Vec::new();
    let mut key_loads = 0;
    for report in stampedes_at_a_barrier(4, &args)? {
        assert_eq!(report["errors"], 0, "{report}");
        loaded.push(report["keys_loaded"].as_u64().context("keys_loaded")?);
        key_loads += report["key_loads"].as_u64().context("key_loads")?;
    }
    assert_eq!(
        loaded.iter().sum::<u64>(),
        100,
        "every key loaded, once: {loaded:?}"
    );
    assert_eq!(key_loads, 100, "no key loaded twice in one process");
    Ok(loaded)
}

/// The command as a newcomer types it: four `corral stampede --keys 100 --batch
/// 10 --callers 250` started at once (no barrier, no `--key`) share one fresh key, so
/// the keys they load add up to 100; four more started after them run cold again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_started_at_once_share_their_fresh_keys() -> Result<()> {
    let _real_time = real_time().await;
    let server = corral_tests::RedisServer::start()?;
    let url = server.url();
    for group in 0..2 {
        let children = (0..4)
            .map(|_| {
                std::process::Command::new(corral_tests::corral_bin())
                    .args(["stampede", "--keys", "100", "--batch", "10", "--callers", "250"])
                    .args(["--json", "--redis", &url])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .context("spawning corral stampede")
            })
            .collect::<Result<Vec<_>>>()?;
        let mut loaded = Vec::new();
        for child in children {
            let out = child.wait_with_output()?;
            anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            loaded.push(report["keys_loaded"].as_u64().context("keys_loaded")?);
        }
        assert_eq!(loaded.iter().sum::<u64>(), 100, "group {group}: {loaded:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_load_each_of_a_hundred_keys_once() -> Result<()> {
    let _real_time = real_time().await;
    let server = corral_tests::RedisServer::start()?;
    let loaded = four_bulk_processes(&["--redis", &server.url()]).await?;
    println!("4 x 250 callers, batches of 10 of 100 keys: keys loaded per process {loaded:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_load_each_of_a_hundred_keys_once_on_a_cluster() -> Result<()> {
    let _real_time = real_time().await;
    let nodes = corral_tests::RedisCluster::shared()?;
    let prefix = format!("bulk-{}:", std::process::id());
    let mut args: Vec<&str> = nodes
        .iter()
        .flat_map(|n| ["--redis-cluster", n.as_str()])
        .collect();
    args.extend(["--prefix", &prefix]);
    let loaded = four_bulk_processes(&args).await?;
    println!("4 x 250 callers on a cluster, batches of 10 of 100 keys: keys loaded per process {loaded:?}");
    Ok(())
}

/// A loader that panics as it is called (before its future exists) fails every key of
/// its call with the panic; none is left waiting, and the keys are free afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_panicking_as_it_is_called_fails_its_keys_and_hangs_none() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let batch = f
        .cache
        .get_or_set_many(["a", "b", "c"], relative(), |keys: Vec<String>| {
            assert!(keys.len() < 2, "a loader that expects one key at a time");
            std::future::ready(Ok::<_, std::io::Error>(Vec::<(String, Vec<u8>)>::new()))
        });
    let answers = tokio::time::timeout(Duration::from_secs(10), batch)
        .await
        .context("the batch hung")??;
    for answer in answers {
        let e = answer.expect_err("the loader panicked");
        assert_eq!(e.kind(), ErrorKind::Loader, "{e}");
        assert!(e.to_string().contains("panicked"), "{e}");
    }
    assert_eq!(f.cache.flights_in_progress(), 0, "no flight left behind");
    let calls = Calls::default();
    let answers = values(
        f.cache
            .get_or_set_many(["a"], relative(), answering(&calls))
            .await?,
    )?;
    assert_eq!(answers, [Some("value:a".into())]);
    Ok(())
}

/// Bypassed keys (no L1, no registry, no lock) are still loaded together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypassed_keys_are_loaded_in_one_call() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let calls = Calls::default();
    let keys = named(0..10);
    let answers = values(
        f.cache
            .get_or_set_many(&keys, relative().bypass(true), answering(&calls))
            .await?,
    )?;
    assert!(answers.iter().all(Option::is_some));
    assert_eq!(calls.all(), [keys], "one call for the ten");
    Ok(())
}

/// A single-key caller that waited for a key a batch's loader left out loads it with
/// its own loader, rather than getting the batch's "absent".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_key_caller_loads_what_a_batch_left_out() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let (batch, release) = held_batch(&f.cache, &["k"], |_| Ok::<_, std::io::Error>(Vec::new())).await;
    let single = {
        let cache = f.cache.clone();
        tokio::spawn(async move {
            cache
                .get_or_set("k", relative(), || async { Ok::<_, std::io::Error>("its own") })
                .await
        })
    };
    while f.cache.followers_of("k") == 0 {
        tokio::task::yield_now().await;
    }
    release.notify_one();
    assert_eq!(values(batch.await??)?, [None], "absent for the batch");
    assert_eq!(single.await??, "its own");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_key_is_named_alike_warm_or_cold_and_before_a_bad_tag() -> Result<()> {
    let f = Fixture::new(Backend::Memory)?;
    let calls = Calls::default();
    // The first key, the options, every key, then the tags: as the portable body checks.
    let e = f
        .cache
        .get_or_set_many(["a", ""], relative().tags([""]), answering(&calls))
        .await
        .expect_err("a bad key and a bad tag");
    assert_eq!(e.argument(), Some("key"), "{e}");
    let e = f
        .cache
        .get_or_set_many(["a", "b"], relative().tags([""]), answering(&calls))
        .await
        .expect_err("a bad tag");
    assert_eq!(e.argument(), Some("tags"), "{e}");
    // A bad first key says the same before and after its options were accepted once.
    let options = || LoadOptions::relative(Duration::from_secs(77));
    let bad = ["", "b"];
    let cold = f
        .cache
        .get_or_set_many(bad, options(), answering(&calls))
        .await
        .expect_err("cold");
    f.cache
        .get_or_set_many(["warm"], options(), answering(&calls))
        .await?;
    let warm = f
        .cache
        .get_or_set_many(bad, options(), answering(&calls))
        .await
        .expect_err("warm");
    assert_eq!(cold.to_string(), warm.to_string());
    assert!(cold.to_string().contains("position 0"), "{cold}");
    assert_eq!(
        calls.all(),
        [["warm".to_string()]],
        "no loader ran for a bad batch"
    );
    Ok(())
}

/// A batch's loader call still running at the hard timeout is stopped: every key it
/// loads gets `Timeout`, nothing is cached, and the call ends (the timeout counts from
/// the call, contract §5.16, §7.2; `cluster::a_batch_keys_hard_timeout_counts_from_its_loader_call`
/// holds the call back behind another key's store step).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_loader_past_the_hard_timeout_is_stopped() -> Result<()> {
    let _real_time = real_time().await;
    let f = Fixture::new(Backend::Memory)?;
    let calls = Calls::default();
    let options = relative().hard_timeout(Duration::from_millis(100));
    let answers = f
        .cache
        .get_or_set_many(["a", "b"], options, |keys: Vec<String>| {
            calls.note(&keys);
            std::future::pending::<Loaded<std::io::Error>>()
        })
        .await?;
    assert_eq!(calls.all(), [["a", "b"]], "one call for both keys");
    for answer in answers {
        let e = answer.expect_err("stopped at the hard timeout");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    }
    assert_eq!(f.cache.get("a").await?, None, "nothing cached");
    assert_eq!(f.cache.flights_in_progress(), 0);
    Ok(())
}

/// Where a [`wired`] cache's replies can be held: those of its `MGET`s, and those of
/// the commands naming what `naming` holds (`named`).
struct Gates {
    mgets: Arc<Gate>,
    named: Arc<Gate>,
    naming: Arc<Mutex<Option<String>>>,
}

/// A cache on a real redis-server reached through a wire whose replies can be held
/// ([`Gates`]), with the server (stopped when dropped).
async fn wired() -> Result<(RedisServer, Corral, Gates)> {
    let server = RedisServer::start()?;
    let wire = RealWire::connect(&server.url()).await?;
    let gates = Gates {
        mgets: wire.mgets.clone(),
        named: wire.named.clone(),
        naming: wire.naming.clone(),
    };
    let cache = Corral::builder()
        .redis_options(RedisOptions::new(server.url()))
        .redis_wire(Arc::new(wire))
        .build()?;
    Ok((server, cache, gates))
}

/// A batch of `keys` in a task of its own, every one of them a hit (its loader fails).
fn batch_of_hits(cache: &Corral, keys: &'static [&'static str]) -> tokio::task::JoinHandle<Answers> {
    let cache = cache.clone();
    tokio::spawn(async move {
        cache
            .get_or_set_many(keys, relative(), |_: Vec<String>| async {
                Err::<Vec<(String, String)>, _>(std::io::Error::other("all are hits"))
            })
            .await
    })
}

/// Removes the entry `name` from the server at `url` by hand: no process hears of it.
async fn delete_by_hand(url: &str, name: &str) -> Result<()> {
    let mut raw = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let removed: u64 = redis::cmd("DEL").arg(name).query_async(&mut raw).await?;
    anyhow::ensure!(removed == 1, "{name} was not there to remove");
    Ok(())
}

/// A batch of `k` and `x` in a task of its own, loading with `calls` noting its calls.
fn batch_of_k_and_x(
    cache: &Corral,
    calls: &Calls,
) -> tokio::task::JoinHandle<corral::Result<Vec<corral::Result<Option<Bytes>>>>> {
    let (cache, calls) = (cache.clone(), calls.clone());
    tokio::spawn(async move {
        cache
            .get_or_set_many(["k", "x"], relative(), answering(&calls))
            .await
    })
}

/// A key another caller in this process is loading is followed, however that flight
/// ends: here its loader fails (nothing reaches L2) while the reply to the batch's read
/// of its other key is held on the wire. The batch gets that caller's error for the key and does not
/// load it again (contract §5.3, §5.16: a batch joins its flights before it reads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flight_that_fails_while_a_batch_reads_is_followed_not_loaded_again() -> Result<()> {
    let (_server, cache, Gates { mgets, .. }) = wired().await?;
    cache.get("warm-up").await?;
    let (loading, fail) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let single = {
        let (cache, loading, fail) = (cache.clone(), loading.clone(), fail.clone());
        // Its value is not cached: only following the flight gives it to the batch.
        let uncached = relative().should_cache(|_| false);
        tokio::spawn(async move {
            cache
                .get_or_set("k", uncached, move || async move {
                    loading.notify_one();
                    fail.notified().await;
                    Err::<Vec<u8>, _>(std::io::Error::other("the origin is down"))
                })
                .await
        })
    };
    loading.notified().await;
    mgets.close();
    let calls = Calls::default();
    let batch = batch_of_k_and_x(&cache, &calls);
    // The batch's read was made, its reply held; meanwhile the other flight fails.
    mgets.arrived().await;
    fail.notify_one();
    let single = single.await?;
    assert!(single.is_err_and(|e| e.kind() == ErrorKind::Loader));
    mgets.let_one();
    let answers = batch.await??;
    assert_eq!(
        calls.all(),
        [["x".to_string()]],
        "k was the other caller's to load"
    );
    assert!(
        answers[0].as_ref().is_err_and(|e| e.kind() == ErrorKind::Loader),
        "{:?}",
        answers[0]
    );
    assert_eq!(
        answers[1].as_ref().ok().cloned().flatten(),
        Some(Bytes::from("value:x"))
    );
    Ok(())
}

/// How the other caller's flight of `k` goes in `a_flight_that_begins_while_a_batch_reads`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Begun {
    /// Its loader fails before the batch's read is answered.
    Fails,
    /// Its loader returns a value (not cached: only following the flight gives it to
    /// the batch) before the batch's read is answered.
    Loads,
    /// Its loader is still running when the batch's read is answered.
    Runs,
}

/// A batch that reads keys no flight in this process has under way joins them after
/// its read; a flight of such a key that another caller began meanwhile is followed, as
/// if the batch had joined first: `k` is loaded once in the process, and the batch gets
/// that flight's outcome, however it ends (contract §5.3, §5.16).
async fn a_flight_that_begins_while_a_batch_reads(begun: Begun) -> Result<()> {
    let (_server, cache, Gates { mgets, .. }) = wired().await?;
    cache.get("warm-up").await?;
    mgets.close();
    let calls = Calls::default();
    let batch = batch_of_k_and_x(&cache, &calls);
    // The batch's read was made (k and x both missed), its reply held.
    mgets.arrived().await;
    let (loading, end) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let single = {
        let (cache, loading, end) = (cache.clone(), loading.clone(), end.clone());
        // Its value is not cached: only following the flight gives it to the batch.
        let uncached = relative().should_cache(|_| false);
        tokio::spawn(async move {
            cache
                .get_or_set("k", uncached, move || async move {
                    loading.notify_one();
                    end.notified().await;
                    match begun {
                        Begun::Fails => Err(std::io::Error::other("the origin is down")),
                        Begun::Loads | Begun::Runs => Ok("from the single caller"),
                    }
                })
                .await
        })
    };
    loading.notified().await;
    if begun != Begun::Runs {
        end.notify_one();
        let single = single.await?;
        assert_eq!(single.is_ok(), begun == Begun::Loads, "{single:?}");
        mgets.let_one();
    } else {
        mgets.let_one();
        // The batch follows the flight now: it ends after the batch joined it.
        tokio::time::timeout(Duration::from_secs(10), async {
            while cache.followers_of("k") == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .context("the batch never followed the flight of k")?;
        end.notify_one();
        single.await??;
    }
    let answers = batch.await??;
    assert_eq!(
        calls.all(),
        [["x".to_string()]],
        "k was the other caller's to load"
    );
    match begun {
        Begun::Fails => assert!(
            answers[0].as_ref().is_err_and(|e| e.kind() == ErrorKind::Loader),
            "{:?}",
            answers[0]
        ),
        Begun::Loads | Begun::Runs => assert_eq!(
            answers[0].as_ref().ok().cloned().flatten(),
            Some(Bytes::from("from the single caller"))
        ),
    }
    assert_eq!(
        answers[1].as_ref().ok().cloned().flatten(),
        Some(Bytes::from("value:x"))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flight_that_begins_and_fails_while_a_batch_reads_is_followed() -> Result<()> {
    a_flight_that_begins_while_a_batch_reads(Begun::Fails).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flight_that_begins_and_loads_while_a_batch_reads_is_followed() -> Result<()> {
    a_flight_that_begins_while_a_batch_reads(Begun::Loads).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flight_that_begins_while_a_batch_reads_and_runs_on_is_followed() -> Result<()> {
    a_flight_that_begins_while_a_batch_reads(Begun::Runs).await
}

/// A read that came before a write this process's bypass made does not fill L1 over it:
/// the reply to a batch's read of `k` (the old value) is held while a bypass loads and
/// writes the new one; the batch answers the old value (its call began before the
/// write), but a `get` after the write gets the new one, from L1 or L2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_from_before_a_bypass_write_does_not_fill_l1_over_it() -> Result<()> {
    let (server, cache, Gates { mgets, .. }) = wired().await?;
    let other = Corral::builder().redis(server.url()).build()?;
    other.set("k", "old", EntryOptions::new()).await?;
    mgets.close();
    let batch = batch_of_hits(&cache, &["k"]);
    mgets.arrived().await;
    let bypass = relative().bypass(true);
    let written = cache
        .get_or_set("k", bypass, || async { Ok::<_, std::io::Error>("new") })
        .await?;
    assert_eq!(&written[..], b"new");
    mgets.let_one();
    assert_eq!(values(batch.await??)?, [Some("old".to_string())]);
    assert_eq!(
        cache.get("k").await?.as_deref(),
        Some(&b"new"[..]),
        "the batch's older read filled L1 over the bypass's write"
    );
    Ok(())
}

/// A hit a batch read before another caller's flight of the key began does not stay in
/// L1 over that flight's fill: the reply to a batch's read of `k` (the old value) is
/// held while the entry goes from L2 without a word to this process (a `DEL` by hand)
/// and a `get_or_set` here loads and fills the new one. The batch answers the old value
/// (its read came first), but a `get` after the batch gets the new one, from L1 or L2
/// (contract §5.16).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hit_a_flight_overtook_while_a_batch_read_keeps_no_older_copy_in_l1() -> Result<()> {
    let (server, cache, Gates { mgets, .. }) = wired().await?;
    // Subscribed before the race: a late subscription's flush of L1 would hide it.
    cache.get("warm-up").await?;
    let other = Corral::builder().redis(server.url()).build()?;
    other.set("k", "old", EntryOptions::new()).await?;
    let name = other.entry_name("k")?;
    mgets.close();
    let batch = batch_of_hits(&cache, &["k"]);
    mgets.arrived().await;
    delete_by_hand(&server.url(), &name).await?;
    let loaded = cache
        .get_or_set("k", relative(), || async { Ok::<_, std::io::Error>("new") })
        .await?;
    assert_eq!(&loaded[..], b"new");
    mgets.let_one();
    assert_eq!(values(batch.await??)?, [Some("old".to_string())]);
    assert_eq!(
        cache.get("k").await?.as_deref(),
        Some(&b"new"[..]),
        "the batch's older read stayed in L1 over the flight's fill"
    );
    Ok(())
}

/// A batch fills L1 with a hit only once it knows no flight of the key overtook its
/// read: the reply to a batch's read of `k` (the old value) and of `t` (tagged) is held
/// while `k` goes from L2 by hand and a `get_or_set` here loads the new value; then, while
/// the batch waits for `t`'s tag moments (held on the wire), a `get` of `k` is not
/// served the batch's older read (the flight that returned the new value came first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_fills_l1_with_a_hit_only_once_no_flight_of_its_key_overtook_the_read() -> Result<()> {
    let (server, cache, Gates { mgets, named, naming }) = wired().await?;
    cache.get("warm-up").await?;
    let other = Corral::builder().redis(server.url()).build()?;
    other
        .set("k", "old", EntryOptions::new().relative(Duration::from_secs(60)))
        .await?;
    other
        .get_or_set("t", relative().tags(["held-tag"]), || async {
            Ok::<_, std::io::Error>("tagged")
        })
        .await?;
    let name = other.entry_name("k")?;
    mgets.close();
    let batch = batch_of_hits(&cache, &["k", "t"]);
    mgets.arrived().await;
    delete_by_hand(&server.url(), &name).await?;
    let loaded = cache
        .get_or_set("k", relative(), || async { Ok::<_, std::io::Error>("new") })
        .await?;
    assert_eq!(&loaded[..], b"new");
    *naming.lock().unwrap() = Some("held-tag".to_string());
    named.close();
    mgets.let_one();
    // The batch judged both reads: `k` is answered, `t` waits for its tag's moments.
    named.arrived().await;
    assert_eq!(
        cache.get("k").await?.as_deref(),
        Some(&b"new"[..]),
        "L1 served the batch's older read of k after the flight that loaded the new value returned"
    );
    named.let_one();
    assert_eq!(
        values(batch.await??)?,
        [Some("old".to_string()), Some("tagged".to_string())]
    );
    assert_eq!(cache.get("k").await?.as_deref(), Some(&b"new"[..]));
    Ok(())
}

/// A batch whose read of the prefix's generation timed out (its reply held on the wire,
/// no generation known to stand in) reads it once: the keys that fly on are named in
/// the generation the batch stood in with, and degrade from there (contract §5.8), as
/// one key's flight does after its one read. Before, each flying key read the
/// generation again, one more store timeout before its lock steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_generation_read_timed_out_reads_it_once() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = generation_held(&server, Duration::from_millis(200)).await?;
    let reads_before = command_calls(&server, "get").await?;
    let calls = Calls::default();
    let keys = named(0..5);
    let answers = values(
        cache
            .get_or_set_many(&keys, relative(), answering(&calls))
            .await?,
    )?;
    let generation_reads = command_calls(&server, "get").await? - reads_before;
    assert_eq!(
        answers,
        keys.iter()
            .map(|k| Some(format!("value:{k}")))
            .collect::<Vec<_>>(),
        "degraded: loaded, served"
    );
    assert_eq!(calls.all().len(), 1, "one loader call");
    assert_eq!(generation_reads, 1, "the generation read again per flying key");
    Ok(())
}

/// A batch's options are judged once, when it is called: an absolute expiry that was
/// ahead then and passes while the batch reads (here, its generation read held on the
/// wire until the response timeout) fails no key. Each key is loaded and served, as one
/// key's get-or-set is whose absolute point passes while it runs: not cached, since the
/// point passed (contract §5.16). Before, each key that flew on judged the options
/// again at its flight's start and failed with an invalid argument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_absolute_expiry_passes_while_it_reads_fails_no_key() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = generation_held(&server, Duration::from_millis(800)).await?;
    let calls = Calls::default();
    let keys = named(0..3);
    let soon = std::time::SystemTime::now() + Duration::from_millis(250);
    let answers = values(
        cache
            .get_or_set_many(&keys, EntryOptions::new().absolute(soon), answering(&calls))
            .await?,
    )?;
    assert_eq!(
        answers,
        keys.iter()
            .map(|k| Some(format!("value:{k}")))
            .collect::<Vec<_>>(),
        "each key loaded and served, none judged again"
    );
    assert_eq!(calls.all().len(), 1, "one loader call");
    // Past its point, nothing is cached: no entry in L2, no copy in L1.
    assert_eq!(
        server.entries_held().await?,
        0,
        "an entry was written past its point"
    );
    // An L1 copy answers at once; without one, the read meets the held generation.
    let read = tokio::time::timeout(Duration::from_secs(2), cache.get(&keys[0])).await;
    assert!(!matches!(read, Ok(Ok(Some(_)))), "L1 kept a copy past its point");
    Ok(())
}

/// A bypass batch whose read of the prefix's generation timed out reads it once: a bypass
/// reads no key first, but its keys are named as a batch's are, in one generation found
/// once for them all (contract §5.16); each key is loaded and served, not written (its
/// name could not be read), as one key's bypass is. Before, each key read the
/// generation on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bypass_batch_whose_generation_read_timed_out_reads_it_once() -> Result<()> {
    let server = RedisServer::start()?;
    let cache = generation_held(&server, Duration::from_millis(200)).await?;
    let reads = async || -> Result<u64> {
        Ok(command_calls(&server, "get").await? + command_calls(&server, "mget").await?)
    };
    let reads_before = reads().await?;
    let calls = Calls::default();
    let keys = named(0..5);
    let answers = values(
        cache
            .get_or_set_many(&keys, relative().bypass(true), answering(&calls))
            .await?,
    )?;
    let generation_reads = reads().await? - reads_before;
    assert_eq!(
        answers,
        keys.iter()
            .map(|k| Some(format!("value:{k}")))
            .collect::<Vec<_>>(),
        "loaded, served"
    );
    assert_eq!(calls.all().len(), 1, "one loader call");
    assert_eq!(generation_reads, 1, "the generation read again per bypassing key");
    Ok(())
}

/// A cache on `server` whose reads of the prefix's generation get no reply (held on the
/// wire) until its response timeout, `timeout`.
async fn generation_held(server: &RedisServer, timeout: Duration) -> Result<Corral> {
    let wire = RealWire::holding_the_generation(&server.url()).await?;
    let mut options = RedisOptions::new(server.url());
    options.response_timeout = timeout;
    Ok(Corral::builder()
        .redis_options(options)
        .redis_wire(Arc::new(wire))
        .build()?)
}
