// The contract vectors (tests/vectors/*.json) against the Corral component in Node,
// transpiled by jco, with JavaScript implementations of its imports. The same `.wasm`
// file wasmtime loads (CORRAL_GUEST_WASM) is transpiled here at test time.
//
// A vector's host state (L1, L2, the lock table, the flight registry, the manual clock,
// the loader script of the callers' origin) lives in this thread, and its sequential
// steps run here, on one instance. A `get_or_set_together` step needs several calls blocked inside the
// component at once, which one JS thread cannot do: each of its callers runs in a worker
// thread (../lib/caller.mjs) with an instance of its own, configured alike, whose Corral
// imports and wall clock are this thread's, called synchronously:
//   - the worker instantiates and configures, posts 'ready', and waits for 'go';
//   - on 'go' it runs a get-or-set (../lib/get-or-set.mjs). Each import call, and its
//     origin's load, posts {iface, fn, args} on the worker's MessagePort and blocks in
//     Atomics.wait on a shared Int32 (the bell);
//   - this thread posts {value} or {trap} on the port, then rings the bell (stores 1,
//     notifies); the worker takes the answer with receiveMessageOnPort, and throws on
//     {trap}, which traps its call. Some answers are held back: a follower's `join`
//     until its leader finishes or goes away, a leader's `load` until every other
//     caller still running waits on the flight;
//   - the worker posts the call's {ok}, {err} or {trap}; this thread ends its flight if
//     it still led one (a leader gone), and terminates the workers after the step.
// Every wait is bounded (WAIT_MS in a worker, STEP_MS here) and fails with a message.
//
// A vector's steps may name a `process` ("a" by default): each process is an instance
// with a host of its own (L1, flight registry), and all of them share the world (the
// clock, L2, the get-or-set locks, the lock table). A process's landing announcement
// reaches every other process's L1 at once. A loader's `during` steps run, in other
// processes, inside the load.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFile, readdir, mkdtemp, writeFile, mkdir, rm } from 'node:fs/promises';
import { createHash } from 'node:crypto';
import { tmpdir } from 'node:os';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { isDeepStrictEqual } from 'node:util';
import { MessageChannel, Worker } from 'node:worker_threads';
import { transpile } from '@bytecodealliance/jco';
import { WASIShim } from '@bytecodealliance/preview2-shim/instantiation';
import { getOrSet, getOrSetMany, drop } from '../lib/get-or-set.mjs';
import { keyvalue } from '../lib/keyvalue.mjs';
import { worldOf } from '../lib/world.mjs';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '..', '..', '..');
const wasmPath = process.env.CORRAL_GUEST_WASM
  ?? join(process.env.CARGO_TARGET_DIR ?? join(root, 'target'), 'guest', 'wasm32-wasip2', 'guest', 'corral_guest.wasm');
const CALLER = new URL('../lib/caller.mjs', import.meta.url);
const T0 = 1_700_000_000_000n;
const WAIT_MS = 5_000;
const STEP_MS = 20_000;
const MAIN = 'main';
const PREFIX = 'corral:';
// The pseudo-interface of a caller's own origin (its loader), answered by this thread.
const ORIGIN = 'origin';
const CACHE = 'corral:cache/cache@0.2.0';
const LOCK = 'corral:lock/lock@0.2.0';

/** The folders of transpiled modules, removed once every test of the file ended. */
const outDirs = [];
after(() => Promise.all(outDirs.map((out) => rm(out, { recursive: true, force: true }))));

/** Transpiles the component once; returns its `instantiate` and the module's URL. */
async function transpiled(bytes) {
  const { files } = await transpile(bytes, { name: 'corral', instantiation: 'async', quiet: true });
  const out = await mkdtemp(join(tmpdir(), 'corral-jco-'));
  for (const [name, data] of Object.entries(files)) {
    await mkdir(dirname(join(out, name)), { recursive: true });
    await writeFile(join(out, name), data);
  }
  // The core modules are read at each instantiation: keep them until the tests end.
  outDirs.push(out);
  const url = pathToFileURL(join(out, 'corral.js')).href;
  return { instantiate: (await import(url)).instantiate, url };
}

/** `wasi:clocks/wall-clock` on the world's manual clock. */
function wallClock(world) {
  return {
    now: () => ({ seconds: world.now / 1000n, nanoseconds: Number(world.now % 1000n) * 1_000_000 }),
    resolution: () => ({ seconds: 0n, nanoseconds: 1_000_000 }),
  };
}

/** What every process of a vector shares: the clock, L2, the get-or-set locks, the lock table. */
function newWorld() {
  return { now: T0, l2: new Map(), locks: new Map(), table: new Map(), seq: 0, hosts: [], mismatches: [] };
}

/**
 * One process's host, in JavaScript, in `world`: its L1, its flight registry, the
 * loader script of its running step. `imports(caller)` are the imports of the instance
 * of `caller` (MAIN, or a together step's caller index).
 */
