//! The simulated server's keyspace: the Redis commands Corral's store and Lua send
//! (`GET`, `MGET`, `EXISTS`, `SET` with `NX`/`PX`/`GET`, `DEL`, `INCR`, `TIME`, `TYPE`,
//! `PEXPIRE`, `PTTL`, `GETEX`, `SETRANGE`, `PUBLISH`), over the world's records. A name says where its data lives
//! (`corral_core::names::kind_of`): flight locks and lease locks among the locks, fencing
//! counters among the counters, the rest (entries, tag moments, the generation counter)
//! among the entries. Every write is recorded for the invariants as the store applies it,
//! so a script that writes what it should not is seen doing so.

use bytes::Bytes;
use corral_core::names::{Kind, kind_of};

use crate::lua::{Keyspace, Reply};

use crate::world::{Grant, HeldLock, State, Tag, VersionKind, check_fill_over, tag_of};

/// What an entry written through this step is, for the invariants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// A plain write (`set`, `swap`): a load written so is unfenced.
    Plain,
    /// A conditional write (`set_if`): a load's fenced fill.
    Fenced,
    /// A read's touch written back (same value).
    Touch,
}

/// One atomic step of the server, by one process at one moment.
pub(crate) struct Step<'a> {
    pub(crate) st: &'a mut State,
    pub(crate) now: u64,
    pub(crate) proc: usize,
    /// The workload call whose flight sends this step (a flight lock records it).
    pub(crate) call: Option<u64>,
    pub(crate) write: Write,
    /// The sender's clock, when the command carries it (read-and-touch's `now`).
    pub(crate) clock_ms: Option<u64>,
    /// The server (`Conn::server`): a Redlock server keeps its locks and counters under
    /// names of its own (`s{n}|{name}`).
    pub(crate) server: usize,
}

/// Lease server `server`'s copy of the lock or counter `name`: a Redlock server (1..)
/// keeps its own, as `s{server}|{name}`; the store (0) keeps `name`.
pub(crate) fn on_server(server: usize, name: &str) -> String {
    match server {
        0 => name.to_owned(),
        s => format!("s{s}|{name}"),
    }
}

/// The server a stored lock or counter name is on, and the name as the lock code gave it
/// (see [`on_server`]).
pub(crate) fn server_of(stored: &str) -> (usize, &str) {
    stored
        .split_once('|')
        .and_then(|(s, name)| Some((s.strip_prefix('s')?.parse().ok()?, name)))
        .unwrap_or((0, stored))
}

/// A key written without `PX` never expires (as far as a run can tell).
const NO_EXPIRY: u64 = u64::MAX / 4;

/// The expiry metadata of envelope bytes, if they decode.
pub(crate) fn meta_of(bytes: &[u8]) -> Option<corral_core::expiry::EntryMeta> {
    let limits = corral_core::Limits::default();
    corral_core::envelope::decode_header(bytes, bytes.len() as u64, &limits)
        .ok()
        .map(|d| d.meta)
}

enum Home {
    Entries,
    Locks,
    Fences,
}

