//! Counters of what a cache did, readable at any time ([`MetricsSnapshot`]) and exported
//! through the [`metrics`] facade under conventional names (`corral_cache_*_total`, labelled
//! with the cache's `prefix`).
//!
//! Each counter is counted twice: in the cache's own atomic (what
//! [`Corral::metrics`](crate::Corral::metrics) and the CLI show) and in the handle of the
//! `metrics` recorder in force when the cache was built. Without a recorder that handle is
//! a no-op, so the export costs one branch per count.

use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{Label, Unit};

/// One counter of a cache: its own count, and its exported handle.
#[derive(Debug)]
pub(crate) struct Counter {
    value: AtomicU64,
    exported: metrics::Counter,
}

impl Counter {
    /// Registers `name{prefix, label}` with the recorder in force now (the global one,
    /// or a local one around the cache's construction).
    fn new(name: &'static str, prefix: &str, label: Option<(&'static str, &'static str)>) -> Self {
        let mut labels = vec![Label::new("prefix", prefix.to_owned())];
        labels.extend(label.map(|(key, value)| Label::from_static_parts(key, value)));
        Self {
            value: AtomicU64::new(0),
            exported: metrics::counter!(name, labels),
        }
    }

    fn add(&self, n: u64) {
        if n > 0 {
            self.value.fetch_add(n, Ordering::Relaxed);
            self.exported.increment(n);
        }
    }

    fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

/// The loader's duration, in seconds, per load (the get-or-set driver records it).
pub(crate) const LOAD_DURATION: &str = "corral_cache_load_duration_seconds";

/// Every exported counter name, its unit and what it counts (given to the recorder with
/// `describe_counter!`); labels other than `prefix` are listed in the description.
const DESCRIPTIONS: &[(&str, Unit, &str)] = &[
    (
        "corral_cache_hits_total",
        Unit::Count,
        "Reads served from a tier (label tier: l1 or l2).",
    ),
    (
        "corral_cache_misses_total",
        Unit::Count,
        "Reads that found nothing fresh in either tier.",
    ),
    ("corral_cache_sets_total", Unit::Count, "Entries written by set."),
    (
        "corral_cache_removes_total",
        Unit::Count,
        "Entries removed on request.",
    ),
    (
        "corral_cache_corrupt_entries_total",
        Unit::Count,
        "Corrupt or foreign entries found, removed and treated as misses.",
    ),
    (
        "corral_cache_loads_total",
        Unit::Count,
        "Keys a get-or-set loader was called for (a bulk call's loader call counts each of its keys).",
    ),
    (
        "corral_cache_coalesced_total",
        Unit::Count,
        "Get-or-set callers served by another caller's load in this process.",
    ),
    (
        "corral_cache_lock_waits_total",
        Unit::Count,
        "Get-or-set callers that waited on another process's lock.",
    ),
    (
        "corral_cache_lock_timeouts_total",
        Unit::Count,
        "Distributed lock waits that ran past the lock wait.",
    ),
    (
        "corral_cache_degraded_loads_total",
        Unit::Count,
        "Loads run uncached because the distributed lock could not be had.",
    ),
    (
        "corral_cache_l2_errors_total",
        Unit::Count,
        "L2 operations that failed.",
    ),
    (
        "corral_cache_invalidations_total",
        Unit::Count,
        "Invalidations (label kind: peer = an L1 entry dropped for another process's write, \
         flush = the whole L1 dropped on a (re)subscription, expire, tag, clear).",
    ),
    (
        "corral_cache_fills_refused_total",
        Unit::Count,
        "Loads whose L2 write was refused because the key was set or removed while they ran, or their lock lapsed.",
    ),
    (
        "corral_cache_stale_served_total",
        Unit::Count,
        "Stale values served in place of a failed or late load.",
    ),
    (
        "corral_cache_load_timeouts_total",
        Unit::Count,
        "Loads that ran past a timeout (label kind: soft or hard).",
    ),
    (
        "corral_cache_refreshes_total",
        Unit::Count,
        "Entries reloaded in the background.",
    ),
];

/// A counter's label besides `prefix`, if any.
macro_rules! label {
    () => {
        None
    };
    ($key:literal, $value:literal) => {
        Some(($key, $value))
    };
}

/// Declares the counters once: the fields of [`Metrics`] and of [`MetricsSnapshot`], their
/// order in [`MetricsSnapshot::fields`], and the exported name and label of each.
macro_rules! counters {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident => $name:literal $({ $key:literal = $value:literal })?;
    )*) => {
        /// The counters of one cache (shared by its clones).
        #[derive(Debug)]
        pub(crate) struct Metrics {
            $(pub(crate) $field: Counter,)*
            /// How long each load waited for its value from the loader, in seconds
            /// ([`LOAD_DURATION`]); a bulk call's key counts from when it was ready to
            /// load, its wait for the batch's other keys included.
            pub(crate) load_duration: metrics::Histogram,
        }

        impl Metrics {
            /// The counters of the cache named under `prefix`, registered with the
            /// `metrics` recorder in force now: install the recorder before building caches.
            pub(crate) fn new(prefix: &str) -> Self {
                describe();
                Self {
                    $($field: Counter::new($name, prefix, label!($($key, $value)?)),)*
                    load_duration: metrics::histogram!(
                        LOAD_DURATION,
                        vec![Label::new("prefix", prefix.to_owned())]
                    ),
                }
            }

            pub(crate) fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot {
                    $($field: self.$field.get(),)*
                }
            }
        }

        /// The exported name and extra label of each field, in [`MetricsSnapshot::fields`]'s order.
        #[cfg(test)]
        const EXPORTED: [(&str, &str, Option<(&str, &str)>); COUNTERS] = [
            $((stringify!($field), $name, label!($($key, $value)?)),)*
        ];

        /// How many counters a cache keeps.
        const COUNTERS: usize = [$(stringify!($field)),*].len();

        /// What a cache has done since it was built. Serializes to a flat JSON object of
        /// counters (`{"l1_hits": 10, ...}`), say for a `/metrics` or health endpoint.
        ///
        /// The same counts are exported through the `metrics` facade (see docs/telemetry.md
        /// for their names).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
        #[non_exhaustive]
        pub struct MetricsSnapshot {
            $($(#[doc = $doc])* pub $field: u64,)*
        }

        impl MetricsSnapshot {
            /// What was counted since `earlier` (a snapshot of the same cache taken
            /// before this one), counter by counter.
            pub fn since(&self, earlier: &MetricsSnapshot) -> MetricsSnapshot {
                MetricsSnapshot {
                    $($field: self.$field.saturating_sub(earlier.$field),)*
                }
            }

            /// Name and value of every counter, in a stable order (for tables and JSON).
            pub fn fields(&self) -> [(&'static str, u64); COUNTERS] {
                [$((stringify!($field), self.$field),)*]
            }
        }
    };
}

counters! {
    /// Reads served from L1 (`corral_cache_hits_total{tier="l1"}`).
    l1_hits => "corral_cache_hits_total" { "tier" = "l1" };
    /// Reads served from L2 (`corral_cache_hits_total{tier="l2"}`).
    l2_hits => "corral_cache_hits_total" { "tier" = "l2" };
    /// Reads that found nothing fresh (`corral_cache_misses_total`).
    misses => "corral_cache_misses_total";
    /// Entries written (`corral_cache_sets_total`).
    sets => "corral_cache_sets_total";
    /// Entries removed on request (`corral_cache_removes_total`).
    removes => "corral_cache_removes_total";
    /// Corrupt or foreign entries found, removed and treated as misses
    /// (`corral_cache_corrupt_entries_total`).
    corrupt => "corral_cache_corrupt_entries_total";
    /// Keys a get-or-set loader was called for: one per single-key load, and each key of
    /// a bulk call's loader call (`corral_cache_loads_total`).
    loads => "corral_cache_loads_total";
    /// Get-or-set callers served by another caller's load in this process
    /// (`corral_cache_coalesced_total`).
    coalesced => "corral_cache_coalesced_total";
    /// Get-or-set callers that waited on another process's lock
    /// (`corral_cache_lock_waits_total`).
    lock_waits => "corral_cache_lock_waits_total";
    /// Distributed lock waits that ran past the deadline (`corral_cache_lock_timeouts_total`).
    lock_timeouts => "corral_cache_lock_timeouts_total";
    /// Loads run uncached because the distributed lock could not be had
    /// (`corral_cache_degraded_loads_total`).
    degraded => "corral_cache_degraded_loads_total";
    /// L2 operations that failed (`corral_cache_l2_errors_total`).
    l2_errors => "corral_cache_l2_errors_total";
    /// L1 entries dropped because another process wrote, removed or loaded the key
    /// (`corral_cache_invalidations_total{kind="peer"}`).
    l1_invalidations => "corral_cache_invalidations_total" { "kind" = "peer" };
    /// Times the whole L1 was dropped because the landing channel was (re)established
    /// and announcements may have been missed (`corral_cache_invalidations_total{kind="flush"}`).
    l1_flushes => "corral_cache_invalidations_total" { "kind" = "flush" };
    /// Loads whose L2 write was refused because the key was set or removed while they
    /// ran (fenced fills), or because their flight's lock lapsed meanwhile: the caller
    /// got the value, the newer write stayed (`corral_cache_fills_refused_total`).
    fills_refused => "corral_cache_fills_refused_total";
    /// Stale values served in place of a failed or late load
    /// (`corral_cache_stale_served_total`).
    stale_served => "corral_cache_stale_served_total";
    /// Loads that ran past their soft timeout (`corral_cache_load_timeouts_total{kind="soft"}`).
    soft_timeouts => "corral_cache_load_timeouts_total" { "kind" = "soft" };
    /// Loads that ran past their hard timeout (`corral_cache_load_timeouts_total{kind="hard"}`).
    hard_timeouts => "corral_cache_load_timeouts_total" { "kind" = "hard" };
    /// Entries reloaded in the background (`corral_cache_refreshes_total`).
    refreshes => "corral_cache_refreshes_total";
    /// Soft invalidations: entries marked expired, kept for stale use
    /// (`corral_cache_invalidations_total{kind="expire"}`).
    expires => "corral_cache_invalidations_total" { "kind" = "expire" };
    /// Invalidations by tag (`corral_cache_invalidations_total{kind="tag"}`).
    tag_invalidations => "corral_cache_invalidations_total" { "kind" = "tag" };
    /// Whole-cache clears (`corral_cache_invalidations_total{kind="clear"}`).
    clears => "corral_cache_invalidations_total" { "kind" = "clear" };
}

/// Tells the recorder in force what each exported name counts, and in what unit.
fn describe() {
    for &(name, unit, description) in DESCRIPTIONS {
        metrics::describe_counter!(name, unit, description);
    }
    metrics::describe_histogram!(
        LOAD_DURATION,
        Unit::Seconds,
        "How long each load waited for its value from the loader; a bulk call's key counts from when it was ready to load, its wait for the batch's other keys included."
    );
}

impl Metrics {
    /// Counts one more: in the cache's own counter and in the exported one.
    pub(crate) fn bump(counter: &Counter) {
        counter.add(1);
    }

    /// Counts `n` more at once (none: nothing recorded).
    pub(crate) fn add(counter: &Counter, n: u64) {
        counter.add(n);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use metrics::{Key, KeyName, Metadata, Recorder, SharedString};
    use parking_lot::Mutex;

    use super::*;

    #[test]
    fn a_snapshot_serializes_to_flat_counters() {
        let m = Metrics::new("test:");
        Metrics::bump(&m.l1_hits);
        let json = serde_json::to_value(m.snapshot()).unwrap();
        assert_eq!(json["l1_hits"], 1);
        assert_eq!(json["misses"], 0);
        assert_eq!(json["stale_served"], 0);
        assert_eq!(json.as_object().unwrap().len(), COUNTERS);
    }

    #[test]
    fn fields_follow_the_declaration_and_every_name_is_described() {
        let m = Metrics::new("test:");
        Metrics::bump(&m.clears);
        let fields = m.snapshot().fields();
        assert_eq!(fields[0], ("l1_hits", 0));
        assert_eq!(fields[COUNTERS - 1], ("clears", 1));
        for (field, name, _) in EXPORTED {
            assert!(
                name.starts_with("corral_cache_") && name.ends_with("_total"),
                "{field}: {name}"
            );
            assert!(
                DESCRIPTIONS.iter().any(|(described, ..)| *described == name),
                "{name} is not described"
            );
        }
        // No two fields share a series.
        let mut series: Vec<_> = EXPORTED.iter().map(|(_, name, label)| (name, label)).collect();
        series.sort();
        series.dedup();
        assert_eq!(series.len(), COUNTERS);
    }

    /// A recorder that keeps counters by `name{labels}` and descriptions by name.
    #[derive(Default)]
    struct Kept {
        counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
        units: Mutex<BTreeMap<String, Option<Unit>>>,
    }

    impl Kept {
        fn value(&self, series: &str) -> Option<u64> {
            self.counters
                .lock()
                .get(series)
                .map(|c| c.load(Ordering::Relaxed))
        }
    }

    impl Recorder for Kept {
        fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.units.lock().insert(key.as_str().to_owned(), unit);
        }
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.units.lock().insert(key.as_str().to_owned(), unit);
        }
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> metrics::Counter {
            let labels: Vec<_> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let series = format!("{}{{{}}}", key.name(), labels.join(","));
            metrics::Counter::from_arc(self.counters.lock().entry(series).or_default().clone())
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> metrics::Gauge {
            metrics::Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> metrics::Histogram {
            metrics::Histogram::noop()
        }
    }

    #[test]
    fn counters_are_exported_with_their_labels_and_units() {
        let kept = Kept::default();
        let m = metrics::with_local_recorder(&kept, || Metrics::new("app:"));
        Metrics::bump(&m.l2_hits);
        Metrics::bump(&m.l2_hits);
        Metrics::bump(&m.soft_timeouts);
        assert_eq!(
            kept.value("corral_cache_hits_total{prefix=app:,tier=l2}"),
            Some(2)
        );
        assert_eq!(
            kept.value("corral_cache_hits_total{prefix=app:,tier=l1}"),
            Some(0)
        );
        assert_eq!(
            kept.value("corral_cache_load_timeouts_total{prefix=app:,kind=soft}"),
            Some(1)
        );
        assert_eq!(kept.value("corral_cache_misses_total{prefix=app:}"), Some(0));
        assert_eq!(kept.counters.lock().len(), COUNTERS);
        assert_eq!(kept.units.lock()["corral_cache_loads_total"], Some(Unit::Count));
        assert_eq!(kept.units.lock()[LOAD_DURATION], Some(Unit::Seconds));
        assert_eq!(m.snapshot().l2_hits, 2);
    }
}
