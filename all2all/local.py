"""The one-rank dispatcher: every expert is local, so dispatch and combine are identities.

Legend: T tokens, R received rows (== T here), D hidden, K top-k.
"""
from __future__ import annotations

import torch

from all2all.base import DispatchResult, Dispatcher, check_dispatch_args


class LocalDispatcher(Dispatcher):
    """EP size 1. Returns the caller's tensors themselves: no copies, no collectives."""

    name = "local"

    def __init__(self, group, num_experts: int, placement: str = "linear"):
        super().__init__(group, num_experts, placement)
        if self.ep_size != 1:
            raise ValueError(f"the 'local' dispatcher needs an EP group of size 1, got {self.ep_size}; "
                             "use 'allgather_reducescatter', 'all_to_all' or 'auto'")

    def dispatch(self, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor,
                 topk_ids_TK: torch.Tensor) -> DispatchResult:
        check_dispatch_args(x_TD, topk_weights_TK, topk_ids_TK)
        # R == T and every slot is local; weights keep the caller's dtype (no cast, no copy).
        return DispatchResult(x_TD, topk_weights_TK, topk_ids_TK, _handle=x_TD.shape[0])

    def combine(self, y_RD: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        if y_RD.shape[0] != result._handle:
            raise ValueError(f"y has {y_RD.shape[0]} rows, dispatch produced {result._handle}")
        return y_RD
