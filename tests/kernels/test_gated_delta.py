"""The Gated DeltaNet kernels (kernels/gated_delta.py) against transformers' Qwen3-Next torch paths
(causal_conv1d_fn / causal_conv1d_update, torch_chunk_gated_delta_rule /
torch_recurrent_gated_delta_rule, Qwen3NextRMSNormGated), one sequence at a time, on flat batches
of mixed lengths; the state pool carried across calls, slots outside the batch untouched, the
chunked form against the token-by-token one, and the argument checks."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen, rms_norm_gated

_hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
# transformers routes these to flash-linear-attention / causal-conv1d where they are installed (GPU hosts,
# CUDA tensors only): the torch functions underneath are the reference.
hf = SimpleNamespace(Qwen3NextRMSNormGated=_hf.Qwen3NextRMSNormGated, **{
    name: inspect.unwrap(getattr(_hf, name)) for name in ("causal_conv1d_fn", "causal_conv1d_update",
                                                          "torch_chunk_gated_delta_rule",
                                                          "torch_recurrent_gated_delta_rule")})

HK, HV, DK, DV = 2, 4, 16, 8
C, K = 24, 4
N = 9  # pool slots, more than any batch uses
MIXED = [1, 2, 3, 5, 70]  # 70 crosses the 64-token chunk
MIXED_INITIAL = [True, False, True, False, True]


def _qsl(lens):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return qsl


def _delta_inputs(lens, seed, dtype=torch.float32, decay=2.0):
    """q, k [T, HK, DK], v [T, HV, DV] (dtype), g <= 0 fp32 [T, HV] (as the model computes it), beta [T, HV]."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k = (torch.randn(T, HK, DK, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(T, HV, DV, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(T, HV, generator=gen)) * decay
    beta = torch.rand(T, HV, generator=gen).to(dtype)
    return q, k, v, g, beta


def _pool(*shape, seed):
    return torch.randn(N, *shape, generator=torch.Generator().manual_seed(seed))


def _hf_delta(q, k, v, g, beta, qsl, pool, slots, initial, fn=None):
    """transformers' delta rule per sequence (recurrent for one token, chunked otherwise, or fn):
    outputs [T, HV, DV] and final states [B, HV, DK, DV]."""
    out, states = torch.empty(v.shape, dtype=q.dtype), []
    for b in range(len(qsl) - 1):
        s, e = qsl[b], qsl[b + 1]
        f = fn or (hf.torch_recurrent_gated_delta_rule if e - s == 1 else hf.torch_chunk_gated_delta_rule)
        init = pool[slots[b]][None] if initial[b] else None
        o, st = f(*(x[None, s:e] for x in (q, k, v, g, beta)), initial_state=init, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        out[s:e] = o[0]
        states.append(st[0])
    return out, torch.stack(states)


def _hf_conv(x, w, bias, qsl, pool, slots, initial, activation):
    """transformers' conv per sequence (update from the state, or fn from zeros): outputs [T, C] and
    the new states [B, C, K - 1]."""
    out, states = torch.empty_like(x), []
    for b in range(len(qsl) - 1):
        x_1CL = x[qsl[b]:qsl[b + 1]].T[None]
        if initial[b]:
            state = pool[slots[b]][None].clone()
            y = hf.causal_conv1d_update(x_1CL, state, w, bias, activation)
        else:
            y = hf.causal_conv1d_fn(x_1CL, w, bias, activation=activation)
            state = F.pad(x_1CL, (K - 1, 0))[..., -(K - 1):]
        out[qsl[b]:qsl[b + 1]] = y[0].T
        states.append(state[0].to(pool.dtype))
    return out, torch.stack(states)


# --- against transformers -------------------------------------------------------------------------

@pytest.mark.parametrize("lens,initial", [(MIXED, MIXED_INITIAL), ([1, 1, 1, 1], [True, False, True, True])])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, None)])
def test_conv_matches_transformers(lens, initial, dtype, tol, with_bias, activation):
    gen = torch.Generator().manual_seed(len(lens))
    x = torch.randn(sum(lens), C, generator=gen).to(dtype)
    w = (torch.randn(C, K, generator=gen) * 0.5).to(dtype)
    bias = torch.randn(C, generator=gen).to(dtype) if with_bias else None
    pool = _pool(C, K - 1, seed=1).to(dtype)
    slots = torch.tensor([7, 0, 3, 5, 2][:len(lens)])
    initial = torch.tensor(initial)
    qsl = _qsl(lens)
    want_y, want_states = _hf_conv(x, w, bias, qsl, pool, slots, initial, activation)
    y = causal_conv1d_varlen(x, w, bias, qsl, pool, slots, initial, activation)
    assert y.dtype == dtype
    torch.testing.assert_close(y, want_y, rtol=tol, atol=tol)
    torch.testing.assert_close(pool[slots], want_states, rtol=0, atol=0)  # copies of inputs: exact


