"""The compiled CPU kernels (README.md here), when this install has them.

`_kernels` is one extension module built from this folder's C files: `_kernels.c` (the
quantized products, the decoder layers' loop in one call, decode bursts), `_attention.c`
(paged attention, RoPE, the KV write), `_int8.c` (`--activations int8`), all on
OpenMP's thread pool, and `_bindings.c` (the Python functions). They are built by
`pip install` (setup.py: an optional extension, so an install that cannot compile still
succeeds) and load only on an x86-64 CPU with AVX2, FMA and F16C. `PDSERVE_NO_KERNELS=1`
turns them off, to run the fallback path on purpose (CI does). Without them a quantized
GGUF is dequantized to fp32 at load, as before: slower, and `pdserve serve` says why on
its startup line.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch  # noqa: F401  (first: the kernels then share torch's libgomp thread pool)

DISABLE_ENV = "PDSERVE_NO_KERNELS"


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None, f"{DISABLE_ENV} is set"
    try:
        from pdserve.kernels import _kernels  # type: ignore[attr-defined]
    except ImportError as e:
        return None, f"the compiled kernels are not available ({e})"
    return _kernels, None


def kernels() -> ModuleType | None:
    """The extension module, or None (see `unavailable_reason`)."""
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here; None when they can."""
    return _load()[1]
