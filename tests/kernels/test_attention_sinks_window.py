"""Attention sinks and sliding windows (gpt-oss) in every paged-attention path: the torch reference,
the batched CPU path (native decode kernel on and off) and the three Triton kernels (split-KV
decode, varlen prefill, unified), against a dense naive attention (attention_cases.dense_attention)
as transformers' gpt-oss eager_attention_forward computes it (mask kv_idx > q_idx - W, the sink logit as one more
softmax column, dropped before the values).

Windows smaller than a block, spanning several blocks, spanning several key tiles (so that the
kernels' unmasked middle phase runs) and longer than any context; decode rows, fresh prefills,
chunked prefills over cached context, sequences shorter than the window, GQA. For the Triton
kernels, cache slots before each sequence's first visible key are NaN: a kernel that reads them
(even masked) fails. Without a GPU the kernels run under TRITON_INTERPRET=1
(tests/kernels/conftest.py) on tiny shapes.
Legend: T query tokens, B sequences, H query heads, G KV heads, d head dim, S block size, W window.
"""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.attention import paged_attention_torch, round_trip_kv
from kernels.cpu_attention import paged_attention_cpu
from kernels.triton_attention.decode import paged_attention_decode_triton
from kernels.triton_attention.prefill import paged_attention_prefill_triton
from kernels.triton_attention.unified import unified_attention_triton
from tests.kernels.attention_cases import PagedBatch, dense_attention, paged_batch
from tests.kernels.test_fp8_kv_cache import K_SCALE, V_SCALE, quantize_cache
from tests.kernels.triton_marks import DEV, needs_cuda, needs_triton_device

S = 4  # block size
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}  # several key tiles per sequence
TOL = dict(atol=2e-5, rtol=2e-5)
# (window, sinks): sinks alone, then windows below a block, over several blocks, over several 16-key
# tiles, and beyond every context, each with and without sinks.
CASES = [(None, True)] + [(w, s) for w in (3, 10, 40, 1000) for s in (False, True)]
CASE_IDS = [f"W{w}-{'sinks' if s else 'nosinks'}" for w, s in CASES]
# (cached, new): decode rows (one of a single token, one shorter than most windows, others around
# block edges), fresh prompts, chunked prefills over cached context (mid-block, on a block edge,
# crossing windows), a sequence with no query this step.
MIXED = [(15, 1), (0, 1), (9, 7), (16, 11), (0, 13), (2, 1), (32, 1), (5, 0), (44, 19), (0, 3), (51, 1)]


def expected(batch: PagedBatch, window, sinks_H, kv_dtype=None):
    """dense_attention over every sequence's keys ([T, H, d] fp32); kv_dtype: as an FP8 cache gives them back."""
    outs = []
    for q, k, v in batch.contexts:
        if kv_dtype is not None:
            k, v = round_trip_kv(k, kv_dtype, K_SCALE), round_trip_kv(v, kv_dtype, V_SCALE)
        if q.shape[0]:
            outs.append(dense_attention(q, k, v, batch.scale, window=window, sinks_H=sinks_H))
    return torch.cat(outs).float()


def make_sinks(H, on, seed=0):
    """Sink logits around the scores' range (q.k * scale ~ N(0, 1)), so that they matter."""
    if not on:
        return None
    return torch.empty(H).uniform_(-1.0, 3.0, generator=torch.Generator().manual_seed(seed))


