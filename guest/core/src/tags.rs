//! Tags and clear (contract §7.5): invalidating many entries at once, in every
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
use crate::generation::Heard;
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
/// may forget an invalidation: contract §7.5.)
pub fn state_ttl_ms(now_ms: u64) -> u64 {
    crate::expiry::LATEST_EXPIRY_MS.saturating_sub(now_ms).max(1)
}

/// How a process may keep a tag's moments it read: until this moment at most (the L1
/// TTL from the read), so that without announcements a process learns of an
/// invalidation within the L1 TTL, as it does of an entry's change.
pub fn known_until(now_ms: u64, l1_ttl_ms: u64) -> u64 {
    now_ms.saturating_add(l1_ttl_ms)
}

/// What a process keeps of one tag's moments, and until when they may judge an entry
/// without being read again ([`known_until`]). A body keeps one per tag it judged by,
/// forgets them all when announcements may have been missed (a gap), and changes one
/// only through [`hear_moments`]. Once lapsed they still bound a write's stamp
/// ([`written_at`]) when the store cannot be read: moments only move forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeptTag {
    /// The tag's moments as known.
    pub moments: TagMoments,
    /// Until when (Unix ms) they may judge an entry without a read.
    pub until_ms: u64,
    /// Whether what is kept was ever usable (so may have judged an entry L1 holds):
    /// set by [`hear_moments`]; news carries `false`. Dropping such a tag moves L1's
    /// tag epoch on ([`KeptTags`]).
    pub judged: bool,
}

impl KeptTag {
    /// News of `moments`, usable until `until_ms` (nothing judged by them yet).
    #[must_use]
    pub fn news(moments: TagMoments, until_ms: u64) -> KeptTag {
        KeptTag {
            moments,
            until_ms,
            judged: false,
        }
    }

    /// The moments, if they may judge an entry at `now_ms` without a read.
    #[must_use]
    pub fn usable(&self, now_ms: u64) -> Option<TagMoments> {
        (now_ms < self.until_ms).then_some(self.moments)
    }
}

/// The tags' moments a process keeps, by tag. What has lapsed is swept out once the
/// map doubles (from [`KeptTags::SWEEP_FROM`] tags); a sweep that drops a tag that may
/// have judged an entry moves L1's tag epoch on (every tagged entry L1 holds is judged
/// again), since an entry may outlive the bound of a tag it was judged by (a stale copy
/// served for a fail-safe throttle, a clock stepped back), and [`hear_moments`] treats
/// a tag missing from the map as new.
#[derive(Clone, Debug, Default)]
pub struct KeptTags {
    /// Per tag: what is kept.
    map: std::collections::HashMap<String, KeptTag>,
    /// The size at which lapsed tags are swept out next.
    sweep_at: usize,
}

impl KeptTags {
    /// The fewest tags kept before lapsed ones are swept out.
    pub const SWEEP_FROM: usize = 1024;

    /// How many tags may be kept before lapsed ones are swept out again, once a sweep
    /// left `kept`: twice as many, and never under [`Self::SWEEP_FROM`].
    #[must_use]
    pub fn next_sweep(kept: usize) -> usize {
        kept.saturating_mul(2).max(Self::SWEEP_FROM)
    }

    /// What is kept of `tag`, lapsed or not.
    #[must_use]
    pub fn get(&self, tag: &str) -> Option<KeptTag> {
        self.map.get(tag).copied()
    }

    /// Keeps `kept` of `tag` (what [`hear_moments`] said), at `now_ms`. Says whether
    /// lapsed tags that may have judged an entry ([`KeptTag::judged`]) were swept out:
    /// L1's tag epoch must then move on. Tags only heard of (announced, never usable)
    /// judged nothing.
    #[must_use]
    pub fn keep(&mut self, tag: &str, kept: KeptTag, now_ms: u64) -> bool {
        match self.map.get_mut(tag) {
            Some(k) => *k = kept,
            None => {
                self.map.insert(tag.to_owned(), kept);
            }
        }
        if self.map.len() < self.sweep_at.max(Self::SWEEP_FROM) {
            return false;
        }
        let mut judged_swept = false;
        self.map.retain(|_, k| {
            let stays = k.usable(now_ms).is_some();
            judged_swept |= !stays && k.judged;
            stays
        });
        self.sweep_at = Self::next_sweep(self.map.len());
        judged_swept
    }

