//! The host side of the portable body's imports (`l1`, `l2`, `flights`, the lock
//! `table`), as wasmtime's wasi-keyvalue does it: a shared [`Backend`], a per-call
//! [`CallState`], and one `add_to_linker`.
//!
//! Imports block on the stores: a portable call runs on a blocking thread, or, in
//! lockstep ([`super::PortableBuilder::lockstep`]), on a thread whose every store step
//! the caller's task performs while that thread waits. Every flight a call led and did
//! not end is handed on when the call ends.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::oneshot;

use wasmtime::component::{HasData, Linker, ResourceTable};
use wasmtime_wasi::{HostWallClock, WasiCtx, WasiCtxView, WasiView};

use crate::cache::registry::{self, Join, LeaderGuard, Registry, Shared};
use crate::clock::Clock;
use crate::guest::bindings::Guest;
use crate::guest::bindings::corral::cache::flights::{self, Joined};
use crate::guest::bindings::corral::cache::{l1, l2, types};
use crate::guest::bindings::corral::lock::table;
use crate::guest::bindings::corral::lock::types::Held;
use crate::guest::convert::to_wit;
use crate::store::l1::Ticket;
use crate::store::{LandingWatch, Stores};

/// What a flight's followers get in the portable body: what `flights.finish` passed.
pub(crate) type WitOutcome = Result<Vec<u8>, types::Error>;

/// What every instance of one portable cache shares.
pub(crate) struct Backend {
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) clock: Arc<dyn Clock>,
    /// The `l1` import's tier: the native body's L1 with its fencing, holding the
    /// guest's own record. Another process's announced change drops its key; a gap in
    /// the announcements drops everything ([`l1_invalidation`]).
    pub(crate) l1: crate::store::l1::L1<l1::L1Entry>,
    pub(crate) stores: Stores,
    /// How a failed change announcement is retried: as the native body does.
    pub(crate) announcing: Announcing,
    pub(crate) registry: Registry<WitOutcome>,
    /// The `lock` export's table: a [`MemoryLocks`](crate::locks::MemoryLocks), whose
    /// own sweeper removes expired entries in the background (contract §6.2).
    pub(crate) table: crate::locks::MemoryLocks,
    /// Announcements retried in the background, until they end.
    pub(crate) owed: crate::owed::Owed,
}

/// The schedule and bounds of change announcements retried in the background.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Announcing {
    pub(crate) retry: crate::store::Retry,
    /// Each try's bound: the store's timeout.
    pub(crate) bound: Duration,
    /// The L1 TTL: other processes' copies have lapsed by then.
    pub(crate) give_up_after: Duration,
}

/// What one call brings: the flights it leads, the locks it holds.
#[derive(Default)]
pub(crate) struct CallState {
    /// Set when the caller went away: the call ends at its load (contract §5.11).
    pub(crate) cancelled: Arc<AtomicBool>,
    /// The flights this call leads, until it finishes them.
    pub(crate) leading: HashMap<String, LeaderGuard<WitOutcome>>,
    /// The flights a batch of this call follows (`flights.join-many`), until a `join`
    /// of the key takes their outcome.
    pub(crate) following: HashMap<String, oneshot::Receiver<Shared<WitOutcome>>>,
    /// The flight locks this call holds (key, owner token), until it releases them.
    pub(crate) locks: HashMap<String, String>,
    /// In lockstep: where this call's store steps are performed.
    pub(crate) lockstep: Option<Lockstep>,
    /// The loader panicked: what its caller gets (the call traps).
    pub(crate) panicked: Option<crate::Error>,
    /// The deadline the guest armed for this call's store steps (`l2.bound`).
    pub(crate) deadline: Option<tokio::time::Instant>,
}

/// A store step a lockstep call hands to its caller's task.
pub(crate) type Step = BoxFuture<'static, ()>;

/// A lockstep call's link to its caller's task, which performs each step it is sent and
/// waits for the next while the call's thread computes: one of the two runs at a time.
#[derive(Clone, Debug)]
pub(crate) struct Lockstep {
    steps: mpsc::Sender<Step>,
}

/// Waits for what the other side of a lockstep sends: spinning for up to `spin`, then
/// blocking. The caller's task spins a little (the call usually computes for
/// microseconds, about what a thread takes to wake up); a call's thread does not (its
/// caller's step may wait on other tasks for long, and many calls may be waiting).
pub(crate) fn recv_soon<T>(rx: &mpsc::Receiver<T>, spin: Duration) -> Result<T, mpsc::RecvError> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(mpsc::TryRecvError::Disconnected) => return Err(mpsc::RecvError),
            Err(mpsc::TryRecvError::Empty) if start.elapsed() < spin => std::hint::spin_loop(),
            Err(mpsc::TryRecvError::Empty) => return rx.recv(),
        }
    }
}

