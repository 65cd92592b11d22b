"""The fast CPU expert layer (kernels/cpu_experts.py, the seam's "torch" backend on CPU fp32)
against the reference fused_experts_torch: every form (the native kernel, grouped GEMM, sorted loop), experts
without tokens, one token, top-1 and top-k, expert_map with experts elsewhere (-1)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_experts, cpu_native
from kernels.reference import fused_experts_torch


def _inputs(T, D, F, E, K, seed=0, skewed=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    w13 = torch.randn(E, 2 * F, D, generator=gen) * D ** -0.5
    w2 = torch.randn(E, D, F, generator=gen) * F ** -0.5
    logits = torch.randn(T, E, generator=gen)
    if skewed:  # half the experts never chosen
        logits[:, E // 2:] -= 100.0
    weights, ids = logits.softmax(-1).topk(K, dim=-1)
    return x, w13, w2, weights, ids


@pytest.fixture(params=["native", "grouped", "loop"])
def form(request, monkeypatch):
    """Force one form for every size: the native kernel or the grouped GEMM (decode), or the
    sorted loop (prefill). The native form fails the test if the kernel did not run."""
    if request.param == "native" and cpu_native.library() is None:
        pytest.skip("no C compiler: the native kernels did not build")
    if request.param == "grouped" and not cpu_experts.HAVE_GROUPED_MM:
        pytest.skip("this torch build has no CPU torch._grouped_mm")
    monkeypatch.setattr(cpu_experts, "GROUPED_MAX_ROWS", -1 if request.param == "loop" else 10 ** 9)
    calls = []
    if request.param == "native":
        real = cpu_experts.native_ops.experts
        monkeypatch.setattr(cpu_experts.native_ops, "experts", lambda *a: calls.append(1) or real(*a))
    else:
        monkeypatch.setattr(cpu_experts.native_ops, "experts", lambda *a: None)
    yield request.param
    assert bool(calls) == (request.param == "native")


@pytest.mark.parametrize("T,K", [(1, 1), (1, 4), (7, 1), (33, 2), (200, 4)])
def test_matches_reference(form, T, K):
    x, w13, w2, w, ids = _inputs(T, 48, 24, 8, K, seed=T * 10 + K)
    out = kernels.fused_experts(x, w13, w2, w, ids, backend="torch")
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids), atol=2e-6, rtol=1e-5)


def test_experts_without_tokens(form):
    x, w13, w2, w, ids = _inputs(40, 32, 16, 8, 2, skewed=True)
    assert ids.max() < 4  # experts 4..7 got nothing
    out = cpu_experts.fused_experts_cpu(x, w13, w2, w, ids)
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids), atol=2e-6, rtol=1e-5)


def test_expert_map_sums_to_the_whole(form):
    """Two ranks of 6 global experts (3 each, -1 elsewhere): each matches the reference on its
    shard, and the two shards add up to the unsharded layer."""
    x, w13, w2, w, ids = _inputs(50, 32, 16, 6, 3, seed=3)
    total = torch.zeros_like(x)
    for rank in range(2):
        local = torch.arange(rank * 3, rank * 3 + 3)
        emap = torch.full((6,), -1, dtype=torch.int32)
        emap[local] = torch.arange(3, dtype=torch.int32)
        out = cpu_experts.fused_experts_cpu(x, w13[local], w2[local], w, ids, emap)
        torch.testing.assert_close(out, fused_experts_torch(x, w13[local], w2[local], w, ids, emap),
                                   atol=2e-6, rtol=1e-5)
        total += out
    torch.testing.assert_close(total, fused_experts_torch(x, w13, w2, w, ids), atol=5e-6, rtol=1e-5)


def test_no_local_expert_gives_zeros(form):
    x, w13, w2, w, ids = _inputs(5, 16, 8, 4, 2)
    emap = torch.tensor([-1, -1, -1, -1, 0, 1])  # the 4 routed experts all live elsewhere
    out = cpu_experts.fused_experts_cpu(x, w13[:2], w2[:2], w, ids, emap)
    assert torch.equal(out, torch.zeros_like(x))


def test_workload_shape_both_forms_agree():
    """The benchmark's layer (D=256, F=128, E=16, top-4) at a decode and a prefill size."""
    for T in (64, 300):
        x, w13, w2, w, ids = _inputs(T, 256, 128, 16, 4, seed=T)
        ref = kernels.fused_experts(x, w13, w2, w, ids, backend="reference")
        ids_R, w_R = ids.reshape(-1), w.reshape(-1)
        if cpu_experts.HAVE_GROUPED_MM:
            torch.testing.assert_close(cpu_experts._grouped(x, w13, w2, w_R, ids_R, 4), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cpu_experts._sorted_loop(x, w13, w2, w_R, ids_R, 4), ref, atol=1e-5, rtol=1e-5)


def test_unaligned_shapes_take_the_loop():
    """D or F not a multiple of 4 (the grouped GEMM's 16-byte strides): the loop runs instead."""
    x, w13, w2, w, ids = _inputs(10, 30, 6, 4, 2)
    out = kernels.fused_experts(x, w13, w2, w, ids, backend="torch")
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids), atol=2e-6, rtol=1e-5)


def test_other_dtypes_use_the_reference():
    x, w13, w2, w, ids = _inputs(9, 16, 8, 4, 2)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    assert torch.equal(kernels.fused_experts(x, w13, w2, w, ids, backend="torch"),
                       fused_experts_torch(x, w13, w2, w, ids))


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the native kernels did not build")
@pytest.mark.parametrize("D,F", [(50, 13), (256, 128)])  # widths off the vector length; the workload's
def test_native_widths(D, F):
    from kernels.cpu_native import ops

    x, w13, w2, w, ids = _inputs(9, D, F, 8, 3, seed=D)
    out = ops.experts(x, w13, w2, w.reshape(-1), ids.reshape(-1), 3)
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids), atol=2e-6, rtol=1e-5)
    assert ops.experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, w.reshape(-1), ids.reshape(-1),
                       3) is None, "strided weights: the torch path"
