//! The stores a body performs I/O on, behind pure-I/O traits: none of them decides
//! anything the contract governs, and none calls the guest.
//!
//! - [`Entries`]: envelopes (header + value bytes) under keys: read, write, conditional
//!   write, delete. A store MAY drop an entry once the TTL it was written with passes
//!   (Redis does, the memory store does): the TTL is an upper bound the guest computes.
//! - [`FlightLock`]: the get-or-set's distributed lock: try-lock (`SET NX PX`) and an
//!   owner-checked release.
//! - [`Notifications`]: landings: announce that a key changed or a value landed, and
//!   watch for it (followers wake on it; other processes drop their L1 copy).
//!
//! Backends: [`memory`] (the embedded default, one process) and [`redis`]; `Stores`
//! is the one place a cache's three are composed. `l1` is the in-process tier.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::Result;

#[cfg(feature = "redis")]
mod breaker;
pub(crate) mod l1;
mod landing;
// The Redis connection type is no part of the API: only tests reach it.
#[cfg(all(feature = "redis", any(test, feature = "test-util")))]
pub mod link;
#[cfg(all(feature = "redis", not(any(test, feature = "test-util"))))]
pub(crate) mod link;
pub mod memory;
#[cfg(feature = "redis")]
mod owners;
#[cfg(feature = "redis")]
pub(crate) mod pubsub;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
mod redis_options;
#[cfg(feature = "redis")]
pub(crate) mod script;
#[cfg(all(feature = "redis", feature = "test-util"))]
pub mod wire;

pub use landing::LandingWatch;

/// The entries and the flight lock of a cache, as a
/// [`CorralBuilder::store_layer`](crate::CorralBuilder::store_layer) wraps them.
#[cfg(feature = "test-util")]
pub type Layered = (Arc<dyn Entries>, Arc<dyn FlightLock>);
pub use landing::Landings;

