//! The in-memory store: the embedded default, and a first-class backend for tests.
//!
//! It keeps Redis's semantics for what Corral uses, on the cache's [`Clock`]: an entry
//! lives until the TTL it was written with passes (a read after that finds nothing,
//! as `PX` does), the flight lock is a `SET NX PX` with an owner, and landings are
//! announced to the waiters of this process. It judges nothing: the guest's TTL is the
//! only expiry it knows.
//!
//! Expired entries are removed by a background invalidation (contract §3): it may
//! start on any call, runs at most once per interval, never two at once, and off the
//! calling task.
//!
//! Names are hashed with `foldhash`, seeded at random per store, as the in-process
//! flight registry hashes keys: fast, but not a keyed hash built to resist callers who
//! study the process to choose colliding keys (SipHash is). Where keys come straight
//! from untrusted clients, bound their number or derive them (a keyed digest of the id).

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, ready};
use parking_lot::Mutex;
use tokio::sync::watch;

use super::{Entries, Fill, Filled, FlightLock, LandingWatch, Landings, Notifications};
use crate::Result;
use crate::clock::Clock;

const SHARDS: usize = 16;

/// Bytes and the moment (Unix ms, on the cache's clock) the store may drop them.
#[derive(Clone, Debug)]
struct Stored {
    bytes: Bytes,
    until_ms: u64,
}

impl Stored {
    /// `bytes` kept `ttl_ms` (at least 1 ms) from `now`.
    fn new(bytes: Bytes, ttl_ms: u64, now: u64) -> Stored {
        Stored {
            bytes,
            until_ms: now.saturating_add(ttl_ms.max(1)),
        }
    }
}

/// A shard's map. Its keys are the cache's names, hashed with a seed of this store's
/// (`foldhash`, as the registry hashes keys): a hash a key needs on every call costs a
/// few instructions, not SipHash's hundreds.
type Map<V> = HashMap<String, V, foldhash::fast::RandomState>;

type Shard = Mutex<Map<Stored>>;

/// The in-memory store. Cheap to clone; clones share the entries.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Picks a key's shard.
    hasher: foldhash::fast::RandomState,
    entries: [Shard; SHARDS],
    /// The get-or-set locks: owner and the moment the lock lapses.
    locks: [Mutex<Map<(String, u64)>>; SHARDS],
    clock: Arc<dyn Clock>,
    landings: Landings,
    interval_ms: u64,
    last_run_ms: AtomicU64,
    running: AtomicBool,
    started: AtomicU64,
    removed: AtomicU64,
    runs: watch::Sender<u64>,
    /// The caches over this store that hear tag and clear announcements.
    invalidation_hooks: Mutex<Vec<super::InvalidationHook>>,
}

