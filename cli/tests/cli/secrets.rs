//! No secret is ever printed: a Redis URL's password appears in no error, no log line
//! at any level, no help text and no Debug output, whatever the command and however it
//! fails. Each check runs with `CORRAL_LOG=trace` and looks at stdout and stderr both.

use std::process::Output;

use crate::support::{closed_port, corral, redis_cmd, redis_server, run_command, text};

const SECRET: &str = "hunter2";

/// Runs `corral args` with every log level on (and `env` set) and asserts the secret
/// is nowhere in what it printed; gives stderr.
fn assert_never_printed(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let mut command = corral(args);
    command.env("CORRAL_LOG", "trace").envs(env.iter().copied());
    let out = run_command(command, Some("get k\n"));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        !stdout.contains(SECRET),
        "the password is on stdout of {args:?}:\n{stdout}"
    );
    assert!(
        !stderr.contains(SECRET),
        "the password is on stderr of {args:?}:\n{stderr}"
    );
    (out, stderr)
}

#[test]
fn a_password_of_an_unreachable_redis_is_never_printed() {
    let url = format!("redis://u:{SECRET}@127.0.0.1:{}", closed_port());
    let masked = url.replace(SECRET, "***");
    for args in [
        vec!["get", "k", "--redis", &url],
        vec!["lock", "--key", "k", "--redis", &url, "--", "true"],
        vec!["--redis", &url, "script"],
    ] {
        let (out, stderr) = assert_never_printed(&args, &[]);
        assert_eq!(out.status.code(), Some(69), "{args:?}: {stderr}");
        assert!(stderr.contains(&masked), "the server is named, masked: {stderr}");
        assert!(
            stderr.contains("command line cli=Cli"),
            "the trace shows the parsed command line: {stderr}"
        );
    }
}

#[test]
fn a_password_from_the_environment_is_never_printed() {
    let url = format!("redis://u:{SECRET}@127.0.0.1:{}", closed_port());
    let env = [("CORRAL_REDIS", url.as_str())];
    let (out, _) = assert_never_printed(&["get", "k"], &env);
    assert_eq!(out.status.code(), Some(69));
    let (out, _) = assert_never_printed(&["lock", "--key", "k", "--", "true"], &env);
    assert_eq!(out.status.code(), Some(69));
    let (out, _) = assert_never_printed(&["--help"], &env);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        text(&out.stdout).contains("[env: CORRAL_REDIS]"),
        "the help names the variable, not its value"
    );
}

#[test]
fn a_password_in_a_usage_error_is_never_printed() {
    let url = format!("redis://u:{SECRET}@127.0.0.1:1");
    for args in [
        vec!["--redis", &url, "get"],
        vec!["--redis", &url, "--redis", &url, "get", "k"],
        vec!["get", "k", &url],
        vec!["lock", "--key", "k", "--redis", &url, "--ttl", &url, "--", "true"],
    ] {
        let (out, stderr) = assert_never_printed(&args, &[]);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
    }
}

#[test]
fn a_wrong_password_to_a_live_redis_is_never_printed() {
    let server = redis_server();
    let () = redis_cmd(&server.url(), &["CONFIG", "SET", "requirepass", "sesame"]);
    let url = format!("redis://u:{SECRET}@127.0.0.1:{}", server.port());
    for args in [
        vec!["get", "k", "--redis", &url],
        vec!["lock", "--key", "k", "--redis", &url, "--", "true"],
    ] {
        let (out, stderr) = assert_never_printed(&args, &[]);
        assert_eq!(out.status.code(), Some(69), "{args:?}: {stderr}");
        assert!(stderr.contains("authentication failed"), "{stderr}");
    }
}

/// A password holding characters a URL should percent-encode (a space, a quote, an
/// angle bracket, a backtick) is still a password: masked as any other, on a live
/// server that refuses it and on a closed port alike.
#[test]
fn a_password_with_characters_a_url_should_encode_is_never_printed() {
    let server = redis_server();
    let () = redis_cmd(&server.url(), &["CONFIG", "SET", "requirepass", "sesame"]);
    let port = server.url().rsplit(':').next().unwrap().to_owned();
    let closed = closed_port().to_string();
    for secret in ["hunter2 with spaces", "hunter2\"<q>`", "hunter2 x"] {
        for port in [&port, &closed] {
            let url = format!("redis://:{secret}@127.0.0.1:{port}");
            for args in [
                vec!["get", "k", "--redis", &url],
                vec!["lock", "--key", "k", "--redis", &url, "--", "true"],
            ] {
                let (out, stderr) = assert_never_printed(&args, &[]);
                assert_eq!(out.status.code(), Some(69), "{args:?}: {stderr}");
                assert!(!stderr.contains(secret), "{args:?}: {stderr}");
            }
        }
    }
}

/// A URL the library refuses to parse is reported without its password.
#[test]
fn a_password_in_a_url_that_does_not_parse_is_never_printed() {
    for url in [
        format!(":{SECRET}@127.0.0.1:1"),
        format!("redis:/:{SECRET}@127.0.0.1:1"),
    ] {
        let (out, stderr) = assert_never_printed(&["get", "k", "--redis", &url], &[]);
        assert_ne!(out.status.code(), Some(0), "{url}: {stderr}");
    }
}