/// Envelopes under string keys. Every method is one atomic step on the store.
///
/// Failures are [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) errors, with
/// the backend's own error as the source.
pub trait Entries: Send + Sync + fmt::Debug + 'static {
    /// The bytes under `key`, as stored. A value that is not bytes (a Redis hash, list,
    /// ...) is an [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) error.
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>>;

    /// Whether reads that reach this store together are worth sending together
    /// ([`get_many`](Self::get_many)): true for a store across a network, where every
    /// request costs a round trip; false (the default) for one in memory.
    fn gathers(&self) -> bool {
        false
    }

    /// Whether the store is in parts that fail apart ([`part_of`](Self::part_of)): a
    /// Redis Cluster's masters. False (the default) for a store in one part.
    fn in_parts(&self) -> bool {
        false
    }

    /// The part of a store [in parts](Self::in_parts) that serves `key`, which a request
    /// that reads several keys waits on whole: on a Redis Cluster its master
    /// (`host:port`), `None` while the store does not know it (a part of its own).
    /// Reads gathered from several parts go each to its own, so that a frozen part
    /// delays only its own.
    fn part_of(&self, key: &str) -> Option<Arc<str>> {
        let _ = key;
        None
    }

    /// The bytes under each of `keys`, in order, as [`get`](Self::get) reads them, in as
    /// few round trips as the store allows (Redis: one `MGET` per node), each key with
    /// its own result: a node that fails fails its keys only. A key holding a value of
    /// another Redis type reads as nothing here; the get-or-set's own read after its
    /// lock meets it and removes it.
    fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Bytes>>>> {
        Box::pin(async move {
            let reads = keys.iter().map(|key| async move {
                match self.get(key).await {
                    Err(e) if e.kind() == crate::ErrorKind::Corrupt => Ok(None),
                    read => read,
                }
            });
            futures::future::join_all(reads).await
        })
    }

    /// Reads `key` and applies a read's sliding touch on the server, atomically, in one
    /// round trip, when the store can (Redis runs the guest's read-and-touch script);
    /// `None` when it cannot, and the caller reads with [`get`](Self::get) and writes
    /// the touch back with [`replace_if_equal`](Self::replace_if_equal).
    fn read_and_touch<'a>(
        &'a self,
        key: &'a str,
        now_ms: u64,
    ) -> Option<BoxFuture<'a, Result<Option<Bytes>>>> {
        let _ = (key, now_ms);
        None
    }

    /// Reads `key` and sets its TTL to `ttl_ms` in the same atomic step (`GETEX PX`), so
    /// a read slides an expiry moment the store keeps in one command; `None` when the
    /// store cannot, and the caller reads with [`get`](Self::get) and slides the TTL
    /// with [`replace_if_equal`](Self::replace_if_equal) over the same bytes.
    fn get_and_expire<'a>(
        &'a self,
        key: &'a str,
        ttl_ms: u64,
    ) -> Option<BoxFuture<'a, Result<Option<Bytes>>>> {
        let _ = (key, ttl_ms);
        None
    }

    /// How long `key` has left before the store drops it, in ms: `None` when it is
    /// missing or never expires.
    fn ttl_ms<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<u64>>>;

    /// Removes `name` if it holds something other than bytes (a value of another Redis
    /// type, which [`get`](Self::get) reports as
    /// [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt)); says whether it did. A store
    /// that holds only bytes has nothing to remove.
    fn delete_foreign<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool>> {
        let _ = name;
        Box::pin(std::future::ready(Ok(false)))
    }

    /// Writes `bytes` under `key`; the store MAY drop them after `ttl_ms`.
    fn set<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<()>>;

    /// Writes `bytes` under `name` (TTL `ttl_ms`), as [`set`](Self::set) does, and returns
    /// what was there, in one atomic step (a removal's tombstone).
    fn swap<'a>(&'a self, name: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<Option<Bytes>>>;

    /// A fenced fill (contract §5.12): writes `bytes` under `name` (TTL `ttl_ms`) only if
    /// it still holds what a read found there: nothing (`expected` is `None`) or exactly
    /// `expected`. Says whether it wrote: `false` means someone wrote since.
    fn set_if<'a>(
        &'a self,
        name: &'a str,
        expected: Option<Bytes>,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>>;

    /// Removes `key`; says whether it was there.
    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>>;

    /// Removes `key` only if it still holds exactly `expected`; says whether it did.
    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, Result<bool>>;

    /// Replaces `key`'s bytes with `bytes` (TTL `ttl_ms`) only if it still holds exactly
    /// `expected`; says whether it did.
    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: Bytes,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>>;

    /// A short name for logs and tables: `memory`, `redis`.
    fn name(&self) -> &'static str;
}

