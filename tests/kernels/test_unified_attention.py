"""The unified paged-attention kernel (kernels/triton_attention/unified.py) against the torch
reference kernels.attention.paged_attention_torch on mixed batches, and the layer's switch to it.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (set in tests/kernels/conftest.py) on tiny
shapes; with a GPU the same tests run on it, plus a real shape (Qwen3-30B-A3B attention) and a
CUDA-graph replay over a new batch layout.
Legend: T query tokens, B sequences, H query heads, G KV heads, d head dim, N blocks, S block size.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models.layers.attention as attention_layer
from kernels.attention import paged_attention_torch
from kernels.triton_attention.unified import num_tile_slots, unified_attention_triton
from tests.kernels.attention_cases import PagedBatch, paged_batch
from tests.kernels.triton_marks import DEV, kernel_grid, needs_cuda, needs_triton_device

pytestmark = needs_triton_device
SMALL = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}  # several key tiles per sequence
SENTINEL = 7.0
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (cached, new): decode rows (context a multiple of the block size, a one-token sequence, one past
# a block / chunk edge), prefill chunks over cached context starting mid-block and on a block edge,
# a fresh prompt, a sequence with no query this step; query counts not multiples of the tile's.
MIXED = [(15, 1), (0, 1), (9, 7), (16, 11), (0, 13), (32, 1), (5, 0), (20, 26), (3, 1)]


def device_args(batch: PagedBatch, dtype: torch.dtype):
    """q and cache in dtype on the device, and the runner's device layout (int32 offsets / lengths)."""
    meta = batch.meta
    return (batch.q.to(dtype).to(DEV), batch.cache.to(dtype).to(DEV), meta.block_tables_BM.to(DEV),
            torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEV),
            torch.tensor(meta.seq_lens, dtype=torch.int32, device=DEV))


def reference(batch: PagedBatch, dtype: torch.dtype, chunk: int | None) -> torch.Tensor:
    """paged_attention_torch in fp32 on the inputs rounded to dtype, as the kernel sees them."""
    r = lambda x: x.to(dtype).float()  # noqa: E731
    return paged_attention_torch(r(batch.q), r(batch.k_new), r(batch.v_new), r(batch.cache), batch.meta,
                                 batch.scale, chunk)


def run_case(seqs, H, G, d, S, chunk=None, dtype=torch.float32, block_q=None, config=SMALL, seed=0,
             decodes_apart=False, decode_stream=False):
    batch = paged_batch(seqs, S, H, G, d, seed=seed, stale_cache=True)  # stray reads give wrong values
    q, cache, tables, qsl, lens = device_args(batch, dtype)
    out = torch.full_like(q, SENTINEL)
    res = unified_attention_triton(q, cache, tables, qsl, lens, batch.scale, chunk_size=chunk, out_THd=out,
                                   block_q=block_q, config=config, decodes_apart=decodes_apart,
                                   decode_stream=decode_stream)
    assert res is out
    torch.testing.assert_close(out.float().cpu(), reference(batch, dtype, chunk), atol=TOL[dtype], rtol=TOL[dtype])


# GQA 1, 2, 4 (16, 8, 4 queries a tile); chunks smaller than most contexts; decodes_apart: one-query
# sequences in the decode kernel
@pytest.mark.parametrize("heads,chunk,decodes_apart", kernel_grid({"4-4": (4, 4), "4-2": (4, 2), "8-2": (8, 2)},
                                                                  {"None": None, "8": 8},
                                                                  {"False": False, "True": True}))
def test_mixed_batch(heads, chunk, decodes_apart):
    H, G = heads
    run_case(MIXED, H, G, d=16, S=4, chunk=chunk, seed=H + G, decodes_apart=decodes_apart)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fused_merge", [False, True])
def test_decode_rows_apart_split_and_merged(splits, fused_merge):
    """The decode kernel inside a mixed batch (query_start_loc given): its splits merged by the
    last program or by the merge kernel write exactly the rows of one-query sequences, at their
    place among the prefill rows, and nothing else."""
    from kernels.triton_attention.decode import paged_attention_decode_triton

    seqs = [(15, 1), (9, 7), (0, 1), (40, 1), (5, 0), (3, 4)]
    batch = paged_batch(seqs, 4, 4, 2, 16, seed=21, stale_cache=True)
    q, cache, tables, qsl, lens = device_args(batch, torch.float32)
    out = torch.full_like(q, SENTINEL)
    paged_attention_decode_triton(q, cache, tables, lens, batch.scale, out_BHd=out, num_splits=splits, block_n=16,
                                  fused_merge=fused_merge, query_start_loc_B1=qsl)
    starts = batch.meta.query_start_loc
    decode_rows = [a for a, b in zip(starts, starts[1:]) if b - a == 1]
    others = sorted(set(range(q.shape[0])) - set(decode_rows))
    want = reference(batch, torch.float32, None)
    torch.testing.assert_close(out[decode_rows].cpu(), want[decode_rows], atol=1e-5, rtol=1e-5)
    assert (out[others] == SENTINEL).all(), "the decode kernel wrote a prefill row"


