"""The sharding check every new architecture must pass: sharded == monolithic with a killed
worker and a slice worker (shared by the architecture tests)."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np

from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig


def assert_sharded_with_a_killed_worker_equals_monolithic(model, url: str, tmp_path,
                                                         n_prompt: int = 36, n_decode: int = 16) -> None:
    """Two workers (one holding experts 0-3 of every layer from the model, one serving a slice of
    experts 4-7); the first is SIGKILLed after 10 remote calls. Tokens and logits must equal the
    monolithic run bit for bit, and both the fallback and the survivor must have worked."""
    from backbone.dispatch import DispatchConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import spawn_worker, wait_for_nodes
    from modelfile.slicer import parse_span, plan_slice, write_slice
    from tests.polling import until

    engine = Engine(model)
    prompt = np.random.default_rng(7).integers(0, engine.cfg.n_vocab, n_prompt).tolist()
    mono = generate(engine, prompt, n_decode, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)

    part = tmp_path / "experts-4-7.gguf"
    write_slice(plan_slice(model, [(None, parse_span("4-7", "experts"))]), part)
    procs = []
    try:
        for node, args in (("victim", ["--model", str(model), "--layer", "all", "--experts", "0-3"]),
                           ("steady", ["--slice", str(part)])):
            procs.append(spawn_worker(url, node, args, heartbeat_s=0.5,
                                      log_file=open(tmp_path / f"{node}.log", "w")))
        fp = model_fingerprint(engine.reader)
        asyncio.run(wait_for_nodes(url, fp, {"victim", "steady"}, procs=procs))
        victim = procs[0]
        killed = []
        sharded_engine = Engine(model)
        cfg = BackboneConfig(model_path=sharded_engine.path, nats_url=url, dispatch=DispatchConfig(),
                             serve_manifest=False)
        with BackboneService(sharded_engine, cfg) as backbone:
            remote = backbone.dispatch
            # Both announce bundles (the default): every layer step goes to each in one message.
            remote.bus.run(until(lambda: remote.coverage.bundle_nodes == 2, "both workers' bundle heartbeats"))

            def on_token(_):
                if not killed and remote.stats.totals().remote > 20:
                    os.kill(victim.proc.pid, signal.SIGKILL)
                    victim.proc.wait()
                    killed.append(True)

            gen = generate(sharded_engine, prompt, n_decode, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True,
                           on_token=on_token)
            totals = remote.stats.totals()
            per_node = remote.stats.to_dict()["per_node"]
    finally:
        for p in procs:
            if p.alive():
                p.stop()
    assert killed, "the worker was never killed"
    assert gen.tokens == mono.tokens
    assert np.array_equal(gen.logits_array(), mono.logits_array())
    assert totals.remote > 0 and totals.local > 0 and totals.bundles > 0
    assert per_node["steady"]["calls"] > 0
