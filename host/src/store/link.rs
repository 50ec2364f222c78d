//! How Corral reaches Redis: one server, or a Redis Cluster through its seed nodes, set
//! up the one way Corral sets up every connection (`TCP_NODELAY`, the options' connect
//! and response timeouts, one retry).
//!
//! A [`Link`] is the command connection either way, and speaks `ConnectionLike`, so the
//! store, the announcements and the lock leases issue the same commands and scripts over
//! both. On a cluster every command Corral sends names keys of one slot only (an entry,
//! its flight lock, its user lock and its fence counter share one hash tag, contract
//! §2.4), so the cluster client routes each to one master and none is refused with
//! `CROSSSLOT`. The landing channel is classic pub/sub, which a cluster broadcasts to
//! every node: a subscription to any one node hears every announcement
//! ([`Connection::subscribers`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::FutureExt;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::{Cmd, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisFuture, Value};

use super::owners::Owners;
use super::redis_options::{RedisOptions, redact, redact_in};
#[cfg(feature = "test-util")]
use super::wire::Wire;
use crate::{Error, Result};

/// A command connection to one Redis server or to a Redis Cluster. Cheap to clone;
/// clones share the connection.
#[derive(Clone)]
pub enum Link {
    /// One server, through a `ConnectionManager` (it reconnects by itself).
    Server(ConnectionManager),
    /// A cluster, through the cluster client (it follows slot moves and failovers).
    Cluster(ClusterConnection),
    /// A server reached in process ([`Wire`]).
    #[cfg(feature = "test-util")]
    Wired(Arc<dyn Wire>),
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Link::Server(_) => "Link::Server",
            Link::Cluster(_) => "Link::Cluster",
            #[cfg(feature = "test-util")]
            Link::Wired(_) => "Link::Wired",
        })
    }
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Server(c) => c.req_packed_command(cmd),
            Link::Cluster(c) => c.req_packed_command(cmd),
            #[cfg(feature = "test-util")]
            Link::Wired(w) => {
                let sent = w.send(vec![cmd.clone()]);
                Box::pin(async move {
                    let reply = sent.await?.into_iter().next().ok_or_else(|| {
                        redis::RedisError::from((redis::ErrorKind::Client, "a wire answered no reply"))
                    })?;
                    reply.extract_error()
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Server(c) => c.req_packed_commands(cmd, offset, count),
            Link::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "test-util")]
            Link::Wired(w) => {
                let sent = w.send(cmd.cmd_iter().cloned().collect());
                Box::pin(async move { Ok(sent.await?.into_iter().skip(offset).take(count).collect()) })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Server(c) => c.get_db(),
            Link::Cluster(c) => c.get_db(),
            #[cfg(feature = "test-util")]
            Link::Wired(_) => 0,
        }
    }
}

/// What a link is opened from: a client per reachable server.
#[derive(Clone)]
enum Reach {
    Server(redis::Client),
    Cluster {
        client: Box<ClusterClient>,
        /// One client per seed node, for subscriptions.
        nodes: Vec<redis::Client>,
    },
    #[cfg(feature = "test-util")]
    Wired(Arc<dyn Wire>),
}

/// Where a subscription may go: a client per reachable server, or a wire.
#[derive(Clone)]
pub(crate) enum Subscribers {
    /// The server, or every seed node of a cluster, in the order to try them.
    Clients(Vec<redis::Client>),
    #[cfg(feature = "test-util")]
    Wired(Arc<dyn Wire>),
}

/// A way to Redis: its clients, and a command link opened lazily (an unreachable
/// server is reported by the first command, and the link keeps reconnecting).
#[derive(Clone)]
pub(crate) struct Connection {
    reach: Reach,
    connect_timeout: Duration,
    response_timeout: Duration,
}

fn info(url: &str) -> Result<ConnectionInfo> {
    Ok(url
        .into_connection_info()
        .map_err(|e| {
            let e = redact_in(&e.to_string(), url);
            Error::invalid_argument("redis url", format!("{} is not a Redis URL: {e}", redact(url)))
        })?
        .set_tcp_settings(TcpSettings::default().set_nodelay(true)))
}

/// The server `url` leads to, as `host:port` (a Unix socket by its path), whatever its
/// database, user or password: one server process, whichever of its databases a URL
/// names. Names are compared as written (`localhost` and `127.0.0.1` differ).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a bad URL.
pub(crate) fn destination(url: &str) -> Result<String> {
    Ok(info(url)?.addr().to_string())
}

fn failed(what: &'static str) -> impl Fn(redis::RedisError) -> Error {
    move |e| Error::unavailable(format!("redis {what} failed"), e)
}

