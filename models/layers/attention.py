"""The attention layer: writes this step's K/V into the paged cache, then attends through
the block tables. The cache tensor is bound by the model runner after it is allocated.

On CUDA the Triton kernels run (kernels/triton_attention): one launch for the KV write and one
for the whole batch's attention: the split-KV decode kernel on decode-only steps (the only ones
captured in CUDA graphs), else the unified kernel, whose tiles of a few query tokens times a KV
head's query heads serve prefill chunks and decode rows of a mixed batch alike
(MOE_UNIFIED_ATTENTION=0: the varlen prefill kernel instead, its tile height set by the longest
query). Elsewhere the batched CPU path runs (kernels/cpu_attention.py, tested against the
pure-torch reference kernels.attention.paged_attention_torch).

An FP8 cache (kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2", allocated so by the model runner)
is quantised with the layer's per-tensor k_scale / v_scale: host floats, 1.0 unless the checkpoint
has them (models/loader.py), fixed after loading, so captured CUDA graphs keep them. Caches of the
model dtype ignore them.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

from kernels import batch_invariant
from kernels.attention import AttentionMetadata, is_fp8_kv, paged_attention_torch, write_kv_cache
from kernels.cpu_attention import paged_attention_cpu
from scheduler.kv_cache_spec import SlidingWindow

try:  # Triton is absent on some platforms; the torch reference then serves every device.
    from kernels.triton_attention.decode import paged_attention_decode_triton
    from kernels.triton_attention.kv_cache import write_kv_cache_triton
    from kernels.triton_attention.prefill import paged_attention_prefill_triton
    from kernels.triton_attention.unified import unified_attention_triton
    HAVE_TRITON_ATTENTION = True
except ImportError:
    HAVE_TRITON_ATTENTION = False


# MOE_ROPE_KV_WRITE=0 keeps the KV write a launch of its own (for A/B runs).
ROPE_WRITES_KV = os.environ.get("MOE_ROPE_KV_WRITE", "1") != "0"
# Batches that are not decode-only go through the unified kernel (faster than the varlen prefill
# kernel on an H200 in mixed steps, BENCHMARKS.md §2); MOE_UNIFIED_ATTENTION=0 keeps the prefill kernel.
UNIFIED_ATTENTION = os.environ.get("MOE_UNIFIED_ATTENTION", "1") != "0"


def use_triton_attention(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve tensors on x's device (CUDA with Triton importable)."""
    return HAVE_TRITON_ATTENTION and x.is_cuda


def mixed_graph_max_tokens(layers: list[nn.Module]) -> int:
    """The largest mixed step (tokens) whose forward through these attention layers may replay from a
    CUDA graph: each layer's `max_mixed_graph_tokens` (the unified kernel reads the whole layout from
    device tensors at any size; MLA up to the steps it runs wholly absorbed; the varlen prefill
    kernel takes host lengths: 0), the least of them; 0 without attention layers."""
    return min((getattr(layer, "max_mixed_graph_tokens", 0) for layer in layers), default=0)


