//! The simulated server under the real Redis code: a [`Wire`] per process, so the
//! `redis` crate's commands (and pipelines) of the real `RedisStore`, its scripts by
//! `EVALSHA` or `EVAL`, its breaker and link, and the real subscription task of
//! `RedisNotifications` run over the simulated network and keyspace. The only code the
//! simulator replaces is the socket and the server.
//!
//! A command's trip is [`Conn::call`]'s (delays, lost requests and replies, a connection
//! down, a pause); the server applies it through the keyspace and the Lua as one step.
//! A `PUBLISH` (a command, or a script's) reaches the processes subscribed to its
//! channel at that moment, each delivery delayed, lost, or held while the process is
//! paused. A subscription is a connection of its own: it is cut when the process's
//! connection or subscription goes down and when the store restarts, and the real task
//! then subscribes again (its tries are refused until the fault ends), and drops its L1.

use std::sync::Arc;
use std::time::Duration;

use corral::store::wire::{Wire, WireSubscription};
use futures::FutureExt;
use futures::future::BoxFuture;
use redis::{Cmd, Msg, RedisResult, Value};
use tokio::sync::mpsc;

use crate::keyspace::{Step, Write};
use crate::lua::{Keyspace as _, Reply};
use crate::scenario::{Broken, Script};
use crate::world::{CALL, Conn, State, World, tag_of};

/// Process `proc`'s way to the store (server 0).
pub(crate) struct SimWire {
    pub(crate) world: Arc<World>,
    pub(crate) proc: usize,
}

impl SimWire {
    pub(crate) fn new(world: Arc<World>, proc: usize) -> Arc<Self> {
        Arc::new(SimWire { world, proc })
    }
}

/// A process's live subscription, as the server sees it.
pub(crate) struct Listener {
    id: u64,
    tx: mpsc::UnboundedSender<Msg>,
    channels: Vec<String>,
}

impl Wire for SimWire {
    fn send(&self, commands: Vec<Cmd>) -> BoxFuture<'static, RedisResult<Vec<Value>>> {
        let conn = Conn {
            world: self.world.clone(),
            proc: self.proc,
            server: 0,
        };
        // The workload call whose task sends it (a flight lock records it).
        let call = CALL.try_with(|c| *c).ok();
        let commands: Vec<Vec<Vec<u8>>> = commands.iter().map(args_of).collect();
        // Lease releases the store may apply (their locks are not left behind), and
        // acquires whose takers learn of their grants from the replies.
        let mut acquires = Vec::new();
        // What the trip would publish (a command's, or an announcing release's).
        let mut publishes = Vec::new();
        for (i, args) in commands.iter().enumerate() {
            if upper(&args[0]) == "PUBLISH" && args.len() == 3 {
                publishes.push((String::from_utf8_lossy(&args[1]).into_owned(), args[2].clone()));
            }
            let Some((script, _)) = known(args) else {
                continue;
            };
            let (_, argv) = script_parts(args);
            let owner = || String::from_utf8_lossy(argv.first().map_or(&[][..], Vec::as_slice)).into_owned();
            match (script, argv) {
                (Script::DeleteIfEqual, [_, channel, message, ..])
                | (Script::FillAndRelease, [_, _, _, _, _, channel, message, ..]) => {
                    publishes.push((String::from_utf8_lossy(channel).into_owned(), message.clone()));
                }
                (Script::LockRelease, _) => {
                    self.world.st.lock().release_attempts.insert((0, owner()));
                }
                (Script::LockAcquire | Script::LockAcquireFair, _) => acquires.push((i, owner())),
                _ => {}
            }
        }
        let world = self.world.clone();
        async move {
            let (what, name) = label(&commands);
            let broken = conn.world.scenario.broken;
            let replies = conn
                .call(what, &name, move |st, now, p| {
                    let replies: Vec<Reply> = commands
                        .iter()
                        .map(|args| execute(st, now, p, call, &broken, what, args))
                        .collect();
                    for (args, reply) in commands.iter().zip(&replies) {
                        if let (Some((Script::RenewFenced, _)), Reply::Int(0)) = (known(args), reply) {
                            renewal_refused(st, p, args);
                        }
                    }
                    let summary = summary(&replies);
                    (replies, summary)
                })
                .await
                .map_err(|e| {
                    // Refused or dropped before the store: nobody heard it. (Applied
                    // with its reply lost, or late by a stalled server, it was delivered.)
                    let cause = e.to_string();
                    if crate::world::refused(&cause) || cause.contains(crate::world::DROPPED) {
                        world.unannounced(&publishes);
                    }
                    failure(&cause)
                })?;
            for (i, owner) in acquires {
                if matches!(replies.get(i), Some(Reply::Bulk(_))) {
                    world.st.lock().acknowledge(&owner);
                }
            }
            Ok(replies.into_iter().map(value_of).collect())
        }
        .boxed()
    }

    fn subscription(&self) -> BoxFuture<'static, RedisResult<Box<dyn WireSubscription>>> {
        let (world, proc) = (self.world.clone(), self.proc);
        async move {
            world.gate(proc).await;
            let (there, _) = world.latency();
            tokio::time::sleep(Duration::from_millis(there)).await;
            let now = world.now();
            if world.is_crashed(proc) || world.deaf_until(proc, now).is_some() {
                return Err(failure(crate::world::REFUSED));
            }
            let (tx, rx) = mpsc::unbounded_channel();
            let id = world.open_subscription(proc, tx);
            Ok(Box::new(SimSubscription { world, proc, id, rx }) as Box<dyn WireSubscription>)
        }
        .boxed()
    }
}

