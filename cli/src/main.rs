//! `corral`: the command-line face of the cache.
//!
//! `corral demo` runs the main job on the embedded default (no Redis needed). The
//! entry commands (`set`, `get`, `refresh`, `remove`, `inspect`) work on the embedded
//! default or, with `--redis URL`, on a shared Redis; `corral script` runs one command
//! per line of standard input against one cache, which is how the embedded default
//! (which lives only as long as the process) is used from a shell.

use std::io::BufRead;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

mod lock;
mod stampede;
use comfy_table::Table;
use corral::{Clock, Corral, EntryOptions, Error, ErrorKind, ManualClock};

#[derive(Debug, Parser)]
#[command(
    name = "corral",
    version,
    about = "Corral: a tiered cache and lock that stops cache stampedes"
)]
struct Cli {
    /// Use Redis at this URL as L2 (default: the embedded in-memory L2). `lock` takes it
    /// several times for Redlock.
    #[arg(long, global = true, env = "CORRAL_REDIS", value_name = "URL")]
    redis: Vec<String>,
    /// Store every key under this prefix in Redis.
    #[arg(long, global = true, default_value = "corral:")]
    prefix: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
    /// Print the value under KEY.
    Get { key: String },
    /// Refresh KEY as a read would (moves a sliding expiry).
    Refresh { key: String },
    /// Remove KEY.
    Remove { key: String },
    /// Decode the entry under KEY and show its metadata.
    Inspect { key: String },
    /// Run one command per line of standard input (e.g. `set k v --sliding 5m`) on one cache.
    Script,
    /// Fire N concurrent get-or-set calls at one cold key; report loads, latency, commands.
    ///
    /// Run several at once against one Redis to try a multi-process stampede.
    Stampede {
        /// Concurrent callers.
        #[arg(long, default_value_t = 1000)]
        callers: usize,
        /// How long the loader takes, in ms.
        #[arg(long, default_value_t = 500)]
        loader_ms: u64,
        /// The key (default: a fresh one per run).
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
    },
    /// Run COMMAND only while holding the lock KEY: a distributed flock(1) for cron jobs.
    ///
    /// The fencing token is passed to COMMAND as CORRAL_FENCING_TOKEN. If the lock is
    /// lost, COMMAND gets SIGTERM, then SIGKILL after 5 s. Exits with COMMAND's status,
    /// or 75 when the lock could not be had within --wait, or 76 when it was lost.
    /// Several --redis URLs mean Redlock.
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
        /// The command and its arguments.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            if let Some(hint) = hint(&e) {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(exit_code(&e))
        }
    }
}

fn hint(e: &Error) -> Option<&'static str> {
    match e.kind() {
        ErrorKind::Unavailable => Some(
            "is redis-server running at that URL? Start one with `redis-server --port 6379`, \
             or drop --redis to use the embedded in-memory store",
        ),
        ErrorKind::InvalidArgument => Some("see `corral --help` for what each argument takes"),
        ErrorKind::Corrupt => Some(
            "the bytes under this key were not written by this Corral version; \
             `corral remove KEY` deletes them, and a `get` treats them as a miss",
        ),
        ErrorKind::Guest => {
            Some("the guest component failed: this is a bug, please report it with the command you ran")
        }
        _ => None,
    }
}

fn exit_code(e: &Error) -> u8 {
    match e.kind() {
        ErrorKind::InvalidArgument => 2,
        ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::Quorum => 3,
        _ => 1,
    }
}

fn build(cli: &Cli) -> corral::Result<Corral> {
    build_with(cli, |b| b)
}

fn build_with(
    cli: &Cli,
    configure: impl FnOnce(corral::CorralBuilder) -> corral::CorralBuilder,
) -> corral::Result<Corral> {
    let builder = configure(Corral::builder());
    if cli.redis.len() > 1 {
        return Err(Error::from(ErrorKind::InvalidArgument)
            .with_context("--redis may be given several times only for `lock` (Redlock)"));
    }
    let builder = match cli.redis.first() {
        Some(url) => {
            let mut options = corral::RedisOptions::new(url.clone());
            options.prefix = cli.prefix.clone();
            builder.redis_options(options)
        }
        None => builder,
    };
    builder.build()
}

