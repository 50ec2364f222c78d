//! One run: a seed, a scenario, several processes, a trace, and the invariants.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use corral::locks::RedisLocks;
use corral::portable::PortableCache;
use corral::{Clock, Corral, EntryOptions, ErrorKind, LoadOptions};

use crate::body::{Body, Finish, Load, wait_for};
use parking_lot::Mutex;

use crate::rng::Rng;
use crate::scenario::Scenario;
use crate::world::{Conn, MayRefresh, SLOW_NET_MS, Tag, World, tag_of};

/// The wall clock of the simulated epoch's start (any fixed point will do).
pub const EPOCH_MS: u64 = 1_700_000_000_000;
/// A generous bound on any one call, virtual time: a call past it is a violation.
pub const CALL_BOUND_MS: u64 = 30_000;
/// After a write is acknowledged, how long other processes may still serve what it
/// replaced when its notification is delivered: the announcement's trip (≤ 400 ms slow),
/// its delivery (≤ 5 ms), and a read already under way (its reply ≤ 400 ms), rounded up.
pub const NOTIFY_WINDOW_MS: u64 = 1_000;
/// Quiet time after the workload, before the final checks.
pub const QUIESCE_MS: u64 = 20_000;
/// How long values live (relative expiration), far past any run.
const VALUE_TTL: Duration = Duration::from_secs(120);

/// A process's wall clock: the epoch plus the virtual time Tokio keeps, plus a skew
/// (clock faults). The driver's sleeps and the guest's `now` agree by construction.
#[derive(Clone, Debug)]
pub struct SimClock {
    start: tokio::time::Instant,
    skew: Arc<AtomicI64>,
    /// The highest reading anyone took.
    highest: Arc<AtomicU64>,
}

impl SimClock {
    /// The highest reading anyone took of this clock so far: a point its readers may
    /// have judged passed, even after a step back.
    pub(crate) fn highest_ms(&self) -> u64 {
        self.highest.load(Ordering::SeqCst)
    }
}

impl Clock for SimClock {
    fn now_ms(&self) -> u64 {
        let virt = self.start.elapsed().as_millis() as i64;
        let now = (EPOCH_MS as i64 + virt + self.skew.load(Ordering::SeqCst)) as u64;
        self.highest.fetch_max(now, Ordering::SeqCst);
        now
    }
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub seed: u64,
    pub procs: usize,
    pub keys: usize,
    /// Callers per process (when not the scenario's own).
    pub callers: Option<usize>,
    /// ` --broken NAME` when the store was deliberately broken, ` --no-clears` without
    /// `clear` in the workload, ` --portable` for the
    /// portable body, else empty.
    pub broken: String,
    pub scenario: &'static str,
    /// Calls made by the workload.
    pub ops: u64,
    /// The longest call of each kind, virtual ms.
    pub longest_ms: BTreeMap<&'static str, u64>,
    /// Loader calls: under the flight lock, and degraded (without it).
    pub locked_loads: u64,
    pub degraded_loads: u64,
    /// The `degraded` counters of every process, summed.
    pub metrics_degraded: u64,
    pub faults: BTreeMap<&'static str, u64>,
    /// Loads that began while a fresh copy of their key stood (eager refreshes).
    pub refreshes: u64,
    /// Anomalies a fault explains, by kind.
    pub excused: BTreeMap<&'static str, u64>,
    pub violations: Vec<String>,
    pub trace: String,
}

impl Outcome {
    /// The command that replays this run.
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run -p corral-sim --release -- --seed {} --scenario {} --procs {} --keys {}{}{} --trace",
            self.seed,
            self.scenario,
            self.procs,
            self.keys,
            self.callers.map_or(String::new(), |c| format!(" --callers {c}")),
            self.broken
        )
    }
}

#[derive(Clone, Debug)]
pub(crate) enum LoaderPlan {
    Ok(u64),
    Slow(u64),
    Fail(u64),
    Panic(u64),
}

impl LoaderPlan {
    /// How long the loader takes, ms.
    fn ms(&self) -> u64 {
        match *self {
            LoaderPlan::Ok(ms) | LoaderPlan::Fail(ms) | LoaderPlan::Panic(ms) | LoaderPlan::Slow(ms) => ms,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Get(String),
    Set(String),
    Remove(String),
    /// An `expire` (of an entry without a stale window: a removal).
    Expire(String),
    GetOrSet(String, LoaderPlan),
    /// A `set_tagged` with one tag.
    SetTagged(String, String),
    /// A get-or-set whose loaded entry carries one tag.
    GetOrSetTagged(String, String, LoaderPlan),
    RemoveByTag(String),
    Clear,
    /// A `set` of a freshness key, with its expiry.
    SetFor(String, Expiry),
    /// A get-or-set of a freshness key, with its loaded entry's expiry and what else
    /// it asks (the native body's `fetch`).
    GetOrSetFor(String, Expiry, LoaderPlan, Detach),
    /// A get-or-set of several distinct keys at once; the loader leaves out the key at
    /// this position, if any.
    GetOrSetMany(Vec<String>, LoaderPlan, Option<usize>, BatchAsks),
}

/// What a batch asks beyond its keys: a hard timeout (the native body's; the portable
/// body's timeouts are its builder's), at most this many keys per loader call, and
/// (with `--refresh`) how long its entries live.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BatchAsks {
    pub(crate) hard_ms: Option<u64>,
    pub(crate) max_batch: Option<usize>,
    pub(crate) relative_ms: Option<u64>,
}

/// How a freshness key's entry expires: a short relative expiry, sliding within it, or
/// with a fail-safe window after it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expiry {
    relative_ms: u64,
    sliding_ms: Option<u64>,
    stale_ms: Option<u64>,
}

impl Expiry {
    fn draw(r: &mut Rng) -> Self {
        let relative_ms = r.range(300, 3_000);
        match r.range(0, 2) {
            0 => Expiry {
                relative_ms,
                sliding_ms: Some(r.range(100, 800)),
                stale_ms: None,
            },
            1 => Expiry {
                relative_ms,
                sliding_ms: None,
                stale_ms: Some(r.range(300, 2_000)),
            },
            _ => Expiry {
                relative_ms,
                sliding_ms: Some(r.range(100, 800)),
                stale_ms: Some(r.range(300, 2_000)),
            },
        }
    }

    fn options(self) -> EntryOptions {
        let mut o = EntryOptions::new().relative(Duration::from_millis(self.relative_ms));
        if let Some(ms) = self.sliding_ms {
            o = o.sliding(Duration::from_millis(ms));
        }
        if let Some(ms) = self.stale_ms {
            o = o.fail_safe(Duration::from_millis(ms));
        }
        o
    }
}

/// What a freshness get-or-set asks beyond its entry's expiry: loader timeouts,
/// background completion, eager refresh. The native body runs it through `fetch`; the
/// portable body, which has none of them, runs a plain get-or-set.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Detach {
    soft_ms: Option<u64>,
    hard_ms: Option<u64>,
    background: bool,
    refresh_permille: Option<u64>,
}

impl Detach {
    fn draw(r: &mut Rng, expiry: &Expiry) -> Self {
        let mut d = Detach::default();
        if expiry.stale_ms.is_some() && r.chance(400) {
            d.soft_ms = Some(r.range(20, 600));
        }
        if r.chance(300) {
            d.hard_ms = Some(r.range(100, 2_000));
            d.background = r.chance(500);
        }
        if r.chance(400) {
            d.refresh_permille = Some(r.range(300, 900));
        }
        d
    }

    pub(crate) fn is_plain(&self) -> bool {
        self.soft_ms.is_none() && self.hard_ms.is_none() && self.refresh_permille.is_none()
    }

    pub(crate) fn options(&self, entry: EntryOptions) -> LoadOptions {
        let mut o = LoadOptions::new().entry(entry);
        if let Some(ms) = self.soft_ms {
            o = o.soft_timeout(Duration::from_millis(ms));
        }
        if let Some(ms) = self.hard_ms {
            o = o
                .hard_timeout(Duration::from_millis(ms))
                .background_completion(self.background);
        }
        if let Some(pm) = self.refresh_permille {
            o = o.eager_refresh(pm as f64 / 1000.0);
        }
        o
    }
}

/// The keys of the freshness workload (short expiries; not in the convergence check).
pub(crate) const FRESH_KEYS: [&str; 2] = ["f0", "f1"];

/// The tags the workload uses.
const TAGS: [&str; 2] = ["t0", "t1"];

/// A value a caller saw written (a `set`, or its own loader's value it got back): its
/// tags, and when the call returned.
#[derive(Clone, Debug)]
struct Written {
    tags: Vec<String>,
    t_done: u64,
    proc: usize,
}

