//! Tags and clear across processes over a real redis-server (contract §7.5): every
//! process stops serving an invalidated entry (from its L1 too) within the announcement
//! latency; tenants never see each other's tags or clears.
//!
//! The other processes are this very test binary, run again as `tags::child` (an
//! ignored test that only acts when `CORRAL_TAGS_CHILD` names a Redis): each builds its
//! own `Corral`, reads the entries into its own L1, and then answers `get KEY` lines on
//! stdin with `@@ KEY=VALUE` (or `@@ KEY=null`) on stdout.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use corral::{Corral, EntryOptions, RedisOptions};
use corral_tests::{RedisServer, until_a_hears_b};

const PREFIX: &str = "tags-mp:";
const LONG: Duration = Duration::from_secs(600);

fn cache(url: &str, prefix: &str) -> Result<Corral> {
    let mut o = RedisOptions::new(url);
    o.prefix = prefix.to_owned();
    Ok(Corral::builder().redis_options(o).build()?)
}

/// A cache on `server` under `prefix` whose clock moves only when told (standing at the
/// system's time now), with an L1 TTL of `l1_ttl`.
fn on_a_manual_clock(
    server: &RedisServer,
    prefix: &str,
    l1_ttl: Duration,
) -> Result<(Corral, corral::ManualClock)> {
    let clock = corral::ManualClock::starting_now();
    Ok((on_the_clock(server, prefix, l1_ttl, &clock)?, clock))
}

/// A cache on `server` under `prefix` on `clock`, with an L1 TTL of `l1_ttl`.
fn on_the_clock(
    server: &RedisServer,
    prefix: &str,
    l1_ttl: Duration,
    clock: &corral::ManualClock,
) -> Result<Corral> {
    let mut o = RedisOptions::new(server.url());
    o.prefix = prefix.to_owned();
    Ok(Corral::builder()
        .clock(clock.clone())
        .l1_ttl(l1_ttl)
        .redis_options(o)
        .build()?)
}

/// The child's side: serve `get` lines until stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by tags::invalidations_reach_every_process as another process"]
async fn child() -> Result<()> {
    let Ok(url) = std::env::var("CORRAL_TAGS_CHILD") else {
        return Ok(());
    };
    let cache = cache(&url, PREFIX)?;
    let answer = |key: &str, v: Option<bytes::Bytes>| {
        let v = v.map_or("null".to_owned(), |b| String::from_utf8_lossy(&b).into_owned());
        println!("@@ {key}={v}");
        std::io::stdout().flush().ok();
    };
    // Fill this process's L1. A fill is refused when L1 is flushed while it reads (the
    // subscription connecting says announcements may have been missed): fill again until
    // a second pass is served from L1, a bounded number of times.
    let mut hits = 0;
    for _ in 0..50 {
        for key in ["a", "b", "c"] {
            cache.get(key).await?;
        }
        let hits_before = cache.metrics().l1_hits;
        for key in ["a", "b", "c"] {
            cache.get(key).await?;
        }
        hits = cache.metrics().l1_hits - hits_before;
        if hits == 3 {
            break;
        }
    }
    println!("@@ ready l1_hits={hits}");
    std::io::stdout().flush().ok();
    // Stdin is read on a thread of its own: the runtime's threads never block.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    while let Some(line) = rx.recv().await {
        let Some(key) = line.strip_prefix("get ") else {
            continue;
        };
        let v = cache.get(key).await?;
        answer(key, v);
    }
    Ok(())
}

struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(url: &str) -> Result<Peer> {
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "tags::child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("CORRAL_TAGS_CHILD", url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("spawning a peer process")?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("stdout")?);
        Ok(Peer { child, stdin, stdout })
    }

    /// The next `@@` line.
    fn line(&mut self) -> Result<String> {
        loop {
            let mut line = String::new();
            if self.stdout.read_line(&mut line)? == 0 {
                bail!("the peer ended");
            }
            // libtest may print "test tags::child ... " before the first answer.
            if let Some(at) = line.find("@@ ") {
                return Ok(line[at + 3..].trim_end().to_owned());
            }
        }
    }

    fn get(&mut self, key: &str) -> Result<String> {
        writeln!(self.stdin, "get {key}")?;
        self.stdin.flush()?;
        let line = self.line()?;
        Ok(line
            .strip_prefix(&format!("{key}="))
            .context("an answer")?
            .to_owned())
    }

    /// Polls `key` until it reads `want`, within `within`; returns how long it took.
    fn until(&mut self, key: &str, want: &str, within: Duration) -> Result<Duration> {
        let start = Instant::now();
        loop {
            let got = self.get(key)?;
            if got == want {
                return Ok(start.elapsed());
            }
            if start.elapsed() > within {
                bail!("{key} still read {got:?}, not {want:?}, after {within:?}");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two other processes hold `a` (tag `news`), `b` (tag `sports`) and `c` (untagged) in
/// their L1. `remove_by_tag("news")` here: both stop serving `a` within the window and
/// keep `b` and `c`; `expire_by_tag("sports")`: `b` goes too; `clear()`: `c` goes, and
/// a value set afterwards is served everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidations_reach_every_process() -> Result<()> {
    let server = RedisServer::start()?;
    let url = server.url();
    let here = cache(&url, PREFIX)?;
    here.set_tagged("a", b"a".to_vec(), EntryOptions::new().relative(LONG), &["news"])
        .await?;
    here.set_tagged(
        "b",
        b"b".to_vec(),
        EntryOptions::new().relative(LONG),
        &["sports", "x"],
    )
    .await?;
    here.set("c", b"c".to_vec(), EntryOptions::new().relative(LONG))
        .await?;
    let mut peers = vec![Peer::spawn(&url)?, Peer::spawn(&url)?];
    for peer in &mut peers {
        let ready = peer.line()?;
        assert_eq!(
            ready, "ready l1_hits=3",
            "every entry is served from the peer's L1"
        );
    }
    // The announcement travels while remove_by_tag returns; a bounded poll, not a sleep.
    let window = Duration::from_secs(2);
    here.remove_by_tag("news").await?;
    for peer in &mut peers {
        let took = peer.until("a", "null", window)?;
        eprintln!("a peer stopped serving a removed tag's entry {took:?} after remove_by_tag returned");
        assert_eq!(peer.get("b")?, "b");
        assert_eq!(peer.get("c")?, "c");
    }
    here.expire_by_tag("x").await?;
    for peer in &mut peers {
        peer.until("b", "null", window)?;
        assert_eq!(peer.get("c")?, "c");
    }
    here.clear().await?;
    for peer in &mut peers {
        peer.until("c", "null", window)?;
    }
    assert_eq!(here.get("c").await?, None);
    // After the clear, new writes are served to everyone (in the new generation).
    here.set_tagged("a", b"a2".to_vec(), EntryOptions::new().relative(LONG), &["news"])
        .await?;
    for peer in &mut peers {
        peer.until("a", "a2", window)?;
    }
    let m = here.metrics();
    assert_eq!((m.tag_invalidations, m.clears), (2, 1));
    Ok(())
}

/// Two tenants (prefixes) on one Redis, with the same keys and the same tags: one's
/// `remove_by_tag` and `clear` leave the other's entries alone, in L1 and in L2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_see_each_others_tags_or_clears() -> Result<()> {
    let server = RedisServer::start()?;
    let (one, two) = (
        cache(&server.url(), "tenant-1:")?,
        cache(&server.url(), "tenant-2:")?,
    );
    let two_fresh = cache(&server.url(), "tenant-2:")?; // no L1 copy: reads L2
    for c in [&one, &two] {
        c.set_tagged("k", b"v".to_vec(), EntryOptions::new().relative(LONG), &["t"])
            .await?;
        c.set("u", b"u".to_vec(), EntryOptions::new().relative(LONG))
            .await?;
    }
    tokio::time::sleep(Duration::from_millis(2)).await; // the removal must be later than the writes
    one.remove_by_tag("t").await?;
    assert_eq!(one.get("k").await?, None);
    one.clear().await?;
    assert_eq!(one.get("u").await?, None);
    for c in [&two, &two_fresh] {
        assert_eq!(c.get("k").await?.as_deref(), Some(&b"v"[..]));
        assert_eq!(c.get("u").await?.as_deref(), Some(&b"u"[..]));
    }
    Ok(())
}

/// Bad tags are argument errors naming `tags` or `tag`, before anything is written.
#[tokio::test]
async fn bad_tags_name_the_argument() -> Result<()> {
    let cache = Corral::builder().build()?;
    let e = cache
        .set_tagged("k", b"v".to_vec(), EntryOptions::new(), &vec!["t"; 17])
        .await
        .unwrap_err();
    assert_eq!(e.argument(), Some("tags"));
    assert_eq!(cache.remove_by_tag("").await.unwrap_err().argument(), Some("tag"));
    assert_eq!(cache.get("k").await?, None);
    Ok(())
}

/// A load that began before a `clear()` and lands after it writes under the old
/// generation's name, which nobody reads again; this process's L1 must not keep it either
/// (before the fix the flight took its L1 ticket after the clear and filled L1, so `get`
/// served the pre-clear load here while every other process saw nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_running_across_a_clear_does_not_fill_l1() -> Result<()> {
    let server = RedisServer::start()?;
    for url in [None, Some(server.url())] {
        let (cache, other) = match &url {
            Some(url) => (cache(url, "clear-race:")?, Some(cache(url, "clear-race:")?)),
            None => (Corral::builder().build()?, None),
        };
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let load = {
            let cache = cache.clone();
            tokio::spawn(async move {
                cache
                    .get_or_set("k", EntryOptions::new().relative(LONG), || async move {
                        let _ = started_tx.send(());
                        let _ = go_rx.await;
                        Ok::<_, std::io::Error>("before the clear")
                    })
                    .await
            })
        };
        started_rx.await.context("the load started")?;
        cache.clear().await?;
        go_tx.send(()).ok();
        let loaded = load.await??;
        assert_eq!(&loaded[..], b"before the clear", "its caller gets what it loaded");
        assert_eq!(cache.get("k").await?, None, "{url:?}: not served after the clear");
        if let Some(other) = other {
            assert_eq!(other.get("k").await?, None);
        }
    }
    Ok(())
}

