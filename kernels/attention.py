"""Paged attention: KV-cache writes through a slot mapping, attention reads through block
tables. This file is the pure-torch reference (the CPU path); GPU kernels share its inputs.

Legend: T query tokens of the batch, B sequences, H query heads, G KV heads, d head dim,
N cache blocks, S block size, L context length of a sequence.
KV cache layout per layer: kv_cache_2NSGd = [2 (k, v), N, S, G, d], zero-initialised so that
masked-out padding is finite.

FP8 caches (kv_cache_dtype "fp8" = "fp8_e4m3", "fp8_e5m2"; torch.float8_e4m3fn / float8_e5m2) hold
K and V with one per-tensor scale each per layer (k_scale, v_scale: 1.0 unless the checkpoint
gives them), as vLLM: a value x is stored as fp8(clamp(x / scale, +-fp8 max)) and read back as
float(stored) * scale, the attention maths then as usual. Every reader attends over what the cache
holds: fresh keys of a prefill go through the same round trip. Caches of any other dtype ignore
the scales.

Local attention, at most one kind per layer (key_start): chunked-local (Llama-4's RoPE layers,
chunk_size C: a query at p sees floor(p / C) * C .. p) or a sliding window (gpt-oss's alternate
layers, sliding_window W: p sees max(0, p - W + 1) .. p, as transformers' kv_idx > q_idx - W).
Attention sinks (gpt-oss, sinks_H: fp32 [H]): head h's learned logit s_h (natural-log units, not
scaled) joins every row's softmax as one more column whose value is zero,
p_j = exp(l_j) / (sum_i exp(l_i) + exp(s_h)): the output shrinks where the keys score low.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Batch layout shared by every attention layer of one forward.

    query_start_loc: host list of B+1 offsets of each sequence's queries in the flat batch.
    seq_lens: host list of B context lengths after this step (cached + new tokens).
    block_tables_BM: [B, max_blocks] int32 block ids on the device (padding is 0, never read).
    slot_mapping_T: [T] int64 cache slot (block_id * S + offset) of each new token; -1 = skip.
    decode_seqs: indices of sequences with exactly one query token (batched together).
    prefill_seqs: indices of the others (one attention call each).
    """
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables_BM: torch.Tensor
    slot_mapping_T: torch.Tensor
    decode_seqs: list[int]
    prefill_seqs: list[int]
    # Decode sequences, prepared once per forward: their token positions in the batch [Bd],
    # context lengths [Bd] and block tables cut to the longest context [Bd, nblk].
    decode_token_idx: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    # With several KV-cache groups (e.g. full and chunked-local layers), each group's own
    # metadata (same batch layout, its own block tables and slots); group 0 is this object.
    group_metas: list["AttentionMetadata"] | None = None
    # Device-side layout for the GPU kernels (kernels/triton_attention): device copies of
    # query_start_loc [B+1] and seq_lens [B] (int32 or int64), the longest query of the batch, and whether every
    # sequence has exactly one query (a decode-only step: the split-KV decode kernel, and the
    # shape a CUDA graph is captured for; padded rows then have seq_lens 0 and slot -1).
    query_start_loc_t: torch.Tensor | None = None
    seq_lens_t: torch.Tensor | None = None
    max_query_len: int = 0
    decode_only: bool = False
    # False: the host lists (query_start_loc, seq_lens, decode_seqs, prefill_seqs) are placeholders
    # that do not describe the step, as in a mixed step's CUDA graph: kernels read the device tensors.
    host_lists: bool = True
    # Recurrent (linear-attention) layers: each sequence's slot in their state pools [B] int64 and
    # whether its state carries over from earlier steps [B] bool (False: the step starts at position
    # 0, the state reads as zeros); None without such layers (scheduler/kv_cache_spec.py).
    state_slots_B: torch.Tensor | None = None
    has_initial_state_B: torch.Tensor | None = None
    # What a layer derives from this layout once per forward for every later layer to reuse
    # (e.g. MLA's context-gather indices), keyed by the deriving layer kind.
    derived: dict = field(default_factory=dict)

    def for_group(self, group: int) -> "AttentionMetadata":
        return self if self.group_metas is None else self.group_metas[group]


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype is an FP8 one (quantised with per-tensor scales)."""
    return dtype in FP8_KV_DTYPES


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a cache of `dtype` stores it: fp8(clamp(x / scale)) for FP8 (saturated to +-448 for
    e4m3, +-57344 for e5m2; the cast rounds to nearest even), a plain cast otherwise."""
    if not is_fp8_kv(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache contents x back in `dtype`: float(x) * scale for FP8, a plain cast otherwise."""
    if not is_fp8_kv(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def round_trip_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as an FP8 cache of cache_dtype would give it back (x itself for other caches, which hold
    the model dtype exactly)."""
    if not is_fp8_kv(cache_dtype):
        return x
    return dequantize_kv(quantize_kv(x, cache_dtype, scale), x.dtype, scale)


def write_kv_cache(k_TGd: torch.Tensor, v_TGd: torch.Tensor, kv_cache_2NSGd: torch.Tensor,
                   slot_mapping_T: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k_TGd[t] / v_TGd[t] to slot slot_mapping_T[t], cast (FP8: quantised with k_scale / v_scale)
    to the cache dtype."""
    flat = kv_cache_2NSGd.view(2, -1, *kv_cache_2NSGd.shape[3:])
    if is_fp8_kv(flat.dtype):  # torch has no index_copy_ for float8: copy the bytes
        raw = flat.view(torch.uint8)
        raw[0].index_copy_(0, slot_mapping_T, quantize_kv(k_TGd, flat.dtype, k_scale).view(torch.uint8))
        raw[1].index_copy_(0, slot_mapping_T, quantize_kv(v_TGd, flat.dtype, v_scale).view(torch.uint8))
        return
    flat[0].index_copy_(0, slot_mapping_T, k_TGd.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping_T, v_TGd.to(flat.dtype))


def _gather_context(kv_cache_2NSGd, block_ids, length, start: int = 0):
    """K and V of one sequence's tokens start .. length - 1: each [length - start, G, d]."""
    S = kv_cache_2NSGd.shape[2]
    b0, nblk = start // S, -(-length // S)
    kv = kv_cache_2NSGd[:, block_ids[b0:nblk]]  # [2, nblk - b0, S, G, d]
    kv = kv.reshape(2, (nblk - b0) * S, *kv.shape[3:])[:, start - b0 * S:length - b0 * S]
    return kv[0], kv[1]


def chunk_start(pos: torch.Tensor | int, chunk_size: int | None):
    """First position a query at `pos` may attend to under chunked-local attention (0 without it)."""
    if chunk_size is None:
        return pos * 0
    return (pos // chunk_size) * chunk_size


def key_start(pos: torch.Tensor | int, chunk_size: int | None, sliding_window: int | None = None):
    """First position a query at `pos` may attend to: its chunk's start under chunked-local
    attention, max(0, pos - sliding_window + 1) under a sliding window, else 0."""
    if sliding_window is None:
        return chunk_start(pos, chunk_size)
    lo = pos - (sliding_window - 1)
    return lo.clamp(min=0) if isinstance(lo, torch.Tensor) else max(lo, 0)


def check_local(chunk_size: int | None, sliding_window: int | None) -> None:
    """Validates the local-attention arguments of every paged-attention entry point."""
    if chunk_size is not None and sliding_window is not None:
        raise ValueError(f"chunk_size ({chunk_size}) and sliding_window ({sliding_window}) exclude each other")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive or None, got {chunk_size}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")


def check_sinks(sinks_H: torch.Tensor | None, H: int, device: torch.device) -> torch.Tensor | None:
    """Validates attention sinks (one float logit per query head, on the queries' device); returns
    them contiguous (the kernels index them by head)."""
    if sinks_H is None:
        return None
    if sinks_H.shape != (H,) or not sinks_H.is_floating_point():
        raise ValueError(f"sinks must be a float [H={H}] tensor, got {sinks_H.dtype} {tuple(sinks_H.shape)}")
    if sinks_H.device != device:
        raise ValueError(f"sinks on {sinks_H.device}, queries on {device}")
    return sinks_H.contiguous()


def _attend(q, k, v, mask, causal: bool, scale: float, gqa: bool, sinks_H: torch.Tensor | None):
    """SDPA of q [.., H, n, d] over k, v [.., G, L, d] (mask: bool, broadcast to [.., n, L]; causal:
    the top-left causal mask instead). With sinks_H [H], the plain softmax with the sink column
    appended (as transformers' gpt-oss eager attention), in fp32."""
    if sinks_H is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    H, n, L = q.shape[-3], q.shape[-2], k.shape[-2]
    k, v = (t.float().repeat_interleave(H // t.shape[-3], dim=-3) for t in (k, v))
    scores = q.float() @ k.transpose(-1, -2) * scale  # [.., H, n, L]
    if causal:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks_H.float().view(H, 1, 1).expand(*scores.shape[:-1], 1)
    p = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return (p @ v).to(q.dtype)


def paged_attention_torch(q_THd: torch.Tensor, k_TGd: torch.Tensor, v_TGd: torch.Tensor,
                          kv_cache_2NSGd: torch.Tensor, meta: AttentionMetadata, scale: float,
                          chunk_size: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0, *,
                          sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its context.

    chunk_size: None = global causal attention. Otherwise chunked-local attention (Llama-4's
    RoPE layers): a query at position p sees only the keys at positions
    floor(p / chunk_size) * chunk_size .. p, its own chunk so far.
    sliding_window: a query at p sees the keys max(0, p - sliding_window + 1) .. p (not with
    chunk_size). sinks: fp32 [H], each head's sink logit (module docstring); None = no sinks.
    New K/V must already be written to the cache. k_scale / v_scale: an FP8 cache's scales
    (ignored for other caches; see the module docstring). Returns [T, H, d].
    """
    check_local(chunk_size, sliding_window)
    sinks = check_sinks(sinks, q_THd.shape[1], q_THd.device)
    local = chunk_size is not None or sliding_window is not None
    out = torch.empty_like(q_THd)
    H, G = q_THd.shape[1], kv_cache_2NSGd.shape[3]
    gqa = H != G
    cdt = kv_cache_2NSGd.dtype

    def fresh(start: int, end: int):  # a prefill's new K/V as the cache holds them
        return round_trip_kv(k_TGd[start:end], cdt, k_scale), round_trip_kv(v_TGd[start:end], cdt, v_scale)

    for b in meta.prefill_seqs:
        start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
        n, L = end - start, meta.seq_lens[b]
        q = q_THd[start:end].transpose(0, 1)  # [H, n, d]
        if n == L and not local:  # no cached context: attend over the fresh keys directly
            k, v = fresh(start, end)
            mask, causal = None, True
        else:
            # Keys before the first query's chunk / window are never seen: skip reading them.
            k0 = key_start(L - n, chunk_size, sliding_window)
            if n == L:
                k, v = fresh(start, end)
            else:
                k, v = _gather_context(kv_cache_2NSGd, meta.block_tables_BM[b], L, k0)
            # Query i sits at position L - n + i and sees keys key_start(L - n + i) .. L - n + i.
            qpos = torch.arange(L - n, L, device=q.device)[:, None]
            kpos = torch.arange(k0, L, device=q.device)[None, :]
            mask, causal = (kpos <= qpos) & (kpos >= key_start(qpos, chunk_size, sliding_window)), False
        k, v = dequantize_kv(k.transpose(0, 1), q.dtype, k_scale), dequantize_kv(v.transpose(0, 1), q.dtype, v_scale)
        o = _attend(q, k, v, mask, causal, scale, gqa, sinks)
        out[start:end] = o.transpose(0, 1)
    if meta.decode_seqs:
        idx, lens, tables = meta.decode_token_idx, meta.decode_seq_lens, meta.decode_block_tables
        S, nblk = kv_cache_2NSGd.shape[2], tables.shape[1]
        if not local:
            first_pos = torch.zeros_like(lens)
            block_ids = tables  # [B, nblk]
        else:
            # Read only the blocks of each query's chunk / window (the one query sits at lens - 1).
            first_pos = key_start(lens - 1, chunk_size, sliding_window)
            span = min(-(-(chunk_size or sliding_window) // S) + 1, nblk)  # blocks a chunk / window can touch
            cols = (first_pos // S)[:, None] + torch.arange(span, device=lens.device)[None, :]
            block_ids = tables.gather(1, cols.clamp(max=nblk - 1))  # clamped columns are masked below
        W = block_ids.shape[1]
        kv = kv_cache_2NSGd[:, block_ids]  # [2, B, W, S, G, d]
        kv = kv.reshape(2, kv.shape[1], W * S, G, -1).transpose(2, 3)  # [2, B, G, W*S, d]
        kpos = (first_pos // S * S)[:, None] + torch.arange(W * S, device=q_THd.device)[None, :]
        mask = (kpos < lens[:, None]) & (kpos >= first_pos[:, None])
        q = q_THd[idx][:, :, None, :]  # [B, H, 1, d]
        o = _attend(q, dequantize_kv(kv[0], q.dtype, k_scale), dequantize_kv(kv[1], q.dtype, v_scale),
                    mask[:, None, None, :], False, scale, gqa, sinks)
        out[idx] = o[:, :, 0, :]
    return out
