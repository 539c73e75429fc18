"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ggml():
    pytest.importorskip("llama_cpp", reason="ggml backend needs llama-cpp-python (pip install '.[backbone]')")
    from kernels import ggml

    if not ggml.available():
        pytest.skip("llama_cpp is installed but its ggml libraries do not load")
    return ggml
