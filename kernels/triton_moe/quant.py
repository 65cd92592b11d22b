"""Per-token-group dynamic FP8 (e4m3) quantisation of activations, and its torch reference.

Legend: T tokens, D hidden, G = ceil(D / group) groups per row.

    x_TD -> (q_TD float8_e4m3fn, s_TG float32) with x ~= q * s, s = max|x_group| / 448
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, D, stride_xm, stride_qm, stride_sm,
                        GROUP: tl.constexpr, FP8MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    m = offs < D
    x = tl.load(x_ptr + row * stride_xm + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / FP8MAX
    q = tl.clamp(x / s, -FP8MAX, FP8MAX)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row * stride_sm + g, s)


def per_token_group_quant_fp8(x_TD: torch.Tensor, group: int = 128):
    """x_TD [T, D] (any float dtype, last dim contiguous) -> (q_TD fp8, s_TG fp32)."""
    T, D = x_TD.shape
    G = triton.cdiv(D, group)
    q = torch.empty(T, D, dtype=FP8_DTYPE, device=x_TD.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x_TD.device)
    if T:
        _group_quant_kernel[(T, G)](x_TD, q, s, D, x_TD.stride(0), q.stride(0), s.stride(0),
                                    GROUP=group, FP8MAX=FP8_MAX, num_warps=1)
    return q, s


def per_token_group_quant_torch(x_TD: torch.Tensor, group: int = 128):
    """Reference of :func:`per_token_group_quant_fp8`."""
    T, D = x_TD.shape
    G = -(-D // group)
    xp = torch.nn.functional.pad(x_TD.float(), (0, G * group - D)).view(T, G, group)
    s = xp.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    q = (xp / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(T, G * group)[:, :D].contiguous(), s
