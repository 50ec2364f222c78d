//! Server-side Lua for Redis stores.
//!
//! [`READ_AND_TOUCH`] reads an envelope and applies [`crate::expiry::check`] on the
//! server, so a sliding read costs one round trip and cannot race another writer. It is
//! the one place the expiry rule is written a second time, in Lua; the contract suite
//! runs it against a real Redis beside the Rust rule.
//!
//! Timestamps are below 2^53, so Lua's doubles hold them exactly; fencing counters may
//! not be, so the lock scripts keep them as decimal strings.

/// `KEYS[1]`: the entry. `ARGV[1]`: now (Unix ms). `ARGV[2]`: the store TTL grace (ms).
///
/// Returns the envelope, touched when a sliding read moved it, or nil when the key is
/// missing or expired (an expired entry is deleted). Bytes that are not a version-1
/// envelope come back untouched, for the reader to judge (and remove) as corrupt.
pub const READ_AND_TOUCH: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return false end
if string.len(v) < 32 or string.sub(v, 1, 4) ~= 'CRL\1' then return v end
local function u64(at)
  local n = 0
  for i = at, at + 7 do n = n * 256 + string.byte(v, i) end
  return n
end
local absolute, sliding, expires = u64(5), u64(13), u64(21)
local now = tonumber(ARGV[1])
if now >= expires then
  redis.call('DEL', KEYS[1])
  return false
end
if sliding > 0 then
  local target = now + sliding
  if absolute > 0 and absolute < target then target = absolute end
  if target > expires then
    local bytes, n = {}, target
    for i = 8, 1, -1 do
      bytes[i] = string.char(n % 256)
      n = math.floor(n / 256)
    end
    local field = table.concat(bytes)
    redis.call('SETRANGE', KEYS[1], 20, field)
    redis.call('PEXPIRE', KEYS[1], target - now + tonumber(ARGV[2]))
    v = string.sub(v, 1, 20) .. field .. string.sub(v, 29)
  end
end
return v
"#;

/// The end of a script that may announce a landing: publishes the message `ARGV[$m]` on
/// the channel `ARGV[$c]` when a channel is given, adds 2 to `result` if that succeeded
/// (a publish that fails, a user without channel rights, never fails the script: the
/// caller announces on its own), and returns `result`.
macro_rules! announce_and_return {
    ($c:literal, $m:literal) => {
        concat!(
            "if ARGV[",
            $c,
            "] then\n",
            "  local published = redis.pcall('PUBLISH', ARGV[",
            $c,
            "], ARGV[",
            $m,
            "])\n",
            "  if type(published) == 'number' then result = result + 2 end\n",
            "end\n",
            "return result\n"
        )
    };
}

/// `KEYS[1]`: the key. `ARGV[1]`: the bytes it must hold. Deletes the key only if it
/// still holds exactly those bytes; returns 1 when deleted, else 0. Used to remove a
/// corrupt entry without removing a good one written since, and to release a lock.
/// Optionally `ARGV[2]`, `ARGV[3]`: a channel and a message published in the same step,
/// whether or not it deleted (a flight's release announcing its landing: one command,
/// and nothing owed once it returned); 2 is then added when the publish succeeded. A
/// publish that fails (a user without channel rights) never fails the delete: the
/// caller announces on its own.
pub const DELETE_IF_EQUAL: &str = concat!(
    r#"
local result = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  result = redis.call('DEL', KEYS[1])
end
"#,
    announce_and_return!("2", "3")
);

/// A get-or-set's lock with the double-check's first look (contract §5.4). `KEYS[1]`: the
/// flight lock, `KEYS[2]`: its entry (one slot). `ARGV[1]`: the owner token, `ARGV[2]`:
/// the TTL (ms). Takes the lock if free (`SET NX PX`) and, in the same step, says
/// whether anything is under the entry: 0 busy; 1 taken and the entry is empty (that
/// look is the double-check read: any write after it is caught by the fenced fill,
/// §5.12); 2 taken and something is there (the double-check reads it).
pub const LOCK_AND_PEEK: &str = r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1 + redis.call('EXISTS', KEYS[2])
end
return 0
"#;

