//! The component, compiled once per process, and how instances of it are made.
//!
//! One [`Engine`] with epoch interruption (a runaway guest traps at its deadline instead
//! of hanging a thread), one compiled [`Component`], and for the native body one
//! pre-linked instance template whose only real imports are WASI's: the portable
//! imports trap if the pure exports ever called them. The portable body links its own
//! template from the same component ([`crate::portable`]).

use std::sync::OnceLock;
use std::time::Duration;

use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Config, Engine, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{Guest, GuestPre};
use crate::{Error, ErrorKind, Result};

/// The guest component's bytes: `guest/component` built for `wasm32-wasip2`.
pub const GUEST_WASM: &[u8] = include_bytes!(env!("CORRAL_GUEST_WASM"));

/// Where the build put the guest component (the file [`GUEST_WASM`] was read from).
pub const GUEST_WASM_PATH: &str = env!("CORRAL_GUEST_WASM");

/// How often the engine's epoch advances.
const EPOCH_TICK: Duration = Duration::from_millis(10);

/// The budget of one pure policy call, in epoch ticks (1 s: a pure decision takes
/// microseconds; only a runaway guest reaches it).
pub(crate) const CALL_BUDGET_TICKS: u64 = 100;

/// The budget of one portable call, in ticks (1 hour): its imports may wait on a loader
/// or a lock for as long as the caller allows, and that time counts.
pub(crate) const PORTABLE_BUDGET_TICKS: u64 = 360_000;

/// The engine and the compiled component, shared by every body in the process.
pub(crate) struct Loaded {
    pub(crate) engine: Engine,
    pub(crate) component: Component,
    /// The native body's template: WASI, and traps for the portable imports.
    pub(crate) policy_pre: GuestPre<PolicyState>,
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
    let mut linker = Linker::<PolicyState>::new(&engine);
    // std on wasip2 imports wasi:cli and wasi:io (stderr for panics); the policy itself
    // needs nothing else.
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    linker.define_unknown_imports_as_traps(&component)?;
    let policy_pre = GuestPre::new(linker.instantiate_pre(&component)?)?;
    Ok(Loaded {
        engine,
        component,
        policy_pre,
    })
}

/// The store data of a native-body instance: WASI only.
pub(crate) struct PolicyState {
    wasi: WasiCtx,
    table: ResourceTable,
}

impl PolicyState {
    pub(crate) fn new() -> Self {
        PolicyState {
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
        }
    }
}

impl WasiView for PolicyState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// One instance and its store.
pub(crate) struct Slot<T: 'static> {
    pub(crate) store: Store<T>,
    pub(crate) guest: Guest,
}

/// Instantiates `pre` with `state` as the store data.
pub(crate) fn instantiate<T: 'static>(loaded: &Loaded, pre: &GuestPre<T>, state: T) -> Result<Slot<T>> {
    let mut store = Store::new(&loaded.engine, state);
    // Instantiation runs guest code too; every call sets its own budget afterwards.
    store.set_epoch_deadline(CALL_BUDGET_TICKS);
    let guest = pre
        .instantiate(&mut store)
        .map_err(|e| Error::guest("instantiating the guest component failed", e))?;
    Ok(Slot { store, guest })
}

pub(crate) fn trap(e: wasmtime::Error) -> Error {
    Error::guest("the guest component trapped", e)
}
