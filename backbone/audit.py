"""Audits of remote expert replies: the backbone checks strangers with its own replica.

The backbone holds every expert, so it can recompute any reply itself (BOINC's validation idea,
with the backbone as the reference instead of a vote). Which replies are audited:

* every reply of a node still on probation: until ``probation`` of its replies have been audited
  *and passed*, none of its replies is used unchecked. Verdicts for a layer step are taken before
  any of the step's audits is judged, so a node that starts a step on probation has every reply
  of that step audited (audit before use: a prefill step of 49 calls from a new node is 49 audits);
* after that, one reply chosen at random in every window of ``ceil(1 / rate)`` consecutive
  replies of that node *on that layer* — so a node that lies on every reply of a layer is caught
  within ``2 * ceil(1 / rate) - 1`` of its lies there (the rest of the window it started lying in,
  then one whole window), whatever the layer and however long it was honest, and it cannot tell
  which reply is the audited one;
* ``rate = 1`` audits every reply; ``rate = 0`` audits none (probation included): a trusted
  swarm at full speed, with no guarantee.

An audited reply is *replaced* by the backbone's own result, so ``rate = 1`` is exact by
construction. How it is compared depends on the kernel the worker announced (heartbeat and reply
carry a label such as ``ggml-x86_64`` or ``numpy-aarch64``, see :func:`kernel_label`):

* a kernel the backbone runs on the same CPU architecture (ggml or numpy): the backbone recomputes
  the reply *with that kernel* and demands identical bits (a fast-mode backbone that repacks
  its experts, ``-repack``, recomputes a node without repacking, ``-det`` included, in the plain
  layout; a deterministic-mode worker is recomputed by a fast-mode backbone 7 rows at a time,
  which gives the deterministic mode's bits, a ``-det-repack`` one where the backbone repacks;
  a deterministic backbone cannot recompute the fast mode's tiled kernel, so a fast worker is a
  foreign kernel to it);
* the numpy kernel on another CPU (``numpy-aarch64`` against an x86 backbone) and the browser's
  (``js-wasm32``, ``js-scalar``): they compute the numpy kernel's function, whose only float
  rounding left to the CPU is that of float64 sums rounded to float32 once (the activations are
  ggml's float32 operations, bit for bit everywhere), so the backbone recomputes with numpy and
  accepts a relative L2 error up to :data:`NUMPY_TOLERANCE`: a liar at honest x (1 + 1e-3) is
  caught on its first audited reply (``tests/trust/test_kernel_labels.py``);
* any other (ggml on ARM against an x86 backbone, a GPU kernel): the backbone recomputes with
  numpy, takes out of the difference every quant-step flip of the down projection's input that
  float summation order could cause (an activation within its error bound of a rounding
  boundary: ``kernels/flips.py``), and accepts what is left up to :data:`EXPLAINED_TOLERANCE`.
  A plain relative L2 bound would have to be loose (one flip moves a one-row output by up to
  ~3e-3, so such a bound lets a liar at 1e-3 through); with the flips taken out honest kernels
  differ by ~1e-6, and what a liar may choose is only the rounding of values that sit on a
  boundary. (Without a local numpy expert path, a backbone falls back to
  :data:`CROSS_KERNEL_TOLERANCE`.)

A failed audit quarantines the node: its replies are ignored from then on, and the dispatcher
recomputes every reply of that node in the same layer step before the step's outputs are combined
(:meth:`backbone.dispatch.RemoteExperts._finish_step`), so the lies of the step that caught it are
never used. What a liar can get used, per layer, before it is caught (docs/trust.md):

* from its first reply: none (probation audits and replaces every reply until it has passed);
* after an honest stretch: at most ``2 * ceil(1 / rate) - 2`` of its lying replies on a layer
  (:attr:`AuditConfig.max_replies_used`), whatever the step: the catching step's are recomputed,
  and a step with ``2 * ceil(1 / rate) - 1`` or more of its replies on one layer always holds an
  audited one. A reply is one call of one expert (all its rows: a prefill call of 40 rows is one
  reply), one chunk of a call split over messages, or one call's answer inside a bundle.

Per-node state is bounded (:data:`MAX_NODES` records, least recently heard evicted; an evicted node
starts a fresh probation, which costs it audits, never trust). The quarantine set is bounded too
(:data:`MAX_QUARANTINED`, oldest first out); a liar that falls out of it meets a fresh probation.

Pure logic: no I/O, no clock; the caller computes the reference and publishes the verdicts.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QT

from kernels.backend import kernel_label

#: Largest relative L2 error ``|reply - reference| / |reference|`` accepted, per weight type of
#: the expert, where no flips are taken out (the replica check between two racing replies, and a
#: backbone without a local numpy path). Set from bench/kernel_gap.py (numpy worker vs ggml:
#: both round activations as ggml does, bit for bit, and sum in other orders; small and 122B
#: expert shapes): worst F32 2.9e-7, F16 8.7e-5, BF16 1.4e-4, quantized 1.9e-3 (one activation on
#: the other side of a Q8 step in a one-row call), so the quantized bound is loose.
CROSS_KERNEL_TOLERANCE: dict[int, float] = {QT.F32: 1e-5, QT.F16: 2e-4, QT.BF16: 2e-3}
#: For every quantized weight type.
QUANTIZED_TOLERANCE = 1e-2
#: For a kernel the backbone cannot rerun, after its flips are taken out (kernels/flips.py):
#: measured numpy vs ggml at most 1.5e-6 on every type (bench/kernel_gap.py: 65x headroom), a
#: liar at 1e-3 still 8.6e-4 or more (a few of its lie's components can pass for flips).
EXPLAINED_TOLERANCE = 1e-4
#: For the numpy kernel on another CPU and the browser's, against this backbone's numpy: measured
#: 0 (identical bits) on every type (bench/kernel_gap.py: the browser kernel under node, the numpy
#: kernel on arm64 under qemu); a float64 sum that rounds to the other float32 on another CPU
#: costs ~1e-7. 1e-5 leaves a liar at 1e-3 100x above the bound.
NUMPY_TOLERANCE = 1e-5
#: The labels of kernels that compute the numpy kernel's function on any CPU.
NUMPY_FAMILY = ("numpy-", "js-")

DEFAULT_RATE = 0.1
DEFAULT_PROBATION = 16
#: Nodes whose audit record (replies seen, passed audits, one window per layer) is kept. A record
#: costs about 120 bytes plus about 150 per layer it answered on: 1,024 nodes on 48 layers ~ 7.5 MB.
MAX_NODES = 1024
#: Quarantined node names kept (a name is at most 64 bytes: ~ 8 MB at the cap).
MAX_QUARANTINED = 65536


@dataclass(frozen=True)
class AuditConfig:
    """``rate``: fraction of remote replies recomputed (0..1); ``probation``: how many first
    replies of a node are all audited; ``seed``: for tests (None: unpredictable)."""

    rate: float = DEFAULT_RATE
    probation: int = DEFAULT_PROBATION
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0 or math.isnan(self.rate):
            raise ValueError(f"audit rate must be between 0 and 1, got {self.rate}")
        if self.probation < 0:
            raise ValueError(f"audit probation must be >= 0, got {self.probation}")

    @property
    def window(self) -> int:
        """Replies per window of a node on a layer, one of which is audited (0: never)."""
        return math.ceil(1.0 / self.rate) if self.rate > 0 else 0

    @property
    def max_replies_to_catch(self) -> int:
        """A node that lies on every reply of a layer is caught within this many of its lying
        replies on that layer: it may start lying just after the window's audited reply, then the
        next window's audit may be its last reply (probation counts as audited)."""
        return 2 * self.window - 1 if self.window else 0

    @property
    def max_replies_used(self) -> int:
        """Lying replies of a node on one layer that can be *used* before it is caught: the
        catching step's replies are all recomputed, so one less than :attr:`max_replies_to_catch`;
        0 for a liar that lies from its first reply (probation)."""
        return max(0, self.max_replies_to_catch - 1)