/// What the background invalidation has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InvalidationStats {
    /// Runs started.
    pub started: u64,
    /// Completed runs.
    pub runs: u64,
    /// Expired entries removed, in all runs.
    pub removed: u64,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("entries", &self.len())
            .field("interval_ms", &self.inner.interval_ms)
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// A store on `clock` that sweeps expired entries at most every `interval_ms`: the
    /// embedded default's, for composing with other stores
    /// ([`CorralBuilder::stores`](crate::CorralBuilder::stores)).
    pub fn new(clock: Arc<dyn Clock>, interval_ms: u64) -> Self {
        let now = clock.now_ms();
        MemoryStore {
            inner: Arc::new(Inner {
                hasher: foldhash::fast::RandomState::default(),
                entries: std::array::from_fn(|_| Mutex::default()),
                locks: std::array::from_fn(|_| Mutex::default()),
                clock,
                landings: Landings::default(),
                interval_ms,
                last_run_ms: AtomicU64::new(now),
                running: AtomicBool::new(false),
                started: AtomicU64::new(0),
                removed: AtomicU64::new(0),
                runs: watch::channel(0).0,
                invalidation_hooks: Mutex::new(Vec::new()),
            }),
        }
    }

    /// How many entries the store holds, expired ones included until invalidated.
    pub fn len(&self) -> usize {
        self.inner.entries.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether the store holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lets the get-or-set lock `name` lapse now, whoever holds it, as it would for a
    /// holder paused past its TTL; says whether one was held. For tests.
    #[cfg(any(test, feature = "test-util"))]
    pub fn lapse_lock(&self, name: &str) -> bool {
        self.inner.locks[self.index(name)].lock().remove(name).is_some()
    }

    /// What the background invalidation has done so far.
    pub fn invalidation_stats(&self) -> InvalidationStats {
        InvalidationStats {
            started: self.inner.started.load(Ordering::SeqCst),
            runs: *self.inner.runs.borrow(),
            removed: self.inner.removed.load(Ordering::SeqCst),
        }
    }

    /// Waits until at least `runs` invalidation runs have completed.
    pub async fn invalidated(&self, runs: u64) {
        let mut rx = self.inner.runs.subscribe();
        // The sender lives in `inner`, which `self` keeps alive: this cannot fail.
        let _ = rx.wait_for(|n| *n >= runs).await;
    }

    fn index(&self, key: &str) -> usize {
        self.inner.hasher.hash_one(key) as usize % SHARDS
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.inner.entries[self.index(key)]
    }

    fn now(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// The live bytes under `key` in a locked shard; a lapsed entry is removed.
    fn live(map: &mut Map<Stored>, key: &str, now: u64) -> Option<Bytes> {
        match map.get(key) {
            Some(s) if now < s.until_ms => Some(s.bytes.clone()),
            Some(_) => {
                map.remove(key);
                None
            }
            None => None,
        }
    }

    /// Writes `stored` under `name` in a locked shard if it still holds `expected` (live
    /// bytes, or nothing); says whether it did.
    fn put_if(map: &mut Map<Stored>, name: &str, expected: Option<Bytes>, stored: Stored, now: u64) -> bool {
        let unchanged = Self::live(map, name, now) == expected;
        if unchanged {
            map.insert(name.to_owned(), stored);
        }
        unchanged
    }

    /// Starts a background invalidation if one is due and none is running.
    fn maybe_invalidate(&self) {
        let inner = &self.inner;
        let now = self.now();
        if now
            < inner
                .last_run_ms
                .load(Ordering::Acquire)
                .saturating_add(inner.interval_ms)
        {
            return;
        }
        if inner
            .running
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            inner.running.store(false, Ordering::Release);
            return;
        };
        inner.last_run_ms.store(now, Ordering::Release);
        inner.started.fetch_add(1, Ordering::SeqCst);
        let store = self.clone();
        runtime.spawn_blocking(move || store.invalidate(now));
    }

    /// Removes every entry whose TTL has passed at `now_ms`.
    fn invalidate(&self, now_ms: u64) {
        let inner = &self.inner;
        let mut removed = 0;
        for shard in &inner.entries {
            let mut map = shard.lock();
            let before = map.len();
            map.retain(|_, s| now_ms < s.until_ms);
            removed += (before - map.len()) as u64;
        }
        for shard in &inner.locks {
            shard.lock().retain(|_, (_, until)| now_ms < *until);
        }
        inner.removed.fetch_add(removed, Ordering::SeqCst);
        inner.running.store(false, Ordering::Release);
        inner.runs.send_modify(|n| *n += 1);
        tracing::debug!(removed, "memory store invalidation done");
    }
}

impl Entries for MemoryStore {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>> {
        self.maybe_invalidate();
        let now = self.now();
        let found = Self::live(&mut self.shard(key).lock(), key, now);
        ready(Ok(found)).boxed()
    }

    /// Every key read as [`get`](Self::get) reads it, at one moment.
    fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Bytes>>>> {
        self.maybe_invalidate();
        let now = self.now();
        let found = keys
            .iter()
            .map(|key| Ok(Self::live(&mut self.shard(key).lock(), key, now)))
            .collect();
        ready(found).boxed()
    }

