//! [`CorralBuilder`]: what a cache is made of, and the one place it is composed.
//!
//! Every setting left alone takes the guest's default (`policy.defaults`, contract
//! §5.9): the builder writes none of them down.

use std::sync::Arc;
use std::time::Duration;

use super::l1_invalidation;
use super::metrics::Metrics;
use super::registry::Registry;
use super::{Corral, FlightSettings, Inner};
use crate::Result;
use crate::clock::{Clock, SystemClock};
use crate::guest::Policy;
use crate::guest::policy::{Settings, defaults};
use crate::locks::{Locks, MemoryLocks};
#[cfg(feature = "redis")]
use crate::locks::{RedisLocks, Server};
use crate::options::{DEFAULT_PREFIX, duration_ms};
use crate::store::l1::L1;
use crate::store::memory::MemoryStore;
use crate::store::{Entries, FlightLock, Notifications, Stores};

#[cfg(feature = "redis")]
use crate::store::redis::RedisOptions;

/// Configures and builds a [`Corral`].
#[derive(Debug)]
#[must_use]
pub struct CorralBuilder {
    clock: Arc<dyn Clock>,
    overrides: Overrides,
    #[cfg(feature = "redis")]
    redis: Option<RedisOptions>,
    custom: Option<Stores>,
    custom_prefix: Option<String>,
    /// An in-memory L2 shared with other caches of this process.
    memory: Option<MemoryStore>,
    /// `Some(false)`: sliding entries keep their moment in the envelope even where the
    /// store could keep it.
    sliding_in_store: Option<bool>,
    /// Test seams: a Redis reached in process, and a layer over the opened stores.
    #[cfg(feature = "test-util")]
    seams: crate::compose::Seams,
}

/// The settings a caller named; the rest come from the guest's defaults.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Overrides {
    pub(crate) default_sliding_ms: Option<u64>,
    pub(crate) max_key_bytes: Option<u32>,
    pub(crate) max_value_bytes: Option<u32>,
    pub(crate) l1_ttl_ms: Option<u64>,
    pub(crate) lock_wait_ms: Option<u64>,
    pub(crate) lock_ttl_ms: Option<u64>,
    pub(crate) invalidation_interval_ms: Option<u64>,
    pub(crate) degraded_l1_ttl_ms: Option<u64>,
    pub(crate) fail_safe_throttle_ms: Option<u64>,
    pub(crate) hard_timeout_ms: Option<u64>,
    pub(crate) soft_timeout_ms: Option<u64>,
    pub(crate) eager_refresh_permille: Option<u32>,
    pub(crate) l1_capacity: Option<u64>,
}

impl Overrides {
    /// The guest's defaults with these overrides applied.
    pub(crate) fn settings(&self) -> Result<Settings> {
        let mut s = defaults()?;
        let l = &mut s.limits;
        l.default_sliding_ms = self.default_sliding_ms.unwrap_or(l.default_sliding_ms);
        l.max_key_bytes = self.max_key_bytes.unwrap_or(l.max_key_bytes);
        l.max_value_bytes = self.max_value_bytes.unwrap_or(l.max_value_bytes);
        s.l1_ttl_ms = self.l1_ttl_ms.unwrap_or(s.l1_ttl_ms);
        s.lock_wait_ms = self.lock_wait_ms.unwrap_or(s.lock_wait_ms);
        s.lock_ttl_ms = self.lock_ttl_ms.unwrap_or(s.lock_ttl_ms);
        s.invalidation_interval_ms = self
            .invalidation_interval_ms
            .unwrap_or(s.invalidation_interval_ms);
        s.degraded_l1_ttl_ms = self.degraded_l1_ttl_ms.unwrap_or(s.degraded_l1_ttl_ms);
        s.fail_safe_throttle_ms = self.fail_safe_throttle_ms.unwrap_or(s.fail_safe_throttle_ms);
        s.hard_timeout_ms = self.hard_timeout_ms.or(s.hard_timeout_ms);
        s.soft_timeout_ms = self.soft_timeout_ms.or(s.soft_timeout_ms);
        s.eager_refresh_permille = self.eager_refresh_permille.or(s.eager_refresh_permille);
        s.l1_capacity = self.l1_capacity.unwrap_or(s.l1_capacity);
        crate::guest::policy::check_settings(s)?;
        Ok(s)
    }

