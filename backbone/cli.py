"""``kvasir generate`` and ``kvasir verify``: the backbone on the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvasir_bus.connect import add_connection_flags
from kvasir_bus.threads import add_kernel_flags

DEFAULT_VERIFY_PROMPT = (
    "The swarm splits a mixture-of-experts model into single experts, so that a phone can carry "
    "a real share of a frontier model while the backbone keeps every expert as its fallback."
)


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text with an MoE GGUF model",
        description="Generate text with an MoE GGUF model: on this node alone, or with the expert "
        "workers on a NATS bus (--nats).",
        epilog="example: kvasir generate --model models/small-qwen3moe-q4_k.gguf --prompt 'Once upon a time' -n 16")
    p.add_argument("--model", required=True, metavar="FILE", help="the GGUF model")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt text")
    p.add_argument("-n", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="always take the most likely token (default)")
    mode.add_argument("--temperature", type=float, default=None, metavar="T", help="sample at this temperature")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    p.add_argument("--ctx", type=int, default=None, metavar="N", help="context size (default: the model's)")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--dump-logits", metavar="FILE.npy",
                   help="save the logits of every position (prompt and generated) as float32")
    add_bus_flags(p)
    add_kernel_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "verify", help="compare our engine's logits with llama.cpp's on the same tokens",
        description="Run llama.cpp and our engine on the same tokens (the prompt, then N greedy "
        "steps of our engine) and report how closely the logits agree.",
        epilog="example: kvasir verify --deterministic --model models/small-qwen3moe-q4_k.gguf")
    p.add_argument("--model", required=True, metavar="FILE", help="the GGUF model")
    p.add_argument("--prompt", default=DEFAULT_VERIFY_PROMPT, metavar="TEXT",
                   help="the prompt (default: a built-in paragraph)")
    p.add_argument("--decode", type=int, default=16, metavar="N", help="greedy steps after the prompt (default 16)")
    p.add_argument("--json", action="store_true", help="print JSON with positions, max_abs_diff, min_cosine, "
                   "argmax_agreement")
    p.add_argument("--expert-layout", choices=("repacked", "plain", "rows"), default=None,
                   help="the fast mode's routed-expert layout for this run (KVASIR_EXPERT_LAYOUT; default: "
                   "that variable, else repacked). Serving takes each expert call's layout by its rows "
                   "(repacked below 8 rows, plain from 8), which no llama.cpp setting does: 'repacked' "
                   "compares with llama.cpp's default (every expert repacked), 'plain' with llama.cpp's "
                   "experts kept plain; each is one of the two kernels serving uses, bit for bit")
    add_kernel_flags(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "ledger", help="the backbone's ledger spool",
        description="Operate on a backbone's ledger spool (won events not yet stored by the market's stream).",
        epilog="example: kvasir ledger replay --spool ~/.local/state/kvasir/spool/MODEL/NODE --nats nats://host:4222")
    ledger = p.add_subparsers(dest="ledger_command", metavar="ACTION", parser_class=type(p))
    ledger.required = True
    p = ledger.add_parser("replay", help="send a (dead) backbone's spooled wins to the ledger stream",
                          description="Send every won event a backbone's spool holds that the ledger stream "
                          "has not acknowledged, under the ids it was first sent with (the stream and the "
                          "market count each once), then compact the spool.",
                          epilog="example: kvasir ledger replay --spool DIR --nats nats://host:4222")
    p.add_argument("--spool", required=True, metavar="DIR", help="the spool directory")
    p.add_argument("--nats", metavar="URL", default=None, help="the bus (default: $NATS_URL, else local)")
    add_connection_flags(p)
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="wait this long for the stream to store everything (default 30)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_ledger_replay)


def add_bus_flags(p: argparse.ArgumentParser) -> None:
    """Flags for running against expert workers; filled in by the sharding milestone."""
    p.add_argument("--nats", metavar="URL", default=None,
                   help="dispatch experts to the workers on this NATS bus (default: all local; "
                   "NATS_URL is not read here so that a plain run stays local)")
    add_connection_flags(p)
    p.add_argument("--timeout-ms", type=float, default=None, metavar="MS",
                   help="per-expert reply timeout (default: adaptive from observed latency)")
    p.add_argument("--wire-dtype", choices=("float32", "float16"), default="float32",
                   help="rounding of rows on the wire, applied to local experts too (default float32)")
    add_audit_flags(p)
    add_replica_flags(p)
    add_spool_flag(p)


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    """``--replicas`` and ``--hot``: how the backbone uses the workers' replicas and its own experts."""
    p.add_argument("--replicas", choices=("race", "balance"), default="race",
                   help="race: every replica computes, the first reply wins; balance: the workers share "
                   "each expert in a NATS queue group (one computes) and an unanswered request is re-sent "
                   "after the p95 of that expert's latency (hedging); give the workers the same "
                   "--replicas (default race)")
    p.add_argument("--race-confirm", type=float, default=1.0, metavar="X",
                   help="race mode: once a layer step's calls are won, wait up to X times the step's round trip "
                   "for the other replicas' replies (workers past probation), so each winner is compared "
                   "with another replica before its answer is used; a disagreement is audited here and the "
                   "call recomputed. 0: use the first replies at once (a sleeper's racing lie may then be "
                   "used once before it is caught) (default 1.0)")
    p.add_argument("--bundles", choices=("on", "off"), default="on",
                   help="on: every call of a layer step for one worker goes in one message on the worker's "
                   "node subject (workers that announce bundles); off: one message per expert (default on)")
    p.add_argument("--fast-paths", choices=("on", "off"), default="on",
                   help="on: a layer step's bundles go out and their replies are read on the engine "
                   "thread's own NATS connection, other replies are handled where nats.py parses them, "
                   "and a step's requests are written to the socket in one write, wherever the "
                   "connection allows it; off: every message through nats.py's ordinary path (the same "
                   "answers, more CPU per call; to compare, or to rule them out) (default on)")
    p.add_argument("--hot", choices=("auto", "off"), default="off",
                   help="auto: compute an expert here when this node's measured cost beats its measured "
                   "round trip (a slow link costs less than a local compute); off: always ask the workers "
                   "(default off)")


