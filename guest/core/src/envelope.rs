//! The bytes a store holds for an entry: a fixed header carrying the expiry metadata,
//! then the value.
//!
//! ```text
//! offset  size  field
//!      0     3  magic "CRL"
//!      3     1  version: 1, or 2 for a sliding entry whose store keeps the moment
//!      4     8  absolute expiration, Unix ms, big-endian; 0 = none
//!     12     8  sliding interval, ms, big-endian; 0 = none
//!     20     8  expires at, Unix ms, big-endian (as written; see below)
//!     28     4  value length, big-endian
//!     32     -  value bytes (versions 1 and 2)
//!     32     8  version 3 only: the stale window, ms, big-endian (never 0)
//!     40     -  value bytes (version 3)
//!
//! version 4 (a tagged entry, contract §7.5):
//!     32     8  the stale window, ms, big-endian; 0 = none
//!     40     8  written at, Unix ms, big-endian (what tag invalidations compare)
//!     48     1  tag count, 1..=16
//!     49     -  each tag: its length (1 byte, 1..=128), then its UTF-8 bytes
//!      -     -  value bytes
//! ```
//!
//! Version 4 is an entry written with tags. Entries without tags are written as
//! before (versions 1 to 3), so the tag section costs nothing to those who do not use
//! tags, and older readers still read untagged entries. A tagged entry keeps its
//! expiry moment in the envelope (as version 1 does); its store never does. The fields
//! a read's touch rewrites are all in the first 48 bytes ([`Header`]): a reader writes
//! the new header in place of those bytes and keeps everything after them (the tag
//! section and the value) as it was.
//!
//! Version 3 is an entry with a fail-safe stale window (contract §7.1): its envelope
//! keeps its expiry moment (as version 1 does), and the store keeps it until the window
//! ends. Entries without one are written as before, so older readers still read them.
//!
//! Zero is free to mean "none" because [`crate::expiry::plan`] never produces a zero
//! duration or an absolute point at the epoch.
//!
//! Where a sliding entry's current expiry moment lives is the entry's own business
//! ([`Keeper`]): in a version-1 envelope it is the expires-at field, and a read that
//! slides it rewrites that field (the Redis read script,
//! [`crate::script::READ_AND_TOUCH`], does it in place); in a version-2 envelope it is
//! the store's TTL, which a read slides without touching the bytes (`GETEX`), and the
//! expires-at field only says when the entry would have expired unread. Every reader
//! follows what the entry says, so processes on either kind of clock share a store.
//!
//! Decoding never panics: anything that is not a version-1 envelope within the limits
//! decodes to a [`Corruption`].

use crate::{Corruption, EntryMeta, Limits};

/// The length of a version-1 or -2 header; their value starts here.
pub const HEADER_LEN: usize = 32;
/// The fixed part of a version-4 (tagged) header; its tag section follows.
pub const TAGGED_FIXED_LEN: usize = 48;
/// The most tags an entry carries.
pub const MAX_TAGS: usize = 16;
/// The longest tag, in UTF-8 bytes.
pub const MAX_TAG_BYTES: usize = 128;
/// The longest header (version 4 with [`MAX_TAGS`] tags of [`MAX_TAG_BYTES`]): what a
/// reader must see to decode any entry.
pub const MAX_HEADER_LEN: usize = TAGGED_FIXED_LEN + 1 + MAX_TAGS * (1 + MAX_TAG_BYTES);
/// The longest fixed header: what a touch rewrites.
const MAX_FIXED_LEN: usize = TAGGED_FIXED_LEN;
/// The first bytes of every envelope.
pub const MAGIC: [u8; 3] = *b"CRL";
/// The envelope version whose header keeps a sliding entry's expiry moment.
pub const VERSION: u8 = 1;
/// The envelope version of a sliding entry whose store keeps its expiry moment in
/// its TTL. The layout is the same.
pub const STORE_KEPT_VERSION: u8 = 2;
/// The envelope version of an entry with a fail-safe stale window.
pub const STALE_VERSION: u8 = 3;
/// The envelope version of an entry written with tags.
pub const TAGGED_VERSION: u8 = 4;

