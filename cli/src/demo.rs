//! `corral demo`: the main job and the cache contract in one screen, on the embedded
//! default (no Redis needed), with a manual clock so that it can skip ahead in time.

use std::time::Duration;

use comfy_table::Table;
use corral::{Clock, Corral, EntryOptions, Error, ManualClock};

use crate::failure::Failure;
use crate::output::out;
use crate::stampede;

/// The contract in one screen, on the embedded default with a manual clock (so the
/// demo can skip ahead in time without waiting).
pub async fn run() -> Result<(), Failure> {
    out!("Corral demo, part 1: a stampede on the embedded default (in-memory L2).\n")?;
    let clock = ManualClock::starting_now();
    let cache = Corral::builder()
        .clock(clock.clone())
        .l1_ttl(Duration::from_secs(1))
        .build()?;
    let key = "report:2026-q3";
    let report = stampede::run(&cache, key, 1_000, Duration::from_millis(200), None, true).await;
    out!("{}\n", report.table())?;

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
    out!("{tiers}\n")?;

    out!("Corral demo, part 2: the cache contract, with a manual clock we move by hand.\n")?;
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
    out!("{table}\n")?;

    let mut metrics = Table::new();
    metrics
        .load_preset(comfy_table::presets::UTF8_BORDERS_ONLY)
        .set_header(["metric", "count"]);
    for (name, value) in cache.metrics().fields() {
        if value > 0 {
            metrics.add_row([name.to_string(), value.to_string()]);
        }
    }
    out!("{metrics}")?;
    Ok(())
}
