//! One L2 read, as every operation does it: the store returns bytes, the guest judges
//! them, and this loop performs what the judgement asks (contract §3).
//!
//! A read costs the store one command. An entry that does not slide is read with a
//! `GET`. A sliding entry whose store keeps its expiry moment is read with `GETEX PX`,
//! which slides it in the same command; one whose envelope keeps the moment (a manual
//! clock over Redis) goes through the store's read-and-touch script. Which one a key
//! needs is learnt from its previous read ([`ReadHints`]); the first read of a key is a
//! `GET`, and the guest then asks for the slide to be written back, only over the very
//! bytes read (compare-and-replace), so it can never overwrite a newer value. A read
//! whose guess was stale (the key now holds another kind of entry) is put right the
//! same way. Expired and corrupt bytes are removed, again only if unchanged.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Buf, Bytes};

use super::Corral;
use super::kept::{Again, Kept};
use super::metrics::Metrics;
use crate::guest::policy::{
    JudgedMany, JudgedRead, NextRead, ReadOutcome, TagVerdict, Touch, Verdict as WitVerdict, WitMeta,
};
use crate::{ErrorKind, Result};

/// How each key was last found to need reading: a lossy, lock-free table of guesses.
///
/// A guess only picks the command; the guest judges what the command returned and asks
/// to put right whatever a wrong guess did (§3.5). So the table may forget and may
/// confuse two keys whose hashes share a slot: either costs one more command, never a
/// wrong answer. In return a lookup is a hash and a few atomic loads (one, until a guess
/// is first written), with no lock and no allocation, on every L2 read.
pub(crate) struct ReadHints {
    /// Per slot: the key's hash (0: empty) and the guess, packed by [`pack`].
    slots: Box<[(AtomicU64, AtomicU64)]>,
    /// Whether any slot was ever written: until one is, every key is read plainly and a
    /// lookup is one load (a cache whose entries never slide never writes one). A
    /// reader that misses a guess written meanwhile takes the plain read, as one
    /// between a slot's two stores may.
    written: AtomicBool,
    /// A fixed seed: which keys share a slot is the same in every run (a simulated run
    /// replays its commands byte for byte); a collision costs a command, never a value.
    hasher: foldhash::fast::FixedState,
    /// The shortest TTL a `GETEX` may set: a removal's. A guess may meet a removal's
    /// tombstone, and must not cut its life below the flight lock's TTL (contract
    /// §5.12) even if the fix-up that follows never runs. Keys that slide by less are
    /// read with a plain `GET`.
    floor_ms: u64,
}

impl fmt::Debug for ReadHints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadHints")
            .field("slots", &self.slots.len())
            .finish()
    }
}

/// The guess in a slot: the kind in the top two bits, a `GETEX` TTL (below 2^53) in the rest.
fn pack(next: NextRead) -> u64 {
    match next {
        NextRead::Get => 0,
        NextRead::Script => 1 << 62,
        NextRead::Expiring(ms) => (2 << 62) | (ms & ((1 << 62) - 1)),
    }
}

fn unpack(packed: u64) -> NextRead {
    match packed >> 62 {
        1 => NextRead::Script,
        2 => NextRead::Expiring(packed & ((1 << 62) - 1)),
        _ => NextRead::Get,
    }
}

impl ReadHints {
    /// A table for about `capacity` keys (as many as L1 holds), between 16,384 and
    /// 65,536 slots (256 KiB to 1 MiB): a few hundred keys read with L1 off rarely
    /// share a slot (two that do read plainly and write their touch back).
    pub(crate) fn new(capacity: u64, floor_ms: u64) -> Self {
        let slots = capacity.clamp(1 << 14, 1 << 16).next_power_of_two() as usize;
        ReadHints {
            slots: (0..slots)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
            written: AtomicBool::new(false),
            hasher: foldhash::fast::FixedState::with_seed(0),
            floor_ms,
        }
    }

    /// The TTL a removal's tombstone gets.
    pub(crate) fn removal_ttl_ms(&self) -> u64 {
        self.floor_ms
    }

    fn slot(&self, key: &str) -> (u64, &(AtomicU64, AtomicU64)) {
        let hash = self.hasher.hash_one(key) | 1; // never 0, which marks an empty slot
        (hash, &self.slots[(hash as usize) & (self.slots.len() - 1)])
    }

