//! `corral`: the command-line face of the cache, and a distributed flock(1).
//!
//! This file owns the command line (what `corral` accepts) and sends each command to
//! its module: `demo`, the entry commands (`set`, `get`, `refresh`, `remove`,
//! `inspect`, in [`entry`]), `script`, `stampede` and `lock`. Every way out is an exit
//! status from [`failure`]; every word on stderr goes through [`redact`].

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use corral::Corral;

mod demo;
mod entry;
mod failure;
mod group;
mod link;
mod lock;
mod output;
mod probe;
mod redact;
mod script;
mod signals;
mod stampede;

use failure::{Failure, code};
use output::say;
use redact::RedisUrl;

#[derive(Debug, Parser)]
#[command(
    name = "corral",
    version,
    about = "Corral: a tiered cache and lock that stops cache stampedes"
)]
pub struct Cli {
    /// Use Redis at this URL as L2 (default: the embedded in-memory L2). `lock` takes it
    /// several times for Redlock.
    #[arg(
        long,
        global = true,
        env = "CORRAL_REDIS",
        hide_env_values = true,
        value_name = "URL",
        value_parser = RedisUrl::parse
    )]
    redis: Vec<RedisUrl>,
    /// Use the Redis Cluster that has this node as L2 (and for `lock`); give it several
    /// times to name more seed nodes. Any reachable node will do. Takes precedence over
    /// --redis (and CORRAL_REDIS).
    #[arg(
        long,
        global = true,
        env = "CORRAL_REDIS_CLUSTER",
        hide_env_values = true,
        value_name = "URL",
        value_parser = RedisUrl::parse
    )]
    redis_cluster: Vec<RedisUrl>,
    /// Store every key under this prefix in Redis.
    #[arg(long, global = true, default_value = corral::DEFAULT_PREFIX)]
    prefix: String,
    /// How long connecting to Redis may take, the handshake's round trip included
    /// (default 500ms): raise it for a link whose round trip is long.
    #[arg(long, global = true, value_parser = link::timeout, value_name = "DURATION")]
    connect_timeout: Option<Duration>,
    /// How long one Redis command may take (default 1s).
    #[arg(long, global = true, value_parser = link::timeout, value_name = "DURATION")]
    response_timeout: Option<Duration>,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The timeouts of every connection to Redis.
    fn link(&self) -> link::Link {
        link::Link::new(self.connect_timeout, self.response_timeout)
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Walk through the cache contract on the embedded default and print what happened.
    Demo,
    /// Store VALUE under KEY.
    Set {
        key: String,
        value: String,
        /// Expire this long after the set (e.g. 30s, 5m).
        #[arg(long, value_parser = humantime::parse_duration)]
        relative: Option<Duration>,
        /// Expire at this Unix time, in milliseconds.
        #[arg(long, value_name = "UNIX_MS")]
        absolute_ms: Option<u64>,
        /// Expire this long after the last read or refresh (e.g. 20m).
        #[arg(long, value_parser = humantime::parse_duration)]
        sliding: Option<Duration>,
    },
    /// Write the value under KEY on stdout, its bytes exactly as stored.
    ///
    /// A terminal gets a newline after it, and control characters or bytes that are not
    /// UTF-8 escaped (`\u{1b}`, `\xff`); a pipe or a file gets the bytes alone. A miss writes
    /// nothing on stdout, says "(no entry)" on stderr and exits 0.
    Get { key: String },
    /// Refresh KEY as a read would (moves a sliding expiry).
    Refresh { key: String },
    /// Remove KEY.
    Remove { key: String },
    /// Decode the entry under KEY and show its metadata.
    Inspect { key: String },
    /// Run one command per line of standard input (e.g. `set k v --sliding 5m`) on one cache.
    ///
    /// A line is split into words as a POSIX shell splits them: quote a key or value that
    /// holds white space, quotes, a backslash or a leading `#` (`set k '{"a": 1}'`); a
    /// line or word starting with `#` is a comment. A value read by `get` is written with
    /// a newline after it; a miss as "(no entry)".
    Script,
    /// Fire N concurrent get-or-set calls at one cold key; report loads, latency, commands.
    ///
    /// Run several at once against one Redis to try a multi-process stampede.
    Stampede {
        /// Concurrent callers (1 to 100,000).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        callers: u32,
        /// How long the loader takes, in ms (at most an hour).
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
        loader_ms: u64,
        /// The key (default: a fresh one, shared by the runs against the same store that
        /// start while this one runs: start several at once for a multi-process stampede).
        #[arg(long)]
        key: Option<String>,
        /// Print exactly one JSON object on stdout instead of tables.
        #[arg(long)]
        json: bool,
        /// Print "ready" on stderr once connected, then wait for a line on stdin (a barrier
        /// for several processes).
        #[arg(long)]
        wait_for_go: bool,
        /// How long to wait for another process's load before loading uncached.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
        lock_wait: Duration,
        /// Bulk calls over this many keys (KEY:0 .. KEY:<N-1>, 1 to 1,000,000): each
        /// caller asks for a random --batch of them through one get_or_set_many.
        #[arg(long, requires = "batch", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        keys: Option<u32>,
        /// How many of the --keys each caller asks for (1 to 10,000).
        #[arg(long, requires = "keys", value_parser = clap::value_parser!(u32).range(1..=10_000))]
        batch: Option<u32>,
    },
    /// Run COMMAND only while holding the lock KEY: a distributed flock(1) for cron jobs.
    ///
    /// COMMAND runs in a process group of its own, with the fencing token in
    /// CORRAL_FENCING_TOKEN. It is done, and the lock released, when none of its
    /// processes is left: on Linux that includes those it moved out of its group (setsid,
    /// double forks), not work it had started outside its process tree (systemd-run, at,
    /// a daemon, ssh). SIGINT, SIGTERM and SIGHUP are passed on to all its processes (with
    /// SIGCONT, for a stopped one); if the lock is lost they get SIGTERM; either way
    /// SIGKILL follows after --grace.
    /// The lock is released before `corral` exits. Exits with COMMAND's status, or 128 +
    /// the signal received, 75 when another owner held the lock past --wait, 76 when it
    /// was lost, 69 when Redis could not be used, 65 when the lock's names hold what is
    /// not a Corral lock, 64 for a bad argument, 126/127 when COMMAND could not be
    /// started. Several --redis URLs mean Redlock.
    Lock {
        /// The lock's key.
        #[arg(long)]
        key: String,
        /// Hold the lock for exactly this long (else a watchdog renews it while COMMAND runs).
        #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "watchdog")]
        ttl: Option<Duration>,
        /// Renew the lock while COMMAND runs (the default), with this Redis TTL.
        #[arg(long, value_parser = humantime::parse_duration, default_missing_value = "30s", num_args = 0..=1)]
        watchdog: Option<Duration>,
        /// How long to wait for the lock.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
        wait: Duration,
        /// Wait in line: first come, first served across every process waiting for KEY
        /// with --fair (a queue in Redis).
        #[arg(long)]
        fair: bool,
        /// How long COMMAND's processes may take to stop after a signal, before SIGKILL
        /// (at most 24h).
        #[arg(long, value_parser = group::grace, default_value = "5s")]
        grace: Duration,
        /// The command and its arguments.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    output::init_logging();
    if let Some(failure) = not_utf8() {
        return failure.report();
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage(&e),
    };
    tracing::debug!(?cli, "command line");
    match run(cli).await {
        Ok(code) => code,
        Err(failure) => failure.report(),
    }
}

/// The first argument that is not UTF-8, named by its place (keys, values and URLs are
/// text): clap would only say that one of them is not.
fn not_utf8() -> Option<Failure> {
    // Named by its place only: the bytes may be a URL's password.
    let place = std::env::args_os()
        .skip(1)
        .position(|arg| arg.to_str().is_none())?;
    Some(Failure::new(
        code::USAGE,
        format!(
            "argument {} is not UTF-8: keys, values and URLs are text",
            place + 1
        ),
    ))
}

/// Clap's report on the command line (help, version, or what is wrong with it), redacted:
/// what is wrong exits with EX_USAGE (clap's own status is 2).
fn usage(e: &clap::Error) -> ExitCode {
    let text = e.render().to_string();
    if e.use_stderr() {
        say!("{}", text.trim_end());
        ExitCode::from(code::USAGE)
    } else {
        // Help and version: on stdout, like clap would; a closed stdout is no matter.
        let _ = output::line(format_args!("{}", redact::redact(text.trim_end())));
        ExitCode::SUCCESS
    }
}

async fn run(cli: Cli) -> Result<ExitCode, Failure> {
    match &cli.command {
        Command::Lock {
            key,
            ttl,
            watchdog,
            wait,
            fair,
            grace,
            command,
        } => {
            let request = lock::Request {
                urls: if cli.redis_cluster.is_empty() {
                    &cli.redis
                } else {
                    &[]
                },
                cluster: &cli.redis_cluster,
                prefix: &cli.prefix,
                link: cli.link(),
                key,
                ttl: *ttl,
                watchdog: *watchdog,
                wait: *wait,
                fair: *fair,
                grace: *grace,
                command,
            };
            lock::run(request).await
        }
        Command::Demo => demo::run().await.map(|()| ExitCode::SUCCESS),
        _ => run_cache(&cli).await,
    }
}

/// The commands that work on a cache: the embedded one, or one on `--redis`.
async fn run_cache(cli: &Cli) -> Result<ExitCode, Failure> {
    let standalone = if cli.redis_cluster.is_empty() {
        cli.redis.as_slice()
    } else {
        &[]
    };
    let redis = match standalone {
        [] => None,
        [url] => Some(url),
        _ => {
            return Err(Failure::new(
                code::USAGE,
                "--redis may be given several times only for `lock` (Redlock)",
            ));
        }
    };
    let builder = match &cli.command {
        Command::Stampede { lock_wait, .. } => Corral::builder().lock_wait(*lock_wait),
        _ => Corral::builder(),
    };
    let link = cli.link();
    let builder = match (redis, cli.redis_cluster.as_slice()) {
        (Some(url), _) => builder.redis_options(link.server(url, &cli.prefix)),
        (None, []) => builder,
        (None, nodes) => builder.redis_options(link.cluster(nodes, &cli.prefix)),
    };
    // A cluster's failures name its first seed node.
    let redis = redis.or(cli.redis_cluster.first());
    let cache = builder.build().map_err(|e| Failure::from_error(&e, redis))?;
    // Said before the wait for what the command left owed.
    let code = match run_on(&cache, cli, redis).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => failure.report(),
    };
    close(&cache, link.owed_within()).await;
    Ok(code)
}

