// `wasi:keyvalue@0.2.0-draft2` (store and atomics) on a real redis-server, for jco: a
// host's standard interface, nothing of Corral's. Map it with
//   jco serve app.wasm --jco-map 'wasi:keyvalue/*=/ABSOLUTE/PATH/keyvalue-redis.mjs#*'
// and give the server as CORRAL_REDIS_HOST / CORRAL_REDIS_PORT (127.0.0.1:6379).
//
// Component imports are synchronous: each command goes to a worker thread that holds the
// connection (redis-worker.mjs), and this thread blocks until its answer (at most
// CORRAL_REDIS_TIMEOUT_MS, 5 s). A bucket's keys are its identifier, a colon, and the key.
// Compare-and-swap is one Lua script: the write lands only if the key still holds what
// `cas.new` read (absent included).
import { MessageChannel, Worker, receiveMessageOnPort } from 'node:worker_threads';

const host = process.env.CORRAL_REDIS_HOST ?? '127.0.0.1';
const redisPort = Number(process.env.CORRAL_REDIS_PORT ?? 6379);
const timeoutMs = Number(process.env.CORRAL_REDIS_TIMEOUT_MS ?? 5000);

const { port1, port2 } = new MessageChannel();
const bell = new Int32Array(new SharedArrayBuffer(4));
const worker = new Worker(new URL('./redis-worker.mjs', import.meta.url), {
  workerData: { port: port2, bell, host, redisPort },
  transferList: [port2],
});
worker.unref();
let workerError = null;
worker.on('error', (e) => { workerError = e; });
let nextId = 0;

/** Sends one command and blocks until its reply; a failure is the interface's `other`
 * error. A reply that comes after its command timed out is dropped, never taken for the
 * next command's. */
function redis(...args) {
  if (workerError) throw { tag: 'other', val: `the redis worker failed: ${workerError.message}` };
  const id = ++nextId;
  const deadline = performance.now() + timeoutMs;
  Atomics.store(bell, 0, 0);
  port1.postMessage({ id, args });
  for (;;) {
    const message = receiveMessageOnPort(port1)?.message;
    if (message === undefined) {
      const left = deadline - performance.now();
      if (left <= 0 || Atomics.wait(bell, 0, 0, left) === 'timed-out') {
        throw { tag: 'other', val: `redis did not answer ${args[0]} within ${timeoutMs} ms` };
      }
      Atomics.store(bell, 0, 0);
      continue;
    }
    if (message.id !== id) continue;
    if ('error' in message) throw { tag: 'other', val: message.error };
    return message.value;
  }
}

const SWAP = `local cur = redis.call('GET', KEYS[1])
if ARGV[1] == '1' then
  if cur ~= ARGV[2] then return 0 end
elseif cur then
  return 0
end
redis.call('SET', KEYS[1], ARGV[3])
return 1`;

class Bucket {
  constructor(name) { this.prefix = `${name}:`; }
  get(key) { return redis('GET', this.prefix + key) ?? undefined; }
  set(key, value) { redis('SET', this.prefix + key, value); }
  delete(key) { redis('DEL', this.prefix + key); }
  exists(key) { return redis('EXISTS', this.prefix + key) === 1n; }
  listKeys(cursor) {
    const [next, keys] = redis('SCAN', cursor ?? '0', 'MATCH', `${this.prefix}*`);
    const text = (b) => Buffer.from(b).toString('utf8');
    return {
      keys: keys.map((k) => text(k).slice(this.prefix.length)),
      cursor: text(next) === '0' ? undefined : text(next),
    };
  }
}

class Cas {
  static new(bucket, key) {
    const cas = new Cas();
    cas.name = bucket.prefix + key;
    cas.seen = redis('GET', cas.name) ?? undefined;
    return cas;
  }
  current() { return this.seen; }
}

export const store = { open: (name) => new Bucket(name), Bucket };

export const atomics = {
  Cas,
  swap(cas, value) {
    const present = cas.seen !== undefined;
    let swapped;
    const again = new Cas();
    try {
      swapped = redis('EVAL', SWAP, '1', cas.name, present ? '1' : '0', present ? cas.seen : '', value);
      if (swapped === 1n) return;
      again.name = cas.name;
      again.seen = redis('GET', cas.name) ?? undefined;
    } catch (e) {
      // `swap`'s own error type: a store failure is `store-error`.
      throw { tag: 'store-error', val: e };
    }
    throw { tag: 'cas-failed', val: again };
  },
  increment(bucket, key, delta) {
    return redis('INCRBY', bucket.prefix + key, delta.toString());
  },
};