@dataclass
class _Record:
    seen: int = 0  # replies of this node (verdicts taken)
    passed: int = 0  # audits of this node judged and passed
    last_pass_at: float = 0.0  # when (time.time()) the last one passed (0: never)
    windows: dict = field(default_factory=dict)  # layer -> _Window


@dataclass
class _Window:
    seen: int = 0  # replies of this (node, layer) since the window started
    pick: int = 0  # which of them is audited
    later: list[int] = field(default_factory=list)  # the picks of the next windows, drawn ahead


@dataclass
class AuditStats:
    audits: int = 0
    failures: int = 0
    quarantined: list[str] = field(default_factory=list)  # in the order they were caught

    def to_dict(self) -> dict:
        return {"audits": self.audits, "audit_failures": self.failures, "quarantined": list(self.quarantined)}


def relative_error(reply: np.ndarray, reference: np.ndarray) -> float:
    """``|reply - reference|_2 / |reference|_2`` in float64 (inf when the reply is not finite;
    0 when both are zero)."""
    a = reply.astype(np.float64)
    b = reference.astype(np.float64)
    if not np.isfinite(a).all():
        return math.inf
    diff = float(np.linalg.norm(a - b))
    norm = float(np.linalg.norm(b))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def replies_agree(reply: np.ndarray, reference: np.ndarray, *, same_kernel: bool, weight_type: int,
                  kernel: str = "") -> bool:
    """Whether a worker's reply passes an audit against the backbone's own result (``kernel``:
    the label the worker announced, which sets the bound when bits are not demanded)."""
    if reply.shape != reference.shape:
        return False
    if same_kernel:
        return bool(np.array_equal(reply, reference))
    return relative_error(reply, reference) <= bound(kernel, weight_type)


