//! `corral lock` as a distributed flock(1), against real redis-server processes: the
//! command's process group, signals passed on to it, the lock released on every way
//! out, and exit statuses that say what happened.
//!
//! Each command writes its pid (`$$`, its process group's id) to a marker file once it
//! runs; the tests wait for that file, never for a guessed delay.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, getpgid};

use crate::support::{
    Running, TempDir, closed_port, command_group, eventually, group_gone, pid_in, redis_cmd, redis_server,
    run, text,
};

/// A command that starts a grandchild in its own process group, writes its pid to
/// `$1` and waits: `sh -c '...' sh MARKER`.
const WITH_GRANDCHILD: &str = r#"sleep 1000 & echo $$ > "$1"; wait"#;

/// `corral lock --key KEY --redis URL [extra...] -- sh -c SCRIPT sh MARKER`, in the
/// background.
fn lock_in_background(
    url: &str,
    key: &str,
    extra: &[&str],
    script: &str,
    marker: &std::path::Path,
) -> Running {
    let marker = marker.to_str().unwrap();
    let mut args = vec!["lock", "--key", key, "--redis", url];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script, "sh", marker]);
    Running::spawn(&args)
}

/// `corral lock --key job --redis URL [extra...] -- true`, run to its end.
fn lock_job(url: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["lock", "--key", "job", "--redis", url];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "true"]);
    run(&args, None)
}

/// Asserts that a second `corral lock` on `key` gets the lock at its first try.
fn assert_lock_free(url: &str, key: &str) {
    let out = run(
        &["lock", "--key", key, "--wait", "0s", "--redis", url, "--", "true"],
        None,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "the lock was left behind: {}",
        text(&out.stderr)
    );
}

/// Sends `signal` to `corral lock` running a command with a grandchild; asserts the
/// whole group is gone, `corral` exited `code`, and the lock is free.
fn assert_signal_passed_on(signal: Signal, code: i32) {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    let corral = lock_in_background(&server.url(), "job", &["--grace", "1s"], WITH_GRANDCHILD, &marker);
    let pgid = command_group(&marker);
    assert_ne!(
        getpgid(Some(corral.pid())),
        Ok(pgid),
        "corral is not in the command's group"
    );

    corral.signal(signal);
    let out = corral.finish();

    assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
    assert!(
        group_gone(pgid),
        "a process of the command's group survived {signal}"
    );
    assert_lock_free(&server.url(), "job");
}

#[test]
fn sigterm_stops_the_command_group_releases_the_lock_and_exits_143() {
    assert_signal_passed_on(Signal::SIGTERM, 143);
}

#[test]
fn sigint_is_passed_on_to_the_command_group_and_exits_130() {
    // A POSIX shell's background job ignores SIGINT: its sleep only goes by SIGKILL,
    // after the grace period.
    assert_signal_passed_on(Signal::SIGINT, 130);
}

#[test]
fn sighup_is_passed_on_to_the_command_group_and_exits_129() {
    assert_signal_passed_on(Signal::SIGHUP, 129);
}