@pytest.mark.parametrize("lens,initial", [(MIXED, MIXED_INITIAL), ([1, 1, 1], [True, False, True]),
                                          ([64, 65, 2], [False, True, True])])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_delta_rule_matches_transformers(lens, initial, dtype, tol):
    q, k, v, g, beta = _delta_inputs(lens, seed=sum(lens), dtype=dtype)
    pool = _pool(HV, DK, DV, seed=2)
    slots = torch.tensor([4, 8, 1, 6, 0][:len(lens)])
    initial = torch.tensor(initial)
    qsl = _qsl(lens)
    want_o, want_states = _hf_delta(q, k, v, g, beta, qsl, pool, slots, initial)
    o = gated_delta_rule_varlen(q, k, v, g, beta, qsl, pool, slots, initial)
    assert o.dtype == dtype
    torch.testing.assert_close(o, want_o, rtol=tol, atol=tol)
    # The maths is fp32 from the same (bf16) inputs either way: the states agree closely
    torch.testing.assert_close(pool[slots], want_states, rtol=1e-5, atol=1e-5)


def test_delta_rule_matches_transformers_recurrent_on_long_sequences():
    lens, initial = MIXED, torch.tensor(MIXED_INITIAL)
    q, k, v, g, beta = _delta_inputs(lens, seed=5)
    pool = _pool(HV, DK, DV, seed=3)
    slots = torch.arange(len(lens)) + 2
    qsl = _qsl(lens)
    want_o, want_states = _hf_delta(q, k, v, g, beta, qsl, pool, slots, initial, hf.torch_recurrent_gated_delta_rule)
    o = gated_delta_rule_varlen(q, k, v, g, beta, qsl, pool, slots, initial)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], want_states, rtol=1e-5, atol=1e-5)


