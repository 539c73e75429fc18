"""ggml's CPU kernels through ctypes: llama.cpp's own quantized matmuls on the GGUF bytes.

The shared libraries come from the installed ``llama_cpp`` package (``llama_cpp/lib/``); the
package itself is never imported, so loading them costs no model machinery. Weights stay
zero-copy: a small metadata-only ggml context (``no_alloc``) points each weight tensor's
``data`` at the GGUF memmap slice and the activations at numpy buffers; a graph is planned and
run with ``ggml_graph_compute`` and a per-thread work buffer. Built graphs are kept in a small
per-thread LRU keyed by a few ints (the weights' types and shapes, rows, threads), so a
repeated call only rebinds its data addresses: the weights' (ints made once per tensor), and
each array's, read from numpy's struct (:func:`address`). An expert's three tensors are
checked once (a plan per gate tensor), its rows on every call. Threads share no ggml state: any number of Python threads may call at once
(ctypes releases the GIL; with ggml's OpenMP build each calling thread gets its own team of
``n_threads``, so concurrent callers should lower KVASIR_THREADS to avoid oversubscription).

This is the project's one ggml binding: the libraries (:class:`Lib`), the structs, the graph
type (:class:`Graph`), the per-thread graph cache and work buffer (:func:`run_cached`) and the
thread policy (:func:`threads_for`). ``kernels/dense.py`` builds its graphs (attention, RoPE,
norms, softmax) with these public names; this module holds the quantized products.

``GGML_ASSERT`` calls ``abort()``: it kills the process with no Python exception. Every public
function therefore checks shapes, types and byte counts in Python first and raises
``ValueError``, and sizes each context from the number of tensors it will hold.

Which CPU path ggml takes (it decides the rounding, see ``kernels/actquant.py``):
``ggml_mul_mat`` uses llamafile's tinyBLAS for F32/F16/Q8_0/Q4_0/... weights when there are at
least 2 rows, the "tiled" kernel for K-quants and most IQ types at 8 rows or more, and
``vec_dot`` otherwise. ``ggml_mul_mat_id`` (llama.cpp's routed experts) never uses tinyBLAS:
``vec_dot`` per row, or the tiled kernel when at least 8 rows go to the expert.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import mmap
import os
import sys
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.checks import ACT_FORMAT, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, check_ffn, check_rows, check_weight
from kernels.tensors import QTensor
from kvasir_bus.threads import kernel_mode, set_kernel_mode

T = GGMLQuantizationType

ENV_LIB_DIR = "KVASIR_GGML_LIB_DIR"  # overrides the llama_cpp/lib lookup
ENV_THREADS = "KVASIR_THREADS"

# Weight types ggml's CPU backend multiplies (those with a vec_dot).
SUPPORTED_TYPES = frozenset(ACT_FORMAT)


class GgmlUnavailable(RuntimeError):
    """ggml's shared libraries could not be found or loaded."""


# --- struct layouts ---------------------------------------------------------------------------
# Checked with offsetof() against the headers llama-cpp-python 0.3.36 installs
# (site-packages/include/ggml.h, ggml-cpu.h; ggml 0.25.3), x86-64:
#   ggml_init_params: sizeof 24; mem_size 0, mem_buffer 8, no_alloc 16
#   ggml_tensor: sizeof 336; type 0, buffer 8, ne 16, nb 48, op 80, op_params 84, flags 148,
#                src 152, view_src 232, view_offs 240, data 248, name 256, extra 320, padding 328
#   ggml_cplan: sizeof 56; work_size 0, work_data 8, n_threads 16, threadpool 24,
#               abort_callback 32, abort_callback_data 40, use_ref 48
#   ggml_type_traits_cpu: sizeof 32; from_float 0, vec_dot 8, vec_dot_type 16, nrows 24
# _load() re-checks the sizes and reads ne/nb/data back from a real tensor.

class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Tensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class CPlan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


_FromFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class TypeTraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


_LAYOUT = {
    InitParams: (24, {"mem_size": 0, "mem_buffer": 8, "no_alloc": 16}),
    Tensor: (336, {"type": 0, "buffer": 8, "ne": 16, "nb": 48, "op": 80, "op_params": 84, "flags": 148,
                    "src": 152, "view_src": 232, "view_offs": 240, "data": 248, "name": 256, "extra": 320}),
    CPlan: (56, {"work_size": 0, "work_data": 8, "n_threads": 16, "threadpool": 24, "abort_callback": 32,
                  "abort_callback_data": 40, "use_ref": 48}),
    TypeTraitsCpu: (32, {"from_float": 0, "vec_dot": 8, "vec_dot_type": 16, "nrows": 24}),
}

_PT = ctypes.POINTER(Tensor)
GRAPH_NODES = 32  # nodes per graph; the largest (attention) has 13


def lib_dir() -> Path:
    """Folder holding libggml-base.so and libggml-cpu.so (env KVASIR_GGML_LIB_DIR, else
    ``llama_cpp/lib`` of the installed llama-cpp-python, located without importing it)."""
    override = os.environ.get(ENV_LIB_DIR)
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise GgmlUnavailable("llama_cpp is not installed (pip install 'kvasir-bus[backbone]')")
    return Path(spec.origin).parent / "lib"


