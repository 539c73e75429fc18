"""The kernel mode: ``fast`` (llama.cpp's default kernels, the default) and ``deterministic``
(batch-invariant, what this suite runs in: tests/conftest.py). ggml reads its switch once when
it loads, so the fast mode is checked in child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import backend, ggml
from kvasir_bus.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json
import numpy as np
from gguf import GGMLQuantizationType as T
from kernels import ggml
from kernels.backend import kernel_label, kernel_settings
from kernels.tensors import QTensor

rng = np.random.default_rng(0)
w = QTensor("w", T.Q4_K, (256, 64), ggml.quantize(rng.standard_normal((64, 256)).astype(np.float32), T.Q4_K))
f = QTensor("f", T.F16, (256, 64), rng.standard_normal((64, 256)).astype(np.float16).view(np.uint8).ravel())
x = rng.standard_normal((16, 256)).astype(np.float32)
batch = ggml.matmul(w, x, routed=True)
alone = np.concatenate([ggml.matmul(w, x[i:i + 1], routed=True) for i in range(16)])
dense_one = ggml.matmul(f, x[:1])
dense_two = ggml.matmul(f, x[:2])[:1]
print(json.dumps({"label": kernel_label(), "settings": kernel_settings(),
                  "routed_batch_invariant": bool(np.array_equal(batch, alone)),
                  "one_row_as_in_batch": bool(np.array_equal(dense_one, dense_two))}))
"""


def _probe(mode: str | None, repack: str | None = None, flash: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVASIR_KERNEL_MODE", "GGML_CPU_TILED_MM", "KVASIR_REPACK", "KVASIR_FLASH_ATTN")}
    if flash is not None:
        env["KVASIR_FLASH_ATTN"] = flash
    if mode:
        env["KVASIR_KERNEL_MODE"] = mode
    if repack is not None:
        env["KVASIR_REPACK"] = repack
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def need_ggml():
    if not ggml.available():
        pytest.skip("ggml not available")


def test_default_mode_is_fast_with_repacked_dense_weights_and_tiled_kernels(need_ggml):
    got = _probe(None)
    assert got["settings"]["mode"] == "fast" and got["settings"]["tiled_mm"] is True
    assert got["settings"]["flash_attn"] is True  # as llama-server attends on a CPU by default
    if not got["settings"]["repack"]:
        pytest.skip("this ggml has no CPU repack buffer type")
    assert got["label"].endswith("-repack")
    # 16 rows to one K-quant expert take the plain layout's tiled kernel (kernels.ggml.expert_layout:
    # repacked below 8 rows only), not what each row gets alone (the same on a worker and the backbone)
    assert got["routed_batch_invariant"] is False


def test_fast_mode_without_repacking_takes_the_tiled_kernel(need_ggml):
    got = _probe(None, repack="0")
    assert got["settings"]["mode"] == "fast" and got["settings"]["repack"] is False
    assert not got["label"].endswith(("-det", "-repack"))
    # 16 rows to one K-quant expert take the tiled kernel: not what each row gets alone
    assert got["routed_batch_invariant"] is False


def test_deterministic_mode_is_batch_invariant_and_says_so_in_its_label(need_ggml):
    got = _probe("deterministic")
    assert got["settings"]["mode"] == "deterministic" and got["settings"]["tiled_mm"] is False
    # its routed experts repacked where ggml has a kernel for them (kernels.ggml.expert_layout)
    assert got["label"].endswith("-det-repack" if got["settings"]["repack_experts"] else "-det")
    assert got["routed_batch_invariant"] is True and got["one_row_as_in_batch"] is True


def test_flash_attention_is_the_fast_modes_switch_and_never_the_deterministic_modes(need_ggml, monkeypatch):
    assert _probe(None, flash="0")["settings"]["flash_attn"] is False
    # batch-invariance: ggml's flash attention tiles 64 query rows or more (kernels.ggml.flash_attn_setting)
    assert _probe("deterministic", flash="1")["settings"]["flash_attn"] is False
    monkeypatch.setenv("KVASIR_FLASH_ATTN", "yes")
    with pytest.raises(ValueError, match="KVASIR_FLASH_ATTN='yes': expected 0 or 1"):
        ggml.flash_attn_setting()


def test_deterministic_mode_without_repacking_keeps_its_experts_plain_and_batch_invariant(need_ggml):
    got = _probe("deterministic", repack="0")
    assert got["settings"]["repack_experts"] is False and got["label"].endswith("-det")
    assert got["routed_batch_invariant"] is True and got["one_row_as_in_batch"] is True


def test_labels_name_the_mode_only_where_it_changes_the_bits():
    assert backend.kernel_label("ggml", "x86_64", "fast", repack=False) == "ggml-x86_64"
    assert backend.kernel_label("ggml", "x86_64", "fast", repack=True) == "ggml-x86_64-repack"
    # the deterministic mode's -repack: its routed experts repacked (other bits than plain -det)
    assert backend.kernel_label("ggml", "x86_64", "deterministic", repack=True) == "ggml-x86_64-det-repack"
    assert backend.kernel_label("ggml", "x86_64", "deterministic", repack=False) == "ggml-x86_64-det"
    assert backend.kernel_label("numpy", "x86_64", "deterministic") == "numpy-x86_64"


def test_switching_mode_after_ggml_loaded_is_a_usage_error(need_ggml):
    ggml.load()
    other = "fast" if backend.kernel_mode() == "deterministic" else "deterministic"

    class Args:
        deterministic = other == "deterministic"
        threads = None

    with pytest.raises(ValueError, match="after ggml loaded"):
        backend.set_mode(other)
    if Args.deterministic:
        with pytest.raises(UsageError):
            backend.apply_kernel_flags(Args())


def test_bad_thread_count_is_a_usage_error():
    class Args:
        deterministic = False
        threads = 0

    with pytest.raises(UsageError, match="--threads"):
        backend.apply_kernel_flags(Args())


@pytest.mark.parametrize("repack", ["1", "0"])
def test_sharded_equals_monolithic_in_the_fast_mode_too(need_ggml, repack):
    """The sharding suite's exactness tests, rerun with workers and backbone in the fast mode,
    with weights repacked (the default: the workers repack their slices' experts) and without."""
    env = dict(os.environ, KVASIR_KERNEL_MODE="fast", KVASIR_REPACK=repack, PYTHONPATH=str(ROOT))
    env.pop("GGML_CPU_TILED_MM", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/backbone/test_sharding.py", "-k", "change_nothing or killed_mid_generation"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "2 passed" in out.stdout
