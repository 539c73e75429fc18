"""Replicas check each other for free (race mode): the losing reply of a call is compared with the
winner's, and a disagreement audits both here. A sleeper (honest for a while, then lying) beside
one honest replica is caught at its first lies that race the honest reply."""

from __future__ import annotations

import asyncio

import pytest

from backbone.audit import AuditConfig
from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from tests.polling import until
from tests.trust import liars
from tests.trust.test_audit_bound import bus, honest_worker, model, monolithic, prompt, N_DECODE  # noqa: F401

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")

GENERATIONS = 8


@pytest.mark.parametrize("rate", [0.1, 0.0], ids=["default-audit", "no-audit"])
def test_a_sleeper_beside_an_honest_replica_is_caught_by_the_race_and_changes_no_token(
        rate, model, prompt, monolithic, honest_worker, bus):
    """``no-audit``: the backbone recomputes nothing unless replicas disagree, so only the
    comparison can catch the sleeper; with the default audit, as the issue asks."""
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=bus.url, market=False, serve_manifest=False,
                         dispatch=DispatchConfig(audit=AuditConfig(rate=rate)))
    changed = 0
    with liars.BusLiar(model, bus.url, liars.sleeper(60), node="sleeper") as sleeper:
        with BackboneService(engine, cfg) as backbone:
            asyncio.run(until(lambda: {"sleeper", "honest"} <= set(backbone.dispatch.coverage.bundle_holders(0, 0)),
                              "the backbone hears both replicas", 20))
            for _ in range(GENERATIONS):
                tokens = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False).tokens
                changed += sum(a != b for a, b in zip(tokens, monolithic))
            stats = backbone.stats.to_dict()
    assert sleeper.lies > 0, "the sleeper never lied (too few calls)"
    assert stats["quarantined"] == ["sleeper"]
    if rate > 0:
        assert changed == 0  # caught by the race's comparison or by a sampled audit, whichever came first
    else:
        assert stats["totals"]["disputes"] >= 1  # only the comparison could catch it
    # With no audit at all, a lie that wins its race before the honest reply arrives is used in
    # that step (the comparison is made when the loser comes): the sleeper is caught all the same,
    # at its first racing lies, but a token may change once. docs/trust.md says so.
