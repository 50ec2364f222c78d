//! Leases on one Redis, or on several independent ones (Redlock).
//!
//! Acquire: `SET NX PX` with a random 128-bit owner token and `INCR` of the key's
//! fencing counter (first raised to the server's clock in microseconds), in one script
//! per server, on all servers in parallel. The lease is held only with a majority
//! within its validity (TTL minus elapsed minus drift, counted from the last reply), as
//! the guest decides; otherwise it is released everywhere at once. The token is chosen
//! before anything is sent, so an acquire whose reply never came, or whose caller gave
//! up mid-flight, is released afterwards, owner-checked. Release and extend are
//! owner-checked scripts. A lease taken without a TTL has a watchdog that renews it
//! every TTL/3 while the holder lives; when a renewal finds the lock lost (or its
//! validity runs out unconfirmed), the lease's lost signal fires.
//!
//! Lease timing (validity, the retry and renewal schedules, the lost signal) runs on
//! Tokio's monotonic [`Instant`], never on the wall clock: a step of the system clock
//! neither loses a held lease nor keeps a lapsed one.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{Either, join_all};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::clock::{Clock, SystemClock};
use crate::guest::Policy;
use crate::guest::policy::defaults;
use crate::locks::{LeaseServer, LockScript};
use crate::options::duration_ms;
use crate::owed::Owed;
use crate::store::Notifications;
use crate::store::link::{Connection, Healing};
use crate::store::pubsub::RedisNotifications;
use crate::store::redis::{RedisOptions, redact};
use crate::store::script::Script;
use crate::{Error, ErrorKind, Result};

/// How a lease is taken.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct LockOptions {
    ttl: Option<Duration>,
    wait: Duration,
    watchdog_ttl: Duration,
    fair: bool,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: None,
            wait: Duration::from_secs(5),
            watchdog_ttl: Duration::from_secs(30),
            fair: false,
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

    /// First come, first served across every process: waiters for the key queue in
    /// Redis in the order they started waiting (by their machines' clocks), and only the
    /// head of the queue may take the lock when it is free (a fair
    /// [`RedisLocks::try_acquire`], or a wait of zero, takes it only when no one is
    /// queued). A waiter keeps its place while it keeps trying; one that stops trying
    /// without leaving (its process died) is dropped from the queue 5 s after its last
    /// try (contract §6.3). Every acquirer of a key must be fair for the order to hold:
    /// an unfair one takes a free lock whoever waits. Default: off.
    pub fn fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }
}

/// One server of a lock (one Redis, or one Redis Cluster): its URL (for logs) and its
/// command link.
pub(crate) struct Server {
    url: String,
    conn: Conn,
}

/// How a server is reached.
enum Conn {
    /// A Redis (or a Redis Cluster): it runs the scripts as Lua, over a link replaced
    /// after timeouts in a row (a cache's leases share the cache's, contract §5.13).
    Redis(Healing),
    /// A server that is not a Redis ([`RedisLocks::over`]).
    Custom(Arc<dyn LeaseServer>),
}

impl Server {
    /// Connects (lazily) the one way Corral connects to Redis.
    pub(crate) fn open(options: &RedisOptions) -> Result<Self> {
        let link = Healing::new(Connection::open(options)?)?;
        Ok(Server::shared(options, link))
    }

    /// A server reached through an existing link (a cache's): replaced for both alike.
    pub(crate) fn shared(options: &RedisOptions, conn: Healing) -> Self {
        Server {
            // Only ever shown to people (logs, errors, Debug): never with its password.
            url: redact(&options.url),
            conn: Conn::Redis(conn),
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
    prefix: String,
    acquire: Script,
    acquire_fair: Script,
    release: Script,
    extend: Script,
    /// The origin of the millisecond timeline the guest's schedules are computed on:
    /// monotonic.
    origin: Instant,
    /// Where releases are announced and waiters wake (the landing channel of the
    /// prefix); `None` for Redlock and custom servers, whose waiters poll.
    landings: Option<Arc<dyn Notifications>>,
    /// Releases and queue departures running in the background, until they end
    /// ([`close`](RedisLocks::close) waits for them).
    owed: Owed,
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
    /// The server failed or did not answer in time: why, whether the command may have
    /// run there all the same (anything but a refused connection), and on a cluster the
    /// node that failed (`host:port`, the master serving the key as last learnt).
    Down {
        cause: String,
        maybe_ran: bool,
        node: Option<Arc<str>>,
    },
    /// The script refused before changing anything (`CORRAL_FOREIGN`: another Redis type
    /// or a foreign value under the lock's names; `CORRAL_FENCE_EXHAUSTED`: a fencing
    /// counter that can rise no further): what it said.
    Refused {
        said: String,
        /// Whether it was the fencing counter that can rise no further.
        exhausted: bool,
    },
}

impl Reply {
    fn value(&self) -> Option<u64> {
        match self {
            Reply::Value(v) => Some(*v),
            Reply::Down { .. } | Reply::Refused { .. } => None,
        }
    }

    /// The reply of a failed command (on the cluster node `node`): Corral's own refusals
    /// are told from outages.
    fn failed(e: &redis::RedisError, node: Option<Arc<str>>) -> Reply {
        match e.code() {
            Some(code @ ("CORRAL_FOREIGN" | "CORRAL_FENCE_EXHAUSTED")) => Reply::Refused {
                said: e.detail().map_or_else(|| code.to_owned(), str::to_owned),
                exhausted: code == "CORRAL_FENCE_EXHAUSTED",
            },
            _ => Reply::Down {
                cause: e.to_string(),
                maybe_ran: !never_sent(e),
                node,
            },
        }
    }
}

/// Whether `e` says the command never ran: the connection was refused, or could not be
/// set up (login or database switch refused, a client setting the server does not
/// take), or the server refused the command before running it (`NOAUTH`: a login
/// first; `NOPERM`: the ACL user may not send it; a command a script calls without
/// the right fails the script with another error). A command that may have run (a
/// lost reply, a timeout, an error a script raised after it changed something) owes a
/// release; one of these owes nothing.
fn never_sent(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig | ErrorKind::RESP3NotSupported
        )
        // A refusal of the command itself; one raised inside a script would name it.
        || (e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) && !e.to_string().contains("script"))
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
        || (e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
            && e.to_string().contains("refused to switch database"))
}