    /// Whether any guess was ever written: until one is, [`get`](Self::get) answers
    /// `None` for every key.
    pub(crate) fn any(&self) -> bool {
        self.written.load(Ordering::Relaxed)
    }

    pub(crate) fn get(&self, key: &str) -> Option<NextRead> {
        if !self.any() {
            return None;
        }
        let (hash, (tag, guess)) = self.slot(key);
        (tag.load(Ordering::Relaxed) == hash).then(|| unpack(guess.load(Ordering::Relaxed)))
    }

    /// Records how the guest says `key` is to be read next, given the guess this read used.
    pub(crate) fn note(&self, key: &str, used: Option<NextRead>, next: NextRead) {
        let next = match next {
            NextRead::Expiring(ms) if ms < self.floor_ms => NextRead::Get,
            next => next,
        };
        if used == Some(next) || (used.is_none() && next == NextRead::Get) {
            return;
        }
        if !self.written.load(Ordering::Relaxed) {
            self.written.store(true, Ordering::Relaxed);
        }
        let (hash, (tag, guess)) = self.slot(key);
        // Two stores, not one step: a reader between them takes a wrong guess, which
        // costs it one command.
        guess.store(pack(next), Ordering::Relaxed);
        tag.store(hash, Ordering::Relaxed);
    }
}

/// A shared `MGET`'s reads, each with its judgement, taken in order: the bytes a key
/// holds (none: `Ok(None)`) and what the guest judged of them, or the judgement kept for
/// the same head. Should the guest's judgement have failed, every read it was asked
/// about fails with it; a read a kept judgement answered is served, a miss is a miss,
/// a failed read keeps its own error.
struct SharedReads {
    found: std::vec::IntoIter<Result<Option<Bytes>>>,
    /// For each read, the judgement kept for its head, if one was: the guest judged the
    /// others only, in order.
    again: std::vec::IntoIter<Option<Again>>,
    judged: Result<Judgements>,
}

/// Keeps what the guest's `many` judgement of `reads` (each with its key's hash, in
/// order) says may be kept.
fn keep_judged<'r>(kept: &Kept, reads: impl Iterator<Item = (&'r [u8], u64)>, many: &JudgedMany) {
    let columns = many
        .each
        .iter()
        .zip(&many.value_offsets)
        .zip(many.keep_until_ms.iter().zip(&many.kept_len));
    for ((stored, hash), ((verdict, &offset), (&until, &len))) in reads.zip(columns) {
        let next_read = match verdict {
            WitVerdict::Flies | WitVerdict::Alone => continue,
            served => next_read_of_served(served),
        };
        if until > 0 {
            kept.keep(hash, stored, (len as usize, until), offset, next_read);
        }
    }
}

/// The guest's judgement of a shared `MGET`'s reads (`judged-many`), column by column,
/// each taken in order.
#[derive(Default)]
struct Judgements {
    each: std::vec::IntoIter<WitVerdict>,
    value_offsets: std::vec::IntoIter<u32>,
    l1_until_ms: std::vec::IntoIter<u64>,
    flying: std::vec::IntoIter<JudgedRead>,
}

impl From<JudgedMany> for Judgements {
    fn from(many: JudgedMany) -> Self {
        Judgements {
            each: many.each.into_iter(),
            value_offsets: many.value_offsets.into_iter(),
            l1_until_ms: many.l1_until_ms.into_iter(),
            flying: many.flying.into_iter(),
        }
    }
}

/// A shared read served from itself alone: where its value starts, how the key is read
/// next, how long L1 may serve it.
struct ServedRead {
    value_offset: u32,
    next_read: NextRead,
    l1_until_ms: u64,
}

/// A shared read that goes on to its flight: its bytes, and the guest's judgement of
/// them (`None`: to be judged alone, with the whole header). Boxed: most reads are
/// served, and each moves through the loop that takes them.
type Flying = (Bytes, Option<Box<JudgedRead>>);

/// One shared read's judgement: served from the read alone, or on to its flight (with
/// its judgement, or to be judged alone: `None`).
enum Verdict {
    Served(ServedRead),
    Flies(Option<Box<JudgedRead>>),
}

impl Iterator for SharedReads {
    type Item = Result<Option<(Bytes, Verdict)>>;

