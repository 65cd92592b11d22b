"""Skinny GEMM (skinny_linear, M <= 16) and the MoE top-k combine (moe_sum) against torch.

Legend: M rows of x, N output features, K input features (for moe_sum: T tokens, K experts
per token, D hidden).

References: F.linear and `.sum(dim=1)`, plus an exact fp64 product for an error bound. The
kernel sums K products in fp32 in another order than torch, so halves may round differently
from F.linear; instead every element is held to a bound it must meet whatever the order:
    |y - exact| <= acc_err + half an ulp of y's dtype at |exact| + acc_err,
    acc_err = (K + 1) * u * (sum_k |x_k w_k| + |bias|)      (fp32 summation, u = 2^-24)
with u doubled on a GPU (tensor-core accumulation need not round to nearest). fp32 outputs are
not rounded again, so they are held to acc_err alone. Without a GPU the kernels run under
TRITON_INTERPRET=1 (tests/kernels/conftest.py) on small awkward shapes; real shapes and CUDA
graph capture need a GPU. Outputs and workspaces come from a NaN-poisoned torch.empty, so an
element never written shows.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kernels.triton_fused.moe_sum import moe_sum  # noqa: E402
from kernels.triton_fused.skinny_gemm import SkinnyConfig, skinny_config, skinny_linear  # noqa: E402

from tests.kernels.triton_marks import CUDA, DEV, needs_triton_device, needs_cuda  # noqa: E402
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MANTISSA_BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}
SMALLEST_ULP = {torch.float32: 2.0 ** -149, torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24}


def randn(*shape, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def half_ulp(v, dtype):
    """Half a unit in the last place of `dtype` at magnitude v (fp64 tensor)."""
    _, e = torch.frexp(v.abs())  # v = m * 2^e, 0.5 <= m < 1: the ulp is 2^(e - p)
    ulp = torch.ldexp(torch.ones_like(v), e - MANTISSA_BITS[dtype]).clamp_min(SMALLEST_ULP[dtype])
    return 0.5 * ulp


def assert_linear_close(y, x, w, bias=None):
    """y meets the fp32-accumulation bound of the module docstring, and F.linear is as close."""
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype, (y.shape, y.dtype)
    assert y.is_contiguous()
    assert not y.isnan().any(), "unwritten (poisoned) or NaN elements"
    xd, wd = x.double(), w.double()
    exact = xd @ wd.T
    magnitude = xd.abs() @ wd.abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    u = 2.0 ** -24 * (2 if CUDA else 1)
    acc_err = (x.shape[1] + 1) * u * magnitude
    bound = acc_err if y.dtype == torch.float32 else acc_err + half_ulp(exact.abs() + acc_err, y.dtype)
    err = (y.double() - exact).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements out of bound; worst at {worst}: " \
                                 f"err {err.flatten()[worst].item():.3e} > bound {bound.flatten()[worst].item():.3e}"
    ref = F.linear(x, w, bias)  # torch's own rounding meets the same bound, so the two are 2 bounds apart
    assert ((y.double() - ref.double()).abs() <= 2 * bound).all()


# --- skinny_linear on small awkward shapes --------------------------------------------------

SKINNY_CASES = [  # M, N, K, config (None: skinny_config's)
    (1, 50, 200, None),
    (1, 37, 300, SkinnyConfig(8, 64)),  # N % BLOCK_N, K % BLOCK_K, 5 steps
    (2, 40, 320, SkinnyConfig(8, 64, split_k=2)),  # split-K, last part short
    (3, 24, 256, SkinnyConfig(4, 32, split_k=4)),  # M padded to 4 rows; split-K dividing K evenly
    (4, 33, 100, SkinnyConfig(16, 32, split_k=3)),  # three parts, the last one partial
    (5, 30, 96, SkinnyConfig(8, 32)),  # rows mode for more than 4 rows
    (8, 40, 200, SkinnyConfig(16, 64, use_dot=True)),
    (8, 48, 256, SkinnyConfig(16, 32, split_k=2, use_dot=True)),
    (16, 20, 130, SkinnyConfig(16, 32, split_k=3, use_dot=True)),
    (16, 64, 128, None),
]


@needs_triton_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", range(len(SKINNY_CASES)))
def test_skinny_linear(dtype, bias, case, poisoned_empty):
    M, N, K, cfg = SKINNY_CASES[case]
    strided = case % 2 == 1
    wide = randn(M, K + 24, dtype=dtype, seed=case)
    x = wide[:, 8:8 + K] if strided else wide[:, :K].contiguous()  # strided: rows K + 24 apart
    w = randn(N, K, dtype=dtype, seed=100 + case)
    b = randn(N, dtype=dtype, seed=200 + case) if bias else None
    assert_linear_close(skinny_linear(x, w, b, config=cfg), x, w, b)


@needs_triton_device
def test_skinny_linear_strided_weight_rows_and_exact_small_integers(poisoned_empty):
    """W a row slice of a wider matrix (the kernel takes its row stride); with small integers
    every fp32 sum is exact, so the result must equal the integer product in any order."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (3, 96), generator=g).to(torch.bfloat16).to(DEV)
    w_wide = torch.randint(-4, 5, (24, 128), generator=g).to(torch.bfloat16).to(DEV)
    w = w_wide[:, 16:112]
    for cfg in (None, SkinnyConfig(8, 32, split_k=3), SkinnyConfig(16, 32, use_dot=True)):
        y = skinny_linear(x, w, config=cfg)
        assert torch.equal(y, (x.double() @ w.double().T).to(torch.bfloat16))


