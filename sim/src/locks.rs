//! Locks under simulation: lease sessions through the real lease code
//! ([`corral::locks::RedisLocks`] over the simulated store), a fenced resource that
//! keeps the highest token it accepted and refuses lower ones, and the lock invariants.
//!
//! - A lease that says it is valid when its holder uses it is the store's holder then
//!   (so no two holders are ever valid at one instant), unless a store restart wiped the
//!   lock (excused, and then the fencing must order the two).
//! - Fencing tokens rise with every grant of a key, store restarts included (checked
//!   by the store as it grants: see `world.rs`).
//! - The resource refuses only holders whose lease has run out (a pause or a slow
//!   network the lease cannot see): a valid holder refused is a violation.
//! - Every lock the store granted (flight locks too) sees a release from its owner,
//!   unless its process crashed: an acquire whose reply was lost is released, not left
//!   to its TTL ([`check_orphans`]).

use std::sync::Arc;
use std::time::Duration;

use corral::ErrorKind;
use corral::locks::{Lease, LockOptions, RedisLocks};

use crate::keyspace::{on_server, server_of};
use crate::rng::Rng;
use crate::run::{CALL_BOUND_MS, CallRec, Ctx, Res};
use crate::scenario::Scenario;
use crate::world::World;

/// One holder's session on a lock key.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    think: u64,
    key: String,
    /// A watchdog lease (renewed while held), else a lease of exactly the TTL.
    watchdog: bool,
    wait_ms: u64,
    /// Per use of the resource: how long the holder works before it, and whether it
    /// extends its lease first (a lease with a TTL).
    steps: Vec<(u64, bool)>,
    /// Released at the end, else dropped (released in the background).
    release: bool,
}

impl Session {
    /// The pause before the session.
    pub(crate) fn think(&self) -> u64 {
        self.think
    }
}

/// The sessions of locker `locker` of process `proc`.
pub(crate) fn sessions(s: &Scenario, seed: u64, proc: usize, locker: usize) -> Vec<Session> {
    let mut r = Rng::new(seed, 200 + (proc * 16 + locker) as u64);
    (0..s.lock_sessions)
        .map(|_| {
            let think = r.range(0, s.think_ms);
            let key = format!("lock{}", r.range(0, s.lock_keys as u64 - 1));
            let watchdog = r.chance(500);
            let wait_ms = r.range(0, 2_000);
            let steps = (0..r.range(1, 4))
                .map(|_| (r.range(0, s.lease_ttl_ms / 2), !watchdog && r.chance(300)))
                .collect();
            let release = r.chance(850);
            Session {
                think,
                key,
                watchdog,
                wait_ms,
                steps,
                release,
            }
        })
        .collect()
}

