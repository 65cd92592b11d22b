"""Qwen3-MoE token for token with Hugging Face transformers, through the whole engine."""
from __future__ import annotations


import pytest

from tests.factories import assert_outputs_match_hf, generate_greedy, load_hf_model, make_qwen3_moe_checkpoint

PROMPT_LENGTHS = [1, 5, 17, 33, 64]  # around and across the 16-token block size


def assert_matches_hf(model_dir: str, max_tokens: int = 12, **llm_kwargs) -> None:
    _, prompts, outs = generate_greedy(model_dir, PROMPT_LENGTHS, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(load_hf_model(model_dir), prompts, outs, max_tokens)


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
