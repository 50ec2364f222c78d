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
import { resolve } from 'node:path';
import { fail, firstRead, freePort, printed, start, startOrigin, stop, wasiOnly } from './platform-run.mjs';

const app = resolve(process.argv[2] ?? 'target/platform/app-draft.wasm');
const wasmtime = process.env.WASMTIME ?? 'wasmtime';
const ORIGIN_MS = 200;

await wasiOnly(app);
const { calls, at: originAt, close: closeOrigin } = await startOrigin(ORIGIN_MS);
const port = await freePort();
const child = start(wasmtime, ['serve', '-Scli', '-Skeyvalue', '-Opooling-allocator=n', '--addr', `127.0.0.1:${port}`, '--env', `CORRAL_EXAMPLE_ORIGIN=${originAt}`, app]);
try {
  await printed(child, 'Serving HTTP', 120_000);
} catch (e) {
  fail(`wasmtime serve did not listen: ${e.message}`);
}
const base = `http://127.0.0.1:${port}`;
console.log(`platform: wasmtime serve on ${base} (wasi:keyvalue@0.2.0-draft, in memory), origin on ${originAt}`);

await firstRead(base, 'wasmtime serve');
const second = await fetch(`${base}/items/first`);
await second.text();
console.log(`platform: wasmtime serve: a second request found it ${second.headers.get('x-corral')} (${calls.get('first')} origin calls): each request has its own instance and its own copy of the store there`);
stop();
closeOrigin();
process.exit(0);
