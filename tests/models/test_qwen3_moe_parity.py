"""Qwen3-MoE token for token with Hugging Face transformers, through the whole engine."""
from __future__ import annotations

import random

import pytest
import torch

from moe import LLM, SamplingParams
from tests.factories import hf_teacher_forced_logprobs, load_hf_model, make_qwen3_moe_checkpoint

PROMPT_LENGTHS = [1, 5, 17, 33, 64]  # around and across the 16-token block size


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def assert_matches_hf(model_dir: str, max_tokens: int = 12, **llm_kwargs) -> None:
    llm = LLM(model_dir, dtype="float32", device="cpu", **llm_kwargs)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = load_hf_model(model_dir)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert len(comp.token_ids) == max_tokens and comp.finish_reason == "length"
        ref = hf_teacher_forced_logprobs(hf, prompt, comp.token_ids)
        # Greedy: at every step our token is transformers' argmax (so its greedy run is the same).
        assert comp.token_ids == ref.argmax(-1).tolist()
        ours = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)])
        theirs = ref.gather(-1, torch.tensor(comp.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert all(comp.logprobs[i][t].rank == 1 for i, t in enumerate(comp.token_ids))


@pytest.mark.parametrize("layout,shards", [("per_expert", 1), ("per_expert", 3), ("fused", 1), ("fused", 2)])
def test_layouts_match_hf(tmp_path, layout, shards):
    path = make_qwen3_moe_checkpoint(str(tmp_path / "ckpt"), layout=layout, shards=shards, seed=shards)
    assert_matches_hf(path)


@pytest.mark.parametrize("overrides", [
    dict(norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=2),
    dict(num_experts=4, num_experts_per_tok=1, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True),
])
def test_config_variants_match_hf(tmp_path, overrides):
    path = make_qwen3_moe_checkpoint(str(tmp_path / "ckpt"), seed=7, **overrides)
    assert_matches_hf(path)


def test_small_blocks_and_budget_match_hf(tmp_path):
    """Chunked prefill across steps and many small blocks read the same context."""
    path = make_qwen3_moe_checkpoint(str(tmp_path / "ckpt"), seed=3)
    assert_matches_hf(path, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
