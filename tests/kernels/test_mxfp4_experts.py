"""MXFP4 expert weights (gpt-oss's hub format) in the expert layer, `kernels.fused_experts`.

- the dequantisations, kernels/reference_mxfp4.py's and the Triton GEMMs' tile form
  (kernels/triton_moe/mxfp4.py, run alone through dequantize_mxfp4_triton), equal models.mxfp4's
  bit for bit on every byte value and every scale 0..255, in bf16, fp16 and fp32; mutations of the
  tile code (nibbles swapped, scale or subnormal code off, sign lost) fail that check;
- every backend ("torch", "reference", "triton": TRITON_INTERPRET=1 without a GPU, tiny shapes)
  against the reference on the dequantised weights, with biases on/off, silu / swigluoai, one token,
  row counts not a multiple of BLOCK_M, an expert with no tokens, an expert map with experts
  elsewhere (-1), defer_sum's TopKSum, K not a multiple of BLOCK_K, the atomic and split-K down GEMM;
  and "triton" against its own 16-bit-weight path on the same values (bit for bit under the
  interpreter): the MXFP4 form changes the weight loads only;
- bad shapes / dtypes raise ValueErrors naming the tensor; the config key is "mxfp4";
- the MXFP4 GEMMs compile for sm_90 (tests/kernels/compile_sm90_mxfp4.py, no GPU needed);
- on a GPU, gpt-oss-20b's real shapes, and a CUDA graph capture.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import reference_mxfp4
from kernels.reference import fused_experts_torch
from models import mxfp4 as models_mxfp4
from tests.kernels.test_expert_bias_swiglu import make_routing
from tests.kernels.triton_marks import CUDA, DEV, INTERPRET, kernel_grid, needs_cuda, needs_triton_device

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SMALL_LIMIT = 0.75  # swigluoai's limit here: a good share of gate and up is clamped
SMALL_CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 2,
             "num_warps": 4, "num_stages": 1}
WIDE_CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
            "num_warps": 4, "num_stages": 1}  # D = F = 96: K not a multiple of BLOCK_K, N of BLOCK_N
MXFP4_SRC = Path(kernels.__file__).with_name("triton_moe") / "mxfp4.py"
COMPILE_SCRIPT = Path(__file__).with_name("compile_sm90_mxfp4.py")


def rel(out, ref):
    out, ref = out.cpu().double(), ref.cpu().double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 != 0.0 and every NaN / inf pattern counts)."""
    return t.cpu().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def every_byte_and_scale():
    """q [256, 256]: row r holds every byte value, with scale r (every E8M0 value) on its 16 blocks."""
    q = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    s = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 512 // 32)
    return q, s


def models_dequant(q, s, dtype):
    return models_mxfp4.dequantize_mxfp4(q.unflatten(-1, (-1, 16)), s, dtype)


# --- the dequantisations --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_dequant_equals_models_mxfp4(dtype):
    q, s = every_byte_and_scale()
    assert torch.equal(bits(reference_mxfp4.dequantize_mxfp4(q, s, dtype)), bits(models_dequant(q, s, dtype)))
    # [E, N, Kd/2] (one expert at a time), on quantised weights
    w = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = models_mxfp4.quantize_mxfp4(w)
    got = reference_mxfp4.dequantize_mxfp4(blocks.flatten(-2), scales, dtype)
    assert got.shape == (3, 8, 64)
    assert torch.equal(bits(got), bits(models_mxfp4.dequantize_mxfp4(blocks, scales, dtype)))
    assert reference_mxfp4.FP4_E2M1_VALUES == models_mxfp4.FP4_E2M1_VALUES


def _dequant_mismatches(dequant, dtype) -> int:
    q, s = every_byte_and_scale()
    got = dequant(q.to(DEV), s.to(DEV), dtype)
    return int((bits(got) != bits(models_dequant(q, s, dtype))).sum())


@needs_triton_device
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter, on infinities
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_tile_dequant_equals_models_mxfp4_on_every_byte_and_scale(dtype):
    """The GEMMs' in-register dequantisation: exact, subnormals (scales 0, 1) and infinities
    (scales 254, 255 in fp32; earlier in fp16) included."""
    from kernels.triton_moe.mxfp4 import dequantize_mxfp4_triton
    assert _dequant_mismatches(dequantize_mxfp4_triton, dtype) == 0
    q, s = every_byte_and_scale()  # partial tiles: N and Kd not multiples of the blocks
    got = dequantize_mxfp4_triton(q[:37, :48].to(DEV), s[:37, :3].to(DEV), dtype, block_n=16, block_k=64)
    assert torch.equal(bits(got), bits(models_dequant(q[:37, :48], s[:37, :3], dtype)))


