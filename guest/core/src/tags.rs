//! Tags and clear (contract §6b.5): invalidating many entries at once, in every
//! process, without scanning keys.
//!
//! **Tags.** An entry may be written with tags (at most [`MAX_TAGS`], each 1 to
//! [`MAX_TAG_BYTES`] bytes of UTF-8); it then carries its tags and the moment it was
//! written ([`Tagged`], envelope version 4). Each tag has one small store key
//! ([`crate::names::tag_name`]) holding two moments ([`TagMoments`], Unix ms by the cache's
//! clock): the last `remove_by_tag` and the last `expire_by_tag`. Readers compare:
//!
//! - written **at or before** the tag's removal moment: a miss, as if removed;
//! - else written at or before its expire moment: stale from that moment (fail-safe
//!   serves it within its stale window; without one, a miss);
//! - else the tag does not touch it.
//!
//! Moments only move forward ([`update`]): an invalidation never undoes a later one.
//! Bytes that are not moments are read as a removal at the end of time (every entry
//! with that tag is a miss) until the next `remove_by_tag` writes good ones: unknown
//! state errs on the side of a miss.
//!
//! **Clear** is a generation, not a scan: one counter per prefix
//! ([`crate::names::generation`]), part of every entry's and flight lock's name
//! ([`crate::names::locate`]). `clear` moves it on; entries of older generations are
//! never read again and lapse by their TTLs.
//!
//! **Announcements.** Other processes hear of an invalidation on the prefix's
//! invalidation channel ([`crate::names::invalidations`]), as a message [`encode`]
//! writes and [`decode`] reads: they update the moments they keep (or the generation)
//! and stop serving what it invalidates from their L1.

pub use crate::envelope::{MAX_TAG_BYTES, MAX_TAGS, Tagged};
use crate::expiry::EntryMeta;
use crate::{Arg, ArgError};

/// Checks an entry's tags: at most 16, each 1 to 128 bytes (UTF-8: a `&str` is).
/// Duplicates are allowed (the envelope keeps them as given).
///
/// # Errors
/// An [`ArgError`] naming `tags`.
pub fn check(tags: &[impl AsRef<str>]) -> Result<(), ArgError> {
    if tags.len() > MAX_TAGS {
        return Err(ArgError::new(
            Arg::Tags,
            format!("are {} tags, over the limit of {MAX_TAGS}", tags.len()),
        ));
    }
    for tag in tags {
        check_one(tag.as_ref()).map_err(|reason| ArgError::new(Arg::Tags, reason))?;
    }
    Ok(())
}

/// Checks the tag an invalidation names (`remove_by_tag`, `expire_by_tag`).
///
/// # Errors
/// An [`ArgError`] naming `tag`.
pub fn check_tag(tag: &str) -> Result<(), ArgError> {
    check_one(tag).map_err(|reason| ArgError::new(Arg::Tag, reason))
}

fn check_one(tag: &str) -> Result<(), String> {
    if tag.is_empty() {
        return Err("a tag must not be empty".into());
    }
    if tag.len() > MAX_TAG_BYTES {
        return Err(format!(
            "a tag is {} bytes, over the limit of {MAX_TAG_BYTES}",
            tag.len()
        ));
    }
    Ok(())
}

/// A tag's invalidation moments, Unix ms by the cache's clock; 0 = never.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagMoments {
    /// The last `remove_by_tag`.
    pub removed_ms: u64,
    /// The last `expire_by_tag`.
    pub expired_ms: u64,
}

/// How long the stored moments are: two big-endian u64s behind a magic.
const MOMENTS_LEN: usize = 4 + 16;
const MOMENTS_MAGIC: [u8; 4] = *b"CRT\x01";