/// The error of a lock `what` that a server refused (see [`Reply::Refused`]), if any
/// (only a refusal for an exhausted fencing counter when `exhausted`):
/// [`ErrorKind::Corrupt`], since what is stored under the lock's names cannot serve it.
fn refused(key: &str, what: &str, replies: &[Reply], exhausted: bool) -> Option<Error> {
    replies.iter().find_map(|r| match r {
        Reply::Refused {
            said,
            exhausted: full,
        } if *full || !exhausted => Some(Error::new(
            ErrorKind::Corrupt,
            format!("lock {key:?} cannot be {what}: {said}"),
        )),
        _ => None,
    })
}

/// Whole milliseconds of `d`.
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl RedisLocks {
    /// Locks on the Redis servers at `urls` (one: a plain lease; several: Redlock),
    /// keys under the prefix `corral:`. Connections are lazy.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for no URL or a bad one.
    pub fn connect<S: AsRef<str>>(urls: &[S]) -> Result<Self> {
        Self::connect_with(urls, crate::options::DEFAULT_PREFIX, SystemClock)
    }

    /// As [`connect`](Self::connect), with a key prefix and the cache's wall clock.
    ///
    /// Lease timing never reads `clock`: validity, the retry and renewal schedules and
    /// the lost signal run on Tokio's monotonic clock (which a paused test runtime
    /// controls), so a step of the wall clock changes nothing about a lease.
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub fn connect_with<S: AsRef<str>>(urls: &[S], prefix: &str, clock: impl Clock) -> Result<Self> {
        let _ = clock;
        if urls.is_empty() {
            return Err(Error::invalid_argument(
                "redis url",
                "must be given at least once",
            ));
        }
        let servers: Vec<RedisOptions> = urls
            .iter()
            .map(|url| RedisOptions {
                prefix: prefix.to_owned(),
                ..RedisOptions::new(url.as_ref())
            })
            .collect();
        Self::from_options(&servers)
    }

    /// Locks on one Redis Cluster reached through its seed nodes: a single-server lease
    /// per key, on the master of the key's slot (the lock and its fencing counter share
    /// the slot). What a failover does to a held lease: see docs/redis.md.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for no node or a bad URL.
    pub fn connect_cluster<S: AsRef<str>>(nodes: &[S], prefix: &str) -> Result<Self> {
        if nodes.is_empty() {
            return Err(Error::invalid_argument(
                "redis cluster node",
                "must be given at least once",
            ));
        }
        let options = RedisOptions {
            prefix: prefix.to_owned(),
            ..RedisOptions::cluster(nodes.iter().map(|n| n.as_ref().to_owned()))
        };
        Self::from_options(&[options])
    }

    /// Locks on the servers `servers` describe, each with its own timeouts: one (a
    /// server, or a cluster through its seed nodes) for a plain lease, several
    /// independent servers for Redlock. Keys go under their prefix, the same on every
    /// server. Connections are lazy. [`connect`](Self::connect) with the defaults of
    /// [`RedisOptions::new`].
    ///
    /// ```no_run
    /// # fn demo() -> corral::Result<()> {
    /// use std::time::Duration;
    /// use corral::RedisOptions;
    /// use corral::locks::RedisLocks;
    ///
    /// // A server across an ocean: its handshake alone takes a long round trip.
    /// let mut far = RedisOptions::new("redis://far.example:6379");
    /// far.connect_timeout = Duration::from_secs(3);
    /// far.response_timeout = Duration::from_secs(3);
    /// let locks = RedisLocks::from_options(&[far])?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for no server, a bad URL, a cluster among several
    /// servers, one server named twice, or prefixes that differ.
    pub fn from_options(servers: &[RedisOptions]) -> Result<Self> {
        let [first, rest @ ..] = servers else {
            return Err(Error::invalid_argument(
                "redis options",
                "must name at least one server",
            ));
        };
        let prefix = first.prefix.as_str();
        if rest.iter().any(|s| s.prefix != prefix) {
            return Err(Error::invalid_argument(
                "redis options prefix",
                "must be the same on every server of a Redlock",
            ));
        }
        let policy = Policy::load(defaults()?.limits)?;
        if rest.is_empty() {
            return Self::single(first, prefix, policy);
        }
        if servers.iter().any(|s| !s.cluster_nodes.is_empty()) {
            return Err(Error::invalid_argument(
                "redis options cluster_nodes",
                "a Redlock runs on independent servers, not on a cluster",
            ));
        }
        // One server named twice would hold two votes of the majority (and a lock it
        // holds would read as held by another owner at its second vote).
        let mut seen = std::collections::HashSet::new();
        for server in servers {
            let at = crate::store::link::destination(&server.url)?;
            if !seen.insert(at.clone()) {
                return Err(Error::invalid_argument(
                    "redis url",
                    format!("names the server {at} twice: a Redlock needs independent servers"),
                ));
            }
        }
        let servers = servers.iter().map(Server::open).collect::<Result<Vec<_>>>()?;
        Ok(Self::from_parts(policy, Arc::new(SystemClock), servers, prefix))
    }

    /// Leases on servers that are not Redis (a simulated store, another database), one
    /// [`LeaseServer`] each (several: Redlock), keys under `prefix`: the same protocol,
    /// decisions and timing as on Redis.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for no server; [`ErrorKind::Guest`] if the guest
    /// cannot be loaded.
    pub fn over(servers: Vec<Arc<dyn LeaseServer>>, prefix: &str) -> Result<Self> {
        if servers.is_empty() {
            return Err(Error::invalid_argument(
                "lease server",
                "must be given at least once",
            ));
        }
        let policy = Policy::load(defaults()?.limits)?;
        let servers = servers
            .into_iter()
            .map(|server| Server {
                url: format!("{server:?}"),
                conn: Conn::Custom(server),
            })
            .collect();
        Ok(Self::from_parts(policy, Arc::new(SystemClock), servers, prefix))
    }

    /// Locks sharing a cache's guest handle and Redis connection
    /// ([`Corral::locks`](crate::Corral::locks)). The wall clock is not used: lease
    /// timing is monotonic.
    pub(crate) fn from_parts(
        policy: Policy,
        _wall_clock: Arc<dyn Clock>,
        servers: Vec<Server>,
        prefix: &str,
    ) -> Self {
        let scripts = policy.lock_scripts();
        RedisLocks {
            inner: Arc::new(Inner {
                acquire: Script::new(&scripts.acquire),
                acquire_fair: Script::new(&scripts.acquire_fair),
                release: Script::new(&scripts.release),
                extend: Script::new(&scripts.extend),
                servers,
                policy,
                prefix: prefix.to_owned(),
                origin: Instant::now(),
                landings: None,
                owed: Owed::default(),
            }),
        }
    }

    /// These locks, announcing each release on `landings` and waking their waiters on
    /// it (the timer of the backoff stays as the fallback).
    pub(crate) fn woken_by(mut self, landings: Arc<dyn Notifications>) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.landings = Some(landings);
        }
        self
    }

    /// These locks, counting their background work in `owed` (a cache's, so that its
    /// [`close`](crate::Corral::close) waits for both at once).
    pub(crate) fn owing_to(mut self, owed: &Owed) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.owed = owed.clone();
        }
        self
    }

    /// One server's lease (`options`, prefix `prefix`) whose waiters wake on releases:
    /// a subscription of its own to the prefix's landing channel.
    fn single(options: &RedisOptions, prefix: &str, policy: Policy) -> Result<Self> {
        let connection = Connection::open(options)?;
        let subscribers = connection.subscribers();
        // One command link for leases and their announcements, healed for both.
        let link = Healing::new(connection)?;
        let channel = policy.channel(prefix)?;
        let landings = RedisNotifications::new(
            subscribers,
            link.swap(),
            options,
            channel,
            policy.invalidation_channel(prefix)?,
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
            crate::guest::policy::retry(&defaults()?),
        );
        let server = Server::shared(options, link);
        Ok(
            Self::from_parts(policy, Arc::new(SystemClock), vec![server], prefix)
                .woken_by(Arc::new(landings)),
        )
    }

    /// `at` on the guest's millisecond timeline (monotonic, from this handle's origin).
    fn mono_ms(&self, at: Instant) -> u64 {
        ms(at.saturating_duration_since(self.inner.origin))
    }

    /// The instant `at_ms` on the guest's millisecond timeline names.
    fn instant(&self, at_ms: u64) -> Instant {
        self.inner.origin + Duration::from_millis(at_ms)
    }

    /// How many servers the locks span.
    pub fn servers(&self) -> usize {
        self.inner.servers.len()
    }

    /// The Redis key of the lock `key` (contract §2.4: `{<n>:<prefix><key>}:k`).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key.
    pub fn lock_key(&self, key: &str) -> Result<String> {
        Ok(self.names(key)?.0[0].clone())
    }

    /// The lock's, its fencing counter's and its waiting mark's names, and its queue's
    /// (fair leases): one hash slot, so every script that touches them is single-slot
    /// on a Redis Cluster.
    fn names(&self, key: &str) -> Result<(LockKeys, String)> {
        let n = self.inner.policy.locate(&self.inner.prefix, key, 0)?;
        Ok(([n.lock, n.fence, n.waiting], n.queue))
    }

    /// Runs `script` on every server in parallel, each bounded by the connection's
    /// response timeout.
    async fn everywhere(&self, script: &Script, keys: &[String], args: &[&str]) -> Vec<Reply> {
        let all: Vec<usize> = (0..self.inner.servers.len()).collect();
        self.on(&all, script, keys, args).await
    }

    /// Runs `script` on the servers `which` (indices) in parallel; the replies in order.
    async fn on(&self, which: &[usize], script: &Script, keys: &[String], args: &[&str]) -> Vec<Reply> {
        let mut calls = which.iter().map(|&i| {
            let server = &self.inner.servers[i];
            let (mut conn, healing) = match &server.conn {
                Conn::Redis(healing) => (healing.current(), healing),
                Conn::Custom(custom) => {
                    return Either::Right(self.custom(server, custom, script, keys, args));
                }
            };
            let mut invocation = script.prepare_invoke();
            for k in keys {
                invocation.key(k);
            }
            for a in args {
                invocation.arg(*a);
            }
            Either::Left(async move {
                // The connection's response timeout bounds each server's answer.
                let reply = invocation.invoke_async::<u64>(&mut conn).await;
                // Timeouts in a row replace a half-open connection, as the cache's.
                healing.observe(matches!(&reply, Err(e) if e.is_timeout()));
                match reply {
                    Ok(v) => Reply::Value(v),
                    Err(e) => {
                        // On a cluster: the master of the key's slot, the node that failed.
                        let node = keys.first().and_then(|k| healing.node_of(k));
                        healing.relearn();
                        tracing::debug!(server = %server.url, node = node.as_deref(), error = %e, "lock command failed");
                        Reply::failed(&e, node)
                    }
                }
            })
        });
        // One server (the common case): awaited directly, with no fan-out machinery.
        if which.len() == 1
            && let Some(call) = calls.next()
        {
            return vec![call.await];
        }
        join_all(calls).await
    }

    /// Runs `script` on a server that is not a Redis ([`LeaseServer`]).
    async fn custom<'a>(
        &'a self,
        server: &'a Server,
        custom: &'a Arc<dyn LeaseServer>,
        script: &'a Script,
        keys: &'a [String],
        args: &'a [&'a str],
    ) -> Reply {
        let inner = &self.inner;
        let which = if std::ptr::eq(script, &inner.acquire) {
            LockScript::Acquire
        } else if std::ptr::eq(script, &inner.acquire_fair) {
            LockScript::AcquireFair
        } else if std::ptr::eq(script, &inner.release) {
            LockScript::Release
        } else {
            LockScript::Extend
        };
        match custom.run(which, keys, args).await {
            Ok(v) => Reply::Value(v),
            Err(e) => {
                tracing::debug!(server = %server.url, error = %e.cause, "lock command failed");
                Reply::Down {
                    cause: e.cause,
                    maybe_ran: e.maybe_ran,
                    node: None,
                }
            }
        }
    }

    /// The error of a lock `what` too few servers answered: [`ErrorKind::Unavailable`]
    /// with the cause on a single server, [`ErrorKind::Quorum`] under Redlock.
    fn unanswered(&self, what: &str, replies: &[Reply]) -> Error {
        let servers = &self.inner.servers;
        let down: Vec<String> = servers
            .iter()
            .zip(replies)
            .filter_map(|(server, reply)| match reply {
                Reply::Down { cause, node, .. } => Some(match node {
                    Some(node) => format!("redis://{node}: {cause}"),
                    None => format!("{}: {cause}", server.url),
                }),
                Reply::Refused { said, .. } => Some(format!("{}: {said}", server.url)),
                Reply::Value(_) => None,
            })
            .collect();
        if servers.len() == 1 {
            return Error::new(
                ErrorKind::Unavailable,
                format!("Redis failed the lock {what} ({})", down.join("; ")),
            );
        }
        let answered = replies.iter().filter(|r| r.value().is_some()).count();
        Error::new(
            ErrorKind::Quorum,
            format!(
                "only {answered} of {} Redis servers answered the lock {what}; a lock needs a majority ({})",
                servers.len(),
                down.join("; ")
            ),
        )
    }

    /// Releases `token` on the servers `which`, owner-checked (raising their counters
    /// to `fence`, "0": not at all), in the background: for an acquire or a release
    /// whose outcome is unknown there. Each server is tried (on the guest's retry
    /// schedule) until it answers or `until` passes, counted until then (see
    /// [`close`](Self::close)). Without a current Tokio runtime nothing runs: the lock
    /// then lapses by its TTL.
    fn release_in_background(
        &self,
        which: Vec<usize>,
        keys: LockKeys,
        token: String,
        fence: String,
        until: Instant,
    ) {
        let locks = self.clone();
        let announcement = self.announcement(&keys[0]);
        let name = keys[0].clone();
        let spawned = self.inner.owed.spawn(async move {
            let args = release_args(&token, &fence, &announcement);
            let mut pending = which;
            let mut attempt = 0;
            loop {
                let replies = locks.on(&pending, &locks.inner.release, &keys, &args).await;
                pending = pending
                    .into_iter()
                    .zip(replies)
                    .filter_map(|(i, r)| r.value().is_none().then_some(i))
                    .collect();
                if pending.is_empty() {
                    return;
                }
                let now = Instant::now();
                let next = locks
                    .inner
                    .policy
                    .lock_next_try(attempt, locks.mono_ms(now), locks.mono_ms(until));
                let Ok(Some(at)) = next else {
                    tracing::warn!(key = %keys[0], servers = pending.len(), "a lock could not be released on every server: its TTL ends it there");
                    return;
                };
                attempt += 1;
                tokio::time::sleep_until(locks.instant(at)).await;
            }
        });
        if spawned.is_none() {
            tracing::debug!(key = %name, "no runtime: a lock of unknown state is left to its TTL");
        }
    }

    /// Lets what these locks do in the background end, for at most `within`: releases
    /// of dropped leases and of attempts whose outcome is unknown (a lost reply, an
    /// acquire its caller gave up on), and fair waiters leaving their queue. A process
    /// about to exit calls it last: a task still running when the process exits never
    /// ends, and a lock it owed a release stays held, by nobody, until its TTL. Clones
    /// share what they wait for, and a cache's leases ([`Locks::redis`](crate::locks::Locks::redis))
    /// share it with the cache ([`Corral::close`](crate::Corral::close)); leases still
    /// held are their holders' (release them first).
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] when something was still under way at `within`, saying
    /// how much.
    pub async fn close(&self, within: Duration) -> Result<()> {
        crate::owed::closed("the locks", self.inner.owed.settle(within).await, within)
    }

    /// A lease request checked: its Redis TTL in ms, and whether a watchdog renews it.
    /// A watchdog lease's TTL is named `watchdog`, as [`LockOptions::watchdog`] sets it.
    fn checked(&self, key: &str, options: &LockOptions) -> Result<(u64, bool)> {
        let (ttl_ms, watchdog) = options.lease();
        match self.inner.policy.lock_check_request(key, ttl_ms) {
            Err(e) if watchdog && e.argument() == Some("ttl") => Err(e.naming("watchdog")),
            checked => checked.map(|()| (ttl_ms, watchdog)),
        }
    }

    /// One attempt: the lease, or `Ok(None)` when another owner holds the lock.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad key or a zero TTL;
    /// [`ErrorKind::Unavailable`] when the one server did not answer (the cause is in
    /// the message); [`ErrorKind::Quorum`] when under a majority of several answered.
    pub async fn try_acquire(&self, key: &str, options: LockOptions) -> Result<Option<Lease>> {
        let (ttl_ms, watchdog) = self.checked(key, &options)?;
        let queue = options.fair.then_some(Queue::Try);
        self.attempt(key, ttl_ms, watchdog, (queue, false)).await
    }

    /// Takes the lock of `key`, trying until `options.wait` runs out (50 ms doubling to
    /// 1 s between tries, as the guest schedules, on the monotonic clock).
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] when another owner held it throughout; at the end,
    /// [`ErrorKind::Unavailable`] when the one server did not answer, or
    /// [`ErrorKind::Quorum`] when too few of several did; [`ErrorKind::InvalidArgument`]
    /// for a bad key or a zero TTL.
    pub async fn acquire(&self, key: &str, options: LockOptions) -> Result<Lease> {
        let (ttl_ms, watchdog) = self.checked(key, &options)?;
        let policy = &self.inner.policy;
        let deadline = self
            .mono_ms(Instant::now())
            .saturating_add(duration_ms(options.wait));
        // A fair acquire's place in the queue, under one id for all its tries (a fair
        // acquire that waits not at all is one lone try: it never queues).
        let place = match options.fair && !options.wait.is_zero() {
            true => Some(Place {
                locks: self,
                key,
                waiter: policy.lock_fair_waiter(started_waiting_us(), &crate::lock_token())?,
                done: false,
            }),
            false => None,
        };
        let queue = match &place {
            Some(place) => Some(Queue::Wait(&place.waiter)),
            None => options.fair.then_some(Queue::Try),
        };
        let mut attempt = 0;
        let lock_name = match &self.inner.landings {
            Some(_) => Some(self.names(key)?.0[0].clone()),
            None => None,
        };
        let last_error = loop {
            // Registered before the try, so a release between the try and the wait
            // is not missed.
            let mut landing = match (&self.inner.landings, &lock_name) {
                (Some(landings), Some(name)) => Some(landings.watch(name).await),
                _ => None,
            };
            // A try that waits for the announcement asks the holder's release for one.
            let waits = landing.is_some() && !options.wait.is_zero();
            let last_error = match self.attempt(key, ttl_ms, watchdog, (queue, waits)).await {
                Ok(Some(lease)) => {
                    // The winning try left the queue.
                    if let Some(place) = place {
                        place.taken(self.inner.servers.len());
                    }
                    return Ok(lease);
                }
                Ok(None) => Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "lock {key:?} is held by another owner (waited {:?})",
                        options.wait
                    ),
                ),
                Err(e) if matches!(e.kind(), ErrorKind::Quorum | ErrorKind::Unavailable) => e,
                Err(e) => break e,
            };
            let now = self.mono_ms(Instant::now());
            let Some(next) = policy.lock_next_try(attempt, now, deadline)? else {
                break last_error;
            };
            attempt += 1;
            // Woken by the holder's release, or by the backoff's timer if the release's
            // announcement never comes.
            match &mut landing {
                Some(landing) => tokio::select! {
                    biased;
                    () = landing.landed() => {}
                    () = tokio::time::sleep_until(self.instant(next)) => {}
                },
                None => tokio::time::sleep_until(self.instant(next)).await,
            }
        };
        if let Some(place) = place {
            place.leave().await;
        }
        Err(last_error)
    }

    /// Gives `waiter`'s place in the queue of `key` up, on every server (a failure is
    /// only logged: a place not given up lapses, contract §6).
    async fn leave(&self, key: &str, waiter: &str) {
        let Ok(([lock, fence, waiting], queue)) = self.names(key) else {
            return;
        };
        let keys = [lock, fence, queue, waiting];
        let replies = self
            .everywhere(&self.inner.acquire_fair, &keys, &["", "0", waiter, "leave"])
            .await;
        if let Some(Reply::Down { cause, .. }) = replies.iter().find(|r| r.value().is_none()) {
            tracing::debug!(key, cause = %cause, "a fair waiter's place could not be given up: it lapses");
        }
    }

    /// The channel and message announcing a release of `lock`, where the landing
    /// channel is Redis's: `LOCK_RELEASE` publishes them when a waiter marked the lock,
    /// whichever path releases (a lease's release, an undone partial acquire, a
    /// background retry).
    fn announcement(&self, lock: &str) -> Option<(String, String)> {
        self.inner.landings.as_ref()?.announcement(lock)
    }

    /// How long a release of an unsettled acquire keeps trying (asked only when needed:
    /// the uncontended path makes no guest call for it).
    fn orphan_window(&self, ttl_ms: u64) -> Duration {
        let ms = self.inner.policy.lock_orphan_window_ms(ttl_ms).unwrap_or(ttl_ms);
        Duration::from_millis(ms)
    }

    /// One acquire on every server for `token`: `LOCK_ACQUIRE`, or through the fair
    /// queue (`queue_name`) when `queue` says how. A try by a waiter that hears
    /// releases (`waits`) marks the lock waited for when it finds it held, so that the
    /// holder's release announces itself; an uncontended release announces nothing.
    async fn acquire_round(
        &self,
        keys: &LockKeys,
        queue_name: String,
        token: &str,
        ttl_ms: u64,
        (queue, waits): (Option<Queue<'_>>, bool),
    ) -> Vec<Reply> {
        let inner = &self.inner;
        let ttl_arg = ttl_ms.to_string();
        let [lock, fence, waiting] = keys;
        let Some(queue) = queue else {
            let args = [token, &ttl_arg, "wait"];
            let args = if waits { &args[..] } else { &args[..2] };
            return self.everywhere(&inner.acquire, keys, args).await;
        };
        let (waiter, how) = match queue {
            Queue::Wait(waiter) => (waiter, "wait"),
            Queue::Try => (token, "try"),
        };
        let keys = [lock.clone(), fence.clone(), queue_name, waiting.clone()];
        let keys = if waits { &keys[..] } else { &keys[..3] };
        let args = [token, ttl_arg.as_str(), waiter, how];
        self.everywhere(&inner.acquire_fair, keys, &args).await
    }

    /// One try at the lock of `key`: through the fair queue when `queue` says how; by a
    /// waiter that will wait for the release's announcement when `waits`.
    async fn attempt(
        &self,
        key: &str,
        ttl_ms: u64,
        watchdog: bool,
        how: (Option<Queue<'_>>, bool),
    ) -> Result<Option<Lease>> {
        let inner = &self.inner;
        // The token exists before anything is sent: whatever becomes of the replies, or
        // of this future, the attempt can be released, owner-checked.
        let token = crate::lock_token();
        let (keys, queue_name) = self.names(key)?;
        let sent = Instant::now();
        let unsettled = Unsettled {
            locks: self,
            keys: &keys,
            token: &token,
            sent,
            ttl_ms,
            settled: false,
        };
        let replies = self.acquire_round(&keys, queue_name, &token, ttl_ms, how).await;
        let received = Instant::now();
        let elapsed = ms(received - sent);
        let counters: Vec<u64> = replies
            .iter()
            .filter_map(|r| r.value().filter(|v| *v > 0))
            .collect();
        let n = inner.servers.len() as u32;
        // A counter that can rise no further refuses the whole acquire, majority or not:
        // under Redlock the others' counters may lag behind the largest token it gave
        // out, and a lock taken without it would hand out a smaller one. (Another type
        // under a minority's names is that server's failure: the majority decides.)
        if let Some(e) = refused(key, "acquired", &replies, true) {
            self.undo(&replies, &keys, &token, sent, ttl_ms).await;
            unsettled.settle();
            return Err(e);
        }
        if let Some(validity) = inner
            .policy
            .lock_decide(counters.len() as u32, n, ttl_ms, elapsed)?
        {
            let fencing = inner.policy.lock_fencing_token(&counters)?;
            unsettled.settle();
            // The validity has the round's time taken off already: it runs from now.
            let valid_until = received + Duration::from_millis(validity);
            return Ok(Some(Lease::start(
                self.clone(),
                key,
                keys.clone(),
                ttl_ms,
                Grant {
                    token,
                    fencing,
                    valid_until,
                    may_hold: replies
                        .iter()
                        .map(|r| {
                            r.value().is_some_and(|v| v > 0)
                                || matches!(r, Reply::Down { maybe_ran: true, .. })
                        })
                        .collect(),
                },
                watchdog,
            )));
        }
        self.undo(&replies, &keys, &token, sent, ttl_ms).await;
        unsettled.settle();
        if let Some(e) = refused(key, "acquired", &replies, false) {
            return Err(e);
        }
        let answered = replies.iter().filter(|r| r.value().is_some()).count() as u32;
        if !inner.policy.lock_has_quorum(answered, n)? {
            return Err(self.unanswered("acquire", &replies));
        }
        Ok(None)
    }
}

impl RedisLocks {
    /// Undoes a try that did not take the lock: releases `token` at once where the
    /// replies say it was set, and in the background until `until` where they leave it
    /// unknown (no reply, yet the command may have reached the server), for the orphan
    /// window of a try `sent` then with `ttl_ms`.
    async fn undo(&self, replies: &[Reply], keys: &LockKeys, token: &str, sent: Instant, ttl_ms: u64) {
        let set: Vec<usize> = (0..replies.len())
            .filter(|&i| replies[i].value().is_some_and(|v| v > 0))
            .collect();
        let mut unknown: Vec<usize> = (0..replies.len())
            .filter(|&i| matches!(replies[i], Reply::Down { maybe_ran: true, .. }))
            .collect();
        if !set.is_empty() {
            let announcement = self.announcement(&keys[0]);
            let args = release_args(token, "0", &announcement);
            let undone = self.on(&set, &self.inner.release, keys, &args).await;
            unknown.extend(
                set.iter()
                    .zip(&undone)
                    .filter_map(|(&i, r)| r.value().is_none().then_some(i)),
            );
        }
        if !unknown.is_empty() {
            let until = sent + self.orphan_window(ttl_ms);
            self.release_in_background(unknown, keys.clone(), token.to_owned(), "0".into(), until);
        }
    }
}

/// The moment a fair acquire starts waiting, in µs on the system's wall clock (a fair
/// queue orders its waiters by it across processes and servers: real time, whatever
/// clock the cache runs on), strictly later than the one before in this process.
fn started_waiting_us() -> u64 {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let before = LAST
        .fetch_update(
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
            |last| Some(now.max(last.saturating_add(1))),
        )
        .unwrap_or(now);
    now.max(before.saturating_add(1))
}

/// `LOCK_RELEASE`'s arguments: the owner `token`, the `fence` counters are first raised
/// to ("0": not at all), and the `announcement`'s channel and message, if any.
fn release_args<'a>(
    token: &'a str,
    fence: &'a str,
    announcement: &'a Option<(String, String)>,
) -> Vec<&'a str> {
    let mut args = vec![token, fence];
    if let Some((channel, message)) = announcement {
        args.extend([channel.as_str(), message.as_str()]);
    }
    args
}

