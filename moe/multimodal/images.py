"""Turning what a request carries for an image (a PIL image, raw encoded bytes, or an OpenAI-style
`data:image/...;base64,...` URL) into a decoded PIL image, with a clear ValueError for every way it
can be wrong. Images are never fetched over the network or read from files: the server must not
become a proxy, and a request must not be able to read the host's disk.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import warnings

from PIL import Image

# A URL scheme ("http:", "https:", "file:", "s3:", ...) at the start of a string that is not a data URL.
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_NOT_FETCHED = "fetching images over the network is not supported: send the image as a base64 data URL"


class _ImageSizeError(ValueError):
    """A size refusal of ours (kept apart from the ValueErrors PIL raises on corrupt data)."""


_BOMB_GUARD = "a decompression-bomb guard"


def _check_size(image: Image.Image, max_pixels: int | None, why: str = _BOMB_GUARD) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise _ImageSizeError(f"the image has zero size ({width}x{height} pixels)")
    if max_pixels is not None and width * height > max_pixels:
        raise _ImageSizeError(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                              f"{max_pixels} ({why}): send a smaller image")


def _decode_bytes(data: bytes, max_pixels: int | None, why: str = _BOMB_GUARD) -> Image.Image:
    if not data:
        raise ValueError("the image data is empty")
    try:
        with warnings.catch_warnings():
            # PIL only warns between MAX_IMAGE_PIXELS and twice that; both are refused here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # lazy: reads the header only
            _check_size(image, max_pixels, why)  # before decoding the pixels
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"the image is too large to decode safely, a decompression-bomb guard ({e})") from None
    except _ImageSizeError:
        raise
    except Image.UnidentifiedImageError:
        raise ValueError(f"cannot decode the image: {len(data)} bytes in no image format this server reads "
                         "(is it corrupt or not an image?)") from None
    except (OSError, SyntaxError, EOFError, ValueError, struct.error) as e:
        raise ValueError(f"cannot decode the image: it is corrupt or truncated ({e})") from None
    return image


def _decode_data_url(url: str, max_pixels: int | None, why: str = _BOMB_GUARD) -> Image.Image:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("malformed data URL: no ',' between the header and the data")
    params = header[len("data:"):].split(";")
    media_type = params[0].strip().lower()
    if not media_type.startswith("image/"):
        raise ValueError(f"the data URL's media type is {media_type or 'missing'!r}, expected image/* "
                         "(e.g. data:image/png;base64,...)")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ValueError("the image data URL must be base64-encoded (data:image/...;base64,...)")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the image data URL holds bad base64 ({e})") from None
    return _decode_bytes(data, max_pixels, why)


def load_image(obj, max_pixels: int | None = None, why: str = _BOMB_GUARD) -> Image.Image:
    """A decoded PIL image from a PIL image, encoded image bytes, or a `data:image/...;base64,` URL.

    max_pixels: width*height above which the image is refused, from its header, before its pixels
    are decoded; None means PIL's `Image.MAX_IMAGE_PIXELS` at call time (PIL's own decompression-bomb
    check, which reads that global, applies in any case). why: the limit's reason, for the message.
    """
    if max_pixels is None:
        max_pixels = Image.MAX_IMAGE_PIXELS
    if isinstance(obj, Image.Image):
        _check_size(obj, max_pixels, why)
        try:
            obj.load()  # a lazily opened file image decodes here, not later in the processor
        except (OSError, SyntaxError, EOFError) as e:
            raise ValueError(f"cannot decode the image: it is corrupt or truncated ({e})") from None
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return _decode_bytes(bytes(obj), max_pixels, why)
    if isinstance(obj, str):
        text = obj.strip()
        if text[:5].lower() == "data:":
            return _decode_data_url(text, max_pixels, why)
        if _SCHEME_RE.match(text):
            raise ValueError(f"{_NOT_FETCHED} (got a {text.split(':', 1)[0].lower()}: URL)")
        raise ValueError("an image given as a string must be a data URL (data:image/...;base64,...); "
                         f"got a string starting with {text[:20]!r}")
    raise ValueError(f"unsupported image type {type(obj).__name__}: expected a PIL image, encoded image bytes "
                     "or a data:image/...;base64 URL string")
