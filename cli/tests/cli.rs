//! The `corral` binary as a person uses it: what it prints and how it exits.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn corral(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(args)
        .env_remove("CORRAL_REDIS")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("corral runs");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn demo_runs_on_the_embedded_default() {
    let out = corral(&["demo"], None);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("hit: s3cr3t"), "{stdout}");
    assert!(stdout.contains("`key` must not be only white space"), "{stdout}");
}

#[test]
fn script_runs_commands_on_one_embedded_cache() {
    let out = corral(
        &["script"],
        Some("set k hello --sliding 5m\nget k\ninspect k\nremove k\nget k\n"),
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "stored k");
    assert_eq!(lines[1], "hello");
    assert!(
        stdout.contains("sliding expiration") && stdout.contains("5m"),
        "{stdout}"
    );
    assert!(stdout.contains("removed\n(no entry)"), "{stdout}");
}

#[test]
fn a_bad_key_names_the_argument_and_exits_2() {
    let out = corral(&["get", "  "], None);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("invalid argument: `key` must not be only white space"),
        "{stderr}"
    );
    assert!(stderr.contains("hint:"), "{stderr}");
}

#[test]
fn an_unreachable_redis_says_what_to_do_and_exits_3() {
    // Port 1 on loopback: nothing listens there.
    let out = corral(&["--redis", "redis://127.0.0.1:1", "get", "k"], None);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("store unavailable"), "{stderr}");
    assert!(stderr.contains("redis-server"), "{stderr}");
}
