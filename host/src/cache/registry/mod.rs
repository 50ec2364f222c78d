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
use std::hash::BuildHasher;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use foldhash::fast::SeedableRandomState;
use hashbrown::HashTable;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::Error;
use crate::owed::{Owed, Pending};
use crate::store::l1::Ticket;

mod peek;
use peek::{Ended, Peeking};
pub(crate) use peek::{Peek, Settled};

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
    /// The live flights, by key (each found by its key's hash). Hashed with foldhash
    /// (randomly seeded, weaker against crafted collisions than SipHash): the table
    /// holds only the keys with a flight under way.
    by_key: HashTable<Live<T>>,
    hasher: SeedableRandomState,
    /// Flights no caller may join any more (their key changed since they began), by id,
    /// until their leaders finish.
    sealed: HashMap<u64, Flight<T>>,
    next_id: u64,
    /// Counted in the cache's owed work while any flight leads: one count for them all
    /// (see [`Corral::close`](crate::Corral::close)), not one per key of a batch.
    leading: Option<Pending>,
    /// The batch reading keys it has not joined ([`Registry::peek`]), if one does. One
    /// at a time: the others join first.
    peeking: Option<Peeking>,
    /// While a batch reads before joining: the flights of its keys that began and ended
    /// since it looked, each key's last, for it to follow after its read.
    ended: HashTable<Ended<T>>,
}

/// A live flight in the table, with its key and the key's hash.
struct Live<T> {
    hash: u64,
    key: FlightKey,
    flight: Flight<T>,
}

/// A flight's key: its own text, or its place in the text of a batch's keys (one
/// allocation for them all).
struct FlightKey {
    text: Arc<str>,
    at: Range<usize>,
}

impl FlightKey {
    fn as_str(&self) -> &str {
        &self.text[self.at.clone()]
    }
}

/// `keys` joined in one allocation, and where each is in it, in order: the text the
/// flights of a batch's keys share.
fn joined<'k>(keys: impl Iterator<Item = &'k str> + Clone) -> (Arc<str>, impl Iterator<Item = Range<usize>>) {
    let text = keys.clone().collect::<String>().into();
    let ranges = keys.scan(0, |at, key| {
        let range = *at..*at + key.len();
        *at = range.end;
        Some(range)
    });
    (text, ranges)
}

/// Where a joining key's text lives, should it lead.
enum KeyText<'a> {
    /// Its own (allocated if it leads).
    Own,
    /// In a batch's keys, at this range.
    In(&'a Arc<str>, Range<usize>),
}

/// The flights of one cache, by key. Cheap to clone; clones share the map.
pub(crate) struct Registry<T> {
    shared: Arc<Table<T>>,
}

