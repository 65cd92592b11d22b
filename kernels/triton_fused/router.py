"""Softmax top-k router in one launch: routing/router.py's softmax_topk.

Legend: T tokens, E experts (<= 512), K top-k (<= 16), BLOCK_T token rows per program,
BLOCK_E = E padded to a power of two, BLOCK_K = K padded to a power of two.

Per row: softmax over the E logits in fp32 (exp(x - max) / sum), then K passes of "take the
maximum, then mask it out" in registers, so weights come out in descending order; among equal
probabilities the lowest expert id is taken first (torch.topk leaves that order unspecified).
With renormalize the K weights are divided by their sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_fused.common import check_float, unit_last_stride

MAX_EXPERTS = 512
MAX_TOP_K = 16


# The row count changes with the batch: not specialised on, so every batch size shares one
# compiled kernel (no compile while a CUDA graph of a new size is captured).
@triton.jit(do_not_specialize=["T"])
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_t,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_mask = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_mask = cols < E
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where(col_mask[None, :], x, float("-inf"))  # rows past T read zeros: finite, never stored
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(col_mask[None, :], p, -1.0)  # padding below every probability
    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(p, axis=1)
        # lowest index holding the maximum: explicit, so ties do not depend on argmax's rule
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        weights = tl.where(kcols[None, :] == k, best[:, None], weights)
        ids = tl.where(kcols[None, :] == k, idx[:, None], ids)
        p = tl.where(cols[None, :] == idx[:, None], -2.0, p)  # taken: below padding and every probability
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # columns >= K hold 0
    out_mask = row_mask[:, None] & (kcols < K)[None, :]
    offs = rows[:, None] * K + kcols[None, :]
    tl.store(w_ptr + offs, weights, mask=out_mask)
    tl.store(ids_ptr + offs, ids, mask=out_mask)


def softmax_topk_triton(logits_TE: torch.Tensor, top_k: int, renormalize: bool,
                        out_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_TK fp32, ids_TK int32) of the top_k softmax probabilities of each row, descending.

    logits_TE: [T, E] fp32/fp16/bf16, any row stride; E <= 512, top_k <= min(E, 16).
    out_ids: a contiguous [T, top_k] int32 tensor to write the ids into (the expert-load
    counters' step buffer); a new one when None.
    """
    check_float("logits", logits_TE)
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    if not 0 < E <= MAX_EXPERTS:
        raise ValueError(f"softmax_topk_triton handles 1..{MAX_EXPERTS} experts, got {E}")
    if not 0 < top_k <= min(E, MAX_TOP_K):
        raise ValueError(f"top_k must be in 1..{min(E, MAX_TOP_K)} (E={E}, at most {MAX_TOP_K}), got {top_k}")
    logits = unit_last_stride(logits_TE)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device) if out_ids is None else out_ids
    if T > 0:
        BLOCK_E = triton.next_power_of_2(E)
        BLOCK_T = max(1, min(8, 1024 // BLOCK_E))
        _softmax_topk_kernel[(triton.cdiv(T, BLOCK_T),)](
            logits, weights, ids, T, E, logits.stride(0), K=top_k, RENORMALIZE=bool(renormalize),
            BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k), num_warps=4, **pdl_launch(logits))
    return weights, ids