impl Connection {
    /// The way to what `options` name: its cluster nodes when it names some, else its URL.
    pub(crate) fn open(options: &RedisOptions) -> Result<Self> {
        crate::require_runtime("connecting to Redis")?;
        let reach = if options.cluster_nodes.is_empty() {
            Reach::Server(redis::Client::open(info(&options.url)?).map_err(failed("client"))?)
        } else {
            let infos = options
                .cluster_nodes
                .iter()
                .map(|url| info(url))
                .collect::<Result<Vec<_>>>()?;
            let nodes = infos
                .iter()
                .map(|i| redis::Client::open(i.clone()).map_err(failed("client")))
                .collect::<Result<Vec<_>>>()?;
            let client = ClusterClient::builder(infos)
                .connection_timeout(options.connect_timeout)
                .response_timeout(options.response_timeout)
                // No command is sent twice: a resent `SET NX` or lock script whose first
                // try landed would report the lock busy while holding it. So a MOVED or
                // ASK redirect fails the command once (the slot map is rebuilt for the
                // next one) instead of being followed.
                .retries(0)
                .tcp_settings(TcpSettings::default().set_nodelay(true))
                .build()
                .map_err(failed("cluster client"))?;
            Reach::Cluster {
                client: Box::new(client),
                nodes,
            }
        };
        Ok(Connection {
            reach,
            connect_timeout: options.connect_timeout,
            response_timeout: options.response_timeout,
        })
    }

    /// The way to the server `wire` reaches, with `options`' timeouts.
    #[cfg(feature = "test-util")]
    pub(crate) fn wired(wire: Arc<dyn Wire>, options: &RedisOptions) -> Self {
        Connection {
            reach: Reach::Wired(wire),
            connect_timeout: options.connect_timeout,
            response_timeout: options.response_timeout,
        }
    }

    /// A new command link, connecting lazily.
    pub(crate) fn link(&self) -> Result<Link> {
        match &self.reach {
            #[cfg(feature = "test-util")]
            Reach::Wired(wire) => Ok(Link::Wired(wire.clone())),
            Reach::Server(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.response_timeout))
                    .set_number_of_retries(1);
                client
                    .get_connection_manager_lazy(config)
                    .map(Link::Server)
                    .map_err(failed("connect"))
            }
            Reach::Cluster { client, .. } => {
                let config = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(self.connect_timeout)
                    .set_response_timeout(self.response_timeout);
                Ok(Link::Cluster(
                    client.get_pending_async_connection_with_config(config),
                ))
            }
        }
    }

    /// Clients a subscription may use, in the order to try them: the server, or every
    /// seed node of the cluster (classic pub/sub reaches every node of a cluster).
    pub(crate) fn subscribers(&self) -> Subscribers {
        match &self.reach {
            Reach::Server(client) => Subscribers::Clients(vec![client.clone()]),
            Reach::Cluster { nodes, .. } => Subscribers::Clients(nodes.clone()),
            #[cfg(feature = "test-util")]
            Reach::Wired(wire) => Subscribers::Wired(wire.clone()),
        }
    }

    /// Whether this is a cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.reach, Reach::Cluster { .. })
    }
}

/// Commands timing out in a row before the connection is replaced.
const TIMEOUTS_BEFORE_RECONNECT: u32 = 2;

/// A command link that heals: replaced after [`TIMEOUTS_BEFORE_RECONNECT`] timeouts in a
/// row (a half-open connection never errors on its own: its replies just stop coming).
/// Cheap to clone; clones share the link, its replacement and the count, so whatever
/// shares one (a cache's store, its announcements and its leases) heals together.
#[derive(Clone)]
pub(crate) struct Healing {
    link: Arc<ArcSwap<Link>>,
    connection: Connection,
    /// Commands that timed out in a row.
    timeouts: Arc<AtomicU32>,
    /// A cluster's slot owners: which node a key's command goes to.
    owners: Option<Arc<Owners>>,
}

impl Healing {
    /// A healing link to where `connection` leads (connecting lazily).
    pub(crate) fn new(connection: Connection) -> Result<Self> {
        Ok(Healing {
            link: Arc::new(ArcSwap::from_pointee(connection.link()?)),
            owners: connection
                .is_cluster()
                .then(|| Arc::new(Owners::new(connection.response_timeout))),
            connection,
            timeouts: Arc::new(AtomicU32::new(0)),
        })
    }

    /// On a cluster, the address (`host:port`) of the master serving `key`'s slot, as
    /// last learnt; `None` for one server, or before the cluster first said (it is then
    /// asked, in the background).
    /// A cluster's masters as last learnt (`None`: not a cluster, or not learnt yet).
    pub(crate) fn masters(&self) -> Option<Vec<Arc<str>>> {
        self.owners.as_ref()?.masters()
    }

