"""Scheduler test factories: schedulers, requests, and a fake model runner."""
from __future__ import annotations

import random

from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                   enable_prefix_caching=True, enable_chunked_prefill=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
                                     enable_chunked_prefill=enable_chunked_prefill,
                                     enable_prefix_caching=enable_prefix_caching))


def make_requests(n, rng: random.Random, min_len=1, max_len=40, max_tokens=(1, 20), prefix=None, start=0):
    reqs = []
    for i in range(n):
        prompt = list(prefix or []) + [rng.randrange(1, 100) for _ in range(rng.randint(min_len, max_len))]
        reqs.append(Request(f"r{start + i}", prompt, max_tokens=rng.randint(*max_tokens)))
    return reqs


def fake_tokens(so: SchedulerOutput, sched: Scheduler) -> dict[str, list[int]]:
    """What a model runner would sample: a token for each request that reached its end.
    The token depends only on (request, position), like a deterministic model."""
    out = {}
    for req_id in so.num_scheduled_tokens:
        r = sched.requests[req_id]
        if r.num_computed_tokens == r.num_tokens:
            out[req_id] = [hash((req_id, r.num_tokens)) % 97 + 1]
    return out


def check_invariants(sched: Scheduler, so: SchedulerOutput, running_before: list[str]) -> None:
    cfg = sched.config
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    # Every block's reference count equals the number of requests holding it.
    holders: dict[int, int] = {}
    for req_id, blocks in sched.kv.req_to_blocks.items():
        assert len({b.block_id for b in blocks}) == len(blocks), f"{req_id} holds a block twice"
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    pool = sched.kv.pool
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in pool._free)
    # Each request holds enough blocks for its computed tokens.
    for r in sched.running:
        assert len(sched.kv.req_to_blocks[r.request_id]) * cfg.block_size >= r.num_computed_tokens
        assert r.status == RequestStatus.RUNNING
    # Decode-first: a request running before this step is scheduled now or was preempted,
    # whenever the budget covers one token per running request.
    if cfg.max_num_batched_tokens >= cfg.max_num_seqs:
        for req_id in running_before:
            if req_id in sched.requests:
                assert req_id in so.num_scheduled_tokens or req_id in so.preempted_req_ids


def run_to_completion(sched: Scheduler, rng: random.Random | None = None, abort_prob: float = 0.0,
                      max_steps: int = 100000) -> dict[str, list[int]]:
    """Drive the scheduler with the fake runner; returns the generated tokens per request."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        running_before = [r.request_id for r in sched.running]
        so = sched.schedule()
        check_invariants(sched, so, running_before)
        for co in sched.update_from_output(so, fake_tokens(so, sched)):
            outputs.setdefault(co.req_id, []).extend(co.new_token_ids)
        if rng is not None and abort_prob and rng.random() < abort_prob and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            outputs.pop(victim, None)
            outputs[victim + ":aborted"] = []
    else:
        raise AssertionError("scheduler did not finish")
    return outputs


def assert_all_blocks_free(sched: Scheduler) -> None:
    assert not sched.kv.req_to_blocks
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
