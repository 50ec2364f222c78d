// The wasmtime settings of the engine that runs the guest, shared by the engine
// (`engine.rs`) and `build.rs`, which compiles the guest ahead of time with them: an
// artefact deserializes only into an engine configured alike (wasmtime checks it).
// Included as the body of a module that has `Config` in scope.

/// Applies the guest engine's settings: epoch interruption (a runaway guest traps at
/// its deadline instead of hanging a thread); everything else is wasmtime's default.
pub(crate) fn configure(config: &mut Config) {
    config.epoch_interruption(true);
}
