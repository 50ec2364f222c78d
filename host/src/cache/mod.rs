//! [`Corral`]: the cache a service embeds.
//!
//! - this file: the handle, `get`, `set`, `refresh`, `remove`, `inspect`;
//! - [`builder`]: how a cache is composed; [`read`]: one L2 read, judged by the guest;
//! - [`flight`]: the get-or-set driver; [`registry`]: in-process single flight;
//! - [`load`]: get-or-set options; [`typed`]: JSON values; [`metrics`]: counters.
//!
//! A change that could not be made at once is retried in the background (a change
//! announcement, a failed removal's tombstone, a tag or clear announcement): at once,
//! then on the guest's schedule (`Settings::retry_first_ms`, doubling to
//! `retry_max_ms`), for up to the L1 TTL. Only within a running process: a process that
//! exits takes its retries with it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

#[cfg(doc)]
use crate::ErrorKind;
use crate::clock::Clock;
use crate::guest::Policy;
use crate::guest::convert::Parts;
use crate::guest::policy::{ExpirePlan, ReadOutcome, StoreNames, WitMeta};
use crate::options::{EntryOptions, Inspection};
use crate::store::Stores;
use crate::store::l1::{L1, RemovalWatch, Ticket};
use crate::{Error, Result};
use load::Served;
use read::Looked;

mod builder;
mod flight;
mod gathered;
mod health;
mod judge;
mod kept;
pub(crate) mod load;
pub(crate) mod metrics;
mod named;
mod read;
pub(crate) mod registry;
pub(crate) mod tags;
mod typed;
mod watched;

pub use builder::CorralBuilder;
pub(crate) use builder::Overrides;
pub(crate) use flight::distinct_keys;
pub use health::Health;
use metrics::{Metrics, MetricsSnapshot};
use registry::Registry;

/// A tiered cache whose every decision is made by the Corral guest component.
///
/// Cheap to clone: clones share the stores, the guest and the metrics.
///
/// ```no_run
/// # async fn demo() -> corral::Result<()> {
/// use std::time::Duration;
/// use corral::{Corral, EntryOptions};
///
/// let cache = Corral::builder().build()?; // in-memory L2; `.redis(url)` for Redis
/// cache.set("user:42", b"Ada".to_vec(), EntryOptions::new().sliding(Duration::from_secs(60))).await?;
/// assert_eq!(cache.get("user:42").await?.as_deref(), Some(&b"Ada"[..]));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Corral {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) policy: Policy,
    /// The prefix this cache's data is named under in the store.
    pub(crate) prefix: String,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) stores: Stores,
    pub(crate) l1: L1,
    pub(crate) l1_ttl_ms: u64,
    pub(crate) flight: FlightSettings,
    /// The schedule of work retried in the background (the guest's settings).
    pub(crate) retry: crate::store::Retry,
    /// How many times a compare-and-set on a tag's moments or the generation tries.
    pub(crate) cas_tries: u32,
    /// How each key read lately is to be read next (`GET`, `GETEX` or the script).
    pub(crate) read_hints: read::ReadHints,
    /// The entry names the guest gave lately (a key named again without a guest call).
    pub(crate) names: named::Names<String>,
    /// The guest's judgements of fresh hits a batch or a gathering of gets read, kept for
    /// the same heads read again (found by the keys' hashes in `names`).
    pub(crate) kept: kept::Kept,
    /// All the store names of keys the guest named lately for a get-or-set.
    pub(crate) flight_names: named::Names<StoreNames>,
    /// `get`'s L2 reads that reach the cache together, read together (named in one
    /// guest call, read in one request, judged in one guest call); `None` when the
    /// store is in memory and a read costs no round trip.
    pub(crate) gets: Option<gathered::Gets>,
    /// Typed values decoded from the bytes L1 holds, reused while L1 holds those very
    /// bytes (see [`Corral::get_or_set_json_shared`]).
    pub(crate) decoded: typed::Decoded,
    pub(crate) registry: Registry<registry::Outcome>,
    /// In-process single flight of eager refreshes, apart from the get-or-sets': a
    /// caller that misses L1 while a refresh runs reads L2 as usual (the current value)
    /// instead of waiting for the refresh's load.
    pub(crate) refreshes: Registry<registry::Outcome>,
    /// Flights running in tasks of their own (`fetch`, refreshes), to their very end.
    pub(crate) background: Arc<std::sync::atomic::AtomicUsize>,
    /// Flights leading and work owed in the background, until they end
    /// ([`close`](Corral::close) waits for them).
    pub(crate) owed: crate::owed::Owed,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) locks: crate::locks::Locks,
    /// The tag moments and the generation this process knows (contract §7.5).
    pub(crate) tags: Arc<tags::TagState>,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct FlightSettings {
    pub(crate) lock_wait_ms: u64,
    pub(crate) lock_ttl_ms: u64,
    /// How long a degraded load is served from L1.
    pub(crate) degraded_l1_ttl_ms: u64,
    /// How long a stale copy served by fail-safe is served from L1.
    pub(crate) fail_safe_throttle_ms: u64,
    /// The default hard loader timeout.
    pub(crate) hard_timeout_ms: Option<u64>,
    /// The default soft loader timeout (flights in a task of their own only).
    pub(crate) soft_timeout_ms: Option<u64>,
    /// The default eager refresh (flights in a task of their own only).
    pub(crate) eager_refresh_permille: Option<u32>,
    /// The longest one store command may take (the Redis response timeout).
    pub(crate) store_timeout: std::time::Duration,
    /// How long a flight's store steps may take, phase by phase (contract §5.13).
    pub(crate) store_budget: crate::guest::bindings::corral::cache::types::StoreBudget,
}

