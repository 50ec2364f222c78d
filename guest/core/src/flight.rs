//! The single-flight state machine of a tiered get-or-set (contract §5).
//!
//! One [`Flight`] is the life of one get-or-set in the process that leads it (the
//! host's keyed flight registry makes every other caller of the same key in the process
//! wait for that leader: one loader call per key per process). The host checks L1
//! first (against a deadline this machine issued when it filled L1), then drives the
//! flight: it performs each [`Action`] and feeds back the [`Event`] it led to. The
//! machine decides everything else: when to take the distributed lock, how long to back
//! off, when to give up and degrade, what to write where, and what to write into L1.
//!
//! In the style of quinn-proto: no I/O, no clock reads; `now_ms` comes with every event,
//! so a simulated-time harness drives every path deterministically (see the tests).
//! The state is a plain value, so any instance of the component can step any flight.

use crate::envelope::Header;
use crate::expiry::{self, EntryMeta, EntryOptions};
use crate::{ArgError, Limits, key, policy};

/// How a get-or-set runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlightConfig {
    /// How long to wait for the distributed lock (or a value) before degrading.
    pub lock_wait_ms: u64,
    /// The distributed lock's TTL.
    pub lock_ttl_ms: u64,
    /// The longest an entry is served from L1 without asking L2.
    pub l1_ttl_ms: u64,
    /// How long a degraded load's value is served from L1 (0: not at all).
    pub degraded_l1_ttl_ms: u64,
    /// Fail-safe: how long a stale copy served in place of a failed reload is served
    /// from L1 before the loader is tried again (contract §7.1).
    pub fail_safe_throttle_ms: u64,
    /// The hard loader timeout: a load running longer ends the flight (with the stale
    /// copy if there is one, else a timeout). `None`: no limit.
    pub hard_timeout_ms: Option<u64>,
    /// The soft loader timeout (contract §7.2): when a stale copy exists and the load
    /// runs longer, the callers get the stale copy and the load goes on in the
    /// background, still filling the tiers. `None`: no soft timeout.
    pub soft_timeout_ms: Option<u64>,
    /// Eager refresh (contract §7.3): once this many thousandths of an entry's
    /// freshness (its `relative` duration) have passed, a hit returns it and starts one
    /// background refresh (for a caller that can take it: `starts_refresh`). `None`:
    /// never.
    pub eager_refresh_permille: Option<u32>,
    /// Background completion (contract §7.2): a load still running at the hard
    /// timeout is not stopped. The callers are answered then, as a hard timeout answers
    /// them (the stale copy, else a timeout), and the load goes on to fill the tiers
    /// when it succeeds. Only a body that can answer before the loader returns sets it.
    pub background_completion: bool,
    /// This flight is such a background refresh: it takes the lock without waiting
    /// (another process is refreshing if it is held), and a failure leaves the current
    /// value in place.
    pub refresh: bool,
    /// Skip both locks: load, write the tiers if cacheable, return.
    pub bypass: bool,
    /// The caller can be handed the refresh a hit past its refresh moment starts. When
    /// it cannot (a portable follower leading in a load's place: its `outcome` answers
    /// with a value alone), such a hit starts none and keeps its refresh moment, so the
    /// next caller starts it.
    pub starts_refresh: bool,
}

impl Default for FlightConfig {
    fn default() -> Self {
        crate::Settings::DEFAULT.flight(false)
    }
}

/// How long renewals keep a leader's lock while its loader runs, in lock TTLs from the
/// flight's start (5 min at the default TTL): a loader hung past it lets another process
/// lead, as a crashed leader's lapsed lock does.
pub const RENEWED_HOLD_MAX_TTLS: u64 = 10;

/// First wait of a follower for the lock holder; doubled per attempt.
pub const BACKOFF_INITIAL_MS: u64 = 50;
/// Longest wait between two looks.
pub const BACKOFF_MAX_MS: u64 = 1_000;

/// How long, in real time, a get-or-set's store steps may take (contract §5.13). The
/// body arms each deadline when its phase begins and fails a step that runs past it
/// (the machine then hears `StoreFailed`, `L2Failed` or `L2WriteFailed`, and degrades).
/// Real time, not the cache's clock: a manual or stepped clock must not stretch a store
/// step, nor cut one short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreBudget {
    /// The steps before the load (reads, the lock, waits for a landing) share the lock
    /// wait, and at least one store timeout.
    pub before_load_ms: u64,
    /// An eager refresh's steps before its load share one store timeout: it takes the
    /// lock without waiting (contract §7.3), so it has no lock wait to spend, and a
    /// body that begins it while its caller waits (the portable one) keeps that caller
    /// no longer than one store step.
    pub refresh_before_load_ms: u64,
    /// The steps after the load (the fill) share one store timeout.
    pub after_load_ms: u64,
    /// The release and the announcement get one store timeout of their own: the steps
    /// before may have spent theirs.
    pub release_ms: u64,
}

impl StoreBudget {
    /// The budget of a cache whose lock wait and store timeout are these.
    pub fn new(lock_wait_ms: u64, store_timeout_ms: u64) -> StoreBudget {
        StoreBudget {
            before_load_ms: store_timeout_ms.max(lock_wait_ms),
            refresh_before_load_ms: store_timeout_ms,
            after_load_ms: store_timeout_ms,
            release_ms: store_timeout_ms,
        }
    }

    /// What the steps before the load of a flight run by `config` share: a refresh's
    /// budget, or a get-or-set's.
    pub fn before_load_of(&self, config: &FlightConfig) -> u64 {
        if config.refresh {
            self.refresh_before_load_ms
        } else {
            self.before_load_ms
        }
    }

    /// How long a tagged load may spend reading its tags' moments before the loader
    /// runs: one store timeout, no more than is left of the steps before the load
    /// (`left_ms`), and no more than half the time to the load's first timeout
    /// (`first_mark_in_ms`): the loader keeps the rest.
    pub fn tag_read_ms(&self, left_ms: u64, first_mark_in_ms: Option<u64>) -> u64 {
        let bound = self.after_load_ms.min(left_ms);
        first_mark_in_ms.map_or(bound, |mark| bound.min(mark / 2))
    }
}

/// The wait before look number `attempt` (0-based): 50 ms doubling to at most 1 s.
pub fn backoff_ms(attempt: u32) -> u64 {
    BACKOFF_INITIAL_MS
        .saturating_mul(1u64 << attempt.min(16))
        .min(BACKOFF_MAX_MS)
}

/// Until when an entry with `meta`, filled into L1 at `now_ms`, may be served from L1
/// without asking L2: never past its expiry, never longer than the L1 TTL, and for a
/// sliding entry never longer than half its interval, so that reads served by L1 send a
/// read (and its touch) to L2 at least twice per interval and keep it alive there.
pub fn l1_deadline(meta: &EntryMeta, now_ms: u64, l1_ttl_ms: u64) -> u64 {
    let mut until = meta.expires_at_ms.min(now_ms.saturating_add(l1_ttl_ms));
    if let Some(s) = meta.sliding_ms {
        until = until.min(now_ms.saturating_add((s / 2).max(1)));
    }
    until
}

/// The latest moment L1 may serve a copy whose own deadline is `deadline_ms` (its
/// [`l1_deadline`], or a flight's): no later than what judged it stops being known. For
/// a copy of what the store held (`read`: a hit, a stale copy), that is the generation
/// it was named in (`generation_until_ms`): a clear whose announcement a process missed
/// is learnt once that knowledge lapses, and a copy read late in its window would
/// otherwise serve what the clear removed for up to another L1 TTL. A value this
/// process loaded or wrote is newer than any clear it could have missed, and is not
/// bound by it (so an outage, which lets the generation lapse, still keeps a degraded
/// copy). For a tagged entry, the first of its tags' moments to lapse (`tags_until_ms`;
/// `u64::MAX` for an untagged one).
pub fn l1_copy_until(deadline_ms: u64, read: bool, generation_until_ms: u64, tags_until_ms: u64) -> u64 {
    let generation = if read { generation_until_ms } else { u64::MAX };
    deadline_ms.min(generation).min(tags_until_ms)
}

/// When an eager refresh of an entry with `meta` falls due (contract §7.3): after
/// `permille` thousandths of its freshness, counted as the caller's `relative` duration
/// ending at the entry's absolute point. `None` (never) without eager refresh, for
/// options without a relative duration, or for an entry without an absolute point.
pub fn refresh_at(meta: &EntryMeta, options: &EntryOptions, permille: Option<u32>) -> Option<u64> {
    let permille = u64::from(permille?.min(1000));
    let duration = options.relative_ms?;
    let end = meta.absolute_ms?;
    let left = duration / 1000 * (1000 - permille) + duration % 1000 * (1000 - permille) / 1000;
    Some(end.saturating_sub(left))
}

/// Checks an eager refresh fraction, in thousandths: strictly between 0 and 1000.
///
/// # Errors
/// An [`ArgError`] naming `eager_refresh`.
pub fn check_eager_refresh(permille: u32) -> Result<(), ArgError> {
    if (1..1000).contains(&permille) {
        return Ok(());
    }
    Err(ArgError::new(
        crate::Arg::EagerRefresh,
        format!(
            "must be a fraction strictly between 0 and 1 of the freshness (say 0.8), not {permille}/1000"
        ),
    ))
}

/// Where a flight stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Reading L2 for the first time.
    Reading,
    /// Trying to take the distributed lock.
    Locking,
    /// Holding the lock, reading L2 again before loading.
    DoubleChecking,
    /// Waiting for the lock holder's value (or the next try).
    Waiting,
    /// The loader runs.
    Loading,
    /// Writing the loaded value to L2.
    Writing,
    /// Finished: no more actions.
    Done,
}

/// What the host tells the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A read of L2 found a fresh entry (as judged by [`policy::read`]) with this meta.
    L2Hit(EntryMeta),
    /// A read of L2 found nothing fresh (missing, expired or corrupt).
    L2Miss,
    /// A read of L2 found a stale copy (past its expiry, within its stale window): a
    /// miss, but one fail-safe may serve if the reload fails.
    L2Stale(EntryMeta),
    /// A read of L2 failed (store unavailable).
    L2Failed,
    /// The distributed lock is ours.
    LockAcquired,
    /// Someone else holds the distributed lock. `watching` says whether the host has a
    /// live notification channel for landings (then waits can be long: a landing wakes
    /// the waiter; the timer is only a safety net).
    LockBusy {
        /// Whether a landing notification will wake the wait.
        watching: bool,
    },
    /// The lock could not be tried (store unavailable).
    LockFailed,
    /// A wait ended: a value landed, or the timer fired.
    Woken,
    /// A wait ended at the real-time deadline of the steps before the load
    /// ([`StoreBudget::before_load_ms`]) before the clock reached its moment, with no
    /// landing: the lock wait is over, whatever the cache's clock says. Only real time
    /// ends a wait on a clock that stands still (a manual clock) or stepped back; the
    /// flight then judges the lock timed out, as it does at its own deadline, rather
    /// than looking again at once for as long as the clock lags.
    BudgetSpent,
    /// The loader returned a value of `len` bytes; `cacheable` is the caller's
    /// `should_cache` verdict on it.
    Loaded {
        /// The value's length.
        len: u64,
        /// Whether the caller's predicate accepts caching it.
        cacheable: bool,
        /// This value's own expiry, replacing the flight's options for its write (a
        /// typed `None` cached briefly); `None`: the flight's options.
        expiry: Option<EntryOptions>,
    },
    /// The loader failed.
    LoadFailed,
    /// The loader ran past the hard timeout (`Action::Load`'s `until_ms`) and was
    /// stopped.
    LoadTimedOut,
    /// The loader is still running at the soft timeout (`Action::Load`'s
    /// `soft_until_ms`); it goes on.
    LoadSlow,
    /// The loader is still running at the hard timeout of a flight with background
    /// completion (`Action::Load`'s `overdue_ms`); it goes on.
    LoadOverdue,
    /// The L2 write succeeded.
    L2Written,
    /// The L2 write failed.
    L2WriteFailed,
    /// The loader is still running at `Action::Load`'s (or the last
    /// `Action::KeepLoading`'s) `renew_at_ms`: the flight's lock is due for renewal.
    RenewDue,
    /// The lock was renewed ([`Action::RenewLock`]): it is still this flight's.
    Renewed,
    /// The renewal found the lock no longer this flight's (it lapsed, or was taken
    /// over): the load goes on, and fills nothing.
    RenewRefused,
    /// The renewal could not be tried (store unavailable): the lock holds until it
    /// lapses, and is tried again before then if there is time.
    RenewFailed,
    /// The loader call began, later than the load was asked for (a batch's key waits
    /// for its batch to be quiet, contract §5.16): the load's timeouts count from now.
    /// The machine answers [`Action::Load`] with its moments re-armed; the body keeps
    /// the loader it has (it does not call it again) and waits by the new moments.
    LoadBegan,
}