/// An encoded fixed header: 32, 40 or 48 bytes, kept inline (no allocation per write).
/// A tagged entry's tag section follows it (see [`encode_tagged_header`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Header {
    bytes: [u8; MAX_FIXED_LEN],
    len: u8,
}

impl Header {
    /// The header's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl std::ops::Deref for Header {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl std::fmt::Debug for Header {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Header({:02x?})", self.as_bytes())
    }
}

/// Where a sliding entry's current expiry moment lives (contract §3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keeper {
    /// In the envelope's expires-at field; the store's TTL is only an upper bound.
    Envelope,
    /// In the store's TTL: while the store holds the entry, it has not slid out.
    Store,
}
/// How a removal's tombstone starts: the magic and version 0. The rest is the removal's
/// own nonce (at most [`TOMBSTONE_NONCE_MAX`] bytes), so that no two removals leave the
/// same bytes: a load's fill may not overwrite a tombstone unless that very one was there
/// before the load began (fenced fills, contract §5.12). A reader takes it for a miss and
/// leaves it; it lapses by its TTL.
pub const TOMBSTONE: [u8; 4] = [b'C', b'R', b'L', 0];
/// The longest nonce a tombstone carries.
pub const TOMBSTONE_NONCE_MAX: usize = 32;

/// Whether stored bytes (`head` of `total_len`) are a removal's tombstone.
#[inline]
pub fn is_tombstone(head: &[u8], total_len: u64) -> bool {
    head.starts_with(&TOMBSTONE) && total_len <= (TOMBSTONE.len() + TOMBSTONE_NONCE_MAX) as u64
}

/// Where the expires-at field starts (the one a touch rewrites).
pub const EXPIRES_AT_OFFSET: usize = 20;

/// The header for `meta` in front of a value of `value_len` bytes.
///
/// # Panics
/// Never for values within [`Limits`]; a `value_len` over `u32::MAX` is clamped, and a
/// reader then sees the envelope as corrupt rather than misreading it.
pub fn encode_header(meta: &EntryMeta, value_len: u64, keeper: Keeper) -> Header {
    let mut h = [0u8; MAX_FIXED_LEN];
    h[..3].copy_from_slice(&MAGIC);
    h[3] = match (meta.stale_ms, keeper) {
        (Some(_), _) => STALE_VERSION,
        (None, Keeper::Store) if meta.sliding_ms.is_some() => STORE_KEPT_VERSION,
        _ => VERSION,
    };
    h[4..12].copy_from_slice(&meta.absolute_ms.unwrap_or(0).to_be_bytes());
    h[12..20].copy_from_slice(&meta.sliding_ms.unwrap_or(0).to_be_bytes());
    h[20..28].copy_from_slice(&meta.expires_at_ms.to_be_bytes());
    let len = u32::try_from(value_len).unwrap_or(u32::MAX);
    h[28..32].copy_from_slice(&len.to_be_bytes());
    let mut header_len = HEADER_LEN;
    if let Some(stale) = meta.stale_ms {
        h[32..40].copy_from_slice(&stale.to_be_bytes());
        header_len = 40;
    }
    Header {
        bytes: h,
        len: header_len as u8,
    }
}

/// The fixed part of a version-4 header (the tag section follows it).
fn tagged_fixed(meta: &EntryMeta, value_len: u64, written_at_ms: u64) -> Header {
    let mut header = encode_header(meta, value_len, Keeper::Envelope);
    header.bytes[3] = TAGGED_VERSION;
    header.bytes[32..40].copy_from_slice(&meta.stale_ms.unwrap_or(0).to_be_bytes());
    header.bytes[40..48].copy_from_slice(&written_at_ms.to_be_bytes());
    header.len = TAGGED_FIXED_LEN as u8;
    header
}