/// One subscription connection of a process.
struct SimSubscription {
    world: Arc<World>,
    proc: usize,
    id: u64,
    rx: mpsc::UnboundedReceiver<Msg>,
}

impl SimSubscription {
    /// A round trip on this connection: `None` if it was cut meanwhile (its replies
    /// never come: the caller's timeout ends the wait).
    async fn trip(&self) -> Option<()> {
        trip(&self.world, self.proc, self.id).await
    }
}

/// A round trip on `proc`'s subscription connection `id`, as [`SimSubscription::trip`].
async fn trip(w: &World, proc: usize, id: u64) -> Option<()> {
    w.gate(proc).await;
    let (there, _) = w.latency();
    tokio::time::sleep(Duration::from_millis(there)).await;
    if !w.listening(proc, id) {
        return None;
    }
    let (back, _) = w.latency();
    tokio::time::sleep(Duration::from_millis(back)).await;
    w.gate(proc).await;
    Some(())
}

impl WireSubscription for SimSubscription {
    fn subscribe<'a>(&'a mut self, channel: &'a str) -> BoxFuture<'a, RedisResult<()>> {
        async move {
            if self.trip().await.is_none() {
                return std::future::pending().await;
            }
            self.world.subscribed(self.proc, self.id, channel);
            Ok(())
        }
        .boxed()
    }

    fn next_message(&mut self) -> BoxFuture<'_, Option<Msg>> {
        self.rx.recv().boxed()
    }

    fn ping(&self) -> BoxFuture<'static, RedisResult<()>> {
        let (world, proc, id) = (self.world.clone(), self.proc, self.id);
        async move {
            if trip(&world, proc, id).await.is_none() {
                return std::future::pending().await;
            }
            Ok(())
        }
        .boxed()
    }
}

impl World {
    /// A new subscription connection of `proc` (it replaces any other).
    fn open_subscription(&self, proc: usize, tx: mpsc::UnboundedSender<Msg>) -> u64 {
        let id = self.next_seq();
        self.procs[proc].half_open.lock().take();
        *self.procs[proc].subscription.lock() = Some(Listener {
            id,
            tx,
            channels: Vec::new(),
        });
        id
    }

    /// Whether `proc`'s subscription `id` is still up.
    fn listening(&self, proc: usize, id: u64) -> bool {
        self.procs[proc]
            .subscription
            .lock()
            .as_ref()
            .is_some_and(|l| l.id == id)
    }

    /// `proc`'s subscription `id` now hears `channel`. Once it hears both of the
    /// prefix's channels (the landing channel and the tag and clear one) it is live
    /// again, and the process drops its L1: what it could not hear until now is healed.
    /// (The real task drops L1 once both are confirmed, at this same moment.)
    fn subscribed(&self, proc: usize, id: u64, channel: &str) {
        let live = {
            let mut sub = self.procs[proc].subscription.lock();
            let Some(l) = sub.as_mut().filter(|l| l.id == id) else {
                return;
            };
            if !l.channels.iter().any(|c| c == channel) {
                l.channels.push(channel.to_owned());
            }
            channels().iter().all(|c| l.channels.contains(c))
        };
        if live {
            let now = self.now();
            let mut st = self.st.lock();
            for i in std::mem::take(&mut st.unhealed[proc]) {
                st.gaps[i].healed = Some(now);
            }
            drop(st);
            self.log(format_args!("p{proc} resubscribed: L1 dropped"));
        }
    }

