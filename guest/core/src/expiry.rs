//! Expiration (contract §3): planning at set time, checking on read.
//!
//! An entry is expired when `now_ms >= expires_at_ms`. Absolute wins over sliding: a
//! read or refresh moves a sliding entry's expiry to `now + sliding`, but never past its
//! absolute point and never backwards. An entry without a sliding expiration never moves.
//!
//! Fail-safe (contract §7.1): an entry set with a `max_stale` outlives its freshness.
//! From `expires_at_ms` it is stale: never returned as fresh, never slid, but kept until
//! `expires_at_ms + stale_ms` so that a get-or-set whose loader fails can serve it.

use crate::{Arg, ArgError, Limits};

/// How an entry expires, as the caller asks at set time. All times in milliseconds;
/// `absolute_ms` is a Unix epoch point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryOptions {
    /// Expire at this point in time.
    pub absolute_ms: Option<u64>,
    /// Expire this long after the set.
    pub relative_ms: Option<u64>,
    /// Expire this long after the last read or refresh.
    pub sliding_ms: Option<u64>,
    /// Fail-safe: keep a stale copy this long past the expiry, to serve when a reload
    /// fails (contract §7.1). `None`: gone at its expiry.
    pub max_stale_ms: Option<u64>,
}

/// The expiry metadata an entry carries with it in every tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryMeta {
    /// The absolute expiration, if any.
    pub absolute_ms: Option<u64>,
    /// The sliding interval, if any.
    pub sliding_ms: Option<u64>,
    /// When the entry expires (stops being fresh).
    pub expires_at_ms: u64,
    /// How long past `expires_at_ms` a stale copy is kept for fail-safe; `None`: not.
    pub stale_ms: Option<u64>,
}

impl EntryMeta {
    /// When the entry is gone for good: its expiry, plus its stale window if any.
    pub fn gone_at_ms(&self) -> u64 {
        self.expires_at_ms.saturating_add(self.stale_ms.unwrap_or(0))
    }
}

/// An entry checked at a moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// Still fresh, with the metadata after the read's sliding touch.
    Fresh {
        /// The metadata after the touch.
        meta: EntryMeta,
        /// Whether the touch moved the expiry.
        moved: bool,
    },
    /// Past its expiry but within its stale window: never returned as fresh, never
    /// slid; a get-or-set may serve it when its reload fails (fail-safe).
    Stale,
    /// Expired: never return it.
    Expired,
}

/// Plans the metadata of an entry set at `now_ms` with `options`.
///
/// # Errors
/// An [`ArgError`] naming the option at fault when absolute and relative are both
/// given, a duration is zero, the absolute point is not after `now_ms`, or the
/// arithmetic would overflow.
pub fn plan(options: &EntryOptions, now_ms: u64, limits: &Limits) -> Result<EntryMeta, ArgError> {
    let EntryOptions {
        absolute_ms,
        relative_ms,
        sliding_ms,
        max_stale_ms,
    } = *options;
    if max_stale_ms == Some(0) {
        return Err(ArgError::new(Arg::MaxStale, "must be a positive duration"));
    }
    if absolute_ms.is_some() && relative_ms.is_some() {
        return Err(ArgError::new(
            Arg::Relative,
            "may not be given together with an absolute expiration",
        ));
    }
    if relative_ms == Some(0) {
        return Err(ArgError::new(Arg::Relative, "must be a positive duration"));
    }
    if sliding_ms == Some(0) {
        return Err(ArgError::new(Arg::Sliding, "must be a positive duration"));
    }
    // Durations are bounded alike at every moment (so a verdict on options without an
    // absolute point never changes with the clock), then checked within reach.
    for (arg, d) in [
        (Arg::Relative, relative_ms),
        (Arg::Sliding, sliding_ms),
        (Arg::MaxStale, max_stale_ms),
    ] {
        if let Some(d) = d {
            crate::check_duration(arg, d, false)?;
        }
    }
    if let Some(at) = absolute_ms
        && at <= now_ms
    {
        return Err(ArgError::new(
            Arg::Absolute,
            format!("must lie in the future: {at} ms is not after now ({now_ms} ms)"),
        ));
    }
    let absolute_ms = match relative_ms {
        Some(rel) => Some(within_reach(now_ms.saturating_add(rel), Arg::Relative)?),
        None => absolute_ms
            .map(|at| within_reach(at, Arg::Absolute))
            .transpose()?,
    };
    let sliding_ms = match (absolute_ms, sliding_ms) {
        (None, None) => Some(limits.default_sliding_ms),
        (_, sliding) => sliding,
    };
    let slid_to = match sliding_ms {
        Some(s) => Some(within_reach(now_ms.saturating_add(s), Arg::Sliding)?),
        None => None,
    };
    let expires_at_ms = match (absolute_ms, slid_to) {
        (Some(a), Some(s)) => a.min(s),
        (Some(a), None) => a,
        (None, Some(s)) => s,
        (None, None) => unreachable!("a default sliding expiration is always set"),
    };
    // The stale window must end within reach too (a read slides no further than
    // that: see `check`).
    let latest = absolute_ms.unwrap_or(expires_at_ms).max(expires_at_ms);
    if let Some(stale) = max_stale_ms {
        within_reach(latest.saturating_add(stale), Arg::MaxStale)?;
    }
    Ok(EntryMeta {
        absolute_ms,
        sliding_ms,
        expires_at_ms,
        stale_ms: max_stale_ms,
    })
}

