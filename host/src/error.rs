//! The one error type of the public API.

// Without the `redis` feature some of what serves Redis stores goes unused.
#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_variables))]

use std::fmt;
use std::sync::Arc;

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
/// Its `Display` is `kind: message`, followed by the root cause when the message does not
/// already say it (`store unavailable: redis SET failed: Connection refused (os error
/// 111)`). Store errors never leak a Redis type: the Redis error is only the
/// [`source`](std::error::Error::source). A loader's error is the source of the error
/// every caller of its flight gets, the leader and each coalesced follower alike, so
/// each can downcast it ([`Error::loader_error`]). A clone shares the source.
#[derive(Clone)]
pub struct Error(Box<Inner>);

/// What an [`Error`] says, boxed: a `Result` of this crate is its value's size and a
/// pointer, however much an error carries.
#[derive(Clone)]
struct Inner {
    kind: ErrorKind,
    message: String,
    argument: Option<String>,
    /// A loader that panicked: its flight is handed on, not shared.
    panicked: bool,
    /// A store call refused before it was sent (an open breaker).
    unsent: bool,
    /// Shared, not copied, by the callers of one flight.
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.0.kind, self.detail())
    }
}

/// An error of `kind` whose message is the kind's own description.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Inner {
            kind,
            message,
            argument,
            panicked,
            unsent,
            source,
        } = &*self.0;
        f.debug_struct("Error")
            .field("kind", kind)
            .field("message", message)
            .field("argument", argument)
            .field("panicked", panicked)
            .field("unsent", unsent)
            .field("source", source)
            .finish()
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error::new(kind, kind.to_string())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The batch loader returned no value for a key: the key is absent (`None`), and
/// nothing is cached for it.
#[derive(Debug)]
pub(crate) struct Absent;

impl fmt::Display for Absent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the batch loader returned no value for this key")
    }
}

impl std::error::Error for Absent {}

/// A batch loader's error, the same for every key of its call.
#[derive(Debug)]
pub(crate) struct BatchLoaderError(pub(crate) Arc<Source>);

impl fmt::Display for BatchLoaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for BatchLoaderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// What a panic's `payload` says, if it says it in words.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".to_owned())
}