/// A `remove_by_tag` (`tag`) or `clear` (`None`) a caller saw succeed.
#[derive(Clone, Debug)]
struct Invalidated {
    tag: Option<String>,
    /// The workload call that made it.
    call: u64,
    proc: usize,
    t_inv: u64,
    t_ack: u64,
    /// The call failed (a `clear` whose reply was lost may still have moved the
    /// generation, unannounced): no process was told.
    failed: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Res {
    Value(Option<String>),
    Done(bool),
    Failed(ErrorKind),
    TimedOut,
    Panicked,
}

#[derive(Clone, Debug)]
pub(crate) struct CallRec {
    pub(crate) id: u64,
    pub(crate) proc: usize,
    pub(crate) op: &'static str,
    pub(crate) key: String,
    pub(crate) t_inv: u64,
    pub(crate) t_end: u64,
    pub(crate) res: Res,
    /// The value this call's own loader produced, and what it was told to do.
    pub(crate) loaded: Option<(String, LoaderPlan)>,
    /// Its process's clock when it began and when it returned.
    pub(crate) clocks: (u64, u64),
    /// Whether the value served was a stale copy, when the body said.
    pub(crate) stale: Option<bool>,
    /// What a freshness get-or-set asked beyond its entry (timeouts, eager refresh), or
    /// what its process's cache applies to every get-or-set (`cache_level`).
    pub(crate) detach: Option<Detach>,
    /// `detach` is its cache's, shared by every get-or-set of the process: one that
    /// follows a load in the process times out with it, as a call without timeouts does.
    pub(crate) cache_level: bool,
    /// A batch key's hard timeout, and when its loader call began (the simulated time
    /// and its process's clock), if this call loaded it: the timeout counts from then.
    pub(crate) batch_hard: Option<(u64, Option<(u64, u64)>)>,
    /// When its own loader began (the simulated time and its process's clock), if it ran
    /// one and its process was not paused since the call began: a load's hard timeout
    /// leaves the loader at least half of it (contract §7.2).
    pub(crate) load_began: Option<(u64, u64)>,
}

impl CallRec {
    /// A get-or-set with timeouts or eager refresh: its loader may run on after it, or
    /// be cut, and the caller may get a stale copy, the current value or `Timeout`.
    fn detached(&self) -> bool {
        self.detach.is_some_and(|d| !d.is_plain())
    }

    /// Whether the call's own hard timeout ran out: it asked for one and ran at least that
    /// long; a call whose timeout is its cache's (`cache_level`) also ran the load (one
    /// that followed a load times out with it: `check_coalesced_timeouts`).
    fn own_timeout_ran_out(&self) -> bool {
        // (A batch's key counts from its loader call, which it ran: `batch_hard`.)
        self.hard_timeout_ran_out()
            && (!self.cache_level || self.loaded.is_some() || self.batch_hard.is_some())
    }

    /// Whether the call asked for a hard timeout and ran at least that long, by the
    /// simulated time or by its process's clock (the guest judges a load's answer by
    /// the cache's clock, so a clock stepped forward during a load times it out).
    fn hard_timeout_ran_out(&self) -> bool {
        let (clock_inv, clock_end) = self.clocks;
        // A batch key's runs from its loader call; one it did not load (it followed a
        // flight) timed out only as that flight did (`check_coalesced_timeouts`).
        if let Some((h, began)) = self.batch_hard {
            return began.is_some_and(|(t_began, clock_began)| {
                self.t_end - t_began >= h || clock_end.saturating_sub(clock_began) >= h
            });
        }
        let Some(h) = self.detach.and_then(|d| d.hard_ms) else {
            return false;
        };
        let ran = |(t, clock): (u64, u64), at_least: u64| {
            self.t_end - t >= at_least || clock_end.saturating_sub(clock) >= at_least
        };
        // Counted from the load (contract §7.2), which came after the call began; and
        // the loader, once it began, kept at least half of it (a tagged load reads its
        // tags' moments first, within half the time to its first timeout).
        ran((self.t_inv, clock_inv), h) && self.load_began.is_none_or(|began| ran(began, h.div_ceil(2)))
    }
}

/// A write a caller saw succeed: its key, when it returned, its order in the store.
#[derive(Clone, Debug)]
struct Acked {
    key: String,
    t_ack: u64,
    order: u64,
    label: String,
}

struct Plan {
    down: Vec<Vec<(u64, u64)>>,
    /// Per process, the spans its subscription alone is down.
    deaf: Vec<Vec<(u64, u64)>>,
    /// A Redlock server that stalls, and when.
    stall: Option<(usize, u64, u64)>,
    restart: Option<u64>,
    skew: Vec<i64>,
    steps: Vec<(usize, u64, i64)>,
    /// Per process, the spans it is paused.
    paused: Vec<Vec<(u64, u64)>>,
    /// A process that crashes, and when.
    crash: Option<(usize, u64)>,
    /// Per process, when its subscription connection goes half-open, if it does.
    half_open: Vec<Option<u64>>,
}

const HORIZON_MS: u64 = 3_000;
/// A pause lasts this long: past the flight lock's TTL and a lease's at the top.
const PAUSE_MIN_MS: u64 = 300;
const PAUSE_MAX_MS: u64 = 4_000;

fn plan(s: &Scenario, seed: u64) -> Plan {
    let mut r = Rng::new(seed, 1);
    let f = &s.faults;
    let mut down = vec![Vec::new(); s.procs];
    let mut skew = vec![0; s.procs];
    let mut steps = Vec::new();
    for p in 0..s.procs {
        if r.chance(f.down_pm) {
            let a = r.range(0, HORIZON_MS);
            down[p].push((a, a + r.range(100, 2_000)));
        }
        if r.chance(f.clock_pm) {
            skew[p] = r.range(0, 600) as i64 - 300;
        }
        if r.chance(f.clock_pm) {
            let by = r.range(500, 3_000) as i64;
            steps.push((p, r.range(0, HORIZON_MS), if r.chance(500) { by } else { -by }));
        }
    }
    let restart = r.chance(f.restart_pm).then(|| r.range(0, HORIZON_MS));
    // Drawn after the others, so adding them changed no earlier plan.
    let mut paused = vec![Vec::new(); s.procs];
    for spans in paused.iter_mut() {
        if r.chance(f.pause_pm) {
            let a = r.range(0, HORIZON_MS);
            spans.push((a, a + r.range(PAUSE_MIN_MS, PAUSE_MAX_MS)));
        }
    }
    // One process at most crashes: the others must carry on.
    let crash = r
        .chance(f.crash_pm)
        .then(|| (r.range(0, s.procs as u64 - 1) as usize, r.range(0, HORIZON_MS)));
    let mut deaf = vec![Vec::new(); s.procs];
    for spans in deaf.iter_mut() {
        if r.chance(f.deaf_pm) {
            let a = r.range(0, HORIZON_MS);
            spans.push((a, a + r.range(100, 2_000)));
        }
    }
    // A minority of Redlock's servers: one stalls.
    let stall = (s.lease_servers > 1 && r.chance(f.stall_pm)).then(|| {
        let server = r.range(1, s.lease_servers as u64) as usize;
        let a = r.range(0, HORIZON_MS);
        (server, a, a + r.range(300, 3_000))
    });
    // Drawn last, so adding it changed no earlier plan.
    let half_open = (0..s.procs)
        .map(|_| r.chance(f.half_open_pm).then(|| r.range(0, HORIZON_MS)))
        .collect();
    Plan {
        half_open,
        down,
        deaf,
        stall,
        restart,
        skew,
        steps,
        paused,
        crash,
    }
}

fn loader_plan(r: &mut Rng, s: &Scenario) -> LoaderPlan {
    let f = &s.faults;
    let base = r.range(5, 60);
    if r.chance(f.loader_panic_pm) {
        LoaderPlan::Panic(base)
    } else if r.chance(f.loader_fail_pm) {
        LoaderPlan::Fail(base)
    } else if r.chance(f.loader_slow_pm) {
        LoaderPlan::Slow(r.range(300, 8_000))
    } else {
        LoaderPlan::Ok(base)
    }
}

fn workload(s: &Scenario, seed: u64, proc: usize, actor: usize) -> Vec<(u64, Op)> {
    let mut r = Rng::new(seed, 100 + (proc * 16 + actor) as u64);
    (0..s.ops_per_actor)
        .map(|_| {
            let think = r.range(0, s.think_ms);
            let key = format!("k{}", r.range(0, s.keys as u64 - 1));
            let op = match r.range(0, 99) {
                0..=29 => Op::Get(key),
                30..=44 => Op::Set(key),
                45..=49 => Op::Remove(key),
                50..=54 => Op::Expire(key),
                _ => Op::GetOrSet(key, loader_plan(&mut r, s)),
            };
            (think, op)
        })
        .collect()
}

/// The batcher of a process (with `--batches`): get-or-sets of 2 or more distinct hot
/// keys at once (overlapping the callers' keys and each other's), a quarter of them
/// with a key the loader leaves out; between them, reads and writes of those keys.
fn batcher(s: &Scenario, seed: u64, proc: usize) -> Vec<(u64, Op)> {
    if !s.batches || s.keys < 2 {
        return Vec::new();
    }
    let mut r = Rng::new(seed, 900 + proc as u64);
    (0..s.ops_per_actor)
        .map(|_| {
            let think = r.range(0, s.think_ms);
            let op = match r.range(0, 9) {
                0 => Op::Set(format!("k{}", r.range(0, s.keys as u64 - 1))),
                1 => Op::Remove(format!("k{}", r.range(0, s.keys as u64 - 1))),
                _ => {
                    let size = r.range(2, s.keys.min(4) as u64) as usize;
                    let mut keys: Vec<String> = Vec::with_capacity(size);
                    while keys.len() < size {
                        let key = format!("k{}", r.range(0, s.keys as u64 - 1));
                        if !keys.contains(&key) {
                            keys.push(key);
                        }
                    }
                    let left_out = r.chance(250).then(|| r.range(0, size as u64 - 1) as usize);
                    let asks = BatchAsks {
                        hard_ms: r.chance(300).then(|| r.range(100, 2_000)),
                        max_batch: r.chance(300).then(|| r.range(1, 2) as usize),
                        // Drawn last: the other scenarios' seeds draw as they did.
                        relative_ms: (s.refresh && s.portable).then(|| r.range(800, 3_000)),
                    };
                    Op::GetOrSetMany(keys, loader_plan(&mut r, s), left_out, asks)
                }
            };
            (think, op)
        })
        .collect()
}

/// The tagger of a process: tagged writes and loads of the same hot keys, reads,
/// `remove_by_tag` and, rarely, `clear`.
fn tagger(s: &Scenario, seed: u64, proc: usize) -> Vec<(u64, Op)> {
    let mut r = Rng::new(seed, 300 + proc as u64);
    (0..s.ops_per_actor)
        .map(|_| {
            let think = r.range(0, s.think_ms);
            let key = format!("k{}", r.range(0, s.keys as u64 - 1));
            let tag = TAGS[r.range(0, TAGS.len() as u64 - 1) as usize].to_owned();
            let op = match r.range(0, 99) {
                0..=24 => Op::Get(key),
                25..=49 => Op::SetTagged(key, tag),
                50..=79 => Op::GetOrSetTagged(key, tag, loader_plan(&mut r, s)),
                80..=96 => Op::RemoveByTag(tag),
                _ if s.clears => Op::Clear,
                _ => Op::RemoveByTag(tag),
            };
            (think, op)
        })
        .collect()
}

/// The freshener of a process: reads, writes and loads of the freshness keys, whose
/// entries expire within the run (sliding, absolute, fail-safe stale windows), with
/// loaders that fail more often than the others', so stale copies get served.
fn freshener(s: &Scenario, seed: u64, proc: usize) -> Vec<(u64, Op)> {
    let mut r = Rng::new(seed, 500 + proc as u64);
    (0..s.ops_per_actor)
        .map(|_| {
            let think = r.range(0, s.think_ms);
            let key = FRESH_KEYS[r.range(0, FRESH_KEYS.len() as u64 - 1) as usize].to_owned();
            let op = match r.range(0, 99) {
                0..=34 => Op::Get(key),
                35..=54 => Op::SetFor(key, Expiry::draw(&mut r)),
                _ => {
                    let expiry = Expiry::draw(&mut r);
                    let plan = if r.chance(250) {
                        LoaderPlan::Fail(r.range(5, 60))
                    } else {
                        loader_plan(&mut r, s)
                    };
                    let detach = Detach::draw(&mut r, &expiry);
                    Op::GetOrSetFor(key, expiry, plan, detach)
                }
            };
            (think, op)
        })
        .collect()
}

/// Runs `seed` of `scenario` on a fresh current-thread runtime with paused time.
pub fn run_seed(scenario: &Scenario, seed: u64) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    rt.block_on(simulate(scenario.clone(), seed))
}

