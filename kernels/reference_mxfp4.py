"""Pure-torch reference of the expert layer with MXFP4 weights (gpt-oss's hub format), and its
dequantisation (the same as models/mxfp4.py's, which kernels/ may not import: tests check the two agree).

Legend: T tokens, D hidden, E experts, F expert intermediate, K top-k.
A weight [N, Kd] is `q` uint8 [N, Kd/2] (two FP4 E2M1 codes a byte: low nibble = even column, high
nibble = odd) with `s` uint8 [N, Kd/32] (E8M0, one per 32 columns): w = e2m1 * 2^(s - 127). q is the
checkpoint's blocks [N, Kd/32, 16] with the last two dimensions flattened (the same memory).
"""
from __future__ import annotations

import torch

from kernels.reference import fused_experts_torch

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def dequantize_mxfp4(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q uint8 [..., Kd/2], s uint8 [..., Kd/32] -> [..., Kd] in `dtype` (exact but for the range of
    `dtype`: each value is a code times a power of two, made in fp32 then cast)."""
    if q.dtype != torch.uint8 or s.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weights and scales must be uint8, got {q.dtype} and {s.dtype}")
    Kd = 2 * q.shape[-1]
    if Kd % MXFP4_BLOCK or tuple(s.shape) != (*q.shape[:-1], Kd // MXFP4_BLOCK):
        raise ValueError(f"MXFP4 weights {tuple(q.shape)} and scales {tuple(s.shape)} do not match: "
                         f"[..., Kd/2] bytes over [..., Kd/{MXFP4_BLOCK}] scales, Kd a multiple of {MXFP4_BLOCK}")
    if q.dim() == 3:  # one expert at a time keeps the int64 / fp32 temporaries small
        out = torch.empty(*q.shape[:-1], Kd, dtype=dtype, device=q.device)
        for e in range(q.shape[0]):
            out[e] = dequantize_mxfp4(q[e], s[e], dtype)
        return out
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=q.device)
    codes = torch.stack([q & 0x0F, q >> 4], dim=-1).long()  # [..., Kd/2, 2]: even, odd column
    values = lut[codes].reshape(*q.shape[:-1], Kd // MXFP4_BLOCK, MXFP4_BLOCK)
    values = torch.ldexp(values, s.to(torch.int32)[..., None] - 127)
    return values.reshape(*q.shape[:-1], Kd).to(dtype)


def fused_experts_mxfp4_torch(x_TD, w13_q, w2_q, w13_scale, w2_scale, topk_weights_TK, topk_ids_TK,
                              expert_map_E=None, **kwargs):
    """Dequantise the experts to the activation dtype (every call: slow; tests, CPU), then run
    :func:`kernels.reference.fused_experts_torch` with the same keywords (biases, activation)."""
    w13 = dequantize_mxfp4(w13_q, w13_scale, x_TD.dtype)
    w2 = dequantize_mxfp4(w2_q, w2_scale, x_TD.dtype)
    return fused_experts_torch(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, expert_map_E, **kwargs)
