"""A calibrated profile (``kvasir calibrate``'s JSON) as the cost functions the simulator uses.

Every cost is a fitted line in what it grows with (rows, experts, context). A profile belongs to
the model it was measured on: :func:`costs_for` refuses another model's unless ``rescale`` says
to scale it, and then scales each cost by the bytes it streams (a dense layer's weights, an
expert's slabs) and the context term by the KV width, and says so in ``Costs.notes``.
``backbone_cores``: a backbone with that many cores instead of the profile's, its dense path
assumed to scale linearly with them (stated as such wherever it is used); the dispatch runs on
the engine's and the bus's threads and does not scale.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvasir_bus.errors import UsageError
from planner.shapes import Shapes

PROFILE_KIND = "kvasir-profile"
PROFILE_VERSION = 1


def load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise UsageError(f"--profile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--profile {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND or data.get("version") != PROFILE_VERSION:
        raise UsageError(f"--profile {path}: not a kvasir profile of version {PROFILE_VERSION} "
                         "(make one with kvasir calibrate)")
    if "model" not in data or "worker" not in data:
        raise UsageError(f"--profile {path}: incomplete (no model or worker section)")
    return data


@dataclass(frozen=True)
class Line:
    """``c0 + c1 * x1 + c2 * x2 + c3 * x3`` (seconds)."""

    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0
    c3: float = 0.0

    def __call__(self, x1: float = 0.0, x2: float = 0.0, x3: float = 0.0) -> float:
        return self.c0 + self.c1 * x1 + self.c2 * x2 + self.c3 * x3

    def scaled(self, k: float, k2: float | None = None) -> "Line":
        return Line(self.c0 * k, self.c1 * k, self.c2 * (k if k2 is None else k2), self.c3 * k)


@dataclass(frozen=True)
class Costs:
    """Seconds per piece of work, for one model's shapes on one backbone and one kind of worker."""

    attention: Line  # per layer: (rows, rows * context, sequences in the step)
    recurrent: Line  # per layer: (rows, rows * context, sequences in the step)
    shared: Line  # per layer: (rows,), overlapped with the routed experts' wait
    head: Line  # per step: (rows,)
    backbone_kernel: Line  # a local fallback or audit of a layer: (calls, rows)
    worker_kernel: Line  # one message of a worker: (calls, rows)
    backbone_per_message: float
    backbone_per_call: float
    backbone_per_row: float
    worker_per_message: float
    nats_per_message: float
    hop: float  # wall time per layer step at zero round trip beyond the CPU (wake-ups, loopback)
    row_bytes: int
    call_bytes: int
    message_bytes: int
    backbone_threads: int  # the cores the dense path keeps busy while it runs
    request: float = 0.0  # kvasir serve's HTTP exchange and admission, per request
    token: float = 0.0  # its streamed event, per token
    # One expert computed alone on the backbone, per call: (rows,). Fallbacks, audits, silent
    # experts, hot experts and a fresh backbone's compute-ahead run it one call at a time.
    local_call: Line = Line()
    # A layer step sent and awaited through the bus client's loop thread instead of the engine
    # thread's own connection (balance mode, calls on experts' subjects, probes): the extra wall
    # time of the hand-offs between the threads, per layer step.
    bus_path: float = 0.0
    # Workers on the cores the backbone runs on (colocated): CPU per worker a layer step wakes past
    # the first (processes woken at once on shared cores), fitted by kvasir calibrate so that a
    # second worker costs the model what it was measured to cost.
    fanout: float = 0.0
    # The bus client's loop thread's CPU per won call while the engine thread sends and reads the
    # step itself (the market link's share: each win's ledger event and the routing statistics,
    # batched and stored): work of a thread of its own on the backbone's cores, beside the engine's.
    bus_per_win: float = 0.0
    # Of ``backbone_per_call``, the part that taking a call's reply costs (decoding its output,
    # settling it), paid once per reply: twice for a call two replicas both answer (race mode).
    reply_per_call: float = 0.0
    # Balance mode, per call: when to hedge it (the percentiles of its expert's recent round trips,
    # backbone/replicas.py hedge_delay) and its timer, on the bus thread (the GIL's).
    hedge_per_call: float = 0.0
    # Colocated: a core's speed while every core of the machine runs our work, relative to one
    # alone (kvasir calibrate fits it with ``fanout`` on its one- and two-worker runs); 1: no loss.
    core_efficiency: float = 1.0
    # An audited call's recomputation beyond the reference computed ahead, per call: (rows,). 0
    # when the worker's kernel is one this backbone runs (the bits are compared); numpy's, or numpy
    # with the flips taken out, for other kernels (backbone/audit.py rerun_backend).
    audit_recompute: Line = Line()
    audit_path: str = "exact"
    # On the numpy paths, per audited call whose expert's weights the backbone's cache of
    # dequantized weights does not hold: dequantizing them (sim._DequantCache). 0: not measured
    # (profiles before it was: their audit line is the mean over the calibration's own misses).
    audit_miss: float = 0.0
    # The workers' kernel on a call of ``tiled_from`` rows or more, where a fast-mode worker's ggml
    # takes its tiled kernels (planner/calibrate.py measure_tiled): what such a call costs less
    # than ``worker_kernel`` says, per call and per row (deltas, usually negative). 0: the workers
    # run the kernel the profile timed (deterministic workers, or a profile without it).
    tiled_from: int = 0
    tiled_call: float = 0.0
    tiled_row: float = 0.0
    notes: tuple[str, ...] = field(default=())


