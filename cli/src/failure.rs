//! How a command ends when it does not succeed: an exit status from sysexits(3), which
//! cron, systemd and shells know how to read, and what to tell the person: what
//! happened, why (the cause, named), and what to do next.

use std::fmt;
use std::process::ExitCode;

use corral::{Error, ErrorKind};

use crate::output::say;
use crate::redact::RedisUrl;

/// The exit statuses of `corral`, besides 0 and a locked command's own status.
pub mod code {
    /// EX_USAGE: a bad argument.
    pub const USAGE: u8 = 64;
    /// Something failed that has no better status (e.g. a loader's error).
    pub const GENERIC: u8 = 1;
    /// EX_DATAERR: the bytes under a key are not a Corral entry.
    pub const DATA: u8 = 65;
    /// EX_UNAVAILABLE: Redis unreachable, authentication or permission refused, or a
    /// lock's quorum lost to outages.
    pub const UNAVAILABLE: u8 = 69;
    /// EX_SOFTWARE: the guest component broke its contract (a bug).
    pub const SOFTWARE: u8 = 70;
    /// EX_IOERR: stdout could not be written (other than closed by its reader).
    pub const IO: u8 = 74;
    /// EX_TEMPFAIL: the lock is held by another owner; try again later.
    pub const TEMPFAIL: u8 = 75;
    /// The lock was lost while the command ran (EX_PROTOCOL's number).
    pub const LOCK_LOST: u8 = 76;
    /// The command was found but could not be executed (as shells say).
    pub const CANNOT_EXECUTE: u8 = 126;
    /// The command was not found (as shells say).
    pub const NOT_FOUND: u8 = 127;
    /// stdout was closed by its reader: what a tool killed by SIGPIPE exits with.
    pub const CLOSED_STDOUT: u8 = 128 + 13;
}

/// The status for an error of the library.
pub fn exit_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::InvalidArgument => code::USAGE,
        ErrorKind::Unavailable | ErrorKind::Quorum => code::UNAVAILABLE,
        ErrorKind::Timeout => code::TEMPFAIL,
        ErrorKind::LockLost => code::LOCK_LOST,
        ErrorKind::Corrupt => code::DATA,
        ErrorKind::Guest => code::SOFTWARE,
        _ => code::GENERIC,
    }
}

/// A command that did not succeed: its exit status and its report on stderr.
#[derive(Debug)]
#[must_use]
pub struct Failure {
    code: u8,
    message: Option<String>,
    causes: Vec<String>,
    hint: Option<String>,
}

impl Failure {
    /// Exits with `code`, saying `message`.
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: Some(message.into()),
            causes: Vec::new(),
            hint: None,
        }
    }

    /// Exits with `code`, saying nothing (what there was to say was said).
    pub fn quiet(code: u8) -> Self {
        Failure {
            code,
            message: None,
            causes: Vec::new(),
            hint: None,
        }
    }

    /// Adds a "caused by" line (unless it repeats the last one, as an error wrapping
    /// an `io::Error` often does).
    pub fn because(mut self, cause: impl fmt::Display) -> Self {
        let cause = cause.to_string();
        // An error's own message already ends with its root cause: say it once.
        let said = self
            .message
            .as_deref()
            .is_some_and(|m| m.ends_with(cause.as_str()));
        if self.causes.last() != Some(&cause) && !said {
            self.causes.push(cause);
        }
        self
    }

    /// Says what to do next.
    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// The exit status.
    pub fn code(&self) -> u8 {
        self.code
    }

    /// A failed write to stdout: quiet when its reader is gone (`| head -1`).
    pub fn from_stdout(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Failure::quiet(code::CLOSED_STDOUT);
        }
        Failure::new(code::IO, format!("writing to stdout failed: {e}"))
            .hint("check the file or pipe stdout goes to (a full disk?)")
    }

    /// A library error of a command run against `redis` (`None`: the embedded store).
    pub fn from_error(e: &Error, redis: Option<&RedisUrl>) -> Self {
        if let (ErrorKind::Unavailable, Some(url)) = (e.kind(), redis) {
            let url = url.to_string();
            return Failure::unavailable(e, &format!("Redis at {url}"), Cause::of_error(e), &url);
        }
        let failure = Failure::new(exit_code(e.kind()), e.to_string()).because_sources(e);
        match hint(e.kind()) {
            Some(hint) => failure.hint(hint),
            None => failure,
        }
    }

    /// Redis could not be used for `what` (e.g. "Redis at URL") because of `cause`;
    /// `server` says where to act on it.
    pub fn unavailable(e: &Error, what: &str, cause: Cause, server: &str) -> Self {
        Failure::new(
            code::UNAVAILABLE,
            format!("cannot use {what}: {}", cause.phrase()),
        )
        .because(e)
        .because_sources(e)
        .hint(cause.next_step(server))
    }

    /// Adds a "caused by" line for each source of `e`.
    pub fn because_sources(self, e: &Error) -> Self {
        sources(e).into_iter().fold(self, Failure::because)
    }

    /// Prints the report (redacted) and gives the exit status.
    pub fn report(&self) -> ExitCode {
        self.report_as("");
        ExitCode::from(self.code)
    }

    /// Prints the report (redacted), each line starting with `prefix`.
    pub fn report_as(&self, prefix: &str) {
        if let Some(message) = &self.message {
            say!("{prefix}error: {message}");
        }
        for cause in &self.causes {
            say!("{prefix}  caused by: {cause}");
        }
        if let Some(hint) = &self.hint {
            say!("{prefix}hint: {hint}");
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::from_error(&e, None)
    }
}

