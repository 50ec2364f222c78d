//! The entry names the guest gave lately, remembered: a key read again in the same
//! generation is named without a guest call.
//!
//! An entry's name is the guest's (`locate-entry`): a function of the cache's prefix,
//! its limits, the key and the generation, the first two fixed for a cache. So what
//! the guest answered once for a key in a generation is its answer for good, and this
//! table only remembers answers: it decides nothing. It is lossy (a slot holds the
//! four keys hashed to it last), bounded (slots and the key length it keeps), and a
//! slot is trusted only for the very key and generation it holds, so a collision,
//! hostile or not, costs a guest call and never a wrong name.

use std::hash::BuildHasher;

use foldhash::fast::SeedableRandomState;
use parking_lot::Mutex;

use crate::guest::convert::Parts;
use crate::hint::prefetch;

/// Keys longer than this are always named by the guest (bounds what the table holds).
const LONGEST_KEY: usize = 256;

/// The keys a slot holds. Four: the keys of a batch of a hundred, spread over the
/// smallest table, all fit (a slot that a fifth key reaches is about one in a thousand
/// tables); two ways made one process in several rename keys of every batch.
const WAYS: usize = 4;

/// One remembered answer.
struct Named<N> {
    /// The key's hash, compared before the key itself.
    hash: u64,
    generation: u64,
    key: Box<str>,
    name: N,
}

/// A slot's ways, the one kept last first.
type Slot<N> = [Option<Named<N>>; WAYS];

/// A slot with its lock, starting a cache line: its lock and the way kept last (the
/// one most lookups find) share that line.
#[repr(align(64))]
struct Locked<N>(Mutex<Slot<N>>);

/// Names of type `N` (an entry's, or all of a key's: WIT `store-names`) by key and
/// generation.
pub(crate) struct Names<N> {
    slots: Box<[Locked<N>]>,
    hasher: SeedableRandomState,
}

impl<N> std::fmt::Debug for Names<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Names").field("slots", &self.slots.len()).finish()
    }
}

impl<N: Clone> Names<N> {
    /// A table for about `capacity` keys (as many as L1 holds), between 512 and 2,048
    /// slots of four keys each. At most each key (up to 256 bytes) and what the guest
    /// named it (each name about the prefix and twice the key, escaped): with all five
    /// of a key's names and the default prefix, about 24 MiB at the very worst.
    pub(crate) fn new(capacity: u64) -> Self {
        Self::with_hasher(capacity, SeedableRandomState::random())
    }

    /// [`new`](Self::new), its keys hashed by `hasher` (a seed of its own, in tests).
    fn with_hasher(capacity: u64, hasher: SeedableRandomState) -> Self {
        let slots = capacity.clamp(1 << 9, 1 << 11).next_power_of_two() as usize;
        Names {
            slots: (0..slots)
                .map(|_| Locked(Mutex::new(Default::default())))
                .collect(),
            hasher,
        }
    }

    /// The hasher this table places keys by (randomly seeded).
    pub(crate) fn hasher(&self) -> &SeedableRandomState {
        &self.hasher
    }

    /// The slot of `key`, and its hash.
    fn slot(&self, key: &str) -> (&Mutex<Slot<N>>, u64) {
        let hash = self.hash(key);
        (self.slot_of(hash), hash)
    }

    /// The hash of `key` this table places it by: a batch hashes each key once, for
    /// this table and for finding its keys that come twice ([`distinct_keys`]).
    ///
    /// [`distinct_keys`]: crate::cache::distinct_keys
    pub(crate) fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The slot of a key hashed `hash`.
    fn slot_of(&self, hash: u64) -> &Mutex<Slot<N>> {
        &self.slots[hash as usize & (self.slots.len() - 1)].0
    }

    /// What `f` makes of the name the guest gave `key` in `generation`, if remembered.
    fn with<R>(&self, key: &str, generation: u64, f: impl FnOnce(&N) -> R) -> Option<R> {
        let (slot, hash) = self.slot(key);
        Self::with_in(slot, hash, key, generation, f)
    }

    /// [`with`](Self::with), the key's slot and hash found already.
    fn with_in<R>(
        slot: &Mutex<Slot<N>>,
        hash: u64,
        key: &str,
        generation: u64,
        f: impl FnOnce(&N) -> R,
    ) -> Option<R> {
        let slot = slot.lock();
        slot.iter()
            .flatten()
            .find(|n| n.hash == hash && n.generation == generation && &*n.key == key)
            .map(|n| f(&n.name))
    }

    /// The name the guest gave `key` in `generation`, if remembered.
    pub(crate) fn get(&self, key: &str, generation: u64) -> Option<N> {
        self.with(key, generation, N::clone)
    }

