//! The native driver of get-or-set: a loop that performs what the guest's flight
//! machine asks (contract §5). It decides nothing; the guest does.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use tokio::time::{Instant, sleep, timeout_at};
use tracing::Instrument;

use super::Corral;
use super::load::{LoadOptions, Served};
use super::metrics::Metrics;
use super::read::L2Read;
use super::registry::{Join, LeaderGuard, Outcome};
use crate::guest::policy::wflight::{self, Action, Event, Outcome as FlightOutcome, StaleCause};
use crate::store::LandingWatch;
use crate::store::l1::L1Entry;
use crate::{Error, Result};
use tokio::sync::oneshot;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl Corral {
    /// The value under `key`; on a miss, `loader` produces it, once per key across
    /// every caller in this process and every process sharing the Redis. The value is
    /// cached as `options` say and returned to every caller waiting for it.
    ///
    /// - L1 hit: returned at once. L2 hit: L1 is filled, the value returned.
    /// - Miss: the first caller of the key in this process leads; the others wait for
    ///   its result. The leader takes the distributed lock (`SET NX PX`, a random
    ///   128-bit owner token), reads L2 again, loads, writes L2 then L1, releases the
    ///   lock (owner-checked), and announces the landing (pub/sub), which wakes the
    ///   waiting processes; they read the value from L2.
    /// - If the lock cannot be had (Redis down, or held past the lock wait), the loader
    ///   runs uncached for this caller (with a `tracing` warning), still coalesced
    ///   within the process.
    /// - A loader error goes to the leader and every coalesced caller; nothing is cached.
    /// - Dropping the future mid-flight releases the lock (in the background) and hands
    ///   the flight to a waiting caller: no lock, permit or map entry leaks.
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) -> corral::Result<()> {
    /// use std::time::Duration;
    /// use corral::{EntryOptions, LoadOptions};
    ///
    /// let options = LoadOptions::new()
    ///     .entry(EntryOptions::new().relative(Duration::from_secs(60)))
    ///     .should_cache(|v| !v.is_empty());
    /// let user = cache
    ///     .get_or_set("user:42", options, || async { Ok::<_, std::io::Error>(b"Ada".to_vec()) })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a bad key
    /// or options, before anything runs; [`ErrorKind::Loader`](crate::ErrorKind::Loader)
    /// with the loader's error as the source.
    pub async fn get_or_set<F, Fut, V, E>(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        loader: F,
    ) -> Result<Bytes>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<V, E>>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        self.get_or_set_served(key, options, loader)
            .await
            .map(|served| served.value)
    }

    /// As [`get_or_set`](Self::get_or_set), saying whether the value is a stale copy
    /// fail-safe served in place of a failed reload (contract §6b.1; see
    /// [`LoadOptions::fail_safe`]).
    ///
    /// # Errors
    /// As [`get_or_set`](Self::get_or_set); with a hard timeout and no stale copy,
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout).
    pub async fn get_or_set_served<F, Fut, V, E>(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        loader: F,
    ) -> Result<Served>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<V, E>>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        let options = options.into();
        // Both need the load to outlive the call, which only `fetch` can promise.
        for (set, name) in [
            (options.soft_timeout_ms.is_some(), "soft_timeout"),
            (options.eager_refresh_permille.is_some(), "eager_refresh"),
            (options.background_completion, "background_completion"),
        ] {
            if set {
                return Err(Error::invalid_argument(
                    name,
                    "needs a loader that may run on after the call returns: use Corral::fetch, \
                     whose loader is Send + 'static",
                ));
            }
        }
        self.judge(key, &options)?;
        if options.bypass {
            return self
                .lead(key, &options, loader, &mut None, &mut None)
                .instrument(self.flight_span(key))
                .await
                .result;
        }
        let now = self.inner.clock.now_ms();
        if let Some((value, stale)) = self.inner.l1.get_served(key, now) {
            Metrics::bump(&self.inner.metrics.l1_hits);
            if stale {
                Metrics::bump(&self.inner.metrics.stale_served);
            }
            return Ok(Served { value, stale });
        }
        match self.inner.registry.lead_or_follow(key).await {
            Ok(guard) => {
                let mut guard = Some(guard);
                let result = self
                    .lead(key, &options, loader, &mut guard, &mut None)
                    .instrument(self.flight_span(key))
                    .await
                    .result;
                // The flight ended before its outcome was handed on (a bad argument, a
                // guest failure): the followers get the same.
                if let Some(guard) = guard {
                    share(guard, &result);
                }
                result
            }
            Err(outcome) => {
                Metrics::bump(&self.inner.metrics.coalesced);
                outcome.map_err(Error::from_shared)
            }
        }
    }

    /// The value under `key`, as [`get_or_set`](Self::get_or_set), with a loader that
    /// may run on after this call returns (`Send + 'static`): the flight runs in a task
    /// of its own, to its end even if this caller goes away. That is what the soft
    /// timeout ([`LoadOptions::soft_timeout`]) and eager refresh
    /// ([`LoadOptions::eager_refresh`]) need: the caller is answered with a stale copy
    /// while the load goes on, or with the current value while one refresh runs.
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) -> corral::Result<()> {
    /// use std::time::Duration;
    /// use corral::LoadOptions;
    ///
    /// let options = LoadOptions::relative(Duration::from_secs(60))
    ///     .fail_safe(Duration::from_secs(3600))
    ///     .soft_timeout(Duration::from_millis(100))
    ///     .eager_refresh(0.8);
    /// let price = cache
    ///     .fetch("price:42", options, || async { Ok::<_, std::io::Error>(b"9.99".to_vec()) })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`get_or_set_served`](Self::get_or_set_served).
    pub async fn fetch<F, Fut, V, E>(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        loader: F,
    ) -> Result<Bytes>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<V, E>> + Send + 'static,
        V: Into<Bytes> + Send + 'static,
        E: Into<BoxError> + Send + 'static,
    {
        self.fetch_served(key, options, loader)
            .await
            .map(|served| served.value)
    }

    /// As [`fetch`](Self::fetch), saying whether the value is a stale copy.
    ///
    /// # Errors
    /// As [`get_or_set_served`](Self::get_or_set_served).
    pub async fn fetch_served<F, Fut, V, E>(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        loader: F,
    ) -> Result<Served>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<V, E>> + Send + 'static,
        V: Into<Bytes> + Send + 'static,
        E: Into<BoxError> + Send + 'static,
    {
        let options = options.into();
        self.judge(key, &options)?;
        if options.bypass {
            let mut in_caller = options;
            in_caller.soft_timeout_ms = None;
            in_caller.eager_refresh_permille = None;
            return self.get_or_set_served(key, in_caller, loader).await;
        }
        let now = self.inner.clock.now_ms();
        if let Some(entry) = self.inner.l1.get_entry(key, now) {
            Metrics::bump(&self.inner.metrics.l1_hits);
            if entry.stale {
                Metrics::bump(&self.inner.metrics.stale_served);
            }
            if entry.refresh_at_ms.is_some_and(|at| now >= at) {
                self.inner.l1.disarm_refresh(key);
                self.refresh_in_background(key, &options, loader, None);
            }
            return Ok(Served {
                value: entry.value,
                stale: entry.stale,
            });
        }
        match self.inner.registry.lead_or_follow(key).await {
            Ok(guard) => {
                let (tx, rx) = oneshot::channel();
                let (cache, key, span) = (self.clone(), key.to_owned(), self.flight_span(key));
                let running = Running::start(&self.inner.background);
                tokio::spawn(async move {
                    let _running = running;
                    let mut followers = Some(guard);
                    let mut answer = Some(tx);
                    let led = cache
                        .lead(&key, &options, loader, &mut followers, &mut answer)
                        .instrument(span)
                        .await;
                    if let Some(guard) = followers {
                        share(guard, &led.result);
                    }
                    if let Some(tx) = answer {
                        let _ = tx.send(led.result);
                    }
                    if let (Some(guard), Some(loader)) = (led.refresh, led.loader) {
                        cache.refresh_in_background(&key, &options, loader, Some(guard));
                    }
                });
                rx.await.unwrap_or_else(|_| {
                    Err(Error::guest(
                        "the flight's task ended without an answer",
                        "it panicked",
                    ))
                })
            }
            Err(outcome) => {
                Metrics::bump(&self.inner.metrics.coalesced);
                outcome.map_err(Error::from_shared)
            }
        }
    }

    /// Starts one eager refresh of `key` in the background (contract §6b.3), unless a
    /// flight of the key already runs in this process. It takes the flight lock without
    /// waiting: if another process holds it, that one refreshes, and this does nothing.
    /// `joined`: the registry's lead, if the caller took it already.
    fn refresh_in_background<F, Fut, V, E>(
        &self,
        key: &str,
        options: &LoadOptions,
        loader: F,
        joined: Option<LeaderGuard<Outcome>>,
    ) where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<V, E>> + Send + 'static,
        V: Into<Bytes> + Send + 'static,
        E: Into<BoxError> + Send + 'static,
    {
        let guard = match joined {
            Some(guard) => guard,
            None => match self.inner.refreshes.join(key) {
                Join::Leader(guard) => guard,
                Join::Follower(_) => return,
            },
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut options = options.clone();
        options.refresh = true;
        let (cache, key, span) = (self.clone(), key.to_owned(), self.flight_span(key));
        let running = Running::start(&self.inner.background);
        runtime.spawn(async move {
            let _running = running;
            let mut followers = Some(guard);
            let led = cache
                .lead(&key, &options, loader, &mut followers, &mut None)
                .instrument(span)
                .await;
            if let Some(guard) = followers {
                share(guard, &led.result);
            }
            if let Err(e) = led.result {
                tracing::debug!(key, error = %e, "eager refresh left the current value in place");
            }
        });
    }

    /// One flight, led by this caller: the guest decides, this loop performs.
    /// `followers` is the flight's registry guard: its outcome is handed to the callers
    /// waiting on it as soon as it is known, before the lock's release and announcement.
    /// `answer`, when given (a flight in a task of its own, see [`fetch`](Self::fetch)),
    /// is where the caller waits: it may be answered before the flight ends (a soft
    /// timeout's stale copy), and then the flight goes on without it.
    async fn lead<F, Fut, V, E>(
        &self,
        key: &str,
        options: &LoadOptions,
        loader: F,
        followers: &mut Option<LeaderGuard<Outcome>>,
        answer: &mut Option<oneshot::Sender<Result<Served>>>,
    ) -> Led<F>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<V, E>>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        let mut loader = Some(loader);
        let mut refresh = None;
        let result = self
            .fly(key, options, &mut loader, followers, answer, &mut refresh)
            .await;
        Led {
            result,
            loader,
            refresh,
        }
    }

    async fn fly<F, Fut, V, E>(
        &self,
        key: &str,
        options: &LoadOptions,
        loader: &mut Option<F>,
        followers: &mut Option<LeaderGuard<Outcome>>,
        answer: &mut Option<oneshot::Sender<Result<Served>>>,
        refresh: &mut Option<LeaderGuard<Outcome>>,
    ) -> Result<Served>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<V, E>>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        let inner = &*self.inner;
        let detached = answer.is_some() || options.refresh;
        let config = self.flight_config(options, answer.is_some());
        let mut now = inner.clock.now_ms();
        let (state, mut action) = inner.policy.flight_start(key, &options.entry, config, now)?;
        if !options.tags.is_empty() {
            inner.policy.check_tags(&options.tags)?;
        }
        // Taken before the names: L1 is never filled across a clear after them.
        let named = inner.l1.ticket(key);
        let names = self.locate(key).await?;
        let mut held = HeldFlight {
            cache: self,
            key,
            lock_name: &names.flight_lock,
            state,
            owner: None,
            unanswered: false,
            releasing: false,
            done: false,
        };
        // Every store step has a deadline (contract §5.13): those before the load share
        // the lock wait (at least one store timeout), those after it one store timeout.
        // A step past its deadline failed, and the guest decides what follows.
        let mut deadline = Instant::now()
            + inner
                .flight
                .store_timeout
                .max(Duration::from_millis(inner.flight.lock_wait_ms));
        let mut value: Option<Bytes> = None;
        // The stale copy the last read found (fail-safe).
        let mut stale: Option<Bytes> = None;
        let mut loader_error: Option<BoxError> = None;
        let mut landing = None;
        let mut waited = false;
        // What the last L2 read found on a miss: the fill is fenced on it.
        let mut fence: Option<Option<Bytes>> = None;
        // This process's writes of the key, as of the last L2 step: L1 is fenced on it.
        let mut l1_ticket = named;
        // Tags (contract §6b.5): what L1 keeps of an L2 hit's, and the loaded entry's
        // (written at the moment its load began, after every invalidation of its tags
        // completed by then: older than any invalidation after).
        let mut stamp: Option<super::tags::TagStamp> = None;
        let mut written_tags: Option<crate::guest::policy::Tagged> = None;
        let mut written_at = now;
        // The tag epoch before the last L2 read: a stale copy it found is kept in L1 only
        // until any tag invalidation this process hears of (it may carry tags).
        let mut read_tag_epoch = inner.l1.tag_epoch();
        // Whether the callers got the stale copy before the load ended (counted then).
        let mut served_stale_early = false;
        loop {
            trace_action(&action);
            let event = match action {
                Action::ReadL2 => {
                    l1_ticket = inner.l1.ticket_since(key, named);
                    read_tag_epoch = inner.l1.tag_epoch();
                    match by(deadline, self.l2_look(&names.entry, now)).await {
                        Ok(L2Read::Hit(v, meta, holds, tags)) => {
                            value = Some(v);
                            stamp = tags;
                            // A refresh writes over the very bytes it found, so a set or
                            // removal meanwhile wins (fenced fills, contract §5.12).
                            if options.refresh {
                                fence = Some(Some(holds));
                            }
                            Event::L2Hit(meta)
                        }
                        Ok(L2Read::Miss { holds }) => {
                            fence = Some(holds);
                            // The copy an earlier read found is gone: never served.
                            stale = None;
                            Event::L2Miss
                        }
                        Ok(L2Read::Stale {
                            value: copy,
                            meta,
                            holds,
                        }) => {
                            stale = Some(copy);
                            fence = Some(Some(holds));
                            Event::L2Stale(meta)
                        }
                        Err(e) => {
                            crate::throttle::warn_every!(10, key, error = %e, "L2 read failed during get-or-set");
                            Event::L2Failed
                        }
                    }
                }
                Action::TryLock(ttl_ms) => {
                    // Listen before trying, so a landing right after the try is not missed.
                    let watch = timeout_at(deadline, inner.stores.notifications.watch(key))
                        .await
                        .unwrap_or_else(|_| LandingWatch::never());
                    let watching = watch.is_live();
                    landing = Some(watch);
                    // The token is known before it is sent (contract §5.13): should the
                    // reply never come, or this future be dropped while waiting for it,
                    // the lock is released, owner-checked, all the same.
                    let owner = held.owner.insert(crate::lock_token()).clone();
                    held.unanswered = true;
                    let tried = by(
                        deadline,
                        inner
                            .stores
                            .flight_lock
                            .try_lock(&names.flight_lock, &owner, ttl_ms),
                    )
                    .await;
                    held.unanswered = false;
                    match tried {
                        Ok(true) => Event::LockAcquired,
                        Ok(false) => {
                            held.owner = None;
                            Event::LockBusy(watching)
                        }
                        Err(e) => {
                            crate::throttle::warn_every!(10, key, error = %e, "get-or-set lock unavailable");
                            // The SET may have been applied with its reply lost.
                            held.release_in_background();
                            Event::LockFailed
                        }
                    }
                }
                Action::Wait(until_ms) => {
                    if !waited {
                        waited = true;
                        Metrics::bump(&inner.metrics.lock_waits);
                    }
                    let pause = Duration::from_millis(until_ms.saturating_sub(inner.clock.now_ms()))
                        .min(deadline.saturating_duration_since(Instant::now()));
                    match landing.as_mut() {
                        // Biased: no random draw (a landing and the timer at the same
                        // moment end the wait alike).
                        Some(watch) => tokio::select! {
                            biased;
                            () = watch.landed() => {}
                            () = sleep(pause) => {}
                        },
                        None => sleep(pause).await,
                    }
                    landing = None;
                    Event::Woken
                }
                Action::Load(request) => {
                    Metrics::bump(&inner.metrics.loads);
                    let Some(load) = loader.take() else {
                        return Err(Error::guest(
                            "the flight asked for a second load",
                            "broken contract",
                        ));
                    };
                    if !options.tags.is_empty() {
                        written_at = self.tagged_write_at(&options.tags, deadline).await;
                    }
                    let began = std::time::Instant::now();
                    let running = AssertUnwindSafe(async move { load().await }).catch_unwind();
                    let mut running = std::pin::pin!(running);
                    let left = |until: u64| Duration::from_millis(until.saturating_sub(inner.clock.now_ms()));
                    // The early answers (contract §6b.2): only when the caller can be
                    // answered before the flight ends (`fetch`), and only at the moments
                    // the guest set: the soft timeout (with a stale copy), and the hard
                    // one with background completion. The guest says what each gives.
                    let mut early = None;
                    let marks = [
                        (request.soft_until_ms, Event::LoadSlow),
                        (request.overdue_ms, Event::LoadOverdue),
                    ];
                    for (mark, event) in marks {
                        // Once answered (or loaded), no later moment matters.
                        let (Some(mark), true, None) = (mark, answer.is_some(), &early) else {
                            continue;
                        };
                        match tokio::time::timeout(left(mark), &mut running).await {
                            Ok(loaded) => early = Some(loaded),
                            Err(_) => {
                                let hard = event == Event::LoadOverdue;
                                now = inner.clock.now_ms();
                                let (state, next) = inner.policy.flight_step(held.state, event, now)?;
                                held.state = state;
                                trace_action(&next);
                                let served = match next {
                                    Action::AnswerStale(l1_until_ms) => {
                                        Metrics::bump(if hard {
                                            &inner.metrics.hard_timeouts
                                        } else {
                                            &inner.metrics.soft_timeouts
                                        });
                                        Metrics::bump(&inner.metrics.stale_served);
                                        served_stale_early = true;
                                        let copy = stale.clone().unwrap_or_default();
                                        // Callers that come while the load runs get it from L1.
                                        if let Some(until_ms) = l1_until_ms {
                                            let entry = L1Entry {
                                                value: copy.clone(),
                                                until_ms,
                                                stale: true,
                                                refresh_at_ms: None,
                                                tagged: Some(read_tag_epoch),
                                            };
                                            inner.l1.fill_entry(key, entry, l1_ticket);
                                        }
                                        Some(Ok(Served {
                                            value: copy,
                                            stale: true,
                                        }))
                                    }
                                    Action::AnswerTimedOut => {
                                        Metrics::bump(&inner.metrics.hard_timeouts);
                                        Some(Err(Error::new(
                                            crate::ErrorKind::Timeout,
                                            "the loader ran past the get-or-set's hard timeout \
                                             (it goes on in the background and fills the cache if it succeeds)",
                                        )))
                                    }
                                    Action::KeepLoading => None,
                                    _ => {
                                        return Err(Error::guest(
                                            "the flight answered a slow load out of turn",
                                            "broken contract",
                                        ));
                                    }
                                };
                                if let Some(served) = served {
                                    if let Some(guard) = followers.take() {
                                        share(guard, &served);
                                    }
                                    if let Some(tx) = answer.take() {
                                        let _ = tx.send(served);
                                    }
                                }
                            }
                        }
                    }
                    // The hard timeout: a loader still running at the guest's moment is
                    // dropped. The guest also judges the answer's time by the cache's
                    // clock, so a late answer times out alike.
                    let loaded = match (early, request.until_ms) {
                        (Some(loaded), _) => Some(loaded),
                        (None, Some(until)) => tokio::time::timeout(left(until), &mut running).await.ok(),
                        (None, None) => Some(running.await),
                    };
                    inner.metrics.load_duration.record(began.elapsed());
                    deadline = Instant::now() + inner.flight.store_timeout;
                    match loaded {
                        None => Event::LoadTimedOut,
                        // The flight is abandoned (its lock released by `held`).
                        Some(Err(panic)) => return Err(Error::loader_panicked(&*panic)),
                        Some(Ok(Ok(v))) => {
                            let v: Bytes = v.into();
                            let (cacheable, expiry) = options.verdict(&v);
                            let loaded = wflight::Loaded {
                                len: v.len() as u64,
                                cacheable,
                                expiry: expiry.as_ref().map(crate::guest::convert::options_in),
                            };
                            value = Some(v);
                            Event::Loaded(loaded)
                        }
                        Some(Ok(Err(e))) => {
                            loader_error = Some(e.into());
                            Event::LoadFailed
                        }
                    }
                }
                // Only ever the answer to `load-slow` or `load-overdue`, handled above.
                Action::AnswerStale(_) | Action::KeepLoading | Action::AnswerTimedOut => {
                    return Err(Error::guest(
                        "the flight answered early out of turn",
                        "broken contract",
                    ));
                }
                Action::WriteL2(mut write) => {
                    l1_ticket = inner.l1.ticket_since(key, named);
                    if !options.tags.is_empty() {
                        let tagged = crate::guest::policy::Tagged {
                            written_at_ms: written_at,
                            tags: options.tags.to_vec(),
                        };
                        let (header, ttl) = inner.policy.tag_plan(
                            &write.header,
                            write.store_ttl_ms,
                            &tagged,
                            inner.clock.now_ms(),
                        )?;
                        write.header = header;
                        write.store_ttl_ms = ttl;
                        written_tags = Some(tagged);
                    }
                    let v = value.as_deref().unwrap_or_default();
                    let mut stored = Vec::with_capacity(write.header.len() + v.len());
                    stored.extend_from_slice(&write.header);
                    stored.extend_from_slice(v);
                    let entries = &inner.stores.entries;
                    // Fenced (contract §5.12): only over what the last read found, so a
                    // set or removal since then wins over this load.
                    let written = match fence.take() {
                        Some(holds) => entries.set_if(&names.entry, holds, stored.into(), write.store_ttl_ms),
                        None => {
                            let name = names.entry.as_str();
                            Box::pin(async move {
                                entries
                                    .set(name, stored.into(), write.store_ttl_ms)
                                    .await
                                    .map(|()| true)
                            })
                        }
                    };
                    match self.l2_op(by(deadline, written)).await {
                        Ok(true) => Event::L2Written,
                        Ok(false) => {
                            Metrics::bump(&inner.metrics.fills_refused);
                            tracing::debug!(key, "fill refused: the key was written since the load began");
                            Event::L2WriteFailed
                        }
                        Err(e) => {
                            crate::throttle::warn_every!(10, key, error = %e, "L2 write failed; the value is returned uncached");
                            Event::L2WriteFailed
                        }
                    }
                }
                Action::Finish(finish) => {
                    record_outcome(&finish.outcome);
                    let result = match finish.outcome {
                        FlightOutcome::LoaderFailed => Err(Error::loader(
                            loader_error.take().unwrap_or_else(|| "loader failed".into()),
                        )),
                        FlightOutcome::TimedOut => Err(Error::new(
                            crate::ErrorKind::Timeout,
                            "the loader ran past the get-or-set's hard timeout (nothing was cached)",
                        )),
                        FlightOutcome::Stale(_) => Ok(Served {
                            value: stale.take().unwrap_or_default(),
                            stale: true,
                        }),
                        FlightOutcome::Skipped => Err(Error::new(
                            crate::ErrorKind::Unavailable,
                            "the refresh did not run: another process holds the lock, or the store failed",
                        )),
                        _ => Ok(Served {
                            value: value.take().unwrap_or_default(),
                            stale: false,
                        }),
                    };
                    if options.refresh && matches!(finish.outcome, FlightOutcome::Loaded(true)) {
                        Metrics::bump(&inner.metrics.refreshes);
                    }
                    // Followers get the outcome now, not after two more store round trips.
                    if let Some(guard) = followers.take() {
                        share(guard, &result);
                    }
                    // An L2 hit due for an eager refresh (only for a flight in a task of
                    // its own): the refresh joins the refreshes' registry before the caller
                    // is answered, so whoever the caller tells finds it running.
                    let refresh_due = detached
                        && !options.refresh
                        && matches!(finish.outcome, FlightOutcome::L2Hit(_))
                        && finish.refresh_at_ms.is_some_and(|at| inner.clock.now_ms() >= at);
                    if refresh_due && let Join::Leader(guard) = inner.refreshes.join(key) {
                        *refresh = Some(guard);
                    }
                    if let Some(tx) = answer.take() {
                        let _ = tx.send(match &result {
                            Ok(served) => Ok(served.clone()),
                            Err(e) => Err(e.share()),
                        });
                    }
                    // The release has a deadline of its own (the steps before may have
                    // spent theirs); until it is confirmed the lock stays owed, so a caller
                    // that goes away now, or a release that fails, releases it in the
                    // background instead of leaving it to its TTL.
                    let closing = Instant::now() + inner.flight.store_timeout;
                    held.releasing = finish.release;
                    if finish.release
                        && let Some(owner) = held.owner.clone()
                    {
                        let released = by(
                            closing,
                            inner.stores.flight_lock.release(&names.flight_lock, &owner),
                        )
                        .await;
                        match released {
                            Ok(_) => held.owner = None,
                            Err(e) => {
                                crate::throttle::warn_every!(10, key, error = %e, "lock release failed; retried in the background");
                                held.release_in_background();
                            }
                        }
                    }
                    held.done = true;
                    let deadline = closing;
                    if finish.notify
                        && let Err(e) = by(deadline, inner.stores.notifications.announce(key)).await
                    {
                        tracing::debug!(key, error = %e, "landing announcement failed; waiters fall back to polling");
                    }
                    if !options.refresh {
                        self.count_outcome(key, finish.outcome, served_stale_early);
                    }
                    // Fenced: not over a write this process made since the last L2 step.
                    if let (Ok(served), Some(mut until_ms)) = (&result, finish.l1_until_ms) {
                        // A tagged value: what the read judged, or the load's own tags
                        // judged now (an invalidation may have come since it began).
                        let loaded = matches!(finish.outcome, FlightOutcome::Loaded(_));
                        let tags = match (loaded, written_tags.take()) {
                            (true, Some(tagged)) => {
                                match self.stamp_written(tagged, inner.clock.now_ms()).await {
                                    Ok(Some(stamp)) => Some(stamp),
                                    _ => return result,
                                }
                            }
                            _ => stamp.take(),
                        };
                        let tagged = match tags {
                            Some(s) => {
                                until_ms = until_ms.min(s.until_ms);
                                s.tagged
                            }
                            None if served.stale => Some(read_tag_epoch),
                            None => None,
                        };
                        let entry = L1Entry {
                            value: served.value.clone(),
                            until_ms,
                            stale: served.stale,
                            // Due already: the refresh starts now, not on the next hit.
                            refresh_at_ms: finish.refresh_at_ms.filter(|_| !refresh_due),
                            tagged,
                        };
                        inner.l1.fill_entry(key, entry, l1_ticket);
                    }
                    return result;
                }
            };
            now = inner.clock.now_ms();
            let (state, next) = inner.policy.flight_step(held.state, event, now)?;
            held.state = state;
            action = next;
        }
    }

    /// The flight configuration of a get-or-set with `options`: the call's own settings,
    /// else the cache's. `answering`: the caller can be answered before the flight ends
    /// (a flight in a task of its own, see [`fetch`](Self::fetch)).
    pub(super) fn flight_config(&self, options: &LoadOptions, answering: bool) -> wflight::FlightConfig {
        let flight = &self.inner.flight;
        // The cache's defaults for what needs the load to outlive its caller apply only
        // to flights in a task of their own (`fetch`, a refresh).
        let detached = answering || options.refresh;
        wflight::FlightConfig {
            lock_wait_ms: flight.lock_wait_ms,
            lock_ttl_ms: flight.lock_ttl_ms,
            l1_ttl_ms: self.inner.l1_ttl_ms,
            degraded_l1_ttl_ms: flight.degraded_l1_ttl_ms,
            fail_safe_throttle_ms: flight.fail_safe_throttle_ms,
            hard_timeout_ms: options.hard_timeout_ms.or(flight.hard_timeout_ms),
            soft_timeout_ms: options
                .soft_timeout_ms
                .or(flight.soft_timeout_ms.filter(|_| detached)),
            eager_refresh_permille: options
                .eager_refresh_permille
                .or(flight.eager_refresh_permille.filter(|_| detached)),
            // Only a caller that can be answered before the load ends: never a refresh.
            background_completion: options.background_completion && answering,
            refresh: options.refresh,
            bypass: options.bypass,
        }
    }

    /// Counts how a flight ended; `served_stale_early`: its stale copy was served (and
    /// counted) at a timeout already.
    fn count_outcome(&self, key: &str, outcome: FlightOutcome, served_stale_early: bool) {
        let m = &self.inner.metrics;
        match outcome {
            FlightOutcome::L2Hit(_) => Metrics::bump(&m.l2_hits),
            FlightOutcome::Loaded(_) | FlightOutcome::LoaderFailed => Metrics::bump(&m.misses),
            FlightOutcome::Degraded(timed_out) => {
                Metrics::bump(&m.misses);
                Metrics::bump(&m.degraded);
                if timed_out {
                    Metrics::bump(&m.lock_timeouts);
                }
                crate::throttle::warn_every!(
                    10,
                    key,
                    timed_out,
                    "distributed lock unavailable: loaded uncached"
                );
            }
            FlightOutcome::Stale(cause) => {
                Metrics::bump(&m.misses);
                if !served_stale_early {
                    Metrics::bump(&m.stale_served);
                }
                match cause {
                    StaleCause::LoadTimedOut => Metrics::bump(&m.hard_timeouts),
                    StaleCause::LockTimedOut => Metrics::bump(&m.lock_timeouts),
                    StaleCause::LoaderFailed | StaleCause::StoreFailed => {}
                }
                crate::throttle::warn_every!(
                    10,
                    key,
                    ?cause,
                    "reload failed: served the stale copy (fail-safe)"
                );
            }
            FlightOutcome::TimedOut => {
                Metrics::bump(&m.misses);
                Metrics::bump(&m.hard_timeouts);
            }
            FlightOutcome::Skipped => {}
        }
    }
}

