"""The bus API ``kvasir.<model>.generate``: the same streams as alone, spread over every
backbone of the model by the queue group, bad requests refused with an error reply."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from backbone.generate import generate
from backbone.generate_bus import GenerateRefused, NoBackbone, generate_all, new_request
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.scheduler import SchedulerConfig
from backbone.server_http import ServerConfig, ServerThread
from backbone.tokenizer import Tokenizer
from kvasir_bus import generate_codec as gc
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.subjects import Subjects

N_TOKENS = 8


@pytest.fixture(scope="module")
def model(models):
    return models("mixtral", "q8_0")


@pytest.fixture(scope="module")
def fp(model):
    return model_fingerprint(Engine(model).reader)


@pytest.fixture(scope="module")
def prompts(model):
    n_vocab = Engine(model).cfg.n_vocab
    rng = np.random.default_rng(3)
    return [rng.integers(0, n_vocab, int(n)).tolist() for n in rng.integers(3, 20, 16)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each prompt's greedy tokens, generated alone (no server, no batching)."""
    return [generate(Engine(model), p, N_TOKENS, Sampler(SamplerConfig()), stop_on_eos=False).tokens for p in prompts]


def backbone(model, url, fp, node) -> ServerThread:
    cfg = ServerConfig(port=0, model_name="tiny", bus_model=fp, bus_url=url, node=node,
                       scheduler=SchedulerConfig(max_active=16, step_tokens=64, deterministic=True))
    return ServerThread(Engine(model), Tokenizer(model), cfg)


async def ask_all(url, fp, prompts):
    nc = await connect(url, "test-client")
    try:
        return await asyncio.gather(*(generate_all(nc, fp, new_request(p, N_TOKENS, stop_on_eos=False))
                                      for p in prompts))
    finally:
        await nc.drain()


def test_a_second_backbone_joining_the_queue_group_takes_a_share(nats_server, model, fp, prompts, alone, arun):
    with backbone(model, nats_server.url, fp, "bb-a") as a:
        first = arun(ask_all(nats_server.url, fp, prompts[:8]), timeout=120)
        assert [t for t, _, _ in first] == alone[:8]
        assert {done.node for _, _, done in first} == {"bb-a"}
        with backbone(model, nats_server.url, fp, "bb-b") as b:
            both = arun(ask_all(nats_server.url, fp, prompts), timeout=120)
            # every stream is exactly what it is alone, whichever backbone ran it
            assert [t for t, _, _ in both] == alone
            nodes = [done.node for _, _, done in both]
            assert set(nodes) == {"bb-a", "bb-b"}  # all 16 on one: probability 2^-15
            assert b.server.bus.served == nodes.count("bb-b")
            assert a.server.bus.served == 8 + nodes.count("bb-a")
    for tokens, text, done in both:
        assert done.finish_reason == "length"
        assert done.completion_tokens == len(tokens) == N_TOKENS
        assert done.prompt_tokens > 0


def test_text_prompt_and_sampling_fields(nats_server, model, fp, arun):
    tok = Tokenizer(model)
    with backbone(model, nats_server.url, fp, "bb"):
        async def go():
            nc = await connect(nats_server.url, "test-client")
            greedy = await generate_all(nc, fp, new_request("Hello world", N_TOKENS, stop_on_eos=False))
            sampled = [await generate_all(nc, fp, new_request("Hello world", N_TOKENS, temperature=0.9, seed=5,
                                                                stop_on_eos=False)) for _ in range(2)]
            await nc.drain()
            return greedy, sampled

        greedy, sampled = arun(go(), timeout=60)
    ids = tok.encode("Hello world")
    expected = generate(Engine(model), ids, N_TOKENS, Sampler(SamplerConfig()), stop_on_eos=False).tokens
    assert greedy[0] == expected
    assert greedy[1] == tok.decode_bytes(expected).decode("utf-8", errors="replace")
    assert greedy[2].prompt_tokens == len(ids)
    assert sampled[0][0] == sampled[1][0]  # the same seed, the same stream


def test_bad_requests_get_error_replies_and_the_backbone_keeps_serving(nats_server, model, fp, arun):
    n_ctx = Engine(model).n_ctx
    with backbone(model, nats_server.url, fp, "bb"):
        async def go():
            nc = await connect(nats_server.url, "test-client")
            refusals = []
            for req in (new_request([1] * (n_ctx - 2), 8),       # past the context
                        new_request([10 ** 6], 4)):               # not a token of this vocabulary
                with pytest.raises(GenerateRefused) as err:
                    await generate_all(nc, fp, req)
                refusals.append(err.value.code)
            # not a request at all: an error reply, never silence
            reply = await nc.request(Subjects(fp).generate(), msgpack.packb({"v": 1, "t": "gq"}), timeout=10)
            refusals.append(gc.decode_generate_reply(reply.data).code)
            ok = await generate_all(nc, fp, new_request([1, 2, 3], 4, stop_on_eos=False))
            await nc.drain()
            return refusals, ok

        refusals, ok = arun(go(), timeout=60)
    assert refusals == [gc.ERR_BAD_REQUEST] * 3
    assert len(ok[0]) == 4


def test_no_backbone_is_said_at_once(nats_server, fp, arun):
    async def go():
        nc = await connect(nats_server.url, "test-client")
        try:
            with pytest.raises(NoBackbone):
                await generate_all(nc, fp, new_request([1, 2], 2), timeout_s=30)
        finally:
            await nc.drain()

    arun(go(), timeout=20)


def test_records_validate_and_round_trip():
    req = gc.GenerateRequest("r1", (1, 2, 3), "", 5, temperature=0.5, top_p=0.9, seed=7, stop_on_eos=False)
    assert gc.decode_generate_request(req.encode()) == req
    for rec in (gc.GenerateToken("r1", 0, 42, "hi"), gc.GenerateDone("r1", "bb", "length", 3, 5)):
        assert gc.decode_generate_reply(rec.encode()) == rec
    assert gc.GenerateDone("r1", "bb", "stop", 3, 5).usage == {"prompt_tokens": 3, "completion_tokens": 5,
                                                                "total_tokens": 8}
    for bad in (dict(prompt_ids=(), prompt_text=""), dict(prompt_ids=(1,), prompt_text="x"),
                dict(prompt_ids=(1,), max_tokens=0), dict(prompt_ids=(1,), temperature=3.0),
                dict(prompt_ids=(1,), top_p=0.0), dict(prompt_ids=(-1,))):
        with pytest.raises(gc.CodecError):
            gc.GenerateRequest("r1", **bad)
    with pytest.raises(gc.CodecError, match="finish_reason"):
        gc.GenerateDone("r1", "bb", "maybe", 1, 1)
    assert Subjects(req.request_id.replace("r", "a") + "bc").generate() == "kvasir.a1bc.generate"
