"""Downloading a volunteer's experts: only their byte ranges, each slab verified, resumable.

The market assigns half-open holdings ``(layer, lo, hi)``. :func:`plan_download` turns them
into the slice a worker will serve (the exact layout of :mod:`modelfile.slice_file`, header
written by the same code as ``kvasir slice``) and into one :class:`SlabJob` per
(layer, expert, gate|up|down, and their bias rows for gpt-oss): where the slab lies in the
source, its SHA-256 from the backbone's manifest, and where it goes in the slice file. The
source's header must agree with the manifest (same file size, same data offset, every slab
where the manifest says), or nothing is downloaded. A split GGUF is several sources, one per
part (:func:`part_names`, :func:`identify_parts`); each slab is fetched from its part.

:func:`download_slice` writes the slice header into ``DIR/<model>.<plan>.part`` and then
streams the slabs straight to their final offsets, one ranged request per run of contiguous
slabs, hashing as the bytes land. A slab whose digest differs from the manifest's is refused
(:class:`SlabVerificationError`); the part file is never renamed into a slice, so a refused
slab is never served. Progress is kept in a sidecar ``.part.json`` (the slabs complete, and how
far into the next one), saved after an fsync of the data, so an interrupted download resumes
where it stopped, to the byte: a dropped connection is retried with backoff, and a new run of
the command picks up the part file. A finished slice is renamed to
``DIR/<model>.<plan>.slice.gguf``; asking again for the same assignment finds it, checks its
digests locally and fetches nothing. Slabs already on disk in another slice or part of the
same model are copied (after checking their digests) instead of fetched again.

Bytes fetched: the slabs, and nothing else here (the header was fetched by
:func:`workers.source.identify`, and any of its bytes that fall inside a slab are taken from
its cache).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from gguf import GGML_QUANT_SIZES

from kvasir_bus.errors import KvasirError, ModelFileError, UsageError
from gguf import GGMLQuantizationType

from kvasir_bus.market_codec import Manifest
from kvasir_bus.progress import LogProgress
from kvasir_bus.wire import Holding
from kernels.tensors import split_part_paths
from modelfile.gguf_header import split_fingerprint
from modelfile.slice_file import (KINDS, SliceInfo, has_expert_bias, load_slice, slice_bias_name,
                                  slice_tensor_name, source_bias_name, source_tensor_name)
from modelfile.slicer import SlicePlan, SliceTensor, write_slice_header
from workers.source import ByteCache, Identity, Source, TransientSourceError, identify

try:  # advisory locks: POSIX (Linux, Android, macOS); elsewhere two downloads must not share a dir
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

STATE_VERSION = 2  # 2: slabs name their part
SAVE_EVERY_S = 0.5  # the least time between two state saves while slabs complete
READ_CHUNK = 1 << 20

Progress = Callable[[int, int], None]  # (slab bytes on disk, slab bytes in all)


class DownloadError(KvasirError):
    """The download could not finish; the part file is kept so a new run resumes."""


class SlabVerificationError(DownloadError):
    """A slab's SHA-256 differs from the backbone's manifest: the slab is refused."""


@dataclass(frozen=True)
class SlabJob:
    index: int
    layer: int
    expert: int
    kind: str  # gate, up, down, or gate_bias, up_bias, down_bias (a bias row)
    src: int  # absolute offset in the source (its part)
    size: int
    sha256: str
    dst: int  # absolute offset in the slice file
    part: int = 0  # which file of a split source

    def __str__(self) -> str:
        return f"layer {self.layer} expert {self.expert} {self.kind}"


@dataclass(frozen=True)
class DownloadPlan:
    model: str
    holdings: tuple[Holding, ...]  # merged, as in the slice file
    slice_plan: SlicePlan
    header: bytes  # the slice file's header (metadata and tensor infos)
    jobs: tuple[SlabJob, ...]  # in slice-file order
    file_bytes: int  # size of the finished slice
    plan_id: str

    @property
    def slab_bytes(self) -> int:
        return sum(j.size for j in self.jobs)


@dataclass(frozen=True)
class DownloadResult:
    path: str
    slice: SliceInfo
    slab_bytes: int  # bytes of expert slabs in the slice
    fetched: int  # bytes transferred from the source by this call
    from_cache: int  # slab bytes taken from bytes fetched earlier (the header reads)
    reused: int  # slab bytes found on disk (resumed part, earlier slices)
    seconds: float
    retries: int


# -- planning ---------------------------------------------------------------------------------

def merge_holdings(holdings: Iterable[Holding]) -> tuple[Holding, ...]:
    """Market holdings -> sorted holdings with overlapping or touching ranges merged."""
    by_layer: dict[int, list[list[int]]] = {}
    for h in holdings:
        if h.hi <= h.lo:
            raise UsageError(f"empty holding: layer {h.layer} lo={h.lo} hi={h.hi} (half-open)")
        by_layer.setdefault(h.layer, []).append([h.lo, h.hi])
    out = []
    for layer in sorted(by_layer):
        merged: list[list[int]] = []
        for a, b in sorted(by_layer[layer]):
            if merged and a <= merged[-1][1]:  # overlapping or touching: [0, 4) + [4, 8)
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out += [Holding(layer, a, b) for a, b in merged]
    return tuple(out)


def part_names(name: str) -> list[str] | None:
    """The names (paths or URLs) of every part of the split GGUF ``name`` is a part of
    (``...-00002-of-00003.gguf``, any part), in order; None if it is not a split part. For a
    URL only the path's last segment changes (the query, with a token, stays)."""
    base, sep, query = name.partition("?")
    parts = split_part_paths(base)
    return None if parts is None else [p + sep + query for p in parts]


