//! Corral's brain: every decision of the cache and lock contract, as pure functions
//! and state machines.
//!
//! Nothing here performs I/O or reads a clock. Time comes in as `now_ms` (Unix epoch
//! milliseconds), in the style of quinn-proto: the same inputs always give the same
//! answer, so every rule is unit-testable natively and the same code runs inside the
//! WebAssembly component (`corral-guest`) that every host drives.
//!
//! - [`key`]: what a key may be.
//! - [`expiry`]: planning an entry's expiry at set time, checking it on read.
//! - [`envelope`]: the bytes a store holds: a versioned header carrying the expiry
//!   metadata, then the value.
//! - [`flight`]: the single-flight state machine of a tiered get-or-set.
//! - [`lock`]: the lock protocols: lock table, retries, Redlock, watchdog, fencing.
//! - [`names`]: where a key's data lives in a shared store (unambiguous, cluster-ready).
//! - [`policy`]: the above composed into one decision per store operation.
//! - [`tags`]: tag invalidations and clear (generations), without scans.
//! - [`generation`]: what a process knows of its prefix's generation, under late,
//!   lost and overlapping news.
//! - [`script`]: the server-side Lua a Redis store runs to read and touch atomically;
//!   it mirrors [`expiry::check`] and lives here so the rule has one home.

#![deny(missing_docs)]

pub mod batch;
pub mod envelope;
mod error;
pub mod expiry;
pub mod flight;
pub mod generation;
pub mod key;
pub mod kv;
pub mod lock;
pub mod names;
pub mod policy;
pub mod script;
pub mod tags;

pub use error::{Arg, ArgError, Corruption};
pub use expiry::{EntryMeta, EntryOptions, Freshness};

/// The longest duration a setting or a lock's TTL may name: 100 years (of 365 days).
/// Far past anything a cache or a lock needs, and within the range of every store and
/// timer Corral uses (Redis's `PX`, moka's TTL, Tokio's timers), so a setting that
/// builds always works; `Duration::MAX` and its kin are argument errors, not panics.
pub const LONGEST_DURATION_MS: u64 = 100 * 365 * 24 * 60 * 60 * 1000;

/// Checks a duration named `arg`: at most [`LONGEST_DURATION_MS`], and positive unless
/// `zero_ok`.
///
/// # Errors
/// An [`ArgError`] naming `arg`.
pub fn check_duration(arg: Arg, ms: u64, zero_ok: bool) -> Result<(), ArgError> {
    if ms == 0 && !zero_ok {
        return Err(ArgError::new(arg, "must be a positive duration"));
    }
    if ms > LONGEST_DURATION_MS {
        // A host counts a longer duration than a u64 of ms holds as the largest one.
        let or_more = if ms == u64::MAX { " or more" } else { "" };
        return Err(ArgError::new(
            arg,
            format!("must be at most 100 years of 365 days ({LONGEST_DURATION_MS} ms), not {ms} ms{or_more}"),
        ));
    }
    Ok(())
}

/// The limits and defaults of one cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The longest key, in UTF-8 bytes.
    pub max_key_bytes: u32,
    /// The largest value, in bytes.
    pub max_value_bytes: u32,
    /// The sliding expiration an entry gets when its options name no expiration.
    pub default_sliding_ms: u64,
    /// Whether the store's own TTLs run on this cache's clock (Redis on the system clock,
    /// the memory store on any), so that a sliding entry's expiry moment may live in the
    /// store's TTL and a read slides it in one command (`GETEX`, contract §3.1). When
    /// false (a manual clock over Redis), the moment lives in the envelope. Readers
    /// follow what each entry says, whatever this is.
    pub sliding_in_store: bool,
}

impl Limits {
    /// 20 minutes, as SqlServerCache.
    pub const DEFAULT_SLIDING_MS: u64 = 20 * 60 * 1000;
    /// 1 KiB of key: far more than any sensible key, far less than Redis's 512 MB.
    pub const DEFAULT_MAX_KEY_BYTES: u32 = 1024;
    /// 16 MiB of value.
    pub const DEFAULT_MAX_VALUE_BYTES: u32 = 16 * 1024 * 1024;

    /// Checks that the limits are usable.
    ///
    /// # Errors
    /// An [`ArgError`] naming `limits` when a size or the default sliding is zero, or a
    /// value limit leaves no room for the envelope header.
    pub fn check(&self) -> Result<(), ArgError> {
        let bad = |reason: &str| Err(ArgError::new(Arg::Limits, reason));
        if self.max_key_bytes == 0 {
            return bad("max key bytes must be positive");
        }
        if self.max_value_bytes == 0 {
            return bad("max value bytes must be positive");
        }
        if self.max_value_bytes > u32::MAX - envelope::MAX_HEADER_LEN as u32 {
            return bad("max value bytes leaves no room for the envelope header");
        }
        if self.default_sliding_ms == 0 {
            return bad("default sliding expiration must be positive");
        }
        check_duration(Arg::Setting("default_sliding"), self.default_sliding_ms, false)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Settings::DEFAULT.limits
    }
}

