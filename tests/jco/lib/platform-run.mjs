// What the platform runs (platform-hosts.mjs, platform-wasmtime.mjs) share: the
// processes they start (each in a process group of its own, all stopped when the run
// ends, however it ends), the slow origin, and the checks both hosts must pass.
import { spawn } from 'node:child_process';
import { createServer } from 'node:http';
import { createServer as createTcpServer } from 'node:net';
import { once } from 'node:events';
import { readFile } from 'node:fs/promises';
import { worldOf } from './world.mjs';

const children = [];

/** Stops every process the run started. */
export function stop() {
  for (const child of children) {
    try { process.kill(-child.pid, 'SIGKILL'); } catch { /* gone */ }
  }
}
process.on('exit', stop);
// A run cancelled (a CI timeout, ^C) stops what it started too.
process.on('SIGINT', () => process.exit(130));
process.on('SIGTERM', () => process.exit(143));

/** Ends the run: says why, exit code 1. */
export function fail(why) {
  console.error(`platform: FAILED: ${why}`);
  process.exit(1);
}

/** A loopback port free now. */
export async function freePort() {
  const server = createTcpServer().listen(0, '127.0.0.1');
  await once(server, 'listening');
  const { port } = server.address();
  server.close();
  return port;
}

/** Starts `cmd` in a process group of its own (so that its children stop with it). */
export function start(cmd, args, env = {}, stdio = ['ignore', 'pipe', 'pipe']) {
  const child = spawn(cmd, args, { env: { ...process.env, ...env }, detached: true, stdio });
  child.on('error', (e) => fail(`${cmd} did not start: ${e.message}`));
  children.push(child);
  return child;
}

/** Resolves once `child` printed `text` on stdout or stderr, within `ms`. */
export function printed(child, text, ms) {
  return new Promise((ok, no) => {
    let seen = '';
    const timer = setTimeout(() => no(new Error(`no "${text}" within ${ms} ms; it printed: ${seen.slice(-2000)}`)), ms);
    const look = (chunk) => {
      seen += chunk;
      if (seen.includes(text)) { clearTimeout(timer); ok(); }
    };
    child.stdout.on('data', look);
    child.stderr.on('data', look);
    child.on('exit', (code) => { clearTimeout(timer); no(new Error(`exited with ${code}: ${seen.slice(-2000)}`)); });
  });
}

/** Fails the run unless the component at `path` imports `wasi:*` only. */
export async function wasiOnly(path) {
  const { imports } = await worldOf(await readFile(path));
  const foreign = imports.filter((i) => !i.startsWith('wasi:'));
  if (foreign.length) fail(`${path} imports ${foreign.join(', ')}`);
  console.log(`platform: ${path} imports ${imports.length} interfaces, all wasi:*`);
}

/** The slow origin: answers `item {id} from the origin` after `ms`, counting its calls per id. */
export async function startOrigin(ms) {
  const calls = new Map();
  const server = createServer((req, res) => {
    const id = decodeURIComponent(req.url.replace(/^\/items\//, ''));
    calls.set(id, (calls.get(id) ?? 0) + 1);
    setTimeout(() => res.end(`item ${id} from the origin`), ms);
  }).listen(0, '127.0.0.1');
  await once(server, 'listening');
  return { calls, at: `127.0.0.1:${server.address().port}`, close: () => server.close() };
}

/** The app at `base` answers `GET /items/first` with the origin's value, loaded, and a
 * second read of the id within the request is a hit. */
export async function firstRead(base, host) {
  const res = await fetch(`${base}/items/first`);
  const body = await res.text();
  if (res.status !== 200 || body !== 'item first from the origin') fail(`${host}: GET /items/first: ${res.status} ${body}`);
  if (res.headers.get('x-corral') !== 'loaded' || res.headers.get('x-corral-again') !== 'hit') {
    fail(`${host}: GET /items/first: x-corral ${res.headers.get('x-corral')}, x-corral-again ${res.headers.get('x-corral-again')}`);
  }
  console.log(`platform: ${host}: GET /items/first answered the origin's value (loaded), and a second read within the request was a hit`);
}
