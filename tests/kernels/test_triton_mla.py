"""Triton MLA kernels (latent-cache write, absorbed split-KV decode, varlen prefill attention)
and the MLA layer's GPU path, against the torch references.

Without a GPU every kernel runs under TRITON_INTERPRET=1 (set in tests/kernels/conftest.py) on
tiny awkward shapes; with a GPU the same tests run on it, plus DeepSeek-V3-shape tests (bf16)
and a CUDA-graph replay of the decode at the end.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

import models.layers.mla_attention as mla_layer  # noqa: E402
from kernels.attention import AttentionMetadata  # noqa: E402
from kernels.mla_attention import mla_absorbed_torch, write_latent_cache  # noqa: E402
from kernels.triton_attention.mla_chunks import mla_chunks_triton  # noqa: E402
from kernels.triton_attention.mla_decode import (mla_decode_triton, mla_token_rows,  # noqa: E402
                                                 write_latent_cache_triton)
from kernels.triton_attention.varlen import varlen_attention_triton  # noqa: E402
from models.config import RopeConfig  # noqa: E402
from models.layers.mla_attention import MLAAttention, MLAConfig  # noqa: E402
from tests.factories_deepseek import mla_step_metadata  # noqa: E402

from tests.kernels.triton_marks import DEV, needs_triton_device, needs_cuda  # noqa: E402


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


# --- paged latent cache with poisoned unused slots --------------------------------------------

def paged_cache(lens, S, C, extra_blocks, dtype, seed):
    """(poisoned cache [N, S, C], clean copy, block tables [B, M] int32): each sequence gets its
    own scattered blocks; every slot no sequence reads is NaN in the poisoned copy."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-L // S) for L in lens]
    M = max(max(per), 1)
    N = sum(per) + extra_blocks
    perm = torch.randperm(N, generator=g)
    tables = torch.zeros(len(lens), M, dtype=torch.int32)
    clean = torch.randn(N, S, C, generator=g).to(dtype)
    poisoned = torch.full_like(clean, float("nan"))
    used = 0
    for b, L in enumerate(lens):
        tables[b, :per[b]] = perm[used:used + per[b]].to(torch.int32)
        used += per[b]
        flat_ids = torch.arange(L)
        blk, off = tables[b, flat_ids // S].long(), flat_ids % S
        poisoned[blk, off] = clean[blk, off]
    clean = torch.where(poisoned.isnan(), torch.zeros_like(clean), clean)
    return poisoned.to(DEV), clean.to(DEV), tables.to(DEV)


def decode_reference(q_BHC, clean_cache, tables, lens, scale, R):
    """mla_absorbed_torch over the sequences with seq_len > 0; zeros for the padded ones."""
    B = q_BHC.shape[0]
    out = torch.zeros(B, q_BHC.shape[1], R, dtype=q_BHC.dtype, device=q_BHC.device)
    live = [b for b in range(B) if lens[b] > 0]
    if not live:
        return out
    S = clean_cache.shape[1]
    nblk = -(-max(lens[b] for b in live) // S)
    meta = AttentionMetadata(list(range(B + 1)), list(lens), tables, torch.empty(0), live, [],
                             decode_token_idx=torch.tensor(live, device=q_BHC.device),
                             decode_seq_lens=torch.tensor([lens[b] for b in live], device=q_BHC.device),
                             decode_block_tables=tables[live, :nblk].long())
    mla_absorbed_torch(q_BHC, None, clean_cache, meta, [], True, scale, out)
    return out


# --- interpreter-size kernel tests ------------------------------------------------------------

@needs_triton_device
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_latent_cache_skips_minus_one_slots(cache_dtype):
    g = torch.Generator().manual_seed(0)
    N, S, C, T = 6, 4, 24, 7
    latent = torch.randn(T, C, generator=g).to(DEV)
    slots = torch.tensor([5, -1, 0, 23, 9, -1, 14], device=DEV)
    cache = torch.full((N, S, C), float("nan"), dtype=cache_dtype, device=DEV)
    ref = cache.clone()
    keep = slots >= 0
    write_latent_cache(latent[keep], ref, slots[keep])
    write_latent_cache_triton(latent, cache, slots)
    torch.testing.assert_close(cache, ref, equal_nan=True, atol=0, rtol=0)
    assert cache.flatten(0, 1)[slots[keep]].isfinite().all()


@needs_triton_device
@pytest.mark.parametrize("lens,S,H,R,P,splits", [
    ([1, 4, 5, 17], 4, 3, 32, 16, 1),       # one-token context, block edge, one past it
    ([1, 4, 5, 17], 4, 3, 32, 16, 3),       # several splits, some of them empty
    ([9, 0, 30, 0], 8, 4, 20, 8, 4),        # padded rows (seq_len 0), non-power-of-two R and P
    ([33, 2], 16, 40, 16, 16, None),        # two head tiles, default split count
])
def test_mla_decode_matches_reference(lens, S, H, R, P, splits):
    scale = 0.3
    poisoned, clean, tables = paged_cache(lens, S, R + P, extra_blocks=3, dtype=torch.float32, seed=len(lens) + H)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), H, R + P, generator=g).to(DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = torch.full((len(lens), H, R), float("nan"), device=DEV)
    mla_decode_triton(q, poisoned, tables, seq_lens, scale, R, out_BHR=out, num_splits=splits)
    ref = decode_reference(q, clean, tables, lens, scale, R)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_triton_device
def test_mla_decode_bf16_and_int64_tables():
    lens, S, H, R, P = [7, 12], 4, 2, 32, 16
    poisoned, clean, tables = paged_cache(lens, S, R + P, extra_blocks=2, dtype=torch.bfloat16, seed=3)
    q = torch.randn(2, H, R + P, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)
    out = mla_decode_triton(q, poisoned, tables.long(), torch.tensor(lens, device=DEV), 0.2, R, num_splits=2)
    assert out.dtype == torch.bfloat16
    ref = decode_reference(q, clean, tables, lens, 0.2, R)
    assert rel(out, ref) < 1e-2


@needs_triton_device
def test_mla_decode_rejects_bad_shapes():
    q = torch.zeros(2, 2, 24, device=DEV)
    cache = torch.zeros(4, 4, 24, device=DEV)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode_triton(q, cache, tables, torch.ones(2, dtype=torch.int32, device=DEV), 1.0, 24)
    with pytest.raises(ValueError, match="do not match 2 rows"):
        mla_decode_triton(q, cache, tables, torch.ones(3, dtype=torch.int32, device=DEV), 1.0, 16)


@needs_triton_device
@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_rows_read_their_sequences_tables(splits):
    """table_rows: several rows (a mixed step's tokens) read one sequence's block table, each its own
    length; the same as each row having that table row of its own."""
    lens, S, H, R, P = [13, 6, 0], 4, 3, 32, 16
    poisoned, clean, tables = paged_cache(lens, S, R + P, extra_blocks=3, dtype=torch.float32, seed=11)
    rows = [0, 0, 0, 1, 0, 2, 1]
    row_lens = [11, 12, 13, 6, 1, 0, 3]
    q = torch.randn(len(rows), H, R + P, generator=torch.Generator().manual_seed(4)).to(DEV)
    rows_t = torch.tensor(rows, dtype=torch.int32, device=DEV)
    out = mla_decode_triton(q, poisoned, tables, torch.tensor(row_lens, dtype=torch.int32, device=DEV), 0.3, R,
                            num_splits=splits, table_rows_B=rows_t)
    ref = decode_reference(q, clean, tables[rows_t.long()], row_lens, 0.3, R)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="table rows"):
        mla_decode_triton(q, poisoned, tables, torch.ones(len(rows), dtype=torch.int32, device=DEV), 0.3, R,
                          table_rows_B=rows_t[:-1])


