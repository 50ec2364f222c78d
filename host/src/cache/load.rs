//! Options of a get-or-set: how the entry expires, what may be cached, and bypass.

use std::fmt;
use std::sync::Arc;

use crate::options::EntryOptions;

type Predicate = Arc<dyn Fn(&[u8]) -> bool + Send + Sync>;

/// A value as a cache served it, saying whether it was a stale copy kept for fail-safe
/// (contract §7.1): see [`Corral::get_stale`](crate::Corral::get_stale) and
/// [`Corral::get_or_set_served`](crate::Corral::get_or_set_served).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Served {
    /// The value.
    pub value: bytes::Bytes,
    /// Whether it is a stale copy: past its expiry, served because a reload failed,
    /// timed out or could not get the lock (or, for `get_stale`, because nothing fresh
    /// was there).
    pub stale: bool,
}

/// How a [`get_or_set`](crate::Corral::get_or_set) caches what its loader returns.
///
/// `EntryOptions` converts into `LoadOptions` (cache everything, no bypass).
#[derive(Clone, Default)]
#[must_use]
pub struct LoadOptions {
    pub(crate) entry: EntryOptions,
    should_cache: Option<Predicate>,
    pub(crate) bypass: bool,
    /// How long a typed `None` is cached; `None`: not at all.
    pub(crate) none_ttl: Option<std::time::Duration>,
    /// Set by the typed API: a loaded JSON `null` is a `None`.
    pub(crate) typed: bool,
    /// The hard loader timeout, if this call names one (else the cache's default).
    pub(crate) hard_timeout_ms: Option<u64>,
    /// The soft loader timeout (needs [`Corral::fetch`](crate::Corral::fetch)).
    pub(crate) soft_timeout_ms: Option<u64>,
    /// Eager refresh, in thousandths of the freshness (needs `fetch`).
    pub(crate) eager_refresh_permille: Option<u32>,
    /// A load past the hard timeout goes on in the background (needs `fetch`).
    pub(crate) background_completion: bool,
    /// This is a background refresh's flight.
    pub(crate) refresh: bool,
    /// The tags a loaded entry carries (contract §7.5).
    pub(crate) tags: Arc<[String]>,
    /// The most keys one call of a batch loader gets; `None`: no limit.
    pub(crate) max_batch: Option<usize>,
    /// When the call judged these options ([`Corral::judge`](super::Corral)), set by the
    /// call itself: every flight of the call starts from that verdict (one that leads
    /// after following, a batch's key that flies on after its batch's reads, a refresh).
    pub(crate) judged_ms: Option<u64>,
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("entry", &self.entry)
            .field("should_cache", &self.should_cache.is_some())
            .field("bypass", &self.bypass)
            .field("none_ttl", &self.none_ttl)
            .field("hard_timeout_ms", &self.hard_timeout_ms)
            .field("soft_timeout_ms", &self.soft_timeout_ms)
            .field("eager_refresh_permille", &self.eager_refresh_permille)
            .field("background_completion", &self.background_completion)
            .field("tags", &self.tags)
            .field("max_batch", &self.max_batch)
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

