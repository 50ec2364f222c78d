//! The portable body in wasmtime: the host side of the component's `cache` and `lock`
//! exports. The component runs the same `corral-core` machines against these imports
//! (`l1`, `l2`, `local-lock`, `loader`, the lock `table`) with time from `wasi:clocks`,
//! which this module injects from the cache's [`Clock`]. This path is for portability
//! (the same `.wasm` runs in jco, or composed into a wasm platform), not speed: calls are
//! synchronous on a blocking thread, one instance, one call at a time.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use wasmtime_wasi::{HostWallClock, WasiCtx};

use crate::bindings::corral::cache::{l1, l2, loader, local_lock, types};
use crate::bindings::corral::lock::table;
use crate::bindings::corral::lock::types::Held;
use crate::bindings::exports::corral::cache::cache as wcache;
use crate::clock::{Clock, SystemClock};
use crate::l2::{L2Store, MemoryL2};
use crate::options::{EntryOptions, duration_ms};
use crate::policy::{
    PORTABLE_BUDGET_TICKS, Policy, Slot, default_limits, from_wit, instantiate_with, loaded, options_in, trap,
};
use crate::semaphore::{KeyPermit, KeyedSemaphore};
use crate::{Error, ErrorKind, Result};

type Loader = Box<dyn FnMut(&str) -> std::result::Result<Vec<u8>, String> + Send>;
type ShouldCache = Box<dyn Fn(&[u8]) -> bool + Send>;

/// What the imports of one portable instance act on.
#[derive(Default)]
pub(crate) struct Imports {
    backend: Option<Backend>,
    permits: HashMap<String, KeyPermit>,
    loader: Option<Loader>,
    should_cache: Option<ShouldCache>,
}

struct Backend {
    runtime: tokio::runtime::Handle,
    clock: Arc<dyn Clock>,
    l1: moka::sync::Cache<String, l1::L1Entry>,
    l2: Arc<dyn L2Store>,
    semaphore: KeyedSemaphore,
    table: Arc<Mutex<HashMap<String, Held>>>,
}

impl Imports {
    fn backend(&self) -> std::result::Result<&Backend, types::Error> {
        self.backend
            .as_ref()
            .ok_or_else(|| types::Error::Other("this instance runs no portable cache".into()))
    }
}

fn to_wit(e: Error) -> types::Error {
    match e.kind() {
        ErrorKind::Unavailable | ErrorKind::Timeout => types::Error::Unavailable(e.to_string()),
        _ => types::Error::Other(e.to_string()),
    }
}

impl types::Host for crate::policy::GuestState {}

impl l1::Host for crate::policy::GuestState {
    fn get(&mut self, key: String) -> Option<l1::L1Entry> {
        self.portable.backend.as_ref()?.l1.get(&key)
    }

    fn set(&mut self, key: String, entry: l1::L1Entry) {
        if let Some(b) = &self.portable.backend {
            b.l1.insert(key, entry);
        }
    }

    fn delete(&mut self, key: String) {
        if let Some(b) = &self.portable.backend {
            b.l1.invalidate(&key);
        }
    }
}

impl l2::Host for crate::policy::GuestState {
    fn get(&mut self, key: String) -> std::result::Result<Option<Vec<u8>>, types::Error> {
        let b = self.portable.backend()?;
        b.runtime
            .block_on(b.l2.peek(&key))
            .map(|v| v.map(|b| b.to_vec()))
            .map_err(to_wit)
    }

    fn set(&mut self, key: String, value: Vec<u8>, ttl_ms: u64) -> std::result::Result<(), types::Error> {
        let b = self.portable.backend()?;
        b.runtime
            .block_on(b.l2.write(&key, value.into(), ttl_ms))
            .map_err(to_wit)
    }

    fn delete(&mut self, key: String) -> std::result::Result<bool, types::Error> {
        let b = self.portable.backend()?;
        b.runtime.block_on(b.l2.delete(&key)).map_err(to_wit)
    }

    fn delete_if_equal(&mut self, key: String, expected: Vec<u8>) -> std::result::Result<bool, types::Error> {
        let b = self.portable.backend()?;
        b.runtime
            .block_on(b.l2.delete_if_equal(&key, expected.into()))
            .map_err(to_wit)
    }

    fn replace_if_equal(
        &mut self,
        key: String,
        expected: Vec<u8>,
        value: Vec<u8>,
        ttl_ms: u64,
    ) -> std::result::Result<bool, types::Error> {
        let b = self.portable.backend()?;
        b.runtime
            .block_on(b.l2.replace_if_equal(&key, expected.into(), value.into(), ttl_ms))
            .map_err(to_wit)
    }

    fn try_lock(&mut self, key: String, ttl_ms: u64) -> std::result::Result<Option<String>, types::Error> {
        let b = self.portable.backend()?;
        let owner = crate::lock_token();
        let taken = b
            .runtime
            .block_on(b.l2.try_lock(&key, &owner, ttl_ms))
            .map_err(to_wit)?;
        Ok(taken.then_some(owner))
    }

