"""Worker-side stamps of ``bench/timeline.py``: loaded by a worker process only when that script
puts this folder first on its PYTHONPATH and sets KVASIR_TIMELINE (a file prefix); any other
process finds the variable unset and this file does nothing.

Once ``workers.runtime`` is imported, its bundle handler, its kernels (the bound decode step and
the one-expert function) and its reply publish are wrapped to append
``perf_counter_ns pid thread event`` lines to ``<prefix>.<pid>`` (CLOCK_MONOTONIC: the same clock
as the backbone's stamps in the script's own process)."""

import importlib.abc
import importlib.util
import os
import sys
import threading
import time

_PREFIX = os.environ.get("KVASIR_TIMELINE")


def _install() -> None:
    out = open(f"{_PREFIX}.{os.getpid()}", "w", buffering=1)

    def stamp(event: str) -> None:
        out.write(f"{time.perf_counter_ns()} {os.getpid()} {threading.get_native_id()} {event}\n")

    def wrap_runtime(rt) -> None:
        from kernels import ggml

        on_bundle, send, timed, step = rt.Worker._on_bundle, rt.Worker._send, rt._timed, ggml.MoeStep.__call__

        async def on_bundle_(self, msg):
            stamp("w_msg")
            await on_bundle(self, msg)

        async def send_(self, *a, **kw):
            await send(self, *a, **kw)
            stamp("w_sent")

        def timed_(weights, rows):
            stamp("w_k0")
            try:
                return timed(weights, rows)
            finally:
                stamp("w_k1")

        def step_(self, *a, **kw):
            stamp("w_k0")
            try:
                return step(self, *a, **kw)
            finally:
                stamp("w_k1")

        rt.Worker._on_bundle, rt.Worker._send, rt._timed, ggml.MoeStep.__call__ = on_bundle_, send_, timed_, step_

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "workers.runtime":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                wrap_runtime(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Hook())


if _PREFIX:
    _install()
