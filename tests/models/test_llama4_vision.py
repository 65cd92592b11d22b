"""Llama-4 vision tower and image-embedding merge against transformers' Llama4ForConditionalGeneration.

One tiny random multimodal checkpoint (tests/factories_llama4_mm.py: 56-pixel tiles, 4 image tokens
per tile, every vision parameter random) saved in two shards; our model loads it with
`load_vision`, and the encoder alone loads it too.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.llama4 import Llama4ForCausalLM
from models.llama4_vision import (Llama4VisionConfig, Llama4VisionEncoder, merge_image_features, pixel_shuffle,
                                  vision_rope_angles)
from models.loader import load_weights
from models.registry import load_model_config
from tests.factories_llama4 import save_llama4_checkpoint
from tests.factories_llama4_mm import IMAGE_TOKEN_ID, LLAMA4_TINY_VISION, make_llama4_mm_model, \
    save_llama4_mm_checkpoint

TOKENS_PER_TILE = 4  # (56 / 14 * 0.5) ** 2


@pytest.fixture(scope="module")
def hf_mm():
    return make_llama4_mm_model(seed=0)


@pytest.fixture(scope="module")
def mm_ckpt(hf_mm, tmp_path_factory):
    return save_llama4_mm_checkpoint(hf_mm, str(tmp_path_factory.mktemp("llama4_mm")), shards=2)


def _build(path: str, load_vision: bool) -> Llama4ForCausalLM:
    cls, cfg = load_model_config(path)
    assert cls is Llama4ForCausalLM
    cfg.load_vision = load_vision
    model = cls(cfg).float().eval()
    load_weights(model, path, progress=False)
    return model


@pytest.fixture(scope="module")
def ours(mm_ckpt):
    return _build(mm_ckpt, load_vision=True)


def _pixels(num_tiles: int, seed: int) -> torch.Tensor:
    return torch.randn(num_tiles, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_image_features(hf_mm, pixel_values: torch.Tensor) -> torch.Tensor:
    """What Llama4ForConditionalGeneration.forward scatters: the projector over the flattened tiles."""
    tiles = hf_mm.get_image_features(pixel_values=pixel_values, return_dict=True).last_hidden_state
    return hf_mm.multi_modal_projector(tiles.reshape(-1, tiles.shape[-1]))


@torch.no_grad()
def _hf_merged_embeds(hf_mm, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
    """The inputs_embeds HF's forward hands its language model (captured by a pre-hook)."""
    seen = {}
    hook = hf_mm.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True)
    try:
        hf_mm(input_ids=input_ids[None], pixel_values=pixel_values)
    finally:
        hook.remove()
    return seen["embeds"][0]


def _prompt(tiles_per_image: list[int], seed: int) -> torch.Tensor:
    """bos, text, then per image a text gap and its tiles' image tokens, then trailing text."""
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(2, 400, (n,), generator=gen)  # noqa: E731 (never the image token)
    parts = [torch.tensor([1]), text(3)]
    for tiles in tiles_per_image:
        parts += [text(2), torch.full((tiles * TOKENS_PER_TILE,), IMAGE_TOKEN_ID)]
    return torch.cat(parts + [text(5)])


