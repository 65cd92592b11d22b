"""The `low_latency` dispatcher on 2 and 4 gloo ranks against the single-process expert layer.

Legend: T tokens of a rank, R = P*C received rows, D hidden, K top-k, E experts, P ranks,
C capacity.

One spawn per EP size runs every case (the shared scenarios of a2a_cases.py plus routing
shapes that stress the fixed capacity); each case is reported as its own test. A case checks
the combined output against `fused_experts` over all experts, the static receive shape, the
per-source counts riding in the rows, and that padding rows carry zero x, zero weights and ids
that are not on the receiving rank.
"""
from __future__ import annotations

import pytest
import torch

from all2all import LowLatencyDispatcher, choose_backend, make_dispatcher
from kernels import fused_experts
from routing.placement import expert_owner_ranks, local_expert_ids, make_expert_map
from tests.all2all.a2a_cases import D, E, K, global_weights, make_inputs, run_cases, scenarios
from tests.all2all.a2a_harness import run_ranks

PLACEMENTS = ("linear", "round_robin")


def _routing(kind: str, T: int, owner_E: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[T, K] int64 global expert ids of one routing shape."""
    scores_TE = torch.rand(T, E, generator=g)
    if kind == "skewed":  # most tokens pick experts 0..2
        scores_TE[torch.rand(T, generator=g) < 0.8, :3] += 2.0
    elif kind == "group_limited":  # 4 groups of 4 experts, each token confined to 2 groups
        groups_TG = torch.rand(T, 4, generator=g).topk(2, dim=1).indices
        allowed_TE = torch.zeros(T, E, dtype=torch.bool)
        for j in range(2):
            allowed_TE |= (torch.arange(E) // 4)[None] == groups_TG[:, j:j + 1]
        scores_TE = torch.where(allowed_TE, scores_TE, -1.0)
    elif kind == "idle_expert":  # experts 5 and 6 get no token
        scores_TE[:, 5:7] = -1.0
    elif kind == "to_rank0":  # every token only to rank 0's experts (count = T there)
        scores_TE = torch.where(owner_E == 0, scores_TE, -1.0)
    return scores_TE.topk(K, dim=1).indices


def _inputs(kind: str, counts: list[int], placement: str, seed: int):
    ep = len(counts)
    owner_E = expert_owner_ranks(E, ep, placement).long()
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, T in enumerate(counts):
        x_TD = torch.randn(T, D, generator=g)
        ids_TK = _routing(kind, T, owner_E, g).to(torch.int32 if r % 2 else torch.int64)
        out.append((x_TD, torch.rand(T, K, generator=g).softmax(dim=1), ids_TK))
    return out


def _check(disp, rank: int, ep: int, inputs, placement: str, max_tokens: int | None = None) -> None:
    w13_EFD, w2_EDF = global_weights()
    x_TD, weights_TK, ids_TK = inputs[rank]
    local = torch.tensor(local_expert_ids(E, ep, rank, placement))
    expert_map = make_expert_map(E, ep, rank, placement)
    recv = disp.dispatch(x_TD, weights_TK, ids_TK, max_tokens_across_ranks=max_tokens)
    y_RD = fused_experts(recv.x_RD, w13_EFD[local], w2_EDF[local], recv.topk_weights_RK, recv.topk_ids_RK,
                         expert_map=expert_map, backend="torch")
    y_TD = disp.combine(y_RD, recv)
    want_TD = fused_experts(x_TD, w13_EFD, w2_EDF, weights_TK, ids_TK, backend="torch")
    assert y_TD.shape == (len(x_TD), D) and y_TD.dtype == x_TD.dtype, (y_TD.shape, y_TD.dtype)
    torch.testing.assert_close(y_TD, want_TD, atol=1e-5, rtol=1e-5)
    assert recv.topk_ids_RK.dtype == ids_TK.dtype
    counts = LowLatencyDispatcher.received_counts(recv)
    if max_tokens is not None and max_tokens > disp.capacity:
        assert counts is None, "expected the variable-size fallback"
        return
    C = disp.capacity if max_tokens is None else max(max_tokens, 1)  # chunks of M rows when M is given
    assert recv.num_rows == ep * C, f"received {recv.num_rows} rows, expected the static {ep * C}"
    owner_E = expert_owner_ranks(E, ep, placement).long()
    want_P = torch.tensor([int((owner_E[ids.long()] == rank).any(dim=1).sum()) for _, _, ids in inputs])
    assert torch.equal(counts, want_P), (counts, want_P)
    pad_R = torch.arange(ep * C) % C >= counts.repeat_interleave(C)
    assert not recv.x_RD[pad_R].any() and not recv.topk_weights_RK[pad_R].any(), "padding rows not zero"
    off_RK = expert_map.long()[recv.topk_ids_RK.long()] < 0
    assert not recv.topk_weights_RK[off_RK].any(), "off-rank slot with a non-zero weight"
    if ep > 1:
        assert off_RK[pad_R].all(), "a padding row names an expert of this rank"


def _extra_cases(ep: int):
    """name -> (routing kind, tokens per rank, capacity, max_tokens_across_ranks)."""
    uneven = [7, 13, 1, 11][:ep]
    return {
        "skewed": ("skewed", uneven, 16, None),
        "group_limited": ("group_limited", uneven, 13, None),
        "idle_expert": ("idle_expert", [9, 0, 5, 3][:ep], 9, None),
        "capacity_exactly_T": ("to_rank0", [6] * ep, 6, None),
        "hint_within_capacity": ("random", uneven, 13, 13),
        "hint_below_capacity": ("group_limited", uneven, 32, max(uneven)),  # chunks of max(T), not 32
        "fallback_over_capacity": ("skewed", uneven, 4, max(uneven)),
    }


def ll_cases(rank: int, ep: int) -> dict[str, str | None]:
    """Case name -> None if it passed on this rank, else the failure message."""
    results = run_cases(rank, ep, backends=("low_latency",))
    for placement in PLACEMENTS:
        for i, (name, (kind, counts, C, hint)) in enumerate(_extra_cases(ep).items()):
            key = f"low_latency-{placement}-{name}"
            try:
                disp = make_dispatcher("low_latency", None, E, placement, capacity=C)
                _check(disp, rank, ep, _inputs(kind, counts, placement, 200 + i), placement, hint)
                results[key] = None
            except AssertionError as exc:
                results[key] = f"{type(exc).__name__}: {exc}"
    # "auto" on CUDA: low_latency, falling back to the bytes rule's backend (EP=2 here: all-gather,
    # EP=4: all_to_all) for calls over the capacity.
    uneven = [7, 13, 1, 11][:ep]
    for placement in PLACEMENTS:
        for i, (name, (kind, C, hint)) in enumerate({"auto_decode": ("random", 13, 13),
                                                     "auto_prefill": ("skewed", 4, max(uneven))}.items()):
            key = f"auto-{placement}-{name}"
            try:
                disp = make_dispatcher("auto", None, E, placement, top_k=K, capacity=C, auto_low_latency=True)
                assert isinstance(disp, LowLatencyDispatcher), disp
                assert disp.fallback_backend == choose_backend(ep, E, K), disp
                _check(disp, rank, ep, _inputs(kind, uneven, placement, 300 + i), placement, hint)
                results[key] = None
            except AssertionError as exc:
                results[key] = f"{type(exc).__name__}: {exc}"
    # Hard limit: every rank holds more than C tokens, so every rank raises before any collective.
    disp = make_dispatcher("low_latency", None, E, capacity=2)
    x_TD, w_TK, ids_TK = make_inputs("uneven", [3] * ep, "linear", 5)[rank]
    try:
        disp.dispatch(x_TD, w_TK, ids_TK)
        results["capacity_error"] = "no error for T=3 > capacity=2"
    except ValueError as exc:
        results["capacity_error"] = None if "exceed capacity=2" in str(exc) else f"wrong message: {exc}"
    return results


def case_names(ep: int) -> list[str]:
    return ([f"low_latency-{p}-{s}" for p in PLACEMENTS for s in scenarios(ep)]
            + [f"low_latency-{p}-{n}" for p in PLACEMENTS for n in _extra_cases(ep)]
            + [f"auto-{p}-{n}" for p in PLACEMENTS for n in ("auto_decode", "auto_prefill")] + ["capacity_error"])


_RESULTS: dict[int, list[dict]] = {}


def _results(ep: int) -> list[dict]:
    if ep not in _RESULTS:
        _RESULTS[ep] = run_ranks(ll_cases, ep, timeout_s=50.0, collective_timeout_s=15.0)
    return _RESULTS[ep]


@pytest.mark.parametrize("case", case_names(2))
def test_ep2(case):
    failures = {r: res[case] for r, res in enumerate(_results(2)) if res[case] is not None}
    assert not failures, failures


@pytest.mark.parametrize("case", case_names(4))
def test_ep4(case):
    failures = {r: res[case] for r, res in enumerate(_results(4)) if res[case] is not None}
    assert not failures, failures


def test_single_process_and_errors():
    w13_EFD, w2_EDF = global_weights()
    for T in (0, 1, 7):
        x_TD, w_TK, ids_TK = make_inputs("uneven", [T], "round_robin", seed=3)[0]
        disp = make_dispatcher("low_latency", None, E, "round_robin", capacity=7)
        recv = disp.dispatch(x_TD, w_TK, ids_TK)
        assert recv.num_rows == 7
        y_RD = fused_experts(recv.x_RD, w13_EFD, w2_EDF, recv.topk_weights_RK, recv.topk_ids_RK,
                             expert_map=disp.expert_map_on("cpu"), backend="torch")
        torch.testing.assert_close(disp.combine(y_RD, recv), fused_experts(x_TD, w13_EFD, w2_EDF, w_TK, ids_TK),
                                   atol=1e-6, rtol=1e-6)
        with pytest.raises(ValueError, match=r"y must be \[7, 32\]"):
            disp.combine(y_RD[:3], recv)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        LowLatencyDispatcher(None, E, capacity=0)
    with pytest.raises(ValueError, match="fallback must be one of"):
        LowLatencyDispatcher(None, E, fallback="local")
    with pytest.raises(ValueError, match="below this rank's 7 tokens"):
        disp.dispatch(x_TD, w_TK, ids_TK, max_tokens_across_ranks=6)
    debug = LowLatencyDispatcher(None, E, capacity=8, debug=True)
    with pytest.raises(RuntimeError, match=r"expert ids outside \[0, 16\)"):
        debug.dispatch(x_TD, w_TK, ids_TK.clamp(max=E - 1) + 1)