    /// Forgets `tag`.
    pub fn remove(&mut self, tag: &str) {
        self.map.remove(tag);
    }

    /// Forgets every tag (a gap: announcements may have been missed).
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// How many tags are kept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no tag is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// What a process learnt of a tag's moments, for [`hear_moments`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TagNews {
    /// The store held `found`, read after [`crate::generation::Known::heard`] said
    /// `since`; it says `heard` now.
    Read {
        /// What was heard when the read began.
        since: Heard,
        /// What is heard now.
        heard: Heard,
        /// What the store held, and until when it may be kept.
        found: KeptTag,
    },
    /// This process's own invalidation wrote them over the very bytes it read
    /// ([`update`]): what the store held then, as a read finds it.
    Wrote(KeptTag),
    /// Another process announced them. An announcement may come late (its invalidation
    /// retried it) and a later one may have been lost, so it moves moments forward but
    /// is kept no longer than what is kept already: only a read or a write restarts the
    /// bound.
    Announced(KeptTag),
}

/// What [`hear_moments`] leaves the body to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TagHeeded {
    /// What to keep of the tag now (`None`: nothing).
    pub kept: Option<KeptTag>,
    /// Whether a moment an entry in L1 may have been judged by moved forward: every
    /// tagged entry L1 holds is judged again (its tag epoch moves on).
    pub moved: bool,
    /// What the caller's call judges by: the moments, and until when that judgement
    /// holds (`now`: for this call only, nothing may keep it).
    pub using: KeptTag,
    /// Whether `using`'s moments are the store's own: what a read found (or the
    /// process's own write wrote), moved by nothing the process kept. Only a judgement
    /// by the store's own moments may delete an entry ([`judge`]).
    pub stored: bool,
}

/// Takes in `news` of a tag of which the process keeps `kept`, at `now_ms` (for a read:
/// the call's time, taken before the read began):
///
/// - what is kept and what is learnt are merged, each moment the later of the two
///   ([`TagMoments::merge`]);
/// - a read or the process's own write restarts the bound (the later of the two), unless
///   what is kept moved what it found: the store may have lost that moment, and a moment
///   the store does not hold is never trusted past its own bound;
/// - an announcement moves moments forward but never extends the bound (it may come
///   late, retried, and a later invalidation's may have been lost); with nothing usable
///   kept, it is kept until the moment it was heard: it judges nothing, but a read that
///   began by then (and may have been answered before the invalidation) merges it;
/// - what a read finds replaces what had lapsed before it began (the store may have
///   lost a moment: every process then goes by the store);
/// - a read during which a clear or a gap was heard is used for its call and not kept
///   (it may predate what was missed); what is kept is then used with it until its own
///   bound, and a moment it moved forward moves the epoch still;
/// - a tag new to the process moves nothing: no entry L1 serves was judged by it, since
///   what is kept is forgotten only with L1 or once lapsed ([`KeptTags`]). Else any
///   moment that moved does.
#[must_use]
pub fn hear_moments(kept: Option<KeptTag>, news: TagNews, now_ms: u64) -> TagHeeded {
    let usable = kept.filter(|k| k.usable(now_ms).is_some());
    let merged = |with: Option<KeptTag>, found: KeptTag| {
        with.map_or(found.moments, |k| k.moments.merge(&found.moments))
    };
    let (found, moments, until_ms) = match news {
        // What the store holds stands for what had lapsed: the store may have lost a
        // moment a process kept (restarted empty, evicted), and every other process
        // then goes by the store; one that went by its own memory would judge a write
        // made since (stamped by the writer's clock, the moment unread) older than it.
        TagNews::Read { since, heard, found } => {
            let with = kept.filter(|k| now_ms <= k.until_ms);
            let moments = merged(with, found);
            if !heard.no_news_since(&since) {
                return TagHeeded {
                    kept,
                    moved: kept.is_some_and(|k| k.moments != moments),
                    using: KeptTag::news(moments, with.map_or(now_ms, |k| k.until_ms)),
                    stored: moments == found.moments,
                };
            }
            (found, moments, restarted(with, found, moments))
        }
        TagNews::Wrote(found) => {
            let moments = merged(usable, found);
            (found, moments, restarted(usable, found, moments))
        }
        // Merged with what is kept, lapsed or not (a late announcement never moves a
        // moment back), but trusted no longer than what is usable.
        TagNews::Announced(found) => (
            found,
            merged(kept, found),
            usable.map_or(now_ms, |k| k.until_ms.min(found.until_ms)),
        ),
    };
    let now_kept = KeptTag {
        moments,
        until_ms,
        judged: kept.is_some_and(|k| k.judged) || now_ms < until_ms,
    };
    TagHeeded {
        kept: Some(now_kept),
        moved: kept.is_some_and(|k| k.moments != moments),
        using: now_kept,
        // Heard of, an announcement is never the store's own.
        stored: !matches!(news, TagNews::Announced(_)) && moments == found.moments,
    }
}

