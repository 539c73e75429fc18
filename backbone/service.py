"""The backbone on the bus: one frozen :class:`BackboneConfig`, one :class:`BackboneService`.

While running, the service

* dispatches the engine's routed experts to the workers with local fallback
  (:class:`backbone.dispatch.RemoteExperts`; the engine is handed it with ``use_experts`` at
  start and given its local experts back at stop);
* publishes routing statistics and ledger events for the market (:class:`MarketLink`);
* answers ``kvasir.<model>.manifest`` with the SHA-256 manifest of every expert slab (the
  market learns the model's geometry from it; volunteers verify their downloads against it);
* optionally serves its own GGUF over HTTP with Range support (``serve_weights``), behind
  node tokens when configured (a request without a valid token gets 401).

Lifecycle like the worker's and the market's: ``NEW -> RUNNING -> STOPPING -> STOPPED``;
``start()`` and ``stop()`` are idempotent; ``with BackboneService(...) as bb:`` does both.
The synchronous engine drives it from its own thread; the NATS client lives on a loop thread.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

import structlog

from backbone.coverage_view import CoverageView
from backbone.audit import AuditConfig
from backbone.dispatch import DispatchConfig, RemoteExperts, log_summary
from backbone.dispatch_stats import DispatchStats
from backbone.hot_experts import HotConfig, HotExperts
from backbone.metrics import DispatchCollector
from backbone.model import WIRE_DTYPES
from backbone.replicas import ReplicaConfig, Replicas
from kvasir_bus import micro
from kvasir_bus.errors import UsageError
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects

log = structlog.get_logger("kvasir.backbone")


def parse_listen(spec: str) -> tuple[str, int]:
    """``PORT``, ``:PORT`` or ``HOST:PORT`` -> (host, port); the host defaults to 127.0.0.1."""
    host, _, port = spec.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"--serve-weights wants PORT or HOST:PORT, got {spec!r}") from None
    if not 0 <= number <= 65535:
        raise UsageError(f"--serve-weights port must be 0..65535, got {number}")
    return host or "127.0.0.1", number


@dataclass(frozen=True)
class BackboneConfig:
    """Everything the backbone role is told, parsed once (``from_args``) and passed down whole."""

    model_path: str
    nats_url: str | None = None  # None: $NATS_URL, else the local default (kvasir_bus.connect)
    node: str = "backbone"
    dispatch: DispatchConfig = DispatchConfig()
    wire_dtype: str = "float32"  # rounding of rows on the wire, applied to local experts too
    n_ctx: int | None = None
    market: bool = True  # routing statistics and ledger events for a market
    market_interval_s: float = 1.0
    serve_manifest: bool = True  # answer manifest requests (a long-running backbone does)
    serve_weights: str | None = None  # [HOST:]PORT to serve the GGUF on
    tokens: tuple[str, ...] = ()  # node tokens for weight downloads; none: open
    advertise_host: str | None = None
    disconnect_timeout_s: float = 10.0
    replicas: ReplicaConfig = ReplicaConfig()  # race or balance (hedged) with the workers' replicas
    hot: HotConfig = HotConfig()  # compute an expert here when that beats its round trip
    spool: str | None = None  # ledger spool DIR (None: the default place, "off": none)
    sign_key: str | None = None  # nkey seed file signing ledger/routing/quarantine (kvasir_bus.signing)

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise UsageError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if not self.market_interval_s > 0:
            raise UsageError(f"market interval must be positive, got {self.market_interval_s}")
        if self.serve_weights is not None:
            parse_listen(self.serve_weights)
        object.__setattr__(self, "tokens", tuple(self.tokens))

    @classmethod
    def from_args(cls, args, **fixed) -> "BackboneConfig":
        """From parsed CLI flags (those a subcommand lacks keep their defaults); ``fixed``
        sets what the subcommand decides itself (``serve_manifest``, ``market_interval_s``...)."""
        timeout_ms = getattr(args, "timeout_ms", None)
        if timeout_ms is not None and not timeout_ms > 0:
            raise UsageError(f"--timeout-ms must be positive, got {timeout_ms}")
        confirm = getattr(args, "race_confirm", None)
        if confirm is not None and not (0 <= confirm <= 100):  # NaN fails both
            raise UsageError(f"--race-confirm must be between 0 and 100, got {confirm}")
        values = dict(
            model_path=os.fspath(args.model),
            nats_url=getattr(args, "nats", None),
            dispatch=DispatchConfig(timeout_s=timeout_ms / 1000 if timeout_ms else None,
                                    audit=_audit_config(getattr(args, "audit", None)),
                                    bundles=getattr(args, "bundles", None) != "off",
                                    reply_secret=_reply_secret(getattr(args, "reply_secret", None)),
                                    confirm=1.0 if confirm is None else confirm,
                                    **_fast_paths(getattr(args, "fast_paths", None) != "off")),
            wire_dtype=getattr(args, "wire_dtype", None) or "float32",
            n_ctx=getattr(args, "ctx", None),
            serve_weights=getattr(args, "serve_weights", None),
            tokens=node_tokens(getattr(args, "token", None) or ()),
            advertise_host=getattr(args, "advertise_host", None),
            replicas=ReplicaConfig(mode=getattr(args, "replicas", None) or "race"),
            hot=HotConfig(mode=getattr(args, "hot", None) or "off"),
            spool=getattr(args, "spool", None),
            sign_key=getattr(args, "sign_key", None),
        )
        values.update(fixed)
        return cls(**values)


def _fast_paths(on: bool) -> dict[str, bool]:
    """``--fast-paths``: the engine connection, inline reply delivery and one-write publishes."""
    return dict(engine_connection=on, inline_delivery=on, direct_publish=on)


def _reply_secret(path: str | None) -> bytes:
    """``--reply-secret FILE``: the 32-byte hex secret kvasir enrol wrote (b"": none)."""
    if path is None:
        return b""
    try:
        secret = bytes.fromhex(open(path).read().strip())
    except OSError as exc:
        raise UsageError(f"--reply-secret {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise UsageError(f"--reply-secret {path}: not a hex secret (kvasir enrol writes DIR/trust/reply.key)") from None
    if len(secret) < 16:
        raise UsageError(f"--reply-secret {path}: {len(secret)} bytes; expected the 32 kvasir enrol writes")
    return secret


def _audit_config(rate: float | None) -> AuditConfig:
    if rate is None:
        return AuditConfig()
    try:
        return AuditConfig(rate=rate)
    except ValueError as exc:
        raise UsageError(f"--audit: {exc}") from None


def node_tokens(given) -> tuple[str, ...]:
    """``--token`` values, else ``$KVASIR_NODE_TOKEN`` if set, else none."""
    env = os.environ.get("KVASIR_NODE_TOKEN", "")
    return tuple(given) or ((env,) if env else ())


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass
class _Running:
    """What exists only while the service runs."""

    bus: LoopThread
    nc: object = None
    dispatch: RemoteExperts | None = None
    replicas: Replicas | None = None
    hot: HotExperts | None = None
    experts: object = None  # what the engine was handed: the dispatch, or the hot experts around it
    link: object = None
    weights: object = None
    manifest: object = None
    subs: list = field(default_factory=list)
    service: object = None  # the $SRV micro service
    manifest_tally: micro.Tally = field(default_factory=micro.Tally)
    quarantines: object = None  # backbone.quarantine_list.QuarantineList


class BackboneService:
    def __init__(self, engine, cfg: BackboneConfig):
        self.engine, self.cfg = engine, cfg
        self.state = State.NEW
        self.model: str | None = None  # the fingerprint, known once started
        self.metrics: DispatchCollector | None = None  # Prometheus collector, once started
        self._run: _Running | None = None

    # -- what callers read ------------------------------------------------------------------------

    @property
    def dispatch(self) -> RemoteExperts:
        if self._run is None or self._run.dispatch is None:
            raise RuntimeError(f"backbone service is {self.state.value}, not running")
        return self._run.dispatch

    @property
    def stats(self) -> DispatchStats:
        return self.dispatch.stats

    @property
    def replicas(self) -> Replicas | None:
        return self._run.replicas if self._run else None

    @property
    def hot(self) -> HotExperts | None:
        """The hot-expert planner (None with ``--hot off``)."""
        return self._run.hot if self._run else None

    @property
    def weights(self):
        """The :class:`~backbone.weights_http.WeightsServer`, if serving weights."""
        return self._run.weights if self._run else None

    @property
    def weights_url(self) -> str | None:
        return self.weights.url if self.weights else None

    @property
    def manifest(self):
        return self._run.manifest if self._run else None

    @property
    def market_link(self):
        """The :class:`~backbone.market_link.MarketLink` (None with ``market=False``)."""
        return self._run.link if self._run else None

    def wait_ledger_acked(self, timeout_s: float) -> bool:
        """Block until the market acknowledged every ledger event recorded so far; False if it
        did not within ``timeout_s`` (or there is no market link)."""
        link = self.market_link
        if link is None:
            return False
        return self._run.bus.run(link.wait_acked(timeout_s), timeout=timeout_s + 5)

    def request(self, subject: str, payload: bytes, timeout_s: float) -> bytes:
        """One NATS request on the backbone's connection (e.g. the market's status)."""
        if self.state is not State.RUNNING:
            raise RuntimeError(f"backbone service is {self.state.value}, not running")

        async def ask() -> bytes:
            msg = await self._run.nc.request(subject, payload, timeout=timeout_s)
            return msg.data

        return self._run.bus.run(ask(), timeout=timeout_s + 5)

    def serving_mix(self) -> dict:
        """The replica mode with its hedges, and the hot experts' counts (for $SRV and the bench)."""
        run = self._run
        if run is None or run.replicas is None:
            return {}
        return {"replicas": run.replicas.to_dict(), "hot": run.hot.to_dict() if run.hot else {"mode": "off"}}

    # -- discovery ($SRV) -------------------------------------------------------------------------

    def card(self) -> micro.Card:
        from kernels.backend import kernel_label

        return micro.Card(role="backbone", node=self.cfg.node, model=self.model or "", kernel=kernel_label())

    def _served(self) -> list[micro.Served]:
        """The manifest it answers, and the expert calls it makes: errors are the calls that
        fell back to this node, processing time the winning replies' round trips."""
        run, subjects = self._run, Subjects(self.model)

        def dispatch() -> micro.Tally:
            t = run.dispatch.stats.totals()
            return micro.Tally(requests=t.remote + t.local, errors=t.local,
                               processing_ns=int(t.latency_sum_s * 1e9),
                               data={**run.dispatch.stats.to_dict()["totals"], **self.serving_mix()})
        served = [micro.Served("dispatch", subjects.dispatch_all(), stats=dispatch,
                               metadata={"direction": "out: asks the workers, falls back to itself",
                                         "replicas": self.cfg.replicas.mode, "hot": self.cfg.hot.mode})]
        if self.cfg.serve_manifest:
            served.append(micro.Served("manifest", subjects.manifest(), stats=lambda: run.manifest_tally))
        return served

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> "BackboneService":
        """Connect, listen, hand the engine its remote experts; serve manifest and weights."""
        if self.state is State.RUNNING:
            return self
        if self.state is not State.NEW:
            raise RuntimeError(f"backbone service is {self.state.value}; make a new one")
        from kvasir_bus.connect import connect
        from kvasir_bus.fingerprint import model_fingerprint

        if self.engine.path is None:
            raise UsageError("the backbone service needs an engine loaded from a GGUF file")
        cfg = self.cfg
        run = self._run = _Running(bus=LoopThread(f"kvasir-{cfg.node}"))
        self.state = State.RUNNING
        try:
            self.model = model_fingerprint(self.engine.reader)
            pending = run.bus.submit(connect(cfg.nats_url, name=micro.connection_name("backbone", cfg.node)))
            try:
                run.nc = pending.result()
            except BaseException:  # SIGTERM while the bus is unreachable: stop the reconnect loop too
                pending.cancel()
                raise
            from kvasir_bus.signing import Signer

            signer = Signer.load(cfg.sign_key)  # ledger, routing and quarantine carry its signature
            log.info("signing_key", public_key=signer.public_key,
                     note="a market trusts it with --trust-backbone (kvasir up wires it)")
            if cfg.market:
                from backbone.market_link import MarketLink
                from backbone.spool import Spool, resolve

                where = resolve(cfg.spool, self.model, cfg.node)
                run.link = MarketLink(run.nc, self.model, cfg.node, interval_s=cfg.market_interval_s,
                                      top_k=self.engine.cfg.n_expert_used, spool=Spool(where) if where else None)
                run.link.signer = signer
            run.dispatch = RemoteExperts(run.bus, run.nc, self.model, self.engine.local_experts,
                                         self.engine.cfg.n_embd, cfg.dispatch,
                                         coverage=CoverageView(cfg.dispatch.uncovered_ttl_s, n_layer=self.engine.cfg.n_layer,
                                                                 n_expert=self.engine.cfg.n_expert),
                                         recorder=run.link)
            run.dispatch.signer = signer
            run.replicas = run.dispatch.replicas = Replicas(cfg.replicas)
            run.experts = run.dispatch
            if cfg.hot.mode != "off":
                run.hot = run.experts = HotExperts(run.dispatch, run.replicas.book, cfg.hot)
            run.bus.run(run.dispatch.start())
            from backbone.quarantine_list import QuarantineList

            # Distrust what any trusted backbone caught: the market's list now, verdicts on the bus from now on.
            run.quarantines = QuarantineList(run.nc, self.model, run.dispatch.auditor, own_key=signer.public_key)
            run.bus.submit(run.quarantines.start(load=cfg.market))
            self.metrics = DispatchCollector(lambda: self._run.dispatch.stats if self._run else None, self.model)
            run.dispatch.observe_reply = self.metrics.observe_reply
            if run.link is not None:
                run.bus.run(run.link.start())
            if cfg.serve_weights is not None:
                from backbone.weights_http import WeightsServer

                host, port = parse_listen(cfg.serve_weights)
                run.weights = WeightsServer(self.engine.path, host=host, port=port, tokens=cfg.tokens,
                                            advertise_host=cfg.advertise_host, model=self.model).start()
            if cfg.serve_manifest:
                from backbone.manifest import build_manifest, serve_manifest

                run.manifest = build_manifest(self.engine.path, source_url=self.weights_url or "")
                run.subs.append(run.bus.run(serve_manifest(run.nc, run.manifest, tally=run.manifest_tally)))
            run.service = run.bus.run(micro.start_service(run.nc, self.card(), self._served()))
        except BaseException:
            self.stop()
            raise
        self.engine.use_experts(run.experts)
        prepared = getattr(self.engine, "prepared_bytes", 0)
        if prepared:  # the engine repacked its weights when it loaded (fast mode, kernels.expert.prepare)
            log.info("kernels_prepared", repacked_mb=round(prepared / 2**20, 1),
                     seconds=round(self.engine.prepared_s, 2))
        if cfg.serve_manifest:
            log.info("backbone_serving", model=self.model, weights=self.weights_url,
                     tokens=len(cfg.tokens), slabs=len(run.manifest.slabs))
        return self

    def stop(self) -> None:
        """Give the engine its local experts back, flush the market link, disconnect."""
        if self.state is not State.RUNNING:
            self.state = State.STOPPED
            return
        self.state = State.STOPPING
        run, timeout = self._run, self.cfg.disconnect_timeout_s
        if run.experts is not None and self.engine.experts is run.experts:
            self.engine.use_experts(None)
        if run.hot is not None:
            run.hot.close()

        def step(what: str, coro) -> None:  # each step on its own: one out of time skips no other
            done = run.bus.submit(coro)
            try:
                done.result(timeout)
            except Exception as exc:  # leaving anyway
                done.cancel()
                log.warning("disconnect_failed", step=what, error=f"{type(exc).__name__}: {exc}")

        try:
            step("service", micro.stop_service(run.service))
            for sub in run.subs:
                step("subscription", sub.unsubscribe())
            run.subs.clear()
            if run.link is not None:
                step("market link", run.link.stop())
            if run.quarantines is not None:  # ends its asking for the market's list, if it still asks
                step("quarantine list", run.quarantines.stop())
            if run.dispatch is not None:
                log_summary(run.dispatch)
                step("dispatch", run.dispatch.close())
            if run.nc is not None:
                step("drain", run.nc.drain())
        finally:
            if run.weights is not None:
                run.weights.stop()
            run.bus.stop()
            if run.link is not None:
                run.link.release_spool()  # a stop out of time must not keep the spool locked
            self.state = State.STOPPED

    def __enter__(self) -> "BackboneService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
