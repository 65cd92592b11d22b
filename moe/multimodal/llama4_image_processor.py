"""Llama-4 image preprocessing: PIL images -> bf16 tiles for the vision tower, computing what
transformers' Llama4ImageProcessor (torchvision backend, CPU) computes, bit for bit, in pure torch.

Per image: convert to RGB (alpha composited on white) -> uint8 [3, H, W] -> pick the best canvas of
k x m tiles (k * m <= max_patches) -> resize without distortion into it (never upscaling past one
tile unless resize_to_max_canvas) -> zero-pad right/bottom to the canvas -> rescale and normalise
in bfloat16 -> split into row-major tiles -> when there is more than one tile, append a "global"
tile: the whole image squashed to one tile.

Legend: T tiles, C channels (3), H/W heights/widths in pixels, N batch of 1.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from moe.engine.tokenizer import read_json

# PIL resampling codes (what preprocessor_config.json stores) -> torch interpolate modes.
_RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}

DEFAULTS = dict(size={"height": 336, "width": 336}, max_patches=16, resize_to_max_canvas=False,
                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], rescale_factor=1 / 255, do_rescale=True,
                do_normalize=True, do_convert_rgb=True, resample=2, do_resize=True)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor       # [T, 3, tile, tile]; bf16; the global tile last when T > 1
    aspect_ratio: tuple[int, int]    # (ratio_h, ratio_w): the canvas in tiles

    @property
    def num_tiles(self) -> int:
        return self.pixel_values.shape[0]


def supported_canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """Every (height, width) canvas of k x m tiles with k * m <= max_tiles, in transformers' order:
    grouped by aspect ratio (groups in order of first appearance, walking tile counts downwards)."""
    by_ratio: dict[Fraction, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in (d for d in range(1, count + 1) if count % d == 0):
            by_ratio.setdefault(Fraction(rows, count // rows), []).append((rows, count // rows))
    return [(rows * tile, cols * tile) for group in by_ratio.values() for rows, cols in group]


def best_canvas(image_hw: tuple[int, int], canvases: list[tuple[int, int]], to_max_canvas: bool) -> tuple[int, int]:
    """The canvas to fit the image into. Each canvas allows a distortion-free scale (the limiting side's);
    prefer the smallest upscale (or the largest, to_max_canvas), else the mildest downscale; ties go
    to the smallest area, then the first listed. Computed in float32 torch as transformers does, so
    that ties break identically."""
    sizes_K2 = torch.tensor(canvases)
    scale_h = sizes_K2[:, 0] / image_hw[0]
    scale_w = sizes_K2[:, 1] / image_hw[1]
    scales = torch.minimum(scale_h, scale_w)
    up = scales[scales >= 1]
    if len(up):
        chosen = up.max() if to_max_canvas else up.min()
    else:
        chosen = scales[scales < 1].max()
    matching = sizes_K2[scales == chosen]
    best = matching[torch.argmin(matching[:, 0] * matching[:, 1])]
    return int(best[0]), int(best[1])


def fit_without_distortion(image_hw: tuple[int, int], bound_hw: tuple[int, int]) -> tuple[int, int]:
    """The largest size inside `bound_hw` with the image's aspect ratio (the limiting side exact, the other floored)."""
    (h, w), (bh, bw) = image_hw, bound_hw
    if bw / w < bh / h:
        return max(min(math.floor(h * (bw / w)), bh), 1), max(bw, 1)
    return max(bh, 1), max(min(math.floor(w * (bh / h)), bw), 1)


def native_uint8_resize_default(resample: int) -> bool:
    """torchvision resizes uint8 CPU images natively for bicubic, and for bilinear only when torch's
    CPU capability string contains "AVX2"; otherwise via float32 and rounding (results can differ by 1)."""
    return resample == 3 or "AVX2" in torch.backends.cpu.get_cpu_capability()


def _config_error(key: str, value, expected: str) -> ValueError:
    return ValueError(f"preprocessor config: {key}={value!r} is invalid, expected {expected}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _per_channel(key: str, value) -> list[float]:
    values = [value] * 3 if _is_number(value) else value
    if not isinstance(values, (list, tuple)) or len(values) != 3 or not all(_is_number(v) for v in values):
        raise _config_error(key, value, "a number or a list of 3 numbers")
    return [float(v) for v in values]


class Llama4ImageProcessor:
    def __init__(self, config: dict | None = None, native_uint8_resize: bool | None = None) -> None:
        """config: preprocessor_config.json's dict (unknown keys ignored, missing ones take transformers'
        defaults). native_uint8_resize: None follows torchvision on this host; True/False forces a path."""
        cfg = {**DEFAULTS, **{k: v for k, v in (config or {}).items() if k in DEFAULTS}}
        size = cfg["size"]
        if _is_number(size):
            size = {"height": size, "width": size}
        if not isinstance(size, dict) or set(size) != {"height", "width"} or not all(
                isinstance(size[k], int) and not isinstance(size[k], bool) and size[k] > 0 for k in size):
            raise _config_error("size", cfg["size"], "{'height': n, 'width': n} with positive integers")
        if size["height"] != size["width"]:
            raise _config_error("size", cfg["size"], "a square tile (height == width)")
        self.tile_size: int = size["height"]
        for key in ("resize_to_max_canvas", "do_rescale", "do_normalize", "do_convert_rgb", "do_resize"):
            if not isinstance(cfg[key], bool):
                raise _config_error(key, cfg[key], "true or false")
        if not cfg["do_resize"]:
            raise _config_error("do_resize", False, "true (Llama-4 always resizes to a canvas of tiles)")
        if not (isinstance(cfg["max_patches"], int) and not isinstance(cfg["max_patches"], bool)
                and cfg["max_patches"] >= 1):
            raise _config_error("max_patches", cfg["max_patches"], "a positive integer")
        if not (_is_number(cfg["rescale_factor"]) and cfg["rescale_factor"] > 0):
            raise _config_error("rescale_factor", cfg["rescale_factor"], "a positive number")
        if cfg["resample"] not in _RESAMPLE_MODES or isinstance(cfg["resample"], bool):
            raise _config_error("resample", cfg["resample"], "2 (bilinear) or 3 (bicubic)")
        self.image_mean = _per_channel("image_mean", cfg["image_mean"])
        self.image_std = _per_channel("image_std", cfg["image_std"])
        if not all(self.image_std):
            raise _config_error("image_std", cfg["image_std"], "non-zero values")
        if cfg["do_normalize"] and not cfg["do_rescale"]:
            # transformers cannot do it either (it normalises uint8 pixels, which torchvision refuses)
            raise _config_error("do_normalize", True, "false when do_rescale is false")
        self.max_patches: int = cfg["max_patches"]
        self.resize_to_max_canvas: bool = cfg["resize_to_max_canvas"]
        self.rescale_factor = float(cfg["rescale_factor"])
        self.do_rescale, self.do_normalize = cfg["do_rescale"], cfg["do_normalize"]
        self.do_convert_rgb: bool = cfg["do_convert_rgb"]
        self.resample: int = cfg["resample"]
        self.native_uint8_resize = (native_uint8_resize_default(self.resample) if native_uint8_resize is None
                                    else bool(native_uint8_resize))
        self.canvases = supported_canvases(self.max_patches, self.tile_size)

    @classmethod
    def from_pretrained(cls, folder: str, native_uint8_resize: bool | None = None) -> Llama4ImageProcessor:
        config = read_json(os.path.join(folder, "preprocessor_config.json"))  # {} when absent
        return cls(config, native_uint8_resize=native_uint8_resize)

    def processor_kwargs(self) -> dict:
        """The effective settings (everything the output depends on), JSON-serialisable."""
        return dict(size={"height": self.tile_size, "width": self.tile_size}, max_patches=self.max_patches,
                    resize_to_max_canvas=self.resize_to_max_canvas, image_mean=list(self.image_mean),
                    image_std=list(self.image_std), rescale_factor=self.rescale_factor, do_rescale=self.do_rescale,
                    do_normalize=self.do_normalize, do_convert_rgb=self.do_convert_rgb, resample=self.resample,
                    native_uint8_resize=self.native_uint8_resize)

    # ---- steps -------------------------------------------------------------------------------------

    def to_uint8_chw(self, image: Image.Image) -> torch.Tensor:
        """uint8 [3, H, W]; transparency (an alpha band or a palette/colour-key transparency) is
        composited onto white, other modes (L, P, CMYK, I;16, ...) converted by PIL."""
        if not isinstance(image, Image.Image):
            raise ValueError(f"expected a PIL image, got {type(image).__name__} (decode it with load_image first)")
        if image.width <= 0 or image.height <= 0:
            raise ValueError(f"the image has zero size ({image.width}x{image.height} pixels)")
        if self.do_convert_rgb:
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                image = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                image = image.convert("RGB")
        elif image.mode != "RGB":
            raise ValueError(f"the image is in mode {image.mode!r} but do_convert_rgb is false: only RGB images "
                             "can be processed without conversion")
        hwc = np.array(image)
        return torch.from_numpy(hwc).permute(2, 0, 1).contiguous()

    def resize(self, x_NCHW: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
        """Antialiased resize of uint8 pixels, as torchvision does it on the CPU (unchanged when the size is)."""
        if tuple(x_NCHW.shape[-2:]) == tuple(size_hw):
            return x_NCHW
        mode = _RESAMPLE_MODES[self.resample]
        if self.native_uint8_resize:
            return F.interpolate(x_NCHW, size=list(size_hw), mode=mode, align_corners=False, antialias=True)
        y = F.interpolate(x_NCHW.to(torch.float32), size=list(size_hw), mode=mode, align_corners=False,
                          antialias=True)
        if mode == "bicubic":
            y = y.clamp_(0, 255)
        return y.round_().to(torch.uint8)

    def rescale_and_normalize(self, x_NCHW: torch.Tensor) -> torch.Tensor:
        """In bfloat16 when both are on (as Llama-4's reference does): every op rounds to bf16, the
        rescale factor stays a float32 scalar, mean and std are bf16 tensors."""
        if self.do_rescale and self.do_normalize:
            x = x_NCHW.to(torch.bfloat16) * self.rescale_factor
            mean = torch.tensor(self.image_mean, dtype=torch.bfloat16).view(-1, 1, 1)
            std = torch.tensor(self.image_std, dtype=torch.bfloat16).view(-1, 1, 1)
            return x.sub(mean).div_(std)
        if self.do_rescale:
            return x_NCHW * self.rescale_factor  # float32, as transformers gives
        return x_NCHW

    def plan(self, image_hw: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """(canvas (H, W), resized image size (H, W)) for an image of `image_hw`."""
        canvas = best_canvas(image_hw, self.canvases, self.resize_to_max_canvas)
        bound = canvas
        if not self.resize_to_max_canvas:  # upscale at most to one tile's side
            bound = (min(max(image_hw[0], self.tile_size), canvas[0]), min(max(image_hw[1], self.tile_size), canvas[1]))
        return canvas, fit_without_distortion(image_hw, bound)

    def process_one(self, image: Image.Image) -> ProcessedImage:
        x_NCHW = self.to_uint8_chw(image)[None]
        image_hw = (x_NCHW.shape[-2], x_NCHW.shape[-1])
        canvas, new_hw = self.plan(image_hw)
        resized = self.resize(x_NCHW, new_hw)
        padded = F.pad(resized, (0, canvas[1] - new_hw[1], 0, canvas[0] - new_hw[0]), value=0)
        pixels = self.rescale_and_normalize(padded)[0]                      # [3, canvas_h, canvas_w]
        t = self.tile_size
        rows, cols = canvas[0] // t, canvas[1] // t
        tiles_TCHW = pixels.view(3, rows, t, cols, t).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, t, t)
        if rows * cols > 1:
            global_tile = self.rescale_and_normalize(self.resize(x_NCHW, (t, t)))
            tiles_TCHW = torch.cat([tiles_TCHW, global_tile])
        return ProcessedImage(pixel_values=tiles_TCHW.contiguous(), aspect_ratio=(rows, cols))

    def __call__(self, images: list[Image.Image]) -> list[ProcessedImage]:
        if isinstance(images, Image.Image):
            images = [images]
        return [self.process_one(image) for image in images]
