//! A loopback TCP proxy that sits between Corral and a `redis-server` and injects real
//! network faults: latency, a frozen network, half-open peers, resets, refused
//! connections, and killing only the pub/sub connections.
//!
//! The proxy runs on a thread of its own with a small current-thread tokio runtime, so it
//! works the same under any test runtime (or none) and never depends on the test's
//! runtime staying alive: dropping the [`FaultProxy`] stops the listener, closes every
//! connection and joins the thread.
//!
//! Every control method is synchronous and takes effect before it returns: a chunk read
//! after `blackhole(true)` or `half_open()` is never forwarded, and when `reset_all()` or
//! `drop_subscribers()` returns, the affected sockets are already closed.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use bytes::{Buf, Bytes};
use parking_lot::{Condvar, Mutex};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot, watch};

/// How much one read takes from a socket.
const CHUNK: usize = 16 * 1024;
/// How many bytes a direction may hold back (under latency) before the proxy stops
/// reading its source: the sender then feels TCP back-pressure, as on a slow link.
const MAX_QUEUED: usize = 4 * 1024 * 1024;
/// How long a connection to the upstream may take before the client is reset.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `reset_all` and `drop_*` wait for the connections they close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How many distinct command names a connection remembers.
const MAX_COMMANDS: usize = 64;

/// What the proxy knows about one live connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// The connection's number, in accept order from 0.
    pub id: u64,
    /// The distinct command names the client has sent, upper-cased, in first-seen
    /// order (at most 64). Sniffed from the RESP stream, so a `SUBSCRIBE` inside a key
    /// or a value does not count.
    pub commands: Vec<String>,
    /// Whether the client has sent `SUBSCRIBE`, `SSUBSCRIBE` or `PSUBSCRIBE`.
    pub subscriber: bool,
    /// Whether [`FaultProxy::half_open`] has cut it off.
    pub half_open: bool,
}

