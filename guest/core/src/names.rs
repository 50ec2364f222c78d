//! Where a key's data lives in a shared store (contract §2.4): one unambiguous,
//! Redis-Cluster-ready name per (prefix, kind, key).
//!
//! A name is `{<n>:<prefix><key>}:<kind>`, where `<n>` is the prefix's length in bytes
//! and, inside the braces, `\` is written `\\` and `}` is written `\]`:
//!
//! - unambiguous: the braces close at the first `}`, escaping is one-to-one, and `<n>`
//!   says where the prefix ends, so no two (prefix, kind, key) share a name, whatever
//!   characters prefixes and keys hold (nested prefixes included);
//! - cluster-ready: the braces are the Redis hash tag, the same for every kind of one
//!   (prefix, key), so an entry, its flight lock, its user lock and its fence counter
//!   share one hash slot and every script touching them is single-slot;
//! - readable: `{7:corral:user:42}:e`.
//!
//! Names of the first round's scheme (`corral:e:user:42`) never start with `{`: they
//! are simply never read again.
//!
//! **Generations** (`clear`, contract §7.5): an entry and its flight lock are named in
//! the prefix's current generation, `{…}:e` in generation 0 (the names above: nothing
//! moves until a first clear) and `{…}:e@<g>` from generation 1. User locks and fence
//! counters are not cache data: they keep their names across clears. A tag's moments
//! live at `{<n>:<prefix><tag>}:t`, the generation counter at `{<n>:<prefix>}:g`, and
//! tag and clear announcements travel on `{<n>:<prefix>}:i`.

use crate::{Arg, ArgError, Limits, key};

/// The prefix a cache's data is named under when none is given.
pub const DEFAULT_PREFIX: &str = "corral:";

/// What a name holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A cache entry (`e`).
    Entry,
    /// The get-or-set lock of an entry (`l`).
    FlightLock,
    /// A user lock of the lock API (`k`).
    Lock,
    /// The fencing counter of a user lock (`f`).
    Fence,
    /// The waiters' queue of a fair user lock (`q`).
    Queue,
    /// The mark of a user lock's waiters (`w`): set by a try that found the lock held
    /// and will wait, it tells the release to announce itself.
    Waiting,
    /// A tag's invalidation moments (`t`; the "key" is the tag).
    Tag,
}

impl Kind {
    fn letter(self) -> char {
        match self {
            Kind::Entry => 'e',
            Kind::FlightLock => 'l',
            Kind::Lock => 'k',
            Kind::Fence => 'f',
            Kind::Queue => 'q',
            Kind::Waiting => 'w',
            Kind::Tag => 't',
        }
    }
}

/// The names of one key's data under one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// The entry.
    pub entry: String,
    /// The entry's get-or-set lock.
    pub flight_lock: String,
    /// The user lock of the same key.
    pub lock: String,
    /// The user lock's fencing counter.
    pub fence: String,
    /// The user lock's queue of fair waiters.
    pub queue: String,
    /// The mark of the user lock's waiters.
    pub waiting: String,
}

/// The names of `key`'s data under `prefix`, once `key` passed the key rules.
///
/// # Errors
/// An [`ArgError`] naming `key`.
pub fn locate(prefix: &str, key: &str, limits: &Limits) -> Result<Names, ArgError> {
    locate_in(prefix, key, 0, limits)
}

/// As [`locate`], with the entry and its flight lock in `generation` (a user lock and
/// its fence counter have no generation).
///
/// # Errors
/// An [`ArgError`] naming `key`.
pub fn locate_in(prefix: &str, key: &str, generation: u64, limits: &Limits) -> Result<Names, ArgError> {
    key::validate(key, limits)?;
    let tag = tag(prefix, key);
    Ok(Names {
        entry: named(&tag, Kind::Entry, generation),
        flight_lock: named(&tag, Kind::FlightLock, generation),
        lock: named(&tag, Kind::Lock, generation),
        fence: named(&tag, Kind::Fence, generation),
        queue: named(&tag, Kind::Queue, generation),
        waiting: named(&tag, Kind::Waiting, generation),
    })
}

/// Strings joined in one: `text`, and where each ends in it (in bytes), in order. A
/// batch's keys cross the component boundary this way, and their names come back so:
/// one string per call, not one per key, is what keeps naming a batch cheap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Joined {
    /// The strings, one after another.
    pub text: String,
    /// Where each string ends in `text`.
    pub ends: Vec<u32>,
}