function newHost(world) {
  const state = {
    l1: new Map(), script: null,
    // L1's fencing (WIT `l1-ticket`): flushes, changes of generation, writes per key.
    flushes: 0n, generations: 0n, writes: new Map(),
  };
  const ticket = (key) => ({ flushes: state.flushes, generations: state.generations, writes: state.writes.get(key) ?? 0n });
  const wrote = (key) => state.writes.set(key, (state.writes.get(key) ?? 0n) + 1n);
  /** Another process's change of `key`: this L1 drops its copy, and a fill in flight is fenced out. */
  const hear = (key) => { wrote(key); state.l1.delete(key); };
  // key -> { leader, waiting: [{ caller, resolve }] }: at most one flight per key.
  const flights = new Map();
  // Held-back answers: each gate settles its answer once its condition holds, and says whether it did.
  const gates = new Set();
  const poke = () => gates.forEach((gate) => gate());
  const same = (a, b) => a !== undefined && b !== undefined && Buffer.compare(Buffer.from(a), Buffer.from(b)) === 0;
  // Whether `key` holds exactly `expected` (absent: nothing), as a fenced write asks.
  const holds = (key, expected) => {
    const held = world.l2.get(key);
    return expected === undefined || expected === null ? held === undefined : same(held, expected);
  };
  const heldEq = (a, b) => (a === undefined && b === undefined) || (a !== undefined && b !== undefined && a.owner === b.owner && a.expiresAtMs === b.expiresAtMs && a.token === b.token);

  function join(caller, key) {
    const flight = flights.get(key);
    if (!flight) {
      flights.set(key, { leader: caller, waiting: [] });
      return { tag: 'lead' };
    }
    if (caller === MAIN) throw new Error(`the main thread cannot wait on the flight of ${key}`);
    return new Promise((resolve) => {
      flight.waiting.push({ caller, resolve });
      poke();
    });
  }

  // `${caller} ${key}` -> the outcome box of a flight a batch of `caller` follows
  // (`joinMany`), until its `join` takes it.
  const followed = new Map();

  /** A batch's keys join their flights at once: true where `caller` leads, false where it follows. */
  function joinMany(caller, keys) {
    return keys.map((key) => {
      const flight = flights.get(key);
      if (!flight) {
        flights.set(key, { leader: caller, waiting: [] });
        return true;
      }
      const box = {};
      box.outcome = new Promise((resolve) => {
        box.resolve = (joined) => { box.joined = joined; resolve(joined); };
      });
      flight.waiting.push({ caller, resolve: box.resolve });
      followed.set(`${caller} ${key}`, box);
      poke();
      return false;
    });
  }

  /** `join`, after a batch followed the flight: its outcome, however soon it ended. */
  function joinFollowed(caller, key) {
    const box = followed.get(`${caller} ${key}`);
    if (!box) return join(caller, key);
    followed.delete(`${caller} ${key}`);
    if (box.joined) return box.joined;
    if (caller === MAIN) throw new Error(`the main thread cannot wait on the flight of ${key}`);
    return box.outcome;
  }

  function finish(caller, key, outcome) {
    const flight = flights.get(key);
    if (flight?.leader !== caller) return;
    flights.delete(key);
    const joined = outcome.tag === 'ok' ? { tag: 'value', val: outcome.val } : { tag: 'failed', val: outcome.val };
    flight.waiting.forEach((w) => w.resolve(joined));
  }

  /** The flight of `key` goes from its leader to its first follower, if any. */
  function handOn(key, flight) {
    const next = flight.waiting.shift();
    if (!next) {
      flights.delete(key);
      return;
    }
    flight.leader = next.caller;
    next.resolve({ tag: 'lead' });
  }

  /** `caller` dropped the load of the flight of `key` it leads. */
  function abandon(caller, key) {
    const flight = flights.get(key);
    if (flight?.leader !== caller) return;
    handOn(key, flight);
    poke();
  }

  /** `caller`'s call returned or trapped: a flight it still leads goes to its first follower. */
  function callEnded(caller) {
    for (const [name, held] of world.locks) {
      if (held.holder[0] === host && held.holder[1] === caller) world.locks.delete(name);
    }
    for (const name of followed.keys()) {
      if (name.startsWith(`${caller} `)) followed.delete(name);
    }
    for (const [key, flight] of flights) {
      flight.waiting = flight.waiting.filter((w) => w.caller !== caller);
      if (flight.leader === caller) handOn(key, flight);
    }
    poke();
  }

  /** Resolves once `ready()` holds, checked now and at every join and call end. */
  function until(ready) {
    return new Promise((resolve) => {
      const gate = () => ready() && (gates.delete(gate), resolve(), true);
      if (!gate()) gates.add(gate);
    });
  }

  const imports = (caller) => ({
    'corral:cache/l1': {
      ticket: (key) => ticket(key),
      get: (key) => state.l1.get(key),
      // A read's fill: only if nothing was written or cleared since the ticket.
      fill: (key, entry, since) => {
        const now = ticket(key);
        if (now.flushes !== since.flushes || now.generations !== since.generations || now.writes !== since.writes) return false;
        state.l1.set(key, entry);
        return true;
      },
      // This process's own write: replaces fills, unless the key was written again since.
      set: (key, entry, since) => {
        const now = ticket(key);
        wrote(key);
        if (now.flushes === since.flushes && now.generations === since.generations && now.writes === since.writes) state.l1.set(key, entry);
        else state.l1.delete(key);
      },
      delete: (key) => { wrote(key); state.l1.delete(key); },
      clear: () => moveGeneration(),
      flush: () => { state.flushes += 1n; state.l1.clear(); },
    },
    'corral:cache/l2': {
      get: (key) => world.l2.get(key),
      getMany: (names) => names.map((name) => ({ tag: 'ok', val: world.l2.get(name) })),
      set: (key, value) => { world.l2.set(key, value); },
      delete: (key) => world.l2.delete(key),
      swap: (key, value) => {
        const old = world.l2.get(key);
        world.l2.set(key, value);
        return old;
      },
      deleteIfEqual: (key, expected) => same(world.l2.get(key), expected) && world.l2.delete(key),
      replaceIfEqual: (key, expected, value) => {
        if (!same(world.l2.get(key), expected)) return false;
        world.l2.set(key, value);
        return true;
      },
      // `expected` absent: only where the key holds nothing (a fenced fill).
      setIf: (key, expected, value) => {
        if (!holds(key, expected)) return false;
        world.l2.set(key, value);
        return true;
      },
      // The fill only while `owner` holds the lock (not lapsed), the release, and the
      // landing announced, in one step.
      fillReleasing: (key, expected, value, _ttl, lock, owner, landed) => {
        const lease = world.locks.get(lock);
        const held = lease?.owner === owner && world.now < lease.until;
        const written = held && holds(key, expected);
        if (written) world.l2.set(key, value);
        if (held) world.locks.delete(lock);
        world.hosts.filter((h) => h !== host).forEach((h) => h.hear(landed));
        return { written, held };
      },
      // Held until released or `ttl` ms on the world's clock; a call that ends releases
      // what it holds (as a component host does when a call traps).
      tryLock: (name, ttl) => {
        const held = world.locks.get(name);
        if (held && world.now < held.until) return undefined;
        const owner = `owner-${++world.seq}`;
        world.locks.set(name, { owner, until: world.now + ttl, holder: [host, caller] });
        return owner;
      },
      releaseLock: (name, owner) => world.locks.get(name)?.owner === owner && world.locks.delete(name),
      // Nothing is bounded here (see `bound`): the budget never runs out.
      waitLanding: () => false,
      announceLanding: (key) => world.hosts.filter((h) => h !== host).forEach((h) => h.hear(key)),
      // Every step here answers at once: nothing to bound.
      bound: () => {},
      // Every process (this one too) moves its L1 to another generation, as `clear`.
      announceInvalidation: () => world.hosts.forEach((h) => h.moveGeneration()),
    },
    'corral:cache/flights': {
      join: (key) => joinFollowed(caller, key),
      joinMany: (keys) => joinMany(caller, keys),
      finish: (key, outcome) => finish(caller, key, outcome),
      abandon: (key) => abandon(caller, key),
    },
    // Not an import: the caller's own origin, which its get-or-set calls between the
    // phases (a worker's, through the same channel as its imports).
    [ORIGIN]: {
      load: (key) => state.script.load(caller, key),
      shouldCache: () => state.script.shouldCache(caller),
    },
    'corral:lock/table': {
      get: (key) => world.table.get(key),
      compareAndSwap: (key, expected, next) => {
        if (!heldEq(world.table.get(key), expected)) return false;
        world.table.set(key, next);
        return true;
      },
    },
    'wasi:clocks/wall-clock': wallClock(world),
  });
  /** A tag or clear announcement heard: as the `clear` import. */
  const moveGeneration = () => { state.generations += 1n; state.flushes += 1n; state.l1.clear(); };
  const host = { world, state, imports, callEnded, until, hear, moveGeneration, waiting: (key) => flights.get(key)?.waiting.length ?? 0 };
  world.hosts.push(host);
  return host;
}