@pytest.mark.parametrize("block_q,chunk", [(3, None), (1, 6), (5, 12)])
def test_tile_heights_padded_rows_and_head_dim(block_q, chunk):
    """Tiles of odd height (BQ * HG rows padded to 16), d padded to 32, block 5, key tiles over
    several blocks and chunk edges inside tiles."""
    run_case([(0, 9), (21, 19), (37, 3), (50, 1), (6, 1), (12, 12)], 4, 2, d=24, S=5, chunk=chunk,
             block_q=block_q, seed=block_q, decodes_apart=block_q != 3)


@pytest.mark.parametrize("decodes_apart", [False, True])
def test_bf16_default_tiles(decodes_apart):
    run_case(MIXED, 8, 2, d=32, S=16, dtype=torch.bfloat16, config=None, seed=5, decodes_apart=decodes_apart)


def test_padding_rows_and_spare_tile_slots_write_nothing():
    """q with rows past query_start_loc[B] (as a padded step buffer): the grid then has more tile
    slots than the batch has tiles; those programs, and padding rows, leave the output alone."""
    seqs = [(4, 3), (9, 1), (0, 6)]
    H, G, d, pad = 4, 2, 16, 11
    batch = paged_batch(seqs, 4, H, G, d, seed=3)
    q, cache, tables, qsl, lens = device_args(batch, torch.float32)
    T = q.shape[0]
    q_pad = torch.cat([q, torch.randn(pad, H, d, device=DEV)])
    block_q = 2  # 11 padding rows add spare slots at this tile height
    assert num_tile_slots(T + pad, len(seqs), block_q) > num_tile_slots(T, len(seqs), block_q)
    for decodes_apart in (False, True):
        out = torch.full_like(q_pad, SENTINEL)
        unified_attention_triton(q_pad, cache, tables, qsl, lens, batch.scale, out_THd=out, block_q=block_q,
                                 config=SMALL, decodes_apart=decodes_apart)
        assert (out[T:] == SENTINEL).all(), "a program past the batch wrote"
        torch.testing.assert_close(out[:T].cpu(), reference(batch, torch.float32, None), atol=1e-5, rtol=1e-5)


