"""Llama-4 image preprocessing and prompt expansion (moe/multimodal) against transformers.

The fixture comparisons use tests/fixtures/llama4_processor/processor_fixtures.safetensors, made by
transformers' real processor (torchvision backend) with make_fixtures.py next to it; the other
tests need no fixture: hand-computed canvases, tile order, normalisation, config errors, and the
prompt expansion against transformers' own Llama4Processor text path.
"""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from moe.engine.tokenizer import Tokenizer
from moe.multimodal.llama4_image_processor import Llama4ImageProcessor, ProcessedImage, best_canvas, supported_canvases
from moe.multimodal.llama4_prompt import ImagePlaceholder, Llama4ImageTokens
from tests.factories_llama4_mm import (
    IMAGE_TOKEN_ID,
    LLAMA4_TINY_PREPROCESSOR,
    LLAMA4_TINY_PROCESSOR,
    TOKEN_IDS,
    save_llama4_mm_processor_configs,
    save_llama4_mm_tokenizer,
)

FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "llama4_processor")
FIXTURE = os.environ.get("MOE_LLAMA4_PROCESSOR_FIXTURE", os.path.join(FIXTURE_DIR, "processor_fixtures.safetensors"))
_spec = importlib.util.spec_from_file_location("llama4_make_fixtures", os.path.join(FIXTURE_DIR, "make_fixtures.py"))
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)

TILE = 56
PATCHES = 4  # (56 // 14) ** 2 // round(1 / 0.5 ** 2)


def _processor(**overrides) -> Llama4ImageProcessor:
    return Llama4ImageProcessor({**LLAMA4_TINY_PREPROCESSOR, **overrides})


def _random_image(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8))


def _solid(h: int, w: int, rgb: tuple[int, int, int]) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, dtype=np.uint8), (h, w, 3)).copy()


def _value(level: int) -> float:
    """The normalised bf16 value of a uint8 level under mean = std = 0.5 (the tiny config)."""
    x = torch.tensor([level], dtype=torch.uint8).to(torch.bfloat16) * (1 / 255)
    return ((x - torch.tensor(0.5, dtype=torch.bfloat16)) / torch.tensor(0.5, dtype=torch.bfloat16)).item()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(save_llama4_mm_tokenizer(str(tmp_path_factory.mktemp("llama4_mm_tok"))))


@pytest.fixture(scope="module")
def image_tokens(tokenizer) -> Llama4ImageTokens:
    return Llama4ImageTokens.from_tokenizer(tokenizer, LLAMA4_TINY_PROCESSOR)


# ---- canvases ----------------------------------------------------------------------------------------

def test_supported_canvases_order():
    assert supported_canvases(4, 56) == [(56, 224), (112, 112), (56, 56), (224, 56), (56, 168), (168, 56),
                                         (56, 112), (112, 56)]


@pytest.mark.parametrize("image_hw,to_max,canvas,resized", [
    ((5, 9), False, (56, 56), (31, 56)),      # four canvases tie at scale 56/9: the smallest area wins
    ((5, 9), True, (112, 112), (62, 112)),    # the largest upscale, 112/9
    ((40, 200), False, (56, 224), (40, 200)),  # fits 1 x 4 at scale 1.12 but is not upscaled
    ((150, 130), False, (112, 112), (112, 97)),  # no canvas is big enough: the mildest downscale
    ((56, 56), False, (56, 56), (56, 56)),
    ((100, 60), False, (112, 112), (100, 60)),
    ((30, 45), False, (56, 56), (37, 56)),     # upscaled to one tile's side, not beyond
])
def test_best_canvas_hand_computed(image_hw, to_max, canvas, resized):
    proc = _processor(resize_to_max_canvas=to_max)
    assert best_canvas(image_hw, proc.canvases, to_max) == canvas
    assert proc.plan(image_hw) == (canvas, resized)


# ---- pixels ------------------------------------------------------------------------------------------

def test_tiles_are_row_major_and_the_global_tile_is_last():
    colours = [(10, 20, 30), (200, 0, 0), (0, 200, 0), (0, 0, 200)]
    quadrants = [_solid(56, 56, c) for c in colours]
    image = np.concatenate([np.concatenate(quadrants[:2], 1), np.concatenate(quadrants[2:], 1)], 0)  # 112 x 112
    out = _processor()([Image.fromarray(image)])[0]
    assert out.aspect_ratio == (2, 2) and out.num_tiles == 5 and out.pixel_values.shape == (5, 3, TILE, TILE)
    for i, colour in enumerate(colours):
        want = torch.tensor([_value(c) for c in colour], dtype=torch.bfloat16).view(3, 1, 1).expand(3, TILE, TILE)
        assert torch.equal(out.pixel_values[i], want), f"tile {i}"
    glob = out.pixel_values[4]  # the whole image at half size: each quadrant's colour in its 28 x 28 corner
    assert torch.equal(glob[:, 5, 5], out.pixel_values[0][:, 0, 0])
    assert torch.equal(glob[:, 50, 50], out.pixel_values[3][:, 0, 0])


