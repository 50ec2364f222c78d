//! [`Corral`]: the cache a service embeds, and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::clock::{Clock, SystemClock};
use crate::l1::L1;
use crate::l2::{L2Store, MemoryL2};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::options::{EntryOptions, Inspection, duration_ms};
use crate::policy::{Limits, Policy, ReadOutcome, WitMeta};
use crate::registry::Registry;
use crate::{Error, ErrorKind, Result};

#[cfg(feature = "redis")]
use crate::l2::{RedisL2, RedisOptions};

/// A tiered cache whose every decision is made by the Corral guest component.
///
/// Cheap to clone: clones share the stores, the guest and the metrics.
///
/// ```no_run
/// # async fn demo() -> corral::Result<()> {
/// use std::time::Duration;
/// use corral::{Corral, EntryOptions};
///
/// let cache = Corral::builder().build()?; // in-memory L2; `.redis(url)` for Redis
/// cache.set("user:42", b"Ada".to_vec(), EntryOptions::new().sliding(Duration::from_secs(60))).await?;
/// assert_eq!(cache.get("user:42").await?.as_deref(), Some(&b"Ada"[..]));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Corral {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) policy: Policy,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) l2: Arc<dyn L2Store>,
    memory: Option<MemoryL2>,
    #[cfg(feature = "redis")]
    redis: Option<RedisL2>,
    pub(crate) l1: L1,
    pub(crate) l1_ttl_ms: u64,
    pub(crate) flight: FlightSettings,
    pub(crate) registry: Registry,
    pub(crate) metrics: Arc<Metrics>,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct FlightSettings {
    pub(crate) lock_wait_ms: u64,
    pub(crate) lock_ttl_ms: u64,
}

impl fmt::Debug for Corral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Corral")
            .field("l2", &self.inner.l2)
            .field("clock", &self.inner.clock)
            .finish_non_exhaustive()
    }
}

/// Configures and builds a [`Corral`].
#[derive(Debug)]
#[must_use]
pub struct CorralBuilder {
    clock: Arc<dyn Clock>,
    limits: Limits,
    invalidation_interval: Duration,
    l1_capacity: u64,
    l1_ttl: Duration,
    lock_wait: Duration,
    lock_ttl: Duration,
    #[cfg(feature = "redis")]
    redis: Option<RedisOptions>,
}

impl Default for CorralBuilder {
    fn default() -> Self {
        CorralBuilder {
            clock: Arc::new(SystemClock),
            limits: crate::policy::default_limits(),
            invalidation_interval: Duration::from_secs(30),
            l1_capacity: 100_000,
            l1_ttl: Duration::from_secs(5 * 60),
            lock_wait: Duration::from_secs(5),
            lock_ttl: Duration::from_secs(30),
            #[cfg(feature = "redis")]
            redis: None,
        }
    }
}

impl CorralBuilder {
    /// The clock every decision reads (default: the system clock). Tests pass a
    /// [`ManualClock`](crate::ManualClock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Use Redis at `url` (`redis://host:port/db`) as L2, keys under the prefix `corral:`.
    #[cfg(feature = "redis")]
    pub fn redis(self, url: impl Into<String>) -> Self {
        self.redis_options(RedisOptions::new(url))
    }

    /// Use Redis as L2 with these options.
    #[cfg(feature = "redis")]
    pub fn redis_options(mut self, options: RedisOptions) -> Self {
        self.redis = Some(options);
        self
    }

    /// The sliding expiration of entries whose options name none (default 20 minutes).
    pub fn default_sliding(mut self, idle: Duration) -> Self {
        self.limits.default_sliding_ms = duration_ms(idle);
        self
    }

    /// The longest key, in UTF-8 bytes (default 1024).
    pub fn max_key_bytes(mut self, n: u32) -> Self {
        self.limits.max_key_bytes = n;
        self
    }

    /// The largest value, in bytes (default 16 MiB).
    pub fn max_value_bytes(mut self, n: u32) -> Self {
        self.limits.max_value_bytes = n;
        self
    }

    /// How often the in-memory L2 removes expired entries in the background (default 30 s).
    pub fn invalidation_interval(mut self, every: Duration) -> Self {
        self.invalidation_interval = every;
        self
    }

    /// How many entries L1 holds at most (default 100,000); 0 turns L1 off.
    pub fn l1_capacity(mut self, entries: u64) -> Self {
        self.l1_capacity = entries;
        self
    }

    /// The longest an entry is served from L1 without asking L2 (default 5 minutes).
    /// L1 never serves an entry past its L2 expiry either.
    pub fn l1_ttl(mut self, ttl: Duration) -> Self {
        self.l1_ttl = ttl;
        self
    }

    /// How long a get-or-set waits for another process's load (the distributed lock)
    /// before running its loader uncached (default 5 s).
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// The TTL of the get-or-set lock, the longest a crashed loader can block others
    /// (default 30 s).
    pub fn lock_ttl(mut self, ttl: Duration) -> Self {
        self.lock_ttl = ttl;
        self
    }

