//! The command `corral lock` runs, in a process group of its own, and every process it
//! starts, handled as a whole: signalled as a whole, waited for as a whole, and stopped
//! as a whole (a signal, then SIGKILL after a grace period).
//!
//! The command is done when none of its processes is left, not when its first process
//! exits: whatever it left running, in its group or not (`setsid`, `setpgid`, a
//! double-forked daemon), still runs under the lock. On Linux `corral` makes itself a
//! child subreaper: the processes the command orphans become its children instead of
//! init's, so every process the command started is `corral`'s child or a descendant of
//! one, until it has exited and `corral` has reaped it. "Done" is then "the group is
//! empty and `corral` has no child left"; signals go to the group (`killpg`) and to every
//! descendant outside it, found by walking `/proc` from `corral`'s pid.
//!
//! What this does not reach, and so neither waits for nor stops:
//! - work started outside the process tree: `systemd-run`, `at`, a daemon asked over a
//!   socket (`docker run`, a job queue), a command run by `ssh` on another host;
//! - processes the command's first process creates as `corral`'s siblings
//!   (`clone(CLONE_PARENT)`);
//! - anything, once `corral` itself is SIGKILLed: the command's processes go to init and
//!   keep running, and the lock lapses at its TTL;
//! - everything beyond the group when `corral` cannot become a subreaper or has no
//!   `/proc` (it warns), and on systems other than Linux.
//!
//! Descendants running under another user (a setuid program's) are waited for, but
//! signals to them fail with EPERM (a warning); a process stuck in uninterruptible sleep
//! past SIGKILL is given up after [`KILL_WAIT`]. A daemon the command starts
//! (`gpg-agent`, `ssh-agent`) holds the lock until it ends, as it holds flock(1)'s when
//! it keeps the inherited descriptor.
//!
//! Children `corral` already had when it started the command (inherited across the
//! `exec` that started `corral`) are not the command's: neither they nor their
//! descendants are waited for or signalled.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::process::ExitStatus;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use crate::output::say;
use crate::signals::Signals;

/// How often to look whether processes of the command are left, once its leader exited.
const POLL: Duration = Duration::from_millis(10);
/// How long processes may take to die after SIGKILL before `corral` gives up on them.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// The longest `--grace`: a day. A command that has not stopped a day after its signal
/// is killed.
const LONGEST_GRACE: Duration = Duration::from_secs(24 * 60 * 60);

/// A `--grace` on the command line: at most [`LONGEST_GRACE`] (zero: SIGKILL at once).
pub fn grace(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d > LONGEST_GRACE {
        return Err(format!(
            "must be at most {}",
            humantime::format_duration(LONGEST_GRACE)
        ));
    }
    Ok(d)
}

/// A running command: its process group, and its processes outside the group.
#[derive(Debug)]
pub struct Group {
    leader: tokio::process::Child,
    pgid: Pid,
    /// The leader's status, once it exited and was reaped.
    status: Option<ExitStatus>,
    /// Reaps the processes `corral` adopts while the command runs.
    reaper: Option<tokio::task::JoinHandle<()>>,
    /// How the command's processes outside its group are found; `None` when they cannot
    /// be (not a subreaper, or no `/proc`): then only the group counts.
    tree: Option<Tree>,
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(reaper) = self.reaper.take() {
            reaper.abort();
        }
    }
}

impl Group {
    /// Starts `command` (program and arguments) with `env` added, as the leader of a
    /// new process group.
    pub fn start(command: &[String], env: &[(&str, String)]) -> io::Result<Group> {
        let (program, args) = command
            .split_first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no command given"))?;
        let adopting = become_subreaper();
        let tree = adopting.then(Tree::here).flatten();
        let leader = tokio::process::Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .process_group(0)
            .spawn()?;
        let pgid = Pid::from_raw(leader.id().expect("a child that was just spawned has a pid") as i32);
        Ok(Group {
            leader,
            pgid,
            status: None,
            reaper: adopting.then(|| tokio::spawn(reap_adopted(pgid))),
            tree,
        })
    }

    /// The process group's id (the leader's pid).
    pub fn pgid(&self) -> Pid {
        self.pgid
    }

    /// Sends `signal` to every process of the command: its group, and its descendants
    /// outside the group.
    pub fn signal(&self, signal: Signal) {
        self.send(signal, true);
    }

