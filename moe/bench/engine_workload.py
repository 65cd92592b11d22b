"""Pieces `moe bench throughput` and `moe bench latency` share: the engine flags, random prompts
(vLLM's `--dataset-name random`: uniform token ids, with per-request lengths drawn as `moe bench
serve` draws them for --random-range-ratio) and writing the result JSON."""
from __future__ import annotations

import argparse
import json
import os
import platform
import random

import torch

from moe.bench.serve import sample_lengths
from moe.config import EngineArgs

DEFAULT_MODEL = "tiny-qwen3-moe"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine argument as vLLM spells it; --model defaults to the built-in tiny model."""
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:
        if action.dest == "model":
            action.required, action.default = False, DEFAULT_MODEL
            action.help = f"checkpoint folder, or {DEFAULT_MODEL!r} (default)"
        elif action.dest == "seed":
            action.help = "seed of the engine and of the random prompts (default: %(default)s)"


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The engine arguments of a parsed command line, as LLM(**kwargs) takes them."""
    return vars(EngineArgs.from_cli_args(args))


def random_token_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                          range_ratio: float = 0.0, prefix_len: int = 0) -> list[tuple[dict, int]]:
    """(prompt, output length) per request: the lengths drawn by moe.bench.serve.sample_lengths
    (`input_len` and `output_len` exactly when range_ratio is 0), then `prefix_len` uniform random
    token ids that begin every prompt (vLLM's --random-prefix-len: a shared prefix, which prefix
    caching reuses), then each prompt's own uniform random token ids below vocab_size, all from one
    random.Random(seed)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError(f"need num_prompts, input_len and output_len >= 1 and prefix_len >= 0, got {num_prompts}, "
                         f"{input_len}, {output_len} and {prefix_len}")
    rng = random.Random(seed)
    lengths = sample_lengths(rng, num_prompts, input_len, output_len, range_ratio)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [({"prompt_token_ids": prefix + [rng.randrange(vocab_size) for _ in range(n_in)]}, n_out)
            for n_in, n_out in lengths]


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    """`num_prompts` prompts of exactly `input_len` uniform random token ids."""
    return [p for p, _ in random_token_requests(num_prompts, input_len, 1, vocab_size, seed)]


def environment(engine_kwargs: dict) -> dict:
    """What a result JSON records about where it ran."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and engine_kwargs.get("device") != "cpu" \
        else platform.processor() or platform.machine()
    return {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads()}


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