/// The bound of what a read or an own write (`found`) leaves kept as `moments`, with
/// `with` kept before: the later of the two bounds, unless `with` moved what the store
/// held (then `with`'s own: a moment the store does not hold is not trusted longer).
fn restarted(with: Option<KeptTag>, found: KeptTag, moments: TagMoments) -> u64 {
    match with {
        Some(k) if moments != found.moments => k.until_ms,
        Some(k) => k.until_ms.max(found.until_ms),
        None => found.until_ms,
    }
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
    /// Removed by a tag, or stale without a window to serve it in, by the store's own
    /// moments: a miss; a reader removes it.
    Removed,
    /// As [`Verdict::Removed`], but by moments the process kept or heard of, which the
    /// store may have lost (restarted empty, evicted): every other process then goes by
    /// the store, and an entry written since (stamped before the lost moment by its
    /// writer's clock) is theirs to read. From [`judge`], not an answer: a body reads
    /// the tags' moments from the store and judges the entry again ([`judge_again`]),
    /// so a reader, and a leader's double-check under its flight lock, sees what every
    /// other process sees, and deletes only by what the store holds. From
    /// [`judge_again`]: a miss, the entry left.
    Hidden,
}

/// Judges again, by the store's own moments, an entry [`judge`] found
/// [`Verdict::Hidden`]: `found[i]` is what a read of `tagged.tags[i]`'s key found now,
/// and `heeded[i]` what [`hear_moments`] said of that read. Returns the verdict and until
/// when L1 may keep what it judged.
///
/// L1 keeps it only while every tag's kept moments are the store's own
/// ([`TagHeeded::stored`]), and no longer than they are trusted: past a kept moment the
/// store lost, a later invalidation's announcement merges below that moment and moves
/// nothing, so it would not stop L1 serving the entry. For the same reason a stale copy
/// (which a fail-safe keeps past its tags' bound) is then not served: a miss, the entry
/// left ([`Verdict::Hidden`]).
pub fn judge_again(
    tagged: &Tagged,
    meta: &EntryMeta,
    found: &[TagMoments],
    heeded: &[TagHeeded],
    now_ms: u64,
) -> (Verdict, u64) {
    let verdict = judge(tagged, meta, found, true, now_ms);
    if heeded.iter().all(|h| h.stored) {
        let until = heeded.iter().map(|h| h.using.until_ms).min().unwrap_or(u64::MAX);
        return (verdict, until);
    }
    match verdict {
        Verdict::Stale(_) => (Verdict::Hidden, now_ms),
        verdict => (verdict, now_ms),
    }
}

