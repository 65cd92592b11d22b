"""Low-latency dispatch: fixed-capacity buffers, one equal-split all-to-all each way, no host sync.

Legend: T tokens on this rank, P ranks, C capacity (rows any rank sends to any one rank per
call), N = P*C send rows = R received rows, D hidden, K top-k, E global experts, B bytes per
packed row, W x words, M = 2K+1 metadata int32 per row.

In the manner of DeepEP's low-latency mode: every shape is fixed by C, so nothing the host must
know depends on the routing, and a whole dispatch + experts + combine can be captured in a CUDA
graph. All steps are kernels/triton_dispatch (Triton on CUDA, torch references elsewhere):

dispatch:
  1. route: slot of each (destination p, token t) pair = prefix count of the tokens going to p
     (a token whose experts share a rank goes there once), deterministic, no atomics.
  2. pack: every row of the [P, C] send buffer is written: row p*C + s = token x + weights (zero
     for experts not on p) + global ids + p's count; padding rows (s >= count) carry x = 0,
     weight 0 and an id of an expert not on p, so `expert_map` skips them there.
  3. ONE equal-split all_to_all_single of the N packed rows (the counts ride in the rows: no
     count exchange, no split lists, no `.tolist()`).
  4. unpack: dense weights/ids and the per-source counts. x_RD is a row-strided view, R = P*C
     always: the expert kernel sees a static shape.
combine: the same equal-split all_to_all_single of y_RD back, then out[t] = sum_p back[row of
  (p, t)] in fp32, in rank order (one gather kernel, deterministic).
Per dispatch + combine: 0 host syncs, 2 collectives, 4 kernels (+ a few tiny allocations).

Capacity contract (why no token is ever dropped): a token goes to a destination at most once,
so a destination gets at most T rows from a rank; T <= C on every rank is therefore sufficient.
T is known on the host, so the check costs nothing. Every rank must take the same path (the
collectives must match), but T differs per rank under data parallelism, so the decision cannot
look at T alone without a collective. Hence:
  * `dispatch(..., max_tokens_across_ranks=M)`: the caller passes the step's largest T over the
    EP group (the same value on every rank; a runner under DP already knows it, it pads its
    CUDA-graph batch to it). M <= C: the low-latency path with chunks of M rows per destination
    instead of C (enough, since T <= M everywhere, and the same on every rank: a decode batch of
    8 moves 8 rows per destination, not the capacity; each CUDA graph has its M); M > C: every
    rank falls back to the variable-size backend `fallback` for this call (all_to_all by
    default; "auto" picks it by bytes), logged once.
  * without it, C is a hard limit: T > C raises ValueError before any collective. (The other
    ranks then wait in their collective until the group's timeout, so a caller whose ranks may
    disagree must pass M.)
  * debug (arg or MOE_LOW_LATENCY_DEBUG=1): after routing, sync and raise RuntimeError if any
    destination count exceeds the call's chunk or an id is out of [0, E). Off in the hot path: the
    route kernel never writes past the chunk, so a broken contract loses rows, it does not corrupt
    memory.

Bytes per rank and when this wins (for the `auto` rule): all_to_all sends sum_t m_t rows (m_t =
distinct ranks of token t's experts, m ~ P(1 - C(E-E/P, k)/C(E, k)) under uniform routing) after
a count exchange and a host sync; low_latency always sends P*C rows of B = D*itemsize + 8K + ~16
bytes (its own chunk included), whatever the routing, and the expert kernel sorts P*C*K slots.
Bytes ratio low_latency / all_to_all = P*C / (m*T). It wins when latency, not bandwidth, bounds
the step: decode, small T close to C (set C to the decode batch per rank, e.g. max_num_seqs), where
the host sync + launch overhead of the eager path (tens of us per layer) dwarfs the padding traffic
and the CUDA graph removes the launches; it loses for prefill (T >> typical C, falls back) and when
T << C (P*C*B of mostly padding). E.g. D=7168 bf16, P=8, C=128: 8*128*14.4 KB = 14.7 MB per
direction per rank per layer.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from all2all.allgather_reducescatter import AllGatherReduceScatterDispatcher
from all2all.all_to_all import AllToAllDispatcher
from all2all.base import DispatchResult, Dispatcher, check_dispatch_args
from all2all.comm import all_to_all_rows
from all2all.packing import RowLayout
from kernels.triton_dispatch import ops

logger = logging.getLogger("all2all.low_latency")

DEFAULT_CAPACITY = 256  # vLLM's default max_num_seqs: a decode batch per rank
CAPACITY_ENV = "MOE_LOW_LATENCY_CAPACITY"
DEBUG_ENV = "MOE_LOW_LATENCY_DEBUG"
_ALIGN = 16


@dataclass(frozen=True)
class CountedRowLayout:
    """A RowLayout row plus one int32 behind the metadata: the count of the row's chunk."""

    base: RowLayout

    @property
    def meta_width(self) -> int:
        return 2 * self.base.top_k + 1

    @property
    def row_bytes(self) -> int:
        end = self.base.meta_offset + 4 * self.meta_width
        return -(-end // _ALIGN) * _ALIGN

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def meta(self, buf_NB: torch.Tensor) -> torch.Tensor:
        """[N, 2K+1] int32 view: weight bits, ids, count."""
        o = self.base.meta_offset
        return buf_NB[:, o:o + 4 * self.meta_width].view(torch.int32)


@dataclass(frozen=True)
class _LLHandle:
    chunk: int                   # C of this call: rows per destination
    row_PT: torch.Tensor         # [P, T] int64 send row of (rank p, token t); N = not sent
    recv_counts_P: torch.Tensor  # [P] int64 rows each source really sent (the rest is padding)
    send_counts_P: torch.Tensor  # [P] int64 rows this rank sent to each destination
    num_tokens: int
    hidden: int


@dataclass(frozen=True)
class _FallbackHandle:
    inner: DispatchResult  # the fallback backend's result


# The variable-size backends a call over the capacity may fall back to.
_FALLBACK_CLASSES: dict[str, type[Dispatcher]] = {"all_to_all": AllToAllDispatcher,
                                                  "allgather_reducescatter": AllGatherReduceScatterDispatcher}


class LowLatencyDispatcher(Dispatcher):
    """x_RD holds P chunks of C rows, ordered by source rank, then by source token; see the
    module docstring for the capacity contract.

    Args:
        group, num_experts, placement: as for every Dispatcher.
        capacity: C, identical on every rank; None = $MOE_LOW_LATENCY_CAPACITY, else 256.
        debug: check the counts and ids on every dispatch (host sync); None = $MOE_LOW_LATENCY_DEBUG.
        fallback: the variable-size backend of calls over the capacity ("all_to_all" or
            "allgather_reducescatter"; backend "auto" passes the one its bytes rule picks).
    """

    name = "low_latency"

    def __init__(self, group, num_experts: int, placement: str = "linear", capacity: int | None = None,
                 debug: bool | None = None, fallback: str = "all_to_all"):
        super().__init__(group, num_experts, placement)
        if fallback not in _FALLBACK_CLASSES:
            raise ValueError(f"low_latency fallback must be one of {tuple(_FALLBACK_CLASSES)}, got {fallback!r}")
        self.fallback_backend = fallback
        if capacity is None:
            capacity = int(os.environ.get(CAPACITY_ENV, DEFAULT_CAPACITY))
        if capacity < 1:
            raise ValueError(f"low_latency capacity must be >= 1 rows per destination, got {capacity}")
        self.capacity = capacity
        self.debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0") if debug is None else debug
        self._fallback: Dispatcher | None = None
        self._fallback_logged = False
        # Padding rows sent to p carry the first expert not on p (expert 0 when P == 1: x and
        # weight are zero there, so it adds nothing either).
        owner = self.owner_ranks.long()
        self._pad_ids = torch.tensor([int((owner != p).nonzero()[0]) if (owner != p).any() else 0
                                      for p in range(self.ep_size)], dtype=torch.int64)

    def dispatch(self, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                 max_tokens_across_ranks: int | None = None) -> DispatchResult:
        """As Dispatcher.dispatch; `max_tokens_across_ranks`: the largest T of this call over the
        group, the same on every rank (see the module docstring), or None (T <= C is required)."""
        check_dispatch_args(x_TD, topk_weights_TK, topk_ids_TK)
        T, D = x_TD.shape
        C = self.capacity
        if max_tokens_across_ranks is not None:
            if max_tokens_across_ranks < T:
                raise ValueError(f"max_tokens_across_ranks={max_tokens_across_ranks} is below this rank's "
                                 f"{T} tokens")
            if max_tokens_across_ranks > C:
                return self._dispatch_fallback(x_TD, topk_weights_TK, topk_ids_TK, max_tokens_across_ranks)
            # Chunks of M rows suffice (no rank sends more than its T <= M to one destination) and
            # M is the same on every rank: a small decode batch does not move the whole capacity.
            return self._dispatch_fixed(x_TD, topk_weights_TK, topk_ids_TK, max(max_tokens_across_ranks, 1))
        elif T > C:
            raise ValueError(f"low_latency dispatcher: {T} tokens exceed capacity={C} rows per destination; "
                             f"raise the capacity or pass max_tokens_across_ranks (identical on every rank) "
                             f"to fall back to {self.fallback_backend} for such calls")
        return self._dispatch_fixed(x_TD, topk_weights_TK, topk_ids_TK, C)

    def _dispatch_fixed(self, x_TD, topk_weights_TK, topk_ids_TK, C: int) -> DispatchResult:
        """The fixed path with chunks of C rows per destination (T <= C on every rank)."""
        T, D = x_TD.shape
        K = topk_ids_TK.shape[1]
        P, dev = self.ep_size, x_TD.device
        N = P * C
        layout = CountedRowLayout(RowLayout(D, x_TD.dtype, K))
        owner_E = self._owner_on(dev)

        if self.debug:
            self._check_ids(topk_ids_TK)
        row_PT, tok_N, send_counts_P = ops.route(topk_ids_TK, owner_E, P, C)
        if self.debug:
            self._check_counts(send_counts_P, C)
        self._phase("route")
        send_NB = layout.empty(N, dev)
        ops.pack(layout.base.words_of(x_TD), topk_weights_TK, topk_ids_TK, owner_E, tok_N, send_counts_P,
                 self._on("pad_ids", dev, lambda: self._pad_ids), layout.base.x_words(send_NB),
                 layout.meta(send_NB), C)
        self._phase("pack")
        recv_NB = layout.empty(N, dev)
        all_to_all_rows(recv_NB, send_NB, None, None, self.group)
        self._phase("transfer")

        weights_RK = torch.empty(N, K, dtype=torch.float32, device=dev)
        ids_RK = torch.empty(N, K, dtype=topk_ids_TK.dtype, device=dev)
        recv_counts_P = torch.empty(P, dtype=torch.int64, device=dev)
        ops.unpack(layout.meta(recv_NB), C, weights_RK, ids_RK, recv_counts_P)
        self._phase("unpack")
        handle = _LLHandle(C, row_PT, recv_counts_P, send_counts_P, T, D)
        return DispatchResult(layout.base.x_view(recv_NB), weights_RK, ids_RK, _handle=handle)

    # Debug only (host syncs): ids are checked before the route kernel reads owner[id].
    def _check_ids(self, topk_ids_TK: torch.Tensor) -> None:
        if topk_ids_TK.numel() and not (0 <= int(topk_ids_TK.min()) and int(topk_ids_TK.max()) < self.num_experts):
            raise RuntimeError(f"low_latency dispatcher: expert ids outside [0, {self.num_experts})")

    def _check_counts(self, send_counts_P: torch.Tensor, C: int) -> None:
        worst = int(send_counts_P.max())
        if worst > C:
            raise RuntimeError(f"low_latency dispatcher: {worst} rows for one destination exceed "
                               f"the {C} rows per destination of this call; rows past it would be lost")

    def _dispatch_fallback(self, x_TD, topk_weights_TK, topk_ids_TK, max_tokens: int) -> DispatchResult:
        if self._fallback is None:
            self._fallback = _FALLBACK_CLASSES[self.fallback_backend](self.group, self.num_experts, self.placement)
        if not self._fallback_logged:
            logger.debug("low_latency dispatcher: %d tokens on some rank exceed capacity=%d; such calls "
                         "use the %s backend", max_tokens, self.capacity, self.fallback_backend)
            self._fallback_logged = True
        self._fallback.phase_timer = self.phase_timer
        inner = self._fallback.dispatch(x_TD, topk_weights_TK, topk_ids_TK)
        return DispatchResult(inner.x_RD, inner.topk_weights_RK, inner.topk_ids_RK,
                              _handle=_FallbackHandle(inner))

    def combine(self, y_RD: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        h = result._handle
        if isinstance(h, _FallbackHandle):
            return self._fallback.combine(y_RD, h.inner)
        N = self.ep_size * h.chunk
        if y_RD.shape != (N, h.hidden):
            raise ValueError(f"y must be [{N}, {h.hidden}] (the dispatched rows), got {tuple(y_RD.shape)}")
        back_ND = torch.empty(N, h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        all_to_all_rows(back_ND, y_RD.contiguous(), None, None, self.group)
        self._phase("combine_transfer")
        out_TD = torch.empty(h.num_tokens, h.hidden, dtype=y_RD.dtype, device=y_RD.device)
        ops.combine(back_ND, h.row_PT, out_TD)
        self._phase("combine")
        return out_TD

    @staticmethod
    def received_counts(result: DispatchResult) -> torch.Tensor | None:
        """[P] int64 device tensor: rows each source really sent in `result` (the rest of its
        chunk of C is padding); None for a call that fell back to the variable-size backend."""
        h = result._handle
        return h.recv_counts_P if isinstance(h, _LLHandle) else None

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", capacity={self.capacity}, fallback={self.fallback_backend})"
