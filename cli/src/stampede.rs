//! `corral stampede`: N concurrent get-or-set calls at one cold key (or, with `--keys`,
//! bulk get-or-set calls at random subsets of many cold keys), and the report of what
//! they cost (loads, latency, Redis commands).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use comfy_table::Table;
use corral::{Clock, Corral, EntryOptions};

use crate::failure::{Failure, code};
use crate::output::{out, say};
use crate::redact::RedisUrl;

/// What `corral stampede` was asked to do.
#[derive(Debug)]
pub struct Request {
    pub callers: usize,
    pub loader: Duration,
    /// The key (default: a fresh one, shared by the runs against the same store that
    /// start while this one runs).
    pub key: Option<String>,
    /// One JSON object on stdout instead of tables.
    pub json: bool,
    /// Say "ready" on stderr once connected, then wait for a line on stdin.
    pub wait_for_go: bool,
    /// Bulk calls: each caller asks for a random `batch` of `keys` keys.
    pub bulk: Option<Bulk>,
}

/// The most keys a bulk stampede's callers may ask for in all: each is a string held
/// until its caller is answered.
pub const MOST_KEYS_ASKED: usize = 10_000_000;

/// A bulk stampede: each caller asks for `batch` distinct keys drawn at random from
/// `keys` keys (`KEY:0` .. `KEY:<keys - 1>`) through one `get_or_set_many`.
#[derive(Clone, Copy, Debug)]
pub struct Bulk {
    pub keys: usize,
    pub batch: usize,
}

impl Bulk {
    /// Checks the shape for `callers` callers: at least one key, a batch of 1 to `keys`
    /// keys, and at most [`MOST_KEYS_ASKED`] keys asked for in all.
    pub fn new(keys: usize, batch: usize, callers: usize) -> Result<Self, Failure> {
        if keys == 0 || batch == 0 || batch > keys {
            return Err(Failure::new(
                code::USAGE,
                format!("--batch must be between 1 and --keys ({keys}), not {batch}"),
            ));
        }
        if callers.saturating_mul(batch) > MOST_KEYS_ASKED {
            return Err(Failure::new(
                code::USAGE,
                format!(
                    "--callers x --batch must be at most {MOST_KEYS_ASKED} keys asked for in all, not {callers} x {batch}"
                ),
            ));
        }
        Ok(Bulk { keys, batch })
    }
}

/// Runs `corral stampede` on `cache` (on `redis`; `None`: the embedded store) and prints
/// the report.
pub async fn command(cache: &Corral, request: Request, redis: Option<&RedisUrl>) -> Result<(), Failure> {
    if request.wait_for_go {
        // Connect (and subscribe) before the barrier, so the start is even.
        cache.get(WARM_UP).await?;
        say!("ready");
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| Failure::new(code::USAGE, format!("waiting for go on stdin: {e}")))?;
    }
    let (key, shared) = match request.key {
        Some(key) => (key, false),
        None => (fresh_key(cache).await?, true),
    };
    let report = run(
        cache,
        &key,
        request.callers,
        request.loader,
        request.bulk,
        !request.json,
    )
    .await;
    if shared {
        // The next run starts cold: this run's key is no longer handed out. (Those that
        // started with this one have theirs already.)
        let _ = cache.remove(FRESH_KEY).await;
    }
    if request.json {
        out!("{}", report.json())?;
    } else {
        out!("{}", report.table())?;
    }
    // A run whose callers failed says why, with the status of the first failure (a bad
    // key is a usage error; a Redis that fails only degrades a get-or-set, which loads
    // uncached and answers).
    match (&report.first_error, report.errors) {
        (Some(e), _) => Err(Failure::from_error(e, redis)),
        (None, 0) => Ok(()),
        (None, n) => Err(Failure::new(
            code::SOFTWARE,
            format!(
                "{n} of {} callers got no answer (a caller's task failed)",
                report.callers
            ),
        )),
    }
}

/// Read to connect (and subscribe) before a barrier: a key no run uses.
const WARM_UP: &str = "stampede:warm-up";

/// Where the runs that start together find their fresh key.
const FRESH_KEY: &str = "stampede:fresh-key";

/// A fresh key for this run, shared by the runs against the same store that start while
/// it has not finished (the default `--key`): the first to ask names it (`stampede:` and
/// the moment it asked), the others get that name through the cache's own get-or-set (one
/// load across processes), and each run stops handing it out as it finishes, so several
/// runs started at once stampede together and the next run starts cold. Handed out for
/// a minute at most, should a run end without saying so.
async fn fresh_key(cache: &Corral) -> Result<String, Failure> {
    let named = cache
        .get_or_set(
            FRESH_KEY,
            EntryOptions::new().relative(Duration::from_secs(60)),
            || async {
                Ok::<_, std::convert::Infallible>(format!("stampede:{}", corral::SystemClock.now_ms()))
            },
        )
        .await?;
    Ok(String::from_utf8_lossy(&named).into_owned())
}

