//! One L2 read, as every operation does it: the store returns bytes, the guest judges
//! them, and this loop performs what the judgement asks (contract §3).
//!
//! A read costs the store one command. An entry that does not slide is read with a
//! `GET`. A sliding entry whose store keeps its expiry moment is read with `GETEX PX`,
//! which slides it in the same command; one whose envelope keeps the moment (a manual
//! clock over Redis) goes through the store's read-and-touch script. Which one a key
//! needs is learnt from its previous read ([`ReadHints`]); the first read of a key is a
//! `GET`, and the guest then asks for the slide to be written back, only over the very
//! bytes read (compare-and-replace), so it can never overwrite a newer value. A read
//! whose guess was stale (the key now holds another kind of entry) is put right the
//! same way. Expired and corrupt bytes are removed, again only if unchanged.

use std::fmt;

use bytes::Bytes;

use super::Corral;
use super::metrics::Metrics;
use crate::guest::policy::{NextRead, ReadOutcome, Touch, WitMeta};
use crate::{ErrorKind, Result};

/// How each key was last found to need reading, bounded like L1. A key not here (or
/// found not to slide) is read with a plain `GET`.
#[derive(Clone)]
pub(crate) struct ReadHints(moka::sync::Cache<String, NextRead>);

impl fmt::Debug for ReadHints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadHints")
            .field("keys", &self.0.entry_count())
            .finish()
    }
}

impl ReadHints {
    pub(crate) fn new(capacity: u64) -> Self {
        ReadHints(moka::sync::Cache::new(capacity.max(1_000)))
    }

    fn get(&self, key: &str) -> Option<NextRead> {
        self.0.get(key)
    }

    /// Records how the guest says `key` is to be read next, given the hint this read
    /// used.
    fn note(&self, key: &str, used: Option<NextRead>, next: NextRead) {
        match next {
            NextRead::Get if used.is_some() => self.0.invalidate(key),
            NextRead::Get => {}
            next if used != Some(next) => self.0.insert(key.to_owned(), next),
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
        let hint = inner.read_hints.get(name);
        // The read, and the TTL it set if it set one.
        let (read, slid_ms) = match hint {
            Some(NextRead::Script) => match entries.read_and_touch(name, now) {
                Some(touching) => (touching, None),
                None => (entries.get(name), None),
            },
            Some(NextRead::Expiring(ttl_ms)) => match entries.get_and_expire(name, ttl_ms) {
                Some(expiring) => (expiring, Some(ttl_ms)),
                None => (entries.get(name), None),
            },
            Some(NextRead::Get) | None => (entries.get(name), None),
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
        match inner.policy.read(&stored, now, slid_ms)? {
            ReadOutcome::Fresh(hit) => {
                let value = stored.slice(hit.value_offset as usize..);
                let ttl = hit.store_ttl_ms;
                match hit.touch {
                    Some(Touch::Rewrite(header)) => {
                        let mut touched = Vec::with_capacity(stored.len());
                        touched.extend_from_slice(&header);
                        touched.extend_from_slice(&value);
                        self.l2_op(entries.replace_if_equal(name, stored, touched.into(), ttl))
                            .await?;
                    }
                    Some(Touch::Expire) => {
                        self.l2_op(entries.replace_if_equal(name, stored.clone(), stored, ttl))
                            .await?;
                    }
                    None => {}
                }
                inner.read_hints.note(name, hint, hit.next_read);
                Ok(L2Read::Hit(value, hit.meta))
            }
            ReadOutcome::Removed(rearm) => {
                if rearm {
                    // The guess gave the tombstone a sliding TTL: give it a removal's.
                    let (_, ttl) = inner.policy.removal(inner.flight.lock_ttl_ms, b"")?;
                    self.l2_op(entries.replace_if_equal(name, stored.clone(), stored.clone(), ttl))
                        .await?;
                }
                Ok(L2Read::Miss { holds: Some(stored) })
            }
            ReadOutcome::Expired => remove(stored).await,
            ReadOutcome::Corrupt(reason) => {
                Metrics::bump(&inner.metrics.corrupt);
                tracing::warn!(name, %reason, "corrupt entry removed and treated as a miss");
                remove(stored).await
            }
        }
    }
}
