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
//! A whole embedding, on the embedded in-memory L2 (add `.redis(url)` to the builder to
//! share the entries and the single flight between processes, and to get leases):
//!
//! ```
//! use std::time::Duration;
//! use corral::{Corral, EntryOptions, ErrorKind, LoadOptions};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct User { id: u64, name: String }
//!
//! async fn load_user(id: u64) -> std::io::Result<User> {
//!     Ok(User { id, name: "Ada".into() }) // the database, in a real service
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> corral::Result<()> {
//! let cache = Corral::builder()
//!     .default_sliding(Duration::from_secs(600)) // entries whose options name no expiry
//!     .hard_timeout(Duration::from_secs(2))      // a loader that hangs is stopped
//!     .build()?;
//!
//! // However many callers miss "user:42" at once: one load (with Redis, across processes).
//! // Kept for 5 minutes, tagged so a change to the user drops every entry about it, and
//! // served stale for up to an hour when the database fails (fail-safe).
//! let options = LoadOptions::new()
//!     .entry(EntryOptions::new().relative(Duration::from_secs(300)).fail_safe(Duration::from_secs(3600)))
//!     .tags(["user:42"]);
//! let user: User = cache.get_or_set_json("user:42", options, || load_user(42)).await?;
//! assert_eq!(user.name, "Ada");
//!
//! // The user changed: drop everything tagged with it (with Redis, in every process).
//! cache.remove_by_tag("user:42").await?;
//! assert!(cache.get("user:42").await?.is_none());
//!
//! // A lock for work that must not run twice at once (in process here; with Redis,
//! // `cache.locks().redis()` gives leases with fencing tokens).
//! let locks = cache.locks().table();
//! assert!(locks.try_lock("nightly-report", "me", Duration::from_secs(30))?);
//! assert!(!locks.try_lock("nightly-report", "someone else", Duration::from_secs(30))?);
//! locks.unlock("nightly-report", "me")?;
//!
//! // Bad input is a typed error naming what was wrong.
//! let err = cache.get("   ").await.unwrap_err();
//! assert_eq!((err.kind(), err.argument()), (ErrorKind::InvalidArgument, Some("key")));
//!
//! // Counters for a `/metrics` endpoint, then a shutdown that lets work in flight end.
//! assert_eq!(cache.metrics().loads, 1);
//! cache.close(Duration::from_secs(5)).await?;
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod cache;
mod clock;
mod compose;
mod error;
mod gather;
pub mod guest;
mod hint;
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