/// A user lock's names a lease's scripts take as `KEYS`: the lock, its fencing counter,
/// its waiting mark.
type LockKeys = [String; 3];

/// How a try goes through a fair lock's queue (`LOCK_ACQUIRE_FAIR`).
#[derive(Clone, Copy)]
enum Queue<'a> {
    /// An acquire's try as the waiter it names: queued (or kept in its place) unless
    /// it takes the lock.
    Wait(&'a str),
    /// A lone try: it takes the lock only if no one is queued, and never queues.
    Try,
}

/// A fair acquire's place in its lock's queue. The try that takes the lock leaves the
/// queue in the same step ([`Place::taken`]); an acquire that gives up leaves it
/// ([`Place::leave`]); one whose future is dropped leaves it in the background.
struct Place<'a> {
    locks: &'a RedisLocks,
    key: &'a str,
    waiter: String,
    done: bool,
}

impl Place<'_> {
    /// The lock was taken: the winning try left the queue where it took the lock. Under
    /// Redlock a server that answered 0 (or not at all) may keep the waiter queued, at
    /// the head, holding up the next winner there: it leaves them all, in the
    /// background.
    fn taken(mut self, servers: usize) {
        self.done = servers < 2;
    }

    async fn leave(mut self) {
        self.done = true;
        self.locks.leave(self.key, &self.waiter).await;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let (locks, key, waiter) = (
            self.locks.clone(),
            self.key.to_owned(),
            std::mem::take(&mut self.waiter),
        );
        let owed = locks.inner.owed.clone();
        owed.spawn(async move { locks.leave(&key, &waiter).await });
    }
}