/// A leader's fill and its flight lock's release in one step (contract §5.5, §5.12).
/// `KEYS[1]`: the entry, `KEYS[2]`: its flight lock (one slot). `ARGV[1]`: the lock's
/// owner token; `ARGV[2]`: how the fill is fenced: `nx` (only over nothing), `eq` (only
/// over exactly the bytes `ARGV[3]`) or `set` (over anything: no read found what the key
/// held); `ARGV[4]`: the entry's bytes, `ARGV[5]`: its TTL (ms). Optionally `ARGV[6]`,
/// `ARGV[7]`: a channel and a message published in the same step, whatever happened
/// (the landing's announcement), as [`DELETE_IF_EQUAL`] does.
///
/// The fill is made only while `ARGV[1]` still holds the lock: a load that outlived its
/// lock (a loader slower than the TTL, a process paused past it) writes nothing, since
/// another leader may hold the lock now and a removal since the double-check may have
/// outlived its tombstone. Returns the sum of 1 when written, 2 when published and 4
/// when the lock was still held (then released).
pub const FILL_AND_RELEASE: &str = concat!(
    r#"
local result = 0
if redis.call('GET', KEYS[2]) == ARGV[1] then
  result = 4
  local written
  if ARGV[2] == 'eq' then
    if redis.call('GET', KEYS[1]) == ARGV[3] then
      written = redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
    end
  elseif ARGV[2] == 'nx' then
    written = redis.call('SET', KEYS[1], ARGV[4], 'NX', 'PX', ARGV[5])
  else
    written = redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
  end
  if written then result = result + 1 end
  redis.call('DEL', KEYS[2])
end
"#,
    announce_and_return!("6", "7")
);

/// A leader's renewal of its flight lock while its loader runs (contract §5.12).
/// `KEYS[1]`: the flight lock, `KEYS[2]`: its entry (one slot). `ARGV[1]`: the lock's
/// owner token, `ARGV[2]`: the new TTL (ms); `ARGV[3]`: what the entry must still hold,
/// as the leader's fill is fenced: `nx` (nothing), `eq` (exactly the bytes `ARGV[4]`) or
/// `set` (anything). Resets the TTL only while `ARGV[1]` holds the lock and the entry
/// holds what the fill expects: 1, else 0. A removal made during the load leaves a
/// tombstone that lives a lock TTL and more, so the next renewal, a third of the TTL on,
/// finds it and the lock is not kept past it: a renewed load never outlives a removal's
/// tombstone to fill over it.
pub const RENEW_FENCED: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[3] == 'nx' then
  if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
elseif ARGV[3] == 'eq' then
  if redis.call('GET', KEYS[2]) ~= ARGV[4] then return 0 end
end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"#;

/// `KEYS[1]`: the key. `ARGV[1]`: the bytes it must hold, `ARGV[2]`: the new bytes,
/// `ARGV[3]`: the TTL (ms). Replaces the bytes only if the key still holds exactly
/// `ARGV[1]`: 1, else 0. Writes back a touch without ever overwriting a newer value.
pub const REPLACE_IF_EQUAL: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"#;

