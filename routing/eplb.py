"""Expert-parallel load balancing (EPLB): which logical expert each physical expert slot holds.

Follows the idea of DeepSeek's published EPLB algorithm (own implementation):
- hierarchical, when the expert groups split evenly over the nodes: pack the groups onto the nodes
  (every node gets the same number of groups, balancing group load), replicate the hottest experts
  within each node, then pack each node's physical experts onto its GPUs;
- global otherwise: replicate over all experts, then pack all physical experts onto all GPUs.
Replication gives one more replica, again and again, to the expert with the highest load per
replica. Packing is balanced bin packing: items by load descending, each into the least-loaded bin
that still has room, so every bin gets exactly the same number of items.

Legend: L MoE layers, E logical experts, P physical experts (E + redundant), G GPUs (EP ranks),
S = P / G slots per GPU (slot p lives on GPU p // S), R the most replicas of any expert, N nodes,
B bins, I items, W rows packed at once (layers, or layers x nodes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertPlacement:
    phys_to_log_LP: torch.Tensor  # int64 [L, P]: the logical expert in each physical slot
    log_to_phys_LER: torch.Tensor  # int64 [L, E, R]: the slots of each logical expert, increasing, padded with -1
    replica_count_LE: torch.Tensor  # int64 [L, E], >= 1

    @classmethod
    def from_phys_to_log(cls, phys_to_log_LP, num_logical: int) -> ExpertPlacement:
        """Derive the replica lists and counts from the slot contents [L, P]."""
        p2l_LP = torch.as_tensor(phys_to_log_LP, dtype=torch.int64).clone()
        if p2l_LP.dim() != 2:
            raise ValueError(f"phys_to_log must be 2-D [layers, physical], got shape {tuple(p2l_LP.shape)}")
        L, P = p2l_LP.shape
        if p2l_LP.numel() and (p2l_LP.min() < 0 or p2l_LP.max() >= num_logical):
            raise ValueError(f"phys_to_log holds logical ids outside [0, {num_logical})")
        count_LE = torch.zeros(L, num_logical, dtype=torch.int64)
        count_LE.scatter_add_(1, p2l_LP, torch.ones_like(p2l_LP))
        if (count_LE == 0).any():
            layer, expert = (count_LE == 0).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} has no physical slot in layer {layer}")
        R = max(1, int(count_LE.max())) if count_LE.numel() else 1
        # Slots grouped by logical expert, in increasing slot order (stable sort).
        slot_sorted_LP = torch.argsort(p2l_LP, dim=1, stable=True)
        expert_sorted_LP = p2l_LP.gather(1, slot_sorted_LP)
        first_LE = torch.cumsum(count_LE, dim=1) - count_LE
        rank_LP = torch.arange(P).expand(L, P) - first_LE.gather(1, expert_sorted_LP)
        l2p_LER = torch.full((L, num_logical, R), -1, dtype=torch.int64)
        layer_LP = torch.arange(L).unsqueeze(1).expand(L, P)
        l2p_LER[layer_LP, expert_sorted_LP, rank_LP] = slot_sorted_LP
        return cls(p2l_LP, l2p_LER, count_LE)

    @classmethod
    def initial(cls, num_layers: int, num_logical: int, num_physical: int) -> ExpertPlacement:
        """The default placement: slot p holds logical expert p % E."""
        if num_physical < num_logical:
            raise ValueError(f"num_physical={num_physical} is smaller than num_logical={num_logical}")
        p2l_LP = (torch.arange(num_physical) % num_logical).expand(num_layers, num_physical)
        return cls.from_phys_to_log(p2l_LP, num_logical)

    @property
    def num_layers(self) -> int:
        return self.phys_to_log_LP.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phys_to_log_LP.shape[1]

    @property
    def num_logical(self) -> int:
        return self.replica_count_LE.shape[1]


def _balanced_pack(weight_WI: torch.Tensor, num_bins: int, key_WI: torch.Tensor | None = None):
    """Pack I items into `num_bins` bins of I / num_bins items each, every row independently.

    Items go in order of weight descending (ties: lower index first), each into the bin of least
    load that still has room (ties: fewer items, then lower bin index). With `key_WI` (the logical
    expert of each item), only bins not yet holding an item of the same key are considered while
    any of them has room: a second replica on the same GPU is a wasted slot.
    Returns bin_WI (the bin of each item) and pos_WI (its position in the bin).
    """
    W, I = weight_WI.shape
    cap = I // num_bins
    order_WI = torch.argsort(-weight_WI, dim=1, stable=True)
    rows = torch.arange(W)
    load_WB = torch.zeros(W, num_bins, dtype=torch.float64)
    count_WB = torch.zeros(W, num_bins, dtype=torch.int64)
    holds_WBK = None
    if key_WI is not None:
        holds_WBK = torch.zeros(W, num_bins, int(key_WI.max()) + 1, dtype=torch.bool)
    bin_WI = torch.empty(W, I, dtype=torch.int64)
    pos_WI = torch.empty(W, I, dtype=torch.int64)
    for k in range(I):
        item_W = order_WI[:, k]
        cand_WB = count_WB < cap
        if holds_WBK is not None:  # spread replicas: skip bins already holding this expert, if any other has room
            key_W = key_WI[rows, item_W]
            fresh_WB = cand_WB & ~holds_WBK[rows, :, key_W]
            cand_WB = torch.where(fresh_WB.any(dim=1, keepdim=True), fresh_WB, cand_WB)
        load_key_WB = load_WB.masked_fill(~cand_WB, float("inf"))
        cand_WB &= load_key_WB == load_key_WB.min(dim=1, keepdim=True).values
        count_key_WB = count_WB.masked_fill(~cand_WB, I + 1)
        cand_WB &= count_key_WB == count_key_WB.min(dim=1, keepdim=True).values
        bin_W = cand_WB.to(torch.int8).argmax(dim=1)  # first True
        bin_WI[rows, item_W] = bin_W
        pos_WI[rows, item_W] = count_WB[rows, bin_W]
        load_WB[rows, bin_W] += weight_WI[rows, item_W]
        count_WB[rows, bin_W] += 1
        if holds_WBK is not None:
            holds_WBK[rows, bin_W, key_W] = True
    return bin_WI, pos_WI


def _replicate(load_WE: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Replica count [W, E] summing to `num_slots` per row: each extra replica goes to the expert
    of highest load per replica (ties: fewer replicas, then lower index)."""
    W, E = load_WE.shape
    count_WE = torch.ones(W, E, dtype=torch.int64)
    rows = torch.arange(W)
    for _ in range(num_slots - E):
        ratio_WE = load_WE / count_WE
        best_WE = ratio_WE == ratio_WE.max(dim=1, keepdim=True).values
        count_key_WE = count_WE.masked_fill(~best_WE, num_slots + 1)
        pick_W = count_key_WE.argmin(dim=1)  # first of the fewest replicas among the best
        count_WE[rows, pick_W] += 1
    return count_WE


