//! `corral lock`: a distributed flock(1). Takes a lease, runs the command in a process
//! group of its own while holding it, and releases it on every way out.
//!
//! - The command is done when none of its processes is left: its group is empty and, on
//!   Linux, no descendant outside the group (`setsid`, a double fork) runs either
//!   ([`crate::group`] says how, and what still escapes).
//! - The command's status is `corral`'s (128 + signal if a signal ended it).
//! - SIGINT, SIGTERM and SIGHUP sent to `corral` go to the command's whole group and its
//!   descendants outside it; after the grace period what is left gets SIGKILL; `corral`
//!   exits 128 + the signal.
//! - Lock lost while the command runs: its processes are stopped the same way; exit 76.
//! - Lock held by another owner: 75. Redis unreachable, refusing the login or the
//!   commands, or too few Redlock servers answering: 69, naming the cause.
//! - A command that cannot be started: 127 (not found) or 126 (not executable).
//!
//! Whatever happens once the lock is held, its release (owner-checked) runs before
//! `corral` exits, and so do the releases the locks still owe (an attempt whose reply
//! was lost, a release Redis did not answer, retried): all of it within
//! [`Link::owed_within`] of the command's end (3 s on the default timeouts), or until
//! another signal.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use corral::locks::{Lease, LockOptions, RedisLocks};
use corral::{Error, ErrorKind, RedisOptions};
use nix::sys::signal::Signal;

use crate::failure::{Cause, Failure, code};
use crate::group::{self, Group};
use crate::link::Link;
use crate::output::say;
use crate::probe;
use crate::redact::RedisUrl;
use crate::signals::{self, Signals};

/// What `corral lock` was asked to do.
#[derive(Debug)]
pub struct Request<'a> {
    pub urls: &'a [RedisUrl],
    /// A Redis Cluster's seed nodes, instead of `urls`.
    pub cluster: &'a [RedisUrl],
    pub prefix: &'a str,
    /// The timeouts of the connections.
    pub link: Link,
    pub key: &'a str,
    /// A fixed lease of this TTL (else a watchdog lease).
    pub ttl: Option<Duration>,
    /// The watchdog lease's TTL (default 30 s).
    pub watchdog: Option<Duration>,
    /// How long to wait for the lock (0: one try).
    pub wait: Duration,
    /// First come, first served across processes (`LockOptions::fair`).
    pub fair: bool,
    /// How long the command may take to stop after a signal, before SIGKILL.
    pub grace: Duration,
    /// The program and its arguments.
    pub command: &'a [String],
}

impl Request<'_> {
    fn options(&self) -> LockOptions {
        let options = LockOptions::new().wait(self.wait).fair(self.fair);
        match (self.ttl, self.watchdog) {
            (Some(ttl), _) => options.ttl(ttl),
            (None, Some(ttl)) => options.watchdog(ttl),
            (None, None) => options,
        }
    }
}

/// How the command's run ended.
enum Ending {
    /// Its group is gone; the leader's status.
    Exited(std::io::Result<std::process::ExitStatus>),
    /// The lock was lost.
    Lost,
    /// `corral` received a signal.
    Signalled(Signal),
}

/// Runs `corral lock`.
pub async fn run(request: Request<'_>) -> Result<ExitCode, Failure> {
    if request.urls.is_empty() && request.cluster.is_empty() {
        return Err(Failure::new(
            code::USAGE,
            "`lock` needs --redis URL (several for Redlock) or --redis-cluster URL",
        )
        .hint("e.g. `corral lock --key nightly --redis redis://127.0.0.1:6379 -- ./nightly.sh`"));
    }
    let mut signals = Signals::listen()
        .map_err(|e| Failure::new(code::GENERIC, format!("could not catch signals: {e}")))?;
    let locks = connect(&request)?;
    let (outcome, lease) = hold(&locks, &request, &mut signals).await;
    let within = request.link.owed_within();
    let until = Instant::now() + within;
    if let Some(lease) = lease {
        release(lease, until, within).await;
    }
    // Said before the wait for what the locks still owe.
    let code = outcome.unwrap_or_else(|failure| failure.report());
    pay_what_is_owed(&locks, (until, within), &mut signals).await;
    Ok(code)
}