impl Joined {
    /// Ends the string being pushed onto `text`.
    fn end_part(&mut self) {
        self.ends.push(u32::try_from(self.text.len()).unwrap_or(u32::MAX));
    }

    /// The strings, in order; `None` if an end is out of order, past the text, or
    /// inside a character.
    pub fn parts(&self) -> Option<Vec<&str>> {
        split_joined(&self.text, &self.ends)
    }
}

/// The strings `text` holds, each ending where `ends` says (see [`Joined`]); `None` if
/// an end is out of order, past the text, or inside a character.
fn split_joined<'a>(text: &'a str, ends: &[u32]) -> Option<Vec<&'a str>> {
    let mut start = 0;
    ends.iter()
        .map(|&end| {
            let end = usize::try_from(end).ok()?;
            let part = text.get(start..end)?;
            start = end;
            Some(part)
        })
        .collect()
}

/// The entry names of `keys` under `prefix` in `generation`, in order and joined, once
/// every key passed the key rules (a batch's reads need only these).
///
/// # Errors
/// The position of the first bad key, and the [`ArgError`] naming `key` that says it
/// ([`batch::at_position`](crate::batch::at_position)).
pub fn entries_in<S: AsRef<str>>(
    prefix: &str,
    keys: &[S],
    generation: u64,
    limits: &Limits,
) -> Result<Joined, (usize, ArgError)> {
    let mut names = Joined {
        text: String::with_capacity(keys.len() * (prefix.len() + 32)),
        ends: Vec::with_capacity(keys.len()),
    };
    for (i, key) in keys.iter().enumerate() {
        let key = key.as_ref();
        key::validate(key, limits).map_err(|e| (i, crate::batch::at_position(i, e)))?;
        push_tag(&mut names.text, prefix, key);
        push_kind(&mut names.text, Kind::Entry, generation);
        names.end_part();
    }
    Ok(names)
}

/// [`entries_in`] for keys that came joined in `keys` (see [`Joined`]).
///
/// # Errors
/// As [`entries_in`]; an [`ArgError`] naming `keys`, at position 0, when their ends do
/// not split their text.
pub fn entries_of_joined(
    prefix: &str,
    keys: &Joined,
    generation: u64,
    limits: &Limits,
) -> Result<Joined, (usize, ArgError)> {
    let Some(keys) = keys.parts() else {
        return Err((0, ArgError::new(Arg::Keys, "their ends do not split their text")));
    };
    entries_in(prefix, &keys, generation, limits)
}

/// `<tag>:<kind>`, with the generation's `@<g>` for the kinds it changes (entries and
/// flight locks, from generation 1). Built by hand: this runs for every key of every
/// operation, and formatting machinery costs the guest more than the bytes.
fn named(tag: &str, kind: Kind, generation: u64) -> String {
    let mut name = String::with_capacity(tag.len() + 24);
    name.push_str(tag);
    push_kind(&mut name, kind, generation);
    name
}

/// Appends `:<kind>`, and `@<g>` where the generation names it (see [`named`]).
fn push_kind(to: &mut String, kind: Kind, generation: u64) {
    to.push(':');
    to.push(kind.letter());
    if generation > 0 && matches!(kind, Kind::Entry | Kind::FlightLock) {
        to.push('@');
        push_decimal(to, generation);
    }
}

/// Appends `n` in decimal.
fn push_decimal(to: &mut String, n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // ASCII digits only.
    to.push_str(std::str::from_utf8(&digits[at..]).unwrap_or_default());
}

/// The name of one kind of `key`'s data under `prefix`, once `key` passed the key rules
/// (one name where [`locate`] gives all four: a read needs only its entry's).
///
/// # Errors
/// An [`ArgError`] naming `key`.
pub fn locate_one(prefix: &str, key: &str, kind: Kind, limits: &Limits) -> Result<String, ArgError> {
    locate_one_in(prefix, key, kind, 0, limits)
}

