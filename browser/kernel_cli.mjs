// Run the tab's kernel (src/kernel.js) outside a browser, for bench/browser_kernel.py:
//   node kernel_cli.mjs DIR   (DIR/spec.json + the weight and row files it names)
// writes DIR/out.f32 (the expert's output rows) and prints {"seconds": [...]} per repeat.
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { expertFfn, useWasm, kernelLabel } from "./src/kernel.js";
import { compileWat } from "./src/wat.mjs";

const dir = process.argv[2], spec = JSON.parse(readFileSync(join(dir, "spec.json"), "utf8"));
const bytes = (f) => { const b = readFileSync(join(dir, f)); return new Uint8Array(b.buffer, b.byteOffset, b.byteLength); };
const W = (w) => ({ type: w.type, ne0: w.ne0, ne1: w.ne1, data: bytes(w.file) });
const E = { gate: W(spec.gate), up: W(spec.up), down: W(spec.down), glu: spec.glu || "swiglu" };
for (const k of ["gateBias", "upBias", "downBias"]) if (spec[k]) { const b = bytes(spec[k]); E[k] = new Float32Array(b.slice().buffer); }
const xb = bytes(spec.x), x = new Float32Array(xb.slice().buffer), n = spec.rows;
if (spec.wasm) useWasm(await compileWat(join(import.meta.dirname, "src", "q4k.wat")));
const seconds = [];
let y;
for (let r = 0; r < (spec.repeats || 1); r++) {
  const t0 = process.hrtime.bigint();
  y = expertFfn(E, x, n);
  seconds.push(Number(process.hrtime.bigint() - t0) / 1e9);
}
writeFileSync(join(dir, "out.f32"), Buffer.from(y.buffer));
console.log(JSON.stringify({ seconds, kernel: kernelLabel() }));
