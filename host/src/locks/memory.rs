//! The in-memory lock provider (seed 001): atomic try-lock with takeover of expired
//! locks, owner checks, and a background sweep of expired entries ("zombies") that
//! never removes an entry renewed or taken over in the meantime. O(1) per operation.
//!
//! Every table sweeps by itself from its construction until its last clone is dropped,
//! at the guest's interval (1 s) or [one of its own](MemoryLocks::with_sweep_interval):
//! on a task of the Tokio runtime current at construction, or, made outside any
//! runtime, on a thread of its own.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::Result;
use crate::clock::{Clock, SystemClock, steady};
use crate::guest::Policy;
use crate::guest::policy::{Held, defaults};
use crate::options::duration_ms;

const SHARDS: usize = 16;

/// An in-memory lock table. Cheap to clone; clones share the table.
#[derive(Clone)]
pub struct MemoryLocks {
    inner: Arc<Inner>,
}

struct Inner {
    policy: Policy,
    clock: Arc<dyn Clock>,
    hasher: RandomState,
    shards: [Mutex<Shard>; SHARDS],
    /// The table's own sweeper: it goes with the table.
    _sweeper: Sweeper,
}

/// A released lock's record, as the guest's `lock::release` makes it: no owner, expired
/// at every moment, keeping its token.
fn free(token: u64) -> Held {
    Held {
        owner: String::new(),
        expires_at_ms: 0,
        token,
    }
}

/// One shard of a table: its records, and the highest fencing token of a record it
/// forgot (a release, a sweep): a key without a record reads as a free record with
/// that token, so the key's next token is above any it had.
#[derive(Default)]
struct Shard {
    records: HashMap<String, Held>,
    floor: u64,
}

impl Shard {
    /// The record under `key` as the table answers it: stored, or a free one at the
    /// floor (none while nothing was forgotten).
    fn view(&self, key: &str) -> Option<std::borrow::Cow<'_, Held>> {
        match self.records.get(key) {
            Some(held) => Some(std::borrow::Cow::Borrowed(held)),
            None => (self.floor > 0).then(|| std::borrow::Cow::Owned(free(self.floor))),
        }
    }

    /// Forgets `key`'s record, keeping its token under the floor: the record, if any.
    fn forget(&mut self, key: &str) -> Option<Held> {
        let held = self.records.remove(key)?;
        self.floor = self.floor.max(held.token);
        Some(held)
    }
}

/// A table's own sweeper. It holds the table only weakly; dropping it (with the table's
/// last clone) stops it.
enum Sweeper {
    /// A task on the runtime current at construction: aborted on drop.
    Task(tokio::task::AbortHandle),
    /// A thread of its own (no runtime at construction): the closed channel stops it.
    Thread {
        /// Never sent on: dropping it disconnects the thread's receiver.
        _stop: mpsc::Sender<()>,
    },
    /// None could start (a guest failure or no thread): the table is swept only on demand.
    None,
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        if let Sweeper::Task(task) = self {
            task.abort();
        }
    }
}

impl Sweeper {
    fn start(table: Weak<Inner>, every: Duration) -> Sweeper {
        let sweep = move || {
            let Some(inner) = table.upgrade() else {
                return false;
            };
            match (MemoryLocks { inner }).sweep() {
                Ok(n) if n > 0 => tracing::debug!(removed = n, "lock sweep"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "lock sweep failed"),
            }
            true
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let task = runtime.spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    if !sweep() {
                        return;
                    }
                }
            });
            return Sweeper::Task(task.abort_handle());
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("corral-lock-sweep".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    if !sweep() {
                        return;
                    }
                }
            });
        match thread {
            Ok(_) => Sweeper::Thread { _stop: stop },
            Err(e) => {
                tracing::warn!(error = %e, "no lock sweep thread: expired locks stay until swept");
                Sweeper::None
            }
        }
    }
}

impl fmt::Debug for MemoryLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLocks")
            .field("entries", &self.len())
            .finish_non_exhaustive()
    }
}

