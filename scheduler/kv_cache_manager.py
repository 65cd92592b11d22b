"""Per-request KV block tables on top of the block pool, with prefix-cache lookup."""
from __future__ import annotations

from scheduler.block_pool import BlockPool, KVBlock, hash_block_tokens
from scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # Per request, how many of its leading blocks are already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens, since start.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[start:start + bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks; at least one token is always left to compute
        so that the step produces logits for the next token."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones; None if the pool
        cannot supply them (nothing is changed then)."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self._num_cached_blocks[req_id] = 0
        num_hit = len(new_computed_blocks) if new_computed_blocks else 0
        total_tokens = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(blocks) - num_hit
        if needed <= 0 and not num_hit:
            new_blocks = []  # the common decode step: the last block still has room
        else:
            # Hits that sit in the free queue stop being free once touched.
            evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if num_hit else 0
            if needed > self.pool.num_free_blocks - evictable_hits:
                if not blocks:
                    del self.req_to_blocks[req_id], self._num_cached_blocks[req_id]
                return None
            if num_hit:
                self.pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
            new_blocks = self.pool.get_new_blocks(max(needed, 0)) or []
            blocks.extend(new_blocks)
        if self.enable_caching:
            # Only tokens known now can be hashed: a decode step's KV slot is for a known token.
            num_full = min(total_tokens, request.num_tokens) // self.block_size
            if num_full > self._num_cached_blocks[req_id]:
                self._cache_full_blocks(request, blocks, num_full)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        self._update_block_hashes(request)
        for i in range(self._num_cached_blocks[request.request_id], num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