/// The error's sources, outermost first (the error itself not included).
fn sources(e: &Error) -> Vec<String> {
    let mut out = Vec::new();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push(s.to_string());
        source = s.source();
    }
    out
}

fn hint(kind: ErrorKind) -> Option<&'static str> {
    match kind {
        ErrorKind::Unavailable => Some(
            "is redis-server running at that URL? Start one with `redis-server --port 6379`, \
             or drop --redis to use the embedded in-memory store",
        ),
        ErrorKind::InvalidArgument => Some("see `corral --help` for what each argument takes"),
        ErrorKind::Corrupt => Some(
            "the bytes under this key were not written by this Corral version; \
             `corral remove KEY` deletes them, and a `get` treats them as a miss",
        ),
        ErrorKind::Guest => {
            Some("the guest component failed: this is a bug, please report it with the command you ran")
        }
        _ => None,
    }
}

/// Why a Redis server could not be used, read from the words of its error (the
/// library keeps the Redis error only as its message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    Refused,
    HostNotFound,
    TimedOut,
    Authentication,
    Permission,
    Database,
    OutOfMemory,
    Unknown,
}

impl Cause {
    /// Reads the cause from an error and its sources.
    pub fn of_error(e: &Error) -> Cause {
        let chain: Vec<String> = std::iter::once(e.to_string()).chain(sources(e)).collect();
        Cause::of(&chain.join(": "))
    }

    /// Reads the cause from an error's text.
    pub fn of(text: &str) -> Cause {
        let text = text.to_ascii_lowercase();
        let has = |words: &[&str]| words.iter().any(|w| text.contains(w));
        if has(&[
            "wrongpass",
            "noauth",
            "username-password",
            "authentication",
            "invalid password",
        ]) {
            Cause::Authentication
        } else if has(&["noperm", "permission", "can't run this command"]) {
            Cause::Permission
        } else if has(&["switch database", "db index"]) {
            Cause::Database
        } else if has(&["oom command not allowed", "maxmemory"]) {
            Cause::OutOfMemory
        } else if has(&["refused"]) {
            Cause::Refused
        } else if has(&[
            "lookup address",
            "name or service not known",
            "nodename nor servname",
            "no such host",
        ]) {
            Cause::HostNotFound
        } else if has(&["timed out", "timeout"]) {
            Cause::TimedOut
        } else {
            Cause::Unknown
        }
    }

    /// The cause in a few words.
    pub fn phrase(self) -> &'static str {
        match self {
            Cause::Refused => "connection refused",
            Cause::HostNotFound => "host not found",
            Cause::TimedOut => "no answer in time",
            Cause::Authentication => "authentication failed",
            Cause::Permission => "permission denied (ACL)",
            Cause::Database => "the database number was refused",
            Cause::OutOfMemory => "the server is out of memory (maxmemory)",
            Cause::Unknown => "the server failed",
        }
    }

    /// What to do about it.
    pub fn next_step(self, url: &str) -> String {
        match self {
            Cause::Refused => format!(
                "nothing listens at {url}: start redis-server there (`redis-server --port PORT`), \
                 or fix the URL (--redis, CORRAL_REDIS)"
            ),
            Cause::HostNotFound => format!("check the host name in {url} (--redis, CORRAL_REDIS)"),
            Cause::TimedOut => format!(
                "{url} did not answer within the timeout: is the server overloaded or stopped, \
                 or a firewall dropping the connection?"
            ),
            Cause::Authentication => format!(
                "check the user name and password that {url} carries against the server's \
                 requirepass or ACL users"
            ),
            Cause::Permission => format!(
                "the ACL user of {url} may not run a command Corral needs: grant it \
                 `+@read +@write +@scripting +@pubsub +time` on Corral's keys and channels \
                 (`~{{* &{{*`; for the prefix `corral:` alone, `~{{7:corral:* &{{7:corral:*`)"
            ),
            Cause::Database => format!(
                "the database number at the end of {url} is past the server's `databases` \
                 setting (16 by default: 0 to 15)"
            ),
            Cause::OutOfMemory => format!(
                "{url} refuses writes at its maxmemory: raise maxmemory, or let it evict \
                 (`maxmemory-policy allkeys-lru` for a cache, never for locks)"
            ),
            Cause::Unknown => {
                format!("is redis-server running at {url}? Run with CORRAL_LOG=debug to see its replies")
            }
        }
    }
}
