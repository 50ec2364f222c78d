//! The lock table (`corral:lock/table`) on the bucket: an entry is a record gone at the
//! lock's expiry, so a taker finds an expired lock free without anyone deleting it, and
//! reads and compare-and-swap judge the same view.

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
    let (owner, expires_at_ms) = kv::held_in(live?)?;
    Some(Held { owner, expires_at_ms })
}

fn same(a: Option<&Held>, b: Option<&Held>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.owner == b.owner && a.expires_at_ms == b.expires_at_ms,
        _ => false,
    }
}

/// The record of `held`: gone at its expiry.
fn record(held: &Held) -> Vec<u8> {
    kv::record(held.expires_at_ms, &kv::held(&held.owner, held.expires_at_ms))
}

/// A store that fails answers as an empty or unchanged table: the lock export then
/// says a lock is free or was not taken, never that a caller holds one it does not.
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

    fn compare_and_delete(key: String, expected: Held) -> bool {
        change(&name(&key), |live| {
            let equal = same(held_of(live).as_ref(), Some(&expected));
            (equal.then(kv::tombstone), equal)
        })
        .unwrap_or(false)
    }
}
