//! The entry names the guest gave lately, remembered: a key read again in the same
//! generation is named without a guest call.
//!
//! An entry's name is the guest's (`locate-entry`): a function of the cache's prefix,
//! its limits, the key and the generation, the first two fixed for a cache. So what
//! the guest answered once for a key in a generation is its answer for good, and this
//! table only remembers answers: it decides nothing. It is lossy (a slot holds the last
//! key hashed to it), bounded (slots and the key length it keeps), and a slot is
//! trusted only for the very key and generation it holds, so a collision, hostile or
//! not, costs one guest call and never a wrong name.

use std::hash::BuildHasher;

use parking_lot::Mutex;

/// Keys longer than this are always named by the guest (bounds what the table holds).
const LONGEST_KEY: usize = 256;

/// One remembered answer.
struct Named {
    generation: u64,
    key: Box<str>,
    name: Box<str>,
}

pub(crate) struct Names {
    slots: Box<[Mutex<Option<Named>>]>,
    hasher: foldhash::fast::RandomState,
}

impl std::fmt::Debug for Names {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Names").field("slots", &self.slots.len()).finish()
    }
}

impl Names {
    /// A table for about `capacity` keys (as many as L1 holds), between 1,024 and
    /// 4,096 slots: at most a few MiB with the longest keys.
    pub(crate) fn new(capacity: u64) -> Self {
        let slots = capacity.clamp(1 << 10, 1 << 12).next_power_of_two() as usize;
        Names {
            slots: (0..slots).map(|_| Mutex::new(None)).collect(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    fn slot(&self, key: &str) -> &Mutex<Option<Named>> {
        let at = self.hasher.hash_one(key) as usize & (self.slots.len() - 1);
        &self.slots[at]
    }

    /// The name the guest gave `key` in `generation`, if remembered.
    pub(crate) fn get(&self, key: &str, generation: u64) -> Option<String> {
        let slot = self.slot(key).lock();
        slot.as_ref()
            .filter(|n| n.generation == generation && &*n.key == key)
            .map(|n| String::from(&*n.name))
    }

    /// Remembers that the guest named `key` `name` in `generation`.
    pub(crate) fn keep(&self, key: &str, generation: u64, name: &str) {
        if key.len() > LONGEST_KEY {
            return;
        }
        let mut slot = self.slot(key).lock();
        match slot.as_mut() {
            // The slot's strings are reused when the key is the same (a new generation).
            Some(n) if &*n.key == key => {
                n.generation = generation;
                if *n.name != *name {
                    n.name = name.into();
                }
            }
            _ => {
                *slot = Some(Named {
                    generation,
                    key: key.into(),
                    name: name.into(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_given_back_only_for_its_own_key_and_generation() {
        let names = Names::new(0);
        names.keep("k", 3, "{c:k}:e:3");
        assert_eq!(names.get("k", 3).as_deref(), Some("{c:k}:e:3"));
        assert_eq!(names.get("k", 4), None, "another generation");
        assert_eq!(names.get("k2", 3), None, "another key");
        // Keys sharing a slot: the later one holds it, the earlier is named again.
        let crowd: Vec<String> = (0..5_000).map(|n| format!("key:{n}")).collect();
        for key in &crowd {
            names.keep(key, 1, &format!("name of {key}"));
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
