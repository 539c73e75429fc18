"""Where a volunteer's weights come from: ranged reads of a GGUF on disk or over HTTP(S).

A volunteer never downloads a whole model. It reads the GGUF header (metadata and tensor
table), which names the model (its fingerprint), and then only its experts' byte ranges.

* :func:`open_source` opens a local path or an ``http(s)://`` URL as a :class:`Source` with
  ``read(offset, length)`` and ``stream(offset, length)``. Over HTTP every read is one
  ``Range: bytes=a-b`` GET on a kept-alive connection; redirects are followed (HuggingFace's
  ``resolve/main/...`` URLs answer with one to a CDN), a node token is sent as
  ``Authorization: Bearer`` to the URL's own host only (never to a host a redirect points at),
  and a server that ignores ``Range`` is refused rather than read to the end.
* :func:`read_header` fetches the header in a few precise rounds: the pure parser
  (:func:`modelfile.gguf_header.parse_header`) says how many bytes it needs at least when
  the bytes end too early, so the overshoot past the header is at most
  ``max(HEADER_STEP, header / 32)`` bytes.
* :func:`identify` reads the header and gives the fingerprint it names, equal to
  :func:`kvasir_bus.fingerprint.compute_fingerprint` of the whole file. Every byte fetched is
  kept in a :class:`ByteCache`, so header bytes that a later slab read needs are not fetched
  twice.
"""

from __future__ import annotations

import bisect
import http.client
import os
import socket
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit, urlunsplit

from kvasir_bus import __version__
from kvasir_bus.errors import KvasirError, ModelFileError, UsageError
from kvasir_bus.fingerprint import SLICE_SOURCE_KEY
from modelfile.gguf_header import GGUFHeader, NeedMore, parse_header

HEADER_FIRST = 8 * 1024  # first header read
HEADER_STEP = 512  # a later header read asks for max(lower bound, have + max(STEP, have / 32))
STREAM_CHUNK = 1 << 20
MAX_REDIRECTS = 10


class SourceError(KvasirError):
    """The source cannot give the bytes asked for (and trying again will not help)."""


class TransientSourceError(SourceError):
    """A read failed in a way that may pass: a dropped connection, a timeout, a 5xx."""


# -- a sparse cache of fetched bytes ----------------------------------------------------------

