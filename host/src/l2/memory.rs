//! The in-memory L2: the embedded default, and a first-class backend for tests.
//!
//! It does not expire entries by itself: a read never returns an expired entry (the
//! guest judges every read), and a background invalidation removes the expired ones
//! (SPEC section 3): it may start on any call, runs at most once per interval, never
//! two at once, and off the calling task.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::{L2Store, LandingWatch, Landings};
use crate::Result;
use crate::clock::Clock;
use crate::locks::MemoryLocks;
use crate::policy::{Policy, ReadOutcome};

const SHARDS: usize = 16;

/// The in-memory L2 store. Cheap to clone; clones share the entries.
#[derive(Clone)]
pub struct MemoryL2 {
    inner: Arc<Inner>,
}

struct Inner {
    hasher: RandomState,
    shards: [Mutex<HashMap<String, Bytes>>; SHARDS],
    policy: Policy,
    clock: Arc<dyn Clock>,
    /// The get-or-set locks: the same-process counterpart of `SET NX PX`.
    locks: MemoryLocks,
    landings: Landings,
    interval_ms: u64,
    last_run_ms: AtomicU64,
    running: AtomicBool,
    started: AtomicU64,
    removed: AtomicU64,
    runs: watch::Sender<u64>,
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

impl fmt::Debug for MemoryL2 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryL2")
            .field("entries", &self.len())
            .field("interval_ms", &self.inner.interval_ms)
            .finish_non_exhaustive()
    }
}

impl MemoryL2 {
    pub(crate) fn new(policy: Policy, clock: Arc<dyn Clock>, interval_ms: u64) -> Self {
        let now = clock.now_ms();
        MemoryL2 {
            inner: Arc::new(Inner {
                hasher: RandomState::new(),
                shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
                locks: MemoryLocks::from_parts(policy.clone(), clock.clone()),
                policy,
                clock,
                landings: Landings::default(),
                interval_ms,
                last_run_ms: AtomicU64::new(now),
                running: AtomicBool::new(false),
                started: AtomicU64::new(0),
                removed: AtomicU64::new(0),
                runs: watch::channel(0).0,
            }),
        }
    }

    /// How many entries the store holds, expired ones included until invalidated.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether the store holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Bytes>> {
        &self.inner.shards[self.inner.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Starts a background invalidation if one is due and none is running.
    fn maybe_invalidate(&self) {
        let inner = &self.inner;
        let now = inner.clock.now_ms();
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

    /// Removes every entry the guest judges expired at `now_ms`.
    fn invalidate(&self, now_ms: u64) {
        let inner = &self.inner;
        let mut removed = 0;
        for shard in &inner.shards {
            let mut map = shard.lock();
            map.retain(|_, bytes| {
                // Corrupt bytes are left for a read to find, remove and count.
                let expired = matches!(inner.policy.read(bytes, now_ms), Ok(ReadOutcome::Expired));
                removed += u64::from(expired);
                !expired
            });
        }
        inner.removed.fetch_add(removed, Ordering::SeqCst);
        inner.running.store(false, Ordering::Release);
        inner.runs.send_modify(|n| *n += 1);
        tracing::debug!(removed, "memory L2 invalidation done");
    }

    fn read_now(&self, key: &str, now_ms: u64) -> Result<Option<Bytes>> {
        let mut map = self.shard(key).lock();
        let Some(bytes) = map.get(key) else {
            return Ok(None);
        };
        match self.inner.policy.read(bytes, now_ms)? {
            ReadOutcome::Fresh(hit) => match hit.new_header {
                Some(header) => {
                    let mut touched = Vec::with_capacity(bytes.len());
                    touched.extend_from_slice(&header);
                    touched.extend_from_slice(&bytes[header.len()..]);
                    let touched = Bytes::from(touched);
                    map.insert(key.to_owned(), touched.clone());
                    Ok(Some(touched))
                }
                None => Ok(Some(bytes.clone())),
            },
            ReadOutcome::Expired => {
                map.remove(key);
                Ok(None)
            }
            ReadOutcome::Corrupt(_) => Ok(Some(bytes.clone())),
        }
    }
}

impl L2Store for MemoryL2 {
    fn read<'a>(&'a self, key: &'a str, now_ms: u64) -> BoxFuture<'a, Result<Option<Bytes>>> {
        self.maybe_invalidate();
        futures::future::ready(self.read_now(key, now_ms)).boxed()
    }

    fn peek<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>> {
        let found = self.shard(key).lock().get(key).cloned();
        futures::future::ready(Ok(found)).boxed()
    }

    fn write<'a>(&'a self, key: &'a str, bytes: Bytes, _ttl_ms: u64) -> BoxFuture<'a, Result<()>> {
        self.maybe_invalidate();
        self.shard(key).lock().insert(key.to_owned(), bytes);
        futures::future::ready(Ok(())).boxed()
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.maybe_invalidate();
        let removed = self.shard(key).lock().remove(key).is_some();
        futures::future::ready(Ok(removed)).boxed()
    }

    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, Result<bool>> {
        let mut map = self.shard(key).lock();
        let equal = map.get(key).is_some_and(|b| *b == expected);
        if equal {
            map.remove(key);
        }
        futures::future::ready(Ok(equal)).boxed()
    }

    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: Bytes,
        bytes: Bytes,
        _ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>> {
        let mut map = self.shard(key).lock();
        let equal = map.get(key).is_some_and(|b| *b == expected);
        if equal {
            map.insert(key.to_owned(), bytes);
        }
        futures::future::ready(Ok(equal)).boxed()
    }

    fn try_lock<'a>(&'a self, key: &'a str, owner: &'a str, ttl_ms: u64) -> BoxFuture<'a, Result<bool>> {
        let taken = self
            .inner
            .locks
            .try_lock(key, owner, Duration::from_millis(ttl_ms));
        futures::future::ready(taken).boxed()
    }

    fn release_lock<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>> {
        futures::future::ready(self.inner.locks.unlock(key, owner)).boxed()
    }

    fn watch_landing<'a>(&'a self, key: &'a str) -> BoxFuture<'a, LandingWatch> {
        futures::future::ready(self.inner.landings.watch(key)).boxed()
    }

    fn announce_landing<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<()>> {
        self.inner.landings.announce(key);
        futures::future::ready(Ok(())).boxed()
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}