class Lib:
    """The loaded libraries with their ctypes signatures."""

    def __init__(self, folder: Path):
        mode = getattr(os, "RTLD_GLOBAL", ctypes.RTLD_GLOBAL)
        libs = []
        for name in ("libggml-base.so", "libggml-cpu.so"):
            path = folder / name
            if not path.exists():
                raise GgmlUnavailable(f"{path}: not found")
            try:
                libs.append(ctypes.CDLL(str(path), mode=mode))
            except OSError as exc:
                raise GgmlUnavailable(f"{path}: cannot load: {exc}") from None
        self.folder = folder
        base, cpu = libs

        def fn(lib, name, restype, *argtypes):
            try:
                f = getattr(lib, name)
            except AttributeError:
                raise GgmlUnavailable(f"{folder}: ggml has no {name} (llama-cpp-python too old?)") from None
            f.restype = restype
            f.argtypes = list(argtypes)
            setattr(self, name, f)

        c_ctx, i64, sz, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int, ctypes.c_float
        fn(base, "ggml_version", ctypes.c_char_p)
        fn(base, "ggml_commit", ctypes.c_char_p)
        fn(base, "ggml_init", c_ctx, InitParams)
        fn(base, "ggml_free", None, c_ctx)
        fn(base, "ggml_tensor_overhead", sz)
        fn(base, "ggml_graph_n_nodes", ctypes.c_int, ctypes.c_void_p)
        fn(base, "ggml_graph_node", _PT, ctypes.c_void_p, ctypes.c_int)
        fn(base, "ggml_graph_overhead_custom", sz, sz, ctypes.c_bool)
        fn(base, "ggml_blck_size", i64, ctypes.c_int)
        fn(base, "ggml_type_size", sz, ctypes.c_int)
        fn(base, "ggml_row_size", sz, ctypes.c_int, i64)
        fn(base, "ggml_new_tensor_1d", _PT, c_ctx, ctypes.c_int, i64)
        fn(base, "ggml_new_tensor_2d", _PT, c_ctx, ctypes.c_int, i64, i64)
        fn(base, "ggml_new_tensor_3d", _PT, c_ctx, ctypes.c_int, i64, i64, i64)
        fn(base, "ggml_mul_mat", _PT, c_ctx, _PT, _PT)
        fn(base, "ggml_mul_mat_id", _PT, c_ctx, _PT, _PT, _PT)
        fn(base, "ggml_swiglu_split", _PT, c_ctx, _PT, _PT)
        # gpt-oss: expert biases, its clamped activation, attention sinks
        fn(base, "ggml_add_id", _PT, c_ctx, _PT, _PT, _PT)
        fn(base, "ggml_swiglu_oai", _PT, c_ctx, _PT, _PT, f32, f32)
        fn(base, "ggml_soft_max_add_sinks", None, _PT, _PT)
        # flash attention (the fast mode's, as llama-server's default: kernels.dense.flash_attn)
        fn(base, "ggml_flash_attn_ext", _PT, c_ctx, _PT, _PT, _PT, _PT, f32, f32, f32)
        fn(base, "ggml_flash_attn_ext_add_sinks", None, _PT, _PT)
        fn(base, "ggml_view_4d", _PT, c_ctx, _PT, i64, i64, i64, i64, sz, sz, sz, sz)
        fn(base, "ggml_permute", _PT, c_ctx, _PT, i32, i32, i32, i32)
        fn(base, "ggml_prec_set_acc", ctypes.c_bool, _PT, i32)
        fn(base, "ggml_soft_max_ext", _PT, c_ctx, _PT, _PT, f32, f32)
        fn(base, "ggml_soft_max", _PT, c_ctx, _PT)
        fn(base, "ggml_cont_2d", _PT, c_ctx, _PT, i64, i64)
        fn(base, "ggml_rope_ext", _PT, c_ctx, _PT, _PT, _PT, i32, i32, i32, f32, f32, f32, f32, f32, f32)
        fn(base, "ggml_rms_norm", _PT, c_ctx, _PT, f32)
        fn(base, "ggml_mul", _PT, c_ctx, _PT, _PT)
        fn(base, "ggml_silu", _PT, c_ctx, _PT)
        fn(base, "ggml_div", _PT, c_ctx, _PT, _PT)
        # gated delta-net (qwen35moe), multi-section RoPE, and the element-wise ops around them
        fn(base, "ggml_ssm_conv", _PT, c_ctx, _PT, _PT)
        fn(base, "ggml_gated_delta_net", _PT, c_ctx, _PT, _PT, _PT, _PT, _PT, _PT, i64)
        fn(base, "ggml_rope_multi", _PT, c_ctx, _PT, _PT, _PT, i32, ctypes.POINTER(ctypes.c_int), i32, i32, f32, f32,
           f32, f32, f32, f32)
        fn(base, "ggml_sigmoid", _PT, c_ctx, _PT)
        fn(base, "ggml_softplus", _PT, c_ctx, _PT)
        fn(base, "ggml_scale", _PT, c_ctx, _PT, f32)
        fn(base, "ggml_add", _PT, c_ctx, _PT, _PT)
        fn(base, "ggml_reshape_3d", _PT, c_ctx, _PT, i64, i64, i64)
        fn(base, "ggml_reshape_4d", _PT, c_ctx, _PT, i64, i64, i64, i64)
        fn(base, "ggml_repeat_4d", _PT, c_ctx, _PT, i64, i64, i64, i64)
        fn(base, "ggml_nbytes", sz, _PT)
        fn(base, "ggml_get_rows", _PT, c_ctx, _PT, _PT)
        fn(base, "ggml_set_rows", _PT, c_ctx, _PT, _PT, _PT)  # grouped attention: new K/V cells
        fn(base, "ggml_concat", _PT, c_ctx, _PT, _PT, i32)
        fn(base, "ggml_cpy", _PT, c_ctx, _PT, _PT)
        fn(base, "ggml_view_2d", _PT, c_ctx, _PT, i64, i64, sz, sz)
        fn(base, "ggml_view_3d", _PT, c_ctx, _PT, i64, i64, i64, sz, sz, sz)
        # the router's top-k in the graph, as llama.cpp's build_moe_ffn (kernels/fused.py)
        fn(base, "ggml_argsort", _PT, c_ctx, _PT, i32)
        fn(base, "ggml_sum_rows", _PT, c_ctx, _PT)
        fn(base, "ggml_clamp", _PT, c_ctx, _PT, f32, f32)
        fn(base, "ggml_reshape_2d", _PT, c_ctx, _PT, i64, i64)
        fn(base, "ggml_cont", _PT, c_ctx, _PT)
        fn(base, "ggml_new_graph_custom", ctypes.c_void_p, c_ctx, sz, ctypes.c_bool)
        fn(base, "ggml_build_forward_expand", None, ctypes.c_void_p, _PT)
        fn(base, "ggml_quantize_requires_imatrix", ctypes.c_bool, ctypes.c_int)
        fn(base, "ggml_quantize_chunk", sz, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, i64, i64, i64,
           ctypes.c_void_p)
        fn(cpu, "ggml_cpu_init", None)
        # weight repacking (llama.cpp's default on CPU): the repack buffer type is C++ (mangled)
        fn(base, "ggml_backend_alloc_ctx_tensors_from_buft", ctypes.c_void_p, c_ctx, ctypes.c_void_p)
        fn(base, "ggml_backend_tensor_set", None, _PT, ctypes.c_void_p, sz, sz)
        fn(base, "ggml_backend_buffer_free", None, ctypes.c_void_p)
        fn(base, "ggml_log_get", None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))
        fn(base, "ggml_log_set", None, ctypes.c_void_p, ctypes.c_void_p)
        try:
            fn(cpu, "_Z35ggml_backend_cpu_repack_buffer_typev", ctypes.c_void_p)
            self.repack_buft = self._Z35ggml_backend_cpu_repack_buffer_typev()
        except GgmlUnavailable:
            self.repack_buft = None
        fn(cpu, "ggml_get_type_traits_cpu", ctypes.POINTER(TypeTraitsCpu), ctypes.c_int)
        fn(cpu, "ggml_graph_plan", CPlan, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        fn(cpu, "ggml_graph_compute", ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(CPlan))

        self.ggml_cpu_init()
        self.version = self.ggml_version().decode()
        self.commit = self.ggml_commit().decode()
        self.tensor_overhead = self.ggml_tensor_overhead()
        self.graph_overhead = self.ggml_graph_overhead_custom(GRAPH_NODES, False)
        self._self_check()

    def _self_check(self) -> None:
        for struct, (size, offsets) in _LAYOUT.items():
            if ctypes.sizeof(struct) != size or any(getattr(struct, f).offset != o for f, o in offsets.items()):
                raise GgmlUnavailable(f"ctypes layout of {struct.__name__} does not match ggml's headers")
        graph = Graph(self, n_tensors=1)
        try:
            t = graph.input(T.Q8_0, (64, 3, 2))
            ok = (list(t.contents.ne) == [64, 3, 2, 1] and t.contents.nb[0] == 34 and t.contents.nb[1] == 68
                  and t.contents.nb[2] == 204 and t.contents.data is None and t.contents.type == int(T.Q8_0))
        finally:
            graph.free()
        if not ok:
            raise GgmlUnavailable(f"ggml {self.version} ({self.folder}): tensor struct read-back failed; "
                                  "the ctypes layout does not match this build")


_lib: Lib | None = None
_lib_error: GgmlUnavailable | None = None
_lib_lock = threading.Lock()


def load() -> Lib:
    """The loaded libraries; raises GgmlUnavailable (every time) if they cannot be loaded."""
    global _lib, _lib_error
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is None and _lib_error is None:
            try:
                mode = kernel_mode()
                # the switches read once, like the mode (a bad value raises ValueError before
                # anything loads: no half-set library is left behind)
                flash = mode == "fast" and flash_attn_setting()
                layout = expert_layout_setting()
                set_kernel_mode(mode)  # ggml reads GGML_CPU_TILED_MM once, as it loads
                lib = Lib(lib_dir())
                lib.mode = mode
                # repacked() is asked for every dense weight of every call
                allowed = lib.repack_buft is not None and os.environ.get(ENV_REPACK, "1") != "0"
                lib.repack = mode == "fast" and allowed
                lib.flash_attn = flash
                # the routed experts: a repacked copy in both modes where allowed, used by the
                # calls of fewer rows than repack_below (expert_layout: every call in the
                # deterministic mode, those under FAST_REPACK_BELOW rows in the fast mode)
                lib.expert_layout = layout
                lib.repack_experts = allowed and layout != "plain"
                lib.repack_below = _repack_below(mode, allowed, layout)
                _lib = lib
            except GgmlUnavailable as exc:
                _lib_error = exc
    if _lib is None:
        raise _lib_error
    return _lib


def loaded_mode() -> str | None:
    """The kernel mode ggml loaded with in this process, or None if it has not loaded yet."""
    return None if _lib is None else _lib.mode


def deterministic() -> bool:
    """Whether this process's ggml runs batch-invariant (kernel mode ``deterministic``, fixed
    when the libraries load: see ``kvasir_bus/threads.py``)."""
    return load().mode == "deterministic"


def available() -> bool:
    try:
        load()
    except GgmlUnavailable:
        return False
    return True


def info() -> dict:
    lib = load()
    return {"version": lib.version, "commit": lib.commit, "lib_dir": str(lib.folder), "threads": n_threads(),
            "mode": lib.mode}


SMALL_WORK = 1 << 21  # multiply-adds below which one thread beats waking a team (measured on 2 cores)


@functools.lru_cache(maxsize=None)
def _cpu_count() -> int:
    """os.cpu_count(), asked once: glibc answers it by reading /sys (~15 µs), and the thread
    policy is consulted on every graph call."""
    return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def _n_threads(value: str | None) -> int:
    if not value:
        return _cpu_count()
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{ENV_THREADS}={value!r}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"{ENV_THREADS}={value!r}: expected a positive integer")
    return n


def n_threads() -> int:
    """Threads per ggml call: env KVASIR_THREADS, else os.cpu_count(); at most the cap inside
    :func:`thread_cap` (one inside :func:`one_thread`)."""
    return _capped(_n_threads(os.environ.get(ENV_THREADS)))


def _capped(n: int) -> int:
    """``n`` threads, or this thread's :func:`thread_cap` where that is fewer."""
    cap = getattr(_tls, "cap", None)
    return n if cap is None else min(n, cap)


@contextlib.contextmanager
def thread_cap(n: int):
    """On this thread, every ggml call inside runs on at most ``n`` threads (nested caps: the
    least). A process's threads that each lead an OpenMP team keep their teams' threads within
    the CPUs this way (see :func:`one_thread`): ``L`` lanes of ``cores // L`` each add up to
    at most the cores, counting the process's first thread."""
    if n < 1:
        raise ValueError(f"a thread cap must be >= 1, got {n}")
    before = getattr(_tls, "cap", None)
    _tls.cap = n if before is None else min(before, n)
    try:
        yield
    finally:
        _tls.cap = before


def one_thread():
    """On this thread, every ggml call inside runs on it alone (no OpenMP team).

    libgomp keeps each thread's team for the thread's life and counts every team's threads;
    once they outnumber the CPUs, every barrier of every team spins a hundred times and then
    sleeps (its "throttled" spin). A process whose graphs run on two threads of its own with a
    team each (a worker's event loop computing a small bundle inline, its pool the big calls)
    is past that on any machine, for the rest of its life. Measured on 2 cores: a 16-stream
    decode step of the small model (about 340 barriers) led by a second thread took 14-16 ms
    alone and 20-28 ms once the main thread had run one 2-thread graph (four runs each); an
    expert call's graph has a few barriers, and there the difference was lost in the noise.
    A caller whose calls are small enough to run inline computes them here instead, so only
    one thread of the process ever leads a team."""
    return thread_cap(1)


