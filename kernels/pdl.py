"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a forward.

A decode step is a chain of ~15 short kernels per layer; between two of them the GPU drains the
first grid's last wave, then launches and ramps up the next. With PDL a kernel is launched while
its predecessor is still running: its programs become resident on the SMs the predecessor's tail
leaves idle and wait there (`griddepcontrol.wait`) until the predecessor has finished and its
memory is visible, so the launch and ramp-up overlap the tail. Correctness rests on one rule,
kept by `pdl_enter`: a kernel launched with PDL waits before it touches memory that a kernel may
have written, so it sees everything its predecessor (and, transitively, every earlier kernel)
wrote. The one thing read before the wait is weights (the skinny GEMM's first tile): no Triton
kernel writes them, and a kernel launched without PDL (torch's, cuBLAS's, NCCL's, e.g. the
copies that move weights) is only followed once it has ended.

Off under the Triton interpreter, on GPUs before compute capability 9 (and on ROCm), and with
MOE_PDL=0 (A/B runs). CUDA-graph capture keeps the programmatic edges.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def hopper_or_later(index: int) -> bool:
    """An NVIDIA GPU of compute capability 9 or later (griddepcontrol, bulk copies). ROCm reports
    its own capability numbers and has neither."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("MOE_PDL", "1") == "0":
        return False
    return hopper_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking a `USE_PDL: tl.constexpr` that calls `pdl_enter` first."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(t) else {"USE_PDL": False}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The first statement of a kernel launched through `pdl_launch`: wait until the previous
    kernel's writes are visible, then let the next kernel launch (it waits in turn)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
