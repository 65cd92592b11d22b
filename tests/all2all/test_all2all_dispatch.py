"""Every backend at EP=2 and EP=4 on gloo ranks against the single-process expert layer.

One spawn per EP size runs all (backend, placement, scenario) cases; each case is reported as
its own test. See a2a_cases.py for the scenarios.
"""
from __future__ import annotations

import pytest
import torch

from tests.all2all.a2a_cases import D, E, K, case_names, global_weights, make_inputs, run_cases
from tests.all2all.a2a_harness import run_ranks
from all2all import DispatchResult, make_dispatcher
from kernels import fused_experts

_RESULTS: dict[int, list[dict]] = {}


def _results(ep: int) -> list[dict]:
    if ep not in _RESULTS:
        _RESULTS[ep] = run_ranks(run_cases, ep, timeout_s=50.0, collective_timeout_s=15.0)
    return _RESULTS[ep]


@pytest.mark.parametrize("case", case_names(2))
def test_ep2(case):
    failures = {r: res[case] for r, res in enumerate(_results(2)) if res[case] is not None}
    assert not failures, failures


@pytest.mark.parametrize("case", case_names(4))
def test_ep4(case):
    failures = {r: res[case] for r, res in enumerate(_results(4)) if res[case] is not None}
    assert not failures, failures


@pytest.mark.parametrize("backend", ["local", "auto"])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_local_is_identity(backend, T):
    w13_EFD, w2_EDF = global_weights()
    x_TD, weights_TK, ids_TK = make_inputs("uneven", [T], "linear", seed=7)[0]
    disp = make_dispatcher(backend, None, E, top_k=K)
    assert disp.name == "local"
    recv = disp.dispatch(x_TD, weights_TK, ids_TK)
    assert isinstance(recv, DispatchResult)
    assert recv.x_RD is x_TD and recv.topk_weights_RK is weights_TK and recv.topk_ids_RK is ids_TK
    y_RD = fused_experts(recv.x_RD, w13_EFD, w2_EDF, recv.topk_weights_RK, recv.topk_ids_RK,
                         expert_map=disp.expert_map_on("cpu"), backend="torch")
    y_TD = disp.combine(y_RD, recv)
    assert y_TD is y_RD and y_TD.shape == (T, D)
    torch.testing.assert_close(y_TD, fused_experts(x_TD, w13_EFD, w2_EDF, weights_TK, ids_TK))


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "all_to_all"])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_collective_backends_without_torch_distributed(backend, T):
    # EP=1 without an initialised process group: the collectives degrade to copies.
    w13_EFD, w2_EDF = global_weights()
    x_TD, weights_TK, ids_TK = make_inputs("uneven", [T], "round_robin", seed=3)[0]
    disp = make_dispatcher(backend, None, E, "round_robin")
    recv = disp.dispatch(x_TD, weights_TK, ids_TK)
    y_RD = fused_experts(recv.x_RD, w13_EFD, w2_EDF, recv.topk_weights_RK, recv.topk_ids_RK,
                         expert_map=disp.expert_map_on("cpu"), backend="torch")
    torch.testing.assert_close(disp.combine(y_RD, recv),
                               fused_experts(x_TD, w13_EFD, w2_EDF, weights_TK, ids_TK),
                               atol=1e-6, rtol=1e-6)
