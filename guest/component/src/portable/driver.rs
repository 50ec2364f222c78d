//! The portable body of one get-or-set flight, the component's twin of the host's
//! `Driver` (host/src/cache/flight/driver.rs): it performs the action the flight machine
//! asks for over the imports, one short function per action, and feeds back what
//! happened. It decides nothing the contract governs: what to fence, what L1 keeps and
//! until when, whether a refresh is due, all come with the actions. What it keeps are
//! registers, the bytes the actions brought.
//!
//! The load is the caller's: the driver stops at the machine's `load` action
//! ([`Step::Load`]) and goes on when the caller ends the load ([`Driver::loaded`],
//! [`Driver::failed`]), in a later call of the instance (`cache.begin`, then the end of
//! its `load` resource).

use corral_core::flight::{self, Action, Event, Flight, Outcome};
use corral_core::tags::{Tagged, Verdict};
use corral_core::{Limits, envelope, names, policy};

use super::{
    Found, StoredRead, UNBOUNDED, generation_known_until, judge, judge_read, l2_read_holding, now_ms,
    settings, tagged_out, ticket_since, written_at,
};
use crate::bindings::corral::cache::{flights, l1, l2, types};

/// Where a flight's run stopped.
pub(super) enum Step {
    /// At the load: the caller loads the value and ends the load.
    Load,
    /// At its end: what the caller gets.
    Done(Result<Vec<u8>, types::Error>),
    /// At a wait for another process's landing, which a batch's flight does not wait
    /// out ([`Driver::park_at_wait`]).
    Parked,
}

/// One flight in progress over the imports: the machine, the performer of its actions,
/// and its registers.
pub(super) struct Driver {
    flight: Flight,
    key: String,
    names: names::Names,
    limits: Limits,
    /// The tags a loaded value is written with.
    tag_list: Vec<String>,
    /// The value of the last L2 hit, or the loaded value.
    value: Vec<u8>,
    /// The tags of what L1 is filled with: those the L2 hit carried, or the load's own,
    /// and until when they are known.
    tagged: Option<Tagged>,
    tags_until: u64,
    /// When the loaded entry counts as written: when the load began, after every
    /// invalidation of its tags the store held then (a load that began before an
    /// invalidation is older than it; one that began after is newer, contract §7.5).
    written_at: u64,
    /// The stale copy the last read found (fail-safe).
    stale: Vec<u8>,
    /// This process's writes of the key as of the names, and as of the last L2 step:
    /// L1 is filled only if none came since (contract §5.12).
    named: l1::L1Ticket,
    l1_ticket: l1::L1Ticket,
    /// The flight lock's owner token, while this flight holds it.
    owner: Option<String>,
    /// The write was asked to release the lock and announce the landing, and the host
    /// could not in the write's own step (`l2.fill-releasing`), or that step failed:
    /// done at the finish, after the followers got the outcome.
    release_owed: bool,
    loader_error: String,
    /// What the key held after the last successful read: a fenced fill writes only over
    /// it (contract §5.12).
    holds: Option<Vec<u8>>,
    /// The value served is due for its eager refresh (the machine said so at the end).
    refresh_due: bool,
    /// It leads the process's flight of the key: its followers get the outcome as soon
    /// as it is known (`flights.finish`).
    leads: bool,
    /// The key's data could not be named (the prefix's generation unknown and unread):
    /// every store step fails, and the flight degrades (contract §5.8).
    unnamed: bool,
    /// What the flight's first L2 read brought, when a batch made it with its other
    /// keys' (`l2.get-many`), and the key's L1 ticket taken before it: taken by that
    /// read instead of a read of its own.
    first_read: Option<(StoredRead, l1::L1Ticket)>,
    /// Stop at the first wait for a landing instead of waiting ([`Step::Parked`]).
    park: bool,
    /// Its steps before the load run within a bound its batch armed for it and its
    /// other flights together (`l2.bound`), not one of its own.
    bounded: bool,
    /// When the bound of its own steps before the load ends (unbounded: `u64::MAX`).
    before_load_until: u64,
    /// While the caller loads: the load's hard and soft timeouts, each until it is
    /// reported ([`Driver::overdue`]).
    hard_at: Option<u64>,
    soft_at: Option<u64>,
    /// The machine had the callers answered with the stale copy (`stale`) at the soft
    /// timeout, while the load goes on.
    answered: bool,
}