fn home(name: &str) -> Home {
    match kind_of(name) {
        Some(Kind::FlightLock | Kind::Lock) => Home::Locks,
        Some(Kind::Fence) => Home::Fences,
        _ => Home::Entries,
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn number(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

impl<'a> Step<'a> {
    pub(crate) fn new(st: &'a mut State, now: u64, proc: usize, write: Write) -> Self {
        Step {
            st,
            now,
            proc,
            call: None,
            write,
            clock_ms: None,
            server: 0,
        }
    }

    fn get(&mut self, name: &str) -> Reply {
        match home(name) {
            Home::Entries => self
                .st
                .live(name, self.now)
                .map_or(Reply::Nil, |b| Reply::Bulk(b.to_vec())),
            Home::Locks => self
                .st
                .live_lock(name, self.now)
                .map_or(Reply::Nil, |l| Reply::Bulk(l.owner.clone().into_bytes())),
            Home::Fences => self
                .st
                .fences
                .get(name)
                .map_or(Reply::Nil, |c| Reply::Bulk(c.to_string().into_bytes())),
        }
    }

    /// `SET name value [NX] [PX ms] [GET]`.
    fn set(&mut self, args: &[Vec<u8>]) -> Reply {
        let (name, value) = (text(&args[1]), &args[2]);
        let mut nx = false;
        let mut get = false;
        let mut px = None;
        let mut rest = args[3..].iter();
        while let Some(a) = rest.next() {
            match a.to_ascii_uppercase().as_slice() {
                b"NX" => nx = true,
                b"GET" => get = true,
                b"PX" => match rest.next().and_then(|ms| number(ms)).filter(|&ms| ms > 0) {
                    Some(ms) => px = Some(ms),
                    None => return Reply::error("ERR invalid expire time in 'set' command"),
                },
                _ => return Reply::error("ERR syntax error"),
            }
        }
        let old = self.get(&name);
        if nx && old != Reply::Nil {
            return Reply::Nil;
        }
        let now = self.now;
        match home(&name) {
            Home::Entries => {
                let bytes = Bytes::copy_from_slice(value);
                let ttl = px.unwrap_or(NO_EXPIRY);
                match self.write {
                    Write::Fenced => check_fill_over(self.st, &name, &bytes, now, false),
                    Write::Plain => check_fill_over(self.st, &name, &bytes, now, true),
                    Write::Touch => {}
                }
                self.st.note_generation(self.call, &name, &bytes);
                self.st
                    .write(self.proc, &name, bytes, ttl, now, self.write == Write::Fenced);
                self.judge_envelope(&name);
            }
            Home::Locks => {
                if self.st.locks.get(&name).is_some_and(|l| l.until <= now) {
                    // A lapsed lock taken over: its holder lost it. (One still held and
                    // overwritten, by a command without NX, is not excused.)
                    let key = self.st.key_of(&name);
                    // Where nothing keeps a leader from renewing, none loses its lock
                    // while its load runs.
                    if self.st.leaders_keep_locks
                        && let Some(load) = self.st.loads.iter().find(|l| {
                            l.locked && l.end.is_none() && !l.renewal_refused && l.lock_name == name
                        })
                    {
                        let what = format!(
                            "lock-renewal: {name} lapsed at {} under p{}'s load (call {}, since {})",
                            load.lock_until, load.proc, load.call, load.start
                        );
                        self.st.violation(now, what);
                    }
                    self.st.lock_losses.entry(key).or_default().push(now);
                }
                let key = self.st.key_of(&name);
                self.st.grants.push(Grant {
                    name: name.clone(),
                    key,
                    proc: self.proc,
                    owner: text(value),
                    t: now,
                    acknowledged: false,
                    fencing: 0,
                });
                self.st.locks.insert(
                    name.clone(),
                    HeldLock {
                        owner: text(value),
                        proc: self.proc,
                        until: now.saturating_add(px.unwrap_or(NO_EXPIRY)),
                        since: now,
                        // Until the reply reaches its taker (it may be lost).
                        reply_lost: true,
                        call: self.call,
                    },
                );
            }
            Home::Fences => match number(value) {
                Some(c) => {
                    self.st.fences.insert(name, c);
                }
                None => return Reply::error(format!("sim: {name} set to {:?}, not a counter", text(value))),
            },
        }
        if get { old } else { Reply::ok() }
    }

    fn del(&mut self, name: &str) -> Reply {
        let was = self.get(name) != Reply::Nil;
        match home(name) {
            Home::Entries => {
                if self.st.entries.remove(name).is_some() {
                    let key = self.st.key_of(name);
                    self.st
                        .push_version_of(&key, name, self.now, VersionKind::Cleanup);
                }
            }
            Home::Locks => {
                self.st.locks.remove(name);
            }
            Home::Fences => {
                self.st.fences.remove(name);
            }
        }
        Reply::Int(i64::from(was))
    }

    fn incr(&mut self, name: &str) -> Reply {
        let Home::Fences = home(name) else {
            return Reply::error(format!("sim: INCR of {name}, which is not a counter"));
        };
        let current = self.st.fences.get(name).copied().unwrap_or(0);
        match current.checked_add(1).filter(|&c| c <= i64::MAX as u64) {
            Some(c) => {
                self.st.fences.insert(name.to_owned(), c);
                Reply::Int(c as i64)
            }
            None => Reply::error("ERR increment or decrement would overflow"),
        }
    }

    /// `PEXPIRE name ms`, and `GETEX name PX ms`'s expiry.
    fn pexpire(&mut self, name: &str, ms: u64) -> Reply {
        let now = self.now;
        let until = now.saturating_add(ms.max(1));
        let set = match home(name) {
            Home::Entries => match self.st.entries.get_mut(name).filter(|s| now < s.until) {
                Some(s) => {
                    s.until = until;
                    true
                }
                None => false,
            },
            Home::Locks => match self.st.locks.get_mut(name).filter(|l| now < l.until) {
                Some(l) => {
                    l.until = until;
                    // A flight lock renewed while its loader runs: that load holds it
                    // longer (a takeover before then is not excused as a lapse).
                    let (proc, since) = (l.proc, l.since);
                    let mut renewed = Vec::new();
                    for load in self.st.loads.iter_mut().filter(|r| {
                        r.locked
                            && r.end.is_none()
                            && r.proc == proc
                            && r.lock_name == name
                            && r.start >= since
                    }) {
                        load.lock_until = until;
                        renewed.push((load.key.clone(), load.start, load.call));
                    }
                    for (key, start, call) in renewed {
                        self.check_renewal_fenced(name, &key, start, call);
                    }
                    true
                }
                None => false,
            },
            Home::Fences => self.st.fences.contains_key(name),
        };
        Reply::Int(i64::from(set))
    }

    /// A flight lock is renewed only while its key holds what the load's fill expects:
    /// never while the entry still holds what a set, a removal or another load wrote
    /// after the load began (a renewal that ignored it would let the load outlive a
    /// removal's tombstone). An entry that expired since holds nothing, which an `nx`
    /// fill expects.
    fn check_renewal_fenced(&mut self, lock: &str, key: &str, start: u64, call: u64) {
        // The entry of the lock's own generation: a process that has not heard of a
        // clear yet still renews in the generation it knows.
        let Some(entry) = corral_core::names::beside(lock, Kind::Entry) else {
            return;
        };
        // The entry's last version (or a restart): one the workload wrote after the
        // load began, not cleaned up since and still held (not expired), is not what
        // the fill expects.
        let now = self.now;
        if self.st.live(&entry, now).is_none() {
            return;
        }
        let last = self
            .st
            .versions
            .get(key)
            .and_then(|v| v.iter().rev().find(|x| x.name == entry || x.name.is_empty()));
        let written = last.filter(|x| {
            x.t > start
                && matches!(
                    x.kind,
                    VersionKind::Set(_) | VersionKind::Remove | VersionKind::Load { .. }
                )
        });
        if let Some(written) = written {
            let what = format!(
                "renewal-fenced: {lock} renewed under call {call}'s load (since {start}) though {:?} was written at {}",
                written.kind, written.t
            );
            self.st.violation(now, what);
        }
    }

    fn setrange(&mut self, name: &str, offset: usize, field: &[u8]) -> Reply {
        let now = self.now;
        let Some(stored) = self.st.entries.get_mut(name).filter(|s| now < s.until) else {
            return Reply::error(format!("sim: SETRANGE of {name}, which holds nothing"));
        };
        let before = stored.bytes.clone();
        let mut bytes = stored.bytes.to_vec();
        if bytes.len() < offset + field.len() {
            bytes.resize(offset + field.len(), 0);
        }
        bytes[offset..offset + field.len()].copy_from_slice(field);
        stored.bytes = Bytes::from(bytes);
        let after = stored.bytes.clone();
        let len = after.len();
        self.judge_envelope(name);
        self.judge_touch(name, &before, &after);
        Reply::Int(len as i64)
    }

    /// A touch in place (read-and-touch's `SETRANGE`): it never moves the expiry of an
    /// entry that had expired by the toucher's own clock (an idle sliding entry stays
    /// expired).
    fn judge_touch(&mut self, name: &str, before: &[u8], after: &[u8]) {
        let (Some(clock), Some(old), Some(new)) = (self.clock_ms, meta_of(before), meta_of(after)) else {
            return;
        };
        if old.expires_at_ms <= clock && new.expires_at_ms > old.expires_at_ms {
            let now = self.now;
            let what = format!(
                "touch: {name} expired at {} revived at {clock} (to {})",
                old.expires_at_ms, new.expires_at_ms
            );
            self.st.violation(now, what);
        }
    }

    /// An entry just written: its envelope must decode, and a sliding entry's expiry
    /// must not pass its absolute point (no touch moves it there). The first write of a
    /// value records its expiry, for the expiry invariant.
    fn judge_envelope(&mut self, name: &str) {
        if kind_of(name) != Some(Kind::Entry) {
            return;
        }
        let Some(bytes) = self.st.entries.get(name).map(|s| s.bytes.clone()) else {
            return;
        };
        let now = self.now;
        // `tag_of` names a value only for bytes that decode.
        let violation = match (tag_of(&bytes), meta_of(&bytes)) {
            (Tag::Tombstone, _) => None,
            (Tag::Value(v), Some(meta)) => {
                self.st.value_meta.entry(v.clone()).or_insert(meta);
                match (meta.sliding_ms, meta.absolute_ms) {
                    (Some(_), Some(absolute)) if meta.expires_at_ms > absolute => Some(format!(
                        "touch: {v} under {name} expires at {}, past its absolute point {absolute}",
                        meta.expires_at_ms
                    )),
                    _ => None,
                }
            }
            _ => Some(format!(
                "envelope: {name} written with bytes that are not an envelope"
            )),
        };
        if let Some(what) = violation {
            self.st.violation(now, what);
        }
    }
}

impl Keyspace for Step<'_> {
    fn command(&mut self, args: &[Vec<u8>]) -> Reply {
        let mut name = args.get(1).map(|n| text(n)).unwrap_or_default();
        let own;
        let args = if self.server > 0 && matches!(home(&name), Home::Locks | Home::Fences) {
            name = on_server(self.server, &name);
            let mut a = args.to_vec();
            a[1] = name.clone().into_bytes();
            own = a;
            &own[..]
        } else {
            args
        };
        let arity = |n: usize| args.len() == n;
        match args[0].to_ascii_uppercase().as_slice() {
            b"GET" if arity(2) => self.get(&name),
            b"MGET" if args.len() >= 2 => {
                Reply::Array(args[1..].iter().map(|n| self.get(&text(n))).collect())
            }
            b"EXISTS" if arity(2) => Reply::Int(i64::from(self.get(&name) != Reply::Nil)),
            b"SET" if args.len() >= 3 => self.set(args),
            b"DEL" if args.len() >= 2 => {
                let mut deleted = 0;
                for n in &args[1..] {
                    if let Reply::Int(d) = self.del(&text(n)) {
                        deleted += d;
                    }
                }
                Reply::Int(deleted)
            }
            b"INCR" if arity(2) => self.incr(&name),
            b"TYPE" if arity(2) => Reply::Status(
                if self.get(&name) == Reply::Nil {
                    "none"
                } else {
                    "string"
                }
                .into(),
            ),
            b"PEXPIRE" if arity(3) => match std::str::from_utf8(&args[2])
                .ok()
                .and_then(|t| t.parse::<i64>().ok())
            {
                // A time not in the future deletes the key, as on Redis.
                Some(ms) if ms <= 0 => match self.get(&name) {
                    Reply::Nil => Reply::Int(0),
                    _ => self.del(&name),
                },
                Some(_) if matches!(home(&name), Home::Fences) => Reply::error(format!(
                    "ERR sim: an expiry on the counter {name} is not simulated"
                )),
                Some(ms) => self.pexpire(&name, ms as u64),
                None => Reply::error("ERR value is not an integer or out of range"),
            },
            b"GETEX" if arity(2) => self.get(&name),
            b"GETEX" if arity(4) && args[2].eq_ignore_ascii_case(b"PX") => {
                match std::str::from_utf8(&args[3])
                    .ok()
                    .and_then(|t| t.parse::<i64>().ok())
                {
                    None => Reply::error("ERR value is not an integer or out of range"),
                    Some(ms) if ms <= 0 => Reply::error("ERR invalid expire time in 'getex' command"),
                    Some(ms) => {
                        let found = self.get(&name);
                        if found != Reply::Nil {
                            self.pexpire(&name, ms as u64);
                        }
                        found
                    }
                }
            }
            b"PTTL" if arity(2) => {
                let now = self.now;
                let until = match home(&name) {
                    Home::Entries => self
                        .st
                        .entries
                        .get(&name)
                        .filter(|s| now < s.until)
                        .map(|s| s.until),
                    Home::Locks => self.st.live_lock(&name, now).map(|l| l.until),
                    Home::Fences => self.st.fences.get(&name).map(|_| NO_EXPIRY),
                };
                match until {
                    None => Reply::Int(-2),
                    Some(u) if u >= NO_EXPIRY => Reply::Int(-1),
                    Some(u) => Reply::Int((u - now) as i64),
                }
            }
            b"SETRANGE" if arity(4) => match number(&args[2]) {
                Some(offset) => self.setrange(&name, offset as usize, &args[3]),
                None => Reply::error("ERR offset is out of range"),
            },
            b"TIME" => {
                let us = crate::world::store_time_us(self.now);
                Reply::Array(vec![
                    Reply::Bulk((us / 1_000_000).to_string().into_bytes()),
                    Reply::Bulk((us % 1_000_000).to_string().into_bytes()),
                ])
            }
            // Delivered once the step is applied, to whoever subscribed by then (a
            // Redlock server's channel has no subscribers).
            b"PUBLISH" if arity(3) => {
                if self.server == 0 {
                    self.st.outbox.push((text(&args[1]), args[2].clone()));
                }
                Reply::Int(0)
            }
            _ => Reply::error(format!("ERR sim: unknown command or arity '{}'", text(&args[0]))),
        }
    }
}
