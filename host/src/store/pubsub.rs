//! Landings over Redis pub/sub: announced on the prefix's channel (named by the guest,
//! contract §2.4) as `"{origin} {key}"`, where `origin` names the announcing process's
//! store, so that waiters anywhere wake and other processes drop their L1 copy.
//!
//! The subscription is kept by a background task of its own, never by a caller
//! (contract §5.13): every step (connect, `SUBSCRIBE`, the health `PING`) has a
//! deadline; a dropped, refused or silently dead connection (a `PING` unanswered within
//! the response timeout) is replaced, with backoff, and every (re)subscription tells
//! the cache to drop its whole L1, since it cannot know what it missed. A watch never
//! waits for the subscription: without one it never fires and the caller's timer is
//! the fallback.
//!
//! On a Redis Cluster the channel is classic pub/sub, which the cluster broadcasts to
//! every node, so the subscription may sit on any node: it starts on the first seed node
//! and, when that node fails, moves to the next that answers.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};

use arc_swap::ArcSwap;

use super::link::{Link, Subscribers, cluster_nodes, pubsub_on};
use super::redis_options::RedisOptions;
use super::{ForeignHook, InvalidationHook, LandingWatch, Landings, Notifications};
use crate::{Error, Result};

/// How often an idle subscription is checked with a `PING`.
const HEALTH_EVERY: Duration = Duration::from_secs(1);

/// The landing channel of one prefix on one Redis. Cheap to clone.
#[derive(Clone)]
pub(crate) struct RedisNotifications {
    shared: Arc<Shared>,
}

struct Shared {
    /// For the subscription's own connection: the server, or each seed node of a cluster.
    subscribers: Subscribers,
    /// How long to wait before subscribing again after a failure (the guest's schedule).
    retry: super::Retry,
    /// Which of `clients` to try first: the one that last answered.
    current: std::sync::atomic::AtomicUsize,
    /// The store's command link (announcements go there; replaced when it hangs).
    commands_conn: Arc<ArcSwap<Link>>,
    channel: String,
    /// The prefix's tag and clear channel (contract §7.5), on the same subscription.
    invalidations: String,
    /// This store's name on the channel, so it can tell its own messages apart.
    origin: String,
    landings: Landings,
    /// Whether a subscription is live now.
    live: AtomicBool,
    /// Set once the first subscription attempt ended, either way.
    first_attempt: FirstAttempt,
    on_foreign: OnceLock<ForeignHook>,
    on_invalidation: OnceLock<InvalidationHook>,
    commands: Arc<AtomicU64>,
    connect_timeout: Duration,
    response_timeout: Duration,
}

