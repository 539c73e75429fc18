// WAT -> wasm bytes with wabt (npm); used by build.mjs and kernel_cli.mjs.
import wabtInit from "wabt";
import { readFileSync } from "node:fs";
export async function compileWat(path) {
  const wabt = await wabtInit();
  const mod = wabt.parseWat(path, readFileSync(path, "utf8"), { simd: true });
  mod.validate();
  const { buffer } = mod.toBinary({});
  mod.destroy();
  return new Uint8Array(buffer);
}
