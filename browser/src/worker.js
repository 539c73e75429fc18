// A volunteer expert worker in a browser tab, written from docs/protocol.md:
//   bus  -> kvasir.<model>.manifest           the backbone's manifest (SHA-256 of every slab)
//   bus  -> kvasir.<model>.market.volunteer.<node>  the scarcest range that fits the budget
//   HTTP -> the GGUF's header, then only the assigned slabs (Range requests), each hashed
//   bus  <- kvasir.<model>.x.<layer>.<expert>  and kvasir.<model>.n.<node> (bundles): answered
//   bus  -> kvasir.<model>.coverage.<node>    heartbeats every 2 s, kernel label js-wasm32
//   bus  -> kvasir.<model>.market.node.<node>  its credit, audits passed and failed, quarantine
// Opened as /worker?nats=ws://BUS:PORT&budget=64MB&node=NAME[&token=T][&model=FP].

import { wsconnect } from "@nats-io/nats-core";
import { encode, decode } from "@msgpack/msgpack";
import { readHeader } from "./gguf.js";
import { sha256hex } from "./sha256.js";
import { expertFfn, weightBytes, f16ToF32, TYPE_NAMES, useWasm, kernelLabel } from "./kernel.js";
import simdWasm from "./simd.wat";

const VERSION = "0.1.0-browser";
// Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and MXFP4 in WebAssembly SIMD where the browser has it (src/simd.wat), else
// plain JavaScript; both compute the same bits (tests/browser/test_kernel_node.py checks), the
// label says which one runs.
useWasm(Uint8Array.from(atob(simdWasm), (c) => c.charCodeAt(0)));
const KERNEL = kernelLabel();
const KINDS = ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"];
const MAX_ROWS = 4096, MAX_REQUEST = 8 * 1024 * 1024;
const ID_RE = /^[A-Za-z0-9_.:-]{1,64}$/, NODE_RE = /^[A-Za-z0-9_-]{1,64}$/;

const ui = {};
const S = window.kvasir = {
  state: "starting", error: "", model: "", node: "", holdings: [], assignedBytes: 0,
  headerBytes: 0, slabBytes: 0, served: 0, rows: 0, rowsByLayer: {}, computeMs: 0, reward: 0, creditedRows: 0,
  auditsPassed: 0, auditsFailed: 0, auditsKnown: false, quarantined: false, errors: 0, lying: false, log: [],
};

function show() {
  const rate = S.computeMs > 0 ? (S.rows / (S.computeMs / 1000)) : 0;
  ui.state.textContent = S.state; ui.state.className = "state " + S.state.split(" ")[0];
  ui.range.textContent = S.holdings.length ? S.holdings.map(([l, a, b]) => `L${l}:${a}-${b - 1}`).join(", ") +
    ` (${(S.assignedBytes / 1e6).toFixed(2)} MB)` : "-";
  ui.rows.textContent = `${S.rows} rows in ${S.served} calls`;
  ui.speed.textContent = rate ? `${rate.toFixed(1)} rows/s (${KERNEL})` : "-";
  ui.reward.textContent = `${S.reward.toFixed(4)} (${S.creditedRows} rows credited)`;
  // The backbones report every audit they judge, passed or failed, in their routing statistics;
  // the market adds them up per node (this tab's node report), and a failed one is also
  // announced at once (kvasir.<model>.quarantine).
  const counts = `audits passed: ${S.auditsPassed}, failed: ${S.auditsFailed}`;
  ui.audits.textContent = S.quarantined ? `FAILED: quarantined by the backbone (its replies are no longer used); ${counts}` :
    S.auditsKnown ? `${counts} (counted by the market from the backbones' reports)` :
    `${counts} (no audit of this tab reported yet)`;
  if (S.lying) ui.audits.textContent += " [TEST MODE: this tab corrupts its replies]";
  ui.error.textContent = S.error; ui.error.hidden = !S.error;
}
function say(msg) { S.log.push(msg); if (S.log.length > 50) S.log.shift(); ui.log.textContent = S.log.slice(-8).join("\n"); }
function fail(msg) { S.error = msg; S.state = "error"; say("error: " + msg); show(); }

function parseSize(text) {
  const m = /^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)b?\s*$/i.exec(text || "");
  if (!m) throw new Error(`budget ${JSON.stringify(text)}: expected a size like 64MB or 1.5GiB`);
  const base = m[3] ? 1024 : 1000, pow = { "": 0, k: 1, m: 2, g: 3, t: 4 }[m[2].toLowerCase()];
  return Math.floor(parseFloat(m[1]) * base ** pow);
}

