//! The lock protocols (contract §6): the in-memory lock table's transitions, the
//! retry schedule, Redlock's quorum and validity arithmetic, the watchdog's timing, and
//! fencing. Pure, like the rest of this crate; the host performs the I/O.

use crate::{Arg, ArgError, Limits, key};

/// A held lock as a lock table stores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// Who holds it (empty in a [released](release) record).
    pub owner: String,
    /// When it expires (Unix ms): expired when `now_ms >= expires_at_ms`.
    pub expires_at_ms: u64,
    /// The fencing token of the acquire that stored it: each acquire of a key takes the
    /// token of the record it replaces plus one, so the tokens of a key rise with every
    /// acquire as long as its table keeps its record (a release leaves a free record
    /// behind for that, and a table that forgets records keeps their highest token as
    /// a floor under the key's next one). A compare-and-swap compares the token too:
    /// a swap that read a record before a later acquire and release can never land.
    pub token: u64,
}

/// Checks a lock request: the key follows the cache's key rules; the TTL is positive
/// (a lock always expires), longer than its clock-drift allowance (a shorter lease
/// could never be valid: see [`decide`]) and at most [`crate::LONGEST_DURATION_MS`].
///
/// # Errors
/// An [`ArgError`] naming `key` or `ttl`.
pub fn check_request(key: &str, ttl_ms: u64, limits: &Limits) -> Result<(), ArgError> {
    key::validate(key, limits)?;
    if ttl_ms == 0 {
        return Err(ArgError::new(
            Arg::Ttl,
            "must be a positive duration: a lock always expires",
        ));
    }
    if ttl_ms <= drift_ms(ttl_ms) {
        return Err(ArgError::new(
            Arg::Ttl,
            format!(
                "must be longer than the clock-drift allowance ({} ms for {ttl_ms} ms): \
                 such a lease would never be valid",
                drift_ms(ttl_ms)
            ),
        ));
    }
    crate::check_duration(Arg::Ttl, ttl_ms, false)
}

/// Whether `current` is expired (or absent) at `now_ms`.
pub fn is_expired(current: Option<&Held>, now_ms: u64) -> bool {
    current.is_none_or(|h| now_ms >= h.expires_at_ms)
}

/// Whether `owner` holds `current` at `now_ms`.
pub fn is_locked_by(current: Option<&Held>, owner: &str, now_ms: u64) -> bool {
    current.is_some_and(|h| h.owner == owner && now_ms < h.expires_at_ms)
}

/// A try-lock: the new entry to store if the lock is free (absent, released or
/// expired), else `None`. Not re-entrant: a holder trying again while its lock lives
/// gets `None`. Its token is the current record's plus one (1 for a key without one);
/// a key whose token reached `u64::MAX` is never taken again, rather than hand out a
/// token twice.
pub fn try_lock(current: Option<&Held>, owner: &str, ttl_ms: u64, now_ms: u64) -> Option<Held> {
    if !is_expired(current, now_ms) {
        return None;
    }
    let token = current.map_or(0, |h| h.token).checked_add(1)?;
    Some(Held {
        owner: owner.to_owned(),
        expires_at_ms: now_ms.saturating_add(ttl_ms),
        token,
    })
}

/// An unlock: the free record to store in place of `current` if `owner` holds it at
/// `now_ms`, else `None`. The record has no owner, is expired at every moment, and
/// keeps the token, so the next acquire's is higher.
pub fn release(current: Option<&Held>, owner: &str, now_ms: u64) -> Option<Held> {
    let held = current.filter(|_| is_locked_by(current, owner, now_ms))?;
    Some(Held {
        owner: String::new(),
        expires_at_ms: 0,
        token: held.token,
    })
}

/// Whether a sweep may remove `entry`: only once it is expired. The remover MUST
/// remove it only if the table still holds this very entry (a renewal or takeover in
/// between replaces it, and the replacement stays).
pub fn sweepable(entry: &Held, now_ms: u64) -> bool {
    now_ms >= entry.expires_at_ms
}

/// How often an in-memory lock table sweeps its expired entries (ms): no expired entry
/// outlives one interval.
pub const SWEEP_INTERVAL_MS: u64 = 1_000;

/// When to try again after attempt `attempt` (0-based) failed at `now_ms`: the backoff
/// schedule (50 ms doubling to 1 s), never past `deadline_ms`; `None` once the deadline
/// has passed (give up). Any one millisecond timeline serves; the host's lease code
/// uses a monotonic one.
pub fn next_try(attempt: u32, now_ms: u64, deadline_ms: u64) -> Option<u64> {
    (now_ms < deadline_ms).then(|| {
        now_ms
            .saturating_add(crate::flight::backoff_ms(attempt))
            .min(deadline_ms)
    })
}