/// Takes the lock and runs the command under it: how that ended, and the lease to
/// release (also one an acquire interrupted by a signal took all the same).
async fn hold(
    locks: &RedisLocks,
    request: &Request<'_>,
    signals: &mut Signals,
) -> (Result<ExitCode, Failure>, Option<Lease>) {
    tracing::info!(key = request.key, wait = %humantime::format_duration(request.wait), "taking the lock");
    let acquiring = acquire(locks, request);
    tokio::pin!(acquiring);
    let lease = tokio::select! {
        acquired = &mut acquiring => match acquired {
            Ok(lease) => lease,
            Err(failure) => return (Err(failure), None),
        },
        signal = signals.next() => {
            // The acquire ends here. An attempt in flight, whose reply may yet take the
            // lock, is released owner-checked in the background (the locks owe it), which
            // `corral` waits for before it exits; one between attempts owes nothing.
            tracing::info!(%signal, "signal received while taking the lock; the command is not started");
            return (Ok(ExitCode::from(signals::exit_code(signal))), None);
        }
    };
    tracing::info!(
        key = request.key,
        fencing_token = lease.fencing_token(),
        "holding the lock"
    );
    let outcome = supervise(&lease, request, signals).await;
    (outcome, Some(lease))
}

/// Lets what the locks still owe Redis end before `corral` exits, until `until` or
/// another signal: the release of an attempt whose reply was lost (the lock may be held
/// there by nobody), a release Redis did not answer, a fair waiter's place in the
/// queue. A process that exits first leaves such a lock held until its TTL.
async fn pay_what_is_owed(locks: &RedisLocks, (until, within): (Instant, Duration), signals: &mut Signals) {
    let left = until.saturating_duration_since(Instant::now());
    tokio::select! {
        closed = locks.close(left) => if closed.is_err() {
            say!(
                "corral lock: warning: releases owed to Redis did not finish within {within:?}; what they would free expires with its TTL"
            );
        },
        signal = signals.next() => {
            tracing::info!(%signal, "signal received: exiting without waiting for the releases owed to Redis");
        }
    }
}

/// The locks on the request's servers.
fn connect(request: &Request<'_>) -> Result<RedisLocks, Failure> {
    let servers: Vec<RedisOptions> = if request.cluster.is_empty() {
        request
            .urls
            .iter()
            .map(|url| request.link.server(url, request.prefix))
            .collect()
    } else {
        vec![request.link.cluster(request.cluster, request.prefix)]
    };
    RedisLocks::from_options(&servers).map_err(|e| Failure::from_error(&e, single(request.named())))
}

/// Takes the lease, or says why not.
async fn acquire(locks: &RedisLocks, request: &Request<'_>) -> Result<Lease, Failure> {
    match locks.acquire(request.key, request.options()).await {
        Ok(lease) => Ok(lease),
        Err(e) => Err(not_acquired(&e, request).await),
    }
}

/// The one URL of a single-server lock (or the first node of a cluster's).
fn single(urls: &[RedisUrl]) -> Option<&RedisUrl> {
    match urls {
        [url] => Some(url),
        _ => None,
    }
}

impl Request<'_> {
    /// The URLs failures name: the servers, or the cluster's first seed node.
    fn named(&self) -> &[RedisUrl] {
        if self.urls.is_empty() {
            &self.cluster[..self.cluster.len().min(1)]
        } else {
            self.urls
        }
    }
}

/// Why the lease was not had: held by another owner (75), or the servers failed (69).
async fn not_acquired(e: &Error, request: &Request<'_>) -> Failure {
    match e.kind() {
        ErrorKind::Timeout => {
            let waited = match request.wait {
                Duration::ZERO => String::new(),
                wait => format!(" (waited {})", humantime::format_duration(wait)),
            };
            Failure::new(
                code::TEMPFAIL,
                format!("lock {:?} is held by another owner{waited}", request.key),
            )
            .hint("another run holds it: try again later, or pass a longer --wait to wait for it")
        }
        ErrorKind::Unavailable | ErrorKind::Quorum => unavailable(e, request).await,
        // A lock's names are not an entry's: `corral remove` does not reach them, and a
        // fencing counter Corral raised to its end must not be deleted by hand.
        ErrorKind::Corrupt => Failure::from_error(e, single(request.named())).hint(
            "the error names what is wrong under the lock's names in Redis; a value no Corral lock \
             wrote is another program's (rename the lock, or have its owner remove it); a fencing \
             counter at its end cannot give a higher token: use another lock key",
        ),
        _ => Failure::from_error(e, single(request.named())),
    }
}