/// A loopback TCP proxy to one upstream address, with faults switchable at any time.
///
/// Faults and what they touch:
///
/// | method | existing connections | new connections |
/// |---|---|---|
/// | [`set_latency`](Self::set_latency) | chunks read from now on | yes |
/// | [`blackhole`](Self::blackhole) | yes | yes (accepted, then silent) |
/// | [`half_open`](Self::half_open) | yes, for good | no |
/// | [`reset_all`](Self::reset_all) | yes (RST) | no |
/// | [`refuse`](Self::refuse) | no | yes (accepted, then RST) |
/// | [`drop_subscribers`](Self::drop_subscribers) | subscribers only (RST) | no |
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("latency", &self.latency())
            .field("blackhole", &self.shared.blackhole.load(Ordering::SeqCst))
            .field("refuse", &self.shared.refuse.load(Ordering::SeqCst))
            .field("live_connections", &self.live_connections())
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy on a free port of 127.0.0.1 that forwards every connection to
    /// `upstream`, byte for byte, both ways. It is a plain pipe until a fault is set.
    pub fn start(upstream: SocketAddr) -> Result<FaultProxy> {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .context("binding the fault proxy's listener")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            latency_nanos: AtomicU64::new(0),
            blackhole: AtomicBool::new(false),
            refuse: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            closed: Condvar::new(),
            live: watch::Sender::new(0),
        });
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        // The runtime is built and dropped on the proxy's thread only: never inside the
        // caller's runtime, where dropping one panics.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{}", addr.port()))
            .spawn({
                let shared = shared.clone();
                move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(runtime) => runtime,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    runtime.block_on(async move {
                        let listener = match TcpListener::from_std(listener) {
                            Ok(listener) => listener,
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        };
                        let _ = ready_tx.send(Ok(()));
                        accept_loop(listener, shared, shutdown_rx).await;
                    });
                    // Dropping the runtime drops every connection task, and with them
                    // their sockets.
                    drop(runtime);
                }
            })
            .context("spawning the fault proxy's thread")?;
        let proxy = FaultProxy {
            addr,
            shared,
            shutdown: Some(shutdown_tx),
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(proxy),
            Ok(Err(e)) => Err(e).context("starting the fault proxy's runtime"),
            Err(_) => Err(anyhow!("the fault proxy's thread died while starting")),
        }
    }

    /// The address it listens on (127.0.0.1:port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `redis://127.0.0.1:PORT`, to hand to a client instead of the server's URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.addr.port())
    }

    /// The address every connection is forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Delays every chunk read from now on, in both directions, by `latency` (a round
    /// trip so takes at least twice as long). Chunks already in flight keep their delay.
    /// Order is kept; throughput is not limited.
    pub fn set_latency(&self, latency: Duration) {
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.shared.latency_nanos.store(nanos, Ordering::SeqCst);
    }

    /// The current latency.
    pub fn latency(&self) -> Duration {
        Duration::from_nanos(self.shared.latency_nanos.load(Ordering::SeqCst))
    }

    /// A frozen network, for existing and new connections alike: connections are
    /// accepted and kept open, but nothing is forwarded either way; bytes read meanwhile
    /// (and bytes held back by latency) are swallowed for good. A close by the client
    /// still closes its connection; a close by the server reaches the client only once
    /// the blackhole is lifted. `blackhole(false)` resumes forwarding.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.store(on, Ordering::SeqCst);
        self.shared.wake_all();
    }

    /// The peer silently gone: every existing connection stops forwarding for good, both
    /// ways, and is never closed by the proxy (a close by the server is not passed on),
    /// while new connections work normally. Bytes the client sends are read and
    /// swallowed, as if acknowledged by a peer that then vanished. [`heal`](Self::heal)
    /// does not revive these connections. Returns how many were cut off.
    pub fn half_open(&self) -> usize {
        let conns = self.shared.conns.lock();
        for conn in conns.values() {
            conn.frozen.store(true, Ordering::SeqCst);
            conn.wake.notify_one();
        }
        conns.len()
    }

    /// Closes every existing connection abruptly: the client gets an RST (`SO_LINGER`
    /// 0), the server a plain close. New connections work. Returns once they are closed,
    /// with how many there were.
    pub fn reset_all(&self) -> usize {
        self.drop_connections_matching(|_| true)
    }

    /// Refuses new connections while `on`: each is accepted and reset at once (the
    /// listener stays bound, so the port is never lost), so a client's connect may
    /// succeed but its first read or write fails. Existing connections are untouched.
    pub fn refuse(&self, on: bool) {
        self.shared.refuse.store(on, Ordering::SeqCst);
    }

    /// Resets (as [`reset_all`](Self::reset_all)) only the connections for which `which`
    /// is true. Returns once they are closed, with how many there were.
    pub fn drop_connections_matching(&self, which: impl Fn(&ConnInfo) -> bool) -> usize {
        let mut conns = self.shared.conns.lock();
        let mut ids = Vec::new();
        for conn in conns.values() {
            if which(&conn.info()) {
                conn.kill.store(true, Ordering::SeqCst);
                conn.wake.notify_one();
                ids.push(conn.id);
            }
        }
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        while ids.iter().any(|id| conns.contains_key(id)) {
            let timed_out = self.shared.closed.wait_until(&mut conns, deadline).timed_out();
            assert!(
                !timed_out || ids.iter().all(|id| !conns.contains_key(id)),
                "fault proxy: connections {ids:?} did not close within {CLOSE_TIMEOUT:?}"
            );
        }
        ids.len()
    }

    /// Resets only the connections that have sent `SUBSCRIBE`, `SSUBSCRIBE` or
    /// `PSUBSCRIBE` (sniffed from the client's RESP commands, case-insensitively), so a
    /// pub/sub connection dies while the command connection lives. Returns once they are
    /// closed, with how many there were.
    pub fn drop_subscribers(&self) -> usize {
        self.drop_connections_matching(|conn| conn.subscriber)
    }

    /// Back to a plain pipe: no latency, no blackhole, accepting. Connections cut off by
    /// [`half_open`](Self::half_open) stay cut off.
    pub fn heal(&self) {
        self.set_latency(Duration::ZERO);
        self.refuse(false);
        self.blackhole(false);
    }

    /// Connections accepted and forwarded so far (refused ones not counted).
    pub fn connections_accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections refused so far by [`refuse`](Self::refuse).
    pub fn connections_refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// Connections open now (including half-open and blackholed ones).
    pub fn live_connections(&self) -> usize {
        self.shared.conns.lock().len()
    }

    /// The live connections, in accept order.
    pub fn connections(&self) -> Vec<ConnInfo> {
        let mut infos: Vec<ConnInfo> = self.shared.conns.lock().values().map(|c| c.info()).collect();
        infos.sort_by_key(|info| info.id);
        infos
    }

    /// Waits until exactly `n` connections are live (say, for a client to have closed
    /// its connection), for at most `timeout`.
    pub async fn wait_live_connections(&self, n: usize, timeout: Duration) -> Result<()> {
        let mut live = self.shared.live.subscribe();
        match tokio::time::timeout(timeout, live.wait_for(|&count| count == n)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(anyhow!("fault proxy stopped")),
            Err(_) => Err(anyhow!(
                "fault proxy: {} live connections after {timeout:?}, not {n}",
                self.live_connections()
            )),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the handle and the proxy's thread share.
struct Shared {
    upstream: SocketAddr,
    latency_nanos: AtomicU64,
    blackhole: AtomicBool,
    refuse: AtomicBool,
    accepted: AtomicU64,
    refused: AtomicU64,
    next_id: AtomicU64,
    /// The live connections. A connection leaves only after its sockets are closed.
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    /// Signalled (with `conns`) whenever a connection leaves.
    closed: Condvar,
    /// The number of live connections, for async waiters.
    live: watch::Sender<usize>,
}

impl Shared {
    fn wake_all(&self) {
        for conn in self.conns.lock().values() {
            conn.wake.notify_one();
        }
    }

    fn register(self: &Arc<Self>) -> (Arc<Conn>, Registered) {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let conn = Arc::new(Conn {
            id,
            frozen: AtomicBool::new(false),
            kill: AtomicBool::new(false),
            wake: Notify::new(),
            seen: Mutex::new(Seen::default()),
        });
        let mut conns = self.conns.lock();
        conns.insert(id, conn.clone());
        self.live.send_replace(conns.len());
        drop(conns);
        let registered = Registered {
            shared: self.clone(),
            id,
        };
        (conn, registered)
    }

    fn latency(&self) -> Duration {
        Duration::from_nanos(self.latency_nanos.load(Ordering::SeqCst))
    }
}

/// Removes its connection from the registry when dropped, which is after the
/// connection's sockets are closed (or when the runtime drops the task at shutdown).
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut conns = self.shared.conns.lock();
        conns.remove(&self.id);
        self.shared.live.send_replace(conns.len());
        self.shared.closed.notify_all();
    }
}

