"""Waiting on a condition in a test: poll a cheap in-process check, never sleep a fixed time."""

from __future__ import annotations

import asyncio


async def until(check, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``check()`` (cheap, in-process) every 20 ms until it holds; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)