def test_wide_image_is_one_row_of_tiles_and_padding_is_black():
    image = np.concatenate([_solid(40, 56, (i * 60, 255 - i * 60, 7)) for i in range(4)], 1)  # 40 x 224
    out = _processor()([Image.fromarray(image)])[0]
    assert out.aspect_ratio == (1, 4) and out.num_tiles == 5
    for i in range(4):
        assert out.pixel_values[i, 0, 0, 0].item() == _value(i * 60)
        assert (out.pixel_values[i, :, 40:] == -1).all()  # rows 40..55 are padding (0 -> -1)
        assert (out.pixel_values[i, :, :40] != -1).any()


@pytest.mark.parametrize("hw", [(5, 9), (1, 1), (300, 20), (57, 113)])
def test_tile_count_matches_the_aspect_ratio(hw):
    out = _processor()([_random_image(*hw, seed=1)])[0]
    rows, cols = out.aspect_ratio
    assert out.num_tiles == rows * cols + (1 if rows * cols > 1 else 0)
    assert rows * cols <= 4


def test_normalisation_range_and_dtype():
    image = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    image[0, 0], image[0, 1] = 0, 255
    pv = _processor()([Image.fromarray(image)])[0].pixel_values
    assert pv.dtype == torch.bfloat16
    assert pv.min().item() == -1.0 and pv.max().item() == 1.0
    assert torch.equal(pv[0, :, 5, 7].float(), torch.tensor([_value(v) for v in image[5, 7]]))
    other = _processor(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    assert other([Image.fromarray(image)])[0].pixel_values.max().item() > 1.5


def test_deterministic_and_independent_of_the_batch():
    images = [_random_image(70, 90, seed=3), _random_image(5, 9, seed=4)]
    proc = _processor()
    first, second = proc(images), proc(images[::-1])
    assert torch.equal(first[0].pixel_values, second[1].pixel_values)
    assert torch.equal(first[1].pixel_values, second[0].pixel_values)


def test_both_resize_paths_differ_by_at_most_one_level():
    """torchvision picks the uint8 or the float32 resize by CPU capability; they round differently."""
    image = _random_image(150, 130, seed=5)
    a = Llama4ImageProcessor(LLAMA4_TINY_PREPROCESSOR, native_uint8_resize=True)([image])[0].pixel_values
    b = Llama4ImageProcessor(LLAMA4_TINY_PREPROCESSOR, native_uint8_resize=False)([image])[0].pixel_values
    assert not torch.equal(a, b)
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2 / 255 + 2 ** -7)


def test_modes_are_converted_like_transformers():
    transparent = np.zeros((56, 56, 4), dtype=np.uint8)  # fully transparent black -> white
    assert (_processor()([Image.fromarray(transparent, "RGBA")])[0].pixel_values == 1).all()
    grey = Image.fromarray(np.full((56, 56), 77, dtype=np.uint8))
    assert (_processor()([grey])[0].pixel_values == _value(77)).all()
    with pytest.raises(ValueError, match="mode 'L' but do_convert_rgb is false"):
        _processor(do_convert_rgb=False)([grey])


# ---- configuration -----------------------------------------------------------------------------------

