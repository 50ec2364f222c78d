//! Time, injected: every decision's `now` comes from one [`Clock`].
//!
//! This is the only place in the host that reads the system clock.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// A real-time clock read once, then run on the monotonic clock: Unix epoch
/// milliseconds that never step. A lock table given a real-time clock measures its
/// expiries on one ([`steady`]), so a step of the wall clock moves no lock (contract §6.2).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SteadyClock {
    origin_ms: u64,
    origin: Instant,
}

impl Clock for SteadyClock {
    fn now_ms(&self) -> u64 {
        let elapsed = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.origin_ms.saturating_add(elapsed)
    }

    fn is_real_time(&self) -> bool {
        true
    }
}

/// What a lock table measures its expiries on, given `clock`: a clock that runs in real
/// time ([`Clock::is_real_time`], the wall clock) stands for a [`SteadyClock`] starting
/// at its reading now; any other (a manual or simulated clock) is used as it is, so a
/// test still moves the locks' time by hand.
pub(crate) fn steady(clock: Arc<dyn Clock>) -> Arc<dyn Clock> {
    if !clock.is_real_time() {
        return clock;
    }
    Arc::new(SteadyClock {
        origin_ms: clock.now_ms(),
        origin: Instant::now(),
    })
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

/// A wall clock stepped by hand: real time by its own account, as the system clock is.
#[cfg(test)]
#[derive(Clone, Debug)]
pub(crate) struct SteppedWall(ManualClock);

#[cfg(test)]
impl SteppedWall {
    pub(crate) fn new(now_ms: u64) -> Self {
        SteppedWall(ManualClock::new(now_ms))
    }

    /// Steps the clock to `now_ms`.
    pub(crate) fn set(&self, now_ms: u64) {
        self.0.set(now_ms);
    }
}

#[cfg(test)]
impl Clock for SteppedWall {
    fn now_ms(&self) -> u64 {
        self.0.now_ms()
    }

    fn is_real_time(&self) -> bool {
        true
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

    #[test]
    fn a_steady_clock_starts_at_the_wall_clock_and_ignores_its_steps() {
        let wall = SteppedWall::new(5_000_000);
        let steady = steady(Arc::new(wall.clone()));
        let first = steady.now_ms();
        assert!(
            (5_000_000..5_001_000).contains(&first),
            "starts at the wall clock: {first}"
        );
        wall.set(9_000_000);
        assert!(steady.now_ms() < 5_001_000, "a step forward is not taken");
        wall.set(1_000);
        assert!(steady.now_ms() >= first, "nor a step back");
        assert!(steady.is_real_time());
    }

    #[test]
    fn a_clock_that_is_not_real_time_is_kept_as_it_is() {
        let manual = ManualClock::new(1_000);
        let kept = steady(Arc::new(manual.clone()));
        manual.advance(Duration::from_secs(3_600));
        assert_eq!(kept.now_ms(), 3_601_000, "moved by hand");
    }
}