const enc = (rec) => encode({ v: 1, ...rec });
function dec(data) {
  const m = decode(data);
  if (!m || typeof m !== "object" || Array.isArray(m)) throw new Error("not a msgpack map");
  return m;
}

// -- the manifest (kvasir_bus/market_codec.py Manifest, docs/protocol.md) -----------------
function readManifest(m) {
  if (m.t === "e") throw new Error(`the backbone has no manifest: ${m.code}: ${m.message}`);
  if (m.t !== "mf" || (m.v !== 1 && m.v !== 2)) throw new Error(`unexpected manifest reply (v=${m.v}, t=${m.t})`);
  if (m.parts && m.parts.length) throw new Error("split GGUF models are not supported by the browser worker yet");
  const n = m.n_slabs, u32 = (b) => new Uint32Array(b.slice().buffer), slabs = new Map();
  const L = u32(m.slab_layer), E = u32(m.slab_expert), K = m.slab_kind;
  const off = new DataView(m.slab_offset.slice().buffer), size = new DataView(m.slab_size.slice().buffer);
  if (L.length !== n || E.length !== n || K.length !== n || m.slab_sha256.length !== 32 * n) throw new Error("manifest arrays do not match n_slabs");
  for (let i = 0; i < n; i++) {
    const key = `${L[i]}.${E[i]}`;
    if (!slabs.has(key)) slabs.set(key, {});
    slabs.get(key)[KINDS[K[i]]] = {
      offset: Number(off.getBigUint64(8 * i, true)), size: Number(size.getBigUint64(8 * i, true)),
      sha256: Array.from(m.slab_sha256.subarray(32 * i, 32 * i + 32), (x) => x.toString(16).padStart(2, "0")).join(""),
    };
  }
  return { model: m.model, arch: m.arch, nLayer: m.n_layer, nExpert: m.n_expert, nEmbd: m.n_embd, nFf: m.n_ff,
    fileBytes: m.file_bytes, dataOffset: m.data_offset, slabs };
}
function smallestExpert(man) {
  let best = Infinity;
  for (const s of man.slabs.values()) best = Math.min(best, Object.values(s).reduce((a, x) => a + x.size, 0));
  return best;
}

// -- the bus ------------------------------------------------------------------------------
async function connectWithBackoff(servers, name) {
  let delay = 500;
  for (;;) {
    try {
      S.state = "connecting"; show();
      const nc = await wsconnect({ servers, name, maxReconnectAttempts: -1, reconnectTimeWait: 1000, timeout: 5000 });
      return nc;
    } catch (e) {
      S.error = `the bus at ${servers} is unreachable (${e.message || e}); retrying in ${(delay / 1000).toFixed(1)} s`;
      S.state = "retrying"; show();
      await new Promise((r) => setTimeout(r, delay));
      delay = Math.min(delay * 2, 30000);
    }
  }
}

async function request(nc, subject, payload, timeout = 10000) {
  try {
    return dec((await nc.request(subject, payload, { timeout })).data);
  } catch (e) {
    const what = String(e && (e.code || e.message || e));
    if (/503|no responders/i.test(what)) throw Object.assign(new Error(`nobody answers ${subject}`), { noResponders: true });
    throw new Error(`${subject}: ${e.message || e}`);
  }
}

