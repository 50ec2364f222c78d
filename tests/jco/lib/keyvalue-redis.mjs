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

/** Sends one command and blocks until its reply; a failure is the interface's `other` error. */
function redis(...args) {
  Atomics.store(bell, 0, 0);
  port1.postMessage(args);
  if (Atomics.wait(bell, 0, 0, timeoutMs) === 'timed-out') {
    throw { tag: 'other', val: `redis did not answer ${args[0]} within ${timeoutMs} ms` };
  }
  const reply = receiveMessageOnPort(port1).message;
  if ('error' in reply) throw { tag: 'other', val: reply.error };
  return reply.value;
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
    const swapped = redis('EVAL', SWAP, '1', cas.name, present ? '1' : '0', present ? cas.seen : '', value);
    if (swapped !== 1n) {
      const again = new Cas();
      again.name = cas.name;
      again.seen = redis('GET', cas.name) ?? undefined;
      throw { tag: 'cas-failed', val: again };
    }
  },
  increment(bucket, key, delta) {
    return redis('INCRBY', bucket.prefix + key, delta.toString());
  },
};
