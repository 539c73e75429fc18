"""An asyncio event loop on a background thread, for synchronous code that talks to NATS.

The backbone's forward pass is plain synchronous numpy; its NATS client lives on this loop.
``run(coro)`` blocks until the coroutine is done; ``submit(coro)`` returns a
``concurrent.futures.Future``. ``stop()`` is idempotent and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Coroutine


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (the ``backbone`` extra; a worker uses it when
    its machine has it, and runs without it) and not turned off with ``KVASIR_UVLOOP=0``: its
    scheduling, timers, socket transports and cross-thread wake-up are C, which takes about a
    third off the bus thread's CPU per remote expert call (``bench/dispatch.py --overhead``);
    asyncio's own loop otherwise."""
    if os.environ.get("KVASIR_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(coro)`` on :func:`new_loop`'s loop: a role's main loop (the worker's)."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro)


class LoopThread:
    def __init__(self, name: str = "kvasir-bus"):
        self.loop = new_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, cancel what still runs on it, wait for the thread (at most ``timeout``:
        it is a daemon thread, so a task that ignores cancellation cannot keep the process)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> "LoopThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
