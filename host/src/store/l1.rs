//! The L1 tier: moka's synchronous cache, in process (a read needs no await). An entry
//! carries the deadline the guest issued when it was filled (never past the entry's L2
//! expiry, nor the L1 TTL); moka's own TTL is only an upper bound that keeps memory in
//! check. A capacity of 0 turns L1 off.
//!
//! Fills are fenced too (contract §5.12): a reader takes a [`Ticket`] before it reads L2
//! and fills L1 only if no set, removal or invalidation of the key happened in this
//! process since. Writes bump a per-key epoch (striped: a collision only skips a fill,
//! or seals a flight of the other key, which the next caller then leads anew) under
//! the stripe's lock, which a fill holds too around its check and its insert, so a
//! fill and a write of one key never interleave. An entry carries the count of flushes
//! its ticket saw, and is served only while no flush came since. The
//! stripes are picked by a fixed-key hasher: which keys share one is the same in every
//! process and every run (a simulation replays byte for byte); a shared stripe costs a
//! skipped fill or an extra flight, never a wrong value.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use moka::sync::Cache;

const STRIPES: usize = 1024;

#[derive(Clone, Debug)]
pub(crate) struct L1Entry {
    pub(crate) value: Bytes,
    /// Served until this moment (Unix ms), as issued by the guest.
    pub(crate) until_ms: u64,
    /// A stale copy served by fail-safe for the throttle (contract §7.1).
    pub(crate) stale: bool,
    /// When an eager refresh falls due (contract §7.3), until one is started.
    pub(crate) refresh_at_ms: Option<u64>,
    /// A tagged entry: the tag epoch it was judged in (see [`L1Tagged`]).
    pub(crate) tagged: L1Tagged,
}

impl L1Entry {
    /// A fresh copy of `value`, served until `until_ms`, with no refresh due.
    fn fresh(value: Bytes, until_ms: u64, tagged: L1Tagged) -> Self {
        L1Entry {
            value,
            until_ms,
            stale: false,
            refresh_at_ms: None,
            tagged,
        }
    }
}

/// What L1 keeps of a tagged entry (contract §7.5): the tag epoch in which the guest
/// judged its tags (`None`: untagged). Any invalidation this process hears of moves the
/// epoch on, and a hit of an entry judged in an older epoch is a miss: the read goes to
/// L2 and the guest judges it again. A hit in the same epoch needs no judgement (one
/// atomic load), which is what keeps a tagged hit as cheap as an untagged one.
pub(crate) type L1Tagged = Option<u64>;

/// What a reader saw of a key's writes before it read L2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ticket {
    all: u64,
    generations: u64,
    key: u64,
}

impl Ticket {
    /// Its counts, for a body that carries it across the component boundary: the
    /// flushes of all of L1, the changes of generation, the writes of the key's stripe.
    pub(crate) fn parts(self) -> [u64; 3] {
        [self.all, self.generations, self.key]
    }

    /// Whether, since `earlier` (a ticket of the same key), the prefix moved to another
    /// generation while the key was not written in this process.
    pub(crate) fn only_generation_moved_since(self, earlier: Ticket) -> bool {
        self.generations != earlier.generations && self.key == earlier.key
    }

    /// Whether nothing wrote the key (its stripe) in this process, nor was a change of
    /// it heard, nor did the prefix move to another generation between `earlier` and
    /// this ticket. A flush of all of L1 (a gap in the announcements) does not count:
    /// what was missed is unknown, and every key would count as changed.
    pub(crate) fn key_unchanged_since(self, earlier: Ticket) -> bool {
        self.generations == earlier.generations && self.key == earlier.key
    }

    /// A ticket [`parts`](Self::parts) gave.
    pub(crate) const fn from_parts([all, generations, key]: [u64; 3]) -> Self {
        Ticket {
            all,
            generations,
            key,
        }
    }
}

/// A removal's watch of its key ([`L1::watch_removal`]).
#[derive(Debug)]
pub(crate) struct RemovalWatch {
    epochs: Arc<Epochs>,
    key: String,
    id: u64,
}

impl RemovalWatch {
    /// Whether nothing has ended the watch: no write of the key since it began, in this
    /// process or heard from another.
    pub(crate) fn is_current(&self) -> bool {
        self.epochs.removals.lock().get(&self.key) == Some(&self.id)
    }
}

