//! The harness of Corral's integration tests: real `redis-server` processes on free
//! loopback ports, and fixtures that build a cache over each backend with a manual clock.
//!
//! Redis tests are never skipped: without `redis-server` they fail, saying how to
//! install it. `REDIS_SERVER_BIN` picks another binary.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use corral::{Corral, ManualClock};

pub mod cluster;
pub mod proxy;
pub mod usage;
pub mod wire;

pub use cluster::RedisCluster;
pub use proxy::{ConnInfo, FaultProxy};

/// A `redis-server` this process started, on a free loopback port. Dropping it stops it.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    /// The arguments it was started with beyond the defaults (kept for a restart).
    extra: Vec<String>,
}

/// Makes the process `cmd` starts die with the thread that starts it: a server of a
/// cluster shared by a whole test binary (started from a thread that lives as long as
/// the process) is never left behind when the binary exits.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // prctl, getppid and _exit, which are async-signal-safe and touch no memory of the
    // parent's.
    let parent = std::process::id();
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The parent may have died between the fork and the prctl: then no signal
            // will ever come, so go now.
            if libc::getppid() != parent as libc::pid_t {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// A free loopback port (it may be taken again before the caller binds it).
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a probe socket")?;
    Ok(listener.local_addr()?.port())
}

fn server_bin() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into())
}

impl RedisServer {
    /// Starts a server on a free port and waits until it accepts connections.
    pub fn start() -> Result<Self> {
        // A port can be taken between the probe and the bind: try a few.
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            match Self::start_on(port) {
                Ok(server) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried at least once"))
    }

    /// Starts a server on `port` and waits until it is ready.
    pub fn start_on(port: u16) -> Result<Self> {
        Self::start_with(port, &[])
    }

    /// Starts a server on `port` with `extra` arguments (a cluster node's, say) and
    /// waits until it is ready.
    pub fn start_with(port: u16, extra: &[String]) -> Result<Self> {
        let bin = server_bin();
        let mut cmd = Command::new(&bin);
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--loglevel", "notice", "--protected-mode", "no"])
        .args(extra);
        die_with_parent(&mut cmd);
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                format!("starting `{bin}` failed: install it with `apt-get install redis-server` (or set REDIS_SERVER_BIN)")
            })?;
        // Wait for the server's own word that it is ready, not for a guessed delay.
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut ready = false;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !ready && line.contains("Ready to accept connections") {
                    ready = true;
                    let _ = tx.send(Ok(()));
                } else if !ready && (line.contains("Address already in use") || line.contains("# Failed")) {
                    let _ = tx.send(Err(line));
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(RedisServer {
                port,
                child: Some(child),
                extra: extra.to_vec(),
            }),
            Ok(Err(line)) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("redis-server on port {port} failed: {line}")
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("redis-server on port {port} did not become ready within 10 s")
            }
        }
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// `127.0.0.1:PORT`, say for a [`FaultProxy`] in front of it.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// Kills the server (SIGKILL) and waits for it to die.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let fresh = Self::start_with(self.port, &self.extra)?;
        *self = fresh;
        Ok(())
    }

    fn signal(&self, sig: &str) -> Result<()> {
        let pid = self.child.as_ref().context("server is not running")?.id();
        let status = Command::new("kill").args([sig, &pid.to_string()]).status()?;
        anyhow::ensure!(status.success(), "kill {sig} {pid} failed");
        Ok(())
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) -> Result<()> {
        self.signal("-STOP")
    }

    /// Unfreezes a paused server (SIGCONT).
    pub fn resume(&self) -> Result<()> {
        self.signal("-CONT")
    }

    /// Another process's `clear` of `prefix`, written but never announced (its process
    /// died between the write and the publish): the prefix's generation counter moves
    /// past both what it held and `at_least` (a clock's now, in Unix ms).
    pub async fn clear_unannounced(&self, prefix: &str, at_least: u64) -> Result<()> {
        let generation = format!("{{{}:{prefix}}}:g", prefix.len());
        let mut conn = self.connection().await?;
        let known: Option<u64> = redis::cmd("GET").arg(&generation).query_async(&mut conn).await?;
        let () = redis::cmd("SET")
            .arg(&generation)
            .arg(known.unwrap_or(0).max(at_least) + 1)
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// How many cache entries the server holds: names of an entry's kind (`…}:e`), of any
    /// prefix and generation.
    pub async fn entries_held(&self) -> Result<usize> {
        use corral_core::names::{Kind, kind_of};
        let mut conn = self.connection().await?;
        let names: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await?;
        Ok(names.iter().filter(|n| kind_of(n) == Some(Kind::Entry)).count())
    }

    /// A plain async connection, for planting and checking raw data.
    pub async fn connection(&self) -> Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.url())?;
        Ok(client.get_multiplexed_async_connection().await?)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Until `b`'s writes are heard by `a`: a changed value `b` wrote is read by `a` after
