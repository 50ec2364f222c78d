//! Why a lock's Redis servers did not answer. The library reports a lock that too few
//! servers answered as one `Quorum` error, without the servers' own errors; to name the
//! cause (connection refused, authentication failed, a command the ACL forbids, ...)
//! the CLI asks each server itself, once, on a fresh connection: a `PING`, then a
//! trivial script (the lock commands are scripts).

use futures::future::join_all;

use crate::failure::Cause;
use crate::link::Link;
use crate::redact::RedisUrl;

/// What one server said to the probe.
#[derive(Debug)]
pub struct Finding {
    pub url: RedisUrl,
    /// `None`: it answered the probe.
    pub error: Option<String>,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.error {
            Some(error) => write!(f, "{}: {error}", self.url),
            None => write!(f, "{}: answers now", self.url),
        }
    }
}

impl Finding {
    /// The cause of this server's failure; `None` if it answered.
    pub fn cause(&self) -> Option<Cause> {
        self.error.as_deref().map(Cause::of)
    }
}

/// Probes every server at once, each over `link`: it may take a connection and two
/// replies ([`Link::probe_within`]), as the commands it stands in for.
pub async fn servers(urls: &[RedisUrl], link: Link) -> Vec<Finding> {
    let within = link.probe_within();
    join_all(urls.iter().map(|url| async move {
        let error = match tokio::time::timeout(within, check(url.expose(), link)).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {within:?} (timed out)")),
        };
        Finding {
            url: url.clone(),
            error,
        }
    }))
    .await
}

async fn check(url: &str, link: Link) -> redis::RedisResult<()> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(link.connect_timeout))
        .set_response_timeout(Some(link.response_timeout));
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    redis::cmd("PING").query_async::<()>(&mut conn).await?;
    redis::Script::new("return 1")
        .invoke_async::<_, ()>(&mut conn)
        .await
}
