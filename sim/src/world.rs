//! The simulated world: one store with Redis's semantics for what Corral uses, the
//! network between each process and it, the fault plan, the trace, and the records the
//! invariants are checked against.
//!
//! Every store operation of a process goes through [`Conn`]: refused while the
//! process's connection is down; otherwise the request travels (a delay), is applied
//! atomically on the store at its arrival (virtual) time, and the reply travels back,
//! delayed, or lost (the caller gets `Unavailable` after a timeout, though the store
//! applied the command).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use corral::locks::{LeaseServer, LockScript, Unanswered};
use corral::{Error, ErrorKind};
use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;

use crate::keyspace::{Step, Write};
use crate::lua::Reply;
use crate::rng::Rng;
use crate::scenario::{Broken, Scenario, Script};

tokio::task_local! {
    /// The workload call a task runs (its store commands are that call's).
    pub(crate) static CALL: u64;
}

/// How long a caller waits for a reply that never comes (the client's response timeout).
pub const REPLY_TIMEOUT_MS: u64 = 1_000;
/// Longest normal one-way latency.
pub const NET_MS: u64 = 3;
/// Longest delayed one-way latency (a "delay" fault).
pub const SLOW_NET_MS: u64 = 400;
/// Longest a delivered notification takes after the store applied the publish.
pub const DELIVERY_MS: u64 = 5;

/// What a stored value is, as the invariants see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tag {
    /// An envelope holding this value (`w{n}` from a set, `load{n}` from a loader).
    Value(String),
    /// A removal's tombstone.
    Tombstone,
    /// Bytes that are neither.
    Other,
}

/// Decodes stored bytes into a [`Tag`] (the envelope's value follows its header, whose
/// length the version says: a tagged entry's carries its tags).
pub fn tag_of(bytes: &[u8]) -> Tag {
    if bytes.len() < 32 && bytes.starts_with(b"CRL\0") {
        return Tag::Tombstone;
    }
    if !bytes.starts_with(b"CRL") {
        return Tag::Other;
    }
    let limits = corral_core::Limits::default();
    match corral_core::envelope::decode_header(bytes, bytes.len() as u64, &limits) {
        Ok(d) => Tag::Value(String::from_utf8_lossy(&bytes[d.value_offset..]).into_owned()),
        Err(_) => Tag::Other,
    }
}

/// The prefix every simulated process names its data under.
pub const SIM_PREFIX: &str = "sim:";

/// The name gaps of the tag and clear channel carry (no user key is named so).
pub const INVALIDATIONS: &str = "#invalidations";

/// How a version of a key came to be in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VersionKind {
    /// A `set` (plain write) of a `w{n}` value.
    Set(String),
    /// A loader's value, written fenced (`set_if`) or plain (`set`: no fence known).
    Load { value: String, fenced: bool },
    /// A removal's tombstone (`swap`).
    Remove,
    /// A compare-and-delete of expired or corrupt bytes.
    Cleanup,
    /// The store restarted empty.
    Restart,
}

impl VersionKind {
    /// The value this version wrote, if it wrote one.
    pub(crate) fn value(&self) -> Option<&str> {
        match self {
            VersionKind::Set(v) | VersionKind::Load { value: v, .. } => Some(v),
            _ => None,
        }
    }
}

/// A call's reads of one name ([`State::reads`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Reads {
    /// One is running: since when.
    pub(crate) pending_since: Option<u64>,
    /// When the last one that failed ended.
    pub(crate) failed_at: Option<u64>,
}

/// One version of a key, in the store's order.
#[derive(Clone, Debug)]
pub struct Version {
    pub order: u64,
    pub t: u64,
    pub kind: VersionKind,
    /// The store name it was written under (a `clear` moves a key's entry to another
    /// name); empty for a restart, which wiped every name.
    pub name: String,
}

#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub(crate) bytes: Bytes,
    pub(crate) until: u64,
    /// The virtual time this version was applied.
    since: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct HeldLock {
    pub(crate) owner: String,
    pub(crate) proc: usize,
    pub(crate) until: u64,
    pub(crate) since: u64,
    /// The try that took it lost its reply: the flight did not know it held it.
    pub(crate) reply_lost: bool,
    /// The workload call whose flight took it (a process may run two flights of one
    /// key: one sealed by a change it heard, and a new one).
    pub(crate) call: Option<u64>,
}

/// A lock the store granted (a get-or-set flight lock, or a lease), for the checks that
/// every grant is released by its owner or left to a crashed process, and that fencing
/// tokens only rise.
#[derive(Clone, Debug)]
pub struct Grant {
    /// The lock's store name, and the user key.
    pub name: String,
    pub key: String,
    pub proc: usize,
    pub owner: String,
    /// When the store applied it.
    pub t: u64,
    /// Its reply reached the caller.
    pub acknowledged: bool,
    /// A lease's fencing token (0 for a flight lock).
    pub fencing: u64,
}

/// A load in progress or done, as the loader saw it.
#[derive(Clone, Debug)]
pub struct LoadRec {
    pub call: u64,
    pub proc: usize,
    pub key: String,
    pub value: String,
    pub start: u64,
    pub end: Option<u64>,
    /// Ran while its process held the key's flight lock (a try whose reply arrived).
    pub locked: bool,
    /// When that lock lapses (store time).
    pub lock_until: u64,
    /// That lock's store name (each generation of the prefix has its own).
    pub lock_name: String,
    /// A renewal of that lock was refused (the key was written or removed during the
    /// load): the lock lapses under the load by design.
    pub renewal_refused: bool,
    /// Began while a fresh copy of its key stood, in a call that may refresh: an eager
    /// refresh, whose caller is served that copy, not this load's value (`Some(false)`),
    /// or, its double-check read having failed, perhaps the call's own lead
    /// (`Some(true)`: either answer).
    pub refresh: Option<bool>,
    /// Its call's own read of the key's entry failed, or was still running, after the
    /// lock was taken: no refresh may load then (contract §7.3: a refresh whose second
    /// read finds the entry unreadable does nothing), only the call's own lead.
    pub own_read_failed: bool,
}