    /// The tags a loaded entry carries (contract §7.5): at most 16, each 1 to 128
    /// bytes (else the get-or-set is an argument error naming `tags`, before the loader
    /// runs). [`Corral::remove_by_tag`](crate::Corral::remove_by_tag) of any of them
    /// invalidates it in every process; a load that began before that invalidation
    /// counts as older than it.
    pub fn tags<T: Into<String>>(mut self, tags: impl IntoIterator<Item = T>) -> Self {
        self.tags = tags.into_iter().map(Into::into).collect();
        self
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

    /// Adds `predicate` to the one already set: both must accept.
    pub(crate) fn and_should_cache(
        mut self,
        predicate: impl Fn(&[u8]) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.should_cache = Some(match self.should_cache.take() {
            Some(first) => Arc::new(move |v: &[u8]| first(v) && predicate(v)),
            None => Arc::new(predicate),
        });
        self
    }

    /// Fail-safe (contract §7.1): keep each loaded entry's stale copy for `max_stale`
    /// past its expiry, and when a later reload fails, runs past its hard timeout or
    /// cannot get the lock, serve that copy instead of the error (to every caller of the
    /// flight; then from L1 for the cache's
    /// [`fail_safe_throttle`](crate::CorralBuilder::fail_safe_throttle)). Shorthand for
    /// `entry(entry_options.fail_safe(max_stale))`.
    pub fn fail_safe(mut self, max_stale: std::time::Duration) -> Self {
        self.entry = self.entry.fail_safe(max_stale);
        self
    }

    /// The hard loader timeout of this call (contract §7.2): a loader still running
    /// `timeout` after it started is stopped (its future dropped); the callers get the
    /// stale copy if fail-safe has one, else
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout). Nothing is cached. Overrides
    /// the cache's [`hard_timeout`](crate::CorralBuilder::hard_timeout).
    pub fn hard_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.hard_timeout_ms = Some(crate::options::duration_ms(timeout).max(1));
        self
    }

    /// Background completion (contract §7.2): a loader still running at the hard
    /// timeout is not stopped. The callers are answered then as the hard timeout
    /// answers them (the stale copy if fail-safe has one, else
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout)), and the load goes on in the
    /// background: when it succeeds its value fills both tiers (fenced like any fill,
    /// so a `set` or `remove` meanwhile wins), and the next call gets it. Needs a loader
    /// that may outlive the call: [`Corral::fetch`](crate::Corral::fetch) (with
    /// `get_or_set` it is an [`InvalidArgument`](crate::ErrorKind::InvalidArgument)
    /// naming `background_completion`). Without a hard timeout it changes nothing.
    pub fn background_completion(mut self, on: bool) -> Self {
        self.background_completion = on;
        self
    }

    /// The soft loader timeout (contract §7.2): when a stale copy exists (see
    /// [`fail_safe`](Self::fail_safe)) and the loader runs longer than `timeout`, the
    /// callers get the stale copy at once and the load goes on in the background,
    /// filling both tiers when it ends. Needs a loader that may outlive the call:
    /// [`Corral::fetch`](crate::Corral::fetch) (with `get_or_set` it is an
    /// [`InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `soft_timeout`).
    pub fn soft_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.soft_timeout_ms = Some(crate::options::duration_ms(timeout).max(1));
        self
    }

    /// Eager refresh (contract §7.3): once `fraction` (strictly between 0 and 1) of a
    /// loaded entry's freshness has passed (its [`relative`](Self::relative)
    /// duration), a hit returns the current value at once and starts one background
    /// refresh; across processes only one runs (it takes the flight lock without
    /// waiting), and a failed refresh leaves the current value in place. Entries without
    /// a relative duration are not refreshed early. Needs
    /// [`Corral::fetch`](crate::Corral::fetch) (with `get_or_set`: an
    /// [`InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `eager_refresh`).
    pub fn eager_refresh(mut self, fraction: f64) -> Self {
        self.eager_refresh_permille = Some(permille(fraction));
        self
    }

    /// The most keys one loader call of [`get_or_set_many`](crate::Corral::get_or_set_many)
    /// gets: more misses are loaded in several calls, made at once. At least 1 (0 is an
    /// [`InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `max_batch`); no
    /// limit by default. A single-key get-or-set ignores it.
    pub fn max_batch(mut self, keys: usize) -> Self {
        self.max_batch = Some(keys);
        self
    }

    /// Skip L1, the flight registry and the lock: call the loader, write the tiers if
    /// `should_cache` accepts, return. For forced refreshes.
    pub fn bypass(mut self, bypass: bool) -> Self {
        self.bypass = bypass;
        self
    }

    /// Negative caching for the typed get-or-set: a loaded `None` (JSON `null`), which is
    /// not cached unless asked, is cached for `ttl` (its own expiry, whatever the
    /// entry's options say), so a missing row is not asked for on every call.
    pub fn cache_none_for(mut self, ttl: std::time::Duration) -> Self {
        self.none_ttl = Some(ttl);
        self
    }

    /// Whether a loaded `value` may be cached, and with which expiry if not the
    /// entry's: a typed `None` only when negative caching was asked for, with its TTL.
    pub(crate) fn verdict(&self, value: &[u8]) -> (bool, Option<EntryOptions>) {
        if self.typed && value == b"null" {
            return match self.none_ttl {
                Some(ttl) => (true, Some(EntryOptions::new().relative(ttl))),
                None => (false, None),
            };
        }
        (self.accepts(value), None)
    }

    pub(crate) fn accepts(&self, value: &[u8]) -> bool {
        self.should_cache.as_ref().is_none_or(|p| p(value))
    }

    /// Refuses, naming the first one set, the options that let a load outlive its
    /// call (a soft timeout, eager refresh, background completion) and, when
    /// `with_hard_timeout`, a hard timeout: `why` says what the call needs instead.
    pub(crate) fn refuse_outliving(&self, with_hard_timeout: bool, why: &str) -> crate::Result<()> {
        let set = [
            (
                with_hard_timeout && self.hard_timeout_ms.is_some(),
                "hard_timeout",
            ),
            (self.soft_timeout_ms.is_some(), "soft_timeout"),
            (self.eager_refresh_permille.is_some(), "eager_refresh"),
            (self.background_completion, "background_completion"),
        ];
        match set.into_iter().find(|(set, _)| *set) {
            Some((_, name)) => Err(crate::Error::invalid_argument(name, why)),
            None => Ok(()),
        }
    }
}

/// A fraction in thousandths; anything not strictly between 0 and 1 becomes a value the
/// guest refuses (naming `eager_refresh`).
pub(crate) fn permille(fraction: f64) -> u32 {
    let permille = (fraction * 1000.0).round();
    if permille.is_finite() && permille > 0.0 {
        permille.min(f64::from(u32::MAX)) as u32
    } else {
        0
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
