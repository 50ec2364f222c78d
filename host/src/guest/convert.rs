//! Between the public types and the WIT types, one function per direction.

use super::bindings::corral::cache::types;
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