/// What a call that may refresh early asked, for judging its loads: its eager-refresh
/// fraction and its relative duration, and the highest reading of its process's clock
/// when its load began (its double-check judged the copy due at a reading no higher).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MayRefresh {
    pub(crate) permille: u64,
    pub(crate) relative_ms: u64,
    pub(crate) clock_ms: u64,
}

impl MayRefresh {
    /// A call's ask, as its load begins: the highest reading of its process's `clock` now.
    pub(crate) fn now(permille: u64, relative_ms: u64, clock: &crate::run::SimClock) -> Self {
        MayRefresh {
            permille,
            relative_ms,
            clock_ms: clock.highest_ms(),
        }
    }

    /// When the refresh of a copy whose absolute point is `end_ms` falls due (contract
    /// §7.3): `permille` thousandths of the call's relative duration, counted as ending
    /// at that point, have passed.
    pub(crate) fn due_ms(&self, end_ms: u64) -> u64 {
        let left = u128::from(self.relative_ms) * u128::from(1000 - self.permille.min(1000)) / 1000;
        end_ms.saturating_sub(left as u64)
    }
}

/// A lost or undeliverable notification: `key` (or every key: `None`) for `proc` at `t`.
#[derive(Clone, Debug)]
pub struct Gap {
    pub proc: usize,
    pub key: Option<String>,
    pub t: u64,
    /// When the process drops its whole L1 for it (it resubscribes: its connection came
    /// back, or the store restarted; `wire::UNHEALED` until it has); `None` for a
    /// notification lost on its way, which only the L1 TTL ends.
    pub healed: Option<u64>,
}

/// Everything the world holds, behind one lock (one thread runs the world anyway).
#[derive(Debug)]
pub struct State {
    pub(crate) rng: Rng,
    pub(crate) calm: bool,
    /// No fault can keep a leader from renewing its flight lock (no pause, crash, clock
    /// step, delay, lost reply, outage or restart), and the body renews (the native
    /// one): a flight lock must not lapse while its leader's load runs.
    pub(crate) leaders_keep_locks: bool,
    pub trace: String,
    pub(crate) entries: BTreeMap<String, Stored>,
    pub(crate) locks: BTreeMap<String, HeldLock>,
    order: u64,
    seq: u64,
    /// Per user key, every version in the store's order.
    pub versions: BTreeMap<String, Vec<Version>>,
    /// Per value, its first version's order.
    pub value_order: BTreeMap<String, u64>,
    /// Each write of the prefix's generation counter (a `clear`'s step): by which
    /// workload call (none: outside any), and the generation it wrote.
    pub generations: Vec<(Option<u64>, u64)>,
    /// Tombstones applied per (process, key), not yet claimed by a returning remove.
    pending_swaps: BTreeMap<(usize, String), Vec<u64>>,
    /// Per key, times a held flight lock was lost (lapsed and taken over, or wiped).
    pub lock_losses: BTreeMap<String, Vec<u64>>,
    /// Loads that began while a fresh copy of their key stood: eager refreshes.
    pub refresh_loads: u64,
    /// Per (call, key): the call's reads of the key's entry, or of a name the judgement
    /// of an entry needs (a tag's moments, the generation).
    pub(crate) reads: BTreeMap<(u64, String), Reads>,
    pub gaps: Vec<Gap>,
    /// Per process, its gaps that last until it resubscribes (indexes into `gaps`).
    pub(crate) unhealed: Vec<Vec<usize>>,
    /// What the store's `PUBLISH`es of the step being applied put out.
    pub(crate) outbox: Vec<(String, Vec<u8>)>,
    /// The store's script cache (`EVAL` fills it, a restart empties it): SHA-1 to body.
    pub(crate) scripts: BTreeMap<String, String>,
    pub loads: Vec<LoadRec>,
    pub faults: BTreeMap<&'static str, u64>,
    pub violations: Vec<String>,
    /// Anomalies a fault explains (counted, not failures).
    pub excused: BTreeMap<&'static str, u64>,
    /// Per process, the spans its connection is down.
    pub(crate) down: Vec<Vec<(u64, u64)>>,
    /// Per process, the spans its subscription alone is down (commands flow).
    pub(crate) deaf: Vec<Vec<(u64, u64)>>,
    /// Lease servers stalled: (server, from, to).
    pub(crate) stalls: Vec<(usize, u64, u64)>,
    /// Per process, the spans it is paused (none of its tasks gets past a gate).
    pub(crate) paused: Vec<Vec<(u64, u64)>>,
    /// Per process, when it crashed.
    pub(crate) crashed: Vec<Option<u64>>,
    /// Store name (entry or lock) to user key.
    names: BTreeMap<String, String>,
    /// Every lock the store granted, in its order.
    pub grants: Vec<Grant>,
    /// Owner tokens a release was sent for (or tried: refused, lost, whatever came of it).
    /// Per server (`Conn::server`), since Redlock's grants are per server.
    pub release_attempts: std::collections::BTreeSet<(usize, String)>,
    /// Lease fencing counters, by store name (gone with a restart, as without persistence).
    pub(crate) fences: BTreeMap<String, u64>,
    /// When the store restarted.
    pub restarts: Vec<u64>,
    /// The fenced resource: per lock key, the highest token it accepted.
    pub resource: BTreeMap<String, u64>,
    /// Tokens the fenced resource accepted from a holder whose lease a restart wiped
    /// (by lock key).
    pub(crate) wiped_writes: std::collections::BTreeSet<(String, u64)>,
    /// Per value, the expiry its envelope carried when first written.
    pub value_meta: BTreeMap<String, corral_core::expiry::EntryMeta>,
}