/// A tagged write that begins after an invalidation of its tag completed, in this
/// process or another, is newer than it: served, whatever the millisecond. Invalidations
/// in a burst push a tag's moment ahead of the clock (each is later than the last), and
/// a writer used to stamp its write by its own clock and the moments it happened to
/// know: the probe's `remove_by_tag` then `set_tagged` in two processes lost 28 of 200
/// writes. Writes are now stamped after the moments read from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tagged_write_after_a_completed_removal_is_served_in_every_process() -> Result<()> {
    let server = RedisServer::start()?;
    let a = cache(&server.url(), "after-removal:")?;
    let b = cache(&server.url(), "after-removal:")?;
    let (mut sets_lost, mut loads_lost) = (0, 0);
    for i in 0..200 {
        a.remove_by_tag("t").await?;
        let key = format!("set{i}");
        b.set_tagged(&key, b"v".to_vec(), EntryOptions::new().relative(LONG), &["t"])
            .await?;
        if b.get(&key).await?.is_none() {
            sets_lost += 1;
        }
        a.remove_by_tag("t").await?;
        let key = format!("load{i}");
        let options = corral::LoadOptions::relative(LONG).tags(["t"]);
        b.get_or_set(&key, options, || async { Ok::<_, std::io::Error>("loaded") })
            .await?;
        if b.get(&key).await?.is_none() {
            loads_lost += 1;
        }
    }
    assert_eq!(
        (sets_lost, loads_lost),
        (0, 0),
        "acknowledged tagged writes its writer could not read"
    );
    Ok(())
}

/// In one process, on a clock that does not move: a tagged get-or-set right after
/// `remove_by_tag` is cached (its load began after the removal), so three calls load
/// once. Before, a load began in the removal's millisecond counted as older: 3 loads.
#[tokio::test]
async fn a_tagged_load_in_the_millisecond_of_a_removal_is_cached() -> Result<()> {
    let clock = corral::ManualClock::new(1_000_000);
    let cache = Corral::builder().clock(clock).build()?;
    cache.remove_by_tag("t").await?;
    let loads = std::sync::atomic::AtomicUsize::new(0);
    for _ in 0..3 {
        let options = corral::LoadOptions::relative(LONG).tags(["t"]);
        cache
            .get_or_set("k", options, || async {
                loads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, std::io::Error>("v")
            })
            .await?;
    }
    assert_eq!(loads.into_inner(), 1, "loaded once, then served");
    Ok(())
}

