// The example application built on `wasi:keyvalue@0.2.0-draft` (target/platform/
// app-draft.wasm) under `wasmtime serve -S cli -S keyvalue`, a host this project did not
// write, in front of a slow origin that counts its calls.
// Usage: node lib/platform-wasmtime.mjs APP.wasm (WASMTIME names the binary; default
// `wasmtime` on the PATH).
//
// Checks, each failing the run with exit 1: the app imports only `wasi:*`; it answers with the origin's value, and
// a second read of the id within the same request is a hit. Then says what a second
// request finds: wasmtime's in-memory store is private to each `open`, and a
// `wasi:http@0.2` server instantiates per request, so nothing is shared between requests.
import { spawn } from 'node:child_process';
import { createServer } from 'node:http';
import { createServer as createTcpServer } from 'node:net';
import { resolve } from 'node:path';
import { once } from 'node:events';
import { readFile } from 'node:fs/promises';
import { componentWit } from '@bytecodealliance/jco';

const app = resolve(process.argv[2] ?? 'target/platform/app-draft.wasm');
const wasmtime = process.env.WASMTIME ?? 'wasmtime';
const ORIGIN_MS = 200;

let child = null;
const stop = () => { try { if (child) process.kill(-child.pid, 'SIGKILL'); } catch { /* gone */ } };
process.on('exit', stop);
process.on('SIGINT', () => process.exit(130));
process.on('SIGTERM', () => process.exit(143));
const fail = (why) => {
  console.error(`platform: FAILED: ${why}`);
  process.exit(1);
};

{
  const wit = await componentWit(await readFile(app));
  const foreign = [...wit.matchAll(/^\s*import ([^;]+);/gm)].map((m) => m[1]).filter((i) => !i.startsWith('wasi:'));
  if (foreign.length) fail(`${app} imports ${foreign.join(', ')}`);
}

const calls = new Map();
const origin = createServer((req, res) => {
  const id = decodeURIComponent(req.url.replace(/^\/items\//, ''));
  calls.set(id, (calls.get(id) ?? 0) + 1);
  setTimeout(() => res.end(`item ${id} from the origin`), ORIGIN_MS);
}).listen(0, '127.0.0.1');
await once(origin, 'listening');
const originAt = `127.0.0.1:${origin.address().port}`;

const probe = createTcpServer().listen(0, '127.0.0.1');
await once(probe, 'listening');
const port = probe.address().port;
probe.close();

child = spawn(wasmtime, ['serve', '-Scli', '-Skeyvalue', '-Opooling-allocator=n', '--addr', `127.0.0.1:${port}`, '--env', `CORRAL_EXAMPLE_ORIGIN=${originAt}`, app], {
  detached: true,
  stdio: ['ignore', 'pipe', 'pipe'],
});
child.on('error', (e) => fail(`${wasmtime} did not start: ${e.message}`));
await new Promise((ok) => {
  let seen = '';
  const timer = setTimeout(() => fail(`wasmtime serve did not listen within 120 s: ${seen.slice(-2000)}`), 120_000);
  const look = (chunk) => {
    seen += chunk;
    if (seen.includes('Serving HTTP')) { clearTimeout(timer); ok(); }
  };
  child.stdout.on('data', look);
  child.stderr.on('data', look);
  child.on('exit', (code) => fail(`wasmtime serve exited with ${code}: ${seen.slice(-2000)}`));
});
const base = `http://127.0.0.1:${port}`;
console.log(`platform: wasmtime serve on ${base} (wasi:keyvalue@0.2.0-draft, in memory), origin on ${originAt}`);

const first = await fetch(`${base}/items/first`);
const body = await first.text();
if (first.status !== 200 || body !== 'item first from the origin') fail(`GET /items/first: ${first.status} ${body}`);
if (first.headers.get('x-corral') !== 'loaded' || first.headers.get('x-corral-again') !== 'hit') {
  fail(`GET /items/first: x-corral ${first.headers.get('x-corral')}, x-corral-again ${first.headers.get('x-corral-again')}`);
}
console.log('platform: wasmtime serve: GET /items/first answered the origin\'s value (loaded), and a second read within the request was a hit');
const second = await fetch(`${base}/items/first`);
await second.text();
console.log(`platform: wasmtime serve: a second request found it ${second.headers.get('x-corral')} (${calls.get('first')} origin calls): each request has its own instance and its own copy of the store there`);
stop();
origin.close();
process.exit(0);
