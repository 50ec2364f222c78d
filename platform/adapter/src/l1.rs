//! L1 and the flight registry, as state of the instance.
//!
//! L1 keeps the component's entries with the fencing the `l1` interface asks for: a
//! ticket counts the flushes, the moves to another generation, and the writes of a key,
//! and a fill lands only if none moved since its ticket. It holds at most the core's L1
//! capacity; past it, a fill or a write drops every entry and counts a flush (refusing
//! the fills in progress, which may no longer be judged).

use std::cell::RefCell;
use std::collections::HashMap;

use crate::Adapter;
use crate::bindings::exports::corral::cache::flights::{self, Joined};
use crate::bindings::exports::corral::cache::l1::{self, L1Entry, L1Ticket};
use crate::bindings::exports::corral::cache::types;

#[derive(Default)]
struct Tier {
    entries: HashMap<String, L1Entry>,
    /// The number of each key's last write since the last flush (a flush forgets them).
    /// A ticket's `writes` only ever grows: a key not written since the flush counts
    /// `floor`, the number of the last write before it, so a follower that compares its
    /// ticket with its load's (`key_unchanged`) never takes a write after a flush for
    /// none.
    writes: HashMap<String, u64>,
    /// Writes numbered so far.
    last_write: u64,
    /// `last_write` at the last flush.
    floor: u64,
    flushes: u64,
    generations: u64,
}

thread_local! {
    static TIER: RefCell<Tier> = RefCell::new(Tier::default());
}

/// The core's L1 capacity: the same bound as in every body.
fn capacity() -> usize {
    usize::try_from(corral_core::Settings::DEFAULT.l1_capacity).unwrap_or(usize::MAX)
}

impl Tier {
    fn ticket(&self, key: &str) -> L1Ticket {
        L1Ticket {
            flushes: self.flushes,
            generations: self.generations,
            writes: self.writes.get(key).copied().unwrap_or(self.floor),
        }
    }

    fn wrote(&mut self, key: &str) {
        self.last_write += 1;
        self.writes.insert(key.to_owned(), self.last_write);
    }

    fn flush(&mut self) {
        self.entries.clear();
        self.writes.clear();
        self.floor = self.last_write;
        self.flushes += 1;
    }

    fn insert(&mut self, key: String, entry: L1Entry) {
        if self.entries.len() >= capacity() || self.writes.len() >= capacity() {
            self.flush();
        }
        self.entries.insert(key, entry);
    }
}

fn same(a: &L1Ticket, b: &L1Ticket) -> bool {
    a.flushes == b.flushes && a.generations == b.generations && a.writes == b.writes
}

impl l1::Guest for Adapter {
    fn ticket(key: String) -> L1Ticket {
        TIER.with(|t| t.borrow().ticket(&key))
    }

    fn get(key: String) -> Option<L1Entry> {
        TIER.with(|t| t.borrow().entries.get(&key).cloned())
    }

    fn fill(key: String, entry: L1Entry, since: L1Ticket) -> bool {
        TIER.with(|t| {
            let mut t = t.borrow_mut();
            if !same(&t.ticket(&key), &since) {
                return false;
            }
            t.insert(key, entry);
            true
        })
    }

    fn set(key: String, entry: L1Entry, since: L1Ticket) {
        TIER.with(|t| {
            let mut t = t.borrow_mut();
            let unchanged = same(&t.ticket(&key), &since);
            t.wrote(&key);
            if unchanged {
                t.insert(key, entry);
            } else {
                t.entries.remove(&key);
            }
        });
    }

    fn delete(key: String) {
        TIER.with(|t| {
            let mut t = t.borrow_mut();
            t.wrote(&key);
            t.entries.remove(&key);
        });
    }

    fn clear() {
        TIER.with(|t| {
            let mut t = t.borrow_mut();
            t.generations += 1;
            t.flush();
        });
    }

    fn flush() {
        TIER.with(|t| t.borrow_mut().flush());
    }
}

/// The flight registry of an instance that is its own process: the component makes a
/// second caller of the instance follow the first itself, so a join here always leads.
impl flights::Guest for Adapter {
    fn join(_key: String) -> Joined {
        Joined::Lead
    }

    fn join_many(keys: Vec<String>) -> Vec<bool> {
        vec![true; keys.len()]
    }

    fn finish(_key: String, _outcome: Result<Vec<u8>, types::Error>) {}

    fn abandon(_key: String) {}
}
