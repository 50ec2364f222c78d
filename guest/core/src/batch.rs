//! Many keys at once (contract §5.16): what a bulk get-or-set decides for all its keys
//! in one step, so a body asks once per batch, not once per key.
//!
//! Each key of a batch is still a flight of its own ([`crate::flight`]), with every
//! promise of one. What is decided here for the batch as a whole:
//! - every key is checked and its entry named before anything runs
//!   ([`names::entries_in`]): a bad key fails the call, naming its position, whatever is
//!   cached;
//! - the keys' first reads, made together, are judged together ([`read_many`]): a
//!   fresh hit with nothing left to do (no touch to write back, no tags to judge) is
//!   answered from that read alone (L1 serves it until its
//!   [`l1_deadline`](crate::flight::l1_deadline)); every other key goes on to its flight;
//! - the loader is called with the keys that reach their loads together, at most
//!   `max_batch` per call ([`calls`]).

use crate::envelope;
use crate::expiry::{self, Freshness};
#[cfg(doc)]
use crate::names;
use crate::policy::{self, NextRead, ReadOutcome};
use crate::{Arg, ArgError, Corruption, Limits, flight};

/// How many leading bytes of each first read a body passes to [`judge`]: every fixed
/// header, and an entry's tags up to 207 bytes in all (five of 40, say). A batch of large
/// values crosses the boundary at this much a read, not at the longest header
/// ([`envelope::MAX_HEADER_LEN`]); a read whose header goes past it (many or long tags)
/// is judged [`Judged::Alone`].
pub const HEAD_LEN: usize = 256;

/// What a first read found for one key of a batch: the stored bytes' head, their whole
/// length, and the TTL the read set if it slid the entry (`GETEX`).
#[derive(Clone, Copy, Debug)]
pub struct FirstRead<'a> {
    /// The stored bytes' first [`HEAD_LEN`] bytes or more (all of them, if fewer).
    pub head: &'a [u8],
    /// The length of the stored bytes.
    pub total_len: u64,
    /// The TTL the read set, if it set one.
    pub slid_ms: Option<u64>,
}

/// One first read, judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Judged {
    /// A fresh entry that leaves nothing to do (no touch to write back, no tags to
    /// judge): its value is served from this read alone.
    Served(Served),
    /// Anything else, as [`policy::read`] judges it: the key goes on to its flight with
    /// it (a fresh entry, to its touch or its tags' judgement).
    Flies {
        /// The judgement of the bytes.
        outcome: ReadOutcome,
        /// For a fresh entry, the moment until which L1 may serve it; 0 otherwise.
        l1_until_ms: u64,
    },
    /// Its header goes on past the head passed: the body judges it alone, with
    /// [`policy::read`] and its whole header, and it flies on with that judgement.
    Alone,
}

/// A first read served from itself alone: what a body needs to answer it, and no more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    /// Where the value starts in the stored bytes.
    pub value_offset: usize,
    /// How the next read of this key should read it: never [`NextRead::Expiring`] (a
    /// read that slides in the store has a TTL to set: it flies).
    pub next_read: NextRead,
    /// The moment until which L1 may serve it.
    pub l1_until_ms: u64,
    /// Until when this judgement holds for the same head (0: it does not, past its own
    /// moment): at any moment `now` before it, a read whose first
    /// [`kept_len`](Self::kept_len) bytes and whole length are this read's is served the
    /// same way (the same value offset and next read), L1 until the earlier of this
    /// moment and `now` plus the L1 TTL. So a body may keep the judgement of a head it
    /// reads again (an entry read many times over its life) instead of asking anew; the
    /// rule stays here.
    pub keep_until_ms: u64,
    /// How many leading bytes of the read the judgement depends on (its header; 0 when
    /// not kept).
    pub kept_len: usize,
}

impl Served {
    /// This judgement, for a read with the same kept bytes and length at `now_ms`, given
    /// the cache's `l1_ttl_ms`; `None` past [`keep_until_ms`](Self::keep_until_ms) (or
    /// for a judgement not kept).
    pub fn again_at(&self, now_ms: u64, l1_ttl_ms: u64) -> Option<Served> {
        (now_ms < self.keep_until_ms).then(|| Served {
            l1_until_ms: self.keep_until_ms.min(now_ms.saturating_add(l1_ttl_ms)),
            ..*self
        })
    }
}