/// What a registry's clones share.
struct Table<T> {
    flights: Mutex<Flights<T>>,
    /// The flights' hasher (a copy), for hashing keys before the lock is taken.
    hasher: SeedableRandomState,
    /// How many flights began of keys the reading batch holds ([`Registry::peek`]),
    /// readable without the lock: a batch about to fill L1 with its reads sees at once
    /// whether any flight of its keys began since it settled ([`Peek::overtook`]).
    peeked_begun: AtomicU64,
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
        Registry::counted_hashing(owed, SeedableRandomState::random())
    }

    /// [`counted`](Self::counted), its keys hashed by `hasher` (randomly seeded): a
    /// batch that hashed its keys with the same one for its names' table hashes them
    /// once ([`peek`](Self::peek), [`settle`](Self::settle)).
    pub(crate) fn counted_hashing(owed: &Owed, hasher: SeedableRandomState) -> Self {
        Registry {
            shared: Arc::new(Table {
                hasher: hasher.clone(),
                flights: Mutex::new(Flights {
                    by_key: HashTable::new(),
                    hasher,
                    sealed: HashMap::new(),
                    next_id: 0,
                    leading: None,
                    peeking: None,
                    ended: HashTable::new(),
                }),
                peeked_begun: AtomicU64::new(0),
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
        self.join_in(&mut self.shared.flights.lock(), key, KeyText::Own, ticket)
    }

    /// [`join`](Self::join) for each of `keys` (each with its ticket now, `ticket`), in
    /// order, with the map locked once. The keys that lead share one allocation of
    /// their text.
    pub(crate) fn join_many<'k, K>(&self, keys: K, ticket: impl Fn(&str) -> Ticket) -> Vec<Join<T>>
    where
        K: IntoIterator<Item = &'k str>,
        K::IntoIter: ExactSizeIterator + Clone,
    {
        self.join_all_in(&mut self.shared.flights.lock(), keys.into_iter(), ticket)
    }

    /// [`join_many`](Self::join_many) with the map (`flights`) locked already.
    fn join_all_in<'k>(
        &self,
        flights: &mut Flights<T>,
        keys: impl ExactSizeIterator<Item = &'k str> + Clone,
        ticket: impl Fn(&str) -> Ticket,
    ) -> Vec<Join<T>> {
        let (text, ranges) = joined(keys.clone());
        keys.zip(ranges)
            .map(|(key, range)| self.join_in(flights, key, KeyText::In(&text, range), ticket(key)))
            .collect()
    }

    fn join_in(&self, flights: &mut Flights<T>, key: &str, text: KeyText<'_>, ticket: Ticket) -> Join<T> {
        let hash = flights.hasher.hash_one(key);
        self.join_hashed(flights, hash, key, text, ticket)
    }

    /// [`join_in`](Self::join_in) of `key`, hashed `hash`.
    fn join_hashed(
        &self,
        flights: &mut Flights<T>,
        hash: u64,
        key: &str,
        text: KeyText<'_>,
        ticket: Ticket,
    ) -> Join<T> {
        let id = flights.next_id + 1;
        let flight = Flight {
            id,
            ticket,
            followers: Vec::new(),
        };
        // One lookup: the key's flight is followed, sealed and replaced, or begun.
        match flights.by_key.find_mut(hash, |live| live.key.as_str() == key) {
            Some(live) if ticket.key_unchanged_since(live.flight.ticket) => {
                let (tx, rx) = oneshot::channel();
                let followers = &mut live.flight.followers;
                // Followers that gave up leave their sender behind: drop those first.
                followers.retain(|f| !f.is_closed());
                followers.push(tx);
                return Join::Follower(rx);
            }
            Some(live) => {
                let stale = std::mem::replace(&mut live.flight, flight);
                flights.sealed.insert(stale.id, stale);
            }
            None => {
                let key = match text {
                    KeyText::Own => FlightKey {
                        text: key.into(),
                        at: 0..key.len(),
                    },
                    KeyText::In(text, at) => FlightKey {
                        text: text.clone(),
                        at,
                    },
                };
                flights
                    .by_key
                    .insert_unique(hash, Live { hash, key, flight }, |live| live.hash);
            }
        }
        flights.next_id = id;
        if flights.peeking.as_mut().is_some_and(|p| p.holds(hash)) {
            self.shared.peeked_begun.fetch_add(1, Ordering::Release);
        }
        if flights.leading.is_none() {
            flights.leading = Some(self.shared.owed.hold());
        }
        Join::Leader(LeaderGuard {
            registry: self.clone(),
            hash,
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
        let flights = self.shared.flights.lock();
        let hash = flights.hasher.hash_one(key);
        flights
            .by_key
            .find(hash, |live| live.key.as_str() == key)
            .map_or(0, |live| {
                live.flight.followers.iter().filter(|tx| !tx.is_closed()).count()
            })
    }
}

/// Held by the leader. Finishing hands the outcome to the followers; dropping it
/// unfinished (cancellation, a trap, a panic) tells them the leader is gone. Either way
/// the entry leaves the map, exactly once.
pub(crate) struct LeaderGuard<T> {
    registry: Registry<T>,
    /// The key's hash: where its flight is in the table.
    hash: u64,
    /// Which flight of the key this is (the table's entry is this leader's own only if
    /// its id matches).
    id: u64,
    done: bool,
}

impl<T> fmt::Debug for LeaderGuard<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderGuard").field("flight", &self.id).finish()
    }
}

impl<T: Clone> LeaderGuard<T> {
    pub(crate) fn finish(self, outcome: T) {
        self.finish_with(|| outcome.clone());
    }

    /// Hands each follower the outcome `outcome` makes (called once per follower: a
    /// flight without followers makes none).
    pub(crate) fn finish_with(mut self, outcome: impl Fn() -> T) {
        for tx in self.close(Some(&outcome)) {
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
                let followers = guard.close_in(&mut flights, Some(&outcome));
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
    /// its followers, in join order. `outcome` makes what they get (`None`: the leader
    /// went away), for a batch that read the key before joining it.
    fn close(&mut self, outcome: Option<&dyn Fn() -> T>) -> Vec<oneshot::Sender<Shared<T>>> {
        if self.done {
            return Vec::new();
        }
        let registry = self.registry.clone();
        self.close_in(&mut registry.shared.flights.lock(), outcome)
    }

    /// [`close`](Self::close) with the map (`flights`) locked already.
    fn close_in(
        &mut self,
        flights: &mut Flights<T>,
        outcome: Option<&dyn Fn() -> T>,
    ) -> Vec<oneshot::Sender<Shared<T>>> {
        if self.done {
            return Vec::new();
        }
        self.done = true;
        take_flight(flights, self.hash, self.id, outcome)
    }
}

/// Takes the flight `id` (of the key hashed `hash`) out of the map, live or sealed: its
/// followers, in join order. A live one is kept as ended while a batch that looked at
/// its key before it began reads ([`Registry::peek`]), with the outcome `outcome` makes.
fn take_flight<T>(
    flights: &mut Flights<T>,
    hash: u64,
    id: u64,
    outcome: Option<&dyn Fn() -> T>,
) -> Vec<oneshot::Sender<Shared<T>>> {
    // Found by its id among the key's hash: no key to compare, none kept to find it.
    let taken = match flights.by_key.find_entry(hash, |live| live.flight.id == id) {
        Ok(live) => {
            let Live { key, flight, .. } = live.remove().0;
            if flights.peeked(hash, id) {
                flights.keep_ended(Ended {
                    hash,
                    key,
                    id,
                    ticket: flight.ticket,
                    outcome: outcome.map(|made| made()),
                });
            }
            Some(flight)
        }
        // A sealed flight's key has a newer flight, which a batch follows instead.
        Err(_) => flights.sealed.remove(&id),
    };
    if flights.by_key.is_empty() && flights.sealed.is_empty() {
        flights.leading = None;
    }
    taken.map_or_else(Vec::new, |f| f.followers)
}

impl<T> Drop for LeaderGuard<T> {
    fn drop(&mut self) {
        for tx in self.close(None) {
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
            async move { registry.lead_or_follow("k", || T0).await.map(|g| g.id) }
        });
        while registry.followers("k") == 0 {
            tokio::task::yield_now().await;
        }
        drop(leader);
        assert!(follower.await.unwrap().is_ok(), "the follower leads now");
        assert_eq!(registry.len(), 0);
    }
}
