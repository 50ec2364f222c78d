//! The entry names the guest gave lately, remembered: a key read again in the same
//! generation is named without a guest call.
//!
//! An entry's name is the guest's (`locate-entry`): a function of the cache's prefix,
//! its limits, the key and the generation, the first two fixed for a cache. So what
//! the guest answered once for a key in a generation is its answer for good, and this
//! table only remembers answers: it decides nothing. It is lossy (a slot holds the two
//! keys hashed to it last), bounded (slots and the key length it keeps), and a slot is
//! trusted only for the very key and generation it holds, so a collision, hostile or
//! not, costs a guest call and never a wrong name.

use std::hash::BuildHasher;

use parking_lot::Mutex;

/// Keys longer than this are always named by the guest (bounds what the table holds).
const LONGEST_KEY: usize = 256;

/// One remembered answer.
struct Named<N> {
    generation: u64,
    key: Box<str>,
    name: N,
}

/// A slot's two ways, the one kept last first.
type Slot<N> = [Option<Named<N>>; 2];

/// Names of type `N` (an entry's, or all of a key's: WIT `store-names`) by key and
/// generation.
pub(crate) struct Names<N> {
    slots: Box<[Mutex<Slot<N>>]>,
    hasher: foldhash::fast::RandomState,
}

impl<N> std::fmt::Debug for Names<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Names").field("slots", &self.slots.len()).finish()
    }
}

impl<N: Clone> Names<N> {
    /// A table for about `capacity` keys (as many as L1 holds), between 1,024 and
    /// 4,096 slots of two keys each. At most each key (up to 256 bytes) and what the
    /// guest named it (each name about the prefix and twice the key, escaped): with all
    /// five of a key's names and the default prefix, about 24 MiB at the very worst.
    pub(crate) fn new(capacity: u64) -> Self {
        let slots = capacity.clamp(1 << 10, 1 << 12).next_power_of_two() as usize;
        Names {
            slots: (0..slots).map(|_| Mutex::new([None, None])).collect(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    fn slot(&self, key: &str) -> &Mutex<Slot<N>> {
        let at = self.hasher.hash_one(key) as usize & (self.slots.len() - 1);
        &self.slots[at]
    }

    /// What `f` makes of the name the guest gave `key` in `generation`, if remembered.
    fn with<R>(&self, key: &str, generation: u64, f: impl FnOnce(&N) -> R) -> Option<R> {
        let slot = self.slot(key).lock();
        slot.iter()
            .flatten()
            .find(|n| n.generation == generation && &*n.key == key)
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
        let mut slot = self.slot(key).lock();
        // The key's string is reused when the slot holds it (another generation), and
        // the key moves to the first way: kept last.
        if let Some(way) = slot
            .iter()
            .position(|n| n.as_ref().is_some_and(|n| &*n.key == key))
        {
            slot.swap(0, way);
            if let Some(n) = &mut slot[0] {
                n.generation = generation;
                n.name = name.to_owned();
            }
            return;
        }
        // A new key takes the first way; the key kept before it moves to the second.
        slot.swap(0, 1);
        slot[0] = Some(Named {
            generation,
            key: key.into(),
            name: name.to_owned(),
        });
    }
}

impl Names<String> {
    /// Writes the name the guest gave `key` in `generation` at the end of `out`, if
    /// remembered; says whether it was.
    pub(crate) fn write_to(&self, key: &str, generation: u64, out: &mut String) -> bool {
        self.with(key, generation, |name| out.push_str(name)).is_some()
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
    fn two_keys_sharing_a_slot_are_both_remembered() {
        let names = Names::new(0);
        let first = "key:0".to_string();
        let at = |key: &str| std::ptr::from_ref(names.slot(key));
        let sharing_with_first = |prefix: &str| {
            (1..)
                .map(|n| format!("{prefix}:{n}"))
                .find(|k| at(k) == at(&first))
                .expect("a key in the same slot")
        };
        let second = sharing_with_first("key");
        names.keep(&first, 1, "one");
        names.keep(&second, 1, "two");
        assert_eq!(
            (names.get(&first, 1).as_deref(), names.get(&second, 1).as_deref()),
            (Some("one"), Some("two"))
        );
        // A third pushes out the one kept longest ago: kept again, the first is newer.
        let third = sharing_with_first("other");
        names.keep(&first, 2, "one again");
        names.keep(&third, 1, "three");
        assert_eq!(names.get(&second, 1), None, "kept before the other two");
        assert_eq!(names.get(&first, 2).as_deref(), Some("one again"));
        assert_eq!(names.get(&third, 1).as_deref(), Some("three"));
    }

    #[test]
    fn a_name_is_given_back_only_for_its_own_key_and_generation() {
        let names = Names::new(0);
        names.keep("k", 3, "{c:k}:e:3");
        assert_eq!(names.get("k", 3).as_deref(), Some("{c:k}:e:3"));
        assert_eq!(names.get("k", 4), None, "another generation");
        assert_eq!(names.get("k2", 3), None, "another key");
        let mut out = String::from("a");
        assert!(names.write_to("k", 3, &mut out) && !names.write_to("k", 2, &mut out));
        assert_eq!(out, "a{c:k}:e:3");
        // Keys sharing a slot: the later two hold it, the earlier are named again.
        let crowd: Vec<String> = (0..5_000).map(|n| format!("key:{n}")).collect();
        for key in &crowd {
            names.keep(key, 1, format!("name of {key}").as_str());
        }
        for key in &crowd {
            if let Some(name) = names.get(key, 1) {
                assert_eq!(name, format!("name of {key}"));
            }
        }
        let long = "x".repeat(LONGEST_KEY + 1);
        names.keep(&long, 1, "n");
        assert_eq!(names.get(&long, 1), None, "too long to keep");
    }
}
