//! The body a simulated process runs: the native [`Corral`], or the component's own
//! `cache` export in wasmtime ([`PortableCache`], in lockstep with its caller's task).
//! Both get the same workload; a loader is written once, as a plan, and run the way
//! each body calls loaders (an async closure, or a blocking one whose waits run on the
//! caller's runtime).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use corral::portable::PortableCache;
use corral::{Corral, EntryOptions, LoadOptions};

/// One process's cache.
#[derive(Clone, Debug)]
pub(crate) enum Body {
    Native(Corral),
    Portable(PortableCache),
}

/// How a loader ends, once its wait is over: its value, or its error (or a panic).
pub(crate) type Finish = Box<dyn FnOnce() -> Result<Bytes, String> + Send>;

/// A loader's wait.
pub(crate) type Wait = Arc<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// A loader, as both bodies can run it: `start` is called when it begins (it returns
/// what it will produce, or an error or a panic after its wait), `wait` is its time.
pub(crate) struct Load {
    pub(crate) wait: Wait,
    pub(crate) start: Box<dyn FnOnce() -> Finish + Send>,
}

/// A batch loader, as both bodies can run it: the keys asked for, and after its wait,
/// a value per key it found (or its error, or a panic).
pub(crate) type BatchLoad = Arc<
    dyn Fn(Vec<String>) -> futures::future::BoxFuture<'static, Result<Vec<(String, Bytes)>, String>>
        + Send
        + Sync,
>;

/// A [`Load`] as the native body calls loaders: an async closure that may outlive its
/// call (`fetch`).
fn native_loader(
    load: Load,
) -> impl FnOnce() -> futures::future::BoxFuture<'static, Result<Bytes, std::io::Error>> + Send + 'static {
    move || {
        Box::pin(async move {
            let finish = (load.start)();
            (load.wait)().await;
            finish().map_err(std::io::Error::other)
        })
    }
}

impl Body {
    pub(crate) async fn get(&self, key: &str) -> corral::Result<Option<Bytes>> {
        match self {
            Body::Native(c) => c.get(key).await,
            Body::Portable(c) => c.get(key).await,
        }
    }

    pub(crate) async fn set_tagged(
        &self,
        key: &str,
        value: String,
        options: EntryOptions,
        tags: &[String],
    ) -> corral::Result<()> {
        match self {
            Body::Native(c) => c.set_tagged(key, value, options, tags).await,
            Body::Portable(c) => c.set_tagged(key, value.into_bytes(), options, tags).await,
        }
    }

    pub(crate) async fn remove_by_tag(&self, tag: &str) -> corral::Result<()> {
        match self {
            Body::Native(c) => c.remove_by_tag(tag).await,
            Body::Portable(c) => c.remove_by_tag(tag).await,
        }
    }

    pub(crate) async fn clear(&self) -> corral::Result<()> {
        match self {
            Body::Native(c) => c.clear().await,
            Body::Portable(c) => c.clear().await,
        }
    }

    pub(crate) async fn remove(&self, key: &str) -> corral::Result<bool> {
        match self {
            Body::Native(c) => c.remove(key).await,
            Body::Portable(c) => c.remove(key).await,
        }
    }

    /// Soft invalidation (contract §7.4): the workload's entries have no stale window,
    /// so it is a removal.
    pub(crate) async fn expire(&self, key: &str) -> corral::Result<bool> {
        match self {
            Body::Native(c) => c.expire(key).await,
            Body::Portable(c) => c.expire(key).await,
        }
    }

    pub(crate) async fn get_or_set(
        &self,
        key: &str,
        entry: EntryOptions,
        tags: &[String],
        load: Load,
    ) -> corral::Result<Bytes> {
        let options = LoadOptions::new().entry(entry).tags(tags.iter().cloned());
        match self {
            Body::Native(c) => {
                let loader = native_loader(load);
                c.get_or_set(key, options, loader).await
            }
            Body::Portable(c) => {
                let mut load = Some(load);
                let loader = move |_: &str| -> Result<Vec<u8>, String> {
                    let Some(load) = load.take() else {
                        return Err("sim: a second load".into());
                    };
                    let finish = (load.start)();
                    // The wait runs on the caller's (paused) runtime.
                    corral::portable::in_caller((load.wait)());
                    finish().map(|b| b.to_vec())
                };
                c.get_or_set(key, options, loader).await
            }
        }
    }