/** The vector's `settings` over the component's defaults (`policy.defaults`). */
function settingsFor(defaults, settings = {}) {
  const names = { max_key_bytes: ['maxKeyBytes', Number], max_value_bytes: ['maxValueBytes', Number], default_sliding_ms: ['defaultSlidingMs', BigInt] };
  const top = {
    hard_timeout_ms: ['hardTimeoutMs', BigInt],
    fail_safe_throttle_ms: ['failSafeThrottleMs', BigInt],
    soft_timeout_ms: ['softTimeoutMs', BigInt],
    eager_refresh_permille: ['eagerRefreshPermille', Number],
  };
  const limits = { ...defaults.limits };
  const out = { ...defaults };
  for (const [name, value] of Object.entries(settings)) {
    if (name in top) {
      const [field, type] = top[name];
      out[field] = type(value);
      continue;
    }
    if (!(name in names)) throw new Error(`unknown setting ${name}`);
    const [field, type] = names[name];
    limits[field] = type(value);
  }
  return { ...out, limits };
}

/** Runs one component call: `{ok}`, `{err}` (its error result) or `{trap}` (anything else thrown). */
function settle(run) {
  try {
    return { ok: run() };
  } catch (e) {
    return e?.payload !== undefined ? { err: e.payload } : { trap: String(e?.message ?? e) };
  }
}

