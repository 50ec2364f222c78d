//! Leases on one Redis, or on several independent ones (Redlock).
//!
//! Acquire: `SET NX PX` with a random 128-bit owner token and `INCR` of the key's
//! fencing counter, in one script per server, on all servers in parallel. The lease is
//! held only with a majority within its validity (TTL minus elapsed minus drift), as
//! the guest decides; otherwise it is released everywhere at once. Release and extend
//! are owner-checked scripts. A lease taken without a TTL has a watchdog that renews
//! it every TTL/3 while the holder lives; when a renewal finds the lock lost (or its
//! validity runs out unconfirmed), the lease's lost signal fires.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::join_all;
use redis::Script;
use redis::aio::ConnectionManager;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::clock::{Clock, SystemClock};
use crate::guest::Policy;
use crate::guest::policy::defaults;
use crate::options::duration_ms;
use crate::store::redis::{Connection, RedisOptions};
use crate::{Error, ErrorKind, Result};

/// How a lease is taken.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct LockOptions {
    ttl: Option<Duration>,
    wait: Duration,
    watchdog_ttl: Duration,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: None,
            wait: Duration::from_secs(5),
            watchdog_ttl: Duration::from_secs(30),
        }
    }
}

impl LockOptions {
    /// A watchdog lease (renewed while held), waiting up to 5 s for the lock.
    pub fn new() -> Self {
        Self::default()
    }

    /// A lease of exactly `ttl`, no watchdog: it expires unless [`Lease::extend`]ed.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// A watchdog lease whose Redis TTL is `ttl` (default 30 s), renewed every `ttl / 3`.
    pub fn watchdog(mut self, ttl: Duration) -> Self {
        self.ttl = None;
        self.watchdog_ttl = ttl;
        self
    }

    /// The Redis TTL in ms, and whether a watchdog renews it.
    fn lease(&self) -> (u64, bool) {
        match self.ttl {
            Some(ttl) => (duration_ms(ttl), false),
            None => (duration_ms(self.watchdog_ttl), true),
        }
    }

    /// How long to keep trying (50 ms doubling to 1 s between tries); zero: one try.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }
}

/// One server of a lock: its URL (for logs) and its connection.
pub(crate) struct Server {
    url: String,
    conn: ConnectionManager,
}

impl Server {
    /// Connects (lazily) the one way Corral connects to Redis.
    pub(crate) fn open(options: &RedisOptions) -> Result<Self> {
        let conn = Connection::open(&options.url, options.connect_timeout, options.response_timeout)?;
        Ok(Server::shared(options, conn.manager))
    }

    /// A server reached through an existing connection (a cache's).
    pub(crate) fn shared(options: &RedisOptions, conn: ConnectionManager) -> Self {
        Server {
            url: options.url.clone(),
            conn,
        }
    }
}

/// Locks on one Redis (a single-server lease) or several independent ones (Redlock).
/// Cheap to clone.
#[derive(Clone)]
pub struct RedisLocks {
    inner: Arc<Inner>,
}

struct Inner {
    servers: Vec<Server>,
    policy: Policy,
    clock: Arc<dyn Clock>,
    prefix: String,
    acquire: Script,
    release: Script,
    extend: Script,
}

impl fmt::Debug for RedisLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<&str> = self.inner.servers.iter().map(|s| s.url.as_str()).collect();
        f.debug_struct("RedisLocks")
            .field("servers", &urls)
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

/// What one server said to one command.
enum Reply {
    /// The script's integer answer.
    Value(u64),
    /// The server failed or did not answer in time.
    Down,
}

impl RedisLocks {
    /// Locks on the Redis servers at `urls` (one: a plain lease; several: Redlock),
    /// keys under the prefix `corral:`, on the system clock. Connections are lazy.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for no URL or a bad one.
    pub fn connect<S: AsRef<str>>(urls: &[S]) -> Result<Self> {
        Self::connect_with(urls, "corral:", SystemClock)
    }

    /// As [`connect`](Self::connect), with a key prefix and a clock.
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub fn connect_with<S: AsRef<str>>(urls: &[S], prefix: &str, clock: impl Clock) -> Result<Self> {
        if urls.is_empty() {
            return Err(Error::invalid_argument(
                "redis url",
                "must be given at least once",
            ));
        }
        let policy = Policy::load(defaults()?.limits)?;
        let mut servers = Vec::with_capacity(urls.len());
        for url in urls {
            let options = RedisOptions::new(url.as_ref());
            servers.push(Server::open(&options)?);
        }
        Ok(Self::from_parts(policy, Arc::new(clock), servers, prefix))
    }

