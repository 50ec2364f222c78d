//! `Corral::build()` needs no home directory and writes no file: the guest was compiled
//! when the crate was built (there is no wasmtime compilation cache to keep). Each test
//! runs a fresh process (this binary again, only `child_builds_a_cache`) with `HOME` and
//! the XDG directories unset or pointed at an empty read-only directory, so the guest
//! is loaded for the first time there, and checks the directory is still empty after.

use std::env;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const CHILD: &str = "CORRAL_NO_FILES_CHILD";

/// Runs in the child process only: the first load of the guest in a process.
#[test]
fn child_builds_a_cache() {
    if env::var_os(CHILD).is_none() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let cache = corral::Corral::builder().build().expect("Corral::build()");
        cache
            .set("k", b"v".to_vec(), corral::EntryOptions::new())
            .await
            .expect("set");
        assert_eq!(cache.get("k").await.expect("get").as_deref(), Some(&b"v"[..]));
    });
    println!("child: built a cache and used it");
}

fn run_child(home: Option<&Path>) {
    let exe = env::current_exe().expect("this test binary");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        "child_builds_a_cache",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD, "1")
    .env_remove("HOME")
    .env_remove("XDG_CACHE_HOME")
    .env_remove("XDG_CONFIG_HOME")
    .env_remove("XDG_DATA_HOME");
    if let Some(home) = home {
        cmd.env("HOME", home)
            .env("XDG_CACHE_HOME", home.join(".cache"))
            .env("XDG_CONFIG_HOME", home.join(".config"));
    }
    let out = cmd.output().expect("running the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child: built a cache and used it"),
        "the child failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn scratch(name: &str) -> PathBuf {
    let dir = env::temp_dir().join(format!("corral-no-files-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

#[test]
fn build_works_with_home_unset() {
    run_child(None);
}

#[test]
fn build_works_with_a_read_only_home_and_writes_nothing_there() {
    let home = scratch("ro");
    fs::set_permissions(&home, fs::Permissions::from_mode(0o555)).expect("chmod");
    run_child(Some(&home));
    // Root may write in a read-only directory all the same: the real check is that
    // nothing was written, whoever runs the test.
    let left: Vec<_> = fs::read_dir(&home)
        .expect("the home")
        .map(|e| e.expect("an entry").path())
        .collect();
    fs::set_permissions(&home, fs::Permissions::from_mode(0o755)).expect("chmod");
    let _ = fs::remove_dir_all(&home);
    assert!(left.is_empty(), "Corral wrote into HOME: {left:?}");
}
