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
use crate::guest::policy::{ReadOutcome, WitMeta};
use crate::{ErrorKind, Result};

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

/// What one L2 read found.
#[derive(Debug)]
pub(crate) enum L2Read {
    /// A fresh entry: its value and (touched) metadata.
    Hit(Bytes, WitMeta),
    /// Nothing fresh. `holds` is what the key holds now as far as this read knows
    /// (nothing, or a removal's tombstone): a fill is fenced on it (contract §5.12).
    Miss { holds: Option<Bytes> },
}

impl Corral {
    /// Reads the entry `name` at `now`. Returns the value and its (touched) metadata
    /// when fresh.
    pub(crate) async fn l2_read(&self, name: &str, now: u64) -> Result<Option<(Bytes, WitMeta)>> {
        Ok(match self.l2_look(name, now).await? {
            L2Read::Hit(value, meta) => Some((value, meta)),
            L2Read::Miss { .. } => None,
        })
    }

    /// Reads the entry `name` at `now`, saying on a miss what the key holds.
    pub(crate) async fn l2_look(&self, name: &str, now: u64) -> Result<L2Read> {
        let inner = &*self.inner;
        let entries = &inner.stores.entries;
        let sliding = inner.sliding_keys.contains(name);
        let read = match sliding.then(|| entries.read_and_touch(name, now)).flatten() {
            Some(touching) => touching,
            None => entries.get(name),
        };
        let nothing = L2Read::Miss { holds: None };
        let stored = match read.await {
            Ok(Some(stored)) => stored,
            Ok(None) => return Ok(nothing),
            Err(e) if e.kind() == ErrorKind::Corrupt => {
                Metrics::bump(&inner.metrics.corrupt);
                tracing::warn!(name, error = %e, "corrupt entry removed and treated as a miss");
                self.l2_op(entries.delete_foreign(name)).await?;
                return Ok(nothing);
            }
            Err(e) => return Err(self.l2_failed(e)),
        };
        // Removes what the read found, unless it changed meanwhile.
        let remove = |stored: Bytes| async move {
            let removed = self.l2_op(entries.delete_if_equal(name, stored.clone())).await?;
            Ok::<_, crate::Error>(L2Read::Miss {
                holds: (!removed).then_some(stored),
            })
        };
        match inner.policy.read(&stored, now)? {
            ReadOutcome::Fresh(hit) => {
                let value = stored.slice(hit.value_offset as usize..);
                if let Some(header) = hit.new_header {
                    let mut touched = Vec::with_capacity(stored.len());
                    touched.extend_from_slice(&header);
                    touched.extend_from_slice(&value);
                    self.l2_op(entries.replace_if_equal(name, stored, touched.into(), hit.store_ttl_ms))
                        .await?;
                }
                inner
                    .sliding_keys
                    .note(name, sliding, hit.meta.sliding_ms.is_some());
                Ok(L2Read::Hit(value, hit.meta))
            }
            ReadOutcome::Removed => Ok(L2Read::Miss { holds: Some(stored) }),
            ReadOutcome::Expired => remove(stored).await,
            ReadOutcome::Corrupt(reason) => {
                Metrics::bump(&inner.metrics.corrupt);
                tracing::warn!(name, %reason, "corrupt entry removed and treated as a miss");
                remove(stored).await
            }
        }
    }
}