def add_spool_flag(p: argparse.ArgumentParser) -> None:
    """``--spool DIR``: where won ledger events wait for the stream (backbone.spool)."""
    p.add_argument("--spool", metavar="DIR", default=None,
                   help="keep every won ledger event here until the market's stream stores it, so a "
                   "killed backbone loses none (sent on the next start, or by `kvasir ledger replay`); "
                   "default $XDG_STATE_HOME/kvasir/spool/<model>/<node>, 'off': no spool")
    p.add_argument("--sign-key", metavar="FILE", default=None,
                   help="nkey seed file (a plain SU... seed, or the backbone identity's .creds file) "
                   "that signs ledger batches, routing statistics and quarantine events; "
                   "$KVASIR_BACKBONE_SEED wins over it; neither: a fresh key per process, whose "
                   "public key is logged at start (signing_key) for `kvasir market --trust-backbone`")


def cmd_ledger_replay(args) -> int:
    import asyncio

    from backbone.market_link import replay
    from kvasir_bus.connect import connect
    from kvasir_bus.errors import KvasirError, UsageError
    from kvasir_bus.logs import configure

    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    configure("warning")

    async def run() -> dict:
        nc = await connect(args.nats, name="kvasir-ledger-replay")
        try:
            return await replay(nc, args.spool, args.timeout)
        finally:
            await nc.drain()

    got = asyncio.run(run())
    if args.json:
        print(json.dumps(got))
    else:
        print(f"spool {got['spool']} ({got['node']}, model {got['model']}): {got['replayed']} event(s) "
              f"to replay, {got['stored']} stored by the stream, {got['unsent']} left")
    if got["unsent"]:
        raise KvasirError(f"{got['unsent']} spooled record(s) not stored within {args.timeout:g} s "
                          "(is the bus up, with JetStream?); they stay in the spool")
    return 0


