"""Triton expert layer against the torch references.

Without a GPU every kernel runs under TRITON_INTERPRET=1 (set in tests/kernels/conftest.py) on
small awkward shapes; with a GPU the same tests run on it, plus real-shape tests at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.reference import fused_experts_torch  # noqa: E402
from kernels.triton_moe import (align_tokens, align_tokens_torch, fused_experts_triton,  # noqa
                                fused_experts_triton_fp8)
from kernels.triton_moe import config as cfgmod  # noqa: E402
from tests.kernels.fp8_interpreter_cast import interpreter_e4m3, interpreter_qdq_groups  # noqa: E402

from tests.kernels.triton_marks import CUDA, DEV, INTERPRET, kernel_grid, needs_triton_device  # noqa: E402
SMALL_CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2,
             "num_warps": 4, "num_stages": 1}


def make_inputs(T, D, F, E, K, dtype, seed=0, empty_expert=None, expert_map=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dtype)
    n_ids = expert_map.numel() if expert_map is not None else E
    logits = torch.randn(T, n_ids, generator=g)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    tw, ti = torch.softmax(logits, -1).topk(K, dim=-1)
    return [t.to(DEV) for t in (x, w13, w2, tw, ti.to(torch.int32))]


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# --- alignment ------------------------------------------------------------------------------

def check_alignment(ids, E, bm, emap, path):
    s, e, n = align_tokens(ids, E, bm, emap, path=path)
    rs, re_, rn = align_tokens_torch(ids.cpu(), E, bm, None if emap is None else emap.cpu())
    s, e, n = s.cpu(), e.cpu(), int(n.item())
    R = ids.numel()
    assert n == int(rn.item()) and n % bm == 0
    assert torch.equal(e, re_), "one expert id per block, -1 past the end / for elsewhere"
    used = s[:n]
    real = used[used < R]
    assert torch.equal(real.sort().values, torch.arange(R, dtype=torch.int32)), \
        "every real row present exactly once"
    assert torch.all(s[n:] == R) and torch.all((used == R) | (used < R)), "sentinels elsewhere"
    flat = ids.reshape(-1).long().cpu()
    if emap is not None:
        flat = emap.long().cpu()[flat]
    for blk in range(n // bm):
        rows = used[blk * bm:(blk + 1) * bm]
        rows = rows[rows < R].long()
        want = int(e[blk]) if int(e[blk]) >= 0 else -1
        assert torch.all(torch.where(flat[rows] < 0, -1, flat[rows]) == want)
        if len(rows) < bm:  # padding only at the end of an expert's last block
            assert torch.all(s[blk * bm + len(rows):(blk + 1) * bm] == R)


ALIGN_CASES = [(1, 1, 1, 16, False), (1, 8, 16, 16, False), (37, 2, 5, 16, False), (64, 4, 8, 32, False),
               (300, 2, 3, 16, False), (9, 3, 6, 16, True), (700, 2, 33, 64, True), (1500, 2, 250, 16, False)]


# The ranked path's programs each read every id (quadratic under the interpreter): its case of 250
# experts takes 400 tokens, still 13 programs over 13 chunks of ids, not 1500.
@needs_triton_device
@pytest.mark.parametrize("T,K,E,bm,with_map,path", [
    (*case, path) if path != "ranked" or case[0] != 1500 else (400, *case[1:], path)
    for path in ("ranked", "small", "large") for case in ALIGN_CASES])
def test_alignment_matches_torch(path, T, K, E, bm, with_map, monkeypatch):
    monkeypatch.setattr("kernels.triton_moe.align.SMALL_CHUNK_ROWS", 64)  # several chunks
    g = torch.Generator().manual_seed(T * 31 + E)
    emap = None
    if with_map:  # 2*E global experts, half of them elsewhere (-1)
        emap = torch.full((2 * E,), -1, dtype=torch.int32)
        emap[torch.randperm(2 * E, generator=g)[:E]] = torch.arange(E, dtype=torch.int32)
        ids = torch.randint(0, 2 * E, (T, K), generator=g, dtype=torch.int32)
        emap = emap.to(DEV)
    else:
        ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
        if E > 2:
            ids[ids == 1] = 0  # expert 1 gets no tokens
    check_alignment(ids.to(DEV), E, bm, emap, path)
    if path == "ranked":  # no atomics: the reference's stable order, row for row
        s, _, _ = align_tokens(ids.to(DEV), E, bm, emap, path=path)
        ref, _, _ = align_tokens_torch(ids, E, bm, None if emap is None else emap.cpu())
        assert torch.equal(s.cpu(), ref)


def test_alignment_auto_path():
    from kernels.triton_moe.align import auto_path
    assert auto_path(16, 20) == auto_path(256, 140) == "small"  # one program: decode up to 32 tokens
    assert auto_path(512, 160) == auto_path(4096, 600) == "ranked"
    assert auto_path(8192, 1000) == "large"  # GPU time only: one program loses from ~8192 rows
    assert auto_path(131072, 9000) == "large"
    assert auto_path(2000, 20000) == "large"  # too many blocks for one program


# --- the expert layer -----------------------------------------------------------------------

@needs_triton_device
@pytest.mark.parametrize("T,D,F,E,K", [
    (1, 32, 16, 4, 2),      # one token
    (19, 40, 24, 4, 2),     # T not a multiple of BLOCK_M, D and F not multiples of 16
    (33, 24, 40, 1, 1),     # E = 1, top-1
    (17, 48, 32, 6, 1),     # top-1 with several experts
    (40, 32, 16, 8, 3),     # top-3, 120 rows
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_experts_matches_reference(T, D, F, E, K, dtype):
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, dtype, empty_expert=E - 1 if E > 2 else None)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=SMALL_CFG if not CUDA else None)
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert out.shape == (T, D) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]


@needs_triton_device
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_one_token_needs_no_alignment_launch(ids_dtype, monkeypatch):
    """A single token's K distinct experts are already aligned: block r holds flat row r alone
    (one_row_blocks), so the layer runs without align_tokens, with the same result."""
    import kernels.triton_moe.fused as fused

    def no_align(*args, **kwargs):
        raise AssertionError("align_tokens launched for a single token")

    x, w13, w2, tw, ti = make_inputs(1, 40, 24, 8, 3, torch.float32, seed=3)
    sorted_ids, expert_ids, npp = fused.one_row_blocks(ti, 16)
    assert int(npp.item()) == 3 * 16 and torch.equal(expert_ids.cpu(), ti.reshape(-1).cpu())
    want = torch.full((3 * 16,), 3, dtype=torch.int32)
    want[::16] = torch.arange(3, dtype=torch.int32)
    assert torch.equal(sorted_ids.cpu(), want)
    monkeypatch.setattr(fused, "align_tokens", no_align)
    out = fused_experts_triton(x, w13, w2, tw, ti.to(ids_dtype), config=SMALL_CFG if not CUDA else None)
    assert rel(out, fused_experts_torch(x, w13, w2, tw, ti)) < 1e-5


@needs_triton_device
@pytest.mark.parametrize("large", [True, False])
def test_deferred_sum_beyond_the_moe_sum_range(large, monkeypatch):
    """A batch past MOE_SUM_MAX_TOKENS (a mixed or prefill step) still hands its top-k outputs
    to the next norm unsummed, unless MOE_DEFER_SUM_LARGE is off; summed, they are the layer."""
    import kernels.triton_moe.fused as fused

    monkeypatch.setattr(fused, "MOE_SUM_MAX_TOKENS", 4)
    monkeypatch.setattr(fused, "DEFER_SUM_MIN_TOKENS", 2)
    monkeypatch.setattr(fused, "DEFER_SUM_LARGE", large)
    x, w13, w2, tw, ti = make_inputs(9, 32, 16, 4, 2, torch.float32, seed=4)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=SMALL_CFG if not CUDA else None, defer_sum=True)
    assert isinstance(out, fused.TopKSum) == large
    summed = out.materialize() if large else out
    assert summed.shape == (9, 32) and rel(summed, fused_experts_torch(x, w13, w2, tw, ti)) < 1e-5


# down GEMM variants: fp32-atomic top-k sum, alone and with the F range split over programs
DOWN_VARIANTS = [{"ATOMIC_SUM": True}, {"SPLIT_K": 2}, {"SPLIT_K": 3}]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shapes(*TDFEK):
    return {"-".join(map(str, s)): s for s in TDFEK}


@needs_triton_device
@pytest.mark.parametrize("shape,dtype,down", kernel_grid(
    shapes((1, 32, 16, 4, 2), (19, 40, 24, 4, 2), (33, 24, 40, 1, 1), (40, 32, 48, 8, 3)), DTYPES,
    {"atomic": DOWN_VARIANTS[0], "split2": DOWN_VARIANTS[1], "split3": DOWN_VARIANTS[2]}))
def test_atomic_sum_and_split_k_match_reference(shape, dtype, down):
    """SPLIT_K 3 over F=40..48 with BLOCK_K 16 leaves the last split a partial (or no) tile."""
    T, D, F, E, K = shape
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, dtype, seed=5,
                                     empty_expert=E - 1 if E > 2 else None)
    cfg = dict(SMALL_CFG, down=down)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=cfg)
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert out.shape == (T, D) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]


@needs_triton_device
@pytest.mark.parametrize("shape,dtype,split_down", kernel_grid(
    shapes((1, 32, 16, 4, 2), (19, 40, 24, 4, 2), (40, 48, 40, 8, 3)), DTYPES,
    {"split2": (2, {}), "split3-down2": (3, {"SPLIT_K": 2}), "split8": (8, {})}))
def test_gate_up_split_k_matches_reference(shape, dtype, split_down):
    """gate_up's D range over SPLIT_K programs, then the activation launch: D=40 with BLOCK_K 16
    leaves a split a partial tile, SPLIT_K 3 over D=48 an exact one, 8 (capped at the tiles) every
    tile its own split; an expert with no rows; with the down GEMM plain or split."""
    (T, D, F, E, K), (split, down) = shape, split_down
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, dtype, seed=6, empty_expert=E - 1 if E > 2 else None)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=dict(SMALL_CFG, SPLIT_K=split, down=down))
    ref = fused_experts_torch(x, w13, w2, tw, ti)
    assert out.shape == (T, D) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]
    if dtype == torch.float32:  # the partial sums add up to the unsplit GEMM's (fp32, up to their order)
        assert rel(out, fused_experts_triton(x, w13, w2, tw, ti, config=dict(SMALL_CFG, down=down))) < 1e-6


# Where the down GEMM's TMA descriptors run: Hopper or later, or the CPU interpreter.
TMA_HERE = torch.cuda.get_device_capability()[0] >= 9 if CUDA else INTERPRET


@pytest.mark.skipif(not TMA_HERE, reason="TMA needs a Hopper GPU or the interpreter")
@pytest.mark.parametrize("shape,dtype,down", kernel_grid(
    shapes((19, 40, 24, 4, 2), (33, 24, 40, 1, 1), (40, 48, 40, 8, 3)), DTYPES,
    {"plain": {}, "atomic": {"ATOMIC_SUM": True}, "split2": {"SPLIT_K": 2}}))
def test_down_tma_tiles_match_pointer_tiles(shape, dtype, down):
    """The down GEMM's tiles through TMA descriptors: F=24 / 40 with BLOCK_K 16 leaves a partial last
    tile (zeros past F), D=40 with BLOCK_N 16 a tile reading the next expert's rows (never stored), an
    expert with no rows; the same sums as the pointer loads' (fp32: the same order)."""
    from kernels.triton_moe.fused import tma_descriptors
    T, D, F, E, K = shape
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, dtype, seed=8, empty_expert=E - 1 if E > 2 else None)
    h = torch.empty(64, F, dtype=dtype, device=DEV)
    assert tma_descriptors(h, w2, 16, 16, 16) is not None, "the TMA form runs, not the pointer loads"
    out = fused_experts_triton(x, w13, w2, tw, ti, config=dict(SMALL_CFG, down=dict(down, TMA=True)))
    plain = fused_experts_triton(x, w13, w2, tw, ti, config=dict(SMALL_CFG, down=down))
    assert out.shape == (T, D) and out.dtype == dtype
    assert rel(out, fused_experts_torch(x, w13, w2, tw, ti)) < TOL[dtype]
    assert rel(out, plain) < (1e-6 if dtype == torch.float32 else TOL[dtype])


