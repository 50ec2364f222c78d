//! Telemetry: the counters a cache exports through the `metrics` facade (names, labels,
//! values, units) and the `tracing` span of each get-or-set flight.
//!
//! Each cache's counters are registered with the recorder in force when it is built: here
//! a recorder of the test's own, made local to the thread for the `build()` only, so no
//! other test of this binary can count into it (nor it into theirs).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use corral::{Corral, EntryOptions, LoadOptions};
use metrics::{Key, KeyName, Metadata, Recorder, SharedString, Unit};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

fn relative() -> LoadOptions {
    EntryOptions::new()
        .relative(std::time::Duration::from_secs(60))
        .into()
}

/// A recorder that keeps every series as `name{key=value,...}` (labels in registration
/// order, `prefix` first), the histogram samples and the described units.
#[derive(Default)]
struct Kept {
    counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
    histograms: Mutex<BTreeMap<String, Arc<Samples>>>,
    units: Mutex<BTreeMap<String, Option<Unit>>>,
}

#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl metrics::HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().push(value);
    }
}

fn series(key: &Key) -> String {
    let labels: Vec<_> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Kept {
    fn counter(&self, series: &str) -> u64 {
        match self.counters.lock().get(series) {
            Some(c) => c.load(Ordering::Relaxed),
            None => panic!("no series {series}; have {:?}", self.counters.lock().keys()),
        }
    }

    fn samples(&self, series: &str) -> Vec<f64> {
        self.histograms
            .lock()
            .get(series)
            .map(|s| s.0.lock().clone())
            .unwrap_or_default()
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
        metrics::Counter::from_arc(self.counters.lock().entry(series(key)).or_default().clone())
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::from_arc(self.histograms.lock().entry(series(key)).or_default().clone())
    }
}

/// Every field of `MetricsSnapshot` and the series it is exported as, for the default
/// prefix `corral:`.
const EXPORTED: [(&str, &str); 22] = [
    ("l1_hits", "corral_cache_hits_total{prefix=corral:,tier=l1}"),
    ("l2_hits", "corral_cache_hits_total{prefix=corral:,tier=l2}"),
    ("misses", "corral_cache_misses_total{prefix=corral:}"),
    ("sets", "corral_cache_sets_total{prefix=corral:}"),
    ("removes", "corral_cache_removes_total{prefix=corral:}"),
    ("corrupt", "corral_cache_corrupt_entries_total{prefix=corral:}"),
    ("loads", "corral_cache_loads_total{prefix=corral:}"),
    ("coalesced", "corral_cache_coalesced_total{prefix=corral:}"),
    ("lock_waits", "corral_cache_lock_waits_total{prefix=corral:}"),
    (
        "lock_timeouts",
        "corral_cache_lock_timeouts_total{prefix=corral:}",
    ),
    ("degraded", "corral_cache_degraded_loads_total{prefix=corral:}"),
    ("l2_errors", "corral_cache_l2_errors_total{prefix=corral:}"),
    (
        "l1_invalidations",
        "corral_cache_invalidations_total{prefix=corral:,kind=peer}",
    ),
    (
        "l1_flushes",
        "corral_cache_invalidations_total{prefix=corral:,kind=flush}",
    ),
    (
        "fills_refused",
        "corral_cache_fills_refused_total{prefix=corral:}",
    ),
    ("stale_served", "corral_cache_stale_served_total{prefix=corral:}"),
    (
        "soft_timeouts",
        "corral_cache_load_timeouts_total{prefix=corral:,kind=soft}",
    ),
    (
        "hard_timeouts",
        "corral_cache_load_timeouts_total{prefix=corral:,kind=hard}",
    ),
    ("refreshes", "corral_cache_refreshes_total{prefix=corral:}"),
    (
        "expires",
        "corral_cache_invalidations_total{prefix=corral:,kind=expire}",
    ),
    (
        "tag_invalidations",
        "corral_cache_invalidations_total{prefix=corral:,kind=tag}",
    ),
    (
        "clears",
        "corral_cache_invalidations_total{prefix=corral:,kind=clear}",
    ),
];

const LOAD_DURATION: &str = "corral_cache_load_duration_seconds{prefix=corral:}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_are_exported_with_conventional_names_labels_and_units() -> Result<()> {
    let kept = Arc::new(Kept::default());
    let cache = metrics::with_local_recorder(&*kept, || Corral::builder().build())?;
    assert_eq!(
        kept.counters.lock().len(),
        EXPORTED.len(),
        "every counter is registered at build"
    );

    // A miss and its load, then an L1 hit.
    let v = cache
        .get_or_set("a", relative(), || async { Ok::<_, std::io::Error>("A") })
        .await?;
    assert_eq!(v, "A");
    cache
        .get_or_set("a", relative(), || async { Ok::<_, std::io::Error>("never") })
        .await?;

    // Three callers coalesced onto one load.
    let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let leader = {
        let (cache, started, go) = (cache.clone(), started.clone(), go.clone());
        tokio::spawn(async move {
            cache
                .get_or_set("b", relative(), || async move {
                    started.notify_one();
                    go.notified().await;
                    Ok::<_, std::io::Error>("B")
                })
                .await
        })
    };
    started.notified().await;
    let mut followers = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let cache = cache.clone();
        followers.spawn(async move {
            cache
                .get_or_set("b", relative(), || async { Ok::<_, std::io::Error>("not B") })
                .await
        });
    }
    while cache.followers_of("b") < 3 {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    go.notify_one();
    assert_eq!(leader.await??, "B");
    while let Some(v) = followers.join_next().await {
        assert_eq!(v??, "B");
    }

    // A set, a removal and a read of nothing.
    cache.set("s", "S", EntryOptions::new()).await?;
    assert!(cache.remove("s").await?);
    assert_eq!(cache.get("nothing").await?, None);

    let m = cache.metrics();
    assert_eq!(
        (m.l1_hits, m.misses, m.loads, m.coalesced, m.sets, m.removes),
        (1, 3, 2, 3, 1, 1)
    );
    assert_eq!(kept.counter("corral_cache_hits_total{prefix=corral:,tier=l1}"), 1);
    assert_eq!(kept.counter("corral_cache_hits_total{prefix=corral:,tier=l2}"), 0);
    assert_eq!(kept.counter("corral_cache_misses_total{prefix=corral:}"), 3);
    assert_eq!(kept.counter("corral_cache_loads_total{prefix=corral:}"), 2);
    assert_eq!(kept.counter("corral_cache_coalesced_total{prefix=corral:}"), 3);
    assert_eq!(kept.counter("corral_cache_sets_total{prefix=corral:}"), 1);
    assert_eq!(kept.counter("corral_cache_removes_total{prefix=corral:}"), 1);
    // The exported counters and the snapshot (what the CLI shows) agree, field by field.
    let fields = m.fields();
    assert_eq!(fields.len(), EXPORTED.len());
    for ((field, value), (expected_field, series)) in fields.into_iter().zip(EXPORTED) {
        assert_eq!(field, expected_field);
        assert_eq!(kept.counter(series), value, "{field} as {series}");
    }

    let durations = kept.samples(LOAD_DURATION);
    assert_eq!(durations.len(), 2, "one sample per load");
    assert!(durations.iter().all(|s| *s >= 0.0 && *s < 60.0), "{durations:?}");
    let units = kept.units.lock();
    assert_eq!(units["corral_cache_loads_total"], Some(Unit::Count));
    assert_eq!(units["corral_cache_invalidations_total"], Some(Unit::Count));
    assert_eq!(units["corral_cache_load_duration_seconds"], Some(Unit::Seconds));
    Ok(())
}

