//! The native body of one get-or-set flight: it performs the action the guest's flight
//! machine asks for, one short function per action, and feeds back what happened. It
//! decides nothing the contract governs (contract §5): what to fence, when to answer
//! early, when a refresh is due, what L1 keeps, all come with the actions. What it keeps
//! are registers, the bytes the actions brought (the last read's value, stale copy and
//! what the key held, the loaded value), and the tickets that fence L1 against this
//! process's own writes.

use std::panic::AssertUnwindSafe;

use bytes::Bytes;
use futures::FutureExt;
use tokio::sync::oneshot;
use tokio::time::{Duration, Instant, timeout_at};

use super::batch::Quiet;
use super::held::{HeldFlight, by, in_ms, share};
use super::{BoxError, Served};
use crate::cache::Corral;
use crate::cache::load::LoadOptions;
use crate::cache::metrics::Metrics;
use crate::cache::read::L2Read;
use crate::cache::registry::{Join, LeaderGuard, Outcome, UNCHANGED};
use crate::cache::tags::TagStamp;
use crate::guest::policy::Tagged;
use crate::guest::policy::wflight::{Action, Event, Finish, LoadRequest, Outcome as FlightOutcome, Write};
use crate::options::duration_ms;
use crate::store::l1::{L1Entry, L1Tagged, Ticket};
use crate::store::{Fill, Filled, LandingWatch};
use crate::{Error, ErrorKind, Result};

/// Where a flight's caller and followers are answered, and what it leaves behind.
pub(super) struct Callers<'a, F> {
    /// The loader, until the flight calls it.
    pub(super) loader: &'a mut Option<F>,
    /// The followers in this process, answered as soon as the outcome is known.
    pub(super) followers: &'a mut Option<LeaderGuard<Outcome>>,
    /// The caller, when it may be answered before the flight ends (`fetch`).
    pub(super) answer: &'a mut Option<oneshot::Sender<Result<Served>>>,
    /// The refreshes' registry lead, when the value served is due for a refresh now.
    pub(super) refresh: &'a mut Option<LeaderGuard<Outcome>>,
    /// The batch this flight is one key of ([`Corral::get_or_set_many`]): told when the
    /// flight waits for another process, so the batch's loads need not wait for it.
    pub(super) batch: Option<&'a Quiet>,
    /// A batch key's loader call, begun at this moment (the cache's clock): its load
    /// waits for the batch to be quiet first, and its timeouts count from the call
    /// (contract §5.16).
    pub(super) began: Option<oneshot::Receiver<u64>>,
}

/// A flight's first L2 read, made before it began, together with the reads of the
/// other keys of its batch: the read, the tickets taken before it, and the deadline of
/// the store steps before the load, which it began.
pub(super) struct FirstRead {
    pub(super) named: Ticket,
    pub(super) l1_ticket: Ticket,
    pub(super) tag_epoch: u64,
    pub(super) read: Result<L2Read>,
    pub(super) deadline: Instant,
    /// The key's data could not be named (the prefix's generation unread, and none may
    /// stand in): the read failed, and so does every later store step of the flight.
    pub(super) unnamed: bool,
    /// The generation a batch named the key's data in for this read (read, known, or
    /// standing in for one that could not be read); `None`: a flight's own read.
    pub(super) batch_generation: Option<u64>,
}

/// One flight in progress: the performer of its actions and its registers.
pub(super) struct Driver<'a, F> {
    cache: &'a Corral,
    key: &'a str,
    options: &'a LoadOptions,
    entry_name: &'a str,
    held: HeldFlight<'a>,
    callers: Callers<'a, F>,
    /// The guest's clock reading the last event was stepped with.
    now: u64,
    /// The deadline of the store steps under way (contract §5.13).
    deadline: Instant,
    /// This process's writes of the key: as of the names, and as of the last L2 step.
    named: Ticket,
    l1_ticket: Ticket,
    /// The value of the last L2 hit, or the loaded value.
    value: Option<Bytes>,
    /// The stale copy the last read found (fail-safe).
    stale: Option<Bytes>,
    /// What the key held after the last successful read: a fenced fill writes over it.
    holds: Option<Bytes>,
    loader_error: Option<BoxError>,
    landing: Option<LandingWatch>,
    waited: bool,
    /// What L1 keeps of an L2 hit's tags; the loaded entry's tags once written.
    stamp: Option<TagStamp>,
    written_tags: Option<Tagged>,
    /// When the loaded entry counts as written (its load's start, after its tags'
    /// invalidations known then: contract §7.5).
    written_at: u64,
    /// The tag epoch before the last L2 read: a stale copy it found is kept in L1 only
    /// until any tag invalidation this process hears of.
    read_tag_epoch: u64,
    /// The callers got the stale copy before the load ended (counted then).
    served_stale_early: bool,
    /// The write was asked to release the lock and announce the landing, and the store
    /// could not in the same step: done at the finish, once the followers have the
    /// outcome.
    release_owed: bool,
    /// The first read, made before the flight began (a batch's), or the double-check's,
    /// made by the lock that found the entry empty: it answers the next action only, if
    /// that is the read.
    first_read: Option<FirstRead>,
    /// The key's data could not be named: every store step fails, and the flight
    /// degrades (contract §5.8).
    unnamed: bool,
}