def test_down_tma_descriptors_only_where_tma_reads():
    from kernels.triton_moe.fused import tma_descriptors
    h, w2 = torch.empty(32, 24, device=DEV), torch.empty(4, 40, 24, device=DEV)
    assert (tma_descriptors(h, w2, 16, 16, 16) is not None) == TMA_HERE
    assert tma_descriptors(torch.empty(32, 23, device=DEV), w2, 16, 16, 16) is None, "rows of 92 bytes"
    assert tma_descriptors(h, torch.empty(4, 40, 23, device=DEV), 16, 16, 16) is None
    assert tma_descriptors(h, w2[:, :20], 16, 16, 16) is None, "the experts' rows not stacked"


def test_down_tma_compiles_to_bulk_tensor_copies_for_sm90():
    """For an H100/H200 (no GPU needed): the TMA form's K loop moves its tiles with bulk tensor copies and
    no per-thread async copies, into wgmma as the pointer form does, without spills."""
    script = Path(__file__).with_name("compile_sm90_down_tma.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    pointers, tma = report["pointers"], report["tma"]
    assert pointers["bulk_tensor_copies"] == 0 and pointers["async_copies"] > 0
    assert tma["bulk_tensor_copies"] > 0 and tma["async_copies"] == 0
    assert tma["wgmma"] > 0 and pointers["wgmma"] > 0
    assert tma["spill_store_bytes"] in (0, None)


@pytest.mark.parametrize("weights", ["fp8", "half_tiles"])
def test_down_tma_refuses_quantised_weights_and_half_tiles(weights):
    from kernels.triton_moe.fused import _run
    x, w13, w2, tw, ti = make_inputs(3, 128, 128, 2, 1, torch.float32)
    if weights == "fp8":
        q = torch.zeros_like(w13, dtype=torch.float8_e4m3fn)
        args, kw = (x, q, q[:, :128], tw, ti, None, dict(FP8_CFG, down={"TMA": True})), \
            {"fp8": (torch.ones(2, 2, 1), torch.ones(2, 1, 1))}
    else:
        cfg = dict(SMALL_CFG, BLOCK_SIZE_M=32, down={"TMA": True, "HALF_TILES": True})
        args, kw = (x, w13, w2, tw, ti, None, cfg), {}
    with pytest.raises(ValueError, match="TMA tiles"):
        _run(*args, **kw)


def test_fp8_gate_up_refuses_a_split():
    from kernels.triton_moe.fused import fused_experts_triton_fp8
    x, w13, w2, tw, ti = make_inputs(3, 128, 128, 2, 1, torch.float32)
    q = torch.zeros_like(w13, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cannot split D"):
        fused_experts_triton_fp8(x, q, q[:, :128], torch.ones(2, 2, 1), torch.ones(2, 1, 1), tw, ti,
                                 config=dict(FP8_CFG, SPLIT_K=2))


@needs_triton_device
@pytest.mark.parametrize("down", [{}, {"SPLIT_K": 2}])
@pytest.mark.parametrize("K", [1, 2])
def test_expert_map_with_remote_experts(K, down):
    E_global, E = 8, 3
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[torch.tensor([1, 4, 6])] = torch.arange(E, dtype=torch.int32)
    x, w13, w2, tw, ti = make_inputs(21, 40, 24, E, K, torch.float32, expert_map=emap)
    emap = emap.to(DEV)
    cfg = dict(SMALL_CFG, down=down)
    out = fused_experts_triton(x, w13, w2, tw, ti, emap, config=cfg)
    ref = fused_experts_torch(x, w13, w2, tw, ti, emap)
    assert rel(out, ref) < 1e-5
    # a token routed only to remote experts gets exactly zero
    ti2 = ti.clone()
    ti2[0] = 0  # global expert 0 is not on this rank
    out2 = fused_experts_triton(x, w13, w2, tw, ti2, emap, config=cfg)
    assert torch.all(out2[0] == 0)


@needs_triton_device
def test_seam_dispatches_to_triton():
    if not CUDA:
        pytest.skip("the seam picks triton only for CUDA tensors")
    from kernels import fused_experts
    x, w13, w2, tw, ti = make_inputs(8, 64, 32, 4, 2, torch.bfloat16)
    out = fused_experts(x, w13, w2, tw, ti, backend="triton")
    assert rel(out, fused_experts_torch(x, w13, w2, tw, ti)) < 2e-2


# --- FP8 ------------------------------------------------------------------------------------

FP8_CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
           "num_warps": 4, "num_stages": 1}


def test_block_quant_roundtrip():
    from kernels.reference_fp8 import dequantize_block_fp8, quantize_block_fp8
    w = torch.randn(3, 200, 136)
    q, s = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2, 2)
    assert rel(dequantize_block_fp8(q, s), w) < 4e-2


