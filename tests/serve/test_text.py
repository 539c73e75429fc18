"""Text is never lost: a completion's text equals ``Tokenizer.decode`` of its tokens (what
``kvasir generate`` prints), byte for byte, streamed or not; invalid UTF-8 becomes U+FFFD."""

from __future__ import annotations

import random

import pytest

from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.scheduler import SchedulerConfig
from backbone.server_http import ServerConfig, ServerThread
from backbone.tokenizer import StreamDecoder, Tokenizer

openai = pytest.importorskip("openai", reason="the completions are read with the official openai client")

# On the tiny mixtral (seed 1) this sampled run mixes valid multi-byte characters ("°", split
# over tokens) with byte tokens that form no character: the case that used to lose text.
PROMPT, SEED, TEMPERATURE, N = "Hello world", 34, 1.5, 24


@pytest.fixture(scope="module")
def model(models):
    return models("mixtral", "q8_0")


def joined(tok: Tokenizer, ids: list[int]) -> str:
    dec = StreamDecoder(tok)
    return "".join(dec.push(t) for t in ids) + dec.flush()


def test_stream_decoder_equals_one_shot_decode_for_any_token_list(model):
    tok = Tokenizer(model)
    n_vocab = Engine(model).cfg.n_vocab
    rng = random.Random(7)
    for _ in range(400):
        ids = [rng.randrange(n_vocab) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.2:
            ids[0] = tok.bos_id
        assert joined(tok, ids) == tok.decode(ids), ids


def test_stream_decoder_holds_back_an_incomplete_character(model):
    tok = Tokenizer(model)
    ids = tok.encode("°é", add_bos=False)
    assert any(len(tok.piece_bytes(t)) == 1 and tok.piece_bytes(t)[0] >= 0x80 for t in ids)  # split bytes
    dec = StreamDecoder(tok)
    out = [dec.push(t) for t in ids]
    assert "\ufffd" not in "".join(out)
    assert "".join(out) + dec.flush() == "°é"
    lead = next(t for t in ids if tok.piece_bytes(t)[:1] == b"\xc2")  # "°" starts with 0xC2 0xB0
    dec = StreamDecoder(tok)  # a character cut short at the end of the stream is replaced, not dropped
    assert dec.push(lead) == ""
    assert dec.flush() == "\ufffd"


def test_completion_text_equals_generate_streamed_or_not(model):
    tok, engine = Tokenizer(model), Engine(model)
    ids = generate(engine, tok.encode(PROMPT), N, Sampler(SamplerConfig(temperature=TEMPERATURE, seed=SEED)),
                   stop_on_eos=False).tokens
    expected = tok.decode(ids)
    assert "\ufffd" in expected and "°" in expected  # the case under test is really there
    cfg = ServerConfig(port=0, model_name="tiny", scheduler=SchedulerConfig())
    with ServerThread(engine, tok, cfg) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=N, temperature=TEMPERATURE, seed=SEED,
                  extra_body={"ignore_eos": True})
        whole = api.completions.create(**kw)
        pieces = [c.choices[0].text for c in api.completions.create(stream=True, **kw)]
    assert whole.usage.completion_tokens == N
    assert whole.choices[0].text == expected
    assert "".join(pieces) == expected


def test_the_bus_api_keeps_a_character_the_last_token_cut_short(model, nats_server, arun):
    from backbone.generate_bus import generate_all, new_request
    from kvasir_bus.connect import connect
    from kvasir_bus.fingerprint import model_fingerprint

    tok, engine = Tokenizer(model), Engine(model)
    ids = generate(engine, tok.encode(PROMPT), N, Sampler(SamplerConfig(temperature=TEMPERATURE, seed=SEED)),
                   stop_on_eos=False).tokens
    cut = None  # a length whose last token leaves a character unfinished
    for n in range(1, N + 1):
        dec = StreamDecoder(tok)
        "".join(dec.push(t) for t in ids[:n])
        if dec.flush():
            cut = n
            break
    assert cut is not None, "no stream prefix ends inside a character: the case is not there"
    fp = model_fingerprint(engine.reader)
    cfg = ServerConfig(port=0, model_name="tiny", scheduler=SchedulerConfig(), bus_model=fp, bus_url=nats_server.url)
    with ServerThread(engine, tok, cfg):
        async def ask():
            nc = await connect(nats_server.url, "text-client")
            try:
                return await generate_all(nc, fp, new_request(PROMPT, cut, temperature=TEMPERATURE, seed=SEED,
                                                              stop_on_eos=False))
            finally:
                await nc.close()

        tokens, text, done = arun(ask(), timeout=60)
    assert tokens == ids[:cut]
    assert text == tok.decode(ids[:cut]) and text.endswith("\ufffd") and done.text
