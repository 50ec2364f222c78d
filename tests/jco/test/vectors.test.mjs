// The contract vectors (tests/vectors/*.json) against the Corral component in Node,
// transpiled by jco, with JavaScript implementations of its imports. The same `.wasm`
// file wasmtime loads (CORRAL_GUEST_WASM) is transpiled here at test time.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFile, readdir, mkdtemp, writeFile, mkdir, rm } from 'node:fs/promises';
import { createHash } from 'node:crypto';
import { tmpdir } from 'node:os';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { transpile } from '@bytecodealliance/jco';
import { WASIShim } from '@bytecodealliance/preview2-shim/instantiation';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '..', '..', '..');
const wasmPath = process.env.CORRAL_GUEST_WASM
  ?? join(process.env.CARGO_TARGET_DIR ?? join(root, 'target'), 'guest', 'wasm32-wasip2', 'guest', 'corral_guest.wasm');
const T0 = 1_700_000_000_000n;

/** Transpiles the component once; returns its `instantiate`. */
async function transpiled(bytes) {
  const { files } = await transpile(bytes, { name: 'corral', instantiation: 'async', quiet: true });
  const out = await mkdtemp(join(tmpdir(), 'corral-jco-'));
  for (const [name, data] of Object.entries(files)) {
    await mkdir(dirname(join(out, name)), { recursive: true });
    await writeFile(join(out, name), data);
  }
  // The core modules are read at each instantiation: keep them until the tests end.
  after(() => rm(out, { recursive: true, force: true }));
  return (await import(pathToFileURL(join(out, 'corral.js')).href)).instantiate;
}

/** The host side, in JavaScript: maps for L1, L2 and the lock table, a manual clock. */
function host() {
  const state = { now: T0, l1: new Map(), l2: new Map(), locks: new Map(), table: new Map(), loader: null, shouldCache: () => true, seq: 0 };
  const same = (a, b) => a !== undefined && b !== undefined && Buffer.compare(Buffer.from(a), Buffer.from(b)) === 0;
  const heldEq = (a, b) => (a === undefined && b === undefined) || (a !== undefined && b !== undefined && a.owner === b.owner && a.expiresAtMs === b.expiresAtMs);
  const imports = {
    'corral:cache/types': {},
    'corral:lock/types': {},
    'corral:cache/l1': {
      get: (key) => state.l1.get(key),
      set: (key, entry) => { state.l1.set(key, entry); },
      delete: (key) => { state.l1.delete(key); },
    },
    'corral:cache/l2': {
      get: (key) => state.l2.get(key),
      set: (key, value) => { state.l2.set(key, value); },
      delete: (key) => state.l2.delete(key),
      deleteIfEqual: (key, expected) => same(state.l2.get(key), expected) && state.l2.delete(key),
      replaceIfEqual: (key, expected, value) => {
        if (!same(state.l2.get(key), expected)) return false;
        state.l2.set(key, value);
        return true;
      },
      // One process, one flight at a time: the lock is always free here.
      tryLock: (key) => { const owner = `owner-${++state.seq}`; state.locks.set(key, owner); return owner; },
      releaseLock: (key, owner) => state.locks.get(key) === owner && state.locks.delete(key),
      waitLanding: () => {},
      announceLanding: () => {},
    },
    'corral:cache/local-lock': { acquire: () => true, release: () => {} },
    'corral:cache/loader': {
      load: (key) => state.loader(key),
      shouldCache: (key, value) => state.shouldCache(value),
    },
    'corral:lock/table': {
      get: (key) => state.table.get(key),
      compareAndSwap: (key, expected, next) => {
        if (!heldEq(state.table.get(key), expected)) return false;
        state.table.set(key, next);
        return true;
      },
      compareAndDelete: (key, expected) => heldEq(state.table.get(key), expected) && state.table.delete(key),
    },
  };
  const wasi = new WASIShim().getImportObject();
  const wallClock = {
    now: () => ({ seconds: state.now / 1000n, nanoseconds: Number(state.now % 1000n) * 1_000_000 }),
    resolution: () => ({ seconds: 0n, nanoseconds: 1_000_000 }),
  };
  for (const key of Object.keys(wasi)) {
    if (key.startsWith('wasi:clocks/wall-clock')) wasi[key] = wallClock;
  }
  wasi['wasi:clocks/wall-clock'] = wallClock;
  return { state, imports: { ...wasi, ...imports } };
}

