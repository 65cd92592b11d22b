"""batch_invariant=True: a request's greedy tokens and logprobs are bit-identical whatever it is
batched with, however its prefill is chunked, wherever it sits in the batch and whether its prefix
came from the prefix cache, for every family the mode covers (CPU, fp32); the families it does not
cover, and several ranks, are refused by name."""
from __future__ import annotations

import random

import pytest
import torch

from kernels import batch_invariant
from moe import LLM, SamplingParams
from tests.factories import make_qwen3_moe_checkpoint
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_glm4_moe import make_glm4_moe_checkpoint
from tests.factories_gpt_oss import make_gpt_oss_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint
from tests.factories_minimax_m2 import make_minimax_m2_checkpoint
from tests.factories_mixtral import make_mixtral_checkpoint
from tests.factories_qwen3_next import make_qwen3_next_checkpoint

FAMILIES = {
    "qwen3_moe": make_qwen3_moe_checkpoint,
    "mixtral": make_mixtral_checkpoint,
    "glm4_moe": make_glm4_moe_checkpoint,
    "minimax_m2": make_minimax_m2_checkpoint,
    "gpt_oss": make_gpt_oss_checkpoint,  # sinks, sliding windows, biases
    # chunked-local attention of 8 tokens (the factory's): the target's prompt spans several chunks
    "llama4": lambda path: save_llama4_checkpoint(make_llama4_model(seed=0), path),
}
TARGET_LEN, MAX_TOKENS = 27, 8


@pytest.fixture(autouse=True)
def mode_off_afterwards():
    yield
    batch_invariant.set_enabled(False)  # process-wide: later tests build kernels without an engine


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _target_result(llm: LLM, target: list[int], others: list[list[int]], at: int, prompt_logprobs: bool = True):
    """The number of its prompt tokens found in the prefix cache, then the target's tokens and
    logprobs (every value as the engine returned it) when generated among `others`, at position `at`
    of the batch; prompt logprobs (which skip the prefix cache) where asked for."""
    prompts = others[:at] + [target] + others[at:]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS if p is target else 3 + i % 7,
                             ignore_eos=True, logprobs=3,
                             prompt_logprobs=2 if p is target and prompt_logprobs else None)
              for i, p in enumerate(prompts)]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[at]
    seq = out.outputs[0]
    return out.num_cached_tokens, (seq.token_ids, seq.cumulative_logprob,
            [{t: lp.logprob for t, lp in step.items()} for step in seq.logprobs],
            [None if step is None else {t: lp.logprob for t, lp in step.items()}
             for step in out.prompt_logprobs or ()])


def _check_invariance(path: str, **engine) -> None:
    target = _prompts(1, seed=1)[0][:3] * 9  # repeats: a prefix the cache can hold
    assert len(target) == TARGET_LEN
    results = []
    # Alone, the prompt in one chunk; among 5 others in 7-token chunks beside their decodes, in the
    # middle; among 9 others in 13-token chunks, last; and with its first 16 tokens from the cache.
    for budget, others, at, caching in ((64, [], 0, False), (7, _prompts(5, seed=2), 2, False),
                                        (13, _prompts(9, seed=3), 9, False), (20, _prompts(3, seed=4), 1, True)):
        with LLM(path, batch_invariant=True, max_num_batched_tokens=budget, max_model_len=64, block_size=4,
                 enable_prefix_caching=caching, **engine) as llm:
            if caching:  # a first request leaves the target's first 4 blocks in the cache
                llm.generate([{"prompt_token_ids": target[:17]}], SamplingParams(max_tokens=1), use_tqdm=False)
            cached, result = _target_result(llm, target, others, at, prompt_logprobs=not caching)
            # (Llama-4's chunked-local layers turn prefix caching off: the run is then one more batch.)
            assert cached == (16 if caching and llm.llm_engine.core.schedulers[0].kv.enable_caching else 0)
            results.append(result)
    first = results[0]
    assert len(first[0]) == MAX_TOKENS
    for other in results[1:]:
        assert other[0] == first[0], "tokens differ"
        assert other[2] == first[2], "logprobs differ"
        assert other[3] == first[3] or not other[3], "prompt logprobs differ"
        assert other[1] == first[1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_results_do_not_depend_on_the_batch(family, tmp_path):
    _check_invariance(FAMILIES[family](str(tmp_path / family)), dtype="float32", device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4"])
def test_results_do_not_depend_on_the_batch_on_cuda(family, tmp_path):
    """bf16 through the Triton kernels (invariant GEMM, expert kernel, unified attention), decode and
    mixed steps replayed from CUDA graphs."""
    # (a KV cache of 8 MiB: the default share of the GPU would make millions of 4-token blocks)
    _check_invariance(FAMILIES[family](str(tmp_path / family)), dtype="bfloat16", device="cuda",
                      max_num_seqs=16, kv_cache_memory_bytes=8 << 20)


def test_the_mode_is_not_a_no_op(tmp_path):
    """The same runs without the mode differ in the last bits somewhere (the test above can fail)."""
    path = make_qwen3_moe_checkpoint(str(tmp_path / "q"))
    target = _prompts(1, seed=1)[0][:3] * 9
    results = []
    for budget, others, at in ((64, [], 0), (7, _prompts(5, seed=2), 2)):
        with LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=budget, max_model_len=64,
                 block_size=4, enable_prefix_caching=False) as llm:
            results.append(_target_result(llm, target, others, at)[1])
    assert results[0][2] != results[1][2] or results[0][3] != results[1][3]


@pytest.mark.parametrize("family,what", [("deepseek_v3", "MLA attention"),
                                         ("qwen3_next", "linear-attention")])
def test_uncovered_families_are_refused(family, what, tmp_path):
    make = {"deepseek_v3": make_deepseek_v3_checkpoint, "qwen3_next": make_qwen3_next_checkpoint}[family]
    path = make(str(tmp_path / family))
    with pytest.raises(ValueError, match=f"batch_invariant is not supported .*{what}"):
        LLM(path, dtype="float32", device="cpu", batch_invariant=True)


def test_several_ranks_are_refused(monkeypatch):
    from moe.config import EngineArgs

    with pytest.raises(ValueError, match="batch_invariant runs on one rank"):
        EngineArgs(model="tiny-qwen3-moe", tensor_parallel_size=2, batch_invariant=True).validate()
    for variable in ("MOE_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"):  # the environment turns it on too
        with monkeypatch.context() as env:
            env.setenv(variable, "1")
            with pytest.raises(ValueError, match="batch_invariant runs on one rank"):
                EngineArgs(model="tiny-qwen3-moe", data_parallel_size=2).validate()
    monkeypatch.setenv("MOE_BATCH_INVARIANT", "0")  # MOE_ wins over VLLM_
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    EngineArgs(model="tiny-qwen3-moe", data_parallel_size=2).validate()
