// `wasi:keyvalue@0.2.0-draft2` (store and atomics) in memory, for jco: one map shared by
// every instance given these imports, with compare-and-swap that fails when the key
// changed since the handle read it (absent included), as the interface specifies.

const same = (a, b) =>
  (a === undefined && b === undefined) ||
  (a !== undefined && b !== undefined && Buffer.compare(Buffer.from(a), Buffer.from(b)) === 0);

/** The imports of a key-value store held in `map` (key -> Uint8Array). */
export function keyvalue(map) {
  class Bucket {
    get(key) { return map.get(key); }
    set(key, value) { map.set(key, Uint8Array.from(value)); }
    delete(key) { map.delete(key); }
    exists(key) { return map.has(key); }
    listKeys() { return { keys: [...map.keys()], cursor: undefined }; }
  }
  class Cas {
    static new(_bucket, key) {
      const cas = new Cas();
      cas.key = key;
      cas.seen = map.get(key);
      return cas;
    }
    current() { return this.seen; }
  }
  const store = { open: () => new Bucket(), Bucket, Error: undefined };
  const atomics = {
    Cas,
    swap(cas, value) {
      if (!same(map.get(cas.key), cas.seen)) throw { tag: 'cas-failed', val: Cas.new(null, cas.key) };
      map.set(cas.key, Uint8Array.from(value));
    },
    increment(_bucket, key, delta) {
      const next = BigInt(new TextDecoder().decode(map.get(key) ?? new Uint8Array()) || '0') + delta;
      map.set(key, new TextEncoder().encode(next.toString()));
      return next;
    },
  };
  delete store.Error;
  return { 'wasi:keyvalue/store': store, 'wasi:keyvalue/atomics': atomics };
}
