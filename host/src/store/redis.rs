//! The Redis store, on one server or a Redis Cluster (through a `Link`): entries, the
//! flight lock, and (in `pubsub`) the landing channel.
//!
//! It stores under exactly the names it is given: the guest names every key's data
//! under the configured prefix (contract §2.4), so applications and tenants sharing one
//! Redis never meet, and every command names keys of one cluster slot. A read is one
//! `GET`, `GETEX`, or for an envelope that keeps a sliding moment one `EVALSHA` of the
//! guest's read-and-touch Lua (contract §3.5).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use redis::aio::ConnectionLike;

use super::Scripts;
use super::breaker::{Breaker, Breakers, Probed, Prober, is_connection_failure};
use super::link::{Connection, Healing, Link};
use super::pubsub::RedisNotifications;
pub use super::redis_options::{RedisOptions, redact};
use super::script::Script;
use super::{Entries, Fill, Filled, FlightLock};
use crate::gather::{Follower, Gather, distinct, keep_part, spread};
use crate::{Error, ErrorKind, Result};

/// The Redis store. Cheap to clone.
#[derive(Clone)]
pub struct RedisStore {
    /// The command connection; replaced after consecutive timeouts.
    healing: Healing,
    /// Fail calls fast while Redis keeps failing: on a cluster, one per master.
    breakers: Arc<Breakers>,
    options: RedisOptions,
    read_and_touch: Arc<Script>,
    delete_if_equal: Arc<Script>,
    lock_and_peek: Arc<Script>,
    fill_and_release: Arc<Script>,
    replace_if_equal: Arc<Script>,
    renew_fenced: Arc<Script>,
    delete_foreign: Arc<Script>,
    grace_ms: u64,
    commands: Arc<AtomicU64>,
    notifications: RedisNotifications,
    /// Entry reads gathered into one pipeline (on a cluster, one per slot).
    gather: Arc<Reads>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.options.prefix)
            .finish_non_exhaustive()
    }
}

/// What failed, for people: `redis GET failed`, and on a cluster the node it was sent
/// to (`redis GET failed on node 10.0.0.2:7001`), as the breaker that let it through
/// knows it.
fn failed(what: &str, at: &Breaker) -> String {
    match at.node() {
        Some(node) => format!("redis {what} failed on node {node}"),
        None => format!("redis {what} failed"),
    }
}

fn unavailable<'a>(what: &'static str, at: &'a Breaker) -> impl Fn(redis::RedisError) -> Error + 'a {
    move |e| Error::unavailable(failed(what, at), e)
}

/// How a command's result is noted by its store on the way out, and by the breaker
/// that let it through.
trait Seen: Sized {
    fn seen(self, store: &RedisStore, at: &Breaker) -> Self;
}

impl<T> Seen for redis::RedisResult<T> {
    fn seen(self, store: &RedisStore, at: &Breaker) -> Self {
        store.observe(at, self.as_ref().err());
        self
    }
}

/// What an `MGET` answered (as the connection gave it, server errors in it
/// included): each key's bytes, or nothing (as the store's answer per key). Bulk
/// strings are taken as they came (no copy); any other shape is converted as redis-rs
/// would; an error anywhere in it is the whole answer's.
fn mget_values(answer: redis::Value) -> redis::RedisResult<Vec<Result<Option<Bytes>>>> {
    let items = match answer {
        redis::Value::Array(items) => items,
        other => {
            let values: Vec<Option<Vec<u8>>> = redis::from_redis_value(other.extract_error()?)?;
            return Ok(values.into_iter().map(|v| Ok(v.map(Bytes::from))).collect());
        }
    };
    let mut values = Vec::with_capacity(items.len());
    for item in items {
        values.push(Ok(match item {
            redis::Value::BulkString(bytes) => Some(Bytes::from(bytes)),
            redis::Value::Nil => None,
            other => redis::from_redis_value::<Option<Vec<u8>>>(other.extract_error()?)?.map(Bytes::from),
        }));
    }
    Ok(values)
}

/// A read's failure: a value of another Redis type is corrupt data, not an outage.
fn read_failed<'a>(what: &'static str, at: &'a Breaker) -> impl Fn(redis::RedisError) -> Error + 'a {
    move |e| {
        if e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE") {
            Error::new(
                ErrorKind::Corrupt,
                "holds a value of another Redis type, not a Corral entry",
            )
            .with_source(e)
        } else {
            Error::unavailable(failed(what, at), e)
        }
    }
}

