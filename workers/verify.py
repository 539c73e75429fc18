"""A worker checks the experts it holds against the backbone's SHA-256 manifest before serving.

A GGUF whose tensor bytes were changed keeps its fingerprint (the fingerprint covers metadata and
the tensor table, not gigabytes of weights), so a slice cut from a damaged or doctored copy would
answer on the right subjects with wrong numbers. The manifest (``kvasir.<model>.manifest``, from
the backbone) holds the digest of every expert slab; a worker hashes each slab it holds and
refuses to start if any differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvasir_bus.market_codec import KINDS, Manifest
from modelfile.slice_file import SliceInfo


@dataclass(frozen=True)
class SlabMismatch:
    layer: int
    expert: int
    kind: str  # "gate", "up" or "down"; "missing" when the manifest has no such expert

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
        for kind, tensor in zip(KINDS, info.expert_weights(layer, expert)):
            ref = refs[kind]
            if tensor.nbytes != ref.size or hashlib.sha256(tensor.data).hexdigest() != ref.sha256:
                bad.append(SlabMismatch(layer, expert, kind))
    return bad


def describe(bad: list[SlabMismatch], limit: int = 4) -> str:
    """One line naming the first mismatches."""
    head = ", ".join(str(m) for m in bad[:limit])
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return f"{len(bad)} slab(s) differ from the backbone's manifest: {head}{more}"