impl Drop for RemovalWatch {
    fn drop(&mut self) {
        let epochs = &self.epochs;
        let mut removals = epochs.removals.lock();
        if removals.get(&self.key) == Some(&self.id) {
            removals.remove(&self.key);
            epochs.removals_watched.store(removals.len(), Ordering::SeqCst);
        }
    }
}

/// An entry as moka keeps it: with the count of flushes ([`Epochs::all`]) its ticket
/// saw. A flush hides every entry put before it at once, whatever moka's clock says:
/// moka's `invalidate_all` keeps an entry timestamped in its own tick.
#[derive(Clone)]
struct Kept<V> {
    flushes: u64,
    value: V,
}

/// Puts `value` under `key` as of `ticket`: it is served until the next flush after the
/// ticket's.
fn put<V: Clone + Send + Sync + 'static>(
    cache: &Cache<String, Kept<V>>,
    key: &str,
    ticket: Ticket,
    value: V,
) {
    let flushes = ticket.all;
    cache.insert(key.to_owned(), Kept { flushes, value });
}

/// The tier: moka's cache of `V` (the native body's [`L1Entry`], or the portable body's
/// own record) and the epochs that fence its fills. Every fencing rule is written here,
/// once, for both bodies; only the native body's reads know its entry's fields.
pub(crate) struct L1<V = L1Entry> {
    cache: Option<Cache<String, Kept<V>>>,
    epochs: Arc<Epochs>,
}

impl<V: Clone + Send + Sync + 'static> Clone for L1<V> {
    fn clone(&self) -> Self {
        L1 {
            cache: self.cache.clone(),
            epochs: self.epochs.clone(),
        }
    }
}

impl<V> std::fmt::Debug for L1<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L1")
            .field("on", &self.cache.is_some())
            .field("epochs", &self.epochs)
            .finish()
    }
}

#[derive(Debug)]
struct Epochs {
    /// A fixed seed: deterministic stripes (a collision only makes a key look changed).
    hasher: foldhash::fast::FixedState,
    /// Bumped by every clear.
    all: AtomicU64,
    /// Bumped by every clear that follows a change of the prefix's generation.
    generations: AtomicU64,
    /// Bumped whenever this process learns of a tag invalidation (contract §7.5).
    tags: AtomicU64,
    /// Bumped by every write of a key hashing here.
    stripes: Box<[AtomicU64]>,
    /// Held by every change of a key hashing here (a fill, a write, a drop, a refresh
    /// disarmed) around its check of the epochs and its step in moka, and all of them by
    /// a flush: a fill that found its ticket current lands before any write or flush
    /// after it, and one that did not lands nothing. (Moka's own evictions take none:
    /// they only drop.)
    locks: Box<[parking_lot::Mutex<()>]>,
    /// Keys whose removal is retried in the background, each with its watch's number
    /// ([`RemovalWatch`]).
    removals: parking_lot::Mutex<HashMap<String, u64>>,
    /// How many keys `removals` holds: a write looks at the map only when it holds any.
    removals_watched: AtomicUsize,
    /// The next watch's number.
    next_removal: AtomicU64,
}

impl Epochs {
    /// Ends the watch of `key`, if there is one (one atomic load when there is none).
    fn unwatch(&self, key: &str) {
        if self.removals_watched.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut removals = self.removals.lock();
        if removals.remove(key).is_some() {
            self.removals_watched.store(removals.len(), Ordering::SeqCst);
        }
    }

    fn stripe(&self, key: &str) -> &AtomicU64 {
        &self.stripes[self.stripe_of(key)]
    }

    fn stripe_of(&self, key: &str) -> usize {
        self.hasher.hash_one(key) as usize % STRIPES
    }

    fn ticket(&self, key: &str) -> Ticket {
        self.ticket_at(self.stripe(key))
    }

    fn ticket_at(&self, stripe: &AtomicU64) -> Ticket {
        Ticket {
            all: self.all.load(Ordering::Acquire),
            generations: self.generations.load(Ordering::Acquire),
            key: stripe.load(Ordering::Acquire),
        }
    }

    /// `change` of `key`, given its stripe, with the stripe's lock held: no other change
    /// of a key of this stripe runs meanwhile.
    fn changing<R>(&self, key: &str, change: impl FnOnce(&AtomicU64) -> R) -> R {
        let at = self.stripe_of(key);
        let _held = self.locks[at].lock();
        change(&self.stripes[at])
    }
}