/// The latest expiry moment (Unix ms) an entry may have: 2^53 - 1, about the year
/// 287,000. Every store keeps it exactly (Lua's doubles hold integers up to 2^53, and
/// Redis takes it as a `PX`), so one rule holds on every backend: an expiry within it
/// works everywhere, one past it is an argument error everywhere (contract §3.4).
pub const LATEST_EXPIRY_MS: u64 = (1 << 53) - 1;

/// `at` if no later than [`LATEST_EXPIRY_MS`], else an argument error naming `arg`.
fn within_reach(at: u64, arg: Arg) -> Result<u64, ArgError> {
    if at > LATEST_EXPIRY_MS {
        return Err(ArgError::new(
            arg,
            format!(
                "puts the expiry past the latest a store keeps ({LATEST_EXPIRY_MS} ms after the Unix epoch)"
            ),
        ));
    }
    Ok(at)
}

/// Checks `meta` at `now_ms`, applying the sliding touch of a read or refresh.
#[inline]
pub fn check(meta: &EntryMeta, now_ms: u64) -> Freshness {
    if now_ms >= meta.gone_at_ms() {
        return Freshness::Expired;
    }
    if now_ms >= meta.expires_at_ms {
        return Freshness::Stale;
    }
    let Some(sliding) = meta.sliding_ms else {
        return Freshness::Fresh {
            meta: *meta,
            moved: false,
        };
    };
    let latest = LATEST_EXPIRY_MS.saturating_sub(meta.stale_ms.unwrap_or(0));
    let slid_to = now_ms.saturating_add(sliding).min(latest);
    let target = meta.absolute_ms.map_or(slid_to, |a| a.min(slid_to));
    if target > meta.expires_at_ms {
        let meta = EntryMeta {
            expires_at_ms: target,
            ..*meta
        };
        Freshness::Fresh { meta, moved: true }
    } else {
        Freshness::Fresh {
            meta: *meta,
            moved: false,
        }
    }
}

/// The grace a store TTL gets past the expiry moment, so that a store never drops an
/// entry before its metadata says so (clocks of host and store may differ slightly).
pub const STORE_TTL_GRACE_MS: u64 = 1_000;

