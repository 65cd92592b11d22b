"""Batch-invariant mode (engine argument `batch_invariant`, `MOE_BATCH_INVARIANT=1` or vLLM's
`VLLM_BATCH_INVARIANT=1`): a request's tokens and logprobs are bit-identical whatever it is batched
with, however its prefill is chunked and wherever it sits in the batch.

What makes results depend on the batch, and what this mode does instead:
- GEMMs: a library GEMM picks its algorithm (tile shapes, split-K, GEMV for one row) from M, so a
  row's sum over K is ordered differently in a batch of 1 and of 300. Here every dense GEMM (the
  projections, the router, the LM head, the reference experts) runs on fixed row tiles: on the CPU
  the library GEMM on tiles of TILE_ROWS rows, each call the same shape; on CUDA a Triton GEMM of
  one fixed tile config without split-K (kernels/triton_fused/invariant_gemm.py).
- The Triton expert kernel: one fixed launch config (no split-K, no atomics) whatever the token
  count, and the top-k sum always one moe_sum launch in slot order (never deferred to the next
  RMSNorm for some batch sizes and not others).
- Attention: decode rows and prefill rows through one computation whose key tiles start at key 0
  and step a fixed width, every tile masked the same way, and no split-KV; on the CPU
  `paged_attention_invariant` below, on CUDA the unified Triton kernel with `invariant=True`.
- Pointwise exp / sigmoid / SiLU on the CPU: `pointwise` (a scalar remainder loop rounds apart).
- Norms, RoPE, the router's softmax / top-k and sampling already compute each row alone
  (tests/moe/test_batch_invariant.py checks the whole model).

The mode is process-wide (the worker sets it from its engine arguments); models whose layers have
no invariant path here (MLA attention, linear attention) refuse it by name.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata, dequantize_kv, key_start

# Rows of one CPU GEMM call in this mode: every call has this many rows (the last tile padded).
TILE_ROWS = 32
# Keys of one online-softmax step of the CPU attention (a multiple of nothing in particular:
# tiles start at key 0, so a query sees the same tiles whatever else the step holds).
KEY_TILE = 32
# Queries computed together (memory only: each query's arithmetic is its own).
QUERY_CHUNK = 256
# Elements of one pointwise call: a multiple of 64, below torch's intra-op parallel grain (32768).
POINTWISE_PIECE = 16384
_NEG_BIG = -1.0e30  # the running max before any key: exp(-inf - _NEG_BIG) = 0, never NaN


def requested_by_environment() -> bool:
    """MOE_BATCH_INVARIANT=1, else vLLM's VLLM_BATCH_INVARIANT=1."""
    return os.environ.get("MOE_BATCH_INVARIANT", os.environ.get("VLLM_BATCH_INVARIANT")) == "1"


_enabled = requested_by_environment()


def enabled() -> bool:
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn the mode on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every output row is computed the same way whatever the other rows are."""
    if x.is_cuda:
        from kernels.triton_fused import triton_available

        if not triton_available():
            raise RuntimeError("batch_invariant on CUDA needs Triton (its fixed-tile GEMM)")
        from kernels.triton_fused.invariant_gemm import invariant_linear_triton

        return invariant_linear_triton(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M = x2.shape[0]
    pad = -M % TILE_ROWS
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    out = torch.cat([F.linear(tile, weight, bias) for tile in x2.split(TILE_ROWS)])
    return out[:M].reshape(*shape[:-1], weight.shape[0])


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn (exp, sigmoid, SiLU): on the CPU torch computes the elements of a
    vector loop's remainder with a scalar formula that rounds differently, so which elements of a
    row take it depends on the tensor's length (the batch). Here every element goes through the
    vector loop: the flattened values in pieces of POINTWISE_PIECE (one thread each, no split) padded
    to a multiple of 64. On CUDA, or with the mode off, fn(x)."""
    if x.is_cuda or not _enabled:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    if n % 64:
        flat = torch.cat([flat, flat.new_zeros(64 - n % 64)])
    out = torch.cat([fn(piece) for piece in flat.split(POINTWISE_PIECE)]) if flat.numel() else flat
    return out[:n].view(x.shape)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or `linear` in this mode (for GEMMs that bypass models/layers/linear.py)."""
    return linear(x, weight, bias) if _enabled else F.linear(x, weight, bias)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], rows as in `linear`."""
    return linear(a, b.t())