/// Lets what the command left under way (an announcement or a removal retried, a lock
/// release) end before `corral` exits, for at most `within` (see [`Corral::close`]):
/// the bound `corral lock` gives its releases.
async fn close(cache: &Corral, within: Duration) {
    if cache.close(within).await.is_err() {
        say!(
            "corral: warning: a change owed to the store (a removal, an announcement or a release, retried) was not made within {within:?}; what it would have changed stays until its TTL"
        );
    }
}

/// Runs a cache command on `cache`, which is on `redis` (`None`: the embedded store).
async fn run_on(cache: &Corral, cli: &Cli, redis: Option<&RedisUrl>) -> Result<(), Failure> {
    match &cli.command {
        Command::Script => script::run(cache, redis).await,
        Command::Stampede {
            callers,
            loader_ms,
            key,
            json,
            wait_for_go,
            lock_wait: _,
            keys,
            batch,
        } => {
            let count = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
            let bulk = match (keys, batch) {
                (Some(keys), Some(batch)) => {
                    Some(stampede::Bulk::new(count(*keys), count(*batch), count(*callers))?)
                }
                _ => None,
            };
            let request = stampede::Request {
                bulk,
                callers: count(*callers),
                loader: Duration::from_millis(*loader_ms),
                key: key.clone(),
                json: *json,
                wait_for_go: *wait_for_go,
            };
            stampede::command(cache, request, redis).await
        }
        command => entry::run(cache, command, redis, entry::Printed::Alone).await,
    }
}
