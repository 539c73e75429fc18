"""A liar that speaks the whole wire contract: per-expert requests *and* bundles, with a heartbeat.

What an attacker does: fork the worker and change what it replies. It computes the honest answer
with the backbone's own kernel (so an audit demands identical bits), then replies ``lie(honest,
layer, n)`` (``n``: its replies so far). It announces every expert of the model and, with
``bundles``, takes bundles on its node subject, so it races an honest bundle worker too.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from backbone.model import Engine
from kernels.backend import kernel_label
from kernels.expert import expert_ffn
from kvasir_bus import codec, market_codec
from kvasir_bus.codec import Holding
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects, parse_dispatch


def noise(out, layer, n):
    return np.random.default_rng(n).standard_normal(out.shape).astype(np.float32)


def zeros(out, layer, n):
    return np.zeros_like(out)


def scaled(out, layer, n):
    return (out * np.float32(1 + 1e-3)).astype(np.float32)


scaled.needs_honest = True  # the others need only the shape: the liar answers them fast, and wins races


def sleeper(after: int, lie=noise):
    """Honest for its first ``after`` replies, then ``lie`` on every one."""
    def lies(out, layer, n):
        return lie(out, layer, n) if n >= after else out
    lies.needs_honest = True
    return lies


class BusLiar:
    """Answers every expert of the model (per expert and, with ``bundles``, in bundles)."""

    def __init__(self, model_path, url: str, lie, node: str = "liar", *, bundles: bool = True,
                 heartbeat_s: float = 0.2, kernel: str | None = None, backend: str | None = None,
                 delay_s: float = 0.0):
        self.engine, self.url, self.lie, self.node = Engine(model_path), url, lie, node
        self.model = model_fingerprint(self.engine.reader)
        self.subjects = Subjects(self.model)
        self.bundles, self.heartbeat_s = bundles, heartbeat_s
        self.delay_s = delay_s  # added before each reply goes out: a slower replica
        self.kernel = kernel or kernel_label()  # what it announces (None: the backbone's own kernel)
        self.backend = backend  # what its honest answer is computed with (None: this process's default)
        self.sent = 0  # replies (calls answered)
        self.lies = 0
        self.first_lie_at: float | None = None
        self.quarantined = threading.Event()
        self.caught_at: float | None = None
        self.bus = LoopThread(f"liar-{node}")
        self._stop = asyncio.Event()

    def __enter__(self) -> "BusLiar":
        self.nc = self.bus.run(connect(self.url, name=f"kvasir-test-{self.node}"))
        self.bus.run(self._listen())
        self._beat = self.bus.submit(self._heartbeats())
        return self

    def __exit__(self, *exc) -> None:
        self.bus.loop.call_soon_threadsafe(self._stop.set)
        try:
            self._beat.result(5)
        except Exception:
            pass
        self.bus.run(self.nc.close())
        self.bus.stop()

    def heartbeat(self) -> codec.Heartbeat:
        cfg = self.engine.cfg
        return codec.Heartbeat(model=self.model, node=self.node,
                               holdings=tuple(Holding(layer, 0, cfg.n_expert) for layer in range(cfg.n_layer)),
                               budget_bytes=0, load=0.0, served=self.sent, version="0", kernel=self.kernel,
                               sent_at=time.time(), bundles=self.bundles)

    async def _heartbeats(self) -> None:
        while not self._stop.is_set():
            await self.nc.publish(self.subjects.coverage(self.node), self.heartbeat().encode())
            try:
                await asyncio.wait_for(self._stop.wait(), self.heartbeat_s)
            except asyncio.TimeoutError:
                pass

    async def _listen(self) -> None:
        await self.nc.subscribe(self.subjects.dispatch_all(), cb=self._answer)
        if self.bundles:
            await self.nc.subscribe(self.subjects.node(self.node), cb=self._answer_bundle)
        await self.nc.subscribe(self.subjects.quarantine(), cb=self._heard)
        await self.nc.flush()

    async def _heard(self, msg) -> None:
        try:
            event = market_codec.decode_quarantine(msg.data)
        except Exception:
            return
        if event.node == self.node:
            self.caught_at = event.at
            self.quarantined.set()

    def _out(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        if getattr(self.lie, "needs_honest", False):
            honest = expert_ffn(*self.engine.weights.expert(layer, expert), rows.astype(np.float32), routed=True,
                                backend=self.backend)
        else:
            honest = np.full((len(rows), self.engine.cfg.n_embd), np.nan, np.float32)  # never equal: a lie
        out = np.ascontiguousarray(self.lie(honest, layer, self.sent), dtype=np.float32)
        if not np.array_equal(out, honest):
            self.lies += 1
            if self.first_lie_at is None:
                self.first_lie_at = time.time()
        self.sent += 1
        return out

    async def _answer(self, msg) -> None:
        req = codec.decode_request(msg.data)
        out = self._out(parse_dispatch(msg.subject).layer, req.expert, req.rows)
        reply = codec.DispatchReply(request_id=req.request_id, node=self.node, rows=out, kernel=self.kernel)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await self.nc.publish(msg.reply, reply.encode())

    async def _answer_bundle(self, msg) -> None:
        bundle = codec.decode_bundle(msg.data)
        outs = [self._out(bundle.layer, expert, bundle.rows[bundle.call_index(i)])
                for i, expert in enumerate(bundle.experts)]
        payload = codec.BundleReplyEncoder(self.node, self.kernel).encode_answers(bundle, np.concatenate(outs))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await self.nc.publish(msg.reply, payload)