@needs_triton_device
@pytest.mark.parametrize("T,D,F,E,K,down", [(7, 200, 136, 4, 2, {}), (1, 128, 128, 1, 1, {}),
                                            (7, 200, 136, 4, 2, {"SPLIT_K": 2})])
def test_fp8_matches_dequantised_reference(T, D, F, E, K, down, monkeypatch):
    from kernels import reference_fp8
    from kernels.reference_fp8 import (fused_experts_fp8_actquant_torch, fused_experts_fp8_torch,
                                       quantize_block_fp8)
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, torch.float32, seed=3)
    q13, s13 = quantize_block_fp8(w13.cpu())
    q2, s2 = quantize_block_fp8(w2.cpu())
    q13, s13, q2, s2 = (t.to(DEV) for t in (q13, s13, q2, s2))
    out = fused_experts_triton_fp8(x, q13, q2, s13, s2, tw, ti, config=dict(FP8_CFG, down=down))
    ref = fused_experts_fp8_torch(x, q13, q2, s13, s2, tw, ti)
    if INTERPRET:
        # The interpreter's float32 -> e4m3 cast mis-rounds some values (124.6 -> 64): the
        # activation-quantising oracle casts the same way (tests/kernels/fp8_interpreter_cast.py).
        monkeypatch.setattr(reference_fp8, "_qdq_groups", interpreter_qdq_groups)
    else:
        assert rel(out, ref) < 6e-2
    tight = fused_experts_fp8_actquant_torch(x, q13, q2, s13, s2, tw, ti)
    assert rel(out, tight) < 1e-2


