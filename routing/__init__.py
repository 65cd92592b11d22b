"""Routers (which experts each token goes to) and expert placement (which rank holds which expert)."""
from routing.router import RouterOutput, softmax_topk
from routing.placement import expert_owner_ranks, local_expert_ids, make_expert_map

__all__ = ["RouterOutput", "softmax_topk", "make_expert_map", "expert_owner_ranks", "local_expert_ids"]