/// A moment a process keeps but the store lost (evicted; a restart loses it too) hides
/// nothing from it and deletes nothing: an entry its kept moments would remove is judged
/// again by the store's, as every other process judges it. A write made since, stamped
/// before the lost moment by a clock behind the keeper's, is served to the keeper too,
/// and a get-or-set there serves it rather than loading over it (contract §5.4, §7.5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moment_the_store_lost_hides_nothing_another_process_wrote() -> Result<()> {
    let server = RedisServer::start()?;
    let prefix = "lost:";
    let (ahead, clock) = on_a_manual_clock(&server, prefix, Duration::from_secs(60))?;
    clock.advance(Duration::from_secs(5));
    ahead.remove_by_tag("t").await?;
    let mut conn = server.connection().await?;
    let moments = format!("{{{}:{prefix}t}}:t", prefix.len());
    let lost: u32 = redis::cmd("DEL").arg(&moments).query_async(&mut conn).await?;
    assert_eq!(lost, 1, "the tag's moments were under {moments}");

    let writer = cache(&server.url(), prefix)?;
    writer
        .set_tagged("k", b"v".to_vec(), EntryOptions::new().relative(LONG), &["t"])
        .await?;
    let loads = AtomicUsize::new(0);
    let got = ahead
        .get_or_set("k", corral::LoadOptions::relative(LONG).tags(["t"]), || async {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(b"loaded".to_vec())
        })
        .await?;
    assert_eq!(
        (&got[..], loads.load(Ordering::SeqCst)),
        (&b"v"[..], 0),
        "the keeper loaded over a write the store's moments do not remove"
    );
    assert_eq!(ahead.get("k").await?.as_deref(), Some(&b"v"[..]));
    let reader = cache(&server.url(), prefix)?;
    assert_eq!(
        reader.get("k").await?.as_deref(),
        Some(&b"v"[..]),
        "the keeper deleted a write the store's moments do not remove"
    );
    // A later removal, stamped before the moment the keeper still keeps: its
    // announcement moves nothing the keeper keeps, so the keeper's L1 must not have
    // kept what the store's moments judged.
    reader.remove_by_tag("t").await?;
    assert_eq!(
        ahead.get("k").await?,
        None,
        "the keeper served from L1 an entry a completed remove_by_tag removed"
    );
    Ok(())
}

