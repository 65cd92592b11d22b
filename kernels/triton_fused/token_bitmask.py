"""A grammar mask applied in one launch: -inf into the logits of disallowed tokens.

Legend: B logits rows, V vocabulary, R masked rows, W mask words (int32, 32 tokens each).

Grid (R, V blocks): each program reads its row's mask words for BLOCK_V tokens and stores -inf
where a token's bit is 0, reading no logits (a decode step's masked rows cost their mask plus the
stores). The torch reference is kernels/token_bitmask.py's apply_token_bitmask_reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# R changes with the batch: not specialised on.
@triton.jit(do_not_specialize=["V"])
def _token_bitmask_kernel(logits_ptr, rows_ptr, mask_ptr, V, stride_lb, stride_mr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = offs < V
    row = tl.load(rows_ptr + r).to(tl.int64)
    words = tl.load(mask_ptr + r.to(tl.int64) * stride_mr + offs // 32, mask=inside, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    neg_inf = tl.full([BLOCK_V], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_lb + offs, neg_inf, mask=inside & banned)


def apply_token_bitmask_triton(logits_BV: torch.Tensor, rows_R: torch.Tensor, bitmask_RW: torch.Tensor) -> None:
    """kernels/token_bitmask.py's contract (in place). bitmask_RW may be a view whose rows have any
    stride (its words contiguous)."""
    R = rows_R.numel()
    V = logits_BV.shape[1]
    if R == 0 or V == 0:
        return
    if bitmask_RW.dtype != torch.int32 or bitmask_RW.stride(-1) != 1:
        raise ValueError(f"the bitmask must be int32 with contiguous words, got {bitmask_RW.dtype} "
                         f"strides {bitmask_RW.stride()}")
    if bitmask_RW.shape[1] * 32 < V:
        raise ValueError(f"a bitmask of {bitmask_RW.shape[1]} words covers {bitmask_RW.shape[1] * 32} tokens, "
                         f"fewer than the vocabulary's {V}")
    BLOCK_V = 4096
    _token_bitmask_kernel[(R, triton.cdiv(V, BLOCK_V))](
        logits_BV, rows_R, bitmask_RW, V, logits_BV.stride(0), bitmask_RW.stride(0), BLOCK_V=BLOCK_V, num_warps=4)