    /// [`Group::signal`], saying why a signal could not be sent only when `warn`.
    fn send(&self, signal: Signal, warn: bool) {
        match killpg(self.pgid, signal) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) if warn => say!(
                "corral lock: warning: could not send {signal} to process group {}: {e}",
                self.pgid
            ),
            Err(_) => {}
        }
        let Some(tree) = &self.tree else { return };
        // The group's members already got it from `killpg`: once is enough (a shell's
        // trap would run twice).
        for process in tree.descendants().filter(|p| p.pgrp != self.pgid) {
            match kill(process.pid, signal) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) if warn => say!(
                    "corral lock: warning: could not send {signal} to process {}, which the command started outside its process group: {e}",
                    process.pid
                ),
                Err(_) => {}
            }
        }
    }

    /// Waits until the leader exited and no process of the command is left, and gives
    /// the leader's status. Cancel-safe: a later call goes on where this one stopped.
    pub async fn finished(&mut self) -> io::Result<ExitStatus> {
        self.settle(None).await
    }

    /// [`Group::finished`], sending `again` (when given) to what is left at every look:
    /// processes forked meanwhile get it too.
    async fn settle(&mut self, again: Option<Signal>) -> io::Result<ExitStatus> {
        let status = match self.status {
            Some(status) => status,
            None => {
                let status = self.leader.wait().await?;
                self.status = Some(status);
                if self.alive() {
                    tracing::info!(
                        pgid = self.pgid.as_raw(),
                        "the command exited; waiting for the processes it left behind, which run under the lock"
                    );
                }
                status
            }
        };
        while self.alive() {
            if let Some(signal) = again {
                self.send(signal, false);
            }
            sleep(POLL).await;
        }
        Ok(status)
    }

    /// Stops the command: `first` to every process (and SIGCONT, for a stopped one),
    /// SIGKILL after `grace` to what is left (again at every look, so that forks cannot
    /// outrun it), and waits (boundedly) until none is left. Signals `corral` receives meanwhile are passed on too.
    pub async fn stop(&mut self, first: Signal, grace: Duration, signals: &mut Signals) {
        self.signal(first);
        // A stopped process (SIGSTOP, a job control stop) hears `first` only once it
        // runs again: continue it, as init systems do.
        self.send(Signal::SIGCONT, false);
        // A grace past what a clock can count (`--grace` refuses one) waits without end.
        let deadline = Instant::now().checked_add(grace);
        let kill_at = async {
            match deadline {
                Some(deadline) => sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(kill_at);
        loop {
            tokio::select! {
                _ = self.finished() => return,
                signal = signals.next() => self.signal(signal),
                () = &mut kill_at => break,
            }
        }
        say!(
            "corral lock: the command's processes were still running {} after {first}: sending SIGKILL",
            humantime::format_duration(grace)
        );
        self.signal(Signal::SIGKILL);
        if timeout(KILL_WAIT, self.settle(Some(Signal::SIGKILL)))
            .await
            .is_err()
        {
            say!(
                "corral lock: warning: processes of the command (process group {}) survived SIGKILL for {KILL_WAIT:?}",
                self.pgid
            );
        }
    }

    /// Whether any process of the command is left. Reaps `corral`'s exited children
    /// first, but only once the leader was reaped through tokio (reaping it here would
    /// steal its status); until then the leader itself is alive, or a zombie of the
    /// group.
    fn alive(&self) -> bool {
        if self.status.is_none() {
            return !matches!(killpg(self.pgid, None), Err(Errno::ESRCH));
        }
        reap(self.pgid);
        if !matches!(killpg(self.pgid, None), Err(Errno::ESRCH)) {
            return true;
        }
        self.tree.as_ref().is_some_and(Tree::any_left)
    }
}

/// Reaps every exited child of this process in the group `pgid`.
fn reap(pgid: Pid) {
    let group = Pid::from_raw(-pgid.as_raw());
    while let Ok(status) = waitpid(group, Some(WaitPidFlag::WNOHANG)) {
        if status == WaitStatus::StillAlive {
            break;
        }
    }
}

/// Makes the processes the command orphans children of `corral`; says whether it did.
fn become_subreaper() -> bool {
    #[cfg(target_os = "linux")]
    match nix::sys::prctl::set_child_subreaper(true) {
        Ok(()) => return true,
        Err(e) => say!(
            "corral lock: warning: cannot become a child subreaper ({e}): only the command's process group is waited for and signalled"
        ),
    }
    #[cfg(not(target_os = "linux"))]
    tracing::debug!("no child subreaper here: only the command's process group is waited for and signalled");
    false
}

/// A subreaper's duty while the command runs: on every SIGCHLD, reap the adopted
/// children that exited, never the `leader`, whose status tokio collects.
async fn reap_adopted(leader: Pid) {
    let Ok(mut exits) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) else {
        return;
    };
    loop {
        reap_all_but(leader);
        if exits.recv().await.is_none() {
            return;
        }
    }
}

