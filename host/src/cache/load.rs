//! Options of a get-or-set: how the entry expires, what may be cached, and bypass.

use std::fmt;
use std::sync::Arc;

use crate::options::EntryOptions;

type Predicate = Arc<dyn Fn(&[u8]) -> bool + Send + Sync>;

/// How a [`get_or_set`](crate::Corral::get_or_set) caches what its loader returns.
///
/// `EntryOptions` converts into `LoadOptions` (cache everything, no bypass).
#[derive(Clone, Default)]
#[must_use]
pub struct LoadOptions {
    pub(crate) entry: EntryOptions,
    should_cache: Option<Predicate>,
    pub(crate) bypass: bool,
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("entry", &self.entry)
            .field("should_cache", &self.should_cache.is_some())
            .field("bypass", &self.bypass)
            .finish()
    }
}

impl LoadOptions {
    /// Cache every loaded value with the cache's default expiration.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cache loaded values for `after` from the load: `LoadOptions::relative(d)` is
    /// `LoadOptions::new().entry(EntryOptions::new().relative(d))`.
    pub fn relative(after: std::time::Duration) -> Self {
        Self::new().entry(EntryOptions::new().relative(after))
    }

    /// Cache loaded values until `idle` passes without a read.
    pub fn sliding(idle: std::time::Duration) -> Self {
        Self::new().entry(EntryOptions::new().sliding(idle))
    }

    /// Cache loaded values until `at`.
    pub fn absolute(at: std::time::SystemTime) -> Self {
        Self::new().entry(EntryOptions::new().absolute(at))
    }

    /// How the loaded entry expires.
    pub fn entry(mut self, entry: EntryOptions) -> Self {
        self.entry = entry;
        self
    }

    /// Cache a loaded value only if `predicate` accepts it; a rejected value is still
    /// returned to the caller (and its coalesced followers), but written to no tier.
    /// Use it to keep failures (an error page, an empty result) out of the cache.
    pub fn should_cache(mut self, predicate: impl Fn(&[u8]) -> bool + Send + Sync + 'static) -> Self {
        self.should_cache = Some(Arc::new(predicate));
        self
    }

    /// Skip L1, the flight registry and the lock: call the loader, write the tiers if
    /// `should_cache` accepts, return. For forced refreshes.
    pub fn bypass(mut self, bypass: bool) -> Self {
        self.bypass = bypass;
        self
    }

    pub(crate) fn accepts(&self, value: &[u8]) -> bool {
        self.should_cache.as_ref().is_none_or(|p| p(value))
    }
}

impl From<EntryOptions> for LoadOptions {
    fn from(entry: EntryOptions) -> Self {
        LoadOptions::new().entry(entry)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_shortcuts_are_the_long_forms() {
        let d = Duration::from_secs(30);
        assert_eq!(LoadOptions::relative(d).entry, EntryOptions::new().relative(d));
        assert_eq!(LoadOptions::sliding(d).entry, EntryOptions::new().sliding(d));
        assert!(!LoadOptions::relative(d).should_cache(|_| false).accepts(b"x"));
    }
}
