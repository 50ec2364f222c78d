//! `corral script`: one entry command per line of standard input, all on one cache
//! (which is how the embedded store, living only as long as the process, is used from
//! a shell). A failed line is reported on stderr with its number and the script goes
//! on; at the end, `corral` exits with the highest status of the failed lines.

use std::io::BufRead;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use corral::Corral;

use crate::failure::{Failure, code};
use crate::redact::RedisUrl;
use crate::{Cli, entry};

/// The options that say which cache to use: the script's, never a line's.
const GLOBAL_OPTIONS: [&str; 2] = ["redis", "prefix"];

/// Runs the lines of stdin on `cache` (on `redis`; `None`: the embedded store).
pub async fn run(cache: &Corral, redis: Option<&RedisUrl>) -> Result<(), Failure> {
    let (mut lines, mut failed, mut worst) = (0, 0, 0);
    for (n, line) in std::io::stdin().lock().lines().enumerate() {
        let outcome = match line {
            Ok(line) if is_blank(&line) => continue,
            Ok(line) => run_line(cache, &line, redis).await,
            Err(e) => Err(Failure::new(code::USAGE, format!("cannot read the line: {e}"))),
        };
        lines += 1;
        if let Err(failure) = outcome {
            if failure.code() == code::CLOSED_STDOUT {
                return Err(failure);
            }
            failure.report_as(&format!("line {}: ", n + 1));
            failed += 1;
            worst = worst.max(failure.code());
        }
    }
    if failed > 0 {
        return Err(Failure::new(
            worst,
            format!("{failed} of {lines} script lines failed"),
        ));
    }
    Ok(())
}

fn is_blank(line: &str) -> bool {
    let line = line.trim_start();
    line.is_empty() || line.starts_with('#')
}

async fn run_line(cache: &Corral, line: &str, redis: Option<&RedisUrl>) -> Result<(), Failure> {
    // Words as a POSIX shell splits them: quotes keep white space in a key or value.
    let words = shlex::split(line).ok_or_else(|| {
        Failure::new(code::USAGE, "the line has a quote that is not closed")
            .hint("quote a key or value with white space in it as a shell would: set 'a key' \"a value\"")
    })?;
    let words = std::iter::once("corral".to_owned()).chain(words);
    let matches = Cli::command()
        .try_get_matches_from(words)
        .map_err(|e| Failure::new(code::USAGE, first_line(&e.render().to_string())))?;
    if let Some(option) = GLOBAL_OPTIONS
        .into_iter()
        .find(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
    {
        return Err(Failure::new(
            code::USAGE,
            format!("--{option} cannot be given on a script line"),
        )
        .hint(format!(
            "every line runs on the cache the script opened: pass --{option} to `corral script` itself"
        )));
    }
    let cli =
        Cli::from_arg_matches(&matches).map_err(|e| Failure::new(code::USAGE, first_line(&e.to_string())))?;
    entry::run(cache, &cli.command, redis, entry::Printed::Line).await
}

/// Clap's report up to its usage line, on one line, without its own "error: " (a
/// missing argument is named on the line after the first).
fn first_line(text: &str) -> String {
    let said: Vec<&str> = text
        .lines()
        .take_while(|line| !line.is_empty() && !line.starts_with("Usage:"))
        .map(str::trim)
        .collect();
    let said = said.join(" ");
    said.strip_prefix("error: ").unwrap_or(&said).to_owned()
}