/// The whole header of a tagged entry: the fixed part, then the tag section. `tags`
/// must have passed [`crate::tags::check`] (1 to 16 tags of 1 to 128 bytes).
pub fn encode_tagged_header(meta: &EntryMeta, value_len: u64, tagged: &Tagged) -> Vec<u8> {
    let fixed = tagged_fixed(meta, value_len, tagged.written_at_ms);
    let mut out =
        Vec::with_capacity(TAGGED_FIXED_LEN + 1 + tagged.tags.iter().map(|t| t.len() + 1).sum::<usize>());
    out.extend_from_slice(&fixed);
    out.push(tagged.tags.len().min(MAX_TAGS) as u8);
    for tag in tagged.tags.iter().take(MAX_TAGS) {
        let bytes = &tag.as_bytes()[..tag.len().min(MAX_TAG_BYTES)];
        out.push(bytes.len() as u8);
        out.extend_from_slice(bytes);
    }
    out
}

/// The fixed header a touch writes in place of `decoded`'s (its first
/// `returned.len()` bytes), carrying `meta`: the same version and layout as the entry
/// read, so the bytes after it (a tag section, the value) stay as they are.
pub fn rewrite_header(decoded: &Decoded, meta: &EntryMeta) -> Header {
    match &decoded.tagged {
        Some(tagged) => tagged_fixed(meta, decoded.value_len as u64, tagged.written_at_ms),
        None => encode_header(meta, decoded.value_len as u64, Keeper::Envelope),
    }
}

/// What a tagged entry carries for tag invalidations (contract §7.5): when it was
/// written, by the cache's clock, and its tags.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tagged {
    /// When it was written (a set), or when its load began (a get-or-set), Unix ms.
    pub written_at_ms: u64,
    /// Its tags, 1 to 16, each 1 to 128 bytes of UTF-8.
    pub tags: Vec<String>,
}

/// The bytes a store keeps: an envelope `header`, then `rest` (the value, or what
/// follows a header a touch or an expire rewrote). The one place a header and its value
/// are joined.
pub fn splice(header: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut stored = Vec::with_capacity(header.len() + rest.len());
    stored.extend_from_slice(header);
    stored.extend_from_slice(rest);
    stored
}

/// The whole envelope: header and value.
pub fn encode(meta: &EntryMeta, value: &[u8], keeper: Keeper) -> Vec<u8> {
    splice(encode_header(meta, value.len() as u64, keeper).as_bytes(), value)
}

/// A decoded header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded {
    /// The entry's metadata.
    pub meta: EntryMeta,
    /// Where the value starts.
    pub value_offset: usize,
    /// How long the value is.
    pub value_len: usize,
    /// Where its expiry moment lives.
    pub keeper: Keeper,
    /// A tagged entry's write moment and tags (version 4).
    pub tagged: Option<Tagged>,
    /// How long its fixed header is (what a touch rewrites): 32, 40 or 48.
    pub fixed_len: usize,
}

