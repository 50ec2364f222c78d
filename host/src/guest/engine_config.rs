// The wasmtime settings of the engine that runs the guest, shared by the engine
// (`engine.rs`) and `build.rs`, which compiles the guest ahead of time with them: an
// artefact deserializes only into an engine configured alike (wasmtime checks it).
// Included as the body of a module that has `Config` in scope.

/// Applies the guest engine's settings: epoch interruption (a runaway guest traps at
/// its deadline instead of hanging a thread), and, explicitly, every setting whose
/// default follows a wasmtime cargo feature that another crate of the service may turn
/// on (features are unified across the build): the build script's wasmtime and the
/// service's must agree, or the compiled guest is refused. The component-model async
/// support (on with wasmtime's default features, or wasmtime-wasi's `p3`) is not used by
/// the guest.
pub(crate) fn configure(config: &mut Config) {
    config.epoch_interruption(true);
    config.concurrency_support(false);
}
