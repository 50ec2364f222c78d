//! Time, injected: every decision's `now` comes from one [`Clock`].
//!
//! This is the only place in the host that reads the system clock.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of the current time, in Unix epoch milliseconds.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Now, in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// Whether this clock runs in real time, as a store's own TTLs do (the system clock
    /// does). Only then may a store keep a sliding entry's expiry moment in its TTL
    /// (contract §3.1); otherwise the moment lives in the envelope, where this clock
    /// judges it. The default, `false`, is right for any clock.
    fn is_real_time(&self) -> bool {
        false
    }
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn is_real_time(&self) -> bool {
        true
    }
}

/// A clock that moves only when told to: for deterministic tests and simulations.
///
/// Clones share one time.
#[derive(Clone, Debug)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        ManualClock {
            now_ms: Arc::new(AtomicU64::new(now_ms)),
        }
    }

    /// A clock standing at the system's current time.
    pub fn starting_now() -> Self {
        ManualClock::new(SystemClock.now_ms())
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.now_ms.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to `now_ms`.
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_clones_share_it() {
        let clock = ManualClock::new(1_000);
        let twin = clock.clone();
        assert_eq!(clock.now_ms(), 1_000);
        twin.advance(Duration::from_millis(250));
        assert_eq!(clock.now_ms(), 1_250);
        clock.set(7);
        assert_eq!(twin.now_ms(), 7);
    }
}