def paged_attention_invariant(q_THd: torch.Tensor, k_TGd: torch.Tensor, v_TGd: torch.Tensor,
                              kv_cache_2NSGd: torch.Tensor, meta: AttentionMetadata,
                              scale: float, chunk_size: int | None = None, k_scale: float = 1.0,
                              v_scale: float = 1.0, *, sliding_window: int | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.attention.paged_attention_torch's contract (the new K/V, k_TGd / v_TGd, already in the
    cache, which is all that is read), each query computed alone: online softmax over key tiles of
    KEY_TILE keys from key 0 (a tile past a query's position, or before its chunk / window, is fully
    masked and changes nothing, bit for bit), each tile's scores and values a fixed-shape product
    per query. Returns [T, H, d]."""
    T, H, d = q_THd.shape
    _, _, S, G, _ = kv_cache_2NSGd.shape
    out = torch.empty_like(q_THd)
    qsl, lens = meta.query_start_loc, meta.seq_lens
    counts = [qsl[b + 1] - qsl[b] for b in range(len(lens))]
    dev = q_THd.device
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(counts, device=dev))
    # Query i of sequence b sits at position L_b - n_b + i.
    first = torch.tensor([L - n - q0 for L, n, q0 in zip(lens, counts, qsl)], device=dev)
    pos = first[seq_of] + torch.arange(seq_of.numel(), device=dev)
    lo = key_start(pos, chunk_size, sliding_window)
    lo = lo if torch.is_tensor(lo) else torch.zeros_like(pos)
    tables = meta.block_tables_BM.long()
    for t0 in range(0, seq_of.numel(), QUERY_CHUNK):  # bounds the [t, H, KEY_TILE, d] products
        rows = slice(t0, min(t0 + QUERY_CHUNK, seq_of.numel()))
        out[rows] = _attend_alone(q_THd[rows], kv_cache_2NSGd, tables[seq_of[rows]], pos[rows], lo[rows], S, G,
                                  scale, k_scale, v_scale, sinks).to(q_THd.dtype)
    return out


def _attend_alone(q_tHd, kv_cache_2NSGd, tables_tM, pos_t, lo_t, S, G, scale, k_scale, v_scale, sinks):
    """Queries at positions pos_t over keys lo_t .. pos_t, each one's arithmetic its own: products
    and sums over contiguous last dims (no batched GEMM, whose kernel could depend on the count)."""
    t, H, d = q_tHd.shape
    HG, dev = H // G, q_tHd.device
    q = q_tHd.float().view(t, G, HG, 1, d)
    m = torch.full((t, G, HG), _NEG_BIG, dtype=torch.float32, device=dev)
    denom = torch.zeros(t, G, HG, dtype=torch.float32, device=dev)
    acc = torch.zeros(t, G, HG, d, dtype=torch.float32, device=dev)
    offs = torch.arange(KEY_TILE, device=dev)
    for k0 in range(0, int(pos_t.max()) + 1, KEY_TILE):
        kpos = k0 + offs  # [n]
        blocks = tables_tM[:, (kpos // S).clamp(max=tables_tM.shape[1] - 1)]  # [t, n]
        kv = kv_cache_2NSGd[:, blocks, kpos % S]  # [2, t, n, G, d]
        k = dequantize_kv(kv[0], torch.float32, k_scale).transpose(1, 2)  # [t, G, n, d]
        v = dequantize_kv(kv[1], torch.float32, v_scale).permute(0, 2, 3, 1)  # [t, G, d, n]
        s = (q * k[:, :, None]).sum(-1) * scale  # [t, G, HG, n]
        allowed = (kpos[None, :] <= pos_t[:, None]) & (kpos[None, :] >= lo_t[:, None])  # [t, n]
        s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = pointwise(torch.exp, m - m_new)
        p = pointwise(torch.exp, s - m_new[..., None])
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[:, :, :, None, :] * v[:, :, None]).sum(-1)
        m = m_new
    if sinks is not None:  # one more column of value zero: it only adds to the denominator
        sink = sinks.float().view(G, HG).expand(t, G, HG)
        m_new = torch.maximum(m, sink)
        alpha = pointwise(torch.exp, m - m_new)
        acc, denom = acc * alpha[..., None], denom * alpha + pointwise(torch.exp, sink - m_new)
    return (acc / torch.where(denom == 0, 1.0, denom)[..., None]).view(t, H, d)
