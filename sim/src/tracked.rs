//! What the invariants need to know of a cache's store calls, call by call, that the
//! commands on the wire cannot tell: which workload call an entry read was for (reads
//! of several calls travel in one pipeline) and how it ended, and which flight locks
//! their flights know they hold. A layer over the real store
//! ([`corral::CorralBuilder::store_layer`]): it forwards every call unchanged.

use std::sync::Arc;

use bytes::Bytes;
use corral::Result;
use corral::store::{Entries, Fill, Filled, FlightLock, Layered};
use futures::FutureExt;
use futures::future::BoxFuture;

use crate::world::{CALL, DETACHED_CALLS, World};

/// The entries and flight lock of process `proc`, watched.
pub(crate) struct Tracked {
    world: Arc<World>,
    proc: usize,
    entries: Arc<dyn Entries>,
    lock: Arc<dyn FlightLock>,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracked").field("proc", &self.proc).finish()
    }
}

impl Tracked {
    /// The layer for process `proc`.
    pub(crate) fn layer(world: Arc<World>, proc: usize) -> impl FnOnce(Layered) -> Layered + Send + 'static {
        move |(entries, lock)| {
            let tracked = Arc::new(Tracked {
                world,
                proc,
                entries,
                lock,
            });
            (tracked.clone(), tracked)
        }
    }

    /// The workload call the running task serves (a flight in a task of its own, a
    /// `fetch`'s, counts for its process).
    fn call(&self) -> u64 {
        CALL.try_with(|c| *c).unwrap_or(DETACHED_CALLS + self.proc as u64)
    }

    /// Notes the call's read of `name`: still running (`pending`, which counts as failed
    /// while it lasts), or done, failed or not. A failure is kept, with its moment,
    /// through later reads of the name that succeed (the flight judged with the failed
    /// one: a re-read of a tag after the flight chose to load changes nothing).
    fn note(&self, call: u64, name: &str, pending: bool, failed: bool) {
        let now = self.world.now();
        let mut st = self.world.st.lock();
        let key = st.key_of(name);
        let read = st.reads.entry((call, key)).or_default();
        read.pending_since = pending.then_some(now);
        if failed {
            read.failed_at = Some(now);
        }
    }

    /// `read`, noted as failed until it returns; a read the flight abandons (at its
    /// deadline) failed when it was dropped.
    fn tracked<'a>(
        &'a self,
        name: &'a str,
        read: BoxFuture<'a, Result<Option<Bytes>>>,
    ) -> BoxFuture<'a, Result<Option<Bytes>>> {
        let call = self.call();
        self.note(call, name, true, false);
        async move {
            let mut abandoned = Abandoned(Some((self, call, name)));
            let got = read.await;
            abandoned.0 = None;
            self.note(call, name, false, got.is_err());
            got
        }
        .boxed()
    }

    /// The flight knows it holds the lock it took (a reply lost, or a flight that gave
    /// up waiting and dropped this future, leaves it unknown to it).
    fn taken(&self, name: &str, owner: &str) {
        let mut st = self.world.st.lock();
        if let Some(l) = st.locks.get_mut(name).filter(|l| l.owner == owner) {
            l.reply_lost = false;
        }
        st.acknowledge(owner);
    }

    fn releasing(&self, owner: &str) {
        self.world
            .st
            .lock()
            .release_attempts
            .insert((0, owner.to_owned()));
    }
}

impl Entries for Tracked {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>> {
        self.tracked(key, self.entries.get(key))
    }

    fn gathers(&self) -> bool {
        self.entries.gathers()
    }

    fn in_parts(&self) -> bool {
        self.entries.in_parts()
    }

    fn part_of(&self, key: &str) -> Option<std::sync::Arc<str>> {
        self.entries.part_of(key)
    }

    fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Bytes>>>> {
        let call = self.call();
        for key in keys {
            self.note(call, key, true, false);
        }
        async move {
            let mut abandoned: Vec<_> = keys
                .iter()
                .map(|key| Abandoned(Some((self, call, *key))))
                .collect();
            let got = self.entries.get_many(keys).await;
            abandoned.iter_mut().for_each(|a| a.0 = None);
            for (key, found) in keys.iter().zip(&got) {
                self.note(call, key, false, found.is_err());
            }
            got
        }
        .boxed()
    }

    fn read_and_touch<'a>(
        &'a self,
        key: &'a str,
        now_ms: u64,
    ) -> Option<BoxFuture<'a, Result<Option<Bytes>>>> {
        let read = self.entries.read_and_touch(key, now_ms)?;
        Some(self.tracked(key, read))
    }

    fn get_and_expire<'a>(
        &'a self,
        key: &'a str,
        ttl_ms: u64,
    ) -> Option<BoxFuture<'a, Result<Option<Bytes>>>> {
        let read = self.entries.get_and_expire(key, ttl_ms)?;
        Some(self.tracked(key, read))
    }

    fn ttl_ms<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<u64>>> {
        self.entries.ttl_ms(key)
    }

    fn delete_foreign<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.entries.delete_foreign(name)
    }

    fn set<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<()>> {
        self.entries.set(key, bytes, ttl_ms)
    }

    fn swap<'a>(&'a self, name: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<Option<Bytes>>> {
        self.entries.swap(name, bytes, ttl_ms)
    }

    fn set_if<'a>(
        &'a self,
        name: &'a str,
        expected: Option<Bytes>,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>> {
        self.entries.set_if(name, expected, bytes, ttl_ms)
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.entries.delete(key)
    }

    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, Result<bool>> {
        self.entries.delete_if_equal(key, expected)
    }

    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: Bytes,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>> {
        self.entries.replace_if_equal(key, expected, bytes, ttl_ms)
    }

    fn name(&self) -> &'static str {
        self.entries.name()
    }
}

impl FlightLock for Tracked {
    fn try_lock<'a>(&'a self, key: &'a str, owner: &'a str, ttl_ms: u64) -> BoxFuture<'a, Result<bool>> {
        async move {
            let tried = self.lock.try_lock(key, owner, ttl_ms).await;
            if let Ok(true) = tried {
                self.taken(key, owner);
            }
            tried
        }
        .boxed()
    }

    fn release<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.releasing(owner);
        self.lock.release(key, owner)
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
        entry: &'a str,
        over: Option<Option<Bytes>>,
    ) -> Option<BoxFuture<'a, Result<bool>>> {
        self.lock.renew(key, owner, ttl_ms, entry, over)
    }

    fn try_lock_peeking<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
        entry: &'a str,
    ) -> Option<BoxFuture<'a, Result<Option<bool>>>> {
        let tried = self.lock.try_lock_peeking(key, owner, ttl_ms, entry)?;
        let call = self.call();
        Some(
            async move {
                let tried = tried.await;
                if let Ok(Some(_)) = tried {
                    self.taken(key, owner);
                    // The look it took with the lock is the flight's read of the entry.
                    self.note(call, entry, false, false);
                }
                tried
            }
            .boxed(),
        )
    }

    fn release_announcing<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        channel: &'a str,
        message: &'a str,
    ) -> Option<BoxFuture<'a, Result<bool>>> {
        self.releasing(owner);
        self.lock.release_announcing(key, owner, channel, message)
    }

    fn fill_releasing<'a>(
        &'a self,
        fill: Fill<'a>,
        key: &'a str,
        owner: &'a str,
        announce: Option<(&'a str, &'a str)>,
    ) -> Option<BoxFuture<'a, Result<Filled>>> {
        self.releasing(owner);
        self.lock.fill_releasing(fill, key, owner, announce)
    }
}

/// A tracked read still running when its future is dropped: noted as failed then.
struct Abandoned<'a>(Option<(&'a Tracked, u64, &'a str)>);

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some((tracked, call, name)) = self.0.take() {
            tracked.note(call, name, false, true);
        }
    }
}