async function main() {
  for (const id of ["state", "range", "rows", "speed", "reward", "audits", "error", "log", "stop", "node"]) ui[id] = document.getElementById(id);
  const q = new URLSearchParams(location.search);
  const servers = q.get("nats") || `ws://${location.hostname}:8080`;
  const node = S.node = q.get("node") || "tab-" + Math.random().toString(36).slice(2, 10);
  ui.node.textContent = node;
  const token = q.get("token") || "";
  let budget;
  try {
    if (!NODE_RE.test(node)) throw new Error(`node name ${JSON.stringify(node)}: use 1-64 of A-Z a-z 0-9 _ -`);
    budget = parseSize(q.get("budget") || "64MB");
  } catch (e) { return fail(e.message); }

  const cfg = await (await fetch("/worker/config.json")).json();
  const model = S.model = q.get("model") || cfg.model;
  if (!model) return fail("this weights server does not know its model's fingerprint: add &model=FINGERPRINT to the link");
  // &lie=1 (tests only): corrupt every reply, to be caught by the audit; honoured only where the
  // weights server was started with its test switch (config.json says test_lies), never by default.
  S.lying = q.get("lie") === "1" && cfg.test_lies === true;
  if (S.lying) say("TEST MODE: this tab corrupts its replies (the weights server allows it for tests)");
  const fileUrl = new URL("/" + encodeURIComponent(cfg.file), location.href);
  if (token) fileUrl.searchParams.set("token", token);

  const nc = await connectWithBackoff(servers, `kvasir-browser-worker-${node}`);
  S.error = ""; S.state = "connected"; show(); say(`connected to ${servers}`);
  (async () => { for await (const s of nc.status()) { if (s.type === "disconnect") { S.state = "reconnecting"; show(); } if (s.type === "reconnect") { S.state = "serving"; show(); } } })();
  const root = `kvasir.${model}`;

  // manifest, then the market's assignment
  let man;
  try { man = readManifest(await request(nc, `${root}.manifest`, new Uint8Array(0))); }
  catch (e) { return fail(e.noResponders ? `no backbone serves model ${model} on this bus` : e.message); }
  const smallest = smallestExpert(man);
  if (budget < smallest) return fail(`the budget of ${(budget / 1e6).toFixed(2)} MB is too small for one expert of this model (${(smallest / 1e6).toFixed(2)} MB)`);
  let asg, delay = 250;
  for (let tries = 0; ; tries++) {
    try { asg = await request(nc, `${root}.market.volunteer.${node}`, enc({ t: "vq", model, node, budget_bytes: budget })); }
    catch (e) { if (e.noResponders && tries < 8) { await new Promise((r) => setTimeout(r, 500)); continue; } return fail(e.noResponders ? "no market answers on this bus" : e.message); }
    if (asg.t === "e" && ["no_manifest", "warming_up", "internal"].includes(asg.code) && tries < 40) {
      await new Promise((r) => setTimeout(r, delay)); delay = Math.min(2 * delay, 5000); continue;
    }
    break;
  }
  if (asg.t === "e") return fail(asg.code === "no_fit" ? `the budget is too small for one expert: ${asg.message}` : `the market refused: ${asg.code}: ${asg.message}`);
  if (asg.t !== "as" || asg.model !== model || asg.node !== node) return fail("the market's answer is not an assignment for this tab");
  S.holdings = asg.holdings; S.assignedBytes = asg.bytes; show();
  say(`assigned ${asg.holdings.map(([l, a, b]) => `L${l}:${a}-${b - 1}`).join(", ")}`);

  // the GGUF header (types and shapes), then the slabs
  S.state = "downloading"; show();
  const hdrs = { "X-Kvasir-Node": node, ...(token ? { Authorization: `Bearer ${token}` } : {}) };
  const range = async (a, b) => {
    const r = await fetch(fileUrl, { cache: "no-store", headers: { ...hdrs, Range: `bytes=${a}-${b - 1}` } });
    if (r.status === 401) throw new Error("the weights server refused the download: a valid token= is needed");
    if (r.status !== 206 && r.status !== 200) throw new Error(`the weights server answered ${r.status}`);
    return new Uint8Array(await r.arrayBuffer());
  };
  let hdr;
  try { hdr = await readHeader(range); } catch (e) { return fail(`cannot read the model's header: ${e.message}`); }
  S.headerBytes = hdr.fetched;
  if (hdr.dataOffset !== man.dataOffset) return fail("the weights file differs from the backbone's manifest (data offset)");
  const glu = man.arch === "gpt-oss" ? "swiglu_oai" : "swiglu";
  const experts = new Map();
  for (const [layer, lo, hi] of asg.holdings) {
    const t = {};
    for (const k of ["gate", "up", "down"]) {
      t[k] = hdr.tensors[`blk.${layer}.ffn_${k}_exps.weight`];
      if (!t[k]) return fail(`the model has no tensor blk.${layer}.ffn_${k}_exps.weight`);
      try { weightBytes(t[k].type, t[k].ne[0], t[k].ne[1]); } catch (e) { return fail(`${k} of layer ${layer}: ${e.message}`); }
    }
    for (let e = lo; e < hi; e++) {
      const refs = man.slabs.get(`${layer}.${e}`);
      if (!refs) return fail(`the manifest has no layer ${layer} expert ${e}`);
      const E = { glu };
      for (const kind of KINDS) {
        const ref = refs[kind];
        if (!ref) continue;
        const data = await range(ref.offset, ref.offset + ref.size);
        S.slabBytes += data.byteLength; show();
        if (data.byteLength !== ref.size || await sha256hex(data) !== ref.sha256) {
          return fail(`layer ${layer} expert ${e} ${kind}: the slab failed its SHA-256 check against the manifest; refusing to serve it`);
        }
        if (kind.endsWith("_bias")) E[kind.replace("_bias", "Bias")] = new Float32Array(data.buffer, data.byteOffset, data.byteLength / 4);
        else E[kind] = { type: t[kind].type, ne0: t[kind].ne[0], ne1: t[kind].ne[1], data };
      }
      experts.set(`${layer}.${e}`, E);
    }
  }
  say(`downloaded ${S.slabBytes} slab bytes (${[...new Set(asg.holdings.map(([l]) => TYPE_NAMES[hdr.tensors[`blk.${l}.ffn_gate_exps.weight`].type]))].join(", ")}), all verified`);

  // serving
  const nEmbd = man.nEmbd, subs = [];
  const reply = (msg, rec) => { try { msg.respond(enc(rec)); } catch { /* the asker is gone */ } };
  const errReply = (msg, id, code, message) => reply(msg, { t: "e", request_id: ID_RE.test(id || "") ? id : "", node, code, message: message.slice(0, 1024) });
  const rowsOf = (m) => {
    if (!Array.isArray(m.shape) || m.shape.length !== 2 || m.shape[1] !== nEmbd || !(m.shape[0] >= 1) || m.shape[0] > MAX_ROWS) throw new Error(`shape ${JSON.stringify(m.shape)} does not fit [rows, ${nEmbd}]`);
    const n = m.shape[0] * nEmbd, d = m.data;
    if (!(d instanceof Uint8Array)) throw new Error("data must be bin");
    if (m.dtype === "float32" && d.byteLength === 4 * n) return new Float32Array(d.slice().buffer);
    if (m.dtype === "float16" && d.byteLength === 2 * n) {
      const h = new Uint16Array(d.slice().buffer), x = new Float32Array(n);
      for (let i = 0; i < n; i++) x[i] = f16ToF32(h[i]);
      return x;
    }
    throw new Error(`data is ${d.byteLength} bytes, not ${m.shape[0]} rows of ${nEmbd} ${m.dtype}`);
  };
  const compute = (layer, E, x, n) => {
    const t0 = performance.now(), y = expertFfn(E, x, n);
    S.computeMs += performance.now() - t0; S.rows += n; S.rowsByLayer[layer] = (S.rowsByLayer[layer] || 0) + n;
    if (S.lying) for (let i = 0; i < y.length; i++) y[i] = y[i] * 1.5 + 0.01;
    return y;
  };
  const check = (m, kind) => {
    if (m.v !== 1) throw Object.assign(new Error(`protocol version ${m.v} is not supported`), { code: "bad_request" });
    if (m.t !== kind) throw Object.assign(new Error(`expected a ${kind} message, got ${m.t}`), { code: "bad_request" });
    if (m.model !== model) throw Object.assign(new Error(`this node serves model ${model}`), { code: "wrong_model" });
  };
  const onRequest = (layer, expert) => (err, msg) => {
    if (err || !msg.reply) return;
    let m = {};
    try {
      if (msg.data.byteLength > MAX_REQUEST) throw Object.assign(new Error("request too large"), { code: "bad_request" });
      m = dec(msg.data); check(m, "x");
      if (!ID_RE.test(m.request_id || "")) throw Object.assign(new Error("bad request_id"), { code: "bad_request" });
      if (m.layer !== layer || m.expert !== expert) throw Object.assign(new Error("layer/expert differ from the subject"), { code: "bad_request" });
      const x = rowsOf(m), n = m.shape[0], y = compute(layer, experts.get(`${layer}.${expert}`), x, n);
      S.served++;
      reply(msg, { t: "r", request_id: m.request_id, node, dtype: "float32", shape: [n, nEmbd], data: new Uint8Array(y.buffer), kernel: KERNEL });
    } catch (e) { S.errors++; errReply(msg, m.request_id, e.code || "bad_request", e.message); }
    show();
  };
  const onBundle = (err, msg) => {
    if (err || !msg.reply) return;
    let m = {};
    try {
      if (msg.data.byteLength > MAX_REQUEST) throw Object.assign(new Error("bundle too large"), { code: "bad_request" });
      m = dec(msg.data); check(m, "xb");
      const { ids, experts: ex, counts } = m;
      if (!ID_RE.test(m.bundle_id || "") || !Array.isArray(ids) || !Array.isArray(ex) || !Array.isArray(counts) ||
          ids.length !== ex.length || ids.length !== counts.length || ids.length < 1 || ids.length > Math.min(4096, man.nExpert) ||
          new Set(ids).size !== ids.length || !ids.every((i) => ID_RE.test(i)) || !counts.every((c) => Number.isInteger(c) && c >= 1) ||
          !ex.every((e) => Number.isInteger(e) && e >= 0)) throw Object.assign(new Error("ids, experts, counts do not fit"), { code: "bad_request" });
      const x = rowsOf(m), R = m.shape[0], total = counts.reduce((a, b) => a + b, 0);
      if (total > MAX_ROWS || !(m.index instanceof Uint8Array) || m.index.byteLength !== 4 * total) throw Object.assign(new Error("index does not fit"), { code: "bad_request" });
      const index = new DataView(m.index.buffer, m.index.byteOffset, m.index.byteLength);
      const outIds = [], outCounts = [], errors = [], parts = [];
      for (let i = 0, o = 0; i < ids.length; o += counts[i], i++) {
        const E = experts.get(`${m.layer}.${ex[i]}`);
        if (!E) { errors.push([ids[i], "not_held", `this node does not hold layer ${m.layer} expert ${ex[i]}`]); continue; }
        const rows = new Float32Array(counts[i] * nEmbd);
        for (let j = 0; j < counts[i]; j++) {
          const r = index.getUint32(4 * (o + j), true);
          if (r >= R) throw Object.assign(new Error(`index ${r} >= ${R}`), { code: "bad_request" });
          rows.set(x.subarray(r * nEmbd, (r + 1) * nEmbd), j * nEmbd);
        }
        parts.push(compute(m.layer, E, rows, counts[i])); outIds.push(ids[i]); outCounts.push(counts[i]);
      }
      const n = outCounts.reduce((a, b) => a + b, 0), out = new Float32Array(n * nEmbd);
      for (let i = 0, o = 0; i < parts.length; o += parts[i].length, i++) out.set(parts[i], o);
      S.served += outIds.length;
      reply(msg, { t: "rb", bundle_id: m.bundle_id, node, ids: outIds, counts: outCounts, dtype: "float32",
        shape: [n, nEmbd], data: new Uint8Array(out.buffer), errors, kernel: KERNEL });
    } catch (e) { S.errors++; errReply(msg, m.bundle_id, e.code || "bad_request", e.message); }
    show();
  };
  for (const key of experts.keys()) {
    const [l, e] = key.split(".").map(Number);
    subs.push(nc.subscribe(`${root}.x.${l}.${e}`, { callback: onRequest(l, e) }));
  }
  subs.push(nc.subscribe(`${root}.n.${node}`, { callback: onBundle }));
  subs.push(nc.subscribe(`${root}.quarantine`, { callback: (err, msg) => {
    try { const m = dec(msg.data); if (m.t === "q" && m.node === node) { S.quarantined = true; say(`quarantined: layer ${m.layer} expert ${m.expert}, error ${m.error}`); show(); } } catch { /* not ours */ }
  } }));
  await nc.flush();
  const heartbeat = () => nc.publish(`${root}.coverage.${node}`, enc({ t: "hb", model, node, holdings: asg.holdings,
    budget_bytes: budget, load: 0, served: S.served, version: VERSION, kernel: KERNEL, sent_at: Date.now() / 1000 + 1e-6, bundles: true }));
  heartbeat();
  S.state = "serving"; show(); say(`serving ${experts.size} experts`);
  const beat = setInterval(heartbeat, 2000);
  // What the market holds of this tab (credit, audits, quarantine): its own node report, a few
  // dozen bytes (docs/protocol.md), the one market subject a worker may ask under kvasir creds.
  const report = setInterval(async () => {
    try {
      const r = await request(nc, `${root}.market.node.${node}`, new Uint8Array(0), 3000);
      if (r.t === "nr" && r.node === node && [r.rows, r.audits_passed, r.audits_failed].every(Number.isSafeInteger)) {
        S.creditedRows = r.rows; S.reward = Number(r.reward) || 0;
        S.auditsPassed = r.audits_passed; S.auditsFailed = r.audits_failed; S.auditsKnown = true;
        if (r.quarantined === true) S.quarantined = true;
      }
      show();
    } catch { /* the market may be restarting */ }
  }, 2000);

  let stopped = false;
  const leave = async (why) => {
    if (stopped) return; stopped = true;
    clearInterval(beat); clearInterval(report);
    for (const s of subs) s.unsubscribe();
    S.state = "stopped"; S.holdings = []; say(`left the swarm (${why})`); show();
    try { await nc.drain(); } catch { /* closing anyway */ }
  };
  ui.stop.disabled = false;
  ui.stop.onclick = () => leave("stop button");
  window.addEventListener("pagehide", () => leave("tab closed"));
  S.leave = leave;
}

main().catch((e) => fail(String(e && e.message || e)));
