//! How `corral` reaches Redis: the library's timeouts ([`RedisOptions::new`]), unless
//! the command line raises them for a slow link, and the bounds `corral` derives from
//! them for what it owes Redis before it exits.

use std::time::Duration;

use corral::RedisOptions;

use crate::redact::RedisUrl;

/// The longest timeout the command line accepts: every call still ends by a deadline
/// a person waits for.
const LONGEST: Duration = Duration::from_secs(600);

/// How long what a command leaves owed to Redis (a lock's release, an announcement or
/// a removal retried) may take before `corral` exits anyway, on a link with the
/// library's timeouts; a slower link gets a connection and a reply more.
const OWED_AT_LEAST: Duration = Duration::from_secs(3);

/// The timeouts of every connection `corral` opens.
#[derive(Clone, Copy, Debug)]
pub struct Link {
    /// How long connecting may take, the handshake's round trip included.
    pub connect_timeout: Duration,
    /// How long one command may take.
    pub response_timeout: Duration,
}

impl Link {
    /// The library's timeouts, or those given.
    pub fn new(connect_timeout: Option<Duration>, response_timeout: Option<Duration>) -> Self {
        let defaults = RedisOptions::new("");
        Link {
            connect_timeout: connect_timeout.unwrap_or(defaults.connect_timeout),
            response_timeout: response_timeout.unwrap_or(defaults.response_timeout),
        }
    }

    /// Options for the server at `url`, keys under `prefix`.
    pub fn server(&self, url: &RedisUrl, prefix: &str) -> RedisOptions {
        self.apply(RedisOptions::new(url.expose()), prefix)
    }

    /// Options for the Redis Cluster reached through `nodes`, keys under `prefix`.
    pub fn cluster(&self, nodes: &[RedisUrl], prefix: &str) -> RedisOptions {
        let nodes = nodes.iter().map(|n| n.expose().to_owned());
        self.apply(RedisOptions::cluster(nodes), prefix)
    }

    fn apply(&self, mut options: RedisOptions, prefix: &str) -> RedisOptions {
        options.prefix = prefix.to_owned();
        options.connect_timeout = self.connect_timeout;
        options.response_timeout = self.response_timeout;
        options
    }

    /// How long what a command leaves owed to Redis may take before `corral` exits
    /// anyway: 3 s, or a connection and a reply on this link if that is longer.
    pub fn owed_within(&self) -> Duration {
        OWED_AT_LEAST.max(self.connect_timeout + self.response_timeout)
    }

    /// How long asking a server why it failed may take: a connection and two replies
    /// (a `PING`, a script), 2.5 s on the library's timeouts.
    pub fn probe_within(&self) -> Duration {
        self.connect_timeout + 2 * self.response_timeout
    }
}

/// A timeout on the command line (`--connect-timeout 2s`): more than zero, at most
/// ten minutes.
pub fn timeout(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be more than zero".into());
    }
    if d > LONGEST {
        return Err(format!("must be at most {}", humantime::format_duration(LONGEST)));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_is_more_than_zero_and_at_most_ten_minutes() {
        assert_eq!(timeout("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(timeout("10m"), Ok(LONGEST));
        assert_eq!(timeout("0s").unwrap_err(), "must be more than zero");
        assert_eq!(timeout("11m").unwrap_err(), "must be at most 10m");
        assert!(timeout("soon").is_err());
    }

    #[test]
    fn what_is_owed_gets_a_connection_and_a_reply_on_a_slow_link() {
        assert_eq!(Link::new(None, None).owed_within(), OWED_AT_LEAST);
        let slow = Link::new(Some(Duration::from_secs(4)), Some(Duration::from_secs(5)));
        assert_eq!(slow.owed_within(), Duration::from_secs(9));
        assert_eq!(slow.probe_within(), Duration::from_secs(14));
    }
}
