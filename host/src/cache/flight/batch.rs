//! Many keys, one load each: [`Corral::get_or_set_many`].
//!
//! Every key of a batch is a flight of its own, stepped by the guest's flight machine
//! through the same driver as a single get-or-set, so each key keeps every promise of
//! one (fenced fills, `should_cache`, tags, fail-safe, timeouts, metrics). What a batch
//! changes is how its flights meet the store and the loader:
//! - L1 hits are served at once. Of the other keys, one another caller in this process
//!   leads is awaited; the rest are read together ([`Corral::l2_look_many`]: one `MGET`
//!   per node for the keys a plain read serves), and a fresh hit is served from its read.
//! - The keys their reads left unanswered join the registry after the read and are led
//!   here ([`Registry::peek`](registry::Registry::peek), `settle`): a flight of one that
//!   another caller began meanwhile is followed, as if the batch had joined first.
//! - The loader is called once with every led key whose flight reached its load, as soon
//!   as the batch is quiet: none of its flights is between two store steps (a flight
//!   waiting for another process's landing is not). So the keys whose misses were found
//!   together are loaded together; a key whose lock holder gave up later is loaded in a
//!   call of its own. `max_batch` splits a call.

use std::collections::{BTreeSet, HashMap};
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
use crate::cache::L1Fill;
use crate::cache::load::LoadOptions;
use crate::cache::metrics::Metrics;
use crate::cache::read::L2Read;
use crate::cache::registry::{self, Join, LeaderGuard, Outcome, Settled};
use crate::cache::tags::TagStamp;
use crate::clock::Clock;
use crate::error::{Absent, BatchLoaderError, panic_text};
use crate::guest::convert::Parts;
use crate::guest::policy::WitMeta;
use crate::store::l1::Ticket;
use crate::{Error, Result};

/// Until when L1 may serve a batch's hit: judged with the batch's reads, or to be asked
/// of the guest by the entry's metadata.
enum L1Until {
    Judged(u64),
    Ask(WitMeta),
}

/// A batch's hit to fill L1 with, once the batch settled (the key at `at`).
struct HitFill {
    at: usize,
    until: L1Until,
    stamp: Option<TagStamp>,
}

/// A batch's entry names: the generation they are in (known, read, or standing in for
/// one that could not be read), and whether the entries may be read in it.
pub(super) struct Located {
    entries: Parts,
    generation: u64,
    readable: bool,
}

/// What a batch's read left of the keys it read, besides the led keys that fly on.
struct AfterRead {
    /// Led at the look and answered by their reads: their flights end now.
    hits: Vec<(usize, LeaderGuard<Outcome>)>,
    /// Not joined, and not answered by their reads: joined now, each with its read.
    unjoined: Vec<(usize, FirstRead)>,
    /// Not joined, and answered by their reads (their positions in the batch).
    unjoined_hits: Vec<usize>,
}

/// Sorts the keys a batch read (`to_read`, in order) by what their reads left: the
/// keys to fly (`flying`, in the same order), the keys led at the look (`leads`, in the
/// same order). A led key that flies goes to `parts`.
fn after_read(
    to_read: &[usize],
    flying: Vec<(usize, FirstRead)>,
    leads: Vec<(usize, LeaderGuard<Outcome>)>,
    parts: &mut Vec<(usize, Part, Option<FirstRead>)>,
) -> AfterRead {
    // Every key answered by its read, none led at the look: the batch of fresh hits.
    if flying.is_empty() && leads.is_empty() {
        return AfterRead {
            hits: Vec::new(),
            unjoined: Vec::new(),
            unjoined_hits: to_read.to_vec(),
        };
    }
    // The next key to fly, and the next led, each taken only when its turn comes (a
    // read is large to move).
    let (mut flying, mut leads) = (flying.into_iter(), leads.into_iter());
    let (mut next, mut next_lead) = (flying.next(), leads.next());
    let mut after = AfterRead {
        hits: Vec::new(),
        unjoined: Vec::new(),
        unjoined_hits: Vec::with_capacity(to_read.len()),
    };
    for &i in to_read {
        let first = next.take_if(|(at, _)| *at == i).map(|(_, first)| {
            next = flying.next();
            first
        });
        let lead = next_lead.take_if(|(at, _)| *at == i).map(|(_, guard)| {
            next_lead = leads.next();
            guard
        });
        match (lead, first) {
            (Some(guard), Some(first)) => parts.push((i, Part::Lead(Some(guard)), Some(first))),
            (Some(guard), None) => after.hits.push((i, guard)),
            (None, Some(first)) => after.unjoined.push((i, first)),
            (None, None) => after.unjoined_hits.push(i),
        }
    }
    debug_assert!(
        next.is_none() && next_lead.is_none(),
        "a read or a lead matched no key"
    );
    after
}