/// An acquire in flight: dropped before [`settle`](Unsettled::settle) (the caller gave
/// up, or a step failed), it releases the attempt's token on every server in the
/// background, owner-checked, until the orphan window ends.
struct Unsettled<'a> {
    locks: &'a RedisLocks,
    keys: &'a LockKeys,
    token: &'a str,
    sent: Instant,
    ttl_ms: u64,
    settled: bool,
}

impl Unsettled<'_> {
    fn settle(mut self) {
        self.settled = true;
    }
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        if !self.settled {
            let all = (0..self.locks.inner.servers.len()).collect();
            self.locks.release_in_background(
                all,
                self.keys.clone(),
                self.token.to_owned(),
                "0".into(),
                self.sent + self.locks.orphan_window(self.ttl_ms),
            );
        }
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
    /// The lock's, its fencing counter's and its waiting mark's names.
    keys: LockKeys,
    token: String,
    ttl_ms: u64,
    fencing: u64,
    /// Until when the lease is valid (monotonic): the last confirmation's validity.
    valid_until: Mutex<Instant>,
    /// By server: whether it may hold the lock (the acquire set it there, or its reply
    /// was lost).
    may_hold: Vec<bool>,
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

/// What a won acquire grants: the owner token, the fencing token, and until when the
/// lease is valid.
struct Grant {
    token: String,
    fencing: u64,
    valid_until: Instant,
    /// By server: whether it may hold the lock (it said so, or its reply was lost).
    may_hold: Vec<bool>,
}