/// The answer of a gathered read its pipeline did not answer.
fn unanswered() -> Result<Option<Bytes>> {
    Err(Error::new(
        ErrorKind::Unavailable,
        "a pipelined read went unanswered",
    ))
}

/// Entry reads gathering: each asks with its key and what it reads.
type Reads = Gather<(String, Read), Result<Option<Bytes>>>;
type ReadFollower = Follower<(String, Read), Result<Option<Bytes>>>;

/// What an entry read asks of Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Read {
    /// The bytes (`GET`).
    Get,
    /// The bytes, setting the key's TTL to this many ms (`GETEX PX`).
    Expire(u64),
}

/// The command for one read.
fn read_command(key: &str, read: Read) -> redis::Cmd {
    match read {
        Read::Get => {
            let mut get = redis::Cmd::with_capacity(2, key.len() + 3);
            get.arg("GET").arg(key);
            get
        }
        Read::Expire(ttl_ms) => {
            let mut getex = redis::Cmd::with_capacity(4, key.len() + 28);
            getex.arg("GETEX").arg(key).arg("PX").arg(ttl_ms.max(1));
            getex
        }
    }
}

fn read_name(read: Read) -> &'static str {
    match read {
        Read::Get => "GET",
        Read::Expire(_) => "GETEX",
    }
}

/// How a breaker's background probe asks Redis: one `PING` to the server it guards (on a
/// cluster, to the master's address), within `timeout`. An answer of any kind (even an
/// error reply from the server) is the server up; a failure of the connection counts on the link as a
/// command's would (timeouts in a row replace it) and, on a cluster, has the masters
/// learnt again. An address the cluster no longer has as a master is `Gone`.
fn prober(healing: Healing, commands: Arc<AtomicU64>, timeout: std::time::Duration) -> Prober {
    Arc::new(move |node: Option<Arc<str>>| {
        let healing = healing.clone();
        let commands = commands.clone();
        async move {
            if let (Some(node), Some(masters)) = (&node, healing.masters())
                && !masters.contains(node)
            {
                return Probed::Gone;
            }
            commands.fetch_add(1, Ordering::Relaxed);
            let answer = tokio::time::timeout(timeout, ping(healing.current(), node.as_deref())).await;
            let (probed, timed_out) = match &answer {
                Ok(Ok(())) => (Probed::Up, false),
                // An error the server replied with (not one the client made up: on a
                // cluster, "no connection to that node" while it is being reconnected).
                Ok(Err(e)) if e.code().is_some() && !is_connection_failure(e) => (Probed::Up, false),
                Ok(Err(e)) => (Probed::Down, e.is_timeout()),
                Err(_) => (Probed::Down, true),
            };
            healing.observe(timed_out);
            if probed == Probed::Down {
                healing.relearn();
            }
            probed
        }
        .boxed()
    })
}

/// `PING` on `link`: to the cluster node at `node` (`host:port`) when it names one.
async fn ping(mut link: Link, node: Option<&str>) -> redis::RedisResult<()> {
    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    let address = node
        .and_then(|n| n.rsplit_once(':'))
        .and_then(|(host, port)| Some((host.to_owned(), port.parse::<u16>().ok()?)));
    match (&mut link, address) {
        (Link::Cluster(cluster), Some((host, port))) => cluster
            .route_command(
                redis::cmd("PING"),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port }),
            )
            .await
            .map(drop),
        _ => redis::cmd("PING").query_async::<()>(&mut link).await,
    }
}

/// Deletes `KEYS[1]` only if it holds something other than a string: 1 if it did.
const DELETE_FOREIGN: &str =
    "if redis.call('TYPE', KEYS[1]).ok ~= 'string' then return redis.call('DEL', KEYS[1]) end return 0";

