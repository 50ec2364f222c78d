//! The keyed flight registry: in-process single flight, one semantics for every body
//! (contract §5.3, §5.11, §5.14). The first caller of a key leads; the others follow and
//! get the leader's outcome (a value or an error). A leader that goes away without one
//! (its future dropped, its component call trapped) hands the flight on: its followers
//! join again, and one of them leads. An entry leaves the map when its leader finishes
//! or goes away, so the map holds only live flights.
//!
//! The native body shares `Result<Served, Arc<Error>>`; the portable body shares what the
//! component's `flights.finish` passed. Same registry, same rules.
//!
//! Followers wait on a oneshot channel each, kept in join order, and are handed the
//! outcome in that order: no wake-up depends on a random draw, so a simulation with
//! several followers per flight replays byte for byte.
//!
//! A flight is joined only while its key is as it was when the flight began (the key's
//! L1 [`Ticket`]: no write of it in this process, no change of it heard, no clear since).
//! Otherwise its outcome may be older than a write acknowledged before the caller came:
//! the flight is sealed (it finishes for the followers it has) and the caller leads a
//! new one (contract §5.12).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use hashbrown::hash_map::EntryRef;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::Error;
use crate::owed::{Owed, Pending};
use crate::store::l1::Ticket;

/// What the native body's followers get.
pub(crate) type Outcome = std::result::Result<super::load::Served, Arc<Error>>;

/// What a follower's wait ends with.
#[derive(Clone, Debug)]
pub(crate) enum Shared<T> {
    /// The leader's outcome.
    Done(T),
    /// The leader went away without one: join again.
    Gone,
}

/// One live flight: its leader's mark, the key's ticket when it began, and its
/// followers in join order.
struct Flight<T> {
    id: u64,
    ticket: Ticket,
    followers: Vec<oneshot::Sender<Shared<T>>>,
}

struct Flights<T> {
    /// By key: each key's one allocation, shared with its leader's guard. Hashed with
    /// foldhash (randomly seeded, weaker against crafted collisions than SipHash): the
    /// map holds only the keys with a flight under way.
    by_key: hashbrown::HashMap<Arc<str>, Flight<T>, foldhash::fast::RandomState>,
    /// Flights no caller may join any more (their key changed since they began), by id,
    /// until their leaders finish.
    sealed: HashMap<u64, Flight<T>>,
    next_id: u64,
    /// Counted in the cache's owed work while any flight leads: one count for them all
    /// (see [`Corral::close`](crate::Corral::close)), not one per key of a batch.
    leading: Option<Pending>,
}

/// The flights of one cache, by key. Cheap to clone; clones share the map.
pub(crate) struct Registry<T> {
    shared: Arc<Table<T>>,
}

/// What a registry's clones share.
struct Table<T> {
    flights: Mutex<Flights<T>>,
    /// Counts the flights while any leads (see [`Flights::leading`]).
    owed: Owed,
}

impl<T> Clone for Registry<T> {
    fn clone(&self) -> Self {
        Registry {
            shared: self.shared.clone(),
        }
    }
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry::counted(&Owed::default())
    }
}

impl<T> Registry<T> {
    /// An empty registry whose flights count in `owed` while they lead.
    pub(crate) fn counted(owed: &Owed) -> Self {
        Registry {
            shared: Arc::new(Table {
                flights: Mutex::new(Flights {
                    by_key: hashbrown::HashMap::default(),
                    sealed: HashMap::new(),
                    next_id: 0,
                    leading: None,
                }),
                owed: owed.clone(),
            }),
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
    Follower(oneshot::Receiver<Shared<T>>),
}

/// The ticket of flights joined whatever changed since they began: background
/// refreshes, one per key at a time (their fills are fenced on their own reads).
pub(crate) const UNCHANGED: Ticket = Ticket::from_parts([0, 0, 0]);

impl<T: Clone> Registry<T> {
    /// Joins the flight of `key`, if one runs and the key is as it was when it began
    /// (`ticket`, the key's L1 ticket now, says it is unchanged since the flight's);
    /// else leads one.
    pub(crate) fn join(&self, key: &str, ticket: Ticket) -> Join<T> {
        self.join_in(&mut self.shared.flights.lock(), key, ticket)
    }

    /// [`join`](Self::join) for each of `keys` (each with its ticket now), in order,
    /// with the map locked once.
    pub(crate) fn join_many<'k>(&self, keys: impl IntoIterator<Item = (&'k str, Ticket)>) -> Vec<Join<T>> {
        let mut flights = self.shared.flights.lock();
        keys.into_iter()
            .map(|(key, ticket)| self.join_in(&mut flights, key, ticket))
            .collect()
    }

