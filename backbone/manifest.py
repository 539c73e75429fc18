"""The backbone's manifest of a model: where every expert slab lies, and its SHA-256.

A volunteer downloads its experts from an untrusted place (a mirror, a CDN, HuggingFace, the
backbone's own HTTP server through a proxy). What makes the bytes trustworthy is this
manifest, which the backbone answers on ``kvasir.<model>.manifest``: one
:class:`~kvasir_bus.market_codec.SlabRef` per (layer, expert, gate|up|down) with its absolute
offset, size and SHA-256 in the backbone's own GGUF. A worker refuses any slab whose digest
differs. Models whose experts carry bias rows (gpt-oss) also get one slab per expert and
``*_bias`` kind: its row of ``blk.L.ffn_{kind}_exps.bias`` (F32, contiguous in the (rows, E)
tensor). A split GGUF (``name-00001-of-00003.gguf``) lists its parts, and each slab names
the part its offset is in.

Hashing a large model takes a while (about 1 GB/s per core), so :func:`build_manifest`
streams each tensor through a bounded buffer on a few threads (hashlib releases the GIL) and
caches the result next to the model as ``FILE.gguf.kvasir-manifest``, keyed by the model's
fingerprint, size and modification time: a restart reads the cache instead of rehashing.

:func:`serve_manifest` answers manifest requests on the bus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import msgpack
import structlog

from kvasir_bus import market_codec
from kvasir_bus.codec import CodecError
from kvasir_bus.errors import KvasirError, ModelFileError
from kvasir_bus.market_codec import Manifest, ManifestPart, SlabRef
from kvasir_bus.subjects import Subjects

log = structlog.get_logger("kvasir.manifest")

CACHE_SUFFIX = ".kvasir-manifest"
CACHE_VERSION = 2  # 2: bias-row slabs and split parts
CHUNK_BYTES = 8 << 20  # the read buffer of one hashing thread

Progress = Callable[[int, int], None]  # (bytes hashed, bytes to hash)


def cache_path_for(model_path: str | os.PathLike) -> str:
    return os.fspath(model_path) + CACHE_SUFFIX


def build_manifest(path: str | os.PathLike, *, source_url: str = "", cache: bool = True,
                   cache_path: str | os.PathLike | None = None, threads: int | None = None,
                   progress: Progress | None = None) -> Manifest:
    """The manifest of the MoE GGUF at ``path`` (every expert slab of every layer; any part
    of a split GGUF stands for all of them).

    ``source_url`` is put in the manifest (where volunteers may fetch the file; "" = nowhere).
    With ``cache`` the result is read from / written to ``cache_path`` (default
    ``PATH.kvasir-manifest``); a cache whose fingerprint, size or mtime differ is rebuilt.
    An unwritable cache location is logged and otherwise ignored.
    """
    from modelfile.slicer import plan_slice
    from kernels.tensors import open_gguf

    path = os.fspath(path)
    plan = plan_slice(path, [(None, None)])  # validates the model: every expert tensor, shapes
    reader = open_gguf(path)
    files = [os.fspath(p) for p in getattr(reader, "paths", [path])]  # the parts of a split GGUF
    stats = [os.stat(f) for f in files]
    key = {"fingerprint": plan.fingerprint, "size": [st.st_size for st in stats],
           "mtime_ns": [st.st_mtime_ns for st in stats]}
    where = os.fspath(cache_path) if cache_path is not None else cache_path_for(path)
    if cache:
        cached = _read_cache(where, key)
        if cached is not None:
            log.debug("manifest_cache_hit", path=where, model=cached.model)
            return dataclasses.replace(cached, source_url=source_url)

    part_of = {f: i for i, f in enumerate(files)}
    jobs = []  # (tensor, its part, expert count, bytes per expert)
    for t in plan.tensors:
        count = t.holding.count
        jobs.append((t, part_of[t.src_path or files[0]], count, t.nbytes // count))
    total = sum(t.nbytes for t, *_ in jobs)
    done = [0]

    def on_bytes(n: int) -> None:  # called from the hashing threads; progress is advisory
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    workers = threads or max(1, min(4, os.cpu_count() or 1))
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="manifest-hash") as pool:
            results = list(pool.map(lambda job: _hash_tensor(fds[job[1]], files[job[1]], job[0], *job[2:],
                                                             on_bytes), jobs))
    finally:
        for fd in fds:
            os.close(fd)
    slabs = []
    for (t, part, count, nb2), digests in zip(jobs, results):
        kind = f"{t.kind}_bias" if t.bias else t.kind
        for i, digest in enumerate(digests):
            slabs.append(SlabRef(t.holding.layer, t.holding.lo + i, kind, t.src_offset + i * nb2,
                                 nb2, digest, part))
    offsets = [int(r.data_offset) for r in getattr(reader, "parts", [reader])]
    parts = tuple(ManifestPart(os.path.basename(f), st.st_size, off)
                  for f, st, off in zip(files, stats, offsets)) if len(files) > 1 else ()
    manifest = Manifest(model=plan.fingerprint, arch=plan.arch, n_layer=plan.n_layer,
                        n_expert=plan.n_expert, n_embd=plan.n_embd, n_ff=plan.n_ff,
                        file_bytes=stats[0].st_size, data_offset=offsets[0],
                        source_url="", slabs=tuple(slabs), parts=parts)
    if cache:
        _write_cache(where, key, manifest)
    log.info("manifest_built", model=manifest.model, slabs=len(slabs), bytes=total, cached=cache)
    return dataclasses.replace(manifest, source_url=source_url)


def _hash_tensor(fd: int, path: str, t, count: int, nb2: int, on_bytes) -> list[str]:
    """SHA-256 of each of ``count`` consecutive ``nb2``-byte slabs starting at t.src_offset."""
    chunk = min(CHUNK_BYTES, nb2)
    digests = []
    pos = t.src_offset
    for _ in range(count):
        h = hashlib.sha256()
        left = nb2
        while left:
            data = os.pread(fd, min(left, chunk), pos)
            if not data:
                raise ModelFileError(f"{path}: ended early at byte {pos} while hashing {t.name} "
                                     "(was the file changed?)")
            n = len(data)
            h.update(data)
            pos += n
            left -= n
            on_bytes(n)
        digests.append(h.hexdigest())
    return digests


def _read_cache(where: str, key: dict) -> Manifest | None:
    try:
        with open(where, "rb") as f:
            body = msgpack.unpackb(f.read(), raw=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, msgpack.UnpackException) as exc:
        log.warning("manifest_cache_unreadable", path=where, error=str(exc))
        return None
    if not isinstance(body, dict) or body.get("v") != CACHE_VERSION:
        return None
    if any(body.get(k) != v for k, v in key.items()):
        log.info("manifest_cache_stale", path=where)
        return None
    try:
        manifest = market_codec.decode_manifest(body.get("manifest", b""), max_bytes=1 << 30)
    except CodecError as exc:
        log.warning("manifest_cache_corrupt", path=where, error=str(exc))
        return None
    return manifest if manifest.model == key["fingerprint"] else None


def _write_cache(where: str, key: dict, manifest: Manifest) -> None:
    payload = msgpack.packb({"v": CACHE_VERSION, **key, "manifest": manifest.encode()}, use_bin_type=True)
    tmp = f"{where}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(payload)
        os.replace(tmp, where)
    except OSError as exc:
        log.warning("manifest_cache_not_written", path=where, error=exc.strerror or str(exc))
        try:
            os.unlink(tmp)
        except OSError:
            pass


async def serve_manifest(nc, manifest: Manifest, tally=None):
    """Answer ``kvasir.<model>.manifest`` requests with ``manifest``; returns the subscription
    (``await sub.unsubscribe()`` to stop). The payload is encoded once, here. ``tally``
    (a :class:`kvasir_bus.micro.Tally`) counts the requests for ``$SRV.STATS``."""
    payload = manifest.encode()
    limit = getattr(nc, "max_payload", 0) or 0
    if limit and len(payload) > limit:
        raise KvasirError(f"the manifest of {manifest.model} is {len(payload)} bytes, over the bus' "
                          f"max_payload of {limit}: raise max_payload (deploy/nats.conf sets 8 MB)")
    headers = market_codec.headers_for(manifest)
    subject = Subjects(manifest.model).manifest()
    served = log.bind(model=manifest.model)

    async def on_request(msg) -> None:
        if not msg.reply:
            return
        t0 = time.perf_counter()
        try:
            await nc.publish(msg.reply, payload, headers=headers)
        except Exception as exc:  # the asker is gone or the bus hiccuped; keep serving
            served.warning("manifest_reply_failed", error=str(exc))
            tally is None or tally.record(time.perf_counter() - t0, str(exc))
            return
        tally is None or tally.record(time.perf_counter() - t0)
        served.debug("manifest_served", bytes=len(payload))

    sub = await nc.subscribe(subject, cb=on_request)
    await nc.flush()
    served.info("manifest_serving", subject=subject, slabs=len(manifest.slabs), bytes=len(payload))
    return sub
