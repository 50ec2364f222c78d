//! The Redis store, through the `redis` crate's `ConnectionManager` (reconnects by
//! itself): entries, the flight lock, and (in [`super::pubsub`]) the landing channel.
//!
//! Every key is stored under the configured prefix, so applications and tenants sharing
//! one Redis never see each other's entries or locks: entries live at `{prefix}e:{key}`,
//! flight locks at `{prefix}l:{key}` (see docs/contract.md, "Key scheme"). A read is one
//! `GET`, or for an entry known to slide one `EVALSHA` of the guest's read-and-touch Lua.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;
use redis::{IntoConnectionInfo, Script};

use super::pubsub::RedisNotifications;
use super::{Entries, FlightLock};
use crate::guest::policy::Scripts;
use crate::{Error, Result};

/// How to reach Redis.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RedisOptions {
    /// `redis://host:port/db`.
    pub url: String,
    /// Every key is stored as `prefix` + key.
    pub prefix: String,
    /// How long one connection attempt may take.
    pub connect_timeout: Duration,
    /// How long one command may take.
    pub response_timeout: Duration,
}

impl RedisOptions {
    /// Options for `url` with the default prefix `corral:` and timeouts.
    pub fn new(url: impl Into<String>) -> Self {
        RedisOptions {
            url: url.into(),
            prefix: "corral:".into(),
            connect_timeout: Duration::from_millis(500),
            response_timeout: Duration::from_secs(1),
        }
    }
}

/// A connection to one Redis, set up the one way Corral sets up every connection:
/// `TCP_NODELAY`, the options' connect and response timeouts, one retry.
#[derive(Clone)]
pub(crate) struct Connection {
    pub(crate) client: redis::Client,
    pub(crate) manager: ConnectionManager,
}

impl Connection {
    /// Connects lazily: an unreachable server is reported by the first command, and the
    /// manager keeps reconnecting.
    pub(crate) fn open(url: &str, connect_timeout: Duration, response_timeout: Duration) -> Result<Self> {
        let info = url
            .into_connection_info()
            .map_err(|e| Error::invalid_argument("redis url", format!("is not a Redis URL: {e}")))?
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        crate::require_runtime("connecting to Redis")?;
        let client = redis::Client::open(info).map_err(unavailable("client"))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout))
            .set_number_of_retries(1);
        let manager = client
            .get_connection_manager_lazy(config)
            .map_err(unavailable("connect"))?;
        Ok(Connection { client, manager })
    }
}

/// The Redis store. Cheap to clone.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    options: RedisOptions,
    prefix: Arc<str>,
    read_and_touch: Arc<Script>,
    delete_if_equal: Arc<Script>,
    replace_if_equal: Arc<Script>,
    grace_ms: u64,
    commands: Arc<AtomicU64>,
    notifications: RedisNotifications,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unavailable(what: &'static str) -> impl Fn(redis::RedisError) -> Error {
    move |e| Error::unavailable(format!("redis {what} failed"), e)
}

impl RedisStore {
    /// Connects to Redis (lazily) with the guest's scripts.
    pub(crate) fn connect(options: &RedisOptions, scripts: &Scripts) -> Result<Self> {
        let conn = Connection::open(&options.url, options.connect_timeout, options.response_timeout)?;
        let commands = Arc::new(AtomicU64::new(0));
        let channel = format!("{}landed", options.prefix);
        Ok(RedisStore {
            notifications: RedisNotifications::new(conn.clone(), channel, commands.clone()),
            conn: conn.manager,
            options: options.clone(),
            prefix: options.prefix.as_str().into(),
            read_and_touch: Arc::new(Script::new(&scripts.read_and_touch)),
            delete_if_equal: Arc::new(Script::new(&scripts.delete_if_equal)),
            replace_if_equal: Arc::new(Script::new(&scripts.replace_if_equal)),
            grace_ms: scripts.grace_ms,
            commands,
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

    /// The store's connection, for the lock API of the same cache.
    pub(crate) fn manager(&self) -> ConnectionManager {
        self.conn.clone()
    }

    fn namespaced(&self, space: &str, key: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + space.len() + key.len());
        k.push_str(&self.prefix);
        k.push_str(space);
        k.push_str(key);
        k
    }

    /// The Redis key an entry is stored under: `{prefix}e:{key}`.
    pub fn entry_key(&self, key: &str) -> String {
        self.namespaced("e:", key)
    }

    /// The Redis key of an entry's get-or-set lock: `{prefix}l:{key}`.
    pub fn lock_key(&self, key: &str) -> String {
        self.namespaced("l:", key)
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
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// The prefix every key is stored under.
    pub fn prefix(&self) -> &str {
        &self.prefix
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
                self.count(1);
                let mut conn = self.conn.clone();
                let found: Option<Vec<u8>> = self
                    .read_and_touch
                    .key(self.entry_key(key))
                    .arg(now_ms)
                    .arg(self.grace_ms)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(unavailable("read-and-touch"))?;
                Ok(found.map(Bytes::from))
            }
            .boxed(),
        )
    }

    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>> {
        async move {
            self.count(1);
            let mut conn = self.conn.clone();
            let found: Option<Vec<u8>> = redis::cmd("GET")
                .arg(self.entry_key(key))
                .query_async(&mut conn)
                .await
                .map_err(unavailable("GET"))?;
            Ok(found.map(Bytes::from))
        }
        .boxed()
    }

    fn set<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<()>> {
        async move {
            self.count(1);
            let mut conn = self.conn.clone();
            redis::cmd("SET")
                .arg(self.entry_key(key))
                .arg(bytes.as_ref())
                .arg("PX")
                .arg(ttl_ms.max(1))
                .query_async::<()>(&mut conn)
                .await
                .map_err(unavailable("SET"))
        }
        .boxed()
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        async move {
            self.count(1);
            let mut conn = self.conn.clone();
            let n: u64 = redis::cmd("DEL")
                .arg(self.entry_key(key))
                .query_async(&mut conn)
                .await
                .map_err(unavailable("DEL"))?;
            Ok(n > 0)
        }
        .boxed()
    }

    fn delete_if_equal<'a>(&'a self, key: &'a str, expected: Bytes) -> BoxFuture<'a, Result<bool>> {
        async move {
            self.count(1);
            let mut conn = self.conn.clone();
            let n: u64 = self
                .delete_if_equal
                .key(self.entry_key(key))
                .arg(expected.as_ref())
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable("delete-if-equal"))?;
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
            self.count(1);
            let mut conn = self.conn.clone();
            let n: u64 = self
                .replace_if_equal
                .key(self.entry_key(key))
                .arg(expected.as_ref())
                .arg(bytes.as_ref())
                .arg(ttl_ms.max(1))
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable("replace-if-equal"))?;
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
            self.count(1);
            let mut conn = self.conn.clone();
            let ok: Option<String> = redis::cmd("SET")
                .arg(self.lock_key(key))
                .arg(owner)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms.max(1))
                .query_async(&mut conn)
                .await
                .map_err(unavailable("SET NX"))?;
            Ok(ok.is_some())
        }
        .boxed()
    }

    fn release<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>> {
        async move {
            self.count(1);
            let mut conn = self.conn.clone();
            let n: u64 = self
                .delete_if_equal
                .key(self.lock_key(key))
                .arg(owner)
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable("lock release"))?;
            Ok(n > 0)
        }
        .boxed()
    }
}
