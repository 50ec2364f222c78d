//! The guest's judgements of fresh hits, kept: a head read again is served by the
//! judgement the guest gave it, without asking again.
//!
//! The guest's `read-many` is a function of the bytes it is given, the moment, and
//! what is fixed for a cache (its limits, its L1 TTL). For a fresh hit it says, beside
//! its verdict, until when the same head judges the same way (`keep-until-ms`) and how
//! many of its leading bytes that depends on (`kept-len`): at any moment before then,
//! a read whose first `kept-len` bytes and whole length are the same is served with
//! the same value offset and next read, L1 until the earlier of that moment and the
//! read's own moment plus the L1 TTL (`corral_core::batch::Served::again_at`). This
//! table only remembers such answers and applies that rule; it decides nothing. An
//! entry lives in the store unchanged for most of its life and is read many times, so
//! a batch of hits mostly finds each head here.
//!
//! A judgement is found by its key's hash (the names' hasher: a batch has it already,
//! and a gathering of `get`s hashes its keys alike) but trusted only for its very bytes: a slot holds whichever head was kept there
//! last, a collision costs a guest call, never a wrong judgement. A slot is a line of
//! atomics under a sequence number: a reader takes no lock and writes nothing (a write
//! it overlapped is seen in the sequence, and the read is a miss); a writer that finds
//! the slot being written skips it.

use std::sync::atomic::{AtomicU64, Ordering, fence};

use crate::guest::policy::NextRead;

/// The most bytes a kept judgement may depend on: every untagged header (32 or 40
/// bytes). A longer one (a tagged entry's, were it ever kept) is not kept.
pub(crate) const KEPT_BYTES: usize = 40;

const WORDS: usize = KEPT_BYTES / 8;

/// Two ways a set: a batch of a hundred keys over the smallest table finds a set that
/// a third key reaches about once in a hundred batches.
const WAYS: usize = 2;

/// A kept judgement, applied at a moment: what a served read needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Again {
    pub(crate) value_offset: u32,
    pub(crate) next_read: NextRead,
    pub(crate) l1_until_ms: u64,
}

/// One kept judgement: a cache line of atomics.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    /// Even while settled, odd while written; every write moves it on by two.
    seq: AtomicU64,
    /// The kept bytes, little-endian, zero past their length.
    head: [AtomicU64; WORDS],
    /// The kept length (bits 0-7), the next read (bit 8: the read-and-touch script), a
    /// tag of the key's hash (bits 9-31: a way holding another key's head is passed over
    /// at once, as most are), the value's offset (bits 32-63). 0: empty.
    shape: AtomicU64,
    /// The whole length of the read.
    total_len: AtomicU64,
    /// Until when the judgement holds (exclusive).
    until_ms: AtomicU64,
}

/// A read's kept bytes as words, zero past them, and their length; `None` when too long.
fn words_of(head: &[u8], len: usize) -> Option<[u64; WORDS]> {
    if len > KEPT_BYTES || len > head.len() {
        return None;
    }
    let mut words = [0u64; WORDS];
    for (word, chunk) in words.iter_mut().zip(head[..len].chunks(8)) {
        let mut bytes = [0u8; 8];
        bytes[..chunk.len()].copy_from_slice(chunk);
        *word = u64::from_le_bytes(bytes);
    }
    Some(words)
}

/// Whether `slot` holds the bytes `kept` (at most [`KEPT_BYTES`]), as [`words_of`]
/// writes them.
fn holds(slot: &Slot, kept: &[u8]) -> bool {
    if kept.len() > KEPT_BYTES {
        return false;
    }
    let mut chunks = kept.chunks_exact(8);
    let whole = chunks.by_ref().zip(&slot.head).all(|(chunk, word)| {
        <[u8; 8]>::try_from(chunk)
            .is_ok_and(|chunk| u64::from_le_bytes(chunk) == word.load(Ordering::Relaxed))
    });
    let rest = chunks.remainder();
    whole
        && (rest.is_empty() || {
            let mut bytes = [0u8; 8];
            bytes[..rest.len()].copy_from_slice(rest);
            slot.head[kept.len() / 8].load(Ordering::Relaxed) == u64::from_le_bytes(bytes)
        })
}

fn shape_of(len: usize, next_read: NextRead, value_offset: u32, hash: u64) -> Option<u64> {
    let script = match next_read {
        NextRead::Get => 0,
        NextRead::Script => 1,
        // A read that sets a TTL is never served from its read alone.
        NextRead::Expiring(_) => return None,
    };
    Some(len as u64 | script << 8 | tag_of(hash) | u64::from(value_offset) << 32)
}

/// A key's tag in a slot's shape (see [`Slot::shape`]): bits its set was not picked by.
fn tag_of(hash: u64) -> u64 {
    (hash >> 41) << 9 & TAG
}

const TAG: u64 = 0xffff_fe00;

/// The kept judgements of one cache.
pub(crate) struct Kept {
    slots: Box<[Slot]>,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept").field("slots", &self.slots.len()).finish()
    }
}

