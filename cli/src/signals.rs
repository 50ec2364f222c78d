//! The signals `corral lock` takes over from their default (die on the spot): SIGINT,
//! SIGTERM and SIGHUP. Once [`Signals::listen`] ran they are queued for
//! [`Signals::next`], so that `corral lock` can pass them on to its command and release
//! the lock before it exits.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};

/// The signals a flock(1)-like wrapper forwards to its command.
#[derive(Debug)]
pub struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    /// Starts catching SIGINT, SIGTERM and SIGHUP (for the rest of the process's life).
    pub fn listen() -> std::io::Result<Self> {
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// The next signal received (cancel-safe).
    pub async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::SIGINT,
            _ = self.terminate.recv() => Signal::SIGTERM,
            _ = self.hangup.recv() => Signal::SIGHUP,
        }
    }
}

/// The status of a process that died of `signal`, as shells report it.
pub fn exit_code(signal: Signal) -> u8 {
    128 + signal as u8
}
