"""`kvasir tap` shows the generate API's traffic decoded, one bounded line per message."""

from __future__ import annotations

import asyncio

from backbone.generate_bus import cancel, generate_all, new_request
from backbone.model import Engine
from backbone.scheduler import SchedulerConfig
from backbone.server_http import ServerConfig, ServerThread
from backbone.tokenizer import Tokenizer
from kvasir_bus import generate_codec as gc
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from market.tap import line, summarize_payload, tap


def test_each_generate_record_is_one_decoded_bounded_line():
    long_prompt = "Hello\nworld " * 1000
    cases = {
        gc.GenerateRequest("r1", (1, 2, 3), "", 16): "generate prompt=3 ids max=16 greedy id=r1",
        gc.GenerateRequest("r2", (), long_prompt, 8, temperature=0.7, top_p=0.9, seed=3, stop_on_eos=False):
            'generate prompt="Hello\\nworld Hello\\nworld Hello\\nworld H..." (12000 chars) max=8 t=0.7 top_p=0.9 '
            "seed=3 ignore_eos id=r2",
        gc.GenerateToken("r1", 3, 42, "a\nb"): 'token #3 42 "a\\nb" id=r1',
        gc.GenerateToken("r1", 4, 43, "x" * 4000): f'token #4 43 "{"x" * 24}..." id=r1',
        gc.GenerateDone("r1", "bb", "length", 3, 16):
            "generate-done node=bb finish=length prompt=3 completion=16 id=r1",
        gc.GenerateCancel("r1"): "generate-cancel id=r1",
    }
    for record, expected in cases.items():
        assert summarize_payload(record.encode()) == expected
        shown = line("kvasir.abc.generate", record.headers(), record.encode(), at=0)
        assert "\n" not in shown and len(shown) < 300


def test_tap_decodes_a_live_generate_stream(nats_server, models, arun):
    path = models("mixtral", "q8_0")
    fp = model_fingerprint(Engine(path).reader)
    cfg = ServerConfig(port=0, model_name="tiny", bus_model=fp, bus_url=nats_server.url, node="bb",
                       scheduler=SchedulerConfig(max_active=2, step_tokens=16))
    with ServerThread(Engine(path), Tokenizer(path), cfg):
        async def go():
            watch, client = await connect(nats_server.url, "tap"), await connect(nats_server.url, "client")
            lines: list[str] = []
            ready = asyncio.Event()
            # everything, inboxes included: the generate request, each token, the end, a cancel
            watching = asyncio.ensure_future(tap(watch, ">", lines.append, count=6, duration=170, ready=ready.set))
            await ready.wait()
            req = new_request([1, 2, 3], 3, stop_on_eos=False)
            await generate_all(client, fp, req)
            await cancel(client, fp, req)  # too late: ignored, but shown
            shown = await watching
            await watch.close()
            await client.close()
            return shown, lines, req.request_id

        shown, lines, rid = arun(go(), timeout=180)
    assert shown == 6, lines
    summaries = [ln.split("} ", 1)[1] for ln in lines]
    assert summaries[0] == f"generate prompt=3 ids max=3 greedy ignore_eos id={rid}"
    assert [s.split()[:2] for s in summaries[1:4]] == [["token", "#0"], ["token", "#1"], ["token", "#2"]]
    assert summaries[4].startswith("generate-done node=bb finish=length prompt=3 completion=3")
    assert summaries[5] == f"generate-cancel id={rid}"
    assert lines[0].split()[1] == f"kvasir.{fp}.generate" and lines[5].split()[1] == f"kvasir.{fp}.generate.cancel"