    /// A get-or-set of many keys: each body's `get_or_set_many` (the portable body's
    /// runs in the component, `begin-many`).
    pub(crate) async fn get_or_set_many(
        &self,
        keys: &[String],
        entry: EntryOptions,
        asks: crate::run::BatchAsks,
        load: BatchLoad,
    ) -> corral::Result<Vec<corral::Result<Option<Bytes>>>> {
        let mut options = LoadOptions::new().entry(entry);
        if let Some(max) = asks.max_batch {
            options = options.max_batch(max);
        }
        match self {
            Body::Native(c) => {
                if let Some(ms) = asks.hard_ms {
                    options = options.hard_timeout(std::time::Duration::from_millis(ms));
                }
                let loader = |asked: Vec<String>| {
                    let running = load(asked);
                    async move { running.await.map_err(std::io::Error::other) }
                };
                c.get_or_set_many(keys, options, loader).await
            }
            Body::Portable(c) => {
                let loader = move |asked: &[String]| -> Result<Vec<(String, Vec<u8>)>, String> {
                    // The wait runs on the caller's (paused) runtime; a panic is the
                    // loader's, here, as in the native body.
                    let running = std::panic::AssertUnwindSafe(load(asked.to_vec()));
                    let found = corral::portable::in_caller(futures::FutureExt::catch_unwind(running))
                        .ok_or_else(|| "sim: the caller went away".to_owned())?
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
                    Ok(found.into_iter().map(|(k, v)| (k, v.to_vec())).collect())
                };
                c.get_or_set_many(keys, options, loader).await
            }
        }
    }

    /// Whether this is the native body.
    pub(crate) fn is_native(&self) -> bool {
        matches!(self, Body::Native(_))
    }

    /// A get-or-set with timeouts or eager refresh: the native body's `fetch` (its
    /// loader may run on after the call; `stale` is told whether the value served is a
    /// stale copy); the portable body, whose timeouts and eager refresh are its cache's
    /// settings (not a call's options) and which has no `fetch`, runs a plain get-or-set.
    pub(crate) async fn fetch(
        &self,
        key: &str,
        entry: EntryOptions,
        options: LoadOptions,
        load: Load,
        stale: &parking_lot::Mutex<Option<bool>>,
    ) -> corral::Result<Bytes> {
        match self {
            Body::Native(c) => {
                let loader = native_loader(load);
                let served = c.fetch_served(key, options, loader).await?;
                *stale.lock() = Some(served.stale);
                Ok(served.value)
            }
            Body::Portable(_) => self.get_or_set(key, entry, &[], load).await,
        }
    }

    /// The raw bytes under a store name.
    pub(crate) async fn raw(&self, name: &str) -> Option<Bytes> {
        match self {
            Body::Native(c) => c.entries().get(name).await.ok().flatten(),
            Body::Portable(c) => c.entries().get(name).await.ok().flatten(),
        }
    }

    pub(crate) fn flights_in_progress(&self) -> usize {
        match self {
            Body::Native(c) => c.flights_in_progress(),
            Body::Portable(c) => c.flights_in_progress(),
        }
    }

    /// Takes the process's table lock of `key` for `owner`, if free, with its fencing
    /// token (the native body's `MemoryLocks` through `Corral::locks()`, the portable
    /// body's `lock` export).
    pub(crate) async fn acquire(&self, key: &str, owner: &str, ttl: Duration) -> corral::Result<Option<u64>> {
        match self {
            Body::Native(c) => c.locks().table().acquire(key, owner, ttl),
            Body::Portable(c) => c.acquire(key, owner, ttl).await,
        }
    }

    /// Releases the table lock of `key` if `owner` holds it.
    pub(crate) async fn unlock(&self, key: &str, owner: &str) -> corral::Result<bool> {
        match self {
            Body::Native(c) => c.locks().table().unlock(key, owner),
            Body::Portable(c) => c.unlock(key, owner).await,
        }
    }

    /// Whether `owner` holds the table lock of `key`.
    pub(crate) async fn is_locked_by(&self, key: &str, owner: &str) -> corral::Result<bool> {
        match self {
            Body::Native(c) => c.locks().table().is_locked_by(key, owner),
            Body::Portable(c) => c.is_locked_by(key, owner).await,
        }
    }

    /// Entries in the process's lock table, lapsed ones included until swept.
    pub(crate) fn table_len(&self) -> usize {
        match self {
            Body::Native(c) => c.locks().table().len(),
            Body::Portable(c) => c.locks_held(),
        }
    }

    /// Degraded loads the body counted (the portable body keeps no metrics).
    pub(crate) fn degraded(&self) -> u64 {
        match self {
            Body::Native(c) => c.metrics().degraded,
            Body::Portable(_) => 0,
        }
    }
}

/// How long a loader waits: its time, then its process's gate (a paused process's
/// loader returns when it resumes).
pub(crate) fn wait_for(
    world: Arc<crate::world::World>,
    proc: usize,
    ms: u64,
) -> impl Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync {
    move || {
        let w = world.clone();
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            w.gate(proc).await;
        })
    }
}