    /// As [`settings`](Self::settings), for a cache over these stores: a Redis
    /// connection's response timeout is the one its store steps are held to.
    pub(crate) fn settings_over(
        &self,
        #[cfg(feature = "redis")] redis: Option<&RedisOptions>,
    ) -> Result<Settings> {
        let mut s = self.settings()?;
        s.store_timeout_ms = duration_ms(crate::store::store_timeout(
            #[cfg(feature = "redis")]
            redis,
            s.store_timeout_ms,
        ));
        // Only a Redis response timeout can have moved it: it is the one named.
        if crate::guest::policy::check_settings(s).is_err() {
            return Err(crate::Error::invalid_argument(
                "response_timeout",
                format!(
                    "must be between 1 ms and 100 years of 365 days, not {} ms",
                    s.store_timeout_ms
                ),
            ));
        }
        Ok(s)
    }
}

impl Default for CorralBuilder {
    fn default() -> Self {
        CorralBuilder {
            clock: Arc::new(SystemClock),
            overrides: Overrides::default(),
            #[cfg(feature = "redis")]
            redis: None,
            custom: None,
            custom_prefix: None,
            memory: None,
            sliding_in_store: None,
            #[cfg(feature = "test-util")]
            seams: Default::default(),
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

    /// Use a Redis Cluster as L2, reached through its seed nodes (`redis://host:port`
    /// each; one reachable node is enough), keys under the prefix `corral:`. Every key's
    /// data shares one hash slot, so no command is ever refused with `CROSSSLOT`.
    #[cfg(feature = "redis")]
    pub fn redis_cluster<I, S>(self, nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.redis_options(RedisOptions::cluster(nodes))
    }

    /// Use Redis as L2 with these options.
    #[cfg(feature = "redis")]
    pub fn redis_options(mut self, options: RedisOptions) -> Self {
        self.redis = Some(options);
        self.memory = None;
        self
    }

    /// Reaches the Redis of [`redis_options`](Self::redis_options) through `wire`, a
    /// server in this process, instead of a socket: everything above the connection (the
    /// store's commands and scripts, its breaker, the subscription, the cache's leases)
    /// runs as it does against a `redis-server`. For simulators (`corral-sim`).
    #[cfg(all(feature = "redis", feature = "test-util"))]
    pub fn redis_wire(mut self, wire: Arc<dyn crate::store::wire::Wire>) -> Self {
        self.seams.wire = Some(wire);
        self
    }

    /// Wraps the entries and the flight lock the builder opens (whichever backend) in
    /// `layer`'s: to watch what a cache asks of its store, call by call. For simulators.
    #[cfg(feature = "test-util")]
    pub fn store_layer(
        mut self,
        layer: impl FnOnce(crate::store::Layered) -> crate::store::Layered + Send + 'static,
    ) -> Self {
        self.seams.layer = Some(Box::new(layer));
        self
    }

    /// Use `store` as L2: an in-memory store (the embedded default's kind) shared with
    /// other caches built on it, for tests of several processes in one: each cache keeps
    /// its own L1 and flights over the one store and lock table, and hears the others'
    /// tag and clear announcements, but not their key changes (an L1 copy another cache
    /// replaced lives until its L1 TTL). Make it with [`MemoryStore::new`] on this
    /// cache's clock; the store keeps every cache's announcement hook for its lifetime.
    pub fn memory(mut self, store: MemoryStore) -> Self {
        self.memory = Some(store);
        #[cfg(feature = "redis")]
        {
            self.redis = None;
        }
        self
    }

    /// Use your own stores (a simulated network, another database): entries, the
    /// get-or-set lock and landing notifications, each behind its pure-I/O trait. The
    /// data is named under `prefix` (contract §2.4).
    pub fn stores(
        mut self,
        prefix: impl Into<String>,
        entries: Arc<dyn Entries>,
        flight_lock: Arc<dyn FlightLock>,
        notifications: Arc<dyn Notifications>,
    ) -> Self {
        self.custom = Some(Stores {
            entries,
            flight_lock,
            notifications,
            memory: None,
            #[cfg(feature = "redis")]
            redis: None,
        });
        self.custom_prefix = Some(prefix.into());
        self
    }

    /// Whether new sliding entries may keep their expiry moment in the store's TTL, so a
    /// read slides them with one `GETEX` (default: yes, where the store's TTLs run on
    /// this cache's clock; contract §3.2). Turn it off while processes of a Corral
    /// before version-2 envelopes still share the store: they take a version-2 entry
    /// for a corrupt one. Readers always read both.
    pub fn sliding_in_store(mut self, allowed: bool) -> Self {
        self.sliding_in_store = Some(allowed);
        self
    }

    /// How long a degraded get-or-set's value (loaded without the lock while the store
    /// or the lock failed; never written to L2) is served from this process's L1
    /// (default 1 s; zero: not at all), so an outage does not send every caller to the
    /// loader.
    pub fn degraded_l1_ttl(mut self, ttl: Duration) -> Self {
        self.overrides.degraded_l1_ttl_ms = Some(duration_ms(ttl));
        self
    }

    /// Fail-safe: how long a stale copy served in place of a failed reload is then
    /// served from this process's L1 before the loader is tried again (default 10 s),
    /// so a failing source is not hammered (contract §7.1).
    pub fn fail_safe_throttle(mut self, throttle: Duration) -> Self {
        self.overrides.fail_safe_throttle_ms = Some(duration_ms(throttle));
        self
    }

    /// The hard loader timeout every get-or-set gets unless its options name one
    /// ([`LoadOptions::hard_timeout`](crate::LoadOptions::hard_timeout)); default: none.
    /// A loader still running then is stopped (its future dropped), and the callers get
    /// the stale copy if there is one (fail-safe), else
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout).
    pub fn hard_timeout(mut self, timeout: Duration) -> Self {
        self.overrides.hard_timeout_ms = Some(duration_ms(timeout).max(1));
        self
    }

    /// The soft loader timeout every [`fetch`](crate::Corral::fetch) gets unless its
    /// options name one ([`LoadOptions::soft_timeout`](crate::LoadOptions::soft_timeout));
    /// default: none. `get_or_set`, whose load cannot outlive its caller, ignores it.
    pub fn soft_timeout(mut self, timeout: Duration) -> Self {
        self.overrides.soft_timeout_ms = Some(duration_ms(timeout).max(1));
        self
    }

    /// Eager refresh for every [`fetch`](crate::Corral::fetch) unless its options name
    /// a fraction ([`LoadOptions::eager_refresh`](crate::LoadOptions::eager_refresh));
    /// default: none. `get_or_set` ignores it.
    pub fn eager_refresh(mut self, fraction: f64) -> Self {
        self.overrides.eager_refresh_permille = Some(crate::cache::load::permille(fraction));
        self
    }

    /// The sliding expiration of entries whose options name none (default 20 minutes).
    pub fn default_sliding(mut self, idle: Duration) -> Self {
        self.overrides.default_sliding_ms = Some(duration_ms(idle));
        self
    }

    /// The longest key, in UTF-8 bytes (default 1024).
    pub fn max_key_bytes(mut self, n: u32) -> Self {
        self.overrides.max_key_bytes = Some(n);
        self
    }

    /// The largest value, in bytes (default 16 MiB).
    pub fn max_value_bytes(mut self, n: u32) -> Self {
        self.overrides.max_value_bytes = Some(n);
        self
    }

    /// How often the in-memory L2 removes expired entries in the background (default 30 s).
    pub fn invalidation_interval(mut self, every: Duration) -> Self {
        self.overrides.invalidation_interval_ms = Some(duration_ms(every));
        self
    }

    /// How many entries L1 holds at most (default 100,000); 0 turns L1 off.
    pub fn l1_capacity(mut self, entries: u64) -> Self {
        self.overrides.l1_capacity = Some(entries);
        self
    }

    /// The longest an entry is served from L1 without asking L2 (default 5 minutes).
    /// L1 never serves an entry past its L2 expiry either.
    pub fn l1_ttl(mut self, ttl: Duration) -> Self {
        self.overrides.l1_ttl_ms = Some(duration_ms(ttl));
        self
    }

    /// How long a get-or-set waits for another process's load (the distributed lock)
    /// before running its loader uncached (default 5 s).
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.overrides.lock_wait_ms = Some(duration_ms(wait));
        self
    }

