//! The contract vectors (tests/vectors/*.json) against the native body and against the
//! component's portable body in wasmtime, each over the in-memory L2 and over a real
//! redis-server. The same files run in Node through jco (tests/jco); all hosts must agree.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use corral::locks::MemoryLocks;
use corral::portable::PortableCache;
use corral::store::memory::MemoryStore;
use corral::{Clock, Corral, EntryOptions, ErrorKind, LoadOptions, ManualClock};
use corral_core::names::{Kind, name};
use corral_tests::RedisServer;
use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde_json::{Value, json};

/// Where every vector's clock starts.
const T0: u64 = 1_700_000_000_000;

/// Where the vector files are (CORRAL_VECTORS_DIR runs another set, e.g. a
/// deliberately broken scratch copy).
fn vectors_dir() -> PathBuf {
    std::env::var_os("CORRAL_VECTORS_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("vectors"),
        PathBuf::from,
    )
}

/// The vectors of one file, `tests/vectors/{name}.json`.
fn vectors(name: &str) -> Result<Vec<Value>> {
    let file = vectors_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a list of vectors", file.display()))
}

enum Body {
    Native {
        cache: Corral,
        locks: MemoryLocks,
        /// Whether the vector asks for eager refresh (loads may run in the background).
        eager: bool,
    },
    Portable(PortableCache),
}

fn setting(settings: &Value, name: &str) -> Option<u64> {
    settings.get(name).and_then(Value::as_u64)
}

/// The L2 every process of a vector shares.
enum SharedL2 {
    Memory(MemoryStore),
    /// A redis-server, the vector's keys under `prefix`.
    Redis {
        url: String,
        prefix: String,
    },
}

impl SharedL2 {
    fn prefix(&self) -> &str {
        match self {
            SharedL2::Memory(_) => corral::DEFAULT_PREFIX,
            SharedL2::Redis { prefix, .. } => prefix,
        }
    }

    /// Lets `key`'s get-or-set lock lapse, as it does under a leader paused past its
    /// TTL; says whether one was held.
    async fn lapse_flight_lock(&self, key: &str) -> Result<bool> {
        let lock = name(self.prefix(), key, Kind::FlightLock);
        match self {
            SharedL2::Memory(store) => Ok(store.lapse_lock(&lock)),
            SharedL2::Redis { url, .. } => {
                let mut conn = redis::Client::open(url.as_str())?
                    .get_multiplexed_async_connection()
                    .await?;
                let deleted: u64 = redis::cmd("DEL").arg(&lock).query_async(&mut conn).await?;
                Ok(deleted == 1)
            }
        }
    }
}

impl Body {
    /// A body (a process) over the vector's shared L2.
    fn new(portable: bool, settings: &Value, clock: &ManualClock, l2: &SharedL2) -> Result<Body> {
        let (memory, redis) = match l2 {
            SharedL2::Memory(store) => (Some(store.clone()), None),
            SharedL2::Redis { url, prefix } => {
                let mut o = corral::RedisOptions::new(url.clone());
                o.prefix = prefix.clone();
                (None, Some(o))
            }
        };
        let sliding = setting(settings, "default_sliding_ms").map(Duration::from_millis);
        let key_bytes = setting(settings, "max_key_bytes").map(|n| n as u32);
        let value_bytes = setting(settings, "max_value_bytes").map(|n| n as u32);
        let hard_timeout = setting(settings, "hard_timeout_ms").map(Duration::from_millis);
        let throttle = setting(settings, "fail_safe_throttle_ms").map(Duration::from_millis);
        let eager = setting(settings, "eager_refresh_permille").map(|p| p as f64 / 1000.0);
        let soft_timeout = setting(settings, "soft_timeout_ms").map(Duration::from_millis);
        if portable {
            let mut b = PortableCache::builder().clock(clock.clone());
            if let Some(s) = sliding {
                b = b.default_sliding(s);
            }
            if let Some(n) = key_bytes {
                b = b.max_key_bytes(n);
            }
            if let Some(n) = value_bytes {
                b = b.max_value_bytes(n);
            }
            if let Some(t) = hard_timeout {
                b = b.hard_timeout(t);
            }
            if let Some(t) = throttle {
                b = b.fail_safe_throttle(t);
            }
            if let Some(f) = eager {
                b = b.eager_refresh(f);
            }
            if let Some(o) = redis {
                b = b.redis_options(o);
            }
            if let Some(m) = memory {
                b = b.memory(m);
            }
            return Ok(Body::Portable(b.build()?));
        }
        let mut b = Corral::builder().clock(clock.clone());
        if let Some(s) = sliding {
            b = b.default_sliding(s);
        }
        if let Some(n) = key_bytes {
            b = b.max_key_bytes(n);
        }
        if let Some(n) = value_bytes {
            b = b.max_value_bytes(n);
        }
        if let Some(t) = hard_timeout {
            b = b.hard_timeout(t);
        }
        if let Some(t) = throttle {
            b = b.fail_safe_throttle(t);
        }
        if let Some(f) = eager {
            b = b.eager_refresh(f);
        }
        if let Some(t) = soft_timeout {
            b = b.soft_timeout(t);
        }
        if let Some(o) = redis {
            b = b.redis_options(o);
        }
        if let Some(m) = memory {
            b = b.memory(m);
        }
        Ok(Body::Native {
            cache: b.build()?,
            locks: MemoryLocks::with_clock(clock.clone())?,
            eager: eager.is_some(),
        })
    }
}