    fn next(&mut self) -> Option<Self::Item> {
        let read = self.found.next()?;
        let again = self.again.next().flatten();
        let bytes = match read {
            Ok(Some(bytes)) => bytes,
            nothing_or_failed => return Some(nothing_or_failed.map(|_| None)),
        };
        if let Some(again) = again {
            let served = ServedRead {
                value_offset: again.value_offset,
                next_read: again.next_read,
                l1_until_ms: again.l1_until_ms,
            };
            return Some(Ok(Some((bytes, Verdict::Served(served)))));
        }
        let judged = match &mut self.judged {
            Ok(judged) => judged,
            Err(e) => return Some(Err(e.clone())),
        };
        let column = (judged.value_offsets.next(), judged.l1_until_ms.next());
        let verdict = match (judged.each.next(), column) {
            (Some(WitVerdict::Flies), _) => match judged.flying.next() {
                Some(judged) => Verdict::Flies(Some(Box::new(judged))),
                None => return Some(Err(unjudged())),
            },
            (Some(WitVerdict::Alone), _) => Verdict::Flies(None),
            (Some(served), (Some(value_offset), Some(l1_until_ms))) => Verdict::Served(ServedRead {
                value_offset,
                next_read: next_read_of_served(&served),
                l1_until_ms,
            }),
            _ => return Some(Err(unjudged())),
        };
        Some(Ok(Some((bytes, verdict))))
    }
}

/// How a key whose read the guest judged `served` (or `served-sliding`) is read next.
fn next_read_of_served(served: &WitVerdict) -> NextRead {
    match served {
        WitVerdict::ServedSliding => NextRead::Script,
        _ => NextRead::Get,
    }
}

/// A shared read the guest's judgement left out.
fn unjudged() -> crate::Error {
    crate::Error::guest("a batch's read went unjudged", "broken contract")
}

/// What one read of a batch found.
#[derive(Clone, Debug)]
pub(crate) enum Looked {
    /// A fresh entry judged with the others that leaves nothing to do: its value, and
    /// the moment until which L1 may serve it.
    Served(Bytes, u64),
    /// Anything else, as [`Corral::l2_look`] finds it; for a fresh entry judged with
    /// the others, the moment until which L1 may serve it.
    Read(Box<L2Read>, Option<u64>),
}

/// A read not served from itself alone: what it found, and for a fresh entry judged
/// with others, the moment until which L1 may serve it (what [`Looked::Read`] holds).
pub(crate) type ReadFound = (Box<L2Read>, Option<u64>);

/// What one L2 read found.
#[derive(Clone, Debug)]
pub(crate) enum L2Read {
    /// A fresh entry: its value, (touched) metadata, the bytes the key holds after
    /// the read (a refresh's fill is fenced on them), and, when tagged, what L1 keeps
    /// of its tags.
    Hit(Bytes, WitMeta, Bytes, Option<super::tags::TagStamp>),
    /// Nothing fresh. `holds` is what the key holds now as far as this read knows
    /// (nothing, or a removal's tombstone): a fill is fenced on it (contract §5.12).
    Miss { holds: Option<Bytes> },
    /// A stale copy (fail-safe, contract §7.1): its value and metadata; `holds` is
    /// the bytes read, which the key still holds (a fill is fenced on them).
    Stale {
        value: Bytes,
        meta: WitMeta,
        holds: Bytes,
    },
}

impl Corral {
    /// Writes what a read owes (`bytes` in place of `stored`, TTL `ttl_ms`, only if the
    /// key still holds `stored`) in a task of its own, and waits for it: a caller that
    /// gives up (a deadline, a dropped future) does not cancel it, so a TTL a guess set
    /// is always put right while the store answers.
    async fn owe(&self, name: &str, stored: Bytes, bytes: Bytes, ttl_ms: u64) -> Result<()> {
        let (cache, name) = (self.clone(), name.to_owned());
        let fix = self.inner.owed.spawn(async move {
            let entries = &cache.inner.stores.entries;
            cache
                .l2_op(entries.replace_if_equal(&name, stored, bytes, ttl_ms))
                .await
                .map(drop)
        });
        let Some(fix) = fix else {
            return Err(crate::Error::guest(
                "a read's write-back",
                "no Tokio runtime to run it on",
            ));
        };
        fix.await
            .map_err(|e| crate::Error::guest("a read's write-back task failed", e))?
    }

