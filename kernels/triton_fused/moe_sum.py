"""Top-k combine of an MoE layer in one launch: out_TD = y_TKD.sum(dim=1).

Legend: T tokens, K experts per token (top-k), D hidden; BLOCK_D hidden columns per program.

Replaces `y.view(T, K, D).sum(dim=1)` (kernels/triton_moe/fused.py, models/layers/moe.py), which
at decode sizes costs a generic torch reduce kernel. Grid (T, D blocks); each program loads
its K rows (all K loads issued together: K is a compile-time constant) and sums them in fp32.
Rounding as torch's sum of the same dtype: half types accumulate in fp32 and round once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_fused.common import check_float, interpreting, round_to, unit_last_stride


# T changes with the batch: not specialised on, so every batch size shares one compiled kernel.
@triton.jit(do_not_specialize=["T"])
def _moe_sum_kernel(y_ptr, out_ptr, T, D, stride_yt, stride_yk, stride_ot,
                    K: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    row = y_ptr + t * stride_yt + offs
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(row + k * stride_yk, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, round_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def moe_sum(y_TKD: torch.Tensor) -> torch.Tensor:
    """y_TKD.sum(dim=1) as a new contiguous [T, D] tensor of y's dtype (fp32, fp16 or bf16).

    y_TKD: [T, K, D], any strides for T and K (a non-unit last stride is copied).
    """
    check_float("y", y_TKD)
    if y_TKD.dim() != 3:
        raise ValueError(f"y must be [T, K, D], got shape {tuple(y_TKD.shape)}")
    T, K, D = y_TKD.shape
    y = unit_last_stride(y_TKD)
    out = torch.empty(T, D, dtype=y.dtype, device=y.device)
    if T == 0 or D == 0:
        return out
    if K == 0:
        return out.zero_()
    # Decode (small T): narrow blocks so even T=1 spreads over several SMs; prefill: wide blocks.
    BLOCK_D = min(triton.next_power_of_2(D), 256 if T < 64 else 1024)
    num_warps = max(1, min(4, BLOCK_D * y.element_size() // 512))
    _moe_sum_kernel[(T, triton.cdiv(D, BLOCK_D))](
        y, out, T, D, y.stride(0), y.stride(1), out.stride(0), K=K, BLOCK_D=BLOCK_D,
        INTERPRET=interpreting(), num_warps=num_warps, **pdl_launch(out))
    return out


class TopKSum:
    """An MoE layer's output not yet summed: its [T, K, D] expert outputs (weights applied).

    The expert layer returns one when asked to (`defer_sum`) so that the next RMSNorm, which adds
    the residual anyway, sums the K rows in its own launch (rms_norm_topk_sum_triton): one launch
    a layer fewer at decode sizes. Anything else takes `materialize()`, the moe_sum."""

    def __init__(self, y_TKD: torch.Tensor) -> None:
        self.y_TKD = y_TKD

    def materialize(self) -> torch.Tensor:
        return moe_sum(self.y_TKD)
