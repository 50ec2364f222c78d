//! The cache policy: the decisions a body asks for, one call per operation.
//!
//! These compose [`key`], [`expiry`] and
//! [`envelope`] into the shape the WIT `policy` interface exports, so
//! that a host crosses the wasm boundary once per store operation.

use crate::envelope::{self, Header, Keeper, Tagged};
use crate::expiry::{self, EntryMeta, EntryOptions, Freshness};
use crate::{Arg, ArgError, Limits, key};

/// What a write stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The entry's metadata.
    pub meta: EntryMeta,
    /// The envelope header to put in front of the value.
    pub header: Header,
    /// The store's own TTL: an upper bound, or, for a sliding entry whose store keeps
    /// its expiry moment, exactly that moment.
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
    let keeper = keeper(&meta, limits);
    Ok(Plan {
        meta,
        header: envelope::encode_header(&meta, value_len, keeper),
        store_ttl_ms: store_ttl(&meta, keeper, now_ms),
    })
}

/// Where a new entry's expiry moment will live: in the store's TTL when the entry
/// slides and the store's TTLs run on the cache's clock (contract §3.1).
/// An entry with a stale window keeps its moment in the envelope: the store keeps the
/// bytes until the window ends.
fn keeper(meta: &EntryMeta, limits: &Limits) -> Keeper {
    if limits.sliding_in_store && meta.sliding_ms.is_some() && meta.stale_ms.is_none() {
        Keeper::Store
    } else {
        Keeper::Envelope
    }
}

/// The store TTL of an entry with `meta` at `now_ms`: the moment itself when the store
/// keeps it, else an upper bound with a grace for clocks that differ slightly.
fn store_ttl(meta: &EntryMeta, keeper: Keeper, now_ms: u64) -> u64 {
    match keeper {
        Keeper::Store => meta.expires_at_ms.saturating_sub(now_ms).max(1),
        Keeper::Envelope => expiry::store_ttl_ms(meta, now_ms),
    }
}

/// An entry a read found fresh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit {
    /// The metadata after the read's sliding touch.
    pub meta: EntryMeta,
    /// Where the value starts.
    pub value_offset: usize,
    /// What the reader must still do for the read's touch to last, if anything.
    pub touch: Option<Touch>,
    /// The store TTL that goes with `meta` (what a touch sets).
    pub store_ttl_ms: u64,
    /// How the next read of this key should read it.
    pub next_read: NextRead,
    /// A tagged entry's write moment and tags: the reader judges them by the tags'
    /// moments ([`crate::tags::judge`]) before serving it.
    pub tagged: Option<Tagged>,
}

/// The header and store TTL of a tagged write (contract §7.5): `header` (a plan's, for
/// a value of the length it says) re-encoded as version 4 with `tagged`. The entry
/// keeps its expiry moment in the envelope, so the store TTL is recomputed. With no
/// tags, `header` and `store_ttl_ms` as they are.
///
/// # Errors
/// An [`ArgError`] naming `tags` (see [`crate::tags::check`]).
pub fn tag_plan(
    header: &[u8],
    store_ttl_ms: u64,
    tagged: &Tagged,
    now_ms: u64,
    limits: &Limits,
) -> Result<(Vec<u8>, u64), ArgError> {
    crate::tags::check(&tagged.tags)?;
    if tagged.tags.is_empty() {
        return Ok((header.to_vec(), store_ttl_ms));
    }
    let value_len = header
        .get(28..32)
        .map_or(0, |b| u32::from_be_bytes(b.try_into().expect("4 bytes")));
    let total = header.len() as u64 + u64::from(value_len);
    let decoded = envelope::decode_header(header, total, limits)
        .map_err(|c| ArgError::new(Arg::Value, format!("not a header to tag: {c}")))?;
    let meta = decoded.meta;
    Ok((
        envelope::encode_tagged_header(&meta, u64::from(value_len), tagged),
        expiry::store_ttl_ms(&meta, now_ms),
    ))
}