/** A settled call as the vectors spell it (a trap stays a trap, and matches no `expect`). */
function spelled(r, show = (v) => v) {
  if ('trap' in r) return { trap: r.trap };
  if (!('err' in r)) return { value: r.ok === undefined ? null : show(r.ok) };
  switch (r.err.tag) {
    case 'invalid-argument': return { error: 'invalid-argument', argument: r.err.val.name };
    case 'loader-failed': return { error: 'loader' };
    default: return { error: r.err.tag };
  }
}

const text = (bytes) => Buffer.from(bytes).toString('utf8');
/** A call without a value: `{ok: true}` or its error. */
const done = (r) => {
  const s = spelled(r);
  return { result: 'error' in s || 'trap' in s ? s : { ok: true } };
};
const utf8 = (s) => new TextEncoder().encode(s ?? '');

function options(step, now) {
  const o = step.options ?? {};
  return {
    relativeMs: o.relative_ms === undefined ? undefined : BigInt(o.relative_ms),
    slidingMs: o.sliding_ms === undefined ? undefined : BigInt(o.sliding_ms),
    absoluteMs: o.absolute_in_ms === undefined ? undefined : now + BigInt(o.absolute_in_ms),
    maxStaleMs: o.max_stale_ms === undefined ? undefined : BigInt(o.max_stale_ms),
  };
}

/** What a scripted loader gives the component: its value, its error, or (abandon) a throw, which traps the call. */
function scripted(loader) {
  if ('value' in loader) return utf8(loader.value);
  if ('error' in loader) return { tag: 'err', val: loader.error };
  if (loader.abandon) throw new Error('the caller went away mid-load');
  throw new Error(`unknown loader ${JSON.stringify(loader)}`);
}

/** The next message of `worker`, within STEP_MS. */
function nextMessage(worker, what) {
  return new Promise((resolve, reject) => {
    const done = (end, value) => {
      clearTimeout(timer);
      worker.off('message', onMessage).off('error', onError).off('exit', onExit);
      end(value);
    };
    const onMessage = (m) => done(resolve, m);
    const onError = (e) => done(reject, new Error(`${what}: the worker failed: ${e.stack ?? e}`));
    const onExit = (code) => done(reject, new Error(`${what}: the worker exited with ${code}`));
    const timer = setTimeout(() => done(reject, new Error(`${what}: nothing within ${STEP_MS} ms`)), STEP_MS);
    worker.on('message', onMessage).on('error', onError).on('exit', onExit);
  });
}

/** Caller `i` of a together step, in its own worker and instance; `ready` once configured. */
function startCaller(run, step, i) {
  const { port1, port2 } = new MessageChannel();
  const bell = new Int32Array(new SharedArrayBuffer(4));
  const imports = run.host.imports(i);
  port1.on('message', async ({ iface, fn, args }) => {
    let answer;
    try {
      answer = { value: await imports[iface][fn](...args) };
    } catch (e) {
      answer = { trap: e.message };
    }
    port1.postMessage(answer);
    Atomics.store(bell, 0, 1);
    Atomics.notify(bell, 0);
  });
  const worker = new Worker(CALLER, {
    workerData: {
      component: run.url,
      port: port2,
      bell,
      calls: Object.fromEntries(Object.entries(imports).map(([iface, fns]) => [iface, Object.keys(fns)])),
      origin: ORIGIN,
      settings: run.settings,
      prefix: PREFIX,
      key: step.key,
      options: options(step, run.host.world.now),
      waitMs: WAIT_MS,
    },
    transferList: [port2],
  });
  return {
    ready: nextMessage(worker, `caller ${i} getting ready`),
    call: () => {
      worker.postMessage('go');
      return nextMessage(worker, `caller ${i}'s get-or-set`);
    },
    stop: () => {
      port1.close();
      return worker.terminate();
    },
  };
}

