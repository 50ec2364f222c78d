//! Get-or-set and fetch: the callers of a key in this process join one flight (the
//! registry), and its leader runs the guest's flight machine through the native driver
//! ([`driver`]), which performs each action and decides nothing (contract §5).

mod batch;
mod driver;
mod held;

pub(crate) use batch::distinct_keys;

use std::sync::Arc;

use bytes::Bytes;
use tracing::Instrument;

use self::driver::{Callers, Driver, FirstRead};
use self::held::{HeldFlight, in_ms, share};
use super::Corral;
use super::load::{LoadOptions, Served};
use super::metrics::Metrics;
use super::registry::{Join, LeaderGuard, Outcome, UNCHANGED};
use crate::guest::policy::wflight::{self, Outcome as FlightOutcome, StaleCause};
use crate::guest::policy::{NextRead, StoreNames};
use crate::store::l1::Ticket;
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
    /// fail-safe served in place of a failed reload (contract §7.1; see
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
        let mut options = options.into();
        Self::in_caller_only(&options)?;
        self.judge(key, &mut options)?;
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
        match self.lead_or_follow(key).await {
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
        let mut options = options.into();
        self.judge(key, &mut options)?;
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
        match self.lead_or_follow(key).await {
            Ok(guard) => {
                let (tx, rx) = oneshot::channel();
                let (cache, key, span) = (self.clone(), key.to_owned(), self.flight_span(key));
                let running = Running::start(&self.inner.background);
                self.inner.owed.spawn(async move {
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

    /// Joins the flight of `key` in this process until this caller leads or gets an
    /// outcome. A key a batch's loader left out is no outcome for a caller with a loader
    /// of its own: it joins again, and loads the key if nobody else does.
    async fn lead_or_follow(&self, key: &str) -> std::result::Result<LeaderGuard<Outcome>, Outcome> {
        loop {
            match self
                .inner
                .registry
                .lead_or_follow(key, || self.inner.l1.ticket(key))
                .await
            {
                Err(Err(e)) if e.is_absent() => continue,
                joined => return joined,
            }
        }
    }

    /// Checks that `options` ask for nothing that needs the load to outlive the call,
    /// which only `fetch` can promise.
    fn in_caller_only(options: &LoadOptions) -> Result<()> {
        options.refuse_outliving(
            false,
            "needs a loader that may run on after the call returns: use Corral::fetch, whose \
             loader is Send + 'static",
        )
    }

    /// Starts one eager refresh of `key` in the background (contract §7.3), unless a
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
            None => match self.inner.refreshes.join(key, UNCHANGED) {
                Join::Leader(guard) => guard,
                Join::Follower(_) => return,
            },
        };
        let mut options = options.clone();
        options.refresh = true;
        let (cache, key, span) = (self.clone(), key.to_owned(), self.flight_span(key));
        let running = Running::start(&self.inner.background);
        self.inner.owed.spawn(async move {
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
        let callers = Callers {
            loader: &mut loader,
            followers,
            answer,
            refresh: &mut refresh,
            batch: None,
            began: None,
        };
        let result = self.fly(key, options, callers, None).await;
        Led {
            result,
            loader,
            refresh,
        }
    }

    /// Runs one flight to its end: the guest's machine decides, the driver performs. It
    /// starts from the verdict its call's options got (`LoadOptions::judged_ms`).
    async fn fly<F, Fut, V, E>(
        &self,
        key: &str,
        options: &LoadOptions,
        callers: Callers<'_, F>,
        first: Option<FirstRead>,
    ) -> Result<Served>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<V, E>>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        let inner = &*self.inner;
        let config = self.flight_config(options, callers.answer.is_some());
        let now = inner.clock.now_ms();
        let judged = options.judged_ms.unwrap_or(now);
        let (state, action) = inner
            .policy
            .flight_start(key, &options.entry, config, judged, now)?;
        if !options.tags.is_empty() {
            inner.policy.check_tags(&options.tags)?;
        }
        // Taken before the names (a batch's, before its first read named the entry): L1
        // is never filled across a clear after them.
        let named = first
            .as_ref()
            .map_or_else(|| inner.l1.ticket(key), |read| read.named);
        let (names, first) = match first {
            Some(read) => self.batch_key_names(key, read).await?,
            None => self.locate_reading(key, named).await?,
        };
        let held = HeldFlight::new(self, key, &names.flight_lock, state);
        let driver = Driver::new(self, key, options, &names.entry, held, callers, named, now, first);
        driver.run(action).await
    }

    /// The names of a flight that begins with its batch's read of the key (`read`), and
    /// what it begins with. Named in the generation known now, else in the one the batch
    /// named the key in moments ago (read, or standing in for one that could not be
    /// read), unless a newer one was heard since: a batch whose generation could not be
    /// read does not read it again for each key that flies (contract §5.16). Else, as
    /// one key's flight is named ([`Corral::locate`]). The batch's read is the flight's
    /// first only if it read the entry so named: in another generation, the flight reads
    /// the key again. What cannot be named now is not read, written nor locked.
    async fn batch_key_names(
        &self,
        key: &str,
        mut read: FirstRead,
    ) -> Result<(StoreNames, Option<FirstRead>)> {
        let batch = read.batch_generation;
        let (generation, readable) = match (self.known_generation(), batch) {
            (Some(generation), _) => (generation, true),
            (None, Some(generation)) if self.inner.tags.generation_now() == generation => {
                (generation, !read.unnamed)
            }
            _ => self.flight_generation(|| Ok(())).await?,
        };
        let names = self.names_in(key, generation)?;
        // The batch's read, if it read the entry named now (not one it could not name).
        let same = batch == Some(generation);
        let first = match (readable, same) {
            (true, true) if !read.unnamed => Some(read),
            (true, _) => None,
            (false, true) => {
                read.unnamed = true;
                Some(read)
            }
            (false, false) => Some(self.unreadable(key, read.named)),
        };
        Ok((names, first))
    }

    /// A flight's names ([`Corral::locate`]). When the prefix's generation must be read
    /// first, the entry is read with it, in one store call (one `MGET` on one server),
    /// under the generation this process expects (the last one it knew, 0 at first): if
    /// the store's is that one, that read is the flight's first (contract §5.5); else the
    /// flight reads the entry under the store's. A key whose reads slide (a touch) is
    /// named first and read on its own.
    async fn locate_reading(&self, key: &str, named: Ticket) -> Result<(StoreNames, Option<FirstRead>)> {
        let inner = &*self.inner;
        let policy = &inner.policy;
        if let Some(generation) = self.known_generation() {
            return Ok((self.names_in(key, generation)?, None));
        }
        policy.validate_key(key)?;
        let expected = inner.tags.generation_now();
        let names = self.names_in(key, expected)?;
        if !matches!(inner.read_hints.get(&names.entry), None | Some(NextRead::Get)) {
            let (names, readable) = self.locate(key).await?;
            return Ok((names, (!readable).then(|| self.unreadable(key, named))));
        }
        let generation_name = policy.generation_name(&inner.prefix)?;
        let deadline = in_ms(inner.flight.store_budget.before_load_ms);
        let since = inner.tags.heard_so_far();
        let (l1_ticket, tag_epoch) = (inner.l1.ticket_since(key, named), inner.l1.tag_epoch());
        let now = inner.clock.now_ms();
        let both = [generation_name.as_str(), names.entry.as_str()];
        let read =
            tokio::time::timeout(inner.flight.store_timeout, inner.stores.entries.get_many(&both)).await;
        let mut read = read.unwrap_or_default().into_iter();
        let generation = match read.next() {
            Some(Ok(stored)) => self.adopt_generation(since, stored.as_deref(), now).ok(),
            Some(Err(e)) => {
                self.l2_failed(e);
                None
            }
            None => None,
        };
        // Unread (failed, timed out, foreign bytes): the last one known if it may stand
        // in, so the flight goes on to degrade as it would (contract §5.8); else the
        // flight degrades as if its read had failed: what a clear left is never served.
        let Some(generation) = generation.or_else(|| inner.tags.fallback()) else {
            return Ok((names, Some(self.unreadable(key, named))));
        };
        if generation != expected {
            return Ok((self.names_in(key, generation)?, None));
        }
        let first = match read.next() {
            Some(Ok(stored)) => Some(FirstRead {
                named,
                l1_ticket,
                tag_epoch,
                read: self
                    .l2_judge(&names.entry, None, stored.map(|b| (b, None)), now)
                    .await,
                deadline,
                unnamed: false,
                batch_generation: None,
            }),
            _ => None,
        };
        Ok((names, first))
    }

    /// The first read of a flight named in a generation that stands in for one that could
    /// not be read, and may not be read under ([`Corral::locate`]): failed.
    fn unreadable(&self, key: &str, named: Ticket) -> FirstRead {
        let inner = &*self.inner;
        FirstRead {
            named,
            l1_ticket: inner.l1.ticket_since(key, named),
            tag_epoch: inner.l1.tag_epoch(),
            read: Err(generation_unread()),
            deadline: in_ms(inner.flight.store_budget.before_load_ms),
            unnamed: true,
            batch_generation: None,
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
    pub(super) fn count_outcome(&self, key: &str, outcome: FlightOutcome, served_stale_early: bool) {
        let m = &self.inner.metrics;
        match outcome {
            FlightOutcome::L2Hit(_) => Metrics::bump(&m.l2_hits),
            FlightOutcome::Loaded(_) | FlightOutcome::LoaderFailed => Metrics::bump(&m.misses),
            // The fill refused before it was sent (counted by the driver, refreshes' too).
            FlightOutcome::Lapsed => Metrics::bump(&m.misses),
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

/// Counts a flight in a task of its own while it runs (and a removal retried in the
/// background, [`Corral::remove`]).
pub(crate) struct Running(Arc<std::sync::atomic::AtomicUsize>);

impl Running {
    pub(crate) fn start(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
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

/// A store read not made: the prefix's generation could not be read, and the one last
/// known may be older than a clear this process did not hear of.
fn generation_unread() -> Error {
    Error::new(
        crate::ErrorKind::Unavailable,
        "the prefix's generation could not be read, and a clear may have been missed since it last was",
    )
}
