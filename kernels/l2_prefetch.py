"""Bulk L2 prefetch: ask the L2 for byte ranges ahead of their use, without waiting for them.

On Hopper one thread's `cp.async.bulk.prefetch.L2` hands a contiguous range to the copy engine,
which fetches it into L2 while the program goes on. A prefetch never changes what a load returns
(L2 is the point of coherence), so it is correct anywhere; what matters is when its address is
known. Before `griddepcontrol.wait` (kernels/pdl.py) a kernel may only compute addresses from
weights, step inputs written before the forward, or data of kernels that ended before its
predecessor began.

User: split-KV decode attention at small batches asks for its KV blocks before its PDL wait, while
the kernel before it (RoPE + KV write) runs. Asking for weight streams instead (the expert GEMMs'
slabs, the skinny GEMM's weight) made those kernels slower on an H200 (BENCHMARKS.md §4).

Off under the Triton interpreter and on GPUs before compute capability 9 (no bulk copies).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl


def bulk_prefetch_supported(t: torch.Tensor) -> bool:
    """Whether kernels on t's device can issue bulk L2 prefetches (compiled, not interpreted)."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return pdl.hopper_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def l2_prefetch_lanes(ptrs, nbytes):
    """One request per element of `ptrs` for nbytes (a scalar or a tensor like ptrs; <= 0: none,
    else a multiple of 16) from a 16-byte-aligned address. Give it one element per thread (a 1-D
    tensor of 32 * num_warps): an element that several threads hold is asked for several times."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