/// What a reader writes back after a read, always only over the very bytes it read
/// (compare-and-replace), so that it never overwrites a newer value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Touch {
    /// Put this header in place of the old one, with the hit's store TTL: the read slid
    /// an expiry moment the envelope keeps.
    Rewrite(Header),
    /// Keep the bytes and set their store TTL to the hit's: the read slid a moment the
    /// store keeps, or undoes what a read that slid by a stale guess did.
    Expire,
}

/// How a reader reads a key next time, judging by what it held this time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextRead {
    /// A plain read (`GET`): the entry does not slide.
    Get,
    /// The store's read-and-touch script: the envelope keeps a sliding moment.
    Script,
    /// A read that sets the TTL to this many ms in the same step (`GETEX PX`): the
    /// store keeps a sliding moment with this interval.
    Expiring(u64),
}

impl NextRead {
    /// How to read next an entry whose envelope keeps its expiry (with `meta`, tagged or
    /// not): the script slides version-1 envelopes in place; an entry with a stale window
    /// or tags is read plainly and its touch written back.
    #[inline]
    pub fn of_envelope(meta: &EntryMeta, tagged: bool) -> Self {
        if meta.sliding_ms.is_some() && meta.stale_ms.is_none() && !tagged {
            NextRead::Script
        } else {
            NextRead::Get
        }
    }
}

/// What a read of stored bytes found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Fresh: return the value.
    Fresh(Hit),
    /// Past its expiry, within its stale window (fail-safe): a miss that a get-or-set
    /// may still serve if its reload fails; leave it in place (after its `touch`, which
    /// only ever undoes a read that set its TTL by a stale guess).
    Stale(Hit),
    /// Expired: a miss; remove it.
    Expired,
    /// A removal's tombstone: a miss; leave it (it lapses by its TTL). `rearm` says
    /// the read set its TTL by a guess (`GETEX`): the reader must give it back the TTL
    /// of a removal, so it still refuses the fills it was written to refuse.
    Removed {
        /// Whether to give the tombstone the TTL of a removal again.
        rearm: bool,
    },
    /// Not an envelope this version reads: a miss; remove it and count it.
    Corrupt(crate::Corruption),
}

/// What a soft invalidation (`expire`, contract §7.4) of stored bytes does. It always
/// changes the bytes, so a load that began before it cannot fill over it (fenced fills,
/// §5.12).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expire {
    /// The entry keeps a stale window: put this header in place of the old one (only
    /// over the very bytes read), with this store TTL. It is stale from now on, its
    /// window ending where it did.
    Rewrite {
        /// Whether it was fresh (else it was stale already).
        was_fresh: bool,
        /// The new header: expiring now.
        header: Header,
        /// The store TTL: until its stale window ends.
        store_ttl_ms: u64,
        /// Where the bytes kept after the new header start in the bytes read (the
        /// value, or a tagged entry's tag section and then its value).
        value_offset: usize,
    },
    /// Nothing to keep (no stale window, or removed, expired, corrupt): remove it, as a
    /// removal does (its tombstone refuses older fills). `was_fresh` says whether it was
    /// a fresh entry.
    Remove {
        /// Whether it was fresh.
        was_fresh: bool,
    },
}

/// Soft invalidation of stored bytes at `now_ms`: an entry with a stale window, fresh or
/// stale, is stale from now (kept for fail-safe until its window ends, where it ended);
/// anything else is removed. Missing bytes are removed too (by the body): a load that
/// began before cannot fill over it.
pub fn expire(head: &[u8], total_len: u64, now_ms: u64, limits: &Limits) -> Expire {
    let gone = Expire::Remove { was_fresh: false };
    if envelope::is_tombstone(head, total_len) {
        return gone;
    }
    let Ok(decoded) = envelope::decode_header(head, total_len, limits) else {
        return gone;
    };
    let meta = decoded.meta;
    let freshness = match decoded.keeper {
        Keeper::Envelope => expiry::check(&meta, now_ms),
        Keeper::Store if meta.absolute_ms.is_some_and(|a| now_ms >= a) => Freshness::Expired,
        Keeper::Store => Freshness::Fresh { meta, moved: false },
    };
    let was_fresh = match freshness {
        Freshness::Expired => return gone,
        Freshness::Stale => false,
        Freshness::Fresh { .. } => true,
    };
    if meta.stale_ms.is_none() {
        return Expire::Remove { was_fresh };
    }
    let gone_at = meta.gone_at_ms();
    let meta = EntryMeta {
        expires_at_ms: now_ms,
        stale_ms: Some(gone_at.saturating_sub(now_ms).max(1)),
        ..meta
    };
    // The new fixed header replaces the old one; what follows it (a tagged entry's
    // tags, the value) stays.
    Expire::Rewrite {
        was_fresh,
        header: envelope::rewrite_header(&decoded, &meta),
        store_ttl_ms: expiry::store_ttl_ms(&meta, now_ms),
        value_offset: decoded.fixed_len,
    }
}