/// The clock-drift allowance of a lease of `ttl_ms`: 1% of the TTL plus 2 ms.
pub fn drift_ms(ttl_ms: u64) -> u64 {
    ttl_ms / 100 + 2
}

/// The id a fair acquire waits under in a lock's queue (contract §6): the moment it
/// started waiting (`started_us`, µs on the wall clock, as 16 digits), then its `token`.
/// A queue keeps its waiters in the order of their ids, so the servers of a Redlock,
/// each with its own queue, agree on who is ahead (in the order of arrival, each a
/// waiter would head one server's queue and none win a majority), and a waiter that a
/// server missed is put back in its place there at its next try.
pub fn fair_waiter(started_us: u64, token: &str) -> String {
    format!("{started_us:016}-{token}")
}

/// The majority of `servers`.
pub fn quorum(servers: u32) -> u32 {
    servers / 2 + 1
}

/// Whether `count` of `servers` is a majority (an owner-checked release or extend
/// succeeded, or enough servers answered to judge).
pub fn has_quorum(count: u32, servers: u32) -> bool {
    servers > 0 && count >= quorum(servers)
}

/// Redlock's decision: with `acquired` of `servers` locked after `elapsed_ms` of a
/// `ttl_ms` lease, the lock is held for the returned validity (ms) only with a majority
/// and a positive `ttl - elapsed - drift`. `None`: not held; release everywhere.
///
/// The validity runs from the end of the round (the last reply): `elapsed` is already
/// taken off, so it is added to that moment, never to the moment the round was sent.
/// The same holds for an extend.
pub fn decide(acquired: u32, servers: u32, ttl_ms: u64, elapsed_ms: u64) -> Option<u64> {
    if servers == 0 || acquired < quorum(servers) {
        return None;
    }
    let validity = ttl_ms.saturating_sub(elapsed_ms).saturating_sub(drift_ms(ttl_ms));
    (validity > 0).then_some(validity)
}

/// How long after sending an acquire whose outcome is unknown (a server did not answer,
/// or the caller gave up mid-flight) the host keeps trying to release it, owner-checked:
/// the TTL. Past it the lock has lapsed on every server that ran the acquire on time;
/// a server that ran it later still holds it for at most one TTL.
pub fn orphan_window_ms(ttl_ms: u64) -> u64 {
    ttl_ms
}

/// How long after a (re)confirmation a watchdog renews a lease of `ttl_ms`: TTL/3.
pub fn renew_after_ms(ttl_ms: u64) -> u64 {
    (ttl_ms / 3).max(1)
}

