"""vLLM's token controls in SamplingParams: logit_bias, allowed_token_ids, bad_words,
truncate_prompt_tokens, and best_of's refusal; their validation, their effect on what is sampled
(synchronous and async scheduling), and the sampler's device ops on crafted logits."""
from __future__ import annotations

import math

import pytest
import torch

from moe import LLM, SamplingParams
from moe.engine.core import CoreRequest
from moe.engine.serialization import pack_request, unpack_request
from moe.worker.sampler import SamplingBatch, sample

ENGINE = {"device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 16 << 20}
PROMPTS = [[5, 17, 300, 42, 7, 99], [1, 2, 3], [250, 251, 252, 253, 254, 255, 256, 257]]


@pytest.fixture(scope="module")
def llm():
    llm = LLM("tiny-qwen3-moe", **ENGINE)
    yield llm
    llm.shutdown()


def _gen(llm, params, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


# ---- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {1: -101}}, "logit_bias"),
    ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {1: "5"}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
    ({"allowed_token_ids": 3}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["ok", ""]}, "bad_words"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"bad_words": ["\ud800"]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 3, "n": 2, "temperature": 1.0}, "best_of"),
])
def test_invalid_values_raise_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter {name}"):
        SamplingParams(**kwargs)


def test_valid_values_are_kept():
    p = SamplingParams(n=2, temperature=1.0, best_of=2, logit_bias={3: -100, 4: 2.5}, allowed_token_ids=(1, 2),
                       bad_words=("a",), truncate_prompt_tokens=-1)
    assert p.logit_bias == {3: -100.0, 4: 2.5} and p.allowed_token_ids == [1, 2] and p.bad_words == ["a"]
    assert SamplingParams(best_of=None).best_of is None and SamplingParams(best_of=1).best_of == 1
    assert p.clone(seed=3).logit_bias == p.logit_bias


@pytest.mark.parametrize("kwargs, name", [({"logit_bias": {512: 1.0}}, "logit_bias"),
                                          ({"allowed_token_ids": [1, 512]}, "allowed_token_ids")])
def test_token_ids_out_of_vocabulary_raise_before_anything_is_queued(llm, kwargs, name):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter {name}: token id 512 is out of vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


class _Tokenizer:
    """Words as one token each; a leading space gives another token of the same length for 'cat'
    only (as byte-level BPE does for common words)."""
    ids = {"cat": [10], " cat": [11], "dog food": [20, 21], " dog food": [30, 20, 21]}

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return self.ids[text]


def test_bad_words_are_tokenized_with_and_without_a_leading_space():
    p = SamplingParams(bad_words=["cat", "  dog food"])
    p.update_from_tokenizer(_Tokenizer(), 100)
    # " dog food" is a space token before the plain word's tokens: not another spelling of it.
    assert p._bad_words_token_ids == [[10], [11], [20, 21]]
    with pytest.raises(ValueError, match="invalid sampling parameter bad_words: token id 20 .* out of vocabulary"):
        SamplingParams(bad_words=["dog food"]).update_from_tokenizer(_Tokenizer(), 20)
    with pytest.raises(ValueError, match="bad_words: it needs a tokenizer"):
        SamplingParams(bad_words=["cat"]).update_from_tokenizer(None, 100)


def test_the_new_fields_travel_to_the_engine_core():
    """moe serve sends SamplingParams' init fields as msgpack (int keys of logit_bias included)."""
    p = SamplingParams(logit_bias={7: 1.5}, allowed_token_ids=[1, 7], truncate_prompt_tokens=4,
                       _bad_words_token_ids=[[3], [4, 5]])
    got = unpack_request(pack_request(CoreRequest("r", [1, 2], 4, p, (0,), []))).params
    assert (got.logit_bias, got.allowed_token_ids, got._bad_words_token_ids, got.truncate_prompt_tokens) == \
        ({7: 1.5}, [1, 7], [[3], [4, 5]], 4)


# ---- effect on sampling ---------------------------------------------------------------------
def test_logit_bias_forces_and_suppresses_tokens(llm):
    base = _gen(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    forced = _gen(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={7: 100}))
    assert forced == [[7] * 8] * len(PROMPTS) != base
    first = base[0][0]
    banned = _gen(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={first: -100}))
    assert all(first not in out for out in banned)


def test_allowed_token_ids_restrict_every_output_token(llm):
    allowed = {3, 9, 11, 400}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, allowed_token_ids=list(allowed))
              for i in range(len(PROMPTS))]
    outs = _gen(llm, params)
    assert all(set(out) <= allowed for out in outs) and len({t for out in outs for t in out}) > 1
    # Only some rows restricted: the others sample as before.
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    mixed = _gen(llm, [free, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=[9]),
                       free])
    assert mixed[1] == [9] * 6 and [mixed[0], mixed[2]] == [o for i, o in enumerate(_gen(llm, free)) if i != 1]


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    base = _gen(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))

    def word(n):  # n tokens that greedy decoding emits and whose text encodes back to them
        for out in base:
            for i in range(len(out) - n + 1):
                text = tok.decode(out[i:i + n])
                if text.strip() and tok.encode(text.lstrip(), add_special_tokens=False) == out[i:i + n]:
                    return text, out[i:i + n]
        pytest.skip(f"no {n}-token word in the greedy outputs")

    (single, [t]), (multi, ids) = word(1), word(2)
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[single])
    assert any(t in out for out in base) and all(t not in out for out in _gen(llm, p))
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[multi])
    outs = _gen(llm, p)
    assert any(_contains(out, ids) for out in base) and not any(_contains(out, ids) for out in outs)
    assert any(ids[0] in out for out in outs), "the word's first token alone is not banned"