    fn get_and_expire<'a>(
        &'a self,
        key: &'a str,
        ttl_ms: u64,
    ) -> Option<BoxFuture<'a, Result<Option<Bytes>>>> {
        self.maybe_invalidate();
        let now = self.now();
        let mut map = self.shard(key).lock();
        let found = Self::live(&mut map, key, now);
        if let Some(stored) = map.get_mut(key) {
            stored.until_ms = now.saturating_add(ttl_ms.max(1));
        }
        Some(ready(Ok(found)).boxed())
    }

    fn ttl_ms<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<u64>>> {
        let now = self.now();
        let mut map = self.shard(key).lock();
        let left = Self::live(&mut map, key, now)
            .and_then(|_| map.get(key))
            .map(|stored| stored.until_ms - now);
        ready(Ok(left)).boxed()
    }

    fn set<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<()>> {
        self.maybe_invalidate();
        let stored = Stored::new(bytes, ttl_ms, self.now());
        self.shard(key).lock().insert(key.to_owned(), stored);
        ready(Ok(())).boxed()
    }

    fn swap<'a>(&'a self, name: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<Option<Bytes>>> {
        self.maybe_invalidate();
        let now = self.now();
        let mut map = self.shard(name).lock();
        let old = Self::live(&mut map, name, now);
        map.insert(name.to_owned(), Stored::new(bytes, ttl_ms, now));
        ready(Ok(old)).boxed()
    }

    fn set_if<'a>(
        &'a self,
        name: &'a str,
        expected: Option<Bytes>,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>> {
        let now = self.now();
        let mut map = self.shard(name).lock();
        let written = Self::put_if(&mut map, name, expected, Stored::new(bytes, ttl_ms, now), now);
        ready(Ok(written)).boxed()
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.maybe_invalidate();
        let now = self.now();
        let mut map = self.shard(key).lock();
        let was_live = Self::live(&mut map, key, now).is_some();
        map.remove(key);
        ready(Ok(was_live)).boxed()
    }

    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, Result<bool>> {
        let now = self.now();
        let mut map = self.shard(key).lock();
        let equal = Self::live(&mut map, key, now).is_some_and(|b| b == expected);
        if equal {
            map.remove(key);
        }
        ready(Ok(equal)).boxed()
    }

    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: Bytes,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>> {
        let now = self.now();
        let mut map = self.shard(key).lock();
        let equal = Self::live(&mut map, key, now).is_some_and(|b| b == expected);
        if equal {
            map.insert(key.to_owned(), Stored::new(bytes, ttl_ms, now));
        }
        ready(Ok(equal)).boxed()
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

/// Whether a flight lock's record (its owner, until when) is `owner`'s and live at `now`.
fn held_by((holder, until): &(String, u64), owner: &str, now: u64) -> bool {
    holder == owner && now < *until
}

impl FlightLock for MemoryStore {
    fn try_lock<'a>(&'a self, key: &'a str, owner: &'a str, ttl_ms: u64) -> BoxFuture<'a, Result<bool>> {
        let now = self.now();
        let mut locks = self.inner.locks[self.index(key)].lock();
        let free = locks.get(key).is_none_or(|(_, until)| now >= *until);
        if free {
            locks.insert(
                key.to_owned(),
                (owner.to_owned(), now.saturating_add(ttl_ms.max(1))),
            );
        }
        ready(Ok(free)).boxed()
    }

    fn release<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>> {
        let now = self.now();
        let mut locks = self.inner.locks[self.index(key)].lock();
        let held = locks.get(key).is_some_and(|lock| held_by(lock, owner, now));
        if held {
            locks.remove(key);
        }
        ready(Ok(held)).boxed()
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
        entry: &'a str,
        over: Option<Option<Bytes>>,
    ) -> Option<BoxFuture<'a, Result<bool>>> {
        let now = self.now();
        // The lock's shard stays locked across the entry's look, as a fill's does.
        let mut locks = self.inner.locks[self.index(key)].lock();
        let unchanged =
            |expected: Option<Bytes>| Self::live(&mut self.shard(entry).lock(), entry, now) == expected;
        let renewed = match locks.get_mut(key) {
            Some(lock) if held_by(lock, owner, now) && over.is_none_or(unchanged) => {
                lock.1 = now.saturating_add(ttl_ms.max(1));
                true
            }
            _ => false,
        };
        Some(ready(Ok(renewed)).boxed())
    }

    fn fill_releasing<'a>(
        &'a self,
        fill: Fill<'a>,
        key: &'a str,
        owner: &'a str,
        _announce: Option<(&'a str, &'a str)>,
    ) -> Option<BoxFuture<'a, Result<Filled>>> {
        let now = self.now();
        // The lock's shard stays locked across the fill: the lock cannot change hands
        // between the look and the write.
        let mut locks = self.inner.locks[self.index(key)].lock();
        let held = locks.get(key).is_some_and(|lock| held_by(lock, owner, now));
        let mut written = false;
        if held {
            locks.remove(key);
            let mut map = self.shard(fill.name).lock();
            let stored = Stored::new(fill.bytes, fill.ttl_ms, now);
            written = match fill.over {
                Some(expected) => Self::put_if(&mut map, fill.name, expected, stored, now),
                None => {
                    map.insert(fill.name.to_owned(), stored);
                    true
                }
            };
        }
        let filled = Filled {
            written,
            held,
            // Landings here are the store's own: the caller announces.
            announced: false,
        };
        Some(ready(Ok(filled)).boxed())
    }
}

