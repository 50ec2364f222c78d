// A component's world, read from its bytes by jco: the interfaces it imports and exports.
import { componentWit } from '@bytecodealliance/jco';

/** The interfaces the world of the component `bytes` imports and exports. */
export async function worldOf(bytes) {
  const wit = await componentWit(bytes);
  const named = (verb) => [...wit.matchAll(new RegExp(`^\\s*${verb} ([^;]+);`, 'gm'))].map((m) => m[1]);
  return { imports: named('import'), exports: named('export') };
}