/// The get-or-set's distributed lock, one per entry key. Lock keys never meet entry keys.
pub trait FlightLock: Send + Sync + fmt::Debug + 'static {
    /// Takes the lock of `key` for `owner` if nobody holds it (`SET NX PX`); says
    /// whether it did.
    fn try_lock<'a>(&'a self, key: &'a str, owner: &'a str, ttl_ms: u64) -> BoxFuture<'a, Result<bool>>;

    /// Releases the lock of `key` if `owner` holds it; says whether it did.
    fn release<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>>;

    /// Renews the lock of `key` for `ttl_ms` from now if `owner` still holds it and, when
    /// `over` is given, the entry `entry` still holds exactly that (live bytes, or nothing
    /// for `Some(None)`), all in one step; says whether it did. A leader renews its lock
    /// while its loader runs, so that a load slower than the lock's TTL still fills, and
    /// the entry check ends the lock once the key was removed or written meanwhile, so a
    /// renewed load never outlives a removal's tombstone (contract §5.12). `None`: this
    /// store cannot, and a load that outlives the lock fills nothing. Asked only of a
    /// store that holds the entries too (the same object given as both).
    fn renew<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
        entry: &'a str,
        over: Option<Option<Bytes>>,
    ) -> Option<BoxFuture<'a, Result<bool>>> {
        let _ = (key, owner, ttl_ms, entry, over);
        None
    }

    /// As [`try_lock`](Self::try_lock), and in the same step, once taken, whether
    /// anything is under `entry` (the key's entry, one slot with the lock): `Ok(None)`
    /// busy, `Ok(Some(present))` taken. An empty entry needs no double-check read after
    /// the lock: this look, made with it, is that read. `None`: this store cannot, and
    /// the caller reads after the lock. Only for a store whose lock and entries are on
    /// the same server (a Redis store's own).
    fn try_lock_peeking<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
        entry: &'a str,
    ) -> Option<BoxFuture<'a, Result<Option<bool>>>> {
        let _ = (key, owner, ttl_ms, entry);
        None
    }

    /// As [`release`](Self::release), and publishes `message` on `channel` (a landing's
    /// announcement, [`Notifications::announcement`]) in the same step, whether or not
    /// it released: one command for both. Says whether it published (else the caller
    /// announces on its own). `None`: this store cannot. Only for a store whose lock,
    /// entries and landing channel are on the same server (a Redis store's own).
    fn release_announcing<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        channel: &'a str,
        message: &'a str,
    ) -> Option<BoxFuture<'a, Result<bool>>> {
        let _ = (key, owner, channel, message);
        None
    }

    /// A leader's fill and the release of its lock in one step (contract §5.5, §5.12):
    /// writes `fill` only while `owner` still holds the lock of `key` (a load that
    /// outlived its lock writes nothing), releases the lock if `owner` holds it, and
    /// publishes `announce` (a channel and a message) whatever happened, when given.
    /// `None`: this store cannot, and the caller writes, then releases. Asked only of a
    /// store that holds the entries too (the same object given as both), whose landing
    /// channel is on the same server.
    fn fill_releasing<'a>(
        &'a self,
        fill: Fill<'a>,
        key: &'a str,
        owner: &'a str,
        announce: Option<(&'a str, &'a str)>,
    ) -> Option<BoxFuture<'a, Result<Filled>>> {
        let _ = (fill, key, owner, announce);
        None
    }
}

/// A leader's fill of an entry ([`FlightLock::fill_releasing`]).
#[derive(Clone, Debug)]
pub struct Fill<'a> {
    /// The entry's name.
    pub name: &'a str,
    /// What the entry must still hold for the fill to land (contract §5.12): `Some(None)`
    /// nothing, `Some(Some(bytes))` exactly those bytes; `None`: anything (no read found
    /// what it held).
    pub over: Option<Option<Bytes>>,
    /// The entry's bytes.
    pub bytes: Bytes,
    /// The entry's store TTL.
    pub ttl_ms: u64,
}

/// What a [`FlightLock::fill_releasing`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Filled {
    /// The entry was written.
    pub written: bool,
    /// The lock was still the owner's (and is now released); else nothing was written.
    pub held: bool,
    /// The announcement was published.
    pub announced: bool,
}

/// What a cache does with another process's announcement: the key it names, or `None`
/// when anything may have changed (the channel was re-established after a gap).
pub type ForeignHook = Arc<dyn Fn(Option<String>) + Send + Sync>;

/// What a cache does with a tag or clear announcement (contract §7.5): the message's
/// text, as published, for the cache (its guest) to read. Stores only carry it.
pub type InvalidationHook = Arc<dyn Fn(&str) + Send + Sync>;