#[tokio::test]
async fn a_cache_built_without_a_recorder_counts_all_the_same() -> Result<()> {
    let cache = Corral::builder().build()?;
    cache
        .get_or_set("a", relative(), || async { Ok::<_, std::io::Error>("A") })
        .await?;
    assert_eq!(cache.get("a").await?.as_deref(), Some(&b"A"[..]));
    let m = cache.metrics();
    assert_eq!((m.loads, m.misses, m.l1_hits), (1, 1, 1));
    Ok(())
}

/// A span seen by [`Spans`]: its name, its fields (as recorded last) and the fields of the
/// events logged in it.
#[derive(Clone, Debug, Default)]
struct Seen {
    name: &'static str,
    fields: BTreeMap<String, String>,
    events: Vec<BTreeMap<String, String>>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// A layer that keeps every span once it closes.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Seen>>>);

impl<S> tracing_subscriber::Layer<S> for Spans
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut seen = Seen {
            name: attrs.metadata().name(),
            ..Seen::default()
        };
        attrs.record(&mut Fields(&mut seen.fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(seen);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(seen) = span.extensions_mut().get_mut::<Seen>()
        {
            values.record(&mut Fields(&mut seen.fields));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.event_span(event)
            && let Some(seen) = span.extensions_mut().get_mut::<Seen>()
        {
            let mut fields = BTreeMap::new();
            event.record(&mut Fields(&mut fields));
            seen.events.push(fields);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id)
            && let Some(seen) = span.extensions_mut().remove::<Seen>()
        {
            self.0.lock().push(seen);
        }
    }
}

impl Spans {
    fn flights(&self) -> Vec<Seen> {
        self.0
            .lock()
            .iter()
            .filter(|s| s.name == "corral.flight")
            .cloned()
            .collect()
    }
}

/// The flight span carries the key, the prefix, every action the guest decided, and the
/// outcome; an L1 hit flies no flight.
// One thread: the subscriber is this thread's default, and the flights run on it.
#[tokio::test(flavor = "current_thread")]
async fn each_flight_has_a_span_with_the_guests_decisions_and_its_outcome() -> Result<()> {
    let spans = Spans::default();
    let _default = tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    // While a single dispatcher exists, tracing-core settles a callsite first hit on
    // another thread (another test's flight) by that thread's default alone, for good
    // (never enabled): a second live dispatcher makes it ask every one, this test's too.
    let _second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let cache = Corral::builder().build()?;

    cache
        .get_or_set("a", relative(), || async { Ok::<_, std::io::Error>("A") })
        .await?;
    let flights = spans.flights();
    assert_eq!(flights.len(), 1, "{flights:?}");
    let flight = &flights[0];
    assert_eq!(flight.fields["key"], "a");
    assert_eq!(flight.fields["prefix"], "corral:");
    assert_eq!(flight.fields["outcome"], "loaded");
    let actions: Vec<&str> = flight
        .events
        .iter()
        .filter_map(|e| e.get("action").map(String::as_str))
        .collect();
    assert_eq!(actions.first(), Some(&"read_l2"), "{actions:?}");
    assert!(actions.contains(&"try_lock"), "{actions:?}");
    assert!(actions.contains(&"load"), "{actions:?}");
    assert!(actions.contains(&"write_l2"), "{actions:?}");
    assert_eq!(actions.last(), Some(&"finish"), "{actions:?}");
    let finish = flight
        .events
        .iter()
        .rfind(|e| e.get("action").map(String::as_str) == Some("finish"));
    let finish = finish.expect("a finish event");
    assert!(finish["outcome"].contains("Loaded"), "{finish:?}");
    // The write released the lock: the finish has nothing left to release.
    let write = flight
        .events
        .iter()
        .find(|e| e.get("action").map(String::as_str) == Some("write_l2"))
        .expect("a write event");
    assert_eq!(
        (write["fenced"].as_str(), write["release"].as_str()),
        ("true", "true")
    );
    assert_eq!(finish["release"], "false");

    // An L1 hit: no flight.
    cache
        .get_or_set("a", relative(), || async { Ok::<_, std::io::Error>("never") })
        .await?;
    assert_eq!(spans.flights().len(), 1);

    // A failing loader: its flight says so.
    let failed = cache
        .get_or_set("b", relative(), || async {
            Err::<&str, _>(std::io::Error::other("down"))
        })
        .await;
    assert!(failed.is_err());
    let flights = spans.flights();
    assert_eq!(flights.len(), 2, "{flights:?}");
    assert_eq!(flights[1].fields["key"], "b");
    assert_eq!(flights[1].fields["outcome"], "loader_failed");
    Ok(())
}
