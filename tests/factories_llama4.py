"""Tiny random Llama-4 checkpoints built with Hugging Face transformers.

Chunk size 8 and floor_scale 4 make chunked-local attention and attention temperature tuning act
within prompts of 20-40 tokens; the four layers cover every (RoPE | NoPE) x (dense | MoE) pair.
"""
from __future__ import annotations

import json
import os

import torch

from tests.factories import perturb_norms, save_tokenizer, write_safetensors

LLAMA4_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
    moe_layers=[1, 3], no_rope_layers=[1, 1, 0, 0], attention_chunk_size=8, attn_temperature_tuning=True,
    floor_scale=4, attn_scale=0.5, use_qk_norm=True, max_position_embeddings=256, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0), tie_word_embeddings=False,
    eos_token_id=0, bos_token_id=1, initializer_range=0.1,
)

# Llama-3 scaling with a short pre-training length, so every band (kept, smoothed, divided) is used.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)

_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                    projector_output_dim=32)


def make_llama4_model(seed: int = 0, **overrides):
    """A random fp32 transformers Llama4ForCausalLM (norm weights perturbed away from 1)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    config = Llama4TextConfig(**{**LLAMA4_TINY, **overrides})
    config._attn_implementation = "eager"  # the plain masked softmax, no SDPA kernel choice
    model = Llama4ForCausalLM(config).float().eval()
    perturb_norms(model, seed)
    return model


def save_resharded(model, path: str, shards: int) -> None:
    """model.save_pretrained(path), its safetensors then rewritten as `shards` files."""
    from safetensors.torch import load_file

    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tensors = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
            os.remove(os.path.join(path, f))
        elif f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    write_safetensors(path, tensors, shards)


def save_llama4_checkpoint(model, path: str, layout: str = "text", shards: int = 1,
                           config_edits: dict | None = None) -> str:
    """Save `model` as a hub checkpoint in `path`.

    layout: "text" (Llama4ForCausalLM names) or "multimodal" (a Llama4ForConditionalGeneration
    with a tiny vision tower: text weights under `language_model.`, config under `text_config`).
    config_edits: keys set (value None: removed) in the text part of config.json afterwards.
    """
    os.makedirs(path, exist_ok=True)
    if layout == "multimodal":
        from transformers import Llama4Config, Llama4ForConditionalGeneration

        mm = Llama4ForConditionalGeneration(Llama4Config(text_config=model.config.to_dict(),
                                                         vision_config=_TINY_VISION)).float().eval()
        mm.language_model.load_state_dict(model.state_dict())
        save_resharded(mm, path, shards)
    else:
        save_resharded(model, path, shards)
    if config_edits:
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        text = cfg["text_config"] if layout == "multimodal" else cfg
        for k, v in config_edits.items():
            if v is None:
                text.pop(k, None)
            else:
                text[k] = v
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    save_tokenizer(path, model.config.vocab_size)
    return path