impl TagMoments {
    /// The moments a tag key holds: `None` (no key) is "never"; bytes that are not
    /// moments read as a removal at the end of time (see the module).
    pub fn decode(stored: Option<&[u8]>) -> TagMoments {
        let Some(bytes) = stored else {
            return TagMoments::default();
        };
        if bytes.len() != MOMENTS_LEN || bytes[..4] != MOMENTS_MAGIC {
            return TagMoments {
                removed_ms: u64::MAX,
                expired_ms: 0,
            };
        }
        let at = |i: usize| u64::from_be_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        TagMoments {
            removed_ms: at(4),
            expired_ms: at(12),
        }
    }

    /// The bytes a tag key holds.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MOMENTS_LEN);
        out.extend_from_slice(&MOMENTS_MAGIC);
        out.extend_from_slice(&self.removed_ms.to_be_bytes());
        out.extend_from_slice(&self.expired_ms.to_be_bytes());
        out
    }

    /// The later of two views of one tag, field by field: what a process keeps when it
    /// hears of moments from two places (a read and an announcement).
    pub fn merge(&self, other: &TagMoments) -> TagMoments {
        TagMoments {
            removed_ms: self.removed_ms.max(other.removed_ms),
            expired_ms: self.expired_ms.max(other.expired_ms),
        }
    }
}

/// Which invalidation of a tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalidation {
    /// `remove_by_tag`: entries written until now are gone.
    Remove,
    /// `expire_by_tag`: entries written until now are stale from now.
    Expire,
}

/// What an invalidation at `now_ms` writes over a tag key holding `stored`: the moment
/// moves to `now_ms`, never backwards (a later invalidation already there stays).
/// Unreadable bytes are replaced. A body writes it only over the very bytes it read
/// (compare-and-set), and reads again when another write came first.
pub fn update(stored: Option<&[u8]>, invalidation: Invalidation, now_ms: u64) -> TagMoments {
    let mut moments = match stored {
        Some(bytes) if bytes.len() == MOMENTS_LEN && bytes[..4] == MOMENTS_MAGIC => {
            TagMoments::decode(Some(bytes))
        }
        _ => TagMoments::default(),
    };
    // Later than every earlier invalidation of the tag, even in the same millisecond: a
    // write stamped after one (`written_at`) is then still older than the next.
    let latest = moments.removed_ms.max(moments.expired_ms);
    let at = if latest == 0 {
        now_ms
    } else {
        now_ms.max(latest.saturating_add(1))
    };
    match invalidation {
        Invalidation::Remove => moments.removed_ms = at,
        Invalidation::Expire => moments.expired_ms = at,
    }
    moments
}

/// The moment a tagged write (`set` with tags) is stamped with: `now_ms`, or just after
/// every invalidation of its tags the writer knows of (`known`), whichever is later. A
/// write that follows an invalidation in one process is newer than it, even within the
/// same millisecond, and is served; the next invalidation is later again ([`update`]).
/// A load keeps the moment it began: what it read may predate an invalidation.
pub fn written_at(now_ms: u64, known: &[TagMoments]) -> u64 {
    known
        .iter()
        .flat_map(|m| [m.removed_ms, m.expired_ms])
        .filter(|&at| at != 0)
        .map(|at| at.saturating_add(1))
        .fold(now_ms, u64::max)
}

/// The store TTL of a tag key or a generation counter written at `now_ms`: until the
/// latest expiry any entry may have ([`crate::expiry::LATEST_EXPIRY_MS`]), so it
/// outlives every entry written before it. (A store that evicts keys before their TTL
/// may forget an invalidation: contract §6b.5.)
pub fn state_ttl_ms(now_ms: u64) -> u64 {
    crate::expiry::LATEST_EXPIRY_MS.saturating_sub(now_ms).max(1)
}

/// How a process may keep a tag's moments it read: until this moment at most (the L1
/// TTL from the read), so that without announcements a process learns of an
/// invalidation within the L1 TTL, as it does of an entry's change.
pub fn known_until(now_ms: u64, l1_ttl_ms: u64) -> u64 {
    now_ms.saturating_add(l1_ttl_ms)
}