/// `Result<T, corral::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error(Box::new(Inner {
            kind,
            message: message.into(),
            argument: None,
            panicked: false,
            unsent: false,
            source: None,
        }))
    }

    pub(crate) fn invalid_argument(name: impl Into<String>, reason: impl fmt::Display) -> Self {
        let name = name.into();
        let mut e = Error::new(ErrorKind::InvalidArgument, format!("`{name}` {reason}"));
        e.0.argument = Some(name);
        e
    }

    /// The same argument error naming the argument `name` (as the caller spelled what the
    /// check called otherwise); any other error as it is.
    pub(crate) fn naming(mut self, name: &str) -> Self {
        if let Some(old) = self.0.argument.take() {
            let spelled = format!("`{old}`");
            if let Some(reason) = self.0.message.strip_prefix(&spelled) {
                self.0.message = format!("`{name}`{reason}");
            }
            self.0.argument = Some(name.to_owned());
        }
        self
    }

    pub(crate) fn unavailable(context: impl fmt::Display, source: impl Into<Source>) -> Self {
        Error::new(ErrorKind::Unavailable, context.to_string()).with_source(source)
    }

    pub(crate) fn guest(context: impl fmt::Display, source: impl Into<Source>) -> Self {
        Error::new(ErrorKind::Guest, context.to_string()).with_source(source)
    }

    pub(crate) fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.0.source = Some(Arc::from(source.into()));
        self
    }

    /// The loader's own error: its message is the loader's, said once.
    pub(crate) fn loader(source: Source) -> Self {
        Error::new(ErrorKind::Loader, source.to_string()).with_source(source)
    }

    /// The deepest error in the chain of sources, if any.
    fn root_cause(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let mut cause = std::error::Error::source(self)?;
        while let Some(deeper) = cause.source() {
            cause = deeper;
        }
        Some(cause)
    }

    /// The loader's error as the loader returned it, if this is a get-or-set's
    /// [`ErrorKind::Loader`] error whose loader failed with an `E`: the same for the
    /// caller that ran the loader and for every caller coalesced on its flight.
    ///
    /// ```
    /// # async fn demo(cache: corral::Corral) {
    /// #[derive(Debug)]
    /// struct NotFound;
    /// impl std::fmt::Display for NotFound {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str("no such user") }
    /// }
    /// impl std::error::Error for NotFound {}
    ///
    /// let got = cache
    ///     .get_or_set("user:42", corral::EntryOptions::new(), || async { Err::<String, _>(NotFound) })
    ///     .await;
    /// let e = got.unwrap_err();
    /// assert!(e.loader_error::<NotFound>().is_some()); // a 404, not a 500
    /// assert_eq!(e.to_string(), "loader failed: no such user");
    /// # }
    /// ```
    pub fn loader_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        if self.0.kind != ErrorKind::Loader {
            return None;
        }
        let source = self.0.source.as_deref()?;
        source.downcast_ref::<E>().or_else(|| {
            // A batch loader's error, shared by the keys of its call.
            let shared = source.downcast_ref::<BatchLoaderError>()?;
            shared.0.downcast_ref::<E>()
        })
    }

    /// A batch loader left this key out (see
    /// [`Corral::get_or_set_many`](crate::Corral::get_or_set_many)).
    pub(crate) fn is_absent(&self) -> bool {
        self.loader_error::<Absent>().is_some()
    }

    /// The loader panicked; `payload` is what it panicked with.
    pub(crate) fn loader_panicked(payload: &(dyn std::any::Any + Send)) -> Self {
        Self::panicked_in("the loader", payload)
    }

    /// A load that failed because `what` (the loader, or a predicate it runs: its
    /// `should_cache`) panicked with `payload`: a `Loader` error, its flight handed on.
    pub(crate) fn panicked_in(what: &str, payload: &(dyn std::any::Any + Send)) -> Self {
        let text = panic_text(payload);
        let mut e = Error::new(ErrorKind::Loader, format!("{what} panicked: {text}"));
        e.0.panicked = true;
        e
    }

    /// This error, for a store call refused before it was sent.
    pub(crate) fn unsent(mut self) -> Self {
        self.0.unsent = true;
        self
    }

    /// Whether the store certainly never ran the call: refused before it was sent, or
    /// its connection refused.
    pub(crate) fn never_sent(&self) -> bool {
        if self.0.unsent {
            return true;
        }
        let mut cause = std::error::Error::source(self);
        while let Some(e) = cause {
            #[cfg(feature = "redis")]
            if let Some(e) = e.downcast_ref::<redis::RedisError>()
                && e.is_connection_refusal()
            {
                return true;
            }
            if let Some(e) = e.downcast_ref::<std::io::Error>()
                && e.kind() == std::io::ErrorKind::ConnectionRefused
            {
                return true;
            }
            cause = e.source();
        }
        false
    }

    /// Whether this is a loader's panic (its flight goes to a follower).
    pub(crate) fn is_panic(&self) -> bool {
        self.0.panicked
    }

    /// A copy for another caller of a flight: the same kind, message, argument and
    /// source (the very same loader error, shared).
    pub(crate) fn from_shared(shared: Arc<Error>) -> Self {
        (*shared).clone()
    }

    /// What went wrong, without the kind: the message, then the root cause when the
    /// message does not already say it (`Display` puts the kind before it).
    pub(crate) fn detail(&self) -> String {
        match self.root_cause().map(|root| root.to_string()) {
            Some(root) if !self.0.message.contains(&root) => format!("{}: {root}", self.0.message),
            _ => self.0.message.clone(),
        }
    }

    /// A store failure (`Unavailable`, `Timeout`, `Corrupt`) says which of the cache's
    /// calls met it: `remove: redis SET GET failed`. Other kinds already name what was
    /// wrong.
    pub(crate) fn in_call(mut self, call: &str) -> Self {
        if matches!(
            self.0.kind,
            ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::Corrupt
        ) {
            self.0.message = format!("{call}: {}", self.0.message);
        }
        self
    }

    /// Replaces the message with `context` (the kind, argument and source stay).
    pub fn with_context(mut self, context: impl Into<String>) -> Self {
        self.0.message = context.into();
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.0.kind
    }

    /// For [`ErrorKind::InvalidArgument`], the argument at fault (`key`, `value`,
    /// `absolute`, `relative`, `sliding`, `limits`, ...).
    pub fn argument(&self) -> Option<&str> {
        self.0.argument.as_deref()
    }

    /// Whether trying again later may succeed (a store outage or a timeout).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.0.kind,
            ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::Quorum
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_root_cause_once() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = Error::unavailable("redis SET failed", refused);
        assert_eq!(
            e.to_string(),
            "store unavailable: redis SET failed: Connection refused"
        );
        let e = Error::loader(Box::new(std::io::Error::other("database down")));
        assert_eq!(e.to_string(), "loader failed: database down");
        assert!(e.loader_error::<std::io::Error>().is_some());
        let shared = Arc::new(e);
        let follower = Error::from_shared(shared.clone());
        assert_eq!(follower.to_string(), shared.to_string());
        assert!(
            follower.loader_error::<std::io::Error>().is_some(),
            "followers downcast too"
        );
        assert!(
            Error::new(ErrorKind::Timeout, "x")
                .loader_error::<std::io::Error>()
                .is_none()
        );
        // A clone is the same error, its source shared.
        let copy = follower.clone();
        assert_eq!(
            (copy.kind(), copy.to_string()),
            (follower.kind(), follower.to_string())
        );
        assert!(copy.loader_error::<std::io::Error>().is_some());
        // A store failure names the call; an argument error does not need to.
        let e = Error::new(ErrorKind::Unavailable, "redis SET GET failed").in_call("remove");
        assert_eq!(e.to_string(), "store unavailable: remove: redis SET GET failed");
        let e = Error::new(ErrorKind::InvalidArgument, "key is empty").in_call("remove");
        assert_eq!(e.to_string(), "invalid argument: key is empty");
    }
}
