//! A real `redis-server` reached through a [`Wire`]: commands on one multiplexed
//! connection, pub/sub on a connection of its own. A test can hold the replies of its
//! `MGET`s at a gate (the server read the keys; the reader has not heard: [`RealWire::mgets`]),
//! or those of the commands naming a given name ([`RealWire::named`]), and make its
//! subscription's health `PING`s hang ([`RealWire::hang`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use corral::store::wire::{Wire, WireSubscription};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use redis::aio::{MultiplexedConnection, PubSub, PubSubSink, PubSubStream};
use redis::{Cmd, Msg, RedisResult, Value};
use tokio::sync::Notify;

/// A real server behind a [`Wire`], with hooks for tests.
#[allow(missing_debug_implementations)]
pub struct RealWire {
    client: redis::Client,
    commands: MultiplexedConnection,
    /// While set, a subscription's `PING` is sent nowhere and never answered (a server
    /// that delivered its messages, then froze).
    pub hang: Arc<AtomicBool>,
    /// How many hung pings wait (counted until each is given up).
    pub pending: Arc<AtomicUsize>,
    /// Where the replies of `MGET`s wait while it is closed.
    pub mgets: Arc<Gate>,
    /// Where the replies of other commands naming anything that contains `naming` wait
    /// while it is closed.
    pub named: Arc<Gate>,
    /// What `named` holds the replies of commands naming (none: nothing).
    pub naming: Arc<std::sync::Mutex<Option<String>>>,
    /// How many sends named it so far (held or not).
    pub named_sends: Arc<AtomicUsize>,
}

/// A gate replies wait at while it is closed: each arrival is told
/// ([`arrived`](Gate::arrived)), and each waits until [`let_one`](Gate::let_one).
#[derive(Debug, Default)]
pub struct Gate {
    closed: AtomicBool,
    arrivals: Notify,
    passes: Notify,
}

impl Gate {
    /// Replies that come from now on wait.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Returns once a reply arrived at the closed gate.
    pub async fn arrived(&self) {
        self.arrivals.notified().await;
    }

    /// Lets one waiting reply (or the next to come) through, and opens the gate.
    pub fn let_one(&self) {
        self.closed.store(false, Ordering::SeqCst);
        self.passes.notify_one();
    }

    async fn pass(&self) {
        if self.closed.load(Ordering::SeqCst) {
            self.arrivals.notify_one();
            self.passes.notified().await;
        }
    }
}

impl RealWire {
    /// A wire to the server at `url`.
    pub async fn connect(url: &str) -> anyhow::Result<RealWire> {
        let client = redis::Client::open(url)?;
        let commands = client.get_multiplexed_async_connection().await?;
        Ok(RealWire {
            client,
            commands,
            hang: Arc::default(),
            pending: Arc::default(),
            mgets: Arc::default(),
            named: Arc::default(),
            naming: Arc::default(),
            named_sends: Arc::default(),
        })
    }

    /// A wire to the server at `url` that holds, for good, the replies to every command
    /// naming a prefix's generation counter (`{…}:g`, contract §2.4): the server reads
    /// it, the reader never hears, and a cache's generation read times out.
    pub async fn holding_the_generation(url: &str) -> anyhow::Result<RealWire> {
        let wire = RealWire::connect(url).await?;
        *wire.naming.lock().unwrap_or_else(|e| e.into_inner()) = Some("}:g".to_string());
        wire.named.close();
        Ok(wire)
    }
}

fn is_mget(command: &Cmd) -> bool {
    matches!(command.args_iter().next(), Some(redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"MGET"))
}

impl Wire for RealWire {
    fn send(&self, commands: Vec<Cmd>) -> BoxFuture<'static, RedisResult<Vec<Value>>> {
        let mut conn = self.commands.clone();
        let naming = self.naming.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let names = |command: &Cmd| {
            naming.as_ref().is_some_and(|part| {
                command.args_iter().skip(1).any(|arg| {
                    matches!(arg, redis::Arg::Simple(a) if a.windows(part.len()).any(|w| w == part.as_bytes()))
                })
            })
        };
        let named = commands.iter().any(names);
        if named {
            self.named_sends.fetch_add(1, Ordering::SeqCst);
        }
        let gate = if commands.iter().any(is_mget) {
            Some(self.mgets.clone())
        } else if named {
            Some(self.named.clone())
        } else {
            None
        };
        async move {
            let replies = if let [command] = commands.as_slice() {
                command.query_async(&mut conn).await.map(|reply| vec![reply])
            } else {
                let mut pipe = redis::pipe();
                for command in commands {
                    pipe.add_command(command);
                }
                pipe.query_async(&mut conn).await
            };
            if let Some(gate) = gate {
                gate.pass().await;
            }
            replies
        }
        .boxed()
    }

    fn subscription(&self) -> BoxFuture<'static, RedisResult<Box<dyn WireSubscription>>> {
        let (client, hang, pending) = (self.client.clone(), self.hang.clone(), self.pending.clone());
        async move {
            let pubsub = client.get_async_pubsub().await?;
            Ok(Box::new(Subscription {
                pubsub: Some(pubsub),
                split: None,
                hang,
                pending,
            }) as Box<dyn WireSubscription>)
        }
        .boxed()
    }
}

struct Subscription {
    /// Until the first message is asked for: then split in two.
    pubsub: Option<PubSub>,
    split: Option<(PubSubSink, PubSubStream)>,
    hang: Arc<AtomicBool>,
    pending: Arc<AtomicUsize>,
}

impl WireSubscription for Subscription {
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