/// A stopped command (SIGSTOP, a job control stop) gets SIGCONT with the signal passed
/// on, so that it can act on it (here, its trap) rather than be SIGKILLed stopped
/// after the grace period.
#[test]
fn a_stopped_command_is_continued_to_hear_the_signal_passed_on() {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    let heard = dir.path("heard");
    let script = format!(
        r#"trap 'echo TERM > "{}"; exit 0' TERM; echo $$ > "$1"; kill -STOP $$; sleep 1000"#,
        heard.display()
    );
    let corral = lock_in_background(&server.url(), "job", &["--grace", "30s"], &script, &marker);
    let leader = pid_in(&marker);
    eventually("the command stops itself", || {
        let status = std::fs::read_to_string(format!("/proc/{leader}/stat")).ok()?;
        let state = status.rsplit_once(')')?.1.split_whitespace().next()?.to_owned();
        (state == "T").then_some(())
    });

    corral.signal(Signal::SIGTERM);
    let out = corral.finish();

    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(!stderr.contains("sending SIGKILL"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(&heard).unwrap_or_default().trim(),
        "TERM",
        "the stopped command's trap never ran"
    );
    assert_lock_free(&server.url(), "job");
}

#[test]
fn a_group_that_ignores_the_signal_is_killed_after_the_grace_period() {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    let stubborn = format!(r#"trap "" TERM; {WITH_GRANDCHILD}"#);
    let corral = lock_in_background(&server.url(), "job", &["--grace", "1s"], &stubborn, &marker);
    let pgid = command_group(&marker);

    let sent = Instant::now();
    corral.signal(Signal::SIGTERM);
    let out = corral.finish();

    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(
        sent.elapsed() >= Duration::from_secs(1),
        "SIGKILL came before the grace period ended"
    );
    assert!(stderr.contains("sending SIGKILL"), "{stderr}");
    assert!(
        group_gone(pgid),
        "a process of the command's group survived SIGKILL"
    );
    assert_lock_free(&server.url(), "job");
}

#[test]
fn a_lost_lock_stops_the_whole_group_grandchildren_included_and_exits_76() {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    // The grandchild ignores SIGTERM, so only SIGKILL to the group stops it.
    let script = r#"(trap "" TERM; exec sleep 1000) & echo $! > "$1.grandchild"; echo $$ > "$1"; wait"#;
    let extra = ["--watchdog", "600ms", "--grace", "1s"];
    let corral = lock_in_background(&server.url(), "job", &extra, script, &marker);
    let pgid = command_group(&marker);
    let grandchild = pid_in(&dir.path("pid.grandchild"));

    // The lock vanishes: the watchdog's next renewal finds it gone.
    let () = redis_cmd(&server.url(), &["FLUSHALL"]);
    let out = corral.finish();

    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(76), "{stderr}");
    assert!(
        stderr.contains(r#"lock "job" was lost while the command ran"#),
        "{stderr}"
    );
    assert!(
        group_gone(pgid),
        "a process of the command's group survived the lost lock"
    );
    assert_eq!(
        kill(grandchild, None),
        Err(Errno::ESRCH),
        "the grandchild survived"
    );
    assert_lock_free(&server.url(), "job");
}

#[test]
fn the_lock_is_held_until_the_last_process_of_the_group_ends() {
    let server = redis_server();
    let dir = TempDir::new();
    let (leader_marker, sleeper_marker) = (dir.path("leader"), dir.path("sleeper"));
    // The command leaves a sleep behind in its group and exits at once.
    let script = format!(
        r#"sleep 1000 & echo $! > "{}"; echo $$ > "$1""#,
        sleeper_marker.display()
    );
    let mut corral = lock_in_background(&server.url(), "job", &[], &script, &leader_marker);
    let leader = pid_in(&leader_marker);
    let sleeper = pid_in(&sleeper_marker);
    assert_eq!(
        getpgid(Some(sleeper)),
        Ok(leader),
        "the sleep is in the command's group"
    );
    eventually("the command's first process exits", || {
        exited(leader).then_some(())
    });

    assert!(
        corral.is_running(),
        "corral left while a process of the command ran"
    );
    let out = lock_job(&server.url(), &[]);
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));

    kill(sleeper, Signal::SIGTERM).unwrap();
    let out = corral.finish();
    assert_eq!(
        out.status.code(),
        Some(0),
        "the first process's status: {}",
        text(&out.stderr)
    );
    assert!(group_gone(leader));
    assert_lock_free(&server.url(), "job");
}

/// A process the test started indirectly, SIGKILLed when the test ends, whatever way it
/// ends: a failed assertion must not leave an escaped `sleep 1000` behind.
struct Reaped(Pid);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = kill(self.0, Signal::SIGKILL);
    }
}

/// A command that starts a process in a session (and so a process group) of its own,
/// which writes its pid to `$1.escaped` and sleeps; `{trap}` runs first in it. The
/// command then writes its own pid to `$1`, and `{rest}` follows.
fn with_escaped(trap: &str, rest: &str) -> String {
    format!(
        r#"setsid sh -c '{trap} echo $$ > "$1.escaped"; exec sleep 1000' sh "$1" & echo $$ > "$1"; {rest}"#
    )
}