/// One process as the network sees it: its subscription.
#[derive(Default)]
pub(crate) struct ProcNet {
    /// Its subscription connection, while one is up.
    pub(crate) subscription: Mutex<Option<crate::wire::Listener>>,
    /// A subscription connection gone half-open: still open to the process (its stream
    /// never ends), silent for good, until the process opens another.
    pub(crate) half_open: Mutex<Option<crate::wire::Listener>>,
}

/// The shared world of one run.
pub struct World {
    pub(crate) start: tokio::time::Instant,
    pub(crate) scenario: Scenario,
    pub(crate) st: Mutex<State>,
    pub(crate) procs: Vec<ProcNet>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World").finish_non_exhaustive()
    }
}

impl World {
    pub(crate) fn new(
        scenario: Scenario,
        seed: u64,
        down: Vec<Vec<(u64, u64)>>,
        deaf: Vec<Vec<(u64, u64)>>,
        paused: Vec<Vec<(u64, u64)>>,
    ) -> Arc<Self> {
        let n = scenario.procs;
        let procs = (0..n).map(|_| ProcNet::default()).collect();
        let crashed = vec![None; scenario.procs];
        let f = scenario.faults;
        // No fault can keep a leader from renewing its flight lock, and the body renews.
        let leaders_keep_locks = !scenario.portable
            && [
                f.delay_pm,
                f.reply_lost_pm,
                f.down_pm,
                f.restart_pm,
                f.clock_pm,
                f.pause_pm,
                f.crash_pm,
                f.stall_pm,
                f.pause_holder_pm,
            ]
            .iter()
            .all(|&pm| pm == 0);
        Arc::new(World {
            start: tokio::time::Instant::now(),
            scenario,
            st: Mutex::new(State {
                rng: Rng::new(seed, 0x4E45),
                calm: false,
                leaders_keep_locks,
                trace: String::new(),
                entries: BTreeMap::new(),
                locks: BTreeMap::new(),
                order: 0,
                seq: 0,
                versions: BTreeMap::new(),
                value_order: BTreeMap::new(),
                generations: Vec::new(),
                pending_swaps: BTreeMap::new(),
                lock_losses: BTreeMap::new(),
                refresh_loads: 0,
                reads: BTreeMap::new(),
                gaps: Vec::new(),
                unhealed: vec![Vec::new(); n],
                outbox: Vec::new(),
                scripts: BTreeMap::new(),
                loads: Vec::new(),
                faults: BTreeMap::new(),
                violations: Vec::new(),
                excused: BTreeMap::new(),
                down,
                deaf,
                stalls: Vec::new(),
                paused,
                crashed,
                names: BTreeMap::new(),
                grants: Vec::new(),
                release_attempts: Default::default(),
                fences: BTreeMap::new(),
                restarts: Vec::new(),
                resource: BTreeMap::new(),
                value_meta: BTreeMap::new(),
                wiped_writes: Default::default(),
            }),
            procs,
        })
    }

    /// Virtual milliseconds since the run began (the store's clock).
    pub fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Appends a line to the trace, stamped with the virtual time.
    pub fn log(&self, line: impl std::fmt::Display) {
        let now = self.now();
        let mut st = self.st.lock();
        let _ = writeln!(st.trace, "{now:>6} {line}");
    }

    /// Teaches the world which store names belong to `key` (an entry name `{tag}:x`).
    pub(crate) fn learn_name(&self, key: &str, entry_name: &str) {
        let tag = entry_name.rsplit_once(':').map_or(entry_name, |(t, _)| t);
        self.st.lock().names.insert(tag.to_owned(), key.to_owned());
    }

    /// The next unique number for a written or loaded value.
    pub(crate) fn next_seq(&self) -> u64 {
        let mut st = self.st.lock();
        st.seq += 1;
        st.seq
    }

    pub(crate) fn fault(&self, kind: &'static str) {
        *self.st.lock().faults.entry(kind).or_default() += 1;
    }

    pub(crate) fn violation(&self, what: String) {
        self.log(format_args!("VIOLATION {what}"));
        self.st.lock().violations.push(what);
    }

    pub(crate) fn excuse(&self, kind: &'static str, what: impl std::fmt::Display) {
        self.log(format_args!("excused {kind}: {what}"));
        *self.st.lock().excused.entry(kind).or_default() += 1;
    }

    /// Whether `proc`'s connection is down at `t`.
    pub(crate) fn is_down(&self, proc: usize, t: u64) -> bool {
        let st = self.st.lock();
        !st.calm && st.down[proc].iter().any(|&(a, b)| a <= t && t < b)
    }

    /// When server `server` resumes, if it is stalled at `t`.
    pub(crate) fn stalled_until(&self, server: usize, t: u64) -> Option<u64> {
        let st = self.st.lock();
        st.stalls
            .iter()
            .filter(|&&(s, a, b)| s == server && a <= t && t < b)
            .map(|&(_, _, b)| b)
            .max()
    }

    /// When `proc` hears its channel again, if it cannot at `t`: its connection or its
    /// subscription alone is down (it resubscribes, and drops its L1, at the end).
    pub(crate) fn deaf_until(&self, proc: usize, t: u64) -> Option<u64> {
        let st = self.st.lock();
        if st.calm {
            return None;
        }
        st.down[proc]
            .iter()
            .chain(&st.deaf[proc])
            .filter(|&&(a, b)| a <= t && t < b)
            .map(|&(_, b)| b)
            .max()
    }

    /// Waits while `proc` is paused: every store command, reply, delivery, loader and
    /// call of a paused process waits here, so none of its tasks makes progress the
    /// rest of the world can see until it resumes.
    pub(crate) async fn gate(&self, proc: usize) {
        loop {
            let now = self.now();
            let until = {
                let st = self.st.lock();
                st.paused[proc]
                    .iter()
                    .find(|&&(a, b)| a <= now && now < b)
                    .map(|&(_, b)| b)
            };
            match until {
                Some(b) => tokio::time::sleep(Duration::from_millis(b - now)).await,
                None => return,
            }
        }
    }