    /// Locks sharing a cache's guest handle, clock and Redis connection
    /// ([`Corral::locks`](crate::Corral::locks)).
    pub(crate) fn from_parts(
        policy: Policy,
        clock: Arc<dyn Clock>,
        servers: Vec<Server>,
        prefix: &str,
    ) -> Self {
        let scripts = policy.lock_scripts();
        RedisLocks {
            inner: Arc::new(Inner {
                acquire: Script::new(&scripts.acquire),
                release: Script::new(&scripts.release),
                extend: Script::new(&scripts.extend),
                servers,
                policy,
                clock,
                prefix: prefix.to_owned(),
            }),
        }
    }

    /// How many servers the locks span.
    pub fn servers(&self) -> usize {
        self.inner.servers.len()
    }

    /// The Redis key of the lock `key`: `{prefix}lock:{key}`.
    pub fn lock_key(&self, key: &str) -> String {
        format!("{}lock:{key}", self.inner.prefix)
    }

    fn fence_key(&self, key: &str) -> String {
        format!("{}fence:{key}", self.inner.prefix)
    }

    /// Runs `script` on every server in parallel, each bounded by the connection's
    /// response timeout.
    async fn everywhere(&self, script: &Script, keys: &[String], args: &[&str]) -> Vec<Reply> {
        let calls = self.inner.servers.iter().map(|server| {
            let mut invocation = script.prepare_invoke();
            for k in keys {
                invocation.key(k);
            }
            for a in args {
                invocation.arg(*a);
            }
            let mut conn = server.conn.clone();
            async move {
                // The connection's response timeout bounds each server's answer.
                match invocation.invoke_async::<u64>(&mut conn).await {
                    Ok(v) => Reply::Value(v),
                    Err(e) => {
                        tracing::debug!(server = %server.url, error = %e, "lock command failed");
                        Reply::Down
                    }
                }
            }
        });
        join_all(calls).await
    }

    /// One attempt: the lease, or `Ok(None)` when another owner holds the lock, or an
    /// [`ErrorKind::Quorum`] error when too few servers answered.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key or a zero TTL; [`ErrorKind::Quorum`].
    pub async fn try_acquire(&self, key: &str, options: LockOptions) -> Result<Option<Lease>> {
        let (ttl_ms, watchdog) = options.lease();
        self.inner.policy.lock_check_request(key, ttl_ms)?;
        self.attempt(key, ttl_ms, watchdog).await
    }

    /// Takes the lock of `key`, trying until `options.wait` runs out (50 ms doubling to
    /// 1 s between tries, as the guest schedules).
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] when another owner held it throughout; [`ErrorKind::Quorum`]
    /// when, at the end, too few servers answered; [`ErrorKind::InvalidArgument`] for a
    /// bad key or a zero TTL.
    pub async fn acquire(&self, key: &str, options: LockOptions) -> Result<Lease> {
        let (ttl_ms, watchdog) = options.lease();
        let policy = &self.inner.policy;
        policy.lock_check_request(key, ttl_ms)?;
        let deadline = self
            .inner
            .clock
            .now_ms()
            .saturating_add(duration_ms(options.wait));
        let mut attempt = 0;
        loop {
            let outcome = self.attempt(key, ttl_ms, watchdog).await;
            let last_error = match outcome {
                Ok(Some(lease)) => return Ok(lease),
                Ok(None) => Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "lock {key:?} is held by another owner (waited {:?})",
                        options.wait
                    ),
                ),
                Err(e) if e.kind() == ErrorKind::Quorum => e,
                Err(e) => return Err(e),
            };
            let now = self.inner.clock.now_ms();
            let Some(next) = policy.lock_next_try(attempt, now, deadline)? else {
                return Err(last_error);
            };
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(next.saturating_sub(now))).await;
        }
    }

    async fn attempt(&self, key: &str, ttl_ms: u64, watchdog: bool) -> Result<Option<Lease>> {
        let inner = &self.inner;
        let token = crate::lock_token();
        let keys = [self.lock_key(key), self.fence_key(key)];
        let ttl_arg = ttl_ms.to_string();
        let sent = inner.clock.now_ms();
        let replies = self.everywhere(&inner.acquire, &keys, &[&token, &ttl_arg]).await;
        let elapsed = inner.clock.now_ms().saturating_sub(sent);
        let counters: Vec<u64> = replies
            .iter()
            .filter_map(|r| {
                if let Reply::Value(v @ 1..) = r {
                    Some(*v)
                } else {
                    None
                }
            })
            .collect();
        let answered = replies.iter().filter(|r| matches!(r, Reply::Value(_))).count();
        let n = inner.servers.len() as u32;
        if let Some(validity) = inner
            .policy
            .lock_decide(counters.len() as u32, n, ttl_ms, elapsed)?
        {
            let fencing = inner.policy.lock_fencing_token(&counters)?;
            return Ok(Some(Lease::start(
                self.clone(),
                key,
                token,
                ttl_ms,
                fencing,
                sent + validity,
                watchdog,
            )));
        }
        // Not held: undo the partial acquisition everywhere, at once.
        if !counters.is_empty() {
            self.everywhere(&inner.release, &keys, &[&token, "0"]).await;
        }
        if !inner.policy.lock_has_quorum(answered as u32, n)? {
            return Err(Error::new(
                ErrorKind::Quorum,
                format!("only {answered} of {n} Redis servers answered; a lock needs a majority"),
            ));
        }
        Ok(None)
    }
}