    /// Reads the entry `name` at `now`. Returns the value and its (touched) metadata
    /// when fresh.
    pub(crate) async fn l2_read(
        &self,
        name: &str,
        now: u64,
    ) -> Result<Option<(Bytes, WitMeta, Option<super::tags::TagStamp>)>> {
        Ok(match self.l2_look(name, now).await? {
            L2Read::Hit(value, meta, _, stamp) => Some((value, meta, stamp)),
            L2Read::Miss { .. } | L2Read::Stale { .. } => None,
        })
    }

    /// Reads the entry `name` at `now`, saying on a miss what the key holds: the read
    /// the key's hint asks for, the guest's judgement (a tagged entry's tags too), then
    /// what that judgement leaves to do.
    pub(crate) async fn l2_look(&self, name: &str, now: u64) -> Result<L2Read> {
        let hint = self.inner.read_hints.get(name);
        let fetched = self.l2_fetch(name, hint, now).await?;
        self.l2_judge(name, hint, fetched, now).await
    }

    /// Reads the entries `names` at `now`, as [`l2_look`](Self::l2_look) reads each: the
    /// keys a plain `GET` reads share one `MGET` per node, judged by the guest in one
    /// call; the others (a sliding entry's `GETEX` or read-and-touch) are read each with
    /// its own command, all at once. A fresh entry judged with the others comes with the
    /// moment until which L1 may serve it; one with nothing left to do is served from
    /// its read alone (contract §5.16).
    pub(crate) async fn l2_look_each(&self, names: &[&str], hashes: &[u64], now: u64) -> Vec<Result<Looked>> {
        let mut found: Vec<Option<Result<Looked>>> = names.iter().map(|_| None).collect();
        let served = |at: usize, value, until| found[at] = Some(Ok(Looked::Served(value, until)));
        let rest = self.l2_look_many(names, hashes, now, served).await;
        for (at, look) in rest {
            found[at] = Some(look.map(|(read, l1_until)| Looked::Read(read, l1_until)));
        }
        found
            .into_iter()
            .map(|look| {
                look.unwrap_or_else(|| Err(crate::Error::guest("a read went unanswered", "broken contract")))
            })
            .collect()
    }

    /// [`l2_look_each`](Self::l2_look_each), a read served from itself alone handed to
    /// `served` (its position in `names`, its value, until when L1 may serve it) as it is
    /// judged: the others come back, each with its position, in order. `hashes` places
    /// each read's kept judgement ([`Kept`]): its key's hash by the
    /// names' hasher, in order.
    pub(crate) async fn l2_look_many(
        &self,
        names: &[&str],
        hashes: &[u64],
        now: u64,
        mut served: impl FnMut(usize, Bytes, u64),
    ) -> Vec<(usize, Result<ReadFound>)> {
        let inner = &*self.inner;
        // No guess written yet: every key is read plainly (no list of `None`s).
        let hints: Vec<Option<NextRead>> = if inner.read_hints.any() {
            names.iter().map(|n| inner.read_hints.get(n)).collect()
        } else {
            Vec::new()
        };
        let hint_of = |i: usize| hints.get(i).copied().flatten();
        let is_plain = |hint: &Option<NextRead>| matches!(hint, None | Some(NextRead::Get));
        debug_assert_eq!(names.len(), hashes.len(), "a hash a name");
        let (some_plain, some_hashes): (Vec<&str>, Vec<u64>);
        let (plain, plain_hashes) = if hints.iter().all(is_plain) {
            (names, hashes)
        } else {
            (some_plain, some_hashes) = names
                .iter()
                .zip(hashes)
                .zip(&hints)
                .filter(|(_, hint)| is_plain(hint))
                .map(|((name, hash), _)| (*name, *hash))
                .unzip();
            (&some_plain[..], &some_hashes[..])
        };
        let mut shared = self.shared_reads(plain, plain_hashes, now).await;
        // The keys that need more than their judgement (a touch, tags, a removal, a read
        // of their own) go on as futures, the rest are settled here.
        // A loop, not a closure: the futures' borrows stay of one lifetime (a closure's
        // would be higher-ranked, and the future not provably `Send`).
        let mut looks = Vec::new();
        for (i, &name) in names.iter().enumerate() {
            let hint = hint_of(i);
            let fetched = match hint {
                None | Some(NextRead::Get) => shared.next(),
                Some(_) => None,
            };
            let fetched = match fetched {
                Some(Ok(Some((stored, Verdict::Served(judged))))) => {
                    inner.read_hints.note(name, hint, judged.next_read);
                    let offset = judged.value_offset as usize;
                    if offset > stored.len() {
                        let broken = crate::Error::guest(
                            "a served read's value starts past its bytes",
                            "broken contract",
                        );
                        looks.push((i, self.l2_look_fetched(name, hint, Some(Err(broken)), now)));
                        continue;
                    }
                    // The value is the rest of the bytes read: moved past the header in
                    // place (a slice would share, and allocate, what nothing else holds).
                    let mut value = stored;
                    value.advance(offset);
                    served(i, value, judged.l1_until_ms);
                    continue;
                }
                Some(Ok(Some((stored, Verdict::Flies(judged))))) => Some(Ok(Some((stored, judged)))),
                Some(Ok(None)) => Some(Ok(None)),
                Some(Err(e)) => Some(Err(e)),
                None => None,
            };
            looks.push((i, self.l2_look_fetched(name, hint, fetched, now)));
        }
        let (at, looks): (Vec<usize>, Vec<_>) = looks.into_iter().unzip();
        // `join_all` answers every look, in order.
        at.into_iter()
            .zip(futures::future::join_all(looks).await)
            .collect()
    }