def tolerance(weight_type: int) -> float:
    """The cross-kernel bound for an expert whose weights are of ``weight_type``."""
    return CROSS_KERNEL_TOLERANCE.get(weight_type, QUANTIZED_TOLERANCE)


def numpy_family(announced: str) -> bool:
    """Whether ``announced`` names a kernel that computes the numpy kernel's function."""
    return announced.startswith(NUMPY_FAMILY)


def bound(announced: str, weight_type: int) -> float:
    """The relative L2 error accepted when bits are not demanded, for a worker that announced
    ``announced`` (recomputed as :func:`rerun_backend` says) and an expert of ``weight_type``."""
    return NUMPY_TOLERANCE if numpy_family(announced) else tolerance(weight_type)


#: Rows per recomputation when a fast-mode backbone audits a deterministic-mode worker: ggml's
#: deterministic mode runs a routed expert in one layout at every row count (``-det``: plain, the
#: one-row kernel vec_dot; ``-det-repack``: repacked, a gemv per row), the fast mode takes the
#: same kernels below 8 rows (kernels.ggml.expert_layout: repacked where it repacks, plain where
#: told), so chunks of 7 rows give the deterministic worker's bits (tests/trust/test_kernel_labels.py
#: checks it on every type).
DET_CHUNK_ROWS = 7


