"""The backbone's weights server: HTTP Range semantics, node tokens, byte counting, lifecycle."""

from __future__ import annotations

import http.client
import os
from urllib.parse import urlsplit

import pytest

from backbone.weights_http import WeightsServer, parse_range, token_label

SIZE = 10_000


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "model.gguf"
    path.write_bytes(os.urandom(SIZE))
    return path


@pytest.fixture
def server(blob):
    with WeightsServer(blob, port=0) as srv:
        yield srv


def get(url, method="GET", headers=None, path=None):
    p = urlsplit(url)
    conn = http.client.HTTPConnection(p.hostname, p.port, timeout=10)
    try:
        conn.request(method, path or (p.path + (f"?{p.query}" if p.query else "")), headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("header,expected", [
    ("bytes=0-99", (0, 99)),
    ("bytes=100-", (100, SIZE - 1)),
    ("bytes=-100", (SIZE - 100, SIZE - 1)),
    ("bytes=-99999", (0, SIZE - 1)),  # a suffix longer than the file is the whole file
    ("bytes=9990-99999", (9990, SIZE - 1)),  # an end past the file is clamped
    (f"bytes={SIZE}-", "unsatisfiable"),
    ("bytes=-0", "unsatisfiable"),
    ("bytes=0-1,5-9", "multiple"),
    ("bytes=9-5", "malformed"),
    ("bytes=-", "malformed"),
    ("items=0-5", "malformed"),
    ("bytes=a-b", "malformed"),
])
def test_parse_range(header, expected):
    assert parse_range(header, SIZE) == expected


def test_ranged_get_answers_206_with_exactly_those_bytes(server, blob):
    data = blob.read_bytes()
    for header, (a, b) in (("bytes=10-19", (10, 19)), ("bytes=9000-", (9000, SIZE - 1)),
                           ("bytes=-16", (SIZE - 16, SIZE - 1)), ("bytes=9999-20000", (9999, 9999))):
        status, h, body = get(server.url, headers={"Range": header})
        assert status == 206, header
        assert body == data[a:b + 1]
        assert h["Content-Range"] == f"bytes {a}-{b}/{SIZE}"
        assert h["Content-Length"] == str(b - a + 1)
        assert h["Accept-Ranges"] == "bytes"


def test_get_without_range_is_the_whole_file_and_head_has_no_body(server, blob):
    status, h, body = get(server.url)
    assert (status, body) == (200, blob.read_bytes())
    assert h["Accept-Ranges"] == "bytes" and h["Content-Length"] == str(SIZE)
    status, h, body = get(server.url, method="HEAD")
    assert (status, body, h["Content-Length"]) == (200, b"", str(SIZE))
    status, h, body = get(server.url, method="HEAD", headers={"Range": "bytes=5-9"})
    assert (status, body, h["Content-Range"], h["Content-Length"]) == (206, b"", f"bytes 5-9/{SIZE}", "5")


def test_unsatisfiable_multiple_and_malformed_ranges(server):
    status, h, _ = get(server.url, headers={"Range": f"bytes={SIZE}-"})
    assert status == 416 and h["Content-Range"] == f"bytes */{SIZE}"
    status, h, body = get(server.url, headers={"Range": "bytes=0-1,4-5"})
    assert status == 416 and b"one range" in body
    status, _, body = get(server.url, headers={"Range": "bytes=banana"})
    assert status == 400 and b"bad Range" in body
    assert server.bytes_served == 0


def test_other_paths_are_404(server):
    status, _, _ = get(server.url, path="/etc/passwd")
    assert status == 404
    status, _, _ = get(server.url, path="/../model.gguf")
    assert status == 404


def test_a_download_without_a_valid_node_token_gets_401(blob):
    with WeightsServer(blob, port=0, tokens=["s3cret", "other"]) as srv:
        status, h, _ = get(srv.url, headers={"Range": "bytes=0-9"})
        assert status == 401 and h["WWW-Authenticate"].startswith("Bearer")
        status, _, _ = get(srv.url, headers={"Range": "bytes=0-9", "Authorization": "Bearer wrong"})
        assert status == 401
        status, _, _ = get(srv.url + "?token=wrong")
        assert status == 401
        status, _, _ = get(srv.url, method="HEAD")
        assert status == 401
        assert srv.unauthorized == 4 and srv.bytes_served == 0

        status, _, body = get(srv.url, headers={"Range": "bytes=0-9", "Authorization": "Bearer s3cret"})
        assert (status, len(body)) == (206, 10)
        status, _, body = get(srv.url + "?token=other", headers={"Range": "bytes=0-4"})
        assert (status, len(body)) == (206, 5)
        assert srv.by_token == {token_label("s3cret"): 10, token_label("other"): 5}
        assert "s3cret" not in repr(srv.by_token)


def test_bytes_are_counted_per_client(server):
    get(server.url, headers={"Range": "bytes=0-99", "X-Kvasir-Node": "phone-1"})
    get(server.url, headers={"Range": "bytes=0-49", "X-Kvasir-Node": "phone-2"})
    get(server.url, headers={"Range": "bytes=0-9"})
    assert server.served_to("phone-1") == 100
    assert server.served_to("phone-2") == 50
    assert server.served_to("127.0.0.1") == 10
    assert server.bytes_served == 160


def test_drop_after_cuts_the_answer_once(server):
    server.drop_after(100)
    p = urlsplit(server.url)
    conn = http.client.HTTPConnection(p.hostname, p.port, timeout=10)
    conn.request("GET", p.path, headers={"Range": "bytes=0-999"})
    resp = conn.getresponse()
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    assert len(info.value.partial) == 100
    conn.close()
    status, _, body = get(server.url, headers={"Range": "bytes=0-999"})
    assert (status, len(body)) == (206, 1000)


def test_lifecycle_port_zero_url_and_idempotent_stop(blob):
    srv = WeightsServer(blob, port=0)
    srv.start()
    assert srv.port and srv.url == f"http://127.0.0.1:{srv.port}/model.gguf"
    keep = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    keep.request("GET", "/model.gguf", headers={"Range": "bytes=0-0"})
    keep.getresponse().read()
    srv.stop()
    srv.stop()
    with pytest.raises(OSError):  # the listener is gone, and so is the kept-alive connection
        http.client.HTTPConnection("127.0.0.1", srv.port, timeout=2).request("GET", "/model.gguf")
    with pytest.raises((OSError, http.client.HTTPException)):
        keep.request("GET", "/model.gguf", headers={"Range": "bytes=0-0"})
        keep.getresponse().read()
