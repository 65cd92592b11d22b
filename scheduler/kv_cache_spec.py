"""KV-cache groups: layers that read their past the same way share block tables.

Full-attention layers (standard, and MLA whose page is the compressed latent) keep every
token's KV, so they form one group. Local layers read only a window of their past: chunked-local
attention layers (Llama-4's RoPE layers) their own chunk, sliding-window layers (gpt-oss) their last
W positions. Each local kind and size forms a group of its own whose blocks behind the window are
released as a request moves on, so its pool can be much smaller (prefix caching still spans the
groups: kv_cache_manager.py).

Recurrent layers (Gated DeltaNet's linear attention) keep no per-token past at all but a fixed-size
state per request (a conv state and an SSM state per layer): their group's "blocks" are state slots,
one per running request whatever its length, so the group has max_num_seqs of them and a request
takes its slot with its first tokens and gives it back when it finishes, is aborted or preempted
(recompute preemption starts the state again from position 0). A request whose step starts at
position 0 reads a zero state, so a slot never needs clearing. Prefix caching is off with such a
group: a cached prefix would skip tokens whose state no slot holds.

A layer's group key: None (full attention), an int (a chunked-local layer's chunk size), a
SlidingWindow or RECURRENT_STATE. Group 0 is the full-attention group when there is one; a local layer
whose group is not planned reads through group 0 (keeping every block is always correct). The engine
decides the block count of each group once and hands the same list to the scheduler and to every
model runner.
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
class RecurrentState:
    """The group key of recurrent layers: one state slot per running request."""


RECURRENT_STATE = RecurrentState()


@dataclass(frozen=True)
class KVCacheGroup:
    chunk_size: int | None   # None: full attention (or sliding / recurrent, below); else the chunked-local window
    num_blocks: int          # blocks, or for a recurrent group state slots
    sliding_window: int | None = None
    recurrent: bool = False

    @property
    def is_local(self) -> bool:
        """Whether the group holds less than every block of a request's past (any group but the full one)."""
        return self.chunk_size is not None or self.sliding_window is not None or self.recurrent

    @property
    def key(self) -> int | SlidingWindow | RecurrentState | None:
        if self.recurrent:
            return RECURRENT_STATE
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
    then sliding windows ascending, then the recurrent state."""
    keys = set(layer_keys)
    chunks = sorted(k for k in keys if isinstance(k, int))
    windows = sorted((k for k in keys if isinstance(k, SlidingWindow)), key=lambda w: w.size)
    return ([None] if None in keys else []) + chunks + windows + ([RECURRENT_STATE] if RECURRENT_STATE in keys else [])


def group_for_key(key, num_blocks: int) -> KVCacheGroup:
    if isinstance(key, SlidingWindow):
        return KVCacheGroup(None, num_blocks, sliding_window=key.size)
    if isinstance(key, RecurrentState):
        return KVCacheGroup(None, num_blocks, recurrent=True)
    return KVCacheGroup(key, num_blocks)


def plan_groups(layer_keys: list, num_blocks: int, block_size: int,
                max_num_seqs: int, max_num_batched_tokens: int) -> list[KVCacheGroup]:
    """Block count per group. A local group never needs more than, per running request, its
    window plus one block, plus the blocks one step's new tokens can span; a recurrent group
    one slot per running request."""
    groups = []
    for key in group_keys(layer_keys or [None]):
        if key is None:
            groups.append(KVCacheGroup(None, num_blocks))
        elif isinstance(key, RecurrentState):
            groups.append(group_for_key(key, max_num_seqs))
        else:
            window = key.size if isinstance(key, SlidingWindow) else key
            cap = max_num_seqs * (cdiv(window, block_size) + 1) + cdiv(max_num_batched_tokens, block_size) + 1
            groups.append(group_for_key(key, min(num_blocks, cap)))
    return groups