def poisoned(batch: PagedBatch, window):
    """The cache with NaN at every key before each sequence's first query's window: never read."""
    cache = batch.cache.clone()
    if window is None:
        return cache
    for b, (q, k, _) in enumerate(batch.contexts):
        for p in range(max(0, k.shape[0] - q.shape[0] - window + 1)):
            cache[:, batch.meta.block_tables_BM[b, p // S], p % S] = float("nan")
    return cache


def layout(batch: PagedBatch):
    """Block tables, query_start_loc and seq_lens on the device, as the model runner gives them."""
    meta = batch.meta
    return (meta.block_tables_BM.to(DEV), torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEV),
            torch.tensor(meta.seq_lens, dtype=torch.int32, device=DEV))


def on_dev(sinks_H):
    return None if sinks_H is None else sinks_H.to(DEV)


# --- the torch reference and the CPU path ----------------------------------------------------------

@pytest.fixture(params=["native", "torch"])
def native_decode(request, monkeypatch):
    """The CPU path's decode rows through the native kernel (where it builds) or its torch twin."""
    if request.param == "native" and cpu_native.library() is None:
        pytest.skip("no C compiler: the native kernels did not build")
    if request.param == "torch":
        monkeypatch.setattr(cpu_native, "library", lambda: None)


@pytest.mark.parametrize("window,sinks_on", CASES + [(1, True), (4, False)], ids=CASE_IDS + ["W1-sinks", "W4"])
@pytest.mark.parametrize("H,G", [(4, 2), (4, 4)])
def test_reference_and_cpu_match_naive(window, sinks_on, H, G, native_decode):
    batch = paged_batch(MIXED, S, H, G, d=8, seed=H + G, stale_cache=True)  # unmasked stray reads: wrong values
    sinks = make_sinks(H, sinks_on)
    want = expected(batch, window, sinks)
    args = (batch.q, batch.k_new, batch.v_new, batch.cache, batch.meta, batch.scale)
    ref = paged_attention_torch(*args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(ref, want, **TOL)
    out = paged_attention_cpu(*args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, want, **TOL)


def test_cpu_fresh_prefills_padded_and_back_to_back():
    """Fresh prompts of mixed lengths (padded groups) and of one length back to back (views)."""
    sinks = make_sinks(4, True, seed=3)
    for seqs in ([(0, 16), (0, 15), (0, 14), (0, 5), (0, 1)], [(0, 12)] * 4):
        batch = paged_batch(seqs, S, 4, 2, d=8, seed=len(seqs))
        args = (batch.q, batch.k_new, batch.v_new, batch.cache, batch.meta, batch.scale)
        for window in (5, None):
            out = paged_attention_cpu(*args, sliding_window=window, sinks=sinks)
            torch.testing.assert_close(out, expected(batch, window, sinks), **TOL)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reference_and_cpu_fp8_cache(kv_dtype, native_decode):
    batch = paged_batch(MIXED, S, 4, 2, d=8, seed=4, stale_cache=True)
    cache8 = quantize_cache(batch.cache, kv_dtype)
    sinks = make_sinks(4, True, seed=4)
    want = expected(batch, 10, sinks, kv_dtype)
    for attend in (paged_attention_torch, paged_attention_cpu):
        out = attend(batch.q, batch.k_new, batch.v_new, cache8, batch.meta, batch.scale, None, K_SCALE, V_SCALE,
                     sliding_window=10, sinks=sinks)
        torch.testing.assert_close(out, want, **TOL)


def test_cpu_sinks_of_minus_infinity_are_no_sinks():
    batch = paged_batch(MIXED, S, 4, 2, d=8, seed=6)
    args = (batch.q, batch.k_new, batch.v_new, batch.cache, batch.meta, batch.scale)
    none = paged_attention_cpu(*args, sliding_window=10)
    out = paged_attention_cpu(*args, sliding_window=10, sinks=torch.full((4,), float("-inf")))
    torch.testing.assert_close(out, none, **TOL)


# --- Triton: split-KV decode -----------------------------------------------------------------------

DECODE_LENS = [37, 0, 1, 16, 17, 3, 50, 0, 9]  # 0: padding rows (zeros out, nothing read)


def decode_case(lens, H, G, d, seed):
    """A decode batch (one query per sequence; seq_lens 0 rows are padding) as the kernel takes it:
    (batch of the real rows, q [B, H, d], tables, seq_lens, real rows' indices)."""
    batch = paged_batch([(L - 1, 1) for L in lens if L], S, H, G, d, seed=seed, stale_cache=True)
    rows = [b for b, L in enumerate(lens) if L]
    q = torch.zeros(len(lens), H, d)
    q[rows] = batch.q
    tables = torch.zeros(len(lens), batch.meta.block_tables_BM.shape[1], dtype=torch.int32)
    tables[rows] = batch.meta.block_tables_BM.to(torch.int32)
    return batch, q, tables, torch.tensor(lens, dtype=torch.int32), rows


def decode(lens, H, G, window, sinks, seed=0, kv_dtype=None, **kw):
    """(kernel output [B, H, d] on the CPU, naive expectation) of a decode batch."""
    batch, q, tables, seq_lens, rows = decode_case(lens, H, G, 16, seed)
    cache = poisoned(batch, window)
    scales = {}
    if kv_dtype is not None:
        cache, scales = quantize_cache(cache, kv_dtype), {"k_scale": K_SCALE, "v_scale": V_SCALE}
    out = paged_attention_decode_triton(q.to(DEV), cache.to(DEV), tables.to(DEV), seq_lens.to(DEV), batch.scale,
                                        block_n=16, sliding_window=window, sinks=on_dev(sinks), **scales, **kw)
    want = torch.zeros(len(lens), H, 16)
    want[rows] = expected(batch, window, sinks, kv_dtype)
    return out.cpu(), want


# Every case in 3 splits merged by the last program; a few in one split and in 4 merged by the merge kernel.
DECODE_CASES = ([(w, s, 3, True) for w, s in CASES] + [(w, True, 1, None) for w in (None, 3, 40)]
                + [(w, True, 4, False) for w in (None, 10, 1000)])


@needs_triton_device
@pytest.mark.parametrize("window,sinks_on,num_splits,fused_merge", DECODE_CASES,
                         ids=[f"W{w}-{'sinks' if s else 'nosinks'}-P{p}-{'fused' if f else 'kernel'}"
                              for w, s, p, f in DECODE_CASES])
def test_decode_kernel(window, sinks_on, num_splits, fused_merge):
    """One split (the sink before the one normalisation) and several (the sink in the merge: the
    last program's or the merge kernel's)."""
    H, G = 4, 2
    sinks = make_sinks(H, sinks_on, seed=num_splits)
    out, want = decode(DECODE_LENS, H, G, window, sinks, seed=num_splits, num_splits=num_splits,
                       fused_merge=fused_merge)
    torch.testing.assert_close(out, want, **TOL)


@needs_triton_device
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_kernel_fp8_cache(kv_dtype):
    sinks = make_sinks(8, True, seed=8)
    out, want = decode(DECODE_LENS, 8, 2, 10, sinks, seed=8, kv_dtype=kv_dtype, num_splits=3)
    torch.testing.assert_close(out, want, **TOL)


# --- Triton: varlen prefill and unified ------------------------------------------------------------

def varlen(kernel, seqs, H, G, window, sinks, seed=0, kv_dtype=None, **kw):
    """(kernel output [T, H, d] on the CPU, naive expectation) of a mixed batch."""
    batch = paged_batch(seqs, S, H, G, 16, seed=seed, stale_cache=True)
    cache = poisoned(batch, window)
    scales = {}
    if kv_dtype is not None:
        cache, scales = quantize_cache(cache, kv_dtype), {"k_scale": K_SCALE, "v_scale": V_SCALE}
    tables, qsl, lens = layout(batch)
    q = batch.q.to(DEV)
    if kernel is paged_attention_prefill_triton:
        out = kernel(q, cache.to(DEV), tables, qsl, lens, max(n for _, n in seqs), batch.scale, config=SMALL,
                     sliding_window=window, sinks=on_dev(sinks), **scales, **kw)
    else:
        out = kernel(q, cache.to(DEV), tables, qsl, lens, batch.scale, config={"BLOCK_N": 16, "num_stages": 1},
                     sliding_window=window, sinks=on_dev(sinks), **scales, **kw)
    return out.cpu(), expected(batch, window, sinks, kv_dtype)


@needs_triton_device
@pytest.mark.parametrize("window,sinks_on", CASES, ids=CASE_IDS)
def test_prefill_kernel(window, sinks_on):
    """8 queries x 2 heads a tile, 16-key tiles: rows of one tile start their windows at different keys."""
    sinks = make_sinks(4, sinks_on, seed=1)
    out, want = varlen(paged_attention_prefill_triton, MIXED, 4, 2, window, sinks, seed=1)
    torch.testing.assert_close(out, want, **TOL)


UNIFIED_CASES = [(w, s, False) for w, s in CASES] + [(w, True, True) for w in (None, 3, 40)]


@needs_triton_device
@pytest.mark.parametrize("window,sinks_on,decodes_apart", UNIFIED_CASES,
                         ids=[f"W{w}-{'sinks' if s else 'nosinks'}{'-apart' if a else ''}"
                              for w, s, a in UNIFIED_CASES])
def test_unified_kernel(window, sinks_on, decodes_apart):
    """GQA 4 (16 queries x 4 heads a tile); decodes_apart: decode rows in the split-KV kernel."""
    sinks = make_sinks(8, sinks_on, seed=2)
    out, want = varlen(unified_attention_triton, MIXED, 8, 2, window, sinks, seed=2, decodes_apart=decodes_apart)
    torch.testing.assert_close(out, want, **TOL)


@needs_triton_device
@pytest.mark.parametrize("kernel", [paged_attention_prefill_triton, unified_attention_triton])
def test_varlen_kernels_fp8_cache(kernel):
    sinks = make_sinks(4, True, seed=5)
    out, want = varlen(kernel, MIXED, 4, 2, 10, sinks, seed=5, kv_dtype=torch.float8_e4m3fn)
    torch.testing.assert_close(out, want, **TOL)


# --- what a mutation would break -----------------------------------------------------------------

@needs_triton_device
def test_window_off_by_one_and_sink_weight_change_the_output():
    """W and W + 1 differ (and W matches naive, above), sinks on and off differ, in every kernel:
    a window bound shifted by one or a sink dropped would not pass."""
    sinks = make_sinks(4, True, seed=7)
    seqs = [(9, 7), (12, 1), (0, 11)]
    for run in (lambda w, s: varlen(paged_attention_prefill_triton, seqs, 4, 2, w, s, seed=7)[0],
                lambda w, s: varlen(unified_attention_triton, seqs, 4, 2, w, s, seed=7)[0],
                lambda w, s: decode([13, 6], 4, 2, w, s, seed=7, num_splits=2)[0]):
        base = run(5, sinks)
        assert (base - run(6, sinks)).abs().max() > 1e-2
        assert (base - run(5, None)).abs().max() > 1e-2
    # The reference and the CPU path too.
    batch = paged_batch(seqs, S, 4, 2, d=8, seed=7)
    args = (batch.q, batch.k_new, batch.v_new, batch.cache, batch.meta, batch.scale)
    for attend in (paged_attention_torch, paged_attention_cpu):
        base = attend(*args, sliding_window=5, sinks=sinks)
        assert (base - attend(*args, sliding_window=6, sinks=sinks)).abs().max() > 1e-2
        assert (base - attend(*args, sliding_window=5)).abs().max() > 1e-2


# --- arguments ---------------------------------------------------------------------------------------

@needs_triton_device
def test_rejects_chunk_and_window_together_and_bad_sinks():
    batch = paged_batch([(3, 1)], S, 4, 2, d=16)
    tables, qsl, lens = layout(batch)
    q, cache = batch.q.to(DEV), batch.cache.to(DEV)
    torch_args = (batch.q, batch.k_new, batch.v_new, batch.cache, batch.meta, batch.scale)
    calls = [lambda **kw: paged_attention_torch(*torch_args, **kw),
             lambda **kw: paged_attention_cpu(*torch_args, **kw),
             lambda **kw: paged_attention_decode_triton(q, cache, tables, lens, batch.scale, **kw),
             lambda **kw: paged_attention_prefill_triton(q, cache, tables, qsl, lens, 1, batch.scale, **kw),
             lambda **kw: unified_attention_triton(q, cache, tables, qsl, lens, batch.scale, **kw)]
    for call in calls:
        with pytest.raises(ValueError, match="chunk_size.*sliding_window"):
            call(chunk_size=8, sliding_window=8)
        with pytest.raises(ValueError, match="sliding_window must be positive"):
            call(sliding_window=0)
        with pytest.raises(ValueError, match="sinks"):
            call(sinks=torch.zeros(2, device=DEV))


# --- GPU: gpt-oss-20b attention shapes (H=64, G=8, d=64, W=128, bf16, block 16) ---------------------

@needs_cuda
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_gpt_oss_shapes(window):
    seqs = [(0, 300), (200, 77), (1000, 1), (5, 1), (127, 1), (130, 260)]
    H, G, d = 64, 8, 64
    batch = paged_batch(seqs, 16, H, G, d, seed=9)
    sinks = make_sinks(H, True, seed=9)
    r = lambda x: x.to(torch.bfloat16).float()  # noqa: E731  the inputs as the kernels see them
    ref = paged_attention_torch(r(batch.q), r(batch.k_new), r(batch.v_new), r(batch.cache), batch.meta,
                                batch.scale, sliding_window=window, sinks=sinks)
    tables, qsl, lens = layout(batch)
    q, cache, sinks_d = batch.q.to(DEV, torch.bfloat16), batch.cache.to(DEV, torch.bfloat16), sinks.to(DEV)
    outs = [paged_attention_prefill_triton(q, cache, tables, qsl, lens, 300, batch.scale, sliding_window=window,
                                           sinks=sinks_d),
            unified_attention_triton(q, cache, tables, qsl, lens, batch.scale, sliding_window=window, sinks=sinks_d)]
    for out in outs:
        torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    dec = [b for b, (_, n) in enumerate(seqs) if n == 1]
    rows = [batch.meta.query_start_loc[b] for b in dec]
    out = paged_attention_decode_triton(q[rows], cache, tables[dec], lens[dec], batch.scale, sliding_window=window,
                                        sinks=sinks_d, num_splits=4)
    torch.testing.assert_close(out.float().cpu(), ref[rows], atol=2e-2, rtol=2e-2)
