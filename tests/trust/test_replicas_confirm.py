"""A winner is checked before it is used (race mode's ``confirm`` wait): a sleeper that always
wins the race, beside an honest replica a few milliseconds slower, changes no token.

Without the wait, the sleeper's racing lies beat the honest reply every time and are used in
their step (the comparison runs when the loser comes, after the step): only sampled audits
would stop them, up to the stated bound of lies used. With it, the step waits for the slower
replica (the step's round trip, at least 5 ms), compares, audits both on a disagreement and
recomputes the call."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

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


class Race(NamedTuple):
    changed: int  # tokens that differ from the monolithic run's, in all generations
    stats: dict  # the dispatch statistics
    handed: int  # steps the engine thread handed to the bus thread
    steady: liars.BusLiar
    sleeper: liars.BusLiar


def race(rate, model, prompt, monolithic, bus, generations=GENERATIONS) -> Race:
    """A sleeper that wins every race beside an honest replica ``SLOWER_S`` slower, at audit
    ``rate``: ``generations`` greedy generations on a fresh backbone."""
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=bus.url, market=False, serve_manifest=False,
                         dispatch=DispatchConfig(audit=AuditConfig(rate=rate)))
    changed = 0
    with liars.BusLiar(model, bus.url, honest, node="steady", delay_s=SLOWER_S) as steady, \
            liars.BusLiar(model, bus.url, liars.sleeper(60), node="sleeper") as sleeper:
        with BackboneService(engine, cfg) as backbone:
            asyncio.run(until(lambda: {"sleeper", "steady"} <= set(backbone.dispatch.coverage.bundle_holders(0, 0)),
                              "the backbone hears both replicas", 20))
            for _ in range(generations):
                tokens = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False).tokens
                changed += sum(a != b for a, b in zip(tokens, monolithic))
            return Race(changed, backbone.stats.to_dict(), backbone.dispatch.handed_steps, steady, sleeper)


@pytest.mark.parametrize("rate", [0.1, 0.0], ids=["default-audit", "no-audit"])
def test_a_sleeper_that_always_wins_the_race_changes_no_token(rate, model, prompt, monolithic, bus):
    got = race(rate, model, prompt, monolithic, bus)
    totals = got.stats["totals"]
    assert got.sleeper.lies > 0, "the sleeper never lied (too few calls)"
    assert got.stats["quarantined"] == ["sleeper"]
    assert got.steady.lies == 0 and "steady" not in got.stats["quarantined"]
    # the paths the lies could take, whole (a dict in pytest's message is cut short)
    assert got.changed == 0, repr({k: v for k, v in totals.items() if k in (
        "confirm_waits", "confirm_missed", "disputes", "recomputed", "timeouts", "late", "duplicates")}
        | {"handed": got.handed})
    assert np.isfinite(totals["latency_mean_ms"])


def test_a_step_handed_to_the_bus_thread_still_checks_its_winners(model, prompt, monolithic, bus, monkeypatch):
    """A step the engine thread hands over (a reply it cannot take itself: an error, a
    quarantined sender's, a forgery) waits for its racing replicas as any other step does. The
    engine thread here takes no reply at all, so every step is handed over; without the wait
    there, the sleeper's racing lies were used unchecked (this test changed tokens)."""
    from backbone.dispatch import RemoteExperts

    monkeypatch.setattr(RemoteExperts, "_take_direct", lambda self, bundle, msg, stats: False)
    got = race(0.0, model, prompt, monolithic, bus, generations=2)
    assert got.sleeper.lies > 0 and got.handed > 0, (got.sleeper.lies, got.handed)
    assert got.stats["quarantined"] == ["sleeper"] and got.steady.lies == 0
    assert got.changed == 0, got.stats["totals"]
