//! The portable body in wasmtime: the component's own `cache` and `lock` exports, run
//! against this crate's stores as their imports (`imports`). The component runs the
//! same `corral-core` machines the native body drives, with time from `wasi:clocks`,
//! which this module injects from the cache's [`Clock`]. This path is for portability
//! (the same `.wasm` runs in jco, or composed into a wasm platform), not speed: each
//! call takes an instance from a pool and runs on a blocking thread; concurrent calls
//! run on separate instances and coalesce through the shared flight registry. In
//! lockstep (`PortableBuilder::lockstep`, for simulations) a call's thread and its
//! caller's task take turns, so a seed replays byte for byte.

// Without the `redis` feature some of what serves Redis stores goes unused.
#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_variables))]

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use wasmtime::component::Linker;

use crate::LoadOptions;
use crate::cache::Overrides;
use crate::clock::{Clock, SystemClock};
use crate::guest::Policy;
use crate::guest::bindings::GuestPre;
use crate::guest::bindings::corral::cache::types;
use crate::guest::bindings::exports::corral::cache::cache::Begun;
use crate::guest::convert::{from_wit, options_in};
use crate::guest::engine::{Loaded, PORTABLE_BUDGET_TICKS, Slot, instantiate, loaded, trap};
use crate::options::{EntryOptions, duration_ms};
use crate::store::{Entries, FlightLock, Notifications, Stores};
use crate::{Error, Result};

mod batch;
mod imports;

#[cfg(any(test, feature = "test-util"))]
pub use imports::in_caller;
use imports::{Backend, CallState, Lockstep, PortableState};

/// How many idle instances a portable cache keeps.
const MAX_IDLE: usize = 16;

/// The portable body's template: WASI and this module's imports, linked once.
fn portable_pre(loaded: &Loaded) -> Result<&'static GuestPre<PortableState>> {
    static PRE: OnceLock<std::result::Result<GuestPre<PortableState>, String>> = OnceLock::new();
    PRE.get_or_init(|| {
        let link = || -> wasmtime::Result<GuestPre<PortableState>> {
            let mut linker = Linker::new(&loaded.engine);
            imports::add_to_linker(&mut linker)?;
            GuestPre::new(linker.instantiate_pre(&loaded.component)?)
        };
        link().map_err(|e| format!("{e:#}"))
    })
    .as_ref()
    .map_err(|e| {
        Error::new(
            crate::ErrorKind::Guest,
            format!("linking the portable body failed: {e}"),
        )
    })
}

/// The component's own cache and lock exports (the portable body), run in wasmtime with
/// this crate's stores as its imports. Cheap to clone.
///
/// ```no_run
/// # async fn demo() -> corral::Result<()> {
/// let cache = corral::portable::PortableCache::builder().build()?;
/// cache.set("k", b"v".to_vec(), corral::EntryOptions::new()).await?;
/// assert_eq!(cache.get("k").await?.as_deref(), Some(&b"v"[..]));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PortableCache {
    inner: Arc<PortableInner>,
}

struct PortableInner {
    /// Calls run in lockstep with their caller's task (see [`PortableBuilder::lockstep`]).
    lockstep: bool,
    loaded: &'static Loaded,
    pre: &'static GuestPre<PortableState>,
    backend: Arc<Backend>,
    settings: types::Settings,
    prefix: String,
    // Boxed on purpose: an instance moves out of the pool and back around every call.
    #[allow(clippy::vec_box)]
    idle: Mutex<Vec<Box<Slot<PortableState>>>>,
}

impl fmt::Debug for PortableCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PortableCache")
            .field("l2", &self.inner.backend.stores.entries.name())
            .finish_non_exhaustive()
    }
}

/// Configures a [`PortableCache`].
#[derive(Debug)]
#[must_use]
pub struct PortableBuilder {
    clock: Arc<dyn Clock>,
    #[cfg(feature = "redis")]
    redis: Option<crate::store::redis::RedisOptions>,
    overrides: Overrides,
    /// Stores of the caller's own, and their prefix.
    custom: Option<(String, Stores)>,
    /// An in-memory L2 shared with other caches of this process.
    memory: Option<crate::store::memory::MemoryStore>,
    lockstep: bool,
    /// Test seams: a Redis reached in process, and a layer over the opened stores.
    #[cfg(feature = "test-util")]
    seams: crate::compose::Seams,
}

impl Default for PortableBuilder {
    fn default() -> Self {
        PortableBuilder {
            clock: Arc::new(SystemClock),
            #[cfg(feature = "redis")]
            redis: None,
            overrides: Overrides::default(),
            custom: None,
            memory: None,
            lockstep: false,
            #[cfg(feature = "test-util")]
            seams: Default::default(),
        }
    }
}

impl PortableBuilder {
    /// The clock the guest's `wasi:clocks` reads (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Redis as the L2 import, with these options (default: the in-memory store).
    #[cfg(feature = "redis")]
    pub fn redis_options(mut self, options: crate::store::redis::RedisOptions) -> Self {
        self.redis = Some(options);
        self.memory = None;
        self
    }

    /// An in-memory L2 shared with other caches, as
    /// [`CorralBuilder::memory`](crate::CorralBuilder::memory) takes it.
    pub fn memory(mut self, store: crate::store::memory::MemoryStore) -> Self {
        self.memory = Some(store);
        #[cfg(feature = "redis")]
        {
            self.redis = None;
        }
        self
    }

    /// Your own stores as the imports' (a simulated network, another database), as
    /// [`CorralBuilder::stores`](crate::CorralBuilder::stores) takes them; the data is
    /// named under `prefix`.
    pub fn stores(
        mut self,
        prefix: impl Into<String>,
        entries: Arc<dyn Entries>,
        flight_lock: Arc<dyn FlightLock>,
        notifications: Arc<dyn Notifications>,
    ) -> Self {
        let stores = Stores {
            entries,
            flight_lock,
            notifications,
            memory: None,
            #[cfg(feature = "redis")]
            redis: None,
        };
        self.custom = Some((prefix.into(), stores));
        self
    }

