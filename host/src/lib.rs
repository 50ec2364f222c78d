//! Corral: a tiered cache with single-flight loading and distributed locks, whose
//! every decision is made by a WebAssembly component.
//!
//! The guest component (`guest/component`, built from `corral-core`) is the brain: key
//! rules, expiry, the stored envelope, the single-flight machine, the lock protocols. This
//! crate is the fast native body: it loads the component once, calls its pure `policy`,
//! `flight` and lock `policy` exports synchronously, and performs the I/O: the clock, L1
//! (moka), L2 (in memory, or Redis through the `redis` crate), the flight registry, the
//! locks and their watchdogs.
//!
//! - [`Corral`]: `get`, `set`, `refresh`, `remove`, and [`Corral::get_or_set`], which
//!   loads each key once across every caller and process.
//! - [`locks`]: [`locks::MemoryLocks`] in process; [`locks::RedisLocks`] leases on one
//!   Redis or Redlock on several, with fencing tokens and a watchdog.
//! - [`portable`]: the component's own `cache` and `lock` exports, run in wasmtime with
//!   this crate's stores as their imports (the body any component host can supply).
//!
//! Where things live: [`guest`] loads the brain and asks it; `Corral` drives it for
//! a service; [`store`] holds the pure-I/O stores (memory, Redis) behind traits;
//! [`locks`] holds the lock APIs; [`portable`] runs the component's own body. The
//! contract all of them keep is `docs/contract.md`.
//!
//! ```no_run
//! # async fn demo() -> corral::Result<()> {
//! use std::time::Duration;
//! use corral::{Corral, EntryOptions, ErrorKind};
//!
//! let cache = Corral::builder().redis("redis://127.0.0.1:6379").build()?;
//! cache.set("greeting", "hello", EntryOptions::new().relative(Duration::from_secs(30))).await?;
//! let value = cache.get("greeting").await?; // Some(b"hello")
//! # assert!(value.is_some());
//! let err = cache.get("   ").await.unwrap_err();
//! assert_eq!(err.kind(), ErrorKind::InvalidArgument);
//! assert_eq!(err.argument(), Some("key"));
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod cache;
mod clock;
mod compose;
mod error;
mod gather;
pub mod guest;
pub mod locks;
mod options;
mod owed;
pub mod portable;
pub mod store;
mod throttle;

pub use cache::load::{LoadOptions, Served};
pub use cache::metrics::MetricsSnapshot;
pub use cache::{Corral, CorralBuilder, Health};
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{Error, ErrorKind, Result};
pub use options::{DEFAULT_PREFIX, EntryMeta, EntryOptions, Inspection};
#[cfg(feature = "redis")]
pub use store::redis::RedisOptions;

/// A fresh random 128-bit owner token for a lock, as 32 hex digits.
pub(crate) fn lock_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Redis connections run on the caller's Tokio runtime: without one, a clear error
/// instead of the runtime's panic.
pub(crate) fn require_runtime(what: &str) -> Result<()> {
    tokio::runtime::Handle::try_current().map(|_| ()).map_err(|_| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("{what} needs a Tokio runtime: build the cache inside one (e.g. in #[tokio::main])"),
        )
    })
}
