//! The cache policy: the decisions a body asks for, one call per operation.
//!
//! These compose [`key`](crate::key), [`expiry`](crate::expiry) and
//! [`envelope`](crate::envelope) into the shape the WIT `policy` interface exports, so
//! that a host crosses the wasm boundary once per store operation.

use crate::envelope::{self, HEADER_LEN};
use crate::expiry::{self, EntryMeta, EntryOptions, Freshness};
use crate::{Arg, ArgError, Limits, key};

/// What a write stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The entry's metadata.
    pub meta: EntryMeta,
    /// The envelope header to put in front of the value.
    pub header: [u8; HEADER_LEN],
    /// An upper bound for the store's own TTL.
    pub store_ttl_ms: u64,
}

/// Plans a write of a `value_len`-byte value under `key` at `now_ms`.
///
/// # Errors
/// An [`ArgError`] naming the key, the value (over the limit) or the expiry option.
pub fn plan_set(
    key: &str,
    value_len: u64,
    options: &EntryOptions,
    now_ms: u64,
    limits: &Limits,
) -> Result<Plan, ArgError> {
    key::validate(key, limits)?;
    plan_value(value_len, options, now_ms, limits)
}

/// Plans a write of a `value_len`-byte value at `now_ms`, for a key already judged.
///
/// # Errors
/// An [`ArgError`] naming the value (over the limit) or the expiry option.
pub fn plan_value(
    value_len: u64,
    options: &EntryOptions,
    now_ms: u64,
    limits: &Limits,
) -> Result<Plan, ArgError> {
    if value_len > u64::from(limits.max_value_bytes) {
        return Err(ArgError::new(
            Arg::Value,
            format!(
                "is {value_len} bytes, over the limit of {}",
                limits.max_value_bytes
            ),
        ));
    }
    let meta = expiry::plan(options, now_ms, limits)?;
    Ok(Plan {
        meta,
        header: envelope::encode_header(&meta, value_len),
        store_ttl_ms: expiry::store_ttl_ms(&meta, now_ms),
    })
}

/// An entry a read found fresh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit {
    /// The metadata after the read's sliding touch.
    pub meta: EntryMeta,
    /// Where the value starts.
    pub value_offset: usize,
    /// The header to write back when the touch moved the expiry.
    pub new_header: Option<[u8; HEADER_LEN]>,
    /// The store TTL upper bound that goes with `meta`.
    pub store_ttl_ms: u64,
}

/// What a read of stored bytes found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Fresh: return the value.
    Fresh(Hit),
    /// Expired: a miss; remove it.
    Expired,
    /// A removal's tombstone: a miss; leave it (it lapses by its TTL).
    Removed,
    /// Not an envelope this version reads: a miss; remove it and count it.
    Corrupt(crate::Corruption),
}

/// What a removal writes, and for how long a store keeps it: a tombstone carrying the
/// removal's `nonce` (the body's, random; cut to [`envelope::TOMBSTONE_NONCE_MAX`]
/// bytes), which outlives any load that began before the removal and still holds its
/// flight lock (`lock_ttl_ms`), so that load's fill is refused (contract §5.12).
pub fn removal(lock_ttl_ms: u64, nonce: &[u8]) -> (Vec<u8>, u64) {
    let mut tombstone = envelope::TOMBSTONE.to_vec();
    tombstone.extend_from_slice(&nonce[..nonce.len().min(envelope::TOMBSTONE_NONCE_MAX)]);
    (
        tombstone,
        lock_ttl_ms.max(1).saturating_add(expiry::STORE_TTL_GRACE_MS),
    )
}

