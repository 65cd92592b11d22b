"""Fused RMSNorm, RoPE (+ q/k norm) and softmax top-k kernels against their torch references.

Legend: T tokens, D hidden, H query heads, G key heads, d head dim, E experts, K top-k.

The references are the modules' torch code (RMSNorm.forward, RotaryEmbedding.forward,
softmax_topk) with their Triton gates (and native CPU kernels) forced off, so on a GPU too they
run the torch ops.
Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py) on small
awkward shapes; the real-shape and CUDA-graph tests at the end need a GPU. Kernel outputs are
allocated through a poisoned torch.empty (NaN / -7), so an element never written shows.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

import models.layers.norm as norm_mod  # noqa: E402
import models.layers.rotary as rotary_mod  # noqa: E402
import routing.router as router_mod  # noqa: E402
from kernels.cpu_native import ops as cpu_native_ops  # noqa: E402
from kernels.triton_fused.moe_sum import TopKSum, moe_sum  # noqa: E402
from kernels.triton_fused.rms_norm import rms_norm_topk_sum_triton, rms_norm_triton  # noqa: E402
from kernels.triton_fused.rope import qk_norm_rope_triton, rope_triton  # noqa: E402
from kernels.triton_fused.router import softmax_topk_triton  # noqa: E402
from models.config import RopeConfig  # noqa: E402
from models.layers.rotary import get_rope  # noqa: E402

from tests.kernels.triton_marks import CUDA, DEV, INTERPRET, needs_triton_device, needs_cuda  # noqa: E402
GATED = (norm_mod, rotary_mod, router_mod)


@pytest.fixture(autouse=True)
def torch_references(monkeypatch):
    """The module code under test is the torch reference: its Triton gate off, and on the CPU its
    native kernels too (kernels/cpu_native; they have their own tests against the same code)."""
    for mod in GATED:
        monkeypatch.setattr(mod, "use_triton_fused", lambda x: False)
    monkeypatch.setattr(cpu_native_ops.cpu_native, "library", lambda: None)


# --- references and comparisons ------------------------------------------------------------

def rms_norm_ref(x, weight, eps, residual=None):
    return norm_mod.RMSNorm.forward(SimpleNamespace(weight=weight, eps=eps), x, residual)


def make_rope(d, max_pos, rotary_dim, neox, scaling="default"):
    rope = {"default": RopeConfig(theta=10000.0),
            "yarn": RopeConfig(theta=10000.0, scaling_type="yarn", factor=4.0, original_max_position_embeddings=32,
                               params={"beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0})}
    return get_rope(d, max_pos, rope[scaling], rotary_dim, neox).to(DEV)


def ordered_bits(t):
    """Float bits mapped to integers that are ordered as the floats: adjacent floats differ by 1."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    b = t.contiguous().view(ints).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    return torch.where(b < 0, -(b + sign_bit), b)  # two's complement of a negative float -> minus its magnitude