MUTATIONS = {  # name: (original text in mxfp4.py, mutated text)
    "nibbles_swapped": ("tl.interleave(_e2m1_times_two(q & 15), _e2m1_times_two(q >> 4))",
                        "tl.interleave(_e2m1_times_two(q >> 4), _e2m1_times_two(q & 15))"),
    "scale_off_by_one": ("(s - 1) << 23, 0x200000 << s", "s << 23, 0x200000 << s"),
    "code_exponent_off_by_one": ("* 1.7014118346046923e38  # 2^127", "* 8.507059173023462e37"),
    "mantissa_bit_dropped": ("& 0x81C00000", "& 0x81800000"),
    "sign_dropped": ("& 0x81C00000", "& 0x01C00000"),
    "subnormal_scales_flushed": ("0x200000 << s)", "0 * s)"),
}
# The packed bf16 form's (inline PTX: CUDA only).
PACKED_MUTATIONS = {
    "packed_sign_dropped": ("shl.b32 t0, w01, 12; and.b32 t0, t0, 0x80008000;",
                            "shl.b32 t0, w01, 12; and.b32 t0, t0, 0x00008000;"),
    "packed_bytes_of_a_pair_swapped": ("prmt.b32 w01, $4, z, 0x4140;", "prmt.b32 w01, $4, z, 0x4041;"),
    "packed_subnormal_scales_flushed": ("(s - 1) << 7, 0x20 << s)", "(s - 1) << 7, 0 * s)"),
    "packed_high_nibbles_mantissa_dropped": ("shl.b32 t1, w23, 2; and.b32 t1, t1, 0x01C001C0;",
                                             "shl.b32 t1, w23, 2; and.b32 t1, t1, 0x01800180;"),
}


def _fresh_mxfp4(tmp_path, name: str, src: str, upcast: str, monkeypatch):
    """A copy of mxfp4.py with src, imported afresh under MOE_MXFP4_UPCAST=upcast (read at import)."""
    monkeypatch.setenv("MOE_MXFP4_UPCAST", upcast)
    path = tmp_path / f"mxfp4_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"mxfp4_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_triton_device
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("mutation", list(MUTATIONS) + list(PACKED_MUTATIONS))
def test_mutated_tile_dequant_fails(mutation, tmp_path, monkeypatch):
    """The exhaustive check catches each mutation of the tile code (run from a mutated copy)."""
    packed = mutation in PACKED_MUTATIONS
    if packed and not CUDA:
        pytest.skip("the packed form is inline PTX: CUDA only")
    old, new = (PACKED_MUTATIONS if packed else MUTATIONS)[mutation]
    src = MXFP4_SRC.read_text()
    assert src.count(old) == 1, f"mutation {mutation!r} no longer applies to {MXFP4_SRC}"
    mod = _fresh_mxfp4(tmp_path, mutation, src.replace(old, new), "packed" if packed else "fp32", monkeypatch)
    assert bool(mod.PACKED_UPCAST) == packed
    dtype = torch.float32 if mutation == "subnormal_scales_flushed" else torch.bfloat16
    assert _dequant_mismatches(mod.dequantize_mxfp4_triton, dtype) > 0


@needs_cuda
@pytest.mark.parametrize("upcast", ["fp32", "packed"])
def test_every_upcast_form_is_exact_on_every_byte_and_scale(upcast, tmp_path, monkeypatch):
    """bf16 tiles through either form (MOE_MXFP4_UPCAST) equal models.mxfp4 bit for bit."""
    mod = _fresh_mxfp4(tmp_path, upcast, MXFP4_SRC.read_text(), upcast, monkeypatch)
    assert bool(mod.PACKED_UPCAST) == (upcast == "packed")
    assert _dequant_mismatches(mod.dequantize_mxfp4_triton, torch.bfloat16) == 0
    q, s = every_byte_and_scale()  # partial tiles
    got = mod.dequantize_mxfp4_triton(q[:37, :48].to(DEV), s[:37, :3].to(DEV), torch.bfloat16, block_n=16, block_k=64)
    assert torch.equal(bits(got), bits(models_dequant(q[:37, :48], s[:37, :3], torch.bfloat16)))


