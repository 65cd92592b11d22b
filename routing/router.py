"""Router functions: router logits -> (top-k weights, top-k expert ids).

Legend: T tokens, E experts (global), K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton_fused import fused_kernels_serve


@dataclass
class RouterOutput:
    """topk_weights_TK: float32 routed weights; topk_ids_TK: int32 global expert ids."""
    topk_weights_TK: torch.Tensor
    topk_ids_TK: torch.Tensor


def use_triton_fused(x: torch.Tensor) -> bool:
    """Whether softmax_topk runs the fused Triton kernel (CUDA, Triton importable). Tests
    monkeypatch this to run it on the CPU under TRITON_INTERPRET=1."""
    return fused_kernels_serve(x)


def softmax_topk(router_logits_TE: torch.Tensor, top_k: int, renormalize: bool,
                 out_ids: torch.Tensor | None = None) -> RouterOutput:
    """Qwen-style router: softmax over all experts in fp32, keep the top-k, optionally renormalise.
    On CUDA (E <= 512, top_k <= 16) one Triton launch; among equal probabilities it takes the
    lowest expert id first, where torch.topk's order is unspecified.

    out_ids: a contiguous [T, top_k] int32 tensor that receives the ids (the expert-load counters'
    step buffer, counted once per step for all layers: moe/expert_load/counters.py)."""
    E = router_logits_TE.shape[-1]
    if router_logits_TE.dim() == 2 and E <= 512 and top_k <= 16 and use_triton_fused(router_logits_TE):
        from kernels.triton_fused.router import softmax_topk_triton

        return RouterOutput(*softmax_topk_triton(router_logits_TE, top_k, renormalize, out_ids))
    probs = torch.softmax(router_logits_TE, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if out_ids is not None:
        return RouterOutput(weights, out_ids.copy_(ids))
    return RouterOutput(weights, ids.to(torch.int32))

# softmax_topk takes `out_ids`: a MoEBlock may have it write into the expert-load step buffer.
softmax_topk.writes_ids_into = True
