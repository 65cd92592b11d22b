"""The block pool's free queue: blocks never handed out go first, in id order, then freed blocks in
the order they were freed (least recently freed first, so cached prefixes live longest)."""
from __future__ import annotations

import pytest

from scheduler.block_pool import BlockPool


def test_fresh_blocks_go_first_then_freed_ones_in_lru_order():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 3 and pool.usage() == pytest.approx(0.5)
    pool.cache_block(a[1], block_hash=11)
    pool.free_blocks([a[2], a[1]])  # tail first, as requests free
    assert pool.num_free_blocks == 5
    # the 3 never-used blocks before any freed one, then block 2 (freed first)
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 5, 2]
    assert pool.get_cached_block(11) is a[1]  # still cached: not handed out yet
    assert pool.get_new_blocks(2) is None  # one free block left
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert pool.get_cached_block(11) is None and a[1].block_hash is None  # evicted when handed out
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    assert sorted(b.block_id for b in pool.blocks) == list(range(6))


def test_a_cached_free_block_is_taken_back_by_touch():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, block_hash=7)
    pool.free_blocks([b])
    assert pool.num_free_blocks == 4
    pool.touch([pool.get_cached_block(7)])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 3
    assert [x.block_id for x in pool.get_new_blocks(3)] == [1, 2, 3]