    /// The bytes under `names` (each placed in the kept judgements by its hash in
    /// `hashes`), in one `MGET` per node, to be judged as they are taken, in order: by
    /// the judgement kept for the same head, else by the guest (all those in one call,
    /// their judgements kept).
    async fn shared_reads(&self, names: &[&str], hashes: &[u64], now: u64) -> SharedReads {
        let inner = &*self.inner;
        if names.is_empty() {
            return SharedReads {
                found: Vec::new().into_iter(),
                again: Vec::new().into_iter(),
                judged: Ok(Judgements::default()),
            };
        }
        let found: Vec<Result<Option<Bytes>>> = inner
            .stores
            .entries
            .get_many(names)
            .await
            .into_iter()
            .map(|read| read.map_err(|e| self.l2_failed(e)))
            .collect();
        let (kept, l1_ttl_ms) = (&inner.kept, inner.l1_ttl_ms);
        let again: Vec<Option<Again>> = found
            .iter()
            .zip(hashes)
            .map(|(read, &hash)| match read {
                Ok(Some(stored)) => kept.get(hash, stored, now, l1_ttl_ms),
                _ => None,
            })
            .collect();
        // The reads with bytes no kept judgement answered, with their keys' hashes.
        let unjudged = found
            .iter()
            .zip(hashes)
            .zip(&again)
            .filter_map(|((read, hash), again)| match (read, again) {
                (Ok(Some(stored)), None) => Some((&stored[..], *hash)),
                _ => None,
            });
        let judged = if unjudged.clone().next().is_none() {
            Ok(Judgements::default())
        } else {
            let judged = inner
                .policy
                .read_many(unjudged.clone().map(|(stored, _)| stored), now, l1_ttl_ms);
            if let Ok(many) = &judged {
                keep_judged(kept, unjudged, many);
            }
            judged.map(Judgements::from)
        };
        SharedReads {
            found: found.into_iter(),
            again: again.into_iter(),
            judged,
        }
    }

    /// One key of [`l2_look_many`](Self::l2_look_many): judged with the others, when its
    /// bytes came with theirs (or alone, should their judgement have left it: `None`),
    /// else read on its own.
    async fn l2_look_fetched(
        &self,
        name: &str,
        hint: Option<NextRead>,
        fetched: Option<Result<Option<Flying>>>,
        now: u64,
    ) -> Result<ReadFound> {
        match fetched {
            Some(read) => match read? {
                Some((stored, Some(judged))) => {
                    let l1_until =
                        matches!(judged.outcome, ReadOutcome::Fresh(_)).then_some(judged.l1_until_ms);
                    let read = self.l2_judged(name, hint, stored, judged.outcome, now).await?;
                    Ok((Box::new(read), l1_until))
                }
                Some((stored, None)) => {
                    let read = self.l2_judge(name, hint, Some((stored, None)), now).await?;
                    Ok((Box::new(read), None))
                }
                None => Ok((Box::new(L2Read::Miss { holds: None }), None)),
            },
            None => Ok((Box::new(self.l2_look(name, now).await?), None)),
        }
    }

