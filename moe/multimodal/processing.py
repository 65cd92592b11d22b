"""A prompt's images -> `ImageItem`s and the prompt ids with each `<|image|>` expanded.

Runs where prompts are processed (the caller's process offline, the API processes under `moe
serve`, there in several threads at once): decode each image (PIL image, bytes or base64 data URL),
check the count against limit_mm_per_prompt, run the checkpoint's image processor (or take its
output from the processor cache, keyed by the image's hash), and expand the placeholders into the
image's tokens.

Images are refused above `max_pixels`, from their header, before their pixels are decoded:
MAX_PIXELS_PER_CANVAS_PIXEL times the processor's largest canvas (16 tiles of 336 pixels for
Llama-4: 1.8 MP, so 29 MP; a 12 MP photo passes). The processor shrinks anything larger onto that
canvas, so more pixels are only more decoding time and memory (an 88 MP PNG: 1.7 GB).
"""
from __future__ import annotations

import os
import threading

import torch
from PIL import Image

from moe.engine.tokenizer import read_json
from moe.multimodal.hashing import hash_encoded_image, hash_image
from moe.multimodal.images import load_image
from moe.multimodal.inputs import ImageItem, check_items_in_prompt
from moe.multimodal.llama4_image_processor import Llama4ImageProcessor, ProcessedImage
from moe.multimodal.llama4_prompt import Llama4ImageTokens
from moe.multimodal.processor_cache import ProcessorCache, SenderCache

GiB = 1 << 30
MAX_PIXELS_PER_CANVAS_PIXEL = 16  # 4x the largest canvas's side: headroom for the antialiased downscale


class _Counts(threading.local):
    """Lookups and hits, per thread: InputProcessor counts a request's lookups as the difference
    before and after processing it, which requests in other threads must not change."""
    queries = 0
    hits = 0


def images_of(mm_data) -> list:
    """multi_modal_data ({"image": one image or a list}) -> the raw images, in order."""
    if not isinstance(mm_data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': image_or_list}}, "
                         f"got {type(mm_data).__name__}")
    unknown = sorted(set(mm_data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data has unsupported modality {unknown}: only 'image' is supported")
    images = mm_data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


class ImageProcessing:
    def __init__(self, model_path: str, tokenizer, image_limit: int, cache_gb: float = 4.0,
                 tile_size: int | None = None) -> None:
        if tokenizer is None:
            raise ValueError("images need the model's tokenizer (tokenizer.json) to expand <|image|>")
        self.model_id = os.path.realpath(model_path)
        self.image_limit = image_limit
        self.processor = Llama4ImageProcessor.from_pretrained(model_path)
        if tile_size is not None and self.processor.tile_size != tile_size:
            raise ValueError(f"the image processor makes {self.processor.tile_size}-pixel tiles "
                             f"(preprocessor_config.json 'size', transformers' default when the file is missing), "
                             f"but the vision tower takes {tile_size}-pixel images (vision_config.image_size)")
        self.tokens = Llama4ImageTokens.from_tokenizer(tokenizer, read_json(os.path.join(model_path,
                                                                                          "processor_config.json")))
        self.processor_kwargs = self.processor.processor_kwargs()
        canvas_pixels = max(h * w for h, w in self.processor.canvases)
        self.max_pixels = canvas_pixels * MAX_PIXELS_PER_CANVAS_PIXEL
        tile = self.processor.tile_size
        self._max_pixels_why = (f"{MAX_PIXELS_PER_CANVAS_PIXEL}x the largest canvas of this model's image processor, "
                                f"{canvas_pixels // tile ** 2} tiles of {tile}x{tile}, onto which it shrinks larger "
                                "images")
        self.cache = ProcessorCache(int(cache_gb * GiB))
        self._cache_lock = threading.Lock()  # the caches' LRU updates are not atomic
        # Keys-only mode (moe serve, one engine core, mm_processor_cache_type "lru"): the engine
        # core holds the pixels and this side keeps only the IPC cache's keys and layouts.
        self.keys_only: SenderCache | None = None
        self._counts = _Counts()  # lookups of processed images, and those that skipped the processor

    @property
    def queries(self) -> int:
        return self._counts.queries

    @property
    def hits(self) -> int:
        return self._counts.hits

    def use_keys_only(self, sender: SenderCache) -> None:
        """Keep only keys and layouts here (the core's side of `sender` holds the pixels)."""
        self.keys_only = sender
        self.cache = ProcessorCache(0)

    def process(self, prompt_token_ids: list[int], mm_data) -> tuple[list[int], list[ImageItem]]:
        raw = images_of(mm_data)
        if len(raw) > self.image_limit:
            raise ValueError(f"the prompt has {len(raw)} images, more than limit_mm_per_prompt allows "
                             f"({{'image': {self.image_limit}}})")
        self.tokens.check_prompt_ids(prompt_token_ids, len(raw))
        if not raw:
            return prompt_token_ids, []
        processed, hashes = [], []
        for i, obj in enumerate(raw):
            key, item = self._cached(obj)
            if item is None:
                try:
                    image = load_image(obj, self.max_pixels, self._max_pixels_why)
                except ValueError as e:
                    raise ValueError(f"image {i} of the prompt: {e}") from None
                item = self.processor([image])[0]
                with self._cache_lock:
                    self.cache.put(key, item)
            processed.append(item)
            hashes.append(key)
        ids, placeholders = self.tokens.expand_image_placeholders(prompt_token_ids, processed)
        items = [ImageItem(h, p.offset, p.length, p.num_embeds, img.pixel_values, img.aspect_ratio,
                           source=obj if self.keys_only is not None else None)
                 for h, p, img, obj in zip(hashes, placeholders, processed, raw)]
        check_items_in_prompt(items, len(ids))
        return ids, items

    def restore_evicted(self, items: list[ImageItem], sender: SenderCache) -> None:
        """Keys-only mode, right before sending: an image processed as a hit (its pixels a shape on
        the meta device) whose key the engine core has evicted since, because other requests were
        sent in between, is processed again from the image as it was given."""
        for item in items:
            if item.pixel_values.is_meta and item.mm_hash not in sender:
                image = load_image(item.source, self.max_pixels, self._max_pixels_why)
                item.pixel_values = self.processor([image])[0].pixel_values

    def _cached(self, obj) -> tuple[str | None, object]:
        """(the image's key, its processed form if cached). Encoded images (bytes, data URLs) are
        keyed by their bytes, so a hit skips decoding too; a PIL image by its pixels; anything else
        (which load_image then refuses) by nothing."""
        if isinstance(obj, Image.Image):
            key = hash_image(obj, self.model_id, self.processor_kwargs)
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            key = hash_encoded_image(bytes(obj), self.model_id, self.processor_kwargs)
        elif isinstance(obj, str):
            key = hash_encoded_image(obj.strip().encode(), self.model_id, self.processor_kwargs)
        else:
            return None, None
        return key, self._lookup(key)

    def _lookup(self, key: str) -> ProcessedImage | None:
        self._counts.queries += 1
        if self.keys_only is not None:
            meta = self.keys_only.metadata(key)  # (shape, dtype, layout) of pixels the core holds
            item = None if meta is None else ProcessedImage(torch.empty(meta[0], dtype=meta[1], device="meta"),
                                                            meta[2])
        else:
            with self._cache_lock:
                item = self.cache.get(key)
        self._counts.hits += item is not None
        return item