impl fmt::Debug for RedisNotifications {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisNotifications")
            .field("channel", &self.shared.channel)
            .field("live", &self.shared.live.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl RedisNotifications {
    /// Starts keeping a subscription to `channel` (in the background, on the caller's
    /// Tokio runtime, until the last clone is dropped).
    pub(crate) fn new(
        subscribers: Subscribers,
        commands_conn: Arc<ArcSwap<Link>>,
        options: &RedisOptions,
        channel: String,
        invalidations: String,
        commands: Arc<AtomicU64>,
        retry: super::Retry,
    ) -> Self {
        let shared = Arc::new(Shared {
            subscribers,
            retry,
            current: std::sync::atomic::AtomicUsize::new(0),
            commands_conn,
            channel,
            invalidations,
            origin: crate::lock_token(),
            landings: Landings::default(),
            live: AtomicBool::new(false),
            first_attempt: FirstAttempt::default(),
            on_foreign: OnceLock::new(),
            on_invalidation: OnceLock::new(),
            commands,
            connect_timeout: options.connect_timeout,
            response_timeout: options.response_timeout,
        });
        tokio::spawn(keep_subscribed(Arc::downgrade(&shared)));
        RedisNotifications { shared }
    }
}

/// Subscribes, listens until the connection fails, and again, for as long as the
/// notifications live.
async fn keep_subscribed(weak: Weak<Shared>) {
    let Some(retry) = weak.upgrade().map(|shared| shared.retry) else {
        return;
    };
    let mut backoff = retry.first;
    loop {
        let Some(shared) = weak.upgrade() else { return };
        match subscribe(&shared).await {
            Ok(subscription) => {
                backoff = retry.first;
                shared.live.store(true, Ordering::SeqCst);
                shared.first_attempt.end();
                std::sync::atomic::fence(Ordering::SeqCst);
                // Whatever was announced while unsubscribed is unknown: drop all of L1.
                if let Some(hook) = shared.on_foreign.get() {
                    hook(None);
                }
                drop(shared);
                listen(&weak, subscription).await;
                let Some(shared) = weak.upgrade() else { return };
                shared.live.store(false, Ordering::SeqCst);
                // Its node may be gone (a cluster has others): try it last.
                shared.current.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(channel = %shared.channel, "landing channel lost; subscribing again");
            }
            Err(e) => {
                shared.first_attempt.end();
                tracing::debug!(channel = %shared.channel, error = %e, "landing channel unavailable; waiters fall back to timers");
                drop(shared);
                tokio::time::sleep(backoff).await;
                backoff = retry.next(backoff);
            }
        }
    }
}

/// A live subscription: the `redis` crate's, or a wire's.
enum Subscription {
    Redis(redis::aio::PubSubSink, redis::aio::PubSubStream),
    #[cfg(feature = "test-util")]
    Wired(Box<dyn super::wire::WireSubscription>),
}

impl Subscription {
    /// The next message; `None` once the connection is gone.
    async fn next(&mut self) -> Option<redis::Msg> {
        match self {
            Subscription::Redis(_, stream) => stream.next().await,
            #[cfg(feature = "test-util")]
            Subscription::Wired(wired) => wired.next_message().await,
        }
    }

    /// A `PING` on the subscribed connection, holding no borrow of the subscription:
    /// messages are heard while it waits.
    fn ping(&self) -> futures::future::BoxFuture<'static, redis::RedisResult<()>> {
        match self {
            Subscription::Redis(sink, _) => {
                let mut sink = sink.clone();
                async move { sink.ping::<redis::Value>().await.map(drop) }.boxed()
            }
            #[cfg(feature = "test-util")]
            Subscription::Wired(wired) => wired.ping(),
        }
    }
}

fn timed_out(what: &str) -> Error {
    Error::new(crate::ErrorKind::Timeout, format!("redis {what} timed out"))
}

async fn subscribe(shared: &Shared) -> Result<Subscription> {
    shared.commands.fetch_add(1, Ordering::Relaxed);
    // (One way only without the test seam.)
    #[cfg_attr(not(feature = "test-util"), allow(clippy::infallible_destructuring_match))]
    let clients = match &shared.subscribers {
        Subscribers::Clients(clients) => clients,
        #[cfg(feature = "test-util")]
        Subscribers::Wired(wire) => return subscribe_wired(shared, wire.as_ref()).await,
    };
    let first = shared.current.load(Ordering::Relaxed);
    let mut pubsub = match pubsub_on(clients, first, shared.connect_timeout).await {
        Ok((at, pubsub)) => {
            shared.current.store(at, Ordering::Relaxed);
            pubsub
        }
        // No seed node answers: a cluster may have others (replicas promoted, nodes
        // added since the seeds were written down).
        Err(e) => {
            let link = Link::clone(&shared.commands_conn.load());
            let nodes = cluster_nodes(&link, shared.response_timeout).await;
            if nodes.is_empty() {
                return Err(e);
            }
            pubsub_on(&nodes, 0, shared.connect_timeout).await?.1
        }
    };
    // One channel per SUBSCRIBE: each gets its own confirmation.
    for channel in [&shared.channel, &shared.invalidations] {
        confirmed(shared, pubsub.subscribe(channel)).await?;
    }
    let (sink, stream) = pubsub.split();
    Ok(Subscription::Redis(sink, stream))
}

/// [`subscribe`] over a wire: the same steps, within the same deadlines.
#[cfg(feature = "test-util")]
async fn subscribe_wired(shared: &Shared, wire: &dyn super::wire::Wire) -> Result<Subscription> {
    let mut wired = tokio::time::timeout(shared.connect_timeout, wire.subscription())
        .await
        .map_err(|_| timed_out("pub/sub connect"))?
        .map_err(|e| Error::unavailable("redis pub/sub connect failed", e))?;
    for channel in [&shared.channel, &shared.invalidations] {
        confirmed(shared, wired.subscribe(channel)).await?;
    }
    Ok(Subscription::Wired(wired))
}

/// One `SUBSCRIBE`'s confirmation, within the response timeout.
async fn confirmed(shared: &Shared, subscribing: impl Future<Output = redis::RedisResult<()>>) -> Result<()> {
    tokio::time::timeout(shared.response_timeout, subscribing)
        .await
        .map_err(|_| timed_out("SUBSCRIBE"))?
        .map_err(|e| Error::unavailable("redis SUBSCRIBE failed", e))
}

/// Feeds the local waiters and the L1 hook until the stream ends or a health `PING`
/// goes unanswered within the response timeout. Messages that came while the ping
/// waited are heard before the subscription is given up: they were delivered, and a
/// process that dropped them unread would keep in L1 what they invalidated until it
/// subscribed again.
async fn listen(weak: &Weak<Shared>, mut subscription: Subscription) {
    let mut health = tokio::time::interval(HEALTH_EVERY);
    health.tick().await;
    // The health `PING` under way, if any: whether it was answered in time.
    let mut ping: Option<futures::future::BoxFuture<'static, bool>> = None;
    loop {
        let answered = async {
            match ping.as_mut() {
                Some(ping) => ping.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            // Messages first: a connection that delivers is alive. They are heard while
            // a ping waits for its answer.
            biased;
            msg = subscription.next() => {
                let Some(msg) = msg else { return };
                if !hear(weak, &msg) {
                    return;
                }
            }
            alive = answered => {
                ping = None;
                if alive {
                    continue;
                }
                while let Some(Some(msg)) = subscription.next().now_or_never() {
                    if !hear(weak, &msg) {
                        return;
                    }
                }
                return;
            }
            _ = health.tick() => {
                if ping.is_some() {
                    // (The last one is still within its response timeout.)
                    continue;
                }
                let Some(shared) = weak.upgrade() else { return };
                let (bound, sent) = (shared.response_timeout, subscription.ping());
                // Timed from when it is first polled (sent): a backlog of messages that
                // keeps it waiting to be sent does not count against it.
                ping = Some(async move { matches!(tokio::time::timeout(bound, sent).await, Ok(Ok(()))) }.boxed());
            }
        }
    }
}

/// Hands one message to the L1 hook and the local waiters; `false` once the
/// notifications are gone.
fn hear(weak: &Weak<Shared>, msg: &redis::Msg) -> bool {
    let Some(shared) = weak.upgrade() else {
        return false;
    };
    let Ok(payload) = msg.get_payload::<String>() else {
        return true;
    };
    if msg.get_channel_name() == shared.invalidations {
        if let Some(hook) = shared.on_invalidation.get() {
            hook(&payload);
        }
        return true;
    }
    // "{origin} {key}": the key may hold spaces, the origin never does.
    let Some((from, key)) = payload.split_once(' ') else {
        return true;
    };
    shared.landings.announce(key);
    if from != shared.origin
        && let Some(hook) = shared.on_foreign.get()
    {
        hook(Some(key.to_owned()));
    }
    true
}

/// Whether the first subscription attempt ended, and who waits for it. Its waiters wake
/// in the order they came (a `watch` channel wakes them in an order a random number
/// picks, which a deterministic simulation cannot replay).
#[derive(Default)]
struct FirstAttempt {
    ended: AtomicBool,
    waiters: tokio::sync::Notify,
}

impl FirstAttempt {
    fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
        self.waiters.notify_waiters();
    }

    async fn ended(&self) {
        let notified = self.waiters.notified();
        let mut notified = std::pin::pin!(notified);
        // Registered before the check: an `end` after it wakes this waiter.
        notified.as_mut().enable();
        if !self.ended.load(Ordering::SeqCst) {
            notified.await;
        }
    }
}

impl RedisNotifications {
    /// Waits for the first subscription attempt to end, within the connect and response
    /// timeouts: only a cache's first moments wait; later a missing subscription never
    /// holds a caller.
    async fn first_attempt(&self) {
        let shared = &self.shared;
        let bound = shared.connect_timeout + shared.response_timeout;
        let _ = tokio::time::timeout(bound, shared.first_attempt.ended()).await;
    }
}

impl Notifications for RedisNotifications {
    fn subscribed(&self) -> BoxFuture<'_, Option<bool>> {
        async move {
            self.first_attempt().await;
            Some(self.shared.live.load(Ordering::SeqCst))
        }
        .boxed()
    }

