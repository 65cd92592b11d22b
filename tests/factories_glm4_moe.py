"""Tiny random GLM-4.5 checkpoints built with transformers (fp32), plain or FP8 block-quantised."""
from __future__ import annotations

import json
import os

import torch

from tests.factories import perturb_biases, perturb_norms, save_tokenizer, take_saved_tensors, write_safetensors
from tests.factories_deepseek import quantize_with_twin

# head_dim 32 != hidden / heads (16), so a head dim taken from the wrong field shows; half of each
# head rotates; layer 0 dense; 8 experts in 2 groups of which a token may use 1. Weights drawn wider
# than transformers' 0.02, so greedy outputs vary instead of repeating one token.
GLM4_MOE_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    eos_token_id=0, bos_token_id=1, initializer_range=0.1,
)


def _mtp_tensors(cfg) -> dict[str, torch.Tensor]:
    """Fake multi-token-prediction layer tensors (layer index num_hidden_layers), as the hub has."""
    n, D = cfg.num_hidden_layers, cfg.hidden_size
    return {f"model.layers.{n}.eh_proj.weight": torch.randn(D, 2 * D),
            f"model.layers.{n}.enorm.weight": torch.ones(D),
            f"model.layers.{n}.shared_head.head.weight": torch.randn(cfg.vocab_size, D),
            f"model.layers.{n}.self_attn.q_proj.weight": torch.randn(cfg.num_attention_heads * cfg.head_dim, D),
            f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.randn(cfg.moe_intermediate_size, D)}


def make_glm4_moe_checkpoint(path: str, seed: int = 0, shards: int = 1, mtp: bool = True, layout: str = "per_expert",
                             fp8_twin_path: str | None = None, with_tokenizer: bool = True, **overrides) -> str:
    """Save a random transformers GLM-4.5 MoE to `path` (fp32).

    Norm weights are perturbed from 1, q/k/v biases and every router's correction bias from 0.
    layout: "per_expert" (hub names experts.{e}.gate_proj...) or "fused" (transformers' in-memory
    3-D experts.gate_up_proj [E, 2F, D] / experts.down_proj [E, D, F]).
    mtp: add fake layer-`num_hidden_layers` tensors (must be ignored on load).
    fp8_twin_path: instead save at `path` an FP8 e4m3 128x128 block-quantised checkpoint
    (`*.weight_scale_inv` beside each projection weight, `quantization_config` in config.json),
    and at `fp8_twin_path` its dequantised fp32 twin (loadable by transformers).
    """
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    config = Glm4MoeConfig(**{**GLM4_MOE_TINY, **overrides})
    model = Glm4MoeForCausalLM(config).float().eval()
    perturb_norms(model, seed)
    perturb_biases(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)  # config.json and the per-expert hub layout
    tensors = take_saved_tensors(path)
    if layout == "fused":
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()
                   if not (config.tie_word_embeddings and k == "lm_head.weight")}  # as save_pretrained
    if fp8_twin_path is not None:
        twin = quantize_with_twin(tensors)
        os.makedirs(fp8_twin_path, exist_ok=True)
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        with open(os.path.join(fp8_twin_path, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
        write_safetensors(fp8_twin_path, twin)
        if with_tokenizer:
            save_tokenizer(fp8_twin_path, config.vocab_size)
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
    if mtp:
        tensors.update(_mtp_tensors(config))
    write_safetensors(path, tensors, shards)
    if with_tokenizer:
        save_tokenizer(path, config.vocab_size)
    return path
