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