def assert_ulps(out, ref, ulps=1, outlier_ulps=None, atol=0.0, max_outlier_fraction=0.0):
    """Every element within `ulps` units in the last place of the reference, except at most
    max(2, max_outlier_fraction * numel) outliers, each within outlier_ulps or atol (a rounding
    flipped by a last-bit difference upstream)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements"
    dist = (ordered_bits(out) - ordered_bits(ref)).abs()
    outliers = dist > ulps
    if outlier_ulps is None:
        assert not outliers.any(), f"{int(outliers.sum())} elements off by more than {ulps} ulp; max {int(dist.max())}"
        return
    far = outliers & (dist > outlier_ulps) & ((out.float() - ref.float()).abs() > atol)
    assert not far.any(), f"{int(far.sum())} elements off by more than {outlier_ulps} ulp and {atol}"
    n_out, allowed = int(outliers.sum()), max(2, int(max_outlier_fraction * out.numel()))
    assert n_out <= allowed, f"{n_out} of {out.numel()} elements off by more than {ulps} ulp"


# Halves: the fp32 sum of squares is reduced in another order than torch's (and on a GPU rsqrt
# may differ in the last bit), which now and then flips one rounding to the half type: most
# elements are exact on the CPU, within 1 ulp on a GPU; rare outliers 1-2 ulp off (or, after a
# rotation or a weight > 1, a small absolute error). The rounding order itself (round the
# normalised x, then multiply by the weight) must be kept: rounding once differs in a quarter
# of the elements.
HALF_NORM = (dict(ulps=1, outlier_ulps=2, atol=6e-2, max_outlier_fraction=1e-4) if CUDA else
             dict(ulps=0, outlier_ulps=1, atol=1e-2, max_outlier_fraction=1e-3))


def assert_norm_close(out, ref):
    """fp32: the sum of squares is reduced in another order, so a few ulp; halves: see above."""
    if out.dtype == torch.float32:
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=4e-6, atol=1e-6)
    else:
        assert_ulps(out, ref, **HALF_NORM)


def randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


HALF_TYPES = [torch.float32, torch.bfloat16, torch.float16]


# --- RMSNorm --------------------------------------------------------------------------------

@needs_triton_device
@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("T,D,strided", [(1, 64, False), (7, 96, False), (5, 200, True), (19, 32, True),
                                         (2, 2048, False)])
def test_rms_norm(dtype, residual, T, D, strided, poisoned_empty):
    wide = randn(T, D + 24, dtype=dtype, seed=T + D) * 3
    x = wide[:, 8:8 + D] if strided else wide[:, :D].contiguous()  # strided: rows D + 24 apart
    w = 1 + 0.3 * randn(D, dtype=dtype, seed=1)
    if residual:
        r = randn(T, D, dtype=dtype, seed=2)
        out, s = rms_norm_triton(x, w, 1e-6, r)
        ref_out, ref_s = rms_norm_ref(x, w, 1e-6, r)
        assert torch.equal(s, ref_s), "x + residual, rounded once to the input dtype"
    else:
        out, ref_out = rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert_norm_close(out, ref_out)


@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_of_qkv_split(dtype, poisoned_empty):
    """q_norm / k_norm: [T, H, d] views of a fused qkv output, normalised over d."""
    T, H, G, d = 6, 4, 2, 16
    qkv = randn(T, (H + 2 * G) * d, dtype=dtype, seed=3)
    q, k, _ = qkv.split([H * d, G * d, G * d], -1)
    for heads, n in ((q.reshape(T, H, d), H), (k.reshape(T, G, d), G)):
        assert not heads.is_contiguous()
        w = 1 + 0.3 * randn(d, dtype=dtype, seed=n)
        out = rms_norm_triton(heads, w, 1e-6)
        assert out.shape == (T, n, d)
        assert_norm_close(out, rms_norm_ref(heads, w, 1e-6))


@needs_triton_device
def test_rms_norm_weight_dtype_promotes(poisoned_empty):
    """bf16 x with an fp32 weight: the product is fp32 (torch's promotion), normalised x rounded to bf16 first."""
    x = randn(3, 48, dtype=torch.bfloat16, seed=4)
    w = 1 + 0.3 * randn(48, dtype=torch.float32, seed=5)
    out = rms_norm_triton(x, w, 1e-5)
    assert out.dtype == torch.float32
    gpu_slack = dict(outlier_ulps=2, atol=3e-2, max_outlier_fraction=0.05) if CUDA else {}  # see HALF_NORM
    assert_ulps(out, rms_norm_ref(x, w, 1e-5), 2, **gpu_slack)


@needs_triton_device
@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("T,K,D,strided", [(1, 8, 64, False), (5, 2, 200, True), (3, 1, 96, False),
                                           (2, 8, 2048, False)])
def test_rms_norm_of_topk_sum_is_moe_sum_then_norm(dtype, T, K, D, strided, poisoned_empty):
    """One launch for an MoE layer's combine and the next input norm: the same sum and residual
    (equal, rounded as moe_sum rounds) and the same norm as the two launches it replaces."""
    if strided:  # K outermost, as a permuted buffer: neither the T nor the K stride is D
        y = (2 * randn(K, T, D + 6, dtype=dtype, seed=T + K)).permute(1, 0, 2)[:, :, 3:3 + D]
    else:
        y = (2 * randn(T * K, D, dtype=dtype, seed=T + K)).view(T, K, D)
    r = randn(T, D, dtype=dtype, seed=7)
    w = 1 + 0.3 * randn(D, dtype=dtype, seed=8)
    out, s = rms_norm_topk_sum_triton(y, w, 1e-6, r)
    ref_out, ref_s = rms_norm_triton(moe_sum(y), w, 1e-6, r)
    assert torch.equal(s, ref_s), "sum rounded to the input dtype, then the residual added and rounded"
    assert_norm_close(out, ref_out)
    # the RMSNorm module takes the layer's TopKSum straight (its Triton gate forced on here)
    norm = norm_mod.RMSNorm(D, 1e-6).to(device=DEV, dtype=dtype)
    norm.weight.data.copy_(w)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norm_mod, "use_triton_fused", lambda x: True)
        mod_out, mod_s = norm(TopKSum(y), r)
    assert torch.equal(mod_s, s) and torch.equal(mod_out, out)
    # without the Triton gate (and without a residual) the sum is materialised first
    assert_norm_close(norm(TopKSum(y), r)[0], rms_norm_ref(moe_sum(y), w, 1e-6, r)[0])
    assert_norm_close(norm(TopKSum(y)), rms_norm_ref(moe_sum(y), w, 1e-6))