impl fmt::Debug for Corral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Corral")
            .field("l2", &self.inner.stores.entries.name())
            .field("clock", &self.inner.clock)
            .finish_non_exhaustive()
    }
}

/// How a value reaches L1, with the ticket taken before the L2 step it comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum L1Fill {
    /// A read found it: no write of the key since may be overwritten.
    Read(Ticket),
    /// This process wrote it to L2: it replaces any older fill, unless the key was
    /// written again since.
    Write(Ticket),
}

/// Another process's set, removal or load of a key drops this process's L1 copy; a
/// gap in the announcements drops all of L1.
pub(crate) fn l1_invalidation(
    l1: L1,
    metrics: Arc<Metrics>,
    tags: Arc<tags::TagState>,
) -> crate::store::ForeignHook {
    Arc::new(move |key: Option<String>| {
        if key.is_none() {
            // Tag and clear announcements may have been missed too.
            tags.forget();
        }
        l1.hear(key.as_deref());
        match key {
            Some(_) => Metrics::bump(&metrics.l1_invalidations),
            None => Metrics::bump(&metrics.l1_flushes),
        }
    })
}

impl Corral {
    /// A builder with the defaults: in-memory L2, system clock, 20-minute default sliding.
    pub fn builder() -> CorralBuilder {
        CorralBuilder::default()
    }

