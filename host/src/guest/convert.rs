//! Between the public types and the WIT types, one function per direction.

use super::bindings::corral::cache::types;
use super::bindings::exports::corral::cache::policy;
use crate::options::{EntryMeta, EntryOptions};
use crate::{Error, ErrorKind};

pub(crate) fn from_wit(e: types::Error) -> Error {
    match e {
        types::Error::InvalidArgument(a) => Error::invalid_argument(a.name, a.reason),
        types::Error::Unavailable(m) => Error::new(ErrorKind::Unavailable, m),
        types::Error::Corrupt(m) => Error::new(ErrorKind::Corrupt, m),
        types::Error::LoaderFailed(m) => Error::new(ErrorKind::Loader, m),
        types::Error::Timeout(m) => Error::new(ErrorKind::Timeout, m),
        types::Error::Other(m) => Error::new(ErrorKind::Guest, m),
    }
}

/// An error as the guest's imports report it.
pub(crate) fn to_wit(e: &Error) -> types::Error {
    match e.kind() {
        ErrorKind::Unavailable | ErrorKind::Timeout => types::Error::Unavailable(e.to_string()),
        ErrorKind::Corrupt => types::Error::Corrupt(e.to_string()),
        _ => types::Error::Other(e.to_string()),
    }
}

pub(crate) fn options_in(o: &EntryOptions) -> types::EntryOptions {
    types::EntryOptions {
        absolute_ms: o.absolute_ms,
        relative_ms: o.relative_ms,
        sliding_ms: o.sliding_ms,
        max_stale_ms: o.max_stale_ms,
    }
}

#[cfg(any(test, feature = "test-util"))]
pub(crate) fn meta_in(m: &EntryMeta) -> types::EntryMeta {
    types::EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
        stale_ms: m.stale_ms,
    }
}

pub(crate) fn meta_out(m: types::EntryMeta) -> EntryMeta {
    EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
        stale_ms: m.stale_ms,
    }
}

/// `parts` joined in one string, as a batch's keys cross into the guest.
pub(crate) fn joined<S: AsRef<str>>(parts: &[S]) -> policy::Joined {
    let mut text = String::with_capacity(parts.iter().map(|p| p.as_ref().len()).sum());
    let ends = parts
        .iter()
        .map(|part| {
            text.push_str(part.as_ref());
            u32::try_from(text.len()).unwrap_or(u32::MAX)
        })
        .collect();
    policy::Joined { text, ends }
}

/// The strings a joined one holds, each borrowed from its text (a batch's names with
/// one allocation for them all); `None` if its ends do not split its text.
pub(crate) fn split(joined: policy::Joined) -> Option<Parts> {
    let mut start = 0;
    let ends = joined
        .ends
        .iter()
        .map(|&end| {
            let end = usize::try_from(end).ok()?;
            joined.text.get(start..end)?;
            start = end;
            Some(end)
        })
        .collect::<Option<Vec<usize>>>()?;
    Some(Parts {
        text: joined.text,
        ends,
    })
}

/// Strings split out of one text ([`split`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Parts {
    text: String,
    /// Where each part ends in `text` (each on a character boundary, in order).
    ends: Vec<usize>,
}

impl Parts {
    /// The `i`th part.
    pub(crate) fn get(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.text[start..self.ends[i]]
    }

    /// The parts, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let part = &self.text[start..end];
            start = end;
            part
        })
    }

    /// How many parts there are.
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Room for `count` parts of about `bytes` bytes in all, none yet.
    pub(crate) fn with_capacity(count: usize, bytes: usize) -> Parts {
        Parts {
            text: String::with_capacity(bytes),
            ends: Vec::with_capacity(count),
        }
    }

    /// The text parts are added to: a part written at its end is closed by
    /// [`Self::close_part`].
    pub(crate) fn text_mut(&mut self) -> &mut String {
        &mut self.text
    }

    /// Ends the part written since the last one ended.
    pub(crate) fn close_part(&mut self) {
        self.ends.push(self.text.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joined_strings_split_back_and_bad_ends_do_not() {
        let parts = ["", "ab", "é", "c"];
        let split_back = split(joined(&parts)).unwrap();
        assert_eq!(split_back.iter().collect::<Vec<_>>(), parts);
        assert_eq!((split_back.len(), split_back.get(2)), (4, "é"));
        for ends in [vec![1], vec![4], vec![2, 0]] {
            let bad = policy::Joined {
                text: "éa".into(),
                ends,
            };
            let ends = bad.ends.clone();
            assert!(split(bad).is_none(), "{ends:?}");
        }
    }
}
