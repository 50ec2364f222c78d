//! Corral's store imports (`corral:cache/l1`, `l2`, `flights`, `corral:lock/table`) made
//! of `wasi:keyvalue@0.2.0-draft2`, as a component of its own: plugged into the Corral
//! component (`wac compose`, platform/corral-wasi.wac), it leaves an application only
//! `wasi:*` imports to satisfy.
//!
//! - The store expires nothing: every value is a record carrying its own expiry, and a
//!   removal is a compare-and-swap to a tombstone (`corral_core::kv`).
//! - Every conditional change (a fenced fill, a sliding touch, a removal, the get-or-set
//!   lock, the lock table) is a compare-and-swap over what was read.
//! - The get-or-set lock is a record that is gone at its TTL: a taker finds it free then.
//! - L1 and the flight registry are state of the instance; the component itself makes a
//!   second caller of the instance follow the first (`cache.begin` answers `wait`).
//! - No host offers a watcher: landings and tag or clear announcements are not sent, a
//!   waiter polls on the flight machine's backoff, and other instances see a change
//!   within their L1 TTL.
//! - Store steps cannot be bounded from inside (`l2.bound` is a no-op): the host's own
//!   timeouts bound them.
//!
//! The store is the `wasi:keyvalue` bucket named by `CORRAL_KEYVALUE_STORE` (default
//! `default`, Spin's default label; `""`, wasmtime's only one, with `draft`).
//!
//! With the feature `draft`, the adapter is built on `wasi:keyvalue@0.2.0-draft`
//! (wasmtime's `-S keyvalue`, wasmCloud), which has no compare-and-swap. It promises
//! less, and never a wrong value:
//! - a change that must land only over what was read is not made in the store: a load's
//!   fill stays in this instance's L1 (when the store still holds what the flight read),
//!   sliding touches and conditional removals are skipped, and tag invalidations and
//!   `clear` fail (`unavailable`, saying why) rather than be lost;
//! - `set`, removals, the get-or-set lock and the lock table are read-then-write: two
//!   instances may both take a lock (a second load, never shared), and the `lock`
//!   export's locks are exclusive only within an instance.

#![cfg(target_arch = "wasm32")]

/// The generated bindings. The canonical-ABI glue they contain is `unsafe` by nature;
/// it is allowed here and nowhere else.
#[allow(unsafe_code)]
#[cfg(not(feature = "draft"))]
mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "corral:platform/keyvalue-adapter",
        generate_all,
    });

    use super::Adapter;
    export!(Adapter);
}

/// The bindings of the `@0.2.0-draft` flavour (feature `draft`).
#[allow(unsafe_code)]
#[cfg(feature = "draft")]
mod bindings {
    wit_bindgen::generate!({
        path: "../wit-draft",
        world: "corral:platform-draft/keyvalue-adapter",
        generate_all,
    });

    use super::Adapter;
    export!(Adapter);
}

mod l1;
mod l2;
mod table;

struct Adapter;

/// Now, in Unix ms, from `wasi:clocks/wall-clock`.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