def add_audit_flags(p: argparse.ArgumentParser) -> None:
    """``--audit R``: how many remote replies the backbone recomputes (backbone.audit)."""
    from backbone.audit import DEFAULT_PROBATION, DEFAULT_RATE

    p.add_argument("--audit", type=float, default=DEFAULT_RATE, metavar="R",
                   help=f"fraction 0..1 of remote replies recomputed here and compared; an audited reply "
                   f"is replaced by the local result and a liar is quarantined. Every reply of a node's "
                   f"first {DEFAULT_PROBATION} is audited too; 1 makes the output exact by construction, "
                   f"0 turns audits off (default {DEFAULT_RATE})")
    p.add_argument("--reply-secret", metavar="FILE", default=None,
                   help="the deployment's reply secret (kvasir creds/enrol's DIR/trust/reply.key): a reply "
                   "naming any node counts only with that node's Kvasir-Proof (enrolled nodes get their key at "
                   "enrolment, kvasir creds workers in their credentials file), so no one can answer under "
                   "another's name; without it only self-certifying names (k..., a worker's own key) are "
                   "checked, and a chosen name is the sender's word (docs/security.md)")


def add_http_flags(p: argparse.ArgumentParser) -> None:
    """``kvasir serve --http``: the OpenAI-compatible server (backbone.server_http)."""
    p.add_argument("--http", metavar="[HOST:]PORT", default=None,
                   help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions) here "
                   "(port 0: any free port; without --nats every expert is local)")
    p.add_argument("--model-name", metavar="NAME", default=None, help="model id in the API (default: the file's stem)")
    p.add_argument("--ctx", type=int, default=None, metavar="N", help="context size (default: the model's)")
    p.add_argument("--max-active", type=int, default=None, metavar="N",
                   help="the most sequences per engine step (default 1024: memory decides, see --kv-mb)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="waiting requests beyond which the server answers 429 (default 64)")
    p.add_argument("--step-tokens", type=int, default=256, metavar="N",
                   help="tokens per engine step, decode tokens plus prompt chunks (default 256)")
    p.add_argument("--kv-mb", type=float, default=None, metavar="MB",
                   help="bound on the KV caches of the active sequences; a request is admitted while its "
                   "reserved cache (prompt + max_tokens) fits (default: half the memory available at start, "
                   "at most --max-active full contexts; the start line says what one stream costs)")
    p.add_argument("--micro-batches", type=int, default=1, metavar="N",
                   help="lanes of sequences stepped at once, on threads of their own: with 2, one computes "
                   "its attention while the other waits for its remote experts (default 1)")
    add_kernel_flags(p)  # --deterministic: the engine's kernels are batch-invariant, and the server says so


def cmd_serve_http(args) -> int:
    """``kvasir serve --http``: every expert local, or with ``--nats`` the experts go to the
    swarm (the engine gets the backbone service's remote experts) and the bus API
    ``kvasir.<model>.generate`` is served beside HTTP."""
    from kvasir_bus.errors import DependencyError

    try:
        import backbone.server_http  # noqa: F401  (aiohttp present?)
    except ImportError as exc:
        raise DependencyError(f"the HTTP server needs {exc.name} (pip install 'kvasir-bus[backbone]')") from None
    from backbone.model import Engine
    from kvasir_bus.logs import configure

    from kernels.backend import apply_kernel_flags

    server_cfg = http_config(args)  # flags checked before the model is read
    check_ctx(args.ctx)
    apply_kernel_flags(args, share=True)
    if not getattr(args, "nats", None):
        configure("info")
        engine = Engine(args.model, n_ctx=args.ctx)  # validates the file first
        check_ctx(args.ctx, engine)
        run_http(engine, args, server_cfg)
        return 0
    from backbone.service import BackboneConfig, BackboneService

    cfg = BackboneConfig.from_args(args)
    configure("info")
    engine = Engine(cfg.model_path, n_ctx=cfg.n_ctx, wire_dtype=cfg.wire_dtype)
    with BackboneService(engine, cfg) as backbone:
        run_http(engine, args, server_cfg, bus_model=backbone.model, bus_url=cfg.nats_url, node=cfg.node)
    return 0


def http_config(args):
    """The :class:`ServerConfig` of ``--http`` and the scheduler flags (model name aside)."""
    from pathlib import Path

    from backbone.scheduler import SchedulerConfig
    from backbone.server_http import ServerConfig, parse_http
    from kvasir_bus.errors import UsageError

    host, port = parse_http(args.http)
    if args.kv_mb is not None and not args.kv_mb > 0:
        raise UsageError(f"--kv-mb must be positive, got {args.kv_mb}")
    from backbone.scheduler import MAX_ACTIVE

    sched = SchedulerConfig(max_active=MAX_ACTIVE if args.max_active is None else args.max_active, max_queue=args.max_queue,
                            step_tokens=args.step_tokens,
                            kv_bytes=int(args.kv_mb * 2**20) if args.kv_mb else None,
                            deterministic=args.deterministic, micro_batches=args.micro_batches)
    return ServerConfig(host=host, port=port, model_name=args.model_name or Path(args.model).stem, scheduler=sched)


def run_http(engine, args, cfg, bus_model: str | None = None, bus_url: str | None = None,
             node: str = "backbone") -> None:
    """Serve ``engine`` (local or remote experts) over HTTP, and on the bus with ``bus_model``,
    until SIGINT/SIGTERM."""
    from dataclasses import replace

    from backbone.server_http import serve_forever
    from backbone.tokenizer import Tokenizer

    cfg = replace(cfg, bus_model=bus_model, bus_url=bus_url, node=node)
    tok = Tokenizer(args.model)
    where = f"experts on the bus, generate API on kvasir.{bus_model}.generate" if bus_model else "all experts local"
    serve_forever(engine, tok, cfg, on_ready=lambda url: print(
        f"serving {cfg.model_name} at {url}/v1 (OpenAI API; {engine.cfg.arch}, context {engine.n_ctx}, {where}, "
        f"{'deterministic, ' if cfg.scheduler.deterministic else ''}up to {cfg.scheduler.max_active} sequences "
        f"per step)", flush=True))


def check_ctx(ctx: int | None, engine=None) -> None:
    """``--ctx`` must be 1..the model's trained context (the engine would clamp a larger one
    silently); without ``engine`` only the lower bound is checked (before the model is read)."""
    from kvasir_bus.errors import UsageError

    if ctx is None:
        return
    limit = engine.cfg.n_ctx_train if engine is not None else None
    if ctx < 1 or (limit is not None and ctx > limit):
        raise UsageError(f"--ctx must be 1..{limit if limit is not None else 'the model context'}, got {ctx}")


def _sampler(args):
    from backbone.sampling import Sampler, SamplerConfig

    if args.temperature is None:
        return Sampler(SamplerConfig())
    return Sampler(SamplerConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed))