def _as_load(load_LE) -> torch.Tensor:
    load_LE = torch.as_tensor(load_LE).detach().cpu().to(torch.float64).contiguous()
    if load_LE.dim() != 2 or load_LE.shape[0] == 0 or load_LE.shape[1] == 0:
        raise ValueError(f"load_LE must be a non-empty 2-D [layers, experts] array, got shape {tuple(load_LE.shape)}")
    if not torch.isfinite(load_LE).all():
        raise ValueError("load_LE holds NaN or infinite values")
    if (load_LE < 0).any():
        raise ValueError("load_LE holds negative values")
    return load_LE


def _check_sizes(E: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    for name, value in (("num_physical", num_physical), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_gpus", num_gpus)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if num_physical < E:
        raise ValueError(f"num_physical={num_physical} is smaller than the number of logical experts {E}")
    if num_physical % num_gpus:
        raise ValueError(f"num_physical={num_physical} is not divisible by num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} is not divisible by num_nodes={num_nodes}")


def _greedy_match(overlap_XY: torch.Tensor) -> list[int]:
    """match[x] = y, pairing rows with columns by largest overlap first (ties: lower indices)."""
    n = overlap_XY.shape[0]
    score = overlap_XY.to(torch.float64).clone()
    match = [0] * n
    for _ in range(n):
        flat = int(score.argmax())
        x, y = divmod(flat, n)
        match[x] = y
        score[x, :] = -1
        score[:, y] = -1
    return match


def _counts(p2l_LGS: torch.Tensor, E: int) -> torch.Tensor:
    """[L, G, E]: how many slots of each GPU hold each logical expert."""
    L, G, S = p2l_LGS.shape
    count_LGE = torch.zeros(L, G, E, dtype=torch.int64)
    return count_LGE.scatter_add_(2, p2l_LGS, torch.ones_like(p2l_LGS))


def _follow_previous(p2l_LGS: torch.Tensor, prev_LGS: torch.Tensor, nodes: int, E: int) -> torch.Tensor:
    """Renumber the new nodes and GPUs (interchangeable after packing) to overlap the previous
    placement most, then order each GPU's slots so every slot whose previous expert stays on that
    GPU keeps it; the newly arrived experts fill the other slots in increasing slot order."""
    L, G, S = p2l_LGS.shape
    per_node = G // nodes
    new_LGE, prev_LGE = _counts(p2l_LGS, E), _counts(prev_LGS, E)
    out_LGS = torch.empty_like(p2l_LGS)
    for layer in range(L):
        new_NhE = new_LGE[layer].view(nodes, per_node, E)
        prev_NhE = prev_LGE[layer].view(nodes, per_node, E)
        node_overlap = torch.minimum(new_NhE.sum(1)[:, None], prev_NhE.sum(1)[None]).sum(-1)
        for new_node, prev_node in enumerate(_greedy_match(node_overlap)):
            gpu_overlap = torch.minimum(new_NhE[new_node][:, None], prev_NhE[prev_node][None]).sum(-1)
            for new_gpu, prev_gpu in enumerate(_greedy_match(gpu_overlap)):
                gpu = prev_node * per_node + prev_gpu
                left = new_NhE[new_node, new_gpu].tolist()
                prev_slots = prev_LGS[layer, gpu].tolist()
                slots = [-1] * S
                for s, expert in enumerate(prev_slots):
                    if left[expert] > 0:
                        slots[s] = expert
                        left[expert] -= 1
                arrivals = [e for e in range(E) for _ in range(left[e])]
                for s in range(S):
                    if slots[s] < 0:
                        slots[s] = arrivals.pop(0)
                out_LGS[layer, gpu] = torch.tensor(slots)
    return out_LGS


def rebalance_experts(load_LE, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
                      previous: ExpertPlacement | None = None) -> ExpertPlacement:
    """A placement of P = num_physical expert slots over G = num_gpus GPUs balancing load_LE.

    load_LE: [L, E] non-negative load of each logical expert per layer (torch, numpy or nested lists).
    Hierarchical when num_groups % num_nodes == 0 and E % num_groups == 0 (each expert group's
    experts stay on one node; replicas stay on their expert's node), global otherwise.
    Requires P >= E, P % G == 0 and G % num_nodes == 0 (so P % num_nodes == 0); ValueError otherwise.
    Every expert gets at least one replica; every GPU gets S = P / G slots, in ascending logical
    order within a GPU. Replicas of one expert go to different GPUs of their packing domain (its
    node, or all GPUs when global) whenever, at each replica's turn, a GPU of that domain with a
    free slot does not hold the expert yet (then the least loaded such GPU is taken, even if a GPU
    holding it is less loaded). So an expert with more replicas than its domain has GPUs always
    shares a GPU; with fewer it usually does not, but greedy packing cannot guarantee it.
    previous: an earlier placement of the same shape; the nodes and GPUs are renumbered to overlap it
    most, and slots whose expert stays on its GPU keep it (see `moves`).
    Deterministic: ties go to lower indices.
    """
    load_LE = _as_load(load_LE)
    L, E = load_LE.shape
    _check_sizes(E, num_physical, num_groups, num_nodes, num_gpus)
    P, G = num_physical, num_gpus
    if num_groups % num_nodes == 0 and E % num_groups == 0:
        groups, nodes = num_groups, num_nodes
    else:
        groups, nodes = 1, 1
    S, per_node = P // G, G // nodes
    group_size = E // groups

    # 1. Groups onto nodes (the same number each); each node lists its groups in ascending id.
    group_load_LG = load_LE.view(L, groups, group_size).sum(-1)
    group_node_LG, _ = _balanced_pack(group_load_LG, nodes)
    group_order_LG = torch.argsort(group_node_LG * groups + torch.arange(groups), dim=1)
    # Logical ids of each node's experts, node by node: [L, N, E/N].
    expert_of_LNe = (group_order_LG[:, :, None] * group_size + torch.arange(group_size)).reshape(L, nodes, -1)

    # 2. Replicate within each node: its E/N experts share P/N slots.
    rows = L * nodes
    node_load_We = load_LE.gather(1, expert_of_LNe.reshape(L, -1)).view(rows, -1)
    count_We = _replicate(node_load_We, P // nodes)

    # 3. Physical experts of each node onto its GPUs: items listed expert by expert.
    slots_per_node = P // nodes
    local_expert_WI = torch.repeat_interleave(
        torch.arange(E // nodes).repeat(rows), count_We.flatten()).view(rows, slots_per_node)
    weight_WI = (node_load_We / count_We).gather(1, local_expert_WI)
    bin_WI, pos_WI = _balanced_pack(weight_WI, per_node, key_WI=local_expert_WI)

    logical_WI = expert_of_LNe.reshape(rows, -1).gather(1, local_expert_WI)
    slot_WI = bin_WI * S + pos_WI
    p2l_WP = torch.empty(rows, slots_per_node, dtype=torch.int64)
    p2l_WP.scatter_(1, slot_WI, logical_WI)
    p2l_LGS = p2l_WP.view(L, G, S).sort(dim=-1).values

    if previous is not None:
        prev_LP = previous.phys_to_log_LP
        if tuple(prev_LP.shape) != (L, P) or previous.num_logical != E:
            raise ValueError(f"previous placement has shape {tuple(prev_LP.shape)} over {previous.num_logical} "
                             f"logical experts, expected ({L}, {P}) over {E}")
        p2l_LGS = _follow_previous(p2l_LGS, prev_LP.view(L, G, S), nodes, E)
    return ExpertPlacement.from_phys_to_log(p2l_LGS.reshape(L, P), E)


def moves(previous: ExpertPlacement, new: ExpertPlacement) -> int:
    """How many slots (over all layers) hold a different logical expert in `new` than in `previous`."""
    if previous.phys_to_log_LP.shape != new.phys_to_log_LP.shape:
        raise ValueError(f"placements differ in shape: {tuple(previous.phys_to_log_LP.shape)} "
                         f"vs {tuple(new.phys_to_log_LP.shape)}")
    return int((previous.phys_to_log_LP != new.phys_to_log_LP).sum())


def gpu_loads(load_LE, placement: ExpertPlacement, num_gpus: int) -> torch.Tensor:
    """[L, G] float64: each expert's load split evenly over its replicas, summed per GPU."""
    load_LE = _as_load(load_LE)
    p2l_LP = placement.phys_to_log_LP
    if load_LE.shape != placement.replica_count_LE.shape:
        raise ValueError(f"load_LE has shape {tuple(load_LE.shape)}, the placement covers "
                         f"{tuple(placement.replica_count_LE.shape)}")
    L, P = p2l_LP.shape
    if num_gpus < 1 or P % num_gpus:
        raise ValueError(f"num_physical={P} is not divisible by num_gpus={num_gpus}")
    share_LP = (load_LE / placement.replica_count_LE).gather(1, p2l_LP)
    return share_LP.view(L, num_gpus, P // num_gpus).sum(-1)


def balancedness(load_per_gpu_LG) -> torch.Tensor:
    """[L] float64: mean / max of each layer's per-GPU load; 1.0 is perfect (and an all-zero layer)."""
    load_LG = torch.as_tensor(load_per_gpu_LG).to(torch.float64)
    if load_LG.dim() != 2:
        raise ValueError(f"load_per_gpu_LG must be 2-D [layers, gpus], got shape {tuple(load_LG.shape)}")
    peak_L = load_LG.max(dim=1).values
    ratio_L = load_LG.mean(dim=1) / peak_L.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(peak_L > 0, ratio_L, torch.ones_like(ratio_L))
