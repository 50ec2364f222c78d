//! The cache commands: what they print and how they exit (sysexits), `script`'s lines,
//! and a stdout closed by its reader.

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use crate::support::{Running, closed_port, corral, redis_server, run, run_command, text};

#[test]
fn demo_runs_on_the_embedded_default() {
    let out = run(&["demo"], None);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("hit: s3cr3t"), "{stdout}");
    assert!(stdout.contains("`key` must not be only white space"), "{stdout}");
}

#[test]
fn script_runs_commands_on_one_embedded_cache() {
    let out = run(
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
fn a_bad_key_names_the_argument_and_exits_64() {
    let out = run(&["get", "  "], None);
    assert_eq!(out.status.code(), Some(64));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("invalid argument: `key` must not be only white space"),
        "{stderr}"
    );
    assert!(stderr.contains("hint:"), "{stderr}");
}

#[test]
fn an_unreachable_redis_names_the_cause_says_what_to_do_and_exits_69() {
    let url = format!("redis://127.0.0.1:{}", closed_port());
    let out = run(&["--redis", &url, "get", "k"], None);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot use Redis at {url}: connection refused")),
        "{stderr}"
    );
    assert!(stderr.contains("hint: nothing listens at"), "{stderr}");
    assert!(stderr.contains("redis-server"), "{stderr}");
}

/// A `remove` Redis did not answer fails (69), and `corral` retries the removal until
/// Redis answers, within its bound, before it exits: the old value does not outlive it.
#[test]
fn a_removal_redis_did_not_answer_is_retried_before_corral_exits() {
    let server = redis_server();
    let proxy = corral_tests::FaultProxy::start(server.addr()).expect("the fault proxy starts");
    let stored = run(&["--redis", &server.url(), "set", "k", "old"], None);
    assert!(stored.status.success(), "{}", text(&stored.stderr));
    proxy.refuse(true);
    let mut removing = Running::spawn(&["--redis", &proxy.url(), "remove", "k"]);
    removing.wait_for_stderr("cannot use Redis");
    proxy.heal();
    let out = removing.finish();
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
    let read = run(&["--redis", &server.url(), "get", "k"], None);
    assert_eq!(text(&read.stdout), "", "the old value outlived corral");
    assert!(
        text(&read.stderr).contains("(no entry)"),
        "{}",
        text(&read.stderr)
    );
}

/// `get` writes a value's bytes exactly as stored (a value is a byte string: no
/// replacement characters, no newline added for a pipe), and says a miss on stderr, so
/// a stored `(no entry)` and a miss differ.
#[test]
fn get_writes_the_values_bytes_exactly_and_a_miss_on_stderr() {
    let server = redis_server();
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        let cache = corral::Corral::builder()
            .redis(server.url())
            .build()
            .expect("a cache");
        for (key, value) in [
            ("binary", &b"\xff\x00\xfe"[..]),
            ("line", b"a\n"),
            ("words", b"(no entry)"),
        ] {
            cache
                .set(key, value.to_vec(), corral::EntryOptions::new())
                .await
                .expect("stored");
        }
    });
    for (key, value) in [
        ("binary", &b"\xff\x00\xfe"[..]),
        ("line", b"a\n"),
        ("words", b"(no entry)"),
    ] {
        let out = run(&["--redis", &server.url(), "get", key], None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(out.stdout, value, "{key}");
    }
    let out = run(&["--redis", &server.url(), "get", "missing"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("(no entry)"), "{}", text(&out.stderr));
}

/// An argument that is not UTF-8 is a usage error naming its place (never its bytes,
/// which may be a URL's password).
#[test]
fn an_argument_that_is_not_utf8_is_named_by_its_place() {
    use std::os::unix::ffi::OsStrExt;
    let mut command = corral(&["get"]);
    command.arg(std::ffi::OsStr::from_bytes(b"k\xff"));
    let out = run_command(command, None);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("argument 2 is not UTF-8"), "{stderr}");
}

