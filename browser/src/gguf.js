// Just enough of a GGUF header to know each expert tensor's type and shape: read with HTTP
// Range requests, growing the window until the tensor table fits (a big tokenizer is megabytes).

const TEXT = new TextDecoder();
const SCALAR = { 0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8 };

class Short extends Error {}

function parse(buf) {
  const dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  let p = 0;
  const need = (n) => { if (p + n > buf.byteLength) throw new Short(); };
  const u32 = () => { need(4); const v = dv.getUint32(p, true); p += 4; return v; };
  const u64 = () => { need(8); const v = Number(dv.getBigUint64(p, true)); p += 8; return v; };
  const str = () => { const n = u64(); need(n); const s = TEXT.decode(buf.subarray(p, p + n)); p += n; return s; };
  const value = (t) => {
    if (t === 8) return str();
    if (t === 9) {
      const et = u32(), n = u64();
      if (et === 8) { for (let i = 0; i < n; i++) str(); return null; }
      const w = SCALAR[et]; if (!w) throw new Error(`GGUF array of type ${et}`);
      need(n * w); p += n * w; return null;
    }
    const w = SCALAR[t]; if (!w) throw new Error(`GGUF value of type ${t}`);
    need(w);
    let v;
    switch (t) {
      case 0: v = dv.getUint8(p); break; case 1: v = dv.getInt8(p); break;
      case 2: v = dv.getUint16(p, true); break; case 3: v = dv.getInt16(p, true); break;
      case 4: v = dv.getUint32(p, true); break; case 5: v = dv.getInt32(p, true); break;
      case 6: v = dv.getFloat32(p, true); break; case 7: v = !!dv.getUint8(p); break;
      case 10: v = Number(dv.getBigUint64(p, true)); break; case 11: v = Number(dv.getBigInt64(p, true)); break;
      case 12: v = dv.getFloat64(p, true); break;
    }
    p += w; return v;
  };
  need(4);
  if (TEXT.decode(buf.subarray(0, 4)) !== "GGUF") throw new Error("the weights file is not a GGUF file");
  p = 4;
  const version = u32(), nTensors = u64(), nKv = u64(), kv = {};
  if (version < 2) throw new Error(`GGUF version ${version} is too old`);
  for (let i = 0; i < nKv; i++) { const k = str(); kv[k] = value(u32()); }
  const tensors = {};
  for (let i = 0; i < nTensors; i++) {
    const name = str(), nd = u32(), ne = [];
    for (let j = 0; j < nd; j++) ne.push(u64());
    tensors[name] = { ne, type: u32(), offset: u64() };
  }
  const align = kv["general.alignment"] || 32;
  const dataOffset = Math.ceil(p / align) * align;
  return { kv, tensors, dataOffset, headerBytes: p };
}

/** Fetch and parse the header of `url`; `fetchRange(a, b)` -> Uint8Array of bytes [a, b). */
export async function readHeader(fetchRange, { start = 256 * 1024, max = 64 * 1024 * 1024 } = {}) {
  let size = start, fetched = 0;
  for (;;) {
    const buf = await fetchRange(0, size);
    fetched += buf.byteLength;
    try {
      return { ...parse(buf), fetched };
    } catch (e) {
      if (!(e instanceof Short) || buf.byteLength < size || size >= max) {
        if (e instanceof Short) throw new Error("the GGUF header is cut short");
        throw e;
      }
      size *= 4;
    }
  }
}
