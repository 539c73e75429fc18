"""``kvasir synth`` (build a synthetic MoE GGUF) and ``kvasir info`` (inspect any MoE GGUF).

Heavy imports (numpy, gguf, the generator) happen inside the command functions so that
``kvasir --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvasir_bus.errors import UsageError

# The choices, repeated here so the parser needs no numpy; a test checks they match
# synth.model's tables.
ARCH_CHOICES = ("qwen3moe", "qwen2moe", "mixtral", "qwen35moe", "qwen3next", "gpt-oss")
PRESET_CHOICES = ("tiny", "small", "122b-layer")
TYPE_CHOICES = ("f32", "f16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "mxfp4")

_SIZE_FLAGS = (
    ("--layers", "number of transformer blocks"),
    ("--experts", "routed experts per layer"),
    ("--experts-used", "experts selected per token (top-k)"),
    ("--hidden", "embedding width (n_embd)"),
    ("--expert-ffn", "FFN width of one routed expert"),
    ("--heads", "attention heads"),
    ("--kv-heads", "key/value heads (GQA); must divide --heads"),
    ("--vocab", "vocabulary size (at least 258)"),
    ("--ctx", "training context length written to the file"),
    ("--shared-expert-ffn", "FFN width of the shared expert (qwen2moe, qwen35moe)"),
    ("--head-dim", "attention head size (qwen35moe, gpt-oss; default hidden / heads)"),
    ("--rope-dims", "rotated dimensions per head (qwen35moe; default per preset)"),
    ("--ssm-k-heads", "delta-net query/key heads (qwen35moe)"),
    ("--ssm-v-heads", "delta-net value heads (qwen35moe); a multiple of --ssm-k-heads"),
    ("--ssm-head-dim", "delta-net head size (qwen35moe)"),
    ("--conv-kernel", "delta-net causal conv width (qwen35moe)"),
    ("--full-attention-interval", "every N-th layer is full attention, the rest delta-net (qwen35moe)"),
    ("--sliding-window", "positions the sliding-window layers see (gpt-oss)"),
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "synth", help="write a synthetic MoE GGUF with random weights",
        description="Write a Mixture-of-Experts GGUF with random weights and a byte-level "
        "tokenizer that llama.cpp loads. Presets: tiny (unit tests), small (demo, benchmarks), "
        "122b-layer (the 122B model's per-expert shapes, 1 layer, written streaming). Size "
        "flags override the preset. K-quant types need rows that are a multiple of 256; "
        "matrices that do not fit fall back like llama.cpp's quantizer (with a warning).",
        epilog="example (the demo's model): kvasir synth --arch qwen3moe --preset small --type q4_k "
        "--seed 0 -o models/small-qwen3moe-q4_k.gguf")
    p.add_argument("--arch", choices=ARCH_CHOICES, default="qwen3moe",
                   help="architecture family (mixtral = llama.cpp's llama with experts; qwen35moe = "
                   "Qwen3.5 MoE, gated delta-net + gated attention; default %(default)s)")
    p.add_argument("--preset", choices=PRESET_CHOICES, default="tiny", help="sizes (default %(default)s)")
    p.add_argument("--type", dest="qtype", choices=TYPE_CHOICES, default="f32",
                   help="type of the weight matrices; norms and routers stay f32; mxfp4: routed experts "
                   "in MXFP4, other matrices q8_0, as the published gpt-oss GGUFs (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("-o", "--output", required=True, metavar="FILE.gguf", help="file to write")
    p.add_argument("--force", action="store_true", help="overwrite FILE.gguf if it exists")
    sizes = p.add_argument_group("size overrides")
    for flag, text in _SIZE_FLAGS:
        sizes.add_argument(flag, type=int, metavar="N", help=text)
    rope = p.add_argument_group("RoPE scaling (gpt-oss)")
    rope.add_argument("--rope-scaling", choices=("none", "yarn"), default="none",
                      help="write YaRN RoPE scaling, as the published gpt-oss files have it (default none)")
    rope.add_argument("--rope-scaling-factor", type=float, metavar="F",
                      help="YaRN context extension factor (default 32, as published)")
    rope.add_argument("--rope-original-context", type=int, metavar="N",
                      help="YaRN: the context length before extension (default 4096, as published)")
    p.add_argument("--mtp", action="store_true",
                   help="qwen35moe: add the multi-token-prediction block (blk.N.nextn.*, nextn_predict_layers 1) "
                   "the published files have; llama.cpp loads it, the engine never executes it")
    p.set_defaults(func=run_synth)

    p = subparsers.add_parser(
        "info", help="describe a MoE GGUF or a slice: shapes, expert slab size, types, fingerprint",
        description="Print a MoE GGUF's architecture, sizes, bytes per expert slab (gate+up+down "
        "of one expert in one layer), the share of the file that routed experts make up, the "
        "model fingerprint and the type of every tensor group. For a slice (kvasir slice, a "
        "volunteer's download): the source's fingerprint and shapes, and the experts it holds.",
        epilog="example: kvasir info models/small-qwen3moe-q4_k.gguf --json")
    p.add_argument("file", metavar="FILE.gguf")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_info)


def run_synth(args: argparse.Namespace) -> int:
    from synth import model as synth

    overrides = {flag.lstrip("-").replace("-", "_"): getattr(args, flag.lstrip("-").replace("-", "_"))
                 for flag, _ in _SIZE_FLAGS}
    cfg = synth.make_config(args.arch, args.preset, args.qtype, args.seed, rope_scaling=args.rope_scaling,
                            rope_scaling_factor=args.rope_scaling_factor,
                            rope_original_context=args.rope_original_context, mtp=args.mtp, **overrides)
    if Path(args.output).exists() and not args.force:
        raise UsageError(f"{args.output} exists: give --force to overwrite it")
    progress = _ProgressLine() if sys.stderr.isatty() else _log_progress(args.output)
    try:
        report = synth.write_model(args.output, cfg, progress=progress)
    finally:
        progress.close()
    if report.fallbacks:
        print(f"kvasir synth: warning: {_fallback_summary(report.fallbacks)}", file=sys.stderr)
    layers = f"{cfg.layers} layer" + ("s" if cfg.layers != 1 else "") + (" + an MTP block" if cfg.mtp else "")
    print(f"wrote {report.path}: {_size(report.file_bytes)}, {cfg.arch} {cfg.preset} {cfg.qtype}, "
          f"{layers} x {cfg.experts} experts (top-{cfg.experts_used}), hidden {cfg.hidden}, "
          f"expert FFN {cfg.expert_ffn}, seed {cfg.seed}, in {report.seconds:.1f} s")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from synth.model import describe_model

    info = describe_slice(args.file)
    if info is not None:
        return _print_slice(args, info)
    info = describe_model(args.file)
    if args.json:
        print(json.dumps(info, sort_keys=False))
        return 0
    used = info["experts_used"]
    rows = [
        ("file", f"{args.file} ({_size(info['file_bytes'])})"),
        ("architecture", info["architecture"]),
        ("layers", f"{info['layers']}" + (f" ({info['layers'] - info['mtp_layers']} + {info['mtp_layers']} "
                                          "multi-token-prediction, never executed)" if info["mtp_layers"] else "")),
        ("experts", f"{info['experts']}" + (f" ({used} used per token)" if used else "")),
        ("hidden", info["hidden"]),
        ("expert FFN", info["expert_ffn"]),
        ("expert slab", f"{info['expert_slab_bytes']:,} bytes (gate+up+down of one expert, one layer)"
         + (f"; up to {info['expert_slab_bytes_max']:,} in other layers"
            if info["expert_slab_bytes_max"] != info["expert_slab_bytes"] else "")),
        ("expert share", f"{100 * info['expert_share']:.1f}% of the file is routed experts"),
        ("fingerprint", info["fingerprint"]),
    ]
    for key, value in rows:
        print(f"{key:<13} {value}")
    print("tensor types:")
    for group, types in info["tensor_types"].items():
        print(f"  {group}: " + ", ".join(f"{t} ({_count(n)})" for t, n in types.items()))
    return 0


def describe_slice(path: str) -> dict | None:
    """What ``kvasir info`` shows for a slice (``kvasir slice``, a volunteer's download), or
    None when ``path`` is not a slice.

    The keys of :func:`synth.model.describe_model` with the *source's* shapes (layers, experts
    per layer, hidden, expert FFN; the slice records them) and its fingerprint (the ``<model>``
    of the bus subjects), plus ``slice``: format version, source name, holdings as people read
    them (inclusive ``L<layer>:<first>-<last>``), experts held and their bytes.
    ``experts_used`` is None: a slice does not record top-k. Raises ModelFileError for a file
    that says it is a slice but is not a valid one.
    """
    from gguf import GGMLQuantizationType

    from kernels.tensors import open_gguf
    from modelfile.slice_file import KEYS, slice_from_reader

    reader = open_gguf(path)
    if KEYS.VERSION not in reader.fields:
        return None
    sl = slice_from_reader(reader, str(path))
    source_name = reader.fields.get(KEYS.SOURCE_NAME)
    slabs = {}  # layer -> bytes of one expert's gate+up+down there
    types: dict[str, dict[str, int]] = {}
    for h in sl.holdings:
        slabs.setdefault(h.layer, sum(t.nbytes for t in sl.expert_weights(h.layer, h.lo)))
    for layer, triple in sorted(sl.types.items()):
        for kind, t in zip(("gate", "up", "down"), triple):
            group = types.setdefault(f"ffn_{kind}_exps", {})
            name = GGMLQuantizationType(int(t)).name.lower()
            group[name] = group.get(name, 0) + 1
    file_bytes = Path(path).stat().st_size
    return {
        "architecture": sl.arch,
        "layers": sl.n_layer,
        "experts": sl.n_expert,
        "experts_used": None,
        "hidden": sl.n_embd,
        "expert_ffn": sl.n_ff,
        "expert_slab_bytes": next(iter(slabs.values())),
        "expert_slab_bytes_max": max(slabs.values()),
        "expert_share": sl.nbytes / file_bytes,
        "fingerprint": sl.fingerprint,
        "file_bytes": file_bytes,
        "tensor_types": types,
        "slice": {
            "version": int(reader.fields[KEYS.VERSION].contents()),
            "source_fingerprint": sl.fingerprint,
            "source_name": source_name.contents() if source_name is not None else None,
            "holdings": [str(h) for h in sl.holdings],
            "experts_held": sl.n_held,
            "expert_bytes": sl.nbytes,
        },
    }


def _print_slice(args: argparse.Namespace, info: dict) -> int:
    if args.json:
        print(json.dumps(info, sort_keys=False))
        return 0
    sl = info["slice"]
    source = sl["source_fingerprint"] + (f" ({sl['source_name']})" if sl["source_name"] else "")
    rows = [
        ("file", f"{args.file} ({_size(info['file_bytes'])})"),
        ("kind", f"slice (format {sl['version']}) of model {source}"),
        ("holdings", " ".join(sl["holdings"]) + f"  ({sl['experts_held']} experts, "
         f"{_size(sl['expert_bytes'])}; inclusive ranges)"),
        ("architecture", info["architecture"]),
        ("layers", f"{info['layers']} in the source"),
        ("experts", f"{info['experts']} per layer in the source"),
        ("hidden", info["hidden"]),
        ("expert FFN", info["expert_ffn"]),
        ("expert slab", f"{info['expert_slab_bytes']:,} bytes (gate+up+down of one expert, one layer)"
         + (f"; up to {info['expert_slab_bytes_max']:,} in other layers"
            if info["expert_slab_bytes_max"] != info["expert_slab_bytes"] else "")),
        ("fingerprint", f"{info['fingerprint']} (the source's: the slice serves kvasir."
         f"{info['fingerprint']}.x.*)"),
    ]
    for key, value in rows:
        print(f"{key:<13} {value}")
    print("tensor types (per layer held):")
    for group, types in info["tensor_types"].items():
        print(f"  {group}: " + ", ".join(f"{t} ({n} layer{'s' if n != 1 else ''})" for t, n in types.items()))
    return 0


def _fallback_summary(fallbacks: dict[str, tuple[str, str]]) -> str:
    """One line: which tensor groups could not take the asked type, and what they got."""
    from synth.model import tensor_group

    groups: dict[tuple[str, str, str], int] = {}
    for name, (asked, got) in fallbacks.items():
        key = (tensor_group(name), asked, got)
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{g} ({_count(n)}) {asked} -> {got}" for (g, asked, got), n in groups.items()]
    return ("rows not a multiple of the type's block size, these tensors fell back: "
            + "; ".join(parts))


def _count(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _log_progress(output: str):
    """Not on a terminal (CI, a pipe): a JSON log line on stderr every 10% or 10 s, once the
    file has taken 2 s (a tiny model is written before anyone wonders)."""
    from kvasir_bus.logs import configure
    from kvasir_bus.progress import LogProgress

    configure("info")
    return LogProgress("synth_progress", unit="bytes", after_s=2.0, output=output)


class _ProgressLine:
    """A ``\\r`` progress line on stderr, at most ten updates a second."""

    def __init__(self) -> None:
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int, name: str) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        self._shown = True
        pct = 100 * done / total if total else 100
        sys.stderr.write(f"\r\x1b[K{_size(done)} / {_size(total)} ({pct:.0f}%)  {name}")
        sys.stderr.flush()

    def close(self) -> None:
        if self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