def identify_parts(spec: str, source: Source, identity: Identity, open_part: Callable[[str], Source]
                   ) -> tuple[list[Source], list[Identity]]:
    """Every part of the split GGUF that ``source`` (opened from ``spec``, a path or URL) is a
    part of, opened (``open_part(name)``) and identified, in order (``source`` itself stands
    for its own part). A source that is not a split part is returned alone. On failure the
    parts opened here are closed."""
    if identity.header.split is None:
        return [source], [identity]
    names = part_names(spec)
    _, count = identity.header.split
    if names is None or len(names) != count:
        raise ModelFileError(f"{source.name}: a part of a {count}-part split GGUF, but not named "
                             "NAME-0000i-of-0000n.gguf: cannot find the other parts")
    mine = identity.header.split[0]
    sources: list[Source] = []
    idents: list[Identity] = []
    try:
        for i, part in enumerate(names):
            if i == mine:
                sources.append(source)
                idents.append(identity)
                continue
            src = open_part(part)
            sources.append(src)
            idents.append(identify(src))
    except BaseException:
        for src in sources:
            if src is not source:
                src.close()
        raise
    return sources, idents


def model_of(idents: Sequence[Identity]) -> str:
    """The fingerprint of the model whose file(s) ``idents`` are (every part of a split one)."""
    if len(idents) == 1:
        return idents[0].fingerprint
    return split_fingerprint([i.header for i in idents], idents[0].source)


