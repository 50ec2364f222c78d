//! Builds the Corral guest component (`guest/component`) for `wasm32-wasip2` with a
//! nested cargo, the way wasmtime's test-programs artifacts do, and tells the crate
//! where the `.wasm` is through `CORRAL_GUEST_WASM`.
//!
//! The nested build uses its own target directory (`<target>/guest`), so it never
//! waits on the outer build's lock, and every profile of the outer build (dev, test,
//! release, bench) shares one guest build: the guest is rebuilt only when its sources,
//! the WIT or the lock file change.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-wasip2";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest_dir
        .parent()
        .expect("host/ sits in the workspace root")
        .to_path_buf();
    for watched in [
        "guest/core/src",
        "guest/core/Cargo.toml",
        "guest/component/src",
        "guest/component/Cargo.toml",
        "wit",
        "Cargo.lock",
        "Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    let target_dir = guest_target_dir(&root);
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args([
            "build",
            "--package",
            "corral-guest",
            "--target",
            TARGET,
            "--profile",
            "guest",
        ])
        .env("CARGO_TARGET_DIR", &target_dir)
        // The outer build's flags are for the host, not for wasm.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env("CARGO_ENCODED_RUSTFLAGS", "-Clink-arg=-zstack-size=65536")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    let status = cmd
        .status()
        .expect("could not run cargo to build the guest component");
    if !status.success() {
        panic!(
            "building the guest component for {TARGET} failed (see above).\n\
             If the target is missing, install it with: rustup target add {TARGET}"
        );
    }
    let wasm = target_dir.join(TARGET).join("guest").join("corral_guest.wasm");
    assert!(wasm.exists(), "the guest build produced no {}", wasm.display());
    println!("cargo:rustc-env=CORRAL_GUEST_WASM={}", wasm.display());
}

/// `<workspace target dir>/guest`: beside the outer build's profiles, shared by all.
fn guest_target_dir(root: &Path) -> PathBuf {
    let outer = match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => root.join("target"),
    };
    let outer = if outer.is_absolute() {
        outer
    } else {
        root.join(outer)
    };
    outer.join("guest")
}
