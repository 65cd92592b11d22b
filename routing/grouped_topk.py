"""DeepSeek-style router: sigmoid (or softmax) scores, a per-expert correction bias used for
selection only, group-limited top-k, weights from the unbiased scores.

Legend: T tokens, E experts (global), K top-k, G expert groups, E/G experts per group.
"""
from __future__ import annotations

import torch

from kernels import batch_invariant
from routing.router import RouterOutput


def grouped_topk(router_logits_TE: torch.Tensor, top_k: int, num_expert_group: int = 1, topk_group: int = 1,
                 renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 e_score_correction_bias_E: torch.Tensor | None = None,
                 scoring_func: str = "sigmoid") -> RouterOutput:
    """Group-limited top-k routing (DeepSeek-V3 `noaux_tc`).

    router_logits_TE: [T, E] logits (any float dtype; scored in fp32).
    e_score_correction_bias_E: [E] added to the scores to *choose* experts only; None = zero.
    Each group of E/G consecutive experts is scored by the sum of its two best biased scores
    (its best one when a group holds a single expert); only the `topk_group` best groups stay
    eligible; the top-k eligible experts are picked by biased score. Their weights are the
    unbiased scores, divided by their sum when `renormalize`, then times `routed_scaling_factor`.
    Returns fp32 weights [T, K] and int32 global expert ids [T, K] (no sentinel values).
    """
    T, E = router_logits_TE.shape
    G = num_expert_group or 1
    if E % G:
        raise ValueError(f"n_routed_experts={E} is not divisible by n_group={G}")
    if not 1 <= (topk_group or G) <= G:
        raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={G}")
    if top_k > (topk_group or G) * (E // G):
        raise ValueError(f"num_experts_per_tok={top_k} exceeds the {topk_group} groups x {E // G} experts "
                         "that remain eligible")
    logits = router_logits_TE.float()
    if scoring_func == "sigmoid":
        scores_TE = batch_invariant.pointwise(torch.sigmoid, logits)
    elif scoring_func == "softmax":
        scores_TE = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func={scoring_func!r} is not supported (sigmoid, softmax)")
    choice_TE = scores_TE if e_score_correction_bias_E is None else scores_TE + e_score_correction_bias_E.float()
    if G > 1:
        per_group = choice_TE.view(T, G, E // G)
        group_scores_TG = per_group.topk(min(2, E // G), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores_TG, k=topk_group, dim=-1, sorted=False)[1]
        group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask_TE = group_mask_TG[:, :, None].expand(T, G, E // G).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~expert_mask_TE, float("-inf"))
    ids_TK = torch.topk(choice_TE, k=top_k, dim=-1, sorted=False)[1]
    weights_TK = scores_TE.gather(1, ids_TK)
    if renormalize:
        # The epsilon is transformers' (keeps an all-zero row finite).
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights_TK = weights_TK * routed_scaling_factor
    return RouterOutput(weights_TK, ids_TK.to(torch.int32))
