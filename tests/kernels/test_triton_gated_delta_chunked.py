"""The chunked gated delta rule (kernels/triton_gated_delta_chunked.py) against the naive per-token
loop (float64) of tests/kernels/test_triton_gated_delta.py, on the interpreter without a GPU and on
the GPU where there is one (there also at Qwen3-Next's shapes against the recurrent kernel, and a
CUDA-graph replay over a new batch layout).

The batches mix decodes, sequences walked token by token (shorter than recurrent_below), a zero-token
one, and sequences of several chunks with a partial last chunk, with has_initial mixed; fresh
sequences' slots hold NaN (must read as zeros), slots outside the batch a sentinel.
"""
from __future__ import annotations

import pytest
import torch

from kernels.gated_delta import gated_delta_rule_varlen
from kernels.triton_gated_delta import gated_delta_rule_recurrent_triton
from kernels.triton_gated_delta_chunked import gated_delta_rule_chunked_triton
from tests.kernels.test_triton_gated_delta import (HK, HV, DK, DV, N, assert_outside_untouched, batch_args,
                                                   delta_case, delta_inputs, dev_copy, make_pool, naive_delta,
                                                   qsl_of)
from tests.kernels.triton_marks import DEV, needs_cuda, needs_triton_device

pytestmark = needs_triton_device

LENS = [1, 35, 3, 0, 16, 17, 2]  # decode; 3 chunks of 16 (the last of 3 tokens); short; none; 1 chunk; 1 + 1 token
INITIAL = [True, False, True, True, True, False, False]
SLOTS = [7, 2, 4, 9, 0, 5, 8]  # 1, 3, 6 stay out of the batch


def run_chunked(inputs, qsl, pool, slots=SLOTS, initial=INITIAL, **kw):
    kw = {"chunk_size": 16, "block_v": 16, "recurrent_below": 3, "precision": "ieee", **kw}
    return gated_delta_rule_chunked_triton(*(t.to(DEV) for t in inputs), qsl, pool, *batch_args(slots, initial), **kw)


