"""Tiny random multimodal Llama-4 (`Llama4ForConditionalGeneration`) built with transformers.

The text half is tests/factories_llama4.py's LLAMA4_TINY. The vision tower: 56-pixel tiles of
14-pixel patches (a 4 x 4 grid), pixel shuffle 0.5 -> 4 image tokens per tile; head dim 16 so the
2-D RoPE has 4 frequencies per axis. Every vision parameter is drawn at random (transformers
initialises biases to 0 and LayerNorms to 1, which would hide a missing bias or a wrong norm).
"""
from __future__ import annotations


import torch

from tests.factories import perturb_norms, save_tokenizer
from tests.factories_llama4 import LLAMA4_TINY, save_resharded

IMAGE_TOKEN_ID = 500  # inside LLAMA4_TINY's vocabulary of 512
LLAMA4_TINY_VISION = dict(
    hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=56,
    patch_size=14, pixel_shuffle_ratio=0.5, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)


@torch.no_grad()
def randomize_vision(model, seed: int) -> None:
    """Linear weights ~ N(0, 1/fan_in), biases and embeddings ~ N(0, 0.1-0.5), LayerNorm weights
    ~ 1 + N(0, 0.3): activations stay O(1) through the tower, so absolute tolerances mean something."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not name.startswith(("vision_model.", "multi_modal_projector.")):
            continue
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.3 * noise)
        elif name.endswith(("class_embedding", "positional_embedding_vlm")):
            p.copy_(0.5 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)


def make_llama4_mm_model(seed: int = 0, vision_overrides: dict | None = None, **text_overrides):
    """A random fp32 transformers Llama4ForConditionalGeneration (eager text attention)."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(seed)
    config = Llama4Config(text_config={**LLAMA4_TINY, **text_overrides},
                          vision_config={**LLAMA4_TINY_VISION, **(vision_overrides or {})},
                          image_token_index=IMAGE_TOKEN_ID)
    config.text_config._attn_implementation = "eager"
    model = Llama4ForConditionalGeneration(config).float().eval()
    perturb_norms(model.language_model, seed)
    randomize_vision(model, seed + 1)
    return model


def save_llama4_mm_checkpoint(model, path: str, shards: int = 1) -> str:
    """Save `model` as a hub checkpoint (config.json, safetensors in `shards` files, tokenizer)."""
    save_resharded(model, path, shards)
    save_tokenizer(path, model.config.text_config.vocab_size)
    return path
