// Gated activations as ggml's CPU backend computes them (kernels/glu.py, the same bits): silu
// as ggml_vec_swiglu_f32 on an AVX-512 CPU (ggml_v_expf's polynomial for whole 16-float vectors,
// scalar x / (1 + expf(-x)) for the rest of a row) and gpt-oss' swiglu_oai (scalar, expf),
// each float32 operation of ggml's rounded as ggml rounds it. float32 +, *, / are float64 ones
// rounded with Math.fround (exact: float64 has more than twice float32's bits); an FMA is
// float64 a * b + c (the product is exact) rounded once more, redone where that sum sits
// exactly half-way between two float32 values; expf is glibc's algorithm step by step.

const fr = Math.fround;
const hex = (m, e) => m * 2 ** e; // a hex float literal: mantissa (as an integer) times 2^e
const SHIFT = fr(hex(0x18, 19)); // 0x1.8p23
const LOG2E = fr(hex(0x1715476, -24)); // 0x1.715476p+0
const LN2_HI = fr(hex(0x162e4, -17)); // 0x1.62e4p-1
const LN2_LO = fr(hex(0x17f7d1c, -44)); // 0x1.7f7d1cp-20
const C1 = fr(hex(0x1ffffec, -25)); // 0x1.ffffecp-1
const C2 = fr(hex(0x1fffdb6, -26)); // 0x1.fffdb6p-2
const C3 = fr(hex(0x1555e66, -27)); // 0x1.555e66p-3
const C4 = fr(hex(0x1573e2e, -29)); // 0x1.573e2ep-5
const C5 = fr(hex(0x10e4020, -31)); // 0x1.0e4020p-7
export const WIDTH = 16; // floats per ggml_v_silu call on AVX-512

const _d = new Float64Array(1), _w = new Uint32Array(_d.buffer); // _w[0]: the low word (little-endian)

/** float32 fma(a, b, c) with one rounding, of float32 inputs. */
export function fma32(a, b, c) {
  const p = a * b;
  let s = p + c;
  _d[0] = s;
  if ((_w[0] & 0x1fffffff) === 0x10000000) { // on a float32 midpoint: was the float64 sum exact?
    const bb = s - p, err = (p - (s - bb)) + (c - bb);
    if (err !== 0) {
      _w[0] += (err > 0) === (s > 0) ? 1 : -1; // one float64 ulp toward the exact sum
      s = _d[0];
    }
  }
  return fr(s);
}

// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c): x N / ln 2 = k + r, 2^(k/N) from a table
const TAB = Array.from({ length: 32 }, (_, i) => 2 ** (i / 32));
const INVLN2N = hex(0x171547652b82fe, -52) * 32;
const ESHIFT = hex(0x18, 48); // 0x1.8p52
const E0 = hex(0x1c6af84b912394, -57) / 32768, E1 = hex(0x1ebfce50fac4f3, -55) / 1024,
  E2 = hex(0x162e42ff0c52d6, -53) / 32;
const OVER = fr(hex(0x162e42e, -18)), UNDER = -fr(hex(0x19fe368, -18)); // 0x1.62e42ep6, -0x1.9fe368p6

/** glibc's expf of a float32 value. */
export function expf(x) {
  if (x > OVER) return Infinity;
  if (x < UNDER) return 0;
  const z = INVLN2N * x, kd = (z + ESHIFT) - ESHIFT, r = z - kd;
  const i = ((kd % 32) + 32) % 32, s = TAB[i] * 2 ** ((kd - i) / 32);
  return fr(((E0 * r + E1) * (r * r) + (E2 * r + 1)) * s);
}

/** ggml_v_expf, AVX-512 form, of one float32 lane. */
export function vExpf(x) {
  const z = fma32(x, LOG2E, SHIFT), n = fr(z - SHIFT);
  if (Math.abs(n) > 192) return n <= 0 ? 0 : Infinity;
  const b = fma32(-n, LN2_LO, fma32(-n, LN2_HI, x)), u = fr(b * b);
  const j = fma32(fma32(fma32(C5, b, C4), u, fma32(C3, b, C2)), u, fma32(C1, b, 1));
  return fr(j * 2 ** n); // vscalefps: one rounding
}

/** h = silu(g) * u over rows of nff (Float32Arrays of n * nff), as ggml_vec_swiglu_f32. */
export function swiglu(g, u, nff) {
  const h = new Float32Array(g.length), split = nff - (nff % WIDTH);
  for (let r = 0; r < g.length; r += nff) {
    for (let c = 0; c < nff; c++) {
      const x = g[r + c], e = c < split ? vExpf(fr(0 - x)) : expf(-x);
      h[r + c] = fr(fr(x / fr(1 + e)) * u[r + c]);
    }
  }
  return h;
}

/** gpt-oss' swiglu_oai as ggml_compute_forward_swiglu_oai_f32 computes it. */
export function swigluOai(g, u, alpha, limit) {
  const h = new Float32Array(g.length);
  for (let i = 0; i < h.length; i++) {
    const x = Math.min(g[i], limit), y = Math.max(-limit, Math.min(u[i], limit));
    h[i] = fr(fr(x / fr(1 + expf(fr(alpha * -x)))) * fr(y + 1));
  }
  return h;
}
