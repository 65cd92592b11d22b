"""Paged attention on the CPU, batched over sequences: the fast path of models/layers/attention.py
for non-CUDA tensors. kernels.attention.paged_attention_torch stays the reference it is tested
against (same inputs, same masks).

Legend: T query tokens of the batch, B sequences (Bg of one group), H query heads, G KV heads,
d head dim, N cache blocks, S block size, P padded length of a group, W blocks read per sequence.

What is batched (measured on a 2-core AVX-512 VM, 64 sequences, H=8, G=4, d=32, fp32):
- fresh prefills (no cached context): sequences of similar length padded to the group's longest
  and run as one causal SDPA (with a [P, P] chunk-window mask under chunked-local attention); 64 x 128
  tokens: 23 ms against 47 ms for one SDPA per sequence. Groups are cut where padding would add
  more than PAD_SLACK of the exact work.
- decode rows (fp32): one call of the native kernel (kernels/cpu_native/paged_decode.c) over the
  paged cache, no gather (2.4-6.5x faster than the grouped SDPA at the workload's decode step,
  BENCHMARKS.md §6); its fallback (no C compiler, other dtypes): one SDPA per group of sequences
  of similar context length, reading only the group's blocks, gathered with one index_select on
  the [N, S*G*d] view of each of K and V (advanced indexing on the 5-D cache cost 2.5x more); 64
  sequences of 160 tokens: 2.6 ms against 4.5 ms for the reference's gather of the whole batch.
- prefills on cached context (prefix-cache hits, chunked prefill) run one SDPA each, as the
  reference does: they are rare on the CPU path and their context differs per sequence.
- FP8 caches (kernels/attention.py's docstring): dequantised in torch where read (the native
  kernel takes fp32 caches only, so decode rows take the grouped-SDPA fallback), fresh prefill
  keys round-tripped through the cache dtype: correct rather than fast.
- sliding windows: masks and first visible positions as for chunks, everywhere (the native kernel
  takes each row's first position). Attention sinks: every SDPA above with one more key whose
  score is the sink and whose value is zero (_sdpa_sinks, fp32); the native kernel has no sinks,
  so decode rows with sinks take the grouped-SDPA fallback.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_native import ops as native_ops
from kernels.attention import (
    AttentionMetadata,
    _gather_context,
    check_local,
    check_sinks,
    dequantize_kv,
    is_fp8_kv,
    key_start,
    round_trip_kv,
)

# A group is cut when padding it would cost more than this factor of its exact work.
PAD_SLACK = 1.25


def _groups(lengths: list[int], cost) -> list[list[int]]:
    """Indices into `lengths`, longest first, in groups whose padded cost (len(group) x
    cost(longest)) stays within PAD_SLACK of the sum of their own costs."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    exact = 0.0
    for i in order:
        if groups:
            top = cost(lengths[groups[-1][0]])
            if (len(groups[-1]) + 1) * top <= PAD_SLACK * (exact + cost(lengths[i])):
                groups[-1].append(i)
                exact += cost(lengths[i])
                continue
        groups.append([i])
        exact = cost(lengths[i])
    return groups


def _local_mask(P: int, chunk_size: int | None, sliding_window: int | None) -> torch.Tensor | None:
    """[P, P] causal chunked-local / sliding-window mask of a fresh prefill of P tokens; None where
    the causal mask alone is it."""
    if (chunk_size or P) >= P and (sliding_window or P) >= P:
        return None
    pos = torch.arange(P)
    qpos, kpos = pos[:, None], pos[None, :]
    return (kpos <= qpos) & (kpos >= key_start(qpos, chunk_size, sliding_window))