    /// Whether `proc` was paused at some moment in `from..=to`.
    pub(crate) fn paused_within(&self, proc: usize, from: u64, to: u64) -> bool {
        self.st.lock().paused[proc]
            .iter()
            .any(|&(a, b)| a <= to && from < b)
    }

    /// With `per_mille`, pauses `proc` from now for 300..4000 ms (a pause at a moment
    /// the workload picks); says whether it did.
    pub(crate) fn maybe_pause(&self, proc: usize, per_mille: u32) -> bool {
        let now = self.now();
        let span = {
            let mut st = self.st.lock();
            if st.calm || !st.rng.chance(per_mille) {
                return false;
            }
            let d = st.rng.range(300, 4_000);
            st.paused[proc].push((now, now + d));
            d
        };
        self.fault("process-pause");
        self.log(format_args!("p{proc} PAUSED for {span} ms"));
        true
    }

    /// Whether `proc` has crashed.
    pub(crate) fn is_crashed(&self, proc: usize) -> bool {
        self.st.lock().crashed[proc].is_some()
    }

    /// Marks `proc` crashed: from now on it sends nothing and hears nothing.
    pub(crate) fn crash(&self, proc: usize) {
        let now = self.now();
        self.st.lock().crashed[proc] = Some(now);
        self.cut_subscription(proc);
        self.fault("process-crash");
    }

    /// Turns every fault off (for the final convergence reads).
    pub(crate) fn calm(&self) {
        self.st.lock().calm = true;
    }

    /// The store restarts empty: entries, locks, subscriptions (every process then
    /// resubscribes and drops its L1, as after any gap in the channel).
    pub(crate) fn restart_store(self: &Arc<Self>) {
        let now = self.now();
        {
            let mut st = self.st.lock();
            st.entries.clear();
            st.fences.clear();
            st.scripts.clear();
            st.restarts.push(now);
            let locks = std::mem::take(&mut st.locks);
            for (name, lock) in locks {
                if now < lock.until {
                    let key = st.key_of(&name);
                    st.lock_losses.entry(key).or_default().push(now);
                }
            }
            let keys: Vec<String> = st.versions.keys().cloned().collect();
            for key in keys {
                st.push_version(&key, now, VersionKind::Restart);
            }
            for p in 0..self.procs.len() {
                // Healed when its subscription task has subscribed again.
                st.unheard(p, None, now);
            }
        }
        self.fault("store-restart");
        self.log("STORE RESTART (empty)");
        for p in 0..self.procs.len() {
            self.cut_subscription(p);
        }
    }

    /// Runs a load's bookkeeping at its start; returns the record's index. `began` is
    /// when its call began: a lock its process took before that belongs to another
    /// flight of the process (one that handed its outcome on and is still releasing).
    ///
    /// `refresh`: the call asked for eager refresh, so its load may be a refresh of a
    /// fresh value (which the once-per-fill-window check does not apply to), made no
    /// earlier than the copy's refresh falls due.
    pub(crate) fn load_started(
        &self,
        call: u64,
        proc: usize,
        key: &str,
        value: &str,
        began: u64,
        refresh: Option<MayRefresh>,
    ) -> usize {
        let now = self.now();
        let mut problems = Vec::new();
        let mut excuses = Vec::new();
        let mut early = Vec::new();
        let mut refreshing = None;
        let clock_error_ms = if self.scenario.faults.clock_pm > 0 {
            CLOCK_ERROR_MS
        } else {
            0
        };
        let index;
        {
            let mut st = self.st.lock();
            let lock_name = st.names_of(key).map(|(_, l)| l);
            let held = lock_name
                .as_ref()
                .and_then(|n| st.locks.get(n))
                .filter(|l| now < l.until);
            let locked = held.is_some_and(|l| {
                l.proc == proc && !l.reply_lost && l.since >= began && l.call.is_none_or(|c| c == call)
            });
            let mut lock_until = 0;
            let mut own_read_failed = false;
            if locked {
                let since = held.map_or(0, |l| l.since);
                lock_until = held.map_or(0, |l| l.until);
                // Exclusive: no other process's locked load of the key still runs,
                // unless the lock was lost (lapsed or wiped) since it began.
                for other in st.loads.iter().filter(|l| {
                    l.key == key
                        && l.locked
                        && l.end.is_none()
                        && l.proc != proc
                        && Some(&l.lock_name) == lock_name.as_ref()
                }) {
                    // Lost: lapsed (the loader outlived the lock TTL), or wiped by a restart.
                    let lost = now >= other.lock_until
                        || st
                            .lock_losses
                            .get(key)
                            .is_some_and(|ts| ts.iter().any(|&t| t >= other.start));
                    let what = format!(
                        "p{proc} loads {key} while p{} still loads it (call {}, since {})",
                        other.proc, other.call, other.start
                    );
                    if lost {
                        excuses.push(("double-load-lock-lost", what))
                    } else {
                        problems.push(what)
                    }
                }
                // Once per fill window: nothing fresh had landed before this flight took
                // the lock and was still fresh when its loader started (its double-check
                // read, made in between, would have found it), unless that read failed.
                // Fresh at the load, not only at the lock: a process paused between the
                // two reads what is there when it wakes.
                // An eager refresh loads so by design: counted, not judged.
                // A copy that stood before the lock: fresh whatever the clock (`true`),
                // or perhaps fresh by the process's own (a refresh, or a lead).
                let copy = if let Some((entry, _)) = st.names_of(key)
                    && let Some(stored) = st.entries.get(&entry)
                    && now < stored.until
                    && stored.since < since
                    && let Tag::Value(v) = tag_of(&stored.bytes)
                    && !st.removed_by_tag(&stored.bytes, now)
                {
                    let fresh = fresh_whatever_the_clock(&stored.bytes, now, clock_error_ms);
                    let end = crate::keyspace::meta_of(&stored.bytes).and_then(|m| m.absolute_ms);
                    Some((v.to_string(), stored.since, fresh, end))
                } else {
                    None
                };
                if refresh.is_some() && copy.as_ref().is_some_and(|(_, _, fresh, _)| !fresh) {
                    refreshing = Some(true);
                }
                let fresh_copy = copy
                    .filter(|(_, _, fresh, _)| *fresh)
                    .map(|(v, since, _, end)| (v, since, end));
                if let Some((v, landed, end)) = fresh_copy {
                    // A read by a call (`of`) of a name (`about`) failed since the lock was
                    // taken, or is still running: the double-check had no answer to judge by.
                    let failed_since_lock = |of: &dyn Fn(u64) -> bool, about: &dyn Fn(&str) -> bool| {
                        st.reads.iter().any(|((c, k), read)| {
                            of(*c)
                                && about(k)
                                && [read.pending_since, read.failed_at]
                                    .into_iter()
                                    .flatten()
                                    .any(|t| t >= since)
                        })
                    };
                    // The entry's read, or one the judgement of what it found needs
                    // (a tag's moments, the generation: names no user key has).
                    let read_failed =
                        failed_since_lock(&|c| c == call || c == DETACHED_CALLS + proc as u64, &|k| {
                            k == key || k.starts_with('{')
                        });
                    own_read_failed = failed_since_lock(&|c| c == call, &|k| k == key);
                    let what = format!(
                        "p{proc} loads {key} although {v} landed at {landed} before its lock ({since})"
                    );
                    if let Some(asked) = refresh {
                        // A refresh (its caller is served the copy), or, after a failed
                        // read, perhaps a lead (its caller is served this load).
                        st.refresh_loads += 1;
                        refreshing = Some(read_failed);
                        // A refresh begins once its double-check found the copy due by
                        // the process's clock: never before any reading of that clock
                        // reached the moment the copy falls due.
                        let due = end.map(|end| asked.due_ms(end));
                        if !read_failed && due.is_none_or(|due| asked.clock_ms < due) {
                            let due = due.map_or("never".to_owned(), |d| d.to_string());
                            early.push(format!(
                                "p{proc} refreshes {key} (copy {v}) at {} by its clock, \
                                 before the copy falls due at {due}",
                                asked.clock_ms
                            ));
                        }
                    } else if read_failed {
                        excuses.push(("load-after-failed-read", what));
                    } else {
                        problems.push(what);
                    }
                }
            }
            st.loads.push(LoadRec {
                call,
                proc,
                key: key.to_owned(),
                value: value.to_owned(),
                start: now,
                end: None,
                locked,
                lock_until,
                lock_name: lock_name.clone().unwrap_or_default(),
                renewal_refused: false,
                refresh: refreshing,
                own_read_failed,
            });
            index = st.loads.len() - 1;
            let _ = writeln!(
                st.trace,
                "{now:>6} p{proc} c{call} loader starts {value} ({})",
                if locked { "locked" } else { "degraded" }
            );
        }
        for p in problems {
            self.violation(format!("single-flight: {p}"));
        }
        for p in early {
            self.violation(format!("refresh-when-due: {p}"));
        }
        for (k, e) in excuses {
            self.excuse(k, e);
        }
        index
    }