    /// The name of `key` in `generation`: remembered, else what `name` asks the guest
    /// for, then remembered.
    pub(crate) fn remembered_or<E>(
        &self,
        key: &str,
        generation: u64,
        name: impl FnOnce() -> Result<N, E>,
    ) -> Result<N, E> {
        if let Some(known) = self.get(key, generation) {
            return Ok(known);
        }
        let named = name()?;
        self.keep(key, generation, &named);
        Ok(named)
    }

    /// Remembers that the guest named `key` `name` in `generation`.
    pub(crate) fn keep<Q>(&self, key: &str, generation: u64, name: &Q)
    where
        Q: ?Sized + ToOwned<Owned = N>,
    {
        if key.len() > LONGEST_KEY {
            return;
        }
        let (slot, hash) = self.slot(key);
        let mut slot = slot.lock();
        // The key's string is reused when the slot holds it (another generation), and
        // the key moves to the first way: kept last.
        if let Some(way) = slot
            .iter()
            .position(|n| n.as_ref().is_some_and(|n| n.hash == hash && &*n.key == key))
        {
            slot[..=way].rotate_right(1);
            if let Some(n) = &mut slot[0] {
                n.generation = generation;
                n.name = name.to_owned();
            }
            return;
        }
        // A new key takes the first way; the others move down one, and the one kept
        // longest ago leaves.
        slot.rotate_right(1);
        slot[0] = Some(Named {
            hash,
            generation,
            key: key.into(),
            name: name.to_owned(),
        });
    }
}