    /// After the quiet at the end: every live process hears both of its prefix's
    /// channels again (a subscription task that stopped, or subscribed to the wrong
    /// channel, would leave its gaps excused for ever).
    pub(crate) fn check_subscribed(&self) {
        let want = channels();
        for p in 0..self.procs.len() {
            if self.is_crashed(p) {
                continue;
            }
            let heard = self.procs[p]
                .subscription
                .lock()
                .as_ref()
                .map(|l| l.channels.clone())
                .unwrap_or_default();
            if !want.iter().all(|c| heard.contains(c)) {
                self.violation(format!(
                    "subscription: p{p} hears {heard:?} after the quiet, not both of {want:?}"
                ));
            }
        }
    }

    /// Makes `proc`'s subscription connection half-open (the peer silently gone): its
    /// stream stays open but nothing arrives on it, no publication and no answer to a
    /// health `PING`; a new connection works. The real task finds out only by its
    /// `PING`'s timeout, and what is published meanwhile is a gap until it resubscribes.
    /// Whether there was one to cut.
    pub(crate) fn half_open_subscription(&self, proc: usize) -> bool {
        let net = &self.procs[proc];
        let Some(listener) = net.subscription.lock().take() else {
            return false;
        };
        *net.half_open.lock() = Some(listener);
        true
    }

    /// Cuts `proc`'s subscription (its connection or subscription went down, the store
    /// restarted, it crashed): the real task sees its stream end.
    pub(crate) fn cut_subscription(&self, proc: usize) {
        self.procs[proc].subscription.lock().take();
    }

    /// Delivers what the step just applied published (`st.outbox`) to the processes on
    /// the wire: each delivery delayed, lost, or held while its process is paused; a
    /// process that cannot hear it (not subscribed now, or cut before it arrives) has a
    /// gap until it resubscribes.
    pub(crate) fn deliver(self: &Arc<Self>, st: &mut State, now: u64) {
        for (channel, message) in std::mem::take(&mut st.outbox) {
            let (tag_channel, body, gap_key) = about(st, &channel, &message);
            for p in 0..self.procs.len() {
                let net = &self.procs[p];
                if st.crashed[p].is_some() {
                    continue;
                }
                let listening = net
                    .subscription
                    .lock()
                    .as_ref()
                    .filter(|l| l.channels.contains(&channel))
                    .map(|l| l.id);
                let Some(id) = listening else {
                    st.unheard(p, Some(&gap_key), now);
                    continue;
                };
                let mute = self.scenario.broken.mute_notifications;
                if mute || (!st.calm && st.rng.chance(self.scenario.faults.notify_lost_pm)) {
                    if !mute {
                        *st.faults.entry("notify-lost").or_default() += 1;
                        st.lost(p, &gap_key, now);
                        let what = if tag_channel {
                            "invalidation"
                        } else {
                            "notification"
                        };
                        use std::fmt::Write as _;
                        let _ = writeln!(st.trace, "{now:>6} p{p} {what} {body:?} lost");
                    }
                    continue;
                }
                let delay = st.rng.range(0, crate::world::DELIVERY_MS);
                let (w, channel, message, gap_key) =
                    (self.clone(), channel.clone(), message.clone(), gap_key.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    // A paused process reads its socket when it resumes.
                    w.gate(p).await;
                    if w.is_crashed(p) {
                        return;
                    }
                    let msg = Msg::from_owned_value(Value::Array(vec![
                        Value::BulkString(b"message".to_vec()),
                        Value::BulkString(channel.into_bytes()),
                        Value::BulkString(message),
                    ]))
                    .expect("a pub/sub message");
                    let sent = w.procs[p]
                        .subscription
                        .lock()
                        .as_ref()
                        .filter(|l| l.id == id)
                        .is_some_and(|l| l.tx.send(msg).is_ok());
                    if !sent {
                        let now = w.now();
                        w.st.lock().unheard(p, Some(&gap_key), now);
                    }
                });
            }
        }
    }
}

/// A publication's channel kind (the tag and clear channel?), what it says (without
/// its origin) and the key its gaps carry.
fn about(st: &State, channel: &str, message: &[u8]) -> (bool, String, String) {
    let tag_channel = channel == corral_core::names::invalidations(crate::world::SIM_PREFIX);
    let text = String::from_utf8_lossy(message).into_owned();
    // "{origin} {key}" or "{origin} {invalidation}".
    let body = text.split_once(' ').map_or(text.as_str(), |(_, b)| b).to_owned();
    let gap_key = if tag_channel {
        crate::world::INVALIDATIONS.to_owned()
    } else {
        st.key_of(&body)
    };
    (tag_channel, body, gap_key)
}

