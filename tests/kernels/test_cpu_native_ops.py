"""The native RMSNorm and RoPE (kernels/cpu_native/norm_rope.c through kernels/cpu_native/ops.py)
against their torch twins (models/layers/norm.py, models/layers/rotary.py with the native path off):
strided rows and heads, the residual add, NeoX and interleaved layouts, partial rotary dims, the
q/k norm; and None (the torch path) where they do not serve."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.cpu_native import ops
from models.config import RopeConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the native kernels did not build")


@pytest.fixture
def torch_twin(monkeypatch):
    """Runs a callable with the native kernels switched off (the torch composition)."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(ops.cpu_native, "library", lambda: None)
            return fn(*args)
    return run


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T,D", [(1, 8), (5, 37), (300, 256)])  # the last: the parallel loop
def test_rms_norm(T, D, torch_twin):
    norm = RMSNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * randn(D, seed=1))
    wide = randn(T, D + 6, seed=2)
    x, res = wide[:, 3:3 + D], randn(T, D, seed=3)  # x's rows D + 6 apart
    res_before = res.clone()
    for args in ((x,), (x, res)):
        got, want = norm(*args), torch_twin(norm, *args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-6)
    assert torch.equal(res, res_before), "the residual passed in is not written"
    assert ops.rms_norm(x, norm.weight, 1e-5) is not None


@pytest.mark.parametrize("neox,rotary_dim", [(True, 32), (False, 32), (True, 16), (False, 24)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope(neox, rotary_dim, qk_norm, torch_twin):
    T, H, G, d = 70, 8, 2, 32
    rope = RotaryEmbedding(d, 4096, RopeConfig(theta=1e4), rotary_dim, neox)
    qkv = randn(T, (H + 2 * G) * d, seed=4)
    q, k, _ = qkv.split([H * d, G * d, G * d], -1)
    q, k = q.view(T, H, d), k.view(T, G, d)  # strided views, as attention gets them
    positions = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(5))
    if qk_norm:
        q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        with torch.no_grad():
            q_norm.weight.copy_(1 + 0.3 * randn(d, seed=6))
            k_norm.weight.copy_(1 + 0.3 * randn(d, seed=7))
        got = rope.forward_with_qk_norm(positions, q, k, q_norm, k_norm)
        want = torch_twin(rope.forward_with_qk_norm, positions, q, k, q_norm, k_norm)
    else:
        got, want = rope(positions, q, k), torch_twin(rope, positions, q, k)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-6)


def test_declines_what_it_does_not_take():
    w = torch.ones(8)
    assert ops.rms_norm(torch.randn(3, 8).bfloat16(), w.bfloat16(), 1e-6) is None  # fp32 only
    assert ops.rms_norm(torch.randn(2, 3, 8), w, 1e-6) is None  # [T, D] only
    assert ops.rms_norm(torch.randn(3, 8), torch.ones(7), 1e-6) is None  # weight of another width
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    cos, sin = torch.randn(16, 4), torch.randn(16, 4)
    pos = torch.arange(4)
    assert ops.rope(pos, q.double(), k.double(), cos, sin, 8, True) is None
    assert ops.rope(pos, q, k, cos, sin, 8, True, q_weight=torch.ones(8)) is None  # both norms or neither
    assert ops.rope(pos, q, k, cos, sin, 8, True) is not None
