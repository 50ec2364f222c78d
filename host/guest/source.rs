// The guest component from source: where the shipped build lives, how to build it
// afresh, and the fingerprint of the sources it was built from. Shared by host/build.rs
// and host/tests/shipped_guest.rs (`#[path]`-included by both, so the one command and
// the one fingerprint are never written twice).

#![allow(dead_code)]

use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target the guest is built for.
pub const TARGET: &str = "wasm32-wasip2";

/// The shipped component, relative to `host/`.
pub const SHIPPED: &str = "guest/corral_guest.wasm";

/// The fingerprint of the sources the shipped component was built from, relative to
/// `host/`.
pub const STAMP: &str = "guest/corral_guest.sources";

/// What selects shipped or fresh: `source` or `shipped` (unset: see host/build.rs).
pub const ENV_BUILD: &str = "CORRAL_GUEST_BUILD";

/// The command that puts the shipped component right.
pub const REFRESH: &str = "scripts/refresh-guest";

/// Everything of the workspace the component is made from, relative to its root. The
/// lock file, the toolchain and the `guest` profile are not in the fingerprint (they
/// change with the host's dependencies); the byte comparison with a fresh build in the
/// test suite covers them.
pub const SOURCES: &[&str] = &[
    "guest/core/Cargo.toml",
    "guest/core/src",
    "guest/component/Cargo.toml",
    "guest/component/src",
    "wit",
];

/// The workspace root whose guest sources sit beside `host/`, if they do (a path or
/// git dependency on the repository, or the workspace itself; not a packaged crate).
pub fn workspace_root(manifest_dir: &Path) -> Option<PathBuf> {
    let root = manifest_dir.parent()?;
    let component = fs::read_to_string(root.join("guest/component/Cargo.toml")).ok()?;
    component
        .contains("name = \"corral-guest\"")
        .then(|| root.to_path_buf())
}

/// The fresh build's output under the workspace's target directory.
pub fn fresh_wasm(guest_target_dir: &Path) -> PathBuf {
    guest_target_dir
        .join(TARGET)
        .join("guest")
        .join("corral_guest.wasm")
}

/// `<target dir>/guest`: the guest's own target directory beside the outer build's
/// profiles (a nested cargo never waits on the outer build's lock).
pub fn guest_target_dir(root: &Path, cargo_target_dir: Option<OsString>) -> PathBuf {
    let outer = match cargo_target_dir {
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

/// Builds `guest/component` for `wasm32-wasip2` with `cargo` (the `guest` profile, a
/// 64 KiB stack) and returns the `.wasm`. The same command as `scripts/refresh-guest`
/// runs, through the test suite:
///
/// ```sh
/// CARGO_TARGET_DIR=target/guest CARGO_ENCODED_RUSTFLAGS="-Clink-arg=-zstack-size=65536" \
///   cargo build --locked -p corral-guest --target wasm32-wasip2 --profile guest
/// ```
pub fn build(root: &Path, guest_target_dir: &Path, cargo: &OsString) -> Result<PathBuf, String> {
    let status = Command::new(cargo)
        .current_dir(root)
        .args([
            "build",
            "--locked",
            "--package",
            "corral-guest",
            "--target",
            TARGET,
            "--profile",
            "guest",
        ])
        .env("CARGO_TARGET_DIR", guest_target_dir)
        // An outer build's flags are for the host, not for wasm.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env("CARGO_ENCODED_RUSTFLAGS", "-Clink-arg=-zstack-size=65536")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .status()
        .map_err(|e| format!("could not run cargo to build the guest component: {e}"))?;
    if !status.success() {
        return Err(format!(
            "building the guest component for {TARGET} failed (see above).\n\
             If the target is missing, install it with: rustup target add {TARGET}"
        ));
    }
    let wasm = fresh_wasm(guest_target_dir);
    if !wasm.exists() {
        return Err(format!("the guest build produced no {}", wasm.display()));
    }
    Ok(wasm)
}

/// Whether `rustc` has the standard library for `wasm32-wasip2`.
pub fn target_installed(rustc: &OsString) -> bool {
    Command::new(rustc)
        .args(["--print", "target-libdir", "--target", TARGET])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .is_some_and(|dir| dir.is_dir())
}

/// The fingerprint of [`SOURCES`] under `root`: FNV-1a (64 bits) over every file's
/// path (relative, `/`-separated, sorted) and contents (line endings as LF, so a
/// Windows checkout agrees), followed by the number of files. Change detection, not a
/// security measure.
pub fn fingerprint(root: &Path) -> io::Result<String> {
    let mut files = Vec::new();
    for source in SOURCES {
        collect(root, &root.join(source), &mut files)?;
    }
    files.sort();
    let mut hash = Fnv::new();
    for (name, path) in &files {
        hash.write(name.as_bytes());
        hash.write(&[0]);
        let contents = fs::read(path)?;
        let mut normalised = Vec::with_capacity(contents.len());
        for (i, &b) in contents.iter().enumerate() {
            if !(b == b'\r' && contents.get(i + 1) == Some(&b'\n')) {
                normalised.push(b);
            }
        }
        hash.write(&(normalised.len() as u64).to_le_bytes());
        hash.write(&normalised);
    }
    Ok(format!("fnv1a64:{:016x} files:{}", hash.0, files.len()))
}

/// The fingerprint the shipped component was built from, as recorded beside it.
pub fn recorded_fingerprint(manifest_dir: &Path) -> Option<String> {
    let text = fs::read_to_string(manifest_dir.join(STAMP)).ok()?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
}

/// The stamp file's text for `fingerprint`.
pub fn stamp_text(fingerprint: &str) -> String {
    format!(
        "# The fingerprint of the guest sources (host/guest/source.rs: SOURCES) that\n\
         # corral_guest.wasm was built from. Written by {REFRESH}; never by hand.\n\
         {fingerprint}\n"
    )
}

fn collect(root: &Path, path: &Path, out: &mut Vec<(String, PathBuf)>) -> io::Result<()> {
    if path.is_dir() {
        for entry in fs::read_dir(path)? {
            collect(root, &entry?.path(), out)?;
        }
    } else if path.is_file() {
        let relative = path.strip_prefix(root).unwrap_or(path);
        let name = relative
            .components()
            .map(|c| c.as_os_str().to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        out.push((name, path.to_path_buf()));
    }
    Ok(())
}

/// FNV-1a, 64 bits.
pub struct Fnv(pub u64);

impl Fnv {
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The FNV-1a hash of `bytes`, as 16 hex digits.
pub fn fnv_hex(bytes: &[u8]) -> String {
    let mut h = Fnv::new();
    h.write(bytes);
    format!("{:016x}", h.0)
}