    fn release_lock(&mut self, key: String, owner: String) -> std::result::Result<bool, types::Error> {
        let b = self.portable.backend()?;
        b.runtime
            .block_on(b.l2.release_lock(&key, &owner))
            .map_err(to_wit)
    }

    fn wait_landing(&mut self, key: String, until_ms: u64) {
        let Ok(b) = self.portable.backend() else { return };
        let pause = Duration::from_millis(until_ms.saturating_sub(b.clock.now_ms()));
        b.runtime.block_on(async {
            let mut watch = b.l2.watch_landing(&key).await;
            tokio::select! {
                () = watch.landed() => {}
                () = tokio::time::sleep(pause) => {}
            }
        });
    }

    fn announce_landing(&mut self, key: String) {
        if let Ok(b) = self.portable.backend() {
            let _ = b.runtime.block_on(b.l2.announce_landing(&key));
        }
    }
}

impl local_lock::Host for crate::policy::GuestState {
    fn acquire(&mut self, key: String, timeout_ms: u64) -> bool {
        let Ok(b) = self.portable.backend() else {
            return false;
        };
        let permit = b
            .runtime
            .block_on(b.semaphore.acquire(&key, Duration::from_millis(timeout_ms)));
        let acquired = permit.acquired();
        if acquired {
            self.portable.permits.insert(key, permit);
        }
        acquired
    }

    fn release(&mut self, key: String) {
        self.portable.permits.remove(&key);
    }
}

impl loader::Host for crate::policy::GuestState {
    fn load(&mut self, key: String) -> std::result::Result<Vec<u8>, String> {
        match self.portable.loader.as_mut() {
            Some(load) => load(&key),
            None => Err("no loader was given".into()),
        }
    }

    fn should_cache(&mut self, _key: String, value: Vec<u8>) -> bool {
        self.portable.should_cache.as_ref().is_none_or(|p| p(&value))
    }
}

impl table::Host for crate::policy::GuestState {
    fn get(&mut self, key: String) -> Option<Held> {
        self.portable.backend.as_ref()?.table.lock().get(&key).cloned()
    }

    fn compare_and_swap(&mut self, key: String, expected: Option<Held>, new: Held) -> bool {
        let Some(b) = &self.portable.backend else {
            return false;
        };
        let mut table = b.table.lock();
        if table.get(&key) != expected.as_ref() {
            return false;
        }
        table.insert(key, new);
        true
    }

    fn compare_and_delete(&mut self, key: String, expected: Held) -> bool {
        let Some(b) = &self.portable.backend else {
            return false;
        };
        let mut table = b.table.lock();
        if table.get(&key) != Some(&expected) {
            return false;
        }
        table.remove(&key);
        true
    }
}

impl crate::bindings::corral::lock::types::Host for crate::policy::GuestState {}

/// The cache's clock as the guest's `wasi:clocks/wall-clock`.
struct WallClock(Arc<dyn Clock>);

impl HostWallClock for WallClock {
    fn resolution(&self) -> Duration {
        Duration::from_millis(1)
    }

    fn now(&self) -> Duration {
        Duration::from_millis(self.0.now_ms())
    }
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
    slot: Arc<Mutex<Slot>>,
    l2: Arc<dyn L2Store>,
}

impl fmt::Debug for PortableCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PortableCache")
            .field("l2", &self.l2.name())
            .finish_non_exhaustive()
    }
}

/// Configures a [`PortableCache`].
#[derive(Debug)]
#[must_use]
pub struct PortableBuilder {
    clock: Arc<dyn Clock>,
    #[cfg(feature = "redis")]
    redis: Option<crate::l2::RedisOptions>,
    default_sliding: Duration,
    max_key_bytes: u32,
    max_value_bytes: u32,
}