    pub(crate) fn load_ended(&self, index: usize) {
        let now = self.now();
        self.st.lock().loads[index].end = Some(now);
    }

    /// Claims the oldest tombstone `proc` applied to `key` (a returning `remove`).
    pub(crate) fn claim_swap(&self, proc: usize, key: &str) -> Option<u64> {
        let mut st = self.st.lock();
        let pending = st.pending_swaps.get_mut(&(proc, key.to_owned()))?;
        (!pending.is_empty()).then(|| pending.remove(0))
    }

    /// Draws `per_mille` from the network's generator (off when calm).
    fn draw(&self, per_mille: u32) -> bool {
        let mut st = self.st.lock();
        !st.calm && st.rng.chance(per_mille)
    }

    pub(crate) fn latency(&self) -> (u64, bool) {
        let slow = self.draw(self.scenario.faults.delay_pm);
        let mut st = self.st.lock();
        if slow {
            (st.rng.range(50, SLOW_NET_MS), true)
        } else {
            (st.rng.range(0, NET_MS), false)
        }
    }
}

impl State {
    /// A violation found while the store applies a command at `now` (the world's
    /// [`World::violation`] takes the lock this already holds).
    pub(crate) fn violation(&mut self, now: u64, what: String) {
        let _ = writeln!(self.trace, "{now:>6} VIOLATION {what}");
        self.violations.push(what);
    }

    /// The grant to `owner` reached its caller.
    pub(crate) fn acknowledge(&mut self, owner: &str) {
        if let Some(g) = self.grants.iter_mut().rev().find(|g| g.owner == owner) {
            g.acknowledged = true;
        }
    }

    /// Whether stored entry bytes carry a tag whose stored moments remove them (a
    /// `remove_by_tag` after the write): such an entry is a miss to every reader.
    pub(crate) fn removed_by_tag(&self, bytes: &[u8], now: u64) -> bool {
        let limits = corral_core::Limits::default();
        let Ok(decoded) = corral_core::envelope::decode_header(bytes, bytes.len() as u64, &limits) else {
            return false;
        };
        let Some(tagged) = decoded.tagged else {
            return false;
        };
        let moments: Vec<_> = tagged
            .tags
            .iter()
            .map(|tag| {
                let name = corral_core::names::tag_name(SIM_PREFIX, tag).unwrap_or_default();
                let stored = self.entries.get(&name).filter(|s| now < s.until);
                corral_core::tags::TagMoments::decode(stored.map(|s| &s.bytes[..]))
            })
            .collect();
        corral_core::tags::judge(&tagged, &decoded.meta, &moments, true, 0)
            != corral_core::tags::Verdict::Untouched
    }

