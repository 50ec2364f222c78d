//! The guest component, loaded once, and the calls into its `policy` export.
//!
//! The component is compiled once per process (and cached on disk by wasmtime between
//! processes). Calls are synchronous and short; each takes an idle instance from a
//! small pool (one `Store` each), so concurrent callers never share a `Store`.

use std::fmt;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Config, Engine, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::corral::cache::types;
use crate::bindings::exports::corral::cache::policy as wit;
use crate::bindings::{Guest, GuestPre};
use crate::options::{EntryMeta, EntryOptions};
use crate::{Error, ErrorKind, Result};

/// The guest component's bytes: `guest/component` built for `wasm32-wasip2`.
pub const GUEST_WASM: &[u8] = include_bytes!(env!("CORRAL_GUEST_WASM"));

/// Where the build put the guest component (the file [`GUEST_WASM`] was read from).
pub const GUEST_WASM_PATH: &str = env!("CORRAL_GUEST_WASM");

/// How often the engine's epoch advances.
const EPOCH_TICK: std::time::Duration = std::time::Duration::from_millis(10);

/// The budget of one pure policy call, in epoch ticks (1 s: a pure decision takes
/// microseconds; only a runaway guest reaches it).
const CALL_BUDGET_TICKS: u64 = 100;

/// The budget of one portable call, in ticks (1 hour): its imports may wait on a loader
/// or a lock for as long as the caller allows, and that time counts.
pub(crate) const PORTABLE_BUDGET_TICKS: u64 = 360_000;

/// How many idle instances the pool keeps; more are created under load and dropped after.
const MAX_IDLE: usize = 64;

pub(crate) struct GuestState {
    wasi: WasiCtx,
    table: ResourceTable,
    /// What the portable body's imports act on (unused by the native body's calls).
    pub(crate) portable: crate::portable::Imports,
}

impl WasiView for GuestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

pub(crate) struct Loaded {
    pub(crate) engine: Engine,
    pub(crate) pre: GuestPre<GuestState>,
}

/// Compiles the component and links WASI, once per process.
pub(crate) fn loaded() -> Result<&'static Loaded> {
    static LOADED: OnceLock<std::result::Result<Loaded, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| load().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| {
            Error::new(
                ErrorKind::Guest,
                format!("loading the guest component failed: {e}"),
            )
        })
}

fn load() -> wasmtime::Result<Loaded> {
    let mut config = Config::new();
    // A cache across processes: the multi-process tools and tests compile once.
    if let Ok(cache) = wasmtime::Cache::from_file(None) {
        config.cache(Some(cache));
    }
    // A guest that runs away (a bug) traps at its deadline instead of hanging a thread.
    config.epoch_interruption(true);
    let engine = Engine::new(&config)?;
    let ticker = engine.clone();
    std::thread::Builder::new()
        .name("corral-epoch".into())
        .spawn(move || {
            loop {
                std::thread::sleep(EPOCH_TICK);
                ticker.increment_epoch();
            }
        })?;
    let component = Component::new(&engine, GUEST_WASM)?;
    let mut linker = Linker::<GuestState>::new(&engine);
    // std on wasip2 imports wasi:cli and wasi:io (stderr for panics); the policy itself
    // needs nothing.
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    // The portable body's imports (the native body links them too: one component).
    Guest::add_to_linker::<_, wasmtime::component::HasSelf<_>>(&mut linker, |s| s)?;
    let pre = GuestPre::new(linker.instantiate_pre(&component)?)?;
    Ok(Loaded { engine, pre })
}

pub(crate) struct Slot {
    pub(crate) store: Store<GuestState>,
    pub(crate) guest: Guest,
}

/// A handle to the guest's cache decisions. Cheap to clone.
#[derive(Clone)]
pub struct Policy {
    inner: Arc<Inner>,
}