/// One connection's switches and what was sniffed from it.
struct Conn {
    id: u64,
    /// Cut off by `half_open`: never forwards again.
    frozen: AtomicBool,
    /// To be reset by `reset_all` or `drop_*`.
    kill: AtomicBool,
    /// Wakes the connection's task after a switch changed.
    wake: Notify,
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    commands: Vec<String>,
    subscriber: bool,
}

impl Conn {
    fn info(&self) -> ConnInfo {
        let seen = self.seen.lock();
        ConnInfo {
            id: self.id,
            commands: seen.commands.clone(),
            subscriber: seen.subscriber,
            half_open: self.frozen.load(Ordering::SeqCst),
        }
    }

    fn record(&self, name: &[u8]) {
        let name = String::from_utf8_lossy(name).to_ascii_uppercase();
        let mut seen = self.seen.lock();
        if matches!(name.as_str(), "SUBSCRIBE" | "SSUBSCRIBE" | "PSUBSCRIBE") {
            seen.subscriber = true;
        }
        if seen.commands.len() < MAX_COMMANDS && !seen.commands.contains(&name) {
            seen.commands.push(name);
        }
    }

    fn held(&self, shared: &Shared) -> bool {
        self.frozen.load(Ordering::SeqCst) || shared.blackhole.load(Ordering::SeqCst)
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut shutdown: oneshot::Receiver<()>) {
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let client = match accepted {
            Ok((client, _)) => client,
            Err(_) => {
                // Out of descriptors or a connection aborted before accept: back off a
                // little rather than spin.
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        if shared.refuse.load(Ordering::SeqCst) {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            abort(client);
            continue;
        }
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let (conn, registered) = shared.register();
        tokio::spawn(serve(client, shared.clone(), conn, registered));
    }
}

/// Closes `stream` with an RST rather than a FIN.
fn abort(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn serve(mut client: TcpStream, shared: Arc<Shared>, conn: Arc<Conn>, registered: Registered) {
    let _ = client.set_nodelay(true);
    let connect = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(shared.upstream));
    tokio::pin!(connect);
    let connected = loop {
        if conn.kill.load(Ordering::SeqCst) {
            break None;
        }
        tokio::select! {
            connected = &mut connect => break connected.ok().and_then(Result::ok),
            () = conn.wake.notified() => {}
        }
    };
    let Some(mut upstream) = connected else {
        abort(client);
        drop(registered);
        return;
    };
    let _ = upstream.set_nodelay(true);
    let outcome = pump(&mut client, &mut upstream, &shared, &conn).await;
    match outcome {
        Outcome::Close => drop(client),
        Outcome::Reset => abort(client),
    }
    drop(upstream);
    // Only now, with both sockets closed, does the connection leave the registry.
    drop(registered);
}

/// How a connection ends, for the client's side.
enum Outcome {
    /// A plain close (FIN).
    Close,
    /// An abortive close (RST).
    Reset,
}

/// One direction of a connection.
#[derive(Default)]
struct Direction {
    /// Chunks read and not yet written, each with when it may be written.
    queue: VecDeque<(Instant, Bytes)>,
    queued: usize,
    /// The source has closed its side.
    eof: bool,
    /// The close has been passed on (the destination's write side is shut down).
    shut: bool,
}

impl Direction {
    fn push(&mut self, due: Instant, bytes: Bytes) {
        self.queued += bytes.len();
        self.queue.push_back((due, bytes));
    }

    fn clear(&mut self) {
        self.queue.clear();
        self.queued = 0;
    }

    fn front(&self) -> Option<(Instant, Bytes)> {
        self.queue.front().cloned()
    }

    fn advance(&mut self, n: usize) {
        if let Some((_, front)) = self.queue.front_mut() {
            front.advance(n);
            self.queued -= n;
            if front.is_empty() {
                self.queue.pop_front();
            }
        }
    }

    /// Whether it may read more from its source.
    fn reading(&self) -> bool {
        !self.eof && self.queued < MAX_QUEUED
    }
}

/// Forwards both directions until both are closed, a socket fails, or the connection is
/// killed.
async fn pump(client: &mut TcpStream, upstream: &mut TcpStream, shared: &Shared, conn: &Conn) -> Outcome {
    let (mut client_rx, mut client_tx) = client.split();
    let (mut upstream_rx, mut upstream_tx) = upstream.split();
    let mut up = Direction::default(); // client -> upstream
    let mut down = Direction::default(); // upstream -> client
    let mut client_buf = vec![0u8; CHUNK];
    let mut upstream_buf = vec![0u8; CHUNK];
    let mut sniffer = Sniffer::default();
    loop {
        if conn.kill.load(Ordering::SeqCst) {
            return Outcome::Reset;
        }
        let held = conn.held(shared);
        if held {
            up.clear();
            down.clear();
        } else {
            if up.eof && up.queue.is_empty() && !up.shut {
                let _ = upstream_tx.shutdown().await;
                up.shut = true;
            }
            if down.eof && down.queue.is_empty() && !down.shut {
                let _ = client_tx.shutdown().await;
                down.shut = true;
            }
            if up.shut && down.shut {
                return Outcome::Close;
            }
        }
        let up_front = if held { None } else { up.front() };
        let down_front = if held { None } else { down.front() };
        let (up_writing, down_writing) = (up_front.is_some(), down_front.is_some());
        tokio::select! {
            () = conn.wake.notified() => {}
            read = client_rx.read(&mut client_buf), if up.reading() => match read {
                Ok(0) | Err(_) if conn.held(shared) => {
                    // The client left a frozen connection: nothing is left to keep open.
                    return Outcome::Close;
                }
                Ok(0) => up.eof = true,
                Ok(n) => {
                    sniffer.feed(&client_buf[..n], |name| conn.record(name));
                    if !conn.held(shared) {
                        up.push(due(shared), Bytes::copy_from_slice(&client_buf[..n]));
                    }
                }
                Err(_) => return Outcome::Close,
            },
            read = upstream_rx.read(&mut upstream_buf), if down.reading() => match read {
                Ok(0) => down.eof = true,
                Ok(n) => {
                    if !conn.held(shared) {
                        down.push(due(shared), Bytes::copy_from_slice(&upstream_buf[..n]));
                    }
                }
                // A frozen connection keeps its client however the server goes.
                Err(_) if conn.held(shared) => down.eof = true,
                // The server's reset reaches the client as a reset.
                Err(_) => return Outcome::Reset,
            },
            sent = send(&mut upstream_tx, up_front, shared, conn), if up_writing => match sent {
                Ok(Some(n)) => up.advance(n),
                Ok(None) => {}
                Err(_) => return Outcome::Reset,
            },
            sent = send(&mut client_tx, down_front, shared, conn), if down_writing => match sent {
                Ok(Some(n)) => down.advance(n),
                Ok(None) => {}
                Err(_) => return Outcome::Close,
            },
        }
    }
}

/// When a chunk read now may be written.
fn due(shared: &Shared) -> Instant {
    Instant::now() + shared.latency()
}

/// Writes (part of) `front` once it is due, unless the connection is held by then.
/// Cancel-safe: a write either happened and is reported, or did not happen.
async fn send<W: AsyncWrite + Unpin>(
    tx: &mut W,
    front: Option<(Instant, Bytes)>,
    shared: &Shared,
    conn: &Conn,
) -> io::Result<Option<usize>> {
    let Some((due, bytes)) = front else {
        return std::future::pending().await;
    };
    if due > Instant::now() {
        tokio::time::sleep_until(due.into()).await;
    }
    if conn.held(shared) {
        return Ok(None);
    }
    match tx.write(&bytes).await? {
        0 => Err(io::ErrorKind::WriteZero.into()),
        n => Ok(Some(n)),
    }
}

/// How many bytes of a command name the sniffer keeps.
const NAME_MAX: usize = 32;
/// How long a RESP header line may be before the sniffer gives up on the stream.
const LINE_MAX: usize = 32;

/// Follows the client's RESP stream (arrays of bulk strings, or inline commands) across
/// chunk boundaries and reports each command's name. On anything else it stops
/// reporting rather than guess.
#[derive(Debug, Default)]
struct Sniffer {
    state: SniffState,
    /// The header line read so far.
    line: Vec<u8>,
    /// The command name read so far.
    name: Vec<u8>,
    /// Inline: still inside the first word.
    in_name: bool,
    /// Bulk strings left in the current array.
    elems_left: u64,
    /// The current bulk string is the command's name.
    naming: bool,
    /// Bytes of the current bulk string (payload and CRLF) still to come.
    data_left: u64,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum SniffState {
    #[default]
    Begin,
    ArrayHeader,
    BulkHeader,
    BulkData,
    Inline,
    Lost,
}

fn parse_len(digits: &[u8]) -> Option<i64> {
    std::str::from_utf8(digits).ok()?.parse().ok()
}

impl Sniffer {
    fn feed(&mut self, mut bytes: &[u8], mut on_command: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            match self.state {
                SniffState::Lost => return,
                SniffState::BulkData => {
                    let take = usize::try_from(self.data_left)
                        .unwrap_or(usize::MAX)
                        .min(bytes.len());
                    if self.naming {
                        let payload_left =
                            usize::try_from(self.data_left.saturating_sub(2)).unwrap_or(usize::MAX);
                        let part = &bytes[..take.min(payload_left)];
                        let room = NAME_MAX.saturating_sub(self.name.len());
                        self.name.extend_from_slice(&part[..part.len().min(room)]);
                    }
                    self.data_left -= take as u64;
                    bytes = &bytes[take..];
                    if self.data_left == 0 {
                        if self.naming {
                            on_command(&self.name);
                            self.naming = false;
                        }
                        self.element_done();
                    }
                }
                SniffState::Begin => {
                    let b = bytes[0];
                    bytes = &bytes[1..];
                    match b {
                        b'*' => {
                            self.line.clear();
                            self.state = SniffState::ArrayHeader;
                        }
                        b'\r' | b'\n' | b' ' | b'\t' => {}
                        _ => {
                            self.name.clear();
                            self.name.push(b);
                            self.in_name = true;
                            self.state = SniffState::Inline;
                        }
                    }
                }
                SniffState::Inline => {
                    let b = bytes[0];
                    bytes = &bytes[1..];
                    let blank = matches!(b, b' ' | b'\t' | b'\r' | b'\n');
                    if self.in_name && blank {
                        on_command(&self.name);
                        self.in_name = false;
                    } else if self.in_name && self.name.len() < NAME_MAX {
                        self.name.push(b);
                    }
                    if b == b'\n' {
                        self.state = SniffState::Begin;
                    }
                }
                SniffState::ArrayHeader | SniffState::BulkHeader => {
                    let b = bytes[0];
                    bytes = &bytes[1..];
                    if b != b'\n' {
                        if self.line.len() >= LINE_MAX {
                            self.state = SniffState::Lost;
                        } else {
                            self.line.push(b);
                        }
                        continue;
                    }
                    let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
                    if self.state == SniffState::ArrayHeader {
                        match parse_len(line) {
                            Some(n) if n > 0 => {
                                self.elems_left = n as u64;
                                self.naming = true;
                                self.line.clear();
                                self.state = SniffState::BulkHeader;
                            }
                            Some(_) => self.state = SniffState::Begin,
                            None => self.state = SniffState::Lost,
                        }
                    } else {
                        match line
                            .split_first()
                            .and_then(|(&kind, digits)| (kind == b'$').then(|| parse_len(digits)).flatten())
                        {
                            Some(len) if len >= 0 => {
                                self.data_left = len as u64 + 2;
                                self.name.clear();
                                self.state = SniffState::BulkData;
                            }
                            Some(_) => {
                                // A null bulk string: no payload.
                                self.naming = false;
                                self.element_done();
                            }
                            None => self.state = SniffState::Lost,
                        }
                    }
                }
            }
        }
    }

    fn element_done(&mut self) {
        self.elems_left -= 1;
        self.line.clear();
        self.state = if self.elems_left == 0 {
            SniffState::Begin
        } else {
            SniffState::BulkHeader
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commands(stream: &[u8], split: usize) -> Vec<String> {
        let mut sniffer = Sniffer::default();
        let mut names = Vec::new();
        let (a, b) = stream.split_at(split);
        for part in [a, b] {
            sniffer.feed(part, |name| {
                names.push(String::from_utf8_lossy(name).into_owned())
            });
        }
        names
    }

    #[test]
    fn the_sniffer_names_commands_across_every_split() {
        let stream: &[u8] = b"*1\r\n$4\r\nPING\r\n\
            *3\r\n$3\r\nSET\r\n$9\r\nSUBSCRIBE\r\n$11\r\nssubscribe!\r\n\
            *2\r\n$9\r\nsubscribe\r\n$4\r\nchan\r\n\
            PING inline\r\n\
            *2\r\n$3\r\nGET\r\n$-1\r\n\
            *1\r\n$10\r\nSSUBSCRIBE\r\n";
        let want = ["PING", "SET", "subscribe", "PING", "GET", "SSUBSCRIBE"];
        for split in 0..=stream.len() {
            assert_eq!(commands(stream, split), want, "split at {split}");
        }
    }

    #[test]
    fn the_sniffer_stops_on_what_it_does_not_know() {
        assert_eq!(
            commands(b"*1\r\n:4\r\n*1\r\n$4\r\nPING\r\n", 0),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_proxy_connection_records_subscribers() {
        let conn = Conn {
            id: 0,
            frozen: AtomicBool::new(false),
            kill: AtomicBool::new(false),
            wake: Notify::new(),
            seen: Mutex::new(Seen::default()),
        };
        conn.record(b"ping");
        conn.record(b"PING");
        assert!(!conn.info().subscriber);
        conn.record(b"sSubscribe");
        let info = conn.info();
        assert!(info.subscriber);
        assert_eq!(info.commands, ["PING", "SSUBSCRIBE"]);
    }
}