/// Landings: a key changed, or a loaded value landed, in some process sharing the store.
pub trait Notifications: Send + Sync + fmt::Debug + 'static {
    /// Registers interest in the next landing of `key` in any process sharing the
    /// store. Register before trying the lock, so no landing is missed. Never fails:
    /// without a channel the watch never fires and the caller's timer is the fallback.
    fn watch<'a>(&'a self, key: &'a str) -> BoxFuture<'a, LandingWatch>;

    /// Tells every process sharing the store that `key` landed or changed.
    fn announce<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<()>>;

    /// The Redis channel and message that announce `key`, for a server-side script
    /// that announces in the same step as its change (a lock's release); `None`: this
    /// store announces only through [`announce`](Self::announce).
    fn announcement(&self, key: &str) -> Option<(String, String)> {
        let _ = key;
        None
    }

    /// Calls `hook` with the key of every landing another process announces, and with
    /// `None` whenever announcements may have been missed.
    fn on_foreign(&self, hook: ForeignHook) {
        let _ = hook;
    }

    /// Tells every process sharing the store (this one included) of a tag or clear
    /// announcement (contract §7.5); a store without a channel for them does nothing.
    fn publish_invalidation<'a>(&'a self, text: &'a str) -> BoxFuture<'a, Result<()>> {
        let _ = text;
        Box::pin(std::future::ready(Ok(())))
    }

    /// Calls `hook` with the text of every tag or clear announcement, this process's
    /// own included (the cache tells them apart).
    fn on_invalidation(&self, hook: InvalidationHook) {
        let _ = hook;
    }

    /// Whether other processes' announcements are heard now: `Some(live)` for a channel
    /// that can be down (Redis pub/sub; a fresh one is waited for, within its connect
    /// and response timeouts), `None` for one that cannot (in-process).
    fn subscribed(&self) -> BoxFuture<'_, Option<bool>> {
        Box::pin(std::future::ready(None))
    }
}

/// The server-side Lua of a Redis store, as the guest writes it (data, not decisions
/// the store makes: the store runs them verbatim).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Scripts {
    /// Read and apply the sliding touch atomically.
    pub(crate) read_and_touch: String,
    /// Owner-checked delete (corrupt-entry removal, lock release, with its landing's
    /// announcement).
    pub(crate) delete_if_equal: String,
    /// The get-or-set lock with the double-check's first look.
    pub(crate) lock_and_peek: String,
    /// A leader's fill and its lock's release.
    pub(crate) fill_and_release: String,
    /// Compare-and-replace (a read's touch written back).
    pub(crate) replace_if_equal: String,
    /// A flight lock's renewal while its loader runs, owner- and entry-checked.
    pub(crate) renew_fenced: String,
    /// The grace a store TTL gets past the expiry moment.
    pub(crate) grace_ms: u64,
}

/// How long one store command may take before a body gives up on it: the Redis
/// options' response timeout, else the settings' store timeout (`default_ms`, the
/// core's default unless set).
pub(crate) fn store_timeout(
    #[cfg(feature = "redis")] redis: Option<&redis::RedisOptions>,
    default_ms: u64,
) -> std::time::Duration {
    #[cfg(feature = "redis")]
    if let Some(options) = redis {
        return options.response_timeout;
    }
    std::time::Duration::from_millis(default_ms)
}

/// A schedule of background tries (given by the guest's settings): the first wait,
/// doubled after each try up to `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Retry {
    pub(crate) first: std::time::Duration,
    pub(crate) max: std::time::Duration,
}

impl Retry {
    /// The wait after `previous`.
    pub(crate) fn next(&self, previous: std::time::Duration) -> std::time::Duration {
        (previous * 2).min(self.max)
    }