struct Inner {
    loaded: &'static Loaded,
    slots: Mutex<Vec<Slot>>,
    limits: types::Limits,
    header_len: usize,
    read_script: String,
    delete_if_equal_script: String,
    replace_if_equal_script: String,
    grace_ms: u64,
    lock_scripts: wlock::LockScripts,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

/// The limits of one cache (see the builder).
pub(crate) use types::Limits;

/// The default limits: 1 KiB keys, 16 MiB values, 20 minutes of default sliding.
pub(crate) fn default_limits() -> Limits {
    Limits {
        max_key_bytes: 1024,
        max_value_bytes: 16 * 1024 * 1024,
        default_sliding_ms: 20 * 60 * 1000,
    }
}

pub(crate) use crate::bindings::corral::lock::types::Held;
pub(crate) use crate::bindings::exports::corral::cache::flight as wflight;
pub(crate) use crate::bindings::exports::corral::lock::policy as wlock;
pub(crate) use types::EntryMeta as WitMeta;
pub(crate) use wit::{Freshness as WitFreshness, Plan, ReadOutcome};

impl Policy {
    /// Loads the guest and checks `limits` with it.
    pub(crate) fn load(limits: Limits) -> Result<Self> {
        let loaded = loaded()?;
        let mut slot = instantiate(loaded)?;
        let p = slot.guest.corral_cache_policy();
        let checked = p.call_check_limits(&mut slot.store, limits).map_err(trap)?;
        checked.map_err(from_wit)?;
        let header_len = p.call_header_len(&mut slot.store).map_err(trap)? as usize;
        let read_script = p.call_redis_read_script(&mut slot.store).map_err(trap)?;
        let delete_if_equal_script = p
            .call_redis_delete_if_equal_script(&mut slot.store)
            .map_err(trap)?;
        let replace_if_equal_script = p
            .call_redis_replace_if_equal_script(&mut slot.store)
            .map_err(trap)?;
        let grace_ms = p.call_store_ttl_grace_ms(&mut slot.store).map_err(trap)?;
        let lock_scripts = slot
            .guest
            .corral_lock_policy()
            .call_scripts(&mut slot.store)
            .map_err(trap)?;
        Ok(Policy {
            inner: Arc::new(Inner {
                loaded,
                slots: Mutex::new(vec![slot]),
                limits,
                header_len,
                read_script,
                delete_if_equal_script,
                replace_if_equal_script,
                grace_ms,
                lock_scripts,
            }),
        })
    }

    fn call<R>(&self, f: impl FnOnce(&mut Slot) -> wasmtime::Result<R>) -> Result<R> {
        self.call_with_budget(CALL_BUDGET_TICKS, f)
    }

    fn call_with_budget<R>(&self, ticks: u64, f: impl FnOnce(&mut Slot) -> wasmtime::Result<R>) -> Result<R> {
        let idle = self.inner.slots.lock().pop();
        let mut slot = match idle {
            Some(slot) => slot,
            None => instantiate(self.inner.loaded)?,
        };
        slot.store.set_epoch_deadline(ticks);
        // A trapped instance is poisoned: it is dropped, not returned to the pool.
        let out = f(&mut slot).map_err(trap)?;
        let mut slots = self.inner.slots.lock();
        if slots.len() < MAX_IDLE {
            slots.push(slot);
        }
        Ok(out)
    }

