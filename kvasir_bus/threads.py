"""Thread settings that must be in place before numpy (OpenBLAS) or ggml (OpenMP) load.

On small machines OpenBLAS' idle threads and ggml's OpenMP threads busy-wait against each
other: alternating numpy and ggml calls made a 1-row ggml matmul 30x slower in a probe. Short
spin counts on both sides fix it without making either slow.

``GGML_CPU_TILED_MM=0`` keeps ggml's CPU backend on one K-quant matmul kernel whatever the batch
size: by default it switches to a "tiled" kernel once 8 or more rows go to a weight, which sums
in another order, so a token's logits would depend on what else is in its batch (and on how
many tokens of a batch chose the same expert). Batch invariance is worth more here than the
tiled kernel's prefill speed: the engine serves continuous batches, and its decode steps must
reproduce its prefill. It must be set before libggml loads; llama.cpp in the same process (the
reference in ``kvasir verify``) then uses the same kernels. Values the user already set win.
"""

import os

DEFAULTS = {
    "GOMP_SPINCOUNT": "10000",
    "OPENBLAS_THREAD_TIMEOUT": "4",
    "GGML_CPU_TILED_MM": "0",
}

for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
