// The example application (target/platform/app.wasm: platform/app composed with
// corral-wasi.wasm) on hosts this project did not write: two `jco serve` processes whose
// `wasi:keyvalue` is one real redis-server (keyvalue-redis.mjs), in front of a slow
// origin that counts its calls. Usage: node lib/platform-hosts.mjs APP.wasm
//
// Checks, each failing the run with exit 1:
//   0. the composed application imports only `wasi:*`;
//   1. the app answers with the origin's value, and a second read of the id within the
//      same request is a hit;
//   2. 500 concurrent requests for one cold id, split over both hosts, make exactly one
//      origin call and all get the origin's value;
//   3. a PUT through one host is served by the other within the app's L1 TTL (1 s), plus
//      1 s for the requests in flight on a busy machine.
// The last line reads `platform: N origin calls for 500 requests over 2 hosts`.
import { createConnection } from 'node:net';
import { resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { fail, firstRead, freePort, printed, start, startOrigin, stop, wasiOnly } from './platform-run.mjs';

const here = dirname(fileURLToPath(import.meta.url));
const app = resolve(process.argv[2] ?? 'target/platform/app.wasm');
const jco = resolve(here, '..', 'node_modules', '@bytecodealliance', 'jco', 'dist', 'jco.js');
const keyvalue = resolve(here, 'keyvalue-redis.mjs');
const REQUESTS = 500;
const ORIGIN_MS = 200;
const L1_TTL_MS = 1000;
const POLL_MS = 20;
const SLACK_MS = 1000;

async function redisUp(port) {
  for (let i = 0; i < 100; i += 1) {
    const ok = await new Promise((done) => {
      const s = createConnection({ host: '127.0.0.1', port }, () => s.write('PING\r\n'));
      s.setTimeout(500, () => { s.destroy(); done(false); });
      s.on('data', (d) => { s.destroy(); done(d.toString().startsWith('+PONG')); });
      s.on('error', () => done(false));
    });
    if (ok) return;
    await new Promise((r) => setTimeout(r, 50));
  }
  fail(`redis-server on ${port} did not answer`);
}

const percentile = (sorted, p) => sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];

// 0. The application, composed, imports nothing but `wasi:*`.
await wasiOnly(app);

// The origin: slow, counting its calls per id.
const { calls, at: originAt, close: closeOrigin } = await startOrigin(ORIGIN_MS);

const redisPort = await freePort();
start(process.env.REDIS_SERVER_BIN ?? 'redis-server', ['--port', String(redisPort), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], {}, 'ignore');
await redisUp(redisPort);

const hosts = [];
for (let i = 0; i < 2; i += 1) {
  const port = await freePort();
  const child = start(process.execPath, [jco, 'serve', app, '--port', String(port), '--host', '127.0.0.1', '--jco-map', `wasi:keyvalue/*=${keyvalue}#*`], {
    CORRAL_REDIS_PORT: String(redisPort),
    CORRAL_EXAMPLE_ORIGIN: originAt,
  });
  try {
    await printed(child, 'Server listening', 120_000);
  } catch (e) {
    fail(`jco serve (host ${i}) did not start: ${e.message}`);
  }
  hosts.push(`http://127.0.0.1:${port}`);
}
console.log(`platform: 2 jco serve hosts (${hosts.join(', ')}), redis-server on ${redisPort}, origin on ${originAt} (${ORIGIN_MS} ms a call)`);

// 1. The origin's value, and a hit on a second read within the request.
await firstRead(hosts[0], 'jco serve');

// 2. One cold id, 500 concurrent requests over both hosts.
{
  const started = performance.now();
  const results = await Promise.all(Array.from({ length: REQUESTS }, async (_, i) => {
    const t0 = performance.now();
    const res = await fetch(`${hosts[i % 2]}/items/cold`);
    const body = await res.text();
    return { ms: performance.now() - t0, status: res.status, body, how: res.headers.get('x-corral') };
  }));
  const wall = performance.now() - started;
  const bad = results.filter((r) => r.status !== 200 || r.body !== 'item cold from the origin');
  if (bad.length) fail(`${bad.length} of ${REQUESTS} requests got something else, first: ${bad[0].status} ${bad[0].body}`);
  const loaded = results.filter((r) => r.how === 'loaded').length;
  if (loaded !== 1) fail(`${loaded} requests say they loaded the value`);
  const ms = results.map((r) => r.ms).sort((a, b) => a - b);
  console.log(`platform: ${REQUESTS} requests for one cold id over 2 hosts: p50 ${percentile(ms, 50).toFixed(1)} ms, p99 ${percentile(ms, 99).toFixed(1)} ms, max ${ms[ms.length - 1].toFixed(1)} ms, all in ${wall.toFixed(0)} ms`);
}
const coldCalls = calls.get('cold') ?? 0;
if (coldCalls !== 1) fail(`${coldCalls} origin calls for one cold id`);

// 3. A write through one host, served by the other.
{
  // Host 1 holds the old value in L1 when the write lands.
  const before = await fetch(`${hosts[1]}/items/cold`);
  if ((await before.text()) !== 'item cold from the origin' || before.headers.get('x-corral') !== 'hit') fail('host 1 did not hold the old value');
  const put = await fetch(`${hosts[0]}/items/cold`, { method: 'PUT', body: 'written through host 0' });
  if (put.status !== 204) fail(`PUT: ${put.status} ${await put.text()}`);
  const t0 = performance.now();
  let seen = '';
  while (performance.now() - t0 < L1_TTL_MS + 2000) {
    seen = await (await fetch(`${hosts[1]}/items/cold`)).text();
    if (seen === 'written through host 0') break;
    await new Promise((r) => setTimeout(r, POLL_MS));
  }
  const after = performance.now() - t0;
  if (seen !== 'written through host 0') fail(`host 1 still served "${seen}" ${after.toFixed(0)} ms after the PUT`);
  // The bound is the L1 TTL, plus the requests in flight meanwhile on a busy machine.
  if (after > L1_TTL_MS + SLACK_MS) fail(`host 1 served the write only after ${after.toFixed(0)} ms (bound: the L1 TTL, ${L1_TTL_MS} ms)`);
  console.log(`platform: a PUT through host 0 was served by host 1 after ${after.toFixed(0)} ms (bound: the L1 TTL, ${L1_TTL_MS} ms)`);
}

stop();
closeOrigin();
console.log(`platform: ${coldCalls} origin calls for ${REQUESTS} requests over 2 hosts`);
process.exit(0);