    pub(crate) fn node_of(&self, key: &str) -> Option<Arc<str>> {
        let owners = self.owners.as_ref()?;
        let node = owners.of(key.as_bytes());
        if node.is_none() {
            owners.relearn(&self.current());
        }
        node
    }

    /// On a cluster, asks which node serves which slot again (in the background, at most
    /// once a second): after a failure, a redirect or a refusal, since a master may have
    /// died or a replica taken over.
    pub(crate) fn relearn(&self) {
        if let Some(owners) = &self.owners {
            owners.relearn(&self.current());
        }
    }

    /// The link for one command: the one in use now.
    pub(crate) fn current(&self) -> Link {
        Link::clone(&self.link.load())
    }

    /// The slot the link is swapped in, for those who pick it per command themselves
    /// (the announcements).
    pub(crate) fn swap(&self) -> Arc<ArcSwap<Link>> {
        self.link.clone()
    }

    /// The way to Redis the link is opened from.
    pub(crate) fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Notes how a command ended: after [`TIMEOUTS_BEFORE_RECONNECT`] timeouts in a row
    /// the connection is replaced (lazily: the next command connects).
    pub(crate) fn observe(&self, timed_out: bool) {
        if !timed_out {
            // Read first: the common case writes nothing every thread would contend on.
            if self.timeouts.load(Ordering::Relaxed) != 0 {
                self.timeouts.store(0, Ordering::Relaxed);
            }
            return;
        }
        if self.timeouts.fetch_add(1, Ordering::AcqRel) + 1 < TIMEOUTS_BEFORE_RECONNECT {
            return;
        }
        if self.connection.is_cluster() {
            // The cluster client reconnects each node by itself; a new link would drop
            // the healthy nodes' connections too.
            self.timeouts.store(0, Ordering::Relaxed);
            return;
        }
        self.timeouts.store(0, Ordering::Relaxed);
        match self.connection.link() {
            Ok(fresh) => {
                crate::throttle::warn_every!(10, "redis stopped answering: reconnecting");
                self.link.store(Arc::new(fresh));
            }
            Err(e) => {
                crate::throttle::warn_every!(10, error = %e, "redis stopped answering and a new connection failed")
            }
        }
    }
}

/// Clients for every node a cluster knows now (masters and replicas), asked through
/// `link` (`CLUSTER SLOTS`, within `timeout`): where a subscription goes when no seed
/// node answers. Empty for one server or when the cluster does not answer.
pub(crate) async fn cluster_nodes(link: &Link, timeout: Duration) -> Vec<redis::Client> {
    let Link::Cluster(conn) = link else {
        return Vec::new();
    };
    let mut conn = conn.clone();
    let slots = tokio::time::timeout(
        timeout,
        redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async::<Vec<Vec<Value>>>(&mut conn),
    )
    .await;
    let Ok(Ok(slots)) = slots else {
        return Vec::new();
    };
    let mut seen = std::collections::BTreeSet::new();
    for range in slots {
        for node in range.iter().skip(2) {
            if let Value::Array(node) = node
                && let (Some(Value::BulkString(host)), Some(Value::Int(port))) = (node.first(), node.get(1))
            {
                seen.insert((String::from_utf8_lossy(host).into_owned(), *port));
            }
        }
    }
    seen.into_iter()
        .filter_map(|(host, port)| redis::Client::open(format!("redis://{host}:{port}")).ok())
        .collect()
}

/// Subscribes `pubsub` through the first of `clients` that answers within `timeout`,
/// starting at `first` (so a dead node is not tried first again), all tries together
/// within twice `timeout`.
pub(crate) async fn pubsub_on(
    clients: &[redis::Client],
    first: usize,
    timeout: Duration,
) -> Result<(usize, redis::aio::PubSub)> {
    tokio::time::timeout(2 * timeout, try_each(clients, first, timeout))
        .await
        .unwrap_or_else(|_| {
            Err(Error::new(
                crate::ErrorKind::Timeout,
                "no Redis node took a pub/sub connection in time",
            ))
        })
}

async fn try_each(
    clients: &[redis::Client],
    first: usize,
    timeout: Duration,
) -> Result<(usize, redis::aio::PubSub)> {
    let mut last = None;
    for i in 0..clients.len() {
        let at = first.wrapping_add(i) % clients.len();
        match tokio::time::timeout(timeout, clients[at].get_async_pubsub().boxed()).await {
            Ok(Ok(pubsub)) => return Ok((at, pubsub)),
            Ok(Err(e)) => last = Some(Error::unavailable("redis pub/sub connect failed", e)),
            Err(_) => {
                last = Some(Error::new(
                    crate::ErrorKind::Timeout,
                    "redis pub/sub connect timed out",
                ));
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::new(crate::ErrorKind::Unavailable, "no Redis node to subscribe to")))
}