/// the old one was in its L1 (announcements come in order: whatever `b` wrote before is
/// heard by then too). `round` tells one wait's values from another's.
pub async fn until_a_hears_b(a: &Corral, b: &Corral, round: &str) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        b.set("probe", format!("{round}-p"), corral::EntryOptions::new())
            .await?;
        a.get("probe").await?;
        b.set("probe", format!("{round}-q"), corral::EntryOptions::new())
            .await?;
        if a.get("probe").await?.as_deref() == Some(format!("{round}-q").as_bytes()) {
            return Ok(());
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "a never heard b");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Tests whose assertions involve real time (a 300 ms lease renewed every 100 ms, a
/// wake-up before a 1 s safety timer, four processes racing) take this first, so that
/// they never starve each other of the machine's two cores. Hold it for the whole test.
pub async fn real_time() -> tokio::sync::MutexGuard<'static, ()> {
    static REAL_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    REAL_TIME.lock().await
}

/// The `corral` binary of this build (`cargo test` builds it beside the test binaries).
pub fn corral_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary has a path");
    // target/<profile>/deps/all-<hash> -> target/<profile>/corral
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .join("corral");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p corral-cli`",
        bin.display()
    );
    bin
}

/// Runs `processes` `corral stampede ARGS --json --wait-for-go` processes started at
/// one barrier (each says "ready" once connected, then all are told to go: no sleep),
/// and returns their JSON reports, each checked to have succeeded.
pub fn stampedes_at_a_barrier(processes: usize, args: &[&str]) -> Result<Vec<serde_json::Value>> {
    use std::io::Write;
    let mut children = Vec::with_capacity(processes);
    for _ in 0..processes {
        let child = Command::new(corral_bin())
            .arg("stampede")
            .args(args)
            .args(["--json", "--wait-for-go"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning corral stampede")?;
        children.push(child);
    }
    for child in &mut children {
        let mut line = String::new();
        BufReader::new(child.stderr.as_mut().context("piped")?).read_line(&mut line)?;
        anyhow::ensure!(line.trim() == "ready", "a stampede said {line:?}, not ready");
    }
    for child in &mut children {
        writeln!(child.stdin.as_mut().context("piped")?, "go")?;
    }
    let mut reports = Vec::with_capacity(processes);
    for child in children {
        let out = child.wait_with_output()?;
        anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        reports.push(serde_json::from_slice(&out.stdout).context("one JSON object on stdout")?);
    }
    Ok(reports)
}

/// Server-side command count (`INFO stats` total_commands_processed).
pub async fn commands_processed(server: &RedisServer) -> Result<u64> {
    let mut conn = server.connection().await?;
    let info: String = redis::cmd("INFO").arg("stats").query_async(&mut conn).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .context("no total_commands_processed in INFO")?
        .trim()
        .parse()
        .context("total_commands_processed is a number")
}

/// How many times the server ran `command` so far (`INFO commandstats`; commands run
/// by scripts included); 0 before its first call.
pub async fn command_calls(server: &RedisServer, command: &str) -> Result<u64> {
    let mut conn = server.connection().await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    calls_in(&info, command)
}

/// How many times `command` ran, as `info` (the text of `INFO commandstats`) says; 0
/// when it names none.
pub fn calls_in(info: &str, command: &str) -> Result<u64> {
    let prefix = format!("cmdstat_{command}:calls=");
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .map_or(Ok(0), str::parse)?)
}

/// Which L2 backend a fixture runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The embedded in-memory L2.
    Memory,
    /// A real redis-server started for the fixture.
    Redis,
    /// The test binary's shared Redis Cluster (3 masters, 3 replicas), under a prefix
    /// of the fixture's own.
    Cluster,
}

/// The prefix fixtures store Redis keys under.
pub const PREFIX: &str = "test:";

/// A cache over one backend with a manual clock, and what it runs on.
#[derive(Debug)]
pub struct Fixture {
    /// The cache under test.
    pub cache: Corral,
    /// The clock every decision reads.
    pub clock: ManualClock,
    /// The server, for the Redis backend.
    pub redis: Option<RedisServer>,
}

impl Fixture {
    /// A fixture on `backend` with default settings.
    pub fn new(backend: Backend) -> Result<Self> {
        Self::with(backend, |b| b)
    }

    /// A fixture on `backend`, the builder adjusted by `configure`.
    pub fn with(
        backend: Backend,
        configure: impl FnOnce(corral::CorralBuilder) -> corral::CorralBuilder,
    ) -> Result<Self> {
        let clock = ManualClock::starting_now();
        let builder = Corral::builder().clock(clock.clone());
        let (builder, redis) = match backend {
            Backend::Memory => (builder, None),
            Backend::Redis => {
                let server = RedisServer::start()?;
                let mut options = corral::RedisOptions::new(server.url());
                options.prefix = PREFIX.into();
                (builder.redis_options(options), Some(server))
            }
            Backend::Cluster => {
                static TENANTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let tenant = TENANTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut options = corral::RedisOptions::cluster(RedisCluster::shared()?);
                options.prefix = format!("{PREFIX}{tenant}:");
                (builder.redis_options(options), None)
            }
        };
        let cache = configure(builder).build()?;
        Ok(Fixture { cache, clock, redis })
    }

    /// The name `key`'s entry has in the store, valid key or not (contract §2.4).
    pub fn name(&self, key: &str) -> String {
        corral_core::names::name(self.cache.prefix(), key, corral_core::names::Kind::Entry)
    }

    /// Writes raw bytes under `key`, bypassing the cache's encoding: straight into Redis
    /// for the Redis backends.
    pub async fn plant(&self, key: &str, bytes: &[u8]) -> Result<()> {
        match self.cache.redis_store() {
            Some(store) => {
                redis::cmd("SET")
                    .arg(self.name(key))
                    .arg(bytes)
                    .query_async::<()>(&mut store.connection())
                    .await?;
            }
            None => {
                self.cache
                    .entries()
                    .set(&self.name(key), bytes.to_vec().into(), 60_000)
                    .await?
            }
        }
        Ok(())
    }

    /// A raw connection to the fixture's Redis or cluster (through the cache's own link).
    pub fn raw(&self) -> Option<corral::store::link::Link> {
        self.cache
            .redis_store()
            .map(corral::store::redis::RedisStore::connection)
    }

    /// Whether the store still holds an entry under `key`, expired or not (a removal's
    /// tombstone is no entry: contract §5.12).
    pub async fn stored(&self, key: &str) -> Result<bool> {
        let held: Option<Vec<u8>> = match self.raw() {
            Some(mut conn) => {
                redis::cmd("GET")
                    .arg(self.name(key))
                    .query_async(&mut conn)
                    .await?
            }
            None => self
                .cache
                .entries()
                .get(&self.name(key))
                .await?
                .map(|b| b.to_vec()),
        };
        Ok(held.is_some_and(|b| !corral_core::envelope::is_tombstone(&b, b.len() as u64)))
    }
}
