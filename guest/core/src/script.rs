//! Server-side Lua for Redis stores.
//!
//! [`READ_AND_TOUCH`] reads an envelope and applies [`crate::expiry::check`] on the
//! server, so a sliding read costs one round trip and cannot race another writer. It is
//! the one place the expiry rule is written a second time, in Lua; the contract suite
//! runs it against a real Redis beside the Rust rule.
//!
//! Timestamps are below 2^53, so Lua's doubles hold them exactly.

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

/// `KEYS[1]`: the key. `ARGV[1]`: the bytes it must hold. Deletes the key only if it
/// still holds exactly those bytes; returns 1 when deleted, else 0. Used to remove a
/// corrupt entry without removing a good one written since, and to release a lock.
pub const DELETE_IF_EQUAL: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
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

/// Lock acquire with fencing. `KEYS[1]`: the lock, `KEYS[2]`: its fencing counter.
/// `ARGV[1]`: the owner token, `ARGV[2]`: the TTL (ms). Takes the lock if free
/// (`SET NX PX`), else returns 0. Taken: raises the counter to at least the server's
/// `TIME` in microseconds (seconds and six digits of microseconds, as a string: Lua's
/// number formatting would round it), then returns it incremented. So a counter that
/// was lost (a restart without persistence, eviction, `DEL`) restarts above every
/// earlier token, as long as the server's clock did not step back and the key saw
/// fewer than one acquire per microsecond on average; counters of Redlock servers
/// track their clocks, not their acquire counts. `TIME` in a script needs effects
/// replication: the default since Redis 5.
pub const LOCK_ACQUIRE: &str = r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  local floor = t[1] .. string.format('%06d', tonumber(t[2]))
  local counter = redis.call('GET', KEYS[2])
  if not counter or tonumber(counter) < tonumber(floor) then
    redis.call('SET', KEYS[2], floor)
  end
  return redis.call('INCR', KEYS[2])
end
return 0
"#;

/// Owner-checked release. `KEYS[1]`: the lock, `KEYS[2]`: its fencing counter.
/// `ARGV[1]`: the owner token, `ARGV[2]`: the fencing token the lease carried (0: none).
/// Raises the counter to at least that token (so a later holder on any majority gets
/// a larger one; the token is stored as the string it came as, never a Lua number),
/// then deletes the lock if the owner holds it: 1, else 0.
pub const LOCK_RELEASE: &str = r#"
local fence = tonumber(ARGV[2])
if fence > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') < fence then
  redis.call('SET', KEYS[2], ARGV[2])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// Owner-checked extend. `KEYS[1]`: the lock. `ARGV[1]`: the owner token, `ARGV[2]`:
/// the new TTL (ms). Resets the TTL if the owner holds it: 1, else 0.
pub const LOCK_EXTEND: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

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
        let floor = LOCK_ACQUIRE.find("'TIME'").unwrap();
        assert!(floor < LOCK_ACQUIRE.find("'INCR'").unwrap(), "floor, then INCR");
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