#[test]
fn the_lock_is_held_until_an_escaped_descendant_ends() {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    // The command leaves a process behind outside its group and exits at once.
    let script = with_escaped("", "true");
    let mut corral = lock_in_background(&server.url(), "job", &[], &script, &marker);
    let leader = pid_in(&marker);
    let escaped = Reaped(pid_in(&dir.path("pid.escaped")));
    assert_ne!(
        getpgid(Some(escaped.0)),
        Ok(leader),
        "the escaped process left the command's group"
    );
    eventually("the command's first process exits", || {
        exited(leader).then_some(())
    });

    assert!(
        corral.is_running(),
        "corral left while a descendant of the command ran"
    );
    let out = lock_job(&server.url(), &[]);
    assert_eq!(
        out.status.code(),
        Some(75),
        "a second holder ran beside the escaped process: {}",
        text(&out.stderr)
    );

    kill(escaped.0, Signal::SIGTERM).unwrap();
    let out = corral.finish();
    assert_eq!(
        out.status.code(),
        Some(0),
        "the first process's status: {}",
        text(&out.stderr)
    );
    assert!(exited(escaped.0));
    assert_lock_free(&server.url(), "job");
}

#[test]
fn a_lost_lock_stops_escaped_descendants_too() {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    // The escaped process ignores SIGTERM: only SIGKILL sent to it, not to the
    // command's group, stops it.
    let script = with_escaped(r#"trap "" TERM;"#, "wait");
    let extra = ["--watchdog", "600ms", "--grace", "1s"];
    let corral = lock_in_background(&server.url(), "job", &extra, &script, &marker);
    let pgid = command_group(&marker);
    let escaped = Reaped(pid_in(&dir.path("pid.escaped")));

    // The lock vanishes: the watchdog's next renewal finds it gone.
    let () = redis_cmd(&server.url(), &["FLUSHALL"]);
    let out = corral.finish();

    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(76), "{stderr}");
    assert!(stderr.contains("sending SIGKILL"), "{stderr}");
    assert!(group_gone(pgid), "a process of the command's group survived");
    assert!(exited(escaped.0), "the escaped process survived the lost lock");
    assert_lock_free(&server.url(), "job");
}

/// Whether `pid` has exited (gone, or a zombie waiting for its parent).
fn exited(pid: Pid) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

/// The release at the end finds Redis out of reach (its connections reset, new ones
/// refused): `corral` retries it until Redis answers, within its bound, and only then
/// exits, so the next run finds the lock free instead of waiting out its TTL.
#[test]
fn a_release_redis_did_not_answer_is_retried_before_corral_exits() {
    let server = redis_server();
    let proxy = corral_tests::FaultProxy::start(server.addr()).expect("the fault proxy starts");
    let dir = TempDir::new();
    let marker = dir.path("pid");
    let go = dir.path("pid.go");
    let made = std::process::Command::new("mkfifo")
        .arg(&go)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {go:?}");
    // The command says it runs, then waits for a line on the fifo.
    let script = r#"echo $$ > "$1"; read line < "$1.go""#;
    let mut corral = lock_in_background(&proxy.url(), "owed", &["--ttl", "30s"], script, &marker);
    pid_in(&marker);
    proxy.refuse(true);
    assert!(proxy.reset_all() >= 1, "corral's connections");
    // Opening the fifo waits for the command to read it.
    std::fs::write(&go, "go\n").expect("the command reads the fifo");
    corral.wait_for_stderr("could not confirm the release");
    proxy.heal();
    let out = corral.finish();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_lock_free(&server.url(), "owed");
}

/// The Redis name of lock `key`'s part `kind` under the default prefix: `k` the lock,
/// `f` its fencing counter, `q` its fair queue.
fn name_of(key: &str, kind: char) -> String {
    format!("{{7:corral:{key}}}:{kind}")
}

