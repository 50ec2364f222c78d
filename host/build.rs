//! Picks the guest component and compiles it ahead of time for the target.
//!
//! **Which component.** The crate ships it built (`host/guest/corral_guest.wasm`), so a
//! dependent needs neither the `wasm32-wasip2` target nor a nested cargo. The rule:
//!
//! - `CORRAL_GUEST_BUILD=source`: build `guest/component` from source with a nested
//!   cargo (the target must be installed).
//! - `CORRAL_GUEST_BUILD=shipped`: the shipped file, whatever the sources say.
//! - unset: the shipped file when the guest sources beside this crate are the ones it
//!   was built from (their fingerprint equals `host/guest/corral_guest.sources`), or
//!   when there are none (a packaged crate). When they differ (someone edited
//!   `guest/` or `wit/`): build from source if `wasm32-wasip2` is installed, else warn
//!   and use the shipped file.
//!
//! `scripts/refresh-guest` rebuilds the shipped file and its fingerprint; the test
//! suite (`host/tests/shipped_guest.rs`) builds the guest from source and fails, with
//! that command, when the shipped bytes differ from a fresh build.
//!
//! **Compiled here, not at run time.** The build script compiles the chosen component
//! with Cranelift for the target (`Engine::precompile_component`, the configuration of
//! `src/guest/engine_config.rs`, baseline CPU features) into `OUT_DIR`; the crate
//! embeds both and deserializes the compiled one, so the crate itself carries no
//! compiler and no compilation cache, and writes nothing at run time.
//!
//! The crate reads `CORRAL_GUEST_WASM` (the component's path), `CORRAL_GUEST_CWASM`
//! (the compiled artefact's), `CORRAL_GUEST_WASM_FNV` (the hash of the component that
//! was compiled, checked before deserializing) and `CORRAL_GUEST_ORIGIN`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

#[path = "guest/source.rs"]
mod source;

mod engine_config {
    use wasmtime::Config;
    include!("src/guest/engine_config.rs");
}

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=guest");
    println!("cargo:rerun-if-changed=src/guest/engine_config.rs");
    println!("cargo:rerun-if-env-changed={}", source::ENV_BUILD);
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    let (wasm_path, origin) = choose(&manifest_dir);
    let wasm = fs::read(&wasm_path)
        .unwrap_or_else(|e| panic!("reading the guest component {}: {e}", wasm_path.display()));

    let cwasm = precompile(&wasm);
    let cwasm_path = out_dir.join("corral_guest.cwasm");
    fs::write(&cwasm_path, cwasm).expect("writing the compiled guest to OUT_DIR");

    println!("cargo:rustc-env=CORRAL_GUEST_WASM={}", wasm_path.display());
    println!("cargo:rustc-env=CORRAL_GUEST_CWASM={}", cwasm_path.display());
    println!("cargo:rustc-env=CORRAL_GUEST_WASM_FNV={}", source::fnv_hex(&wasm));
    println!("cargo:rustc-env=CORRAL_GUEST_ORIGIN={origin}");
}

/// The component to embed, and where it came from (`shipped` or `source`).
fn choose(manifest_dir: &Path) -> (PathBuf, &'static str) {
    let shipped = manifest_dir.join(source::SHIPPED);
    let asked = env::var(source::ENV_BUILD).unwrap_or_default();
    let root = source::workspace_root(manifest_dir);
    if let Some(root) = &root {
        for watched in source::SOURCES {
            println!("cargo:rerun-if-changed={}", root.join(watched).display());
        }
    }
    match asked.as_str() {
        "shipped" => return (shipped, "shipped"),
        "source" => {
            let root = root.unwrap_or_else(|| {
                panic!(
                    "{}=source, but the guest sources are not beside this crate (a packaged \
                     crate ships only the built component)",
                    source::ENV_BUILD
                )
            });
            return (from_source(&root), "source");
        }
        "" => {}
        other => panic!(
            "{}={other}: expected `source` or `shipped` (or unset)",
            source::ENV_BUILD
        ),
    }
    let Some(root) = root else {
        return (shipped, "shipped");
    };
    let current = source::fingerprint(&root).expect("reading the guest sources");
    if source::recorded_fingerprint(manifest_dir).as_deref() == Some(current.as_str()) {
        return (shipped, "shipped");
    }
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    if source::target_installed(&rustc) {
        (from_source(&root), "source")
    } else {
        println!(
            "cargo:warning=the guest sources differ from those of the shipped component \
             ({}); using it all the same: install {} (rustup target add {}) to build the \
             guest from source, then run {}",
            source::SHIPPED,
            source::TARGET,
            source::TARGET,
            source::REFRESH
        );
        (shipped, "shipped")
    }
}

fn from_source(root: &Path) -> PathBuf {
    // What else the fresh build depends on: dependency versions and the guest profile.
    for watched in ["Cargo.lock", "Cargo.toml", "rust-toolchain.toml"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let target_dir = source::guest_target_dir(root, env::var_os("CARGO_TARGET_DIR"));
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    source::build(root, &target_dir, &cargo).unwrap_or_else(|e| panic!("{e}"))
}

/// The component compiled for the crate's target, with the run-time engine's settings.
fn precompile(wasm: &[u8]) -> Vec<u8> {
    let target = env::var("TARGET").expect("set by cargo");
    let mut config = wasmtime::Config::new();
    engine_config::configure(&mut config);
    // An explicit target also means no CPU features inferred from this machine: the
    // code runs on any CPU of the target's architecture (the binary may be deployed
    // elsewhere than it was built).
    config
        .target(&target)
        .unwrap_or_else(|e| panic!("wasmtime cannot compile for the target {target}: {e}"));
    let engine = wasmtime::Engine::new(&config).unwrap_or_else(|e| {
        let host = env::var("HOST").unwrap_or_default();
        panic!(
            "wasmtime cannot compile the guest for {target} on {host}: {e:#}\n\
             Cross-compiling to another CPU architecture needs corral's `cross-arch` \
             feature (Cranelift for every architecture in this build script)."
        )
    });
    let cwasm = engine
        .precompile_component(wasm)
        .unwrap_or_else(|e| panic!("compiling the guest component for {target}: {e:#}"));
    assert!(
        matches!(
            wasmtime::Engine::detect_precompiled(&cwasm),
            Some(wasmtime::Precompiled::Component)
        ),
        "wasmtime's output is not a precompiled component"
    );
    cwasm
}
