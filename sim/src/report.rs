//! Totals over many runs, and the table the binary ends with.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::run::Outcome;

/// What many runs found, added up.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub seeds: u64,
    pub ops: u64,
    pub longest_ms: BTreeMap<&'static str, u64>,
    pub locked_loads: u64,
    pub degraded_loads: u64,
    pub metrics_degraded: u64,
    /// Loads that began while a fresh copy of their key stood (eager refreshes).
    pub refreshes: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub excused: BTreeMap<&'static str, u64>,
    pub violations: u64,
    /// The failing runs (seed, scenario, first violation).
    pub failing: Vec<(u64, &'static str, String)>,
    /// Seeds whose second run traced otherwise than the first.
    pub nondeterministic: Vec<u64>,
}

impl Totals {
    /// Adds one run.
    pub fn add(&mut self, o: &Outcome) {
        self.seeds += 1;
        self.ops += o.ops;
        for (k, ms) in &o.longest_ms {
            let l = self.longest_ms.entry(k).or_default();
            *l = (*l).max(*ms);
        }
        self.locked_loads += o.locked_loads;
        self.degraded_loads += o.degraded_loads;
        self.metrics_degraded += o.metrics_degraded;
        self.refreshes += o.refreshes;
        for (k, n) in &o.faults {
            *self.faults.entry(k).or_default() += n;
        }
        for (k, n) in &o.excused {
            *self.excused.entry(k).or_default() += n;
        }
        self.violations += o.violations.len() as u64;
        if let Some(first) = o.violations.first() {
            self.failing.push((o.seed, o.scenario, first.clone()));
        }
    }

    /// The summary table.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, u64)> = vec![
            ("seeds".into(), self.seeds),
            ("operations".into(), self.ops),
            ("loads under the flight lock".into(), self.locked_loads),
            ("degraded loads (no lock)".into(), self.degraded_loads),
            ("  metrics().degraded, summed".into(), self.metrics_degraded),
            ("loads of a fresh copy (eager refreshes)".into(), self.refreshes),
        ];
        for (k, ms) in &self.longest_ms {
            rows.push((format!("longest {k}, virtual ms"), *ms));
        }
        let injected: u64 = self.faults.values().sum();
        rows.push(("faults injected".into(), injected));
        for (k, n) in &self.faults {
            rows.push((format!("  {k}"), *n));
        }
        let excused: u64 = self.excused.values().sum();
        rows.push(("anomalies a fault explains".into(), excused));
        for (k, n) in &self.excused {
            rows.push((format!("  {k}"), *n));
        }
        rows.push(("invariant violations".into(), self.violations));
        rows.push(("failing seeds".into(), self.failing.len() as u64));
        rows.push((
            "nondeterministic seeds".into(),
            self.nondeterministic.len() as u64,
        ));
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (k, n) in rows {
            let _ = writeln!(out, "{k:<width$}  {n:>10}");
        }
        out
    }
}
