//! A real Redis Cluster on loopback: `redis-server --cluster-enabled yes` nodes joined
//! with `redis-cli --cluster create`, masters and replicas, stopped again on drop.
//!
//! [`RedisCluster::shared`] is one cluster for a whole test binary (tenants kept apart by
//! prefix, as in production): started from a thread that lives as long as the process,
//! so its servers die with it ([`RedisServer`] sets `PR_SET_PDEATHSIG`). A test that
//! kills nodes starts its own with [`RedisCluster::start`].

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::RedisServer;

/// How long a node of the shared cluster may be unreachable before its replica takes
/// over: long, so that a loaded machine never fails one over by mistake.
pub const SHARED_NODE_TIMEOUT: Duration = Duration::from_secs(5);

/// A Redis Cluster this process started. Dropping it stops every node.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    dir: PathBuf,
}

/// A port whose cluster bus port (`port + 10000`) is free too.
fn cluster_port() -> Result<u16> {
    for _ in 0..200 {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        if port > 55_000 {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    bail!("found no port pair (p, p + 10000) free for a cluster node")
}

fn sync_conn(port: u16) -> Result<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    Ok(client.get_connection_with_timeout(Duration::from_secs(2))?)
}

/// `INFO <section>` or `CLUSTER INFO` of the node on `port`, as text.
fn info(port: u16, cmd: &[&str]) -> Result<String> {
    let mut conn = sync_conn(port)?;
    let mut c = redis::cmd(cmd[0]);
    for a in &cmd[1..] {
        c.arg(*a);
    }
    Ok(c.query(&mut conn)?)
}

fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
        .map(str::trim)
}

/// Removes the node directories of clusters whose test process is gone (a shared
/// cluster's outlive it: its servers die with the process, its files do not).
fn remove_stale_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("corral-cluster-")) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or_default();
        if !pid.is_empty() && !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each (a node unreachable for
    /// `node_timeout` is failed over), joins them, and waits until every node reports
    /// the cluster ok and every replica is in sync.
    pub fn start(masters: usize, replicas: usize, node_timeout: Duration) -> Result<Self> {
        remove_stale_dirs();
        let dir = std::env::temp_dir().join(format!(
            "corral-cluster-{}-{}",
            std::process::id(),
            cluster_port()?
        ));
        std::fs::create_dir_all(&dir)?;
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            let mut last = None;
            for _ in 0..5 {
                let port = cluster_port()?;
                let extra: Vec<String> = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &dir.join(format!("nodes-{port}.conf")).display().to_string(),
                    "--cluster-node-timeout",
                    &node_timeout.as_millis().to_string(),
                    "--dir",
                    &dir.display().to_string(),
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                match RedisServer::start_with(port, &extra) {
                    Ok(node) => {
                        last = None;
                        nodes.push(node);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            if let Some(e) = last {
                return Err(e);
            }
        }
        let cluster = RedisCluster { nodes, dir };
        let addrs: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .context("running `redis-cli --cluster create` (install redis-tools)")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        cluster.wait_ok(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// One cluster (3 masters, 1 replica each) for this whole test binary.
    pub fn shared() -> Result<Vec<String>> {
        static SHARED: OnceLock<std::result::Result<Vec<String>, String>> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || match RedisCluster::start(3, 1, SHARED_NODE_TIMEOUT) {
                    Ok(cluster) => {
                        let _ = tx.send(Ok(cluster.urls()));
                        // Lives as long as the process; its servers die with this thread.
                        loop {
                            std::thread::park();
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(format!("{e:#}")));
                    }
                });
                rx.recv().unwrap_or_else(|e| Err(e.to_string()))
            })
            .clone()
            .map_err(|e| anyhow::anyhow!("the shared cluster did not start: {e}"))
    }

    /// `redis://127.0.0.1:PORT` of every node still running.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.pid().is_some())
            .map(RedisServer::url)
            .collect()
    }

    /// Waits until every running node says `cluster_state:ok`, knows every slot, and
    /// every replica's link to its master is up.
    pub fn wait_ok(&self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let ready = self.nodes.iter().filter(|n| n.pid().is_some()).all(|n| {
                let Ok(ci) = info(n.port(), &["CLUSTER", "INFO"]) else {
                    return false;
                };
                let Ok(repl) = info(n.port(), &["INFO", "replication"]) else {
                    return false;
                };
                field(&ci, "cluster_state") == Some("ok")
                    && field(&ci, "cluster_slots_ok") == Some("16384")
                    && (field(&repl, "role") == Some("master")
                        || field(&repl, "master_link_status") == Some("up"))
            });
            if ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the cluster was not ok within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The index of the node that is master of `name`'s slot now.
    pub fn master_of(&self, name: &str) -> Result<usize> {
        let any = self
            .nodes
            .iter()
            .find(|n| n.pid().is_some())
            .context("no node running")?;
        let mut conn = sync_conn(any.port())?;
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(name).query(&mut conn)?;
        let slots: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query(&mut conn)
            .context("CLUSTER SLOTS")?;
        let int = |v: &redis::Value| match v {
            redis::Value::Int(i) => Some(*i),
            _ => None,
        };
        for range in slots {
            let (Some(from), Some(to)) = (range.first().and_then(int), range.get(1).and_then(int)) else {
                bail!("unexpected CLUSTER SLOTS entry: {range:?}");
            };
            if !(from..=to).contains(&slot) {
                continue;
            }
            let port = match range.get(2) {
                Some(redis::Value::Array(master)) => master.get(1).and_then(int),
                _ => None,
            }
            .with_context(|| format!("unexpected CLUSTER SLOTS entry: {range:?}"))?;
            return self
                .nodes
                .iter()
                .position(|n| n.port() == port as u16)
                .context("the master is not one of ours");
        }
        bail!("slot {slot} is not served")
    }

    /// The node at `index`.
    pub fn node(&mut self, index: usize) -> &mut RedisServer {
        &mut self.nodes[index]
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