    fn join_in(&self, flights: &mut Flights<T>, key: &str, ticket: Ticket) -> Join<T> {
        let id = flights.next_id + 1;
        let flight = Flight {
            id,
            ticket,
            followers: Vec::new(),
        };
        // One lookup: the key's flight is followed, sealed and replaced, or begun.
        let key = match flights.by_key.entry_ref(key) {
            EntryRef::Occupied(mut live) => {
                if ticket.key_unchanged_since(live.get().ticket) {
                    let (tx, rx) = oneshot::channel();
                    let followers = &mut live.get_mut().followers;
                    // Followers that gave up leave their sender behind: drop those first.
                    followers.retain(|f| !f.is_closed());
                    followers.push(tx);
                    return Join::Follower(rx);
                }
                let stale = live.insert(flight);
                let key = live.key().clone();
                flights.sealed.insert(stale.id, stale);
                key
            }
            EntryRef::Vacant(vacant) => vacant.insert_entry(flight).key().clone(),
        };
        flights.next_id = id;
        if flights.leading.is_none() {
            flights.leading = Some(self.shared.owed.hold());
        }
        Join::Leader(LeaderGuard {
            registry: self.clone(),
            key,
            id,
            done: false,
        })
    }

    /// Joins the flight of `key` until this caller leads or gets an outcome: a leader
    /// gone without one sends its followers back here, and the first to return leads.
    /// `ticket` gives the key's L1 ticket at each try.
    pub(crate) async fn lead_or_follow(
        &self,
        key: &str,
        ticket: impl Fn() -> Ticket,
    ) -> Result<LeaderGuard<T>, T> {
        loop {
            match self.join(key, ticket()) {
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
    /// Flights in progress (sealed ones included).
    pub(crate) fn len(&self) -> usize {
        let flights = self.shared.flights.lock();
        flights.by_key.len() + flights.sealed.len()
    }

    /// Callers waiting on the flight of `key`.
    #[cfg_attr(not(any(test, feature = "test-util")), allow(dead_code))]
    pub(crate) fn followers(&self, key: &str) -> usize {
        self.shared
            .flights
            .lock()
            .by_key
            .get(key)
            .map_or(0, |f| f.followers.iter().filter(|tx| !tx.is_closed()).count())
    }
}

/// Held by the leader. Finishing hands the outcome to the followers; dropping it
/// unfinished (cancellation, a trap, a panic) tells them the leader is gone. Either way
/// the entry leaves the map, exactly once.
pub(crate) struct LeaderGuard<T> {
    registry: Registry<T>,
    key: Arc<str>,
    /// Which flight of the key this is (the map's entry is this leader's own only if
    /// its id matches).
    id: u64,
    done: bool,
}

impl<T> fmt::Debug for LeaderGuard<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderGuard").field("key", &self.key).finish()
    }
}

impl<T: Clone> LeaderGuard<T> {
    pub(crate) fn finish(self, outcome: T) {
        self.finish_with(|| outcome.clone());
    }

    /// Hands each follower the outcome `outcome` makes (called once per follower: a
    /// flight without followers makes none).
    pub(crate) fn finish_with(mut self, outcome: impl Fn() -> T) {
        for tx in self.close() {
            let _ = tx.send(Shared::Done(outcome()));
        }
    }
}

impl<T> Registry<T> {
    /// Finishes the flights `finished` leads (this registry's), each with the outcome
    /// its function makes (called once per follower), as [`LeaderGuard::finish_with`]
    /// would one by one, with the map locked once.
    pub(crate) fn finish_all<F: Fn() -> T>(&self, finished: impl IntoIterator<Item = (LeaderGuard<T>, F)>) {
        let mut answered = Vec::new();
        {
            let mut flights = self.shared.flights.lock();
            for (mut guard, outcome) in finished {
                debug_assert!(Arc::ptr_eq(&guard.registry.shared, &self.shared));
                let followers = guard.close_in(&mut flights);
                if !followers.is_empty() {
                    answered.push((followers, outcome));
                }
            }
        }
        for (followers, outcome) in answered {
            for tx in followers {
                let _ = tx.send(Shared::Done(outcome()));
            }
        }
    }
}

impl<T> LeaderGuard<T> {
    /// Takes the flight out of the map (once, and only if it is this leader's own);
    /// its followers, in join order.
    fn close(&mut self) -> Vec<oneshot::Sender<Shared<T>>> {
        if self.done {
            return Vec::new();
        }
        self.done = true;
        take_flight(&mut self.registry.shared.flights.lock(), &self.key, self.id)
    }

