"""Per-request KV block tables on top of the block pool, with prefix-cache lookup.

The main group (full attention) keeps every block of a request. Local groups (chunked-local and
sliding-window layers, see kv_cache_spec.py) hold only the blocks their window still reaches; a
recurrent group one state slot per request.

Prefix caching spans the main and the local groups: every group registers its full blocks under the
request's chained block hashes, and a released local block keeps its hash in the free queue until it
is handed out again. A prefix of k blocks is a hit when the main group holds all k and each local group
holds the blocks its layers still read at position k * block_size (the window before it; nothing
at a chunk boundary): the longest such prefix wins (vLLM's hybrid KV-cache manager's rule). A
recurrent group turns prefix caching off (no slot holds the state at a prefix's end).
"""
from __future__ import annotations

from itertools import accumulate

from scheduler.block_pool import BlockPool, KVBlock, hash_block_tokens
from scheduler.kv_cache_spec import KVCacheGroup, cdiv
from scheduler.request import Request


class LocalBlocks:
    """Block tables of one local group (chunked-local or sliding-window). A request's list keeps
    None where a block behind its window was released, so list index = position // block_size still."""

    def __init__(self, group: KVCacheGroup, block_size: int, enable_caching: bool = False) -> None:
        self.group, self.block_size = group, block_size
        self.pool = BlockPool(group.num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks registered in the prefix cache

    def first_needed_block(self, first_new_position: int) -> int:
        """Blocks before this one lie wholly behind the window of the first new token (and so of
        every later one): no query reads them again."""
        return self.group.first_needed_position(first_new_position) // self.block_size

    def _releasable(self, blocks: list, first_new_position: int) -> int:
        return sum(1 for b in blocks[:self.first_needed_block(first_new_position)] if b is not None)

    def can_allocate(self, request: Request, num_computed: int, total_tokens: int,
                     hits: list[KVBlock | None] | None = None) -> bool:
        blocks = hits if hits is not None else self.req_to_blocks.get(request.request_id, [])
        needed = cdiv(total_tokens, self.block_size) - len(blocks)
        # a hit in the free queue stops being free once taken
        free = self.pool.num_free_blocks - (sum(1 for b in hits if b is not None and b.ref_cnt == 0) if hits else 0)
        return needed <= 0 or needed <= free + self._releasable(blocks, num_computed)

    def allocate(self, request: Request, num_computed: int, total_tokens: int,
                 hits: list[KVBlock | None] | None = None) -> list[KVBlock]:
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if hits:
            self.pool.touch(b for b in hits if b is not None)
            blocks.extend(hits)
        first_needed = self.first_needed_block(num_computed)
        released = [b for b in blocks[:first_needed] if b is not None]
        if released:
            self.pool.free_blocks(released)  # the earliest first: the last to serve a later prefix hit
            blocks[:first_needed] = [None] * first_needed
        new = self.pool.get_new_blocks(max(cdiv(total_tokens, self.block_size) - len(blocks), 0)) or []
        blocks.extend(new)
        return new

    def cache_full_blocks(self, request: Request, num_full: int) -> None:
        """Register the request's blocks below num_full (their tokens all known) under its block hashes."""
        blocks, hashes = self.req_to_blocks[request.request_id], request.block_hashes
        for i in range(self._num_cached_blocks.get(request.request_id, 0), num_full):
            if blocks[i] is not None:  # (a hit's blocks behind the window: registered by an earlier request)
                self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def block_ids(self, request: Request) -> list[int]:
        # A released block's slot reads as block 0: it lies outside every query's window.
        return [0 if b is None else b.block_id for b in self.req_to_blocks.get(request.request_id, [])]


class StateSlots:
    """The recurrent group: one slot (a block id of its own pool) per request, taken with its first
    tokens and kept, whatever its length, until it is freed."""

    def __init__(self, group: KVCacheGroup) -> None:
        self.pool = BlockPool(group.num_blocks, enable_caching=False)
        self.req_to_slot: dict[str, KVBlock] = {}

    def can_allocate(self, request: Request, num_computed: int, total_tokens: int, hits=None) -> bool:
        return request.request_id in self.req_to_slot or self.pool.num_free_blocks > 0

    def allocate(self, request: Request, num_computed: int, total_tokens: int, hits=None) -> list[KVBlock]:
        if request.request_id in self.req_to_slot:
            return []
        slot = self.req_to_slot[request.request_id] = self.pool.get_new_blocks(1)[0]
        return [slot]

    def free(self, request: Request) -> None:
        slot = self.req_to_slot.pop(request.request_id, None)
        if slot is not None:
            self.pool.free_blocks([slot])

    def block_ids(self, request: Request) -> list[int]:
        slot = self.req_to_slot.get(request.request_id)
        return [] if slot is None else [slot.block_id]


# allocate_slots' answer when no group needs a block (shared, never mutated).
NO_NEW_BLOCKS: tuple = ()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 groups: list[KVCacheGroup] | None = None) -> None:
        groups = groups or [KVCacheGroup(None, num_blocks)]
        if groups[0].is_local:
            raise ValueError("the first KV-cache group must be the full-attention one")
        self.groups = groups
        # A recurrent group keeps no state at a cached prefix's end: no prefix caching beside it.
        self.enable_caching = enable_caching and not any(g.recurrent for g in groups[1:])
        self.local = [StateSlots(g) if g.recurrent else LocalBlocks(g, block_size, self.enable_caching)
                      for g in groups[1:]]
        self.block_size = block_size
        self.pool = BlockPool(groups[0].num_blocks, self.enable_caching)
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
            extra = tuple(m.mm_hash for m in request.mm_items if m.overlaps(start, start + bs)) \
                if request.mm_items else ()
            hashes.append(hash_block_tokens(parent, tokens[start:start + bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock | None]], int]:
        """Longest cached prefix of full blocks that every group holds what it reads of (see the
        module docstring): its blocks, one list per group (local groups: None behind the window),
        and its length in tokens; ([], 0) for none. At least one token is always left to compute so
        that the step produces logits for the next token. Nothing for a request that skips reading
        the cache (Request.skip_reading_prefix_cache; not counted as a query either)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        self._update_block_hashes(request)
        bs, hashes = self.block_size, request.block_hashes
        main: list[KVBlock] = []
        for block_hash in hashes[:(request.num_tokens - 1) // bs]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            main.append(block)
        k, hits = len(main), []
        if k and self.local:  # shorten the prefix until each local group holds its window before it
            found = [[g.pool.get_cached_block(h) for h in hashes[:k]] for g in self.local]
            misses = [list(accumulate((b is None for b in f), initial=0)) for f in found]
            while k and any(m[k] > m[g.first_needed_block(k * bs)] for g, m in zip(self.local, misses)):
                k -= 1
            hits = [[None] * g.first_needed_block(k * bs) + f[g.first_needed_block(k * bs):k]
                    for g, f in zip(self.local, found)]
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += k * bs
        return ([main[:k]] + hits if k else []), k * bs

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hits: list[list[KVBlock | None]] | None = None) -> list[list[KVBlock]] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones and the prefix hit `hits`
        (get_computed_blocks'), one list per group (group 0 first), or NO_NEW_BLOCKS when none is
        needed; None if a pool cannot supply them (nothing is changed then)."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self._num_cached_blocks[req_id] = 0
        main_hits = hits[0] if hits else ()
        num_hit = len(main_hits)
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        total_tokens = num_computed + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(blocks) - num_hit
        # The common decode step: the last block still has room, no hit, no local group (Scheduler.schedule
        # takes this case inline for running requests when the step fills no block: keep the two in step).
        fast = needed <= 0 and not num_hit and not self.local
        if not fast:
            local_hits = (hits[1:] if hits else [None] * len(self.local)) if self.local else ()
            # Hits that sit in the free queue stop being free once touched.
            evictable_hits = sum(1 for b in main_hits if b.ref_cnt == 0) if num_hit else 0
            if needed > self.pool.num_free_blocks - evictable_hits or (local_hits and not all(
                    g.can_allocate(request, num_computed, total_tokens, h) for g, h in zip(self.local, local_hits))):
                if not blocks:
                    del self.req_to_blocks[req_id], self._num_cached_blocks[req_id]
                return None
            if num_hit:
                self.pool.touch(main_hits)
                blocks.extend(main_hits)
            new_blocks = self.pool.get_new_blocks(max(needed, 0)) or []
            blocks.extend(new_blocks)
            new_local = [g.allocate(request, num_computed, total_tokens, h) for g, h in zip(self.local, local_hits)] \
                if local_hits else []
        # Register blocks that this step fills in the prefix cache (their tokens are all known:
        # total_tokens never exceeds the request's tokens). In the fast path only a step ending
        # exactly on a block boundary fills one.
        if self.enable_caching and (not fast or total_tokens % self.block_size == 0):
            # Only blocks whose tokens are all known (async scheduling computes a placeholder's KV
            # before its token arrives; such a block is registered by a later allocation).
            num_full = min(total_tokens, len(request.all_token_ids)) // self.block_size
            if num_full > self._num_cached_blocks[req_id]:
                self._cache_full_blocks(request, blocks, num_full)
                for g in self.local:
                    g.cache_full_blocks(request, num_full)
        if fast:
            return NO_NEW_BLOCKS
        return [new_blocks] + new_local if new_local else [new_blocks]

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
        for group in self.local:
            group.free(request)

    def block_ids(self, request: Request) -> list[list[int]]:
        """The request's block ids, one list per group."""
        main = [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]
        return [main] + [g.block_ids(request) for g in self.local]

    def reset_prefix_cache(self) -> None:
        for pool in [self.pool] + [g.pool for g in self.local if isinstance(g, LocalBlocks)]:
            pool.reset_prefix_cache()
