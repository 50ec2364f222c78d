//! Where followers wait for a value to land: one `Notify` per awaited key, shared by
//! every waiter of the key in the process and removed when the last one leaves.

use std::collections::HashMap;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
use tokio::time::{Duration, Instant, sleep, timeout_at};

use crate::Clock;

/// Per awaited key: the `Notify` its watches wait on, and how many watches there are.
type Waiters = HashMap<String, (Arc<Notify>, usize)>;

/// The waiters of this process, by key.
#[derive(Clone, Default)]
pub struct Landings {
    waiters: Arc<Mutex<Waiters>>,
}

impl fmt::Debug for Landings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Landings")
            .field("keys", &self.waiters.lock().len())
            .finish()
    }
}

impl Landings {
    /// Registers interest in `key` now, so that an announcement made from now on is
    /// not missed, however late the returned watch is awaited.
    pub fn watch(&self, key: &str) -> LandingWatch {
        let notify = {
            let mut map = self.waiters.lock();
            let entry = map
                .entry(key.to_owned())
                .or_insert_with(|| (Arc::new(Notify::new()), 0));
            entry.1 += 1;
            entry.0.clone()
        };
        let mut notified = Box::pin(notify.notified_owned());
        notified.as_mut().enable();
        LandingWatch {
            notified: Some(notified),
            key: key.to_owned(),
            landings: self.clone(),
        }
    }

    /// Wakes every watch of `key`.
    pub fn announce(&self, key: &str) {
        if let Some((notify, _)) = self.waiters.lock().get(key) {
            notify.notify_waiters();
        }
    }

    /// Keys with waiters (for leak checks).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.waiters.lock().len()
    }
}

/// A registered wait for one key's landing. Await [`LandingWatch::landed`].
pub struct LandingWatch {
    notified: Option<Pin<Box<OwnedNotified>>>,
    key: String,
    landings: Landings,
}

impl fmt::Debug for LandingWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LandingWatch")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl LandingWatch {
    /// A watch that never fires (when no notification channel is available; the
    /// caller's timer is then the only wake-up).
    pub fn never() -> Self {
        LandingWatch {
            notified: None,
            key: String::new(),
            landings: Landings::default(),
        }
    }

    /// Whether an announcement can wake this watch.
    pub fn is_live(&self) -> bool {
        self.notified.is_some()
    }

    /// Completes when a value for the key is announced.
    pub async fn landed(&mut self) {
        match self.notified.as_mut() {
            Some(n) => n.as_mut().await,
            None => std::future::pending().await,
        }
    }

    /// A follower's wait (the flight's `wait` action): until a value lands, `clock`
    /// reaches `until_ms`, or real time reaches `deadline`, whichever is first. Says
    /// whether the deadline cut it short: nothing landed and the clock is still short of
    /// `until_ms` (a clock that stands still or stepped back), which the body reports as
    /// `budget-spent`.
    pub(crate) async fn wait(&mut self, clock: &dyn Clock, until_ms: u64, deadline: Option<Instant>) -> bool {
        let pause = Duration::from_millis(until_ms.saturating_sub(clock.now_ms()));
        let waited = async {
            // Biased: no random draw (a landing and the timer at the same moment end the
            // wait alike).
            tokio::select! {
                biased;
                () = self.landed() => true,
                () = sleep(pause) => false,
            }
        };
        let landed = match deadline {
            Some(deadline) => timeout_at(deadline, waited).await.unwrap_or(false),
            None => waited.await,
        };
        !landed && deadline.is_some_and(|d| Instant::now() >= d) && clock.now_ms() < until_ms
    }
}

impl Drop for LandingWatch {
    fn drop(&mut self) {
        if self.notified.take().is_none() {
            return;
        }
        let mut map = self.landings.waiters.lock();
        if let Some(entry) = map.get_mut(&self.key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                map.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_announcement_before_the_await_is_not_missed_and_the_map_empties() {
        let landings = Landings::default();
        let mut a = landings.watch("k");
        let mut b = landings.watch("k");
        let other = landings.watch("other");
        landings.announce("k");
        a.landed().await;
        b.landed().await;
        assert_eq!(landings.len(), 2);
        drop((a, b, other));
        assert_eq!(landings.len(), 0);
    }
}
