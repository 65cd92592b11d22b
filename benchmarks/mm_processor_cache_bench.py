"""What the processor cache saves on repeated images: the input side of a Llama-4 prompt with an
image (decode the base64 data URL a client sends, hash, process into 336-pixel tiles, expand the
placeholder), cache off (mm_processor_cache_gb=0) against on, Llama-4 Scout's processor settings.

    python benchmarks/mm_processor_cache_bench.py --out benchmarks/results/mm_processor_cache_cpu.json

Requests draw their image from a pool of --distinct images (--requests in all), so with the cache
on, all but the first sight of each image hit. Prints and writes one JSON.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.tiny import build_tokenizer  # noqa: E402
from moe.multimodal.processing import ImageProcessing  # noqa: E402

SPECIAL = ["<|begin_of_text|>", "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>",
           "<|tile_x_separator|>", "<|tile_y_separator|>"]
# Llama-4 Scout's preprocessor_config.json / processor_config.json (the hub files' values).
SCOUT_PREPROCESSOR = dict(size={"height": 336, "width": 336}, max_patches=16, resize_to_max_canvas=False,
                          image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], rescale_factor=1 / 255,
                          do_rescale=True, do_normalize=True, do_convert_rgb=True, do_resize=True, resample=2)
SCOUT_PROCESSOR = dict(patch_size=14, pixel_shuffle_ratio=0.5)


def model_folder() -> str:
    folder = tempfile.mkdtemp(prefix="mm_cache_bench_")
    tok = build_tokenizer(512)
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(folder, "tokenizer.json"))
    for name, cfg in (("preprocessor_config.json", SCOUT_PREPROCESSOR), ("processor_config.json", SCOUT_PROCESSOR)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(cfg, f)
    return folder


def photo_data_url(seed: int, height: int, width: int) -> str:
    """A smooth random picture (photo-like, so JPEG stays small) as a base64 JPEG data URL."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(height // 16, width // 16, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def run(folder: str, images: list[str], order: list[int], cache_gb: float, ids: list[int]) -> dict:
    proc = ImageProcessing(folder, _Tok(folder), image_limit=1, cache_gb=cache_gb)
    times = []
    for i in order:
        start = time.perf_counter()
        proc.process(ids, {"image": images[i]})
        times.append((time.perf_counter() - start) * 1e3)
    return {"mm_processor_cache_gb": cache_gb, "requests": len(order), "mean_ms": statistics.mean(times),
            "median_ms": statistics.median(times), "total_s": sum(times) / 1e3,
            "hits": proc.cache.hits, "queries": proc.cache.queries}


class _Tok:
    """The project's tokenizer wrapper over the folder's tokenizer.json."""

    def __new__(cls, folder: str):
        from moe.engine.tokenizer import Tokenizer
        return Tokenizer(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--distinct", type=int, default=8)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = model_folder()
    images = [photo_data_url(s, args.height, args.width) for s in range(args.distinct)]
    order = [int(i) for i in np.random.default_rng(0).integers(0, args.distinct, size=args.requests)]
    ids = _Tok(folder).encode("<|image|> what is in the picture?")
    run(folder, images, order[:2], 4.0, ids)  # warm-up (imports, first-call costs)
    off = run(folder, images, order, 0.0, ids)
    on = run(folder, images, order, 4.0, ids)
    result = {"host": platform.node(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "image_hw": [args.height, args.width], "distinct_images": args.distinct, "cache_off": off,
              "cache_on": on, "speedup": off["total_s"] / on["total_s"]}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