def _sdpa_sinks(q, k, v, mask, scale: float, gqa: bool, sinks_H: torch.Tensor) -> torch.Tensor:
    """SDPA of q [.., H, n, d] over k, v [.., G, L, d] (mask: bool, broadcast to [.., n, L]; None =
    causal) with each head's sink logit as one more key of value zero, in fp32: q gets one more
    dim holding sink / scale, the real keys a 0 there and the sink key a 1 (and 0 elsewhere), so the
    sink key scores the sink in every row of its head, the real keys as before. One bool mask for
    all heads, as without sinks, where a float mask with the sinks in would be per head."""
    H, n, L, d = q.shape[-3], q.shape[-2], k.shape[-2], k.shape[-1]
    if mask is None:
        mask = torch.ones(n, L, dtype=torch.bool).tril()
    mask = F.pad(mask, (0, 1), value=True)  # every row sees its sink
    # A sink of -inf (none) as one whose exp is 0 in fp32: the real keys' 0 times it stays 0.
    sink_q = (sinks_H.float().clamp(min=-1e4) / scale).view(H, 1, 1).expand(*q.shape[:-1], 1)
    q = torch.cat([q.float(), sink_q], dim=-1)
    k = F.pad(k.float(), (0, 1, 0, 1))
    k[..., L, d] = 1.0
    v = F.pad(v.float(), (0, 0, 0, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _sdpa(q, k, v, mask, scale: float, gqa: bool, sinks_H: torch.Tensor | None) -> torch.Tensor:
    """SDPA under a bool mask (None = causal), with sinks when given; in q's dtype."""
    if sinks_H is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)
    return _sdpa_sinks(q, k, v, mask, scale, gqa, sinks_H).to(q.dtype)


def _prefill_fresh(out_THd, q_THd, k_TGd, v_TGd, meta, seqs, scale, chunk_size, sliding_window, sinks, gqa):
    """Prefills with no cached context: their keys are the batch's own new K/V."""
    starts = [meta.query_start_loc[b] for b in seqs]
    lens = [meta.query_start_loc[b + 1] - meta.query_start_loc[b] for b in seqs]
    for group in _groups(lens, lambda n: n * n):
        P, Bg, first = lens[group[0]], len(group), starts[group[0]]
        if all(lens[i] == P and starts[i] == first + j * P for j, i in enumerate(group)):
            # back to back in the batch, all of one length (a benchmark's batch): views, no gathers
            rows = slice(first, first + Bg * P)
            q, k, v = (t[rows].view(Bg, P, *t.shape[1:]) for t in (q_THd, k_TGd, v_TGd))
            idx_BP = valid_BP = None
        else:
            n_B = torch.tensor([lens[i] for i in group])
            start_B = torch.tensor([starts[i] for i in group])
            # Rows past a sequence's end repeat its last token: finite, masked as keys, dropped as queries.
            pos_P = torch.arange(P)
            idx_BP = start_B[:, None] + torch.minimum(pos_P[None, :], n_B[:, None] - 1)
            valid_BP = None if bool((n_B == P).all()) else pos_P[None, :] < n_B[:, None]
            q, k, v = q_THd[idx_BP], k_TGd[idx_BP], v_TGd[idx_BP]
        # [Bg, heads, P, d]; padded keys sit after every real query, so the causal mask alone hides them.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        mask = _local_mask(P, chunk_size, sliding_window)
        o = _sdpa(q, k, v, mask, scale, gqa, sinks).transpose(1, 2)  # [Bg, P, H, d]
        if idx_BP is None:
            out_THd[rows] = o.reshape(Bg * P, *o.shape[2:])
        elif valid_BP is None:
            out_THd[idx_BP.reshape(-1)] = o.reshape(-1, *o.shape[2:])
        else:
            out_THd[idx_BP[valid_BP]] = o[valid_BP]


def _prefill_cached(out_THd, q_THd, kv_cache_2NSGd, meta, b, scale, chunk_size, sliding_window, sinks, gqa,
                    k_scale, v_scale):
    """One prefill on cached context (its new K/V already in the cache), as the reference."""
    start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
    n, L = end - start, meta.seq_lens[b]
    k0 = key_start(L - n, chunk_size, sliding_window)  # keys before the first query's chunk / window: never seen
    k, v = _gather_context(kv_cache_2NSGd, meta.block_tables_BM[b], L, k0)
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(k0, L)[None, :]
    mask = (kpos <= qpos) & (kpos >= key_start(qpos, chunk_size, sliding_window))
    q = q_THd[start:end].transpose(0, 1)
    k, v = dequantize_kv(k.transpose(0, 1), q.dtype, k_scale), dequantize_kv(v.transpose(0, 1), q.dtype, v_scale)
    o = _sdpa(q, k, v, mask, scale, gqa, sinks)
    out_THd[start:end] = o.transpose(0, 1)


def _decode_plan(meta, S: int, chunk_size, sliding_window):
    """Per group of decode sequences: (flat block ids [Bg*W], mask [Bg, W*S], query rows [Bg]).
    The same for every layer of a forward with the same chunking / window, so it is kept on `meta`."""
    key = ("_cpu_decode_plan", S, chunk_size, sliding_window)
    cached = getattr(meta, "_cpu_plans", {}).get(key)
    if cached is not None:
        return cached
    lens_host = [meta.seq_lens[b] for b in meta.decode_seqs]
    tables_all = meta.decode_block_tables
    nblk_all = tables_all.shape[1]
    first_host = [key_start(L - 1, chunk_size, sliding_window) for L in lens_host]
    # Blocks a sequence reads: from its first visible position's block to its last token's.
    reads = [-(-L // S) - f // S for L, f in zip(lens_host, first_host)]
    plan = []
    for group in _groups(reads, lambda w: w):
        sel = torch.tensor(group)
        W = reads[group[0]]
        lens_B = meta.decode_seq_lens[sel]
        first_B = torch.tensor([first_host[i] for i in group])
        cols_BW = (first_B // S)[:, None] + torch.arange(W)[None, :]
        # Columns past a sequence's last block read its last block again (masked below).
        last_B = (lens_B - 1) // S
        blocks_BW = tables_all[sel].gather(1, torch.minimum(cols_BW, last_B[:, None]).clamp(max=nblk_all - 1))
        kpos_BK = (first_B // S * S)[:, None] + torch.arange(W * S)[None, :]
        mask_BK = (kpos_BK < lens_B[:, None]) & (kpos_BK >= first_B[:, None])
        plan.append((blocks_BW.reshape(-1), mask_BK[:, None, None, :], meta.decode_token_idx[sel]))
    if not hasattr(meta, "_cpu_plans"):
        meta._cpu_plans = {}
    meta._cpu_plans[key] = plan
    return plan


def _native_decode_args(meta, chunk_size, sliding_window):
    """The decode rows' int32 block tables, lengths and first visible positions and their int64
    query rows, contiguous for the native kernel; the same for every layer of a forward with the
    same chunking / window, so they are kept on `meta`."""
    key = ("_cpu_native_decode", chunk_size, sliding_window)
    plans = meta.__dict__.setdefault("_cpu_plans", {})
    if key not in plans:
        lens = meta.decode_seq_lens.to(torch.int32).contiguous()
        firsts = key_start((lens - 1).clamp(min=0), chunk_size, sliding_window).to(torch.int32).contiguous()
        plans[key] = (meta.decode_block_tables.to(torch.int32).contiguous(), lens, firsts,
                      meta.decode_token_idx.to(torch.int64).contiguous())
    return plans[key]


def _decode(out_THd, q_THd, kv_cache_2NSGd, meta, scale, chunk_size, sliding_window, sinks, gqa, k_scale, v_scale):
    """All decode rows: the native kernel where it serves (not with sinks), else in groups of
    similar context length, each reading only its blocks."""
    if sinks is None and q_THd.dtype == torch.float32 and native_ops.paged_decode(
            out_THd, q_THd, kv_cache_2NSGd, scale, *_native_decode_args(meta, chunk_size, sliding_window)):
        return
    _, N, S, G, d = kv_cache_2NSGd.shape
    k_cache, v_cache = kv_cache_2NSGd.view(2, N, S * G * d).unbind(0)
    for blocks, mask, rows in _decode_plan(meta, S, chunk_size, sliding_window):
        Bg = rows.shape[0]
        k = k_cache.index_select(0, blocks).view(Bg, -1, G, d).transpose(1, 2)  # [Bg, G, W*S, d]
        v = v_cache.index_select(0, blocks).view(Bg, -1, G, d).transpose(1, 2)
        q = q_THd[rows][:, :, None, :]  # [Bg, H, 1, d]
        o = _sdpa(q, dequantize_kv(k, q.dtype, k_scale), dequantize_kv(v, q.dtype, v_scale), mask, scale, gqa, sinks)
        out_THd[rows] = o[:, :, 0, :]


def paged_attention_cpu(q_THd: torch.Tensor, k_TGd: torch.Tensor, v_TGd: torch.Tensor,
                        kv_cache_2NSGd: torch.Tensor, meta: AttentionMetadata, scale: float,
                        chunk_size: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0, *,
                        sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.attention.paged_attention_torch: causal attention of each
    sequence's new queries over its context (chunked-local when chunk_size is set, a sliding
    window when sliding_window is; sinks: fp32 [H] sink logits); new K/V must already be in the
    cache; k_scale / v_scale: an FP8 cache's scales. Returns [T, H, d]."""
    if q_THd.is_cuda:
        raise ValueError("paged_attention_cpu runs on CPU tensors; CUDA uses kernels/triton_attention")
    check_local(chunk_size, sliding_window)
    sinks = check_sinks(sinks, q_THd.shape[1], q_THd.device)
    out_THd = torch.empty_like(q_THd)
    gqa = q_THd.shape[1] != kv_cache_2NSGd.shape[3]
    fresh = [b for b in meta.prefill_seqs
             if meta.query_start_loc[b + 1] - meta.query_start_loc[b] == meta.seq_lens[b]]
    if fresh:
        if is_fp8_kv(kv_cache_2NSGd.dtype):  # fresh keys as the cache holds them
            k_TGd = round_trip_kv(k_TGd, kv_cache_2NSGd.dtype, k_scale)
            v_TGd = round_trip_kv(v_TGd, kv_cache_2NSGd.dtype, v_scale)
        _prefill_fresh(out_THd, q_THd, k_TGd, v_TGd, meta, fresh, scale, chunk_size, sliding_window, sinks, gqa)
    if len(fresh) < len(meta.prefill_seqs):
        fresh_set = set(fresh)
        for b in meta.prefill_seqs:
            if b not in fresh_set:
                _prefill_cached(out_THd, q_THd, kv_cache_2NSGd, meta, b, scale, chunk_size, sliding_window, sinks, gqa,
                                k_scale, v_scale)
    if meta.decode_seqs:
        _decode(out_THd, q_THd, kv_cache_2NSGd, meta, scale, chunk_size, sliding_window, sinks, gqa, k_scale, v_scale)
    return out_THd