fn options(step: &Value, now: u64) -> EntryOptions {
    let o = &step["options"];
    let mut options = EntryOptions::new();
    if let Some(ms) = o.get("relative_ms").and_then(Value::as_u64) {
        options = options.relative(Duration::from_millis(ms));
    }
    if let Some(ms) = o.get("sliding_ms").and_then(Value::as_u64) {
        options = options.sliding(Duration::from_millis(ms));
    }
    if let Some(offset) = o.get("absolute_in_ms").and_then(Value::as_i64) {
        options = options.absolute_at_ms(now.saturating_add_signed(offset));
    }
    if let Some(ms) = o.get("max_stale_ms").and_then(Value::as_u64) {
        options = options.fail_safe(Duration::from_millis(ms));
    }
    options
}

/// A result as the vectors spell it: `{"value": ..}` or an error.
fn outcome<T: Into<Value>>(r: corral::Result<T>) -> Value {
    match r {
        Ok(v) => json!({"value": v.into()}),
        Err(e) => error(&e),
    }
}

/// A result without a value: `{"ok": true}` or an error.
fn done(r: corral::Result<()>) -> Value {
    match r {
        Ok(()) => json!({"ok": true}),
        Err(e) => error(&e),
    }
}

fn error(e: &corral::Error) -> Value {
    let kind = match e.kind() {
        ErrorKind::InvalidArgument => "invalid-argument",
        ErrorKind::Loader => "loader",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::Corrupt => "corrupt",
        ErrorKind::Timeout => "timeout",
        _ => "other",
    };
    match e.argument() {
        Some(a) => json!({"error": kind, "argument": a}),
        None => json!({"error": kind}),
    }
}

fn text(v: Option<bytes::Bytes>) -> Value {
    v.map_or(Value::Null, |b| {
        Value::String(String::from_utf8_lossy(&b).into_owned())
    })
}

/// One vector's world: its processes (a body each, named by the steps' `process`,
/// "a" by default), the L2 they share and the clock they read. Mismatches of steps run
/// inside a loader (`during`) are kept here.
struct World {
    bodies: BTreeMap<String, Body>,
    clock: ManualClock,
    l2: SharedL2,
    failures: Mutex<Vec<String>>,
    /// Steps run, nested ones included.
    ran: AtomicUsize,
}

/// The processes a vector's steps name, nested steps included.
fn processes(steps: &[Value], into: &mut Vec<String>) {
    for step in steps {
        let p = step["process"].as_str().unwrap_or("a").to_owned();
        if !into.contains(&p) {
            into.push(p);
        }
        if let Some(during) = step["loader"]["during"].as_array() {
            processes(during, into);
        }
    }
}

