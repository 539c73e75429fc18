// The market dashboard: one EventSource on /events, one redraw per snapshot. No framework, no
// build step: the DOM is built once per model and only its attributes and texts change.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);

function fmt(x, digits = 2) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
}

// A worker's mean reply latency as the backbones measured it; "-" when it has not served lately.
function latencyText(ms) {
  return ms === null || ms === undefined ? "-" : `${Number(ms).toFixed(1)} ms`;
}

function pct(x) {
  return x === null || x === undefined ? "unknown" : (100 * x).toFixed(1) + "%";
}

// Ranges travel half-open (lo <= e < hi); people read them inclusive, as `kvasir status` prints
// them (kvasir_bus.wire.Holding): L1:8-15 is experts 8 to 15.
function rangeText(layer, lo, hi) {
  return `L${layer}:${lo}-${hi - 1}`;
}

function holdingsText(hs) {
  return hs.map(([l, lo, hi]) => rangeText(l, lo, hi)).join(" ") || "-";
}

function section(doc) {
  let sec = document.querySelector(`section.model[data-model="${doc.model}"]`);
  if (!sec) {
    sec = $("#model-tpl").content.firstElementChild.cloneNode(true);
    sec.dataset.model = doc.model;
    $(".fp", sec).textContent = doc.model;
    $("#models").appendChild(sec);
  }
  return sec;
}

// The heatmap: one row per layer that has routed experts, one cell per expert.
function drawHeatmap(sec, doc) {
  const heat = $(".heatmap", sec);
  const layers = [...new Set(doc.demand.map((e) => e.layer))].sort((a, b) => a - b);
  const shape = `${layers.join(",")}x${doc.n_expert}`;
  if (heat.dataset.shape !== shape) {
    heat.textContent = "";
    heat.dataset.shape = shape;
    heat.style.gridTemplateColumns = `3em repeat(${doc.n_expert}, minmax(6px, 1fr))`;
    for (const layer of layers) {
      const lab = document.createElement("div");
      lab.className = "lab";
      lab.textContent = `L${layer}`;
      heat.appendChild(lab);
      for (let e = 0; e < doc.n_expert; e++) {
        const cell = document.createElement("div");
        cell.className = "cell";
        cell.dataset.layer = layer;
        cell.dataset.expert = e;
        heat.appendChild(cell);
      }
    }
    $(".legend", sec).innerHTML =
      '<span><i class="cell" data-replicas="0"></i> hole</span>' +
      '<span><i class="cell" data-replicas="0" data-pending="1"></i> assigned, downloading</span>' +
      '<span><i class="cell" data-replicas="1"></i> 1</span>' +
      '<span><i class="cell" data-replicas="2"></i> 2</span>' +
      '<span><i class="cell" data-replicas="3"></i> 3+ replicas</span>';
  }
  for (const cell of heat.querySelectorAll(".cell")) {
    const l = +cell.dataset.layer, e = +cell.dataset.expert;
    const r = doc.replicas[l][e], p = doc.pending[l][e];
    if (cell.dataset.replicas !== String(r)) cell.dataset.replicas = r;
    if (cell.dataset.pending !== String(p)) cell.dataset.pending = p;
    cell.classList.toggle("many", r > 3);
    cell.title = `layer ${l} expert ${e}: ${r} replica(s)` + (p ? `, ${p} pending` : "");
  }
}

// One polyline per key (class = the key), all on one scale: the first key's is the main line.
function drawChart(svg, points, keys, max) {
  const known = (key) => points.map((p) => p[key]).filter((v) => v !== null && v !== undefined);
  const top = max !== undefined ? max : Math.max(1e-9, ...keys.flatMap(known)) * 1.1;
  const n = Math.max(points.length - 1, 1);
  svg.innerHTML = keys.map((key) => {
    const xy = [];
    points.forEach((p, i) => {
      const v = p[key];
      if (v !== null && v !== undefined) xy.push(`${(300 * i / n).toFixed(1)},${(90 - 88 * v / top).toFixed(1)}`);
    });
    return `<polyline class="${key}" points="${xy.join(" ")}"></polyline>`;
  }).join("");
  svg.dataset.points = known(keys[0]).length;
}