/** A result as the vectors spell it. */
function outcome(run) {
  try {
    const v = run();
    return v === undefined ? { value: null } : { value: v };
  } catch (e) {
    const err = e.payload ?? e;
    switch (err.tag) {
      case 'invalid-argument': return { error: 'invalid-argument', argument: err.val.name };
      case 'loader-failed': return { error: 'loader' };
      default: return { error: err.tag ?? 'other' };
    }
  }
}

const text = (bytes) => bytes === undefined ? null : Buffer.from(bytes).toString('utf8');
const utf8 = (s) => new TextEncoder().encode(s ?? '');

function options(step, now) {
  const o = step.options ?? {};
  return {
    relativeMs: o.relative_ms === undefined ? undefined : BigInt(o.relative_ms),
    slidingMs: o.sliding_ms === undefined ? undefined : BigInt(o.sliding_ms),
    absoluteMs: o.absolute_in_ms === undefined ? undefined : now + BigInt(o.absolute_in_ms),
  };
}

function runStep(exports, state, step) {
  const cache = exports['corral:cache/cache@0.1.0'];
  const lock = exports['corral:lock/lock@0.1.0'];
  switch (step.op) {
    case 'set': {
      const r = outcome(() => cache.set(step.key, utf8(step.value), options(step, state.now)));
      return 'error' in r ? r : { ok: true };
    }
    case 'get': return outcome(() => text(cache.get(step.key)));
    case 'refresh': return outcome(() => cache.refresh(step.key));
    case 'remove': return outcome(() => cache.remove(step.key));
    case 'get_or_set': {
      let loads = 0;
      state.loader = () => {
        loads += 1;
        if ('value' in step.loader) return utf8(step.loader.value);
        throw step.loader.error;
      };
      state.shouldCache = () => step.should_cache ?? true;
      const r = outcome(() => text(cache.getOrSet(step.key, options(step, state.now), step.bypass ?? false)));
      return { ...r, loads };
    }
    case 'try_lock': return outcome(() => lock.tryLock(step.key, step.owner, BigInt(step.ttl_ms)));
    case 'unlock': return outcome(() => lock.unlock(step.key, step.owner));
    case 'is_locked_by': return outcome(() => lock.isLockedBy(step.key, step.owner));
    case 'is_lock_expired': return outcome(() => lock.isLockExpired(step.key));
    default: throw new Error(`unknown op ${step.op}`);
  }
}

test('the contract vectors pass in the component under jco', async () => {
  const bytes = await readFile(wasmPath);
  console.log(`component: ${wasmPath}, ${bytes.length} bytes, sha256 ${createHash('sha256').update(bytes).digest('hex')}`);
  const instantiate = await transpiled(bytes);
  const dir = process.env.CORRAL_VECTORS_DIR ?? join(root, 'tests', 'vectors');
  const vectors = [];
  for (const file of (await readdir(dir)).filter((f) => f.endsWith('.json')).sort()) {
    vectors.push(...JSON.parse(await readFile(join(dir, file), 'utf8')));
  }
  const failures = [];
  let steps = 0;
  for (const vector of vectors) {
    const { state, imports } = host();
    const exports = await instantiate(null, imports);
    const s = vector.settings ?? {};
    exports['corral:cache/cache@0.1.0'].configure({
      limits: {
        maxKeyBytes: s.max_key_bytes ?? 1024,
        maxValueBytes: s.max_value_bytes ?? 16 * 1024 * 1024,
        defaultSlidingMs: BigInt(s.default_sliding_ms ?? 20 * 60 * 1000),
      },
      l1TtlMs: 300_000n,
      lockWaitMs: 5_000n,
      lockTtlMs: 30_000n,
    });
    vector.steps.forEach((step, i) => {
      if (step.op === 'advance') {
        state.now += BigInt(step.ms);
        return;
      }
      steps += 1;
      const got = runStep(exports, state, step);
      const { loads, ...result } = got;
      try {
        assert.deepStrictEqual(result, step.expect);
        if (step.loads !== undefined) assert.equal(loads, step.loads, 'loader calls');
      } catch (e) {
        failures.push(`${vector.name} / step ${i} (${step.op}): expected ${JSON.stringify(step.expect)}, got ${JSON.stringify(result)}${step.loads !== undefined ? `, loads ${loads}/${step.loads}` : ''}`);
      }
    });
  }
  console.log(`component under jco: ${vectors.length} vectors, ${steps} steps, ${failures.length} mismatches`);
  assert.ok(vectors.length >= 40, 'at least 40 vectors');
  assert.deepStrictEqual(failures, []);
});