/// Decodes the header in `head` (the first bytes of an envelope of `total_len` bytes).
///
/// # Errors
/// A [`Corruption`] when the bytes are not a version-1 envelope, the lengths disagree,
/// the value is over `limits.max_value_bytes`, or the fields contradict each other.
// Inlined into each reader: a batch judges a hundred headers in one guest call, and a
// call per header cost more than its decoding there.
#[inline(always)]
pub fn decode_header(head: &[u8], total_len: u64, limits: &Limits) -> Result<Decoded, Corruption> {
    let header_len = HEADER_LEN as u64;
    if head.len() < 4.min(HEADER_LEN) || total_len < 4 {
        return Err(Corruption::Truncated {
            expected: header_len,
            actual: total_len,
        });
    }
    if head[..3] != MAGIC {
        return Err(Corruption::Foreign);
    }
    let (keeper, fixed_len) = match head[3] {
        VERSION => (Keeper::Envelope, header_len),
        STORE_KEPT_VERSION => (Keeper::Store, header_len),
        STALE_VERSION => (Keeper::Envelope, 40),
        TAGGED_VERSION => (Keeper::Envelope, TAGGED_FIXED_LEN as u64),
        other => return Err(Corruption::UnknownVersion(other)),
    };
    let mut header_len = fixed_len;
    if (head.len() as u64) < header_len || total_len < header_len {
        return Err(Corruption::Truncated {
            expected: header_len,
            actual: total_len.min(head.len() as u64),
        });
    }
    let tagged = if head[3] == TAGGED_VERSION {
        let (tagged, section) = decode_tag_section(head, total_len)?;
        header_len += section;
        Some(tagged)
    } else {
        None
    };
    let u64_at = |at: usize| u64::from_be_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let absolute = u64_at(4);
    let sliding = u64_at(12);
    let expires_at_ms = u64_at(20);
    let value_len = u32::from_be_bytes(head[28..32].try_into().expect("4 bytes"));
    if value_len > limits.max_value_bytes {
        return Err(Corruption::Oversized {
            len: u64::from(value_len),
            max: limits.max_value_bytes,
        });
    }
    let expected = header_len + u64::from(value_len);
    if total_len < expected {
        return Err(Corruption::Truncated {
            expected,
            actual: total_len,
        });
    }
    if total_len > expected {
        return Err(Corruption::TrailingBytes {
            expected,
            actual: total_len,
        });
    }
    let stale_ms = if tagged.is_some() {
        (u64_at(32) != 0).then(|| u64_at(32))
    } else if fixed_len > HEADER_LEN as u64 {
        match u64_at(32) {
            0 => return Err(Corruption::Inconsistent("a stale window of 0 ms")),
            stale => Some(stale),
        }
    } else {
        None
    };
    let meta = EntryMeta {
        absolute_ms: (absolute != 0).then_some(absolute),
        sliding_ms: (sliding != 0).then_some(sliding),
        expires_at_ms,
        stale_ms,
    };
    if meta.absolute_ms.is_none() && meta.sliding_ms.is_none() {
        return Err(Corruption::Inconsistent(
            "neither absolute nor sliding expiration",
        ));
    }
    if meta.absolute_ms.is_some_and(|a| expires_at_ms > a) {
        return Err(Corruption::Inconsistent("expires after its absolute expiration"));
    }
    if keeper == Keeper::Store && meta.sliding_ms.is_none() {
        return Err(Corruption::Inconsistent(
            "its store keeps the expiry, but it does not slide",
        ));
    }
    Ok(Decoded {
        meta,
        value_offset: header_len as usize,
        value_len: value_len as usize,
        keeper,
        tagged,
        fixed_len: fixed_len as usize,
    })
}

/// The tag section of a version-4 header in `head` (which holds at least the fixed
/// part): the tags and written-at moment, and how many bytes the section takes.
fn decode_tag_section(head: &[u8], total_len: u64) -> Result<(Tagged, u64), Corruption> {
    let truncated = |expected: usize| Corruption::Truncated {
        expected: expected as u64,
        actual: total_len.min(head.len() as u64),
    };
    let written_at_ms = u64::from_be_bytes(head[40..48].try_into().expect("8 bytes"));
    let mut at = TAGGED_FIXED_LEN;
    let count = *head.get(at).ok_or_else(|| truncated(at + 1))? as usize;
    if count == 0 || count > MAX_TAGS {
        return Err(Corruption::Inconsistent("a tagged entry with 0 or over 16 tags"));
    }
    at += 1;
    let mut tags = Vec::with_capacity(count);
    for _ in 0..count {
        let len = *head.get(at).ok_or_else(|| truncated(at + 1))? as usize;
        if len == 0 || len > MAX_TAG_BYTES {
            return Err(Corruption::Inconsistent("a tag of 0 or over 128 bytes"));
        }
        at += 1;
        let bytes = head.get(at..at + len).ok_or_else(|| truncated(at + len))?;
        let tag =
            std::str::from_utf8(bytes).map_err(|_| Corruption::Inconsistent("a tag that is not UTF-8"))?;
        tags.push(tag.to_owned());
        at += len;
    }
    if (at as u64) > total_len {
        return Err(truncated(at));
    }
    Ok((Tagged { written_at_ms, tags }, (at - TAGGED_FIXED_LEN) as u64))
}