/// `corral lock --key KEY --ttl 60s [extra...]` through `proxy` (slow, so that a reply
/// can be caught on its way back), with the reply to the acquire that set the lock lost:
/// once the lock exists on `server`, every connection to it goes half-open (new ones
/// work, quick again). Returns what `corral` did, and the lock's fencing counter as the
/// lost acquire left it (every take raises it).
fn with_the_acquire_reply_lost(
    server: &corral_tests::RedisServer,
    proxy: &corral_tests::FaultProxy,
    key: &str,
    extra: &[&str],
) -> (std::process::Output, u64) {
    // Each way: a round trip (400 ms) stays under the connection timeout (500 ms).
    proxy.set_latency(Duration::from_millis(200));
    let url = proxy.url();
    let mut args = vec!["lock", "--key", key, "--ttl", "60s", "--redis", &url];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "true"]);
    let corral = Running::spawn(&args);
    let lock = name_of(key, 'k');
    eventually("the acquire reached Redis", || {
        (redis_cmd::<u64>(&server.url(), &["EXISTS", &lock]) == 1).then_some(())
    });
    // The reply is still on its way back (200 ms): swallowed. (The subscription's
    // connection goes half-open too: a waiter then wakes by its backoff's timer.)
    proxy.set_latency(Duration::ZERO);
    assert!(proxy.half_open() >= 1, "corral's connections");
    let fence: Option<u64> = redis_cmd(&server.url(), &["GET", &name_of(key, 'f')]);
    (
        corral.finish(),
        fence.expect("the lost acquire raised the fencing counter"),
    )
}

/// `corral lock` over a link whose round trip (700 ms) is longer than the default
/// connect timeout: 69 without `--connect-timeout`, the command run under the lock (and
/// the lock released) with it.
#[test]
fn a_lock_over_a_slow_link_needs_connect_timeout_and_works_with_it() {
    let server = redis_server();
    let proxy = corral_tests::FaultProxy::start(server.addr()).expect("the fault proxy starts");
    proxy.set_latency(Duration::from_millis(350));
    let url = proxy.url();
    let refused = run(&["lock", "--key", "far", "--redis", &url, "--", "true"], None);
    let stderr = text(&refused.stderr);
    assert_eq!(refused.status.code(), Some(69), "{stderr}");

    let held = run(
        &[
            "lock",
            "--key",
            "far",
            "--connect-timeout",
            "5s",
            "--redis",
            &url,
            "--",
            "sh",
            "-c",
            "echo token=$CORRAL_FENCING_TOKEN",
        ],
        None,
    );
    assert!(held.status.success(), "{}", text(&held.stderr));
    assert!(text(&held.stdout).starts_with("token="), "{}", text(&held.stdout));
    assert_lock_free(&server.url(), "far");
}

/// An acquire whose reply was lost set the lock in Redis, held by nobody: `corral`
/// (which cannot know it holds it) releases it before it exits, so the next run finds
/// the lock free instead of waiting out the TTL.
#[test]
fn an_acquire_whose_reply_was_lost_leaves_no_lock_behind_when_corral_exits() {
    let server = redis_server();
    let proxy = corral_tests::FaultProxy::start(server.addr()).expect("the fault proxy starts");
    let (out, _) = with_the_acquire_reply_lost(&server, &proxy, "lost", &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("failed the lock acquire"), "{stderr}");
    let left: u64 = redis_cmd(&server.url(), &["EXISTS", &name_of("lost", 'k')]);
    assert_eq!(left, 0, "a lock no one holds was left behind: {stderr}");
    assert_lock_free(&server.url(), "lost");
}