def test_upcast_switch_refuses_unknown_forms():
    env = {**os.environ, "MOE_MXFP4_UPCAST": "fast"}
    done = subprocess.run([sys.executable, "-c", "import kernels.triton_moe.mxfp4"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=Path(kernels.__file__).parents[1])
    assert done.returncode != 0 and "MOE_MXFP4_UPCAST='fast'" in done.stderr


# --- the expert layer -----------------------------------------------------------------------

CASES = {  # name: T, D, F, E, K, extras
    "one_token": (1, 64, 32, 4, 2, {}),                                     # triton: one_row_blocks
    "ragged": (19, 96, 96, 4, 2, {"empty_expert": 3, "cfg": WIDE_CFG}),     # 38 rows, masked K / N
    "expert_map": (13, 64, 64, 3, 2, {"E_global": 8, "local": (1, 4, 6)}),  # token 0: only elsewhere
    "defer": (40, 64, 32, 4, 3, {"empty_expert": 0}),                       # 120 rows: TopKSum
}


def make_case(name, dtype=torch.bfloat16, biases=True, seed=0):
    T, D, F, E, K, ex = CASES[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    q13, s13 = models_mxfp4.quantize_mxfp4(torch.randn(E, 2 * F, D, generator=g) * D ** -0.5)
    q2, s2 = models_mxfp4.quantize_mxfp4(torch.randn(E, D, F, generator=g) * F ** -0.5)
    tw, ti, emap = make_routing(T, E, K, ex, g)
    return {"x": x, "q13": q13.flatten(-2), "s13": s13, "q2": q2.flatten(-2), "s2": s2, "tw": tw, "ti": ti,
            "emap": emap, "b13": torch.randn(E, 2 * F, generator=g).to(dtype) if biases else None,
            "b2": (torch.randn(E, D, generator=g) * 0.5).to(dtype) if biases else None,
            "cfg": ex.get("cfg", SMALL_CFG)}


def dequantised(c, dtype):
    return (reference_mxfp4.dequantize_mxfp4(c["q13"], c["s13"], dtype),
            reference_mxfp4.dequantize_mxfp4(c["q2"], c["s2"], dtype))


def oracle(c, swap_nibbles=False, **kw):
    """fused_experts_torch in fp32 on the dequantised weights (swap_nibbles: the wrong layout)."""
    cc = dict(c)
    if swap_nibbles:
        cc["q13"], cc["q2"] = [(q >> 4) | (q << 4) for q in (c["q13"], c["q2"])]
    w13, w2 = dequantised(cc, torch.float32)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    return fused_experts_torch(c["x"].float(), w13, w2, c["tw"], c["ti"], c["emap"], w13_bias=f(c["b13"]),
                               w2_bias=f(c["b2"]), **kw)


@pytest.fixture
def run(monkeypatch):
    """run(backend, case, weights="mxfp4"|"16bit", config=None, **kw) -> ([T, D] on the CPU, deferred):
    kernels.fused_experts with the case's MXFP4 weights (or their dequantised values), triton
    with the case's small config under the interpreter (or `config`); a TopKSum is summed."""
    from kernels.triton_fused.moe_sum import TopKSum

    def _run(backend, c, weights="mxfp4", config=None, **kw):
        dev = "cpu"
        if backend == "triton":
            if not (CUDA or INTERPRET):
                pytest.skip("no GPU and TRITON_INTERPRET is not set")
            import kernels.triton_moe.fused as fused
            cfg = config if config is not None else (None if CUDA else c["cfg"])
            if cfg is not None:
                monkeypatch.setattr(fused, "get_config", lambda *a, **k: cfg)
            dev = DEV
        mv = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
        if weights == "mxfp4":
            w = dict(w13=mv["q13"], w2=mv["q2"], w13_scale=mv["s13"], w2_scale=mv["s2"])
        else:
            w13, w2 = dequantised(mv, mv["x"].dtype)
            w = dict(w13=w13, w2=w2)
        out = kernels.fused_experts(mv["x"], topk_weights=mv["tw"], topk_ids=mv["ti"], expert_map=mv["emap"],
                                    backend=backend, w13_bias=mv["b13"], w2_bias=mv["b2"], **w, **kw)
        deferred = isinstance(out, TopKSum)
        if deferred:
            out = out.materialize()
        assert out.shape == c["x"].shape and out.dtype == c["x"].dtype
        return out.cpu(), deferred

    return _run


def _act(activation):
    return {} if activation == "silu" else {"activation": activation, "swiglu_limit": SMALL_LIMIT}


BIASES, ACTIVATIONS = {"nobias": False, "bias": True}, {"silu": "silu", "swigluoai": "swigluoai"}
CASE_IDS = {c: c for c in CASES}


@pytest.mark.parametrize("backend,biases,activation,case",
                         kernel_grid({"torch": "torch", "reference": "reference"}, BIASES, ACTIVATIONS,
                                     CASE_IDS, cover="all")
                         + kernel_grid({"triton": "triton"}, BIASES, ACTIVATIONS, CASE_IDS))
def test_backends_match_reference_on_dequantised_weights(backend, biases, activation, case, run):
    c = make_case(case, biases=biases, seed=len(case) + 3 * biases)
    out, deferred = run(backend, c, defer_sum=case == "defer", **_act(activation))
    ref = oracle(c, **_act(activation))
    assert rel(out, ref) < TOL[torch.bfloat16], rel(out, ref)
    assert deferred == (backend == "triton" and case == "defer")
    if c["emap"] is not None:  # token 0 routed only to experts elsewhere: exactly zero, no bias
        assert torch.all(out[0] == 0)
    if backend == "triton":
        # the MXFP4 form changes the weight loads only: the 16-bit path on the same values agrees
        same, _ = run(backend, c, weights="16bit", defer_sum=case == "defer", **_act(activation))
        if INTERPRET:
            assert torch.equal(out, same)
        else:
            assert rel(out, same) < 1e-3
    else:  # the dequantise-then-reference path exactly
        same, _ = run("reference", c, weights="16bit", **_act(activation))
        assert torch.equal(out, same)
    if case == "ragged" and activation == "silu":  # the check tells a swapped nibble order apart
        assert rel(out, oracle(c, swap_nibbles=True)) > 0.3


@pytest.mark.parametrize("down", [{"ATOMIC_SUM": True}, {"SPLIT_K": 2}, {"SPLIT_K": 3}],
                         ids=["atomic", "split2", "split3"])
@pytest.mark.parametrize("case", ["ragged", "expert_map"])
def test_triton_atomic_and_split_k_down(case, down, run):
    """The fp32-atomic down GEMM, its F range split over programs (each split starting at its own
    byte and scale column): b2 once, the top-k sum fused."""
    c = make_case(case, seed=7)
    cfg = dict(c["cfg"], down=down)
    out, deferred = run("triton", c, config=cfg, defer_sum=True, activation="swigluoai", swiglu_limit=SMALL_LIMIT)
    assert not deferred
    assert rel(out, oracle(c, activation="swigluoai", swiglu_limit=SMALL_LIMIT)) < TOL[torch.bfloat16]
    same, _ = run("triton", c, weights="16bit", config=cfg, activation="swigluoai", swiglu_limit=SMALL_LIMIT)
    assert rel(out, same) < 1e-6  # fp32 atomics: the order of the adds may differ


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("case", ["ragged", "expert_map"])
def test_triton_split_k_gate_up(case, split, run):
    """gate_up's D range split over programs (each split from its own byte and scale column), the
    partial sums then biased (b13 once) and clamped in the activation launch; down split too."""
    c = make_case(case, seed=8)
    cfg = dict(c["cfg"], SPLIT_K=split, down={"SPLIT_K": 2})
    out, _ = run("triton", c, config=cfg, activation="swigluoai", swiglu_limit=SMALL_LIMIT)
    assert rel(out, oracle(c, activation="swigluoai", swiglu_limit=SMALL_LIMIT)) < TOL[torch.bfloat16]
    same, _ = run("triton", c, weights="16bit", config=cfg, activation="swigluoai", swiglu_limit=SMALL_LIMIT)
    assert rel(out, same) < 1e-6  # fp32 atomics: the order of the adds may differ


@pytest.mark.parametrize("case,dtype,down", kernel_grid(CASE_IDS,
                                                         {"bf16": torch.bfloat16, "fp16": torch.float16},
                                                         {"plain": {}, "split2": {"SPLIT_K": 2}}))
def test_dot_scaled_form_equals_the_kernels_dequantisation(case, dtype, down, run, monkeypatch):
    """MOE_MXFP4_DOT_SCALED: the tiles through tl.dot_scaled give what the kernels' own
    dequantisation gives (the same weight values; exactly under the interpreter), and both the
    reference, with masked K / N, an expert map, split-K and the deferred sum."""
    import kernels.triton_moe.fused as fused
    c = make_case(case, dtype=dtype, seed=5)
    # on a GPU 16-row tiles of 64 x 64: Triton 3.6 cannot lower the E2M1 conversion of smaller ones
    kw = dict(defer_sum=case == "defer", activation="swigluoai", swiglu_limit=SMALL_LIMIT,
              config=dict(WIDE_CFG if CUDA else c["cfg"], down=down) if down else None)
    outs = {}
    for scaled in (False, True):
        monkeypatch.setattr(fused, "MXFP4_DOT_SCALED", "1" if scaled else "0")
        outs[scaled], _ = run("triton", c, **kw)
    assert rel(outs[True], oracle(c, activation="swigluoai", swiglu_limit=SMALL_LIMIT)) < TOL[dtype]
    if INTERPRET and not down:
        assert torch.equal(outs[True], outs[False])
    else:  # split-K: fp32 atomics in another order; on the GPU another MMA shape
        assert rel(outs[True], outs[False]) < 1e-3


SWAP_FORMS = {"both": {"SWAP_AB": True}, "atomic": {"SWAP_AB": True, "down": {"ATOMIC_SUM": True}},
              "split-down": {"SWAP_AB": True, "down": {"SPLIT_K": 2}}, "split-gate_up": {"SWAP_AB": True, "SPLIT_K": 2},
              "down-only": {"down": {"SWAP_AB": True}}}


# each form on one case and each case under one form in the interpreter (the product on a GPU)
@pytest.mark.parametrize("case,form", kernel_grid(CASE_IDS, SWAP_FORMS, cover="values"))
def test_swap_ab_form_equals_the_plain_one(case, form, run):
    """SWAP_AB (the transposed product, the dequantised weights as the MMA's A operand): the plain
    order's result, with biases, swigluoai, masked K / N, an expert map, split-K and atomics."""
    c = make_case(case, seed=13)
    kw = dict(defer_sum=case == "defer", activation="swigluoai", swiglu_limit=SMALL_LIMIT)
    cfg = dict(c["cfg"], **{k: v for k, v in form.items() if k != "down"}, down=form.get("down", {}))
    swapped, _ = run("triton", c, config=cfg, **kw)
    plain, _ = run("triton", c, config=dict(c["cfg"], down={k: v for k, v in cfg["down"].items() if k != "SWAP_AB"},
                                            **({"SPLIT_K": 2} if "SPLIT_K" in form else {})), **kw)
    assert rel(swapped, oracle(c, activation="swigluoai", swiglu_limit=SMALL_LIMIT)) < TOL[torch.bfloat16]
    assert rel(swapped, plain) < 1e-3


def test_swap_ab_needs_mxfp4_weights():
    from kernels.triton_moe import fused_experts_triton
    args = (torch.randn(3, 64), torch.randn(4, 64, 64), torch.randn(4, 64, 32), torch.ones(3, 2) / 2,
            torch.tensor([[0, 1]] * 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="SWAP_AB is for MXFP4 weights"):
        fused_experts_triton(*(t.to(DEV) for t in args), config=dict(SMALL_CFG, SWAP_AB=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp16_and_fp32_activations(backend, dtype, run):
    c = make_case("ragged", dtype=dtype, seed=11)
    out, _ = run(backend, c, activation="swigluoai", swiglu_limit=SMALL_LIMIT)
    assert rel(out, oracle(c, activation="swigluoai", swiglu_limit=SMALL_LIMIT)) < TOL[dtype]


def test_unwritten_outputs_show(run, poisoned_empty):
    """Every element of every buffer the call reads is written first (torch.empty gives NaNs here)."""
    if not (CUDA or INTERPRET):
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    for case in ("expert_map", "ragged"):
        c = make_case(case, seed=5)
        out, _ = run("triton", c)
        assert not out.isnan().any()
        assert rel(out, oracle(c)) < TOL[torch.bfloat16]


def test_config_key_and_block_k(monkeypatch, tmp_path):
    """Configs are looked up under dtype "mxfp4" (tuned file, else the defaults); a BLOCK_SIZE_K not
    a multiple of 32 is refused."""
    if not (CUDA or INTERPRET):
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from kernels.triton_moe import config as cfgmod
    from kernels.triton_moe import fused, fused_experts_triton_mxfp4
    c = make_case("one_token", seed=1)
    x, q13, q2, tw, ti, s13, s2 = (c[k].to(DEV) for k in ("x", "q13", "q2", "tw", "ti", "s13", "s2"))
    E, F = s13.shape[0], s13.shape[1] // 2
    asked = []
    monkeypatch.setattr(fused, "get_config", lambda *a, **k: asked.append(a) or SMALL_CFG)
    kernels.fused_experts(x, q13, q2, tw, ti, backend="triton", w13_scale=s13, w2_scale=s2)
    assert asked == [(1, E, F, 2, "mxfp4")]
    for bad in (dict(SMALL_CFG, BLOCK_SIZE_K=16), dict(SMALL_CFG, down={"BLOCK_SIZE_K": 48})):
        with pytest.raises(ValueError, match="BLOCK_SIZE_K a multiple of 32"):
            fused_experts_triton_mxfp4(x, q13, q2, s13, s2, tw, ti, config=bad)
    file_cfg = dict(SMALL_CFG, BLOCK_SIZE_N=32)
    name = cfgmod.config_file_name(E, F, cfgmod.device_name(), "mxfp4")
    (tmp_path / name).write_text(json.dumps({"1": file_cfg}))
    monkeypatch.setenv("MOE_KERNEL_CONFIG_DIR", str(tmp_path))
    cfgmod.load_configs.cache_clear()
    try:
        assert cfgmod.get_config(1, E, F, 2, "mxfp4") == file_cfg
        assert cfgmod.get_config(1, E, F, 2, torch.bfloat16) == cfgmod.default_config(1, E, F, 2, "bf16")
        monkeypatch.delenv("MOE_KERNEL_CONFIG_DIR")
        cfgmod.load_configs.cache_clear()
        assert cfgmod.get_config(1, E, F, 2, "mxfp4") == cfgmod.default_config(1, E, F, 2, "mxfp4")
    finally:
        cfgmod.load_configs.cache_clear()


def test_bad_arguments_name_the_tensor():
    c = make_case("ragged", biases=False, seed=2)  # E=4, D=F=96
    x, q13, q2, s13, s2, tw, ti = (c[k] for k in ("x", "q13", "q2", "s13", "s2", "tw", "ti"))
    call = kernels.fused_experts

    def fails(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            call(*args, **kw)

    full = dict(w13_scale=s13, w2_scale=s2)
    fails(r"w13 must be \[E, 2F, 48\] \(MXFP4", x, q13[..., :40], q2, tw, ti, **full)
    fails(r"w13 must be \[E, 2F, 48\] \(MXFP4", x, q13.unflatten(-1, (-1, 16)), q2, tw, ti, **full)
    fails(r"w2 must be \[4, 96, 48\] \(MXFP4", x, q13, q2[:, :, :47], tw, ti, **full)
    fails("need both w13 and w2 as uint8", x, q13, q2.to(torch.bfloat16), tw, ti, **full)
    fails("need both w13 and w2 as uint8", x, q13.float(), q2, tw, ti, **full)
    fails("need both w13_scale and w2_scale", x, q13, q2, tw, ti)
    fails("need both w13_scale and w2_scale", x, q13, q2, tw, ti, w13_scale=s13)
    fails("w13_scale must be uint8", x, q13, q2, tw, ti, w13_scale=s13.float(), w2_scale=s2)
    fails("w2_scale must be uint8", x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2.to(torch.int8))
    fails(r"w13_scale must be \[4, 192, 3\]", x, q13, q2, tw, ti, w13_scale=s13[:, :, :2], w2_scale=s2)
    fails(r"w2_scale must be \[4, 96, 3\]", x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2[:2])
    fails("block_shape is for FP8 weights", x, q13, q2, tw, ti, block_shape=(128, 128), **full)
    fails("hidden_states must be bf16, fp16 or fp32", x.to(torch.float64), q13, q2, tw, ti, **full)
    fails("w13_scale is on meta", x, q13, q2, tw, ti, w13_scale=s13.to("meta"), w2_scale=s2)
    fails(r"w13_bias must be \[4, 192\]", x, q13, q2, tw, ti, w13_bias=torch.zeros(4, 96), **full)
    fails(r"w2_bias must be \[4, 96\]", x, q13, q2, tw, ti, w2_bias=torch.zeros(4, 48), **full)
    fails("backend 'deepspeed' has no MXFP4 path", x, q13, q2, tw, ti, backend="deepspeed", **full)
    # D (or F) not a multiple of 32: no whole scale blocks
    x40 = torch.randn(3, 40).to(torch.bfloat16)
    ti3, tw3 = ti[:3], tw[:3]
    fails("D and F multiples of 32", x40, torch.zeros(4, 64, 20, dtype=torch.uint8),
          torch.zeros(4, 40, 16, dtype=torch.uint8), tw3, ti3,
          w13_scale=torch.zeros(4, 64, 1, dtype=torch.uint8), w2_scale=torch.zeros(4, 40, 1, dtype=torch.uint8))
    from kernels.triton_moe.mxfp4 import dequantize_mxfp4_triton
    with pytest.raises(ValueError, match="do not match"):
        reference_mxfp4.dequantize_mxfp4(q13, s13[..., :2])
    with pytest.raises(ValueError, match="must be uint8"):
        reference_mxfp4.dequantize_mxfp4(q13.to(torch.int8), s13)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4_triton(q13, s13[..., :2])


# --- compiled for sm_90 (no GPU needed) -----------------------------------------------------

def _compile_reports(runs: list[tuple[list[str], dict]]) -> list[dict]:
    """compile_sm90_mxfp4.py once per (arguments, extra environment), the runs side by side (each
    compiles on one core): their reports, in order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, str(COMPILE_SCRIPT), *args], env=env | extra, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args, extra in runs]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return reports


def test_mxfp4_gemms_compile_for_sm90():
    """gate_up (bias, swigluoai; also split-K) and down (split-K, atomic, bias) with W_MXFP4 at gpt-oss's shape
    (K = 2880: the masked last K step) and the decode / prefill default configs, with the kernels'
    own dequantisation in either upcast form (MOE_MXFP4_UPCAST packed / fp32) and through tl.dot_scaled
    (MXFP4_SCALED; compiled once: it upcasts on its own, whatever the form): compiled, the dot a bf16 MMA
    (mma.sync at BLOCK_M 16, wgmma at 128), the weight bytes loaded by the pipeliner's async copies, no
    fp32 multiply flushing subnormals (the exact dequantisation relies on that), the packed form's bf16x2
    fmas where asked for."""
    pytest.importorskip("triton")
    reports = _compile_reports([(["--scaled"], {"MOE_MXFP4_UPCAST": "packed"}), ([], {"MOE_MXFP4_UPCAST": "fp32"})])
    for upcast, report, forms in zip(("packed", "fp32"), reports, (("mxfp4", "mxfp4_scaled"), ("mxfp4",))):
        assert set(report) == {f"{g}/{c}/bf16/{form}" for g in ("gate_up", "down") for c in ("decode", "prefill")
                               for form in forms} | {f"gate_up_split4/decode/bf16/{form}" for form in forms}
        for name, r in report.items():
            assert r["compiled"] and not r["ftz_f32_mul"], (upcast, name, r)
            # tl.dot_scaled upcasts on its own; the kernels' own dequantisation takes the form asked for
            assert r["packed_upcast"] == (upcast == "packed" and not name.endswith("_scaled")), (upcast, name, r)
            if name.endswith("_scaled"):  # tl.dot_scaled: the compiler's upcast picks its own MMA (bf16 operands)
                mma = "wgmma.mma_async" if "/prefill/" in name else ""
            else:
                mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" if "/decode/" in name else "wgmma.mma_async"
            assert any(m.startswith(mma) and "bf16" in m for m in r["mma"]), (upcast, name, r["mma"])
            # the weight bytes stay pipelined (with the activations): gate_up's a, gate, up; down's a, w2
            assert r["async_copies_in_loop"] >= (3 if name.startswith("gate_up") else 2), (upcast, name, r)


def test_swap_ab_makes_the_dequantised_tile_a_register_operand():
    """SWAP_AB compiled for sm_90 at the decode tile (16 rows): the dot becomes wgmma with the
    dequantised weights as its A operand straight from registers (no shared-memory allocation in the K
    loop); the plain order stores each dequantised tile to shared memory and runs mma.sync."""
    pytest.importorskip("triton")
    plain_report, swapped_report = _compile_reports([(["--configs", "decode"], {}),
                                                     (["--configs", "decode", "--swap-ab"], {})])
    for name, swapped in swapped_report.items():
        plain = plain_report[name]
        assert all(m.startswith("wgmma.mma_async") for m in swapped["mma"]) and swapped["mma"], (name, swapped)
        assert swapped["local_allocs_in_loop"] == 0 and swapped["spill_store_bytes"] == 0, (name, swapped)
        assert all(m.startswith("mma.sync") for m in plain["mma"]) and plain["local_allocs_in_loop"] >= 1, (name, plain)


# --- on a GPU: real shapes ------------------------------------------------------------------

def _gpt_oss_problem(E, T, K=4, D=2880, F=2880, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q13 = torch.randint(0, 256, (E, 2 * F, D // 2), device="cuda", dtype=torch.uint8, generator=g)
    q2 = torch.randint(0, 256, (E, D, F // 2), device="cuda", dtype=torch.uint8, generator=g)
    # random codes have rms ~2.9: scales 2^-8 .. 2^-6 give weights of the size of D^-0.5
    s13 = torch.randint(119, 122, (E, 2 * F, D // 32), device="cuda", dtype=torch.uint8, generator=g)
    s2 = torch.randint(119, 122, (E, D, F // 32), device="cuda", dtype=torch.uint8, generator=g)
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    tw, ti = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(K, dim=-1)
    b13 = torch.randn(E, 2 * F, device="cuda", generator=g)
    b2 = torch.randn(E, D, device="cuda", generator=g) * 0.1
    return x, q13, q2, s13, s2, tw, ti.to(torch.int32), b13, b2


@needs_cuda
@pytest.mark.parametrize("T", [1, 5, 64, 300, 2048])
def test_real_shapes_gpu(T):
    """gpt-oss-20b (E=32, D=F=2880, top-4): MXFP4 triton against the reference and the 16-bit path
    on the dequantised weights, biases and swigluoai on (the shipped or default configs)."""
    from kernels.triton_moe import fused_experts_triton, fused_experts_triton_mxfp4
    from kernels.triton_moe.config import get_config
    x, q13, q2, s13, s2, tw, ti, b13, b2 = _gpt_oss_problem(32, T)
    w13 = reference_mxfp4.dequantize_mxfp4(q13, s13)
    w2 = reference_mxfp4.dequantize_mxfp4(q2, s2)
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai")
    out = fused_experts_triton_mxfp4(x, q13, q2, s13, s2, tw, ti, **kw)
    ref = fused_experts_torch(x, w13, w2, tw, ti, **kw)
    assert rel(out, ref) < TOL[torch.bfloat16]
    cfg = {k: v for k, v in get_config(T, 32, 2880, 4, "mxfp4").items() if k != "SWAP_AB"}  # an MXFP4 form
    same = fused_experts_triton(x, w13, w2, tw, ti, config=cfg, **kw)
    assert rel(out, same) < 1e-3
    assert rel(out, kernels.fused_experts(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2, **kw)) < 1e-5


@needs_cuda
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("up_split", [2, 8])
def test_real_shapes_split_gate_up_gpu(T, up_split):
    """gpt-oss-20b with gate_up's D range split (and down's F range): the reference on the
    dequantised weights, and the unsplit call up to the order of the fp32 additions."""
    from kernels.triton_moe import fused_experts_triton_mxfp4
    from kernels.triton_moe.config import default_config
    x, q13, q2, s13, s2, tw, ti, b13, b2 = _gpt_oss_problem(32, T)
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai")
    base = default_config(T, 32, 2880, 4, "mxfp4")
    out = fused_experts_triton_mxfp4(x, q13, q2, s13, s2, tw, ti, config=dict(base, SPLIT_K=up_split,
                                                                              down={"SPLIT_K": 2}), **kw)
    ref = fused_experts_torch(x, reference_mxfp4.dequantize_mxfp4(q13, s13), reference_mxfp4.dequantize_mxfp4(q2, s2),
                              tw, ti, **kw)
    assert rel(out, ref) < TOL[torch.bfloat16]
    # h rounds to bf16 after sums in another order: 2.7e-3 apart on an H100
    assert rel(out, fused_experts_triton_mxfp4(x, q13, q2, s13, s2, tw, ti, config=base, **kw)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("up,down", [(1, {}), (1, {"SPLIT_K": 4}), (4, {"SPLIT_K": 4})],
                         ids=["plain", "split4", "up_split4"])
def test_cuda_graph_capture_gpu(up, down):
    from kernels.triton_moe import fused_experts_triton_mxfp4
    from kernels.triton_moe.config import default_config
    x, q13, q2, s13, s2, tw, ti, b13, b2 = _gpt_oss_problem(32, 1)
    cfg = dict(default_config(1, 32, 2880, 4, "mxfp4"), down=down, **({"SPLIT_K": up} if up > 1 else {}))
    kw = dict(config=cfg, w13_bias=b13, w2_bias=b2, activation="swigluoai")
    eager = fused_experts_triton_mxfp4(x, q13, q2, s13, s2, tw, ti, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton_mxfp4(x, q13, q2, s13, s2, tw, ti, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, eager) < 2e-3  # split-K: fp32 atomics in another order, then the bf16 cast


def test_dot_scaled_auto_takes_the_decode_tiles_only(monkeypatch):
    """MOE_MXFP4_DOT_SCALED=auto (the default): tl.dot_scaled for 16-row tiles of at least 64 x 64 (faster
    there on an H100), the kernels' own dequantisation for taller tiles (faster or a tie) and for smaller
    ones (Triton 3.6 cannot lower their E2M1 conversion); fp32 activations never; 1 / 0 every / no tile."""
    from kernels.triton_moe import fused

    def tile(m, n, k):
        return {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k}
    assert fused.MXFP4_DOT_SCALED == "auto"
    form = fused.mxfp4_dot_scaled
    assert form(tile(16, 64, 64), torch.bfloat16) == "bf16" and form(tile(16, 128, 128), torch.float16) == "fp16"
    for m, n, k in ((64, 64, 64), (128, 128, 64), (16, 32, 128), (16, 64, 32), (16, 16, 32)):
        assert form(tile(m, n, k), torch.bfloat16) == "", (m, n, k)
    assert form(tile(16, 64, 64), torch.float32) == ""
    monkeypatch.setattr(fused, "MXFP4_DOT_SCALED", "1")
    assert form(tile(128, 16, 32), torch.bfloat16) == "bf16" and form(tile(16, 64, 64), torch.float32) == ""
    monkeypatch.setattr(fused, "MXFP4_DOT_SCALED", "0")
    assert form(tile(16, 64, 64), torch.bfloat16) == ""


def test_mxfp4_decode_tiles_take_swap_ab():
    """The untuned MXFP4 decode tiles, and the shipped H100 configs' 16-row ones, run SWAP_AB (1.16-1.22x
    at 1-64 tokens on an H100); 16-bit weights and taller tiles do not."""
    from kernels.triton_moe.config import CONFIG_DIR, default_config, split_config
    assert default_config(1, 32, 2880, 4, "mxfp4")["SWAP_AB"]
    assert "SWAP_AB" not in default_config(1, 32, 2880, 4, "bf16")
    assert "SWAP_AB" not in default_config(4096, 32, 2880, 4, "mxfp4")
    for path in CONFIG_DIR.glob("*dtype=mxfp4.json"):
        for m, cfg in json.loads(path.read_text()).items():
            up, down = split_config(cfg)
            assert up.get("SWAP_AB", False) == down.get("SWAP_AB", False) == (cfg["BLOCK_SIZE_M"] == 16), (path, m)
