// The expert function down(act(gate x + bg) * (up x + bu)) + bd, as ggml's CPU backend computes
// it: activations are first rounded to the weight type's vec_dot type (Q8_K for K-quants, Q8_0
// for Q8_0/Q4_0/MXFP4, f16 for F16, nothing for F32), then each block's integer dot is exact and
// the block sums are accumulated in float64 and rounded to float32 once per output (as the numpy
// worker does: ~1e-6 relative of ggml, inside the audit tolerance of a foreign kernel).
// Plain JavaScript: the portable fallback every browser runs.

import { swiglu, swigluOai } from "./glu.js";

export const TYPES = { F32: 0, F16: 1, Q4_0: 2, Q8_0: 8, Q4_K: 12, Q5_K: 13, Q6_K: 14, MXFP4: 39 };
// ggml type -> [block size, bytes per block, activation format]
export const TRAITS = {
  0: [1, 4, "f32"], 1: [1, 2, "f16"], 2: [32, 18, "q8_0"], 8: [32, 34, "q8_0"],
  12: [256, 144, "q8_K"], 13: [256, 176, "q8_K"], 14: [256, 210, "q8_K"], 39: [32, 17, "q8_0"],
};
export const TYPE_NAMES = Object.fromEntries(Object.entries(TYPES).map(([k, v]) => [v, k]));

const SWIGLU_OAI_ALPHA = Math.fround(1.702);
const SWIGLU_OAI_LIMIT = 7.0;
const fr = Math.fround;

// -- f16 ------------------------------------------------------------------------------------
const F16 = new Float32Array(65536);
for (let h = 0; h < 65536; h++) {
  const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  F16[h] = e === 0 ? s * m * 2 ** -24 : e === 31 ? (m ? NaN : s * Infinity) : s * (1024 + m) * 2 ** (e - 25);
}
export const f16ToF32 = (h) => F16[h];
const _f = new Float32Array(1), _u = new Uint32Array(_f.buffer);
/** float -> f16 bits, round to nearest even (F16C). */
export function f32ToF16(v) {
  _f[0] = v;
  const x = _u[0], sign = (x >>> 16) & 0x8000, exp = (x >>> 23) & 0xff;
  let mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  const e = exp - 112;
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e, rem = mant & ((1 << shift) - 1), mid = 1 << (shift - 1);
    let half = mant >>> shift;
    if (rem > mid || (rem === mid && (half & 1))) half++;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem === 0x1000 && (half & 1))) half++;
  return sign | half;
}
const rne = (v) => fr(fr(v) + 12582912) - 12582912; // ggml's nearest_int (|v| < 2^22)

// -- activation rounding (kernels/actquant.py) ---------------------------------------------
/** Q8_K of one row (ggml's quantize_row_q8_K_ref): {d: Float64Array(nb), q: Int8Array(k), bs: Int32Array(nb*16)}. */
export function quantQ8K(x, off, k) {
  const nb = k / 256, d = new Float64Array(nb), q = new Int8Array(k), bs = new Int32Array(nb * 16);
  for (let b = 0; b < nb; b++) {
    const o = off + b * 256;
    let amax = 0, max = 0;
    for (let j = 0; j < 256; j++) { const a = Math.abs(x[o + j]); if (a > amax) { amax = a; max = x[o + j]; } }
    if (amax === 0) continue;
    const iscale = fr(-127 / max);
    d[b] = fr(1 / iscale);
    for (let j = 0; j < 256; j++) {
      const v = Math.min(127, rne(iscale * x[o + j]));
      q[b * 256 + j] = v;
      bs[b * 16 + (j >> 4)] += v;
    }
  }
  return { d, q, bs };
}
/** Q8_0 of one row (ggml's x86 quantize_row_q8_0): d is f16-rounded. */
export function quantQ80(x, off, k) {
  const nb = k / 32, d = new Float64Array(nb), q = new Int8Array(k);
  for (let b = 0; b < nb; b++) {
    const o = off + b * 32;
    let amax = 0;
    for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(x[o + j]));
    d[b] = F16[f32ToF16(fr(amax / 127))];
    const id = amax !== 0 ? fr(127 / amax) : 0;
    for (let j = 0; j < 32; j++) q[b * 32 + j] = Math.max(-128, Math.min(127, rne(x[o + j] * id)));
  }
  return { d, q };
}
function actF16(x, off, k) {
  const out = new Float64Array(k);
  for (let j = 0; j < k; j++) out[j] = F16[f32ToF16(x[off + j])];
  return out;
}
function actF32(x, off, k) { return Float64Array.from(x.subarray(off, off + k)); }

