"""kv_cache_dtype="fp8" (e4m3) / "fp8_e5m2" through the engine on the CPU: the cache is allocated
in FP8, so the same kv_cache_memory_bytes holds 4x the blocks of a float32 model's cache and 2x a
bf16 one's; generation runs for the GQA, MLA and chunked-local families; greedy tokens mostly
agree with the unquantised cache's (the agreement is measured and printed, random tiny models
have near-ties, so it is bounded loosely, not asserted exact); unknown names fail clearly."""
from __future__ import annotations

import random

import pytest
import torch

from moe import LLM, SamplingParams
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint

BUDGET = 8 << 20
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8kv")
    llama4 = str(root / "llama4")
    save_llama4_checkpoint(make_llama4_model(), llama4)
    return {"qwen3_moe": "tiny-qwen3-moe", "deepseek_v3": make_deepseek_v3_checkpoint(str(root / "dsv3")),
            "llama4": llama4}


def _engine(model, kv_cache_dtype, dtype="float32", **kw):
    return LLM(model, device="cpu", dtype=dtype, max_model_len=128, kv_cache_memory_bytes=BUDGET,
               kv_cache_dtype=kv_cache_dtype, **kw)


def _greedy(llm, n_prompts=16, max_tokens=24, seed=0):
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(4, 40))]}
               for _ in range(n_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two runs' greedy tokens are equal."""
    return sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)) / sum(len(s) for s in a)


@pytest.mark.parametrize("model_dtype,ratio", [("float32", 4), ("bfloat16", 2)])
@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_fp8_cache_holds_more_blocks_in_the_same_memory(model_dtype, ratio, name):
    sizes = {}
    for kv in ("auto", name):
        with _engine("tiny-qwen3-moe", kv, dtype=model_dtype) as llm:
            runner = llm.llm_engine.executor.runner
            assert runner.kv_dtype == getattr(torch, model_dtype)  # the model computes in its dtype
            assert all(c.dtype == (FP8[kv] if kv != "auto" else runner.kv_dtype) for c in runner.kv_caches)
            sizes[kv] = (runner.kv_cache_bytes_per_block(), runner.num_kv_blocks)
            assert sum(c.numel() * c.element_size() for c in runner.kv_caches) <= BUDGET
            if kv != "auto":
                assert len(_greedy(llm, n_prompts=2, max_tokens=4)[0]) == 4
    (bytes_auto, blocks_auto), (bytes_fp8, blocks_fp8) = sizes["auto"], sizes[name]
    assert bytes_auto == ratio * bytes_fp8
    assert blocks_fp8 == BUDGET // bytes_fp8 and blocks_fp8 >= ratio * blocks_auto


@pytest.mark.parametrize("family,least", [("qwen3_moe", 0.5), ("deepseek_v3", 0.5), ("llama4", 0.0)])
def test_greedy_tokens_mostly_agree_with_the_unquantised_cache(checkpoints, family, least, capsys):
    """Measured on 16 prompts x 24 tokens; llama4's tiny model (L2-normed keys, temperature tuning)
    is the touchiest, so it only has to generate."""
    with _engine(checkpoints[family], "auto") as llm:
        base = _greedy(llm)
    agreed = {}
    for name in ("fp8", "fp8_e5m2"):
        with _engine(checkpoints[family], name) as llm:
            out = _greedy(llm)
            assert all(c.dtype == FP8[name] for c in llm.llm_engine.executor.runner.kv_caches)
        assert [len(t) for t in out] == [len(t) for t in base]
        agreed[name] = agreement(base, out)
    with capsys.disabled():
        print(f"\n{family}: greedy agreement with the float32 cache: "
              + ", ".join(f"{k} {v:.2f}" for k, v in agreed.items()))
    assert agreed["fp8"] >= least and agreed["fp8_e5m2"] >= least * 0.8


def test_e4m3_aliases_are_one_cache():
    with _engine("tiny-qwen3-moe", "fp8") as llm:
        a = _greedy(llm, n_prompts=3, max_tokens=6)
    with _engine("tiny-qwen3-moe", "fp8_e4m3") as llm:
        b = _greedy(llm, n_prompts=3, max_tokens=6)
    assert a == b


@pytest.mark.parametrize("name,match", [("fp4", "kv_cache_dtype must be 'auto' or one of"),
                                        ("FP8", "kv_cache_dtype must be 'auto' or one of"),
                                        ("fp8_inc", "kv_cache_dtype='fp8_inc' is not supported")])
def test_unknown_kv_cache_dtype_fails_clearly(name, match):
    with pytest.raises(ValueError, match=match):
        _engine("tiny-qwen3-moe", name)
