//! A batch that reads before it joins (contract §5.16). Joining a key only to end its
//! flight at once is most of what a batch of fresh hits would cost the registry, so a
//! batch looks first ([`Registry::peek`]): a key with a flight under way is joined as
//! ever; the others are read, and only those their reads did not answer are joined,
//! after the read ([`Registry::settle`]). Single flight holds as if the batch had joined
//! first: a flight of such a key that another caller begins while the batch reads is
//! followed, running or ended (the registry keeps what the flights of the batch's keys
//! ended with until the batch settles). One batch reads so at a time; a batch that
//! comes meanwhile joins every key first, so batches that overlap share their reads.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;

use hashbrown::HashTable;

use super::{FlightKey, Flights, Join, KeyText, Registry, joined};
use crate::store::l1::Ticket;

/// The batch reading before it joins.
pub(super) struct Peeking {
    /// The last flight id when it looked: a flight with a greater one began since.
    looked: u64,
    /// The hashes of the keys it reads before joining; sorted once a flight's end
    /// first asks (most batches end before any does).
    keys: Vec<u64>,
    sorted: bool,
    /// A Bloom filter of `keys` (one bit each, about 16 bits per key): most flights
    /// that end while the batch reads are of other keys, and need no look at `keys`.
    bloom: Vec<u64>,
}

impl Peeking {
    fn new(looked: u64, keys: Vec<u64>) -> Self {
        let bits = (keys.len() * 16).next_power_of_two().clamp(64, 1 << 20);
        let mut bloom = vec![0u64; bits / 64];
        for &hash in &keys {
            let bit = Self::bit(hash, bits);
            bloom[bit / 64] |= 1 << (bit % 64);
        }
        Peeking {
            looked,
            keys,
            sorted: false,
            bloom,
        }
    }

    /// Where `hash` is in a filter of `bits` bits (the hash's high bits: its low ones
    /// placed it in the map).
    fn bit(hash: u64, bits: usize) -> usize {
        (hash >> 40) as usize & (bits - 1)
    }

    pub(super) fn holds(&mut self, hash: u64) -> bool {
        let bit = Self::bit(hash, self.bloom.len() * 64);
        if self.bloom[bit / 64] & (1 << (bit % 64)) == 0 {
            return false;
        }
        if !self.sorted {
            self.keys.sort_unstable();
            self.sorted = true;
        }
        self.keys.binary_search(&hash).is_ok()
    }
}

/// A flight of a key a batch reads before joining that ended while it read.
pub(super) struct Ended<T> {
    pub(super) hash: u64,
    pub(super) key: FlightKey,
    pub(super) id: u64,
    /// The key's ticket when the flight began.
    pub(super) ticket: Ticket,
    /// What its followers got (`None`: its leader went away without an outcome).
    pub(super) outcome: Option<T>,
}

/// A batch's look at its keys before reading them ([`Registry::peek`]): over when
/// dropped, once the batch [`settled`](Registry::settle) and filled L1 with its hits.
pub(crate) struct Peek<T> {
    registry: Registry<T>,
    /// The last flight id when the batch looked.
    looked: u64,
    /// When the batch settled (its own joins among them): the last flight id, and how
    /// many flights of the keys it holds had begun.
    settled: (u64, u64),
    /// Nothing to end: the batch read nothing before joining.
    done: bool,
}

impl<T> Peek<T> {
    /// Whether a flight of `key`, a key the batch answered from its read, began since
    /// the batch settled: it runs, or it ran while the batch filled L1. Asked as the
    /// batch fills L1 with the key's read (its stripe held: no fill of the key runs
    /// meanwhile), so a flight that filled L1 with what it found after the batch's
    /// read is never overwritten by that read; one that begins later fills after it.
    /// (One that began before the settle is among [`settle`](Registry::settle)'s
    /// overtaken keys.)
    pub(crate) fn overtook(&self, key: &str) -> bool {
        let shared = &self.registry.shared;
        let (last_id, begun) = self.settled;
        if self.done || shared.peeked_begun.load(Ordering::Acquire) == begun {
            return false;
        }
        // A flight of this batch's own (one it led from the look, or joined settling)
        // began before the settle: not one that overtook it.
        shared.flights.lock().began_since(key, last_id)
    }
}

impl<T> Drop for Peek<T> {
    fn drop(&mut self) {
        if !self.done {
            let ended = self.registry.shared.flights.lock().unpeek();
            drop(ended); // outcomes, dropped outside the lock
        }
    }
}