pub(crate) struct Ctx {
    pub(crate) world: Arc<World>,
    pub(crate) calls: Mutex<Vec<CallRec>>,
    acked: Mutex<Vec<Acked>>,
    /// Per value, how it was written (its tags, when its call returned).
    written: Mutex<BTreeMap<String, Written>>,
    invalidated: Mutex<Vec<Invalidated>>,
    next_call: Mutex<u64>,
    /// Per process, its clock.
    clocks: Vec<SimClock>,
    /// Per process, its tasks (actors and their calls): a crash aborts them all.
    pub(crate) tasks: Vec<Mutex<Vec<tokio::task::AbortHandle>>>,
    /// Per process, what its cache applies to every get-or-set, if it was built so (the
    /// portable body with `--refresh` or `--timeouts`): its eager-refresh fraction (any of
    /// its loads may be a refresh) and its hard timeout (a follower in the process times
    /// out with the load it followed).
    cache_level: Vec<Option<Detach>>,
}

impl Ctx {
    /// Process `proc`'s clock.
    pub(crate) fn clock(&self, proc: usize) -> &SimClock {
        &self.clocks[proc]
    }

    /// The next call's number.
    pub(crate) fn next_id(&self) -> u64 {
        let mut n = self.next_call.lock();
        *n += 1;
        *n
    }
}

