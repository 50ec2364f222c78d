//! What the tests of the `corral` binary share: running it, waiting for it (always
//! with a deadline), temporary folders, a Redis to talk to, and process-group checks.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::{Pid, getpgid};

/// How long anything may take before a test gives up on it: a bound, never a wait.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// How long a pipe may stay open after its process exited.
const PIPE_GRACE: Duration = Duration::from_secs(5);

/// The `corral` binary, with no Redis or log setting inherited from the environment.
pub fn corral(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_corral"));
    command
        .args(args)
        .env_remove("CORRAL_REDIS")
        .env_remove("CORRAL_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Runs `corral args` to the end, `stdin` on its standard input.
pub fn run(args: &[&str], stdin: Option<&str>) -> Output {
    run_command(corral(args), stdin)
}

/// Runs `command` to the end, `stdin` on its standard input.
pub fn run_command(mut command: Command, stdin: Option<&str>) -> Output {
    let mut child = command.stdin(Stdio::piped()).spawn().expect("corral starts");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    let running = Running(Some(child));
    running.finish()
}

/// Text of a process's output.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A `corral` process in the background; killed if the test ends before it does.
#[derive(Debug)]
pub struct Running(Option<Child>);

impl Running {
    pub fn spawn(args: &[&str]) -> Self {
        Running(Some(corral(args).spawn().expect("corral starts")))
    }

    /// Starts `corral args` with `env` added.
    pub fn spawn_with(args: &[&str], env: &[(&str, &str)]) -> Self {
        Running(Some(
            corral(args)
                .envs(env.iter().copied())
                .spawn()
                .expect("corral starts"),
        ))
    }

    /// Reads its stderr until a line contains `needle` (the rest is thrown away).
    pub fn wait_for_stderr(&mut self, needle: &str) {
        let stderr = self
            .0
            .as_mut()
            .expect("running")
            .stderr
            .take()
            .expect("stderr piped");
        let mut lines = BufReader::new(stderr).lines();
        let found = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|line| line.contains(needle));
        assert!(found, "corral ended without saying {needle:?}");
        std::thread::spawn(move || lines.for_each(drop));
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.0.as_ref().expect("running").id() as i32)
    }

    pub fn signal(&self, signal: Signal) {
        kill(self.pid(), signal).expect("corral is there to be signalled");
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        self.0
            .as_mut()
            .expect("running")
            .try_wait()
            .expect("try_wait")
            .is_none()
    }

    /// Waits (at most [`DEADLINE`]) for it to exit, and collects what it printed.
    pub fn finish(mut self) -> Output {
        let mut child = self.0.take().expect("running");
        // Drain the pipes on threads so that a chatty process never blocks on them.
        let stdout = child.stdout.take().map(Drain::start);
        let stderr = child.stderr.take().map(Drain::start);
        let status = wait_with_deadline(&mut child);
        Output {
            status,
            stdout: stdout.map(Drain::finish).unwrap_or_default(),
            stderr: stderr.map(Drain::finish).unwrap_or_default(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A pipe read to its end on a thread.
struct Drain {
    bytes: Arc<Mutex<Vec<u8>>>,
    thread: std::thread::JoinHandle<()>,
}

impl Drain {
    fn start(mut pipe: impl std::io::Read + Send + 'static) -> Self {
        let bytes = Arc::new(Mutex::new(Vec::new()));
        let sink = bytes.clone();
        let thread = std::thread::spawn(move || {
            let mut chunk = [0; 8192];
            while let Ok(n @ 1..) = pipe.read(&mut chunk) {
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Drain { bytes, thread }
    }

    /// What was read, once the pipe closed, or once [`PIPE_GRACE`] passed (a process
    /// left behind may hold the pipe open: its test fails on its own assertions).
    fn finish(self) -> Vec<u8> {
        let deadline = Instant::now() + PIPE_GRACE;
        while !self.thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::mem::take(&mut *self.bytes.lock().unwrap())
    }
}

fn wait_with_deadline(child: &mut Child) -> ExitStatus {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("corral (pid {}) did not exit within {DEADLINE:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `probe` until it gives a value, at most [`DEADLINE`]; `what` names it.
pub fn eventually<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A folder for one test's files, removed at the end.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "corral-cli-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits for the pid a command wrote to `marker` (its `$$`) and asserts that it leads
/// a process group of its own; gives the group's id.
pub fn command_group(marker: &Path) -> Pid {
    let pid = pid_in(marker);
    assert_eq!(
        getpgid(Some(pid)),
        Ok(pid),
        "the command leads a process group of its own"
    );
    assert_ne!(getpgid(None), Ok(pid), "the test is not in the command's group");
    pid
}

/// Waits for the number a command wrote to `marker` (its `$$`, or a `$!`).
pub fn pid_in(marker: &Path) -> Pid {
    eventually(&format!("a pid in {}", marker.display()), || {
        let text = std::fs::read_to_string(marker).ok()?;
        text.trim().parse().ok().map(Pid::from_raw)
    })
}

/// Whether no process of the group `pgid` is left (not even a zombie).
pub fn group_gone(pgid: Pid) -> bool {
    killpg(pgid, None) == Err(Errno::ESRCH)
}

/// A TCP port on loopback where nothing listens.
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Runs one command on the Redis at `url` and gives its reply.
pub fn redis_cmd<T: redis::FromRedisValue>(url: &str, args: &[&str]) -> T {
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query(&mut conn).unwrap()
}

/// A fresh redis-server for one test.
pub fn redis_server() -> corral_tests::RedisServer {
    corral_tests::RedisServer::start().expect("redis-server starts (apt-get install redis-server)")
}
