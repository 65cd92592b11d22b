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


def hf_routed_experts(model, token_ids: list[int], with_scores: bool = False):
    """[T, MoE layers, K]: the expert ids transformers' router modules choose for the tokens, in layer
    order (their last output is the chosen ids; Llama-4's router returns its logits, top-k of them).
    with_scores: also [T, MoE layers, E], the scores each router ranks the experts by (its logits, or
    sigmoid(logits) + the correction bias where it has one; before any group limit)."""
    chosen, scores = [], []

    def hook(module, inputs, output):
        if type(module).__name__ == "Llama4Router":
            chosen.append(output[1].topk(module.top_k, dim=-1).indices)
            scores.append(output[1])
            return
        chosen.append(output[-1])
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None and len(inputs) > 1 and torch.is_tensor(inputs[1]):
            bias = inputs[1]  # MiniMax-M2's router is given it
        scores.append(output[0].float() if bias is None else output[0].float().sigmoid() + bias)

    routers = [m for m in model.modules() if type(m).__name__.endswith(("Router", "TopkRouter"))]
    assert routers, "no router module found in the transformers model"
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    T = len(token_ids)
    ids = torch.stack([c.reshape(T, -1) for c in chosen], dim=1).numpy()
    if not with_scores:
        return ids
    return ids, torch.stack([s.reshape(T, -1) for s in scores], dim=1).numpy()


def assert_same_experts(got: np.ndarray, want: np.ndarray, scores: np.ndarray, tie: float = 1e-4) -> None:
    """got and want [T, L, K] choose the same experts per token and layer (in any order), except
    where want's choice is a near-tie (each expert only one side chose scores within `tie` of the
    K-th best): there float sums in another order may pick the other expert. Such a flip changes its
    layer's output, which every later layer of that token and of the later tokens reads, so those
    are not compared."""
    same = np.sort(got, axis=-1) == np.sort(want, axis=-1)
    flips = []  # (token, layer) of each near-tie flip so far
    for t, layer in zip(*np.nonzero(~same.all(axis=-1))):  # token-major
        if any(t >= t0 and layer > l0 for t0, l0 in flips):
            continue
        kth = np.sort(scores[t, layer])[-got.shape[-1]]
        differ = np.setxor1d(got[t, layer], want[t, layer])
        assert (np.abs(scores[t, layer, differ] - kth) <= tie).all(), (
            f"token {t}, MoE layer {layer}: experts {sorted(got[t, layer])} chosen, "
            f"{sorted(want[t, layer])} expected (scores of the difference {scores[t, layer, differ]}, "
            f"K-th best {kth}: no near-tie)")
        flips.append((t, layer))


def test_near_tie_exemption_of_the_routing_comparison():
    want = np.array([[[0, 1]], [[2, 3]]])
    scores = np.array([[[0.9, 0.5, 0.49999, 0.1]], [[0.1, 0.2, 0.8, 0.7]]])
    assert_same_experts(want[:, :, ::-1].copy(), want, scores)  # the order of a token's ids is free
    flipped = np.array([[[0, 2]], [[2, 3]]])
    assert_same_experts(flipped, want, scores)  # 0.5 vs 0.49999: a near-tie
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_same_experts(np.array([[[0, 1]], [[2, 1]]]), want, scores)  # 0.2 vs 0.7
    deep = np.stack([want[:, 0], want[:, 0]], axis=1)  # two layers
    deep_scores = np.concatenate([scores, scores], axis=1)
    deep_scores[1, 0, 1] = 0.69999  # a near-tie with expert 3 in token 1's layer 0
    after_flip = deep.copy()
    after_flip[0, 0] = [0, 2]  # a near-tie flip in layer 0 of token 0 ...
    after_flip[1, 1] = [0, 1]  # ... exempts token 1's layer 1, which reads it
    assert_same_experts(after_flip, deep, deep_scores)
    before_flip = deep.copy()
    before_flip[1, 0] = [2, 1]  # token 1's near-tie flip in layer 0 exempts nothing of token 0 ...
    before_flip[0, 1] = [2, 3]  # ... whose layer 1 is then wrong
    with pytest.raises(AssertionError, match="token 0, MoE layer 1:"):
        assert_same_experts(before_flip, deep, deep_scores)


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
        want, scores = hf_routed_experts(hf, forwarded, with_scores=True)
        assert got is not None and got.dtype == np.int16
        assert got.shape == want.shape == (len(forwarded), want.shape[1], want.shape[2])
        assert_same_experts(got, want, scores)


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
