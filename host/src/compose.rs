//! The one place the brain and the stores meet: a cache's stores are opened with the
//! names and scripts the guest gives them, as plain values. No module of `store/`
//! imports `guest/` or `cache/`.

use std::sync::Arc;

use crate::Result;
use crate::guest::Policy;
use crate::store::{Retry, Stores, memory};

/// The stores of a cache: Redis with `redis`'s options, else the embedded default; and
/// the prefix its data is named under. A test's `seams` go under (a wire to a Redis in
/// process) and around (a layer over the entries and the flight lock) what is opened.
pub(crate) fn open_stores(
    #[cfg(feature = "redis")] redis: Option<&crate::store::redis::RedisOptions>,
    #[cfg(feature = "test-util")] seams: Seams,
    memory: Option<memory::MemoryStore>,
    policy: &Policy,
    clock: Arc<dyn crate::Clock>,
    invalidation_interval_ms: u64,
    retry: Retry,
) -> Result<(String, Stores)> {
    #[cfg(feature = "test-util")]
    let Seams {
        #[cfg(feature = "redis")]
        wire,
        layer,
    } = seams;
    #[cfg(feature = "redis")]
    if let Some(options) = redis {
        let channel = policy.channel(&options.prefix)?;
        let invalidations = policy.invalidation_channel(&options.prefix)?;
        #[cfg(feature = "test-util")]
        let connection = match wire {
            Some(wire) => crate::store::link::Connection::wired(wire, options),
            None => crate::store::link::Connection::open(options)?,
        };
        #[cfg(not(feature = "test-util"))]
        let connection = crate::store::link::Connection::open(options)?;
        let store = crate::store::redis::RedisStore::connect(
            connection,
            options,
            policy.scripts(),
            channel,
            invalidations,
            retry,
        )?;
        let stores = Stores::redis(store);
        #[cfg(feature = "test-util")]
        let stores = layered(stores, layer);
        return Ok((options.prefix.clone(), stores));
    }
    let _ = (policy, retry);
    let store = memory.unwrap_or_else(|| memory::MemoryStore::new(clock, invalidation_interval_ms));
    let stores = Stores::memory(store);
    #[cfg(feature = "test-util")]
    let stores = layered(stores, layer);
    Ok((crate::options::DEFAULT_PREFIX.to_owned(), stores))
}

/// A test's layer over the entries and the flight lock.
#[cfg(feature = "test-util")]
type Layer = Box<dyn FnOnce(crate::store::Layered) -> crate::store::Layered + Send>;

/// `stores` with `layer` (if any) over their entries and flight lock.
#[cfg(feature = "test-util")]
fn layered(mut stores: Stores, layer: Option<Layer>) -> Stores {
    if let Some(layer) = layer {
        (stores.entries, stores.flight_lock) = layer((stores.entries.clone(), stores.flight_lock.clone()));
    }
    stores
}

/// What a test may put under or around the stores a builder opens: a Redis reached in
/// process, and a layer over the entries and the flight lock.
#[cfg(feature = "test-util")]
#[derive(Default)]
pub(crate) struct Seams {
    #[cfg(feature = "redis")]
    pub(crate) wire: Option<Arc<dyn crate::store::wire::Wire>>,
    pub(crate) layer: Option<Layer>,
}

#[cfg(feature = "test-util")]
impl std::fmt::Debug for Seams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seams").finish_non_exhaustive()
    }
}