    /// What a read of `name` (with `hint`) that `fetched` these bytes (and the TTL it
    /// set) found: the guest's judgement, then what it leaves to do.
    pub(crate) async fn l2_judge(
        &self,
        name: &str,
        hint: Option<NextRead>,
        fetched: Option<(Bytes, Option<u64>)>,
        now: u64,
    ) -> Result<L2Read> {
        let Some((stored, slid_ms)) = fetched else {
            return Ok(L2Read::Miss { holds: None });
        };
        let outcome = self.inner.policy.read(&stored, now, slid_ms)?;
        self.l2_judged(name, hint, stored, outcome, now).await
    }

    /// What the guest's judgement `outcome` of the bytes `stored` under `name` leaves to
    /// do: a tagged entry's tags judged, then the judgement settled.
    async fn l2_judged(
        &self,
        name: &str,
        hint: Option<NextRead>,
        stored: Bytes,
        mut outcome: ReadOutcome,
        now: u64,
    ) -> Result<L2Read> {
        let inner = &*self.inner;
        // A tagged entry is judged by its tags' moments too (contract §7.5).
        let mut stamp = None;
        if let ReadOutcome::Fresh(hit) | ReadOutcome::Stale(hit) = &mut outcome
            && let Some(tagged) = hit.tagged.take()
        {
            let (verdict, tags) = self.judge_tagged(tagged, hit.meta, now).await?;
            match verdict {
                TagVerdict::Untouched => stamp = Some(tags),
                TagVerdict::Stale(meta) => {
                    inner.read_hints.note(name, hint, NextRead::Get);
                    return Ok(L2Read::Stale {
                        value: stored.slice(hit.value_offset as usize..),
                        meta,
                        holds: stored,
                    });
                }
                TagVerdict::Removed => return self.remove_read(name, stored).await,
                // Judged again by the store's own moments (`judge_tagged`), and still not
                // servable as it is (stale past a moment the store lost): a miss, left in
                // the store.
                TagVerdict::Hidden => return Ok(L2Read::Miss { holds: Some(stored) }),
            }
        }
        self.l2_settle(name, hint, stored, outcome, stamp).await
    }

    /// The read `hint` asks for: the bytes found and the TTL the read set, if it set
    /// one; `None` for nothing. A value of another Redis type is removed: nothing.
    async fn l2_fetch(
        &self,
        name: &str,
        hint: Option<NextRead>,
        now: u64,
    ) -> Result<Option<(Bytes, Option<u64>)>> {
        let inner = &*self.inner;
        let entries = &inner.stores.entries;
        let (read, slid_ms) = match hint {
            Some(NextRead::Script) => match entries.read_and_touch(name, now) {
                Some(touching) => (touching, None),
                None => (entries.get(name), None),
            },
            Some(NextRead::Expiring(ttl_ms)) => match entries.get_and_expire(name, ttl_ms) {
                Some(expiring) => (expiring, Some(ttl_ms)),
                None => (entries.get(name), None),
            },
            Some(NextRead::Get) | None => (entries.get(name), None),
        };
        match read.await {
            Ok(Some(stored)) => Ok(Some((stored, slid_ms))),
            Ok(None) => Ok(None),
            Err(e) if e.kind() == ErrorKind::Corrupt => {
                Metrics::bump(&inner.metrics.corrupt);
                crate::throttle::warn_every!(10, name, error = %e, "corrupt entry removed and treated as a miss");
                self.l2_op(entries.delete_foreign(name)).await?;
                Ok(None)
            }
            Err(e) => Err(self.l2_failed(e)),
        }
    }

