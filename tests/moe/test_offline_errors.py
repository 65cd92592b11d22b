"""Offline misuse fails at once with an error naming the argument: integers the engine cannot hold,
stop strings that are not valid Unicode, arguments of the wrong kind, and an LLM used after shutdown."""
from __future__ import annotations

import pytest

from moe import LLM, SamplingParams
from moe.sampling_params import INT64_MAX, SEED_MAX

ENGINE = {"device": "cpu", "max_model_len": 64, "kv_cache_memory_bytes": 8 << 20}


@pytest.fixture(scope="module")
def tiny():
    from models.tiny import ensure_tiny_model

    return ensure_tiny_model("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def llm(tiny):
    llm = LLM(tiny, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("name", ["top_k", "max_tokens", "min_tokens", "logprobs", "n"])
@pytest.mark.parametrize("value", [2**63, 10**30])
def test_integers_beyond_int64_are_refused(name, value):
    kwargs = {name: value, "temperature": 1.0}
    with pytest.raises(ValueError, match=rf"invalid sampling parameter {name}={value}: must be at most {INT64_MAX}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("value", [2**64, 10**30])
def test_seeds_beyond_uint64_are_refused(value):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter seed={value}: must be at most {SEED_MAX}"):
        SamplingParams(seed=value)


def test_an_integer_too_long_to_print_is_still_named():
    with pytest.raises(ValueError, match=r"invalid sampling parameter top_k=<an integer of \d+ bits>: must be at most"):
        SamplingParams(top_k=10**5000)


def test_stop_token_ids_beyond_int64_are_refused():
    with pytest.raises(ValueError, match=r"invalid sampling parameter stop_token_ids=.*at most"):
        SamplingParams(stop_token_ids=[3, 2**64])


@pytest.mark.parametrize("stop, where", [("a\ud800", ""), (["ok", "\udfff"], r" \(string 1\)")])
def test_stop_strings_with_lone_surrogates_are_refused(stop, where):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter stop=.*must be valid Unicode text{where}"):
        SamplingParams(stop=stop)


def test_largest_int64_values_generate(llm):
    """The bound is the engine's: top_k and seed at int64's maximum (n=2: seeds max and max + 1) run a step."""
    params = SamplingParams(n=2, temperature=1.0, top_k=INT64_MAX, seed=INT64_MAX, max_tokens=3,
                            min_tokens=1, ignore_eos=True)
    out = llm.generate("hello", params, use_tqdm=False)[0]
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]
    again = llm.generate("hello", params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]  # seeded


@pytest.mark.parametrize("prompts, kind", [(5, "int"), (2.5, "float"), (b"hello", "bytes"), (True, "bool")])
def test_generate_with_a_non_prompt_names_what_prompts_may_be(llm, prompts, kind):
    with pytest.raises(TypeError, match=rf"prompts must be a string, a prompt dict .* or a list of them, got {kind}"):
        llm.generate(prompts, use_tqdm=False)


@pytest.mark.parametrize("params, kind", [(5, "int"), ("greedy", "str")])
def test_generate_with_non_sampling_params_names_them(llm, params, kind):
    with pytest.raises(TypeError, match=rf"sampling_params must be a SamplingParams or a list of them, got {kind}"):
        llm.generate("hi", params, use_tqdm=False)


@pytest.mark.parametrize("request_id", [None, 5, [None], ["a", 3], b"0"])
def test_abort_request_with_a_non_id_names_request_id(llm, request_id):
    with pytest.raises(TypeError, match=r"request_id must be a request id \(a string\) or a list of them, got"):
        llm.llm_engine.abort_request(request_id)


def test_abort_request_still_takes_ids_and_lists(llm):
    llm.llm_engine.abort_request("no-such-request")
    llm.llm_engine.abort_request(["a", "b"])
    llm.llm_engine.abort_request(("a",))
    assert not llm.llm_engine.has_unfinished_requests()


def test_generator_of_prompts_still_works(llm):
    outs = llm.generate((p for p in ["a", "b"]), SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(outs) == 2


SHUT_DOWN_CALLS = {
    "generate": lambda llm: llm.generate("hi", use_tqdm=False),
    "chat": lambda llm: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False),
    "get_metrics": lambda llm: llm.get_metrics(),
    "reset_prefix_cache": lambda llm: llm.reset_prefix_cache(),
    "get_expert_load": lambda llm: llm.get_expert_load(),
    "reset_expert_load": lambda llm: llm.reset_expert_load(),
    "start_expert_load_recording": lambda llm: llm.start_expert_load_recording("/nonexistent/load.jsonl"),
    "stop_expert_load_recording": lambda llm: llm.stop_expert_load_recording(),
}


@pytest.fixture(scope="module")
def shut_down_llm(tiny):
    with LLM(tiny, **ENGINE) as llm:
        assert llm.get_metrics() is not None and llm.get_expert_load().counts is not None
    return llm


@pytest.mark.parametrize("name", sorted(SHUT_DOWN_CALLS))
def test_every_method_after_shutdown_says_the_llm_was_shut_down(shut_down_llm, name):
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        SHUT_DOWN_CALLS[name](shut_down_llm)


def test_shutdown_twice_is_fine_and_the_tokenizer_stays(shut_down_llm):
    shut_down_llm.shutdown()
    shut_down_llm.__exit__(None, None, None)
    assert shut_down_llm.get_tokenizer() is not None  # the tokenizer needs no engine
