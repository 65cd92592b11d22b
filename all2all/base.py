"""The dispatcher protocol: move routed tokens to the ranks that hold their experts, and back.

Legend: T tokens on this rank, R rows received by this rank, D hidden, K top-k,
E global experts, P ranks of the expert-parallel (EP) group.

A MoE block on every rank of the EP group runs, in the same order on all ranks:

    recv = dispatcher.dispatch(x_TD, topk_weights_TK, topk_ids_TK)
    y_RD = fused_experts(recv.x_RD, w13_local, w2_local, recv.topk_weights_RK,
                         recv.topk_ids_RK, expert_map=dispatcher.expert_map_on(x_TD.device))
    y_TD = dispatcher.combine(y_RD, recv)

`dispatch` and `combine` are collectives over the EP group: every rank must call them, even one
with T == 0 (a rank without work runs a dummy batch so the collectives never hang; see
moe/worker/model_runner.py and docs/architecture.md).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from routing.placement import PLACEMENT_STRATEGIES, expert_owner_ranks, make_expert_map


@dataclass
class DispatchResult:
    """What a rank receives from `dispatch`: the rows its local experts must process.

    Attributes:
        x_RD: [R, D] activations, dtype of the dispatched x. May be a row-strided view
            (stride(1) == 1, stride(0) >= D) of the receive buffer: the backends pack the routing
            metadata behind each row so one collective carries everything. R may be 0.
        topk_weights_RK: [R, K] float32 routed weights (the local backend passes the caller's
            tensor through unchanged). A slot whose expert lives on another rank has weight 0
            here (the owning rank applies the real weight).
        topk_ids_RK: [R, K] GLOBAL expert ids in [0, E), dtype of the dispatched ids. Slots of
            experts held elsewhere keep their global id: `expert_map` maps them to -1, so they
            contribute nothing on this rank.
        _handle: backend-private state that only `combine` reads (splits, permutation, counts).
    """

    x_RD: torch.Tensor
    topk_weights_RK: torch.Tensor
    topk_ids_RK: torch.Tensor
    _handle: Any = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return self.x_RD.shape[0]


class Dispatcher(ABC):
    """Token dispatcher of one EP group. Subclasses implement `dispatch` and `combine`.

    Args:
        group: the EP process group (None = the default group, or a single process when
            torch.distributed is not initialised). Tensors must live on a device the group's
            backend can use (CPU for gloo, the rank's CUDA device for NCCL).
        num_experts: E, the number of global experts (divisible by the group size).
        placement: "linear" or "round_robin" (routing.placement), identical on every rank.
    """

    name: str = "base"
    # all2all.phases.PhaseTimer marking the phases of dispatch / combine (None: not timed).
    phase_timer = None

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, placement: str = "linear"):
        if placement not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement must be one of {PLACEMENT_STRATEGIES}, got {placement!r}")
        self.group = group
        self.ep_size, self.ep_rank = group_size_and_rank(group)
        self.num_experts = num_experts
        self.placement = placement
        # Validates divisibility; CPU copies, moved lazily per device (see `_on`).
        self.expert_map = make_expert_map(num_experts, self.ep_size, self.ep_rank, placement)
        self.owner_ranks = expert_owner_ranks(num_experts, self.ep_size, placement)
        self._device_cache: dict[tuple[str, torch.device], torch.Tensor] = {}

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor,
                 topk_ids_TK: torch.Tensor) -> DispatchResult:
        """Send each token to the ranks holding its experts.

        Args:
            x_TD: [T, D] activations (fp32/bf16/fp16), T may be 0 and may differ across ranks.
            topk_weights_TK: [T, K] routed weights (any float dtype; carried as float32).
            topk_ids_TK: [T, K] GLOBAL expert ids in [0, E) (int32 or int64).
        Returns:
            DispatchResult with the rows this rank's experts must process.
        """

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        """Return each token's expert outputs to its home rank, summed over ranks.

        Args:
            y_RD: [R, D] this rank's expert output for `result.x_RD` (non-local slots already 0).
            result: the DispatchResult of the matching `dispatch` call.
        Returns:
            [T, D] in the dtype of `y_RD`, aligned with the `x_TD` given to `dispatch`.
        """

    def _phase(self, name: str) -> None:
        """End of a phase of dispatch or combine (all2all/phases.py names them)."""
        if self.phase_timer is not None:
            self.phase_timer.mark(name)

    def expert_map_on(self, device: torch.device | str) -> torch.Tensor:
        """[E] int32 global -> local expert id on this rank (-1 = elsewhere), on `device`."""
        return self._on("expert_map", device, lambda: self.expert_map)

    def _on(self, key: str, device: torch.device | str, make) -> torch.Tensor:
        """Per-device cache of a constant table: `make()` (a CPU tensor) is copied to `device`
        once, so a dispatch does no host->device copy and no host-side tensor work."""
        cached = self._device_cache.get((key, device))
        if cached is None:
            cached = make().to(device)
            self._device_cache[(key, device)] = cached
            self._device_cache[(key, torch.device(device))] = cached
        return cached

    def _owner_on(self, device: torch.device) -> torch.Tensor:
        """[E] int64 owner rank of each global expert, on `device`."""
        return self._on("owner_long", device, lambda: self.owner_ranks.long())

    def _is_local_on(self, device: torch.device) -> torch.Tensor:
        """[E] bool: expert lives on this rank, on `device`."""
        return self._on("is_local", device, lambda: self.expert_map >= 0)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ep_size={self.ep_size}, ep_rank={self.ep_rank}, "
                f"num_experts={self.num_experts}, placement={self.placement!r})")


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, rank) of `group`; (1, 0) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_dispatch_args(x_TD: torch.Tensor, topk_weights_TK: torch.Tensor,
                        topk_ids_TK: torch.Tensor) -> None:
    if x_TD.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x_TD.shape)}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"topk_ids must be [{x_TD.shape[0]}, K], got shape {tuple(topk_ids_TK.shape)}")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights_TK.shape)} and topk_ids "
                         f"{tuple(topk_ids_TK.shape)} must have the same shape")
    if topk_ids_TK.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids_TK.dtype}")