def cmd_generate(args) -> int:
    import numpy as np

    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.tokenizer import StreamDecoder, Tokenizer
    from kvasir_bus.errors import UsageError

    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
    if args.dump_logits:  # fail now, not after the whole run
        from pathlib import Path

        folder = Path(args.dump_logits).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--dump-logits {args.dump_logits}: directory {folder} does not exist")
    check_ctx(args.ctx)
    sampler = _sampler(args)
    cfg = backbone_config(args)  # flags checked before the model is read
    from kernels.backend import apply_kernel_flags

    apply_kernel_flags(args, share=True)
    engine = Engine(cfg.model_path, n_ctx=cfg.n_ctx, wire_dtype=cfg.wire_dtype)  # validates the file first
    check_ctx(args.ctx, engine)
    tok = Tokenizer(args.model)
    prompt = tok.encode(args.prompt)
    if len(prompt) + args.n > engine.n_ctx:
        raise UsageError(f"the prompt is {len(prompt)} tokens; with -n {args.n} that exceeds "
                         f"the context of {engine.n_ctx} tokens")
    stream = None if args.json else StreamDecoder(tok)

    def on_token(t: int) -> None:
        if stream is not None:
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()

    stats = ledger = None
    with _backbone_for(cfg, engine) as backbone:
        gen = generate(engine, prompt, args.n, sampler, stop_on_eos=not args.no_stop,
                       keep_logits=bool(args.dump_logits), on_token=on_token)
        if backbone is not None:
            stats = backbone.stats.to_dict()
    if stream is not None:
        sys.stdout.write(stream.flush())  # a truncated last character prints as U+FFFD, as in "text"
    if backbone is not None and backbone.market_link is not None:
        ledger = backbone.market_link.report()  # after stop: its last flush counted
    if args.dump_logits:
        np.save(args.dump_logits, gen.logits_array())
    from kernels.backend import backend_name

    result = {
        "text": tok.decode(gen.tokens),
        "tokens": gen.tokens,
        "prompt_tokens": gen.prompt,
        "stop_reason": gen.stop_reason,
        "prefill_tokens_per_s": round(len(prompt) / gen.prefill_s, 2) if gen.prefill_s else None,
        "decode_tokens_per_s": round((len(gen.tokens) - 1) / gen.decode_s, 2)
        if gen.decode_s and len(gen.tokens) > 1 else None,
        "kernel": backend_name(),
    }
    if stats:
        result["dispatch"] = stats
    if ledger:
        result["ledger"] = ledger
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[{len(prompt)} prompt tokens, {len(gen.tokens)} generated ({gen.stop_reason}); "
              f"prefill {result['prefill_tokens_per_s']} tok/s, decode {result['decode_tokens_per_s']} tok/s, "
              f"kernel {result['kernel']}]", file=sys.stderr)
        if stats:
            t = stats["totals"]
            nodes = ", ".join(f"{n} {v['calls']}" for n, v in stats["per_node"].items()) or "none"
            print(f"[experts: {t['calls']} calls, {t['remote']} remote ({nodes}), {t['local']} local "
                  f"(no responders {t['no_responders']}, timeouts {t['timeouts']}, invalid {t['invalid']})]",
                  file=sys.stderr)
    return 0


