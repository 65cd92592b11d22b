"""HALF_TILES in the expert GEMMs (kernels/triton_moe/gemm.py): an expert's last block with only
padding in its upper half runs a tile of BLOCK_M / 2 rows. The routing below gives blocks of every
kind at BLOCK_M 32: full blocks, last blocks of more than 16 rows (full tiles), last blocks of at
most 16 rows (half tiles), a lone block of exactly 16 rows, an expert with no rows, and (with an expert map)
blocks of experts on other ranks. Outputs are checked against the torch references with unwritten
memory poisoned, so a row the half tile should have computed and did not shows as NaN."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.reference import fused_experts_torch  # noqa: E402
from kernels.triton_moe import fused_experts_triton, fused_experts_triton_fp8  # noqa: E402
from kernels.triton_moe.align import align_tokens_torch  # noqa: E402
from tests.kernels.triton_marks import DEV, INTERPRET, kernel_grid, needs_triton_device  # noqa: E402

CFG = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4,
       "num_stages": 1}
# rows of expert e for E = 5, top-2: 40 = 32 + 8 (half), 49 = 32 + 17 (full: one row past the half),
# 25 (full), 0, 16 (exactly half)
PAIRS = [(0, 1)] * 40 + [(1, 2)] * 9 + [(2, 4)] * 16
HALF = [{"HALF_TILES": True}, {"HALF_TILES": True, "down": {"HALF_TILES": False}}, {"down": {"HALF_TILES": True}}]
DOWNS = [{}, {"ATOMIC_SUM": True}, {"SPLIT_K": 2}]


def routing(seed: int = 0, E: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(PAIRS, dtype=torch.int32)[torch.randperm(len(PAIRS), generator=g)]
    w = torch.rand(len(PAIRS), 2, generator=g) + 0.1
    return w / w.sum(-1, keepdim=True), ids


def inputs(dtype, D=48, F=40, E=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(PAIRS), D, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dtype)
    tw, ti = routing(seed)
    return [t.to(DEV) for t in (x, w13, w2, tw, ti)]


def with_down(half: dict, down: dict) -> dict:
    cfg = dict(CFG, **{k: v for k, v in half.items() if k != "down"})
    cfg["down"] = {**half.get("down", {}), **down}
    return cfg


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_routing_makes_every_kind_of_block():
    _, ti = routing()
    sorted_ids, expert_ids, npp = align_tokens_torch(ti, 5, 32)
    R, bm = ti.numel(), 32
    blocks = sorted_ids[:int(npp)].view(-1, bm)
    valid = (blocks < R).sum(1)
    assert valid.tolist() == [32, 8, 32, 17, 25, 16] and expert_ids[:6].tolist() == [0, 0, 1, 1, 2, 4]
    assert (blocks[:, bm // 2] >= R).tolist() == [False, True, False, False, False, True], \
        "the half-tile test is the upper half's first row"


@needs_triton_device
@pytest.mark.parametrize("down,half,dtype", kernel_grid(dict(zip(["plain", "atomic", "split2"], DOWNS)),
                                                        dict(zip(["both", "gate_up", "down"], HALF)),
                                                        {"fp32": torch.float32, "bf16": torch.bfloat16}))
def test_half_tiles_match_reference(dtype, half, down, poisoned_empty):
    x, w13, w2, tw, ti = inputs(dtype)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=with_down(half, down))
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@needs_triton_device
@pytest.mark.parametrize("down", [{}, {"SPLIT_K": 2}])
def test_half_tiles_with_remote_experts_biases_and_swiglu(down, poisoned_empty):
    """Experts 1 and 3 live on another rank (their blocks have expert id -1 and write zeros)."""
    x, w13, w2, tw, ti = inputs(torch.float32)
    emap = torch.tensor([0, -1, 1, -1, 2], dtype=torch.int32, device=DEV)
    local13, local2 = w13[[0, 2, 4]], w2[[0, 2, 4]]
    g = torch.Generator().manual_seed(1)
    b13 = torch.randn(3, local13.shape[1], generator=g).to(DEV)
    b2 = torch.randn(3, local2.shape[1], generator=g).to(DEV)
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai", swiglu_limit=0.75)
    out = fused_experts_triton(x, local13, local2, tw, ti, emap, config=with_down(HALF[0], down), **kw)
    ref = fused_experts_torch(x, local13, local2, tw, ti, emap, **kw)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5


@needs_triton_device
def test_half_tiles_fp8(monkeypatch):
    from kernels import reference_fp8
    from kernels.reference_fp8 import fused_experts_fp8_actquant_torch, quantize_block_fp8
    from tests.kernels.fp8_interpreter_cast import interpreter_qdq_groups
    x, w13, w2, tw, ti = inputs(torch.float32, D=200, F=136)
    q13, s13 = quantize_block_fp8(w13.cpu())
    q2, s2 = quantize_block_fp8(w2.cpu())
    q13, s13, q2, s2 = (t.to(DEV) for t in (q13, s13, q2, s2))
    cfg = dict(CFG, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, HALF_TILES=True)
    out = fused_experts_triton_fp8(x, q13, q2, s13, s2, tw, ti, config=cfg)
    if INTERPRET:  # the interpreter's e4m3 cast (tests/kernels/fp8_interpreter_cast.py)
        monkeypatch.setattr(reference_fp8, "_qdq_groups", interpreter_qdq_groups)
    assert rel(out, fused_experts_fp8_actquant_torch(x, q13, q2, s13, s2, tw, ti)) < 1e-2


@needs_triton_device
def test_half_tiles_mxfp4():
    from kernels.reference_mxfp4 import dequantize_mxfp4
    from kernels.triton_moe.fused import fused_experts_triton_mxfp4
    from models.mxfp4 import quantize_mxfp4
    x, w13, w2, tw, ti = inputs(torch.float32, D=64, F=64)
    (q13, s13), (q2, s2) = (quantize_mxfp4(w.cpu()) for w in (w13, w2))
    q13, q2 = q13.flatten(-2), q2.flatten(-2)
    cfg = dict(CFG, BLOCK_SIZE_K=32, HALF_TILES=True)
    out = fused_experts_triton_mxfp4(x, *(t.to(DEV) for t in (q13, q2, s13, s2)), tw, ti, config=cfg)
    ref = fused_experts_torch(x, dequantize_mxfp4(q13, s13, torch.float32).to(DEV),
                              dequantize_mxfp4(q2, s2, torch.float32).to(DEV), tw, ti)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5


def test_half_tiles_need_tiles_of_16_rows():
    x, w13, w2, tw, ti = inputs(torch.float32)
    with pytest.raises(ValueError, match="HALF_TILES needs BLOCK_SIZE_M >= 32"):
        fused_experts_triton(x, w13, w2, tw, ti, config=dict(CFG, BLOCK_SIZE_M=16, HALF_TILES=True))
