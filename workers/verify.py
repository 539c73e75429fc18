"""A worker checks the experts it holds against the backbone's SHA-256 manifest before serving.

A GGUF whose tensor bytes were changed keeps its fingerprint (the fingerprint covers metadata and
the tensor table, not gigabytes of weights), so a slice cut from a damaged or doctored copy would
answer on the right subjects with wrong numbers. The manifest (``kvasir.<model>.manifest``, from
the backbone) holds the digest of every expert slab; a worker hashes each slab it holds and
refuses to start if any differs. For gpt-oss the manifest also has each expert's bias rows,
which are checked the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

import nats.errors

from kvasir_bus import market_codec
from kvasir_bus.errors import KvasirError
from kvasir_bus.market_codec import CodecError, ErrorReply, Manifest, UnsupportedVersionError
from kvasir_bus.subjects import Subjects
from modelfile.slice_file import SliceInfo


@dataclass(frozen=True)
class SlabMismatch:
    layer: int
    expert: int
    kind: str  # a slab kind ("gate", "up_bias", ...); "missing" when the manifest has no such expert

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"layer {self.layer} expert {self.expert} is not in the manifest"
        return f"layer {self.layer} expert {self.expert} {self.kind}"


def check_slabs(info: SliceInfo, manifest: Manifest) -> list[SlabMismatch]:
    """Hash every slab ``info`` holds and compare with ``manifest``; the mismatches, in file order
    (empty when all agree)."""
    bad: list[SlabMismatch] = []
    for layer, expert in info.experts():
        try:
            refs = {ref.kind: ref for ref in manifest.slabs_for(layer, expert)}
        except KeyError:
            bad.append(SlabMismatch(layer, expert, "missing"))
            continue
        for kind, ref in refs.items():
            try:
                data = info.slab(layer, expert, kind)
            except KeyError:  # the slice lacks what the manifest has (bias rows of an old slice)
                bad.append(SlabMismatch(layer, expert, kind))
                continue
            if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
                bad.append(SlabMismatch(layer, expert, kind))
    return bad


def describe(bad: list[SlabMismatch], limit: int = 4) -> str:
    """One line naming the first mismatches."""
    head = ", ".join(str(m) for m in bad[:limit])
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return f"{len(bad)} slab(s) differ from the backbone's manifest: {head}{more}"


async def ask_manifest(nc, model: str, timeout: float) -> Manifest:
    """The backbone's manifest of ``model`` over the bus; KvasirError saying why not."""
    subject = Subjects(model).manifest()
    try:
        msg = await nc.request(subject, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        raise KvasirError(f"no backbone answers for model {model} (nobody answers {subject}): "
                          "is a backbone serving this exact model on this bus?") from None
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        raise KvasirError(f"no backbone answers for model {model}: {subject} got no reply within "
                          f"{timeout:g} s") from None
    try:
        reply = market_codec.decode_manifest_reply(msg.data)
    except UnsupportedVersionError as exc:
        raise KvasirError(f"the backbone's manifest of {model} is newer than this worker reads ({exc}): "
                          "upgrade kvasir") from None
    except CodecError as exc:
        raise KvasirError(f"the backbone's manifest of {model} is malformed: {exc}") from None
    if isinstance(reply, ErrorReply):
        raise KvasirError(f"the backbone has no manifest for {model}: {reply.code}: {reply.message}")
    if reply.model != model:
        raise KvasirError(f"asked {subject}, got the manifest of model {reply.model}")
    return reply


async def manifest_if_served(nc, model: str, timeout: float = 2.0) -> Manifest | None:
    """The manifest, or None when no backbone serves it (nobody answers, or not in time)."""
    try:
        return await ask_manifest(nc, model, timeout)
    except KvasirError as exc:
        if "no backbone answers" in str(exc):
            return None
        raise

