"""Expert biases (w13_bias, w2_bias) and gpt-oss's clamped SwiGLU ("swigluoai") in the expert layer.

Every backend of `kernels.fused_experts` ("reference", "torch" with each CPU form, "triton" under
TRITON_INTERPRET=1 without a GPU) against `naive_experts`, a per-token loop written here in float64
that mirrors transformers' GptOssExperts (checked against it in
test_naive_oracle_is_hf_gpt_oss_experts), on: biases on/off, silu / swigluoai with a limit that
clamps, an expert with no tokens, one token, row counts not a multiple of BLOCK_M, an expert map
with experts elsewhere (-1), defer_sum's TopKSum, the atomic / split-K down GEMM, bf16 and fp32.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k.
"""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_experts, cpu_native
from tests.kernels.triton_marks import CUDA, DEV, INTERPRET, kernel_grid

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's defaults
SMALL_LIMIT = 0.75  # gate_up ~ N(0, 2) here: a good share of both gate and up is clamped
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SMALL_CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2,
             "num_warps": 4, "num_stages": 1}
HAVE_TRITON_DEVICE = CUDA or INTERPRET


# --- the oracle -----------------------------------------------------------------------------

def naive_experts(x, w13, w2, tw, ti, emap=None, b13=None, b2=None, activation="silu",
                  alpha=ALPHA, limit=LIMIT, b2_after_weight=False):
    """Token by token, expert by expert, in float64 (GptOssExperts' math, our gate-then-up layout).
    b2_after_weight: the mutation (w * (h @ W2^T) + b2) the backends must not match."""
    T, D = x.shape
    F = w2.shape[2]
    out = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for k in range(ti.shape[1]):
            e = int(ti[t, k])
            if emap is not None:
                e = int(emap[e])
            if e < 0:  # expert on another rank: nothing, bias included
                continue
            gate_up = w13[e].double() @ x[t].double()
            if b13 is not None:
                gate_up = gate_up + b13[e].double()
            gate, up = gate_up[:F], gate_up[F:]
            if activation == "silu":
                h = gate * torch.sigmoid(gate) * up
            else:
                gate = gate.clamp(max=limit)
                up = up.clamp(min=-limit, max=limit)
                h = gate * torch.sigmoid(gate * alpha) * (up + 1)
            y = w2[e].double() @ h
            w = float(tw[t, k])
            if b2 is None:
                out[t] += w * y
            elif b2_after_weight:
                out[t] += w * y + b2[e].double()
            else:
                out[t] += w * (y + b2[e].double())
    return out


def rel(out, ref):
    out, ref = out.cpu().double(), ref.cpu().double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def clamped_share(x, w13, b13, limit):
    """Share of gate_up values of every (token, expert) pair beyond +-limit (that clamping acts)."""
    gu = torch.einsum("td,efd->tef", x.double(), w13.double())
    if b13 is not None:
        gu = gu + b13.double()[None]
    return (gu.abs() > limit).double().mean().item()


# --- inputs ---------------------------------------------------------------------------------

CASES = {  # name: T, D, F, E, K, extras
    "one_token": (1, 32, 16, 4, 2, {}),                                  # triton: one_row_blocks
    "ragged": (19, 40, 24, 4, 2, {"empty_expert": 3}),                   # 38 rows, D/F not x16
    "expert_map": (13, 32, 24, 3, 2, {"E_global": 8, "local": (1, 4, 6)}),
    "defer": (40, 32, 16, 4, 3, {"empty_expert": 0}),                    # 120 rows: TopKSum
}


def make_routing(T, E, K, ex, g):
    """(topk weights, topk ids, expert map) of a case: ex "E_global" / "local" give an expert map
    with -1 experts (token 0 routed only to those), "empty_expert" an expert no token picks."""
    emap, n_ids = None, E
    if "E_global" in ex:
        n_ids = ex["E_global"]
        emap = torch.full((n_ids,), -1, dtype=torch.int32)
        emap[torch.tensor(ex["local"])] = torch.arange(E, dtype=torch.int32)
    logits = torch.randn(T, n_ids, generator=g)
    if "empty_expert" in ex:
        logits[:, ex["empty_expert"]] = -1e9
    tw, ti = torch.softmax(logits, -1).topk(K, dim=-1)
    ti = ti.to(torch.int32)
    if emap is not None:
        ti[0] = torch.tensor([0, 2][:K], dtype=torch.int32)  # token 0: only experts elsewhere
        assert bool((emap[ti[0].long()] < 0).all())
    return tw, ti, emap


