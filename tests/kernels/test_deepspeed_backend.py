"""backend="deepspeed" (kernels/deepspeed_moe.py).

CPU: the routing / sorting / masking around the grouped GEMMs, with a torch GEMM injected that follows
the FasterTransformer contract (written here from the contract, independently of the module), against
the reference; the errors of the seam. GPU (CUDA + libdeepspeedft.so only): the library itself against
the reference, and one call captured in a CUDA graph.

Legend: T tokens, D hidden, E experts, F expert intermediate, K top-k, R = T*K rows.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import kernels
from kernels import deepspeed_moe
from kernels.deepspeed_moe import fused_experts_deepspeed
from kernels.reference import fused_experts_torch
from kernels.reference_fp8 import quantize_block_fp8
from routing import make_expert_map


def ft_gemm_torch(a_RK, w_EKN, ends_E, out_RN, fill=None):
    """The FT contract: expert e owns rows [ends[e-1], ends[e]) (ends[-1] read as 0), out = a @ w[e]
    accumulated in fp32; rows from ends[E-1] on are neither read nor written. `fill` first overwrites
    all of out, so that untouched rows are visible."""
    E, K, N = w_EKN.shape
    assert a_RK.is_contiguous() and w_EKN.is_contiguous() and out_RN.is_contiguous()
    assert ends_E.dtype == torch.int64 and tuple(ends_E.shape) == (E,)
    assert a_RK.shape[1] == K and tuple(out_RN.shape) == (a_RK.shape[0], N)
    ends = ends_E.tolist()
    assert ends == sorted(ends) and ends[-1] <= a_RK.shape[0]
    if fill is not None:
        out_RN.fill_(fill)
    start = 0
    for e, end in enumerate(ends):
        out_RN[start:end] = (a_RK[start:end].float() @ w_EKN[e].float()).to(out_RN.dtype)
        start = end
    return out_RN


def nan_filled_gemm(a_RK, w_EKN, ends_E, out_RN):
    return ft_gemm_torch(a_RK, w_EKN, ends_E, out_RN, fill=float("nan"))


def _inputs(T, D, F, E, K, dtype=torch.float32, seed=0, n_ids=None, device="cpu", empty_expert=True):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g)
    w13_EFD = torch.randn(E, 2 * F, D, generator=g) * D ** -0.5
    w2_EDF = torch.randn(E, D, F, generator=g) * F ** -0.5
    logits = torch.randn(T, n_ids or E, generator=g)
    if empty_expert and (n_ids or E) > K:
        logits[:, 0] = -1e9  # expert 0 gets no token
    w_TK, ids_TK = torch.softmax(logits, -1).topk(K, dim=-1)
    return [t.to(device) for t in (x_TD.to(dtype), w13_EFD.to(dtype), w2_EDF.to(dtype), w_TK,
                                   ids_TK.to(torch.int32))]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("T,D,F,E,K,dtype", [
    (5, 32, 16, 4, 2, torch.float32),      # expert 0 without tokens, top-2
    (1, 32, 16, 4, 1, torch.float32),      # one token, top-1
    (7, 32, 16, 1, 1, torch.float32),      # E = 1
    (9, 64, 24, 8, 3, torch.bfloat16),     # top-3, half activations
    (16, 32, 16, 6, 6, torch.bfloat16),    # K = E: every expert gets every token
])
@pytest.mark.parametrize("gemm", [ft_gemm_torch, nan_filled_gemm], ids=["plain", "nan_fill"])
def test_matches_reference_with_injected_gemm(T, D, F, E, K, dtype, gemm):
    x, w13, w2, w, ids = _inputs(T, D, F, E, K, dtype, seed=T)
    out = fused_experts_deepspeed(x, w13, w2, w, ids, gemm=gemm)
    ref = fused_experts_torch(x, w13, w2, w, ids)
    assert out.dtype == dtype and out.shape == (T, D) and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **_tol(dtype))


def test_expert_with_one_token_and_expert_with_none():
    x, w13, w2, w, _ = _inputs(3, 32, 16, 4, 2)
    ids = torch.tensor([[0, 1], [0, 2], [1, 0]], dtype=torch.int32)  # expert 2: one row, expert 3: none
    seen = []

    def spy(a, w_, ends, out):
        seen.append(ends.tolist())
        return nan_filled_gemm(a, w_, ends, out)

    out = fused_experts_deepspeed(x, w13, w2, w, ids, gemm=spy)
    assert seen == [[3, 5, 6, 6]] * 2  # counts 3, 2, 1, 0 -> inclusive cumsum, same for both GEMMs
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_map_rows_elsewhere_sort_last_and_cannot_leak(dtype):
    """Global ids through an expert map (-1 = elsewhere): those rows sort after the last expert's end,
    the injected GEMM leaves them NaN, and the result is still finite and equal to the reference; the
    ranks add up to the whole layer."""
    T, D, F, E_global, K = 11, 32, 16, 8, 3
    x, w13, w2, w, ids = _inputs(T, D, F, E_global, K, dtype, seed=3, empty_expert=False)
    ref_all = fused_experts_torch(x, w13, w2, w, ids)
    total = torch.zeros(T, D)
    for rank in range(2):
        emap = make_expert_map(E_global, 2, rank, "round_robin")
        local = (emap >= 0).nonzero()[:, 0]
        ends_seen = []

        def spy(a, w_, ends, out):
            ends_seen.append(ends[-1].item())
            return nan_filled_gemm(a, w_, ends, out)

        out = fused_experts_deepspeed(x, w13[local], w2[local], w, ids, expert_map=emap, gemm=spy)
        n_local = int((emap[ids.long()] >= 0).sum())
        assert ends_seen == [n_local] * 2 and n_local < T * K  # some rows really are garbage
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, fused_experts_torch(x, w13[local], w2[local], w, ids, emap), **_tol(dtype))
        total += out.float()
    torch.testing.assert_close(total, ref_all.float(), **_tol(dtype))


def test_no_local_rows_gives_zeros():
    x, w13, w2, w, ids = _inputs(4, 32, 16, 2, 1)
    emap = torch.tensor([-1, -1], dtype=torch.int32)  # both routed experts live elsewhere
    out = fused_experts_deepspeed(x, w13, w2, w, ids, expert_map=emap, gemm=nan_filled_gemm)
    assert torch.equal(out, torch.zeros_like(out))


def test_transposed_weights_are_made_once_per_tensor():
    x, w13, w2, w, ids = _inputs(4, 32, 16, 4, 2)
    weights_seen = []

    def spy(a, w_, ends, out):
        weights_seen.append(w_)
        return ft_gemm_torch(a, w_, ends, out)

    fused_experts_deepspeed(x, w13, w2, w, ids, gemm=spy)
    fused_experts_deepspeed(x, w13, w2, w, ids, gemm=spy)
    assert weights_seen[0] is weights_seen[2] and weights_seen[1] is weights_seen[3]
    assert torch.equal(weights_seen[0], w13.transpose(1, 2)) and weights_seen[0].is_contiguous()


def test_seam_on_cpu_says_cuda_is_needed():
    x, w13, w2, w, ids = _inputs(3, 32, 16, 4, 2, torch.bfloat16)
    with pytest.raises(ValueError, match="backend 'deepspeed' needs CUDA tensors"):
        kernels.fused_experts(x, w13, w2, w, ids, backend="deepspeed")


def test_seam_rejects_fp8_for_deepspeed():
    x, w13, w2, w, ids = _inputs(3, 128, 128, 2, 1)
    q13, s13 = quantize_block_fp8(w13)
    q2, s2 = quantize_block_fp8(w2)
    with pytest.raises(ValueError, match="backend 'deepspeed' has no FP8 path"):
        kernels.fused_experts(x, q13, q2, w, ids, backend="deepspeed", w13_scale=s13, w2_scale=s2)


def test_backend_none_never_picks_deepspeed(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("backend=None must not reach the deepspeed backend")

    monkeypatch.setattr(deepspeed_moe, "fused_experts_deepspeed", boom)
    x, w13, w2, w, ids = _inputs(3, 32, 16, 4, 2)
    kernels.fused_experts(x, w13, w2, w, ids)


def test_missing_library_names_the_fix(monkeypatch):
    monkeypatch.delenv(deepspeed_moe.LIB_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "dskernels", None)  # `import dskernels` -> ImportError
    assert deepspeed_moe.library_path() is None
    with pytest.raises(RuntimeError, match=r"not found: `pip install deepspeed-kernels`.*MOE_DEEPSPEED_FT_LIB"):
        deepspeed_moe._library()
    monkeypatch.setenv(deepspeed_moe.LIB_ENV, "/nonexistent/libdeepspeedft.so")
    with pytest.raises(RuntimeError,
                       match=r"cannot load /nonexistent/libdeepspeedft.so.*pip install deepspeed-kernels"):
        deepspeed_moe._library()
    assert not deepspeed_moe.available("cpu") and not deepspeed_moe.available("cuda")


def test_library_path_from_the_wheel(monkeypatch, tmp_path):
    monkeypatch.delenv(deepspeed_moe.LIB_ENV, raising=False)
    fake = types.ModuleType("dskernels")
    fake.library_path = lambda: str(tmp_path)  # like the wheel: the package directory
    monkeypatch.setitem(sys.modules, "dskernels", fake)
    assert deepspeed_moe.library_path() is None  # package without the .so
    (tmp_path / "libdeepspeedft.so").touch()
    assert deepspeed_moe.library_path() == str(tmp_path / "libdeepspeedft.so")
    monkeypatch.setenv(deepspeed_moe.LIB_ENV, "/elsewhere/lib.so")  # the variable wins
    assert deepspeed_moe.library_path() == "/elsewhere/lib.so"


def test_fp32_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="fp16 and bf16 only.*no fp32 MoeGemmRunner"):
        deepspeed_moe._runner(torch.float32, torch.device("cuda", 0))


# --------------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_library = pytest.mark.skipif(
    not deepspeed_moe.available("cuda"),
    reason=f"needs CUDA (cc 8.x) and libdeepspeedft.so (pip install deepspeed-kernels or "
           f"{deepspeed_moe.LIB_ENV})")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_supported_archs():
    assert deepspeed_moe._unsupported_arch((8, 0)) is None
    assert deepspeed_moe._unsupported_arch((8, 9)) is None
    assert "7.5" in deepspeed_moe._unsupported_arch((7, 5))
    assert "refuses sm_90" in deepspeed_moe._unsupported_arch((9, 0))


@pytest.mark.skipif(not (torch.cuda.is_available() and deepspeed_moe.library_path()
                         and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs a Hopper GPU and libdeepspeedft.so")
def test_gpu_hopper_is_refused_with_the_reason():
    x, w13, w2, w, ids = _inputs(3, 64, 32, 4, 2, torch.bfloat16, device="cuda")
    assert not deepspeed_moe.available("cuda")
    with pytest.raises(ValueError, match="refuses sm_90"):
        kernels.fused_experts(x, w13, w2, w, ids, backend="deepspeed")


@needs_cuda
def test_gpu_alignment_is_checked_before_the_library():
    x, w13, w2, w, ids = _inputs(3, 36, 16, 4, 2, torch.bfloat16, device="cuda")  # D = 36: not 8-aligned
    with pytest.raises(ValueError, match="multiples of 8"):
        kernels.fused_experts(x, w13, w2, w, ids, backend="deepspeed")


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("use_map", [False, True], ids=["local", "expert_map"])
def test_gpu_library_matches_reference(dtype, T, use_map):
    """Qwen3-like small shape: E=8, D=256, F=128, top-2."""
    E, D, F, K = 8, 256, 128, 2
    if use_map:  # 16 global experts, this rank holds 8 (round robin): about half the rows are garbage
        x, w13, w2, w, ids = _inputs(T, D, F, 2 * E, K, dtype, seed=T, device="cuda", empty_expert=False)
        emap = make_expert_map(2 * E, 2, 0, "round_robin").cuda()
        local = (emap >= 0).nonzero()[:, 0]
        w13, w2 = w13[local].contiguous(), w2[local].contiguous()
    else:
        x, w13, w2, w, ids = _inputs(T, D, F, E, K, dtype, seed=T, device="cuda")
        emap = None
    out = kernels.fused_experts(x, w13, w2, w, ids, expert_map=emap, backend="deepspeed")
    ref = fused_experts_torch(x, w13, w2, w, ids, emap)
    assert out.dtype == dtype and torch.isfinite(out).all()
    if ref.float().norm() > 0:
        assert _rel(out, ref) < 1e-2
    else:
        assert out.float().norm() == 0


@needs_library
def test_gpu_cuda_graph_replay_equals_eager():
    E, D, F, K, T = 8, 256, 128, 2, 64
    x, w13, w2, w, ids = _inputs(T, D, F, E, K, torch.bfloat16, seed=1, device="cuda")
    x2, _, _, w_2, ids2 = _inputs(T, D, F, E, K, torch.bfloat16, seed=2, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: library load, runner, transposed weights, allocator
        fused_experts_deepspeed(x, w13, w2, w, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_experts_deepspeed(x, w13, w2, w, ids)
    graph.replay()
    # K = 2: the two fp32 atomic adds per token commute exactly, so equality is bitwise.
    assert torch.equal(static_out, fused_experts_deepspeed(x, w13, w2, w, ids))
    # New routing in place: the per-expert counts are recomputed on the device at replay.
    x.copy_(x2), w.copy_(w_2), ids.copy_(ids2)
    graph.replay()
    assert torch.equal(static_out, fused_experts_deepspeed(x, w13, w2, w, ids))
    assert _rel(static_out, fused_experts_torch(x, w13, w2, w, ids)) < 1e-2