    /// The live lock `name`, if any.
    pub(crate) fn live_lock(&self, name: &str, now: u64) -> Option<&HeldLock> {
        self.locks.get(name).filter(|l| now < l.until)
    }

    pub(crate) fn key_of(&self, name: &str) -> String {
        // A Redlock server's copy of a lock name: `s{n}|{name}`.
        let (_, name) = crate::keyspace::server_of(name);
        let tag = name.rsplit_once(':').map_or(name, |(t, _)| t);
        self.names.get(tag).cloned().unwrap_or_else(|| name.to_owned())
    }

    /// The lease lock's store name of lock key `key` (`{tag}:k`).
    pub(crate) fn lock_name_of(&self, key: &str) -> String {
        self.names
            .iter()
            .find(|(_, k)| *k == key)
            .map_or_else(|| key.to_owned(), |(tag, _)| format!("{tag}:k"))
    }

    /// The entry and flight-lock names of `key` (`{tag}:e`, `{tag}:l`).
    /// The prefix's generation a store name belongs to (`…@g`; none: 0).
    pub(crate) fn generation_of(name: &str) -> u64 {
        name.rsplit_once('@')
            .and_then(|(_, g)| g.parse().ok())
            .unwrap_or(0)
    }

    /// When the version of order `order` was applied to the store, if known.
    pub(crate) fn applied_at(&self, order: u64) -> Option<u64> {
        self.versions
            .values()
            .flatten()
            .find(|v| v.order == order)
            .map(|v| v.t)
    }

    /// Notes a write of `bytes` under `name` by the workload call `call`: the
    /// generation, if `name` is the prefix's counter.
    pub(crate) fn note_generation(&mut self, call: Option<u64>, name: &str, bytes: &[u8]) {
        if name == corral_core::names::generation(SIM_PREFIX) {
            let generation = corral_core::tags::generation(Some(bytes));
            self.generations.push((call, generation));
        }
    }

    /// The generation the workload call `call` (a `clear`) wrote the prefix's counter
    /// with, if it did: the one its announcement tells of. (A command a stalled server
    /// applies late is still its caller's.)
    pub(crate) fn generation_written(&self, call: u64) -> Option<u64> {
        self.generations
            .iter()
            .filter(|&&(c, _)| c == Some(call))
            .map(|&(_, g)| g)
            .next_back()
    }

    /// The generation the version of order `order` was written in, if known.
    pub(crate) fn generation_at(&self, order: u64) -> Option<u64> {
        self.versions
            .values()
            .flatten()
            .find(|v| v.order == order && !v.name.is_empty())
            .map(|v| Self::generation_of(&v.name))
    }

    /// In the prefix's current generation (a `clear` moves it).
    pub(crate) fn names_of(&self, key: &str) -> Option<(String, String)> {
        self.names.iter().find(|(_, k)| *k == key)?;
        let counter = corral_core::names::generation(SIM_PREFIX);
        let g = corral_core::tags::generation(self.entries.get(&counter).map(|s| &s.bytes[..]));
        let name = |kind| corral_core::names::name_in(SIM_PREFIX, key, kind, g);
        Some((
            name(corral_core::names::Kind::Entry),
            name(corral_core::names::Kind::FlightLock),
        ))
    }

    fn push_version(&mut self, key: &str, t: u64, kind: VersionKind) -> u64 {
        self.push_version_of(key, "", t, kind)
    }

    /// As [`push_version`](Self::push_version), written under the store name `name`.
    pub(crate) fn push_version_of(&mut self, key: &str, name: &str, t: u64, kind: VersionKind) -> u64 {
        self.order += 1;
        let order = self.order;
        if let Some(v) = kind.value() {
            self.value_order.entry(v.to_owned()).or_insert(order);
        }
        self.versions.entry(key.to_owned()).or_default().push(Version {
            order,
            t,
            kind,
            name: name.to_owned(),
        });
        order
    }

    pub(crate) fn live(&mut self, name: &str, now: u64) -> Option<Bytes> {
        match self.entries.get(name) {
            Some(s) if now < s.until => Some(s.bytes.clone()),
            Some(_) => {
                self.entries.remove(name);
                None
            }
            None => None,
        }
    }

    /// Writes `bytes` under `name`, recording the version; `fenced` for a `set_if`.
    pub(crate) fn write(&mut self, proc: usize, name: &str, bytes: Bytes, ttl: u64, now: u64, fenced: bool) {
        let key = self.key_of(name);
        let kind = match tag_of(&bytes) {
            Tag::Value(v) if v.starts_with("load") => VersionKind::Load { value: v, fenced },
            Tag::Value(v) => VersionKind::Set(v),
            Tag::Tombstone => VersionKind::Remove,
            Tag::Other => VersionKind::Cleanup,
        };
        let old = self.entries.get(name).filter(|s| now < s.until).cloned();
        // Touches rewrite the same value: not a new version.
        let same = old.as_ref().is_some_and(|o| tag_of(&o.bytes) == tag_of(&bytes));
        let since = if same {
            old.as_ref().map_or(now, |o| o.since)
        } else {
            now
        };
        self.entries.insert(
            name.to_owned(),
            Stored {
                bytes,
                until: now.saturating_add(ttl.max(1)),
                since,
            },
        );
        if same {
            return;
        }
        let is_remove = kind == VersionKind::Remove;
        let order = self.push_version_of(&key, name, now, kind);
        if is_remove {
            self.pending_swaps.entry((proc, key)).or_default().push(order);
        }
    }
}

/// Reads made outside any workload call (a `fetch` flight runs in a task of its own)
/// are noted under this number plus their process's.
pub(crate) const DETACHED_CALLS: u64 = 1 << 40;

/// The most a process's clock is off the simulated time: a skew and a step.
pub(crate) const CLOCK_ERROR_MS: u64 = 300 + 3_000;

