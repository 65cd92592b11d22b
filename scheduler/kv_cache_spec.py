"""KV-cache groups: layers that read their past the same way share block tables.

Full-attention layers (standard, and MLA whose page is the compressed latent) keep every
token's KV, so they form one group. Chunked-local attention layers (Llama-4's RoPE layers)
read only their own chunk: they form a group of their own whose blocks before the current
chunk are released as a request moves on, so its pool can be much smaller.

Group 0 is the full-attention group when there is one. The engine decides the block count of
each group once and hands the same list to the scheduler and to every model runner.
"""
from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    chunk_size: int | None   # None: full attention; else the chunked-local window
    num_blocks: int

    @property
    def is_chunked(self) -> bool:
        return self.chunk_size is not None


def group_keys(layer_chunk_sizes: list[int | None]) -> list[int | None]:
    """Distinct chunk sizes of the layers, full attention (None) first, then ascending."""
    keys = set(layer_chunk_sizes)
    return ([None] if None in keys else []) + sorted(k for k in keys if k is not None)


def plan_groups(layer_chunk_sizes: list[int | None], num_blocks: int, block_size: int,
                max_num_seqs: int, max_num_batched_tokens: int) -> list[KVCacheGroup]:
    """Block count per group. A chunked group never needs more than, per running request, its
    chunk plus one block, plus the blocks one step's new tokens can span."""
    groups = []
    for key in group_keys(layer_chunk_sizes or [None]):
        if key is None:
            groups.append(KVCacheGroup(None, num_blocks))
        else:
            cap = max_num_seqs * (cdiv(key, block_size) + 1) + cdiv(max_num_batched_tokens, block_size) + 1
            groups.append(KVCacheGroup(key, min(num_blocks, cap)))
    return groups
