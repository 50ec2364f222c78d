//! Locks (contract §6): an in-memory lock table, leases on one Redis or on several
//! (Redlock) with a watchdog and fencing tokens, and the keyed semaphore. Every decision
//! (who wins, when a lock is expired, when to retry, whether a quorum holds, when to
//! renew, which fencing token) is the guest's; this module performs the I/O.
//!
//! [`Corral::locks`](crate::Corral::locks) gives the lock APIs of a cache, sharing its
//! guest, clock, limits and Redis connection; [`MemoryLocks::new`] and
//! [`RedisLocks::connect`] stand alone.

mod memory;
#[cfg(feature = "redis")]
mod redis;
mod semaphore;

pub use memory::MemoryLocks;
#[cfg(feature = "redis")]
pub(crate) use redis::Server;
#[cfg(feature = "redis")]
pub use redis::{Lease, LockOptions, RedisLocks};
pub use semaphore::{KeyPermit, KeyedSemaphore};

/// The lock APIs of one cache: an in-process lock table, and leases on the cache's
/// Redis when it has one. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Locks {
    pub(crate) table: MemoryLocks,
    #[cfg(feature = "redis")]
    pub(crate) redis: Option<RedisLocks>,
}

impl Locks {
    /// The in-process lock table (`try_lock`, `unlock`, ...), on the cache's clock.
    pub fn table(&self) -> &MemoryLocks {
        &self.table
    }

    /// Leases (with fencing tokens and a watchdog) on the cache's Redis, over the
    /// cache's own connection; `None` on the embedded in-memory backend.
    #[cfg(feature = "redis")]
    pub fn redis(&self) -> Option<&RedisLocks> {
        self.redis.as_ref()
    }
}