def plan_download(identity: Identity | Sequence[Identity], manifest: Manifest,
                  holdings: Iterable[Holding]) -> DownloadPlan:
    """Check the source (every part of a split one, in order) against the manifest and lay
    out the slice of ``holdings``."""
    idents = list(identity) if isinstance(identity, (list, tuple)) else [identity]
    name = idents[0].source
    model = manifest.model
    if len(idents) == 1 and idents[0].header.split is not None and idents[0].header.split[1] > 1:
        raise DownloadError(f"{name} is one part of a split GGUF: identify all its parts (identify_parts)")
    fingerprint = model_of(idents)
    if fingerprint != model:
        raise DownloadError(f"{name} is model {fingerprint}, the manifest is for {model}")

    def mismatch(what: str) -> DownloadError:
        return DownloadError(f"{name} does not match the backbone's manifest of model {model}: {what}")

    if len(idents) != max(1, len(manifest.parts)):
        raise mismatch(f"the source has {len(idents)} file(s), the manifest {max(1, len(manifest.parts))}")
    for i, ident in enumerate(idents):
        data_offset, file_bytes = manifest.part_bounds(i)
        which = f"part {i + 1}: " if manifest.parts else ""
        if ident.size != file_bytes:
            raise mismatch(f"{which}the file has {ident.size} bytes, the manifest says {file_bytes}")
        if ident.header.data_offset != data_offset:
            raise mismatch(f"{which}tensor data starts at {ident.header.data_offset}, the manifest says "
                           f"{data_offset}")
    header = idents[0].header
    held = merge_holdings(holdings)
    if not held:
        raise UsageError("nothing to download: the assignment holds no experts")
    tensors = {t.name: (part, t) for part, ident in enumerate(idents) for t in ident.header.tensors}
    arch = str(header.metadata.get("general.architecture") or manifest.arch)
    with_bias = has_expert_bias(arch)
    slice_tensors: list[SliceTensor] = []
    slabs: list[tuple[SliceTensor, int, object]] = []  # (slice tensor, expert, SlabRef)

    def where(part: int, offset: int, size: int) -> str:
        return f"{f'part {part + 1} ' if manifest.parts else ''}offset {offset} ({size} bytes)"

    def add(st: SliceTensor, part: int, start: int, nb2: int, h: Holding, kind: str) -> None:
        """Slice tensor ``st`` and its experts' slabs, checked against the manifest: ``start``
        is the source tensor's offset in file ``part``, ``nb2`` the bytes of one expert."""
        slice_tensors.append(st)
        for e in h.experts:
            try:
                ref = next(s for s in manifest.slabs_for(h.layer, e) if s.kind == kind)
            except (KeyError, StopIteration):
                raise mismatch(f"the manifest has no {kind} slab of layer {h.layer} expert {e}") from None
            if (ref.part, ref.offset, ref.size) != (part, start + e * nb2, nb2):
                raise mismatch(f"layer {h.layer} expert {e} {kind} lies at {where(part, start + e * nb2, nb2)} "
                               f"in the source, at {where(ref.part, ref.offset, ref.size)} in the manifest")
            slabs.append((st, e, ref))

    for h in held:
        if h.layer >= manifest.n_layer or h.hi > manifest.n_expert:
            raise DownloadError(f"assigned {h} lies outside model {model} ({manifest.n_layer} layers "
                                f"of {manifest.n_expert} experts)")
        for kind in KINDS:
            part, t = tensors.get(source_tensor_name(h.layer, kind), (0, None))
            if t is None or len(t.ne) != 3:
                raise mismatch(f"no 3-D tensor {source_tensor_name(h.layer, kind)}")
            ne0, ne1, n_exp = t.ne
            block, type_size = GGML_QUANT_SIZES[t.ggml_type]
            nb2 = ne1 * (ne0 // block) * type_size
            st = SliceTensor(slice_tensor_name(h.layer, kind, h.lo, h.last), h, kind, t.ggml_type,
                             (ne0, ne1, h.count), t.offset + h.lo * nb2, h.count * nb2)
            add(st, part, t.offset, nb2, h, kind)
        if with_bias:  # the held experts' bias rows, after the weights, as `kvasir slice` lays them out
            for kind in KINDS:
                part, b = tensors.get(source_bias_name(h.layer, kind), (0, None))
                if b is None or len(b.ne) != 2 or b.ggml_type != GGMLQuantizationType.F32:
                    raise mismatch(f"no F32 bias rows {source_bias_name(h.layer, kind)}")
                rows = b.ne[0]
                st = SliceTensor(slice_bias_name(h.layer, kind, h.lo, h.last), h, kind,
                                 GGMLQuantizationType.F32, (rows, h.count), b.offset + h.lo * rows * 4,
                                 h.count * rows * 4, bias=True)
                add(st, part, b.offset, rows * 4, h, f"{kind}_bias")
    gname = header.metadata.get("general.name")
    plan = SlicePlan(source=_display_name(name), fingerprint=model, arch=arch,
                     name=gname if isinstance(gname, str) else "", alignment=header.alignment,
                     n_layer=manifest.n_layer, n_expert=manifest.n_expert, n_embd=manifest.n_embd,
                     n_ff=manifest.n_ff, holdings=held, tensors=tuple(slice_tensors))
    head = slice_header_bytes(plan)
    # the data layout of slicer._copy_data: each tensor at the next multiple of the alignment
    pos = len(head)
    offsets = {}
    for st in slice_tensors:
        pos += -pos % plan.alignment
        offsets[st.name] = pos
        pos += st.nbytes
    pos += -pos % plan.alignment
    jobs = []
    for i, (st, e, ref) in enumerate(slabs):
        jobs.append(SlabJob(i, st.holding.layer, e, ref.kind, ref.offset, ref.size, ref.sha256,
                            offsets[st.name] + (e - st.holding.lo) * ref.size, ref.part))
    digest = hashlib.sha256(head)
    for j in jobs:
        digest.update(f"{j.layer},{j.expert},{j.kind},{j.part},{j.src},{j.size},{j.sha256},{j.dst}\n".encode())
    return DownloadPlan(model, held, plan, head, tuple(jobs), pos, digest.hexdigest()[:12])


def slice_header_bytes(plan: SlicePlan) -> bytes:
    """The slice header ``kvasir slice`` would write for ``plan`` (through its own writer)."""
    with tempfile.TemporaryDirectory(prefix="kvasir-header-") as tmp:
        path = os.path.join(tmp, "header.gguf")
        write_slice_header(plan, path)
        with open(path, "rb") as f:
            return f.read()


def _display_name(name: str) -> str:
    base = name.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return base or name


# -- downloading ------------------------------------------------------------------------------

def slice_paths(cache_dir: str, plan: DownloadPlan) -> tuple[str, str, str]:
    """(part file, its state sidecar, finished slice) of ``plan`` in ``cache_dir``."""
    stem = os.path.join(cache_dir, f"{plan.model}.{plan.plan_id}")
    return stem + ".part", stem + ".part.json", stem + ".slice.gguf"


def download_slice(source: Source | Sequence[Source], plan: DownloadPlan, cache_dir: str | os.PathLike, *,
                   cache: ByteCache | Sequence[ByteCache] | None = None, progress: Progress | None = None,
                   retries: int = 5, backoff_s: float = 0.5,
                   cancel: threading.Event | None = None) -> DownloadResult:
    """Download ``plan``'s slabs from ``source`` into a slice in ``cache_dir`` (see module doc).

    ``source``: one per file of the model (the parts of a split GGUF, in order), as planned.
    ``cache``: bytes fetched earlier from the same source (the header reads), one per file.
    ``retries``: how many times in a row a dropped connection is retried before giving up
    (the part file stays; calling again resumes). ``cancel``: set it (from another thread)
    to stop at the next chunk with a :class:`DownloadError`; the part file stays.
    """
    cache_dir = os.fspath(cache_dir)
    if not os.path.isdir(cache_dir):
        raise UsageError(f"cache directory {cache_dir} does not exist")
    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    caches = (list(cache) if isinstance(cache, (list, tuple)) else [cache or ByteCache()])
    caches += [ByteCache() for _ in range(len(sources) - len(caches))]
    if any(j.part >= len(sources) for j in plan.jobs):
        raise UsageError(f"the plan has slabs in {1 + max(j.part for j in plan.jobs)} files, "
                         f"{len(sources)} source(s) given")
    part, state_path, final = slice_paths(cache_dir, plan)
    with _Lock(part + ".lock"):
        return _Download(sources, plan, part, state_path, final, caches, progress,
                         retries, backoff_s, cancel).run()


class _Lock:
    def __init__(self, path: str) -> None:
        self.path, self.fd = path, -1

    def __enter__(self) -> "_Lock":
        if fcntl is not None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # another download of the same slice: wait for it
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:  # the lock file stays: unlinking it would let a third process in
            os.close(self.fd)


class _Download:
    def __init__(self, sources: list[Source], plan: DownloadPlan, part: str, state_path: str, final: str,
                 caches: list[ByteCache], progress: Progress | None, retries: int, backoff_s: float,
                 cancel: threading.Event | None) -> None:
        self.sources, self.plan = sources, plan
        self.part, self.state_path, self.final = part, state_path, final
        self.caches, self.progress = caches, progress
        self.retries, self.backoff_s = retries, backoff_s
        self.cancel = cancel
        self.done: set[int] = set()
        self.done_bytes = 0  # bytes of the slabs in self.done
        self.partial: tuple[int, int] | None = None  # (job index, bytes of it on disk)
        self.fd = -1
        self.fetched0 = self._fetched()
        self.from_cache = 0
        self.reused = 0
        self.retried = 0
        self.last_save = 0.0
        self.t0 = time.perf_counter()

    # the whole flow ----------------------------------------------------------------------------
    def run(self) -> DownloadResult:
        existing = self._finished_slice()
        if existing is not None:
            return self._result(existing)
        self._open_part()
        try:
            self._download_all()
            os.fsync(self.fd)
        except BaseException:
            self._save_state(force=True)
            raise
        finally:
            self._close()
        os.replace(self.part, self.final)
        _unlink(self.state_path)
        try:
            info = self._check_final()
        except BaseException:
            _unlink(self.final)
            raise
        return self._result(info)

    def _fetched(self) -> int:
        return sum(src.fetched for src in self.sources)

    def _result(self, info: SliceInfo) -> DownloadResult:
        return DownloadResult(self.final, info, self.plan.slab_bytes, self._fetched() - self.fetched0,
                              self.from_cache, self.reused, time.perf_counter() - self.t0, self.retried)

    def _finished_slice(self) -> SliceInfo | None:
        """The slice of this plan, if a previous run finished it and it still verifies."""
        if not os.path.exists(self.final):
            return None
        try:
            with open(self.final, "rb") as f:
                if f.read(len(self.plan.header)) != self.plan.header:
                    return None
                fd = f.fileno()
                if os.fstat(fd).st_size != self.plan.file_bytes:
                    return None
                if any(_digest(fd, j.dst, j.size) != j.sha256 for j in self.plan.jobs):
                    return None
            info = self._check_final()
        except (OSError, ModelFileError):
            return None
        self.reused = self.done_bytes = self.plan.slab_bytes
        self._report()
        return info

    def _check_final(self) -> SliceInfo:
        info = load_slice(self.final)
        if info.fingerprint != self.plan.model or info.holdings != self.plan.holdings:
            raise ModelFileError(f"{self.final}: read back other holdings or fingerprint than planned (bug)")
        for job in self.plan.jobs[:1] + self.plan.jobs[-1:]:
            if hashlib.sha256(info.slab(job.layer, job.expert, job.kind)).hexdigest() != job.sha256:
                raise ModelFileError(f"{self.final}: {job} reads back wrong from the slice (bug)")
        return info

    # the part file and its state ---------------------------------------------------------------
    def _open_part(self) -> None:
        state = self._load_state()
        fresh = state is None
        if fresh:
            tmp = f"{self.part}.{secrets.token_hex(4)}.tmp"
            with open(tmp, "wb") as f:
                f.write(self.plan.header)
                f.truncate(self.plan.file_bytes)
            os.replace(tmp, self.part)
            _unlink(self.state_path)
        self.fd = os.open(self.part, os.O_RDWR)
        if not fresh:
            done, partial = state
            for i in sorted(done):  # complete on an earlier run: check them again, locally
                job = self.plan.jobs[i]
                if _digest(self.fd, job.dst, job.size) == job.sha256:
                    self._complete(job)
                    self.reused += job.size
            if partial is not None and partial[0] not in self.done:
                self.partial = partial
                self.reused += partial[1]
        self._salvage()
        self._save_state(force=True)
        self._report()

    def _load_state(self) -> tuple[set[int], tuple[int, int] | None] | None:
        try:
            with open(self.state_path) as f:
                state = json.load(f)
            with open(self.part, "rb") as f:
                head = f.read(len(self.plan.header))
                size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError):
            return None
        if (not isinstance(state, dict) or state.get("v") != STATE_VERSION
                or state.get("plan") != self.plan.plan_id or head != self.plan.header
                or size != self.plan.file_bytes):
            return None
        n = len(self.plan.jobs)
        done = {i for i in state.get("done", []) if isinstance(i, int) and 0 <= i < n}
        partial = state.get("partial")
        if (isinstance(partial, list) and len(partial) == 2 and all(isinstance(x, int) for x in partial)
                and 0 <= partial[0] < n and 0 < partial[1] < self.plan.jobs[partial[0]].size):
            return done, (partial[0], partial[1])
        return done, None

    def _save_state(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.fd < 0 or (not force and now - self.last_save < SAVE_EVERY_S):
            return
        self.last_save = now
        os.fsync(self.fd)  # the state never claims bytes that are not on disk
        slabs = [[j.layer, j.expert, j.kind, j.sha256, j.dst, j.size] for j in self.plan.jobs
                 if j.index in self.done]
        state = {"v": STATE_VERSION, "plan": self.plan.plan_id, "model": self.plan.model,
                 "source": self.sources[0].name, "done": sorted(self.done),
                 "partial": list(self.partial) if self.partial else None, "slabs": slabs}
        tmp = f"{self.state_path}.{secrets.token_hex(4)}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_path)

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _salvage(self) -> None:
        """Copy slabs this plan needs from other slices/parts of the same model on disk."""
        want = {(j.layer, j.expert, j.kind, j.sha256): j for j in self.plan.jobs
                if j.index not in self.done and (self.partial is None or self.partial[0] != j.index)}
        if not want:
            return
        folder = os.path.dirname(self.part) or "."
        for path in sorted(glob.glob(os.path.join(glob.escape(folder), f"{self.plan.model}.*.slice.gguf"))):
            if path == self.final or not want:
                continue
            try:
                info = load_slice(path)
            except ModelFileError:
                continue
            for (layer, expert, kind, sha), job in list(want.items()):
                if info.holds(layer, expert):
                    try:
                        data = info.slab(layer, expert, kind)
                    except KeyError:
                        continue
                    self._adopt(job, data, want)
        pattern = os.path.join(glob.escape(folder), f"{self.plan.model}.*.part.json")
        for state_path in sorted(glob.glob(pattern)):
            if state_path == self.state_path or not want:
                continue
            try:
                with open(state_path) as f:
                    slabs = json.load(f).get("slabs", [])
                fd = os.open(state_path[:-len(".json")], os.O_RDONLY)
            except (OSError, ValueError, AttributeError):
                continue
            try:
                for layer, expert, kind, sha, dst, size in slabs:
                    job = want.get((layer, expert, kind, sha))
                    if job is not None and size == job.size:
                        self._adopt(job, os.pread(fd, size, dst), want)
            except (TypeError, ValueError, OSError):
                pass
            finally:
                os.close(fd)

    def _adopt(self, job: SlabJob, data: bytes, want: dict) -> None:
        if len(data) == job.size and hashlib.sha256(data).hexdigest() == job.sha256:
            _pwrite_all(self.fd, data, job.dst)
            self._complete(job)
            self.reused += job.size
            del want[(job.layer, job.expert, job.kind, job.sha256)]

    # fetching ----------------------------------------------------------------------------------
    def _download_all(self) -> None:
        failures = 0
        while True:
            runs = self._runs()
            if not runs:
                return
            try:
                for run in runs:
                    self._fetch_run(run)
                    failures = 0
            except _Refetch:
                continue  # the slab is fetched again whole on the next pass
            except TransientSourceError as exc:
                failures += 1
                self.retried += 1
                self._save_state(force=True)
                if failures > self.retries:
                    left = len(self.plan.jobs) - len(self.done)
                    raise DownloadError(f"download interrupted: {exc}; {left} of {len(self.plan.jobs)} "
                                        f"slabs left. Run again to resume from {self.part}") from None
                time.sleep(min(8.0, self.backoff_s * 2 ** (failures - 1)))

    def _runs(self) -> list[list[SlabJob]]:
        """Pending slabs grouped into runs that are contiguous in the source and the slice."""
        runs: list[list[SlabJob]] = []
        for job in self.plan.jobs:
            if job.index in self.done:
                continue
            prev = runs[-1][-1] if runs else None
            if (prev is not None and prev.part == job.part and prev.src + prev.size == job.src
                    and prev.dst + prev.size == job.dst
                    and not (self.partial and self.partial[0] == job.index)):
                runs[-1].append(job)
            else:
                runs.append([job])
        return runs

    def _fetch_run(self, run: Sequence[SlabJob]) -> None:
        first = run[0]
        skip = 0
        h = hashlib.sha256()
        resumed = False
        if self.partial and self.partial[0] == first.index:
            skip = self.partial[1]
            h.update(_read(self.fd, first.dst, skip))
            resumed = True
        k, at = 0, skip  # current job in the run, bytes of it on disk
        for data, cached in self._stream(first.part, first.src + skip, run[-1].src + run[-1].size):
            if self.cancel is not None and self.cancel.is_set():
                raise DownloadError(f"download cancelled; run again to resume from {self.part}")
            view = memoryview(data)
            if cached:
                self.from_cache += len(view)
            while view:
                job = run[k]
                n = min(len(view), job.size - at)
                _pwrite_all(self.fd, view[:n], job.dst + at)
                h.update(view[:n])
                view = view[n:]
                at += n
                if at < job.size:
                    self.partial = (job.index, at)
                    continue
                digest = h.hexdigest()
                if digest != job.sha256:
                    self.partial = None
                    if resumed and k == 0:
                        # the resumed prefix may be what is wrong (a torn write): fetch it whole
                        raise _Refetch()
                    raise SlabVerificationError(
                        f"{job} slab ({job.size} bytes at offset {job.src} of {self.sources[job.part].name}) fails "
                        f"verification: SHA-256 {digest[:16]}..., the backbone's manifest says "
                        f"{job.sha256[:16]}...; refused (the source is not the model the backbone "
                        "serves, or it was tampered with)")
                self._complete(job)
                self.partial = None
                self._save_state()
                self._report()
                h = hashlib.sha256()
                k, at = k + 1, 0
            self._report()

    def _stream(self, part: int, start: int, end: int) -> Iterator[tuple[bytes, bool]]:
        for a, b, data in self.caches[part].pieces(start, end):
            if data is not None:
                yield data, True
            else:
                for chunk in self.sources[part].stream(a, b - a):
                    yield chunk, False

    def _complete(self, job: SlabJob) -> None:
        if job.index not in self.done:
            self.done.add(job.index)
            self.done_bytes += job.size

    def _report(self) -> None:
        if self.progress is not None:
            done = self.done_bytes + (self.partial[1] if self.partial else 0)
            self.progress(done, self.plan.slab_bytes)


class _Refetch(Exception):
    """A resumed slab did not verify: fetch it again from its first byte."""


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _read(fd: int, offset: int, length: int) -> bytes:
    out = bytearray()
    while len(out) < length:
        data = os.pread(fd, min(READ_CHUNK, length - len(out)), offset + len(out))
        if not data:
            break
        out += data
    return bytes(out)


def _digest(fd: int, offset: int, length: int) -> str:
    h = hashlib.sha256()
    pos, end = offset, offset + length
    while pos < end:
        data = os.pread(fd, min(READ_CHUNK, end - pos), pos)
        if not data:
            return ""
        h.update(data)
        pos += len(data)
    return h.hexdigest()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def progress_for(stream, label: str = "downloading", event: str = "download_progress",
                 **context) -> TerminalProgress | LogProgress:
    """The progress callback for ``stream``: a redrawn line on a terminal; elsewhere (a log
    file, a pipe) a structlog line every 10% or 10 s (:class:`kvasir_bus.progress.LogProgress`)."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return TerminalProgress(stream, label)
    return LogProgress(event, unit="bytes", **context)


class TerminalProgress:
    """A ``\\r`` progress line for a terminal (MB done / total, %, MB/s), at most 10 redraws/s."""

    def __init__(self, stream, label: str = "downloading") -> None:
        self.stream, self.label = stream, label
        self.t0 = time.perf_counter()
        self.first: int | None = None
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = done  # bytes already on disk do not count towards the rate
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        rate = (done - self.first) / 1e6 / max(now - self.t0, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(f"\r{self.label}: {done / 1e6:,.1f} / {total / 1e6:,.1f} MB  {pct:5.1f}%  "
                          f"{rate:,.1f} MB/s ")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