class ByteCache:
    """Byte ranges already fetched from one source, so that none is fetched twice.

    Ranges are kept merged and sorted; ``missing(a, b)`` lists the holes of ``[a, b)`` and
    ``get(a, b)`` returns the bytes when they are all here.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._chunks: list[bytes] = []

    def __len__(self) -> int:
        return sum(len(c) for c in self._chunks)

    def add(self, start: int, data: bytes) -> None:
        if not data:
            return
        end = start + len(data)
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and self._starts[i] + len(self._chunks[i]) >= start:
            lo = i
        else:
            lo = i + 1
        hi = lo
        while hi < len(self._starts) and self._starts[hi] <= end:
            hi += 1
        if lo == hi:
            self._starts.insert(lo, start)
            self._chunks.insert(lo, bytes(data))
            return
        new_start = min(start, self._starts[lo])
        last_end = self._starts[hi - 1] + len(self._chunks[hi - 1])
        new_end = max(end, last_end)
        buf = bytearray(new_end - new_start)
        for s, c in zip(self._starts[lo:hi], self._chunks[lo:hi]):
            buf[s - new_start:s - new_start + len(c)] = c
        buf[start - new_start:end - new_start] = data
        self._starts[lo:hi] = [new_start]
        self._chunks[lo:hi] = [bytes(buf)]

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        holes = []
        pos = start
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while pos < end and i < len(self._starts):
            s, e = self._starts[i], self._starts[i] + len(self._chunks[i])
            if e <= pos:
                i += 1
                continue
            if s >= end:
                break
            if s > pos:
                holes.append((pos, s))
            pos = max(pos, e)
            i += 1
        if pos < end:
            holes.append((pos, end))
        return holes

    def get(self, start: int, end: int) -> bytes | None:
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return None
        s, c = self._starts[i], self._chunks[i]
        if s + len(c) < end:
            return None
        return c[start - s:end - s]

    def pieces(self, start: int, end: int) -> list[tuple[int, int, bytes | None]]:
        """``[a, b)`` cut into consecutive pieces ``(a, b, bytes or None if not cached)``."""
        out: list[tuple[int, int, bytes | None]] = []
        pos = start
        for a, b in self.missing(start, end):
            if a > pos:
                out.append((pos, a, self.get(pos, a)))
            out.append((a, b, None))
            pos = b
        if pos < end:
            out.append((pos, end, self.get(pos, end)))
        return out


# -- sources ----------------------------------------------------------------------------------

class Source:
    """Ranged reads of one GGUF. ``fetched`` counts the payload bytes actually transferred."""

    name: str
    size: int

    def __init__(self) -> None:
        self.fetched = 0
        self.requests = 0

    def read(self, offset: int, length: int) -> bytes:
        return b"".join(self.stream(offset, length))

    def stream(self, offset: int, length: int, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise SourceError(f"{self.name}: bytes {offset}-{offset + length} are outside the file "
                              f"({self.size} bytes)")


class LocalSource(Source):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.name = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SourceError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise SourceError(f"{path}: is a directory, not a GGUF file") from None
        except OSError as exc:
            raise SourceError(f"{path}: cannot open: {exc.strerror}") from None
        self.size = os.fstat(self._fd).st_size

    def stream(self, offset: int, length: int, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        self._check_range(offset, length)
        self.requests += 1
        end = offset + length
        while offset < end:
            data = os.pread(self._fd, min(chunk, end - offset), offset)
            if not data:
                raise SourceError(f"{self.name}: ended at byte {offset} (was it truncated?)")
            self.fetched += len(data)
            offset += len(data)
            yield data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def redact_url(url: str) -> str:
    """The URL without credentials or a ``token`` query parameter, for messages and logs."""
    p = urlsplit(url)
    netloc = p.hostname or ""
    if p.port:
        netloc += f":{p.port}"
    query = urlencode([(k, "***" if k.lower() == "token" else v) for k, v in parse_qsl(p.query)])
    return urlunsplit((p.scheme, netloc, p.path, query, ""))


class HttpSource(Source):
    """A GGUF behind an HTTP(S) URL that supports ``Range`` requests.

    ``token`` goes as ``Authorization: Bearer`` to the URL's own scheme/host/port and to no
    other: a redirect to a CDN gets the request without it (signed CDN URLs carry their own
    credentials). The final URL of a redirect chain is kept for later reads and re-resolved
    from the original once if it stops working (signed URLs expire).
    """

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 node: str | None = None) -> None:
        super().__init__()
        p = urlsplit(url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise UsageError(f"{redact_url(url)}: expected an http:// or https:// URL")
        self.url = url
        self.name = redact_url(url)
        self.token = token
        self.timeout = timeout
        self.node = node
        self._origin = _origin(url)
        self._resolved = url
        self._conn: http.client.HTTPConnection | None = None
        self._conn_origin = ""
        self.size = self._probe_size()

    # The public reads -----------------------------------------------------------------------
    def stream(self, offset: int, length: int, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        self._check_range(offset, length)
        if length == 0:
            return
        resp = self._get_range(offset, offset + length - 1)
        got = 0
        try:
            while got < length:
                try:
                    data = resp.read(min(chunk, length - got))
                except (OSError, http.client.HTTPException) as exc:
                    raise TransientSourceError(
                        f"{self.name}: connection lost after {got} of {length} bytes at offset "
                        f"{offset} ({type(exc).__name__}: {exc})") from None
                if not data:
                    raise TransientSourceError(f"{self.name}: the server closed the connection after "
                                               f"{got} of {length} bytes at offset {offset}")
                got += len(data)
                self.fetched += len(data)
                yield data
        except BaseException:
            self._drop_connection()
            raise
        if resp.will_close:
            self._drop_connection()

    def close(self) -> None:
        self._drop_connection()

    # HTTP -----------------------------------------------------------------------------------
    def _probe_size(self) -> int:
        """Learn the file size (and that ranges work) with a one-byte ranged GET."""
        resp = self._request("GET", {"Range": "bytes=0-0"})
        try:
            if resp.status == 200:
                total = _int_header(resp, "Content-Length")
                if total is not None and total <= 1:
                    resp.read()
                    return total
                raise SourceError(f"{self.name}: the server does not support HTTP Range requests "
                                  "(it answered a ranged GET with the whole file); a volunteer "
                                  "downloads only its experts, so it needs a server that does")
            first, last, total = _content_range(resp, self.name)
            if first != 0 or total is None:
                raise SourceError(f"{self.name}: unexpected Content-Range "
                                  f"{resp.getheader('Content-Range')!r} for bytes=0-0")
            data = resp.read()
            self.fetched += len(data)
            if resp.will_close:
                self._drop_connection()
            return total
        except BaseException:
            self._drop_connection()
            raise

    def _get_range(self, first: int, last: int) -> http.client.HTTPResponse:
        resp = self._request("GET", {"Range": f"bytes={first}-{last}"})
        if resp.status == 200:
            self._drop_connection()
            raise SourceError(f"{self.name}: the server ignored the Range header (answered 200 "
                              "with the whole file); it must support HTTP Range requests")
        try:
            a, b, total = _content_range(resp, self.name)
        except BaseException:
            self._drop_connection()
            raise
        if (a, b) != (first, last) or (total is not None and total != self.size):
            self._drop_connection()
            raise SourceError(f"{self.name}: asked for bytes {first}-{last} of {self.size}, got "
                              f"{resp.getheader('Content-Range')!r} (did the file change?)")
        self.requests += 1
        return resp

    def _request(self, method: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """One request with redirects followed; returns a response with status 200 or 206."""
        url = self._resolved
        re_resolved = False
        hops = 0
        while True:
            resp = self._send(method, url, headers)
            status = resp.status
            if status in (301, 302, 303, 307, 308):
                location = resp.getheader("Location")
                self._discard(resp)
                if not location:
                    raise SourceError(f"{self.name}: redirect {status} without a Location")
                hops += 1
                if hops > MAX_REDIRECTS:
                    raise SourceError(f"{self.name}: more than {MAX_REDIRECTS} redirects")
                url = urljoin(url, location)
                continue
            if status in (200, 206):
                self._resolved = url
                return resp
            body = self._discard(resp, keep=512)
            if url != self.url and not re_resolved and status in (401, 403, 404, 410):
                # an expired signed CDN URL: ask the original URL again
                url, hops, re_resolved = self.url, 0, True
                continue
            raise _status_error(status, resp.reason, self.name, body, bool(self.token))

    def _send(self, method: str, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        p = urlsplit(url)
        origin = _origin(url)
        path = urlunsplit(("", "", p.path or "/", p.query, ""))
        hdrs = {"User-Agent": f"kvasir-worker/{__version__}", "Accept-Encoding": "identity", **headers}
        if self.node:
            hdrs["X-Kvasir-Node"] = self.node
        if self.token and origin == self._origin:
            hdrs["Authorization"] = f"Bearer {self.token}"
        for attempt in (0, 1):
            conn = self._connection(origin, p)
            fresh = conn.sock is None
            try:
                conn.request(method, path, headers=hdrs)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self._drop_connection()
                if attempt == 0 and not fresh:  # the kept-alive connection had been closed
                    continue
                raise TransientSourceError(f"{self.name}: {type(exc).__name__}: {exc}") from None
            except socket.timeout:
                self._drop_connection()
                raise TransientSourceError(f"{self.name}: no answer within {self.timeout:g} s") from None
            except OSError as exc:
                self._drop_connection()
                raise TransientSourceError(f"{self.name}: cannot connect to {p.hostname}:"
                                           f"{p.port or (443 if p.scheme == 'https' else 80)}: "
                                           f"{exc.strerror or exc}") from None
        raise AssertionError("unreachable")

    def _connection(self, origin: str, p) -> http.client.HTTPConnection:
        if self._conn is not None and self._conn_origin == origin:
            return self._conn
        self._drop_connection()
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(p.hostname, p.port, timeout=self.timeout)
        self._conn_origin = origin
        return self._conn

    def _discard(self, resp: http.client.HTTPResponse, keep: int = 0) -> bytes:
        """Read a small error/redirect body (to reuse the connection), or drop the connection."""
        length = _int_header(resp, "Content-Length")
        if length is not None and length <= 64 * 1024:
            try:
                body = resp.read()
            except (OSError, http.client.HTTPException):
                self._drop_connection()
                return b""
            if resp.will_close:
                self._drop_connection()
            return body[:keep]
        self._drop_connection()
        return b""

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None
            self._conn_origin = ""


def _origin(url: str) -> str:
    p = urlsplit(url)
    port = p.port or (443 if p.scheme == "https" else 80)
    return f"{p.scheme}://{(p.hostname or '').lower()}:{port}"


def _int_header(resp, name: str) -> int | None:
    value = resp.getheader(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _content_range(resp, name: str) -> tuple[int, int, int | None]:
    value = resp.getheader("Content-Range") or ""
    try:
        unit, rest = value.split(" ", 1)
        span, total = rest.split("/", 1)
        first, last = span.split("-", 1)
        if unit != "bytes":
            raise ValueError
        return int(first), int(last), (None if total.strip() == "*" else int(total))
    except ValueError:
        raise SourceError(f"{name}: a 206 answer with a bad Content-Range {value!r}") from None


def _status_error(status: int, reason: str, name: str, body: bytes, has_token: bool) -> SourceError:
    detail = body.decode("utf-8", "replace").strip().splitlines()[0][:200] if body.strip() else ""
    detail = f" ({detail})" if detail else ""
    if status == 401:
        hint = ("the node token was not accepted" if has_token else
                "a node token is needed: --token TOKEN or $KVASIR_NODE_TOKEN")
        return SourceError(f"{name}: 401 Unauthorized: {hint}{detail}")
    if status == 403:
        return SourceError(f"{name}: 403 Forbidden{detail}")
    if status == 404:
        return SourceError(f"{name}: 404 Not Found{detail}")
    if status == 416:
        return SourceError(f"{name}: 416 Range Not Satisfiable (is the file shorter than its header "
                           f"says?){detail}")
    if status >= 500 or status == 429:
        return TransientSourceError(f"{name}: {status} {reason}{detail}")
    return SourceError(f"{name}: HTTP {status} {reason}{detail}")


def open_source(spec: str, *, token: str | None = None, timeout: float = 30.0,
                node: str | None = None) -> Source:
    """A local path or an ``http(s)://`` URL as a :class:`Source` (``token``: node token)."""
    if not spec:
        raise UsageError("--source is empty: give a GGUF path or an http(s):// URL")
    scheme = urlsplit(spec).scheme.lower()
    if scheme in ("http", "https"):
        return HttpSource(spec, token=token, timeout=timeout, node=node)
    if scheme == "file":
        return LocalSource(urlsplit(spec).path)
    if "://" in spec:
        raise UsageError(f"--source {redact_url(spec)}: unsupported scheme {scheme!r} "
                         "(give a path, http:// or https://)")
    return LocalSource(spec)


