//! The L1 tier: moka's synchronous cache, in process (a read needs no await). An entry
//! carries the deadline the guest issued when it was filled (never past the entry's L2
//! expiry, nor the L1 TTL); moka's own TTL is only an upper bound that keeps memory in
//! check. A capacity of 0 turns L1 off.

use std::time::Duration;

use bytes::Bytes;
use moka::sync::Cache;

#[derive(Clone, Debug)]
pub(crate) struct L1Entry {
    pub(crate) value: Bytes,
    /// Served until this moment (Unix ms), as issued by the guest.
    pub(crate) until_ms: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct L1 {
    cache: Option<Cache<String, L1Entry>>,
}

impl L1 {
    pub(crate) fn new(capacity: u64, ttl: Duration) -> Self {
        L1 {
            cache: (capacity > 0).then(|| Cache::builder().max_capacity(capacity).time_to_live(ttl).build()),
        }
    }

    /// Whether L1 is on (a capacity above 0).
    pub(crate) fn is_on(&self) -> bool {
        self.cache.is_some()
    }

    /// The value of `key` if the deadline the guest issued has not passed at `now_ms`.
    pub(crate) fn get(&self, key: &str, now_ms: u64) -> Option<Bytes> {
        let entry = self.cache.as_ref()?.get(key)?;
        (now_ms < entry.until_ms).then_some(entry.value)
    }

    pub(crate) fn insert(&self, key: &str, value: Bytes, until_ms: u64) {
        if let Some(cache) = &self.cache {
            cache.insert(key.to_owned(), L1Entry { value, until_ms });
        }
    }

    pub(crate) fn remove(&self, key: &str) {
        if let Some(cache) = &self.cache {
            cache.invalidate(key);
        }
    }
}
