//! In-process lock tables under simulation: each process's own table (the native
//! body's [`corral::locks::MemoryLocks`] through `Corral::locks()`, or the portable
//! body's `lock` export over its host's table), used by sessions of that process.
//!
//! The table's time is its process's clock (clock faults included), and the invariants
//! are judged on it. A call's table time is known only to lie between the clock's
//! readings before and after it, so a lock taken by a call surely lives until the first
//! reading plus its TTL (unless a reading of the clock reached that point already and a
//! step back followed: the table may have seen it lapse), and has surely lapsed from the
//! second reading plus its TTL.
//! - A try that wins while another owner's lock surely lives (taken, not being
//!   released) is a violation: two holders.
//! - A holder that asks while its lock surely lives is told it holds it; one whose
//!   lock another owner took over, or surely lapsed, is told it does not.
//! - An unlock by a holder whose lock surely lives releases it; an unlock of a lock
//!   another owner took over releases nothing.
//! - A try loses only to a lock that may still live: one that was never taken, was
//!   released, or has surely lapsed is free (judged only when no other call on the key
//!   overlapped the try).
//! - A lock is not re-entrant: a holder that tries again while its lock surely lives
//!   is refused, and keeps the lock it has.
//! - Fencing: every acquire that wins a key gets a token never won on it before, and
//!   above every token won by an acquire that ended before it began.
//! - Once the workload is over and every lock surely lapsed, the table's sweeper has
//!   emptied it ([`check_swept`]).
//!
//! A crash takes its process's table with it: nothing outlives the process.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use corral::Clock;
use parking_lot::Mutex;

use crate::body::Body;
use crate::rng::Rng;
use crate::run::Ctx;
use crate::scenario::Scenario;

/// How often a session tries again while it waits for a lock.
const RETRY_MS: u64 = 25;

/// One holder's session on a table lock.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    think: u64,
    key: String,
    wait_ms: u64,
    /// How long the holder works before each look at its lock.
    steps: Vec<u64>,
    /// Unlocked at the end, else left to lapse (and be swept).
    release: bool,
    /// Once it holds the lock, it tries for it again (refused: not re-entrant).
    again: bool,
}

impl Session {
    /// The pause before the session.
    pub(crate) fn think(&self) -> u64 {
        self.think
    }
}

/// The table sessions of table locker `locker` of process `proc`.
pub(crate) fn sessions(s: &Scenario, seed: u64, proc: usize, locker: usize) -> Vec<Session> {
    let mut r = Rng::new(seed, 400 + (proc * 16 + locker) as u64);
    (0..s.lock_sessions)
        .map(|_| Session {
            think: r.range(0, s.think_ms),
            key: format!("table{}", r.range(0, s.lock_keys as u64 - 1)),
            wait_ms: r.range(0, 2_000),
            // Some holders work past their TTL: their lock lapses and another takes it.
            steps: (0..r.range(1, 3)).map(|_| r.range(0, s.lease_ttl_ms)).collect(),
            release: r.chance(850),
            again: r.chance(250),
        })
        .collect()
}

/// What the workload knows of one lock: who took it last, and when it surely lives
/// until and surely lapses at (table time).
#[derive(Clone, Debug)]
struct Holder {
    owner: String,
    lives_until: u64,
    lapses_at: u64,
    /// Its unlock is under way: a try that wins meanwhile may follow the release.
    releasing: bool,
}

/// Per process, what its sessions know of its table's locks.
#[derive(Debug, Default)]
pub(crate) struct Known {
    holders: Mutex<HashMap<String, Holder>>,
    /// Per key, the table calls under way, and how many began so far.
    calls: Mutex<HashMap<String, (usize, u64)>>,
    /// Per key, the fencing tokens acquires won, and the highest of them.
    tokens: Mutex<HashMap<String, (std::collections::HashSet<u64>, u64)>>,
}

impl Known {
    /// A call on `key` begins: the count it began at.
    fn begin(&self, key: &str) -> u64 {
        let mut calls = self.calls.lock();
        let (open, begun) = calls.entry(key.to_owned()).or_default();
        *open += 1;
        *begun += 1;
        *begun
    }

    /// The highest fencing token won on `key` by an acquire that has ended.
    fn highest_token(&self, key: &str) -> u64 {
        self.tokens.lock().get(key).map_or(0, |(_, highest)| *highest)
    }

