"""Fixtures of the download tests."""

import pytest

from backbone.weights_http import WeightsServer


@pytest.fixture
def serve():
    servers = []

    def start(path, **kw):
        srv = WeightsServer(path, port=0, **kw).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
