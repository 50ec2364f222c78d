//! The brain, loaded: the guest component compiled once per process, a pool of
//! instances, and the synchronous calls into its pure `policy` and `flight` exports.
//!
//! - `engine`: the wasmtime engine, the component, epoch deadlines, instantiation.
//! - `policy`: `Policy`, the handle every body asks for decisions (public only for the
//!   tests, with the `test-util` feature).
//! - `convert`: between the public types and the WIT types.
//!
//! The portable body (the component's own `cache`/`lock` exports) links its imports in
//! the `portable` module, above this one; this module knows nothing of them.

pub(crate) mod bindings;
pub(crate) mod convert;
pub(crate) mod engine;
pub(crate) mod policy;

pub use engine::{GUEST_WASM, GUEST_WASM_PATH};
#[cfg(not(any(test, feature = "test-util")))]
pub(crate) use policy::Policy;
#[cfg(any(test, feature = "test-util"))]
pub use policy::{Freshness, Policy};
