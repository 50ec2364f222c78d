//! Locks (SPEC section 6): an in-memory lock provider, and leases on one Redis or on
//! several (Redlock), with a watchdog and fencing tokens. Every decision (who wins,
//! when a lock is expired, when to retry, whether a quorum holds, when to renew, which
//! fencing token) is the guest's; this module performs the I/O.

mod memory;
#[cfg(feature = "redis")]
mod redis;

pub use memory::MemoryLocks;
#[cfg(feature = "redis")]
pub use redis::{Lease, LockOptions, RedisLocks};