def rerun_backend(announced: str, own_backend: str, *, machine: str | None = None,
                  mode: str | None = None, repack: bool | None = None) -> tuple[str, bool]:
    """How to audit a reply of a worker that announced ``announced``: the backend to recompute it
    with, and whether identical bits are demanded (True when that backend on this CPU
    architecture computes the announced kernel's expert bits: the same label, a plain-expert
    label recomputed in the plain layout by a backbone that repacks (:func:`rerun_plain`), or a
    deterministic one recomputed by a fast-mode backbone in chunks, :func:`rerun_rows`). The
    numpy kernel of another CPU and the browser's are recomputed with numpy (within
    :data:`NUMPY_TOLERANCE`), any other with our own kernel (within :func:`tolerance`).
    ``machine``, ``mode``, ``repack``: this backbone's (None: this process's, as
    :func:`kernel_label` takes them)."""
    for backend in dict.fromkeys((own_backend, "numpy")):
        if announced == kernel_label(backend, machine, mode, repack if backend == "ggml" else None):
            return backend, True
    if rerun_rows(announced, own_backend, machine=machine, mode=mode, repack=repack) \
            or rerun_plain(announced, own_backend, machine=machine, mode=mode, repack=repack):
        return own_backend, True
    if numpy_family(announced):
        return "numpy", False
    return own_backend, False


def rerun_rows(announced: str, own_backend: str, *, machine: str | None = None, mode: str | None = None,
               repack: bool | None = None) -> int:
    """Rows per recomputation of a reply of ``announced`` (0: all rows at once). A fast-mode ggml
    backbone recomputes a deterministic-mode worker's reply :data:`DET_CHUNK_ROWS` rows at a
    time: a ``-det`` one's (in the plain layout, :func:`rerun_plain`) always, a ``-det-repack``
    one's where it repacks its own experts."""
    if own_backend != "ggml":
        return 0
    own = kernel_label("ggml", machine, mode, repack)
    det = kernel_label("ggml", machine, "deterministic", repack=False)  # plain experts: vec_dot at every row count
    if own in (det, det + "-repack"):  # a deterministic backbone: the fast mode's tiled kernel is foreign
        return 0
    # repacked at every row count (-det-repack, a fast node's -xall): the fast rule's repacked kernel below 8 rows
    if announced == det or (own.endswith("-repack") and announced in (det + "-repack", own + "-xall")):
        return DET_CHUNK_ROWS
    return 0


def rerun_plain(announced: str, own_backend: str, *, machine: str | None = None, mode: str | None = None,
                repack: bool | None = None) -> bool:
    """Whether a reply of ``announced`` is recomputed in the plain layout at every row count
    (``LocalExperts.compute(plain=True)``): by a fast-mode backbone that repacks its experts
    (``-repack``: repacked below 8 rows, kernels.ggml.expert_layout), for a node whose experts
    are plain (the fast mode without repacking, KVASIR_REPACK=0, or with its experts kept plain,
    ``-xplain``; or ``-det``)."""
    if own_backend != "ggml":
        return False
    own = kernel_label("ggml", machine, mode, repack)
    if not own.endswith("-repack") or own.endswith("-det-repack"):
        return False
    return announced in (own[:-len("-repack")], own + "-xplain", kernel_label("ggml", machine, "deterministic", repack=False))