    /// What the guest's judgement of `stored` leaves to do: a touch written back (owed
    /// if it fails), a stale copy's or a tombstone's TTL given back, expired and corrupt
    /// bytes removed; and the key's next read noted.
    async fn l2_settle(
        &self,
        name: &str,
        hint: Option<NextRead>,
        stored: Bytes,
        outcome: ReadOutcome,
        stamp: Option<super::tags::TagStamp>,
    ) -> Result<L2Read> {
        let inner = &*self.inner;
        match outcome {
            ReadOutcome::Fresh(hit) => {
                let value = stored.slice(hit.value_offset as usize..);
                let ttl = hit.store_ttl_ms;
                let holds = match hit.touch {
                    Some(Touch::Rewrite(header)) => {
                        // The fixed header only: the bytes after it (a tagged entry's
                        // tags, the value) stay as they are.
                        let touched = crate::store::splice(&header, &stored[header.len()..]);
                        self.owe(name, stored, touched.clone(), ttl).await?;
                        touched
                    }
                    Some(Touch::Expire) => {
                        self.owe(name, stored.clone(), stored.clone(), ttl).await?;
                        stored
                    }
                    None => stored,
                };
                inner.read_hints.note(name, hint, hit.next_read);
                Ok(L2Read::Hit(value, hit.meta, holds, stamp))
            }
            ReadOutcome::Stale(hit) => {
                if let Some(Touch::Expire) = hit.touch {
                    // A guess set its TTL: give it back the TTL of its stale window.
                    self.owe(name, stored.clone(), stored.clone(), hit.store_ttl_ms)
                        .await?;
                }
                inner.read_hints.note(name, hint, hit.next_read);
                Ok(L2Read::Stale {
                    value: stored.slice(hit.value_offset as usize..),
                    meta: hit.meta,
                    holds: stored,
                })
            }
            ReadOutcome::Removed(rearm) => {
                if rearm {
                    // The guess gave the tombstone a sliding TTL: give it a removal's.
                    let ttl = inner.read_hints.removal_ttl_ms();
                    self.owe(name, stored.clone(), stored.clone(), ttl).await?;
                }
                inner.read_hints.note(name, hint, NextRead::Get);
                Ok(L2Read::Miss { holds: Some(stored) })
            }
            ReadOutcome::Expired => self.remove_read(name, stored).await,
            ReadOutcome::Corrupt(reason) => {
                Metrics::bump(&inner.metrics.corrupt);
                crate::throttle::warn_every!(10, name, %reason, "corrupt entry removed and treated as a miss");
                self.remove_read(name, stored).await
            }
        }
    }

    /// Removes what a read found, unless it changed meanwhile: a miss, holding what is
    /// there now if something else is.
    async fn remove_read(&self, name: &str, stored: Bytes) -> Result<L2Read> {
        let entries = &self.inner.stores.entries;
        let removed = self.l2_op(entries.delete_if_equal(name, stored.clone())).await?;
        Ok(L2Read::Miss {
            holds: (!removed).then_some(stored),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_keys_share_a_hint_slot_is_the_same_in_every_table() {
        // A simulated run replays its commands byte for byte: the slots may not depend
        // on a random seed.
        let (one, two) = (ReadHints::new(0, 0), ReadHints::new(0, 0));
        for key in ["e", "{corral:k}:e@3", "another key"] {
            let at = |hints: &ReadHints| {
                let (hash, slot) = hints.slot(key);
                let index = (std::ptr::from_ref(slot) as usize - hints.slots.as_ptr() as usize)
                    / std::mem::size_of::<(AtomicU64, AtomicU64)>();
                (hash, index)
            };
            assert_eq!(at(&one), at(&two), "{key}");
        }
    }

    #[test]
    fn a_guess_is_kept_until_another_replaces_it() {
        let hints = ReadHints::new(0, 0);
        assert_eq!(hints.get("k"), None);
        hints.note("k", None, NextRead::Get);
        assert_eq!(hints.get("k"), None, "a plain GET is the default: nothing kept");
        for next in [
            NextRead::Expiring(1_200_000),
            NextRead::Script,
            NextRead::Expiring((1 << 53) - 1),
        ] {
            hints.note("k", hints.get("k"), next);
            assert_eq!(hints.get("k"), Some(next));
        }
        hints.note("k", hints.get("k"), NextRead::Get);
        assert_eq!(hints.get("k"), Some(NextRead::Get));
    }

    #[test]
    fn keys_sharing_a_slot_push_each_other_out_and_nothing_worse() {
        let hints = ReadHints::new(0, 0);
        let keys: Vec<String> = (0..80_000).map(|i| format!("key-{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            hints.note(k, None, NextRead::Expiring(i as u64 + 1));
        }
        // 80,000 keys in 16,384 slots: most guesses are gone, the rest are right.
        let right = keys
            .iter()
            .enumerate()
            .filter(|(i, k)| hints.get(k) == Some(NextRead::Expiring(*i as u64 + 1)))
            .count();
        let remembered = keys.iter().filter(|k| hints.get(k).is_some()).count();
        assert_eq!(right, remembered, "a slot answers only for the key it holds");
        assert!((8_000..=16_384).contains(&right), "{right}");
    }
}
