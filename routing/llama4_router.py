"""Llama-4 router: top-k over the raw router logits, sigmoid of the chosen logits.

Unlike softmax routers, the score multiplies the expert's *input*, not its output:
expert_e(sigmoid(l_e) * x). The MoE block applies it (see models/llama4.py); this function
only selects. Released Llama-4 models use top-1; transformers supports any k (every chosen
expert gets its own scaled input, the outputs are summed), and so does the block.

Legend: T tokens, E experts (global), K top-k.
"""
from __future__ import annotations

import torch

from kernels import batch_invariant
from routing.router import RouterOutput


def llama4_topk(router_logits_TE: torch.Tensor, top_k: int = 1) -> RouterOutput:
    """router_logits_TE [T, E] -> RouterOutput with topk_weights_TK = sigmoid of the top-k
    logits (float32, in (0, 1), to scale the expert INPUT) and topk_ids_TK (int32 global ids)."""
    logits, ids = torch.topk(router_logits_TE, top_k, dim=-1)
    return RouterOutput(batch_invariant.pointwise(torch.sigmoid, logits.float()), ids.to(torch.int32))