@needs_triton_device
def test_group_quant_kernel():
    from kernels.triton_moe.quant import per_token_group_quant_fp8, per_token_group_quant_torch
    x = torch.randn(5, 200, device=DEV)
    q, s = per_token_group_quant_fp8(x)
    rq, rs = per_token_group_quant_torch(x)
    assert torch.allclose(s, rs)
    if INTERPRET:  # the interpreter's own cast (see fp8_interpreter_cast.py), bit for bit
        xp = torch.nn.functional.pad(x, (0, 56)).view(5, 2, 128)  # groups of 128, the last padded
        rq = interpreter_e4m3((xp / s[..., None]).clamp(-448, 448)).view(5, 256)[:, :200]
    assert torch.equal(q.float(), rq.float())


@pytest.mark.skipif(not INTERPRET, reason="checks the oracle of the interpreter's cast")
def test_interpreter_e4m3_oracle_is_the_interpreters_cast():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float8e4nv), mask=mask)

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1024, generator=g) * sc for sc in (1e-3, 1e-2, 0.1, 1, 10, 100)]).clamp(-448, 448)
    y = torch.full(x.shape, float("nan")).to(torch.float8_e4m3fn)
    cast_kernel[(1,)](x, y, x.numel(), BLOCK=8192)
    assert torch.equal(y.float(), interpreter_e4m3(x).float())
    # ... and it is not torch's cast (if a Triton release fixes the interpreter, drop the oracle)
    assert not torch.equal(y.float(), x.to(torch.float8_e4m3fn).float())