def test_delta_rule_scale_without_l2norm():
    """scale replaces d ** -0.5 (transformers' fixed one: fed q pre-scaled to compare)."""
    lens, initial = [1, 9], torch.tensor([True, False])
    q, k, v, g, beta = _delta_inputs(lens, seed=6)
    k = k * 0.3  # unnormalised keys: kept small so that the delta rule stays stable
    pool = _pool(HV, DK, DV, seed=4)
    slots, qsl = torch.tensor([1, 3]), _qsl(lens)
    want = []
    for b, f in enumerate((hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule)):
        s, e = qsl[b], qsl[b + 1]
        want.append(f(q[None, s:e] * 0.7 * DK ** 0.5, *(x[None, s:e] for x in (k, v, g, beta)),
                      initial_state=pool[slots[b]][None] if initial[b] else None)[0][0])
    o = gated_delta_rule_varlen(q, k, v, g, beta, qsl, pool, slots, initial, scale=0.7, use_qk_l2norm=False)
    torch.testing.assert_close(o, torch.cat(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(7)
    x, z = (torch.randn(5, HV, DV, generator=gen).to(dtype) * 3 for _ in range(2))
    norm = hf.Qwen3NextRMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, generator=gen) + 1)
        want = norm(x.reshape(-1, DV), z.reshape(-1, DV)).reshape(x.shape)
    got = rms_norm_gated(x, z, norm.weight.detach(), 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- state across steps ---------------------------------------------------------------------------

# Two sequences over four calls: A in 7 + 1 + 1 + 30 tokens, B in 3 + 1 + 5 + 1 (mixed decode / prefill steps)
PIECES = [(7, 3), (1, 1), (1, 5), (30, 1)]
SLOTS = torch.tensor([5, 2])


def _pieces_qsl(step):
    return [0, step[0], step[0] + step[1]]


def _piece_rows(i):
    """Rows of step i's tokens in the whole sequences laid out as one batch [A (39), B (10)]."""
    a0, b0 = sum(p[0] for p in PIECES[:i]), sum(p[1] for p in PIECES[:i])
    return torch.cat([torch.arange(a0, a0 + PIECES[i][0]), 39 + torch.arange(b0, b0 + PIECES[i][1])])


def test_conv_state_carried_over_steps():
    gen = torch.Generator().manual_seed(8)
    x, w, bias = torch.randn(49, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    whole_pool = torch.zeros(N, C, K - 1)
    want = causal_conv1d_varlen(x, w, bias, [0, 39, 49], whole_pool, SLOTS, torch.tensor([False, False]))
    pool = torch.full((N, C, K - 1), float("nan"))  # the first step must not read it
    got = torch.empty_like(want)
    for i, step in enumerate(PIECES):
        rows = _piece_rows(i)
        got[rows] = causal_conv1d_varlen(x[rows], w, bias, _pieces_qsl(step), pool, SLOTS,
                                         torch.tensor([i > 0, i > 0]))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[SLOTS], whole_pool[SLOTS], rtol=0, atol=0)


def test_delta_rule_state_carried_over_steps():
    q, k, v, g, beta = _delta_inputs([39, 10], seed=9)
    whole_pool = _pool(HV, DK, DV, seed=10)
    want = gated_delta_rule_varlen(q, k, v, g, beta, [0, 39, 49], whole_pool, SLOTS, torch.tensor([True, False]))
    pool = _pool(HV, DK, DV, seed=10)  # same contents: A starts from its slot's state, B from zeros
    got = torch.empty_like(want)
    for i, step in enumerate(PIECES):
        rows = _piece_rows(i)
        got[rows] = gated_delta_rule_varlen(*(x[rows] for x in (q, k, v, g, beta)), _pieces_qsl(step), pool, SLOTS,
                                            torch.tensor([True, i > 0]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, whole_pool, rtol=1e-5, atol=1e-5)


# --- the pool: other slots, fresh sequences -------------------------------------------------------

def _sentinel_case(kernel):
    """Runs kernel on MIXED over slots 6, 1, 4, 0, 8 of a NaN-filled pool and of a zero one, every
    sequence fresh; returns (outputs, pool) of both."""
    slots, initial, qsl = torch.tensor([6, 1, 4, 0, 8]), torch.zeros(5, dtype=torch.bool), _qsl(MIXED)
    results = []
    for fill in (float("nan"), 0.0):
        if kernel == "conv":
            gen = torch.Generator().manual_seed(11)
            x, w = torch.randn(sum(MIXED), C, generator=gen), torch.randn(C, K, generator=gen)
            pool = torch.full((N, C, K - 1), fill)
            out = causal_conv1d_varlen(x, w, None, qsl, pool, slots, initial)
        else:
            pool = torch.full((N, HV, DK, DV), fill)
            out = gated_delta_rule_varlen(*_delta_inputs(MIXED, seed=12), qsl, pool, slots, initial)
        results.append((out, pool))
    return slots, results


@pytest.mark.parametrize("kernel", ["conv", "delta"])
def test_other_slots_untouched_and_fresh_sequences_ignore_their_slot(kernel):
    slots, [(out, pool), (out_zero, pool_zero)] = _sentinel_case(kernel)
    torch.testing.assert_close(out, out_zero, rtol=0, atol=0)  # NaN anywhere fails
    torch.testing.assert_close(pool[slots], pool_zero[slots], rtol=0, atol=0)
    others = torch.tensor([s for s in range(N) if s not in slots.tolist()])
    assert pool[others].isnan().all()


@pytest.mark.parametrize("kernel", ["conv", "delta"])
def test_zero_token_sequence_keeps_or_clears_its_state(kernel):
    shape = (C, K - 1) if kernel == "conv" else (HV, DK, DV)
    pool = _pool(*shape, seed=13)
    before = pool.clone()
    slots, initial, qsl = torch.tensor([3, 5, 7]), torch.tensor([True, False, True]), [0, 0, 0, 2]
    if kernel == "conv":
        causal_conv1d_varlen(torch.randn(2, C), torch.randn(C, K), None, qsl, pool, slots, initial)
    else:
        gated_delta_rule_varlen(*_delta_inputs([2], seed=14), qsl, pool, slots, initial)
    assert torch.equal(pool[3], before[3]) and not pool[5].any()
    assert not torch.allclose(pool[7], before[7])


# --- chunked against token by token ---------------------------------------------------------------

def _token_by_token(q, k, v, g, beta, lens, pool, slots, initial):
    """Our kernel fed one token per sequence per call (its decode path), carrying the states."""
    qsl = _qsl(lens)
    out = torch.empty(v.shape, dtype=q.dtype)
    for t in range(max(lens)):
        live = [b for b, n in enumerate(lens) if n > t]
        rows = torch.tensor([qsl[b] + t for b in live])
        out[rows] = gated_delta_rule_varlen(*(x[rows] for x in (q, k, v, g, beta)), list(range(len(live) + 1)), pool,
                                            slots[live], initial[live] | (t > 0))
    return out


@pytest.mark.parametrize("chunk_size", [64, 16, 7])
@pytest.mark.parametrize("decay", [2.0, 30.0])  # 30: exp(cumulative decay) underflows within a chunk
def test_chunked_matches_token_by_token(chunk_size, decay):
    lens, initial = [64, 65, 3, 130, 1], torch.tensor([True, False, True, True, False])
    q, k, v, g, beta = _delta_inputs(lens, seed=15, decay=decay)
    slots = torch.tensor([2, 7, 0, 4, 5])
    pool_step = _pool(HV, DK, DV, seed=16)
    pool_chunk = pool_step.clone()
    want = _token_by_token(q, k, v, g, beta, lens, pool_step, slots, initial)
    got = gated_delta_rule_varlen(q, k, v, g, beta, _qsl(lens), pool_chunk, slots, initial, chunk_size=chunk_size)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool_chunk, pool_step, rtol=1e-5, atol=1e-5)


# --- bad arguments ---------------------------------------------------------------------------------

def _conv_args(**over):
    args = dict(x_TC=torch.randn(6, C), weight_CK=torch.randn(C, K), bias_C=torch.randn(C), query_start_loc=[0, 2, 6],
                conv_state_NCS=torch.zeros(N, C, K - 1), slots_B=torch.tensor([0, 1]),
                has_initial_B=torch.tensor([False, True]))
    return {**args, **over}


def _delta_args(**over):
    q, k, v, g, beta = _delta_inputs([2, 4], seed=17)
    args = dict(q_TKd=q, k_TKd=k, v_TVe=v, g_TV=g, beta_TV=beta, query_start_loc=[0, 2, 6],
                ssm_state_NVde=torch.zeros(N, HV, DK, DV), slots_B=torch.tensor([0, 1]),
                has_initial_B=torch.tensor([False, True]))
    return {**args, **over}


@pytest.mark.parametrize("over,match", [
    (dict(x_TC=torch.randn(1, 6, C)), r"x_TC must be \[T, C\]"),
    (dict(weight_CK=torch.randn(C, 1, K)), r"weight_CK must be \[C=24, K\]"),
    (dict(weight_CK=torch.randn(C + 1, K)), r"weight_CK must be \[C=24, K\]"),
    (dict(bias_C=torch.randn(C - 1)), r"bias_C must be \[C=24\]"),
    (dict(conv_state_NCS=torch.zeros(N, C, K)), r"conv_state_NCS must be \[N, C=24, S=3\]"),
    (dict(activation="gelu"), "activation must be 'silu' or None"),
    (dict(query_start_loc=[0, 2, 5]), "query_start_loc must run from 0 to T=6"),
    (dict(query_start_loc=[0, 6]), r"query_start_loc has 2 offsets, expected B \+ 1 = 3"),
    (dict(query_start_loc=[0, 4, 2, 6], slots_B=torch.tensor([0, 1, 2]), has_initial_B=torch.zeros(3, dtype=bool)),
     "query_start_loc must be non-decreasing"),
    (dict(slots_B=torch.tensor([0.0, 1.0])), "slots_B must be an int64"),
    (dict(has_initial_B=torch.tensor([0, 1])), r"has_initial_B must be a bool \[B=2\]"),
])
def test_conv_bad_arguments_raise(over, match):
    with pytest.raises(ValueError, match=match):
        causal_conv1d_varlen(**_conv_args(**over))


@pytest.mark.parametrize("over,match", [
    (dict(q_TKd=torch.randn(6, HK * DK)), r"q_TKd and k_TKd must both be \[T, K, d\]"),
    (dict(k_TKd=torch.randn(6, HK, DK + 1)), r"q_TKd and k_TKd must both be \[T, K, d\]"),
    (dict(v_TVe=torch.randn(5, HV, DV)), r"v_TVe must be \[T=6, V, e\]"),
    (dict(v_TVe=torch.randn(6, 3, DV)), r"value heads \(3\) must be a multiple of the key heads \(2\)"),
    (dict(g_TV=torch.zeros(6, HV, 1)), r"g_TV must be \[T=6, V=4\]"),
    (dict(beta_TV=torch.zeros(6, HK)), r"beta_TV must be \[T=6, V=4\]"),
    (dict(ssm_state_NVde=torch.zeros(N, HV, DV, DK + 1)), r"ssm_state_NVde must be \[N, V=4, d=16, e=8\]"),
    (dict(ssm_state_NVde=torch.zeros(N, HV, DK, DV, dtype=torch.bfloat16)), "ssm_state_NVde must be float32"),
    (dict(chunk_size=0), "chunk_size must be positive"),
    (dict(query_start_loc=[0, 2, 7]), "query_start_loc must run from 0 to T=6"),
    (dict(query_start_loc=[0, 1, 2, 6]), r"query_start_loc has 4 offsets, expected B \+ 1 = 3"),
    (dict(query_start_loc=[0, 4, 2, 6], slots_B=torch.tensor([0, 1, 2]), has_initial_B=torch.zeros(3, dtype=bool)),
     "query_start_loc must be non-decreasing"),
    (dict(slots_B=torch.tensor([[0, 1]])), "slots_B must be an int64 \\[B\\]"),
    (dict(has_initial_B=torch.tensor([True])), r"has_initial_B must be a bool \[B=2\]"),
])
def test_delta_rule_bad_arguments_raise(over, match):
    with pytest.raises(ValueError, match=match):
        gated_delta_rule_varlen(**_delta_args(**over))


@pytest.mark.parametrize("x,z,w,match", [
    (torch.randn(3, DV), torch.randn(3, DV + 1), torch.ones(DV), "z must have x's shape"),
    (torch.randn(3, DV), torch.randn(3, DV), torch.ones(DV + 1), r"weight_e must be \[e=8\]"),
])
def test_rms_norm_gated_bad_arguments_raise(x, z, w, match):
    with pytest.raises(ValueError, match=match):
        rms_norm_gated(x, z, w, 1e-6)