    /// Loads the guest, checks the limits and connects the stores. Redis is connected
    /// lazily: an unreachable server is reported by the operations that need it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for bad limits or a bad Redis URL;
    /// [`ErrorKind::Guest`] if the guest component cannot be loaded.
    pub fn build(self) -> Result<Corral> {
        let policy = Policy::load(self.limits)?;
        let l1 = L1::new(self.l1_capacity, self.l1_ttl);
        let metrics = Arc::new(Metrics::default());
        let clock = self.clock;
        let memory_l2 = || {
            MemoryL2::new(
                policy.clone(),
                clock.clone(),
                duration_ms(self.invalidation_interval),
            )
        };
        let mut memory = None;
        #[cfg(feature = "redis")]
        let mut redis = None;
        #[cfg(feature = "redis")]
        let l2: Arc<dyn L2Store> = match &self.redis {
            Some(options) => {
                let store = RedisL2::connect(options, &policy)?;
                // Another process's set, removal or load of a key drops our L1 copy.
                let (l1, metrics) = (l1.clone(), metrics.clone());
                store.on_foreign_landing(Arc::new(move |key| {
                    let (l1, metrics) = (l1.clone(), metrics.clone());
                    tokio::spawn(async move {
                        l1.remove(&key).await;
                        Metrics::bump(&metrics.l1_invalidations);
                    });
                }));
                redis = Some(store.clone());
                Arc::new(store)
            }
            None => {
                let store = memory_l2();
                memory = Some(store.clone());
                Arc::new(store)
            }
        };
        #[cfg(not(feature = "redis"))]
        let l2: Arc<dyn L2Store> = {
            let store = memory_l2();
            memory = Some(store.clone());
            Arc::new(store)
        };
        Ok(Corral {
            inner: Arc::new(Inner {
                policy,
                clock,
                l2,
                memory,
                #[cfg(feature = "redis")]
                redis,
                l1,
                l1_ttl_ms: duration_ms(self.l1_ttl),
                flight: FlightSettings {
                    lock_wait_ms: duration_ms(self.lock_wait),
                    lock_ttl_ms: duration_ms(self.lock_ttl),
                },
                registry: Registry::default(),
                metrics,
            }),
        })
    }
}

impl Corral {
    /// A builder with the defaults: in-memory L2, system clock, 20-minute default sliding.
    pub fn builder() -> CorralBuilder {
        CorralBuilder::default()
    }