# --- configs ----------------------------------------------------------------------------------

def test_config_nearest_bucket_and_default(tmp_path, monkeypatch, caplog):
    name = cfgmod.config_file_name(4, 24, "Fake_GPU", "bf16")
    assert name == "E=4,N=24,device_name=Fake_GPU,dtype=bf16.json"
    assert cfgmod.config_file_name(4, 24, "X", "fp8_w8a8", (128, 128)).endswith(
        "dtype=fp8_w8a8,block_shape=[128,128].json")
    c1 = dict(SMALL_CFG, BLOCK_SIZE_M=16)
    c2 = dict(SMALL_CFG, BLOCK_SIZE_M=64, down={"BLOCK_SIZE_N": 32})
    (tmp_path / name).write_text(json.dumps({"1": c1, "256": c2}))
    monkeypatch.setenv("MOE_KERNEL_CONFIG_DIR", str(tmp_path))
    cfgmod.load_configs.cache_clear()
    assert cfgmod.get_config(3, 4, 24, 2, torch.bfloat16, device="Fake_GPU") == c1
    assert cfgmod.get_config(200, 4, 24, 2, torch.bfloat16, device="Fake_GPU") == c2
    assert cfgmod.get_config(10 ** 6, 4, 24, 2, "bf16", device="Fake_GPU") == c2
    up, down = cfgmod.split_config(c2)
    assert down["BLOCK_SIZE_N"] == 32 and down["BLOCK_SIZE_M"] == 64 and up["BLOCK_SIZE_N"] == 16
    with caplog.at_level("WARNING"):
        d = cfgmod.get_config(8, 5, 24, 2, torch.bfloat16, device="Other_GPU")
        cfgmod.get_config(8, 5, 24, 2, torch.bfloat16, device="Other_GPU")
    assert set(cfgmod.CONFIG_KEYS) <= set(d)
    warned = [r for r in caplog.records if "E=5,N=24,device_name=Other_GPU" in r.getMessage()]
    assert len(warned) == 1, "one log line naming the file that would help"
    cfgmod.load_configs.cache_clear()