/// How one cache runs: its limits and the timings of its get-or-set. The one place
/// the defaults are written (contract §5.9): every body, builder and the CLI read them
/// from here, through the guest's `policy.defaults` export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Key and value limits, and the default sliding expiration.
    pub limits: Limits,
    /// The longest L1 serves an entry without asking L2 (default 5 minutes).
    pub l1_ttl_ms: u64,
    /// How long a get-or-set waits for the distributed lock or the holder's value
    /// before degrading to an uncached load (default 5 s).
    pub lock_wait_ms: u64,
    /// The get-or-set lock's TTL, the longest a crashed loader blocks others (default 30 s).
    pub lock_ttl_ms: u64,
    /// How often a store that does not expire entries by itself sweeps them (default 30 s).
    pub invalidation_interval_ms: u64,
    /// How long a degraded get-or-set's value (loaded without the lock, not written to
    /// L2) is served from this process's L1 (default 1 s; 0: not at all), so an outage
    /// does not send every caller to the loader (contract §5.8).
    pub degraded_l1_ttl_ms: u64,
    /// Fail-safe: how long a stale copy served in place of a failed reload is served
    /// from L1 before the loader is tried again (default 10 s; contract §7.1).
    pub fail_safe_throttle_ms: u64,
    /// The hard loader timeout of a get-or-set (default none; contract §7.2).
    pub hard_timeout_ms: Option<u64>,
    /// The soft loader timeout of a get-or-set whose load may outlive its caller
    /// (default none; contract §7.2).
    pub soft_timeout_ms: Option<u64>,
    /// Eager refresh, in thousandths of an entry's relative freshness (default none;
    /// contract §7.3).
    pub eager_refresh_permille: Option<u32>,
    /// How many entries L1 holds at most (default 100,000; 0 turns L1 off).
    pub l1_capacity: u64,
    /// How many times a compare-and-set on a small shared key (a tag's moments, the
    /// generation) reads and writes again when another writer came first (default 32).
    pub cas_tries: u32,
    /// Work a body retries in the background (an announcement, a removal, a
    /// subscription): the first wait, doubled after each try up to `retry_max_ms`
    /// (default 50 ms doubling to 2 s).
    pub retry_first_ms: u64,
    /// The longest wait between two background tries (default 2 s).
    pub retry_max_ms: u64,
    /// The longest one store step (a read, a write, a lock) may take, in real time,
    /// before it counts as failed (default 1 s; a Redis connection's response timeout
    /// takes its place). A get-or-set's steps share deadlines built from it
    /// ([`Settings::store_budget`], contract §5.13).
    pub store_timeout_ms: u64,
}

impl Settings {
    /// The defaults.
    pub const DEFAULT: Settings = Settings {
        limits: Limits {
            max_key_bytes: Limits::DEFAULT_MAX_KEY_BYTES,
            max_value_bytes: Limits::DEFAULT_MAX_VALUE_BYTES,
            default_sliding_ms: Limits::DEFAULT_SLIDING_MS,
            sliding_in_store: false,
        },
        l1_ttl_ms: 5 * 60_000,
        lock_wait_ms: 5_000,
        lock_ttl_ms: 30_000,
        invalidation_interval_ms: 30_000,
        degraded_l1_ttl_ms: 1_000,
        fail_safe_throttle_ms: 10_000,
        hard_timeout_ms: None,
        soft_timeout_ms: None,
        eager_refresh_permille: None,
        l1_capacity: 100_000,
        cas_tries: 32,
        retry_first_ms: 50,
        retry_max_ms: 2_000,
        store_timeout_ms: 1_000,
    };

