"""Router functions: router logits -> (top-k weights, top-k expert ids).

Legend: T tokens, E experts (global), K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouterOutput:
    """topk_weights_TK: float32 routed weights; topk_ids_TK: int32 global expert ids."""
    topk_weights_TK: torch.Tensor
    topk_ids_TK: torch.Tensor


def softmax_topk(router_logits_TE: torch.Tensor, top_k: int, renormalize: bool) -> RouterOutput:
    """Qwen-style router: softmax over all experts in fp32, keep the top-k, optionally renormalise."""
    probs = torch.softmax(router_logits_TE, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return RouterOutput(weights, ids.to(torch.int32))
