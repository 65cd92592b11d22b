"""Routers (which experts each token goes to) and expert placement (which rank holds which expert)."""
from routing.eplb import ExpertPlacement, balancedness, gpu_loads, moves, rebalance_experts
from routing.grouped_topk import grouped_topk
from routing.llama4_router import llama4_topk
from routing.placement import expert_owner_ranks, local_expert_ids, make_expert_map
from routing.router import RouterOutput, softmax_topk

__all__ = ["RouterOutput", "softmax_topk", "grouped_topk", "llama4_topk", "make_expert_map",
           "expert_owner_ranks", "local_expert_ids",
           "ExpertPlacement", "rebalance_experts", "moves", "gpu_loads", "balancedness"]