def _backbone_for(cfg, engine):
    """Nothing (all local), or the backbone on the bus when --nats is given: it dispatches the
    experts to the workers and reports to a market; it serves no manifest (``kvasir serve`` does)."""
    from contextlib import nullcontext

    if not cfg.nats_url:  # NATS_URL is not read here so that a plain run stays local
        return nullcontext(None)
    from backbone.service import BackboneService
    from kvasir_bus.logs import configure

    configure("info")
    return BackboneService(engine, cfg)


def backbone_config(args):
    """The one place ``generate``'s flags become a :class:`BackboneConfig`."""
    from backbone.service import BackboneConfig

    return BackboneConfig.from_args(args, serve_manifest=False)


def cmd_verify(args) -> int:
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.reference import Reference, compare
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.tokenizer import Tokenizer
    from kvasir_bus.errors import UsageError

    if args.decode < 0:
        raise UsageError(f"--decode must be >= 0, got {args.decode}")
    from kernels.backend import apply_kernel_flags

    apply_kernel_flags(args)
    _verify_layout(args.expert_layout)
    engine = Engine(args.model)  # validates the file first
    tok = Tokenizer(args.model)
    prompt = tok.encode(args.prompt)
    if len(prompt) + args.decode > engine.n_ctx:
        raise UsageError(f"the prompt is {len(prompt)} tokens; with --decode {args.decode} that exceeds "
                         f"the context of {engine.n_ctx} tokens")
    step = _verify_progress(args.decode, len(prompt))
    gen = generate(engine, prompt, args.decode, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True,
                   on_token=step)
    if step is not None:
        step.log.info("verify_reference", engine="llama.cpp", tokens=len(gen.all_tokens))
    from kernels.backend import kernel_settings

    ours = kernel_settings()
    # llama.cpp runs in this process on the same libggml-cpu: the same tiled-matmul switch, and
    # its weights repacked exactly when ours are (its CPU extra buffer types, its default).
    ref = Reference(args.model, n_ctx=len(gen.all_tokens) + 8, n_batch=max(32, len(gen.all_tokens)),
                    repack=ours["repack"], repack_experts=ours.get("repack_experts"))
    # batch-invariant: one batch of every position must give each row's bits; fast: the rows
    # as the generation computed them (the prompt at once, then each token alone)
    batched = ours["mode"] == "deterministic"
    logits = ref.logits(gen.all_tokens) if batched else ref.logits_as_generated(gen.all_tokens, len(prompt))
    report = compare(gen.logits_array(), logits)
    report["settings"] = {"ours": ours, "llama_cpp": {"tiled_mm": ours["tiled_mm"], "repack": ours["repack"],
                                                      "repack_experts": ours.get("repack_experts", ours["repack"]),
                                                      "expert_layout": "plain" if not ours.get("repack_experts") else
                                                      "repacked",
                                                      "flash_attn": ref.flash_attn, "threads": os.cpu_count(),
                                                      "eval": "one batch" if batched else "prompt, then one token at a time"}}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"model            {args.model} ({engine.cfg.arch}, {engine.cfg.n_layer} layers, "
              f"{engine.cfg.n_expert} experts, top-{engine.cfg.n_expert_used})")
        print(f"positions        {report['positions']} ({len(prompt)} prompt + {len(gen.tokens)} greedy)")
        print(f"max |diff|       {report['max_abs_diff']:.3g}")
        print(f"min cosine       {report['min_cosine']:.9f}")
        print(f"argmax agreement {report['argmax_agreement']:.3f}")
        print(f"kernels          ours {ours['label']} ({ours['mode']}: tiled matmul "
              f"{'on' if ours['tiled_mm'] else 'off'}, repacking {'on' if ours['repack'] else 'off'}); "
              f"llama.cpp the same switches, "
              f"flash attention {'on' if ref.flash_attn else 'off'}, {report['settings']['llama_cpp']['eval']}")
    return 0


