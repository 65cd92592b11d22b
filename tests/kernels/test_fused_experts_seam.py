"""The `kernels.fused_experts` seam in FP8 mode: torch backend = dequantise like the load-time
path, then the reference (exactly); the Triton FP8 kernel through the seam (CUDA only); the
shape and dtype checks.

Legend: T tokens, D hidden, E experts, F expert intermediate, K top-k.
"""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference_fp8 import fused_experts_fp8_actquant_torch, quantize_block_fp8
from models.fp8 import dequantize_fp8_block
from routing import make_expert_map

FP8 = torch.float8_e4m3fn


def _inputs(T, D, F, E, K, dtype=torch.float32, seed=0, n_ids=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g).to(dtype)
    w13_EFD = torch.randn(E, 2 * F, D, generator=g) * D ** -0.5
    w2_EDF = torch.randn(E, D, F, generator=g) * F ** -0.5
    logits = torch.randn(T, n_ids or E, generator=g)
    logits[:, 0] = -1e9  # expert 0 gets no token
    w_TK, ids_TK = torch.softmax(logits, -1).topk(K, dim=-1)
    q13, s13 = quantize_block_fp8(w13_EFD)
    q2, s2 = quantize_block_fp8(w2_EDF)
    return [t.to(device) for t in (x_TD, q13, q2, s13, s2, w_TK, ids_TK.to(torch.int32))]


@pytest.mark.parametrize("T,D,F,E,K,dtype", [
    (1, 128, 128, 2, 1, torch.float32),        # one token, whole blocks
    (9, 200, 136, 4, 2, torch.float32),        # partial edge blocks, gate/up boundary inside a block
    (17, 160, 256, 8, 3, torch.bfloat16),      # two F blocks, partial D block, half activations
])
def test_fp8_torch_backend_is_load_time_dequant_then_reference(T, D, F, E, K, dtype):
    x, q13, q2, s13, s2, w, ids = _inputs(T, D, F, E, K, dtype, seed=T)
    out = kernels.fused_experts(x, q13, q2, w, ids, backend="torch", w13_scale=s13, w2_scale=s2)
    # What the model gets when it dequantises at load (models/fp8.py), in the activation dtype.
    w13 = dequantize_fp8_block(q13, s13, (128, 128)).to(dtype)
    w2 = dequantize_fp8_block(q2, s2, (128, 128)).to(dtype)
    ref = kernels.fused_experts(x, w13, w2, w, ids, backend="reference")
    assert out.dtype == dtype and torch.equal(out, ref)


def test_fp8_torch_backend_expert_map_and_block_shape():
    """Global ids through an expert map (-1 = elsewhere), and a non-default block shape."""
    T, D, F, E_global, K = 6, 96, 64, 8, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E_global, 2 * F, D, generator=g), torch.randn(E_global, D, F, generator=g)
    w, ids = torch.rand(T, K, generator=g), torch.randint(0, E_global, (T, K), generator=g)
    q13, s13 = quantize_block_fp8(w13, (32, 64))
    q2, s2 = quantize_block_fp8(w2, (32, 64))
    total = torch.zeros(T, D)
    for rank in range(2):
        emap = make_expert_map(E_global, 2, rank, "round_robin")
        local = (emap >= 0).nonzero()[:, 0]
        total += kernels.fused_experts(x, q13[local], q2[local], w, ids, expert_map=emap, backend="torch",
                                       w13_scale=s13[local], w2_scale=s2[local], block_shape=(32, 64))
    ref = kernels.fused_experts(x, dequantize_fp8_block(q13, s13, (32, 64)),
                                dequantize_fp8_block(q2, s2, (32, 64)), w, ids, backend="reference")
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)


def test_fp8_seam_rejects_bad_scales_and_dtypes():
    x, q13, q2, s13, s2, w, ids = _inputs(3, 200, 136, 2, 1)
    deq13, deq2 = q13.float(), q2.float()
    call = kernels.fused_experts
    with pytest.raises(ValueError, match="both w13_scale and w2_scale"):
        call(x, q13, q2, w, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="no w13_scale/w2_scale"):
        call(x, q13, q2, w, ids)
    with pytest.raises(ValueError, match="w13 must be float8_e4m3fn"):
        call(x, deq13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="w2 must be float8_e4m3fn"):
        call(x, q13, deq2, w, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match=r"w13_scale must be \[2, 3, 2\]"):
        call(x, q13, q2, w, ids, w13_scale=s13[:, :2], w2_scale=s2)
    with pytest.raises(ValueError, match=r"w2_scale must be \[2, 2, 2\] for block_shape \(128, 128\)"):
        call(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2.transpose(1, 2)[:, :1])
    with pytest.raises(ValueError, match=r"w13_scale must be \[2, 5, 4\] for block_shape \(64, 64\)"):
        call(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, block_shape=(64, 64))
    with pytest.raises(ValueError, match="w2_scale must be float32"):
        call(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2.half())
    with pytest.raises(ValueError, match="block_shape is only meaningful"):
        call(x, deq13, deq2, w, ids, block_shape=(128, 128))
    with pytest.raises(ValueError, match="w2 must be"):  # the weight shape checks still come first
        call(x, q13, q2[:, :, :5], w, ids, w13_scale=s13, w2_scale=s2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton FP8 kernel is checked on CUDA only "
                    "(TRITON_INTERPRET mis-rounds fp32 -> e4m3)")
@pytest.mark.parametrize("T,D,F,E,K", [(1, 128, 128, 1, 1), (37, 200, 256, 8, 3)])
def test_fp8_triton_backend_through_the_seam(T, D, F, E, K):
    x, q13, q2, s13, s2, w, ids = _inputs(T, D, F, E, K, torch.bfloat16, seed=T, device="cuda")
    out = kernels.fused_experts(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)  # backend None: triton
    ref = kernels.fused_experts(x, q13, q2, w, ids, backend="torch", w13_scale=s13, w2_scale=s2)
    tight = fused_experts_fp8_actquant_torch(x.float(), q13, q2, s13, s2, w, ids)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert out.dtype == torch.bfloat16
    assert rel(out, ref) < 6e-2 and rel(out, tight) < 2e-2
