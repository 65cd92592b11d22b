"""All-to-all dispatch: each token travels only to the ranks that hold one of its experts.

Legend: T tokens on this rank, P ranks, S rows this rank sends (distinct (rank, token) pairs),
R rows it receives, D hidden, K top-k, E global experts, B bytes per packed row.

dispatch: owner rank of every slot -> a [P, T] "token goes to rank" mask (a token whose two
experts share a rank is sent there once) -> per-rank counts, exchanged with one small
all_to_all_single -> the send permutation (rank-major, token order within a rank) built with
cumsum + scatter on the device -> one all_to_all_single of packed rows (x + weights + ids, see
all2all.packing). A slot whose expert is on another destination is sent with weight 0 and its
global id, so it contributes nothing there.
combine: the reverse all_to_all_single of the expert outputs, then index_add_ per token.

Host syncs: exactly one per dispatch/combine pair, the `.tolist()` of the split sizes, which
all_to_all_single takes as Python ints and which size the buffers. Nothing else reads back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from all2all.base import DispatchResult, Dispatcher, check_dispatch_args
from all2all.comm import all_to_all_rows
from all2all.packing import RowLayout, pack_rows, unpack_rows


@dataclass(frozen=True)
class _A2AHandle:
    token_idx_S: torch.Tensor  # [S] int64 home token of each sent row, rank-major
    send_splits: list[int]     # [P] rows sent to each rank (= rows that come back from it)
    recv_splits: list[int]     # [P] rows received from each rank
    num_tokens: int
    hidden: int


class AllToAllDispatcher(Dispatcher):
    """x_RD holds the rows sent to this rank, ordered by source rank, then by source token."""

    name = "all_to_all"

    def dispatch(self, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor,
                 topk_ids_TK: torch.Tensor) -> DispatchResult:
        check_dispatch_args(x_TD, topk_weights_TK, topk_ids_TK)
        T, D = x_TD.shape
        K = topk_ids_TK.shape[1]
        P, dev = self.ep_size, x_TD.device
        owner_E = self._on("owner_long", self.owner_ranks.long(), dev)
        dest_TK = owner_E[topk_ids_TK.long()]
        goes_PT = torch.zeros(P, T, dtype=torch.bool, device=dev)
        goes_PT.scatter_(0, dest_TK.t(), True)  # duplicates (two experts on one rank) collapse
        send_counts_P = goes_PT.sum(1)
        recv_counts_P = torch.empty_like(send_counts_P)
        all_to_all_rows(recv_counts_P, send_counts_P, [1] * P, [1] * P, self.group)
        # The ONE host sync: all_to_all_single needs the split sizes as Python ints.
        counts = torch.cat([send_counts_P, recv_counts_P]).tolist()
        send_splits, recv_splits = counts[:P], counts[P:]
        S, R = sum(send_splits), sum(recv_splits)

        # Compact the (rank, token) pairs of goes_PT, rank-major, without nonzero() (it would sync):
        # each set flag's position is its exclusive prefix count; unset flags land in slot S.
        goes_N = goes_PT.flatten()
        slot_N = torch.where(goes_N, torch.cumsum(goes_N, 0) - 1, S)
        pair_S = torch.empty(S + 1, dtype=torch.int64, device=dev)
        pair_S.scatter_(0, slot_N, torch.arange(P * T, dtype=torch.int64, device=dev))
        pair_S = pair_S[:S]
        token_idx_S = pair_S % T if T else pair_S
        dest_S = pair_S // T if T else pair_S

        here_SK = dest_TK[token_idx_S] == dest_S[:, None]
        weights_SK = torch.where(here_SK, topk_weights_TK[token_idx_S].float(), 0.0)
        layout = RowLayout(D, x_TD.dtype, K)
        send_SB = layout.empty(S, dev)
        pack_rows(layout, send_SB, x_TD, token_idx_S, weights_SK, topk_ids_TK[token_idx_S])
        recv_RB = layout.empty(R, dev)
        all_to_all_rows(recv_RB, send_SB, recv_splits, send_splits, self.group)
        x_RD, weights_RK, ids_RK = unpack_rows(layout, recv_RB)
        handle = _A2AHandle(token_idx_S, send_splits, recv_splits, T, D)
        return DispatchResult(x_RD, weights_RK, ids_RK.to(topk_ids_TK.dtype), _handle=handle)

    def combine(self, y_RD: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        h: _A2AHandle = result._handle
        R = sum(h.recv_splits)
        if y_RD.shape[0] != R:
            raise ValueError(f"y has {y_RD.shape[0]} rows, dispatch produced {R}")
        back_SD = torch.empty(len(h.token_idx_S), h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        all_to_all_rows(back_SD, y_RD.reshape(R, h.hidden).contiguous(), h.send_splits,
                        h.recv_splits, self.group)
        # Each token gets one row back per destination rank; index_add_ sums them (on CUDA with
        # atomics, so the summation order, and bf16 rounding, may vary run to run).
        out_TD = torch.zeros(h.num_tokens, h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        out_TD.index_add_(0, h.token_idx_S, back_SD)
        return out_TD