/// Whether entry bytes were fresh at virtual time `t` by any process's clock, and still
/// are when the double-check read that follows the lock arrives (a slow trip later):
/// an entry of the freshness workload may have expired by the reader's clock, and been
/// reloaded. `clock_error_ms`: how far the scenario's clocks may be off.
fn fresh_whatever_the_clock(bytes: &[u8], t: u64, clock_error_ms: u64) -> bool {
    crate::keyspace::meta_of(bytes).is_some_and(|meta| {
        meta.sliding_ms.is_none()
            && meta.expires_at_ms > crate::run::EPOCH_MS + t + clock_error_ms + SLOW_NET_MS
    })
}

/// One process's connection to the store: the store traits, over the simulated network.
#[derive(Clone)]
pub struct Conn {
    pub(crate) world: Arc<World>,
    pub(crate) proc: usize,
    /// Which server it talks to: 0, the store; 1.. the lease servers of Redlock (their
    /// locks and counters are their own; the store's restarts wipe them too).
    pub(crate) server: usize,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("proc", &self.proc).finish()
    }
}

fn unavailable(why: &str) -> Error {
    Error::from(ErrorKind::Unavailable).with_context(format!("sim: {why}"))
}

type Applied<T> = (T, String);

impl Conn {
    /// One command: refused while down; else request delay, atomic apply at arrival,
    /// reply delay or loss.
    pub(crate) async fn call<T: Send + 'static>(
        &self,
        what: &'static str,
        name: &str,
        apply: impl FnOnce(&mut State, u64, usize) -> Applied<T> + Send + 'static,
    ) -> corral::Result<T> {
        let w = &self.world;
        let p = self.proc;
        let key = w.st.lock().key_of(name);
        // Who sends it, and to which server when not the store.
        let who = match self.server {
            0 => format!("p{p}"),
            s => format!("p{p}@s{s}"),
        };
        w.gate(p).await;
        if w.is_crashed(p) {
            // A dead process sends nothing (the library's background tasks outlive it here).
            tokio::time::sleep(Duration::from_millis(1)).await;
            return Err(unavailable(CRASHED));
        }
        if w.is_down(p, w.now()) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            w.fault("refused");
            w.log(format_args!("{who} {what} {key} -> refused (connection down)"));
            return Err(unavailable(REFUSED));
        }
        let (there, slow) = w.latency();
        if slow {
            w.fault("delay");
        }
        tokio::time::sleep(Duration::from_millis(there)).await;
        if w.is_down(p, w.now()) {
            // Dropped on the way: never applied; the client times out.
            w.fault("conn-drop");
            w.log(format_args!(
                "{who} {what} {key} -> request lost (connection dropped)"
            ));
            tokio::time::sleep(Duration::from_millis(
                REPLY_TIMEOUT_MS - there.min(REPLY_TIMEOUT_MS),
            ))
            .await;
            return Err(unavailable(DROPPED));
        }
        if let Some(end) = w.stalled_until(self.server, w.now()) {
            // A stalled server (SIGSTOP) applies what reached it when it resumes; the
            // caller gives up at its response timeout.
            w.fault("server-stall");
            let give_up = w.now() + REPLY_TIMEOUT_MS - there.min(REPLY_TIMEOUT_MS);
            if end > give_up {
                let late = w.clone();
                let who = who.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(end - late.now())).await;
                    let now = late.now();
                    let (_, summary) = {
                        let mut st = late.st.lock();
                        let applied = apply(&mut st, now, p);
                        late.deliver(&mut st, now);
                        applied
                    };
                    late.log(format_args!(
                        "{who} {what} {key} applied late, the server resumed ({summary}) -> nobody waits"
                    ));
                });
                tokio::time::sleep(Duration::from_millis(give_up - w.now())).await;
                return Err(unavailable("server stalled: timed out"));
            }
            tokio::time::sleep(Duration::from_millis(end - w.now())).await;
        }
        let now = w.now();
        let (out, summary) = {
            let mut st = w.st.lock();
            let applied = apply(&mut st, now, p);
            w.deliver(&mut st, now);
            applied
        };
        if w.draw(w.scenario.faults.reply_lost_pm) {
            w.fault("reply-lost");
            w.log(format_args!(
                "{who} {what} {key} applied ({summary}) -> reply lost"
            ));
            tokio::time::sleep(Duration::from_millis(REPLY_TIMEOUT_MS)).await;
            return Err(unavailable("reply lost: timed out"));
        }
        let (back, slow) = w.latency();
        if slow {
            w.fault("delay");
        }
        w.log(format_args!(
            "{who} {what} {key} -> {summary} (sent -{there}, reply +{back})"
        ));
        tokio::time::sleep(Duration::from_millis(back)).await;
        // A reply reaching a paused process is read when it resumes.
        w.gate(p).await;
        Ok(out)
    }
}

/// The fenced-fill invariant, at the store: a load's value never lands over a version
/// a set or removal wrote after the load began.
/// (Removals are unique, so a compare-and-set never mistakes a newer tombstone for the
/// one its read found: the simulator found that bug when they were all alike.)
///
/// `plain` for a load written with a plain set: neither body does that (the workload
/// has no bypass), so it is a violation too.
pub(crate) fn check_fill_over(st: &mut State, name: &str, bytes: &Bytes, now: u64, plain: bool) {
    let Tag::Value(value) = tag_of(bytes) else {
        return;
    };
    if !value.starts_with("load") {
        return;
    }
    let key = st.key_of(name);
    let Some(started) = st.loads.iter().find(|l| l.value == value).map(|l| l.start) else {
        return;
    };
    // The last version under this very name (or a restart): one under another
    // generation's name is another entry.
    let Some(last) = st
        .versions
        .get(&key)
        .and_then(|v| v.iter().rev().find(|x| x.name == name || x.name.is_empty()))
        .cloned()
    else {
        return;
    };
    let newer = matches!(last.kind, VersionKind::Set(_) | VersionKind::Remove) && last.t > started;
    if newer && st.live(name, now).is_some() {
        let what = format!(
            "{value} (load began {started}) overwrote {:?} written at {}{}",
            last.kind,
            last.t,
            if plain { " with a plain set" } else { "" }
        );
        let what = format!("fenced-fill: {what}");
        st.violation(now, what);
    }
}