/// The same lost reply while `corral` may wait: the lock its lost attempt set is
/// released, and a later try takes it, so the command runs (rather than `corral`
/// waiting on its own lost attempt until `--wait` runs out, then exiting 75).
#[test]
fn an_acquire_whose_reply_was_lost_is_released_and_a_later_try_takes_the_lock() {
    let server = redis_server();
    let proxy = corral_tests::FaultProxy::start(server.addr()).expect("the fault proxy starts");
    let (out, lost) = with_the_acquire_reply_lost(&server, &proxy, "retaken", &["--wait", "20s"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // Taken again after the lost attempt (not that attempt's reply arriving after all).
    let fence: Option<u64> = redis_cmd(&server.url(), &["GET", &name_of("retaken", 'f')]);
    assert!(
        fence > Some(lost),
        "the lock was not taken again: {fence:?} after {lost}"
    );
    let left: u64 = redis_cmd(&server.url(), &["EXISTS", &name_of("retaken", 'k')]);
    assert_eq!(left, 0, "the lock was left behind: {stderr}");
}

#[test]
fn a_command_that_is_not_found_exits_127_and_releases_the_lock() {
    let server = redis_server();
    let out = run(
        &[
            "lock",
            "--key",
            "job",
            "--redis",
            &server.url(),
            "--",
            "no-such-command-here",
        ],
        None,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "{stderr}");
    assert!(
        stderr.contains(r#"cannot run "no-such-command-here": command not found"#),
        "{stderr}"
    );
    assert_lock_free(&server.url(), "job");
}

#[test]
fn a_command_that_is_not_executable_exits_126_and_releases_the_lock() {
    let server = redis_server();
    let dir = TempDir::new();
    let script = dir.path("script.sh");
    std::fs::write(&script, "#!/bin/sh\necho hello\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = run(
        &[
            "lock",
            "--key",
            "job",
            "--redis",
            &server.url(),
            "--",
            script.to_str().unwrap(),
        ],
        None,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(126), "{stderr}");
    assert!(stderr.contains("not executable"), "{stderr}");
    assert_lock_free(&server.url(), "job");
}

#[test]
fn a_lock_held_by_another_owner_exits_75() {
    let server = redis_server();
    let dir = TempDir::new();
    let holder = holding_job(&server.url(), &dir);

    let out = lock_job(&server.url(), &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains(r#"error: lock "job" is held by another owner"#),
        "{stderr}"
    );
    assert!(stderr.contains("--wait"), "{stderr}");

    let out = lock_job(&server.url(), &["--wait", "200ms"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains("held by another owner (waited 200ms)"),
        "{stderr}"
    );

    holder.signal(Signal::SIGTERM);
    assert_eq!(holder.finish().status.code(), Some(143));
}

/// `corral lock` holding "job" (unfair) with a command that waits until signalled;
/// returns once the command runs.
fn holding_job(url: &str, dir: &TempDir) -> Running {
    let marker = dir.path("pid");
    let holder = lock_in_background(url, "job", &[], WITH_GRANDCHILD, &marker);
    pid_in(&marker);
    holder
}

/// The queue of the lock "job" under the default prefix (contract §2.4), as its lines.
fn queued(url: &str) -> Vec<String> {
    let queue: Option<String> = redis_cmd(url, &["GET", &name_of("job", 'q')]);
    queue.unwrap_or_default().lines().map(str::to_owned).collect()
}

/// `corral lock --fair --wait 60s` on "job", in the background, once the queue holds
/// `ahead` waiters; returns once it is queued behind them.
fn fair_waiter(url: &str, script: &str, file: &std::path::Path, ahead: usize) -> Running {
    let waiter = lock_in_background(url, "job", &["--fair", "--wait", "60s"], script, file);
    eventually("the waiter queued", || {
        (queued(url).len() == ahead + 1).then_some(())
    });
    waiter
}

/// Fair waiters in separate processes get the lock in the order they came (a queue in
/// Redis, contract §6): six `corral lock --fair` processes, each started once the one
/// before it is queued, while another holds the lock. Without the queue, whichever
/// tried first after each release won, in any order.
#[test]
fn fair_waiters_in_separate_processes_are_served_in_the_order_they_came() {
    let server = redis_server();
    let url = server.url();
    let dir = TempDir::new();
    let holder = holding_job(&url, &dir);
    let order = dir.path("order");
    let names: Vec<String> = (0..6).map(|i| format!("w{i}")).collect();
    let waiters: Vec<Running> = names
        .iter()
        .enumerate()
        .map(|(i, name)| fair_waiter(&url, &format!(r#"echo {name} >> "$1""#), &order, i))
        .collect();
    holder.signal(Signal::SIGTERM);
    assert_eq!(holder.finish().status.code(), Some(143));
    for waiter in waiters {
        let out = waiter.finish();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    let served = std::fs::read_to_string(&order).unwrap();
    assert_eq!(
        served.lines().collect::<Vec<_>>(),
        names,
        "first come, first served"
    );
    assert!(queued(&url).is_empty(), "the queue is deleted once empty");
}

/// Ten `corral lock --wait 30s` processes on one key, each holding it for 300 ms: every
/// release that has a waiter (all but the last) is announced before its process exits
/// (the announcement is made by the release's own script, so a process that exits right
/// after its release owes nothing) and wakes the next waiter, instead of the waiter
/// sleeping out its backoff step (50 ms doubling to 1 s: polling took 7.9 s for ten).
/// The bound on the span from the first acquire to the last release (3 s of holding)
/// is generous: it asserts the wake-ups, not a speed.
#[test]
fn ten_processes_hand_the_lock_on_at_each_release_and_every_waited_for_release_is_announced() {
    let server = redis_server();
    let url = server.url();
    let dir = TempDir::new();
    let times = dir.path("times");
    let holders: Vec<Running> = (0..10)
        .map(|_| {
            lock_in_background(
                &url,
                "job",
                &["--wait", "30s"],
                r#"date +%s%N >> "$1"; sleep 0.3; date +%s%N >> "$1""#,
                &times,
            )
        })
        .collect();
    for holder in holders {
        let out = holder.finish();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    let stamps: Vec<u128> = std::fs::read_to_string(&times)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(stamps.len(), 20);
    let took = Duration::from_nanos((stamps[19] - stamps[0]) as u64);
    // Start, end, start, end, ...: the gap between one's end and the next one's start.
    let gaps_ms: Vec<u128> = stamps[1..]
        .chunks(2)
        .filter(|pair| pair.len() == 2)
        .map(|pair| pair[1].saturating_sub(pair[0]) / 1_000_000)
        .collect();
    let stats: String = redis_cmd(&url, &["INFO", "commandstats"]);
    let published = corral_tests::calls_in(&stats, "publish").unwrap();
    println!(
        "from the first acquire to the last release: {took:?}; hand-off gaps (ms) {gaps_ms:?}; {published} releases announced"
    );
    assert_eq!(
        published, 9,
        "every release with a waiter announced, and only those"
    );
    assert!(took < Duration::from_millis(5_000), "{took:?}: waiters polled");
}

/// A fair waiter that gives up (its --wait runs out) leaves the queue at once; one
/// killed while queued (SIGKILL: it cannot leave) holds up those behind it only until
/// its place lapses, 5 s after its last try, never for good.
#[test]
fn a_fair_waiter_that_gives_up_leaves_the_queue_and_a_killed_ones_place_lapses() {
    let server = redis_server();
    let url = server.url();
    let dir = TempDir::new();
    let holder = holding_job(&url, &dir);

    let out = run(
        &[
            "lock", "--key", "job", "--fair", "--wait", "300ms", "--redis", &url, "--", "true",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    assert!(queued(&url).is_empty(), "it left: {:?}", queued(&url));

    let ran = dir.path("ran");
    let killed = fair_waiter(&url, r#"echo killed >> "$1""#, &ran, 0);
    let next = fair_waiter(&url, r#"echo next >> "$1""#, &ran, 1);
    killed.signal(Signal::SIGKILL);
    let _ = killed.finish();
    holder.signal(Signal::SIGTERM);
    assert_eq!(holder.finish().status.code(), Some(143));
    let released = Instant::now();
    let out = next.finish();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    println!(
        "the next waiter got the lock {:?} after the release",
        released.elapsed()
    );
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "next\n");
    assert!(queued(&url).is_empty());
}

#[test]
fn a_signal_while_waiting_for_the_lock_ends_the_wait_and_exits_128_plus_it() {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    let holder = lock_in_background(&server.url(), "job", &[], WITH_GRANDCHILD, &marker);
    command_group(&marker);
    let started = dir.path("started");
    let args = [
        "lock",
        "--key",
        "job",
        "--wait",
        "20s",
        "--redis",
        &server.url(),
        "--",
        "touch",
        started.to_str().unwrap(),
    ];
    let mut waiter = Running::spawn_with(&args, &[("CORRAL_LOG", "corral::lock=info")]);
    waiter.wait_for_stderr("taking the lock");

    let sent = Instant::now();
    waiter.signal(Signal::SIGTERM);
    let out = waiter.finish();

    assert_eq!(out.status.code(), Some(143));
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "the wait did not end with the signal"
    );
    assert!(!started.exists(), "the command ran after the signal");
    holder.signal(Signal::SIGTERM);
    assert_eq!(holder.finish().status.code(), Some(143));
    assert_lock_free(&server.url(), "job");
}

#[test]
fn the_command_gets_the_token_and_its_status_is_corrals() {
    let server = redis_server();
    let url = server.url();
    let lock = |script: &str| {
        run(
            &["lock", "--key", "job", "--redis", &url, "--", "sh", "-c", script],
            None,
        )
        .status
        .code()
    };
    let env_check = r#"test "$CORRAL_LOCK_KEY" = job && test "$CORRAL_FENCING_TOKEN" -gt 0"#;
    assert_eq!(lock(env_check), Some(0));
    assert_eq!(lock("exit 7"), Some(7));
    assert_eq!(lock("kill -KILL $$"), Some(128 + 9));
    assert_lock_free(&url, "job");
}

#[test]
fn an_unreachable_redis_exits_69_naming_the_cause() {
    let url = format!("redis://127.0.0.1:{}", closed_port());
    let out = lock_job(&url, &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(
        stderr.contains(&format!("error: cannot use Redis at {url}: connection refused")),
        "{stderr}"
    );
    assert!(stderr.contains("hint: nothing listens at"), "{stderr}");
}

#[test]
fn redlock_without_a_majority_exits_69() {
    let server = redis_server();
    let (a, b) = (
        format!("redis://127.0.0.1:{}", closed_port()),
        format!("redis://127.0.0.1:{}", closed_port()),
    );
    let url = server.url();
    let out = lock_job(&url, &["--redis", &a, "--redis", &b]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(
        stderr.contains(r#"cannot take lock "job": too few of its 3 Redis servers answered"#),
        "{stderr}"
    );
    assert!(stderr.to_lowercase().contains("connection refused"), "{stderr}");
    assert!(stderr.contains("a lock needs a majority (2 of 3)"), "{stderr}");
}

/// A port where something accepts connections and closes them at once: an error whose
/// words name no cause, so `corral` asks the servers why.
fn hanging_up() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let url = format!("redis://{}", listener.local_addr().expect("its address"));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            drop(conn);
        }
    });
    url
}

/// Redlock without a majority, one server up behind a slow link (1.2 s round trip),
/// two that hang up: the servers `corral` asks why the lock failed get the link's
/// timeouts too, so the one that is up is named as answering, not as timed out.
#[test]
fn redlock_without_a_majority_over_a_slow_link_names_the_server_that_answers() {
    let server = redis_server();
    let proxy = corral_tests::FaultProxy::start(server.addr()).expect("the fault proxy starts");
    proxy.set_latency(Duration::from_millis(600));
    let (url, a, b) = (proxy.url(), hanging_up(), hanging_up());
    let args = [
        "--connect-timeout",
        "5s",
        "--response-timeout",
        "5s",
        "lock",
        "--key",
        "job",
        "--wait",
        "0s",
        "--redis",
        &url,
        "--redis",
        &a,
        "--redis",
        &b,
        "--",
        "true",
    ];
    let out = run(&args, None);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains(&format!("{url}: answers now")), "{stderr}");
}

#[test]
fn a_refused_login_or_command_exits_69_naming_the_cause() {
    let server = redis_server();
    let admin = server.url();
    let () = redis_cmd(
        &admin,
        &[
            "ACL", "SETUSER", "noscript", "on", ">pw", "~*", "&*", "+@all", "-evalsha", "-eval",
        ],
    );
    let () = redis_cmd(&admin, &["CONFIG", "SET", "requirepass", "sesame"]);
    let port = server.port();

    // A try refused at login or at the database switch never ran: it owes no release
    // (before, `corral` retried one for 3 s and warned that it could not).
    for wrong in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis://:wrong@127.0.0.1:{port}"),
    ] {
        let out = lock_job(&wrong, &[]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(69), "{stderr}");
        assert!(stderr.contains("authentication failed"), "{stderr}");
        assert!(stderr.contains("requirepass or ACL users"), "{stderr}");
        assert!(!stderr.contains("did not finish"), "{stderr}");
    }
    let past_databases = format!("redis://:sesame@127.0.0.1:{port}/16");
    let out = lock_job(&past_databases, &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("the database number was refused"), "{stderr}");
    assert!(!stderr.contains("did not finish"), "{stderr}");

    let forbidden = format!("redis://noscript:pw@127.0.0.1:{port}");
    let out = lock_job(&forbidden, &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("permission denied (ACL)"), "{stderr}");
    assert!(stderr.contains("+@scripting"), "{stderr}");
    assert!(!stderr.contains("did not finish"), "{stderr}");
}

/// One server named twice (in any spelling) would be two votes of a Redlock's majority,
/// and its own lock would read as another owner's: a usage error naming the server.
#[test]
fn a_server_named_twice_is_a_usage_error() {
    let server = redis_server();
    let url = server.url();
    // Another database of the same server is the same server.
    let again = format!("{url}/1");
    let out = lock_job(&url, &["--redis", &again]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("twice"), "{stderr}");
}

#[test]
fn lock_without_redis_is_a_usage_error() {
    let out = run(&["lock", "--key", "job", "--", "true"], None);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("`lock` needs --redis URL"), "{stderr}");
}

/// A grace past a day is refused up front as a usage error naming `--grace`: one past
/// what a clock can count made `corral` panic when the signal came, leaving the command
/// running unsupervised and the lock to the next holder.
#[test]
fn a_grace_past_a_day_is_a_usage_error_naming_it() {
    let server = redis_server();
    for grace in ["300000000000y", "18446744073709551615s", "25h"] {
        let out = lock_job(&server.url(), &["--grace", grace]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "--grace {grace}: {stderr}");
        assert!(
            stderr.contains("--grace") && !stderr.contains("panicked"),
            "--grace {grace}: {stderr}"
        );
    }
}

/// The longest grace there is still stops the command's processes and releases the
/// lock when `corral` is signalled and they stop by themselves.
#[test]
fn the_longest_grace_still_ends_with_the_command() {
    let server = redis_server();
    let dir = TempDir::new();
    let marker = dir.path("pid");
    let corral = lock_in_background(
        &server.url(),
        "job",
        &["--grace", "24h"],
        WITH_GRANDCHILD,
        &marker,
    );
    let pgid = command_group(&marker);
    corral.signal(Signal::SIGTERM);
    let out = corral.finish();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    assert!(group_gone(pgid), "the command's processes stopped");
    assert_lock_free(&server.url(), "job");
}

/// Another program's value under the lock's name is reported as such (65), with a hint
/// that fits a lock: `corral remove` does not reach a lock's names.
#[test]
fn a_foreign_value_under_the_locks_name_is_a_data_error_with_a_hint_for_locks() {
    let server = redis_server();
    let () = redis_cmd(&server.url(), &["LPUSH", "{7:corral:job}:k", "x"]);
    let out = lock_job(&server.url(), &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(65), "{stderr}");
    assert!(stderr.contains("not a Corral lock"), "{stderr}");
    assert!(!stderr.contains("corral remove"), "{stderr}");
    assert!(stderr.contains("another program"), "{stderr}");
}

#[test]
fn a_bad_watchdog_ttl_is_a_usage_error_naming_watchdog() {
    let server = redis_server();
    for (flag, value) in [("--watchdog", "0s"), ("--watchdog", "2ms"), ("--ttl", "0s")] {
        let out = lock_job(&server.url(), &[flag, value]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{flag} {value}: {stderr}");
        let named = flag.trim_start_matches('-');
        assert!(stderr.contains(&format!("`{named}`")), "{flag} {value}: {stderr}");
    }
}
