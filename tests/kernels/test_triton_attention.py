"""Triton paged attention (KV write, varlen prefill, split-KV decode) against float64 dense
references and kernels.attention.

Without a GPU the kernels run under TRITON_INTERPRET=1 (set in tests/kernels/conftest.py) on tiny
shapes; with a GPU the same tests run on it, plus real-shape tests (Qwen3-30B-A3B attention) and
a CUDA-graph capture of the decode kernel at the end.
Legend: T query tokens, B sequences, H query heads, G KV heads, d head dim, N blocks, S block size.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl

from kernels.attention import AttentionMetadata, paged_attention_torch, write_kv_cache
from kernels.triton_attention.decode import paged_attention_decode_triton
from kernels.triton_attention.kv_cache import write_kv_cache_triton
from kernels.triton_attention.prefill import paged_attention_prefill_triton
from tests.kernels.triton_marks import kernel_grid

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="no GPU and TRITON_INTERPRET is not set")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a GPU")
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}  # several key tiles per sequence
POISON = float("nan")


def dense_reference(q_nHd, k_LGd, v_LGd, scale, chunk):
    """float64 masked softmax: query i (position L - n + i) sees key j <= pos in its chunk."""
    n, H, _ = q_nHd.shape
    L, G, _ = k_LGd.shape
    k = k_LGd.double().repeat_interleave(H // G, dim=1)
    v = v_LGd.double().repeat_interleave(H // G, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q_nHd.double(), k) * scale
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(L)[None, :]
    allowed = kpos <= qpos
    if chunk is not None:
        allowed &= (kpos // chunk) == (qpos // chunk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


class Batch:
    """Random paged batch. seqs: (cached, new) tokens per sequence. The cache is poisoned with NaN
    everywhere no key of the batch lives, and also at keys before the chunk of a sequence's first
    query (a kernel must not read them); block ids are shuffled over a larger cache."""

    def __init__(self, seqs, H, G, d, S, chunk=None, dtype=torch.float32, seed=0, table_dtype=torch.int32):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.scale, self.chunk = seqs, d ** -0.5, chunk
        nblk = [max(1, -(-(c + n) // S)) for c, n in seqs]
        N = sum(nblk) + 5
        perm = torch.randperm(N, generator=g).tolist()
        cache = torch.full((2, N, S, G, d), POISON)
        tables = torch.zeros(len(seqs), max(nblk) + 2, dtype=table_dtype)  # padding columns: id 0
        qs, refs = [], []
        for b, (c, n) in enumerate(seqs):
            L = c + n
            blocks = [perm.pop() for _ in range(nblk[b])]
            tables[b, :len(blocks)] = torch.tensor(blocks, dtype=table_dtype)
            k, v = torch.randn(L, G, d, generator=g), torch.randn(L, G, d, generator=g)
            q = torch.randn(n, H, d, generator=g)
            k, v, q = k.to(dtype).float(), v.to(dtype).float(), q.to(dtype).float()  # exact in dtype
            lo = 0 if chunk is None or L == 0 else (c // chunk) * chunk
            slots = torch.tensor([blocks[p // S] * S + p % S for p in range(lo, L)], dtype=torch.int64)
            if slots.numel():
                write_kv_cache(k[lo:], v[lo:], cache, slots)
            qs.append(q)
            if n:
                refs.append(dense_reference(q, k, v, self.scale, chunk))
        self.q = torch.cat(qs).to(dtype).to(DEV)
        self.ref = torch.cat(refs).float()
        self.cache = cache.to(dtype).to(DEV)
        self.tables = tables.to(DEV)
        qsl = [0]
        for _, n in seqs:
            qsl.append(qsl[-1] + n)
        self.qsl = qsl
        self.qsl_t = torch.tensor(qsl, dtype=torch.int32, device=DEV)
        self.seq_lens_t = torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=DEV)
        self.max_q = max(n for _, n in seqs)

    def new_kv(self):
        """K and V of each sequence's new tokens, [T, G, d] each, read back from the cache."""
        S, ks, vs = self.cache.shape[2], [], []
        for b, (c, n) in enumerate(self.seqs):
            pos = torch.arange(c, c + n, device=DEV)
            kv = self.cache[:, self.tables[b, pos // S].long(), pos % S]  # [2, n, G, d]
            ks.append(kv[0]), vs.append(kv[1])
        return torch.cat(ks), torch.cat(vs)

    def prefill(self, config=None):
        out = torch.full_like(self.q, POISON)
        res = paged_attention_prefill_triton(self.q, self.cache, self.tables, self.qsl_t, self.seq_lens_t,
                                             self.max_q, self.scale, chunk_size=self.chunk, out_THd=out,
                                             config=config)
        assert res is out
        return out.float().cpu()


def assert_close(out, ref, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.isfinite(out).all(), "unwritten or poisoned output"
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


# --- KV write -------------------------------------------------------------------------------

@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_cache_strided_views_and_skipped_slots(slot_dtype):
    T, H, G, d, N, S = 9, 4, 2, 24, 6, 4
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * G) * d, generator=g).to(DEV)
    k = qkv[:, H * d:(H + G) * d].view(T, G, d)  # non-contiguous views, as split from a fused qkv
    v = qkv[:, (H + G) * d:].view(T, G, d)
    slots = torch.randperm(N * S, generator=g)[:T]
    slots[[2, 5, 8]] = -1
    cache = torch.randn(2, N, S, G, d, generator=g).to(DEV)
    expect = cache.clone()
    keep = slots >= 0
    write_kv_cache(k.cpu()[keep], v.cpu()[keep], expect_cpu := expect.cpu(), slots[keep])
    write_kv_cache_triton(k, v, cache, slots.to(slot_dtype).to(DEV))
    assert torch.equal(cache.cpu(), expect_cpu), "written rows differ or a skipped slot was touched"


def test_write_kv_cache_casts_to_cache_dtype():
    T, G, d, N, S = 5, 1, 16, 2, 4
    k, v = torch.randn(T, G, d, device=DEV), torch.randn(T, G, d, device=DEV)
    cache = torch.zeros(2, N, S, G, d, dtype=torch.bfloat16, device=DEV)
    slots = torch.tensor([7, 0, 3, 4, 1], device=DEV)
    write_kv_cache_triton(k, v, cache, slots)
    expect = torch.zeros_like(cache).cpu()
    write_kv_cache(k.cpu(), v.cpu(), expect, slots.cpu())
    if CUDA:
        assert torch.equal(cache.cpu(), expect)
    else:  # the interpreter truncates fp32 -> bf16 instead of rounding: one bf16 ulp apart at most
        torch.testing.assert_close(cache.cpu().float(), expect.float(), atol=0, rtol=2 ** -7)


def test_write_kv_cache_rejects_bad_shapes():
    cache = torch.zeros(2, 2, 4, 2, 16, device=DEV)
    k = torch.zeros(3, 2, 8, device=DEV)
    with pytest.raises(ValueError, match="k_TGd"):
        write_kv_cache_triton(k, k, cache, torch.zeros(3, dtype=torch.int64, device=DEV))


# --- prefill ---------------------------------------------------------------------------------

# (cached, new): one-token prompts, fresh prefills, contexts starting mid-block (prefix hits /
# later chunks of a chunked prefill), decode rows at and around block / chunk edges.
MIXED = [(0, 1), (0, 11), (9, 7), (5, 12), (16, 5), (3, 26), (15, 1), (16, 1), (23, 1), (0, 1)]


@pytest.mark.parametrize("H,G", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("chunk", [None, 8])
def test_prefill_mixed_batch(H, G, chunk):
    batch = Batch(MIXED, H, G, d=16, S=4, chunk=chunk, seed=H + G)
    assert_close(batch.prefill(), batch.ref, torch.float32)


@pytest.mark.parametrize("chunk,S", [(None, 5), (3, 5), (16, 4), (12, 8)])
def test_prefill_small_tiles_cross_blocks_and_chunks(chunk, S):
    """16-key tiles over several blocks: the unmasked phase, chunk edges inside and on tiles."""
    seqs = [(0, 40), (21, 19), (37, 3), (50, 1), (6, 33)]
    batch = Batch(seqs, 4, 2, d=24, S=S, chunk=chunk, seed=3, table_dtype=torch.int64)  # d padded to 32
    assert_close(batch.prefill(SMALL), batch.ref, torch.float32)


@pytest.mark.skipif(not INTERPRET, reason="flips a compile-time switch: the interpreter reads it at run time")
@pytest.mark.parametrize("chunk,window", [(None, None), (3, None), (None, 9)])
def test_prefill_same_with_and_without_block_prefetch(monkeypatch, chunk, window):
    """The key tiles' cache blocks read one tile ahead (the default) or in the tile's own step
    (MOE_ATTN_BLOCK_PREFETCH=0): the same output, over contexts of many tiles whose last prefetch
    runs past the block table's used entries."""
    import kernels.triton_attention.common as common
    seqs = [(0, 40), (21, 19), (37, 3), (50, 1), (6, 33)]
    batch = Batch(seqs, 4, 2, d=24, S=5, chunk=chunk, seed=4)
    outs = []
    for prefetch in (True, False):
        monkeypatch.setattr(common, "BLOCK_PREFETCH", tl.constexpr(prefetch))
        outs.append(paged_attention_prefill_triton(batch.q, batch.cache, batch.tables, batch.qsl_t, batch.seq_lens_t,
                                                   batch.max_q, batch.scale, chunk, config=SMALL,
                                                   sliding_window=window))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    if window is None:
        assert_close(outs[0], batch.ref, torch.float32)


def test_prefill_and_unified_compile_for_sm90_without_spills():
    """Compiled for sm_90 (no GPU needed), with the block tables read a key tile ahead and in the
    tile's own step: both key loops of both kernels compile (the interpreter runs no compiler) and
    spill nothing at the shipped configs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_sm90_attention.py"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {f"{k}/{w}" for k in ("unified", "prefill") for w in ("ahead", "in_step")}, report
    for name, r in report.items():
        assert r["spill_store_bytes"] == 0 and 0 < r["registers"] <= 255, (name, r)


def test_prefill_bf16_and_matches_torch_reference():
    batch = Batch(MIXED, 8, 2, d=32, S=4, dtype=torch.bfloat16, seed=5)
    out = batch.prefill()
    assert_close(out, batch.ref, torch.bfloat16)
    # Same conventions as the CPU path: every sequence through its prefill branch.
    meta = AttentionMetadata(query_start_loc=batch.qsl, seq_lens=batch.seq_lens_t.tolist(),
                             block_tables_BM=batch.tables.cpu(), slot_mapping_T=torch.zeros(0),
                             decode_seqs=[], prefill_seqs=list(range(len(MIXED))))
    k_new, v_new = batch.new_kv()
    ref = paged_attention_torch(batch.q.cpu().float(), k_new.cpu().float(), v_new.cpu().float(),
                                batch.cache.cpu().float().nan_to_num(0.0), meta, batch.scale)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_prefill_rejects_bad_inputs():
    batch = Batch([(0, 3)], 4, 2, d=16, S=4)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_prefill_triton(batch.q[:, :3], batch.cache, batch.tables, batch.qsl_t,
                                       batch.seq_lens_t, 3, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_prefill_triton(batch.q, batch.cache.transpose(1, 2), batch.tables, batch.qsl_t,
                                       batch.seq_lens_t, 3, 1.0)


# --- decode ----------------------------------------------------------------------------------

def decode_case(lens, H, G, d, S, chunk=None, dtype=torch.float32, seed=0):
    """Decode batch: one query per sequence; seq_lens 0 rows are padding (reference: zeros)."""
    batch = Batch([(max(L - 1, 0), 1 if L else 0) for L in lens], H, G, d, S, chunk, dtype, seed)
    q = torch.randn(len(lens), H, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ref = torch.zeros(len(lens), H, d)
    rows = [b for b, L in enumerate(lens) if L]
    ref[rows] = batch.ref  # Batch built one query per non-empty row, in order
    q[rows] = batch.q.cpu()
    return batch, q.to(DEV), ref


# under the interpreter each GQA layout with one split form, each split form with one layout
@pytest.mark.parametrize("heads,splits", kernel_grid(
    {"4-4": (4, 4), "8-2": (8, 2), "8-1": (8, 1)},
    {"1": (1, None), "3-fused": (3, True), "3-kernel": (3, False), "auto-fused": (None, True),
     "auto-kernel": (None, False)}, cover="values"))
def test_decode_splits_and_padded_rows(heads, splits):
    (H, G), (num_splits, fused_merge) = heads, splits
    lens = [37, 0, 1, 16, 17, 64, 0, 50]
    batch, q, ref = decode_case(lens, H, G, d=16, S=4, seed=H * G)
    out = torch.full_like(q, POISON)
    res = paged_attention_decode_triton(q, batch.cache, batch.tables, batch.seq_lens_t, batch.scale,
                                        out_BHd=out, num_splits=num_splits, block_n=16, fused_merge=fused_merge)
    assert res is out
    assert_close(out.cpu(), ref, torch.float32)
    if fused_merge:  # the merging program sets its counter back: the next launch starts from 0
        from kernels.last_program import zeroed_counters
        assert not zeroed_counters("decode_merge", len(lens) * G, q.device).any()


@pytest.mark.parametrize("num_splits", [2, 4, 5, 16])
def test_decode_merges_in_the_last_program_only_for_few_splits(num_splits, monkeypatch):
    """By default the splits are merged in the last program up to FUSED_MERGE_MAX_SPLITS of them
    (its counters are taken), above by the merge kernel; the output is the same either way."""
    import kernels.triton_attention.decode as decode

    taken = []
    real = decode.zeroed_counters
    monkeypatch.setattr(decode, "zeroed_counters", lambda *a: taken.append(a) or real(*a))
    lens = [37, 0, 64, 50]
    batch, q, ref = decode_case(lens, 8, 2, d=16, S=4, seed=num_splits)
    out = paged_attention_decode_triton(q, batch.cache, batch.tables, batch.seq_lens_t, batch.scale,
                                        num_splits=num_splits, block_n=16)
    assert_close(out.cpu(), ref, torch.float32)
    assert bool(taken) == (num_splits <= decode.FUSED_MERGE_MAX_SPLITS)


@pytest.mark.parametrize("chunk,num_splits", [(8, 1), (8, 2), (20, 3), (64, 4)])
def test_decode_chunked_local(chunk, num_splits):
    """Queries at the first, middle and last position of a chunk; keys before it are NaN."""
    lens = [1, 8, 9, 16, 23, 24, 25, 61, 0]
    batch, q, ref = decode_case(lens, 4, 2, d=24, S=5, chunk=chunk, seed=chunk)
    out = paged_attention_decode_triton(q, batch.cache, batch.tables, batch.seq_lens_t, batch.scale,
                                        chunk_size=chunk, num_splits=num_splits, block_n=16)
    assert_close(out.cpu(), ref, torch.float32)


def test_decode_bf16_default_tiles():
    batch, q, ref = decode_case([130, 3, 0, 77], 8, 2, d=32, S=16, dtype=torch.bfloat16)
    out = paged_attention_decode_triton(q, batch.cache, batch.tables, batch.seq_lens_t, batch.scale, num_splits=2)
    assert out.dtype == torch.bfloat16
    assert_close(out.float().cpu(), ref, torch.bfloat16)


# --- GPU: real shapes (Qwen3-30B-A3B attention: H=32, G=4, d=128, bf16, block 16) -------------

def _real_batch(seqs, seed=0):
    return Batch(seqs, 32, 4, d=128, S=16, dtype=torch.bfloat16, seed=seed)


@needs_cuda
@pytest.mark.parametrize("chunk", [None, 1024])
def test_gpu_prefill_real_shapes(chunk):
    seqs = [(0, 2048), (1000, 1000), (3071, 1025), (0, 1), (4095, 1), (17, 513)]
    batch = Batch(seqs, 32, 4, d=128, S=16, chunk=chunk, dtype=torch.bfloat16, seed=7)
    assert_close(batch.prefill(), batch.ref, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("B,num_splits", [(1, None), (7, 5), (256, None)])
def test_gpu_decode_real_shapes(B, num_splits):
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 4097, (B,), generator=g).tolist()
    lens[0] = 4096
    if B > 1:
        lens[1] = 0
    batch, q, ref = decode_case(lens, 32, 4, d=128, S=16, dtype=torch.bfloat16, seed=B)
    out = paged_attention_decode_triton(q, batch.cache, batch.tables, batch.seq_lens_t, batch.scale,
                                        num_splits=num_splits)
    assert_close(out.float().cpu(), ref, torch.bfloat16)


@needs_cuda
def test_gpu_fused_merge_is_race_free():
    """The program that counts last merges: 300 launches back to back, no sync between them, must
    all give the same bits (the merge reads the parts in a fixed order, so any part read before
    it was visible, or a counter not set back, shows as a difference) and match the reference."""
    lens = [4096, 1, 700, 2048, 0, 3000, 64, 1500]
    batch, q, ref = decode_case(lens, 32, 4, d=128, S=16, dtype=torch.bfloat16, seed=11)
    outs = [paged_attention_decode_triton(q, batch.cache, batch.tables, batch.seq_lens_t, batch.scale,
                                          num_splits=32, fused_merge=True) for _ in range(300)]
    torch.cuda.synchronize()
    assert_close(outs[0].float().cpu(), ref, torch.bfloat16)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    separate = paged_attention_decode_triton(q, batch.cache, batch.tables, batch.seq_lens_t, batch.scale,
                                             num_splits=32, fused_merge=False)
    assert_close(separate.float().cpu(), outs[0].float().cpu(), torch.bfloat16)


@needs_cuda
def test_gpu_decode_cuda_graph_replay_with_new_lengths():
    B, H, G, d, S, max_blocks = 64, 32, 4, 128, 16, 72
    first = decode_case([1 + (37 * b) % 1000 for b in range(B)], H, G, d, S, dtype=torch.bfloat16, seed=1)
    second = decode_case([0 if b % 9 == 0 else 1 + (101 * b) % 1023 for b in range(B)], H, G, d, S,
                         dtype=torch.bfloat16, seed=2)
    cache = torch.zeros(2, max(first[0].cache.shape[1], second[0].cache.shape[1]), S, G, d,
                        dtype=torch.bfloat16, device="cuda")
    q_s = torch.zeros(B, H, d, dtype=torch.bfloat16, device="cuda")
    tables_s = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    lens_s = torch.zeros(B, dtype=torch.int32, device="cuda")
    out_s = torch.full((B, H, d), POISON, dtype=torch.bfloat16, device="cuda")

    def load(case):
        batch, q, _ = case
        cache[:, :batch.cache.shape[1]].copy_(batch.cache)
        q_s.copy_(q)
        tables_s.zero_()
        tables_s[:, :batch.tables.shape[1]].copy_(batch.tables)
        lens_s.copy_(batch.seq_lens_t)

    def step():
        paged_attention_decode_triton(q_s, cache, tables_s, lens_s, d ** -0.5, out_BHd=out_s)

    load(first)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case in (first, second):
        load(case)
        out_s.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out_s.float().cpu(), case[2], torch.bfloat16)
