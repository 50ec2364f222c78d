//! `corral lock`: run a command only while holding a lock.

use std::process::ExitCode;
use std::time::Duration;

use corral::locks::{LockOptions, RedisLocks};
use corral::{Error, ErrorKind};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Exit status when the lock could not be had within --wait (EX_TEMPFAIL).
pub const COULD_NOT_LOCK: u8 = 75;
/// Exit status when the lock was lost while the command ran.
pub const LOCK_LOST: u8 = 76;

pub async fn run(
    urls: &[String],
    prefix: &str,
    key: &str,
    options: LockOptions,
    command: &[String],
) -> corral::Result<ExitCode> {
    if urls.is_empty() {
        return Err(Error::from(ErrorKind::InvalidArgument)
            .with_context("`lock` needs --redis URL (several for Redlock)"));
    }
    let locks = RedisLocks::connect_with(urls, prefix, corral::SystemClock)?;
    let lease = match locks.acquire(key, options).await {
        Ok(lease) => lease,
        Err(e) if matches!(e.kind(), ErrorKind::Timeout | ErrorKind::Quorum) => {
            eprintln!("corral lock: could not get lock {key:?}: {e}");
            eprintln!("hint: another holder is running; pass --wait 30s to wait for it");
            return Ok(ExitCode::from(COULD_NOT_LOCK));
        }
        Err(e) => return Err(e),
    };
    eprintln!(
        "corral lock: holding {key:?} (fencing token {})",
        lease.fencing_token()
    );
    let mut child = tokio::process::Command::new(&command[0])
        .args(&command[1..])
        .env("CORRAL_FENCING_TOKEN", lease.fencing_token().to_string())
        .env("CORRAL_LOCK_KEY", key)
        .spawn()
        .map_err(|e| {
            Error::from(ErrorKind::InvalidArgument)
                .with_context(format!("could not start {:?}: {e}", command[0]))
        })?;
    tokio::select! {
        status = child.wait() => {
            let status = status.map_err(|e| Error::from(ErrorKind::Unavailable).with_context(format!("waiting for the command: {e}")))?;
            if let Err(e) = lease.release().await {
                eprintln!("corral lock: warning: {e}");
            }
            Ok(ExitCode::from(exit_status(status)))
        }
        () = lease.lost() => {
            eprintln!("corral lock: lock {key:?} lost: stopping the command (SIGTERM)");
            if let Some(pid) = child.id() {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            }
            if tokio::time::timeout(Duration::from_secs(5), child.wait()).await.is_err() {
                eprintln!("corral lock: the command ignored SIGTERM for 5 s: SIGKILL");
                let _ = child.kill().await;
            }
            Ok(ExitCode::from(LOCK_LOST))
        }
    }
}

fn exit_status(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code.clamp(0, 255) as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        (None, None) => 1,
    }
}