def _token_sequence_bans(async_scheduling: bool, words):
    with LLM("tiny-qwen3-moe", async_scheduling=async_scheduling, **ENGINE) as llm:
        assert llm.llm_engine.core.async_scheduling is async_scheduling
        free = _gen(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        p = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, _bad_words_token_ids=words),
             SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True, _bad_words_token_ids=words),
             SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
        return free, _gen(llm, p)


def test_multi_token_bad_words_with_the_newest_token_pending_async():
    """Under async scheduling the newest output token is still on the device when the next step's
    sampling is built: the ban then depends on it on the device. The outputs equal the synchronous
    engine's, and no banned sequence occurs."""
    free, _ = _token_sequence_bans(False, None)
    words = [free[0][1:3], free[0][4:7], free[1][2:4], [free[2][0]]]
    want_free, want = _token_sequence_bans(False, words)
    got_free, got = _token_sequence_bans(True, words)
    assert got == want and got_free == want_free == free
    for out in got[:2]:
        assert not any(_contains(out, w) for w in words)
    assert want[0] != free[0] and want[2] == free[2]


def test_truncate_prompt_tokens_is_the_truncated_prompt(llm):
    prompt = list(range(10, 60))
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=7)
    outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:5]}], p, use_tqdm=False)
    want = llm.generate([{"prompt_token_ids": prompt[-7:]}], SamplingParams(temperature=0.0, max_tokens=6,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    assert outs[0].prompt_token_ids == prompt[-7:] and outs[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[1].prompt_token_ids == prompt[:5]  # shorter than k: unchanged
    # A text prompt; one longer than max_model_len runs once cut to fit (-1: max_model_len).
    text = "hello the cat " * 4
    ids = llm.get_tokenizer().encode(text)
    got = llm.generate(text, p, use_tqdm=False)[0]
    assert got.prompt == text and got.prompt_token_ids == ids[-7:]
    long = {"prompt_token_ids": [5] * 200}
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate(long, SamplingParams(max_tokens=1), use_tqdm=False)
    cut = llm.generate(long, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 128


def test_get_tokenizer_encodes_and_decodes(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.llm_engine.get_tokenizer()
    ids = tok.encode("hello the cat", add_special_tokens=False)
    assert ids and tok.decode(ids) == "hello the cat"


# ---- the sampler's device ops ----------------------------------------------------------------
def _batch(B, **kw):
    args = dict(temperature_B=torch.zeros(B), top_k_B=None, top_p_B=None, min_p_B=None, seeds=[None] * B,
                all_greedy=True, max_num_logprobs=-1)
    args.update(kw)
    return SamplingBatch(**args)


def test_sampler_token_bias_allowed_columns_and_pending_bans():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    # row 0 may only sample 2 or 3; row 1 has token 0 banned and token 3 raised by 2.5.
    bias = torch.tensor([[0, 0, 1, 1], [2, 3, 0, 3], [0, 0, -math.inf, 2.5]], dtype=torch.float64)
    out = sample(logits, _batch(3, token_bias=bias, num_allowed=2)).sampled_B
    assert out.tolist() == [2, 3, 0]
    # Row 2 bans token 0 when the pending token at index 1 is 7 (it is), row 0 when index 0 is 8 (it is not).
    bans = torch.tensor([[2, 0], [0, 0], [1, 0], [7, 8]])
    b = _batch(3, pending_bans=bans, pending_tokens=torch.tensor([7, 7]))
    assert sample(logits, b).sampled_B.tolist() == [0, 0, 1]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_token_controls_never_wait_for_the_device(enforce_eager):
    """logit_bias, allowed_token_ids and bad words (pending ones included) are built and applied
    without synchronizing the stream inside a step's launch (async scheduling)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    words = [[86, 86], [86, 129, 129], [321]]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={7: 5.0, 9: -3.0}),
              SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True, allowed_token_ids=[3, 9, 86]),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, _bad_words_token_ids=words),
              SamplingParams(temperature=0.9, seed=2, top_k=5, max_tokens=10, ignore_eos=True,
                             _bad_words_token_ids=words, logit_bias={86: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=3, allowed_token_ids=[86]),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=4,
             max_num_batched_tokens=48, gpu_memory_utilization=0.2) as llm:
        assert llm.llm_engine.core.async_scheduling
        want = _gen(llm, params, [p["prompt_token_ids"] for p in prompts])
        runner = llm.llm_engine.executor.runner
        real, launched = runner.launch, []

        def strict(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                launched.append(1)
        runner.launch = strict
        got = _gen(llm, params, [p["prompt_token_ids"] for p in prompts])
    assert len(launched) > 10 and got == want
    assert set(got[1]) <= {3, 9, 86} and got[4] == [86] * 10
    assert not any(_contains(got[i], w) for i in (2, 3) for w in words)