def make_case(name, dtype, biases=True, seed=0, bias_dtype=None):
    T, D, F, E, K, ex = CASES[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * F, D, generator=g) * D ** -0.5
    w2 = torch.randn(E, D, F, generator=g) * F ** -0.5
    b13 = torch.randn(E, 2 * F, generator=g)
    b2 = torch.randn(E, D, generator=g) * 0.5
    tw, ti, emap = make_routing(T, E, K, ex, g)
    bias_dtype = bias_dtype or dtype
    case = {"x": x.to(dtype), "w13": w13.to(dtype), "w2": w2.to(dtype), "tw": tw, "ti": ti,
            "emap": emap, "b13": b13.to(bias_dtype) if biases else None,
            "b2": b2.to(bias_dtype) if biases else None}
    return case


BACKENDS = ["reference", "torch", "torch-grouped", "torch-loop", "triton"]


@pytest.fixture
def run(monkeypatch):
    """run(backend, case, **kw): kernels.fused_experts on that backend (the CPU forms forced as in
    test_cpu_experts.py; triton with small blocks under the interpreter); returns [T, D] (a TopKSum
    summed by moe_sum, as the next RMSNorm would) and whether a TopKSum came back."""
    from kernels.triton_fused.moe_sum import TopKSum

    def _run(backend, c, config=None, **kw):
        if backend in ("torch-grouped", "torch-loop"):
            if backend == "torch-grouped" and not cpu_experts.HAVE_GROUPED_MM:
                pytest.skip("this torch build has no CPU torch._grouped_mm")
            monkeypatch.setattr(cpu_experts, "GROUPED_MAX_ROWS", -1 if backend == "torch-loop" else 10 ** 9)
            monkeypatch.setattr(cpu_experts.native_ops, "experts", lambda *a: None)
        dev = "cpu"
        if backend == "triton":
            if not HAVE_TRITON_DEVICE:
                pytest.skip("no GPU and TRITON_INTERPRET is not set")
            pytest.importorskip("triton")
            import kernels.triton_moe.fused as fused
            cfg = config if config is not None else (None if CUDA else SMALL_CFG)
            if cfg is not None:
                monkeypatch.setattr(fused, "get_config", lambda *a, **k: cfg)
            dev = DEV
        mv = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
        out = kernels.fused_experts(mv["x"], mv["w13"], mv["w2"], mv["tw"], mv["ti"], mv["emap"],
                                    backend=backend.split("-")[0], w13_bias=mv["b13"], w2_bias=mv["b2"], **kw)
        deferred = isinstance(out, TopKSum)
        if deferred:
            assert out.y_TKD.shape == (c["x"].shape[0], c["ti"].shape[1], c["x"].shape[1])
            out = out.materialize()
        assert out.shape == c["x"].shape and out.dtype == c["x"].dtype
        return out.cpu(), deferred

    return _run


def oracle(c, **kw):
    return naive_experts(c["x"], c["w13"], c["w2"], c["tw"], c["ti"], c["emap"], c["b13"], c["b2"], **kw)


# --- every backend against the oracle -------------------------------------------------------

NAIVE_AXES = ({"nobias": False, "bias": True}, {"silu": "silu", "swigluoai": "swigluoai"}, {c: c for c in CASES},
              {"fp32": torch.float32, "bf16": torch.bfloat16})


@pytest.mark.parametrize("backend,biases,activation,case,dtype",
                         kernel_grid({b: b for b in BACKENDS if b != "triton"}, *NAIVE_AXES, cover="all")
                         + kernel_grid({"triton": "triton"}, *NAIVE_AXES))