    /// The value under `key`, if a fresh entry holds one: from L1, else from L2 (which
    /// then fills L1). A read of a sliding entry in L2 moves its expiry (never past its
    /// absolute expiration). Missing, expired and corrupt entries are all `None`; an
    /// expired or corrupt entry is removed.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key; [`ErrorKind::Unavailable`] when
    /// the store fails.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>> {
        let now = self.inner.clock.now_ms();
        // Only a valid key can be in L1: a hit needs no key check.
        if let Some(value) = self.inner.l1.get(key, now) {
            Metrics::bump(&self.inner.metrics.l1_hits);
            return Ok(Some(value));
        }
        self.get_from_l2(key, now).await.map_err(|e| e.in_call("get"))
    }

    /// [`get`](Self::get) past an L1 miss, with the store's own messages.
    async fn get_from_l2(&self, key: &str, now: u64) -> Result<Option<Bytes>> {
        // Before the entry is named: a clear after it (another generation) refuses the fill.
        let ticket = self.inner.l1.ticket(key);
        let m = &self.inner.metrics;
        match self.look_gathered(key, now).await? {
            Looked::Served(value, until) => {
                Metrics::bump(&m.l2_hits);
                self.fill_l1_until(key, &value, until, L1Fill::Read(ticket), None);
                Ok(Some(value))
            }
            Looked::Read(read, l1_until) => match *read {
                read::L2Read::Hit(value, meta, _, stamp) => {
                    Metrics::bump(&m.l2_hits);
                    match l1_until {
                        Some(until) => self.fill_l1_until(key, &value, until, L1Fill::Read(ticket), stamp),
                        None => {
                            self.fill_l1(key, &value, meta, now, L1Fill::Read(ticket), stamp)
                                .await?
                        }
                    }
                    Ok(Some(value))
                }
                read::L2Read::Miss { .. } | read::L2Read::Stale { .. } => {
                    Metrics::bump(&m.misses);
                    Ok(None)
                }
            },
        }
    }

    /// Stores `value` under `key`, expiring as `options` say: L2 first, then L1.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming `key`, `value`, `absolute`, `relative` or
    /// `sliding`; [`ErrorKind::Unavailable`] when the store fails (L1 is then not written).
    pub async fn set(&self, key: &str, value: impl Into<Bytes>, options: EntryOptions) -> Result<()> {
        self.write_tagged(key, value.into(), options, &[] as &[&str])
            .await
            .map_err(|e| e.in_call("set"))
    }

    /// As [`set`](Self::set), the entry carrying `tags` (contract §7.5): at most 16,
    /// each 1 to 128 bytes. [`remove_by_tag`](Self::remove_by_tag) and
    /// [`expire_by_tag`](Self::expire_by_tag) of any of them invalidate it in every
    /// process. No tags: as `set`.
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) -> corral::Result<()> {
    /// use corral::EntryOptions;
    /// cache.set_tagged("user:42", b"Ada".to_vec(), EntryOptions::new(), &["users", "team:7"]).await?;
    /// cache.remove_by_tag("team:7").await?; // user:42 is a miss everywhere now
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`set`](Self::set), and [`ErrorKind::InvalidArgument`] naming `tags`.
    pub async fn set_tagged(
        &self,
        key: &str,
        value: impl Into<Bytes>,
        options: EntryOptions,
        tags: &[impl AsRef<str>],
    ) -> Result<()> {
        self.write_tagged(key, value.into(), options, tags)
            .await
            .map_err(|e| e.in_call("set"))
    }

    /// [`set_tagged`](Self::set_tagged), with the store's own messages.
    async fn write_tagged(
        &self,
        key: &str,
        value: Bytes,
        options: EntryOptions,
        tags: &[impl AsRef<str>],
    ) -> Result<()> {
        let now = self.inner.clock.now_ms();
        let mut plan = self.inner.policy.plan_set(key, value.len(), &options, now)?;
        let tagged = if tags.is_empty() {
            None
        } else {
            let tags: Vec<String> = tags.iter().map(|t| t.as_ref().to_owned()).collect();
            self.inner.policy.check_tags(&tags)?;
            // After every invalidation of these tags completed before this set began, in
            // any process (their moments read from the store).
            let deadline = tokio::time::Instant::now() + self.inner.flight.store_timeout;
            let tagged = crate::guest::policy::Tagged {
                written_at_ms: self.tagged_write_at(&tags, deadline).await,
                tags,
            };
            let (header, ttl) = self
                .inner
                .policy
                .tag_plan(&plan.header, plan.store_ttl_ms, &tagged, now)?;
            plan.header = header;
            plan.store_ttl_ms = ttl;
            Some(tagged)
        };
        let named = self.inner.l1.ticket(key);
        let entry = self.entry_of(key).await?;
        // This process stops serving the old value before the store changes, and other
        // processes hear of the change even if the write's reply never comes.
        self.inner.l1.remove(key);
        let ticket = self.inner.l1.ticket_since(key, named);
        if let Err(e) = self
            .l2_write(&entry, &plan.header, &value, plan.store_ttl_ms)
            .await
        {
            // The write may have landed all the same, unless it was never sent.
            if !e.never_sent() {
                self.announce_in_background(key);
            }
            return Err(e);
        }
        Metrics::bump(&self.inner.metrics.sets);
        self.announce_change(key).await;
        let stamp = match tagged {
            Some(tagged) => match self.stamp_written(tagged, now).await? {
                Some(stamp) => Some(stamp),
                // Already invalidated (a tag's moment at or after this write): not kept.
                None => {
                    self.inner.l1.remove(key);
                    return Ok(());
                }
            },
            None => None,
        };
        self.fill_l1(key, &value, plan.meta, now, L1Fill::Write(ticket), stamp)
            .await
    }

    /// Tells the other processes sharing the store that `key` changed, so they drop
    /// their L1 copy, and returns once the announcement is published (within the
    /// store's timeout): when `set` or `remove` returns, every process subscribed then
    /// has been told. An announcement that fails is retried in the background.
    async fn announce_change(&self, key: &str) {
        let bound = self.inner.flight.store_timeout;
        let published = tokio::time::timeout(bound, self.inner.stores.notifications.announce(key)).await;
        if !matches!(published, Ok(Ok(()))) {
            self.announce_in_background(key);
        }
    }

    /// Announces that `key` changed from a task of its own, retrying on the guest's retry
    /// schedule for as long as another process may still serve an older copy from its L1
    /// (the L1 TTL): an announcement that could not reach Redis is made when Redis
    /// answers again.
    fn announce_in_background(&self, key: &str) {
        let inner = &*self.inner;
        inner.retry.announce_in_background(
            &inner.owed,
            inner.stores.notifications.clone(),
            key,
            inner.flight.store_timeout,
            Duration::from_millis(inner.l1_ttl_ms),
        );
    }

    /// Runs `attempt` in the background on the one retry schedule
    /// ([`Retry::in_background`](crate::store::Retry::in_background)), for up to the L1 TTL.
    fn retry_in_background<A, F>(&self, key: &str, at_once: bool, gave_up: &'static str, attempt: A)
    where
        A: FnMut() -> F + Send + 'static,
        F: Future<Output = bool> + Send + 'static,
    {
        let give_up_after = Duration::from_millis(self.inner.l1_ttl_ms);
        self.inner
            .retry
            .in_background(&self.inner.owed, give_up_after, key, at_once, gave_up, attempt);
    }

    /// A removal's tombstone and its TTL: unique (a random nonce), so a load fenced on
    /// one tombstone never takes another for it.
    fn tombstone(&self) -> Result<(Bytes, u64)> {
        let nonce = rand::random::<u128>().to_be_bytes();
        let (tombstone, ttl_ms) = self.inner.policy.removal(self.inner.flight.lock_ttl_ms, &nonce)?;
        Ok((Bytes::from(tombstone), ttl_ms))
    }

    /// Writes a tombstone for a removal whose write failed, went unanswered or was
    /// abandoned by its caller, from a task of its own, on the schedule of announcements
    /// ([`retry_in_background`](Self::retry_in_background)), until it lands, the key
    /// turns out removed already, or a later write of the key ends it (see
    /// [`retry_removal`](Self::retry_removal)).
    fn remove_in_background(&self, key: &str, entry: Option<String>, watch: RemovalWatch) {
        let (cache, owned, watch) = (self.clone(), key.to_owned(), Arc::new(watch));
        // Counted while it runs (dropped with the task's closure).
        let running = flight::Running::start(&self.inner.background);
        self.retry_in_background(
            key,
            true,
            "a failed removal could not be written within the L1 TTL: the old value stays in L2 until it expires",
            move || {
                let _running = &running;
                let (cache, key, entry, watch) = (cache.clone(), owned.clone(), entry.clone(), watch.clone());
                async move { cache.retry_removal(&key, entry.as_deref(), &watch).await }
            },
        );
    }

    /// One try of a failed removal's retry; says whether the retry is over. It replaces
    /// only what the removal was to replace: not once the key was written again in this
    /// process or another process's write of it was heard here (`watch`), and only over
    /// the very bytes it reads, so a write that lands between its read and its write
    /// wins. A tombstone already there (the first write landed after all, or another
    /// removal's) or nothing at all ends it too. Then the key's L1 copy goes again (a
    /// read may have brought the old value back meanwhile), and the change is announced.
    async fn retry_removal(&self, key: &str, entry: Option<&str>, watch: &RemovalWatch) -> bool {
        if !watch.is_current() {
            tracing::debug!(key, "a failed removal is not retried: the key was written since");
            return true;
        }
        let bound = self.inner.flight.store_timeout;
        let named;
        let entry = match entry {
            Some(entry) => entry,
            // Not named yet: in the generation known now (read if need be).
            None => match tokio::time::timeout(bound, self.entry_of(key)).await {
                Ok(Ok(entry)) => {
                    named = entry;
                    &named
                }
                Ok(Err(e)) => return !e.is_retryable(),
                Err(_) => return false,
            },
        };
        let entries = &self.inner.stores.entries;
        let stored = match tokio::time::timeout(bound, entries.get(entry)).await {
            Ok(Ok(stored)) => stored,
            Ok(Err(e)) => {
                tracing::debug!(key, error = %e, "retrying a failed removal: the read failed");
                // Retried while the store is out of reach; anything else (a value of another
                // Redis type) ends it.
                return !e.is_retryable();
            }
            Err(_) => {
                tracing::debug!(key, "retrying a failed removal: the read timed out; retrying");
                return false;
            }
        };
        if let Some(stored) = stored {
            let now = self.inner.clock.now_ms();
            match self.inner.policy.read(&stored, now, None) {
                Ok(ReadOutcome::Removed { .. }) => {}
                Ok(_) => {
                    if !watch.is_current() {
                        return true;
                    }
                    // A tombstone of its own, not the first write's again: a load fenced
                    // on the first one (which may have landed, its reply lost) must not
                    // take this one for it (contract §5.12).
                    let Ok((tombstone, ttl_ms)) = self.tombstone() else {
                        return true;
                    };
                    let write = entries.replace_if_equal(entry, stored, tombstone, ttl_ms);
                    match tokio::time::timeout(bound, write).await {
                        Ok(Ok(true)) => tracing::debug!(key, "a failed removal was written on a retry"),
                        Ok(Ok(false)) => {
                            tracing::debug!(
                                key,
                                "a failed removal is not retried: the key was written since"
                            );
                            return true;
                        }
                        // It may have landed: the next try reads it.
                        _ => return false,
                    }
                }
                Err(e) => {
                    tracing::debug!(key, error = %e, "retrying a failed removal: the guest failed; retrying");
                    return false;
                }
            }
        }
        self.inner.l1.drop_copy(key);
        self.announce_change(key).await;
        true
    }

    /// Refreshes `key` in L2 as a read would, without returning the value: a sliding
    /// entry's expiry moves. Says whether a fresh entry was there; a missing one is not
    /// an error.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn refresh(&self, key: &str) -> Result<bool> {
        let refreshed = async {
            let entry = self.entry_of(key).await?;
            let now = self.inner.clock.now_ms();
            Ok(self.l2_read(&entry, now).await?.is_some())
        };
        refreshed.await.map_err(|e: Error| e.in_call("refresh"))
    }

    /// Removes `key` from both tiers. Says whether L2 held it; a missing entry is not
    /// an error.
    ///
    /// This process's L1 copy goes at once, whatever the store does. When the store
    /// fails or does not answer (or the caller stops waiting), the removal may not have
    /// reached L2: it is written again in the background, on the schedule of change
    /// announcements (50 ms doubling to 2 s, for up to the L1 TTL, while this process
    /// runs), but never once the key was written again in this process or another
    /// process's write of it was heard here, and only over the very bytes it then reads
    /// (contract §5.12).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key; [`ErrorKind::Unavailable`] (or
    /// [`ErrorKind::Timeout`]) when the store fails: the removal may not have landed,
    /// and is being retried.
    pub async fn remove(&self, key: &str) -> Result<bool> {
        self.remove_entry(key).await.map_err(|e| e.in_call("remove"))
    }

    /// [`remove`](Self::remove), with the store's own messages.
    async fn remove_entry(&self, key: &str) -> Result<bool> {
        // The key first: a bad key is an argument error and loses nothing. Then this
        // process's copy goes, before the entry is named: naming it may need the store
        // (the prefix's generation), and the copy goes whatever the store does.
        self.inner.policy.validate_key(key)?;
        self.inner.l1.remove(key);
        // A tombstone, not a delete: a load that began before this removal may not fill
        // over it (contract §5.12).
        let (tombstone, ttl_ms) = self.tombstone()?;
        // Watched from before the write: unless the write's outcome is known, the
        // tombstone is written again in the background.
        let mut unsettled = Unsettled {
            cache: self.clone(),
            key: key.to_owned(),
            entry: None,
            watch: Some(self.inner.l1.watch_removal(key)),
        };
        let before_naming = self.inner.l1.ticket(key);
        let entry = match self.entry_of(key).await {
            Ok(entry) => entry,
            Err(e) => {
                if !e.is_retryable() {
                    unsettled.settle();
                }
                return Err(e);
            }
        };
        unsettled.entry = Some(entry.clone());
        let ended = unsettled.watch.as_ref().is_some_and(|w| !w.is_current());
        if ended
            && self
                .inner
                .l1
                .ticket(key)
                .only_generation_moved_since(before_naming)
        {
            // Naming it read a new generation, which ended every watch of an entry named
            // before: this one is named only now. (A write of the key meanwhile ended it
            // for good: a retry must not land over that write.)
            unsettled.watch = Some(self.inner.l1.watch_removal(key));
        }
        let entries = &self.inner.stores.entries;
        let old = match self.l2_op(entries.swap(&entry, tombstone, ttl_ms)).await {
            Ok(old) => {
                unsettled.settle();
                old
            }
            Err(e) => {
                if !e.is_retryable() {
                    // Not the store's reach (a value of another Redis type): no retry.
                    unsettled.settle();
                }
                return Err(e);
            }
        };
        let now = self.inner.clock.now_ms();
        let removed = match old {
            Some(old) => matches!(self.inner.policy.read(&old, now, None)?, ReadOutcome::Fresh(_)),
            None => false,
        };
        // Again, after the store: a read that began before the removal fills nothing.
        self.inner.l1.remove(key);
        Metrics::bump(&self.inner.metrics.removes);
        self.announce_change(key).await;
        Ok(removed)
    }

    /// Soft invalidation (contract §7.4): `key` stops being fresh now, in every
    /// process, but an entry set with [`fail_safe`](crate::EntryOptions::fail_safe)
    /// keeps its stale copy, which a get-or-set whose reload fails still serves. An
    /// entry without a stale window is removed, as [`remove`](Self::remove) does.
    /// Announced to the other processes like a removal. Says whether L2 held a fresh
    /// entry.
    ///
    /// # Errors
    /// As [`remove`](Self::remove).
    pub async fn expire(&self, key: &str) -> Result<bool> {
        self.expire_entry(key).await.map_err(|e| e.in_call("expire"))
    }

    /// [`expire`](Self::expire), with the store's own messages.
    async fn expire_entry(&self, key: &str) -> Result<bool> {
        // As a removal: this process's copy goes before the entry is named.
        self.inner.policy.validate_key(key)?;
        self.inner.l1.remove(key);
        let entry = self.entry_of(key).await?;
        let entries = &self.inner.stores.entries;
        // The bytes always change (a stale rewrite, or a removal's tombstone), so a load
        // that began before this cannot fill over it (§5.12). A rewrite goes only over
        // the very bytes read; after a few tries over a concurrent writer, a removal.
        let mut expired = None;
        for _ in 0..3 {
            let Some(stored) = self.l2_op(entries.get(&entry)).await? else {
                break;
            };
            let now = self.inner.clock.now_ms();
            match self.inner.policy.expire(&stored, now)? {
                ExpirePlan::Remove(was_fresh) => {
                    self.remove_entry(key).await?;
                    Metrics::bump(&self.inner.metrics.expires);
                    return Ok(was_fresh);
                }
                ExpirePlan::Rewrite(plan) => {
                    let bytes = crate::store::splice(&plan.header, &stored[plan.value_offset as usize..]);
                    let swapped = entries.replace_if_equal(&entry, stored, bytes, plan.store_ttl_ms);
                    match self.l2_op(swapped).await {
                        Ok(true) => {
                            expired = Some(plan.was_fresh);
                            break;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            // The rewrite may have landed: the other processes hear of it.
                            self.inner.l1.remove(key);
                            if !e.never_sent() {
                                self.announce_in_background(key);
                            }
                            return Err(e);
                        }
                    }
                }
            }
        }
        let Some(was_fresh) = expired else {
            // Missing, or rewritten under us each time: a removal (a tombstone) wins.
            self.remove_entry(key).await?;
            Metrics::bump(&self.inner.metrics.expires);
            return Ok(false);
        };
        self.inner.l1.remove(key);
        Metrics::bump(&self.inner.metrics.expires);
        self.announce_change(key).await;
        Ok(was_fresh)
    }

    /// The value under `key`, fresh or, failing that, a stale copy kept for fail-safe
    /// (contract §7.1), saying which. [`get`](Self::get) returns fresh values only.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn get_stale(&self, key: &str) -> Result<Option<Served>> {
        let entry = self.entry_of(key).await?;
        let now = self.inner.clock.now_ms();
        if let Some((value, stale)) = self.inner.l1.get_served(key, now) {
            Metrics::bump(&self.inner.metrics.l1_hits);
            return Ok(Some(Served { value, stale }));
        }
        Ok(match self.l2_look(&entry, now).await? {
            read::L2Read::Hit(value, ..) => {
                Metrics::bump(&self.inner.metrics.l2_hits);
                Some(Served { value, stale: false })
            }
            read::L2Read::Stale { value, .. } => {
                Metrics::bump(&self.inner.metrics.stale_served);
                Some(Served { value, stale: true })
            }
            read::L2Read::Miss { .. } => {
                Metrics::bump(&self.inner.metrics.misses);
                None
            }
        })
    }

    /// The entry under `key` as stored in L2, decoded, without touching it.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the stored bytes are not an envelope (they are left
    /// in place); otherwise as [`get`](Self::get).
    pub async fn inspect(&self, key: &str) -> Result<Option<Inspection>> {
        let entry = self.entry_of(key).await?;
        let Some(stored) = self.l2_op(self.inner.stores.entries.get(&entry)).await? else {
            return Ok(None);
        };
        let now = self.inner.clock.now_ms();
        let (fresh, stale) = match self.inner.policy.read(&stored, now, None)? {
            ReadOutcome::Removed { .. } => return Ok(None),
            ReadOutcome::Fresh(_) => (true, false),
            ReadOutcome::Stale(_) => (false, true),
            ReadOutcome::Expired | ReadOutcome::Corrupt(_) => (false, false),
        };
        let decoded = self.inner.policy.decode(&stored)?;
        let mut meta = decoded.meta;
        if decoded.kept_by_store {
            // The envelope says when it would have expired unread; the store knows when
            // it will (contract §3.1).
            match self.l2_op(self.inner.stores.entries.ttl_ms(&entry)).await? {
                Some(ttl_ms) => meta.expires_at_ms = now.saturating_add(ttl_ms),
                // Gone between the two reads: slid out or removed.
                None => return Ok(None),
            }
        }
        let value_len = decoded.value_len;
        Ok(Some(Inspection {
            meta,
            value_len,
            fresh,
            stale,
            stored_len: stored.len(),
        }))
    }

    /// What this cache has done so far.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.metrics.snapshot()
    }

    /// Get-or-set flights in progress in this process, eager refreshes included: 0
    /// whenever none runs (the registry keeps no entry for a finished or abandoned
    /// flight). A gauge a service may export beside [`metrics`](Self::metrics).
    pub fn flights_in_progress(&self) -> usize {
        self.inner.registry.len() + self.inner.refreshes.len()
    }

    /// Flights running in tasks of their own (`fetch` and eager refreshes) that have
    /// not ended yet, lock release and announcement included, and failed removals
    /// being retried ([`remove`](Self::remove)).
    #[cfg(any(test, feature = "test-util"))]
    pub fn background_in_progress(&self) -> usize {
        self.inner.background.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Callers in this process waiting on the flight of `key` (0 when none runs).
    #[cfg(any(test, feature = "test-util"))]
    pub fn followers_of(&self, key: &str) -> usize {
        self.inner.registry.followers(key)
    }

    /// The entries store (for tests that plant or inspect raw bytes).
    #[cfg(any(test, feature = "test-util"))]
    pub fn entries(&self) -> &dyn crate::store::Entries {
        &*self.inner.stores.entries
    }

    /// The prefix this cache's data is named under.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The name `key`'s entry has in the store (for tests that plant raw bytes).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key.
    #[cfg(any(test, feature = "test-util"))]
    pub fn entry_name(&self, key: &str) -> Result<String> {
        self.inner
            .policy
            .locate_entry(&self.inner.prefix, key, self.inner.tags.generation_now())
    }

    /// The in-memory store, when that is the backend.
    #[cfg(any(test, feature = "test-util"))]
    pub fn memory_store(&self) -> Option<&crate::store::memory::MemoryStore> {
        self.inner.stores.memory.as_ref()
    }

    /// Commands this cache's Redis store has sent so far (a script counts as one), when
    /// Redis is the backend: what a workload costs the server. The announcements'
    /// subscription and the lock APIs' leases are not counted.
    #[cfg(feature = "redis")]
    pub fn redis_commands_sent(&self) -> Option<u64> {
        self.inner.stores.redis.as_ref().map(|r| r.commands_sent())
    }

    /// The Redis store, when that is the backend.
    #[cfg(all(feature = "redis", any(test, feature = "test-util")))]
    pub fn redis_store(&self) -> Option<&crate::store::redis::RedisStore> {
        self.inner.stores.redis.as_ref()
    }

    /// The guest's decisions, for tests that compare against them.
    #[cfg(any(test, feature = "test-util"))]
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The lock APIs of this cache: they share its guest, clock, limits and Redis
    /// connection.
    pub fn locks(&self) -> &crate::locks::Locks {
        &self.inner.locks
    }

    /// The name of the L2 backend: `memory` or `redis`.
    pub fn backend(&self) -> &'static str {
        self.inner.stores.entries.name()
    }

    /// The clock this cache reads.
    pub fn clock(&self) -> &dyn Clock {
        &*self.inner.clock
    }

    pub(crate) async fn l2_op<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        op.await.map_err(|e| self.l2_failed(e))
    }

    /// Counts a failed store operation.
    pub(crate) fn l2_failed(&self, e: Error) -> Error {
        Metrics::bump(&self.inner.metrics.l2_errors);
        e
    }

    /// Checks `key` and names its data in the store, in the prefix's current
    /// generation (contract §2.4, §7.5).
    /// A get-or-set's names: when the generation cannot be read (the store is down),
    /// the last one known, so the flight goes on to degrade as it would (§5.8); the
    /// read is bounded by one store timeout. Says whether the entry may be read under
    /// them ([`flight_generation`](Self::flight_generation)).
    pub(crate) async fn locate(&self, key: &str) -> Result<(StoreNames, bool)> {
        let policy = &self.inner.policy;
        let (generation, readable) = self.flight_generation(|| policy.validate_key(key)).await?;
        Ok((self.names_in(key, generation)?, readable))
    }

    /// The store names of `key` (already checked) in `generation`: remembered, else the
    /// guest's.
    pub(crate) fn names_in(&self, key: &str, generation: u64) -> Result<StoreNames> {
        let inner = &*self.inner;
        inner.flight_names.remembered_or(key, generation, || {
            inner.policy.locate(&inner.prefix, key, generation)
        })
    }

    /// The generation a get-or-set names its data in: the known one, else one read
    /// within a store timeout, else the last one known. `check` runs first when it must
    /// be read: a bad key is an argument error, even with the store down. Says whether
    /// entries may be read in it: not when it stands in for one that could not be read
    /// and a clear may have been missed since it was ([`tags::TagState::fallback`]): the
    /// flight then degrades as if its reads had failed.
    async fn flight_generation(&self, check: impl FnOnce() -> Result<()>) -> Result<(u64, bool)> {
        if let Some(g) = self.known_generation() {
            return Ok((g, true));
        }
        check()?;
        let bound = self.inner.flight.store_timeout;
        Ok(match tokio::time::timeout(bound, self.generation()).await {
            Ok(Ok(g)) => (g, true),
            _ => match self.inner.tags.fallback() {
                Some(g) => (g, true),
                None => (self.inner.tags.generation_now(), false),
            },
        })
    }

    /// A batch's keys (hashed `hashes`, in order, by the names'
    /// [`hash`](named::Names::hash)), all checked (contract §5.16), and named (by memory
    /// or in one guest call) when the prefix's generation is known: their names in it.
    /// `None` when it is not: the keys are checked by the guest alone, and named by
    /// [`locate_entries`](Self::locate_entries) once L1 answered what it holds, so that a
    /// batch of L1 hits waits on no store, as one get-or-set's L1 hit does not.
    pub(crate) fn entries_if_known(&self, keys: &[&str], hashes: &[u64]) -> Result<Option<(Parts, u64)>> {
        match self.known_generation() {
            Some(generation) => Ok(Some((self.entries_hashed(keys, hashes, generation)?, generation))),
            None => {
                let (policy, prefix) = (&self.inner.policy, &self.inner.prefix);
                policy.locate_entries(prefix, keys, 0).map(|_| None)
            }
        }
    }

    /// The entry names of a batch's keys, checked already
    /// ([`entries_if_known`](Self::entries_if_known)), in the generation
    /// [`locate`](Self::locate) would use (read now if it is not known): the names, that
    /// generation, and whether they may be read.
    pub(crate) async fn locate_entries(&self, keys: &[&str]) -> Result<(Parts, u64, bool)> {
        let (generation, readable) = self.flight_generation(|| Ok(())).await?;
        Ok((self.entries_in(keys, generation)?, generation, readable))
    }

    /// Checks `key` and names its entry in the store, in the current generation.
    pub(crate) async fn entry_of(&self, key: &str) -> Result<String> {
        let policy = &self.inner.policy;
        let generation = self.current_generation(|| policy.validate_key(key)).await?;
        // Only a valid key was ever named.
        self.inner.names.remembered_or(key, generation, || {
            policy.locate_entry(&self.inner.prefix, key, generation)
        })
    }

    /// The entry names of `keys`, all checked and named (by memory or in one guest call),
    /// in the generation [`entry_of`](Self::entry_of) would use.
    pub(crate) async fn entries_of<K: AsRef<str>>(&self, keys: &[K]) -> Result<Parts> {
        let (policy, prefix) = (&self.inner.policy, &self.inner.prefix);
        let check = || policy.locate_entries(prefix, keys, 0).map(drop);
        let generation = self.current_generation(check).await?;
        self.entries_in(keys, generation)
    }

    /// The entry names of `keys` in `generation`: the remembered ones from memory (those
    /// keys were checked when the guest named them), the others checked and named by
    /// the guest in one call.
    fn entries_in<K: AsRef<str>>(&self, keys: &[K], generation: u64) -> Result<Parts> {
        let names = &self.inner.names;
        let hashes: Vec<u64> = keys.iter().map(|k| names.hash(k.as_ref())).collect();
        self.entries_hashed(keys, &hashes, generation)
    }

    /// [`entries_in`](Self::entries_in), the keys hashed already (`hashes`, in order, by
    /// the names' [`hash`](named::Names::hash)).
    fn entries_hashed<K: AsRef<str>>(&self, keys: &[K], hashes: &[u64], generation: u64) -> Result<Parts> {
        let remembered = &self.inner.names;
        // A name is about the prefix, the key and a few bytes more.
        let per_name = self.inner.prefix.len() + 16;
        let bytes = keys.iter().map(|k| k.as_ref().len() + per_name).sum();
        let mut parts = Parts::with_capacity(keys.len(), bytes);
        // Where the keys not remembered stand in `keys`.
        let at = remembered.write_all_to(keys, hashes, generation, &mut parts);
        if at.is_empty() {
            return Ok(parts);
        }
        let asked: Vec<&str> = at.iter().map(|&i| keys[i].as_ref()).collect();
        let (policy, prefix) = (&self.inner.policy, &self.inner.prefix);
        let named = match policy.locate_entries(prefix, &asked, generation) {
            Ok(named) => named,
            // A bad key's error names its position among those asked: asked of the whole
            // batch, the guest names the same key (the first bad one) at its place there.
            Err(e) if e.kind() == crate::ErrorKind::InvalidArgument => {
                return policy.locate_entries(prefix, keys, generation);
            }
            Err(e) => return Err(e),
        };
        for (key, name) in asked.iter().zip(named.iter()) {
            remembered.keep(key, generation, name);
        }
        let mut merged = Parts::with_capacity(keys.len(), bytes);
        let mut fresh = at.iter().zip(named.iter()).peekable();
        for i in 0..keys.len() {
            let name = match fresh.next_if(|(at, _)| **at == i) {
                Some((_, name)) => name,
                None => parts.get(i),
            };
            merged.text_mut().push_str(name);
            merged.close_part();
        }
        Ok(merged)
    }

    /// The generation a read names its entry in: the known one, else one read (never a
    /// fallback, so that a read after a clear misses). `check` runs first when it must
    /// be read: a bad key is an argument error, even with the store down.
    async fn current_generation(&self, check: impl FnOnce() -> Result<()>) -> Result<u64> {
        if let Some(g) = self.known_generation() {
            return Ok(g);
        }
        check()?;
        self.generation().await
    }

    /// Writes `header` then `value` to the entry `name`.
    pub(crate) async fn l2_write(&self, name: &str, header: &[u8], value: &[u8], ttl_ms: u64) -> Result<()> {
        let stored = crate::store::splice(header, value);
        self.l2_op(self.inner.stores.entries.set(name, stored, ttl_ms))
            .await
    }

    /// Puts `value` in L1 until the guest's deadline for `meta`, fenced by the ticket
    /// taken before the L2 step it comes from (contract §5.12).
    pub(crate) async fn fill_l1(
        &self,
        key: &str,
        value: &Bytes,
        meta: WitMeta,
        now: u64,
        how: L1Fill,
        stamp: Option<tags::TagStamp>,
    ) -> Result<()> {
        if !self.inner.l1.is_on() {
            return Ok(());
        }
        let until = self.inner.policy.l1_deadline(meta, now, self.inner.l1_ttl_ms)?;
        self.fill_l1_until(key, value, until, how, stamp);
        Ok(())
    }

    /// `corral-core`'s `flight::l1_copy_until`, which the portable body calls, in this
    /// body (a few numbers' minimum, made here rather than across the boundary per
    /// fill): a copy lives no longer than the first of its tags' moments to lapse
    /// (`tags_until_ms`, the guest's `tag-known-until`), and a copy of what the store
    /// held (`read`) no longer than the generation it was named in is known: a `clear`
    /// whose announcement this process missed is learnt when that knowledge lapses. A
    /// value this process loaded or wrote is newer than any clear it missed.
    pub(crate) fn l1_copy_until(&self, deadline_ms: u64, read: bool, tags_until_ms: u64) -> u64 {
        let generation = if read {
            self.inner.tags.generation_known_until()
        } else {
            u64::MAX
        };
        deadline_ms.min(generation).min(tags_until_ms)
    }

    /// Puts `value` in L1 until `until` (the guest's deadline), fenced as
    /// [`fill_l1`](Self::fill_l1) fences it.
    pub(crate) fn fill_l1_until(
        &self,
        key: &str,
        value: &Bytes,
        until: u64,
        how: L1Fill,
        stamp: Option<tags::TagStamp>,
    ) {
        self.fill_l1_until_unless(key, value, until, how, stamp, || false);
    }

    /// As [`fill_l1_until`](Self::fill_l1_until); a fill of a read is also refused if
    /// `overtaken`, asked as it fills ([`L1::fill_entry_unless`]), says a newer copy may
    /// be in L1 since the read.
    pub(crate) fn fill_l1_until_unless(
        &self,
        key: &str,
        value: &Bytes,
        until: u64,
        how: L1Fill,
        stamp: Option<tags::TagStamp>,
        overtaken: impl FnOnce() -> bool,
    ) {
        let tags_until = stamp.map_or(u64::MAX, |s| s.until_ms);
        let until = self.l1_copy_until(until, matches!(how, L1Fill::Read(_)), tags_until);
        let tagged = stamp.and_then(|s| s.tagged);
        let l1 = &self.inner.l1;
        match how {
            L1Fill::Read(ticket) => {
                l1.fill_unless(key, value.clone(), until, ticket, tagged, overtaken);
            }
            L1Fill::Write(ticket) => l1.insert(key, value.clone(), until, ticket, tagged),
        }
    }
}

/// A removal's tombstone on its way to the store: dropped unsettled (its write failed,
/// went unanswered, or its caller stopped waiting), it is written again in the
/// background ([`Corral::remove_in_background`]).
struct Unsettled {
    cache: Corral,
    key: String,
    /// The entry's name in the store; `None` while it could not be named (the
    /// prefix's generation could not be read): the retry names it.
    entry: Option<String>,
    watch: Option<RemovalWatch>,
}

impl Unsettled {
    /// The write's outcome is known: nothing to retry.
    fn settle(mut self) {
        self.watch = None;
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        if let Some(watch) = self.watch.take() {
            let entry = self.entry.take();
            self.cache.remove_in_background(&self.key, entry, watch);
        }
    }
}