/** `get_or_set_together`: callers[0] leads; the others start once its loader runs (or its call ends). */
async function together(run, step) {
  const { host } = run;
  const running = new Set(step.callers.keys());
  const abandoned = new Set();
  let loads = 0;
  let releaseFollowers;
  const leaderLoads = new Promise((resolve) => { releaseFollowers = resolve; });
  host.state.script = {
    load: async (caller, key) => {
      loads += 1;
      if (caller === 0) releaseFollowers();
      await host.until(() => host.waiting(key) >= running.size - 1);
      if (step.callers[caller].loader.abandon) abandoned.add(caller);
      return scripted(step.callers[caller].loader);
    },
    shouldCache: (caller) => step.callers[caller].should_cache ?? true,
  };
  const callers = step.callers.map((_, i) => startCaller(run, step, i));
  try {
    await Promise.all(callers.map((c) => c.ready));
    const ended = (i) => (r) => {
      running.delete(i);
      host.callEnded(i);
      return r;
    };
    const leader = callers[0].call().then(ended(0));
    await Promise.race([leaderLoads, leader]);
    const settled = await Promise.all([leader, ...callers.slice(1).map((c, i) => c.call().then(ended(i + 1)))]);
    const result = settled.map((r, i) => (abandoned.has(i) && 'trap' in r ? { abandoned: true } : spelled(r, text)));
    return { result, loads };
  } finally {
    await Promise.all(callers.map((c) => c.stop()));
  }
}

/** Each op the vectors use: runs a step, returns `{result, loads?}` (nothing for `advance`). */
const ops = {
  advance: ({ host }, step) => { host.world.now += BigInt(step.ms); },
  set: ({ host, exports }, step) => {
    const r = spelled(settle(() => exports[CACHE].setTagged(step.key, utf8(step.value), options(step, host.world.now), step.tags ?? [])));
    return { result: 'error' in r ? r : { ok: true } };
  },
  remove_by_tag: ({ exports }, step) => done(settle(() => exports[CACHE].removeByTag(step.tag))),
  expire_by_tag: ({ exports }, step) => done(settle(() => exports[CACHE].expireByTag(step.tag))),
  clear: ({ exports }) => done(settle(() => exports[CACHE].clear())),
  get: ({ exports }, step) => ({ result: spelled(settle(() => exports[CACHE].get(step.key)), text) }),
  refresh: ({ exports }, step) => ({ result: spelled(settle(() => exports[CACHE].refresh(step.key))) }),
  remove: ({ exports }, step) => ({ result: spelled(settle(() => exports[CACHE].remove(step.key))) }),
  expire: ({ exports }, step) => ({ result: spelled(settle(() => exports[CACHE].expire(step.key))) }),
  get_or_set: ({ host, exports, world }, step) => {
    let loads = 0;
    host.state.script = {
      load: () => {
        loads += 1;
        // Other processes' steps, inside the load.
        runSteps(world, step.loader.during ?? [], `${JSON.stringify(step.key)}'s loader:`);
        // A slow loader: the clock moves this much while it runs.
        host.world.now += BigInt(step.loader.takes_ms ?? 0);
        return scripted(step.loader);
      },
      shouldCache: () => step.should_cache ?? true,
    };
    const origin = { load: (key) => host.state.script.load(MAIN, key), shouldCache: () => host.state.script.shouldCache(MAIN) };
    const r = settle(() => getOrSet(exports[CACHE], step.key, options(step, host.world.now), step.bypass ?? false, step.tags ?? [], origin));
    host.callEnded(MAIN);
    return { result: spelled(r, text), loads };
  },
  get_or_set_together: together,
  get_or_set_many: ({ host, exports, world }, step) => {
    let loads = 0;
    const asked = [];
    const loader = step.loader ?? {};
    const origin = {
      loadMany: (keys) => {
        loads += 1;
        asked.push(...keys);
        // Other processes' steps, inside the first load.
        if (loads === 1) runSteps(world, loader.during ?? [], 'a batch\'s loader:');
        if ('error' in loader) return { tag: 'err', val: loader.error };
        const values = loader.values ?? {};
        return keys.filter((k) => k in values).map((k) => [k, utf8(values[k])]);
      },
      shouldCache: () => true,
    };
    const r = settle(() => getOrSetMany(exports[CACHE], step.keys, options(step, host.world.now), step.tags ?? [], origin));
    host.callEnded(MAIN);
    const result = 'ok' in r ? { each: r.ok.map((a) => spelled(a, text)) } : spelled(r, text);
    if (step.asked !== undefined) result.asked = [...asked].sort();
    return { result, loads };
  },
  // The key's get-or-set lock lapses, as under a leader paused past its TTL.
  lapse_flight_lock: ({ world, exports, settings }, step) => {
    const names = exports['corral:cache/policy@0.2.0'].locate(PREFIX, step.key, 0n, settings.limits);
    return { result: { value: world.locks.delete(names.flightLock) } };
  },
  try_lock: ({ exports }, step) => ({ result: spelled(settle(() => exports[LOCK].tryLock(step.key, step.owner, BigInt(step.ttl_ms)))) }),
  acquire: ({ exports }, step) => ({ result: spelled(settle(() => exports[LOCK].acquire(step.key, step.owner, BigInt(step.ttl_ms))), Number) }),
  unlock: ({ exports }, step) => ({ result: spelled(settle(() => exports[LOCK].unlock(step.key, step.owner))) }),
  is_locked_by: ({ exports }, step) => ({ result: spelled(settle(() => exports[LOCK].isLockedBy(step.key, step.owner))) }),
  is_lock_expired: ({ exports }, step) => ({ result: spelled(settle(() => exports[LOCK].isLockExpired(step.key))) }),
};

