"""``kvasir worker --enrol LINK``: serve under an identity the enrolment service signed for this
process's own fresh key (:mod:`kvasir_bus.enrol`), and renew it while serving.

Renewal makes before it breaks: at half the JWT's lifetime the worker asks for a fresh JWT over
its own connection, opens a second connection with it, starts a second :class:`Worker` on the
same slice there (subscribed and flushed before it says anything), and only then drains the
first (requests in flight are answered) and closes its connection, before the old JWT expires
and the server would drop it. Between the two, both connections hold the subjects: a race-mode
request gets two replies and the backbone takes the first, as with any two replicas.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import structlog

from kvasir_bus import enrol
from kvasir_bus.connect import ConnectOptions, connect

log = structlog.get_logger("kvasir.worker")


class EnrolledServing:
    """An enrolled identity and the worker serving under it, renewed in place."""

    def __init__(self, url: str, identity: enrol.Enrolled, creds_path: Path, slice_info, worker_cfg,
                 token: str | None = None, link_url: str | None = None):
        self.url, self.identity, self.creds_path = url, identity, Path(creds_path)
        self.token = token  # for a renewal over a guest connection when our own is gone
        self.link_url = link_url or url  # where that renewal asks: the bus, or the HTTP(S) service
        self.slice, self.cfg = slice_info, replace(worker_cfg, node=identity.name, reply_key=identity.reply_key)
        self.nc = self.worker = None
        self.renewals = 0
        self._task: asyncio.Task | None = None

    async def _open(self):
        from workers.runtime import Worker

        nc = await connect(self.url, f"worker-{self.identity.name}",
                           options=ConnectOptions(creds=str(self.creds_path)))
        worker = Worker(self.slice, self.cfg)
        await worker.start(nc)
        return nc, worker

    async def start(self) -> "EnrolledServing":
        self.identity.write(self.creds_path)
        self.nc, self.worker = await self._open()
        self._task = asyncio.create_task(self._renew_loop())
        return self

    async def _renew_loop(self) -> None:
        while True:
            ttl = max(1.0, self.identity.exp - time.time())
            await asyncio.sleep(ttl / 2)
            try:
                await self.renew()
            except Exception as exc:  # the service may be away: try again at half the rest
                log.warning("renewal_failed", node=self.identity.name, error=str(exc)[:160])

    async def renew(self) -> None:
        """A fresh JWT, a new connection and worker with it, then the old ones drained."""
        if self.nc.is_connected or self.token is None:
            fresh = await enrol.request_identity(self.nc, self.identity.seed, None)
        else:  # our connection is down (its JWT may have run out): ask as the token's holder
            fresh = await enrol.enrol_link(self.link_url, self.token, seed=self.identity.seed)
        self.identity = fresh
        fresh.write(self.creds_path)
        old_nc, old_worker = self.nc, self.worker
        self.nc, self.worker = await self._open()
        await old_worker.stop()  # unsubscribes, answers what it holds
        await old_nc.drain()
        self.renewals += 1
        log.info("identity_renewed", node=fresh.name, exp=fresh.exp, renewals=self.renewals)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.worker is not None:
            await self.worker.stop()
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()


async def enrol_and_serve(link: str, token: str | None, cache_dir: str, worker_cfg, *, slice_info=None,
                          volunteer_cfg=None) -> int:
    """Enrol with the join ``link`` (``nats://host:port#TOKEN`` over the bus, or
    ``https://host:port/enrol#TOKEN`` over HTTPS, whose answer names the bus), then serve
    ``slice_info`` or volunteer with ``volunteer_cfg`` (the market assigns a range), until
    SIGTERM/SIGINT."""
    import os
    import signal

    from workers.volunteer import default_cache_dir, volunteer

    link_url, link_token = enrol.split_link(link)
    identity = await enrol.enrol_link(link_url, token or link_token)
    url = identity.bus_url
    folder = Path(cache_dir or default_cache_dir()) / "enrolled"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    creds_path = folder / f"{identity.name}.creds"
    log.info("enrolled", node=identity.name, exp=identity.exp, creds=str(creds_path))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if slice_info is None:  # volunteer: ask the market over a first connection as ourselves
        identity.write(creds_path)
        nc = await connect(url, f"worker-{identity.name}", options=ConnectOptions(creds=str(creds_path)))
        try:
            got = await volunteer(nc, replace(volunteer_cfg, node=identity.name))
        finally:
            await nc.drain()
        slice_info = got.slice
        worker_cfg = replace(worker_cfg, budget_bytes=volunteer_cfg.budget_bytes)
    serving = await EnrolledServing(url, identity, creds_path, slice_info, worker_cfg,
                                    token=token or link_token, link_url=link_url).start()
    try:
        await stop.wait()
    finally:
        await serving.stop()
        os.environ.pop("NATS_CREDS", None)
    return 0