    /// Checks a key against the contract (non-empty, not only white space, within the
    /// length limit).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming `key`.
    pub fn validate_key(&self, key: &str) -> Result<()> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_validate_key(&mut s.store, key, limits)
        })?
        .map_err(from_wit)
    }

    /// Checks `meta` at `now_ms`, applying a read's sliding touch.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`] if the component fails.
    pub fn check(&self, meta: &EntryMeta, now_ms: u64) -> Result<Freshness> {
        let meta = meta_in(meta);
        let f = self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_check(&mut s.store, meta, now_ms)
        })?;
        Ok(match f {
            WitFreshness::Fresh((meta, moved)) => Freshness::Fresh {
                meta: meta_out(meta),
                moved,
            },
            WitFreshness::Expired => Freshness::Expired,
        })
    }

    pub(crate) fn plan_set(
        &self,
        key: &str,
        value_len: usize,
        options: &EntryOptions,
        now_ms: u64,
    ) -> Result<Plan> {
        let limits = self.inner.limits;
        let options = options_in(options);
        self.call(|s| {
            s.guest.corral_cache_policy().call_plan_set(
                &mut s.store,
                key,
                value_len as u64,
                options,
                now_ms,
                limits,
            )
        })?
        .map_err(from_wit)
    }

    /// Reads stored bytes at `now_ms`: fresh (with the touch to write back), expired, or corrupt.
    pub(crate) fn read(&self, stored: &[u8], now_ms: u64) -> Result<ReadOutcome> {
        let limits = self.inner.limits;
        let head = &stored[..stored.len().min(self.inner.header_len)];
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_read(&mut s.store, head, stored.len() as u64, now_ms, limits)
        })
    }

    /// Decodes stored bytes without judging them; corrupt bytes are an error.
    pub(crate) fn decode(&self, stored: &[u8]) -> Result<(EntryMeta, usize, usize)> {
        let limits = self.inner.limits;
        let head = &stored[..stored.len().min(self.inner.header_len)];
        let d = self
            .call(|s| {
                s.guest
                    .corral_cache_policy()
                    .call_decode(&mut s.store, head, stored.len() as u64, limits)
            })?
            .map_err(from_wit)?;
        Ok((meta_out(d.meta), d.value_offset as usize, d.value_len as usize))
    }

    /// Starts a get-or-set flight: judges key and options, returns the first action.
    pub(crate) fn flight_start(
        &self,
        key: &str,
        options: &EntryOptions,
        config: wflight::FlightConfig,
        now_ms: u64,
    ) -> Result<(wflight::FlightState, wflight::Action)> {
        let limits = self.inner.limits;
        let options = options_in(options);
        self.call(|s| {
            s.guest
                .corral_cache_flight()
                .call_start(&mut s.store, key, options, config, now_ms, limits)
        })?
        .map_err(from_wit)
    }

    /// Feeds one event to a flight; returns the new state and the next action.
    pub(crate) fn flight_step(
        &self,
        state: wflight::FlightState,
        event: wflight::Event,
        now_ms: u64,
    ) -> Result<(wflight::FlightState, wflight::Action)> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_cache_flight()
                .call_step(&mut s.store, state, event, now_ms, limits)
        })
    }

    /// Whether an abandoned flight holds the lock (and so owes a release).
    pub(crate) fn flight_abandon(&self, state: wflight::FlightState) -> Result<bool> {
        self.call(|s| s.guest.corral_cache_flight().call_abandon(&mut s.store, state))
    }

    /// Until when an entry filled into L1 at `now_ms` may be served from L1.
    pub(crate) fn l1_deadline(&self, meta: WitMeta, now_ms: u64, l1_ttl_ms: u64) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_cache_flight()
                .call_l1_deadline(&mut s.store, meta, now_ms, l1_ttl_ms)
        })
    }

    /// Checks a lock request (key rules, positive TTL).
    pub(crate) fn lock_check_request(&self, key: &str, ttl_ms: u64) -> Result<()> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_check_request(&mut s.store, key, ttl_ms, limits)
        })?
        .map_err(from_wit)
    }

    /// The entry to store if the lock is free at `now_ms`.
    pub(crate) fn lock_try(
        &self,
        current: Option<&Held>,
        owner: &str,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Result<Option<Held>> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_try_lock(&mut s.store, current, owner, ttl_ms, now_ms)
        })
    }

    pub(crate) fn lock_is_expired(&self, current: Option<&Held>, now_ms: u64) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_is_expired(&mut s.store, current, now_ms)
        })
    }

    pub(crate) fn lock_is_locked_by(&self, current: Option<&Held>, owner: &str, now_ms: u64) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_is_locked_by(&mut s.store, current, owner, now_ms)
        })
    }

    pub(crate) fn lock_sweepable(&self, entry: &Held, now_ms: u64) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_sweepable(&mut s.store, entry, now_ms)
        })
    }

    pub(crate) fn lock_next_try(&self, attempt: u32, now_ms: u64, deadline_ms: u64) -> Result<Option<u64>> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_next_try(&mut s.store, attempt, now_ms, deadline_ms)
        })
    }

    pub(crate) fn lock_decide(
        &self,
        acquired: u32,
        servers: u32,
        ttl_ms: u64,
        elapsed_ms: u64,
    ) -> Result<Option<u64>> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_decide(&mut s.store, acquired, servers, ttl_ms, elapsed_ms)
        })
    }

    pub(crate) fn lock_has_quorum(&self, count: u32, servers: u32) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_has_quorum(&mut s.store, count, servers)
        })
    }

    pub(crate) fn lock_renew_after(&self, ttl_ms: u64) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_renew_after_ms(&mut s.store, ttl_ms)
        })
    }

    pub(crate) fn lock_fencing_token(&self, per_server: &[u64]) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_fencing_token(&mut s.store, per_server)
        })
    }

    /// The lock scripts (acquire with fencing, release, extend).
    pub(crate) fn lock_scripts(&self) -> &wlock::LockScripts {
        &self.inner.lock_scripts
    }

    /// The Lua a Redis store runs to read and touch in one round trip.
    pub(crate) fn redis_read_script(&self) -> &str {
        &self.inner.read_script
    }

    /// The Lua of an owner-checked delete (corrupt-entry removal, lock release).
    pub(crate) fn redis_delete_if_equal_script(&self) -> &str {
        &self.inner.delete_if_equal_script
    }

    /// The Lua of a compare-and-replace (the portable body's touch write-back).
    pub(crate) fn redis_replace_if_equal_script(&self) -> &str {
        &self.inner.replace_if_equal_script
    }

    /// The grace a store TTL gets past the expiry moment.
    pub(crate) fn store_ttl_grace_ms(&self) -> u64 {
        self.inner.grace_ms
    }

    /// Idle instances in the pool (for diagnostics).
    pub fn idle_instances(&self) -> usize {
        self.inner.slots.lock().len()
    }
}

