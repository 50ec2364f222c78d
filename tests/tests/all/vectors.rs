//! The contract vectors (tests/vectors/*.json) against the native body and against the
//! component's portable body in wasmtime, each over the in-memory L2 and over a real
//! redis-server. The same files run in Node through jco (tests/jco); all hosts must agree.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use corral::locks::MemoryLocks;
use corral::portable::PortableCache;
use corral::{Clock, Corral, EntryOptions, ErrorKind, LoadOptions, ManualClock};
use corral_tests::RedisServer;
use serde_json::{Value, json};

/// Where every vector's clock starts.
const T0: u64 = 1_700_000_000_000;

fn vectors() -> Result<Vec<Value>> {
    // CORRAL_VECTORS_DIR runs another set (e.g. a deliberately broken scratch copy).
    let dir = std::env::var_os("CORRAL_VECTORS_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("vectors"),
        PathBuf::from,
    );
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "json"));
    files.sort();
    let mut all = Vec::new();
    for file in files {
        let list: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&file)?)
            .with_context(|| format!("{} is not a list of vectors", file.display()))?;
        all.extend(list);
    }
    Ok(all)
}

enum Body {
    Native { cache: Corral, locks: MemoryLocks },
    Portable(PortableCache),
}

fn setting(settings: &Value, name: &str) -> Option<u64> {
    settings.get(name).and_then(Value::as_u64)
}

