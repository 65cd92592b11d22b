"""The expert GEMMs' persistent forms (config "PERSISTENT", kernels/triton_moe/gemm.py): a fixed
grid whose programs loop over the used tiles, with and without FLATTEN (the tile loop fused with
the K loop). The routing of test_half_tiles.py gives full blocks, partly padded ones and an expert
with no rows; the interpreter's grid is 4 programs an SM-count unit, far fewer than the tiles, so
every program runs several. Outputs are checked against the torch reference with unwritten memory
poisoned: a tile no program ran shows as NaN."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.reference import fused_experts_torch  # noqa: E402
from kernels.triton_moe import fused_experts_triton, fused_experts_triton_fp8  # noqa: E402
from kernels.triton_moe.fused import persistent_programs  # noqa: E402
from tests.kernels.test_half_tiles import CFG, inputs, rel  # noqa: E402
from tests.kernels.triton_marks import DEV, needs_cuda, needs_triton_device  # noqa: E402

FORMS = [{"PERSISTENT": 1}, {"PERSISTENT": 2, "FLATTEN": True},
         {"PERSISTENT": 1, "down": {"PERSISTENT": 0}}, {"down": {"PERSISTENT": 1, "FLATTEN": True}}]


def config(form: dict, down: dict | None = None) -> dict:
    cfg = dict(CFG, **{k: v for k, v in form.items() if k != "down"})
    cfg["down"] = {**form.get("down", {}), **(down or {})}
    return cfg


@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", FORMS, ids=["both", "both-flat-2", "gate_up", "down-flat"])
@pytest.mark.parametrize("down", [{}, {"ATOMIC_SUM": True}], ids=["plain", "atomic"])
def test_persistent_forms_match_reference(dtype, form, down, poisoned_empty):
    x, w13, w2, tw, ti = inputs(dtype)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=config(form, down))
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@needs_triton_device
@pytest.mark.parametrize("flatten", [False, True])
def test_persistent_forms_with_biases_swiglu_and_uneven_k(flatten, poisoned_empty):
    """D = 40 and F = 24 are not multiples of BLOCK_K 16: the masked K loop."""
    x, w13, w2, tw, ti = inputs(torch.float32, D=40, F=24)
    g = torch.Generator().manual_seed(1)
    b13 = torch.randn(w13.shape[0], w13.shape[1], generator=g).to(DEV)
    b2 = torch.randn(w2.shape[0], w2.shape[1], generator=g).to(DEV)
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai", swiglu_limit=0.75)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=config({"PERSISTENT": 1, "FLATTEN": flatten}), **kw)
    ref = fused_experts_torch(x, w13, w2, tw, ti, **kw)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5


def test_persistent_grid_is_smaller_than_the_tiles():
    """The tests above run several tiles a program (else they would not test the loop)."""
    tiles = 6 * 5  # 6 used blocks of 32 rows (PAIRS' routing) x 80 / 16 gate_up columns
    programs = persistent_programs({"PERSISTENT": 1}, tiles, torch.device("cpu"), None, False)
    assert 1 <= programs < tiles / 2
    assert persistent_programs({"PERSISTENT": 0}, tiles, torch.device("cpu"), None, False) == 0
    assert persistent_programs({"PERSISTENT": 64}, 3, torch.device("cpu"), None, False) == 3, "no idle programs"


@pytest.mark.parametrize("extra", [{"HALF_TILES": True}, {"SPLIT_K": 2}], ids=["half", "split"])
def test_persistent_forms_refuse_what_they_lack(extra):
    x, w13, w2, tw, ti = inputs(torch.float32)
    with pytest.raises(ValueError, match="PERSISTENT expert GEMM takes no"):
        fused_experts_triton(x, w13, w2, tw, ti, config=dict(CFG, PERSISTENT=1, **extra))


def test_persistent_forms_refuse_expert_maps_and_fp8():
    x, w13, w2, tw, ti = inputs(torch.float32)
    emap = torch.tensor([0, -1, 1, -1, 2], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="PERSISTENT expert GEMM takes no expert map"):
        fused_experts_triton(x, w13[[0, 2, 4]], w2[[0, 2, 4]], tw, ti, emap, config=dict(CFG, PERSISTENT=1))
    from kernels.reference_fp8 import quantize_block_fp8
    q13, s13 = quantize_block_fp8(w13.cpu())
    q2, s2 = quantize_block_fp8(w2.cpu())
    cfg = dict(CFG, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, PERSISTENT=1)
    with pytest.raises(ValueError, match="PERSISTENT expert GEMM takes no"):
        fused_experts_triton_fp8(x, *(t.to(DEV) for t in (q13, q2, s13, s2)), tw, ti, config=cfg)


@needs_cuda
@pytest.mark.parametrize("flatten", [False, True])
def test_persistent_forms_replay_in_a_cuda_graph_with_other_routings(flatten):
    """The tile count comes from the device (npp): a graph captured on one routing computes another
    routing's blocks, more or fewer of them, at the Qwen3-30B-A3B expert shape."""
    torch.manual_seed(0)
    E, D, F, K, T = 128, 2048, 768, 8, 512
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * F, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5
    w2 = torch.randn(E, D, F, device="cuda", dtype=torch.bfloat16) * F ** -0.5
    cfg = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": 4,
           "num_stages": 3, "PERSISTENT": 1, "FLATTEN": flatten}
    skewed = torch.randn(T, E, device="cuda")
    skewed[:, :16] += 4  # most rows on 16 experts: fewer, fuller blocks than the even routing
    routings = [torch.softmax(logits, -1).topk(K, dim=-1) for logits in (torch.randn(T, E, device="cuda"), skewed)]
    tw_s, ti_s = routings[0][0].clone(), routings[0][1].to(torch.int32)
    out = fused_experts_triton(x, w13, w2, tw_s, ti_s, config=cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(x, w13, w2, tw_s, ti_s, config=cfg)
    for tw, ti in reversed(routings):
        tw_s.copy_(tw)
        ti_s.copy_(ti)
        graph.replay()
        ref = fused_experts_torch(x.float(), w13.float(), w2.float(), tw, ti)
        assert rel(out, ref) < 2e-2
