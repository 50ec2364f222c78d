//! Warnings at most once per interval per call site, with a count of the ones held
//! back: an outage logs a line every ten seconds per kind of failure, not one per call.
//!
//! ```ignore
//! static LOCK_DOWN: Throttle = Throttle::every_secs(10);
//! if let Some(suppressed) = LOCK_DOWN.allow() {
//!     tracing::warn!(suppressed, key, "get-or-set lock unavailable");
//! }
//! ```

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One call site's rate limit.
#[derive(Debug)]
pub(crate) struct Throttle {
    every_ms: u64,
    /// When it last let a line through (ms since the process's first throttled line,
    /// plus one; 0: never).
    last_ms: AtomicU64,
    /// Lines held back since.
    suppressed: AtomicU64,
}

fn now_ms() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = ORIGIN.get_or_init(Instant::now);
    u64::try_from(origin.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

impl Throttle {
    /// At most one line per `secs` seconds.
    pub(crate) const fn every_secs(secs: u64) -> Self {
        Throttle {
            every_ms: secs * 1_000,
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when a line may go out now (`n` lines were held back since the last
    /// one), else `None` (and this one is counted as held back).
    pub(crate) fn allow(&self) -> Option<u64> {
        let now = now_ms();
        let last = self.last_ms.load(Ordering::Relaxed);
        if (last == 0 || now >= last.saturating_add(self.every_ms))
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::AcqRel));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// `tracing::warn!` at most once per `$secs` seconds at this call site, with the count
/// of the lines held back in the field `suppressed`.
macro_rules! warn_every {
    ($secs:expr, $($arg:tt)+) => {{
        static THROTTLE: $crate::throttle::Throttle = $crate::throttle::Throttle::every_secs($secs);
        if let Some(suppressed) = THROTTLE.allow() {
            tracing::warn!(suppressed, $($arg)+);
        }
    }};
}
pub(crate) use warn_every;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_count_of_the_rest() {
        let t = Throttle::every_secs(3_600);
        assert_eq!(t.allow(), Some(0), "the first goes out");
        for _ in 0..500 {
            assert_eq!(t.allow(), None);
        }
        // Pretend the interval passed.
        t.last_ms.store(1, Ordering::Relaxed);
        let t2 = Throttle { every_ms: 0, ..t };
        assert_eq!(t2.allow(), Some(500), "the next says how many were held back");
    }
}