    /// Notes `token`, won on `key`: whether it was never won before.
    fn won_token(&self, key: &str, token: u64) -> bool {
        let mut tokens = self.tokens.lock();
        let (won, highest) = tokens.entry(key.to_owned()).or_default();
        *highest = (*highest).max(token);
        won.insert(token)
    }

    /// A call on `key` that began at `at` ends: whether no other call overlapped it.
    fn end(&self, key: &str, at: u64) -> bool {
        let mut calls = self.calls.lock();
        let (open, begun) = calls.entry(key.to_owned()).or_default();
        *open -= 1;
        *open == 0 && *begun == at
    }
}

/// A session's view of its process's table: its clock, and what it knows.
struct Table<'a> {
    ctx: &'a Arc<Ctx>,
    proc: usize,
    body: &'a Body,
    known: &'a Known,
    id: u64,
}

impl Table<'_> {
    fn now(&self) -> u64 {
        self.ctx.clock(self.proc).now_ms()
    }

    /// Whether a lock that surely lives until `until` may have been judged lapsed: some
    /// reading of the table's clock reached it (a step back later does not revive a
    /// lock the table saw lapse, and swept).
    fn may_have_lapsed(&self, until: u64) -> bool {
        self.ctx.clock(self.proc).highest_ms() >= until
    }

    fn violation(&self, what: std::fmt::Arguments<'_>) {
        self.ctx
            .world
            .violation(format!("table: p{} c{} {what}", self.proc, self.id));
    }

    /// A table call failed: only a crash excuses it.
    fn failed(&self, op: &str, e: &corral::Error) {
        if !self.ctx.world.is_crashed(self.proc) {
            self.violation(format_args!("{op} failed: {e}"));
        }
    }

    /// Tries for the lock until it wins or `wait_ms` has passed (virtual time).
    async fn acquire(&self, key: &str, owner: &str, ttl: Duration, wait_ms: u64) -> Option<bool> {
        let w = &self.ctx.world;
        let give_up = w.now() + wait_ms;
        loop {
            let known = self.known.holders.lock().get(key).cloned();
            let at = self.known.begin(key);
            let floor = self.known.highest_token(key);
            let before = self.now();
            let tried = self.body.acquire(key, owner, ttl).await;
            let after = self.now();
            let alone = self.known.end(key, at);
            let token = match tried {
                Ok(token) => token,
                Err(e) => {
                    self.failed("acquire", &e);
                    return None;
                }
            };
            if let Some(token) = token {
                if token <= floor {
                    self.violation(format_args!(
                        "{owner} won {key} with fencing token {token}, not above {floor}, won before it began"
                    ));
                }
                if !self.known.won_token(key, token) {
                    self.violation(format_args!(
                        "{owner} won {key} with fencing token {token} a second time"
                    ));
                }
                self.took(key, owner, ttl, before, after);
                return Some(true);
            }
            let free = known.is_none_or(|h| before.min(after) >= h.lapses_at);
            if alone && free {
                self.violation(format_args!("{owner} refused {key}, which nobody held"));
            }
            if w.now() >= give_up {
                return Some(false);
            }
            tokio::time::sleep(Duration::from_millis(RETRY_MS)).await;
            w.gate(self.proc).await;
        }
    }

    /// `owner` won `key` by a call between table times `before` and `after`.
    fn took(&self, key: &str, owner: &str, ttl: Duration, before: u64, after: u64) {
        let ttl = ttl.as_millis() as u64;
        let mut holders = self.known.holders.lock();
        if let Some(other) = holders.get(key)
            && !other.releasing
            && !self.may_have_lapsed(other.lives_until)
        {
            if other.owner == owner {
                self.violation(format_args!(
                    "{owner} won {key} again at {before}..{after} while its lock lived until {}",
                    other.lives_until
                ));
            } else {
                self.violation(format_args!(
                    "two holders of {key}: {owner} won at {before}..{after} while {} held it until {}",
                    other.owner, other.lives_until
                ));
            }
        }
        holders.insert(
            key.to_owned(),
            Holder {
                owner: owner.to_owned(),
                lives_until: before.min(after) + ttl,
                // The table read its time during the call: a step back within the
                // call may leave both readings below it, never the highest.
                lapses_at: before.max(after).max(self.ctx.clock(self.proc).highest_ms()) + ttl,
                releasing: false,
            },
        );
    }

    /// The holder looks at its lock: the table must agree with what is known of it.
    async fn look(&self, key: &str, owner: &str) -> bool {
        let known = self.known.holders.lock().get(key).cloned();
        let before = self.now();
        let holds = match self.body.is_locked_by(key, owner).await {
            Ok(holds) => holds,
            Err(e) => {
                self.failed("is_locked_by", &e);
                return false;
            }
        };
        let after = self.now();
        match known {
            Some(h) if h.owner == owner && !holds && !self.may_have_lapsed(h.lives_until) => {
                self.violation(format_args!(
                    "{owner} told it does not hold {key}, which lives until {}",
                    h.lives_until
                ))
            }
            Some(h) if h.owner != owner && holds => self.violation(format_args!(
                "{owner} told it holds {key}, which {} took over",
                h.owner
            )),
            Some(h) if h.owner == owner && holds && before.min(after) >= h.lapses_at => self.violation(
                format_args!("{owner} told it holds {key}, which lapsed at {}", h.lapses_at),
            ),
            _ => {}
        }
        holds
    }

    /// The holder unlocks: released only if it still held the lock.
    async fn release(&self, key: &str, owner: &str) {
        let known = {
            let mut holders = self.known.holders.lock();
            let known = holders.get(key).cloned();
            if let Some(h) = holders.get_mut(key)
                && h.owner == owner
            {
                h.releasing = true;
            }
            known
        };
        let at = self.known.begin(key);
        let unlocked = self.body.unlock(key, owner).await;
        self.known.end(key, at);
        let released = match unlocked {
            Ok(released) => released,
            Err(e) => {
                self.failed("unlock", &e);
                return;
            }
        };
        match known {
            Some(h) if h.owner == owner && !released && !self.may_have_lapsed(h.lives_until) => self
                .violation(format_args!(
                    "{owner}'s unlock of {key}, which lives until {}, released nothing",
                    h.lives_until
                )),
            Some(h) if h.owner != owner && released => self.violation(format_args!(
                "{owner}'s unlock released {key}, which {} took over",
                h.owner
            )),
            _ => {}
        }
        let mut holders = self.known.holders.lock();
        if holders.get(key).is_some_and(|h| h.owner == owner) {
            if released {
                holders.remove(key);
            } else if let Some(h) = holders.get_mut(key) {
                h.releasing = false;
            }
        }
    }
}