@needs_triton_device
@pytest.mark.parametrize("rows", [16, 64])
def test_mla_chunks_match_reference_and_leave_the_other_rows(rows):
    """Chunks (fresh, over cached keys, crossing token tiles, of 2 tokens) packed BQ tokens a
    program: each row sees the keys up to its position; decode rows and a padding sequence of
    several tokens (context 0) are left as they were."""
    S, H, R, P = 4, 3, 32, 16
    new = [1, 7, 1, 13, 2, 3]
    cached = [8, 0, 3, 9, 5, 0]
    lens = [c + n for c, n in zip(cached, new)]
    lens[-1] = 0  # padding
    poisoned, clean, tables = paged_cache(lens, S, R + P, extra_blocks=3, dtype=torch.float32, seed=21)
    T = sum(new)
    qsl = np.concatenate([[0], np.cumsum(new)])
    q = torch.randn(T, H, R + P, generator=torch.Generator().manual_seed(5)).to(DEV)
    out = torch.full((T, H, R), 7.0, device=DEV)
    mla_chunks_triton(q, poisoned, tables, torch.tensor(qsl, dtype=torch.int32, device=DEV),
                      torch.tensor(lens, dtype=torch.int32, device=DEV), 0.3, R, out, rows=rows)
    for b, n in enumerate(new):
        toks = range(qsl[b], qsl[b + 1])
        if n == 1 or lens[b] == 0:
            assert (out[list(toks)] == 7.0).all(), f"sequence {b}'s rows were written"
            continue
        causal = [lens[b] - n + i + 1 for i in range(n)]
        ref = decode_reference(q[list(toks)], clean, tables[[b] * n], causal, 0.3, R)
        torch.testing.assert_close(out[list(toks)], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [8, 48])
