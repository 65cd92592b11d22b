"""The few-token expert path (kernels/triton_moe/skinny.py) against the torch reference.

Legend: T tokens, D hidden, F expert intermediate, E experts, K top-k.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py) on small,
awkward shapes (D and F not multiples of the tiles, several K steps); real shapes and CUDA-graph
capture need a GPU. Outputs and intermediates come from a NaN-poisoned torch.empty, so a row or
column never written shows.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.reference import fused_experts_torch  # noqa: E402
from kernels.triton_moe import fused as fused_mod  # noqa: E402
from kernels.triton_moe import fused_experts_triton  # noqa: E402
from kernels.triton_moe.skinny import SkinnyExpertConfig, fused_experts_skinny, skinny_expert_config  # noqa: E402

from tests.kernels.test_triton_moe import TOL, make_inputs, rel  # noqa: E402
from tests.kernels.triton_marks import DEV, needs_cuda, needs_triton_device  # noqa: E402

SMALL = SkinnyExpertConfig(up_block_n=4, up_block_k=16, down_block_n=8, down_block_k=16)


@pytest.fixture
def poisoned_empty(monkeypatch):
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", empty)


@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,D,F,E,K", [(1, 40, 24, 6, 4), (2, 48, 40, 5, 2), (3, 33, 19, 4, 1),
                                       (1, 64, 32, 8, 8)])
@pytest.mark.parametrize("cfg", [None, SMALL], ids=["default", "small-tiles"])
def test_skinny_experts_match_reference(dtype, T, D, F, E, K, cfg, poisoned_empty):
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, dtype, seed=T * 7 + D)
    out = fused_experts_skinny(x, w13, w2, tw, ti, config=cfg)
    ref = fused_experts_torch(x.cpu(), w13.cpu(), w2.cpu(), tw.cpu(), ti.cpu())
    assert out.shape == (T, D) and out.dtype == dtype
    assert not out.isnan().any(), "every output element written"
    assert rel(out.cpu(), ref) < TOL[dtype]


@needs_triton_device
def test_skinny_experts_expert_map_skips_rows_elsewhere(poisoned_empty):
    """Global ids through an expert map; rows whose expert is on another rank (-1) add nothing,
    and a token with all its experts elsewhere comes out zero."""
    T, D, F, K = 2, 40, 24, 3
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32, device=DEV)
    x, w13, w2, tw, ti = make_inputs(T, D, F, 4, K, torch.float32, seed=3, expert_map=emap)
    ti[1] = torch.tensor([1, 3, 5], dtype=torch.int32, device=DEV)  # all elsewhere
    out = fused_experts_skinny(x, w13, w2, tw, ti, emap, config=SMALL)
    ref = fused_experts_torch(x.cpu(), w13.cpu(), w2.cpu(), tw.cpu(), ti.cpu(), emap.cpu())
    assert torch.all(out[1] == 0)
    assert ref[0].abs().sum() > 0 and rel(out.cpu(), ref) < TOL[torch.float32]


@needs_triton_device
def test_skinny_experts_exact_on_small_integers():
    """Integer-valued inputs whose products and sums are exact in fp32: the result must equal
    the reference bit for bit, so a wrong expert, row or weight cannot hide in a tolerance."""
    T, D, F, E = 2, 24, 20, 5
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (T, D), generator=g).float()
    w13 = torch.randint(-1, 2, (E, 2 * F, D), generator=g).float()
    w2 = torch.randint(-1, 2, (E, D, F), generator=g).float()
    ti = torch.tensor([[4, 0, 2], [1, 4, 3]], dtype=torch.int32)
    tw = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 0.0625]])
    # SiLU is not integer-valued: make every gate a large positive number (SiLU(g) ~ g) instead
    w13[:, :F] = 0
    w13[:, :F, 0] = 1
    x[:, 0] = 40
    out = fused_experts_skinny(*(t.to(DEV) for t in (x, w13, w2, tw, ti)), config=SMALL)
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert torch.equal(out.cpu(), ref)


@needs_triton_device
def test_default_triton_path_takes_skinny_up_to_its_limit(monkeypatch):
    """fused_experts_triton without a config runs the skinny path up to SKINNY_MAX_TOKENS tokens
    and the grouped GEMMs above; both agree with the reference."""
    monkeypatch.setattr(fused_mod, "SKINNY_MAX_TOKENS", 2)
    calls = []
    real = fused_mod.fused_experts_skinny
    monkeypatch.setattr(fused_mod, "fused_experts_skinny", lambda *a, **k: calls.append(1) or real(*a, **k))
    for T, want in ((1, 1), (2, 1), (3, 0)):
        calls.clear()
        x, w13, w2, tw, ti = make_inputs(T, 32, 16, 4, 2, torch.float32, seed=T)
        out = fused_experts_triton(x, w13, w2, tw, ti)
        assert len(calls) == want, T
        assert rel(out.cpu(), fused_experts_torch(*(t.cpu() for t in (x, w13, w2, tw, ti)))) < TOL[torch.float32]


def test_skinny_expert_config_heuristic():
    cfg = skinny_expert_config(2048, 768)  # Qwen3-30B-A3B
    assert (cfg.up_block_k, cfg.up_block_n) == (2048, 1)   # a 4 KiB row of gate and of up per step
    assert (cfg.down_block_k, cfg.down_block_n) == (1024, 4)
    small = skinny_expert_config(40, 24, elem_bytes=4)
    assert small.up_block_k == 64 and small.down_block_k == 32
    for v in small[:4]:
        assert v >= 1 and v & (v - 1) == 0


# --- GPU: real shapes and CUDA graphs -------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("D,F,E,K", [(2048, 768, 128, 8), (5120, 8192, 16, 1), (7168, 2048, 32, 8)])
def test_skinny_experts_real_shapes_and_graph(T, D, F, E, K, poisoned_empty):
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, torch.bfloat16, seed=T)
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert rel(fused_experts_skinny(x, w13, w2, tw, ti), ref) < TOL[torch.bfloat16]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = fused_experts_skinny(x, w13, w2, tw, ti)
    x2, _, _, tw2, ti2 = make_inputs(T, D, F, E, K, torch.bfloat16, seed=T + 10)
    x.copy_(x2)
    tw.copy_(tw2)
    ti.copy_(ti2)
    out_static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out_static, fused_experts_torch(x, w13, w2, tw, ti)) < TOL[torch.bfloat16]


@needs_triton_device
def test_bench_skinny_experts_smoke(tmp_path):
    """benchmarks/bench_skinny_experts.py end to end on a tiny shape (interpreter or GPU)."""
    import json

    from benchmarks import bench_skinny_experts

    out = tmp_path / "skinny_experts.json"
    bench_skinny_experts.main(["--device", DEV, "--tiny", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["T"] for r in rows] == [1, 3]
    for r in rows:
        assert r["grouped_rel_err"] < 2e-2 and all(e["rel_err"] < 2e-2 for e in r["sweep"])