class _VerifySteps:
    """Not on a terminal (CI, a pipe): the greedy steps of our engine as JSON log lines on
    stderr (every 10% or 10 s, :class:`~kvasir_bus.progress.LogProgress`), then one line when
    llama.cpp's run starts; a terminal gets only the report, as before."""

    def __init__(self, steps: int, prompt_tokens: int) -> None:
        import structlog

        from kvasir_bus.progress import LogProgress

        self.log = structlog.get_logger("kvasir.verify")
        self.steps, self.done = steps, 0
        self.progress = LogProgress("verify_progress", unit="steps", engine="kvasir",
                                    prompt_tokens=prompt_tokens)

    def __call__(self, _token: int) -> None:
        self.done += 1
        self.progress(self.done, self.steps)


def _verify_layout(asked: str | None) -> None:
    """Set the routed experts' layout for ``kvasir verify`` before ggml loads (``--expert-layout``,
    else KVASIR_EXPERT_LAYOUT, else ``repacked``: llama.cpp's default, which the layout rule of
    serving matches only where no expert gets 8 rows); a clear error where ggml has already
    loaded with another."""
    from kernels import ggml
    from kvasir_bus.errors import UsageError

    layout = asked or os.environ.get(ggml.ENV_EXPERT_LAYOUT) or "repacked"
    if ggml.loaded_mode() is None:
        os.environ[ggml.ENV_EXPERT_LAYOUT] = layout
    elif asked is None:  # loaded already (verify called in a process that computed): as it is
        return
    try:
        loaded = ggml.load().expert_layout if ggml.available() else layout
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if loaded != layout:
        raise UsageError(f"--expert-layout {layout} asked for after ggml loaded with {loaded}; "
                         f"set {ggml.ENV_EXPERT_LAYOUT}={layout} before the process starts")


def _verify_progress(steps: int, prompt_tokens: int) -> _VerifySteps | None:
    if sys.stderr.isatty():
        return None
    from kvasir_bus.logs import configure

    configure("info")
    return _VerifySteps(steps, prompt_tokens)