/// A process that swept the tags it no longer trusts (a service whose tags name users
/// keeps a bounded map) still stops serving an entry from L1 once a tag it was judged by
/// is removed by another process, even with its clock stepped back below the tag's
/// bound (contract §7.5). The step here (a minute) is itself a gap that flushes L1; that
/// the sweep alone makes L1 judge its tagged entries again (for a copy that outlives its
/// tags' bound without a step) is `cache::tags` `lapsed_tags_are_swept_out_once_the_map_doubles`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_swept_its_tags_still_stops_serving_a_removed_one() -> Result<()> {
    use corral::Clock as _;
    let server = RedisServer::start()?;
    let l1_ttl = Duration::from_secs(30);
    let (a, clock) = on_a_manual_clock(&server, "swept:", l1_ttl)?;
    let start = clock.now_ms();
    let b = cache(&server.url(), "swept:")?;
    a.set_tagged("k", b"v".to_vec(), EntryOptions::new().relative(LONG), &["t"])
        .await?;
    assert_eq!(a.get("k").await?.as_deref(), Some(&b"v"[..]));
    assert_eq!(a.metrics().l1_hits, 1, "served from L1");
    // Past what `a` may keep of "t"; then enough other tags that the lapsed one is swept.
    clock.advance(l1_ttl * 2);
    for n in 0..1_100 {
        let tag = format!("user:{n}");
        a.set_tagged(
            &format!("u{n}"),
            b"u".to_vec(),
            EntryOptions::new().relative(LONG),
            &[tag],
        )
        .await?;
    }
    // The clock steps back: the L1 copy of "k" is within its bound again.
    clock.set(start);
    b.remove_by_tag("t").await?;
    let began = Instant::now();
    while a.get("k").await?.is_some() {
        assert!(
            began.elapsed() < Duration::from_secs(3),
            "a removed tag's entry was still served from L1"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// A clear whose announcement never came (its process died between the write and the
/// publish) is learnt within the L1 TTL, the generation's trust, even across a wall
/// clock stepped back: the step is a gap in what this process heard (L1 flushed, the
/// generation read again), not an hour more of trust. A reading less than a second
/// behind is not a step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_back_does_not_extend_what_a_process_trusts() -> Result<()> {
    use corral::Clock as _;
    let server = RedisServer::start()?;
    let l1_ttl = Duration::from_secs(30);
    let prefix = "stepped:";
    let (a, clock) = on_a_manual_clock(&server, prefix, l1_ttl)?;
    let start = clock.now_ms();
    a.set("k", b"v".to_vec(), EntryOptions::new().relative(LONG))
        .await?;
    assert_eq!(a.get("k").await?.as_deref(), Some(&b"v"[..]));

    server.clear_unannounced(prefix, start).await?;
    clock.advance(Duration::from_secs(10));
    assert_eq!(
        a.get("k").await?.as_deref(),
        Some(&b"v"[..]),
        "within the L1 TTL, unheard: still served (the documented bound)"
    );
    let flushes = a.metrics().l1_flushes;
    clock.set(clock.now_ms() - 500);
    assert_eq!(a.get("k").await?.as_deref(), Some(&b"v"[..]));
    assert_eq!(
        a.metrics().l1_flushes,
        flushes,
        "half a second back is not a step"
    );

    // An hour back, then more than the L1 TTL forward.
    clock.set(start - 3_600_000);
    clock.advance(l1_ttl + Duration::from_secs(1));
    assert_eq!(
        a.get("k").await?,
        None,
        "the clear was not learnt within the L1 TTL of the clock's own time"
    );
    Ok(())
}

/// An L1 copy lives no longer than the generation it was named in is known: a read late
/// in that window, after a clear whose announcement never came, is served (the
/// documented bound), but its copy is not served past the L1 TTL of the last read of the
/// generation before the clear. Before, the copy lived a whole L1 TTL from the late
/// read, and the clear's removed value was served up to twice the L1 TTL after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_filled_late_in_the_generations_window_does_not_outlive_it() -> Result<()> {
    use corral::Clock as _;
    let server = RedisServer::start()?;
    let l1_ttl = Duration::from_secs(30);
    let prefix = "late-fill:";
    let (a, clock) = on_a_manual_clock(&server, prefix, l1_ttl)?;
    // The get-or-set's process: once the generation lapsed, a process's first read
    // learns the new one and empties its L1, so each check must be its process's first.
    let a2 = on_the_clock(&server, prefix, l1_ttl, &clock)?;
    let b = cache(&server.url(), prefix)?;
    until_a_hears_b(&a, &b, "subscribed").await?;
    until_a_hears_b(&a2, &b, "subscribed, 2").await?;
    // Written by another process, so not in the L1s (and their announcements heard):
    // one read by `get`, one by a get-or-set.
    for key in ["k", "k2"] {
        b.set(key, b"v".to_vec(), EntryOptions::new().relative(LONG))
            .await?;
    }
    until_a_hears_b(&a, &b, "written").await?;
    until_a_hears_b(&a2, &b, "written, 2").await?;
    let load = || async { Ok::<_, std::io::Error>("loaded") };

    server.clear_unannounced(prefix, clock.now_ms()).await?;
    clock.advance(l1_ttl - Duration::from_secs(1));
    assert_eq!(
        a.get("k").await?.as_deref(),
        Some(&b"v"[..]),
        "within the L1 TTL, unheard: still served (the documented bound)"
    );
    let options = EntryOptions::new().relative(LONG);
    assert_eq!(a2.get_or_set("k2", options, load).await?, "v");
    clock.advance(Duration::from_secs(2));
    assert_eq!(
        a.get("k").await?,
        None,
        "the copy filled late in the generation's window outlived it"
    );
    assert_eq!(
        a2.get_or_set("k2", options, load).await?,
        "loaded",
        "the get-or-set's copy filled late in the generation's window outlived it"
    );
    Ok(())
}
