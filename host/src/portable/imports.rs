//! The host side of the portable body's imports (`l1`, `l2`, `flights`, `loader`, the
//! lock `table`), as wasmtime's wasi-keyvalue does it: a shared [`Backend`], a per-call
//! [`CallState`], and one `add_to_linker`.
//!
//! Imports block on the stores: a portable call runs on a blocking thread. A call whose
//! caller went away traps at its next loader return (contract §5.11), and every flight
//! it led is handed on when the call ends.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use wasmtime::component::{HasData, Linker, ResourceTable};
use wasmtime_wasi::{HostWallClock, WasiCtx, WasiCtxView, WasiView};

use crate::cache::registry::{LeaderGuard, Registry};
use crate::clock::Clock;
use crate::guest::bindings::Guest;
use crate::guest::bindings::corral::cache::flights::{self, Joined};
use crate::guest::bindings::corral::cache::{l1, l2, loader, types};
use crate::guest::bindings::corral::lock::table;
use crate::guest::bindings::corral::lock::types::Held;
use crate::guest::convert::to_wit;
use crate::store::Stores;

/// What a flight's followers get in the portable body: what `flights.finish` passed.
pub(crate) type WitOutcome = Result<Vec<u8>, types::Error>;

/// The loader of one portable get-or-set.
pub(crate) type Loader = Box<dyn FnMut(&str) -> Result<Vec<u8>, String> + Send>;
/// The caching verdict of one portable get-or-set.
pub(crate) type ShouldCache = Box<dyn Fn(&[u8]) -> bool + Send>;

/// What every instance of one portable cache shares.
pub(crate) struct Backend {
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) l1: moka::sync::Cache<String, l1::L1Entry>,
    pub(crate) stores: Stores,
    pub(crate) registry: Registry<WitOutcome>,
    pub(crate) table: Mutex<HashMap<String, Held>>,
}

/// What one call brings: its loader, and the flights it leads.
#[derive(Default)]
pub(crate) struct CallState {
    pub(crate) loader: Option<Loader>,
    pub(crate) should_cache: Option<ShouldCache>,
    /// Set when the caller went away: the call traps at its next loader return.
    pub(crate) cancelled: Arc<AtomicBool>,
    /// The flights this call leads, until it finishes them.
    pub(crate) leading: HashMap<String, LeaderGuard<WitOutcome>>,
    /// The flight locks this call holds (key, owner token), until it releases them.
    pub(crate) locks: HashMap<String, String>,
}

impl Backend {
    /// Ends a call: a flight lock it still holds (it trapped or was cancelled mid-flight)
    /// is released, owner-checked, and the release announced, so the process that takes
    /// over need not wait out the lock's TTL; then the flights it led are handed on.
    pub(crate) fn end_call(&self, call: CallState) {
        for (key, owner) in &call.locks {
            let released = self.runtime.block_on(async {
                self.stores.flight_lock.release(key, owner).await?;
                self.stores.notifications.announce(key).await
            });
            if let Err(e) = released {
                tracing::warn!(key, error = %e, "releasing an abandoned flight lock failed; it expires by its TTL");
            }
        }
        drop(call);
    }
}

/// The store data of a portable instance.
pub(crate) struct PortableState {
    wasi: WasiCtx,
    resources: ResourceTable,
    pub(crate) backend: Arc<Backend>,
    pub(crate) call: CallState,
}

impl fmt::Debug for PortableState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PortableState").finish_non_exhaustive()
    }
}

impl PortableState {
    /// An instance's data: the guest reads `backend.clock` as `wasi:clocks/wall-clock`.
    pub(crate) fn new(backend: Arc<Backend>) -> Self {
        let mut wasi = WasiCtx::builder();
        wasi.wall_clock(WallClock(backend.clock.clone()));
        PortableState {
            wasi: wasi.build(),
            resources: ResourceTable::new(),
            backend,
            call: CallState::default(),
        }
    }
}

impl WasiView for PortableState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.resources,
        }
    }
}

struct Portable;

impl HasData for Portable {
    type Data<'a> = &'a mut PortableState;
}

/// Links WASI and the portable imports.
pub(crate) fn add_to_linker(linker: &mut Linker<PortableState>) -> wasmtime::Result<()> {
    wasmtime_wasi::p2::add_to_linker_sync(linker)?;
    Guest::add_to_linker::<_, Portable>(linker, |s| s)
}

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

impl types::Host for &mut PortableState {}

impl crate::guest::bindings::corral::lock::types::Host for &mut PortableState {}

impl l1::Host for &mut PortableState {
    fn get(&mut self, key: String) -> Option<l1::L1Entry> {
        self.backend.l1.get(&key)
    }

    fn set(&mut self, key: String, entry: l1::L1Entry) {
        self.backend.l1.insert(key, entry);
    }

    fn delete(&mut self, key: String) {
        self.backend.l1.invalidate(&key);
    }
}