async fn simulate(scenario: Scenario, seed: u64) -> Outcome {
    crate::quiet_loader_panics();
    let plan = plan(&scenario, seed);
    let world = World::new(
        scenario.clone(),
        seed,
        plan.down.clone(),
        plan.deaf.clone(),
        plan.paused.clone(),
    );
    world.log(format_args!(
        "seed {seed} scenario {} procs {}",
        scenario.name, scenario.procs
    ));
    let mut caches = Vec::new();
    let mut lockers = Vec::new();
    let mut skews = Vec::new();
    let mut clocks = Vec::new();
    let mut cache_level = Vec::new();
    for p in 0..scenario.procs {
        let level = scenario.portable.then(|| {
            let mut r = Rng::new(seed, 1_000 + p as u64);
            Detach {
                refresh_permille: scenario.refresh.then(|| r.range(300, 900)),
                hard_ms: scenario.timeouts.then(|| r.range(300, 4_000)),
                ..Detach::default()
            }
        });
        let level = level.filter(|d| !d.is_plain());
        cache_level.push(level);
        let skew = Arc::new(AtomicI64::new(plan.skew[p]));
        if plan.skew[p] != 0 {
            world.fault("clock-skew");
            world.log(format_args!("p{p} clock skewed {} ms", plan.skew[p]));
        }
        let clock = SimClock {
            start: world.start,
            skew: skew.clone(),
            highest: Arc::default(),
        };
        clocks.push(clock.clone());
        // Either body runs the real Redis store and subscription over its wire. (A
        // portable process's native cache only names keys: on the store traits, it
        // sends nothing.)
        let mut redis = corral::RedisOptions::new("redis://sim");
        redis.prefix = crate::world::SIM_PREFIX.to_owned();
        redis.response_timeout = Duration::from_millis(crate::world::REPLY_TIMEOUT_MS);
        let native = if scenario.portable {
            let names_only = Arc::new(corral::store::memory::MemoryStore::new(
                Arc::new(clock.clone()),
                1_000,
            ));
            Corral::builder().stores(
                crate::world::SIM_PREFIX,
                names_only.clone(),
                names_only.clone(),
                names_only,
            )
        } else {
            Corral::builder()
                .redis_options(redis.clone())
                .redis_wire(crate::wire::SimWire::new(world.clone(), p))
                .store_layer(crate::tracked::Tracked::layer(world.clone(), p))
        };
        let native = native
            .clock(clock.clone())
            .l1_ttl(Duration::from_millis(scenario.l1_ttl_ms))
            .lock_ttl(Duration::from_millis(scenario.lock_ttl_ms))
            .lock_wait(Duration::from_millis(scenario.lock_wait_ms))
            .build()
            .expect("a simulated process");
        let keys = (0..scenario.keys).map(|k| format!("k{k}"));
        for key in keys.chain(FRESH_KEYS.iter().map(|k| (*k).to_owned())) {
            world.learn_name(&key, &native.entry_name(&key).expect("a valid key"));
        }
        // The cache's own leases (over its link, woken by its subscription), where the
        // store is their one server.
        let cache_leases = native.locks().redis().cloned();
        let cache = if scenario.portable {
            let mut portable = PortableCache::builder();
            if let Some(pm) = level.and_then(|d| d.refresh_permille) {
                world.log(format_args!("p{p} refreshes early at {pm} permille"));
                portable = portable.eager_refresh(pm as f64 / 1000.0);
            }
            if let Some(ms) = level.and_then(|d| d.hard_ms) {
                world.log(format_args!("p{p} times loads out after {ms} ms"));
                portable = portable.hard_timeout(Duration::from_millis(ms));
            }
            let portable = portable
                .clock(clock)
                .redis_options(redis)
                .redis_wire(crate::wire::SimWire::new(world.clone(), p))
                .store_layer(crate::tracked::Tracked::layer(world.clone(), p))
                .l1_ttl(Duration::from_millis(scenario.l1_ttl_ms))
                .lock_ttl(Duration::from_millis(scenario.lock_ttl_ms))
                .lock_wait(Duration::from_millis(scenario.lock_wait_ms))
                .lockstep()
                .build()
                .expect("a simulated portable process");
            Body::Portable(portable)
        } else {
            Body::Native(native)
        };
        // One lease server: the store itself; several (Redlock): servers of their own.
        let servers: Vec<usize> = match scenario.lease_servers {
            1 => vec![0],
            n => (1..=n).collect(),
        };
        let servers = servers
            .into_iter()
            .map(|server| {
                Arc::new(Conn {
                    world: world.clone(),
                    proc: p,
                    server,
                }) as Arc<dyn corral::locks::LeaseServer>
            })
            .collect();
        let locks = match cache_leases {
            Some(leases) if scenario.lease_servers == 1 => leases,
            _ => {
                RedisLocks::over(servers, crate::world::SIM_PREFIX).expect("leases over the simulated store")
            }
        };
        for k in 0..scenario.lock_keys {
            let key = format!("lock{k}");
            world.learn_name(&key, &locks.lock_key(&key).expect("a valid key"));
        }
        lockers.push(locks);
        caches.push(cache);
        skews.push(skew);
    }
    // A connection down, or a subscription alone: the process resubscribes (and drops
    // its L1) when it comes back.
    for (gaps, fault, what) in [
        (&plan.down, "conn-down", "connection"),
        (&plan.deaf, "subscription-drop", "subscription"),
    ] {
        for (p, spans) in gaps.iter().enumerate() {
            for &(a, b) in spans {
                world.fault(fault);
                world.log(format_args!("plan: p{p} {what} down {a}..{b}"));
                let w = world.clone();
                // Its subscription is cut; its own task subscribes again once the
                // store takes it (from `b`).
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(a)).await;
                    w.cut_subscription(p);
                });
            }
        }
    }
    for (p, at) in plan.half_open.iter().enumerate() {
        let Some(at) = *at else { continue };
        world.log(format_args!("plan: p{p} subscription half-open at {at}"));
        let w = world.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at)).await;
            if w.half_open_subscription(p) {
                w.fault("subscription-half-open");
                w.log(format_args!("p{p} subscription half-open"));
            } else {
                w.log(format_args!("p{p} subscription half-open: none to cut"));
            }
        });
    }
    if let Some((server, a, b)) = plan.stall {
        world.fault("server-stall-planned");
        world.log(format_args!("plan: lease server s{server} stalled {a}..{b}"));
        world.st.lock().stalls.push((server, a, b));
    }
    if let Some(at) = plan.restart {
        world.log(format_args!("plan: store restarts at {at}"));
        let w = world.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at)).await;
            w.restart_store();
        });
    }
    for (p, spans) in plan.paused.iter().enumerate() {
        for &(a, b) in spans {
            world.fault("process-pause");
            world.log(format_args!("plan: p{p} paused {a}..{b}"));
        }
    }
    for &(p, at, by) in &plan.steps {
        world.fault("clock-step");
        world.log(format_args!("plan: p{p} clock steps {by} ms at {at}"));
        let (w, skew) = (world.clone(), skews[p].clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at)).await;
            skew.fetch_add(by, Ordering::SeqCst);
            w.log(format_args!("p{p} clock stepped {by} ms"));
        });
    }

    let ctx = Arc::new(Ctx {
        world: world.clone(),
        calls: Mutex::new(Vec::new()),
        acked: Mutex::new(Vec::new()),
        written: Mutex::new(BTreeMap::new()),
        invalidated: Mutex::new(Vec::new()),
        next_call: Mutex::new(0),
        clocks,
        tasks: (0..scenario.procs).map(|_| Mutex::new(Vec::new())).collect(),
        cache_level,
    });
    if let Some((p, at)) = plan.crash {
        world.log(format_args!("plan: p{p} crashes at {at}"));
        let ctx = ctx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at)).await;
            // Dead first (what its dropped futures spawn sends nothing), then dropped.
            ctx.world.crash(p);
            let tasks = std::mem::take(&mut *ctx.tasks[p].lock());
            let live = tasks.iter().filter(|t| !t.is_finished()).count();
            ctx.world
                .log(format_args!("p{p} CRASHED: {live} tasks dropped mid-flight"));
            for t in tasks {
                t.abort();
            }
        });
    }
    let mut actors = Vec::new();
    for (p, cache) in caches.iter().enumerate() {
        // The callers, then the tagger.
        let plans = (0..scenario.actors)
            .map(|a| workload(&scenario, seed, p, a))
            .chain(std::iter::once(tagger(&scenario, seed, p)))
            .chain(std::iter::once(freshener(&scenario, seed, p)))
            .chain(std::iter::once(batcher(&scenario, seed, p)));
        for ops in plans {
            let (ctx2, cache) = (ctx.clone(), cache.clone());
            let actor = tokio::spawn(async move {
                for (think, op) in ops {
                    tokio::time::sleep(Duration::from_millis(think)).await;
                    ctx2.world.gate(p).await;
                    call(&ctx2, p, &cache, op).await;
                }
            });
            ctx.tasks[p].lock().push(actor.abort_handle());
            actors.push((p, actor));
        }
        for l in 0..scenario.lockers {
            let sessions = crate::locks::sessions(&scenario, seed, p, l);
            let (ctx2, locks) = (ctx.clone(), lockers[p].clone());
            let actor = tokio::spawn(async move {
                for s in sessions {
                    tokio::time::sleep(Duration::from_millis(s.think())).await;
                    ctx2.world.gate(p).await;
                    crate::locks::session(&ctx2, p, &locks, s).await;
                }
            });
            ctx.tasks[p].lock().push(actor.abort_handle());
            actors.push((p, actor));
        }
        let known = Arc::new(crate::table::Known::default());
        for l in 0..scenario.table_lockers {
            let sessions = crate::table::sessions(&scenario, seed, p, l);
            let (ctx2, cache, known) = (ctx.clone(), cache.clone(), known.clone());
            let actor = tokio::spawn(async move {
                for s in sessions {
                    tokio::time::sleep(Duration::from_millis(s.think())).await;
                    ctx2.world.gate(p).await;
                    crate::table::session(&ctx2, p, &cache, &known, s).await;
                }
            });
            ctx.tasks[p].lock().push(actor.abort_handle());
            actors.push((p, actor));
        }
    }
    for (p, a) in actors {
        match a.await {
            Ok(()) => {}
            Err(e) if e.is_cancelled() && world.is_crashed(p) => {}
            Err(_) => world.violation(format!("an actor of p{p} panicked")),
        }
    }
    tokio::time::sleep(Duration::from_millis(QUIESCE_MS)).await;
    crate::locks::check_no_lock_left(&world);
    crate::table::check_swept(&ctx, &caches);
    world.check_subscribed();

    // After quiesce: no flight left anywhere.
    for (p, cache) in caches.iter().enumerate() {
        if world.is_crashed(p) {
            continue;
        }
        let n = cache.flights_in_progress();
        if n != 0 {
            world.violation(format!("quiesce: p{p} has {n} flights in progress"));
        }
    }
    // Convergence: with faults off and L1 deadlines past, every process reads what
    // the store holds.
    world.calm();
    // Entries are named in the prefix's current generation (a `clear` moved it).
    let generation = {
        let counter = corral_core::names::generation(crate::world::SIM_PREFIX);
        let alive = (0..caches.len()).find(|&p| !world.is_crashed(p)).unwrap_or(0);
        corral_core::tags::generation(caches[alive].raw(&counter).await.as_deref())
    };
    for k in 0..scenario.keys {
        let key = format!("k{k}");
        for (p, cache) in caches.iter().enumerate() {
            if world.is_crashed(p) {
                continue;
            }
            let name = corral_core::names::name_in(
                crate::world::SIM_PREFIX,
                &key,
                corral_core::names::Kind::Entry,
                generation,
            );
            let stored = cache.raw(&name).await;
            let want = match stored.as_deref().map(tag_of) {
                Some(Tag::Value(v)) if !removed_by_tag(&world, stored.as_deref()) => Some(v),
                _ => None,
            };
            let got = cache
                .get(&key)
                .await
                .map(|v| v.map(|b| String::from_utf8_lossy(&b).into_owned()));
            world.log(format_args!("final p{p} get {key} -> {got:?} (store {want:?})"));
            match got {
                Ok(got) if got == want => {}
                other => world.violation(format!(
                    "convergence: p{p} reads {key} as {other:?}, the store holds {want:?}"
                )),
            }
        }
    }

    check_history(&ctx, &scenario, &plan);
    check_coalesced_timeouts(&ctx);
    check_expiry(&ctx);
    check_invalidations(&ctx, &scenario, &plan);
    crate::locks::check_orphans(&world);

    let metrics_degraded = caches.iter().map(|c| c.degraded()).sum();
    let calls = ctx.calls.lock().len() as u64;
    let mut longest_ms = BTreeMap::new();
    for c in ctx.calls.lock().iter() {
        let l = longest_ms.entry(c.op).or_insert(0);
        *l = (*l).max(c.t_end - c.t_inv);
    }
    let st = world.st.lock();
    let broken = match scenario.broken.name {
        "" => String::new(),
        name => format!(" --broken {name}"),
    };
    let flags = [
        (scenario.portable, " --portable"),
        (!scenario.clears, " --no-clears"),
        (scenario.batches, " --batches"),
        (scenario.refresh, " --refresh"),
        (scenario.timeouts, " --timeouts"),
    ];
    let broken: String = std::iter::once(broken.as_str())
        .chain(flags.iter().filter(|(on, _)| *on).map(|(_, flag)| *flag))
        .collect();
    Outcome {
        seed,
        broken,
        procs: scenario.procs,
        keys: scenario.keys,
        callers: (scenario.actors != Scenario::for_seed(seed).actors).then_some(scenario.actors),
        scenario: scenario.name,
        ops: calls,
        longest_ms,
        locked_loads: st.loads.iter().filter(|l| l.locked).count() as u64,
        degraded_loads: st.loads.iter().filter(|l| !l.locked).count() as u64,
        refreshes: st.refresh_loads,
        metrics_degraded,
        faults: st.faults.clone(),
        excused: st.excused.clone(),
        violations: st.violations.clone(),
        trace: st.trace.clone(),
    }
}

fn show(v: &Option<Bytes>) -> Option<String> {
    v.as_ref().map(|b| String::from_utf8_lossy(b).into_owned())
}