impl<V: Clone + Send + Sync + 'static> L1<V> {
    pub(crate) fn new(capacity: u64, ttl: Duration) -> Self {
        L1 {
            cache: (capacity > 0).then(|| Cache::builder().max_capacity(capacity).time_to_live(ttl).build()),
            epochs: Arc::new(Epochs {
                hasher: foldhash::fast::FixedState::with_seed(0),
                all: AtomicU64::new(0),
                generations: AtomicU64::new(0),
                tags: AtomicU64::new(1),
                stripes: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
                locks: (0..STRIPES).map(|_| parking_lot::Mutex::new(())).collect(),
                removals: parking_lot::Mutex::new(HashMap::new()),
                removals_watched: AtomicUsize::new(0),
                next_removal: AtomicU64::new(0),
            }),
        }
    }

    /// Whether L1 is on (a capacity above 0).
    pub(crate) fn is_on(&self) -> bool {
        self.cache.is_some()
    }

    /// Taken before reading L2 for a later [`fill`](Self::fill).
    pub(crate) fn ticket(&self, key: &str) -> Ticket {
        self.epochs.ticket(key)
    }

    /// A ticket for `key` as of now, but as of `earlier` for changes of the prefix's
    /// generation: a caller that named its entry in the store (in the generation then,
    /// contract §7.5) after `earlier` never fills L1 across a `clear()` that moved the
    /// prefix to another generation meanwhile.
    pub(crate) fn ticket_since(&self, key: &str, earlier: Ticket) -> Ticket {
        Ticket {
            generations: earlier.generations,
            ..self.epochs.ticket(key)
        }
    }

    /// As [`fill`](Self::fill), with the whole entry (a stale copy, a refresh moment).
    pub(crate) fn fill_entry(&self, key: &str, entry: V, ticket: Ticket) -> bool {
        self.fill_entry_unless(key, entry, ticket, || false)
    }

    /// As [`fill_entry`](Self::fill_entry), unless `overtaken`, asked with the key's
    /// stripe held (no other fill of the key runs meanwhile), says that a newer copy may
    /// have been put since the read.
    pub(crate) fn fill_entry_unless(
        &self,
        key: &str,
        entry: V,
        ticket: Ticket,
        overtaken: impl FnOnce() -> bool,
    ) -> bool {
        let Some(cache) = &self.cache else {
            return false;
        };
        let epochs = &self.epochs;
        epochs.changing(key, |stripe| {
            let current = epochs.ticket_at(stripe) == ticket && !overtaken();
            if current {
                put(cache, key, ticket, entry);
            }
            current
        })
    }

    /// Writes `key` after a set (or an eager refresh or a bypass) in this process wrote
    /// L2, `ticket` taken before that write: newer than any fill in progress (they are
    /// refused); but if the key was written again in this process since the ticket
    /// (another set, an invalidation from another process), this value may be older
    /// than that one, and the key is dropped instead.
    pub(crate) fn insert_entry(&self, key: &str, entry: V, ticket: Ticket) {
        let Some(cache) = &self.cache else {
            return;
        };
        let epochs = &self.epochs;
        epochs.changing(key, |stripe| {
            // Writes of this key since the ticket, a new generation since the entry was
            // named (it was written under an older generation's name), or a flush (other
            // processes' announcements may have been missed since the write, a newer
            // value among them): dropped.
            let unchanged = epochs.ticket_at(stripe) == ticket;
            stripe.fetch_add(1, Ordering::AcqRel);
            if unchanged {
                put(cache, key, ticket, entry);
            } else {
                cache.invalidate(key);
            }
        });
    }

    /// The entry under `key`, as stored (no judgement of its deadline).
    pub(crate) fn peek(&self, key: &str) -> Option<V> {
        let kept = self.cache.as_ref()?.get(key)?;
        (kept.flushes == self.epochs.all.load(Ordering::Acquire)).then_some(kept.value)
    }

    /// Another process's announcement, as a cache hears it: the key it names changed
    /// (its copy goes, fills in progress are refused), or `None`, a gap in the
    /// announcements (everything goes).
    pub(crate) fn hear(&self, key: Option<&str>) {
        match key {
            Some(key) => self.remove(key),
            None => self.clear(),
        }
    }

    /// Drops `key` (a write of it in this process, or another process's write heard
    /// here): newer than any fill in progress, and the end of a removal's retry that
    /// watches the key ([`watch_removal`](Self::watch_removal)).
    pub(crate) fn remove(&self, key: &str) {
        self.epochs.unwatch(key);
        self.drop_key(key);
    }

    /// Drops `key`'s copy and refuses fills in progress, as [`remove`](Self::remove),
    /// but ends no watch: what a removal's retry does once its tombstone is there.
    pub(crate) fn drop_copy(&self, key: &str) {
        self.drop_key(key);
    }

    /// Watches `key` for a removal whose tombstone may not have been written (contract
    /// §5.12): the watch stays current until the key is written again in this process
    /// (`set`, `remove`, `expire`), another process's write of it is heard here, the
    /// key is watched again (a newer removal), or the prefix moves to another
    /// generation. A flush of all of L1 (announcements that may have been missed) does
    /// not end it. Dropping the watch ends it.
    pub(crate) fn watch_removal(&self, key: &str) -> RemovalWatch {
        let epochs = &self.epochs;
        let id = epochs.next_removal.fetch_add(1, Ordering::Relaxed);
        let mut removals = epochs.removals.lock();
        removals.insert(key.to_owned(), id);
        epochs.removals_watched.store(removals.len(), Ordering::SeqCst);
        RemovalWatch {
            epochs: self.epochs.clone(),
            key: key.to_owned(),
            id,
        }
    }

    /// A write that drops `key`: its stripe moves on (fills in progress are refused)
    /// under the stripe's lock, so no fill slips in between.
    fn drop_key(&self, key: &str) {
        self.epochs.changing(key, |stripe| {
            stripe.fetch_add(1, Ordering::AcqRel);
            if let Some(cache) = &self.cache {
                cache.invalidate(key);
            }
        });
    }

    /// Empties L1 because the prefix moved to another generation (a `clear()`, here or
    /// announced): fills and writes that named their entries before it are refused.
    pub(crate) fn clear_generation(&self) {
        self.epochs.generations.fetch_add(1, Ordering::AcqRel);
        {
            // Every entry named before is gone: no removal is left to retry.
            let mut removals = self.epochs.removals.lock();
            removals.clear();
            self.epochs.removals_watched.store(0, Ordering::SeqCst);
        }
        self.clear();
    }

    /// Drops every entry; fills in progress are refused. Every stripe's lock is held
    /// (in order) meanwhile: a fill that checked its ticket before the flush landed
    /// before it, and is dropped with the rest.
    pub(crate) fn clear(&self) {
        let _held: Vec<_> = self.epochs.locks.iter().map(|lock| lock.lock()).collect();
        self.epochs.all.fetch_add(1, Ordering::AcqRel);
        if let Some(cache) = &self.cache {
            cache.invalidate_all();
        }
    }
}