    fn watch<'a>(&'a self, key: &'a str) -> BoxFuture<'a, LandingWatch> {
        async move {
            let shared = &self.shared;
            self.first_attempt().await;
            if shared.live.load(Ordering::SeqCst) {
                shared.landings.watch(key)
            } else {
                LandingWatch::never()
            }
        }
        .boxed()
    }

    fn announce<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<()>> {
        async move {
            let shared = &self.shared;
            shared.commands.fetch_add(1, Ordering::Relaxed);
            let mut conn = Link::clone(&shared.commands_conn.load());
            redis::cmd("PUBLISH")
                .arg(&shared.channel)
                .arg(format!("{} {key}", shared.origin))
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| Error::unavailable("redis PUBLISH failed", e))
        }
        .boxed()
    }

    fn announcement(&self, key: &str) -> Option<(String, String)> {
        let shared = &self.shared;
        Some((shared.channel.clone(), format!("{} {key}", shared.origin)))
    }

    fn on_foreign(&self, hook: ForeignHook) {
        let shared = &self.shared;
        let set = shared.on_foreign.set(hook).is_ok();
        // Paired with the fence in `keep_subscribed`: of the hook's registration and the
        // subscription going live, whichever comes second sees the first.
        std::sync::atomic::fence(Ordering::SeqCst);
        if set && shared.live.load(Ordering::SeqCst) {
            // Subscribed before the hook was there: what was heard meanwhile went
            // nowhere, so the hook hears of a gap, as after any (re)subscription.
            if let Some(hook) = shared.on_foreign.get() {
                hook(None);
            }
        }
    }

    fn publish_invalidation<'a>(&'a self, text: &'a str) -> BoxFuture<'a, Result<()>> {
        async move {
            let shared = &self.shared;
            shared.commands.fetch_add(1, Ordering::Relaxed);
            let mut conn = Link::clone(&shared.commands_conn.load());
            redis::cmd("PUBLISH")
                .arg(&shared.invalidations)
                .arg(text)
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| Error::unavailable("redis PUBLISH failed", e))
        }
        .boxed()
    }

    fn on_invalidation(&self, hook: InvalidationHook) {
        let _ = self.shared.on_invalidation.set(hook);
    }
}
