//! Many keys, one load each: [`Corral::get_or_set_many`].
//!
//! Every key of a batch is a flight of its own, stepped by the guest's flight machine
//! through the same driver as a single get-or-set, so each key keeps every promise of
//! one (fenced fills, `should_cache`, tags, fail-safe, timeouts, metrics). What a batch
//! changes is how its flights meet the store and the loader:
//! - L1 hits are served at once. Every other key joins this process's flight registry:
//!   a key another caller leads is awaited, the rest are led here.
//! - The led keys' first L2 reads go out together ([`Corral::l2_look_many`]: one `MGET`
//!   per node for the keys a plain read serves).
//! - The loader is called once with every led key whose flight reached its load, as soon
//!   as the batch is quiet: none of its flights is between two store steps (a flight
//!   waiting for another process's landing is not). So the keys whose misses were found
//!   together are loaded together; a key whose lock holder gave up later is loaded in a
//!   call of its own. `max_batch` splits a call.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::Shared;
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};
use tracing::Instrument;

use super::driver::{Callers, FirstRead};
use super::held::{in_ms, past_deadline, share};
use super::{BoxError, Served};
use crate::cache::Corral;
use crate::cache::load::LoadOptions;
use crate::cache::metrics::Metrics;
use crate::cache::registry::{self, Join, LeaderGuard, Outcome};
use crate::guest::policy::StoreNames;
use crate::{Error, ErrorKind, Result};

/// What the loader returned for one call of a batch: every key of the call shares it.
#[derive(Clone)]
enum Chunk {
    Loaded(Arc<HashMap<String, Bytes>>),
    Failed(Arc<BoxError>),
    Panicked(Arc<str>),
}

/// A loader call's answer, or its panic.
type Caught<T> = std::result::Result<T, Box<dyn std::any::Any + Send + 'static>>;

fn chunk_of<I, V, E>(loaded: Caught<std::result::Result<I, E>>) -> Chunk
where
    I: IntoIterator<Item = (String, V)>,
    V: Into<Bytes>,
    E: Into<BoxError>,
{
    match loaded {
        Ok(Ok(values)) => Chunk::Loaded(Arc::new(values.into_iter().map(|(k, v)| (k, v.into())).collect())),
        Ok(Err(e)) => Chunk::Failed(Arc::new(e.into())),
        Err(panic) => Chunk::Panicked(panic_text(&*panic).into()),
    }
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".to_owned())
}

/// The batch loader returned no value for a key: the key is absent (`None`), and
/// nothing is cached for it.
#[derive(Debug)]
pub(crate) struct Absent;

impl fmt::Display for Absent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the batch loader returned no value for this key")
    }
}

impl std::error::Error for Absent {}

/// A batch loader's error, the same for every key of its call.
#[derive(Debug)]
pub(crate) struct BatchLoaderError(pub(crate) Arc<BoxError>);

impl fmt::Display for BatchLoaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for BatchLoaderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Whether a batch's flights are all quiet: how many are between two store steps
/// (`busy`), and which keys wait for the loader.
pub(super) struct Quiet {
    state: Mutex<QuietState>,
    /// Woken when the batch turns quiet, and when a loader call is made.
    wake: Notify,
}

struct QuietState {
    busy: usize,
    ready: BTreeSet<usize>,
}

impl Quiet {
    fn new() -> Self {
        Quiet {
            state: Mutex::new(QuietState {
                busy: 0,
                ready: BTreeSet::new(),
            }),
            wake: Notify::new(),
        }
    }

