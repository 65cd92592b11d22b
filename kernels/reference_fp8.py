"""Pure-torch reference of the FP8 block-quantised expert layer, and a weight block-quantiser.

Legend: T tokens, D hidden, E experts, F expert intermediate, K top-k; block_shape = (bn, bk).
Weights are float8_e4m3fn with scales [E, ceil(N/bn), ceil(Kd/bk)] in the DeepSeek-V3 hub format
(`weight_scale_inv`): dequantised weight = fp8 * scale, broadcast over each bn x bk block.
"""
from __future__ import annotations

import torch

from kernels.reference import fused_experts_torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _expand(scale_ENK: torch.Tensor, N: int, Kd: int, block_shape) -> torch.Tensor:
    bn, bk = block_shape
    s = scale_ENK.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return s[..., :N, :Kd]


def dequantize_block_fp8(w_fp8: torch.Tensor, scale: torch.Tensor, block_shape=(128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[E, N, Kd] fp8 and [E, ceil(N/bn), ceil(Kd/bk)] scales -> [E, N, Kd] `dtype`."""
    N, Kd = w_fp8.shape[-2:]
    if w_fp8.dim() == 2:
        return (w_fp8.float() * _expand(scale, N, Kd, block_shape)).to(dtype)
    out = torch.empty(w_fp8.shape, dtype=dtype, device=w_fp8.device)
    for e in range(w_fp8.shape[0]):  # one expert at a time keeps the fp32 temporaries small
        out[e] = dequantize_block_fp8(w_fp8[e], scale[e], block_shape, dtype)
    return out


def quantize_block_fp8(w: torch.Tensor, block_shape=(128, 128)):
    """Block-quantise a [.., N, Kd] float weight -> (fp8 weight, fp32 scales [.., ceil(N/bn), ceil(Kd/bk)])."""
    bn, bk = block_shape
    N, Kd = w.shape[-2:]
    nb, kb = -(-N // bn), -(-Kd // bk)
    wp = torch.nn.functional.pad(w.float(), (0, kb * bk - Kd, 0, nb * bn - N))
    blocks = wp.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [.., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [.., nb, kb]
    scale = amax.clamp(min=1e-10) / FP8_MAX
    q = _expand(scale, nb * bn, kb * bk, block_shape)
    q = (wp / q).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)[..., :N, :Kd].contiguous()
    return q, scale


def fused_experts_fp8_torch(x_TD, w13_fp8, w2_fp8, w13_scale, w2_scale, topk_weights_TK,
                            topk_ids_TK, expert_map_E=None, block_shape=(128, 128)):
    """Dequantise the weights to the activation dtype, then run :func:`fused_experts_torch`.

    Activations stay unquantised here, so the kernel's dynamic FP8 activation quantisation shows
    up as a small relative error (a few 1e-2) against this reference.
    """
    w13 = dequantize_block_fp8(w13_fp8, w13_scale, block_shape, x_TD.dtype)
    w2 = dequantize_block_fp8(w2_fp8, w2_scale, block_shape, x_TD.dtype)
    return fused_experts_torch(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, expert_map_E)


def _qdq_groups(x_TD: torch.Tensor, group: int) -> torch.Tensor:
    """Quantise-dequantise per (row, group of columns), as the kernel's activations are."""
    T, D = x_TD.shape
    G = -(-D // group)
    xp = torch.nn.functional.pad(x_TD.float(), (0, G * group - D)).view(T, G, group)
    s = xp.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = (xp / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s
    return q.view(T, G * group)[:, :D]


def fused_experts_fp8_actquant_torch(x_TD, w13_fp8, w2_fp8, w13_scale, w2_scale, topk_weights_TK,
                                     topk_ids_TK, expert_map_E=None, block_shape=(128, 128)):
    """Tighter oracle: also quantises x and SiLU(gate)*up per token group (group = bk), in fp32.

    For small test shapes only (the weights are dequantised to fp32).
    """
    T, D = x_TD.shape
    w13 = dequantize_block_fp8(w13_fp8, w13_scale, block_shape)
    w2 = dequantize_block_fp8(w2_fp8, w2_scale, block_shape)
    F = w2.shape[2]
    ids = topk_ids_TK.long()
    if expert_map_E is not None:
        ids = expert_map_E.long()[ids]
    xq = _qdq_groups(x_TD, block_shape[1])
    out = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xq[tok] @ w13[e].t()
        h = _qdq_groups(torch.nn.functional.silu(gu[:, :F]) * gu[:, F:], block_shape[1])
        o = (h @ w2[e].t()) * topk_weights_TK[tok, slot].float()[:, None]
        out.index_add_(0, tok, o)
    return out.to(x_TD.dtype)
