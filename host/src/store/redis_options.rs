//! How to reach Redis ([`RedisOptions`]) and how a Redis URL is shown to people
//! ([`redact`]): the connection's options, apart from the store, the link and the
//! subscription that all read them.

use std::fmt;
use std::time::Duration;

use redis::IntoConnectionInfo;

/// How to reach Redis. Its `Debug` output never shows a password.
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisOptions {
    /// `redis://host:port/db`: the server; for a cluster, the first of its nodes.
    pub url: String,
    /// A Redis Cluster's seed nodes (`redis://host:port` each), or empty for one server.
    /// Any reachable node will do: the client learns the rest from it.
    pub cluster_nodes: Vec<String>,
    /// The namespace every name is made under (contract §2.4): tenants sharing a Redis
    /// give each other different prefixes.
    pub prefix: String,
    /// How long one connection attempt may take.
    pub connect_timeout: Duration,
    /// How long one command may take.
    pub response_timeout: Duration,
    /// After this many failures of the connection in a row, calls fail at once (a
    /// get-or-set loads uncached) until a probe succeeds; 0 turns the breaker off.
    /// Default 3.
    pub breaker_threshold: u32,
    /// How often an open breaker probes Redis (a `PING` in the background: no call waits
    /// on it; every call is refused until a probe is answered).
    /// Default 1 s.
    pub breaker_cool_down: Duration,
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &redact(&self.url))
            .field(
                "cluster_nodes",
                &self.cluster_nodes.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("breaker_threshold", &self.breaker_threshold)
            .field("breaker_cool_down", &self.breaker_cool_down)
            .finish()
    }
}

/// `url` with the secret part of its user information replaced by `***`
/// (`redis://user:***@host:6379`, `redis://***@host`), for anything a person may read:
/// errors, logs, `Debug`.
pub fn redact(url: &str) -> String {
    let url = &redact_query(url);
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    let user = match rest[..at].split_once(':') {
        Some((user, _secret)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!("{scheme}://{user}{}", &rest[at..])
}

impl RedisOptions {
    /// Options for `url` with the default prefix `corral:` and timeouts.
    pub fn new(url: impl Into<String>) -> Self {
        RedisOptions {
            url: url.into(),
            cluster_nodes: Vec::new(),
            prefix: crate::options::DEFAULT_PREFIX.into(),
            connect_timeout: Duration::from_millis(500),
            response_timeout: Duration::from_secs(1),
            breaker_threshold: 3,
            breaker_cool_down: Duration::from_secs(1),
        }
    }

    /// Options for a Redis Cluster reached through `nodes` (seed nodes; one reachable
    /// node is enough), with the default prefix and timeouts.
    pub fn cluster<I, S>(nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(Into::into).collect();
        RedisOptions {
            cluster_nodes: nodes.clone(),
            ..RedisOptions::new(nodes.first().cloned().unwrap_or_default())
        }
    }
}

/// `url` with the values of `pass=` and `password=` query parameters (a unix socket's
/// password: `redis+unix:///run/redis.sock?pass=...`) replaced by `***`.
fn redact_query(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let params: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((name, _)) if name.eq_ignore_ascii_case("pass") || name.eq_ignore_ascii_case("password") => {
                format!("{name}=***")
            }
            _ => p.to_owned(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

/// `text` with every occurrence of `url` (and of its password) redacted.
pub(crate) fn redact_in(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact(url));
    if let Ok(info) = url.into_connection_info()
        && let Some(password) = info.redis_settings().password()
        && !password.is_empty()
    {
        out = out.replace(password, "***");
    }
    out
}
