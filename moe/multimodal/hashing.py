"""Cache keys of multimodal inputs: a digest of everything that decides the processed result.

A processed image (pixel_values + metadata) depends on the model (its processor), the image's
pixels (mode, size, raw bytes, palette) and the processor kwargs, so the key covers exactly those:
identical inputs give the same key in any process, any change gives a different one.

Every part is length-prefixed before it is hashed, so parts cannot run into each other
("ab" + "c" and "a" + "bc" differ), and each kind of key starts with its own tag, so an image key
never equals a key of encoded bytes.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from PIL import Image

_DIGEST_BYTES = 32  # blake2b-256: 64 hex characters


def canonical_json(obj: Any) -> bytes:
    """`obj` as JSON with sorted keys and no spaces: equal dicts give equal bytes whatever their order.

    Tuples and lists encode the same (they give the same processor result)."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise TypeError(f"processor kwargs must be JSON-serialisable (str keys, numbers, strings, lists, "
                        f"dicts) to be part of a cache key: {exc}") from None


def hash_bytes(*parts: bytes | str) -> str:
    """Hex blake2b-256 digest over the parts (str parts as UTF-8), each length-prefixed."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        if isinstance(part, str):
            part = part.encode("utf-8")
        elif not isinstance(part, (bytes, bytearray, memoryview)):
            raise TypeError(f"hash_bytes takes bytes or str parts, got {type(part).__name__}")
        part = memoryview(part).cast("B")
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _palette_bytes(image: Image.Image) -> bytes:
    """The palette of a palette image ("P"/"PA"): the same indices with another palette are other pixels."""
    if image.mode not in ("P", "PA"):
        return b""
    palette = image.getpalette(rawmode="RGBA") or []
    return bytes(palette)


def hash_image(image: Image.Image, model_id: str, processor_kwargs: dict | None = None) -> str:
    """The cache key of `image` processed by `model_id`'s processor with `processor_kwargs`.

    Covers the model id, mode, size, palette, the "transparency" info (it changes RGBA conversion),
    the raw pixel bytes, and the kwargs as canonical JSON. Decodes a lazily loaded image."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"hash_image takes a PIL.Image.Image, got {type(image).__name__}")
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"hash_image needs the model id as a non-empty string, got {model_id!r}")
    width, height = image.size
    transparency = image.info.get("transparency")
    return hash_bytes(
        "moe-mm-image-v1", model_id, image.mode, f"{width}x{height}", _palette_bytes(image),
        repr(transparency) if transparency is not None else "", image.tobytes(),
        canonical_json(processor_kwargs or {}))


def hash_encoded_image(data: bytes, model_id: str, processor_kwargs: dict | None = None) -> str:
    """The cache key of an encoded image file (PNG/JPEG bytes, a decoded data URL) without decoding it.

    Equal bytes decode to equal pixels, so this is a valid key; the same pixels encoded twice
    differently get two keys (a miss, never a wrong hit). Never equal to a hash_image key."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"hash_encoded_image needs the model id as a non-empty string, got {model_id!r}")
    return hash_bytes("moe-mm-encoded-v1", model_id, data, canonical_json(processor_kwargs or {}))