/** The processes `steps` name (nested ones included), "a" by default. */
function processesOf(steps, into = new Set()) {
  for (const step of steps) {
    into.add(step.process ?? 'a');
    processesOf(step.loader?.during ?? [], into);
  }
  return into;
}

/** Checks one step's result against its expectations; a mismatch is kept in `world`. */
function check(world, at, i, step, ran) {
  const expect = step.callers?.map((c) => c.expect) ?? (step.asked === undefined ? step.expect : { ...step.expect, asked: step.asked });
  const loadsOk = step.loads === undefined || ran.loads === step.loads;
  if (!loadsOk || !isDeepStrictEqual(ran.result, expect)) {
    world.mismatches.push(`${at} step ${i} (${step.op}): expected ${JSON.stringify(expect)}, got ${JSON.stringify(ran.result)}${step.loads !== undefined ? `, loads ${ran.loads}/${step.loads}` : ''}`);
  }
}

/** Runs `steps` synchronously (inside a loader: no together step); returns how many ran. */
function runSteps(world, steps, at) {
  let ran = 0;
  for (const [i, step] of steps.entries()) {
    const out = ops[step.op](world.runs.get(step.process ?? 'a'), step);
    if (out instanceof Promise) throw new Error(`${at} step ${i}: ${step.op} cannot run inside a loader`);
    if (!out) continue;
    ran += 1;
    world.ran += 1;
    check(world, at, i, step, out);
  }
  return ran;
}

/**
 * A process of the composed component (corral-wasi.wasm: the component with the
 * keyvalue adapter plugged in): its only host is a `wasi:keyvalue` store shared by every
 * process of the world, and the world's clock; L1 and the flight registry are the
 * adapter's, inside the instance.
 */
function composedHost(world) {
  world.kv ??= new Map();
  // The get-or-set lock is a record in the store: a lapse removes it there.
  world.locks = { delete: (name) => world.kv.delete(name) };
  return {
    world,
    state: { script: null },
    imports: () => ({ ...keyvalue(world.kv), 'wasi:clocks/wall-clock': wallClock(world) }),
    callEnded: () => {},
  };
}

/** Runs one vector on a fresh world; returns its step count and mismatches. */
async function runVector({ instantiate, url }, vector, hostFor = newHost) {
  const world = { ...newWorld(), runs: new Map(), ran: 0 };
  for (const name of processesOf(vector.steps)) {
    const host = hostFor(world);
    const { [ORIGIN]: _origin, ...imports } = host.imports(MAIN);
    const exports = await instantiate(null, { ...new WASIShim().getImportObject(), ...imports });
    const settings = settingsFor(exports['corral:cache/policy@0.2.0'].defaults(), vector.settings);
    exports[CACHE].configure(settings, PREFIX);
    world.runs.set(name, { host, exports, settings, url, world });
  }
  for (const [i, step] of vector.steps.entries()) {
    const ran = await ops[step.op](world.runs.get(step.process ?? 'a'), step);
    if (!ran) continue;
    world.ran += 1;
    check(world, `${vector.name} /`, i, step, ran);
  }
  return { steps: world.ran, mismatches: world.mismatches };
}

test('the contract vectors pass in the component under jco', async () => {
  const bytes = await readFile(wasmPath);
  console.log(`component: ${wasmPath}, ${bytes.length} bytes, sha256 ${createHash('sha256').update(bytes).digest('hex')}`);
  const component = await transpiled(bytes);
  const dir = process.env.CORRAL_VECTORS_DIR ?? join(root, 'tests', 'vectors');
  const files = [];
  const unknown = [];
  for (const file of (await readdir(dir)).filter((f) => f.endsWith('.json')).sort()) {
    const vectors = JSON.parse(await readFile(join(dir, file), 'utf8'));
    for (const vector of vectors) {
      vector.steps.forEach((step, i) => {
        if (!Object.hasOwn(ops, step.op)) unknown.push(`${file} / ${vector.name} / step ${i}: ${step.op}`);
      });
    }
    files.push({ file, vectors });
  }
  assert.deepStrictEqual(unknown, [], 'every op is one this host runs');
  const mismatches = [];
  let vectors = 0;
  let steps = 0;
  for (const { file, vectors: list } of files) {
    const before = mismatches.length;
    let fileSteps = 0;
    for (const vector of list) {
      const ran = await runVector(component, vector);
      fileSteps += ran.steps;
      mismatches.push(...ran.mismatches);
    }
    console.log(`${file}: ${list.length} vectors, ${fileSteps} steps, ${mismatches.length - before} mismatches`);
    vectors += list.length;
    steps += fileSteps;
  }
  console.log(`component under jco: ${vectors} vectors, ${steps} steps, ${mismatches.length} mismatches`);
  assert.ok(vectors >= 40, 'at least 40 vectors');
  assert.deepStrictEqual(mismatches, []);
});

