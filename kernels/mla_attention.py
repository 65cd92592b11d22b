"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache: pure-torch
reference (the CPU path); GPU kernels share its inputs.

The cache keeps per token only C = R + P numbers: the normalised KV latent (R = kv_lora_rank)
then the rotated shared rope key (P = qk_rope_head_dim). Two equivalent ways to attend:

- expanded: per-head keys [k_nope | k_pe] and values come from the latent through kv_b_proj
  (W_kvb = [H * (Dn + Dv), R]); plain attention with qk head dim Dn + P and v head dim Dv.
- absorbed: the query's nope part is projected into latent space (q_nope @ W_UK), keys are the
  cache rows themselves ([latent | k_pe], one "KV head" shared by all query heads), values
  are the latents; the output latent goes through W_UV afterwards (done by the caller).

An FP8 cache (kv_cache_dtype "fp8" / "fp8_e5m2") holds the whole row, latent and rope key,
quantised with one per-tensor scale per layer (`kv_scale`, vLLM's k_scale of an MLA layer; see
kernels/attention.py for the rounding): stored fp8(clamp(row / kv_scale)), read float * kv_scale.
Fresh rows of a prefill are attended as the cache holds them (round-tripped). Other caches ignore
kv_scale.

Legend: T query tokens, H heads (local), R kv_lora_rank, P qk_rope_head_dim, C = R + P,
Dn qk_nope_head_dim, Dv v_head_dim, N cache blocks, S block size, L context length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata, dequantize_kv, is_fp8_kv, quantize_kv, round_trip_kv


def write_latent_cache(latent_TC: torch.Tensor, cache_NSC: torch.Tensor, slot_mapping_T: torch.Tensor,
                       kv_scale: float = 1.0) -> None:
    """Store each new token's [latent | k_pe] row at its slot (block_id * S + offset), cast (FP8:
    quantised with kv_scale) to the cache dtype."""
    flat = cache_NSC.view(-1, cache_NSC.shape[-1])
    if is_fp8_kv(flat.dtype):  # torch has no index_copy_ for float8: copy the bytes
        rows = quantize_kv(latent_TC, flat.dtype, kv_scale).view(torch.uint8)
        flat.view(torch.uint8).index_copy_(0, slot_mapping_T, rows)
        return
    flat.index_copy_(0, slot_mapping_T, latent_TC.to(cache_NSC.dtype))


def gather_latent_context(cache_NSC: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The cache rows of one sequence's first `length` tokens: [length, C]."""
    S = cache_NSC.shape[1]
    nblk = -(-length // S)
    return cache_NSC[block_ids[:nblk]].reshape(nblk * S, -1)[:length]


def _context(cache_NSC, latent_TC, meta: AttentionMetadata, b: int, kv_scale: float = 1.0):
    """(context rows [L, C], query positions offset) of prefill sequence b: fresh rows when
    nothing is cached yet, else read through the block table (an FP8 cache's rows dequantised
    to fp32, fresh rows round-tripped through it)."""
    start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
    n, L = end - start, meta.seq_lens[b]
    if n == L:
        return round_trip_kv(latent_TC[start:end], cache_NSC.dtype, kv_scale), start, end, n, L
    ctx = gather_latent_context(cache_NSC, meta.block_tables_BM[b], L)
    if is_fp8_kv(ctx.dtype):
        ctx = dequantize_kv(ctx, torch.float32, kv_scale)
    return ctx, start, end, n, L


def _causal_mask(n: int, L: int, device) -> torch.Tensor:
    # Query i sits at position L - n + i and sees keys 0 .. L - n + i.
    return torch.arange(L, device=device)[None, :] <= torch.arange(L - n, L, device=device)[:, None]


def mla_expanded_prefill_torch(q_THE: torch.Tensor, latent_TC: torch.Tensor, cache_NSC: torch.Tensor,
                               w_kvb: torch.Tensor, meta: AttentionMetadata, seqs: list[int],
                               qk_nope_head_dim: int, v_head_dim: int, scale: float,
                               out_THDv: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Expanded-form attention for the sequences `seqs` (writes their rows of `out_THDv`).

    q_THE: [T, H, Dn + P] queries (rope part already rotated); latent_TC: [T, C] this step's
    cache rows (already written to the cache); w_kvb: [H * (Dn + Dv), R] kv_b_proj weight of
    the local heads; out_THDv: [T, H, Dv]; kv_scale: an FP8 cache's scale.
    """
    H, R = q_THE.shape[1], w_kvb.shape[1]
    for b in seqs:
        ctx_LC, start, end, n, L = _context(cache_NSC, latent_TC, meta, b, kv_scale)
        ctx_LC = ctx_LC.to(q_THE.dtype)
        kv = F.linear(ctx_LC[:, :R], w_kvb).view(L, H, qk_nope_head_dim + v_head_dim)
        k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
        k_pe = ctx_LC[:, None, R:].expand(L, H, ctx_LC.shape[1] - R)
        k = torch.cat((k_nope, k_pe), dim=-1)
        q = q_THE[start:end].transpose(0, 1)  # [H, n, Dn + P]
        mask = None if n == L else _causal_mask(n, L, q.device)
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           is_causal=mask is None, scale=scale)
        out_THDv[start:end] = o.transpose(0, 1)


def _latent_attention(q_HnC: torch.Tensor, ctx_LC: torch.Tensor, R: int, scale: float,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Single-KV-head attention in latent space: q [..., H, n, C] over ctx [..., L, C] with
    values ctx[..., :R]; mask [..., n, L] broadcast over heads. Softmax in fp32."""
    s = torch.matmul(q_HnC.float(), ctx_LC.float().unsqueeze(-3).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    p = s.softmax(dim=-1)
    return torch.matmul(p, ctx_LC[..., :R].float().unsqueeze(-3)).to(q_HnC.dtype)


def mla_absorbed_torch(q_THC: torch.Tensor, latent_TC: torch.Tensor, cache_NSC: torch.Tensor,
                       meta: AttentionMetadata, prefill_seqs: list[int], include_decode: bool,
                       scale: float, out_THR: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Absorbed-form attention: q_THC = [q_nope @ W_UK | q_pe] per head [T, H, C]; keys are the
    cache rows, values their latent part. Writes out_THR [T, H, R] (latent outputs) for the
    given prefill sequences and, when `include_decode`, for every decode sequence (batched
    through meta.decode_* tensors). kv_scale: an FP8 cache's scale."""
    R = out_THR.shape[-1]
    for b in prefill_seqs:
        ctx_LC, start, end, n, L = _context(cache_NSC, latent_TC, meta, b, kv_scale)
        q = q_THC[start:end].transpose(0, 1)  # [H, n, C]
        out_THR[start:end] = _latent_attention(q, ctx_LC, R, scale, _causal_mask(n, L, q.device)).transpose(0, 1)
    if include_decode and meta.decode_seqs:
        idx, lens, tables = meta.decode_token_idx, meta.decode_seq_lens, meta.decode_block_tables
        Bd, nblk = tables.shape
        S = cache_NSC.shape[1]
        ctx_BLC = cache_NSC[tables].reshape(Bd, nblk * S, -1)
        if is_fp8_kv(ctx_BLC.dtype):
            ctx_BLC = dequantize_kv(ctx_BLC, torch.float32, kv_scale)
        mask_B1L = (torch.arange(nblk * S, device=q_THC.device)[None, :] < lens[:, None])[:, None, :]
        q = q_THC[idx][:, :, None, :]  # [Bd, H, 1, C]
        out_THR[idx] = _latent_attention(q, ctx_BLC, R, scale, mask_B1L)[:, :, 0, :]
