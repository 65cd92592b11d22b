"""Cache keys of images: equal inputs -> equal keys; any change of pixels, mode, size, palette,
processor kwargs or model -> another key."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from moe.multimodal.hashing import canonical_json, hash_bytes, hash_encoded_image, hash_image

MODEL = "meta-llama/Llama-4-Scout-17B-16E-Instruct"
KWARGS = {"max_patches": 16, "resize_to_max_canvas": False}


def _image(seed: int = 0, size=(37, 23), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8), mode)


def test_equal_images_equal_keys():
    a, b = _image(0), _image(0)
    assert a is not b
    key = hash_image(a, MODEL, KWARGS)
    assert key == hash_image(b, MODEL, dict(reversed(list(KWARGS.items()))))  # kwargs order does not matter
    assert len(key) == 64 and int(key, 16) >= 0


def test_every_input_changes_the_key():
    base = _image(0)
    key = hash_image(base, MODEL, KWARGS)
    one_pixel = base.copy()
    r, g, b = one_pixel.getpixel((5, 7))
    one_pixel.putpixel((5, 7), ((r + 1) % 256, g, b))
    variants = {
        "pixel": hash_image(one_pixel, MODEL, KWARGS),
        "mode": hash_image(base.convert("RGBA"), MODEL, KWARGS),
        "size": hash_image(base.resize((23, 37)), MODEL, KWARGS),
        # same bytes, other shape: 37x23 and 23x37 RGB hold the same number of bytes
        "shape only": hash_image(Image.frombytes("RGB", (23, 37), base.tobytes()), MODEL, KWARGS),
        "kwargs value": hash_image(base, MODEL, {**KWARGS, "max_patches": 8}),
        "kwargs extra": hash_image(base, MODEL, {**KWARGS, "extra": None}),
        "no kwargs": hash_image(base, MODEL, None),
        "model": hash_image(base, MODEL + "-other", KWARGS),
    }
    assert key not in variants.values(), variants
    assert len(set(variants.values())) == len(variants)


def test_palette_image_palette_matters():
    idx = np.random.default_rng(1).integers(0, 4, (9, 11), dtype=np.uint8)
    a, b = Image.fromarray(idx, "P"), Image.fromarray(idx, "P")
    a.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    b.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 9, 9, 9])
    assert a.tobytes() == b.tobytes()
    assert hash_image(a, MODEL) != hash_image(b, MODEL)
    assert hash_image(a, MODEL) == hash_image(a.copy(), MODEL)


def test_encoded_bytes_and_parts():
    data = b"\x89PNG fake bytes"
    key = hash_encoded_image(data, MODEL, KWARGS)
    assert key == hash_encoded_image(bytes(data), MODEL, KWARGS)
    assert key != hash_encoded_image(data + b"!", MODEL, KWARGS)
    assert key != hash_encoded_image(data, MODEL, {})
    # parts are length-prefixed: moving a boundary changes the digest
    assert hash_bytes("ab", "c") != hash_bytes("a", "bc")
    assert hash_bytes(b"ab", "c") == hash_bytes("ab", b"c")


def test_bad_inputs_name_the_problem():
    with pytest.raises(TypeError, match="PIL.Image"):
        hash_image(np.zeros((2, 2, 3), np.uint8), MODEL)
    with pytest.raises(ValueError, match="model id"):
        hash_image(_image(), "")
    with pytest.raises(TypeError, match="JSON-serialisable"):
        hash_image(_image(), MODEL, {"size": object()})
    with pytest.raises(TypeError, match="bytes or str"):
        hash_bytes(3)
    assert canonical_json({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'
