"""Programmatic dependent launch (kernels/pdl.py): when it is on, and that a chain of PDL kernels
sees every write of the kernel before it, eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.pdl import pdl_enabled, pdl_launch  # noqa: E402
from kernels.triton_fused.rms_norm import rms_norm_triton  # noqa: E402
from kernels.triton_fused.skinny_gemm import skinny_linear  # noqa: E402

from tests.kernels.triton_marks import CUDA  # noqa: E402

HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


def test_pdl_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    assert pdl_launch(torch.zeros(1)) == {"USE_PDL": False}
    if CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl_enabled(torch.zeros(1, device="cuda"))


@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9 or later")
def test_pdl_switch(monkeypatch):
    x = torch.zeros(1, device="cuda")
    assert pdl_launch(x) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv("MOE_PDL", "0")
    assert pdl_launch(x) == {"USE_PDL": False}


def _chain(x, w_norm, w_big, layers):
    """A decode-like chain of dependent launches: a big skinny GEMM (many programs, a long tail)
    feeding a norm with the residual, feeding the next GEMM."""
    residual = x
    for _ in range(layers):
        y = skinny_linear(x, w_big)
        x, residual = rms_norm_triton(y, w_norm, 1e-6, residual)
    return x, residual


@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9 or later")
def test_pdl_chain_equals_the_serialised_one_eager_and_in_a_graph(monkeypatch):
    g = torch.Generator().manual_seed(0)
    D, layers = 4096, 40
    w_big = (torch.randn(D, D, generator=g) * D ** -0.5).to(torch.bfloat16).cuda()
    w_norm = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).cuda()
    x = torch.randn(1, D, generator=g).to(torch.bfloat16).cuda()
    monkeypatch.setenv("MOE_PDL", "0")
    want = _chain(x, w_norm, w_big, layers)
    monkeypatch.setenv("MOE_PDL", "1")
    for _ in range(3):
        got = _chain(x, w_norm, w_big, layers)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _chain(x, w_norm, w_big, layers)
    for _ in range(5):
        for t in static:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(static, want))
