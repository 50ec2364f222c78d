//! The cache contract (contract §2-§4), every rule a test, each run against both L2
//! backends: the in-memory store and a real redis-server started for the test. Time is a
//! manual clock throughout: no test waits for anything to expire.

use std::time::Duration;

use anyhow::Result;
use corral::{EntryOptions, ErrorKind};
use corral_tests::{Backend, Fixture};

const SEC: Duration = Duration::from_secs(1);
const MIN: Duration = Duration::from_secs(60);

/// Runs each listed `async fn(Backend) -> Result<()>` once per backend.
macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
               async fn $name() -> anyhow::Result<()> { super::$name(corral_tests::Backend::Memory).await } )*
        }
        mod redis {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
               async fn $name() -> anyhow::Result<()> { super::$name(corral_tests::Backend::Redis).await } )*
        }
        /// The same on a real Redis Cluster (3 masters, 3 replicas), one tenant each.
        mod cluster {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
               async fn $name() -> anyhow::Result<()> { super::$name(corral_tests::Backend::Cluster).await } )*
        }
    };
}

contract!(
    a_value_set_is_read_back,
    values_are_bytes_and_an_empty_value_is_a_value,
    keys_are_never_trimmed,
    an_empty_key_is_an_argument_error_everywhere,
    a_white_space_key_is_an_argument_error_everywhere,
    a_key_over_the_limit_is_rejected_and_stores_nothing,
    a_value_over_the_limit_is_rejected_and_loses_nothing,
    absolute_and_relative_together_are_rejected,
    zero_durations_are_rejected,
    an_absolute_point_in_the_past_is_rejected,
    a_relative_entry_expires_and_is_removed,
    an_absolute_entry_expires_at_its_point,
    a_read_moves_a_sliding_entry,
    a_refresh_moves_a_sliding_entry,
    absolute_caps_sliding,
    refresh_of_a_non_sliding_entry_changes_nothing,
    no_options_mean_the_default_sliding_expiration,
    the_default_sliding_is_configurable,
    missing_entries_are_not_errors,
    a_removed_entry_is_gone,
    a_set_replaces_value_and_expiry,
    foreign_bytes_are_a_miss_removed_and_counted,
    a_truncated_envelope_is_a_miss_removed_and_counted,
    an_unknown_envelope_version_is_a_miss_removed_and_counted,
    inspect_shows_the_stored_meta_without_touching,
    one_expiry_rule_holds_on_every_store,
    a_value_of_another_redis_type_is_a_corrupt_miss,
);

fn arg_error<T: std::fmt::Debug>(r: corral::Result<T>) -> (ErrorKind, String) {
    let e = r.expect_err("expected an argument error");
    (e.kind(), e.argument().unwrap_or_default().to_string())
}

fn invalid(name: &str) -> (ErrorKind, String) {
    (ErrorKind::InvalidArgument, name.to_string())
}

async fn a_value_set_is_read_back(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    // A fresh cache's landing subscription flushes L1 when it goes live (what was filled
    // before it may have missed announcements): wait for it, so the fill below stays.
    f.cache.health().await;
    f.cache.set("user:1", "Ada", EntryOptions::new()).await?;
    assert_eq!(f.cache.get("user:1").await?.as_deref(), Some(&b"Ada"[..]));
    assert_eq!(f.cache.metrics().l1_hits, 1, "the set filled L1");
    Ok(())
}

async fn values_are_bytes_and_an_empty_value_is_a_value(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let binary: Vec<u8> = (0..=255).collect();
    f.cache.set("bin", binary.clone(), EntryOptions::new()).await?;
    f.cache.set("empty", Vec::new(), EntryOptions::new()).await?;
    assert_eq!(f.cache.get("bin").await?.as_deref(), Some(&binary[..]));
    assert_eq!(
        f.cache.get("empty").await?.as_deref(),
        Some(&b""[..]),
        "empty is a value, not a miss"
    );
    Ok(())
}

async fn keys_are_never_trimmed(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache.set("a", "plain", EntryOptions::new()).await?;
    f.cache.set(" a ", "spaced", EntryOptions::new()).await?;
    assert_eq!(f.cache.get("a").await?.as_deref(), Some(&b"plain"[..]));
    assert_eq!(f.cache.get(" a ").await?.as_deref(), Some(&b"spaced"[..]));
    assert_eq!(f.cache.get("a ").await?, None);
    Ok(())
}

