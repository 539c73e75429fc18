"""Shared test fixtures.

``nats_server``: a fresh embedded nats-server per test (function scope), on a free port, with
the deployment ``max_payload`` (8 MB) and a WebSocket listener on another free port. Starting
one takes ~20-50 ms, cheap enough that no test shares a bus (subscriptions left over by one
test cannot answer another's requests). Use ``nats_server.url`` (``nats://127.0.0.1:PORT``)
and ``nats_server.websocket_url``. It is stopped, and its temp dir removed, after the test.

``arun``: runs a coroutine to completion with a deadline, so async tests need no plugin::

    def test_echo(nats_server, arun):
        async def go():
            nc = await connect(nats_server.url, "test")
            ...
        arun(go())            # default deadline 10 s; arun(go(), timeout=30)
"""

from __future__ import annotations

import os

# The suite asserts batch invariance: run it in the deterministic kernel mode unless told
# otherwise (tests/kernels/test_mode.py runs the sharding tests in the fast mode too).
os.environ.setdefault("KVASIR_KERNEL_MODE", "deterministic")

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, Callable

import pytest

from kvasir_bus.server import EmbeddedNats


@pytest.fixture(scope="module", autouse=True)
def _module_state_home(tmp_path_factory):
    """The same for a module's own fixtures (a module-scoped swarm starts before any test's
    $XDG_STATE_HOME is set): one state home per module, never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("module-state")))
        yield


@pytest.fixture(autouse=True)
def _own_state_home(tmp_path_factory, monkeypatch):
    """Every test (and the processes it starts) gets its own $XDG_STATE_HOME: a backbone's
    default ledger spool lives there, and must not carry one test's wins into another."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(port=0, websocket_port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _run(coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


@pytest.fixture
def arun() -> Callable[..., Any]:
    return _run


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """models(arch, qtype, preset="tiny", seed=1, **overrides) -> path of a synthetic GGUF."""
    from tests.model_cache import ModelCache

    return ModelCache(tmp_path_factory)
