"""Tiny random multimodal Llama-4 (`Llama4ForConditionalGeneration`) built with transformers.

The text half is tests/factories_llama4.py's LLAMA4_TINY. The vision tower: 56-pixel tiles of
14-pixel patches (a 4 x 4 grid), pixel shuffle 0.5 -> 4 image tokens per tile; head dim 16 so the
2-D RoPE has 4 frequencies per axis. Every vision parameter is drawn at random (transformers
initialises biases to 0 and LayerNorms to 1, which would hide a missing bias or a wrong norm).
"""
from __future__ import annotations

import json
import os

import torch

from tests.factories import perturb_norms
from tests.factories_llama4 import LLAMA4_TINY, save_resharded

# The tiny tokenizer (build_llama4_mm_tokenizer): a byte-level BPE trained to 506 entries whose first
# four are the chat special tokens (so <|eot|> = 0 = LLAMA4_TINY's eos, <|begin_of_text|> = 1 = its bos),
# then Llama-4's image special tokens appended as added special tokens: ids 506..511, all inside the
# vocabulary of 512 and above 400 (test_llama4_vision draws its text ids below 400).
CHAT_SPECIAL_TOKENS = ("<|eot|>", "<|begin_of_text|>", "<|header_start|>", "<|header_end|>")
IMAGE_SPECIAL_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                        "<|tile_y_separator|>")
TOKENIZER_BPE_SIZE = 506
TOKEN_IDS = {**{t: i for i, t in enumerate(CHAT_SPECIAL_TOKENS)},
             **{t: TOKENIZER_BPE_SIZE + i for i, t in enumerate(IMAGE_SPECIAL_TOKENS)}}
IMAGE_TOKEN_ID = TOKEN_IDS["<|patch|>"]  # the model's image_token_index: the rows image features replace

# The image processing of the tiny checkpoint: one tile = the tower's 56-pixel image_size, up to 4 tiles.
LLAMA4_TINY_PREPROCESSOR = dict(size={"height": 56, "width": 56}, max_patches=4, resize_to_max_canvas=False,
                                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], rescale_factor=1 / 255,
                                do_rescale=True, do_normalize=True, do_convert_rgb=True, do_resize=True, resample=2,
                                image_processor_type="Llama4ImageProcessor", processor_class="Llama4Processor")
LLAMA4_TINY_PROCESSOR = dict(patch_size=14, pixel_shuffle_ratio=0.5, processor_class="Llama4Processor",
                             fake_image_token="<|image|>", image_token="<|image|>",
                             start_of_image_token="<|image_start|>", end_of_image_token="<|image_end|>",
                             patch_token="<|patch|>", tile_x_separator_token="<|tile_x_separator|>",
                             tile_y_separator_token="<|tile_y_separator|>")
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


def build_llama4_mm_tokenizer():
    """The tiny `tokenizers.Tokenizer` with Llama-4's chat and image special tokens (ids in TOKEN_IDS)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from models.tiny import _CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_BPE_SIZE, special_tokens=list(CHAT_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() != TOKENIZER_BPE_SIZE:
        raise RuntimeError(f"the tiny BPE trained to {tok.get_vocab_size()} entries, not {TOKENIZER_BPE_SIZE}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_SPECIAL_TOKENS])
    for token, token_id in TOKEN_IDS.items():
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} got id {tok.token_to_id(token)}, expected {token_id}")
    return tok


def save_llama4_mm_tokenizer(path: str) -> str:
    """tokenizer.json and tokenizer_config.json (bos/eos and Llama-4's chat template, taken from
    transformers' processing_llama4) into `path`."""
    from transformers.models.llama4.processing_llama4 import chat_template

    os.makedirs(path, exist_ok=True)
    build_llama4_mm_tokenizer().save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|eot|>", "add_bos_token": False, "chat_template": chat_template}, f, indent=2)
    return path


def save_llama4_mm_processor_configs(path: str, **preprocessor_overrides) -> str:
    """preprocessor_config.json (the image processor) and processor_config.json (the prompt expansion)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({**LLAMA4_TINY_PREPROCESSOR, **preprocessor_overrides}, f, indent=2)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump(LLAMA4_TINY_PROCESSOR, f, indent=2)
    return path


def save_llama4_mm_checkpoint(model, path: str, shards: int = 1) -> str:
    """Save `model` as a hub checkpoint (config.json, safetensors in `shards` files, tokenizer,
    preprocessor_config.json and processor_config.json)."""
    save_resharded(model, path, shards)
    vocab = model.config.text_config.vocab_size
    if vocab < TOKENIZER_BPE_SIZE + len(IMAGE_SPECIAL_TOKENS):
        raise ValueError(f"the tiny multimodal tokenizer needs a vocabulary of at least 512, the model has {vocab}")
    save_llama4_mm_tokenizer(path)
    save_llama4_mm_processor_configs(path)
    return path


def picture(height: int, width: int, seed: int, mode: str = "RGB"):
    """A random PIL image (uint8 noise) of the given size and mode."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def data_url(image) -> str:
    """The image as a base64 PNG data URL (what an OpenAI client sends in an image_url part)."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