    /// Runs each call in lockstep with its caller's task, for deterministic simulation
    /// on a current-thread runtime with paused time: the call computes on a thread of its
    /// own while the caller's task waits (blocking its runtime thread), and the caller's
    /// task performs each store step the call asks for while the call waits. One of the
    /// two runs at a time, so nothing depends on how threads are scheduled; a loader can
    /// await on the caller's runtime through [`in_caller`]. A call whose caller goes
    /// away does no more I/O (its locks lapse by their TTL).
    #[cfg(any(test, feature = "test-util"))]
    pub fn lockstep(mut self) -> Self {
        self.lockstep = true;
        self
    }

    /// As [`CorralBuilder::redis_wire`](crate::CorralBuilder::redis_wire).
    #[cfg(all(feature = "redis", feature = "test-util"))]
    pub fn redis_wire(mut self, wire: Arc<dyn crate::store::wire::Wire>) -> Self {
        self.seams.wire = Some(wire);
        self
    }

    /// As [`CorralBuilder::store_layer`](crate::CorralBuilder::store_layer).
    #[cfg(feature = "test-util")]
    pub fn store_layer(
        mut self,
        layer: impl FnOnce(crate::store::Layered) -> crate::store::Layered + Send + 'static,
    ) -> Self {
        self.seams.layer = Some(Box::new(layer));
        self
    }

    /// The longest an entry is served from L1 without asking L2 (default 5 minutes).
    pub fn l1_ttl(mut self, ttl: Duration) -> Self {
        self.overrides.l1_ttl_ms = Some(duration_ms(ttl));
        self
    }

    /// How long a get-or-set waits for another process's load before loading uncached
    /// (default 5 s).
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.overrides.lock_wait_ms = Some(duration_ms(wait));
        self
    }

    /// The TTL of the get-or-set lock (default 30 s).
    pub fn lock_ttl(mut self, ttl: Duration) -> Self {
        self.overrides.lock_ttl_ms = Some(duration_ms(ttl));
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

    /// As [`CorralBuilder::hard_timeout`](crate::CorralBuilder::hard_timeout).
    pub fn hard_timeout(mut self, timeout: Duration) -> Self {
        self.overrides.hard_timeout_ms = Some(duration_ms(timeout).max(1));
        self
    }

    /// The soft loader timeout (contract §7.2); default: none. A component call runs
    /// its caller's load to its end, so it serves the callers of the same instance that
    /// follow a load its holder still runs (a host that keeps an instance across
    /// callers, as jco does): asking once it is due, they get the stale copy, if the
    /// flight has one, and the load goes on to fill the tiers.
    pub fn soft_timeout(mut self, timeout: Duration) -> Self {
        self.overrides.soft_timeout_ms = Some(duration_ms(timeout).max(1));
        self
    }

    /// Eager refresh (contract §7.3) for every get-or-set. A component call cannot
    /// leave work behind, so the refresh runs in the call that found the value due,
    /// after the hit, before it returns; its decisions are the native body's. Default:
    /// none.
    pub fn eager_refresh(mut self, fraction: f64) -> Self {
        self.overrides.eager_refresh_permille = Some(crate::cache::load::permille(fraction));
        self
    }

    /// As [`CorralBuilder::fail_safe_throttle`](crate::CorralBuilder::fail_safe_throttle).
    pub fn fail_safe_throttle(mut self, throttle: Duration) -> Self {
        self.overrides.fail_safe_throttle_ms = Some(duration_ms(throttle));
        self
    }

    /// Instantiates the component with its imports; call inside a Tokio runtime.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) outside a
    /// runtime or for bad settings; [`ErrorKind::Guest`](crate::ErrorKind::Guest) if the
    /// component cannot be loaded.
    pub fn build(self) -> Result<PortableCache> {
        crate::require_runtime("the portable cache")?;
        let mut settings = self.overrides.settings_over(
            #[cfg(feature = "redis")]
            self.redis.as_ref(),
        )?;
        #[cfg(feature = "redis")]
        let redis = self.redis.is_some();
        #[cfg(not(feature = "redis"))]
        let redis = false;
        // A custom store's TTL clock is its own business: its envelopes keep the moment.
        settings.limits.sliding_in_store = self.custom.is_none() && Stores::keep_sliding(redis, &*self.clock);
        let policy = Policy::load(settings.limits)?;
        let (prefix, stores) = match self.custom {
            Some(custom) => custom,
            None => crate::compose::open_stores(
                #[cfg(feature = "redis")]
                self.redis.as_ref(),
                #[cfg(feature = "test-util")]
                self.seams,
                self.memory,
                &policy,
                self.clock.clone(),
                settings.invalidation_interval_ms,
                crate::guest::policy::retry(&settings),
            )?,
        };
        let loaded = loaded()?;
        let table = crate::locks::MemoryLocks::from_parts(policy.clone(), self.clock.clone());
        let l1 = crate::store::l1::L1::new(settings.l1_capacity, Duration::from_millis(settings.l1_ttl_ms));
        stores
            .notifications
            .on_foreign(imports::l1_invalidation(l1.clone()));
        stores
            .notifications
            .on_invalidation(imports::tag_invalidation(l1.clone()));
        let owed = crate::owed::Owed::default();
        let cache = PortableCache {
            inner: Arc::new(PortableInner {
                lockstep: self.lockstep,
                loaded,
                pre: portable_pre(loaded)?,
                backend: Arc::new(Backend {
                    runtime: tokio::runtime::Handle::current(),
                    clock: self.clock,
                    l1,
                    announcing: imports::Announcing {
                        retry: crate::guest::policy::retry(&settings),
                        bound: Duration::from_millis(settings.store_timeout_ms),
                        give_up_after: Duration::from_millis(settings.l1_ttl_ms),
                    },
                    stores,
                    registry: crate::cache::registry::Registry::counted(&owed),
                    table,
                    owed,
                }),
                settings,
                prefix,
                idle: Mutex::new(Vec::new()),
            }),
        };
        // The first instance judges the settings now, not at the first call.
        let slot = cache.inner.instance()?;
        cache.inner.idle.lock().push(slot);
        Ok(cache)
    }
}