impl Driver {
    /// `named`: the key's ticket taken before `names` were.
    pub(super) fn new(
        flight: Flight,
        key: String,
        names: names::Names,
        named: l1::L1Ticket,
        limits: Limits,
        tag_list: Vec<String>,
    ) -> Self {
        Driver {
            flight,
            named,
            l1_ticket: named,
            key,
            names,
            limits,
            tag_list,
            value: Vec::new(),
            tagged: None,
            tags_until: u64::MAX,
            written_at: 0,
            stale: Vec::new(),
            owner: None,
            release_owed: false,
            loader_error: String::new(),
            holds: None,
            refresh_due: false,
            leads: false,
            unnamed: false,
            first_read: None,
            park: false,
            bounded: false,
            before_load_until: u64::MAX,
            hard_at: None,
            soft_at: None,
            answered: false,
        }
    }

    /// The flight stops at its first wait for another process's landing instead of
    /// waiting ([`Step::Parked`]): a batch's flight, whose batch holds other keys'
    /// flight locks until its loads end (waiting with them held could wait on a batch
    /// that waits on this one).
    pub(super) fn park_at_wait(&mut self) {
        self.park = true;
    }

    /// Its steps before the load run within the bound its batch armed already (the
    /// refreshes of a batch's hits: one store timeout for them all), not one of its own;
    /// that bound ends at `until` (the cache's clock).
    pub(super) fn within_batch_bound(&mut self, until: u64) {
        self.bounded = true;
        self.before_load_until = until;
    }

    /// The flight's first L2 read was made already, with a batch's other keys: `read`,
    /// the key's ticket (as [`ticket_since`] gives it) taken before it.
    pub(super) fn first_read(&mut self, read: StoredRead, ticket: l1::L1Ticket) {
        self.first_read = Some((read, ticket));
    }

    /// The key's ticket for a fill of what an L2 read brings, taken before that read.
    pub(super) fn read_ticket(&self) -> l1::L1Ticket {
        ticket_since(&self.key, self.named)
    }

    /// The key's data could not be named: the flight's store steps all fail.
    pub(super) fn unnamed(&mut self) {
        self.unnamed = true;
    }

    /// The flight leads the process's flight of the key (joined as its leader).
    pub(super) fn lead(&mut self) {
        self.leads = true;
    }

    /// Whether the machine ended the flight asking for an eager refresh now.
    pub(super) fn refresh_due(&self) -> bool {
        self.refresh_due
    }

    /// The key of the flight.
    pub(super) fn key(&self) -> &str {
        &self.key
    }

    /// Runs the flight from its first action to its load or its end.
    pub(super) fn start(&mut self, action: Action) -> Step {
        // The store steps of each phase share a deadline (contract §5.13).
        if !self.bounded {
            let ms = settings().store_budget().before_load_of(&self.flight.config);
            self.before_load_until = now_ms().saturating_add(ms);
            l2::bound(ms);
        }
        self.run(action)
    }

    /// Whether the key's data could be named (else every store step fails).
    pub(super) fn named(&self) -> bool {
        !self.unnamed
    }

    /// The name of the key's entry in L2.
    pub(super) fn entry_name(&self) -> &str {
        &self.names.entry
    }

    /// The caller's load brought `value`, which it judged `cacheable` or not: the flight
    /// goes on to its end.
    pub(super) fn loaded(&mut self, value: Vec<u8>, cacheable: bool) -> Step {
        let len = value.len() as u64;
        self.value = value;
        self.resume(Event::Loaded {
            len,
            cacheable,
            expiry: None,
        })
    }

    /// The caller's origin call for the load begins now, later than the load was
    /// handed out: the machine re-arms the load's timeouts from now (`load-began`),
    /// and the load goes on.
    pub(super) fn began(&mut self) {
        match self.flight.handle(Event::LoadBegan, now_ms(), &self.limits) {
            // The load again, its timeouts re-armed; its tagged write moment stays when
            // the load was handed out, as in the native body.
            Action::Load {
                until_ms,
                soft_until_ms,
                ..
            } => {
                self.hard_at = until_ms;
                self.soft_at = soft_until_ms;
            }
            // Never the machine's answer to a load's start.
            other => {
                let _step = self.run(other);
            }
        }
    }