/// As [`locate_one`], in `generation` (which changes only entries and flight locks).
///
/// # Errors
/// An [`ArgError`] naming `key`.
pub fn locate_one_in(
    prefix: &str,
    key: &str,
    kind: Kind,
    generation: u64,
    limits: &Limits,
) -> Result<String, ArgError> {
    key::validate(key, limits)?;
    Ok(name_in(prefix, key, kind, generation))
}

/// The name of one kind of `key`'s data under `prefix` (no key rules applied).
pub fn name(prefix: &str, key: &str, kind: Kind) -> String {
    name_in(prefix, key, kind, 0)
}

/// As [`name`], in `generation`.
pub fn name_in(prefix: &str, key: &str, kind: Kind, generation: u64) -> String {
    named(&tag(prefix, key), kind, generation)
}

/// Where `tag`'s invalidation moments live under `prefix`: `{<n>:<prefix><tag>}:t`.
///
/// # Errors
/// An [`ArgError`] naming `tag` (see [`crate::tags::check_tag`]).
pub fn tag_name(prefix: &str, tag_: &str) -> Result<String, ArgError> {
    crate::tags::check_tag(tag_)?;
    Ok(name(prefix, tag_, Kind::Tag))
}

/// What kind of a key's data `name` names, read back from the name (`…}:e`, `…}:e@3`):
/// none for a name of the prefix's own (the generation, the channels) or not Corral's.
/// A store that cannot change data only over what was read tells entries from the rest
/// by it.
pub fn kind_of(name: &str) -> Option<Kind> {
    let (head, last) = name.rsplit_once(':')?;
    if !head.ends_with('}') {
        return None;
    }
    let mut rest = last.chars();
    let kind = match rest.next()? {
        'e' => Kind::Entry,
        'l' => Kind::FlightLock,
        'k' => Kind::Lock,
        'f' => Kind::Fence,
        'q' => Kind::Queue,
        'w' => Kind::Waiting,
        't' => Kind::Tag,
        _ => return None,
    };
    let suffix = rest.as_str();
    let generation_ok = suffix.is_empty()
        || matches!(kind, Kind::Entry | Kind::FlightLock)
            && suffix
                .strip_prefix('@')
                .is_some_and(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()));
    generation_ok.then_some(kind)
}

/// The name of `kind` beside `name`, a name of a key's data ([`kind_of`]): the same key,
/// in the same generation (`{…}:l@3` gives the entry `{…}:e@3`). None for a name that is
/// not a key's, or a generation for a kind it does not change.
pub fn beside(name: &str, kind: Kind) -> Option<String> {
    kind_of(name)?;
    let (head, last) = name.rsplit_once(':')?;
    // After the kind's letter (ASCII): nothing, or the generation's `@<g>`.
    let generation = last.get(1..)?;
    if !generation.is_empty() && !matches!(kind, Kind::Entry | Kind::FlightLock) {
        return None;
    }
    let mut to = String::with_capacity(name.len());
    to.push_str(head);
    to.push(':');
    to.push(kind.letter());
    to.push_str(generation);
    Some(to)
}

/// The generation counter of `prefix` (clear): `{<n>:<prefix>}:g`.
pub fn generation(prefix: &str) -> String {
    format!("{}:g", tag(prefix, ""))
}

/// The invalidation channel of `prefix` (tags and clears): `{<n>:<prefix>}:i`.
pub fn invalidations(prefix: &str) -> String {
    format!("{}:i", tag(prefix, ""))
}

/// The landing channel of `prefix`: `{<n>:<prefix>}:n`.
pub fn channel(prefix: &str) -> String {
    format!("{}:n", tag(prefix, ""))
}

/// `{<n>:<prefix><key>}`, escaped.
fn tag(prefix: &str, key: &str) -> String {
    let mut tag = String::with_capacity(prefix.len() + key.len() + 8);
    push_tag(&mut tag, prefix, key);
    tag
}

