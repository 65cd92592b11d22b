"""The model runner's per-step sampling inputs: a step whose rows are all plain greedy (no
logprobs, penalties, min_tokens, biases or bad words) takes a one-pass fast path, which must give
what the full per-row path gives; any other row sends the step through the full path."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe import LLM, SamplingParams
from moe.worker.step_inputs import RequestState


@pytest.fixture(scope="module")
def runner():
    llm = LLM("tiny-qwen3-moe", dtype="float32", device="cpu")
    yield llm.llm_engine.executor.runner
    llm.shutdown()


def _states(params: list[SamplingParams]) -> list[RequestState]:
    return [RequestState([1, 2, 3, 4], 3, p, row=i, num_computed_tokens=3) for i, p in enumerate(params)]


def _as_dict(batch) -> dict:
    return {f.name: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(batch) for v in [getattr(batch, f.name)]}


def test_plain_greedy_fast_path_equals_the_full_path(runner):
    states = _states([SamplingParams(temperature=0.0, max_tokens=8, top_k=5, top_p=0.5),
                      SamplingParams(temperature=0.0)])
    assert all(s.plain_greedy for s in states)
    fast = runner._sampling_batch(states, [4, 4])
    for s in states:
        s.plain_greedy = False
    full = runner._sampling_batch(states, [4, 4])
    assert fast.all_greedy and _as_dict(fast) == _as_dict(full)


@pytest.mark.parametrize("special", [dict(temperature=0.7), dict(temperature=0.0, logprobs=2),
                                     dict(temperature=0.0, repetition_penalty=1.2),
                                     dict(temperature=0.0, frequency_penalty=0.5),
                                     dict(temperature=0.0, presence_penalty=0.5),
                                     dict(temperature=0.0, min_tokens=4),
                                     dict(temperature=0.0, logit_bias={7: 5.0}),
                                     dict(temperature=0.0, allowed_token_ids=[7, 8])])
def test_one_row_with_its_own_settings_takes_the_full_path(runner, special):
    states = _states([SamplingParams(temperature=0.0), SamplingParams(**special)])
    assert states[0].plain_greedy and not states[1].plain_greedy
    batch = runner._sampling_batch(states, [4, 4])
    applied = {"temperature": batch.temperature_B is not None, "logprobs": batch.max_num_logprobs == 2,
               "repetition_penalty": batch.repetition_penalty_B is not None,
               "frequency_penalty": batch.frequency_penalty_B is not None,
               "presence_penalty": batch.presence_penalty_B is not None, "min_tokens": batch.banned_tokens is not None,
               "logit_bias": batch.token_bias is not None, "allowed_token_ids": batch.token_bias is not None}
    assert applied[next(k for k in special if k != "temperature" or len(special) == 1)]