def decode_threads() -> int:
    """Threads for a one-token (decode) graph: env KVASIR_THREADS, else half the cores, as
    llama.cpp's default ``n_threads`` (its batches get every core, like :func:`n_threads`).
    A decode graph is short: an OpenMP team on every core then spends its time at barriers,
    and on a machine shared with workers or other processes one descheduled thread stalls the
    team (measured on 2 loaded cores: 2-thread decode at 1.5 tok/s, 1-thread at ~35)."""
    value = os.environ.get(ENV_THREADS)
    return _capped(_n_threads(value) if value else max(1, _cpu_count() // 2))


def threads_for(work: int, tokens: int = 0) -> int:
    """Threads for a call of ``work`` multiply-adds on ``tokens`` token rows (0: unknown): one
    for small products (waking an OpenMP team costs more than it saves; a 1-row expert of the
    small model is 0.4 M), :func:`decode_threads` for one token, else :func:`n_threads`. The
    thread count never changes the result."""
    if work < SMALL_WORK:
        return 1
    return decode_threads() if tokens == 1 else n_threads()


def expert_threads(work: int) -> int:
    """Threads for a routed-expert call of ``work`` multiply-adds (a worker's request, the
    backbone's local layer): one for small products, else :func:`n_threads`, whatever the
    rows. A decode graph (:func:`decode_threads`) has dozens of ops and a barrier after each; an
    expert's has four, each of millions of multiply-adds for a 122B expert, where a second thread
    halves the time (1-row Q8_0 at 3072x1024: 1.27k rows/s on one thread, 2.73k on two). The
    thread count never changes the result."""
    return 1 if work < SMALL_WORK else n_threads()


# --- graphs and computation ---------------------------------------------------------------------

# --- data addresses -----------------------------------------------------------------------------
# A graph call binds every per-call array's data address into its tensor. numpy's own ways to
# read it build objects: ``__array_interface__`` a dict (~2 µs on this machine),
# ``.ctypes.data`` a ``_ctypes`` helper (~1.5-2.5 µs); a decode step binds a few hundred.
# The address is the first field of numpy's public ``PyArrayObject_fields`` struct, right
# after the object header (subclasses such as np.memmap extend the struct after it), so it is
# read from there (~0.3 µs), once the self-check below has confirmed the layout on this build;
# where it fails, every array takes the dict.

_ndarray = np.ndarray
_read_address = ctypes.c_void_p.from_address
_DATA_FIELD = object.__basicsize__  # sizeof(PyObject): where PyArrayObject's ``data`` starts


class _Subclass(np.ndarray):
    """An ndarray subclass for the self-check (np.memmap is one)."""


def _address_other(a) -> int:
    """The address of an ndarray subclass (or of any array where the self-check failed)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected a numpy array or an int address, got {type(a).__name__}")
    if _FAST_ADDRESS:
        return _read_address(id(a) + _DATA_FIELD).value or 0
    return a.__array_interface__["data"][0]


def _layout_holds() -> bool:
    """Whether reading ``data`` at _DATA_FIELD gives numpy's own answer for arrays made in every
    way the kernels see them (owned, sliced, read-only over bytes, reshaped, empty)."""
    base = np.arange(64, dtype=np.float32)
    samples = (base, base[3:17], base.reshape(8, 8)[2:], np.frombuffer(bytes(64), dtype=np.float32, offset=4),
               np.empty((0, 4), dtype=np.float32), np.zeros(3, dtype=np.int32), base[8:].view(_Subclass))
    return all(_read_address(id(a) + _DATA_FIELD).value == a.__array_interface__["data"][0] for a in samples)


_FAST_ADDRESS = _layout_holds()


def address(a) -> int:
    """The data address of numpy array ``a`` (an int is taken as an address already)."""
    if a.__class__ is int:
        return a
    if a.__class__ is _ndarray and _FAST_ADDRESS:
        return _read_address(id(a) + _DATA_FIELD).value or 0
    return _address_other(a)


def _ptr(a: np.ndarray) -> int:
    return address(a)


class Graph:
    """A metadata-only ggml context holding one small graph, reusable for same-shaped calls.

    Three kinds of tensor data, so that one built graph serves every call of the same shapes:

    - inputs (:meth:`input`, and the :meth:`output`): leaves whose data pointers are bound per
      :meth:`run`, in declaration order (weights, activations, caches, the result);
    - views (:meth:`view`: ``ggml_view_*``, ``ggml_permute``): follow their root at its offset;
    - fixed buffers (:meth:`constant`): numpy arrays kept referenced here until the context is
      freed, so ggml never sees a dangling pointer;
    - scratch (:meth:`scratch`, an op's intermediate result): a place in the graph's scratch
      memory, given by :meth:`place` (the graph cache's per-thread arena, which every graph it
      holds shares, as llama.cpp's compute buffer: intermediates live for one run only) or,
      for a graph run outside the cache, memory of its own at its first :meth:`run`.

    A graph is used by one thread at a time (``run`` rewrites its data pointers); the caller
    keeps the arrays it passes alive for the call, the graph never reads them afterwards.
    """

    def __init__(self, lib: Lib, n_tensors: int, nodes: int = GRAPH_NODES):
        self.lib = lib
        # One object header + struct per tensor, the graph, and slack for alignment padding.
        overhead = lib.graph_overhead if nodes == GRAPH_NODES else lib.ggml_graph_overhead_custom(nodes, False)
        size = lib.tensor_overhead * (n_tensors + 2) + overhead + 1024
        self.ctx = lib.ggml_init(InitParams(size, None, True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self.graph = lib.ggml_new_graph_custom(self.ctx, nodes, False)
        self.keep: list[np.ndarray] = []
        self.scratch_bytes = 0
        self.inputs: list[Tensor] = []  # bound per call, in this order
        self.views: list[tuple[Tensor, int, int]] = []  # (view, index of its root input, offset)
        self._index: dict[int, int] = {}  # tensor address -> index in inputs
        self._fixed: set[int] = set()  # addresses of tensors with a buffer of their own
        self._scratch: dict[int, tuple] = {}  # scratch tensor address -> (its struct, offset)
        self.placed = False  # whether the scratch tensors (and views of them) have their memory
        self._bound: list[int] | None = None  # the addresses run() last bound (it rebinds what moved)

    def _new(self, ggml_type: int, ne: tuple[int, ...]):
        lib = self.lib
        new = (lib.ggml_new_tensor_1d, lib.ggml_new_tensor_2d, lib.ggml_new_tensor_3d)[len(ne) - 1]
        t = new(self.ctx, int(ggml_type), *(int(n) for n in ne))
        if not t:
            raise MemoryError("ggml_new_tensor failed")
        return t

    def input(self, ggml_type: int, ne: tuple[int, ...]):
        """A new leaf tensor whose data is bound per call."""
        t = self._new(ggml_type, ne)
        self._index[ctypes.addressof(t.contents)] = len(self.inputs)
        self.inputs.append(t.contents)
        return t

    def constant(self, ggml_type: int, ne: tuple[int, ...], data: np.ndarray):
        """A new leaf pointed at ``data`` (C-contiguous, exactly the tensor's size) for good."""
        t = self._new(ggml_type, ne)
        self._fix(t, data)
        return t

    def buffer(self, ggml_type: int, ne: tuple[int, ...]):
        """A new tensor in the graph's scratch memory that no op computes: what the graph
        copies into its views (``ggml_cpy``) is what later ops read; it must be filled before
        it is read, in node order, as every scratch tensor is rewritten on every run."""
        return self.scratch(self._new(ggml_type, ne))

    def view(self, t):
        """Register ``t`` (a view, permute, ...) so its data follows its root."""
        if not t:
            raise MemoryError("ggml view failed")
        c = t.contents
        root, offs = c.view_src, int(c.view_offs)
        if root in self._scratch:
            pass  # placed with its root (:meth:`place`)
        elif root in self._fixed:
            c.data = ctypes.cast(root, _PT).contents.data + offs
        elif root in self._index:
            self.views.append((c, self._index[root], offs))
        else:
            raise RuntimeError("view of an unknown tensor")
        return t

    def scratch(self, t):
        """Give op result ``t`` a place of its own in the graph's scratch memory (64-byte
        aligned; the memory itself comes with :meth:`place`)."""
        if not t:
            raise MemoryError("ggml op failed")
        n = max(1, int(self.lib.ggml_nbytes(t)))
        c = t.contents
        self._scratch[ctypes.addressof(c)] = (c, self.scratch_bytes)
        self.scratch_bytes += (n + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
        return t

    def place(self, memory: np.ndarray | None = None) -> None:
        """Point every scratch tensor, and every view of one, into ``memory`` (64-byte aligned,
        at least :attr:`scratch_bytes`; kept referenced here), or into memory of the graph's own.
        Intermediates are written before they are read in every run, so graphs that never run at
        the same time may share the memory."""
        if memory is None:
            memory = aligned_empty(self.scratch_bytes)
        if memory.nbytes < self.scratch_bytes or memory.ctypes.data % SCRATCH_ALIGN:
            raise ValueError(f"scratch memory of {memory.nbytes} bytes for a graph of {self.scratch_bytes}")
        self.keep.append(memory)
        base = memory.ctypes.data
        for c, offset in self._scratch.values():
            c.data = base + offset
        # A view's data is its root's plus its offset, read by ggml when the view is made (ggml
        # makes every view of a view a view of the base tensor): now that the roots have theirs.
        lib, graph, scratch = self.lib, self.graph, self._scratch
        for i in range(lib.ggml_graph_n_nodes(graph)):
            c = lib.ggml_graph_node(graph, i).contents
            if c.view_src in scratch:
                c.data = scratch[c.view_src][0].data + c.view_offs
        self._fixed.update(scratch)
        self.placed = True

    def _fix(self, t, data: np.ndarray) -> None:
        self.keep.append(data)
        t.contents.data = _ptr(data)
        self._fixed.add(ctypes.addressof(t.contents))

    def output(self, t):
        """Make op result ``t`` a graph output (an input in the binding order), computed after
        everything declared before it."""
        if not t:
            raise MemoryError("ggml op failed")
        self._index[ctypes.addressof(t.contents)] = len(self.inputs)
        self.inputs.append(t.contents)
        self.lib.ggml_build_forward_expand(self.graph, t)
        return t

    def expand(self, t):
        """Add op ``t`` (e.g. a copy into a cache) to the graph, computed after everything
        expanded before it and before everything expanded after."""
        if not t:
            raise MemoryError("ggml op failed")
        self.lib.ggml_build_forward_expand(self.graph, t)
        return t

    def finish(self, threads: int) -> "Graph":
        """Plan the graph for ``threads`` threads; call after the last :meth:`output`."""
        self.plan = self.lib.ggml_graph_plan(self.graph, threads, None)
        self.plan_ref = ctypes.byref(self.plan)
        self.n_inputs = len(self.inputs)
        # what run() needs, looked up once: a call is a few hundred nanoseconds of binding
        self.work_size = int(self.plan.work_size)
        self._graph_arg = ctypes.c_void_p(self.graph)
        self._compute = self.lib.ggml_graph_compute
        return self

    def run(self, arrays) -> None:
        """Compute with the inputs and outputs pointed at ``arrays`` (in declaration order;
        C-contiguous and of the planned sizes: the callers check). An int is an address
        already (a weight's ``QTensor.ptr``, a repacked buffer), the rest are numpy arrays."""
        if len(arrays) != self.n_inputs:
            raise ValueError(f"graph takes {self.n_inputs} arrays, got {len(arrays)}")
        if not self.placed:  # a graph outside the cache: scratch memory of its own
            self.place()
        if _FAST_ADDRESS:  # address() inlined: this runs for every array of every graph call
            ptrs = [a if a.__class__ is int else
                    _read_address(id(a) + _DATA_FIELD).value if a.__class__ is _ndarray else _address_other(a)
                    for a in arrays]
        else:
            ptrs = [address(a) for a in arrays]
        last = self._bound
        if last is None:
            for c, p in zip(self.inputs, ptrs):
                c.data = p
            for c, i, offs in self.views:
                c.data = ptrs[i] + offs
        else:  # only what moved: a step's weights and most of its buffers are where they were
            for c, p, q in zip(self.inputs, ptrs, last):
                if p != q:
                    c.data = p
            for c, i, offs in self.views:
                if ptrs[i] != last[i]:
                    c.data = ptrs[i] + offs
        self._bound = ptrs
        if self.work_size:
            self.plan.work_data = work_address(self.work_size)
        status = self._compute(self._graph_arg, self.plan_ref)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def free(self) -> None:
        if self.ctx:
            self.lib.ggml_free(self.ctx)
            self.ctx = None
            self.keep.clear()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # interpreter shutdown
            pass


class GraphCache:
    """Per-thread LRU of built graphs, keyed by what fixes their shapes (op, rows, weight types
    and shapes, threads; never the weights' bytes, which are inputs rebound per call).

    Building a context and graph costs ~25 ctypes calls (tens of microseconds, as much as a
    1-row Q4_K expert's compute on a fast CPU); a hit only rebinds the inputs and outputs.
    The graphs share one scratch arena (:meth:`arena`), as llama.cpp's graphs share its compute
    buffer: the memory is that of the largest graph, touched once, not a fresh allocation per
    graph (a 64-token prompt's layer of the 122B shapes holds 37 MB of intermediates: built
    per prompt with fresh memory, as before the arena, its prefill was ~6% slower in paired
    runs). A graph with more
    scratch than :data:`MAX_ARENA_BYTES` gets memory of its own and is not kept.
    """

    MAX_ENTRIES = 64
    MAX_ARENA_BYTES = 512 << 20

    def __init__(self):
        self.entries: OrderedDict[tuple, Graph] = OrderedDict()
        self._arena: np.ndarray | None = None

    @property
    def bytes(self) -> int:
        """The arena's size: what the kept graphs' intermediates take (older, smaller arenas
        live on only in graphs placed before it grew)."""
        return 0 if self._arena is None else self._arena.nbytes

    def arena(self, nbytes: int) -> np.ndarray | None:
        """The shared scratch memory for a graph of ``nbytes`` (grown when too small; the graphs
        placed in the old one keep it), or None past :data:`MAX_ARENA_BYTES`."""
        if nbytes > self.MAX_ARENA_BYTES:
            return None
        if self._arena is None or self._arena.nbytes < nbytes:
            grown = max(nbytes, min(2 * self.bytes, self.MAX_ARENA_BYTES))
            self._arena = aligned_empty(grown)
        return self._arena

    def get(self, key: tuple) -> Graph | None:
        graph = self.entries.get(key)
        if graph is not None:
            self.entries.move_to_end(key)
        return graph

    def put(self, key: tuple, graph: Graph) -> bool:
        """Place ``graph`` in the arena and keep it (True), or give it memory of its own for
        the one run it is built for (False: the caller frees it)."""
        memory = self.arena(graph.scratch_bytes)
        graph.place(memory)
        if memory is None:
            return False
        self.entries[key] = graph
        while len(self.entries) > self.MAX_ENTRIES:
            _, old = self.entries.popitem(last=False)
            old.free()
        return True


class Key:
    """A graph-cache key whose hash is computed once: a step graph's key names every layer's
    shapes and weight types (a tuple of thousands of characters), and a lookup hashes its key
    twice (``get``'s lookup and its ``move_to_end``), 5 us each per step for the small model's
    4-stream decode graph, more once the step's graph has evicted the CPU's caches."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: tuple):
        self.key, self._hash = key, hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (other.__class__ is Key and self._hash == other._hash and self.key == other.key)


_tls = threading.local()


def graph_cache() -> GraphCache:
    """This thread's graph cache (every kernel of this package shares it)."""
    cache = getattr(_tls, "graphs", None)
    if cache is None:
        cache = _tls.graphs = GraphCache()
    return cache


SCRATCH_ALIGN = 64  # bytes: every scratch tensor and arena starts on a cache line


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` (at least 1) starting on a 64-byte boundary."""
    raw = np.empty(max(1, nbytes) + SCRATCH_ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % SCRATCH_ALIGN
    return raw[start:start + max(1, nbytes)]


def work_buffer(size: int) -> np.ndarray:
    """A per-thread scratch buffer of at least ``size`` bytes, 64-byte aligned, reused across calls."""
    buf = getattr(_tls, "work", None)
    if buf is None or buf.nbytes < size:
        buf = aligned_empty(size)
        _tls.work, _tls.work_size, _tls.work_ptr = buf, size, buf.ctypes.data
    return buf


def work_address(size: int) -> int:
    """The address of :func:`work_buffer` (``size``): valid until this thread asks for a bigger
    one, so a graph binds it per call (what ``ggml_graph_compute`` reads it from is the plan)."""
    tls = _tls
    if getattr(tls, "work_size", 0) < size:
        work_buffer(size)
    return tls.work_ptr


def run_cached(key: tuple, build, arrays) -> None:
    """Run the graph cached under ``key`` (``build()`` makes it on a miss) on ``arrays``, the
    data of its inputs and outputs in declaration order. ``build`` frees what it made if it
    fails; a graph too big to cache is freed after this one run."""
    cache = graph_cache()
    graph = cache.get(key)
    if graph is not None:  # the common case: a hit, then only the binding and the compute
        graph.run(arrays)
        return
    graph = build()
    cached = cache.put(key, graph)
    try:
        graph.run(arrays)
    finally:
        if not cached:
            graph.free()


# --- weight repacking ---------------------------------------------------------------------------
# llama.cpp on this CPU puts Q4_0, Q4_K, IQ4_NL... weights into ggml_backend_cpu's "repack"
# buffer type: the bytes are interleaved once, at load, for gemv/gemm kernels that round in
# another order than vec_dot. For a dense weight (``ggml_mul_mat``) the repacked kernels switch
# with the row count (a gemm per 4 rows, a gemv for the rest: other bits), so only the fast mode
# repacks dense weights (attention, shared expert, output head), as llama.cpp does.
#
# The routed experts (:func:`expert_layout`) take their layout by the rows of each call, a rule
# both sides of a call apply to what they both see. ggml's repacked ``mul_mat_id`` takes every
# row through a gemv of its own: each row gets the same bits at any row count (batch-invariant,
# checked in tests/kernels/test_expert_layout.py) but never reaches a gemm. Measured at the 122B
# expert shape (3072x1024 Q4_K, 2 threads, ``bench/kernel.py``) against the plain layout's
# kernels of the fast mode: repacked is 1.13x at 1 row and 1.2x at 2-6 rows (1.17-1.33x at the
# small model's 512x256), then 0.87x at 8 rows and 0.3x from 64, where the plain layout's tiled
# kernel takes over (ggml's switch at 8 rows). So the fast mode multiplies an expert call of
# fewer than 8 rows repacked and a larger one plain (:data:`FAST_REPACK_BELOW`), as the best raw
# kernel at each size; the deterministic mode repacks every call (one kernel at every row
# count, 1.1-1.2x the plain one-row kernel it would otherwise run).
#
# A call is one expert on the rows it gets: a worker's request, or one expert's rows inside a
# layer's ``mul_mat_id`` (:func:`moe_ffn` splits a layer by each expert's row count; the
# backbone's one-graph layer holds every expert in one layout only while a step has fewer
# rows than the threshold, ``kernels.fused``). Either way the same rows meet the same kernel.
#
# The cost is memory: the repacked copy lives beside the mapped bytes. In the deterministic
# mode the plain bytes are never read again and their pages are let go
# (:func:`release_mapped_pages`), so a worker's resident memory stays its slice's size. In the
# fast mode they are let go too, and a call of 8 or more rows reads them back from the file
# (the page cache): a node that only decodes holds about one copy, one that also prefills up
# to two (the mapped half is clean page cache, which the kernel reclaims under pressure; a
# slice held in anonymous memory holds two). KVASIR_REPACK=0 keeps one plain copy.

FAST_REPACK_BELOW = 8  # fast mode: expert calls of fewer rows run repacked (ggml's tiled kernel starts at 8)
EVERY_CALL = 1 << 62  # deterministic mode: every expert call runs repacked

# KVASIR_EXPERT_LAYOUT: "rows" (the default, the rule above), "repacked" (every call repacked
# where ggml has the kernel: what llama.cpp's CPU backend does by default, so that ``kvasir
# verify`` can compare bit for bit) or "plain" (every call plain: llama.cpp with its experts
# kept out of the repack buffer). Read once, as ggml loads; a fast-mode node says which in its
# kernel label (``kernels.backend.kernel_label``). The deterministic mode repacks every call
# unless "plain".
ENV_EXPERT_LAYOUT = "KVASIR_EXPERT_LAYOUT"
EXPERT_LAYOUTS = ("rows", "repacked", "plain")


def _repack_below(mode: str, allowed: bool, layout: str) -> int:
    """Rows below which an expert call runs repacked, for a process of ``mode`` that may repack
    (``allowed``) with KVASIR_EXPERT_LAYOUT ``layout``: 0 for never."""
    if not allowed or layout == "plain":
        return 0
    return EVERY_CALL if mode == "deterministic" or layout == "repacked" else FAST_REPACK_BELOW


def expert_layout_setting() -> str:
    """KVASIR_EXPERT_LAYOUT, checked (default ``rows``); raises ValueError on another value."""
    value = os.environ.get(ENV_EXPERT_LAYOUT, "").strip().lower() or "rows"
    if value not in EXPERT_LAYOUTS:
        raise ValueError(f"{ENV_EXPERT_LAYOUT}={value!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")
    return value


ENV_FLASH_ATTN = "KVASIR_FLASH_ATTN"  # "0" turns flash attention off in fast mode (see flash_attn_setting)


def flash_attn_setting() -> bool:
    """Whether the fast mode's attention is ggml's flash attention: env KVASIR_FLASH_ATTN,
    ``1`` (the default, as llama-server runs on a CPU: its ``--flash-attn auto``) or ``0`` (the
    KQ product, softmax and KQV product of llama.cpp with flash attention off). The
    deterministic mode never uses it: ggml's flash attention tiles 64 query rows or more and
    splits one row's cells over the threads from 512 cells on, so a row's bits would depend on
    its batch and the thread count. Raises ``ValueError`` on another value."""
    value = os.environ.get(ENV_FLASH_ATTN, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_FLASH_ATTN}={value!r}: expected 0 or 1")
    return value == "1"


ENV_REPACK = "KVASIR_REPACK"  # "0" turns repacking off in fast mode (default on, as llama.cpp: see repack_enabled)


class Repacked:
    """One weight's bytes in the CPU repack buffer, and what a graph's weight input needs to use
    them: ``data`` (a uint8 view of the repacked bytes, bound like any input), ``buffer`` and
    ``extra`` (the buffer and repack traits ggml's CPU backend dispatches on)."""

    def __init__(self, lib: Lib, w: QTensor, ctx, tensor, buffer):
        self.lib, self.ctx, self.buffer_handle = lib, ctx, buffer
        c = tensor.contents
        self.buffer, self.extra = c.buffer, c.extra
        n = lib.ggml_nbytes(tensor)
        self.data = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(c.data))
        self.ptr = int(c.data)

    def __del__(self) -> None:
        try:
            self.lib.ggml_backend_buffer_free(self.buffer_handle)
            self.lib.ggml_free(self.ctx)
        except Exception:  # interpreter shutdown
            pass

    def slab(self, i: int, nbytes: int) -> "RepackedSlab":
        """Expert ``i`` of a repacked 3-D tensor, ``nbytes`` long: ggml interleaves rows in
        groups of 8 (or 4) within a row of experts' matrix (it repacks only when ``ne[1]`` is a
        multiple of the group), so each expert's bytes stay in place, the repacking of its own
        2-D matrix."""
        return RepackedSlab(self, i, nbytes)


class RepackedSlab:
    """One expert of a :class:`Repacked` 3-D tensor, what a graph's weight input needs (the
    same ``extra`` and ``buffer``, the expert's ``data`` and ``ptr``); keeps its tensor alive."""

    __slots__ = ("parent", "buffer", "extra", "data", "ptr")

    def __init__(self, parent: Repacked, i: int, nbytes: int):
        if parent.data.nbytes % nbytes or not 0 <= i < parent.data.nbytes // nbytes:
            raise ValueError(f"expert {i} of {nbytes} bytes is not in a repacked tensor of {parent.data.nbytes}")
        self.parent, self.buffer, self.extra = parent, parent.buffer, parent.extra
        self.data = parent.data[i * nbytes:(i + 1) * nbytes]
        self.ptr = parent.ptr + i * nbytes


_repacked: "weakref.WeakKeyDictionary[QTensor, Repacked | None]" = weakref.WeakKeyDictionary()
_repack_lock = threading.Lock()


def repack_enabled() -> bool:
    """Whether weights are repacked in this process (dense ones and the routed experts' slabs):
    fast mode, unless KVASIR_REPACK=0. llama.cpp's default on CPU, and what its users' decode
    speed comes from on an AVX-512 machine (``bench/engine.py`` measures ours with and without
    it beside llama.cpp; on the earlier AVX2 machine dense repacking gained nothing). The
    repacked copy lives in memory beside the mapped file, as llama.cpp's does; the engine and
    the workers make it when they load (``kernels.expert.prepare``), else a weight's first use
    does. Fixed when the libraries load (KVASIR_REPACK is read then), as the mode is."""
    return load().repack


def repack_experts_enabled() -> bool:
    """Whether routed experts have a repacked copy in this process (:func:`expert_layout`:
    used by every call in the deterministic mode, by calls under :data:`FAST_REPACK_BELOW` rows
    in the fast mode) where ggml has its repack buffer, unless KVASIR_REPACK=0."""
    return load().repack_experts


def repack_below() -> int:
    """Rows from which an expert call runs in the plain layout in this process (a huge number
    where every call is repacked, 0 where none is): :func:`repacked_rows`' threshold."""
    return load().repack_below


def repacked_rows(rows: int) -> bool:
    """Whether an expert call of ``rows`` rows runs in the repacked layout in this process,
    where the expert's type has a repacked kernel (:func:`expert_layout`; :func:`expert_repacked`
    says whether it has)."""
    return rows < load().repack_below


@functools.lru_cache(maxsize=None)
def has_repacked_kernel(ggml_type: int) -> bool:
    """Whether ggml on this CPU has a repacked layout for experts of ``ggml_type`` (probed on a
    256 x 8 matrix: expert shapes are whole blocks of rows and of the 8-row interleave)."""
    lib = load()
    if lib.repack_buft is None:
        return False
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if 256 % block:
        return False
    probe = QTensor("layout probe", GGMLQuantizationType(ggml_type), (256, 8),
                    np.zeros(8 * (256 // block) * type_size, np.uint8))
    return repack_weight(probe) is not None


def expert_layout(ggml_type: int, rows: int, mode: str | None = None) -> str:
    """The layout a routed expert's weights are multiplied in for a call of ``rows`` rows:
    ``"repacked"`` where ggml has a repacked kernel for the type (Q4_K, Q4_0, IQ4_NL on x86;
    not with KVASIR_REPACK=0) and the call has fewer rows than the mode's threshold (every call
    in the deterministic mode, fewer than :data:`FAST_REPACK_BELOW` in the fast mode), else
    ``"plain"`` (the GGUF's bytes; see the repacking notes above). The rule takes only what
    both sides of a call see (the type, the rows, the mode: the mode and the repacking are in
    each node's kernel label); ``mode`` None: this process's. Tested in
    tests/kernels/test_expert_layout.py."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    lib = load()
    mode = mode or lib.mode
    if mode == lib.mode:
        below = lib.repack_below
    else:  # a process of the other mode on this machine, with this environment
        below = _repack_below(mode, os.environ.get(ENV_REPACK, "1") != "0", expert_layout_setting())
    return "repacked" if rows < below and has_repacked_kernel(ggml_type) else "plain"


def expert_repacked(w: QTensor) -> Repacked | RepackedSlab | None:
    """A routed expert's weight (a 3-D slab, an expert's 2-D view of one, or a lone expert
    matrix) in the repack buffer where this process repacks experts and ggml has a kernel for
    it (made once per tensor; a view finds its bytes in its slab's repacked copy), else None.
    Which calls use it: :func:`expert_layout` (:func:`repacked_rows`)."""
    if not load().repack_experts:
        return None
    try:
        return _repacked[w]
    except KeyError:
        pass
    if len(w.ne) == 2 and w.slab is not None:
        parent = expert_repacked(w.slab)
        rp = None if parent is None else parent.slab(w.slab_index, w.nbytes)
        with _repack_lock:
            return _repacked.setdefault(w, rp)
    with _repack_lock:
        if w not in _repacked:
            _repacked[w] = repack_weight(w)
    return _repacked[w]


def repacked(w: QTensor) -> Repacked | RepackedSlab | None:
    """A dense weight ``w`` in the repack buffer (made once per tensor), or None where
    repacking is off, ggml has no repacked kernel for its type and shape, or ``w`` holds routed
    experts (a 3-D slab or an expert's 2-D view of one: their layout is :func:`expert_repacked`'s).
    :func:`repack_weight` repacks any weight on request (the benchmark's raw graphs, the tests)."""
    if not load().repack or len(w.ne) != 2 or w.slab is not None:
        return None
    try:
        return _repacked[w]
    except KeyError:
        pass
    with _repack_lock:
        if w not in _repacked:
            _repacked[w] = repack_weight(w)
    return _repacked[w]


def repack_weight(w: QTensor) -> Repacked | None:
    """``w`` copied into the CPU repack buffer whatever the mode (None: no repacked kernel for
    its type and shape here). :func:`repacked` is the cached, mode-aware way in."""
    lib = load()
    check_weight(w, dims=3 if len(w.ne) == 3 else 2)
    ctx = lib.ggml_init(InitParams(lib.tensor_overhead * 2 + 1024, None, True))
    if not ctx:
        raise MemoryError("ggml_init failed")
    new = lib.ggml_new_tensor_2d if len(w.ne) == 2 else lib.ggml_new_tensor_3d
    t = new(ctx, int(w.ggml_type), *(int(n) for n in w.ne))
    buffer = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx, lib.repack_buft) if t else None
    if not buffer:
        lib.ggml_free(ctx)
        return None
    if not t.contents.extra:  # no repacked layout for this type/shape on this CPU
        lib.ggml_backend_buffer_free(buffer)
        lib.ggml_free(ctx)
        return None
    # ggml logs every repacked tensor at debug level to stderr: quiet it for this call only
    old_cb, old_data = ctypes.c_void_p(), ctypes.c_void_p()
    lib.ggml_log_get(ctypes.byref(old_cb), ctypes.byref(old_data))
    lib.ggml_log_set(ctypes.cast(_quiet_log, ctypes.c_void_p), None)
    advise_huge_pages(t.contents.data, lib.ggml_nbytes(t))  # before the copy touches its pages
    try:
        lib.ggml_backend_tensor_set(t, w.data.ctypes.data, 0, w.data.nbytes)  # repacks
    finally:
        lib.ggml_log_set(old_cb, old_data)
    release_mapped_pages(w.data)
    return Repacked(lib, w, ctx, t, buffer)


_MADV_DONTNEED = 4  # Linux
_MADV_HUGEPAGE = 14  # Linux
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB pages) transparent huge page


def advise_huge_pages(address: int, nbytes: int) -> int:
    """Ask Linux to back the whole 2 MiB pages of ``[address, address + nbytes)`` with
    transparent huge pages (``madvise(MADV_HUGEPAGE)``). A repacked weight is streamed through
    at every token; with 4 KiB pages a 122B expert's 5.3 MB take some 1300 TLB entries, with huge
    ones 3. llama.cpp's CPU buffers do not ask; this machine's THP setting is ``madvise``, where
    nothing gets huge pages unasked. Honoured where THP is ``madvise`` or ``always``; where the
    operator set ``never`` (``/sys/kernel/mm/transparent_hugepage/enabled``), or on another
    system, nothing happens. Returns the bytes advised."""
    if not sys.platform.startswith("linux"):
        return 0
    return _advise_whole(address, nbytes, HUGE_PAGE, _MADV_HUGEPAGE)  # 0 without THP (EINVAL)


def _advise_whole(address: int, nbytes: int, unit: int, advice: int) -> int:
    """``madvise(advice)`` on the whole ``unit``-sized pages of ``[address, address + nbytes)``;
    the bytes advised, 0 if none are whole or the kernel refused."""
    start, end = -(-address // unit) * unit, (address + nbytes) // unit * unit
    if end <= start or _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) != 0:
        return 0
    return end - start


def _read_only_file_mapping(a: np.ndarray) -> bool:
    """Whether ``a``'s bytes lie in a read-only mapping of a file (a GGUF opened as
    ``np.memmap(mode="r")``): their pages can be dropped and read again from the file."""
    while a is not None:
        if isinstance(a, np.memmap):
            return a.mode == "r" and getattr(a, "_mmap", None) is not None
        a = a.base if isinstance(a.base, np.ndarray) else None
    return False


def release_mapped_pages(a: np.ndarray) -> int:
    """Drop the whole pages of ``a`` from this process's memory when they map a file read-only
    (``madvise(MADV_DONTNEED)``: the next read, if any, brings them back from the file or the
    page cache, with the same bytes). A repacked weight is read from its copy from then on, so
    its mapped bytes would only double the memory a worker holds for its budget. Anything else
    (arrays in memory, other systems) is left alone. Returns the bytes released."""
    if not sys.platform.startswith("linux") or not _read_only_file_mapping(a):
        return 0
    return _advise_whole(a.ctypes.data, a.nbytes, mmap.PAGESIZE, _MADV_DONTNEED)


@functools.lru_cache(maxsize=None)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet_log(level, text, user_data) -> None:
    """A ggml log callback that keeps warnings and errors (levels 3, 4) and drops the rest."""
    if level in (3, 4):
        import sys

        sys.stderr.write(text.decode(errors="replace"))


_anchor: tuple | None = None  # (ctx, buffer): a small repack buffer that lives as long as the process


def _repack_anchor(lib: Lib) -> int:
    """A buffer of the repack type that is never freed. A cached graph outlives the weights it
    was built with (the cache is keyed by shapes, and the next engine's weights bind to it), and
    ggml reads only the buffer's type from a weight input, to pick the repacked kernel: pointed
    at a dead weight's buffer, it read freed memory and picked the plain kernel for repacked
    bytes (wrong numbers, once a second engine of the same shapes ran in the process)."""
    global _anchor
    with _repack_lock:
        if _anchor is None:
            ctx = lib.ggml_init(InitParams(lib.tensor_overhead * 2 + 1024, None, True))
            if not ctx:
                raise MemoryError("ggml_init failed")
            lib.ggml_new_tensor_1d(ctx, int(T.F32), 64)
            buffer = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx, lib.repack_buft)
            if not buffer:
                lib.ggml_free(ctx)
                raise MemoryError("could not allocate a repack buffer")
            _anchor = (ctx, buffer)
    return _anchor[1]


def weight_input(g: Graph, w: QTensor, rp: Repacked | RepackedSlab | None, ne: tuple | None = None):
    """A weight input of ``g`` (of shape ``ne``, ``w.ne`` by default): bound per call to
    ``w.data``, or to ``rp.data`` when repacked (then the tensor carries a buffer of the repack
    type, :func:`_repack_anchor`, and the weight's repack traits: static in ggml, the same for
    every weight of its type and shape class)."""
    t = g.input(w.ggml_type, w.ne if ne is None else ne)
    if rp is not None:
        t.contents.buffer, t.contents.extra = _repack_anchor(g.lib), rp.extra
    return t


def weight_data(w: QTensor, rp: Repacked | RepackedSlab | None) -> int:
    """The address a weight input of :func:`weight_input` is bound to."""
    return w.ptr if rp is None else rp.ptr


# --- public kernels ---------------------------------------------------------------------------

def matmul(w: QTensor, x: np.ndarray, *, routed: bool = False) -> np.ndarray:
    """``W`` applied to rows, as ggml computes it on this CPU.

    x (n, ne0) float32 -> (n, ne1) float32. ``routed=False`` runs ``ggml_mul_mat(W, X)`` (dense
    layers, shared experts); ``routed=True`` runs ``ggml_mul_mat_id`` with all n rows sent to
    this one expert, the op llama.cpp uses for routed experts (it takes different CPU paths,
    see the module docstring).
    """
    check_weight(w)
    x = _rows(x, w.ne[0], w.name)
    if not routed and x.shape[0] == 1 and deterministic():  # batch invariance: see _one_row
        return _one_row(matmul, w, x, routed=False)
    n = x.shape[0]
    lib = load()
    threads = expert_threads(n * w.ne[0] * w.ne[1]) if routed else threads_for(n * w.ne[0] * w.ne[1], n)
    rp = (expert_repacked(w) if repacked_rows(n) else None) if routed else repacked(w)  # expert_layout

    def build() -> Graph:
        g = Graph(lib, n_tensors=5)
        try:
            if routed:
                wt = weight_input(g, w, rp, (w.ne[0], w.ne[1], 1))
                xt = g.input(T.F32, (w.ne[0], 1, n))
                ids = g.constant(T.I32, (1, n), np.zeros(n, dtype=np.int32))
                g.output(lib.ggml_mul_mat_id(g.ctx, wt, xt, ids))  # (n, 1, ne1)
            else:
                wt = weight_input(g, w, rp)
                xt = g.input(T.F32, (w.ne[0], n))
                g.output(lib.ggml_mul_mat(g.ctx, wt, xt))  # (n, ne1)
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    out = np.empty((n, w.ne[1]), dtype=np.float32)
    run_cached(("mm", routed, n, threads, rp is not None, *w.shape_key), build, (weight_data(w, rp), x, out))
    return out


class _FfnPlan:
    """What every call of one expert's FFN needs besides its rows, checked once: the three
    tensors are immutable, so they pass :func:`check_ffn` for good. ``shape_id`` names the
    graph shape (types, sizes, biases, activation: never the weights' bytes, which are bound
    per call), so experts of one shape share their cached graphs."""

    __slots__ = ("up", "down", "n_embd", "n_ff", "work", "shape_id", "weights", "rps", "routed")

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.up, self.down = up, down
        self.n_embd, self.n_ff = gate.ne
        self.work = 3 * self.n_embd * self.n_ff  # multiply-adds per row
        triple = (gate, up, down)
        biases = tuple(w.bias_ptr for w in triple if w.bias is not None)
        # a dense call (a shared expert) and a routed call each bind their own layout
        self.rps = tuple(repacked(w) for w in triple)  # None each where not repacked
        shape = (int(gate.ggml_type), int(up.ggml_type), int(down.ggml_type), gate.ne,
                 tuple(w.bias is not None for w in triple), gate.glu)
        self.shape_id = shape_id((*shape, tuple(rp is not None for rp in self.rps)))
        # the addresses a call binds after x, in graph input order: weights, then bias rows
        self.weights = (*(weight_data(w, rp) for w, rp in zip(triple, self.rps)), *biases)
        # a routed call: (shape id, repacking, addresses) per layout, [few rows, many rows]
        # (expert_layout: repacked below repacked_rows' threshold where the weights have a copy)
        self.routed = []
        for rps in (tuple(expert_repacked(w) for w in triple), (None, None, None)):
            self.routed.append((shape_id((*shape, "routed", tuple(rp is not None for rp in rps))), rps,
                                (*(weight_data(w, rp) for w, rp in zip(triple, rps)), *biases)))


_ffn_plans: "weakref.WeakKeyDictionary[QTensor, _FfnPlan]" = weakref.WeakKeyDictionary()
_shape_ids: dict[tuple, int] = {}
_shape_lock = threading.Lock()


def shape_id(shape: tuple) -> int:
    """A small int standing for a graph-shape tuple (any hashable description of what fixes a
    graph's shapes): cache keys stay a few ints, hashed in nanoseconds, however much the shape
    holds. Work it out once per set of weights (as the expert plans here do), not per call. Two shapes must never share an id (a graph
    built for one would read the other's bytes), hence the lock around numbering a new one."""
    got = _shape_ids.get(shape)
    if got is None:
        with _shape_lock:
            got = _shape_ids.setdefault(shape, len(_shape_ids))
    return got


_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


def _rows(x, width: int, what: str) -> np.ndarray:
    """:func:`check_rows` with its answer for the common case (already a C-contiguous float32
    (n>=1, width) array) found without a numpy call."""
    if (x.__class__ is _ndarray and x.dtype == _F32 and x.ndim == 2 and x.shape[1] == width and x.shape[0]
            and x.flags.c_contiguous):
        return x
    return check_rows(x, width, what)


def _ffn_plan(gate: QTensor, up: QTensor, down: QTensor, x) -> tuple[_FfnPlan, np.ndarray]:
    """The checked plan of this expert and its rows as C-contiguous (n, n_embd) float32."""
    plan = _ffn_plans.get(gate)
    if plan is not None and plan.up is up and plan.down is down:
        return plan, _rows(x, plan.n_embd, gate.name)
    x = check_ffn(gate, up, down, x)
    plan = _FfnPlan(gate, up, down)
    _ffn_plans[gate] = plan
    return plan, x


def expert_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, *, routed: bool,
               plain: bool = False) -> np.ndarray:
    """``down(silu(gate(x)) * up(x))`` as one ggml graph, as llama.cpp builds it.

    x (n, n_embd) float32 -> (n, n_embd) float32, a new array. ``routed=True`` uses
    ``ggml_mul_mat_id`` (llama.cpp's ``build_moe_ffn``), ``routed=False`` ``ggml_mul_mat``
    (``build_ffn``, the shared expert). ``ggml_swiglu_split`` rounds silu(g)*u to float32 and
    the down matmul quantizes that, as in llama.cpp. gpt-oss' experts: each product's bias is
    added with ``ggml_add_id`` (``ggml_add`` when not routed) and the activation is
    ``ggml_swiglu_oai`` when the gate says so (``gate.glu``), the ops and order of ``build_moe_ffn``.

    A worker calls this once per request, often on one row of a small expert, so the call
    itself is kept to a plan lookup, a graph-cache hit and the binding of x and the result.
    ``plain``: a routed call in the plain layout whatever its rows (what a node that does not
    repack its experts computes: the audit of such a node, ``backbone.audit.rerun_plain``).
    """
    plan, x = _ffn_plan(gate, up, down, x)
    n = x.shape[0]
    if n == 1 and not routed and deterministic():  # batch invariance: see _one_row
        return _one_row(expert_ffn, gate, up, down, x, routed=False)
    if routed:  # the layout of expert_layout for n rows, the team for any large call
        sid, rps, weights = plan.routed[1 if plain or not repacked_rows(n) else 0]
        threads = expert_threads(plan.work * n)
        key = ("ffn", sid, True, n, threads)
        out = np.empty((n, plan.n_embd), dtype=np.float32)
        run_cached(key, lambda: _build_ffn(gate, up, down, True, n, threads, rps), (x, *weights, out))
        return out
    threads = threads_for(plan.work * n, n)
    key = ("ffn", plan.shape_id, False, n, threads)
    out = np.empty((n, plan.n_embd), dtype=np.float32)
    run_cached(key, lambda: _build_ffn(gate, up, down, False, n, threads, plan.rps), (x, *plan.weights, out))
    return out


def _build_ffn(gate: QTensor, up: QTensor, down: QTensor, routed: bool, n: int, threads: int,
               rps: tuple = (None, None, None)) -> Graph:
    """:func:`expert_ffn`'s graph for ``n`` rows of experts shaped like these (any such expert's
    bytes are bound to it per call; ``rps``: their repacking, per weight, or None). Inputs: x,
    gate, up, down, the bias rows present, the result."""
    n_embd, n_ff = gate.ne
    lib = load()
    g = Graph(lib, n_tensors=16)
    try:
        ids = None
        if routed:
            ids = g.constant(T.I32, (1, n), np.zeros(n, dtype=np.int32))
            xt = g.input(T.F32, (n_embd, 1, n))
            gw = weight_input(g, gate, rps[0], (n_embd, n_ff, 1))
            uw = weight_input(g, up, rps[1], (n_embd, n_ff, 1))
            dw = weight_input(g, down, rps[2], (n_ff, n_embd, 1))
            gt = g.scratch(lib.ggml_mul_mat_id(g.ctx, gw, xt, ids))  # (n, 1, n_ff)
            ut = g.scratch(lib.ggml_mul_mat_id(g.ctx, uw, xt, ids))
        else:
            xt = g.input(T.F32, (n_embd, n))
            gw, uw, dw = (weight_input(g, w, rp) for w, rp in zip((gate, up, down), rps))
            gt = g.scratch(lib.ggml_mul_mat(g.ctx, gw, xt))  # (n, n_ff)
            ut = g.scratch(lib.ggml_mul_mat(g.ctx, uw, xt))
        # bias inputs in gate, up, down order (the order of their addresses in _FfnPlan.weights)
        bt = {role: g.input(T.F32, (w.ne[1], 1) if routed else (w.ne[1],))
              for role, w in (("gate", gate), ("up", up), ("down", down)) if w.bias is not None}

        def biased(t, role: str):
            b = bt.get(role)
            if b is None:
                return t
            return g.scratch(lib.ggml_add_id(g.ctx, t, b, ids) if routed else lib.ggml_add(g.ctx, t, b))

        # build_moe_ffn's order: up and its bias, then gate and its bias
        ut = biased(ut, "up")
        gt = biased(gt, "gate")
        if gate.glu == "swiglu_oai":
            h = g.scratch(lib.ggml_swiglu_oai(g.ctx, gt, ut, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT))
        else:
            h = g.scratch(lib.ggml_swiglu_split(g.ctx, gt, ut))  # silu(g) * u, float32
        y = lib.ggml_mul_mat_id(g.ctx, dw, h, ids) if routed else lib.ggml_mul_mat(g.ctx, dw, h)
        if "down" in bt:
            y = biased(g.scratch(y), "down")
        g.output(y)
        return g.finish(threads)
    except BaseException:
        g.free()
        raise


def quantize(x: np.ndarray, ggml_type: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize rows with ggml's own quantizer (``ggml_quantize_chunk``), as llama-quantize does.

    x (rows, n_per_row) float32 -> 1-D uint8 array of ``rows * row_size`` bytes, the tensor's
    data as it lies in a GGUF. Works for every type ggml can quantize to, the K-quants included;
    IQ2/IQ1 types need an ``imatrix`` of shape (n_per_row,).
    """
    ggml_type = T(int(ggml_type))
    x = np.asarray(x)
    if x.ndim != 2 or min(x.shape) < 1:
        raise ValueError(f"expected a 2-D (rows, n_per_row) array, got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n_per_row = x.shape
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"cannot quantize to {ggml_type.name}")
    block, _ = GGML_QUANT_SIZES[ggml_type]
    if n_per_row % block:
        raise ValueError(f"row length {n_per_row} is not a multiple of {ggml_type.name}'s block size {block}")
    lib = load()
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_per_row,):
            raise ValueError(f"imatrix must have shape ({n_per_row},), got {imatrix.shape}")
    elif lib.ggml_quantize_requires_imatrix(int(ggml_type)):
        raise ValueError(f"{ggml_type.name} needs an importance matrix (imatrix=)")
    row_size = lib.ggml_row_size(int(ggml_type), n_per_row)
    out = np.empty(rows * row_size, dtype=np.uint8)
    written = lib.ggml_quantize_chunk(int(ggml_type), x.ctypes.data, out.ctypes.data, 0, rows, n_per_row,
                                      None if imatrix is None else imatrix.ctypes.data)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def vec_dot_type(ggml_type: int) -> GGMLQuantizationType:
    """The format ggml's CPU backend converts activations to before multiplying with weights
    of ``ggml_type`` (``type_traits_cpu[type].vec_dot_type``)."""
    lib = load()
    return T(lib.ggml_get_type_traits_cpu(int(ggml_type)).contents.vec_dot_type)


def cpu_from_float(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """Convert rows with the CPU backend's own ``from_float`` for ``ggml_type`` (the SIMD code
    that quantizes activations inside a matmul, e.g. x86 ``quantize_row_q8_0``, not the
    reference quantizer ``quantize`` uses). x (rows, k) float32 -> 1-D uint8 blocks."""
    ggml_type = T(int(ggml_type))
    x = np.asarray(x)
    if x.ndim != 2 or min(x.shape) < 1:
        raise ValueError(f"expected a 2-D (rows, k) array, got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    block, _ = GGML_QUANT_SIZES[ggml_type]
    if x.shape[1] % block:
        raise ValueError(f"row length {x.shape[1]} is not a multiple of {ggml_type.name}'s block size {block}")
    lib = load()
    address = lib.ggml_get_type_traits_cpu(int(ggml_type)).contents.from_float
    if not address:
        raise ValueError(f"ggml's CPU backend has no from_float for {ggml_type.name}")
    convert = _FromFloat(address)
    row_size = lib.ggml_row_size(int(ggml_type), x.shape[1])
    out = np.empty(x.shape[0] * row_size, dtype=np.uint8)
    for r in range(x.shape[0]):
        convert(x[r].ctypes.data, out.ctypes.data + r * row_size, x.shape[1])
    return out


def _one_row(fn, *args, routed: bool):
    """Run a one-row dense product as a two-row one and keep the first row.

    ``ggml_mul_mat`` takes ``vec_dot`` for one row and llamafile's tinyBLAS from two rows on,
    and the two sum in different orders (1 ulp apart for F32/F16 weights). Duplicating the row
    makes a decode step compute exactly what the same row gets inside a prompt batch, so the
    engine's results do not depend on how tokens were batched.
    """
    *head, x = args
    return fn(*head, np.repeat(x, 2, axis=0), routed=routed)[:1]


def moe_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, ids: np.ndarray, *,
            biases: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] = (None, None, None),
            glu: str = "swiglu") -> np.ndarray:
    """Many routed experts in one graph, llama.cpp's ``build_moe_ffn`` up to the weighting.

    gate/up: the 3-D expert slabs, ne (n_embd, n_ff, E); down ne (n_ff, n_embd, E). x (T, n_embd)
    float32; ids (T, K) int32, the experts each row goes to. Returns (T, K, n_embd) float32: row
    t through expert ids[t, k], before the router weight. ``biases``: gpt-oss' bias rows (E, n_ff),
    (E, n_ff), (E, n_embd) float32 or None; ``glu``: the activation (swiglu or swiglu_oai).

    ``ggml_mul_mat_id`` computes each expert on the rows that chose it, in row order, so every
    row's result is the one the same expert gives those rows alone (:func:`expert_ffn` with
    ``routed=True``, what a worker computes): one call per layer instead of one per expert.
    """
    plan = _moe_plans.get(gate)
    if plan is None or not plan.fits(up, down, biases, glu):
        plan = _MoePlan(gate, up, down, biases, glu)
        _moe_plans[gate] = plan
    n_embd, n_ff, E = gate.ne
    x = _rows(x, n_embd, gate.name)
    if not (ids.__class__ is _ndarray and ids.dtype == _I32 and ids.flags.c_contiguous):
        ids = np.ascontiguousarray(ids, dtype=np.int32)
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or ids.size == 0:
        raise ValueError(f"ids: expected shape ({x.shape[0]}, K), got {ids.shape}")
    if not _ids_in_range(ids, E):  # ggml aborts on an id outside 0..E-1
        raise ValueError(f"expert ids out of range 0..{E - 1}")
    n, k = ids.shape
    if not plan.two_layouts or n * k < load().repack_below:  # one layout for every expert's rows
        return _moe_graph(plan, gate, up, down, x, ids, 0 if plan.two_layouts else 1)
    # each expert's layout by the rows it gets here (expert_layout). The layout most (row, slot)
    # pairs take runs the whole layer (the call's own rows, no gather), the other's pairs run
    # again, gathered row by row, and replace theirs: either way every expert meets exactly
    # its rows, in the order the one graph gives them, in its layout. Past SPLIT_GATHER_SHARE
    # of the pairs in the minority, both halves are gathered instead, in one graph
    # (:func:`_moe_split_graph`: no compute thrown away).
    below = load().repack_below
    few = np.bincount(ids.ravel(), minlength=E)[ids] < below  # (n, k)
    n_few = int(np.count_nonzero(few))
    if n_few in (0, few.size):
        return _moe_graph(plan, gate, up, down, x, ids, 0 if n_few else 1)
    majority = 0 if 2 * n_few >= few.size else 1
    minority = few if majority else ~few
    if minority.sum() <= SPLIT_GATHER_SHARE * few.size:
        out = _moe_graph(plan, gate, up, down, x, ids, majority).reshape(n * k, n_embd)
        pairs = np.flatnonzero(minority)  # (row, slot) pairs row by row, each row's slots in order
        part = _moe_graph(plan, gate, up, down, np.take(x, pairs // k, axis=0), ids.ravel()[pairs][:, None],
                          1 - majority)
        out[pairs] = part.reshape(len(pairs), n_embd)
        return out.reshape(n, k, n_embd)
    return _moe_split_graph(plan, gate, up, down, x, ids, few)


def _moe_split_graph(plan: "_MoePlan", gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, ids: np.ndarray,
                     few: np.ndarray) -> np.ndarray:
    """:func:`moe_ffn` with each (row, slot) pair in its expert's layout (``few``: repacked),
    as one graph: each half's rows gathered in the graph (``ggml_get_rows``, row by row, each
    row's slots in order), its experts in its layout, the halves put back in pair order. The
    same bits as a graph per half: the gathers and the concatenation copy float32 rows."""
    n, k = ids.shape
    flat = ids.ravel()
    pairs = [np.flatnonzero(few), np.flatnonzero(~few)]
    order = np.concatenate(pairs)
    back = np.empty(n * k, np.int32)
    back[order] = np.arange(n * k, dtype=np.int32)  # pair p's place in the two halves, one after the other
    pa, pb = len(pairs[0]), len(pairs[1])
    threads = expert_threads(plan.work * n * k)
    key = ("moe-split", plan.layouts[0][0], plan.layouts[1][0], n, k, pa, threads)
    arrays = [x]
    for half in pairs:
        arrays += [(half // k).astype(np.int32), np.ascontiguousarray(flat[half])]
    arrays.append(back)
    biases = plan.layouts[0][2][3:]
    arrays += [*plan.layouts[0][2][:3], *plan.layouts[1][2][:3], *biases]
    out = np.empty((n, k, gate.ne[0]), dtype=np.float32)
    arrays.append(out)
    run_cached(key, lambda: _build_moe_split(plan, gate, up, down, n, k, pa, pb, threads), arrays)
    return out


def _build_moe_split(plan: "_MoePlan", gate: QTensor, up: QTensor, down: QTensor, n: int, k: int, pa: int,
                     pb: int, threads: int) -> Graph:
    """:func:`_moe_split_graph`'s graph. Inputs: x (D, n), per half its pairs' rows and experts,
    the pairs' places, the repacked half's three slabs, the plain half's, the bias rows present,
    the result (D, k, n)."""
    n_embd, n_ff, E = gate.ne
    lib = load()
    g = Graph(lib, n_tensors=48)
    try:
        ctx = g.ctx
        xt = g.input(T.F32, (n_embd, n))
        halves = [(g.input(T.I32, (p,)), g.input(T.I32, (1, p)), p) for p in (pa, pb)]
        back = g.input(T.I32, (n * k,))
        slabs = [[weight_input(g, w, rp) for w, rp in zip((gate, up, down), plan.layouts[i][1])] for i in (0, 1)]
        bt = [g.input(T.F32, (rows, E)) if b is not None else None
              for b, rows in zip(plan.biases, (n_ff, n_ff, n_embd))]
        ys = []
        for (rows, it, p), (gw, uw, dw) in zip(halves, slabs):
            def biased(t, b, it=it):
                return t if b is None else g.scratch(lib.ggml_add_id(ctx, t, b, it))

            xh = g.view(lib.ggml_reshape_3d(ctx, g.scratch(lib.ggml_get_rows(ctx, xt, rows)), n_embd, 1, p))
            ut = biased(g.scratch(lib.ggml_mul_mat_id(ctx, uw, xh, it)), bt[1])  # build_moe_ffn's order
            gt = biased(g.scratch(lib.ggml_mul_mat_id(ctx, gw, xh, it)), bt[0])
            if plan.glu == "swiglu_oai":
                h = g.scratch(lib.ggml_swiglu_oai(ctx, gt, ut, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT))
            else:
                h = g.scratch(lib.ggml_swiglu_split(ctx, gt, ut))
            y = biased(g.scratch(lib.ggml_mul_mat_id(ctx, dw, h, it)), bt[2])  # (D, 1, p)
            ys.append(g.view(lib.ggml_reshape_2d(ctx, y, n_embd, p)))
        both = g.scratch(lib.ggml_concat(ctx, ys[0], ys[1], 1))  # (D, pa + pb)
        g.output(lib.ggml_get_rows(ctx, both, back))  # (D, n * k): pair order, the bytes of (n, k, D)
        return g.finish(threads)
    except BaseException:
        g.free()
        raise


SPLIT_GATHER_SHARE = 0.1  # moe_ffn: the minority's share of pairs past which both halves are gathered (measured with the halves as two graphs: at 64 rows with a quarter repacked, gathering both cost 85% of computing the quarter twice)


def _moe_graph(plan: "_MoePlan", gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, ids: np.ndarray,
               layout: int) -> np.ndarray:
    """:func:`moe_ffn`'s one graph on checked x (n, D), ids (n, k), every expert in ``layout``
    (0: repacked where the slabs have a copy, 1: plain) -> (n, k, D)."""
    n, k = ids.shape
    sid, rps, weights = plan.layouts[layout]
    threads = expert_threads(plan.work * n * k)
    out = np.empty((n, k, gate.ne[0]), dtype=np.float32)
    run_cached(("moe", sid, n, k, threads), lambda: _build_moe(plan, rps, gate, up, down, n, k, threads),
               (x, ids, *weights, out))
    return out


def _ids_in_range(ids: np.ndarray, limit: int) -> bool:
    """Whether every entry of the C-contiguous int32 ``ids`` (non-empty) lies in 0..limit-1.
    Read as uint32 a negative id is >= 2**31 > limit, so one maximum checks both ends; a
    decode step's few ids are quicker to check as Python ints than with a numpy reduction."""
    if ids.size <= 64:
        listed = ids.ravel().tolist()
        return min(listed) >= 0 and max(listed) < limit
    return int(ids.view(np.uint32).max()) < limit


class _MoePlan:
    """:func:`moe_ffn`'s checked expert slabs, bias rows and activation (as :class:`_FfnPlan`)."""

    __slots__ = ("up", "down", "biases", "glu", "work", "layouts", "two_layouts")

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, biases: tuple, glu: str):
        for w in (gate, up, down):
            check_weight(w, dims=3)
        n_embd, n_ff, E = gate.ne
        if up.ne != gate.ne or down.ne != (n_ff, n_embd, E):
            raise ValueError(f"expert slabs {gate.ne}, {up.ne}, {down.ne} do not fit together")
        biases = tuple(biases)
        if len(biases) != 3:
            raise ValueError(f"expected three bias entries (gate, up, down), got {len(biases)}")
        for b, rows in zip(biases, (n_ff, n_ff, n_embd)):
            if b is not None and (not isinstance(b, np.ndarray) or b.dtype != np.float32 or b.shape != (E, rows)
                                  or not b.flags.c_contiguous):
                raise ValueError(f"expert bias: expected C-contiguous float32 ({E}, {rows}), got "
                                 f"{getattr(b, 'dtype', type(b).__name__)} {getattr(b, 'shape', '')}")
        self.up, self.down, self.biases, self.glu = up, down, biases, glu
        self.work = 3 * n_embd * n_ff  # multiply-adds per (row, slot)
        # (shape id, repacking, addresses) per layout: [repacked where the slabs have a copy, plain]
        self.layouts = []
        for rps in (tuple(expert_repacked(w) for w in (gate, up, down)), (None, None, None)):
            sid = shape_id(("moe", gate.shape_key, up.shape_key, down.shape_key,
                            tuple(b is not None for b in biases), glu, tuple(rp is not None for rp in rps)))
            self.layouts.append((sid, rps, (*(weight_data(w, rp) for w, rp in zip((gate, up, down), rps)),
                                            *(address(b) for b in biases if b is not None))))
        self.two_layouts = any(rp is not None for rp in self.layouts[0][1])  # expert_layout

    def fits(self, up: QTensor, down: QTensor, biases: tuple, glu: str) -> bool:
        """Whether a call with these arguments is the one this plan checked (same objects)."""
        mine = self.biases
        return (up is self.up and down is self.down and glu == self.glu and len(biases) == 3
                and biases[0] is mine[0] and biases[1] is mine[1] and biases[2] is mine[2])


_moe_plans: "weakref.WeakKeyDictionary[QTensor, _MoePlan]" = weakref.WeakKeyDictionary()


def _build_moe(plan: _MoePlan, rps: tuple, gate: QTensor, up: QTensor, down: QTensor, n: int, k: int,
               threads: int) -> Graph:
    """:func:`moe_ffn`'s graph for ``n`` rows of ``k`` slots, the slabs repacked as ``rps`` says
    (None each: plain). Inputs: x, ids, the three slabs, the bias rows present, the result."""
    n_embd, n_ff, E = gate.ne
    lib = load()
    g = Graph(lib, n_tensors=16)
    try:
        xt = g.input(T.F32, (n_embd, 1, n))  # one row per token, broadcast over its K slots
        it = g.input(T.I32, (k, n))
        gw, uw, dw = (weight_input(g, w, rp) for w, rp in zip((gate, up, down), rps))
        bt = [g.input(T.F32, (rows, E)) if b is not None else None
              for b, rows in zip(plan.biases, (n_ff, n_ff, n_embd))]

        def biased(t, b):
            return t if b is None else g.scratch(lib.ggml_add_id(g.ctx, t, b, it))

        # build_moe_ffn's order: up and its bias, then gate and its bias
        ut = biased(g.scratch(lib.ggml_mul_mat_id(g.ctx, uw, xt, it)), bt[1])  # (n_ff, K, n)
        gt = biased(g.scratch(lib.ggml_mul_mat_id(g.ctx, gw, xt, it)), bt[0])
        if plan.glu == "swiglu_oai":
            h = g.scratch(lib.ggml_swiglu_oai(g.ctx, gt, ut, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT))
        else:
            h = g.scratch(lib.ggml_swiglu_split(g.ctx, gt, ut))
        y = lib.ggml_mul_mat_id(g.ctx, dw, h, it)  # (n_embd, K, n)
        if bt[2] is not None:
            y = biased(g.scratch(y), bt[2])
        g.output(y)
        return g.finish(threads)
    except BaseException:
        g.free()
        raise


class MoeStep:
    """:func:`moe_ffn` for one row and ``k`` slots of fixed expert slabs, its graph bound once.

    A worker answers each decode step with the same graph on the same slabs; through
    :func:`moe_ffn` every call looks up the plan, checks the rows, ids and threads, allocates the
    result and rebinds the graph's seven pointers (~15 µs of Python per call on the shared 2-core
    machine). Here the row, the ids and the result live in buffers of this object, the graph
    (built by the same :func:`_build_moe`, so the same bits) points at them and at a work buffer
    of its own for good, and a call copies the row and ids in and computes. The graph is owned
    here, outside the per-thread LRU, which could free it under a bound pointer.

    Not for concurrent use (one row buffer): a worker keeps one per holding and ``k``, on its loop.
    """

    __slots__ = ("k", "n_expert", "x", "ids", "out", "_graph", "_work", "_keep", "_compute", "_args", "_many")

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, k: int, *,
                 biases: tuple = (None, None, None), glu: str = "swiglu"):
        plan = _MoePlan(gate, up, down, biases, glu)
        n_embd, _, n_expert = gate.ne
        if k < 1:
            raise ValueError(f"k: expected at least one slot, got {k}")
        self.k, self.n_expert = k, n_expert
        self.x = np.zeros((1, n_embd), np.float32)
        self.ids = np.zeros((1, k), np.int32)
        self.out = np.zeros((1, k, n_embd), np.float32)
        # one row: each expert gets it once, a call under the fast mode's threshold whenever k is
        # (expert_layout); from k = FAST_REPACK_BELOW slots only a repeated slot could reach it
        _, rps, weights = plan.layouts[0]
        self._many = plan.two_layouts and k >= load().repack_below  # then a call checks its slots
        graph = _build_moe(plan, rps, gate, up, down, 1, k, expert_threads(plan.work * k))
        try:
            graph.place()  # scratch memory of its own: it runs outside the cache, on its owner's thread
            for c, p in zip(graph.inputs, (address(self.x), address(self.ids), *weights, address(self.out))):
                c.data = p
            for c, i, offs in graph.views:
                c.data = address((self.x, self.ids, *weights, self.out)[i]) + offs
            if graph.work_size:  # 64-byte aligned, as work_buffer's
                self._work = aligned_empty(graph.work_size)
                graph.plan.work_data = self._work.ctypes.data
            else:
                self._work = None
        except BaseException:
            graph.free()
            raise
        self._graph = graph
        self._keep = (plan, gate, up, down)  # the slabs and bias rows the graph points at
        self._compute, self._args = graph._compute, (graph._graph_arg, graph.plan_ref)

    def __call__(self, row: np.ndarray, slots) -> np.ndarray:
        """``row`` (n_embd,) float32 through the experts of slab indices ``slots`` (k ints) ->
        (k, n_embd) float32, a view of this object's result buffer: valid until the next call.
        Row k has the bits ``moe_ffn(..., row[None], [slots])[0, k]`` gives."""
        ids = self.ids
        ids[0] = slots
        if not _ids_in_range(ids, self.n_expert):  # ggml aborts on an id outside 0..E-1
            raise ValueError(f"expert ids out of range 0..{self.n_expert - 1}")
        if self._many and int(np.bincount(ids[0]).max()) >= load().repack_below:  # a slot repeated that often
            plan, gate, up, down = self._keep
            self.out[0] = moe_ffn(gate, up, down, np.asarray(row, np.float32)[None], ids,
                                  biases=plan.biases, glu=plan.glu)[0]
            return self.out[0]
        self.x[0] = row
        status = self._compute(*self._args)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")
        return self.out[0]

    def __del__(self) -> None:
        try:
            self._graph.free()
        except Exception:  # interpreter shutdown, or __init__ failed before the graph
            pass


def get_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (n,) of a 2-D weight, dequantised by ggml (``ggml_get_rows``, llama.cpp's
    token embedding lookup): (n, ne0) float32."""
    check_weight(w)
    if not (ids.__class__ is _ndarray and ids.dtype == _I32 and ids.flags.c_contiguous):
        ids = np.ascontiguousarray(ids, dtype=np.int32)
    if ids.ndim != 1 or ids.size == 0 or not _ids_in_range(ids, w.ne[1]):
        raise ValueError(f"{w.name}: row ids must be a non-empty 1-D array in 0..{w.ne[1] - 1}")
    n = len(ids)
    lib = load()

    def build() -> Graph:
        g = Graph(lib, n_tensors=4)
        try:
            wt = g.input(w.ggml_type, w.ne)
            it = g.input(T.I32, (n,))
            g.output(lib.ggml_get_rows(g.ctx, wt, it))
            return g.finish(1)
        except BaseException:
            g.free()
            raise

    out = np.empty((n, w.ne[0]), dtype=np.float32)
    run_cached(("get_rows", n, *w.shape_key), build, (w.ptr, ids, out))
    return out
