"""The recurrent KV-cache group: one state slot per running request, whatever its length, given back
when it finishes, is aborted or preempted; prefix caching off beside it."""
from __future__ import annotations

import random

from scheduler import KVCacheGroup, Request, RequestStatus, Scheduler, SchedulerConfig, plan_groups
from scheduler.kv_cache_spec import RECURRENT_STATE, group_keys
from tests.scheduler.factories import fake_tokens, make_requests


def make_hybrid(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64):
    groups = plan_groups([RECURRENT_STATE, RECURRENT_STATE, None, RECURRENT_STATE], num_blocks, block_size,
                         max_num_seqs, max_num_batched_tokens)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
                                     kv_cache_groups=groups))


def test_plan_groups_gives_a_slot_per_running_request():
    assert group_keys([RECURRENT_STATE, 8, None]) == [None, 8, RECURRENT_STATE]
    groups = plan_groups([RECURRENT_STATE, None], num_blocks=1000, block_size=4, max_num_seqs=6,
                         max_num_batched_tokens=64)
    assert groups == [KVCacheGroup(None, 1000), KVCacheGroup(None, 6, recurrent=True)]
    assert groups[1].key == RECURRENT_STATE and groups[1].is_local


def test_a_request_holds_one_slot_for_its_whole_life():
    sched = make_hybrid()
    assert not sched.kv.enable_caching  # a cached prefix would skip tokens whose state no slot holds
    sched.add_request(Request("a", list(range(1, 40)), max_tokens=30))  # 39 prompt tokens: chunks of 16
    slots = sched.kv.local[0]
    seen = set()
    while sched.has_unfinished_requests():
        so = sched.schedule()
        ids = sched.kv.block_ids(sched.requests["a"])
        assert len(ids) == 2 and len(ids[1]) == 1  # full attention's blocks, then the one slot
        seen.add(ids[1][0])
        assert slots.pool.num_free_blocks == slots.pool.num_blocks - 1
        sched.update_from_output(so, fake_tokens(so, sched))
    assert len(seen) == 1
    assert slots.pool.num_free_blocks == slots.pool.num_blocks and not slots.req_to_slot


def test_slots_of_running_requests_are_distinct_and_never_leak_under_preemption():
    rng = random.Random(3)
    reqs = make_requests(30, rng, max_len=30, max_tokens=(5, 25))
    outputs = {}
    for tight in (False, True):
        sched = make_hybrid(num_blocks=256 if not tight else 30)
        for r in reqs:
            sched.add_request(Request(r.request_id, r.prompt_token_ids, r.max_tokens))
        got: dict[str, list[int]] = {}
        steps = 0
        while sched.has_unfinished_requests():
            so = sched.schedule()
            held = [sched.kv.block_ids(sched.requests[r])[1] for r in so.num_scheduled_tokens]
            assert all(len(h) == 1 for h in held) and len({h[0] for h in held}) == len(held)
            for co in sched.update_from_output(so, fake_tokens(so, sched)):
                got.setdefault(co.req_id, []).extend(co.new_token_ids)
            steps += 1
            assert steps < 10000
        for g in [sched.kv] + sched.kv.local:
            assert g.pool.num_free_blocks == g.pool.num_blocks  # nothing leaked
        outputs[tight] = (got, sched.num_preemptions)
    assert outputs[True][0] == outputs[False][0]
    assert outputs[True][1] > 0  # the tight cache preempted (and so freed and retook slots)


def test_abort_frees_the_slot():
    sched = make_hybrid(max_num_batched_tokens=64)
    sched.add_request(Request("a", list(range(1, 30)), max_tokens=5))
    sched.add_request(Request("b", list(range(1, 5)), max_tokens=5))
    sched.schedule()
    slots = sched.kv.local[0]
    assert slots.pool.num_free_blocks == slots.pool.num_blocks - 2
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert slots.pool.num_free_blocks == slots.pool.num_blocks - 1 and set(slots.req_to_slot) == {"b"}
