//! The shipped guest (`host/guest/corral_guest.wasm`) is what its sources build: a fresh
//! build from `guest/` and `wit/` must produce the very same bytes, and the fingerprint
//! recorded beside it must be the sources' own. Either failing means: run
//! `scripts/refresh-guest` and commit `host/guest/`.
//!
//! With `CORRAL_GUEST_REFRESH=1` (what `scripts/refresh-guest` sets) these tests write
//! the shipped component and its fingerprint instead of checking them.
//!
//! These tests build the guest from source, so they need the `wasm32-wasip2` target
//! (`./scripts/test` installs it). A workspace guest build is a no-op when it is fresh.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

#[path = "../guest/source.rs"]
mod source;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn root() -> PathBuf {
    source::workspace_root(&manifest_dir()).expect("the workspace's guest sources")
}

fn refreshing() -> bool {
    env::var_os("CORRAL_GUEST_REFRESH").is_some_and(|v| v == "1")
}

/// Builds the guest from source with the one command `build.rs` uses.
fn fresh_build() -> PathBuf {
    let root = root();
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    assert!(
        source::target_installed(&rustc),
        "checking the shipped guest against its sources builds them for {target}: \
         install it with `rustup target add {target}`",
        target = source::TARGET
    );
    let target_dir = source::guest_target_dir(&root, env::var_os("CARGO_TARGET_DIR"));
    let cargo = env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    source::build(&root, &target_dir, &cargo).unwrap_or_else(|e| panic!("{e}"))
}

fn describe(bytes: &[u8]) -> String {
    format!("{} bytes, fnv1a64 {}", bytes.len(), source::fnv_hex(bytes))
}

#[test]
fn shipped_guest_equals_a_fresh_build() {
    let fresh_path = fresh_build();
    let fresh = fs::read(&fresh_path).expect("reading the fresh build");
    let shipped_path = manifest_dir().join(source::SHIPPED);
    if refreshing() {
        fs::write(&shipped_path, &fresh).expect("writing the shipped guest");
        eprintln!("refreshed {} ({})", shipped_path.display(), describe(&fresh));
        return;
    }
    let shipped = fs::read(&shipped_path).unwrap_or_default();
    if shipped != fresh {
        let first = shipped.iter().zip(&fresh).position(|(a, b)| a != b);
        panic!(
            "\n\nThe shipped guest component is stale: it differs from a fresh build of guest/ \
             and wit/.\n  shipped: {} ({})\n  fresh:   {} ({})\n  first difference at byte \
             {}\nA service depending on Corral gets the shipped one. Fix: run `{}` and commit \
             host/guest/.\n\n",
            shipped_path.display(),
            describe(&shipped),
            fresh_path.display(),
            describe(&fresh),
            first.map_or_else(|| "(one is a prefix of the other)".into(), |i| i.to_string()),
            source::REFRESH,
        );
    }
}

#[test]
fn shipped_guest_records_the_fingerprint_of_its_sources() {
    let current = source::fingerprint(&root()).expect("reading the guest sources");
    let stamp = manifest_dir().join(source::STAMP);
    if refreshing() {
        fs::write(&stamp, source::stamp_text(&current)).expect("writing the fingerprint");
        eprintln!("refreshed {} ({current})", stamp.display());
        return;
    }
    let recorded = source::recorded_fingerprint(&manifest_dir());
    assert_eq!(
        recorded.as_deref(),
        Some(current.as_str()),
        "\n\nThe guest sources changed since the shipped component was built (so every build \
         here compiles the guest from source, and dependents get a stale one). Fix: run `{}` \
         and commit host/guest/.\n\n",
        source::REFRESH
    );
}

/// What the crate embedded is the shipped file, or, when the build chose the sources, a
/// build equal to it (checked above); and the compiled artefact is of those bytes.
#[test]
fn the_embedded_guest_is_the_shipped_one() {
    let shipped = fs::read(manifest_dir().join(source::SHIPPED)).expect("the shipped guest");
    let origin = env!("CORRAL_GUEST_ORIGIN");
    if origin == "shipped" {
        assert_eq!(
            Path::new(corral::guest::GUEST_WASM_PATH),
            manifest_dir().join(source::SHIPPED)
        );
    }
    if !refreshing() {
        assert!(
            corral::guest::GUEST_WASM == shipped.as_slice(),
            "the embedded guest ({origin}, {}) differs from the shipped one ({}): run `{}`",
            describe(corral::guest::GUEST_WASM),
            describe(&shipped),
            source::REFRESH
        );
    }
    assert_eq!(
        env!("CORRAL_GUEST_WASM_FNV"),
        source::fnv_hex(corral::guest::GUEST_WASM)
    );
}