async fn run(cli: Cli) -> corral::Result<ExitCode> {
    if let Command::Lock {
        key,
        ttl,
        watchdog,
        wait,
        command,
    } = &cli.command
    {
        let mut options = corral::locks::LockOptions::new().wait(*wait);
        options = match (ttl, watchdog) {
            (Some(ttl), _) => options.ttl(*ttl),
            (None, Some(w)) => options.watchdog(*w),
            (None, None) => options,
        };
        return lock::run(&cli.redis, &cli.prefix, key, options, command).await;
    }
    run_cache(cli).await.map(|()| ExitCode::SUCCESS)
}

async fn run_cache(cli: Cli) -> corral::Result<()> {
    match &cli.command {
        Command::Demo => demo().await,
        Command::Script => {
            let cache = build(&cli)?;
            for (n, line) in std::io::stdin().lock().lines().enumerate() {
                let line = line.map_err(|e| {
                    Error::from(ErrorKind::InvalidArgument)
                        .with_context(format!("reading line {}: {e}", n + 1))
                })?;
                let words: Vec<&str> = line.split_whitespace().collect();
                if words.is_empty() || words[0].starts_with('#') {
                    continue;
                }
                let parsed = match Cli::try_parse_from(std::iter::once("corral").chain(words.iter().copied()))
                {
                    Ok(parsed) => parsed,
                    Err(e) => {
                        eprintln!(
                            "line {}: {}",
                            n + 1,
                            e.to_string().lines().next().unwrap_or_default()
                        );
                        continue;
                    }
                };
                if let Err(e) = entry_command(&cache, &parsed.command).await {
                    println!("line {}: error: {e}", n + 1);
                }
            }
            Ok(())
        }
        Command::Stampede {
            callers,
            loader_ms,
            key,
            json,
            wait_for_go,
            lock_wait,
        } => {
            let cache = build_with(&cli, |b| b.lock_wait(*lock_wait))?;
            let key = key
                .clone()
                .unwrap_or_else(|| format!("stampede:{}", corral::SystemClock.now_ms()));
            if *wait_for_go {
                // Connect (and subscribe) before the barrier, so the start is even.
                cache.get(&format!("{key}:warmup")).await?;
                eprintln!("ready");
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).map_err(|e| {
                    Error::from(ErrorKind::InvalidArgument)
                        .with_context(format!("waiting for go on stdin: {e}"))
                })?;
            }
            let report =
                stampede::run(&cache, &key, *callers, Duration::from_millis(*loader_ms), !*json).await;
            if *json {
                println!("{}", report.json());
            } else {
                println!("{}", report.table());
            }
            Ok(())
        }
        command => entry_command(&build(&cli)?, command).await,
    }
}

async fn entry_command(cache: &Corral, command: &Command) -> corral::Result<()> {
    match command {
        Command::Set {
            key,
            value,
            relative,
            absolute_ms,
            sliding,
        } => {
            let mut options = EntryOptions::new();
            if let Some(d) = relative {
                options = options.relative(*d);
            }
            if let Some(at) = absolute_ms {
                options = options.absolute_at_ms(*at);
            }
            if let Some(d) = sliding {
                options = options.sliding(*d);
            }
            cache.set(key, value.clone().into_bytes(), options).await?;
            println!("stored {key}");
        }
        Command::Get { key } => match cache.get(key).await? {
            Some(v) => println!("{}", String::from_utf8_lossy(&v)),
            None => println!("(no entry)"),
        },
        Command::Refresh { key } => {
            let found = cache.refresh(key).await?;
            println!("{}", if found { "refreshed" } else { "(no entry)" });
        }
        Command::Remove { key } => {
            let found = cache.remove(key).await?;
            println!("{}", if found { "removed" } else { "(no entry)" });
        }
        Command::Inspect { key } => match cache.inspect(key).await? {
            Some(i) => println!("{}", inspection_table(cache, key, &i)),
            None => println!("(no entry)"),
        },
        Command::Demo | Command::Script | Command::Stampede { .. } | Command::Lock { .. } => {
            return Err(
                Error::from(ErrorKind::InvalidArgument).with_context("demo and script cannot be nested")
            );
        }
    }
    Ok(())
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
    table.add_row(["state", if i.fresh { "fresh" } else { "expired" }]);
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
    table
}

