//! The lock table (`corral:lock/table`) on the bucket: an entry is a record the store
//! never drops (a release swaps in a free one), so that the key's fencing token rises
//! with every acquire; the lock protocol judges expiry, and reads and compare-and-swap
//! judge the same view, token included.

use corral_core::{kv, lock};

use crate::Adapter;
use crate::bindings::exports::corral::lock::table;
use crate::bindings::exports::corral::lock::types::Held;
use crate::l2::{change, with_bucket};
use crate::now_ms;

/// Where the table keeps `key`: apart from the cache's names.
fn name(key: &str) -> String {
    format!("corral-lock:{key}")
}

/// The record `live` holds, as the lock protocol reads it.
fn held_of(live: Option<&[u8]>) -> Option<lock::Held> {
    kv::held_in(live?)
}

/// The lock protocol's record of the table's `held`.
fn from_table(held: Held) -> lock::Held {
    lock::Held {
        owner: held.owner,
        expires_at_ms: held.expires_at_ms,
        token: held.token,
    }
}

/// The record of `held`: never gone from the store, so that its token outlives the
/// lock (the lock protocol judges its expiry).
fn record(held: &lock::Held) -> Vec<u8> {
    kv::record(kv::NEVER, &kv::held(held))
}

/// A store that fails answers as an empty or unchanged table: the lock export then
/// says a lock is free or was not taken, never that a caller holds one it does not.
/// (A failed read answered as no record gives a taker the token 1 only if its swap
/// lands, and a swap expecting no record fails over any record there.)
impl table::Guest for Adapter {
    fn get(key: String) -> Option<Held> {
        let stored = with_bucket(|bucket| Ok(bucket.get(&name(&key)).ok().flatten())).ok()??;
        let held = held_of(kv::live(&stored, now_ms()))?;
        Some(Held {
            owner: held.owner,
            expires_at_ms: held.expires_at_ms,
            token: held.token,
        })
    }

    fn compare_and_swap(key: String, expected: Option<Held>, new: Held) -> bool {
        let (expected, new) = (expected.map(from_table), from_table(new));
        change(&name(&key), |live| {
            // Every field, the token included.
            let equal = held_of(live) == expected;
            (equal.then(|| record(&new)), equal)
        })
        .unwrap_or(false)
    }
}
