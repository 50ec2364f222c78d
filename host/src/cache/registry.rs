//! The keyed flight registry: in-process single flight, one semantics for every body
//! (contract §5.3, §5.11, §5.14). The first caller of a key leads; the others follow and
//! get the leader's outcome (a value or an error). A leader that goes away without one
//! (its future dropped, its component call trapped) hands the flight on: its followers
//! join again, and one of them leads. An entry leaves the map when its leader finishes
//! or goes away, so the map holds only live flights.
//!
//! The native body shares `Result<Bytes, Arc<Error>>`; the portable body shares what the
//! component's `flights.finish` passed. Same registry, same rules.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::Error;

/// What the native body's followers get.
pub(crate) type Outcome = std::result::Result<Bytes, Arc<Error>>;

/// What a follower's wait ends with.
#[derive(Clone, Debug)]
pub(crate) enum Shared<T> {
    /// The leader's outcome.
    Done(T),
    /// The leader went away without one: join again.
    Gone,
}

type Slot<T> = watch::Sender<Option<Shared<T>>>;

/// The flights of one cache, by key. Cheap to clone; clones share the map.
pub(crate) struct Registry<T> {
    flights: Arc<Mutex<HashMap<String, Arc<Slot<T>>>>>,
}

impl<T> Clone for Registry<T> {
    fn clone(&self) -> Self {
        Registry {
            flights: self.flights.clone(),
        }
    }
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            flights: Arc::default(),
        }
    }
}

impl<T> fmt::Debug for Registry<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").field("flights", &self.len()).finish()
    }
}

/// What joining a key's flight gave.
pub(crate) enum Join<T> {
    /// No flight ran: this caller leads one.
    Leader(LeaderGuard<T>),
    /// A flight runs: wait for it with [`follow`].
    Follower(watch::Receiver<Option<Shared<T>>>),
}

impl<T: Clone> Registry<T> {
    pub(crate) fn join(&self, key: &str) -> Join<T> {
        let mut flights = self.flights.lock();
        if let Some(slot) = flights.get(key) {
            return Join::Follower(slot.subscribe());
        }
        let slot = Arc::new(watch::channel(None).0);
        flights.insert(key.to_owned(), slot.clone());
        Join::Leader(LeaderGuard {
            registry: self.clone(),
            key: key.to_owned(),
            slot,
            done: false,
        })
    }

    /// Joins the flight of `key` until this caller leads or gets an outcome: a leader
    /// gone without one sends its followers back here, and the first to return leads.
    pub(crate) async fn lead_or_follow(&self, key: &str) -> Result<LeaderGuard<T>, T> {
        loop {
            match self.join(key) {
                Join::Leader(guard) => return Ok(guard),
                Join::Follower(rx) => match follow(rx).await {
                    Shared::Done(outcome) => return Err(outcome),
                    Shared::Gone => continue,
                },
            }
        }
    }
}

impl<T> Registry<T> {
    /// Flights in progress.
    pub(crate) fn len(&self) -> usize {
        self.flights.lock().len()
    }

    /// Callers waiting on the flight of `key`.
    #[cfg_attr(not(any(test, feature = "test-util")), allow(dead_code))]
    pub(crate) fn followers(&self, key: &str) -> usize {
        self.flights
            .lock()
            .get(key)
            .map_or(0, |slot| slot.receiver_count())
    }
}

/// Held by the leader. Finishing hands the outcome to the followers; dropping it
/// unfinished (cancellation, a trap, a panic) tells them the leader is gone. Either way
/// the entry leaves the map, exactly once.
pub(crate) struct LeaderGuard<T> {
    registry: Registry<T>,
    key: String,
    slot: Arc<Slot<T>>,
    done: bool,
}

impl<T> fmt::Debug for LeaderGuard<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderGuard").field("key", &self.key).finish()
    }
}

impl<T> LeaderGuard<T> {
    pub(crate) fn finish(mut self, outcome: T) {
        self.close(Shared::Done(outcome));
    }

    fn close(&mut self, result: Shared<T>) {
        if self.done {
            return;
        }
        self.done = true;
        {
            let mut flights = self.registry.flights.lock();
            if flights.get(&self.key).is_some_and(|s| Arc::ptr_eq(s, &self.slot)) {
                flights.remove(&self.key);
            }
        }
        self.slot.send_replace(Some(result));
    }
}

impl<T> Drop for LeaderGuard<T> {
    fn drop(&mut self) {
        self.close(Shared::Gone);
    }
}

/// Waits for the leader's outcome; a leader that vanished without one counts as gone.
pub(crate) async fn follow<T: Clone>(mut rx: watch::Receiver<Option<Shared<T>>>) -> Shared<T> {
    match rx.wait_for(Option::is_some).await {
        Ok(shared) => shared.clone().unwrap_or(Shared::Gone),
        Err(_) => Shared::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn followers_get_the_leaders_outcome_and_the_map_empties() {
        let registry = Registry::<&str>::default();
        let Join::Leader(leader) = registry.join("k") else {
            panic!("first is leader")
        };
        let Join::Follower(rx) = registry.join("k") else {
            panic!("second follows")
        };
        assert_eq!(registry.len(), 1);
        leader.finish("v");
        assert!(matches!(follow(rx).await, Shared::Done("v")));
        assert_eq!(registry.len(), 0);
    }

    #[tokio::test]
    async fn a_dropped_leader_hands_the_flight_to_a_follower() {
        let registry = Registry::<&str>::default();
        let Join::Leader(leader) = registry.join("k") else {
            panic!()
        };
        let follower = tokio::spawn({
            let registry = registry.clone();
            async move { registry.lead_or_follow("k").await.map(|g| g.key.clone()) }
        });
        while registry.followers("k") == 0 {
            tokio::task::yield_now().await;
        }
        drop(leader);
        assert_eq!(follower.await.unwrap().unwrap(), "k", "the follower leads now");
        assert_eq!(registry.len(), 0);
    }
}