/// How a key a batch read before joining it was joined ([`Registry::settle`]).
pub(crate) enum Settled<T> {
    /// Joined now; `true`: its leader reads the key again (a flight of it began since
    /// the look, or the key changed since the batch's read: the read may be older than
    /// what the key holds now).
    Joined(Join<T>, bool),
    /// A flight of the key began and ended since the look: its outcome.
    Ended(T),
}

impl<T: Clone> Registry<T> {
    /// [`peek`](Self::peek) of keys it hashes itself.
    #[cfg(test)]
    pub(crate) fn peek_keys<'k, K>(
        &self,
        keys: K,
        ticket: impl Fn(&str) -> Ticket,
    ) -> (Peek<T>, Vec<Option<Join<T>>>)
    where
        K: IntoIterator<Item = &'k str>,
        K::IntoIter: ExactSizeIterator + Clone,
    {
        let hasher = &self.shared.hasher;
        self.peek(keys.into_iter().map(|key| (key, hasher.hash_one(key))), ticket)
    }

    /// The hash of `key` by this registry's hasher: what [`peek`](Self::peek) and
    /// [`settle`](Self::settle) take with each key.
    #[cfg(test)]
    pub(crate) fn hash(&self, key: &str) -> u64 {
        self.shared.hasher.hash_one(key)
    }

    /// A batch's look at `keys` (each with its ticket now, `ticket`) before it reads
    /// them, with the map locked once: a key with a flight under way joins it (`Some`,
    /// as [`join`](Self::join)); the others (`None`) are read before they join, and
    /// joined by [`settle`](Self::settle) only if their reads did not answer them; the
    /// list is empty when no key joined (no flight was under way: every key is read
    /// first). While another batch reads so, every key joins now, as
    /// [`join_many`](Self::join_many) joins them.
    ///
    /// Each key comes with its hash by this registry's hasher (the one it was [made
    /// with](Self::counted_hashing)): none is hashed under the lock.
    pub(crate) fn peek<'k, K>(
        &self,
        keys: K,
        ticket: impl Fn(&str) -> Ticket,
    ) -> (Peek<T>, Vec<Option<Join<T>>>)
    where
        K: IntoIterator<Item = (&'k str, u64)>,
        K::IntoIter: ExactSizeIterator + Clone,
    {
        let keys = keys.into_iter();
        debug_assert!(
            keys.clone()
                .all(|(key, hash)| hash == self.shared.hasher.hash_one(key)),
            "a key hashed by another hasher"
        );
        let mut flights = self.shared.flights.lock();
        let looked = flights.next_id;
        let peek = |done| Peek {
            registry: self.clone(),
            looked,
            settled: (looked, 0),
            done,
        };
        if flights.peeking.is_some() {
            let joins = self.join_all_in(&mut flights, keys.map(|(key, _)| key), ticket);
            return (peek(true), joins.into_iter().map(Some).collect());
        }
        let mut unjoined = Vec::with_capacity(keys.len());
        let joins = if flights.by_key.is_empty() {
            // No flight under way: nothing to join, no list of `None`s.
            unjoined.extend(keys.map(|(_, hash)| hash));
            Vec::new()
        } else {
            keys.map(|(key, hash)| {
                if flights
                    .by_key
                    .find(hash, |live| live.key.as_str() == key)
                    .is_some()
                {
                    return Some(self.join_hashed(&mut flights, hash, key, KeyText::Own, ticket(key)));
                }
                unjoined.push(hash);
                None
            })
            .collect()
        };
        if unjoined.is_empty() {
            return (peek(true), joins);
        }
        flights.peeking = Some(Peeking::new(looked, unjoined));
        (peek(false), joins)
    }

    /// [`settle`](Self::settle) of keys it hashes itself.
    #[cfg(test)]
    pub(crate) fn settle_keys<'k, M>(
        &self,
        peek: &mut Peek<T>,
        misses: M,
        hits: impl IntoIterator<Item = &'k str>,
        ticket: impl Fn(&str) -> Ticket,
    ) -> (Vec<Settled<T>>, Vec<usize>)
    where
        M: IntoIterator<Item = (&'k str, Ticket)>,
        M::IntoIter: ExactSizeIterator + Clone,
    {
        let hasher = &self.shared.hasher;
        let misses = misses
            .into_iter()
            .map(|(key, read)| (key, hasher.hash_one(key), read));
        let hits = hits.into_iter().map(|key| (key, hasher.hash_one(key)));
        self.settle(peek, misses, hits, ticket)
    }

    /// Settles `peek`, with the map locked once. Joins, in order, the keys it read whose
    /// reads did not answer them (`misses`, each with the ticket taken before its read;
    /// `ticket` gives each key's ticket now); the keys that lead share one allocation of
    /// their text. Returns how each was joined, and the positions among `hits` (the
    /// keys it answered from their reads) of those a flight of began since the look:
    /// they do not fill L1 (that flight may have filled it with what it found after the
    /// batch's read). A flight that begins later is caught as the batch fills
    /// ([`Peek::overtook`]): the look goes on until `peek` is dropped.
    ///
    /// Each key comes with its hash by this registry's hasher (the one it was [made
    /// with](Self::counted_hashing)): none is hashed under the lock.
    pub(crate) fn settle<'k, M>(
        &self,
        peek: &mut Peek<T>,
        misses: M,
        hits: impl IntoIterator<Item = (&'k str, u64)>,
        ticket: impl Fn(&str) -> Ticket,
    ) -> (Vec<Settled<T>>, Vec<usize>)
    where
        M: IntoIterator<Item = (&'k str, u64, Ticket)>,
        M::IntoIter: ExactSizeIterator + Clone,
    {
        let misses = misses.into_iter();
        debug_assert!(
            misses
                .clone()
                .all(|(key, hash, _)| hash == self.shared.hasher.hash_one(key)),
            "a key hashed by another hasher"
        );
        let (text, ranges) = joined(misses.clone().map(|(key, _, _)| key));
        let mut settled = Vec::with_capacity(misses.len());
        let mut flights = self.shared.flights.lock();
        let looked = peek.looked;
        let any_began = flights.next_id != looked;
        for ((key, hash, read), range) in misses.zip(ranges) {
            let now = ticket(key);
            let began = flights
                .by_key
                .find(hash, |live| live.key.as_str() == key)
                .is_some();
            let ended = flights
                .ended
                .find(hash, |e| e.key.as_str() == key)
                .filter(|e| e.id > looked)
                .map(|e| e.outcome.clone().filter(|_| now.key_unchanged_since(e.ticket)));
            let mut join = |text, ticket| self.join_hashed(&mut flights, hash, key, text, ticket);
            settled.push(match (began, ended) {
                // A flight began since the look and runs: followed (or, its key changed
                // since it began, sealed and led anew).
                (true, _) => Settled::Joined(join(KeyText::Own, now), true),
                // One began and ended: its outcome, as its followers got it.
                (false, Some(Some(outcome))) => Settled::Ended(outcome),
                // One ended without an outcome, or the key changed since it began.
                (false, Some(None)) => Settled::Joined(join(KeyText::Own, now), true),
                // None began since the look: led from the read, as of the read (a
                // caller after a change since seals it), unless the key changed since.
                (false, None) if now.key_unchanged_since(read) => {
                    Settled::Joined(join(KeyText::In(&text, range), read), false)
                }
                (false, None) => Settled::Joined(join(KeyText::In(&text, range), now), true),
            });
        }
        let overtaken = if any_began {
            hits.into_iter()
                .enumerate()
                .filter(|(_, (key, hash))| flights.began_since_hashed(*hash, key, looked))
                .map(|(i, _)| i)
                .collect()
        } else {
            Vec::new()
        };
        // The look goes on until the batch has filled L1 with its hits (`Peek::overtook`).
        peek.settled = (flights.next_id, self.shared.peeked_begun.load(Ordering::Acquire));
        (settled, overtaken)
    }
}

impl<T> Flights<T> {
    /// Whether the flight `id` of the key hashed `hash` is one a batch reading before
    /// it joins is to hear of: of one of its keys, begun since it looked.
    pub(super) fn peeked(&mut self, hash: u64, id: u64) -> bool {
        self.peeking
            .as_mut()
            .is_some_and(|p| id > p.looked && p.holds(hash))
    }

    /// Keeps `ended` as its key's last ended flight.
    pub(super) fn keep_ended(&mut self, ended: Ended<T>) {
        let key = ended.key.as_str();
        match self.ended.find_mut(ended.hash, |e| e.key.as_str() == key) {
            Some(last) => *last = ended,
            None => {
                self.ended.insert_unique(ended.hash, ended, |e| e.hash);
            }
        }
    }

    /// Whether a flight of `key` began since the last flight id was `since`: it runs,
    /// or it ended (kept, `key` being a key the reading batch looked at).
    fn began_since(&self, key: &str, since: u64) -> bool {
        self.began_since_hashed(self.hasher.hash_one(key), key, since)
    }

    /// [`began_since`](Self::began_since) of `key`, hashed `hash`.
    fn began_since_hashed(&self, hash: u64, key: &str, since: u64) -> bool {
        self.by_key
            .find(hash, |live| live.key.as_str() == key)
            .is_some_and(|live| live.flight.id > since)
            || self
                .ended
                .find(hash, |e| e.key.as_str() == key)
                .is_some_and(|e| e.id > since)
    }

    /// The end of a batch's look: what ended meanwhile, to be dropped once the map is
    /// unlocked.
    fn unpeek(&mut self) -> HashTable<Ended<T>> {
        self.peeking = None;
        std::mem::take(&mut self.ended)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Join, Registry};
    use super::*;

    const T0: Ticket = Ticket::from_parts([0, 0, 0]);
    const CHANGED: Ticket = Ticket::from_parts([0, 0, 1]);

    fn kept(r: &Registry<&str>) -> usize {
        r.shared.flights.lock().ended.len()
    }

    fn lead(r: &Registry<&'static str>, key: &str) -> super::super::LeaderGuard<&'static str> {
        let Join::Leader(guard) = r.join(key, T0) else {
            panic!("no flight of {key} ran")
        };
        guard
    }

    #[tokio::test]
    async fn a_batch_that_reads_before_joining_gets_what_began_meanwhile() {
        let registry = Registry::<&str>::default();
        let under_way = lead(&registry, "a");
        let (mut peek, looked) = registry.peek_keys(["a", "b", "c", "d", "e"], |_| T0);
        assert!(
            matches!(looked[0], Some(Join::Follower(_))),
            "a flight under way is followed"
        );
        assert!(
            looked[1..].iter().all(Option::is_none),
            "the others are read first"
        );
        // While the batch reads: b's flight begins and ends, c's begins and runs, e's
        // begins and ends too (e's read was a hit); d sees none.
        lead(&registry, "b").finish("B");
        let c = lead(&registry, "c");
        lead(&registry, "e").finish("E");
        let (settled, overtaken) =
            registry.settle_keys(&mut peek, [("b", T0), ("c", T0), ("d", T0)], ["e"], |_| T0);
        assert!(matches!(settled[0], Settled::Ended("B")));
        assert!(matches!(&settled[1], Settled::Joined(Join::Follower(_), true)));
        assert!(matches!(&settled[2], Settled::Joined(Join::Leader(_), false)));
        assert_eq!(overtaken, [0], "e's hit may have filled L1 over e's flight");
        drop(peek);
        assert_eq!(kept(&registry), 0, "no batch reads: nothing kept");
        drop((under_way, c, settled));
        assert_eq!(registry.len(), 0);
    }

    #[tokio::test]
    async fn a_flight_ended_meanwhile_is_not_followed_across_a_change_or_a_leader_gone() {
        let registry = Registry::<&str>::default();
        let (mut peek, _) = registry.peek_keys(["a", "b", "c"], |_| T0);
        lead(&registry, "a").finish("A");
        drop(lead(&registry, "b"));
        // a was written since its flight began, b's leader went away, c was written
        // since the batch read it: each led, and read again.
        let now = |k: &str| if k == "b" { T0 } else { CHANGED };
        let (settled, _) = registry.settle_keys(&mut peek, [("a", T0), ("b", T0), ("c", T0)], [], now);
        drop(peek);
        for s in &settled {
            assert!(matches!(s, Settled::Joined(Join::Leader(_), true)));
        }
        // c's flight began as of now: a caller now follows it.
        assert!(matches!(registry.join("c", CHANGED), Join::Follower(_)));
    }

    #[tokio::test]
    async fn a_flight_led_from_a_read_is_sealed_for_a_caller_after_a_change_since_the_read() {
        let registry = Registry::<&str>::default();
        let (mut peek, _) = registry.peek_keys(["k"], |_| T0);
        // The batch read k as of T0; nothing changed since: led from its read.
        let (settled, _) = registry.settle_keys(&mut peek, [("k", T0)], [], |_| T0);
        drop(peek);
        assert!(matches!(&settled[0], Settled::Joined(Join::Leader(_), false)));
        assert!(matches!(registry.join("k", T0), Join::Follower(_)));
        assert!(matches!(registry.join("k", CHANGED), Join::Leader(_)), "sealed");
    }

    #[tokio::test]
    async fn only_the_reading_batchs_keys_are_kept_and_one_batch_reads_at_a_time() {
        let registry = Registry::<&str>::default();
        let (first, looked) = registry.peek_keys(["a", "b"], |_| T0);
        assert!(looked.iter().all(Option::is_none));
        // A batch while the first reads joins first: it leads its keys, and the first
        // follows it after its read.
        let (second, joined) = registry.peek_keys(["b", "c"], |_| T0);
        assert!(matches!(
            joined[..],
            [Some(Join::Leader(_)), Some(Join::Leader(_))]
        ));
        drop((second, joined));
        assert_eq!(kept(&registry), 1, "b, of the first batch, is kept; c is not");
        lead(&registry, "x").finish("X");
        assert_eq!(kept(&registry), 1, "nor is a key no batch reads");
        drop(first); // cancelled while it read
        assert_eq!(kept(&registry), 0, "nothing kept once no batch reads");
        lead(&registry, "a").finish("A");
        assert_eq!(kept(&registry), 0);
        let (mut third, looked) = registry.peek_keys(["a"], |_| T0);
        assert!(looked.is_empty(), "the next batch reads first again");
        let (settled, overtaken) = registry.settle_keys(&mut third, [("a", T0)], [], |_| T0);
        assert!(matches!(&settled[0], Settled::Joined(Join::Leader(_), false)));
        assert!(overtaken.is_empty());
        assert!(
            registry.shared.flights.lock().peeking.is_some(),
            "until it filled L1"
        );
        drop(third);
        assert!(registry.shared.flights.lock().peeking.is_none());
    }

    #[tokio::test]
    async fn a_flight_that_begins_after_the_settle_overtakes_the_batchs_hits_until_it_filled() {
        let registry = Registry::<&str>::default();
        let (mut peek, _) = registry.peek_keys(["hit", "miss", "other"], |_| T0);
        let (settled, overtaken) = registry.settle_keys(&mut peek, [("miss", T0)], ["hit", "other"], |_| T0);
        assert!(overtaken.is_empty());
        assert!(
            !peek.overtook("hit") && !peek.overtook("other"),
            "its own join of a miss overtakes none of its hits"
        );
        // After the settle, before the batch fills L1: a flight of `hit` begins and
        // ends (it may have filled L1 with what it read after the batch); another of a
        // key the batch did not read runs.
        lead(&registry, "hit").finish("newer");
        let _elsewhere = lead(&registry, "elsewhere");
        assert!(peek.overtook("hit"), "an ended flight of the key");
        assert!(!peek.overtook("other"), "a flight of another key");
        let running = lead(&registry, "other");
        assert!(peek.overtook("other"), "a running flight of the key");
        assert!(
            !peek.overtook("miss"),
            "the batch's own flight, joined as it settled"
        );
        drop((peek, settled, running));
        assert_eq!(kept(&registry), 0, "nothing kept once the batch filled");
    }

    #[tokio::test]
    async fn a_hit_the_batch_leads_from_its_look_is_not_overtaken_by_its_own_flight() {
        let registry = Registry::<&str>::default();
        // A flight of `led` runs as of a ticket its key has since left: the batch seals
        // it and leads its own from the look; `read` has none.
        let old = lead(&registry, "led");
        let (mut peek, looked) = registry.peek_keys(["led", "read"], |_| CHANGED);
        assert!(matches!(looked[0], Some(Join::Leader(_))), "sealed and led anew");
        let (settled, _) = registry.settle_keys(&mut peek, [], ["read"], |_| CHANGED);
        // Another caller's flight of a key of the batch begins after the settle: the
        // check is made, and the batch's own flight of `led` is not counted.
        let _other = lead(&registry, "read");
        assert!(peek.overtook("read"));
        assert!(!peek.overtook("led"), "its own flight, led since the look");
        drop((peek, looked, settled, old));
    }

    #[test]
    fn a_reading_batch_holds_each_of_its_keys_and_few_others() {
        let hasher = foldhash::fast::RandomState::default();
        for n in [1usize, 100, 10_000] {
            let hashes: Vec<u64> = (0..n).map(|i| hasher.hash_one(format!("k{i}"))).collect();
            let mut peeking = Peeking::new(0, hashes.clone());
            assert!(hashes.iter().all(|&h| peeking.holds(h)), "{n} keys");
            let others = (0..1000).filter(|i| peeking.holds(hasher.hash_one(format!("other{i}"))));
            assert_eq!(
                others.count(),
                0,
                "{n} keys: a hash is held only if it is one of them"
            );
        }
    }

    #[tokio::test]
    async fn a_batch_whose_keys_all_had_flights_reads_nothing_before_joining() {
        let registry = Registry::<&str>::default();
        let _a = lead(&registry, "a");
        let (peek, looked) = registry.peek_keys(["a"], |_| T0);
        assert!(matches!(looked[..], [Some(Join::Follower(_))]));
        assert!(registry.shared.flights.lock().peeking.is_none());
        drop(peek);
    }
}