/** The transpiled component, once for every test of this file. */
let transpiledOnce;
const component = () => (transpiledOnce ??= readFile(wasmPath).then(transpiled));

/** One process (an instance and its host) over a fresh world, configured with the defaults. */
async function oneProcess() {
  const { instantiate } = await component();
  const world = newWorld();
  const host = newHost(world);
  const { [ORIGIN]: _origin, ...imports } = host.imports(MAIN);
  const exports = await instantiate(null, { ...new WASIShim().getImportObject(), ...imports });
  exports[CACHE].configure(exports['corral:cache/policy@0.2.0'].defaults(), PREFIX);
  return { world, host, cache: exports[CACHE] };
}

const FOR_A_MINUTE = { relativeMs: 60_000n };

test('a second caller of a key in the same instance follows the load the first holds', async () => {
  const { cache } = await oneProcess();
  const first = cache.begin('k', FOR_A_MINUTE, false, []);
  assert.equal(first.tag, 'lead');
  assert.equal(first.val.key(), 'k');
  const second = cache.begin('k', FOR_A_MINUTE, false, []);
  assert.equal(second.tag, 'wait', 'the instance cannot block on a load only its own caller can end');
  assert.deepStrictEqual(second.val.outcome(), { tag: 'pending' });
  assert.equal(text(cache.Load.complete(first.val, utf8('v'), true)), 'v');
  const outcome = second.val.outcome();
  assert.equal(outcome.tag, 'ready');
  assert.equal(text(outcome.val.val), 'v');
  const third = cache.begin('k', FOR_A_MINUTE, false, []);
  assert.equal(third.tag, 'hit');
  assert.equal(text(third.val), 'v');
});

test('a dropped load releases its flight lock and its follower leads in its place', async () => {
  const { world, cache } = await oneProcess();
  const first = cache.begin('k', FOR_A_MINUTE, false, []);
  assert.equal(first.tag, 'lead');
  assert.equal(world.locks.size, 1, 'the leader holds the flight lock during its load');
  const second = cache.begin('k', FOR_A_MINUTE, false, []);
  drop(first.val);
  assert.equal(world.locks.size, 0, 'the dropped load released the flight lock');
  const outcome = second.val.outcome();
  assert.equal(outcome.tag, 'lead', 'the follower leads once the load was dropped');
  assert.equal(text(cache.Load.complete(outcome.val, utf8('w'), true)), 'w');
  assert.equal(text(cache.get('k')), 'w');
});

test('a failed load reaches its follower and caches nothing', async () => {
  const { world, cache } = await oneProcess();
  const first = cache.begin('k', FOR_A_MINUTE, false, []);
  const second = cache.begin('k', FOR_A_MINUTE, false, []);
  const failed = settle(() => cache.Load.fail(first.val, 'origin down'));
  assert.deepStrictEqual(failed.err, { tag: 'loader-failed', val: 'origin down' });
  const outcome = second.val.outcome();
  assert.equal(outcome.tag, 'ready');
  assert.deepStrictEqual(outcome.val, { tag: 'err', val: { tag: 'loader-failed', val: 'origin down' } });
  assert.equal(cache.get('k'), undefined);
  assert.equal(world.locks.size, 0);
});

test('a bad key or bad tags is a typed error, and the failed begin hands its flight on', async () => {
  const { cache } = await oneProcess();
  const bad = settle(() => cache.begin('', FOR_A_MINUTE, false, []));
  assert.equal(bad.err?.tag, 'invalid-argument');
  assert.equal(bad.err.val.name, 'key');
  const badTags = settle(() => cache.begin('k', FOR_A_MINUTE, false, ['']));
  assert.equal(badTags.err?.tag, 'invalid-argument');
  assert.equal(badTags.err.val.name, 'tags');
  // The failed begin handed its flight on: the key is led again at once.
  const again = cache.begin('k', FOR_A_MINUTE, false, []);
  assert.equal(again.tag, 'lead');
  assert.equal(text(cache.Load.complete(again.val, utf8('v'), false)), 'v');
  assert.equal(cache.get('k'), undefined, 'an uncacheable value is served, not cached');
});

