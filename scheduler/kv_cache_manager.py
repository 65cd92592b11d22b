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
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(needed, 0)) or []
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Only tokens known now can be hashed: a decode step's KV slot is for a known token.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        self._update_block_hashes(request)
        for i in range(num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