/// The lock's servers failed. Names the cause from the error's words or, when they do
/// not say, from asking each server.
async fn unavailable(e: &Error, request: &Request<'_>) -> Failure {
    let named = Cause::of_error(e) != Cause::Unknown;
    let findings = if named {
        Vec::new()
    } else {
        probe::servers(request.named(), request.link).await
    };
    let failure = match single(request.named()) {
        Some(url) => {
            let cause = match findings.iter().find_map(probe::Finding::cause) {
                Some(cause) => cause,
                None => Cause::of_error(e),
            };
            Failure::unavailable(e, &format!("Redis at {url}"), cause, &url.to_string())
        }
        None => {
            let n = request.named().len();
            Failure::new(
                code::UNAVAILABLE,
                format!("cannot take lock {:?}: too few of its {n} Redis servers answered", request.key),
            )
            .because(e)
            .because_sources(e)
            .hint(format!(
                "a lock needs a majority ({} of {n}): bring back the servers named above, each with its cause",
                n / 2 + 1
            ))
        }
    };
    findings.iter().fold(failure, Failure::because)
}

/// Runs the command until its group is gone, the lock is lost or a signal comes.
async fn supervise(lease: &Lease, request: &Request<'_>, signals: &mut Signals) -> Result<ExitCode, Failure> {
    let env = [
        ("CORRAL_FENCING_TOKEN", lease.fencing_token().to_string()),
        ("CORRAL_LOCK_KEY", request.key.to_owned()),
    ];
    let mut group = Group::start(request.command, &env).map_err(|e| cannot_start(&request.command[0], &e))?;
    let ending = tokio::select! {
        status = group.finished() => Ending::Exited(status),
        () = lease.lost() => Ending::Lost,
        signal = signals.next() => Ending::Signalled(signal),
    };
    match ending {
        Ending::Exited(Ok(status)) => Ok(ExitCode::from(group::exit_code(status))),
        Ending::Exited(Err(e)) => Err(Failure::new(
            code::GENERIC,
            format!("lost track of the command (process group {}): {e}", group.pgid()),
        )),
        Ending::Lost => {
            say!(
                "corral lock: lock {:?} lost (expired or taken over): stopping the command (SIGTERM to its process group, SIGKILL after {})",
                request.key,
                humantime::format_duration(request.grace)
            );
            group.stop(Signal::SIGTERM, request.grace, signals).await;
            Err(lost(request.key))
        }
        Ending::Signalled(signal) => {
            tracing::info!(%signal, pgid = group.pgid().as_raw(), "passing the signal on to the command's processes");
            group.stop(signal, request.grace, signals).await;
            Ok(ExitCode::from(signals::exit_code(signal)))
        }
    }
}

fn lost(key: &str) -> Failure {
    Failure::new(
        code::LOCK_LOST,
        format!("lock {key:?} was lost while the command ran; the command was stopped"),
    )
    .hint(
        "another holder may have run meanwhile: check the resource (it should refuse the \
             stale CORRAL_FENCING_TOKEN); a longer --watchdog TTL or --ttl survives longer pauses",
    )
}

/// A command that could not be started: 127 when not found, 126 otherwise.
fn cannot_start(program: &str, e: &std::io::Error) -> Failure {
    if e.kind() == std::io::ErrorKind::NotFound {
        Failure::new(
            code::NOT_FOUND,
            format!("cannot run {program:?}: command not found"),
        )
        .because(e)
        .hint("check the name, or give its path; the lock was released")
    } else {
        Failure::new(
            code::CANNOT_EXECUTE,
            format!("cannot run {program:?}: not executable"),
        )
        .because(e)
        .hint("check its permissions (chmod +x) and its #! line; the lock was released")
    }
}

/// Releases the lease, owner-checked, until `until`. A lease known lost is
/// released too (if Redis only missed renewals, the lock may still be ours).
async fn release(lease: Lease, until: Instant, within: Duration) {
    let key = lease.key().to_owned();
    let known_lost = lease.is_lost();
    match tokio::time::timeout_at(until.into(), lease.release()).await {
        Ok(Ok(())) => tracing::info!(key, "released the lock"),
        Ok(Err(e)) if known_lost => tracing::debug!(key, error = %e, "release of a lost lock"),
        Ok(Err(e)) => say!(
            "corral lock: warning: could not confirm the release of lock {key:?} ({e}); retrying it before exiting (if it is still held then, it expires with its TTL)"
        ),
        Err(_) => say!(
            "corral lock: warning: releasing lock {key:?} took more than {within:?}; if it is still held, it expires with its TTL"
        ),
    }
}