impl World {
    fn body(&self, step: &Value) -> Result<&Body> {
        let p = step["process"].as_str().unwrap_or("a");
        self.bodies.get(p).with_context(|| format!("no process {p:?}"))
    }

    /// Runs `steps` in order, checking each against its expectations; `at` names them
    /// in a mismatch.
    fn run_steps<'a>(self: &'a Arc<Self>, steps: &'a [Value], at: String) -> BoxFuture<'a, Result<()>> {
        async move {
            for (i, step) in steps.iter().enumerate() {
                let loads = Arc::new(AtomicUsize::new(0));
                let Some(got) = run_step(self, step, &loads).await? else {
                    continue;
                };
                self.ran.fetch_add(1, Ordering::SeqCst);
                let expect = expectation(step);
                let mut failures = self.failures.lock();
                if got != expect {
                    failures.push(format!(
                        "{at} step {i} ({}): expected {expect}, got {got}",
                        step["op"]
                    ));
                }
                if let Some(expected) = step.get("loads").and_then(Value::as_u64) {
                    let n = loads.load(Ordering::SeqCst) as u64;
                    if n != expected {
                        failures.push(format!(
                            "{at} step {i}: expected {expected} loader call(s), got {n}"
                        ));
                    }
                }
            }
            Ok(())
        }
        .boxed()
    }
}

/// A loader's `during` steps, run by another process while the loader runs: they
/// interleave with the load at a known point.
fn during(step: &Value) -> Vec<Value> {
    step["loader"]["during"].as_array().cloned().unwrap_or_default()
}