    /// Runs `attempt` from a task of its own until it says it is done: at once (unless
    /// the caller has just tried: `at_once` false), then after the first wait, doubling
    /// up to the longest, for up to `give_up_after` (a cache's L1 TTL), after which it
    /// warns with `gave_up`. The one schedule of every change either body retries in
    /// the background, counted in `owed` while it runs. Outside a Tokio runtime,
    /// nothing is retried.
    pub(crate) fn in_background<A, F>(
        self,
        owed: &crate::owed::Owed,
        give_up_after: std::time::Duration,
        key: &str,
        at_once: bool,
        gave_up: &'static str,
        mut attempt: A,
    ) where
        A: FnMut() -> F + Send + 'static,
        F: std::future::Future<Output = bool> + Send + 'static,
    {
        let key = key.to_owned();
        owed.spawn(async move {
            let started = tokio::time::Instant::now();
            let mut backoff = self.first;
            let mut wait = !at_once;
            loop {
                if wait {
                    if started.elapsed() + backoff > give_up_after {
                        tracing::warn!(key, "{gave_up}");
                        return;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = self.next(backoff);
                }
                if attempt().await {
                    return;
                }
                wait = true;
            }
        });
    }

    /// Announces `key` on `notifications` on this schedule, each try within `bound`,
    /// until one is published: a change whose announcement failed (other processes
    /// would otherwise serve their copies until their L1 deadline). The caller has just
    /// tried once.
    pub(crate) fn announce_in_background(
        self,
        owed: &crate::owed::Owed,
        notifications: Arc<dyn Notifications>,
        key: &str,
        bound: std::time::Duration,
        give_up_after: std::time::Duration,
    ) {
        let owned = key.to_owned();
        self.in_background(
            owed,
            give_up_after,
            key,
            true,
            "a change could not be announced within the L1 TTL: other processes' copies have lapsed by now",
            move || {
                let (notifications, key) = (notifications.clone(), owned.clone());
                async move {
                    match tokio::time::timeout(bound, notifications.announce(&key)).await {
                        Ok(Ok(())) => return true,
                        Ok(Err(e)) => {
                            tracing::debug!(key, error = %e, "change announcement failed; retrying")
                        }
                        Err(_) => tracing::debug!(key, "change announcement timed out; retrying"),
                    }
                    false
                }
            },
        );
    }
}

/// The bytes a store keeps for an entry: an envelope header, then the rest (the value,
/// or what follows a rewritten header). The one place the native body joins them.
pub(crate) fn splice(header: &[u8], rest: &[u8]) -> Bytes {
    let mut stored = Vec::with_capacity(header.len() + rest.len());
    stored.extend_from_slice(header);
    stored.extend_from_slice(rest);
    stored.into()
}

/// A cache's three stores, composed once.
#[derive(Clone, Debug)]
pub(crate) struct Stores {
    pub(crate) entries: Arc<dyn Entries>,
    pub(crate) flight_lock: Arc<dyn FlightLock>,
    pub(crate) notifications: Arc<dyn Notifications>,
    /// The memory backend, when that is the one (for its invalidation figures).
    #[cfg_attr(not(any(test, feature = "test-util")), allow(dead_code))]
    pub(crate) memory: Option<memory::MemoryStore>,
    /// The Redis backend, when that is the one (commands sent; the lock API's connection).
    #[cfg(feature = "redis")]
    pub(crate) redis: Option<redis::RedisStore>,
}

impl Stores {
    /// Whether the stores a cache opens ([`memory`](Self::memory), or
    /// [`redis`](Self::redis) when `redis`) keep a sliding entry's expiry moment
    /// in their TTLs (contract §3.1): the memory store's TTLs run on the cache's own
    /// clock, whatever it is; Redis's run in real time, so only with a clock that does.
    pub(crate) fn keep_sliding(redis: bool, clock: &dyn crate::Clock) -> bool {
        !redis || clock.is_real_time()
    }

    /// Whether one store object holds both the entries and the flight lock (the memory
    /// store's and a Redis store's own, or a user's store given as both), so a leader's
    /// fill may go with its release ([`FlightLock::fill_releasing`]); a layer over the
    /// entries alone, or entries apart from the lock, write through the entries.
    pub(crate) fn fill_with_lock(&self) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.entries), Arc::as_ptr(&self.flight_lock))
    }

    /// The embedded default: everything in this process.
    pub(crate) fn memory(store: memory::MemoryStore) -> Self {
        let shared = Arc::new(store.clone());
        Stores {
            entries: shared.clone(),
            flight_lock: shared,
            notifications: Arc::new(store.clone()),
            memory: Some(store),
            #[cfg(feature = "redis")]
            redis: None,
        }
    }

    /// One Redis: entries, the flight lock and the landing channel.
    #[cfg(feature = "redis")]
    pub(crate) fn redis(store: redis::RedisStore) -> Self {
        let shared = Arc::new(store.clone());
        Stores {
            entries: shared.clone(),
            flight_lock: shared,
            notifications: Arc::new(store.notifications().clone()),
            memory: None,
            redis: Some(store),
        }
    }
}