def test_mla_chunks_refuse_rows_that_are_no_tile(rows):
    q, cache = torch.zeros(4, 2, 24), torch.zeros(4, 4, 24)
    with pytest.raises(ValueError, match="power of two"):
        mla_chunks_triton(q, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                          torch.tensor([4], dtype=torch.int32), 1.0, 16, torch.zeros(4, 2, 16), rows=rows)


def test_mla_token_rows_give_each_token_its_sequence_and_causal_length():
    # a decode (context 8), a chunk of 3 over 4 cached tokens, a fresh prompt of 2, then padding
    # sequences of context 0: one of a token, the last holding the rest (as a mixed graph pads)
    qsl = torch.tensor([0, 1, 4, 6, 7, 10], dtype=torch.int32)
    seq_lens = torch.tensor([8, 7, 2, 0, 0], dtype=torch.int32)
    rows, lens = mla_token_rows(qsl, seq_lens, 10)
    assert rows.tolist() == [0, 1, 1, 1, 2, 2, 3, 4, 4, 4]
    assert lens.tolist() == [8, 5, 6, 7, 1, 2, 0, 0, 0, 0]
    assert mla_token_rows(qsl, seq_lens, 10, chunks_apart=True)[1].tolist() == [8] + [0] * 9  # decode rows only


