"""Bad input is refused with an error naming the problem, before anything is queued, and the same
LLM then serves a normal request with unchanged output and every KV block back in the pool."""
from __future__ import annotations

import logging
import math

import pytest

from moe import LLM, SamplingParams

REFERENCE_PROMPT = {"prompt_token_ids": [5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]}


def greedy(n=6, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    return LLM(qwen3_ckpt, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(REFERENCE_PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids


def assert_still_serving(llm, reference):
    """Nothing queued or held, no block in use, and the reference request gives the same tokens."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    assert kv.usage() == 0.0 and kv.pool.num_free_blocks == kv.num_blocks
    assert llm.generate(REFERENCE_PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids == reference
    assert kv.usage() == 0.0


# ---- SamplingParams alone ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter {name}=.*finite"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("kwargs,name,why", [
    ({"temperature": "0.5"}, "temperature", "must be a number, got str"),
    ({"temperature": None}, "temperature", "must be a number, got NoneType"),
    ({"top_k": 2.5}, "top_k", "must be an integer"),
    ({"n": True}, "n", "must be an integer"),
    ({"max_tokens": True}, "max_tokens", "must be an integer or None"),
    ({"max_tokens": 2.0}, "max_tokens", "must be an integer or None"),
    ({"seed": "7"}, "seed", "must be an integer or None"),
    ({"seed": -2}, "seed", "non-negative"),
    ({"stop": [None]}, "stop", "a string or a list of strings"),
    ({"stop": [b"x"]}, "stop", "a string or a list of strings"),
    ({"stop": 5}, "stop", "a string or a list of strings"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": 3}, "stop_token_ids", "non-negative integers"),
    ({"ignore_eos": "yes"}, "ignore_eos", "True or False"),
    ({"n": 3, "temperature": 0.0}, "n", "must be 1 with greedy sampling"),
])
def test_wrong_types_and_combinations_name_the_parameter(kwargs, name, why):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter {name}=.*{why}"):
        SamplingParams(**kwargs)


def test_seed_minus_one_means_unseeded_and_numpy_like_ints_pass():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(n=2, temperature=0.7).n == 2
    assert SamplingParams(stop=("a", "b")).stop_list == ["a", "b"]


# ---- through the engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("call,error,match", [
    (lambda llm: llm.generate(REFERENCE_PROMPT, greedy(logprobs=100000), use_tqdm=False),
     ValueError, "logprobs=100000: at most max_logprobs=20"),
    (lambda llm: llm.generate(REFERENCE_PROMPT, greedy(logprobs=21), use_tqdm=False),
     ValueError, "logprobs=21: at most max_logprobs=20"),
    (lambda llm: llm.generate(REFERENCE_PROMPT, greedy(stop_token_ids=[512]), use_tqdm=False),
     ValueError, "stop_token_ids: token id 512 is out of vocabulary"),
    (lambda llm: llm.generate(None, greedy(), use_tqdm=False), ValueError, "prompts is None"),
    (lambda llm: llm.generate([REFERENCE_PROMPT, None], greedy(), use_tqdm=False), ValueError, "got NoneType"),
    (lambda llm: llm.generate("abc \ud800 def", greedy(), use_tqdm=False), ValueError, "not valid Unicode"),
    (lambda llm: llm.generate({"prompt_token_ids": [True, 2]}, greedy(), use_tqdm=False),
     ValueError, "prompt_token_ids must be a list of integers"),
    (lambda llm: llm.generate({"prompt_token_ids": [1.0, 2]}, greedy(), use_tqdm=False),
     ValueError, "prompt_token_ids must be a list of integers"),
    (lambda llm: llm.generate(REFERENCE_PROMPT, {"max_tokens": 2}, use_tqdm=False), TypeError, "got a dict"),
    (lambda llm: llm.generate([REFERENCE_PROMPT, REFERENCE_PROMPT], [greedy(), greedy(logprobs=99)],
                              use_tqdm=False), ValueError, "logprobs=99"),
])
def test_bad_input_is_refused_and_engine_keeps_serving(llm, reference, call, error, match):
    with pytest.raises(error, match=match):
        call(llm)
    assert_still_serving(llm, reference)


def test_numpy_and_tuple_token_ids_are_taken_as_ints(llm, reference):
    """Token ids as numpy integers or a tuple (not plain ints in a list: the slower check) give the
    plain-int list's tokens; the prompt handed back is plain ints."""
    import numpy as np

    plain = llm.generate({"prompt_token_ids": [5, 17, 42, 9]}, greedy(), use_tqdm=False)[0]
    for ids in ([np.int64(5), np.int32(17), 42, np.int16(9)], (5, 17, 42, 9)):
        out = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert out.prompt_token_ids == [5, 17, 42, 9] and all(type(t) is int for t in out.prompt_token_ids)


def test_logprobs_limits(llm, reference):
    out = llm.generate(REFERENCE_PROMPT, greedy(n=2, logprobs=20), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[:2] and all(len(lp) >= 20 for lp in out.logprobs)
    engine = llm.llm_engine
    engine.max_logprobs = 10**6  # as with max_logprobs=-1: the vocabulary is the limit
    try:
        with pytest.raises(ValueError, match="logprobs=513: at most vocab_size=512"):
            llm.generate(REFERENCE_PROMPT, greedy(logprobs=513), use_tqdm=False)
    finally:
        engine.max_logprobs = 20
    assert_still_serving(llm, reference)


def test_aborting_a_child_id_aborts_the_whole_request(llm, reference):
    engine = llm.llm_engine
    engine.add_request("parent", REFERENCE_PROMPT, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20))
    engine.step()
    assert engine.scheduler.kv.usage() > 0
    engine.abort_request("1_parent")
    assert not engine.has_unfinished_requests() and "parent" not in engine._parents
    assert_still_serving(llm, reference)


def test_max_tokens_beyond_max_model_len_is_capped_with_a_warning(llm, reference, caplog):
    llm.llm_engine._warned_max_tokens_cap = False
    prompt = {"prompt_token_ids": list(range(1, 61))}  # 60 tokens: max_model_len=64 leaves 4
    with caplog.at_level(logging.WARNING, logger="moe.engine.llm_engine"):
        out = llm.generate(prompt, greedy(n=100), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert any("max_tokens=100 is capped to 4" in r.getMessage() for r in caplog.records)
    assert_still_serving(llm, reference)


def test_engine_arguments_checked(qwen3_ckpt, caplog):
    from moe.config import EngineArgs

    with pytest.raises(ValueError, match=r"moe_backend must be one of \(None, 'torch', 'triton', 'deepspeed'\)"):
        LLM(qwen3_ckpt, device="cpu", moe_backend="cutlass")
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, or -1"):
        EngineArgs(model="m", max_logprobs=-5).validate()
    with caplog.at_level(logging.WARNING, logger="moe.config"):
        EngineArgs(model="m", trust_remote_code=True).validate()
    assert any("no remote code runs" in r.getMessage() for r in caplog.records)
