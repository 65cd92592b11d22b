"""All-to-all dispatch: each token travels only to the ranks that hold one of its experts.

Legend: T tokens on this rank, P ranks, S rows this rank sends (distinct (rank, token) pairs),
R rows it receives, D hidden, K top-k, E global experts, B bytes per packed row, W x words.

dispatch:
  1. owner rank of every slot -> here_PTK (slot's expert is on rank p) -> goes_PT (token goes to
     rank p; a token whose experts share a rank is sent there once) -> send counts, exchanged
     with one equal-split all_to_all_single of P int64 (launched at once, on NCCL's stream).
  2. While that exchange is in flight, and before the host knows S: slot_PT = the send-buffer
     row of each (rank, token) pair (rank-major, token order within a rank), from one cumsum;
     then x and the metadata are scattered (index_put_) into a send buffer of P*T + 1 rows, the
     worst case (the size of all-gather's receive buffer). Row 0 is a trash row that every
     unsent pair writes to; rows 1..S are sent. A slot whose expert is on another destination
     is sent with weight 0 and its global id, so it contributes nothing there.
  3. The one host sync, the `.tolist()` of the 2P counts that all_to_all_single needs as Python
     ints, then one all_to_all_single of the packed rows (x + weights + ids, all2all.packing).
combine: the reverse all_to_all_single into rows 1..S of a buffer whose row 0 is zero, then
  out[t] = sum_p back[slot_PT[p, t]]: one gather + one sum over P in fp32, deterministic (no
  atomics; index_add_ of bf16 rows was the slowest kernel of the first version).

Per dispatch + combine: 1 host sync, no host->device copy, 3 NCCL calls, ~15 small kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from all2all.base import DispatchResult, Dispatcher, check_dispatch_args
from all2all.comm import all_to_all_rows
from all2all.packing import RowLayout, unpack_rows


@dataclass(frozen=True)
class _A2AHandle:
    slot_PT: torch.Tensor      # [P, T] int64 row of (rank p, token t) in the send/back buffer; 0 = not sent
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

        dest_TK = self._owner_on(dev)[topk_ids_TK]
        ranks_P11 = self._on("ranks_P11", dev, lambda: torch.arange(P).view(P, 1, 1))
        here_PTK = dest_TK[None] == ranks_P11
        goes_PT = here_PTK.any(dim=2)
        counts_2P = torch.empty(2 * P, dtype=torch.int64, device=dev)
        torch.sum(goes_PT, dim=1, out=counts_2P[:P])
        all_to_all_rows(counts_2P[P:], counts_2P[:P], None, None, self.group)
        self._phase("count_exchange")

        # Overlaps the count exchange: everything below needs no host-side S.
        slot_PT = torch.cumsum(goes_PT.view(-1), 0).view(P, T).mul_(goes_PT)
        send_NB = layout.empty(P * T + 1, dev)
        meta_PTM = torch.empty(P, T, 2 * K, dtype=torch.int32, device=dev)
        torch.mul(here_PTK, topk_weights_TK, out=meta_PTM[..., :K].view(torch.float32))
        meta_PTM[..., K:].copy_(topk_ids_TK)
        if T:
            layout.x_words(send_NB).index_put_((slot_PT,), layout.words_of(x_TD))
            layout.meta_view(send_NB).index_put_((slot_PT,), meta_PTM)
        self._phase("pack")

        # The ONE host sync: all_to_all_single needs the split sizes as Python ints.
        counts = counts_2P.tolist()
        self._phase("sync")
        send_splits, recv_splits = counts[:P], counts[P:]
        S, R = sum(send_splits), sum(recv_splits)
        recv_RB = layout.empty(R, dev)
        all_to_all_rows(recv_RB, send_NB[1:S + 1], recv_splits, send_splits, self.group)
        self._phase("transfer")
        x_RD, weights_RK, ids_RK = unpack_rows(layout, recv_RB)
        handle = _A2AHandle(slot_PT, send_splits, recv_splits, T, D)
        ids_RK = ids_RK.contiguous() if topk_ids_TK.dtype == torch.int32 else ids_RK.to(topk_ids_TK.dtype)
        result = DispatchResult(x_RD, weights_RK.contiguous(), ids_RK, _handle=handle)
        self._phase("unpack")
        return result

    def combine(self, y_RD: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        h: _A2AHandle = result._handle
        R, S = sum(h.recv_splits), sum(h.send_splits)
        if y_RD.shape[0] != R:
            raise ValueError(f"y has {y_RD.shape[0]} rows, dispatch produced {R}")
        back_ND = torch.empty(S + 1, h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        back_ND[0].zero_()  # what every unsent (rank, token) pair gathers
        all_to_all_rows(back_ND[1:], y_RD.reshape(R, h.hidden).contiguous(), h.send_splits,
                        h.recv_splits, self.group)
        self._phase("combine_transfer")
        P, T = h.slot_PT.shape
        if P == 1:
            out_TD = back_ND.index_select(0, h.slot_PT[0])
            self._phase("combine")
            return out_TD
        # Each token has one row per rank it went to (zero row elsewhere): sum them. For P == 2
        # one elementwise add (computed in fp32, rounded once): sum(0) over a [2, T, D] tensor
        # runs a reduction kernel ~2.5x slower than the add (H200 profile, T=4096).
        back_PTD = back_ND.index_select(0, h.slot_PT.view(-1)).view(P, T, h.hidden)
        out_TD = torch.add(back_PTD[0], back_PTD[1]) if P == 2 else back_PTD.sum(0)
        self._phase("combine")
        return out_TD