async fn run_step(world: &Arc<World>, step: &Value, loads: &Arc<AtomicUsize>) -> Result<Option<Value>> {
    let clock = &world.clock;
    let key = step["key"].as_str().unwrap_or_default();
    let owner = step["owner"].as_str().unwrap_or_default();
    let value = step["value"].as_str().unwrap_or_default().as_bytes().to_vec();
    let now = clock.now_ms();
    let tags: Vec<String> = step["tags"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let tag = step["tag"].as_str().unwrap_or_default();
    let op = step["op"].as_str().context("op")?;
    match op {
        "advance" => {
            clock.advance(Duration::from_millis(step["ms"].as_u64().context("ms")?));
            return Ok(None);
        }
        "lapse_flight_lock" => return Ok(Some(json!({"value": world.l2.lapse_flight_lock(key).await?}))),
        _ => {}
    }
    let body = world.body(step)?;
    let got = match (op, body) {
        ("set", Body::Native { cache, .. }) if !tags.is_empty() => {
            done(cache.set_tagged(key, value, options(step, now), &tags).await)
        }
        ("set", Body::Portable(p)) if !tags.is_empty() => {
            done(p.set_tagged(key, value, options(step, now), &tags).await)
        }
        ("set", Body::Native { cache, .. }) => done(cache.set(key, value, options(step, now)).await),
        ("set", Body::Portable(p)) => done(p.set(key, value, options(step, now)).await),
        ("remove_by_tag", Body::Native { cache, .. }) => done(cache.remove_by_tag(tag).await),
        ("remove_by_tag", Body::Portable(p)) => done(p.remove_by_tag(tag).await),
        ("expire_by_tag", Body::Native { cache, .. }) => done(cache.expire_by_tag(tag).await),
        ("expire_by_tag", Body::Portable(p)) => done(p.expire_by_tag(tag).await),
        ("clear", Body::Native { cache, .. }) => done(cache.clear().await),
        ("clear", Body::Portable(p)) => done(p.clear().await),
        ("get", Body::Native { cache, .. }) => outcome(cache.get(key).await.map(text)),
        ("get", Body::Portable(p)) => outcome(p.get(key).await.map(text)),
        ("refresh", Body::Native { cache, .. }) => outcome(cache.refresh(key).await),
        ("refresh", Body::Portable(p)) => outcome(p.refresh(key).await),
        ("remove", Body::Native { cache, .. }) => outcome(cache.remove(key).await),
        ("remove", Body::Portable(p)) => outcome(p.remove(key).await),
        ("expire", Body::Native { cache, .. }) => outcome(cache.expire(key).await),
        ("expire", Body::Portable(p)) => outcome(p.expire(key).await),
        ("get_or_set", body) => {
            let loaded: std::result::Result<Vec<u8>, String> = match step["loader"].get("value") {
                Some(v) => Ok(v.as_str().unwrap_or_default().as_bytes().to_vec()),
                None => Err(step["loader"]["error"].as_str().unwrap_or("failed").to_string()),
            };
            let cacheable = step["should_cache"].as_bool().unwrap_or(true);
            let bypass = step["bypass"].as_bool().unwrap_or(false);
            // A slow loader: the clock moves this much while it runs.
            let takes = Duration::from_millis(step["loader"]["takes_ms"].as_u64().unwrap_or(0));
            let counter = loads.clone();
            let clock = clock.clone();
            // Steps of other processes, run inside the loader (before its clock moves).
            let (world, during, at) = (world.clone(), during(step), format!("{key:?}'s loader:"));
            let r = match body {
                Body::Native { cache, eager, .. } => {
                    let o = LoadOptions::new()
                        .entry(options(step, now))
                        .bypass(bypass)
                        .tags(tags.clone())
                        .should_cache(move |_| cacheable);
                    let load = move || async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        world
                            .run_steps(&during, at)
                            .await
                            .map_err(std::io::Error::other)?;
                        clock.advance(takes);
                        loaded.map_err(std::io::Error::other)
                    };
                    // With eager refresh the loader may run in the background: `fetch`,
                    // then wait for every flight (a refresh) to end before counting loads.
                    if *eager {
                        let r = cache.fetch(key, o, load).await;
                        while cache.flights_in_progress() + cache.background_in_progress() > 0 {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        r
                    } else {
                        cache.get_or_set(key, o, load).await
                    }
                }
                Body::Portable(p) => {
                    // The loader runs on the call's blocking thread: it may block on the runtime.
                    let runtime = tokio::runtime::Handle::current();
                    let load = move |_: &str| {
                        counter.fetch_add(1, Ordering::SeqCst);
                        runtime
                            .block_on(world.run_steps(&during, at.clone()))
                            .map_err(|e| format!("{e:#}"))?;
                        clock.advance(takes);
                        loaded.clone()
                    };
                    let o = LoadOptions::new()
                        .entry(options(step, now))
                        .bypass(bypass)
                        .tags(tags.clone())
                        .should_cache(move |_| cacheable);
                    p.get_or_set(key, o, load).await
                }
            };
            outcome(r.map(|b| text(Some(b))))
        }
        ("try_lock", body) => {
            let ttl = Duration::from_millis(step["ttl_ms"].as_u64().context("ttl_ms")?);
            match body {
                Body::Native { locks, .. } => outcome(locks.try_lock(key, owner, ttl)),
                Body::Portable(p) => outcome(p.try_lock(key, owner, ttl).await),
            }
        }
        ("acquire", body) => {
            let ttl = Duration::from_millis(step["ttl_ms"].as_u64().context("ttl_ms")?);
            match body {
                Body::Native { locks, .. } => outcome(locks.acquire(key, owner, ttl)),
                Body::Portable(p) => outcome(p.acquire(key, owner, ttl).await),
            }
        }
        ("unlock", Body::Native { locks, .. }) => outcome(locks.unlock(key, owner)),
        ("unlock", Body::Portable(p)) => outcome(p.unlock(key, owner).await),
        ("is_locked_by", Body::Native { locks, .. }) => outcome(locks.is_locked_by(key, owner)),
        ("is_locked_by", Body::Portable(p)) => outcome(p.is_locked_by(key, owner).await),
        ("is_lock_expired", Body::Native { locks, .. }) => outcome(locks.is_lock_expired(key)),
        ("is_lock_expired", Body::Portable(p)) => outcome(p.is_lock_expired(key).await),
        ("get_or_set_together", body) => together(body, step, now, loads).await?,
        ("get_or_set_many", body) => many(world, body, step, now, &tags, loads).await?,
        (op, _) => anyhow::bail!("unknown op {op:?}"),
    };
    Ok(Some(got))
}

/// How a scripted loader ends.
#[derive(Clone, Debug)]
enum Script {
    Value(Vec<u8>),
    Error(String),
    Abandon,
}

fn script(loader: &Value) -> Script {
    if let Some(v) = loader.get("value") {
        return Script::Value(v.as_str().unwrap_or_default().as_bytes().to_vec());
    }
    if loader.get("abandon").is_some() {
        return Script::Abandon;
    }
    Script::Error(loader["error"].as_str().unwrap_or("failed").to_string())
}

/// Waits (bounded) until `probe` holds; the probe reads the registry, which has no
/// notification of its own.
async fn until(what: &str, probe: impl Fn() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !probe() {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// `get_or_set_together`: the first caller leads and its loader holds until every other
/// caller waits on its flight; then it ends as scripted (see tests/vectors/README.md).
async fn together(body: &Body, step: &Value, now: u64, loads: &Arc<AtomicUsize>) -> Result<Value> {
    let key = step["key"].as_str().context("key")?.to_owned();
    let callers = step["callers"].as_array().context("callers")?;
    let entry = options(step, now);
    // The leader's loader: says it entered, then waits for the gate.
    let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
    let mut entered_rx = Some(entered_rx);
    let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    let gate_rx = Arc::new(std::sync::Mutex::new(gate_rx));
    let mut tasks = Vec::new();
    for (i, caller) in callers.iter().enumerate() {
        let scripted = script(&caller["loader"]);
        let cacheable = caller["should_cache"].as_bool().unwrap_or(true);
        let (key, loads) = (key.clone(), loads.clone());
        let leader = i == 0;
        let (entered, gate) = (entered_tx.clone(), gate_rx.clone());
        // Blocks the calling thread: fine for the portable body (a blocking thread), and
        // for the native body run as its own task on a multi-thread runtime.
        let load = move || -> std::result::Result<Vec<u8>, String> {
            loads.fetch_add(1, Ordering::SeqCst);
            if leader {
                let _ = entered.send(());
                let _ = gate.lock().expect("gate").recv();
            }
            match scripted.clone() {
                Script::Value(v) => Ok(v),
                Script::Error(e) => Err(e),
                // The caller is gone by now; whatever this returns is never seen.
                Script::Abandon => Err("abandoned".into()),
            }
        };
        let task = match body {
            Body::Native { cache, .. } => {
                let cache = cache.clone();
                let o = LoadOptions::new().entry(entry).should_cache(move |_| cacheable);
                tokio::spawn(async move {
                    cache
                        .get_or_set(&key, o, || async move {
                            tokio::task::spawn_blocking(load)
                                .await
                                .expect("loader thread")
                                .map_err(std::io::Error::other)
                        })
                        .await
                })
            }
            Body::Portable(p) => {
                let p = p.clone();
                let mut load = Some(load);
                tokio::spawn(async move {
                    let once = move |_: &str| load.take().map_or(Err("loaded twice".into()), |l| l());
                    let o = LoadOptions::new().entry(entry).should_cache(move |_| cacheable);
                    p.get_or_set(&key, o, once).await
                })
            }
        };
        tasks.push(task);
        if let Some(entered) = entered_rx.take() {
            // The leader is in its loader before anyone else calls.
            tokio::task::spawn_blocking(move || entered.recv_timeout(Duration::from_secs(10))).await??;
        }
    }
    let followers = callers.len() - 1;
    until("every follower waits on the leader", || match body {
        Body::Native { cache, .. } => cache.followers_of(&key) == followers,
        Body::Portable(p) => p.followers_of(&key) == followers,
    })
    .await?;
    let mut tasks = tasks.into_iter();
    let leader = tasks.next().context("a leader")?;
    let mut got = Vec::new();
    if matches!(script(&callers[0]["loader"]), Script::Abandon) {
        // The leader's caller goes away mid-load; its loader then returns into nothing.
        leader.abort();
        anyhow::ensure!(
            leader.await.is_err_and(|e| e.is_cancelled()),
            "the leader was cancelled"
        );
        gate_tx.send(())?;
        got.push(json!({"abandoned": true}));
    } else {
        gate_tx.send(())?;
        got.push(outcome(leader.await?.map(|b| text(Some(b)))));
    }
    for task in tasks {
        got.push(outcome(task.await?.map(|b| text(Some(b)))));
    }
    Ok(json!({"callers": got}))
}

/// What a step expects: `expect`, or for a together step each caller's, in order.
fn expectation(step: &Value) -> Value {
    match (step["callers"].as_array(), step.get("asked")) {
        (Some(callers), _) => {
            json!({"callers": callers.iter().map(|c| c["expect"].clone()).collect::<Vec<_>>()})
        }
        (None, Some(asked)) => {
            let mut expect = step["expect"].clone();
            expect["asked"] = asked.clone();
            expect
        }
        (None, None) => step["expect"].clone(),
    }
}

/// A `get_or_set_many` step: one answer per key (`{"each": [...]}`), or the call's
/// error; with `asked`, the keys the loader was asked for (sorted, every call's).
async fn many(
    world: &Arc<World>,
    body: &Body,
    step: &Value,
    now: u64,
    tags: &[String],
    loads: &Arc<AtomicUsize>,
) -> Result<Value> {
    let keys: Vec<String> = step["keys"]
        .as_array()
        .context("keys")?
        .iter()
        .map(|k| k.as_str().unwrap_or_default().to_owned())
        .collect();
    let values: BTreeMap<String, Vec<u8>> = step["loader"]["values"]
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().as_bytes().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    let failure = step["loader"]["error"].as_str().map(str::to_owned);
    let asked = Arc::new(Mutex::new(Vec::<String>::new()));
    let (counter, noted) = (loads.clone(), asked.clone());
    let (world2, during, at) = (world.clone(), during(step), "a batch's loader:".to_owned());
    // One call of the loader: its `during` steps run in the first call only.
    let ran_during = Arc::new(AtomicUsize::new(0));
    let load = move |keys: Vec<String>| -> (Vec<Value>, BTreeMap<String, Vec<u8>>, Option<String>) {
        counter.fetch_add(1, Ordering::SeqCst);
        noted.lock().extend(keys.iter().cloned());
        let found = keys
            .iter()
            .filter_map(|k| values.get(k).map(|v| (k.clone(), v.clone())))
            .collect();
        let steps = if ran_during.fetch_add(1, Ordering::SeqCst) == 0 {
            during.clone()
        } else {
            Vec::new()
        };
        (steps, found, failure.clone())
    };
    let o = LoadOptions::new().entry(options(step, now)).tags(tags.to_vec());
    let answers = match body {
        Body::Native { cache, .. } => {
            let loader = |keys: Vec<String>| {
                let (steps, found, failure) = load(keys);
                let (world, at) = (world2.clone(), at.clone());
                async move {
                    world.run_steps(&steps, at).await.map_err(std::io::Error::other)?;
                    match failure {
                        Some(e) => Err(std::io::Error::other(e)),
                        None => Ok(found),
                    }
                }
            };
            cache.get_or_set_many(&keys, o, loader).await
        }
        Body::Portable(p) => {
            let runtime = tokio::runtime::Handle::current();
            let loader = move |keys: &[String]| {
                let (steps, found, failure) = load(keys.to_vec());
                runtime
                    .block_on(world2.run_steps(&steps, at.clone()))
                    .map_err(|e| format!("{e:#}"))?;
                match failure {
                    Some(e) => Err(e),
                    None => Ok(found.into_iter().collect()),
                }
            };
            p.get_or_set_many(&keys, o, loader).await
        }
    };
    let mut got = match answers {
        Ok(answers) => {
            let each: Vec<Value> = answers.into_iter().map(|a| outcome(a.map(text))).collect();
            json!({ "each": each })
        }
        Err(e) => error(&e),
    };
    if step.get("asked").is_some() {
        let mut asked = asked.lock().clone();
        asked.sort();
        got["asked"] = json!(asked);
    }
    Ok(got)
}

/// Where a file's vectors run.
#[derive(Clone, Copy, Debug)]
enum Host {
    /// The native body (`Corral`, `MemoryLocks`).
    Native,
    /// The component's own exports in wasmtime (`PortableCache`).
    Wasmtime,
}

/// Runs every vector of `file` on fresh bodies; returns (vectors, steps) run, or every
/// mismatch.
async fn run_file(file: &str, host: Host, redis: Option<&RedisServer>) -> Result<(usize, usize)> {
    let mut failures = Vec::new();
    let mut steps_run = 0;
    let vectors = vectors(file)?;
    for (n, vector) in vectors.iter().enumerate() {
        let name = vector["name"].as_str().unwrap_or("?");
        let steps = vector["steps"].as_array().context("steps")?;
        let clock = ManualClock::new(T0);
        // One Redis for all vectors: each its own tenant (prefix).
        let l2 = match redis {
            Some(server) => SharedL2::Redis {
                url: server.url(),
                prefix: format!("v{n}:"),
            },
            None => SharedL2::Memory(MemoryStore::new(
                Arc::new(clock.clone()),
                corral_core::Settings::DEFAULT.invalidation_interval_ms,
            )),
        };
        let mut names = Vec::new();
        processes(steps, &mut names);
        let mut bodies = BTreeMap::new();
        for p in names {
            let body = Body::new(matches!(host, Host::Wasmtime), &vector["settings"], &clock, &l2)?;
            bodies.insert(p, body);
        }
        let world = Arc::new(World {
            bodies,
            clock,
            l2,
            failures: Mutex::new(Vec::new()),
            ran: AtomicUsize::new(0),
        });
        world.run_steps(steps, format!("{name} /")).await?;
        steps_run += world.ran.load(Ordering::SeqCst);
        failures.append(&mut world.failures.lock());
    }
    anyhow::ensure!(
        failures.is_empty(),
        "{file}.json: {} mismatch(es):\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok((vectors.len(), steps_run))
}

async fn run(file: &str, host: Host, over_redis: bool) -> Result<()> {
    let server = over_redis.then(RedisServer::start).transpose()?;
    let (vectors, steps) = run_file(file, host, server.as_ref()).await?;
    let store = if over_redis { "redis-server" } else { "memory" };
    println!("{file}.json, {host:?} over {store}: {vectors} vectors, {steps} steps passed");
    anyhow::ensure!(vectors > 0, "{file}.json holds no vector");
    Ok(())
}

/// One module per vector file, one test per host and store: `vectors::expiry::native`
/// runs one file in one body. The list is checked against the directory below.
macro_rules! vector_files {
    ($($file:ident),* $(,)?) => {
        const FILES: &[&str] = &[$(stringify!($file)),*];
        $(
            mod $file {
                use super::{Host, run};

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn native() -> anyhow::Result<()> {
                    run(stringify!($file), Host::Native, false).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn native_over_redis() -> anyhow::Result<()> {
                    run(stringify!($file), Host::Native, true).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn wasmtime() -> anyhow::Result<()> {
                    run(stringify!($file), Host::Wasmtime, false).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn wasmtime_over_redis() -> anyhow::Result<()> {
                    run(stringify!($file), Host::Wasmtime, true).await
                }
            }
        )*
    };
}

vector_files!(
    batches, coalescing, errors, expiry, freshness, get_or_set, keys, locks, processes, tags
);

/// As wasmtime's `assert_test_exists`: a vector file without tests fails here.
#[test]
fn every_vector_file_has_its_tests() -> Result<()> {
    let mut on_disk: Vec<String> = std::fs::read_dir(vectors_dir())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = FILES.iter().map(|f| (*f).to_owned()).collect();
    listed.sort();
    assert_eq!(
        on_disk, listed,
        "every tests/vectors/*.json needs a line in vector_files!(...) in tests/tests/all/vectors.rs"
    );
    Ok(())
}

#[test]
fn wasmtime_loads_the_very_file_jco_runs() -> Result<()> {
    let on_disk = std::fs::read(corral::guest::GUEST_WASM_PATH)?;
    assert!(
        on_disk == corral::guest::GUEST_WASM,
        "{} differs from the embedded component",
        corral::guest::GUEST_WASM_PATH
    );
    Ok(())
}