/// Appends [`tag`]`(prefix, key)`.
fn push_tag(to: &mut String, prefix: &str, key: &str) {
    to.push('{');
    push_decimal(to, prefix.len() as u64);
    to.push(':');
    for part in [prefix, key] {
        // `\` and `}` escaped; the runs between them copied whole.
        let mut rest = part;
        while let Some(at) = rest.find(['\\', '}']) {
            to.push_str(&rest[..at]);
            to.push_str(if rest.as_bytes()[at] == b'\\' {
                "\\\\"
            } else {
                "\\]"
            });
            rest = &rest[at + 1..];
        }
        to.push_str(rest);
    }
    to.push('}');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_any_generation_and_batch_entries_match_one_by_one() {
        let limits = Limits::default();
        assert_eq!(
            name_in("p:", "k", Kind::Entry, u64::MAX),
            format!("{{2:p:k}}:e@{}", u64::MAX)
        );
        assert_eq!(name_in("p:", "k", Kind::Lock, 7), "{2:p:k}:k");
        let keys = ["a", "b}\\", "user:42"];
        let entries = entries_in("corral:", &keys, 3, &limits).unwrap();
        let entries = entries.parts().unwrap();
        assert_eq!(entries.len(), keys.len());
        for (key, entry) in keys.iter().zip(entries) {
            assert_eq!(entry, locate_in("corral:", key, 3, &limits).unwrap().entry);
        }
        let (at, e) = entries_in("p:", &["a", " "], 0, &limits).unwrap_err();
        assert_eq!((at, e.arg), (1, crate::Arg::Key));
    }

    #[test]
    fn a_tag_escapes_backslashes_and_closing_braces_in_prefix_and_key() {
        assert_eq!(tag("p}", "a\\b}c"), "{2:p\\]a\\\\b\\]c}");
        assert_eq!(tag("", "é}"), "{0:é\\]}");
        assert_eq!(tag("corral:", "user:42"), "{7:corral:user:42}");
    }

    #[test]
    fn joined_strings_split_back_and_bad_ends_are_refused() {
        let joined = Joined {
            text: "abéc".into(),
            ends: vec![0, 2, 4, 5],
        };
        assert_eq!(joined.parts().unwrap(), ["", "ab", "é", "c"]);
        assert_eq!(split_joined("abc", &[]).unwrap(), Vec::<&str>::new());
        assert!(split_joined("abc", &[2, 1]).is_none(), "out of order");
        assert!(split_joined("abc", &[4]).is_none(), "past the text");
        assert!(split_joined("é", &[1]).is_none(), "inside a character");
        let bad = Joined {
            text: "ab".into(),
            ends: vec![3],
        };
        let (at, e) = entries_of_joined("p:", &bad, 0, &Limits::default()).unwrap_err();
        assert_eq!((at, e.arg), (0, crate::Arg::Keys));
    }

    #[test]
    fn a_names_kind_reads_back_from_it_and_only_from_corrals_names() {
        let limits = Limits::default();
        for g in [0, 7] {
            let n = locate_in("corral:", "a:b}:e", g, &limits).unwrap();
            assert_eq!(kind_of(&n.entry), Some(Kind::Entry), "{}", n.entry);
            assert_eq!(kind_of(&n.flight_lock), Some(Kind::FlightLock));
            assert_eq!(kind_of(&n.lock), Some(Kind::Lock));
            assert_eq!(kind_of(&n.fence), Some(Kind::Fence));
            assert_eq!(kind_of(&n.queue), Some(Kind::Queue));
            assert_eq!(kind_of(&n.waiting), Some(Kind::Waiting));
        }
        assert_eq!(kind_of(&tag_name("corral:", "t").unwrap()), Some(Kind::Tag));
        for other in [
            generation("corral:"),
            invalidations("corral:"),
            channel("corral:"),
        ] {
            assert_eq!(kind_of(&other), None, "{other}");
        }
        for foreign in [
            "", "e", "x:e", "{a}:e@", "{a}:e@1x", "{a}:k@1", "{a}:q@1", "{a}:w@1", "{a}:z",
        ] {
            assert_eq!(kind_of(foreign), None, "{foreign}");
            assert_eq!(beside(foreign, Kind::Entry), None, "{foreign}");
        }
    }

    #[test]
    fn a_name_beside_another_is_the_same_keys_in_the_same_generation() {
        let limits = Limits::default();
        for generation in [0, 3] {
            let n = locate_in("corral:", "user:42", generation, &limits).unwrap();
            assert_eq!(beside(&n.flight_lock, Kind::Entry), Some(n.entry.clone()));
            assert_eq!(beside(&n.entry, Kind::FlightLock), Some(n.flight_lock.clone()));
        }
        let n = locate("corral:", "user:42", &limits).unwrap();
        assert_eq!(beside(&n.entry, Kind::Lock), Some(n.lock));
        let later = locate_in("corral:", "user:42", 3, &limits).unwrap();
        assert_eq!(beside(&later.entry, Kind::Lock), None, "a lock has no generation");
    }
    use proptest::prelude::*;

    #[test]
    fn names_read_well_and_share_one_hash_tag() {
        let n = locate("corral:", "user:42", &Limits::default()).unwrap();
        assert_eq!(n.entry, "{7:corral:user:42}:e");
        assert_eq!(n.flight_lock, "{7:corral:user:42}:l");
        assert_eq!(n.lock, "{7:corral:user:42}:k");
        assert_eq!(n.fence, "{7:corral:user:42}:f");
        assert_eq!(channel("corral:"), "{7:corral:}:n");
    }

    #[test]
    fn nested_prefixes_never_meet() {
        // The first round's scheme mapped both of these to `corral:e:e:k`.
        assert_ne!(
            name("corral:", "e:k", Kind::Entry),
            name("corral:e:", "k", Kind::Entry)
        );
        assert_ne!(name("a", "bc", Kind::Entry), name("ab", "c", Kind::Entry));
        assert_ne!(name("t", "x}:l", Kind::Entry), name("t", "x", Kind::FlightLock));
    }

    #[test]
    fn generations_move_entries_and_flight_locks_only() {
        let g0 = locate("corral:", "k", &Limits::default()).unwrap();
        assert_eq!(locate_in("corral:", "k", 0, &Limits::default()).unwrap(), g0);
        let g3 = locate_in("corral:", "k", 3, &Limits::default()).unwrap();
        assert_eq!(g3.entry, "{7:corral:k}:e@3");
        assert_eq!(g3.flight_lock, "{7:corral:k}:l@3");
        assert_eq!((g3.lock, g3.fence), (g0.lock, g0.fence));
        assert_eq!(tag_name("corral:", "news").unwrap(), "{7:corral:news}:t");
        assert_eq!(generation("corral:"), "{7:corral:}:g");
        assert_eq!(invalidations("corral:"), "{7:corral:}:i");
        assert!(tag_name("corral:", "").is_err());
        // Tenants never share a tag, a counter or a channel.
        assert_ne!(tag_name("a:", "t").unwrap(), tag_name("b:", "t").unwrap());
        assert_ne!(generation("a:"), generation("a:b"));
    }

    #[test]
    fn a_bad_key_is_an_argument_error() {
        assert!(locate("p", " ", &Limits::default()).is_err());
    }

    /// The Redis Cluster hash tag: the bytes between the first `{` and the next `}`.
    fn hash_tag(name: &str) -> &str {
        let open = name.find('{').unwrap();
        let close = name[open + 1..].find('}').unwrap() + open + 1;
        &name[open + 1..close]
    }

    proptest! {
        #[test]
        fn distinct_triples_get_distinct_names(
            p1 in ".{0,6}", k1 in ".{1,6}", p2 in ".{0,6}", k2 in ".{1,6}",
            kind1 in 0..7usize, kind2 in 0..7usize, g1 in 0..3u64, g2 in 0..3u64,
        ) {
            let kinds = [Kind::Entry, Kind::FlightLock, Kind::Lock, Kind::Fence, Kind::Tag, Kind::Queue, Kind::Waiting];
            // Only entries and flight locks have generations.
            let g1 = if kind1 < 2 { g1 } else { 0 };
            let g2 = if kind2 < 2 { g2 } else { 0 };
            let (a, b) = (name_in(&p1, &k1, kinds[kind1], g1), name_in(&p2, &k2, kinds[kind2], g2));
            prop_assert_eq!(a == b, (p1, k1, kind1, g1) == (p2, k2, kind2, g2));
        }

        #[test]
        fn every_kind_of_one_key_shares_a_slot(p in ".{0,8}", k in ".{1,8}") {
            let n = locate(&p, &k, &Limits::default());
            prop_assume!(n.is_ok());
            let n = n.unwrap();
            let tag = hash_tag(&n.entry).to_owned();
            prop_assert!(!tag.is_empty());
            for other in [&n.flight_lock, &n.lock, &n.fence, &n.queue, &n.waiting] {
                prop_assert_eq!(hash_tag(other), tag.as_str());
            }
        }
    }
}