// -- dots: one weight row (byte offset p) against one rounded activation row ---------------
function scaleMin(s, p, j) { // get_scale_min_k4: [scale, min] of sub-block j from 12 bytes at p
  if (j < 4) return [s[p + j] & 63, s[p + j + 4] & 63];
  return [(s[p + j + 4] & 0xf) | ((s[p + j - 4] >> 6) << 4), (s[p + j + 4] >> 4) | ((s[p + j] >> 6) << 4)];
}
function dotQ4K(w, p, nb, a) {
  let sum = 0;
  for (let b = 0; b < nb; b++, p += 144) {
    const dw = F16[w[p] | (w[p + 1] << 8)], mw = F16[w[p + 2] | (w[p + 3] << 8)];
    const q = a.q, y = b * 256;
    let isum = 0, msum = 0;
    for (let j = 0; j < 4; j++) {
      const [s1, m1] = scaleMin(w, p + 4, 2 * j), [s2, m2] = scaleMin(w, p + 4, 2 * j + 1);
      const qs = p + 16 + 32 * j, y1 = y + 64 * j, y2 = y1 + 32;
      let d1 = 0, d2 = 0;
      for (let l = 0; l < 32; l++) { const v = w[qs + l]; d1 += (v & 15) * q[y1 + l]; d2 += (v >> 4) * q[y2 + l]; }
      isum += s1 * d1 + s2 * d2;
      const bs = a.bs, o = b * 16 + 4 * j;
      msum += m1 * (bs[o] + bs[o + 1]) + m2 * (bs[o + 2] + bs[o + 3]);
    }
    sum += a.d[b] * (dw * isum - mw * msum);
  }
  return sum;
}
function dotQ5K(w, p, nb, a) {
  let sum = 0;
  for (let b = 0; b < nb; b++, p += 176) {
    const dw = F16[w[p] | (w[p + 1] << 8)], mw = F16[w[p + 2] | (w[p + 3] << 8)];
    const q = a.q, y = b * 256, qh = p + 16;
    let isum = 0, msum = 0;
    for (let j = 0; j < 4; j++) {
      const [s1, m1] = scaleMin(w, p + 4, 2 * j), [s2, m2] = scaleMin(w, p + 4, 2 * j + 1);
      const qs = p + 48 + 32 * j, y1 = y + 64 * j, y2 = y1 + 32, u1 = 1 << (2 * j), u2 = u1 << 1;
      let d1 = 0, d2 = 0;
      for (let l = 0; l < 32; l++) {
        const v = w[qs + l], h = w[qh + l];
        d1 += ((v & 15) + (h & u1 ? 16 : 0)) * q[y1 + l];
        d2 += ((v >> 4) + (h & u2 ? 16 : 0)) * q[y2 + l];
      }
      isum += s1 * d1 + s2 * d2;
      const bs = a.bs, o = b * 16 + 4 * j;
      msum += m1 * (bs[o] + bs[o + 1]) + m2 * (bs[o + 2] + bs[o + 3]);
    }
    sum += a.d[b] * (dw * isum - mw * msum);
  }
  return sum;
}
function dotQ6K(w, p, nb, a) {
  let sum = 0;
  const sc8 = new Int8Array(w.buffer, w.byteOffset, w.byteLength);
  for (let b = 0; b < nb; b++, p += 210) {
    const dw = F16[w[p + 208] | (w[p + 209] << 8)], q = a.q;
    let isum = 0;
    for (let n = 0; n < 2; n++) {
      const ql = p + 64 * n, qh = p + 128 + 32 * n, sc = p + 192 + 8 * n, y = b * 256 + 128 * n;
      for (let l = 0; l < 32; l++) {
        const is = l >> 4, L = w[ql + l], L2 = w[ql + l + 32], H = w[qh + l];
        isum += sc8[sc + is] * (((L & 15) | ((H & 3) << 4)) - 32) * q[y + l]
              + sc8[sc + is + 2] * (((L2 & 15) | (((H >> 2) & 3) << 4)) - 32) * q[y + l + 32]
              + sc8[sc + is + 4] * (((L >> 4) | (((H >> 4) & 3) << 4)) - 32) * q[y + l + 64]
              + sc8[sc + is + 6] * (((L2 >> 4) | (((H >> 6) & 3) << 4)) - 32) * q[y + l + 96];
      }
    }
    sum += a.d[b] * dw * isum;
  }
  return sum;
}
function dotQ80(w, p, nb, a) {
  let sum = 0;
  const w8 = new Int8Array(w.buffer, w.byteOffset, w.byteLength);
  for (let b = 0; b < nb; b++, p += 34) {
    const q = a.q, y = b * 32;
    let isum = 0;
    for (let j = 0; j < 32; j++) isum += w8[p + 2 + j] * q[y + j];
    sum += F16[w[p] | (w[p + 1] << 8)] * a.d[b] * isum;
  }
  return sum;
}
function dotQ40(w, p, nb, a) {
  let sum = 0;
  for (let b = 0; b < nb; b++, p += 18) {
    const q = a.q, y = b * 32;
    let isum = 0;
    for (let j = 0; j < 16; j++) { const v = w[p + 2 + j]; isum += ((v & 15) - 8) * q[y + j] + ((v >> 4) - 8) * q[y + j + 16]; }
    sum += F16[w[p] | (w[p + 1] << 8)] * a.d[b] * isum;
  }
  return sum;
}
const KMXFP4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
const e8m0Half = (e) => (e < 2 ? 2 ** -(128 - e) * 1 : 2 ** (e - 128)); // GGML_E8M0_TO_FP32_HALF
function dotMXFP4(w, p, nb, a) {
  let sum = 0;
  for (let b = 0; b < nb; b++, p += 17) {
    const q = a.q, y = b * 32;
    let isum = 0;
    for (let j = 0; j < 16; j++) { const v = w[p + 1 + j]; isum += KMXFP4[v & 15] * q[y + j] + KMXFP4[v >> 4] * q[y + j + 16]; }
    sum += fr(e8m0Half(w[p])) * a.d[b] * isum;
  }
  return sum;
}
function dotF32(w, p, n, a) {
  const f = new Float32Array(w.buffer, w.byteOffset + p, n);
  let sum = 0;
  for (let j = 0; j < n; j++) sum += f[j] * a[j];
  return sum;
}
function dotF16(w, p, n, a) {
  let sum = 0;
  for (let j = 0; j < n; j++, p += 2) sum += F16[w[p] | (w[p + 1] << 8)] * a[j];
  return sum;
}
const DOTS = { 0: dotF32, 1: dotF16, 2: dotQ40, 8: dotQ80, 12: dotQ4K, 13: dotQ5K, 14: dotQ6K, 39: dotMXFP4 };
const ACTS = { f32: actF32, f16: actF16, q8_0: quantQ80, q8_K: quantQ8K };

