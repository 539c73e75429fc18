"""Synthetic models for the tests, built once per session and shared by every test file."""

from __future__ import annotations

import pytest


class ModelCache:
    def __init__(self, tmp_path_factory):
        self.root = tmp_path_factory.mktemp("models")
        self.paths = {}

    def __call__(self, arch: str, qtype: str, preset: str = "tiny", seed: int = 1, **overrides):
        synth = pytest.importorskip("synth.model", reason="the synthetic model generator is needed")
        pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")
        key = (arch, qtype, preset, seed, tuple(sorted(overrides.items())))
        if key not in self.paths:
            extra = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
            path = self.root / f"{arch}-{preset}-{qtype}-s{seed}{'-' + extra if extra else ''}.gguf"
            synth.synth_model(path, arch=arch, preset=preset, qtype=qtype, seed=seed, **overrides)
            self.paths[key] = path
        return self.paths[key]