impl Notifications for MemoryStore {
    fn watch<'a>(&'a self, key: &'a str) -> BoxFuture<'a, LandingWatch> {
        ready(self.inner.landings.watch(key)).boxed()
    }

    fn announce<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<()>> {
        self.inner.landings.announce(key);
        ready(Ok(())).boxed()
    }

    fn publish_invalidation<'a>(&'a self, text: &'a str) -> BoxFuture<'a, Result<()>> {
        let hooks = self.inner.invalidation_hooks.lock().clone();
        for hook in hooks {
            hook(text);
        }
        ready(Ok(())).boxed()
    }

    fn on_invalidation(&self, hook: super::InvalidationHook) {
        self.inner.invalidation_hooks.lock().push(hook);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ManualClock;

    #[tokio::test]
    async fn entries_lapse_with_their_ttl_and_locks_with_theirs() {
        let clock = ManualClock::new(1_000);
        let store = MemoryStore::new(Arc::new(clock.clone()), 60_000);
        store.set("k", Bytes::from_static(b"v"), 100).await.unwrap();
        assert!(store.try_lock("k", "a", 50).await.unwrap());
        assert!(!store.try_lock("k", "b", 50).await.unwrap(), "held");
        assert!(!store.release("k", "b").await.unwrap(), "owner-checked");
        clock.set(1_050);
        assert!(store.try_lock("k", "b", 50).await.unwrap(), "lapsed: taken over");
        assert!(!store.release("k", "a").await.unwrap());
        assert_eq!(store.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
        clock.set(1_100);
        assert_eq!(store.get("k").await.unwrap(), None, "the TTL passed");
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn many_keys_read_together_read_as_each_alone() {
        let clock = ManualClock::new(1_000);
        let store = MemoryStore::new(Arc::new(clock.clone()), 60_000);
        store.set("short", Bytes::from_static(b"s"), 100).await.unwrap();
        store.set("long", Bytes::from_static(b"l"), 1_000).await.unwrap();
        clock.set(1_100);
        let keys = ["long", "short", "none", "long"];
        let together: Vec<_> = store
            .get_many(&keys)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let mut alone = Vec::new();
        for key in keys {
            alone.push(store.get(key).await.unwrap());
        }
        assert_eq!(together, alone);
        assert_eq!(together[0].as_deref(), Some(&b"l"[..]));
        assert_eq!(together[1], None, "its TTL passed");
    }
}