/// One call of the workload, bounded, in a task of its own (a panic that escapes the
/// library is caught at the join and is a violation).
async fn call(ctx: &Arc<Ctx>, proc: usize, cache: &Body, op: Op) {
    if let Op::GetOrSetMany(keys, plan, left_out, asks) = op {
        return call_many(ctx, proc, cache, keys, plan, left_out, asks).await;
    }
    let w = ctx.world.clone();
    let id = ctx.next_id();
    let t_inv = w.now();
    let loaded: Arc<Mutex<Option<(String, LoaderPlan)>>> = Arc::default();
    let load_began: Arc<Mutex<Option<(u64, u64)>>> = Arc::default();
    // Whether the value served is a stale copy, when the body says.
    let stale: Arc<Mutex<Option<bool>>> = Arc::default();
    let (name, key) = match &op {
        Op::Get(k) => ("get", k.clone()),
        Op::Set(k) | Op::SetTagged(k, _) | Op::SetFor(k, _) => ("set", k.clone()),
        Op::Remove(k) => ("remove", k.clone()),
        Op::Expire(k) => ("expire", k.clone()),
        Op::GetOrSet(k, _) | Op::GetOrSetTagged(k, ..) | Op::GetOrSetFor(k, ..) => ("get_or_set", k.clone()),
        Op::RemoveByTag(t) => ("remove_by_tag", t.clone()),
        Op::Clear => ("clear", "*".to_owned()),
        Op::GetOrSetMany(..) => unreachable!("call_many runs it"),
    };
    let tags: Vec<String> = match &op {
        Op::SetTagged(_, t) | Op::GetOrSetTagged(_, t, _) => vec![t.clone()],
        _ => Vec::new(),
    };
    if name != "set" {
        w.log(format_args!("p{proc} c{id} {name} {key}"));
    }
    let op_detach = match &op {
        Op::GetOrSetFor(.., d) => Some(*d),
        _ => None,
    };
    // A process whose cache refreshes early or times loads out does so in any of its
    // get-or-sets, whatever the call asked (the portable body's are its builder's).
    let cache_level = ctx.cache_level[proc];
    let op_detach = match (&op, cache_level) {
        (Op::GetOrSet(..) | Op::GetOrSetTagged(..) | Op::GetOrSetFor(..), Some(d)) => Some(d),
        _ => op_detach,
    };
    let (entry, relative_ms) = match &op {
        Op::SetFor(_, e) | Op::GetOrSetFor(_, e, ..) => (e.options(), e.relative_ms),
        _ => (
            EntryOptions::new().relative(VALUE_TTL),
            VALUE_TTL.as_millis() as u64,
        ),
    };
    let clock_inv = ctx.clocks[proc].now_ms();
    // The portable body refreshes early only as its cache does (a call's own ask is not
    // heard): its loads are judged as refreshes only then.
    let refreshes = cache.is_native() || cache_level.is_some();
    let bound = Duration::from_millis(CALL_BOUND_MS);
    let task = {
        let (cache, w, loaded, key) = (cache.clone(), w.clone(), loaded.clone(), key.clone());
        let (clock, load_began) = (ctx.clocks[proc].clone(), load_began.clone());
        let (tags, stale) = (tags.clone(), stale.clone());
        tokio::spawn(crate::world::CALL.scope(id, async move {
            let res = match op {
                Op::Get(_) => tokio::time::timeout(bound, cache.get(&key))
                    .await
                    .map(|r| r.map(|v| (Res::Value(show(&v)), None))),
                Op::Set(_) | Op::SetTagged(..) | Op::SetFor(..) => {
                    let value = format!("w{}", w.next_seq());
                    w.log(format_args!("p{proc} c{id} set {key} = {value} {tags:?}"));
                    tokio::time::timeout(bound, cache.set_tagged(&key, value.clone(), entry, &tags))
                        .await
                        .map(|r| r.map(|()| (Res::Done(true), Some(value))))
                }
                Op::RemoveByTag(_) => tokio::time::timeout(bound, cache.remove_by_tag(&key))
                    .await
                    .map(|r| r.map(|()| (Res::Done(true), None))),
                Op::Clear => tokio::time::timeout(bound, cache.clear())
                    .await
                    .map(|r| r.map(|()| (Res::Done(true), None))),
                Op::Remove(_) => tokio::time::timeout(bound, cache.remove(&key))
                    .await
                    .map(|r| r.map(|b| (Res::Done(b), None))),
                Op::Expire(_) => tokio::time::timeout(bound, cache.expire(&key))
                    .await
                    .map(|r| r.map(|b| (Res::Done(b), None))),
                Op::GetOrSetMany(..) => unreachable!("call_many runs it"),
                Op::GetOrSet(_, plan) | Op::GetOrSetTagged(_, _, plan) | Op::GetOrSetFor(_, _, plan, _) => {
                    let detach = op_detach.unwrap_or_default();
                    let began = w.now();
                    let ms = plan.ms();
                    let start = {
                        let (w, key, loaded, clock) = (w.clone(), key.clone(), loaded.clone(), clock.clone());
                        let load_began = load_began.clone();
                        move || -> Finish {
                            *load_began.lock() = Some((w.now(), clock.now_ms()));
                            let value = format!("load{}", w.next_seq());
                            let refresh = detach
                                .refresh_permille
                                .filter(|_| refreshes)
                                .map(|permille| MayRefresh::now(permille, relative_ms, &clock));
                            let index = w.load_started(id, proc, &key, &value, began, refresh);
                            let end = EndGuard(w.clone(), index);
                            *loaded.lock() = Some((value.clone(), plan.clone()));
                            if let LoaderPlan::Slow(_) = plan {
                                w.fault("loader-slow");
                            }
                            Box::new(move || {
                                let _end = end;
                                plan_ends(&w, proc, id, &plan).map(|()| Bytes::from(value))
                            })
                        }
                    };
                    let load = Load {
                        wait: Arc::new(wait_for(w.clone(), proc, ms)),
                        start: Box::new(start),
                    };
                    // The portable body's timeouts and eager refresh are its cache's:
                    // it runs every get-or-set as it is (with its tags).
                    let got = if detach.is_plain() || !cache.is_native() {
                        tokio::time::timeout(bound, cache.get_or_set(&key, entry, &tags, load)).await
                    } else {
                        let options = detach.options(entry);
                        tokio::time::timeout(bound, cache.fetch(&key, entry, options, load, &stale)).await
                    };
                    got.map(|r| r.map(|v| (Res::Value(Some(String::from_utf8_lossy(&v).into_owned())), None)))
                }
            };
            match res {
                Err(_elapsed) => (Res::TimedOut, None),
                Ok(Err(e)) => {
                    w.log(format_args!("p{proc} c{id} error: {e}"));
                    (Res::Failed(e.kind()), None)
                }
                Ok(Ok(r)) => r,
            }
        }))
    };
    ctx.tasks[proc].lock().push(task.abort_handle());
    let (res, written) = match task.await {
        Ok(r) => r,
        Err(_) => (Res::Panicked, None),
    };
    // The caller sees the result when its process runs.
    w.gate(proc).await;
    let t_end = w.now();
    let clock_end = ctx.clocks[proc].now_ms();
    w.log(format_args!(
        "p{proc} c{id} {name} {key} -> {res:?} [{t_inv}..{t_end}]"
    ));
    let rec = CallRec {
        id,
        proc,
        op: name,
        key: key.clone(),
        t_inv,
        t_end,
        res: res.clone(),
        loaded: loaded.lock().clone(),
        clocks: (clock_inv, clock_end),
        stale: *stale.lock(),
        detach: op_detach,
        cache_level: cache_level.is_some(),
        batch_hard: None,
        // A pause, or a step of the clock, before the loader began may have spent the
        // load's timeout before it: then only the call's whole time is judged.
        load_began: load_began.lock().filter(|&(t_began, clock_began)| {
            // The clock moved by more than the simulated time (a millisecond of rounding).
            let drift = (clock_began as i64 - clock_inv as i64) - (t_began - t_inv) as i64;
            drift.abs() <= 1 && !w.paused_within(proc, t_inv, t_began)
        }),
    };
    // A write the caller saw succeed: its place in the store's order.
    let order = match (name, &res, &written) {
        ("set", Res::Done(_), Some(v)) => w.st.lock().value_order.get(v).copied().map(|o| (o, v.clone())),
        ("remove" | "expire", Res::Done(_), _) => w.claim_swap(proc, &key).map(|o| (o, name.to_owned())),
        _ => None,
    };
    if let Some((order, label)) = order {
        ctx.acked.lock().push(Acked {
            key: key.clone(),
            t_ack: t_end,
            order,
            label,
        });
    }
    // What the tag and clear invariant needs: values written, invalidations made.
    let mine = match (&res, &written, &rec.loaded) {
        (Res::Done(_), Some(v), _) => Some(v.clone()),
        (Res::Value(Some(v)), _, Some((l, _))) if v == l => Some(v.clone()),
        _ => None,
    };
    if let Some(v) = mine {
        ctx.written.lock().insert(
            v,
            Written {
                tags: tags.clone(),
                t_done: t_end,
                proc,
            },
        );
    }
    if let (Res::Done(_), "remove_by_tag" | "clear") | (Res::Failed(_), "clear") = (&res, name) {
        ctx.invalidated.lock().push(Invalidated {
            tag: (name == "remove_by_tag").then(|| key.clone()),
            call: rec.id,
            proc,
            t_inv,
            t_ack: t_end,
            failed: matches!(res, Res::Failed(_)),
        });
    }
    check_call(&w, &rec);
    ctx.calls.lock().push(rec);
}