def varlen_reference(q, k, v, ns, lks, scale):
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    qs = ks = 0
    for n, Lk in zip(ns, lks):
        qpos = torch.arange(Lk - n, Lk, device=q.device)[:, None]
        mask = torch.arange(Lk, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(q[qs:qs + n].transpose(0, 1).float(), k[ks:ks + Lk].transpose(0, 1).float(),
                                           v[ks:ks + Lk].transpose(0, 1).float(), attn_mask=mask, scale=scale)
        out[qs:qs + n] = o.transpose(0, 1).to(q.dtype)
        qs, ks = qs + n, ks + Lk
    return out


def varlen_inputs(ns, lks, H, E, Dv, dtype, seed):
    """q, k, v with v a strided view (the value half of a [L, H, E + Dv] tensor), cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(ns), H, E, generator=g).to(DEV, dtype)
    kv = torch.randn(sum(lks), H, E + Dv, generator=g).to(DEV, dtype)
    k, v = kv.split([E, Dv], dim=-1)
    cu = [torch.tensor(np.concatenate(([0], np.cumsum(x))), dtype=torch.int32, device=DEV) for x in (ns, lks)]
    return q, k, v, cu[0], cu[1]


@needs_triton_device
@pytest.mark.parametrize("ns,lks,H,E,Dv", [
    ([5, 1, 3], [5, 1, 3], 2, 24, 20),          # fresh prompts (Lk == n), one of one token
    ([4, 1, 40, 3], [9, 7, 50, 3], 3, 24, 16),  # cached context (Lk > n) and a mix
    ([70], [75], 1, 8, 8),                      # two query tiles, head dims below 16
])
def test_varlen_matches_reference(ns, lks, H, E, Dv):
    q, k, v, cu_q, cu_k = varlen_inputs(ns, lks, H, E, Dv, torch.float32, seed=sum(ns))
    out = torch.full((sum(ns), H, Dv), float("nan"), device=DEV)
    varlen_attention_triton(q, k, v, cu_q, cu_k, max(ns), 0.25, out_THDv=out)
    torch.testing.assert_close(out, varlen_reference(q, k, v, ns, lks, 0.25), atol=1e-5, rtol=1e-5)


@needs_triton_device
def test_varlen_rejects_mismatched_heads():
    q, k, v, cu_q, cu_k = varlen_inputs([2], [2], 2, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="same heads"):
        varlen_attention_triton(q, k[:, :1], v[:, :1], cu_q, cu_k, 2, 1.0)


# --- the MLA layer: GPU path against the torch path --------------------------------------------

def run_layer_both_paths(monkeypatch, cfg, dtype, block_size, num_blocks, steps, device, tol, graph_layout=False):
    """The same layer and inputs through the torch path and the Triton path, step by step
    (each path with its own cache); a final decode-only step is padded to 2 more rows.
    graph_layout: the Triton path's mixed steps as a mixed step's CUDA graph runs them (host lists
    marked placeholders: every row absorbed)."""
    torch.manual_seed(0)
    layer = MLAAttention(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    layer = layer.to(device, dtype)
    outs = {}
    for use_triton in (False, True):
        monkeypatch.setattr(mla_layer, "use_triton_path", lambda x, flag=use_triton: flag)
        layer.kv_cache = torch.zeros(layer.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(1)
        outs[use_triton] = []
        for new, cached in steps:
            x = torch.randn(sum(new), cfg.hidden_size, generator=gen).to(device, dtype)
            decode_only = all(n == 1 for n in new)
            pad = len(new) + 2 if decode_only and use_triton else None
            meta, positions = mla_step_metadata(new, cached, block_size, num_blocks, device, pad_to=pad)
            meta.host_lists = not (graph_layout and use_triton and not decode_only)
            if pad:
                x = torch.cat((x, torch.randn(2, cfg.hidden_size, generator=gen).to(device, dtype)))
            with torch.no_grad():
                out = layer(positions, x, meta)
            if pad:
                assert out[len(new):].isfinite().all(), "padded rows must stay finite"
                out = out[:len(new)]
            outs[use_triton].append(out)
    for step, (a, b) in enumerate(zip(outs[True], outs[False])):
        assert rel(a, b) < tol, f"step {step}: rel err {rel(a, b)}"


# Step 1: fresh prefills (one of a single token); step 2: chunked prefills over cached context
# plus decodes (a context of 1, one ending on a block edge); step 3: decode-only.
LAYER_STEPS = [([5, 1, 9, 3], [0, 0, 0, 0]), ([1, 6, 1, 1], [5, 1, 9, 3]), ([1, 1, 1, 1], [6, 7, 10, 4])]


@needs_triton_device
@pytest.mark.parametrize("graph_layout, chunk_rows", [(False, 64), (True, 0), (True, 16), (True, 64)])
def test_mla_layer_triton_path_matches_torch_path(monkeypatch, graph_layout, chunk_rows):
    """The GPU path's mixed steps eagerly (prefill rows expanded) and as their CUDA graph runs them
    (every row absorbed from the device layout, the chunks a row a token or packed; steps 1 and 2:
    18 and 9 tokens)."""
    import kernels.triton_attention.mla_decode as mla_decode
    monkeypatch.setattr(mla_layer, "CHUNK_ROWS", chunk_rows)
    absorbed = []
    real_rows = mla_decode.mla_token_rows
    monkeypatch.setattr(mla_decode, "mla_token_rows",
                        lambda qsl, lens, T, **kw: absorbed.append(T) or real_rows(qsl, lens, T, **kw))
    rope = RopeConfig(10000.0, "yarn", 4.0, 16, {"mscale": 0.707, "mscale_all_dim": 1.0})
    cfg = MLAConfig(hidden_size=40, num_heads=3, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
                    qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=256, rope=rope)
    run_layer_both_paths(monkeypatch, cfg, torch.float32, 4, 64, LAYER_STEPS, DEV, tol=1e-5, graph_layout=graph_layout)
    assert absorbed == ([18, 9] if graph_layout else [])


def test_cpu_tensors_take_the_torch_path():
    assert not mla_layer.use_triton_path(torch.zeros(1))


# --- GPU: DeepSeek-V3 shapes, bf16 ----------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("H", [16, 128])
def test_mla_decode_deepseek_shapes(H):
    lens, S, R, P = [1, 16, 17, 300, 1000, 4096, 0, 2049], 16, 512, 64
    poisoned, clean, tables = paged_cache(lens, S, R + P, extra_blocks=10, dtype=torch.bfloat16, seed=H)
    q = torch.randn(len(lens), H, R + P, generator=torch.Generator().manual_seed(0)).to(DEV, torch.bfloat16)
    scale = 192 ** -0.5
    ref = decode_reference(q, clean, tables, lens, scale, R)
    for splits in (None, 1, 7):
        out = mla_decode_triton(q, poisoned, tables, torch.tensor(lens, dtype=torch.int32, device=DEV), scale, R,
                                num_splits=splits)
        assert rel(out, ref) < 1e-2, splits
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@needs_cuda
def test_mla_decode_replays_in_cuda_graph():
    B, H, S, R, P, M = 6, 128, 16, 512, 64, 256  # tables wide enough for 4096 tokens
    lens1, lens2 = [5, 4096, 0, 33, 1, 700], [16, 17, 2000, 0, 4096, 1]
    poisoned, clean, tables1 = paged_cache(lens1 + lens2, S, R + P, extra_blocks=4, dtype=torch.bfloat16, seed=7)
    tables1 = torch.cat((tables1, torch.zeros(2 * B, M - tables1.shape[1], dtype=tables1.dtype, device=DEV)), 1)
    g = torch.Generator().manual_seed(3)
    q_static = torch.randn(B, H, R + P, generator=g).to(DEV, torch.bfloat16)
    lens_static = torch.tensor(lens1, dtype=torch.int32, device=DEV)
    tables_static = tables1[:B].clone()
    out_static = torch.empty(B, H, R, dtype=torch.bfloat16, device=DEV)
    scale = 192 ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        mla_decode_triton(q_static, poisoned, tables_static, lens_static, scale, R, out_BHR=out_static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_triton(q_static, poisoned, tables_static, lens_static, scale, R, out_BHR=out_static)
    for lens, rows in ((lens1, slice(0, B)), (lens2, slice(B, 2 * B))):
        q_new = torch.randn(B, H, R + P, generator=g).to(DEV, torch.bfloat16)
        q_static.copy_(q_new)
        lens_static.copy_(torch.tensor(lens, dtype=torch.int32))
        tables_static.copy_(tables1[rows])
        out_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_reference(q_new, clean, tables1[rows], lens, scale, R)
        assert rel(out_static, ref) < 1e-2
        torch.testing.assert_close(out_static.float(), ref.float(), atol=3e-2, rtol=3e-2)


@needs_cuda
def test_varlen_deepseek_shapes():
    ns, lks = [1, 100, 513, 7], [1, 2000, 513, 4096]
    q, k, v, cu_q, cu_k = varlen_inputs(ns, lks, 16, 192, 128, torch.bfloat16, seed=0)
    out = varlen_attention_triton(q, k, v, cu_q, cu_k, max(ns), 192 ** -0.5)
    ref = varlen_reference(q, k, v, ns, lks, 192 ** -0.5)
    assert rel(out, ref) < 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@needs_cuda
def test_mla_layer_gpu_path_deepseek_dims(monkeypatch):
    rope = RopeConfig(10000.0, "yarn", 40.0, 4096, {"mscale": 1.0, "mscale_all_dim": 1.0})
    cfg = MLAConfig(hidden_size=512, num_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=16384, rope=rope)
    steps = [([300, 1, 40], [0, 0, 0]), ([1, 200, 1], [300, 1, 40]), ([1, 1, 1], [301, 201, 41])]
    for graph_layout, tol in ((False, 2e-2), (True, 3e-2)):  # absorbed: q @ W_UK rounded to bf16, 576-wide dots
        run_layer_both_paths(monkeypatch, cfg, torch.bfloat16, 16, 128, steps, DEV, tol=tol, graph_layout=graph_layout)