    /// [`close`](Self::close) with the map (`flights`) locked already.
    fn close_in(&mut self, flights: &mut Flights<T>) -> Vec<oneshot::Sender<Shared<T>>> {
        if self.done {
            return Vec::new();
        }
        self.done = true;
        take_flight(flights, &self.key, self.id)
    }
}

/// Takes the flight `id` of `key` out of the map, live or sealed: its followers, in
/// join order.
fn take_flight<T>(flights: &mut Flights<T>, key: &str, id: u64) -> Vec<oneshot::Sender<Shared<T>>> {
    // One lookup for a live flight, the usual case: a newer flight of the key (this
    // one sealed) goes back.
    let taken = match flights.by_key.remove_entry(key) {
        Some((_, flight)) if flight.id == id => Some(flight),
        Some((key, newer)) => {
            flights.by_key.insert(key, newer);
            flights.sealed.remove(&id)
        }
        None => flights.sealed.remove(&id),
    };
    if flights.by_key.is_empty() && flights.sealed.is_empty() {
        flights.leading = None;
    }
    taken.map_or_else(Vec::new, |f| f.followers)
}

impl<T> Drop for LeaderGuard<T> {
    fn drop(&mut self) {
        for tx in self.close() {
            let _ = tx.send(Shared::Gone);
        }
    }
}

/// Waits for the leader's outcome; a leader that vanished without one counts as gone.
pub(crate) async fn follow<T>(rx: oneshot::Receiver<Shared<T>>) -> Shared<T> {
    rx.await.unwrap_or(Shared::Gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Ticket = Ticket::from_parts([0, 0, 0]);

    #[tokio::test]
    async fn a_flight_whose_key_changed_since_it_began_is_not_joined() {
        let registry = Registry::<&str>::default();
        let Join::Leader(old) = registry.join("k", T0) else {
            panic!("first is leader")
        };
        let Join::Follower(early) = registry.join("k", T0) else {
            panic!("a caller while nothing changed follows")
        };
        // The key was written (or a change heard) since the flight began.
        let later = Ticket::from_parts([0, 0, 1]);
        let Join::Leader(new) = registry.join("k", later) else {
            panic!("a caller after a change leads a new flight")
        };
        let Join::Follower(late) = registry.join("k", later) else {
            panic!("and the next caller follows the new one")
        };
        assert_eq!(registry.len(), 2);
        old.finish("old");
        new.finish("new");
        assert!(matches!(follow(early).await, Shared::Done("old")));
        assert!(matches!(follow(late).await, Shared::Done("new")));
        assert_eq!(registry.len(), 0);
    }

    #[tokio::test]
    async fn flights_finished_together_answer_each_its_own_followers() {
        let registry = Registry::<&str>::default();
        let Join::Leader(a) = registry.join("a", T0) else {
            panic!("first is leader")
        };
        let Join::Leader(b) = registry.join("b", T0) else {
            panic!("first is leader")
        };
        let Join::Follower(on_a) = registry.join("a", T0) else {
            panic!("second follows")
        };
        // A sealed flight (its key changed since it began) ends with the others.
        let Join::Leader(new_a) = registry.join("a", Ticket::from_parts([0, 0, 1])) else {
            panic!("a caller after a change leads a new flight")
        };
        let Join::Follower(on_b) = registry.join("b", T0) else {
            panic!("second follows")
        };
        let done = |v: &'static str| move || v;
        registry.finish_all([(a, done("A")), (b, done("B")), (new_a, done("new A"))]);
        assert!(matches!(follow(on_a).await, Shared::Done("A")));
        assert!(matches!(follow(on_b).await, Shared::Done("B")));
        assert_eq!(registry.len(), 0);
    }

    #[tokio::test]
    async fn the_flights_count_as_owed_work_while_any_leads() {
        let owed = Owed::default();
        let registry = Registry::<&str>::counted(&owed);
        let Join::Leader(a) = registry.join("a", T0) else {
            panic!("first is leader")
        };
        let Join::Leader(b) = registry.join("b", T0) else {
            panic!("first is leader")
        };
        assert_eq!(owed.pending(), 1, "one count for the flights under way");
        a.finish("A");
        assert_eq!(owed.pending(), 1, "b still leads");
        drop(b);
        assert_eq!(owed.pending(), 0, "none leads");
        let Join::Leader(c) = registry.join("c", T0) else {
            panic!("first is leader")
        };
        assert_eq!(owed.pending(), 1);
        registry.finish_all([(c, || "C")]);
        assert_eq!(owed.pending(), 0);
    }

    #[tokio::test]
    async fn followers_get_the_leaders_outcome_and_the_map_empties() {
        let registry = Registry::<&str>::default();
        let Join::Leader(leader) = registry.join("k", T0) else {
            panic!("first is leader")
        };
        let Join::Follower(rx) = registry.join("k", T0) else {
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
        let Join::Leader(leader) = registry.join("k", T0) else {
            panic!()
        };
        let follower = tokio::spawn({
            let registry = registry.clone();
            async move {
                registry
                    .lead_or_follow("k", || T0)
                    .await
                    .map(|g| g.key.to_string())
            }
        });
        while registry.followers("k") == 0 {
            tokio::task::yield_now().await;
        }
        drop(leader);
        assert_eq!(follower.await.unwrap().unwrap(), "k", "the follower leads now");
        assert_eq!(registry.len(), 0);
    }
}