/// A get-or-set of several keys, bounded, in a task of its own: one loader call per
/// batch of keys led together, each key's load recorded as a single key's is, and one
/// record per key, judged as a get-or-set of that key.
async fn call_many(
    ctx: &Arc<Ctx>,
    proc: usize,
    cache: &Body,
    keys: Vec<String>,
    plan: LoaderPlan,
    left_out: Option<usize>,
    asks: BatchAsks,
) {
    let w = ctx.world.clone();
    // One id for the batch: its flights' reads run in its task, and count for it.
    let id = ctx.next_id();
    let t_inv = w.now();
    let clock_inv = ctx.clocks[proc].now_ms();
    w.log(format_args!("p{proc} c{id} get_or_set_many {keys:?} {asks:?}"));
    let loaded: Arc<Mutex<BTreeMap<String, (String, LoaderPlan)>>> = Arc::default();
    let ms = plan.ms();
    let absent = left_out.map(|i| keys[i].clone());
    // When each key's loader call began (the simulated time, the process's clock).
    let began: Arc<Mutex<BTreeMap<String, (u64, u64)>>> = Arc::default();
    // A process whose cache refreshes early may load a key due for refresh.
    let cache_level = ctx.cache_level[proc];
    let refresh = cache_level.and_then(|d| d.refresh_permille);
    let relative_ms = asks.relative_ms.unwrap_or(VALUE_TTL.as_millis() as u64);
    let load: crate::body::BatchLoad = {
        let (w, loaded, plan, began) = (w.clone(), loaded.clone(), plan.clone(), began.clone());
        let clock = ctx.clocks[proc].clone();
        let wait = Arc::new(wait_for(w.clone(), proc, ms));
        Arc::new(move |asked: Vec<String>| {
            let mut ends = Vec::with_capacity(asked.len());
            let mut values = Vec::with_capacity(asked.len());
            for key in asked {
                let value = format!("load{}", w.next_seq());
                let refresh = refresh.map(|permille| MayRefresh::now(permille, relative_ms, &clock));
                let index = w.load_started(id, proc, &key, &value, t_inv, refresh);
                began.lock().insert(key.clone(), (w.now(), clock.now_ms()));
                ends.push(EndGuard(w.clone(), index));
                if absent.as_ref() != Some(&key) {
                    loaded.lock().insert(key.clone(), (value.clone(), plan.clone()));
                    values.push((key, Bytes::from(value)));
                }
            }
            if let LoaderPlan::Slow(_) = plan {
                w.fault("loader-slow");
            }
            w.log(format_args!(
                "p{proc} c{id} loads {:?}",
                values.iter().map(|(k, _)| k).collect::<Vec<_>>()
            ));
            let (w, plan, wait) = (w.clone(), plan.clone(), wait.clone());
            Box::pin(async move {
                wait().await;
                let _ends = ends;
                plan_ends(&w, proc, id, &plan).map(|()| values)
            })
        })
    };
    let bound = Duration::from_millis(CALL_BOUND_MS);
    let task = {
        let (cache, asked) = (cache.clone(), keys.clone());
        let entry = EntryOptions::new().relative(Duration::from_millis(relative_ms));
        tokio::spawn(crate::world::CALL.scope(id, async move {
            tokio::time::timeout(bound, cache.get_or_set_many(&asked, entry, asks, load)).await
        }))
    };
    ctx.tasks[proc].lock().push(task.abort_handle());
    let answers: Vec<Res> = match task.await {
        Err(_) => vec![Res::Panicked; keys.len()],
        Ok(Err(_elapsed)) => vec![Res::TimedOut; keys.len()],
        Ok(Ok(Err(e))) => {
            w.log(format_args!("p{proc} c{id} error: {e}"));
            vec![Res::Failed(e.kind()); keys.len()]
        }
        Ok(Ok(Ok(answers))) => answers
            .into_iter()
            .map(|a| match a {
                Ok(v) => Res::Value(v.as_deref().map(|b| String::from_utf8_lossy(b).into_owned())),
                Err(e) => Res::Failed(e.kind()),
            })
            .collect(),
    };
    w.gate(proc).await;
    let t_end = w.now();
    let clock_end = ctx.clocks[proc].now_ms();
    for (key, res) in keys.into_iter().zip(answers) {
        w.log(format_args!(
            "p{proc} c{id} get_or_set {key} -> {res:?} [{t_inv}..{t_end}]"
        ));
        let rec = CallRec {
            id,
            proc,
            op: "get_or_set",
            key: key.clone(),
            t_inv,
            t_end,
            res: res.clone(),
            loaded: loaded.lock().get(&key).cloned(),
            clocks: (clock_inv, clock_end),
            stale: None,
            // A key due for refresh answers with its copy while its loader runs.
            detach: cache_level,
            cache_level: cache_level.is_some(),
            // A hard timeout cuts the key's load, counted from its loader call (the
            // native body's asks; the portable body's builder, with `--timeouts`).
            batch_hard: if cache.is_native() {
                asks.hard_ms
            } else {
                cache_level.and_then(|d| d.hard_ms)
            }
            .map(|h| (h, began.lock().get(&key).copied())),
            load_began: None,
        };
        if let (Res::Value(Some(v)), Some((l, _))) = (&res, &rec.loaded)
            && v == l
        {
            ctx.written.lock().insert(
                v.clone(),
                Written {
                    tags: Vec::new(),
                    t_done: t_end,
                    proc,
                },
            );
        }
        check_call(&w, &rec);
        ctx.calls.lock().push(rec);
    }
}

/// How a loader of call `id` ends, as its plan says: it fails, it panics, or it
/// answers (the caller's value).
fn plan_ends(w: &World, proc: usize, id: u64, plan: &LoaderPlan) -> Result<(), String> {
    match plan {
        LoaderPlan::Fail(_) => {
            w.fault("loader-fail");
            w.log(format_args!("p{proc} c{id} loader fails"));
            Err("sim: loader failed".to_owned())
        }
        LoaderPlan::Panic(_) => {
            w.fault("loader-panic");
            w.log(format_args!("p{proc} c{id} loader panics"));
            panic!("sim: loader panic");
        }
        LoaderPlan::Ok(_) | LoaderPlan::Slow(_) => Ok(()),
    }
}

struct EndGuard(Arc<World>, usize);

impl Drop for EndGuard {
    fn drop(&mut self) {
        self.0.load_ended(self.1);
    }
}

/// Per call: bounded, typed errors, no escaped panic, a loader's outcome reaches its caller.
pub(crate) fn check_call(w: &World, c: &CallRec) {
    let who = format!("p{} c{} {} {}", c.proc, c.id, c.op, c.key);
    match (&c.res, c.op) {
        (Res::TimedOut, _) => w.violation(format!("deadline: {who} ran past {CALL_BOUND_MS} ms")),
        (Res::Panicked, _) => w.violation(format!("panic escaped: {who}")),
        (
            Res::Failed(ErrorKind::Unavailable),
            "get" | "set" | "remove" | "expire" | "remove_by_tag" | "clear",
        ) => {}
        (Res::Failed(ErrorKind::Loader), "get_or_set") => {}
        // A hard timeout that ran out (its loader started after the call began).
        (Res::Failed(ErrorKind::Timeout), "get_or_set") if c.own_timeout_ran_out() => {}
        // Not its own: the timeout of the flight it followed, judged once every call is
        // in (`check_coalesced_timeouts`).
        (Res::Failed(ErrorKind::Timeout), "get_or_set") if c.detach.is_none() || c.cache_level => {}
        // Held past the wait, no answer, or lost before the release.
        (
            Res::Failed(
                ErrorKind::Timeout | ErrorKind::Unavailable | ErrorKind::LockLost | ErrorKind::Quorum,
            ),
            "lock",
        ) => {}
        (Res::Failed(kind), _) => w.violation(format!("error kind: {who} failed with {kind:?}")),
        _ => {}
    }
    if let Some((value, plan)) = &c.loaded {
        // A process whose cache refreshes early (`cache_level`): a call's load may be an
        // eager refresh, whose caller is served the copy it hit, whatever the load does:
        // a value of its key written before the load began. Surely one (`Some(false)`:
        // a copy fresh by every clock stood when it took the lock): that copy, never its
        // own value; else its own value (a lead) or such a copy.
        let refreshing = c.cache_level && c.detach.is_some_and(|d| d.refresh_permille.is_some());
        let (refreshed, copy, blind_refresh) = if refreshing {
            let st = w.st.lock();
            let load = st.loads.iter().find(|l| l.value == *value);
            let start = load.map_or(c.t_end, |l| l.start);
            let written_before = |v: &str| {
                st.versions.get(&c.key).is_some_and(|versions| {
                    versions
                        .iter()
                        .any(|version| version.t <= start && version.kind.value() == Some(v))
                })
            };
            let copy = match &c.res {
                Res::Value(Some(v)) => v != value && written_before(v),
                _ => false,
            };
            // Served the copy: a refresh, which never loads once its own second read
            // of the entry failed (contract §7.3).
            let blind = copy && load.is_some_and(|l| l.own_read_failed);
            (load.and_then(|l| l.refresh), copy, blind)
        } else {
            (None, false, false)
        };
        if blind_refresh {
            w.violation(format!(
                "refresh-after-failed-read: {who}'s refresh loaded {value} although its read of the \
                 entry failed after its lock"
            ));
        }
        let ok = match (plan, &c.res) {
            (_, Res::Value(Some(_))) if refreshed == Some(false) => copy,
            // A loader's panic traps the portable call that runs it, a refresh's too.
            (LoaderPlan::Panic(_), Res::Failed(ErrorKind::Loader)) => true,
            _ if refreshed == Some(false) => false,
            (_, Res::Value(Some(_))) if copy => true,
            // Cut by a timeout, or answered before its loader ended (a stale copy, the
            // current value while a refresh runs): the expiry check judges the value.
            (_, Res::Value(Some(_))) if c.detached() && !c.cache_level => true,
            (_, Res::Failed(ErrorKind::Timeout)) => c.own_timeout_ran_out(),
            (LoaderPlan::Fail(_), Res::Failed(ErrorKind::Loader)) => true,
            // Fail-safe: the stale copy of an entry written with a window (the window is
            // checked by `check_expiry`).
            (LoaderPlan::Panic(_) | LoaderPlan::Fail(_), Res::Value(Some(v))) => {
                v != value
                    && w.st
                        .lock()
                        .value_meta
                        .get(v)
                        .is_some_and(|m| m.stale_ms.is_some())
            }
            (LoaderPlan::Ok(_) | LoaderPlan::Slow(_), Res::Value(Some(v))) => v == value,
            _ => false,
        };
        if !ok {
            let meta = match &c.res {
                Res::Value(Some(v)) => w.st.lock().value_meta.get(v).copied(),
                _ => None,
            };
            let meta = meta.map_or(String::new(), |m| format!(" ({m:?})"));
            w.violation(format!(
                "loader outcome: {who} ran its loader ({plan:?}, {value}) and got {:?}{meta}",
                c.res
            ));
        }
    }
}