// The composed component: built by scripts/platform (target/platform/corral-wasi.wasm).
const composedPath = process.env.CORRAL_WASI_WASM ?? join(root, 'target', 'platform', 'corral-wasi.wasm');
// Its processes share nothing but the store: no landing or invalidation is announced
// (no host offers a watcher), so vectors of several processes or of callers following each
// other's flights, which expect them heard at once, are not its to keep.
/** The composed component's bytes; none (the test skipped) when it is not built and not required. */
async function composedBytes(t) {
  try {
    return await readFile(composedPath);
  } catch (e) {
    if (process.env.CORRAL_WASI_REQUIRED) throw e;
    t.skip(`${composedPath} is not built (scripts/platform builds it)`);
    return undefined;
  }
}

const COMPOSED_FILES = ['errors.json', 'expiry.json', 'freshness.json', 'get_or_set.json', 'keys.json', 'locks.json', 'tags.json'];
// Of the batches, the vectors of one process (one caller at a time: nothing to hear).
const COMPOSED_ONE_PROCESS = ['batches.json'];

test('the contract vectors pass in the composed corral-wasi component (keyvalue adapter, wasi imports only)', async (t) => {
  const bytes = await composedBytes(t);
  if (!bytes) return;
  const component = await transpiled(bytes);
  const dir = process.env.CORRAL_VECTORS_DIR ?? join(root, 'tests', 'vectors');
  const mismatches = [];
  let vectors = 0;
  let steps = 0;
  for (const file of [...COMPOSED_FILES, ...COMPOSED_ONE_PROCESS]) {
    let list = JSON.parse(await readFile(join(dir, file), 'utf8'));
    if (COMPOSED_ONE_PROCESS.includes(file)) list = list.filter((v) => processesOf(v.steps).size === 1);
    const before = mismatches.length;
    let fileSteps = 0;
    for (const vector of list) {
      const ran = await runVector(component, vector, composedHost);
      fileSteps += ran.steps;
      mismatches.push(...ran.mismatches);
    }
    console.log(`composed ${file}: ${list.length} vectors, ${fileSteps} steps, ${mismatches.length - before} mismatches`);
    vectors += list.length;
    steps += fileSteps;
  }
  console.log(`composed component under jco: ${vectors} vectors, ${steps} steps, ${mismatches.length} mismatches`);
  assert.deepStrictEqual(mismatches, []);
});

test('the composed component imports only wasi:* interfaces and exports the cache and the locks', async (t) => {
  const bytes = await composedBytes(t);
  if (!bytes) return;
  const { imports, exports } = await worldOf(bytes);
  console.log(`composed imports: ${imports.join(', ')}`);
  assert.ok(imports.some((i) => i.startsWith('wasi:keyvalue/atomics@')), 'it imports wasi:keyvalue atomics');
  assert.deepStrictEqual(imports.filter((i) => !i.startsWith('wasi:')), [], 'nothing but wasi:* is imported');
  for (const name of ['corral:cache/cache@0.2.0', 'corral:lock/lock@0.2.0']) assert.ok(exports.includes(name), `it exports ${name}`);
});

test('a caller that began after the key changed never gets the value of a load that began before', async () => {
  const { cache } = await oneProcess();
  const first = cache.begin('k', FOR_A_MINUTE, false, []);
  assert.equal(first.tag, 'lead');
  cache.remove('k');
  const second = cache.begin('k', FOR_A_MINUTE, false, []);
  assert.equal(second.tag, 'wait');
  assert.equal(text(cache.Load.complete(first.val, utf8('old'), true)), 'old', 'the load that began first gets its own value');
  const outcome = second.val.outcome();
  assert.equal(outcome.tag, 'lead', `the later caller leads a load of its own, not ${JSON.stringify(outcome)}`);
  assert.equal(text(cache.Load.complete(outcome.val, utf8('new'), true)), 'new');
  assert.equal(text(cache.get('k')), 'new');
});

test('a bad argument is refused while another caller of the instance holds the key\'s load', async () => {
  const { cache } = await oneProcess();
  const first = cache.begin('k', FOR_A_MINUTE, false, []);
  const bad = settle(() => cache.begin('k', FOR_A_MINUTE, false, ['']));
  assert.equal(bad.err?.tag, 'invalid-argument', `not ${JSON.stringify(bad)}`);
  assert.equal(bad.err.val.name, 'tags');
  cache.Load.complete(first.val, utf8('v'), true);
});

test('a follower that led in a dropped load\'s place answers that load\'s outcome from then on', async () => {
  const { cache } = await oneProcess();
  const first = cache.begin('k', FOR_A_MINUTE, false, []);
  const second = cache.begin('k', FOR_A_MINUTE, false, []);
  drop(first.val);
  const led = second.val.outcome();
  assert.equal(led.tag, 'lead');
  assert.equal(text(cache.Load.complete(led.val, utf8('v'), false)), 'v');
  const again = second.val.outcome();
  assert.equal(again.tag, 'ready', `asked again, not ${JSON.stringify(again)}`);
  assert.equal(text(again.val.val), 'v');
});
