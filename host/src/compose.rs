//! The one place the brain and the stores meet: a cache's stores are opened with the
//! names and scripts the guest gives them, as plain values. No module of `store/`
//! imports `guest/` or `cache/`.

use std::sync::Arc;

use crate::Result;
use crate::guest::Policy;
use crate::store::{Retry, Stores, memory};

/// The stores of a cache: Redis with `redis`'s options, else the embedded default; and
/// the prefix its data is named under.
pub(crate) fn open_stores(
    #[cfg(feature = "redis")] redis: Option<&crate::store::redis::RedisOptions>,
    memory: Option<memory::MemoryStore>,
    policy: &Policy,
    clock: Arc<dyn crate::Clock>,
    invalidation_interval_ms: u64,
    retry: Retry,
) -> Result<(String, Stores)> {
    #[cfg(feature = "redis")]
    if let Some(options) = redis {
        let channel = policy.channel(&options.prefix)?;
        let invalidations = policy.invalidation_channel(&options.prefix)?;
        let store = crate::store::redis::RedisStore::connect(
            options,
            policy.scripts(),
            channel,
            invalidations,
            retry,
        )?;
        return Ok((options.prefix.clone(), Stores::redis(store)));
    }
    let _ = (policy, retry);
    let store = memory.unwrap_or_else(|| memory::MemoryStore::new(clock, invalidation_interval_ms));
    Ok((crate::options::DEFAULT_PREFIX.to_owned(), Stores::memory(store)))
}