impl RedisStore {
    /// The store over `connection` (connecting lazily), reached as `options` say, with the
    /// guest's scripts; landings go on `channel`.
    pub(crate) fn connect(
        connection: Connection,
        options: &RedisOptions,
        scripts: &Scripts,
        channel: String,
        invalidations: String,
        retry: super::Retry,
    ) -> Result<Self> {
        let commands = Arc::new(AtomicU64::new(0));
        let subscribers = connection.subscribers();
        // One command link for entries, the flight lock, announcements and the cache's
        // leases, so a replacement after timeouts heals them all.
        let healing = Healing::new(connection)?;
        let gather = Arc::default();
        let prober = prober(
            healing.clone(),
            commands.clone(),
            options.connect_timeout + options.response_timeout,
        );
        Ok(RedisStore {
            notifications: RedisNotifications::new(
                subscribers,
                healing.swap(),
                options,
                channel,
                invalidations,
                commands.clone(),
                retry,
            ),
            healing,
            breakers: Arc::new(Breakers::new(
                options.breaker_threshold,
                options.breaker_cool_down,
                prober,
            )),
            options: options.clone(),
            read_and_touch: Arc::new(Script::new(&scripts.read_and_touch)),
            delete_if_equal: Arc::new(Script::new(&scripts.delete_if_equal)),
            lock_and_peek: Arc::new(Script::new(&scripts.lock_and_peek)),
            fill_and_release: Arc::new(Script::new(&scripts.fill_and_release)),
            replace_if_equal: Arc::new(Script::new(&scripts.replace_if_equal)),
            renew_fenced: Arc::new(Script::new(&scripts.renew_fenced)),
            delete_foreign: Arc::new(Script::new(DELETE_FOREIGN)),
            grace_ms: scripts.grace_ms,
            commands,
            gather,
        })
    }

    /// The landing channel of this store's prefix.
    pub(crate) fn notifications(&self) -> &RedisNotifications {
        &self.notifications
    }

    /// How this store was reached.
    pub(crate) fn options(&self) -> &RedisOptions {
        &self.options
    }

    /// The store's command link, shared with the lock API of the same cache (no
    /// breaker: a lease's own deadlines bound its calls), replaced for both alike.
    pub(crate) fn link(&self) -> Healing {
        self.healing.clone()
    }

    /// Whether a breaker is open now, how often they opened, and how many calls they
    /// refused at once (on a cluster, one breaker per master: all together).
    pub fn breaker(&self) -> (bool, u64, u64) {
        let (opened, refused) = self.breakers.figures();
        let masters = self.healing.masters();
        (self.breakers.is_open(masters.as_deref()), opened, refused)
    }

    /// On a cluster, the masters (`host:port`) whose breakers are open now.
    pub fn open_breakers(&self) -> Vec<String> {
        self.breakers.open_nodes(self.healing.masters().as_deref())
    }