/// Runs `which` (or this store's planted bug in it) in the step, as `EVALSHA` does.
fn script(step: &mut Step<'_>, broken: &Broken, which: Script, keys: &[&str], argv: &[&[u8]]) -> Reply {
    crate::lua::eval(&broken.script(which), keys, argv, step)
}

/// A reply as its command's caller reads it (`read`). A reply of another shape (an
/// error from a script, say) is a violation: the store's code sent what it should not.
fn answered<T>(
    st: &mut State,
    now: u64,
    what: &str,
    reply: &Reply,
    read: impl FnOnce(&Reply) -> Option<T>,
) -> Option<T> {
    let got = read(reply);
    if got.is_none() {
        let what = format!("store: {what} answered {reply:?}");
        st.violation(now, what);
    }
    got
}

fn int(reply: &Reply) -> Option<i64> {
    match reply {
        Reply::Int(i) => Some(*i),
        _ => None,
    }
}

/// A failed command as a lease sees it: refused (never sent: it did not run), else
/// unknown (a timeout: it may have run).
fn unanswered(e: Error) -> Unanswered {
    let cause = e.to_string();
    let maybe_ran = !refused(&cause);
    Unanswered { cause, maybe_ran }
}

/// Whether a failed command's cause says it was never sent (refused, or its process
/// dead): the client knows it did not run. (A request dropped on its way did not run
/// either, but its client only sees a timeout.)
pub(crate) fn refused(cause: &str) -> bool {
    cause.contains(REFUSED) || cause.contains(CRASHED)
}

pub(crate) const REFUSED: &str = "connection refused";
pub(crate) const CRASHED: &str = "process crashed";
pub(crate) const DROPPED: &str = "connection dropped";

/// The store's clock as Redis's `TIME` gives it to a script: microseconds since the Unix
/// epoch (the simulated epoch starts at [`crate::run::EPOCH_MS`]).
pub(crate) fn store_time_us(now: u64) -> u64 {
    (crate::run::EPOCH_MS + now) * 1_000
}

/// The lease scripts (`corral-core`'s `script::LOCK_*`), as a Redis runs them: the
/// script's text in Lua, one atomic step on the store at the moment the request arrives.
impl LeaseServer for Conn {
    fn run<'a>(
        &'a self,
        script: LockScript,
        keys: &'a [String],
        args: &'a [&'a str],
    ) -> BoxFuture<'a, Result<u64, Unanswered>> {
        let lock = keys.first().cloned().unwrap_or_default();
        let owner = args.first().map(|a| (*a).to_owned()).unwrap_or_default();
        let keys = keys.to_vec();
        let argv: Vec<Vec<u8>> = args.iter().map(|a| a.as_bytes().to_vec()).collect();
        let broken = self.world.scenario.broken;
        let (which, what) = match script {
            LockScript::Acquire => (Script::LockAcquire, "acquire"),
            LockScript::AcquireFair => (Script::LockAcquireFair, "acquire"),
            LockScript::Release => (Script::LockRelease, "unlock"),
            LockScript::Extend => (Script::LockExtend, "extend"),
        };
        if script == LockScript::Release {
            self.world
                .st
                .lock()
                .release_attempts
                .insert((self.server, owner.clone()));
        }
        let this = self.clone();
        let server = self.server;
        async move {
            let taker = owner.clone();
            let got = this
                .call(what, &lock, move |st, now, p| {
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let argv: Vec<&[u8]> = argv.iter().map(Vec::as_slice).collect();
                    let mut step = Step::new(st, now, p, Write::Plain);
                    step.server = server;
                    let reply = self::script(&mut step, &broken, which, &keys, &argv);
                    match script {
                        LockScript::Acquire | LockScript::AcquireFair => {
                            let token = answered(st, now, what, &reply, |r| match r {
                                Reply::Int(0) => Some(0),
                                Reply::Bulk(b) => std::str::from_utf8(b).ok()?.parse::<u64>().ok(),
                                _ => None,
                            })
                            .unwrap_or(0);
                            if token > 0 {
                                granted(st, now, p, &taker, token);
                                (token, format!("taken, token {token}"))
                            } else {
                                (0, "busy".to_owned())
                            }
                        }
                        LockScript::Release | LockScript::Extend => {
                            let done = answered(st, now, what, &reply, int).unwrap_or(0) == 1;
                            (u64::from(done), format!("{done}"))
                        }
                    }
                })
                .await;
            if matches!(script, LockScript::Acquire | LockScript::AcquireFair)
                && let Ok(token) = got
                && token > 0
            {
                this.world.st.lock().acknowledge(&owner);
            }
            got.map_err(unanswered)
        }
        .boxed()
    }
}

/// A lease acquire's grant (recorded when its `SET` took the lock) gets its fencing
/// token, which must rise above every token granted for the key before.
pub(crate) fn granted(st: &mut State, now: u64, p: usize, owner: &str, token: u64) {
    let Some(at) = st.grants.iter().rposition(|g| g.owner == owner && g.proc == p) else {
        let what = format!("fencing: p{p} got token {token} with no lock taken");
        st.violation(now, what);
        return;
    };
    // Per server: Redlock's servers count on their own.
    let (key, name) = (st.grants[at].key.clone(), st.grants[at].name.clone());
    let regressed = st
        .grants
        .iter()
        .filter(|g| g.name == name && g.fencing > 0)
        .map(|g| g.fencing)
        .max()
        .filter(|&m| m >= token);
    if let Some(m) = regressed {
        let what = format!("fencing: p{p} got token {token} for {key} after {m} was granted");
        st.violation(now, what);
    }
    st.grants[at].fencing = token;
}
