"""Fused Triton kernels for the small per-layer ops of a decode step: RMSNorm (with the residual
add), rotary embedding (optionally with Qwen3's per-head q/k RMSNorm first) and the softmax top-k
router. Each matches its torch reference (models/layers/norm.py, models/layers/rotary.py,
routing/router.py), which stays the CPU path.

Import the kernels from the submodules (rms_norm, rope, router): importing this package loads
no Triton, so `triton_available()` can gate the GPU path cheaply.
"""
from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_kernels_serve(x) -> bool:
    """Whether the fused Triton kernels serve tensors on x's device: CUDA with Triton importable.
    Each integrating module wraps this in its own `use_triton_fused(x)`, which tests monkeypatch."""
    return bool(x.is_cuda) and triton_available()
