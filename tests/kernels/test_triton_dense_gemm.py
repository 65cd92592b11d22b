"""The tiled Triton GEMM of the decode projections (dense_linear) against torch.

Legend: M rows of x, N output features, K input features.

Every element is held to the fp32-accumulation bound of test_triton_skinny.py (the kernel sums
in another order than torch, so halves may round differently from F.linear). Without a GPU the
kernel runs under TRITON_INTERPRET=1 on small awkward shapes (row and column blocks cut short,
split-K parts short or empty); real shapes and CUDA graph capture need a GPU. Outputs and
workspaces come from a NaN-poisoned torch.empty, so an element never written shows.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.triton_fused.dense_gemm import DenseConfig, dense_config, dense_linear  # noqa: E402

from tests.kernels.test_triton_skinny import assert_linear_close, randn  # noqa: E402
from tests.kernels.triton_marks import DEV, needs_cuda, needs_triton_device  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

DENSE_CASES = [  # M, N, K, config (None: dense_config's)
    (5, 50, 200, None),
    (17, 37, 300, DenseConfig(16, 16, 64)),  # M, N and K all cut short; 5 K steps
    (40, 48, 256, DenseConfig(32, 32, 32, split_k=2)),  # split-K dividing K evenly
    (33, 24, 100, DenseConfig(16, 16, 32, split_k=3)),  # three parts, the last one partial
    (20, 20, 130, DenseConfig(16, 16, 32, split_k=8)),  # more parts than K needs: some empty
    (64, 64, 96, DenseConfig(64, 32, 32, num_warps=8, num_stages=3)),
]


@needs_triton_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", range(len(DENSE_CASES)))
def test_dense_linear(dtype, bias, case, poisoned_empty):
    M, N, K, cfg = DENSE_CASES[case]
    strided = case % 2 == 1
    wide = randn(M, K + 24, dtype=dtype, seed=case)
    x = wide[:, 8:8 + K] if strided else wide[:, :K].contiguous()  # strided: rows K + 24 apart
    w = randn(N, K, dtype=dtype, seed=100 + case)
    b = randn(N, dtype=dtype, seed=200 + case) if bias else None
    assert_linear_close(dense_linear(x, w, b, config=cfg), x, w, b)


@needs_triton_device
def test_dense_linear_exact_small_integers_and_strided_weight(poisoned_empty):
    """W a row slice of a wider matrix; with small integers every fp32 sum is exact, so the result
    equals the integer product whatever the order or the split."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (24, 96), generator=g).to(torch.bfloat16).to(DEV)
    w_wide = torch.randint(-4, 5, (40, 128), generator=g).to(torch.bfloat16).to(DEV)
    w = w_wide[:, 16:112]
    for cfg in (None, DenseConfig(16, 16, 32, split_k=3), DenseConfig(32, 64, 16)):
        assert torch.equal(dense_linear(x, w, config=cfg), (x.double() @ w.double().T).to(torch.bfloat16))


def test_dense_config_heuristic():
    for M in (3, 8, 32, 64, 100, 256, 512):
        for N, K in ((5120, 2048), (2048, 4096), (2560, 2048), (2048, 2048), (50, 7)):
            cfg = dense_config(M, N, K)
            for v in (cfg.block_m, cfg.block_n, cfg.block_k):
                assert v >= 16 and v & (v - 1) == 0
            assert cfg.split_k >= 1
            tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
            if cfg.split_k > 1:  # split only to fill the SMs, never into single K steps
                assert tiles * cfg.split_k // 2 < 2 * 132
                assert triton.cdiv(K, cfg.block_k) >= 2 * cfg.split_k


def test_dense_linear_bad_inputs():
    x, w = torch.randn(20, 8), torch.randn(4, 8)
    with pytest.raises(TypeError, match="one dtype"):
        dense_linear(x, w.half())
    with pytest.raises(ValueError, match=r"w must be \[N, 8\]"):
        dense_linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        dense_linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        dense_linear(x, torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="power of two"):
        dense_linear(x, w, config=DenseConfig(24, 16, 16))


# --- GPU: real shapes and CUDA graphs -------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("M", [8, 32, 100, 256])
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096), (2560, 2048), (2048, 2048)])
def test_dense_linear_real_shapes(M, N, K, poisoned_empty):
    x = randn(M, K, dtype=torch.bfloat16, seed=M)
    w = randn(N, K, dtype=torch.bfloat16, seed=N + K) * 0.05
    b = randn(N, dtype=torch.bfloat16, seed=7)
    assert_linear_close(dense_linear(x, w), x, w)
    assert_linear_close(dense_linear(x, w, b), x, w, b)
    for split in (1, 4):  # split-K forced on and off around the heuristic's choice
        assert_linear_close(dense_linear(x, w, config=dense_config(M, N, K)._replace(split_k=split)), x, w)


@needs_cuda
@pytest.mark.parametrize("M", [16, 256])
def test_dense_linear_cuda_graph(M):
    """Capture once, replay with new inputs copied into the static buffer."""
    N, K = 2048, 4096
    w = randn(N, K, dtype=torch.bfloat16, seed=N) * 0.05
    x_static = randn(M, K, dtype=torch.bfloat16, seed=2)
    for cfg in (None, dense_config(M, N, K)._replace(split_k=4)):
        dense_linear(x_static, w, config=cfg)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = dense_linear(x_static, w, config=cfg)
        for seed in (3, 4):
            x_new = randn(M, K, dtype=torch.bfloat16, seed=seed)
            x_static.copy_(x_new)
            y_static.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert_linear_close(y_static.clone(), x_new, w)
