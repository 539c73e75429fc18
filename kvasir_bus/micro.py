"""Every role is a NATS micro service: ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` answer.

``nats micro list`` (and every NATS tool that speaks the micro protocol) finds the swarm's
processes through these subjects. :func:`start_service` registers one service per role process
with nats-py's :mod:`nats.micro`: its name is ``kvasir-<role>`` (``kvasir-worker``,
``kvasir-market``, ``kvasir-backbone``), its version the package's, and its metadata says who it
is (:class:`Card`: role, node, model fingerprint, kernel, version).

The subjects a role answers are *not* moved into micro endpoints: micro endpoints always join a
queue group, and the workers' dispatch subjects must stay plain subscriptions (replicas race,
the first reply wins). So a role describes the subjects it serves as :class:`Served` entries:
INFO lists them (subject, queue group, metadata) and STATS reports the role's own counters for
them (requests, errors, processing time, and a ``data`` map with more), read at the moment of
the request, exactly as the micro protocol shapes them.

:func:`connection_name` gives each process its NATS connection name,
``kvasir-<role>-<node>-<pid>``, unique per process (``nats server report connections``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvasir_bus import __version__

ROLES = ("worker", "market", "backbone")


def service_name(role: str) -> str:
    """``kvasir-<role>``: the micro service name every process of a role shares."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    return f"kvasir-{role}"


def connection_name(role: str, node: str | None = None, pid: int | None = None) -> str:
    """``kvasir-<role>-<node>-<pid>``: who a connection is, unique per process. ``role`` is a
    service role or a tool's name (``status``, ``tap``, ``up``).

    ``node`` defaults to the host name; a node named like its role (the market's default node is
    ``market``) is replaced by the host name, so no name reads ``kvasir-market-market``."""
    pid = os.getpid() if pid is None else pid
    if not node or node == role:
        node = _host()
    suffix = f"-{pid}" if not node.endswith(f"-{pid}") else ""  # a default worker id has it already
    return f"kvasir-{role}-{node}{suffix}"


def _host() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    return host or "localhost"


@dataclass(frozen=True)
class Card:
    """Who a service is: what ``$SRV.INFO`` and ``$SRV.PING`` carry in ``metadata``."""

    role: str
    node: str
    model: str  # the fingerprint; a market serving every model says "*"
    kernel: str = ""  # what computes experts here ("" where nothing does)
    version: str = __version__

    def __post_init__(self) -> None:
        service_name(self.role)  # an unknown role fails here

    def metadata(self) -> dict[str, str]:
        return {"role": self.role, "node": self.node, "model": self.model,
                "kernel": self.kernel or "none", "version": self.version, "pid": str(os.getpid())}


@dataclass
class Tally:
    """Counters of one served subject, in the micro protocol's terms."""

    requests: int = 0
    errors: int = 0
    processing_ns: int = 0
    last_error: str = ""
    data: dict[str, Any] | None = None

    def record(self, seconds: float, error: str | None = None) -> None:
        """One request that took ``seconds``; ``error`` says why it failed, if it did."""
        self.requests += 1
        self.processing_ns += int(seconds * 1e9)
        if error is not None:
            self.errors += 1
            self.last_error = error[:200]

    def timer(self) -> _Timer:
        """``with tally.timer() as t: ...`` records one request; ``t.error = "..."`` fails it
        (an exception escaping the block fails it too, and propagates)."""
        return _Timer(self)


class _Timer:
    def __init__(self, tally: Tally) -> None:
        self.tally, self.error = tally, None

    def __enter__(self) -> _Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None and self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"
        self.tally.record(time.perf_counter() - self.t0, self.error)


@dataclass(frozen=True)
class Served:
    """A subject a role answers outside :mod:`nats.micro`, described for INFO and STATS.

    ``stats`` returns the current counters (called for each ``$SRV.STATS`` request);
    ``queue_group`` is "" for plain subscriptions (replicas race)."""

    name: str
    subject: str
    stats: Callable[[], Tally]
    queue_group: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


def _service_class():
    from nats.micro.service import EndpointInfo, EndpointStats, Service

    class RoleService(Service):
        """A micro service whose INFO and STATS also list the role's :class:`Served` subjects."""

        def __init__(self, client: Any, config: Any, served: Sequence[Served]) -> None:
            super().__init__(client, config)
            self.served = tuple(served)

        def info(self):
            info = super().info()
            info.endpoints += [EndpointInfo(name=s.name, subject=s.subject, queue_group=s.queue_group,
                                            metadata=dict(s.metadata)) for s in self.served]
            return info

        def stats(self):
            stats = super().stats()
            for s in self.served:
                t = s.stats()
                stats.endpoints.append(EndpointStats(
                    name=s.name, subject=s.subject, queue_group=s.queue_group,
                    num_requests=t.requests, num_errors=t.errors, last_error=t.last_error,
                    processing_time=t.processing_ns,
                    average_processing_time=t.processing_ns // t.requests if t.requests else 0,
                    data=t.data))
            return stats

    return RoleService


async def start_service(nc: Any, card: Card, served: Sequence[Served] = (), *,
                        description: str = "") -> Any:
    """Register ``card``'s micro service on ``nc`` and answer ``$SRV.*`` until ``stop()``.

    Returns the :class:`nats.micro.service.Service` (``await svc.stop()`` unsubscribes; it is
    idempotent). The ``$SRV`` subscriptions are live on the server when this returns."""
    from nats.micro.service import ServiceConfig

    config = ServiceConfig(name=service_name(card.role), version=card.version,
                           description=description or f"Kvasir {card.role} {card.node}",
                           metadata=card.metadata())
    service = _service_class()(nc, config, served)
    await service.start()
    return service


async def stop_service(service: Any) -> None:
    """Stop ``service`` (None: nothing to do); never raises (the connection may be gone)."""
    if service is None:
        return
    try:
        await service.stop()
    except Exception:  # a closed connection: the server dropped the subscriptions already
        pass