/// Decodes a whole envelope into its metadata and value.
///
/// # Errors
/// As [`decode_header`].
pub fn decode<'a>(bytes: &'a [u8], limits: &Limits) -> Result<(EntryMeta, &'a [u8]), Corruption> {
    let d = decode_header(bytes, bytes.len() as u64, limits)?;
    Ok((d.meta, &bytes[d.value_offset..d.value_offset + d.value_len]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const META: EntryMeta = EntryMeta {
        absolute_ms: Some(2_000),
        sliding_ms: Some(500),
        expires_at_ms: 1_500,
        stale_ms: None,
    };

    fn limits() -> Limits {
        Limits::default()
    }

    #[test]
    fn an_envelope_round_trips() {
        let bytes = encode(&META, b"hello", Keeper::Envelope);
        assert_eq!(bytes.len(), HEADER_LEN + 5);
        assert_eq!(&bytes[..4], b"CRL\x01");
        assert_eq!(decode(&bytes, &limits()), Ok((META, &b"hello"[..])));
    }

    #[test]
    fn a_sliding_entry_whose_store_keeps_the_moment_says_so() {
        let bytes = encode(&META, b"v", Keeper::Store);
        assert_eq!(&bytes[..4], b"CRL\x02");
        let d = decode_header(&bytes, bytes.len() as u64, &limits()).unwrap();
        assert_eq!((d.meta, d.keeper), (META, Keeper::Store));
        // Only a sliding entry has a moment to keep: others are version 1 either way.
        let fixed = EntryMeta {
            sliding_ms: None,
            ..META
        };
        assert_eq!(
            encode(&fixed, b"v", Keeper::Store),
            encode(&fixed, b"v", Keeper::Envelope)
        );
        let mut forged = encode(&fixed, b"v", Keeper::Envelope);
        forged[3] = STORE_KEPT_VERSION;
        assert!(matches!(
            decode(&forged, &limits()),
            Err(Corruption::Inconsistent(_))
        ));
    }

    #[test]
    fn an_empty_value_is_a_value() {
        let bytes = encode(&META, b"", Keeper::Envelope);
        assert_eq!(decode(&bytes, &limits()), Ok((META, &b""[..])));
    }

    #[test]
    fn the_header_alone_decodes_given_the_total_length() {
        let bytes = encode(&META, &[7; 100], Keeper::Envelope);
        let d = decode_header(&bytes[..HEADER_LEN], bytes.len() as u64, &limits()).unwrap();
        assert_eq!((d.meta, d.value_offset, d.value_len), (META, HEADER_LEN, 100));
    }

    #[test]
    fn a_truncated_envelope_is_corrupt() {
        let bytes = encode(&META, b"hello", Keeper::Envelope);
        for cut in [0, 2, 3, 10, HEADER_LEN, HEADER_LEN + 4] {
            let err = decode(&bytes[..cut], &limits()).unwrap_err();
            assert!(matches!(err, Corruption::Truncated { .. }), "cut at {cut}: {err}");
        }
    }

    #[test]
    fn trailing_bytes_are_corrupt() {
        let mut bytes = encode(&META, b"hello", Keeper::Envelope);
        bytes.push(0);
        assert!(matches!(
            decode(&bytes, &limits()),
            Err(Corruption::TrailingBytes { .. })
        ));
    }

    #[test]
    fn foreign_bytes_are_corrupt() {
        for bytes in [
            &b"hello world, this is not a Corral envelope"[..],
            b"{\"json\":true}",
            b"\0\0\0\0",
        ] {
            assert_eq!(decode(bytes, &limits()), Err(Corruption::Foreign));
        }
    }

    #[test]
    fn an_unknown_version_is_corrupt() {
        let mut bytes = encode(&META, b"x", Keeper::Envelope);
        bytes[3] = 5;
        assert_eq!(decode(&bytes, &limits()), Err(Corruption::UnknownVersion(5)));
    }

    #[test]
    fn an_entry_with_a_stale_window_is_version_3_with_a_40_byte_header() {
        let meta = EntryMeta {
            stale_ms: Some(9_000),
            ..META
        };
        for keeper in [Keeper::Envelope, Keeper::Store] {
            let bytes = encode(&meta, b"hello", keeper);
            assert_eq!((&bytes[..4], bytes.len()), (&b"CRL\x03"[..], 40 + 5));
            let d = decode_header(&bytes[..40], bytes.len() as u64, &limits()).unwrap();
            assert_eq!((d.meta, d.value_offset, d.keeper), (meta, 40, Keeper::Envelope));
            assert_eq!(decode(&bytes, &limits()), Ok((meta, &b"hello"[..])));
        }
        // Without its window's bytes, or with a window of 0, it is corrupt.
        let bytes = encode(&meta, b"", Keeper::Envelope);
        assert!(matches!(
            decode_header(&bytes[..HEADER_LEN], bytes.len() as u64, &limits()),
            Err(Corruption::Truncated { .. })
        ));
        let mut zero = bytes.clone();
        zero[32..40].fill(0);
        assert!(matches!(
            decode(&zero, &limits()),
            Err(Corruption::Inconsistent(_))
        ));
        // Entries without one are written as before.
        assert_eq!(encode(&META, b"v", Keeper::Envelope)[3], VERSION);
    }

    #[test]
    fn an_oversized_value_is_corrupt() {
        let small = Limits {
            max_value_bytes: 4,
            ..limits()
        };
        let bytes = encode(&META, b"hello", Keeper::Envelope);
        assert_eq!(
            decode(&bytes, &small),
            Err(Corruption::Oversized { len: 5, max: 4 })
        );
    }

    #[test]
    fn contradictory_fields_are_corrupt() {
        let none = EntryMeta {
            absolute_ms: None,
            sliding_ms: None,
            expires_at_ms: 5,
            stale_ms: None,
        };
        assert!(matches!(
            decode(&encode(&none, b"", Keeper::Envelope), &limits()),
            Err(Corruption::Inconsistent(_))
        ));
        let past_absolute = EntryMeta {
            absolute_ms: Some(5),
            sliding_ms: None,
            expires_at_ms: 6,
            stale_ms: None,
        };
        assert!(matches!(
            decode(&encode(&past_absolute, b"", Keeper::Envelope), &limits()),
            Err(Corruption::Inconsistent(_))
        ));
    }

    #[test]
    fn the_expires_at_field_is_where_the_script_writes() {
        let bytes = encode(&META, b"v", Keeper::Envelope);
        let field = &bytes[EXPIRES_AT_OFFSET..EXPIRES_AT_OFFSET + 8];
        assert_eq!(field, 1_500u64.to_be_bytes());
    }

    #[test]
    fn a_tagged_entry_is_version_4_and_a_touch_keeps_its_tags() {
        let tagged = Tagged {
            written_at_ms: 1_234,
            tags: vec!["news".into(), "ünïcode tag".into()],
        };
        for stale in [None, Some(9_000)] {
            let meta = EntryMeta {
                stale_ms: stale,
                ..META
            };
            let header = encode_tagged_header(&meta, 5, &tagged);
            let bytes = [&header[..], b"hello"].concat();
            assert_eq!(&bytes[..4], b"CRL\x04");
            let d = decode_header(&bytes, bytes.len() as u64, &limits()).unwrap();
            assert_eq!(
                (d.meta, d.value_offset, d.fixed_len),
                (meta, header.len(), TAGGED_FIXED_LEN)
            );
            assert_eq!(d.tagged.as_ref(), Some(&tagged));
            assert_eq!(decode(&bytes, &limits()), Ok((meta, &b"hello"[..])));
            // A touch rewrites the fixed part only: the tags and the value stay.
            let slid = EntryMeta {
                expires_at_ms: 1_900,
                ..meta
            };
            let fixed = rewrite_header(&d, &slid);
            let touched = [fixed.as_bytes(), &bytes[fixed.len()..]].concat();
            let t = decode_header(&touched, touched.len() as u64, &limits()).unwrap();
            assert_eq!((t.meta, t.tagged), (slid, Some(tagged.clone())));
        }
        // Every cut of a tagged envelope is corrupt, never a panic.
        let bytes = [&encode_tagged_header(&META, 1, &tagged)[..], b"x"].concat();
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], &limits()).is_err(), "cut at {cut}");
        }
        // Zero tags, an empty tag or foreign bytes in a tag are corrupt.
        let mut zero = bytes.clone();
        zero[TAGGED_FIXED_LEN] = 0;
        assert!(matches!(
            decode(&zero, &limits()),
            Err(Corruption::Inconsistent(_))
        ));
        let mut bad = bytes.clone();
        bad[TAGGED_FIXED_LEN + 2] = 0xff;
        assert!(decode(&bad, &limits()).is_err());
        // The longest header is what `header-len` reports.
        let longest = Tagged {
            written_at_ms: 1,
            tags: (0..MAX_TAGS).map(|i| format!("{i:0>128}")).collect(),
        };
        assert_eq!(encode_tagged_header(&META, 0, &longest).len(), MAX_HEADER_LEN);
    }

    fn any_meta() -> impl Strategy<Value = EntryMeta> {
        (
            proptest::option::of(1u64..u64::MAX / 2),
            proptest::option::of(1u64..u64::MAX / 2),
            1u64..u64::MAX / 2,
        )
            .prop_filter("some expiration", |(a, s, _)| a.is_some() || s.is_some())
            .prop_map(|(a, s, e)| EntryMeta {
                absolute_ms: a,
                sliding_ms: s,
                expires_at_ms: a.map_or(e, |a| a.min(e)),
                stale_ms: None,
            })
    }

    proptest! {
        #[test]
        fn every_valid_entry_round_trips(meta in any_meta(), value in proptest::collection::vec(any::<u8>(), 0..300)) {
            let bytes = encode(&meta, &value, Keeper::Envelope);
            prop_assert_eq!(decode(&bytes, &limits()), Ok((meta, &value[..])));
        }

        #[test]
        fn no_input_panics_and_only_envelopes_decode(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok((meta, value)) = decode(&bytes, &limits()) {
                // Whatever decodes re-encodes to the very same bytes.
                let d = decode_header(&bytes, bytes.len() as u64, &limits()).unwrap();
                let again = match &d.tagged {
                    Some(tagged) => [&encode_tagged_header(&meta, value.len() as u64, tagged)[..], value].concat(),
                    None => encode(&meta, value, d.keeper),
                };
                prop_assert_eq!(again, bytes);
            }
        }

        #[test]
        fn any_truncation_of_an_envelope_is_corrupt(meta in any_meta(), value in proptest::collection::vec(any::<u8>(), 1..100), cut in 0usize..132) {
            let bytes = encode(&meta, &value, Keeper::Envelope);
            let cut = cut.min(bytes.len() - 1);
            prop_assert!(decode(&bytes[..cut], &limits()).is_err());
        }
    }
}
