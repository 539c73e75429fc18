"""Partial download (M3): a volunteer reads the header, fingerprints the model over ranged reads,
gets an assignment and fetches only its experts' slabs, each checked against the manifest.

Byte accounting used below, for a volunteer that got ``slab`` bytes of experts: ``header`` is
the GGUF header (``data_offset`` bytes); the fingerprint is computed from the header alone, so
the bound is ``fetched <= 1.05 * (slab + header)``.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import threading

import numpy as np
import pytest
from gguf import GGUFReader

from backbone.manifest import build_manifest, serve_manifest
from kvasir_bus import codec, market_codec
from kvasir_bus.cli import main
from kvasir_bus.connect import connect
from kvasir_bus.errors import KvasirError, ModelFileError, UsageError
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.logs import capture
from kvasir_bus.subjects import Subjects
from tests.model_cache import ModelCache
from workers import download as dl
from kernels.expert import expert_ffn
from workers.runtime import Worker, WorkerConfig
from modelfile.slice_file import KINDS, load_slice
from workers.source import HEADER_FIRST, HEADER_STEP, ByteCache, SourceError, identify, open_source
from kernels.tensors import tensors_from_reader
from workers.volunteer import NoFitError, VolunteerConfig, parse_size, volunteer

H = codec.Holding  # half-open (layer, lo, hi), as the market assigns
ASSIGNED = (H(0, 2, 6), H(1, 0, 3))  # 7 experts: one run per kind in layer 0, one in layer 1


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny(models):
    return models("qwen3moe", "q8_0", seed=1)


@pytest.fixture(scope="session")
def tiny_k(models):
    return models("qwen3moe", "q4_k", seed=1)


@pytest.fixture(scope="session")
def manifests(tmp_path_factory):
    root = tmp_path_factory.mktemp("manifests")
    made = {}

    def get(path):
        if path not in made:
            made[path] = build_manifest(path, cache_path=root / f"{len(made)}.mf")
        return made[path]

    return get


def expert_bytes(path, layer, expert):
    t = tensors_from_reader(GGUFReader(path))
    return [bytes(t[f"blk.{layer}.ffn_{k}_exps.weight"].expert(expert).data) for k in KINDS]


# -- the header and the fingerprint over ranged reads ------------------------------------------

def test_a_custom_alignment_is_honoured_and_bad_files_are_refused(tmp_path):
    from pathlib import Path

    from tests.modelfile.test_slice import build_source

    path = Path(build_source(tmp_path / "aligned.gguf", alignment=64))
    with open_source(str(path)) as src:
        got = identify(src)
    assert got.header.alignment == 64
    assert got.fingerprint == model_fingerprint(GGUFReader(path))
    bad = tmp_path / "short.gguf"
    bad.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="truncated"), open_source(str(bad)) as src:
        identify(src)


@pytest.mark.parametrize("which", ["tiny", "tiny_k"])
def test_fingerprint_over_http_equals_model_fingerprint_of_the_file(which, request, serve):
    path = request.getfixturevalue(which)
    srv = serve(path)
    with open_source(srv.url, node="fp") as src:
        got = identify(src)
    assert got.fingerprint == model_fingerprint(GGUFReader(path))
    # the header, at most one small read step past its end, and nothing else (the size probe
    # is one byte)
    h = got.header_bytes
    assert got.fetched_header <= max(HEADER_FIRST, h + max(HEADER_STEP, h // 32))
    assert srv.served_to("fp") == src.fetched == 1 + got.fetched_header


def test_a_kvasir_slice_is_not_a_source(tiny, tmp_path):
    from modelfile.slicer import plan_slice, write_slice

    out = write_slice(plan_slice(tiny, [((0, 0), (0, 1))]), tmp_path / "s.gguf").path
    with pytest.raises(ModelFileError, match="kvasir slice"), open_source(out) as src:
        identify(src)


class _NoRanges(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


def test_a_server_without_range_support_is_refused_not_read_to_the_end(tiny):
    handler = lambda *a, **kw: _NoRanges(*a, directory=str(tiny.parent), **kw)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SourceError, match="Range"):
            open_source(f"http://127.0.0.1:{httpd.server_address[1]}/{tiny.name}")
    finally:
        httpd.shutdown()
        httpd.server_close()


class _Redirect(http.server.BaseHTTPRequestHandler):
    """Answers everything with a 302 to ``target`` (HuggingFace's resolve/main does this)."""

    target = ""
    seen: list = []
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        self.seen.append(self.headers.get("Authorization"))
        self.send_response(302)
        self.send_header("Location", self.target)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("cdn_token", [None, "t0k"])
def test_redirects_are_followed_and_the_token_stays_with_its_host(tiny, serve, cdn_token):
    cdn = serve(tiny, tokens=[cdn_token] if cdn_token else [])
    handler = type("R", (_Redirect,), {"target": cdn.url, "seen": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/org/model/resolve/main/{tiny.name}"
    try:
        if cdn_token:  # the token is for the redirecting host only, never sent on to the CDN
            with pytest.raises(SourceError, match="401"):
                open_source(url, token="t0k")
            assert cdn.unauthorized >= 1
        else:
            with open_source(url, token="t0k") as src:
                assert identify(src).fingerprint == model_fingerprint(GGUFReader(tiny))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert handler.seen and all(a == "Bearer t0k" for a in handler.seen)


# -- downloading slabs ----------------------------------------------------------------------

def _plan(url_or_path, manifest, holdings=ASSIGNED, **kw):
    src = open_source(url_or_path, **kw)
    ident = identify(src)
    return src, ident, dl.plan_download(ident, manifest, holdings)


def _check_slice(result, source_path, holdings=ASSIGNED):
    info = load_slice(result.path)
    assert info.holdings == dl.merge_holdings(holdings)
    assert info.fingerprint == model_fingerprint(GGUFReader(source_path))
    for layer, e in info.experts():
        assert [bytes(t.data) for t in info.expert_weights(layer, e)] == expert_bytes(source_path, layer, e)
    return info


@pytest.mark.parametrize("which", ["tiny", "tiny_k"])
def test_download_fetches_only_the_assigned_slabs_and_the_slice_equals_the_source(
        which, request, serve, manifests, tmp_path):
    path = request.getfixturevalue(which)
    srv = serve(path)
    src, ident, plan = _plan(srv.url, manifests(path), node="v1")
    with src:
        result = dl.download_slice(src, plan, tmp_path, cache=ident.cache)
    _check_slice(result, path)
    served = srv.served_to("v1")
    assert served == src.fetched
    slab, header = plan.slab_bytes, ident.header_bytes
    assert slab == 7 * manifests(path).expert_bytes(0)
    assert result.fetched + result.from_cache == slab  # every slab byte fetched once, no more
    assert served <= 1.05 * (slab + header)  # the fingerprint needs the header only
    assert not any(p.endswith((".part", ".json")) for p in os.listdir(tmp_path))


def test_a_download_cut_off_resumes_to_the_byte(tiny_k, serve, manifests, tmp_path):
    srv = serve(tiny_k)
    src, ident, plan = _plan(srv.url, manifests(tiny_k), node="v3")
    before = srv.served_to("v3")
    srv.drop_after(plan.slab_bytes // 3)  # the connection dies a third of the way in
    with pytest.raises(dl.DownloadError, match="resume"):
        dl.download_slice(src, plan, tmp_path, cache=ident.cache, retries=0)
    part, state, final = dl.slice_paths(str(tmp_path), plan)
    assert os.path.exists(part) and os.path.exists(state) and not os.path.exists(final)

    progress = []
    result = dl.download_slice(src, plan, tmp_path, cache=ident.cache,
                               progress=lambda done, total: progress.append((done, total)))
    _check_slice(result, tiny_k)
    assert result.reused > 0 and progress[0][0] > 0 and progress[-1] == (plan.slab_bytes, plan.slab_bytes)
    # both attempts together fetched each slab byte exactly once
    assert srv.served_to("v3") - before == plan.slab_bytes - result.from_cache

    again = dl.download_slice(src, plan, tmp_path, cache=ident.cache)  # finished: nothing fetched
    assert (again.fetched, again.reused, again.path) == (0, plan.slab_bytes, result.path)
    src.close()


def test_a_torn_partial_slab_is_fetched_again_whole(tiny_k, serve, manifests, tmp_path):
    import json

    srv = serve(tiny_k)
    src, ident, plan = _plan(srv.url, manifests(tiny_k), node="v6")
    srv.drop_after(plan.jobs[0].size // 2 + 1000)
    with pytest.raises(dl.DownloadError):
        dl.download_slice(src, plan, tmp_path, cache=ident.cache, retries=0)
    part, state, _ = dl.slice_paths(str(tmp_path), plan)
    index, have = json.load(open(state))["partial"]
    with open(part, "r+b") as f:  # the bytes on disk are not what the state says (a torn write)
        f.seek(plan.jobs[index].dst + have // 2)
        f.write(b"\xff\x00\xff")
    before = srv.served_to("v6")
    result = dl.download_slice(src, plan, tmp_path, cache=ident.cache, retries=0)
    _check_slice(result, tiny_k)
    assert srv.served_to("v6") - before == result.fetched
    src.close()


def test_a_cancelled_download_stops_and_keeps_its_part(tiny, serve, manifests, tmp_path):
    srv = serve(tiny)
    src, ident, plan = _plan(srv.url, manifests(tiny))
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(dl.DownloadError, match="cancelled"):
        dl.download_slice(src, plan, tmp_path, cache=ident.cache, cancel=cancel)
    assert os.path.exists(dl.slice_paths(str(tmp_path), plan)[0])
    _check_slice(dl.download_slice(src, plan, tmp_path, cache=ident.cache), tiny)
    src.close()


def test_byte_cache_holds_what_was_added():
    rng = np.random.default_rng(7)
    truth = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    have = np.zeros(5000, bool)
    cache = ByteCache()
    for _ in range(60):
        a = int(rng.integers(0, 4900))
        b = a + int(rng.integers(1, 200))
        cache.add(a, truth[a:b])
        have[a:b] = True
        x = int(rng.integers(0, 4900))
        y = x + int(rng.integers(1, 100))
        assert (cache.get(x, y) == truth[x:y]) == bool(have[x:y].all())
        holes = cache.missing(x, y)
        assert sum(q - p for p, q in holes) == int((~have[x:y]).sum())
        assert b"".join(d if d is not None else truth[p:q] for p, q, d in cache.pieces(x, y)) == truth[x:y]
    assert len(cache) == int(have.sum())


def test_a_dropped_connection_is_retried_by_itself(tiny_k, serve, manifests, tmp_path):
    srv = serve(tiny_k)
    src, ident, plan = _plan(srv.url, manifests(tiny_k), node="v4")
    srv.drop_after(plan.slab_bytes // 2)
    with src:
        result = dl.download_slice(src, plan, tmp_path, cache=ident.cache, retries=2, backoff_s=0.01)
    assert result.retries == 1
    assert result.fetched + result.from_cache == plan.slab_bytes
    _check_slice(result, tiny_k)


def test_slabs_already_on_disk_are_reused_for_another_assignment(tiny, serve, manifests, tmp_path):
    srv = serve(tiny)
    m = manifests(tiny)
    src, ident, plan = _plan(srv.url, m, node="v5")
    dl.download_slice(src, plan, tmp_path, cache=ident.cache)
    other = dl.plan_download(ident, m, (H(0, 4, 8),))  # experts 4-5 of layer 0 are held already
    before = srv.served_to("v5")
    result = dl.download_slice(src, other, tmp_path)
    assert result.reused == 2 * m.expert_bytes(0)
    assert srv.served_to("v5") - before == 2 * m.expert_bytes(0)
    _check_slice(result, tiny, (H(0, 4, 8),))
    src.close()


def test_a_tampered_slab_is_refused_and_never_becomes_a_slice(tiny, serve, manifests, tmp_path):
    m = manifests(tiny)  # from the original
    bad = tmp_path / "tampered.gguf"
    data = bytearray(tiny.read_bytes())
    slab = next(s for s in m.slabs_for(0, 3) if s.kind == "up")  # weights only: the header is intact
    data[slab.offset + slab.size // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    srv = serve(bad)
    out = tmp_path / "cache"
    out.mkdir()
    src, ident, plan = _plan(srv.url, m)
    assert ident.fingerprint == m.model  # same id: only the slab hash can tell
    for _ in range(2):  # refused again after a restart: a refused slab is never marked complete
        with pytest.raises(dl.SlabVerificationError, match="layer 0 expert 3 up .*refused"):
            dl.download_slice(src, plan, out, cache=ident.cache)
    assert not [p for p in os.listdir(out) if p.endswith(".slice.gguf")]
    src.close()


def test_a_source_of_another_build_is_refused_before_downloading(models, tiny, manifests):
    other = models("qwen3moe", "q8_0", seed=2)  # same shapes, other weights
    with open_source(str(other)) as src:
        ident = identify(src)
    with pytest.raises(dl.DownloadError, match="manifest is for"):
        dl.plan_download(ident, manifests(tiny), ASSIGNED)


# -- the volunteer flow, against a fake market -----------------------------------------------

class Bus:
    """A backbone answering manifest requests and a fake market answering volunteers."""

    def __init__(self, nc, manifest, reply):
        self.nc, self.manifest, self.reply = nc, manifest, reply
        self.asked = []

    async def start(self, market=True):
        await serve_manifest(self.nc, self.manifest)
        if market:
            await self.nc.subscribe(f"{Subjects(self.manifest.model).volunteer()}.*", cb=self._market)
        await self.nc.flush()
        return self

    async def _market(self, msg):
        req = market_codec.decode_volunteer(msg.data)
        self.asked.append(req)
        await self.nc.publish(msg.reply, self.reply(req).encode())


def assign(manifest, holdings=ASSIGNED, rate=2.5):
    def reply(req):
        size = sum(manifest.expert_bytes(h.layer) * (h.hi - h.lo) for h in holdings)
        return market_codec.Assignment(req.model, req.node, holdings, size, rate)
    return reply


def test_volunteer_gets_an_assignment_downloads_and_serves(tiny, serve, manifests, tmp_path, nats_server, arun):
    m = manifests(tiny)
    srv = serve(tiny, tokens=["node-token"])
    rows = np.random.default_rng(0).standard_normal((2, m.n_embd)).astype(np.float32)

    async def go():
        nc = await connect(nats_server.url, "backbone")
        bus = await Bus(nc, m, assign(m)).start()
        wc = await connect(nats_server.url, "volunteer")
        cfg = VolunteerConfig(source=srv.url, budget_bytes=parse_size("1MB"), node="phone-1",
                              token="node-token", cache_dir=str(tmp_path))
        with capture() as logs:
            got = await volunteer(wc, cfg)
        worker = Worker(got.slice, WorkerConfig(node="phone-1", heartbeat_s=60))
        await worker.start(wc)
        req = codec.DispatchRequest(model=m.model, layer=1, expert=2, rows=rows, request_id="r1")
        reply = codec.decode_reply((await nc.request(Subjects(m.model).dispatch(1, 2), req.encode(),
                                                     timeout=5)).data)
        await worker.stop()
        await wc.close()
        await nc.close()
        return got, bus, logs, reply

    got, bus, logs, reply = arun(go(), timeout=30)
    assert bus.asked == [market_codec.VolunteerRequest(m.model, "phone-1", 1_000_000)]
    assert got.assignment.reward_rate == 2.5
    _check_slice(got.download, tiny)
    t = tensors_from_reader(GGUFReader(tiny))
    want = expert_ffn(*(t[f"blk.1.ffn_{k}_exps.weight"].expert(2) for k in KINDS), rows, routed=True)
    np.testing.assert_array_equal(reply.rows, want)
    assert srv.served_to("phone-1") == got.fetched
    assert got.fetched <= 1.05 * (got.download.slab_bytes + got.identity.header_bytes)


def test_a_download_without_the_node_token_is_refused(tiny, serve, manifests, tmp_path, nats_server, arun):
    srv = serve(tiny, tokens=["node-token"])

    async def go():
        wc = await connect(nats_server.url, "volunteer")
        try:
            await volunteer(wc, VolunteerConfig(source=srv.url, budget_bytes=10**6, node="n",
                                                cache_dir=str(tmp_path)))
        finally:
            await wc.close()

    with pytest.raises(SourceError, match="401.*token"):
        arun(go())
    assert srv.unauthorized == 1 and srv.bytes_served == 0


def test_a_budget_below_one_expert_gets_a_clear_refusal(tiny, manifests, tmp_path, nats_server, arun):
    m = manifests(tiny)
    one = m.expert_bytes(0)

    async def go(budget, market_says_no_fit):
        nc = await connect(nats_server.url, "backbone")
        no_fit = lambda req: codec.ErrorReply("", "market", market_codec.ERR_NO_FIT, "nothing fits")  # noqa: E731
        bus = await Bus(nc, m, no_fit if market_says_no_fit else assign(m)).start()
        wc = await connect(nats_server.url, "volunteer")
        try:
            await volunteer(wc, VolunteerConfig(source=str(tiny), budget_bytes=budget, node="n",
                                                cache_dir=str(tmp_path)))
        finally:
            await wc.close()
            await nc.close()
        return bus

    with pytest.raises(NoFitError, match=f"budget of {one - 1:,} bytes cannot hold even one expert.*"
                                          f"smallest expert is {one:,} bytes"):
        arun(go(one - 1, False))
    # the market's own refusal reads the same, with its reason
    with pytest.raises(NoFitError, match=f"smallest expert is {one:,} bytes.*nothing fits"):
        arun(go(one, True))


@pytest.mark.parametrize("missing", ["market", "backbone"])
def test_no_market_or_no_backbone_for_the_model_is_a_clear_error(missing, tiny, manifests, tmp_path,
                                                                 nats_server, arun):
    m = manifests(tiny)

    async def go():
        nc = await connect(nats_server.url, "backbone")
        if missing == "market":
            await Bus(nc, m, assign(m)).start(market=False)
        wc = await connect(nats_server.url, "volunteer")
        try:
            await volunteer(wc, VolunteerConfig(source=str(tiny), budget_bytes=10**9, node="n",
                                                cache_dir=str(tmp_path), request_timeout_s=2))
        finally:
            await wc.close()
            await nc.close()

    with pytest.raises(KvasirError, match=f"no {missing} answers for model {m.model}"):
        arun(go())


@pytest.mark.parametrize("text,value", [
    ("340MB", 340_000_000), ("1.5GiB", 1_610_612_736), ("5308416", 5_308_416), ("64 kb", 64_000),
    ("2M", 2_000_000), ("10KiB", 10_240), ("1TB", 10**12),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MB", "-5MB", "0", "1.5 XB", "3 iB"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_kvasir_worker_with_budget_and_source_volunteers_and_serves(tiny, serve, manifests, tmp_path,
                                                                  nats_server, arun):
    import signal
    import subprocess
    import sys

    m = manifests(tiny)
    srv = serve(tiny, tokens=["cli-token"])

    async def go():
        nc = await connect(nats_server.url, "backbone")
        await Bus(nc, m, assign(m, (H(1, 4, 8),))).start()
        beats = asyncio.Queue()
        await nc.subscribe(Subjects(m.model).coverage("cli-1"), cb=beats.put)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": root, "KVASIR_NODE_TOKEN": "cli-token"}
        proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "worker", "--nats", nats_server.url,
                                 "--budget", "200kB", "--source", srv.url, "--cache-dir", str(tmp_path),
                                 "--node", "cli-1"], env=env, stderr=subprocess.PIPE)
        try:
            beat = codec.decode_heartbeat((await asyncio.wait_for(beats.get(), 20)).data)
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(proc.wait, 20)
        await nc.close()
        return beat, rc, proc.stderr.read().decode()

    beat, rc, err = arun(go(), timeout=40)
    assert rc == 0, err
    assert beat.holdings == (H(1, 4, 8),) and beat.budget_bytes == 200_000
    assert srv.served_to("cli-1") <= 1.05 * (4 * m.expert_bytes(1) + m.data_offset)


def test_cli_volunteering_needs_budget_and_source_and_no_slice(capsys):
    assert main(["worker", "--budget", "1MB"]) == 2
    assert "both --budget" in capsys.readouterr().err
    assert main(["worker", "--budget", "1MB", "--source", "x.gguf", "--slice", "s.gguf"]) == 2
    assert "leave out --slice" in capsys.readouterr().err