/// A held lock. Release it with [`release`](Lease::release); dropped, it is released in
/// the background. Its [`lost`](Lease::lost) signal fires if the lock is lost.
pub struct Lease {
    shared: Arc<LeaseShared>,
    /// The watchdog, for a lease taken without a TTL.
    monitor: Option<JoinHandle<()>>,
    watchdog: bool,
    released: bool,
}

struct LeaseShared {
    locks: RedisLocks,
    key: String,
    token: String,
    ttl_ms: u64,
    fencing: u64,
    valid_until: AtomicU64,
    lost: watch::Sender<bool>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.shared.key)
            .field("fencing_token", &self.shared.fencing)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl Lease {
    fn start(
        locks: RedisLocks,
        key: &str,
        token: String,
        ttl_ms: u64,
        fencing: u64,
        valid_until: u64,
        watchdog: bool,
    ) -> Lease {
        let shared = Arc::new(LeaseShared {
            locks,
            key: key.to_owned(),
            token,
            ttl_ms,
            fencing,
            valid_until: AtomicU64::new(valid_until),
            lost: watch::channel(false).0,
        });
        // A lease with a TTL needs no task: its validity is a deadline, checked on demand.
        let monitor = watchdog.then(|| tokio::spawn(renew(shared.clone())));
        Lease {
            shared,
            monitor,
            watchdog,
            released: false,
        }
    }

    /// The fencing token: strictly increasing per lock key across holders. Pass it to
    /// the resource you guard, and have it refuse tokens older than one it has seen.
    pub fn fencing_token(&self) -> u64 {
        self.shared.fencing
    }

    /// The lock key.
    pub fn key(&self) -> &str {
        &self.shared.key
    }

    /// Whether the lock is known lost (or, for a lease with a TTL, its validity ran out).
    pub fn is_lost(&self) -> bool {
        *self.shared.lost.borrow() || (!self.watchdog && self.shared.validity_passed())
    }

    /// Completes when the lock is lost (never, while it is held).
    pub async fn lost(&self) {
        let mut rx = self.shared.lost.subscribe();
        loop {
            if *rx.borrow_and_update() {
                return;
            }
            if self.watchdog {
                let _ = rx.changed().await;
                continue;
            }
            if self.shared.validity_passed() {
                self.shared.lost.send_replace(true);
                return;
            }
            // Until the validity the guest gave (an extend may move it), or a change.
            let wait = self.shared.until_validity();
            tokio::select! {
                _ = rx.changed() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Resets the lock's TTL to `ttl` if this lease still holds it (on a majority).
    ///
    /// # Errors
    /// [`ErrorKind::LockLost`] if it does not (the lost signal then fires).
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        extend(&self.shared, duration_ms(ttl)).await
    }

    /// Releases the lock (owner-checked, on every server).
    ///
    /// # Errors
    /// [`ErrorKind::LockLost`] if this lease no longer held it: another owner's lock is
    /// left untouched.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        if let Some(m) = self.monitor.take() {
            m.abort();
        }
        release(&self.shared).await
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(m) = self.monitor.take() {
            m.abort();
        }
        if self.released {
            return;
        }
        let shared = self.shared.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = release(&shared).await {
                    tracing::debug!(key = %shared.key, error = %e, "background release of a dropped lease");
                }
            });
        }
    }
}

impl LeaseShared {
    fn validity_passed(&self) -> bool {
        self.locks.inner.clock.now_ms() >= self.valid_until.load(Ordering::SeqCst)
    }

