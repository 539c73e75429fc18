"""Self-enrolment: a worker with a memory budget and a source asks the market for work.

``kvasir worker --nats URL --budget 340MB --source PATH_OR_URL``::

    source   -> the header, which names the model (ranged reads)  workers.source.identify
                (every part's header for a split GGUF)             workers.download.identify_parts
    bus      -> kvasir.<model>.manifest          (the backbone)   SHA-256 of every slab
    bus      -> kvasir.<model>.market.volunteer  (the market)     the scarcest range that fits
    source   -> only the assigned slabs, each verified             workers.download
    disk     -> the slice, loaded                                  modelfile.slice_file.load_slice

then the caller serves the slice with :class:`workers.runtime.Worker`. Every way this can
fail ends in one clear :class:`~kvasir_bus.errors.KvasirError` line: no backbone or no market
answers for the model, the budget cannot hold one expert, the source differs from the
backbone's model, a slab fails verification.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import threading
from dataclasses import dataclass, replace

import nats.errors
import structlog

from kvasir_bus import market_codec, micro
from kvasir_bus.codec import CodecError, ErrorReply
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.market_codec import Assignment, Manifest, VolunteerRequest
from kvasir_bus.subjects import Subjects
from workers.verify import ask_manifest
from workers.download import (DownloadResult, download_slice, identify_parts, model_of, plan_download,
                              progress_for)
from modelfile.slice_file import SliceInfo
from workers.source import Identity, identify, open_source

log = structlog.get_logger("kvasir.volunteer")

TOKEN_ENV = "KVASIR_NODE_TOKEN"
CACHE_ENV = "KVASIR_CACHE_DIR"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """``340MB`` -> 340,000,000; ``1.5GiB`` -> 1,610,612,736; ``5308416`` -> 5,308,416.

    Units: B, kB/MB/GB/TB (powers of 1000; the B may be left out), KiB/MiB/GiB/TiB (powers
    of 1024), case-insensitive.
    """
    m = _SIZE.match(str(text))
    if m is None:
        raise UsageError(f"size {text!r}: expected a number of bytes with an optional unit, "
                         "like 340MB, 1.5GiB or 5308416")
    number, prefix, binary, _ = m.groups()
    if binary and not prefix:
        raise UsageError(f"size {text!r}: 'i' needs a prefix (KiB, MiB, GiB, TiB)")
    base = 1024 if binary else 1000
    value = int(float(number) * base ** _POWERS[prefix.lower()])
    if value <= 0:
        raise UsageError(f"size {text!r} must be more than 0 bytes")
    return value


def default_cache_dir() -> str:
    """``$KVASIR_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvasir``, else ``~/.cache/kvasir``."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvasir")


@dataclass(frozen=True)
class VolunteerConfig:
    source: str  # a GGUF path or an http(s) URL
    budget_bytes: int
    node: str
    token: str | None = None  # node token for the weights server
    cache_dir: str = ""  # "" = default_cache_dir()
    request_timeout_s: float = 5.0  # manifest and market requests
    http_timeout_s: float = 30.0
    retries: int = 5  # dropped connections retried in a row before giving up


@dataclass(frozen=True, eq=False)
class Volunteered:
    slice: SliceInfo
    assignment: Assignment
    manifest: Manifest
    identity: Identity  # of the source given (for a split GGUF: its part)
    download: DownloadResult
    fetched: int  # every byte taken from the source: header and slabs (of every part)
    parts: tuple[Identity, ...] = ()  # every part of a split GGUF, in order (empty: one file)


class NoFitError(KvasirError):
    """The budget cannot hold even one expert of the model."""


def smallest_expert(manifest: Manifest) -> int:
    return min(manifest.expert_bytes(layer) for layer in manifest.moe_layers)


async def volunteer(nc, cfg: VolunteerConfig, *, progress=None,
                    cancel: threading.Event | None = None) -> Volunteered:
    """Identify the source, get the manifest and an assignment, download and load the slice."""
    if cfg.budget_bytes <= 0:
        raise UsageError(f"--budget must be positive, got {cfg.budget_bytes}")
    cache_dir = cfg.cache_dir or default_cache_dir()
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the cache directory {cache_dir}: {exc.strerror or exc}") from None

    def open_part(spec: str):
        return open_source(spec, token=cfg.token, timeout=cfg.http_timeout_s, node=cfg.node)

    source = await asyncio.to_thread(open_part, cfg.source)
    sources = [source]
    try:
        identity = await asyncio.to_thread(identify, source)
        sources, idents = await asyncio.to_thread(identify_parts, cfg.source, source, identity, open_part)
        model = model_of(idents)
        vlog = log.bind(node=cfg.node, model=model)
        vlog.info("source_identified", source=source.name, size=sum(i.size for i in idents),
                  parts=len(idents), header_bytes=sum(i.header_bytes for i in idents),
                  fetched=sum(i.fetched_header for i in idents), requests=sum(i.requests for i in idents))
        subjects = Subjects(model)

        manifest = await ask_manifest(nc, model, cfg.request_timeout_s)
        smallest = smallest_expert(manifest)
        if cfg.budget_bytes < smallest:
            raise NoFitError(_no_fit(model, cfg.budget_bytes, smallest))

        assignment = await _ask_market(nc, subjects, model, cfg, smallest)
        plan = plan_download(idents, manifest, assignment.holdings)
        if plan.slab_bytes > cfg.budget_bytes:
            raise KvasirError(f"the market assigned {plan.slab_bytes:,} bytes of experts of {model}, "
                              f"over the budget of {cfg.budget_bytes:,} bytes; refusing")
        vlog.info("assigned", holdings=[str(h) for h in assignment.holdings], bytes=plan.slab_bytes,
                  experts=assignment.n_experts, reward_rate=assignment.reward_rate)

        result = await asyncio.to_thread(download_slice, sources, plan, cache_dir,
                                         cache=[i.cache for i in idents], progress=progress,
                                         retries=cfg.retries, cancel=cancel)
    finally:
        for src in sources:
            await asyncio.to_thread(src.close)
    done = Volunteered(result.slice, assignment, manifest, identity, result, sum(s.fetched for s in sources),
                       tuple(idents) if len(idents) > 1 else ())
    vlog.info("slice_ready", path=result.path, slab_bytes=result.slab_bytes, fetched=done.fetched,
              fetched_slabs=result.fetched, reused=result.reused, seconds=round(result.seconds, 3),
              retries=result.retries)
    return done


