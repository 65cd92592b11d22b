"""Expert placement: which expert-parallel rank holds which experts."""
from __future__ import annotations

import torch

PLACEMENT_STRATEGIES = ("linear", "round_robin")


def local_expert_ids(num_experts: int, ep_size: int, ep_rank: int, strategy: str = "linear") -> list[int]:
    """Global ids of the experts rank `ep_rank` holds, in local order.

    linear: rank r holds the contiguous range [r*E/ep, (r+1)*E/ep); round_robin: ids r, r+ep, ...
    """
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"expert_placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}")
    per_rank = num_experts // ep_size
    if strategy == "linear":
        return list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
    return list(range(ep_rank, num_experts, ep_size))


def make_expert_map(num_experts: int, ep_size: int, ep_rank: int, strategy: str = "linear") -> torch.Tensor:
    """[num_experts] int32: global expert id -> local id on `ep_rank`, or -1 where held elsewhere."""
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    local = local_expert_ids(num_experts, ep_size, ep_rank, strategy)
    expert_map[torch.tensor(local, dtype=torch.long)] = torch.arange(len(local), dtype=torch.int32)
    return expert_map


def expert_owner_ranks(num_experts: int, ep_size: int, strategy: str = "linear") -> torch.Tensor:
    """[num_experts] int32: the expert-parallel rank that holds each global expert."""
    owner = torch.empty(num_experts, dtype=torch.int32)
    for rank in range(ep_size):
        owner[torch.tensor(local_expert_ids(num_experts, ep_size, rank, strategy), dtype=torch.long)] = rank
    return owner