/// Judges a tagged entry (`tagged`, with metadata `meta`) by the moments of its tags
/// (`moments[i]` being those of `tagged.tags[i]`; `stored`: all of them the store's own,
/// [`TagHeeded::stored`]) at `now_ms`. An entry written at or before a moment is
/// invalidated by it: a write and an invalidation in the same millisecond count the
/// write as the older (a miss, never a stale value), unless the writer knew of the
/// invalidation and stamped its write after it ([`written_at`]).
pub fn judge(
    tagged: &Tagged,
    meta: &EntryMeta,
    moments: &[TagMoments],
    stored: bool,
    now_ms: u64,
) -> Verdict {
    let removed = if stored { Verdict::Removed } else { Verdict::Hidden };
    let written = tagged.written_at_ms;
    let hit = |at: u64| at != 0 && written <= at;
    if moments.iter().any(|m| hit(m.removed_ms)) {
        return removed;
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
        return removed;
    }
    let stale = EntryMeta {
        expires_at_ms: meta.expires_at_ms.min(expired_at),
        ..*meta
    };
    if now_ms >= stale.gone_at_ms() {
        return removed;
    }
    Verdict::Stale(stale)
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
        assert_eq!(judge(&tagged, &meta, &[removed], true, T), Verdict::Untouched);
        // The next removal, still in that millisecond, is later than the write.
        let again = update(Some(&removed.encode()), Invalidation::Remove, T);
        assert_eq!(again.removed_ms, T + 1);
        assert_eq!(judge(&tagged, &meta, &[again], true, T), Verdict::Removed);
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
        assert_eq!(judge(&t, &m, &removed(NOW - 1), true, NOW), Verdict::Untouched);
        assert_eq!(
            judge(&t, &m, &removed(NOW), true, NOW),
            Verdict::Removed,
            "same ms: the write is older"
        );
        assert_eq!(judge(&t, &m, &removed(NOW + 5), true, NOW + 5), Verdict::Removed);
        // By moments the process kept or heard of: a miss all the same, but left in the
        // store (it may have lost them).
        assert_eq!(judge(&t, &m, &removed(NOW + 5), false, NOW + 5), Verdict::Hidden);
        assert_eq!(judge(&t, &m, &removed(NOW - 1), false, NOW), Verdict::Untouched);
        assert_eq!(
            judge(&t, &m, &[TagMoments::default(); 2], true, NOW),
            Verdict::Untouched
        );
    }

    #[test]
    fn a_hidden_entry_judged_again_goes_by_the_store_and_l1_keeps_it_only_as_stored() {
        let (t, m) = entry(NOW - 100, Some(60_000));
        let found = |removed_ms, expired_ms| {
            [
                TagMoments {
                    removed_ms,
                    expired_ms,
                },
                TagMoments::default(),
            ]
        };
        let heard = |stored, until_ms| TagHeeded {
            kept: None,
            moved: false,
            using: KeptTag::news(TagMoments::default(), until_ms),
            stored,
        };
        let both_stored = [heard(true, NOW + 300), heard(true, NOW + 200)];
        let one_lost = [heard(true, NOW + 300), heard(false, NOW + 50)];
        // The store lost the moment that hid it: untouched, kept in L1 no longer than
        // the moments are trusted, and not at all past a kept moment it lost.
        let untouched = judge_again(&t, &m, &found(0, 0), &both_stored, NOW);
        assert_eq!(untouched, (Verdict::Untouched, NOW + 200));
        assert_eq!(
            judge_again(&t, &m, &found(0, 0), &one_lost, NOW),
            (Verdict::Untouched, NOW)
        );
        // The store holds the removal: removed by its own moments (the reader deletes).
        assert_eq!(
            judge_again(&t, &m, &found(NOW - 50, 0), &one_lost, NOW).0,
            Verdict::Removed
        );
        // Stale by the store's moments: served as such only as stored.
        assert!(matches!(
            judge_again(&t, &m, &found(0, NOW - 50), &both_stored, NOW).0,
            Verdict::Stale(_)
        ));
        assert_eq!(
            judge_again(&t, &m, &found(0, NOW - 50), &one_lost, NOW),
            (Verdict::Hidden, NOW),
            "a stale copy L1 keeps past a lost moment would outlive a later removal"
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
        match judge(&t, &m, &expired, true, NOW + 10) {
            Verdict::Stale(meta) => assert_eq!(meta.expires_at_ms, NOW + 10),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            judge(&t, &m, &expired, true, NOW + 1_010),
            Verdict::Removed,
            "past its window"
        );
        let (t, m) = entry(NOW, None);
        assert_eq!(
            judge(&t, &m, &expired, true, NOW + 10),
            Verdict::Removed,
            "no window"
        );
        assert_eq!(judge(&t, &m, &expired, false, NOW + 10), Verdict::Hidden);
        let (t, m) = entry(NOW + 11, Some(1_000));
        assert_eq!(
            judge(&t, &m, &expired, true, NOW + 20),
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
    fn moments_are_known_for_the_l1_ttl_from_their_read() {
        assert_eq!(known_until(NOW, 300_000), NOW + 300_000);
        assert_eq!(known_until(u64::MAX - 1, 300_000), u64::MAX);
    }

    fn moments(removed_ms: u64, expired_ms: u64) -> TagMoments {
        TagMoments {
            removed_ms,
            expired_ms,
        }
    }

    fn kept(m: TagMoments, until_ms: u64) -> KeptTag {
        KeptTag::news(m, until_ms)
    }

    /// `k` as kept once it was usable: it may have judged an entry.
    fn judged(k: KeptTag) -> KeptTag {
        KeptTag { judged: true, ..k }
    }

    #[test]
    fn moments_heard_twice_keep_the_later_of_each_until_the_later_bound() {
        let a = kept(moments(NOW - 10, 0), NOW + 100);
        let heeded = hear_moments(
            Some(a),
            TagNews::Wrote(kept(moments(NOW - 20, NOW - 5), NOW + 50)),
            NOW,
        );
        let both = judged(kept(moments(NOW - 10, NOW - 5), NOW + 100));
        assert_eq!(heeded.kept, Some(both));
        assert_eq!(heeded.using, both);
        assert!(heeded.moved, "the expire moment moved");
        let again = hear_moments(
            Some(both),
            TagNews::Announced(kept(moments(NOW - 10, NOW - 5), NOW + 300)),
            NOW,
        );
        assert!(!again.moved, "nothing new: L1's judgements stand");
        // A tag new to the process moves nothing: no entry was judged by it.
        let new = hear_moments(None, TagNews::Wrote(kept(moments(NOW, 0), NOW + 1)), NOW);
        assert_eq!(
            (new.kept, new.moved),
            (Some(judged(kept(moments(NOW, 0), NOW + 1))), false)
        );
    }

    #[test]
    fn an_announcement_moves_moments_forward_but_never_extends_what_is_kept() {
        let read = kept(moments(NOW - 10, 0), NOW + 100);
        // Late (its invalidation retried it): a later removal's announcement may have
        // been lost, and the store may be past it. Only a read restarts the bound.
        let late = kept(moments(NOW - 5, 0), NOW + 300);
        let heeded = hear_moments(Some(read), TagNews::Announced(late), NOW);
        let moved = judged(kept(moments(NOW - 5, 0), NOW + 100));
        assert_eq!((heeded.kept, heeded.using), (Some(moved), moved));
        assert!(heeded.moved, "L1's judgements by the old moment go");
        // Of a tag not kept: kept lapsed, so the next call reads the tag, and the
        // moments still bound a write's stamp.
        let unknown = hear_moments(None, TagNews::Announced(late), NOW);
        assert_eq!(unknown.kept, Some(kept(late.moments, NOW)), "judged nothing");
        assert_eq!(unknown.using.usable(NOW), None);
        assert!(!unknown.moved, "no entry was judged by it");
        // A lapsed one is trusted no longer, but its moments never move back.
        let lapsed = hear_moments(Some(kept(moments(0, 0), NOW - 1)), TagNews::Announced(late), NOW);
        assert_eq!(lapsed.kept, Some(kept(late.moments, NOW)));
        let later = hear_moments(
            Some(kept(moments(NOW - 1, 0), NOW - 1)),
            TagNews::Announced(late),
            NOW,
        );
        assert_eq!(later.kept, Some(kept(moments(NOW - 1, 0), NOW)));
        assert!(!later.moved);
        // This process's own write is what the store held: it restarts the bound.
        let wrote = hear_moments(Some(read), TagNews::Wrote(late), NOW);
        assert_eq!(wrote.kept, Some(judged(late)));
        // Once usable, a tag may have judged an entry, lapsed or not.
        let lapsed_again = hear_moments(wrote.kept, TagNews::Announced(late), NOW + 301);
        assert!(lapsed_again.kept.is_some_and(|k| k.judged));
        // Heard of, never the store's own: an entry it judges removed stays in the store.
        assert!(!heeded.stored && !unknown.stored && wrote.stored);
    }

    #[test]
    fn an_announcement_heard_while_a_read_was_on_its_way_is_not_lost() {
        let since = Heard::default();
        // The call began at NOW and sent its read; the removal's announcement came first,
        // within the same millisecond.
        let removal = kept(moments(NOW - 1, 0), NOW + 300);
        let heard = hear_moments(None, TagNews::Announced(removal), NOW);
        // The read was answered before the removal was written.
        let found = kept(moments(NOW - 10, 0), NOW + 300);
        let read = hear_moments(
            heard.kept,
            TagNews::Read {
                since,
                heard: since,
                found,
            },
            NOW,
        );
        assert_eq!(
            read.using.moments, removal.moments,
            "the removal judges this call"
        );
        assert_eq!(read.kept, Some(kept(removal.moments, NOW)), "not trusted longer");
        assert!(!read.stored);
        // A read that began after it was heard finds it, or the store lost it.
        let later = hear_moments(
            heard.kept,
            TagNews::Read {
                since,
                heard: since,
                found,
            },
            NOW + 1,
        );
        assert_eq!(later.using, judged(found));
    }

    #[test]
    fn a_moment_the_store_does_not_hold_is_never_kept_past_its_bound() {
        let since = Heard::default();
        let lost = kept(moments(NOW + 1_552, 0), NOW + 50);
        let found = kept(moments(NOW - 10, 0), NOW + 300);
        let read = hear_moments(
            Some(lost),
            TagNews::Read {
                since,
                heard: since,
                found,
            },
            NOW,
        );
        assert_eq!(read.kept, Some(judged(lost)), "merged, bound not restarted");
        // Nor by the process's own write.
        let wrote = hear_moments(Some(lost), TagNews::Wrote(found), NOW);
        assert_eq!(wrote.kept, Some(judged(lost)));
        // An own write over a lapsed moment goes by the store's, as a read does.
        let over_lapsed = hear_moments(
            Some(kept(moments(NOW + 1_552, 0), NOW - 1)),
            TagNews::Wrote(found),
            NOW,
        );
        assert_eq!(over_lapsed.kept, Some(judged(found)));
        assert!(over_lapsed.stored);
    }

    #[test]
    fn only_moments_a_read_found_unmoved_are_the_stores_own() {
        let since = Heard::default();
        let found = kept(moments(NOW - 10, 0), NOW + 300);
        let read = |kept, heard| hear_moments(kept, TagNews::Read { since, heard, found }, NOW);
        assert!(read(None, since).stored);
        // What is kept agrees, or has lapsed (the read replaces it): the store's own.
        assert!(read(Some(kept(moments(NOW - 20, 0), NOW + 50)), since).stored);
        assert!(read(Some(kept(moments(NOW + 1_552, 0), NOW - 1)), since).stored);
        // A kept moment later than the store's (which may have lost it) moves it: not.
        let later = read(Some(kept(moments(NOW + 1_552, 0), NOW + 50)), since);
        assert_eq!(later.using.moments, moments(NOW + 1_552, 0));
        assert!(!later.stored);
        // Used once after a gap, the read is still the store's own when nothing moved it.
        let gap = Heard { gaps: 1, ..since };
        assert!(read(None, gap).stored);
        assert!(!read(Some(kept(moments(NOW + 1_552, 0), NOW + 50)), gap).stored);
    }

    #[test]
    fn a_read_that_overlapped_a_gap_is_used_once_and_not_kept() {
        let since = Heard::default();
        let heard = Heard {
            gaps: 1,
            ..Heard::default()
        };
        let found = kept(moments(0, NOW - 1), NOW + 300);
        let read = |kept| hear_moments(kept, TagNews::Read { since, heard, found }, NOW);
        let alone = read(None);
        assert_eq!(alone.kept, None);
        assert_eq!(alone.using, kept(moments(0, NOW - 1), NOW), "for this call only");
        // With what is kept and still usable: both, until the kept bound.
        let before = kept(moments(NOW - 9, 0), NOW + 50);
        let with = read(Some(before));
        assert_eq!(with.kept, Some(before), "what is kept is unchanged");
        assert_eq!(with.using, kept(moments(NOW - 9, NOW - 1), NOW + 50));
        assert!(with.moved, "a moment moved: L1's judgements by the old ones go");
        // One that lapsed before the read began adds nothing: the store's moments stand
        // (it may have lost one).
        let lapsed = read(Some(kept(moments(NOW - 9, 0), NOW - 1)));
        assert_eq!(lapsed.using, kept(moments(0, NOW - 1), NOW));
        // A read with nothing heard meanwhile is kept.
        let quiet = hear_moments(
            None,
            TagNews::Read {
                since,
                heard: since,
                found,
            },
            NOW,
        );
        assert_eq!((quiet.kept, quiet.using), (Some(judged(found)), judged(found)));
        // Nor when kept: a moment the store lost is forgotten with it.
        let forgot = hear_moments(
            Some(kept(moments(NOW + 1_552, 0), NOW - 1)),
            TagNews::Read {
                since,
                heard: since,
                found,
            },
            NOW,
        );
        assert_eq!(forgot.kept, Some(judged(found)));
        assert!(forgot.moved, "L1's judgements by the forgotten moment go");
        assert_eq!(found.usable(NOW + 299), Some(found.moments));
        assert_eq!(found.usable(NOW + 300), None);
    }

    #[test]
    fn lapsed_tags_are_swept_out_once_the_map_doubles() {
        let mut kept_tags = KeptTags::default();
        let m = moments(1, 0);
        // A service whose tags each name one user: thousands, each judged by once.
        let mut sweeps = 0;
        for n in 0..10_000u64 {
            sweeps += usize::from(kept_tags.keep(&format!("user:{n}"), judged(kept(m, n + 1)), n));
        }
        assert!(
            kept_tags.len() <= 2 * KeptTags::SWEEP_FROM,
            "{} kept",
            kept_tags.len()
        );
        assert!(
            (1..=10).contains(&sweeps),
            "{sweeps} sweeps: each moves L1's tag epoch"
        );
        let _ = kept_tags.keep("live", judged(kept(m, u64::MAX)), 10_000);
        for n in 10_000..20_000u64 {
            let _ = kept_tags.keep(&format!("user:{n}"), judged(kept(m, n + 1)), n);
        }
        assert_eq!(
            kept_tags.get("live"),
            Some(judged(kept(m, u64::MAX))),
            "what has not lapsed stays"
        );
        kept_tags.clear();
        assert!(kept_tags.is_empty());
        // Tags only heard of (kept lapsed) judged nothing: sweeping them moves no epoch.
        let heard = (0..10_000u64)
            .filter(|&n| kept_tags.keep(&format!("other:{n}"), kept(m, n), n))
            .count();
        assert_eq!(heard, 0);
    }
}
