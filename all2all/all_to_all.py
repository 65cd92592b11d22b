"""All-to-all dispatch: each token travels only to the ranks that hold one of its experts.

Legend: T tokens on this rank, P ranks, S rows this rank sends (distinct (rank, token) pairs),
R rows it receives, D hidden, K top-k, E global experts, B bytes per packed row, W x words.

dispatch (kernels/triton_dispatch/ops.py: one Triton launch each on CUDA, their torch references
elsewhere):
  1. route: for each destination p, in token order, the tokens with an expert on p (a token whose
     experts share a rank goes there once): their slots and the send counts, which go out at once
     in one equal-split all_to_all_single of P int64 (on NCCL's stream).
  2. While that exchange is in flight, and before the host knows S: pack_var writes the S rows,
     back to back by destination, into a send buffer of P*T rows (the worst case): x, weights
     (zero for experts on other destinations) and ids in one byte row each (all2all.packing).
  3. The one host sync, the `.tolist()` of the 2P counts that all_to_all_single needs as Python
     ints, then one all_to_all_single of the packed rows; unpack_var makes the dense weights and
     ids (x stays a view of the received rows).
combine: the reverse all_to_all_single, then out[t] = sum_p back[row of (p, t)] in fp32, in rank
  order (deterministic, no atomics): one launch.

Per dispatch + combine: 1 host sync, no host->device copy, 3 NCCL calls, 5 kernels on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from all2all.base import DispatchResult, Dispatcher, check_dispatch_args
from all2all.comm import all_to_all_rows
from all2all.packing import RowLayout
from kernels.triton_dispatch import ops


@dataclass(frozen=True)
class _A2AHandle:
    row_PT: torch.Tensor       # [P, T] int64 row of (rank p, token t) among the rows sent; P*T = not sent
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
        layout = RowLayout(D, x_TD.dtype, K)
        owner_E = self._owner_on(dev)

        row_PT, tok_N, send_counts_P = ops.route(topk_ids_TK, owner_E, P, T)
        recv_counts_P = torch.empty_like(send_counts_P)
        all_to_all_rows(recv_counts_P, send_counts_P, None, None, self.group)
        self._phase("count_exchange")

        # Overlaps the count exchange: nothing below needs the host to know S.
        send_NB = layout.empty(P * T, dev)
        ops.pack_var(layout.words_of(x_TD), topk_weights_TK, topk_ids_TK, owner_E, tok_N, send_counts_P, row_PT,
                     layout.x_words(send_NB), layout.meta_view(send_NB))
        self._phase("pack")

        # The ONE host sync: all_to_all_single needs the split sizes as Python ints.
        counts = torch.cat((send_counts_P, recv_counts_P)).tolist()
        self._phase("sync")
        send_splits, recv_splits = counts[:P], counts[P:]
        S, R = sum(send_splits), sum(recv_splits)
        recv_RB = layout.empty(R, dev)
        all_to_all_rows(recv_RB, send_NB[:S], recv_splits, send_splits, self.group)
        self._phase("transfer")
        weights_RK = torch.empty(R, K, dtype=torch.float32, device=dev)
        ids_RK = torch.empty(R, K, dtype=topk_ids_TK.dtype, device=dev)
        ops.unpack_var(layout.meta_view(recv_RB), weights_RK, ids_RK)
        result = DispatchResult(layout.x_view(recv_RB), weights_RK, ids_RK,
                                _handle=_A2AHandle(row_PT, send_splits, recv_splits, T, D))
        self._phase("unpack")
        return result

    def combine(self, y_RD: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        h: _A2AHandle = result._handle
        R, S = sum(h.recv_splits), sum(h.send_splits)
        if y_RD.shape[0] != R:
            raise ValueError(f"y has {y_RD.shape[0]} rows, dispatch produced {R}")
        back_SD = torch.empty(S, h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        all_to_all_rows(back_SD, y_RD.reshape(R, h.hidden).contiguous(), h.send_splits,
                        h.recv_splits, self.group)
        self._phase("combine_transfer")
        out_TD = torch.empty(h.num_tokens, h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        ops.combine(back_SD, h.row_PT, out_TD)
        self._phase("combine")
        return out_TD