impl L1<L1Entry> {
    /// The value of `key` if the deadline the guest issued has not passed at `now_ms`.
    /// A stale copy fail-safe re-armed is not returned: only a get-or-set serves one
    /// ([`get_served`](Self::get_served)).
    pub(crate) fn get(&self, key: &str, now_ms: u64) -> Option<Bytes> {
        let entry = self.peek(key)?;
        (now_ms < entry.until_ms && !entry.stale && self.judged_now(&entry)).then_some(entry.value)
    }

    /// As [`get`](Self::get), saying whether the value is a stale copy fail-safe served.
    pub(crate) fn get_served(&self, key: &str, now_ms: u64) -> Option<(Bytes, bool)> {
        self.get_entry(key, now_ms).map(|e| (e.value, e.stale))
    }

    /// The whole entry of `key`, if still servable at `now_ms`.
    pub(crate) fn get_entry(&self, key: &str, now_ms: u64) -> Option<L1Entry> {
        let entry = self.peek(key)?;
        (now_ms < entry.until_ms && self.judged_now(&entry)).then_some(entry)
    }

    /// Whether an entry's tags (if any) were judged in the current tag epoch.
    fn judged_now(&self, entry: &L1Entry) -> bool {
        entry
            .tagged
            .is_none_or(|epoch| epoch == self.epochs.tags.load(Ordering::Acquire))
    }

    /// The tag epoch, read before the moments a judgement uses.
    pub(crate) fn tag_epoch(&self) -> u64 {
        self.epochs.tags.load(Ordering::Acquire)
    }

    /// This process learnt of a tag invalidation (after updating the moments it keeps):
    /// every tagged entry must be judged again before L1 serves it.
    pub(crate) fn bump_tags(&self) {
        self.epochs.tags.fetch_add(1, Ordering::AcqRel);
    }