/// How a flight ended, for the caller and the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Served from L2 (`after_wait`: once another process's load landed).
    L2Hit {
        /// Whether the value came from another process's load we waited for.
        after_wait: bool,
    },
    /// This flight loaded the value; `cached` says whether it went into the tiers.
    Loaded {
        /// Whether the value was written to the tiers.
        cached: bool,
    },
    /// This flight loaded the value, but its distributed lock lapsed (or was taken
    /// over) while the loader ran: the caller gets the value and nothing is cached,
    /// since another leader may hold the lock and a removal since the double-check may
    /// have outlived its tombstone (contract §5.12). A refused fill.
    Lapsed,
    /// The distributed lock could not be had (store down or wait timed out): the
    /// loader ran uncached for this caller.
    Degraded {
        /// Whether the lock wait ran past its deadline (else the store failed).
        timed_out: bool,
    },
    /// The loader failed; nothing was cached. Its error goes to the caller and to every
    /// caller coalesced on this flight.
    LoaderFailed,
    /// The reload failed in a way fail-safe covers, and a stale copy existed: it is
    /// served to every caller of the flight, and from L1 for the throttle.
    Stale(StaleCause),
    /// The loader ran past the hard timeout and there was no stale copy: a timeout
    /// error for every caller; nothing cached.
    TimedOut,
    /// A background refresh found the lock held (another process refreshes) or the
    /// store failing: it did nothing.
    Skipped,
}

impl Outcome {
    /// Whether the value the flight answered with is a copy of what the store held (a
    /// hit, a stale copy), not one it loaded: such a copy is bound by the generation it
    /// was named in ([`l1_copy_until`]).
    pub fn read_from_store(&self) -> bool {
        matches!(self, Outcome::L2Hit { .. } | Outcome::Stale(_))
    }
}

/// Why a flight served a stale copy (contract §7.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StaleCause {
    /// The loader failed.
    LoaderFailed,
    /// The loader ran past the hard timeout.
    LoadTimedOut,
    /// The distributed lock was held past the lock wait.
    LockTimedOut,
    /// The store failed (the lock could not be tried, or a read failed).
    StoreFailed,
}

/// What the host does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Read L2 (through [`policy::read`]) and report [`Event::L2Hit`], [`Event::L2Miss`]
    /// or [`Event::L2Failed`].
    ReadL2,
    /// Try the distributed lock with this TTL (`SET NX PX`, a fresh random token), and
    /// report [`Event::LockAcquired`], [`Event::LockBusy`] or [`Event::LockFailed`].
    TryLock {
        /// The lock's TTL.
        ttl_ms: u64,
    },
    /// Wait until a value for the key lands (a notification) or until `until_ms`,
    /// whichever is first, then report [`Event::Woken`] ([`Event::BudgetSpent`] when the
    /// real-time deadline of the steps before the load ended it first, with no landing).
    Wait {
        /// When to stop waiting.
        until_ms: u64,
    },
    /// Call the loader once and report [`Event::Loaded`] or [`Event::LoadFailed`]; if
    /// `until_ms` is set and the loader is still running then, stop it and report
    /// [`Event::LoadTimedOut`] (a body that cannot stop it reports what it returned:
    /// the machine judges a late answer as a timeout all the same).
    Load {
        /// The hard timeout's moment, if any.
        until_ms: Option<u64>,
        /// The soft timeout's moment, if any (only when a stale copy exists): if the
        /// loader still runs then, report [`Event::LoadSlow`] and keep it running.
        soft_until_ms: Option<u64>,
        /// The hard timeout's moment with background completion, if any: if the loader
        /// still runs then, report [`Event::LoadOverdue`] and keep it running.
        overdue_ms: Option<u64>,
        /// When the flight's lock is due for renewal, if it holds one: if the loader
        /// still runs then, report [`Event::RenewDue`] (a body that cannot renew ignores
        /// it: a load that outlives the lock then fills nothing).
        renew_at_ms: Option<u64>,
    },
    /// Renew the flight's lock (owner-checked, a TTL of `ttl_ms` from now) while the
    /// load goes on, and report [`Event::Renewed`], [`Event::RenewRefused`] or
    /// [`Event::RenewFailed`].
    RenewLock {
        /// The lock's new TTL.
        ttl_ms: u64,
        /// Renew only while the key still holds what the last L2 read found (those
        /// bytes, or nothing), as the fill is fenced: a removal or a `set` during the load
        /// ends the lock, so a renewed load never outlives a removal's tombstone
        /// (contract §5.12). A body that cannot check the entry in the same step as the
        /// renewal does not renew (it reports [`Event::RenewFailed`]).
        fenced: bool,
    },
    /// Soft timeout: hand the stale copy to every caller now and fill L1 with it until
    /// `l1_until_ms` (marked stale: the callers that come while the load runs get it
    /// too), keep the load running in the background, and report its result as usual;
    /// the flight's finish then fills the tiers.
    AnswerStale {
        /// Fill L1 with the stale copy until this moment.
        l1_until_ms: Option<u64>,
    },
    /// Keep the load running and report its result as usual, answering nobody early
    /// (after a soft timeout whose stale copy's window ended meanwhile, or a renewal):
    /// the lock's next renewal falls at `renew_at_ms`, if set (report
    /// [`Event::RenewDue`] then).
    KeepLoading {
        /// When the lock is next due for renewal, if ever.
        renew_at_ms: Option<u64>,
    },
    /// Hard timeout with background completion and no stale copy to serve: give every
    /// caller a timeout error now, keep the load running and report its result as
    /// usual; the flight's finish then fills the tiers.
    AnswerTimedOut,
    /// Write the header followed by the value to L2 with this TTL, then report
    /// [`Event::L2Written`] or [`Event::L2WriteFailed`] (a fenced write that found the
    /// key changed failed).
    WriteL2 {
        /// The envelope header.
        header: Header,
        /// The store TTL upper bound.
        store_ttl_ms: u64,
        /// Fenced (contract §5.12): write only if the key still holds what the last L2
        /// read found (those bytes, or nothing), so a `set` or removal since then wins
        /// over this load. Every fill after a read is fenced; only a bypass, which
        /// reads nothing, writes plainly.
        fenced: bool,
        /// The flight holds the distributed lock: the write also releases it
        /// (owner-checked) and announces the landing (a value landed, or the lock is
        /// free), after writing and before the flight's end; a store that can does all
        /// three in one step, writing only while the lock is still this flight's
        /// (contract §5.12). The [`Action::Finish`] that follows releases and announces
        /// nothing. Reported as a write: [`Event::L2Written`] or [`Event::L2WriteFailed`].
        release: bool,
    },
    /// The flight is over: release the lock if `release` (owner-checked), tell waiters
    /// the value landed if `notify`, fill L1 until `l1_until_ms` if set, and return.
    Finish {
        /// How it ended.
        outcome: Outcome,
        /// Release the distributed lock.
        release: bool,
        /// Notify waiting followers: a value was written to L2, or the lock released.
        notify: bool,
        /// Fill L1 with the value, servable until this moment.
        l1_until_ms: Option<u64>,
        /// When an eager refresh of the value falls due (contract §7.3), if ever: a hit
        /// at or after it starts one background refresh. `None` when `refresh_now`.
        refresh_at_ms: Option<u64>,
        /// The value served (an L2 hit) is due for its eager refresh already: start one
        /// background refresh now (a body that can run one).
        refresh_now: bool,
    },
}

/// One get-or-set in the process that leads it. A plain value: copy it, store it,
/// step it anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flight {
    /// Where it stands.
    pub phase: Phase,
    /// How the loaded entry expires.
    pub options: EntryOptions,
    /// How it runs.
    pub config: FlightConfig,
    /// Looks taken while waiting for the lock.
    pub attempt: u32,
    /// When waiting for the lock ends.
    pub deadline_ms: u64,
    /// Whether this flight holds the distributed lock.
    pub locked: bool,
    /// Whether this flight has waited for another holder.
    pub waited: bool,
    /// Whether the lock wait timed out.
    pub timed_out: bool,
    /// The planned entry, once loaded and cacheable.
    pub planned: Option<EntryMeta>,
    /// The stale copy a read found, if any: fail-safe serves it should the reload fail.
    pub stale: Option<EntryMeta>,
    /// When the running load's hard timeout falls, if it has one.
    pub load_until_ms: Option<u64>,
    /// Whether the callers already got the stale copy (soft timeout).
    pub answered: bool,
    /// Whether an L2 read found something to fence a fill on (a value, a stale copy,
    /// or nothing at all), as opposed to no read or only failed ones.
    pub fence_known: bool,
    /// When the distributed lock this flight took lapses at the latest, counted from
    /// before its try (or last renewal) was sent: a load that ends later fills nothing
    /// (contract §5.12).
    pub lock_until_ms: Option<u64>,
    /// While the loader runs holding the lock: when the lock is next due for renewal.
    pub renew_at_ms: Option<u64>,
    /// A renewal in progress: when it was sent (the lock's new TTL counts from then).
    pub renew_sent_ms: Option<u64>,
}

impl Flight {
    /// Judges what a flight would start with at `now_ms`, its key aside: the entry
    /// options, the eager refresh fraction and the timeouts (a batch judges them once
    /// for all its keys).
    ///
    /// # Errors
    /// An [`ArgError`] naming the first bad one.
    pub fn check(
        options: &EntryOptions,
        config: &FlightConfig,
        now_ms: u64,
        limits: &Limits,
    ) -> Result<(), ArgError> {
        expiry::plan(options, now_ms, limits)?;
        if let Some(p) = config.eager_refresh_permille {
            check_eager_refresh(p)?;
        }
        for timeout in [config.hard_timeout_ms, config.soft_timeout_ms]
            .into_iter()
            .flatten()
        {
            crate::check_duration(crate::Arg::Timeout, timeout, false)?;
        }
        Ok(())
    }

