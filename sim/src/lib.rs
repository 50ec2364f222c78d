//! Deterministic simulation of Corral: several processes (each a real [`corral::Corral`]
//! with its own L1, flight registry, clock and connection) run the production driver
//! and the real guest over a simulated store and network, on virtual time, with faults
//! and workloads drawn from one seed. See `docs/simulator.md` and `sim/README.md`.

pub(crate) mod body;
pub(crate) mod keyspace;
pub(crate) mod locks;
pub(crate) mod lua;
pub mod report;
pub mod rng;
pub mod run;
pub mod scenario;
pub(crate) mod table;
pub(crate) mod tracked;
pub(crate) mod wire;
pub mod world;

pub use report::Totals;
pub use run::{Outcome, run_seed};
pub use scenario::{BROKEN, Broken, FaultRates, Scenario};

/// Keeps the simulated loaders' deliberate panics off stderr (other panics still print).
pub fn quiet_loader_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let sim = info
                .payload()
                .downcast_ref::<&str>()
                .is_some_and(|m| m.starts_with("sim: loader panic"));
            if !sim {
                previous(info);
            }
        }));
    });
}
