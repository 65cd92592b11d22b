"""RMSNorm over the last dimension, optionally after a residual add, in one pass.

Legend: T tokens, D normalised width, H heads (per-head norm: rows are (token, head) pairs),
R rows = T * H, BLOCK_R rows per program, BLOCK_D = D padded to a power of two.

Maths of models/layers/norm.py's RMSNorm.forward, rounding for rounding:
    s = (x + residual) rounded to x's dtype            (residual variant; s is also returned)
    n = s_fp32 * rsqrt(mean(s_fp32^2) + eps), rounded to x's dtype
    out = weight * n, in the promoted dtype of (weight, x)  (the product of two half-precision
          values is exact in fp32, so rounding it once gives torch's result)
Only the fp32 sum of squares may differ from torch's in its last bits (another reduction order).

rms_norm_topk_sum_triton takes the x of an MoE layer's output still as its top-k expert outputs
[T, K, D] (kernels/triton_fused/moe_sum.py's TopKSum) and sums them first, rounded as moe_sum
rounds: the combine and the next layer's input norm in one launch instead of two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_fused.common import (
    check_float,
    check_same_device,
    interpreting,
    round_to,
    unit_last_stride,
)


# The row count changes with the batch: not specialised on, so every batch size shares one
# compiled kernel (no compile while a CUDA graph of a new size is captured).
@triton.jit(do_not_specialize=["R"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, R, H,
                     stride_xt, stride_xh, stride_rt, stride_rh, eps,
                     D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
                     TOPK: tl.constexpr = 0, stride_xk=0):
    pdl_enter(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    t, h = rows // H, rows % H
    in_dtype: tl.constexpr = x_ptr.dtype.element_ty
    x_rows = x_ptr + (t * stride_xt + h * stride_xh)[:, None] + cols[None, :]
    if TOPK > 0:  # x is an MoE layer's [T, K, D] expert outputs: their sum, rounded as moe_sum's
        x = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(TOPK):
            x += tl.load(x_rows + k * stride_xk, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x, in_dtype, INTERPRET).to(tl.float32)
    else:
        x = tl.load(x_rows, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (t * stride_rt + h * stride_rh)[:, None] + cols[None, :], mask=mask, other=0.0)
        s = round_to(x + r.to(tl.float32), in_dtype, INTERPRET)
        tl.store(res_out_ptr + rows[:, None] * D + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    normed = round_to(x * rstd[:, None], in_dtype, INTERPRET).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = round_to(w[None, :] * normed, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], out, mask=mask)


def _as_rows(name: str, t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t with a unit last stride, H, stride per token, stride per head) for [T, D] or [T, H, D]."""
    if t.dim() not in (2, 3):
        raise ValueError(f"{name} must be [T, D] or [T, H, D], got shape {tuple(t.shape)}")
    t = unit_last_stride(t)
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def rms_norm_triton(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                    residual_TD: torch.Tensor | None = None):
    """RMSNorm of each row of x over its last dimension.

    x_TD: [T, D] or [T, H, D] (per-head norm, e.g. q_norm / k_norm), any strides except that the
    last dimension should be contiguous (else it is copied). weight_D: [D].
    Returns out (contiguous, x's shape, dtype promote(weight, x)); with residual_TD (x's shape and
    dtype): (norm(x + residual), x + residual), both written by the same launch.
    """
    check_float("x", x_TD)
    check_float("weight", weight_D)
    D = x_TD.shape[-1]
    if weight_D.shape != (D,):
        raise ValueError(f"weight must be [{D}] (x's last dimension), got {tuple(weight_D.shape)}")
    tensors = {"x": x_TD, "weight": weight_D}
    if residual_TD is not None:
        if residual_TD.shape != x_TD.shape or residual_TD.dtype != x_TD.dtype:
            raise ValueError(f"residual must match x: got {tuple(residual_TD.shape)} {residual_TD.dtype}, "
                             f"x is {tuple(x_TD.shape)} {x_TD.dtype}")
        tensors["residual"] = residual_TD
    check_same_device(**tensors)
    x, H, sxt, sxh = _as_rows("x", x_TD)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight_D.dtype), device=x.device)
    if residual_TD is not None:
        res, _, srt, srh = _as_rows("residual", residual_TD)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        res, srt, srh, res_out = x, 0, 0, out  # unused by the kernel
    R = x.shape[0] * H
    if R > 0 and D > 0:
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_R = max(1, min(16, 2048 // BLOCK_D))  # narrow rows (per-head norm): several per program
        num_warps = max(1, min(16, BLOCK_R * BLOCK_D // 256))
        _rms_norm_kernel[(triton.cdiv(R, BLOCK_R),)](
            x, res, weight_D.contiguous(), out, res_out, R, H, sxt, sxh, srt, srh, float(eps),
            D=D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, HAS_RESIDUAL=residual_TD is not None,
            INTERPRET=interpreting(), num_warps=num_warps, **pdl_launch(x))
    return out if residual_TD is None else (out, res_out)


def rms_norm_topk_sum_triton(y_TKD: torch.Tensor, weight_D: torch.Tensor, eps: float, residual_TD: torch.Tensor):
    """(norm(s), s) for s = y_TKD.sum(dim=1) + residual_TD, as moe_sum followed by rms_norm_triton
    with the residual, rounding for rounding, in one launch.

    y_TKD: [T, K, D], any strides for T and K (a non-unit last stride is copied); residual_TD:
    [T, D] of y's dtype; weight_D: [D].
    """
    check_float("y", y_TKD)
    check_float("weight", weight_D)
    if y_TKD.dim() != 3:
        raise ValueError(f"y must be [T, K, D], got shape {tuple(y_TKD.shape)}")
    T, K, D = y_TKD.shape
    if weight_D.shape != (D,):
        raise ValueError(f"weight must be [{D}] (y's last dimension), got {tuple(weight_D.shape)}")
    if residual_TD.shape != (T, D) or residual_TD.dtype != y_TKD.dtype:
        raise ValueError(f"residual must be [{T}, {D}] {y_TKD.dtype}, got {tuple(residual_TD.shape)} "
                         f"{residual_TD.dtype}")
    check_same_device(y=y_TKD, weight=weight_D, residual=residual_TD)
    if K == 0:
        return rms_norm_triton(residual_TD.new_zeros(T, D), weight_D, eps, residual_TD)
    y = unit_last_stride(y_TKD)
    res, _, srt, _ = _as_rows("residual", residual_TD)
    out = torch.empty(T, D, dtype=torch.promote_types(y.dtype, weight_D.dtype), device=y.device)
    res_out = torch.empty(T, D, dtype=y.dtype, device=y.device)
    if T > 0 and D > 0:
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_R = max(1, min(16, 2048 // BLOCK_D))
        _rms_norm_kernel[(triton.cdiv(T, BLOCK_R),)](
            y, res, weight_D.contiguous(), out, res_out, T, 1, y.stride(0), 0, srt, 0, float(eps),
            D=D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, HAS_RESIDUAL=True, INTERPRET=interpreting(),
            num_warps=max(1, min(16, BLOCK_R * BLOCK_D // 256)), TOPK=K, stride_xk=y.stride(1),
            **pdl_launch(y))
    return out, res_out