impl PortableInner {
    /// An idle instance, or a new one configured with this cache's settings.
    fn instance(&self) -> Result<Box<Slot<PortableState>>> {
        if let Some(slot) = self.idle.lock().pop() {
            return Ok(slot);
        }
        let mut slot = instantiate(self.loaded, self.pre, PortableState::new(self.backend.clone()))?;
        slot.guest
            .corral_cache_cache()
            .call_configure(&mut slot.store, self.settings, &self.prefix)
            .map_err(trap)?
            .map_err(from_wit)?;
        Ok(slot)
    }
}

/// Runs `run` on a thread of its own in lockstep with this task: this task waits
/// (blocking its thread) while the call computes, and performs each store step the call
/// sends while the call waits for it.
async fn lockstep<R: Send + 'static>(
    mut call: CallState,
    run: impl FnOnce(CallState) -> Result<R> + Send + 'static,
) -> Result<R> {
    let (steps, next) = std::sync::mpsc::channel();
    let (done, outcome) = std::sync::mpsc::sync_channel(1);
    call.lockstep = Some(Lockstep::new(steps));
    // The call's thread reads this runtime's clock (paused, in a simulation).
    let runtime = tokio::runtime::Handle::current();
    let thread = std::thread::Builder::new()
        .name("corral-portable-lockstep".into())
        .spawn(move || {
            let _context = runtime.enter();
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(call)));
            let _ = done.send(out);
        });
    if let Err(e) = thread {
        return Err(Error::guest("the portable call's thread failed to start", e));
    }
    // Until the call has dropped its link (it ended), perform its steps one by one.
    let spin = Duration::from_micros(50);
    while let Ok(step) = imports::recv_soon(&next, spin) {
        step.await;
    }
    match imports::recv_soon(&outcome, spin) {
        Ok(Ok(out)) => out,
        Ok(Err(panic)) => Err(Error::guest(
            "the portable call's thread failed",
            Error::loader_panicked(&*panic).to_string(),
        )),
        Err(e) => Err(Error::guest("the portable call's thread failed", e)),
    }
}

/// A portable get-or-set's own origin: the loader the caller gave, run between the
/// phases of the component's get-or-set (`begin`, then the end of its `load`).
struct Origin {
    loader: Loader,
    should_cache: ShouldCache,
}

/// The loader of one portable get-or-set.
type Loader = Box<dyn FnMut(&str) -> std::result::Result<Vec<u8>, String> + Send>;
/// The caching verdict of one portable get-or-set.
type ShouldCache = Box<dyn Fn(&[u8]) -> bool + Send>;

impl Origin {
    /// Runs the loader for the component's `load` and ends it with what the loader
    /// gave. A caller gone before or during the load, or a loader that panics, drops the
    /// load instead (the component releases its flight lock, and a follower leads) and
    /// ends the call (contract §5.11); a panic reaches the caller as a loader error.
    fn load(
        &mut self,
        s: &mut Slot<PortableState>,
        load: wasmtime::component::ResourceAny,
        key: &str,
    ) -> wasmtime::Result<std::result::Result<Vec<u8>, types::Error>> {
        // `should_cache` runs with the loader: its panic is the load's, as the loader's is.
        let (loader, should_cache) = (&mut self.loader, &self.should_cache);
        let judged = || {
            (loader)(key).map(|value| {
                let cacheable = should_cache(&value);
                (value, cacheable)
            })
        };
        let out = match run_origin(s, judged) {
            Ok(out) => out,
            Err(e) => {
                load.resource_drop(&mut s.store)?;
                return Err(e);
            }
        };
        let cache = s.guest.corral_cache_cache().load();
        match out {
            Ok((value, cacheable)) => cache.call_complete(&mut s.store, load, &value, cacheable),
            Err(reason) => cache.call_fail(&mut s.store, load, &reason),
        }
    }
}

/// Runs `origin` (the caller's loader) for loads the call holds: unless the caller went
/// away before or during it, or it panicked (the panic is what the caller gets). On an
/// error the call drops its loads (the component releases their flight locks, and a
/// follower leads) and ends (contract §5.11).
fn run_origin<T>(s: &mut Slot<PortableState>, origin: impl FnOnce() -> T) -> wasmtime::Result<T> {
    let cancelled = s.store.data().call.cancelled.clone();
    if cancelled.load(Ordering::SeqCst) {
        return Err(wasmtime::format_err!("the caller went away before the load"));
    }
    let lockstep = s.store.data().call.lockstep.clone();
    let run = std::panic::AssertUnwindSafe(origin);
    let out = match &lockstep {
        Some(link) => link.enter(|| std::panic::catch_unwind(run)),
        None => std::panic::catch_unwind(run),
    };
    let out = match out {
        Ok(out) => out,
        Err(panic) => {
            s.store.data_mut().call.panicked = Some(Error::loader_panicked(&*panic));
            return Err(wasmtime::format_err!("the loader panicked"));
        }
    };
    if cancelled.load(Ordering::SeqCst) {
        return Err(wasmtime::format_err!("the caller went away mid-load"));
    }
    Ok(out)
}

/// Marks a call cancelled when its caller's future is dropped before it returned.
struct CancelOnDrop(Arc<std::sync::atomic::AtomicBool>, bool);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.1 {
            self.0.store(true, Ordering::SeqCst);
        }
    }
}

impl PortableCache {
    /// A builder: in-memory L2, system clock.
    pub fn builder() -> PortableBuilder {
        PortableBuilder::default()
    }

    /// Lets what this cache has under way end, for at most `within`, as
    /// [`Corral::close`](crate::Corral::close) does: its flights, and the announcements
    /// it retries in the background.
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when something was still under
    /// way at `within`, saying how much.
    pub async fn close(&self, within: Duration) -> Result<()> {
        let left = self.inner.backend.owed.settle(within).await;
        crate::owed::closed("the portable cache", left, within)
    }