thread_local! {
    /// The lockstep link of the call running on this thread (for its loader).
    static CURRENT: RefCell<Option<Lockstep>> = const { RefCell::new(None) };
}

impl Lockstep {
    pub(crate) fn new(steps: mpsc::Sender<Step>) -> Self {
        Lockstep { steps }
    }

    /// Runs `step` on the caller's task and waits for its output; `None` when the caller
    /// went away.
    pub(crate) fn run<T: Send + 'static>(&self, step: impl Future<Output = T> + Send + 'static) -> Option<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let step = async move {
            let _ = tx.send(step.await);
        };
        self.steps.send(step.boxed()).ok()?;
        rx.recv().ok()
    }

    /// Makes this the link of the call on this thread while `f` runs.
    pub(crate) fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        let previous = CURRENT.with(|c| c.replace(Some(self.clone())));
        let out = f();
        CURRENT.with(|c| *c.borrow_mut() = previous);
        out
    }
}

/// Inside a lockstep call (its loader, on the call's thread): runs `step` on the
/// caller's task and waits for it. `None` outside a lockstep call, or when the caller
/// went away.
#[cfg_attr(not(any(test, feature = "test-util")), allow(dead_code))]
pub fn in_caller<T: Send + 'static>(step: impl Future<Output = T> + Send + 'static) -> Option<T> {
    let link = CURRENT.with(|c| c.borrow().clone())?;
    link.run(step)
}

impl Backend {
    /// Ends a call: the flight locks it still holds (it trapped or was cancelled
    /// mid-flight, or a lock try's reply was lost) are released, owner-checked, and the
    /// releases announced, so the process that takes over need not wait out the locks'
    /// TTL; then the flights it led are handed on. The releases go out together, and
    /// end within one store timeout however many there are: what is left expires by
    /// its TTL.
    pub(crate) fn end_call(&self, call: CallState) {
        if !call.locks.is_empty() {
            let stores = self.stores.clone();
            let locks: Vec<(String, String)> =
                call.locks.iter().map(|(k, o)| (k.clone(), o.clone())).collect();
            let bound = self.announcing.bound;
            let released = self.io(call.lockstep.as_ref(), async move {
                let each = locks.iter().map(|(key, owner)| async {
                    stores.flight_lock.release(key, owner).await?;
                    stores.notifications.announce(key).await
                });
                tokio::time::timeout(bound, futures::future::join_all(each)).await
            });
            match released {
                Some(Ok(each)) => {
                    for e in each.into_iter().filter_map(std::result::Result::err) {
                        tracing::warn!(error = %e, "releasing an abandoned flight lock failed; it expires by its TTL");
                    }
                }
                Some(Err(_)) => {
                    tracing::warn!("releasing abandoned flight locks timed out; they expire by their TTL");
                }
                None => tracing::warn!("the caller went away: an abandoned flight lock expires by its TTL"),
            }
        }
        drop(call);
    }

    /// Performs one store step: on the caller's task in lockstep, else blocking this
    /// thread on the runtime. `None`: the (lockstep) caller went away.
    fn io<T: Send + 'static>(
        &self,
        lockstep: Option<&Lockstep>,
        step: impl Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        match lockstep {
            Some(link) => link.run(step),
            None => Some(self.runtime.block_on(step)),
        }
    }
}

/// The store data of a portable instance.
pub(crate) struct PortableState {
    wasi: WasiCtx,
    resources: ResourceTable,
    pub(crate) backend: Arc<Backend>,
    pub(crate) call: CallState,
}

impl fmt::Debug for PortableState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PortableState").finish_non_exhaustive()
    }
}

/// What an import answers when its lockstep caller went away.
fn gone() -> types::Error {
    to_wit(&crate::Error::new(
        crate::ErrorKind::Unavailable,
        "the caller went away",
    ))
}

