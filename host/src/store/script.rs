//! Lua scripts, run by their hash (`EVALSHA`), and by their body (`EVAL`, on the same
//! key, so routed to the same node) where the node answers `NOSCRIPT`. A script's first
//! call in a process goes by its body at once: a fresh process (a `corral lock`, a
//! short-lived job) would otherwise pay a `NOSCRIPT` round trip per script. Never with a
//! `SCRIPT LOAD`: a cluster client sends that to every node, so while any node is down
//! it fails, and with it every call of a script some live node had not run yet. An
//! `EVAL` also leaves the script in that node's cache, so its next call is an
//! `EVALSHA` again.
//!
//! The same shape as the `redis` crate's `Script` (`key`, `arg`, `prepare_invoke`,
//! `invoke_async`), which only falls back to `SCRIPT LOAD`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, RedisResult, ToRedisArgs};

/// A Lua script: its body and its SHA-1. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Script {
    code: Arc<str>,
    hash: Arc<str>,
    /// Sent once already (by its body): later calls go by its hash.
    sent: Arc<AtomicBool>,
}

impl Script {
    pub(crate) fn new(code: &str) -> Self {
        Script {
            code: code.into(),
            hash: redis::Script::new(code).get_hash().into(),
            sent: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A call with no keys or arguments yet.
    pub(crate) fn prepare_invoke(&self) -> Invocation<'_> {
        Invocation {
            script: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// A call with `key` as its first key.
    pub(crate) fn key<T: ToRedisArgs>(&self, key: T) -> Invocation<'_> {
        let mut call = self.prepare_invoke();
        call.key(key);
        call
    }
}

/// One call of a script: its keys and arguments.
pub(crate) struct Invocation<'a> {
    script: &'a Script,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Invocation<'_> {
    pub(crate) fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub(crate) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// `name` (`EVALSHA` or `EVAL`) of `script` (the hash or the body) on the keys and
    /// arguments: routed by its first key on a cluster.
    fn command(&self, name: &str, script: &str) -> Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(script)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }

    /// Runs the script by its hash, or by its body the first time and where the node
    /// does not have it.
    pub(crate) async fn invoke_async<T: FromRedisValue>(
        &self,
        con: &mut (impl ConnectionLike + Send),
    ) -> RedisResult<T> {
        // Later calls on the same connection queue behind this one, so they find it
        // (on other servers, a `NOSCRIPT` sends it by body there too).
        if !self.script.sent.load(Ordering::Relaxed) && !self.script.sent.swap(true, Ordering::AcqRel) {
            match self.command("EVAL", &self.script.code).query_async(con).await {
                // A user allowed `EVALSHA` only (its scripts loaded by an operator).
                Err(e) if e.code() == Some("NOPERM") => {}
                done => return done,
            }
        }
        match self.command("EVALSHA", &self.script.hash).query_async(con).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                self.command("EVAL", &self.script.code).query_async(con).await
            }
            done => done,
        }
    }
}