impl World {
    /// Publications a failed trip carried: lost for every process on the wire.
    fn unannounced(&self, publishes: &[(String, Vec<u8>)]) {
        if publishes.is_empty() {
            return;
        }
        let now = self.now();
        let mut st = self.st.lock();
        for (channel, message) in publishes {
            let (_, _, gap_key) = about(&st, channel, message);
            for p in 0..self.procs.len() {
                st.lost(p, &gap_key, now);
            }
        }
    }
}

impl State {
    /// `proc` could not hear a publication about `key` (every key: `None`) at `now`: a
    /// gap until it resubscribes (and drops its L1).
    pub(crate) fn unheard(&mut self, proc: usize, key: Option<&str>, now: u64) {
        self.gaps.push(crate::world::Gap {
            proc,
            key: key.map(str::to_owned),
            t: now,
            healed: Some(UNHEALED),
        });
        let i = self.gaps.len() - 1;
        self.unhealed[proc].push(i);
    }

    /// A publication about `key` lost on its way to `proc` at `now`: a gap only the L1
    /// TTL ends.
    fn lost(&mut self, proc: usize, key: &str, now: u64) {
        self.gaps.push(crate::world::Gap {
            proc,
            key: Some(key.to_owned()),
            t: now,
            healed: None,
        });
    }
}

/// The prefix's two channels: the landing channel and the tag and clear one.
fn channels() -> [String; 2] {
    [
        corral_core::names::channel(crate::world::SIM_PREFIX),
        corral_core::names::invalidations(crate::world::SIM_PREFIX),
    ]
}

/// A gap's end while its process has not resubscribed yet (it never did, by the end).
pub(crate) const UNHEALED: u64 = u64::MAX / 4;

/// A command's arguments as bytes.
fn args_of(cmd: &Cmd) -> Vec<Vec<u8>> {
    cmd.args_iter()
        .map(|a| match a {
            redis::Arg::Simple(bytes) => bytes.to_vec(),
            // Corral sends no cursor.
            _ => b"0".to_vec(),
        })
        .collect()
}

fn upper(arg: &[u8]) -> String {
    String::from_utf8_lossy(arg).to_ascii_uppercase()
}

/// The scripts a Corral store sends that the simulator knows by name (for the trace and
/// for planted bugs).
const SCRIPTS: &[(Script, &str)] = &[
    (Script::ReadAndTouch, "read_and_touch"),
    (Script::DeleteIfEqual, "delete_if_equal"),
    (Script::ReplaceIfEqual, "replace_if_equal"),
    (Script::LockAndPeek, "lock_and_peek"),
    (Script::FillAndRelease, "fill_and_release"),
    (Script::RenewFenced, "renew"),
    (Script::LockAcquire, "acquire"),
    (Script::LockAcquireFair, "acquire"),
    (Script::LockRelease, "unlock"),
    (Script::LockExtend, "extend"),
];

fn script_of(body: &str) -> Option<(Script, &'static str)> {
    SCRIPTS.iter().find(|(s, _)| s.text() == body).copied()
}

/// What a trip is called in the trace, and the name it is about.
fn label(commands: &[Vec<Vec<u8>>]) -> (&'static str, String) {
    let Some(first) = commands.first() else {
        return ("nothing", String::new());
    };
    let arg = |i: usize| {
        first
            .get(i)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .unwrap_or_default()
    };
    if commands.len() > 1 {
        return ("pipeline", arg(1));
    }
    let what = match upper(&first[0]).as_str() {
        "GET" => "get",
        "MGET" => "mget",
        "GETEX" => "getex",
        "PTTL" => "pttl",
        "DEL" => "delete",
        "PUBLISH" => "publish",
        "PING" => "ping",
        "SET" => {
            let (nx, get) = set_flags(first);
            if get {
                "swap"
            } else if nx {
                if corral_core::names::kind_of(&arg(1)) == Some(corral_core::names::Kind::Lock) {
                    "try_lock"
                } else {
                    "set_if"
                }
            } else {
                "set"
            }
        }
        "EVAL" | "EVALSHA" => {
            let name = known(first).map(|(_, n)| n);
            let (keys, _) = script_parts(first);
            let key = keys.first().map(|k| String::from_utf8_lossy(k).into_owned());
            return (name.unwrap_or("script"), key.unwrap_or_default());
        }
        _ => "command",
    };
    (what, arg(1))
}