def test_tuner_candidates():
    from kernels.triton_moe.tune import _candidates
    narrow, wide = _candidates(16, False, False), _candidates(16, False, False, wide=True)
    assert narrow == wide[:len(narrow)] and len(wide) > len(narrow)
    assert not any("SPLIT_K" in c for c in narrow)
    assert {c.get("SPLIT_K") for c in wide} == {None, 1, 2, 4}
    up = _candidates(16, True, False, wide=True)
    assert {c.get("SPLIT_K") for c in up} == {None, 2, 4, 8} and not any("ATOMIC_SUM" in c for c in up)
    assert not any("SPLIT_K" in c for c in _candidates(16, True, False) + _candidates(16, True, True, wide=True)
                   + _candidates(32, True, False, wide=True)), "gate_up splits decode tiles only, not FP8's"
    fp8 = _candidates(16, True, True, wide=True)
    assert all(c["BLOCK_SIZE_K"] == 128 and c["BLOCK_SIZE_N"] == 128 for c in fp8)
    for bm in (16, 32, 64, 128):  # half tiles from BLOCK_M 64, in the wide search only
        for gate_up in (True, False):
            halves = [c for c in _candidates(bm, gate_up, False, wide=True) if c.get("HALF_TILES")]
            assert bool(halves) == (bm >= 64) and not any("HALF_TILES" in c for c in _candidates(bm, gate_up, False))
            tiles = [{k: v for k, v in c.items() if k != "HALF_TILES"} for c in halves]
            assert all(t in _candidates(bm, gate_up, False, wide=True) for t in tiles), "a variant of a searched tile"


def test_tuner_tries_tma_down_tiles_on_hopper_wide_search_only():
    from kernels.triton_moe.tune import _TMA_VARIANTS, _candidates
    for bm in (16, 32, 64, 128):
        tma = [c for c in _candidates(bm, False, False, wide=True, tma=True) if c.get("TMA")]
        assert len(tma) == (_TMA_VARIANTS if bm >= 64 else 0)
        plain = _candidates(bm, False, False, wide=True)
        assert [{k: v for k, v in c.items() if k != "TMA"} for c in tma] == plain[:len(tma)]
        assert not any(c.get("TMA") and c.get("HALF_TILES") for c in _candidates(bm, False, False, True, tma=True))
        assert not any(c.get("TMA") for c in plain + _candidates(bm, True, False, wide=True, tma=True)
                       + _candidates(bm, False, True, wide=True, tma=True)
                       + _candidates(bm, False, False, wide=True, mxfp4=True, tma=True)
                       + _candidates(bm, False, False, tma=True)), "down, 16-bit, wide search only"


def test_tuner_tries_swap_ab_first_on_mxfp4_decode_tiles():
    from kernels.triton_moe.tune import _candidates
    for gate_up in (True, False):
        swapped = [c for c in _candidates(16, gate_up, False, mxfp4=True) if c.get("SWAP_AB")]
        plain = _candidates(16, gate_up, False)
        assert swapped and _candidates(16, gate_up, False, mxfp4=True)[:len(swapped)] == swapped
        assert [{k: v for k, v in c.items() if k != "SWAP_AB"} for c in swapped] == plain[:len(swapped)]
        assert not any(c.get("SWAP_AB") for c in plain + _candidates(64, gate_up, False, mxfp4=True))


