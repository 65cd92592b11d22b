"""One processed image of a request, as the engine core, the scheduler and the model runner see it.

The input side (moe/engine/input_processor.py) turns each image into pixel tiles and expands its
`<|image|>` placeholder into the image's tokens; from then on an image is a span of prompt
positions [offset, offset + length) whose `num_embeds` image-token positions (the model's
image_token_index, `<|patch|>` for Llama-4) take the encoder's features, in order. The scheduler
needs only the span, the embedding count and the hash (encoder budget, prefix-cache keys); the
runner needs the pixels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ImageItem:
    mm_hash: str                 # hash of the model, the image's pixels and the processor settings
    offset: int                  # first prompt position of the image's tokens (<|image_start|>)
    length: int                  # how many prompt tokens the image spans (through <|image_end|>)
    num_embeds: int              # how many of them take encoder features (tiles x tokens per tile)
    pixel_values: torch.Tensor   # [tiles, C, H, W] as the processor made them (bf16 for Llama-4)
    # API side only (never sent): the tile layout (rows, cols) and the image as given, so that an
    # image the engine core no longer holds can be processed again (keys-only IPC cache).
    layout: tuple[int, int] | None = None
    source: object = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the tokens [start, end) touch the image's span."""
        return self.offset < end and start < self.end


def check_items_in_prompt(items: list[ImageItem], num_prompt_tokens: int) -> None:
    """Spans in order, disjoint and inside the prompt: what every later stage relies on."""
    last_end = 0
    for i, item in enumerate(items):
        if item.offset < last_end or item.end > num_prompt_tokens or item.length <= 0 or item.num_embeds <= 0:
            raise ValueError(f"image {i}: its tokens [{item.offset}, {item.end}) overlap the previous image or lie "
                             f"outside the prompt of {num_prompt_tokens} tokens")
        last_end = item.end
