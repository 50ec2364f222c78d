//! The command `corral lock` runs, in a process group of its own, handled as a whole:
//! signalled as a whole (grandchildren included), waited for as a whole, and stopped as
//! a whole (a signal, then SIGKILL after a grace period).
//!
//! The command is done when its process group is empty, not when its first process
//! exits: whatever it left running in its group still runs under the lock. On Linux
//! `corral` makes itself a child subreaper: processes the command orphans become its
//! children, and it reaps them as they exit (on SIGCHLD), instead of leaving them as
//! zombies (still members of the group) to an init that may reap late or never.

use std::io;
use std::process::ExitStatus;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use crate::output::say;
use crate::signals::Signals;

/// How often to look whether processes of the group are left, once its leader exited.
const POLL: Duration = Duration::from_millis(10);
/// How long processes may take to die after SIGKILL before `corral` gives up on them.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// A running command and its process group.
#[derive(Debug)]
pub struct Group {
    leader: tokio::process::Child,
    pgid: Pid,
    /// The leader's status, once it exited and was reaped.
    status: Option<ExitStatus>,
    /// Reaps the processes `corral` adopts while the command runs.
    reaper: Option<tokio::task::JoinHandle<()>>,
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
        })
    }

    /// The process group's id (the leader's pid).
    pub fn pgid(&self) -> Pid {
        self.pgid
    }

    /// Sends `signal` to every process of the group.
    pub fn signal(&self, signal: Signal) {
        match killpg(self.pgid, signal) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => say!(
                "corral lock: warning: could not send {signal} to process group {}: {e}",
                self.pgid
            ),
        }
    }

    /// Waits until the leader exited and no process of the group is left, and gives the
    /// leader's status. Cancel-safe: a later call goes on where this one stopped.
    pub async fn finished(&mut self) -> io::Result<ExitStatus> {
        let status = match self.status {
            Some(status) => status,
            None => {
                let status = self.leader.wait().await?;
                self.status = Some(status);
                if self.alive() {
                    tracing::info!(
                        pgid = self.pgid.as_raw(),
                        "the command exited; waiting for the processes it left in its group, which run under the lock"
                    );
                }
                status
            }
        };
        while self.alive() {
            sleep(POLL).await;
        }
        Ok(status)
    }

    /// Stops the group: `first` to every process, SIGKILL after `grace` to what is left,
    /// and waits (boundedly) until none is left. Signals `corral` receives meanwhile are
    /// passed on to the group too.
    pub async fn stop(&mut self, first: Signal, grace: Duration, signals: &mut Signals) {
        self.signal(first);
        let deadline = Instant::now() + grace;
        loop {
            tokio::select! {
                _ = self.finished() => return,
                signal = signals.next() => self.signal(signal),
                () = sleep_until(deadline) => break,
            }
        }
        say!(
            "corral lock: the command's processes were still running {} after {first}: sending SIGKILL",
            humantime::format_duration(grace)
        );
        self.signal(Signal::SIGKILL);
        if timeout(KILL_WAIT, self.finished()).await.is_err() {
            say!(
                "corral lock: warning: processes of group {} survived SIGKILL for {KILL_WAIT:?}",
                self.pgid
            );
        }
    }

    /// Whether any process of the group is left. Reaps the group's zombies that are
    /// `corral`'s children first, but only once the leader was reaped through tokio
    /// (reaping it here would steal its status).
    fn alive(&self) -> bool {
        if self.status.is_some() {
            reap(self.pgid);
        }
        !matches!(killpg(self.pgid, None), Err(Errno::ESRCH))
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
        Err(e) => tracing::debug!(error = %e, "could not become a child subreaper; orphans go to init"),
    }
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
/// [`reap`] takes care of the rest.
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

/// The status `corral lock` exits with for the command's `status`, as shells report it.
pub fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code.clamp(0, 255) as u8,
        (None, Some(signal)) => 128u8.saturating_add(signal as u8),
        (None, None) => 1,
    }
}
