"""Model shapes from a GGUF header alone, and the published shapes."""

from __future__ import annotations

import os

import pytest

from kvasir_bus.cli import main
from planner.shapes import PUBLISHED, from_gguf, published


def test_shapes_from_the_header_match_the_engine(models):
    from backbone.model import Engine

    path = models("qwen3moe", "q4_k")
    s, cfg = from_gguf(str(path)), Engine(path).cfg
    assert (s.n_layer, s.n_embd, s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_head, s.n_head_kv) == \
        (cfg.n_layer, cfg.n_embd, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_head, cfg.n_head_kv)
    from kvasir_bus.fingerprint import model_fingerprint

    assert s.fingerprint == model_fingerprint(Engine(path).reader)
    assert s.expert_bytes > 0 and s.dense_bytes_attention > 0


def test_a_huge_file_needs_only_its_header(models, tmp_path):
    """A 77 GB file (sparse: its header, then nothing on disk) is read in the header alone."""
    src = from_gguf(str(models("qwen3moe", "q4_k")))
    big = tmp_path / "huge.gguf"
    with open(models("qwen3moe", "q4_k"), "rb") as f:
        big.write_bytes(f.read(1 << 16))
    os.truncate(big, 77 * 10**9)
    s = from_gguf(str(big))
    assert s.fingerprint == src.fingerprint and s.n_expert == src.n_expert


def test_published_shapes_are_the_configs():
    q = published("qwen35moe-122b-a10b")
    assert (q.n_embd, q.n_expert, q.n_expert_used, q.n_ff_exp, q.expert_bytes) == (3072, 256, 8, 1024, 3 * 1769472)
    assert q.n_attention_layers == 12 and q.n_recurrent_layers == 36  # every 4th layer full attention
    g = published("gpt-oss-120b")
    assert (g.n_layer, g.n_expert, g.n_expert_used, g.n_embd) == (36, 128, 4, 2880)
    d = published("deepseek-v3")
    assert (d.n_layer, d.n_moe_layers, d.n_expert, d.n_expert_used, d.n_embd) == (61, 58, 256, 8, 7168)
    assert set(PUBLISHED) == {"qwen35moe-122b-a10b", "gpt-oss-120b", "deepseek-v3"}


def test_calibrate_refuses_a_missing_model_in_one_line(tmp_path, capsys):
    assert main(["calibrate", "--model", str(tmp_path / "none.gguf"), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "none.gguf" in err and "\n" not in err


def test_calibrate_refuses_a_file_that_is_not_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    assert main(["calibrate", "--model", str(bad), "-o", str(tmp_path / "p.json")]) == 2
    assert "\n" not in capsys.readouterr().err.strip()


def test_the_commands_are_registered_for_kvasir():
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")).read()
    assert '"8-plan" = "planner.cli"' in text and '"planner"' in text
