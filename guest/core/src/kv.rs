//! Corral's data in a key-value store that expires nothing and changes a key only by
//! compare-and-swap (`wasi:keyvalue@0.2.0-draft2`): every stored value is a *record*, the
//! moment from which the store's copy counts as gone, then the bytes. A removal writes a
//! record already gone (a tombstone), through compare-and-swap like every conditional
//! change, so it never lands over a newer write; the get-or-set lock is a record that is
//! gone at its expiry, so a taker finds it free then without anyone deleting it. A lock
//! table entry ([`held`]) is never gone: it keeps its key's fencing token, and the lock
//! protocol judges its expiry.
//!
//! Reads and compare-and-swap judge the same view ([`live`]): what an adapter compares
//! with `expected` is what its reads return.

use crate::lock::Held;

/// A record that never counts as gone.
pub const NEVER: u64 = u64::MAX;

/// The bytes of a record's moment.
const MOMENT_LEN: usize = 8;

/// The record of `payload`, gone from `until_ms` (Unix ms) on.
pub fn record(until_ms: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MOMENT_LEN + payload.len());
    out.extend_from_slice(&until_ms.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A removal's record: gone already, at every moment.
pub fn tombstone() -> Vec<u8> {
    record(0, &[])
}

/// Until when a value stored at `now_ms` with a TTL of `ttl_ms` counts (saturating: a
/// TTL too long to represent never ends).
pub fn until(now_ms: u64, ttl_ms: u64) -> u64 {
    now_ms.saturating_add(ttl_ms)
}

/// What `stored` holds at `now_ms`: its bytes, or none once its moment came. Bytes too
/// short to be a record were not written by Corral: they count as they are, never gone
/// (the cache judges them, and removes them as foreign). Longer foreign bytes cannot be
/// told from a record: their first 8 bytes are read as its moment.
pub fn live(stored: &[u8], now_ms: u64) -> Option<&[u8]> {
    let Some((moment, payload)) = stored.split_first_chunk::<MOMENT_LEN>() else {
        return Some(stored);
    };
    (now_ms < u64::from_be_bytes(*moment)).then_some(payload)
}

/// The payload of a lock table entry: its expiry, its fencing token, then its owner.
pub fn held(held: &Held) -> Vec<u8> {
    let mut payload = Vec::with_capacity(2 * MOMENT_LEN + held.owner.len());
    payload.extend_from_slice(&held.expires_at_ms.to_be_bytes());
    payload.extend_from_slice(&held.token.to_be_bytes());
    payload.extend_from_slice(held.owner.as_bytes());
    payload
}

/// The lock table entry a payload holds; none for bytes that are not one (too short,
/// or an owner that is not UTF-8).
pub fn held_in(payload: &[u8]) -> Option<Held> {
    let (moment, rest) = payload.split_first_chunk::<MOMENT_LEN>()?;
    let (token, owner) = rest.split_first_chunk::<8>()?;
    let owner = std::str::from_utf8(owner).ok()?;
    Some(Held {
        owner: owner.to_owned(),
        expires_at_ms: u64::from_be_bytes(*moment),
        token: u64::from_be_bytes(*token),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_counts_until_its_moment_and_not_from_it() {
        let r = record(1_000, b"v");
        assert_eq!(live(&r, 999), Some(&b"v"[..]));
        assert_eq!(live(&r, 1_000), None);
        assert_eq!(live(&record(NEVER, b"v"), u64::MAX - 1), Some(&b"v"[..]));
    }

    #[test]
    fn a_tombstone_is_gone_at_every_moment() {
        assert_eq!(live(&tombstone(), 0), None);
        assert_eq!(live(&tombstone(), u64::MAX), None);
    }

    #[test]
    fn bytes_shorter_than_a_record_count_as_they_are() {
        assert_eq!(live(b"abc", 5), Some(&b"abc"[..]));
        assert_eq!(live(b"", 5), Some(&b""[..]));
    }

    #[test]
    fn an_empty_value_is_a_record_of_its_own() {
        let r = record(10, b"");
        assert_eq!(live(&r, 9), Some(&b""[..]));
        assert_ne!(r, tombstone());
    }

    #[test]
    fn a_ttl_at_the_edge_of_u64_never_ends() {
        assert_eq!(until(u64::MAX - 5, 10), NEVER);
        assert_eq!(until(5, u64::MAX), NEVER);
        assert_eq!(until(5, 10), 15);
    }

    #[test]
    fn a_lock_entry_round_trips_and_foreign_bytes_are_none() {
        let entry = Held {
            owner: "owner-1".into(),
            expires_at_ms: 42,
            token: u64::MAX,
        };
        assert_eq!(held_in(&held(&entry)), Some(entry));
        assert_eq!(held_in(b"short"), None);
        assert_eq!(held_in(&record(1, b"short")), None, "no token");
        assert_eq!(held_in(&record(1, &[0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0xfe])), None);
    }
}