def test_tuner_composes_what_split_config_splits():
    from kernels.triton_moe.tune import compose
    up = dict(SMALL_CFG, BLOCK_SIZE_M=64, HALF_TILES=True)
    for down in (dict(SMALL_CFG, BLOCK_SIZE_M=64, BLOCK_SIZE_N=32), dict(up, SPLIT_K=2)):
        assert cfgmod.split_config(compose(up, down)) == (up, dict(down, HALF_TILES=down.get("HALF_TILES", False)))
    # gate_up's own split stays with gate_up, whatever the down GEMM's
    for down in (dict(SMALL_CFG), dict(SMALL_CFG, SPLIT_K=4, ATOMIC_SUM=True)):
        assert cfgmod.split_config(compose(dict(SMALL_CFG, SPLIT_K=2), down)) == (dict(SMALL_CFG, SPLIT_K=2), down)
    plain = dict(SMALL_CFG, BLOCK_SIZE_M=64)
    assert cfgmod.split_config(compose(plain, dict(plain, HALF_TILES=True))) == (plain, dict(plain, HALF_TILES=True))
    swap = dict(SMALL_CFG, SWAP_AB=True)
    for down in (dict(SMALL_CFG), dict(swap)):  # SWAP_AB in gate_up alone, or in both
        assert cfgmod.split_config(compose(swap, down)) == (swap, dict(down, SWAP_AB=down.get("SWAP_AB", False)))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_tuner_writes_merged_file(tmp_path, monkeypatch):
    from kernels.triton_moe.tune import tune
    name = cfgmod.config_file_name(4, 32, cfgmod.device_name(), "bf16")
    (tmp_path / name).write_text(json.dumps({"512": SMALL_CFG}))
    monkeypatch.setenv("MOE_KERNEL_CONFIG_DIR", str(tmp_path))
    cfgmod.load_configs.cache_clear()
    tune(4, 64, 32, 2, [8], "bf16", budget_s=5, out_dir=tmp_path, report=tmp_path / "report.json")
    got = json.loads((tmp_path / name).read_text())
    assert set(got) == {"8", "512"} and got["512"] == SMALL_CFG
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [r["M"] for r in rows] == [8] and rows[0]["config"] == got["8"]
    assert rows[0]["tuned_us"] > 0 and rows[0]["default_us"] > 0 and rows[0]["prior_us"] > 0
    cfgmod.load_configs.cache_clear()


def test_tuner_reports_the_config_in_use_and_keeps_it_when_nothing_beats_it(tmp_path, monkeypatch):
    """The report times the file in use (prior_us, speedup_over_prior) beside the default; a prior no
    searched candidate beats stays (fake timings: every config but the prior takes 2 ms)."""
    import kernels.triton_moe.tune as tune
    prior = dict(cfgmod.default_config(512, 4, 32, 2, "bf16"), num_stages=5)  # not a searched candidate
    monkeypatch.setattr(tune, "make_problem", lambda E, D, F, K, M, dtype, **kw: (None,) * 5)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(tune, "_time_split", lambda up, down, problems, quant_w:
                        1.0 if tune.compose(up, down) == tune.compose(*cfgmod.split_config(prior)) else 2.0)
    name = cfgmod.config_file_name(4, 32, cfgmod.device_name(), "bf16")
    (tmp_path / name).write_text(json.dumps({"512": prior}))
    monkeypatch.setenv("MOE_KERNEL_CONFIG_DIR", str(tmp_path))
    cfgmod.load_configs.cache_clear()
    try:
        tune.tune(4, 64, 32, 2, [512], "bf16", budget_s=5, out_dir=tmp_path, report=tmp_path / "report.json")
    finally:
        cfgmod.load_configs.cache_clear()
    row, = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert row["prior_us"] == row["tuned_us"] == 1e3 and row["speedup_over_prior"] == 1.0
    assert row["default_us"] == 2e3 and row["speedup"] == 2.0
    assert json.loads((tmp_path / name).read_text())["512"] == tune.compose(*cfgmod.split_config(prior))