/// Runs one session as a call of its own (a crash drops it mid-flight).
pub(crate) async fn session(ctx: &Arc<Ctx>, proc: usize, locks: &RedisLocks, s: Session) {
    let w = ctx.world.clone();
    let id = ctx.next_id();
    let t_inv = w.now();
    let ttl = Duration::from_millis(w.scenario.lease_ttl_ms);
    let kind = if s.watchdog { "watchdog" } else { "ttl" };
    w.log(format_args!(
        "p{proc} c{id} lock {} ({kind} {} ms, wait {} ms)",
        s.key, w.scenario.lease_ttl_ms, s.wait_ms
    ));
    let task = {
        let (w, locks, key) = (w.clone(), locks.clone(), s.key.clone());
        tokio::spawn(async move {
            let options = if s.watchdog {
                LockOptions::new().watchdog(ttl)
            } else {
                LockOptions::new().ttl(ttl)
            }
            .wait(Duration::from_millis(s.wait_ms));
            let bound = Duration::from_millis(CALL_BOUND_MS);
            let lease = match tokio::time::timeout(bound, locks.acquire(&key, options)).await {
                Err(_) => return Res::TimedOut,
                Ok(Err(e)) => {
                    w.log(format_args!("p{proc} c{id} acquire failed: {e}"));
                    return Res::Failed(e.kind());
                }
                Ok(Ok(lease)) => lease,
            };
            let token = lease.fencing_token();
            w.log(format_args!(
                "p{proc} c{id} holds {key}, token {token}, valid {} ms",
                lease.valid_for().as_millis()
            ));
            for (work, extend) in s.steps {
                tokio::time::sleep(Duration::from_millis(work)).await;
                w.gate(proc).await;
                if extend && let Err(e) = lease.extend(ttl).await {
                    w.log(format_args!("p{proc} c{id} extend failed: {e}"));
                    if !matches!(e.kind(), ErrorKind::LockLost | ErrorKind::Unavailable) {
                        return Res::Failed(e.kind());
                    }
                }
                if lease.is_lost() || lease.valid_for().is_zero() {
                    w.log(format_args!("p{proc} c{id} lease on {key} lost: stops"));
                    break;
                }
                // Checked, then a little more work: a pause here is what no lease sees.
                let checked = w.now();
                w.maybe_pause(proc, w.scenario.faults.pause_holder_pm);
                let (busy, _) = w.latency();
                tokio::time::sleep(Duration::from_millis(busy.min(50))).await;
                w.gate(proc).await;
                use_resource(&w, proc, id, &key, &lease, checked).await;
            }
            if !s.release {
                w.log(format_args!("p{proc} c{id} drops its lease on {key}"));
                drop(lease);
                return Res::Done(false);
            }
            match tokio::time::timeout(bound, lease.release()).await {
                Err(_) => Res::TimedOut,
                Ok(Ok(())) => Res::Done(true),
                Ok(Err(e)) => {
                    w.log(format_args!("p{proc} c{id} release failed: {e}"));
                    Res::Failed(e.kind())
                }
            }
        })
    };
    ctx.tasks[proc].lock().push(task.abort_handle());
    let res = task.await.unwrap_or(Res::Panicked);
    w.gate(proc).await;
    let t_end = w.now();
    w.log(format_args!(
        "p{proc} c{id} lock {} -> {res:?} [{t_inv}..{t_end}]",
        s.key
    ));
    let rec = CallRec {
        id,
        proc,
        op: "lock",
        key: s.key,
        t_inv,
        t_end,
        res,
        loaded: None,
        clocks: (0, 0),
        stale: None,
        detach: None,
        cache_level: false,
        batch_hard: None,
        load_began: None,
    };
    crate::run::check_call(&w, &rec);
    ctx.calls.lock().push(rec);
}

