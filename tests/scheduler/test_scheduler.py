"""The scheduler policy against a fake model runner, with invariants checked every step."""
from __future__ import annotations

import logging
import random

import pytest

from scheduler import Request, RequestStatus
from tests.scheduler.factories import (assert_all_blocks_free, make_requests, make_scheduler,
                                       run_to_completion)


def reference_outputs(reqs):
    sched = make_scheduler(num_blocks=4096, max_num_seqs=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    for r in reqs:
        sched.add_request(Request(r.request_id, r.prompt_token_ids, r.max_tokens))
    return run_to_completion(sched)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("caching", [True, False])
def test_many_random_requests_tight_pool(seed, caching):
    rng = random.Random(seed)
    reqs = make_requests(200, rng, prefix=[5] * rng.choice([0, 8, 13]))
    expected = reference_outputs(reqs)
    sched = make_scheduler(num_blocks=24, max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=caching)
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched)
    assert outputs == expected  # preemption and chunking change nothing in what is generated
    assert sched.num_preemptions > 0
    assert_all_blocks_free(sched)


def test_random_aborts_leave_no_leak():
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=32, max_num_seqs=16, max_num_batched_tokens=24)
    for r in make_requests(300, rng, prefix=[9] * 8):
        sched.add_request(r)
    run_to_completion(sched, rng, abort_prob=0.3)
    assert_all_blocks_free(sched)


def test_chunked_prefill_splits_long_prompt_and_decodes_go_first():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    sched.add_request(Request("short", [1, 2], max_tokens=10))
    so = sched.schedule()
    sched.update_from_output(so, {"short": [3]})
    sched.add_request(Request("long", list(range(1, 21)), max_tokens=2))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens.items()) == [("short", 1), ("long", 7)]
    sched.update_from_output(so, {"short": [4]})
    so = sched.schedule()
    assert list(so.num_scheduled_tokens.items()) == [("short", 1), ("long", 7)]


def test_without_chunking_prefill_must_fit_whole():
    with pytest.raises(ValueError, match="max_num_batched_tokens.*smaller than max_model_len"):
        make_scheduler(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=False)
    sched = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    sched.add_request(Request("a", list(range(1, 21)), max_tokens=3))
    sched.add_request(Request("b", list(range(31, 51)), max_tokens=3))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 20}  # "b" does not fit the rest of the budget whole


def test_cache_smaller_than_max_model_len_is_an_error():
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(num_blocks=2, block_size=4, max_model_len=64)


def test_preemption_recompute_and_warning(caplog):
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16)
    sched.add_request(Request("a", [1] * 6, max_tokens=8))
    sched.add_request(Request("b", [2] * 6, max_tokens=8))
    with caplog.at_level(logging.WARNING, logger="moe.scheduler"):
        outputs = run_to_completion(sched)
    assert sched.num_preemptions >= 1
    assert "is preempted by PreemptionMode.RECOMPUTE" in caplog.text
    assert "gpu_memory_utilization" in caplog.text and "total_cumulative_preemption_cnt=" in caplog.text
    assert len(outputs["a"]) == len(outputs["b"]) == 8
    assert_all_blocks_free(sched)


def test_prefix_cache_hits_full_blocks_only():
    sched = make_scheduler(block_size=4)
    prefix = list(range(1, 11))  # 10 tokens: 2 full blocks
    sched.add_request(Request("a", prefix + [50], max_tokens=1))
    run_to_completion(sched)
    sched.add_request(Request("b", prefix + [60, 61], max_tokens=1))
    so = sched.schedule()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens["b"] == 4
    assert sched.kv.prefix_cache_hits == 8
    assert sched.requests["b"].num_cached_tokens == 8


def test_blocks_filled_by_decode_steps_are_cached():
    """A block that generated tokens fill (during decode steps, one token a step) is registered
    once full: a later prompt holding those tokens hits it."""
    sched = make_scheduler(block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    generated = run_to_completion_with(sched, Request("a", prompt, max_tokens=7))
    known = prompt + generated  # 13 tokens: the decode steps filled blocks 1 and 2
    sched.add_request(Request("b", known[:12] + [99], max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12 and so.num_scheduled_tokens["b"] == 1


def run_to_completion_with(sched, request: Request) -> list[int]:
    sched.add_request(request)
    return run_to_completion(sched)[request.request_id]


def test_fully_cached_prompt_still_computes_last_token():
    sched = make_scheduler(block_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    sched.add_request(Request("a", prompt, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(Request("b", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 and so.num_scheduled_tokens["b"] == 4


def test_evicted_blocks_are_not_hit():
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=64)
    sched.add_request(Request("a", list(range(1, 13)), max_tokens=1))
    run_to_completion(sched)
    # 59 tokens take 15 blocks: a's tail blocks go first (freed tail first), its head survives.
    sched.add_request(Request("big", list(range(100, 159)), max_tokens=1))
    run_to_completion(sched)
    sched.add_request(Request("c", list(range(1, 13)), max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    sched.add_request(Request("bigger", list(range(200, 263)), max_tokens=1))  # needs every block
    run_to_completion(sched)
    run_to_completion(sched)
    sched.add_request(Request("c", list(range(1, 13)), max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_abort_frees_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(Request("a", list(range(1, 30)), max_tokens=5))
    sched.add_request(Request("w", list(range(1, 30)), max_tokens=5))
    sched.schedule()
    used = sched.kv.num_blocks - sched.kv.pool.num_free_blocks
    assert used > 0
    sched.finish_requests(["a", "w"], RequestStatus.FINISHED_ABORTED)
    assert_all_blocks_free(sched)
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "w"} and so.is_empty


def test_stop_conditions():
    sched = make_scheduler()
    sched.add_request(Request("eos", [1, 2], max_tokens=10, eos_token_ids=(7,), min_tokens=2))
    sched.add_request(Request("tok", [1, 2], max_tokens=10, stop_token_ids=(8,)))
    sched.add_request(Request("ign", [1, 2], max_tokens=2, eos_token_ids=(7,), ignore_eos=True))
    so = sched.schedule()
    outs = {o.req_id: o for o in sched.update_from_output(so, {"eos": [7], "tok": [8], "ign": [7]})}
    assert outs["eos"].finish_reason is None  # min_tokens=2: the first EOS does not stop
    assert outs["tok"].finish_reason == "stop" and outs["tok"].stop_reason == 8
    so = sched.schedule()
    outs = {o.req_id: o for o in sched.update_from_output(so, {"eos": [7], "ign": [7]})}
    assert outs["eos"].finish_reason == "stop" and outs["ign"].finish_reason == "length"


def test_duplicate_request_id():
    sched = make_scheduler()
    sched.add_request(Request("a", [1], max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("a", [1], max_tokens=1))