// rows: [[text, numeric?, class?], ...] per row; a row may carry rowClass and title (properties).
function fillTable(tbody, rows) {
  tbody.textContent = "";
  for (const row of rows) {
    const tr = document.createElement("tr");
    if (row.rowClass) tr.className = row.rowClass;
    if (row.title) tr.title = row.title;
    for (const [text, num, cls] of row) {
      const td = document.createElement("td");
      td.textContent = text;
      td.className = [num ? "num" : "", cls || ""].join(" ").trim();
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
}

// A backbone's audit caught the node: on which expert, how far off (when: in the tooltip).
function quarantineText(q) {
  if (!q) return "-";
  const err = q.error === null ? "bad reply" : `error ${Number(q.error).toPrecision(2)}`;
  return `yes: L${q.layer} e${q.expert}, ${err}`;
}

function drawModel(doc) {
  const sec = section(doc);
  const holes = doc.demand.filter((e) => e.replicas === 0).length;
  $(".summary", sec).textContent = doc.manifest_known
    ? `${doc.n_layer} layers x ${doc.n_expert} experts, ${doc.demand.length} ranges of ${doc.range_experts}, ` +
      `${holes} holes, ${doc.nodes.length} workers` +
      ((doc.quarantined || []).length ? `, quarantined: ${doc.quarantined.map((q) => q.node).join(", ")}` : "")
    : "manifest not received from the backbone yet";
  // Keys the enrolment service revoked (the server dropped and refuses them), most recent first.
  const revoked = (doc.revoked || []).slice().reverse();
  $(".summary", sec).title = revoked.map((r) => `${r.node} revoked ${new Date(r.at * 1000).toLocaleString()}: ${r.why}`).join("\n");
  if (revoked.length) $(".summary", sec).textContent += `; revoked: ${revoked.map((r) => r.node).join(", ")}`;
  if (doc.manifest_known) drawHeatmap(sec, doc);

  const hist = doc.history || [];
  drawChart($("svg.fallback", sec), hist, ["fallback_rate"], 1);
  drawChart($("svg.tokens", sec), hist, ["tokens_per_s", "rows_per_s"]);
  const last = hist[hist.length - 1] || {};
  $(".fallback-now", sec).textContent = `now ${pct(last.fallback_rate)}`;
  $(".tokens-now", sec).textContent = `now ${fmt(last.tokens_per_s, 1)} tokens/s`;
  $(".rows-now", sec).textContent = `${fmt(last.rows_per_s, 1)} rows/s per MoE layer`;

  const rewards = Object.fromEntries(doc.rewards.nodes.map((t) => [t.node, t]));
  const caught = Object.fromEntries((doc.quarantined || []).map((q) => [q.node, q]));
  const audits = doc.audits || {};
  // The market drops a quarantined node from its workers and ignores its heartbeats: such a
  // node keeps a row here (what it held is unknown), so the page still says who was caught.
  const listed = new Set(doc.nodes.map((n) => n.node));
  const dropped = (doc.quarantined || []).filter((q) => !listed.has(q.node)).map((q) => ({node: q.node}));
  fillTable($("table.workers tbody", sec), doc.nodes.concat(dropped).map((n) => {
    const t = rewards[n.node], q = caught[n.node], known = listed.has(n.node);
    const held = known ? holdingsText(n.holdings) + (n.pending.length ? ` (pending ${holdingsText(n.pending)})` : "")
      : "- (dropped by the market)";
    const row = [[n.node], [n.kernel || "-"], [n.version || "-"], [held], [latencyText(n.latency_ms), 1, "latency"],
                 [known ? fmt(n.load, 0) : "-", 1], [known ? String(n.served) : "-", 1],
                 [!known ? "ignored" : n.age_s === null ? "never" : `${fmt(n.age_s, 1)} s ago`, 1],
                 [t ? String(t.rows) : "0", 1], [t ? fmt(t.reward, 3) : "0.000", 1],
                 [audits[n.node] ? `${audits[n.node].passed} / ${audits[n.node].failed}` : "0 / 0", 1],
                 [quarantineText(q), 0, "quarantine"]];
    if (q) {
      row.rowClass = "quarantined";
      row.title = `quarantined at ${new Date(q.at * 1000).toLocaleString()} (kernel ${q.kernel || "-"}, ` +
        `${q.exact ? "identical bits" : "a tolerance"} demanded)`;
    }
    return row;
  }));
  const wanted = doc.demand.filter((e) => e.demand > 0)
    .sort((a, b) => (a.replicas > 0) - (b.replicas > 0) || b.demand - a.demand || a.layer - b.layer || a.lo - b.lo)
    .slice(0, 12);
  fillTable($("table.demand tbody", sec), wanted.map((e) => [
    [rangeText(e.layer, e.lo, e.hi)], [String(e.replicas), 1], [String(e.target), 1],
    [pct(e.usage), 1], [fmt(e.demand), 1], [fmt(e.reward_rate, 3), 1]]));
}

function draw(state) {
  $("#empty").hidden = state.models.length > 0;
  const seen = new Set();
  for (const doc of state.models) {
    drawModel(doc);
    seen.add(doc.model);
  }
  for (const sec of document.querySelectorAll("section.model")) {
    if (!seen.has(sec.dataset.model)) sec.remove();
  }
  $("#updated").textContent = "updated " + new Date(state.sent_at * 1000).toLocaleTimeString();
  document.body.dataset.sentAt = state.sent_at;  // tests wait for a fresh snapshot on this
}

function connect() {
  const conn = $("#conn");
  const src = new EventSource("/events");
  src.addEventListener("state", (ev) => {
    conn.dataset.state = "live";
    conn.textContent = "live";
    draw(JSON.parse(ev.data));
  });
  src.onerror = () => {  // EventSource reconnects by itself
    conn.dataset.state = "lost";
    conn.textContent = "reconnecting";
  };
}

connect();
