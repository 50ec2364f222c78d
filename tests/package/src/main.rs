//! A service's first use of Corral, built from the packaged crate.
use std::time::Duration;

#[tokio::main]
async fn main() -> corral::Result<()> {
    let cache = corral::Corral::builder().build()?;
    let value = cache
        .get_or_set(
            "greeting",
            corral::EntryOptions::new().relative(Duration::from_secs(60)),
            || async { Ok::<_, std::io::Error>("hello from the packaged crate") },
        )
        .await?;
    println!("{}", String::from_utf8_lossy(&value));
    cache.close(Duration::from_secs(1)).await?;
    Ok(())
}
