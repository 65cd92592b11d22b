"""L2 prefetch for the decode kernels: ask the L2 for a byte range ahead of its use, without waiting.

At decode sizes a kernel streams a few MB of weights with few programs; each program keeps only
a few tiles in flight, so HBM runs well under its bandwidth while the first loads of every
program wait a full memory latency. On Hopper, one thread's `cp.async.bulk.prefetch.L2` hands a
contiguous range to the copy engine, which fetches it into L2 while the program goes on; the
program's own loads then hit L2 or a fetch already on its way. A prefetch never changes what a
load returns (L2 is the point of coherence), so it is correct anywhere; what matters is when the
address is known. Before `griddepcontrol.wait` (kernels/pdl.py) a kernel may only compute
addresses from weights, host-written inputs, or data written by kernels that finished before its
predecessor started (read past L1, ".cg").

Users (each behind an A/B switch, on by default where it measured faster on an H200, BENCHMARKS.md §3):
- the expert GEMMs: gate_up asks for its gate and up slabs once it knows its expert, the down
  GEMM for its slab before its wait (`MOE_PREFETCH_EXPERTS`);
- the skinny GEMM: its first programs ask for the whole weight before the wait (`MOE_PREFETCH_SKINNY`);
- split-KV decode attention: the KV blocks of a program's keys, before the wait (`MOE_PREFETCH_ATTN`).

Off under the Triton interpreter and on GPUs before compute capability 9 (no bulk copies).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

SITES = ("EXPERTS", "SKINNY", "ATTN")
# One request's size field counts 16-byte units in 16 bits (seen in the SASS of sm_90): ranges
# are asked for in pieces of at most this many bytes.
MAX_REQUEST_BYTES = tl.constexpr(1 << 19)


@functools.lru_cache(maxsize=None)
def _device_has_bulk_copies(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_enabled(site: str, t: torch.Tensor) -> bool:
    """Whether kernels of `site` (one of SITES) prefetch into L2 on t's device."""
    if site not in SITES:
        raise ValueError(f"unknown prefetch site {site!r}; expected one of {SITES}")
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(f"MOE_PREFETCH_{site}", "1") == "0":
        return False
    return _device_has_bulk_copies(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def l2_prefetch(ptr, nbytes):
    """Asks L2 for bytes [ptr, ptr + nbytes), widened to whole 16-byte granules (they hold bytes
    of the same allocation, so no page beyond it is touched). Thread 0 of the program issues the
    requests; nothing waits for them. nbytes <= 0: nothing."""
    start = ptr.to(tl.int64, bitcast=True)
    lo = start & -16
    hi = (start + nbytes + 15) & -16
    for a in range(lo, hi, MAX_REQUEST_BYTES):
        size = tl.minimum(hi - a, MAX_REQUEST_BYTES).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [a, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_share(ptr, nbytes, part, num_parts):
    """Part `part` of `num_parts` near-equal 16-byte-aligned shares of [ptr, ptr + nbytes): the
    first programs of a grid ask for a whole tensor between them."""
    share = ((nbytes + num_parts - 1) // num_parts + 15) // 16 * 16
    lo = part * share
    l2_prefetch(ptr.to(tl.pointer_type(tl.int8)) + lo, tl.minimum(share, nbytes - lo))


@triton.jit
def l2_prefetch_lanes(ptrs, nbytes):
    """One request per element of `ptrs`, of nbytes (a scalar or a tensor like ptrs; <= 0: none)
    from a 16-byte-aligned address. Give it one element per thread (a 1-D tensor of
    32 * num_warps): elements held by several threads would be asked for several times."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_shares(grid_programs: int, num_sms: int = 132) -> int:
    """How many programs share a whole-tensor prefetch: one per SM at most (the first programs of a
    grid are the first to be resident)."""
    return max(1, min(grid_programs, num_sms))
