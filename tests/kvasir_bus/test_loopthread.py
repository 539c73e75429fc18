"""Which event loop the roles run on: uvloop's where it is installed, asyncio's when
``KVASIR_UVLOOP=0`` says so (or without uvloop); the bus thread and a worker's main loop alike."""

from __future__ import annotations

import asyncio

import pytest

from kvasir_bus import loopthread


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_runs_the_bus_thread_and_a_roles_main_loop_where_installed(monkeypatch):
    pytest.importorskip("uvloop", reason="uvloop is in the backbone extra; without it asyncio's loop runs")
    monkeypatch.delenv("KVASIR_UVLOOP", raising=False)
    assert loopthread.run(_loop_module()).startswith("uvloop")
    bus = loopthread.LoopThread("test-uvloop")
    try:
        assert bus.run(_loop_module(), timeout=10).startswith("uvloop")
    finally:
        bus.stop()


def test_kvasir_uvloop_0_keeps_asyncios_own_loop(monkeypatch):
    monkeypatch.setenv("KVASIR_UVLOOP", "0")
    assert loopthread.run(_loop_module()).startswith("asyncio")
    bus = loopthread.LoopThread("test-asyncio")
    try:
        assert bus.run(_loop_module(), timeout=10).startswith("asyncio")
    finally:
        bus.stop()
