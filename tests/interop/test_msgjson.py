"""python -m kvasir_bus.msgjson: msgpack payloads as JSON lines for nats --translate, and JSON
packed as msgpack for nats req --force-stdin (no nats CLI needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import numpy as np

from kvasir_bus import codec, generate_codec as gc
from kvasir_bus.msgjson import to_json

CMD = [sys.executable, "-m", "kvasir_bus.msgjson"]


def test_a_dispatch_request_reads_as_json_with_its_rows_as_a_byte_count():
    req = codec.DispatchRequest(model="0123456789abcdef", layer=3, expert=17,
                                rows=np.array([[1, -2, 0.5, 0]], np.float32), request_id="1a")
    out = subprocess.run(CMD, input=req.encode(), capture_output=True, check=True).stdout.decode()
    got = json.loads(out)
    assert (got["t"], got["layer"], got["expert"], got["shape"]) == ("x", 3, 17, [1, 4])
    assert got["data"] == "<16 bytes: 0000803f000000c0...>"


def test_packed_json_is_a_request_the_codec_accepts():
    body = {"v": 1, "t": "gq", "request_id": "r1", "prompt_ids": [], "prompt_text": "Hi", "max_tokens": 2,
            "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop_on_eos": True}
    out = subprocess.run([*CMD, "--pack", json.dumps(body)], capture_output=True, check=True).stdout
    req = gc.decode_generate_request(out)
    assert (req.request_id, req.prompt_text, req.max_tokens) == ("r1", "Hi", 2)


def test_what_is_not_msgpack_passes_through_and_bad_json_is_one_line_and_exit_2():
    assert to_json(b"") == "" and to_json(b"\xc1 not msgpack").endswith("not msgpack")
    assert to_json(msgpack.packb({"k": b"\x00" * 3})) == '{"k": "<3 bytes: 000000>"}'
    bad = subprocess.run([*CMD, "--pack", "{nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not JSON" in bad.stderr
    arr = subprocess.run([*CMD, "--pack", "[1]"], capture_output=True, text=True)
    assert arr.returncode == 2 and "JSON object" in arr.stderr