impl Corral {
    /// The span of one flight (the get-or-set driven by this caller): the guest's
    /// decisions are logged in it, and its `outcome` recorded at the finish.
    fn flight_span(&self, key: &str) -> tracing::Span {
        let prefix = &self.inner.prefix;
        tracing::debug_span!("corral.flight", key = %key, prefix = %prefix, outcome = tracing::field::Empty)
    }
}

/// Logs what the guest decided the flight does next (in the flight's span). Variants are
/// matched by name only, so a change of their payloads does not touch this.
// `Load { .. }` matches the variant with or without a payload.
#[allow(clippy::unneeded_struct_pattern)]
fn trace_action(action: &Action) {
    match action {
        Action::ReadL2 => tracing::debug!(action = "read_l2", "flight action"),
        Action::TryLock(ttl_ms) => tracing::debug!(action = "try_lock", ttl_ms, "flight action"),
        Action::Wait(until_ms) => tracing::debug!(action = "wait", until_ms, "flight action"),
        Action::Load { .. } => tracing::debug!(action = "load", detail = ?action, "flight action"),
        Action::WriteL2(write) => {
            tracing::debug!(
                action = "write_l2",
                store_ttl_ms = write.store_ttl_ms,
                "flight action"
            );
        }
        Action::Finish(finish) => tracing::debug!(
            action = "finish",
            outcome = ?finish.outcome,
            release = finish.release,
            notify = finish.notify,
            l1_until_ms = ?finish.l1_until_ms,
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

/// Counts a flight in a task of its own while it runs.
struct Running(Arc<std::sync::atomic::AtomicUsize>);

impl Running {
    fn start(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Running(count.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What a flight left: its result, the loader if it was not called, and, when the value
/// it served (an L2 hit) is due for an eager refresh, the registry's lead for it.
struct Led<F> {
    result: Result<Served>,
    loader: Option<F>,
    refresh: Option<LeaderGuard<Outcome>>,
}

/// Hands a flight's `result` to its followers; a panicking loader, or a bad argument, is
/// its caller's failure, not the key's: the flight goes to a follower at once (§5.11).
fn share(guard: LeaderGuard<Outcome>, result: &Result<Served>) {
    match result {
        // A bad argument is this caller's too: its followers may have asked well.
        Err(e) if e.is_panic() || e.kind() == crate::ErrorKind::InvalidArgument => drop(guard),
        Ok(value) => guard.finish(Ok(value.clone())),
        Err(e) => guard.finish(Err(Arc::new(e.share()))),
    }
}

/// Runs a store `step` until `deadline`; one still running then has failed.
async fn by<T>(deadline: Instant, step: impl Future<Output = Result<T>>) -> Result<T> {
    timeout_at(deadline, step).await.unwrap_or_else(|_| {
        Err(Error::new(
            crate::ErrorKind::Timeout,
            "the get-or-set's deadline for store steps passed",
        ))
    })
}

/// A leader's flight in progress. Dropped before it finishes (the caller's future was
/// dropped), it asks the guest whether the flight owes a lock release, and releases in
/// the background; a lock try whose answer never came is released the same way.
struct HeldFlight<'a> {
    cache: &'a Corral,
    key: &'a str,
    lock_name: &'a str,
    state: wflight::FlightState,
    /// The token of the lock this flight holds or is trying to take.
    owner: Option<String>,
    /// A try with `owner` was sent and its answer has not come back.
    unanswered: bool,
    /// The flight finished and owes the release now under way.
    releasing: bool,
    done: bool,
}

impl HeldFlight<'_> {
    /// Releases `owner`'s lock (owner-checked) in the background, then tells waiting
    /// processes, so one of them takes over at once.
    fn release_in_background(&mut self) {
        let Some(owner) = self.owner.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let stores = self.cache.inner.stores.clone();
        let (key, name) = (self.key.to_owned(), self.lock_name.to_owned());
        runtime.spawn(async move {
            match stores.flight_lock.release(&name, &owner).await {
                Ok(_) => {
                    let _ = stores.notifications.announce(&key).await;
                }
                Err(e) => crate::throttle::warn_every!(10, key, error = %e, "releasing an abandoned lock failed; it expires by its TTL"),
            }
        });
    }
}

impl Drop for HeldFlight<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let owed = self.cache.inner.policy.flight_abandon(self.state).unwrap_or(true);
        if owed || self.unanswered || self.releasing {
            self.release_in_background();
        }
    }
}