impl Body {
    /// A body over the in-memory L2, or over Redis (keys under `prefix`) when given one.
    fn new(
        portable: bool,
        settings: &Value,
        clock: &ManualClock,
        redis: Option<(&RedisServer, String)>,
    ) -> Result<Body> {
        let redis = redis.map(|(server, prefix)| {
            let mut o = corral::l2::RedisOptions::new(server.url());
            o.prefix = prefix;
            o
        });
        let sliding = setting(settings, "default_sliding_ms").map(Duration::from_millis);
        let key_bytes = setting(settings, "max_key_bytes").map(|n| n as u32);
        let value_bytes = setting(settings, "max_value_bytes").map(|n| n as u32);
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
            if let Some(o) = redis {
                b = b.redis_options(o);
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
        if let Some(o) = redis {
            b = b.redis_options(o);
        }
        Ok(Body::Native {
            cache: b.build()?,
            locks: MemoryLocks::with_clock(clock.clone())?,
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

async fn run_step(
    body: &Body,
    step: &Value,
    clock: &ManualClock,
    loads: &Arc<AtomicUsize>,
) -> Result<Option<Value>> {
    let key = step["key"].as_str().unwrap_or_default();
    let owner = step["owner"].as_str().unwrap_or_default();
    let value = step["value"].as_str().unwrap_or_default().as_bytes().to_vec();
    let now = clock.now_ms();
    let got = match (step["op"].as_str().context("op")?, body) {
        ("advance", _) => {
            clock.advance(Duration::from_millis(step["ms"].as_u64().context("ms")?));
            return Ok(None);
        }
        ("set", Body::Native { cache, .. }) => done(cache.set(key, value, options(step, now)).await),
        ("set", Body::Portable(p)) => done(p.set(key, value, options(step, now)).await),
        ("get", Body::Native { cache, .. }) => outcome(cache.get(key).await.map(text)),
        ("get", Body::Portable(p)) => outcome(p.get(key).await.map(text)),
        ("refresh", Body::Native { cache, .. }) => outcome(cache.refresh(key).await),
        ("refresh", Body::Portable(p)) => outcome(p.refresh(key).await),
        ("remove", Body::Native { cache, .. }) => outcome(cache.remove(key).await),
        ("remove", Body::Portable(p)) => outcome(p.remove(key).await),
        ("get_or_set", body) => {
            let loaded: std::result::Result<Vec<u8>, String> = match step["loader"].get("value") {
                Some(v) => Ok(v.as_str().unwrap_or_default().as_bytes().to_vec()),
                None => Err(step["loader"]["error"].as_str().unwrap_or("failed").to_string()),
            };
            let cacheable = step["should_cache"].as_bool().unwrap_or(true);
            let bypass = step["bypass"].as_bool().unwrap_or(false);
            let counter = loads.clone();
            let r = match body {
                Body::Native { cache, .. } => {
                    let o = LoadOptions::new()
                        .entry(options(step, now))
                        .bypass(bypass)
                        .should_cache(move |_| cacheable);
                    cache
                        .get_or_set(key, o, || async move {
                            counter.fetch_add(1, Ordering::SeqCst);
                            loaded.map_err(std::io::Error::other)
                        })
                        .await
                }
                Body::Portable(p) => {
                    let load = move |_: &str| {
                        counter.fetch_add(1, Ordering::SeqCst);
                        loaded.clone()
                    };
                    p.get_or_set(key, options(step, now), bypass, load, move |_| cacheable)
                        .await
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
        ("unlock", Body::Native { locks, .. }) => outcome(locks.unlock(key, owner)),
        ("unlock", Body::Portable(p)) => outcome(p.unlock(key, owner).await),
        ("is_locked_by", Body::Native { locks, .. }) => outcome(locks.is_locked_by(key, owner)),
        ("is_locked_by", Body::Portable(p)) => outcome(p.is_locked_by(key, owner).await),
        ("is_lock_expired", Body::Native { locks, .. }) => outcome(locks.is_lock_expired(key)),
        ("is_lock_expired", Body::Portable(p)) => outcome(p.is_lock_expired(key).await),
        (op, _) => anyhow::bail!("unknown op {op:?}"),
    };
    Ok(Some(got))
}

/// Runs every vector on fresh bodies; returns (vectors, steps) run, or every mismatch.
async fn run_all(portable: bool, redis: Option<&RedisServer>) -> Result<(usize, usize)> {
    let mut failures = Vec::new();
    let mut steps_run = 0;
    let vectors = vectors()?;
    for (n, vector) in vectors.iter().enumerate() {
        let name = vector["name"].as_str().unwrap_or("?");
        let clock = ManualClock::new(T0);
        // One Redis for all vectors: each its own tenant (prefix).
        let body = Body::new(
            portable,
            &vector["settings"],
            &clock,
            redis.map(|r| (r, format!("v{n}:"))),
        )?;
        for (i, step) in vector["steps"].as_array().context("steps")?.iter().enumerate() {
            let loads = Arc::new(AtomicUsize::new(0));
            let Some(got) = run_step(&body, step, &clock, &loads).await? else {
                continue;
            };
            steps_run += 1;
            if got != step["expect"] {
                failures.push(format!(
                    "{name} / step {i} ({}): expected {}, got {got}",
                    step["op"], step["expect"]
                ));
            }
            if let Some(expected) = step.get("loads").and_then(Value::as_u64) {
                let n = loads.load(Ordering::SeqCst) as u64;
                if n != expected {
                    failures.push(format!(
                        "{name} / step {i}: expected {expected} loader call(s), got {n}"
                    ));
                }
            }
        }
    }
    anyhow::ensure!(
        failures.is_empty(),
        "{} mismatch(es):\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok((vectors.len(), steps_run))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vectors_pass_in_the_native_body() -> Result<()> {
    let (vectors, steps) = run_all(false, None).await?;
    println!("native body: {vectors} vectors, {steps} steps passed");
    assert!(vectors >= 40);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vectors_pass_in_the_native_body_over_redis() -> Result<()> {
    let server = RedisServer::start()?;
    let (vectors, steps) = run_all(false, Some(&server)).await?;
    println!("native body over redis-server: {vectors} vectors, {steps} steps passed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vectors_pass_in_the_component_in_wasmtime_over_redis() -> Result<()> {
    let server = RedisServer::start()?;
    let (vectors, steps) = run_all(true, Some(&server)).await?;
    println!("component in wasmtime over redis-server: {vectors} vectors, {steps} steps passed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vectors_pass_in_the_component_in_wasmtime() -> Result<()> {
    let (vectors, steps) = run_all(true, None).await?;
    println!("component in wasmtime: {vectors} vectors, {steps} steps passed");
    assert!(vectors >= 40);
    Ok(())
}

#[test]
fn wasmtime_loads_the_very_file_jco_runs() -> Result<()> {
    let on_disk = std::fs::read(corral::GUEST_WASM_PATH)?;
    assert!(
        on_disk == corral::GUEST_WASM,
        "{} differs from the embedded component",
        corral::GUEST_WASM_PATH
    );
    Ok(())
}
