"""The pool of fixed-size KV blocks: a free queue in LRU order, reference counts, prefix hashes.

A freed block keeps its hash and stays findable by it until the free queue hands it out again,
so a later request with the same prefix can take it back without recomputing (prefix caching).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Chained block hash: equal only when the whole prefix up to this block is equal. extra_keys:
    what else the block's KV depends on (the hashes of the images whose tokens it holds: image
    tokens are the same ids for every image)."""
    if extra_keys:
        return hash((parent_hash, tuple(token_ids), extra_keys))
    return hash((parent_hash, tuple(token_ids)))


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Front = next to hand out (least recently freed); OrderedDict gives O(1) removal by id.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock] | None:
        """Take `n` blocks off the free queue (evicting their cached hashes); None if too few."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free queue.

        Callers pass a request's blocks tail first, so a prefix's last blocks are evicted first.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than taken")
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Record that `block` holds the full block with this chained hash."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        # If another block already holds the same content, keep the first: both stay correct.
        self._cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                block.block_hash = None
        self._cached = {h: b for h, b in self._cached.items() if b.block_hash == h}
