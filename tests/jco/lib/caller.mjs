// One caller of a `get_or_set_together` step, in a worker thread with its own instance of
// the component (the protocol is described at the top of test/vectors.test.mjs). Its
// Corral imports and its wall clock are the main thread's, called synchronously.
import { parentPort, receiveMessageOnPort, workerData } from 'node:worker_threads';
import { once } from 'node:events';
import { WASIShim } from '@bytecodealliance/preview2-shim/instantiation';
import { getOrSet } from './get-or-set.mjs';

const { component, port, bell, calls, origin, settings, prefix, key, options, waitMs } = workerData;

/** Calls `iface.fn(...args)` in the main thread and blocks until it answers. */
function call(iface, fn, args) {
  Atomics.store(bell, 0, 0);
  port.postMessage({ iface, fn, args });
  if (Atomics.wait(bell, 0, 0, waitMs) === 'timed-out') {
    throw new Error(`${iface}#${fn}(${JSON.stringify(args[0])}) got no answer within ${waitMs} ms`);
  }
  const answer = receiveMessageOnPort(port).message;
  if ('trap' in answer) throw new Error(answer.trap);
  return answer.value;
}

const imports = new WASIShim().getImportObject();
for (const [iface, fns] of Object.entries(calls)) {
  const answered = Object.fromEntries(fns.map((fn) => [fn, (...args) => call(iface, fn, args)]));
  // The caller's own origin is no import of the component: its get-or-set calls it
  // between the phases.
  if (iface !== origin) imports[iface] = answered;
}
const load = (k) => call(origin, 'load', [k]);
const shouldCache = (value) => call(origin, 'shouldCache', [value]);
const { instantiate } = await import(component);
const cache = (await instantiate(null, imports))['corral:cache/cache@0.2.0'];
cache.configure(settings, prefix);
parentPort.postMessage('ready');
await once(parentPort, 'message');
let result;
try {
  result = { ok: getOrSet(cache, key, options, false, [], { load, shouldCache }) };
} catch (e) {
  result = e?.payload !== undefined ? { err: e.payload } : { trap: String(e?.message ?? e) };
}
parentPort.postMessage(result);
