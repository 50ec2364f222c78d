// A get-or-set over the component's two phases, as an application drives it: `begin`,
// then, when it leads, its own origin's load and the end of the component's `load`
// (`complete` or `fail`). A load the origin abandons (it throws) is dropped, which
// releases the flight lock and hands the flight on, and the throw goes on to the caller.

/** A get-or-set of `key` through `cache` (the `corral:cache/cache` export) and `origin`:
 * `{ load(key) -> bytes | { tag: 'err', val: text }, shouldCache(bytes) -> bool }`. */
export function getOrSet(cache, key, options, bypass, tags, origin) {
  const begun = cache.begin(key, options, bypass, tags);
  switch (begun.tag) {
    case 'hit':
      return begun.val;
    case 'lead':
      return end(cache, begun.val, origin);
    case 'refresh': {
      // Served as a hit; the refresh's own outcome changes nothing for this caller.
      const [value, load] = begun.val;
      try {
        end(cache, load, origin);
      } catch (e) {
        if (e?.payload === undefined) throw e;
      }
      return value;
    }
    case 'wait':
      drop(begun.val);
      throw new Error(`a caller of a fresh instance was made to follow the load of ${key}`);
    default:
      throw new Error(`unknown begun ${begun.tag}`);
  }
}

function end(cache, load, origin) {
  let loaded;
  try {
    loaded = origin.load(load.key());
  } catch (e) {
    drop(load);
    throw e;
  }
  if (loaded?.tag === 'err') return cache.Load.fail(load, loaded.val);
  return cache.Load.complete(load, loaded, origin.shouldCache(loaded));
}

/** Drops a resource handle now (the component runs its destructor). */
export function drop(resource) {
  const dispose = resource[Symbol.dispose] ?? resource[Symbol.for('dispose')];
  if (typeof dispose !== 'function') throw new Error('this jco build gives resources no dispose method');
  dispose.call(resource);
}

/** What a batch's load of a key its loader left out ends with: the host's text for an
 * absent key (host/src/error.rs `Absent`), which the caller answers as none. */
export const ABSENT = 'the batch loader returned no value for this key';

/** Runs one component call that returns a result: `{ok}` or `{err}` (its error). */
function settled(run) {
  try {
    return { ok: run() };
  } catch (e) {
    if (e?.payload === undefined) throw e;
    return { err: e.payload };
  }
}

/** A get-or-set of many `keys` through `cache` and `origin`:
 * `{ loadMany(keys) -> [[key, bytes], ...] | { tag: 'err', val: text }, shouldCache(bytes) -> bool }`.
 * `begin-many` answers each distinct key; the loads it hands out are loaded with one
 * `loadMany`, then the waits are asked. Returns `{ok}` (absent: undefined) or `{err}`
 * per key asked, in order; throws the call's own error. */
export function getOrSetMany(cache, keys, options, tags, origin) {
  const distinct = [...new Set(keys)];
  const begun = cache.beginMany(distinct, options, false, tags);
  const answers = new Array(distinct.length);
  const loads = [];
  const waits = [];
  begun.forEach((b, i) => {
    if (b.tag === 'err') {
      answers[i] = { err: b.val };
      return;
    }
    const v = b.val;
    switch (v.tag) {
      case 'hit': answers[i] = { ok: v.val }; break;
      case 'lead': loads.push([i, v.val, true]); break;
      case 'refresh': answers[i] = { ok: v.val[0] }; loads.push([i, v.val[1], false]); break;
      case 'wait': waits.push([i, v.val]); break;
      default: throw new Error(`unknown begun ${v.tag}`);
    }
  });
  try {
    loadAll(cache, distinct, loads, origin, answers);
  } catch (e) {
    waits.forEach(([, follower]) => drop(follower));
    throw e;
  }
  for (const [at, [i, follower]] of waits.entries()) {
    let followed;
    try {
      followed = follower.outcome();
    } finally {
      drop(follower);
    }
    if (followed.tag === 'ready') {
      answers[i] = followed.val.tag === 'ok' ? { ok: followed.val.val } : { err: followed.val.val };
    } else if (followed.tag === 'lead') {
      try {
        loadAll(cache, distinct, [[i, followed.val, true]], origin, answers);
      } catch (e) {
        waits.slice(at + 1).forEach(([, f]) => drop(f));
        throw e;
      }
    } else {
      waits.slice(at + 1).forEach(([, f]) => drop(f));
      throw new Error(`a batch's key ${distinct[i]} was made to wait on its own instance`);
    }
  }
  const absent = (a) => (a.err?.tag === 'loader-failed' && a.err.val === ABSENT ? { ok: undefined } : a);
  return keys.map((k) => absent(answers[distinct.indexOf(k)]));
}

/** One `loadMany` for every load held; each load ends with what it gave. */
function loadAll(cache, keys, loads, origin, answers) {
  if (loads.length === 0) return;
  let loaded;
  try {
    // The loads' timeouts count from the origin call.
    loads.forEach(([, load]) => load.begin());
    loaded = origin.loadMany(loads.map(([i]) => keys[i]));
  } catch (e) {
    loads.forEach(([, load]) => drop(load));
    throw e;
  }
  const values = loaded?.tag === 'err' ? null : new Map(loaded);
  for (const [i, load, answersKey] of loads) {
    let answer;
    if (values === null) answer = settled(() => cache.Load.fail(load, loaded.val));
    else if (values.has(keys[i])) {
      const value = values.get(keys[i]);
      answer = settled(() => cache.Load.complete(load, value, origin.shouldCache(value)));
    } else answer = settled(() => cache.Load.fail(load, ABSENT));
    if (answersKey) answers[i] = answer;
  }
}