/// Runs one session of process `proc` on its table.
pub(crate) async fn session(ctx: &Arc<Ctx>, proc: usize, body: &Body, known: &Known, s: Session) {
    let w = &ctx.world;
    let id = ctx.next_id();
    let table = Table {
        ctx,
        proc,
        body,
        known,
        id,
    };
    let owner = format!("p{proc}c{id}");
    let ttl = Duration::from_millis(w.scenario.lease_ttl_ms);
    w.log(format_args!(
        "p{proc} c{id} table lock {} ({} ms, wait {} ms)",
        s.key, w.scenario.lease_ttl_ms, s.wait_ms
    ));
    if table.acquire(&s.key, &owner, ttl, s.wait_ms).await != Some(true) {
        w.log(format_args!("p{proc} c{id} table lock {}: not taken", s.key));
        return;
    }
    w.log(format_args!("p{proc} c{id} holds table lock {}", s.key));
    if s.again {
        // Refused while the lock lives (won again only once it surely lapsed); the looks
        // that follow check it kept the lock.
        let again = table.acquire(&s.key, &owner, ttl, 0).await;
        w.log(format_args!(
            "p{proc} c{id} table lock {} tried again: {again:?}",
            s.key
        ));
    }
    for work in s.steps {
        tokio::time::sleep(Duration::from_millis(work)).await;
        w.gate(proc).await;
        if !table.look(&s.key, &owner).await {
            w.log(format_args!("p{proc} c{id} table lock {} lapsed: stops", s.key));
            break;
        }
    }
    if s.release {
        table.release(&s.key, &owner).await;
        w.log(format_args!("p{proc} c{id} table lock {} released", s.key));
    } else {
        w.log(format_args!("p{proc} c{id} table lock {} left to lapse", s.key));
    }
}

/// After the workload and the quiet time: every table lock surely lapsed (the steps of
/// the clock are over, the last TTL long past), so each live process's sweeper emptied
/// its table. An entry left is a lock the table never forgets.
pub(crate) fn check_swept(ctx: &Ctx, bodies: &[Body]) {
    for (p, body) in bodies.iter().enumerate() {
        if ctx.world.is_crashed(p) {
            continue;
        }
        let left = body.table_len();
        if left != 0 {
            ctx.world.violation(format!(
                "table: p{p} kept {left} lapsed locks past the quiet time"
            ));
        }
    }
}
