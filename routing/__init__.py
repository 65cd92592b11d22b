"""Routers (which experts each token goes to) and expert placement (which rank holds which expert)."""
from routing.router import RouterOutput, softmax_topk
from routing.placement import make_expert_map

__all__ = ["RouterOutput", "softmax_topk", "make_expert_map"]
