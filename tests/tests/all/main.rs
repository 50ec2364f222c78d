//! Corral's integration tests: one binary of modules (as wasmtime's crates/wasi/tests/all).

mod backends;
mod batch;
mod cluster;
mod contract;
mod edges;
mod freshness;
mod gathering;
mod locks;
mod portable;
mod proxy;
mod ready;
mod single_flight;
mod sliding;
mod subscription;
mod tags;
mod telemetry;
mod vectors;