def test_skinny_config_heuristic():
    for M in (1, 2, 4, 8, 16):
        for N, K in ((5120, 2048), (2048, 4096), (128, 2048), (1536, 2048), (50, 7)):
            cfg = skinny_config(M, N, K)
            assert cfg.use_dot == (M > 4)
            for v in (cfg.block_n, cfg.block_k, cfg.num_warps):
                assert v & (v - 1) == 0
            assert cfg.block_k <= max(16, triton.next_power_of_2(K))
            if cfg.use_dot:
                assert cfg.block_n >= 16 and cfg.block_k >= 16
            assert 1 <= cfg.split_k <= max(1, triton.cdiv(K, cfg.block_k))
    # M = 1 at Qwen3-30B-A3B shapes: single-step programs, no split-K launch needed
    assert skinny_config(1, 5120, 2048) == SkinnyConfig(2, 2048, 1, 4, False, 3)
    assert skinny_config(16, 2048, 4096).split_k > 1  # 128 column blocks alone would leave SMs idle
    with pytest.raises(ValueError, match="1..16 rows"):
        skinny_config(17, 128, 128)


def test_skinny_linear_bad_inputs():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_linear(torch.randn(17, 8), w)
    with pytest.raises(TypeError, match="one dtype"):
        skinny_linear(x, w.half())
    with pytest.raises(TypeError, match="one dtype"):
        skinny_linear(x, w, torch.randn(4).half())
    with pytest.raises(ValueError, match=r"w must be \[N, 8\]"):
        skinny_linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        skinny_linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        skinny_linear(x[None], w)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        skinny_linear(x, torch.randn(8, 4).t())
    with pytest.raises(TypeError, match="x must be"):
        skinny_linear(x.long(), w.long())
    with pytest.raises(ValueError, match="power of two"):
        skinny_linear(x, w, config=SkinnyConfig(6, 32))
    with pytest.raises(ValueError, match="dot mode"):
        skinny_linear(x, w, config=SkinnyConfig(8, 32, use_dot=True))


# --- moe_sum --------------------------------------------------------------------------------

def assert_moe_sum(out, y):
    """Halves: torch sums in fp32 and rounds once, and so does the kernel. The fp32 sum of K <= 8
    values with 8 (bf16) or 11 (fp16) significant bits is exact unless their magnitudes span more
    than ~10 binades, so the order cannot matter and the results must be equal. fp32: the order
    matters; held to the summation bound K * u * sum|y|."""
    ref = y.sum(dim=1)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements"
    if y.dtype == torch.float32:
        bound = y.shape[1] * 2.0 ** -24 * y.double().abs().sum(dim=1)
        assert ((out.double() - y.double().sum(dim=1)).abs() <= bound).all()
    else:
        assert torch.equal(out, ref)


