"""The LLM API: input forms, bad input, sampling options, logprobs format, metrics."""
from __future__ import annotations

import pytest

from moe import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    return LLM(qwen3_ckpt, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=128)


def greedy(n=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_text_and_token_prompts_in_input_order(llm):
    ids = llm.get_tokenizer().encode("Hello world")
    outs = llm.generate(["Hello world", {"prompt_token_ids": [7, 8, 9]}, {"prompt": "Hello world"}], greedy(),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello world", None, "Hello world"]
    assert outs[0].prompt_token_ids == ids and outs[1].prompt_token_ids == [7, 8, 9]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].text == llm.get_tokenizer().decode(outs[0].outputs[0].token_ids)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_bad_inputs_raise_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="longer than the maximum model length max_model_len=64"):
        llm.generate({"prompt_token_ids": [1] * 65}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="token id 512 is out of vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 512]}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate([3.5], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [1, 2]}, greedy(), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(logprobs=-1), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(stop=[""]), "stop"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {param}="):
        SamplingParams(**kwargs)


def test_logprobs_format(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1
        assert len(entry) == 3  # the sampled token is the top-1 under greedy
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        values = [lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(isinstance(lp.decoded_token, str) for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [1, 2, 3]}, p, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": [9, 9]}, {"prompt_token_ids": [1, 2, 3]}],
                         [SamplingParams(temperature=1.0, max_tokens=5), p], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate({"prompt_token_ids": [1, 2, 3]}, p.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_top_k_one_equals_greedy_and_n_children(llm):
    prompt = {"prompt_token_ids": [4, 5, 6]}
    g = llm.generate(prompt, greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    k1 = llm.generate(prompt, SamplingParams(temperature=0.8, top_k=1, max_tokens=6, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0].token_ids
    assert k1 == g
    outs = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 6 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stop_conditions(llm):
    prompt = {"prompt_token_ids": [4, 5, 6]}
    ref = llm.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0]
    # stop_token_ids: the token ends generation and is kept in token_ids, not in the text.
    stop_tok = ref.token_ids[3]
    first = ref.token_ids.index(stop_tok)
    out = llm.generate(prompt, greedy(10, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    # stop strings: the text is cut before the stop string.
    text = ref.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip() and "\ufffd" not in stop:
        out = llm.generate(prompt, greedy(10, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:text.index(stop)]
        out = llm.generate(prompt, greedy(10, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
        assert out.outputs[0].text == text[:text.index(stop) + len(stop)]


def test_eos_min_tokens_and_ignore_eos(llm):
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": [4, 5, 6]}
    ref = llm.generate(prompt, greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    old = engine.eos_token_ids
    try:
        eos = ref[2]
        engine.eos_token_ids = (eos,)
        engine.executor.runner.eos_token_ids = [eos]
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[:ref.index(eos) + 1] and out.finish_reason == "stop" and out.stop_reason is None
        out = llm.generate(prompt, greedy(6), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6 and eos not in out.token_ids
    finally:
        engine.eos_token_ids = old
        engine.executor.runner.eos_token_ids = list(old)


def test_penalties_change_output(llm):
    prompt = {"prompt_token_ids": [4, 5, 6]}
    base = llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    pen = llm.generate(prompt, greedy(16, frequency_penalty=2.0, repetition_penalty=1.5),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert pen != base


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate({"prompt_token_ids": [1] * 60}, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_metrics(llm):
    llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(3), use_tqdm=False)
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["moe:generation_tokens"] >= 3 and metrics["moe:prompt_tokens"] >= 3
    success = {m.labels["finished_reason"]: m.value for m in llm.get_metrics() if m.name == "moe:request_success"}
    assert set(success) == {"stop", "length", "abort", "error"} and success["length"] >= 1
    assert "moe:num_preemptions" in metrics and "moe:prefix_cache_hits" in metrics
    assert metrics["moe:num_requests_running"] == 0


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="unknown engine argument.*bogus"):
        LLM("tiny-qwen3-moe", bogus=1)


def test_shutdown_releases_the_model_and_refuses_new_work(qwen3_ckpt):
    import weakref
    with LLM(qwen3_ckpt, dtype="float32", device="cpu") as llm:
        assert len(llm.generate(["Hello"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2
        model = weakref.ref(llm.llm_engine.executor.worker.model)
    assert model() is None, "shutdown drops the model (and the KV cache with the runner)"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hello"], greedy(2), use_tqdm=False)