def _line(d: dict, a: str, b: str | None = None, c: str | None = None) -> Line:
    return Line(float(d.get("c0_s", 0.0)), float(d.get(a, 0.0)), float(d.get(b, 0.0)) if b else 0.0,
                float(d.get(c, 0.0)) if c else 0.0)


def bus_per_win(dispatch: dict) -> float:
    """The bus thread's CPU per won call on the engine connection's path, from calibrate's
    dispatch runs (bundles on, not through the bus thread: there every call is one win and the loop
    thread does nothing for the step itself): the median over the row counts."""
    if "bus_per_win_s" in dispatch:
        return float(dispatch["bus_per_win_s"])
    per = [r["bus_thread_cpu_s"] / r["calls"] for r in dispatch.get("runs", ())
           if r.get("bundles") and not r.get("via_bus") and r.get("calls") and "bus_thread_cpu_s" in r]
    return float(sorted(per)[len(per) // 2]) if per else 0.0


def reply_per_call(dispatch: dict) -> float:
    """The engine thread's CPU per call that taking a bundle's reply costs, from calibrate's
    dispatch runs: the same bundled steps on the engine thread's own connection (it sends and
    takes the replies) and through the bus thread (which takes them), each row count's difference
    of the engine thread's CPU per call; the median, within ``[0, backbone_per_call]``."""
    if "reply_per_call_s" in dispatch:
        return float(dispatch["reply_per_call_s"])
    runs = [r for r in dispatch.get("runs", ()) if r.get("bundles") and r.get("calls") and "engine_dispatch_cpu_s" in r]
    direct = {r["rows"]: r for r in runs if not r.get("via_bus")}
    diffs = sorted(direct[r["rows"]]["engine_dispatch_cpu_s"] / direct[r["rows"]]["calls"]
                   - r["engine_dispatch_cpu_s"] / r["calls"] for r in runs if r.get("via_bus") and r["rows"] in direct)
    if not diffs:
        return 0.0
    return min(float(dispatch.get("backbone_per_call_s", 0.0)), max(0.0, diffs[len(diffs) // 2]))


def same_model(profile: dict, shapes: Shapes) -> bool:
    m = profile["model"]
    if shapes.fingerprint and m.get("fingerprint"):
        return shapes.fingerprint == m["fingerprint"]
    return shapes.name == m.get("name")


def routing_of(profile: dict, shapes: Shapes) -> list | None:
    """Per layer of ``shapes``, each expert's share of the rows in the profile's routing
    measurement (``kvasir calibrate``'s :func:`planner.calibrate.measure_routing`), or None (a
    layer without routed experts) -- None in all where the profile has none or is another
    model's (a router's skew is its own weights'). A share is (rows + 1/2) / (all + E/2): an
    expert the measurement never saw picked stays possible, as it is for the real router."""
    r = profile.get("routing")
    if not r or not same_model(profile, shapes):
        return None
    counts = r.get("counts") or []
    if len(counts) != shapes.n_layer:
        return None
    out = []
    for c in counts:
        if not c:
            out.append(None)
            continue
        if len(c) != shapes.n_expert:
            return None
        if not all(isinstance(v, (int, float)) and v >= 0 for v in c):
            raise UsageError("--profile: its routing counts must be rows, numbers >= 0 (remake it with kvasir calibrate)")
        total = float(sum(c)) + shapes.n_expert / 2
        out.append([(v + 0.5) / total for v in c])
    return out


def audit_path(profile: dict, worker_kernel: str) -> tuple[str, int]:
    """How this profile's backbone audits a reply of a worker that announces ``worker_kernel``
    (:func:`backbone.audit.rerun_backend`, on the profile's CPU and kernel mode): "exact" (bits
    compared with the reference computed ahead; with the rows per rerun when a fast backbone reruns
    a deterministic worker in chunks), "numpy" or "explained"."""
    from backbone.audit import numpy_family, rerun_backend, rerun_rows

    m = profile["machine"]
    own = profile["backbone"].get("backend", "ggml")
    machine, mode = m.get("machine"), m.get("kernel_mode")
    mode = "deterministic" if mode == "deterministic" else "fast"
    _, exact = rerun_backend(worker_kernel, own, machine=machine, mode=mode)
    if exact:
        return "exact", rerun_rows(worker_kernel, own, machine=machine, mode=mode)
    return ("numpy" if numpy_family(worker_kernel) else "explained"), 0


def costs_for(profile: dict, shapes: Shapes, *, rescale: bool = False, worker: dict | None = None,
              backbone_cores: int | None = None, where: str = "--profile", worker_kernel: str | None = None) -> Costs:
    """The cost functions for ``shapes`` from ``profile`` (its backbone part) and ``worker`` (a
    worker profile's kernel, default the profile's own). ``worker_kernel``: the kernel label the
    workers announce (default the worker profile's), which decides how audits recompute."""
    measured = Shapes.from_dict(profile["model"])
    notes = []
    if not same_model(profile, shapes):
        if not rescale:
            raise UsageError(f"{where}: calibrated for {measured.name} ({measured.fingerprint or 'no fingerprint'}), "
                             f"not {shapes.name} ({shapes.fingerprint or 'published shape'}); calibrate on this "
                             "model, or pass --rescale to scale the profile by the weights' bytes")
        notes.append(f"profile of {measured.name} rescaled to {shapes.name} by weight bytes")
    if "backbone" not in profile:
        raise UsageError(f"{where}: a worker-only profile (kvasir calibrate --role worker) has no backbone costs")
    b = profile["backbone"]
    dense, disp = b["dense"], b["dispatch"]

    def ratio(new: int, old: int) -> float:
        return new / old if old else 1.0

    k_attn = ratio(shapes.dense_bytes_attention, measured.dense_bytes_attention)
    kv_new, kv_old = shapes.n_head_kv * shapes.head_dim, measured.n_head_kv * measured.head_dim
    k_ctx = ratio(kv_new, kv_old) * ratio(shapes.n_head, measured.n_head)
    attention = _line(dense["attention"], "c_row_s", "c_row_ctx_s", "c_seq_s") if "attention" in dense else Line()
    if "recurrent" in dense:
        recurrent = _line(dense["recurrent"], "c_row_s", "c_row_ctx_s", "c_seq_s")
        k_rec = ratio(shapes.dense_bytes_recurrent, measured.dense_bytes_recurrent)
    else:  # never measured: a delta-net layer costs like an attention layer of its bytes, no context term
        recurrent = Line(attention.c0, attention.c1, 0.0, attention.c3)
        k_rec = ratio(shapes.dense_bytes_recurrent, measured.dense_bytes_attention)
        if shapes.n_recurrent_layers:
            notes.append("delta-net layers costed as attention layers of their bytes (none in the profile's model)")
    k_exp = ratio(shapes.expert_bytes, measured.expert_bytes)
    k_head = ratio(shapes.head_bytes, measured.head_bytes)
    k_row = ratio(shapes.n_embd, measured.n_embd)
    threads = int(profile["machine"].get("backbone_threads") or max(1, (profile["machine"].get("cpus") or 2) // 2))
    core_k = 1.0
    if backbone_cores:
        core_k = threads / backbone_cores
        notes.append(f"backbone dense path scaled from {threads} to {backbone_cores} cores (linear: optimistic)")
        threads = backbone_cores
    # A worker's costs as measured in place (kvasir calibrate's dispatch runs) where there are; a
    # device's own kernel timing (--role worker) with its per-message figure otherwise.
    wsrc = (worker or profile)["worker"]
    wk = wsrc.get("in_place") or wsrc["kernel"]
    w_msg = 0.0 if "in_place" in wsrc else float(wsrc.get("per_message_s", profile["worker"].get("per_message_s", 0.0)))
    w_exp = k_exp
    if worker is not None and not same_model(worker, shapes):
        w_exp = ratio(shapes.expert_bytes, Shapes.from_dict(worker["model"]).expert_bytes)
    # A dense line's fixed part is partly the weights streamed (scales with their bytes) and partly
    # overhead (graph launch, Python; does not): the streamed part at the bandwidth the local
    # kernel reached on one expert's slabs (its per-expert cost), the rest kept as it is.
    lk = b["local_kernel"]
    bw = measured.expert_bytes / lk["c_call_s"] if lk.get("c_call_s") else 0.0

    # Its per-row part is the multiply-adds of those weights: at other shapes, the rate the local
    # kernel reached per row and weight byte (a small model's dense rows are mostly overhead, so
    # scaling its own per-row figure by the bytes would overstate a big model's).
    per_row_byte = lk.get("c_row_s", 0.0) / measured.expert_bytes if measured.expert_bytes else 0.0

    def split(line: Line, old_bytes: int, k: float, k2: float | None = None) -> Line:
        if k == 1.0 or not bw:
            return line.scaled(k, k2)
        streamed = min(line.c0, old_bytes / bw)
        c1 = old_bytes * k * per_row_byte if per_row_byte else line.c1 * k
        return Line(line.c0 - streamed + streamed * k, c1, line.c2 * (k if k2 is None else k2), line.c3 * k)

    if "local_call" in b:
        local_call = Line(b["local_call"]["c0_s"], b["local_call"]["c_row_s"]).scaled(k_exp * core_k)
    else:  # a profile made before it was measured: the layer kernel's cost of one expert
        local_call = Line(lk["c0_s"] + lk["c_call_s"], lk["c_row_s"]).scaled(k_exp * core_k)
        notes.append("one expert alone on the backbone costed as the layer kernel's one call (not in the profile)")
    label = worker_kernel or (worker or profile)["worker"].get("kernel_label")
    tiled = wsrc.get("tiled") or {}
    tiled_from, tiled_call, tiled_row = 0, 0.0, 0.0
    if tiled and label == tiled.get("label") and label != wsrc.get("kernel_label"):
        # workers of the other kernel mode than the one timed: a call of 8 rows or more runs tiled
        tiled_from = int(tiled.get("from_rows", 8))
        tiled_call = (float(tiled["c_call_s"]) - float(wsrc["kernel"]["c_call_s"])) * w_exp
        tiled_row = (float(tiled["c_row_s"]) - float(wsrc["kernel"]["c_row_s"])) * w_exp
    if label is None:
        path, chunk = "exact", 0
        notes.append("audits costed as the same kernel's (the profile does not say which kernel its worker ran)")
    else:
        path, chunk = audit_path(profile, label)
    aud = b.get("audit", {})
    audit_miss = 0.0
    if path == "exact":
        # A fast backbone rerunning a deterministic worker's reply in chunks of `chunk` rows: one
        # call per chunk (its per-row cost is the reference's again); otherwise nothing beyond it.
        audit_recompute = Line(local_call.c0, local_call.c1) if chunk else Line()
    elif path in aud:
        audit_recompute = Line(aud[path]["c0_s"], aud[path]["c_row_s"]).scaled(k_exp * core_k)
        audit_miss = float(aud[path].get("miss_s", 0.0)) * k_exp * core_k
    else:
        audit_recompute = Line(local_call.c0 * 10, local_call.c1 * 10)
        notes.append(f"audits by {path} costed at 10x a local call (not measured in this profile)")
    return Costs(
        attention=split(attention, measured.dense_bytes_attention, k_attn, k_ctx).scaled(core_k),
        recurrent=split(recurrent, measured.dense_bytes_recurrent or measured.dense_bytes_attention, k_rec).scaled(core_k),
        shared=_line(dense["shared"], "c_row_s").scaled(k_attn * core_k),
        head=split(_line(dense["head"], "c_row_s"), measured.head_bytes, k_head).scaled(core_k),
        backbone_kernel=Line(b["local_kernel"]["c0_s"], b["local_kernel"]["c_call_s"],
                             b["local_kernel"]["c_row_s"]).scaled(k_exp * core_k),
        worker_kernel=Line(wk["c0_s"], wk["c_call_s"], wk["c_row_s"]).scaled(w_exp),
        backbone_per_message=disp["backbone_per_message_s"], backbone_per_call=disp["backbone_per_call_s"],
        backbone_per_row=disp["backbone_per_row_s"] * k_row,
        worker_per_message=w_msg,
        nats_per_message=profile["nats"]["per_message_s"], hop=disp["hop_s"],
        row_bytes=4 * shapes.n_embd, call_bytes=int(profile["wire"]["call_bytes"]),
        message_bytes=int(profile["wire"]["message_bytes"]), backbone_threads=threads,
        request=float(b.get("serving", {}).get("request_s", 0.0)), token=float(b.get("serving", {}).get("token_s", 0.0)),
        local_call=local_call, bus_path=float(disp.get("bus_path_s", 0.0)), fanout=float(disp.get("fanout_s", 0.0)),
        bus_per_win=bus_per_win(disp), reply_per_call=reply_per_call(disp),
        hedge_per_call=float(disp.get("hedge_per_call_s", 0.0)),
        core_efficiency=float(disp.get("core_efficiency", 1.0)),
        audit_recompute=audit_recompute,
        audit_path=path, audit_miss=audit_miss, tiled_from=tiled_from, tiled_call=tiled_call, tiled_row=tiled_row,
        notes=tuple(notes))