@needs_triton_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,D", [(1, 8, 300), (5, 2, 77), (5, 1, 300), (1, 2, 1030), (5, 8, 77)])
@pytest.mark.parametrize("strided", [False, True])
def test_moe_sum(dtype, T, K, D, strided, poisoned_empty):
    if strided:  # [T, K, D] out of a wider buffer with K outermost: neither T nor K stride is D
        y = (3 * randn(K, T, D + 5, dtype=dtype, seed=T * K + D)).permute(1, 0, 2)[:, :, 2:2 + D]
        assert y.stride() == (D + 5, T * (D + 5), 1)
    else:
        y = (3 * randn(T * K, D, dtype=dtype, seed=T * K + D)).view(T, K, D)  # as the experts return it
    assert_moe_sum(moe_sum(y), y)


def test_moe_sum_bad_inputs():
    with pytest.raises(ValueError, match=r"\[T, K, D\]"):
        moe_sum(torch.randn(4, 8))
    with pytest.raises(TypeError, match="y must be"):
        moe_sum(torch.ones(1, 2, 3, dtype=torch.int32))


# --- GPU: real shapes and CUDA graphs -------------------------------------------------------

REAL_NK = [(5120, 2048), (2048, 4096), (128, 2048), (768 * 2, 2048)]


@needs_cuda
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N,K", REAL_NK)
def test_skinny_linear_real_shapes(M, N, K, poisoned_empty):
    x = randn(M, K, dtype=torch.bfloat16, seed=M)
    w = randn(N, K, dtype=torch.bfloat16, seed=N + K) * 0.05
    b = randn(N, dtype=torch.bfloat16, seed=7)
    assert_linear_close(skinny_linear(x, w), x, w)
    assert_linear_close(skinny_linear(x, w, b), x, w, b)
    for split in (1, 4):  # split-K forced on and off around the heuristic's choice
        cfg = skinny_config(M, N, K)._replace(split_k=split)
        assert_linear_close(skinny_linear(x, w, config=cfg), x, w)


@needs_cuda
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N,K", [(2048, 4096), (128, 2048)])
def test_skinny_linear_cuda_graph(M, N, K):
    """Capture once, replay with new inputs copied into the static buffer."""
    w = randn(N, K, dtype=torch.bfloat16, seed=N) * 0.05
    b = randn(N, dtype=torch.bfloat16, seed=1)
    x_static = randn(M, K, dtype=torch.bfloat16, seed=2)
    for cfg in (None, skinny_config(M, N, K)._replace(split_k=4)):
        skinny_linear(x_static, w, b, config=cfg)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = skinny_linear(x_static, w, b, config=cfg)
        for seed in (3, 4):
            x_new = randn(M, K, dtype=torch.bfloat16, seed=seed)
            x_static.copy_(x_new)
            y_static.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert_linear_close(y_static.clone(), x_new, w, b)


@needs_cuda
@pytest.mark.parametrize("T", [1, 8, 256])
def test_moe_sum_real_shapes_and_graph(T, poisoned_empty):
    K, D = 8, 2048
    y_static = randn(T * K, D, dtype=torch.bfloat16, seed=T).view(T, K, D)
    assert_moe_sum(moe_sum(y_static), y_static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = moe_sum(y_static)
    y_new = randn(T * K, D, dtype=torch.bfloat16, seed=T + 1).view(T, K, D)
    y_static.copy_(y_new)
    out_static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_moe_sum(out_static.clone(), y_new)


# --- the benchmark's smoke mode -------------------------------------------------------------

@needs_triton_device
def test_bench_skinny_smoke(tmp_path):
    """benchmarks/bench_skinny.py end to end on tiny shapes (interpreter on the CPU, or the GPU)."""
    import json

    from benchmarks import bench_skinny

    out = tmp_path / "skinny.json"
    bench_skinny.main(["--device", DEV, "--tiny", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["linear"] and result["moe_sum"]
    for row in result["linear"]:
        assert row["max_abs_diff"] <= row["tolerance"]
        assert row["best_config"] is not None