    /// The TTL of the get-or-set lock, the longest a crashed or paused leader can block
    /// others (default 30 s). A running loader's leader renews its lock every third of
    /// it, so a loader may take longer and still fill.
    pub fn lock_ttl(mut self, ttl: Duration) -> Self {
        self.overrides.lock_ttl_ms = Some(duration_ms(ttl));
        self
    }

    fn uses_redis(&self) -> bool {
        #[cfg(feature = "redis")]
        return self.redis.is_some();
        #[cfg(not(feature = "redis"))]
        false
    }

    /// Loads the guest, checks the settings and connects the stores. Redis is connected
    /// lazily: an unreachable server is reported by the operations that need it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for bad limits
    /// or a bad Redis URL; [`ErrorKind::Guest`](crate::ErrorKind::Guest) if the guest
    /// component cannot be loaded.
    pub fn build(self) -> Result<Corral> {
        let mut settings = self.overrides.settings_over(
            #[cfg(feature = "redis")]
            self.redis.as_ref(),
        )?;
        // A custom store's TTL clock is its own business: its envelopes keep the moment.
        settings.limits.sliding_in_store = self.sliding_in_store != Some(false)
            && self.custom.is_none()
            && Stores::keep_sliding(self.uses_redis(), &*self.clock);
        let policy = Policy::load(settings.limits)?;
        let l1 = L1::new(settings.l1_capacity, Duration::from_millis(settings.l1_ttl_ms));
        let watched = Arc::new(super::watched::Watched::new(self.clock, policy.clone()));
        let clock: Arc<dyn Clock> = watched.clone();
        let (prefix, stores) = match self.custom {
            Some(custom) => (
                self.custom_prefix.unwrap_or_else(|| DEFAULT_PREFIX.to_owned()),
                custom,
            ),
            None => crate::compose::open_stores(
                #[cfg(feature = "redis")]
                self.redis.as_ref(),
                #[cfg(feature = "test-util")]
                self.seams,
                self.memory,
                &policy,
                clock.clone(),
                settings.invalidation_interval_ms,
                crate::guest::policy::retry(&settings),
            )?,
        };
        // Counted, and exported to the `metrics` recorder in force now, under the prefix.
        let metrics = Arc::new(Metrics::new(&prefix));
        let tags = Arc::new(super::tags::TagState::new(policy.clone())?);
        listen(&stores, &l1, &metrics, &tags, &policy, &clock, settings.l1_ttl_ms);
        // A wall clock stepped back is a gap in what this process heard (contract §7.5).
        let gap = super::l1_invalidation(l1.clone(), metrics.clone(), tags.clone());
        watched.on_step(move || gap(None));
        let flight = FlightSettings::of(&settings, policy.store_budget(settings)?);
        let owed = crate::owed::Owed::default();
        let locks = locks_over(&stores, &policy, &clock, &owed);
        let (_, removal_ttl_ms) = policy.removal(settings.lock_ttl_ms, b"")?;
        let gets = stores
            .entries
            .gathers()
            .then(|| super::gathered::Gets::new(settings.l1_capacity, removal_ttl_ms));
        // The flights' registry hashes keys as the names' table does: a batch hashes
        // each of its keys once, for both.
        let names = super::named::Names::new(settings.l1_capacity);
        let registry = Registry::counted_hashing(&owed, names.hasher().clone());
        Ok(Corral {
            inner: Arc::new(Inner {
                policy,
                prefix,
                clock,
                stores,
                l1,
                l1_ttl_ms: settings.l1_ttl_ms,
                flight,
                read_hints: super::read::ReadHints::new(settings.l1_capacity, removal_ttl_ms),
                names,
                kept: super::kept::Kept::new(settings.l1_capacity),
                flight_names: super::named::Names::new(settings.l1_capacity),
                gets,
                decoded: super::typed::Decoded::new(settings.l1_capacity, settings.l1_ttl_ms),
                retry: crate::guest::policy::retry(&settings),
                cas_tries: settings.cas_tries,
                registry,
                refreshes: Registry::counted(&owed),
                background: Default::default(),
                owed,
                metrics,
                locks,
                tags,
            }),
        })
    }
}