/// What a tagged entry's tags say about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No tag invalidates it.
    Untouched,
    /// An `expire_by_tag` made it stale: this is its metadata from then (expiring at
    /// that moment), within its stale window still at `now`. Fail-safe may serve it;
    /// a plain read does not.
    Stale(EntryMeta),
    /// Removed by a tag, or stale without a window to serve it in: a miss; a reader
    /// removes it.
    Removed,
}

/// Judges a tagged entry (`tagged`, with metadata `meta`) by the moments of its tags
/// (`moments[i]` being those of `tagged.tags[i]`) at `now_ms`. An entry written at or
/// before a moment is invalidated by it: a write and an invalidation in the same
/// millisecond count the write as the older (a miss, never a stale value), unless the
/// writer knew of the invalidation and stamped its write after it ([`written_at`]).
pub fn judge(tagged: &Tagged, meta: &EntryMeta, moments: &[TagMoments], now_ms: u64) -> Verdict {
    let written = tagged.written_at_ms;
    let hit = |at: u64| at != 0 && written <= at;
    if moments.iter().any(|m| hit(m.removed_ms)) {
        return Verdict::Removed;
    }
    let Some(expired_at) = moments
        .iter()
        .filter(|m| hit(m.expired_ms))
        .map(|m| m.expired_ms)
        .max()
    else {
        return Verdict::Untouched;
    };
    if meta.stale_ms.is_none() {
        return Verdict::Removed;
    }
    let stale = EntryMeta {
        expires_at_ms: meta.expires_at_ms.min(expired_at),
        ..*meta
    };
    if now_ms >= stale.gone_at_ms() {
        return Verdict::Removed;
    }
    Verdict::Stale(stale)
}

/// The latest moment L1 may serve a tagged entry judged on moments a process keeps
/// until `known_until` (each tag's): no later than the entry's own deadline, nor than
/// the first of those moments lapses.
pub fn l1_until(l1_until_ms: u64, known_until: &[u64]) -> u64 {
    known_until.iter().copied().fold(l1_until_ms, u64::min)
}

/// An invalidation another process hears of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// A tag's moments moved (to at least these).
    Tag {
        /// The tag.
        tag: String,
        /// Its moments after the invalidation.
        moments: TagMoments,
    },
    /// The prefix was cleared: its generation is now (at least) this.
    Clear {
        /// The new generation.
        generation: u64,
    },
}

/// The text of an invalidation message on the invalidation channel:
/// `t <removed> <expired> <tag>` or `c <generation>`, after the announcing store's
/// origin and a space (the tag last: it may hold spaces).
pub fn encode(origin: &str, message: &Message) -> String {
    match message {
        Message::Tag { tag, moments } => {
            format!("{origin} t {} {} {tag}", moments.removed_ms, moments.expired_ms)
        }
        Message::Clear { generation } => format!("{origin} c {generation}"),
    }
}

/// Reads an invalidation message: its origin and what it says; `None` for anything
/// else (a message of a later version, say), which the reader ignores.
pub fn decode(text: &str) -> Option<(&str, Message)> {
    let (origin, rest) = text.split_once(' ')?;
    let (kind, rest) = rest.split_once(' ')?;
    match kind {
        "t" => {
            let (removed, rest) = rest.split_once(' ')?;
            let (expired, tag) = rest.split_once(' ')?;
            check_one(tag).ok()?;
            let moments = TagMoments {
                removed_ms: removed.parse().ok()?,
                expired_ms: expired.parse().ok()?,
            };
            Some((
                origin,
                Message::Tag {
                    tag: tag.to_owned(),
                    moments,
                },
            ))
        }
        "c" => Some((
            origin,
            Message::Clear {
                generation: rest.parse().ok()?,
            },
        )),
        _ => None,
    }
}

