//! A circuit breaker for one store: after a few failures in a row (the store unreachable
//! or not answering), calls fail at once with [`ErrorKind::Unavailable`] instead of each
//! paying a connect or response timeout. While it is open a background task probes the
//! server once per cool-down (a `PING`, bounded by the store's timeouts) and closes the
//! breaker when the server answers: no caller ever waits on a probe, so once the breaker
//! is open every call ends at once, for as long as the outage lasts. A call admitted
//! before the breaker opened that succeeds late closes it too (the server answered).
//!
//! A get-or-set then degrades at once (it loads, uncached) during an outage, and `get`,
//! `set`, `remove` fail fast; none waits out timeouts that cannot succeed. Only failures
//! of the connection count (a timeout, a refused or dropped connection, a cluster that is
//! down), never an answer the store gave (a wrong type, a missing script). Lock-free:
//! every command asks it, so it costs one atomic load when closed.
//!
//! A store keeps one per server ([`Breakers`]): on a Redis Cluster one per master (by
//! the address serving the command's key's slot, [`super::owners`]), so a dead master
//! refuses its own shard's keys only, and its refusals name it. Finding a master's
//! breaker costs a slot hash, a binary search and a shared read lock per command. A
//! master's probe goes to that master's address; once the cluster no longer has it as a
//! master (a replica took over), its breaker closes and its probing ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::{Error, ErrorKind, Result};

/// What a background probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probed {
    /// The server answered: the breaker closes.
    Up,
    /// No answer in time, or the connection failed: it stays open.
    Down,
    /// The cluster no longer has this address as a master: nothing to guard.
    Gone,
}

/// How a store probes a server: the cluster node's address (`host:port`), or `None` for
/// the store's one server (or a cluster's keys whose master is not known yet). The
/// future must end within the store's own timeouts.
pub(crate) type Prober = Arc<dyn Fn(Option<Arc<str>>) -> BoxFuture<'static, Probed> + Send + Sync>;

/// The breaker of one store. Shared behind an `Arc` (its probe task holds a `Weak`).
pub(crate) struct Breaker {
    /// Failures in a row while closed.
    failures: AtomicU32,
    /// Open: calls are refused at once.
    open: AtomicBool,
    /// When the next probe asks (ms after `origin`), for the refusals' message.
    next_probe_ms: AtomicU64,
    /// A probe task runs (at most one per breaker).
    probing: AtomicBool,
    /// How often it opened.
    opened: AtomicU64,
    /// Calls it refused at once.
    refused: AtomicU64,
    threshold: u32,
    cool_down: Duration,
    origin: Instant,
    /// The cluster node it guards (`host:port`), if it guards one.
    node: Option<Arc<str>>,
    prober: Prober,
    /// Itself, for the probe task it starts.
    me: Weak<Breaker>,
}

impl std::fmt::Debug for Breaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker")
            .field("node", &self.node)
            .field("open", &self.is_open())
            .finish_non_exhaustive()
    }
}

impl Breaker {
    /// Opens after `threshold` failures in a row (0: never); while open, `prober` asks
    /// the server (`node`) once per `cool_down`, in the background.
    pub(crate) fn new(
        threshold: u32,
        cool_down: Duration,
        node: Option<Arc<str>>,
        prober: Prober,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Breaker {
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            next_probe_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            opened: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            threshold,
            cool_down,
            origin: Instant::now(),
            node,
            prober,
            me: me.clone(),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Lets a call through, or refuses it at once while open.
    pub(crate) fn admit(&self) -> Result<()> {
        if !self.open.load(Ordering::Acquire) {
            return Ok(());
        }
        // Its probe task may have gone (its runtime shut down): start another.
        if !self.probing.load(Ordering::SeqCst) {
            self.start_probing();
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        let next = self.next_probe_ms.load(Ordering::Relaxed);
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "{} is failing (circuit open after {} failures in a row): not tried; the next probe in {} ms",
                self.what(),
                self.threshold,
                next.saturating_sub(self.now_ms())
            ),
        )
        .unsent())
    }