    /// Whether the store is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.healing.connection().is_cluster()
    }

    /// The command link for one command on `key`, and the breaker that let it through
    /// (on a cluster, that of the master serving `key`), unless that breaker refuses it.
    fn conn(&self, key: &str) -> Result<(Link, Arc<Breaker>)> {
        let at = self.breakers.of(self.healing.node_of(key));
        if let Err(e) = at.admit() {
            // A replica may have taken over meanwhile.
            self.healing.relearn();
            return Err(e);
        }
        Ok((self.healing.current(), at))
    }

    /// Reads `key` as `read` asks, with the reads that reach this store at the same
    /// moment ([`gather`](crate::gather)).
    async fn read(&self, key: &str, read: Read) -> Result<Option<Bytes>> {
        let together = async |mut followers: Vec<ReadFollower>| {
            if self.is_cluster() {
                // A cluster's pipeline goes to one node: the leader reads its own slot's
                // keys, and hands each other slot's to one of them to lead, so that no
                // read waits on another node's reply.
                let slot = |key: &str| super::owners::slot(key.as_bytes());
                let slots: Vec<u16> = followers.iter().map(|f| slot(&f.query.0)).collect();
                followers = keep_part(followers, slots, &slot(key));
            }
            let mut answers = self.read_together(key, read, &followers).await.into_iter();
            let mine = answers.next();
            for (follower, found) in followers.into_iter().zip(answers) {
                follower.answer(found);
            }
            mine
        };
        self.gather
            .run(
                || (key.to_owned(), read),
                self.options.response_timeout,
                || self.read_alone(key, read),
                together,
            )
            .await
    }

    /// One read, one command.
    async fn read_alone(&self, key: &str, read: Read) -> Result<Option<Bytes>> {
        let (mut conn, at) = self.conn(key)?;
        self.count(1);
        let found: Option<Vec<u8>> = read_command(key, read)
            .query_async(&mut conn)
            .await
            .seen(self, &at)
            .map_err(read_failed(read_name(read), &at))?;
        Ok(found.map(Bytes::from))
    }

    /// `key`'s read and the followers', in that order, in one pipeline, each with its own
    /// answer (a key of another Redis type fails its own read only). The same read asked
    /// for twice is sent once.
    async fn read_together(
        &self,
        key: &str,
        read: Read,
        followers: &[ReadFollower],
    ) -> Vec<Result<Option<Bytes>>> {
        let asked = followers.iter().map(|f| (f.query.0.as_str(), f.query.1));
        let (unique, at_unique) = distinct(std::iter::once((key, read)).chain(asked));
        spread(self.pipeline_reads(&unique).await, &at_unique)
            .into_iter()
            .map(|answer| answer.unwrap_or_else(unanswered))
            .collect()
    }

    /// `reads` (of keys in one slot, on a cluster) in one pipeline, each with its own
    /// answer, in order. A pipeline that fails whole fails each read, and counts once on
    /// the breaker of its node: one request that failed.
    async fn pipeline_reads(&self, reads: &[(&str, Read)]) -> Vec<Result<Option<Bytes>>> {
        let Some(&(first, _)) = reads.first() else {
            return Vec::new();
        };
        let (mut conn, at) = match self.conn(first) {
            Ok(admitted) => admitted,
            Err(e) => return vec![Err(e); reads.len()],
        };
        self.count(reads.len() as u64);
        let mut pipe = redis::Pipeline::with_capacity(reads.len());
        pipe.ignore_errors();
        for &(key, read) in reads {
            pipe.add_command(read_command(key, read));
        }
        let answers: Vec<redis::RedisResult<Option<Vec<u8>>>> =
            match pipe.query_async(&mut conn).await.seen(self, &at) {
                Ok(answers) => answers,
                Err(e) => {
                    return vec![Err(Error::unavailable(failed("pipeline of reads", &at), e)); reads.len()];
                }
            };
        if answers.len() != reads.len() {
            let e = Error::new(
                ErrorKind::Unavailable,
                format!(
                    "redis answered {} of a pipeline's {} reads",
                    answers.len(),
                    reads.len()
                ),
            );
            return vec![Err(e); reads.len()];
        }
        answers
            .into_iter()
            .zip(reads)
            .map(|(found, &(_, read))| {
                // A server error of one read (LOADING, MASTERDOWN, ...) counts on the
                // breaker as it would alone.
                if let Err(e) = &found {
                    self.observe(&at, Some(e));
                }
                found
                    .map(|bytes| bytes.map(Bytes::from))
                    .map_err(read_failed(read_name(read), &at))
            })
            .collect()
    }

    /// Notes how a command ended (`failure`, if it failed) on the link and on `at`.
    fn observe(&self, at: &Breaker, failure: Option<&redis::RedisError>) {
        self.healing.observe(failure.is_some_and(|e| e.is_timeout()));
        let failed = failure.is_some_and(is_connection_failure);
        at.record(failed);
        if failed {
            // A master may have died, or a replica taken over (a redirect counts too).
            self.healing.relearn();
        }
    }

    fn count(&self, n: u64) {
        self.commands.fetch_add(n, Ordering::Relaxed);
    }

    /// Commands sent to Redis so far by this store (a script counts as one).
    pub fn commands_sent(&self) -> u64 {
        self.commands.load(Ordering::Relaxed)
    }

    /// A connection to the same Redis, for callers that need raw access (tests, tools).
    #[cfg(any(test, feature = "test-util"))]
    pub fn connection(&self) -> Link {
        self.healing.current()
    }
}