    /// Clears `key`'s refresh moment (a refresh was started): this process starts no
    /// other for this copy. Not a write: it leaves the key's fills alone.
    pub(crate) fn disarm_refresh(&self, key: &str) {
        if let Some(cache) = &self.cache {
            self.epochs.changing(key, |_| {
                if let Some(mut kept) = cache.get(key)
                    && kept.value.refresh_at_ms.is_some()
                {
                    kept.value.refresh_at_ms = None;
                    cache.insert(key.to_owned(), kept);
                }
            });
        }
    }

    /// Fills `key` with what was read after `ticket`, unless the key was written in
    /// this process since; says whether it filled.
    #[cfg(test)]
    pub(crate) fn fill(
        &self,
        key: &str,
        value: Bytes,
        until_ms: u64,
        ticket: Ticket,
        tagged: L1Tagged,
    ) -> bool {
        self.fill_unless(key, value, until_ms, ticket, tagged, || false)
    }

    /// As [`fill`](Self::fill), unless `overtaken` says so ([`fill_entry_unless`](Self::fill_entry_unless)).
    pub(crate) fn fill_unless(
        &self,
        key: &str,
        value: Bytes,
        until_ms: u64,
        ticket: Ticket,
        tagged: L1Tagged,
        overtaken: impl FnOnce() -> bool,
    ) -> bool {
        let entry = L1Entry::fresh(value, until_ms, tagged);
        self.fill_entry_unless(key, entry, ticket, overtaken)
    }

