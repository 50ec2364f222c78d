//! The one error type of the public API.

// Without the `redis` feature some of what serves Redis stores goes unused.
#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_variables))]

use std::fmt;

/// What kind of failure an [`Error`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument broke the contract; [`Error::argument`] names it. Nothing was
    /// stored, changed or removed.
    InvalidArgument,
    /// The store (Redis) could not be reached, timed out or failed.
    Unavailable,
    /// A stored value was not a Corral envelope. Reads treat this as a miss; it only
    /// surfaces where a caller asked to see the raw entry.
    Corrupt,
    /// A lock the caller held was lost (expired, taken over, or its server gone).
    LockLost,
    /// A deadline passed before the operation could complete.
    Timeout,
    /// The guest component failed: a trap or a broken contract. A bug, not a condition.
    Guest,
    /// The loader of a get-or-set failed; the source is its error.
    Loader,
    /// Too few of a lock's Redis servers answered for a majority.
    Quorum,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Unavailable => "store unavailable",
            ErrorKind::Corrupt => "corrupt entry",
            ErrorKind::LockLost => "lock lost",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Guest => "guest component failed",
            ErrorKind::Loader => "loader failed",
            ErrorKind::Quorum => "no quorum",
        })
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error of a Corral operation: a [`kind`](Error::kind), a message, and the cause.
///
/// Store errors never leak a Redis type: the Redis error is only the
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    argument: Option<String>,
    /// A loader that panicked: its flight is handed on, not shared.
    panicked: bool,
    #[source]
    source: Option<Source>,
}

/// `Result<T, corral::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            argument: None,
            panicked: false,
            source: None,
        }
    }

    pub(crate) fn invalid_argument(name: impl Into<String>, reason: impl fmt::Display) -> Self {
        let name = name.into();
        let mut e = Error::new(ErrorKind::InvalidArgument, format!("`{name}` {reason}"));
        e.argument = Some(name);
        e
    }

    pub(crate) fn unavailable(context: impl fmt::Display, source: impl Into<Source>) -> Self {
        Error::new(ErrorKind::Unavailable, context.to_string()).with_source(source)
    }

    pub(crate) fn guest(context: impl fmt::Display, source: impl Into<Source>) -> Self {
        Error::new(ErrorKind::Guest, context.to_string()).with_source(source)
    }

    pub(crate) fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub(crate) fn loader(source: Source) -> Self {
        Error::new(ErrorKind::Loader, format!("the loader failed: {source}")).with_source(source)
    }

    /// The loader panicked; `payload` is what it panicked with.
    pub(crate) fn loader_panicked(payload: &(dyn std::any::Any + Send)) -> Self {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-string payload".to_owned());
        let mut e = Error::new(ErrorKind::Loader, format!("the loader panicked: {what}"));
        e.panicked = true;
        e
    }

    /// Whether this is a loader's panic (its flight goes to a follower).
    pub(crate) fn is_panic(&self) -> bool {
        self.panicked
    }

    /// A copy for the other callers of a flight: same kind, message and argument; the
    /// source is described, not shared (a `Box<dyn Error>` cannot be cloned).
    pub(crate) fn share(&self) -> Error {
        Error {
            kind: self.kind,
            message: self.message.clone(),
            argument: self.argument.clone(),
            panicked: self.panicked,
            source: None,
        }
    }

    pub(crate) fn from_shared(shared: std::sync::Arc<Error>) -> Self {
        let mut e = shared.share();
        e.source = Some(Box::new(SharedError(shared)));
        e
    }

    /// Replaces the message with `context` (the kind, argument and source stay).
    pub fn with_context(mut self, context: impl Into<String>) -> Self {
        self.message = context.into();
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// For [`ErrorKind::InvalidArgument`], the argument at fault (`key`, `value`,
    /// `absolute`, `relative`, `sliding`, `limits`, ...).
    pub fn argument(&self) -> Option<&str> {
        self.argument.as_deref()
    }

    /// Whether trying again later may succeed (a store outage or a timeout).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::Quorum
        )
    }
}

/// The leader's error, as seen by a caller coalesced on its flight.
#[derive(Debug)]
struct SharedError(std::sync::Arc<Error>);

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the flight's leader failed: {}", self.0)
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}