impl ReadOutcome {
    /// Whether the read found a stale copy.
    pub fn is_stale(&self) -> bool {
        matches!(self, ReadOutcome::Stale(_))
    }
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

/// Reads stored bytes (`head` being at least their first [`HEADER_LEN`](crate::envelope::HEADER_LEN) bytes, or all of
/// them) at `now_ms`, applying the sliding touch of a read. `slid_ms` is the TTL the
/// read itself set, when it was a [`NextRead::Expiring`] read.
#[inline(always)]
pub fn read(head: &[u8], total_len: u64, now_ms: u64, limits: &Limits, slid_ms: Option<u64>) -> ReadOutcome {
    if envelope::is_tombstone(head, total_len) {
        return ReadOutcome::Removed {
            rearm: slid_ms.is_some(),
        };
    }
    let decoded = match envelope::decode_header(head, total_len, limits) {
        Ok(d) => d,
        Err(c) => return ReadOutcome::Corrupt(c),
    };
    let value_offset = decoded.value_offset;
    match decoded.keeper {
        Keeper::Envelope => match expiry::check(&decoded.meta, now_ms) {
            Freshness::Expired => ReadOutcome::Expired,
            Freshness::Stale => ReadOutcome::Stale(Hit {
                meta: decoded.meta,
                value_offset,
                touch: slid_ms.map(|_| Touch::Expire),
                store_ttl_ms: expiry::store_ttl_ms(&decoded.meta, now_ms),
                next_read: NextRead::Get,
                tagged: decoded.tagged,
            }),
            Freshness::Fresh { meta, moved } => {
                let touch = if moved {
                    // The fixed header only: a reader keeps the bytes after it.
                    Some(Touch::Rewrite(envelope::rewrite_header(&decoded, &meta)))
                } else {
                    // A guess set this entry's TTL: give it its own back.
                    slid_ms.map(|_| Touch::Expire)
                };
                ReadOutcome::Fresh(Hit {
                    meta,
                    value_offset,
                    touch,
                    store_ttl_ms: expiry::store_ttl_ms(&meta, now_ms),
                    next_read: NextRead::of_envelope(&meta, decoded.tagged.is_some()),
                    tagged: decoded.tagged,
                })
            }
        },
        // The store holds it, so it has not slid out; only its absolute point can have
        // passed. The read slides it to now + sliding, never past the absolute point.
        Keeper::Store => {
            let meta = decoded.meta;
            if meta.absolute_ms.is_some_and(|a| now_ms >= a) {
                return ReadOutcome::Expired;
            }
            let sliding = meta.sliding_ms.unwrap_or(limits.default_sliding_ms);
            let slid_to = now_ms.saturating_add(sliding).min(expiry::LATEST_EXPIRY_MS);
            let meta = EntryMeta {
                expires_at_ms: meta.absolute_ms.map_or(slid_to, |a| a.min(slid_to)),
                ..meta
            };
            let ttl = store_ttl(&meta, Keeper::Store, now_ms);
            ReadOutcome::Fresh(Hit {
                meta,
                value_offset,
                touch: (slid_ms != Some(ttl)).then_some(Touch::Expire),
                store_ttl_ms: ttl,
                next_read: NextRead::Expiring(sliding),
                tagged: None,
            })
        }
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
        assert_eq!(
            read(&tomb, tomb.len() as u64, NOW, &l, None),
            ReadOutcome::Removed { rearm: false }
        );
        assert!(ttl > 30_000);
        assert_ne!(
            tomb,
            removal(30_000, b"another removal").0,
            "no two removals alike"
        );
        assert!(matches!(read(&tomb, 64, NOW, &l, None), ReadOutcome::Corrupt(_)));
        assert!(matches!(read(b"CRL", 3, NOW, &l, None), ReadOutcome::Corrupt(_)));
    }

    fn fail_safe(relative_ms: u64, max_stale_ms: u64) -> EntryOptions {
        EntryOptions {
            relative_ms: Some(relative_ms),
            max_stale_ms: Some(max_stale_ms),
            ..EntryOptions::default()
        }
    }

    fn stored_with(options: &EntryOptions, value: &[u8]) -> Vec<u8> {
        let plan = plan_set("k", value.len() as u64, options, NOW, &Limits::default()).unwrap();
        [plan.header.as_bytes(), value].concat()
    }

    #[test]
    fn a_stale_copy_reads_as_stale_until_its_window_ends() {
        let l = Limits::default();
        let bytes = stored_with(&fail_safe(1_000, 5_000), b"v");
        let len = bytes.len() as u64;
        assert!(matches!(
            read(&bytes, len, NOW + 999, &l, None),
            ReadOutcome::Fresh(_)
        ));
        match read(&bytes, len, NOW + 1_000, &l, None) {
            ReadOutcome::Stale(hit) => {
                assert_eq!(&bytes[hit.value_offset..], b"v");
                assert_eq!(hit.touch, None);
                assert_eq!(hit.store_ttl_ms, 5_000 + expiry::STORE_TTL_GRACE_MS);
            }
            other => panic!("expected stale, got {other:?}"),
        }
        assert_eq!(read(&bytes, len, NOW + 6_000, &l, None), ReadOutcome::Expired);
    }

    #[test]
    fn expire_makes_a_fail_safe_entry_stale_now_and_removes_any_other() {
        let l = Limits::default();
        let bytes = stored_with(&fail_safe(60_000, 5_000), b"v");
        let len = bytes.len() as u64;
        let Expire::Rewrite {
            was_fresh,
            header,
            store_ttl_ms,
            value_offset,
        } = expire(&bytes, len, NOW + 10, &l)
        else {
            panic!("expected a rewrite");
        };
        assert!(was_fresh);
        // Stale from now; the window still ends where it did (60 s + 5 s after the set).
        assert_eq!(store_ttl_ms, 65_000 - 10 + expiry::STORE_TTL_GRACE_MS);
        let after = [header.as_bytes(), &bytes[value_offset..]].concat();
        assert_eq!(after.len(), bytes.len());
        assert!(matches!(
            read(&after, len, NOW + 10, &l, None),
            ReadOutcome::Stale(_)
        ));
        // Already stale: the bytes change all the same (a load that read them cannot fill
        // over the expire), and the window still ends where it did.
        let Expire::Rewrite {
            was_fresh, header, ..
        } = expire(&after, len, NOW + 20, &l)
        else {
            panic!("expected a rewrite");
        };
        assert!(!was_fresh);
        let again = [header.as_bytes(), &bytes[value_offset..]].concat();
        assert_ne!(again, after);
        assert!(read(&again, len, NOW + 60_000 + 5_000 - 1, &l, None).is_stale());
        assert_eq!(read(&again, len, NOW + 65_000, &l, None), ReadOutcome::Expired);
        let plain_opts = EntryOptions {
            max_stale_ms: None,
            ..fail_safe(60_000, 1)
        };
        let plain_bytes = stored_with(&plain_opts, b"v");
        assert_eq!(
            expire(&plain_bytes, plain_bytes.len() as u64, NOW, &l),
            Expire::Remove { was_fresh: true }
        );
        let (tomb, _) = removal(30_000, b"n");
        assert_eq!(
            expire(&tomb, tomb.len() as u64, NOW, &l),
            Expire::Remove { was_fresh: false }
        );
        assert_eq!(expire(b"junk", 4, NOW, &l), Expire::Remove { was_fresh: false });
    }

    #[test]
    fn a_tagged_write_reads_back_with_its_tags_and_slides_keeping_them() {
        let l = in_store();
        let opts = EntryOptions {
            sliding_ms: Some(1_000),
            ..Default::default()
        };
        let plan = plan_set("k", 3, &opts, NOW, &l).unwrap();
        assert_eq!(plan.header[3], envelope::STORE_KEPT_VERSION);
        let tagged = Tagged {
            written_at_ms: NOW,
            tags: vec!["a".into(), "b".into()],
        };
        let (header, ttl) = tag_plan(&plan.header, plan.store_ttl_ms, &tagged, NOW, &l).unwrap();
        assert_eq!(header[3], envelope::TAGGED_VERSION);
        assert_eq!(
            ttl,
            1_000 + expiry::STORE_TTL_GRACE_MS,
            "the envelope keeps its moment"
        );
        let bytes = [&header[..], b"abc"].concat();
        let ReadOutcome::Fresh(hit) = read(&bytes, bytes.len() as u64, NOW + 500, &l, None) else {
            panic!("fresh")
        };
        assert_eq!(&bytes[hit.value_offset..], b"abc");
        assert_eq!(hit.tagged.as_ref(), Some(&tagged));
        assert_eq!(
            hit.next_read,
            NextRead::Get,
            "the script slides untagged entries only"
        );
        let Some(Touch::Rewrite(fixed)) = hit.touch else {
            panic!("a slide")
        };
        let touched = [fixed.as_bytes(), &bytes[fixed.len()..]].concat();
        let ReadOutcome::Fresh(again) = read(&touched, touched.len() as u64, NOW + 1_400, &l, None) else {
            panic!("slid")
        };
        assert_eq!(
            (again.tagged, &touched[again.value_offset..]),
            (Some(tagged.clone()), &b"abc"[..])
        );
        // expire keeps the tags too.
        let stale = EntryOptions {
            max_stale_ms: Some(5_000),
            ..opts
        };
        let plan = plan_set("k", 1, &stale, NOW, &l).unwrap();
        let (header, _) = tag_plan(&plan.header, plan.store_ttl_ms, &tagged, NOW, &l).unwrap();
        let bytes = [&header[..], b"v"].concat();
        let Expire::Rewrite {
            header, value_offset, ..
        } = expire(&bytes, bytes.len() as u64, NOW + 1, &l)
        else {
            panic!("rewrite")
        };
        let after = [header.as_bytes(), &bytes[value_offset..]].concat();
        let ReadOutcome::Stale(hit) = read(&after, after.len() as u64, NOW + 1, &l, None) else {
            panic!("stale")
        };
        assert_eq!(hit.tagged, Some(tagged.clone()));
        // Bad tags are argument errors naming `tags`.
        let too_many = Tagged {
            written_at_ms: NOW,
            tags: vec!["t".into(); 17],
        };
        assert_eq!(
            tag_plan(&plan.header, 1, &too_many, NOW, &l).unwrap_err().arg,
            Arg::Tags
        );
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
        let ReadOutcome::Fresh(hit) = read(&bytes, bytes.len() as u64, NOW + 999, &Limits::default(), None)
        else {
            panic!("expected fresh")
        };
        assert_eq!(&bytes[hit.value_offset..], b"abc");
        assert_eq!(hit.touch, None, "no sliding, no touch");
        assert_eq!(hit.next_read, NextRead::Get);
        assert_eq!(
            read(&bytes, bytes.len() as u64, NOW + 1_000, &Limits::default(), None),
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
        let ReadOutcome::Fresh(hit) = read(&bytes, 2 + 31, NOW + 500, &Limits::default(), None) else {
            panic!("expected fresh")
        };
        assert_eq!(hit.meta.expires_at_ms, NOW + 1_500);
        assert_eq!(hit.next_read, NextRead::Script);
        let Some(Touch::Rewrite(header)) = hit.touch else {
            panic!("expected a rewrite, got {:?}", hit.touch)
        };
        assert_eq!(
            envelope::decode_header(&header, 33, &Limits::default())
                .unwrap()
                .meta,
            hit.meta
        );
    }

    fn stored(plan: &Plan, value: &[u8]) -> Vec<u8> {
        let mut bytes = plan.header.to_vec();
        bytes.extend_from_slice(value);
        bytes
    }

    fn in_store() -> Limits {
        Limits {
            sliding_in_store: true,
            ..Limits::default()
        }
    }

    #[test]
    fn a_store_that_keeps_the_moment_gets_it_exactly_and_slides_it_in_one_step() {
        let l = in_store();
        let opts = EntryOptions {
            sliding_ms: Some(1_000),
            ..Default::default()
        };
        let plan = plan_set("k", 1, &opts, NOW, &l).unwrap();
        assert_eq!(plan.header[3], envelope::STORE_KEPT_VERSION);
        assert_eq!(plan.store_ttl_ms, 1_000, "the moment itself, no grace");
        let bytes = stored(&plan, b"x");
        // Read plainly: the reader still owes the slide.
        let ReadOutcome::Fresh(hit) = read(&bytes, 33, NOW + 900, &l, None) else {
            panic!("fresh")
        };
        assert_eq!(hit.touch, Some(Touch::Expire));
        assert_eq!(hit.store_ttl_ms, 1_000);
        assert_eq!(hit.meta.expires_at_ms, NOW + 1_900);
        assert_eq!(hit.next_read, NextRead::Expiring(1_000));
        // Read with GETEX PX 1000: nothing left to do. Long past the written
        // expires-at, the store's holding it is what counts.
        let ReadOutcome::Fresh(hit) = read(&bytes, 33, NOW + 5_000, &l, Some(1_000)) else {
            panic!("fresh")
        };
        assert_eq!(hit.touch, None);
        assert_eq!(hit.meta.expires_at_ms, NOW + 6_000);
        // Whatever the reader's own setting: the entry says who keeps the moment.
        let ReadOutcome::Fresh(hit) = read(&bytes, 33, NOW + 5_000, &Limits::default(), Some(1_000)) else {
            panic!("fresh")
        };
        assert_eq!(hit.touch, None);
    }

    #[test]
    fn a_store_kept_slide_never_passes_the_absolute_point() {
        let l = in_store();
        let opts = EntryOptions {
            sliding_ms: Some(1_000),
            absolute_ms: Some(NOW + 1_500),
            ..Default::default()
        };
        let plan = plan_set("k", 1, &opts, NOW, &l).unwrap();
        let bytes = stored(&plan, b"x");
        let ReadOutcome::Fresh(hit) = read(&bytes, 33, NOW + 1_000, &l, Some(1_000)) else {
            panic!("fresh")
        };
        assert_eq!(hit.meta.expires_at_ms, NOW + 1_500);
        assert_eq!(
            (hit.touch, hit.store_ttl_ms),
            (Some(Touch::Expire), 500),
            "cut back to the point"
        );
        assert_eq!(
            read(&bytes, 33, NOW + 1_500, &l, Some(1_000)),
            ReadOutcome::Expired
        );
    }

    #[test]
    fn a_read_that_slid_by_a_stale_guess_gives_the_entry_its_own_ttl_back() {
        let l = in_store();
        let fixed = EntryOptions {
            relative_ms: Some(60_000),
            ..Default::default()
        };
        let plan = plan_set("k", 1, &fixed, NOW, &l).unwrap();
        assert_eq!(
            plan.header[3],
            envelope::VERSION,
            "only sliding entries are kept by the store"
        );
        let bytes = stored(&plan, b"x");
        let ReadOutcome::Fresh(hit) = read(&bytes, 33, NOW + 10_000, &l, Some(1_000)) else {
            panic!("fresh")
        };
        assert_eq!(hit.touch, Some(Touch::Expire));
        assert_eq!(hit.store_ttl_ms, 50_000 + expiry::STORE_TTL_GRACE_MS);
        assert_eq!(hit.next_read, NextRead::Get);
        let (tomb, _) = removal(30_000, b"n");
        assert_eq!(
            read(&tomb, tomb.len() as u64, NOW, &l, Some(1_000)),
            ReadOutcome::Removed { rearm: true }
        );
    }

    #[test]
    fn unreadable_bytes_are_reported_corrupt_not_expired() {
        assert!(matches!(
            read(
                b"garbage-garbage-garbage-garbage-garbage",
                39,
                NOW,
                &Limits::default(),
                None
            ),
            ReadOutcome::Corrupt(_)
        ));
    }
}
