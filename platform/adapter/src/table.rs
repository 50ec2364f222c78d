//! The lock table (`corral:lock/table`) on the bucket: an entry is a record the store
//! never drops (a release swaps in a free one), so that the key's fencing token rises
//! with every acquire; the lock protocol judges expiry, and reads and compare-and-swap
//! judge the same view, token included.

use corral_core::kv;

use crate::Adapter;
use crate::bindings::exports::corral::lock::table;
use crate::bindings::exports::corral::lock::types::Held;
use crate::l2::{change, with_bucket};
use crate::now_ms;

/// Where the table keeps `key`: apart from the cache's names.
fn name(key: &str) -> String {
    format!("corral-lock:{key}")
}

fn held_of(live: Option<&[u8]>) -> Option<Held> {
    let held = kv::held_in(live?)?;
    Some(Held {
        owner: held.owner,
        expires_at_ms: held.expires_at_ms,
        token: held.token,
    })
}

fn same(a: Option<&Held>, b: Option<&Held>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.owner == b.owner && a.expires_at_ms == b.expires_at_ms && a.token == b.token,
        _ => false,
    }
}

/// The record of `held`: never gone from the store, so that its token outlives the
/// lock (the lock protocol judges its expiry).
fn record(held: &Held) -> Vec<u8> {
    let entry = corral_core::lock::Held {
        owner: held.owner.clone(),
        expires_at_ms: held.expires_at_ms,
        token: held.token,
    };
    kv::record(kv::NEVER, &kv::held(&entry))
}

/// A store that fails answers as an empty or unchanged table: the lock export then
/// says a lock is free or was not taken, never that a caller holds one it does not.
/// (A failed read answered as no record gives a taker the token 1 only if its swap
/// lands, and a swap expecting no record fails over any record there.)
impl table::Guest for Adapter {
    fn get(key: String) -> Option<Held> {
        let stored = with_bucket(|bucket| Ok(bucket.get(&name(&key)).ok().flatten())).ok()??;
        held_of(kv::live(&stored, now_ms()))
    }

    fn compare_and_swap(key: String, expected: Option<Held>, new: Held) -> bool {
        change(&name(&key), |live| {
            let equal = same(held_of(live).as_ref(), expected.as_ref());
            (equal.then(|| record(&new)), equal)
        })
        .unwrap_or(false)
    }
}