impl PortableState {
    /// Performs one store step of this call (see [`Backend::io`]); a caller gone marks
    /// the call cancelled.
    fn io<T: Send + 'static>(&mut self, step: impl Future<Output = T> + Send + 'static) -> Option<T> {
        let out = self.backend.io(self.call.lockstep.as_ref(), step);
        if out.is_none() {
            self.call.cancelled.store(true, Ordering::SeqCst);
        }
        out
    }

    /// As [`io`](Self::io), for a step whose result is a store result; a step still
    /// running at the call's deadline (`l2.bound`) fails with a timeout.
    fn store<T: Send + 'static>(
        &mut self,
        step: impl Future<Output = crate::Result<T>> + Send + 'static,
    ) -> Result<T, types::Error> {
        let deadline = self.call.deadline;
        let bounded = async move {
            let Some(deadline) = deadline else {
                return step.await;
            };
            tokio::time::timeout_at(deadline, step).await.unwrap_or_else(|_| {
                Err(crate::Error::new(
                    crate::ErrorKind::Timeout,
                    "the store step ran past the get-or-set's deadline",
                ))
            })
        };
        match self.io(bounded) {
            Some(out) => out.map_err(|e| to_wit(&e)),
            None => Err(gone()),
        }
    }

    /// An instance's data: the guest reads `backend.clock` as `wasi:clocks/wall-clock`.
    pub(crate) fn new(backend: Arc<Backend>) -> Self {
        let mut wasi = WasiCtx::builder();
        wasi.wall_clock(WallClock(backend.clock.clone()));
        PortableState {
            wasi: wasi.build(),
            resources: ResourceTable::new(),
            backend,
            call: CallState::default(),
        }
    }
}

impl WasiView for PortableState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.resources,
        }
    }
}

struct Portable;

impl HasData for Portable {
    type Data<'a> = &'a mut PortableState;
}

/// Links WASI and the portable imports.
pub(crate) fn add_to_linker(linker: &mut Linker<PortableState>) -> wasmtime::Result<()> {
    wasmtime_wasi::p2::add_to_linker_sync(linker)?;
    Guest::add_to_linker::<_, Portable>(linker, |s| s)
}

/// The cache's clock as the guest's `wasi:clocks/wall-clock`.
struct WallClock(Arc<dyn Clock>);

impl HostWallClock for WallClock {
    fn resolution(&self) -> Duration {
        Duration::from_millis(1)
    }

    fn now(&self) -> Duration {
        Duration::from_millis(self.0.now_ms())
    }
}

impl types::Host for &mut PortableState {}

impl crate::guest::bindings::corral::lock::types::Host for &mut PortableState {}

/// What the portable body's L1 does with other processes' announcements: as the native
/// body's L1 does, the key named is dropped, and a gap drops everything.
pub(crate) fn l1_invalidation(l1: crate::store::l1::L1<l1::L1Entry>) -> crate::store::ForeignHook {
    Arc::new(move |key: Option<String>| l1.hear(key.as_deref()))
}

/// What it does with a tag or clear announcement, its own included (contract §7.5):
/// everything goes, as after a `clear`, and the guest, seeing L1's generations move,
/// reads tags and the generation again. The host reads no message: the guest keeps
/// what they say.
pub(crate) fn tag_invalidation(l1: crate::store::l1::L1<l1::L1Entry>) -> crate::store::InvalidationHook {
    Arc::new(move |_message: &str| l1.clear_generation())
}

fn ticket_in(t: l1::L1Ticket) -> Ticket {
    Ticket::from_parts([t.flushes, t.generations, t.writes])
}

impl l1::Host for &mut PortableState {
    fn ticket(&mut self, key: String) -> l1::L1Ticket {
        let [flushes, generations, writes] = self.backend.l1.ticket(&key).parts();
        l1::L1Ticket {
            flushes,
            generations,
            writes,
        }
    }

    fn get(&mut self, key: String) -> Option<l1::L1Entry> {
        self.backend.l1.peek(&key)
    }

    fn fill(&mut self, key: String, entry: l1::L1Entry, since: l1::L1Ticket) -> bool {
        self.backend.l1.fill_entry(&key, entry, ticket_in(since))
    }

    fn set(&mut self, key: String, entry: l1::L1Entry, since: l1::L1Ticket) {
        self.backend.l1.insert_entry(&key, entry, ticket_in(since));
    }

    fn delete(&mut self, key: String) {
        self.backend.l1.remove(&key);
    }

    fn clear(&mut self) {
        self.backend.l1.clear_generation();
    }

    fn flush(&mut self) {
        self.backend.l1.hear(None);
    }
}

impl l2::Host for &mut PortableState {
    fn get(&mut self, key: String) -> Result<Option<Vec<u8>>, types::Error> {
        let b = self.backend.clone();
        self.store(async move { b.stores.entries.get(&key).await })
            .map(|v| v.map(|b| b.to_vec()))
    }

