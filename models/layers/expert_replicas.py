"""EPLB's physical experts in one MoE layer: which logical expert each physical slot holds, the
map back, and moving expert weights between ranks when that changes.

Legend: E logical experts, P physical slots (E + redundant), S = P / G slots per expert-parallel
rank (G ranks; slot p lives on rank p // S, local slot p % S), R = 1 + redundant (the most
replicas one expert can have).

The dispatcher and the expert kernel only ever see physical ids, placed linearly; EPLB changes
what lives in a slot, never where a slot lives. So a rebalance is: move weights into the slots
whose logical expert changed, then rewrite the small maps in place (the device tensors keep
their addresses).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def initial_phys_to_log(num_logical: int, num_physical: int) -> list[int]:
    """Slot p holds logical expert p % E: the experts in order, then replicas of the first ones."""
    return [p % num_logical for p in range(num_physical)]


class ExpertReplicas:
    """Host list phys_to_log and the device maps the forward reads: log_to_phys_ER [E, R] int64
    (each expert's slots in increasing order, -1 past its count) and replica_count_E [E] int64."""

    def __init__(self, phys_to_log: list[int], num_logical: int, device: torch.device) -> None:
        self.num_logical, self.num_physical = num_logical, len(phys_to_log)
        max_replicas = self.num_physical - num_logical + 1
        self.log_to_phys_ER = torch.full((num_logical, max_replicas), -1, dtype=torch.int64, device=device)
        self.replica_count_E = torch.zeros(num_logical, dtype=torch.int64, device=device)
        self.phys_to_log: list[int] = []
        self.set(phys_to_log)

    def set(self, phys_to_log: list[int]) -> None:
        """Install a placement (every logical expert in at least one slot), in place."""
        if len(phys_to_log) != self.num_physical:
            raise ValueError(f"a placement of {len(phys_to_log)} slots for {self.num_physical} physical experts")
        slots: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(phys_to_log):
            if not 0 <= e < self.num_logical:
                raise ValueError(f"physical slot {p} holds logical expert {e}, outside [0, {self.num_logical})")
            slots[e].append(p)
        missing = [e for e, s in enumerate(slots) if not s]
        if missing:
            raise ValueError(f"logical experts {missing[:8]} have no physical slot")
        table = torch.full(tuple(self.log_to_phys_ER.shape), -1, dtype=torch.int64)
        for e, s in enumerate(slots):
            table[e, :len(s)] = torch.tensor(s, dtype=torch.int64)
        self.log_to_phys_ER.copy_(table)
        self.replica_count_E.copy_(torch.tensor([len(s) for s in slots], dtype=torch.int64))
        self.phys_to_log = list(phys_to_log)


def plan_moves(old: list[int], new: list[int], slots_per_rank: int) -> list[tuple[int, int]]:
    """(source slot, destination slot) for every slot whose logical expert changes. The source
    is a slot that held that expert before: on the destination's own rank if there is one (a
    local copy), else the lowest such slot (every rank computes the same plan)."""
    holders: dict[int, list[int]] = {}
    for p, e in enumerate(old):
        holders.setdefault(e, []).append(p)
    moves = []
    for p, (was, now) in enumerate(zip(old, new)):
        if was == now:
            continue
        if now not in holders:
            raise ValueError(f"logical expert {now} is held by no slot of the old placement")
        rank = p // slots_per_rank
        local = [q for q in holders[now] if q // slots_per_rank == rank]
        moves.append((local[0] if local else holders[now][0], p))
    return moves


def move_expert_weights(params: list[torch.Tensor], old: list[int], new: list[int], ep_rank: int,
                        slots_per_rank: int, group: dist.ProcessGroup | None) -> int:
    """Fill this rank's slots for placement `new` from where `old` had the experts: local copies,
    and point-to-point transfers over the expert-parallel `group` (every rank of it calls this
    with the same arguments but its own ep_rank). params: per-slot tensors [S, ...] (weights and
    FP8 scales alike), updated in place. Returns the number of slots this rank received."""
    lo = ep_rank * slots_per_rank
    # Moved as raw bytes: FP8 weights travel like any other (gloo has no float8 type).
    params = [p.view(torch.uint8) for p in params]
    moves = plan_moves(old, new, slots_per_rank)
    incoming = [(src, dst) for src, dst in moves if dst // slots_per_rank == ep_rank]
    # Everything that leaves or is copied is read from the old weights: snapshot what a later
    # write in this call could overwrite, i.e. send before receive and stage local copies.
    staged: dict[int, list[torch.Tensor]] = {}
    ops, recv_into = [], []
    for src, dst in moves:
        src_rank, dst_rank = src // slots_per_rank, dst // slots_per_rank
        if src_rank == ep_rank and dst_rank != ep_rank:
            peer = dist.get_global_rank(group, dst_rank) if group is not None else dst_rank
            ops += [dist.P2POp(dist.isend, p[src - lo].contiguous(), peer, group) for p in params]
    for src, dst in incoming:
        src_rank = src // slots_per_rank
        if src_rank == ep_rank:
            staged[dst] = [p[src - lo].clone() for p in params]
        else:
            peer = dist.get_global_rank(group, src_rank) if group is not None else src_rank
            bufs = [torch.empty_like(p[dst - lo]) for p in params]
            ops += [dist.P2POp(dist.irecv, b, peer, group) for b in bufs]
            recv_into.append((dst, bufs))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for dst, bufs in list(staged.items()) + recv_into:
        for p, b in zip(params, bufs):
            p[dst - lo].copy_(b)
    return len(incoming)