/// Applies one command at the store, as Redis would: scripts by body or by hash (a hash
/// the store does not have is `NOSCRIPT`), each a step of its own kind for the
/// invariants. A reply of an error is a violation: Corral's store sent what it should
/// not (the simulated keyspace holds nothing of another type).
fn execute(
    st: &mut State,
    now: u64,
    p: usize,
    call: Option<u64>,
    broken: &Broken,
    what: &str,
    args: &[Vec<u8>],
) -> Reply {
    let name = upper(&args[0]);
    let reply = match name.as_str() {
        "PING" => Reply::Status("PONG".to_owned()),
        "EVAL" | "EVALSHA" => eval(st, now, p, call, broken, &name, args),
        "SET" => {
            let (nx, get) = set_flags(args);
            let write = if get {
                // A removal's tombstone, or an `expire`'s stale rewrite of the same value.
                Write::Touch
            } else if nx {
                Write::Fenced
            } else {
                Write::Plain
            };
            let lock = corral_core::names::kind_of(&String::from_utf8_lossy(&args[1]))
                == Some(corral_core::names::Kind::Lock);
            let mut command = args.to_vec();
            if nx && ((lock && broken.lock_without_nx) || (!lock && broken.unfenced_set_if)) {
                command.retain(|a| upper(a) != "NX");
            }
            let mut step = Step::new(st, now, p, write);
            step.call = call;
            step.command(&command)
        }
        "GETEX" => Step::new(st, now, p, Write::Touch).command(args),
        _ => Step::new(st, now, p, Write::Plain).command(args),
    };
    if let Reply::Error(e) = &reply
        && !e.starts_with("NOSCRIPT")
    {
        let what = format!("store: {what} answered {reply:?}");
        st.violation(now, what);
    }
    reply
}

fn eval(
    st: &mut State,
    now: u64,
    p: usize,
    call: Option<u64>,
    broken: &Broken,
    name: &str,
    args: &[Vec<u8>],
) -> Reply {
    let Some(script) = args.get(1).map(|a| String::from_utf8_lossy(a).into_owned()) else {
        return Reply::error("ERR wrong number of arguments");
    };
    let body = if name == "EVAL" {
        st.scripts
            .insert(redis::Script::new(&script).get_hash().to_owned(), script.clone());
        script
    } else {
        match st.scripts.get(&script) {
            Some(body) => body.clone(),
            None => return Reply::error("NOSCRIPT No matching script. Please use EVAL."),
        }
    };
    let (keys, argv) = script_parts(args);
    let keys: Vec<String> = keys
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut argv: Vec<&[u8]> = argv.iter().map(Vec::as_slice).collect();
    let which = script_of(&body).map(|(s, _)| s);
    let write = match which {
        Some(Script::ReadAndTouch) => Write::Touch,
        // A fenced fill, or a touch written back: the same value, never a new version.
        Some(Script::ReplaceIfEqual) => Write::Fenced,
        // A leader's fill, fenced unless no read found what the key held.
        Some(Script::FillAndRelease) if argv.get(1) != Some(&&b"set"[..]) => Write::Fenced,
        _ => Write::Plain,
    };
    if which == Some(Script::FillAndRelease) && broken.unfenced_set_if {
        // The planted bug: the fill whatever the key holds.
        argv[1] = b"set";
    }
    if which == Some(Script::ReplaceIfEqual) && broken.unfenced_set_if {
        // The planted bug: the write whatever the key holds.
        let command = vec![
            b"SET".to_vec(),
            keys.first().map(|k| k.as_bytes().to_vec()).unwrap_or_default(),
            argv.get(1).map(|a| a.to_vec()).unwrap_or_default(),
            b"PX".to_vec(),
            argv.get(2).map(|a| a.to_vec()).unwrap_or_default(),
        ];
        Step::new(st, now, p, Write::Fenced).command(&command);
        return Reply::Int(1);
    }
    let mut step = Step::new(st, now, p, write);
    step.call = call;
    if which == Some(Script::ReadAndTouch) {
        step.clock_ms = argv
            .first()
            .and_then(|a| std::str::from_utf8(a).ok()?.parse::<u64>().ok());
    }
    let text = match which {
        Some(s) => broken.script(s).into_owned(),
        None => body,
    };
    let reply = crate::lua::eval(&text, &keys, &argv, &mut step);
    if matches!(which, Some(Script::LockAcquire | Script::LockAcquireFair))
        && let Reply::Bulk(token) = &reply
        && let Some(token) = std::str::from_utf8(token)
            .ok()
            .and_then(|t| t.parse::<u64>().ok())
    {
        let owner = argv
            .first()
            .map(|o| String::from_utf8_lossy(o).into_owned())
            .unwrap_or_default();
        crate::world::granted(st, now, p, &owner, token);
    }
    reply
}

