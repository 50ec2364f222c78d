//! A circuit breaker for one store: after a few failures in a row (the store unreachable
//! or not answering), calls fail at once with [`ErrorKind::Unavailable`] instead of each
//! paying a connect or response timeout; after a cool-down one call goes through as a
//! probe, and its success closes the breaker again. A probe whose caller goes away before
//! the answer (its future dropped: a timeout, a cancelled request) never reports; its slot
//! lapses after one cool-down, so the next call probes instead.
//!
//! A get-or-set then degrades at once (it loads, uncached) during an outage, and `get`,
//! `set`, `remove` fail fast; none waits out timeouts that cannot succeed. Only failures
//! of the connection count (a timeout, a refused or dropped connection, a cluster that is
//! down), never an answer the store gave (a wrong type, a missing script). Lock-free:
//! every command asks it, so it costs two atomic loads when closed.
//!
//! A store keeps one per server ([`Breakers`]): on a Redis Cluster one per master (by
//! the address serving the command's key's slot, [`super::owners`]), so a dead master
//! refuses its own shard's keys only, and its refusals name it. Finding a master's
//! breaker costs a slot hash, a binary search and a shared read lock per command.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::{Error, ErrorKind, Result};

/// The breaker of one store. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub(crate) struct Breaker {
    /// Failures in a row while closed.
    failures: AtomicU32,
    /// 0 while closed; else the moment (ms after `origin`, at least 1) it may probe.
    open_until_ms: AtomicU64,
    /// 0 when no probe is out; else the moment its slot lapses (ms after `origin`).
    probe_until_ms: AtomicU64,
    /// How often it opened.
    opened: AtomicU64,
    /// Calls it refused at once.
    refused: AtomicU64,
    threshold: u32,
    cool_down: Duration,
    origin: Instant,
    /// The cluster node it guards (`host:port`), if it guards one.
    node: Option<Arc<str>>,
}

impl Breaker {
    /// Opens after `threshold` failures in a row (0: never) and probes after `cool_down`.
    pub(crate) fn new(threshold: u32, cool_down: Duration) -> Self {
        Breaker {
            node: None,
            failures: AtomicU32::new(0),
            open_until_ms: AtomicU64::new(0),
            probe_until_ms: AtomicU64::new(0),
            opened: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            threshold,
            cool_down,
            origin: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Lets a call through, or refuses it at once while open (one probe per cool-down
    /// goes through).
    pub(crate) fn admit(&self) -> Result<()> {
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Ok(());
        }
        let now = self.now_ms();
        if now >= until {
            let probe = self.probe_until_ms.load(Ordering::Acquire);
            if now >= probe
                && self
                    .probe_until_ms
                    .compare_exchange(
                        probe,
                        self.after_cool_down(now),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
            {
                return Ok(());
            }
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "{} is failing (circuit open after {} failures in a row): not tried; the next probe in {} ms",
                self.what(),
                self.threshold,
                until.saturating_sub(now)
            ),
        ))
    }

    /// Notes how an admitted call ended: `failed` for a failure of the connection.
    pub(crate) fn record(&self, failed: bool) {
        if !failed {
            if self.failures.load(Ordering::Relaxed) != 0 {
                self.failures.store(0, Ordering::Relaxed);
            }
            if self.open_until_ms.load(Ordering::Acquire) != 0 {
                self.open_until_ms.store(0, Ordering::Release);
                self.probe_until_ms.store(0, Ordering::Release);
                tracing::info!(node = self.node.as_deref(), "Redis answers again: circuit closed");
            }
            return;
        }
        if self.threshold == 0 {
            return;
        }
        let open = self.open_until_ms.load(Ordering::Acquire) != 0;
        let n = self.failures.fetch_add(1, Ordering::AcqRel).saturating_add(1);
        if open || n >= self.threshold {
            self.open_until_ms
                .store(self.after_cool_down(self.now_ms()), Ordering::Release);
            self.probe_until_ms.store(0, Ordering::Release);
            if !open {
                self.opened.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    node = self.node.as_deref(),
                    failures = n,
                    cool_down_ms = self.cool_down.as_millis() as u64,
                    "Redis is failing: circuit open, calls fail fast (get-or-set loads uncached) until a probe succeeds"
                );
            }
        }
    }