/// The generation a prefix's counter holds (`None`: never cleared, 0). Bytes that are
/// not a decimal count read as 0, and the next `clear` replaces them.
pub fn generation(stored: Option<&[u8]>) -> u64 {
    stored
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// What `clear` writes at `now_ms` over a counter holding `stored` (only over those
/// very bytes: compare-and-set), and the generation it starts: one past the stored one,
/// or the clock's millisecond if that is later. So a counter a store restart emptied
/// does not count up again through numbers processes that still know an older
/// generation write under: their values, written before the clear, would be read after
/// it.
pub fn next_generation(stored: Option<&[u8]>, now_ms: u64) -> (Vec<u8>, u64) {
    let next = generation(stored).saturating_add(1).max(now_ms);
    (next.to_string().into_bytes(), next)
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_write_that_knows_of_an_invalidation_is_newer_and_the_next_invalidation_newer_still() {
        const T: u64 = 1_700_000_000_000;
        let removed = update(None, Invalidation::Remove, T);
        assert_eq!(removed.removed_ms, T);
        // A set in the same millisecond, after the removal it knows of: newer.
        let written = written_at(T, &[removed]);
        assert_eq!(written, T + 1);
        let tagged = Tagged {
            written_at_ms: written,
            tags: vec!["t".into()],
        };
        let meta = EntryMeta {
            absolute_ms: None,
            sliding_ms: None,
            expires_at_ms: T + 60_000,
            stale_ms: None,
        };
        assert_eq!(judge(&tagged, &meta, &[removed], T), Verdict::Untouched);
        // The next removal, still in that millisecond, is later than the write.
        let again = update(Some(&removed.encode()), Invalidation::Remove, T);
        assert_eq!(again.removed_ms, T + 1);
        assert_eq!(judge(&tagged, &meta, &[again], T), Verdict::Removed);
        // An expiry counts too, and a clock that moved on is used as it is.
        let expired = update(Some(&again.encode()), Invalidation::Expire, T + 50);
        assert_eq!((expired.removed_ms, expired.expired_ms), (T + 1, T + 50));
        assert_eq!(written_at(T + 50, &[expired]), T + 51);
        assert_eq!(written_at(T + 99, &[expired]), T + 99);
        assert_eq!(written_at(T, &[]), T);
    }

    use super::*;

    const NOW: u64 = 1_700_000_000_000;

    fn entry(written: u64, stale: Option<u64>) -> (Tagged, EntryMeta) {
        (
            Tagged {
                written_at_ms: written,
                tags: vec!["a".into(), "b".into()],
            },
            EntryMeta {
                absolute_ms: Some(NOW + 60_000),
                sliding_ms: None,
                expires_at_ms: NOW + 60_000,
                stale_ms: stale,
            },
        )
    }

    #[test]
    fn tags_are_bounded_and_errors_name_them() {
        assert!(check(&["a"; 16]).is_ok());
        assert_eq!(check(&["a"; 17]).unwrap_err().arg, Arg::Tags);
        assert_eq!(check(&[""]).unwrap_err().arg, Arg::Tags);
        assert!(check(&["é".repeat(64)]).is_ok());
        assert_eq!(check(&["x".repeat(129)]).unwrap_err().arg, Arg::Tags);
        assert_eq!(check_tag("").unwrap_err().arg, Arg::Tag);
    }

    #[test]
    fn a_removal_at_or_after_the_write_removes_and_an_earlier_one_does_not() {
        let (t, m) = entry(NOW, None);
        let removed = |at| {
            [
                TagMoments {
                    removed_ms: at,
                    expired_ms: 0,
                },
                TagMoments::default(),
            ]
        };
        assert_eq!(judge(&t, &m, &removed(NOW - 1), NOW), Verdict::Untouched);
        assert_eq!(
            judge(&t, &m, &removed(NOW), NOW),
            Verdict::Removed,
            "same ms: the write is older"
        );
        assert_eq!(judge(&t, &m, &removed(NOW + 5), NOW + 5), Verdict::Removed);
        assert_eq!(
            judge(&t, &m, &[TagMoments::default(); 2], NOW),
            Verdict::Untouched
        );
    }

    #[test]
    fn an_expiry_makes_it_stale_within_its_window_else_removes_it() {
        let expired = [
            TagMoments::default(),
            TagMoments {
                removed_ms: 0,
                expired_ms: NOW + 10,
            },
        ];
        let (t, m) = entry(NOW, Some(1_000));
        match judge(&t, &m, &expired, NOW + 10) {
            Verdict::Stale(meta) => assert_eq!(meta.expires_at_ms, NOW + 10),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            judge(&t, &m, &expired, NOW + 1_010),
            Verdict::Removed,
            "past its window"
        );
        let (t, m) = entry(NOW, None);
        assert_eq!(judge(&t, &m, &expired, NOW + 10), Verdict::Removed, "no window");
        let (t, m) = entry(NOW + 11, Some(1_000));
        assert_eq!(
            judge(&t, &m, &expired, NOW + 20),
            Verdict::Untouched,
            "written after"
        );
    }

    #[test]
    fn moments_only_move_forward_and_unknown_bytes_err_towards_a_miss() {
        let m = update(None, Invalidation::Remove, NOW);
        assert_eq!(
            m,
            TagMoments {
                removed_ms: NOW,
                expired_ms: 0
            }
        );
        let bytes = m.encode();
        assert_eq!(TagMoments::decode(Some(&bytes)), m);
        let later = update(Some(&bytes), Invalidation::Expire, NOW + 5);
        assert_eq!(
            later,
            TagMoments {
                removed_ms: NOW,
                expired_ms: NOW + 5
            }
        );
        // A process whose clock is behind never moves a moment back: its removal is
        // later than every invalidation before it.
        assert_eq!(
            update(Some(&later.encode()), Invalidation::Remove, NOW - 100).removed_ms,
            NOW + 6
        );
        assert_eq!(TagMoments::decode(Some(b"junk")).removed_ms, u64::MAX);
        assert_eq!(update(Some(b"junk"), Invalidation::Remove, NOW).removed_ms, NOW);
        assert_eq!(m.merge(&later), later);
    }

    #[test]
    fn messages_round_trip_and_tags_may_hold_spaces() {
        let tag = Message::Tag {
            tag: "a tag with spaces".into(),
            moments: TagMoments {
                removed_ms: 7,
                expired_ms: 9,
            },
        };
        let clear = Message::Clear { generation: 42 };
        for m in [tag, clear] {
            let text = encode("0af3", &m);
            assert_eq!(decode(&text), Some(("0af3", m)));
        }
        assert_eq!(decode("0af3 z 1"), None);
        assert_eq!(decode("0af3 c x"), None);
        assert_eq!(decode("0af3 t 1 2 "), None);
    }

    #[test]
    fn generations_move_past_the_stored_one_and_the_clock() {
        assert_eq!(generation(None), 0);
        let (bytes, g) = next_generation(None, 0);
        assert_eq!((g, generation(Some(&bytes))), (1, 1));
        assert_eq!(next_generation(Some(b"41"), 0).1, 42);
        assert_eq!(generation(Some(b"junk")), 0);
        const T: u64 = 1_700_000_000_000;
        // An emptied counter (a store restart) starts from the clock, not from 1.
        assert_eq!(next_generation(None, T).1, T);
        assert_eq!(next_generation(Some(b"41"), T).1, T);
        // A counter ahead of this clock still moves on.
        assert_eq!(next_generation(Some((T + 5).to_string().as_bytes()), T).1, T + 6);
        assert_eq!(
            next_generation(Some(u64::MAX.to_string().as_bytes()), T).1,
            u64::MAX
        );
    }

    #[test]
    fn l1_keeps_a_tagged_entry_no_longer_than_its_moments_are_known() {
        assert_eq!(l1_until(NOW + 100, &[NOW + 50, NOW + 70]), NOW + 50);
        assert_eq!(l1_until(NOW + 100, &[]), NOW + 100);
        assert_eq!(known_until(NOW, 300_000), NOW + 300_000);
    }
}