/// A batch's keys each once, in the order first asked for, with the hash `hash` gives
/// each, and for each key asked the position of its distinct key: a key asked twice is
/// loaded once, answered twice (both bodies, contract §5.16).
pub(crate) fn distinct_keys<K: AsRef<str>>(
    keys: &[K],
    hash: impl Fn(&str) -> u64,
) -> (Vec<&str>, Vec<u64>, Vec<usize>) {
    let all: Vec<u64> = keys.iter().map(|key| hash(key.as_ref())).collect();
    // Most batches ask for each key once, which no two equal hashes says at once.
    let mut sorted = all.clone();
    sorted.sort_unstable();
    if sorted.windows(2).all(|pair| pair[0] != pair[1]) {
        return (
            keys.iter().map(AsRef::as_ref).collect(),
            all,
            (0..keys.len()).collect(),
        );
    }
    let mut distinct: Vec<&str> = Vec::with_capacity(keys.len());
    let mut hashes: Vec<u64> = Vec::with_capacity(keys.len());
    // Each distinct key's position, found by its hash: four bytes a key.
    let mut index_of: hashbrown::HashTable<u32> = hashbrown::HashTable::with_capacity(keys.len());
    let asked = keys
        .iter()
        .zip(all)
        .map(|(key, hashed)| {
            let key = key.as_ref();
            let entry = index_of.entry(
                hashed,
                |&at| distinct[at as usize] == key,
                |&at| hashes[at as usize],
            );
            match entry {
                hashbrown::hash_table::Entry::Occupied(at) => *at.get() as usize,
                hashbrown::hash_table::Entry::Vacant(vacant) => {
                    vacant.insert(distinct.len() as u32);
                    distinct.push(key);
                    hashes.push(hashed);
                    distinct.len() - 1
                }
            }
        })
        .collect();
    (distinct, hashes, asked)
}

/// The answers of a batch's distinct keys (`answers`), in the order asked (`asked`: the
/// position of each key asked among the distinct ones): a key's last asking takes its
/// answer, any earlier one a copy.
fn hand_out<T: Clone>(answers: Vec<T>, asked: &[usize]) -> Vec<T> {
    // As many asked as distinct: each key was asked once, in the order of `answers`.
    if answers.len() == asked.len() {
        return answers;
    }
    let mut left = vec![0u32; answers.len()];
    for &i in asked {
        left[i] += 1;
    }
    let mut answers: Vec<Option<T>> = answers.into_iter().map(Some).collect();
    asked
        .iter()
        .filter_map(|&i| {
            left[i] -= 1;
            if left[i] == 0 {
                answers[i].take()
            } else {
                answers[i].clone()
            }
        })
        .collect()
}

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
        // The answer is read inside the catch too: a lazy iterator, or a value's
        // conversion, may panic as it is taken, and that panic is the loader's.
        Ok(Ok(values)) => {
            let taken = std::panic::catch_unwind(AssertUnwindSafe(|| {
                values.into_iter().map(|(k, v)| (k, v.into())).collect()
            }));
            match taken {
                Ok(values) => Chunk::Loaded(Arc::new(values)),
                Err(panic) => Chunk::Panicked(panic_text(&*panic).into()),
            }
        }
        Ok(Err(e)) => Chunk::Failed(Arc::new(e.into())),
        Err(panic) => Chunk::Panicked(panic_text(&*panic).into()),
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
struct Loads<'a, M, C: Future, S> {
    keys: &'a [&'a str],
    call: M,
    /// How many keys ready together go into each call (the guest's `batch-calls`).
    split: S,
    quiet: Quiet,
    /// Per key, the call that loads it, once made (taken by the key's flight).
    calls: Mutex<Vec<Option<Shared<C>>>>,
    /// The cache's clock: when a key's call began.
    clock: &'a dyn Clock,
}

impl<'a, M, C, S> Loads<'a, M, C, S>
where
    M: Fn(Vec<String>) -> C,
    C: Future<Output = Chunk>,
    S: Fn(u64) -> Result<Vec<u64>>,
{
    fn new(keys: &'a [&'a str], call: M, split: S, clock: &'a dyn Clock) -> Self {
        Loads {
            keys,
            call,
            split,
            quiet: Quiet::new(),
            calls: Mutex::new(keys.iter().map(|_| None).collect()),
            clock,
        }
    }

    /// The load of key `index`, as its flight's loader: waits until the batch is quiet,
    /// then shares one loader call with the keys that are ready with it, saying when
    /// that call began (`began`: the flight's timeouts count from then).
    async fn load(&self, index: usize, began: oneshot::Sender<u64>) -> std::result::Result<Bytes, BoxError> {
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
        let _ = began.send(self.clock.now_ms());
        let chunk = call.await;
        drop(ready);
        match chunk {
            Chunk::Loaded(values) => values
                .get(self.keys[index])
                .cloned()
                .ok_or_else(|| Box::new(Absent) as BoxError),
            Chunk::Failed(e) => Err(Box::new(BatchLoaderError(e))),
            // The driver catches it: a panic is its caller's, as for one key.
            Chunk::Panicked(what) => std::panic::resume_unwind(Box::new(what.to_string())),
        }
    }

    /// One loader call for the keys at `group`.
    fn call_for(&self, group: &[usize]) -> Shared<C> {
        (self.call)(group.iter().map(|&i| self.keys[i].to_owned()).collect()).shared()
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
        // Should the guest fail to say, one call for them all.
        let sizes = (self.split)(due.len() as u64).unwrap_or_else(|_| vec![due.len() as u64]);
        let mut rest = &due[..];
        let mut made: Vec<(&[usize], Shared<C>)> = Vec::with_capacity(sizes.len());
        for size in sizes
            .into_iter()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX).max(1))
        {
            if rest.is_empty() {
                break;
            }
            let (group, after) = rest.split_at(size.min(rest.len()));
            made.push((group, self.call_for(group)));
            rest = after;
        }
        // Keys the sizes left out (none, from the guest) are one more call.
        if !rest.is_empty() {
            made.push((rest, self.call_for(rest)));
        }
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

