"""Request.skip_reading_prefix_cache (set for prompt_logprobs requests): the whole prompt is
scheduled from position 0 even where the cache holds it, and its blocks still fill the cache."""
from __future__ import annotations

from scheduler import Request
from tests.scheduler.factories import make_scheduler, run_to_completion


def test_a_skipping_request_computes_its_whole_prompt_and_fills_the_cache():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    prompt = list(range(1, 19))  # 4 full blocks and 2 tokens
    sched.add_request(Request("warm", prompt, max_tokens=1))
    run_to_completion(sched)
    hits = sched.kv.prefix_cache_hits
    sched.add_request(Request("skip", prompt, max_tokens=1, skip_reading_prefix_cache=True))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens["skip"] == 8
    assert sched.requests["skip"].num_cached_tokens == 0 and sched.kv.prefix_cache_hits == hits
    sched.update_from_output(so, {})
    run_to_completion(sched)
    sched.add_request(Request("read", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16, "the cache still serves others"
