"""The backbone role: its frozen config, parsed once, and the service's lifecycle."""

from __future__ import annotations

import argparse

import pytest

from backbone.dispatch import RemoteExperts
from backbone.service import BackboneConfig, BackboneService, State
from kvasir_bus.errors import UsageError


def args(**kw) -> argparse.Namespace:
    base = dict(model="m.gguf", nats=None, timeout_ms=None, wire_dtype="float32", ctx=None,
                serve_weights=None, token=[], advertise_host=None)
    return argparse.Namespace(**{**base, **kw})


def test_config_from_flags_builds_the_dispatch_config_once(monkeypatch):
    monkeypatch.delenv("KVASIR_NODE_TOKEN", raising=False)
    cfg = BackboneConfig.from_args(args(nats="nats://h:1", timeout_ms=250, wire_dtype="float16", ctx=64),
                                   serve_manifest=False)
    assert (cfg.model_path, cfg.nats_url, cfg.wire_dtype, cfg.n_ctx) == ("m.gguf", "nats://h:1", "float16", 64)
    assert cfg.dispatch.timeout_s == 0.25 and not cfg.serve_manifest and cfg.tokens == ()
    with pytest.raises(Exception):
        cfg.nats_url = "elsewhere"  # frozen


def test_node_token_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("KVASIR_NODE_TOKEN", "env-token")
    assert BackboneConfig.from_args(args()).tokens == ("env-token",)
    assert BackboneConfig.from_args(args(token=["a", "b"])).tokens == ("a", "b")


@pytest.mark.parametrize("flags, message", [
    (dict(timeout_ms=0), "--timeout-ms must be positive"),
    (dict(timeout_ms=-5), "--timeout-ms must be positive"),
    (dict(serve_weights="nope"), "--serve-weights wants PORT or HOST:PORT"),
    (dict(serve_weights="70000"), "port must be 0..65535"),
    (dict(wire_dtype="int8"), "wire dtype must be one of"),
])
def test_bad_flags_are_one_line_usage_errors(flags, message):
    with pytest.raises(UsageError, match=message):
        BackboneConfig.from_args(args(**flags))


def test_stop_before_start_is_harmless_and_final():
    service = BackboneService(engine=None, cfg=BackboneConfig(model_path="m.gguf"))
    assert service.state is State.NEW
    service.stop()
    service.stop()
    assert service.state is State.STOPPED
    with pytest.raises(RuntimeError, match="stopped"):
        service.start()


def test_start_and_stop_are_idempotent_and_hand_the_engine_its_experts(nats_server, models):
    pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")
    from backbone.model import Engine

    engine = Engine(models("qwen3moe", "q8_0"))
    local = engine.experts
    cfg = BackboneConfig(model_path=engine.path, nats_url=nats_server.url, market=False)
    with BackboneService(engine, cfg) as service:
        assert service.state is State.RUNNING
        assert service.start() is service  # a second start changes nothing
        assert isinstance(engine.experts, RemoteExperts) and engine.experts is service.dispatch
        assert service.manifest is not None and service.market_link is None
        assert service.wait_ledger_acked(0.1) is False  # no market link: nothing will be acked
    assert service.state is State.STOPPED and engine.experts is local
    service.stop()  # and a second stop too
    assert service.stats.totals().remote == 0  # the counters stay readable after stop
