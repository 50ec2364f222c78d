// The Redis-backed `wasi:keyvalue` the platform run maps into jco (lib/keyvalue-redis.mjs),
// against a real redis-server this test starts on a free port and stops by its pid.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { createServer } from 'node:net';
import { once } from 'node:events';

const server = createServer().listen(0, '127.0.0.1');
await once(server, 'listening');
const port = server.address().port;
server.close();
const redis = spawn(process.env.REDIS_SERVER_BIN ?? 'redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], { stdio: 'ignore' });
after(() => redis.kill('SIGKILL'));
const cli = (...args) => execFileSync('redis-cli', ['-p', String(port), ...args]).toString().trim();
for (let i = 0; i < 100 && (() => { try { return cli('PING') !== 'PONG'; } catch { return true; } })(); i += 1) {
  await new Promise((r) => setTimeout(r, 50));
}
process.env.CORRAL_REDIS_PORT = String(port);
const { store, atomics } = await import('../lib/keyvalue-redis.mjs');
const bytes = (s) => new TextEncoder().encode(s);
const text = (b) => (b === undefined ? undefined : Buffer.from(b).toString());

test('compare-and-swap lands only over what it read, absent and empty told apart', () => {
  const bucket = store.open('cas');
  bucket.set('k', bytes('v1'));
  const stale = atomics.Cas.new(bucket, 'k');
  bucket.set('k', bytes('v2'));
  assert.throws(() => atomics.swap(stale, bytes('v3')), (e) => e.tag === 'cas-failed' && text(e.val.current()) === 'v2');
  assert.equal(text(bucket.get('k')), 'v2');
  const fresh = atomics.Cas.new(bucket, 'k');
  atomics.swap(fresh, bytes('v3'));
  assert.equal(text(bucket.get('k')), 'v3');
  const absent = atomics.Cas.new(bucket, 'none');
  atomics.swap(absent, new Uint8Array());
  assert.equal(bucket.get('none')?.length, 0, 'an empty value is a value');
  const empty = atomics.Cas.new(bucket, 'none');
  bucket.delete('none');
  assert.throws(() => atomics.swap(empty, bytes('x')), (e) => e.tag === 'cas-failed', 'read empty, now absent: changed');
});

test('a connection the server closes is opened again, and no reply is taken for another command\'s', () => {
  const bucket = store.open('conn');
  bucket.set('a', bytes('A'));
  bucket.set('b', bytes('B'));
  cli('CLIENT', 'KILL', 'TYPE', 'normal');
  let first;
  try { first = text(bucket.get('a')); } catch (e) { first = e.tag; }
  assert.ok(first === 'A' || first === 'other', `the first read after the kill: ${first}`);
  assert.equal(text(bucket.get('b')), 'B');
  assert.equal(text(bucket.get('a')), 'A');
});
