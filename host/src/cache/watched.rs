//! The cache's clock, watched for steps back (contract §7.5).
//!
//! What a process knows, it keeps until wall-clock moments: the generation and the tags'
//! moments until an L1 TTL after their read, L1 copies until their own bound. A wall
//! clock stepped back pushes every such moment away by the step, and a process that
//! hears no announcements would learn of a clear that much later. Every reading of the
//! cache's clock goes through [`Watched`]; one the guest calls a step back
//! (`clock-stepped-back`) is handled as a gap in the announcements: L1 flushed, the
//! generation and the tags read again.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::clock::Clock;
use crate::guest::Policy;

/// What a step back sets off.
type OnStep = Box<dyn Fn() + Send + Sync>;

/// A clock whose readings are watched for steps back.
pub(crate) struct Watched {
    clock: Arc<dyn Clock>,
    /// The latest reading seen.
    latest: AtomicU64,
    policy: Policy,
    on_step: OnceLock<OnStep>,
}

impl fmt::Debug for Watched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watched").field("clock", &self.clock).finish()
    }
}

impl Watched {
    pub(crate) fn new(clock: Arc<dyn Clock>, policy: Policy) -> Self {
        Watched {
            latest: AtomicU64::new(clock.now_ms()),
            clock,
            policy,
            on_step: OnceLock::new(),
        }
    }

    /// Calls `on_step` at every step back from now on (once: later calls are ignored).
    /// It runs on the thread that read the clock: it must not read it again, nor take a
    /// lock held around a reading.
    pub(crate) fn on_step(&self, on_step: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_step.set(Box::new(on_step));
    }

    /// Takes in a reading behind the latest one: a step back (as the guest judges it)
    /// sets off `on_step`, once per step (the reading it found becomes the latest).
    ///
    /// A reading taken on another thread just before the step may still raise the latest
    /// after the step was taken in: the next reading is then a step again, and L1 is
    /// flushed twice for one step (more work, never less safety).
    #[cold]
    fn behind(&self, mut latest: u64, now: u64) {
        loop {
            if !self.policy.clock_stepped_back(latest, now).unwrap_or(false) {
                return; // Not a step, or another reading took it in first.
            }
            match self
                .latest
                .compare_exchange(latest, now, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                // Raised meanwhile by a reading from before the step: judge against that.
                Err(moved) => latest = moved,
            }
        }
        tracing::warn!(
            from_ms = latest,
            to_ms = now,
            "the wall clock stepped back: L1 is flushed and the generation and tags are read again"
        );
        if let Some(on_step) = self.on_step.get() {
            on_step();
        }
    }
}

impl Clock for Watched {
    fn now_ms(&self) -> u64 {
        let now = self.clock.now_ms();
        let latest = self.latest.load(Ordering::Acquire);
        if now > latest {
            self.latest.fetch_max(now, Ordering::AcqRel);
        } else if now < latest {
            self.behind(latest, now);
        }
        now
    }

    fn is_real_time(&self) -> bool {
        self.clock.is_real_time()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;
    use crate::guest::policy::defaults;

    fn watched(clock: &ManualClock) -> (Watched, Arc<AtomicUsize>) {
        let policy = Policy::load(defaults().unwrap().limits).unwrap();
        let watched = Watched::new(Arc::new(clock.clone()), policy);
        let steps = Arc::new(AtomicUsize::new(0));
        let counted = steps.clone();
        watched.on_step(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        (watched, steps)
    }

    #[test]
    fn a_step_back_past_a_second_sets_off_the_gap_once() {
        let clock = ManualClock::new(1_000_000);
        let (watched, steps) = watched(&clock);
        clock.advance(Duration::from_secs(5));
        assert_eq!(watched.now_ms(), 1_005_000);
        clock.set(1_004_500);
        assert_eq!(watched.now_ms(), 1_004_500, "readings pass through unchanged");
        assert_eq!(steps.load(Ordering::SeqCst), 0, "half a second: crossed readings");
        clock.set(1_000_000);
        watched.now_ms();
        assert_eq!(steps.load(Ordering::SeqCst), 1, "five seconds back");
        watched.now_ms();
        clock.advance(Duration::from_millis(10));
        watched.now_ms();
        assert_eq!(steps.load(Ordering::SeqCst), 1, "one step, one gap");
        assert!(watched.is_real_time() == clock.is_real_time());
    }

    #[test]
    fn a_step_taken_in_while_another_reading_raised_the_latest_still_sets_off_the_gap() {
        let clock = ManualClock::new(1_000_000);
        let (watched, steps) = watched(&clock);
        // This reading saw 1_000_000 as the latest; a reading from before the step, on
        // another thread, raised it before this one could take the step in.
        watched.latest.store(1_000_005, Ordering::Release);
        watched.behind(1_000_000, 990_000);
        assert_eq!(steps.load(Ordering::SeqCst), 1, "the step was not deferred");
        // Taken in: the same reading again is no step.
        watched.behind(1_000_005, 990_000);
        assert_eq!(steps.load(Ordering::SeqCst), 1);
    }
}