    /// The caller's load failed with `reason`: the flight goes on to its end.
    pub(super) fn failed(&mut self, reason: String) -> Step {
        self.loader_error = reason;
        self.resume(Event::LoadFailed)
    }

    /// While the caller loads, a timeout of the load that is due and not yet reported:
    /// reported now (contract §7.2), as the native body's timers report it while its
    /// loader runs. The hard timeout ends the flight (the stale copy, else a timeout,
    /// for every caller; the caller's late value is judged the same); the soft timeout
    /// may have the callers answered with the stale copy ([`Driver::answered`]) while
    /// the load goes on. `None`: nothing due.
    pub(super) fn overdue(&mut self) -> Option<Step> {
        let now = now_ms();
        if self.hard_at.is_some_and(|at| now >= at) {
            return Some(self.resume(Event::LoadTimedOut));
        }
        if self.soft_at.is_some_and(|at| now >= at) {
            self.soft_at = None;
            return Some(self.resume(Event::LoadSlow));
        }
        None
    }

    /// The stale copy the callers were answered with at the soft timeout, if they were.
    pub(super) fn answered(&self) -> Option<&[u8]> {
        self.answered.then_some(self.stale.as_slice())
    }

    /// The caller dropped the load: the flight lock goes (owner-checked, announced, so
    /// the next leader need not wait out its TTL), and the process's flight of the key
    /// to one of its followers (contract §5.11).
    pub(super) fn abandon(&mut self) {
        let holds_lock = self.flight.abandon();
        l2::bound(settings().store_budget().release_ms);
        self.release_and_announce(holds_lock, holds_lock);
        if self.leads {
            flights::abandon(&self.key);
        }
    }

    fn resume(&mut self, event: Event) -> Step {
        if !matches!(event, Event::LoadSlow) {
            self.hard_at = None;
            self.soft_at = None;
        }
        l2::bound(settings().store_budget().after_load_ms);
        let action = self.flight.handle(event, now_ms(), &self.limits);
        self.run(action)
    }

    /// The load handed out to the caller, its timeouts (`until_ms`, `soft_until_ms`,
    /// `overdue_ms`) armed. A tagged load reads its tags' moments first, within what the
    /// native body gives that read: one store timeout, the rest of the steps before the
    /// load, and half the time to the load's first timeout, which counts from the load
    /// (contract §7.2): the caller's loader keeps the other half. The rest of the steps
    /// is reckoned by the cache's clock (this body has no other): only a tighter bound
    /// than the one armed is armed, so a clock stepped forward leaves the armed one in
    /// place. A shared bound (refreshes) is armed again for the steps after the read.
    fn hand_out_load(
        &mut self,
        until_ms: Option<u64>,
        soft_until_ms: Option<u64>,
        overdue_ms: Option<u64>,
    ) -> Step {
        let now = now_ms();
        let left = self.before_load_until.saturating_sub(now);
        let first_mark = [soft_until_ms, overdue_ms, until_ms].into_iter().flatten().min();
        let read_ms = settings()
            .store_budget()
            .tag_read_ms(left, first_mark.map(|mark| mark.saturating_sub(now)));
        let tighter = !self.tag_list.is_empty() && read_ms < left;
        if tighter {
            l2::bound(read_ms);
        }
        // A key with a bad tag was refused before its flight began.
        self.written_at = written_at(&self.tag_list, now).unwrap_or(now);
        if tighter && self.bounded {
            l2::bound(self.before_load_until.saturating_sub(now_ms()));
        }
        self.hard_at = until_ms;
        self.soft_at = soft_until_ms;
        Step::Load
    }

