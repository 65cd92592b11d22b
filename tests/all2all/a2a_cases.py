"""Dispatch -> reference experts -> combine on every rank, checked against one process.

Legend: T tokens of a rank, R received rows, D hidden, F intermediate, K top-k, E experts.

Every rank builds the SAME global problem from a seed (all ranks' tokens, one global weight set),
keeps its own tokens and its own experts' weights, and compares its combined output with
`kernels.fused_experts` run on its tokens with all E experts. Failures are collected per case
name instead of raised, so all ranks keep issuing the same collectives in the same order.
"""
from __future__ import annotations

import torch

from all2all import make_dispatcher
from all2all import comm
from kernels import fused_experts
from routing.placement import expert_owner_ranks, local_expert_ids, make_expert_map

E, D, F, K = 16, 32, 16, 3
BACKENDS = ("allgather_reducescatter", "all_to_all", "allgather_reducescatter[gloo_fallback]")
PLACEMENTS = ("linear", "round_robin")


def scenarios(ep: int) -> dict[str, list[int]]:
    """Scenario name -> tokens per rank."""
    return {
        "uneven": [5, 2, 7, 3][:ep],
        "zero_tokens": [4, 0, 6, 1][:ep],
        "receives_nothing": [3, 5, 2, 4][:ep],  # every expert lives on rank 0
        "same_rank_pair": [6, 3, 4, 5][:ep],     # two of each token's experts share a rank
        "one_token": [1] + [0] * (ep - 1),
        "all_empty": [0] * ep,
    }


def case_names(ep: int) -> list[str]:
    return [f"{b}-{p}-{s}" for b in BACKENDS for p in PLACEMENTS for s in scenarios(ep)]


def global_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w13_EFD = torch.randn(E, 2 * F, D, generator=g) * 0.2
    w2_EDF = torch.randn(E, D, F, generator=g) * 0.2
    return w13_EFD, w2_EDF


def make_inputs(scenario: str, counts: list[int], placement: str, seed: int):
    """Per rank: (x_TD fp32, weights_TK fp32, ids_TK) for every rank of the group."""
    ep = len(counts)
    g = torch.Generator().manual_seed(seed)
    owner_E = expert_owner_ranks(E, ep, placement).long()
    out = []
    for r, T in enumerate(counts):
        x_TD = torch.randn(T, D, generator=g)
        ids_TK = torch.rand(T, E, generator=g).topk(K, dim=1).indices
        if scenario == "receives_nothing":
            on0 = torch.tensor(local_expert_ids(E, ep, 0, placement))
            ids_TK = on0[torch.rand(T, len(on0), generator=g).topk(K, dim=1).indices]
        elif scenario == "same_rank_pair":
            for t in range(T):  # tiny test data; the dispatchers themselves never loop over tokens
                rank = int(torch.randint(ep, (1,), generator=g))
                mine = torch.tensor(local_expert_ids(E, ep, rank, placement))
                pair = mine[torch.randperm(len(mine), generator=g)[:2]]
                rest = torch.tensor([e for e in torch.randperm(E, generator=g).tolist()
                                     if e not in pair.tolist()][:K - 2])
                ids_TK[t] = torch.cat([pair, rest])
            assert all(len(set(owner_E[row].tolist())) < K for row in ids_TK)
        ids_TK = ids_TK.to(torch.int32 if r % 2 else torch.int64)
        weights_TK = torch.rand(T, K, generator=g).softmax(dim=1)
        out.append((x_TD, weights_TK, ids_TK))
    return out


def _check_case(disp, rank, ep, scenario, counts, placement, seed, w13_EFD, w2_EDF,
                device="cpu") -> None:
    inputs = make_inputs(scenario, counts, placement, seed)
    x_TD, weights_TK, ids_TK = (t.to(device) for t in inputs[rank])
    local = torch.tensor(local_expert_ids(E, ep, rank, placement)).to(device)
    expert_map = make_expert_map(E, ep, rank, placement).to(device)

    recv = disp.dispatch(x_TD, weights_TK, ids_TK)
    y_RD = fused_experts(recv.x_RD, w13_EFD[local], w2_EDF[local], recv.topk_weights_RK,
                         recv.topk_ids_RK, expert_map=expert_map, backend="torch")
    y_TD = disp.combine(y_RD, recv)

    want_TD = fused_experts(x_TD, w13_EFD, w2_EDF, weights_TK, ids_TK, backend="torch")
    assert y_TD.shape == (len(x_TD), D) and y_TD.dtype == x_TD.dtype, (y_TD.shape, y_TD.dtype)
    torch.testing.assert_close(y_TD, want_TD, atol=1e-5, rtol=1e-5)

    ids_RK = recv.topk_ids_RK
    assert ids_RK.dtype == ids_TK.dtype, (ids_RK.dtype, ids_TK.dtype)
    assert ids_RK.numel() == 0 or (0 <= int(ids_RK.min()) and int(ids_RK.max()) < E), "ids not global"
    off_rank_RK = expert_map.long()[ids_RK.long()] < 0
    assert not recv.topk_weights_RK[off_rank_RK].any(), "off-rank slot with a non-zero weight"
    if disp.name == "all_to_all":
        owner_E = expert_owner_ranks(E, ep, placement).long().to(device)
        # Each token arrives here at most once, and only if one of its experts is here.
        want_R = sum(int((owner_E[ids.long().to(device)] == rank).any(dim=1).sum()) for _, _, ids in inputs)
        assert recv.num_rows == want_R, f"received {recv.num_rows} rows, expected {want_R}"


def run_cases(rank: int, ep: int, device: str = "cpu",
              backends: tuple[str, ...] = BACKENDS) -> dict[str, str | None]:
    """Case name -> None if it passed on this rank, else the failure message.

    device "cuda" runs the same cases on an NCCL group (tests/all2all/nccl_check.py)."""
    torch.manual_seed(0)
    w13_EFD, w2_EDF = (w.to(device) for w in global_weights())
    results: dict[str, str | None] = {}
    for backend in backends:
        real = backend.split("[")[0]
        if backend.endswith("[gloo_fallback]"):
            comm._NO_REDUCE_SCATTER.add("gloo")  # exercise the all_reduce fallback
        for placement in PLACEMENTS:
            disp = make_dispatcher(real, None, E, placement)
            for i, (scenario, counts) in enumerate(scenarios(ep).items()):
                name = f"{backend}-{placement}-{scenario}"
                try:
                    _check_case(disp, rank, ep, scenario, counts, placement, 100 + i, w13_EFD, w2_EDF,
                                device)
                    results[name] = None
                except AssertionError as exc:
                    results[name] = f"{type(exc).__name__}: {exc}"
        comm._NO_REDUCE_SCATTER.discard("gloo")
    return results