/// What a cache hears from other processes: their set, removal or load of a key drops
/// its L1 copy; their tag invalidation or clear (contract §7.5) drops what it names.
fn listen(
    stores: &Stores,
    l1: &L1,
    metrics: &Arc<Metrics>,
    tags: &Arc<super::tags::TagState>,
    policy: &Policy,
    clock: &Arc<dyn Clock>,
    l1_ttl_ms: u64,
) {
    stores
        .notifications
        .on_foreign(l1_invalidation(l1.clone(), metrics.clone(), tags.clone()));
    stores
        .notifications
        .on_invalidation(super::tags::invalidation_hook(
            tags.clone(),
            policy.clone(),
            l1.clone(),
            clock.clone(),
            l1_ttl_ms,
            metrics.clone(),
        ));
}

impl FlightSettings {
    fn of(
        settings: &Settings,
        store_budget: crate::guest::bindings::corral::cache::types::StoreBudget,
    ) -> Self {
        FlightSettings {
            lock_wait_ms: settings.lock_wait_ms,
            lock_ttl_ms: settings.lock_ttl_ms,
            degraded_l1_ttl_ms: settings.degraded_l1_ttl_ms,
            fail_safe_throttle_ms: settings.fail_safe_throttle_ms,
            hard_timeout_ms: settings.hard_timeout_ms,
            soft_timeout_ms: settings.soft_timeout_ms,
            eager_refresh_permille: settings.eager_refresh_permille,
            store_timeout: Duration::from_millis(settings.store_timeout_ms),
            store_budget,
        }
    }
}

/// The lock APIs of a cache: its own lock table, and leases on its Redis connection
/// (woken by its announcements, their background work counted with the cache's in
/// `owed`) when Redis is the store.
fn locks_over(
    stores: &Stores,
    policy: &Policy,
    clock: &Arc<dyn crate::Clock>,
    owed: &crate::owed::Owed,
) -> Locks {
    #[cfg(not(feature = "redis"))]
    let _ = (stores, owed);
    Locks {
        table: MemoryLocks::from_parts(policy.clone(), crate::clock::steady(clock.clone())),
        #[cfg(feature = "redis")]
        redis: stores.redis.as_ref().map(|store| {
            let server = Server::shared(store.options(), store.link());
            RedisLocks::from_parts(
                policy.clone(),
                clock.clone(),
                vec![server],
                &store.options().prefix,
            )
            .woken_by(stores.notifications.clone())
            .owing_to(owed)
        }),
    }
}
