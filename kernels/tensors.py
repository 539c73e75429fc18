"""GGUF tensors as raw, typed byte ranges: the unit both the engine and the workers compute on.

A :class:`QTensor` is one weight tensor exactly as it lies in the GGUF: its ggml type, its
shape in ggml order (``ne``, innermost first) and its bytes (a read-only view of the
memory-mapped file; nothing is copied or dequantised). For the 3-D expert tensors
``ffn_{gate,up,down}_exps`` the expert index is ``ne[2]``, the outermost dimension, so expert
``e`` is the contiguous slab ``data[e*nb2:(e+1)*nb2]`` (:meth:`QTensor.expert`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from kvasir_bus.errors import ModelFileError


@dataclass(frozen=True, eq=False)
class QTensor:
    """One weight tensor as it lies in the GGUF. Immutable; compared and hashed by identity (its
    bytes are a memmap view: value equality would mean comparing megabytes), so a kernel can
    remember the tensors it has already validated (``kernels.checks``)."""

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length (input features)
    data: np.ndarray  # uint8, 1-D, exactly nbytes long, C-contiguous
    # What a routed expert's projection carries besides its matrix (gpt-oss; None/"swiglu" elsewhere):
    bias: np.ndarray | None = None  # float32 (ne[1],), added to every output row (llama.cpp: ggml_add_id)
    glu: str = "swiglu"  # on an expert's gate: the gated activation joining it to up (swiglu, swiglu_oai)

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.ne[0] // block * type_size

    @property
    def nbytes(self) -> int:
        rows = 1
        for n in self.ne[1:]:
            rows *= n
        return rows * self.row_bytes

    @property
    def n_expert(self) -> int:
        if len(self.ne) != 3:
            raise ValueError(f"{self.name} is not a 3-D expert tensor (ne={self.ne})")
        return self.ne[2]

    @property
    def expert_bytes(self) -> int:
        """nb[2]: the size of one expert's slab."""
        return self.ne[1] * self.row_bytes

    def expert(self, e: int, bias: np.ndarray | None = None, glu: str = "swiglu") -> "QTensor":
        """Expert ``e`` of a 3-D expert tensor, as a 2-D tensor viewing the same bytes.
        ``bias``: the expert tensor's bias rows (E, ne[1]) float32, of which row ``e`` goes along."""
        if not 0 <= e < self.n_expert:
            raise IndexError(f"{self.name}: expert {e} out of range 0..{self.n_expert - 1}")
        nb2 = self.expert_bytes
        return QTensor(f"{self.name}[{e}]", self.ggml_type, self.ne[:2], self.data[e * nb2:(e + 1) * nb2],
                       None if bias is None else bias[e], glu)

    def f32(self) -> np.ndarray:
        """Dequantised copy in numpy order (``ne`` reversed), float32."""
        from gguf.quants import dequantize

        shape = tuple(reversed(self.ne))
        if self.ggml_type == GGMLQuantizationType.F32:
            return self.data.view(np.float32).reshape(shape).copy()
        if self.ggml_type == GGMLQuantizationType.F16:
            return self.data.view(np.float16).reshape(shape).astype(np.float32)
        rows = self.data.reshape(-1, self.row_bytes)
        return dequantize(rows, self.ggml_type).reshape(shape).astype(np.float32, copy=False)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Memory-map a GGUF file, turning every way it can be unreadable into one clear error."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc.strerror}") from None
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on damage
        raise ModelFileError(f"{path}: corrupt or truncated GGUF ({type(exc).__name__}: {exc})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size:
            raise ModelFileError(
                f"{path}: truncated: tensor {t.name} needs bytes up to {t.data_offset + int(t.n_bytes)}, "
                f"file has {size}")
    return reader


def tensor_from_reader(reader: GGUFReader, name: str) -> QTensor:
    for t in reader.tensors:
        if t.name == name:
            return _qtensor(reader, t)
    raise KeyError(name)


def tensors_from_reader(reader: GGUFReader) -> dict[str, QTensor]:
    return {t.name: _qtensor(reader, t) for t in reader.tensors}


def _qtensor(reader: GGUFReader, t) -> QTensor:
    ne = tuple(int(n) for n in t.shape)
    start = int(t.data_offset)
    data = reader.data[start:start + int(t.n_bytes)]
    return QTensor(t.name, GGMLQuantizationType(int(t.tensor_type)), ne, data)
