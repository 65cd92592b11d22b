"""Process-group state of this process: tensor-, pipeline-, data- and expert-parallel ranks and
groups, the rank layout, and the few collectives the model code calls.

Rank layout (as vLLM orders it, TP fastest): world = DP x PP x TP and

    rank = (dp_rank * PP + pp_rank) * TP + tp_rank

* TP group: the TP ranks of one (dp, pp) pair; dense layers are sharded over it.
* PP: stage `pp_rank` of a DP replica sends its activations to the same tp_rank of stage
  pp_rank + 1 (point-to-point on the default group, no group needed).
* EP group (with enable_expert_parallel): every DP x TP rank of one pipeline stage,
  ep_rank = dp_rank * TP + tp_rank. Without EP the experts are TP-sharded and DP replicas
  share no collective at all.
* A DP replica (its PP x TP ranks) runs one scheduler's batch; its *driver* rank (last stage,
  tp_rank 0) samples and reports the tokens (the other ranks learn them next step).

With one process everything is size 1 and no collective runs, so the same model code serves
the single-device path and the parallel ones.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same signature).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of a layout and the rank arithmetic; no process groups (safe in the driver)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def driver_rank(self, dp_rank: int) -> int:
        """The rank that samples for DP replica `dp_rank` (last stage, TP rank 0)."""
        return self.rank_of(dp_rank, self.pp - 1, 0)

    def replica_ranks(self, dp_rank: int) -> list[int]:
        return [self.rank_of(dp_rank, p, t) for p in range(self.pp) for t in range(self.tp)]


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    enable_expert_parallel: bool = False
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    rank: int = 0
    world_size: int = 1
    all2all_backend: str = "auto"
    expert_placement_strategy: str = "linear"
    # Group for pickled control messages (gloo, also when the model collectives run on NCCL).
    cpu_group: Any = None

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp_size, self.pp_size, self.dp_size)

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """This rank samples for its DP replica."""
        return self.is_last_pp_rank and self.tp_rank == 0

    @property
    def needs_dummy_batches(self) -> bool:
        """DP replicas share the MoE collectives: an idle replica must still run a forward."""
        return self.dp_size > 1 and self.enable_expert_parallel


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def collective_timeout() -> datetime.timedelta:
    """Timeout of every collective (MOE_COLLECTIVE_TIMEOUT_S, default 300 s): a lost peer fails
    the step instead of hanging it."""
    return datetime.timedelta(seconds=float(os.environ.get("MOE_COLLECTIVE_TIMEOUT_S", "300")))


def init_parallel_state(layout: ParallelLayout, rank: int, enable_expert_parallel: bool = False,
                        all2all_backend: str = "auto", expert_placement_strategy: str = "linear") -> ParallelState:
    """Create the groups of `layout` (torch.distributed must be initialised with world_size ranks)
    and install the state of `rank`. Every rank calls this with the same arguments: new_group is
    itself collective, so every rank creates every group, in the same order."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks, but tensor_parallel_size x "
                         f"pipeline_parallel_size x data_parallel_size = {layout.world_size}")
    dp_rank, pp_rank, tp_rank = layout.coords(rank)
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    state = ParallelState(tp_size=tp, tp_rank=tp_rank, pp_size=pp, pp_rank=pp_rank, dp_size=dp, dp_rank=dp_rank,
                          rank=rank, world_size=layout.world_size, enable_expert_parallel=enable_expert_parallel,
                          all2all_backend=all2all_backend, expert_placement_strategy=expert_placement_strategy)
    timeout = collective_timeout()
    if tp > 1:
        for d in range(dp):
            for p in range(pp):
                ranks = [layout.rank_of(d, p, t) for t in range(tp)]
                group = dist.new_group(ranks, timeout=timeout)
                if (d, p) == (dp_rank, pp_rank):
                    state.tp_group = group
    if enable_expert_parallel and dp * tp > 1:
        for p in range(pp):
            ranks = [layout.rank_of(d, p, t) for d in range(dp) for t in range(tp)]
            if ranks == list(range(layout.world_size)):
                group = dist.group.WORLD
            else:
                group = dist.new_group(ranks, timeout=timeout)
            if p == pp_rank:
                state.ep_group = group
        state.ep_size, state.ep_rank = dp * tp, dp_rank * tp + tp_rank
    if str(dist.get_backend()) == "gloo":
        state.cpu_group = dist.group.WORLD
    else:
        state.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    set_parallel_state(state)
    return state


def reset_parallel_state() -> None:
    set_parallel_state(ParallelState())


# ---- collectives the layers call ---------------------------------------------------------------
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group (identity at size 1)."""
    if _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' shards along the last dimension (identity at size 1)."""
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=-1)


def tp_row_chunk(num_rows: int) -> tuple[int, int, int]:
    """(start, end, chunk): the rows of a TP-replicated [T, ...] tensor this TP rank owns when
    the ranks split it (sequence split); chunk = ceil(T / tp) is every rank's padded share."""
    chunk = -(-num_rows // _STATE.tp_size)
    start = min(num_rows, _STATE.tp_rank * chunk)
    return start, min(num_rows, start + chunk), chunk


def tp_all_gather_rows(x_ND: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of `tp_row_chunk`: every rank's rows, concatenated in rank order -> [num_rows, ...]."""
    if _STATE.tp_size == 1:
        return x_ND
    _, _, chunk = tp_row_chunk(num_rows)
    padded = x_ND.new_zeros((chunk, *x_ND.shape[1:]))
    padded[:x_ND.shape[0]] = x_ND
    out = x_ND.new_empty((chunk * _STATE.tp_size, *x_ND.shape[1:]))
    _all_gather_single(out, padded, group=_STATE.tp_group)
    return out[:num_rows]


def pp_send(tensors: dict[str, torch.Tensor]) -> None:
    """Send a stage's activations (sorted by name) to the same TP rank of the next stage."""
    s = _STATE
    dst = s.layout.rank_of(s.dp_rank, s.pp_rank + 1, s.tp_rank)
    for name in sorted(tensors):
        t = tensors[name]
        if t.numel():
            dist.send(t.contiguous(), dst)


def pp_recv(tensors: dict[str, torch.Tensor]) -> None:
    """Fill pre-allocated `tensors` (same names and shapes as the sender's) from the previous stage."""
    s = _STATE
    src = s.layout.rank_of(s.dp_rank, s.pp_rank - 1, s.tp_rank)
    for name in sorted(tensors):
        t = tensors[name]
        if t.numel():
            dist.recv(t, src)