impl<'a, F, Fut, V, E> Driver<'a, F>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = std::result::Result<V, E>>,
    V: Into<Bytes>,
    E: Into<BoxError>,
{
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        cache: &'a Corral,
        key: &'a str,
        options: &'a LoadOptions,
        entry_name: &'a str,
        held: HeldFlight<'a>,
        callers: Callers<'a, F>,
        named: Ticket,
        now: u64,
        first_read: Option<FirstRead>,
    ) -> Self {
        let inner = &*cache.inner;
        // The steps before the load share a deadline (contract §5.13); a refresh's,
        // one store timeout (it takes the lock without waiting).
        let budget = &inner.flight.store_budget;
        let before_load = if options.refresh {
            budget.refresh_before_load_ms
        } else {
            budget.before_load_ms
        };
        let deadline = first_read
            .as_ref()
            .map_or_else(|| in_ms(before_load), |r| r.deadline.min(in_ms(before_load)));
        let unnamed = first_read.as_ref().is_some_and(|r| r.unnamed);
        Driver {
            cache,
            key,
            options,
            entry_name,
            held,
            callers,
            now,
            deadline,
            named,
            l1_ticket: named,
            value: None,
            stale: None,
            holds: None,
            loader_error: None,
            landing: None,
            waited: false,
            stamp: None,
            written_tags: None,
            written_at: now,
            read_tag_epoch: inner.l1.tag_epoch(),
            served_stale_early: false,
            release_owed: false,
            first_read,
            unnamed,
        }
    }

    /// Performs `action` and every one that follows, until the flight finishes.
    pub(super) async fn run(mut self, mut action: Action) -> Result<Served> {
        loop {
            trace_action(&action);
            if !matches!(action, Action::ReadL2) {
                // A read made ahead answers only the read that comes next.
                self.first_read = None;
            }
            let event = match action {
                Action::ReadL2 => self.read_l2().await,
                Action::TryLock(ttl_ms) => self.try_lock(ttl_ms).await,
                Action::Wait(until_ms) => {
                    let _idle = self.callers.batch.map(Quiet::idle);
                    self.wait(until_ms).await
                }
                Action::Load(request) => self.load(request).await?,
                Action::WriteL2(write) => self.write_l2(write).await?,
                Action::Finish(finish) => return self.finish(finish).await,
                // Only ever the answer to what a running load reports (see `load`).
                Action::AnswerStale(_)
                | Action::KeepLoading(_)
                | Action::AnswerTimedOut
                | Action::RenewLock(_) => return Err(out_of_turn("a load")),
            };
            action = self.step(event)?;
        }
    }

    /// Feeds `event` to the guest at the cache's clock; the next action.
    fn step(&mut self, event: Event) -> Result<Action> {
        self.step_at(event, self.cache.inner.clock.now_ms())
    }

    /// [`step`](Self::step) with what happened at the moment `now` (the cache's clock).
    fn step_at(&mut self, event: Event, now: u64) -> Result<Action> {
        self.now = now;
        let (state, next) = self
            .cache
            .inner
            .policy
            .flight_step(self.held.state, event, self.now)?;
        self.held.state = state;
        Ok(next)
    }

    async fn read_l2(&mut self) -> Event {
        let inner = &*self.cache.inner;
        let read = match self.first_read.take() {
            Some(first) => {
                self.l1_ticket = first.l1_ticket;
                self.read_tag_epoch = first.tag_epoch;
                first.read
            }
            None => {
                self.l1_ticket = inner.l1.ticket_since(self.key, self.named);
                self.read_tag_epoch = inner.l1.tag_epoch();
                if self.unnamed {
                    return Event::L2Failed;
                }
                by(self.deadline, self.cache.l2_look(self.entry_name, self.now)).await
            }
        };
        match read {
            Ok(L2Read::Hit(value, meta, holds, tags)) => {
                self.value = Some(value);
                self.stamp = tags;
                self.holds = Some(holds);
                Event::L2Hit(meta)
            }
            Ok(L2Read::Miss { holds }) => {
                self.holds = holds;
                Event::L2Miss
            }
            Ok(L2Read::Stale { value, meta, holds }) => {
                self.stale = Some(value);
                self.holds = Some(holds);
                Event::L2Stale(meta)
            }
            Err(e) => {
                crate::throttle::warn_every!(10, self.key, error = %e, "L2 read failed during get-or-set");
                Event::L2Failed
            }
        }
    }

    async fn try_lock(&mut self, ttl_ms: u64) -> Event {
        if self.unnamed {
            return Event::LockFailed;
        }
        let inner = &*self.cache.inner;
        // Listen before trying, so a landing right after the try is not missed.
        let watch = timeout_at(self.deadline, inner.stores.notifications.watch(self.key))
            .await
            .unwrap_or_else(|_| LandingWatch::never());
        let watching = watch.is_live();
        self.landing = Some(watch);
        // The token is known before it is sent (contract §5.13): should the reply never
        // come, or this future be dropped while waiting for it, the lock is released,
        // owner-checked, all the same.
        let owner = self.held.owner.insert(crate::lock_token()).clone();
        self.held.unanswered = true;
        // Where the store can, the lock looks at the entry in the same step: taken over
        // an empty entry, that look is the double-check's read (the tickets, as a read's,
        // taken before it is sent).
        let (l1_ticket, tag_epoch) = (inner.l1.ticket_since(self.key, self.named), inner.l1.tag_epoch());
        let lock = inner.stores.flight_lock.as_ref();
        let tried = match lock.try_lock_peeking(self.held.lock_name, &owner, ttl_ms, self.entry_name) {
            Some(peeking) => by(self.deadline, peeking).await,
            None => by(self.deadline, lock.try_lock(self.held.lock_name, &owner, ttl_ms))
                .await
                .map(|taken| taken.then_some(true)),
        };
        self.held.unanswered = false;
        match tried {
            Ok(Some(present)) => {
                if !present {
                    self.first_read = Some(FirstRead {
                        named: self.named,
                        l1_ticket,
                        tag_epoch,
                        read: Ok(L2Read::Miss { holds: None }),
                        deadline: self.deadline,
                        unnamed: false,
                        batch_generation: None,
                    });
                }
                Event::LockAcquired
            }
            Ok(None) => {
                self.held.owner = None;
                Event::LockBusy(watching)
            }
            Err(e) => {
                crate::throttle::warn_every!(10, self.key, error = %e, "get-or-set lock unavailable");
                // The SET may have been applied with its reply lost.
                self.held.release_in_background();
                Event::LockFailed
            }
        }
    }

    async fn wait(&mut self, until_ms: u64) -> Event {
        let inner = &*self.cache.inner;
        if !self.waited {
            self.waited = true;
            Metrics::bump(&inner.metrics.lock_waits);
        }
        let mut watch = self.landing.take().unwrap_or_else(LandingWatch::never);
        if watch.wait(&*inner.clock, until_ms, Some(self.deadline)).await {
            Event::BudgetSpent
        } else {
            Event::Woken
        }
    }

    /// Calls the loader once. The caller is answered early at the moments the guest set
    /// (contract §7.2), only when it can be answered before the flight ends (`fetch`);
    /// a loader still running at the hard timeout is dropped, and the guest judges the
    /// answer's time by the cache's clock, so a late answer times out alike.
    async fn load(&mut self, request: LoadRequest) -> Result<Event> {
        let inner = &*self.cache.inner;
        Metrics::bump(&inner.metrics.loads);
        let Some(load) = self.callers.loader.take() else {
            return Err(Error::guest(
                "the flight asked for a second load",
                "broken contract",
            ));
        };
        let left = |until: u64| Duration::from_millis(until.saturating_sub(inner.clock.now_ms()));
        if !self.options.tags.is_empty() {
            // The tags' moments are read within one store timeout, and within half the
            // time to the load's first deadline: the loader keeps the rest.
            let first_mark = [request.soft_until_ms, request.overdue_ms, request.until_ms]
                .into_iter()
                .flatten()
                .min();
            let left_ms = duration_ms(self.deadline.saturating_duration_since(Instant::now()));
            let first_mark_in = first_mark.map(|mark| duration_ms(left(mark)));
            let read_ms = inner
                .policy
                .tag_read_ms(inner.flight.store_budget, left_ms, first_mark_in)?;
            let read_by = in_ms(read_ms);
            self.written_at = self.cache.tagged_write_at(&self.options.tags, read_by).await;
        }
        let began = std::time::Instant::now();
        let running = AssertUnwindSafe(async move { load().await }).catch_unwind();
        let mut running = std::pin::pin!(running);
        let loaded = self.await_loader(&mut running, &request).await?;
        inner.metrics.load_duration.record(began.elapsed());
        self.deadline = in_ms(inner.flight.store_budget.after_load_ms);
        Ok(match loaded {
            None => Event::LoadTimedOut,
            // The flight is abandoned (its lock released by `held`).
            Some(Err(panic)) => return Err(Error::loader_panicked(&*panic)),
            Some(Ok(Ok(v))) => {
                let v: Bytes = v.into();
                // A `should_cache` that panics fails the load as a loader's panic does.
                let verdict = std::panic::catch_unwind(AssertUnwindSafe(|| self.options.verdict(&v)));
                let (cacheable, expiry) =
                    verdict.map_err(|panic| Error::panicked_in("should_cache", &*panic))?;
                let loaded = crate::guest::policy::wflight::Loaded {
                    len: v.len() as u64,
                    cacheable,
                    expiry: expiry.as_ref().map(crate::guest::convert::options_in),
                };
                self.value = Some(v);
                Event::Loaded(loaded)
            }
            Some(Ok(Err(e))) => {
                self.loader_error = Some(e.into());
                Event::LoadFailed
            }
        })
    }

    /// Waits for the loader's answer (`None`: stopped at the hard timeout), doing at each
    /// moment the guest set what it is due for: an early answer, the lock's renewal. A
    /// batch key's load counts its timeouts from its loader call: until the call begins,
    /// only the lock's renewal is due; then the guest re-arms the rest (`load-began`).
    async fn await_loader<L: Future + Unpin>(
        &mut self,
        running: &mut L,
        request: &LoadRequest,
    ) -> Result<Option<L::Output>> {
        let clock = &self.cache.inner.clock;
        let mut began = self.callers.began.take();
        let mut marks = Marks::of(request);
        if began.is_some() {
            marks = Marks {
                renew: marks.renew,
                ..Marks::default()
            };
        }
        loop {
            // Once answered, no early answer is due.
            let next = marks.next(self.callers.answer.is_some());
            let left = next.map(|(at, _)| Duration::from_millis(at.saturating_sub(clock.now_ms())));
            let mark = match first_of(running, &mut began, left, || clock.now_ms()).await {
                // A call that began and answered in one poll: its answer is judged by
                // the moments of its call too.
                Woke::Loaded(loaded) => {
                    self.began_unheard(began.take())?;
                    return Ok(Some(loaded));
                }
                Woke::Began(at) => {
                    began = None;
                    marks = self.load_began(at)?;
                    continue;
                }
                Woke::At => match next {
                    Some((_, mark)) => mark,
                    None => continue,
                },
            };
            match mark {
                Mark::Stop => return Ok(None),
                Mark::Slow => {
                    marks.slow = None;
                    self.answer_early(Event::LoadSlow, &mut marks.renew).await?;
                }
                Mark::Overdue => {
                    marks.overdue = None;
                    self.answer_early(Event::LoadOverdue, &mut marks.renew).await?;
                }
                Mark::Renew => {
                    marks.renew = None;
                    let by_mark = marks.next(self.callers.answer.is_some()).map(|(at, _)| at);
                    if let Some(loaded) = self.renew_lock(running, &mut marks.renew, by_mark).await? {
                        self.began_unheard(began.take())?;
                        return Ok(Some(loaded));
                    }
                }
            }
        }
    }

    /// A batch key's loader call began at `at` (the cache's clock; heard after a
    /// renewal, it may be before the last step): the guest re-arms the load's timeouts
    /// from then, the lock's renewal as it stands.
    fn load_began(&mut self, at: u64) -> Result<Marks> {
        let next = self.step_at(Event::LoadBegan, at)?;
        trace_action(&next);
        match next {
            Action::Load(request) => Ok(Marks::of(&request)),
            _ => Err(out_of_turn("the loader call's start")),
        }
    }

    /// The loader answered before its call's start (`began`, if the flight waits for
    /// one) was heard: in the poll the call began, or during a renewal. The start is
    /// stepped first, so that the answer is judged by the call's moments.
    fn began_unheard(&mut self, began: Option<oneshot::Receiver<u64>>) -> Result<()> {
        if let Some(mut call) = began {
            // The sender went with the answered call: sent, or never to be.
            let at = call
                .try_recv()
                .unwrap_or_else(|_| self.cache.inner.clock.now_ms());
            self.load_began(at)?;
        }
        Ok(())
    }

    /// The load still runs at its lock's renewal moment: renews the lock as the guest
    /// says, still polling the loader, and feeds back how it went. A renewal is checked
    /// against the entry in the same step where the guest asks (a store that cannot, or
    /// whose entries are elsewhere, does not renew: the renewal fails, and a load that
    /// outlives the lock fills nothing). The renewal gives way to the loader's answer and
    /// to the load's next mark (`by_mark`): it then failed, and the lock holds as before.
    /// The next renewal's moment goes to `renew_at`; the loader's answer, if it came
    /// meanwhile, is returned.
    async fn renew_lock<L: Future + Unpin>(
        &mut self,
        running: &mut L,
        renew_at: &mut Option<u64>,
        by_mark: Option<u64>,
    ) -> Result<Option<L::Output>> {
        let next = self.step(Event::RenewDue)?;
        trace_action(&next);
        let renew = match next {
            Action::RenewLock(renew) => renew,
            Action::KeepLoading(at) => {
                *renew_at = at;
                return Ok(None);
            }
            _ => return Err(out_of_turn("a renewal")),
        };
        let inner = &*self.cache.inner;
        let stores = &inner.stores;
        let owner = self.held.owner.clone().unwrap_or_default();
        let over = renew.fenced.then(|| self.holds.clone());
        let renewing = (stores.fill_with_lock() || over.is_none())
            .then(|| {
                stores
                    .flight_lock
                    .renew(self.held.lock_name, &owner, renew.ttl_ms, self.entry_name, over)
            })
            .flatten();
        let mut loaded = None;
        let renewed = match renewing {
            Some(renewing) => {
                let mut until = in_ms(inner.flight.store_budget.after_load_ms);
                if let Some(mark) = by_mark {
                    let left = mark.saturating_sub(inner.clock.now_ms());
                    until = until.min(in_ms(left));
                }
                tokio::select! {
                    biased;
                    renewed = by(until, renewing) => Some(renewed),
                    answer = &mut *running => {
                        loaded = Some(answer);
                        None
                    }
                }
            }
            None => None,
        };
        let event = match renewed {
            Some(Ok(true)) => Event::Renewed,
            Some(Ok(false)) => {
                tracing::debug!(
                    key = self.key,
                    "the flight's lock was lost or its key written during the load; its fill will be refused"
                );
                Event::RenewRefused
            }
            Some(Err(e)) => {
                crate::throttle::warn_every!(10, self.key, error = %e, "flight lock renewal failed");
                Event::RenewFailed
            }
            None => Event::RenewFailed,
        };
        match self.step(event)? {
            Action::KeepLoading(at) => *renew_at = at,
            _ => return Err(out_of_turn("a renewal")),
        }
        Ok(loaded)
    }

    /// The load still runs at a moment the guest set (`load-slow`, `load-overdue`):
    /// answers the callers as the guest says (the stale copy, or a timeout), or not. A
    /// `keep-loading` sets the lock's next renewal (`renew_at`).
    async fn answer_early(&mut self, event: Event, renew_at: &mut Option<u64>) -> Result<()> {
        let inner = &*self.cache.inner;
        let hard = event == Event::LoadOverdue;
        let next = self.step(event)?;
        trace_action(&next);
        let served = match next {
            Action::AnswerStale(l1_until_ms) => {
                let timeouts = if hard {
                    &inner.metrics.hard_timeouts
                } else {
                    &inner.metrics.soft_timeouts
                };
                Metrics::bump(timeouts);
                Metrics::bump(&inner.metrics.stale_served);
                self.served_stale_early = true;
                let copy = self.stale.clone().unwrap_or_default();
                // Callers that come while the load runs get it from L1.
                if let Some(until_ms) = l1_until_ms {
                    // A copy of what the store held.
                    let entry = L1Entry {
                        value: copy.clone(),
                        until_ms: self.cache.l1_copy_until(until_ms, true, u64::MAX),
                        stale: true,
                        refresh_at_ms: None,
                        tagged: Some(self.read_tag_epoch),
                    };
                    inner.l1.fill_entry(self.key, entry, self.l1_ticket);
                }
                Ok(Served {
                    value: copy,
                    stale: true,
                })
            }
            Action::AnswerTimedOut => {
                Metrics::bump(&inner.metrics.hard_timeouts);
                Err(Error::new(
                    ErrorKind::Timeout,
                    "the loader ran past the get-or-set's hard timeout \
                     (it goes on in the background and fills the cache if it succeeds)",
                ))
            }
            Action::KeepLoading(at) => {
                *renew_at = at;
                return Ok(());
            }
            _ => return Err(out_of_turn("a slow load")),
        };
        if let Some(guard) = self.callers.followers.take() {
            share(guard, &served);
        }
        if let Some(tx) = self.callers.answer.take() {
            let _ = tx.send(served);
        }
        Ok(())
    }

    async fn write_l2(&mut self, mut write: Write) -> Result<Event> {
        if self.unnamed {
            return Ok(Event::L2WriteFailed);
        }
        let inner = &*self.cache.inner;
        self.l1_ticket = inner.l1.ticket_since(self.key, self.named);
        if !self.options.tags.is_empty() {
            let tagged = Tagged {
                written_at_ms: self.written_at,
                tags: self.options.tags.to_vec(),
            };
            let now = inner.clock.now_ms();
            let (header, ttl) = inner
                .policy
                .tag_plan(&write.header, write.store_ttl_ms, &tagged, now)?;
            write.header = header;
            write.store_ttl_ms = ttl;
            self.written_tags = Some(tagged);
        }
        let value = self.value.as_deref().unwrap_or_default();
        // Fenced (contract §5.12): only over what the last read found.
        let fill = Fill {
            name: self.entry_name,
            over: write.fenced.then(|| self.holds.clone()),
            bytes: crate::store::splice(&write.header, value),
            ttl_ms: write.store_ttl_ms,
        };
        let cache = self.cache;
        if write.release
            && cache.inner.stores.fill_with_lock()
            && let Some(owner) = self.held.owner.clone()
        {
            // Where the store can, the write releases the lock and announces the
            // landing in the same step, writing only while the lock is still this
            // flight's (contract §5.5, §5.12).
            let stores = &cache.inner.stores;
            let announcement = stores.notifications.announcement(self.key);
            let announce = announcement.as_ref().map(|(c, m)| (c.as_str(), m.as_str()));
            if let Some(step) =
                stores
                    .flight_lock
                    .fill_releasing(fill.clone(), self.held.lock_name, &owner, announce)
            {
                return Ok(self.filled_releasing(step).await);
            }
        }
        // Else the finish releases, once the followers have the outcome.
        self.release_owed = write.release;
        let entries = &inner.stores.entries;
        let written = match fill.over {
            Some(over) => entries.set_if(fill.name, over, fill.bytes, fill.ttl_ms),
            None => Box::pin(async move {
                entries
                    .set(fill.name, fill.bytes, fill.ttl_ms)
                    .await
                    .map(|()| true)
            }),
        };
        Ok(match self.cache.l2_op(by(self.deadline, written)).await {
            Ok(true) => Event::L2Written,
            Ok(false) => self.refused("the key was written since the load began"),
            Err(e) => self.write_failed(&e),
        })
    }

    /// What a write that released the lock in the same step did: announced on its own
    /// when the step did not publish; the lock still owed when its outcome is unknown.
    async fn filled_releasing(&mut self, step: impl Future<Output = Result<Filled>>) -> Event {
        let filled = match self.cache.l2_op(by(self.deadline, step)).await {
            Ok(filled) => filled,
            Err(e) => {
                self.held.release_in_background();
                return self.write_failed(&e);
            }
        };
        if !filled.announced {
            // Still owed until announced: a caller gone meanwhile leaves it (with an
            // owner-checked release, a no-op now) to the background.
            let closing = in_ms(self.cache.inner.flight.store_budget.release_ms);
            self.announce_alone(closing).await;
        }
        self.held.owner = None;
        match filled {
            Filled { written: true, .. } => Event::L2Written,
            Filled { held: false, .. } => self.refused("the flight's lock lapsed during the load"),
            _ => self.refused("the key was written since the load began"),
        }
    }

    /// A fenced fill the store refused (contract §5.12): the value is returned uncached.
    fn refused(&self, why: &'static str) -> Event {
        self.count_refused(why);
        Event::L2WriteFailed
    }

    /// A refused fill, the store's or the flight's own (`lapsed`), counted and logged.
    fn count_refused(&self, why: &'static str) {
        Metrics::bump(&self.cache.inner.metrics.fills_refused);
        tracing::debug!(key = self.key, why, "fill refused");
    }

    fn write_failed(&self, e: &Error) -> Event {
        crate::throttle::warn_every!(10, self.key, error = %e, "L2 write failed; the value is returned uncached");
        Event::L2WriteFailed
    }

    /// The flight's end: the callers get the outcome first, then the lock is released
    /// and the landing announced, then L1 is filled.
    async fn finish(mut self, finish: Finish) -> Result<Served> {
        record_outcome(&finish.outcome);
        let result = self.result_of(&finish);
        // Followers get the outcome now, not after two more store round trips.
        if let Some(guard) = self.callers.followers.take() {
            share(guard, &result);
        }
        // The value served is due for its eager refresh, which a flight in a task of its
        // own can run: the refresh joins the refreshes' registry before the caller is
        // answered, so whoever the caller tells finds it running.
        if finish.refresh_now
            && self.callers.answer.is_some()
            && let Join::Leader(guard) = self.cache.inner.refreshes.join(self.key, UNCHANGED)
        {
            *self.callers.refresh = Some(guard);
        }
        if let Some(tx) = self.callers.answer.take() {
            let _ = tx.send(result.clone());
        }
        if finish.outcome == FlightOutcome::Lapsed {
            // The fill refused before it was sent.
            self.count_refused("the flight's lock lapsed during the load");
        }
        let owed = std::mem::take(&mut self.release_owed);
        self.release_and_announce(finish.release || owed, finish.notify || owed)
            .await;
        if !self.options.refresh {
            self.cache
                .count_outcome(self.key, finish.outcome, self.served_stale_early);
        }
        if let Ok(served) = &result {
            self.fill_l1(served, &finish).await;
        }
        result
    }

    /// What the callers get, as the guest's outcome says.
    fn result_of(&mut self, finish: &Finish) -> Result<Served> {
        let inner = &*self.cache.inner;
        if self.options.refresh && matches!(finish.outcome, FlightOutcome::Loaded(true)) {
            Metrics::bump(&inner.metrics.refreshes);
        }
        match finish.outcome {
            FlightOutcome::LoaderFailed => Err(Error::loader(
                self.loader_error.take().unwrap_or_else(|| "loader failed".into()),
            )),
            FlightOutcome::TimedOut => Err(Error::new(
                ErrorKind::Timeout,
                "the loader ran past the get-or-set's hard timeout (nothing was cached)",
            )),
            FlightOutcome::Stale(_) => Ok(Served {
                value: self.stale.take().unwrap_or_default(),
                stale: true,
            }),
            FlightOutcome::Skipped => Err(Error::new(
                ErrorKind::Unavailable,
                "the refresh did not run: another process holds the lock, or the store failed",
            )),
            _ => Ok(Served {
                value: self.value.take().unwrap_or_default(),
                stale: false,
            }),
        }
    }

    /// Releases the lock (owner-checked) and announces the landing, as the guest says.
    /// The release has a deadline of its own (the steps before may have spent theirs);
    /// until it is confirmed the lock stays owed, so a caller that goes away now, or a
    /// release that fails, releases it in the background instead of leaving it to its TTL.
    async fn release_and_announce(&mut self, release: bool, notify: bool) {
        let inner = &*self.cache.inner;
        let closing = in_ms(inner.flight.store_budget.release_ms);
        self.held.releasing = release;
        // Where the store can, the release publishes the landing's announcement in the
        // same command; one it did not publish (refused, or its outcome unknown) is made
        // on its own below, best effort (a second one only wakes waiters twice).
        let mut announced = false;
        if release && let Some(owner) = self.held.owner.clone() {
            let stores = &inner.stores;
            let announcement = notify
                .then(|| stores.notifications.announcement(self.key))
                .flatten();
            let release = match &announcement {
                Some((channel, message)) => {
                    stores
                        .flight_lock
                        .release_announcing(self.held.lock_name, &owner, channel, message)
                }
                None => None,
            };
            let announcing = release.is_some();
            let release = release.unwrap_or_else(|| stores.flight_lock.release(self.held.lock_name, &owner));
            match by(closing, release).await {
                Ok(published) => {
                    self.held.owner = None;
                    announced = announcing && published;
                }
                Err(e) => {
                    crate::throttle::warn_every!(10, self.key, error = %e, "lock release failed; retried in the background");
                    self.held.release_in_background();
                }
            }
        }
        self.held.done = true;
        if notify && !announced {
            self.announce_alone(closing).await;
        }
    }

    /// The landing's announcement on its own, best effort by `closing` (a second one
    /// only wakes waiters twice; one lost leaves them to their timers). (`&mut`: the
    /// driver is `Send`, not `Sync`, and this future holds it across the await.)
    async fn announce_alone(&mut self, closing: Instant) {
        let announce = self.cache.inner.stores.notifications.announce(self.key);
        if let Err(e) = by(closing, announce).await {
            tracing::debug!(key = self.key, error = %e, "landing announcement failed; waiters fall back to polling");
        }
    }

    /// Fills L1 as the guest says, fenced on this process's writes since the last L2
    /// step. A tagged value: what the read judged, or the load's own tags judged now (an
    /// invalidation may have come since its load began).
    async fn fill_l1(&mut self, served: &Served, finish: &Finish) {
        let Some(until_ms) = finish.l1_until_ms else {
            return;
        };
        let inner = &*self.cache.inner;
        let loaded = matches!(finish.outcome, FlightOutcome::Loaded(_));
        let stamp = match (loaded, self.written_tags.take()) {
            (true, Some(tagged)) => match self.cache.stamp_written(tagged, inner.clock.now_ms()).await {
                Ok(Some(stamp)) => Some(stamp),
                _ => return,
            },
            _ => self.stamp.take(),
        };
        let (tags_until, tagged): (u64, L1Tagged) = match stamp {
            Some(s) => (s.until_ms, s.tagged),
            None if served.stale => (u64::MAX, Some(self.read_tag_epoch)),
            None => (u64::MAX, None),
        };
        // A copy of what the store held (a hit, a stale copy), not a value loaded here.
        let read = matches!(finish.outcome, FlightOutcome::L2Hit(_) | FlightOutcome::Stale(_));
        let until_ms = self.cache.l1_copy_until(until_ms, read, tags_until);
        let entry = L1Entry {
            value: served.value.clone(),
            until_ms,
            stale: served.stale,
            refresh_at_ms: finish.refresh_at_ms,
            tagged,
        };
        // A refresh or a bypass that wrote its value to L2 ran beside this process's
        // flights of the key, not in them: a read in this process from before its write
        // must not fill L1 over it, so it fills as a set does (the ticket is the write's).
        if finish.outcome == FlightOutcome::Loaded(true) && (self.options.refresh || self.options.bypass) {
            inner.l1.insert_entry(self.key, entry, self.l1_ticket);
        } else {
            inner.l1.fill_entry(self.key, entry, self.l1_ticket);
        }
    }
}