def test_from_pretrained_defaults_and_kwargs(tmp_path):
    proc = Llama4ImageProcessor.from_pretrained(str(tmp_path))  # no preprocessor_config.json
    kw = proc.processor_kwargs()
    assert kw["size"] == {"height": 336, "width": 336} and kw["max_patches"] == 16
    assert kw["resample"] == 2 and not kw["resize_to_max_canvas"] and json.dumps(kw)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(LLAMA4_TINY_PREPROCESSOR))
    proc = Llama4ImageProcessor.from_pretrained(str(tmp_path))
    assert proc.tile_size == 56 and proc.max_patches == 4
    (tmp_path / "preprocessor_config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="preprocessor_config.json is not valid JSON"):
        Llama4ImageProcessor.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("key,value", [
    ("size", {"height": 56, "width": 28}), ("size", {"shortest_edge": 56}), ("size", {"height": 0, "width": 0}),
    ("max_patches", 0), ("max_patches", 2.5), ("resize_to_max_canvas", "yes"), ("image_mean", [0.5, 0.5]),
    ("image_std", [0.5, 0.0, 0.5]), ("rescale_factor", -1.0), ("do_rescale", None), ("resample", 1),
    ("do_resize", False), ("do_convert_rgb", 1),
])
def test_bad_config_values_are_named(key, value):
    with pytest.raises(ValueError, match=f"preprocessor config: {key}="):
        _processor(**{key: value})


# ---- prompt expansion --------------------------------------------------------------------------------

def _fake(aspect_ratio: tuple[int, int]) -> ProcessedImage:
    rows, cols = aspect_ratio
    tiles = rows * cols + (1 if rows * cols > 1 else 0)
    return ProcessedImage(pixel_values=torch.zeros(tiles, 3, TILE, TILE, dtype=torch.bfloat16),
                          aspect_ratio=aspect_ratio)


def test_image_tokens_from_the_tokenizer(image_tokens):
    assert image_tokens.patch_id == IMAGE_TOKEN_ID
    assert image_tokens.image_id == TOKEN_IDS["<|image|>"] and image_tokens.downsample_ratio == 4
    assert image_tokens.patches_per_tile(TILE, TILE) == PATCHES


@pytest.mark.parametrize("aspect_ratio", [(1, 1), (2, 2), (1, 3), (3, 1)])
def test_expansion_matches_transformers_text(tokenizer, image_tokens, aspect_ratio):
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    text = Llama4Processor._prompt_split_image(None, aspect_ratio, PATCHES)  # uses no instance state
    assert image_tokens.image_token_ids(_fake(aspect_ratio)) == tokenizer.encode(text)


def test_expansion_structure_and_placeholders(tokenizer, image_tokens):
    t = TOKEN_IDS
    prompt = tokenizer.encode("<|begin_of_text|>A<|image|>B c<|image|>")
    ids, places = image_tokens.expand_image_placeholders(prompt, [_fake((1, 1)), _fake((1, 2))])
    one = [t["<|image_start|>"], t["<|image|>"]] + [IMAGE_TOKEN_ID] * 4 + [t["<|image_end|>"]]
    assert places[0] == ImagePlaceholder(offset=2, length=7, num_embeds=4)
    assert ids[2:9] == one
    second = ids[places[1].offset:places[1].offset + places[1].length]
    assert second == ([t["<|image_start|>"]] + [IMAGE_TOKEN_ID] * 4 + [t["<|tile_x_separator|>"]]
                      + [IMAGE_TOKEN_ID] * 4 + [t["<|tile_y_separator|>"], t["<|image|>"]] + [IMAGE_TOKEN_ID] * 4
                      + [t["<|image_end|>"]])
    assert places[1].num_embeds == 12 == 3 * PATCHES and places[1].offset + places[1].length == len(ids)
    assert sum(i == IMAGE_TOKEN_ID for i in ids) == sum(p.num_embeds for p in places)
    text_ids = [i for k, i in enumerate(ids) if not any(p.offset <= k < p.offset + p.length for p in places)]
    assert text_ids == [i for i in prompt if i != t["<|image|>"]]
    assert image_tokens.expand_image_placeholders(prompt[:2], []) == (prompt[:2], [])


def test_placeholder_count_mismatch(tokenizer, image_tokens):
    prompt = tokenizer.encode("x<|image|>y<|image|>")
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\).*but 1 image\(s\)"):
        image_tokens.expand_image_placeholders(prompt, [_fake((1, 1))])
    with pytest.raises(ValueError, match=r"0 image placeholder\(s\).*but 1 image\(s\)"):
        image_tokens.expand_image_placeholders(tokenizer.encode("no image"), [_fake((1, 1))])


def test_missing_special_token_is_named(tmp_path):
    from models.tiny import build_tokenizer

    build_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"no '<\|image\|>' token \(image_token"):
        Llama4ImageTokens.from_tokenizer(Tokenizer(str(tmp_path)), {})
    with pytest.raises(ValueError, match="pixel_shuffle_ratio=0"):
        Llama4ImageTokens.from_tokenizer(Tokenizer(str(tmp_path)), {"pixel_shuffle_ratio": 0})