    /// Starts a flight for `key` at `now_ms`: the key and the options are judged now,
    /// before anything is loaded. Returns the flight and its first action.
    ///
    /// # Errors
    /// An [`ArgError`] for a bad key or bad entry options.
    pub fn start(
        key: &str,
        options: EntryOptions,
        config: FlightConfig,
        now_ms: u64,
        limits: &Limits,
    ) -> Result<(Flight, Action), ArgError> {
        Flight::start_judged(key, options, config, now_ms, now_ms, limits)
    }

    /// Starts a flight for `key` at `now_ms` for a call that judged its options at
    /// `judged_ms` ([`check`](Self::check)), earlier or now: a batch's key that flies on
    /// after its batch's reads, a caller that leads after following. The options are
    /// judged as the call found them: an absolute point that passed since fails nothing
    /// (the value loaded is not cached, as when it passes while the loader runs). The
    /// flight's own deadlines count from `now_ms`.
    ///
    /// # Errors
    /// An [`ArgError`] for a bad key or bad entry options.
    pub fn start_judged(
        key: &str,
        options: EntryOptions,
        config: FlightConfig,
        judged_ms: u64,
        now_ms: u64,
        limits: &Limits,
    ) -> Result<(Flight, Action), ArgError> {
        key::validate(key, limits)?;
        Flight::check(&options, &config, judged_ms, limits)?;
        let mut flight = Flight {
            phase: Phase::Reading,
            options,
            config,
            attempt: 0,
            deadline_ms: now_ms.saturating_add(config.lock_wait_ms),
            locked: false,
            waited: false,
            timed_out: false,
            planned: None,
            stale: None,
            load_until_ms: None,
            answered: false,
            fence_known: false,
            lock_until_ms: None,
            renew_at_ms: None,
            renew_sent_ms: None,
        };
        if config.refresh {
            // Due already (the hit said so): straight to the lock, without waiting.
            let action = flight.try_lock(now_ms);
            return Ok((flight, action));
        }
        if config.bypass {
            let action = flight.load(now_ms);
            return Ok((flight, action));
        }
        Ok((flight, Action::ReadL2))
    }

    /// Feeds the result of the last action; returns the next action.
    ///
    /// An event that does not fit the phase (a host bug) ends the flight by loading
    /// uncached rather than panicking: the caller still gets a value.
    pub fn handle(&mut self, event: Event, now_ms: u64, limits: &Limits) -> Action {
        use Event as E;
        use Phase as P;
        if matches!(event, E::L2Hit(_) | E::L2Miss | E::L2Stale(_)) {
            self.fence_known = true;
        }
        // A stale copy is a miss that fail-safe remembers.
        let event = match (self.phase, event) {
            (P::Reading | P::DoubleChecking | P::Waiting, E::L2Stale(meta)) => {
                self.stale = Some(meta);
                E::L2Miss
            }
            // The latest read found no stale copy: the one an earlier read found was
            // removed, replaced or lapsed meanwhile, and is not served (contract §7.1).
            (P::Reading | P::DoubleChecking | P::Waiting, E::L2Miss) => {
                self.stale = None;
                E::L2Miss
            }
            // A load that answered past its hard timeout timed out all the same.
            (P::Loading, E::Loaded { .. } | E::LoadFailed)
                if self.load_until_ms.is_some_and(|until| now_ms >= until) =>
            {
                E::LoadTimedOut
            }
            _ => event,
        };
        if self.config.refresh {
            match (self.phase, event) {
                // Another process refreshes, or the store fails: nothing to do.
                (P::Locking, E::LockBusy { .. } | E::LockFailed) => {
                    return self.finish(Outcome::Skipped, false, None);
                }
                // Refreshed meanwhile by someone else: serve that, release.
                (P::DoubleChecking, E::L2Hit(meta))
                    if refresh_at(&meta, &self.options, self.config.eager_refresh_permille)
                        .is_none_or(|at| now_ms < at) =>
                {
                    return self.finish(
                        Outcome::L2Hit { after_wait: false },
                        self.locked,
                        Some(l1_deadline(&meta, now_ms, self.config.l1_ttl_ms)),
                    );
                }
                (P::DoubleChecking, E::L2Hit(_)) => return self.load(now_ms),
                // Gone (removed, expired) or unreadable since the hit: a refresh never
                // brings back what was invalidated, nor writes without a fence.
                (P::DoubleChecking, E::L2Miss | E::L2Failed) => {
                    return self.finish(Outcome::Skipped, self.locked, None);
                }
                // A failed refresh leaves the current value in place.
                (P::Loading, E::LoadFailed | E::LoadTimedOut) => {
                    return self.finish(Outcome::LoaderFailed, self.locked, None);
                }
                _ => {}
            }
        }
        match (self.phase, event) {
            (P::Loading, E::LoadSlow) if !self.answered => match self.stale_l1_until(now_ms) {
                Some(l1_until_ms) => {
                    self.answered = true;
                    Action::AnswerStale { l1_until_ms }
                }
                // Past its window by now: nothing to answer with; the load goes on.
                None => self.keep_loading(),
            },
            (P::Loading, E::RenewDue | E::Renewed | E::RenewRefused | E::RenewFailed) => {
                self.renewal(event, now_ms)
            }
            (P::Loading, E::LoadBegan) => self.timeouts_from(now_ms),
            // The hard timeout, with background completion: the callers get what a hard
            // timeout gives them, and the load goes on.
            (P::Loading, E::LoadOverdue) if !self.answered => {
                self.answered = true;
                match self.stale_l1_until(now_ms) {
                    Some(l1_until_ms) => Action::AnswerStale { l1_until_ms },
                    None => Action::AnswerTimedOut,
                }
            }
            // Answered at the soft timeout already.
            (P::Loading, E::LoadOverdue) => self.keep_loading(),
            (P::Reading | P::DoubleChecking | P::Waiting, E::L2Hit(meta)) => {
                let after_wait = self.waited;
                // A double-check hit holds the lock: release it.
                let refresh = refresh_at(&meta, &self.options, self.config.eager_refresh_permille);
                self.finish_at(
                    Outcome::L2Hit { after_wait },
                    self.locked,
                    Some(l1_deadline(&meta, now_ms, self.config.l1_ttl_ms)),
                    refresh,
                    now_ms,
                )
            }
            (P::Reading, E::L2Miss) => self.try_lock(now_ms),
            (P::Reading | P::Waiting, E::L2Failed) => self.degrade(StaleCause::StoreFailed, now_ms),
            (P::Locking, E::LockAcquired) => {
                self.locked = true;
                self.phase = P::DoubleChecking;
                Action::ReadL2
            }
            (P::Locking, E::LockBusy { watching }) => self.wait(now_ms, watching),
            (P::Locking, E::LockFailed) => self.degrade(StaleCause::StoreFailed, now_ms),
            (P::Waiting, E::Woken) => Action::ReadL2,
            (P::Waiting, E::BudgetSpent) => self.lock_timed_out(now_ms),
            (P::Waiting, E::L2Miss) if now_ms >= self.deadline_ms => self.lock_timed_out(now_ms),
            (P::Waiting, E::L2Miss) => self.try_lock(now_ms),
            (P::DoubleChecking, E::L2Miss | E::L2Failed) => self.load(now_ms),
            (
                P::Loading,
                E::Loaded {
                    len,
                    cacheable,
                    expiry,
                },
            ) => {
                let options = expiry.unwrap_or(self.options);
                let degraded = !self.locked && !self.config.bypass;
                if degraded {
                    // Kept in this process's L1 only, briefly, and only what would have
                    // been cached: an outage does not send every caller to the loader.
                    let l1 = (cacheable && self.config.degraded_l1_ttl_ms > 0)
                        .then(|| policy::plan_value(len, &options, now_ms, limits).ok())
                        .flatten()
                        .map(|plan| {
                            let ttl = self.config.degraded_l1_ttl_ms.min(self.config.l1_ttl_ms);
                            l1_deadline(&plan.meta, now_ms, ttl)
                        });
                    return self.finish(
                        Outcome::Degraded {
                            timed_out: self.timed_out,
                        },
                        false,
                        l1,
                    );
                }
                // The lock may have lapsed while the loader ran (a slow loader, a process
                // paused past the lock's TTL): another process may hold it, and a removal
                // since the double-check may have outlived its tombstone. Not written.
                if !cacheable {
                    return self.finish(Outcome::Loaded { cached: false }, self.locked, None);
                }
                if self.locked && self.lock_until_ms.is_some_and(|until| now_ms >= until) {
                    return self.finish(Outcome::Lapsed, self.locked, None);
                }
                match policy::plan_value(len, &options, now_ms, limits) {
                    Ok(plan) => {
                        self.planned = Some(plan.meta);
                        self.phase = P::Writing;
                        Action::WriteL2 {
                            header: plan.header,
                            store_ttl_ms: plan.store_ttl_ms,
                            fenced: self.fence_known,
                            release: self.locked,
                        }
                    }
                    // Too large to cache, or the absolute point passed while loading:
                    // the caller gets the value, nothing is cached.
                    Err(_) => self.finish(Outcome::Loaded { cached: false }, self.locked, None),
                }
            }
            (P::Loading, E::LoadFailed) => match self.serve_stale(StaleCause::LoaderFailed, now_ms) {
                Some(served) => served,
                None => self.finish(Outcome::LoaderFailed, self.locked, None),
            },
            (P::Loading, E::LoadTimedOut) => match self.serve_stale(StaleCause::LoadTimedOut, now_ms) {
                Some(served) => served,
                None => self.finish(Outcome::TimedOut, self.locked, None),
            },
            (P::Writing, E::L2Written) => {
                let l1 = self
                    .planned
                    .map(|m| l1_deadline(&m, now_ms, self.config.l1_ttl_ms));
                let refresh = self
                    .planned
                    .and_then(|m| refresh_at(&m, &self.options, self.config.eager_refresh_permille));
                self.written(Outcome::Loaded { cached: true }, l1, refresh, now_ms)
            }
            // L2 first, then L1: a failed L2 write leaves L1 alone.
            (P::Writing, E::L2WriteFailed) => {
                self.written(Outcome::Loaded { cached: false }, None, None, now_ms)
            }
            // Anything else is out of order: load uncached, never trap.
            _ => {
                if self.phase == P::Done {
                    return self.finish(Outcome::Degraded { timed_out: false }, false, None);
                }
                self.locked = false;
                self.load(now_ms)
            }
        }
    }

    /// The caller went away mid-flight (its future was dropped). Ends the flight and
    /// says whether a distributed lock is held and must be released.
    pub fn abandon(&mut self) -> bool {
        let owed = self.locked;
        self.locked = false;
        self.phase = Phase::Done;
        owed
    }

    fn try_lock(&mut self, now_ms: u64) -> Action {
        self.phase = Phase::Locking;
        self.lock_until_ms = Some(now_ms.saturating_add(self.config.lock_ttl_ms));
        Action::TryLock {
            ttl_ms: self.config.lock_ttl_ms,
        }
    }

    /// Waits for the holder: with a live landing channel, a landing wakes the waiter and
    /// the timer is a safety net at the longest backoff; without one, the timer is the
    /// only wake-up and follows the backoff schedule (50 ms doubling to 1 s).
    fn wait(&mut self, now_ms: u64, watching: bool) -> Action {
        self.phase = Phase::Waiting;
        self.waited = true;
        let pause = if watching {
            BACKOFF_MAX_MS
        } else {
            backoff_ms(self.attempt)
        };
        let until_ms = now_ms.saturating_add(pause).min(self.deadline_ms.max(now_ms));
        self.attempt = self.attempt.saturating_add(1);
        Action::Wait { until_ms }
    }

