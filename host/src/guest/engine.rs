//! The component, loaded once per process, and how instances of it are made.
//!
//! One [`Engine`] with epoch interruption (a runaway guest traps at its deadline instead
//! of hanging a thread), one [`Component`], and for the native body one pre-linked
//! instance template whose only real imports are WASI's: the portable imports trap if
//! the pure exports ever called them. The portable body links its own template from
//! the same component (the `portable` module, above this one).
//!
//! The component is not compiled here: `build.rs` compiled it for the target with
//! Cranelift and the settings of `engine_config.rs`, and the engine deserializes that
//! artefact. So this crate carries no compiler, keeps no compilation cache and writes
//! no file at run time (no `~/.cache/wasmtime`).

use std::sync::OnceLock;
use std::time::Duration;

use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Engine, Precompiled, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{Guest, GuestPre};
use crate::{Error, ErrorKind, Result};

mod engine_config {
    use wasmtime::Config;
    include!("engine_config.rs");
}

/// The guest component's bytes: `guest/component` built for `wasm32-wasip2` (the copy
/// shipped in `host/guest/`, or a fresh build: see `build.rs`).
pub const GUEST_WASM: &[u8] = include_bytes!(env!("CORRAL_GUEST_WASM"));

/// Where the build took the guest component from (the file [`GUEST_WASM`] was read from).
pub const GUEST_WASM_PATH: &str = env!("CORRAL_GUEST_WASM");

/// [`GUEST_WASM`] compiled for this target by `build.rs` (`Engine::precompile_component`).
const GUEST_CWASM: &[u8] = include_bytes!(env!("CORRAL_GUEST_CWASM"));

/// The FNV-1a hash of the component `build.rs` compiled into [`GUEST_CWASM`].
const GUEST_CWASM_OF: &str = env!("CORRAL_GUEST_WASM_FNV");

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
    let mut config = wasmtime::Config::new();
    engine_config::configure(&mut config);
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
    let component = deserialize(&engine)?;
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

/// The compiled guest, after checking it is the one this build made of [`GUEST_WASM`].
fn deserialize(engine: &Engine) -> wasmtime::Result<Component> {
    let of = fnv_hex(GUEST_WASM);
    if of != GUEST_CWASM_OF {
        wasmtime::bail!(
            "the compiled guest was made from another component (hash {GUEST_CWASM_OF}, \
             embedded {of}): a broken build"
        );
    }
    if Engine::detect_precompiled(GUEST_CWASM) != Some(Precompiled::Component) {
        wasmtime::bail!("the compiled guest is not a precompiled component: a broken build");
    }
    // SAFETY: `Component::deserialize` trusts its bytes to be wasmtime's own output, as
    // machine code it will run. These are: `build.rs` of this very build produced them
    // with `Engine::precompile_component` from `GUEST_WASM` (checked just above by its
    // hash) and they are compiled into the binary (`include_bytes!` from `OUT_DIR`),
    // never read from a file or taken from a caller at run time. The build script's
    // wasmtime is this one (one version in the lock file: both come from the same
    // workspace requirement), and whatever could still differ is checked by
    // `deserialize` itself, which refuses, with an error, an artefact of another
    // wasmtime version, another architecture or OS, CPU features this CPU lacks (the
    // build compiles for the target's baseline) or other engine settings (both sides
    // take theirs from `engine_config.rs`).
    #[allow(unsafe_code)]
    let component = unsafe { Component::deserialize(engine, GUEST_CWASM)? };
    Ok(component)
}

/// FNV-1a, 64 bits, as 16 hex digits (the same as `build.rs`'s).
fn fnv_hex(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
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

/// Instantiates `pre` with `state` as the store data. Boxed: a slot is taken from and
/// given back to a pool around every call, and the bindings hold a handle per export
/// (moving them by value cost about a fifth of a guest call).
pub(crate) fn instantiate<T: 'static>(loaded: &Loaded, pre: &GuestPre<T>, state: T) -> Result<Box<Slot<T>>> {
    let mut store = Store::new(&loaded.engine, state);
    // Instantiation runs guest code too; every call sets its own budget afterwards.
    store.set_epoch_deadline(CALL_BUDGET_TICKS);
    let guest = pre
        .instantiate(&mut store)
        .map_err(|e| Error::guest("instantiating the guest component failed", e))?;
    Ok(Box::new(Slot { store, guest }))
}

pub(crate) fn trap(e: wasmtime::Error) -> Error {
    Error::guest("the guest component trapped", e)
}