/// Reads stored bytes (`head` being at least their first [`HEADER_LEN`] bytes, or all of
/// them) at `now_ms`, applying the sliding touch of a read.
pub fn read(head: &[u8], total_len: u64, now_ms: u64, limits: &Limits) -> ReadOutcome {
    if envelope::is_tombstone(head, total_len) {
        return ReadOutcome::Removed;
    }
    let decoded = match envelope::decode_header(head, total_len, limits) {
        Ok(d) => d,
        Err(c) => return ReadOutcome::Corrupt(c),
    };
    match expiry::check(&decoded.meta, now_ms) {
        Freshness::Expired => ReadOutcome::Expired,
        Freshness::Fresh { meta, moved } => ReadOutcome::Fresh(Hit {
            meta,
            value_offset: decoded.value_offset,
            new_header: moved.then(|| envelope::encode_header(&meta, decoded.value_len as u64)),
            store_ttl_ms: expiry::store_ttl_ms(&meta, now_ms),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000;

    #[test]
    fn a_tombstone_reads_as_removed_and_anything_like_it_as_corrupt() {
        let l = Limits::default();
        let (tomb, ttl) = removal(30_000, b"0123456789abcdef");
        assert_eq!(read(&tomb, tomb.len() as u64, NOW, &l), ReadOutcome::Removed);
        assert!(ttl > 30_000);
        assert_ne!(
            tomb,
            removal(30_000, b"another removal").0,
            "no two removals alike"
        );
        assert!(matches!(read(&tomb, 64, NOW, &l), ReadOutcome::Corrupt(_)));
        assert!(matches!(read(b"CRL", 3, NOW, &l), ReadOutcome::Corrupt(_)));
    }

    #[test]
    fn plan_set_checks_the_key_first() {
        let err = plan_set(" ", 1, &EntryOptions::default(), NOW, &Limits::default()).unwrap_err();
        assert_eq!(err.arg, Arg::Key);
    }

    #[test]
    fn plan_set_rejects_a_value_over_the_limit() {
        let limits = Limits {
            max_value_bytes: 10,
            ..Limits::default()
        };
        assert!(plan_set("k", 10, &EntryOptions::default(), NOW, &limits).is_ok());
        let err = plan_set("k", 11, &EntryOptions::default(), NOW, &limits).unwrap_err();
        assert_eq!(err.arg, Arg::Value);
        assert!(err.reason.contains("over the limit of 10"), "{err}");
    }

    #[test]
    fn a_planned_write_reads_back_fresh_until_it_expires() {
        let opts = EntryOptions {
            relative_ms: Some(1_000),
            ..Default::default()
        };
        let plan = plan_set("k", 3, &opts, NOW, &Limits::default()).unwrap();
        let mut bytes = plan.header.to_vec();
        bytes.extend_from_slice(b"abc");
        let ReadOutcome::Fresh(hit) = read(&bytes, bytes.len() as u64, NOW + 999, &Limits::default()) else {
            panic!("expected fresh")
        };
        assert_eq!(&bytes[hit.value_offset..], b"abc");
        assert_eq!(hit.new_header, None, "no sliding, no touch");
        assert_eq!(
            read(&bytes, bytes.len() as u64, NOW + 1_000, &Limits::default()),
            ReadOutcome::Expired
        );
    }

    #[test]
    fn a_sliding_read_hands_back_the_header_to_write() {
        let opts = EntryOptions {
            sliding_ms: Some(1_000),
            ..Default::default()
        };
        let plan = plan_set("k", 1, &opts, NOW, &Limits::default()).unwrap();
        let mut bytes = plan.header.to_vec();
        bytes.push(b'x');
        let ReadOutcome::Fresh(hit) = read(&bytes, 2 + 31, NOW + 500, &Limits::default()) else {
            panic!("expected fresh")
        };
        assert_eq!(hit.meta.expires_at_ms, NOW + 1_500);
        let header = hit.new_header.expect("moved");
        assert_eq!(
            envelope::decode_header(&header, 33, &Limits::default())
                .unwrap()
                .meta,
            hit.meta
        );
    }

    #[test]
    fn unreadable_bytes_are_reported_corrupt_not_expired() {
        assert!(matches!(
            read(
                b"garbage-garbage-garbage-garbage-garbage",
                39,
                NOW,
                &Limits::default()
            ),
            ReadOutcome::Corrupt(_)
        ));
    }
}
