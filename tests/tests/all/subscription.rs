//! The subscription that carries landings and invalidations, against a real
//! `redis-server` reached through a wire whose health `PING`s can be made to hang.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use corral::store::wire::{Wire, WireSubscription};
use corral::{Corral, EntryOptions, RedisOptions};
use corral_tests::RedisServer;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use redis::aio::{MultiplexedConnection, PubSub, PubSubSink, PubSubStream};
use redis::{Cmd, Msg, RedisResult, Value};

/// Commands on one multiplexed connection, pub/sub on its own, to a real server; while
/// `hang` is set, a subscription's `PING` is sent nowhere and never answered (a server
/// that delivered its messages, then froze). `pending` counts those hung pings waiting.
struct HangingPings {
    client: redis::Client,
    commands: MultiplexedConnection,
    hang: Arc<AtomicBool>,
    pending: Arc<AtomicUsize>,
}

impl HangingPings {
    async fn connect(url: &str) -> Result<HangingPings> {
        let client = redis::Client::open(url)?;
        let commands = client.get_multiplexed_async_connection().await?;
        Ok(HangingPings {
            client,
            commands,
            hang: Arc::default(),
            pending: Arc::default(),
        })
    }
}

impl Wire for HangingPings {
    fn send(&self, commands: Vec<Cmd>) -> BoxFuture<'static, RedisResult<Vec<Value>>> {
        let mut conn = self.commands.clone();
        async move {
            if let [command] = commands.as_slice() {
                return Ok(vec![command.query_async(&mut conn).await?]);
            }
            let mut pipe = redis::pipe();
            for command in commands {
                pipe.add_command(command);
            }
            pipe.query_async(&mut conn).await
        }
        .boxed()
    }

    fn subscription(&self) -> BoxFuture<'static, RedisResult<Box<dyn WireSubscription>>> {
        let (client, hang, pending) = (self.client.clone(), self.hang.clone(), self.pending.clone());
        async move {
            let pubsub = client.get_async_pubsub().await?;
            Ok(Box::new(HangingSubscription {
                pubsub: Some(pubsub),
                split: None,
                hang,
                pending,
            }) as Box<dyn WireSubscription>)
        }
        .boxed()
    }
}

struct HangingSubscription {
    /// Until the first message is asked for: then split in two.
    pubsub: Option<PubSub>,
    split: Option<(PubSubSink, PubSubStream)>,
    hang: Arc<AtomicBool>,
    pending: Arc<AtomicUsize>,
}

impl WireSubscription for HangingSubscription {
    fn subscribe<'a>(&'a mut self, channel: &'a str) -> BoxFuture<'a, RedisResult<()>> {
        async move {
            match self.pubsub.as_mut() {
                Some(pubsub) => pubsub.subscribe(channel).await,
                None => Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "already listening",
                ))),
            }
        }
        .boxed()
    }

    fn next_message(&mut self) -> BoxFuture<'_, Option<Msg>> {
        if let Some(pubsub) = self.pubsub.take() {
            self.split = Some(pubsub.split());
        }
        match self.split.as_mut() {
            Some((_, stream)) => stream.next().boxed(),
            None => std::future::ready(None).boxed(),
        }
    }

    fn ping(&self) -> BoxFuture<'static, RedisResult<()>> {
        let Some((sink, _)) = self.split.as_ref() else {
            return std::future::ready(Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "not listening",
            ))))
            .boxed();
        };
        if self.hang.load(Ordering::SeqCst) {
            let waiting = Pending::new(&self.pending);
            return async move {
                let _waiting = waiting;
                std::future::pending().await
            }
            .boxed();
        }
        let mut sink = sink.clone();
        async move { sink.ping::<Value>().await.map(drop) }.boxed()
    }
}

/// One hung ping waiting, counted until it is dropped (given up).
struct Pending(Arc<AtomicUsize>);

impl Pending {
    fn new(count: &Arc<AtomicUsize>) -> Pending {
        count.fetch_add(1, Ordering::SeqCst);
        Pending(count.clone())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits (up to 10 s) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        ensure!(Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// A message that arrives while the subscription's health `PING` waits for its answer
/// is heard at once, not once the ping is answered or given up (up to the response
/// timeout, 30 s here): another process's write drops this process's L1 copy while the
/// ping still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_is_heard_while_a_health_ping_waits() -> Result<()> {
    let server = RedisServer::start()?;
    let wire = HangingPings::connect(&server.url()).await?;
    let (hang, pending) = (wire.hang.clone(), wire.pending.clone());
    let mut options = RedisOptions::new(server.url());
    options.response_timeout = Duration::from_secs(30);
    let b = Corral::builder()
        .redis_options(options)
        .redis_wire(Arc::new(wire))
        .build()?;
    let a = Corral::builder().redis(server.url()).build()?;
    // b listens once it hears a's announcements.
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.metrics().l1_invalidations == 0 {
        ensure!(Instant::now() < deadline, "b never heard a's announcements");
        a.set("probe", "x", EntryOptions::new()).await?;
        b.get("probe").await?;
        a.set("probe", "x", EntryOptions::new()).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.set("k", "old", EntryOptions::new()).await?;
    assert_eq!(b.get("k").await?.as_deref(), Some(&b"old"[..]));
    hang.store(true, Ordering::SeqCst);
    until("a health ping hangs", || pending.load(Ordering::SeqCst) > 0).await?;
    let heard = b.metrics().l1_invalidations;
    a.set("k", "new", EntryOptions::new()).await?;
    until("b hears the write", || b.metrics().l1_invalidations > heard).await?;
    assert!(
        pending.load(Ordering::SeqCst) > 0,
        "heard only once the ping was given up"
    );
    assert_eq!(b.get("k").await?.as_deref(), Some(&b"new"[..]));
    Ok(())
}
