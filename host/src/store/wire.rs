//! A Redis reached through code in this process instead of a socket: what a simulator
//! puts under the real Redis store, its subscription and its leases
//! ([`CorralBuilder::redis_wire`](crate::CorralBuilder::redis_wire)), so that everything
//! above the connection runs as it does against a `redis-server`: the commands and
//! scripts the store sends, their replies read by the same code, the `NOSCRIPT` path,
//! the breaker, the link's healing, the subscription's keeping.
//!
//! A wire speaks the `redis` crate's own types: [`Cmd`]s in, [`Value`]s out. A failure
//! of the connection is a [`RedisError`](redis::RedisError) made from an
//! [`std::io::Error`] (`TimedOut` for a reply that never came, `ConnectionRefused` for a
//! command never sent), as the crate's own connections report it; a server's error
//! reply is a `Value::ServerError` (`redis::parse_redis_value(b"-NOSCRIPT ...\r\n")`).

use futures::future::BoxFuture;
use redis::{Cmd, Msg, RedisResult, Value};

/// A Redis server reached in process. Shared by every connection opened to it.
pub trait Wire: Send + Sync + 'static {
    /// Sends `commands` in one trip (a pipeline's, or a single command) and returns
    /// their replies, in order.
    fn send(&self, commands: Vec<Cmd>) -> BoxFuture<'static, RedisResult<Vec<Value>>>;

    /// Opens a connection for pub/sub.
    fn subscription(&self) -> BoxFuture<'static, RedisResult<Box<dyn WireSubscription>>>;
}

/// A pub/sub connection of a [`Wire`].
pub trait WireSubscription: Send {
    /// `SUBSCRIBE channel`, returning once the server confirmed it.
    fn subscribe<'a>(&'a mut self, channel: &'a str) -> BoxFuture<'a, RedisResult<()>>;

    /// The next message published on a subscribed channel; `None` once the connection
    /// is gone. Dropping the future loses nothing.
    fn next_message(&mut self) -> BoxFuture<'_, Option<Msg>>;

    /// `PING` on the subscribed connection. The future holds no borrow of the
    /// subscription: messages are heard while it waits.
    fn ping(&self) -> BoxFuture<'static, RedisResult<()>>;
}