/// The moments a running load is due for something, as the guest set them (the
/// cache's clock, Unix ms): stopped, answered early, its lock renewed.
#[derive(Default)]
struct Marks {
    stop: Option<u64>,
    slow: Option<u64>,
    overdue: Option<u64>,
    renew: Option<u64>,
}

#[derive(Clone, Copy)]
enum Mark {
    Stop,
    Slow,
    Overdue,
    Renew,
}

impl Marks {
    /// The moments a load action set.
    fn of(request: &LoadRequest) -> Self {
        Marks {
            stop: request.until_ms,
            slow: request.soft_until_ms,
            overdue: request.overdue_ms,
            renew: request.renew_at_ms,
        }
    }

    /// The first moment still due, and what for: the early answers only while the
    /// caller can be `answered` early; at one moment, in the order above.
    fn next(&self, answerable: bool) -> Option<(u64, Mark)> {
        let early = |at: Option<u64>| at.filter(|_| answerable);
        [
            (self.stop, Mark::Stop),
            (early(self.slow), Mark::Slow),
            (early(self.overdue), Mark::Overdue),
            (self.renew, Mark::Renew),
        ]
        .into_iter()
        .filter_map(|(at, mark)| Some((at?, mark)))
        .min_by_key(|(at, _)| *at)
    }
}