impl MemoryLocks {
    /// A lock table on the system clock, sweeping its expired entries every second. Its
    /// expiries run on the monotonic clock from the table's making: a step of the wall
    /// clock neither frees a held lock nor keeps a lapsed one.
    ///
    /// Made inside a Tokio runtime, the table sweeps on a task of that runtime (so it
    /// stops sweeping if the runtime shuts down before the table is dropped); made
    /// outside any runtime, on a thread of its own (`corral-lock-sweep`). Either stops
    /// when the table's last clone is dropped.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) if the guest cannot be loaded.
    pub fn new() -> Result<Self> {
        Self::with_clock(SystemClock)
    }

    /// A lock table on `clock` (a [`ManualClock`](crate::ManualClock) in tests),
    /// sweeping as [`new`](Self::new) does. A clock that runs in real time
    /// ([`Clock::is_real_time`], as the system clock does) is read once, at the making,
    /// and the table's time then runs on the monotonic clock, as [`new`](Self::new)'s does.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_clock(clock: impl Clock) -> Result<Self> {
        let policy = Policy::load(defaults()?.limits)?;
        let every = Duration::from_millis(policy.lock_sweep_interval_ms()?);
        Ok(Self::build(policy, steady(Arc::new(clock)), Some(every)))
    }

    /// A lock table on `clock` that sweeps every `every` (real time) instead of the
    /// guest's default: no expired entry stays longer than that.
    ///
    /// # Errors
    /// As [`new`](Self::new); [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument)
    /// naming `sweep interval` when `every` is zero.
    pub fn with_sweep_interval(clock: impl Clock, every: Duration) -> Result<Self> {
        if every.is_zero() {
            return Err(crate::Error::invalid_argument(
                "sweep interval",
                "must be a positive duration",
            ));
        }
        let policy = Policy::load(defaults()?.limits)?;
        Ok(Self::build(policy, steady(Arc::new(clock)), Some(every)))
    }

    /// A table sharing a cache's guest handle and limits, its expiries judged on `clock`
    /// as given ([`Corral::locks`](crate::Corral::locks) passes the cache's made
    /// [`steady`]; the portable body, the clock its guest reads), sweeping at the guest's
    /// interval.
    pub(crate) fn from_parts(policy: Policy, clock: Arc<dyn Clock>) -> Self {
        let every = match policy.lock_sweep_interval_ms() {
            Ok(ms) => Some(Duration::from_millis(ms)),
            Err(e) => {
                tracing::warn!(error = %e, "no lock sweep interval: expired locks stay until swept");
                None
            }
        };
        Self::build(policy, clock, every)
    }

    fn build(policy: Policy, clock: Arc<dyn Clock>, every: Option<Duration>) -> Self {
        MemoryLocks {
            inner: Arc::new_cyclic(|table| Inner {
                policy,
                clock,
                hasher: RandomState::new(),
                shards: std::array::from_fn(|_| Mutex::new(Shard::default())),
                _sweeper: every.map_or(Sweeper::None, |every| Sweeper::start(table.clone(), every)),
            }),
        }
    }

    /// The record under `key` as the table answers it (the portable body's
    /// `table.get`): stored, or free at the shard's floor once it forgot one.
    pub(crate) fn held(&self, key: &str) -> Option<Held> {
        self.shard(key).lock().view(key).map(std::borrow::Cow::into_owned)
    }

    /// Stores `new` under `key` if the table answers exactly `expected` there (`None`:
    /// nothing), token included; says whether it did (the portable body's
    /// `table.compare-and-swap`).
    pub(crate) fn compare_and_swap(&self, key: &str, expected: Option<&Held>, new: Held) -> bool {
        let mut shard = self.shard(key).lock();
        if shard.view(key).as_deref() != expected {
            return false;
        }
        shard.records.insert(key.to_owned(), new);
        true
    }

    fn shard(&self, key: &str) -> &Mutex<Shard> {
        &self.inner.shards[self.inner.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Takes the lock of `key` for `owner` for `ttl`, if it is free or expired. Of any
    /// number of racing callers at most one wins while the lock lives.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `key` or `ttl`.
    pub fn try_lock(&self, key: &str, owner: &str, ttl: Duration) -> Result<bool> {
        Ok(self.acquire(key, owner, ttl)?.is_some())
    }

    /// Takes the lock of `key` for `owner` for `ttl` as [`try_lock`](Self::try_lock)
    /// does, and answers the acquire's fencing token (`None`: not taken). Every acquire
    /// of `key` in this table gets a higher token than the one before, across
    /// releases, takeovers and sweeps: pass it to the resource the lock guards, and let
    /// the resource refuse a token below the last it saw (a holder whose lock lapsed
    /// while it was paused).
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock).
    pub fn acquire(&self, key: &str, owner: &str, ttl: Duration) -> Result<Option<u64>> {
        let ttl_ms = duration_ms(ttl);
        let policy = &self.inner.policy;
        policy.lock_check_request(key, ttl_ms)?;
        let now = self.inner.clock.now_ms();
        let mut shard = self.shard(key).lock();
        let Some(entry) = policy.lock_try(shard.view(key).as_deref(), owner, ttl_ms, now)? else {
            return Ok(None);
        };
        let token = entry.token;
        shard.records.insert(key.to_owned(), entry);
        Ok(Some(token))
    }

    /// Releases `key` if `owner` holds it; says whether it did.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) only.
    pub fn unlock(&self, key: &str, owner: &str) -> Result<bool> {
        let now = self.inner.clock.now_ms();
        let mut shard = self.shard(key).lock();
        let released = self
            .inner
            .policy
            .lock_release(shard.view(key).as_deref(), owner, now)?
            .is_some();
        if released {
            shard.forget(key);
        }
        Ok(released)
    }

    /// Releases `key` whoever holds it (for administrators); says whether a lock was
    /// there (held or lapsed; a released one, the portable export's free record, is
    /// none). The next acquire's token is still above its holder's.
    pub fn force_unlock(&self, key: &str) -> bool {
        self.shard(key)
            .lock()
            .forget(key)
            .is_some_and(|held| held != free(held.token))
    }

    /// Whether the lock of `key` is expired (or was never taken).
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) only.
    pub fn is_lock_expired(&self, key: &str) -> Result<bool> {
        let now = self.inner.clock.now_ms();
        let shard = self.shard(key).lock();
        self.inner.policy.lock_is_expired(shard.view(key).as_deref(), now)
    }

    /// Whether `owner` holds the lock of `key` now.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) only.
    pub fn is_locked_by(&self, key: &str, owner: &str) -> Result<bool> {
        let now = self.inner.clock.now_ms();
        let shard = self.shard(key).lock();
        self.inner
            .policy
            .lock_is_locked_by(shard.view(key).as_deref(), owner, now)
    }

    /// Entries in the table, expired ones included until swept.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| s.lock().records.len()).sum()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes the expired entries; returns how many. Two phases: find the candidates,
    /// then remove each only if the table still holds that very entry, so an entry
    /// renewed or taken over in between stays.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) only.
    pub fn sweep(&self) -> Result<usize> {
        let candidates = self.sweep_candidates()?;
        Ok(self.remove_unchanged(candidates))
    }

    fn sweep_candidates(&self) -> Result<Vec<(String, Held)>> {
        let now = self.inner.clock.now_ms();
        let mut candidates = Vec::new();
        for shard in &self.inner.shards {
            let snapshot: Vec<(String, Held)> = shard
                .lock()
                .records
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for (key, entry) in snapshot {
                if self.inner.policy.lock_sweepable(&entry, now)? {
                    candidates.push((key, entry));
                }
            }
        }
        Ok(candidates)
    }

    fn remove_unchanged(&self, candidates: Vec<(String, Held)>) -> usize {
        let mut removed = 0;
        for (key, entry) in candidates {
            let mut shard = self.shard(&key).lock();
            if shard.records.get(&key) == Some(&entry) {
                shard.forget(&key);
                removed += 1;
            }
        }
        removed
    }

    /// Sweeps every `every` on a task of the current runtime until the table is dropped:
    /// an extra sweeper, beside the one every table runs from its construction.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn spawn_sweeper(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let locks = MemoryLocks { inner };
                match locks.sweep() {
                    Ok(n) if n > 0 => tracing::debug!(removed = n, "lock sweep"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "lock sweep failed"),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ManualClock;
    use crate::clock::SteppedWall;

    #[test]
    fn a_step_of_the_wall_clock_neither_frees_a_held_lock_nor_keeps_a_lapsed_one() {
        let wall = SteppedWall::new(1_000_000_000);
        let locks = MemoryLocks::with_clock(wall.clone()).unwrap();
        assert!(locks.try_lock("a", "one", Duration::from_secs(10)).unwrap());
        wall.set(1_000_000_000 + 3_600_000);
        assert!(
            locks.is_locked_by("a", "one").unwrap(),
            "an hour's step forward frees nothing"
        );
        assert!(!locks.try_lock("a", "two", Duration::from_secs(10)).unwrap());
        assert_eq!(locks.sweep().unwrap(), 0, "nor does the sweep take it");
        assert!(locks.try_lock("b", "one", Duration::from_millis(20)).unwrap());
        wall.set(1_000_000_000 - 3_600_000);
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            locks.try_lock("b", "two", Duration::from_secs(10)).unwrap(),
            "an hour's step back keeps no lapsed lock"
        );
    }

    #[tokio::test]
    async fn a_caches_lock_table_is_steady_on_a_real_time_clock() {
        let wall = SteppedWall::new(1_000_000_000);
        let cache = crate::Corral::builder().clock(wall.clone()).build().unwrap();
        let locks = cache.locks().table();
        assert!(locks.try_lock("a", "one", Duration::from_secs(10)).unwrap());
        wall.set(1_000_000_000 + 3_600_000);
        assert!(
            locks.is_locked_by("a", "one").unwrap(),
            "an hour's step forward frees nothing"
        );
    }

    #[test]
    fn every_acquire_of_a_key_takes_a_higher_token_across_releases_and_sweeps() {
        let clock = ManualClock::new(1_000_000);
        let locks = MemoryLocks::with_clock(clock.clone()).unwrap();
        let ttl = Duration::from_millis(100);
        assert_eq!(locks.acquire("a", "one", ttl).unwrap(), Some(1));
        assert_eq!(locks.acquire("a", "two", ttl).unwrap(), None, "held");
        assert!(locks.unlock("a", "one").unwrap());
        assert_eq!(locks.len(), 0, "a release forgets the record");
        assert_eq!(locks.acquire("a", "two", ttl).unwrap(), Some(2));
        clock.advance(ttl);
        assert_eq!(locks.acquire("a", "three", ttl).unwrap(), Some(3), "a takeover");
        clock.advance(ttl);
        assert_eq!(locks.sweep().unwrap(), 1);
        assert_eq!(locks.acquire("a", "four", ttl).unwrap(), Some(4), "after a sweep");
        assert!(locks.force_unlock("a"));
        assert_eq!(
            locks.acquire("a", "five", ttl).unwrap(),
            Some(5),
            "after a forced release"
        );
        // The portable body's release: a free record swapped in, token kept.
        let held = locks.held("a").unwrap();
        assert!(locks.compare_and_swap("a", Some(&held), free(held.token)));
        assert!(
            !locks.compare_and_swap("a", Some(&held), held.clone()),
            "a stale swap never lands"
        );
        assert!(!locks.force_unlock("a"), "a released lock is no lock to force");
        assert_eq!(locks.acquire("a", "six", ttl).unwrap(), Some(6));
    }

    #[test]
    fn the_sweep_never_removes_an_entry_renewed_between_its_two_phases() {
        let clock = ManualClock::new(1_000_000);
        let locks = MemoryLocks::with_clock(clock.clone()).unwrap();
        assert!(locks.try_lock("a", "one", Duration::from_millis(100)).unwrap());
        assert!(locks.try_lock("b", "one", Duration::from_millis(100)).unwrap());
        clock.advance(Duration::from_millis(150));
        let candidates = locks.sweep_candidates().unwrap();
        assert_eq!(candidates.len(), 2, "both expired");
        // Between the phases, "a" is taken over by a new owner.
        assert!(locks.try_lock("a", "two", Duration::from_millis(100)).unwrap());
        assert_eq!(
            locks.remove_unchanged(candidates),
            1,
            "only the untouched zombie goes"
        );
        assert!(locks.is_locked_by("a", "two").unwrap());
        assert_eq!(locks.len(), 1);
    }
}
