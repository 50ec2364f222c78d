//! Landings over Redis pub/sub: announced on the channel `{prefix}landed` as
//! `"{origin} {key}"`, where `origin` names the announcing process's store, so that
//! waiters anywhere wake and other processes drop their L1 copy of the key.
//!
//! One subscription per store, opened on first need; when it drops, the next watch
//! subscribes again.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use tokio::sync::Mutex as AsyncMutex;

use super::redis::Connection;
use super::{ForeignHook, LandingWatch, Landings, Notifications};
use crate::{Error, Result};

/// The landing channel of one prefix on one Redis. Cheap to clone.
#[derive(Clone)]
pub(crate) struct RedisNotifications {
    conn: Connection,
    channel: Arc<str>,
    /// This store's name on the channel, so it can tell its own messages apart.
    origin: Arc<str>,
    landings: Landings,
    /// Whether this process listens on the channel yet.
    listening: Arc<AsyncMutex<bool>>,
    on_foreign: Arc<OnceLock<ForeignHook>>,
    commands: Arc<AtomicU64>,
}

impl fmt::Debug for RedisNotifications {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisNotifications")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl RedisNotifications {
    pub(crate) fn new(conn: Connection, channel: String, commands: Arc<AtomicU64>) -> Self {
        RedisNotifications {
            conn,
            channel: channel.into(),
            origin: crate::lock_token().into(),
            landings: Landings::default(),
            listening: Arc::new(AsyncMutex::new(false)),
            on_foreign: Arc::new(OnceLock::new()),
            commands,
        }
    }

    /// Subscribes once per store; the listener task feeds the local waiters. Returns
    /// false when Redis cannot be reached (callers then rely on their timers; the next
    /// watch tries again).
    async fn ensure_listening(&self) -> bool {
        let mut listening = self.listening.lock().await;
        if *listening {
            return true;
        }
        self.commands.fetch_add(1, Ordering::Relaxed);
        let subscribed = async {
            let mut pubsub = self.conn.client.get_async_pubsub().await?;
            pubsub.subscribe(&*self.channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(pubsub) => {
                let this = self.clone();
                tokio::spawn(async move {
                    let mut messages = pubsub.into_on_message();
                    while let Some(msg) = messages.next().await {
                        // "{origin} {key}": the key may hold spaces, the origin never does.
                        let Ok(payload) = msg.get_payload::<String>() else {
                            continue;
                        };
                        let Some((from, key)) = payload.split_once(' ') else {
                            continue;
                        };
                        this.landings.announce(key);
                        if from != &*this.origin
                            && let Some(hook) = this.on_foreign.get()
                        {
                            hook(key.to_owned());
                        }
                    }
                    // The connection dropped: subscribe again on the next watch.
                    *this.listening.lock().await = false;
                });
                *listening = true;
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "landing channel unavailable; waiters fall back to timers");
                false
            }
        }
    }
}

impl Notifications for RedisNotifications {
    fn watch<'a>(&'a self, key: &'a str) -> BoxFuture<'a, LandingWatch> {
        async move {
            if self.ensure_listening().await {
                self.landings.watch(key)
            } else {
                LandingWatch::never()
            }
        }
        .boxed()
    }

    fn announce<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<()>> {
        async move {
            self.commands.fetch_add(1, Ordering::Relaxed);
            let mut conn = self.conn.manager.clone();
            redis::cmd("PUBLISH")
                .arg(&*self.channel)
                .arg(format!("{} {key}", self.origin))
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| Error::unavailable("redis PUBLISH failed", e))
        }
        .boxed()
    }

    fn on_foreign(&self, hook: ForeignHook) {
        let _ = self.on_foreign.set(hook);
        let this = self.clone();
        tokio::spawn(async move {
            this.ensure_listening().await;
        });
    }
}
