// The Redis connection of keyvalue-redis.mjs, in a worker thread: it performs each
// command the main thread posts on its port, posts the reply with the command's id, and
// rings the bell. RESP2 over one TCP connection, opened again after it is lost.
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
    default: return [{ error: `unexpected RESP byte ${buf[at]}` }, buf.length];
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

// Commands sent and not answered yet, in order: each reply answers the oldest. A reply
// carries its command's id, so the main thread can drop one it stopped waiting for.
const sent = [];
let pending = Buffer.alloc(0);
let socket = null;

function connect() {
  const s = createConnection({ host, port: redisPort });
  s.on('data', (chunk) => {
    pending = Buffer.concat([pending, chunk]);
    for (let parsed = parse(pending, 0); parsed; parsed = parse(pending, 0)) {
      pending = pending.subarray(parsed[1]);
      const id = sent.shift();
      if (id === undefined) continue;
      const [value] = parsed;
      answer(value && typeof value === 'object' && 'error' in value ? { id, error: value.error } : { id, value });
    }
  });
  // A connection that fails or closes fails what it still owes; the next command opens
  // a new one (a restarted server is reached again).
  const lost = (why) => {
    if (socket === s) socket = null;
    pending = Buffer.alloc(0);
    for (const id of sent.splice(0)) answer({ id, error: `redis: ${why}` });
  };
  s.on('error', (e) => lost(e.message));
  s.on('close', () => lost('the connection closed'));
  return s;
}

port.on('message', ({ id, args }) => {
  socket ??= connect();
  sent.push(id);
  socket.write(encode(args));
});