async fn every_operation_rejects(f: &Fixture, key: &str) {
    let c = &f.cache;
    assert_eq!(arg_error(c.get(key).await), invalid("key"));
    assert_eq!(
        arg_error(c.set(key, "v", EntryOptions::new()).await),
        invalid("key")
    );
    assert_eq!(arg_error(c.refresh(key).await), invalid("key"));
    assert_eq!(arg_error(c.remove(key).await), invalid("key"));
    assert_eq!(arg_error(c.inspect(key).await), invalid("key"));
}

async fn an_empty_key_is_an_argument_error_everywhere(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    every_operation_rejects(&f, "").await;
    let e = f.cache.get("").await.unwrap_err();
    assert!(e.to_string().contains("must not be empty"), "{e}");
    Ok(())
}

async fn a_white_space_key_is_an_argument_error_everywhere(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    for key in [" ", "\t\n", "\u{3000}"] {
        every_operation_rejects(&f, key).await;
    }
    Ok(())
}

async fn a_key_over_the_limit_is_rejected_and_stores_nothing(b: Backend) -> Result<()> {
    let f = Fixture::with(b, |b| b.max_key_bytes(8))?;
    f.cache.set("12345678", "fits", EntryOptions::new()).await?;
    let e = f
        .cache
        .set("123456789", "v", EntryOptions::new())
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind(), e.argument()),
        (ErrorKind::InvalidArgument, Some("key"))
    );
    assert!(e.to_string().contains("over the limit of 8"), "{e}");
    assert!(!f.stored("123456789").await?);
    Ok(())
}

async fn a_value_over_the_limit_is_rejected_and_loses_nothing(b: Backend) -> Result<()> {
    let f = Fixture::with(b, |b| b.max_value_bytes(4))?;
    f.cache.set("k", "old", EntryOptions::new()).await?;
    let e = f
        .cache
        .set("k", "too long", EntryOptions::new())
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind(), e.argument()),
        (ErrorKind::InvalidArgument, Some("value"))
    );
    assert_eq!(
        f.cache.get("k").await?.as_deref(),
        Some(&b"old"[..]),
        "the old value is untouched"
    );
    Ok(())
}

async fn absolute_and_relative_together_are_rejected(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let at = f.clock_now() + 60_000;
    let r = f
        .cache
        .set("k", "v", EntryOptions::new().absolute_at_ms(at).relative(MIN))
        .await;
    assert_eq!(arg_error(r), invalid("relative"));
    assert!(!f.stored("k").await?);
    Ok(())
}

async fn zero_durations_are_rejected(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    assert_eq!(
        arg_error(
            f.cache
                .set("k", "v", EntryOptions::new().relative(Duration::ZERO))
                .await
        ),
        invalid("relative")
    );
    assert_eq!(
        arg_error(
            f.cache
                .set("k", "v", EntryOptions::new().sliding(Duration::ZERO))
                .await
        ),
        invalid("sliding")
    );
    assert!(!f.stored("k").await?);
    Ok(())
}

async fn an_absolute_point_in_the_past_is_rejected(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let now = f.clock_now();
    for at in [now - 1, now] {
        let r = f
            .cache
            .set("k", "v", EntryOptions::new().absolute_at_ms(at))
            .await;
        assert_eq!(arg_error(r), invalid("absolute"));
    }
    assert!(!f.stored("k").await?);
    Ok(())
}

async fn a_relative_entry_expires_and_is_removed(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache
        .set("k", "v", EntryOptions::new().relative(10 * SEC))
        .await?;
    f.clock.advance(10 * SEC - Duration::from_millis(1));
    assert!(
        f.cache.get("k").await?.is_some(),
        "fresh until the last millisecond"
    );
    f.clock.advance(Duration::from_millis(1));
    assert_eq!(f.cache.get("k").await?, None, "expired at its moment");
    assert!(!f.stored("k").await?, "an expired entry is removed on read");
    Ok(())
}

async fn an_absolute_entry_expires_at_its_point(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let at = f.clock_now() + 5_000;
    f.cache
        .set("k", "v", EntryOptions::new().absolute_at_ms(at))
        .await?;
    f.clock.advance(4 * SEC);
    assert!(f.cache.get("k").await?.is_some());
    f.clock.set(at);
    assert_eq!(f.cache.get("k").await?, None);
    Ok(())
}

async fn a_read_moves_a_sliding_entry(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache.set("k", "v", EntryOptions::new().sliding(MIN)).await?;
    for _ in 0..5 {
        f.clock.advance(40 * SEC);
        assert!(f.cache.get("k").await?.is_some(), "each read keeps it alive");
    }
    f.clock.advance(MIN);
    assert_eq!(f.cache.get("k").await?, None, "idle for a full interval: expired");
    Ok(())
}

