"""Thread settings that must be in place before numpy (OpenBLAS) or ggml (OpenMP) load.

On small machines OpenBLAS' idle threads and ggml's OpenMP threads busy-wait against each
other: alternating numpy and ggml calls made a 1-row ggml matmul 30x slower in a probe. Short
spin counts on both sides fix it without making either slow. Values the user already set win.
"""

import os

DEFAULTS = {
    "GOMP_SPINCOUNT": "10000",
    "OPENBLAS_THREAD_TIMEOUT": "4",
}

for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
