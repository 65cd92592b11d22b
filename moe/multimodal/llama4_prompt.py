"""Llama-4 prompt expansion on token ids: each `<|image|>` placeholder of a tokenized prompt becomes
the image's token sequence, as transformers' Llama4Processor writes it in text before tokenizing:

    <|image_start|>
      (only when tiles > 1) for each tile row: [P patches, <|tile_x_separator|>] between the row's
      tiles, then <|tile_y_separator|> after the row
    <|image|> P patches (the global tile, or the only tile) <|image_end|>

with P = (tile_h // patch_size) * (tile_w // patch_size) // round(1 / pixel_shuffle_ratio^2)
`<|patch|>` tokens per tile. Special tokens are atomic in the tokenizer (text never merges across
them), so splicing ids gives exactly the ids of tokenizing the expanded text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe.multimodal.llama4_image_processor import ProcessedImage

# processor_config.json keys for the special tokens, with transformers' defaults.
TOKEN_KEYS = {
    "image_token": "<|image|>",
    "start_of_image_token": "<|image_start|>",
    "end_of_image_token": "<|image_end|>",
    "patch_token": "<|patch|>",
    "tile_x_separator_token": "<|tile_x_separator|>",
    "tile_y_separator_token": "<|tile_y_separator|>",
}


@dataclass(frozen=True)
class ImagePlaceholder:
    offset: int      # where the image's expansion starts in the expanded ids
    length: int      # its number of ids, <|image_start|> to <|image_end|> included
    num_embeds: int  # how many of them are <|patch|>: the image-feature rows (tiles * patches per tile)


@dataclass(frozen=True)
class Llama4ImageTokens:
    image_id: int        # the placeholder users write; also the marker before the global tile
    image_start_id: int
    image_end_id: int
    patch_id: int        # the model's image_token_index: features replace these rows
    tile_x_id: int
    tile_y_id: int
    patch_size: int
    downsample_ratio: int  # round(1 / pixel_shuffle_ratio^2): patches merged into one token
    names: dict = field(default_factory=dict, compare=False)  # token id -> its text, for messages

    @classmethod
    def from_tokenizer(cls, tokenizer, processor_config: dict | None) -> Llama4ImageTokens:
        """tokenizer: moe.engine.tokenizer.Tokenizer; processor_config: processor_config.json's dict (None or
        missing keys: transformers' defaults, patch_size 14 and pixel_shuffle_ratio 0.5)."""
        cfg = processor_config or {}
        patch_size = cfg.get("patch_size", 14)
        if not isinstance(patch_size, int) or isinstance(patch_size, bool) or patch_size <= 0:
            raise ValueError(f"processor config: patch_size={patch_size!r} is invalid, expected a positive integer")
        ratio = cfg.get("pixel_shuffle_ratio", 0.5)
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
            raise ValueError(f"processor config: pixel_shuffle_ratio={ratio!r} is invalid, expected a number in (0, 1]")
        ids, names = {}, {}
        for key, default in TOKEN_KEYS.items():
            token = cfg.get(key, default)
            if not isinstance(token, str) or not token:
                raise ValueError(f"processor config: {key}={token!r} is invalid, expected a token string")
            token_id = tokenizer.backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"the tokenizer has no {token!r} token ({key} of the processor config): "
                                 "is this a Llama-4 multimodal checkpoint's tokenizer?")
            ids[key] = token_id
            names[token_id] = token
        return cls(image_id=ids["image_token"], image_start_id=ids["start_of_image_token"],
                   image_end_id=ids["end_of_image_token"], patch_id=ids["patch_token"],
                   tile_x_id=ids["tile_x_separator_token"], tile_y_id=ids["tile_y_separator_token"],
                   patch_size=patch_size, downsample_ratio=int(round(1.0 / ratio ** 2)), names=names)

    def _name(self, token_id: int) -> str:
        return self.names.get(token_id, f"token {token_id}")

    def check_prompt_ids(self, prompt_token_ids: list[int], num_images: int) -> None:
        """Refuse the ids the vision path would misread: a token of an image's expansion
        (<|image_start|>, <|patch|>, ...) given in the prompt itself, which would take image
        features or shift them; an <|image|> placeholder when no image is attached. (With images,
        expand_image_placeholders checks that placeholders and images match one to one.)"""
        expansion = {self.image_start_id, self.image_end_id, self.patch_id, self.tile_x_id, self.tile_y_id}
        found = next((t for t in prompt_token_ids if t in expansion), None)
        if found is not None:
            raise ValueError(f"the prompt holds {self._name(found)} (token id {found}), a token of an image's "
                             f"expansion that only the image processing may write: stand for an image with "
                             f"{self._name(self.image_id)} and attach the image")
        if num_images == 0 and self.image_id in prompt_token_ids:
            raise ValueError(f"the prompt holds the image placeholder {self._name(self.image_id)} (token id "
                             f"{self.image_id}) but no image is attached: attach one image per placeholder, or "
                             "take the placeholder out of the text")

    def patches_per_tile(self, tile_h: int, tile_w: int) -> int:
        return (tile_h // self.patch_size) * (tile_w // self.patch_size) // self.downsample_ratio

    def image_token_ids(self, image: ProcessedImage) -> list[int]:
        """The ids that replace one `<|image|>` placeholder for `image`."""
        rows, cols = image.aspect_ratio
        patches = [self.patch_id] * self.patches_per_tile(*image.pixel_values.shape[-2:])
        ids = [self.image_start_id]
        if rows * cols > 1:
            for _ in range(rows):
                for x in range(cols):
                    ids += patches
                    if x < cols - 1:
                        ids.append(self.tile_x_id)
                ids.append(self.tile_y_id)
        return ids + [self.image_id] + patches + [self.image_end_id]

    def expand_image_placeholders(self, prompt_token_ids: list[int],
                                  images: list[ProcessedImage]) -> tuple[list[int], list[ImagePlaceholder]]:
        """The prompt with its i-th `<|image|>` replaced by images[i]'s tokens, and where each landed."""
        positions = [i for i, t in enumerate(prompt_token_ids) if t == self.image_id]
        if len(positions) != len(images):
            raise ValueError(f"the prompt has {len(positions)} image placeholder(s) (<|image|>, id {self.image_id}) "
                             f"but {len(images)} image(s) were given: they must match one to one")
        out: list[int] = []
        placeholders = []
        start = 0
        for pos, image in zip(positions, images):
            out += prompt_token_ids[start:pos]
            expansion = self.image_token_ids(image)
            num_embeds = sum(1 for t in expansion if t == self.patch_id)
            placeholders.append(ImagePlaceholder(offset=len(out), length=len(expansion), num_embeds=num_embeds))
            out += expansion
            start = pos + 1
        out += prompt_token_ids[start:]
        return out, placeholders