    /// A flight of the batch: busy until the seat is dropped.
    fn seat(&self) -> Seat<'_> {
        self.state.lock().busy += 1;
        Seat(self)
    }

    /// The flight holding a seat waits for something outside the batch (another
    /// process's landing): not busy until the guard is dropped.
    pub(super) fn idle(&self) -> Idle<'_> {
        self.rest(None);
        Idle {
            quiet: self,
            ready: None,
        }
    }

    /// The flight holding a seat waits for the loader with key `index`.
    fn ready(&self, index: usize) -> Idle<'_> {
        self.rest(Some(index));
        Idle {
            quiet: self,
            ready: Some(index),
        }
    }

    fn rest(&self, ready: Option<usize>) {
        let mut state = self.state.lock();
        state.busy = state.busy.saturating_sub(1);
        if let Some(index) = ready {
            state.ready.insert(index);
        }
        let quiet = state.busy == 0 && !state.ready.is_empty();
        drop(state);
        if quiet {
            self.wake.notify_waiters();
        }
    }

    /// The keys waiting for the loader, taken, if the batch is quiet.
    fn take_if_quiet(&self) -> Vec<usize> {
        let mut state = self.state.lock();
        if state.busy > 0 {
            return Vec::new();
        }
        std::mem::take(&mut state.ready).into_iter().collect()
    }
}

/// A flight's place in its batch (see [`Quiet::seat`]).
struct Seat<'a>(&'a Quiet);

impl Drop for Seat<'_> {
    fn drop(&mut self) {
        self.0.rest(None);
    }
}

/// A flight at rest (see [`Quiet::idle`]): busy again when dropped.
pub(super) struct Idle<'a> {
    quiet: &'a Quiet,
    ready: Option<usize>,
}

impl Drop for Idle<'_> {
    fn drop(&mut self) {
        let mut state = self.quiet.state.lock();
        state.busy += 1;
        if let Some(index) = self.ready {
            state.ready.remove(&index);
        }
    }
}

/// The loader of one batch and its calls. `call` starts one loader call (what it
/// answers, judged by [`chunk_of`]); the flights of its keys share it, and it runs on
/// while any of them waits for it.
struct Loads<'a, M, C: Future> {
    keys: &'a [String],
    call: M,
    max_batch: usize,
    quiet: Quiet,
    /// Per key, the call that loads it, once made (taken by the key's flight).
    calls: Mutex<Vec<Option<Shared<C>>>>,
}

impl<'a, M, C> Loads<'a, M, C>
where
    M: Fn(Vec<String>) -> C,
    C: Future<Output = Chunk>,
{
    fn new(keys: &'a [String], call: M, max_batch: usize) -> Self {
        Loads {
            keys,
            call,
            max_batch: max_batch.max(1),
            quiet: Quiet::new(),
            calls: Mutex::new(keys.iter().map(|_| None).collect()),
        }
    }

    /// The load of key `index`, as its flight's loader: waits until the batch is quiet,
    /// then shares one loader call with the keys that are ready with it.
    async fn load(&self, index: usize) -> std::result::Result<Bytes, BoxError> {
        let ready = self.quiet.ready(index);
        let call = loop {
            let woken = self.quiet.wake.notified();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            if let Some(call) = self.take_call(index) {
                break call;
            }
            self.call_if_quiet();
            if let Some(call) = self.take_call(index) {
                break call;
            }
            woken.await;
        };
        let chunk = call.await;
        drop(ready);
        match chunk {
            Chunk::Loaded(values) => values
                .get(&self.keys[index])
                .cloned()
                .ok_or_else(|| Box::new(Absent) as BoxError),
            Chunk::Failed(e) => Err(Box::new(BatchLoaderError(e))),
            // The driver catches it: a panic is its caller's, as for one key.
            Chunk::Panicked(what) => std::panic::resume_unwind(Box::new(what.to_string())),
        }
    }

    fn take_call(&self, index: usize) -> Option<Shared<C>> {
        self.calls.lock()[index].take()
    }

    /// Calls the loader for the keys waiting for it, if the batch is quiet: one call
    /// per `max_batch` of them, in the order they were asked for.
    fn call_if_quiet(&self) {
        let due = self.quiet.take_if_quiet();
        if due.is_empty() {
            return;
        }
        let made: Vec<(&[usize], Shared<C>)> = due
            .chunks(self.max_batch)
            .map(|group| {
                let keys = group.iter().map(|&i| self.keys[i].clone()).collect();
                (group, (self.call)(keys).shared())
            })
            .collect();
        let mut calls = self.calls.lock();
        for (group, call) in made {
            for &i in group {
                calls[i] = Some(call.clone());
            }
        }
        drop(calls);
        self.quiet.wake.notify_waiters();
    }
}