# ---- the tower -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tiles", [1, 2, 5])
def test_image_features_match_hf(hf_mm, ours, num_tiles):
    pixels = _pixels(num_tiles, seed=num_tiles)
    with torch.no_grad():
        got = ours.vision_encoder(pixels)
    want = _hf_image_features(hf_mm, pixels)
    assert got.shape == (num_tiles * TOKENS_PER_TILE, hf_mm.config.text_config.hidden_size)
    assert want.abs().mean() > 0.1  # features of O(1): the tolerance below is a real test
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tiles_are_independent_and_tile_major(ours):
    """Each tile's features are its own rows, in tile order (a batch is not mixed across tiles)."""
    pixels = _pixels(3, seed=7)
    with torch.no_grad():
        together = ours.vision_encoder(pixels)
        alone = torch.cat([ours.vision_encoder(pixels[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_standalone_encoder_loads_only_the_vision_tensors(ours, mm_ckpt):
    encoder = Llama4VisionEncoder(ours.config.vision).float().eval()
    load_weights(encoder, mm_ckpt, progress=False)
    pixels = _pixels(2, seed=11)
    with torch.no_grad():
        torch.testing.assert_close(encoder(pixels), ours.vision_encoder(pixels), rtol=0, atol=0)


@pytest.mark.parametrize("ratio,grid", [(0.5, 4), (0.5, 8), (0.25, 8)])
def test_pixel_shuffle_matches_hf(ratio, grid):
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle as hf_pixel_shuffle

    x = torch.randn(3, grid * grid, 6)
    torch.testing.assert_close(pixel_shuffle(x, ratio), hf_pixel_shuffle(x, ratio), rtol=0, atol=0)


@pytest.mark.parametrize("grid,heads,hidden", [(4, 2, 32), (24, 16, 1408)])  # tiny, and Llama-4 Scout's
def test_rope_angles_match_hf(grid, heads, hidden):
    from transformers import Llama4VisionConfig as HFVisionConfig
    from transformers.models.llama4.modeling_llama4 import Llama4VisionRotaryEmbedding

    hf = Llama4VisionRotaryEmbedding(HFVisionConfig(image_size=grid * 14, patch_size=14, hidden_size=hidden,
                                                    num_attention_heads=heads)).freqs_ci[:, 0]  # [S, d/2]
    angles = vision_rope_angles(grid, hidden // heads, 10000.0)
    torch.testing.assert_close(torch.polar(torch.ones_like(angles), angles), hf, rtol=0, atol=1e-6)


# ---- merging into the prompt ---------------------------------------------------------------------

@pytest.mark.parametrize("tiles_per_image", [[1], [2, 1]], ids=["one_image", "two_images"])
def test_merged_embeddings_match_hf(hf_mm, ours, tiles_per_image):
    input_ids = _prompt(tiles_per_image, seed=len(tiles_per_image))
    pixels = _pixels(sum(tiles_per_image), seed=3)
    with torch.no_grad():
        got = ours.embed_with_images(input_ids, pixels)
        text_only = ours.language_model.model.embed_tokens(input_ids)
    want = _hf_merged_embeds(hf_mm, input_ids, pixels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    is_image = input_ids == IMAGE_TOKEN_ID
    assert torch.equal(got[~is_image], text_only[~is_image])       # text rows untouched
    assert not torch.allclose(got[is_image], text_only[is_image])  # image rows replaced


def test_merge_puts_rows_in_order():
    embeds = torch.randn(7, 4)
    ids = torch.tensor([5, 9, 9, 6, 9, 7, 8])
    feats = torch.randn(3, 4, dtype=torch.float64)
    merged = merge_image_features(embeds, ids, feats, image_token_id=9)
    assert merged.dtype == embeds.dtype
    torch.testing.assert_close(merged[[1, 2, 4]], feats.float())
    torch.testing.assert_close(merged[[0, 3, 5, 6]], embeds[[0, 3, 5, 6]])
    assert not torch.equal(embeds[1], merged[1])  # the input is not modified in place


@pytest.mark.parametrize("extra_rows", [-1, 1])
def test_token_feature_count_mismatch_is_an_error(ours, extra_rows):
    input_ids = _prompt([2], seed=0)  # 8 image tokens
    feats = torch.randn(8 + extra_rows, 64)
    embeds = torch.randn(input_ids.shape[0], 64)
    with pytest.raises(ValueError, match=rf"8 image tokens \(id {IMAGE_TOKEN_ID}\) but {8 + extra_rows} image "
                                         "feature rows"):
        merge_image_features(embeds, input_ids, feats, IMAGE_TOKEN_ID)
    with pytest.raises(ValueError, match="8 image tokens"):  # one tile of pixels for a two-tile prompt
        ours.embed_with_images(input_ids, _pixels(1, seed=0))
    with pytest.raises(ValueError, match=r"image features have shape \[8, 63\]"):
        merge_image_features(embeds, input_ids, torch.randn(8, 63), IMAGE_TOKEN_ID)


def test_bad_pixel_values_are_named(ours):
    with pytest.raises(ValueError, match=r"pixel_values has shape \[2, 3, 28, 28\], expected \[num_tiles, 3, 56, 56"):
        ours.vision_encoder(torch.randn(2, 3, 28, 28))
    with pytest.raises(ValueError, match="floating point"):
        ours.vision_encoder(torch.zeros(1, 3, 56, 56, dtype=torch.uint8))


# ---- loading ---------------------------------------------------------------------------------------

def test_without_vision_the_tower_is_skipped(mm_ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="moe.models.llama4"):
        model = _build(mm_ckpt, load_vision=False)
    assert model.vision_encoder is None
    assert not [n for n, _ in model.named_parameters() if "vision" in n or "projector" in n]
    assert len([r for r in caplog.records if "Skipping the vision tower" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match="built without its vision tower"):
        model.embed_with_images(torch.tensor([1, IMAGE_TOKEN_ID]), _pixels(1, seed=0))


def test_missing_vision_tensor_is_named(mm_ckpt, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(mm_ckpt, path)
    name = "vision_model.model.layers.1.self_attn.k_proj.bias"
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, f))
            if tensors.pop(name, None) is not None:
                save_file(tensors, os.path.join(path, f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) '" + name.replace(".", r"\.") + "'"):
        _build(path, load_vision=True)
    _build(path, load_vision=False)  # text-only does not need it


def test_load_vision_needs_a_vision_config(tmp_path):
    from tests.factories_llama4 import make_llama4_model

    path = save_llama4_checkpoint(make_llama4_model(seed=0), str(tmp_path / "text"))
    with pytest.raises(ValueError, match="has no usable vision_config"):
        _build(path, load_vision=True)


def test_inconsistent_vision_config_fails_only_with_vision(tmp_path):
    """The text factory's old tiny tower (intermediate_size 64 for hidden 32 and ratio 0.5) cannot
    run in transformers either; text-only loading is unaffected."""
    from tests.factories_llama4 import make_llama4_model

    path = save_llama4_checkpoint(make_llama4_model(seed=0), str(tmp_path / "mm"), layout="multimodal")
    with pytest.raises(ValueError, match=r"intermediate_size=64 must equal hidden_size / pixel_shuffle_ratio\^2 = 128"):
        _build(path, load_vision=True)
    assert _build(path, load_vision=False).vision_encoder is None


def test_config_parses_hub_style_fields():
    """Hub configs write `rope_theta` in vision_config and image sizes as ints; HF defaults fill gaps."""
    vision = {k: v for k, v in LLAMA4_TINY_VISION.items() if k != "rope_parameters"}
    cfg = Llama4VisionConfig.from_hf({"vision_config": {**vision, "rope_theta": 500.0, "image_size": [56, 56],
                                                        "vision_feature_layer": -1},
                                      "text_config": {"hidden_size": 64}, "image_token_index": 7})
    assert (cfg.rope_theta, cfg.image_size, cfg.image_token_index, cfg.text_hidden_size) == (500.0, 56, 7, 64)
    assert cfg.tokens_per_tile == TOKENS_PER_TILE and cfg.num_channels == 3
    cfg.check()
    with pytest.raises(ValueError, match="vision_feature_layer=-2"):
        Llama4VisionConfig(**{**cfg.__dict__, "vision_feature_layer": -2}).check()
    with pytest.raises(ValueError, match="only square"):
        Llama4VisionConfig.from_hf({"vision_config": {"image_size": [56, 28]}})


def test_llama4_scout_vision_config_is_accepted(tmp_path):
    """Llama-4 Scout's published vision_config (values as on the hub): 144 tokens per 336-pixel tile."""
    scout = dict(hidden_size=1408, intermediate_size=5632, num_hidden_layers=34, num_attention_heads=16,
                 image_size=336, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=4096,
                 projector_output_dim=4096, vision_output_dim=4096, rope_theta=10000, hidden_act="gelu",
                 norm_eps=1e-5, multi_modal_projector_bias=False, vision_feature_layer=-1,
                 vision_feature_select_strategy="default", num_channels=3)
    cfg = Llama4VisionConfig.from_hf({"vision_config": scout, "text_config": {"hidden_size": 5120},
                                      "image_token_index": 200092})
    cfg.check()
    assert cfg.tokens_per_tile == 144


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_gpu_close_to_hf_fp32(hf_mm, ours, mm_ckpt):
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            encoder = Llama4VisionEncoder(ours.config.vision)
    finally:
        torch.set_default_dtype(torch.float32)
    load_weights(encoder, mm_ckpt, progress=False)
    pixels = _pixels(4, seed=5)
    with torch.no_grad():
        got = encoder(pixels.cuda()).float().cpu()
    want = _hf_image_features(hf_mm, pixels)
    assert (got - want).norm() / want.norm() < 3e-2


def test_checkpoint_config_records_the_image_token(mm_ckpt):
    with open(os.path.join(mm_ckpt, "config.json")) as f:
        assert json.load(f)["image_token_index"] == IMAGE_TOKEN_ID
    _, cfg = load_model_config(mm_ckpt)
    assert cfg.vision.image_token_index == IMAGE_TOKEN_ID and cfg.vision_error is None
