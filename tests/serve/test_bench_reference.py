"""bench/throughput.py's llama-server reference: where it cannot be built, one line says why and
the bench falls back to llama.cpp's batched decode instead of failing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "bench" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cmake_the_reference_is_unavailable_in_one_line(bench, tmp_path, monkeypatch, capsys):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached binary
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no cmake, no compiler
    with pytest.raises(bench.ReferenceUnavailable, match="^cmake and a C\\+\\+ compiler missing") as err:
        bench.llama_server_binary()
    assert "\n" not in str(err.value)
    out = {"results": []}
    args = SimpleNamespace(llama_server=None, llama_src=None, llama_slots=16)
    assert bench.start_reference(Path("unused.gguf"), args, 1024, 1, out) is None
    assert out["llama_server"] == {"unavailable": str(err.value)}
    assert out["results"] == []  # nothing else touched
    assert "reference is llama.cpp's batched decode" in capsys.readouterr().err


def test_a_source_tree_without_a_server_is_refused(bench, tmp_path):
    with pytest.raises(bench.ReferenceUnavailable, match="not a llama.cpp tree"):
        bench._vendored_source("0", tmp_path, str(tmp_path))


def test_a_cached_binary_is_used_as_it_is(bench, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    binary = bench.reference_cache(bench.llama_cpp_version()) / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no build tools needed then
    assert bench.llama_server_binary() == binary
