//! `corral stampede`: N concurrent get-or-set calls at one cold key, and the report of
//! what they cost (loads, latency, Redis commands).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use comfy_table::Table;
use corral::{Clock, Corral, EntryOptions};

use crate::failure::{Failure, code};
use crate::output::{out, say};

/// What `corral stampede` was asked to do.
#[derive(Debug)]
pub struct Request {
    pub callers: usize,
    pub loader: Duration,
    /// The key (default: a fresh one per run).
    pub key: Option<String>,
    /// One JSON object on stdout instead of tables.
    pub json: bool,
    /// Say "ready" on stderr once connected, then wait for a line on stdin.
    pub wait_for_go: bool,
}

/// Runs `corral stampede` on `cache` and prints the report.
pub async fn command(cache: &Corral, request: Request) -> Result<(), Failure> {
    let key = request
        .key
        .unwrap_or_else(|| format!("stampede:{}", corral::SystemClock.now_ms()));
    if request.wait_for_go {
        // Connect (and subscribe) before the barrier, so the start is even.
        cache.get(&format!("{key}:warmup")).await?;
        say!("ready");
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| Failure::new(code::USAGE, format!("waiting for go on stdin: {e}")))?;
    }
    let report = run(cache, &key, request.callers, request.loader, !request.json).await;
    if request.json {
        out!("{}", report.json())
    } else {
        out!("{}", report.table())
    }
}

/// What one stampede did in this process.
pub struct Report {
    callers: usize,
    loader_calls: usize,
    errors: usize,
    latencies: Vec<Duration>,
    wall: Duration,
    redis_commands: Option<u64>,
    flights_left: usize,
    metrics: corral::MetricsSnapshot,
}

pub async fn run(cache: &Corral, key: &str, callers: usize, loader: Duration, progress: bool) -> Report {
    let loads = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let commands_before = cache.redis_commands_sent();
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..callers {
        let (cache, loads, done, key) = (cache.clone(), loads.clone(), done.clone(), key.to_owned());
        tasks.spawn(async move {
            let start = Instant::now();
            let r = cache
                .get_or_set(
                    &key,
                    EntryOptions::new().relative(Duration::from_secs(600)),
                    || async move {
                        let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
                        tokio::time::sleep(loader).await;
                        Ok::<_, std::io::Error>(format!("report #{n}"))
                    },
                )
                .await;
            done.fetch_add(1, Ordering::Relaxed);
            (start.elapsed(), r.is_ok())
        });
    }
    // Long runs show progress on stderr (stdout stays for the result).
    let ticker = progress.then(|| {
        let done = done.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                say!(
                    "  ... {}/{callers} callers answered",
                    done.load(Ordering::Relaxed)
                );
            }
        })
    });
    let mut latencies = Vec::with_capacity(callers);
    let mut errors = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((took, ok)) => {
                latencies.push(took);
                errors += usize::from(!ok);
            }
            Err(_) => errors += 1,
        }
    }
    if let Some(t) = ticker {
        t.abort();
    }
    latencies.sort();
    Report {
        callers,
        loader_calls: loads.load(Ordering::SeqCst),
        errors,
        latencies,
        wall: began.elapsed(),
        redis_commands: commands_before.and_then(|b| cache.redis_commands_sent().map(|now| now - b)),
        flights_left: cache.flights_in_progress(),
        metrics: cache.metrics(),
    }
}

impl Report {
    fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * self.latencies.len() as f64).ceil() as usize;
        self.latencies[rank.clamp(1, self.latencies.len()) - 1]
    }

    fn ms(d: Duration) -> f64 {
        (d.as_secs_f64() * 1e5).round() / 100.0
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "callers": self.callers,
            "loader_calls": self.loader_calls,
            "errors": self.errors,
            "p50_ms": Self::ms(self.percentile(50.0)),
            "p99_ms": Self::ms(self.percentile(99.0)),
            "max_ms": Self::ms(self.latencies.last().copied().unwrap_or_default()),
            "wall_ms": Self::ms(self.wall),
            "redis_commands": self.redis_commands,
            "flights_left": self.flights_left,
            "metrics": self.metrics.fields().iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect::<serde_json::Map<_, _>>(),
        })
    }

    pub fn table(&self) -> Table {
        let mut t = Table::new();
        t.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY)
            .set_header(["stampede", "this process"]);
        t.add_row(["callers".to_string(), self.callers.to_string()]);
        t.add_row(["loader calls".to_string(), self.loader_calls.to_string()]);
        t.add_row(["errors".to_string(), self.errors.to_string()]);
        t.add_row([
            "p50 latency".to_string(),
            format!("{:.1?}", self.percentile(50.0)),
        ]);
        t.add_row([
            "p99 latency".to_string(),
            format!("{:.1?}", self.percentile(99.0)),
        ]);
        t.add_row([
            "max latency".to_string(),
            format!("{:.1?}", self.latencies.last().copied().unwrap_or_default()),
        ]);
        let commands = self
            .redis_commands
            .map_or_else(|| "- (in-memory L2)".to_string(), |n| n.to_string());
        t.add_row(["redis commands".to_string(), commands]);
        t.add_row([
            "coalesced in-process".to_string(),
            self.metrics.coalesced.to_string(),
        ]);
        t.add_row([
            "waited on another process".to_string(),
            self.metrics.lock_waits.to_string(),
        ]);
        t.add_row([
            "degraded (uncached) loads".to_string(),
            self.metrics.degraded.to_string(),
        ]);
        t.add_row([
            "flights left in registry".to_string(),
            self.flights_left.to_string(),
        ]);
        t
    }
}