/// The entry names and the hashes (of all the batch's keys, `hashes`) of the keys at
/// `read`, in order. Every key of the batch (the usual case: L1 off, or it missed them
/// all) takes them as they are, each name found where the last ended: `read` is in
/// order, each key once, so as long as the batch it is every key.
fn names_and_hashes<'a>(
    located: &'a Located,
    read: &[usize],
    hashes: &'a [u64],
) -> (Vec<&'a str>, std::borrow::Cow<'a, [u64]>) {
    debug_assert!(read.windows(2).all(|w| w[0] < w[1]), "keys out of order");
    if read.len() == hashes.len() {
        (located.entries.iter().collect(), hashes.into())
    } else {
        let names = read.iter().map(|&i| located.entries.get(i)).collect();
        (names, read.iter().map(|&i| hashes[i]).collect())
    }
}

/// A key of a batch left without an answer (never: every key gets one).
fn unanswered() -> Error {
    Error::guest("a key of the batch went unanswered", "broken contract")
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
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a bad key
    /// (it names the key, and its position among the batch's distinct keys in the order
    /// they first appear) or bad options, before anything runs. Per key:
    /// [`ErrorKind::Loader`](crate::ErrorKind::Loader) with the loader's error as the
    /// source ([`Error::loader_error`] downcasts it), a timeout, as for one key. A key's
    /// [`hard_timeout`](LoadOptions::hard_timeout) counts from the loader call it is in,
    /// not from the batch's start: a key ready early waits for the others' store steps
    /// without its timeout running.
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
        let mut options: LoadOptions = options.into();
        let inner = &*self.inner;
        Self::in_caller_only(&options)?;
        if let Some(max) = options.max_batch {
            inner.policy.check_max_batch(max as u64)?;
        }
        let keys: Vec<K> = keys.into_iter().collect();
        // Each key hashed once: for its duplicates, and for the names' table.
        let (distinct, hashes, asked) = distinct_keys(&keys, |key| inner.names.hash(key));
        let Some(first) = distinct.first() else {
            return Ok(Vec::new());
        };
        // Checked before anything runs, in the portable body's order (contract §5.16):
        // what a batch cannot take and `max_batch` (above), the first key, the options,
        // every key, the tags. A bad key is named by the naming below, with its
        // position, whether these options were seen before or not; a bad tag only once
        // every key passed.
        let deferred = match self.judge(first, &mut options) {
            Err(e) if matches!(e.argument(), Some("key" | "tags")) => Some(e),
            judged => judged.map(|()| None)?,
        };
        // Taken before the names: L1 is never filled across a clear after them.
        let named: Vec<Ticket> = distinct.iter().map(|k| inner.l1.ticket(k)).collect();
        let entries = self.entries_if_known(&distinct, &hashes)?;
        if let Some(e) = deferred {
            return Err(e);
        }
        let located = entries.map(|(entries, generation)| Located {
            entries,
            generation,
            readable: true,
        });
        let answers = self
            .many((&distinct, &hashes), located, &named, &options, &loader)
            .await;
        Ok(hand_out(answers, &asked)
            .into_iter()
            .map(|answer| match answer {
                Some(Ok(served)) => Ok(Some(served.value)),
                Some(Err(e)) if e.is_absent() => Ok(None),
                Some(Err(e)) => Err(e),
                None => Err(unanswered()),
            })
            .collect())
    }

    /// Every key of `keys` (distinct and checked, each with its hash by the names' hasher,
    /// their entries named (`located`) if the generation was known, else named once L1
    /// answered; their L1 tickets as of the names `named`), answered (`None`: a key
    /// nothing answered, a broken contract).
    async fn many<L, Fut, I, V, E>(
        &self,
        (keys, hashes): (&[&str], &[u64]),
        located: Option<Located>,
        named: &[Ticket],
        options: &LoadOptions,
        loader: &L,
    ) -> Vec<Option<Result<Served>>>
    where
        L: Fn(Vec<String>) -> Fut,
        Fut: Future<Output = std::result::Result<I, E>>,
        I: IntoIterator<Item = (String, V)>,
        V: Into<Bytes>,
        E: Into<BoxError>,
    {
        let inner = &*self.inner;
        // A loader that panics as it is called, before its future exists, panics for
        // the keys of that call alike: nothing escapes into the batch.
        let call = |keys: Vec<String>| {
            let started = std::panic::catch_unwind(AssertUnwindSafe(|| loader(keys)));
            async move {
                match started {
                    Ok(running) => chunk_of(AssertUnwindSafe(running).catch_unwind().await),
                    Err(panic) => Chunk::Panicked(panic_text(&*panic).into()),
                }
            }
        };
        let max_batch = options.max_batch.map(|n| n as u64);
        let split = |ready| inner.policy.batch_calls(ready, max_batch);
        let loads = Loads::new(keys, call, split, &*inner.clock);
        let mut answers: Vec<Option<Result<Served>>> = keys.iter().map(|_| None).collect();
        let parts = if options.bypass {
            // A bypass reads no key first, but its keys are named as a batch's are: in one
            // generation, found once for them all.
            let all: Vec<usize> = (0..keys.len()).collect();
            let Some(located) = self.located(keys, located, &all, &mut answers).await else {
                return answers;
            };
            all.into_iter()
                .map(|i| {
                    (
                        i,
                        Part::Lead(None),
                        Some(self.named_only(keys[i], &located, named[i])),
                    )
                })
                .collect()
        } else {
            let missed = self.answer_l1_hits(keys, &mut answers);
            if missed.is_empty() {
                return answers;
            }
            let Some(located) = self.located(keys, located, &missed, &mut answers).await else {
                return answers;
            };
            self.answer_missed((keys, hashes), &located, named, &missed, &mut answers)
                .await
        };
        if parts.is_empty() {
            // Every key answered by L1 or its read: no flight to run.
            return answers;
        }
        // The led keys hold their seats from now: no load is made before every one of
        // them has reached its load or a wait.
        let mut seats: Vec<Option<Seat<'_>>> = keys.iter().map(|_| None).collect();
        for (i, part, _) in &parts {
            if matches!(part, Part::Lead(_)) {
                seats[*i] = Some(loads.quiet.seat());
            }
        }
        // A loop, not a closure: the futures' borrows stay of one lifetime (a closure's
        // would be higher-ranked, and the future not provably `Send`).
        let mut indices = Vec::with_capacity(parts.len());
        let mut flights = Vec::with_capacity(parts.len());
        for (i, part, first) in parts {
            indices.push(i);
            flights.push(self.one_of_many(i, keys[i], options, &loads, part, seats[i].take(), first));
        }
        let flown = futures::future::join_all(flights).await;
        for (i, answer) in indices.into_iter().zip(flown) {
            answers[i] = Some(answer);
        }
        answers
    }

    /// The batch's keys named (`located`, if the generation was known when they were
    /// checked; else found now, in one generation for them all). `None` only for a
    /// broken guest: then each key at `asked` is answered with its failure.
    async fn located(
        &self,
        keys: &[&str],
        located: Option<Located>,
        asked: &[usize],
        answers: &mut [Option<Result<Served>>],
    ) -> Option<Located> {
        if located.is_some() {
            return located;
        }
        match self.locate_entries(keys).await {
            Ok((entries, generation, readable)) => Some(Located {
                entries,
                generation,
                readable,
            }),
            // Checked already: only a broken guest fails here, each key's failure.
            Err(e) => {
                for &i in asked {
                    answers[i] = Some(Err(e.clone()));
                }
                None
            }
        }
    }

    /// What a key of a bypass batch begins its flight with: no read (a bypass loads
    /// first), only its batch's naming (`located`), and its ticket taken before it
    /// (`named`). Its flight is named in that generation as a read key's is
    /// ([`Corral::batch_key_names`]), and writes nothing where it could not be read.
    fn named_only(&self, key: &str, located: &Located, named: Ticket) -> FirstRead {
        let inner = &*self.inner;
        FirstRead {
            named,
            l1_ticket: inner.l1.ticket_since(key, named),
            tag_epoch: inner.l1.tag_epoch(),
            read: Err(super::generation_unread()),
            deadline: in_ms(inner.flight.store_budget.before_load_ms),
            unnamed: !located.readable,
            batch_generation: Some(located.generation),
        }
    }

    /// Answers a batch's L1 hits (in `answers`); the indices of the other keys.
    fn answer_l1_hits(&self, keys: &[&str], answers: &mut [Option<Result<Served>>]) -> Vec<usize> {
        let inner = &*self.inner;
        if !inner.l1.is_on() {
            return (0..keys.len()).collect();
        }
        let now = inner.clock.now_ms();
        let mut missed = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match inner.l1.get_served(key, now) {
                Some((value, stale)) => {
                    Metrics::bump(&inner.metrics.l1_hits);
                    if stale {
                        Metrics::bump(&inner.metrics.stale_served);
                    }
                    answers[i] = Some(Ok(Served { value, stale }));
                }
                None => missed.push(i),
            }
        }
        missed
    }

    /// The first reads of the keys at `missed` (their entries named as `located` says,
    /// their L1 tickets taken before the names: `named`; the batch's keys' hashes:
    /// `hashes`), together. A fresh hit is answered from its read alone (in `answers`;
    /// its L1 fill comes back in `fills`, to be made once the batch knows no flight of
    /// the key overtook its read); the other keys come back with what their flights
    /// begin with (the read, the tickets taken before it, the deadline it began).
    async fn answer_l2_hits(
        &self,
        (missed, hashes): (&[usize], &[u64]),
        located: &Located,
        answers: &mut [Option<Result<Served>>],
        fills: &mut Vec<HitFill>,
        (named, now): (&[Ticket], u64),
    ) -> Vec<(usize, FirstRead)> {
        let inner = &*self.inner;
        let deadline = in_ms(inner.flight.store_budget.before_load_ms);
        let tag_epoch = inner.l1.tag_epoch();
        let mut l2_hits = 0;
        // A hit served from its read alone is answered as its judgement comes.
        let fills_on = inner.l1.is_on();
        let hit = |at: usize, value: Bytes, until: u64| {
            let i = missed[at];
            l2_hits += 1;
            if fills_on {
                fills.push(HitFill {
                    at: i,
                    until: L1Until::Judged(until),
                    stamp: None,
                });
            }
            answers[i] = Some(Ok(Served { value, stale: false }));
        };
        let readable = located.readable;
        let reads = if !readable {
            (0..missed.len())
                .map(|at| (at, Err(super::generation_unread())))
                .collect()
        } else {
            let (names, hashes) = names_and_hashes(located, missed, hashes);
            let looked = self.l2_look_many(&names, &hashes, now, hit);
            match tokio::time::timeout_at(deadline, looked).await {
                Ok(reads) => reads,
                // Past the deadline, the keys not answered yet.
                Err(_) => (0..missed.len())
                    .filter(|&at| answers[missed[at]].is_none())
                    .map(|at| (at, Err(past_deadline())))
                    .collect(),
            }
        };
        let mut flying = Vec::new();
        for (at, read) in reads {
            let i = missed[at];
            // The ticket taken before the names, so before the read: a write of the key
            // since keeps the read's fill out of L1.
            let l1_ticket = named[i];
            let first = |read| FirstRead {
                named: l1_ticket,
                l1_ticket,
                tag_epoch,
                read,
                deadline,
                unnamed: !readable,
                batch_generation: Some(located.generation),
            };
            let (value, l1_until, stamp) = match read {
                Ok((read, until)) => match *read {
                    L2Read::Hit(value, meta, _, stamp) => {
                        (value, until.map_or(L1Until::Ask(meta), L1Until::Judged), stamp)
                    }
                    read => {
                        flying.push((i, first(Ok(read))));
                        continue;
                    }
                },
                Err(e) => {
                    flying.push((i, first(Err(e))));
                    continue;
                }
            };
            l2_hits += 1;
            if fills_on {
                fills.push(HitFill {
                    at: i,
                    until: l1_until,
                    stamp,
                });
            }
            answers[i] = Some(Ok(Served { value, stale: false }));
        }
        Metrics::add(&inner.metrics.l2_hits, l2_hits);
        flying
    }

    /// The keys at `missed` (L1 missed them; each with its hash by the names' hasher,
    /// which the registry's is): those another caller in this process is loading are
    /// followed; the others are read together, their fresh hits answered
    /// from their reads (in `answers`), and the rest joined after their reads, to lead
    /// their flights from them ([`Registry::peek`](registry::Registry::peek): a flight
    /// of such a key that ran meanwhile is followed, as if joined before the read).
    /// Returns the keys to fly, with what each begins with.
    async fn answer_missed(
        &self,
        (keys, hashes): (&[&str], &[u64]),
        located: &Located,
        named: &[Ticket],
        missed: &[usize],
        answers: &mut [Option<Result<Served>>],
    ) -> Vec<(usize, Part, Option<FirstRead>)> {
        let inner = &*self.inner;
        if missed.is_empty() {
            return Vec::new();
        }
        let ticket = |key: &str| inner.l1.ticket(key);
        let (mut peek, looked) = inner
            .registry
            .peek(missed.iter().map(|&i| (keys[i], hashes[i])), ticket);
        let mut parts = Vec::new();
        // Read: the keys no flight has (`None`) and those this caller leads (`leads`).
        let (mut to_read, mut leads) = (Vec::with_capacity(missed.len()), Vec::new());
        // `looked` is empty when no key joined.
        let mut looked = looked.into_iter();
        for &i in missed {
            match looked.next().flatten() {
                Some(Join::Follower(rx)) => parts.push((i, Part::Follow(rx), None)),
                Some(Join::Leader(guard)) => {
                    to_read.push(i);
                    leads.push((i, guard));
                }
                None => to_read.push(i),
            }
        }
        // The reads' moment: their hits' L1 deadlines count from it.
        let now = inner.clock.now_ms();
        let mut fills = Vec::new();
        let flying = self
            .answer_l2_hits((&to_read, hashes), located, answers, &mut fills, (named, now))
            .await;
        let AfterRead {
            hits,
            unjoined,
            unjoined_hits,
        } = after_read(&to_read, flying, leads, &mut parts);
        let (settled, overtaken) = inner.registry.settle(
            &mut peek,
            unjoined.iter().map(|&(i, _)| (keys[i], hashes[i], named[i])),
            unjoined_hits.iter().map(|&i| (keys[i], hashes[i])),
            ticket,
        );
        let overtaken = overtaken.into_iter().map(|at| unjoined_hits[at]);
        #[cfg(test)]
        tests::between_settle_and_fills();
        self.fill_hits(keys, (named, now), fills, (overtaken, &peek), answers);
        drop(peek);
        for ((i, first), settled) in unjoined.into_iter().zip(settled) {
            parts.push(match settled {
                Settled::Joined(Join::Leader(guard), read_again) => {
                    (i, Part::Lead(Some(guard)), (!read_again).then_some(first))
                }
                Settled::Joined(Join::Follower(rx), _) => (i, Part::Follow(rx), None),
                Settled::Ended(outcome) => {
                    let (tx, rx) = oneshot::channel();
                    let _ = tx.send(registry::Shared::Done(outcome));
                    (i, Part::Follow(rx), None)
                }
            });
        }
        let answers = &*answers;
        // A hit's followers get its value (copied only for them).
        inner.registry.finish_all(hits.into_iter().map(|(i, guard)| {
            (guard, move || match &answers[i] {
                Some(Ok(served)) => Ok(served.clone()),
                _ => Err(Arc::new(unanswered())),
            })
        }));
        parts
    }

    /// Fills L1 with the hits a batch's first reads found (`fills`, each with the ticket
    /// taken before its name, `named`, and until when L1 may serve it, counted from the
    /// reads' moment `now`), once the batch settled: a hit fills only now, and one whose
    /// key a flight began since the batch looked does not (before the settle:
    /// `overtaken`; since: `peek`, asked as each fills), since that flight may have
    /// filled L1 with what it found after the batch's read. A reader meanwhile is never
    /// served the older value after that flight returned.
    fn fill_hits(
        &self,
        keys: &[&str],
        (named, now): (&[Ticket], u64),
        fills: Vec<HitFill>,
        (overtaken, peek): (impl Iterator<Item = usize>, &registry::Peek<Outcome>),
        answers: &[Option<Result<Served>>],
    ) {
        if fills.is_empty() {
            return;
        }
        let inner = &*self.inner;
        let mut overtook = vec![false; keys.len()];
        for i in overtaken {
            overtook[i] = true;
        }
        for HitFill { at: i, until, stamp } in fills {
            let (false, Some(Ok(served))) = (overtook[i], &answers[i]) else {
                continue;
            };
            let key = keys[i];
            let until = match until {
                L1Until::Judged(until) => until,
                L1Until::Ask(meta) => match inner.policy.l1_deadline(meta, now, inner.l1_ttl_ms) {
                    Ok(until) => until,
                    Err(e) => {
                        tracing::debug!(key, error = %e, "L1 not filled");
                        continue;
                    }
                },
            };
            // A flight of the key that begins after the settle, and fills L1 before this
            // fill, found what the key held after this read: it is not overwritten.
            let overtook = || peek.overtook(key);
            self.fill_l1_until_unless(key, &served.value, until, L1Fill::Read(named[i]), stamp, overtook);
        }
    }

    /// Joins the flight of `key` in this process, or leads it.
    fn join_flight(&self, key: &str) -> Part {
        let inner = &*self.inner;
        match inner.registry.join(key, inner.l1.ticket(key)) {
            Join::Leader(guard) => Part::Lead(Some(guard)),
            Join::Follower(rx) => Part::Follow(rx),
        }
    }

    /// One key of a batch, answered: followed, or led (then its flight's loader is the
    /// batch's).
    #[allow(clippy::too_many_arguments)]
    async fn one_of_many<M, C, S>(
        &self,
        index: usize,
        key: &str,
        options: &LoadOptions,
        loads: &Loads<'_, M, C, S>,
        mut part: Part,
        mut seat: Option<Seat<'_>>,
        mut first: Option<FirstRead>,
    ) -> Result<Served>
    where
        M: Fn(Vec<String>) -> C,
        C: Future<Output = Chunk>,
        S: Fn(u64) -> Result<Vec<u64>>,
    {
        loop {
            match part {
                Part::Follow(rx) => match registry::follow(rx).await {
                    registry::Shared::Done(outcome) => {
                        Metrics::bump(&self.inner.metrics.coalesced);
                        return outcome.map_err(Error::from_shared);
                    }
                    // Its leader went away without an outcome: join again (and read
                    // anew, should this caller lead now).
                    registry::Shared::Gone => {
                        first = None;
                        part = self.join_flight(key);
                    }
                },
                Part::Lead(guard) => {
                    let _seat = seat.take().unwrap_or_else(|| loads.quiet.seat());
                    let mut followers = guard;
                    let (began, call_began) = oneshot::channel();
                    let mut loader = Some(move || loads.load(index, began));
                    let (mut answer, mut refresh) = (None, None);
                    let callers = Callers {
                        loader: &mut loader,
                        followers: &mut followers,
                        answer: &mut answer,
                        refresh: &mut refresh,
                        batch: Some(&loads.quiet),
                        began: Some(call_began),
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

#[cfg(test)]
mod send_check {
    use super::*;
    fn send<T: Send>(_: T) {}
    #[allow(dead_code, unused_must_use)]
    fn futures_are_send(c: &Corral, keys: &[&str], o: &LoadOptions) {
        send(c.l2_look_many(&[], &[], 0, |_, _, _| ()));
        let loader = |_: Vec<String>| async { Ok::<_, std::io::Error>(Vec::<(String, Bytes)>::new()) };
        let located = Located {
            entries: Parts::default(),
            generation: 0,
            readable: true,
        };
        send(c.many((keys, &[]), Some(located), &[], o, &loader));
        let clock = crate::clock::SystemClock;
        let loads = Loads::new(
            keys,
            |_| async { Chunk::Panicked("".into()) },
            |n| Ok(vec![n]),
            &clock,
        );
        send(loads.load(0, oneshot::channel().0));
        send(c.one_of_many(0, "k", o, &loads, Part::Lead(None), None, None));
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::time::Duration;

    use super::*;
    use crate::options::EntryOptions;

    thread_local! {
        /// What runs, once, on this thread between a batch's settle and its L1 fills.
        static BETWEEN: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
    }

    /// The seam [`Corral::answer_missed`] calls between the settle and the fills.
    pub(super) fn between_settle_and_fills() {
        if let Some(then) = BETWEEN.with(|b| b.borrow_mut().take()) {
            then();
        }
    }

    /// Sets the seam to run what `then` makes, once, on another thread with a runtime
    /// of its own (the batch holds this thread meanwhile), and to wait for it.
    fn between_on_another_thread<F>(then: impl FnOnce() -> F + Send + 'static)
    where
        F: Future<Output = ()>,
    {
        let run = move || {
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                runtime.block_on(then());
            })
            .join()
            .expect("the other caller");
        };
        BETWEEN.with(|b| *b.borrow_mut() = Some(Box::new(run)));
    }

    /// The bytes L2 holds for `key`'s entry (there must be some).
    async fn stored_entry(cache: &Corral, key: &str) -> Bytes {
        let name = cache.entry_of(key).await.expect("named");
        let stored = cache.inner.stores.entries.get(&name).await.expect("read");
        stored.expect("an entry")
    }

    /// A batch hashes its keys once, for the names' table and the flight registry: the
    /// two hash alike (`Registry::peek` finds a key's flight by the batch's hash).
    #[test]
    fn the_registry_hashes_keys_as_the_names_table_does() {
        let cache = Corral::builder().build().expect("a memory cache");
        for key in ["a", "product:42", ""] {
            assert_eq!(
                cache.inner.registry.hash(key),
                cache.inner.names.hash(key),
                "{key:?}"
            );
        }
    }

    /// A batch of hits read again is judged by what the guest said of the same heads,
    /// and answers as the guest would: fresh until the entries expire, not a moment
    /// after; a key written again is judged by its new bytes.
    #[tokio::test]
    async fn hits_judged_by_their_kept_judgements_answer_as_the_guest_would() {
        let clock = crate::ManualClock::new(1_000_000);
        let cache = Corral::builder()
            .clock(clock.clone())
            .l1_capacity(0)
            .build()
            .expect("a memory cache");
        let keys: Vec<String> = (0..20).map(|i| format!("kept{i}")).collect();
        let expires_at = 1_000_000 + 60_000;
        let loads = std::sync::atomic::AtomicUsize::new(0);
        let batch = |tag: &'static str| {
            let loads = &loads;
            // Loads after the first expiry expire a minute later.
            let until = expires_at + if tag == "fifth" { 60_000 } else { 0 };
            let options = LoadOptions::from(EntryOptions::new().absolute_at_ms(until));
            cache.get_or_set_many(&keys, options, move |asked: Vec<String>| async move {
                loads.fetch_add(asked.len(), std::sync::atomic::Ordering::SeqCst);
                Ok::<_, std::io::Error>(
                    asked
                        .into_iter()
                        .map(|k| (k, tag.as_bytes().to_vec()))
                        .collect::<Vec<_>>(),
                )
            })
        };
        let values = |answers: Vec<Result<Option<Bytes>>>| -> Vec<Vec<u8>> {
            answers
                .into_iter()
                .map(|a| a.expect("answered").expect("a value").to_vec())
                .collect()
        };
        assert!(
            values(batch("first").await.expect("a batch"))
                .iter()
                .all(|v| v == b"first")
        );
        assert_eq!(loads.swap(0, std::sync::atomic::Ordering::SeqCst), 20);
        // Read: judged by the guest, kept. Read again: served by what was kept.
        for _ in 0..2 {
            assert!(
                values(batch("second").await.expect("a batch"))
                    .iter()
                    .all(|v| v == b"first")
            );
        }
        let stored = stored_entry(&cache, &keys[3]).await;
        let hash = cache.inner.names.hash(&keys[3]);
        let kept = cache
            .inner
            .kept
            .get(hash, &stored, clock.now_ms(), cache.inner.l1_ttl_ms);
        assert!(kept.is_some(), "the guest's judgement of the hit is kept");
        assert_eq!(loads.load(std::sync::atomic::Ordering::SeqCst), 0, "hits all");
        // One key written again: its new bytes are judged, and served.
        cache
            .set(
                &keys[5],
                b"written".to_vec(),
                EntryOptions::new().absolute_at_ms(expires_at),
            )
            .await
            .expect("a set");
        let answers = values(batch("third").await.expect("a batch"));
        assert_eq!(answers[5], b"written");
        assert!(answers.iter().enumerate().all(|(i, v)| i == 5 || v == b"first"));
        // One key removed: its tombstone is judged (a miss), and the key loaded anew.
        cache.remove(&keys[7]).await.expect("a removal");
        let answers = values(batch("removed").await.expect("a batch"));
        assert_eq!(answers[7], b"removed");
        assert_eq!(
            loads.swap(0, std::sync::atomic::Ordering::SeqCst),
            1,
            "the removed key alone"
        );
        // The last moment before they expire: still fresh. At it: expired, loaded anew.
        clock.set(expires_at - 1);
        assert!(
            values(batch("fourth").await.expect("a batch"))
                .iter()
                .enumerate()
                .all(|(i, v)| [5, 7].contains(&i) || v == b"first")
        );
        assert_eq!(loads.load(std::sync::atomic::Ordering::SeqCst), 0);
        clock.set(expires_at);
        let after = values(batch("fifth").await.expect("a batch"));
        assert_eq!(
            loads.load(std::sync::atomic::Ordering::SeqCst),
            20,
            "every key expired"
        );
        assert!(after.iter().all(|v| v == b"fifth"));
    }

    #[tokio::test]
    async fn a_flight_that_fills_l1_after_the_batch_settled_keeps_its_newer_copy() {
        let cache = Corral::builder().build().expect("a memory cache");
        let options = || LoadOptions::from(EntryOptions::new().relative(Duration::from_secs(3600)));
        cache
            .set(
                "k",
                "older",
                EntryOptions::new().relative(Duration::from_secs(3600)),
            )
            .await
            .expect("set");
        cache.inner.l1.remove("k"); // as if L1 had let its copy go: the batch reads L2
        let name = cache.entry_of("k").await.expect("named");
        let older = stored_entry(&cache, "k").await;
        let newer = Bytes::from([&older[..older.len() - 5], b"newer"].concat());
        // While the batch is between its settle and its fills: another process writes
        // the key (unheard here yet), and a caller here reads it through a flight that
        // begins after the settle, and fills L1 with it.
        let other = cache.clone();
        between_on_another_thread(move || async move {
            let entries = &other.inner.stores.entries;
            entries.set(&name, newer, 3_600_000).await.expect("written");
            let loader = || async { Err::<Bytes, _>(std::io::Error::other("a hit")) };
            let got = other.get_or_set("k", options(), loader).await.expect("a hit");
            assert_eq!(&got[..], b"newer");
        });
        let loader =
            |_: Vec<String>| async { Err::<Vec<(String, Bytes)>, _>(std::io::Error::other("a hit")) };
        let got = cache
            .get_or_set_many(["k"], options(), loader)
            .await
            .expect("a batch");
        assert!(BETWEEN.with(|b| b.borrow().is_none()), "the seam ran");
        assert!(
            matches!(&got[..], [Ok(Some(v))] if &v[..] == b"older"),
            "read before the write"
        );
        let kept = cache.inner.l1.peek("k").expect("a copy in L1");
        assert_eq!(
            &kept.value[..],
            b"newer",
            "the batch's older read did not replace what a caller after it was served"
        );
    }

    /// The control of the test above: a flight of another key between the settle and
    /// the fills takes nothing from the batch's fills.
    #[tokio::test]
    async fn a_flight_of_another_key_after_the_batch_settled_leaves_its_fills_alone() {
        let cache = Corral::builder().build().expect("a memory cache");
        let options = || LoadOptions::from(EntryOptions::new().relative(Duration::from_secs(3600)));
        for key in ["k", "other"] {
            let entry = EntryOptions::new().relative(Duration::from_secs(3600));
            cache.set(key, "older", entry).await.expect("set");
            cache.inner.l1.remove(key);
        }
        let other = cache.clone();
        between_on_another_thread(move || async move {
            let loader = || async { Err::<Bytes, _>(std::io::Error::other("a hit")) };
            other.get_or_set("other", options(), loader).await.expect("a hit");
        });
        let loader =
            |_: Vec<String>| async { Err::<Vec<(String, Bytes)>, _>(std::io::Error::other("a hit")) };
        cache
            .get_or_set_many(["k"], options(), loader)
            .await
            .expect("a batch");
        assert!(BETWEEN.with(|b| b.borrow().is_none()), "the seam ran");
        let kept = cache.inner.l1.peek("k").expect("the batch filled L1");
        assert_eq!(&kept.value[..], b"older");
    }

    #[test]
    fn keys_asked_twice_are_answered_twice_in_the_order_asked() {
        use std::hash::BuildHasher;
        let hasher = foldhash::fast::RandomState::default();
        let hash = |key: &str| hasher.hash_one(key);
        let (distinct, hashes, asked) = distinct_keys(&["b", "a", "b", "c", "a"], hash);
        assert_eq!(distinct, ["b", "a", "c"]);
        assert_eq!(
            hashes,
            [hash("b"), hash("a"), hash("c")],
            "each distinct key's hash"
        );
        let answers: Vec<String> = distinct.iter().map(|k| k.to_uppercase()).collect();
        let handed = hand_out(answers, &asked);
        assert_eq!(handed, ["B", "A", "B", "C", "A"]);
        let (distinct, _, asked) = distinct_keys(&["b", "a"], hash);
        assert_eq!(hand_out(distinct.clone(), &asked), distinct, "each asked once");
        // Many keys, each asked up to three times, against the first position of each;
        // with every key hashed alike, the same: a hash only finds where to compare.
        let keys: Vec<String> = (0..3_000).map(|n| format!("k{}", (n * 7) % 1_000)).collect();
        let mut first_seen: Vec<&str> = Vec::new();
        for key in &keys {
            if !first_seen.contains(&key.as_str()) {
                first_seen.push(key);
            }
        }
        for colliding in [false, true] {
            let hash = |key: &str| if colliding { 7 } else { hash(key) };
            let (distinct, hashes, asked) = distinct_keys(&keys, hash);
            assert_eq!(distinct, first_seen, "in the order first asked");
            assert_eq!(hashes.len(), distinct.len());
            assert!(keys.iter().zip(&asked).all(|(key, &at)| distinct[at] == key));
        }
    }
}