@pytest.mark.parametrize("use_qk_l2norm,scale", [(True, None), (False, 0.3)])
def test_chunked_matches_token_loop(use_qk_l2norm, scale):
    inputs, qsl, pool0, pool = delta_case(LENS, SLOTS, INITIAL, 21, use_qk_l2norm)
    o = run_chunked(inputs, qsl, pool, scale=scale, use_qk_l2norm=use_qk_l2norm)
    want_o, want_pool = naive_delta(*inputs, qsl, pool0, SLOTS, INITIAL, scale, use_qk_l2norm)
    assert o.dtype == torch.float32 and o.shape == (sum(LENS), HV, DV)
    torch.testing.assert_close(o.cpu().double(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool.cpu().double()[SLOTS], want_pool[SLOTS], atol=2e-5, rtol=2e-5)
    assert_outside_untouched(pool, pool0, SLOTS)


@pytest.mark.parametrize("chunk_size,block_v,recurrent_below", [(32, 16, 1), (64, 32, 8), (16, 16, 100)])
def test_chunk_sizes_value_blocks_and_the_token_walk(chunk_size, block_v, recurrent_below):
    """Odd dims (masked lanes, a partial value block), 3 value heads a key head; every sequence
    chunked (recurrent_below 1: decodes too, the most chunks phase 1's grid allows), the usual split,
    or every one walked token by token."""
    Hk, Hv, Dk, Dv = 1, 3, 12, 20
    lens, initial, slots = [40, 1, 70, 5], [True, False, True, False], [6, 0, 3, 9]
    inputs = delta_inputs(lens, seed=23, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv)
    pool0 = make_pool((Hv, Dk, Dv), slots, initial, seed=24)
    pool = dev_copy(pool0)
    o = run_chunked(inputs, qsl_of(lens), pool, slots, initial, chunk_size=chunk_size, block_v=block_v,
                    recurrent_below=recurrent_below)
    want_o, want_pool = naive_delta(*inputs, qsl_of(lens), pool0, slots, initial)
    torch.testing.assert_close(o.cpu().double(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool.cpu().double()[slots], want_pool[slots], atol=2e-5, rtol=2e-5)


def test_aligned_keys_without_decay():
    """Keys all near one direction, beta near 1, almost no decay: A's powers stay large up to the
    chunk's length, so every factor of the inverse counts (a missing one shows here, not with
    random keys, whose powers vanish)."""
    lens = [64]
    q, k, v, g, beta = delta_inputs(lens, seed=32)
    k = torch.randn(1, HK, DK) + 0.05 * k
    beta = 0.8 + 0.2 * beta
    g = g * 0.001
    pool0 = make_pool((HV, DK, DV), [1], [True], seed=33)
    pool = dev_copy(pool0)
    o = run_chunked((q, k, v, g, beta), qsl_of(lens), pool, [1], [True], chunk_size=64, block_v=16)
    want_o, want_pool = naive_delta(q, k, v, g, beta, qsl_of(lens), pool0, [1], [True])
    torch.testing.assert_close(o.cpu().double(), want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool.cpu().double()[1], want_pool[1], atol=1e-4, rtol=1e-4)


def test_strong_decay_and_padding_rows_stay_finite():
    """A decay of exp(-30) a token: the masked exponents never overflow; rows past the batch are zeros
    and negative slots (graph padding) are written nowhere."""
    lens, slots, initial = [33, 1, 1], [4, -1, 2], [True, True, False]
    q, k, v, g, beta = delta_inputs(lens, seed=25)
    g = torch.full_like(g, -30.0)
    spare = 2
    pad = [torch.cat([t, torch.zeros(spare, *t.shape[1:], dtype=t.dtype)]) for t in (q, k, v, g, beta)]
    pool0 = make_pool((HV, DK, DV), [4, 2], [True, False], seed=26)
    pool = dev_copy(pool0)
    o = gated_delta_rule_chunked_triton(*(t.to(DEV) for t in pad), torch.tensor(qsl_of(lens), device=DEV), pool,
                                        *batch_args(slots, initial), chunk_size=16, block_v=16, precision="ieee")
    want_o, want_pool = naive_delta(q, k, v, g, beta, qsl_of(lens), pool0, [4, 0, 2], initial)
    T = sum(lens)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o[:T].cpu().double(), want_o, atol=2e-5, rtol=2e-5)
    assert (o[T:] == 0).all(), "a spare row is not zero"
    torch.testing.assert_close(pool.cpu().double()[[4, 2]], want_pool[[4, 2]], atol=2e-5, rtol=2e-5)
    assert_outside_untouched(pool, pool0, [4, 2])


def test_state_carried_over_chunks_of_calls_equals_one_call():
    """A prompt fed as two prefill chunks (a step's worth each, the second from the first's state)
    gives what one call gives."""
    lens = [50]
    inputs = delta_inputs(lens, seed=27)
    pool0 = make_pool((HV, DK, DV), [3], [False], seed=28)
    whole = dev_copy(pool0)
    o_whole = run_chunked(inputs, qsl_of(lens), whole, [3], [False])
    parts = dev_copy(pool0)
    o1 = run_chunked(tuple(t[:21] for t in inputs), qsl_of([21]), parts, [3], [False])
    o2 = run_chunked(tuple(t[21:] for t in inputs), qsl_of([29]), parts, [3], [True])
    torch.testing.assert_close(torch.cat([o1, o2]), o_whole, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(parts, whole, atol=2e-5, rtol=2e-5)


def test_rejects_bad_arguments():
    lens = [5]
    inputs = delta_inputs(lens, seed=0)
    pool = torch.zeros(N, HV, DK, DV, device=DEV)
    for kw, match in [(dict(chunk_size=24), "chunk_size"), (dict(block_v=8), "block_v"),
                      (dict(recurrent_below=0), "recurrent_below"), (dict(precision="bf16"), "precision")]:
        with pytest.raises(ValueError, match=match):
            run_chunked(inputs, qsl_of(lens), pool, [0], [False], **kw)
    with pytest.raises(ValueError, match="v_TVe"):
        run_chunked(inputs[:2] + (inputs[2][:, :, :3].transpose(0, 1),) + inputs[3:], qsl_of(lens), pool, [0], [False])


# --- on a GPU: real shapes, the default precision, graphs -------------------------------------------

@needs_cuda
@pytest.mark.parametrize("precision,tol", [("tf32x3", 2e-4), ("ieee", 2e-4), ("tf32", 3e-2)])
def test_qwen3_next_shapes_against_reference(precision, tol):
    """16 key / 32 value heads of 128, bf16 inputs: a 300-token prefill from a state, a fresh 77-token
    one and decodes, against the torch reference (fp32) and the recurrent kernel."""
    Hk, Hv, D = 16, 32, 128
    lens, initial, slots = [300, 1, 77, 1], [True, True, False, False], [5, 2, 8, 0]
    inputs = delta_inputs(lens, seed=29, Hk=Hk, Hv=Hv, Dk=D, Dv=D, dtype=torch.bfloat16)
    pool0 = make_pool((Hv, D, D), slots, initial, seed=30)
    ref_pool = pool0.clone()
    ref = gated_delta_rule_varlen(*inputs, qsl_of(lens), ref_pool, torch.tensor(slots), torch.tensor(initial))
    pool = dev_copy(pool0)
    o = gated_delta_rule_chunked_triton(*(t.cuda() for t in inputs), qsl_of(lens), pool, *batch_args(slots, initial),
                                        precision=precision)
    rel = ((o.float().cpu() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < tol, rel
    state_rel = ((pool.cpu()[slots] - ref_pool[slots]).norm() / ref_pool[slots].norm()).item()
    assert state_rel < tol, state_rel
    rec_pool = dev_copy(pool0)
    rec = gated_delta_rule_recurrent_triton(*(t.cuda() for t in inputs), qsl_of(lens), rec_pool,
                                            *batch_args(slots, initial))
    assert ((o.float() - rec.float()).norm() / rec.float().norm()).item() < tol


@needs_cuda
def test_cuda_graph_replays_for_a_new_batch_layout():
    """Captured on one layout (offsets, slots and has_initial in device buffers), replayed on
    another of the same token count: equal to an eager call on the new layout."""
    T, B = 96, 4
    inputs = [t.cuda() for t in delta_inputs([T], seed=31)]
    qsl = torch.tensor(qsl_of([90, 2, 3, 1]), dtype=torch.int32, device="cuda")
    slots = torch.tensor([0, 1, 2, 3], device="cuda")
    init = torch.tensor([False, True, True, False], device="cuda")
    pool = torch.randn(N, HV, DK, DV, device="cuda") * 0.1
    graph_pool = pool.clone()
    o = gated_delta_rule_chunked_triton(*inputs, qsl, graph_pool, slots, init)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = gated_delta_rule_chunked_triton(*inputs, qsl, graph_pool, slots, init)
    new = [qsl_of([1, 40, 50, 5]), [4, 2, 7, 9], [True, False, True, True]]
    qsl.copy_(torch.tensor(new[0], dtype=torch.int32))
    slots.copy_(torch.tensor(new[1]))
    init.copy_(torch.tensor(new[2]))
    graph_pool.copy_(pool)
    graph.replay()
    eager_pool = pool.clone()
    want = gated_delta_rule_chunked_triton(*inputs, qsl, eager_pool, slots, init)
    torch.testing.assert_close(o, want, atol=0, rtol=0)
    torch.testing.assert_close(graph_pool, eager_pool, atol=0, rtol=0)
    assert B == len(new[1])
