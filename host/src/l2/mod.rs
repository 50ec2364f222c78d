//! The L2 tier: a shared store of envelopes (header + value bytes).
//!
//! Two backends: [`MemoryL2`], the embedded default, and [`RedisL2`]. A backend stores
//! and moves bytes; it decides nothing the contract governs. The one rule it applies
//! (the sliding touch on read, atomically with the read) comes from the guest: the Redis
//! backend runs the guest's Lua on the server, the memory backend asks the guest under
//! its lock.

use std::fmt;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::Result;

mod landing;
mod memory;
#[cfg(feature = "redis")]
mod redis;

pub use landing::LandingWatch;
pub(crate) use landing::Landings;
pub use memory::{InvalidationStats, MemoryL2};
#[cfg(feature = "redis")]
pub use redis::{RedisL2, RedisOptions};

/// A store of envelopes under string keys. Every method is one atomic step.
///
/// Failures are [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) errors, with
/// the backend's own error as the source.
pub trait L2Store: Send + Sync + fmt::Debug + 'static {
    /// Reads `key` at `now_ms`, applying the read's sliding touch atomically: returns
    /// the bytes (touched) or `None` when missing or expired (an expired entry is
    /// removed). Bytes that are not an envelope come back as they are.
    fn read<'a>(&'a self, key: &'a str, now_ms: u64) -> BoxFuture<'a, Result<Option<Bytes>>>;

    /// Reads `key` without touching or judging it.
    fn peek<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>>;

    /// Writes `bytes` under `key`; the store MAY drop them after `ttl_ms`.
    fn write<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<()>>;

    /// Removes `key`; says whether it was there.
    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>>;

    /// Removes `key` only if it still holds exactly `expected`; says whether it did.
    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, Result<bool>>;

    /// Replaces `key`'s bytes with `bytes` only if it still holds exactly `expected`;
    /// says whether it did.
    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: Bytes,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>>;

    /// Takes the lock of `key` for `owner` if nobody holds it (`SET NX PX`); says
    /// whether it did. Lock keys never meet entry keys.
    fn try_lock<'a>(&'a self, key: &'a str, owner: &'a str, ttl_ms: u64) -> BoxFuture<'a, Result<bool>>;

    /// Releases the lock of `key` if `owner` holds it (compare-and-delete); says whether it did.
    fn release_lock<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>>;

    /// Registers interest in the next landing of a value for `key` in any process
    /// sharing the store. Register before trying the lock, so no landing is missed.
    /// Never fails: without a notification channel the watch never fires and the
    /// caller's backoff timer is the fallback.
    fn watch_landing<'a>(&'a self, key: &'a str) -> BoxFuture<'a, LandingWatch>;

    /// Tells every process sharing the store that a value for `key` landed.
    fn announce_landing<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<()>>;

    /// A short name for logs and tables: `memory`, `redis`.
    fn name(&self) -> &'static str;
}
