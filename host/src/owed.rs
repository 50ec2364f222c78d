//! Work a process owes its stores after the call that caused it has returned: a flight
//! that goes on without its caller, an announcement or a removal retried, the release
//! of a lock whose outcome is unknown or whose lease was dropped. Such work runs in
//! tasks of its own, and [`Owed`] counts it (and the flights under way), so that a
//! process can wait for it before it exits (`Corral::close`, `RedisLocks::close`,
//! `PortableCache::close`, which this module knows nothing of). A process that exits
//! without waiting drops that work: the store then keeps what it was owed until a TTL
//! ends it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

use crate::{Error, ErrorKind, Result};

/// A count of owed work, shared by clones.
#[derive(Clone, Debug, Default)]
pub(crate) struct Owed(Arc<Count>);

#[derive(Debug, Default)]
struct Count {
    pending: AtomicUsize,
    /// Callers of [`Owed::settle`] waiting right now: only then does the last piece of
    /// work to end wake anyone.
    settling: AtomicUsize,
    settled: Notify,
}

/// One piece of owed work, counted until dropped.
#[derive(Debug)]
pub(crate) struct Pending(Arc<Count>);

impl Drop for Pending {
    fn drop(&mut self) {
        let count = &self.0;
        if count.pending.fetch_sub(1, Ordering::SeqCst) == 1 && count.settling.load(Ordering::SeqCst) > 0 {
            count.settled.notify_waiters();
        }
    }
}

impl Owed {
    /// Counts a piece of work until the returned value is dropped.
    pub(crate) fn hold(&self) -> Pending {
        self.0.pending.fetch_add(1, Ordering::SeqCst);
        Pending(self.0.clone())
    }

    /// Runs `work` in a task of its own on the current Tokio runtime, counted until it
    /// ends (or its runtime drops it). Outside a runtime nothing runs: `None`.
    pub(crate) fn spawn<F>(&self, work: F) -> Option<tokio::task::JoinHandle<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let pending = self.hold();
        Some(runtime.spawn(async move {
            let _pending = pending;
            work.await
        }))
    }

    /// Work under way now.
    pub(crate) fn pending(&self) -> usize {
        self.0.pending.load(Ordering::SeqCst)
    }

    /// Waits until no work is under way, or `within` has passed (at most a century: a
    /// longer bound is none). Returns how much was still under way then (0: everything
    /// ended). Needs a Tokio runtime with its timers when work is pending.
    pub(crate) async fn settle(&self, within: Duration) -> usize {
        const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
        let until = (within < CENTURY)
            .then(|| tokio::time::Instant::now().checked_add(within))
            .flatten();
        let count = &self.0;
        count.settling.fetch_add(1, Ordering::SeqCst);
        let _settling = Leave(&count.settling);
        loop {
            let settled = count.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if self.pending() == 0 {
                return 0;
            }
            let woken = match until {
                Some(until) => tokio::time::timeout_at(until, settled).await.is_ok(),
                None => {
                    settled.await;
                    true
                }
            };
            if !woken {
                return self.pending();
            }
        }
    }
}

/// What a close that waited `within` says when `left` pieces of `what`'s work were still
/// under way: `Ok` when none was.
pub(crate) fn closed(what: &str, left: usize, within: Duration) -> Result<()> {
    if left == 0 {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Timeout,
        format!(
            "closing {what}: {left} piece(s) of work (the flights under way count as one; retries, releases) still under way after {within:?} \
             (they go on while the runtime runs; what they owe the store ends with its TTL otherwise)"
        ),
    ))
}

/// Takes a settling caller off the count, however its wait ends (a dropped future too).
struct Leave<'a>(&'a AtomicUsize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn settling_waits_for_the_last_piece_of_work_and_no_longer() {
        let owed = Owed::default();
        assert_eq!(owed.settle(Duration::ZERO).await, 0, "nothing owed: at once");
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        owed.spawn(async move {
            let _ = released.await;
        })
        .unwrap();
        let held = owed.hold();
        assert_eq!(owed.pending(), 2);
        assert_eq!(
            owed.settle(Duration::from_secs(1)).await,
            2,
            "the bound ends the wait"
        );
        let settling = tokio::spawn({
            let owed = owed.clone();
            async move { owed.settle(Duration::from_secs(3600)).await }
        });
        tokio::task::yield_now().await;
        drop(held);
        release.send(()).unwrap();
        assert_eq!(settling.await.unwrap(), 0, "woken by the last one to end");
        assert_eq!(owed.pending(), 0);
    }

    #[test]
    fn outside_a_runtime_nothing_is_spawned_or_counted() {
        let owed = Owed::default();
        assert!(owed.spawn(async {}).is_none());
        assert_eq!(owed.pending(), 0);
    }
}