/// The contract in one screen, on the embedded default with a manual clock (so the
/// demo can skip ahead in time without waiting).
async fn demo() -> corral::Result<()> {
    println!("Corral demo, part 1: a stampede on the embedded default (in-memory L2).\n");
    let clock = ManualClock::starting_now();
    let cache = Corral::builder()
        .clock(clock.clone())
        .l1_ttl(Duration::from_secs(1))
        .build()?;
    let key = "report:2026-q3";
    let report = stampede::run(&cache, key, 1_000, Duration::from_millis(200), true).await;
    println!("{}\n", report.table());

    let mut tiers = Table::new();
    tiers
        .load_preset(comfy_table::presets::UTF8_BORDERS_ONLY)
        .set_header(["read", "served by", "took"]);
    for (label, skip) in [
        ("get_or_set right after", Duration::ZERO),
        (
            "get_or_set 2 s later (past the 1 s L1 TTL)",
            Duration::from_secs(2),
        ),
        ("get_or_set again", Duration::ZERO),
    ] {
        clock.advance(skip);
        let before = cache.metrics();
        let began = std::time::Instant::now();
        cache
            .get_or_set(key, EntryOptions::new(), || async {
                Ok::<_, Error>("loaded again?")
            })
            .await?;
        let took = began.elapsed();
        let after = cache.metrics();
        let tier = if after.l1_hits > before.l1_hits {
            "L1 (moka)"
        } else if after.l2_hits > before.l2_hits {
            "L2 (then L1 refilled)"
        } else {
            "the loader"
        };
        tiers.add_row([label.to_string(), tier.to_string(), format!("{took:.1?}")]);
    }
    println!("{tiers}\n");

    println!("Corral demo, part 2: the cache contract, with a manual clock we move by hand.\n");
    let clock = ManualClock::starting_now();
    let cache = Corral::builder()
        .clock(clock.clone())
        .default_sliding(Duration::from_secs(20 * 60))
        .build()?;
    let mut table = Table::new();
    table
        .load_preset(comfy_table::presets::UTF8_BORDERS_ONLY)
        .set_header(["t+", "operation", "result"]);
    let start = clock.now_ms();
    let mut row = |op: &str, result: String| {
        let t = humantime::format_duration(Duration::from_millis(clock.now_ms() - start)).to_string();
        table.add_row([
            if t.is_empty() { "0s".to_string() } else { t },
            op.to_string(),
            result,
        ]);
    };
    let show = |r: corral::Result<Option<bytes::Bytes>>| match r {
        Ok(Some(v)) => format!("hit: {}", String::from_utf8_lossy(&v)),
        Ok(None) => "miss".to_string(),
        Err(e) => format!("error: {e}"),
    };

    cache
        .set(
            "session",
            "s3cr3t",
            EntryOptions::new().sliding(Duration::from_secs(60)),
        )
        .await?;
    row("set session, sliding 1m", "stored".into());
    cache
        .set(
            "report",
            "q3",
            EntryOptions::new().relative(Duration::from_secs(90)),
        )
        .await?;
    row("set report, relative 90s", "stored".into());
    cache.set("plain", "x", EntryOptions::new()).await?;
    row("set plain, no options", "default sliding 20m".into());
    clock.advance(Duration::from_secs(45));
    row("get session", show(cache.get("session").await));
    clock.advance(Duration::from_secs(45));
    row(
        "get session (read at 45s slid it)",
        show(cache.get("session").await),
    );
    row(
        "get report (relative never slides)",
        show(cache.get("report").await),
    );
    clock.advance(Duration::from_secs(61));
    row("get session (idle 61s)", show(cache.get("session").await));
    row("get plain", show(cache.get("plain").await));
    row("get \"   \"", show(cache.get("   ").await));
    let both = EntryOptions::new()
        .relative(Duration::from_secs(1))
        .absolute_at_ms(clock.now_ms() + 5);
    row(
        "set with relative and absolute",
        match cache.set("k", "v", both).await {
            Ok(()) => "stored".into(),
            Err(e) => format!("error: {e}"),
        },
    );
    println!("{table}\n");

    let mut metrics = Table::new();
    metrics
        .load_preset(comfy_table::presets::UTF8_BORDERS_ONLY)
        .set_header(["metric", "count"]);
    for (name, value) in cache.metrics().fields() {
        if value > 0 {
            metrics.add_row([name.to_string(), value.to_string()]);
        }
    }
    println!("{metrics}");
    Ok(())
}