def test_rms_norm_bad_inputs():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm_topk_sum_triton(torch.randn(2, 3, 8), torch.ones(8), 1e-6, torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"\[T, K, D\]"):
        rms_norm_topk_sum_triton(x, torch.ones(8), 1e-6, x)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_triton(x, torch.ones(8), 1e-6, torch.randn(2, 8).double())
    with pytest.raises(TypeError, match="x must be"):
        rms_norm_triton(x.long(), torch.ones(8), 1e-6)


# --- RoPE -----------------------------------------------------------------------------------

def qk_views(T, H, G, d, dtype, seed):
    """q [T, H, d] and k [T, G, d]: views of one fused qkv row per token, as attention gets them."""
    qkv = randn(T, (H + 2 * G) * d, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([H * d, G * d, G * d], -1)
    return q.reshape(T, H, d), k.reshape(T, G, d)


def positions(T, max_pos, seed):
    rng = random.Random(seed)  # spread over the table, well past its first rows
    return torch.tensor([rng.randrange(max_pos) for _ in range(T - 1)] + [max_pos - 1], device=DEV)


ROPE_CASES = [  # T, H, G, d, rotary_dim, max_pos
    (1, 4, 2, 16, 16, 64), (9, 3, 1, 32, 32, 300), (5, 4, 2, 16, 10, 128), (4, 2, 2, 24, 8, 40),
    (2, 32, 4, 128, 128, 4096), (2, 40, 8, 128, 64, 100),  # Qwen3-30B-A3B heads; many heads, partial
]


@needs_triton_device
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("T,H,G,d,rot,max_pos", ROPE_CASES)
def test_rope(neox, dtype, T, H, G, d, rot, max_pos, poisoned_empty):
    rope = make_rope(d, max_pos, rot, neox)
    q, k = qk_views(T, H, G, d, dtype, seed=T * H)
    pos = positions(T, max_pos, seed=d)
    q_out, k_out = rope_triton(pos, q, k, rope.cos_cache, rope.sin_cache, rot, neox)
    q_ref, k_ref = rope(pos, q, k)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    # fp32 maths with contraction off: rounding as torch's separate products (1 ulp of slack for a GPU libm)
    assert_ulps(q_out, q_ref, 1)
    assert_ulps(k_out, k_ref, 1)
    if rot < d:
        assert torch.equal(q_out[..., rot:], q[..., rot:]), "dimensions past rotary_dim pass through"


@needs_triton_device
@pytest.mark.parametrize("neox", [True, False])
def test_rope_yarn_tables_and_int32_positions(neox, poisoned_empty):
    """YaRN folds its attention factor into the tables, which the kernel reads as they are."""
    rope = make_rope(16, 128, 16, neox, "yarn")
    q, k = qk_views(6, 2, 1, 16, torch.float32, seed=7)
    pos = positions(6, 128, seed=8)
    q_out, k_out = rope_triton(pos.to(torch.int32), q, k, rope.cos_cache, rope.sin_cache, 16, neox)
    q_ref, k_ref = rope(pos, q, k)
    assert_ulps(q_out, q_ref, 1)
    assert_ulps(k_out, k_ref, 1)


def qk_norms(d, dtype, seed):
    norms = []
    for i in range(2):
        n = norm_mod.RMSNorm(d, 1e-6).to(DEV)
        with torch.no_grad():
            n.weight.copy_(1 + 0.3 * randn(d, dtype=torch.float32, seed=seed + i))
        norms.append(n.to(dtype))
    return norms


def assert_norm_rope_close(out, ref):
    """A last-bit difference in the norm's rstd can flip one rounding before the rotation."""
    if out.dtype == torch.float32:
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
    else:
        assert_ulps(out, ref, **HALF_NORM)


@needs_triton_device
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("T,H,G,d,rot,max_pos", ROPE_CASES)
def test_qk_norm_rope(neox, dtype, T, H, G, d, rot, max_pos, poisoned_empty):
    rope = make_rope(d, max_pos, rot, neox)
    q_norm, k_norm = qk_norms(d, dtype, seed=T)
    q, k = qk_views(T, H, G, d, dtype, seed=T + H)
    pos = positions(T, max_pos, seed=H)
    q_out, k_out = qk_norm_rope_triton(pos, q, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos_cache,
                                       rope.sin_cache, rot, neox)
    with torch.no_grad():
        q_ref, k_ref = rope(pos, q_norm(q), k_norm(k))
        q_via_module, _ = rope.forward_with_qk_norm(pos, q, k, q_norm, k_norm)  # its torch path: same ops
    assert torch.equal(q_via_module, q_ref)
    assert_norm_rope_close(q_out, q_ref)
    assert_norm_rope_close(k_out, k_ref)


@needs_triton_device
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16)])
@pytest.mark.parametrize("T,H,G,d,rot,max_pos", [ROPE_CASES[0], ROPE_CASES[2], ROPE_CASES[3]])
def test_rope_writes_the_kv_cache_as_the_separate_write(norm, dtype, cache_dtype, T, H, G, d, rot, max_pos):
    """With a KV cache the launch also stores each token's rotated k and its v at its slot: the
    cache then equals write_kv_cache(k_out, v) of the unfused path, bit for bit; -1 skips a token,
    other slots stay untouched."""
    from kernels.attention import write_kv_cache
    rope = make_rope(d, max_pos, rot, neox=True)
    q_norm, k_norm = qk_norms(d, dtype, seed=T)
    qkv = randn(T, (H + 2 * G) * d, dtype=dtype, seed=T + 1)
    q, k, v = (x.reshape(T, -1, d) for x in qkv.split([H * d, G * d, G * d], -1))
    pos = positions(T, max_pos, seed=H)
    N, S = 5, 4
    slots = torch.randperm(N * S, generator=torch.Generator().manual_seed(T))[:T].to(DEV)
    slots[T // 2] = -1  # a padded row of a CUDA graph (with T=1 nothing is written)
    cache = torch.full((2, N, S, G, d), -7.0, dtype=cache_dtype, device=DEV)
    want = cache.clone()
    kv = dict(v_TGd=v, kv_cache_2NSGd=cache, slot_mapping_T=slots)
    if norm:
        q_plain, k_plain = qk_norm_rope_triton(pos, q, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos_cache,
                                               rope.sin_cache, rot, True)
        q_out, k_out = qk_norm_rope_triton(pos, q, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos_cache,
                                           rope.sin_cache, rot, True, **kv)
    else:
        q_plain, k_plain = rope_triton(pos, q, k, rope.cos_cache, rope.sin_cache, rot, True)
        q_out, k_out = rope_triton(pos, q, k, rope.cos_cache, rope.sin_cache, rot, True, **kv)
    assert torch.equal(q_out, q_plain) and torch.equal(k_out, k_plain)
    kept = slots >= 0  # the torch write takes real slots only
    write_kv_cache(k_plain[kept], v[kept], want, slots[kept])
    assert torch.equal(cache, want)
    assert (cache == -7).sum() == 2 * (N * S - (T - 1)) * G * d, "a slot outside the mapping was written"


def test_rope_kv_write_bad_inputs():
    q, k, v = torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    cos = sin = torch.randn(10, 8)
    pos = torch.zeros(3, dtype=torch.int64)
    slots = torch.arange(3)
    cache = torch.zeros(2, 4, 2, 1, 16)
    with pytest.raises(ValueError, match="pass kv_cache too"):
        rope_triton(pos, q, k, cos, sin, 16, True, v_TGd=v)
    with pytest.raises(ValueError, match="kv_cache must be a contiguous"):
        rope_triton(pos, q, k, cos, sin, 16, True, v_TGd=v, kv_cache_2NSGd=cache[:, :, :, :, :8], slot_mapping_T=slots)
    with pytest.raises(ValueError, match="v must be"):
        rope_triton(pos, q, k, cos, sin, 16, True, v_TGd=v[:2], kv_cache_2NSGd=cache, slot_mapping_T=slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rope_triton(pos, q, k, cos, sin, 16, True, v_TGd=v, kv_cache_2NSGd=cache, slot_mapping_T=slots.float())


def test_rope_bad_inputs():
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    cos = sin = torch.randn(10, 8)
    pos = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_triton(pos, q, k, cos, sin, 15, True)
    with pytest.raises(ValueError, match="cos_cache"):
        rope_triton(pos, q, k, cos, sin, 8, True)
    with pytest.raises(ValueError, match="positions"):
        rope_triton(pos.float(), q, k, cos, sin, 16, True)
    with pytest.raises(ValueError, match="head dim"):
        rope_triton(pos, q, torch.randn(3, 1, 8), cos, sin, 16, True)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rope_triton(pos, q, k, torch.ones(8), torch.ones(16), 1e-6, cos, sin, 16, True)


# --- router ---------------------------------------------------------------------------------

def check_topk(logits, K, renormalize, weights, ids):
    """Weights as the reference's; ids too, except where exactly tied probabilities may swap."""
    ref = router_mod.softmax_topk(logits, K, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (logits.shape[0], K)
    assert not weights.isnan().any() and (ids >= 0).all() and (ids < logits.shape[1]).all()
    # a GPU's exp may differ from torch's by a few ulp
    torch.testing.assert_close(weights, ref.topk_weights_TK, rtol=1e-5 if CUDA else 2e-6, atol=1e-7)
    assert (weights[:, :-1] >= weights[:, 1:]).all(), "descending"
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "distinct experts"
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    differ = ids != ref.topk_ids_TK
    ours_p = probs.gather(1, ids.long())[differ]
    ref_p = probs.gather(1, ref.topk_ids_TK.long())[differ]
    assert torch.equal(ours_p, ref_p), "ids differ only between exactly equal probabilities"
    return differ


@needs_triton_device
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("T,E,K,dtype", [
    (1, 8, 2, torch.float32), (37, 60, 4, torch.float32), (11, 128, 8, torch.bfloat16),
    (5, 512, 16, torch.float32), (3, 100, 1, torch.float16), (4, 16, 16, torch.float32),
    (3, 128, 8, torch.float32),
])
def test_softmax_topk(renormalize, T, E, K, dtype, poisoned_empty):
    wide = randn(T, E + 5, dtype=dtype, seed=E) * 2
    logits = wide[:, 2:2 + E]  # rows E + 5 apart
    weights, ids = softmax_topk_triton(logits, K, renormalize)
    differ = check_topk(logits, K, renormalize, weights, ids)
    if dtype == torch.float32:
        assert not differ.any(), "random fp32 logits have no ties"
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T, device=DEV))


@needs_triton_device
def test_softmax_topk_writes_ids_into_a_given_buffer():
    logits = randn(20, 128, dtype=torch.float32, seed=3)
    buf = torch.full((2, 32, 8), -7, dtype=torch.int32, device=DEV)  # rows 20.. must stay untouched
    _, ids = softmax_topk_triton(logits, 8, True, out_ids=buf[1, :20])
    _, ids_plain = softmax_topk_triton(logits, 8, True)
    assert ids.data_ptr() == buf[1].data_ptr() and torch.equal(ids, ids_plain)
    assert (buf[1, 20:] == -7).all() and (buf[0] == -7).all()


@needs_triton_device
def test_softmax_topk_ties_take_lowest_id(poisoned_empty):
    logits = torch.zeros(2, 12, device=DEV)
    logits[1, [3, 7, 9]] = 1.0
    weights, ids = softmax_topk_triton(logits, 4, True)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 7, 9, 0]]
    torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEV))


