"""The OpenAI-compatible server, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from backbone.model import Engine
from backbone.scheduler import SchedulerConfig
from backbone.server_http import ServerConfig, ServerThread
from backbone.tokenizer import Tokenizer
from kvasir_bus.cli import main

openai = pytest.importorskip("openai", reason="the acceptance tests use the official openai client")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello world", "The quick brown fox", "A mixture of experts", "What is the weather like today?",
           "def hello(name):", "Numbers: 0 1 2", "The village by the river", "In a swarm, each worker",
           "Please take an umbrella", "The router picks", "There was a time", "Tomorrow it will rain",
           "The children play", "The message bus is fast", "Every selected expert", "for i in range(10):"]


def start(path, **sched) -> ServerThread:
    cfg = ServerConfig(port=0, model_name="tiny", scheduler=SchedulerConfig(**sched))
    return ServerThread(Engine(path), Tokenizer(path), cfg)


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def health(server) -> dict:
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        return json.load(r)


def post(server, path: str, body: bytes) -> tuple[int, dict, dict]:
    req = urllib.request.Request(server.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.load(exc)


@pytest.fixture(scope="module")
def model(models):
    return models("mixtral", "q8_0")


@pytest.fixture(scope="module")
def server(model):
    with start(model, max_active=16, step_tokens=64, deterministic=True) as s:
        yield s


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = health(server)
    assert h["status"] == "ok" and h["deterministic"] is True


def test_completion_streamed_equals_completion_whole(server):
    c = client(server)
    whole = c.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == len(server.server.tokenizer.encode("Hello world"))
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(c.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_uses_the_models_template_streamed_and_whole(server, model):
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    rendered = "<|endoftext|><|system|>\nBe brief.<|endoftext|>\n<|user|>\nHi<|endoftext|>\n<|assistant|>\n"
    assert whole.usage.prompt_tokens == len(Tokenizer(model).encode(rendered, add_bos=False, special=True))
    assert whole.choices[0].message.role == "assistant"
    stream = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == whole.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_greedy_completion_equals_kvasir_generate_greedy(server, model, capsys):
    assert main(["generate", "--model", str(model), "--prompt", "The quick brown fox", "-n", "20",
                 "--greedy", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    got = client(server).completions.create(model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=0)
    assert got.choices[0].text == cli["text"]
    assert got.usage.completion_tokens == len(cli["tokens"])
    assert got.choices[0].finish_reason == {"length": "length", "eos": "stop"}[cli["stop_reason"]]


def test_sampling_with_a_seed_repeats_and_stop_strings_cut(server):
    c = client(server)
    a, b = (c.completions.create(model="tiny", prompt="There was a time", max_tokens=16, temperature=1.0,
                                 top_p=0.9, seed=7).choices[0].text for _ in range(2))
    assert a == b
    full = c.completions.create(model="tiny", prompt="Hello", max_tokens=30, temperature=0).choices[0].text
    if len(full) < 4:
        pytest.skip("greedy text too short to cut")
    stop = full[2:4]
    cut = c.completions.create(model="tiny", prompt="Hello", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="Hello", max_tokens=30, temperature=0, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut.choices[0].text


def test_sixteen_concurrent_greedy_clients_get_exactly_their_tokens_alone(server):
    c = client(server)

    def ask(i: int) -> str:
        return c.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=8 + i, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text

    alone = [ask(i) for i in range(16)]
    before = health(server)["max_step_sequences"]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16)))
    assert together == alone
    assert health(server)["max_step_sequences"] > max(before, 1)  # they really shared engine steps


def test_each_bad_request_gets_its_4xx_and_the_server_keeps_serving(server):
    c = client(server)
    cases = [
        (dict(model="nope", prompt="hi"), openai.NotFoundError),
        (dict(model="tiny", prompt="hi", max_tokens=0), openai.BadRequestError),
        (dict(model="tiny", prompt="hi", max_tokens=10_000), openai.BadRequestError),
        (dict(model="tiny", prompt="word " * 300, max_tokens=1), openai.BadRequestError),
        (dict(model="tiny", prompt="hi", temperature=7), openai.BadRequestError),
        (dict(model="tiny", prompt="hi", n=2), openai.BadRequestError),
        (dict(model="tiny", prompt=[10**6]), openai.BadRequestError),
    ]
    for kwargs, error in cases:
        with pytest.raises(error) as info:
            c.completions.create(**kwargs)
        assert info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    for body in (b"{not json", b"[1, 2]", b'{"prompt": "hi", "stream": "yes"}'):
        status, _, reply = post(server, "/v1/completions", body)
        assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    status, _, reply = post(server, "/v1/nothing", b"{}")
    assert status == 404 and "error" in reply
    ok = c.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


class Gate:
    """Wraps ``engine.forward``: a step runs only when the test has allowed it, so how far a
    stream gets depends on the test, never on how fast this machine runs the model."""

    def __init__(self, engine):
        self._forward, self._cond, self._allowed = engine.forward, threading.Condition(), 0
        engine.forward = self

    def __call__(self, *args, **kwargs):
        with self._cond:
            self._cond.wait_for(lambda: self._allowed > 0)
            self._allowed -= 1
        return self._forward(*args, **kwargs)

    def allow(self, steps: int) -> None:
        with self._cond:
            self._allowed += steps
            self._cond.notify_all()


def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_a_full_queue_says_retry(models):
    path = models("mixtral", "q8_0", ctx=4096)
    engine = Engine(path)
    gate = Gate(engine)
    cfg = ServerConfig(port=0, model_name="tiny", scheduler=SchedulerConfig(max_active=1, max_queue=1,
                                                                            step_tokens=16))
    with ServerThread(engine, Tokenizer(path), cfg) as s:
        c = client(s)
        gate.allow(1)  # the prompt fits one step, which samples the first token
        stream = c.completions.create(model="tiny", prompt="Hello", max_tokens=4000, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))  # generating now, holding the only slot (its next step waits at the gate)
        waiting = ThreadPoolExecutor(1).submit(lambda: c.completions.create(
            model="tiny", prompt="Hi", max_tokens=2, temperature=0))
        # One running, one waiting: the queue (bound 1) is full.
        while health(s)["queued"] < 1:
            assert not waiting.done()
        status, headers, reply = post(s, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
        assert status == 429 and int(headers["Retry-After"]) >= 1 and reply["error"]["code"] == "server_overloaded"
        stream.close()  # the client goes away mid-stream
        while health(s)["cancelled"] < 1:  # one step at a time until the server has dropped it
            assert not waiting.done()
            gate.allow(1)
        gate.allow(10**6)
        assert waiting.result(timeout=60).usage.completion_tokens == 2
        h = health(s)
    assert h["cancelled"] == 1 and h["completed"] == 1 and h["active"] == 0 and h["rejected"] == 1
    assert h["generated_tokens"] < 4000


def test_kvasir_serve_http_on_the_command_line(model):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "serve", "--model", str(model), "--http",
                             "127.0.0.1:0", "--model-name", "tiny", "--deterministic"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving tiny at http://"), line + proc.stderr.read()
        base = line.split()[3]
        c = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("spec, needle", [("nope", "--http wants PORT"), ("1:99999", "0..65535")])
def test_a_bad_http_address_is_one_line_and_exit_2(model, capsys, spec, needle):
    assert main(["serve", "--model", str(model), "--http", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