/// The upper bound for a store's own TTL for an entry with `meta` at `now_ms`: until it
/// is gone (past its stale window, if it has one), plus the grace.
#[inline]
pub fn store_ttl_ms(meta: &EntryMeta, now_ms: u64) -> u64 {
    meta.gone_at_ms()
        .saturating_sub(now_ms)
        .saturating_add(STORE_TTL_GRACE_MS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: u64 = 1_700_000_000_000;
    const MIN: u64 = 60_000;

    #[test]
    fn an_expiry_past_the_latest_a_store_keeps_is_an_argument_error() {
        let l = Limits::default();
        let far = LATEST_EXPIRY_MS - NOW + 1;
        assert_eq!(
            plan(&opts(None, Some(far), None), NOW, &l).unwrap_err().arg,
            Arg::Relative
        );
        assert_eq!(
            plan(&opts(None, None, Some(far)), NOW, &l).unwrap_err().arg,
            Arg::Sliding
        );
        assert_eq!(
            plan(&opts(Some(LATEST_EXPIRY_MS + 1), None, None), NOW, &l)
                .unwrap_err()
                .arg,
            Arg::Absolute
        );
        assert_eq!(
            plan(&opts(None, Some(u64::MAX), None), NOW, &l).unwrap_err().arg,
            Arg::Relative
        );
        let latest = plan(&opts(Some(LATEST_EXPIRY_MS), None, None), NOW, &l).unwrap();
        assert_eq!(latest.expires_at_ms, LATEST_EXPIRY_MS);
    }

    fn opts(absolute_ms: Option<u64>, relative_ms: Option<u64>, sliding_ms: Option<u64>) -> EntryOptions {
        EntryOptions {
            absolute_ms,
            relative_ms,
            sliding_ms,
            max_stale_ms: None,
        }
    }

    fn plan_now(o: EntryOptions) -> Result<EntryMeta, ArgError> {
        plan(&o, NOW, &Limits::default())
    }

    fn fresh(f: Freshness) -> (EntryMeta, bool) {
        match f {
            Freshness::Fresh { meta, moved } => (meta, moved),
            Freshness::Stale | Freshness::Expired => panic!("expected fresh"),
        }
    }

    #[test]
    fn no_options_get_the_default_sliding_expiration() {
        let meta = plan_now(EntryOptions::default()).unwrap();
        assert_eq!(meta.absolute_ms, None);
        assert_eq!(meta.sliding_ms, Some(20 * MIN));
        assert_eq!(meta.expires_at_ms, NOW + 20 * MIN);
    }

    #[test]
    fn the_default_sliding_comes_from_the_limits() {
        let limits = Limits {
            default_sliding_ms: 5 * MIN,
            ..Limits::default()
        };
        let meta = plan(&EntryOptions::default(), NOW, &limits).unwrap();
        assert_eq!(meta.sliding_ms, Some(5 * MIN));
    }

    #[test]
    fn an_absolute_point_alone_gets_no_sliding() {
        let meta = plan_now(opts(Some(NOW + MIN), None, None)).unwrap();
        assert_eq!(
            meta,
            EntryMeta {
                absolute_ms: Some(NOW + MIN),
                sliding_ms: None,
                expires_at_ms: NOW + MIN,
                stale_ms: None,
            }
        );
    }

    #[test]
    fn relative_becomes_an_absolute_point() {
        let meta = plan_now(opts(None, Some(MIN), None)).unwrap();
        assert_eq!(
            meta,
            EntryMeta {
                absolute_ms: Some(NOW + MIN),
                sliding_ms: None,
                expires_at_ms: NOW + MIN,
                stale_ms: None,
            }
        );
    }

    #[test]
    fn sliding_alone_expires_one_interval_from_now() {
        let meta = plan_now(opts(None, None, Some(MIN))).unwrap();
        assert_eq!(meta.expires_at_ms, NOW + MIN);
        assert_eq!(meta.absolute_ms, None);
    }

    #[test]
    fn sliding_with_a_nearer_absolute_starts_at_the_absolute() {
        let meta = plan_now(opts(None, Some(30_000), Some(MIN))).unwrap();
        assert_eq!(meta.expires_at_ms, NOW + 30_000);
    }

    #[test]
    fn absolute_and_relative_together_are_rejected() {
        let err = plan_now(opts(Some(NOW + MIN), Some(MIN), None)).unwrap_err();
        assert_eq!(err.arg, Arg::Relative);
        assert!(err.reason.contains("absolute"), "{err}");
    }

    #[test]
    fn zero_durations_are_rejected_naming_the_option() {
        assert_eq!(
            plan_now(opts(None, Some(0), None)).unwrap_err().arg,
            Arg::Relative
        );
        assert_eq!(plan_now(opts(None, None, Some(0))).unwrap_err().arg, Arg::Sliding);
    }

    #[test]
    fn an_absolute_point_must_lie_in_the_future() {
        for at in [0, NOW - 1, NOW] {
            let err = plan_now(opts(Some(at), None, None)).unwrap_err();
            assert_eq!(err.arg, Arg::Absolute);
            assert!(err.reason.contains("future"), "{err}");
        }
        assert!(plan_now(opts(Some(NOW + 1), None, None)).is_ok());
    }

    #[test]
    fn overflowing_durations_are_argument_errors() {
        assert_eq!(
            plan_now(opts(None, Some(u64::MAX), None)).unwrap_err().arg,
            Arg::Relative
        );
        assert_eq!(
            plan_now(opts(None, None, Some(u64::MAX))).unwrap_err().arg,
            Arg::Sliding
        );
        let saturated = plan_now(opts(None, Some(u64::MAX), None)).unwrap_err();
        assert!(
            saturated
                .reason
                .ends_with(&format!("not {} ms or more", u64::MAX)),
            "a count a host saturated is no exact figure: {}",
            saturated.reason
        );
        let over = plan_now(opts(None, Some(crate::LONGEST_DURATION_MS + 1), None)).unwrap_err();
        assert!(over.reason.ends_with(" ms"), "{}", over.reason);
    }

    #[test]
    fn an_entry_is_expired_at_its_expiry_moment() {
        let meta = plan_now(opts(None, Some(MIN), None)).unwrap();
        assert!(matches!(check(&meta, NOW + MIN - 1), Freshness::Fresh { .. }));
        assert_eq!(check(&meta, NOW + MIN), Freshness::Expired);
        assert_eq!(check(&meta, u64::MAX), Freshness::Expired);
    }

    #[test]
    fn a_read_moves_a_sliding_entry() {
        let meta = plan_now(opts(None, None, Some(MIN))).unwrap();
        let (touched, moved) = fresh(check(&meta, NOW + 40_000));
        assert!(moved);
        assert_eq!(touched.expires_at_ms, NOW + 40_000 + MIN);
        // Reading again later keeps it alive past the first expiry moment.
        let (again, _) = fresh(check(&touched, NOW + 90_000));
        assert_eq!(again.expires_at_ms, NOW + 90_000 + MIN);
    }

    #[test]
    fn a_sliding_entry_not_read_in_time_expires() {
        let meta = plan_now(opts(None, None, Some(MIN))).unwrap();
        assert_eq!(check(&meta, NOW + MIN), Freshness::Expired);
    }

    #[test]
    fn absolute_caps_sliding() {
        let meta = plan_now(opts(None, Some(90_000), Some(MIN))).unwrap();
        let (touched, moved) = fresh(check(&meta, NOW + 50_000));
        assert!(moved);
        assert_eq!(
            touched.expires_at_ms,
            NOW + 90_000,
            "capped at the absolute point"
        );
        assert_eq!(check(&touched, NOW + 90_000), Freshness::Expired);
    }

    #[test]
    fn a_read_never_moves_a_non_sliding_entry() {
        let meta = plan_now(opts(None, Some(MIN), None)).unwrap();
        assert_eq!(fresh(check(&meta, NOW + 59_000)), (meta, false));
    }

    #[test]
    fn a_read_never_moves_the_expiry_backwards() {
        let meta = EntryMeta {
            absolute_ms: None,
            sliding_ms: Some(MIN),
            expires_at_ms: NOW + 10 * MIN,
            stale_ms: None,
        };
        assert_eq!(fresh(check(&meta, NOW)), (meta, false));
    }

    #[test]
    fn store_ttl_is_an_upper_bound_with_grace() {
        let meta = plan_now(opts(None, Some(MIN), None)).unwrap();
        assert_eq!(store_ttl_ms(&meta, NOW), MIN + STORE_TTL_GRACE_MS);
        assert_eq!(store_ttl_ms(&meta, NOW + 2 * MIN), STORE_TTL_GRACE_MS);
    }

    #[test]
    fn an_entry_with_a_stale_window_is_stale_then_gone_and_never_slides_back() {
        let o = EntryOptions {
            max_stale_ms: Some(5 * MIN),
            ..opts(None, None, Some(MIN))
        };
        let meta = plan_now(o).unwrap();
        assert_eq!((meta.expires_at_ms, meta.stale_ms), (NOW + MIN, Some(5 * MIN)));
        assert!(matches!(check(&meta, NOW + MIN - 1), Freshness::Fresh { .. }));
        // Past its expiry: stale, and a read does not slide it back to fresh.
        assert_eq!(check(&meta, NOW + MIN), Freshness::Stale);
        assert_eq!(check(&meta, NOW + 6 * MIN - 1), Freshness::Stale);
        assert_eq!(check(&meta, NOW + 6 * MIN), Freshness::Expired);
        // The store keeps it until the window ends.
        assert_eq!(store_ttl_ms(&meta, NOW), 6 * MIN + STORE_TTL_GRACE_MS);
    }

    #[test]
    fn a_stale_window_must_be_positive_and_end_within_reach() {
        let l = Limits::default();
        let zero = EntryOptions {
            max_stale_ms: Some(0),
            ..opts(None, Some(MIN), None)
        };
        assert_eq!(plan(&zero, NOW, &l).unwrap_err().arg, Arg::MaxStale);
        let far = EntryOptions {
            max_stale_ms: Some(LATEST_EXPIRY_MS),
            ..opts(None, Some(MIN), None)
        };
        assert_eq!(plan(&far, NOW, &l).unwrap_err().arg, Arg::MaxStale);
    }

    fn any_options() -> impl Strategy<Value = EntryOptions> {
        let dur = prop_oneof![Just(None), (1u64..=10_000_000).prop_map(Some)];
        let abs = prop_oneof![Just(None), (1u64..=10_000_000).prop_map(|d| Some(NOW + d))];
        (abs, dur.clone(), dur).prop_map(|(a, r, s)| {
            // Keep only valid combinations here; the invalid ones have their own tests.
            let r = if a.is_some() { None } else { r };
            opts(a, r, s)
        })
    }

    proptest! {
        #[test]
        fn planned_entries_are_fresh_now_and_expire_by_their_absolute(o in any_options()) {
            let meta = plan_now(o).unwrap();
            prop_assert!(meta.expires_at_ms > NOW);
            if let Some(a) = meta.absolute_ms {
                prop_assert!(meta.expires_at_ms <= a);
            }
            prop_assert!(meta.absolute_ms.is_some() || meta.sliding_ms.is_some());
            let is_fresh = matches!(check(&meta, NOW), Freshness::Fresh { .. });
            prop_assert!(is_fresh);
        }

        #[test]
        fn reads_never_extend_past_absolute_nor_move_backwards(
            o in any_options(),
            steps in proptest::collection::vec(0u64..200_000, 1..20),
        ) {
            let mut meta = plan_now(o).unwrap();
            let mut now = NOW;
            for step in steps {
                now += step;
                match check(&meta, now) {
                    Freshness::Stale | Freshness::Expired => {
                        prop_assert!(now >= meta.expires_at_ms);
                        break;
                    }
                    Freshness::Fresh { meta: touched, moved } => {
                        prop_assert!(touched.expires_at_ms >= meta.expires_at_ms);
                        prop_assert_eq!(moved, touched.expires_at_ms != meta.expires_at_ms);
                        if let Some(a) = touched.absolute_ms {
                            prop_assert!(touched.expires_at_ms <= a);
                        }
                        if touched.sliding_ms.is_none() {
                            prop_assert!(!moved);
                        }
                        prop_assert_eq!(touched.absolute_ms, meta.absolute_ms);
                        prop_assert_eq!(touched.sliding_ms, meta.sliding_ms);
                        meta = touched;
                    }
                }
            }
        }
    }
}