/** Bytes of one weight of type t with ne = [ne0, ne1]. */
export function weightBytes(t, ne0, ne1) {
  const tr = TRAITS[t];
  if (!tr) throw new Error(`weight type ${TYPE_NAMES[t] ?? t} is not supported by this kernel`);
  if (ne0 % tr[0]) throw new Error(`row length ${ne0} is not a multiple of the block size ${tr[0]}`);
  return (ne0 / tr[0]) * tr[1] * ne1;
}

// -- WebAssembly SIMD (src/simd.wat): Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and MXFP4 rows, the same
// bits as the dots above (the integer dot is exact in both; the float64 steps are the same
// operations in the same order). F32 and F16 run the JS dots: they sum in float64 one element
// after the other (numpy's bits), an order SIMD lanes would change.
let wasm = null;
// ggml type -> [export name, activation format]
const WASM_DOTS = { 2: ["q4_0", "q8_0"], 8: ["q8_0", "q8_0"], 12: ["q4k", "q8_K"], 13: ["q5k", "q8_K"], 14: ["q6k", "q8_K"],
  39: ["mxfp4", "q8_0"] };
/** Instantiate the SIMD kernels from their bytes; false (and the JS kernel stays) where the
 * browser lacks WebAssembly SIMD. ``useWasm(null)``: back to the JS kernel. */