    fn run(&mut self, mut action: Action) -> Step {
        loop {
            let event = match action {
                Action::ReadL2 => self.read_l2(),
                Action::TryLock { ttl_ms } => self.try_lock(ttl_ms),
                // A parked flight is abandoned: it never goes on from here.
                Action::Wait { .. } if self.park => return Step::Parked,
                Action::Wait { until_ms } => match l2::wait_landing(&self.key, until_ms) {
                    true => Event::BudgetSpent,
                    false => Event::Woken,
                },
                // At the soft timeout: the callers get the stale copy, the load goes on.
                Action::AnswerStale { l1_until_ms } => {
                    self.answered = true;
                    if let Some(until_ms) = l1_until_ms {
                        self.fill_l1(&self.stale, until_ms, None, true, true);
                    }
                    return Step::Load;
                }
                Action::KeepLoading { .. } => return Step::Load,
                // The caller's load cannot be stopped from here: it ends when the caller
                // ends it, or at its hard timeout when a follower finds it due
                // ([`Driver::overdue`]); the machine judges an end past the hard timeout
                // a timeout all the same. It never reports `load-overdue` or `renew-due`
                // (this body's settings never ask for background completion, and it
                // cannot act while the caller loads), so it is never asked to answer a
                // timeout early or to renew: a load that outlives the lock fills nothing.
                Action::AnswerTimedOut | Action::RenewLock { .. } => {
                    return Step::Done(Err(types::Error::Other(
                        "the flight asked for an early answer it was never offered".to_string(),
                    )));
                }
                Action::Load {
                    until_ms,
                    soft_until_ms,
                    overdue_ms,
                    ..
                } => return self.hand_out_load(until_ms, soft_until_ms, overdue_ms),
                Action::WriteL2 {
                    header,
                    store_ttl_ms,
                    fenced,
                    release,
                } => self.write_l2(&header, store_ttl_ms, fenced, release),
                Action::Finish {
                    outcome,
                    release,
                    notify,
                    l1_until_ms,
                    refresh_at_ms,
                    refresh_now,
                } => {
                    self.refresh_due = refresh_now;
                    let stale_served = matches!(outcome, Outcome::Stale(_));
                    let read = outcome.read_from_store();
                    let result = self.result_of(outcome).map(|()| std::mem::take(&mut self.value));
                    // The followers first: the release and the announcement are two store
                    // round trips, during which a caller joining this flight would get a
                    // value older than a write acknowledged meanwhile.
                    if self.leads {
                        flights::finish(&self.key, result.as_ref().map(Vec::as_slice));
                    }
                    let owed = std::mem::take(&mut self.release_owed);
                    if !self.bounded || release || notify || owed {
                        // Their own bound (and that of what follows in the call); a
                        // refresh with nothing to release (it met the lock held) leaves
                        // the bound its refreshes share in place.
                        l2::bound(settings().store_budget().release_ms);
                    }
                    self.release_and_announce(release || owed, notify || owed);
                    if let (Ok(value), Some(until_ms)) = (&result, l1_until_ms) {
                        self.fill_l1(value, until_ms, refresh_at_ms, stale_served, read);
                    }
                    return Step::Done(result);
                }
            };
            action = self.flight.handle(event, now_ms(), &self.limits);
        }
    }

    fn read_l2(&mut self) -> Event {
        let (made, ticket) = match self.first_read.take() {
            Some((read, ticket)) => (Some(read), ticket),
            None => (None, self.read_ticket()),
        };
        self.l1_ticket = ticket;
        if self.unnamed {
            return Event::L2Failed;
        }
        let read = match made {
            Some(read) => judge_read(&self.names.entry, read, now_ms(), &self.limits),
            None => l2_read_holding(&self.names.entry, now_ms(), &self.limits),
        };
        let Ok((found, held)) = read else {
            return Event::L2Failed;
        };
        self.holds = held;
        match found {
            Found::Fresh(value, meta, tagged, until) => {
                self.value = value;
                self.tagged = tagged;
                self.tags_until = until;
                Event::L2Hit(meta)
            }
            Found::Stale(copy, meta) => {
                self.stale = copy;
                Event::L2Stale(meta)
            }
            Found::Nothing => Event::L2Miss,
        }
    }

    fn try_lock(&mut self, ttl_ms: u64) -> Event {
        if self.unnamed {
            return Event::LockFailed;
        }
        match l2::try_lock(&self.names.flight_lock, ttl_ms) {
            Ok(Some(token)) => {
                self.owner = Some(token);
                Event::LockAcquired
            }
            Ok(None) => Event::LockBusy { watching: false },
            Err(_) => Event::LockFailed,
        }
    }