    fn until_validity(&self) -> Duration {
        let now = self.locks.inner.clock.now_ms();
        Duration::from_millis(self.valid_until.load(Ordering::SeqCst).saturating_sub(now))
    }
}

async fn release(shared: &LeaseShared) -> Result<()> {
    let locks = &shared.locks;
    let keys = [locks.lock_key(&shared.key), locks.fence_key(&shared.key)];
    // One server needs no counter raise: its counter already carries the token.
    let fence = if locks.inner.servers.len() > 1 {
        shared.fencing.to_string()
    } else {
        "0".to_string()
    };
    let replies = locks
        .everywhere(&locks.inner.release, &keys, &[&shared.token, &fence])
        .await;
    let released = replies.iter().filter(|r| matches!(r, Reply::Value(1))).count() as u32;
    shared.lost.send_replace(true);
    let n = locks.inner.servers.len() as u32;
    if !locks.inner.policy.lock_has_quorum(released, n)? {
        return Err(Error::new(
            ErrorKind::LockLost,
            format!(
                "lock {:?} was not held by this lease (expired or taken over)",
                shared.key
            ),
        ));
    }
    Ok(())
}

async fn extend(shared: &LeaseShared, ttl_ms: u64) -> Result<()> {
    let locks = &shared.locks;
    let keys = [locks.lock_key(&shared.key)];
    let ttl_arg = ttl_ms.to_string();
    let sent = locks.inner.clock.now_ms();
    let replies = locks
        .everywhere(&locks.inner.extend, &keys, &[&shared.token, &ttl_arg])
        .await;
    let elapsed = locks.inner.clock.now_ms().saturating_sub(sent);
    let confirmed = replies.iter().filter(|r| matches!(r, Reply::Value(1))).count() as u32;
    let n = locks.inner.servers.len() as u32;
    match locks.inner.policy.lock_decide(confirmed, n, ttl_ms, elapsed)? {
        Some(validity) => {
            shared.valid_until.store(sent + validity, Ordering::SeqCst);
            Ok(())
        }
        None => {
            let answered = replies.iter().filter(|r| matches!(r, Reply::Value(_))).count() as u32;
            if locks.inner.policy.lock_has_quorum(answered, n)? {
                shared.lost.send_replace(true);
                return Err(Error::new(
                    ErrorKind::LockLost,
                    format!("lock {:?} is no longer held by this lease", shared.key),
                ));
            }
            Err(Error::new(
                ErrorKind::Quorum,
                format!("only {answered} of {n} Redis servers answered the extend"),
            ))
        }
    }
}

/// The watchdog of a lease taken without a TTL: renews it every TTL/3 while the holder
/// lives, and fires the lost signal when a renewal finds the lock gone or its validity
/// runs out unconfirmed.
async fn renew(shared: Arc<LeaseShared>) {
    let clock = shared.locks.inner.clock.clone();
    let policy = shared.locks.inner.policy.clone();
    let sleep_until = |at: u64| tokio::time::sleep(Duration::from_millis(at.saturating_sub(clock.now_ms())));
    let Ok(renew_after) = policy.lock_renew_after(shared.ttl_ms) else {
        shared.lost.send_replace(true);
        return;
    };
    let mut next = clock.now_ms() + renew_after;
    let mut attempt = 0;
    loop {
        sleep_until(next).await;
        let until = shared.valid_until.load(Ordering::SeqCst);
        let renewed = tokio::select! {
            r = extend(&shared, shared.ttl_ms) => r,
            () = sleep_until(until) => Err(Error::new(ErrorKind::Timeout, "renewal unanswered within validity")),
        };
        match renewed {
            Ok(()) => {
                attempt = 0;
                next = clock.now_ms() + renew_after;
            }
            Err(e) if e.kind() == ErrorKind::LockLost => {
                tracing::warn!(key = %shared.key, "watchdog: lock lost");
                return;
            }
            Err(e) => {
                // Unconfirmed: retry on the backoff schedule until the validity runs out.
                let now = clock.now_ms();
                match policy.lock_next_try(attempt, now, shared.valid_until.load(Ordering::SeqCst)) {
                    Ok(Some(at)) => {
                        attempt += 1;
                        next = at;
                    }
                    _ => {
                        tracing::warn!(key = %shared.key, error = %e, "watchdog: lock lost (validity ran out)");
                        shared.lost.send_replace(true);
                        return;
                    }
                }
            }
        }
    }
}