def test_backends_match_naive_loop(backend, biases, activation, case, dtype, run):
    c = make_case(case, dtype, biases, seed=len(case))
    act = {} if activation == "silu" else {"activation": activation, "swiglu_alpha": ALPHA,
                                           "swiglu_limit": SMALL_LIMIT}
    out, deferred = run(backend, c, defer_sum=case == "defer", **act)
    ref = oracle(c, activation=activation, limit=SMALL_LIMIT)
    assert rel(out, ref) < TOL[dtype], rel(out, ref)
    assert deferred == (backend == "triton" and case == "defer")
    if activation == "swigluoai":
        assert clamped_share(c["x"], c["w13"], c["b13"], SMALL_LIMIT) > 0.2  # clamping acts
        # and matters: without it the result is far off
        assert rel(out, oracle(c, activation=activation, limit=1e9)) > 10 * TOL[dtype]
    if c["emap"] is not None:  # token 0 routed only to experts elsewhere: exactly zero, no bias
        assert torch.all(out[0] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("down", [{"ATOMIC_SUM": True}, {"SPLIT_K": 2}, {"SPLIT_K": 3}],
                         ids=["atomic", "split2", "split3"])
@pytest.mark.parametrize("case", ["ragged", "expert_map"])
def test_triton_atomic_and_split_k_down_add_b2_once(case, down, dtype, run):
    """The fp32-atomic down GEMM, its F range split over programs: b2 goes in exactly once."""
    c = make_case(case, dtype, seed=7)
    out, deferred = run("triton", c, config=dict(SMALL_CFG, down=down), defer_sum=True,
                        activation="swigluoai", swiglu_limit=SMALL_LIMIT)
    assert not deferred  # the atomic form sums in the kernel
    assert rel(out, oracle(c, activation="swigluoai", limit=SMALL_LIMIT)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["ragged", "expert_map"])
def test_triton_split_k_gate_up_adds_b13_once(case, dtype, run):
    """gate_up's D range split over programs: b13 goes in exactly once, in the activation launch."""
    c = make_case(case, dtype, seed=9)
    for activation in ("silu", "swigluoai"):
        out, _ = run("triton", c, config=dict(SMALL_CFG, SPLIT_K=2), activation=activation,
                     swiglu_limit=SMALL_LIMIT)
        assert rel(out, oracle(c, activation=activation, limit=SMALL_LIMIT)) < TOL[dtype]


@pytest.mark.parametrize("which", ["b13", "b2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_bias_alone_and_fp32_biases_with_bf16(backend, which, run):
    """Only one of the two biases; bf16 activations with fp32 biases (added in fp32)."""
    for dtype in (torch.float32, torch.bfloat16):
        c = make_case("ragged", dtype, seed=11, bias_dtype=torch.float32)
        c["b2" if which == "b13" else "b13"] = None
        for activation in ("silu", "swigluoai"):
            out, _ = run(backend, c, activation=activation, swiglu_limit=SMALL_LIMIT)
            assert rel(out, oracle(c, activation=activation, limit=SMALL_LIMIT)) < TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_alpha_and_limit_clamp_large_values(backend, run):
    """activation="swigluoai" alone means alpha 1.702, limit 7: values pushed beyond 7 are clamped."""
    c = make_case("ragged", torch.float32, seed=3)
    c["b13"] = c["b13"] * 8.0
    c["x"] = c["x"] * 4.0
    assert clamped_share(c["x"], c["w13"], c["b13"], LIMIT) > 0.2
    out, _ = run(backend, c, activation="swigluoai")
    ref = oracle(c, activation="swigluoai")
    assert rel(out, ref) < 1e-5
    assert rel(out, oracle(c, activation="swigluoai", limit=1e9)) > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_b2_is_added_before_the_routed_weight(backend, run):
    """out = sum_k w_k * (h_k @ W2^T + b2): a backend adding b2 after the weight fails here."""
    for activation in ("silu", "swigluoai"):
        c = make_case("ragged", torch.float32, seed=5)
        c["b2"] = c["b2"] * 4.0
        right = oracle(c, activation=activation, limit=SMALL_LIMIT)
        wrong = oracle(c, activation=activation, limit=SMALL_LIMIT, b2_after_weight=True)
        assert rel(wrong, right) > 0.5  # the two orders are far apart on these inputs
        out, _ = run(backend, c, activation=activation, swiglu_limit=SMALL_LIMIT)
        assert rel(out, right) < 1e-5
        assert rel(out, wrong) > 0.5


# --- the fast CPU path stays what it was ----------------------------------------------------

def test_cpu_native_kernel_serves_plain_calls_only(monkeypatch):
    """Plain silu calls still take the native kernel; calls with biases or swigluoai skip it
    (it knows neither) and still match the oracle; zero biases change nothing."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the native kernels did not build")
    calls = []
    real = cpu_experts.native_ops.experts
    monkeypatch.setattr(cpu_experts.native_ops, "experts", lambda *a: calls.append(1) or real(*a))
    c = make_case("ragged", torch.float32, biases=False, seed=2)
    args = (c["x"], c["w13"], c["w2"], c["tw"], c["ti"])
    plain = kernels.fused_experts(*args, backend="torch")
    assert calls == [1]
    zeros = kernels.fused_experts(*args, backend="torch", w13_bias=torch.zeros(4, 48), w2_bias=torch.zeros(4, 40))
    torch.testing.assert_close(zeros, plain, atol=2e-6, rtol=1e-5)
    kernels.fused_experts(*args, backend="torch", activation="swigluoai")
    assert calls == [1]


# --- the oracle is HF's GptOssExperts ----------------------------------------------------------

def test_naive_oracle_is_hf_gpt_oss_experts():
    """Our layout (w13 gate rows then up rows, b13 likewise) into HF's (gate/up interleaved columns,
    transposed), HF's eager GptOssExperts.forward in float64 equals naive_experts."""
    pytest.importorskip("transformers")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    c = make_case("ragged", torch.float32, seed=9)
    E, F2, D = c["w13"].shape
    F = F2 // 2
    cfg = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, swiglu_limit=SMALL_LIMIT)
    hf = GptOssExperts(cfg).double()
    with torch.no_grad():
        w13 = c["w13"].double().transpose(1, 2)  # [E, D, 2F]
        hf.gate_up_proj[:, :, 0::2] = w13[:, :, :F]
        hf.gate_up_proj[:, :, 1::2] = w13[:, :, F:]
        hf.gate_up_proj_bias[:, 0::2] = c["b13"].double()[:, :F]
        hf.gate_up_proj_bias[:, 1::2] = c["b13"].double()[:, F:]
        hf.down_proj.copy_(c["w2"].double().transpose(1, 2))
        hf.down_proj_bias.copy_(c["b2"].double())
        hf.alpha, hf.limit = ALPHA, SMALL_LIMIT  # transformers < 5.23 ignores the config's swiglu_limit
        eager = getattr(GptOssExperts.forward, "__wrapped__", GptOssExperts.forward)
        want = eager(hf, c["x"].double(), c["ti"].long(), c["tw"].double())
    got = naive_experts(c["x"], c["w13"], c["w2"], c["tw"], c["ti"], None, c["b13"], c["b2"],
                        activation="swigluoai", limit=SMALL_LIMIT)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --- bad arguments --------------------------------------------------------------------------

def test_bad_arguments_raise():
    c = make_case("ragged", torch.float32, seed=1)  # E=4, 2F=48, D=40
    args = (c["x"], c["w13"], c["w2"], c["tw"], c["ti"])
    call = kernels.fused_experts
    for backend in ("torch", "reference", "triton"):
        with pytest.raises(ValueError, match=r"activation must be one of \('silu', 'swigluoai'\)"):
            call(*args, backend=backend, activation="gelu")
    with pytest.raises(ValueError, match=r"w13_bias must be \[4, 48\]"):
        call(*args, w13_bias=torch.zeros(4, 24))
    with pytest.raises(ValueError, match=r"w2_bias must be \[4, 40\]"):
        call(*args, w2_bias=torch.zeros(40))
    with pytest.raises(ValueError, match="w2_bias must be float32 or the activation dtype"):
        call(*args, w2_bias=torch.zeros(4, 40, dtype=torch.float16))
    with pytest.raises(ValueError, match="w13_bias is on meta"):
        call(*args, w13_bias=torch.zeros(4, 48, device="meta"))
    for kw in ({"w13_bias": torch.zeros(4, 48)}, {"activation": "swigluoai"}):
        with pytest.raises(ValueError, match="backend 'deepspeed' has no expert biases"):
            call(*args, backend="deepspeed", **kw)
    # FP8 weights: neither biases nor swigluoai
    from kernels.reference_fp8 import quantize_block_fp8
    q13, s13 = quantize_block_fp8(c["w13"])
    q2, s2 = quantize_block_fp8(c["w2"])
    for backend in ("torch", "triton"):
        for kw in ({"w2_bias": torch.zeros(4, 40)}, {"activation": "swigluoai"}):
            with pytest.raises(ValueError, match="not supported with FP8 weights"):
                call(c["x"], q13, q2, c["tw"], c["ti"], backend=backend, w13_scale=s13, w2_scale=s2, **kw)
