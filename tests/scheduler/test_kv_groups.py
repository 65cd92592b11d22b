"""KV-cache groups: chunked-local layers hold only their current chunk's blocks, sliding-window
layers only the blocks their window still reaches."""
from __future__ import annotations

import random

import pytest

from scheduler import KVCacheGroup, Request, RequestStatus, Scheduler, SchedulerConfig, plan_groups
from scheduler.kv_cache_spec import SlidingWindow, group_keys
from tests.scheduler.factories import fake_tokens, make_requests


def make_grouped(num_blocks=64, chunk_blocks=None, block_size=4, chunk=8, max_num_seqs=8,
                 max_num_batched_tokens=32, max_model_len=64):
    groups = plan_groups([chunk, None, chunk, None], num_blocks, block_size, max_num_seqs, max_num_batched_tokens)
    if chunk_blocks is not None:
        groups = [groups[0], KVCacheGroup(chunk, chunk_blocks)]
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
                                     kv_cache_groups=groups))


def test_plan_groups():
    assert group_keys([8, None, 16, None, 8]) == [None, 8, 16]
    groups = plan_groups([8, None], num_blocks=1000, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    # per request: its chunk (2 blocks) + 1; plus one step's new tokens (4 blocks) + 1
    assert [(g.chunk_size, g.num_blocks) for g in groups] == [(None, 1000), (8, 2 * 3 + 4 + 1)]
    assert plan_groups([None], 50, 4, 8, 32) == [KVCacheGroup(None, 50)]


def test_plan_groups_with_sliding_windows():
    keys = [SlidingWindow(6), None, 8, SlidingWindow(3), SlidingWindow(6)]
    assert group_keys(keys) == [None, 8, SlidingWindow(3), SlidingWindow(6)]
    groups = plan_groups([SlidingWindow(6), None], num_blocks=1000, block_size=4, max_num_seqs=2,
                         max_num_batched_tokens=16)
    # per request: the window (2 blocks) + 1; plus one step's new tokens (4 blocks) + 1
    assert groups == [KVCacheGroup(None, 1000), KVCacheGroup(None, 2 * 3 + 4 + 1, sliding_window=6)]
    assert groups[1].key == SlidingWindow(6) and groups[1].is_local and not groups[0].is_local
    assert [groups[1].first_needed_position(p) for p in (0, 5, 6, 20)] == [0, 0, 1, 15]


def test_sliding_group_releases_blocks_behind_the_window():
    groups = plan_groups([SlidingWindow(6), None], 64, 4, 8, 32)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, block_size=4,
                                      num_blocks=64, kv_cache_groups=groups))
    sched.add_request(Request("a", list(range(1, 11)), max_tokens=30))
    window = sched.kv.local[0]
    while sched.has_unfinished_requests():
        first_new = sched.requests["a"].num_computed_tokens
        so = sched.schedule()
        blocks = window.req_to_blocks.get("a", [])
        # Released: every block wholly before position first_new - 5, the earliest this step reads.
        first_live = next(i for i, b in enumerate(blocks) if b is not None)
        assert first_live == max(0, first_new - 6 + 1) // 4
        assert sum(b is not None for b in blocks) <= 2 + 1 + 8  # the window, a partial block, a step's span
        sched.update_from_output(so, fake_tokens(so, sched))
    assert window.pool.num_free_blocks == window.pool.num_blocks