/// What one stampede did in this process.
pub struct Report {
    callers: usize,
    loader_calls: usize,
    /// Distinct keys this process's loader produced, and how many it produced in all
    /// (the same when no key was loaded twice here).
    keys_loaded: usize,
    key_loads: usize,
    errors: usize,
    /// The first error a caller got, if any.
    first_error: Option<corral::Error>,
    latencies: Vec<Duration>,
    wall: Duration,
    redis_commands: Option<u64>,
    flights_left: usize,
    /// What the cache counted during the run (not before it: its warm-up, its key).
    metrics: corral::MetricsSnapshot,
}

pub async fn run(
    cache: &Corral,
    key: &str,
    callers: usize,
    loader: Duration,
    bulk: Option<Bulk>,
    progress: bool,
) -> Report {
    let loads = Arc::new(AtomicUsize::new(0));
    let loaded = Arc::new(Mutex::new(Loaded::default()));
    let done = Arc::new(AtomicUsize::new(0));
    let (commands_before, metrics_before) = (cache.redis_commands_sent(), cache.metrics());
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let options = || EntryOptions::new().relative(Duration::from_secs(600));
    let seed = u64::from(std::process::id()) ^ corral::SystemClock.now_ms().rotate_left(20);
    for caller in 0..callers {
        let (cache, loads, loaded, done, key) = (
            cache.clone(),
            loads.clone(),
            loaded.clone(),
            done.clone(),
            key.to_owned(),
        );
        tasks.spawn(async move {
            let start = Instant::now();
            // Whether every answer came, and the first error, if one was the cause.
            let (ok, error): (bool, Option<corral::Error>) = match bulk {
                None => {
                    let key_for_loader = key.clone();
                    cache
                        .get_or_set(&key, options(), || async move {
                            let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
                            loaded
                                .lock()
                                .expect("no panics")
                                .note(std::slice::from_ref(&key_for_loader));
                            tokio::time::sleep(loader).await;
                            Ok::<_, std::io::Error>(format!("report #{n}"))
                        })
                        .await
                        .map_or_else(|e| (false, Some(e)), |_| (true, None))
                }
                Some(bulk) => {
                    let keys = draw(seed.wrapping_add(caller as u64), bulk)
                        .into_iter()
                        .map(|i| format!("{key}:{i}"));
                    let answers = cache
                        .get_or_set_many(keys, options(), |keys: Vec<String>| {
                            let (loads, loaded) = (loads.clone(), loaded.clone());
                            async move {
                                let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
                                loaded.lock().expect("no panics").note(&keys);
                                tokio::time::sleep(loader).await;
                                let values: HashMap<String, String> =
                                    keys.into_iter().map(|k| (k, format!("report #{n}"))).collect();
                                Ok::<_, std::io::Error>(values)
                            }
                        })
                        .await;
                    match answers {
                        Err(e) => (false, Some(e)),
                        Ok(answers) => {
                            let error = answers.iter().find_map(|a| a.as_ref().err().cloned());
                            let ok = answers.iter().all(|a| matches!(a, Ok(Some(_))));
                            (ok, error)
                        }
                    }
                }
            };
            done.fetch_add(1, Ordering::Relaxed);
            (start.elapsed(), ok, error)
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
    let (mut errors, mut first_error) = (0, None);
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((took, ok, error)) => {
                latencies.push(took);
                errors += usize::from(!ok);
                first_error = first_error.or(error);
            }
            Err(_) => errors += 1,
        }
    }
    if let Some(t) = ticker {
        t.abort();
    }
    latencies.sort();
    let loaded = loaded.lock().expect("no panics");
    Report {
        callers,
        loader_calls: loads.load(Ordering::SeqCst),
        keys_loaded: loaded.distinct.len(),
        key_loads: loaded.all,
        errors,
        first_error,
        latencies,
        wall: began.elapsed(),
        redis_commands: commands_before.and_then(|b| cache.redis_commands_sent().map(|now| now - b)),
        flights_left: cache.flights_in_progress(),
        metrics: cache.metrics().since(&metrics_before),
    }
}

/// The keys a process's loader produced.
#[derive(Default)]
struct Loaded {
    distinct: BTreeSet<String>,
    all: usize,
}

impl Loaded {
    fn note(&mut self, keys: &[String]) {
        self.all += keys.len();
        self.distinct.extend(keys.iter().cloned());
    }
}

/// `bulk.batch` distinct key numbers below `bulk.keys`, drawn from `seed` (splitmix64,
/// a partial Fisher-Yates shuffle).
fn draw(seed: u64, bulk: Bulk) -> Vec<usize> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    // The shuffle's swaps, kept only where they happened: a batch of 10 of a million
    // keys costs 10 entries, not a million.
    let mut swapped: HashMap<usize, usize> = HashMap::with_capacity(bulk.batch * 2);
    (0..bulk.batch)
        .map(|i| {
            let j = i + (next() % (bulk.keys - i) as u64) as usize;
            let at_j = swapped.get(&j).copied().unwrap_or(j);
            let at_i = swapped.get(&i).copied().unwrap_or(i);
            swapped.insert(j, at_i);
            at_j
        })
        .collect()
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
            "keys_loaded": self.keys_loaded,
            "key_loads": self.key_loads,
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
        t.add_row(["keys loaded".to_string(), self.keys_loaded.to_string()]);
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
