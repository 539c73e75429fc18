// Run the tab's kernel (src/kernel.js) outside a browser, for bench/browser_kernel.py and
// tests/browser/test_kernel_node.py:
//   node kernel_cli.mjs DIR
// DIR/spec.json names the weight and row files of one expert call: writes DIR/out.f32 (the
// expert's output rows) and prints {"seconds": [...], "kernel": label} per repeat. With
// "cases": [spec, ...] instead, runs every case with the plain-JS kernel and with the
// WebAssembly SIMD one, writing DIR/out.js.<i>.f32 and DIR/out.wasm.<i>.f32.
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { expertFfn, useWasm, kernelLabel } from "./src/kernel.js";
import { compileWat } from "./src/wat.mjs";

const dir = process.argv[2], spec = JSON.parse(readFileSync(join(dir, "spec.json"), "utf8"));
const bytes = (f) => { const b = readFileSync(join(dir, f)); return new Uint8Array(b.buffer, b.byteOffset, b.byteLength); };
const f32 = (f) => new Float32Array(bytes(f).slice().buffer);
const W = (w) => ({ type: w.type, ne0: w.ne0, ne1: w.ne1, data: bytes(w.file) });
function expert(c) {
  const E = { gate: W(c.gate), up: W(c.up), down: W(c.down), glu: c.glu || "swiglu" };
  for (const k of ["gateBias", "upBias", "downBias"]) if (c[k]) E[k] = f32(c[k]);
  return E;
}
const simd = await compileWat(join(import.meta.dirname, "src", "simd.wat"));

if (spec.cases) {
  const experts = new Map(); // cases sharing weight files share one expert (and its wasm copy)
  for (const mode of ["js", "wasm"]) {
    if (mode === "wasm" && !useWasm(simd)) throw new Error("this node has no WebAssembly SIMD");
    if (mode === "js") useWasm(null);
    experts.clear();
    spec.cases.forEach((c, i) => {
      const key = c.gate.file + "|" + c.up.file + "|" + c.down.file;
      if (!experts.has(key)) experts.set(key, expert(c));
      writeFileSync(join(dir, `out.${mode}.${i}.f32`), Buffer.from(expertFfn(experts.get(key), f32(c.x), c.rows).buffer));
    });
  }
  console.log(JSON.stringify({ cases: spec.cases.length }));
} else {
  const E = expert(spec), x = f32(spec.x), n = spec.rows;
  if (spec.wasm) useWasm(simd);
  const seconds = [];
  let y;
  for (let r = 0; r < (spec.repeats || 1); r++) {
    const t0 = process.hrtime.bigint();
    y = expertFfn(E, x, n);
    seconds.push(Number(process.hrtime.bigint() - t0) / 1e9);
  }
  writeFileSync(join(dir, "out.f32"), Buffer.from(y.buffer));
  console.log(JSON.stringify({ seconds, kernel: kernelLabel() }));
}