/// A script a command runs, if the simulator knows it (by its body, or by its hash).
fn known(args: &[Vec<u8>]) -> Option<(Script, &'static str)> {
    static HASHES: std::sync::OnceLock<Vec<(String, Script, &'static str)>> = std::sync::OnceLock::new();
    let script = String::from_utf8_lossy(args.get(1)?);
    match upper(args.first()?).as_str() {
        "EVAL" => script_of(&script),
        "EVALSHA" => HASHES
            .get_or_init(|| {
                SCRIPTS
                    .iter()
                    .map(|&(s, n)| (redis::Script::new(s.text()).get_hash().to_owned(), s, n))
                    .collect()
            })
            .iter()
            .find(|(hash, _, _)| *hash == script)
            .map(|&(_, s, n)| (s, n)),
        _ => None,
    }
}

/// A script command's `KEYS` and `ARGV` (`EVAL script numkeys key... arg...`).
fn script_parts(args: &[Vec<u8>]) -> (&[Vec<u8>], &[Vec<u8>]) {
    let n = args
        .get(2)
        .and_then(|a| std::str::from_utf8(a).ok()?.parse::<usize>().ok())
        .unwrap_or(0);
    let rest = args.get(3..).unwrap_or_default();
    rest.split_at(n.min(rest.len()))
}

/// A flight lock's renewal refused (the lock lost, or its key written or removed): the
/// lock lapses under the running load by design.
fn renewal_refused(st: &mut State, proc: usize, args: &[Vec<u8>]) {
    let (keys, _) = script_parts(args);
    let Some(lock) = keys.first().map(|k| String::from_utf8_lossy(k).into_owned()) else {
        return;
    };
    for load in st
        .loads
        .iter_mut()
        .filter(|l| l.locked && l.end.is_none() && l.proc == proc && l.lock_name == lock)
    {
        load.renewal_refused = true;
    }
}

/// A `SET`'s `NX` and `GET` flags.
fn set_flags(args: &[Vec<u8>]) -> (bool, bool) {
    let flag = |name: &str| args.iter().skip(3).any(|a| upper(a) == name);
    (flag("NX"), flag("GET"))
}

/// A reply as the `redis` crate reads it off the socket.
fn value_of(reply: Reply) -> Value {
    match reply {
        Reply::Nil => Value::Nil,
        Reply::Int(i) => Value::Int(i),
        Reply::Bulk(b) => Value::BulkString(b),
        Reply::Status(s) if s == "OK" => Value::Okay,
        Reply::Status(s) => Value::SimpleString(s),
        Reply::Error(e) => redis::parse_redis_value(format!("-{e}\r\n").as_bytes())
            .unwrap_or_else(|_| Value::SimpleString(e)),
        Reply::Array(items) => Value::Array(items.into_iter().map(value_of).collect()),
    }
}

/// What the trace says of a trip's replies.
fn summary(replies: &[Reply]) -> String {
    replies.iter().map(shown).collect::<Vec<_>>().join(", ")
}

/// A reply in the trace: values by their tags (a tombstone's nonce is random).
fn shown(reply: &Reply) -> String {
    match reply {
        Reply::Nil => "nil".to_owned(),
        Reply::Int(i) => i.to_string(),
        Reply::Bulk(b) => format!("{:?}", tag_of(b)),
        Reply::Status(s) => s.to_ascii_lowercase(),
        Reply::Error(e) => format!("error {e:?}"),
        Reply::Array(items) => format!("[{}]", summary(items)),
    }
}

/// A trip that failed, as the `redis` crate's connections report it: refused (never
/// sent), or timed out (it may have been applied).
fn failure(cause: &str) -> redis::RedisError {
    let kind = if crate::world::refused(cause) {
        std::io::ErrorKind::ConnectionRefused
    } else {
        std::io::ErrorKind::TimedOut
    };
    redis::RedisError::from(std::io::Error::new(kind, format!("sim: {cause}")))
}