def test_softmax_topk_bad_inputs():
    with pytest.raises(ValueError, match="experts"):
        softmax_topk_triton(torch.randn(2, 513), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_triton(torch.randn(2, 8), 9, True)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_triton(torch.randn(2, 64), 17, True)


# --- model level: greedy tokens with the fused paths forced ---------------------------------

def _qwen3(path):
    from tests.factories import make_qwen3_moe_checkpoint
    return make_qwen3_moe_checkpoint(path, norm_topk_prob=True)


def _deepseek(path):  # MLA: strided q_pe views, interleaved YaRN RoPE, norms of split latents
    from tests.factories_deepseek import YARN, make_deepseek_v3_checkpoint
    return make_deepseek_v3_checkpoint(path, rope_scaling=YARN, max_position_embeddings=128)


def _llama4(path):  # interleaved Llama-3-scaled RoPE
    from tests.factories_llama4 import LLAMA3_ROPE, make_llama4_model, save_llama4_checkpoint
    return save_llama4_checkpoint(make_llama4_model(rope_parameters=LLAMA3_ROPE), path)


def generate_small(path):
    """Greedy outputs (with logprobs) of three short prompts through small steps: chunked prefill."""
    from tests.factories import generate_greedy

    return generate_greedy(path, [1, 13, 6], max_tokens=4, max_model_len=64, max_num_batched_tokens=16,
                           max_num_seqs=4, block_size=4)[2]


def assert_same_greedy_outputs(reference, outputs):
    """The same greedy tokens, and their logprobs within 1e-4."""
    for ref, out in zip(reference, outputs):
        a, b = ref.outputs[0], out.outputs[0]
        assert a.token_ids == b.token_ids
        ref_lp = torch.tensor([a.logprobs[i][t].logprob for i, t in enumerate(a.token_ids)])
        out_lp = torch.tensor([b.logprobs[i][t].logprob for i, t in enumerate(b.token_ids)])
        torch.testing.assert_close(out_lp, ref_lp, atol=1e-4, rtol=0)


@pytest.mark.skipif(not INTERPRET or CUDA, reason="forces the fused kernels on the CPU through the interpreter")
@pytest.mark.parametrize("family,gates", [(_qwen3, GATED), (_deepseek, GATED[:2]), (_llama4, GATED[:2])],
                         ids=["qwen3_moe", "deepseek_v3", "llama4"])
def test_models_generate_same_tokens_with_fused_paths(family, gates, tmp_path, monkeypatch):

    path = family(str(tmp_path / "ckpt"))
    reference = generate_small(path)
    calls = set()
    for mod in GATED:
        monkeypatch.setattr(mod, "use_triton_fused", lambda x, name=mod.__name__: calls.add(name) or True)
    fused = generate_small(path)
    assert calls == {mod.__name__ for mod in gates}, "each fused path the family has ran"
    assert_same_greedy_outputs(reference, fused)


@pytest.mark.skipif(not INTERPRET or CUDA, reason="forces the Triton experts on the CPU through the interpreter")
def test_qwen3_moe_layer_output_is_summed_by_the_next_norm(tmp_path, monkeypatch):
    """With the Triton experts and norms, each MoE layer hands its unsummed top-k outputs to the
    next layer's input norm (or the final norm), which sums them in its own launch: the same
    greedy tokens and logprobs as the torch path."""
    import kernels.fused_moe as fused_moe_mod
    import kernels.triton_fused.rms_norm as rms_norm_mod
    import kernels.triton_moe.fused as triton_moe_fused

    path = _qwen3(str(tmp_path / "ckpt"))
    reference = generate_small(path)
    summed_in_norm = []
    real = rms_norm_mod.rms_norm_topk_sum_triton

    def spy(y, *args):
        summed_in_norm.append(tuple(y.shape))
        return real(y, *args)

    monkeypatch.setattr(rms_norm_mod, "rms_norm_topk_sum_triton", spy)
    monkeypatch.setattr(triton_moe_fused, "DEFER_SUM_MIN_TOKENS", 2)  # this test's steps are small
    monkeypatch.setattr(fused_moe_mod, "_triton_usable", lambda x: True)
    monkeypatch.setattr(norm_mod, "use_triton_fused", lambda x: True)
    fused = generate_small(path)
    assert summed_in_norm and all(len(shape) == 3 and shape[0] >= 2 and shape[1] > 1 for shape in summed_in_norm)
    assert_same_greedy_outputs(reference, fused)


# --- GPU: Qwen3-30B-A3B shapes, and CUDA-graph capture + replay -----------------------------

QWEN3_30B = dict(D=2048, H=32, G=4, d=128, E=128, K=8)


def graph_replay_matches(fn, inputs, refresh, reference):
    """Capture fn(*inputs) in a CUDA graph, refill the inputs in place with new values, replay,
    and compare the graph's outputs to the reference on the new values."""
    fn(*inputs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*inputs)
    refresh()
    graph.replay()
    torch.cuda.synchronize()
    return outs, reference()


@needs_cuda
@pytest.mark.parametrize("T", [1, 256, 8192])
def test_gpu_qwen3_rms_norm(T):
    D = QWEN3_30B["D"]
    x, r = randn(T, D, dtype=torch.bfloat16, seed=T), randn(T, D, dtype=torch.bfloat16, seed=T + 1)
    w = 1 + 0.3 * randn(D, dtype=torch.bfloat16, seed=2)
    out, s = rms_norm_triton(x, w, 1e-6, r)
    ref_out, ref_s = rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(s, ref_s)
    assert_norm_close(out, ref_out)
    if T <= 256:
        def refresh():
            x.copy_(randn(T, D, dtype=torch.bfloat16, seed=T + 10))
        (g_out, g_s), (ref_out, ref_s) = graph_replay_matches(
            lambda a, b: rms_norm_triton(a, w, 1e-6, b), (x, r), refresh, lambda: rms_norm_ref(x, w, 1e-6, r))
        assert torch.equal(g_s, ref_s)
        assert_norm_close(g_out, ref_out)


@needs_cuda
@pytest.mark.parametrize("T", [1, 256, 8192])
def test_gpu_qwen3_qk_norm_rope(T):
    c = QWEN3_30B
    rope = make_rope(c["d"], 40960, c["d"], True)
    q_norm, k_norm = qk_norms(c["d"], torch.bfloat16, seed=3)
    q, k = qk_views(T, c["H"], c["G"], c["d"], torch.bfloat16, seed=T)
    pos = positions(T, 40960, seed=T)

    def fused(p, a, b):
        return qk_norm_rope_triton(p, a, b, q_norm.weight, k_norm.weight, 1e-6, rope.cos_cache, rope.sin_cache,
                                   c["d"], True)

    def reference():
        with torch.no_grad():
            return rope(pos, q_norm(q), k_norm(k))

    for out, ref in zip(fused(pos, q, k), reference()):
        assert_norm_rope_close(out, ref)
    for out, ref in zip(rope_triton(pos, q, k, rope.cos_cache, rope.sin_cache, c["d"], True), rope(pos, q, k)):
        assert_ulps(out, ref, 1)
    if T <= 256:
        def refresh():
            pos.copy_(positions(T, 40960, seed=T + 1))
            q.copy_(randn(*q.shape, dtype=torch.bfloat16, seed=T + 2))
        outs, refs = graph_replay_matches(fused, (pos, q, k), refresh, reference)
        for out, ref in zip(outs, refs):
            assert_norm_rope_close(out, ref)


@needs_cuda
@pytest.mark.parametrize("T", [1, 256, 8192])
def test_gpu_qwen3_router(T):
    E, K = QWEN3_30B["E"], QWEN3_30B["K"]
    logits = randn(T, E, dtype=torch.bfloat16, seed=T) * 2
    check_topk(logits, K, True, *softmax_topk_triton(logits, K, True))
    check_topk(logits, K, False, *softmax_topk_triton(logits, K, False))
    if T <= 256:
        def refresh():
            logits.copy_(randn(T, E, dtype=torch.bfloat16, seed=T + 5) * 2)
        (w, i), _ = graph_replay_matches(lambda x: softmax_topk_triton(x, K, True), (logits,), refresh, lambda: None)
        check_topk(logits, K, True, w, i)