    /// Checks the settings: the limits (as [`Limits::check`]), every duration (at most
    /// [`LONGEST_DURATION_MS`]; positive, but for the ones where zero means "off"), and
    /// the eager refresh fraction, which must lie strictly between 0 and 1000
    /// thousandths.
    ///
    /// # Errors
    /// An [`ArgError`] naming `limits`, the setting at fault (as the builder names it:
    /// `l1_ttl`, `lock_ttl`, ...) or `eager_refresh`.
    pub fn check(&self) -> Result<(), ArgError> {
        self.limits.check()?;
        let durations = [
            ("l1_ttl", Some(self.l1_ttl_ms), false),
            ("lock_wait", Some(self.lock_wait_ms), true),
            ("lock_ttl", Some(self.lock_ttl_ms), false),
            (
                "invalidation_interval",
                Some(self.invalidation_interval_ms),
                false,
            ),
            ("degraded_l1_ttl", Some(self.degraded_l1_ttl_ms), true),
            ("fail_safe_throttle", Some(self.fail_safe_throttle_ms), true),
            ("hard_timeout", self.hard_timeout_ms, false),
            ("soft_timeout", self.soft_timeout_ms, false),
            ("store_timeout", Some(self.store_timeout_ms), false),
        ];
        for (name, ms, zero_ok) in durations {
            if let Some(ms) = ms {
                check_duration(Arg::Setting(name), ms, zero_ok)?;
            }
        }
        if self.cas_tries == 0 {
            return Err(ArgError::new(Arg::Setting("cas_tries"), "must be at least 1"));
        }
        check_duration(Arg::Setting("retry_first"), self.retry_first_ms, false)?;
        check_duration(Arg::Setting("retry_max"), self.retry_max_ms, false)?;
        if self.retry_max_ms < self.retry_first_ms {
            return Err(ArgError::new(
                Arg::Setting("retry_max"),
                "must be at least the first retry's wait",
            ));
        }
        if let Some(p) = self.eager_refresh_permille {
            flight::check_eager_refresh(p)?;
        }
        Ok(())
    }

    /// The flight configuration these settings give a get-or-set.
    pub fn flight(&self, bypass: bool) -> flight::FlightConfig {
        flight::FlightConfig {
            lock_wait_ms: self.lock_wait_ms,
            lock_ttl_ms: self.lock_ttl_ms,
            l1_ttl_ms: self.l1_ttl_ms,
            degraded_l1_ttl_ms: self.degraded_l1_ttl_ms,
            fail_safe_throttle_ms: self.fail_safe_throttle_ms,
            hard_timeout_ms: self.hard_timeout_ms,
            soft_timeout_ms: self.soft_timeout_ms,
            eager_refresh_permille: self.eager_refresh_permille,
            background_completion: false,
            refresh: false,
            bypass,
            starts_refresh: true,
        }
    }
}

impl Settings {
    /// How long a get-or-set's store steps may take, in real time (contract §5.13).
    pub fn store_budget(&self) -> flight::StoreBudget {
        flight::StoreBudget::new(self.lock_wait_ms, self.store_timeout_ms)
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_limits_are_usable() {
        assert_eq!(Limits::default().check(), Ok(()));
    }

    #[test]
    fn every_duration_setting_is_bounded_and_named() {
        let max = LONGEST_DURATION_MS;
        type Setter = fn(&mut Settings, u64);
        let cases: [(&str, Setter); 9] = [
            ("store_timeout", |s, v| s.store_timeout_ms = v),
            ("l1_ttl", |s, v| s.l1_ttl_ms = v),
            ("lock_wait", |s, v| s.lock_wait_ms = v),
            ("lock_ttl", |s, v| s.lock_ttl_ms = v),
            ("invalidation_interval", |s, v| s.invalidation_interval_ms = v),
            ("degraded_l1_ttl", |s, v| s.degraded_l1_ttl_ms = v),
            ("fail_safe_throttle", |s, v| s.fail_safe_throttle_ms = v),
            ("hard_timeout", |s, v| s.hard_timeout_ms = Some(v)),
            ("soft_timeout", |s, v| s.soft_timeout_ms = Some(v)),
        ];
        for (name, set) in cases {
            for (ms, ok) in [(max, true), (max + 1, false), (u64::MAX, false)] {
                let mut s = Settings::DEFAULT;
                set(&mut s, ms);
                match s.check() {
                    Ok(()) => assert!(ok, "{name} = {ms} accepted"),
                    Err(e) => {
                        assert!(!ok, "{name} = {ms} refused: {e}");
                        assert_eq!(e.arg.name(), name);
                    }
                }
            }
        }
        let mut s = Settings::DEFAULT;
        s.limits.default_sliding_ms = u64::MAX;
        assert_eq!(s.check().unwrap_err().arg.name(), "default_sliding");
        s = Settings::DEFAULT;
        s.l1_ttl_ms = 0;
        assert_eq!(s.check().unwrap_err().arg.name(), "l1_ttl");
        s = Settings::DEFAULT;
        s.degraded_l1_ttl_ms = 0;
        assert_eq!(s.check(), Ok(()), "zero: no degraded L1 fill");
    }

    #[test]
    fn zero_limits_are_rejected_naming_limits() {
        for limits in [
            Limits {
                max_key_bytes: 0,
                ..Limits::default()
            },
            Limits {
                max_value_bytes: 0,
                ..Limits::default()
            },
            Limits {
                default_sliding_ms: 0,
                ..Limits::default()
            },
            Limits {
                max_value_bytes: u32::MAX,
                ..Limits::default()
            },
        ] {
            let err = limits.check().unwrap_err();
            assert_eq!(err.arg, Arg::Limits, "{limits:?}");
        }
    }
}