impl Entries for RedisStore {
    fn read_and_touch<'a>(
        &'a self,
        key: &'a str,
        now_ms: u64,
    ) -> Option<BoxFuture<'a, Result<Option<Bytes>>>> {
        Some(
            async move {
                let (mut conn, at) = self.conn(key)?;
                self.count(1);
                let found: Option<Vec<u8>> = self
                    .read_and_touch
                    .key(key)
                    .arg(now_ms)
                    .arg(self.grace_ms)
                    .invoke_async(&mut conn)
                    .await
                    .seen(self, &at)
                    .map_err(read_failed("read-and-touch", &at))?;
                Ok(found.map(Bytes::from))
            }
            .boxed(),
        )
    }

    fn get_and_expire<'a>(
        &'a self,
        key: &'a str,
        ttl_ms: u64,
    ) -> Option<BoxFuture<'a, Result<Option<Bytes>>>> {
        Some(self.read(key, Read::Expire(ttl_ms)).boxed())
    }

    fn ttl_ms<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<u64>>> {
        async move {
            let (mut conn, at) = self.conn(key)?;
            self.count(1);
            // -2: missing; -1: no expiry.
            let left: i64 = redis::cmd("PTTL")
                .arg(key)
                .query_async(&mut conn)
                .await
                .seen(self, &at)
                .map_err(unavailable("PTTL", &at))?;
            Ok(u64::try_from(left).ok())
        }
        .boxed()
    }

    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>> {
        self.read(key, Read::Get).boxed()
    }

    fn gathers(&self) -> bool {
        true
    }

    fn in_parts(&self) -> bool {
        self.is_cluster()
    }

    fn part_of(&self, key: &str) -> Option<Arc<str>> {
        self.healing.node_of(key)
    }

    fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Bytes>>>> {
        async move {
            // One MGET per node, all at once (a cluster's client splits each per slot);
            // a node that fails fails its own keys only.
            let mut groups: Vec<(Option<Arc<str>>, Vec<usize>)> = Vec::new();
            if self.is_cluster() {
                for (i, key) in keys.iter().enumerate() {
                    let node = self.healing.node_of(key);
                    match groups.iter_mut().find(|(n, _)| *n == node) {
                        Some((_, members)) => members.push(i),
                        None => groups.push((node, vec![i])),
                    }
                }
            } else if !keys.is_empty() {
                // One server: one group.
                groups.push((None, (0..keys.len()).collect()));
            }
            let reads = groups.iter().map(|(_, members)| async move {
                let (mut conn, at) = self.conn(keys[members[0]])?;
                self.count(1);
                let size = members.iter().map(|&i| keys[i].len()).sum::<usize>();
                let mut mget = redis::Cmd::with_capacity(members.len() + 1, size + 4);
                mget.arg("MGET");
                for &i in members {
                    mget.arg(keys[i]);
                }
                // The answer as it came: `mget_values` finds any error in it.
                let found = conn
                    .req_packed_command(&mget)
                    .await
                    .and_then(mget_values)
                    .seen(self, &at)
                    .map_err(read_failed("MGET", &at))?;
                if found.len() != members.len() {
                    return Err(Error::new(
                        ErrorKind::Unavailable,
                        format!("redis MGET of {} keys answered {}", members.len(), found.len()),
                    ));
                }
                Ok::<_, Error>(found)
            });
            let answers = match <[_; 1]>::try_from(futures::future::join_all(reads).await) {
                // One node (one server, or keys of one node): its answer is each key's, in order.
                Ok([Ok(values)]) => return values,
                Ok([Err(e)]) => return keys.iter().map(|_| Err(e.clone())).collect(),
                Err(answers) => answers,
            };
            let mut found: Vec<Result<Option<Bytes>>> = keys.iter().map(|_| Ok(None)).collect();
            for ((_, members), answer) in groups.iter().zip(answers) {
                match answer {
                    Ok(values) => {
                        for (&i, bytes) in members.iter().zip(values) {
                            found[i] = bytes;
                        }
                    }
                    Err(e) => {
                        for &i in members {
                            found[i] = Err(e.clone());
                        }
                    }
                }
            }
            found
        }
        .boxed()
    }

    fn swap<'a>(&'a self, name: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<Option<Bytes>>> {
        async move {
            let (mut conn, at) = self.conn(name)?;
            self.count(1);
            let set = |conn: &mut Link| {
                let mut conn = conn.clone();
                let bytes = bytes.clone();
                async move {
                    redis::cmd("SET")
                        .arg(name)
                        .arg(bytes.as_ref())
                        .arg("PX")
                        .arg(ttl_ms.max(1))
                        .arg("GET")
                        .query_async::<Option<Vec<u8>>>(&mut conn)
                        .await
                }
            };
            match set(&mut conn)
                .await
                .seen(self, &at)
                .map_err(read_failed("SET GET", &at))
            {
                Ok(old) => Ok(old.map(Bytes::from)),
                // A value of another type: it goes, and the write goes through.
                Err(e) if e.kind() == ErrorKind::Corrupt => {
                    self.delete_foreign(name).await?;
                    set(&mut conn)
                        .await
                        .seen(self, &at)
                        .map_err(unavailable("SET GET", &at))?;
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        }
        .boxed()
    }

    fn set_if<'a>(
        &'a self,
        name: &'a str,
        expected: Option<Bytes>,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>> {
        async move {
            let Some(expected) = expected else {
                let (mut conn, at) = self.conn(name)?;
                self.count(1);
                let written: Option<String> = redis::cmd("SET")
                    .arg(name)
                    .arg(bytes.as_ref())
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms.max(1))
                    .query_async(&mut conn)
                    .await
                    .seen(self, &at)
                    .map_err(unavailable("SET NX", &at))?;
                return Ok(written.is_some());
            };
            self.replace_if_equal(name, expected, bytes, ttl_ms).await
        }
        .boxed()
    }

    fn delete_foreign<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool>> {
        async move {
            let (mut conn, at) = self.conn(name)?;
            self.count(1);
            let n: u64 = self
                .delete_foreign
                .key(name)
                .invoke_async(&mut conn)
                .await
                .seen(self, &at)
                .map_err(unavailable("delete-foreign", &at))?;
            Ok(n > 0)
        }
        .boxed()
    }

    fn set<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<()>> {
        async move {
            let (mut conn, at) = self.conn(key)?;
            self.count(1);
            redis::cmd("SET")
                .arg(key)
                .arg(bytes.as_ref())
                .arg("PX")
                .arg(ttl_ms.max(1))
                .query_async::<()>(&mut conn)
                .await
                .seen(self, &at)
                .map_err(unavailable("SET", &at))
        }
        .boxed()
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        async move {
            let (mut conn, at) = self.conn(key)?;
            self.count(1);
            let n: u64 = redis::cmd("DEL")
                .arg(key)
                .query_async(&mut conn)
                .await
                .seen(self, &at)
                .map_err(unavailable("DEL", &at))?;
            Ok(n > 0)
        }
        .boxed()
    }

    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, Result<bool>> {
        async move {
            let (mut conn, at) = self.conn(key)?;
            self.count(1);
            let n: u64 = self
                .delete_if_equal
                .key(key)
                .arg(expected.as_ref())
                .invoke_async(&mut conn)
                .await
                .seen(self, &at)
                .map_err(unavailable("delete-if-equal", &at))?;
            Ok(n > 0)
        }
        .boxed()
    }

    fn replace_if_equal<'a>(
        &'a self,
        key: &'a str,
        expected: Bytes,
        bytes: Bytes,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<bool>> {
        async move {
            let (mut conn, at) = self.conn(key)?;
            self.count(1);
            let n: u64 = self
                .replace_if_equal
                .key(key)
                .arg(expected.as_ref())
                .arg(bytes.as_ref())
                .arg(ttl_ms.max(1))
                .invoke_async(&mut conn)
                .await
                .seen(self, &at)
                .map_err(unavailable("replace-if-equal", &at))?;
            Ok(n > 0)
        }
        .boxed()
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}

impl FlightLock for RedisStore {
    fn try_lock<'a>(&'a self, key: &'a str, owner: &'a str, ttl_ms: u64) -> BoxFuture<'a, Result<bool>> {
        async move {
            let (mut conn, at) = self.conn(key)?;
            self.count(1);
            let ok: Option<String> = redis::cmd("SET")
                .arg(key)
                .arg(owner)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms.max(1))
                .query_async(&mut conn)
                .await
                .seen(self, &at)
                .map_err(unavailable("SET NX", &at))?;
            Ok(ok.is_some())
        }
        .boxed()
    }

    fn release<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.release_with(key, owner, None).boxed()
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
        entry: &'a str,
        over: Option<Option<Bytes>>,
    ) -> Option<BoxFuture<'a, Result<bool>>> {
        Some(
            async move {
                let (mut conn, at) = self.conn(key)?;
                self.count(1);
                let (mode, expected) = fence(&over);
                let renewed: u64 = self
                    .renew_fenced
                    .key(key)
                    .key(entry)
                    .arg(owner)
                    .arg(ttl_ms.max(1))
                    .arg(mode)
                    .arg(expected)
                    .invoke_async(&mut conn)
                    .await
                    .seen(self, &at)
                    .map_err(unavailable("lock renewal", &at))?;
                Ok(renewed == 1)
            }
            .boxed(),
        )
    }

    fn try_lock_peeking<'a>(
        &'a self,
        key: &'a str,
        owner: &'a str,
        ttl_ms: u64,
        entry: &'a str,
    ) -> Option<BoxFuture<'a, Result<Option<bool>>>> {
        Some(
            async move {
                let (mut conn, at) = self.conn(key)?;
                self.count(1);
                let taken: u64 = self
                    .lock_and_peek
                    .key(key)
                    .key(entry)
                    .arg(owner)
                    .arg(ttl_ms.max(1))
                    .invoke_async(&mut conn)
                    .await
                    .seen(self, &at)
                    .map_err(unavailable("lock-and-peek", &at))?;
                Ok((taken > 0).then_some(taken > 1))
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
        Some(self.release_with(key, owner, Some((channel, message))).boxed())
    }

    fn fill_releasing<'a>(
        &'a self,
        fill: Fill<'a>,
        key: &'a str,
        owner: &'a str,
        announce: Option<(&'a str, &'a str)>,
    ) -> Option<BoxFuture<'a, Result<Filled>>> {
        Some(
            async move {
                let (mut conn, at) = self.conn(key)?;
                self.count(1);
                let (fence, expected) = fence(&fill.over);
                let mut call = self.fill_and_release.key(fill.name);
                call.key(key)
                    .arg(owner)
                    .arg(fence)
                    .arg(expected)
                    .arg(fill.bytes.as_ref())
                    .arg(fill.ttl_ms.max(1));
                if let Some((channel, message)) = announce {
                    call.arg(channel).arg(message);
                }
                let n: u64 = call
                    .invoke_async(&mut conn)
                    .await
                    .seen(self, &at)
                    .map_err(unavailable("fill-and-release", &at))?;
                Ok(Filled {
                    written: n & 1 != 0,
                    announced: n & 2 != 0,
                    held: n & 4 != 0,
                })
            }
            .boxed(),
        )
    }
}