class Auditor:
    """Decides which replies to audit, judges them, and keeps the quarantine list.

    Thread-compatible, not thread-safe: the dispatcher calls it from its one event loop.
    """

    def __init__(self, cfg: AuditConfig = AuditConfig()) -> None:
        self.cfg = cfg
        self._window = cfg.window  # read twice per reply; the config's property computes it
        self._rng = random.Random(cfg.seed) if cfg.seed is not None else random.SystemRandom()
        self._nodes: OrderedDict[str, _Record] = OrderedDict()  # least recently heard first
        self._quarantined: OrderedDict[str, None] = OrderedDict()  # oldest first
        self.stats = AuditStats()
        self.max_nodes = MAX_NODES
        self.max_quarantined = MAX_QUARANTINED

    def _record(self, node: str) -> _Record:
        record = self._nodes.get(node)
        if record is None:
            record = self._nodes[node] = _Record()
            while len(self._nodes) > self.max_nodes:
                self._nodes.popitem(last=False)
        else:
            self._nodes.move_to_end(node)
        return record

    def on_probation(self, node: str) -> bool:
        """Whether ``node`` has yet to pass ``probation`` audits (every reply of it is audited)."""
        record = self._nodes.get(node)
        return (record.passed if record is not None else 0) < self.cfg.probation

    def last_pass_at(self, node: str) -> float:
        """When the last audit of ``node`` passed (``time.time()``; 0.0: none on record)."""
        record = self._nodes.get(node)
        return record.last_pass_at if record is not None else 0.0

    def quarantine(self, node: str, *, caught_here: bool = True) -> bool:
        """Distrust ``node`` from now on: a failed audit here (``caught_here``: listed in
        :attr:`stats`), or another backbone's quarantine heard on the bus or loaded from the
        market. Returns whether it was new."""
        if node in self._quarantined:
            return False
        self._quarantined[node] = None
        while len(self._quarantined) > self.max_quarantined:
            self._quarantined.popitem(last=False)
        if caught_here:
            self.stats.quarantined.append(node)
            del self.stats.quarantined[:-self.max_quarantined]
        return True

    def is_quarantined(self, node: str) -> bool:
        return node in self._quarantined

    @property
    def quarantined(self) -> frozenset[str]:
        return frozenset(self._quarantined)

    def honest(self, nodes: tuple[str, ...]) -> tuple[str, ...]:
        """``nodes`` less the quarantined ones, in order (``nodes`` itself while none is)."""
        if not self._quarantined:
            return nodes
        return tuple(node for node in nodes if node not in self._quarantined)

    def would_audit(self, node: str, layer: int, ahead: int = 0) -> bool:
        """What :meth:`should_audit` of ``node`` on ``layer`` will answer after ``ahead`` more
        verdicts on it (0: the next one), counting no reply. A window it reaches is drawn now
        instead of then: the same draw. The dispatcher recomputes such a call while its reply is
        still on the way, for a step's calls of one node in the order their verdicts are taken;
        the verdict is still :meth:`should_audit`'s, taken when the reply is used."""
        if self.cfg.rate <= 0.0:
            return False
        if self.cfg.rate >= 1.0 or self.on_probation(node):
            return True
        window = self._window_of(self._record(node), layer)
        windows_on, at = divmod(window.seen + ahead, self._window)
        if not windows_on:
            return at == window.pick
        while len(window.later) < windows_on:
            window.later.append(self._rng.randrange(self._window))
        return at == window.later[windows_on - 1]

    def should_audit(self, node: str, layer: int) -> bool:
        """Called once per remote reply that would be used; True: recompute it locally."""
        if self.cfg.rate <= 0.0:
            return False
        record = self._record(node)
        record.seen += 1
        window = self._window_of(record, layer)
        if window.seen == self._window:
            window.seen = 0
            window.pick = window.later.pop(0) if window.later else self._rng.randrange(self._window)
        audit = window.seen == window.pick or record.passed < self.cfg.probation or self.cfg.rate >= 1.0
        window.seen += 1
        return audit

    def _window_of(self, record: _Record, layer: int) -> _Window:
        window = record.windows.get(layer)
        if window is None:
            window = record.windows[layer] = _Window(pick=self._rng.randrange(self._window))
        return window

    def judge(self, node: str, reply: np.ndarray, reference: np.ndarray | None, *, exact: bool,
              weight_type: int, kernel: str = "", gap: float | None = None) -> bool:
        """Compare an audited reply with the backbone's result (``exact``: as
        :func:`rerun_backend` said for the announced ``kernel``), or judge ``gap``, a foreign
        kernel's difference with its flips taken out (``kernels.flips.explained_gap``, against
        :data:`EXPLAINED_TOLERANCE`); a failure quarantines ``node``. Returns whether it passed."""
        self.stats.audits += 1
        if gap is not None:
            ok = gap <= EXPLAINED_TOLERANCE
        else:
            ok = replies_agree(reply, reference, same_kernel=exact, weight_type=weight_type, kernel=kernel)
        if ok:
            if node not in self._quarantined:
                record = self._record(node)
                record.passed += 1
                record.last_pass_at = time.time()
        else:
            self.stats.failures += 1
            self.quarantine(node)
        return ok