async fn a_refresh_moves_a_sliding_entry(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache.set("k", "v", EntryOptions::new().sliding(MIN)).await?;
    f.clock.advance(50 * SEC);
    assert!(f.cache.refresh("k").await?);
    let meta = f.cache.inspect("k").await?.expect("present").meta;
    assert_eq!(meta.expires_at_ms, f.clock_now() + 60_000);
    f.clock.advance(50 * SEC);
    assert!(
        f.cache.get("k").await?.is_some(),
        "alive 100 s after the set thanks to the refresh"
    );
    Ok(())
}

async fn absolute_caps_sliding(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let start = f.clock_now();
    f.cache
        .set("k", "v", EntryOptions::new().relative(90 * SEC).sliding(MIN))
        .await?;
    f.clock.advance(50 * SEC);
    assert!(f.cache.get("k").await?.is_some());
    let meta = f.cache.inspect("k").await?.expect("present").meta;
    assert_eq!(
        meta.expires_at_ms,
        start + 90_000,
        "slid, but only up to the absolute point"
    );
    f.clock.advance(40 * SEC);
    assert_eq!(f.cache.get("k").await?, None);
    Ok(())
}

async fn refresh_of_a_non_sliding_entry_changes_nothing(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache.set("k", "v", EntryOptions::new().relative(MIN)).await?;
    let before = f.cache.inspect("k").await?.expect("present").meta;
    f.clock.advance(30 * SEC);
    assert!(f.cache.refresh("k").await?);
    assert!(f.cache.get("k").await?.is_some());
    assert_eq!(f.cache.inspect("k").await?.expect("present").meta, before);
    Ok(())
}

async fn no_options_mean_the_default_sliding_expiration(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache.set("k", "v", EntryOptions::new()).await?;
    let meta = f.cache.inspect("k").await?.expect("present").meta;
    assert_eq!((meta.absolute_ms, meta.sliding_ms), (None, Some(20 * 60_000)));
    f.clock.advance(19 * MIN);
    assert!(f.cache.get("k").await?.is_some());
    f.clock.advance(20 * MIN);
    assert_eq!(f.cache.get("k").await?, None);
    Ok(())
}

async fn the_default_sliding_is_configurable(b: Backend) -> Result<()> {
    let f = Fixture::with(b, |b| b.default_sliding(5 * SEC))?;
    f.cache.set("k", "v", EntryOptions::new()).await?;
    assert_eq!(
        f.cache.inspect("k").await?.expect("present").meta.sliding_ms,
        Some(5_000)
    );
    // And a zero default is refused at build time, naming the limits.
    let e = Fixture::with(b, |b| b.default_sliding(Duration::ZERO)).unwrap_err();
    let e = e.downcast::<corral::Error>()?;
    assert_eq!(
        (e.kind(), e.argument()),
        (ErrorKind::InvalidArgument, Some("limits"))
    );
    Ok(())
}

async fn missing_entries_are_not_errors(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    assert_eq!(f.cache.get("nothing").await?, None);
    assert!(!f.cache.refresh("nothing").await?);
    assert!(!f.cache.remove("nothing").await?);
    assert_eq!(f.cache.inspect("nothing").await?, None);
    Ok(())
}

async fn a_removed_entry_is_gone(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache.set("k", "v", EntryOptions::new()).await?;
    assert!(f.cache.remove("k").await?);
    assert_eq!(f.cache.get("k").await?, None);
    assert!(!f.cache.refresh("k").await?);
    assert!(!f.stored("k").await?);
    Ok(())
}

async fn a_set_replaces_value_and_expiry(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache
        .set("k", "one", EntryOptions::new().relative(10 * SEC))
        .await?;
    f.cache.set("k", "two", EntryOptions::new().relative(MIN)).await?;
    f.clock.advance(30 * SEC);
    assert_eq!(f.cache.get("k").await?.as_deref(), Some(&b"two"[..]));
    Ok(())
}

async fn corrupt_is_a_counted_miss(b: Backend, bytes: &[u8]) -> Result<()> {
    let f = Fixture::new(b)?;
    f.plant("bad", bytes).await?;
    assert_eq!(
        f.cache.get("bad").await?,
        None,
        "corrupt data never reaches the caller"
    );
    assert_eq!(f.cache.metrics().corrupt, 1);
    assert!(!f.stored("bad").await?, "and it is removed");
    // Inspecting corrupt bytes says what is wrong rather than guessing.
    f.plant("bad", bytes).await?;
    assert_eq!(
        f.cache.inspect("bad").await.unwrap_err().kind(),
        ErrorKind::Corrupt
    );
    Ok(())
}