# -- reading the header over ranged reads ----------------------------------------------------

@dataclass(frozen=True, eq=False)
class Identity:
    """What a volunteer learns about a source before it asks for work."""

    source: str  # the source's name (a path, or the URL without secrets)
    size: int  # bytes of the whole file
    header: GGUFHeader
    fingerprint: str  # the model the header names (kvasir_bus.fingerprint)
    cache: ByteCache = field(repr=False)  # every byte fetched so far
    header_bytes: int  # the header's length (data_offset)
    fetched_header: int  # bytes fetched to read the header (a little past header_end, at most)
    requests: int


def read_header(source: Source, cache: ByteCache | None = None) -> GGUFHeader:
    """Fetch just enough of ``source`` to parse its header; every byte read lands in ``cache``."""
    cache = cache if cache is not None else ByteCache()
    buf = bytearray()
    want = min(HEADER_FIRST, source.size)
    while True:
        if want > len(buf):
            data = source.read(len(buf), want - len(buf))
            cache.add(len(buf), data)
            buf += data
        try:
            header = parse_header(buf, source.name)
            break
        except NeedMore as more:
            if more.end > source.size or len(buf) >= source.size:
                raise ModelFileError(f"{source.name}: truncated GGUF: the header needs at least "
                                     f"{more.end} bytes, the file has {source.size}") from None
            want = min(source.size, max(more.end, len(buf) + max(HEADER_STEP, len(buf) // 32)))
    end = header.file_bytes_needed
    if end > source.size:
        raise ModelFileError(f"{source.name}: truncated: the tensors need bytes up to {end}, "
                             f"the file has {source.size}")
    return header


def identify(source: Source, cache: ByteCache | None = None) -> Identity:
    """Read the header of ``source`` and the fingerprint it names (equal to
    ``compute_fingerprint`` of the whole file). Refuses a kvasir slice: a volunteer cuts its
    own slice from the original model."""
    cache = cache if cache is not None else ByteCache()
    before, req0 = source.fetched, source.requests
    header = read_header(source, cache)
    if SLICE_SOURCE_KEY in header.metadata:
        raise ModelFileError(f"{source.name}: is a kvasir slice, not a whole model; volunteer from "
                             "the original GGUF")
    return Identity(source.name, source.size, header, header.fingerprint, cache, header.data_offset,
                    source.fetched - before, source.requests - req0)