impl Names<String> {
    /// The names the guest gave `keys` (hashed `hashes`, by [`hash`](Self::hash), in
    /// order) in `generation`, each written as a part of `parts` in order (an empty part
    /// for a key not remembered); the positions of the keys not remembered. The keys'
    /// slots are all asked of the CPU's cache before the first is looked in
    /// ([`prefetch`]): a batch waits on their misses together.
    pub(crate) fn write_all_to<K: AsRef<str>>(
        &self,
        keys: &[K],
        hashes: &[u64],
        generation: u64,
        parts: &mut Parts,
    ) -> Vec<usize> {
        debug_assert_eq!(keys.len(), hashes.len(), "a hash a key");
        // A slot's first line: its lock and the way most lookups find.
        for &hash in hashes {
            prefetch(self.slot_of(hash), 64);
        }
        let mut missing = Vec::new();
        for (i, (key, &hash)) in keys.iter().zip(hashes).enumerate() {
            let out = parts.text_mut();
            let slot = self.slot_of(hash);
            if Self::with_in(slot, hash, key.as_ref(), generation, |name| out.push_str(name)).is_none() {
                missing.push(i);
            }
            parts.close_part();
        }
        missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_batch_named_from_memory_is_named_as_the_guest_names_it() {
        let cache = crate::Corral::builder().build().expect("a memory cache");
        let by_guest = |keys: &[&str]| {
            cache
                .inner
                .policy
                .locate_entries(&cache.inner.prefix, keys, 0)
                .expect("named")
        };
        let keys = ["a", "b}{", "a", "c"];
        let guests = by_guest(&keys);
        let first = cache.entries_of(&keys).await.expect("named");
        let remembered = cache.entries_of(&keys).await.expect("named");
        assert_eq!((&first, &remembered), (&guests, &guests));
        assert_eq!(cache.entries_of(&[] as &[&str]).await.expect("named").len(), 0);
        // A bad key among remembered ones still gets the guest's error, naming it.
        let bad = cache.entries_of(&["a", "c", ""]).await.expect_err("an empty key");
        assert_eq!(
            (bad.kind(), bad.argument()),
            (crate::ErrorKind::InvalidArgument, Some("key"))
        );
        assert_eq!(cache.entry_of("a").await.expect("named"), guests.get(0));
        // Partly remembered: the guest names the rest, and a bad key among them is
        // named at its position in the whole batch, as a cold batch names it.
        let mixed = ["new1", "a", "new{2}", "c"];
        assert_eq!(cache.entries_of(&mixed).await.expect("named"), by_guest(&mixed));
        let long = "x".repeat(100_000);
        let bad_batch = ["a", "new1", long.as_str(), "c"];
        let warm = cache.entries_of(&bad_batch).await.expect_err("a key too long");
        assert!(warm.to_string().contains("position 2"), "{warm}");
        let fresh = crate::Corral::builder().build().expect("a memory cache");
        let cold_error = fresh.entries_of(&bad_batch).await.expect_err("a key too long");
        assert_eq!(warm.to_string(), cold_error.to_string());
    }

    #[test]
    fn four_keys_sharing_a_slot_are_all_remembered() {
        let names = Names::new(0);
        let first = "key:0".to_string();
        let at = |key: &str| std::ptr::from_ref(names.slot(key).0);
        let sharing_with_first = |prefix: &str, skip: usize| {
            (1..)
                .map(|n| format!("{prefix}:{n}"))
                .filter(|k| at(k) == at(&first))
                .nth(skip)
                .expect("a key in the same slot")
        };
        let others: Vec<String> = (0..WAYS - 1)
            .map(|skip| sharing_with_first("key", skip))
            .collect();
        names.keep(&first, 1, "first");
        for (n, key) in others.iter().enumerate() {
            names.keep(key, 1, format!("other {n}").as_str());
        }
        assert_eq!(names.get(&first, 1).as_deref(), Some("first"));
        for (n, key) in others.iter().enumerate() {
            assert_eq!(names.get(key, 1), Some(format!("other {n}")));
        }
        // One more pushes out the one kept longest ago: kept again, the first is newer.
        let one_more = sharing_with_first("more", 0);
        names.keep(&first, 2, "first again");
        names.keep(&one_more, 1, "one more");
        assert_eq!(names.get(&others[0], 1), None, "kept before the others");
        assert_eq!(names.get(&first, 2).as_deref(), Some("first again"));
        assert_eq!(names.get(&first, 1), None, "its other generation is gone");
        assert_eq!(names.get(&one_more, 1).as_deref(), Some("one more"));
        for (n, key) in others.iter().enumerate().skip(1) {
            assert_eq!(names.get(key, 1), Some(format!("other {n}")));
        }
    }

    #[test]
    fn a_batch_of_a_hundred_keys_is_remembered_whole_in_the_smallest_table() {
        // A third key in a slot of two ways came in about one table in seven; a fifth
        // in a slot of four comes in about one in a thousand. Seeded, so that the
        // tables are the same every run.
        for seed in 0..20 {
            let fixed = foldhash::SharedSeed::global_fixed();
            let names = Names::with_hasher(0, SeedableRandomState::with_seed(seed, fixed));
            let keys: Vec<String> = (0..100).map(|n| format!("hit{n}")).collect();
            for key in &keys {
                names.keep(key, 0, key.as_str());
            }
            let kept = keys.iter().filter(|k| names.get(k, 0).is_some()).count();
            assert_eq!(kept, 100, "of 100 kept");
        }
    }

    #[test]
    fn a_name_is_given_back_only_for_its_own_key_and_generation() {
        let names = Names::new(0);
        names.keep("k", 3, "{c:k}:e:3");
        assert_eq!(names.get("k", 3).as_deref(), Some("{c:k}:e:3"));
        assert_eq!(names.get("k", 4), None, "another generation");
        assert_eq!(names.get("k2", 3), None, "another key");
        // Written in parts: the remembered names, an empty part for each key not.
        let mut parts = Parts::with_capacity(4, 16);
        let hashed = |keys: &[&str]| keys.iter().map(|k| names.hash(k)).collect::<Vec<_>>();
        let missing = names.write_all_to(
            &["k2", "k", "k", "x"],
            &hashed(&["k2", "k", "k", "x"]),
            3,
            &mut parts,
        );
        assert_eq!(missing, [0, 3]);
        assert_eq!(
            parts.iter().collect::<Vec<_>>(),
            ["", "{c:k}:e:3", "{c:k}:e:3", ""]
        );
        let mut parts = Parts::with_capacity(1, 0);
        assert_eq!(
            names.write_all_to(&["k"], &hashed(&["k"]), 2, &mut parts),
            [0],
            "another generation"
        );
        // Keys sharing a slot: the later four hold it, the earlier are named again.
        let crowd: Vec<String> = (0..5_000).map(|n| format!("key:{n}")).collect();
        for key in &crowd {
            names.keep(key, 1, format!("name of {key}").as_str());
        }
        for key in &crowd {
            if let Some(name) = names.get(key, 1) {
                assert_eq!(name, format!("name of {key}"));
            }
        }
        // Many at once, as one at a time.
        let mut parts = Parts::with_capacity(crowd.len(), 0);
        let crowd_hashes: Vec<u64> = crowd.iter().map(|k| names.hash(k)).collect();
        let missing = names.write_all_to(&crowd, &crowd_hashes, 1, &mut parts);
        for (i, key) in crowd.iter().enumerate() {
            let one = names.get(key, 1);
            assert_eq!(missing.contains(&i), one.is_none(), "{key}");
            assert_eq!(parts.get(i), one.as_deref().unwrap_or(""), "{key}");
        }
        assert!(missing.len() < crowd.len() && !missing.is_empty());
        let long = "x".repeat(LONGEST_KEY + 1);
        names.keep(&long, 1, "n");
        assert_eq!(names.get(&long, 1), None, "too long to keep");
        names.keep("k", 3, "{c:k}:e:3"); // the crowd may have pushed it out
        let mut parts = Parts::with_capacity(2, 0);
        let both = [long.as_str(), "k"];
        assert_eq!(names.write_all_to(&both, &hashed(&both), 3, &mut parts), [0]);
        assert_eq!(parts.iter().collect::<Vec<_>>(), ["", "{c:k}:e:3"]);
    }
}