    fn get_many(&mut self, names: Vec<String>) -> Vec<Result<Option<Vec<u8>>, types::Error>> {
        let b = self.backend.clone();
        let count = names.len();
        let reads = self.store(async move {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            Ok(b.stores.entries.get_many(&names).await)
        });
        match reads {
            Ok(reads) => reads
                .into_iter()
                .map(|read| read.map(|v| v.map(|b| b.to_vec())).map_err(|e| to_wit(&e)))
                .collect(),
            // The deadline passed, or the caller went away: every read failed.
            Err(e) => vec![Err(e); count],
        }
    }

    fn set(&mut self, key: String, value: Vec<u8>, ttl_ms: u64) -> Result<(), types::Error> {
        let b = self.backend.clone();
        self.store(async move { b.stores.entries.set(&key, value.into(), ttl_ms).await })
    }

    fn delete(&mut self, key: String) -> Result<bool, types::Error> {
        let b = self.backend.clone();
        self.store(async move { b.stores.entries.delete(&key).await })
    }

    fn swap(&mut self, key: String, value: Vec<u8>, ttl_ms: u64) -> Result<Option<Vec<u8>>, types::Error> {
        let b = self.backend.clone();
        self.store(async move { b.stores.entries.swap(&key, value.into(), ttl_ms).await })
            .map(|old| old.map(|b| b.to_vec()))
    }

    fn delete_if_equal(&mut self, key: String, expected: Vec<u8>) -> Result<bool, types::Error> {
        let b = self.backend.clone();
        self.store(async move { b.stores.entries.delete_if_equal(&key, expected.into()).await })
    }

    fn replace_if_equal(
        &mut self,
        key: String,
        expected: Vec<u8>,
        value: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<bool, types::Error> {
        let b = self.backend.clone();
        self.store(async move {
            b.stores
                .entries
                .replace_if_equal(&key, expected.into(), value.into(), ttl_ms)
                .await
        })
    }

    fn set_if(
        &mut self,
        key: String,
        expected: Option<Vec<u8>>,
        value: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<bool, types::Error> {
        let b = self.backend.clone();
        self.store(async move {
            b.stores
                .entries
                .set_if(&key, expected.map(Into::into), value.into(), ttl_ms)
                .await
        })
    }

    /// Through [`FlightLock::fill_releasing`](crate::store::FlightLock::fill_releasing)
    /// where the entries and the lock are one store, as the native body's fill; a lock
    /// whose step failed stays the call's, released at its end.
    fn fill_releasing(
        &mut self,
        name: String,
        expected: Option<Vec<u8>>,
        value: Vec<u8>,
        ttl_ms: u64,
        lock: String,
        owner: String,
        key: String,
    ) -> Result<Option<l2::Filled>, types::Error> {
        let b = self.backend.clone();
        if !b.stores.fill_with_lock() {
            return Ok(None);
        }
        let filled = {
            let (lock, announce_key) = (lock.clone(), key.clone());
            self.store(async move {
                let fill = crate::store::Fill {
                    name: &name,
                    over: Some(expected.map(Into::into)),
                    bytes: value.into(),
                    ttl_ms,
                };
                let announcement = b.stores.notifications.announcement(&announce_key);
                let announce = announcement.as_ref().map(|(c, m)| (c.as_str(), m.as_str()));
                match b.stores.flight_lock.fill_releasing(fill, &lock, &owner, announce) {
                    Some(step) => step.await.map(Some),
                    None => Ok(None),
                }
            })?
        };
        let Some(filled) = filled else {
            return Ok(None);
        };
        self.call.locks.remove(&lock);
        if !filled.announced {
            l2::Host::announce_landing(self, key);
        }
        Ok(Some(l2::Filled {
            written: filled.written,
            held: filled.held,
        }))
    }

    fn try_lock(&mut self, key: String, ttl_ms: u64) -> Result<Option<String>, types::Error> {
        let b = self.backend.clone();
        // The token is the call's before it is sent (contract §5.13): should the reply be
        // lost, the end of the call releases it, owner-checked.
        let owner = crate::lock_token();
        self.call.locks.insert(key.clone(), owner.clone());
        let taken = {
            let (key, owner) = (key.clone(), owner.clone());
            self.store(async move { b.stores.flight_lock.try_lock(&key, &owner, ttl_ms).await })?
        };
        if !taken {
            self.call.locks.remove(&key);
        }
        Ok(taken.then_some(owner))
    }

    /// A release that failed leaves the lock the call's: its end releases it again.
    fn release_lock(&mut self, key: String, owner: String) -> Result<bool, types::Error> {
        let b = self.backend.clone();
        let released = {
            let (key, owner) = (key.clone(), owner);
            self.store(async move { b.stores.flight_lock.release(&key, &owner).await })
        };
        if released.is_ok() {
            self.call.locks.remove(&key);
        }
        released
    }

    fn wait_landing(&mut self, key: String, until_ms: u64) -> bool {
        let b = self.backend.clone();
        let deadline = self.call.deadline;
        self.io(async move {
            let watching = b.stores.notifications.watch(&key);
            let mut watch = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, watching)
                    .await
                    .unwrap_or_else(|_| LandingWatch::never()),
                None => watching.await,
            };
            watch.wait(&*b.clock, until_ms, deadline).await
        })
        // The caller went away: its call has no time left.
        .unwrap_or(true)
    }

