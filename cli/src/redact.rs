//! Secrets never reach the terminal: this module owns the Redis URL type the CLI parses
//! (`--redis`, `CORRAL_REDIS`), which shows itself with its password masked, and the
//! redaction every line the CLI writes to stderr (messages, logs, panics) goes through.
//!
//! Two nets, because a password can surface in two shapes: inside a URL
//! (`redis://user:secret@host`, masked by shape wherever it appears) and on its own (a
//! library's Debug output, `password: Some("secret")`, masked because every password
//! the CLI was given is remembered and replaced wherever it appears, or for a password
//! of under 4 characters wherever it appears in quotes or as a URL's password).

use std::borrow::Cow;
use std::convert::Infallible;
use std::fmt;
use std::sync::RwLock;

/// What a secret is replaced with.
const MASK: &str = "***";

/// Secrets at least this long are masked wherever they appear; shorter ones (which
/// would mask pieces of words) only inside URLs and in quotes, as Debug shows them.
const WHOLE_WORD_MIN: usize = 4;

/// Every password the CLI was given, to be masked wherever it appears.
static SECRETS: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// A Redis URL as given on the command line. Display and Debug mask its password;
/// [`expose`](Self::expose) is for the library call that connects, and nothing else.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(String);

impl RedisUrl {
    /// Takes a URL from the command line and remembers its secrets. Never fails: a
    /// bad URL is reported later by the library, through the redaction, because
    /// clap would print a value it rejects as it is, password and all.
    pub fn parse(raw: &str) -> Result<Self, Infallible> {
        for secret in secrets_of(raw) {
            remember(secret);
        }
        Ok(RedisUrl(raw.to_owned()))
    }

    /// The URL with its password, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The whole argument is one URL: its password ends at its last `@`, whatever
        // characters it holds (a space or a quote included).
        let shown = match password_span(&self.0) {
            Some((from, to)) => format!("{}{MASK}{}", &self.0[..from], &self.0[to..]),
            None => self.0.clone(),
        };
        f.write_str(&redact(&shown))
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisUrl({self})")
    }
}

/// `text` with every URL password and every remembered secret masked.
pub fn redact(text: &str) -> Cow<'_, str> {
    let mut out = mask_url_passwords(text);
    let secrets = SECRETS.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    for secret in secrets.iter() {
        let shapes = if secret.len() >= WHOLE_WORD_MIN {
            vec![(secret.clone(), MASK.to_owned())]
        } else {
            // In quotes, and as a URL's password (one the scan above could not see
            // whole, holding a space or a quote).
            vec![
                (format!("\"{secret}\""), format!("\"{MASK}\"")),
                (format!(":{secret}@"), format!(":{MASK}@")),
            ]
        };
        for (shape, mask) in shapes {
            if out.contains(&shape) {
                out = Cow::Owned(out.replace(&shape, &mask));
            }
        }
    }
    out
}

fn remember(secret: String) {
    let mut secrets = SECRETS.write().unwrap_or_else(|poisoned| poisoned.into_inner());
    if !secret.is_empty() && !secrets.contains(&secret) {
        secrets.push(secret);
        // Longest first, so that a secret containing another is masked whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    }
}

/// The secrets in a Redis URL: the userinfo password and a `pass`/`password` query
/// parameter, each as written and percent-decoded.
fn secrets_of(url: &str) -> Vec<String> {
    let mut found = Vec::new();
    if let Some((from, to)) = password_span(url) {
        found.push(url[from..to].to_owned());
    }
    if let Some((_, query)) = url.split_once('?') {
        for pair in query.split('&') {
            if let Some(("pass" | "password", value)) = pair.split_once('=') {
                found.push(value.to_owned());
            }
        }
    }
    let decoded: Vec<String> = found.iter().map(|s| percent_decode(s)).collect();
    found.extend(decoded);
    found
}

/// Where the userinfo password of `url`, one URL as given on the command line, lies:
/// between the first `:` of its user information and its last `@` before the path.
/// Characters a URL should encode (a space, a quote) do not end it, and a URL without
/// `://` (`:pw@host`, `redis:/:pw@host`, which the library will refuse) is read the
/// same way, so that the refusal never shows the password either.
fn password_span(url: &str) -> Option<(usize, usize)> {
    let scheme_end = url.find("://");
    let start = scheme_end.map_or(0, |at| at + 3);
    let rest = &url[start..];
    let authority = match scheme_end {
        Some(_) => &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())],
        None => rest,
    };
    let at = authority.rfind('@')?;
    let userinfo = &authority[..at];
    let colon = match scheme_end {
        Some(_) => userinfo.find(':')?,
        None => userinfo.rfind(':')?,
    };
    let (from, to) = (start + colon + 1, start + at);
    (from < to).then_some((from, to))
}