    /// Notes how an admitted call ended: `failed` for a failure of the connection.
    pub(crate) fn record(&self, failed: bool) {
        if !failed {
            if self.failures.load(Ordering::Relaxed) != 0 {
                self.failures.store(0, Ordering::Relaxed);
            }
            if self.open.load(Ordering::Acquire) {
                self.close("Redis answers again: circuit closed");
            }
            return;
        }
        if self.threshold == 0 {
            return;
        }
        let n = self.failures.fetch_add(1, Ordering::AcqRel).saturating_add(1);
        if n >= self.threshold
            && !self.open.load(Ordering::Acquire)
            && !self.open.swap(true, Ordering::SeqCst)
        {
            self.opened.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                node = self.node.as_deref(),
                failures = n,
                cool_down_ms = self.cool_down.as_millis() as u64,
                "Redis is failing: circuit open, calls fail fast (get-or-set loads uncached) until a probe succeeds"
            );
            self.start_probing();
        }
    }

    fn close(&self, why: &'static str) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open.swap(false, Ordering::SeqCst) {
            tracing::info!(node = self.node.as_deref(), "{why}");
        }
    }

    /// Starts the probe task unless one runs. Outside a Tokio runtime (never, in a
    /// store: a failure is seen after an await) the breaker stays open until a call
    /// admitted earlier succeeds.
    fn start_probing(&self) {
        self.next_probe_ms.store(
            self.now_ms().saturating_add(millis(self.cool_down)),
            Ordering::Relaxed,
        );
        if self.probing.swap(true, Ordering::SeqCst) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let task = Probing {
                    breaker: self.me.clone(),
                    holds_the_slot: true,
                };
                runtime.spawn(probe_while_open(task, Instant::now() + self.cool_down));
            }
            Err(_) => self.probing.store(false, Ordering::SeqCst),
        }
    }

    /// Whether the probe task goes on: while open. Leaving, it gives its slot up, and
    /// takes it back if the breaker opened again meanwhile and no other task took it
    /// (sequentially consistent with [`record`](Self::record)'s opening: of the two, one
    /// sees the other).
    fn keep_probing(&self) -> bool {
        if self.open.load(Ordering::SeqCst) {
            return true;
        }
        self.probing.store(false, Ordering::SeqCst);
        self.open.load(Ordering::SeqCst) && !self.probing.swap(true, Ordering::SeqCst)
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
        self.open.load(Ordering::Acquire)
    }

    /// How often it opened, and how many calls it refused at once.
    pub(crate) fn figures(&self) -> (u64, u64) {
        (
            self.opened.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A breaker's probe task, as it holds its breaker. Dropped while it holds the
/// breaker's probing slot (its runtime shut down, a probe panicked), it gives the slot
/// up, so the next refused call starts another task.
struct Probing {
    breaker: Weak<Breaker>,
    holds_the_slot: bool,
}

impl Drop for Probing {
    fn drop(&mut self) {
        if self.holds_the_slot
            && let Some(breaker) = self.breaker.upgrade()
        {
            breaker.probing.store(false, Ordering::SeqCst);
        }
    }
}

/// The probe task of one breaker: while it is open, one probe at `first`, then one a
/// cool-down after the last one ended; an answer closes it. Ends once the breaker is
/// closed or gone (its store dropped).
async fn probe_while_open(mut task: Probing, first: Instant) {
    let mut next = first;
    loop {
        tokio::time::sleep_until(next).await;
        let Some(breaker) = task.breaker.upgrade() else {
            return;
        };
        if !breaker.keep_probing() {
            task.holds_the_slot = false;
            return;
        }
        let found = (breaker.prober)(breaker.node.clone()).await;
        next = Instant::now() + breaker.cool_down;
        breaker.next_probe_ms.store(
            breaker.now_ms().saturating_add(millis(breaker.cool_down)),
            Ordering::Relaxed,
        );
        match found {
            Probed::Up => breaker.close("Redis answers again: circuit closed"),
            Probed::Gone => breaker.close("no longer a master: its circuit closed"),
            Probed::Down => tracing::debug!(node = breaker.node.as_deref(), "probe: Redis still failing"),
        }
        if !breaker.keep_probing() {
            task.holds_the_slot = false;
            return;
        }
    }
}

/// The breakers of one store: one for one server; on a cluster one per master (by
/// address), and one for keys whose master is not known yet (before the cluster first
/// told which node serves which slot).
pub(crate) struct Breakers {
    threshold: u32,
    cool_down: Duration,
    prober: Prober,
    /// One server's, or a cluster's for keys of a master not known yet.
    whole: Arc<Breaker>,
    /// A cluster's, per master address; one is made when its address is first met.
    nodes: parking_lot::RwLock<HashMap<Arc<str>, Arc<Breaker>>>,
}

impl Breakers {
    /// Breakers opening after `threshold` failures in a row, probing with `prober` once
    /// per `cool_down` while open.
    pub(crate) fn new(threshold: u32, cool_down: Duration, prober: Prober) -> Self {
        Breakers {
            threshold,
            cool_down,
            whole: Breaker::new(threshold, cool_down, None, prober.clone()),
            prober,
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
            .or_insert_with(|| Breaker::new(self.threshold, self.cool_down, Some(node), self.prober.clone()))
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
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
        || matches!(e.code(), Some("CLUSTERDOWN" | "LOADING" | "MASTERDOWN"))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use futures::FutureExt;

    use super::*;

    /// A server the tests' probes ask: its answer, and how often it was asked.
    #[derive(Default)]
    struct Server {
        answer: parking_lot::Mutex<Option<Probed>>,
        asked: AtomicUsize,
    }

    impl Server {
        fn answers(&self, probed: Probed) {
            *self.answer.lock() = Some(probed);
        }

        fn prober(self: &Arc<Self>) -> Prober {
            let server = self.clone();
            Arc::new(move |_node| {
                server.asked.fetch_add(1, Ordering::Relaxed);
                let probed = server.answer.lock().unwrap_or(Probed::Down);
                async move { probed }.boxed()
            })
        }

        fn asked(&self) -> usize {
            self.asked.load(Ordering::Relaxed)
        }
    }

    fn breaker(threshold: u32, server: &Arc<Server>) -> Arc<Breaker> {
        Breaker::new(threshold, Duration::from_secs(1), None, server.prober())
    }

    /// Lets the probe task run to its next sleep.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_breaker_of_an_address_no_longer_a_master_is_not_reported_open() {
        let breakers = Breakers::new(1, Duration::from_secs(3600), Arc::new(Server::default()).prober());
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
    async fn it_opens_after_the_threshold_and_a_background_probe_closes_it() {
        let server = Arc::new(Server::default());
        let b = breaker(3, &server);
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
        assert!(e.to_string().contains("the next probe in 1000 ms"), "{e}");
        tokio::time::advance(Duration::from_millis(999)).await;
        settle().await;
        assert_eq!(server.asked(), 0, "no probe before the cool-down");
        tokio::time::advance(Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(server.asked(), 1, "one probe after it");
        assert!(
            b.admit().is_err(),
            "no call goes through as a probe: all are refused"
        );
        tokio::time::advance(Duration::from_millis(1_000)).await;
        settle().await;
        assert_eq!(server.asked(), 2, "one probe per cool-down while down");
        server.answers(Probed::Up);
        tokio::time::advance(Duration::from_millis(1_000)).await;
        settle().await;
        assert!(!b.is_open(), "an answer closes it");
        b.admit().expect("closed");
        assert_eq!(b.figures(), (1, 2));
        tokio::time::advance(Duration::from_secs(10)).await;
        settle().await;
        assert_eq!(server.asked(), 3, "no probe while closed");
        for _ in 0..3 {
            b.record(true);
        }
        assert!(b.is_open(), "it opens again");
        tokio::time::advance(Duration::from_millis(1_000)).await;
        settle().await;
        assert_eq!(server.asked(), 4, "and probes again");
        assert!(!b.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_success_closes_it_and_its_probe_task_ends_or_serves_the_next_opening() {
        let server = Arc::new(Server::default());
        let b = breaker(1, &server);
        b.record(true);
        assert!(b.is_open());
        b.record(false);
        assert!(!b.is_open(), "a call admitted earlier answered");
        b.record(true);
        assert!(b.is_open(), "open again before the first task woke");
        tokio::time::advance(Duration::from_millis(1_000)).await;
        settle().await;
        assert_eq!(server.asked(), 1, "one task probes, not two");
        tokio::time::advance(Duration::from_millis(1_000)).await;
        settle().await;
        assert_eq!(server.asked(), 2);
    }

    #[test]
    fn a_probe_task_lost_with_its_runtime_is_started_again_by_the_next_refused_call() {
        let server = Arc::new(Server::default());
        let b = {
            let gone = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            gone.block_on(async {
                let b = breaker(1, &server);
                b.record(true);
                b
            })
        };
        assert!(b.is_open());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            server.answers(Probed::Up);
            assert!(b.admit().is_err(), "refused, and a new task started");
            tokio::time::advance(Duration::from_millis(1_000)).await;
            settle().await;
            assert!(!b.is_open(), "its probe closed it: {}", server.asked());
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_no_longer_a_master_is_closed_by_its_probe() {
        let server = Arc::new(Server::default());
        server.answers(Probed::Gone);
        let b = breaker(1, &server);
        b.record(true);
        tokio::time::advance(Duration::from_millis(1_000)).await;
        settle().await;
        assert!(!b.is_open());
        assert_eq!(server.asked(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_probe_task_ends_with_its_store() {
        let server = Arc::new(Server::default());
        let b = breaker(1, &server);
        b.record(true);
        drop(b);
        tokio::time::advance(Duration::from_millis(5_000)).await;
        settle().await;
        assert_eq!(server.asked(), 0);
        assert_eq!(Arc::strong_count(&server), 1, "the task and its prober are gone");
    }

    #[tokio::test(start_paused = true)]
    async fn a_nodes_failures_open_its_own_breaker_only_and_its_refusals_name_it() {
        let server = Arc::new(Server::default());
        let b = Breakers::new(3, Duration::from_secs(1), server.prober());
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
        let e = breaker(1, &server);
        e.record(true);
        assert!(
            e.admit()
                .unwrap_err()
                .to_string()
                .starts_with("store unavailable: Redis is failing")
        );
    }

    #[tokio::test]
    async fn a_threshold_of_zero_never_opens() {
        let b = breaker(0, &Arc::new(Server::default()));
        for _ in 0..100 {
            b.record(true);
        }
        assert!(b.admit().is_ok());
    }
}