impl Kept {
    /// A table for about `capacity` keys (as many as L1 holds): between 2,048 and 8,192
    /// slots of 64 bytes.
    pub(crate) fn new(capacity: u64) -> Self {
        let slots = capacity.clamp(1 << 11, 1 << 13).next_power_of_two() as usize;
        Kept {
            slots: (0..slots).map(|_| Slot::default()).collect(),
        }
    }

    /// The ways a key hashed `hash` may be kept in.
    fn ways(&self, hash: u64) -> &[Slot] {
        let set = (hash as usize & (self.slots.len() / WAYS - 1)) * WAYS;
        &self.slots[set..set + WAYS]
    }

    /// The judgement kept for `stored` (the bytes a key hashed `hash` holds) at `now_ms`,
    /// given the cache's `l1_ttl_ms`: `None` when none is kept for these bytes, or the
    /// kept one lapsed.
    pub(crate) fn get(&self, hash: u64, stored: &[u8], now_ms: u64, l1_ttl_ms: u64) -> Option<Again> {
        self.ways(hash).iter().find_map(|slot| {
            let seq = slot.seq.load(Ordering::Acquire);
            let shape = slot.shape.load(Ordering::Relaxed);
            let until_ms = slot.until_ms.load(Ordering::Relaxed);
            let len = (shape & 0xff) as usize;
            let same = seq & 1 == 0
                && shape != 0
                && shape & TAG == tag_of(hash)
                && now_ms < until_ms
                && slot.total_len.load(Ordering::Relaxed) == stored.len() as u64
                && holds(slot, stored.get(..len)?);
            // What was read is what one write left only if no write began meanwhile.
            fence(Ordering::Acquire);
            if !same || slot.seq.load(Ordering::Relaxed) != seq {
                return None;
            }
            Some(Again {
                value_offset: (shape >> 32) as u32,
                next_read: if shape >> 8 & 1 == 1 {
                    NextRead::Script
                } else {
                    NextRead::Get
                },
                l1_until_ms: until_ms.min(now_ms.saturating_add(l1_ttl_ms)),
            })
        })
    }