def test_rejects_bad_inputs():
    batch = paged_batch([(0, 3)], 4, 4, 2, 16)
    q, cache, tables, qsl, lens = device_args(batch, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        unified_attention_triton(q[:, :3], cache, tables, qsl, lens, 1.0)
    with pytest.raises(ValueError, match="B\\+1"):
        unified_attention_triton(q, cache, tables, qsl[:1], lens, 1.0)



@pytest.mark.parametrize("pad_tokens,pad_seqs,chunk,decodes_apart", [(0, 1, None, True), (5, 9, None, False),
                                                                   (5, 9, None, True), (23, 2, None, True),
                                                                   (23, 2, 8, True)])
def test_cuda_graph_padding_layout(pad_tokens, pad_seqs, chunk, decodes_apart):
    """A mixed step as the runner uploads it for a graph of more tokens and sequences
    (moe/worker/step_inputs.py `upload(padded=...)`): the real rows equal the reference, the
    padding rows (sequences of context 0) come out as zeros, never NaN, also chunked-local."""
    import numpy as np

    from moe.worker.step_buffers import StepBuffers
    from moe.worker.step_inputs import StepBatch, upload

    H, G, d, S = 4, 2, 16, 4
    batch = paged_batch(MIXED, S, H, G, d, seed=13)
    meta = batch.meta
    qsl, seq_lens = np.array(meta.query_start_loc), np.array(meta.seq_lens)
    n = np.diff(qsl)
    row = np.repeat(np.arange(len(n)), n)
    positions = np.arange(qsl[-1]) - qsl[:-1][row] + (seq_lens - n)[row]
    step = StepBatch([str(i) for i in range(len(n))], [], n, qsl, seq_lens, np.zeros(qsl[-1], dtype=np.int64),
                     positions, row, [meta.block_tables_BM.numpy()], [])
    T, B = int(qsl[-1]), len(n)
    t, b = T + pad_tokens, B + pad_seqs
    buf = StepBuffers(torch.device(DEV), t, b, meta.block_tables_BM.shape[1], 1)
    graph_meta = upload(buf, step, S, padded=(t, b))
    q = torch.cat([batch.q, torch.randn(pad_tokens, H, d)]).to(DEV)
    out = torch.full_like(q, float("nan"))
    unified_attention_triton(q, batch.cache.to(DEV), graph_meta.block_tables_BM, graph_meta.query_start_loc_t,
                             graph_meta.seq_lens_t, batch.scale, chunk, out_THd=out, config=SMALL,
                             decodes_apart=decodes_apart)
    torch.testing.assert_close(out[:T].cpu(), reference(batch, torch.float32, chunk), atol=1e-5, rtol=1e-5)
    assert (out[T:] == 0).all()

# --- the layer's switch --------------------------------------------------------------------------

@pytest.mark.parametrize("unified", [False, True])
def test_layer_switch(unified, monkeypatch):
    """MOE_UNIFIED_ATTENTION: a mixed batch goes through the unified kernel only when on; a
    decode-only step keeps the split-KV decode kernel either way."""
    H, G, d = 4, 2, 16
    batch = paged_batch(MIXED, 4, H, G, d, seed=9)
    q, cache, tables, qsl, lens = device_args(batch, torch.float32)
    # The layer's copy of the layout on the device; the reference keeps batch.meta on the host.
    qsl_host = batch.meta.query_start_loc
    meta = dataclasses.replace(batch.meta, block_tables_BM=tables, query_start_loc_t=qsl, seq_lens_t=lens,
                               slot_mapping_T=batch.meta.slot_mapping_T.to(DEV),
                               max_query_len=max(b - a for a, b in zip(qsl_host, qsl_host[1:])))
    layer = attention_layer.Attention(H, d, G, batch.scale)
    layer.kv_cache = cache
    calls = []
    real = attention_layer.unified_attention_triton
    monkeypatch.setattr(attention_layer, "use_triton_attention", lambda x: True)
    monkeypatch.setattr(attention_layer, "UNIFIED_ATTENTION", unified)
    monkeypatch.setattr(attention_layer, "unified_attention_triton", lambda *a: calls.append(1) or real(*a))
    T = q.shape[0]
    out = layer(q.reshape(T, H * d), batch.k_new.to(DEV).reshape(T, G * d), batch.v_new.to(DEV).reshape(T, G * d),
                meta)
    assert len(calls) == int(unified)
    torch.testing.assert_close(out.view(T, H, d).cpu(), reference(batch, torch.float32, None), atol=1e-5, rtol=1e-5)

    decode = paged_batch([(7, 1), (0, 1), (12, 1)], 4, H, G, d, seed=10)
    q, cache, tables, qsl, lens = device_args(decode, torch.float32)
    dmeta = dataclasses.replace(decode.meta, block_tables_BM=tables, query_start_loc_t=qsl, seq_lens_t=lens,
                                slot_mapping_T=decode.meta.slot_mapping_T.to(DEV), max_query_len=1,
                                decode_only=True)
    layer.kv_cache = cache
    out = layer(q.reshape(3, H * d), decode.k_new.to(DEV).reshape(3, G * d), decode.v_new.to(DEV).reshape(3, G * d),
                dmeta)
    assert len(calls) == int(unified), "a decode-only step went through the unified kernel"
    torch.testing.assert_close(out.view(3, H, d).cpu(), reference(decode, torch.float32, None), atol=1e-5, rtol=1e-5)


# --- GPU: real shapes (Qwen3-30B-A3B attention: H=32, G=4, d=128, bf16, block 16) -------------------

def _real_seqs(num_decodes: int, chunk: int, cached: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(cached - 100, cached + 100, (num_decodes,), generator=g).tolist()
    decodes = [(L - 1, 1) for L in lens]
    return decodes[:num_decodes // 2] + [(cached, chunk)] + decodes[num_decodes // 2:]  # the chunk mid-batch


# (decodes_apart, decode_stream): one launch; the decode rows' launch first; that launch on a side stream
GPU_FORMS = [(False, False), (True, False), (True, True)]
GPU_FORM_IDS = ["one-launch", "apart", "side-stream"]


@needs_cuda
@pytest.mark.parametrize("chunk", [None, 256])
@pytest.mark.parametrize("decodes_apart,decode_stream", GPU_FORMS, ids=GPU_FORM_IDS)
def test_gpu_real_shape_mixed_step(chunk, decodes_apart, decode_stream):
    """64 decode rows around 1,000 tokens of context and a 512-token chunk over 1,000 cached ones."""
    run_case(_real_seqs(64, 512, 1000, seed=1), 32, 4, d=128, S=16, chunk=chunk, dtype=torch.bfloat16,
             config=None, seed=1, decodes_apart=decodes_apart, decode_stream=decode_stream)


@needs_cuda
@pytest.mark.parametrize("decodes_apart,decode_stream", GPU_FORMS, ids=GPU_FORM_IDS)
def test_gpu_cuda_graph_replays_a_new_layout(decodes_apart, decode_stream):
    """Captured once, the launch serves another batch of the same T and B (other lengths, another
    split of the tokens between sequences) written into the same device tensors."""
    H, G, d, S = 32, 4, 128, 16
    first = paged_batch([(300, 1), (0, 40), (700, 1), (64, 23)], S, H, G, d, seed=2)
    second = paged_batch([(15, 1), (1000, 62), (0, 1), (31, 1)], S, H, G, d, seed=3)  # T = 65 as well
    cases = [(b, device_args(b, torch.bfloat16)) for b in (first, second)]
    N = max(a[1].shape[1] for _, a in cases)
    width = max(a[2].shape[1] for _, a in cases)
    q_s = torch.zeros_like(cases[0][1][0])
    cache_s = torch.zeros(2, N, S, G, d, dtype=torch.bfloat16, device="cuda")
    tables_s = torch.zeros(4, width, dtype=torch.int32, device="cuda")
    qsl_s, lens_s = torch.zeros_like(cases[0][1][3]), torch.zeros_like(cases[0][1][4])
    out_s = torch.empty_like(q_s)

    def step():
        unified_attention_triton(q_s, cache_s, tables_s, qsl_s, lens_s, d ** -0.5, out_THd=out_s,
                                 decodes_apart=decodes_apart, decode_stream=decode_stream)

    def load(args):
        q, cache, tables, qsl, lens = args
        q_s.copy_(q), cache_s.zero_(), tables_s.zero_(), qsl_s.copy_(qsl), lens_s.copy_(lens)
        cache_s[:, :cache.shape[1]].copy_(cache)
        tables_s[:, :tables.shape[1]].copy_(tables)

    load(cases[0][1])
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for batch, args in cases:
        load(args)
        out_s.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out_s.float().cpu(), reference(batch, torch.bfloat16, None), atol=2e-2, rtol=2e-2)


def test_decode_stream_switch(monkeypatch):
    """The side stream: CUDA only, off by default, MOE_UNIFIED_DECODE_STREAM=1 on; an explicit argument wins."""
    import kernels.triton_attention.unified as unified
    cuda_q = type("CudaTensor", (), {"is_cuda": True})()
    assert unified.DECODE_STREAM is False and not unified.decode_stream_on(cuda_q)
    assert not unified.decode_stream_on(torch.zeros(1), True), "never on the CPU"
    monkeypatch.setattr(unified, "DECODE_STREAM", True)
    assert unified.decode_stream_on(cuda_q) and not unified.decode_stream_on(cuda_q, False)


@pytest.mark.parametrize("tile", ["32,4,3", "16,4,3"])
def test_tile_switch_sets_this_kernels_tiles_only(tile, monkeypatch):
    """MOE_UNIFIED_TILE (A/B runs): the same results with other key tiles and stages, whatever the
    decode rows' launch; an explicit config still wins."""
    import kernels.triton_attention.unified as unified
    assert unified.TILE is None  # unset: the defaults
    monkeypatch.setattr(unified, "TILE", unified.parse_tile(tile))
    kernel, launches = unified._unified_kernel, []

    class Recorded:  # the launch's keyword arguments, then the real launch
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append({k: kw[k] for k in ("BLOCK_N", "num_warps", "num_stages")})
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(unified, "_unified_kernel", Recorded())
    for decodes_apart in (False, True):
        run_case(MIXED, 8, 2, d=32, S=16, dtype=torch.bfloat16, config=None, seed=9, decodes_apart=decodes_apart)
    run_case(MIXED, 8, 2, d=32, S=16, seed=9)  # an explicit config
    assert launches == [unified.parse_tile(tile)] * 2 + [SMALL]


@pytest.mark.parametrize("text, says", [("32,4", "must be BLOCK_N,num_warps,num_stages"),
                                        ("a,b,c", "must be BLOCK_N,num_warps,num_stages"),
                                        ("48,4,2", "power of two"), ("32,3,2", "num_warps"), ("32,4,0", "num_stages")])
def test_tile_switch_refuses_bad_values(text, says):
    from kernels.triton_attention.unified import parse_tile

    with pytest.raises(ValueError, match=says):
        parse_tile(text)
    assert parse_tile("32,8,3") == {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3} and parse_tile("") is None
