//! The keyed flight registry: in-process single flight. The first caller of a key
//! leads; the others follow and get the leader's result (value or error). An entry is
//! removed when its leader finishes or goes away, so the map holds only live flights.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::Error;

/// What a follower gets.
#[derive(Clone, Debug)]
pub(crate) enum Shared {
    Value(Bytes),
    Failed(Arc<Error>),
    /// The leader went away (its future was dropped): try again.
    Gone,
}

type Slot = watch::Sender<Option<Shared>>;

#[derive(Clone, Default)]
pub(crate) struct Registry {
    flights: Arc<Mutex<HashMap<String, Arc<Slot>>>>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").field("flights", &self.len()).finish()
    }
}

pub(crate) enum Join {
    Leader(LeaderGuard),
    Follower(watch::Receiver<Option<Shared>>),
}

impl Registry {
    pub(crate) fn join(&self, key: &str) -> Join {
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

    pub(crate) fn len(&self) -> usize {
        self.flights.lock().len()
    }

    /// Callers waiting on the flight of `key`.
    pub(crate) fn followers(&self, key: &str) -> usize {
        self.flights
            .lock()
            .get(key)
            .map_or(0, |slot| slot.receiver_count())
    }
}

/// Held by the leader. Finishing hands the result to the followers; dropping it
/// unfinished (cancellation) tells them the leader is gone. Either way the entry leaves
/// the map, exactly once.
pub(crate) struct LeaderGuard {
    registry: Registry,
    key: String,
    slot: Arc<Slot>,
    done: bool,
}

impl LeaderGuard {
    pub(crate) fn finish(mut self, result: Shared) {
        self.close(result);
    }

    fn close(&mut self, result: Shared) {
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

impl Drop for LeaderGuard {
    fn drop(&mut self) {
        self.close(Shared::Gone);
    }
}

/// Waits for the leader's result; a leader that vanished without one counts as gone.
pub(crate) async fn follow(mut rx: watch::Receiver<Option<Shared>>) -> Shared {
    match rx.wait_for(Option::is_some).await {
        Ok(shared) => shared.clone().unwrap_or(Shared::Gone),
        Err(_) => Shared::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn followers_get_the_leaders_value_and_the_map_empties() {
        let registry = Registry::default();
        let Join::Leader(leader) = registry.join("k") else {
            panic!("first is leader")
        };
        let Join::Follower(rx) = registry.join("k") else {
            panic!("second follows")
        };
        assert_eq!(registry.len(), 1);
        leader.finish(Shared::Value(Bytes::from_static(b"v")));
        assert!(matches!(follow(rx).await, Shared::Value(v) if v == "v"));
        assert_eq!(registry.len(), 0);
    }

    #[tokio::test]
    async fn a_dropped_leader_tells_followers_it_is_gone() {
        let registry = Registry::default();
        let Join::Leader(leader) = registry.join("k") else {
            panic!()
        };
        let Join::Follower(rx) = registry.join("k") else {
            panic!()
        };
        drop(leader);
        assert!(matches!(follow(rx).await, Shared::Gone));
        assert_eq!(registry.len(), 0);
        assert!(
            matches!(registry.join("k"), Join::Leader(_)),
            "the next caller leads"
        );
    }
}
