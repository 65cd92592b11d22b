"""A step that fails leaves the engine consistent: the request it can be blamed on finishes with
`finish_reason="error"`, the others finish with the output they would have had, and no KV
block leaks (moe/engine/step_recovery.py)."""
from __future__ import annotations

import pytest

from moe import LLM, SamplingParams
from moe.errors import RequestFailed, StepFailure

GOOD = {"prompt_token_ids": [(7 * i + 3) % 500 + 1 for i in range(40)]}   # spans 2 full blocks of 16
OTHER = {"prompt_token_ids": [(11 * i + 5) % 500 + 1 for i in range(21)]}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    return LLM(qwen3_ckpt, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def reference(llm):
    outs = llm.generate([GOOD, OTHER], PARAMS, use_tqdm=False)
    llm.reset_prefix_cache()
    return {"good": outs[0].outputs[0].token_ids, "other": outs[1].outputs[0].token_ids}


@pytest.fixture
def poisoned(llm, monkeypatch):
    """Steps whose batch holds a request id in `bad` raise (before the model runs, as a failed
    kernel launch would), either plainly or naming the request."""
    bad: set[str] = set()
    named = {"on": False}
    executor = llm.llm_engine.executor
    real = executor.execute_model

    def execute_model(so):
        culprits = sorted(bad & set(so.num_scheduled_tokens))
        if culprits:
            if named["on"]:
                raise StepFailure("bad sampling state", culprits)
            raise RuntimeError("selected index k out of range")
        return real(so)

    monkeypatch.setattr(executor, "execute_model", execute_model)
    yield bad, named
    llm.reset_prefix_cache()


def run_to_completion(engine, max_steps=200) -> dict:
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outs[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine is wedged"
    return outs


def assert_no_leak(engine):
    kv = engine.scheduler.kv
    assert kv.usage() == 0.0 and kv.pool.num_free_blocks == kv.num_blocks
    assert not engine.scheduler.requests and not engine._parents and not engine._child_to_parent
    assert not engine.recovery.held


def test_issue_repro_logprobs_refused_at_add_and_engine_goes_on(llm, reference):
    engine = llm.llm_engine
    engine.add_request("good", GOOD, PARAMS)
    for _ in range(3):
        engine.step()
    with pytest.raises(ValueError, match="logprobs=100000"):
        engine.add_request("bad", GOOD, SamplingParams(logprobs=100000))
    outs = run_to_completion(engine)
    assert outs["good"].outputs[0].token_ids == reference["good"]
    assert_no_leak(engine)


def test_failed_step_blames_the_new_request_and_others_go_on(llm, reference, poisoned):
    bad, _ = poisoned
    engine = llm.llm_engine
    engine.add_request("good", GOOD, PARAMS)
    for _ in range(3):
        engine.step()
    bad.add("bad")
    engine.add_request("bad", OTHER, PARAMS)
    outs = run_to_completion(engine)
    assert outs["bad"].outputs[0].finish_reason == "error" and outs["bad"].finished
    assert "selected index k out of range" in outs["bad"].error
    assert outs["good"].outputs[0].token_ids == reference["good"] and outs["good"].error is None
    assert_no_leak(engine)


def test_two_new_requests_are_told_apart_and_prefix_cache_is_not_poisoned(llm, reference, poisoned):
    bad, _ = poisoned
    engine = llm.llm_engine
    bad.add("bad")
    engine.add_request("bad", OTHER, PARAMS)
    engine.add_request("good", GOOD, PARAMS)   # prefilled in the failed step: its cached blocks are void
    outs = run_to_completion(engine)
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert outs["good"].outputs[0].token_ids == reference["good"]
    assert_no_leak(engine)
    # A later request with the same prefix reads the KV cache, not blocks the failed step never wrote.
    engine.add_request("again", GOOD, PARAMS)
    assert run_to_completion(engine)["again"].outputs[0].token_ids == reference["good"]
    assert_no_leak(engine)


def test_exception_naming_the_request_blames_it_alone(llm, reference, poisoned):
    bad, named = poisoned
    named["on"] = True
    engine = llm.llm_engine
    engine.add_request("good", GOOD, PARAMS)
    engine.add_request("other", OTHER, PARAMS)
    engine.step()
    bad.add("good")   # a request that already ran a step, named by the runner
    outs = run_to_completion(engine)
    assert outs["good"].outputs[0].finish_reason == "error" and "bad sampling state" in outs["good"].error
    assert outs["other"].outputs[0].token_ids == reference["other"]
    assert_no_leak(engine)


def test_failed_n_request_finishes_every_sequence_with_error(llm, reference, poisoned):
    bad, _ = poisoned
    engine = llm.llm_engine
    bad.update({"0_multi", "1_multi"})
    engine.add_request("multi", OTHER, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4))
    outs = run_to_completion(engine)
    assert [o.finish_reason for o in outs["multi"].outputs] == ["error", "error"]
    assert_no_leak(engine)


def test_generate_raises_for_the_failed_prompt_and_llm_keeps_serving(llm, reference, poisoned):
    bad, _ = poisoned
    engine = llm.llm_engine
    real_add = engine.add_request

    def add_request(request_id, prompt, params, processed=None):
        if prompt is OTHER:
            bad.add(request_id)
        return real_add(request_id, prompt, params, processed=processed)

    engine.add_request = add_request
    try:
        with pytest.raises(RequestFailed, match="selected index k out of range"):
            llm.generate([GOOD, OTHER], PARAMS, use_tqdm=False)
    finally:
        del engine.add_request
    assert_no_leak(engine)
    assert llm.generate(GOOD, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == reference["good"]