export function useWasm(bytes) {
  wasm = null;
  if (!bytes) return false;
  try {
    if (!WebAssembly.validate(bytes)) return false;
    const inst = new WebAssembly.Instance(new WebAssembly.Module(bytes), {});
    const mem = inst.exports.memory, need = 65536 * 4;
    mem.grow(Math.ceil((need + 65536) / 65536));
    new Float32Array(mem.buffer, 0, 65536).set(F16);
    wasm = { fn: inst.exports, mem, top: need, scratch: 0, scratchSize: 0 };
    return true;
  } catch { wasm = null; return false; }
}
export const kernelLabel = () => (wasm ? "js-wasm32" : "js-scalar");
function walloc(n) {
  const p = (wasm.top + 15) & ~15, end = p + n, have = wasm.mem.buffer.byteLength;
  if (end > have) wasm.mem.grow(Math.ceil((end - have) / 65536));
  wasm.top = end;
  return p;
}
function wasmMatmul(W, x, n) {
  const [name, fmt] = WASM_DOTS[W.type], kq = fmt === "q8_K", block = kq ? 256 : 32, nb = W.ne0 / block;
  // a weight's bytes are copied into the module's memory once (W keeps where)
  if (W._wasm !== wasm) { W._wp = walloc(W.data.byteLength); new Uint8Array(wasm.mem.buffer, W._wp, W.data.byteLength).set(W.data); W._wasm = wasm; }
  const need = nb * block + nb * 64 + nb * 8 + W.ne1 * 4 + 64;
  if (wasm.scratchSize < need) { wasm.scratch = walloc(need); wasm.scratchSize = need; }
  const qp = wasm.scratch, bsp = (qp + nb * block + 15) & ~15, dp = (bsp + nb * 64 + 15) & ~15, op = (dp + nb * 8 + 15) & ~15;
  const out = new Float32Array(n * W.ne1), fn = wasm.fn[name];
  for (let r = 0; r < n; r++) {
    const a = (kq ? quantQ8K : quantQ80)(x, r * W.ne0, W.ne0), buf = wasm.mem.buffer; // after any grow
    new Int8Array(buf, qp, nb * block).set(a.q); new Float64Array(buf, dp, nb).set(a.d);
    if (kq) new Int32Array(buf, bsp, nb * 16).set(a.bs);
    fn(W._wp, W.ne1, nb, qp, bsp, dp, 0, op);
    out.set(new Float32Array(wasm.mem.buffer, op, W.ne1), r * W.ne1);
  }
  return out;
}

/** W {type, ne0, ne1, data: Uint8Array} times x (n rows of ne0 float32) -> n rows of ne1 float32. */
export function matmul(W, x, n) {
  if (wasm && WASM_DOTS[W.type]) return wasmMatmul(W, x, n);
  const [block, size, fmt] = TRAITS[W.type];
  const nb = W.ne0 / block, rowBytes = nb * size, dot = DOTS[W.type], act = ACTS[fmt];
  const out = new Float32Array(n * W.ne1), len = block === 1 ? W.ne0 : nb;
  for (let r = 0; r < n; r++) {
    const a = act(x, r * W.ne0, W.ne0);
    for (let o = 0, p = 0; o < W.ne1; o++, p += rowBytes) out[r * W.ne1 + o] = dot(W.data, p, len, a);
  }
  return out;
}

/** One expert: {gate, up, down, gateBias?, upBias?, downBias? (Float32Array), glu} on n rows. */
export function expertFfn(E, x, n) {
  const g = matmul(E.gate, x, n), u = matmul(E.up, x, n), nff = E.gate.ne1;
  if (E.gateBias) for (let i = 0; i < g.length; i++) g[i] = fr(g[i] + E.gateBias[i % nff]);
  if (E.upBias) for (let i = 0; i < u.length; i++) u[i] = fr(u[i] + E.upBias[i % nff]);
  const h = E.glu === "swiglu_oai" ? swigluOai(g, u, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT) : swiglu(g, u, nff);
  const y = matmul(E.down, h, n), ne = E.down.ne1;
  if (E.downBias) for (let i = 0; i < y.length; i++) y[i] = fr(y[i] + E.downBias[i % ne]);
  return y;
}
