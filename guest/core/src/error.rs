use std::fmt;

/// The argument of a public operation that an [`ArgError`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Arg {
    /// The entry's key.
    Key,
    /// The entry's value.
    Value,
    /// The absolute expiration point.
    Absolute,
    /// The expiration relative to now.
    Relative,
    /// The sliding expiration.
    Sliding,
    /// The cache's limits and defaults.
    Limits,
    /// A lock's TTL.
    Ttl,
    /// How long a stale copy is kept for fail-safe.
    MaxStale,
    /// A loader timeout.
    Timeout,
    /// The eager refresh fraction.
    EagerRefresh,
    /// The tags an entry carries (contract §7.5).
    Tags,
    /// One tag named by an invalidation (`remove_by_tag`, `expire_by_tag`).
    Tag,
    /// A batch's keys as a whole (a key named twice where each must come once).
    Keys,
    /// A setting of the cache, by the name its builder gives it (`l1_ttl`, `lock_ttl`,
    /// ...).
    Setting(&'static str),
}

impl Arg {
    /// The name the public API gives the argument.
    pub fn name(self) -> &'static str {
        match self {
            Arg::Key => "key",
            Arg::Value => "value",
            Arg::Absolute => "absolute",
            Arg::Relative => "relative",
            Arg::Sliding => "sliding",
            Arg::Limits => "limits",
            Arg::Ttl => "ttl",
            Arg::MaxStale => "max_stale",
            Arg::Timeout => "timeout",
            Arg::EagerRefresh => "eager_refresh",
            Arg::Tags => "tags",
            Arg::Tag => "tag",
            Arg::Keys => "keys",
            Arg::Setting(name) => name,
        }
    }
}

impl fmt::Display for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An argument broke the contract. Nothing was stored, changed or removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgError {
    /// Which argument.
    pub arg: Arg,
    /// What was wrong with it.
    pub reason: String,
}

impl ArgError {
    pub(crate) fn new(arg: Arg, reason: impl Into<String>) -> Self {
        ArgError {
            arg,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid argument `{}`: {}", self.arg, self.reason)
    }
}

impl std::error::Error for ArgError {}

/// Why stored bytes are not an envelope this version reads.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Corruption {
    /// Fewer bytes than the header, or fewer value bytes than the header promises.
    Truncated {
        /// Bytes the envelope should have.
        expected: u64,
        /// Bytes it has.
        actual: u64,
    },
    /// More value bytes than the header promises.
    TrailingBytes {
        /// Bytes the envelope should have.
        expected: u64,
        /// Bytes it has.
        actual: u64,
    },
    /// The value is larger than the cache's limit.
    Oversized {
        /// The value's length.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The bytes do not start with Corral's magic: something else wrote them.
    Foreign,
    /// A Corral envelope of a version this build does not read.
    UnknownVersion(u8),
    /// The header's fields contradict each other.
    Inconsistent(&'static str),
}

impl fmt::Display for Corruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Corruption::Truncated { expected, actual } => {
                write!(f, "truncated envelope: {actual} bytes of {expected}")
            }
            Corruption::TrailingBytes { expected, actual } => {
                write!(f, "envelope has {actual} bytes, header says {expected}")
            }
            Corruption::Oversized { len, max } => {
                write!(f, "stored value of {len} bytes is over the limit of {max}")
            }
            Corruption::Foreign => f.write_str("not a Corral envelope (bad magic)"),
            Corruption::UnknownVersion(v) => write!(f, "unknown envelope version {v}"),
            Corruption::Inconsistent(what) => write!(f, "inconsistent envelope: {what}"),
        }
    }
}

impl std::error::Error for Corruption {}