    /// The value under `key`, if a fresh entry holds one: from L1, else from L2 (which
    /// then fills L1). A read of a sliding entry in L2 moves its expiry (never past its
    /// absolute expiration). Missing, expired and corrupt entries are all `None`; an
    /// expired or corrupt entry is removed.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key; [`ErrorKind::Unavailable`] when
    /// the store fails.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>> {
        let now = self.inner.clock.now_ms();
        // Only a valid key can be in L1: a hit needs no key check.
        if let Some(value) = self.inner.l1.get(key, now).await {
            Metrics::bump(&self.inner.metrics.l1_hits);
            return Ok(Some(value));
        }
        self.inner.policy.validate_key(key)?;
        let m = &self.inner.metrics;
        match self.l2_read(key, now).await? {
            Some((value, meta)) => {
                Metrics::bump(&m.l2_hits);
                self.fill_l1(key, &value, meta, now).await?;
                Ok(Some(value))
            }
            None => {
                Metrics::bump(&m.misses);
                Ok(None)
            }
        }
    }

    /// Stores `value` under `key`, expiring as `options` say: L2 first, then L1.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming `key`, `value`, `absolute`, `relative` or
    /// `sliding`; [`ErrorKind::Unavailable`] when the store fails (L1 is then not written).
    pub async fn set(&self, key: &str, value: impl Into<Bytes>, options: EntryOptions) -> Result<()> {
        let value = value.into();
        let now = self.inner.clock.now_ms();
        let plan = self.inner.policy.plan_set(key, value.len(), &options, now)?;
        self.l2_write(key, &plan.header, &value, plan.store_ttl_ms)
            .await?;
        Metrics::bump(&self.inner.metrics.sets);
        self.announce_change(key);
        self.fill_l1(key, &value, plan.meta, now).await
    }

    /// Tells the other processes sharing the Redis that `key` changed, so they drop
    /// their L1 copy; in the background (a lost announcement costs only staleness up to
    /// the L1 deadline).
    fn announce_change(&self, key: &str) {
        #[cfg(feature = "redis")]
        if let Some(redis) = &self.inner.redis {
            let (redis, key) = (redis.clone(), key.to_owned());
            tokio::spawn(async move {
                if let Err(e) = redis.announce_landing(&key).await {
                    tracing::debug!(key, error = %e, "change announcement failed");
                }
            });
        }
        #[cfg(not(feature = "redis"))]
        let _ = key;
    }

    /// Refreshes `key` in L2 as a read would, without returning the value: a sliding
    /// entry's expiry moves. Says whether a fresh entry was there; a missing one is not
    /// an error.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn refresh(&self, key: &str) -> Result<bool> {
        self.inner.policy.validate_key(key)?;
        let now = self.inner.clock.now_ms();
        Ok(self.l2_read(key, now).await?.is_some())
    }

    /// Removes `key` from both tiers. Says whether L2 held it; a missing entry is not
    /// an error.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key; [`ErrorKind::Unavailable`] when
    /// the store fails.
    pub async fn remove(&self, key: &str) -> Result<bool> {
        self.inner.policy.validate_key(key)?;
        self.inner.l1.remove(key).await;
        let removed = self.l2_op(self.inner.l2.delete(key)).await?;
        Metrics::bump(&self.inner.metrics.removes);
        self.announce_change(key);
        Ok(removed)
    }

    /// The entry under `key` as stored in L2, decoded, without touching it.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the stored bytes are not an envelope (they are left
    /// in place); otherwise as [`get`](Self::get).
    pub async fn inspect(&self, key: &str) -> Result<Option<Inspection>> {
        self.inner.policy.validate_key(key)?;
        let Some(stored) = self.l2_op(self.inner.l2.peek(key)).await? else {
            return Ok(None);
        };
        let (meta, _offset, value_len) = self.inner.policy.decode(&stored)?;
        let now = self.inner.clock.now_ms();
        let fresh = !matches!(self.inner.policy.check(&meta, now)?, crate::Freshness::Expired);
        Ok(Some(Inspection {
            meta,
            value_len,
            fresh,
            stored_len: stored.len(),
        }))
    }

    /// What this cache has done so far.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.metrics.snapshot()
    }

    /// Get-or-set flights in progress in this process: 0 whenever none runs (the
    /// registry keeps no entry for a finished or abandoned flight).
    pub fn flights_in_progress(&self) -> usize {
        self.inner.registry.len()
    }

    /// Callers in this process waiting on the flight of `key` (0 when none runs).
    pub fn followers_of(&self, key: &str) -> usize {
        self.inner.registry.followers(key)
    }

    /// The L2 store.
    pub fn l2(&self) -> &dyn L2Store {
        &*self.inner.l2
    }

    /// The in-memory L2, when that is the backend.
    pub fn memory_l2(&self) -> Option<&MemoryL2> {
        self.inner.memory.as_ref()
    }

    /// The Redis L2, when that is the backend.
    #[cfg(feature = "redis")]
    pub fn redis_l2(&self) -> Option<&RedisL2> {
        self.inner.redis.as_ref()
    }

    /// The guest's decisions, for callers that want them directly.
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The clock this cache reads.
    pub fn clock(&self) -> &dyn Clock {
        &*self.inner.clock
    }

    pub(crate) async fn l2_op<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        let out = op.await;
        if out.is_err() {
            Metrics::bump(&self.inner.metrics.l2_errors);
        }
        out
    }

    /// Writes `header` then `value` to L2.
    pub(crate) async fn l2_write(&self, key: &str, header: &[u8], value: &[u8], ttl_ms: u64) -> Result<()> {
        let mut stored = Vec::with_capacity(header.len() + value.len());
        stored.extend_from_slice(header);
        stored.extend_from_slice(value);
        self.l2_op(self.inner.l2.write(key, stored.into(), ttl_ms)).await
    }

    /// Fills L1 with `value` until the guest's deadline for `meta`.
    pub(crate) async fn fill_l1(&self, key: &str, value: &Bytes, meta: WitMeta, now: u64) -> Result<()> {
        let until = self.inner.policy.l1_deadline(meta, now, self.inner.l1_ttl_ms)?;
        self.inner.l1.insert(key, value.clone(), until).await;
        Ok(())
    }

    /// One L2 read: the store touches atomically, the guest judges what came back.
    /// Returns the value and its (touched) metadata when fresh.
    pub(crate) async fn l2_read(&self, key: &str, now: u64) -> Result<Option<(Bytes, WitMeta)>> {
        let Some(stored) = self.l2_op(self.inner.l2.read(key, now)).await? else {
            return Ok(None);
        };
        match self.inner.policy.read(&stored, now)? {
            ReadOutcome::Fresh(hit) => Ok(Some((stored.slice(hit.value_offset as usize..), hit.meta))),
            ReadOutcome::Expired => {
                self.l2_op(self.inner.l2.delete_if_equal(key, stored)).await?;
                Ok(None)
            }
            ReadOutcome::Corrupt(reason) => {
                Metrics::bump(&self.inner.metrics.corrupt);
                tracing::warn!(key, %reason, "corrupt entry removed and treated as a miss");
                self.l2_op(self.inner.l2.delete_if_equal(key, stored)).await?;
                Ok(None)
            }
        }
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error::new(kind, kind.to_string())
    }
}
