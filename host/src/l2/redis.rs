//! The Redis L2, through the `redis` crate's `ConnectionManager` (reconnects by itself).
//!
//! Every key is stored under the configured prefix, so applications and tenants sharing
//! one Redis never see each other's entries or locks: entries live at `{prefix}e:{key}`,
//! locks at `{prefix}l:{key}`, and landings (a set, a removal, a loaded value) are
//! announced on the channel `{prefix}landed` as `"{origin} {key}"`, where `origin` names
//! the announcing store: waiters wake, and other stores drop their L1 copy. A read is one round trip: the guest's read-and-touch Lua runs on
//! the server (`EVALSHA`, falling back to `EVAL` once).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;
use redis::{IntoConnectionInfo, Script};

use futures::StreamExt;
use tokio::sync::Mutex as AsyncMutex;

use super::{L2Store, LandingWatch, Landings};
use crate::policy::Policy;
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
            response_timeout: Duration::from_secs(2),
        }
    }
}

/// The Redis L2 store. Cheap to clone.
#[derive(Clone)]
pub struct RedisL2 {
    conn: ConnectionManager,
    prefix: Arc<str>,
    read_script: Arc<Script>,
    delete_if_equal: Arc<Script>,
    replace_if_equal: Arc<Script>,
    grace_ms: u64,
    commands: Arc<AtomicU64>,
    client: redis::Client,
    landings: Landings,
    /// Whether this process listens on the landing channel yet (subscribed on first need).
    listening: Arc<AsyncMutex<bool>>,
    /// This store's name on the landing channel, so it can tell its own messages apart.
    origin: Arc<str>,
    /// Called with the key of every landing another store announced (L1 invalidation).
    on_foreign_landing: Arc<OnceLock<LandingHook>>,
}

/// What a store does when another one announces a landing.
pub(crate) type LandingHook = Arc<dyn Fn(String) + Send + Sync>;

impl fmt::Debug for RedisL2 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisL2")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unavailable(what: &'static str) -> impl Fn(redis::RedisError) -> Error {
    move |e| Error::unavailable(format!("redis {what} failed"), e)
}

impl RedisL2 {
    /// Connects to Redis (lazily: an unreachable server is reported by the first
    /// operation, and the manager keeps reconnecting).
    pub(crate) fn connect(options: &RedisOptions, policy: &Policy) -> Result<Self> {
        let info = options
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| {
                Error::invalid_argument("redis url", format!("is not a Redis URL: {e}")).with_source(e)
            })?
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        crate::require_runtime("connecting to Redis")?;
        let client = redis::Client::open(info).map_err(unavailable("client"))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.response_timeout))
            .set_number_of_retries(1);
        let conn = client
            .get_connection_manager_lazy(config)
            .map_err(unavailable("connect"))?;
        Ok(RedisL2 {
            conn,
            prefix: options.prefix.as_str().into(),
            read_script: Arc::new(Script::new(policy.redis_read_script())),
            delete_if_equal: Arc::new(Script::new(policy.redis_delete_if_equal_script())),
            replace_if_equal: Arc::new(Script::new(policy.redis_replace_if_equal_script())),
            grace_ms: policy.store_ttl_grace_ms(),
            commands: Arc::new(AtomicU64::new(0)),
            client,
            landings: Landings::default(),
            listening: Arc::new(AsyncMutex::new(false)),
            origin: crate::lock_token().into(),
            on_foreign_landing: Arc::new(OnceLock::new()),
        })
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

    fn channel(&self) -> String {
        self.namespaced("landed", "")
    }

    /// Subscribes to the landing channel once per process; the listener task feeds the
    /// local waiters. Returns false when Redis cannot be reached (callers then rely on
    /// their timers; the next wait tries again).
    async fn ensure_listening(&self) -> bool {
        let mut listening = self.listening.lock().await;
        if *listening {
            return true;
        }
        self.count(1);
        let subscribed = async {
            let mut pubsub = self.client.get_async_pubsub().await?;
            pubsub.subscribe(self.channel()).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(pubsub) => {
                let landings = self.landings.clone();
                let flag = self.listening.clone();
                let (origin, hook) = (self.origin.clone(), self.on_foreign_landing.clone());
                tokio::spawn(async move {
                    let mut messages = pubsub.into_on_message();
                    while let Some(msg) = messages.next().await {
                        // "{origin} {key}": the key may hold spaces, the origin never does.
                        let Ok(payload) = msg.get_payload::<String>() else {
                            continue;
                        };
                        let Some((from, key)) = payload.split_once(' ') else {
                            continue;
                        };
                        landings.announce(key);
                        if from != &*origin
                            && let Some(hook) = hook.get()
                        {
                            hook(key.to_owned());
                        }
                    }
                    // The connection dropped: subscribe again on the next wait.
                    *flag.lock().await = false;
                });
                *listening = true;
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "landing channel unavailable; waiters fall back to timers");
                false
            }
        }
    }

    /// Calls `hook` with the key of every landing (a set, a removal, a loaded value)
    /// another store announces on this prefix, and starts listening now.
    pub(crate) fn on_foreign_landing(&self, hook: LandingHook) {
        let _ = self.on_foreign_landing.set(hook);
        let store = self.clone();
        tokio::spawn(async move {
            store.ensure_listening().await;
        });
    }

    fn count(&self, n: u64) {
        self.commands.fetch_add(n, Ordering::Relaxed);
    }

    /// Commands sent to Redis so far by this store (a script counts as one).
    pub fn commands_sent(&self) -> u64 {
        self.commands.load(Ordering::Relaxed)
    }

    /// A connection to the same Redis, for callers that need raw access (tests, tools).
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// The prefix every key is stored under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl L2Store for RedisL2 {
    fn read<'a>(&'a self, key: &'a str, now_ms: u64) -> BoxFuture<'a, Result<Option<Bytes>>> {
        async move {
            self.count(1);
            let mut conn = self.conn.clone();
            let found: Option<Vec<u8>> = self
                .read_script
                .key(self.entry_key(key))
                .arg(now_ms)
                .arg(self.grace_ms)
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable("read"))?;
            Ok(found.map(Bytes::from))
        }
        .boxed()
    }

    fn peek<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Bytes>>> {
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

    fn write<'a>(&'a self, key: &'a str, bytes: Bytes, ttl_ms: u64) -> BoxFuture<'a, Result<()>> {
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

    fn release_lock<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFuture<'a, Result<bool>> {
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

    fn watch_landing<'a>(&'a self, key: &'a str) -> BoxFuture<'a, LandingWatch> {
        async move {
            if self.ensure_listening().await {
                self.landings.watch(key)
            } else {
                LandingWatch::never()
            }
        }
        .boxed()
    }

    fn announce_landing<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<()>> {
        async move {
            self.count(1);
            let mut conn = self.conn.clone();
            redis::cmd("PUBLISH")
                .arg(self.channel())
                .arg(format!("{} {key}", self.origin))
                .query_async::<()>(&mut conn)
                .await
                .map_err(unavailable("PUBLISH"))
        }
        .boxed()
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}
