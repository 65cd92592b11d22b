"""moe.multimodal.images.load_image: every accepted form, and a clear ValueError for every bad one."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from moe.multimodal.images import load_image


def _png(h: int = 6, w: int = 10, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    channels = {"RGB": 3, "RGBA": 4}[mode]
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, channels), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def test_accepted_forms_decode_to_the_same_pixels():
    data = _png()
    want = np.array(Image.open(io.BytesIO(data)))
    for obj in (data, bytearray(data), memoryview(data), _data_url(data), " " + _data_url(data, "IMAGE/PNG") + "\n",
                Image.open(io.BytesIO(data))):
        img = load_image(obj)
        assert isinstance(img, Image.Image) and img.size == (10, 6)
        assert np.array_equal(np.array(img), want)


def test_base64_with_line_breaks_is_accepted():
    b64 = base64.encodebytes(_png(40, 40)).decode()  # MIME style: a newline every 76 characters
    assert "\n" in b64.strip()
    assert load_image(f"data:image/png;base64,{b64}").size == (40, 40)


@pytest.mark.parametrize("obj,match", [
    (b"not an image at all", "cannot decode the image: 19 bytes in no image format"),
    (b"", "the image data is empty"),
    (_png()[:60], "cannot decode the image: it is corrupt or truncated"),
    ("data:image/png;base64,@@@not-base64@@@", "bad base64"),
    ("data:image/png;base64," + base64.b64encode(b"garbage bytes").decode(), "cannot decode the image"),
    ("data:image/png," + "abc", "must be base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", "media type is 'text/plain', expected image/"),
    ("data:image/png;base64", "no ','"),
    ("http://example.com/cat.png", "fetching images over the network is not supported: send the image as a "
                                   "base64 data URL"),
    ("https://example.com/cat.png", "fetching images over the network is not supported.*https: URL"),
    ("file:///etc/passwd", "fetching images over the network is not supported.*file: URL"),
    ("just some text", "must be a data URL"),
    (12345, "unsupported image type int"),
    ({"url": "data:..."}, "unsupported image type dict"),
])
def test_bad_inputs_are_named(obj, match):
    with pytest.raises(ValueError, match=match):
        load_image(obj)


def test_zero_size_image():
    with pytest.raises(ValueError, match=r"zero size \(0x5 pixels\)"):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(ValueError, match=r"zero size \(7x0 pixels\)"):
        load_image(Image.new("RGB", (7, 0)))


def test_decompression_bomb_guard(monkeypatch):
    data = _png(64, 64)
    assert load_image(data).size == (64, 64)
    with pytest.raises(ValueError, match=r"64x64 = 4096 pixels, over the limit of 1000"):
        load_image(data, max_pixels=1000)
    with pytest.raises(ValueError, match="over the limit of 1000"):
        load_image(Image.open(io.BytesIO(data)), max_pixels=1000)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # the default limit follows PIL's setting
    with pytest.raises(ValueError, match="decompression-bomb guard"):  # PIL's own check (over 2x) fires first
        load_image(_data_url(data))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)
    with pytest.raises(ValueError, match="decompression-bomb guard.*limit of 3000"):  # PIL's warning, refused
        load_image(data)


def test_truncated_lazy_pil_image():
    img = Image.open(io.BytesIO(_png(64, 64)[:200]))  # the header parses; the pixels do not
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_image(img)