async def _ask_market(nc, subjects: Subjects, model: str, cfg: VolunteerConfig,
                      smallest: int, *, patience_s: float = 60.0, no_market_s: float = 2.0) -> Assignment:
    """Ask for an assignment. Refusals that mean "not yet" (the market is warming up after a
    restart, has not fetched the manifest yet, or hit an internal error) are retried with
    backoff for up to ``patience_s``; "no responders" is retried for ``no_market_s`` (a market
    that just resubscribed can be missed for a moment) before it counts as no market."""
    subject = subjects.volunteer(cfg.node)  # its own subject: under creds the only one it may use
    req = VolunteerRequest(model=model, node=cfg.node, budget_bytes=cfg.budget_bytes)
    loop = asyncio.get_running_loop()
    start, delay = loop.time(), 0.25
    while True:
        waited = loop.time() - start
        try:
            msg = await nc.request(subject, req.encode(), timeout=cfg.request_timeout_s,
                                   headers=market_codec.headers_for(req))
        except nats.errors.NoRespondersError:
            if waited < no_market_s:
                await asyncio.sleep(min(delay, 0.5))
                delay = min(2 * delay, 2.0)
                continue
            raise KvasirError(f"no market answers for model {model} (nobody answers {subject}): start "
                              "a market on this bus") from None
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            raise KvasirError(f"no market answers for model {model}: {subject} got no reply within "
                              f"{cfg.request_timeout_s:g} s (under creds written before volunteer "
                              "subjects named the node, the server refuses it: kvasir creds refresh DIR)") from None
        try:
            reply = market_codec.decode_volunteer_reply(msg.data)
        except CodecError as exc:
            raise KvasirError(f"the market's reply is malformed: {exc}") from None
        if isinstance(reply, ErrorReply):
            if reply.code == market_codec.ERR_NO_FIT:
                raise NoFitError(_no_fit(model, cfg.budget_bytes, smallest, reply.message))
            if market_codec.should_retry(reply) and waited < patience_s:
                log.info("market_not_ready", model=model, code=reply.code, retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
                continue
            raise KvasirError(f"the market refused to assign experts of {model}: {reply.code}: {reply.message}")
        if reply.model != model:
            raise KvasirError(f"the market assigned experts of model {reply.model}, not {model}")
        return reply


def _no_fit(model: str, budget: int, smallest: int, why: str = "") -> str:
    extra = f" (market: {why})" if why else ""
    return (f"a budget of {budget:,} bytes cannot hold even one expert of model {model}: the "
            f"smallest expert is {smallest:,} bytes ({smallest / 1e6:,.1f} MB){extra}")


async def volunteer_and_serve(cfg: VolunteerConfig, worker_cfg, url: str | None) -> int:
    """``kvasir worker --budget --source``: volunteer, then serve the slice until a signal.

    SIGTERM/SIGINT at any point ends it with 0: while connecting (bus unreachable), while
    volunteering (a download stops at its next chunk and resumes next time), while serving.
    """
    import signal

    from kvasir_bus.connect import connect_or_stop, shutdown
    from workers.runtime import Worker

    stop = asyncio.Event()
    cancel = threading.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        cancel.set()  # a download in progress stops at the next chunk (and resumes next time)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    nc = await connect_or_stop(stop, url, name=micro.connection_name("worker", worker_cfg.node))
    if nc is None:  # stopped before the bus answered
        return 0
    progress = progress_for(sys.stderr, node=worker_cfg.node)
    try:
        enrolling = asyncio.ensure_future(volunteer(nc, cfg, progress=progress, cancel=cancel))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({enrolling, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if progress is not None:
                progress.close()
        if not enrolling.done():  # stopped while volunteering: nothing to serve yet
            enrolling.cancel()
            await asyncio.gather(enrolling, return_exceptions=True)
            return 0
        got = enrolling.result()
        worker = Worker(got.slice, replace(worker_cfg, budget_bytes=cfg.budget_bytes))
        try:
            await worker.start(nc)
            await stop.wait()
        finally:
            await worker.stop()
    finally:
        await shutdown(nc)
    return 0