class Attention(nn.Module):
    """chunk_size: None for global causal attention, else chunked-local attention (a query at
    position p sees keys floor(p / chunk_size) * chunk_size .. p). sliding_window W (gpt-oss): a
    query at p sees keys max(0, p - W + 1) .. p. sinks (gpt-oss): a learned logit per query head
    (fp32 [num_heads], this rank's heads; a parameter of this module) that joins each row's
    softmax with a zero value."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 chunk_size: int | None = None, sliding_window: int | None = None,
                 sinks: nn.Parameter | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.chunk_size = chunk_size
        if chunk_size is not None and sliding_window is not None:
            raise ValueError("an attention layer takes chunk_size or sliding_window, not both")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must be [{num_heads}] (one per query head), got {tuple(sinks.shape)}")
        self.sliding_window = sliding_window
        self.sinks = sinks
        # Only layers that have them pass the new arguments: the other calls stay as they were.
        self._extra = {"sliding_window": sliding_window} if sliding_window is not None else {}
        self.kv_cache: torch.Tensor | None = None  # [2, N, S, G, d], bound by the runner
        self.kv_group = 0  # which KV-cache group's block tables this layer reads (set by the runner)
        # An FP8 cache's per-tensor scales (stored = fp8(x / scale)); the loader sets checkpoint values.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def max_mixed_graph_tokens(self) -> int:
        """Mixed steps of any size replay graphs through the unified kernel; none through the
        varlen prefill kernel (host lengths)."""
        return sys.maxsize if UNIFIED_ATTENTION else 0

    @property
    def kv_cache_key(self):
        """This layer's KV-cache group key (scheduler/kv_cache_spec.py)."""
        return SlidingWindow(self.sliding_window) if self.sliding_window is not None else self.chunk_size

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_write_args(self, q: torch.Tensor, meta: AttentionMetadata) -> dict | None:
        """Where forward takes the Triton path: the KV cache and slot mapping a fused RoPE launch
        needs to write this layer's K/V itself (then forward(..., kv_written=True)); else None."""
        meta = meta.for_group(self.kv_group)
        if self.kv_cache is None or not ROPE_WRITES_KV or not self._triton_serves(q, meta):
            return None
        return {"kv_cache_2NSGd": self.kv_cache, "slot_mapping_T": meta.slot_mapping_T, **self._fp8_scales()}

    def _fp8_scales(self) -> dict:
        """The k_scale / v_scale keyword arguments of the KV write and attention calls for an FP8
        cache; none for other caches, whose calls stay as they were without FP8 support."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale} if is_fp8_kv(self.kv_cache.dtype) else {}

    def _attend_args(self) -> dict:
        """The attention calls' keyword arguments: FP8 scales, the sliding window and sinks where set."""
        return {**self._fp8_scales(), **self._extra, **({"sinks": self.sinks} if self.sinks is not None else {})}

    @staticmethod
    def _triton_serves(q: torch.Tensor, group_meta: AttentionMetadata) -> bool:
        """The Triton kernels run this step (CUDA, with the device metadata the runner builds)."""
        return use_triton_attention(q) and group_meta.seq_lens_t is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        """q [T, H*d], k/v [T, G*d] -> [T, H*d]. kv_written: the new K/V are already in the cache
        (written by the RoPE launch, see kv_write_args)."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.kv_cache is None:
            raise RuntimeError("attention ran before the model runner bound a KV cache")
        meta = meta.for_group(self.kv_group)
        if self._triton_serves(q, meta):
            out = self._forward_triton(q, k, v, meta, kv_written)
        else:
            if kv_written:
                raise ValueError("kv_written is only for the Triton path (kv_write_args)")
            write_kv_cache(k, v, self.kv_cache, meta.slot_mapping_T, **self._fp8_scales())
            if batch_invariant.enabled():
                attend = batch_invariant.paged_attention_invariant
            else:
                attend = paged_attention_torch if q.is_cuda else paged_attention_cpu
            out = attend(q, k, v, self.kv_cache, meta, self.scale, self.chunk_size, **self._attend_args())
        return out.reshape(T, self.num_heads * self.head_dim)

    def _forward_triton(self, q, k, v, meta: AttentionMetadata, kv_written: bool) -> torch.Tensor:
        if not kv_written:
            write_kv_cache_triton(k, v, self.kv_cache, meta.slot_mapping_T, **self._fp8_scales())
        args = self._attend_args()
        if batch_invariant.enabled():  # every row through one tiling: no split-KV decode launch
            return unified_attention_triton(q, self.kv_cache, meta.block_tables_BM, meta.query_start_loc_t,
                                            meta.seq_lens_t, self.scale, self.chunk_size, invariant=True, **args)
        if meta.decode_only:
            return paged_attention_decode_triton(q, self.kv_cache, meta.block_tables_BM, meta.seq_lens_t,
                                                 self.scale, self.chunk_size, **args)
        if UNIFIED_ATTENTION:
            return unified_attention_triton(q, self.kv_cache, meta.block_tables_BM, meta.query_start_loc_t,
                                            meta.seq_lens_t, self.scale, self.chunk_size, **args)
        return paged_attention_prefill_triton(q, self.kv_cache, meta.block_tables_BM, meta.query_start_loc_t,
                                              meta.seq_lens_t, meta.max_query_len, self.scale, self.chunk_size,
                                              **args)
