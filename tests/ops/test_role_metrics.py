"""/metrics of the backbone's HTTP server and of a worker asked for it (``--metrics``)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvasir_bus import codec
from kvasir_bus.cli import main
from kvasir_bus.connect import connect
from kvasir_bus.metrics import render
from kvasir_bus.subjects import Subjects

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


def samples(text: str) -> dict[str, float]:
    """Exposition text -> {sample name{sorted labels}: value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model", "node"))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def test_backbone_http_server_counts_tokens_and_steps_on_metrics(models):
    from backbone.model import Engine
    from backbone.server_http import ServerConfig, ServerThread
    from backbone.tokenizer import Tokenizer

    path = models("qwen3moe", "q8_0")
    with ServerThread(Engine(path), Tokenizer(path), ServerConfig(port=0, model_name="tiny")) as server:
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            usage = json.load(r)["usage"]
        got = samples(get(server.url + "/metrics"))
        steps = server.server.scheduler.stats.steps
    assert got["kvasir_backbone_tokens_total{}"] == usage["completion_tokens"] == 3
    assert got["kvasir_backbone_steps_total{}"] == steps >= 3
    assert "kvasir_dispatch_fallback_rate{}" not in got  # every expert local: no dispatch to report


def test_backbone_service_times_each_winning_reply(nats_server, arun, models, tmp_path):
    from backbone.generate import generate
    from backbone.metrics import backbone_registry
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.dispatch import DispatchConfig
    from backbone.service import BackboneConfig, BackboneService
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice
    from kvasir_bus.loopthread import LoopThread
    from workers.runtime import Worker, WorkerConfig

    path = models("qwen3moe", "q8_0")
    out = write_slice(plan_slice(path, [(parse_span("all", "--layer"), parse_span("all", "--experts"))]),
                      tmp_path / "all.gguf").path
    bus = LoopThread("test-worker")
    nc = bus.run(connect(nats_server.url, "test-worker"))
    worker = Worker(load_slice(out), WorkerConfig(node="w-all", heartbeat_s=60))
    bus.run(worker.start(nc))
    try:
        engine = Engine(path)
        # a fixed timeout: every call waits for the worker (with the adaptive one a fresh backbone
        # computes its first steps here while the calls are out, and a two-token run may use none)
        cfg = BackboneConfig(model_path=engine.path, nats_url=nats_server.url, market=False,
                             dispatch=DispatchConfig(timeout_s=10.0))
        with BackboneService(engine, cfg) as service:
            generate(engine, [1, 2, 3], 2, Sampler(SamplerConfig()))
            got = samples(arun(render(backbone_registry(service.metrics))).decode())
            remote = service.stats.totals().remote
    finally:
        bus.run(worker.stop())
        bus.run(nc.close())
        bus.stop()
    assert remote > 0
    replies = sum(v for k, v in got.items() if k.startswith("kvasir_dispatch_reply_seconds_count"))
    assert replies == remote  # one observation per winning reply
    assert got["kvasir_dispatch_node_calls_total{}"] == remote


def test_worker_serves_metrics_when_asked(nats_server, arun, models, tmp_path):
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice
    from workers.runtime import Worker, WorkerConfig

    path = models("qwen3moe", "q8_0")
    info = load_slice(write_slice(plan_slice(path, [(parse_span("1", "--layer"), parse_span("0-3", "--experts"))]),
                                  tmp_path / "s.gguf").path)

    async def go():
        nc = await connect(nats_server.url, "test-worker")
        worker = Worker(info, WorkerConfig(node="w-m", heartbeat_s=60, metrics="127.0.0.1:0"))
        await worker.start(nc)
        req = codec.DispatchRequest(model=info.fingerprint, layer=1, expert=2,
                                    rows=np.ones((5, info.n_embd), np.float32), request_id="r1")
        await nc.request(Subjects(info.fingerprint).dispatch(1, 2), req.encode(), timeout=5)
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.get(worker.metrics_server.url + "/metrics") as r:
                text = await r.text()
        await worker.stop()
        await nc.close()
        return text

    got = samples(arun(go(), timeout=30))
    assert got["kvasir_worker_requests_total{outcome=served}"] == 1
    assert got["kvasir_worker_rows_total{}"] == 5
    assert got["kvasir_worker_experts_held{}"] == 4
    assert got["kvasir_worker_compute_seconds_count{layer=1}"] == 1


def test_worker_metrics_flag_refuses_a_bad_address_in_one_line(capsys):
    assert main(["worker", "--slice", "x.gguf", "--metrics", "nowhere:port"]) == 2
    err = capsys.readouterr().err.strip()
    assert "[HOST:]PORT" in err and len(err.splitlines()) == 1
