// The Redis connection of keyvalue-redis.mjs, in a worker thread: it performs each
// command the main thread posts on its port (one at a time: the main thread blocks until
// the answer), posts the reply, and rings the bell. RESP2 over one TCP connection.
import { workerData } from 'node:worker_threads';
import { createConnection } from 'node:net';

const { port, bell, host, redisPort } = workerData;

/** One RESP value at `at` in `buf`: `[value, next]`, or undefined when more bytes are needed. */
function parse(buf, at) {
  const eol = buf.indexOf('\r\n', at);
  if (eol < 0) return undefined;
  const line = buf.toString('latin1', at + 1, eol);
  const next = eol + 2;
  switch (buf[at]) {
    case 0x2b: return [line, next]; // +
    case 0x2d: return [{ error: line }, next]; // -
    case 0x3a: return [BigInt(line), next]; // :
    case 0x24: { // $
      const len = Number(line);
      if (len < 0) return [null, next];
      if (buf.length < next + len + 2) return undefined;
      return [Uint8Array.prototype.slice.call(buf, next, next + len), next + len + 2];
    }
    case 0x2a: { // *
      const n = Number(line);
      if (n < 0) return [null, next];
      const items = [];
      let pos = next;
      for (let i = 0; i < n; i += 1) {
        const item = parse(buf, pos);
        if (!item) return undefined;
        items.push(item[0]);
        pos = item[1];
      }
      return [items, pos];
    }
    default: throw new Error(`unexpected RESP byte ${buf[at]}`);
  }
}

function encode(args) {
  const parts = [Buffer.from(`*${args.length}\r\n`)];
  for (const arg of args) {
    const bytes = typeof arg === 'string' ? Buffer.from(arg) : Buffer.from(arg);
    parts.push(Buffer.from(`$${bytes.length}\r\n`), bytes, Buffer.from('\r\n'));
  }
  return Buffer.concat(parts);
}

const answer = (message) => {
  port.postMessage(message);
  Atomics.store(bell, 0, 1);
  Atomics.notify(bell, 0);
};

let pending = Buffer.alloc(0);
let waiting = null;
const socket = createConnection({ host, port: redisPort });
socket.on('data', (chunk) => {
  pending = Buffer.concat([pending, chunk]);
  const parsed = parse(pending, 0);
  if (!parsed || !waiting) return;
  pending = pending.subarray(parsed[1]);
  waiting = null;
  const [value] = parsed;
  answer(value && typeof value === 'object' && 'error' in value ? { error: value.error } : { value });
});
socket.on('error', (e) => {
  if (waiting) {
    waiting = null;
    answer({ error: `redis: ${e.message}` });
  }
});
port.on('message', (args) => {
  waiting = args;
  socket.write(encode(args));
});
