//! Locks (contract §6): an in-memory lock table, leases on one Redis or on several
//! (Redlock) with a watchdog and fencing tokens. Every decision
//! (who wins, when a lock is expired, when to retry, whether a quorum holds, when to
//! renew, which fencing token) is the guest's; this module performs the I/O.
//!
//! [`Corral::locks`](crate::Corral::locks) gives the lock APIs of a cache, sharing its
//! guest, clock, limits and Redis connection; [`MemoryLocks::new`] and
//! [`RedisLocks::connect`] stand alone.

mod memory;
#[cfg(feature = "redis")]
mod redis;

pub use memory::MemoryLocks;
#[cfg(feature = "redis")]
pub(crate) use redis::Server;
#[cfg(feature = "redis")]
pub use redis::{Lease, LockOptions, RedisLocks};

/// Which of the guest's lock scripts (`corral-core`'s `script::LOCK_*`) a lease runs on
/// one server.
#[cfg(feature = "redis")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockScript {
    /// `LOCK_ACQUIRE`. `keys`: the lock, its fencing counter, its waiting mark; `args`:
    /// the owner token, the TTL in ms, and `wait` for a try whose caller will wait for
    /// the release's announcement. Takes the lock if free (`SET NX PX`), raises the
    /// counter to at least the server's clock in microseconds and increments it: the
    /// new counter, or 0 when another owner holds the lock (a `wait` then sets the
    /// waiting mark).
    Acquire,
    /// `LOCK_ACQUIRE_FAIR`. `keys`: the lock, its fencing counter, its queue, and its
    /// waiting mark when the waiter hears announcements; `args`:
    /// the owner token, the TTL in ms, the waiter, and `wait`, `try` or `leave`. As
    /// `Acquire`, but first come, first served: only the head of the queue (or anyone,
    /// when no one is queued) may take the lock; `wait` queues the waiter when it does
    /// not take it, `leave` gives its place up (0).
    AcquireFair,
    /// `LOCK_RELEASE`. `keys`: the lock, its fencing counter, its waiting mark; `args`:
    /// the owner token, a fencing token the counter is first raised to (`0`: none), and
    /// optionally a channel and a message. Deletes the lock if the owner holds it: 1,
    /// else 0; released with the waiting mark set, it clears the mark and publishes the
    /// message.
    Release,
    /// `LOCK_EXTEND`. `keys`: the lock; `args`: the owner token, the new TTL in ms. Resets
    /// the TTL if the owner holds the lock: 1, else 0.
    Extend,
}

/// A server for [`RedisLocks`] that is not a Redis: a simulated store, another database.
/// It runs each of the guest's lock scripts with its semantics, atomically, and answers
/// the script's integer; [`RedisLocks::over`] takes one per server.
#[cfg(feature = "redis")]
pub trait LeaseServer: Send + Sync + std::fmt::Debug + 'static {
    /// Runs `script` with `keys` (Redis's `KEYS`) and `args` (its `ARGV`).
    fn run<'a>(
        &'a self,
        script: LockScript,
        keys: &'a [String],
        args: &'a [&'a str],
    ) -> futures::future::BoxFuture<'a, std::result::Result<u64, Unanswered>>;
}

/// A [`LeaseServer`] that did not answer.
#[cfg(feature = "redis")]
#[derive(Clone, Debug)]
pub struct Unanswered {
    /// Why, for errors and logs.
    pub cause: String,
    /// Whether the command may have run all the same (a timeout, a lost reply): an
    /// acquire's token is then released there in the background, owner-checked.
    /// `false` only when it certainly did not (a refused connection). A release is
    /// tried again in the background either way where the lease may hold the lock.
    pub maybe_ran: bool,
}

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