impl l2::Host for &mut PortableState {
    fn get(&mut self, key: String) -> Result<Option<Vec<u8>>, types::Error> {
        let b = &self.backend;
        b.runtime
            .block_on(b.stores.entries.get(&key))
            .map(|v| v.map(|b| b.to_vec()))
            .map_err(|e| to_wit(&e))
    }

    fn set(&mut self, key: String, value: Vec<u8>, ttl_ms: u64) -> Result<(), types::Error> {
        let b = &self.backend;
        b.runtime
            .block_on(b.stores.entries.set(&key, value.into(), ttl_ms))
            .map_err(|e| to_wit(&e))
    }

    fn delete(&mut self, key: String) -> Result<bool, types::Error> {
        let b = &self.backend;
        b.runtime
            .block_on(b.stores.entries.delete(&key))
            .map_err(|e| to_wit(&e))
    }

    fn delete_if_equal(&mut self, key: String, expected: Vec<u8>) -> Result<bool, types::Error> {
        let b = &self.backend;
        b.runtime
            .block_on(b.stores.entries.delete_if_equal(&key, expected.into()))
            .map_err(|e| to_wit(&e))
    }

    fn replace_if_equal(
        &mut self,
        key: String,
        expected: Vec<u8>,
        value: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<bool, types::Error> {
        let b = &self.backend;
        b.runtime
            .block_on(
                b.stores
                    .entries
                    .replace_if_equal(&key, expected.into(), value.into(), ttl_ms),
            )
            .map_err(|e| to_wit(&e))
    }

    fn try_lock(&mut self, key: String, ttl_ms: u64) -> Result<Option<String>, types::Error> {
        let b = self.backend.clone();
        // The token is the call's before it is sent (contract §5.13): should the reply be
        // lost, the end of the call releases it, owner-checked.
        let owner = crate::lock_token();
        self.call.locks.insert(key.clone(), owner.clone());
        let taken = b
            .runtime
            .block_on(b.stores.flight_lock.try_lock(&key, &owner, ttl_ms))
            .map_err(|e| to_wit(&e))?;
        if !taken {
            self.call.locks.remove(&key);
        }
        Ok(taken.then_some(owner))
    }

    fn release_lock(&mut self, key: String, owner: String) -> Result<bool, types::Error> {
        self.call.locks.remove(&key);
        let b = &self.backend;
        b.runtime
            .block_on(b.stores.flight_lock.release(&key, &owner))
            .map_err(|e| to_wit(&e))
    }

    fn wait_landing(&mut self, key: String, until_ms: u64) {
        let b = &self.backend;
        let pause = Duration::from_millis(until_ms.saturating_sub(b.clock.now_ms()));
        b.runtime.block_on(async {
            let mut watch = b.stores.notifications.watch(&key).await;
            tokio::select! {
                biased;
                () = watch.landed() => {}
                () = tokio::time::sleep(pause) => {}
            }
        });
    }

    fn announce_landing(&mut self, key: String) {
        let b = &self.backend;
        let _ = b.runtime.block_on(b.stores.notifications.announce(&key));
    }
}

impl flights::Host for &mut PortableState {
    fn join(&mut self, key: String) -> Joined {
        let b = self.backend.clone();
        match b.runtime.block_on(b.registry.lead_or_follow(&key)) {
            Ok(guard) => {
                self.call.leading.insert(key, guard);
                Joined::Lead
            }
            Err(Ok(value)) => Joined::Value(value),
            Err(Err(e)) => Joined::Failed(e),
        }
    }

    fn finish(&mut self, key: String, outcome: Result<Vec<u8>, types::Error>) {
        if let Some(guard) = self.call.leading.remove(&key) {
            guard.finish(outcome);
        }
    }
}

impl loader::Host for &mut PortableState {
    fn load(&mut self, key: String) -> wasmtime::Result<Result<Vec<u8>, String>> {
        let out = match self.call.loader.as_mut() {
            Some(load) => load(&key),
            None => Err("no loader was given".into()),
        };
        if self.call.cancelled.load(Ordering::SeqCst) {
            return Err(wasmtime::format_err!("the caller went away mid-load"));
        }
        Ok(out)
    }

    fn should_cache(&mut self, _key: String, value: Vec<u8>) -> bool {
        self.call.should_cache.as_ref().is_none_or(|p| p(&value))
    }
}

impl table::Host for &mut PortableState {
    fn get(&mut self, key: String) -> Option<Held> {
        self.backend.table.lock().get(&key).cloned()
    }

    fn compare_and_swap(&mut self, key: String, expected: Option<Held>, new: Held) -> bool {
        let mut table = self.backend.table.lock();
        if table.get(&key) != expected.as_ref() {
            return false;
        }
        table.insert(key, new);
        true
    }

    fn compare_and_delete(&mut self, key: String, expected: Held) -> bool {
        let mut table = self.backend.table.lock();
        if table.get(&key) != Some(&expected) {
            return false;
        }
        table.remove(&key);
        true
    }
}