def test_chunked_group_releases_blocks_behind_the_chunk():
    sched = make_grouped(block_size=4, chunk=8)
    assert sched.kv.enable_caching and sched.kv.local[0].pool.enable_caching  # prefix caching spans the groups
    sched.add_request(Request("a", list(range(1, 11)), max_tokens=30))  # 10 prompt tokens
    chunked = sched.kv.local[0]
    held_max = 0
    while sched.has_unfinished_requests():
        first_new = sched.requests["a"].num_computed_tokens
        so = sched.schedule()
        blocks = chunked.req_to_blocks.get("a", [])
        live = [b for b in blocks if b is not None]
        held_max = max(held_max, len(live))
        # Every block wholly before the chunk of this step's first new token was released.
        first_live = next(i for i, b in enumerate(blocks) if b is not None)
        assert first_live == (first_new // 8) * 8 // 4
        ids = sched.kv.block_ids(sched.requests["a"])
        assert len(ids) == 2 and len(ids[1]) == len(blocks)
        assert all(i == 0 for i, b in zip(ids[1], blocks) if b is None)
        sched.update_from_output(so, fake_tokens(so, sched))
    assert held_max <= 3
    assert len(sched.kv.req_to_blocks) == 0 and not chunked.req_to_blocks
    assert chunked.pool.num_free_blocks == chunked.pool.num_blocks
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("chunk_blocks", [None, 7])
def test_tight_chunk_pool_preempts_without_changing_outputs(chunk_blocks):
    rng = random.Random(4)
    reqs = make_requests(40, rng, max_len=30, max_tokens=(5, 25))
    outputs = {}
    for tight in (False, True):
        sched = make_grouped(num_blocks=256 if not tight else 40,
                             chunk_blocks=chunk_blocks if tight else None, max_num_batched_tokens=16)
        for r in reqs:
            sched.add_request(Request(r.request_id, r.prompt_token_ids, r.max_tokens))
        got: dict[str, list[int]] = {}
        steps = 0
        while sched.has_unfinished_requests():
            so = sched.schedule()
            assert so.total_num_scheduled_tokens <= 16
            for co in sched.update_from_output(so, fake_tokens(so, sched)):
                got.setdefault(co.req_id, []).extend(co.new_token_ids)
            steps += 1
            assert steps < 10000
        for g in [sched.kv] + sched.kv.local:
            assert g.pool.num_free_blocks == g.pool.num_blocks  # nothing leaked
        outputs[tight] = (got, sched.num_preemptions)
    assert outputs[True][0] == outputs[False][0]
    assert outputs[True][1] > 0


def test_abort_frees_every_group():
    sched = make_grouped()
    sched.add_request(Request("a", list(range(1, 30)), max_tokens=5))
    sched.schedule()
    assert sched.kv.local[0].pool.num_free_blocks < sched.kv.local[0].pool.num_blocks
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    for g in [sched.kv] + sched.kv.local:
        assert g.pool.num_free_blocks == g.pool.num_blocks


def _run_to_end(sched):
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, fake_tokens(so, sched))


def _local_refs_match_holders(sched) -> None:
    """Every local block's reference count is the number of requests holding it (prefix hits share blocks)."""
    for g in sched.kv.local:
        holders: dict[int, int] = {}
        for blocks in g.req_to_blocks.values():
            for b in blocks:
                if b is not None:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert all(b.ref_cnt == holders.get(b.block_id, 0) for b in g.pool.blocks)


# (hit tokens, the local blocks the hit holds) with a's blocks all cached, then with its last local block evicted
@pytest.mark.parametrize("key,expected", [
    (SlidingWindow(6), {False: (24, [4, 5]),    # at 24 the window reads positions 19-23: blocks 4-5
                        True: (20, [3, 4])}),   # block 5 gone: at 20 it reads 15-19, blocks 3-4
    (8, {False: (24, []), True: (24, [])}),      # at 24 a chunk starts: nothing of the chunked group is read
])
def test_prefix_hit_needs_each_local_groups_window(key, expected):
    """A prefix hit holds only as far as every local group still caches the blocks its layers read
    right after it (vLLM's hybrid rule): the main group's hit is shortened where a local group lost one."""
    groups = plan_groups([key, None], 64, 4, 8, 32)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_blocks=64,
                          kv_cache_groups=groups)
    prompt = list(range(1, 25))  # 6 full blocks
    for evict in (False, True):
        sched = Scheduler(cfg)
        sched.add_request(Request("a", prompt, max_tokens=1))
        _run_to_end(sched)
        local = sched.kv.local[0]
        if evict:  # hand out every never-used block and one more (a's last local block, freed first), then
            # give them back: that block's hash is gone
            local.pool.free_blocks(local.pool.get_new_blocks(local.pool.num_blocks - 6 + 1))
        b = Request("b", prompt + [90, 91, 92], max_tokens=2)
        sched.add_request(b)
        so = sched.schedule()
        want, window = expected[evict]
        assert b.num_cached_tokens == want and so.num_scheduled_tokens["b"] == 27 - want
        held = [i for i, blk in enumerate(local.req_to_blocks["b"][:want // 4]) if blk is not None]
        assert held == window, "the hit's local blocks: the window before it, None behind it"
        _local_refs_match_holders(sched)
        sched.update_from_output(so, fake_tokens(so, sched))
        _run_to_end(sched)
        for g in [sched.kv] + sched.kv.local:
            assert g.pool.num_free_blocks == g.pool.num_blocks


def test_local_blocks_behind_the_window_stay_cached_for_later_hits():
    """A sliding group's blocks released behind the window keep their hashes in the free queue: a later
    request with the same prefix hits them while no one has taken them."""
    groups = plan_groups([SlidingWindow(6), None], 64, 4, 8, 32)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, block_size=4,
                                      num_blocks=64, kv_cache_groups=groups))
    prompt = list(range(1, 33))  # 8 blocks, computed 8 tokens a step: blocks behind the window released
    sched.add_request(Request("a", prompt, max_tokens=1))
    _run_to_end(sched)
    sched.add_request(Request("b", prompt[:28] + [99, 98], max_tokens=1))
    so = sched.schedule()
    assert sched.requests["b"].num_cached_tokens == 28 and so.num_scheduled_tokens["b"] == 2
    _local_refs_match_holders(sched)
