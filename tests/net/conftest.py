"""Fixtures for the network tests: a deployment's credentials and a server running its config."""

from __future__ import annotations

import pytest

from kvasir_bus import creds
from kvasir_bus.server import EmbeddedNats

WORKERS = ("w1", "w2")


@pytest.fixture
def deployment(tmp_path):
    """``kvasir creds init`` output in a temp dir: any free client and WebSocket ports."""
    out = tmp_path / "dep"
    creds.init(out, "127.0.0.1:0", list(WORKERS), websocket="127.0.0.1:0")
    return out


@pytest.fixture
def secure_server(deployment):
    """nats-server running DIR/nats.conf as it is (ports as the config says: free ones)."""
    server = EmbeddedNats(config=deployment / "nats.conf", port=None, host=None)
    server.start()
    try:
        yield server
    finally:
        server.stop()
