"""Returned routed experts (enable_return_routed_experts): for every family, the experts each MoE
layer chose for each forwarded token are those Hugging Face's own router picks on the same tokens
(read from its router modules' outputs), also across prefill chunks; and they survive prefix-cache
hits, preemption with recompute, async scheduling and stop strings unchanged."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moe import LLM, SamplingParams
from tests.factories import load_hf_model, make_qwen3_moe_checkpoint
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_glm4_moe import make_glm4_moe_checkpoint
from tests.factories_gpt_oss import make_gpt_oss_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint
from tests.factories_minimax_m2 import make_minimax_m2_checkpoint
from tests.factories_mixtral import make_mixtral_checkpoint
from tests.factories_qwen3_next import make_qwen3_next_checkpoint

FAMILIES = {
    "qwen3_moe": make_qwen3_moe_checkpoint,
    "deepseek_v3": make_deepseek_v3_checkpoint,
    "llama4": lambda path: save_llama4_checkpoint(make_llama4_model(seed=0), path),
    "mixtral": make_mixtral_checkpoint,
    "glm4_moe": make_glm4_moe_checkpoint,
    "minimax_m2": make_minimax_m2_checkpoint,
    "gpt_oss": make_gpt_oss_checkpoint,
    "qwen3_next": make_qwen3_next_checkpoint,
}
PROMPT_LENGTHS = [3, 21, 40]
MAX_TOKENS = 6


def _prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def hf_routed_experts(model, token_ids: list[int]) -> np.ndarray:
    """[T, MoE layers, K]: the expert ids transformers' router modules choose for the tokens, in layer
    order (their last output is the chosen ids; Llama-4's router returns its logits, top-k of them)."""
    chosen = []

    def hook(module, _inputs, output):
        if type(module).__name__ == "Llama4Router":
            chosen.append(output[1].topk(module.top_k, dim=-1).indices)
        else:
            chosen.append(output[-1])

    routers = [m for m in model.modules() if type(m).__name__.endswith(("Router", "TopkRouter"))]
    assert routers, "no router module found in the transformers model"
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([c.reshape(len(token_ids), -1) for c in chosen], dim=1).numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_routed_experts_are_the_hf_routers_choices(family, tmp_path):
    path = FAMILIES[family](str(tmp_path / family))
    prompts = _prompts()
    # A 16-token budget: the longer prompts are prefilled in chunks beside the others' decodes.
    with LLM(path, dtype="float32", device="cpu", enable_return_routed_experts=True,
             max_num_batched_tokens=16) as llm:
        outs = _generate(llm, prompts)
        assert llm.llm_engine.core.routed._entries == {}  # nothing kept for finished requests
    hf = load_hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        got = comp.routed_experts
        forwarded = prompt + list(comp.token_ids)[:-1]  # the last token was never fed back
        want = hf_routed_experts(hf, forwarded)
        assert got is not None and got.dtype == np.int16
        assert got.shape == want.shape == (len(forwarded), want.shape[1], want.shape[2])
        # the same experts; the order of a token's K ids is each implementation's own
        assert (np.sort(got, axis=-1) == np.sort(want, axis=-1)).all(), family


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_qwen3_moe_checkpoint(str(tmp_path_factory.mktemp("routed_qwen3")))


@pytest.fixture(scope="module")
def plain_run(qwen3):
    """Routed experts of a roomy synchronous engine without prefix caching."""
    with LLM(qwen3, dtype="float32", device="cpu", enable_return_routed_experts=True,
             enable_prefix_caching=False) as llm:
        outs = _generate(llm, _prompts())
    return [o.outputs[0].routed_experts for o in outs]


def _assert_same(outs, want):
    got = [o.outputs[0].routed_experts for o in outs]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g is not None and g.shape == w.shape and (g == w).all()


def test_prefix_cache_hits_return_the_cached_tokens_routing(qwen3, plain_run):
    prompts = _prompts()
    with LLM(qwen3, dtype="float32", device="cpu", enable_return_routed_experts=True, enable_prefix_caching=True,
             block_size=4) as llm:
        _generate(llm, prompts[2:])  # caches the longest prompt's blocks
        outs = _generate(llm, prompts)
        assert outs[2].num_cached_tokens >= 36, "the second run reads the first one's blocks"
    _assert_same(outs, plain_run)


def test_preemption_with_recompute_rewrites_the_routing(qwen3, plain_run):
    with LLM(qwen3, dtype="float32", device="cpu", enable_return_routed_experts=True, block_size=4,
             num_gpu_blocks_override=16, max_num_batched_tokens=16, max_model_len=64) as llm:
        outs = _generate(llm, _prompts())
        assert llm.llm_engine.core.scheduler.num_preemptions > 0, "the cache is small enough to preempt"
    _assert_same(outs, plain_run)


def test_async_scheduling_returns_the_same_routing(qwen3, plain_run):
    with LLM(qwen3, dtype="float32", device="cpu", enable_return_routed_experts=True, async_scheduling=True,
             max_num_batched_tokens=16) as llm:
        assert llm.llm_engine.core.async_scheduling
        outs = _generate(llm, _prompts())
    _assert_same(outs, plain_run)


def test_a_stop_string_cuts_the_routing_at_the_last_forwarded_token(qwen3, plain_run):
    with LLM(qwen3, dtype="float32", device="cpu", enable_return_routed_experts=True) as llm:
        free = _generate(llm, _prompts()[1:2])[0].outputs[0]
        stop = free.text[len(free.text) // 2:][:2]
        assert stop, "the tiny model's text is long enough to hold a stop string"
        cut = _generate(llm, _prompts()[1:2], stop=[stop])[0].outputs[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < MAX_TOKENS
    n = len(_prompts()[1]) + len(cut.token_ids) - 1
    assert cut.routed_experts.shape[0] == n
    assert (cut.routed_experts == plain_run[1][:n]).all()


def test_off_by_default(qwen3):
    with LLM(qwen3, dtype="float32", device="cpu") as llm:
        out = _generate(llm, _prompts()[:1])[0].outputs[0]
    assert out.routed_experts is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_capture_the_routing():
    """Decode and mixed steps replayed from CUDA graphs (async scheduling, as on CUDA by default) return
    the eager engine's routing: the step buffer is written inside the graphs and read after each replay."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (1, 9, 33, 70, 5, 17)]
    got = {}
    for eager in (True, False):
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=4,
                 max_num_batched_tokens=64, max_model_len=192, gpu_memory_utilization=0.2,
                 enable_return_routed_experts=True) as llm:
            runner = llm.llm_engine.executor.runner
            assert (runner.graphs is None and runner.mixed_graphs is None) == eager
            got[eager] = [o.outputs[0] for o in _generate(llm, prompts, max_tokens=10)]
    compared = differ = 0
    for p, g, e in zip(prompts, got[False], got[True], strict=True):
        assert g.routed_experts.shape == e.routed_experts.shape == (len(p) + 9, 4, 4)
        # up to the first token where a near-tie made the two runs part
        same = next((i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), len(g.token_ids))
        n = len(p) + same
        a, b = np.sort(g.routed_experts[:n], axis=-1), np.sort(e.routed_experts[:n], axis=-1)
        compared += n * a.shape[1]
        differ += int((a != b).any(axis=-1).sum())  # (token, layer) pairs whose chosen set differs
    assert compared > 200 and differ <= compared // 100, (differ, compared)