impl Lease {
    fn start(
        locks: RedisLocks,
        key: &str,
        keys: LockKeys,
        ttl_ms: u64,
        grant: Grant,
        watchdog: bool,
    ) -> Lease {
        let shared = Arc::new(LeaseShared {
            locks,
            key: key.to_owned(),
            keys,
            token: grant.token,
            ttl_ms,
            fencing: grant.fencing,
            valid_until: Mutex::new(grant.valid_until),
            may_hold: grant.may_hold,
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

    /// How much longer the lease is valid by its last confirmation (the acquire, an
    /// [`extend`](Lease::extend) or a watchdog renewal): TTL minus the confirming
    /// round's time minus the drift allowance, counted from that round's last reply on
    /// the monotonic clock. Zero once lost.
    pub fn valid_for(&self) -> Duration {
        if *self.shared.lost.borrow() {
            return Duration::ZERO;
        }
        self.shared.until_validity()
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
                biased;
                _ = rx.changed() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Resets the lock's TTL to `ttl` if this lease still holds it (on a majority);
    /// the validity then runs from this round's last reply.
    ///
    /// # Errors
    /// [`ErrorKind::LockLost`] if it does not (the lost signal then fires);
    /// [`ErrorKind::Unavailable`] (one server) or [`ErrorKind::Quorum`] (Redlock) when
    /// too few servers answered.
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        extend(&self.shared, duration_ms(ttl)).await
    }

    /// Releases the lock (owner-checked, on every server).
    ///
    /// # Errors
    /// [`ErrorKind::LockLost`] if this lease no longer held it: another owner's lock is
    /// left untouched. [`ErrorKind::Unavailable`] (one server) or [`ErrorKind::Quorum`]
    /// (Redlock) when too few servers answered: the lock then lapses by its TTL.
    pub async fn release(mut self) -> Result<()> {
        if let Some(m) = self.monitor.take() {
            m.abort();
        }
        // Marked released only once the release ran: a caller that drops this future
        // midway leaves the lease to `Drop`, which releases it in the background.
        let out = release(&self.shared).await;
        self.released = true;
        out
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
        let owed = shared.locks.inner.owed.clone();
        owed.spawn(async move {
            if let Err(e) = release(&shared).await {
                tracing::debug!(key = %shared.key, error = %e, "background release of a dropped lease");
            }
        });
    }
}

impl LeaseShared {
    fn valid_until(&self) -> Instant {
        *self.valid_until.lock()
    }

    fn validity_passed(&self) -> bool {
        Instant::now() >= self.valid_until()
    }

    fn until_validity(&self) -> Duration {
        self.valid_until().saturating_duration_since(Instant::now())
    }
}

async fn release(shared: &LeaseShared) -> Result<()> {
    let locks = &shared.locks;
    let keys = shared.keys.clone();
    // One server needs no counter raise: its counter already carries the token.
    let fence = if locks.inner.servers.len() > 1 {
        shared.fencing.to_string()
    } else {
        "0".to_string()
    };
    // The release announces itself (waiters wake at once) where the landing channel
    // is Redis's: in the script, so nothing is owed once the release has returned.
    let landings = locks.inner.landings.as_ref();
    let announcement = locks.announcement(&keys[0]);
    let args = release_args(&shared.token, &fence, &announcement);
    let replies = locks.everywhere(&locks.inner.release, &keys, &args).await;
    let released = replies.iter().filter(|r| matches!(r, Reply::Value(1))).count() as u32;
    let answered = replies.iter().filter(|r| r.value().is_some()).count() as u32;
    shared.lost.send_replace(true);
    let n = locks.inner.servers.len() as u32;
    let policy = &locks.inner.policy;
    // A server that did not answer may still hold the lock (or run a pending acquire or
    // extend of it), and one that may hold it still does if the release never reached
    // it: it is released there in the background, until the lock would have lapsed.
    let unknown: Vec<usize> = (0..replies.len())
        .filter(|&i| match replies[i] {
            Reply::Down { maybe_ran, .. } => maybe_ran || shared.may_hold[i],
            _ => false,
        })
        .collect();
    if !unknown.is_empty() {
        let window = Duration::from_millis(policy.lock_orphan_window_ms(shared.ttl_ms)?);
        locks.release_in_background(
            unknown,
            keys.clone(),
            shared.token.clone(),
            fence.clone(),
            Instant::now() + window,
        );
    }
    if policy.lock_has_quorum(released, n)? {
        // Another channel: announced before returning (a task spawned for it could die
        // with a process that exits right after its release).
        if let (Some(landings), None) = (landings, &announcement)
            && let Err(e) = landings.announce(&keys[0]).await
        {
            tracing::debug!(key = %keys[0], error = %e, "a release could not be announced: waiters poll");
        }
        return Ok(());
    }
    if let Some(e) = refused(&shared.key, "released", &replies, false) {
        return Err(e);
    }
    if !policy.lock_has_quorum(answered, n)? {
        return Err(locks.unanswered("release", &replies));
    }
    Err(Error::new(
        ErrorKind::LockLost,
        format!(
            "lock {:?} was not held by this lease (expired or taken over)",
            shared.key
        ),
    ))
}

async fn extend(shared: &LeaseShared, ttl_ms: u64) -> Result<()> {
    let locks = &shared.locks;
    let keys = [shared.keys[0].clone()];
    let ttl_arg = ttl_ms.to_string();
    let sent = Instant::now();
    let replies = locks
        .everywhere(&locks.inner.extend, &keys, &[&shared.token, &ttl_arg])
        .await;
    let received = Instant::now();
    let elapsed = ms(received - sent);
    let confirmed = replies.iter().filter(|r| matches!(r, Reply::Value(1))).count() as u32;
    let n = locks.inner.servers.len() as u32;
    match locks.inner.policy.lock_decide(confirmed, n, ttl_ms, elapsed)? {
        Some(validity) => {
            // The round's time is already taken off: the validity runs from now.
            *shared.valid_until.lock() = received + Duration::from_millis(validity);
            Ok(())
        }
        None => {
            // A server that refused (another type now under the lock's name) answered:
            // the lock is gone there.
            let answered = replies
                .iter()
                .filter(|r| !matches!(r, Reply::Down { .. }))
                .count() as u32;
            if locks.inner.policy.lock_has_quorum(answered, n)? {
                shared.lost.send_replace(true);
                let found = refused(&shared.key, "extended", &replies, false)
                    .map_or_else(String::new, |e| format!(" ({e})"));
                return Err(Error::new(
                    ErrorKind::LockLost,
                    format!("lock {:?} is no longer held by this lease{found}", shared.key),
                ));
            }
            Err(locks.unanswered("extend", &replies))
        }
    }
}

/// The watchdog of a lease taken without a TTL: renews it every TTL/3 while the holder
/// lives, and fires the lost signal when a renewal finds the lock gone or its validity
/// runs out unconfirmed.
async fn renew(shared: Arc<LeaseShared>) {
    let locks = shared.locks.clone();
    let policy = locks.inner.policy.clone();
    let Ok(renew_after) = policy.lock_renew_after(shared.ttl_ms) else {
        shared.lost.send_replace(true);
        return;
    };
    let renew_after = Duration::from_millis(renew_after);
    let mut next = Instant::now() + renew_after;
    let mut attempt = 0;
    loop {
        tokio::time::sleep_until(next).await;
        let until = shared.valid_until();
        // Biased (no random draw): a reply and the validity's end at one moment, the reply.
        let renewed = tokio::select! {
            biased;
            r = extend(&shared, shared.ttl_ms) => r,
            () = tokio::time::sleep_until(until) => Err(Error::new(ErrorKind::Timeout, "renewal unanswered within validity")),
        };
        match renewed {
            Ok(()) => {
                attempt = 0;
                next = Instant::now() + renew_after;
            }
            Err(e) if e.kind() == ErrorKind::LockLost => {
                tracing::warn!(key = %shared.key, "watchdog: lock lost");
                return;
            }
            Err(e) => {
                // Unconfirmed: retry on the backoff schedule until the validity runs out.
                let now = locks.mono_ms(Instant::now());
                let until = locks.mono_ms(shared.valid_until());
                match policy.lock_next_try(attempt, now, until) {
                    Ok(Some(at)) => {
                        attempt += 1;
                        next = locks.instant(at);
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
