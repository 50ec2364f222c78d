//! The entry commands (`set`, `get`, `refresh`, `remove`, `inspect`): one operation on
//! one cache, its result on stdout.

use std::time::Duration;

use comfy_table::Table;
use corral::{Corral, EntryOptions};

use crate::Command;
use crate::failure::{Failure, code};
use crate::output::{out, say};
use crate::redact::RedisUrl;

/// How a command's result is printed: alone (`corral get`: a value's bytes exactly, a
/// miss said on stderr), or as one line among a script's (a value and a newline, a miss
/// as `(no entry)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Printed {
    Alone,
    Line,
}

/// Runs one entry command on `cache`, which is on `redis` (`None`: the embedded store).
pub async fn run(
    cache: &Corral,
    command: &Command,
    redis: Option<&RedisUrl>,
    printed: Printed,
) -> Result<(), Failure> {
    let failed = |e: corral::Error| Failure::from_error(&e, redis);
    match command {
        Command::Set {
            key,
            value,
            relative,
            absolute_ms,
            sliding,
        } => {
            let options = entry_options(*relative, *absolute_ms, *sliding);
            cache
                .set(key, value.clone().into_bytes(), options)
                .await
                .map_err(failed)?;
            out!("stored {key}")
        }
        Command::Get { key } => match (cache.get(key).await.map_err(failed)?, printed) {
            (Some(v), Printed::Alone) => crate::output::value(&v),
            (Some(v), Printed::Line) => crate::output::value_line(&v),
            (None, Printed::Alone) => {
                say!("(no entry)");
                Ok(())
            }
            (None, Printed::Line) => out!("(no entry)"),
        },
        Command::Refresh { key } => {
            let found = cache.refresh(key).await.map_err(failed)?;
            out!("{}", if found { "refreshed" } else { "(no entry)" })
        }
        Command::Remove { key } => {
            let found = cache.remove(key).await.map_err(failed)?;
            out!("{}", if found { "removed" } else { "(no entry)" })
        }
        Command::Inspect { key } => match cache.inspect(key).await.map_err(failed)? {
            Some(i) => out!("{}", inspection_table(cache, key, &i)),
            None => out!("(no entry)"),
        },
        Command::Demo | Command::Script | Command::Stampede { .. } | Command::Lock { .. } => {
            Err(Failure::new(
                code::USAGE,
                "only set, get, refresh, remove and inspect can run on a script line",
            ))
        }
    }
}

fn entry_options(
    relative: Option<Duration>,
    absolute_ms: Option<u64>,
    sliding: Option<Duration>,
) -> EntryOptions {
    let mut options = EntryOptions::new();
    if let Some(d) = relative {
        options = options.relative(d);
    }
    if let Some(at) = absolute_ms {
        options = options.absolute_at_ms(at);
    }
    if let Some(d) = sliding {
        options = options.sliding(d);
    }
    options
}

fn ms(d: Option<u64>) -> String {
    d.map_or_else(
        || "-".to_string(),
        |ms| humantime::format_duration(Duration::from_millis(ms)).to_string(),
    )
}

fn inspection_table(cache: &Corral, key: &str, i: &corral::Inspection) -> Table {
    let now = cache.clock().now_ms();
    let mut table = Table::new();
    table
        .load_preset(comfy_table::presets::UTF8_BORDERS_ONLY)
        .set_header(["field", "value"]);
    table.add_row(["key", key]);
    let state = match (i.fresh, i.stale) {
        (true, _) => "fresh",
        (false, true) => "stale (kept for fail-safe)",
        (false, false) => "expired",
    };
    table.add_row(["state", state]);
    table.add_row(["value bytes".to_string(), i.value_len.to_string()]);
    table.add_row(["stored bytes".to_string(), i.stored_len.to_string()]);
    table.add_row([
        "absolute expiration (unix ms)".to_string(),
        i.meta.absolute_ms.map_or("-".into(), |v| v.to_string()),
    ]);
    table.add_row(["sliding expiration".to_string(), ms(i.meta.sliding_ms)]);
    table.add_row([
        "expires at (unix ms)".to_string(),
        i.meta.expires_at_ms.to_string(),
    ]);
    table.add_row([
        "expires in".to_string(),
        ms(Some(i.meta.expires_at_ms.saturating_sub(now))),
    ]);
    table.add_row(["stale window (fail-safe)".to_string(), ms(i.meta.stale_ms)]);
    table
}
