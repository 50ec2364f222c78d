//! What a leader's flight owes while it runs: the lock it holds or tried to take,
//! released (owner-checked) in the background when the flight is dropped before it
//! finished; and the small steps every action shares (deadlines, handing the outcome on).

use std::sync::Arc;

use tokio::time::{Duration, Instant, timeout_at};

use super::Served;
use crate::cache::Corral;
use crate::cache::registry::{LeaderGuard, Outcome};
use crate::guest::policy::wflight;
use crate::{Error, Result};

/// Hands a flight's `result` to its followers; a panicking loader, or a bad argument, is
/// its caller's failure, not the key's: the flight goes to a follower at once (§5.11).
pub(super) fn share(guard: LeaderGuard<Outcome>, result: &Result<Served>) {
    match result {
        // A bad argument is this caller's too: its followers may have asked well.
        Err(e) if e.is_panic() || e.kind() == crate::ErrorKind::InvalidArgument => drop(guard),
        Ok(value) => guard.finish_with(|| Ok(value.clone())),
        Err(e) => {
            let e = Arc::new(e.clone());
            guard.finish_with(|| Err(e.clone()));
        }
    }
}

/// The deadline `ms` from now; one too far to represent is a century away.
pub(super) fn in_ms(ms: u64) -> Instant {
    let now = Instant::now();
    now.checked_add(Duration::from_millis(ms))
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Runs a store `step` until `deadline`; one still running then has failed.
pub(super) async fn by<T>(deadline: Instant, step: impl Future<Output = Result<T>>) -> Result<T> {
    timeout_at(deadline, step)
        .await
        .unwrap_or_else(|_| Err(past_deadline()))
}

/// What a store step still running at its deadline failed with.
pub(super) fn past_deadline() -> Error {
    Error::new(
        crate::ErrorKind::Timeout,
        "the get-or-set's deadline for store steps passed",
    )
}

/// A leader's flight in progress. Dropped before it finishes (the caller's future was
/// dropped), it asks the guest whether the flight owes a lock release, and releases in
/// the background; a lock try whose answer never came is released the same way.
pub(super) struct HeldFlight<'a> {
    cache: &'a Corral,
    key: &'a str,
    pub(super) lock_name: &'a str,
    pub(super) state: wflight::FlightState,
    /// The token of the lock this flight holds or is trying to take.
    pub(super) owner: Option<String>,
    /// A try with `owner` was sent and its answer has not come back.
    pub(super) unanswered: bool,
    /// The flight finished and owes the release now under way.
    pub(super) releasing: bool,
    pub(super) done: bool,
}

impl<'a> HeldFlight<'a> {
    pub(super) fn new(
        cache: &'a Corral,
        key: &'a str,
        lock_name: &'a str,
        state: wflight::FlightState,
    ) -> Self {
        HeldFlight {
            cache,
            key,
            lock_name,
            state,
            owner: None,
            unanswered: false,
            releasing: false,
            done: false,
        }
    }

    /// Releases `owner`'s lock (owner-checked) in the background, then tells waiting
    /// processes, so one of them takes over at once.
    pub(super) fn release_in_background(&mut self) {
        let Some(owner) = self.owner.take() else {
            return;
        };
        let stores = self.cache.inner.stores.clone();
        let (key, name) = (self.key.to_owned(), self.lock_name.to_owned());
        self.cache.inner.owed.spawn(async move {
            match stores.flight_lock.release(&name, &owner).await {
                Ok(_) => {
                    let _ = stores.notifications.announce(&key).await;
                }
                Err(e) => crate::throttle::warn_every!(10, key, error = %e, "releasing an abandoned lock failed; it expires by its TTL"),
            }
        });
    }
}

impl Drop for HeldFlight<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let owed = self.cache.inner.policy.flight_abandon(self.state).unwrap_or(true);
        if owed || self.unanswered || self.releasing {
            self.release_in_background();
        }
    }
}
