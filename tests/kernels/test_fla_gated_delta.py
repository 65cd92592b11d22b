"""The opt-in prefill path through fla-core's chunked gated delta rule (kernels/fla_gated_delta.py)
against the torch reference (kernels/gated_delta.py): a step's decodes and prefills split to the
recurrent and the chunked kernel, sequences with and without a carried state, final states written
to their slots and no other slot touched. On the CPU the split runs with the reference in both
kernels' places; with a GPU and fla-core, through the real ones on Qwen3-Next's head shapes."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kernels import fla_gated_delta
from kernels.gated_delta import gated_delta_rule_varlen

HK, HV, DK, DV = 16, 32, 128, 128
LENS = [1, 70, 300, 1, 129]  # two decodes among prefills
INITIAL = [True, False, True, True, False]
SLOTS = [3, 0, 6, 1, 4]  # 2, 5 and 7 stay out of the batch
N = 8


def test_off_unless_asked(monkeypatch):
    fla_gated_delta._chunk_kernel.cache_clear()
    monkeypatch.delenv("MOE_FLA_PREFILL", raising=False)
    try:
        assert not fla_gated_delta.fla_prefill_available()
        with pytest.raises(RuntimeError, match="fla-core"):
            fla_gated_delta.gated_delta_rule_chunked_fla(*[None] * 10, scale=1.0)
    finally:
        fla_gated_delta._chunk_kernel.cache_clear()


def _torch_chunk_kernel(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        cu_seqlens, cu_seqlens_cpu):
    """fla-core's chunk_gated_delta_rule signature over the torch reference (CPU tests of the split)."""
    pool = initial_state.clone()
    n = pool.shape[0]
    o = gated_delta_rule_varlen(q[0], k[0], v[0], g[0], beta[0], cu_seqlens_cpu.tolist(), pool, torch.arange(n),
                                torch.ones(n, dtype=torch.bool), scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel)
    return o[None], pool


def _inputs(dev, hk, hv, dk, dv):
    torch.manual_seed(0)
    T = sum(LENS)
    q = torch.randn(T, hk, dk, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hk, dk, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, hv, dv, device=dev, dtype=torch.bfloat16)
    g = -torch.exp(torch.randn(hv, device=dev)) * F.softplus(torch.randn(T, hv, device=dev))  # log decay, <= 0
    beta = torch.sigmoid(torch.randn(T, hv, device=dev)).to(torch.bfloat16)
    pool = torch.randn(N, hv, dk, dv, device=dev) * 0.1
    for s, init in zip(SLOTS, INITIAL):
        if not init:
            pool[s] = float("nan")  # a fresh sequence's slot must read as zeros
    return q, k, v, g, beta, pool


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_split_sends_decodes_and_prefills_their_ways(monkeypatch):
    """Decode rows to the recurrent kernel, prefill rows to the chunked one, each sequence with its own
    slot: the result is the reference's over the whole batch (here both kernels are the reference)."""
    monkeypatch.setattr(fla_gated_delta, "_chunk_kernel", lambda: _torch_chunk_kernel)
    q, k, v, g, beta, pool = _inputs("cpu", 2, 4, 16, 16)
    qsl = [0]
    for n in LENS:
        qsl.append(qsl[-1] + n)
    slots, has_initial = torch.tensor(SLOTS), torch.tensor(INITIAL)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = gated_delta_rule_varlen(q, k, v, g, beta, qsl, ref_pool, slots, has_initial)
    decoded = []

    def recurrent(q, k, v, g, beta, qsl_t, pool, slots, init, scale, use_qk_l2norm):
        decoded.append(len(slots))
        return gated_delta_rule_varlen(q, k, v, g, beta, qsl_t.tolist(), pool, slots, init, scale=scale,
                                       use_qk_l2norm=use_qk_l2norm)

    split = fla_gated_delta.PrefillSplit(qsl, slots, has_initial)
    got = fla_gated_delta.gated_delta_rule_prefill_split(q, k, v, g, beta, split, got_pool, recurrent,
                                                         scale=16 ** -0.5)
    assert decoded == [LENS.count(1)]
    assert _rel(got, ref) < 1e-5 and _rel(got_pool[slots], ref_pool[slots]) < 1e-5
    untouched = [i for i in range(N) if i not in SLOTS]
    assert torch.equal(got_pool[untouched], pool[untouched])


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs a CUDA GPU and fla-core")
def test_split_through_fla_and_the_recurrent_kernel_matches_the_reference(monkeypatch):
    from kernels.triton_gated_delta import gated_delta_rule_recurrent_triton

    monkeypatch.setenv("MOE_FLA_PREFILL", "1")
    fla_gated_delta._chunk_kernel.cache_clear()
    dev = "cuda"
    q, k, v, g, beta, pool = _inputs(dev, HK, HV, DK, DV)
    qsl = [0]
    for n in LENS:
        qsl.append(qsl[-1] + n)
    slots, has_initial = torch.tensor(SLOTS, device=dev), torch.tensor(INITIAL, device=dev)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = gated_delta_rule_varlen(q, k, v, g, beta, qsl, ref_pool, slots, has_initial)
    try:
        assert fla_gated_delta.fla_prefill_available()
        split = fla_gated_delta.PrefillSplit(qsl, slots, has_initial)
        got = fla_gated_delta.gated_delta_rule_prefill_split(q, k, v, g, beta, split, got_pool,
                                                             gated_delta_rule_recurrent_triton, scale=DK ** -0.5)
    finally:
        fla_gated_delta._chunk_kernel.cache_clear()
    assert got.shape == ref.shape and got.dtype == v.dtype
    assert _rel(got, ref) < 1e-2
    assert _rel(got_pool[slots], ref_pool[slots]) < 1e-2
    untouched = [i for i in range(N) if i not in SLOTS]
    assert torch.equal(got_pool[untouched], pool[untouched])