    /// One cool-down after `now_ms` (at least 1: 0 means "none").
    fn after_cool_down(&self, now_ms: u64) -> u64 {
        now_ms
            .saturating_add(u64::try_from(self.cool_down.as_millis()).unwrap_or(u64::MAX))
            .max(1)
    }

    /// The cluster node it guards (`host:port`), if it guards one.
    pub(crate) fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// What it guards, for people.
    fn what(&self) -> String {
        match &self.node {
            Some(node) => format!("Redis node {node}"),
            None => "Redis".to_owned(),
        }
    }

    /// Whether it is open now.
    pub(crate) fn is_open(&self) -> bool {
        self.open_until_ms.load(Ordering::Acquire) != 0
    }

    /// How often it opened, and how many calls it refused at once.
    pub(crate) fn figures(&self) -> (u64, u64) {
        (
            self.opened.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

/// The breakers of one store: one for one server; on a cluster one per master (by
/// address), and one for keys whose master is not known yet (before the cluster first
/// told which node serves which slot).
#[derive(Debug)]
pub(crate) struct Breakers {
    threshold: u32,
    cool_down: Duration,
    /// One server's, or a cluster's for keys of a master not known yet.
    whole: Arc<Breaker>,
    /// A cluster's, per master address; one is made when its address is first met.
    nodes: parking_lot::RwLock<HashMap<Arc<str>, Arc<Breaker>>>,
}

impl Breakers {
    /// Breakers opening after `threshold` failures in a row, probing after `cool_down`.
    pub(crate) fn new(threshold: u32, cool_down: Duration) -> Self {
        Breakers {
            threshold,
            cool_down,
            whole: Arc::new(Breaker::new(threshold, cool_down)),
            nodes: parking_lot::RwLock::new(HashMap::new()),
        }
    }

    /// The breaker of the cluster node `node` (`host:port`), or the store's own.
    pub(crate) fn of(&self, node: Option<Arc<str>>) -> Arc<Breaker> {
        let Some(node) = node else {
            return self.whole.clone();
        };
        if let Some(breaker) = self.nodes.read().get(&node) {
            return breaker.clone();
        }
        self.nodes
            .write()
            .entry(node.clone())
            .or_insert_with(|| {
                Arc::new(Breaker {
                    node: Some(node),
                    ..Breaker::new(self.threshold, self.cool_down)
                })
            })
            .clone()
    }

    /// Whether any is open now. Once a cluster's `masters` are known, only theirs count:
    /// a breaker left open for an address no longer serving a slot (a failed-over master),
    /// or the one for keys of unknown masters, is never tried again, so it would report
    /// open for good.
    pub(crate) fn is_open(&self, masters: Option<&[Arc<str>]>) -> bool {
        match masters {
            None => self.whole.is_open() || self.nodes.read().values().any(|b| b.is_open()),
            Some(masters) => {
                let nodes = self.nodes.read();
                masters.iter().any(|m| nodes.get(m).is_some_and(|b| b.is_open()))
            }
        }
    }

    /// How often they opened, and how many calls they refused at once, all together.
    pub(crate) fn figures(&self) -> (u64, u64) {
        let nodes = self.nodes.read();
        std::iter::once(&self.whole)
            .chain(nodes.values())
            .map(|b| b.figures())
            .fold((0, 0), |(o, r), (opened, refused)| (o + opened, r + refused))
    }

    /// The cluster nodes whose breakers are open now (of `masters`, once known).
    pub(crate) fn open_nodes(&self, masters: Option<&[Arc<str>]>) -> Vec<String> {
        let mut open: Vec<String> = self
            .nodes
            .read()
            .iter()
            .filter(|(node, _)| masters.is_none_or(|m| m.contains(node)))
            .map(|(_, b)| b)
            .filter(|b| b.is_open())
            .filter_map(|b| b.node().map(str::to_owned))
            .collect();
        open.sort();
        open
    }
}

/// Whether `e` is a failure of the connection (not an answer the server gave).
pub(crate) fn is_connection_failure(e: &redis::RedisError) -> bool {
    e.is_timeout()
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(e.code(), Some("CLUSTERDOWN" | "LOADING" | "MASTERDOWN"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_breaker_of_an_address_no_longer_a_master_is_not_reported_open() {
        let breakers = Breakers::new(1, Duration::from_secs(3600));
        let old: Arc<str> = "10.0.0.1:7000".into();
        let promoted: Arc<str> = "10.0.0.2:7001".into();
        breakers.of(Some(old.clone())).record(true);
        breakers.whole.record(true);
        assert!(
            breakers.is_open(None),
            "before the masters are known, every breaker counts"
        );
        assert_eq!(breakers.open_nodes(None), ["10.0.0.1:7000"]);
        let now = [promoted.clone()];
        assert!(
            !breakers.is_open(Some(&now)),
            "the failed-over address serves no slot"
        );
        assert!(breakers.open_nodes(Some(&now)).is_empty());
        breakers.of(Some(promoted)).record(true);
        assert!(breakers.is_open(Some(&now)));
    }

    #[tokio::test(start_paused = true)]
    async fn it_opens_after_the_threshold_probes_after_the_cool_down_and_closes_on_success() {
        let b = Breaker::new(3, Duration::from_secs(1));
        for _ in 0..2 {
            b.admit().unwrap();
            b.record(true);
        }
        assert!(!b.is_open(), "two failures: still closed");
        b.admit().unwrap();
        b.record(false);
        b.record(true);
        b.record(true);
        assert!(!b.is_open(), "a success resets the count");
        b.record(true);
        assert!(b.is_open(), "three in a row: open");
        let e = b.admit().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("circuit open"), "{e}");
        tokio::time::advance(Duration::from_millis(1_000)).await;
        b.admit().expect("one probe after the cool-down");
        assert!(b.admit().is_err(), "only one");
        b.record(true);
        assert!(b.admit().is_err(), "a failed probe opens it again");
        tokio::time::advance(Duration::from_millis(1_000)).await;
        b.admit().expect("the next probe");
        b.record(false);
        assert!(!b.is_open());
        b.admit().expect("closed");
        assert_eq!(b.figures(), (1, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_never_reports_gives_its_slot_up_after_a_cool_down() {
        let b = Breaker::new(1, Duration::from_secs(1));
        b.record(true);
        tokio::time::advance(Duration::from_millis(1_000)).await;
        b.admit().expect("the probe");
        // Its caller went away: no record. Others are refused for one cool-down ...
        assert!(b.admit().is_err());
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(b.admit().is_err());
        // ... then the next call probes, and its success closes the breaker.
        tokio::time::advance(Duration::from_millis(1)).await;
        b.admit().expect("a new probe");
        b.record(false);
        assert!(!b.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_nodes_failures_open_its_own_breaker_only_and_its_refusals_name_it() {
        let b = Breakers::new(3, Duration::from_secs(1));
        let (dead, live): (Arc<str>, Arc<str>) = ("10.0.0.2:7001".into(), "10.0.0.1:7000".into());
        for _ in 0..3 {
            b.of(Some(dead.clone())).record(true);
        }
        assert!(
            b.of(Some(live.clone())).admit().is_ok(),
            "another node's keys go through"
        );
        assert!(b.of(None).admit().is_ok(), "so do keys of a node not known yet");
        let e = b.of(Some(dead.clone())).admit().unwrap_err();
        assert!(
            e.to_string()
                .contains("Redis node 10.0.0.2:7001 is failing (circuit open"),
            "{e}"
        );
        assert!(b.is_open(None));
        assert_eq!(b.open_nodes(None), vec!["10.0.0.2:7001".to_owned()]);
        assert_eq!(b.figures(), (1, 1));
        let e = Breaker::new(1, Duration::from_secs(1));
        e.record(true);
        assert!(
            e.admit()
                .unwrap_err()
                .to_string()
                .starts_with("store unavailable: Redis is failing")
        );
    }

    #[test]
    fn a_threshold_of_zero_never_opens() {
        let b = Breaker::new(0, Duration::from_secs(1));
        for _ in 0..100 {
            b.record(true);
        }
        assert!(b.admit().is_ok());
    }
}
