"""EPLB placement: invariants on synthetic loads, hand-computed small cases, `previous`, bad input.

Legend: L layers, E logical experts, P physical slots, G GPUs, S = P / G slots per GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from routing.eplb import ExpertPlacement, balancedness, gpu_loads, moves, rebalance_experts


def _zipf_LE(L: int, E: int, skew: float, seed: int) -> torch.Tensor:
    """Zipf-shaped loads, each layer a different random permutation of the experts."""
    gen = torch.Generator().manual_seed(seed)
    base_E = 1000.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew
    return torch.stack([base_E[torch.randperm(E, generator=gen)] for _ in range(L)])


def _check_placement(pl: ExpertPlacement, load_LE, P: int, G: int, nodes: int = 1) -> None:
    """Invariants every placement must satisfy. `nodes`: the replication domains (1 when global;
    hierarchical placements replicate each node's experts within the node's slots)."""
    load_LE = torch.as_tensor(load_LE, dtype=torch.float64)
    L, E = load_LE.shape
    p2l_LP, count_LE, l2p_LER = pl.phys_to_log_LP, pl.replica_count_LE, pl.log_to_phys_LER
    assert p2l_LP.dtype == count_LE.dtype == l2p_LER.dtype == torch.int64
    assert tuple(p2l_LP.shape) == (L, P) and tuple(count_LE.shape) == (L, E)
    assert int(p2l_LP.min()) >= 0 and int(p2l_LP.max()) < E
    # Every logical expert placed; counts match the slots; every GPU carries exactly S slots.
    for layer in range(L):
        assert torch.equal(torch.bincount(p2l_LP[layer], minlength=E), count_LE[layer])
    assert int(count_LE.min()) >= 1 and torch.equal(count_LE.sum(1), torch.full((L,), P))
    # Round trip: each listed slot holds its expert, slots increase, padding is -1 past the count.
    R = l2p_LER.shape[2]
    assert R == int(count_LE.max())
    rank_R = torch.arange(R)
    listed_LER = rank_R < count_LE[:, :, None]
    assert torch.all(l2p_LER[~listed_LER] == -1)
    layer_LER = torch.arange(L)[:, None, None].expand_as(l2p_LER)
    assert torch.equal(p2l_LP[layer_LER[listed_LER], l2p_LER[listed_LER]],
                       torch.arange(E)[None, :, None].expand_as(l2p_LER)[listed_LER])
    if R > 1:
        both_LER = listed_LER[:, :, 1:]
        assert torch.all(l2p_LER[:, :, 1:][both_LER] > l2p_LER[:, :, :-1][both_LER])
    again = ExpertPlacement.from_phys_to_log(p2l_LP, E)
    assert torch.equal(again.log_to_phys_LER, l2p_LER) and torch.equal(again.replica_count_LE, count_LE)
    # The whole load lands on the GPUs.
    torch.testing.assert_close(gpu_loads(load_LE, pl, G).sum(1), load_LE.sum(1))
    # Replicas go to the hottest experts: every replicated expert is at least as hot as every
    # unreplicated one of its replication domain.
    node_sets = _node_of_expert_slots(pl, G, nodes)
    for layer in range(L):
        assert all(len(homes) == 1 for homes in node_sets[layer])  # replicas stay on their expert's node
        for n in range(nodes):
            domain = [e for e in range(E) if node_sets[layer][e] == {n}]
            assert len(domain) == E // nodes
            loads, counts = load_LE[layer, domain], count_LE[layer, domain]
            if (counts > 1).any() and (counts == 1).any():
                assert loads[counts > 1].min() >= loads[counts == 1].max()


def _node_of_expert_slots(pl: ExpertPlacement, G: int, nodes: int) -> list[list[set[int]]]:
    """[layer][expert] -> the set of nodes holding a slot of that expert."""
    L, P = pl.phys_to_log_LP.shape
    slots_per_node = P // nodes
    out = []
    for layer in range(L):
        per_expert = [set() for _ in range(pl.num_logical)]
        for slot, expert in enumerate(pl.phys_to_log_LP[layer].tolist()):
            per_expert[expert].add(slot // slots_per_node)
        out.append(per_expert)
    return out


def _colocated(pl: ExpertPlacement, G: int) -> int:
    """How many (layer, GPU, expert) hold more than one replica of the expert on one GPU."""
    L, P = pl.phys_to_log_LP.shape
    gpus_LGS = pl.phys_to_log_LP.view(L, G, P // G)
    return sum(int((torch.bincount(gpus_LGS[layer, g], minlength=pl.num_logical) > 1).sum())
               for layer in range(L) for g in range(G))


def test_global_hand_computed():
    # Replicas: e0 (10 -> 5 per replica), then e1 (6 -> 3). Items 5,5,3,3,3,1 into 2 GPUs of 3.
    pl = rebalance_experts(torch.tensor([[10, 6, 3, 1]]), num_physical=6, num_groups=1, num_nodes=1, num_gpus=2)
    assert pl.phys_to_log_LP.tolist() == [[0, 1, 2, 0, 1, 3]]
    assert pl.replica_count_LE.tolist() == [[2, 2, 1, 1]]
    assert pl.log_to_phys_LER.tolist() == [[[0, 3], [1, 4], [2, -1], [5, -1]]]
    torch.testing.assert_close(gpu_loads([[10, 6, 3, 1]], pl, 2), torch.tensor([[11.0, 9.0]], dtype=torch.float64))


def test_hierarchical_hand_computed():
    # Groups {e0,e1} (load 3) and {e2,e3} (load 14): the hot group goes to node 0, whose 3 slots
    # give e2 a second replica; node 1 gives e1 its second replica.
    pl = rebalance_experts(torch.tensor([[1, 2, 10, 4]]), num_physical=6, num_groups=2, num_nodes=2, num_gpus=2)
    assert pl.phys_to_log_LP.tolist() == [[2, 2, 3, 0, 1, 1]]


CASES = {  # name: (load_LE, P, groups, nodes, G)
    "uniform": (torch.full((3, 16), 7.0), 24, 4, 2, 8),
    "zipf": (_zipf_LE(4, 32, 1.2, seed=1), 48, 4, 2, 8),
    "one_hot_expert": (torch.tensor([[1.0] * 5 + [1000.0] + [1.0] * 10]), 24, 1, 1, 12),
    "zero": (torch.zeros(2, 16), 24, 4, 2, 4),
    "random_layers": (torch.randint(0, 100, (6, 24), generator=torch.Generator().manual_seed(3)), 36, 6, 3, 6),
    "deepseek_like": (_zipf_LE(3, 256, 0.9, seed=2), 288, 8, 4, 32),
    "global_fallback": (_zipf_LE(3, 30, 1.0, seed=4), 36, 3, 2, 6),
    "no_redundancy": (_zipf_LE(2, 8, 1.0, seed=5), 8, 2, 2, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_invariants(name):
    load_LE, P, groups, nodes, G = CASES[name]
    E = load_LE.shape[1]
    pl = rebalance_experts(load_LE, P, groups, nodes, G)
    hierarchical = groups % nodes == 0 and E % groups == 0
    _check_placement(pl, load_LE, P, G, nodes if hierarchical else 1)
    if hierarchical:  # whole groups stay on one node
        node_sets = _node_of_expert_slots(pl, G, nodes)
        group_size = E // groups
        for layer in range(load_LE.shape[0]):
            for g in range(groups):
                homes = set().union(*node_sets[layer][g * group_size:(g + 1) * group_size])
                assert len(homes) == 1, f"layer {layer}: group {g} spans nodes {homes}"


def test_hierarchical_one_group_per_node():
    load_LE = _zipf_LE(3, 32, 1.0, seed=6)
    pl = rebalance_experts(load_LE, 48, num_groups=4, num_nodes=4, num_gpus=8)
    node_sets = _node_of_expert_slots(pl, 8, 4)
    for layer in range(3):
        for g in range(4):
            homes = set().union(*node_sets[layer][g * 8:(g + 1) * 8])
            assert len(homes) == 1
        # The four groups land on four different nodes.
        assert len({min(node_sets[layer][g * 8]) for g in range(4)}) == 4


def test_global_fallback_is_one_group_one_node():
    load_LE = _zipf_LE(3, 30, 1.0, seed=4)
    fallback = rebalance_experts(load_LE, 36, num_groups=3, num_nodes=2, num_gpus=6)
    plain = rebalance_experts(load_LE, 36, num_groups=1, num_nodes=1, num_gpus=6)
    assert torch.equal(fallback.phys_to_log_LP, plain.phys_to_log_LP)


@pytest.mark.parametrize("groups,nodes", [(8, 4), (1, 1)])
def test_balance_beats_initial_on_skew(groups, nodes):
    load_LE = _zipf_LE(4, 256, 1.0, seed=7)
    pl = rebalance_experts(load_LE, 288, groups, nodes, 32)
    new_L = balancedness(gpu_loads(load_LE, pl, 32))
    old_L = balancedness(gpu_loads(load_LE, ExpertPlacement.initial(4, 256, 288), 32))
    assert torch.all(new_L >= old_L) and torch.all(new_L > 1.5 * old_L)
    if (groups, nodes) == (1, 1):
        assert torch.all(new_L > 0.95)


def test_balance_mild_skew_with_redundancy():
    gen = torch.Generator().manual_seed(8)
    load_LE = 100 + 60 * torch.rand(4, 64, generator=gen, dtype=torch.float64)
    pl = rebalance_experts(load_LE, 96, num_groups=8, num_nodes=2, num_gpus=16)
    assert torch.all(balancedness(gpu_loads(load_LE, pl, 16)) >= 0.9)


def test_hot_expert_replicas_spread_over_gpus():
    load_LE, P, groups, nodes, G = CASES["one_hot_expert"]
    pl = rebalance_experts(load_LE, P, groups, nodes, G)
    assert pl.replica_count_LE[0, 5] == 9  # every redundant slot goes to the hot expert
    assert len({s // (P // G) for s in pl.log_to_phys_LER[0, 5].tolist()}) == 9
    assert _colocated(pl, G) == 0


def test_zero_load_spreads_replicas():
    pl = rebalance_experts(torch.zeros(2, 16), 24, 4, 2, 4)
    assert int(pl.replica_count_LE.max()) == 2  # one extra replica each for 8 experts, not 9 for expert 0
    assert _colocated(pl, 4) == 0
    assert torch.equal(balancedness(gpu_loads(torch.zeros(2, 16), pl, 4)), torch.ones(2, dtype=torch.float64))


def test_balancedness_values():
    torch.testing.assert_close(balancedness(torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 0.0]])),
                               torch.tensor([2.0 / 3.0, 1.0, 1.0], dtype=torch.float64))


def test_previous_keeps_slots():
    load_LE = _zipf_LE(3, 64, 1.0, seed=9)
    first = rebalance_experts(load_LE, 80, 8, 2, 8)
    again = rebalance_experts(load_LE, 80, 8, 2, 8, previous=first)
    assert moves(first, again) == 0
    # A changed load: following `previous` moves fewer weights for an equally balanced placement.
    gen = torch.Generator().manual_seed(10)
    changed_LE = load_LE * (0.6 + 0.8 * torch.rand(load_LE.shape, generator=gen, dtype=torch.float64))
    fresh = rebalance_experts(changed_LE, 80, 8, 2, 8)
    kept = rebalance_experts(changed_LE, 80, 8, 2, 8, previous=first)
    _check_placement(kept, changed_LE, 80, 8, nodes=2)
    assert moves(first, kept) < moves(first, fresh)
    torch.testing.assert_close(gpu_loads(changed_LE, kept, 8).sort(1).values,
                               gpu_loads(changed_LE, fresh, 8).sort(1).values)
    # Every slot whose previous expert is still on its GPU keeps it.
    S = 10
    for layer in range(3):
        for g in range(8):
            prev = first.phys_to_log_LP[layer, g * S:(g + 1) * S]
            new = kept.phys_to_log_LP[layer, g * S:(g + 1) * S]
            shared = torch.minimum(torch.bincount(prev, minlength=64), torch.bincount(new, minlength=64)).sum()
            assert int((prev == new).sum()) == int(shared)


def test_previous_from_initial_placement():
    load_LE = _zipf_LE(2, 16, 1.0, seed=11)
    initial = ExpertPlacement.initial(2, 16, 24)
    assert initial.phys_to_log_LP[0].tolist() == [p % 16 for p in range(24)]
    pl = rebalance_experts(load_LE, 24, 1, 1, 4, previous=initial)
    _check_placement(pl, load_LE, 24, 4)
    assert moves(initial, pl) <= moves(initial, rebalance_experts(load_LE, 24, 1, 1, 4))


def test_deterministic_and_input_types():
    load_LE = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(12))
    ref = rebalance_experts(load_LE, 48, 4, 2, 8)
    transposed = np.asfortranarray(load_LE.numpy().astype(np.float64))  # non-contiguous once in torch
    for same in (load_LE, load_LE.numpy(), transposed, load_LE.to(torch.float32), load_LE.tolist()):
        assert torch.equal(rebalance_experts(same, 48, 4, 2, 8).phys_to_log_LP, ref.phys_to_log_LP)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_physical=10, num_gpus=4), "num_physical=10 is not divisible by num_gpus=4"),
    (dict(num_physical=12, num_gpus=6, num_nodes=4), "num_gpus=6 is not divisible by num_nodes=4"),
    (dict(num_physical=6, num_gpus=2), "num_physical=6 is smaller than the number of logical experts 8"),
    (dict(num_gpus=0), "num_gpus=0 must be at least 1"),
    (dict(num_nodes=0), "num_nodes=0 must be at least 1"),
    (dict(load_LE=-torch.ones(1, 8)), "load_LE holds negative values"),
    (dict(load_LE=torch.full((1, 8), float("nan"))), "load_LE holds NaN"),
    (dict(load_LE=torch.ones(8)), "load_LE must be a non-empty 2-D"),
])
def test_bad_arguments(kwargs, message):
    args = dict(load_LE=torch.ones(2, 8), num_physical=16, num_groups=2, num_nodes=2, num_gpus=4) | kwargs
    with pytest.raises(ValueError, match=message):
        rebalance_experts(**args)


def test_bad_placements():
    with pytest.raises(ValueError, match="logical expert 2 has no physical slot in layer 0"):
        ExpertPlacement.from_phys_to_log(torch.tensor([[0, 1, 1, 3]]), 4)
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement.from_phys_to_log(torch.tensor([[0, 1, 4, 3]]), 4)
    with pytest.raises(ValueError, match="placements differ in shape"):
        moves(ExpertPlacement.initial(1, 4, 4), ExpertPlacement.initial(1, 4, 8))
    with pytest.raises(ValueError, match=r"previous placement has shape \(1, 8\)"):
        rebalance_experts(torch.ones(2, 4), 8, 1, 1, 2, previous=ExpertPlacement.initial(1, 4, 8))


def test_replicas_of_an_expert_on_distinct_gpus():
    # Zipf load over 256 experts: up to ~10 replicas each, 32 GPUs; plain least-loaded packing
    # would put some replicas of one expert on the same GPU.
    load_LE = _zipf_LE(3, 256, 1.0, seed=13)
    pl = rebalance_experts(load_LE, 288, 1, 1, 32)
    assert int(pl.replica_count_LE.max()) <= 32
    assert _colocated(pl, 32) == 0


def test_previous_with_renumbered_gpus_moves_nothing():
    # The same GPU contents under other node and GPU numbers: the new placement follows them.
    load_LE = _zipf_LE(2, 64, 1.0, seed=14)
    first = rebalance_experts(load_LE, 80, 8, 2, 8)
    L, G, S = 2, 8, 10
    gpu_order = [5, 4, 7, 6, 2, 0, 1, 3]  # swap the two nodes, and shuffle GPUs inside each
    shuffled = ExpertPlacement.from_phys_to_log(first.phys_to_log_LP.view(L, G, S)[:, gpu_order].reshape(L, -1), 64)
    assert moves(first, shuffled) > 0
    assert moves(shuffled, rebalance_experts(load_LE, 80, 8, 2, 8, previous=shuffled)) == 0
