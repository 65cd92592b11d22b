"""SWAP_AB with 16-bit weights (kernels/triton_moe/gemm.py): both expert GEMMs computing the transposed
product, weights as the MMA's A operand, give the plain form's results on routings with full, partial and
empty expert blocks, with half tiles, the down GEMM's atomic sum and split, K not a multiple of BLOCK_K,
biases and gpt-oss's activation; FP8 weights refuse it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.reference import fused_experts_torch  # noqa: E402
from kernels.triton_moe import fused_experts_triton, fused_experts_triton_fp8  # noqa: E402
from tests.kernels.triton_marks import DEV, needs_triton_device  # noqa: E402

CFG = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4,
       "num_stages": 1}
# rows of expert e for E = 5, top-2: 40 (a full block and one of 8), 9 + 16, 0, 16
PAIRS = [(0, 1)] * 40 + [(1, 2)] * 9 + [(2, 4)] * 16


def inputs(dtype, D=48, F=40, E=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(PAIRS, dtype=torch.int32)[torch.randperm(len(PAIRS), generator=g)]
    w = torch.rand(len(PAIRS), 2, generator=g) + 0.1
    x = torch.randn(len(PAIRS), D, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dtype)
    return [t.to(DEV) for t in (x, w13, w2, w / w.sum(-1, keepdim=True), ids)]


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [{}, {"HALF_TILES": True}, {"down": {"ATOMIC_SUM": True}},
                                   {"down": {"SPLIT_K": 2}}, {"down": {"SWAP_AB": False}}],
                         ids=["both", "half", "atomic", "split2", "gate_up_only"])
def test_swap_ab_matches_the_plain_form(dtype, extra, poisoned_empty):
    x, w13, w2, tw, ti = inputs(dtype, D=56)  # D = 56: the gate_up K loop ends on a partial tile
    cfg = dict(CFG, SWAP_AB=True, **{k: v for k, v in extra.items() if k != "down"})
    cfg["down"] = extra.get("down", {})
    out = fused_experts_triton(x, w13, w2, tw, ti, config=cfg)
    plain = fused_experts_triton(x, w13, w2, tw, ti, config={k: v for k, v in cfg.items() if k != "SWAP_AB"})
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert rel(out, plain) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_triton_device
def test_swap_ab_with_remote_experts_biases_and_swiglu(poisoned_empty):
    """Experts 1 and 3 live on another rank; the down GEMM's K (F = 44) ends on a partial tile."""
    x, w13, w2, tw, ti = inputs(torch.float32, F=44)
    emap = torch.tensor([0, -1, 1, -1, 2], dtype=torch.int32, device=DEV)
    local13, local2 = w13[[0, 2, 4]], w2[[0, 2, 4]]
    g = torch.Generator().manual_seed(1)
    b13 = torch.randn(3, local13.shape[1], generator=g).to(DEV)
    b2 = torch.randn(3, local2.shape[1], generator=g).to(DEV)
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai", swiglu_limit=0.75)
    out = fused_experts_triton(x, local13, local2, tw, ti, emap, config=dict(CFG, SWAP_AB=True), **kw)
    ref = fused_experts_torch(x, local13, local2, tw, ti, emap, **kw)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5


def test_fp8_weights_refuse_swap_ab():
    x, w13, w2, tw, ti = inputs(torch.float32)
    q13, q2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="SWAP_AB is for 16-bit or MXFP4 weights, not FP8"):
        fused_experts_triton_fp8(x, q13, q2, torch.ones(5, 1, 1, device=DEV), torch.ones(5, 1, 1, device=DEV), tw, ti,
                                 config=dict(CFG, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, SWAP_AB=True))