    /// Writes the loaded value; a fenced write lands only over what the last read found
    /// (contract §5.12: a set or removal since that read wins). Asked to `release`, it
    /// writes only while the flight still holds its lock, and releases and announces in
    /// the same step, where the host can ([`Driver::fill_releasing`]); else the finish
    /// releases and announces, once the followers have the outcome.
    fn write_l2(&mut self, header: &[u8], store_ttl_ms: u64, fenced: bool, release: bool) -> Event {
        let loaded = Tagged {
            written_at_ms: self.written_at,
            tags: self.tag_list.clone(),
        };
        let Ok((header, ttl)) = policy::tag_plan(header, store_ttl_ms, &loaded, now_ms(), &self.limits)
        else {
            return Event::L2WriteFailed;
        };
        if self.unnamed {
            return Event::L2WriteFailed;
        }
        let stored = envelope::splice(&header, &self.value);
        self.l1_ticket = ticket_since(&self.key, self.named);
        if !self.tag_list.is_empty() {
            self.tagged = Some(loaded);
            self.tags_until = u64::MAX;
        }
        if release
            && fenced
            && let Some(step) = self.fill_releasing(&stored, ttl)
        {
            return step;
        }
        self.release_owed = release;
        let written = if fenced {
            l2::set_if(&self.names.entry, self.holds.as_deref(), &stored, ttl)
        } else {
            l2::set(&self.names.entry, &stored, ttl).map(|()| true)
        };
        match written {
            Ok(true) => Event::L2Written,
            Ok(false) | Err(_) => Event::L2WriteFailed,
        }
    }

    /// The fenced fill of `stored` and the release of the flight's lock in one step
    /// (`l2.fill-releasing`): `None` when the flight holds no lock or the host cannot.
    /// A step that failed leaves the lock to the finish's release.
    fn fill_releasing(&mut self, stored: &[u8], ttl_ms: u64) -> Option<Event> {
        let owner = self.owner.as_deref()?;
        let filled = l2::fill_releasing(
            &self.names.entry,
            self.holds.as_deref(),
            stored,
            ttl_ms,
            &self.names.flight_lock,
            owner,
            &self.key,
        );
        match filled {
            Ok(None) => None,
            Ok(Some(filled)) => {
                self.owner = None;
                Some(if filled.written {
                    Event::L2Written
                } else {
                    Event::L2WriteFailed
                })
            }
            Err(_) => {
                self.release_owed = true;
                Some(Event::L2WriteFailed)
            }
        }
    }

    fn release_and_announce(&mut self, release: bool, notify: bool) {
        if release && let Some(owner) = self.owner.take() {
            let _ = l2::release_lock(&self.names.flight_lock, &owner);
        }
        if notify {
            l2::announce_landing(&self.key);
        }
    }

    /// The flight's error, if it ended in one; a stale copy served becomes the value.
    fn result_of(&mut self, outcome: Outcome) -> Result<(), types::Error> {
        match outcome {
            Outcome::LoaderFailed => Err(types::Error::LoaderFailed(std::mem::take(&mut self.loader_error))),
            Outcome::TimedOut => Err(types::Error::Timeout(
                "the loader ran past the get-or-set's hard timeout".to_string(),
            )),
            Outcome::Stale(_) => {
                self.value = std::mem::take(&mut self.stale);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Fills L1 until the machine's deadline, no longer than what judged the value is
    /// known (`read`: a copy of what the store held, bound by the generation it was
    /// named in). A tagged value is judged first: its tags may have been invalidated
    /// since its load began.
    fn fill_l1(
        &self,
        value: &[u8],
        until_ms: u64,
        refresh_at_ms: Option<u64>,
        stale_served: bool,
        read: bool,
    ) {
        let tags_until = match (&self.tagged, stale_served) {
            (Some(t), false) => match judge(Some(t), &UNBOUNDED, now_ms()) {
                Ok((Verdict::Untouched, until)) => until.min(self.tags_until),
                _ => return,
            },
            _ => u64::MAX,
        };
        let until_ms = flight::l1_copy_until(until_ms, read, generation_known_until(), tags_until);
        let tagged = if stale_served {
            None
        } else {
            self.tagged.as_ref().map(tagged_out)
        };
        let entry = l1::L1Entry {
            value: value.to_vec(),
            until_ms,
            stale: stale_served,
            refresh_at_ms,
            tagged,
        };
        l1::fill(&self.key, &entry, self.l1_ticket);
    }
}