/// What a load's wait ended with (see [`first_of`]).
enum Woke<T> {
    Loaded(T),
    /// The call began at this moment (the cache's clock).
    Began(u64),
    At,
}

/// Waits for the first of: the loader's answer, its call's start (`began`, while it
/// has not; a start that can no longer come counts as one), and the moment `left` from
/// now (none: never).
async fn first_of<L: Future + Unpin>(
    running: &mut L,
    began: &mut Option<oneshot::Receiver<u64>>,
    left: Option<Duration>,
    now: impl Fn() -> u64,
) -> Woke<L::Output> {
    let call = async {
        match began {
            Some(rx) => rx.await.unwrap_or_else(|_| now()),
            None => std::future::pending().await,
        }
    };
    let moment = async {
        match left {
            Some(left) => tokio::time::sleep(left).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        loaded = running => Woke::Loaded(loaded),
        at = call => Woke::Began(at),
        () = moment => Woke::At,
    }
}

/// The guest answered what the body reported during `what` with an action that does
/// not belong there.
fn out_of_turn(what: &str) -> Error {
    Error::guest(
        format!("the flight answered {what} out of turn"),
        "broken contract",
    )
}

/// Logs what the guest decided the flight does next (in the flight's span). Variants are
/// matched by name only, so a change of their payloads does not touch this.
// `Load { .. }` matches the variant with or without a payload.
#[allow(clippy::unneeded_struct_pattern)]
pub(super) fn trace_action(action: &Action) {
    match action {
        Action::ReadL2 => tracing::debug!(action = "read_l2", "flight action"),
        Action::TryLock(ttl_ms) => tracing::debug!(action = "try_lock", ttl_ms, "flight action"),
        Action::Wait(until_ms) => tracing::debug!(action = "wait", until_ms, "flight action"),
        Action::Load { .. } => tracing::debug!(action = "load", detail = ?action, "flight action"),
        Action::WriteL2(write) => tracing::debug!(
            action = "write_l2",
            store_ttl_ms = write.store_ttl_ms,
            fenced = write.fenced,
            release = write.release,
            "flight action"
        ),
        Action::Finish(finish) => tracing::debug!(
            action = "finish",
            outcome = ?finish.outcome,
            release = finish.release,
            notify = finish.notify,
            l1_until_ms = ?finish.l1_until_ms,
            refresh_now = finish.refresh_now,
            "flight action"
        ),
        #[allow(unreachable_patterns)]
        other => tracing::debug!(action = ?other, "flight action"),
    }
}

/// Records the flight's outcome on its span, in snake case (`loaded`, `l2_hit`,
/// `loader_failed`, ...: the name of the guest's outcome variant).
fn record_outcome(outcome: &FlightOutcome) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    let debug = format!("{outcome:?}");
    let variant = debug.split('(').next().unwrap_or_default();
    let variant = variant.rsplit("::").next().unwrap_or_default();
    let mut name = String::with_capacity(variant.len() + 4);
    for (i, c) in variant.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_lowercase());
    }
    span.record("outcome", name.as_str());
}
