//! One process of `freshness::eager_refresh_runs_once_across_four_processes`: a cache on
//! the Redis at `argv[1]` under the prefix `argv[2]`, its clock standing at `argv[3]`
//! (Unix ms). It says `ready` on stderr once connected, waits for `go` on stdin, fetches
//! `k` (relative 60 s, eager refresh at half of it) with a loader that takes 300 ms and
//! returns `v2`, waits for its background work to end, and prints one JSON object:
//! what the fetch returned, how many loads this process ran, and its refresh count.

use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use corral::{Corral, LoadOptions, ManualClock, RedisOptions};

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, prefix, now] = args.as_slice() else {
        anyhow::bail!("usage: refresh_probe <redis-url> <prefix> <now-ms>");
    };
    let mut options = RedisOptions::new(url.as_str());
    options.prefix = prefix.clone();
    let clock = ManualClock::new(now.parse().context("now-ms")?);
    let cache = Corral::builder().clock(clock).redis_options(options).build()?;
    cache.get("warm-up").await?;
    eprintln!("ready");
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    anyhow::ensure!(line.trim() == "go", "expected go, got {line:?}");
    let loads = Arc::new(AtomicUsize::new(0));
    let counter = loads.clone();
    let returned = cache
        .fetch(
            "k",
            LoadOptions::relative(Duration::from_secs(60)).eager_refresh(0.5),
            move || async move {
                counter.fetch_add(1, Ordering::SeqCst);
                // A slow source: the four processes' refreshes overlap.
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, std::io::Error>("v2")
            },
        )
        .await?;
    while cache.flights_in_progress() + cache.background_in_progress() > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!(
        "{}",
        serde_json::json!({
            "returned": String::from_utf8_lossy(&returned),
            "loads": loads.load(Ordering::SeqCst),
            "refreshes": cache.metrics().refreshes,
        })
    );
    Ok(())
}
