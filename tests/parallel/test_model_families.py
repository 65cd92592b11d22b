"""DeepSeek-V3 and Llama-4 in parallel layouts (spawned gloo workers on the CPU) give the single
process's greedy tokens (and logprobs to 1e-4) on tiny checkpoints.

DeepSeek-V3 (4 layers, layer 0 dense): MLA heads split over TP (q_b_proj / kv_b_proj column
slices, the latent cache replicated per rank), 16 experts in 4 groups with a correction bias, a
shared expert; the pipeline case splits [dense, MoE] | [MoE, MoE] and runs TP inside each stage.
Llama-4 (multimodal layout: weights under `language_model.`, tied embeddings, top-2 so each
token's two scaled inputs travel separately through the dispatcher): the shared expert is
TP-sharded beside expert-parallel routed experts; the pipeline case puts the tied lm_head on a
stage without the embedding. Mixtral (4 layers, 6 experts top-2, GQA heads split over TP).
"""
from __future__ import annotations

import multiprocessing

import pytest

from moe import LLM
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint
from tests.factories_mixtral import make_mixtral_checkpoint
from tests.parallel.conftest import assert_same_as_reference, prompts, sampling_params, summarize

# Few prompts and tokens: every layout spawns its own workers.
NUM_PROMPTS = 3
TP2_EP2 = dict(tensor_parallel_size=2, enable_expert_parallel=True)


def _make_deepseek(path: str) -> str:
    return make_deepseek_v3_checkpoint(path, seed=3, num_hidden_layers=4)


def _make_llama4(path: str) -> str:
    model = make_llama4_model(seed=4, num_experts_per_tok=2, tie_word_embeddings=True)
    return save_llama4_checkpoint(model, path, layout="multimodal")


def _make_mixtral(path: str) -> str:
    return make_mixtral_checkpoint(path, seed=6, num_hidden_layers=4)


FAMILIES = {"deepseek_v3": _make_deepseek, "llama4": _make_llama4, "mixtral": _make_mixtral}
LAYOUTS = {
    "deepseek_v3": {
        "tp2_ep2": TP2_EP2,
        # TP2 x PP2; small blocks and budget: chunked prefill through both stages.
        "pp": dict(tensor_parallel_size=2, pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=16),
    },
    "llama4": {
        "tp2_ep2": TP2_EP2,
        "pp": dict(pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=16),
    },
    "mixtral": {
        "tp2_ep2": TP2_EP2,
        "pp": dict(pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=16),
    },
}


def _generate(path: str, **kwargs):
    llm = LLM(path, dtype="float32", device="cpu", **kwargs)
    try:
        return summarize(llm.generate(prompts()[:NUM_PROMPTS], sampling_params()[:NUM_PROMPTS], use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint, single-process fp32 reference)."""
    name = request.param
    path = FAMILIES[name](str(tmp_path_factory.mktemp(name)))
    return name, path, _generate(path)


@pytest.mark.parametrize("layout", ["tp2_ep2", "pp"])  # "pp": each family's pipeline case
def test_family_layout_matches_single_process(family, layout):
    name, path, reference = family
    assert_same_as_reference(_generate(path, **LAYOUTS[name][layout]), reference)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moe-worker")]