def test_whole_prompts_match_transformers_processor(tokenizer, image_tokens, tmp_path):
    """transformers' Llama4Processor (its text path, with our pixels standing in) vs our id splicing."""
    from transformers import AutoTokenizer
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    folder = save_llama4_mm_processor_configs(str(tmp_path))
    save_llama4_mm_tokenizer(folder)
    hf = Llama4Processor(image_processor=make_fixtures.our_processor_as_hf(folder),
                         tokenizer=AutoTokenizer.from_pretrained(folder), patch_size=14, pixel_shuffle_ratio=0.5)
    images = {name: pil for name, (_, pil) in make_fixtures.build_images().items()}
    proc = Llama4ImageProcessor.from_pretrained(folder)
    for name, (_, names) in make_fixtures.PROMPTS.items():
        text = make_fixtures.prompt_text(name, hf.tokenizer)
        want = list(hf(images=[images[n] for n in names] or None, text=[text])["input_ids"][0])
        got, _ = image_tokens.expand_image_placeholders(tokenizer.encode(text), proc([images[n] for n in names]))
        assert got == want, name


# ---- against transformers' real processor (the committed fixture) ---------------------------------------

@pytest.fixture(scope="module")
def fixture():
    if not os.path.isfile(FIXTURE):
        pytest.skip("no processor fixture yet: run `python tests/fixtures/llama4_processor/make_fixtures.py "
                    "tests/fixtures/llama4_processor` where transformers and torchvision are installed, and commit "
                    "processor_fixtures.safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(FIXTURE, "pt") as f:
        meta = json.loads(f.metadata()["fixture"])
    return meta, load_file(FIXTURE)


def _fixture_image(tensors, name: str) -> Image.Image:
    palette = tensors.get(f"palette.{name}")
    return make_fixtures.rebuild_image(name, tensors[f"image.{name}"].numpy(),
                                       None if palette is None else palette.numpy())


CASES = [("canvas", n) for n in make_fixtures.IMAGES] + [("max_canvas", n) for n in make_fixtures.MAX_CANVAS_IMAGES]


@pytest.mark.parametrize("config,name", CASES, ids=[f"{c}-{n}" for c, n in CASES])
def test_pixel_values_match_transformers(fixture, config, name):
    meta, tensors = fixture
    native = meta["versions"]["native_uint8_bilinear"]  # the resize path torchvision took there
    proc = Llama4ImageProcessor(meta["configs"][config], native_uint8_resize=native)
    got = proc([_fixture_image(tensors, name)])[0]
    want = make_fixtures.decode_pixels(tensors[f"{config}.{name}.codes"], tensors[f"{config}.{name}.codebook"])
    assert got.aspect_ratio == tuple(tensors[f"{config}.{name}.aspect_ratio"].tolist())
    assert got.pixel_values.shape == want.shape and got.pixel_values.dtype == torch.bfloat16
    # Bit-exact: the same uint8 resize path (float32 + round, or torch's native uint8 kernel), then the
    # same bf16 ops. (Native uint8 kernels are SIMD-specific: if this fails only for a fixture made
    # with native_uint8_bilinear true, compare with one uint8 level, 2/255 + 2**-7, instead.)
    assert torch.equal(got.pixel_values.view(torch.int16), want.view(torch.int16)), (
        f"max |diff| {(got.pixel_values.float() - want.float()).abs().max().item()} "
        f"(fixture made with {meta['versions']})")


@pytest.mark.parametrize("name", list(make_fixtures.PROMPTS))
def test_input_ids_match_transformers(fixture, name, tmp_path):
    meta, tensors = fixture
    if meta["errors"]:
        pytest.fail("the fixture script could not run Llama4Processor:\n" + "\n".join(meta["errors"]))
    (tmp_path / "tokenizer.json").write_text(meta["tokenizer_json"])
    tok = Tokenizer(str(tmp_path))
    prompt = meta["prompts"][name]
    assert tok.encode(prompt["text"]) == tensors[f"prompt.{name}.prompt_ids"].tolist()
    tokens = Llama4ImageTokens.from_tokenizer(tok, LLAMA4_TINY_PROCESSOR)
    native = meta["versions"]["native_uint8_bilinear"]
    proc = Llama4ImageProcessor(meta["configs"]["canvas"], native_uint8_resize=native)
    images = proc([_fixture_image(tensors, n) for n in prompt["images"]])
    ids, places = tokens.expand_image_placeholders(tensors[f"prompt.{name}.prompt_ids"].tolist(), images)
    assert ids == tensors[f"prompt.{name}.input_ids"].tolist()
    assert [p.num_embeds for p in places] == [im.num_tiles * PATCHES for im in images]
