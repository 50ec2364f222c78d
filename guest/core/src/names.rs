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

use crate::{ArgError, Limits, key};

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
}

impl Kind {
    fn letter(self) -> char {
        match self {
            Kind::Entry => 'e',
            Kind::FlightLock => 'l',
            Kind::Lock => 'k',
            Kind::Fence => 'f',
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
}

/// The names of `key`'s data under `prefix`, once `key` passed the key rules.
///
/// # Errors
/// An [`ArgError`] naming `key`.
pub fn locate(prefix: &str, key: &str, limits: &Limits) -> Result<Names, ArgError> {
    key::validate(key, limits)?;
    let tag = tag(prefix, key);
    let named = |kind: Kind| format!("{tag}:{}", kind.letter());
    Ok(Names {
        entry: named(Kind::Entry),
        flight_lock: named(Kind::FlightLock),
        lock: named(Kind::Lock),
        fence: named(Kind::Fence),
    })
}

/// The name of one kind of `key`'s data under `prefix`, once `key` passed the key rules
/// (one name where [`locate`] gives all four: a read needs only its entry's).
///
/// # Errors
/// An [`ArgError`] naming `key`.
pub fn locate_one(prefix: &str, key: &str, kind: Kind, limits: &Limits) -> Result<String, ArgError> {
    key::validate(key, limits)?;
    Ok(name(prefix, key, kind))
}

/// The name of one kind of `key`'s data under `prefix` (no key rules applied).
pub fn name(prefix: &str, key: &str, kind: Kind) -> String {
    format!("{}:{}", tag(prefix, key), kind.letter())
}

/// The landing channel of `prefix`: `{<n>:<prefix>}:n`.
pub fn channel(prefix: &str) -> String {
    format!("{}:n", tag(prefix, ""))
}

/// `{<n>:<prefix><key>}`, escaped.
fn tag(prefix: &str, key: &str) -> String {
    let mut tag = String::with_capacity(prefix.len() + key.len() + 8);
    tag.push('{');
    tag.push_str(&prefix.len().to_string());
    tag.push(':');
    for c in prefix.chars().chain(key.chars()) {
        match c {
            '\\' => tag.push_str("\\\\"),
            '}' => tag.push_str("\\]"),
            c => tag.push(c),
        }
    }
    tag.push('}');
    tag
}

#[cfg(test)]
mod tests {
    use super::*;
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
            kind1 in 0..4usize, kind2 in 0..4usize,
        ) {
            let kinds = [Kind::Entry, Kind::FlightLock, Kind::Lock, Kind::Fence];
            let (a, b) = (name(&p1, &k1, kinds[kind1]), name(&p2, &k2, kinds[kind2]));
            prop_assert_eq!(a == b, (p1, k1, kind1) == (p2, k2, kind2));
        }

        #[test]
        fn every_kind_of_one_key_shares_a_slot(p in ".{0,8}", k in ".{1,8}") {
            let n = locate(&p, &k, &Limits::default());
            prop_assume!(n.is_ok());
            let n = n.unwrap();
            let tag = hash_tag(&n.entry).to_owned();
            prop_assert!(!tag.is_empty());
            for other in [&n.flight_lock, &n.lock, &n.fence] {
                prop_assert_eq!(hash_tag(other), tag.as_str());
            }
        }
    }
}
