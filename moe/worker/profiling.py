"""A dummy forward at the step token budget, for sizing the KV cache from measured memory."""
from __future__ import annotations

import torch

from moe.sampling_params import SamplingParams
from scheduler import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.kv_cache_spec import group_for_key, group_keys


def profile_forward(runner, num_tokens: int, max_model_len: int) -> None:
    """Fill one step with `num_tokens` prompt tokens (sequences of at most max_model_len),
    run it through a temporary KV cache just large enough, then drop that cache."""
    bs = runner.block_size
    lengths = []
    left = num_tokens
    while left > 0:
        lengths.append(min(left, max_model_len))
        left -= lengths[-1]
    blocks_needed = sum(-(-n // bs) for n in lengths)
    # Every KV-cache group gets the same temporary blocks.
    keys = group_keys(runner.kv_cache_keys())
    runner.allocate_kv_cache([group_for_key(k, blocks_needed) for k in keys])
    new_reqs, scheduled, next_block = [], {}, 0
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for i, n in enumerate(lengths):
        nb = -(-n // bs)
        new_reqs.append(NewRequestData(f"profile-{i}", [0] * n, n, params,
                                       [list(range(next_block, next_block + nb))] * len(keys), 0))
        scheduled[f"profile-{i}"] = n
        next_block += nb
    so = SchedulerOutput(new_reqs, CachedRequestData(), scheduled, num_tokens)
    runner.dispatch_step.max_tokens = num_tokens  # every rank profiles the same step
    runner.execute_model(so)
    finish = SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids=set(scheduled))
    runner.execute_model(finish)
    runner.allocate_kv_cache([group_for_key(k, 0) for k in keys])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