    /// Published within the store's timeout; one that fails is retried in the
    /// background, as the native body's tag and clear announcements are.
    fn announce_invalidation(&mut self, message: String) {
        let b = self.backend.clone();
        let a = b.announcing;
        self.io(async move {
            let notifications = b.stores.notifications.clone();
            let publish = move || {
                let (notifications, message) = (notifications.clone(), message.clone());
                async move {
                    matches!(
                        tokio::time::timeout(a.bound, notifications.publish_invalidation(&message)).await,
                        Ok(Ok(()))
                    )
                }
            };
            if !publish().await {
                a.retry.in_background(
                    &b.owed,
                    a.give_up_after,
                    "",
                    false,
                    "a tag or clear announcement could not be published within the L1 TTL",
                    publish,
                );
            }
        });
    }

    /// A bound too far to represent is none.
    fn bound(&mut self, ms: u64) {
        self.call.deadline = tokio::time::Instant::now().checked_add(Duration::from_millis(ms));
    }

    /// Announced within the store's timeout; one that fails is retried in the
    /// background, as the native body's are (the change may have landed).
    fn announce_landing(&mut self, key: String) {
        let b = self.backend.clone();
        let a = b.announcing;
        let published = self.io(async move {
            let published = tokio::time::timeout(a.bound, b.stores.notifications.announce(&key)).await;
            if !matches!(published, Ok(Ok(()))) {
                a.retry.announce_in_background(
                    &b.owed,
                    b.stores.notifications.clone(),
                    &key,
                    a.bound,
                    a.give_up_after,
                );
            }
        });
        let _ = published;
    }
}

impl flights::Host for &mut PortableState {
    fn join(&mut self, key: String) -> Joined {
        let b = self.backend.clone();
        // A flight a batch joined: its outcome, or (its leader gone) a join anew.
        if let Some(rx) = self.call.following.remove(&key) {
            match self.io(registry::follow(rx)) {
                Some(Shared::Done(Ok(value))) => return Joined::Value(value),
                Some(Shared::Done(Err(e))) => return Joined::Failed(e),
                Some(Shared::Gone) => {}
                None => return Joined::Failed(gone()),
            }
        }
        let joined = {
            let key = key.clone();
            self.io(async move { b.registry.lead_or_follow(&key, || b.l1.ticket(&key)).await })
        };
        match joined {
            Some(Ok(guard)) => {
                self.call.leading.insert(key, guard);
                Joined::Lead
            }
            Some(Err(Ok(value))) => Joined::Value(value),
            Some(Err(Err(e))) => Joined::Failed(e),
            None => Joined::Failed(gone()),
        }
    }

    fn join_many(&mut self, keys: Vec<String>) -> Vec<bool> {
        let b = &self.backend;
        let joins = b
            .registry
            .join_many(keys.iter().map(String::as_str), |key| b.l1.ticket(key));
        keys.into_iter()
            .zip(joins)
            .map(|(key, join)| match join {
                Join::Leader(guard) => {
                    self.call.leading.insert(key, guard);
                    true
                }
                Join::Follower(rx) => {
                    self.call.following.insert(key, rx);
                    false
                }
            })
            .collect()
    }

    fn finish(&mut self, key: String, outcome: Result<Vec<u8>, types::Error>) {
        if let Some(guard) = self.call.leading.remove(&key) {
            guard.finish(outcome);
        }
    }

    /// The guard goes without an outcome: a follower leads.
    fn abandon(&mut self, key: String) {
        self.call.leading.remove(&key);
    }
}

impl table::Host for &mut PortableState {
    fn get(&mut self, key: String) -> Option<Held> {
        self.backend.table.held(&key)
    }

    fn compare_and_swap(&mut self, key: String, expected: Option<Held>, new: Held) -> bool {
        self.backend.table.compare_and_swap(&key, expected.as_ref(), new)
    }
}