/// Judges the first reads of a batch's keys at `now_ms`, in order.
pub fn read_many(reads: &[FirstRead<'_>], now_ms: u64, limits: &Limits, l1_ttl_ms: u64) -> Vec<Judged> {
    reads
        .iter()
        .map(|read| judge(read, now_ms, limits, l1_ttl_ms))
        .collect()
}

/// Judges one first read of a batch at `now_ms` (see [`read_many`]).
pub fn judge(read: &FirstRead<'_>, now_ms: u64, limits: &Limits, l1_ttl_ms: u64) -> Judged {
    match served_plainly(read, now_ms, limits, l1_ttl_ms) {
        Some(served) => Judged::Served(served),
        None => judged_in_full(read, now_ms, limits, l1_ttl_ms),
    }
}

/// Judges a first read from [`policy::read`]'s whole judgement (see [`read_many`]).
#[inline(never)]
fn judged_in_full(read: &FirstRead<'_>, now_ms: u64, limits: &Limits, l1_ttl_ms: u64) -> Judged {
    match policy::read(read.head, read.total_len, now_ms, limits, read.slid_ms) {
        // Read whole, the header may decode: a head cut short of the longest header
        // that ran out before the header ended says nothing of the entry. (Every other
        // corruption is in the bytes the head holds, or in the lengths: judged as read.)
        ReadOutcome::Corrupt(Corruption::Truncated { .. })
            if (read.head.len() as u64) < read.total_len.min(envelope::MAX_HEADER_LEN as u64) =>
        {
            Judged::Alone
        }
        ReadOutcome::Fresh(hit)
            if hit.touch.is_none()
                && hit.tagged.is_none()
                && !matches!(hit.next_read, NextRead::Expiring(_)) =>
        {
            Judged::Served(Served {
                value_offset: hit.value_offset,
                next_read: hit.next_read,
                l1_until_ms: flight::l1_deadline(&hit.meta, now_ms, l1_ttl_ms),
                keep_until_ms: 0,
                kept_len: 0,
            })
        }
        ReadOutcome::Fresh(hit) => Judged::Flies {
            l1_until_ms: flight::l1_deadline(&hit.meta, now_ms, l1_ttl_ms),
            outcome: ReadOutcome::Fresh(hit),
        },
        outcome => Judged::Flies {
            outcome,
            l1_until_ms: 0,
        },
    }
}

/// The common read of a batch, judged the short way: an untagged entry whose envelope
/// keeps its expiry (version 1, or 3 with a stale window), fresh and not moved by its
/// read, read with no TTL set. Such a read is served just as [`policy::read`] would judge
/// it (its decoding, expiry and next read are the same functions), without building the
/// [`ReadOutcome`] a flight needs; `None` for any other read, judged in full.
#[inline]
fn served_plainly(read: &FirstRead<'_>, now_ms: u64, limits: &Limits, l1_ttl_ms: u64) -> Option<Served> {
    let version = *read.head.get(3)?;
    if read.slid_ms.is_some() || !(version == envelope::VERSION || version == envelope::STALE_VERSION) {
        return None;
    }
    let decoded = envelope::decode_header(read.head, read.total_len, limits).ok()?;
    match expiry::check(&decoded.meta, now_ms) {
        Freshness::Fresh { meta, moved: false } => {
            // Without a sliding interval nothing here moves with the moment but its
            // L1 deadline: fresh until it expires, at any earlier moment, and L1 until
            // the earlier of its expiry and the moment plus the L1 TTL
            // (`flight::l1_deadline`). A sliding entry's judgement is not kept.
            let kept = meta.sliding_ms.is_none();
            Some(Served {
                value_offset: decoded.value_offset,
                next_read: NextRead::of_envelope(&meta, false),
                l1_until_ms: flight::l1_deadline(&meta, now_ms, l1_ttl_ms),
                keep_until_ms: if kept { meta.expires_at_ms } else { 0 },
                kept_len: if kept { decoded.fixed_len } else { 0 },
            })
        }
        _ => None,
    }
}

/// `e`, about the key at position `at` of a batch, saying so.
pub fn at_position(at: usize, e: ArgError) -> ArgError {
    ArgError::new(e.arg, format!("{} (the key at position {at})", e.reason))
}

/// Checks the keys of a batch begun in two phases (the portable body's `begin-many`),
/// before anything runs: each passes the key rules, and none comes twice (each key's
/// load is handed out once).
///
/// # Errors
/// An [`ArgError`] naming `key` or `keys`, with the position of the first bad key.
pub fn check_distinct<S: AsRef<str>>(keys: &[S], limits: &Limits) -> Result<(), ArgError> {
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    for (at, key) in keys.iter().enumerate() {
        let key = key.as_ref();
        crate::key::validate(key, limits).map_err(|e| at_position(at, e))?;
        if !seen.insert(key) {
            let twice = ArgError::new(Arg::Keys, "a key is named twice");
            return Err(at_position(at, twice));
        }
    }
    Ok(())
}

/// Checks a batch's `max_batch`: at least one key per loader call.
///
/// # Errors
/// An [`ArgError`] naming `max_batch`.
pub fn check_max_batch(max_batch: u64) -> Result<(), ArgError> {
    if max_batch == 0 {
        return Err(ArgError::new(
            Arg::Setting("max_batch"),
            "must be at least 1 key per loader call",
        ));
    }
    Ok(())
}

/// How `ready` keys that reached their loads together are split into loader calls: the
/// sizes of the calls, in order, each at most `max_batch` (no limit when `None`).
pub fn calls(ready: u64, max_batch: Option<u64>) -> Vec<u64> {
    let size = max_batch.unwrap_or(u64::MAX).max(1);
    let mut left = ready;
    let mut sizes = Vec::new();
    while left > 0 {
        let call = left.min(size);
        sizes.push(call);
        left -= call;
    }
    sizes
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::envelope::Keeper;
    use crate::expiry::{EntryMeta, EntryOptions};

    /// Stored bytes of every shape a read can find: an envelope of any version (a stale
    /// window, tags, kept by the store, sliding or not), a tombstone, or bytes cut short,
    /// mangled or foreign.
    fn any_stored() -> impl Strategy<Value = Vec<u8>> {
        let meta = (
            proptest::option::of(1u64..4_000),
            proptest::option::of(1u64..4_000),
            1u64..4_000,
            proptest::option::of(1u64..4_000),
        )
            .prop_filter("some expiration", |(a, s, _, _)| a.is_some() || s.is_some())
            .prop_map(|(absolute_ms, sliding_ms, e, stale_ms)| EntryMeta {
                absolute_ms,
                sliding_ms,
                expires_at_ms: absolute_ms.map_or(e, |a| a.min(e)),
                stale_ms,
            });
        let keeper = prop_oneof![Just(Keeper::Envelope), Just(Keeper::Store)];
        let envelope = (
            meta,
            keeper,
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 0..8),
        )
            .prop_map(|(meta, keeper, tagged, value)| {
                if tagged {
                    let tagged = envelope::Tagged {
                        written_at_ms: 5,
                        tags: vec!["t".into()],
                    };
                    [
                        envelope::encode_tagged_header(&meta, value.len() as u64, &tagged),
                        value,
                    ]
                    .concat()
                } else {
                    envelope::encode(&meta, &value, keeper)
                }
            });
        // What a body may find instead: the envelope cut, a byte changed, or a tombstone.
        (envelope, 0usize..4, any::<usize>(), any::<u8>()).prop_map(|(mut bytes, how, at, byte)| {
            match how {
                0 => {}
                1 => bytes.truncate(at % (bytes.len() + 1)),
                2 => {
                    let at = at % bytes.len();
                    bytes[at] = byte;
                }
                _ => bytes = [&envelope::TOMBSTONE[..], &[byte]].concat(),
            }
            bytes
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]
        /// The short way serves a read only as the whole judgement would.
        #[test]
        fn a_read_served_the_short_way_is_judged_as_in_full(
            stored in any_stored(),
            now_ms in 0u64..5_000,
            slid in proptest::option::weighted(0.2, 1u64..4_000),
            head_cut in prop_oneof![Just(usize::MAX), 0usize..80],
        ) {
            let limits = Limits::default();
            let read = FirstRead {
                head: &stored[..head_cut.min(stored.len())],
                total_len: stored.len() as u64,
                slid_ms: slid,
            };
            if let Some(served) = served_plainly(&read, now_ms, &limits, 1_000) {
                let in_full = judged_in_full(&read, now_ms, &limits, 1_000);
                let Judged::Served(whole) = in_full else {
                    return Err(TestCaseError::fail(format!("served the short way only: {in_full:?}")));
                };
                // The same, but for what is kept (the whole judgement keeps nothing).
                prop_assert_eq!(Served { keep_until_ms: 0, kept_len: 0, ..served }, whole);
            }
        }

        /// A kept judgement is the judgement of any read with the same kept bytes and
        /// length, at any moment before it lapses; past it, it is not given.
        #[test]
        fn a_kept_judgement_is_the_judgement_of_the_same_head_at_any_earlier_moment(
            stored in any_stored(),
            first_ms in 0u64..5_000,
            again_ms in 0u64..5_000,
            l1_ttl_ms in prop_oneof![Just(0u64), 1u64..3_000, Just(u64::MAX)],
            noise in proptest::collection::vec(any::<u8>(), 300),
            max_value_bytes in prop_oneof![Just(Limits::default().max_value_bytes), 0u32..10],
            sliding_in_store in any::<bool>(),
        ) {
            // Any limits, the same for both reads (a cache's are fixed).
            let limits = Limits { max_value_bytes, sliding_in_store, ..Limits::default() };
            let read = FirstRead { head: &stored, total_len: stored.len() as u64, slid_ms: None };
            let Judged::Served(served) = judge(&read, first_ms, &limits, l1_ttl_ms) else {
                return Ok(());
            };
            if served.keep_until_ms == 0 {
                prop_assert_eq!(served.kept_len, 0);
                prop_assert_eq!(served.again_at(again_ms, l1_ttl_ms), None);
                return Ok(());
            }
            prop_assert!(first_ms < served.keep_until_ms);
            prop_assert_eq!(served.again_at(first_ms, l1_ttl_ms), Some(served));
            // Another read: the kept bytes, then anything, as long.
            let mut other = stored[..served.kept_len].to_vec();
            other.extend(noise.iter().cycle().take(stored.len() - served.kept_len));
            let again = FirstRead { head: &other, total_len: stored.len() as u64, slid_ms: None };
            let judged = judge(&again, again_ms, &limits, l1_ttl_ms);
            match served.again_at(again_ms, l1_ttl_ms) {
                Some(kept) => prop_assert_eq!(judged, Judged::Served(kept)),
                None => prop_assert!(again_ms >= served.keep_until_ms),
            }
        }
    }

    #[test]
    fn calls_split_by_max_batch() {
        assert_eq!(calls(25, Some(10)), [10, 10, 5]);
        assert_eq!(calls(3, None), [3]);
        assert_eq!(calls(0, Some(4)), Vec::<u64>::new());
        assert_eq!(calls(2, Some(0)), [1, 1], "a call has one key at least");
        assert_eq!(calls(u64::MAX, None), [u64::MAX]);
    }

    #[test]
    fn a_batch_names_its_first_bad_key_by_position() {
        let limits = Limits::default();
        assert!(check_distinct(&["a", "b"], &limits).is_ok());
        let e = check_distinct(&["a", "", "b"], &limits).unwrap_err();
        assert_eq!(e.arg, Arg::Key);
        assert!(e.reason.ends_with("(the key at position 1)"), "{}", e.reason);
        let e = check_distinct(&["a", "b", "a"], &limits).unwrap_err();
        assert_eq!(e.arg, Arg::Keys);
        assert_eq!(e.reason, "a key is named twice (the key at position 2)");
        let (at, e) = crate::names::entries_in("p:", &["a", ""], 0, &limits).unwrap_err();
        assert_eq!(at, 1);
        assert!(e.reason.ends_with("(the key at position 1)"), "{}", e.reason);
    }

    #[test]
    fn max_batch_zero_is_named() {
        let e = check_max_batch(0).unwrap_err();
        assert_eq!(e.arg.name(), "max_batch");
        assert!(check_max_batch(1).is_ok());
    }

    #[test]
    fn fresh_reads_get_their_l1_deadline_and_the_rest_none() {
        let limits = Limits::default();
        let now = 1_000_000;
        let options = EntryOptions {
            relative_ms: Some(60_000),
            ..EntryOptions::default()
        };
        let plan = policy::plan_set("k", 3, &options, now, &limits).unwrap();
        let mut stored = plan.header.to_vec();
        stored.extend_from_slice(b"abc");
        let reads = [
            FirstRead {
                head: &stored,
                total_len: stored.len() as u64,
                slid_ms: None,
            },
            FirstRead {
                head: b"not an envelope",
                total_len: 15,
                slid_ms: None,
            },
        ];
        let judged = read_many(&reads, now + 10, &limits, 5_000);
        let Judged::Served(served) = judged[0] else {
            panic!("a plain fresh entry is served from its read: {:?}", judged[0]);
        };
        assert_eq!(served.value_offset, plan.header.len());
        assert_eq!(served.next_read, NextRead::Get);
        assert_eq!(served.l1_until_ms, now + 10 + 5_000);
        assert!(matches!(
            judged[1],
            Judged::Flies {
                outcome: ReadOutcome::Corrupt(_),
                l1_until_ms: 0
            }
        ));
    }

    #[test]
    fn a_read_that_slides_in_the_store_is_never_served_from_itself() {
        let limits = Limits {
            sliding_in_store: true,
            ..Limits::default()
        };
        let now = 1_000_000;
        let options = EntryOptions {
            sliding_ms: Some(1_000),
            ..EntryOptions::default()
        };
        let plan = policy::plan_set("k", 1, &options, now, &limits).unwrap();
        let mut stored = plan.header.to_vec();
        stored.extend_from_slice(b"x");
        // Even read with its slide already made (`GETEX PX`, nothing left to do): its
        // next read sets a TTL, which a batch served from its read would not know.
        for slid_ms in [None, Some(1_000)] {
            let read = FirstRead {
                head: &stored,
                total_len: stored.len() as u64,
                slid_ms,
            };
            let judged = judge(&read, now + 10, &limits, 5_000);
            assert!(
                matches!(
                    judged,
                    Judged::Flies {
                        outcome: ReadOutcome::Fresh(_),
                        ..
                    }
                ),
                "{judged:?}"
            );
        }
    }

    #[test]
    fn a_header_longer_than_the_head_passed_is_judged_alone() {
        let limits = Limits::default();
        let now = 1_000_000;
        let tags: Vec<String> = (0..8).map(|n| format!("a-tag-of-some-length-{n:>20}")).collect();
        let options = EntryOptions {
            relative_ms: Some(60_000),
            ..EntryOptions::default()
        };
        let plan = policy::plan_set("k", 1_000, &options, now, &limits).unwrap();
        let tagged = crate::envelope::Tagged {
            written_at_ms: now,
            tags,
        };
        let mut stored = envelope::encode_tagged_header(&plan.meta, 1_000, &tagged);
        assert!(stored.len() > HEAD_LEN);
        stored.extend_from_slice(&[7; 1_000]);
        let judge_at = |stored: &[u8], cut: usize| {
            let read = FirstRead {
                head: &stored[..cut.min(stored.len())],
                total_len: stored.len() as u64,
                slid_ms: None,
            };
            judge(&read, now + 10, &limits, 5_000)
        };
        assert_eq!(judge_at(&stored, HEAD_LEN), Judged::Alone);
        // Whole, its header decodes: it flies, to its tags' judgement.
        assert!(matches!(
            judge_at(&stored, envelope::MAX_HEADER_LEN),
            Judged::Flies {
                outcome: ReadOutcome::Fresh(_),
                ..
            }
        ));
        // Bytes that are no envelope are corrupt, from their head as whole.
        stored[0] = b'x';
        assert!(matches!(
            judge_at(&stored, HEAD_LEN),
            Judged::Flies {
                outcome: ReadOutcome::Corrupt(_),
                ..
            }
        ));
        assert!(matches!(
            judge_at(&stored, envelope::MAX_HEADER_LEN),
            Judged::Flies {
                outcome: ReadOutcome::Corrupt(_),
                ..
            }
        ));
        // An untagged entry with a large value is judged from its head alone.
        let plain = policy::plan_set("k", 1_000, &options, now, &limits).unwrap();
        let mut stored = plain.header.to_vec();
        stored.extend_from_slice(&[7; 1_000]);
        let read = FirstRead {
            head: &stored[..HEAD_LEN],
            total_len: stored.len() as u64,
            slid_ms: None,
        };
        assert!(matches!(
            judge(&read, now + 10, &limits, 5_000),
            Judged::Served(_)
        ));
    }
}