/// How a key of a batch is answered.
enum Part {
    /// This caller leads its flight (`None`: a bypass, outside the registry).
    Lead(Option<LeaderGuard<Outcome>>),
    /// Another caller in this process leads it.
    Follow(oneshot::Receiver<registry::Shared<Outcome>>),
}

impl Corral {
    /// The values under `keys`, loading the missing ones with one call of `loader`:
    /// [`get_or_set`](Self::get_or_set) for many keys at once. Each key is loaded at
    /// most once per flight across every caller in this process and every process
    /// sharing the Redis, however the callers' keys overlap; `loader` gets the keys this
    /// caller leads, all at once, and returns a value per key it found.
    ///
    /// - L1 hits are returned at once; the other keys are read from L2 in one round
    ///   trip (one `MGET` per node).
    /// - A key another caller in this process is loading is awaited; a key another
    ///   process is loading is awaited through its landing, as for one key.
    /// - The misses this caller leads are locked each with its own lock, then loaded
    ///   together: one `loader` call with every one of them
    ///   ([`LoadOptions::max_batch`] splits it).
    /// - A key `loader` leaves out is absent: `Ok(None)`, nothing cached. A `loader`
    ///   error is the error of every key of its call, and of every caller waiting for
    ///   those keys.
    /// - Per key, everything one get-or-set promises: fenced fills, `should_cache`,
    ///   tags, fail-safe (a key whose load failed or came back absent is served its
    ///   stale copy, if fail-safe kept one), the hard timeout, metrics.
    ///
    /// The answer is one result per key asked for, in order (a key asked twice is
    /// loaded once, answered twice).
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) -> corral::Result<()> {
    /// use std::collections::HashMap;
    /// use std::time::Duration;
    /// use corral::LoadOptions;
    ///
    /// let ids = ["product:1", "product:2", "product:3"];
    /// let found = cache
    ///     .get_or_set_many(ids, LoadOptions::relative(Duration::from_secs(60)), |keys| async move {
    ///         // One query for every key this caller must load.
    ///         let rows: HashMap<String, Vec<u8>> =
    ///             keys.into_iter().map(|k| (k.clone(), k.into_bytes())).collect();
    ///         Ok::<_, std::io::Error>(rows)
    ///     })
    ///     .await?;
    /// for (id, value) in ids.iter().zip(found) {
    ///     match value? {
    ///         Some(bytes) => println!("{id}: {} bytes", bytes.len()),
    ///         None => println!("{id}: no such product"),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key (it names the key) or bad options,
    /// before anything runs. Per key: [`ErrorKind::Loader`] with the loader's error as
    /// the source ([`Error::loader_error`] downcasts it), a timeout, as for one key.
    pub async fn get_or_set_many<K, L, Fut, I, V, E>(
        &self,
        keys: impl IntoIterator<Item = K>,
        options: impl Into<LoadOptions>,
        loader: L,
    ) -> Result<Vec<Result<Option<Bytes>>>>
    where
        K: AsRef<str>,
        L: Fn(Vec<String>) -> Fut,
        Fut: Future<Output = std::result::Result<I, E>>,
        I: IntoIterator<Item = (String, V)>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        let options = options.into();
        Self::in_caller_only(&options)?;
        if options.max_batch == Some(0) {
            return Err(Error::invalid_argument("max_batch", "must be at least 1"));
        }
        // Each key once, in the order first asked for.
        let mut distinct: Vec<String> = Vec::new();
        let mut index_of: HashMap<String, usize> = HashMap::new();
        let mut asked = Vec::new();
        for key in keys {
            let key = key.as_ref();
            let index = match index_of.get(key) {
                Some(&i) => i,
                None => {
                    // Every key, not only the first: the judgement of options is
                    // remembered, and a remembered one does not look at the key.
                    self.inner.policy.validate_key(key)?;
                    self.judge(key, &options)?;
                    index_of.insert(key.to_owned(), distinct.len());
                    distinct.push(key.to_owned());
                    distinct.len() - 1
                }
            };
            asked.push(index);
        }
        let answers = self.many(&distinct, &options, &loader).await;
        Ok(asked
            .into_iter()
            .map(|i| match &answers[i] {
                Ok(served) => Ok(Some(served.value.clone())),
                Err(e) if e.is_absent() => Ok(None),
                Err(e) => Err(e.clone()),
            })
            .collect())
    }

    /// Every key of `keys` (distinct), answered.
    async fn many<L, Fut, I, V, E>(
        &self,
        keys: &[String],
        options: &LoadOptions,
        loader: &L,
    ) -> Vec<Result<Served>>
    where
        L: Fn(Vec<String>) -> Fut,
        Fut: Future<Output = std::result::Result<I, E>>,
        I: IntoIterator<Item = (String, V)>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        let inner = &*self.inner;
        let call = |keys: Vec<String>| {
            let running = AssertUnwindSafe(loader(keys)).catch_unwind();
            async move { chunk_of(running.await) }
        };
        let loads = Loads::new(keys, call, options.max_batch.unwrap_or(usize::MAX));
        let mut answers: Vec<Option<Result<Served>>> = keys.iter().map(|_| None).collect();
        let now = inner.clock.now_ms();
        let mut parts = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if options.bypass {
                parts.push((i, Part::Lead(None)));
                continue;
            }
            if let Some((value, stale)) = inner.l1.get_served(key, now) {
                Metrics::bump(&inner.metrics.l1_hits);
                if stale {
                    Metrics::bump(&inner.metrics.stale_served);
                }
                answers[i] = Some(Ok(Served { value, stale }));
                continue;
            }
            parts.push((i, self.join_flight(key)));
        }
        // The led keys hold their seats from now: no load is made before every one of
        // them has read L2.
        let led: Vec<usize> = parts
            .iter()
            .filter(|(_, part)| matches!(part, Part::Lead(Some(_))))
            .map(|(i, _)| *i)
            .collect();
        let mut seats: HashMap<usize, Seat<'_>> = led.iter().map(|&i| (i, loads.quiet.seat())).collect();
        let mut firsts = self.first_reads(keys, &led).await;
        // A loop, not a closure: the futures' borrows stay of one lifetime (a closure's
        // would be higher-ranked, and the future not provably `Send`).
        let mut indices = Vec::with_capacity(parts.len());
        let mut flights = Vec::with_capacity(parts.len());
        for (i, part) in parts {
            let (seat, first) = (seats.remove(&i), firsts.remove(&i));
            indices.push(i);
            flights.push(self.one_of_many(i, &keys[i], options, &loads, part, seat, first));
        }
        let answered = futures::future::join_all(flights).await;
        for (i, answer) in indices.into_iter().zip(answered) {
            answers[i] = Some(answer);
        }
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    Err(Error::guest(
                        "a key of the batch went unanswered",
                        "broken contract",
                    ))
                })
            })
            .collect()
    }

    /// Joins the flight of `key` in this process, or leads it.
    fn join_flight(&self, key: &str) -> Part {
        let inner = &*self.inner;
        match inner.registry.join(key, inner.l1.ticket(key)) {
            Join::Leader(guard) => Part::Lead(Some(guard)),
            Join::Follower(rx) => Part::Follow(rx),
        }
    }

    /// The first L2 reads of the keys `led` (indices into `keys`), made together, each
    /// with the tickets taken before it and the deadline it began.
    async fn first_reads(&self, keys: &[String], led: &[usize]) -> HashMap<usize, (StoreNames, FirstRead)> {
        let inner = &*self.inner;
        let deadline = in_ms(inner.flight.store_budget.before_load_ms);
        let mut located = Vec::with_capacity(led.len());
        for &i in led {
            // Taken before the names: L1 is never filled across a clear after them.
            let named = inner.l1.ticket(&keys[i]);
            // A key that cannot be named now is named, or fails, in its own flight.
            if let Ok(names) = self.locate(&keys[i]).await {
                located.push((i, named, names));
            }
        }
        let tag_epoch = inner.l1.tag_epoch();
        let tickets: Vec<_> = located
            .iter()
            .map(|(i, named, _)| inner.l1.ticket_since(&keys[*i], *named))
            .collect();
        let entries: Vec<&str> = located.iter().map(|(_, _, names)| names.entry.as_str()).collect();
        let now = inner.clock.now_ms();
        let reads = match tokio::time::timeout_at(deadline, self.l2_look_many(&entries, now)).await {
            Ok(reads) => reads,
            Err(_) => entries.iter().map(|_| Err(past_deadline())).collect(),
        };
        located
            .into_iter()
            .zip(tickets)
            .zip(reads)
            .map(|(((i, named, names), l1_ticket), read)| {
                let first = FirstRead {
                    named,
                    l1_ticket,
                    tag_epoch,
                    read,
                    deadline,
                };
                (i, (names, first))
            })
            .collect()
    }

    /// One key of a batch, answered: followed, or led (then its flight's loader is the
    /// batch's).
    #[allow(clippy::too_many_arguments)]
    async fn one_of_many<M, C>(
        &self,
        index: usize,
        key: &str,
        options: &LoadOptions,
        loads: &Loads<'_, M, C>,
        mut part: Part,
        mut seat: Option<Seat<'_>>,
        first: Option<(StoreNames, FirstRead)>,
    ) -> Result<Served>
    where
        M: Fn(Vec<String>) -> C,
        C: Future<Output = Chunk>,
    {
        loop {
            match part {
                Part::Follow(rx) => match registry::follow(rx).await {
                    registry::Shared::Done(outcome) => {
                        Metrics::bump(&self.inner.metrics.coalesced);
                        return outcome.map_err(Error::from_shared);
                    }
                    // Its leader went away without an outcome: join again.
                    registry::Shared::Gone => part = self.join_flight(key),
                },
                Part::Lead(guard) => {
                    let _seat = seat.take().unwrap_or_else(|| loads.quiet.seat());
                    let mut followers = guard;
                    let mut loader = Some(move || loads.load(index));
                    let (mut answer, mut refresh) = (None, None);
                    let callers = Callers {
                        loader: &mut loader,
                        followers: &mut followers,
                        answer: &mut answer,
                        refresh: &mut refresh,
                        batch: Some(&loads.quiet),
                    };
                    let result = self
                        .fly(key, options, callers, first)
                        .instrument(self.flight_span(key))
                        .await;
                    if let Some(guard) = followers {
                        share(guard, &result);
                    }
                    return result;
                }
            }
        }
    }
}

impl Error {
    /// A batch loader left this key out (see [`Corral::get_or_set_many`]).
    pub(crate) fn is_absent(&self) -> bool {
        self.kind() == ErrorKind::Loader && self.loader_error::<Absent>().is_some()
    }
}

#[cfg(test)]
mod send_check {
    use super::*;
    fn send<T: Send>(_: T) {}
    #[allow(dead_code, unused_must_use)]
    fn futures_are_send(c: &Corral, keys: &[String], o: &LoadOptions) {
        send(c.l2_look_many(&[], 0));
        send(c.first_reads(keys, &[]));
        let loader = |_: Vec<String>| async { Ok::<_, std::io::Error>(Vec::<(String, Bytes)>::new()) };
        send(c.many(keys, o, &loader));
        let loads = Loads::new(keys, |_| async { Chunk::Panicked("".into()) }, 1);
        send(loads.load(0));
        send(c.one_of_many(0, "k", o, &loads, Part::Lead(None), None, None));
    }
}