/// The Lua the lock scripts share. Fencing counters are decimal strings compared as
/// strings (`below`: by length, then by digits), never as Lua numbers: Lua's doubles
/// hold integers exactly only below 2^53, and a counter may reach Redis's largest
/// integer, 2^63 - 1. `counter_of` reads a counter, and `holder_of` a lock's owner,
/// refusing another Redis type, or a counter that is not a canonical decimal integer,
/// with an error reply naming the key (`CORRAL_FOREIGN`): never a guess.
macro_rules! lock_prelude {
    () => {
        r#"
local function below(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function foreign(key, what)
  return redis.error_reply('CORRAL_FOREIGN ' .. key .. ' holds ' .. what .. ', not a Corral lock')
end
local function counter_of(key)
  local c = redis.pcall('GET', key)
  if type(c) == 'table' then return nil, foreign(key, 'a ' .. redis.call('TYPE', key).ok) end
  if c and (not (c == '0' or string.match(c, '^[1-9]%d*$')) or below('9223372036854775807', c)) then
    return nil, foreign(key, 'a string that is not a fencing counter')
  end
  return c or '0'
end
local function holder_of(key)
  local h = redis.pcall('GET', key)
  if type(h) == 'table' then return nil, foreign(key, 'a ' .. redis.call('TYPE', key).ok) end
  return h
end
"#
    };
}

/// The Lua that takes a lock, shared by [`LOCK_ACQUIRE`] and [`LOCK_ACQUIRE_FAIR`]:
/// `take()` takes `KEYS[1]` for the owner `ARGV[1]` for `ARGV[2]` ms if it is free and
/// returns the new fencing token (a decimal string, from `KEYS[2]`), else 0, or an error
/// reply (`CORRAL_FENCE_EXHAUSTED`, `CORRAL_FOREIGN`: also a busy lock key holding a
/// string with no TTL, which no Corral lock is).
macro_rules! lock_take {
    () => {
        r#"
local function take()
  local counter, refused = counter_of(KEYS[2])
  if refused then return refused end
  if counter == '9223372036854775807' then
    return redis.error_reply('CORRAL_FENCE_EXHAUSTED ' .. KEYS[2] .. ' is at the largest token Redis can count to')
  end
  if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    local t = redis.call('TIME')
    local floor = t[1] .. string.format('%06d', tonumber(t[2]))
    if below(counter, floor) then
      redis.call('SET', KEYS[2], floor)
    end
    -- INCR's reply would reach the caller through a Lua number: the string, exactly.
    redis.call('INCR', KEYS[2])
    return redis.call('GET', KEYS[2])
  end
  local holder, busy = holder_of(KEYS[1])
  if busy then return busy end
  -- A Corral lock always lapses: a string that never does is not one, and would
  -- read as held for good.
  if holder and redis.call('PTTL', KEYS[1]) == -1 then
    return foreign(KEYS[1], 'a string without a TTL')
  end
  return 0
end
"#
    };
}

/// The largest fencing token: Redis's largest integer (`INCR` refuses to go past it).
pub const MAX_FENCING_TOKEN: u64 = i64::MAX as u64;

/// [`FAIR_STALE_MS`], as a literal the scripts are built with.
macro_rules! fair_stale_ms {
    () => {
        5000
    };
}

/// `waiting(mark)` sets a lock's waiting mark for [`FAIR_STALE_MS`]: a waiter renews it
/// at each try it loses, so the mark outlives the waits between its tries. A mark that
/// cannot be set (a user without rights on it) leaves the waiter to its timer, never
/// fails the try.
macro_rules! lock_waiting {
    () => {
        concat!(
            "\nlocal function waiting(mark)\n  if mark then redis.pcall('SET', mark, '1', 'PX', ",
            fair_stale_ms!(),
            ") end\nend\n"
        )
    };
}

/// Lock acquire with fencing. `KEYS[1]`: the lock, `KEYS[2]`: its fencing counter.
/// `ARGV[1]`: the owner token, `ARGV[2]`: the TTL (ms). Takes the lock if free
/// (`SET NX PX`), else returns 0. Taken: raises the counter to at least the server's
/// `TIME` in microseconds (seconds and six digits of microseconds, as a string), then
/// returns it incremented, as a decimal string (an integer reply would pass through a
/// Lua number and come back rounded past 2^53). So a counter that was lost (a restart without persistence,
/// eviction, `DEL`) restarts above every earlier token, as long as the server's clock
/// did not step back and the key saw fewer than one acquire per microsecond on
/// average; counters of Redlock servers track their clocks, not their acquire counts.
/// `TIME` in a script needs effects replication: the default since Redis 5.
///
/// Tokens rise strictly at every counter value: the counter is checked before the lock
/// is taken, and a counter at [`MAX_FENCING_TOKEN`] refuses the acquire with an error
/// reply (`CORRAL_FENCE_EXHAUSTED`) instead of taking a lock it could give no larger
/// token. Another Redis type under either name is refused (`CORRAL_FOREIGN`), and so
/// is a busy lock key holding another type (`SET NX` alone would call it held).
///
/// A caller that will wait when the lock is held passes `KEYS[3]`, the lock's waiting
/// mark, and `ARGV[3]` = `wait`: a try that finds the lock held then sets the mark
/// (for [`FAIR_STALE_MS`]), and the holder's release announces itself ([`LOCK_RELEASE`]).
pub const LOCK_ACQUIRE: &str = concat!(
    lock_prelude!(),
    lock_take!(),
    lock_waiting!(),
    r#"
local result = take()
if result == 0 and ARGV[3] == 'wait' then waiting(KEYS[3]) end
return result
"#
);

/// How long a fair waiter keeps its place in a lock's queue after its last try (ms):
/// five times the longest wait between two tries ([`crate::flight::BACKOFF_MAX_MS`]), so
/// a waiter that is alive keeps its place even when each try also waits out a slow
/// server (the default response and connect timeouts add 1.5 s), and one that died (or
/// gave up without saying so) holds up those behind it for at most this long.
pub const FAIR_STALE_MS: u64 = fair_stale_ms!();

/// A fair lock's acquire: first come, first served across every process. `KEYS[1]`: the
/// lock, `KEYS[2]`: its fencing counter, `KEYS[3]`: its queue, optionally `KEYS[4]`: its
/// waiting mark (set by a `wait` that does not take the lock). `ARGV[1]`: the owner
/// token, `ARGV[2]`: the TTL (ms), as for [`LOCK_ACQUIRE`]; `ARGV[3]`: the waiter (one
/// id for all the tries of one acquire); `ARGV[4]`: what to do:
/// - `wait`: take the lock if it is free and no one is queued ahead (the queue is empty,
///   or this waiter is at its head); else queue at the back, or keep this waiter's place;
/// - `try`: take the lock if it is free and no one is queued; never queue;
/// - `leave`: give this waiter's place up (an acquire that stopped waiting): 0.
///
/// Answers as [`LOCK_ACQUIRE`] does: the fencing token, 0, or an error reply. The queue
/// is one string, a line `<waiter> <until>` per waiter in the order of the waiters' ids
/// ([`crate::lock::fair_waiter`]: when each started waiting), `until` in ms
/// on the server's clock (`TIME`): each try of a waiter moves its `until` to
/// [`FAIR_STALE_MS`] past now, and a waiter whose `until` passed is dropped. The key
/// expires that long after its last write and is deleted once empty; an acquire that
/// finds no queue and takes the lock writes nothing to it.
pub const LOCK_ACQUIRE_FAIR: &str = concat!(
    lock_prelude!(),
    lock_take!(),
    lock_waiting!(),
    r#"
local q = redis.pcall('GET', KEYS[3])
if type(q) == 'table' then return foreign(KEYS[3], 'a ' .. redis.call('TYPE', KEYS[3]).ok) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stale = "#,
    fair_stale_ms!(),
    r#"
local waiters, untils, mine, changed, joined = {}, {}, nil, false, false
for waiter, until_ in string.gmatch(q or '', '(%S+) (%d+)\n') do
  -- An until past now + stale was written before the server's clock stepped back.
  local u = math.min(tonumber(until_), now + stale)
  if u > now then
    waiters[#waiters + 1] = waiter
    untils[#waiters] = u
    if waiter == ARGV[3] then mine = #waiters end
  else
    changed = true
  end
end
-- A new waiter takes its place by its id first: at the head, it may take the lock now.
if ARGV[4] == 'wait' and not mine then
  mine = #waiters + 1
  for i = 1, #waiters do
    if ARGV[3] < waiters[i] then
      mine = i
      break
    end
  end
  table.insert(waiters, mine, ARGV[3])
  table.insert(untils, mine, 0)
  joined = true
end
local result = 0
if ARGV[4] ~= 'leave' and (#waiters == 0 or mine == 1) then
  result = take()
  if type(result) == 'table' then return result end
end
if mine and (result ~= 0 or ARGV[4] == 'leave') then
  table.remove(waiters, mine)
  table.remove(untils, mine)
  -- (Joined and taken in one step: the queue is as it was.)
  if not joined then changed = true end
elseif ARGV[4] == 'wait' then
  untils[mine] = now + stale
  changed = true
end
if result == 0 and ARGV[4] == 'wait' then waiting(KEYS[4]) end
if changed then
  if #waiters == 0 then
    redis.call('DEL', KEYS[3])
  else
    local lines = {}
    for i = 1, #waiters do lines[i] = waiters[i] .. ' ' .. string.format('%.0f', untils[i]) .. '\n' end
    redis.call('SET', KEYS[3], table.concat(lines), 'PX', stale)
  end
end
return result
"#
);

/// Owner-checked release. `KEYS[1]`: the lock, `KEYS[2]`: its fencing counter.
/// `ARGV[1]`: the owner token, `ARGV[2]`: the fencing token the lease carried (0: none);
/// optionally `ARGV[3]`, `ARGV[4]`: a channel and a message announcing the release, and
/// `KEYS[3]`: the lock's waiting mark, when the announcement is owed only to waiters
/// that marked it ([`LOCK_ACQUIRE`]; the mark is cleared as it is announced).
/// Raises the counter to at least that token (so a later holder on any majority gets
/// a larger one; compared and stored as the decimal string it came as, never a Lua
/// number), then deletes the lock if the owner holds it and publishes the
/// announcement in the same step (waiters wake at once, and a process that exits right
/// after its release owes nothing): 1, else 0.
pub const LOCK_RELEASE: &str = concat!(
    lock_prelude!(),
    r#"
local holder, refused = holder_of(KEYS[1])
if refused then return refused end
if ARGV[2] ~= '0' then
  local counter, bad = counter_of(KEYS[2])
  if bad then return bad end
  if below(counter, ARGV[2]) then
    redis.call('SET', KEYS[2], ARGV[2])
  end
end
if holder == ARGV[1] then
  local released = redis.call('DEL', KEYS[1])
  -- An announcement that cannot be made (a user without channel rights) never
  -- turns the release into a failure: waiters fall back to their timers.
  -- Announced only when a waiter marked the lock (or no mark is named): an
  -- uncontended release wakes nobody.
  if ARGV[3] and (not KEYS[3] or redis.pcall('DEL', KEYS[3]) == 1) then
    redis.pcall('PUBLISH', ARGV[3], ARGV[4])
  end
  return released
end
return 0
"#
);

/// Owner-checked extend. `KEYS[1]`: the lock. `ARGV[1]`: the owner token, `ARGV[2]`:
/// the new TTL (ms). Resets the TTL if the owner holds it: 1, else 0.
pub const LOCK_EXTEND: &str = concat!(
    lock_prelude!(),
    r#"
local holder, refused = holder_of(KEYS[1])
if refused then return refused end
if holder == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EXPIRES_AT_OFFSET, MAGIC, VERSION};

    #[test]
    fn fence_counters_are_written_as_strings_and_floored_at_the_server_clock() {
        // Lua formats numbers with 14 significant digits: a 16-digit token would come
        // back rounded or in exponent form, and INCR would refuse it.
        assert!(LOCK_ACQUIRE.contains("redis.call('SET', KEYS[2], floor)"));
        assert!(LOCK_ACQUIRE.contains("string.format('%06d'"));
        assert!(LOCK_RELEASE.contains("redis.call('SET', KEYS[2], ARGV[2])"));
        // No counter is ever turned into a Lua number (exact only below 2^53).
        for script in [LOCK_ACQUIRE, LOCK_RELEASE] {
            assert!(!script.contains("tonumber(counter"), "{script}");
            assert!(!script.contains("tonumber(ARGV[2])"), "{script}");
        }
        assert!(LOCK_ACQUIRE.contains(&MAX_FENCING_TOKEN.to_string()));
        assert!(
            !LOCK_ACQUIRE.contains("return redis.call('INCR'"),
            "no number on the way out"
        );
        let floor = LOCK_ACQUIRE.find("'TIME'").unwrap();
        assert!(floor < LOCK_ACQUIRE.find("'INCR'").unwrap(), "floor, then INCR");
    }

    #[test]
    fn a_fair_waiter_keeps_its_place_across_five_of_the_longest_waits_between_tries() {
        assert_eq!(FAIR_STALE_MS, 5 * crate::flight::BACKOFF_MAX_MS);
        assert!(LOCK_ACQUIRE_FAIR.contains(&format!("local stale = {FAIR_STALE_MS}\n")));
        // Numbers past 2^31 are never formatted with %d (a C long, 32 bits on some
        // builds of Lua).
        assert!(!LOCK_ACQUIRE_FAIR.contains("'%d'"));
        // The fair acquire takes the lock, and marks it waited for, exactly as the plain
        // one does; the mark lasts as long as a fair waiter's place.
        let take = LOCK_ACQUIRE.find("local function take()").unwrap();
        let end = LOCK_ACQUIRE.find("local result = take()").unwrap();
        assert!(LOCK_ACQUIRE_FAIR.contains(&LOCK_ACQUIRE[take..end]));
        assert!(LOCK_ACQUIRE.contains(&format!("'PX', {FAIR_STALE_MS})")));
    }

    #[test]
    fn the_script_agrees_with_the_envelope_layout() {
        // Lua strings are 1-based; SETRANGE offsets are 0-based.
        assert!(READ_AND_TOUCH.contains(&format!("SETRANGE', KEYS[1], {EXPIRES_AT_OFFSET},")));
        assert!(READ_AND_TOUCH.contains(&format!("u64({})", EXPIRES_AT_OFFSET + 1)));
        let magic = format!("'{}\\{}'", std::str::from_utf8(&MAGIC).unwrap(), VERSION);
        assert!(READ_AND_TOUCH.contains(&magic), "{magic}");
    }
}
