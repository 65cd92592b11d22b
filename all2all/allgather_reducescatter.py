"""All-gather + reduce-scatter dispatch: every rank sees every token and computes its experts.

Legend: T tokens on this rank, M = max tokens over ranks, P ranks, R = P*M received rows,
D hidden, K top-k, B bytes per packed row (all2all.packing).

Moves each token to every rank whatever its routing, so its bytes do not depend on top-k or
placement; vLLM's default. Ranks may hold different T (data parallelism), including 0: the
counts are all-gathered first and every rank pads to M, because the one-tensor all-gather and
reduce-scatter need equal chunks. Padding rows are zero with weight 0 and an id that is not
on this rank, so the expert kernel skips them.

Per dispatch + combine: the count all-gather (its input made by a fill kernel, not copied from
the host), packing launched while it is in flight, 1 host sync (M), the row all-gather, 3 small
kernels for the metadata (5 when ranks hold different T), the reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from all2all.base import DispatchResult, Dispatcher, check_dispatch_args
from all2all.comm import all_gather_rows, reduce_scatter_rows
from all2all.packing import RowLayout, pack_rows, unpack_rows


@dataclass(frozen=True)
class _AGHandle:
    num_tokens: int  # T of this rank
    max_tokens: int  # M, the padded chunk per rank
    hidden: int


class AllGatherReduceScatterDispatcher(Dispatcher):
    """x_RD holds all ranks' tokens, rank-major, each rank's chunk padded to M rows."""

    name = "allgather_reducescatter"

    def __init__(self, group, num_experts: int, placement: str = "linear"):
        super().__init__(group, num_experts, placement)
        # A global id that is NOT on this rank, for padding rows (-1 would index expert_map[-1]).
        foreign = (self.expert_map < 0).nonzero().flatten()
        self._foreign_id = int(foreign[0]) if foreign.numel() else 0

    def dispatch(self, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor,
                 topk_ids_TK: torch.Tensor) -> DispatchResult:
        check_dispatch_args(x_TD, topk_weights_TK, topk_ids_TK)
        T, D = x_TD.shape
        K = topk_ids_TK.shape[1]
        P, dev = self.ep_size, x_TD.device
        layout = RowLayout(D, x_TD.dtype, K)
        counts_P = torch.empty(P, dtype=torch.int64, device=dev)
        all_gather_rows(counts_P, torch.full((1,), T, dtype=torch.int64, device=dev), self.group)
        self._phase("count_exchange")
        # Pack while the counts travel: this rank's chunk is its T rows, whatever M turns out to be.
        send_TB = layout.empty(T, dev)
        pack_rows(layout, send_TB, x_TD, topk_weights_TK, topk_ids_TK)
        self._phase("pack")
        # The one host sync: buffer sizes (M) must be known on the host to allocate and launch.
        counts = counts_P.tolist()
        self._phase("sync")
        M = max(counts)
        if M == 0:  # every rank knows it is empty: skip the collective on all ranks alike
            recv_RB = layout.empty(0, dev)
        else:
            if M > T:  # padding: x = 0, weight = 0, id 0 (replaced below)
                send_TB = torch.cat([send_TB, send_TB.new_zeros(M - T, layout.row_bytes)])
            recv_RB = layout.empty(P * M, dev)
            all_gather_rows(recv_RB, send_TB, self.group)
        self._phase("transfer")
        x_RD, weights_RK, ids_RK = unpack_rows(layout, recv_RB)
        # Non-local slots get weight 0 (the contract of DispatchResult), padding rows too.
        keep_RK = self._is_local_on(dev)[ids_RK]
        if min(counts) < M:
            valid_R = (torch.arange(M, device=dev)[None, :] < counts_P[:, None]).flatten()
            keep_RK &= valid_R[:, None]
            ids_RK = torch.where(valid_R[:, None], ids_RK, self._foreign_id)
        weights_RK = torch.mul(keep_RK, weights_RK)
        ids_RK = ids_RK.contiguous() if topk_ids_TK.dtype == torch.int32 else ids_RK.to(topk_ids_TK.dtype)
        self._phase("unpack")
        return DispatchResult(x_RD, weights_RK, ids_RK, _handle=_AGHandle(T, M, D))

    def combine(self, y_RD: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        h: _AGHandle = result._handle
        if y_RD.shape[0] != self.ep_size * h.max_tokens:
            raise ValueError(f"y has {y_RD.shape[0]} rows, dispatch produced {self.ep_size * h.max_tokens}")
        out_MD = torch.empty(h.max_tokens, h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        if h.max_tokens:
            reduce_scatter_rows(out_MD, y_RD.contiguous(), self.group)
        self._phase("combine_transfer")
        return out_MD[:h.num_tokens]