impl Default for PortableBuilder {
    fn default() -> Self {
        PortableBuilder {
            clock: Arc::new(SystemClock),
            #[cfg(feature = "redis")]
            redis: None,
            default_sliding: Duration::from_secs(20 * 60),
            max_key_bytes: default_limits().max_key_bytes,
            max_value_bytes: default_limits().max_value_bytes,
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
    pub fn redis_options(mut self, options: crate::l2::RedisOptions) -> Self {
        self.redis = Some(options);
        self
    }

    /// The sliding expiration of entries whose options name none.
    pub fn default_sliding(mut self, idle: Duration) -> Self {
        self.default_sliding = idle;
        self
    }

    /// The longest key, in UTF-8 bytes (default 1024).
    pub fn max_key_bytes(mut self, n: u32) -> Self {
        self.max_key_bytes = n;
        self
    }

    /// The largest value, in bytes (default 16 MiB).
    pub fn max_value_bytes(mut self, n: u32) -> Self {
        self.max_value_bytes = n;
        self
    }

    /// Instantiates the component with its imports; call inside a Tokio runtime.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] outside a runtime or for bad settings;
    /// [`ErrorKind::Guest`] if the component cannot be loaded.
    pub fn build(self) -> Result<PortableCache> {
        crate::require_runtime("the portable cache")?;
        let runtime = tokio::runtime::Handle::current();
        let mut limits = default_limits();
        limits.default_sliding_ms = duration_ms(self.default_sliding);
        limits.max_key_bytes = self.max_key_bytes;
        limits.max_value_bytes = self.max_value_bytes;
        let policy = Policy::load(limits)?;
        let l2: Arc<dyn L2Store> = match () {
            #[cfg(feature = "redis")]
            () if self.redis.is_some() => Arc::new(crate::l2::RedisL2::connect(
                self.redis.as_ref().expect("checked"),
                &policy,
            )?),
            () => Arc::new(MemoryL2::new(policy, self.clock.clone(), 30_000)),
        };
        let mut wasi = WasiCtx::builder();
        wasi.wall_clock(WallClock(self.clock.clone()));
        let imports = Imports {
            backend: Some(Backend {
                runtime,
                clock: self.clock,
                l1: moka::sync::Cache::builder().max_capacity(100_000).build(),
                l2: l2.clone(),
                semaphore: KeyedSemaphore::new(),
                table: Arc::default(),
            }),
            ..Imports::default()
        };
        let mut slot = instantiate_with(loaded()?, wasi.build(), imports)?;
        slot.store.set_epoch_deadline(PORTABLE_BUDGET_TICKS);
        let settings = wcache::Settings {
            limits,
            l1_ttl_ms: 5 * 60_000,
            lock_wait_ms: 5_000,
            lock_ttl_ms: 30_000,
        };
        slot.guest
            .corral_cache_cache()
            .call_configure(&mut slot.store, settings)
            .map_err(trap)?
            .map_err(from_wit)?;
        Ok(PortableCache {
            slot: Arc::new(Mutex::new(slot)),
            l2,
        })
    }
}

impl PortableCache {
    /// A builder: in-memory L2, system clock.
    pub fn builder() -> PortableBuilder {
        PortableBuilder::default()
    }

    /// The L2 store the imports act on.
    pub fn l2(&self) -> &dyn L2Store {
        &*self.l2
    }

    /// Runs `f` on the instance, on a blocking thread (the imports block on I/O).
    async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Slot) -> wasmtime::Result<std::result::Result<R, types::Error>> + Send + 'static,
    ) -> Result<R> {
        let slot = self.slot.clone();
        tokio::task::spawn_blocking(move || {
            let mut slot = slot.lock();
            slot.store.set_epoch_deadline(PORTABLE_BUDGET_TICKS);
            f(&mut slot)
        })
        .await
        .map_err(|e| Error::guest("the portable call's thread failed", e))?
        .map_err(trap)?
        .map_err(from_wit)
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

    /// Get-or-set in the component: `loader` produces the value on a miss (once),
    /// `should_cache` judges it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key or options; [`ErrorKind::Loader`]
    /// with the loader's text when it failed.
    pub async fn get_or_set(
        &self,
        key: &str,
        options: EntryOptions,
        bypass: bool,
        loader: impl FnMut(&str) -> std::result::Result<Vec<u8>, String> + Send + 'static,
        should_cache: impl Fn(&[u8]) -> bool + Send + 'static,
    ) -> Result<Bytes> {
        let key = key.to_owned();
        let options = options_in(&options);
        let v = self
            .call(move |s| {
                s.store.data_mut().portable.loader = Some(Box::new(loader));
                s.store.data_mut().portable.should_cache = Some(Box::new(should_cache));
                let out = s
                    .guest
                    .corral_cache_cache()
                    .call_get_or_set(&mut s.store, &key, options, bypass);
                s.store.data_mut().portable.loader = None;
                s.store.data_mut().portable.should_cache = None;
                out
            })
            .await?;
        Ok(Bytes::from(v))
    }

    /// The in-memory lock provider, in the component: takes `key` for `owner`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming `key` or `ttl`.
    pub async fn try_lock(&self, key: &str, owner: &str, ttl: Duration) -> Result<bool> {
        let (key, owner, ttl_ms) = (key.to_owned(), owner.to_owned(), duration_ms(ttl));
        self.call(move |s| {
            s.guest
                .corral_lock_lock()
                .call_try_lock(&mut s.store, &key, &owner, ttl_ms)
        })
        .await
    }

    /// Releases `key` if `owner` holds it.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`] only.
    pub async fn unlock(&self, key: &str, owner: &str) -> Result<bool> {
        let (key, owner) = (key.to_owned(), owner.to_owned());
        self.call(move |s| s.guest.corral_lock_lock().call_unlock(&mut s.store, &key, &owner))
            .await
    }

    /// Whether `owner` holds `key`.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`] only.
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
    /// [`ErrorKind::Guest`] only.
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
