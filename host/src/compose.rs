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
    #[cfg(feature = "test-util")] mut seams: Seams,
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
        let connection = crate::store::link::Connection::open(options)?;
        #[cfg(feature = "test-util")]
        let connection = match seams.wire.take() {
            Some(wire) => crate::store::link::Connection::wired(wire, options),
            None => connection,
        };
        let store = crate::store::redis::RedisStore::connect(
            connection,
            options,
            policy.scripts(),
            channel,
            invalidations,
            retry,
        )?;
        #[cfg_attr(not(feature = "test-util"), allow(unused_mut))]
        let mut stores = Stores::redis(store);
        #[cfg(feature = "test-util")]
        seams.wrap(&mut stores);
        return Ok((options.prefix.clone(), stores));
    }
    let _ = (policy, retry);
    let store = memory.unwrap_or_else(|| memory::MemoryStore::new(clock, invalidation_interval_ms));
    #[cfg_attr(not(feature = "test-util"), allow(unused_mut))]
    let mut stores = Stores::memory(store);
    #[cfg(feature = "test-util")]
    seams.wrap(&mut stores);
    Ok((crate::options::DEFAULT_PREFIX.to_owned(), stores))
}

/// What a test may put under or around the stores a builder opens: a Redis reached in
/// process, and a layer over the entries and the flight lock.
#[cfg(feature = "test-util")]
#[derive(Default)]
pub(crate) struct Seams {
    #[cfg(feature = "redis")]
    pub(crate) wire: Option<Arc<dyn crate::store::wire::Wire>>,
    pub(crate) layer: Option<Box<dyn FnOnce(crate::store::Layered) -> crate::store::Layered + Send>>,
}

#[cfg(feature = "test-util")]
impl Seams {
    fn wrap(self, stores: &mut Stores) {
        if let Some(layer) = self.layer {
            let layered = layer((stores.entries.clone(), stores.flight_lock.clone()));
            (stores.entries, stores.flight_lock) = layered;
        }
    }
}

#[cfg(feature = "test-util")]
impl std::fmt::Debug for Seams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seams").finish_non_exhaustive()
    }
}
