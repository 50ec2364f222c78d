//! One L2 read, as every operation does it: the store returns bytes, the guest judges
//! them, and this loop performs what the judgement asks (contract §3).
//!
//! The read costs the store what a `GET` costs. A fresh sliding entry owes a touch:
//! it is written back only over the very bytes read (compare-and-replace), so it can
//! never overwrite a newer value. A key once found sliding is remembered, and its next
//! reads go through the store's read-and-touch (one round trip, the guest's Lua on
//! Redis) when the store has one. Expired and corrupt bytes are removed, again only if
//! unchanged.

use std::fmt;

use bytes::Bytes;

use super::Corral;
use super::metrics::Metrics;
use crate::Result;
use crate::guest::policy::{ReadOutcome, WitMeta};

/// Keys last seen holding a sliding entry, bounded like L1.
#[derive(Clone)]
pub(crate) struct SlidingKeys(moka::sync::Cache<String, ()>);

impl fmt::Debug for SlidingKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlidingKeys")
            .field("keys", &self.0.entry_count())
            .finish()
    }
}

impl SlidingKeys {
    pub(crate) fn new(capacity: u64) -> Self {
        SlidingKeys(moka::sync::Cache::new(capacity.max(1_000)))
    }

    fn contains(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// Records what a read found `key` to be.
    fn note(&self, key: &str, was_known: bool, sliding: bool) {
        match (was_known, sliding) {
            (false, true) => self.0.insert(key.to_owned(), ()),
            (true, false) => self.0.invalidate(key),
            _ => {}
        }
    }
}

/// Whether an L2 read still has to check its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Key {
    /// The caller checked it already.
    Checked,
    /// The read checks it, in the same guest call that judges the bytes (or, when no
    /// bytes came back, in a call of its own): a bad key is an argument error whatever
    /// the store did.
    Unchecked,
}

impl Corral {
    /// Reads `key` at `now`. Returns the value and its (touched) metadata when fresh.
    pub(crate) async fn l2_read(&self, key: &str, now: u64, check: Key) -> Result<Option<(Bytes, WitMeta)>> {
        let inner = &*self.inner;
        let entries = &inner.stores.entries;
        let sliding = inner.sliding_keys.contains(key);
        let read = match sliding.then(|| entries.read_and_touch(key, now)).flatten() {
            Some(touching) => touching,
            None => entries.get(key),
        };
        let stored = match self.l2_op(read).await {
            Ok(Some(stored)) => stored,
            other => {
                if check == Key::Unchecked {
                    inner.policy.validate_key(key)?;
                }
                return other.map(|_| None);
            }
        };
        let outcome = match check {
            Key::Checked => inner.policy.read(&stored, now)?,
            Key::Unchecked => inner.policy.read_entry(key, &stored, now)?,
        };
        match outcome {
            ReadOutcome::Fresh(hit) => {
                let value = stored.slice(hit.value_offset as usize..);
                if let Some(header) = hit.new_header {
                    let mut touched = Vec::with_capacity(stored.len());
                    touched.extend_from_slice(&header);
                    touched.extend_from_slice(&value);
                    self.l2_op(entries.replace_if_equal(key, stored, touched.into(), hit.store_ttl_ms))
                        .await?;
                }
                inner
                    .sliding_keys
                    .note(key, sliding, hit.meta.sliding_ms.is_some());
                Ok(Some((value, hit.meta)))
            }
            ReadOutcome::Expired => {
                self.l2_op(entries.delete_if_equal(key, stored)).await?;
                Ok(None)
            }
            ReadOutcome::Corrupt(reason) => {
                Metrics::bump(&inner.metrics.corrupt);
                tracing::warn!(key, %reason, "corrupt entry removed and treated as a miss");
                self.l2_op(entries.delete_if_equal(key, stored)).await?;
                Ok(None)
            }
        }
    }
}