/// The fencing token of a lease acquired on several servers: the largest per-server
/// counter value. Each counter is first raised to its server's clock in microseconds
/// ([`crate::script::LOCK_ACQUIRE`]), so counters track time rather than acquire counts:
/// a lost counter, or one that drifted behind, restarts above every earlier token. Any
/// two majorities share a server, and every release raises each server's counter to
/// the token it carried, so a later holder's token is larger whenever the earlier
/// holder released (see docs/locks.md on fencing under Redlock).
pub fn fencing_token(per_server: &[u64]) -> u64 {
    per_server.iter().copied().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;

    #[test]
    fn fair_waiters_sort_as_they_started_waiting() {
        let (early, late) = (fair_waiter(999_999, "ff"), fair_waiter(1_000_000, "00"));
        assert_eq!(early, "0000000000999999-ff");
        assert!(early < late, "the earlier start first, whatever the tokens");
        let now_us = 1_795_555_370_387_128;
        assert_eq!(
            fair_waiter(now_us, "t").len(),
            18,
            "16 digits for the coming centuries"
        );
    }

    fn held(owner: &str, expires_at_ms: u64) -> Held {
        Held {
            owner: owner.into(),
            expires_at_ms,
            token: 1,
        }
    }

    #[test]
    fn a_request_needs_a_good_key_and_a_positive_ttl() {
        let l = Limits::default();
        assert_eq!(check_request(" ", 10, &l).unwrap_err().arg, Arg::Key);
        assert_eq!(check_request("k", 0, &l).unwrap_err().arg, Arg::Ttl);
        assert_eq!(check_request("k", 2, &l).unwrap_err().arg, Arg::Ttl, "<= drift");
        assert!(check_request("k", 3, &l).is_ok());
        let longest = crate::LONGEST_DURATION_MS;
        assert!(check_request("k", longest, &l).is_ok());
        assert_eq!(check_request("k", longest + 1, &l).unwrap_err().arg, Arg::Ttl);
        assert_eq!(check_request("k", u64::MAX, &l).unwrap_err().arg, Arg::Ttl);
    }

    #[test]
    fn a_free_lock_is_taken_a_live_one_is_not_an_expired_one_is_taken_over() {
        assert_eq!(try_lock(None, "a", 100, NOW), Some(held("a", NOW + 100)));
        let a = held("a", NOW + 100);
        assert_eq!(try_lock(Some(&a), "b", 100, NOW + 99), None);
        assert_eq!(try_lock(Some(&a), "a", 100, NOW + 99), None, "not re-entrant");
        assert_eq!(
            try_lock(Some(&a), "b", 100, NOW + 100),
            Some(Held {
                token: 2,
                ..held("b", NOW + 200)
            })
        );
    }

    #[test]
    fn every_acquire_takes_a_token_above_the_record_it_replaces() {
        let a = try_lock(None, "a", 100, NOW).unwrap();
        assert_eq!(a.token, 1, "a key's first");
        let free = release(Some(&a), "a", NOW + 1).unwrap();
        assert_eq!(
            free,
            Held {
                owner: String::new(),
                expires_at_ms: 0,
                token: 1
            },
            "a release keeps the token"
        );
        assert!(is_expired(Some(&free), 0), "and frees the lock at once");
        assert!(!is_locked_by(Some(&free), "", 0));
        let b = try_lock(Some(&free), "b", 100, NOW + 1).unwrap();
        assert_eq!(b.token, 2);
        let c = try_lock(Some(&b), "c", 100, NOW + 101).unwrap();
        assert_eq!(c.token, 3, "a takeover too");
        let last = Held {
            token: u64::MAX,
            ..free
        };
        assert_eq!(
            try_lock(Some(&last), "d", 100, NOW),
            None,
            "a token is never handed out twice"
        );
    }

    #[test]
    fn only_the_live_holder_releases() {
        let a = held("a", NOW + 100);
        assert_eq!(release(Some(&a), "b", NOW), None, "another owner");
        assert_eq!(release(Some(&a), "a", NOW + 100), None, "lapsed");
        assert_eq!(release(None, "a", NOW), None, "nothing held");
        assert_eq!(release(Some(&a), "a", NOW + 99).map(|f| f.token), Some(1));
    }

    #[test]
    fn ownership_and_expiry_are_judged_at_now() {
        let a = held("a", NOW + 100);
        assert!(is_locked_by(Some(&a), "a", NOW));
        assert!(!is_locked_by(Some(&a), "b", NOW));
        assert!(!is_locked_by(Some(&a), "a", NOW + 100));
        assert!(!is_expired(Some(&a), NOW + 99));
        assert!(is_expired(Some(&a), NOW + 100));
        assert!(is_expired(None, NOW), "no lock is as good as an expired one");
    }

    #[test]
    fn only_expired_entries_are_sweepable() {
        assert!(!sweepable(&held("a", NOW + 1), NOW));
        assert!(sweepable(&held("a", NOW), NOW));
    }

    #[test]
    fn retries_follow_the_backoff_and_stop_at_the_deadline() {
        assert_eq!(next_try(0, NOW, NOW + 5_000), Some(NOW + 50));
        assert_eq!(next_try(4, NOW, NOW + 5_000), Some(NOW + 800));
        assert_eq!(next_try(9, NOW, NOW + 5_000), Some(NOW + 1_000));
        assert_eq!(
            next_try(9, NOW, NOW + 300),
            Some(NOW + 300),
            "never past the deadline"
        );
        assert_eq!(next_try(0, NOW + 300, NOW + 300), None);
    }

    #[test]
    fn redlock_needs_a_majority_within_the_validity() {
        assert_eq!(quorum(1), 1);
        assert_eq!(quorum(3), 2);
        assert_eq!(quorum(5), 3);
        assert!(has_quorum(3, 5) && !has_quorum(2, 5) && !has_quorum(0, 0));
        assert_eq!(drift_ms(10_000), 102);
        assert_eq!(decide(3, 5, 10_000, 50), Some(10_000 - 50 - 102));
        assert_eq!(decide(2, 5, 10_000, 50), None, "no majority");
        assert_eq!(
            decide(5, 5, 10_000, 9_950),
            None,
            "took too long: no validity left"
        );
        assert_eq!(decide(0, 0, 10_000, 0), None);
        assert_eq!(decide(1, 1, 200, 5), Some(200 - 5 - 4));
    }

    #[test]
    fn an_unknown_acquire_is_released_for_up_to_its_ttl_and_tables_sweep_every_second() {
        assert_eq!(orphan_window_ms(30_000), 30_000);
        assert_eq!(SWEEP_INTERVAL_MS, 1_000);
    }

    #[test]
    fn the_watchdog_renews_at_a_third_of_the_ttl() {
        assert_eq!(renew_after_ms(300), 100);
        assert_eq!(renew_after_ms(30_000), 10_000);
        assert_eq!(renew_after_ms(1), 1);
    }

    #[test]
    fn the_fencing_token_is_the_largest_counter() {
        assert_eq!(fencing_token(&[3, 9, 4]), 9);
        assert_eq!(fencing_token(&[]), 0);
    }
}
