//! Counters of what a cache did, readable at any time.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) l1_hits: AtomicU64,
    pub(crate) l2_hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) sets: AtomicU64,
    pub(crate) removes: AtomicU64,
    pub(crate) corrupt: AtomicU64,
    pub(crate) loads: AtomicU64,
    pub(crate) coalesced: AtomicU64,
    pub(crate) lock_waits: AtomicU64,
    pub(crate) lock_timeouts: AtomicU64,
    pub(crate) degraded: AtomicU64,
    pub(crate) l2_errors: AtomicU64,
    pub(crate) l1_invalidations: AtomicU64,
    pub(crate) l1_flushes: AtomicU64,
    pub(crate) fills_refused: AtomicU64,
}

impl Metrics {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            l1_hits: get(&self.l1_hits),
            l2_hits: get(&self.l2_hits),
            misses: get(&self.misses),
            sets: get(&self.sets),
            removes: get(&self.removes),
            corrupt: get(&self.corrupt),
            loads: get(&self.loads),
            coalesced: get(&self.coalesced),
            lock_waits: get(&self.lock_waits),
            lock_timeouts: get(&self.lock_timeouts),
            degraded: get(&self.degraded),
            l2_errors: get(&self.l2_errors),
            l1_invalidations: get(&self.l1_invalidations),
            l1_flushes: get(&self.l1_flushes),
            fills_refused: get(&self.fills_refused),
        }
    }
}

/// What a cache has done since it was built. Serializes to a flat JSON object of
/// counters (`{"l1_hits": 10, ...}`), say for a `/metrics` or health endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Reads served from L1.
    pub l1_hits: u64,
    /// Reads served from L2.
    pub l2_hits: u64,
    /// Reads that found nothing fresh.
    pub misses: u64,
    /// Entries written.
    pub sets: u64,
    /// Entries removed on request.
    pub removes: u64,
    /// Corrupt or foreign entries found, removed and treated as misses.
    pub corrupt: u64,
    /// Loader calls made by get-or-set.
    pub loads: u64,
    /// Get-or-set callers served by another caller's load in this process.
    pub coalesced: u64,
    /// Get-or-set callers that waited on another process's lock.
    pub lock_waits: u64,
    /// Distributed lock waits that ran past the deadline.
    pub lock_timeouts: u64,
    /// Loads run uncached because the distributed lock could not be had.
    pub degraded: u64,
    /// L2 operations that failed.
    pub l2_errors: u64,
    /// L1 entries dropped because another process wrote, removed or loaded the key.
    pub l1_invalidations: u64,
    /// Times the whole L1 was dropped because the landing channel was (re)established
    /// and announcements may have been missed.
    pub l1_flushes: u64,
    /// Loads whose L2 write was refused because the key was set or removed while they
    /// ran (fenced fills): the caller got the value, the newer write stayed.
    pub fills_refused: u64,
}

impl MetricsSnapshot {
    /// Name and value of every counter, in a stable order (for tables and JSON).
    pub fn fields(&self) -> [(&'static str, u64); 15] {
        [
            ("l1_hits", self.l1_hits),
            ("l2_hits", self.l2_hits),
            ("misses", self.misses),
            ("sets", self.sets),
            ("removes", self.removes),
            ("corrupt", self.corrupt),
            ("loads", self.loads),
            ("coalesced", self.coalesced),
            ("lock_waits", self.lock_waits),
            ("lock_timeouts", self.lock_timeouts),
            ("degraded", self.degraded),
            ("l2_errors", self.l2_errors),
            ("l1_invalidations", self.l1_invalidations),
            ("l1_flushes", self.l1_flushes),
            ("fills_refused", self.fills_refused),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_serializes_to_flat_counters() {
        let m = Metrics::default();
        Metrics::bump(&m.l1_hits);
        let json = serde_json::to_value(m.snapshot()).unwrap();
        assert_eq!(json["l1_hits"], 1);
        assert_eq!(json["misses"], 0);
    }
}