/// After the run: no value was served past its expiry by the reader's own clock (a
/// plain `get`), or past the end of its fail-safe window (a get-or-set), by the
/// expiry its envelope carried when first written (a sliding entry: its absolute
/// point, which no touch moves). A flight's own outcome (a load that ended during the
/// call) is exempt: a caller gets what its flight loaded. The reader's clock at the
/// moment it judged is at least the lower of its clock at the call's start and at its
/// end less the call's span (a clock step back inside the call).
/// A get-or-set whose own hard timeout (if any) did not run out fails with `Timeout`
/// only as a follower of a flight whose leader's did (a batch's key, led with one,
/// counted from its loader call): a call of the same key in the same process that
/// timed out so, begun no later and ended no earlier (a flight answers its followers as
/// it ends). The portable body's timeouts are its cache's (`--timeouts`): its calls are
/// judged so too, a call's own timeout counting only if it ran the load; and a call
/// there joins the flight it finds after its read or its wait, so that flight may have
/// begun after the call began, and the two overlap (a batch returns once all its keys
/// are answered).
fn check_coalesced_timeouts(ctx: &Ctx) {
    let w = &ctx.world;
    let calls = ctx.calls.lock();
    let timed_out = |c: &&CallRec| c.op == "get_or_set" && matches!(c.res, Res::Failed(ErrorKind::Timeout));
    for c in calls
        .iter()
        .filter(timed_out)
        .filter(|c| (c.detach.is_none() || c.cache_level) && !c.own_timeout_ran_out())
    {
        let led = calls.iter().filter(timed_out).any(|l| {
            l.id != c.id
                && l.proc == c.proc
                && l.key == c.key
                && if c.cache_level {
                    // A portable call joins the flight it finds once its wait or read
                    // ends (a batch's key after its read; one that waited on another
                    // process's lock once that ends): one begun since the call began, too.
                    // It is answered as that flight ends (before its leader's caller sees
                    // it, or after): the two overlap.
                    l.t_inv <= c.t_end && c.t_inv <= l.t_end
                } else {
                    l.t_inv <= c.t_inv && c.t_end <= l.t_end
                }
                && l.own_timeout_ran_out()
        });
        if !led {
            w.violation(format!(
                "error kind: p{} c{} get_or_set {} failed with Timeout, its own hard timeout (if any) not run out and following no flight that timed out",
                c.proc, c.id, c.key
            ));
        }
    }
}

fn check_expiry(ctx: &Ctx) {
    let w = &ctx.world;
    let calls = ctx.calls.lock();
    let (metas, loads) = {
        let st = w.st.lock();
        (st.value_meta.clone(), st.loads.clone())
    };
    for c in calls.iter() {
        let Res::Value(Some(v)) = &c.res else {
            continue;
        };
        let Some(meta) = metas.get(v) else { continue };
        let flight_outcome = loads
            .iter()
            .any(|l| l.value == *v && l.end.is_some_and(|e| c.t_inv <= e && e <= c.t_end));
        if flight_outcome {
            continue;
        }
        let fresh_end = match meta.sliding_ms {
            Some(_) => meta.absolute_ms.unwrap_or(u64::MAX),
            None => meta.expires_at_ms,
        };
        // A plain get, or a get-or-set that says the value is not a stale copy: fresh.
        let fresh_only = c.op == "get" || c.stale == Some(false);
        let end = if fresh_only {
            fresh_end
        } else {
            fresh_end.saturating_add(meta.stale_ms.unwrap_or(0))
        };
        let (clock_inv, clock_end) = c.clocks;
        let judged_at_least = clock_inv.min(clock_end.saturating_sub(c.t_end - c.t_inv));
        if judged_at_least >= end {
            w.violation(format!(
                "expiry: p{} c{} {} {} at {} served {v} at its clock >= {judged_at_least}, {} ms past {} ({meta:?})",
                c.proc,
                c.id,
                c.op,
                c.key,
                c.t_inv,
                judged_at_least - end,
                if fresh_only { "its expiry" } else { "its stale window" },
            ));
        }
    }
}

/// After the run: no process served a value older than a write acknowledged before
/// the read began, once the invalidation window passed.
fn check_history(ctx: &Ctx, s: &Scenario, plan: &Plan) {
    let w = &ctx.world;
    let calls = ctx.calls.lock();
    let acked = ctx.acked.lock();
    let written = ctx.written.lock();
    let invalidated = ctx.invalidated.lock();
    let (value_order, gaps, pauses) = {
        let st = w.st.lock();
        (st.value_order.clone(), st.gaps.clone(), st.paused.clone())
    };
    for c in calls.iter() {
        let Res::Value(Some(v)) = &c.res else {
            continue;
        };
        let Some(&served) = value_order.get(v) else {
            if !v.starts_with("load") {
                w.violation(format!(
                    "phantom: p{} c{} served {v}, never written",
                    c.proc, c.id
                ));
            }
            continue;
        };
        let back: u64 = plan
            .steps
            .iter()
            .filter(|(p, _, by)| *p == c.proc && *by < 0)
            .map(|(_, _, by)| by.unsigned_abs())
            .sum::<u64>()
            + plan.skew[c.proc].unsigned_abs() * 2;
        for a in acked
            .iter()
            .filter(|a| a.key == c.key && a.t_ack <= c.t_inv && a.order > served)
        {
            let lag = c.t_inv - a.t_ack;
            if lag <= NOTIFY_WINDOW_MS {
                continue;
            }
            // A gap covers the write if it came once the write was in the store (its
            // announcement goes out after that) or around its acknowledgement (which a
            // writer paused before its reply comes late to).
            let applied = w.st.lock().applied_at(a.order).unwrap_or(a.t_ack);
            let covering = gaps.iter().filter(|g| {
                g.proc == c.proc
                    && g.key.as_ref().is_none_or(|k| *k == c.key)
                    && (g.t >= applied || g.t + 2 * SLOW_NET_MS >= a.t_ack)
                    && g.t <= c.t_inv
            });
            // A notification lost on its way: the copy lives until the L1 TTL. One the
            // process could not hear (its connection down, the store restarted): until it
            // resubscribes and drops its L1 (when it runs, if it was paused then).
            let resumed = |t: u64| {
                pauses[c.proc]
                    .iter()
                    .find(|&&(x, y)| x <= t && t < y)
                    .map_or(t, |&(_, y)| y)
            };
            let gap = covering.into_iter().any(|g| match g.healed {
                None => lag <= s.l1_ttl_ms + NOTIFY_WINDOW_MS + back,
                Some(h) => c.t_inv <= resumed(h) + NOTIFY_WINDOW_MS,
            });
            let what = format!(
                "p{} c{} {} {} at {} served {v} (order {served}), but {} (order {}) was acknowledged at {} ({lag} ms before)",
                c.proc, c.id, c.op, c.key, c.t_inv, a.label, a.order, a.t_ack
            );
            // (The simulator found two library bugs here, now fixed: a `set` whose reply
            // came late filled its own L1 over newer writes, and a caller joining a flight
            // in its tail got an old value while the leader released and announced.)
            // The reader was paused while the announcement should have reached it: it
            // hears it when it resumes, and serves its L1 copy until then.
            let paused = pauses[c.proc].iter().any(|&(x, y)| {
                x <= a.t_ack + NOTIFY_WINDOW_MS
                    && y + 2 * SLOW_NET_MS >= a.t_ack
                    && c.t_inv <= y + NOTIFY_WINDOW_MS
            });
            // Written in a generation of the prefix older than what was served: a
            // `clear` lies between them, and a write a process made in the generation it
            // still knew is never read in the next one (contract §7.5).
            let (served_in, written_in) = {
                let st = w.st.lock();
                (st.generation_at(served), st.generation_at(a.order))
            };
            let across_clear = match (served_in, written_in) {
                (Some(served_in), Some(written_in)) => written_in < served_in,
                (served_in, written_in) => served_in != written_in,
            };
            // Served from a generation a clear had left, over a write after the clear: as
            // stale as any copy. A clear that moved the generation past the served
            // value's, heard by the reader (its announcement goes out before the clear
            // returns), has it use that generation or a later one from then on (§7.5).
            // Excused: the reader missed every such clear that returned (its announcement
            // lost, until the L1 TTL, or unheard, until it resubscribed; a pause across
            // it), or the store restarted between the two writes (a lower generation is
            // believed). A clear that failed announced nothing: the generation it moved,
            // if it did, is learnt from the counter, read again within the L1 TTL. One
            // that never returned (its process crashed) is not counted.
            let behind_a_clear = matches!((served_in, written_in), (Some(old), Some(new)) if old < new) && {
                let served_written = written.get(v).map(|wr| wr.t_done);
                let served_in = served_in.unwrap_or_default();
                let moved_past = |i: &Invalidated| {
                    w.st.lock()
                        .generation_written(i.call)
                        .is_some_and(|g| g > served_in)
                };
                let bound = s.l1_ttl_ms + NOTIFY_WINDOW_MS + back;
                let missed = |i: &Invalidated| {
                    let heard_by = i.t_ack + NOTIFY_WINDOW_MS + 2 * SLOW_NET_MS;
                    missed_announcement(&gaps, &pauses[c.proc], (c.proc, c.t_inv), i, heard_by, bound)
                        .is_some()
                };
                let learnt = invalidated.iter().any(|i| {
                    i.tag.is_none()
                        && moved_past(i)
                        && if i.failed {
                            i.t_ack + bound < c.t_inv
                        } else {
                            i.t_ack + NOTIFY_WINDOW_MS < c.t_inv && !missed(i)
                        }
                });
                // When the served value reached the store: its writer's call may never
                // have returned.
                let served_applied = w.st.lock().applied_at(served).or(served_written);
                let restarted = plan.restart.is_some_and(|r| {
                    r <= c.t_inv && (served_applied.is_some_and(|t| t >= r) || a.t_ack <= r)
                });
                !learnt || restarted
            };
            if paused {
                w.excuse("stale-after-pause", what);
            } else if across_clear {
                w.excuse("stale-across-clear", what);
            } else if behind_a_clear {
                w.excuse("stale-behind-a-lost-clear", what);
            } else if gap {
                w.excuse("stale-after-lost-notification", what);
            } else {
                w.violation(format!("stale read: {what}"));
            }
            break;
        }
    }
}