/// Where the authority (`user:password@host:port`) of a URL's remainder ends.
fn authority_end(rest: &str) -> usize {
    rest.find(|c: char| c.is_whitespace() || matches!(c, '/' | '?' | '#' | '"' | '\'' | '`' | '<' | '>'))
        .unwrap_or(rest.len())
}

/// Masks the password of every `scheme://user:password@host` in `text`.
fn mask_url_passwords(text: &str) -> Cow<'_, str> {
    if !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let end = authority_end(after);
        let authority = &after[..end];
        match authority.rsplit_once('@') {
            Some((userinfo, host)) if userinfo.contains(':') => {
                let user = userinfo.split_once(':').map_or("", |(user, _)| user);
                out.push_str(&format!("{user}:{MASK}@{host}"));
            }
            _ => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_password_is_masked_wherever_the_url_appears() {
        let text = "connect to redis://u:s3cr%40t@127.0.0.1:6379/0 failed; see rediss://:pw@[::1]:7000";
        assert_eq!(
            redact(text),
            "connect to redis://u:***@127.0.0.1:6379/0 failed; see rediss://:***@[::1]:7000"
        );
    }

    #[test]
    fn a_password_with_characters_a_url_should_encode_is_never_shown() {
        for (raw, shown) in [
            ("redis://:Wrong PW99@127.0.0.1:1", "redis://:***@127.0.0.1:1"),
            (
                "redis://u:W\"r<o>n`g@127.0.0.1:1/0",
                "redis://u:***@127.0.0.1:1/0",
            ),
            ("redis://:a b@h:1", "redis://:***@h:1"),
        ] {
            let url = RedisUrl::parse(raw).unwrap();
            assert_eq!(url.to_string(), shown);
            let secret = raw[raw.find("://").unwrap() + 3..raw.rfind('@').unwrap()]
                .split_once(':')
                .unwrap()
                .1;
            let said = redact(&format!("cannot use Redis at {raw}: authentication failed")).into_owned();
            assert!(!said.contains(&format!(":{secret}@")), "{said}");
            assert!(secret.len() < WHOLE_WORD_MIN || !said.contains(secret), "{said}");
        }
    }

    #[test]
    fn a_url_the_library_will_refuse_shows_no_password_either() {
        for raw in [
            ":s3cretpw@host:1",
            "redis:/:s3cretpw@host:1",
            "redis:s3cretpw@host",
        ] {
            let url = RedisUrl::parse(raw).unwrap();
            assert!(!url.to_string().contains("s3cretpw"), "{url}");
            assert!(!redact(&format!("{raw} is not a Redis URL")).contains("s3cretpw"));
        }
    }

    #[test]
    fn urls_without_a_password_are_left_alone() {
        for text in [
            "redis://127.0.0.1:6379",
            "redis://user@host:1/2",
            "no url here",
            "a://",
        ] {
            assert_eq!(redact(text), text);
        }
    }

    #[test]
    fn a_remembered_secret_is_masked_in_any_shape() {
        let url = RedisUrl::parse("redis://u:tr%2Fout@h:1?password=seaweed").unwrap();
        assert_eq!(url.to_string(), "redis://u:***@h:1?password=***");
        assert_eq!(format!("{url:?}"), "RedisUrl(redis://u:***@h:1?password=***)");
        assert_eq!(
            redact(r#"Info { password: Some("tr/out"), other: "seaweed" }"#),
            r#"Info { password: Some("***"), other: "***" }"#
        );
    }

    #[test]
    fn a_short_secret_is_masked_in_urls_and_quotes_but_not_inside_words() {
        RedisUrl::parse("redis://u:xy@h:1").unwrap();
        assert_eq!(
            redact(r#"proxy at redis://u:xy@h:1 said password: Some("xy")"#),
            r#"proxy at redis://u:***@h:1 said password: Some("***")"#
        );
    }
}
