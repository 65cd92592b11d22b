"""KV-cache groups: layers that read their past the same way share block tables.

Full-attention layers (standard, and MLA whose page is the compressed latent) keep every
token's KV, so they form one group. Local layers read only a window of their past: chunked-local
attention layers (Llama-4's RoPE layers) their own chunk, sliding-window layers (gpt-oss) their last
W positions. Each local kind and size forms a group of its own whose blocks behind the window are
released as a request moves on, so its pool can be much smaller.

A layer's group key: None (full attention), an int (a chunked-local layer's chunk size) or a
SlidingWindow. Group 0 is the full-attention group when there is one; a local layer whose group is
not planned reads through group 0 (keeping every block is always correct). The engine decides the
block count of each group once and hands the same list to the scheduler and to every model runner.
"""
from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SlidingWindow:
    """The group key of sliding-window layers: a query at p reads positions max(0, p - size + 1) .. p."""
    size: int


@dataclass(frozen=True)
class KVCacheGroup:
    chunk_size: int | None   # None: full attention (or sliding, below); else the chunked-local window
    num_blocks: int
    sliding_window: int | None = None

    @property
    def is_local(self) -> bool:
        return self.chunk_size is not None or self.sliding_window is not None

    @property
    def key(self) -> int | SlidingWindow | None:
        return SlidingWindow(self.sliding_window) if self.sliding_window is not None else self.chunk_size

    def first_needed_position(self, position: int) -> int:
        """The first position a query at `position` or later reads in this group's layers."""
        if self.chunk_size is not None:
            return (position // self.chunk_size) * self.chunk_size
        if self.sliding_window is not None:
            return max(0, position - self.sliding_window + 1)
        return 0


def group_keys(layer_keys: list) -> list:
    """Distinct group keys of the layers: full attention (None) first, then chunk sizes ascending,
    then sliding windows ascending."""
    keys = set(layer_keys)
    chunks = sorted(k for k in keys if isinstance(k, int))
    windows = sorted((k for k in keys if isinstance(k, SlidingWindow)), key=lambda w: w.size)
    return ([None] if None in keys else []) + chunks + windows


def group_for_key(key, num_blocks: int) -> KVCacheGroup:
    if isinstance(key, SlidingWindow):
        return KVCacheGroup(None, num_blocks, sliding_window=key.size)
    return KVCacheGroup(key, num_blocks)


def plan_groups(layer_keys: list, num_blocks: int, block_size: int,
                max_num_seqs: int, max_num_batched_tokens: int) -> list[KVCacheGroup]:
    """Block count per group. A local group never needs more than, per running request, its
    window plus one block, plus the blocks one step's new tokens can span."""
    groups = []
    for key in group_keys(layer_keys or [None]):
        if key is None:
            groups.append(KVCacheGroup(None, num_blocks))
        else:
            window = key.size if isinstance(key, SlidingWindow) else key
            cap = max_num_seqs * (cdiv(window, block_size) + 1) + cdiv(max_num_batched_tokens, block_size) + 1
            groups.append(group_for_key(key, min(num_blocks, cap)))
    return groups