/// Reaps exited children other than `leader`, peeking first (`WNOWAIT`) so as never
/// to reap the leader. Stops at the leader: tokio reaps it, and the next SIGCHLD or
/// [`Group::alive`] takes care of the rest.
#[cfg(target_os = "linux")]
fn reap_all_but(leader: Pid) {
    use nix::sys::wait::{Id, waitid};
    let peek = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    while let Ok(status) = waitid(Id::All, peek) {
        match status.pid() {
            Some(pid) if pid != leader => {
                let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
            }
            _ => return,
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn reap_all_but(_leader: Pid) {}

/// A process as `/proc/PID/stat` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Process {
    pid: Pid,
    ppid: Pid,
    pgrp: Pid,
    /// Clock ticks after boot: with the pid, names the process across pid reuse.
    start: u64,
}

impl Process {
    /// Parses `/proc/PID/stat`: "pid (comm) state ppid pgrp … starttime …". The command
    /// name may hold spaces and ')', so fields are counted from the last ')'.
    fn parse(stat: &str) -> Option<Process> {
        let (head, rest) = stat.rsplit_once(')')?;
        let pid = head.split_once(" (")?.0.trim().parse().ok()?;
        let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
        // Fields 3 (state) to 22 (starttime) of proc(5), from index 0.
        let field = |n: usize| fields.get(n - 3).copied();
        Some(Process {
            pid: Pid::from_raw(pid),
            ppid: Pid::from_raw(field(4)?.parse().ok()?),
            pgrp: Pid::from_raw(field(5)?.parse().ok()?),
            start: field(22)?.parse().ok()?,
        })
    }

    /// Every process `/proc` lists (those that exit meanwhile are left out).
    fn all() -> io::Result<Vec<Process>> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir("/proc")? {
            let Ok(entry) = entry else { continue };
            if !entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            {
                continue;
            }
            if let Some(process) = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .as_deref()
                .and_then(Process::parse)
            {
                all.push(process);
            }
        }
        Ok(all)
    }
}

/// `corral`'s descendants, found in `/proc`. Only meaningful while `corral` is a child
/// subreaper: otherwise orphans leave the tree for init.
#[derive(Debug)]
struct Tree {
    me: Pid,
    /// The children `corral` had before it started the command: not the command's.
    strangers: Vec<Process>,
}

impl Tree {
    /// The tree under this process, or `None` (with a warning) without a usable `/proc`.
    fn here() -> Option<Tree> {
        let me = nix::unistd::getpid();
        match Process::all() {
            Ok(all) if all.iter().any(|p| p.pid == me) => Some(Tree {
                me,
                strangers: all.into_iter().filter(|p| p.ppid == me).collect(),
            }),
            Ok(_) => {
                say!(
                    "corral lock: warning: /proc does not list corral's own process: only the command's process group is waited for and signalled"
                );
                None
            }
            Err(e) => {
                say!(
                    "corral lock: warning: cannot list processes in /proc ({e}): only the command's process group is waited for and signalled"
                );
                None
            }
        }
    }

    /// The command's processes: `corral`'s descendants, breadth-first, but the
    /// strangers and theirs. Empty if `/proc` can no longer be read.
    fn descendants(&self) -> impl Iterator<Item = Process> {
        let mut children: HashMap<Pid, Vec<Process>> = HashMap::new();
        for process in Process::all().unwrap_or_default() {
            children.entry(process.ppid).or_default().push(process);
        }
        let mut queue = VecDeque::from([self.me]);
        let mut found = Vec::new();
        while let Some(parent) = queue.pop_front() {
            for &child in children.get(&parent).into_iter().flatten() {
                let stranger = |s: &Process| s.pid == child.pid && s.start == child.start;
                if parent == self.me && self.strangers.iter().any(stranger) {
                    continue;
                }
                queue.push_back(child.pid);
                found.push(child);
            }
        }
        found.into_iter()
    }

    /// Whether any of the command's processes is left outside its group, once its leader
    /// was reaped. Reaps every exited child first (any child now: the leader's status is
    /// stored). A subreaper outlives its descendants' parents, so a process is left iff
    /// `corral` has a child left: asked of the kernel (ECHILD), or, when there are
    /// strangers to leave out, of `/proc`.
    fn any_left(&self) -> bool {
        let flags = WaitPidFlag::WNOHANG | WaitPidFlag::__WALL;
        while let Ok(status) = waitpid(None, Some(flags)) {
            if status == WaitStatus::StillAlive {
                break;
            }
        }
        if self.strangers.is_empty() {
            use nix::sys::wait::{Id, waitid};
            let peek = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT | flags;
            !matches!(waitid(Id::All, peek), Err(Errno::ECHILD))
        } else {
            self.descendants().next().is_some()
        }
    }
}

/// The status `corral lock` exits with for the command's `status`, as shells report it.
pub fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code.clamp(0, 255) as u8,
        (None, Some(signal)) => 128u8.saturating_add(signal as u8),
        (None, None) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_count_from_the_last_parenthesis() {
        let stat = "4242 (a) b (c) S 17 4200 4200 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 1 0 987654 0 0";
        assert_eq!(
            Process::parse(stat),
            Some(Process {
                pid: Pid::from_raw(4242),
                ppid: Pid::from_raw(17),
                pgrp: Pid::from_raw(4200),
                start: 987654,
            })
        );
        assert_eq!(Process::parse("garbage"), None);
    }

    #[test]
    fn this_process_is_listed_with_its_parent() {
        let me = nix::unistd::getpid();
        let all = Process::all().unwrap();
        let mine = all.iter().find(|p| p.pid == me).expect("listed");
        assert_eq!(mine.ppid, nix::unistd::getppid());
    }
}
