"""Mixtral token for token with Hugging Face transformers, through the whole engine: the hub's
per-expert names and transformers' fused ones, sharded files, config variants, chunked prefill;
a sliding window shorter than the prompts (every layer slides)."""
from __future__ import annotations

import json
import os

import pytest

from moe import LLM
from tests.factories import assert_outputs_match_hf, generate_greedy, load_hf_model
from tests.factories_mixtral import make_mixtral_checkpoint

PROMPT_LENGTHS = [1, 5, 17, 33, 64]  # around and across the 16-token block size


def assert_matches_hf(model_dir: str, max_tokens: int = 10, **llm_kwargs) -> None:
    _, prompts, outs = generate_greedy(model_dir, PROMPT_LENGTHS, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(load_hf_model(model_dir), prompts, outs, max_tokens)


@pytest.mark.parametrize("layout,shards", [("hub", 1), ("hub", 3), ("fused", 1)])
def test_layouts_match_hf(tmp_path, layout, shards):
    assert_matches_hf(make_mixtral_checkpoint(str(tmp_path / "ckpt"), layout=layout, shards=shards, seed=shards))


def test_variants_and_chunked_prefill_match_hf(tmp_path):
    """top-1 of 4 experts, MHA, tied embeddings, no head_dim in the config (hidden / heads), a
    sliding window as long as the context (it never acts); small blocks and a small token budget."""
    path = make_mixtral_checkpoint(str(tmp_path / "ckpt"), seed=5, num_local_experts=4, num_experts_per_tok=1,
                                   num_key_value_heads=4, tie_word_embeddings=True, sliding_window=512)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.pop("head_dim")  # 64 / 4 heads = 16, the checkpoint's
    with open(config_file, "w") as f:
        json.dump(config, f)
    assert_matches_hf(path, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)


def test_a_sliding_window_shorter_than_the_prompts_matches_hf(tmp_path):
    """Every layer slides over 8 positions; chunks of 8 tokens and blocks of 4 cut across the window."""
    path = make_mixtral_checkpoint(str(tmp_path / "ckpt"), seed=2, sliding_window=8)
    assert_matches_hf(path, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)


def test_a_bad_sliding_window_is_refused(tmp_path):
    path = make_mixtral_checkpoint(str(tmp_path / "ckpt"))
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "sliding_window": -4}, f)
    with pytest.raises(ValueError, match="sliding_window=-4 must be a positive integer or null"):
        LLM(path, device="cpu")


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_mixtral_checkpoint(str(tmp_path / "ckpt"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight"):
        LLM(path, device="cpu")