/// After the run: once a `remove_by_tag(t)` or a `clear` returned and the announcement
/// window passed, no process serves a value written (its call returned) before the
/// invalidation began and carrying `t` (any value, for a clear). Excused: the reader
/// missed the announcement (lost: until the L1 TTL; its connection down: until it
/// resubscribed), it was paused meanwhile, or clocks skewed or stepped by more than the
/// time between the write and the invalidation (contract §7.5: moments are the
/// processes' clocks).
fn check_invalidations(ctx: &Ctx, s: &Scenario, plan: &Plan) {
    let w = &ctx.world;
    let calls = ctx.calls.lock();
    let written = ctx.written.lock();
    let invalidated = ctx.invalidated.lock();
    let (gaps, pauses) = {
        let st = w.st.lock();
        (st.gaps.clone(), st.paused.clone())
    };
    // How far a process's clock may be from the others' (skew both ways, steps).
    let drift = |p: usize| -> u64 {
        let steps: u64 = plan
            .steps
            .iter()
            .filter(|(q, _, _)| *q == p)
            .map(|(_, _, by)| by.unsigned_abs())
            .sum();
        plan.skew[p].unsigned_abs() + steps
    };
    // How far ahead of true time a process's clock was at `t` (negative: behind).
    let ahead = |p: usize, t: u64| -> i64 {
        let stepped: i64 = plan
            .steps
            .iter()
            .filter(|&&(q, at, _)| q == p && at <= t)
            .map(|&(_, _, by)| by)
            .sum();
        plan.skew[p] + stepped
    };
    for c in calls.iter() {
        let (Res::Value(Some(v)), "get" | "get_or_set") = (&c.res, c.op) else {
            continue;
        };
        let Some(wr) = written.get(v) else {
            continue;
        };
        // The first invalidation it should have yielded to is enough.
        if let Some(inv) = invalidated.iter().find(|i| {
            !i.failed
                && i.t_ack + NOTIFY_WINDOW_MS < c.t_inv
                && wr.t_done < i.t_inv
                && i.tag.as_ref().is_none_or(|t| wr.tags.contains(t))
        }) {
            let what = format!(
                "p{} c{} {} {} at {} served {v} (written by p{} by {}), but {} by p{} began at {} and returned at {}",
                c.proc,
                c.id,
                c.op,
                c.key,
                c.t_inv,
                wr.proc,
                wr.t_done,
                inv.tag
                    .as_ref()
                    .map_or("clear".to_owned(), |t| format!("remove_by_tag({t})")),
                inv.proc,
                inv.t_inv,
                inv.t_ack
            );
            if inv.t_inv - wr.t_done <= drift(wr.proc) + drift(inv.proc) {
                w.excuse("invalidation-clock-drift", what);
                continue;
            }
            // A tagged write is stamped after every moment of its tags its writer knew
            // of, and each moment is the clock of the process that invalidated: an
            // earlier invalidation `j` by a clock running ahead carries its lead into the
            // write's stamp. Should the store lose `j`'s moment (a restart) before `inv`
            // reads it, `inv`'s moment, by its own clock, can be older than the stamp.
            let carried = invalidated.iter().any(|j| {
                !j.failed
                    && j.t_inv < wr.t_done
                    && j.tag.as_ref().is_none_or(|t| wr.tags.contains(t))
                    && plan.restart.is_some_and(|r| j.t_inv < r && r < inv.t_ack)
                    && {
                        let lead = ahead(j.proc, j.t_ack).max(0).unsigned_abs();
                        let behind = ahead(inv.proc, inv.t_inv).min(0).unsigned_abs();
                        inv.t_inv.saturating_sub(j.t_ack) <= lead + behind
                    }
            });
            if carried {
                w.excuse("invalidation-clock-drift", what);
                continue;
            }
            let missed = missed_announcement(
                &gaps,
                &pauses[c.proc],
                (c.proc, c.t_inv),
                inv,
                c.t_inv,
                s.l1_ttl_ms + NOTIFY_WINDOW_MS,
            );
            match missed {
                Some(Missed::Paused) => w.excuse("invalidated-after-pause", what),
                Some(Missed::Lost) => w.excuse("invalidated-after-lost-announcement", what),
                None => w.violation(format!("served after invalidation: {what}")),
            }
        }
    }
}

/// How a reader can have missed an invalidation's announcement.
enum Missed {
    /// It was paused across the announcement: it hears it when it resumes.
    Paused,
    /// The announcement was lost on its way (until the L1 TTL), or the reader could not
    /// hear it (until it resubscribed and dropped its L1).
    Lost,
}

/// Whether process `proc`, reading at `t_read`, can have missed `inv`'s announcement
/// (with the `gaps` and `pauses` of the run): a gap counts from just before `inv` began
/// until `heard_by`, and a lost announcement excuses a read up to `lost_for` after `inv`
/// returned.
fn missed_announcement(
    gaps: &[crate::world::Gap],
    pauses: &[(u64, u64)],
    (proc, t_read): (usize, u64),
    inv: &Invalidated,
    heard_by: u64,
    lost_for: u64,
) -> Option<Missed> {
    let paused = pauses.iter().any(|&(x, y)| {
        x <= inv.t_ack + NOTIFY_WINDOW_MS
            && y + 2 * SLOW_NET_MS >= inv.t_ack
            && t_read <= y + NOTIFY_WINDOW_MS
    });
    if paused {
        return Some(Missed::Paused);
    }
    let resumed = |t: u64| {
        pauses
            .iter()
            .find(|&&(x, y)| x <= t && t < y)
            .map_or(t, |&(_, y)| y)
    };
    let lag = t_read.saturating_sub(inv.t_ack);
    let lost = gaps.iter().any(|g| {
        g.proc == proc
            && g.key.as_ref().is_none_or(|k| k == crate::world::INVALIDATIONS)
            && g.t + 2 * SLOW_NET_MS >= inv.t_inv
            && g.t <= heard_by
            && match g.healed {
                None => lag <= lost_for,
                Some(h) => t_read <= resumed(h) + NOTIFY_WINDOW_MS,
            }
    });
    lost.then_some(Missed::Lost)
}

/// Whether stored entry bytes carry a tag whose stored moments remove them: the store
/// still holds them, nobody serves them.
fn removed_by_tag(world: &World, stored: Option<&[u8]>) -> bool {
    let now = world.now();
    stored.is_some_and(|bytes| world.st.lock().removed_by_tag(bytes, now))
}