/// A script's line is split into words as a shell splits them: a key or value with
/// white space in it is quoted, and an unclosed quote is the line's usage error.
#[test]
fn a_script_line_takes_quoted_keys_and_values() {
    let out = run(
        &["script"],
        Some("set 'a key' \"two words\"\nget 'a key'\nget a\nget \"open\nset k\n"),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert_eq!(stdout, "stored a key\ntwo words\n(no entry)\n", "{stderr}");
    assert!(
        stderr.contains("line 4: error: the line has a quote that is not closed"),
        "{stderr}"
    );
    assert!(
        stderr.contains("were not provided: <VALUE>"),
        "the missing argument is named: {stderr}"
    );
}

/// `stampede`'s counts are bounded up front (a huge one is a usage error, not an
/// allocation that aborts), and a run whose callers failed exits with the status of
/// the first failure, naming its cause.
#[test]
fn stampede_bounds_its_counts_and_a_failed_run_says_why() {
    for args in [
        &["--keys", "18446744073709551615", "--batch", "2"][..],
        &["--keys", "4294967296", "--batch", "2"],
        &["--keys", "10", "--batch", "11"],
        &["--callers", "0"],
        &["--callers", "18446744073709551615"],
        &["--loader-ms", "18446744073709551615"],
        &["--callers", "100000", "--keys", "1000000", "--batch", "10000"],
    ] {
        let out = run(&[&["stampede", "--loader-ms", "1"][..], args].concat(), None);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let out = run(
        &["stampede", "--callers", "3", "--loader-ms", "1", "--key", ""],
        None,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("`key` must not be empty"), "{stderr}");
    let out = run(
        &[
            "stampede",
            "--callers",
            "5",
            "--loader-ms",
            "1",
            "--keys",
            "1000000",
            "--batch",
            "10",
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(report["errors"], 0, "{report}");
    assert_eq!(report["key_loads"], 50, "{report}");
}

/// `set k far` over a link adding `each_way` of latency: refused (69, Redis named as
/// the cause) with the flags `short`, stored and read back with the flags `long`.
fn over_a_slow_link(each_way: u64, short: &[&str], long: &[&str]) {
    let server = redis_server();
    let proxy = corral_tests::FaultProxy::start(server.addr()).expect("the fault proxy starts");
    proxy.set_latency(std::time::Duration::from_millis(each_way));
    let url = proxy.url();
    let on_proxy =
        |flags: &[&str], command: &[&str]| run(&[flags, &["--redis", url.as_str()], command].concat(), None);
    let refused = on_proxy(short, &["set", "k", "far"]);
    let stderr = text(&refused.stderr);
    assert_eq!(refused.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("cannot use Redis"), "{stderr}");

    let stored = on_proxy(long, &["set", "k", "far"]);
    assert!(stored.status.success(), "{}", text(&stored.stderr));
    let read = on_proxy(long, &["get", "k"]);
    assert!(read.status.success(), "{}", text(&read.stderr));
    assert_eq!(text(&read.stdout).trim(), "far");
}

const LONG_TIMEOUTS: [&str; 4] = ["--connect-timeout", "5s", "--response-timeout", "5s"];

/// A link whose round trip (700 ms here) is longer than the default connect timeout
/// (500 ms, which covers the handshake's round trip): `corral` cannot connect, and says
/// so (69), until `--connect-timeout` gives the handshake the time it needs.
#[test]
fn a_slow_link_needs_connect_timeout_and_works_with_it() {
    over_a_slow_link(350, &[], &LONG_TIMEOUTS);
}

/// A round trip (1.2 s) longer than the default response timeout (1 s) as well: a
/// longer connect timeout alone is not enough, `--response-timeout` gives each command
/// the time it needs.
#[test]
fn a_link_slower_than_a_second_needs_response_timeout_too() {
    over_a_slow_link(600, &["--connect-timeout", "5s"], &LONG_TIMEOUTS);
}

/// A timeout of nothing, or of more than ten minutes, is refused as a usage error (2,
/// as every other one), naming the flag, before anything connects.
#[test]
fn a_timeout_of_zero_or_past_ten_minutes_is_refused_naming_the_flag() {
    for (flag, value, why) in [
        ("--connect-timeout", "0s", "must be more than zero"),
        ("--response-timeout", "11m", "must be at most 10m"),
        ("--connect-timeout", "soon", "soon"),
    ] {
        let out = run(&[flag, value, "get", "k"], None);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{flag} {value}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains(why),
            "{flag} {value}: {stderr}"
        );
    }
}

#[test]
fn script_goes_on_after_a_failed_line_and_exits_with_the_worst_status() {
    let out = run(
        &["script"],
        Some("set k v\nfrobnicate k\nget k\nget k --absent-flag\n"),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(64), "{stdout}\n{stderr}");
    assert_eq!(stdout, "stored k\nv\n");
    assert!(
        stderr.contains("line 2: error: unrecognized subcommand 'frobnicate'"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 4: error: unexpected argument '--absent-flag'"),
        "{stderr}"
    );
    assert!(stderr.contains("error: 2 of 4 script lines failed"), "{stderr}");
}

#[test]
fn script_on_an_unreachable_redis_exits_69() {
    let url = format!("redis://127.0.0.1:{}", closed_port());
    let out = run(&["--redis", &url, "script"], Some("get k\n"));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("line 1: error: cannot use Redis at"), "{stderr}");
    assert!(stderr.contains("connection refused"), "{stderr}");
}

#[test]
fn script_refuses_redis_and_prefix_on_a_line_instead_of_ignoring_them() {
    let input = "set k v\nget k --redis redis://127.0.0.1:1\nget k --prefix other:\nget k\n";
    let out = run(&["script"], Some(input));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(64), "{stdout}\n{stderr}");
    assert_eq!(stdout, "stored k\nv\n", "the refused lines printed nothing");
    assert!(
        stderr.contains("line 2: error: --redis cannot be given on a script line"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 3: error: --prefix cannot be given on a script line"),
        "{stderr}"
    );
    assert!(
        stderr.contains("pass --prefix to `corral script` itself"),
        "{stderr}"
    );
}

#[test]
fn script_refuses_commands_that_do_not_work_on_a_line() {
    let out = run(&["script"], Some("demo\nlock --key k -- true\n"));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("line 1: error: only set, get, refresh, remove and inspect"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 2: error: only set, get, refresh, remove and inspect"),
        "{stderr}"
    );
}

#[test]
fn a_stdout_closed_from_the_start_ends_demo_quietly() {
    // `corral demo | head -0`: the reader is gone before the first line is written.
    let mut child = corral(&["demo"]).spawn().unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(141),
        "128 + SIGPIPE, as a shell tool says it: {stderr}"
    );
    assert_eq!(stderr, "", "quietly: no panic, no message");
}

#[test]
fn a_stdout_closed_after_the_first_line_ends_script_quietly() {
    // `corral script | head -1`, with the second line written only once the reader left.
    let mut command = corral(&["script"]);
    command.stdin(Stdio::piped());
    let mut child = command.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(b"set k v\n").unwrap();
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert_eq!(first, "stored k\n");
    drop(stdout);
    stdin.write_all(b"get k\nget k\n").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert_eq!(stderr, "", "quietly: no panic, no message");
}

#[test]
fn demo_piped_into_head_prints_its_first_line_and_no_panic() {
    let mut command = std::process::Command::new("sh");
    command
        .args(["-c", r#""$0" demo | head -1"#, env!("CARGO_BIN_EXE_corral")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = run_command(command, None);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stdout,
        "Corral demo, part 1: a stampede on the embedded default (in-memory L2).\n"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr, "", "{stderr}");
}