    /// The entries store the imports act on (for tests that plant raw bytes).
    #[cfg(any(test, feature = "test-util"))]
    pub fn entries(&self) -> &dyn crate::store::Entries {
        &*self.inner.backend.stores.entries
    }

    /// Callers waiting on the flight of `key` (0 when none runs).
    #[cfg(any(test, feature = "test-util"))]
    pub fn followers_of(&self, key: &str) -> usize {
        self.inner.backend.registry.followers(key)
    }

    /// Get-or-set flights in progress in this process: 0 whenever none runs.
    #[cfg(any(test, feature = "test-util"))]
    pub fn flights_in_progress(&self) -> usize {
        self.inner.backend.registry.len()
    }

    /// Runs `f` on an instance, on a blocking thread (the imports block on I/O), with
    /// `call` as its per-call state. The flights the call led are handed on when it
    /// ends; a trapped instance is dropped, never reused.
    async fn call_with<R: Send + 'static>(
        &self,
        mut call: CallState,
        f: impl FnOnce(&mut Slot<PortableState>) -> wasmtime::Result<std::result::Result<R, types::Error>>
        + Send
        + 'static,
    ) -> Result<R> {
        let mut cancel = CancelOnDrop(call.cancelled.clone(), false);
        let inner = self.inner.clone();
        call.cancelled = cancel.0.clone();
        let run = move |call: CallState| -> Result<R> {
            let mut slot = inner.instance()?;
            slot.store.set_epoch_deadline(PORTABLE_BUDGET_TICKS);
            slot.store.data_mut().call = call;
            let out = f(&mut slot);
            // Whatever the call held or led and did not finish is handed on now.
            let mut ended = std::mem::take(&mut slot.store.data_mut().call);
            let panicked = ended.panicked.take();
            inner.backend.end_call(ended);
            if out.is_ok() {
                let mut idle = inner.idle.lock();
                if idle.len() < MAX_IDLE {
                    idle.push(slot);
                }
            }
            // A loader's panic trapped the call: its caller gets the panic.
            if let Some(panic) = panicked {
                return Err(panic);
            }
            out.map_err(trap)?.map_err(from_wit)
        };
        let out = if self.inner.lockstep {
            lockstep(call, run).await
        } else {
            tokio::task::spawn_blocking(move || run(call))
                .await
                .map_err(|e| Error::guest("the portable call's thread failed", e))?
        };
        cancel.1 = true;
        out
    }

    async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Slot<PortableState>) -> wasmtime::Result<std::result::Result<R, types::Error>>
        + Send
        + 'static,
    ) -> Result<R> {
        self.call_with(CallState::default(), f).await
    }

    /// As [`Corral::get`](crate::Corral::get), decided and driven inside the component.
    ///
    /// # Errors
    /// As [`Corral::get`](crate::Corral::get).
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>> {
        let key = key.to_owned();
        let v = self
            .call(move |s| s.guest.corral_cache_cache().call_get(&mut s.store, &key))
            .await?;
        Ok(v.map(Bytes::from))
    }

    /// As [`Corral::set`](crate::Corral::set).
    ///
    /// # Errors
    /// As [`Corral::set`](crate::Corral::set).
    pub async fn set(&self, key: &str, value: impl Into<Vec<u8>>, options: EntryOptions) -> Result<()> {
        let (key, value) = (key.to_owned(), value.into());
        let options = options_in(&options);
        self.call(move |s| {
            s.guest
                .corral_cache_cache()
                .call_set(&mut s.store, &key, &value, options)
        })
        .await
    }

    /// As [`Corral::set_tagged`](crate::Corral::set_tagged).
    ///
    /// # Errors
    /// As [`Corral::set_tagged`](crate::Corral::set_tagged).
    pub async fn set_tagged(
        &self,
        key: &str,
        value: impl Into<Vec<u8>>,
        options: EntryOptions,
        tags: &[impl AsRef<str>],
    ) -> Result<()> {
        let (key, value) = (key.to_owned(), value.into());
        let options = options_in(&options);
        let tags: Vec<String> = tags.iter().map(|t| t.as_ref().to_owned()).collect();
        self.call(move |s| {
            s.guest
                .corral_cache_cache()
                .call_set_tagged(&mut s.store, &key, &value, options, &tags)
        })
        .await
    }

    /// As [`Corral::remove_by_tag`](crate::Corral::remove_by_tag), in the component.
    ///
    /// # Errors
    /// As [`Corral::remove_by_tag`](crate::Corral::remove_by_tag).
    pub async fn remove_by_tag(&self, tag: &str) -> Result<()> {
        let tag = tag.to_owned();
        self.call(move |s| {
            s.guest
                .corral_cache_cache()
                .call_remove_by_tag(&mut s.store, &tag)
        })
        .await
    }

    /// As [`Corral::expire_by_tag`](crate::Corral::expire_by_tag), in the component.
    ///
    /// # Errors
    /// As [`Corral::expire_by_tag`](crate::Corral::expire_by_tag).
    pub async fn expire_by_tag(&self, tag: &str) -> Result<()> {
        let tag = tag.to_owned();
        self.call(move |s| {
            s.guest
                .corral_cache_cache()
                .call_expire_by_tag(&mut s.store, &tag)
        })
        .await
    }

    /// As [`Corral::clear`](crate::Corral::clear), in the component.
    ///
    /// # Errors
    /// As [`Corral::clear`](crate::Corral::clear).
    pub async fn clear(&self) -> Result<()> {
        self.call(move |s| s.guest.corral_cache_cache().call_clear(&mut s.store))
            .await
    }

    /// As [`Corral::refresh`](crate::Corral::refresh).
    ///
    /// # Errors
    /// As [`Corral::refresh`](crate::Corral::refresh).
    pub async fn refresh(&self, key: &str) -> Result<bool> {
        let key = key.to_owned();
        self.call(move |s| s.guest.corral_cache_cache().call_refresh(&mut s.store, &key))
            .await
    }

    /// As [`Corral::remove`](crate::Corral::remove).
    ///
    /// # Errors
    /// As [`Corral::remove`](crate::Corral::remove).
    pub async fn remove(&self, key: &str) -> Result<bool> {
        let key = key.to_owned();
        self.call(move |s| s.guest.corral_cache_cache().call_remove(&mut s.store, &key))
            .await
    }

    /// Soft invalidation in the component.
    ///
    /// # Errors
    /// As [`Corral::expire`](crate::Corral::expire).
    pub async fn expire(&self, key: &str) -> Result<bool> {
        let key = key.to_owned();
        self.call(move |s| s.guest.corral_cache_cache().call_expire(&mut s.store, &key))
            .await
    }

    /// Get-or-set in the component: `loader` produces the value on a miss (once), and
    /// the options' [`should_cache`](LoadOptions::should_cache) judges it; a loaded entry
    /// carries the options' [`tags`](LoadOptions::tags).
    ///
    /// The options are [`Corral::get_or_set`](crate::Corral::get_or_set)'s. The loader
    /// runs inside the component's call, so it is a plain function of the key, and this
    /// body's timeouts and eager refresh are the cache's own
    /// ([`PortableBuilder`]): one call's hard or soft timeout, eager refresh or
    /// background completion is refused. [`cache_none_for`](LoadOptions::cache_none_for)
    /// and [`max_batch`](LoadOptions::max_batch) have no effect here: this cache has no
    /// typed API, and one key makes no batch.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a bad key,
    /// entry option or tag, or an option this body cannot keep (naming it);
    /// [`ErrorKind::Loader`](crate::ErrorKind::Loader) with the loader's text when it
    /// failed.
    pub async fn get_or_set(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        loader: impl FnMut(&str) -> std::result::Result<Vec<u8>, String> + Send + 'static,
    ) -> Result<Bytes> {
        let options: LoadOptions = options.into();
        batch::refuse_timeouts(&options)?;
        let (tags, bypass) = (options.tags.to_vec(), options.bypass);
        let key = key.to_owned();
        let entry = options_in(&options.entry);
        let mut origin = Origin {
            loader: Box::new(loader),
            should_cache: Box::new(move |value: &[u8]| options.accepts(value)),
        };
        let v = self
            .call(move |s| {
                let begun =
                    s.guest
                        .corral_cache_cache()
                        .call_begin(&mut s.store, &key, entry, bypass, &tags)?;
                match begun {
                    Err(e) => Ok(Err(e)),
                    Ok(Begun::Hit(value)) => Ok(Ok(value)),
                    Ok(Begun::Lead(load)) => origin.load(s, load, &key),
                    // The refresh runs in the call that found the value due, after the
                    // hit, before it returns: a call leaves no work behind.
                    Ok(Begun::Refresh((value, load))) => {
                        let _refreshed = origin.load(s, load, &key)?;
                        Ok(Ok(value))
                    }
                    // Only a caller of the same instance leads: this call is its only one.
                    Ok(Begun::Wait(follower)) => {
                        follower.resource_drop(&mut s.store)?;
                        Err(wasmtime::format_err!(
                            "the component made a caller of a fresh instance follow"
                        ))
                    }
                }
            })
            .await?;
        Ok(Bytes::from(v))
    }

    /// How many locks the `lock` export's table holds (expired ones included until the
    /// sweep removes them). For tests.
    #[cfg(feature = "test-util")]
    pub fn locks_held(&self) -> usize {
        self.inner.backend.table.len()
    }

    /// The `lock` export's table, to sweep it at will. For tests.
    #[cfg(feature = "test-util")]
    pub fn lock_table(&self) -> &crate::locks::MemoryLocks {
        &self.inner.backend.table
    }

    /// The in-memory lock provider, in the component: takes `key` for `owner`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `key` or `ttl`.
    pub async fn try_lock(&self, key: &str, owner: &str, ttl: Duration) -> Result<bool> {
        let (key, owner, ttl_ms) = (key.to_owned(), owner.to_owned(), duration_ms(ttl));
        self.call(move |s| {
            s.guest
                .corral_lock_lock()
                .call_try_lock(&mut s.store, &key, &owner, ttl_ms)
        })
        .await
    }

    /// Takes `key` for `owner` for `ttl` as [`try_lock`](Self::try_lock) does, and
    /// answers the acquire's fencing token (`None`: not taken): every acquire of `key`
    /// gets a higher one than the one before.
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock).
    pub async fn acquire(&self, key: &str, owner: &str, ttl: Duration) -> Result<Option<u64>> {
        let (key, owner, ttl_ms) = (key.to_owned(), owner.to_owned(), duration_ms(ttl));
        self.call(move |s| {
            s.guest
                .corral_lock_lock()
                .call_acquire(&mut s.store, &key, &owner, ttl_ms)
        })
        .await
    }

    /// Releases `key` if `owner` holds it.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) only.
    pub async fn unlock(&self, key: &str, owner: &str) -> Result<bool> {
        let (key, owner) = (key.to_owned(), owner.to_owned());
        self.call(move |s| s.guest.corral_lock_lock().call_unlock(&mut s.store, &key, &owner))
            .await
    }

    /// Whether `owner` holds `key`.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) only.
    pub async fn is_locked_by(&self, key: &str, owner: &str) -> Result<bool> {
        let (key, owner) = (key.to_owned(), owner.to_owned());
        self.call(move |s| {
            s.guest
                .corral_lock_lock()
                .call_is_locked_by(&mut s.store, &key, &owner)
        })
        .await
    }

    /// Whether `key`'s lock is expired or was never taken.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) only.
    pub async fn is_lock_expired(&self, key: &str) -> Result<bool> {
        let key = key.to_owned();
        self.call(move |s| {
            s.guest
                .corral_lock_lock()
                .call_is_lock_expired(&mut s.store, &key)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::guest::bindings::exports::corral::cache::cache::Followed;

    const SEC: Duration = Duration::from_secs(1);

    /// What an instance's caller following another caller's load is told, asked before
    /// and after `advance` on the cache's clock, and what the load's holder gets when it
    /// ends the load after both (`late`). The two callers share one instance, as a host
    /// keeping an instance across callers (jco) has them.
    async fn follow_a_load(
        cache: &PortableCache,
        clock: &ManualClock,
        advance: Duration,
        late: &'static [u8],
    ) -> Result<(Followed, Followed, std::result::Result<Vec<u8>, types::Error>)> {
        let clock = clock.clone();
        let options = options_in(&EntryOptions::new().relative(60 * SEC).fail_safe(3600 * SEC));
        cache
            .call(move |s| {
                let cache = s.guest.corral_cache_cache();
                let store = &mut s.store;
                let load = leads(cache, store, options, "the first caller")?;
                let follower = follows(cache, store, options, "the second caller")?;
                let before = cache.follower().call_outcome(&mut *store, follower)?;
                clock.advance(advance);
                let after = cache.follower().call_outcome(&mut *store, follower)?;
                follower.resource_drop(&mut *store)?;
                let ended = cache.load().call_complete(&mut *store, load, late, true)?;
                Ok(Ok((before, after, ended)))
            })
            .await
    }

    type CacheExport = crate::guest::bindings::exports::corral::cache::cache::Guest;

    /// A get-or-set of "k" begun by a caller that must lead (`who`, named if it did
    /// not): its load.
    fn leads(
        cache: &CacheExport,
        store: &mut wasmtime::Store<PortableState>,
        options: types::EntryOptions,
        who: &str,
    ) -> wasmtime::Result<wasmtime::component::ResourceAny> {
        match cache.call_begin(&mut *store, "k", options, false, &[])? {
            Ok(Begun::Lead(load)) => Ok(load),
            _ => Err(wasmtime::format_err!("{who} did not lead")),
        }
    }

    /// A get-or-set of "k" begun by a caller that must follow (`who`, named if it did
    /// not): its follower.
    fn follows(
        cache: &CacheExport,
        store: &mut wasmtime::Store<PortableState>,
        options: types::EntryOptions,
        who: &str,
    ) -> wasmtime::Result<wasmtime::component::ResourceAny> {
        match cache.call_begin(&mut *store, "k", options, false, &[])? {
            Ok(Begun::Wait(follower)) => Ok(follower),
            _ => Err(wasmtime::format_err!("{who} did not follow")),
        }
    }

    fn value(followed: &Followed) -> Option<std::result::Result<&[u8], &types::Error>> {
        match followed {
            Followed::Ready(r) => Some(r.as_ref().map(Vec::as_slice)),
            _ => None,
        }
    }

    /// Callers of the instance whose flights meet the key's lock held by the instance's
    /// own eager refresh follow the refresh, and once it ended begin again as new
    /// callers would (contract §5.15): here the refresh found its entry gone and filled
    /// nothing, so the first to ask loads and the other follows that load. Before, the
    /// first caller's flight waited out the lock wait inside the instance, where the
    /// refresh could not end; and a second follower, joining the process's flight its
    /// own instance led, never returned.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_meeting_their_instances_refresh_follow_it() -> Result<()> {
        let clock = ManualClock::starting_now();
        let cache = PortableCache::builder()
            .clock(clock.clone())
            .eager_refresh(0.5)
            .lock_wait(SEC)
            .build()?;
        let entry = EntryOptions::new().relative(10 * SEC);
        cache.get_or_set("k", entry, |_| Ok(b"old".to_vec())).await?;
        let options = options_in(&entry);
        let seen = cache
            .call(move |s| {
                let cache = s.guest.corral_cache_cache();
                let store = &mut s.store;
                let mut seen = Vec::new();
                clock.advance(6 * SEC);
                let Ok(Begun::Refresh((_, load))) =
                    cache.call_begin(&mut *store, "k", options, false, &[])?
                else {
                    return Err(wasmtime::format_err!("no refresh was due"));
                };
                // Past the entry's end: L1 and L2 miss, and the lock is the refresh's.
                clock.advance(5 * SEC);
                let mut followers = Vec::new();
                for _ in 0..2 {
                    match cache.call_begin(&mut *store, "k", options, false, &[])? {
                        Ok(Begun::Wait(follower)) => followers.push(follower),
                        _ => {
                            load.resource_drop(&mut *store)?;
                            return Ok(Ok(vec!["a caller did not follow the refresh".to_owned()]));
                        }
                    }
                }
                let said = |followed: Followed| match followed {
                    Followed::Pending => "pending".to_owned(),
                    Followed::Ready(r) => format!("ready {:?}", r.map(String::from_utf8)),
                    Followed::Lead(_) => "led".to_owned(),
                };
                let first = cache.follower().call_outcome(&mut *store, followers[0])?;
                seen.push(said(first));
                let ended = cache.load().call_complete(&mut *store, load, b"new", true)?;
                seen.push(format!("refreshed {:?}", ended.map(String::from_utf8)));
                // The first to ask after the refresh leads (the refresh filled nothing)...
                let Followed::Lead(mine) = cache.follower().call_outcome(&mut *store, followers[1])? else {
                    return Ok(Ok(vec!["the first to ask did not lead".to_owned()]));
                };
                seen.push("led".to_owned());
                // ...and the other follows that load while it is open.
                let second = cache.follower().call_outcome(&mut *store, followers[0])?;
                seen.push(said(second));
                let ended = cache.load().call_complete(&mut *store, mine, b"mine", true)?;
                seen.push(format!("loaded {:?}", ended.map(String::from_utf8)));
                for &follower in &followers {
                    let last = cache.follower().call_outcome(&mut *store, follower)?;
                    seen.push(said(last));
                }
                for follower in followers {
                    follower.resource_drop(&mut *store)?;
                }
                Ok(Ok(seen))
            })
            .await?;
        assert_eq!(
            seen,
            [
                "pending",
                r#"refreshed Ok(Ok("new"))"#,
                "led",
                "pending",
                r#"loaded Ok(Ok("mine"))"#,
                r#"ready Ok(Ok("mine"))"#,
                r#"ready Ok(Ok("mine"))"#,
            ]
        );
        assert_eq!(cache.get("k").await?.as_deref(), Some(&b"mine"[..]));
        assert_eq!(cache.flights_in_progress(), 0);
        Ok(())
    }

    /// A follower in the instance asking past the load's hard timeout ends the flight
    /// with what a hard timeout gives every caller (a timeout, no stale copy here), and
    /// the holder's late value is judged the same, cached nowhere (contract §7.2).
    /// Before, the follower was told `pending` for as long as the holder loaded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_in_the_instance_is_answered_at_the_loads_hard_timeout() -> Result<()> {
        let clock = ManualClock::starting_now();
        let cache = PortableCache::builder()
            .clock(clock.clone())
            .hard_timeout(2 * SEC)
            .build()?;
        let (before, after, ended) = follow_a_load(&cache, &clock, 3 * SEC, b"late").await?;
        assert!(matches!(before, Followed::Pending), "within the timeout: pending");
        assert!(
            matches!(value(&after), Some(Err(types::Error::Timeout(_)))),
            "past the hard timeout the follower was not answered with a timeout"
        );
        assert!(
            matches!(ended, Err(types::Error::Timeout(_))),
            "the holder's late end"
        );
        assert_eq!(cache.get("k").await?, None, "a late value was cached");
        assert_eq!(cache.flights_in_progress(), 0);
        Ok(())
    }

    /// With a stale copy, a follower asking past the soft timeout gets it, and the
    /// holder's load goes on to fill the tiers; past the hard timeout, the stale copy
    /// is what every caller gets (contract §7.1, §7.2).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_in_the_instance_gets_the_stale_copy_at_the_loads_timeouts() -> Result<()> {
        let clock = ManualClock::starting_now();
        let cache = PortableCache::builder()
            .clock(clock.clone())
            .soft_timeout(SEC)
            .hard_timeout(10 * SEC)
            .build()?;
        let stale = EntryOptions::new().relative(SEC).fail_safe(3600 * SEC);
        cache.set("k", "old", stale).await?;
        clock.advance(2 * SEC);

        let (before, after, ended) = follow_a_load(&cache, &clock, 2 * SEC, b"new").await?;
        assert!(
            matches!(before, Followed::Pending),
            "within the soft timeout: pending"
        );
        assert_eq!(
            value(&after),
            Some(Ok(&b"old"[..])),
            "at the soft timeout: the stale copy"
        );
        assert_eq!(ended.as_deref(), Ok(&b"new"[..]), "the holder gets its value");
        assert_eq!(
            cache.get("k").await?.as_deref(),
            Some(&b"new"[..]),
            "the load went on to fill the tiers"
        );

        cache.set("k", "old", stale).await?;
        clock.advance(2 * SEC);
        let (_, after, ended) = follow_a_load(&cache, &clock, 11 * SEC, b"late").await?;
        assert_eq!(
            value(&after),
            Some(Ok(&b"old"[..])),
            "past the hard timeout: the stale copy"
        );
        assert_eq!(
            ended.as_deref(),
            Ok(&b"old"[..]),
            "the holder's late end, the same"
        );
        Ok(())
    }

    /// The soft timeout answers the followers waiting then, each for good; one that
    /// begins after it waits for the load's end (L1 kept no stale copy here: no
    /// throttle), as a native caller coming after the answer does (contract §7.2).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_followers_waiting_at_the_soft_timeout_get_the_stale_copy() -> Result<()> {
        let clock = ManualClock::starting_now();
        let cache = PortableCache::builder()
            .clock(clock.clone())
            .soft_timeout(SEC)
            .fail_safe_throttle(Duration::ZERO)
            .build()?;
        let options = EntryOptions::new().relative(SEC).fail_safe(3600 * SEC);
        cache.set("k", "old", options).await?;
        clock.advance(2 * SEC);
        let options = options_in(&options);
        let asked = cache
            .call(move |s| {
                let cache = s.guest.corral_cache_cache();
                let store = &mut s.store;
                let load = leads(cache, store, options, "the first caller")?;
                let early = follows(cache, store, options, "the second caller")?;
                clock.advance(2 * SEC);
                let mut asked = vec![cache.follower().call_outcome(&mut *store, early)?];
                let late = follows(cache, store, options, "the third caller")?;
                asked.push(cache.follower().call_outcome(&mut *store, late)?);
                let ended = cache.load().call_complete(&mut *store, load, b"new", true)?;
                asked.push(cache.follower().call_outcome(&mut *store, early)?);
                asked.push(cache.follower().call_outcome(&mut *store, late)?);
                early.resource_drop(&mut *store)?;
                late.resource_drop(&mut *store)?;
                Ok(ended.map(|_| asked))
            })
            .await?;
        assert_eq!(
            value(&asked[0]),
            Some(Ok(&b"old"[..])),
            "waiting at the soft timeout"
        );
        assert!(
            matches!(asked[1], Followed::Pending),
            "began after the answer: waits"
        );
        assert_eq!(
            value(&asked[2]),
            Some(Ok(&b"old"[..])),
            "asked again: the same answer"
        );
        assert_eq!(value(&asked[3]), Some(Ok(&b"new"[..])), "the load's end");
        Ok(())
    }

    /// A wall clock stepped back while a load runs empties L1 as a gap does, not as a
    /// clear: the key did not change, so a caller that began after the step still
    /// follows the load and takes its outcome (contract §7.5, §5.3).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_clock_step_during_a_load_leaves_its_follower_following() -> Result<()> {
        let clock = ManualClock::starting_now();
        let cache = PortableCache::builder().clock(clock.clone()).build()?;
        let options = options_in(&EntryOptions::new().relative(60 * SEC));
        let (pending, ended, followed) = cache
            .call(move |s| {
                let cache = s.guest.corral_cache_cache();
                let store = &mut s.store;
                let load = leads(cache, store, options, "the first caller")?;
                // The second caller's first reading is the step.
                clock.set(clock.now_ms() - 3_600_000);
                let follower = follows(cache, store, options, "the second caller")?;
                let pending = cache.follower().call_outcome(&mut *store, follower)?;
                // Not cached: a caller that does not take the outcome must load again.
                let ended = cache.load().call_complete(&mut *store, load, b"loaded", false)?;
                let followed = cache.follower().call_outcome(&mut *store, follower)?;
                if let Followed::Lead(again) = &followed {
                    again.resource_drop(&mut *store)?;
                }
                follower.resource_drop(&mut *store)?;
                Ok(Ok((pending, ended, followed)))
            })
            .await?;
        assert!(matches!(pending, Followed::Pending));
        assert_eq!(ended.as_deref(), Ok(&b"loaded"[..]));
        assert_eq!(
            value(&followed),
            Some(Ok(&b"loaded"[..])),
            "the step made the follower load again"
        );
        Ok(())
    }

    /// What `follower` is told when asked (a load it is handed dropped), and then what
    /// the key's next caller begins with, said in words (its load or follower dropped).
    fn asked_then_next(
        s: &mut Slot<PortableState>,
        follower: wasmtime::component::ResourceAny,
        options: types::EntryOptions,
    ) -> wasmtime::Result<(Followed, String)> {
        let cache = s.guest.corral_cache_cache();
        let store = &mut s.store;
        let followed = cache.follower().call_outcome(&mut *store, follower)?;
        if let Followed::Lead(load) = &followed {
            load.resource_drop(&mut *store)?;
        }
        follower.resource_drop(&mut *store)?;
        let next = match cache.call_begin(&mut *store, "k", options, false, &[])? {
            Ok(Begun::Refresh((value, load))) => {
                load.resource_drop(&mut *store)?;
                format!("refresh, serving {:?}", String::from_utf8(value))
            }
            Ok(Begun::Hit(value)) => format!("hit {:?}", String::from_utf8(value)),
            Ok(Begun::Lead(load)) => {
                load.resource_drop(&mut *store)?;
                "lead".to_owned()
            }
            Ok(Begun::Wait(follower)) => {
                follower.resource_drop(&mut *store)?;
                "wait".to_owned()
            }
            Err(e) => format!("error {e:?}"),
        };
        Ok((followed, next))
    }

    /// A follower in the instance whose load was dropped leads in its own right, and the
    /// copy its flight finds is due for its eager refresh: the follower is served the
    /// copy, and the refresh (which `outcome` has no way to hand it) is left due for the
    /// next caller, who gets it. Before, the follower's flight began the refresh and
    /// dropped its load: the copy was disarmed and nobody refreshed it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_that_leads_into_a_copy_due_for_refresh_leaves_the_refresh_due() -> Result<()> {
        let clock = ManualClock::starting_now();
        let cache = PortableCache::builder()
            .clock(clock.clone())
            .eager_refresh(0.5)
            .build()?;
        let options = options_in(&EntryOptions::new().relative(10 * SEC));
        let (followed, next) = cache
            .call(move |s| {
                let cache = s.guest.corral_cache_cache();
                let store = &mut s.store;
                let load = leads(cache, store, options, "the first caller")?;
                let follower = follows(cache, store, options, "the second caller")?;
                // The key is written meanwhile; past half its life, its refresh is due.
                if let Err(e) = cache.call_set(&mut *store, "k", b"written", options)? {
                    return Ok(Err(e));
                }
                clock.advance(6 * SEC);
                // The holder gives its load up: the follower leads.
                load.resource_drop(&mut *store)?;
                Ok(Ok(asked_then_next(s, follower, options)?))
            })
            .await?;
        assert_eq!(
            value(&followed),
            Some(Ok(&b"written"[..])),
            "the follower's answer"
        );
        assert_eq!(next, r#"refresh, serving Ok("written")"#, "the next caller");
        Ok(())
    }

    /// A follower of the instance's own refresh begins again once it ended, and L1 holds
    /// a copy (another caller's load) due for its eager refresh by then: the follower is
    /// served the copy, which stays armed, and the next caller starts the refresh. Before, the follower's hit
    /// disarmed the copy and began a refresh whose load it dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_of_a_refresh_served_from_l1_leaves_the_copys_refresh_due() -> Result<()> {
        let clock = ManualClock::starting_now();
        let cache = PortableCache::builder()
            .clock(clock.clone())
            .eager_refresh(0.5)
            .lock_wait(SEC)
            .build()?;
        let entry = EntryOptions::new().relative(10 * SEC);
        cache.get_or_set("k", entry, |_| Ok(b"old".to_vec())).await?;
        let options = options_in(&entry);
        let (followed, next) = cache
            .call(move |s| {
                let cache = s.guest.corral_cache_cache();
                let store = &mut s.store;
                clock.advance(6 * SEC);
                let Ok(Begun::Refresh((_, refresh))) =
                    cache.call_begin(&mut *store, "k", options, false, &[])?
                else {
                    return Err(wasmtime::format_err!("no refresh was due"));
                };
                // Past the entry's end: the next caller meets the refresh's lock.
                clock.advance(5 * SEC);
                let Ok(Begun::Wait(follower)) = cache.call_begin(&mut *store, "k", options, false, &[])?
                else {
                    refresh.resource_drop(&mut *store)?;
                    return Err(wasmtime::format_err!("the caller did not follow the refresh"));
                };
                // The refresh finds its entry gone; another caller loads the key, and,
                // past half its life, that copy is due for its refresh when the follower
                // asks.
                let _ = cache
                    .load()
                    .call_complete(&mut *store, refresh, b"refreshed", true)?;
                let load = leads(cache, store, options, "the key's next caller")?;
                if let Err(e) = cache.load().call_complete(&mut *store, load, b"loaded", true)? {
                    return Ok(Err(e));
                }
                clock.advance(6 * SEC);
                Ok(Ok(asked_then_next(s, follower, options)?))
            })
            .await?;
        assert_eq!(
            value(&followed),
            Some(Ok(&b"loaded"[..])),
            "the follower's answer"
        );
        assert_eq!(next, r#"refresh, serving Ok("loaded")"#, "the next caller");
        Ok(())
    }
}