def test_tuner_times_quantised_weights_in_their_form(monkeypatch):
    """The tuner's timed calls pass FP8 / MXFP4 weights with their scales under the right keyword
    (an MXFP4 problem timed as 16-bit weights would tune the wrong kernels)."""
    import kernels.triton_moe.tune as tune
    calls = []
    monkeypatch.setattr(tune, "_run", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(tune, "time_calls", lambda fns, reps: [f() for f in fns] and 1.0)
    x, tw, ti = torch.zeros(2, 64), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    q13, q2, s13, s2 = (torch.zeros(1, dtype=torch.uint8) for _ in range(4))
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32}
    for kind in ("mxfp4", "fp8"):
        calls.clear()
        assert tune._time_split(cfg, cfg, [(x, None, None, tw, ti)], (kind, (q13, q2), (s13, s2))) == 1.0
        (args, kw), = calls
        assert args[1] is q13 and args[2] is q2 and kw == {kind: (s13, s2)}
        assert args[6]["down"] == {"BLOCK_SIZE_N": 32}


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_tuner_mxfp4_file(tmp_path):
    from kernels.triton_moe.tune import tune
    tune(4, 64, 64, 2, [8], "mxfp4", budget_s=5, out_dir=tmp_path, report=tmp_path / "report.json")
    got = json.loads((tmp_path / cfgmod.config_file_name(4, 64, cfgmod.device_name(), "mxfp4")).read_text())
    assert set(got) == {"8"} and got["8"]["BLOCK_SIZE_K"] % 32 == 0
    cfgmod.load_configs.cache_clear()


def test_shipped_configs_are_valid():
    files = sorted(cfgmod.CONFIG_DIR.glob("*.json"))
    for f in files:
        for m, c in json.loads(f.read_text()).items():
            assert int(m) > 0 and set(cfgmod.CONFIG_KEYS) <= set(c), f.name


# --- GPU, real shapes -------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("E,D,F,K", [(128, 2048, 768, 8), (16, 5120, 8192, 1),
                                     (128, 2048, 384, 8), (64, 2048, 768, 8)])  # + Qwen3's TP=2 / EP=2 files
@pytest.mark.parametrize("T", [1, 64, 1000, 4096])
def test_real_shapes_gpu(E, D, F, K, T):
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, torch.bfloat16, seed=T)
    out = fused_experts_triton(x, w13, w2, tw, ti)
    assert rel(out, fused_experts_torch(x, w13, w2, tw, ti)) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("E,D,F,K,split", [(128, 2048, 768, 8, 2), (16, 5120, 8192, 1, 4)])
@pytest.mark.parametrize("T", [1, 8, 64, 300])
def test_real_shapes_split_k_gpu(E, D, F, K, split, T):
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, torch.bfloat16, seed=T + 1)
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
           "num_warps": 4, "num_stages": 3, "down": {"SPLIT_K": split}}
    out = fused_experts_triton(x, w13, w2, tw, ti, config=cfg)
    assert rel(out, fused_experts_torch(x, w13, w2, tw, ti)) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("E,D,F,K", [(128, 2048, 768, 8), (16, 5120, 8192, 1)])
@pytest.mark.parametrize("T", [64, 1000, 4096])
def test_real_shapes_down_tma_gpu(E, D, F, K, T):
    x, w13, w2, tw, ti = make_inputs(T, D, F, E, K, torch.bfloat16, seed=T + 2)
    cfg = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": 4,
           "num_stages": 3, "down": {"BLOCK_SIZE_N": 128, "TMA": True}}
    out = fused_experts_triton(x, w13, w2, tw, ti, config=cfg)
    assert rel(out, fused_experts_torch(x, w13, w2, tw, ti)) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("down", [{}, {"SPLIT_K": 2}, {"TMA": True}])
def test_cuda_graph_capture_gpu(down):
    x, w13, w2, tw, ti = make_inputs(33, 256, 128, 8, 2, torch.bfloat16)
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
           "num_warps": 4, "num_stages": 3, "down": down}
    ref = fused_experts_triton(x, w13, w2, tw, ti, config=cfg)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_experts_triton(x, w13, w2, tw, ti, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_experts_triton(x, w13, w2, tw, ti, config=cfg)
    ti.copy_(ti.flip(0))  # new routing, same shapes: the replay must follow the data
    tw.copy_(tw.flip(0))
    g.replay()
    torch.cuda.synchronize()
    assert rel(out, fused_experts_torch(x, w13, w2, tw, ti)) < 2e-2
    assert not torch.equal(out, ref)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 200, 3000])
def test_alignment_large_path_gpu(T):
    ids = torch.randint(0, 256, (T, 8), device="cuda", dtype=torch.int32)
    check_alignment(ids, 256, 64, None, "auto")
