"""The backbone on the bus: what a long-running backbone offers besides computing.

* answers ``kvasir.<model>.manifest`` with the SHA-256 manifest of every expert slab (the
  market learns the model's geometry from it; volunteers verify their downloads against it);
* optionally serves its own GGUF over HTTP with Range support (``--serve-weights``), behind
  node tokens when configured (a request without a valid token gets 401);
* dispatches experts to the workers with local fallback, publishing routing statistics and
  ledger events for the market (:class:`backbone.dispatch.BusExperts`).
"""

from __future__ import annotations

import structlog

from backbone.dispatch import BusExperts, DispatchConfig, RemoteExperts
from kvasir_bus.errors import UsageError

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


class BackboneService:
    def __init__(self, engine, url: str | None, *, serve_weights: str | None = None, tokens: tuple[str, ...] = (),
                 advertise_host: str | None = None, dispatch: DispatchConfig = DispatchConfig(),
                 market_interval_s: float = 1.0):
        self.engine, self.url = engine, url
        self.serve_weights, self.tokens, self.advertise_host = serve_weights, tuple(tokens), advertise_host
        self.bus_experts = BusExperts(engine, url, dispatch, market_interval_s=market_interval_s)
        self.weights = None
        self.manifest = None
        self._manifest_sub = None
        self.remote: RemoteExperts | None = None

    @property
    def weights_url(self) -> str | None:
        return self.weights.url if self.weights else None

    def __enter__(self) -> "BackboneService":
        from backbone.manifest import build_manifest, serve_manifest
        from backbone.weights_http import WeightsServer

        self.remote = self.bus_experts.__enter__()
        try:
            if self.serve_weights is not None:
                host, port = parse_listen(self.serve_weights)
                self.weights = WeightsServer(self.engine.path, host=host, port=port, tokens=self.tokens,
                                             advertise_host=self.advertise_host).start()
            self.manifest = build_manifest(self.engine.path, source_url=self.weights_url or "")
            bus = self.bus_experts.bus
            self._manifest_sub = bus.run(serve_manifest(self.bus_experts.nc, self.manifest))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        log.info("backbone_serving", model=self.remote.model, weights=self.weights_url,
                 tokens=len(self.tokens), slabs=len(self.manifest.slabs))
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._manifest_sub is not None:
                self.bus_experts.bus.run(self._manifest_sub.unsubscribe(), timeout=5)
                self._manifest_sub = None
        except Exception:
            pass
        if self.weights is not None:
            self.weights.stop()
            self.weights = None
        self.bus_experts.__exit__(*exc)
