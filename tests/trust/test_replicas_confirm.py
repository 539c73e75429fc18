"""A winner is checked before it is used (race mode's ``confirm`` wait): a sleeper that always
wins the race, beside an honest replica a few milliseconds slower, changes no token.

Without the wait, the sleeper's racing lies beat the honest reply every time and are used in
their step (the comparison runs when the loser comes, after the step): only sampled audits
would stop them, up to the stated bound of lies used. With it, the step waits for the slower
replica (the step's round trip, at least 5 ms), compares, audits both on a disagreement and
recomputes the call."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backbone.audit import AuditConfig
from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from tests.polling import until
from tests.trust import liars
from tests.trust.test_audit_bound import bus, model, monolithic, prompt, N_DECODE  # noqa: F401

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")

GENERATIONS = 6
SLOWER_S = 0.002  # the honest replica's extra delay per reply: it loses every race


def honest(out, layer, n):
    return out


honest.needs_honest = True


@pytest.mark.parametrize("rate", [0.1, 0.0], ids=["default-audit", "no-audit"])
def test_a_sleeper_that_always_wins_the_race_changes_no_token(rate, model, prompt, monolithic, bus):
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=bus.url, market=False, serve_manifest=False,
                         dispatch=DispatchConfig(audit=AuditConfig(rate=rate)))
    changed = 0
    with liars.BusLiar(model, bus.url, honest, node="steady", delay_s=SLOWER_S) as steady, \
            liars.BusLiar(model, bus.url, liars.sleeper(60), node="sleeper") as sleeper:
        with BackboneService(engine, cfg) as backbone:
            asyncio.run(until(lambda: {"sleeper", "steady"} <= set(backbone.dispatch.coverage.bundle_holders(0, 0)),
                              "the backbone hears both replicas", 20))
            for _ in range(GENERATIONS):
                tokens = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False).tokens
                changed += sum(a != b for a, b in zip(tokens, monolithic))
            stats = backbone.stats.to_dict()
            handed = backbone.dispatch.handed_steps
    totals = stats["totals"]
    assert sleeper.lies > 0, "the sleeper never lied (too few calls)"
    assert stats["quarantined"] == ["sleeper"]
    assert steady.lies == 0 and "steady" not in stats["quarantined"]
    # the paths the lies could take, whole (a dict in pytest's message is cut short)
    assert changed == 0, repr({k: v for k, v in totals.items() if k in (
        "confirm_waits", "confirm_missed", "disputes", "recomputed", "timeouts", "late", "duplicates")} | {"handed": handed})
    assert np.isfinite(totals["latency_mean_ms"])


def test_a_step_handed_to_the_bus_thread_still_checks_its_winners(model, prompt, monolithic, bus, monkeypatch):
    """A step the engine thread hands over (a reply it cannot take itself: an error, a
    quarantined sender's, a forgery) waits for its racing replicas as any other step does. The
    engine thread here takes no reply at all, so every step is handed over; without the wait
    there, the sleeper's racing lies were used unchecked whenever a loaded machine put a step on
    that path (2 tokens changed in a fresh-clone CI run)."""
    from backbone.dispatch import RemoteExperts

    monkeypatch.setattr(RemoteExperts, "_take_direct", lambda self, bundle, msg, stats: False)
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=bus.url, market=False, serve_manifest=False,
                         dispatch=DispatchConfig(audit=AuditConfig(rate=0.0)))
    changed = 0
    with liars.BusLiar(model, bus.url, honest, node="steady", delay_s=SLOWER_S) as steady, \
            liars.BusLiar(model, bus.url, liars.sleeper(60), node="sleeper") as sleeper:
        with BackboneService(engine, cfg) as backbone:
            asyncio.run(until(lambda: {"sleeper", "steady"} <= set(backbone.dispatch.coverage.bundle_holders(0, 0)),
                              "the backbone hears both replicas", 20))
            for _ in range(2):
                tokens = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False).tokens
                changed += sum(a != b for a, b in zip(tokens, monolithic))
            stats = backbone.stats.to_dict()
            handed = backbone.dispatch.handed_steps
    assert sleeper.lies > 0 and handed > 0, (sleeper.lies, handed)
    assert stats["quarantined"] == ["sleeper"] and steady.lies == 0
    assert changed == 0, stats["totals"]