    /// Keeps the guest's judgement of `stored` (the bytes a key hashed `hash` holds):
    /// served with `value_offset` and `next_read` until `until_ms`, for any read whose
    /// first `len` bytes and whole length are these. Nothing when it is not to be kept
    /// (`until_ms` 0, too long a head) or the slot is being written.
    pub(crate) fn keep(
        &self,
        hash: u64,
        stored: &[u8],
        (len, until_ms): (usize, u64),
        value_offset: u32,
        next_read: NextRead,
    ) {
        let (Some(words), Some(shape)) = (
            words_of(stored, len),
            shape_of(len, next_read, value_offset, hash),
        ) else {
            return;
        };
        if until_ms == 0 || len == 0 {
            return;
        }
        // The way holding these very bytes, else the one whose judgement lapses first.
        let ways = self.ways(hash);
        let slot = ways
            .iter()
            .find(|slot| {
                slot.shape.load(Ordering::Relaxed) == shape
                    && slot.total_len.load(Ordering::Relaxed) == stored.len() as u64
                    && words
                        .iter()
                        .zip(&slot.head)
                        .all(|(w, kept)| *w == kept.load(Ordering::Relaxed))
            })
            .unwrap_or_else(|| {
                ways.iter()
                    .min_by_key(|slot| slot.until_ms.load(Ordering::Relaxed))
                    .unwrap_or(&ways[0])
            });
        let seq = slot.seq.load(Ordering::Relaxed);
        if seq & 1 == 1
            || slot
                .seq
                .compare_exchange(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        // No read of the fields below may be taken for one before the odd number.
        fence(Ordering::Release);
        for (kept, word) in slot.head.iter().zip(words) {
            kept.store(word, Ordering::Relaxed);
        }
        slot.shape.store(shape, Ordering::Relaxed);
        slot.total_len.store(stored.len() as u64, Ordering::Relaxed);
        slot.until_ms.store(until_ms, Ordering::Relaxed);
        slot.seq.store(seq + 2, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(n: u8) -> Vec<u8> {
        let mut stored: Vec<u8> = (0..32).map(|i| i ^ n).collect();
        stored.extend_from_slice(b"value");
        stored
    }

    #[test]
    fn a_kept_judgement_serves_only_its_own_bytes_and_length_until_it_lapses() {
        let kept = Kept::new(0);
        let stored = header(1);
        assert_eq!(kept.get(7, &stored, 100, 50), None, "nothing kept yet");
        kept.keep(7, &stored, (32, 1_000), 32, NextRead::Get);
        let again = Again {
            value_offset: 32,
            next_read: NextRead::Get,
            l1_until_ms: 150,
        };
        assert_eq!(kept.get(7, &stored, 100, 50), Some(again));
        assert_eq!(
            kept.get(7, &stored, 990, 50).map(|a| a.l1_until_ms),
            Some(1_000),
            "never past its lapse"
        );
        assert_eq!(kept.get(7, &stored, 1_000, 50), None, "lapsed");
        // The value past the kept bytes does not matter; their length and the kept bytes do.
        let mut other_value = stored.clone();
        other_value[36] ^= 0xff;
        assert_eq!(kept.get(7, &other_value, 100, 50), Some(again));
        let mut other_header = stored.clone();
        other_header[31] ^= 1;
        assert_eq!(kept.get(7, &other_header, 100, 50), None);
        let mut longer = stored.clone();
        longer.push(0);
        assert_eq!(kept.get(7, &longer, 100, 50), None);
        assert_eq!(kept.get(7, &stored[..20], 100, 50), None, "shorter than kept");
        // Found by its key's hash: another set does not hold it, and another key of the
        // same set passes over it.
        assert_eq!(kept.get(8, &stored, 100, 50), None);
        assert_eq!(kept.get(7 | 1 << 50, &stored, 100, 50), None);
    }

    #[test]
    fn what_cannot_be_kept_is_not() {
        let kept = Kept::new(0);
        let stored = header(2);
        kept.keep(3, &stored, (32, 0), 32, NextRead::Get);
        kept.keep(4, &stored, (0, 1_000), 32, NextRead::Get);
        kept.keep(5, &stored, (KEPT_BYTES + 1, 1_000), 32, NextRead::Get);
        kept.keep(6, &stored, (32, 1_000), 32, NextRead::Expiring(5));
        for hash in 3..7 {
            assert_eq!(kept.get(hash, &stored, 1, 1), None, "{hash}");
        }
        kept.keep(8, &stored, (32, 1_000), 32, NextRead::Script);
        assert_eq!(
            kept.get(8, &stored, 1, 1).map(|a| a.next_read),
            Some(NextRead::Script)
        );
    }

    #[test]
    fn two_heads_of_one_set_are_both_kept_and_a_third_replaces_the_first_to_lapse() {
        let kept = Kept::new(0);
        let (a, b, c) = (header(1), header(2), header(3));
        kept.keep(0, &a, (32, 500), 32, NextRead::Get);
        kept.keep(0, &b, (32, 900), 32, NextRead::Get);
        assert!(kept.get(0, &a, 1, 10).is_some() && kept.get(0, &b, 1, 10).is_some());
        kept.keep(0, &c, (32, 700), 32, NextRead::Get);
        assert_eq!(kept.get(0, &a, 1, 10), None, "lapsed first, replaced");
        assert!(kept.get(0, &b, 1, 10).is_some() && kept.get(0, &c, 1, 10).is_some());
        // Kept again with a later lapse: the same slot, moved on.
        kept.keep(0, &c, (32, 2_000), 32, NextRead::Get);
        assert_eq!(kept.get(0, &c, 1_500, 10).map(|a| a.l1_until_ms), Some(1_510));
        assert!(kept.get(0, &b, 1, 10).is_some(), "the other way untouched");
    }

    #[test]
    fn heads_that_differ_only_late_are_told_apart() {
        // Envelopes of one kind share their first bytes (magic, version, no absolute
        // expiry): two such heads in one set are two judgements.
        let kept = Kept::new(0);
        let (mut a, mut b) = (header(0), header(0));
        a[27] = 1;
        b[27] = 2;
        kept.keep(0, &a, (32, 500), 32, NextRead::Get);
        kept.keep(0, &b, (32, 900), 32, NextRead::Get);
        assert_eq!(kept.get(0, &a, 1, 1_000).map(|a| a.l1_until_ms), Some(500));
        assert_eq!(kept.get(0, &b, 1, 1_000).map(|b| b.l1_until_ms), Some(900));
        // A head of 33 bytes: its last word holds one.
        let mut odd = header(4);
        odd[32] = 9;
        kept.keep(9, &odd, (33, 700), 33, NextRead::Get);
        assert!(kept.get(9, &odd, 1, 1).is_some());
        odd[32] = 8;
        assert_eq!(kept.get(9, &odd, 1, 1), None);
    }

    #[test]
    fn readers_never_see_half_a_write() {
        // Two heads written over each other in one slot by two writers while a reader
        // looks: the reader finds one of them whole, or nothing.
        let kept = std::sync::Arc::new(Kept::new(0));
        let (a, b) = (header(1), header(2));
        // One way holds a head that never lapses: the two take turns in the other.
        kept.keep(0, &header(3), (32, u64::MAX), 32, NextRead::Get);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writers: Vec<_> = (0..2u64)
            .map(|first| {
                let (kept, stop, a, b) = (kept.clone(), stop.clone(), a.clone(), b.clone());
                std::thread::spawn(move || {
                    let mut n = first;
                    while !stop.load(Ordering::Relaxed) {
                        let (stored, offset) = if n.is_multiple_of(2) { (&a, 32) } else { (&b, 33) };
                        kept.keep(0, stored, (32, 1_000_000 + n), offset, NextRead::Get);
                        n += 1;
                    }
                })
            })
            .collect();
        for _ in 0..200_000 {
            for (stored, offset) in [(&a, 32), (&b, 33)] {
                if let Some(again) = kept.get(0, stored, 1, 10) {
                    assert_eq!(again.value_offset, offset, "a judgement of other bytes");
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        for writer in writers {
            writer.join().expect("a writer");
        }
    }
}
