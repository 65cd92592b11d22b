"""The engine features every family gets, on the families added last (Mixtral, GLM-4.5, MiniMax-M2, gpt-oss,
Qwen3-Next): expert-load recording counts each routed token once per MoE layer, and preemption under a
tiny KV cache gives the same greedy tokens as a roomy one."""
from __future__ import annotations

import random

import pytest

from moe import LLM, SamplingParams
from tests.factories_glm4_moe import GLM4_MOE_TINY, make_glm4_moe_checkpoint
from tests.factories_gpt_oss import GPT_OSS_TINY, make_gpt_oss_checkpoint
from tests.factories_minimax_m2 import MINIMAX_M2_TINY, make_minimax_m2_checkpoint
from tests.factories_mixtral import MIXTRAL_TINY, make_mixtral_checkpoint
from tests.factories_qwen3_next import QWEN3_NEXT_TINY, make_qwen3_next_checkpoint

# family: (builder, MoE layer indices, top-k)
FAMILIES = {
    "mixtral": (make_mixtral_checkpoint, list(range(MIXTRAL_TINY["num_hidden_layers"])),
                MIXTRAL_TINY["num_experts_per_tok"]),
    "glm4_moe": (make_glm4_moe_checkpoint, list(range(GLM4_MOE_TINY["first_k_dense_replace"],
                                                      GLM4_MOE_TINY["num_hidden_layers"])),
                 GLM4_MOE_TINY["num_experts_per_tok"]),
    "minimax_m2": (make_minimax_m2_checkpoint, list(range(MINIMAX_M2_TINY["num_hidden_layers"])),
                   MINIMAX_M2_TINY["num_experts_per_tok"]),
    "gpt_oss": (make_gpt_oss_checkpoint, list(range(GPT_OSS_TINY["num_hidden_layers"])),
                GPT_OSS_TINY["num_experts_per_tok"]),
    "qwen3_next": (make_qwen3_next_checkpoint, list(range(QWEN3_NEXT_TINY["num_hidden_layers"])),
                   QWEN3_NEXT_TINY["num_experts_per_tok"]),
}
PROMPT_LENGTHS = [3, 20, 45, 9]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    build, moe_layers, top_k = FAMILIES[request.param]
    path = build(str(tmp_path_factory.mktemp(request.param)))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(n)]} for n in PROMPT_LENGTHS]
    return path, moe_layers, top_k, prompts


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_expert_load_counts_every_routed_token_once(family):
    path, moe_layers, top_k, prompts = family
    with LLM(path, dtype="float32", device="cpu", enable_prefix_caching=False) as llm:
        _greedy(llm, prompts)
        load = llm.get_expert_load()
    assert load.layers == moe_layers
    forwarded = sum(PROMPT_LENGTHS) + len(PROMPT_LENGTHS) * (MAX_TOKENS - 1)  # the last token is not fed back
    assert load.counts.sum(axis=1).tolist() == [forwarded * top_k] * len(moe_layers)
    assert (load.counts > 0).sum() > len(moe_layers)  # spread over experts, not one column


def test_preemption_keeps_the_greedy_tokens(family):
    path, _, _, prompts = family
    with LLM(path, dtype="float32", device="cpu") as llm:
        roomy = _greedy(llm, prompts)
    # 16 blocks of 4 tokens for 4 sequences of up to 57 tokens: requests are preempted and recomputed.
    with LLM(path, dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=16,
             max_num_batched_tokens=32, max_model_len=64) as llm:
        tight = _greedy(llm, prompts)
        assert llm.llm_engine.core.scheduler.num_preemptions > 0, "the cache is small enough to preempt"
    assert tight == roomy
