//! The public shapes of the cache contract: entry options and metadata.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The prefix a cache's data is named under when none is given (`RedisOptions`,
/// `RedisLocks::connect`, the embedded default, the CLI's `--prefix`): the guest's
/// `names::DEFAULT_PREFIX`, which the test `the_default_prefix_is_the_guests` holds
/// this to.
pub const DEFAULT_PREFIX: &str = "corral:";

/// How an entry expires, chosen at set time.
///
/// Give at most one of [`absolute`](Self::absolute) and [`relative`](Self::relative),
/// optionally with [`sliding`](Self::sliding). With none of them, the entry gets the
/// cache's default sliding expiration (20 minutes unless configured). Durations count
/// in whole milliseconds, rounded up. The guest judges the options: bad ones are an
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryOptions {
    pub(crate) absolute_ms: Option<u64>,
    pub(crate) relative_ms: Option<u64>,
    pub(crate) sliding_ms: Option<u64>,
    pub(crate) max_stale_ms: Option<u64>,
}

pub(crate) fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

impl EntryOptions {
    /// Options naming no expiration: the cache's default sliding expiration applies.
    pub fn new() -> Self {
        Self::default()
    }

    /// Expire at `at`.
    pub fn absolute(self, at: SystemTime) -> Self {
        let ms = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.absolute_at_ms(ms)
    }

    /// Expire at `at_ms`, in Unix epoch milliseconds (the cache [`Clock`](crate::Clock)'s unit).
    pub fn absolute_at_ms(mut self, at_ms: u64) -> Self {
        self.absolute_ms = Some(at_ms);
        self
    }

    /// Expire `after` the set.
    pub fn relative(mut self, after: Duration) -> Self {
        self.relative_ms = Some(duration_ms(after));
        self
    }

    /// Expire `idle` after the last read or refresh (never past an absolute expiration).
    pub fn sliding(mut self, idle: Duration) -> Self {
        self.sliding_ms = Some(duration_ms(idle));
        self
    }

    /// Fail-safe: once expired, keep a stale copy for `max_stale` more, which a
    /// get-or-set serves when its reload fails, times out or cannot get the lock
    /// (contract §7.1). A plain [`get`](crate::Corral::get) never returns it;
    /// [`get_stale`](crate::Corral::get_stale) does. Must be positive.
    pub fn fail_safe(mut self, max_stale: Duration) -> Self {
        self.max_stale_ms = Some(duration_ms(max_stale));
        self
    }
}

/// The expiry metadata an entry carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EntryMeta {
    /// The absolute expiration, in Unix epoch milliseconds, if any.
    pub absolute_ms: Option<u64>,
    /// The sliding interval, in milliseconds, if any.
    pub sliding_ms: Option<u64>,
    /// When the entry expires (stops being fresh), in Unix epoch milliseconds.
    pub expires_at_ms: u64,
    /// How long past its expiry a stale copy is kept for fail-safe, in ms, if at all.
    pub stale_ms: Option<u64>,
}

/// An entry as stored, for inspection: its metadata and size, judged at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// The metadata as stored (before any touch).
    pub meta: EntryMeta,
    /// The value's length in bytes.
    pub value_len: usize,
    /// Whether the entry is fresh at the moment of inspection.
    pub fresh: bool,
    /// Whether it is past its expiry but within its fail-safe stale window.
    pub stale: bool,
    /// The stored bytes' length (header and value).
    pub stored_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_to_whole_milliseconds() {
        assert_eq!(duration_ms(Duration::ZERO), 0);
        assert_eq!(duration_ms(Duration::from_micros(1)), 1);
        assert_eq!(duration_ms(Duration::from_millis(1500)), 1500);
        assert_eq!(duration_ms(Duration::MAX), u64::MAX);
    }
}