/// An entry checked at a moment (see [`Policy::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Freshness {
    /// Fresh, with the metadata after a sliding touch.
    Fresh {
        /// The metadata after the touch.
        meta: EntryMeta,
        /// Whether the touch moved the expiry.
        moved: bool,
    },
    /// Expired.
    Expired,
}

fn instantiate(loaded: &Loaded) -> Result<Slot> {
    instantiate_with(
        loaded,
        WasiCtx::builder().build(),
        crate::portable::Imports::default(),
    )
}

/// An instance with its own WASI context (clocks) and portable imports.
pub(crate) fn instantiate_with(
    loaded: &Loaded,
    wasi: WasiCtx,
    portable: crate::portable::Imports,
) -> Result<Slot> {
    let state = GuestState {
        wasi,
        table: ResourceTable::new(),
        portable,
    };
    let mut store = Store::new(&loaded.engine, state);
    // Instantiation runs guest code too; every call sets its own budget afterwards.
    store.set_epoch_deadline(CALL_BUDGET_TICKS);
    let guest = loaded
        .pre
        .instantiate(&mut store)
        .map_err(|e| Error::guest("instantiating the guest component failed", e))?;
    Ok(Slot { store, guest })
}

pub(crate) fn trap(e: wasmtime::Error) -> Error {
    Error::guest("the guest component trapped", e)
}

pub(crate) fn from_wit(e: types::Error) -> Error {
    match e {
        types::Error::InvalidArgument(a) => Error::invalid_argument(a.name, a.reason),
        types::Error::Unavailable(m) => Error::new(ErrorKind::Unavailable, m),
        types::Error::Corrupt(m) => Error::new(ErrorKind::Corrupt, m),
        types::Error::LoaderFailed(m) => Error::new(ErrorKind::Loader, format!("the loader failed: {m}")),
        types::Error::Other(m) => Error::new(ErrorKind::Guest, m),
    }
}

pub(crate) fn options_in(o: &EntryOptions) -> types::EntryOptions {
    types::EntryOptions {
        absolute_ms: o.absolute_ms,
        relative_ms: o.relative_ms,
        sliding_ms: o.sliding_ms,
    }
}

pub(crate) fn meta_in(m: &EntryMeta) -> types::EntryMeta {
    types::EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
    }
}

pub(crate) fn meta_out(m: types::EntryMeta) -> EntryMeta {
    EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_past_its_budget_traps_into_a_typed_error_and_the_pool_recovers() {
        let policy = Policy::load(default_limits()).unwrap();
        let limits = policy.inner.limits;
        // A budget of 0 ticks: the first epoch check in the guest traps.
        let e = policy
            .call_with_budget(0, |s| {
                s.guest
                    .corral_cache_policy()
                    .call_validate_key(&mut s.store, "k", limits)
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Guest);
        assert!(e.to_string().contains("trapped"), "{e}");
        assert!(
            policy.validate_key("k").is_ok(),
            "a fresh instance serves the next call"
        );
        assert!(policy.validate_key(" ").is_err());
    }
}
