"""Tiny random gpt-oss checkpoints built with Hugging Face transformers: transformers' own layout, and
the hub's MXFP4 one (experts as blocks + scales) with a dense twin holding the same values for
transformers to run."""
from __future__ import annotations

import json
import os

import torch
from tests.factories import perturb_biases, perturb_norms, save_tokenizer, take_saved_tensors, write_safetensors

# A window of 8 and YaRN scaling from 64 positions act inside short prompts; a low swiglu_limit and
# larger weights make the clamps of the experts' SwiGLU act.
GPT_OSS_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
    sliding_window=8, rms_norm_eps=1e-5, swiglu_limit=0.6, initializer_range=0.1, tie_word_embeddings=False,
    eos_token_id=0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 10000.0},
)


def _build(seed: int, overrides: dict):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(**{**GPT_OSS_TINY, **overrides})
    model = GptOssForCausalLM(config).float().eval()
    perturb_norms(model, seed)
    perturb_biases(model, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # the experts' biases (named *_bias, not .bias) and sinks away from their init
        for name, p in model.named_parameters():
            if name.endswith("_proj_bias") or name.endswith("sinks"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return config, model


def make_gpt_oss_checkpoint(path: str, shards: int = 1, seed: int = 0, **overrides) -> str:
    """Save a random transformers gpt-oss to `path` as save_pretrained writes it (experts
    gate_up_proj [E, D, 2F] interleaved, down_proj [E, F, D])."""
    config, model = _build(seed, overrides)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    write_safetensors(path, take_saved_tensors(path), shards)
    save_tokenizer(path, config.vocab_size)
    return path


def make_gpt_oss_mxfp4_checkpoint(path: str, twin_path: str, seed: int = 0, **overrides) -> tuple[str, str]:
    """The hub's layout at `path`: experts as MXFP4 `*_blocks` [E, out, in/32, 16] and `*_scales`
    [E, out, in/32] (uint8) with config.json's quantization_config; at `twin_path` the same model with
    the dequantised values as dense weights, for transformers to run."""
    from models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    config, model = _build(seed, overrides)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))  # along the input dim: [E, out, in]
                p.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    for out in (path, twin_path):
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out)
        save_tokenizer(out, config.vocab_size)
    tensors = take_saved_tensors(path)
    tensors = {k: v for k, v in tensors.items() if not (k.endswith("gate_up_proj") or k.endswith("down_proj"))}
    write_safetensors(path, {**tensors, **packed})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router",
                                                                                      "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path, twin_path