    /// As [`insert_entry`](Self::insert_entry), for a fresh value.
    pub(crate) fn insert(&self, key: &str, value: Bytes, until_ms: u64, ticket: Ticket, tagged: L1Tagged) {
        let entry = L1Entry::fresh(value, until_ms, tagged);
        self.insert_entry(key, entry, ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fill_never_replaces_a_write_made_after_its_ticket() {
        let l1 = L1::new(100, Duration::from_secs(60));
        let ticket = l1.ticket("k");
        l1.insert("k", Bytes::from_static(b"newer"), u64::MAX, l1.ticket("k"), None);
        assert!(!l1.fill("k", Bytes::from_static(b"older"), u64::MAX, ticket, None));
        assert_eq!(l1.get("k", 0).as_deref(), Some(&b"newer"[..]));

        // A set whose L2 write was overtaken in this process (another set, or another
        // process's invalidation, came in between) does not install its older value.
        let before_write = l1.ticket("k");
        l1.remove("k");
        l1.insert("k", Bytes::from_static(b"late set"), u64::MAX, before_write, None);
        assert_eq!(l1.get("k", 0), None);

        let ticket = l1.ticket("k");
        l1.remove("k");
        assert!(!l1.fill("k", Bytes::from_static(b"older"), u64::MAX, ticket, None));
        assert_eq!(l1.get("k", 0), None);

        // A set whose write came before a flush (announcements missed since: a newer
        // value may be in L2 already) does not install its value either.
        let before_write = l1.ticket("k");
        l1.clear();
        l1.insert(
            "k",
            Bytes::from_static(b"set before the gap"),
            u64::MAX,
            before_write,
            None,
        );
        assert_eq!(l1.get("k", 0), None);

        let ticket = l1.ticket("k");
        l1.clear();
        assert!(!l1.fill("k", Bytes::from_static(b"older"), u64::MAX, ticket, None));

        let ticket = l1.ticket("k");
        assert!(l1.fill("k", Bytes::from_static(b"fresh"), u64::MAX, ticket, None));
        assert_eq!(l1.get("k", 0).as_deref(), Some(&b"fresh"[..]));
    }

    fn version(n: u64) -> Bytes {
        Bytes::copy_from_slice(&n.to_be_bytes())
    }

    /// Two fillers (a ticket, a read of "L2", a fill of what they read) race `write`,
    /// which makes version `n` of a key, for n = 1 to `writes`, in "L2" and then in or
    /// out of L1 as a cache would. Once `write(n)` returned, L1 holds `n`, a newer
    /// version, or nothing.
    fn race_fills_against(writes: u64, write: impl Fn(&L1, &AtomicU64, u64) + Sync) {
        let l1 = L1::<L1Entry>::new(100, Duration::from_secs(60));
        let l2 = AtomicU64::new(0);
        let written = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    let fill = || {
                        let ticket = l1.ticket("k");
                        let read = l2.load(Ordering::SeqCst);
                        std::thread::yield_now();
                        l1.fill("k", version(read), u64::MAX, ticket, None)
                    };
                    while !written.load(Ordering::SeqCst) {
                        fill();
                    }
                    // No write since its ticket: a fill lands (none was refused for nothing).
                    assert!(fill(), "a fill with a current ticket was refused");
                });
            }
            s.spawn(|| {
                // Stops the fillers however this ends.
                struct Done<'a>(&'a std::sync::atomic::AtomicBool);
                impl Drop for Done<'_> {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::SeqCst);
                    }
                }
                let _done = Done(&written);
                for n in 1..=writes {
                    write(&l1, &l2, n);
                    let seen = l1
                        .get("k", 0)
                        .map(|b| u64::from_be_bytes(b[..].try_into().unwrap()));
                    assert!(
                        seen.is_none_or(|v| v >= n),
                        "version {n} made, then L1 held {seen:?}"
                    );
                }
            });
        });
    }

    #[test]
    fn racing_fills_never_put_back_a_value_older_than_a_finished_set() {
        // As a `set` does: a ticket, the L2 write, the L1 insert.
        race_fills_against(5_000, |l1, l2, n| {
            let ticket = l1.ticket("k");
            l2.store(n, Ordering::SeqCst);
            l1.insert("k", version(n), u64::MAX, ticket, None);
        });
    }

    #[test]
    fn no_fill_read_before_a_flush_outlives_it() {
        // Another process's write, its announcement lost: this one flushes L1 (as after
        // a gap in its subscription).
        race_fills_against(5_000, |l1, l2, n| {
            l2.store(n, Ordering::SeqCst);
            l1.clear();
        });
    }

    #[test]
    fn a_flush_waits_for_a_fill_between_its_check_and_its_insert() {
        // A fill holds its stripe's lock from its check of the epochs to its insert: a
        // flush meanwhile lands after the insert and drops it (moka's `invalidate_all`
        // keeps what is inserted after it). That a flush does not run meanwhile can only
        // be seen as nothing happening: 100 ms of it.
        let l1 = L1::<L1Entry>::new(100, Duration::from_secs(60));
        let fill = l1.epochs.locks[l1.epochs.stripe_of("k")].lock();
        let flushed = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                l1.clear();
                flushed.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(100));
            assert!(!flushed.load(Ordering::SeqCst), "the flush ran during the fill");
            drop(fill);
        });
        assert!(flushed.load(Ordering::SeqCst));
    }

    #[test]
    fn a_removal_watch_ends_with_a_write_of_its_key_or_a_newer_watch() {
        for l1 in [
            L1::<L1Entry>::new(100, Duration::from_secs(60)),
            L1::new(0, Duration::from_secs(60)),
        ] {
            let watch = l1.watch_removal("k");
            l1.remove("other");
            l1.clear();
            l1.drop_copy("k");
            assert!(
                watch.is_current(),
                "other keys, a flush and the retry's own drop leave it"
            );
            l1.remove("k");
            assert!(!watch.is_current(), "a write of the key ends it");

            let older = l1.watch_removal("k");
            let newer = l1.watch_removal("k");
            assert!(
                !older.is_current() && newer.is_current(),
                "a newer removal takes over"
            );
            drop(older);
            assert!(newer.is_current(), "an ended watch's drop leaves the newer one");
            l1.clear_generation();
            assert!(!newer.is_current(), "a new generation ends every watch");
            drop(newer);
            assert_eq!(l1.epochs.removals.lock().len(), 0);
            assert_eq!(l1.epochs.removals_watched.load(Ordering::SeqCst), 0);
        }
    }

    #[test]
    fn a_tagged_entry_is_served_only_in_the_tag_epoch_it_was_judged_in() {
        let l1 = L1::new(100, Duration::from_secs(60));
        l1.fill(
            "k",
            Bytes::from_static(b"v"),
            u64::MAX,
            l1.ticket("k"),
            Some(l1.tag_epoch()),
        );
        l1.fill("u", Bytes::from_static(b"u"), u64::MAX, l1.ticket("u"), None);
        assert!(l1.get("k", 0).is_some());
        l1.bump_tags();
        assert_eq!(l1.get("k", 0), None, "judged before an invalidation: a miss");
        assert_eq!(l1.get_served("k", 0), None);
        assert!(l1.get("u", 0).is_some(), "untagged entries are untouched");
        l1.fill(
            "k",
            Bytes::from_static(b"v"),
            u64::MAX,
            l1.ticket("k"),
            Some(l1.tag_epoch()),
        );
        assert!(l1.get("k", 0).is_some(), "judged again");
    }
}