/// One use of the fenced resource by a holder: the request travels, reaches the
/// resource (which accepts tokens at least as high as any it accepted), and the checks
/// run at that moment.
async fn use_resource(w: &Arc<World>, proc: usize, id: u64, key: &str, lease: &Lease, checked: u64) {
    let token = lease.fencing_token();
    let (there, slow) = w.latency();
    if slow {
        w.fault("delay");
    }
    tokio::time::sleep(Duration::from_millis(there)).await;
    w.gate(proc).await;
    if w.is_crashed(proc) {
        return;
    }
    let now = w.now();
    // The lease's own verdict at the moment its holder's write lands.
    let valid = !lease.is_lost() && !lease.valid_for().is_zero();
    let (wiped, holds, best, accepted, newer, best_from_wiped) = {
        let mut st = w.st.lock();
        // The grants that could be this lease's: its token, on this key, to this
        // process (on Redlock each server counts on its own: two servers may hand out
        // one number at one microsecond, to different owners).
        let owners: Vec<(String, u64)> = st
            .grants
            .iter()
            .filter(|g| g.key == key && g.fencing == token && g.proc == proc)
            .map(|g| (g.owner.clone(), g.t))
            .collect();
        // A restart since any of the lease's grants (on Redlock, one per server).
        let wiped = owners.iter().any(|(owner, _)| {
            st.grants
                .iter()
                .filter(|o| o.owner == *owner)
                .any(|o| st.restarts.iter().any(|&r| r >= o.t))
        });
        // Held by its owner on a majority of the lease servers (one: the store).
        let servers = w.scenario.lease_servers;
        let lock = st.lock_name_of(key);
        let copies: Vec<String> = match servers {
            1 => vec![lock],
            n => (1..=n).map(|s| on_server(s, &lock)).collect(),
        };
        let holds = owners.iter().any(|(owner, _)| {
            let holding = copies
                .iter()
                .filter(|name| st.live_lock(name, now).is_some_and(|l| l.owner == *owner))
                .count();
            holding > servers / 2
        });
        let best = st.resource.get(key).copied().unwrap_or(0);
        let accepted = token >= best;
        // The resource moved past this holder by one whose lease a restart wiped (it
        // believed in a majority the restart took away, and wrote a higher token).
        let best_from_wiped = st.wiped_writes.contains(&(key.to_owned(), best));
        if accepted {
            st.resource.insert(key.to_owned(), token);
            if wiped && valid && !holds {
                st.wiped_writes.insert((key.to_owned(), token));
            }
        }
        let newer = st
            .grants
            .iter()
            .filter(|g| g.key == key && g.fencing > token)
            .map(|g| g.fencing)
            .max();
        (wiped, holds, best, accepted, newer, best_from_wiped)
    };
    let verdict = if accepted { "accepted" } else { "REFUSED" };
    w.log(format_args!(
        "p{proc} c{id} writes {key} with token {token} -> {verdict} (resource at {best}, lease {})",
        if valid { "valid" } else { "expired" }
    ));
    let who = format!("p{proc} c{id} on {key} (token {token})");
    if valid && !holds {
        let what = format!("{who}: its lease says valid at {now}, but the store does not hold its lock");
        if wiped {
            w.excuse("lease-wiped-by-restart", what);
        } else {
            w.violation(format!("lease: {what}"));
        }
    }
    if valid && !accepted {
        let what = format!("{who}: a valid holder refused, the resource is at {best}");
        if wiped || best_from_wiped {
            w.excuse("valid-holder-fenced-after-restart", what);
        } else {
            w.violation(format!("fencing: {what}"));
        }
    }
    if !valid {
        // A holder past its lease: paused (or slowed) between its check and its write.
        let paused = w.paused_within(proc, checked, now);
        let kind = match (accepted, newer.is_some(), paused) {
            (false, _, true) => "stale-holder-fenced-after-pause",
            (false, _, false) => "stale-holder-fenced",
            (true, true, _) => "stale-holder-before-newer-wrote",
            (true, false, _) => "stale-holder-no-newer",
        };
        w.excuse(kind, who);
    }
    let (back, _) = w.latency();
    tokio::time::sleep(Duration::from_millis(back)).await;
    w.gate(proc).await;
}

/// After the run: every lock the store granted saw a release sent by its owner (its
/// holder finished, gave up, or never heard the reply), unless its process crashed.
pub(crate) fn check_orphans(w: &World) {
    let (grants, attempts, crashed) = {
        let st = w.st.lock();
        (st.grants.clone(), st.release_attempts.clone(), st.crashed.clone())
    };
    for g in grants {
        // The server that granted it: `s{n}|…` on Redlock, else the store.
        let (server, _) = server_of(&g.name);
        if attempts.contains(&(server, g.owner.clone())) {
            continue;
        }
        let what = format!(
            "p{} took {} at {} ({}, reply {}) and never sent a release",
            g.proc,
            g.key,
            g.t,
            if g.fencing > 0 { "lease" } else { "flight lock" },
            if g.acknowledged { "received" } else { "lost" }
        );
        if crashed[g.proc].is_some_and(|t| t >= g.t) {
            w.excuse("lock-left-by-crash", what);
        } else {
            w.violation(format!("orphan: {what}"));
        }
    }
}

/// After quiesce: the store holds no live lock (every lease released or lapsed, no
/// watchdog renewing a lease nobody holds).
pub(crate) fn check_no_lock_left(w: &World) {
    let now = w.now();
    let left: Vec<String> = {
        let st = w.st.lock();
        st.locks
            .iter()
            .filter(|(_, l)| now < l.until)
            .map(|(name, l)| format!("{name} (p{}, until {})", l.proc, l.until))
            .collect()
    };
    for l in left {
        w.violation(format!("quiesce: lock {l} still held"));
    }
}