async fn foreign_bytes_are_a_miss_removed_and_counted(b: Backend) -> Result<()> {
    corrupt_is_a_counted_miss(b, b"{\"written\":\"by someone else\"}").await
}

async fn a_truncated_envelope_is_a_miss_removed_and_counted(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache
        .set("good", "a value of some length", EntryOptions::new())
        .await?;
    let whole = f.cache.entries().get(&f.name("good")).await?.expect("stored");
    corrupt_is_a_counted_miss(b, &whole[..whole.len() - 3]).await?;
    corrupt_is_a_counted_miss(b, &whole[..20]).await
}

async fn an_unknown_envelope_version_is_a_miss_removed_and_counted(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    f.cache.set("good", "v", EntryOptions::new()).await?;
    let mut bytes = f
        .cache
        .entries()
        .get(&f.name("good"))
        .await?
        .expect("stored")
        .to_vec();
    bytes[3] = 9;
    corrupt_is_a_counted_miss(b, &bytes).await
}

async fn inspect_shows_the_stored_meta_without_touching(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let start = f.clock_now();
    f.cache
        .set("k", "12345", EntryOptions::new().sliding(MIN))
        .await?;
    f.clock.advance(30 * SEC);
    let i = f.cache.inspect("k").await?.expect("present");
    assert_eq!((i.value_len, i.fresh), (5, true));
    assert_eq!(i.meta.expires_at_ms, start + 60_000, "inspect does not slide");
    f.clock.advance(30 * SEC);
    // A store that keeps the moment has dropped it by now; any other still holds it,
    // but not fresh.
    let i = f.cache.inspect("k").await?;
    assert!(i.as_ref().is_none_or(|i| !i.fresh), "{i:?}");
    Ok(())
}

trait ClockNow {
    fn clock_now(&self) -> u64;
}

impl ClockNow for Fixture {
    fn clock_now(&self) -> u64 {
        use corral::Clock;
        self.clock.now_ms()
    }
}

/// A duration the guest accepts works on every store; one past the latest expiry a
/// store keeps is an argument error on every store (contract §3.4). Before, a relative
/// expiry of 2^62 ms worked in memory and failed on Redis as an outage.
async fn one_expiry_rule_holds_on_every_store(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    f.cache
        .set("long", "v", EntryOptions::new().relative(century))
        .await?;
    f.cache
        .set("slides", "v", EntryOptions::new().sliding(century))
        .await?;
    f.clock.advance(century / 2);
    assert_eq!(f.cache.get("long").await?.as_deref(), Some(&b"v"[..]));
    assert_eq!(f.cache.get("slides").await?.as_deref(), Some(&b"v"[..]));
    let beyond = Duration::from_millis(1 << 62);
    assert_eq!(
        arg_error(f.cache.set("k", "v", EntryOptions::new().relative(beyond)).await),
        invalid("relative")
    );
    assert_eq!(
        arg_error(f.cache.set("k", "v", EntryOptions::new().sliding(beyond)).await),
        invalid("sliding")
    );
    assert!(!f.stored("k").await?, "nothing stored");
    Ok(())
}

/// A key of another Redis type under the cache's prefix is a corrupt entry: a miss,
/// removed and counted, and a get-or-set then loads and caches normally instead of
/// degrading on every call (contract §4). The memory store holds only bytes: there the
/// same bytes-level corruption is covered above.
async fn a_value_of_another_redis_type_is_a_corrupt_miss(b: Backend) -> Result<()> {
    let f = Fixture::new(b)?;
    let Some(mut conn) = f.raw() else {
        return Ok(());
    };
    ::redis::cmd("HSET")
        .arg(f.name("k"))
        .arg("field")
        .arg("value")
        .query_async::<()>(&mut conn)
        .await?;
    assert_eq!(f.cache.get("k").await?, None, "a miss, not an outage");
    assert_eq!(f.cache.metrics().corrupt, 1);
    assert!(!f.stored("k").await?, "and removed");
    ::redis::cmd("RPUSH")
        .arg(f.name("k"))
        .arg("item")
        .query_async::<()>(&mut conn)
        .await?;
    let v = f
        .cache
        .get_or_set("k", EntryOptions::new(), || async {
            Ok::<_, std::io::Error>("loaded")
        })
        .await?;
    assert_eq!(v, "loaded");
    let m = f.cache.metrics();
    assert_eq!((m.corrupt, m.degraded, m.loads), (2, 0, 1));
    assert_eq!(
        f.cache.get("k").await?.as_deref(),
        Some(&b"loaded"[..]),
        "and cached"
    );
    Ok(())
}
