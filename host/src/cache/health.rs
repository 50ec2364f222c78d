//! Readiness and shutdown: what a service puts behind `/ready`, a build that fails fast
//! when the store does not answer, and a close that lets what is under way end.

use std::fmt;
use std::time::Duration;

use super::{Corral, CorralBuilder};
use crate::{Error, ErrorKind, Result};

/// What a cache knows of its stores now ([`Corral::health`]): whether L2 answers,
/// whether other processes' announcements are heard, and whether a breaker is open.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// L2 answered a read within the store's timeout.
    pub l2_reachable: bool,
    /// Why it did not, when it did not: the store's error (never a credential).
    pub l2_error: Option<String>,
    /// Other processes' announcements are heard: the Redis subscription is live (always
    /// true for the in-process memory store). While it is down, this process's L1 may
    /// serve a value another process changed, until the L1 TTL.
    pub subscribed: bool,
    /// A circuit breaker of the store is open: calls fail at once, without trying.
    pub breaker_open: bool,
}

impl Health {
    /// Whether the cache serves as promised: L2 answers, announcements are heard, and
    /// no breaker is open. A cache that is not ready still answers every call (misses go
    /// to the loader); a service may still want to stay out of rotation.
    pub fn is_ready(&self) -> bool {
        self.l2_reachable && self.subscribed && !self.breaker_open
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.l2_error, self.subscribed, self.breaker_open) {
            _ if self.is_ready() => write!(f, "ready"),
            (Some(e), _, _) => write!(f, "L2 unreachable: {e}"),
            (None, _, true) => write!(f, "a breaker of the store is open"),
            (None, false, _) => write!(f, "not subscribed to other processes' announcements"),
            (None, true, false) => write!(f, "L2 unreachable"),
        }
    }
}

impl Corral {
    /// Checks the stores now: one read of L2 (the prefix's generation, a key every cache
    /// reads) within the store's timeout, the subscription's state (a fresh cache waits
    /// for its first subscription, within the connect and response timeouts), and the
    /// breakers. Never fails: what is wrong is in the answer. Ends within the store's
    /// timeout plus, for a fresh cache, its connect timeout.
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) {
    /// let health = cache.health().await;
    /// if !health.is_ready() {
    ///     eprintln!("not ready: {health}");
    /// }
    /// # }
    /// ```
    pub async fn health(&self) -> Health {
        let inner = &*self.inner;
        let stores = &inner.stores;
        let subscribed = stores.notifications.subscribed().await.unwrap_or(true);
        let l2_error = match inner.policy.generation_name(&inner.prefix) {
            Err(e) => Some(e.to_string()),
            Ok(name) => {
                match tokio::time::timeout(inner.flight.store_timeout, stores.entries.get(&name)).await {
                    Ok(Ok(_)) => None,
                    // The store's words, without the kind the answer says already.
                    Ok(Err(e)) => Some(e.detail()),
                    Err(_) => Some(format!(
                        "no answer within the store timeout ({} ms)",
                        inner.flight.store_timeout.as_millis()
                    )),
                }
            }
        };
        #[cfg(feature = "redis")]
        let breaker_open = stores.redis.as_ref().is_some_and(|r| r.breaker().0);
        #[cfg(not(feature = "redis"))]
        let breaker_open = false;
        Health {
            l2_reachable: l2_error.is_none(),
            l2_error,
            subscribed,
            breaker_open,
        }
    }

    /// Lets what this cache has under way end, for at most `within`: a graceful
    /// shutdown. It waits for flights (their loads, fills, lock releases and
    /// announcements; those that go on without their caller, `fetch`'s and eager
    /// refreshes, included), announcements and removals retried in the background, a
    /// read's write-back, and what the cache's [Redis leases](crate::locks::Locks::redis)
    /// owe ([`RedisLocks::close`](crate::locks::RedisLocks::close)). A process that
    /// exits without it drops that work: a removal or a change another process never
    /// hears of until its L1 TTL, a lock nobody holds until its TTL.
    ///
    /// A service stops taking requests, closes its cache, then exits. Calls made while
    /// `close` waits are served as usual, and it waits for them too; the cache stays
    /// usable afterwards. Leases still held are their holders': release them first.
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) {
    /// // ... the server has stopped taking requests ...
    /// if let Err(e) = cache.close(std::time::Duration::from_secs(5)).await {
    ///     eprintln!("{e}");
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] when something was still under way at `within`, saying
    /// how much.
    pub async fn close(&self, within: Duration) -> Result<()> {
        // The cache's leases count their work with the cache's.
        let left = self.inner.owed.settle(within).await;
        crate::owed::closed("the cache", left, within)
    }
}

impl CorralBuilder {
    /// As [`build`](Self::build), then checks the stores ([`Corral::health`]) and fails
    /// fast when the cache is not ready: a wrong Redis password, an unreachable or frozen
    /// server. `build` alone succeeds in those cases (the cache then answers every miss
    /// from the loader, and reconnects by itself).
    ///
    /// # Errors
    /// As [`build`](Self::build); [`ErrorKind::Unavailable`] saying what is wrong when
    /// the stores are not ready.
    pub async fn build_ready(self) -> Result<Corral> {
        let cache = self.build()?;
        let health = cache.health().await;
        if health.is_ready() {
            Ok(cache)
        } else {
            Err(Error::new(
                ErrorKind::Unavailable,
                format!("the cache's stores are not ready: {health}"),
            ))
        }
    }
}