    /// The wait for the lock is over (by the clock, or by real time): degrade.
    fn lock_timed_out(&mut self, now_ms: u64) -> Action {
        self.timed_out = true;
        self.degrade(StaleCause::LockTimedOut, now_ms)
    }

    /// The lock cannot be had (`cause`): serve the stale copy if there is one, else
    /// load uncached for this process.
    fn degrade(&mut self, cause: StaleCause, now_ms: u64) -> Action {
        if let Some(served) = self.serve_stale(cause, now_ms) {
            return served;
        }
        self.locked = false;
        self.load(now_ms)
    }

    /// The renewal of the lock while the loader runs, every third of its TTL (as a
    /// lease's watchdog renews), for at most [`RENEWED_HOLD_MAX_TTLS`] TTLs from the
    /// flight's start. Each renewal counts from when it was sent, and checks that the
    /// entry still holds what the fill expects (`fenced`): one the store refused (the lock
    /// lost, or the key written or removed) ends the lock at once; one that failed is
    /// tried again while the lock may still hold. Out of turn (no lock, or a renewal under
    /// way), the load just goes on.
    fn renewal(&mut self, event: Event, now_ms: u64) -> Action {
        let ttl_ms = self.config.lock_ttl_ms;
        let every_ms = crate::lock::renew_after_ms(ttl_ms);
        let answered = match (event, self.renew_sent_ms) {
            (Event::RenewDue, None) if self.locked => {
                self.renew_at_ms = None;
                self.renew_sent_ms = Some(now_ms);
                return Action::RenewLock {
                    ttl_ms,
                    fenced: self.fence_known,
                };
            }
            (Event::Renewed, Some(sent)) => {
                let until = sent.saturating_add(ttl_ms);
                self.lock_until_ms = Some(self.lock_until_ms.map_or(until, |u| u.max(until)));
                self.renew_at_ms = Some(sent.saturating_add(every_ms));
                true
            }
            (Event::RenewRefused, Some(sent)) => {
                self.lock_until_ms = Some(self.lock_until_ms.map_or(sent, |u| u.min(sent)));
                self.renew_at_ms = None;
                true
            }
            // Tried again a third of the TTL on, or halfway to the lock's end if sooner.
            (Event::RenewFailed, Some(_)) => {
                self.renew_at_ms = self.lock_until_ms.and_then(|until| {
                    let next = now_ms.saturating_add(every_ms.min(until.saturating_sub(now_ms) / 2));
                    (now_ms < next && next < until).then_some(next)
                });
                true
            }
            _ => false,
        };
        if answered {
            self.renew_sent_ms = None;
        }
        let hold_until = self.renewed_hold_until();
        self.renew_at_ms = self.renew_at_ms.filter(|at| *at < hold_until);
        self.keep_loading()
    }

    /// Until when renewals may keep the lock: [`RENEWED_HOLD_MAX_TTLS`] TTLs from the
    /// flight's start.
    fn renewed_hold_until(&self) -> u64 {
        let started = self.deadline_ms.saturating_sub(self.config.lock_wait_ms);
        started.saturating_add(self.config.lock_ttl_ms.saturating_mul(RENEWED_HOLD_MAX_TTLS))
    }

    fn keep_loading(&self) -> Action {
        Action::KeepLoading {
            renew_at_ms: self.renew_at_ms,
        }
    }

    fn load(&mut self, now_ms: u64) -> Action {
        self.phase = Phase::Loading;
        // Held while the loader runs: renewed a third of its TTL after it was taken.
        self.renew_sent_ms = None;
        let hold_until = self.renewed_hold_until();
        self.renew_at_ms = self
            .lock_until_ms
            .filter(|until| self.locked && now_ms < *until)
            .map(|until| {
                let ttl_ms = self.config.lock_ttl_ms;
                until - ttl_ms.min(until) + crate::lock::renew_after_ms(ttl_ms)
            })
            .filter(|at| *at < hold_until);
        self.timeouts_from(now_ms)
    }

    /// The load's moments, its timeouts counted from `now_ms` (the lock's renewal as
    /// it stands); a timeout that answered the callers already is not armed again.
    fn timeouts_from(&mut self, now_ms: u64) -> Action {
        let hard_ms = self
            .config
            .hard_timeout_ms
            .map(|t| now_ms.saturating_add(t.max(1)));
        // With background completion the hard timeout answers the callers and the load
        // goes on (a refresh has no callers to answer: its load is stopped as usual).
        let (until_ms, overdue_ms) = if self.config.background_completion && !self.config.refresh {
            (None, hard_ms)
        } else {
            (hard_ms, None)
        };
        self.load_until_ms = until_ms;
        // A soft timeout only matters with a stale copy to give meanwhile, and only
        // before the hard one.
        let soft_until_ms = self
            .config
            .soft_timeout_ms
            .filter(|_| self.stale.is_some() && !self.config.refresh)
            .map(|t| now_ms.saturating_add(t.max(1)))
            .filter(|soft| hard_ms.is_none_or(|hard| *soft < hard));
        // Once answered (the stale copy, or a timeout with background completion), no
        // early answer is due again.
        let (soft_until_ms, overdue_ms) = if self.answered {
            (None, None)
        } else {
            (soft_until_ms, overdue_ms)
        };
        Action::Load {
            until_ms,
            soft_until_ms,
            overdue_ms,
            renew_at_ms: self.renew_at_ms,
        }
    }

    /// Fail-safe (contract §7.1): ends the flight with the stale copy, if one is known
    /// and still within its window, re-armed in L1 for the throttle (never past its
    /// window) so the loader is not hammered; the lock, if held, is released.
    fn serve_stale(&mut self, cause: StaleCause, now_ms: u64) -> Option<Action> {
        let l1 = self.stale_l1_until(now_ms)?;
        Some(self.finish(Outcome::Stale(cause), self.locked, l1))
    }

    /// The known stale copy, if still within its window at `now_ms`: until when L1 may
    /// serve it (the throttle, never past the window; `None` inside: not at all).
    fn stale_l1_until(&self, now_ms: u64) -> Option<Option<u64>> {
        let stale = self.stale.filter(|m| now_ms < m.gone_at_ms())?;
        let until = now_ms
            .saturating_add(self.config.fail_safe_throttle_ms)
            .min(stale.gone_at_ms());
        Some((until > now_ms).then_some(until))
    }

    fn finish(&mut self, outcome: Outcome, release: bool, l1_until_ms: Option<u64>) -> Action {
        self.finish_at(outcome, release, l1_until_ms, None, 0)
    }

    /// Ends a flight whose write has been performed: a write made holding the lock
    /// released it and announced the landing ([`Action::WriteL2`]'s `release`), so the
    /// finish does neither again; a bypass's write announces as any finish does.
    fn written(
        &mut self,
        outcome: Outcome,
        l1_until_ms: Option<u64>,
        refresh_at_ms: Option<u64>,
        now_ms: u64,
    ) -> Action {
        let released = self.locked;
        let mut finish = self.finish_at(outcome, false, l1_until_ms, refresh_at_ms, now_ms);
        if let Action::Finish { notify, .. } = &mut finish {
            *notify &= !released;
        }
        finish
    }

