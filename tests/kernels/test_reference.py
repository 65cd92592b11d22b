"""The torch reference of the expert layer against a per-token loop, and the seam's checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from routing import make_expert_map


def naive(x, w13, w2, weights, ids, expert_map=None):
    out = torch.zeros(x.shape, dtype=torch.float64)
    f = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) if expert_map is None else int(expert_map[ids[t, k]])
            if e < 0:
                continue
            g = w13[e].double() @ x[t].double()
            out[t] += weights[t, k].double() * (w2[e].double() @ (F.silu(g[:f]) * g[f:]))
    return out


@pytest.mark.parametrize("T,D,E,F_,K", [(1, 8, 1, 4, 1), (7, 12, 4, 6, 2), (33, 20, 8, 10, 3), (5, 8, 16, 4, 4)])
def test_reference_matches_naive(T, D, E, F_, K):
    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * F_, D, generator=g), torch.randn(E, D, F_, generator=g)
    weights = torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if K <= E else None
    y = kernels.fused_experts(x, w13, w2, weights, ids, backend="torch")
    torch.testing.assert_close(y.double(), naive(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_expert_map_drops_remote_experts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=g)
    w13_all, w2_all = torch.randn(8, 6, 8, generator=g), torch.randn(8, 8, 3, generator=g)
    weights, ids = torch.rand(9, 2, generator=g), torch.randint(0, 8, (9, 2), generator=g)
    total = torch.zeros(9, 8)
    for rank in range(2):
        emap = make_expert_map(8, 2, rank, "round_robin")
        local = (emap >= 0).nonzero()[:, 0]
        total += kernels.fused_experts(x, w13_all[local], w2_all[local], weights, ids, expert_map=emap,
                                       backend="torch")
    torch.testing.assert_close(total, kernels.fused_experts(x, w13_all, w2_all, weights, ids, backend="torch"),
                               rtol=1e-5, atol=1e-5)


def test_seam_rejects_bad_shapes_and_backends():
    x, w13, w2 = torch.randn(3, 8), torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    w, ids = torch.rand(3, 1), torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="w2 must be"):
        kernels.fused_experts(x, w13, torch.randn(2, 8, 4), w, ids)
    with pytest.raises(ValueError, match="same shape"):
        kernels.fused_experts(x, w13, w2, torch.rand(3, 2), ids)
    with pytest.raises(ValueError, match="unknown fused_experts backend"):
        kernels.fused_experts(x, w13, w2, w, ids, backend="cuda-magic")
    assert kernels.available_backends("cpu")[-1] == "torch"