/// How a leader's fill and its lock's renewals are fenced, as `FILL_AND_RELEASE` and
/// `RENEW_FENCED` take it: `nx` (the entry must hold nothing), `eq` (exactly these
/// bytes) or `set` (anything: no read found what the key held).
fn fence(over: &Option<Option<Bytes>>) -> (&'static str, &[u8]) {
    match over {
        Some(None) => ("nx", &[]),
        Some(Some(bytes)) => ("eq", bytes.as_ref()),
        None => ("set", &[]),
    }
}

impl RedisStore {
    /// The flight lock's owner-checked release (`DELETE_IF_EQUAL`), publishing
    /// `announce` (a channel and a message) in the same script when given: whether it
    /// released, or with `announce`, whether it published.
    async fn release_with(&self, key: &str, owner: &str, announce: Option<(&str, &str)>) -> Result<bool> {
        let (mut conn, at) = self.conn(key)?;
        self.count(1);
        let mut call = self.delete_if_equal.key(key);
        call.arg(owner);
        if let Some((channel, message)) = announce {
            call.arg(channel).arg(message);
        }
        let n: u64 = call
            .invoke_async(&mut conn)
            .await
            .seen(self, &at)
            .map_err(unavailable("lock release", &at))?;
        Ok(match announce {
            Some(_) => n & 2 != 0,
            None => n & 1 != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_the_secret_and_keeps_the_rest() {
        assert_eq!(
            redact("redis://u:hunter2@127.0.0.1:6379/0"),
            "redis://u:***@127.0.0.1:6379/0"
        );
        assert_eq!(redact("rediss://:hunter2@host"), "rediss://:***@host");
        assert_eq!(redact("redis://hunter2@host"), "redis://***@host");
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(
            redact("redis+unix:///run/redis.sock?db=1&pass=hunter2"),
            "redis+unix:///run/redis.sock?db=1&pass=***"
        );
        let options = RedisOptions::new("redis://u:hunter2@127.0.0.1:1");
        assert!(!format!("{options:?}").contains("hunter2"));
    }
}
