"""Kimi-K2 checkpoints are DeepseekV3ForCausalLM with their own fields (model_type "kimi_k2", 384
routed experts in one group, YaRN with factor 32 and beta_fast = beta_slow = 1, routed_scaling_factor
2.827, FP8 128x128 blocks): Kimi-K2-Instruct's config.json parses as such, and a tiny checkpoint
of the same make (one expert group, its YaRN betas, one dense layer, model_type "kimi_k2") gives
transformers' DeepSeek-V3 tokens and logprobs."""
from __future__ import annotations

import json
import os

import torch

from models.registry import load_model_config
from tests.factories import assert_outputs_match_hf, generate_greedy
from tests.factories_deepseek import make_deepseek_v3_checkpoint

# moonshotai/Kimi-K2-Instruct's config.json (the fields the engine reads; auto_map and the tokenizer's
# custom code left out).
KIMI_K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "bos_token_id": 163584,
    "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_group": 1,
    "topk_method": "noaux_tc", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 163840,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def test_kimi_k2_instruct_config_parses_as_deepseek_v3(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(KIMI_K2_CONFIG, f)
    cls, cfg = load_model_config(str(tmp_path))
    assert cls.__name__ == "DeepseekV3ForCausalLM" and cfg.model_type == "kimi_k2"
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (384, 8, 1, 1)
    assert (cfg.first_k_dense_replace, cfg.n_shared_experts, cfg.routed_scaling_factor) == (1, 1, 2.827)
    assert (cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim) == (192, 512, 1536, 128)
    assert cfg.rope.scaling_type == "yarn" and cfg.rope.factor == 32.0
    assert cfg.rope.params["beta_fast"] == 1.0 and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.fp8 is not None and cfg.fp8.block == (128, 128)
    assert cfg.eos_token_ids == [163585]


def test_a_kimi_k2_shaped_tiny_checkpoint_matches_hf(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    yarn = dict(rope_type="yarn", factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                original_max_position_embeddings=16)  # YaRN acting inside short prompts
    # transformers' fused expert names: its per-expert conversion is keyed by model_type deepseek_v3
    path = make_deepseek_v3_checkpoint(str(tmp_path / "ckpt"), seed=11, layout="fused", n_routed_experts=12,
                                       num_experts_per_tok=4, n_group=1, topk_group=1, routed_scaling_factor=2.827,
                                       first_k_dense_replace=1, rope_scaling=yarn, rope_theta=50000.0)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "model_type": "kimi_k2"}, f)
    _, prompts, outs = generate_greedy(path, [1, 9, 40], 8)
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_outputs_match_hf(hf, prompts, outs, 8)