    /// Ends the flight. `refresh_at_ms`: when the served value's eager refresh falls
    /// due; an L2 hit past it at `now_ms` starts one now (a refresh flight never starts
    /// another).
    fn finish_at(
        &mut self,
        outcome: Outcome,
        release: bool,
        l1_until_ms: Option<u64>,
        refresh_at_ms: Option<u64>,
        now_ms: u64,
    ) -> Action {
        self.phase = Phase::Done;
        // Waiters wake for a landed value, and for a released lock (to take it over).
        let notify = matches!(outcome, Outcome::Loaded { cached: true }) || release;
        self.locked = false;
        let refresh_now = matches!(outcome, Outcome::L2Hit { .. })
            && !self.config.refresh
            && self.config.starts_refresh
            && refresh_at_ms.is_some_and(|at| now_ms >= at);
        Action::Finish {
            outcome,
            release,
            notify,
            l1_until_ms,
            refresh_at_ms: refresh_at_ms.filter(|_| !refresh_now),
            refresh_now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000;

    /// A simulated world: one key's L2, one distributed lock, a loader, and time.
    /// `drive` runs a flight to its end, bounded so a livelock fails the test.
    struct World {
        now: u64,
        l2: Option<EntryMeta>,
        lock_holder: Option<&'static str>,
        redis_up: bool,
        loader: Result<u64, ()>,
        cacheable: bool,
        l2_write_ok: bool,
        /// When someone else's value lands in L2 (a simulated other process).
        lands_at: Option<u64>,
        /// Whether the host has a live landing channel.
        watching: bool,
        loads: u32,
        trace: Vec<String>,
    }

    impl World {
        fn new() -> Self {
            World {
                now: NOW,
                l2: None,
                lock_holder: None,
                redis_up: true,
                loader: Ok(5),
                cacheable: true,
                l2_write_ok: true,
                lands_at: None,
                watching: false,
                loads: 0,
                trace: vec![],
            }
        }

        fn land_if_due(&mut self) {
            if let Some(at) = self.lands_at
                && self.now >= at
            {
                self.l2 = Some(EntryMeta {
                    absolute_ms: Some(at + 60_000),
                    sliding_ms: None,
                    expires_at_ms: at + 60_000,
                    stale_ms: None,
                });
                self.lock_holder = None;
                self.lands_at = None;
            }
        }

        fn drive(&mut self, options: EntryOptions, config: FlightConfig) -> (Action, Flight) {
            let limits = Limits::default();
            let (mut flight, mut action) = Flight::start("k", options, config, self.now, &limits).unwrap();
            for _ in 0..200 {
                self.trace.push(
                    format!("{action:?}")
                        .split([' ', '{'])
                        .next()
                        .unwrap()
                        .to_string(),
                );
                let event = match &action {
                    Action::Finish { release, .. } => {
                        if *release {
                            assert_eq!(self.lock_holder, Some("me"), "releases only what it holds");
                            self.lock_holder = None;
                        }
                        return (action, flight);
                    }
                    Action::AnswerStale { .. }
                    | Action::KeepLoading { .. }
                    | Action::AnswerTimedOut
                    | Action::RenewLock { .. } => {
                        panic!("no early answer nor renewal in this world")
                    }
                    Action::ReadL2 => {
                        self.land_if_due();
                        match (self.redis_up, self.l2) {
                            (false, _) => Event::L2Failed,
                            (true, Some(m)) if self.now < m.expires_at_ms => Event::L2Hit(m),
                            (true, _) => Event::L2Miss,
                        }
                    }
                    Action::TryLock { .. } => match (self.redis_up, self.lock_holder) {
                        (false, _) => Event::LockFailed,
                        (true, None) => {
                            self.lock_holder = Some("me");
                            Event::LockAcquired
                        }
                        (true, Some(_)) => Event::LockBusy {
                            watching: self.watching,
                        },
                    },
                    Action::Wait { until_ms } => {
                        assert!(
                            *until_ms > self.now || *until_ms == flight.deadline_ms,
                            "waits move time forward"
                        );
                        // Wake at the landing if it comes first (a notification), else at the timer.
                        self.now = match self.lands_at {
                            Some(at) if at < *until_ms => at.max(self.now),
                            _ => *until_ms,
                        };
                        Event::Woken
                    }
                    Action::Load { .. } => {
                        self.loads += 1;
                        self.now += 500;
                        match self.loader {
                            Ok(len) => Event::Loaded {
                                len,
                                cacheable: self.cacheable,
                                expiry: None,
                            },
                            Err(()) => Event::LoadFailed,
                        }
                    }
                    Action::WriteL2 { release, .. } => {
                        if *release {
                            assert_eq!(self.lock_holder, Some("me"), "releases only what it holds");
                            self.lock_holder = None;
                        }
                        if self.l2_write_ok {
                            self.l2 = Some(flight.planned.unwrap());
                            Event::L2Written
                        } else {
                            Event::L2WriteFailed
                        }
                    }
                };
                action = flight.handle(event, self.now, &limits);
            }
            panic!("livelock: {:?}", self.trace);
        }
    }

    fn relative(ms: u64) -> EntryOptions {
        EntryOptions {
            relative_ms: Some(ms),
            ..Default::default()
        }
    }

    fn finish(a: &Action) -> (Outcome, bool, bool, Option<u64>) {
        match a {
            Action::Finish {
                outcome,
                release,
                notify,
                l1_until_ms,
                ..
            } => (*outcome, *release, *notify, *l1_until_ms),
            other => panic!("not finished: {other:?}"),
        }
    }

    fn stale_meta(world_now: u64) -> EntryMeta {
        EntryMeta {
            absolute_ms: Some(world_now - 1),
            sliding_ms: None,
            expires_at_ms: world_now - 1,
            stale_ms: Some(60_000),
        }
    }

    /// Drives a flight by hand: each event at `NOW + at`.
    fn run(config: FlightConfig, events: &[(u64, Event)]) -> (Flight, Vec<Action>) {
        let limits = Limits::default();
        let (mut f, first) = Flight::start("k", relative(60_000), config, NOW, &limits).unwrap();
        let mut actions = vec![first];
        for (at, e) in events {
            actions.push(f.handle(*e, NOW + at, &limits));
        }
        (f, actions)
    }

    #[test]
    fn a_failed_reload_serves_the_stale_copy_and_rearms_it_in_l1_for_the_throttle() {
        let config = FlightConfig::default();
        let stale = stale_meta(NOW);
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockAcquired),
                (0, Event::L2Stale(stale)),
                (10, Event::LoadFailed),
            ],
        );
        assert_eq!(
            actions[3],
            Action::Load {
                until_ms: None,
                soft_until_ms: None,
                overdue_ms: None,
                renew_at_ms: Some(NOW + 10_000)
            }
        );
        let (outcome, release, notify, l1) = finish(&actions[4]);
        assert_eq!(outcome, Outcome::Stale(StaleCause::LoaderFailed));
        assert!(release && notify, "the lock is released and waiters told");
        assert_eq!(l1, Some(NOW + 10 + config.fail_safe_throttle_ms));
    }

    #[test]
    fn a_flight_starts_from_its_calls_verdict_and_counts_its_deadlines_from_now() {
        let limits = Limits::default();
        let options = EntryOptions {
            absolute_ms: Some(NOW + 100),
            ..EntryOptions::default()
        };
        let config = FlightConfig::default();
        // Judged before the point, started after it: it starts, and counts from now.
        let (mut flight, action) = Flight::start_judged("k", options, config, NOW, NOW + 500, &limits)
            .expect("judged when the point was ahead");
        assert_eq!(action, Action::ReadL2);
        assert_eq!(flight.deadline_ms, NOW + 500 + config.lock_wait_ms);
        // Judged now, the same options are refused.
        let refused = Flight::start("k", options, config, NOW + 500, &limits).expect_err("in the past");
        assert_eq!(refused.arg, crate::Arg::Absolute);
        // Its load is answered, not cached: the point passed.
        flight.handle(Event::L2Miss, NOW + 500, &limits);
        flight.handle(Event::LockAcquired, NOW + 500, &limits);
        flight.handle(Event::L2Miss, NOW + 500, &limits);
        let loaded = Event::Loaded {
            len: 3,
            cacheable: true,
            expiry: None,
        };
        let done = flight.handle(loaded, NOW + 510, &limits);
        assert_eq!(finish(&done).0, Outcome::Loaded { cached: false });
    }

    #[test]
    fn without_a_stale_copy_a_failed_reload_is_the_loaders_error() {
        let (_, actions) = run(
            FlightConfig::default(),
            &[
                (0, Event::L2Miss),
                (0, Event::LockAcquired),
                (0, Event::L2Miss),
                (10, Event::LoadFailed),
            ],
        );
        assert_eq!(finish(&actions[4]).0, Outcome::LoaderFailed);
    }

    #[test]
    fn a_lock_held_past_the_wait_or_a_failed_store_serves_the_stale_copy_not_an_uncached_load() {
        let config = FlightConfig::default();
        let stale = stale_meta(NOW);
        let wait = config.lock_wait_ms;
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockBusy { watching: true }),
                (wait, Event::Woken),
                (wait, Event::L2Stale(stale)),
            ],
        );
        assert_eq!(finish(&actions[4]).0, Outcome::Stale(StaleCause::LockTimedOut));
        let (_, actions) = run(config, &[(0, Event::L2Stale(stale)), (0, Event::LockFailed)]);
        let (outcome, release, _, _) = finish(&actions[2]);
        assert_eq!(
            (outcome, release),
            (Outcome::Stale(StaleCause::StoreFailed), false)
        );
    }

    #[test]
    fn a_wait_out_of_real_time_ends_the_lock_wait_whatever_the_clock_says() {
        // The clock stands still (a manual clock): only real time ends the wait, and it
        // ends as the clock's deadline would (a lock timeout), not with another look.
        let config = FlightConfig::default();
        let (f, actions) = run(
            config,
            &[
                (0, Event::L2Miss),
                (0, Event::LockBusy { watching: true }),
                (0, Event::BudgetSpent),
            ],
        );
        assert!(
            matches!(actions[3], Action::Load { .. }),
            "loads uncached: {:?}",
            actions[3]
        );
        assert!(f.timed_out && !f.locked, "a lock timeout, no lock held");
        let stale = stale_meta(NOW);
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockBusy { watching: false }),
                (0, Event::BudgetSpent),
            ],
        );
        assert_eq!(finish(&actions[3]).0, Outcome::Stale(StaleCause::LockTimedOut));
    }

    #[test]
    fn a_stale_copy_whose_window_ended_meanwhile_is_not_served() {
        let stale = EntryMeta {
            stale_ms: Some(100),
            ..stale_meta(NOW)
        };
        let (_, actions) = run(
            FlightConfig::default(),
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockAcquired),
                (0, Event::L2Miss),
                (500, Event::LoadFailed),
            ],
        );
        assert_eq!(finish(&actions[4]).0, Outcome::LoaderFailed);
    }

    #[test]
    fn a_load_past_the_hard_timeout_is_a_timeout_or_the_stale_copy() {
        let config = FlightConfig {
            hard_timeout_ms: Some(1_000),
            ..FlightConfig::default()
        };
        let loaded = Event::Loaded {
            len: 1,
            cacheable: true,
            expiry: None,
        };
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Miss),
                (0, Event::LockAcquired),
                (0, Event::L2Miss),
                (1_000, Event::LoadTimedOut),
            ],
        );
        assert_eq!(
            actions[3],
            Action::Load {
                until_ms: Some(NOW + 1_000),
                soft_until_ms: None,
                overdue_ms: None,
                renew_at_ms: Some(NOW + 10_000)
            }
        );
        let (outcome, release, _, l1) = finish(&actions[4]);
        assert_eq!((outcome, release, l1), (Outcome::TimedOut, true, None));
        // A body that could not stop the loader reports its late answer: a timeout still.
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Miss),
                (0, Event::LockAcquired),
                (0, Event::L2Miss),
                (1_000, loaded),
            ],
        );
        assert_eq!(finish(&actions[4]).0, Outcome::TimedOut);
        // Just in time: loaded and written.
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Miss),
                (0, Event::LockAcquired),
                (0, Event::L2Miss),
                (999, loaded),
            ],
        );
        assert!(matches!(actions[4], Action::WriteL2 { .. }));
        // With a stale copy: served instead.
        let stale = stale_meta(NOW);
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockAcquired),
                (0, Event::L2Stale(stale)),
                (1_000, Event::LoadTimedOut),
            ],
        );
        assert_eq!(finish(&actions[4]).0, Outcome::Stale(StaleCause::LoadTimedOut));
    }

    #[test]
    fn a_load_whose_call_began_late_counts_its_timeouts_from_the_call() {
        let config = FlightConfig {
            soft_timeout_ms: Some(100),
            hard_timeout_ms: Some(1_000),
            ..FlightConfig::default()
        };
        let loaded = Event::Loaded {
            len: 1,
            cacheable: true,
            expiry: None,
        };
        let stale = stale_meta(NOW);
        let began_late = |last: (u64, Event)| {
            run(
                config,
                &[
                    (0, Event::L2Stale(stale)),
                    (0, Event::LockAcquired),
                    (0, Event::L2Stale(stale)),
                    (800, Event::LoadBegan),
                    last,
                ],
            )
            .1
        };
        let actions = began_late((1_500, loaded));
        assert_eq!(
            actions[4],
            Action::Load {
                until_ms: Some(NOW + 1_800),
                soft_until_ms: Some(NOW + 900),
                overdue_ms: None,
                renew_at_ms: Some(NOW + 10_000)
            },
            "re-armed from the call, the lock's renewal as it was"
        );
        assert!(
            matches!(actions[5], Action::WriteL2 { .. }),
            "past the first hard timeout, within the re-armed one: {:?}",
            actions[5]
        );
        // Past the re-armed hard timeout: a timeout (here, the stale copy).
        let actions = began_late((1_800, loaded));
        assert_eq!(finish(&actions[5]).0, Outcome::Stale(StaleCause::LoadTimedOut));
        // A soft timeout that answered already is not armed again.
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockAcquired),
                (0, Event::L2Stale(stale)),
                (100, Event::LoadSlow),
                (800, Event::LoadBegan),
            ],
        );
        assert!(matches!(actions[4], Action::AnswerStale { .. }));
        assert!(matches!(
            actions[5],
            Action::Load {
                until_ms: Some(until),
                soft_until_ms: None,
                ..
            } if until == NOW + 1_800
        ));
    }

    #[test]
    fn a_soft_timeout_answers_with_the_stale_copy_and_the_load_goes_on_to_fill_the_tiers() {
        let config = FlightConfig {
            soft_timeout_ms: Some(100),
            hard_timeout_ms: Some(5_000),
            ..FlightConfig::default()
        };
        let stale = stale_meta(NOW);
        let loaded = Event::Loaded {
            len: 1,
            cacheable: true,
            expiry: None,
        };
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockAcquired),
                (0, Event::L2Stale(stale)),
                (100, Event::LoadSlow),
                (2_000, loaded),
                (2_000, Event::L2Written),
            ],
        );
        assert_eq!(
            actions[3],
            Action::Load {
                until_ms: Some(NOW + 5_000),
                soft_until_ms: Some(NOW + 100),
                overdue_ms: None,
                renew_at_ms: Some(NOW + 10_000)
            }
        );
        assert_eq!(
            actions[4],
            Action::AnswerStale {
                l1_until_ms: Some(NOW + 100 + config.fail_safe_throttle_ms)
            }
        );
        assert!(
            matches!(actions[5], Action::WriteL2 { .. }),
            "the late value is written"
        );
        assert!(
            matches!(actions[5], Action::WriteL2 { release: true, .. }),
            "the write releases the lock"
        );
        let (outcome, release, notify, l1) = finish(&actions[6]);
        assert_eq!(outcome, Outcome::Loaded { cached: true });
        assert!(!release && !notify && l1.is_some());
        // Without a stale copy there is nothing to answer with: no soft deadline.
        let (_, actions) = run(
            config,
            &[(0, Event::L2Miss), (0, Event::LockAcquired), (0, Event::L2Miss)],
        );
        assert_eq!(
            actions[3],
            Action::Load {
                until_ms: Some(NOW + 5_000),
                soft_until_ms: None,
                overdue_ms: None,
                renew_at_ms: Some(NOW + 10_000)
            }
        );
    }

    #[test]
    fn background_completion_answers_at_the_hard_timeout_and_the_load_goes_on_to_fill_the_tiers() {
        let config = FlightConfig {
            hard_timeout_ms: Some(1_000),
            background_completion: true,
            ..FlightConfig::default()
        };
        let loaded = Event::Loaded {
            len: 1,
            cacheable: true,
            expiry: None,
        };
        // No stale copy: the callers get a timeout at the hard moment; the late value
        // (not judged a timeout: nobody waits for it) is written and fills L1.
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Miss),
                (0, Event::LockAcquired),
                (0, Event::L2Miss),
                (1_000, Event::LoadOverdue),
                (3_000, loaded),
                (3_000, Event::L2Written),
            ],
        );
        assert_eq!(
            actions[3],
            Action::Load {
                until_ms: None,
                soft_until_ms: None,
                overdue_ms: Some(NOW + 1_000),
                renew_at_ms: Some(NOW + 10_000)
            }
        );
        assert_eq!(actions[4], Action::AnswerTimedOut);
        assert!(
            matches!(actions[5], Action::WriteL2 { .. }),
            "the late value is written"
        );
        assert!(
            matches!(actions[5], Action::WriteL2 { release: true, .. }),
            "the write releases the lock"
        );
        let (outcome, release, notify, l1) = finish(&actions[6]);
        assert_eq!(outcome, Outcome::Loaded { cached: true });
        assert!(!release && !notify && l1.is_some());

        // A stale copy: served at the hard moment, re-armed in L1 for the throttle.
        let stale = stale_meta(NOW);
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockAcquired),
                (0, Event::L2Stale(stale)),
                (1_000, Event::LoadOverdue),
                (3_000, Event::LoadFailed),
            ],
        );
        assert_eq!(
            actions[4],
            Action::AnswerStale {
                l1_until_ms: Some(NOW + 1_000 + config.fail_safe_throttle_ms)
            }
        );
        // The late failure leaves the stale copy in place (fail-safe as usual).
        assert_eq!(finish(&actions[5]).0, Outcome::Stale(StaleCause::LoaderFailed));

        // Answered at the soft timeout already: the hard moment answers nobody again.
        let with_soft = FlightConfig {
            soft_timeout_ms: Some(100),
            ..config
        };
        let (_, actions) = run(
            with_soft,
            &[
                (0, Event::L2Stale(stale)),
                (0, Event::LockAcquired),
                (0, Event::L2Stale(stale)),
                (100, Event::LoadSlow),
                (1_000, Event::LoadOverdue),
                (3_000, loaded),
            ],
        );
        assert_eq!(
            actions[3],
            Action::Load {
                until_ms: None,
                soft_until_ms: Some(NOW + 100),
                overdue_ms: Some(NOW + 1_000),
                renew_at_ms: Some(NOW + 10_000)
            }
        );
        assert!(matches!(actions[4], Action::AnswerStale { .. }));
        assert_eq!(
            actions[5],
            Action::KeepLoading {
                renew_at_ms: Some(NOW + 10_000)
            }
        );
        assert!(matches!(actions[6], Action::WriteL2 { .. }));
    }

    #[test]
    fn a_refresh_stops_its_load_at_the_hard_timeout_even_with_background_completion() {
        let config = FlightConfig {
            hard_timeout_ms: Some(1_000),
            background_completion: true,
            ..refreshing(500)
        };
        let limits = Limits::default();
        let options = relative(60_000);
        let due = expiry::plan(&options, NOW - 50_000, &limits).unwrap();
        let (mut f, _) = Flight::start("k", options, config, NOW, &limits).unwrap();
        f.handle(Event::LockAcquired, NOW, &limits);
        let load = f.handle(Event::L2Hit(due), NOW, &limits);
        assert!(
            matches!(
                load,
                Action::Load {
                    until_ms: Some(_),
                    overdue_ms: None,
                    ..
                }
            ),
            "{load:?}"
        );
    }

    fn refreshing(permille: u32) -> FlightConfig {
        FlightConfig {
            eager_refresh_permille: Some(permille),
            refresh: true,
            ..FlightConfig::default()
        }
    }

    #[test]
    fn eager_refresh_falls_due_after_its_fraction_of_the_relative_freshness() {
        let options = relative(60_000);
        let meta = expiry::plan(&options, NOW, &Limits::default()).unwrap();
        assert_eq!(refresh_at(&meta, &options, Some(800)), Some(NOW + 48_000));
        assert_eq!(refresh_at(&meta, &options, None), None);
        let sliding = EntryOptions {
            sliding_ms: Some(60_000),
            ..EntryOptions::default()
        };
        let slid = expiry::plan(&sliding, NOW, &Limits::default()).unwrap();
        assert_eq!(
            refresh_at(&slid, &sliding, Some(800)),
            None,
            "a sliding entry renews itself"
        );
        // A hit says when; a bad fraction is an argument error.
        let config = FlightConfig {
            eager_refresh_permille: Some(800),
            ..FlightConfig::default()
        };
        assert_eq!(hit_refresh(config, meta).1, Some(NOW + 48_000));
        for bad in [0, 1000, 5000] {
            let config = FlightConfig {
                eager_refresh_permille: Some(bad),
                ..FlightConfig::default()
            };
            let err = Flight::start("k", options, config, NOW, &Limits::default()).unwrap_err();
            assert_eq!(err.arg, crate::Arg::EagerRefresh);
        }
    }

    /// Whether an L2 hit of `meta` under `config` starts its refresh now, and the refresh
    /// moment its finish carries.
    fn hit_refresh(config: FlightConfig, meta: EntryMeta) -> (bool, Option<u64>) {
        let (_, actions) = run(config, &[(0, Event::L2Hit(meta))]);
        match &actions[1] {
            Action::Finish {
                refresh_now,
                refresh_at_ms,
                ..
            } => (*refresh_now, *refresh_at_ms),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_hit_past_its_refresh_moment_starts_the_refresh_now_and_a_refresh_never_does() {
        let options = relative(60_000);
        let meta = expiry::plan(&options, NOW - 50_000, &Limits::default()).unwrap();
        let config = FlightConfig {
            eager_refresh_permille: Some(800),
            ..FlightConfig::default()
        };
        assert_eq!(
            hit_refresh(config, meta),
            (true, None),
            "due: now, not on a later hit"
        );
        let fresh = expiry::plan(&options, NOW, &Limits::default()).unwrap();
        assert!(!hit_refresh(config, fresh).0, "fresh: no refresh now");
    }

    #[test]
    fn a_hit_past_its_refresh_moment_for_a_caller_that_cannot_take_a_refresh_keeps_the_moment() {
        let options = relative(60_000);
        let meta = expiry::plan(&options, NOW - 50_000, &Limits::default()).unwrap();
        let config = FlightConfig {
            eager_refresh_permille: Some(800),
            starts_refresh: false,
            ..FlightConfig::default()
        };
        assert_eq!(
            hit_refresh(config, meta),
            (false, Some(NOW - 2_000)),
            "not started: left due for the next caller"
        );
    }

    #[test]
    fn every_fill_after_a_read_is_fenced_and_a_bypass_is_not() {
        let writes = |config: FlightConfig, events: &[(u64, Event)]| -> Vec<bool> {
            run(config, events)
                .1
                .into_iter()
                .filter_map(|a| match a {
                    Action::WriteL2 { fenced, .. } => Some(fenced),
                    _ => None,
                })
                .collect()
        };
        let loaded = Event::Loaded {
            len: 1,
            cacheable: true,
            expiry: None,
        };
        let read_then_load = [
            (0, Event::L2Miss),
            (0, Event::LockAcquired),
            (0, Event::L2Miss),
            (1, loaded),
        ];
        assert_eq!(writes(FlightConfig::default(), &read_then_load), [true]);
        // The double-check failed: fenced on the first read's miss.
        let failed_check = [
            (0, Event::L2Miss),
            (0, Event::LockAcquired),
            (0, Event::L2Failed),
            (1, loaded),
        ];
        assert_eq!(writes(FlightConfig::default(), &failed_check), [true]);
        let bypass = FlightConfig {
            bypass: true,
            ..FlightConfig::default()
        };
        assert_eq!(
            writes(bypass, &[(1, loaded)]),
            [false],
            "nothing read, nothing to fence on"
        );
    }

    #[test]
    fn a_refresh_takes_the_lock_without_waiting_and_a_failure_leaves_the_value() {
        let limits = Limits::default();
        let options = relative(60_000);
        let due = expiry::plan(&options, NOW - 50_000, &limits).unwrap();
        // Held elsewhere: another process refreshes; nothing to do.
        let (mut f, first) = Flight::start("k", options, refreshing(800), NOW, &limits).unwrap();
        assert!(matches!(first, Action::TryLock { .. }));
        let a = f.handle(Event::LockBusy { watching: true }, NOW, &limits);
        assert_eq!(finish(&a), (Outcome::Skipped, false, false, None));
        // Ours, still due: load; a failed load changes nothing but the lock.
        let (mut f, _) = Flight::start("k", options, refreshing(800), NOW, &limits).unwrap();
        f.handle(Event::LockAcquired, NOW, &limits);
        let a = f.handle(Event::L2Hit(due), NOW, &limits);
        assert!(matches!(a, Action::Load { .. }));
        let a = f.handle(Event::LoadFailed, NOW, &limits);
        assert_eq!(finish(&a), (Outcome::LoaderFailed, true, true, None));
        // Ours, but someone refreshed meanwhile: not due any more, nothing loaded.
        let fresh = expiry::plan(&options, NOW, &limits).unwrap();
        let (mut f, _) = Flight::start("k", options, refreshing(800), NOW, &limits).unwrap();
        f.handle(Event::LockAcquired, NOW, &limits);
        let a = f.handle(Event::L2Hit(fresh), NOW, &limits);
        assert_eq!(finish(&a).0, Outcome::L2Hit { after_wait: false });
    }

    #[test]
    fn backoff_doubles_from_50_ms_to_at_most_1_s() {
        let waits: Vec<u64> = (0..8).map(backoff_ms).collect();
        assert_eq!(waits, [50, 100, 200, 400, 800, 1000, 1000, 1000]);
        assert_eq!(backoff_ms(u32::MAX), 1000);
    }

    #[test]
    fn l1_never_outlives_l2_nor_its_own_ttl() {
        let meta = EntryMeta {
            absolute_ms: Some(NOW + 10_000),
            sliding_ms: None,
            expires_at_ms: NOW + 10_000,
            stale_ms: None,
        };
        assert_eq!(l1_deadline(&meta, NOW, 300_000), NOW + 10_000);
        assert_eq!(l1_deadline(&meta, NOW, 2_000), NOW + 2_000);
        let sliding = EntryMeta {
            absolute_ms: None,
            sliding_ms: Some(60_000),
            expires_at_ms: NOW + 60_000,
            stale_ms: None,
        };
        assert_eq!(
            l1_deadline(&sliding, NOW, 300_000),
            NOW + 30_000,
            "half the sliding interval"
        );
    }

    #[test]
    fn an_l1_copy_lives_no_longer_than_what_judged_it_is_known() {
        // Its own deadline, when the generation and its tags are known longer.
        assert_eq!(l1_copy_until(NOW + 100, true, NOW + 200, u64::MAX), NOW + 100);
        // Read late in the generation's window: no longer than that window.
        assert_eq!(l1_copy_until(NOW + 100, true, NOW + 30, u64::MAX), NOW + 30);
        // Loaded or written here: newer than any clear missed; its deadline stands.
        assert_eq!(l1_copy_until(NOW + 100, false, NOW + 30, u64::MAX), NOW + 100);
        assert_eq!(l1_copy_until(NOW + 100, false, 0, u64::MAX), NOW + 100);
        // Tagged: no longer than the first of its tags' moments to lapse, either way.
        assert_eq!(l1_copy_until(NOW + 100, true, NOW + 200, NOW + 50), NOW + 50);
        assert_eq!(l1_copy_until(NOW + 100, false, NOW + 200, NOW + 50), NOW + 50);
        assert_eq!(l1_copy_until(u64::MAX, true, u64::MAX, u64::MAX), u64::MAX);
        // What each outcome's copy is.
        assert!(Outcome::L2Hit { after_wait: true }.read_from_store());
        assert!(Outcome::Stale(StaleCause::StoreFailed).read_from_store());
        assert!(!Outcome::Loaded { cached: true }.read_from_store());
        assert!(!Outcome::Degraded { timed_out: false }.read_from_store());
    }

    #[test]
    fn a_bad_key_or_bad_options_fail_before_anything_runs() {
        let l = Limits::default();
        assert!(Flight::start(" ", EntryOptions::default(), FlightConfig::default(), NOW, &l).is_err());
        let bad = EntryOptions {
            relative_ms: Some(0),
            ..Default::default()
        };
        assert_eq!(
            Flight::start("k", bad, FlightConfig::default(), NOW, &l)
                .unwrap_err()
                .arg,
            crate::Arg::Relative
        );
    }

    #[test]
    fn an_l2_hit_fills_l1_and_takes_no_lock() {
        let mut w = World::new();
        w.l2 = Some(EntryMeta {
            absolute_ms: Some(NOW + 60_000),
            sliding_ms: None,
            expires_at_ms: NOW + 60_000,
            stale_ms: None,
        });
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(
            finish(&a),
            (
                Outcome::L2Hit { after_wait: false },
                false,
                false,
                Some(NOW + 60_000)
            )
        );
        assert_eq!(w.loads, 0);
        assert_eq!(w.trace, ["ReadL2", "Finish"]);
    }

    #[test]
    fn a_leader_double_checks_loads_once_writes_l2_then_l1_and_releases() {
        let mut w = World::new();
        let (a, f) = w.drive(relative(60_000), FlightConfig::default());
        let (outcome, release, notify, l1) = finish(&a);
        // The write released the lock and announced the landing.
        assert_eq!(
            (outcome, release, notify),
            (Outcome::Loaded { cached: true }, false, false)
        );
        assert_eq!(w.loads, 1);
        assert_eq!(
            w.trace,
            ["ReadL2", "TryLock", "ReadL2", "Load", "WriteL2", "Finish"]
        );
        assert_eq!(w.lock_holder, None);
        let planned = f.planned.unwrap();
        assert_eq!(
            planned.expires_at_ms,
            NOW + 500 + 60_000,
            "planned when the value arrived"
        );
        assert_eq!(l1, Some(planned.expires_at_ms));
    }

    #[test]
    fn a_load_that_outlives_its_lock_fills_nothing() {
        let config = FlightConfig::default();
        let loaded = Event::Loaded {
            len: 1,
            cacheable: true,
            expiry: None,
        };
        // The lock's TTL counts from before its try was sent (here, 10 ms before it
        // was taken): a load ending within it writes, releasing the lock with the write.
        let within = config.lock_ttl_ms - 1;
        let (_, actions) = run(
            config,
            &[
                (0, Event::L2Miss),
                (10, Event::LockAcquired),
                (10, Event::L2Miss),
                (within, loaded),
            ],
        );
        assert!(matches!(
            actions[4],
            Action::WriteL2 {
                fenced: true,
                release: true,
                ..
            }
        ));
        // At the TTL the lock may have lapsed (another process may hold it, and a
        // removal may have outlived its tombstone): nothing is written; the lock is
        // released (owner-checked) and the waiters woken.
        for late in [config.lock_ttl_ms, config.lock_ttl_ms + 60_000] {
            let (_, actions) = run(
                config,
                &[
                    (0, Event::L2Miss),
                    (10, Event::LockAcquired),
                    (10, Event::L2Miss),
                    (late, loaded),
                ],
            );
            assert_eq!(
                finish(&actions[4]),
                (Outcome::Lapsed, true, true, None),
                "a load ending {late} ms after its lock try"
            );
        }
    }

    #[test]
    fn a_lock_renewed_while_the_loader_runs_lets_a_slow_load_fill() {
        let config = FlightConfig::default();
        let ttl = config.lock_ttl_ms;
        let third = ttl / 3;
        let loaded = Event::Loaded {
            len: 5,
            cacheable: true,
            expiry: None,
        };
        // Taken at 0 (its try sent then): due a third of the TTL on. Each renewal counts
        // from when it was sent, and the next falls a third of the TTL after that.
        let (f, actions) = run(
            config,
            &[
                (0, Event::L2Miss),
                (0, Event::LockAcquired),
                (0, Event::L2Miss),
                (third, Event::RenewDue),
                (third + 20, Event::Renewed),
                (2 * third, Event::RenewDue),
                (2 * third + 5, Event::Renewed),
                (2 * ttl, loaded),
            ],
        );
        assert!(matches!(actions[3], Action::Load { renew_at_ms: Some(at), .. } if at == NOW + third));
        assert_eq!(
            actions[4],
            Action::RenewLock {
                ttl_ms: ttl,
                fenced: true
            }
        );
        assert_eq!(
            actions[5],
            Action::KeepLoading {
                renew_at_ms: Some(NOW + 2 * third)
            }
        );
        assert_eq!(
            actions[7],
            Action::KeepLoading {
                renew_at_ms: Some(NOW + 3 * third)
            }
        );
        // Still held at 2 x TTL? No: the last renewal, sent at 2/3 TTL, holds to 5/3 TTL.
        assert_eq!(finish(&actions[8]).0, Outcome::Lapsed);
        assert_eq!(f.lock_until_ms, Some(NOW + 2 * third + ttl));
        // Kept renewing, the load fills however long it ran.
        let mut events = vec![(0, Event::L2Miss), (0, Event::LockAcquired), (0, Event::L2Miss)];
        for n in 1..=9 {
            events.push((n * third, Event::RenewDue));
            events.push((n * third + 1, Event::Renewed));
        }
        events.push((3 * ttl + 1, loaded));
        let (_, actions) = run(config, &events);
        // Renewals keep it for ten TTLs from the flight's start at most: a hung loader
        // lets another process lead then.
        let mut events = vec![(0, Event::L2Miss), (0, Event::LockAcquired), (0, Event::L2Miss)];
        for n in 1..=29 {
            events.push((n * third, Event::RenewDue));
            events.push((n * third, Event::Renewed));
        }
        let (_, capped) = run(config, &events);
        let kept = |n: usize| capped[3 + 2 * n].clone();
        assert_eq!(
            kept(28),
            Action::KeepLoading {
                renew_at_ms: Some(NOW + 29 * third)
            }
        );
        assert_eq!(kept(29), Action::KeepLoading { renew_at_ms: None });
        assert_eq!(RENEWED_HOLD_MAX_TTLS * ttl, 30 * third);
        assert!(matches!(
            actions.last(),
            Some(Action::WriteL2 {
                fenced: true,
                release: true,
                ..
            })
        ));
    }

    #[test]
    fn a_refused_renewal_ends_the_lock_and_a_failed_one_is_tried_again_while_it_holds() {
        let config = FlightConfig::default();
        let ttl = config.lock_ttl_ms;
        let third = ttl / 3;
        let loaded = Event::Loaded {
            len: 5,
            cacheable: true,
            expiry: None,
        };
        let start = [(0, Event::L2Miss), (0, Event::LockAcquired), (0, Event::L2Miss)];
        // Refused (the lock was taken over): no more renewals, and even a load ending
        // well within the first TTL fills nothing.
        let mut events = start.to_vec();
        events.extend([
            (third, Event::RenewDue),
            (third + 1, Event::RenewRefused),
            (third + 2, loaded),
        ]);
        let (_, actions) = run(config, &events);
        assert_eq!(actions[5], Action::KeepLoading { renew_at_ms: None });
        assert_eq!(finish(&actions[6]), (Outcome::Lapsed, true, true, None));
        // Failed (the store did not answer): tried again a third on, or halfway to the
        // lock's end if that is sooner, never at or past it.
        let mut events = start.to_vec();
        events.extend([
            (third, Event::RenewDue),
            (third + 7, Event::RenewFailed),
            (2 * third + 3, Event::RenewDue),
            (2 * third + 5, Event::RenewFailed),
        ]);
        let (f, actions) = run(config, &events);
        let halfway = |from: u64| from + (ttl - from) / 2;
        assert_eq!(
            actions[5],
            Action::KeepLoading {
                renew_at_ms: Some(NOW + halfway(third + 7))
            }
        );
        assert_eq!(
            actions[7],
            Action::KeepLoading {
                renew_at_ms: Some(NOW + halfway(2 * third + 5))
            }
        );
        assert_eq!(f.lock_until_ms, Some(NOW + ttl));
        let mut events = start.to_vec();
        events.extend([(ttl - 1, Event::RenewDue), (ttl - 1, Event::RenewFailed)]);
        let (_, actions) = run(config, &events);
        assert_eq!(
            actions[5],
            Action::KeepLoading { renew_at_ms: None },
            "at the lock's end"
        );
        // Out of turn (nothing sent, no lock): the load just goes on.
        let (_, actions) = run(
            config,
            &[(0, Event::L2Miss), (0, Event::LockFailed), (5, Event::Renewed)],
        );
        assert_eq!(
            actions[2],
            Action::Load {
                until_ms: None,
                soft_until_ms: None,
                overdue_ms: None,
                renew_at_ms: None
            }
        );
        assert_eq!(actions[3], Action::KeepLoading { renew_at_ms: None });
        let (_, actions) = run(
            config,
            &[(0, Event::L2Miss), (0, Event::LockFailed), (5, Event::RenewDue)],
        );
        assert_eq!(actions[3], Action::KeepLoading { renew_at_ms: None });
    }

    #[test]
    fn the_double_check_finds_a_value_that_landed_meanwhile() {
        // Between our first read and our lock, someone else's load landed.
        let limits = Limits::default();
        let (mut f, a) = Flight::start("k", relative(1_000), FlightConfig::default(), NOW, &limits).unwrap();
        assert_eq!(a, Action::ReadL2);
        assert!(matches!(
            f.handle(Event::L2Miss, NOW, &limits),
            Action::TryLock { .. }
        ));
        assert_eq!(f.handle(Event::LockAcquired, NOW, &limits), Action::ReadL2);
        let meta = EntryMeta {
            absolute_ms: None,
            sliding_ms: Some(10_000),
            expires_at_ms: NOW + 10_000,
            stale_ms: None,
        };
        let (outcome, release, _, l1) = finish(&f.handle(Event::L2Hit(meta), NOW, &limits));
        assert_eq!(
            (outcome, release, l1),
            (Outcome::L2Hit { after_wait: false }, true, Some(NOW + 5_000))
        );
        assert_eq!(f.phase, Phase::Done);
    }

    #[test]
    fn a_follower_is_woken_when_the_value_lands_and_never_loads() {
        let mut w = World::new();
        w.lock_holder = Some("other");
        w.lands_at = Some(NOW + 30);
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(finish(&a).0, Outcome::L2Hit { after_wait: true });
        assert_eq!(w.loads, 0);
        assert_eq!(w.now, NOW + 30, "woken by the landing, not by the 50 ms timer");
        assert_eq!(w.trace, ["ReadL2", "TryLock", "Wait", "ReadL2", "Finish"]);
    }

    #[test]
    fn a_follower_backs_off_exponentially_then_degrades_at_the_deadline() {
        let mut w = World::new();
        w.lock_holder = Some("stuck");
        let config = FlightConfig {
            lock_wait_ms: 5_000,
            ..Default::default()
        };
        let (a, f) = w.drive(relative(60_000), config);
        assert_eq!(
            finish(&a),
            (
                Outcome::Degraded { timed_out: true },
                false,
                false,
                Some(w.now + 1_000)
            ),
            "kept in L1 for the degraded second, never in L2"
        );
        assert_eq!(w.loads, 1, "the caller still gets a value");
        assert_eq!(
            w.lock_holder,
            Some("stuck"),
            "never releases a lock it does not hold"
        );
        assert_eq!(w.l2, None, "a degraded load is not cached");
        // 50+100+200+400+800+1000+1000+1000+450 = 5000: the deadline, not a minute later.
        assert_eq!(w.now, NOW + 5_000 + 500);
        assert_eq!(f.attempt, 9);
    }

    #[test]
    fn a_watching_follower_waits_for_the_landing_with_a_long_safety_timer() {
        let mut w = World::new();
        w.watching = true;
        w.lock_holder = Some("other");
        w.lands_at = Some(NOW + 700);
        let (a, f) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(finish(&a).0, Outcome::L2Hit { after_wait: true });
        assert_eq!(
            w.trace,
            ["ReadL2", "TryLock", "Wait", "ReadL2", "Finish"],
            "one look, no polling"
        );
        assert_eq!((w.now, f.attempt), (NOW + 700, 1));
    }

    #[test]
    fn a_watching_follower_still_polls_once_a_second_if_no_landing_comes() {
        let mut w = World::new();
        w.watching = true;
        w.lock_holder = Some("stuck");
        let (a, f) = w.drive(
            relative(60_000),
            FlightConfig {
                lock_wait_ms: 3_000,
                ..Default::default()
            },
        );
        assert_eq!(finish(&a).0, Outcome::Degraded { timed_out: true });
        assert_eq!(f.attempt, 3, "1 s, 1 s, 1 s: the safety timer");
    }

    #[test]
    fn a_release_without_a_value_still_wakes_the_waiters() {
        let mut w = World::new();
        w.loader = Err(());
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        let (_, release, notify, _) = finish(&a);
        assert!(release && notify, "so they can take the lock over at once");
    }

    #[test]
    fn a_holder_that_dies_lets_a_follower_take_over() {
        let mut w = World::new();
        w.lock_holder = Some("other");
        let limits = Limits::default();
        let (mut f, _) = Flight::start("k", relative(1_000), FlightConfig::default(), NOW, &limits).unwrap();
        f.handle(Event::L2Miss, NOW, &limits);
        assert!(
            matches!(f.handle(Event::LockBusy { watching: false }, NOW, &limits), Action::Wait { until_ms } if until_ms == NOW + 50)
        );
        assert_eq!(f.handle(Event::Woken, NOW + 50, &limits), Action::ReadL2);
        assert!(matches!(
            f.handle(Event::L2Miss, NOW + 50, &limits),
            Action::TryLock { .. }
        ));
        assert_eq!(
            f.handle(Event::LockAcquired, NOW + 50, &limits),
            Action::ReadL2,
            "double-check as leader"
        );
        assert_eq!(
            f.handle(Event::L2Miss, NOW + 50, &limits),
            Action::Load {
                until_ms: None,
                soft_until_ms: None,
                overdue_ms: None,
                renew_at_ms: Some(NOW + 10_050)
            }
        );
    }

    #[test]
    fn redis_down_degrades_at_once_to_an_uncached_load() {
        let mut w = World::new();
        w.redis_up = false;
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(
            finish(&a),
            (
                Outcome::Degraded { timed_out: false },
                false,
                false,
                Some(NOW + 1_500)
            )
        );
        assert_eq!((w.loads, w.now), (1, NOW + 500), "no waiting on a dead store");
        assert_eq!(w.l2, None, "not cached in L2");
        // Off: not even L1.
        let mut w = World::new();
        w.redis_up = false;
        let off = FlightConfig {
            degraded_l1_ttl_ms: 0,
            ..Default::default()
        };
        let (a, _) = w.drive(relative(60_000), off);
        assert_eq!(finish(&a).3, None);
        // Never past the entry's own expiry.
        let mut w = World::new();
        w.redis_up = false;
        let (a, _) = w.drive(relative(300), FlightConfig::default());
        assert_eq!(finish(&a).3, Some(NOW + 500 + 300));
    }

    #[test]
    fn a_lock_that_cannot_be_tried_degrades() {
        let limits = Limits::default();
        let (mut f, _) = Flight::start("k", relative(1_000), FlightConfig::default(), NOW, &limits).unwrap();
        f.handle(Event::L2Miss, NOW, &limits);
        assert_eq!(
            f.handle(Event::LockFailed, NOW, &limits),
            Action::Load {
                until_ms: None,
                soft_until_ms: None,
                overdue_ms: None,
                renew_at_ms: None
            }
        );
        assert_eq!(
            finish(&f.handle(
                Event::Loaded {
                    len: 1,
                    cacheable: true,
                    expiry: None,
                },
                NOW,
                &limits
            ))
            .0,
            Outcome::Degraded { timed_out: false }
        );
    }

    #[test]
    fn a_loader_error_is_not_cached_and_the_lock_is_released() {
        let mut w = World::new();
        w.loader = Err(());
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(finish(&a), (Outcome::LoaderFailed, true, true, None));
        assert_eq!((w.l2, w.lock_holder), (None, None));
    }

    #[test]
    fn a_value_should_cache_rejects_is_returned_but_written_nowhere() {
        let mut w = World::new();
        w.cacheable = false;
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(finish(&a), (Outcome::Loaded { cached: false }, true, true, None));
        assert_eq!(w.l2, None);
    }

    #[test]
    fn a_failed_l2_write_leaves_l1_alone() {
        let mut w = World::new();
        w.l2_write_ok = false;
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(
            finish(&a),
            (Outcome::Loaded { cached: false }, false, false, None)
        );
        assert_eq!(w.lock_holder, None, "the write released the lock all the same");
    }

    #[test]
    fn a_value_too_large_to_cache_is_still_returned() {
        let mut w = World::new();
        w.loader = Ok(u64::from(Limits::default().max_value_bytes) + 1);
        let (a, _) = w.drive(relative(60_000), FlightConfig::default());
        assert_eq!(finish(&a).0, Outcome::Loaded { cached: false });
        assert_eq!(w.l2, None);
    }

    #[test]
    fn bypass_loads_without_locks_and_writes_both_tiers() {
        let mut w = World::new();
        w.l2 = Some(EntryMeta {
            absolute_ms: None,
            sliding_ms: Some(1_000),
            expires_at_ms: NOW + 1_000,
            stale_ms: None,
        });
        w.lock_holder = Some("other");
        let (a, _) = w.drive(
            relative(60_000),
            FlightConfig {
                bypass: true,
                ..Default::default()
            },
        );
        let (outcome, release, notify, l1) = finish(&a);
        assert_eq!(
            (outcome, release, notify),
            (Outcome::Loaded { cached: true }, false, true)
        );
        assert!(l1.is_some());
        assert_eq!(w.trace, ["Load", "WriteL2", "Finish"]);
        assert_eq!(w.lock_holder, Some("other"));
    }

    #[test]
    fn an_abandoned_flight_owes_a_release_only_while_it_holds_the_lock() {
        let limits = Limits::default();
        let (mut f, _) = Flight::start("k", relative(1_000), FlightConfig::default(), NOW, &limits).unwrap();
        assert!(!f.clone().abandon(), "reading: no lock yet");
        f.handle(Event::L2Miss, NOW, &limits);
        f.handle(Event::LockAcquired, NOW, &limits);
        f.handle(Event::L2Miss, NOW, &limits);
        assert_eq!(f.phase, Phase::Loading);
        assert!(f.abandon(), "dropped mid-load while holding the lock");
        assert!(!f.abandon(), "exactly once");
    }

    #[test]
    fn out_of_order_events_never_panic_and_end_in_a_load() {
        let limits = Limits::default();
        let (mut f, _) = Flight::start("k", relative(1_000), FlightConfig::default(), NOW, &limits).unwrap();
        assert_eq!(
            f.handle(Event::L2Written, NOW, &limits),
            Action::Load {
                until_ms: None,
                soft_until_ms: None,
                overdue_ms: None,
                renew_at_ms: None
            }
        );
        let mut done = f;
        done.phase = Phase::Done;
        assert!(matches!(
            done.handle(Event::Woken, NOW, &limits),
            Action::Finish { release: false, .. }
        ));
    }

    #[test]
    fn the_store_budget_shares_the_lock_wait_before_the_load_and_a_store_timeout_after() {
        let b = StoreBudget::new(5_000, 1_000);
        assert_eq!(
            (
                b.before_load_ms,
                b.refresh_before_load_ms,
                b.after_load_ms,
                b.release_ms
            ),
            (5_000, 1_000, 1_000, 1_000)
        );
        // A refresh never waits for the lock: one store timeout before its load.
        let refresh = FlightConfig {
            refresh: true,
            ..crate::Settings::DEFAULT.flight(false)
        };
        assert_eq!(b.before_load_of(&refresh), 1_000);
        assert_eq!(b.before_load_of(&crate::Settings::DEFAULT.flight(false)), 5_000);
        // A lock wait shorter than one store step still lets one step run.
        assert_eq!(StoreBudget::new(0, 1_000).before_load_ms, 1_000);
        assert_eq!(StoreBudget::new(u64::MAX, u64::MAX).before_load_ms, u64::MAX);
        // A tag read: one store timeout, within what is left, and half the time to the
        // load's first timeout.
        assert_eq!(b.tag_read_ms(5_000, None), 1_000);
        assert_eq!(b.tag_read_ms(300, None), 300);
        assert_eq!(b.tag_read_ms(5_000, Some(600)), 300);
        assert_eq!(b.tag_read_ms(5_000, Some(u64::MAX)), 1_000);
    }
}
